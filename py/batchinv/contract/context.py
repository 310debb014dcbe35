"""``deterministic_context``: the settings under which a strict fp32 reference runs.

Inside the context float32 matmuls and convolutions run in IEEE fp32 (no TF32, no bf16
splitting), autocast is off for CPU and CUDA, torch's deterministic-algorithms mode is on,
and the RNGs are seeded.  On exit every setting and every RNG state is put back as it
was, also when the body raised, so a test or a reference call leaves no trace.

Note on ``CUBLAS_WORKSPACE_CONFIG``: cuBLAS reads it when a handle is created, so setting
it here only helps handles created inside the context; a process that must be
deterministic from its first GEMM should export it before start-up.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = ["CUBLAS_WORKSPACE_CONFIG", "deterministic_context"]

CUBLAS_WORKSPACE_CONFIG = ":4096:8"

# torch >= 2.9 keeps the fp32 precision per backend and operator ("ieee", "tf32", "bf16",
# "none" = follow the legacy flag).  The legacy flags (allow_tf32, float32 matmul precision)
# are views of these; reading a legacy flag can raise when the two APIs were mixed, so the
# per-backend strings are what we save and restore when they exist.
_FP32_PRECISION_KNOBS = (
    ("cuda", "matmul"),
    ("cudnn", "conv"),
    ("cudnn", "rnn"),
    ("mkldnn", "matmul"),
    ("mkldnn", "conv"),
    ("mkldnn", "rnn"),
)


def _precision_knob(backend: str, op: str) -> object | None:
    module = getattr(torch.backends, backend, None)
    knob = getattr(module, op, None) if module is not None else None
    if knob is None:
        return None
    try:
        _ = knob.fp32_precision  # absent before torch 2.9
    except (AttributeError, RuntimeError):
        return None
    return knob


def _read(getter):
    """Reads a legacy flag; None where torch refuses to answer (mixed legacy/new API)."""
    try:
        return getter()
    except RuntimeError:
        return None


@dataclass
class _Snapshot:
    fp32_precision: dict[tuple[str, str], str] = field(default_factory=dict)
    cuda_matmul_allow_tf32: bool | None = None
    cudnn_allow_tf32: bool | None = None
    float32_matmul_precision: str | None = None
    cudnn_deterministic: bool = False
    cudnn_benchmark: bool = False
    deterministic_algorithms: bool = False
    deterministic_warn_only: bool = False
    cublas_workspace_config: str | None = None
    torch_rng: torch.Tensor | None = None
    cuda_rng: list[torch.Tensor] | None = None
    python_rng: object = None
    numpy_rng: object = None


def _take_snapshot() -> _Snapshot:
    snap = _Snapshot()
    for backend, op in _FP32_PRECISION_KNOBS:
        knob = _precision_knob(backend, op)
        if knob is not None:
            snap.fp32_precision[(backend, op)] = knob.fp32_precision
    snap.cuda_matmul_allow_tf32 = _read(lambda: torch.backends.cuda.matmul.allow_tf32)
    snap.cudnn_allow_tf32 = _read(lambda: torch.backends.cudnn.allow_tf32)
    snap.float32_matmul_precision = _read(torch.get_float32_matmul_precision)
    snap.cudnn_deterministic = torch.backends.cudnn.deterministic
    snap.cudnn_benchmark = torch.backends.cudnn.benchmark
    snap.deterministic_algorithms = torch.are_deterministic_algorithms_enabled()
    snap.deterministic_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    snap.cublas_workspace_config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    snap.torch_rng = torch.get_rng_state()
    if torch.cuda.is_available():
        snap.cuda_rng = torch.cuda.get_rng_state_all()
    snap.python_rng = random.getstate()
    snap.numpy_rng = np.random.get_state()
    return snap


def _restore(snap: _Snapshot) -> None:
    # torch >= 2.9 keeps three kinds of state: the legacy matmul-precision enum, the legacy
    # cuDNN bool, and the per-backend strings; the legacy setters also write strings.  So:
    # legacy values first (only those that were readable), then the strings, which win.
    # cuda.matmul.allow_tf32 is not written back: it would overwrite the enum ("medium"
    # would come back as "high"), and on new torch it is implied by the enum and strings.
    if snap.float32_matmul_precision is not None:
        torch.set_float32_matmul_precision(snap.float32_matmul_precision)
    if snap.cudnn_allow_tf32 is not None:
        torch.backends.cudnn.allow_tf32 = snap.cudnn_allow_tf32
    if not snap.fp32_precision and snap.cuda_matmul_allow_tf32 is not None:
        torch.backends.cuda.matmul.allow_tf32 = snap.cuda_matmul_allow_tf32
    for (backend, op), value in snap.fp32_precision.items():
        knob = _precision_knob(backend, op)
        if knob is not None:
            knob.fp32_precision = value
    torch.backends.cudnn.deterministic = snap.cudnn_deterministic
    torch.backends.cudnn.benchmark = snap.cudnn_benchmark
    torch.use_deterministic_algorithms(
        snap.deterministic_algorithms, warn_only=snap.deterministic_warn_only
    )
    if snap.cublas_workspace_config is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = snap.cublas_workspace_config
    torch.set_rng_state(snap.torch_rng)
    if snap.cuda_rng is not None:
        torch.cuda.set_rng_state_all(snap.cuda_rng)
    random.setstate(snap.python_rng)
    np.random.set_state(snap.numpy_rng)


def _apply_strict_settings(seed: int, warn_only: bool) -> None:
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for backend, op in _FP32_PRECISION_KNOBS:
        knob = _precision_knob(backend, op)
        if knob is not None:
            knob.fp32_precision = "ieee"
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    random.seed(seed)
    np.random.seed(seed)


@contextlib.contextmanager
def deterministic_context(seed: int = 0) -> Iterator[None]:
    """Strict fp32, no autocast, deterministic algorithms, seeded RNGs; all restored on exit.

    Settings applied: ``torch.backends.cuda.matmul.allow_tf32 = False``,
    ``torch.backends.cudnn.allow_tf32 = False``, float32 matmul precision ``"highest"``
    (and every per-backend ``fp32_precision`` set to ``"ieee"`` on torch versions that have
    it), ``torch.autocast(..., enabled=False)`` for ``"cpu"`` and ``"cuda"``,
    ``torch.use_deterministic_algorithms(True)`` keeping the caller's ``warn_only``,
    ``cudnn.deterministic = True`` and ``cudnn.benchmark = False``,
    ``CUBLAS_WORKSPACE_CONFIG=":4096:8"`` if unset, and ``torch``, ``torch.cuda`` (when
    available), ``random`` and ``numpy`` seeded with ``seed``.  Usable as a decorator too.
    """
    snap = _take_snapshot()
    try:
        _apply_strict_settings(seed, snap.deterministic_warn_only)
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.autocast("cpu", enabled=False))
            stack.enter_context(torch.autocast("cuda", enabled=False))
            yield
    finally:
        _restore(snap)

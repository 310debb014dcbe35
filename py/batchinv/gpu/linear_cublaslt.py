"""The large-M path of ``batchinv.linear`` on Hopper: cuBLASLt with ONE pinned algorithm, and
the switch that selects it.

Why it may serve a batch-invariant op: a study (``tools/study_cublaslt.py``; results in
``docs/tuning/linear.md``) found on an H200 that cuBLASLt's algorithm 66, pinned with split-K 1
and no reduction scheme, gives bitwise the same row whatever M (1 ... 8191) at every Qwen3-8B
shape, bf16 and fp16, and that its bits equal batchinv's own wgmma kernels' at M = 1, 64 and
4096 (measured, not documented by NVIDIA).  At large M it runs faster than batchinv's kernels.

The switch, ``BATCHINV_LINEAR_PATH`` (read once, at the first call that needs it) or
``batchinv.set_linear_path`` (which takes precedence):

- ``"auto"`` (the default): the pinned algorithm serves the products it is built for where it
  is usable and its self-check passed; elsewhere batchinv's kernels serve them, a
  ``RuntimeWarning`` says why (once per shape) and ``refusals()`` keeps the reason;
- ``"own"``: batchinv's kernels serve every product; cuBLASLt is never loaded;
- ``"cublaslt"``: the pinned algorithm serves every product it is built for, or the call
  raises ``RuntimeError`` with the reason (no sm_90 GPU, no usable libcublasLt, the algorithm
  refused for the shape, the self-check failed).  Nothing falls back silently.

The products it is built for: bf16/fp16 ``x[M, K] @ weight[N, K]ᵀ`` with ``M >= MIN_ROWS`` and
no bias (the forward and ``grad_x``); every other product takes batchinv's kernels under every
setting.  Each guard only decides which path runs, never what a row's bits are:
``cublasLtMatmulAlgoCheck`` must accept the pinned algorithm for the exact (M, N, K), and on
first use per (device, N, K, dtype) the self-check runs probes of ``PROBE_ROWS`` rows (random
rows plus rows of special values) through both the pinned algorithm and batchinv's kernel with
the caller's weight, bit for bit.  The decision is kept for the process, so within a process a
shape's rows always take one path or two paths checked to agree.
"""

from __future__ import annotations

import ctypes
import functools
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..runtime import uses_hopper
from .cublaslt import CublasLt, CublasLtError, find_cublaslt

MIN_ROWS = 1024
# The configuration the heuristic chose for every Qwen3-8B shape in the study:
# algorithm 66, tile 24 (N <= 6144) or 248 (N >= 24576), stages 35, custom option 7, cluster 5.
PINNED = {
    "algo_id": 66,
    "splitk_num": 1,
    "reduction_scheme": 0,
    "cta_swizzling": 0,
    "custom_option": 7,
    "stages_id": 35,
    "inner_shape_id": 0,
    "cluster_shape_id": 5,
}
WIDE_N = 16384  # from here on the heuristic picked the wider tile
TILES = {"narrow": 24, "wide": 248}
_PROBE_SEED = 20261126

# The self-check's probe batches: a multiple of every tile height, one 3 rows past it, and one
# whose residue (61 rows past a multiple of 256) is no power of two, so partial last tiles are
# compared too.  Its cost is bounded: these three products on each path, once per (device, N,
# K, dtype) and process, about 6.6 times the work of one MIN_ROWS-row product.
PROBE_ROWS = (MIN_ROWS, MIN_ROWS + 3, MIN_ROWS + 317)

PATHS = ("auto", "own", "cublaslt")
PATH_ENV = "BATCHINV_LINEAR_PATH"
LEGACY_ENV = "BATCHINV_LINEAR_CUBLASLT"  # the earlier switch: "0" is the same as "own"

_chosen: str | None = None  # set_path's value; None: the environment's


def validate_path(path: object, source: str = "the linear path") -> str:
    """``path`` if it names a path, else a ``ValueError`` that lists the choices."""
    if path not in PATHS:
        choices = ", ".join(repr(p) for p in PATHS)
        raise ValueError(f"{source} must be one of {choices}, got {path!r}")
    return path


@functools.cache
def path_from_environment() -> str:
    """``BATCHINV_LINEAR_PATH`` (default ``"auto"``), read and validated once per process."""
    value = os.environ.get(PATH_ENV)
    if value is not None:
        validate_path(value, PATH_ENV)
    legacy = os.environ.get(LEGACY_ENV)
    if legacy == "0":
        if value not in (None, "own"):
            raise ValueError(
                f"{LEGACY_ENV}=0 selects the 'own' path but {PATH_ENV}={value!r}; "
                f"unset {LEGACY_ENV} ({PATH_ENV} replaces it)"
            )
        return "own"
    return value or "auto"


def configured_path() -> str:
    """The switch's value: ``set_path``'s if set, else the environment's."""
    return _chosen if _chosen is not None else path_from_environment()


def set_path(path: str | None) -> None:
    """Selects the path for later calls (``None``: back to ``BATCHINV_LINEAR_PATH``)."""
    global _chosen
    _chosen = None if path is None else validate_path(path)


def pinned_label(n: int) -> str:
    """What the pinned path runs for ``N`` output columns, for benchmark and audit records."""
    tile = TILES["wide"] if n >= WIDE_N else TILES["narrow"]
    return (
        f"cuBLASLt algo {PINNED['algo_id']} tile {tile} stages {PINNED['stages_id']} "
        f"split-K {PINNED['splitk_num']}"
    )


@functools.cache
def _library(device_index: int) -> CublasLt:
    with torch.cuda.device(device_index):  # a cuBLASLt handle belongs to the current device
        return CublasLt(find_cublaslt())


@functools.cache
def _library_error(device_index: int) -> str | None:
    """Why no cuBLASLt handle can be made on this device (asked once), or None."""
    try:
        _library(device_index)
    except (ImportError, OSError, RuntimeError) as error:  # CublasLtError is a RuntimeError
        return f"libcublasLt is not usable ({error})"
    return None


@functools.cache
def _algorithm(device_index: int, n: int, dtype: torch.dtype):
    lt = _library(device_index)
    tile = TILES["wide"] if n >= WIDE_N else TILES["narrow"]
    return lt.pinned_algo({**PINNED, "tile_id": tile}, dtype)


@dataclass
class _Plan:
    """Descriptors and workspace of one (M, N, K, dtype); built once, reused by every call."""

    desc: ctypes.c_void_p
    layouts: list
    workspace_bytes: int


@functools.lru_cache(maxsize=256)
def _plan(device_index: int, m: int, n: int, k: int, dtype: torch.dtype) -> _Plan | None:
    lt = _library(device_index)
    status, workspace = lt.check(_algorithm(device_index, n, dtype), m, n, k, dtype)
    if status != 0:
        return None
    desc, layouts = lt.descriptors(m, n, k, dtype)
    return _Plan(desc, layouts, workspace)


def _run(x: Tensor, weight: Tensor, out: Tensor, plan: _Plan) -> Tensor:
    index = x.device.index
    # A fresh workspace from torch's stream-ordered allocator per call: two streams never
    # share one (the pinned algorithm asks for a few bytes, likely a tile-scheduler counter).
    nbytes = plan.workspace_bytes
    scratch = torch.empty(nbytes, dtype=torch.uint8, device=x.device) if nbytes else None
    _library(index).matmul(
        plan.desc,
        plan.layouts,
        _algorithm(index, weight.shape[0], x.dtype),
        x,
        weight,
        out,
        scratch,
        torch.cuda.current_stream(x.device).cuda_stream,
    )
    return out


def _aligned(t: Tensor) -> Tensor:
    return t if t.data_ptr() % 16 == 0 else t.clone()


# ---------------------------------------------------------------------------- the self-check


def special_rows(k: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Rows of special values that every probe carries at its start and its end: +0, -0,
    subnormals (alternating signs; mixed magnitudes), +inf, -inf, NaN, +inf with -inf, and
    half the largest finite value (overflow in the fp32 sum or in the final rounding)."""
    info = torch.finfo(dtype)
    subnormal = info.tiny * info.eps  # the smallest positive subnormal of dtype
    gen = torch.Generator(device=device).manual_seed(_PROBE_SEED + 1)
    noise = torch.randn(k, device=device, generator=gen)
    signs = 1.0 - 2.0 * (torch.arange(k, device=device) % 2)

    def with_values(**where: float) -> Tensor:
        row = noise.clone()
        for position, value in where.items():
            row[{"first": 0, "middle": k // 2, "last": k - 1}[position]] = value
        return row

    inf, nan = float("inf"), float("nan")
    rows = [
        torch.zeros(k, device=device),
        torch.full((k,), -0.0, device=device),
        signs * subnormal,
        noise * info.tiny,
        with_values(first=inf),
        with_values(middle=-inf),
        with_values(last=nan),
        with_values(first=inf, last=-inf),
        torch.full((k,), info.max / 2, device=device),
    ]
    return torch.stack(rows).to(dtype)


def probe(m: int, k: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """One self-check batch: seeded random rows, ``special_rows`` at the start and the end."""
    gen = torch.Generator(device=device).manual_seed(_PROBE_SEED)
    rows = torch.randn(m, k, device=device, generator=gen, dtype=dtype)
    special = special_rows(k, dtype, device)
    rows[: special.shape[0]] = special
    rows[m - special.shape[0] :] = special
    return rows


def _self_check(weight: Tensor, batchinv_matmul: Callable) -> str | None:
    """None if the pinned algorithm gives batchinv's bits on every probe, else what differed."""
    (n, k), dtype, device = weight.shape, weight.dtype, weight.device
    weight = _aligned(weight)
    for m in PROBE_ROWS:
        plan = _plan(device.index, m, n, k, dtype)
        if plan is None:
            return f"cublasLtMatmulAlgoCheck refuses the pinned algorithm for the {m}-row probe"
        rows = probe(m, k, dtype, device)
        ours = batchinv_matmul(rows, weight, family="hopper")
        theirs = _run(rows, weight, torch.empty(m, n, dtype=dtype, device=device), plan)
        if not torch.equal(ours.view(torch.int16), theirs.view(torch.int16)):
            return _difference(ours, theirs)
    return None


def _difference(ours: Tensor, theirs: Tensor) -> str:
    """How a probe's two results differ, NaN payloads told apart (the comparator counts two
    NaNs with different bits as different)."""
    ours_bits, theirs_bits = ours.view(torch.int16), theirs.view(torch.int16)
    differ = ours_bits != theirs_bits
    both_nan = differ & ours.isnan() & theirs.isnan()
    rows_differing = int(differ.any(dim=1).sum())
    detail = f"differing elements: {int(differ.sum())}"
    nan_pairs = int(both_nan.sum())
    if nan_pairs:
        index = both_nan.nonzero()[0]
        example = tuple(int(t[index[0], index[1]]) & 0xFFFF for t in (ours_bits, theirs_bits))
        detail += (
            f", {nan_pairs} of them NaN on both paths with other bits "
            f"(batchinv {example[0]:#06x}, cuBLASLt {example[1]:#06x})"
        )
    return (
        f"its bits differ from batchinv's kernels in {rows_differing} of the {ours.shape[0]} "
        f"rows of a self-check probe ({detail})"
    )


# ------------------------------------------------------------------------------ the decision

_CHECKED: dict[tuple[int, int, int, torch.dtype], str | None] = {}
_REFUSED: dict[tuple[int, int, int, torch.dtype], str] = {}


def refusals() -> dict[tuple[int, int, int, torch.dtype], str]:
    """(device, N, K, dtype) -> why the pinned path did not serve it under ``"auto"``."""
    return dict(_REFUSED)


def _refusal(m: int, weight: Tensor, batchinv_matmul: Callable) -> str | None:
    """Why the pinned algorithm cannot serve ``[m, K] @ weightᵀ`` here, or None if it can
    (running the self-check on first use per (device, N, K, dtype))."""
    (n, k), dtype, device = weight.shape, weight.dtype, weight.device
    if dtype not in (torch.bfloat16, torch.float16):
        return f"it takes bf16 or fp16, not {dtype}"
    if not uses_hopper(device):
        return "it needs an sm_90 GPU and a build with the sm_90a image"
    key = (device.index, n, k, dtype)
    if key not in _CHECKED and torch.cuda.is_current_stream_capturing():
        # Loading the library and the self-check synchronise, which a capture forbids.
        return "its self-check for this shape has not run (call once outside the capture)"
    error = _library_error(device.index)
    if error is not None:
        return error
    try:
        plan = _plan(device.index, m, n, k, dtype)
    except CublasLtError as error:
        return f"cuBLASLt cannot describe the product ({error})"
    if plan is None:
        return f"cublasLtMatmulAlgoCheck refuses the pinned algorithm for M = {m}"
    if key not in _CHECKED:
        _CHECKED[key] = _self_check(weight, batchinv_matmul)
    return _CHECKED[key]


def takes_pinned(m: int, weight: Tensor, path: str, batchinv_matmul: Callable) -> bool:
    """Whether a bias-free ``[m, K] @ weightᵀ`` runs on the pinned algorithm under ``path``.

    ``batchinv_matmul`` is batchinv's own kernel that the path must equal bit for bit
    (``batchinv.gpu.linear.matmul_nt``; passed in, since that module calls this one).
    ``"cublaslt"`` raises ``RuntimeError`` where the pinned algorithm cannot serve; ``"auto"``
    records the reason, warns once per shape and answers False."""
    if path == "own" or m < MIN_ROWS:
        return False
    if path == "auto" and not uses_hopper(weight.device):
        return False  # the pinned algorithm is an sm_90 choice; elsewhere there is no choice
    reason = _refusal(m, weight, batchinv_matmul)
    if reason is None:
        return True
    (n, k), dtype, device = weight.shape, weight.dtype, weight.device
    where = f"M = {m}, N = {n}, K = {k}, {dtype} on cuda:{device.index}"
    if path == "cublaslt":
        raise RuntimeError(
            f"batchinv.linear: the path is 'cublaslt' ({PATH_ENV} or batchinv.set_linear_path) "
            f"but cuBLASLt's pinned algorithm cannot serve {where}: {reason}"
        )
    key = (device.index, n, k, dtype)
    if key not in _REFUSED:
        warnings.warn(
            f"batchinv.linear: cuBLASLt's pinned algorithm cannot serve {where}: {reason}; "
            "batchinv's own kernels serve it (path 'auto')",
            RuntimeWarning,
            stacklevel=4,
        )
    _REFUSED[key] = reason
    return False


def matmul_nt(x: Tensor, weight: Tensor, out: Tensor) -> Tensor:
    """``out = x @ weightᵀ`` with the pinned algorithm; call only where ``takes_pinned`` said
    yes, with 16-byte aligned tensors."""
    plan = _plan(x.device.index, x.shape[0], weight.shape[0], x.shape[1], x.dtype)
    return _run(x, weight, out, plan)

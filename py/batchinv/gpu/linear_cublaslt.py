"""The large-M path of ``batchinv.linear`` on Hopper: cuBLASLt with ONE pinned algorithm.

Why it may serve a batch-invariant op: a study (``tools/study_cublaslt.py``; results in
``docs/tuning/linear.md``) found on an H200 that cuBLASLt's algorithm 66, pinned with split-K 1
and no reduction scheme, gives bitwise the same row whatever M (1 ... 8191) at every Qwen3-8B
shape, bf16 and fp16, and that its bits equal batchinv's own wgmma kernels' at M = 1, 64 and
4096 (measured, not documented by NVIDIA).  At large M it runs faster than batchinv's kernels.
So batches of at least ``MIN_ROWS`` rows take it, smaller ones take batchinv's kernels, and a
row's bits are the same either way.

Nothing here is trusted blindly; each guard only decides whether the pinned path is used, never
what a row's bits are:
- sm_90 GPUs only, no bias, bf16/fp16, and ``cublasLtMatmulAlgoCheck`` must accept the pinned
  algorithm for the exact (M, N, K);
- on first use per (device, N, K, dtype), a ``MIN_ROWS``-row random probe goes through both
  the pinned algorithm and batchinv's own kernel and must agree bit for bit; if not, the pinned
  path is off for that shape (a ``RuntimeWarning`` says so) and batchinv's kernels serve all M;
- ``BATCHINV_LINEAR_CUBLASLT=0`` turns the path off.
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


def enabled() -> bool:
    return os.environ.get("BATCHINV_LINEAR_CUBLASLT", "1") != "0"


@functools.cache
def _library(device_index: int) -> CublasLt:
    with torch.cuda.device(device_index):  # a cuBLASLt handle belongs to the current device
        return CublasLt(find_cublaslt())


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


_CHECKED: dict[tuple[int, int, int, torch.dtype], bool] = {}


def _agrees_with_batchinv(weight: Tensor, batchinv_matmul: Callable) -> bool:
    """The first-use self-check per (device, N, K, dtype): a random probe through both paths
    with this weight, bit for bit."""
    n, k = weight.shape
    key = (weight.device.index, n, k, weight.dtype)
    if key not in _CHECKED:
        _CHECKED[key] = _self_check(weight, batchinv_matmul)
    return _CHECKED[key]


def _self_check(weight: Tensor, batchinv_matmul: Callable) -> bool:
    (n, k), dtype, device = weight.shape, weight.dtype, weight.device
    gen = torch.Generator(device=device).manual_seed(_PROBE_SEED)
    probe = torch.randn(MIN_ROWS, k, device=device, generator=gen).to(dtype)
    plan = _plan(device.index, MIN_ROWS, n, k, dtype)
    if plan is None:
        return False
    ours = batchinv_matmul(probe, weight, family="hopper")
    theirs = _run(probe, weight, torch.empty_like(ours), plan)
    bits = torch.int16
    same = bool(torch.equal(ours.view(bits), theirs.view(bits)))
    if not same:
        warnings.warn(
            f"batchinv.linear: cuBLASLt's pinned algorithm does not give batchinv's bits for "
            f"N={n}, K={k}, {dtype} on {torch.cuda.get_device_name(device)}; batchinv's own "
            "kernels serve every batch size for this shape",
            RuntimeWarning,
            stacklevel=3,
        )
    return same


def serves(
    x: Tensor, weight: Tensor, bias: Tensor | None, out: Tensor, batchinv_matmul: Callable
) -> bool:
    """Whether ``x @ weightᵀ`` may take the pinned path (the caller checked sm_90 and dtypes).
    ``batchinv_matmul`` is batchinv's own kernel that the path must equal bit for bit
    (``batchinv.gpu.linear.matmul_nt``; passed in, since that module calls this one)."""
    m, k = x.shape
    n = weight.shape[0]
    if not enabled() or bias is not None or m < MIN_ROWS:
        return False
    if any(t.data_ptr() % 16 for t in (x, weight, out)):
        return False
    try:
        if _plan(x.device.index, m, n, k, x.dtype) is None:
            return False
        return _agrees_with_batchinv(weight, batchinv_matmul)
    except (OSError, RuntimeError, CublasLtError):  # no usable libcublasLt: batchinv's kernels
        return False


def matmul_nt(x: Tensor, weight: Tensor, out: Tensor) -> Tensor:
    """``out = x @ weightᵀ`` with the pinned algorithm; call only where ``serves`` said yes."""
    plan = _plan(x.device.index, x.shape[0], weight.shape[0], x.shape[1], x.dtype)
    return _run(x, weight, out, plan)

"""Tile-mode attention forward on Hopper: launches ``kernels_cu/attention_hopper.cu``.

The kernel computes exactly the per-row arithmetic of ``kernels_cu/attention.cu``'s tile kernel
(same 64-key blocks, 1024-key splits, merge and finalize; see both headers) with the
FlashAttention-3 structure: a TMA producer warpgroup and two or three wgmma consumer
warpgroups of 64 rows each (128- or 192-row tiles; :func:`warpgroups_for`), in a persistent
grid (one CTA per SM taking work items from a queue, a counter zeroed for each launch).
``batchinv.gpu.attention.forward`` calls it for tile launches on sm_90 devices when
:func:`applies` holds; every kernel gives the same bits (tested).
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from ._launch import allow_dynamic_shared, kernel_for, launch, multiprocessors, native, uses_hopper

HEAD_DIM = 128
WARPGROUPS = 2  # consumer warpgroups of the long-sequence kernel (3: the ``_wg3`` kernel)
# The ``_wg3`` kernel (3 consumer warpgroups, 192-row tiles) runs calls whose longest query AND
# key lengths are at most this (session 8, NVIDIA H200, causal GQA 32/8: 4-7% faster at 32 x
# 2048 and 128 x 1024, but 1.8-5.6% slower at 8 x 4096, where the steady softmax dominates and
# stays latency-bound per warp; docs/operators/attention.md).  A function of the call's shape
# only (never of the SM count), and both kernels give the same bits: it changes speed only.
WG3_MAX_LEN = 2048
STAGES = 3  # K/V ring depth (kernels_cu/attention_hopper.cu kStages)
_BOX_BYTES = 64 * 64 * 2  # one 64-row x 64-column TMA box of bf16/fp16
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "f16"}
_MAX_ITEMS = 2**31 - 1 - 1024  # the queue counter is an int32 (each CTA takes one past the end)


def shared_bytes(stages: int = STAGES, warpgroups: int = WARPGROUPS) -> int:
    """Dynamic shared memory of the kernel: Q (warpgroups x two 64-column halves), the K and V
    stages, the fp32 running state (64 values per consumer thread; with 3 warpgroups it lives
    in global scratch, :func:`run_scratch_floats`), the mbarriers (K/V ring, boundary block,
    work-item ring), and 1024 bytes to align the swizzled tiles."""
    q = warpgroups * 2 * _BOX_BYTES
    kv = 2 * stages * 2 * _BOX_BYTES
    run = 64 * 256 * 4 if warpgroups == 2 else 0
    barriers = 8 * (2 * stages + 1 + 4)
    return q + kv + run + barriers + 1024


def warpgroups_for(max_q_len: int, max_k_len: int) -> int:
    """Consumer warpgroups of the kernel that runs a call with these longest query and key
    lengths (``WG3_MAX_LEN``), unless a test forces one (:func:`forced_warpgroups`)."""
    if _forced_warpgroups is not None:
        return _forced_warpgroups
    return 3 if max(max_q_len, max_k_len) <= WG3_MAX_LEN else 2


def run_scratch_floats(ctas: int) -> int:
    """fp32 scratch of the 3-warpgroup kernel: per CTA and consumer thread, the running acc
    (64), m and l (2 + 2) and the two -0 masks of a pending product (kernel's Shape::kRunSlots)."""
    return ctas * 70 * 384


def _tma_rows(t: Tensor) -> bool:
    """``t [rows, H, d]`` readable as a 2-D TMA map ``[rows, H * d]``: heads contiguous within a
    row, 16-byte aligned base and row stride, at least one row."""
    return (
        t.shape[0] > 0
        and t.stride(2) == 1
        and t.stride(1) == t.shape[2]
        and t.stride(0) % 8 == 0
        and t.data_ptr() % 16 == 0
    )


def applies(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether the Hopper kernel takes this tile launch (d = 128, an sm_90a device, K and V
    readable by TMA); otherwise the mma.sync tile kernel runs (same bits)."""
    return (
        q.shape[-1] == HEAD_DIM
        and q.dtype in _DTYPE_NAMES
        and uses_hopper(q.device)
        and _tma_rows(k)
        and _tma_rows(v)
    )


def _tensor_map(t: Tensor) -> bytes:
    """TMA map of ``t [rows, H, d]`` as ``rows x (H * d)``, boxes of 64 rows x 64 columns."""
    rows, heads, d = t.shape
    name = _DTYPE_NAMES[t.dtype]
    return native().tensor_map_2d(t.data_ptr(), name, rows, heads * d, t.stride(0) * 2, 64, 64, 128)


_forced_ctas: int | None = None
_forced_warpgroups: int | None = None


@contextlib.contextmanager
def forced_warpgroups(count: int):
    """Tests and benchmarks: launches within the block run the kernel with ``count`` consumer
    warpgroups (2: 128-row tiles; 3: the ``_wg3`` kernel, 192-row tiles) whatever the shape
    (:func:`warpgroups_for`), so that tests run both kernels on every case. Same bits."""
    global _forced_warpgroups
    if isinstance(count, bool) or not isinstance(count, int):
        raise TypeError(f"count must be an int, got {type(count).__name__}")
    if count not in (2, 3):
        raise ValueError(f"count must be 2 or 3, got {count}")
    previous, _forced_warpgroups = _forced_warpgroups, count
    try:
        yield
    finally:
        _forced_warpgroups = previous


@contextlib.contextmanager
def forced_ctas(count: int):
    """Tests: launches within the block use at most ``count`` CTAs, so that each CTA takes
    many work items from the queue (the bits must not change)."""
    global _forced_ctas
    if isinstance(count, bool) or not isinstance(count, int):
        raise TypeError(f"count must be an int, got {type(count).__name__}")
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    previous, _forced_ctas = _forced_ctas, count
    try:
        yield
    finally:
        _forced_ctas = previous


def _kernel(name: str, device: torch.device, stages: int, warpgroups: int):
    kernel = kernel_for("attention_hopper", name, device)
    allow_dynamic_shared(kernel, shared_bytes(stages, warpgroups), device.index or 0)
    return kernel


def forward_tile(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    layout,
    causal: bool,
    scale_log2: float,
    pack: int,
) -> None:
    """Writes ``out``/``lse`` of every covered row (the canonical layout of
    ``batchinv.gpu.attention``; ``q``, ``k``, ``v`` already pass :func:`applies`)."""
    tq, hq, _ = q.shape
    hkv = k.shape[1]
    warpgroups = warpgroups_for(layout.max_q_len, layout.max_k_len)
    qpt = 64 * warpgroups // pack
    q_tiles = -(-layout.max_q_len // qpt)
    items = q_tiles * (hq // pack) * layout.batch
    if items > _MAX_ITEMS:
        raise ValueError(
            f"attention launch too large: {items} work items (query tiles x head groups x "
            f"sequences; at most {_MAX_ITEMS})"
        )
    if items == 0:
        return
    suffix = "_wg3" if warpgroups == 3 else ""
    name = f"attn_hopper_fwd_{_DTYPE_NAMES[q.dtype]}_d{HEAD_DIM}{suffix}"
    # Persistent grid: one CTA per SM (at most one per item) takes the items from a queue; which
    # CTA computes a row never changes its arithmetic.
    ctas = min(items, _forced_ctas or multiprocessors(q.device.index or 0))
    # The counter (+0), then each CTA's two-slot ring of taken items (written before read).
    queue = torch.zeros(1 + 2 * ctas, dtype=torch.int32, device=q.device)
    # 3 warpgroups: the split running state in global scratch (each slot written before read).
    extra = ()
    if warpgroups == 3:
        extra = (torch.empty(run_scratch_floats(ctas), dtype=torch.float32, device=q.device),)
    launch(
        _kernel(name, q.device, STAGES, warpgroups),
        q.device,
        grid=(ctas,),
        block=(128 * (warpgroups + 1),),
        args=(
            _tensor_map(k),
            _tensor_map(v),
            q,
            out,
            lse,
            layout.q_start,
            layout.q_len,
            layout.k_start,
            layout.k_len,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            tq,
            hq,
            hkv,
            pack,
            int(causal),
            scale_log2,
            queue,
            q_tiles,
            layout.batch,
            *extra,
        ),
        shared_mem=shared_bytes(STAGES, warpgroups),
    )

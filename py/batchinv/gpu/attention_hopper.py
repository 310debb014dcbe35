"""Tile-mode attention forward on Hopper: launches ``kernels_cu/attention_hopper.cu``.

The kernel computes exactly the per-row arithmetic of ``kernels_cu/attention.cu``'s tile kernel
(same 128-key blocks, 2048-key splits, merge and finalize; see both headers) with the
FlashAttention-3 structure: a TMA producer warpgroup and two wgmma consumer warpgroups of 64
rows each (128-row tiles), in a persistent grid (one CTA per SM taking work items from a
queue, a counter zeroed for each launch).  Head dims 64 and 128: a row of Q, K or V is d / 64
swizzled 64-column halves (one TMA box each per 128-key block).
``batchinv.gpu.attention.forward`` calls it for tile launches on sm_90 devices when
:func:`applies` holds; every kernel gives the same bits (tested).
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from ..runtime import (
    allow_dynamic_shared,
    kernel_for,
    launch,
    multiprocessors,
    tensor_map_2d,
    uses_hopper,
)

HEAD_DIMS = frozenset((64, 128))
WARPGROUPS = 2  # consumer warpgroups (64 rows each: 128-row tiles)
BLOCK_KEYS = 128  # keys per block: the contract's (attention.BLOCK_KEYS; tested equal)
# K and V ring depth, each, at both head dims (kernels_cu/attention_hopper.cu kRingStages; deeper
# rings were no faster at d = 64: docs/tuning/attention.md)
STAGES = 2
_Q_HALF_BYTES = 64 * 64 * 2  # 64 query rows x 64 columns of bf16/fp16
_KV_HALF_BYTES = BLOCK_KEYS * 64 * 2  # one TMA box: 128 key rows x 64 columns
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "f16"}
_MAX_ITEMS = 2**31 - 1 - 1024  # the queue counter is an int32 (each CTA takes one past the end)


def shared_bytes(head_dim: int = 128) -> int:
    """Dynamic shared memory of the kernel at ``head_dim`` (64 or 128): Q (two warpgroups x
    d / 64 column halves), the ``STAGES`` K and V stages (d / 64 boxes of 128 keys x
    64 columns each), the fp32 running state (d / 2 values per consumer thread), the mbarriers
    (full / empty of both rings, boundary block, work-item ring), and 1024 bytes to align the
    swizzled tiles."""
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {sorted(HEAD_DIMS)}, got {head_dim!r}")
    halves = head_dim // 64
    q = WARPGROUPS * halves * _Q_HALF_BYTES
    kv = 2 * STAGES * halves * _KV_HALF_BYTES
    run = head_dim // 2 * 128 * WARPGROUPS * 4
    barriers = 8 * (4 * STAGES + 1 + 4)
    return q + kv + run + barriers + 1024


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
    """Whether the Hopper kernel takes this tile launch (d = 64 or 128, an sm_90a device, K and
    V readable by TMA); otherwise the mma.sync tile kernel runs (same bits)."""
    return (
        q.shape[-1] in HEAD_DIMS
        and q.dtype in _DTYPE_NAMES
        and uses_hopper(q.device)
        and _tma_rows(k)
        and _tma_rows(v)
    )


def _tensor_map(t: Tensor) -> bytes:
    """TMA map of ``t [rows, H, d]`` as ``rows x (H * d)``, boxes of 128 rows (one key block)
    x 64 columns (the kernel loads d / 64 boxes per block)."""
    rows, heads, d = t.shape
    name = _DTYPE_NAMES[t.dtype]
    stride = t.stride(0) * 2
    return tensor_map_2d(
        t.data_ptr(), name, rows, heads * d, stride, BLOCK_KEYS, 64, 128, t.device.index
    )


_forced_ctas: int | None = None


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


def kernel_name(dtype: torch.dtype, head_dim: int) -> str:
    """The entry of ``attention_hopper.cu`` for ``dtype`` and ``head_dim``."""
    return f"attn_hopper_fwd_{_DTYPE_NAMES[dtype]}_d{head_dim}"


def _kernel(name: str, device: torch.device, head_dim: int):
    kernel = kernel_for("attention_hopper", name, device)
    allow_dynamic_shared(kernel, shared_bytes(head_dim), device.index or 0)
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
    tq, hq, d = q.shape
    hkv = k.shape[1]
    qpt = 64 * WARPGROUPS // pack
    q_tiles = -(-layout.max_q_len // qpt)
    items = q_tiles * (hq // pack) * layout.batch
    if items > _MAX_ITEMS:
        raise ValueError(
            f"attention launch too large: {items} work items (query tiles x head groups x "
            f"sequences; at most {_MAX_ITEMS})"
        )
    if items == 0:
        return
    name = kernel_name(q.dtype, d)
    # Persistent grid: one CTA per SM (at most one per item) takes the items from a queue; which
    # CTA computes a row never changes its arithmetic.
    ctas = min(items, _forced_ctas or multiprocessors(q.device.index or 0))
    # The counter (+0), then each CTA's two-slot ring of taken items (written before read).
    queue = torch.zeros(1 + 2 * ctas, dtype=torch.int32, device=q.device)
    launch(
        _kernel(name, q.device, d),
        q.device,
        grid=(ctas,),
        block=(128 * (WARPGROUPS + 1),),
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
        ),
        shared_mem=shared_bytes(d),
    )

"""Attention backward on CUDA: launches ``kernels_cu/attention_backward.cu``.

``backward(q, k, v, out, lse, grad_out, q_start, q_len, k_start, k_len, max_q_len, max_k_len,
causal, scale) -> (dq, dk, dv)`` on the canonical layout of the forward: ``q, out, grad_out
[Tq, Hq, d]``, ``k, v [Tk, Hkv, d]`` (contiguous, one dtype: bf16 or fp16), ``lse [Hq, Tq]``
fp32 natural log, int32 ``q_start, q_len, k_start, k_len [B]`` on the same GPU.  Query ``i``
of sequence ``b`` is row ``q_start[b] + i`` at absolute position ``k_len[b] - q_len[b] + i``;
its keys are rows ``k_start[b] + j``, ``j < k_len[b]`` (causal: ``j <=`` the position).

Three launches (see the kernel file for the formula and the invariance contract): ``delta =
rowsum(dO * O)``, then dK/dV (one CTA per sequence, kv head and 64 absolute key positions) and
dQ (one CTA per sequence, query head and 128 queries of the sequence; 64 in the 16-row
variants).  The grids grow with the batch; a sequence's arithmetic does not.  Rows covered by
no sequence get zero gradients.  On an sm_90 device with the sm_90a image, the "tiled"
variant's dK/dV launch at d = 128 is a wgmma kernel (two warpgroups per 128 keys, each doing
``_wide``'s work for its 64 keys) that gives the bits of its mma.sync kernel ``_wide`` (tested;
``USE_WGMMA_DKDV = False`` forces ``_wide``), and its dQ launch a wgmma kernel (one warpgroup
per 64 queries) that gives the bits of ``_tiled`` (tested; ``USE_WGMMA_DQ = False`` forces
``_tiled``).

One host synchronisation per call: the lengths are read once to check that every sequence's
rows lie inside the tensors, fit ``max_q_len`` / ``max_k_len``, and do not overlap another
sequence's rows (each gradient row has one owner: no atomics).  ``ranges_checked=True`` skips
that read, for the ranges of a ``batchinv.gpu.attention.Layout`` built from lengths that passed
the forward's checks (it owns its tensors, so nobody can have edited them since): the autograd
backward runs with no host synchronisation.  Tensors from anywhere else are always checked.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable

import torch
from torch import Tensor

from ..runtime import allow_dynamic_shared, kernel_for, launch, uses_hopper
from ..validation import check_same_device, check_same_dtype, check_tensor

# Keep in step with kernels_cu/attention_backward.cu.
SUPPORTED_HEAD_DIMS = (64, 128)
THREADS = 128  # delta kernel and the 16-row and "tiled" kernels
KEY_BLOCK = 64  # 16-row variants: keys per dK/dV CTA and per dQ step, at absolute positions
DQ_QUERY_ROWS = 64  # 16-row variants: query rows per dQ CTA
WIDE_KEYS = 64  # "tiled" dK/dV (kernel "_wide"): keys per CTA, 8 warps
WIDE_KV_ROWS = 64  # "tiled" dK/dV: queries per step
WIDE_THREADS = 256
TILED_DQ_ROWS = 128  # "tiled" dQ: query rows per CTA (4 warps of 32)
TILED_DQ_KEYS = 32  # "tiled" dQ: keys per step
_PAD = 8  # shared-memory row padding, elements
WGMMA_HEAD_DIMS = (64, 128)  # the head dims the wgmma kernels (sm_90a) exist for
WGMMA_THREADS = 128  # one warpgroup
# "tiled" dK/dV on sm_90a ("_wgmma_pair"), the `_wide` kernel's bits: two warpgroups per CTA,
# 128 keys (64 per warpgroup), one copy of each step's Q / dO / lse / delta shared by both.
WGMMA_PAIR_KEYS = 128
WGMMA_PAIR_THREADS = 256
# Tests and the benchmark only: False forces the `_wide` dK/dV kernel where the wgmma one would
# run (same bits).
USE_WGMMA_DKDV = True
# "tiled" dQ on sm_90a ("_wgmma"): one warpgroup per 64 queries, the `_tiled` kernel's bits.
WGMMA_DQ_ROWS = 64
# Tests and the benchmark only: False forces the `_tiled` dQ kernel (same bits).
USE_WGMMA_DQ = True
_FLOAT_BYTES = 4

# How tiles reach the mma, per variant: (dK/dV kernel, dQ kernel).  "tiled" (default): the
# dK/dV kernel "_wide" (8 warps with 32-row warp tiles, P^T / dS^T through shared memory, two
# CTAs per SM) and the dQ kernel "_tiled" (4 warps of 32 query rows, cp.async double
# buffering).  "async": 16-row warp tiles, cp.async double buffering + ldmatrix; "ldsm": plain
# global loads + ldmatrix; "lds": plain loads throughout.  Same arithmetic for every element
# (tested bitwise); speed differs.
_KERNELS = {
    "tiled": ("wide", "tiled"),
    "async": ("async", "async"),
    "ldsm": ("ldsm", "ldsm"),
    "lds": ("lds", "lds"),
}
VARIANTS = tuple(_KERNELS)
# Kernels whose grid is (heads, B, blocks): the heaviest causal blocks of every sequence first.
_HEAVY_FIRST = ("wide", "tiled")
KERNEL_VARIANT = "tiled"

_DTYPES = (torch.bfloat16, torch.float16)
_SUFFIX = {torch.bfloat16: "bf16", torch.float16: "f16"}
_MAX_GRID_YZ = 65535
_MAX_GRID_X = 2**31 - 1


def delta_lanes(head_dim: int) -> int:
    """Threads per (query row, head) of the delta kernel: 8 elements each (kDeltaLanes)."""
    return head_dim // 8


def kv_query_rows(head_dim: int) -> int:
    """Query rows per step of the 16-row dK/dV kernels (speed only; the kernel's KvQueryRows)."""
    return 32 if head_dim >= 128 else 64


def _tile_bytes(head_dim: int, rows: int) -> int:
    return rows * (head_dim + _PAD) * 2


def _buffers(kernel: str) -> int:
    return 2 if kernel in ("async", "tiled") else 1


def dkdv_shared_bytes(head_dim: int, variant: str) -> int:
    """K and V tiles, then per buffer the Q and dO tiles and the rows' lse and delta ("_wide"
    kernel: one buffer, plus the P^T and dS^T tiles)."""
    kernel = _KERNELS[variant][0]
    if kernel == "wide":
        per_step = 2 * _tile_bytes(head_dim, WIDE_KV_ROWS) + 2 * WIDE_KV_ROWS * _FLOAT_BYTES
        scores = 2 * WIDE_KEYS * (WIDE_KV_ROWS + _PAD) * 2
        return 2 * _tile_bytes(head_dim, WIDE_KEYS) + per_step + scores
    rows = kv_query_rows(head_dim)
    per_buffer = 2 * _tile_bytes(head_dim, rows) + 2 * rows * _FLOAT_BYTES
    return 2 * _tile_bytes(head_dim, KEY_BLOCK) + _buffers(kernel) * per_buffer


def dq_shared_bytes(head_dim: int, variant: str) -> int:
    """Q and dO tiles, per buffer the K and V tiles, and the rows' lse and delta."""
    kernel = _KERNELS[variant][1]
    rows, keys = (TILED_DQ_ROWS, TILED_DQ_KEYS) if kernel == "tiled" else (DQ_QUERY_ROWS, KEY_BLOCK)
    return (
        _buffers(kernel) * 2 * _tile_bytes(head_dim, keys)
        + 2 * _tile_bytes(head_dim, rows)
        + 2 * rows * _FLOAT_BYTES
    )


def _wgmma_tile_bytes(head_dim: int) -> int:
    """A 64-row tile of the wgmma kernels: 64 x d elements of 2 bytes (128-byte-swizzled)."""
    return 64 * head_dim * 2


def wgmma_pair_shared_bytes(head_dim: int) -> int:
    """The pair dK/dV kernel's shared memory: K and V of each warpgroup, two buffers of Q and
    dO, two of lse and delta (64 floats each), a full and an empty mbarrier (8 bytes) per
    buffer, 1024 bytes of alignment (one CTA per SM)."""
    return 8 * _wgmma_tile_bytes(head_dim) + 2 * (2 * 64 * _FLOAT_BYTES + 2 * 8) + 1024


def wgmma_dq_shared_bytes(head_dim: int) -> int:
    """The wgmma dQ kernel's shared memory: Q, dO, one buffer of K and V, 1024 bytes to align
    them (three CTAs per SM)."""
    return 4 * _wgmma_tile_bytes(head_dim) + 1024


def _uses_wgmma(q: Tensor, variant: str | None, switch: bool) -> bool:
    """The condition both wgmma kernels share: the "tiled" variant, d = 64 or 128, an sm_90
    device with the sm_90a image, and the kernel's own switch (passed in, read at call time so
    that a test can turn one kernel off)."""
    return (
        (variant or KERNEL_VARIANT) == "tiled"
        and switch
        and q.shape[-1] in WGMMA_HEAD_DIMS
        and uses_hopper(q.device)
    )


def dkdv_uses_wgmma(q: Tensor, variant: str | None = None) -> bool:
    """Whether the dK/dV launch for ``q`` takes the sm_90a wgmma kernel (``_wgmma_pair``, two
    warpgroups): the "tiled" variant, d = 64 or 128, an sm_90 device with the sm_90a image, and
    ``USE_WGMMA_DKDV``."""
    return _uses_wgmma(q, variant, USE_WGMMA_DKDV)


def dq_uses_wgmma(q: Tensor, variant: str | None = None) -> bool:
    """Whether the dQ launch for ``q`` takes the sm_90a wgmma kernel: the "tiled" variant,
    d = 64 or 128, an sm_90 device with the sm_90a image, and ``USE_WGMMA_DQ``."""
    return _uses_wgmma(q, variant, USE_WGMMA_DQ)


def _geometry(variant: str) -> dict[str, int]:
    """Keys per dK/dV CTA and its threads, query rows per dQ CTA and its threads."""
    kv, dq = _KERNELS[variant]
    return {
        "keys": WIDE_KEYS if kv == "wide" else KEY_BLOCK,
        "kv_threads": WIDE_THREADS if kv == "wide" else THREADS,
        "rows": TILED_DQ_ROWS if dq == "tiled" else DQ_QUERY_ROWS,
        "dq_threads": THREADS,
    }


# ----------------------------------------------------------------------------- validation


def _check_length_arg(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return int(value)


def _check_aligned(name: str, t: Tensor) -> None:
    if t.data_ptr() % 16 != 0:
        raise ValueError(
            f"{name} must start at a 16-byte aligned address (the kernel loads 16-byte "
            f"vectors); got a view at offset {t.storage_offset()} elements: pass a fresh "
            ".contiguous() copy"
        )


def check_backward_args(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    grad_out: Tensor,
    q_start: Tensor,
    q_len: Tensor,
    k_start: Tensor,
    k_len: Tensor,
    max_q_len: int,
    max_k_len: int,
    causal: bool,
    scale: float,
) -> None:
    """Type, shape, layout and device checks (no device synchronisation)."""
    named = {"q": q, "k": k, "v": v, "out": out, "grad_out": grad_out}
    for name, t in named.items():
        check_tensor(name, t, dtypes=_DTYPES, ndim=3)
    check_same_dtype(**named)
    check_tensor("lse", lse, dtypes=(torch.float32,), ndim=2)
    lengths = {"q_start": q_start, "q_len": q_len, "k_start": k_start, "k_len": k_len}
    for name, t in lengths.items():
        check_tensor(name, t, dtypes=(torch.int32,), ndim=1)
    _check_length_arg("max_q_len", max_q_len)
    _check_length_arg("max_k_len", max_k_len)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")
    if not math.isfinite(float(scale)):
        raise ValueError(f"scale must be finite, got {scale}")

    total_q, num_q_heads, head_dim = q.shape
    total_k, num_kv_heads = k.shape[0], k.shape[1]
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"head dim d={head_dim} is not supported by the CUDA attention backward "
            f"(supported: {', '.join(map(str, SUPPORTED_HEAD_DIMS))})"
        )
    if k.shape[2] != head_dim:
        raise ValueError(
            f"q and k must have the same head dim, got d={head_dim} (q) and d={k.shape[2]} (k)"
        )
    if v.shape != k.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    for name in ("out", "grad_out"):
        if named[name].shape != q.shape:
            raise ValueError(
                f"{name} must have q's shape {tuple(q.shape)}, got {tuple(named[name].shape)}"
            )
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"the number of query heads Hq={num_q_heads} must be a positive multiple of the "
            f"number of kv heads Hkv={num_kv_heads}"
        )
    if tuple(lse.shape) != (num_q_heads, total_q):
        raise ValueError(
            f"lse must be [Hq, Tq] = [{num_q_heads}, {total_q}], got {tuple(lse.shape)}"
        )
    batch = q_start.shape[0]
    for name, t in lengths.items():
        if t.shape[0] != batch:
            raise ValueError(
                f"{name} must have one entry per sequence ({batch}, from q_start), got shape "
                f"{tuple(t.shape)}"
            )
    if batch > _MAX_GRID_YZ:
        raise ValueError(f"at most {_MAX_GRID_YZ} sequences are supported, got {batch}")
    for name, t in {**named, "lse": lse, **lengths}.items():
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (call .contiguous() first)")
    device = check_same_device(**named, lse=lse, **lengths)
    if device.type != "cuda":
        raise ValueError(f"the CUDA attention backward needs CUDA tensors, got q on {device}")
    if torch.version.hip:
        raise RuntimeError("the attention backward has no HIP kernel (mma.sync is CUDA only)")
    if torch.cuda.get_device_capability(device) < (8, 0):
        raise RuntimeError(
            f"the attention backward needs an sm_80+ GPU (mma.sync bf16/fp16); {device} is "
            f"sm_{''.join(map(str, torch.cuda.get_device_capability(device)))}"
        )
    for name, t in named.items():
        _check_aligned(name, t)
    del total_k


def _range_problems(start: Tensor, length: Tensor, total: int, max_len: int) -> list[Tensor]:
    """Masks of sequences whose length is outside ``[0, max_len]``, whose rows ``[start,
    start + length)`` leave ``[0, total)``, and (in start order) that overlap the next one."""
    s, n = start.long(), length.long()
    bad_length = (n < 0) | (n > max_len)
    bad_range = (s < 0) | (s + n > total)
    # Empty ranges sort last and overlap nothing.
    order = torch.argsort(torch.where(n > 0, s, s.new_full((), 2**62)), stable=True)
    s_sorted, n_sorted = s[order], n[order]
    overlap = (n_sorted[1:] > 0) & (s_sorted[:-1] + n_sorted[:-1] > s_sorted[1:])
    return [bad_length, bad_range, overlap, order]


def _check_ranges(
    q_start: Tensor, q_len: Tensor, k_start: Tensor, k_len: Tensor, sizes: dict[str, int]
) -> None:
    """One device synchronisation; the error names the first offending sequence."""
    problems = {
        "q": _range_problems(q_start, q_len, sizes["Tq"], sizes["max_q_len"]),
        "k": _range_problems(k_start, k_len, sizes["Tk"], sizes["max_k_len"]),
    }
    flags = torch.stack([m.any() for p in problems.values() for m in p[:3]]).tolist()
    if not any(flags):
        return
    starts = {"q": q_start, "k": k_start}
    lengths = {"q": q_len, "k": k_len}
    for i, (kind, (bad_length, bad_range, overlap, order)) in enumerate(problems.items()):
        total, max_len = sizes[f"T{kind}"], sizes[f"max_{kind}_len"]
        s, n = starts[kind], lengths[kind]
        if flags[3 * i]:
            b = int(bad_length.nonzero()[0, 0])
            raise ValueError(
                f"{kind}_len[{b}] = {int(n[b])} is outside [0, max_{kind}_len = {max_len}]"
            )
        if flags[3 * i + 1]:
            b = int(bad_range.nonzero()[0, 0])
            raise IndexError(
                f"sequence {b}'s {kind} rows [{int(s[b])}, {int(s[b]) + int(n[b])}) "
                f"({kind}_start[{b}], {kind}_len[{b}]) are outside the {total} rows of {kind}"
            )
        if flags[3 * i + 2]:
            j = int(overlap.nonzero()[0, 0])
            a, b = sorted((int(order[j]), int(order[j + 1])))
            raise ValueError(
                f"sequences {a} and {b} share {kind} rows ({kind}_start/{kind}_len): each row "
                "belongs to at most one sequence (its gradient has one owner)"
            )


# ----------------------------------------------------------------------------- launch


def _grid(blocks: int, heads: int, batch: int, kernel: str) -> tuple[int, int, int]:
    """(blocks, heads, B), or (heads, B, blocks) for the heavy-first kernels."""
    if kernel not in _HEAVY_FIRST:
        return (blocks, heads, batch)
    if blocks > _MAX_GRID_YZ:
        raise ValueError(
            f"{blocks} blocks of a sequence exceed the grid's z limit ({_MAX_GRID_YZ}): "
            "max_q_len / max_k_len is too large"
        )
    return (heads, batch, blocks)


@functools.cache
def _kernel_name(stage: str, dtype: torch.dtype, head_dim: int, variant: str) -> str:
    if variant not in VARIANTS:
        raise ValueError(f"unknown kernel variant {variant!r}; expected one of {VARIANTS}")
    base = f"attention_bwd_{stage}_{_SUFFIX[dtype]}_d{head_dim}"
    if stage == "delta":
        return base
    return f"{base}_{_KERNELS[variant][0 if stage == 'dkdv' else 1]}"


def kernel_launches(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    grad_out: Tensor,
    q_start: Tensor,
    q_len: Tensor,
    k_start: Tensor,
    k_len: Tensor,
    max_q_len: int,
    max_k_len: int,
    causal: bool,
    scale: float,
    *,
    ranges_checked: bool = False,
) -> tuple[tuple[Tensor, Tensor, Tensor], list[tuple[str, Callable[[], None]]]]:
    """Checks the arguments, allocates ``(dq, dk, dv)`` (zeroed) and returns them with the
    launches that fill them, in order: ``[("delta", fn), ("dkdv", fn), ("dq", fn)]`` (a stage
    with nothing to do is left out).  ``backward`` runs them all; the benchmark times each.
    ``ranges_checked``: see the module docstring (the range check is the one host sync)."""
    check_backward_args(
        *(q, k, v, out, lse, grad_out, q_start, q_len, k_start, k_len),
        *(max_q_len, max_k_len, causal, scale),
    )
    total_q, num_q_heads, head_dim = q.shape
    total_k, num_kv_heads = k.shape[0], k.shape[1]
    if not ranges_checked:
        sizes = {"Tq": total_q, "Tk": total_k, "max_q_len": max_q_len, "max_k_len": max_k_len}
        _check_ranges(q_start, q_len, k_start, k_len, sizes)

    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    batch = q_start.shape[0]
    launches: list[tuple[str, Callable[[], None]]] = []
    if batch == 0 or (max_q_len == 0 and max_k_len == 0):
        return (dq, dk, dv), launches
    device = q.device
    index = device.index if device.index is not None else torch.cuda.current_device()
    delta = torch.empty((num_q_heads, total_q), dtype=torch.float32, device=device)
    variant = KERNEL_VARIANT
    geometry = _geometry(variant)
    kernel_kinds = _KERNELS[variant]
    inputs = (q, k, v, grad_out, lse, delta, q_start, q_len, k_start, k_len)
    shape_args = (num_q_heads, num_kv_heads, total_q, 1 if causal else 0, float(scale))

    def queue(stage: str, name: str, grid, threads: int, args: tuple, shared: int) -> None:
        """Queues a launch of kernel ``name`` with ``shared`` bytes of dynamic shared memory."""
        kernel = kernel_for("attention_backward", name, device)
        allow_dynamic_shared(kernel, shared, index)
        run = functools.partial(
            launch, kernel, device, grid=grid, block=(threads,), args=args, shared_mem=shared
        )
        launches.append((stage, run))

    if max_q_len > 0:
        name = _kernel_name("delta", q.dtype, head_dim, variant)
        blocks = -(-max_q_len * num_q_heads * delta_lanes(head_dim) // THREADS)
        if blocks > _MAX_GRID_X:
            rows = max_q_len * num_q_heads
            raise ValueError(f"max_q_len * Hq = {rows} is too large for the delta grid")
        launches.append(
            (
                "delta",
                functools.partial(
                    launch,
                    kernel_for("attention_backward", name, device),
                    device,
                    grid=(blocks, batch),
                    block=(THREADS,),
                    args=(out, grad_out, q_start, q_len, delta, num_q_heads, total_q),
                ),
            )
        )
    if max_k_len > 0:
        # The wgmma kernel: 128 keys per CTA (two warpgroups), heavy-first grid like `_wide`'s.
        if dkdv_uses_wgmma(q, variant):
            name = f"attention_bwd_dkdv_{_SUFFIX[q.dtype]}_d{head_dim}_wgmma_pair"
            shared, kv_threads = wgmma_pair_shared_bytes(head_dim), WGMMA_PAIR_THREADS
            keys = WGMMA_PAIR_KEYS
        else:
            name = _kernel_name("dkdv", q.dtype, head_dim, variant)
            shared, kv_threads = dkdv_shared_bytes(head_dim, variant), geometry["kv_threads"]
            keys = geometry["keys"]
        grid = _grid(-(-max_k_len // keys), num_kv_heads, batch, kernel_kinds[0])
        queue("dkdv", name, grid, kv_threads, (*inputs, dk, dv, *shape_args), shared)
    if max_q_len > 0:
        # The wgmma kernel: 64 queries per CTA, heavy-first grid like `_tiled`.
        if dq_uses_wgmma(q, variant):
            name = f"attention_bwd_dq_{_SUFFIX[q.dtype]}_d{head_dim}_wgmma"
            shared = wgmma_dq_shared_bytes(head_dim)
            dq_rows, dq_threads = WGMMA_DQ_ROWS, WGMMA_THREADS
        else:
            name = _kernel_name("dq", q.dtype, head_dim, variant)
            shared, dq_rows = dq_shared_bytes(head_dim, variant), geometry["rows"]
            dq_threads = geometry["dq_threads"]
        grid = _grid(-(-max_q_len // dq_rows), num_q_heads, batch, kernel_kinds[1])
        queue("dq", name, grid, dq_threads, (*inputs, dq, *shape_args), shared)
    return (dq, dk, dv), launches


def backward(*args, **kwargs) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` in the input dtype (fp32 accumulation): ``kernel_launches``'s arguments,
    its launches run in order; see the module docstring (``ranges_checked`` too)."""
    grads, launches = kernel_launches(*args, **kwargs)
    for _, run in launches:
        run()
    return grads

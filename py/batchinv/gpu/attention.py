"""Attention forward on CUDA: launches ``kernels_cu/attention.cu`` on the canonical layout.

Every entry point (padded, varlen, KV cache) is reduced to one canonical layout, which the
backward (``attention_backward``) consumes as well:

- ``q [Tq, Hq, d]``, ``k, v [Tk, Hkv, d]``: flat token rows, unit stride along ``d``, 16-byte
  aligned row and head strides (otherwise a contiguous copy is made; inputs are never changed);
- ``q_start, q_len, k_start, k_len``: int32 CUDA tensors ``[B]``; query ``i < q_len[b]`` is row
  ``q_start[b] + i`` at absolute position ``k_len[b] - q_len[b] + i`` and sees key rows
  ``k_start[b] + j``, ``j < k_len[b]`` (causal: ``j <=`` its position);
- ``max_q_len, max_k_len``: Python ints (bounds of the launch grid);
- ``out [Tq, Hq, d]`` in the input dtype and ``lse [Hq, Tq]`` fp32 (natural log); rows covered
  by no sequence get ``out = 0``, ``lse = -inf``.

Two execution modes with the same per-row arithmetic (see the kernel's header): ``"tile"``
(one CTA walks all KV splits of its query tile) and ``"split"`` (one CTA per KV split, then a
combine kernel).  ``warps`` (1 or 4 warps, 16 or 64 tile rows) follows the number of query rows
per sequence; ``mode="auto"`` picks ``"split"`` for one-warp tiles (decode: the cooperative
kernel) and, for 4-warp tiles, when the tile launch would not fill the GPU and a row spans more
than one split.  Neither choice changes a row's bits.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..kv_cache import upload
from ..runtime import (
    allow_dynamic_shared,
    current_raw_stream,
    kernel_for,
    multiprocessors,
    tensor_map_2d,
    uses_hopper,
)
from . import attention_backward, attention_hopper

BLOCK_KEYS = 128  # keys per block, at absolute positions [128j, 128j + 128)
SPLIT_KEYS = 2048  # keys per split, at absolute positions (kernels_cu/attention.cu kSplitKeys)
HEAD_DIMS = (64, 128)
WARP_CHOICES = (1, 4)
# K/V blocks held by the tile and one-warp split kernels, one and four warps alike (attention.cu
# attn_tile): one K and one V buffer, V_j loading during S_j, K_{j+1} during P_j V_j (FA2's split
# pipeline).
TILE_STAGES = 1
MODES = ("auto", "tile", "split")
MAX_PACKED_HEADS = 16  # query heads of one kv head packed in a tile's rows
# Split launches of 16-row tiles (decode) run the cooperative kernel (attn_split_coop_*):
# COOP_WARPS warps share one tile and one split, same bits as one warp per tile (the one-warp
# kernel stays reachable with coop=False).  Its K/V pipeline depth by default: COOP_DEFAULT_STAGES
# (a 128-key block at d = 128 is a 64 KB stage, and a second one is no faster at large
# batches).  A launch of at most COOP_FEW_CTAS_PER_SM CTAs per SM (small batches: B=1 at 32769
# keys is 136 CTAs, B=8 at 4097 keys 192) takes COOP_FEW_CTAS_STAGES: with few CTAs per SM, a
# second block in flight hides the load latency that other CTAs would otherwise hide (an H200,
# graphed: 136 CTAs 41.9 us against 52.9 us with one stage, 192 CTAs 46.6 against 54.0; from
# 272 CTAs one stage is as fast or faster; docs/tuning/attention.md).  The stage count never
# changes a row's operations (tested).
COOP_WARPS = 4
COOP_STAGES = (1, 2, 3)
COOP_DEFAULT_STAGES = 1
COOP_FEW_CTAS_STAGES = 2
COOP_FEW_CTAS_PER_SM = 1.5
# On sm_90a the cooperative kernel copies K/V by TMA (attn_split_coop_*_tma, where
# coop_tma_applies; same bits), which measured faster than cp.async (docs/tuning/attention.md).

_SUFFIX = {torch.bfloat16: "bf16", torch.float16: "f16"}
_LOG2E = 1.4426950408889634
_MAX_GRID_YZ = 65535


@dataclass(frozen=True)
class Layout:
    """Per-sequence row ranges of the canonical layout (int32 CUDA tensors) and their bounds.

    Built by ``make_layout``, it owns its tensors (rows of one int32 ``[4, B]`` tensor, never a
    caller's tensor), so a layout checked once stays valid: the autograd backward reuses the
    forward's layout without a second check (and without its host sync)."""

    q_start: Tensor
    q_len: Tensor
    k_start: Tensor
    k_len: Tensor
    max_q_len: int
    max_k_len: int

    @functools.cached_property
    def batch(self) -> int:
        return self.q_start.numel()

    @functools.cached_property
    def pointers(self) -> tuple[int, int, int, int]:
        """Device addresses of ``q_start, q_len, k_start, k_len`` (the layout owns them, so
        they never change), passed to the kernels as ints."""
        return tuple(t.data_ptr() for t in (self.q_start, self.q_len, self.k_start, self.k_len))


def make_layout(
    q_start: Tensor,
    q_len: Tensor,
    k_start: Tensor,
    k_len: Tensor,
    max_q_len: int,
    max_k_len: int,
    device: torch.device | str | None = None,
) -> Layout:
    """A ``Layout`` owning a copy of the four per-sequence tensors: one new int32 ``[4, B]``
    tensor on ``device`` (default: ``q_start``'s), whose rows are the four fields.  Later
    edits of the arguments change nothing.  Host tensors reach a GPU in one non-blocking copy
    from pinned memory: building a layout never waits for the GPU."""
    device = q_start.device if device is None else torch.device(device)
    parts = [q_start, q_len, k_start, k_len]
    on_host = [i for i, t in enumerate(parts) if t.device.type == "cpu"]
    if device.type == "cpu" or not on_host:
        packed = torch.stack([t.to(device, torch.int32) for t in parts])
    elif len(on_host) == len(parts):  # one stack (promoting to int64), one cast, one upload
        packed = upload(torch.stack(parts).to(torch.int32), device)
    else:
        uploaded = upload(torch.stack([parts[i].to(torch.int32) for i in on_host]), device)
        if len(on_host) == len(parts):
            packed = uploaded
        else:
            for i, row in zip(on_host, uploaded, strict=True):
                parts[i] = row
            packed = torch.stack([t.to(torch.int32) for t in parts])
    return Layout(*packed.unbind(0), int(max_q_len), int(max_k_len))


def check_supported(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Raises for what the CUDA kernels do not cover (the reference covers more)."""
    check_dtypes_and_head_dim(q, k, v)
    if _capability(q.device.index or 0) < (8, 0):
        raise RuntimeError("the CUDA attention kernels need compute capability 8.0 or newer")


def check_dtypes_and_head_dim(q: Tensor, k: Tensor, v: Tensor) -> None:
    """``check_supported`` without the device requirement (the portable kernel's checks, with
    the same errors)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in _SUFFIX:
            raise TypeError(
                f"{name} has dtype {t.dtype}; the CUDA attention kernels take bfloat16 or "
                "float16 (use the CPU reference for float32)"
            )
    d = q.shape[-1]
    if d not in HEAD_DIMS:
        raise ValueError(
            f"head dim d={d} is not supported by the CUDA attention kernels (supported: "
            f"{', '.join(map(str, HEAD_DIMS))})"
        )


def as_rows(t: Tensor) -> Tensor:
    """``t [rows, H, d]`` usable by the kernel: unit stride along d, 16-byte aligned strides
    and base; a view when it already is, else a fresh contiguous copy (``t.contiguous()``
    would return a contiguous tensor at a misaligned base unchanged: a misaligned-address
    fault in the kernel)."""
    ok = (
        t.stride(-1) == 1
        and t.stride(0) % 8 == 0
        and t.stride(1) % 8 == 0
        and t.data_ptr() % 16 == 0
    )
    return t if ok else t.clone(memory_format=torch.contiguous_format)


def packed_heads(hq: int, hkv: int) -> int:
    """Query heads of one kv head that share a tile: the largest divisor of the group <= 16."""
    group = hq // hkv
    return max(p for p in range(1, min(group, MAX_PACKED_HEADS) + 1) if group % p == 0)


def _kv_stage_bytes(d: int) -> int:
    """One K/V stage of any forward kernel: K and V of one block, dense 128-byte-swizzled rows
    (attention.cu kv_offset; no padding)."""
    return 2 * BLOCK_KEYS * d * 2


def shared_bytes(d: int, warps: int, split: bool) -> int:
    """Dynamic shared memory of a tile kernel (kernels_cu/attention.cu attn_tile): one K and
    one V buffer (``TILE_STAGES`` = 1 block), the Q tile (16-byte padded rows, read in
    every block), then mode (a)'s running state."""
    kv = TILE_STAGES * _kv_stage_bytes(d)
    q = 16 * warps * (d + 8) * 2
    run = 0 if split else (d // 8) * 4 * 32 * warps * 4
    return kv + q + run


def coop_tma_shared_bytes(d: int, stages: int) -> int:
    """Dynamic shared memory of a cooperative split kernel with TMA copies (attn_split_coop_*_tma):
    the stages and the Q / S tile of ``coop_shared_bytes``, one mbarrier per stage, and 1024
    bytes to align the swizzled boxes."""
    return coop_shared_bytes(d, stages) + 8 * stages + 1024


def _tma_rows(t: Tensor) -> bool:
    """``t [rows, H, d]`` readable as a 2-D TMA map ``[rows, H * d]``: heads contiguous within a
    row, 16-byte aligned base and row stride, at least one row and fewer than 2^31 (the kernel's
    int32 box coordinates)."""
    return (
        0 < t.shape[0] < 2**31
        and t.stride(2) == 1
        and t.stride(1) == t.shape[2]
        and t.stride(0) % 8 == 0
        and t.data_ptr() % 16 == 0
    )


def coop_tma_applies(k: Tensor, v: Tensor) -> bool:
    """Whether cooperative split launches copy K/V by TMA: an sm_90a device and K/V rows
    readable as TMA maps; otherwise they use cp.async (the same tile, the same bits)."""
    return uses_hopper(k.device) and _tma_rows(k) and _tma_rows(v)


def _tma_map_spec(t: Tensor) -> tuple[str, int, int, int]:
    """What a TMA map of ``t`` holds besides its address: dtype name, rows, columns, row bytes."""
    rows, heads, d = t.shape
    return _SUFFIX[t.dtype], rows, heads * d, t.stride(0) * 2


@functools.lru_cache(maxsize=256)
def _encoded_tma_map(
    address: int, dtype_name: str, rows: int, cols: int, row_bytes: int, device_index: int
) -> bytes:
    # A map holds only these numbers, so equal arguments give equal bytes: a KV cache's storage
    # (the same address every decode step) is encoded once.
    return tensor_map_2d(address, dtype_name, rows, cols, row_bytes, 64, 64, 128, device_index)


def coop_shared_bytes(d: int, stages: int) -> int:
    """Dynamic shared memory of a cooperative split kernel (attn_split_coop): K/V stages, then
    the Q tile, which the fp32 S tile [16][128 + 4] overlays once Q is in registers."""
    return stages * _kv_stage_bytes(d) + max(16 * (d + 8) * 2, 16 * (BLOCK_KEYS + 4) * 4)


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def _kernel(name: str, device: torch.device, shared: int):
    kernel = kernel_for("attention", name, device)
    allow_dynamic_shared(kernel, shared, device.index or 0)
    return kernel


def choose(
    layout: Layout, hq: int, hkv: int, device: torch.device, mode: str, warps: int | None
) -> tuple[str, int]:
    """``(mode, warps)`` from the shapes; only the number of CTAs depends on them."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if warps is not None and warps not in WARP_CHOICES:
        raise ValueError(f"warps must be one of {WARP_CHOICES} or None, got {warps!r}")
    pack = packed_heads(hq, hkv)
    if warps is None:
        warps = 1 if layout.max_q_len * pack <= 16 else 4
    if mode == "auto" and warps == 1:
        # Decode-like launches run the cooperative split kernel, whatever the context: with
        # 128-key blocks the one-warp tile kernel is slower even at short contexts
        # (docs/tuning/attention.md).
        mode = "split"
    elif mode == "auto":
        qpt = 16 * warps // pack
        tiles = -(-layout.max_q_len // qpt) * (hq // pack) * layout.batch
        long_rows = layout.max_k_len > SPLIT_KEYS
        # Launches that would not fill the GPU twice over spread each row's splits over CTAs.
        few_tiles = tiles < 2 * multiprocessors(device.index or 0)
        mode = "split" if long_rows and few_tiles else "tile"
    return mode, warps


@dataclass(frozen=True)
class Bounds:
    """What ``choose`` reads of a layout: its sequences and the bounds of its launch grid."""

    batch: int
    max_q_len: int
    max_k_len: int


def padded_bounds(q: Tensor, k: Tensor) -> Bounds:
    """The bounds of a padded call (``attention``): the padded widths, whatever the lengths."""
    return Bounds(q.shape[0], q.shape[1], k.shape[1])


def varlen_bounds(cu_q: Tensor, cu_k: Tensor) -> Bounds:
    """The bounds of a packed call (``attention_varlen``) with host ``cu_seqlens``."""
    q_len = cu_q[1:] - cu_q[:-1]
    k_len = cu_k[1:] - cu_k[:-1]
    return Bounds(q_len.numel(), int(q_len.max()), int(k_len.max()))  # host tensors: no sync


def kv_cache_bounds(q: Tensor, cache) -> Bounds:
    """The bounds of a KV-cache call (``attention_with_kv_cache``): the key bound is the
    cache's capacity (the kernels read each slot's length on the device)."""
    return Bounds(q.shape[0], q.shape[1], cache.max_len)


def path_for(bounds: Bounds, hq: int, hkv: int, device: torch.device) -> str:
    """The execution mode ``forward`` takes with its default options for a layout with these
    bounds: ``"split"`` or ``"tile"`` and the tile's warps (``choose``, nothing launched)."""
    mode, warps = choose(bounds, hq, hkv, device, "auto", None)
    return f"{mode} w{warps}"


def forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: Layout,
    causal: bool,
    scale: float,
    *,
    mode: str = "auto",
    warps: int | None = None,
    stages: int | None = None,
    coop: bool | None = None,
    prefill_zero: bool = True,
    hopper: bool | None = None,
    pdl: bool | None = None,
    tma: bool | None = None,
) -> tuple[Tensor, Tensor]:
    """``(out [Tq, Hq, d], lse [Hq, Tq] fp32)`` on the canonical layout.

    ``prefill_zero`` fills out/lse with 0/-inf first (needed when some rows belong to no
    sequence; the caller may pass False when every row is covered).  ``coop`` (split mode
    with one-warp tiles only; default True there) runs the cooperative split kernel and
    ``stages`` is its K/V pipeline depth (one of ``COOP_STAGES``); the other kernels have
    ``TILE_STAGES`` (1; ``stages`` may name it).
    ``hopper``: 4-warp tile launches run ``attention_hopper`` (same bits) where it applies
    (None), always (True: an error where it does not apply) or never (False: the mma.sync
    tile kernel).  ``pdl``: split launches start the combine kernel with programmatic
    dependent launch (see ``combine_uses_pdl``; same bits).  ``tma``: the cooperative split
    kernel copies K/V by TMA where ``coop_tma_applies`` (None), always (True: an error where
    it does not apply) or never (False: cp.async); same bits.

    Host time: a call with the default options reuses the ``_Plan`` of an earlier call with the
    same ``_plan_key`` (dtypes, shapes, strides, alignment, devices, the layout's bounds): every
    decision and check of ``_plan`` depends only on those, so a plan that was built once (its
    checks passed) holds for every call with that key.
    """
    if (
        mode == "auto"
        and warps is None
        and stages is None
        and coop is None
        and hopper is None
        and pdl is None
        and tma is None
    ):
        key = _plan_key(q, k, v, layout, causal)
        plan = _PLANS.get(key)
        if plan is None:
            plan, q, k, v = _plan(q, k, v, layout, causal)
            if plan.reusable:
                if len(_PLANS) >= _MAX_PLANS:
                    _PLANS.clear()
                _PLANS[key] = plan
    else:
        plan, q, k, v = _plan(q, k, v, layout, causal, mode, warps, stages, coop, hopper, pdl, tma)
    return _execute(plan, q, k, v, layout, causal, scale, prefill_zero)


@dataclass(frozen=True)
class _Launch:
    """One kernel launch of a plan; ``args`` are the integer arguments after the pointers."""

    kernel: object
    grid: tuple[int, int, int]
    block: tuple[int]
    shared: int
    args: tuple
    programmatic: bool = False


@dataclass(frozen=True)
class _Plan:
    """What ``forward`` does for one ``_plan_key``: the output shapes, then nothing
    (``kind="empty"``), the Hopper tile kernel (``"hopper"``) or ``main`` (+ ``combine`` for
    split launches).  ``reusable``: ``as_rows`` made no copy (a copy's strides are not the
    key's), so a later call with the same key may reuse the plan."""

    kind: str
    out_shape: tuple[int, int, int]
    lse_shape: tuple[int, int]
    device_index: int
    reusable: bool
    pack: int = 0
    ws_shape: tuple[int, ...] | None = None
    tma: tuple | None = None  # (dtype name, rows, cols, row bytes) of k, then of v
    main: _Launch | None = None
    combine: _Launch | None = None


# Plans by key, for calls with the default options; cleared when full (prefill shapes vary).
_PLANS: dict[tuple, _Plan] = {}
_MAX_PLANS = 512


def _plan_key(q: Tensor, k: Tensor, v: Tensor, layout: Layout, causal: bool) -> tuple:
    """Everything ``_plan`` reads of its arguments (``as_rows``, ``coop_tma_applies`` and
    ``attention_hopper.applies`` read the strides and the 16-byte alignment of the bases)."""
    return (
        q.dtype,
        k.dtype,
        v.dtype,
        q.shape,
        k.shape,
        v.shape,
        q.stride(),
        k.stride(),
        v.stride(),
        q.data_ptr() % 16,
        k.data_ptr() % 16,
        v.data_ptr() % 16,
        q.get_device(),
        k.get_device(),
        layout.batch,
        layout.max_q_len,
        layout.max_k_len,
        causal,
    )


def _plan(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: Layout,
    causal: bool,
    mode: str = "auto",
    warps: int | None = None,
    stages: int | None = None,
    coop: bool | None = None,
    hopper: bool | None = None,
    pdl: bool | None = None,
    tma: bool | None = None,
) -> tuple[_Plan, Tensor, Tensor, Tensor]:
    """The checks and choices of a ``forward`` call: ``(plan, q, k, v)`` with ``q, k, v``
    through ``as_rows``.  Reads only what ``_plan_key`` holds (and the options)."""
    check_supported(q, k, v)
    programmatic = combine_uses_pdl(device=q.device, pdl=pdl)
    rows = as_rows(q), as_rows(k), as_rows(v)
    reusable = rows[0] is q and rows[1] is k and rows[2] is v
    q, k, v = rows
    tq, hq, d = q.shape
    hkv = k.shape[1]
    device = q.device
    index = torch.cuda.current_device() if device.index is None else device.index
    mode, warps = choose(layout, hq, hkv, device, mode, warps)
    shapes = {"out_shape": (tq, hq, d), "lse_shape": (hq, tq), "device_index": index}
    batch = layout.batch
    if tq == 0 or batch == 0 or layout.max_q_len == 0:
        return _Plan("empty", reusable=reusable, **shapes), q, k, v
    pack = packed_heads(hq, hkv)
    split = mode == "split"
    one_warp_split = split and warps == 1
    if coop is None:
        coop = one_warp_split
    if coop and not one_warp_split:
        raise ValueError("coop=True needs a split launch with one-warp (16-row) tiles")
    if not coop and stages not in (None, TILE_STAGES):
        raise ValueError(
            f"stages must be {TILE_STAGES} without coop for {warps}-warp tiles; got {stages!r}"
        )
    if tma is not None and not isinstance(tma, bool):
        raise TypeError(f"tma must be a bool or None, got {type(tma).__name__}")
    if tma and not coop:
        raise ValueError("tma=True needs the cooperative split kernel (coop)")
    tile4 = mode == "tile" and warps == 4
    if tile4 and hopper is not False and attention_hopper.applies(q, k, v):
        return _Plan("hopper", reusable=reusable, pack=pack, **shapes), q, k, v
    if hopper:
        raise ValueError(
            "hopper=True needs a 4-warp tile launch on an sm_90a device with d = 64 or 128 and "
            "K/V rows readable by TMA"
        )
    qpt = 16 * warps // pack
    q_tiles = -(-layout.max_q_len // qpt)
    split_grid = max(1, -(-layout.max_k_len // SPLIT_KEYS))
    grid_z = batch * split_grid if split else batch
    if grid_z > _MAX_GRID_YZ or hq // pack > _MAX_GRID_YZ:
        raise ValueError(
            f"attention launch too large: {batch} sequences x {split_grid if split else 1} "
            f"splits (at most {_MAX_GRID_YZ})"
        )
    suffix = f"{_SUFFIX[q.dtype]}_d{d}"
    maps = None
    if coop:
        if stages is None:
            ctas = q_tiles * (hq // pack) * grid_z
            few = ctas <= COOP_FEW_CTAS_PER_SM * multiprocessors(index)
            stages = COOP_FEW_CTAS_STAGES if few else COOP_DEFAULT_STAGES
        if stages not in COOP_STAGES:
            raise ValueError(f"stages must be one of {COOP_STAGES} with coop; got {stages!r}")
        use_tma = coop_tma_applies(k, v) if tma is None else tma
        if tma and not coop_tma_applies(k, v):
            raise ValueError(
                "tma=True needs an sm_90a device and K/V rows readable by TMA (heads contiguous "
                "in a row, 16-byte aligned base and row stride)"
            )
        shared = coop_tma_shared_bytes(d, stages) if use_tma else coop_shared_bytes(d, stages)
        name = f"attn_split_coop_{suffix}_w{COOP_WARPS}_s{stages}" + ("_tma" if use_tma else "")
        threads = 32 * COOP_WARPS
        maps = (_tma_map_spec(k), _tma_map_spec(v)) if use_tma else None
    else:
        shared = shared_bytes(d, warps, split)
        name = f"attn_{'split' if split else 'fwd'}_{suffix}_w{warps}"
        threads = 32 * warps
    # out is a fresh contiguous [tq, hq, d] tensor: its strides are (hq * d, d).
    out_strides = (hq * d, d)
    main = _Launch(
        _kernel(name, device, shared),
        (q_tiles, hq // pack, grid_z),
        (threads,),
        shared,
        (
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            *out_strides,
            tq,
            hq,
            hkv,
            pack,
            int(causal),
            split_grid,
        ),
    )
    combine = None
    if split:
        combine = _Launch(
            _kernel(f"attn_combine_{suffix}", device, 0),
            (layout.max_q_len, hq, batch),
            (d,),
            0,
            (*out_strides, tq, hq, int(causal)),
            programmatic,
        )
    return (
        _Plan(
            "kernels",
            reusable=reusable,
            pack=pack,
            ws_shape=(split_grid, tq, hq, d + 2) if split else None,
            tma=maps,
            main=main,
            combine=combine,
            **shapes,
        ),
        q,
        k,
        v,
    )


def _execute(
    plan: _Plan,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: Layout,
    causal: bool,
    scale: float,
    prefill_zero: bool,
) -> tuple[Tensor, Tensor]:
    """Allocates the outputs and runs ``plan`` on ``q, k, v`` (already through ``as_rows``)."""
    if prefill_zero:
        out = q.new_zeros(plan.out_shape)
        lse = q.new_full(plan.lse_shape, float("-inf"), dtype=torch.float32)
    else:
        out = q.new_empty(plan.out_shape)
        lse = q.new_empty(plan.lse_shape, dtype=torch.float32)
    if plan.kind == "empty":
        return out, lse
    scale_log2 = float(scale) * _LOG2E
    if plan.kind == "hopper":
        attention_hopper.forward_tile(q, k, v, out, lse, layout, causal, scale_log2, plan.pack)
        return out, lse
    ws = q.new_empty(plan.ws_shape, dtype=torch.float32) if plan.ws_shape is not None else None
    maps = ()
    if plan.tma is not None:
        (k_spec, v_spec) = plan.tma
        maps = (
            _encoded_tma_map(k.data_ptr(), *k_spec, plan.device_index),
            _encoded_tma_map(v.data_ptr(), *v_spec, plan.device_index),
        )
    index = plan.device_index
    stream = current_raw_stream(index)
    q_start, q_len, k_start, k_len = layout.pointers
    main = plan.main
    main.kernel(
        main.grid,
        main.block,
        (
            *maps,
            q,
            k,
            v,
            out,
            lse,
            0 if ws is None else ws,
            q_start,
            q_len,
            k_start,
            k_len,
            *main.args,
            scale_log2,
        ),
        shared_mem=main.shared,
        stream=stream,
        device=index,
    )
    combine = plan.combine
    if combine is not None:
        combine.kernel(
            combine.grid,
            combine.block,
            (ws, out, lse, q_start, q_len, k_len, *combine.args),
            stream=stream,
            device=index,
            programmatic=combine.programmatic,
        )
    return out, lse


def combine_uses_pdl(device: torch.device, pdl: bool | None = None) -> bool:
    """Whether split launches on ``device`` start the combine kernel with programmatic
    dependent launch: its CTAs launch while the split kernel's last CTAs run and wait
    (griddepcontrol.wait) for the whole split grid before reading a partial.  ``pdl=None``:
    where the sm_90a kernels run (``uses_hopper``: the image with the griddepcontrol
    instructions); True: there, else a ValueError; False: an ordinary stream-ordered launch.
    """
    if pdl is not None and not isinstance(pdl, bool):
        raise TypeError(f"pdl must be a bool or None, got {type(pdl).__name__}")
    if pdl is False:
        return False
    hopper = uses_hopper(device)
    if pdl and not hopper:
        raise ValueError(
            "pdl=True needs an sm_90 device and a build with the sm_90a image (the kernels "
            "that carry griddepcontrol)"
        )
    return hopper


def scale_of(softmax_scale: float | None, head_dim: int) -> float:
    """The softmax scale rounded once to fp32 (as the reference does); it must be positive:
    the kernels take each block's max of the raw scores and scale it once, which is the max of
    the scaled scores only for a scale > 0 (kernels_cu/attention.cu's header)."""
    if softmax_scale is None:
        return _default_scale(head_dim)
    return _rounded_scale(softmax_scale, head_dim)


@functools.lru_cache(maxsize=64)
def _default_scale(head_dim: int) -> float:
    return _rounded_scale(None, head_dim)


def _rounded_scale(softmax_scale: float | None, head_dim: int) -> float:
    value = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    scale = float(torch.tensor(value, dtype=torch.float32))
    if not scale > 0.0:
        raise ValueError(
            f"softmax_scale must be positive (after rounding to fp32) for the CUDA attention "
            f"kernels, got {softmax_scale}"
        )
    return scale


# ----------------------------------------------------------------------------- backward


def backward_rows(q, k, v, out, lse, grad_out, layout: Layout, causal: bool, scale: float):
    """``(dq, dk, dv)`` on the canonical layout (rows ``[T, H, d]``, lse ``[Hq, Tq]``) of a
    ``Layout`` whose lengths were checked (the backward kernels then skip their range check)."""
    # The backward kernels take dense rows; the forward also accepts strided views.
    return attention_backward.backward(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        out,
        lse,
        grad_out.contiguous(),
        layout.q_start,
        layout.q_len,
        layout.k_start,
        layout.k_len,
        layout.max_q_len,
        layout.max_k_len,
        causal=causal,
        scale=scale,
        ranges_checked=True,
    )


def run_forward(q, k, v, layout: Layout, causal: bool, scale: float, prefill_zero: bool, **tuning):
    """The entry points' default ``run``: ``forward`` without autograd."""
    return forward(q, k, v, layout, causal, scale, prefill_zero=prefill_zero, **tuning)


# ----------------------------------------------------------------------------- entry points
# The CUDA implementations of batchinv.attention / attention_varlen / attention_with_kv_cache
# on arguments that batchinv.ops.attention validated, the values of the length tensors
# included: lengths arrive as the host (CPU) copies that passed check_length_values (GPU
# tensors work too, for callers that built them themselves), and the layout is built from them.
# ``run`` runs the canonical-layout forward: ``run_forward`` by default, the op's autograd
# runner when the op calls; ``tuning`` (mode, warps, ...; tests and benchmarks) goes to
# ``forward``.


# Host index rows built once per size (a decode step asks for the same ones every layer).
# They are shared: callers read them (make_layout copies them), never write into them.
@functools.lru_cache(maxsize=256)
def _host_arange(batch: int, step: int) -> Tensor:
    return torch.arange(batch, dtype=torch.int64) * step


@functools.lru_cache(maxsize=256)
def _full(batch: int, value: int) -> Tensor:
    return torch.full((batch,), value, dtype=torch.int64)


def _compact_kept_keys(k, v, key_padding_mask, k_len):
    """Kept keys moved to the front of each sequence, in storage order (the mask's definition:
    kept keys are renumbered 0, 1, ...); returns ``(k, v, kept counts, gather index)``."""
    sk = k.shape[1]
    positions = torch.arange(sk, device=k.device)
    kept = key_padding_mask & (positions[None, :] < k_len[:, None])
    order = torch.sort((~kept).to(torch.int8), dim=1, stable=True).indices
    index = order[:, :, None, None].expand(-1, -1, k.shape[2], k.shape[3])
    return torch.gather(k, 1, index), torch.gather(v, 1, index), kept.sum(dim=1), index


def _padded_layout(q, k, v, q_len, k_len, key_padding_mask):
    """``(k, v, layout, gather index or None)`` of a padded call with lengths ``q_len, k_len``
    (host or GPU tensors, None for full): ``k, v`` with the kept keys compacted where there is
    a mask."""
    bounds = padded_bounds(q, k)
    batch, sq, sk = bounds.batch, bounds.max_q_len, bounds.max_k_len
    if q_len is None and k_len is None and key_padding_mask is None:
        return k, v, _full_layout(batch, sq, sk, q.device), None
    q_len = _full(batch, sq) if q_len is None else q_len
    k_len = _full(batch, sk) if k_len is None else k_len
    index = None
    if key_padding_mask is not None:
        if k_len.device.type == "cpu":
            k_len = upload(k_len, q.device)
        k, v, k_len, index = _compact_kept_keys(k, v, key_padding_mask, k_len)
    layout = make_layout(
        _host_arange(batch, sq), q_len, _host_arange(batch, sk), k_len, sq, sk, device=q.device
    )
    return k, v, layout, index


_FULL_LAYOUTS: dict[tuple, Layout] = {}
_MAX_FULL_LAYOUTS = 64


def _full_layout(batch: int, sq: int, sk: int, device: torch.device) -> Layout:
    """The layout of a call without lengths or mask, kept per shape and stream: its upload is
    most of a small call's host time, and a layout is never written after it is made.  Per
    stream, because the upload is ordered on the stream that made it, before that stream's
    kernels only.  One made during a CUDA-graph capture lives in the graph's memory pool and is
    written only by a replay, so it is not kept (a capture reuses one kept by an earlier eager
    call on the capturing stream)."""
    index = torch.cuda.current_device() if device.index is None else device.index
    key = (batch, sq, sk, index, current_raw_stream(index))
    layout = _FULL_LAYOUTS.get(key)
    if layout is None:
        layout = make_layout(
            _host_arange(batch, sq),
            _full(batch, sq),
            _host_arange(batch, sk),
            _full(batch, sk),
            sq,
            sk,
            device=device,
        )
        if not torch.cuda.is_current_stream_capturing():
            if len(_FULL_LAYOUTS) >= _MAX_FULL_LAYOUTS:
                _FULL_LAYOUTS.clear()
            _FULL_LAYOUTS[key] = layout
    return layout


def _varlen_layout(cu_q: Tensor, cu_k: Tensor, device: torch.device) -> Layout:
    """The layout of host (CPU) ``cu_seqlens`` that passed ``check_length_values``."""
    q_len = cu_q[1:] - cu_q[:-1]
    k_len = cu_k[1:] - cu_k[:-1]
    bounds = varlen_bounds(cu_q, cu_k)
    return make_layout(
        cu_q[:-1], q_len, cu_k[:-1], k_len, bounds.max_q_len, bounds.max_k_len, device=device
    )


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    seqlens_q: Tensor | None = None,
    seqlens_k: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    return_lse: bool = False,
    run=run_forward,
    **tuning,
):
    """CUDA ``batchinv.attention`` (padded layout)."""
    batch, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    k, v, layout, _ = _padded_layout(q, k, v, seqlens_q, seqlens_k, key_padding_mask)
    out, lse = run(
        q.reshape(batch * sq, hq, d),
        k.reshape(batch * sk, hkv, d),
        v.reshape(batch * sk, hkv, d),
        layout,
        causal,
        scale_of(softmax_scale, d),
        seqlens_q is not None,
        **tuning,
    )
    out = out.view(batch, sq, hq, d)
    if not return_lse:
        return out
    return out, lse.view(hq, batch, sq).permute(1, 0, 2).contiguous()


def attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    run=run_forward,
    **tuning,
):
    """CUDA ``batchinv.attention_varlen`` (packed rows; ``lse [Hq, Tq]``); host ``cu_seqlens``."""
    layout = _varlen_layout(cu_seqlens_q, cu_seqlens_k, q.device)
    scale = scale_of(softmax_scale, q.shape[-1])
    out, lse = run(q, k, v, layout, causal, scale, False, **tuning)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------- eager no-grad path
# A call that needs no gradient, without lengths or mask (padded) or with host cu_seqlens
# (varlen), with contiguous 16-byte aligned q, k, v and without return_lse, runs a ``_Lean``
# plan: everything ``forward`` decides for it (the ``_Plan``, the layout, the scale, the
# kernels' integer arguments), made once per ``_lean_key`` and reused.  A call then allocates
# once, reads three pointers and launches with ints; the kernels and their arguments are the
# ones ``forward`` launches, hence the same bits.  Other calls take ``attention`` /
# ``attention_varlen``.

# The split workspace and lse share the output's allocation when they take at most this many
# times its bytes (a one-split decode launch: about 2x), so that an output held by the caller
# never keeps a large workspace alive; a larger workspace comes with more splits, whose GPU time
# makes the second allocation's host time matter less.
SHARED_SCRATCH_MAX_RATIO = 4
_SCRATCH_ALIGN = 256  # bytes: lse and the workspace start at least as aligned as any access needs


@dataclass(frozen=True)
class _Lean:
    """A ``_Plan`` with everything a launch of it needs besides the three input pointers.

    ``alloc``: elements of the one allocation (out's dtype), or 0 for out alone plus a
    ``scratch`` fp32 allocation of ``scratch`` elements; ``lse_offset``/``ws_offset``: bytes
    from the start of the buffer that holds them."""

    plan: _Plan
    layout: Layout
    out_shape: tuple[int, ...]
    out_strides: tuple[int, ...]
    alloc: int
    scratch: int
    lse_offset: int
    ws_offset: int
    main_tail: tuple
    combine_tail: tuple | None


_LEAN: dict[tuple, _Lean | None] = {}
_MAX_LEAN = 512


def _align(nbytes: int) -> int:
    return -(-nbytes // _SCRATCH_ALIGN) * _SCRATCH_ALIGN


def _lean_plan(q, k, v, out_shape, layout: Layout, causal: bool, scale: float) -> _Lean | None:
    """The ``_Lean`` of contiguous, aligned ``q, k, v`` on ``layout``, or None where the lean
    launch does not apply (no rows, the Hopper tile kernel): those calls take the general path."""
    *_, hq, d = q.shape
    *_, hkv, _ = k.shape
    tq, tk = math.prod(q.shape[:-2]), math.prod(k.shape[:-2])
    # The canonical rows views ``as_rows`` passes for these tensors (no copy: aligned, d and the
    # head counts make every stride a multiple of 8 elements).
    rows = (
        q.as_strided((tq, hq, d), (hq * d, d, 1)),
        k.as_strided((tk, hkv, d), (hkv * d, d, 1)),
        v.as_strided((tk, hkv, d), (hkv * d, d, 1)),
    )
    plan = _plan(*rows, layout, causal)[0]
    if plan.kind != "kernels" or not plan.reusable:
        return None
    itemsize = q.element_size()
    out_bytes = tq * hq * d * itemsize
    lse_bytes = hq * tq * 4
    ws_bytes = 0 if plan.ws_shape is None else math.prod(plan.ws_shape) * 4
    scratch_bytes = _align(lse_bytes) + ws_bytes
    if scratch_bytes <= SHARED_SCRATCH_MAX_RATIO * out_bytes:
        lse_offset = _align(out_bytes)
        alloc, scratch = -(-(lse_offset + scratch_bytes) // itemsize), 0
    else:
        lse_offset, alloc, scratch = 0, 0, scratch_bytes // 4
    ws_offset = lse_offset + _align(lse_bytes) if ws_bytes else -1
    out_strides = tuple(math.prod(out_shape[i + 1 :]) for i in range(len(out_shape)))
    main, combine = plan.main, plan.combine
    scale_log2 = float(scale) * _LOG2E
    main_tail = (*layout.pointers, *main.args, scale_log2)
    combine_tail = None
    if combine is not None:
        q_start, q_len, _, k_len = layout.pointers
        combine_tail = (q_start, q_len, k_len, *combine.args)
    return _Lean(
        plan, layout, out_shape, out_strides, alloc, scratch, lse_offset, ws_offset,
        main_tail, combine_tail,
    )  # fmt: skip


def _lean_key(q: Tensor, k: Tensor, index: int, stream: int, causal, softmax_scale) -> tuple:
    """What a lean plan depends on besides the layout: shapes, dtype, device, stream (the
    layout's upload is ordered on the stream that made it), causal and the scale.  q, k and v
    are contiguous and aligned, and share k's shape and q's dtype (the op's checks)."""
    return (q.shape, k.shape, q.dtype, index, stream, causal, softmax_scale)


def _keep_lean(key: tuple, lean: _Lean | None) -> None:
    # A layout made during a CUDA-graph capture lives in the graph's pool: not kept.
    if torch.cuda.is_current_stream_capturing():
        return
    if len(_LEAN) >= _MAX_LEAN:
        _LEAN.clear()
    _LEAN[key] = lean


def _run_lean(lean: _Lean, q: Tensor, pointers: tuple, index: int, stream: int) -> Tensor:
    """Allocates and launches ``lean`` on ``q, k, v`` (their ``pointers``): what ``_execute``
    does for its plan."""
    plan = lean.plan
    if lean.alloc:
        buffer = torch.empty(lean.alloc, dtype=q.dtype, device=q.device)
        out = buffer.as_strided(lean.out_shape, lean.out_strides)
        out_ptr = scratch_ptr = buffer.data_ptr()
    else:
        out = torch.empty(lean.out_shape, dtype=q.dtype, device=q.device)
        scratch = torch.empty(lean.scratch, dtype=torch.float32, device=q.device)
        out_ptr, scratch_ptr = out.data_ptr(), scratch.data_ptr()
    lse_ptr = scratch_ptr + lean.lse_offset
    ws_ptr = 0 if lean.ws_offset < 0 else scratch_ptr + lean.ws_offset
    q_ptr, k_ptr, v_ptr = pointers
    maps = ()
    if plan.tma is not None:
        k_spec, v_spec = plan.tma
        maps = (_encoded_tma_map(k_ptr, *k_spec, index), _encoded_tma_map(v_ptr, *v_spec, index))
    main = plan.main
    main.kernel(
        main.grid,
        main.block,
        (*maps, q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, ws_ptr, *lean.main_tail),
        main.shared,
        stream,
        index,
        False,
    )
    combine = plan.combine
    if combine is not None:
        combine.kernel(
            combine.grid,
            combine.block,
            (ws_ptr, out_ptr, lse_ptr, *lean.combine_tail),
            0,
            stream,
            index,
            combine.programmatic,
        )
    return out


_NO_LEAN = object()  # ``_LEAN.get``'s default: no plan made yet (a kept None: the general path)


def _lean_pointers(q: Tensor, k: Tensor, v: Tensor) -> tuple[int, int, int] | None:
    """The addresses of ``q, k, v`` where the lean launch takes them (contiguous, 16-byte
    aligned), else None."""
    if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
        return None
    pointers = q.data_ptr(), k.data_ptr(), v.data_ptr()
    return None if (pointers[0] | pointers[1] | pointers[2]) & 15 else pointers


def attention_no_grad(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: float | None
) -> Tensor:
    """``attention(q, k, v, causal=, softmax_scale=)`` without lengths or mask, for a call
    that needs no gradient and no lse, on arguments the op checked: lean where it applies."""
    pointers = _lean_pointers(q, k, v)
    if pointers is not None:
        device = q.device
        index = torch.cuda.current_device() if device.index is None else device.index
        stream = current_raw_stream(index)
        key = _lean_key(q, k, index, stream, causal, softmax_scale)
        lean = _LEAN.get(key, _NO_LEAN)
        if lean is _NO_LEAN:
            check_supported(q, k, v)
            batch, sq, hq, d = q.shape
            layout = _full_layout(batch, sq, k.shape[1], device)
            lean = _lean_plan(q, k, v, q.shape, layout, causal, scale_of(softmax_scale, d))
            _keep_lean(key, lean)
        if lean is not None:
            return _run_lean(lean, q, pointers, index, stream)
    return attention(q, k, v, causal=causal, softmax_scale=softmax_scale)


def attention_varlen_no_grad(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    causal: bool,
    softmax_scale: float | None,
    lengths: tuple,
) -> Tensor:
    """``attention_varlen(...)`` for a call that needs no gradient and no lse, on host
    ``cu_seqlens`` the op checked, whose values ``lengths`` holds as ints (the key of the
    layout kept for them, which is never written after it is made)."""
    pointers = _lean_pointers(q, k, v)
    if pointers is not None:
        device = q.device
        index = torch.cuda.current_device() if device.index is None else device.index
        stream = current_raw_stream(index)
        key = (*_lean_key(q, k, index, stream, causal, softmax_scale), lengths)
        lean = _LEAN.get(key, _NO_LEAN)
        if lean is _NO_LEAN:
            check_supported(q, k, v)
            layout = _varlen_layout(cu_seqlens_q, cu_seqlens_k, device)
            scale = scale_of(softmax_scale, q.shape[-1])
            lean = _lean_plan(q, k, v, q.shape, layout, causal, scale)
            _keep_lean(key, lean)
        if lean is not None:
            return _run_lean(lean, q, pointers, index, stream)
    return attention_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, softmax_scale=softmax_scale
    )


# The custom ops' backward (batchinv.ops.attention): the eager autograd's kernels on the
# forward's saved outputs, with the same layout and the same views, hence the eager bits,
# without running the forward again.  ``backward`` takes ``backward_rows``'s arguments: the
# CUDA kernels by default, the portable ones on HIP (batchinv.gpu.attention_portable).


def attention_saved_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    causal: bool,
    softmax_scale: float | None,
    seqlens_q: Tensor | None,
    seqlens_k: Tensor | None,
    key_padding_mask: Tensor | None,
    backward=backward_rows,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of ``attention`` from its ``(out, lse [B, Hq, Sq])``."""
    batch, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    k_used, v_used, layout, index = _padded_layout(q, k, v, seqlens_q, seqlens_k, key_padding_mask)
    dq, dk, dv = backward(
        as_rows(q.reshape(batch * sq, hq, d).contiguous()),
        as_rows(k_used.reshape(batch * sk, hkv, d).contiguous()),
        as_rows(v_used.reshape(batch * sk, hkv, d).contiguous()),
        out.reshape(batch * sq, hq, d),
        lse.permute(1, 0, 2).reshape(hq, batch * sq),
        grad_out.reshape(batch * sq, hq, d),
        layout,
        causal,
        scale_of(softmax_scale, d),
    )
    dk, dv = dk.view(batch, sk, hkv, d), dv.view(batch, sk, hkv, d)
    if index is not None:  # the gather's backward, as autograd computes it
        dk = torch.zeros_like(k).scatter_add_(1, index, dk)
        dv = torch.zeros_like(v).scatter_add_(1, index, dv)
    return dq.view(q.shape), dk, dv


def attention_varlen_saved_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    causal: bool,
    softmax_scale: float | None,
    backward=backward_rows,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of ``attention_varlen`` from its ``(out, lse [Hq, Tq])``."""
    layout = _varlen_layout(cu_seqlens_q, cu_seqlens_k, q.device)
    rows = (as_rows(t.contiguous()) for t in (q, k, v))
    scale = scale_of(softmax_scale, q.shape[-1])
    return backward(*rows, out, lse, grad_out, layout, causal, scale)


def attention_with_kv_cache(
    q: Tensor,
    k_new: Tensor,
    v_new: Tensor,
    cache,
    seq_ids: Tensor | None = None,
    seqlens_new: Tensor | None = None,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    run=run_forward,
    **tuning,
):
    """CUDA ``batchinv.attention_with_kv_cache``: append, then attend straight from the cache
    storage (no copy); inference only.  ``seq_ids`` and ``seqlens_new`` are host (CPU) int64
    tensors or None; with them the call makes no host sync (the cache keeps its lengths on the
    host and the layout is uploaded from pinned memory).  ``run``: as in ``attention``."""
    n, s_new, hq, d = q.shape
    scale = scale_of(softmax_scale, d)
    ids, k_len = cache.append_host(k_new, v_new, seq_ids, seqlens_new)
    q_len = _full(n, s_new) if seqlens_new is None else seqlens_new
    bounds = kv_cache_bounds(q, cache)
    layout = make_layout(
        _host_arange(n, s_new),
        q_len,
        ids * cache.max_len,
        k_len,
        bounds.max_q_len,
        bounds.max_k_len,
        device=q.device,
    )
    storage = (cache.batch * cache.max_len, cache.num_kv_heads, cache.head_dim)
    out, lse = run(
        q.reshape(n * s_new, hq, d),
        cache.k.view(storage),
        cache.v.view(storage),
        layout,
        causal,
        scale,
        seqlens_new is not None,
        **tuning,
    )
    out = out.view(n, s_new, hq, d)
    if not return_lse:
        return out
    return out, lse.view(hq, n, s_new).permute(1, 0, 2).contiguous()

"""Token logprobs on CUDA: launches ``kernels_cu/token_logprobs.cu`` (sm_90a only).

Forward: one GEMM pass whose epilogue reduces each 256-column vocabulary tile to an online
log-sum-exp state ``(m, l, s)`` per token (``[T, ceil(V/256)]`` fp32, never the ``[T, V]``
logits), then one warp per token merges the states in a fixed order.  Backward: per
vocabulary chunk of ``GRAD_VOCAB_CHUNK`` columns, recompute the logits and write ``d_z``
(rounded once to the input dtype), add ``d_z @ W_chunk`` to an fp32 ``[T, H]`` buffer, and
compute ``d_W_chunk = d_zᵀ @ hidden`` (tokens reduced in order) straight into ``d_W``; the
last two GEMMs read ``W_chunk``, ``d_z`` and ``hidden`` through wgmma's transpose flags, so no
transposed copy is made.

Target ids are checked on the device (``mark_targets``, one launch): a bad id is replaced by
"ignored" for the kernels and its first position is read back once, after the forward's
launches, to raise ``IndexError`` (one synchronisation per forward call).  Under CUDA-graph
capture or ``device_checks.deferred()`` the same launch marks the device's persistent flag
instead (no sync), read by ``device_checks.raise_device_errors()``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import ModuleType

import torch
from torch import Tensor

from .. import device_checks
from ..runtime import (
    allow_dynamic_shared,
    current_raw_stream,
    kernel_for,
    launch,
    tensor_map_2d,
    uses_hopper,
)
from ..validation import report_bad_index

VOCAB_TILE = 256  # kVocabTile in the kernel: part of the forward's definition (bits)
GRAD_VOCAB_CHUNK = 4096  # vocabulary columns per backward step: part of d_hidden's definition
_WEIGHT_GRAD_BLOCK_M = 128  # d_W rows per CTA (token_logprobs_weight_grad_*: BM 128, BN 256)
_STAGE_K = 64
_STAGES = 4
_MAX_DIM = 2**31 - 1
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "f16"}
_ID_RANGE = {torch.int32: (-(2**31), 2**31 - 1), torch.int64: (-(2**63), 2**63 - 1)}
_MARK_KERNELS = {
    torch.int32: "token_logprobs_mark_targets_i32",
    torch.int64: "token_logprobs_mark_targets_i64",
}
_MARK_THREADS = 256


def _block_m(tokens: int) -> int:
    """Tile rows: a speed choice only (a row's arithmetic does not depend on its tile)."""
    return 128 if tokens >= 1024 else 64


def _threads(block_m: int) -> int:
    return 128 * (block_m // 64 + 1)


def _shared_bytes(block_m: int) -> int:
    # Same layout as linear.cu: stages of (BM + BN) x 64 k-columns, barriers, 1024 alignment.
    return _STAGES * (block_m + VOCAB_TILE) * _STAGE_K * 2 + 16 * _STAGES + 1024


def _kernel(name: str, device: torch.device, shared_bytes: int):
    kernel = kernel_for("token_logprobs", name, device)
    allow_dynamic_shared(kernel, shared_bytes, device.index)
    return kernel


def _tensor_map(t: Tensor, rows: int, cols: int, row_stride: int, box_rows: int) -> bytes:
    """A TMA map of ``rows x cols`` elements of ``t`` (rows ``row_stride`` elements apart);
    reads past ``cols`` or ``rows`` arrive as zeros."""
    name = _DTYPE_NAMES[t.dtype]
    return tensor_map_2d(
        t.data_ptr(), name, rows, cols, row_stride * 2, box_rows, 64, 128, t.device.index
    )


def _aligned(t: Tensor) -> Tensor:
    """``t`` itself when TMA can read it (16-byte aligned base), else an aligned copy."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


def check_gpu_args(hidden: Tensor, weight: Tensor) -> None:
    """What only the GPU path needs; the op has already run check_token_logprobs_args."""
    check_gpu_inputs(hidden, weight)
    if not uses_hopper(hidden.device):
        raise RuntimeError(
            "the GPU token_logprobs needs an sm_90 (Hopper) GPU and a build with 90a; "
            "batchinv does not fall back to another backend"
        )


def check_gpu_inputs(hidden: Tensor, weight: Tensor) -> None:
    """``check_gpu_args`` without the device requirement: what the portable path (HIP) checks,
    with the same errors as the CUDA path."""
    if hidden.dtype not in _DTYPE_NAMES:
        raise TypeError(
            f"the GPU token_logprobs takes bf16 or fp16 hidden and lm_head_weight, got "
            f"{hidden.dtype} (use batchinv.reference.token_logprobs on the CPU for fp32)"
        )
    hidden_size = weight.shape[1]
    if hidden_size == 0 or hidden_size % 8 != 0:
        raise ValueError(
            "the GPU token_logprobs needs H = lm_head_weight.shape[1] to be a positive multiple "
            f"of 8 (16-byte rows), got {hidden_size}"
        )
    if not weight.is_contiguous():
        raise ValueError("lm_head_weight must be contiguous on the GPU (call .contiguous() first)")
    for name, value in (("tokens", hidden.numel() // hidden_size), ("vocabulary", weight.shape[0])):
        if value > _MAX_DIM:
            raise ValueError(f"{name} = {value} exceeds {_MAX_DIM}")


def mark_targets_reference(
    target_ids: Tensor, ignore_index: int, vocab: int
) -> tuple[Tensor, Tensor]:
    """``(targets [T] int32 with -1 for ignored or bad ids, bad [T] bool)`` in torch ops: what
    ``token_logprobs_mark_targets_*`` computes, and the route for an ``ignore_index`` the ids'
    dtype cannot hold (torch's comparison then is not the kernel's)."""
    targets = target_ids.reshape(-1)
    clamped = targets.clamp(0, vocab - 1)
    outside = clamped != targets  # outside [0, vocab)
    low, high = _ID_RANGE[targets.dtype]
    if 0 <= ignore_index < vocab:  # the ignored id is in range: every outside id is bad
        bad = outside
        dropped = outside | (targets == ignore_index)
    elif low <= ignore_index <= high:  # the ignored id is outside: the others there are bad
        bad = outside & (targets != ignore_index)
        dropped = outside
    else:  # torch compares the ids with ignore_index cast to their dtype
        ignored = targets == ignore_index
        bad = outside & ~ignored
        dropped = outside | ignored
    # A kept id lies in [0, vocab), where clamping changes nothing.
    return clamped.masked_fill_(dropped, -1).to(torch.int32), bad


def mark_targets(
    target_ids: Tensor,
    ignore_index: int,
    vocab: int,
    first_bad: Tensor,
    targets32: Tensor | None = None,
) -> Tensor:
    """``targets [T]`` int32 (``targets32`` if given), -1 for ignored or bad ids, in one launch
    of ``token_logprobs_mark_targets_*``; the first bad position goes into ``first_bad``
    (int64 ``[1]``, ``atomicMin`` of an unsigned position: -1 stays where no id is bad).
    No synchronisation."""
    flat = target_ids.reshape(-1).contiguous()  # a copy only if the ids are strided
    count, device = flat.numel(), flat.device
    if targets32 is None:
        targets32 = torch.empty(count, dtype=torch.int32, device=device)
    low, high = _ID_RANGE[flat.dtype]
    if not low <= ignore_index <= high:  # rare: torch ops, with torch's comparison
        marked, bad = mark_targets_reference(flat, ignore_index, vocab)
        targets32.copy_(marked)
        found = torch.where(bad.any(), _first_position(bad), -1)
        # -1 is UINT64_MAX to the kernels: the unsigned minimum of the flag and the position.
        first_bad.copy_(
            torch.where((first_bad < 0) | ((found >= 0) & (found < first_bad)), found, first_bad)
        )
        return targets32
    if count:
        launch(
            kernel_for("token_logprobs", _MARK_KERNELS[flat.dtype], device),
            device,
            grid=(-(-count // _MARK_THREADS),),
            block=(_MARK_THREADS,),
            args=(flat, count, vocab, ignore_index, targets32, first_bad),
        )
    return targets32


def targets_flag(device: torch.device, check: bool, deferred: bool) -> Tensor:
    """The flag ``mark_targets`` writes: the device's persistent one for a deferred check, a
    fresh one for a check read at once, the unread scratch flag for no check."""
    if deferred:
        return device_checks.flag(device_checks.TOKEN_LOGPROBS_TARGETS, device)
    if check:
        return torch.full((1,), -1, dtype=torch.int64, device=device)  # UINT64_MAX
    return device_checks.unread_flag(device)


def checked_targets(target_ids: Tensor, ignore_index: int, vocab: int) -> Tensor:
    """``mark_targets`` with the op's target check: ``IndexError`` for the first bad id after
    one read back, or the device's flag marked where the check is deferred."""
    deferred = device_checks.deferring(target_ids.device)
    first_bad = targets_flag(target_ids.device, True, deferred)
    targets32 = mark_targets(target_ids, ignore_index, vocab, first_bad)
    if not deferred:
        raise_bad_targets(first_bad, target_ids, vocab)
    return targets32


def _first_position(bad: Tensor) -> Tensor:
    """The first True position of ``bad`` ``[T]``, or T (a 0-d tensor on its device)."""
    positions = torch.arange(bad.numel(), device=bad.device)
    return torch.where(bad, positions, bad.numel()).min()


def forward(
    hidden: Tensor,
    weight: Tensor,
    target_ids: Tensor,
    ignore_index: int,
    with_entropy: bool,
    check_targets: bool = True,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """``(logprob [T], lse [T], entropy [T] or None, targets32 [T])``, fp32, flat over tokens.
    ``check_targets=False`` skips reading the bad-target flag (no host sync); a bad target's
    row then gets a logprob of 0 and reads nothing out of bounds."""
    check_gpu_args(hidden, weight)
    return run_forward(
        _launch_partials, hidden, weight, target_ids, ignore_index, with_entropy, check_targets
    )


def run_forward(
    partials: Callable[..., None],
    hidden: Tensor,
    weight: Tensor,
    target_ids: Tensor,
    ignore_index: int,
    with_entropy: bool,
    check_targets: bool = True,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """``forward``'s frame, shared with the portable route: the outputs, the targets, the tile
    states' buffers, ``partials(rows, weight, targets32, target_logit, part_m, part_l,
    part_s)`` (a route's kernels: each token's target logit and the ``(m, l, s)`` state of
    each ``VOCAB_TILE``-column tile), then ``token_logprobs_finalize``'s merge in its fixed
    order and the target check."""
    vocab, hidden_size = weight.shape
    rows = hidden.reshape(-1, hidden_size)
    tokens = rows.shape[0]
    device = hidden.device
    logprob = torch.zeros(tokens, dtype=torch.float32, device=device)
    lse = torch.zeros(tokens, dtype=torch.float32, device=device)
    entropy = torch.zeros(tokens, dtype=torch.float32, device=device) if with_entropy else None
    targets32 = torch.empty(0, dtype=torch.int32, device=device)
    if tokens == 0:
        return logprob, lse, entropy, targets32
    deferred = check_targets and device_checks.deferring(device)
    first_bad = targets_flag(device, check_targets, deferred)
    targets32 = mark_targets(target_ids, ignore_index, vocab, first_bad)
    tiles = -(-vocab // VOCAB_TILE)
    part_m = torch.empty(tokens, tiles, dtype=torch.float32, device=device)
    part_l = torch.empty_like(part_m)
    part_s = torch.empty_like(part_m) if with_entropy else None
    target_logit = torch.zeros(tokens, dtype=torch.float32, device=device)
    partials(rows, weight, targets32, target_logit, part_m, part_l, part_s)
    launch(
        kernel_for("token_logprobs", "token_logprobs_finalize", device),
        device,
        grid=(-(-tokens // 4),),
        block=(128,),
        args=(
            part_m,
            part_l,
            0 if part_s is None else part_s,
            target_logit,
            targets32,
            tiles,
            tokens,
            logprob,
            lse,
            0 if entropy is None else entropy,
        ),
    )
    if check_targets and not deferred:
        raise_bad_targets(first_bad, target_ids, vocab)
    return logprob, lse, entropy, targets32


def _launch_partials(
    rows: Tensor,
    weight: Tensor,
    targets32: Tensor,
    target_logit: Tensor,
    part_m: Tensor,
    part_l: Tensor,
    part_s: Tensor | None,
) -> None:
    """``run_forward``'s ``partials`` on sm_90a: one GEMM whose epilogue reduces each tile."""
    tokens, hidden_size = rows.shape
    vocab, tiles, device = weight.shape[0], part_m.shape[1], rows.device
    rows, weight = _aligned(rows.contiguous()), _aligned(weight)
    block_m = _block_m(tokens)
    dtype_name = _DTYPE_NAMES[rows.dtype]
    shared = _shared_bytes(block_m)
    launch(
        _kernel(f"token_logprobs_partials_{dtype_name}_bm{block_m}", device, shared),
        device,
        grid=(-(-tokens // block_m) * tiles,),
        block=(_threads(block_m),),
        args=(
            _tensor_map(rows, tokens, hidden_size, hidden_size, block_m),
            _tensor_map(weight, vocab, hidden_size, hidden_size, VOCAB_TILE),
            targets32,
            target_logit,
            part_m,
            part_l,
            0 if part_s is None else part_s,
            tokens,
            vocab,
            hidden_size,
            tiles,
        ),
        shared_mem=shared,
    )


def shard_tile_states(
    hidden: Tensor, weight_shard: Tensor, shard_targets32: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """``(part_m, part_l, target_logit)`` of a vocabulary shard (vocab-parallel lm_head):
    ``part_m, part_l [T, ceil(V_shard / VOCAB_TILE)]`` fp32, the ``(m, l)`` state of each
    tile of ``weight_shard [V_shard, H]``'s rows, and ``target_logit [T]`` fp32 for the tokens
    whose ``shard_targets32`` (int32 ids into the shard's rows, -1 for none) falls in it
    (``0.0`` elsewhere).  The same kernel as ``forward``: a shard starting on a
    ``VOCAB_TILE`` boundary gives bitwise the full weight's states of those tiles."""
    check_gpu_args(hidden, weight_shard)
    vocab_shard, hidden_size = weight_shard.shape
    rows = hidden.reshape(-1, hidden_size)
    tokens, device = rows.shape[0], hidden.device
    tiles = -(-vocab_shard // VOCAB_TILE)
    part_m = torch.empty(tokens, tiles, dtype=torch.float32, device=device)
    part_l = torch.empty_like(part_m)
    target_logit = torch.zeros(tokens, dtype=torch.float32, device=device)
    if tokens:
        targets32 = shard_targets32.reshape(-1).to(torch.int32).contiguous()
        _launch_partials(rows, weight_shard, targets32, target_logit, part_m, part_l, None)
    return part_m, part_l, target_logit


def finalize_tile_states(
    part_m: Tensor, part_l: Tensor, target_logit: Tensor, targets32: Tensor
) -> tuple[Tensor, Tensor]:
    """``(logprob [T], lse [T])`` fp32 from the tile states of the whole vocabulary
    (``part_m, part_l [T, tiles]`` in the global tile order), each token's target logit and
    ``targets32 [T]`` (-1: ignored, logprob 0.0): ``token_logprobs_finalize``, the merge
    ``forward`` runs, so the same states give ``forward``'s bits."""
    tokens, tiles = part_m.shape
    device = part_m.device
    logprob = torch.zeros(tokens, dtype=torch.float32, device=device)
    lse = torch.zeros(tokens, dtype=torch.float32, device=device)
    if tokens == 0:
        return logprob, lse
    launch(
        kernel_for("token_logprobs", "token_logprobs_finalize", device),
        device,
        grid=(-(-tokens // 4),),
        block=(128,),
        args=(
            part_m.contiguous(),
            part_l.contiguous(),
            0,
            target_logit.contiguous(),
            targets32.to(torch.int32).contiguous(),
            tiles,
            tokens,
            logprob,
            lse,
            0,
        ),
    )
    return logprob, lse


# ----------------------------------------------------------------------------- eager no-grad path
# A forward that needs no gradient, on contiguous 16-byte aligned hidden and weight, keeps its
# launches per key (shapes, dtypes, device, the entropy flag): the kernels, grids, shared
# memory and integer arguments ``run_forward`` and ``_launch_partials`` choose for it, and the
# TMA maps of hidden and the weight per address (a decode loop's activations cycle through a
# few).  A call allocates its outputs once in their final shape and one workspace for the
# marked targets, the log-sum-exp, the target logits and the tile states, launches the three
# kernels (``mark_targets``' one, the partials, the merge) with pointers as ints and checks the
# targets as ``forward`` does: the general path's kernels and arguments, hence its bits.

_MAX_MAPS = 64  # per plan and operand: the addresses a decode loop's activations cycle through
_SEGMENT = 64  # fp32 elements: workspace segments start on 256-byte boundaries


@dataclasses.dataclass(frozen=True)
class _Lean:
    marks: dict  # ids dtype -> token_logprobs_mark_targets_* kernel
    mark_grid: tuple[int]
    partials: object
    finalize: object
    grid: tuple[int]
    block: tuple[int]
    shared: int
    finalize_grid: tuple[int]
    sizes: tuple[int, int, int, int]  # tokens, vocab, hidden size, tiles
    boxes: tuple[str, int]  # TMA maps: dtype name, box rows of hidden
    workspace: tuple[int, ...]  # 4-byte offsets: targets, lse, logit, m, l, s; size
    maps: tuple[dict, dict]  # address -> encoded TMA map, of hidden and of the weight


_LEAN: dict[tuple, _Lean | None] = {}
_MAX_LEAN = 512
_NO_LEAN = object()  # ``_LEAN.get``'s default: no plan made yet (a kept None: the general path)


def _segment(elements: int) -> int:
    return -(-elements // _SEGMENT) * _SEGMENT


def _lean_plan(hidden: Tensor, weight: Tensor, with_entropy: bool) -> _Lean | None:
    """The launches ``forward`` makes for contiguous, aligned operands (None: no tokens, the
    general path).  Raises ``check_gpu_args``' errors."""
    check_gpu_args(hidden, weight)
    vocab, hidden_size = weight.shape
    tokens = hidden.numel() // hidden_size
    if tokens == 0:
        return None
    device = hidden.device
    tiles = -(-vocab // VOCAB_TILE)
    block_m = _block_m(tokens)
    dtype_name = _DTYPE_NAMES[hidden.dtype]
    shared = _shared_bytes(block_m)
    partials = _kernel(f"token_logprobs_partials_{dtype_name}_bm{block_m}", device, shared)
    finalize = kernel_for("token_logprobs", "token_logprobs_finalize", device)
    states = _segment(tokens * tiles)
    rows = _segment(tokens)  # targets (int32), lse, target logits: a row's 4 bytes each
    targets_at, lse_at, logit_at, m_at = 0, rows, 2 * rows, 3 * rows
    l_at = m_at + states
    s_at = l_at + states
    size = s_at + (states if with_entropy else 0)
    marks = {
        dtype: kernel_for("token_logprobs", name, device) for dtype, name in _MARK_KERNELS.items()
    }
    return _Lean(
        marks,
        (-(-tokens // _MARK_THREADS),),
        partials,
        finalize,
        (-(-tokens // block_m) * tiles,),
        (_threads(block_m),),
        shared,
        (-(-tokens // 4),),
        (tokens, vocab, hidden_size, tiles),
        (dtype_name, block_m),
        (targets_at, lse_at, logit_at, m_at, l_at, s_at, size),
        ({}, {}),
    )


def _lean_map(lean: _Lean, operand: int, address: int, index: int) -> bytes:
    """The TMA map of operand 0 (hidden) or 1 (the weight) at ``address``, kept per address:
    ``_launch_partials``' maps."""
    maps = lean.maps[operand]
    encoded = maps.get(address)
    if encoded is None:
        tokens, vocab, hidden_size, _ = lean.sizes
        dtype_name, block_m = lean.boxes
        rows, box_rows = (tokens, block_m) if operand == 0 else (vocab, VOCAB_TILE)
        encoded = tensor_map_2d(
            address, dtype_name, rows, hidden_size, hidden_size * 2, box_rows, 64, 128, index
        )
        if len(maps) >= _MAX_MAPS:
            maps.clear()
        maps[address] = encoded
    return encoded


def forward_no_grad(
    hidden: Tensor, weight: Tensor, target_ids: Tensor, ignore_index: int, with_entropy: bool
) -> Tensor | tuple[Tensor, Tensor]:
    """``forward``'s logprobs (and entropy with ``with_entropy``) in ``target_ids.shape``, for
    a call that needs no gradient: the launches kept for its key where they apply (see
    above), else ``forward``.  Bad targets raise, or are recorded, as in ``forward``."""
    if hidden.is_contiguous() and weight.is_contiguous():
        h_ptr, w_ptr = hidden.data_ptr(), weight.data_ptr()
        device = hidden.device
        index = torch.cuda.current_device() if device.index is None else device.index
        aligned = not (h_ptr | w_ptr) & 15
        key = (hidden.shape, weight.shape, hidden.dtype, weight.dtype, index, with_entropy, aligned)
        lean = _LEAN.get(key, _NO_LEAN)
        if lean is _NO_LEAN:
            lean = _lean_plan(hidden, weight, with_entropy) if aligned else None
            if not torch.cuda.is_current_stream_capturing():
                if len(_LEAN) >= _MAX_LEAN:
                    _LEAN.clear()
                _LEAN[key] = lean
        if lean is not None:
            return _run_lean(lean, h_ptr, w_ptr, target_ids, ignore_index, with_entropy, index)
    logprob, _, entropy, _ = forward(hidden, weight, target_ids, ignore_index, with_entropy)
    shape = target_ids.shape
    return (logprob.view(shape), entropy.view(shape)) if with_entropy else logprob.view(shape)


def _run_lean(
    lean: _Lean,
    h_ptr: int,
    w_ptr: int,
    target_ids: Tensor,
    ignore_index: int,
    with_entropy: bool,
    index: int,
) -> Tensor | tuple[Tensor, Tensor]:
    """One call on a kept plan: two allocations, three launches (targets, partials, merge)."""
    tokens, vocab, hidden_size, tiles = lean.sizes
    device = target_ids.device
    shape = target_ids.shape
    # Every output element is written by the finalize kernel: no fill.
    out = torch.empty((2, *shape) if with_entropy else shape, dtype=torch.float32, device=device)
    targets_at, lse_at, logit_at, m_at, l_at, s_at, size = lean.workspace
    work = torch.empty(size, dtype=torch.float32, device=device)
    deferred = device_checks.deferring(device)
    first_bad = targets_flag(device, True, deferred)
    base, out_ptr = work.data_ptr(), out.data_ptr()
    targets_ptr = base + 4 * targets_at
    stream = current_raw_stream(index)
    ids = target_ids if target_ids.is_contiguous() else target_ids.contiguous()
    mark = lean.marks.get(ids.dtype)
    low, high = _ID_RANGE[ids.dtype]
    if low <= ignore_index <= high:  # mark_targets' launch, pointers as ints
        args = (ids.data_ptr(), tokens, vocab, ignore_index, targets_ptr, first_bad.data_ptr())
        mark(lean.mark_grid, (_MARK_THREADS,), args, 0, stream, index, False)
    else:
        targets32 = work[targets_at : targets_at + tokens].view(torch.int32)
        mark_targets(target_ids, ignore_index, vocab, first_bad, targets32)
    lse_ptr, logit_ptr = base + 4 * lse_at, base + 4 * logit_at
    m_ptr, l_ptr = base + 4 * m_at, base + 4 * l_at
    s_ptr = base + 4 * s_at if with_entropy else 0
    entropy_ptr = out_ptr + 4 * tokens if with_entropy else 0
    map_hidden = _lean_map(lean, 0, h_ptr, index)
    map_weight = _lean_map(lean, 1, w_ptr, index)
    lean.partials(
        lean.grid,
        lean.block,
        (map_hidden, map_weight, targets_ptr, logit_ptr, m_ptr, l_ptr, s_ptr)
        + (tokens, vocab, hidden_size, tiles),
        lean.shared,
        stream,
        index,
        False,
    )
    lean.finalize(
        lean.finalize_grid,
        (128,),
        (m_ptr, l_ptr, s_ptr, logit_ptr, targets_ptr, tiles, tokens, out_ptr, lse_ptr, entropy_ptr),
        0,
        stream,
        index,
        False,
    )
    if not deferred:
        raise_bad_targets(first_bad, target_ids, vocab)
    return (out[0], out[1]) if with_entropy else out


def raise_bad_targets(first_bad: Tensor, target_ids: Tensor, vocab: int) -> None:
    """``IndexError`` for the first bad target (``first_bad``: the flag ``mark_targets``
    wrote), after one read back: for a check not deferred."""
    position = int(first_bad.item())  # the one synchronisation: bad ids raise here
    if position != -1:
        report_bad_index("target_ids", target_ids, position, vocab)


def _weight_gradient_rows(rows: Tensor, targets32: Tensor) -> Tensor:
    """The hidden rows d_W reduces over: ``rows`` itself, unless an ignored row holds inf or NaN
    (its d_z is 0, but 0 * inf is NaN), then a copy with the ignored rows zeroed.  Finite
    garbage is harmless: its products are exact zeros.  Two small synchronisations."""
    ignored = (targets32 < 0).nonzero().squeeze(1)
    if ignored.numel() == 0 or torch.isfinite(rows.index_select(0, ignored)).all():
        return rows
    clean = rows.clone()
    clean[ignored] = 0
    return clean


def backward(
    grad_logprob: Tensor | None,
    grad_entropy: Tensor | None,
    hidden: Tensor,
    weight: Tensor,
    targets32: Tensor,
    lse: Tensor,
    entropy: Tensor | None,
    needs_hidden: bool,
    needs_weight: bool,
) -> tuple[Tensor | None, Tensor | None]:
    """``(d_hidden like hidden, d_weight like weight)``, either None when not needed.

    Live memory besides the inputs: ``d_W`` itself (``[V, H]``, the weight dtype), the fp32
    ``d_hidden`` accumulator (``[T, H]``) and one ``[T, GRAD_VOCAB_CHUNK]`` ``d_z`` buffer;
    both GEMMs read ``W``, ``d_z`` and ``hidden`` as they lie (no transposed copies)."""
    vocab, hidden_size = weight.shape
    rows = hidden.reshape(-1, hidden_size)
    tokens, device, dtype = rows.shape[0], hidden.device, hidden.dtype
    if tokens == 0 or not (needs_hidden or needs_weight):
        grad_hidden = torch.zeros_like(hidden) if needs_hidden else None
        return grad_hidden, torch.zeros_like(weight) if needs_weight else None
    rows, weight = _aligned(rows.contiguous()), _aligned(weight)
    # Before the large allocations, so its temporaries never add to the peak.
    weight_rows = _weight_gradient_rows(rows, targets32) if needs_weight else None
    grad_hidden = (
        torch.zeros(tokens, hidden_size, dtype=torch.float32, device=device)
        if needs_hidden
        else None
    )
    grad_weight = torch.empty_like(weight) if needs_weight else None  # every row is written
    zero = torch.zeros(tokens, dtype=torch.float32, device=device)
    g = zero if grad_logprob is None else grad_logprob.reshape(-1).float().contiguous()
    g_ent = None if grad_entropy is None else grad_entropy.reshape(-1).float().contiguous()
    chunk = min(GRAD_VOCAB_CHUNK, -(-vocab // 8) * 8)
    grad_z = torch.empty(tokens, chunk, dtype=dtype, device=device)
    block_m = _block_m(tokens)
    dtype_name = _DTYPE_NAMES[dtype]
    shared = _shared_bytes(block_m)
    grad_logits = _kernel(f"token_logprobs_grad_logits_{dtype_name}_bm{block_m}", device, shared)
    map_rows = _tensor_map(rows, tokens, hidden_size, hidden_size, block_m)
    if needs_hidden:
        accumulate = _kernel(f"token_logprobs_accumulate_{dtype_name}_bm{block_m}", device, shared)
    if needs_weight:
        weight_shared = _shared_bytes(_WEIGHT_GRAD_BLOCK_M)
        weight_grad = _kernel(f"token_logprobs_weight_grad_{dtype_name}", device, weight_shared)
        # hidden [T, H] as the N-major B operand: k = token rows, boxes of 64 x 64.
        map_weight_rows = _tensor_map(weight_rows, tokens, hidden_size, hidden_size, 64)
    for start in range(0, vocab, chunk):
        width = min(chunk, vocab - start)
        weight_chunk = weight[start : start + width]
        launch(
            grad_logits,
            device,
            grid=(-(-tokens // block_m) * -(-width // VOCAB_TILE),),
            block=(_threads(block_m),),
            args=(
                map_rows,
                _tensor_map(weight_chunk, width, hidden_size, hidden_size, VOCAB_TILE),
                targets32,
                lse,
                g,
                0 if g_ent is None else g_ent,
                0 if g_ent is None else entropy,
                grad_z,
                chunk,
                tokens,
                width,
                hidden_size,
                start,
            ),
            shared_mem=shared,
        )
        if needs_hidden:
            # d_z [T, width] K-major; W_chunk [width, H] as the N-major B operand.
            launch(
                accumulate,
                device,
                grid=(-(-tokens // block_m) * -(-hidden_size // VOCAB_TILE),),
                block=(_threads(block_m),),
                args=(
                    _tensor_map(grad_z, tokens, width, chunk, block_m),
                    _tensor_map(weight_chunk, width, hidden_size, hidden_size, 64),
                    grad_hidden,
                    tokens,
                    hidden_size,
                    width,
                ),
                shared_mem=shared,
            )
        if needs_weight:
            # d_z [T, width] as the M-major A operand (k = tokens); rows start..start+width of d_W.
            launch(
                weight_grad,
                device,
                grid=(-(-width // _WEIGHT_GRAD_BLOCK_M) * -(-hidden_size // VOCAB_TILE),),
                block=(_threads(_WEIGHT_GRAD_BLOCK_M),),
                args=(
                    _tensor_map(grad_z, tokens, width, chunk, 64),
                    map_weight_rows,
                    grad_weight[start : start + width],
                    width,
                    hidden_size,
                    tokens,
                ),
                shared_mem=weight_shared,
            )
    del grad_z, weight_rows  # freed before the rounded copy of d_hidden
    return _finish(grad_hidden, hidden), grad_weight


def _finish(grad_hidden: Tensor | None, hidden: Tensor) -> Tensor | None:
    return None if grad_hidden is None else grad_hidden.to(hidden.dtype).reshape(hidden.shape)


# ------------------------------------------------------------ autograd and registry entries


class TokenLogprobsFunction(torch.autograd.Function):
    """The differentiable op of a GPU route: ``apply(route, hidden, lm_head_weight,
    target_ids, ignore_index, with_entropy)``, ``route`` a module whose ``forward`` and
    ``backward`` have this module's signatures (this module: the CUDA kernels; or
    ``token_logprobs_portable``), looked up at each call."""

    @staticmethod
    def forward(
        ctx,
        route: ModuleType,
        hidden: Tensor,
        lm_head_weight: Tensor,
        target_ids: Tensor,
        ignore_index: int,
        with_entropy: bool,
    ):
        ctx.route = route
        logprob, lse, entropy, targets32 = route.forward(
            hidden, lm_head_weight, target_ids, ignore_index, with_entropy
        )
        ctx.save_for_backward(hidden, lm_head_weight, targets32, lse, entropy)
        # Unused outputs give None, so an unused entropy adds no term to the gradient.
        ctx.set_materialize_grads(False)
        logprob = logprob.reshape(target_ids.shape)
        if with_entropy:
            return logprob, entropy.reshape(target_ids.shape)
        return logprob

    @staticmethod
    def backward(ctx, grad_logprob: Tensor | None, grad_entropy: Tensor | None = None):
        hidden, lm_head_weight, targets32, lse, entropy = ctx.saved_tensors
        grad_hidden, grad_weight = ctx.route.backward(
            grad_logprob,
            grad_entropy,
            hidden,
            lm_head_weight,
            targets32,
            lse,
            entropy,
            ctx.needs_input_grad[1],
            ctx.needs_input_grad[2],
        )
        return None, grad_hidden, grad_weight, None, None, None


def registry_entries(route: ModuleType) -> tuple[Callable, Callable, Callable]:
    """``(token_logprobs, saving_forward, saved_backward)``: the registry's three entries of a
    GPU route, around the route module's ``forward`` and ``backward`` (this module's or
    ``token_logprobs_portable``'s), looked up at each call."""

    def token_logprobs(
        hidden: Tensor,
        lm_head_weight: Tensor,
        target_ids: Tensor,
        ignore_index: int,
        *,
        vocab_chunk: int,
        return_entropy: bool,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """The registry's ``token_logprobs`` (after the op's checks), differentiable in
        ``hidden`` and ``lm_head_weight``; ``vocab_chunk`` orders the CPU reference only."""
        return TokenLogprobsFunction.apply(
            route, hidden, lm_head_weight, target_ids, ignore_index, bool(return_entropy)
        )

    def saving_forward(
        hidden: Tensor,
        lm_head_weight: Tensor,
        target_ids: Tensor,
        ignore_index: int,
        with_entropy: bool,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The registry's ``token_logprobs.saving_forward``: ``(logprobs, entropy or an empty
        tensor, lse)``, each fp32 of ``target_ids.shape``; the eager forward's bits."""
        logprob, lse, entropy, _ = route.forward(
            hidden, lm_head_weight, target_ids, ignore_index, with_entropy
        )
        shape = target_ids.shape
        entropy = entropy.reshape(shape) if with_entropy else logprob.new_empty((0,))
        return logprob.reshape(shape), entropy, lse.reshape(shape)

    def saved_backward(
        grad_logprob: Tensor,
        grad_entropy: Tensor | None,
        hidden: Tensor,
        lm_head_weight: Tensor,
        target_ids: Tensor,
        ignore_index: int,
        lse: Tensor,
        entropy: Tensor | None,
        needs: tuple[bool, bool],
    ) -> tuple[Tensor | None, Tensor | None]:
        """The registry's ``token_logprobs.saved_backward``: ``(d_hidden, d_weight)`` from
        ``saving_forward``'s outputs (None where ``needs`` is False; ``grad_entropy`` and
        ``entropy`` None when the entropy was not requested); the eager backward's bits."""
        device = target_ids.device  # the forward checked the targets
        targets32 = mark_targets(
            target_ids, ignore_index, lm_head_weight.shape[0], device_checks.unread_flag(device)
        )
        return route.backward(
            grad_logprob,
            grad_entropy,
            hidden,
            lm_head_weight,
            targets32,
            lse.reshape(-1),
            None if entropy is None else entropy.reshape(-1),
            needs[0],
            needs[1],
        )

    return token_logprobs, saving_forward, saved_backward

"""The vocab-parallel lm_head: logits and token logprobs with the single GPU's bits.

Rank r of T holds the vocabulary rows ``vocab_ranges(vocab, T)[r]``: contiguous whole tiles
of ``VOCAB_TILE`` columns (the last range ends at ``vocab``).  ``hidden`` is replicated (every
rank passes the same tensor).

- ``vocab_parallel_logits``: each rank's ``batchinv.lm_head`` columns (bitwise the single
  GPU's: splitting N does not touch the K order), gathered in rank order.
- ``vocab_parallel_token_logprobs``: each rank computes the ``(m, l)`` state of its tiles and
  the target logit of the tokens whose target it holds; the states and logits are gathered
  (fp32 bytes, no arithmetic) and every rank merges all the tiles in the global order.  A
  tile's state depends only on its own columns, so the states are the single GPU's and the
  result is bitwise ``batchinv.token_logprobs`` of the full weight on CUDA.  On the CPU it is
  bitwise ``batchinv.reference.token_logprobs.token_logprobs_tiled`` (256-column tiles merged
  left to right) for every T, not the CPU op's default chunking.  The owner's target logit is
  picked by index, never summed with the other ranks' zeros (``-0.0 + 0.0`` is ``+0.0``).

Both are forward-only (no gradient through the gathers) and return no entropy.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..gpu import token_logprobs as gpu
from ..ops.lm_head import lm_head
from ..reference import token_logprobs as reference
from ..reference.token_logprobs import DEFAULT_IGNORE_INDEX, VOCAB_TILE
from ..validation import check_index_range, check_token_logprobs_args
from .all_reduce import gather_stacked, world_and_rank
from .linear import _forward_only
from .tree import group_ranges

if gpu.VOCAB_TILE != VOCAB_TILE:  # one tile for both backends: the split follows it
    raise ImportError("VOCAB_TILE differs between the reference and the CUDA route")


def vocab_ranges(vocab: int, world: int) -> list[tuple[int, int]]:
    """The vocabulary rows ``[start, stop)`` of each rank: whole ``VOCAB_TILE`` tiles,
    balanced (tile counts differ by at most one, larger first), the last ending at
    ``vocab``.  ValueError naming ``world`` when there are fewer tiles than ranks."""
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise ValueError(f"vocab must be a positive int, got {vocab!r}")
    tiles = -(-vocab // VOCAB_TILE)
    if isinstance(world, bool) or not isinstance(world, int) or not 1 <= world <= tiles:
        raise ValueError(
            f"world must be an int in [1, {tiles}] (vocab = {vocab} has {tiles} tiles of "
            f"{VOCAB_TILE}, each rank holds at least one), got {world!r}"
        )
    return [(lo * VOCAB_TILE, min(hi * VOCAB_TILE, vocab)) for lo, hi in group_ranges(tiles, world)]


def _shard_bounds(
    weight_shard: Tensor, vocab: int, group: dist.ProcessGroup | None
) -> tuple[int, int, list[tuple[int, int]]]:
    world, rank = world_and_rank(group)
    ranges = vocab_ranges(vocab, world)
    start, stop = ranges[rank]
    if weight_shard.dim() != 2 or weight_shard.shape[0] != stop - start:
        raise ValueError(
            f"weight_shard must hold rank {rank}'s {stop - start} vocabulary rows "
            f"[{start}, {stop}) of vocab = {vocab} at world = {world} (vocab_ranges), got shape "
            f"{tuple(weight_shard.shape)}"
        )
    return start, stop, ranges


def _owner_logit(gathered: Tensor, targets: Tensor, ranges: list[tuple[int, int]]) -> Tensor:
    """``[T]``: each token's target logit from the rank whose range holds the target,
    picked by index from ``gathered [world, T]`` (the other ranks hold ``0.0`` there; adding
    them would turn a ``-0.0`` logit into ``+0.0``).  Targets < 0 (ignored) take rank 0's."""
    stops = torch.tensor([stop for _, stop in ranges], device=targets.device)
    owner = torch.searchsorted(stops, targets.clamp(min=0), right=True)
    owner = owner.clamp(max=len(ranges) - 1)
    return gathered.gather(0, owner.unsqueeze(0)).squeeze(0)


def vocab_parallel_logits(
    hidden: Tensor, weight_shard: Tensor, *, vocab: int, group: dist.ProcessGroup | None = None
) -> Tensor:
    """The full logits ``[..., vocab]`` in ``hidden``'s dtype on every rank, bitwise
    ``batchinv.lm_head(hidden, weight)`` of the full weight.  Forward-only."""
    start, stop, ranges = _shard_bounds(weight_shard, vocab, group)
    local = lm_head(hidden, weight_shard)
    widest = max(b - a for a, b in ranges)
    with torch.no_grad():
        padded = local.new_zeros((*local.shape[:-1], widest))
        padded[..., : stop - start] = local
        stacked = gather_stacked(padded, group)
        out = torch.cat([stacked[r, ..., : b - a] for r, (a, b) in enumerate(ranges)], dim=-1)
    return _forward_only(out, hidden, weight_shard)


def vocab_parallel_token_logprobs(
    hidden: Tensor,
    weight_shard: Tensor,
    target_ids: Tensor,
    ignore_index: int = DEFAULT_IGNORE_INDEX,
    *,
    vocab: int,
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """fp32 ``log_softmax(hidden @ weightᵀ)[target_ids]`` of the full weight, on every rank,
    from this rank's ``weight_shard`` (rows ``vocab_ranges(vocab, world)[rank]``).

    ``hidden [..., H]`` and ``target_ids [...]`` are the same on every rank.  A target that is
    neither ``ignore_index`` nor in ``[0, vocab)`` raises ``batchinv.token_logprobs``' error
    (checked on the full ids before the split); ignored tokens give 0.0.  CUDA: bitwise
    ``batchinv.token_logprobs`` (bf16/fp16, sm_90); CPU: bitwise
    ``token_logprobs_tiled`` (see the module doc).  Forward-only, no entropy."""
    start, stop, ranges = _shard_bounds(weight_shard, vocab, group)
    check_token_logprobs_args(
        hidden, weight_shard, target_ids, ignore_index, VOCAB_TILE, check_values=False
    )
    on_cpu = hidden.device.type == "cpu"
    if on_cpu:
        check_index_range("target_ids", target_ids, vocab, allowed=ignore_index)
        targets = target_ids.reshape(-1).long()
        targets = torch.where(targets == ignore_index, -1, targets)
    else:
        targets32 = gpu.checked_targets(target_ids, ignore_index, vocab)  # as the op checks
        targets = targets32.long()
    tokens = targets.numel()
    if tokens == 0:
        return torch.zeros(target_ids.shape, dtype=torch.float32, device=hidden.device)
    with torch.no_grad():
        inside = (targets >= start) & (targets < stop)
        local_targets = torch.where(inside, targets - start, -1)
        rows = hidden.reshape(tokens, hidden.shape[-1])
        if on_cpu:
            part_m, part_l, target_logit = reference.tile_states(
                rows.float(), weight_shard, local_targets
            )
        else:
            part_m, part_l, target_logit = gpu.shard_tile_states(
                rows, weight_shard, local_targets.to(torch.int32)
            )
        tile_counts = [-(-(b - a) // VOCAB_TILE) for a, b in ranges]
        states = part_m.new_zeros((2, tokens, max(tile_counts)))
        states[0, :, : part_m.shape[1]] = part_m
        states[1, :, : part_l.shape[1]] = part_l
        all_states = gather_stacked(states, group)  # [world, 2, T, most tiles]
        all_logits = gather_stacked(target_logit, group)  # [world, T]
        merged = torch.cat(
            [all_states[r, :, :, :count] for r, count in enumerate(tile_counts)], dim=-1
        )
        part_m, part_l = merged[0].contiguous(), merged[1].contiguous()
        target_logit = _owner_logit(all_logits, targets, ranges)
        if on_cpu:
            logprob, _ = reference.merge_tile_states(part_m, part_l, target_logit, targets >= 0)
        else:
            logprob, _ = gpu.finalize_tile_states(part_m, part_l, target_logit, targets32)
    return _forward_only(logprob.reshape(target_ids.shape), hidden, weight_shard)


__all__ = ["vocab_parallel_logits", "vocab_parallel_token_logprobs", "vocab_ranges"]

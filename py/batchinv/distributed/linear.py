"""Tensor-parallel linear layers whose outputs are bitwise the single GPU's.

Column-parallel (q/k/v, gate/up, the lm_head's logits): rank r holds output rows
``shard_columns(weight, r, T)``.  Splitting N leaves every output column's K reduction as
it is, so each rank's columns are bitwise ``batchinv.linear``'s for those columns and the
gathered output is the single GPU's.

Row-parallel (o_proj, down_proj): rank r holds the K columns of whole K groups
(``shard_k``: groups ``group_ranges(K_GROUPS, T)[r]`` of width ``k_group_width(K)``).  It
computes its groups' fp32 partials (``linear_k_group_partials``), reduces the complete
subtrees of its range (``tree.reduce_range``), gathers every rank's node sums (fp32, a
copy of bytes), finishes the fixed tree, adds the bias once and rounds once: bitwise
``batchinv.linear_k_groups`` of the unsharded layer for every world size from 1 to
``K_GROUPS`` (not ``batchinv.linear``: a different K order).

The layers are forward-only: the gathered outputs carry no autograd graph, and a backward
through them raises ``RuntimeError`` rather than returning a gradient that misses the other
ranks' terms.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..ops.linear import linear
from ..ops.linear_k_groups import (
    K_GROUPS,
    k_group_tree_finish,
    k_group_width,
    linear_k_group_partials,
)
from .all_reduce import gather_stacked, gather_variable, world_and_rank
from .tree import canonical_nodes, finish_tree, group_ranges, node_counts, reduce_range


def _check_rank(rank: int, world: int) -> None:
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive int, got {world!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"rank must be an int in [0, {world}), got {rank!r}")


def column_range(out_features: int, rank: int, world: int) -> tuple[int, int]:
    """The output rows ``[start, stop)`` rank ``rank`` holds: equal blocks, so
    ``out_features`` must be divisible by ``world``."""
    _check_rank(rank, world)
    if out_features % world:
        raise ValueError(
            f"world = {world} must divide the output features ({out_features}) of a "
            "column-parallel layer"
        )
    width = out_features // world
    return rank * width, (rank + 1) * width


def shard_columns(weight: Tensor, rank: int, world: int) -> Tensor:
    """Rank ``rank``'s rows of ``weight [out, in]`` (or of a bias ``[out]``): a
    column-parallel layer's shard (output features split in equal blocks)."""
    start, stop = column_range(weight.shape[0], rank, world)
    return weight[start:stop]


def k_range(in_features: int, rank: int, world: int) -> tuple[int, int]:
    """The K columns ``[start, stop)`` rank ``rank`` holds in a row-parallel layer: its
    groups ``group_ranges(K_GROUPS, world)[rank]`` of width ``k_group_width(in_features)``
    (the last group may be partial, a rank's range may be empty when K is small)."""
    _check_rank(rank, world)
    lo, hi = group_ranges(K_GROUPS, world)[rank]
    width = k_group_width(in_features)
    return min(lo * width, in_features), min(hi * width, in_features)


def shard_k(weight: Tensor, rank: int, world: int) -> Tensor:
    """Rank ``rank``'s K columns of ``weight [out, in]`` for a row-parallel layer (x is
    sharded the same way: ``x[..., start:stop]`` with ``k_range``)."""
    start, stop = k_range(weight.shape[-1], rank, world)
    return weight[..., start:stop]


class _ForwardOnly(torch.autograd.Function):
    """Passes ``out`` through; a backward through it raises (the layer is forward-only)."""

    @staticmethod
    def forward(ctx, out: Tensor, *inputs: Tensor) -> Tensor:
        return out

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            "batchinv.distributed layers are forward-only: a gradient through a gathered or "
            "row-parallel output needs the other ranks' terms, which this layer does not "
            "compute (run it under torch.no_grad() or train with the single-GPU ops)"
        )


def _forward_only(out: Tensor, *inputs: Tensor | None) -> Tensor:
    tracked = [t for t in inputs if t is not None and t.requires_grad]
    if not tracked or not torch.is_grad_enabled():
        return out
    return _ForwardOnly.apply(out.detach(), *tracked)


def column_parallel_linear(
    x: Tensor,
    weight_shard: Tensor,
    bias_shard: Tensor | None = None,
    *,
    gather_output: bool,
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """``batchinv.linear(x, weight_shard, bias_shard)``: this rank's output columns, bitwise
    the single GPU's; with ``gather_output`` every rank's columns concatenated in rank order
    (``[..., out_features]``, the full layer's output bitwise).

    Every rank holds the same number of rows (``shard_columns``).  Without gathering the
    result is differentiable like ``batchinv.linear`` (this rank's part of the gradients);
    the gathered output is forward-only."""
    local = linear(x, weight_shard, bias_shard)
    if not gather_output:
        return local
    with torch.no_grad():
        stacked = gather_stacked(local, group)  # [world, ..., n]
        out = torch.cat(stacked.unbind(0), dim=-1)
    return _forward_only(out, x, weight_shard, bias_shard)


def row_parallel_linear(
    x_shard: Tensor,
    weight_shard: Tensor,
    bias: Tensor | None = None,
    *,
    in_features: int,
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """The full layer's output ``[..., out_features]`` in ``x_shard``'s dtype, on every rank,
    bitwise ``batchinv.linear_k_groups(x, weight, bias)`` of the unsharded layer.

    ``x_shard [..., k]`` and ``weight_shard [out, k]`` are this rank's K columns
    (``k_range(in_features, rank, world)``); ``bias [out]`` is the full bias (replicated,
    added once after the tree).  Forward-only (see the module doc)."""
    world, rank = world_and_rank(group)
    start, stop = k_range(in_features, rank, world)
    if weight_shard.dim() != 2 or weight_shard.shape[1] != stop - start:
        raise ValueError(
            f"weight_shard must be [out_features, {stop - start}] (rank {rank} of {world} holds "
            f"K columns [{start}, {stop}) of in_features = {in_features}), got "
            f"{tuple(weight_shard.shape)}"
        )
    if x_shard.dim() < 1 or x_shard.shape[-1] != stop - start:
        raise ValueError(
            f"x_shard must be [..., {stop - start}] (rank {rank} of {world} holds K columns "
            f"[{start}, {stop})), got {tuple(x_shard.shape)}"
        )
    out_features = weight_shard.shape[0]
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != out_features):
        raise ValueError(
            f"bias must be the full [out_features = {out_features}] bias, got {tuple(bias.shape)}"
        )
    lo, hi = group_ranges(K_GROUPS, world)[rank]
    width = k_group_width(in_features)
    with torch.no_grad():
        partials = _rank_partials(x_shard, weight_shard, width, hi - lo)
        sums = reduce_range(partials, lo, hi, K_GROUPS)
        if all(count == 1 for count in node_counts(K_GROUPS, world)):
            # T divides K_GROUPS: one aligned node per rank, so the rest of the tree is the
            # tree over the ranks' nodes in rank order: one gather, one finishing launch.
            out = k_group_tree_finish(gather_stacked(sums[0], group), bias, x_shard.dtype)
        else:
            out = _finish_from_nodes(sums, bias, x_shard, world, group)
    return _forward_only(out, x_shard, weight_shard, bias)


def _finish_from_nodes(
    sums: list[Tensor],
    bias: Tensor | None,
    x_shard: Tensor,
    world: int,
    group: dist.ProcessGroup | None,
) -> Tensor:
    """Any world size: every rank's canonical node sums gathered, the tree finished from
    them, the bias, one rounding."""
    gathered = gather_variable(
        sums,
        node_counts(K_GROUPS, world),
        group,
        shape=sums[0].shape,
        dtype=torch.float32,
        device=x_shard.device,
    )
    nodes = {}
    for (r_lo, r_hi), rank_sums in zip(group_ranges(K_GROUPS, world), gathered, strict=True):
        nodes.update(zip(canonical_nodes(r_lo, r_hi, K_GROUPS), rank_sums, strict=True))
    total = finish_tree(nodes, K_GROUPS)
    if bias is not None:
        total = total + bias.float()
    return total.to(x_shard.dtype)


def _rank_partials(x_shard: Tensor, weight_shard: Tensor, width: int, groups: int) -> Tensor:
    """fp32 ``[groups, ..., out]``: the partials of this rank's groups.  A rank whose groups
    all lie past the end of K (small K) holds no column: its partials are ``+0.0``."""
    if x_shard.shape[-1] == 0:
        shape = (groups, *x_shard.shape[:-1], weight_shard.shape[0])
        return torch.zeros(shape, dtype=torch.float32, device=x_shard.device)
    return linear_k_group_partials(x_shard, weight_shard, group_width=width, groups=groups)


class ColumnParallelLinear(nn.Module):
    """A column-parallel ``nn.Linear`` (forward: ``column_parallel_linear``); build it with
    ``from_full``.  Holds this rank's rows of the weight and bias."""

    def __init__(
        self,
        weight_shard: Tensor,
        bias_shard: Tensor | None = None,
        *,
        gather_output: bool = True,
        group: dist.ProcessGroup | None = None,
    ):
        super().__init__()
        self.weight = nn.Parameter(weight_shard)
        self.bias = None if bias_shard is None else nn.Parameter(bias_shard)
        self.gather_output = gather_output
        self.group = group

    @classmethod
    def from_full(
        cls,
        weight: Tensor,
        bias: Tensor | None,
        rank: int,
        world: int,
        group: dist.ProcessGroup | None = None,
        *,
        gather_output: bool = True,
    ) -> ColumnParallelLinear:
        weight_shard = shard_columns(weight, rank, world).clone()
        bias_shard = None if bias is None else shard_columns(bias, rank, world).clone()
        return cls(weight_shard, bias_shard, gather_output=gather_output, group=group)

    def forward(self, x: Tensor) -> Tensor:
        return column_parallel_linear(
            x, self.weight, self.bias, gather_output=self.gather_output, group=self.group
        )


class RowParallelLinear(nn.Module):
    """A row-parallel ``nn.Linear`` (forward: ``row_parallel_linear`` of this rank's K
    columns of the input); build it with ``from_full``.  Holds this rank's K columns of the
    weight and the full bias."""

    def __init__(
        self,
        weight_shard: Tensor,
        bias: Tensor | None = None,
        *,
        in_features: int,
        group: dist.ProcessGroup | None = None,
    ):
        super().__init__()
        self.weight = nn.Parameter(weight_shard)
        self.bias = None if bias is None else nn.Parameter(bias)
        self.in_features = in_features
        self.group = group

    @classmethod
    def from_full(
        cls,
        weight: Tensor,
        bias: Tensor | None,
        rank: int,
        world: int,
        group: dist.ProcessGroup | None = None,
    ) -> RowParallelLinear:
        in_features = weight.shape[1]
        weight_shard = shard_k(weight, rank, world).clone()
        bias = None if bias is None else bias.clone()
        return cls(weight_shard, bias, in_features=in_features, group=group)

    def shard_input(self, x: Tensor) -> Tensor:
        """This rank's K columns of a full input ``x [..., in_features]``."""
        world, rank = world_and_rank(self.group)
        start, stop = k_range(self.in_features, rank, world)
        return x[..., start:stop]

    def forward(self, x_shard: Tensor) -> Tensor:
        return row_parallel_linear(
            x_shard, self.weight, self.bias, in_features=self.in_features, group=self.group
        )


__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "column_parallel_linear",
    "column_range",
    "k_range",
    "row_parallel_linear",
    "shard_columns",
    "shard_k",
]

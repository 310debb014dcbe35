"""The fixed trees of tensor parallelism: which K groups a rank holds and how sums meet.

A row-parallel layer splits K into ``K_GROUPS`` groups (``batchinv.linear_k_groups``) and
combines the fp32 group partials in one balanced binary tree.  Rank r of T holds the
contiguous groups ``group_ranges(K_GROUPS, T)[r]``; it reduces the complete subtrees inside
its range (the range's canonical segment-tree nodes), every rank receives every node sum and
finishes the same tree.  Each node sum is the subtree value the single GPU computes (the same
fp32 adds of the same operands in the same order), so the finished tree is bitwise the
single GPU's, whatever T.  Nothing here communicates: pure torch adds, testable in one
process.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import Tensor

from ..ops.linear_k_groups import k_group_tree_sum

Node = tuple[int, int]


def _check_power_of_two(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if value & (value - 1):
        raise ValueError(f"{name} must be a power of two (the tree is balanced), got {value}")


def group_ranges(groups: int, world: int) -> list[Node]:
    """Balanced contiguous ranges ``[lo, hi)`` of ``groups`` leaves over ``world`` ranks:
    sizes differ by at most one, the larger ranges first (8 over 3 -> [0,3) [3,6) [6,8)).

    Every rank holds at least one leaf: ``1 <= world <= groups`` (ValueError naming
    ``world`` otherwise)."""
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"groups must be a positive int, got {groups!r}")
    if isinstance(world, bool) or not isinstance(world, int) or not 1 <= world <= groups:
        raise ValueError(
            f"world must be an int in [1, {groups}] (every rank holds at least one of the "
            f"{groups} groups), got {world!r}"
        )
    base, extra = divmod(groups, world)
    ranges, lo = [], 0
    for rank in range(world):
        hi = lo + base + (1 if rank < extra else 0)
        ranges.append((lo, hi))
        lo = hi
    return ranges


def canonical_nodes(lo: int, hi: int, groups: int) -> list[Node]:
    """The segment-tree nodes that exactly cover ``[lo, hi)`` in the balanced tree over
    ``groups`` leaves (a power of two), left to right: each node an aligned power-of-two
    range whose parent is not inside ``[lo, hi)``."""
    _check_power_of_two("groups", groups)
    if not 0 <= lo < hi <= groups:
        raise ValueError(f"need 0 <= lo < hi <= groups = {groups}, got lo = {lo}, hi = {hi}")
    nodes: list[Node] = []

    def visit(a: int, b: int) -> None:
        if b <= lo or hi <= a:
            return
        if lo <= a and b <= hi:
            nodes.append((a, b))
            return
        mid = (a + b) // 2
        visit(a, mid)
        visit(mid, b)

    visit(0, groups)
    return nodes


def reduce_range(partials: Tensor, lo: int, hi: int, groups: int) -> list[Tensor]:
    """The fp32 sums of ``canonical_nodes(lo, hi, groups)``, left to right, from the
    partials ``[hi - lo, ...]`` of groups ``lo .. hi-1`` (each node by
    ``k_group_tree_sum``, the single GPU's pairing)."""
    if partials.dim() < 1 or partials.shape[0] != hi - lo:
        raise ValueError(
            f"partials must have shape [hi - lo = {hi - lo}, ...], got {tuple(partials.shape)}"
        )
    return [k_group_tree_sum(partials[a - lo : b - lo]) for a, b in canonical_nodes(lo, hi, groups)]


def finish_tree(nodes: Mapping[Node, Tensor], groups: int) -> Tensor:
    """The root of the balanced tree over ``groups`` leaves, from node sums that tile
    ``[0, groups)`` (each ``(lo, hi)`` an aligned power-of-two range): a node present is used
    as it is, any other range is ``tree(first half) + tree(second half)``.  Every node must be
    used exactly once (ValueError naming ``nodes`` for gaps, overlaps or unaligned ranges)."""
    _check_power_of_two("groups", groups)
    used: set[Node] = set()

    def tree(a: int, b: int) -> Tensor:
        if (a, b) in nodes:
            used.add((a, b))
            return nodes[(a, b)]
        if b - a == 1:
            raise ValueError(
                f"nodes must tile [0, {groups}) with aligned power-of-two ranges: nothing "
                f"covers group {a} (got {sorted(nodes)})"
            )
        mid = (a + b) // 2
        return tree(a, mid) + tree(mid, b)

    root = tree(0, groups)
    if used != set(nodes):
        raise ValueError(
            f"nodes must tile [0, {groups}) exactly once with aligned power-of-two ranges; "
            f"unused: {sorted(set(nodes) - used)}"
        )
    return root


def rank_tree_sum(values: Sequence[Tensor] | Tensor) -> Tensor:
    """The fixed tree over ranks (``invariant_all_reduce``): pair neighbours level by level,
    an odd last element carried up unchanged, in the operands' dtype.  For a power-of-two
    count it is the K-group tree's pairing; for 3 it is ``(v0 + v1) + v2``."""
    level = list(values.unbind(0) if isinstance(values, Tensor) else values)
    if not level:
        raise ValueError("values must hold at least one tensor")
    while len(level) > 1:
        paired = [level[i] + level[i + 1] for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            paired.append(level[-1])
        level = paired
    return level[0]


def node_counts(groups: int, world: int) -> list[int]:
    """How many canonical nodes each rank sends (known to every rank without a message)."""
    return [len(canonical_nodes(lo, hi, groups)) for lo, hi in group_ranges(groups, world)]


__all__ = [
    "canonical_nodes",
    "finish_tree",
    "group_ranges",
    "node_counts",
    "rank_tree_sum",
    "reduce_range",
]

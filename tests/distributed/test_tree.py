"""The trees and splits of tensor parallelism, in one process (no process group).

Canonical nodes for every range; ``finish_tree`` from every world size's nodes equals the
single GPU's tree bitwise on values where other orders give other bits; the owner's target
logit is selected, never summed (a ``-0.0`` logit survives); the split helpers and their
errors; the CPU tiled token logprobs equal the reference with 256-column chunks.
"""

from __future__ import annotations

import pytest
import torch

from batchinv import K_GROUPS, k_group_tree_sum, k_group_width
from batchinv.contract import assert_bitwise_equal
from batchinv.distributed import (
    canonical_nodes,
    column_range,
    finish_tree,
    group_ranges,
    k_range,
    node_counts,
    rank_tree_sum,
    reduce_range,
    shard_columns,
    shard_k,
    vocab_ranges,
)
from batchinv.distributed.lm_head import _owner_logit
from batchinv.reference.token_logprobs import VOCAB_TILE, token_logprobs, token_logprobs_tiled


def _crafted_partials() -> torch.Tensor:
    """``[8, 4]`` fp32 partials whose sum depends on the order (magnitudes 1e-3 .. 1e8)."""
    generator = torch.Generator().manual_seed(3)
    scale = 10.0 ** torch.randint(-3, 9, (K_GROUPS, 4), generator=generator)
    values = torch.randn(K_GROUPS, 4, generator=generator) * scale
    values[:, 0] = torch.tensor([1e8, 1.0, -1e8, 1.0, 3.0, -7e7, 7e7, 0.5])
    return values.float()


def test_group_ranges_are_balanced_larger_first():
    assert group_ranges(8, 3) == [(0, 3), (3, 6), (6, 8)]
    assert group_ranges(8, 8) == [(g, g + 1) for g in range(8)]
    for world in range(1, 9):
        ranges = group_ranges(8, world)
        sizes = [hi - lo for lo, hi in ranges]
        assert ranges[0][0] == 0 and ranges[-1][1] == 8
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize("world", (0, 9, 2.0, True))
def test_group_ranges_reject_bad_world(world):
    with pytest.raises(ValueError, match="world"):
        group_ranges(8, world)


def test_canonical_nodes_for_every_range():
    assert canonical_nodes(0, 3, 8) == [(0, 2), (2, 3)]
    assert canonical_nodes(3, 6, 8) == [(3, 4), (4, 6)]
    assert canonical_nodes(6, 8, 8) == [(6, 8)]
    assert canonical_nodes(0, 8, 8) == [(0, 8)]
    for lo in range(8):
        for hi in range(lo + 1, 9):
            nodes = canonical_nodes(lo, hi, 8)
            assert nodes[0][0] == lo and nodes[-1][1] == hi
            assert all(a[1] == b[0] for a, b in zip(nodes, nodes[1:], strict=False))
            for a, b in nodes:
                size = b - a
                assert size & (size - 1) == 0 and a % size == 0  # an aligned tree node
                parent = (a - a % (2 * size), a - a % (2 * size) + 2 * size)
                assert not (lo <= parent[0] and parent[1] <= hi)  # the largest node there


@pytest.mark.parametrize("world", range(1, 9))
def test_finish_tree_from_every_world_size_is_the_single_gpu_tree(world):
    partials = _crafted_partials()
    expected = k_group_tree_sum(partials)
    nodes = {}
    for lo, hi in group_ranges(K_GROUPS, world):
        sums = reduce_range(partials[lo:hi], lo, hi, K_GROUPS)
        nodes.update(zip(canonical_nodes(lo, hi, K_GROUPS), sums, strict=True))
    assert [len(canonical_nodes(lo, hi, 8)) for lo, hi in group_ranges(8, world)] == (
        node_counts(8, world)
    )
    assert_bitwise_equal(finish_tree(nodes, K_GROUPS), expected, name=f"T={world}")


def test_the_crafted_partials_tell_orders_apart():
    partials = _crafted_partials()
    left_fold = partials[0].clone()
    for g in range(1, K_GROUPS):
        left_fold = left_fold + partials[g]
    assert not torch.equal(k_group_tree_sum(partials), left_fold)
    # T = 3 done by summing each rank's range left to right and then the ranks: other bits.
    ranks = [partials[lo:hi].sum(0) for lo, hi in group_ranges(8, 3)]
    assert not torch.equal(k_group_tree_sum(partials), (ranks[0] + ranks[1]) + ranks[2])


def test_finish_tree_rejects_gaps_and_overlaps():
    leaf = torch.zeros(2)
    with pytest.raises(ValueError, match="nodes"):
        finish_tree({(0, 4): leaf, (4, 6): leaf}, 8)  # [6, 8) missing
    with pytest.raises(ValueError, match="nodes"):
        finish_tree({(0, 8): leaf, (0, 4): leaf}, 8)  # [0, 4) unused
    with pytest.raises(ValueError, match="power of two"):
        finish_tree({(0, 6): leaf}, 6)


def test_rank_tree_sum_pairs_level_by_level_and_carries_the_odd_one():
    values = torch.tensor([[1.0], [1e8], [-1e8], [1.0], [3.0]])
    first, second = (values[0] + values[1]) + (values[2] + values[3]), values[4]
    assert_bitwise_equal(rank_tree_sum(values), first + second)
    assert_bitwise_equal(rank_tree_sum(values[:3]), (values[0] + values[1]) + values[2])
    assert_bitwise_equal(rank_tree_sum(values[:4]), k_group_tree_sum(values[:4]))


def test_owner_logit_is_selected_not_summed():
    """A ``-0.0`` target logit keeps its sign: ``-0.0 + 0.0`` would give ``+0.0``.  (The
    logits here start their K sum at ``+0.0`` and so are never ``-0.0`` themselves; the
    gathered logits are crafted.)"""
    ranges = [(0, 512), (512, 768), (768, 1000)]
    targets = torch.tensor([3, 600, 999, -1, 511, 512])
    gathered = torch.zeros(3, 6)
    gathered[0, 0], gathered[1, 1], gathered[2, 2] = -0.0, 2.5, -0.0
    gathered[0, 4], gathered[1, 5] = 1.5, -3.0
    picked = _owner_logit(gathered, targets, ranges)
    assert_bitwise_equal(picked, torch.tensor([-0.0, 2.5, -0.0, 0.0, 1.5, -3.0]))
    assert torch.signbit(picked[0]) and not torch.signbit(gathered.sum(0)[0])


def test_splits():
    weight = torch.arange(24.0 * 200).reshape(24, 200)
    assert column_range(24, 2, 3) == (16, 24)
    assert_bitwise_equal(shard_columns(weight, 1, 4), weight[6:12])
    assert k_group_width(200) == 64
    assert [k_range(200, r, 3) for r in range(3)] == [(0, 192), (192, 200), (200, 200)]
    assert_bitwise_equal(shard_k(weight, 1, 3), weight[:, 192:200])
    assert k_group_width(4096) == 512 and k_range(4096, 1, 2) == (2048, 4096)
    assert vocab_ranges(5 * 256 + 37, 4) == [(0, 512), (512, 1024), (1024, 1280), (1280, 1317)]
    assert vocab_ranges(151936, 8)[-1][1] == 151936
    assert all(a % VOCAB_TILE == 0 for a, _ in vocab_ranges(151936, 3))


def test_split_errors_name_the_argument():
    with pytest.raises(ValueError, match="world = 5 must divide"):
        column_range(24, 0, 5)
    with pytest.raises(ValueError, match="rank"):
        shard_k(torch.zeros(4, 64), 2, 2)
    with pytest.raises(ValueError, match="world"):
        vocab_ranges(300, 3)  # two tiles for three ranks


def test_tiled_token_logprobs_are_the_reference_with_tile_chunks():
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(3, 4, 16, generator=generator)
    weight = torch.randn(3 * 256 + 5, 16, generator=generator)
    targets = torch.randint(0, weight.shape[0], (3, 4), generator=generator)
    targets[1, 2] = -100
    expected = token_logprobs(hidden, weight, targets, vocab_chunk=VOCAB_TILE)
    assert_bitwise_equal(token_logprobs_tiled(hidden, weight, targets), expected)

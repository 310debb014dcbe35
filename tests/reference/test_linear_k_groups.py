"""The K-group tree reference: group partials, the tree's order, the bias's place, the shard
property tensor parallelism rests on, M-invariance and the errors."""

from __future__ import annotations

import pytest
import torch
from _helpers_reduction import ALL_FLOAT, randn

from batchinv.contract import assert_bitwise_equal, assert_no_drift, row_invariance_sweep
from batchinv.reference import linear as reference
from batchinv.reference._fixed_order import fixed_order_matmul
from batchinv.reference.linear import (
    K_GROUPS,
    k_group_tree_sum,
    k_group_width,
    linear,
    linear_k_group_partials,
    linear_k_groups,
    linear_k_groups_fp32,
)

# K values: a partial first box with empty groups after it (72), four used groups of which
# the last is partial (200), eight full groups (512), eight groups of two boxes with a partial
# last one (1000).  The CPU loop is O(K) steps, so K stays small.
K_VALUES = (72, 200, 512, 1000)
WORLD_SIZES = (1, 2, 4, 8)
TINY = 2.0**-24  # half an ulp of 1.0 in fp32: 1 + TINY rounds back to 1 (ties to even)


def _params(k, n, *, seed, dtype=torch.float32, with_bias=True):
    weight = randn(n, k, seed=seed, scale=k**-0.5, dtype=dtype)
    bias = randn(n, seed=seed + 1, dtype=dtype) if with_bias else None
    return weight, bias


@pytest.mark.parametrize(
    ("k", "width"),
    [(1, 64), (64, 64), (72, 64), (512, 64), (513, 128), (4096, 512), (12288, 1536)],
)
def test_group_width_is_whole_boxes_over_eight_groups(k, width):
    assert K_GROUPS == 8
    assert k_group_width(k) == width
    assert k_group_width(k) * K_GROUPS >= k > k_group_width(k) * K_GROUPS - 64 * K_GROUPS


@pytest.mark.parametrize("k", K_VALUES)
def test_partials_are_fixed_order_matmuls_of_the_column_ranges(k):
    x = randn(2, 3, k, seed=1)
    weight, _ = _params(k, 5, seed=2, with_bias=False)
    width = k_group_width(k)
    partials = linear_k_group_partials(x, weight, width, K_GROUPS)
    assert partials.shape == (K_GROUPS, 2, 3, 5) and partials.dtype == torch.float32
    rows = x.reshape(6, k)
    for g in range(K_GROUPS):
        begin, end = min(g * width, k), min((g + 1) * width, k)
        if begin == end:
            expected = torch.zeros(6, 5)
            assert not torch.signbit(partials[g]).any(), "an empty group is +0.0"
        else:
            expected = fixed_order_matmul(rows[:, begin:end], weight[:, begin:end].t())
        assert_bitwise_equal(partials[g].reshape(6, 5), expected, name=f"group {g}")


def _sequential_tree(partials):
    acc = partials[0]
    for p in partials[1:]:
        acc = acc + p
    return acc


def _wrong_pairing_tree(partials):
    level = partials
    while level.shape[0] > 1:
        half = level.shape[0] // 2
        level = level[:half] + level[half:]  # pairs (g0, g4), (g1, g5), ...: another tree
    return level[0]


def _tree_cases():
    """Leaves (as multiples of TINY, then 1.0 at g0) whose tree sum and other orders differ."""
    leaves = torch.zeros(K_GROUPS, 1)
    leaves[0], leaves[2], leaves[3] = 1.0, TINY, TINY
    # The tree: (1 + 0) + (TINY + TINY) = 1 + 2^-23 exactly.  Sequentially each TINY is lost.
    return leaves, torch.tensor([1.0 + 2.0**-23])


def _check_tree(tree_sum):
    leaves, expected = _tree_cases()
    assert_bitwise_equal(tree_sum(leaves), expected, name="tree sum")
    # Level by level is tree(first half) + tree(second half) for every power of two.
    values = randn(8, 5, seed=3) * torch.logspace(0, 20, 8, base=2.0)[:, None]
    assert_bitwise_equal(
        tree_sum(values),
        ((values[0] + values[1]) + (values[2] + values[3]))
        + ((values[4] + values[5]) + (values[6] + values[7])),
    )
    assert_bitwise_equal(tree_sum(values[:4]), (values[0] + values[1]) + (values[2] + values[3]))
    assert_bitwise_equal(tree_sum(values[:2]), values[0] + values[1])


def test_tree_sum_is_the_fixed_balanced_tree():
    _check_tree(k_group_tree_sum)


@pytest.mark.parametrize("mutant", (_sequential_tree, _wrong_pairing_tree))
def test_tree_check_catches_another_order(mutant):
    with pytest.raises(AssertionError):
        _check_tree(mutant)


def test_tree_of_one_is_a_view_of_the_partial():
    partials = randn(1, 3, 4, seed=4)
    out = k_group_tree_sum(partials)
    assert out.data_ptr() == partials.data_ptr() and out.shape == (3, 4)


def _tree_order_input():
    """x and weight whose group partials are 1 (g0), TINY (g2), TINY (g3), zeros elsewhere:
    the op sums them as the tree does (1 + 2^-23), linear's sequential K loses both TINYs."""
    k = 256  # width 64: g0 = [0, 64), g2 = [128, 192), g3 = [192, 256)
    x = torch.zeros(1, k)
    x[0, 0] = x[0, 128] = x[0, 192] = 1.0
    weight = torch.zeros(1, k)
    weight[0, 0], weight[0, 128], weight[0, 192] = 1.0, TINY, TINY
    return x, weight


def test_the_op_sums_its_groups_in_the_tree():
    x, weight = _tree_order_input()
    assert_bitwise_equal(linear_k_groups_fp32(x, weight), torch.tensor([[1.0 + 2.0**-23]]))
    assert_bitwise_equal(linear(x, weight), torch.tensor([[1.0]]))  # not the linear's order


def _check_bias_after_tree(forward_fp32):
    x, weight = _tree_order_input()
    bias = torch.tensor([TINY])
    # (1 + 2^-23) + 2^-24 is a tie between 1 + 2^-23 and 1 + 2^-22: rounds to the even one.
    assert_bitwise_equal(forward_fp32(x, weight, bias), torch.tensor([[1.0 + 2.0**-22]]))


def _bias_first(x, weight, bias):
    """Mutant: the bias joins group 0's partial before the tree."""
    partials = linear_k_group_partials(x, weight, k_group_width(x.shape[-1]), K_GROUPS)
    partials[0] = partials[0] + bias
    return k_group_tree_sum(partials)


def test_bias_is_added_after_the_tree():
    _check_bias_after_tree(linear_k_groups_fp32)
    with pytest.raises(AssertionError):
        _check_bias_after_tree(_bias_first)


@pytest.mark.parametrize("dtype", ALL_FLOAT, ids=str)
@pytest.mark.parametrize("with_bias", (False, True))
def test_low_precision_result_is_the_fp32_result_rounded_once(dtype, with_bias):
    x = randn(4, 200, seed=5, dtype=dtype)
    weight, bias = _params(200, 6, seed=6, dtype=dtype, with_bias=with_bias)
    out = linear_k_groups(x, weight, bias)
    assert out.dtype == dtype
    assert_bitwise_equal(out, linear_k_groups_fp32(x, weight, bias).to(dtype))


@pytest.mark.parametrize("with_bias", (False, True))
def test_one_group_is_the_linear(with_bias):
    """K <= 64: group 0 is the whole K and the empty groups add +0.0 (exact, and the sum
    cannot be -0.0), so the bits are the linear's."""
    x = randn(5, 64, seed=7)
    weight, bias = _params(64, 3, seed=8, with_bias=with_bias)
    assert_bitwise_equal(linear_k_groups(x, weight, bias), linear(x, weight, bias))


def _shard_ranges(world_size: int, groups: int = K_GROUPS) -> list[tuple[int, int]]:
    """Balanced contiguous ranges of whole groups, larger ranges first."""
    base, extra = divmod(groups, world_size)
    ranges, start = [], 0
    for rank in range(world_size):
        size = base + (rank < extra)
        ranges.append((start, start + size))
        start += size
    return ranges


@pytest.mark.parametrize("k", (456, 1000))  # the last group partial; no rank without columns
@pytest.mark.parametrize("world_size", (*WORLD_SIZES, 3))
def test_shards_of_whole_groups_give_the_full_partials(k, world_size):
    """What tensor parallelism rests on: a rank's call on its columns gives bitwise its slice
    of the full call's partials, and the tree over the ranks' node sums is the full tree."""
    x = randn(3, k, seed=9)
    weight, _ = _params(k, 7, seed=10, with_bias=False)
    width = k_group_width(k)
    full = linear_k_group_partials(x, weight, width, K_GROUPS)
    nodes = []
    for g_lo, g_hi in _shard_ranges(world_size):
        columns = slice(g_lo * width, min(g_hi * width, k))
        local = linear_k_group_partials(x[:, columns], weight[:, columns], width, g_hi - g_lo)
        assert_bitwise_equal(local, full[g_lo:g_hi], name=f"groups [{g_lo}, {g_hi})")
        if world_size in WORLD_SIZES:
            nodes.append(k_group_tree_sum(local))
    if world_size in WORLD_SIZES:
        assert_bitwise_equal(k_group_tree_sum(torch.stack(nodes)), k_group_tree_sum(full))


@pytest.mark.parametrize("dtype", ALL_FLOAT, ids=str)
def test_row_invariance(dtype):
    weight, bias = _params(200, 9, seed=11, dtype=dtype)

    def make_rows(n, gen):
        return torch.randn(n, 200, generator=gen).to(dtype)

    reports = row_invariance_sweep(
        lambda rows: linear_k_groups(rows, weight, bias), make_rows, batch_sizes=(1, 3, 17)
    )
    assert_no_drift(reports)


def test_gradients_are_the_linears():
    x = randn(4, 200, seed=12).requires_grad_()
    weight, bias = (t.requires_grad_() for t in _params(200, 6, seed=13))
    grad_y = randn(4, 6, seed=14)
    got = torch.autograd.grad(linear_k_groups(x, weight, bias), (x, weight, bias), grad_y)
    expected = torch.autograd.grad(linear(x, weight, bias), (x, weight, bias), grad_y)
    assert_bitwise_equal(list(got), list(expected))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"group_width": 0}, ValueError, "group_width"),
        ({"group_width": 32}, ValueError, "group_width"),
        ({"group_width": 100}, ValueError, "group_width"),
        ({"group_width": -64}, ValueError, "group_width"),
        ({"group_width": 64.0}, TypeError, "group_width"),
        ({"group_width": True}, TypeError, "group_width"),
        ({"groups": 0}, ValueError, "groups"),
        ({"groups": 9}, ValueError, "groups"),
        ({"groups": 2.0}, TypeError, "groups"),
        ({"groups": 3}, ValueError, "left over"),  # 3 * 64 < 200
    ],
)
def test_partials_reject_bad_layouts(kwargs, error, match):
    x = randn(2, 200, seed=15)
    weight, _ = _params(200, 3, seed=16, with_bias=False)
    args = {"group_width": 64, "groups": K_GROUPS} | kwargs
    with pytest.raises(error, match=match):
        linear_k_group_partials(x, weight, args["group_width"], args["groups"])


def test_partials_reject_what_the_linear_rejects():
    x = randn(2, 200, seed=17)
    weight, _ = _params(200, 3, seed=18, with_bias=False)
    with pytest.raises(ValueError, match="weight.shape\\[1\\]"):
        linear_k_group_partials(x, weight[:, :128], 64, K_GROUPS)
    with pytest.raises(TypeError, match="dtype"):
        linear_k_group_partials(x, weight.double(), 64, K_GROUPS)


def test_tree_sum_rejects_bad_partials():
    with pytest.raises(TypeError, match="partials"):
        k_group_tree_sum(torch.zeros(2, 3, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="partials"):
        k_group_tree_sum([torch.zeros(3), torch.zeros(3)])
    for count in (0, 3, 6, 16):
        with pytest.raises(ValueError, match="partials"):
            k_group_tree_sum(torch.zeros(count, 3))
    with pytest.raises(ValueError, match="partials"):
        k_group_tree_sum(torch.tensor(1.0))


def test_group_width_rejects_bad_in_features():
    with pytest.raises(ValueError, match="in_features"):
        k_group_width(0)
    with pytest.raises(TypeError, match="in_features"):
        k_group_width(64.0)


def test_reference_and_op_share_one_tree():
    import batchinv

    assert batchinv.K_GROUPS is reference.K_GROUPS
    assert batchinv.k_group_width is reference.k_group_width

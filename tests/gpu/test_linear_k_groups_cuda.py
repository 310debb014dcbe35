"""The CUDA K-group tree (batchinv.linear_k_groups): per-group partials against the strict
reference's, one row's bits whatever the batch (small-M and tile kernels), simulated tensor
parallelism in one process (T shard calls + tree == T = 1, bitwise), the tree kernel against
torch's adds, accuracy, CUDA-graph capture, and bad input."""

from __future__ import annotations

import pytest
import torch

import batchinv
from batchinv.contract import assert_bitwise_equal, assert_within_tolerance
from batchinv.gpu import linear as gpu_linear
from batchinv.reference import linear as reference
from batchinv.shapes import QWEN3_8B_LINEAR

pytestmark = pytest.mark.cuda

DTYPES = (torch.bfloat16, torch.float16)
# K: one partial box and six empty groups (72), four used groups, the last partial (200), and
# the Qwen3-8B hidden and intermediate sizes (4096: 8 x 512, 12288: 8 x 1536).
K_VALUES = (72, 200, 4096, 12288)
BATCH = 257  # above SMALL_M_MAX_ROWS: the 128x256 tile kernel; one row alone: small-M
PROBE_ROWS = (0, 5, 128, 256)
TP_SHAPES = tuple(s for s in QWEN3_8B_LINEAR if s[0] in ("o_proj", "down_proj"))
TP_M = (1, 64, 2048)
WORLD_SIZES = (2, 4, 8)


def _hopper() -> bool:
    return gpu_linear.uses_hopper(torch.device("cuda"))


@pytest.fixture(autouse=True)
def _needs_hopper():
    if not _hopper():
        pytest.skip("the K-group kernels are sm_90a only")


def _inputs(m, k, n, dtype, seed=0, with_bias=False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(dtype)
    bias = torch.randn(n, device="cuda", generator=gen).to(dtype) if with_bias else None
    return x, w, bias


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", ("small_m", "hopper"))
@pytest.mark.parametrize("k", K_VALUES)
def test_partials_are_within_tolerance_of_the_reference_partials(k, family, dtype):
    x, w, _ = _inputs(5, k, 72, dtype, seed=1)
    width = batchinv.k_group_width(k)
    got = gpu_linear.k_group_partials(x, w, width, 8, family=family)
    expected = reference.linear_k_group_partials(x.cpu(), w.cpu(), width, 8)
    for g in range(8):
        if g * width >= k:  # an empty group: exactly +0.0
            assert_bitwise_equal(got[g].cpu(), expected[g], name=f"empty group {g}")
        else:
            assert_within_tolerance(
                got[g].cpu(),
                expected[g],
                op_class="reduction",
                dtype=dtype,
                name=f"group {g} of K={k} ({family})",
            )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_bias", (False, True))
@pytest.mark.parametrize("k", K_VALUES)
def test_row_alone_equals_row_in_a_batch(k, with_bias, dtype):
    """A row alone runs the small-M kernel, the same row among 257 the 128x256 tile: the same
    bits, for the partials and for the whole op."""
    x, w, bias = _inputs(BATCH, k, 1000, dtype, seed=2, with_bias=with_bias)
    width = batchinv.k_group_width(k)
    partials = gpu_linear.k_group_partials(x, w, width, 8)
    out = batchinv.linear_k_groups(x, w, bias)
    for i in PROBE_ROWS:
        row = x[i : i + 1]
        assert_bitwise_equal(
            gpu_linear.k_group_partials(row, w, width, 8),
            partials[:, i : i + 1],
            name=f"partials of row {i}",
        )
        assert_bitwise_equal(batchinv.linear_k_groups(row, w, bias), out[i : i + 1])
    # Both families over the same batch: the same bits per group.
    assert_bitwise_equal(
        gpu_linear.k_group_partials(x[:9], w, width, 8, family="small_m"),
        gpu_linear.k_group_partials(x[:9], w, width, 8, family="hopper"),
    )


def _shard_ranges(world_size: int) -> list[tuple[int, int]]:
    base, extra = divmod(8, world_size)
    ranges, start = [], 0
    for rank in range(world_size):
        size = base + (rank < extra)
        ranges.append((start, start + size))
        start += size
    return ranges


@pytest.mark.parametrize("m", TP_M)
@pytest.mark.parametrize("name, k, n", TP_SHAPES, ids=[s[0] for s in TP_SHAPES])
def test_simulated_tensor_parallel_equals_one_gpu(name, k, n, m):
    """T ranks of whole groups, each its shard's partials and node sum, then the tree over the
    nodes, the bias and one rounding: bitwise the single-GPU op for T = 2, 4, 8."""
    x, w, bias = _inputs(m, k, n, torch.bfloat16, seed=3, with_bias=True)
    single = batchinv.linear_k_groups(x, w, bias)
    width = batchinv.k_group_width(k)
    for world_size in WORLD_SIZES:
        nodes = []
        for g_lo, g_hi in _shard_ranges(world_size):
            columns = slice(g_lo * width, min(g_hi * width, k))
            local = batchinv.linear_k_group_partials(
                x[:, columns], w[:, columns].contiguous(), group_width=width, groups=g_hi - g_lo
            )
            nodes.append(batchinv.k_group_tree_sum(local))
        tree = batchinv.k_group_tree_sum(torch.stack(nodes))
        assert_bitwise_equal(
            (tree + bias.float()).to(x.dtype), single, name=f"{name} M={m} T={world_size}"
        )
        assert_bitwise_equal(
            gpu_linear.k_group_tree(torch.stack(nodes), bias, x.dtype),
            single,
            name=f"{name} M={m} T={world_size} (tree kernel)",
        )


def _torch_tree(partials):
    level = partials
    while level.shape[0] > 1:
        level = level[0::2] + level[1::2]
    return level[0]


@pytest.mark.parametrize("out_dtype", (torch.float32, *DTYPES), ids=str)
@pytest.mark.parametrize("count", (1, 2, 4, 8))
def test_tree_kernel_equals_torch_adds(count, out_dtype):
    gen = torch.Generator(device="cuda").manual_seed(4)
    scales = torch.logspace(-20, 20, count, base=2.0, device="cuda")
    partials = torch.randn(count, 37, 1001, device="cuda", generator=gen)
    partials = (partials * scales[:, None, None]).contiguous()
    partials[0, 0, :8] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 2.0**-149, 1, 1, 1])
    expected = _torch_tree(partials)
    if out_dtype == torch.float32:
        assert_bitwise_equal(gpu_linear.k_group_tree(partials), expected)
        assert_bitwise_equal(gpu_linear.k_group_tree_sum(partials), expected)
        return
    bias = torch.randn(1001, device="cuda", generator=gen).to(out_dtype)
    assert_bitwise_equal(
        gpu_linear.k_group_tree(partials, bias, out_dtype), (expected + bias.float()).to(out_dtype)
    )
    assert_bitwise_equal(gpu_linear.k_group_tree(partials, None, out_dtype), expected.to(out_dtype))


def test_public_tree_sum_on_cuda_is_the_reference_tree():
    gen = torch.Generator(device="cuda").manual_seed(5)
    partials = torch.randn(8, 3, 4, 513, device="cuda", generator=gen)
    assert_bitwise_equal(batchinv.k_group_tree_sum(partials), reference.k_group_tree_sum(partials))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name, k, n", QWEN3_8B_LINEAR[:4], ids=[s[0] for s in QWEN3_8B_LINEAR[:4]])
def test_accuracy_against_the_fp32_linear(name, k, n, dtype):
    x, w, bias = _inputs(5, k, n, dtype, seed=6, with_bias=True)
    assert_within_tolerance(
        batchinv.linear_k_groups(x, w, bias),
        reference.linear_fp32(x, w, bias),  # strict fp32, fixed order (on the GPU tensors)
        op="linear",
        name=f"linear_k_groups {name}",
    )


def test_three_dimensional_input_and_partials_shape():
    x, w, bias = _inputs(6, 200, 40, torch.bfloat16, seed=7, with_bias=True)
    out = batchinv.linear_k_groups(x.view(2, 3, 200), w, bias)
    assert_bitwise_equal(out, batchinv.linear_k_groups(x, w, bias).view(2, 3, 40))
    partials = batchinv.linear_k_group_partials(x.view(2, 3, 200), w, group_width=64, groups=8)
    assert partials.shape == (8, 2, 3, 40) and partials.dtype == torch.float32


@pytest.mark.parametrize("m", (1, 70))
def test_cuda_graph_replay_equals_eager(m):
    x, w, bias = _inputs(m, 4096, 512, torch.bfloat16, seed=8, with_bias=True)
    static_x = x.clone()
    eager = batchinv.linear_k_groups(x, w, bias)
    w_half = w[:, :1024].contiguous()  # a rank's two groups of 512 columns
    eager_partials = batchinv.linear_k_group_partials(
        x[:, :1024], w_half, group_width=512, groups=2
    )
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm-up off the default stream, as capture wants
        batchinv.linear_k_groups(static_x, w, bias)
        batchinv.linear_k_group_partials(static_x[:, :1024], w_half, group_width=512, groups=2)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = batchinv.linear_k_groups(static_x, w, bias)
        partials = batchinv.linear_k_group_partials(
            static_x[:, :1024], w_half, group_width=512, groups=2
        )
        node = batchinv.k_group_tree_sum(partials)
    other = torch.randn_like(x, dtype=torch.float32).to(x.dtype)
    static_x.copy_(other)
    graph.replay()
    assert_bitwise_equal(out, batchinv.linear_k_groups(other, w, bias), name="replay, new input")
    static_x.copy_(x)
    graph.replay()
    assert_bitwise_equal(out, eager, name="replay")
    assert_bitwise_equal(partials, eager_partials, name="replayed partials")
    assert_bitwise_equal(node, batchinv.k_group_tree_sum(eager_partials), name="replayed node")


def test_gradients_are_the_linears():
    x, w, bias = _inputs(33, 200, 40, torch.bfloat16, seed=9, with_bias=True)
    leaves = [t.clone().requires_grad_() for t in (x, w, bias)]
    others = [t.clone().requires_grad_() for t in (x, w, bias)]
    grad_y = torch.randn(33, 40, device="cuda").to(torch.bfloat16)
    got = torch.autograd.grad(batchinv.linear_k_groups(*leaves), leaves, grad_y)
    expected = torch.autograd.grad(batchinv.linear(*others), others, grad_y)
    assert_bitwise_equal(list(got), list(expected))


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda x, w: batchinv.linear_k_groups(x.float(), w.float()), TypeError, "bf16 or fp16"),
        (
            lambda x, w: batchinv.linear_k_groups(x[:, :196], w[:, :196].contiguous()),
            ValueError,
            "% 8",
        ),
        (
            lambda x, w: batchinv.linear_k_group_partials(x, w, group_width=96, groups=8),
            ValueError,
            "group_width",
        ),
        (
            lambda x, w: batchinv.linear_k_group_partials(x, w, group_width=64, groups=9),
            ValueError,
            "groups",
        ),
        (
            lambda x, w: gpu_linear.k_group_partials(x, w, 64, 9),
            ValueError,
            "groups",
        ),
        (
            lambda x, w: gpu_linear.k_group_partials(x, w, 32, 8),
            ValueError,
            "group_width",
        ),
        (
            lambda x, w: gpu_linear.k_group_tree(torch.zeros(3, 4, 5, device="cuda")),
            ValueError,
            "P in 1, 2, 4, 8",
        ),
        (
            lambda x, w: batchinv.k_group_tree_sum(x[None]),
            TypeError,
            "partials",
        ),
    ],
)
def test_bad_input_is_a_clear_error(call, error, message):
    x, w, _ = _inputs(3, 200, 40, torch.bfloat16, seed=10)
    with pytest.raises(error, match=message):
        call(x, w)
    torch.cuda.synchronize()  # and no illegal access was left behind

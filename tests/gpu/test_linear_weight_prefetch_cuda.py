"""The weight prefetch of the small-M products (``gpu.linear.prefetching_weights``) on CUDA:
programmatic launches give the bits of stream-ordered ones, eagerly and in a CUDA graph, after
kernels that let them start early, and the decode runner's steps are the same bits with and
without it."""

from __future__ import annotations

import pytest
import torch

import batchinv
from batchinv.contract import assert_bitwise_equal
from batchinv.gpu import linear as gpu_linear
from batchinv.models import Qwen3
from batchinv.models.qwen3.decode import Qwen3DecodeRunner
from batchinv.runtime import uses_hopper

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not uses_hopper(torch.device("cuda")),
        reason="the small-M kernel runs on sm_90 with the sm_90a build",
    ),
]

SHAPES = [(1, 4096, 4096), (4, 6144, 4096), (8, 4096, 12288), (16, 4096, 4096)]


def chain(h, norm_weight, weights):
    """rms_norm (which lets the next kernel start at once), then each product of its output."""
    x = batchinv.rms_norm(h, norm_weight, 1e-6)
    return [batchinv.linear(x, w) for w in weights]


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_prefetching_products_give_the_stream_ordered_bits(m, n, k):
    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    h = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    norm_weight = torch.rand(k, device="cuda", dtype=torch.bfloat16, generator=g) + 0.5
    weights = [
        torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02 for _ in range(3)
    ]
    want = chain(h, norm_weight, weights)
    with torch.no_grad(), gpu_linear.prefetching_weights():
        got = chain(h, norm_weight, weights)
    for a, b in zip(got, want, strict=True):
        assert_bitwise_equal(a, b)


def test_prefetching_grouped_products_give_the_stream_ordered_bits():
    g = torch.Generator(device="cuda").manual_seed(3)
    h = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    norm_weight = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    weights = [
        torch.randn(n, 4096, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
        for n in (4096, 1024, 1024)
    ]

    def grouped():
        return gpu_linear.matmul_grouped(batchinv.rms_norm(h, norm_weight, 1e-6), weights)

    want = grouped()
    with gpu_linear.prefetching_weights():
        got = grouped()
    assert_bitwise_equal(got, want)


def test_a_product_waits_for_the_rows_a_long_kernel_writes_last():
    """silu_mul over many rows lets the product launch at its start and writes the product's
    rows (its last ones) near its end: a product that read x before its wait would read them
    unwritten."""
    rows, inter = 32768, 12288
    g = torch.Generator(device="cuda").manual_seed(5)
    gate = torch.randn(rows, inter, device="cuda", dtype=torch.bfloat16, generator=g)
    up = torch.randn(rows, inter, device="cuda", dtype=torch.bfloat16, generator=g)
    weight = torch.randn(4096, inter, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    want = batchinv.linear(batchinv.silu_mul(gate, up)[-4:], weight)
    for _ in range(5):
        with torch.no_grad(), gpu_linear.prefetching_weights():
            inter_rows = batchinv.silu_mul(gate, up)
            got = batchinv.linear(inter_rows[-4:], weight)
        assert_bitwise_equal(got, want)


def test_prefetching_products_in_a_cuda_graph():
    g = torch.Generator(device="cuda").manual_seed(7)
    h = torch.randn(2, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    norm_weight = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    weights = [torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02]
    want = chain(h, norm_weight, weights)[0]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), gpu_linear.prefetching_weights():
        with torch.cuda.stream(stream):
            chain(h, norm_weight, weights)  # plans and maps outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(h, norm_weight, weights)[0]
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise_equal(out, want)


@pytest.mark.parametrize("cuda_graph", [True, False])
def test_the_runner_takes_the_same_bits_with_and_without_the_prefetch(cuda_graph):
    model = Qwen3.from_config(seed=0, device="cuda", dtype=torch.bfloat16)
    prompts = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11]]
    results = {}
    for prefetch in (True, False):
        runner = Qwen3DecodeRunner(
            model, max_batch=4, capacity=32, cuda_graph=cuda_graph, prefetch_weights=prefetch
        )
        slots = runner.add(prompts, seeds=[0, 1, 2])
        for _ in range(8):
            runner.step()
        runner.sync()
        results[prefetch] = [(runner.tokens(s), runner.logprobs(s)) for s in slots]
    for (tokens_a, logprobs_a), (tokens_b, logprobs_b) in zip(
        results[True], results[False], strict=True
    ):
        assert tokens_a == tokens_b
        assert_bitwise_equal(logprobs_a, logprobs_b)

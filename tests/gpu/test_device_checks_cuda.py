"""The public ops whose checks read values (embedding ids, RoPE positions, token-logprob
targets) run inside CUDA-graph capture with their checks on: the check moves to the device
word, a replay with bad values raises at ``raise_device_errors`` naming the op, and good
replays give the eager bits."""

from __future__ import annotations

import pytest
import torch

import batchinv
from batchinv import device_checks
from batchinv.contract import assert_bitwise_equal

pytestmark = pytest.mark.cuda


def captured(fn):
    device_checks.word(torch.device("cuda"))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), device_checks.deferred():
        fn()  # warm-up: plans, kernels and cached tables outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def test_embedding_in_a_graph():
    table = torch.randn(100, 64, device="cuda", dtype=torch.bfloat16)
    ids = torch.tensor([3, 7, 99], device="cuda")
    graph, out = captured(lambda: batchinv.embedding(ids, table))
    graph.replay()
    device_checks.raise_device_errors()
    assert_bitwise_equal(out, batchinv.embedding(ids, table))
    ids[1] = 100
    graph.replay()
    with pytest.raises(IndexError, match="embedding: ids"):
        device_checks.raise_device_errors()
    assert_bitwise_equal(out[0], table[3])  # good rows stay exact


def test_rope_in_a_graph():
    q = torch.randn(4, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(4, 2, 128, device="cuda", dtype=torch.bfloat16)
    positions = torch.tensor([0, 5, 9, 11], device="cuda")
    kwargs = {"theta": 1e6, "max_position": 64}
    graph, (q_rot, k_rot) = captured(lambda: batchinv.rope(q, k, positions, **kwargs))
    graph.replay()
    device_checks.raise_device_errors()
    want_q, want_k = batchinv.rope(q, k, positions, **kwargs)
    assert_bitwise_equal(q_rot, want_q)
    assert_bitwise_equal(k_rot, want_k)
    positions[2] = 64
    graph.replay()
    with pytest.raises(IndexError, match="rope: position_ids"):
        device_checks.raise_device_errors()


def test_token_logprobs_in_a_graph():
    hidden = torch.randn(5, 256, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16) / 16
    targets = torch.tensor([1, 999, 5, -100, 0], device="cuda")
    graph, out = captured(lambda: batchinv.token_logprobs(hidden, weight, targets))
    graph.replay()
    device_checks.raise_device_errors()
    assert_bitwise_equal(out, batchinv.token_logprobs(hidden, weight, targets))
    targets[0] = 1000
    graph.replay()
    with pytest.raises(IndexError, match="token_logprobs: target_ids"):
        device_checks.raise_device_errors()


def test_eager_calls_inside_deferred_do_not_raise_until_asked():
    table = torch.randn(10, 64, device="cuda", dtype=torch.bfloat16)
    with device_checks.deferred():
        out = batchinv.embedding(torch.tensor([1, 10], device="cuda"), table)
    assert torch.isnan(out[1].float()).all()
    with pytest.raises(IndexError, match="embedding"):
        device_checks.raise_device_errors()


def test_an_eager_call_readies_the_word_for_a_later_capture(monkeypatch):
    # torch.compile's CUDA graphs run an op eagerly (checks at once), then capture it: the
    # capture must find the word the eager call allocated, not raise for want of one.
    monkeypatch.setattr(device_checks, "_words", {})
    table = torch.randn(100, 64, device="cuda", dtype=torch.bfloat16)
    ids = torch.tensor([3, 7, 99], device="cuda")
    want = batchinv.embedding(ids, table)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = batchinv.embedding(ids, table)
    graph.replay()
    device_checks.raise_device_errors()
    assert_bitwise_equal(out, want)


def test_reduce_overhead_compile_of_the_checked_ops():
    # The three ops with value checks under torch.compile's CUDA graphs, first call included.
    table = torch.randn(1000, 128, device="cuda", dtype=torch.bfloat16)
    heads_q = torch.randn(4 * 128, 128, device="cuda", dtype=torch.bfloat16) / 16

    def step(ids, positions):
        hidden = batchinv.embedding(ids, table)
        q = batchinv.linear(hidden, heads_q).view(-1, 4, 128)
        q_rot, _ = batchinv.rope(q, q[:, :1], positions, theta=1e6, max_position=64)
        return batchinv.token_logprobs(q_rot.reshape(-1, 128), table, ids.repeat_interleave(4))

    ids = torch.tensor([3, 7, 99, 0], device="cuda")
    positions = torch.tensor([0, 5, 9, 11], device="cuda")
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # warm-up, capture, replay
        got = compiled(ids, positions).clone()
    device_checks.raise_device_errors()
    assert_bitwise_equal(got, step(ids, positions))
    positions[1] = 64
    compiled(ids, positions)
    with pytest.raises(IndexError, match="rope: position_ids"):
        device_checks.raise_device_errors()

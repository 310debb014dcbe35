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
from batchinv.gpu import token_logprobs as gpu_token_logprobs

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
    # capture must find the status (word and flags) the eager call allocated, not raise for
    # want of one.
    monkeypatch.setattr(device_checks, "_status", {})
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


# Deferred checks of the three value-checked ops: (call on the checked values, good values,
# bad values, error, message).  "embedding, strided ids" takes launch_forward's general path.
DEFERRED_CASES = ("embedding", "embedding, strided ids", "rope", "token_logprobs")


def _deferred_cases():
    table = torch.randn(100, 64, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(4, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(4, 2, 128, device="cuda", dtype=torch.bfloat16)
    hidden = torch.randn(5, 256, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16) / 16
    return {
        "embedding": (
            lambda ids: batchinv.embedding(ids, table),
            [3, 7, 99],
            [3, 100, 5],
            IndexError,
            "embedding: ids",
        ),
        "embedding, strided ids": (
            lambda ids: batchinv.embedding(ids, table),
            [3, 7, 99],
            [-1, 7, 5],
            IndexError,
            "embedding: ids",
        ),
        "rope": (
            lambda positions: batchinv.rope(q, k, positions, theta=1e6, max_position=64),
            [0, 5, 9, 11],
            [0, 64, 9, 11],
            IndexError,
            "rope: position_ids",
        ),
        "token_logprobs": (
            lambda targets: batchinv.token_logprobs(hidden, weight, targets),
            [1, 999, 5, -100, 0],
            [1, 999, 1000, -100, 0],
            IndexError,
            "token_logprobs: target_ids",
        ),
    }


def _values(name: str, values: list[int]) -> torch.Tensor:
    """The checked tensor: every other element of a buffer for the strided case."""
    if "strided" not in name:
        return torch.tensor(values, device="cuda")
    buffer = torch.zeros(2 * len(values), dtype=torch.int64, device="cuda")
    buffer[::2] = torch.tensor(values, device="cuda")
    return buffer[::2]


@pytest.mark.parametrize("name", DEFERRED_CASES)
def test_a_deferred_check_accumulates_until_raised_then_is_clear(name):
    call, good, bad, error, message = _deferred_cases()[name]
    device_checks.raise_device_errors()  # start clear
    want = call(_values(name, good))  # the eager call, checked at once
    with device_checks.deferred():
        first = call(_values(name, good))
        call(_values(name, bad))
        after = call(_values(name, good))  # a good call after a bad one: the flag stays failed
    with pytest.raises(error, match=message):
        device_checks.raise_device_errors()
    for bit in device_checks.FLAGGED:
        assert device_checks.flag(bit, torch.device("cuda")).tolist() == [-1]
    with device_checks.deferred():
        again = call(_values(name, good))
    device_checks.raise_device_errors()  # cleared: good calls raise nothing
    for got in (first, after, again):
        assert_bitwise_equal(got, want)


@pytest.mark.parametrize("name", DEFERRED_CASES)
def test_a_captured_check_accumulates_over_replays_then_is_clear(name):
    call, good, bad, error, message = _deferred_cases()[name]
    device_checks.raise_device_errors()
    want = call(_values(name, good))
    values = _values(name, good)
    graph, out = captured(lambda: call(values))
    graph.replay()
    device_checks.raise_device_errors()
    assert_bitwise_equal(out, want)
    values.copy_(_values(name, bad))
    graph.replay()
    values.copy_(_values(name, good))
    graph.replay()  # a good replay after a bad one
    with pytest.raises(error, match=message):
        device_checks.raise_device_errors()
    graph.replay()
    device_checks.raise_device_errors()  # cleared
    assert_bitwise_equal(out, want)


def _gpu_work(fn) -> int:
    """How many kernels, copies and memsets one call of ``fn`` puts on the GPU."""
    fn()  # warm: modules, plans and cached tables
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def test_deferred_checks_add_no_gpu_work():
    # The embedding, RoPE and token_logprobs target-marking kernels write the persistent flag:
    # a deferred call does exactly what an unchecked call does.
    table = torch.randn(100, 64, device="cuda", dtype=torch.bfloat16)
    ids = torch.tensor([3, 7, 99], device="cuda")
    q = torch.randn(4, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(4, 2, 128, device="cuda", dtype=torch.bfloat16)
    positions = torch.tensor([0, 5, 9, 11], device="cuda")
    hidden = torch.randn(5, 256, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16) / 16
    targets = torch.tensor([1, 999, 5, -100, 0], device="cuda")
    rope = {"theta": 1e6, "max_position": 64}
    unchecked = (
        _gpu_work(lambda: batchinv.embedding(ids, table, check_ids=False)),
        _gpu_work(lambda: batchinv.rope(q, k, positions, check_positions=False, **rope)),
        _gpu_work(lambda: gpu_token_logprobs.forward(hidden, weight, targets, -100, False, False)),
    )
    with device_checks.deferred():
        deferred = (
            _gpu_work(lambda: batchinv.embedding(ids, table)),
            _gpu_work(lambda: batchinv.rope(q, k, positions, **rope)),
            _gpu_work(lambda: gpu_token_logprobs.forward(hidden, weight, targets, -100, False)),
        )
    device_checks.raise_device_errors()
    assert deferred == unchecked

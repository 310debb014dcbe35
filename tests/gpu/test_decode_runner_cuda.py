"""The sampler on CUDA: steps replayed from CUDA graphs give the bits of eager steps, of
``Qwen3.generate`` and of the trainer's ``token_logprobs``, in every bucket and padded into
one; device-side checks raise at the next sync and leave the cache as it was."""

from __future__ import annotations

import pytest
import torch

from batchinv.contract import assert_bitwise_equal
from batchinv.models import Qwen3
from batchinv.models.qwen3.decode import Qwen3DecodeRunner

pytestmark = pytest.mark.cuda

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11], [300, 4, 17, 17], [5] * 40]


@pytest.fixture(scope="module")
def model():
    return Qwen3.from_config(seed=0, device="cuda", dtype=torch.bfloat16)


def run(model, prompts, steps, *, cuda_graph, max_batch=8, capacity=64, **kwargs):
    runner = Qwen3DecodeRunner(
        model, max_batch=max_batch, capacity=capacity, cuda_graph=cuda_graph, **kwargs
    )
    slots = runner.add(prompts, seeds=list(range(len(prompts))))
    for _ in range(steps):
        runner.step()
    return runner, slots


@pytest.mark.parametrize("temperature", [None, 0.8])
def test_graph_replay_equals_eager_steps(model, temperature):
    graphed, slots = run(model, PROMPTS, 12, cuda_graph=True, temperature=temperature)
    eager, eager_slots = run(model, PROMPTS, 12, cuda_graph=False, temperature=temperature)
    assert graphed._graphs, "no step was replayed from a graph"
    for a, b in zip(slots, eager_slots, strict=True):
        assert graphed.tokens(a) == eager.tokens(b)
        assert_bitwise_equal(graphed.logprobs(a), eager.logprobs(b))


def test_greedy_graph_equals_generate_and_the_trainer(model):
    graphed, slots = run(model, PROMPTS, 10, cuda_graph=True)
    expected = model.generate([torch.tensor(p) for p in PROMPTS], 11)
    sequences = [graphed.tokens(s) for s in slots]
    assert sequences == [e.tolist() for e in expected]
    trainer = model.token_logprobs([torch.tensor(s) for s in sequences], [len(p) for p in PROMPTS])
    for slot, want in zip(slots, trainer, strict=True):
        assert_bitwise_equal(graphed.logprobs(slot), want.detach().cpu())


@pytest.mark.parametrize("others", [0, 1, 2, 6])
def test_a_slot_has_the_same_bits_in_any_bucket(model, others):
    reference, ref_slots = run(model, PROMPTS[2:3], 9, cuda_graph=True, temperature=0.9)
    runner = Qwen3DecodeRunner(model, max_batch=8, capacity=64, temperature=0.9)
    filler = []
    if others:
        filler = runner.add(
            [[11 + i, 3] for i in range(others)], seeds=[50 + i for i in range(others)]
        )
    (slot,) = runner.add(PROMPTS[2:3], seeds=[0])
    for _ in range(9):
        runner.step([*filler, slot])  # buckets 1, 2, 4 and 8: padded with inert rows
    assert runner.bucket_for(others + 1) in runner._graphs
    assert runner.tokens(slot) == reference.tokens(ref_slots[0])
    assert_bitwise_equal(runner.logprobs(slot), reference.logprobs(ref_slots[0]))


def test_a_bad_device_token_raises_at_sync_and_writes_nothing(model):
    runner, slots = run(model, PROMPTS[:2], 2, cuda_graph=True, max_batch=2)
    k, v, lengths = runner.cache.k.clone(), runner.cache.v.clone(), runner.cache.lengths.clone()
    good = runner._next_token[slots[0]].clone()
    runner._next_token[slots[0]] = 10_000  # as a corrupted device buffer would hold
    runner.step()  # replayed: no host sync, no exception yet
    with pytest.raises(IndexError, match="embedding"):
        runner.sync()
    # Every slot's storage and length as before; the failed step's writes went to the scratch
    # row (the last row of each layer), which belongs to no slot and is never read.
    assert_bitwise_equal(runner.cache.k[:, :-1], k[:, :-1])
    assert_bitwise_equal(runner.cache.v[:, :-1], v[:, :-1])
    assert_bitwise_equal(runner.cache.lengths, lengths)
    runner._next_token[slots[0]] = good  # fixed: steps run again, as if nothing had happened
    runner.step()
    fresh, fresh_slots = run(model, PROMPTS[:2], 3, cuda_graph=True, max_batch=2)
    assert [runner.tokens(s) for s in slots] == [fresh.tokens(s) for s in fresh_slots]


def test_capacity_is_checked_on_the_host_before_a_replay(model):
    runner, _ = run(model, [[1] * 14], 1, cuda_graph=True, max_batch=2, capacity=16)
    runner.step()
    lengths = runner.cache.lengths.clone()
    with pytest.raises(ValueError, match="past the capacity"):
        runner.step()
    assert_bitwise_equal(runner.cache.lengths, lengths)

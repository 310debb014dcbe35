"""The sampler (``Qwen3DecodeRunner``) on the CPU: the same tokens as ``Qwen3.generate``, the
trainer's logprobs bit for bit, samples that depend only on a slot's seed and tokens, bucket
padding that changes nothing, and bad input refused before anything changes.  The same checks
with CUDA graphs: ``tests/gpu/test_decode_runner_cuda.py``."""

from __future__ import annotations

import pytest
import torch

from batchinv.contract import assert_bitwise_equal
from batchinv.models import Qwen3
from batchinv.models.qwen3.decode import Qwen3DecodeRunner, default_buckets, exponential_noise

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11], [300, 4, 17, 17]]


@pytest.fixture(scope="module")
def model():
    return Qwen3.from_config(seed=0)


def run(model, prompts, steps, *, max_batch=4, capacity=16, seeds=None, **kwargs):
    runner = Qwen3DecodeRunner(model, max_batch=max_batch, capacity=capacity, **kwargs)
    slots = runner.add(prompts, seeds=seeds)
    for _ in range(steps):
        runner.step()
    return runner, slots


def test_greedy_tokens_equal_generate(model):
    expected = model.generate([torch.tensor(p) for p in PROMPTS], 5)
    runner, slots = run(model, PROMPTS, 4)
    assert [runner.tokens(s) for s in slots] == [e.tolist() for e in expected]


def test_logprobs_are_the_trainers_bits(model):
    runner, slots = run(model, PROMPTS, 4)
    sequences = [torch.tensor(runner.tokens(s)) for s in slots]
    trainer = model.token_logprobs(sequences, [len(p) for p in PROMPTS])
    for slot, expected in zip(slots, trainer, strict=True):
        got = runner.logprobs(slot)
        assert got.shape == (5,) and got.dtype == torch.float32
        assert_bitwise_equal(got, expected.detach())


@pytest.mark.parametrize("temperature", [None, 0.7])
def test_a_slot_does_not_depend_on_its_batch(model, temperature):
    together, slots = run(model, PROMPTS, 6, seeds=[5, 6, 7, 8], temperature=temperature)
    # alone, in a larger runner (other buckets, other slot index), after another sequence
    alone = Qwen3DecodeRunner(model, max_batch=8, capacity=32, temperature=temperature)
    alone.add([[42, 43]], seeds=[1])
    (slot,) = alone.add([PROMPTS[2]], seeds=[7])
    for _ in range(6):
        alone.step([slot])
    assert alone.tokens(slot) == together.tokens(slots[2])
    assert_bitwise_equal(alone.logprobs(slot), together.logprobs(slots[2]))


def test_sampling_follows_the_seed(model):
    a, sa = run(model, PROMPTS[:1], 8, seeds=[1], temperature=1.0)
    b, sb = run(model, PROMPTS[:1], 8, seeds=[2], temperature=1.0)
    greedy, sg = run(model, PROMPTS[:1], 8)
    assert a.tokens(sa[0]) != b.tokens(sb[0])
    assert a.tokens(sa[0]) != greedy.tokens(sg[0])


def test_exponential_noise_is_keyed_by_seed_position_and_id_only():
    seeds = torch.tensor([3, 3, 4])
    positions = torch.tensor([10, 11, 10])
    noise = exponential_noise(seeds, positions, 1000)
    assert noise.shape == (3, 1000) and noise.dtype == torch.float32
    assert torch.isfinite(noise).all() and (noise > 0).all()
    assert_bitwise_equal(noise[1:2], exponential_noise(seeds[1:2], positions[1:2], 1000))
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    # Exp(1): mean 1, and P(E > 1) = 1/e
    draws = exponential_noise(torch.arange(200), torch.zeros(200, dtype=torch.int64), 1000)
    assert abs(draws.mean().item() - 1.0) < 0.01
    assert abs((draws > 1).float().mean().item() - 0.3679) < 0.01


def test_steps_of_some_slots(model):
    runner, slots = run(model, PROMPTS, 0)
    runner.step([slots[1], slots[3]])
    runner.step([slots[3]])
    lengths = [len(runner.tokens(s)) for s in slots]
    assert lengths == [6, 4, 4, 7]
    runner.release(slots[0])
    (again,) = runner.add([[5, 5, 5]])
    assert again == slots[0] and runner.tokens(again)[:3] == [5, 5, 5]


def test_default_buckets():
    assert default_buckets(1) == (1,)
    assert default_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert default_buckets(300)[-3:] == (224, 256, 300)


def _state(runner):
    return (
        runner.cache.k.clone(),
        runner.cache.v.clone(),
        runner.cache.lengths.clone(),
        dict(runner._lengths),
    )


def _assert_unchanged(runner, before):
    after = _state(runner)
    for a, b in zip(before[:3], after[:3], strict=True):
        assert_bitwise_equal(a, b)
    assert before[3] == after[3]


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (lambda r, s: r.step([s[0], s[0]]), ValueError, "unique"),
        (lambda r, s: r.step([99]), ValueError, "slot 99"),
        (lambda r, s: r.add([[1]] * 4), ValueError, "free slots"),
        (lambda r, s: r.add([[1, 512]]), IndexError, "prompts[0][1]"),
        (lambda r, s: r.add([[-1]]), IndexError, "prompts[0][0]"),
        (lambda r, s: r.add([list(range(17))]), ValueError, "capacity"),
        (lambda r, s: r.add([[1]], seeds=[1.5]), TypeError, "seeds"),
        (lambda r, s: r.add([[1]], seeds=[1, 2]), TypeError, "seeds"),
        (lambda r, s: r.add([[1.5]]), TypeError, "prompts[0]"),
        (lambda r, s: r.add([]), TypeError, "prompts"),
        (lambda r, s: r.tokens(3), ValueError, "slot 3"),
        (lambda r, s: r.release(3), ValueError, "slot 3"),
        (lambda r, s: r.step([True]), TypeError, "slots[0]"),  # True == 1, an active slot
        (lambda r, s: r.step([1.0]), TypeError, "slots[0]"),
        (lambda r, s: r.tokens(True), TypeError, "slot"),
    ],
)
def test_bad_input_changes_nothing(model, call, error, words):
    runner, slots = run(model, PROMPTS[:3], 2, max_batch=4, capacity=16)
    before = _state(runner)
    with pytest.raises(error, match=words.replace("[", r"\[").replace("]", r"\]")):
        call(runner, slots)
    _assert_unchanged(runner, before)
    runner.step()  # still works, and gives what an untouched runner gives
    fresh, fresh_slots = run(model, PROMPTS[:3], 3, max_batch=4, capacity=16)
    assert [runner.tokens(s) for s in slots] == [fresh.tokens(s) for s in fresh_slots]


def test_capacity_is_checked_before_the_step(model):
    runner, slots = run(model, [[1] * 14], 1, max_batch=2, capacity=16)  # 15 cached
    runner.step()  # 16: full
    before = _state(runner)
    with pytest.raises(ValueError, match="past the capacity"):
        runner.step()
    _assert_unchanged(runner, before)


def test_a_bad_token_on_the_device_writes_nothing(model):
    runner, slots = run(model, PROMPTS[:2], 1, max_batch=2, capacity=16)
    before = _state(runner)
    runner._next_token[slots[0]] = 10_000  # as a corrupted device buffer would hold
    # The CPU reference checks ids at once (reading them costs no sync there); a GPU step
    # records the failure and raises at the next sync.
    with pytest.raises(IndexError, match="outside"):
        runner.step()
        runner.sync()
    for a, b in zip(before[:3], _state(runner)[:3], strict=True):
        assert_bitwise_equal(a, b)  # no byte of the cache and no length changed


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"max_batch": 0}, ValueError, "max_batch"),
        ({"capacity": 10**6}, ValueError, "max_position_embeddings"),
        ({"temperature": 0.0}, ValueError, "temperature"),
        ({"buckets": [1, 2]}, ValueError, "largest bucket"),
        ({"cuda_graph": True}, ValueError, "CUDA"),
    ],
)
def test_bad_runner_settings(model, kwargs, error, words):
    settings = {"max_batch": 4, "capacity": 16, **kwargs}
    with pytest.raises(error, match=words):
        Qwen3DecodeRunner(model, **settings)


def test_the_runner_recovers_after_a_failed_device_check(model):
    runner, slots = run(model, PROMPTS[:2], 1, max_batch=2, capacity=16)
    good = runner._next_token[slots[0]].clone()
    runner.status.record(1, torch.tensor([True]))  # as a failed device check leaves it
    runner.step()  # writes nothing: the status predicates every write
    with pytest.raises(IndexError, match="embedding"):
        runner.sync()
    runner._next_token[slots[0]] = good
    runner.step()
    fresh, fresh_slots = run(model, PROMPTS[:2], 2, max_batch=2, capacity=16)
    assert [runner.tokens(s) for s in slots] == [fresh.tokens(s) for s in fresh_slots]


def test_generate_through_the_sampler(model):
    prompts = [torch.tensor(p) for p in PROMPTS]
    greedy = model.generate(prompts, 4)
    sequences, logprobs = model.generate(prompts, 4, return_logprobs=True)
    assert [s.tolist() for s in sequences] == [g.tolist() for g in greedy]
    trainer = model.token_logprobs(sequences, [len(p) for p in PROMPTS])
    for got, want in zip(logprobs, trainer, strict=True):
        assert_bitwise_equal(got, want.detach())
    sampled = model.generate(prompts, 4, seeds=[1, 2, 3, 4], temperature=0.7)
    runner, slots = run(model, PROMPTS, 3, seeds=[1, 2, 3, 4], temperature=0.7)
    assert [s.tolist() for s in sampled] == [runner.tokens(s) for s in slots]


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"max_new_tokens": 10**6}, ValueError, "max_position_embeddings"),
        ({"max_new_tokens": 2.0}, TypeError, "max_new_tokens"),
        ({"generator": torch.Generator(), "seeds": [1, 2, 3, 4]}, ValueError, "generator"),
        ({"ops": "stock", "return_logprobs": True}, ValueError, "batchinv"),
        ({"cuda_graph": True}, ValueError, "CUDA"),
    ],
)
def test_generate_refuses_bad_settings(model, kwargs, error, words):
    kwargs = {"max_new_tokens": 3, **kwargs}
    with pytest.raises(error, match=words):
        model.generate([torch.tensor(p) for p in PROMPTS], **kwargs)


def test_a_dropped_runner_frees_its_cache(model):
    import gc
    import weakref

    runner, _ = run(model, PROMPTS[:1], 1)
    cache = weakref.ref(runner.cache.k)
    gc.disable()  # freed by reference counting alone, without the cycle collector
    try:
        del runner
        assert cache() is None
    finally:
        gc.enable()


def test_a_bad_token_makes_every_write_of_the_step_a_no_op(model, monkeypatch):
    """As on the GPU, where the embedding kernel gives a NaN row for a bad id and raises
    nothing: the step runs to its end and must still write nothing to any slot."""
    from batchinv.models.qwen3 import decode

    def gpu_like_embedding(ids, weight):
        safe = torch.where((ids >= 0) & (ids < weight.shape[0]), ids, 0)
        rows = weight[safe]
        return torch.where(((ids < 0) | (ids >= weight.shape[0]))[..., None], float("nan"), rows)

    monkeypatch.setattr(decode, "_embedding", gpu_like_embedding)
    runner, slots = run(model, PROMPTS[:2], 1, max_batch=2, capacity=16)
    k, v = runner.cache.k.clone(), runner.cache.v.clone()
    lengths = runner.cache.lengths.clone()
    runner._next_token[slots[0]] = 10_000
    runner.step()
    with pytest.raises(IndexError, match="embedding"):
        runner.sync()
    assert_bitwise_equal(runner.cache.k[:, :-1], k[:, :-1])  # the last row: the scratch row
    assert_bitwise_equal(runner.cache.v[:, :-1], v[:, :-1])
    assert_bitwise_equal(runner.cache.lengths, lengths)


def test_a_prefill_that_fails_leaves_its_slots_free(model, monkeypatch):
    """A failure inside the prefill (out of memory, say) after every check passed: the slots
    it took are free again and the runner goes on as if the call had not been made."""
    from batchinv.models.qwen3 import decode

    runner, slots = run(model, PROMPTS[:2], 1, max_batch=4, capacity=16)
    before = _state(runner)
    free = list(runner._free)

    def fail(*args, **kwargs):
        raise RuntimeError("simulated failure inside the prefill")

    with monkeypatch.context() as patch:
        patch.setattr(decode, "qwen3_final_hidden", fail)
        with pytest.raises(RuntimeError, match="simulated failure"):
            runner.add([PROMPTS[2], PROMPTS[3]])
    assert runner._free == free
    assert dict(runner._lengths) == before[3]
    assert (runner.add([PROMPTS[2]]), runner.add([PROMPTS[3]])) == ([free[-1]], [free[-2]])

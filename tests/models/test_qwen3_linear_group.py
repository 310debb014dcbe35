"""The chain's optional ``Qwen3Ops.linear_group`` (q/k/v and gate/up of one ``x``) on the CPU:
called exactly where no gradient is needed, its outputs used as they are (views of one tensor
included), the table's ``linear`` run per weight where it returns None or is absent, and
batchinv's entry declining everything but CUDA sm_90a.  The grouped kernel's bits and the
sampler on CUDA: ``tests/gpu/test_linear_grouped_cuda.py``."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _chain_entries import IDS, PROMPTS, SEQLENS, Counting, forwards

from batchinv.contract import assert_bitwise_equal
from batchinv.models import Qwen3, Qwen3Config
from batchinv.models.qwen3.decode import Qwen3DecodeRunner
from batchinv.models.qwen3.ops import BATCHINV_OPS, REFERENCE_OPS, STOCK_OPS

SEPARATE = dataclasses.replace(BATCHINV_OPS, linear_group=None)


@pytest.fixture(scope="module")
def model():
    return Qwen3.from_config(seed=0, dtype=torch.bfloat16)


def one_output_views(linear):
    """A ``linear_group`` that returns column views of one tensor, as the grouped kernel does:
    each weight's ``linear`` (so the bits are known) copied into one ``[..., sum N]`` output."""

    def linear_group(x, weights, biases):
        parts = [linear(x, w, b) for w, b in zip(weights, biases, strict=True)]
        out = torch.cat(parts, dim=-1)
        return tuple(out.split([w.shape[0] for w in weights], dim=-1))

    return linear_group


def test_reference_and_stock_run_separate_linears():
    assert REFERENCE_OPS.linear_group is None
    assert STOCK_OPS.linear_group is None
    assert BATCHINV_OPS.linear_group is not None


def test_linear_group_runs_twice_per_layer_without_gradients(model):
    entry = Counting(BATCHINV_OPS.linear_group)
    linear = Counting(BATCHINV_OPS.linear)
    ops = dataclasses.replace(BATCHINV_OPS, linear_group=entry, linear=linear)
    with torch.no_grad():
        got = forwards(model, ops)
        want = forwards(model, SEPARATE)
    layers = model.config.num_hidden_layers
    # q/k/v and gate/up in every layer of 5 forwards (the chunked prefill is 3).
    assert entry.calls == 5 * 2 * layers
    # On the CPU batchinv's entry declines, so the table's linear runs every product:
    # 7 per layer and the lm_head, per forward.
    assert linear.calls == 5 * (7 * layers + 1)
    for a, b in zip(got, want, strict=True):
        assert_bitwise_equal(a, b)


def test_chain_takes_views_of_one_output_with_the_same_bits(model):
    calls = Counting(one_output_views(BATCHINV_OPS.linear))
    grouped = dataclasses.replace(BATCHINV_OPS, linear_group=calls)
    with torch.no_grad():
        got = forwards(model, grouped)
        want = forwards(model, SEPARATE)
    assert calls.calls == 5 * 2 * model.config.num_hidden_layers
    for a, b in zip(got, want, strict=True):
        assert_bitwise_equal(a, b)


def test_chain_with_biases_passes_them_per_weight():
    config = dataclasses.replace(Qwen3Config.tiny(), attention_bias=True)
    biased = Qwen3.from_config(config, seed=3, dtype=torch.bfloat16)
    seen = []

    def recording(x, weights, biases):
        seen.append([None if b is None else tuple(b.shape) for b in biases])
        return one_output_views(BATCHINV_OPS.linear)(x, weights, biases)

    grouped = dataclasses.replace(BATCHINV_OPS, linear_group=recording)
    with torch.no_grad():
        got = biased(IDS, seqlens=SEQLENS, ops=grouped)
        want = biased(IDS, seqlens=SEQLENS, ops=SEPARATE)
    assert_bitwise_equal(got, want)
    q_out = config.num_attention_heads * config.head_dim
    kv_out = config.num_key_value_heads * config.head_dim
    assert seen[0] == [(q_out,), (kv_out,), (kv_out,)]  # q/k/v of layer 0
    assert seen[1] == [None, None]  # gate/up: no bias


def test_training_runs_separate_linears(model):
    refusing = dataclasses.replace(BATCHINV_OPS, linear_group=Counting(None, refuse=True))
    logits = model(IDS, seqlens=SEQLENS, ops=refusing)
    logits.float().sum().backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert grads["model.layers.0.self_attn.q_proj.weight"] is not None
    assert grads["model.layers.0.mlp.up_proj.weight"] is not None
    model.zero_grad(set_to_none=True)


def test_an_entry_returning_none_leaves_the_tables_linear(model):
    linear = Counting(BATCHINV_OPS.linear)
    declining = Counting(lambda x, weights, biases: None)
    ops = dataclasses.replace(BATCHINV_OPS, linear=linear, linear_group=declining)
    with torch.no_grad():
        got = model(IDS, seqlens=SEQLENS, ops=ops)
        want = model(IDS, seqlens=SEQLENS, ops=SEPARATE)
    layers = model.config.num_hidden_layers
    assert declining.calls == 2 * layers
    assert linear.calls == 7 * layers + 1
    assert_bitwise_equal(got, want)


def test_batchinv_entry_declines_on_the_cpu():
    x = torch.randn(2, 1, 64).to(torch.bfloat16)
    weights = [torch.randn(n, 64).to(torch.bfloat16) for n in (32, 16, 16)]
    with torch.no_grad():
        assert BATCHINV_OPS.linear_group(x, weights, [None] * 3) is None


def runner_tokens(model, ops_change: dict, steps: int = 4):
    runner = Qwen3DecodeRunner(model, max_batch=4, capacity=16, temperature=0.8)
    runner._ops = dataclasses.replace(runner._ops, **ops_change)
    slots = runner.add(PROMPTS, seeds=[1, 2, 3])
    for _ in range(steps):
        runner.step()
    return runner, slots


def test_the_sampler_calls_linear_group_with_the_same_bits(model):
    entry = Counting(one_output_views(BATCHINV_OPS.linear))
    grouped, slots = runner_tokens(model, {"linear_group": entry})
    plain, plain_slots = runner_tokens(model, {"linear_group": None})
    steps = 4
    # the prefill and every step, q/k/v and gate/up in every layer
    assert entry.calls == (1 + steps) * 2 * model.config.num_hidden_layers
    for a, b in zip(slots, plain_slots, strict=True):
        assert grouped.tokens(a) == plain.tokens(b)
        assert_bitwise_equal(grouped.logprobs(a), plain.logprobs(b))
    assert_bitwise_equal(grouped.cache.k, plain.cache.k)
    assert_bitwise_equal(grouped.cache.v, plain.cache.v)

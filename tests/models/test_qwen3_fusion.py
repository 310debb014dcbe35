"""The chain's optional fused steps (``Qwen3Ops.add_rms_norm`` and
``Qwen3Ops.qk_norm_rope_attention_with_kv_cache``) on the CPU: called exactly where no gradient
is needed, and the same bits as the steps they replace.  The CUDA kernels' bits:
``tests/gpu/test_decode_fusion_cuda.py``."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _chain_entries import IDS, PROMPTS, SEQLENS, Counting, forwards

from batchinv.contract import assert_bitwise_equal
from batchinv.gpu import qk_norm_rope as fused_kernel
from batchinv.models import Qwen3
from batchinv.models.qwen3.decode import Qwen3DecodeRunner
from batchinv.models.qwen3.ops import BATCHINV_OPS, REFERENCE_OPS, STOCK_OPS

UNFUSED = dataclasses.replace(BATCHINV_OPS, add_rms_norm=None)


@pytest.fixture(scope="module")
def model():
    return Qwen3.from_config(seed=0, dtype=torch.bfloat16)


def test_add_rms_norm_runs_without_gradients_with_the_same_bits(model):
    entry = Counting(BATCHINV_OPS.add_rms_norm)
    fused = dataclasses.replace(BATCHINV_OPS, add_rms_norm=entry)
    with torch.no_grad():
        got = forwards(model, fused)
        want = forwards(model, UNFUSED)
    # Every residual add is followed by a norm: two per layer (the first layer's input norm
    # has none, the final norm has one); 5 forwards (the chunked prefill is 3).
    assert entry.calls == 5 * 2 * model.config.num_hidden_layers
    for a, b in zip(got, want, strict=True):
        assert_bitwise_equal(a, b)


def test_training_runs_the_unfused_steps(model):
    refusing = dataclasses.replace(
        BATCHINV_OPS,
        add_rms_norm=Counting(BATCHINV_OPS.add_rms_norm, refuse=True),
        qk_norm_rope_attention_with_kv_cache=Counting(None, refuse=True),
    )
    logits = model(IDS, seqlens=SEQLENS, ops=refusing)
    logits.float().sum().backward()
    assert model.model.embed_tokens.weight.grad is not None
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        assert_bitwise_equal(logits.detach(), model(IDS, seqlens=SEQLENS, ops=BATCHINV_OPS))


@pytest.mark.parametrize("ops", [REFERENCE_OPS, STOCK_OPS, BATCHINV_OPS], ids=lambda o: o.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_add_rms_norm_is_the_tables_add_then_norm(ops, dtype):
    g = torch.Generator().manual_seed(1)
    h, delta = (torch.randn(5, 3, 64, generator=g).to(dtype) * 4 for _ in range(2))
    weight = torch.randn(64, generator=g).to(dtype)
    y, new_h = ops.add_rms_norm(h, delta, weight, 1e-6)
    want_h = ops.residual_add(h, delta)
    assert_bitwise_equal(new_h, want_h)
    assert_bitwise_equal(y, ops.rms_norm(want_h, weight, 1e-6))


def test_batchinv_add_rms_norm_takes_mixed_dtypes_unfused():
    h = torch.randn(4, 32).to(torch.bfloat16)
    delta = torch.randn(4, 32)
    weight = torch.randn(32).to(torch.bfloat16)
    y, new_h = BATCHINV_OPS.add_rms_norm(h, delta, weight, 1e-6)
    want_h = BATCHINV_OPS.residual_add(h, delta)
    assert new_h.dtype == torch.bfloat16
    assert_bitwise_equal(new_h, want_h)
    assert_bitwise_equal(y, BATCHINV_OPS.rms_norm(want_h, weight, 1e-6))


def runner_tokens(model, unfused: bool, steps: int = 4):
    runner = Qwen3DecodeRunner(model, max_batch=4, capacity=16, temperature=0.8)
    entry = None
    if unfused:
        runner._ops = dataclasses.replace(
            runner._ops, add_rms_norm=None, qk_norm_rope_attention_with_kv_cache=None
        )
    else:
        entry = Counting(runner._ops.qk_norm_rope_attention_with_kv_cache)
        runner._ops = dataclasses.replace(runner._ops, qk_norm_rope_attention_with_kv_cache=entry)
    slots = runner.add(PROMPTS, seeds=[1, 2, 3])
    for _ in range(steps):
        runner.step()
    if entry is not None:  # the prefill and every step, in every layer
        assert entry.calls == (1 + steps) * model.config.num_hidden_layers
    return runner, slots


def test_the_sampler_takes_the_fused_steps_with_the_same_bits(model):
    fused, slots = runner_tokens(model, unfused=False)
    plain, plain_slots = runner_tokens(model, unfused=True)
    for a, b in zip(slots, plain_slots, strict=True):
        assert fused.tokens(a) == plain.tokens(b)
        assert_bitwise_equal(fused.logprobs(a), plain.logprobs(b))
    assert_bitwise_equal(fused.cache.k, plain.cache.k)
    assert_bitwise_equal(fused.cache.v, plain.cache.v)


def test_the_fused_kernel_covers_every_head_dim_the_chain_accepts():
    # Even head dims 2 .. 256 in every dtype fall in a geometry with a fused entry.
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for head_dim in range(2, 257, 2):
            assert fused_kernel.geometry(head_dim, dtype) in fused_kernel.GEOMETRIES

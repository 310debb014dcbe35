"""Fewer launches per decode layer, the same bits, on CUDA:

- the chain's fused residual add + RMSNorm (``Qwen3Ops.add_rms_norm``): hidden states and logits
  equal to the unfused chain's bit for bit (padded, packed and chunked prefills);
- ``kernels_cu/qk_norm_rope.cu`` (the q/k norms, RoPE and the cache append in one kernel): q
  and the cache rows equal to ``rms_norm``, ``rope`` and ``index_copy_`` bit for bit, in every
  dtype and head_dim geometry, for contiguous, packed and misaligned inputs, odd token counts
  and several passes of heads, bad positions included;
- the sampler with and without the fusions: the same tokens, logprobs and cache contents,
  eager and replayed, in several buckets, and a failed step writes nothing.
CPU tests of the op-table logic: ``tests/models/test_qwen3_fusion.py``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import batchinv
from batchinv.contract import assert_bitwise_equal
from batchinv.gpu import qk_norm_rope as fused_kernel
from batchinv.models import Qwen3, Qwen3Config
from batchinv.models.qwen3.decode import Qwen3DecodeRunner
from batchinv.models.qwen3.ops import BATCHINV_OPS

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
EPS = 1e-6
THETA = 1_000_000.0
MAX_POSITION = 40960
UNFUSED_ADD = dataclasses.replace(BATCHINV_OPS, add_rms_norm=None)
IDS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2]]
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11], [300, 4, 17, 17], [5] * 40]
# The fused kernel's cases: (dtype, head_dim, q heads, kv heads).  rms_norm's geometry: t4 up to
# 16 chunks of 16 bytes (bf16/fp16 head_dim <= 128, fp32 <= 64), t16 beyond; a CTA norms
# 128 / T heads per pass, so 40 heads take two passes of t4 and 12 heads two of t16.
KERNEL_CASES = [
    (torch.bfloat16, 128, 32, 8),  # Qwen3-8B
    (torch.bfloat16, 64, 5, 1),
    (torch.float16, 128, 40, 8),
    (torch.float16, 64, 3, 3),
    (torch.bfloat16, 256, 9, 3),  # t16
    (torch.float32, 128, 8, 4),  # t16
    (torch.float32, 64, 4, 2),
    (torch.bfloat16, 96, 6, 2),
    (torch.bfloat16, 6, 3, 1),  # half = 3: element-wise rotation, a partial chunk
    (torch.float32, 2, 2, 1),
]
TOKEN_COUNTS = [1, 3, 17, 33]
LAYOUTS = ["contiguous", "packed", "misaligned"]


def _config(head_dim: int, heads: int, kv_heads: int) -> Qwen3Config:
    return dataclasses.replace(
        Qwen3Config.tiny(),
        head_dim=head_dim,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        rope_theta=THETA,
    )


MODELS = {
    "bf16-d64": (None, torch.bfloat16),
    "fp16-d128": (_config(128, 8, 2), torch.float16),
}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    config, dtype = MODELS[request.param]
    return Qwen3.from_config(config, seed=0, device=DEVICE, dtype=dtype)


# ----- residual add + norm in the chain ------------------------------------------------------


def _chain_outputs(model, ops):
    ids = torch.tensor(IDS, device=DEVICE)
    seqlens = torch.tensor([11, 6], device=DEVICE)
    packed = torch.cat([ids[0], ids[1, :6]])
    cu_seqlens = torch.tensor([0, 11, 17], device=DEVICE, dtype=torch.int32)
    return [
        model.final_hidden(ids, seqlens=seqlens, ops=ops),
        model(ids, seqlens=seqlens, ops=ops),
        model(packed, cu_seqlens=cu_seqlens, ops=ops),
        model.prefill_chunked(ids, [4, 1, 6], ops=ops),
        model.prefill_chunked(ids, [1] * 11, ops=ops),  # token by token: decode shapes
    ]


def test_fused_add_norm_keeps_the_chains_bits(model):
    calls = []

    def counting(*args):
        calls.append(1)
        return BATCHINV_OPS.add_rms_norm(*args)

    fused = dataclasses.replace(BATCHINV_OPS, add_rms_norm=counting)
    with torch.no_grad():
        got = _chain_outputs(model, fused)
        want = _chain_outputs(model, UNFUSED_ADD)
    assert calls, "the fused add + norm never ran"
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert_bitwise_equal(a, b, name=f"output {i}")


def test_training_forward_has_the_no_grad_bits(model):
    ids = torch.tensor(IDS, device=DEVICE)
    with_grad = model(ids)  # parameters require grad: the unfused steps
    assert with_grad.requires_grad
    with torch.no_grad():
        assert_bitwise_equal(with_grad.detach(), model(ids))


# ----- the fused kernel against the unfused ops ----------------------------------------------


def _inputs(dtype, head_dim, hq, hk, tokens, layout, gen):
    """q, k, v ``[tokens, 1, H, d]`` as the chain's projections would give them."""
    width = (hq + 2 * hk) * head_dim
    pad = 1 if layout == "misaligned" else 0  # one element off: element-wise loads
    qkv = torch.randn(tokens, width + pad, device=DEVICE, generator=gen).to(dtype) * 3
    # views of one projection output, rows (hq + 2 hk) * head_dim (+ pad) apart
    q, k, v = qkv[:, pad:].split([hq * head_dim, hk * head_dim, hk * head_dim], 1)
    if layout == "contiguous":
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return (
        q.reshape(tokens, 1, hq, head_dim),
        k.reshape(tokens, 1, hk, head_dim),
        v.reshape(tokens, 1, hk, head_dim),
    )


def _unfused(q, k, v, q_weight, k_weight, positions, rows, k_cache, v_cache):
    head_dim = q.shape[-1]
    q = batchinv.rms_norm(q, q_weight, EPS)
    k = batchinv.rms_norm(k, k_weight, EPS)
    q, k = batchinv.rope(
        q, k, positions, theta=THETA, head_dim=head_dim, max_position=MAX_POSITION,
        check_positions=False,
    )  # fmt: skip
    k_cache.index_copy_(0, rows, k.reshape(rows.numel(), *k_cache.shape[1:]))
    v_cache.index_copy_(0, rows, v.reshape(rows.numel(), *v_cache.shape[1:]))
    return q


def _case(dtype, head_dim, hq, hk, tokens, layout, index_dtype=torch.int64, bad=()):
    gen = torch.Generator(device=DEVICE).manual_seed(head_dim * 1000 + tokens)
    q, k, v = _inputs(dtype, head_dim, hq, hk, tokens, layout, gen)
    q_weight = (torch.rand(head_dim, device=DEVICE, generator=gen) + 0.5).to(dtype)
    k_weight = (torch.rand(head_dim, device=DEVICE, generator=gen) + 0.5).to(dtype)
    positions = torch.randint(0, MAX_POSITION, (tokens, 1), device=DEVICE, generator=gen)
    for token, value in bad:
        positions[token, 0] = value
    positions = positions.to(index_dtype)
    storage = 2 * tokens + 5
    rows = torch.randperm(storage, device=DEVICE, generator=gen)[:tokens]
    caches = [torch.full((storage, hk, head_dim), float("nan"), dtype=dtype, device=DEVICE)]
    caches.append(torch.randn(storage, hk, head_dim, device=DEVICE, generator=gen).to(dtype))
    return q, k, v, q_weight, k_weight, positions, rows, caches


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tokens", TOKEN_COUNTS)
@pytest.mark.parametrize(("dtype", "head_dim", "hq", "hk"), KERNEL_CASES)
def test_kernel_has_the_bits_of_norm_rope_and_append(dtype, head_dim, hq, hk, tokens, layout):
    q, k, v, q_weight, k_weight, positions, rows, (k_cache, v_cache) = _case(
        dtype, head_dim, hq, hk, tokens, layout
    )
    assert fused_kernel.geometry(head_dim, dtype) in fused_kernel.GEOMETRIES
    want_k, want_v = k_cache.clone(), v_cache.clone()
    with torch.no_grad():
        want_q = _unfused(q, k, v, q_weight, k_weight, positions, rows, want_k, want_v)
        got_q = fused_kernel.qk_norm_rope_append(
            q, k, v, q_weight, k_weight, EPS, positions, THETA, MAX_POSITION, k_cache, v_cache,
            rows,
        )  # fmt: skip
    assert_bitwise_equal(got_q, want_q, name="q")
    assert_bitwise_equal(k_cache, want_k, name="k_cache")
    assert_bitwise_equal(v_cache, want_v, name="v_cache")


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_kernel_takes_int32_positions_and_marks_bad_ones_as_rope_does(index_dtype):
    bad = ((2, -1), (5, MAX_POSITION), (9, MAX_POSITION + 7))
    q, k, v, q_weight, k_weight, positions, rows, (k_cache, v_cache) = _case(
        torch.bfloat16, 128, 8, 2, 17, "packed", index_dtype, bad
    )
    want_k, want_v = k_cache.clone(), v_cache.clone()
    first_bad = torch.full((1,), -1, dtype=torch.int64, device=DEVICE)
    with torch.no_grad():
        want_q = _unfused(q, k, v, q_weight, k_weight, positions, rows, want_k, want_v)
        got_q = fused_kernel.qk_norm_rope_append(
            q, k, v, q_weight, k_weight, EPS, positions, THETA, MAX_POSITION, k_cache, v_cache,
            rows, first_bad,
        )  # fmt: skip
    assert int(first_bad.item()) == 2
    assert torch.isnan(got_q[2].float()).all() and torch.isnan(got_q[5].float()).all()
    assert_bitwise_equal(got_q, want_q, name="q")
    assert_bitwise_equal(k_cache, want_k, name="k_cache")
    assert_bitwise_equal(v_cache, want_v, name="v_cache")


# ----- the sampler -----------------------------------------------------------------------------

WITHOUT = {
    "add_rms_norm": {"add_rms_norm": None},
    "qk_norm_rope": {"qk_norm_rope_attention_with_kv_cache": None},
    "both": {"add_rms_norm": None, "qk_norm_rope_attention_with_kv_cache": None},
}


def _sample(model, *, cuda_graph, temperature, without=None):
    runner = Qwen3DecodeRunner(
        model, max_batch=8, capacity=64, cuda_graph=cuda_graph, temperature=temperature
    )
    if without is not None:
        runner._ops = dataclasses.replace(runner._ops, **WITHOUT[without])
    slots = runner.add(PROMPTS, seeds=list(range(len(PROMPTS))))
    for step in range(9):
        # buckets 8, 1, 4, 2 (default buckets of max_batch 8), padded with inert rows
        runner.step([slots, slots[:1], slots[1:4], slots[3:5]][step % 4])
    runner.sync()
    return runner, slots


def _assert_same_samples(a, a_slots, b, b_slots):
    for x, y in zip(a_slots, b_slots, strict=True):
        assert a.tokens(x) == b.tokens(y)
        assert_bitwise_equal(a.logprobs(x), b.logprobs(y))
    # Every slot's storage (the scratch row, written by padding and failed steps, aside).
    assert_bitwise_equal(a.cache.k[:, :-1], b.cache.k[:, :-1], name="k")
    assert_bitwise_equal(a.cache.v[:, :-1], b.cache.v[:, :-1], name="v")
    assert_bitwise_equal(a.cache.lengths, b.cache.lengths, name="lengths")


@pytest.mark.parametrize("without", list(WITHOUT))
@pytest.mark.parametrize("temperature", [None, 0.8])
@pytest.mark.parametrize("cuda_graph", [False, True], ids=["eager", "graph"])
def test_sampler_fused_and_unfused_agree(model, cuda_graph, temperature, without):
    fused, slots = _sample(model, cuda_graph=cuda_graph, temperature=temperature)
    plain, plain_slots = _sample(
        model, cuda_graph=cuda_graph, temperature=temperature, without=without
    )
    if cuda_graph:
        assert set(fused._graphs) == {1, 2, 4, 8}
    _assert_same_samples(fused, slots, plain, plain_slots)


def test_sampler_graph_replays_have_the_eager_bits(model):
    graphed, slots = _sample(model, cuda_graph=True, temperature=0.8)
    eager, eager_slots = _sample(model, cuda_graph=False, temperature=0.8, without="both")
    _assert_same_samples(graphed, slots, eager, eager_slots)


def test_sampler_runs_the_fused_kernel_in_every_layer(model, monkeypatch):
    calls = []
    launch = fused_kernel.qk_norm_rope_append

    def counting(*args, **kwargs):
        calls.append(1)
        return launch(*args, **kwargs)

    monkeypatch.setattr(fused_kernel, "qk_norm_rope_append", counting)
    runner = Qwen3DecodeRunner(model, max_batch=4, capacity=64, cuda_graph=False)
    runner.add(PROMPTS[:3])
    for _ in range(3):
        runner.step()
    # the prefill and three steps, every layer
    assert len(calls) == 4 * model.config.num_hidden_layers


@pytest.mark.parametrize("cuda_graph", [False, True], ids=["eager", "graph"])
def test_a_failed_fused_step_writes_nothing(model, cuda_graph):
    runner, slots = _sample(model, cuda_graph=cuda_graph, temperature=None)
    k, v, lengths = runner.cache.k.clone(), runner.cache.v.clone(), runner.cache.lengths.clone()
    good = runner._next_token[slots[0]].clone()
    runner._next_token[slots[0]] = model.config.vocab_size + 5  # a corrupted device buffer
    runner.step(slots[:3])  # bucket 4
    with pytest.raises(IndexError, match="embedding"):
        runner.sync()
    assert_bitwise_equal(runner.cache.k[:, :-1], k[:, :-1], name="k")
    assert_bitwise_equal(runner.cache.v[:, :-1], v[:, :-1], name="v")
    assert_bitwise_equal(runner.cache.lengths, lengths, name="lengths")
    runner._next_token[slots[0]] = good  # fixed: the next step runs as if nothing had happened
    runner.step(slots[:3])
    runner.sync()
    assert_bitwise_equal(runner.cache.lengths[slots[0]], lengths[slots[0]] + 1)

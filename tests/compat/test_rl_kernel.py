"""batchinv.compat.rl_kernel on the CPU: RL-Kernel's op contract (forward / forward_fp32,
its argument names and layouts), both backends, the registry dispatch, get_op and its errors.

Each op is checked against an independent computation written here: the gather, a naive
K-ordered fp32 matmul, and a float64 softmax attention in head-major layout."""

from __future__ import annotations

import math

import pytest
import torch

import batchinv
from batchinv import registry
from batchinv.compat.rl_kernel import (
    DEFAULT_PRIORITY_MAPS,
    KernelRegistry,
    NativeAttentionOp,
    NativeEmbeddingOp,
    NativeLMHeadOp,
    OpBackend,
    get_op,
    kernel_registry,
)
from batchinv.contract import assert_bitwise_equal, assert_within_tolerance
from batchinv.registry import BackendNotImplementedError, UnknownOpError

BACKENDS = (OpBackend.BATCHINV, OpBackend.REFERENCE)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LOW_DTYPES = (torch.bfloat16, torch.float16)


def _randn(*shape, seed, dtype=torch.float32, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


# ----------------------------------------------------------------------------- embedding

VOCAB, HIDDEN = 37, 24


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("id_dtype", (torch.int32, torch.int64), ids=str)
def test_embedding_is_the_gather_bitwise_with_boundary_ids(backend, dtype, id_dtype):
    weight = _randn(VOCAB, HIDDEN, seed=0, dtype=dtype)
    ids = torch.tensor([[0, VOCAB - 1, 5], [VOCAB - 1, 0, 0]], dtype=id_dtype)
    op = NativeEmbeddingOp(backend)
    out = op(ids, weight)
    assert out.dtype == dtype and out.shape == (2, 3, HIDDEN)
    assert_bitwise_equal(out, weight[ids.long()])
    assert_bitwise_equal(op.forward_fp32(ids, weight), weight.float()[ids.long()])


@pytest.mark.parametrize("backend", BACKENDS)
def test_embedding_row_is_the_same_in_a_slice_and_with_padding(backend):
    weight = _randn(VOCAB, HIDDEN, seed=1, dtype=torch.bfloat16)
    ids = torch.randint(0, VOCAB, (5, 9), generator=torch.Generator().manual_seed(2))
    op = NativeEmbeddingOp(backend)
    full = op(ids, weight)
    padded = op(torch.cat([ids, torch.zeros(5, 4, dtype=ids.dtype)], dim=1), weight)
    for b in range(ids.shape[0]):
        assert_bitwise_equal(op(ids[b : b + 1], weight), full[b : b + 1], name=f"row {b}")
        assert_bitwise_equal(padded[b : b + 1, :9], full[b : b + 1], name=f"padded row {b}")
    assert_bitwise_equal(op(ids[1:4], weight), full[1:4], name="slice 1:4")


@pytest.mark.parametrize("backend", BACKENDS)
def test_embedding_is_pure_and_stateless(backend):
    weight = _randn(VOCAB, HIDDEN, seed=3, dtype=torch.float16)
    ids = torch.tensor([3, 0, VOCAB - 1, 3])
    weight_before, ids_before = weight.clone(), ids.clone()
    op = NativeEmbeddingOp(backend)
    first, second = op(ids, weight), op(ids, weight)
    assert_bitwise_equal(second, first)
    assert_bitwise_equal(weight, weight_before)
    assert_bitwise_equal(ids, ids_before)
    assert not list(op.parameters()) and not list(op.buffers()) and not op.state_dict()


@pytest.mark.parametrize("backend", BACKENDS)
def test_embedding_weight_gradient_repeats_bitwise(backend):
    ids = torch.tensor([4, 1, 4, 4, 0])
    grad = _randn(5, HIDDEN, seed=5, dtype=torch.bfloat16)
    grads = []
    for _ in range(2):
        weight = _randn(VOCAB, HIDDEN, seed=4, dtype=torch.bfloat16).requires_grad_()
        NativeEmbeddingOp(backend)(ids, weight).backward(grad)
        grads.append(weight.grad)
    assert_bitwise_equal(grads[1], grads[0])
    expected = torch.zeros(VOCAB, HIDDEN)
    for position, token in enumerate(ids.tolist()):  # fp32, increasing position
        expected[token] = expected[token] + grad[position].float()
    assert_bitwise_equal(grads[0], expected.bfloat16())


# ----------------------------------------------------------------------------- lm_head

TOKENS, K, V = 7, 48, 29


def _naive_logits_fp32(hidden, weight, bias=None):
    """``hidden @ weight.T (+ bias)`` in fp32, K reduced one element at a time in order."""
    h, w = hidden.float().reshape(-1, hidden.shape[-1]), weight.float()
    acc = torch.zeros(h.shape[0], w.shape[0])
    for k in range(h.shape[1]):
        acc = acc + h[:, k : k + 1] * w[:, k]
    if bias is not None:
        acc = acc + bias.float()
    return acc.reshape(*hidden.shape[:-1], w.shape[0])


def _lm_head_inputs(dtype, with_bias, seed=10):
    hidden = _randn(TOKENS, K, seed=seed, dtype=dtype)
    weight = _randn(V, K, seed=seed + 1, dtype=dtype, scale=K**-0.5)
    bias = _randn(V, seed=seed + 2, dtype=dtype) if with_bias else None
    return hidden, weight, bias


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_bias", (False, True), ids=("no_bias", "bias"))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_lm_head_is_bitwise_the_naive_fp32_matmul(backend, with_bias, dtype):
    hidden, weight, bias = _lm_head_inputs(dtype, with_bias)
    op = NativeLMHeadOp(backend)
    naive = _naive_logits_fp32(hidden, weight, bias)
    strict = op.forward_fp32(hidden, weight, bias=bias)
    assert strict.dtype == torch.float32
    assert_bitwise_equal(strict, naive, name="forward_fp32")
    out = op(hidden, weight, bias=bias)
    assert out.dtype == dtype and out.shape == (TOKENS, V)
    assert_bitwise_equal(out, naive.to(dtype), name="forward (one rounding of the fp32 sum)")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_bias", (False, True), ids=("no_bias", "bias"))
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
def test_lm_head_low_precision_is_within_the_reduction_tolerance(backend, with_bias, dtype):
    hidden, weight, bias = _lm_head_inputs(dtype, with_bias, seed=20)
    op = NativeLMHeadOp(backend)
    reference = op.forward_fp32(hidden, weight, bias=bias)
    assert_within_tolerance(op(hidden, weight, bias=bias), reference, op_class="reduction")


@pytest.mark.parametrize("backend", BACKENDS)
def test_lm_head_row_is_the_same_alone_in_a_slice_and_with_padding(backend):
    hidden, weight, _ = _lm_head_inputs(torch.bfloat16, False, seed=30)
    op = NativeLMHeadOp(backend)
    full = op(hidden, weight)
    padded = op(torch.cat([hidden, torch.zeros(3, K, dtype=hidden.dtype)]), weight)
    assert_bitwise_equal(padded[:TOKENS], full, name="with padding rows")
    assert_bitwise_equal(op(hidden[2:5], weight), full[2:5], name="slice 2:5")
    for i in (0, TOKENS - 1):
        assert_bitwise_equal(op(hidden[i : i + 1], weight), full[i : i + 1], name=f"row {i}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_lm_head_is_pure_and_stateless(backend):
    hidden, weight, bias = _lm_head_inputs(torch.float32, True, seed=40)
    before = [t.clone() for t in (hidden, weight, bias)]
    op = NativeLMHeadOp(backend)
    assert_bitwise_equal(op(hidden, weight, bias=bias), op(hidden, weight, bias=bias))
    for t, b in zip((hidden, weight, bias), before, strict=True):
        assert_bitwise_equal(t, b)
    assert not op.state_dict()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_bias", (False, True), ids=("no_bias", "bias"))
def test_lm_head_fp32_gradients_are_the_naive_fixed_order_sums(backend, with_bias):
    hidden, weight, bias = _lm_head_inputs(torch.float32, with_bias, seed=50)
    grad = _randn(TOKENS, V, seed=53)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias) if t is not None]
    op = NativeLMHeadOp(backend)
    op.forward_fp32(leaves[0], leaves[1], bias=leaves[2] if with_bias else None).backward(grad)
    # grad_x reduces over the vocabulary in order; grad_w and grad_b over tokens in order.
    grad_x = torch.zeros(TOKENS, K)
    for n in range(V):
        grad_x = grad_x + grad[:, n : n + 1] * weight[n]
    grad_w = torch.zeros(V, K)
    grad_b = torch.zeros(V)
    for t in range(TOKENS):
        grad_w = grad_w + grad[t][:, None] * hidden[t]
        grad_b = grad_b + grad[t]
    assert_bitwise_equal(leaves[0].grad, grad_x, name="grad hidden")
    assert_bitwise_equal(leaves[1].grad, grad_w, name="grad weight")
    if with_bias:
        assert_bitwise_equal(leaves[2].grad, grad_b, name="grad bias")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
def test_lm_head_low_precision_gradients_are_within_tolerance(backend, dtype):
    hidden, weight, bias = _lm_head_inputs(dtype, True, seed=60)
    grad = _randn(TOKENS, V, seed=63, dtype=dtype)
    op = NativeLMHeadOp(backend)
    low = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    op(low[0], low[1], bias=low[2]).backward(grad)
    strict = [t.float().requires_grad_() for t in (hidden, weight, bias)]
    op.forward_fp32(strict[0], strict[1], bias=strict[2]).backward(grad.float())
    for got, want, name in zip(low, strict, ("hidden", "weight", "bias"), strict=True):
        assert got.grad.dtype == dtype
        assert_within_tolerance(got.grad, want.grad, op_class="reduction", kind="grad", name=name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lm_head_token_logprobs_is_the_log_softmax_of_the_logits(backend):
    hidden, weight, _ = _lm_head_inputs(torch.float32, False, seed=70)
    targets = torch.tensor([0, V - 1, 3, -100, 5, 5, 1])
    op = NativeLMHeadOp(backend)
    logprobs = op.token_logprobs(hidden, weight, targets)
    logits64 = hidden.double() @ weight.double().t()
    expected = torch.log_softmax(logits64, dim=-1).gather(1, targets.clamp_min(0)[:, None])[:, 0]
    expected = torch.where(targets == -100, 0.0, expected)
    assert logprobs.dtype == torch.float32 and logprobs[3] == 0.0
    assert_within_tolerance(logprobs, expected, op_class="logprob")


# ----------------------------------------------------------------------------- attention


def _naive_attention64(q, k, v, *, causal, scale=None, key_padding_mask=None):
    """Head-major softmax attention in float64: query ``i`` sits at key position
    ``Skv - Sq + i``; masked keys get -inf; a row with no visible key gives 0."""
    q, k, v = q.double(), k.double(), v.double()
    hq, sq, d = q.shape[1:]
    hkv, skv = k.shape[1], k.shape[2]
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    visible = torch.ones(q.shape[0], 1, sq, skv, dtype=torch.bool)
    if causal:
        positions = torch.arange(sq)[:, None] + (skv - sq)
        visible = visible & (torch.arange(skv)[None, :] <= positions)
    if key_padding_mask is not None:
        visible = visible & key_padding_mask[:, None, None, :]
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all -inf rows -> 0
    return probs @ v


def _attention_inputs(dtype, batch=3, hq=4, hkv=2, sq=6, skv=9, d=16, seed=80):
    q = _randn(batch, hq, sq, d, seed=seed, dtype=dtype)
    k = _randn(batch, hkv, skv, d, seed=seed + 1, dtype=dtype)
    v = _randn(batch, hkv, skv, d, seed=seed + 2, dtype=dtype)
    return q, k, v


def _left_padding_mask(batch, skv, pads):
    mask = torch.ones(batch, skv, dtype=torch.bool)
    for b, pad in enumerate(pads):
        mask[b, :pad] = False
    return mask


ATTENTION_CASES = {
    "causal_prefill": dict(causal=True, sq=9),
    "causal_offset": dict(causal=True, sq=4),
    "causal_decode": dict(causal=True, sq=1),
    "non_causal": dict(causal=False, sq=6),
    "left_padding_causal": dict(causal=True, sq=4, pads=(0, 3, 2)),
    "holes_non_causal": dict(causal=False, sq=5, holes=True),
    "scale": dict(causal=True, sq=4, scale=0.3),
    "scale_zero": dict(causal=True, sq=4, scale=0.0),
}


def _case_mask(case, batch, skv):
    if "pads" in case:
        return _left_padding_mask(batch, skv, case["pads"])
    if case.get("holes"):
        mask = torch.ones(batch, skv, dtype=torch.bool)
        mask[0, 2] = mask[1, 5] = mask[1, 7] = False
        return mask
    return None


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(ATTENTION_CASES))
def test_attention_fp32_matches_an_independent_float64_reference(backend, name):
    case = ATTENTION_CASES[name]
    q, k, v = _attention_inputs(torch.float32, sq=case["sq"])
    mask = _case_mask(case, q.shape[0], k.shape[2])
    kwargs = dict(causal=case["causal"], scale=case.get("scale"), key_padding_mask=mask)
    expected = _naive_attention64(q, k, v, **kwargs)
    op = NativeAttentionOp(backend)
    strict = op.forward_fp32(q, k, v, **kwargs)
    assert strict.dtype == torch.float32 and strict.shape == q.shape
    assert_within_tolerance(strict, expected, op_class="attention", name=f"{name} fp32")
    for dtype in LOW_DTYPES:
        low = [t.to(dtype) for t in (q, k, v)]
        out = op(*low, **kwargs)
        assert out.dtype == dtype and out.shape == q.shape
        reference = _naive_attention64(*low, **kwargs)
        assert_within_tolerance(out, reference, op_class="attention", name=f"{name} {dtype}")


def test_attention_scale_zero_is_kept_not_replaced_by_the_default():
    q, k, v = _attention_inputs(torch.float32, sq=1)
    op = NativeAttentionOp(OpBackend.REFERENCE)
    zero = op.forward_fp32(q, k, v, scale=0.0)
    # scale 0: every visible key has the same weight, so the output is the mean of v.
    mean = v.double().mean(dim=2, keepdim=True).repeat_interleave(2, dim=1)
    assert_within_tolerance(zero, mean, op_class="attention")
    assert not torch.equal(zero, op.forward_fp32(q, k, v))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_attention_fully_masked_rows_give_zero(backend, dtype):
    q, k, v = _attention_inputs(dtype, sq=3)
    mask = torch.ones(3, 9, dtype=torch.bool)
    mask[1] = False  # sequence 1 has no valid key at all
    op = NativeAttentionOp(backend)
    for out in (
        op(q, k, v, key_padding_mask=mask),
        op.forward_fp32(q, k, v, key_padding_mask=mask),
    ):
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        assert not torch.isnan(out).any()
    # More queries than keys, causal: the first Sq - Skv queries see no key.
    q_long = _randn(3, 4, 12, 16, seed=90, dtype=dtype)
    out = op(q_long, k, v, causal=True)
    assert torch.equal(out[:, :, :3], torch.zeros_like(out[:, :, :3]))
    assert (out[:, :, 3:] != 0).any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_gqa_guard(backend):
    q = torch.randn(1, 6, 2, 16)
    k = v = torch.randn(1, 4, 2, 16)  # 6 query heads over 4 kv heads: no integer group
    op = NativeAttentionOp(backend)
    for fn in (op.forward, op.forward_fp32):
        with pytest.raises(ValueError, match="multiple of the number of kv heads"):
            fn(q, k, v)
    with pytest.raises(ValueError, match="head-major"):
        op(torch.randn(2, 16), k, v)


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_causal_offset_decode_rows_equal_prefill_rows_bitwise(backend):
    q, k, v = _attention_inputs(torch.bfloat16, sq=9, skv=9)
    op = NativeAttentionOp(backend)
    prefill = op(q, k, v, causal=True)
    for step in (1, 5, 9):  # query at position step-1 against its first `step` keys
        decode = op(q[:, :, step - 1 : step], k[:, :, :step], v[:, :, :step], causal=True)
        assert_bitwise_equal(decode, prefill[:, :, step - 1 : step], name=f"decode at {step}")
    chunk = op(q[:, :, 5:], k, v, causal=True)  # the last 4 queries against all keys
    assert_bitwise_equal(chunk, prefill[:, :, 5:], name="last chunk")


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_left_padding_is_bitwise_the_unpadded_sequence(backend):
    q, k, v = _attention_inputs(torch.bfloat16, batch=1, sq=4, skv=6)
    pad = 3
    k_padded = torch.cat([torch.full((1, 2, pad, 16), float("nan")).bfloat16(), k], dim=2)
    v_padded = torch.cat([torch.zeros(1, 2, pad, 16).bfloat16(), v], dim=2)
    mask = _left_padding_mask(1, 6 + pad, (pad,))
    op = NativeAttentionOp(backend)
    padded = op(q, k_padded, v_padded, causal=True, key_padding_mask=mask)
    assert_bitwise_equal(padded, op(q, k, v, causal=True))


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_right_padding_renumbers_kept_keys(backend):
    """batchinv's documented rule (it differs from RL-Kernel's storage positions): the
    queries are the last Sq positions of the kept keys."""
    q, k, v = _attention_inputs(torch.float32, batch=1, sq=5, skv=5)
    mask = torch.tensor([[True, True, True, False, False]])
    op = NativeAttentionOp(backend)
    out = op.forward_fp32(q, k, v, causal=True, key_padding_mask=mask)
    kept = _naive_attention64(q, k[:, :, :3], v[:, :, :3], causal=True)
    assert_within_tolerance(out, kept, op_class="attention")


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_is_pure_and_rows_are_batch_invariant(backend):
    q, k, v = _attention_inputs(torch.bfloat16, sq=4)
    before = [t.clone() for t in (q, k, v)]
    op = NativeAttentionOp(backend)
    full = op(q, k, v, causal=True)
    assert_bitwise_equal(op(q, k, v, causal=True), full)
    for t, b in zip((q, k, v), before, strict=True):
        assert_bitwise_equal(t, b)
    for b in range(q.shape[0]):
        alone = op(q[b : b + 1], k[b : b + 1], v[b : b + 1], causal=True)
        assert_bitwise_equal(alone, full[b : b + 1], name=f"sequence {b} alone")
    assert not op.state_dict()


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_gradients_are_within_tolerance_of_float64(backend):
    q, k, v = _attention_inputs(torch.float32, batch=2, sq=5, skv=7, d=8, seed=95)
    grad = _randn(*q.shape, seed=99)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    NativeAttentionOp(backend).forward_fp32(*leaves, causal=True).backward(grad)
    leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
    _naive_attention64(*leaves64, causal=True).backward(grad.double())
    for got, want, name in zip(leaves, leaves64, "qkv", strict=True):
        assert_within_tolerance(got.grad, want.grad, op_class="attention", kind="grad", name=name)


# ----------------------------------------------------------------------------- registry


def _recording_lookup(monkeypatch):
    seen = []
    real = registry.lookup

    def lookup(op, device):
        seen.append(op)
        return real(op, device)

    monkeypatch.setattr(registry, "lookup", lookup)
    return seen


def test_batchinv_backend_dispatches_each_op_through_batchinvs_registry(monkeypatch):
    seen = _recording_lookup(monkeypatch)
    NativeEmbeddingOp(OpBackend.BATCHINV)(torch.tensor([1]), torch.randn(3, 4))
    assert seen == ["embedding.forward"]
    seen.clear()
    op = NativeLMHeadOp(OpBackend.BATCHINV)
    op(torch.randn(2, 8), torch.randn(5, 8))
    assert "lm_head" in seen and "linear.forward" in seen
    seen.clear()
    op.forward_fp32(torch.randn(2, 8), torch.randn(5, 8))
    assert seen == ["lm_head.fp32"]
    seen.clear()
    NativeAttentionOp(OpBackend.BATCHINV)(*_attention_inputs(torch.float32, sq=2))
    assert seen == ["attention"]


def test_reference_backend_does_not_touch_the_registry(monkeypatch):
    seen = _recording_lookup(monkeypatch)
    NativeEmbeddingOp(OpBackend.REFERENCE)(torch.tensor([1]), torch.randn(3, 4))
    NativeLMHeadOp(OpBackend.REFERENCE)(torch.randn(2, 8), torch.randn(5, 8))
    NativeAttentionOp(OpBackend.REFERENCE)(*_attention_inputs(torch.float32, sq=2))
    assert seen == []


def test_lm_head_has_its_own_registry_entry():
    ops = registry.registered_ops()
    assert ops["lm_head"] == ("cpu", "cuda", "hip")
    assert ops["lm_head.fp32"] == ("cpu", "cuda", "hip")


def _without_hip_entry(monkeypatch, op: str) -> None:
    """An op without a hip implementation (every compat op has one now)."""
    monkeypatch.delitem(registry._IMPLEMENTATIONS[op], "hip")


def test_batchinv_backend_raises_on_hip_for_ops_without_hip_kernels(monkeypatch):
    monkeypatch.setattr(registry, "backend_of", lambda device: "hip")
    _without_hip_entry(monkeypatch, "attention")
    q, k, v = _attention_inputs(torch.float32, sq=2)
    attention = NativeAttentionOp(OpBackend.BATCHINV)
    calls = (
        lambda: attention(q, k, v),
        lambda: attention.forward_fp32(q, k, v),
    )
    for call in calls:
        with pytest.raises(BackendNotImplementedError, match="does not fall back"):
            call()
    # The reference runs wherever it is asked for explicitly.
    NativeAttentionOp(OpBackend.REFERENCE).forward_fp32(q, k, v)


@pytest.mark.parametrize(
    "platform, name, backend",
    [
        ("cpu", "embedding", OpBackend.REFERENCE),
        ("cpu", "lm_head", OpBackend.REFERENCE),
        ("cpu", "attention", OpBackend.REFERENCE),
        ("cuda", "embedding", OpBackend.BATCHINV),
        ("cuda", "lm_head", OpBackend.BATCHINV),
        ("cuda", "attn", OpBackend.BATCHINV),
        ("rocm", "embedding", OpBackend.BATCHINV),
        ("rocm", "lm_head", OpBackend.BATCHINV),
        ("rocm", "attention", OpBackend.BATCHINV),
    ],
)
def test_get_op_takes_the_first_available_backend_of_the_platform_map(platform, name, backend):
    op = get_op(name, platform=platform)
    assert op.backend is backend
    expected_class = {"embedding": NativeEmbeddingOp, "lm_head": NativeLMHeadOp}
    assert isinstance(op, expected_class.get(name, NativeAttentionOp))


@pytest.mark.parametrize("name", ("lm_head", "attention"))
def test_get_op_on_rocm_raises_for_ops_without_hip_kernels(monkeypatch, name):
    _without_hip_entry(monkeypatch, name)
    with pytest.raises(BackendNotImplementedError, match="backend=OpBackend.REFERENCE"):
        get_op(name, platform="rocm")
    assert get_op(name, backend=OpBackend.REFERENCE, platform="rocm").backend is OpBackend.REFERENCE


def test_get_op_explicit_backend_and_default_platform():
    assert get_op("lm_head", backend="reference", platform="cuda").backend is OpBackend.REFERENCE
    assert (
        get_op("lm_head", backend=OpBackend.BATCHINV, platform="cpu").backend is OpBackend.BATCHINV
    )
    assert get_op("embedding") is not get_op("embedding")  # stateless: a fresh module each time


def test_get_op_errors():
    with pytest.raises(UnknownOpError, match="unknown op 'logp'"):
        get_op("logp")
    with pytest.raises(ValueError, match="unknown backend 'flash_attn'"):
        get_op("attention", backend="flash_attn")
    with pytest.raises(ValueError, match="unknown platform 'tpu'"):
        get_op("attention", platform="tpu")


def test_priority_maps_are_inspectable_read_only_data():
    maps = kernel_registry.priority_maps
    assert maps["cuda"]["attention"] == (OpBackend.BATCHINV,)
    assert maps["cpu"]["lm_head"] == (OpBackend.REFERENCE,)
    assert OpBackend.REFERENCE not in maps["cuda"]["attention"]  # no silent fallback on GPUs
    assert OpBackend.REFERENCE not in maps["rocm"]["attention"]
    with pytest.raises(TypeError):
        maps["cuda"]["attention"] = (OpBackend.REFERENCE,)  # type: ignore[index]
    with pytest.raises(TypeError):
        DEFAULT_PRIORITY_MAPS["cpu"] = {}  # type: ignore[index]


def test_a_registry_built_with_other_maps_uses_them(monkeypatch):
    custom = KernelRegistry({"rocm": {"attn": ("batchinv", "reference")}, "cuda": {}})
    assert custom.priority_maps["rocm"]["attention"] == (OpBackend.BATCHINV, OpBackend.REFERENCE)
    assert custom.get_op("attention", platform="rocm").backend is OpBackend.BATCHINV
    # Without a HIP attention, the next entry of this map is used: asked for.
    _without_hip_entry(monkeypatch, "attention")
    assert custom.get_op("attention", platform="rocm").backend is OpBackend.REFERENCE
    with pytest.raises(BackendNotImplementedError, match="not in the priority map"):
        custom.get_op("attention", platform="cuda")
    with pytest.raises(ValueError, match="unknown platform"):
        KernelRegistry({"metal": {}})
    with pytest.raises(UnknownOpError):
        KernelRegistry({"cpu": {"matmul": ("reference",)}})


def test_public_lm_head_is_linear_bitwise():
    hidden, weight, bias = _lm_head_inputs(torch.bfloat16, True, seed=100)
    assert_bitwise_equal(
        batchinv.lm_head(hidden, weight, bias), batchinv.linear(hidden, weight, bias)
    )

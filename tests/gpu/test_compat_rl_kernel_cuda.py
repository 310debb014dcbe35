"""batchinv.compat.rl_kernel on CUDA, and the lm_head and attention kernels against float64
ground truth at the full production shapes (lm_head 151936 x 4096; attention B=8, Skv=4096,
32/8 heads, d=128), where the strict references' loops would be too slow.

The float64 references are computed in chunks (vocabulary slices, one kv-head group of one
sequence at a time) so the file stays well under 40 GB of GPU memory."""

from __future__ import annotations

import math

import pytest
import torch

import batchinv
from batchinv.compat.rl_kernel import (
    NativeAttentionOp,
    NativeLMHeadOp,
    OpBackend,
    get_op,
)
from batchinv.contract import assert_bitwise_equal, assert_within_tolerance
from batchinv.shapes import QWEN3_8B_LINEAR

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
LOW_DTYPES = (torch.bfloat16, torch.float16)
_, HIDDEN, VOCAB = next(s for s in QWEN3_8B_LINEAR if s[0] == "lm_head")
# Qwen3-8B attention at the seeds' production shape.
BATCH, SEQ, HEADS_Q, HEADS_KV, HEAD_DIM = 8, 4096, 32, 8, 128
VOCAB_CHUNK = 16384  # rows of the lm_head weight per float64 slice (512 MiB)


def _randn(*shape, seed, dtype=torch.float32, scale=1.0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return (torch.randn(*shape, generator=gen, device=DEVICE) * scale).to(dtype)


# ----------------------------------------------------------------------------- embedding


@pytest.mark.parametrize("dtype", (torch.float32, *LOW_DTYPES), ids=str)
@pytest.mark.parametrize("id_dtype", (torch.int32, torch.int64), ids=str)
def test_embedding_gather_is_bitwise_at_the_vocabulary_boundaries(dtype, id_dtype):
    weight = _randn(VOCAB, 64, seed=0, dtype=dtype)
    ids = torch.tensor([[0, VOCAB - 1, 7], [VOCAB - 1, 0, 0]], device=DEVICE, dtype=id_dtype)
    op = get_op("embedding")
    assert op.backend is OpBackend.BATCHINV
    assert_bitwise_equal(op(ids, weight), weight[ids.long()])
    assert_bitwise_equal(op.forward_fp32(ids, weight), weight[ids.long()].float())
    assert_bitwise_equal(op(ids[1:], weight), op(ids, weight)[1:], name="slice")


# ----------------------------------------------------------------------------- lm_head


def _lm_head_inputs(tokens, dtype, seed, vocab=VOCAB, hidden=HIDDEN):
    x = _randn(tokens, hidden, seed=seed, dtype=dtype)
    w = _randn(vocab, hidden, seed=seed + 1, dtype=dtype, scale=hidden**-0.5)
    return x, w


def _logits64(x, w, bias=None):
    """``x @ w.T (+ bias)`` in float64, one vocabulary slice at a time."""
    x64 = x.double()
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float64, device=x.device)
    for start in range(0, w.shape[0], VOCAB_CHUNK):
        out[:, start : start + VOCAB_CHUNK] = x64 @ w[start : start + VOCAB_CHUNK].double().t()
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
def test_lm_head_at_the_qwen3_shape_is_within_tolerance_of_float64(dtype):
    x, w = _lm_head_inputs(17, dtype, seed=10)
    op = get_op("lm_head")
    assert op.backend is OpBackend.BATCHINV
    logits = op(x, w)
    assert logits.dtype == dtype and logits.shape == (17, VOCAB)
    expected = _logits64(x, w)
    assert_within_tolerance(logits, expected, op_class="reduction", name=f"lm_head {dtype}")
    strict = op.forward_fp32(x[:5], w)  # the strict reference's K loop on the GPU
    assert strict.dtype == torch.float32
    assert_within_tolerance(strict, expected[:5], op_class="reduction", name="lm_head fp32")


def test_lm_head_token_logprobs_at_the_qwen3_shape_is_within_tolerance_of_float64():
    x, w = _lm_head_inputs(17, torch.bfloat16, seed=20)
    targets = torch.arange(17, device=DEVICE) * 8933 % VOCAB
    targets[0], targets[1] = 0, VOCAB - 1
    logprobs = get_op("lm_head").token_logprobs(x, w, targets)
    expected = torch.log_softmax(_logits64(x, w), dim=-1).gather(1, targets[:, None])[:, 0]
    assert_within_tolerance(
        logprobs, expected, op_class="logprob", dtype=torch.bfloat16, name="token logprobs"
    )


def test_lm_head_rows_are_the_same_alone_in_a_slice_and_with_padding():
    x, w = _lm_head_inputs(33, torch.bfloat16, seed=30)
    op = NativeLMHeadOp()
    full = op(x, w)
    padded = op(torch.cat([x, torch.zeros(31, HIDDEN, dtype=x.dtype, device=DEVICE)]), w)
    assert_bitwise_equal(padded[:33], full, name="with 31 padding rows")
    assert_bitwise_equal(op(x[3:20], w), full[3:20], name="slice 3:20")
    for i in (0, 1, 32):
        assert_bitwise_equal(op(x[i : i + 1], w), full[i : i + 1], name=f"row {i} alone")


@pytest.mark.parametrize("with_bias", (False, True), ids=("no_bias", "bias"))
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
def test_lm_head_bias_and_gradients_match_the_strict_reference(with_bias, dtype):
    x, w = _lm_head_inputs(65, dtype, seed=40, vocab=1000, hidden=256)
    bias = _randn(1000, seed=43, dtype=dtype) if with_bias else None
    grad = _randn(65, 1000, seed=44, dtype=dtype)
    op = NativeLMHeadOp(OpBackend.BATCHINV)
    low = [t.clone().requires_grad_() for t in (x, w, bias) if t is not None]
    out = op(low[0], low[1], bias=low[2] if with_bias else None)
    out.backward(grad)
    strict = [t.float().requires_grad_() for t in (x, w, bias) if t is not None]
    reference = op.forward_fp32(strict[0], strict[1], bias=strict[2] if with_bias else None)
    reference.backward(grad.float())
    assert_within_tolerance(out, reference, op_class="reduction", name="logits")
    for got, want, name in zip(low, strict, ("hidden", "weight", "bias"), strict=False):
        assert_within_tolerance(got.grad, want.grad, op_class="reduction", kind="grad", name=name)


def test_lm_head_reference_backend_on_the_gpu_gives_the_cpu_references_bits():
    x, w = _lm_head_inputs(5, torch.bfloat16, seed=50, vocab=300, hidden=128)
    op = get_op("lm_head", backend=OpBackend.REFERENCE)
    assert op.backend is OpBackend.REFERENCE
    on_gpu = op.forward_fp32(x, w)
    assert on_gpu.device.type == "cuda"
    assert_bitwise_equal(on_gpu.cpu(), op.forward_fp32(x.cpu(), w.cpu()))


def test_fp32_inputs_to_the_batchinv_backend_are_a_clear_error():
    x, w = _lm_head_inputs(2, torch.float32, seed=60, vocab=16, hidden=16)
    with pytest.raises(TypeError, match="bf16 or fp16"):
        NativeLMHeadOp(OpBackend.BATCHINV)(x, w)


# ----------------------------------------------------------------------------- attention


def _head_major_qkv(batch, sq, skv, dtype, seed, hq=HEADS_Q, hkv=HEADS_KV, d=HEAD_DIM):
    q = _randn(batch, hq, sq, d, seed=seed, dtype=dtype)
    k = _randn(batch, hkv, skv, d, seed=seed + 1, dtype=dtype)
    v = _randn(batch, hkv, skv, d, seed=seed + 2, dtype=dtype)
    return q, k, v


def _attention64_one(q, k, v, *, causal, valid=None):
    """One sequence, one kv head ``q [G, Sq, D]``, ``k, v [Skv, D]`` in float64; query ``i``
    sits at key position ``Skv - Sq + i``; ``valid [Skv]`` keeps keys (a suffix here)."""
    q64, k64, v64 = q.double(), k.double(), v.double()
    sq, skv = q.shape[1], k.shape[0]
    scores = (q64 @ k64.t()) * (1.0 / math.sqrt(q.shape[-1]))
    visible = torch.ones(sq, skv, dtype=torch.bool, device=q.device)
    if causal:
        positions = torch.arange(sq, device=q.device)[:, None] + (skv - sq)
        visible = torch.arange(skv, device=q.device)[None, :] <= positions
    if valid is not None:
        visible = visible & valid[None, :]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1).nan_to_num(0.0) @ v64


def _assert_attention_matches_float64(out, q, k, v, *, causal, mask=None, label):
    group = q.shape[1] // k.shape[1]
    for b in range(q.shape[0]):
        expected = torch.empty(q.shape[1:], dtype=torch.float64, device=q.device)
        for h in range(k.shape[1]):
            heads = slice(h * group, (h + 1) * group)
            valid = None if mask is None else mask[b]
            expected[heads] = _attention64_one(
                q[b, heads], k[b, h], v[b, h], causal=causal, valid=valid
            )
        assert_within_tolerance(out[b], expected, op_class="attention", name=f"{label} seq {b}")


def test_attention_prefill_at_the_production_shape_is_within_tolerance_of_float64():
    q, k, v = _head_major_qkv(BATCH, SEQ, SEQ, torch.bfloat16, seed=70)
    op = get_op("attention")
    assert op.backend is OpBackend.BATCHINV
    out = op(q, k, v, causal=True)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    _assert_attention_matches_float64(out, q, k, v, causal=True, label="prefill")


def test_attention_decode_with_left_padding_at_the_production_shape():
    q, k, v = _head_major_qkv(BATCH, 1, SEQ, torch.bfloat16, seed=80)
    mask = torch.ones(BATCH, SEQ, dtype=torch.bool, device=DEVICE)
    for b, pad in enumerate((0, 1, 17, 127, 128, 1000, 2049, 4095)):
        mask[b, :pad] = False
    out = get_op("attn")(q, k, v, causal=True, key_padding_mask=mask)
    _assert_attention_matches_float64(out, q, k, v, causal=True, mask=mask, label="decode")


def test_attention_equals_batchinv_attention_in_its_own_layout():
    q, k, v = _head_major_qkv(3, 100, 300, torch.bfloat16, seed=90, hq=8, hkv=2, d=64)
    out = NativeAttentionOp()(q, k, v, causal=True)
    own = batchinv.attention(*(t.transpose(1, 2) for t in (q, k, v)), causal=True)
    assert_bitwise_equal(out, own.transpose(1, 2))


def test_attention_decode_and_chunk_rows_equal_prefill_rows_bitwise():
    q, k, v = _head_major_qkv(2, 300, 300, torch.bfloat16, seed=100, hq=8, hkv=2, d=128)
    op = NativeAttentionOp()
    prefill = op(q, k, v, causal=True)
    for step in (1, 128, 129, 300):
        decode = op(q[:, :, step - 1 : step], k[:, :, :step], v[:, :, :step], causal=True)
        assert_bitwise_equal(decode, prefill[:, :, step - 1 : step], name=f"decode {step}")
    assert_bitwise_equal(op(q[:, :, 200:], k, v, causal=True), prefill[:, :, 200:], name="chunk")


def test_attention_fully_masked_rows_give_zero_and_the_gqa_guard_holds():
    q, k, v = _head_major_qkv(3, 4, 64, torch.bfloat16, seed=110, hq=8, hkv=2, d=64)
    mask = torch.ones(3, 64, dtype=torch.bool, device=DEVICE)
    mask[2] = False
    out = NativeAttentionOp()(q, k, v, key_padding_mask=mask)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    assert not torch.isnan(out).any()
    with pytest.raises(ValueError, match="multiple of the number of kv heads"):
        NativeAttentionOp()(
            q[:, :6], k[:, :1].expand(-1, 4, -1, -1), v[:, :1].expand(-1, 4, -1, -1)
        )


def test_attention_scale_zero_is_refused_by_the_kernels_and_kept_by_the_reference():
    q, k, v = _head_major_qkv(1, 2, 8, torch.bfloat16, seed=120, hq=4, hkv=2, d=64)
    with pytest.raises(ValueError, match="must be positive"):
        NativeAttentionOp(OpBackend.BATCHINV)(q, k, v, scale=0.0)
    out = NativeAttentionOp(OpBackend.REFERENCE).forward_fp32(q, k, v, scale=0.0, causal=False)
    mean = v.double().mean(dim=2, keepdim=True).repeat_interleave(2, dim=1).expand_as(out)
    assert_within_tolerance(out, mean, op_class="attention")


def test_attention_reference_on_request_on_the_gpu():
    q, k, v = _head_major_qkv(2, 9, 40, torch.bfloat16, seed=130, hq=4, hkv=2, d=64)
    reference = get_op("attention", backend="reference")
    assert reference.backend is OpBackend.REFERENCE
    strict = reference.forward_fp32(q, k, v, causal=True)
    assert strict.device.type == "cuda"
    kernels = NativeAttentionOp(OpBackend.BATCHINV)
    assert_within_tolerance(kernels(q, k, v, causal=True), strict, op_class="attention")
    assert_bitwise_equal(kernels.forward_fp32(q, k, v, causal=True), strict)

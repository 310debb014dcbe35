"""HIP's kernels run on an NVIDIA GPU: the portable entries (``linear_simt_*``,
``kernels_cu/token_logprobs_portable.cu``, ``kernels_cu/attention_portable.cu``) are in the CUDA
build too, and so is ``kernels_cu/attention_backward_portable.cu``, so this is the one place
their arithmetic runs (no AMD GPU exists for this project: docs/amd.md).

The ``hip_dispatch`` fixture makes the registry answer "hip" for CUDA tensors, so the public
ops take their HIP entries end to end (validation, autograd, custom op), while the kernels load
from the CUDA image, which holds the same portable sources.  Checked: accuracy against the
strict fp32 references (the contract's table), rows bitwise invariant to the batch, the token
reductions (grad_weight, d_W) and attention's dK/dV bitwise identical run to run, a sequence's
attention gradients bitwise the same alone, packed or padded among others, bad input errors.
These are the portable code's bits under nvcc and libdevice; HIP's come from clang and ROCm's
ocml (expf, logf), so they are checked here for their order, not for HIP's exact values.
"""

from __future__ import annotations

import pytest
import torch

import batchinv
from batchinv import registry
from batchinv.contract import (
    assert_bitwise_equal,
    assert_no_drift,
    assert_within_tolerance,
    deterministic_context,
    row_invariance_sweep,
)
from batchinv.gpu import attention as gpu_attention
from batchinv.gpu import linear as gpu_linear
from batchinv.gpu import token_logprobs_portable as portable
from batchinv.kv_cache import KVCache
from batchinv.reference.attention import attention_fp32, attention_varlen_fp32
from batchinv.reference.linear import linear_backward, linear_fp32
from batchinv.reference.token_logprobs import token_logprobs_fp32

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
DTYPES = (torch.bfloat16, torch.float16)
IGNORE = -100
# (tokens, H, V): a short last 256-column tile, a vocabulary below one tile, and one over a
# forward logits chunk and two backward chunks (both 4096 columns).
PARITY_CASES = [(37, 128, 5000), (5, 64, 200), (70, 256, 9000)]
SWEEP_BATCH_SIZES = (1, 3, 17, 257)
QWEN3_H, QWEN3_V = 4096, 151936
HEAD_DIMS = (64, 128)
HEADS = ((8, 2), (2, 2))  # (Hq, Hkv): GQA 4:1 and MHA
SPLIT = gpu_attention.SPLIT_KEYS
LONG_CONTEXT = 2 * SPLIT + 452  # three splits: the split merges run
CHUNK_SIZES = (1, 7, 64, 100)


@pytest.fixture
def hip_dispatch(monkeypatch):
    """The registry's HIP entries for CUDA tensors; the kernels still come from the CUDA image
    (batchinv.runtime resolves the image by its own backend lookup)."""
    real = registry.backend_of
    monkeypatch.setattr(
        registry, "backend_of", lambda device: "hip" if device.type == "cuda" else real(device)
    )
    assert registry.lookup("token_logprobs", torch.device(DEVICE)) is portable.token_logprobs


def _randn(*shape, dtype, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


# ---- linear and lm_head: the SIMT loop -----------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", (False, True))
@pytest.mark.parametrize("m, k, n", [(1, 64, 33), (70, 256, 300), (257, 1024, 129)])
def test_linear_forward_matches_reference(hip_dispatch, dtype, with_bias, m, k, n):
    x = _randn(m, k, dtype=dtype, seed=1)
    w = _randn(n, k, dtype=dtype, seed=2, scale=k**-0.5)
    bias = _randn(n, dtype=dtype, seed=3) if with_bias else None
    out = batchinv.linear(x, w, bias)
    assert out.dtype == dtype
    assert_bitwise_equal(out, gpu_linear.simt_matmul_nt(x, w, bias), name="op vs loop")
    assert_within_tolerance(out, linear_fp32(x, w, bias), op_class="reduction", name="linear")
    logits = batchinv.lm_head(x, w, bias)
    assert_bitwise_equal(logits, out, name="lm_head is linear")


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_rows_are_batch_invariant(hip_dispatch, dtype):
    k, n = 256, 300
    w = _randn(n, k, dtype=dtype, seed=4, scale=k**-0.5)

    def make(rows, generator):
        return torch.randn(rows, k, generator=generator).to(dtype)

    def op(rows):
        return batchinv.linear(rows.to(DEVICE), w)

    assert_no_drift(row_invariance_sweep(op, make, batch_sizes=SWEEP_BATCH_SIZES))


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_gradients_match_reference_and_repeat_bitwise(hip_dispatch, dtype):
    m, k, n = 70, 128, 96
    x = _randn(m, k, dtype=dtype, seed=5)
    w = _randn(n, k, dtype=dtype, seed=6, scale=k**-0.5)
    bias = _randn(n, dtype=dtype, seed=7)
    grad = _randn(m, n, dtype=dtype, seed=8)

    def grads():
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, w, bias)]
        batchinv.linear(*leaves).backward(grad)
        return [t.grad for t in leaves]

    got = grads()
    expected = linear_backward(grad.float(), x.float(), w.float(), torch.float32)
    for what, g, want in zip(("grad_x", "grad_weight", "grad_bias"), got, expected, strict=True):
        assert g.dtype == dtype
        assert_within_tolerance(g, want, op_class="reduction", kind="grad", name=what)
    assert_bitwise_equal(grads(), got, name="gradients run to run")


# ---- token_logprobs --------------------------------------------------------------------------


def _inputs(tokens, hidden_size, vocab, dtype, seed=0, ignored=()):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, hidden_size, generator=gen).to(dtype)
    weight = (torch.randn(vocab, hidden_size, generator=gen) / hidden_size**0.25).to(dtype)
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    for position in ignored:
        targets[position] = IGNORE
    return hidden.to(DEVICE), weight.to(DEVICE), targets.to(DEVICE)


def _batchinv(hidden, weight, targets, **kwargs):
    return batchinv.token_logprobs(hidden, weight, targets, IGNORE, **kwargs)


def _reference(hidden, weight, targets, **kwargs):
    with deterministic_context():
        return token_logprobs_fp32(hidden, weight, targets, IGNORE, **kwargs)


def _grads(fn, hidden, weight, targets, g, g_ent=None):
    hidden = hidden.detach().clone().requires_grad_(True)
    weight = weight.detach().clone().requires_grad_(True)
    out = fn(hidden, weight, targets, return_entropy=g_ent is not None)
    if g_ent is None:
        out.backward(g)
    else:
        torch.autograd.backward(out, (g, g_ent))
    return out, hidden.grad, weight.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", PARITY_CASES)
def test_token_logprobs_forward_and_entropy_match_reference(hip_dispatch, case, dtype):
    hidden, weight, targets = _inputs(*case, dtype, ignored=(1,))
    logprob, entropy = _batchinv(hidden, weight, targets, return_entropy=True)
    ref_logprob, ref_entropy = _reference(hidden, weight, targets, return_entropy=True)
    assert logprob.dtype == entropy.dtype == torch.float32
    assert_within_tolerance(logprob, ref_logprob, op_class="logprob", dtype=dtype, name="logprob")
    assert_within_tolerance(entropy, ref_entropy, op_class="logprob", dtype=dtype, name="entropy")
    zero = torch.zeros(1, device=DEVICE)
    assert_bitwise_equal(logprob[1:2], zero)
    assert_bitwise_equal(entropy[1:2], zero)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_entropy", (False, True))
@pytest.mark.parametrize("case", PARITY_CASES)
def test_token_logprobs_gradients_match_reference(hip_dispatch, case, with_entropy, dtype):
    hidden, weight, targets = _inputs(*case, dtype, ignored=(2,))
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(case[0], generator=gen).to(DEVICE)
    g_ent = torch.randn(case[0], generator=gen).to(DEVICE) if with_entropy else None
    _, grad_h, grad_w = _grads(_batchinv, hidden, weight, targets, g, g_ent)
    _, ref_h, ref_w = _grads(_reference, hidden, weight, targets, g, g_ent)
    assert grad_h.dtype == hidden.dtype and grad_w.dtype == weight.dtype
    opts = {"op_class": "logprob", "kind": "grad", "dtype": dtype}
    assert_within_tolerance(grad_h.float(), ref_h.float(), name="d_hidden", **opts)
    assert_within_tolerance(grad_w.float(), ref_w.float(), name="d_weight", **opts)
    assert_bitwise_equal(grad_h[2:3], torch.zeros_like(grad_h[2:3]))
    _, _, again = _grads(_batchinv, hidden, weight, targets, g, g_ent)
    assert_bitwise_equal(again, grad_w, name="d_weight run to run")


@pytest.mark.parametrize("dtype", DTYPES)
def test_token_logprobs_rows_are_batch_invariant(hip_dispatch, dtype):
    hidden_size, vocab = 128, 5000
    gen = torch.Generator().manual_seed(3)
    weight = (torch.randn(vocab, hidden_size, generator=gen) / 4).to(dtype).to(DEVICE)

    def make(n, generator):
        return (
            torch.randn(n, hidden_size, generator=generator).to(dtype),
            torch.randint(0, vocab, (n,), generator=generator),
        )

    def op(rows):
        hidden, targets = rows
        return _batchinv(hidden.to(DEVICE), weight, targets.to(DEVICE), return_entropy=True)

    reports = row_invariance_sweep(op, make, batch_sizes=SWEEP_BATCH_SIZES, int_high=vocab)
    assert_no_drift(reports)


def _row_grad(hidden, weight, targets, g, g_ent):
    hidden = hidden.detach().clone().requires_grad_(True)
    outputs = _batchinv(hidden, weight, targets, return_entropy=True)
    torch.autograd.backward(outputs, (g, g_ent))
    return hidden.grad


@pytest.mark.parametrize("dtype", DTYPES)
def test_token_logprobs_hidden_gradient_rows_are_batch_invariant(hip_dispatch, dtype):
    tokens, hidden_size, vocab = 257, 128, 9000
    hidden, weight, targets = _inputs(tokens, hidden_size, vocab, dtype, seed=4, ignored=(7,))
    gen = torch.Generator().manual_seed(5)
    g, g_ent = torch.randn(2, tokens, generator=gen).to(DEVICE)
    full = _row_grad(hidden, weight, targets, g, g_ent)
    for start, stop in ((0, 1), (100, 101), (256, 257), (3, 20), (90, 257)):
        rows = slice(start, stop)
        part = _row_grad(hidden[rows], weight, targets[rows], g[rows], g_ent[rows])
        assert_bitwise_equal(part, full[start:stop], name=f"d_hidden rows {start}:{stop}")


def test_token_logprobs_forward_chunk_changes_no_bit(hip_dispatch, monkeypatch):
    """The forward's logits chunk bounds memory only: every tile state is the same."""
    hidden, weight, targets = _inputs(37, 128, 9000, torch.bfloat16, seed=9)
    default = _batchinv(hidden, weight, targets, return_entropy=True)
    monkeypatch.setattr(portable, "LOGITS_CHUNK", 256)
    assert_bitwise_equal(_batchinv(hidden, weight, targets, return_entropy=True), default)


def test_token_logprobs_qwen3_rows_match_alone(hip_dispatch):
    """Rows 0, the middle and the last of 17 equal the same rows alone at the Qwen3-8B lm_head
    shape (forward and hidden gradient); a float64 check of four rows."""
    tokens, dtype = 17, torch.bfloat16
    gen = torch.Generator(device=DEVICE).manual_seed(6)
    weight = (torch.randn(QWEN3_V, QWEN3_H, generator=gen, device=DEVICE) / 8).to(dtype)
    hidden = torch.randn(tokens, QWEN3_H, generator=gen, device=DEVICE).to(dtype)
    targets = torch.randint(0, QWEN3_V, (tokens,), generator=gen, device=DEVICE)
    g = torch.randn(tokens, generator=gen, device=DEVICE)
    batch_hidden = hidden.clone().requires_grad_(True)
    logprob = _batchinv(batch_hidden, weight, targets)
    logprob.backward(g)
    for row in (0, tokens // 2, tokens - 1):
        alone = hidden[row : row + 1].clone().requires_grad_(True)
        alone_logprob = _batchinv(alone, weight, targets[row : row + 1])
        alone_logprob.backward(g[row : row + 1])
        assert_bitwise_equal(alone_logprob, logprob[row : row + 1], name=f"logprob row {row}")
        assert_bitwise_equal(alone.grad, batch_hidden.grad[row : row + 1], name=f"d_h row {row}")
    logits = hidden[:4].double() @ weight.double().t()
    ref = torch.log_softmax(logits, -1).gather(-1, targets[:4, None]).squeeze(-1)
    assert_within_tolerance(logprob[:4], ref, op_class="logprob", dtype=dtype)


def test_token_logprobs_custom_op_gives_the_eager_bits(hip_dispatch):
    """The custom op's saving forward and saved backward (the HIP entries) against autograd."""
    hidden, weight, targets = _inputs(37, 128, 5000, torch.bfloat16, seed=10, ignored=(4,))
    gen = torch.Generator().manual_seed(11)
    g, g_ent = torch.randn(2, 37, generator=gen).to(DEVICE)
    eager, eager_h, eager_w = _grads(_batchinv, hidden, weight, targets, g, g_ent)
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    logprob, entropy, _lse = torch.ops.batchinv.token_logprobs(h, w, targets, IGNORE, 4096, True)
    torch.autograd.backward((logprob, entropy), (g, g_ent))
    assert_bitwise_equal((logprob, entropy), eager)
    assert_bitwise_equal((h.grad, w.grad), (eager_h, eager_w))


def test_token_logprobs_bad_input_errors_as_on_cuda(hip_dispatch):
    hidden, weight, targets = _inputs(6, 64, 300, torch.float16)
    targets[4] = 300
    with pytest.raises(IndexError, match="target_ids"):
        _batchinv(hidden, weight, targets)
    with pytest.raises(ValueError, match="multiple of 8"):
        _batchinv(hidden[:, :60], weight[:, :60].contiguous(), targets)
    with pytest.raises(TypeError, match="bf16 or fp16"):
        _batchinv(hidden.float(), weight.float(), targets)


# ---- attention (forward) -----------------------------------------------------------------------


def _qkv(batch, sq, sk, hq, hkv, d, dtype, seed=0):
    q = _randn(batch, sq, hq, d, dtype=dtype, seed=seed, scale=1.5)
    k = _randn(batch, sk, hkv, d, dtype=dtype, seed=seed + 1, scale=1.5)
    v = _randn(batch, sk, hkv, d, dtype=dtype, seed=seed + 2)
    return q, k, v


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("causal", (True, False))
def test_attention_padded_within_tolerance(hip_dispatch, dtype, d, heads, causal):
    hq, hkv = heads
    q, k, v = _qkv(3, 77, 150, hq, hkv, d, dtype, seed=d + hq)
    seqlens_q = torch.tensor([77, 40, 1], device=DEVICE)
    seqlens_k = torch.tensor([150, 91, 64], device=DEVICE)
    kwargs = dict(causal=causal, seqlens_q=seqlens_q, seqlens_k=seqlens_k, return_lse=True)
    out, lse = batchinv.attention(q, k, v, **kwargs)
    ref_out, ref_lse = attention_fp32(q, k, v, **kwargs)
    assert_within_tolerance(out, ref_out, op_class="attention", name="out")
    assert_within_tolerance(lse, ref_lse, op_class="attention", name="lse", dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_attention_long_context_within_tolerance(hip_dispatch, dtype, d):
    q, k, v = _qkv(2, 3, LONG_CONTEXT, 8, 2, d, dtype, seed=11)
    out, lse = batchinv.attention(q, k, v, causal=True, return_lse=True)
    ref_out, ref_lse = attention_fp32(q, k, v, causal=True, return_lse=True)
    assert_within_tolerance(out, ref_out, op_class="attention", name="out")
    assert_within_tolerance(lse, ref_lse, op_class="attention", name="lse", dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_varlen_within_tolerance_and_softmax_scale(hip_dispatch, dtype):
    cu_q = torch.tensor([0, 5, 5, 70], device=DEVICE, dtype=torch.int32)
    cu_k = torch.tensor([0, 130, 131, 200], device=DEVICE, dtype=torch.int32)
    q = _randn(70, 8, 128, dtype=dtype, seed=3)
    k = _randn(200, 2, 128, dtype=dtype, seed=4)
    v = _randn(200, 2, 128, dtype=dtype, seed=5)
    kwargs = dict(causal=True, softmax_scale=0.05, return_lse=True)
    out, lse = batchinv.attention_varlen(q, k, v, cu_q, cu_k, **kwargs)
    ref_out, ref_lse = attention_varlen_fp32(q, k, v, cu_q, cu_k, **kwargs)
    assert_within_tolerance(out, ref_out, op_class="attention", name="out")
    assert_within_tolerance(lse, ref_lse, op_class="attention", name="lse", dtype=dtype)


def _alone(q, k, v, b, lq, lk):
    """Sequence ``b`` alone: its own padded batch of one, trimmed to its lengths."""
    return batchinv.attention(
        q[b : b + 1, :lq].contiguous(),
        k[b : b + 1, :lk].contiguous(),
        v[b : b + 1, :lk].contiguous(),
        causal=True,
        return_lse=True,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
def test_attention_rows_independent_of_batch_position_neighbours_and_padding(
    hip_dispatch, dtype, heads
):
    hq, hkv = heads
    d, sq, sk = 128, 70, 140
    lq, lk = 45, 133  # the sequence under test
    for batch in (1, 3, 8):
        q, k, v = _qkv(batch, sq, sk, hq, hkv, d, dtype, seed=batch)
        b = batch - 1
        q[b, lq:] = float("nan")  # padding is NaN: never read
        k[b, lk:] = float("nan")
        v[b, lk:] = float("nan")
        lens_q = torch.randint(1, sq + 1, (batch,), generator=torch.Generator().manual_seed(batch))
        lens_k = torch.randint(1, sk + 1, (batch,), generator=torch.Generator().manual_seed(7))
        lens_q[b], lens_k[b] = lq, lk
        lengths = {"seqlens_q": lens_q.to(DEVICE), "seqlens_k": lens_k.to(DEVICE)}
        out, lse = batchinv.attention(q, k, v, causal=True, return_lse=True, **lengths)
        alone_out, alone_lse = _alone(q, k, v, b, lq, lk)
        assert_bitwise_equal(out[b : b + 1, :lq], alone_out, name=f"out, batch {batch}")
        assert_bitwise_equal(lse[b : b + 1, :, :lq], alone_lse, name=f"lse, batch {batch}")
        assert bool((out[b, lq:] == 0).all()) and bool((lse[b, :, lq:] == float("-inf")).all())
        if batch > 1:  # other content in the neighbours
            q[0] = _randn(sq, hq, d, dtype=dtype, seed=99)
            k[0] = _randn(sk, hkv, d, dtype=dtype, seed=98)
            out2, lse2 = batchinv.attention(q, k, v, causal=True, return_lse=True, **lengths)
            assert_bitwise_equal(out2[b, :lq], out[b, :lq], name="out, neighbours changed")
            assert_bitwise_equal(lse2[b, :, :lq], lse[b, :, :lq], name="lse, neighbours changed")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_attention_chunked_prefill_and_decode_equal_one_prefill(hip_dispatch, dtype, d):
    total = LONG_CONTEXT
    q, k, v = _qkv(1, total, total, 8, 2, d, dtype, seed=12)
    full_out, full_lse = batchinv.attention(q, k, v, causal=True, return_lse=True)
    for chunk in CHUNK_SIZES:
        # chunk 1 decodes the last 40 tokens one by one, after one big chunk.
        starts = [0, *range(total - 40, total)] if chunk == 1 else list(range(0, total, chunk))
        cache = KVCache(1, total, 2, d, dtype=dtype, device=DEVICE)
        for i, s in enumerate(starts):
            e = starts[i + 1] if i + 1 < len(starts) else total
            out, lse = batchinv.attention_with_kv_cache(
                q[:, s:e], k[:, s:e], v[:, s:e], cache, return_lse=True
            )
            assert_bitwise_equal(out, full_out[:, s:e], name=f"chunk {chunk}, out [{s}, {e})")
            assert_bitwise_equal(lse, full_lse[:, :, s:e], name=f"chunk {chunk}, lse [{s}, {e})")


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_decode_batch_one_equals_batch_eight(hip_dispatch, dtype):
    # Contexts past the first split, ending on it and one key into the second, block edges.
    d, lens = 128, [SPLIT + 52, 5, 1024, 1025, 64, SPLIT, 3, SPLIT - 1]
    ctx = max(lens) + 1
    q, k, v = _qkv(8, ctx, ctx, 8, 2, d, dtype, seed=13)
    big = KVCache(8, ctx, 2, d, dtype=dtype, device=DEVICE)
    for b, n in enumerate(lens):
        big.append(k[b : b + 1, :n], v[b : b + 1, :n], torch.tensor([b], device=DEVICE))
    q_new = torch.stack([q[b, lens[b]] for b in range(8)])[:, None]
    k_new = torch.stack([k[b, lens[b]] for b in range(8)])[:, None]
    v_new = torch.stack([v[b, lens[b]] for b in range(8)])[:, None]
    out8, lse8 = batchinv.attention_with_kv_cache(q_new, k_new, v_new, big, return_lse=True)
    for b in (0, 3, 7):
        one = KVCache(1, ctx, 2, d, dtype=dtype, device=DEVICE)
        one.copy_prefix(b, 0, lens[b], source=big)
        out1, lse1 = batchinv.attention_with_kv_cache(
            q_new[b : b + 1], k_new[b : b + 1], v_new[b : b + 1], one, return_lse=True
        )
        assert_bitwise_equal((out1, lse1), (out8[b : b + 1], lse8[b : b + 1]), name=f"seq {b}")
        n = lens[b] + 1
        full = batchinv.attention(
            q[b : b + 1, :n], k[b : b + 1, :n], v[b : b + 1, :n], causal=True, return_lse=True
        )
        assert_bitwise_equal(out1, full[0][:, -1:], name=f"decode vs prefill {b}")
        assert_bitwise_equal(lse1, full[1][:, :, -1:], name=f"decode lse vs prefill {b}")


def test_attention_masked_keys_and_fully_masked_rows(hip_dispatch):
    q, k, v = _qkv(2, 30, 150, 8, 2, 128, torch.bfloat16, seed=5)
    mask = (torch.rand(2, 150, generator=torch.Generator().manual_seed(1)) > 0.3).to(DEVICE)
    k[~mask] = float("nan")
    v[~mask] = float("nan")
    out = batchinv.attention(q, k, v, causal=True, key_padding_mask=mask)
    ref_out = attention_fp32(q, k, v, causal=True, key_padding_mask=mask)
    assert_within_tolerance(out, ref_out, op_class="attention", name="masked out")
    q, k, v = _qkv(2, 40, 20, 8, 2, 64, torch.bfloat16, seed=8)
    # causal with more queries than keys: the first 20 rows see no key; sequence 1 has none.
    seqlens_k = torch.tensor([20, 0], device=DEVICE)
    out, lse = batchinv.attention(q, k, v, causal=True, seqlens_k=seqlens_k, return_lse=True)
    assert bool((out[0, :20] == 0).all()) and bool((lse[0, :, :20] == float("-inf")).all())
    assert bool((out[1] == 0).all()) and bool((lse[1] == float("-inf")).all())
    assert not bool(torch.signbit(out[0, :20].float()).any())  # +0, not -0
    ref = attention_fp32(q, k, v, causal=True, seqlens_k=seqlens_k)
    assert_within_tolerance(out, ref, op_class="attention", name="out")


def test_attention_bad_input_errors_as_on_cuda(hip_dispatch):
    q, k, v = _qkv(1, 8, 8, 2, 2, 64, torch.bfloat16, seed=14)
    with pytest.raises(ValueError, match="head dim d=48"):
        batchinv.attention(q[..., :48], k[..., :48], v[..., :48])
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        batchinv.attention(q.float(), k.float(), v.float())


# ---- attention (backward) ----------------------------------------------------------------------


def _attention_grads(fn, inputs, grad_out):
    """``(dq, dk, dv)`` of ``fn`` through autograd, from fresh leaves of ``inputs``."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    return torch.autograd.grad(fn(*leaves), leaves, grad_out)


def _reference_grads(fn, inputs, grad_out):
    """The strict fp32 reference's gradients (``batchinv.reference.attention`` by autograd)."""
    return _attention_grads(fn, [t.float() for t in inputs], grad_out.float())


def _assert_grads_within_tolerance(got, expected, dtype):
    for name, g, want in zip(("dq", "dk", "dv"), got, expected, strict=True):
        assert g.dtype == dtype
        assert float(want.abs().max()) > 0, f"reference {name} is zero: the test would be vacuous"
        assert_within_tolerance(g, want, op_class="attention", kind="grad", name=name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("causal", (True, False))
def test_attention_padded_gradients_within_tolerance_and_repeatable(
    hip_dispatch, dtype, d, heads, causal
):
    hq, hkv = heads
    q, k, v = _qkv(3, 77, 150, hq, hkv, d, dtype, seed=2 * d + hq)
    grad_out = _randn(3, 77, hq, d, dtype=dtype, seed=d + 1)
    lengths = {
        "seqlens_q": torch.tensor([77, 40, 1], device=DEVICE),
        "seqlens_k": torch.tensor([150, 91, 64], device=DEVICE),
    }

    def fn(*t):
        return batchinv.attention(*t, causal=causal, **lengths)

    got = _attention_grads(fn, (q, k, v), grad_out)
    expected = _reference_grads(
        lambda *t: attention_fp32(*t, causal=causal, **lengths), (q, k, v), grad_out
    )
    _assert_grads_within_tolerance(got, expected, dtype)
    assert_bitwise_equal(_attention_grads(fn, (q, k, v), grad_out), got, name="run to run")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", (True, False))
def test_attention_varlen_gradients_within_tolerance_and_repeatable(hip_dispatch, dtype, causal):
    # An empty query range, one key, more queries than keys (causal: rows that see nothing)
    # and sequences over two 128-row blocks.
    cu_q = torch.tensor([0, 5, 5, 70, 330, 331], device=DEVICE, dtype=torch.int32)
    cu_k = torch.tensor([0, 130, 131, 171, 471, 472], device=DEVICE, dtype=torch.int32)
    q = _randn(331, 8, 128, dtype=dtype, seed=30, scale=1.5)
    k = _randn(472, 2, 128, dtype=dtype, seed=31, scale=1.5)
    v = _randn(472, 2, 128, dtype=dtype, seed=32)
    grad_out = _randn(331, 8, 128, dtype=dtype, seed=33)
    options = {"causal": causal, "softmax_scale": 0.1}

    def fn(*t):
        return batchinv.attention_varlen(*t, cu_q, cu_k, **options)

    got = _attention_grads(fn, (q, k, v), grad_out)
    expected = _reference_grads(
        lambda *t: attention_varlen_fp32(*t, cu_q, cu_k, **options), (q, k, v), grad_out
    )
    _assert_grads_within_tolerance(got, expected, dtype)
    assert_bitwise_equal(_attention_grads(fn, (q, k, v), grad_out), got, name="run to run")
    if causal:  # rows 5..29 of the third sequence see no key: zero gradient, written or not
        assert bool((got[0][5:30] == 0).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("causal", (True, False))
def test_attention_varlen_sequence_gradients_alone_equal_packed(hip_dispatch, dtype, heads, causal):
    """A sequence's dq, dk, dv are the same bits alone and packed between others, at other row
    offsets, with NaN in every row that belongs to no sequence."""
    hq, hkv = heads
    d, lq, lk = 128, 45, 133
    q1 = _randn(lq, hq, d, dtype=dtype, seed=40, scale=1.5)
    k1 = _randn(lk, hkv, d, dtype=dtype, seed=41, scale=1.5)
    v1 = _randn(lk, hkv, d, dtype=dtype, seed=42)
    g1 = _randn(lq, hq, d, dtype=dtype, seed=43)
    options = {"causal": causal}
    alone_cu_q = torch.tensor([0, lq], device=DEVICE, dtype=torch.int32)
    alone_cu_k = torch.tensor([0, lk], device=DEVICE, dtype=torch.int32)
    alone = _attention_grads(
        lambda *t: batchinv.attention_varlen(*t, alone_cu_q, alone_cu_k, **options),
        (q1, k1, v1),
        g1,
    )
    gap = 3  # the neighbours on both sides hold NaN: their gradients are theirs alone
    for before_q, before_k, after_q, after_k in ((17, 30, 200, 257), (0, 0, 1, 3), (129, 1, 0, 0)):
        q_lengths = torch.tensor([0, before_q, gap, lq, gap, after_q])
        k_lengths = torch.tensor([0, before_k, gap, lk, gap, after_k])
        cu_q = q_lengths.cumsum(0).to(DEVICE, torch.int32)
        cu_k = k_lengths.cumsum(0).to(DEVICE, torch.int32)
        q_at, k_at, tq, tk = before_q + gap, before_k + gap, int(cu_q[-1]), int(cu_k[-1])
        q = _randn(tq, hq, d, dtype=dtype, seed=tq, scale=1.5)
        k = _randn(tk, hkv, d, dtype=dtype, seed=tk, scale=1.5)
        v = _randn(tk, hkv, d, dtype=dtype, seed=tk + 1)
        grad_out = _randn(tq, hq, d, dtype=dtype, seed=tq + 1)
        for t, at, n in ((q, q_at, lq), (k, k_at, lk), (v, k_at, lk), (grad_out, q_at, lq)):
            t[at - gap : at] = float("nan")
            t[at + n : at + n + gap] = float("nan")
        q[q_at : q_at + lq], grad_out[q_at : q_at + lq] = q1, g1
        k[k_at : k_at + lk], v[k_at : k_at + lk] = k1, v1
        packed = _attention_grads(
            lambda *t, cu_q=cu_q, cu_k=cu_k: batchinv.attention_varlen(*t, cu_q, cu_k, **options),
            (q, k, v),
            grad_out,
        )
        where = f"after {before_q} queries and {before_k} keys"
        assert_bitwise_equal(packed[0][q_at : q_at + lq], alone[0], name=f"dq, {where}")
        assert_bitwise_equal(packed[1][k_at : k_at + lk], alone[1], name=f"dk, {where}")
        assert_bitwise_equal(packed[2][k_at : k_at + lk], alone[2], name=f"dv, {where}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
def test_attention_padded_gradient_rows_equal_a_smaller_batch(hip_dispatch, dtype, heads):
    """Sequences 1 and 2 of a padded batch of 5 give the dq, dk, dv bits they give in a batch of
    their own two, and sequence 2 the bits it gives alone at its own lengths (another max_q_len
    and max_k_len); NaN padding is never read."""
    hq, hkv = heads
    d, sq, sk = 64, 70, 140
    q, k, v = _qkv(5, sq, sk, hq, hkv, d, dtype, seed=50)
    grad_out = _randn(5, sq, hq, d, dtype=dtype, seed=54)
    lens_q = torch.tensor([70, 45, 1, 70, 33])
    lens_k = torch.tensor([140, 133, 64, 12, 99])
    for b in range(5):
        q[b, lens_q[b] :] = float("nan")
        k[b, lens_k[b] :] = float("nan")
        v[b, lens_k[b] :] = float("nan")
        grad_out[b, lens_q[b] :] = float("nan")

    def grads(rows, length_rows, width_q=sq, width_k=sk):
        lengths = {
            "seqlens_q": lens_q[length_rows].to(DEVICE),
            "seqlens_k": lens_k[length_rows].to(DEVICE),
        }
        inputs = (q[rows, :width_q], k[rows, :width_k], v[rows, :width_k])
        return _attention_grads(
            lambda *t: batchinv.attention(*t, causal=True, **lengths),
            [t.contiguous() for t in inputs],
            grad_out[rows, :width_q].contiguous(),
        )

    full = grads(slice(0, 5), slice(0, 5))
    small = grads(slice(1, 3), slice(1, 3))
    for b in (1, 2):
        lq, lk = int(lens_q[b]), int(lens_k[b])
        for name, g_full, g_small, n in zip(
            ("dq", "dk", "dv"), full, small, (lq, lk, lk), strict=True
        ):
            assert_bitwise_equal(g_small[b - 1, :n], g_full[b, :n], name=f"{name}, sequence {b}")
            assert bool((g_full[b, n:] == 0).all()), f"{name}: padding rows get zero gradients"
    lq, lk = int(lens_q[2]), int(lens_k[2])
    alone = grads(slice(2, 3), slice(2, 3), width_q=lq, width_k=lk)
    for name, g_full, g_alone in zip(("dq", "dk", "dv"), full, alone, strict=True):
        assert_bitwise_equal(g_alone[0], g_full[2, : g_alone.shape[1]], name=f"{name}, alone")


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_custom_op_gradients_are_the_eager_bits(hip_dispatch, dtype):
    """The custom ops' saved backward (the registry's hip ``<op>.saved_backward``) against the
    eager autograd, padded with a key mask and varlen."""
    q, k, v = _qkv(2, 40, 90, 8, 2, 128, dtype, seed=60)
    grad_out = _randn(2, 40, 8, 128, dtype=dtype, seed=63)
    seqlens_q = torch.tensor([40, 17], device=DEVICE)
    seqlens_k = torch.tensor([90, 51], device=DEVICE)
    mask = (torch.rand(2, 90, generator=torch.Generator().manual_seed(2)) > 0.2).to(DEVICE)
    options = (True, None, seqlens_q, seqlens_k, mask)
    eager = _attention_grads(
        lambda *t: batchinv.attention(
            *t, causal=True, seqlens_q=seqlens_q, seqlens_k=seqlens_k, key_padding_mask=mask
        ),
        (q, k, v),
        grad_out,
    )
    custom = _attention_grads(
        lambda *t: torch.ops.batchinv.attention(*t, *options)[0], (q, k, v), grad_out
    )
    assert_bitwise_equal(custom, eager, name="padded: custom op vs eager")

    cu_q = torch.tensor([0, 7, 40], device=DEVICE, dtype=torch.int32)
    cu_k = torch.tensor([0, 50, 90], device=DEVICE, dtype=torch.int32)
    rows = (q[0], k[0], v[0])
    eager = _attention_grads(
        lambda *t: batchinv.attention_varlen(*t, cu_q, cu_k, causal=False), rows, grad_out[0]
    )
    custom = _attention_grads(
        lambda *t: torch.ops.batchinv.attention_varlen(*t, cu_q, cu_k, False, None)[0],
        rows,
        grad_out[0],
    )
    assert_bitwise_equal(custom, eager, name="varlen: custom op vs eager")

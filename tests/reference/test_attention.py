"""Tests of the attention reference: invariance (Axis-A), accuracy (Axis-B), masks, errors.

Expected values come from independent definitions: torch's SDPA math backend and a
plain float64 attention with materialised scores; invariance compares bit patterns.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from batchinv.contract import (
    SequenceAdapter,
    assert_bitwise_equal,
    assert_no_drift,
    assert_within_tolerance,
    padding_fill,
    sequence_invariance_sweep,
)
from batchinv.kv_cache import KVCache
from batchinv.reference.attention import (
    KV_BLOCK,
    AttentionReference,
    attention,
    attention_fp32,
    attention_varlen,
    attention_with_kv_cache,
)
from batchinv.validation import check_attention_args, check_length_values

# (Hq, Hkv, d): MHA, GQA 2:1 and 3:1, MQA, and the three kernel head dims.
HEAD_CONFIGS = [(4, 2, 64), (4, 4, 128), (6, 2, 32), (3, 1, 256)]
# (Sq, Sk): plain prefill, queries at the end of a longer key sequence (offset), block edges.
SEQ_CONFIGS = [(37, 37), (20, 150), (128, 128), (129, 129)]
# 128: chunks of one KV block.
CHUNK_SIZES = [1, 7, 64, 100, 128]
# Probe length of the T1-T7 sweeps: odd and past one 128-key block (the contract's default probe,
# 67 tokens, stays inside the first block).
SWEEP_PROBE_LEN = 131
LOW_PRECISION = [torch.bfloat16, torch.float16]


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def qkv(b: int, sq: int, sk: int, hq: int, hkv: int, d: int, seed: int, dtype=torch.float32):
    return (
        randn(b, sq, hq, d, seed=seed, dtype=dtype),
        randn(b, sk, hkv, d, seed=seed + 1, dtype=dtype),
        randn(b, sk, hkv, d, seed=seed + 2, dtype=dtype),
    )


def naive_attention64(q, k, v, *, causal, seqlens_q=None, seqlens_k=None, scale=None):
    """Float64 definition with materialised scores, one sequence at a time (autograd-able).

    Returns ``(out [B, Sq, Hq, d], lse [B, Hq, Sq])``; fully masked and padded rows give
    zeros and -inf.
    """
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    outs, lses = [], []
    for i in range(b):
        lq = sq if seqlens_q is None else int(seqlens_q[i])
        lk = sk if seqlens_k is None else int(seqlens_k[i])
        qi = q[i, :lq].double().transpose(0, 1)  # [Hq, lq, d]
        ki = k[i, :lk].double().repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        vi = v[i, :lk].double().repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        s = qi @ ki.transpose(-1, -2) * scale  # [Hq, lq, lk]
        rows = torch.arange(lq)[:, None] + (lk - lq)
        keep = torch.ones(lq, lk, dtype=torch.bool)
        if causal:
            keep = torch.arange(lk)[None, :] <= rows
        has_key = keep.any(dim=-1)
        # Fully masked rows get harmless scores and are zeroed after, so no NaN reaches
        # the backward of softmax.
        s = torch.where(keep, s, float("-inf"))
        s = torch.where(has_key[:, None], s, 0.0)
        p = torch.softmax(s, dim=-1)
        o = torch.where(has_key[:, None], p @ vi, 0.0)  # [Hq, lq, d]
        lse = torch.where(has_key, torch.logsumexp(s, dim=-1), float("-inf"))
        out_i = torch.zeros(sq, hq, d, dtype=torch.float64)
        out_i = torch.cat([o.transpose(0, 1), out_i[lq:]], dim=0)
        lse_i = torch.cat([lse, torch.full((hq, sq - lq), float("-inf"), dtype=torch.float64)], 1)
        outs.append(out_i)
        lses.append(lse_i)
    return torch.stack(outs), torch.stack(lses)


def sdpa_reference(q, k, v, *, causal):
    """torch SDPA (math backend, float64) with a bottom-right causal mask."""
    sq, sk = q.shape[1], k.shape[1]
    mask = None
    if causal:
        mask = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq)
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(
            q.double().transpose(1, 2),
            k.double().transpose(1, 2),
            v.double().transpose(1, 2),
            attn_mask=mask,
            enable_gqa=True,
        )
    return out.transpose(1, 2)


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    """Speed only.  The reference issues thousands of small elementwise ops; on a loaded
    machine torch's intra-op threads spend more time synchronising than computing.  Bits do
    not depend on the thread count (``test_bits_independent_of_thread_count``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ----------------------------------------------------------------------------- precondition


def test_torch_exp_and_log_are_position_independent():
    """The construction needs exp/log whose bits do not depend on the element's slot.

    (torch.sigmoid and torch.maximum(+0, -0) fail this on AVX512 CPUs; exp and log pass.)
    """
    x = torch.empty(5000).uniform_(-100.0, 10.0, generator=torch.Generator().manual_seed(0))
    y = x.abs() + 1e-3
    for fn, arg in ((torch.exp, x), (torch.log, y)):
        whole = fn(arg)
        shifted = fn(arg[3:])
        one_by_one = torch.stack([fn(arg[i : i + 1])[0] for i in range(0, 5000, 7)])
        assert_bitwise_equal(shifted, whole[3:], name=f"{fn.__name__} at an odd offset")
        assert_bitwise_equal(one_by_one, whole[::7], name=f"{fn.__name__} element alone")


def test_bits_independent_of_thread_count():
    q, k, v = qkv(3, 90, 90, 8, 2, 128, seed=2)
    cot = randn(3, 90, 8, 128, seed=3)
    results = []
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out, lse = attention(*leaves, causal=True, return_lse=True)
        results.append((out, lse, *torch.autograd.grad(out, leaves, cot)))
    for other in results[1:]:
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), results[0], other, strict=True):
            assert_bitwise_equal(b, a, name=f"{name} with another thread count")


# ----------------------------------------------------------------------------- accuracy


@pytest.mark.parametrize("hq,hkv,d", HEAD_CONFIGS)
@pytest.mark.parametrize("sq,sk", SEQ_CONFIGS[:2])
@pytest.mark.parametrize("causal", [False, True])
def test_fp32_matches_sdpa_float64(hq, hkv, d, sq, sk, causal):
    q, k, v = qkv(2, sq, sk, hq, hkv, d, seed=10 * d + sq)
    out = attention_fp32(q, k, v, causal=causal)
    expected = sdpa_reference(q, k, v, causal=causal).float()
    assert_within_tolerance(out, expected, op_class="attention")


@pytest.mark.parametrize("causal", [False, True])
def test_lse_matches_float64_logsumexp(causal):
    q, k, v = qkv(2, 20, 150, 4, 2, 64, seed=3)
    out, lse = attention_fp32(q, k, v, causal=causal, return_lse=True)
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 20)
    out64, lse64 = naive_attention64(q, k, v, causal=causal)
    assert_within_tolerance(out, out64.float(), op_class="attention")
    assert_within_tolerance(lse, lse64.float(), op_class="attention")


def test_padded_lengths_and_scale_match_float64():
    q, k, v = qkv(3, 40, 90, 4, 2, 64, seed=4)
    seqlens_q = torch.tensor([40, 13, 1])
    seqlens_k = torch.tensor([90, 13, 70])
    out, lse = attention_fp32(
        q,
        k,
        v,
        causal=True,
        seqlens_q=seqlens_q,
        seqlens_k=seqlens_k,
        softmax_scale=0.3,
        return_lse=True,
    )
    out64, lse64 = naive_attention64(
        q, k, v, causal=True, seqlens_q=seqlens_q, seqlens_k=seqlens_k, scale=0.3
    )
    assert_within_tolerance(out, out64.float(), op_class="attention")
    assert_within_tolerance(lse, lse64.float(), op_class="attention")


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("causal", [False, True])
def test_low_precision_within_attention_tolerance_of_fp32(dtype, causal):
    q, k, v = qkv(2, 70, 70, 4, 2, 64, seed=5, dtype=dtype)
    out, lse = attention(q, k, v, causal=causal, return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    out32, lse32 = attention_fp32(q, k, v, causal=causal, return_lse=True)
    assert_within_tolerance(out, out32, op_class="attention")
    # The low-precision path is the fp32 arithmetic on the same (exactly upcast) inputs,
    # rounded once at the end: same LSE bits, output = fp32 output rounded.
    assert_bitwise_equal(lse, lse32, name="lse")
    assert_bitwise_equal(out, out32.to(dtype), name="output rounded once")


# ----------------------------------------------------------------------------- masking


def test_fully_masked_rows_give_zeros_and_neg_inf_lse():
    q, k, v = qkv(3, 12, 8, 4, 2, 64, seed=6)
    # Sequence 0: 12 queries after 8 keys -> the first 4 queries see no key (offset -4).
    # Sequence 1: no keys at all.  Sequence 2: 5 real queries, 7 padded query rows.
    out, lse = attention(
        q,
        k,
        v,
        causal=True,
        seqlens_q=torch.tensor([12, 12, 5]),
        seqlens_k=torch.tensor([8, 0, 8]),
        return_lse=True,
    )
    zeros = torch.zeros(4, 4, 64)
    assert_bitwise_equal(out[0, :4], zeros, name="rows before the first key")
    assert_bitwise_equal(out[1], torch.zeros(12, 4, 64), name="sequence without keys")
    assert_bitwise_equal(out[2, 5:], torch.zeros(7, 4, 64), name="padded query rows")
    assert torch.isneginf(lse[0, :, :4]).all() and torch.isneginf(lse[1]).all()
    assert torch.isneginf(lse[2, :, 5:]).all()
    assert torch.isfinite(out).all() and torch.isfinite(lse[0, :, 4:]).all()
    assert (out[0, 4:] != 0).any()


def test_nan_padding_never_leaks_forward_and_backward():
    q, k, v = qkv(2, 50, 80, 4, 2, 64, seed=7)
    seqlens_q, seqlens_k = torch.tensor([50, 30]), torch.tensor([80, 45])
    clean = [t.clone() for t in (q, k, v)]
    dirty = [t.clone() for t in (q, k, v)]
    for t, lengths in zip(dirty, (seqlens_q, seqlens_k, seqlens_k), strict=True):
        t[1, int(lengths[1]) :] = float("nan")
    results = []
    for tensors in (clean, dirty):
        leaves = [t.clone().requires_grad_(True) for t in tensors]
        out, lse = attention(
            *leaves, causal=True, seqlens_q=seqlens_q, seqlens_k=seqlens_k, return_lse=True
        )
        cotangent = randn(*out.shape, seed=8)
        grads = torch.autograd.grad(out, leaves, cotangent)
        results.append((out, lse, *grads))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *results, strict=True):
        assert_bitwise_equal(a, b, name=f"{name} with NaN padding")
        assert not torch.isnan(a).any(), name
    _, _, dq, dk, dv = results[1]
    assert_bitwise_equal(dq[1, 30:], torch.zeros_like(dq[1, 30:]), name="dq of padded rows")
    assert_bitwise_equal(dk[1, 45:], torch.zeros_like(dk[1, 45:]), name="dk of padded keys")


def test_nan_in_future_keys_of_decode_cache_does_not_leak():
    """A cache slot past the length holds NaN (KVCache fills with NaN) and is never read."""
    cache = KVCache(1, 100, 2, 64, name="decode cache")
    assert torch.isnan(cache.k).all()
    q, k, v = qkv(1, 70, 70, 4, 2, 64, seed=9)
    out = attention_with_kv_cache(q, k, v, cache)
    assert torch.isfinite(out).all()


def test_key_padding_mask_renumbers_kept_keys():
    """A mask with holes equals attention over the kept keys packed to the front."""
    q, k, v = qkv(2, 30, 120, 4, 2, 64, seed=11)
    mask = torch.rand(2, 120, generator=torch.Generator().manual_seed(1)) < 0.7
    mask[0, 100:] = False
    k_dirty, v_dirty = k.clone(), v.clone()
    k_dirty[~mask] = float("nan")
    v_dirty[~mask] = float("inf")
    out, lse = attention(q, k_dirty, v_dirty, causal=True, key_padding_mask=mask, return_lse=True)
    for b in range(2):
        kept = mask[b].nonzero().squeeze(1)
        out_b, lse_b = attention(
            q[b : b + 1], k[b : b + 1, kept], v[b : b + 1, kept], causal=True, return_lse=True
        )
        assert_bitwise_equal(out[b : b + 1], out_b, name=f"masked sequence {b}")
        assert_bitwise_equal(lse[b : b + 1], lse_b, name=f"masked sequence {b} lse")
    # A prefix mask is the same as seqlens_k.
    prefix = torch.arange(120)[None, :] < torch.tensor([[90], [33]])
    assert_bitwise_equal(
        attention(q, k, v, causal=True, key_padding_mask=prefix),
        attention(q, k, v, causal=True, seqlens_k=torch.tensor([90, 33])),
        name="prefix mask vs seqlens_k",
    )


# ----------------------------------------------------------------------------- Axis-A


def _sequence_in_batch(seq, position: int, batch: int, seed: int, sq_pad: int, sk_pad: int):
    """Puts ``seq = (q, k, v)`` (one sequence, [1, S, H, d]) at row ``position`` of a
    padded batch of random companions with random lengths; padding is NaN."""
    q1, k1, v1 = seq
    lq, lk = q1.shape[1], k1.shape[1]
    hq, hkv, d = q1.shape[2], k1.shape[2], q1.shape[3]
    sq, sk = lq + sq_pad, lk + sk_pad
    q, k, v = qkv(batch, sq, sk, hq, hkv, d, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    seqlens_k = torch.randint(1, sk + 1, (batch,), generator=gen)
    seqlens_q = torch.minimum(torch.randint(1, sq + 1, (batch,), generator=gen), seqlens_k)
    seqlens_q[position], seqlens_k[position] = lq, lk
    for t, lengths in ((q, seqlens_q), (k, seqlens_k), (v, seqlens_k)):
        for b in range(batch):
            t[b, int(lengths[b]) :] = float("nan")
    q[position, :lq], k[position, :lk], v[position, :lk] = q1[0], k1[0], v1[0]
    return q, k, v, seqlens_q, seqlens_k


@pytest.mark.parametrize("hq,hkv,d", HEAD_CONFIGS[:3])
@pytest.mark.parametrize("causal", [False, True])
def test_row_bits_independent_of_batch_position_neighbours_padding(hq, hkv, d, causal):
    seq = qkv(1, 45, 140, hq, hkv, d, seed=20)
    alone, lse_alone = attention(*seq, causal=causal, return_lse=True)
    for batch, position, sq_pad, sk_pad in ((3, 0, 0, 0), (5, 2, 9, 70), (4, 3, 1, 3)):
        q, k, v, seqlens_q, seqlens_k = _sequence_in_batch(
            seq, position, batch, seed=batch * 7, sq_pad=sq_pad, sk_pad=sk_pad
        )
        out, lse = attention(
            q, k, v, causal=causal, seqlens_q=seqlens_q, seqlens_k=seqlens_k, return_lse=True
        )
        label = f"batch {batch} position {position} padding {sq_pad}/{sk_pad}"
        assert_bitwise_equal(out[position : position + 1, :45], alone, name=label)
        assert_bitwise_equal(lse[position : position + 1, :, :45], lse_alone, name=label)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_equals_padded_bitwise(dtype):
    lengths_q = [17, 1, 64, 40]
    lengths_k = [17, 90, 64, 140]
    seqs = [
        qkv(1, lq, lk, 4, 2, 64, seed=30 + i, dtype=dtype)
        for i, (lq, lk) in enumerate(zip(lengths_q, lengths_k, strict=True))
    ]
    q = torch.cat([s[0][0] for s in seqs])
    k = torch.cat([s[1][0] for s in seqs])
    v = torch.cat([s[2][0] for s in seqs])
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int64)
    out, lse = attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True)
    assert lse.shape == (4, q.shape[0])
    for i, s in enumerate(seqs):
        alone, lse_alone = attention(*s, causal=True, return_lse=True)
        rows = slice(int(cu_q[i]), int(cu_q[i + 1]))
        assert_bitwise_equal(out[rows], alone[0], name=f"varlen sequence {i}")
        assert_bitwise_equal(lse[:, rows], lse_alone[0], name=f"varlen sequence {i} lse")


@pytest.mark.parametrize("chunk", CHUNK_SIZES)
def test_chunked_prefill_and_decode_equal_prefill_bitwise(chunk):
    """T5: one sequence fed in chunks (1 = token-by-token decode) through a KV cache,
    next to two companion sequences at other lengths, equals its one-shot prefill."""
    length = 140 if chunk > 1 else 132  # past one 128-key block
    q, k, v = qkv(1, length, length, 4, 2, 64, seed=40)
    full, lse_full = attention(q, k, v, causal=True, return_lse=True)
    cache = KVCache(3, 200, 2, 64, name="t5 cache")
    cache.append(*qkv(2, 1, 33, 4, 2, 64, seed=41)[1:], seq_ids=torch.tensor([0, 2]))
    outs, lses = [], []
    for step, start in enumerate(range(0, length, chunk)):
        n = min(chunk, length - start)
        cq, ck, cv = qkv(3, n, n, 4, 2, 64, seed=100 + step)
        cq[1], ck[1], cv[1] = (
            q[0, start : start + n],
            k[0, start : start + n],
            v[0, start : start + n],
        )
        out, lse = attention_with_kv_cache(cq, ck, cv, cache, return_lse=True)
        outs.append(out[1])
        lses.append(lse[1])
    assert_bitwise_equal(torch.cat(outs)[None], full, name=f"chunk {chunk} output")
    assert_bitwise_equal(torch.cat(lses, dim=-1)[None], lse_full, name=f"chunk {chunk} lse")


def test_prefix_reuse_through_kv_cache_bitwise():
    """T7: a prefix cached by one batch and extended in another equals a one-shot prefill."""
    prefix, suffix = 70, 25
    q, k, v = qkv(1, prefix + suffix, prefix + suffix, 4, 2, 64, seed=50)
    full = attention(q, k, v, causal=True)
    writer = KVCache(4, 128, 2, 64, name="shared cache")
    pq, pk, pv = qkv(2, prefix, prefix, 4, 2, 64, seed=51)
    pq[1], pk[1], pv[1] = q[0, :prefix], k[0, :prefix], v[0, :prefix]
    attention_with_kv_cache(pq, pk, pv, writer, torch.tensor([3, 0]))
    writer.copy_prefix(src=0, dst=2)
    sq, sk, sv = qkv(3, suffix, suffix, 4, 2, 64, seed=52)
    sq[0], sk[0], sv[0] = q[0, prefix:], k[0, prefix:], v[0, prefix:]
    out = attention_with_kv_cache(
        sq, sk, sv, writer, torch.tensor([2, 1, 3]), seqlens_new=torch.tensor([suffix, 9, 4])
    )
    assert_bitwise_equal(out[0:1], full[:, prefix:], name="suffix after a reused prefix")


# ----------------------------------------------------------------------------- T1-T7 sweep


def _pad_batch(seqs, padding: str, seed: int):
    """Right-pads each field of ``seqs`` (tuples of [L, ...] tensors) to a batch [B, S, ...]."""
    gen = torch.Generator().manual_seed(seed)
    width = max(fields[0].shape[0] for fields in seqs)
    batch = [
        torch.stack(
            [
                torch.cat([t, padding_fill(t, width - t.shape[0], padding, generator=gen)])
                for t in column
            ]
        )
        for column in zip(*seqs, strict=True)
    ]
    lengths = torch.tensor([fields[0].shape[0] for fields in seqs])
    return batch, lengths


def _rows(out, lse, b: int, n: int, start: int = 0):
    """Sequence ``b``'s rows ``start:start+n`` of a padded result: (out [n, Hq, d], lse [n, Hq])."""
    return out[b, start : start + n], lse[b, :, start : start + n].t().contiguous()


def _cat_rows(parts):
    return tuple(torch.cat(column) for column in zip(*parts, strict=True))


class AttentionAdapter:
    """The reference through the contract's SequenceAdapter protocol.

    A sequence is ``(q [L, Hq, d], k [L, Hkv, d], v [L, Hkv, d])``; its output rows are
    ``(out [L, Hq, d], lse [L, Hq])``.  Incremental schedules go through ``KVCache``.
    """

    def __init__(self, causal: bool = True):
        self.causal = causal
        self.calls = 0

    def _incremental(self):
        if not self.causal:
            raise NotImplementedError("non-causal attention has no incremental schedule")

    def _cache(self, batch: int, max_len: int, like: Tensor) -> KVCache:
        return KVCache(batch, max(max_len, 1), like.shape[1], like.shape[2], like.dtype)

    def prefill_padded(self, seqs, padding):
        self.calls += 1
        (q, k, v), lengths = _pad_batch(seqs, padding, seed=self.calls)
        out, lse = attention(
            q, k, v, causal=self.causal, seqlens_q=lengths, seqlens_k=lengths, return_lse=True
        )
        return [_rows(out, lse, b, int(n)) for b, n in enumerate(lengths)]

    def prefill_varlen(self, seqs):
        lengths = [fields[0].shape[0] for fields in seqs]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        q, k, v = (torch.cat(column) for column in zip(*seqs, strict=True))
        out, lse = attention_varlen(q, k, v, cu, cu, causal=self.causal, return_lse=True)
        return [
            (out[cu[b] : cu[b + 1]], lse[:, cu[b] : cu[b + 1]].t().contiguous())
            for b in range(len(seqs))
        ]

    def prefill_chunked(self, seq, chunk_lengths):
        self._incremental()
        q, k, v = seq
        cache = self._cache(1, q.shape[0], k)
        parts, start = [], 0
        for n in chunk_lengths:
            chunk = [t[None, start : start + n] for t in (q, k, v)]
            out, lse = attention_with_kv_cache(*chunk, cache, return_lse=True)
            parts.append(_rows(out, lse, 0, n))
            start += n
        return _cat_rows(parts)

    def decode(self, seq, prompt_len, companions):
        self._incremental()
        seqs = [seq, *companions]
        lengths = [fields[0].shape[0] for fields in seqs]
        cache = self._cache(len(seqs), max(lengths), seq[1])
        prompts = [
            tuple(t[: min(prompt_len, n)] for t in fields)
            for fields, n in zip(seqs, lengths, strict=True)
        ]
        (q, k, v), prompt_lengths = _pad_batch(prompts, "nan", seed=prompt_len)
        out, lse = attention_with_kv_cache(
            q, k, v, cache, seqlens_new=prompt_lengths, return_lse=True
        )
        parts = [_rows(out, lse, 0, prompt_len)]
        while int(cache.lengths[0]) < lengths[0]:
            active = [b for b, n in enumerate(lengths) if int(cache.lengths[b]) < n]
            step = [
                torch.stack([seqs[b][f][int(cache.lengths[b])] for b in active])[:, None]
                for f in range(3)
            ]
            out, lse = attention_with_kv_cache(*step, cache, torch.tensor(active), return_lse=True)
            parts.append(_rows(out, lse, active.index(0), 1))
        return _cat_rows(parts)

    def prefix_reuse(self, seq, prefix_len, writer_batch, reader_batch):
        self._incremental()
        prefix = tuple(t[:prefix_len] for t in seq)
        suffix = tuple(t[prefix_len:] for t in seq)
        # Writer: the probe's prefix sits last, after the writer batch.
        writers = [*writer_batch, prefix]
        (q, k, v), lengths = _pad_batch(writers, "garbage", seed=prefix_len)
        writer_cache = self._cache(len(writers), int(lengths.max()), seq[1])
        out, lse = attention_with_kv_cache(
            q, k, v, writer_cache, seqlens_new=lengths, return_lse=True
        )
        parts = [_rows(out, lse, len(writers) - 1, prefix_len)]
        # Reader: another cache; the probe's slot is first and gets the copied prefix.
        readers = [suffix, *reader_batch]
        longest = max([seq[0].shape[0]] + [r[0].shape[0] for r in reader_batch])
        reader_cache = self._cache(len(readers), longest, seq[1])
        reader_cache.copy_prefix(len(writers) - 1, 0, source=writer_cache)
        (q, k, v), lengths = _pad_batch(readers, "nan", seed=prefix_len + 1)
        out, lse = attention_with_kv_cache(
            q, k, v, reader_cache, seqlens_new=lengths, return_lse=True
        )
        parts.append(_rows(out, lse, 0, suffix[0].shape[0]))
        return _cat_rows(parts)


class AttentionGradAdapter:
    """Gradients through the protocol: a sequence is ``(q, k, v, cotangent)``; its rows are
    ``(dq, dk, dv)`` of ``sum(out * cotangent)``.  Training computes whole sequences, so
    there is no incremental schedule (T5, T7 not applicable)."""

    def __init__(self):
        self.calls = 0

    def _grads(self, fn, q, k, v, cot):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        return torch.autograd.grad(fn(*leaves), leaves, cot)

    def prefill_padded(self, seqs, padding):
        self.calls += 1
        (q, k, v, cot), lengths = _pad_batch(seqs, padding, seed=self.calls)
        dq, dk, dv = self._grads(
            lambda *t: attention(*t, causal=True, seqlens_q=lengths, seqlens_k=lengths),
            q,
            k,
            v,
            cot,
        )
        return [(dq[b, :n], dk[b, :n], dv[b, :n]) for b, n in enumerate(lengths.tolist())]

    def prefill_varlen(self, seqs):
        lengths = [fields[0].shape[0] for fields in seqs]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        q, k, v, cot = (torch.cat(column) for column in zip(*seqs, strict=True))
        grads = self._grads(lambda *t: attention_varlen(*t, cu, cu, causal=True), q, k, v, cot)
        return [tuple(g[cu[b] : cu[b + 1]] for g in grads) for b in range(len(seqs))]

    def prefill_chunked(self, seq, chunk_lengths):
        raise NotImplementedError("no backward through a KV cache")

    def decode(self, seq, prompt_len, companions):
        raise NotImplementedError("no backward through a KV cache")

    def prefix_reuse(self, seq, prefix_len, writer_batch, reader_batch):
        raise NotImplementedError("no backward through a KV cache")


def _make_sequence(hq: int, hkv: int, d: int, dtype: torch.dtype, with_cotangent: bool = False):
    def make(length: int, generator: torch.Generator):
        shapes = [(length, hq, d), (length, hkv, d), (length, hkv, d)]
        if with_cotangent:
            shapes.append((length, hq, d))
        return tuple(torch.randn(*s, generator=generator).to(dtype) for s in shapes)

    return make


@pytest.mark.parametrize("hq,hkv,d,dtype", [(4, 2, 64, torch.float32), (4, 1, 128, torch.bfloat16)])
def test_sequence_invariance_sweep_t1_to_t7(hq, hkv, d, dtype):
    adapter = AttentionAdapter(causal=True)
    assert isinstance(adapter, SequenceAdapter)
    reports = sequence_invariance_sweep(
        adapter, _make_sequence(hq, hkv, d, dtype), seq_len=SWEEP_PROBE_LEN
    )
    assert {r.transform_id for r in reports} == {f"T{i}" for i in range(1, 8)}
    assert_no_drift(reports)


def test_sequence_invariance_sweep_non_causal():
    reports = sequence_invariance_sweep(
        AttentionAdapter(causal=False),
        _make_sequence(6, 2, 32, torch.float32),
        seq_len=SWEEP_PROBE_LEN,
    )
    assert_no_drift(reports, allow_not_applicable={"T5", "T7"})


def test_sequence_invariance_sweep_gradients():
    reports = sequence_invariance_sweep(
        AttentionGradAdapter(),
        _make_sequence(4, 2, 64, torch.float32, with_cotangent=True),
        seq_len=SWEEP_PROBE_LEN,
    )
    assert {r.transform_id for r in reports if r.applicable} == {"T1", "T2", "T3", "T4", "T6"}
    assert_no_drift(reports, allow_not_applicable={"T5", "T7"})


def test_sweep_detects_a_block_size_that_follows_the_schedule(monkeypatch):
    """Not vacuous: the same arithmetic with another KV block size in the chunked schedule
    only (as a kernel that picks its tiling from the chunk would) gives other bits."""
    import batchinv.reference.attention as attention_module

    class ScheduleDependentBlocks(AttentionAdapter):
        def prefill_chunked(self, seq, chunk_lengths):
            with monkeypatch.context() as m:
                m.setattr(attention_module, "KV_BLOCK", 16)
                return super().prefill_chunked(seq, chunk_lengths)

    reports = sequence_invariance_sweep(
        ScheduleDependentBlocks(),
        _make_sequence(4, 2, 64, torch.float32),
        batch_sizes=(1,),
        neighbour_kinds=(),
        padding_modes=(),
        chunk_sizes=(7,),
        prompt_lengths=(66,),
        prefix_lengths=(64,),
    )
    drifting = [r for r in reports if r.applicable and not r.bitwise]
    assert [r.case for r in drifting] == [
        "chunked prefill, chunks of 7",
        "chunked prefill, irregular chunks [5, 62]",
    ]
    with pytest.raises(AssertionError, match="2 drifting"):
        assert_no_drift(reports)


# ----------------------------------------------------------------------------- gradients


def _grads(fn, inputs, cotangent):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    return torch.autograd.grad(out, leaves, cotangent)


@pytest.mark.parametrize("hq,hkv,d", HEAD_CONFIGS[:3])
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_match_float64_autograd(hq, hkv, d, causal):
    q, k, v = qkv(2, 30, 75, hq, hkv, d, seed=60)
    seqlens_q, seqlens_k = torch.tensor([30, 11]), torch.tensor([75, 40])
    cotangent = randn(2, 30, hq, d, seed=61)
    kwargs = dict(causal=causal, seqlens_q=seqlens_q, seqlens_k=seqlens_k)
    got = _grads(lambda *t: attention_fp32(*t, **kwargs), (q, k, v), cotangent)
    expected = _grads(
        lambda *t: naive_attention64(*t, **kwargs)[0],
        [t.double() for t in (q, k, v)],
        cotangent.double(),
    )
    for name, g, e in zip(("dq", "dk", "dv"), got, expected, strict=True):
        assert g.dtype == torch.float32, name
        assert_within_tolerance(g, e.float(), op_class="attention", kind="grad")


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_low_precision_gradients_within_tolerance(dtype):
    q, k, v = qkv(1, 40, 40, 4, 2, 64, seed=62, dtype=dtype)
    cotangent = randn(1, 40, 4, 64, seed=63, dtype=dtype)
    got = _grads(lambda *t: attention(*t, causal=True), (q, k, v), cotangent)
    inputs32 = [t.float() for t in (q, k, v)]
    ref = _grads(lambda *t: attention_fp32(*t, causal=True), inputs32, cotangent.float())
    for name, g, r in zip(("dq", "dk", "dv"), got, ref, strict=True):
        assert g.dtype == dtype and r.dtype == torch.float32
        assert_within_tolerance(g, r, op_class="attention", kind="grad")
        # By design: the same fp32 backward on exactly upcast inputs, rounded once.
        assert_bitwise_equal(g, r.to(dtype), name=f"{name} rounded once")


def test_gradients_of_a_sequence_independent_of_its_batch_and_run():
    seq = qkv(1, 45, 100, 4, 2, 64, seed=70)
    cot = randn(1, 45, 4, 64, seed=71)
    alone = _grads(lambda *t: attention(*t, causal=True), seq, cot)
    again = _grads(lambda *t: attention(*t, causal=True), seq, cot)
    for name, a, b in zip(("dq", "dk", "dv"), alone, again, strict=True):
        assert_bitwise_equal(a, b, name=f"{name} run to run")
    for batch, position, sq_pad, sk_pad in ((3, 1, 5, 30), (2, 0, 0, 0)):
        q, k, v, seqlens_q, seqlens_k = _sequence_in_batch(
            seq, position, batch, seed=72 + batch, sq_pad=sq_pad, sk_pad=sk_pad
        )
        cot_b = randn(batch, q.shape[1], 4, 64, seed=73)
        cot_b[position, :45] = cot[0]
        grads = _grads(
            lambda *t, lq=seqlens_q, lk=seqlens_k: attention(
                *t, causal=True, seqlens_q=lq, seqlens_k=lk
            ),
            (q, k, v),
            cot_b,
        )
        dq, dk, dv = (g[position : position + 1] for g in grads)
        label = f"batch {batch} position {position}"
        assert_bitwise_equal(dq[:, :45], alone[0], name=f"dq {label}")
        assert_bitwise_equal(dk[:, :100], alone[1], name=f"dk {label}")
        assert_bitwise_equal(dv[:, :100], alone[2], name=f"dv {label}")
    # Varlen packing of the same sequence with a neighbour before it.
    other = qkv(1, 20, 30, 4, 2, 64, seed=74)
    cu_q = torch.tensor([0, 20, 65])
    cu_k = torch.tensor([0, 30, 130])
    packed = [torch.cat([o[0], s[0]]) for o, s in zip(other, seq, strict=True)]
    cot_packed = torch.cat([randn(20, 4, 64, seed=75), cot[0]])
    grads = _grads(lambda *t: attention_varlen(*t, cu_q, cu_k, causal=True), packed, cot_packed)
    assert_bitwise_equal(grads[0][20:], alone[0][0], name="dq varlen")
    assert_bitwise_equal(grads[1][30:], alone[1][0], name="dk varlen")
    assert_bitwise_equal(grads[2][30:], alone[2][0], name="dv varlen")


# ----------------------------------------------------------------------------- API


def test_module_dispatch_and_inputs_unchanged():
    q, k, v = qkv(2, 10, 10, 4, 2, 64, seed=80, dtype=torch.bfloat16)
    before = [t.clone() for t in (q, k, v)]
    module = AttentionReference(causal=True)
    out = module(q, k, v)
    assert out.dtype == torch.bfloat16
    assert_bitwise_equal(out, attention(q, k, v, causal=True), name="module forward")
    out32 = module.forward_fp32(q, k, v)
    assert out32.dtype == torch.float32
    cu = torch.tensor([0, 10, 20])
    packed = module(
        q.reshape(20, 4, 64),
        k.reshape(20, 2, 64),
        v.reshape(20, 2, 64),
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
    )
    assert_bitwise_equal(packed.reshape(2, 10, 4, 64), out, name="module varlen")
    for old, new in zip(before, (q, k, v), strict=True):
        assert_bitwise_equal(new, old, name="input after the call")


def test_non_contiguous_inputs_give_the_same_bits():
    q, k, v = qkv(2, 30, 30, 4, 2, 64, seed=81)
    strided = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
    assert not strided[0].is_contiguous()
    assert_bitwise_equal(attention(*strided, causal=True), attention(q, k, v, causal=True))


def test_kv_cache_capacity_and_lengths():
    cache = KVCache(2, 10, 2, 64, name="tiny cache")
    k, v = randn(2, 6, 2, 64, seed=1), randn(2, 6, 2, 64, seed=2)
    assert cache.append(k, v, new_lengths=torch.tensor([6, 3])).tolist() == [6, 3]
    with pytest.raises(ValueError, match=r"tiny cache.*sequence 0.*length 12.*max_len=10"):
        cache.append(k, v)
    assert cache.lengths.tolist() == [6, 3], "a failed append must write nothing"
    k_read, _, lengths = cache.read(torch.tensor([1]))
    assert lengths.tolist() == [3]
    assert_bitwise_equal(k_read[0, :3], k[1, :3], name="cached keys")
    assert torch.isnan(k_read[0, 3:]).all()
    with pytest.raises(IndexError, match="seq_ids"):
        cache.read(torch.tensor([2]))


# ----------------------------------------------------------------------------- bad input


def _call(**overrides):
    q, k, v = qkv(2, 8, 8, 4, 2, 64, seed=0)
    args = dict(q=q, k=k, v=v) | overrides
    return attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


@pytest.mark.parametrize(
    "overrides,error,match",
    [
        (dict(q=randn(2, 8, 4, 96, seed=0)[..., :90]), ValueError, "head dim"),
        (
            dict(
                q=randn(2, 8, 4, 512, seed=0),
                k=randn(2, 8, 2, 512, seed=0),
                v=randn(2, 8, 2, 512, seed=0),
            ),
            ValueError,
            r"d=512",
        ),
        (
            dict(
                q=randn(2, 8, 4, 63, seed=0),
                k=randn(2, 8, 2, 63, seed=0),
                v=randn(2, 8, 2, 63, seed=0),
            ),
            ValueError,
            r"d=63",
        ),
        (dict(q=randn(2, 8, 4, 64, seed=0, dtype=torch.bfloat16)), TypeError, "dtype"),
        (dict(q=randn(2, 8, 5, 64, seed=0)), ValueError, r"Hq=5.*Hkv=2"),
        (dict(v=randn(2, 9, 2, 64, seed=0)), ValueError, "k and v"),
        (dict(k=randn(3, 8, 2, 64, seed=0), v=randn(3, 8, 2, 64, seed=0)), ValueError, "batch"),
        (dict(q=randn(8, 4, 64, seed=0)), ValueError, "cu_seqlens"),
        (
            dict(
                q=randn(0, 8, 4, 64, seed=0),
                k=randn(0, 8, 2, 64, seed=0),
                v=randn(0, 8, 2, 64, seed=0),
            ),
            ValueError,
            "empty batch",
        ),
        (dict(seqlens_k=torch.tensor([8, 9])), ValueError, r"seqlens_k\[1\] = 9.*Sk=8"),
        (dict(seqlens_q=torch.tensor([-1, 2])), ValueError, r"seqlens_q\[0\]"),
        (dict(seqlens_k=torch.tensor([8.0, 2.0])), TypeError, "seqlens_k"),
        (dict(seqlens_k=torch.tensor([8])), ValueError, "seqlens_k"),
        (dict(key_padding_mask=torch.ones(2, 8)), TypeError, "key_padding_mask"),
        (dict(key_padding_mask=torch.ones(2, 7, dtype=torch.bool)), ValueError, "key_padding_mask"),
        (dict(softmax_scale=float("nan")), ValueError, "softmax_scale"),
        (dict(causal=1), TypeError, "causal"),
    ],
)
def test_bad_input_raises_naming_the_argument(overrides, error, match):
    with pytest.raises(error, match=match):
        _call(**overrides)


@pytest.mark.parametrize(
    "cu_q,cu_k,match",
    [
        ([0, 5, 3, 8], [0, 2, 4, 8], r"cu_seqlens_q must be non-decreasing"),
        ([1, 5, 8], [0, 4, 8], r"cu_seqlens_q\[0\] must be 0"),
        ([0, 5, 8], [0, 4, 7], r"cu_seqlens_k\[-1\] must equal.*\(8\)"),
        ([0], [0], r"cu_seqlens_q.*empty batch"),
        ([0, 4, 8], [0, 8], r"same number of sequences"),
    ],
)
def test_bad_cu_seqlens_raise(cu_q, cu_k, match):
    q, k, v = randn(8, 4, 64, seed=0), randn(8, 2, 64, seed=1), randn(8, 2, 64, seed=2)
    with pytest.raises(ValueError, match=match):
        attention_varlen(q, k, v, torch.tensor(cu_q), torch.tensor(cu_k))


def test_require_contiguous_and_cu_dtype_checks():
    q, k, v = qkv(1, 8, 8, 4, 2, 64, seed=0)
    with pytest.raises(ValueError, match="q must be contiguous"):
        check_attention_args(
            q.transpose(1, 2).contiguous().transpose(1, 2), k, v, require_contiguous=True
        )
    with pytest.raises(TypeError, match="cu_seqlens_k"):
        attention_varlen(q[0], k[0], v[0], torch.tensor([0, 8]), torch.tensor([0.0, 8.0]))


def test_kv_block_is_the_documented_constant():
    # Changing it changes every bit pattern the GPU kernels are compared against (their
    # kBlockKeys: kernels_cu/common/attention_rows.cuh).
    assert KV_BLOCK == 128


def test_check_attention_args_returns_the_checked_host_lengths():
    # CPU lengths are checked where they are (no copy, no device sync) and handed back, so a
    # GPU backend builds its layout from exactly what passed.
    q, k, v = randn(8, 4, 64, seed=0), randn(8, 2, 64, seed=1), randn(8, 2, 64, seed=2)
    cu_q, cu_k = torch.tensor([0, 5, 8], dtype=torch.int32), torch.tensor([0, 4, 8])
    values = check_attention_args(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert values.cu_seqlens_q is cu_q and values.cu_seqlens_k is cu_k
    assert values.seqlens_q is None and values.seqlens_k is None
    unchecked = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, check_values=False)
    assert check_attention_args(q, k, v, **unchecked) is None
    qp, kp = randn(2, 8, 4, 64, seed=0), randn(2, 9, 2, 64, seed=1)
    lens = torch.tensor([8, 0])
    values = check_attention_args(qp, kp, kp, seqlens_k=torch.tensor([9, 1]), seqlens_q=lens)
    assert values.seqlens_q is lens and values.seqlens_k.tolist() == [9, 1]
    with pytest.raises(ValueError, match=r"seqlens_k\[0\] = 10 is outside \[0, 9\]"):
        check_length_values(qp, kp, seqlens_k=torch.tensor([10, 1]))

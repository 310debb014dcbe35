"""Every kernel variant added for attention, token logprobs and the cluster log-softmax, run
once on small odd shapes with NaN in the padding, and checked for finite results and exact
zeros where nothing may be written.  The value and invariance checks live in each op's own
test file; this file is the short target that `nox -s sanitize` runs under compute-sanitizer
(memcheck is ~50x slower than a plain run, so the full op files do not fit a session)."""

from __future__ import annotations

import pytest
import torch

import batchinv
from batchinv.gpu import attention as gpu_attention
from batchinv.gpu import log_softmax as gpu_log_softmax
from batchinv.reference.kv_cache import KVCache

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
DTYPES = (torch.bfloat16, torch.float16)


def _randn(*shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("mode, warps", (("tile", 4), ("tile", 1), ("split", 1), ("split", 4)))
def test_attention_forward_variants(dtype, d, mode, warps):
    sq, sk = 70, 1100  # more than one 1024-key split, lengths not multiples of 64
    q = _randn(2, sq, 4, d, dtype=dtype, seed=1)
    k = _randn(2, sk, 2, d, dtype=dtype, seed=2)
    v = _randn(2, sk, 2, d, dtype=dtype, seed=3)
    seqlens_q = torch.tensor([sq, 5], device=DEVICE)
    seqlens_k = torch.tensor([sk, 700], device=DEVICE)
    k[1, 700:] = float("nan")
    v[1, 700:] = float("nan")
    out, lse = gpu_attention.attention(
        q,
        k,
        v,
        causal=True,
        seqlens_q=seqlens_q,
        seqlens_k=seqlens_k,
        return_lse=True,
        mode=mode,
        warps=warps,
    )
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[1, :5]).all()
    assert (out[1, 5:] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", (64, 128))
def test_attention_decode_from_cache_and_backward(dtype, d):
    cache = KVCache(3, 1200, 2, d, dtype=dtype, device=DEVICE)
    prefix = _randn(3, 1100, 2, d, dtype=dtype, seed=4)
    cache.append(prefix, prefix.flip(1))
    for step in range(2):  # decode: one token per sequence
        q = _randn(3, 1, 4, d, dtype=dtype, seed=10 + step)
        kv = _randn(3, 1, 2, d, dtype=dtype, seed=20 + step)
        out = batchinv.attention_with_kv_cache(q, kv, kv, cache)
        assert torch.isfinite(out).all()
    q, k, v = (
        _randn(1, 130, heads, d, dtype=dtype, seed=seed).requires_grad_(True)
        for heads, seed in ((4, 30), (2, 31), (2, 32))
    )
    batchinv.attention(q, k, v, causal=True).sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("dtype", DTYPES)
def test_token_logprobs_forward_and_backward(dtype):
    hidden = _randn(37, 256, dtype=dtype, seed=5).requires_grad_(True)
    weight = (_randn(5000, 256, dtype=dtype, seed=6) / 16).requires_grad_(True)
    targets = torch.randint(0, 5000, (37,), device=DEVICE)
    targets[3] = -100
    logprobs, entropy = batchinv.token_logprobs(hidden, weight, targets, return_entropy=True)
    (logprobs.sum() + entropy.sum()).backward()
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()
    assert logprobs[3] == 0


@pytest.mark.parametrize("backward", (False, True))
def test_log_softmax_cluster_form(backward):
    x = _randn(3, 151936, dtype=torch.bfloat16, seed=7).requires_grad_(backward)
    threads = gpu_log_softmax.threads_for(151936, torch.bfloat16, x.device, torch.float32)
    out = batchinv.log_softmax(x)
    assert torch.isfinite(out).all() and threads > 0
    if backward:
        out.sum().backward()
        assert torch.isfinite(x.grad).all()

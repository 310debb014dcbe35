"""The adversarial suite on CUDA: the device-independent case tables of ``tests/_adversarial.py``
(KV caches, KV-cache attention, the static cache, the model over many layers' caches) on GPU
tensors, and what only the GPU can get wrong: an out-of-range id with the id check off must
never make the embedding backward write outside ``grad_weight``, the CUDA KV-cache attention
rejects ``q``/``k_new`` of different token counts as the CPU does, caches the CUDA kernels
cannot run fail where they are made, and the context stays usable after every case.

``nox -s sanitize -- tests/gpu/test_adversarial_cuda.py`` runs these under compute-sanitizer
memcheck."""

from __future__ import annotations

import pytest
import torch

import batchinv
from _adversarial import (
    CUDA,
    ids,
    kv_attention_cases,
    kv_cache_constructor_cases,
    kv_cache_method_cases,
    model_cache_cases,
    run_case,
    static_cache_cases,
)
from batchinv.contract import assert_bitwise_equal
from batchinv.kv_cache import KVCache
from batchinv.reference.embedding import embedding_backward
from batchinv.static_kv_cache import StaticKVCache

pytestmark = pytest.mark.cuda

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _cases():
    if not torch.cuda.is_available():  # the tables build CUDA tensors; collected but skipped
        return []
    return (
        kv_cache_constructor_cases(CUDA)
        + kv_cache_method_cases(CUDA)
        + kv_attention_cases(CUDA)
        + static_cache_cases(CUDA)
        + model_cache_cases(CUDA)
    )


CASES = _cases()


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_bad_call_changes_nothing_on_cuda(case):
    run_case(case)
    torch.cuda.synchronize()  # a fault in the case would surface here


def test_every_device_table_ran():
    assert len(CASES) > 100


# ----------------------------------------------------------------------------- embedding


@pytest.mark.parametrize("id_dtype", (torch.int32, torch.int64))
@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_backward_with_unchecked_out_of_range_ids(dtype, id_dtype):
    """check_ids=False and ids -1, vocab, 2**40: the forward gives NaN rows, the backward drops
    those ids' gradients (bitwise the CPU reference, which drops them too), nothing is written
    out of bounds and the context stays usable."""
    vocab, hidden = 300, 111
    bad = [-1, vocab, 2**40] if id_dtype == torch.int64 else [-1, vocab, 2**31 - 1]
    gen = torch.Generator().manual_seed(7)
    ids_ = torch.randint(0, vocab, (64,), generator=gen)
    ids_[[3, 10, 40]] = torch.tensor(bad)
    ids_[::9] = 5
    ids_ = ids_.to(id_dtype)
    grad = torch.randn(64, hidden, generator=gen).to(dtype)
    weight = torch.randn(vocab, hidden, generator=gen).to(dtype).cuda().requires_grad_(True)
    out = batchinv.embedding(ids_.cuda(), weight, check_ids=False)
    assert bool(out[[3, 10, 40]].isnan().all())
    out.backward(grad.cuda())
    torch.cuda.synchronize()
    expected = embedding_backward(ids_, grad, vocab, dtype)
    assert_bitwise_equal(weight.grad.cpu(), expected)
    in_range = (ids_ >= 0) & (ids_ < vocab)
    dropped = embedding_backward(ids_[in_range], grad[in_range], vocab, dtype)
    assert_bitwise_equal(expected, dropped)
    # the context is intact: a checked call still raises and a good one still works
    with pytest.raises(IndexError, match="ids"):
        batchinv.embedding(ids_.cuda(), weight.detach())
    good = ids_.clamp(0, vocab - 1).cuda()
    assert_bitwise_equal(batchinv.embedding(good, weight.detach()), weight.detach()[good.long()])


def test_embedding_backward_of_only_bad_ids_is_all_zero():
    weight = torch.zeros(10, 16, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    ids_ = torch.tensor([-1, 10, 2**40, -(2**40)], device="cuda")
    batchinv.embedding(ids_, weight, check_ids=False).sum().backward()
    torch.cuda.synchronize()
    assert_bitwise_equal(weight.grad, torch.zeros_like(weight))


# ----------------------------------------------------------------------------- CUDA only


def test_linear_with_no_in_features_names_in_features():
    x = torch.zeros(3, 0, dtype=torch.bfloat16, device="cuda")
    weight = torch.zeros(4, 0, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="in_features"):
        batchinv.linear(x, weight)


@pytest.mark.parametrize(("q_tokens", "k_tokens"), [(2, 1), (1, 3)])
def test_kv_cache_attention_token_count_mismatch_is_an_error(q_tokens, k_tokens):
    cache = KVCache(1, 8, 2, 64, dtype=torch.bfloat16, device="cuda")
    q = torch.randn(1, q_tokens, 4, 64, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(1, k_tokens, 2, 64, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad(), pytest.raises(ValueError, match="S_new"):
        batchinv.attention_with_kv_cache(q, k, k.clone(), cache)
    assert cache.host_lengths().tolist() == [0]
    assert bool(cache.k.isnan().all())


@pytest.mark.parametrize("make", [KVCache, StaticKVCache])
def test_caches_the_cuda_kernels_cannot_run_fail_where_made(make):
    def build(head_dim, dtype):
        if make is KVCache:
            return KVCache(2, 8, 2, head_dim, dtype, "cuda")
        return StaticKVCache(1, 2, 8, 2, head_dim, dtype=dtype, device="cuda")

    with pytest.raises(ValueError, match="head_dim=96.*CUDA attention kernels"):
        build(96, torch.bfloat16)
    with pytest.raises(TypeError, match="float32"):
        build(64, torch.float32)
    build(64, torch.bfloat16)
    build(128, torch.float16)


def test_context_is_usable_after_the_suite():
    torch.cuda.synchronize()
    x = torch.ones(4, 8, dtype=torch.bfloat16, device="cuda")
    assert_bitwise_equal(batchinv.linear(x, x).float().cpu(), torch.full((4, 4), 8.0))

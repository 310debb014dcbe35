"""KVCache and attention_with_kv_cache on CUDA: host syncs per decode step (none with CPU or no
``seq_ids`` / ``seqlens_new``, one with GPU ones), the same bits whichever way the ids come, the
host lengths equal to the device state, and bad GPU ids that raise before anything is written.

Syncs are counted with torch's sync debug mode through ``batchinv.host_syncs`` ("error" raises
on any synchronizing call; "warn" warns once per call)."""

from __future__ import annotations

import pytest
import torch

import batchinv
from batchinv.contract import assert_bitwise_equal
from batchinv.gpu import attention as gpu_attention
from batchinv.host_syncs import count_host_syncs, sync_debug_mode
from batchinv.kv_cache import KVCache

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
DTYPE = torch.bfloat16
HQ, HKV, D = 8, 2, 128
# Cached keys per slot before the step: two slots on and one key past the contract's split
# (SPLIT_KEYS: 2048 keys), so a step's contexts span two splits.
SPLIT = gpu_attention.SPLIT_KEYS
LENGTHS = (1500, 3, SPLIT, SPLIT + 1, 64, 700)
CAPACITY = SPLIT + 100


def _randn(*shape, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(DTYPE).to(DEVICE)


def _filled_cache(seed=0) -> KVCache:
    """A cache whose slots hold ``LENGTHS`` keys, written by one padded append."""
    cache = KVCache(len(LENGTHS), CAPACITY, HKV, D, dtype=DTYPE, device=DEVICE)
    longest = max(LENGTHS)
    k = _randn(len(LENGTHS), longest, HKV, D, seed=seed)
    v = _randn(len(LENGTHS), longest, HKV, D, seed=seed + 1)
    cache.append(k, v, None, torch.tensor(LENGTHS))
    return cache


def _step_inputs(n, s_new=1, seed=100):
    return (
        _randn(n, s_new, HQ, D, seed=seed),
        _randn(n, s_new, HKV, D, seed=seed + 1),
        _randn(n, s_new, HKV, D, seed=seed + 2),
    )


def _decode(cache, ids=None, lens=None, inputs=None):
    """One step (``inputs``: q, k, v; default one new token per slot) returning (out, lse)."""
    if inputs is None:
        inputs = _step_inputs(cache.batch if ids is None else ids.numel())
    return batchinv.attention_with_kv_cache(*inputs, cache, ids, seqlens_new=lens, return_lse=True)


# The permuted subset of slots a step decodes, as CPU and GPU ids.
_IDS = torch.tensor([4, 0, 3])


@pytest.mark.parametrize("ids", (None, _IDS), ids=("all slots", "cpu seq_ids"))
def test_decode_step_makes_no_host_sync_with_host_ids(ids):
    inputs = _step_inputs(len(LENGTHS) if ids is None else ids.numel())
    _decode(_filled_cache(), ids, None, inputs)  # loads the kernels, pins the first host buffer
    cache, gpu_ids_cache = _filled_cache(), _filled_cache()
    torch.cuda.synchronize()
    with sync_debug_mode("error"):
        got = _decode(cache, ids, None, inputs)
    want = _decode(gpu_ids_cache, None if ids is None else ids.to(DEVICE), None, inputs)
    assert_bitwise_equal(got, want, name="decode, host vs GPU seq_ids")
    assert cache.host_lengths().tolist() == gpu_ids_cache.host_lengths().tolist()
    assert_bitwise_equal((cache.k, cache.v), (gpu_ids_cache.k, gpu_ids_cache.v), name="storage")


def test_padded_chunk_with_cpu_lengths_makes_no_host_sync():
    lens, inputs = torch.tensor([5, 0, 2]), _step_inputs(3, s_new=5)
    _decode(_filled_cache(), _IDS, lens, inputs)
    cache, gpu_cache = _filled_cache(), _filled_cache()
    torch.cuda.synchronize()
    with sync_debug_mode("error"):
        got = _decode(cache, _IDS, lens, inputs)
    want = _decode(gpu_cache, _IDS.to(DEVICE), lens.to(DEVICE), inputs)
    assert_bitwise_equal(got, want, name="chunk, CPU vs GPU ids and lengths")
    assert cache.host_lengths(_IDS).tolist() == [64 + 5, 1500, SPLIT + 1 + 2]


def test_gpu_ids_and_lengths_cost_exactly_one_sync():
    cache = _filled_cache()
    ids, lens = _IDS.to(DEVICE), torch.tensor([1, 1, 0], device=DEVICE)
    inputs = _step_inputs(3)
    _decode(cache, ids, lens, inputs)
    # A process's first counted call can see one more sync: count a later call.
    count_host_syncs(lambda: _decode(cache, ids, lens, inputs))
    assert count_host_syncs(lambda: _decode(cache, ids, lens, inputs))[1] == 1
    assert count_host_syncs(lambda: _decode(cache, ids, None, inputs))[1] == 1
    host_lens = lens.cpu()
    assert count_host_syncs(lambda: _decode(cache, _IDS, host_lens, inputs))[1] == 0
    k, v = _randn(3, 1, HKV, D, seed=7), _randn(3, 1, HKV, D, seed=8)
    assert count_host_syncs(lambda: cache.append(k, v, ids, lens))[1] == 1
    assert count_host_syncs(lambda: cache.append(k, v, _IDS, host_lens))[1] == 0


def test_host_lengths_equal_the_device_state():
    a, b = _filled_cache(), KVCache(3, CAPACITY, HKV, D, dtype=DTYPE, device=DEVICE)
    _decode(a, _IDS)
    b.copy_prefix(0, 2, 1000, source=a)
    a.copy_prefix(3, 1)
    a.reset(torch.tensor([5], device=DEVICE))
    want_a = [1501, SPLIT + 2, SPLIT, SPLIT + 2, 65, 0]
    for cache, want in ((a, want_a), (b, [0, 0, 1000])):
        assert cache.host_lengths().tolist() == want
        device_lengths = cache.lengths
        assert device_lengths.device.type == "cuda" and device_lengths.tolist() == want
        # the storage agrees: written below each length, NaN from it on
        written = ~torch.isnan(cache.k[:, :, 0, 0].float())
        positions = torch.arange(CAPACITY, device=DEVICE)
        assert bool((written == (positions[None, :] < device_lengths[:, None])).all())


@pytest.mark.parametrize(
    "ids,lens,error,match",
    [
        ([4, 6, 0], None, IndexError, r"seq_ids\[1\] = 6 is outside"),
        ([4, 4, 0], None, ValueError, "must not repeat"),
        ([4, 3, 0], [1, 2, 1], ValueError, r"seqlens_new\[1\] = 2"),
    ],
)
def test_bad_gpu_ids_or_lengths_raise_before_writing(ids, lens, error, match):
    cache = _filled_cache()
    before = (cache.k.clone(), cache.v.clone(), cache.host_lengths())
    ids = torch.tensor(ids, device=DEVICE)
    lens = None if lens is None else torch.tensor(lens, device=DEVICE)
    with pytest.raises(error, match=match):
        _decode(cache, ids, lens)
    assert_bitwise_equal((cache.k, cache.v, cache.host_lengths()), before, name="cache")

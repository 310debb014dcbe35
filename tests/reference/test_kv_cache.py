"""KVCache bookkeeping: the host lengths, the index-based scatter, the explicit length API, and
errors that write nothing.  Expected storage is built by per-position Python loops here, not by
the cache's own code."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from batchinv.contract import assert_bitwise_equal
from batchinv.kv_cache import KVCache, host_index_copies

HKV, D = 2, 8


def randn(*shape: int, seed: int) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def expected_storage(batch, max_len, writes) -> Tensor:
    """NaN storage with ``writes``: (slot, position, key row [HKV, D]) applied in order."""
    out = torch.full((batch, max_len, HKV, D), float("nan"))
    for slot, pos, row in writes:
        out[slot, pos] = row
    return out


def test_padded_append_writes_exactly_the_kept_positions():
    cache = KVCache(4, 12, HKV, D, name="scatter cache")
    k, v = randn(3, 5, HKV, D, seed=1), randn(3, 5, HKV, D, seed=2)
    cache.append(k[:, :2], v[:, :2], torch.tensor([0, 2, 3]), torch.tensor([2, 0, 1]))
    cache.append(k, v, torch.tensor([3, 0, 1]), torch.tensor([4, 5, 3]))
    k_writes, v_writes = [], []
    schedule = [  # (slot, row of k/v the keys come from, start position, count)
        (0, 0, 0, 2),
        (3, 2, 0, 1),
        (3, 0, 1, 4),
        (0, 1, 2, 5),
        (1, 2, 0, 3),
    ]
    for slot, row, start, count in schedule:
        for t in range(count):
            k_writes.append((slot, start + t, k[row, t]))
            v_writes.append((slot, start + t, v[row, t]))
    assert cache.host_lengths().tolist() == [7, 3, 0, 5]
    assert_bitwise_equal(cache.k, expected_storage(4, 12, k_writes), name="k storage")
    assert_bitwise_equal(cache.v, expected_storage(4, 12, v_writes), name="v storage")


def test_lengths_is_a_copy_and_set_lengths_is_the_way_to_change_them():
    cache = KVCache(3, 10, HKV, D)
    cache.append(randn(3, 4, HKV, D, seed=3), randn(3, 4, HKV, D, seed=4))
    cache.lengths.fill_(9)  # a copy: no effect
    assert cache.lengths.tolist() == [4, 4, 4]
    cache.set_lengths(6)
    assert cache.host_lengths().tolist() == [6, 6, 6]
    cache.set_lengths(torch.tensor([2, 10], dtype=torch.int32), torch.tensor([2, 0]))
    assert cache.host_lengths().tolist() == [10, 6, 2]
    assert cache.host_lengths(torch.tensor([1, 2])).tolist() == [6, 2]
    assert cache.slot_lengths(torch.tensor([2, 0])).tolist() == [2, 10]


def test_lengths_follow_append_copy_prefix_reset_and_set_lengths():
    a = KVCache(3, 20, HKV, D, name="a")
    b = KVCache(2, 20, HKV, D, name="b")
    k, v = randn(3, 6, HKV, D, seed=5), randn(3, 6, HKV, D, seed=6)
    a.append(k, v, None, torch.tensor([6, 1, 4]))
    want_a, want_b = [6, 1, 4], [0, 0]
    a.append(randn(1, 3, HKV, D, seed=7), randn(1, 3, HKV, D, seed=8), torch.tensor([1]))
    want_a[1] += 3
    b.copy_prefix(0, 1, 5, source=a)
    want_b[1] = 5
    a.copy_prefix(2, 0)
    want_a[0] = want_a[2]
    a.reset(torch.tensor([2]))
    want_a[2] = 0
    b.set_lengths(7, torch.tensor([0]))
    want_b[0] = 7
    for cache, want in ((a, want_a), (b, want_b)):
        assert cache.host_lengths().tolist() == want, cache.name
        assert cache.lengths.tolist() == want, cache.name
        assert cache.read()[2].tolist() == want, cache.name
    # storage agrees with the lengths: written up to each length, NaN after (set_lengths aside)
    for slot, n in enumerate(want_a):
        assert not torch.isnan(a.k[slot, :n]).any() and torch.isnan(a.k[slot, n:]).all()


def test_append_returns_the_new_lengths_on_the_cache_device():
    cache = KVCache(2, 10, HKV, D)
    got = cache.append(randn(2, 3, HKV, D, seed=9), randn(2, 3, HKV, D, seed=10))
    assert got.device == cache.k.device and got.dtype == torch.int64 and got.tolist() == [3, 3]
    ids, grown = cache.append_host(
        randn(1, 2, HKV, D, seed=11), randn(1, 2, HKV, D, seed=12), torch.tensor([1])
    )
    assert (ids.device.type, grown.device.type) == ("cpu", "cpu")
    assert (ids.tolist(), grown.tolist()) == ([1], [5])
    grown.fill_(0)  # the returned lengths are the caller's copy
    assert cache.host_lengths().tolist() == [3, 5]


@pytest.mark.parametrize(
    "args,error,match",
    [
        (dict(seq_ids=torch.tensor([0, 3])), IndexError, r"seq_ids\[1\] = 3 is outside"),
        (dict(seq_ids=torch.tensor([1, 1])), ValueError, "must not repeat"),
        (dict(seq_ids=torch.tensor([0])), ValueError, "2 new rows given for 1"),
        (dict(seq_ids=torch.tensor([0.0, 1.0])), TypeError, "seq_ids must have dtype"),
        (dict(new_lengths=torch.tensor([1, 5])), ValueError, r"new_lengths\[1\] = 5 is outside"),
        (dict(new_lengths=torch.tensor([1])), ValueError, "one entry per appended row"),
        (dict(new_lengths=torch.tensor([[1, 1]])), ValueError, "new_lengths must have 1 dim"),
        (dict(new_lengths=torch.tensor([4, 1])), ValueError, r"sequence 0 .*max_len=6"),
    ],
)
def test_bad_append_raises_and_writes_nothing(args, error, match):
    cache = KVCache(3, 6, HKV, D, name="small cache")
    cache.append(randn(3, 3, HKV, D, seed=13), randn(3, 3, HKV, D, seed=14))
    before = (cache.k.clone(), cache.v.clone(), cache.host_lengths())
    seq_ids, new_lengths = args.get("seq_ids"), args.get("new_lengths")
    inputs = [t for t in (seq_ids, new_lengths) if t is not None]
    saved = [t.clone() for t in inputs]
    k, v = randn(2, 4, HKV, D, seed=15), randn(2, 4, HKV, D, seed=16)
    if seq_ids is None:
        seq_ids = torch.tensor([0, 1])
    with pytest.raises(error, match=match):
        cache.append(k, v, seq_ids, new_lengths)
    assert_bitwise_equal((cache.k, cache.v, cache.host_lengths()), before, name="cache")
    for t, s in zip(inputs, saved, strict=True):
        assert_bitwise_equal(t, s, name="caller's index tensor")


@pytest.mark.parametrize(
    "lengths,seq_ids,error,match",
    [
        (7, None, ValueError, r"lengths\[0\] = 7 is outside \[0, max_len=6\]"),
        (-1, None, ValueError, r"lengths\[0\] = -1"),
        (torch.tensor([1, 2]), torch.tensor([0]), ValueError, "one entry per slot"),
        (2.0, None, TypeError, "lengths must be an int or a tensor"),
        (True, None, TypeError, "lengths must be an int or a tensor"),
        (torch.tensor([1.0]), torch.tensor([0]), TypeError, "lengths must have dtype"),
        (1, torch.tensor([3]), IndexError, r"seq_ids\[0\] = 3"),
    ],
)
def test_bad_set_lengths_raises_and_changes_nothing(lengths, seq_ids, error, match):
    cache = KVCache(3, 6, HKV, D, name="small cache")
    cache.set_lengths(torch.tensor([1, 2, 3]))
    with pytest.raises(error, match=match):
        cache.set_lengths(lengths, seq_ids)
    assert cache.host_lengths().tolist() == [1, 2, 3]


def test_host_index_copies_are_int64_copies():
    ids32 = torch.tensor([2, 0], dtype=torch.int32)
    lens64 = torch.tensor([5])
    ids, lens, none = host_index_copies(a=ids32, b=lens64, c=None)
    assert (ids.dtype, ids.tolist(), lens.tolist(), none) == (torch.int64, [2, 0], [5], None)
    ids.fill_(7)
    lens.fill_(7)
    assert (ids32.tolist(), lens64.tolist()) == ([2, 0], [5])
    with pytest.raises(ValueError, match="a must have 1 dim"):
        host_index_copies(a=torch.zeros(2, 2, dtype=torch.int64))

"""The embedding backward's id sort (``embedding_sort_ids`` in ``kernels_cu/embedding.cu``),
played in Python on the CPU: the same keys ((id << 32) + position, an id outside
[0, vocab) as -1, padding keys INT64_MAX) through the same bitonic network give the order of
``torch.sort(stable=True)``, whatever the thread count.  The kernel itself:
tests/gpu/test_embedding_backward_nosync_cuda.py."""

from __future__ import annotations

import pytest
import torch

from batchinv.gpu import embedding as gpu_embedding

VOCAB = 50
INT64_MAX = 2**63 - 1


def _sort_kernel_on_cpu(ids: list[int], vocab: int, threads: int) -> tuple[list[int], list[int]]:
    """``embedding_sort_ids`` step by step: thread t handles indices t, t + threads, ... of
    each network stage (the swaps of one stage touch disjoint pairs, so the thread count does
    not change the result; it is played anyway)."""
    n = len(ids)
    count = max(2, 1 << (n - 1).bit_length())
    keys = [INT64_MAX] * count
    for i, raw in enumerate(ids):
        row = raw if 0 <= raw < vocab else -1
        keys[i] = row * 2**32 + i
    size = 2
    while size <= count:
        stride = size // 2
        while stride > 0:
            for thread in range(threads):
                for i in range(thread, count, threads):
                    partner = i ^ stride
                    if partner > i:
                        a, b = keys[i], keys[partner]
                        if (a > b) == ((i & size) == 0):
                            keys[i], keys[partner] = b, a
            stride //= 2
        size *= 2
    return [k >> 32 for k in keys[:n]], [k & 0xFFFFFFFF for k in keys[:n]]


@pytest.mark.parametrize("threads", (1, 4, 1024))
@pytest.mark.parametrize("n", (1, 2, 3, 7, 8, 9, 100, 257))
def test_the_network_gives_the_stable_sort(n, threads):
    gen = torch.Generator().manual_seed(n)
    ids = torch.randint(0, VOCAB, (n,), generator=gen)
    ids[::3] = 7  # repeats
    ids[1::17] = -5  # out of range on both sides
    ids[2::19] = VOCAB
    ids[4::23] = 2**40
    got_ids, got_positions = _sort_kernel_on_cpu(ids.tolist(), VOCAB, threads)
    valid = (ids >= 0) & (ids < VOCAB)
    want_ids, want_positions = torch.sort(torch.where(valid, ids, -1), stable=True)
    assert got_ids == want_ids.tolist()
    assert got_positions == want_positions.tolist()


def test_the_kernel_is_used_within_its_limits_only():
    limit = gpu_embedding.SORT_MAX_IDS
    assert limit * 8 <= 64 * 1024  # one CTA's keys in 64 KB of shared memory (HIP's LDS too)
    assert gpu_embedding.sort_ids_applies(1, VOCAB)
    assert gpu_embedding.sort_ids_applies(limit, 2**31)
    assert not gpu_embedding.sort_ids_applies(limit + 1, VOCAB)
    assert not gpu_embedding.sort_ids_applies(0, VOCAB)
    assert not gpu_embedding.sort_ids_applies(1, 2**31 + 1)

"""The embedding backward's sync-free segments (``gpu.embedding.static_segments``), built on
CPU: the runs of ``torch.unique_consecutive`` followed by empty padding segments, and, walked
the way the strided kernel walks them, the CPU reference's gradient bit for bit."""

from __future__ import annotations

import pytest
import torch

from batchinv.contract import assert_bitwise_equal
from batchinv.gpu import embedding as gpu_embedding
from batchinv.gpu.embedding import static_segments, strided_grid_x
from batchinv.reference.embedding import embedding_backward

VOCAB = 50
# (name, ids): repeats, out-of-range ids on both sides, one id, all equal, all distinct.
CASES = [
    (
        "random with repeats",
        torch.randint(0, VOCAB, (257,), generator=torch.Generator().manual_seed(0)),
    ),
    ("one id", torch.tensor([7])),
    ("one out-of-range id", torch.tensor([VOCAB])),
    ("all equal", torch.full((33,), 3)),
    ("all distinct", torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))),
    ("out of range", torch.tensor([5, -1, VOCAB, 5, 2**40, -(2**40), VOCAB, 0, VOCAB - 1, -1])),
    ("only out of range", torch.tensor([-3, VOCAB, VOCAB + 1, -3])),
]


def _unique_segments(sorted_ids):
    """What the synchronising path builds: one segment per distinct id."""
    segment_ids, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=offsets[1:])
    return offsets, segment_ids


@pytest.mark.parametrize("name, ids", CASES, ids=[name for name, _ in CASES])
def test_real_segments_are_unique_consecutives_then_empty_padding(name, ids):
    sorted_ids, _ = torch.sort(ids, stable=True)
    n = ids.numel()
    offsets, segment_ids = static_segments(sorted_ids, VOCAB)
    assert offsets.shape == (n + 1,) and segment_ids.shape == (n,)
    assert offsets.dtype == segment_ids.dtype == torch.int64
    want_offsets, want_ids = _unique_segments(sorted_ids)
    distinct = want_ids.numel()
    assert_bitwise_equal(offsets[: distinct + 1], want_offsets)
    assert_bitwise_equal(segment_ids[:distinct], want_ids)
    # the padding: empty (offset n) and an id the kernel never writes
    assert bool((offsets[distinct:] == n).all())
    assert bool((segment_ids[distinct:] == VOCAB).all())
    # every real segment is non-empty, so the first empty one marks the padding
    assert bool((offsets[1 : distinct + 1] > offsets[:distinct]).all())


@pytest.mark.parametrize("name, ids", CASES, ids=[name for name, _ in CASES])
def test_the_backwards_padded_buffer_gives_the_same_segments(name, ids):
    # The backward sorts into a buffer one longer and passes it: as padding a copy does.
    n = ids.numel()
    padded = torch.empty(n + 1, dtype=torch.int64)
    positions = torch.empty(n, dtype=torch.int64)
    torch.sort(ids, stable=True, out=(padded[:n], positions))
    padded[n:].fill_(VOCAB)
    sorted_ids, sorted_positions = torch.sort(ids, stable=True)
    assert_bitwise_equal((padded[:n], positions), (sorted_ids, sorted_positions))
    got = static_segments(padded[:n], VOCAB, padded_ids=padded)
    assert_bitwise_equal(got, static_segments(sorted_ids, VOCAB))


def test_int32_ids_widened_as_the_backward_does_give_the_same_segments():
    ids = torch.randint(-2, VOCAB + 2, (100,), generator=torch.Generator().manual_seed(2))
    wide, _ = torch.sort(ids.to(torch.int32).long(), stable=True)
    offsets, segment_ids = static_segments(wide, VOCAB)
    want_offsets, want_ids = _unique_segments(wide)
    assert_bitwise_equal(offsets[: want_offsets.numel()], want_offsets)
    assert_bitwise_equal(segment_ids[: want_ids.numel()], want_ids)


def test_empty_input_gives_one_offset_and_no_segment():
    offsets, segment_ids = static_segments(torch.zeros(0, dtype=torch.int64), VOCAB)
    assert offsets.tolist() == [0] and segment_ids.numel() == 0


def _strided_kernel_on_cpu(grad_rows, sorted_positions, offsets, segment_ids, vocab, grid_x):
    """``embedding_backward_strided`` in Python, CTA by CTA: CTA x walks segments x,
    x + grid_x, ... until the first empty one, skips ids outside [0, vocab), and sums each
    segment's rows in fp32 in sorted order (all columns at once: each column's adds are
    the kernel's), rounded once."""
    grad_weight = torch.zeros(vocab, grad_rows.shape[1], dtype=grad_rows.dtype)
    written = set()
    for cta in range(grid_x):
        for segment in range(cta, segment_ids.numel(), grid_x):
            begin, end = int(offsets[segment]), int(offsets[segment + 1])
            if begin >= end:
                break
            row = int(segment_ids[segment])
            if not 0 <= row < vocab:
                continue
            assert row not in written  # no two segments write one row
            written.add(row)
            total = torch.zeros(grad_rows.shape[1], dtype=torch.float32)
            for k in range(begin, end):
                total = total + grad_rows[sorted_positions[k]].float()
            grad_weight[row] = total.to(grad_rows.dtype)
    return grad_weight


@pytest.mark.parametrize("grid_x", (1, 3, 1000))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("name, ids", CASES, ids=[name for name, _ in CASES])
def test_strided_walk_of_the_segments_is_the_reference_gradient(name, ids, dtype, grid_x):
    gen = torch.Generator().manual_seed(3)
    grad = torch.randn(ids.numel(), 5, generator=gen).to(dtype)
    sorted_ids, sorted_positions = torch.sort(ids, stable=True)
    offsets, segment_ids = static_segments(sorted_ids, VOCAB)
    got = _strided_kernel_on_cpu(grad, sorted_positions, offsets, segment_ids, VOCAB, grid_x)
    assert_bitwise_equal(got, embedding_backward(ids, grad, VOCAB, dtype))


def test_strided_grid_covers_the_segments_within_a_fixed_cta_budget():
    assert strided_grid_x(1, 4096) == 1
    assert strided_grid_x(1024, 4096) == 1024  # 32 column blocks x 1024 = the budget
    assert strided_grid_x(16384, 4096) == 1024
    assert strided_grid_x(16384, 128) == 16384
    assert strided_grid_x(10**6, 2**24) == 1  # more column blocks than the budget


def test_unknown_segments_mode_is_rejected_before_any_work():
    with pytest.raises(ValueError, match="segments must be 'static' or 'unique', not 'dynamic'"):
        gpu_embedding.backward(torch.tensor([1]), torch.ones(1, 4), 10, torch.float32, "dynamic")

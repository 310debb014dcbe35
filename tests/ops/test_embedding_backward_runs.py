"""The embedding backward's sync-free walk (``embedding_backward_runs`` in
``kernels_cu/embedding.cu``), played in Python CTA by CTA on the CPU: over the stable sort's
ids and positions, with any grid, it writes the CPU reference's gradient bit for bit, each
row once, nothing for an out-of-range id.  The kernel itself: tests/gpu/
test_embedding_backward_nosync_cuda.py."""

from __future__ import annotations

import pytest
import torch

from batchinv.contract import assert_bitwise_equal
from batchinv.gpu import embedding as gpu_embedding
from batchinv.gpu.embedding import runs_grid_x
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


def _runs_kernel_on_cpu(grad_rows, sorted_ids, sorted_positions, vocab, grid_x):
    """``embedding_backward_runs`` in Python, CTA by CTA: CTA x walks the sorted positions x,
    x + grid_x, ...; at a run's first position (the first one, or a new id) it finds the
    run's end, skips ids outside [0, vocab), and sums the run's rows in fp32 in sorted order
    (all columns at once: each column's adds are the kernel's), rounded once."""
    grad_weight = torch.zeros(vocab, grad_rows.shape[1], dtype=grad_rows.dtype)
    ids = sorted_ids.tolist()
    n = len(ids)
    written = []
    for cta in range(grid_x):
        for begin in range(cta, n, grid_x):
            row = ids[begin]
            if begin > 0 and ids[begin - 1] == row:
                continue
            if not 0 <= row < vocab:
                continue
            end = begin + 1
            while end < n and ids[end] == row:
                end += 1
            written.append(row)
            total = torch.zeros(grad_rows.shape[1], dtype=torch.float32)
            for k in range(begin, end):
                total = total + grad_rows[sorted_positions[k]].float()
            grad_weight[row] = total.to(grad_rows.dtype)
    return grad_weight, written


@pytest.mark.parametrize("grid_x", (1, 3, 1000))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("name, ids", CASES, ids=[name for name, _ in CASES])
def test_the_walk_of_the_runs_is_the_reference_gradient(name, ids, dtype, grid_x):
    gen = torch.Generator().manual_seed(3)
    grad = torch.randn(ids.numel(), 5, generator=gen).to(dtype)
    sorted_ids, sorted_positions = torch.sort(ids, stable=True)
    got, written = _runs_kernel_on_cpu(grad, sorted_ids, sorted_positions, VOCAB, grid_x)
    assert_bitwise_equal(got, embedding_backward(ids, grad, VOCAB, dtype))
    # each in-range id's row written exactly once (no two runs of one id, no race)
    in_range = sorted({i for i in ids.tolist() if 0 <= i < VOCAB})
    assert sorted(written) == in_range


def test_int32_ids_widened_as_the_backward_does_give_the_same_walk():
    ids = torch.randint(-2, VOCAB + 2, (100,), generator=torch.Generator().manual_seed(2))
    grad = torch.randn(100, 3, generator=torch.Generator().manual_seed(4))
    sorted_ids, sorted_positions = torch.sort(ids.to(torch.int32).long(), stable=True)
    got, _ = _runs_kernel_on_cpu(grad, sorted_ids, sorted_positions, VOCAB, 7)
    assert_bitwise_equal(got, embedding_backward(ids, grad, VOCAB, torch.float32))


def test_runs_grid_covers_the_ids_within_a_fixed_cta_budget():
    assert runs_grid_x(1, 4096) == 1
    assert runs_grid_x(1024, 4096) == 1024  # 32 column blocks x 1024 = the budget
    assert runs_grid_x(16384, 4096) == 1024
    assert runs_grid_x(16384, 128) == 16384
    assert runs_grid_x(10**6, 2**24) == 1  # more column blocks than the budget


def test_unknown_segments_mode_is_rejected_before_any_work():
    with pytest.raises(ValueError, match="segments must be 'static' or 'unique', not 'dynamic'"):
        gpu_embedding.backward(torch.tensor([1]), torch.ones(1, 4), 10, torch.float32, "dynamic")

"""The tolerance table bites on the GPU: each mutant of tests/_mutants.py wraps the CUDA op at
Qwen3-8B shapes (the 151936-column vocabulary, a 2304-key context, K = 12288) and fails the
op's entry, while the op itself passes it (the CPU twin: tests/contract/test_mutants.py)."""

from __future__ import annotations

import pytest
import torch

from _mutants import GPU_SIZES, MUTANTS, judged_dtype
from batchinv.contract import assert_within_tolerance

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
DTYPES = (torch.bfloat16, torch.float16)  # the CUDA kernels' dtypes (fp32 stays on the CPU)


def _check(op, reference, actual, input_dtype, label):
    assert_within_tolerance(
        actual, reference, op=op, dtype=judged_dtype(op, input_dtype, actual), name=label
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_the_cuda_op_passes_and_the_mutant_fails(mutant, dtype):
    op, make_inputs, reference_fn, op_fn, mutant_fn = MUTANTS[mutant]
    inputs = make_inputs(GPU_SIZES, dtype, DEVICE)
    with torch.no_grad():
        reference = reference_fn(*inputs)
        _check(op, reference, op_fn(*inputs), dtype, "op")
        mutated = mutant_fn(*inputs)
    with pytest.raises(AssertionError, match="elements outside"):
        _check(op, reference, mutated, dtype, mutant)

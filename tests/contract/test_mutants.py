"""The tolerance table bites: plausible bugs, injected by wrapping the op (tests/_mutants.py),
fail the op's entry, and the op itself passes it.  CPU tensors: the op is the reference
path; tests/gpu/test_mutants_cuda.py runs the same mutants around the CUDA kernels."""

from __future__ import annotations

import pytest
import torch

from _mutants import CPU_SIZES, MUTANTS, judged_dtype
from batchinv.contract import assert_within_tolerance

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check(op, reference, actual, input_dtype, label):
    assert_within_tolerance(
        actual, reference, op=op, dtype=judged_dtype(op, input_dtype, actual), name=label
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_the_op_passes_and_the_mutant_fails(mutant, dtype):
    op, make_inputs, reference_fn, op_fn, mutant_fn = MUTANTS[mutant]
    inputs = make_inputs(CPU_SIZES, dtype, "cpu")
    with torch.no_grad():
        reference = reference_fn(*inputs)
        _check(op, reference, op_fn(*inputs), dtype, "op")
        mutated = mutant_fn(*inputs)
    with pytest.raises(AssertionError, match="elements outside"):
        _check(op, reference, mutated, dtype, mutant)

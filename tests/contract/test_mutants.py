"""The tolerance table bites: plausible bugs, injected by wrapping the op (tests/_mutants.py),
fail the op's entry (its forward values; for GRAD_MUTANTS its input gradients), and the op
itself passes it.  CPU tensors: the op is the reference path; tests/gpu/test_mutants_cuda.py
runs the same mutants around the CUDA kernels."""

from __future__ import annotations

import pytest
import torch

from _mutants import (
    CPU_SIZES,
    GRAD_MUTANTS,
    MUTANTS,
    assert_grads_pass_and_mutant_fails,
    assert_op_passes_and_mutant_fails,
)

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_the_op_passes_and_the_mutant_fails(mutant, dtype):
    assert_op_passes_and_mutant_fails(mutant, dtype, CPU_SIZES, "cpu")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mutant", list(GRAD_MUTANTS))
def test_the_op_grads_pass_and_the_mutant_fails(mutant, dtype):
    assert_grads_pass_and_mutant_fails(mutant, dtype, CPU_SIZES, "cpu")

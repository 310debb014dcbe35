"""The tolerance table bites on the GPU: each mutant of tests/_mutants.py wraps the CUDA op at
Qwen3-8B shapes (the 151936-column vocabulary, a 2304-key context, K = 12288) and fails the
op's entry, while the op itself passes it (the CPU twin: tests/contract/test_mutants.py)."""

from __future__ import annotations

import pytest
import torch

from _mutants import (
    GPU_SIZES,
    GRAD_MUTANTS,
    MUTANTS,
    assert_grads_pass_and_mutant_fails,
    assert_op_passes_and_mutant_fails,
)

pytestmark = pytest.mark.cuda

DTYPES = (torch.bfloat16, torch.float16)  # the CUDA kernels' dtypes (fp32 stays on the CPU)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_the_cuda_op_passes_and_the_mutant_fails(mutant, dtype):
    assert_op_passes_and_mutant_fails(mutant, dtype, GPU_SIZES, "cuda")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mutant", list(GRAD_MUTANTS))
def test_the_cuda_op_grads_pass_and_the_mutant_fails(mutant, dtype):
    assert_grads_pass_and_mutant_fails(mutant, dtype, GPU_SIZES, "cuda")

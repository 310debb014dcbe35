"""batchinv.lm_head on CPU: the public op, its registry entries and its torch custom op."""

from __future__ import annotations

import pytest
import torch

import batchinv
from batchinv.contract import assert_bitwise_equal
from batchinv.reference.linear import linear_fp32


def _inputs(bias: bool, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 3, 16, generator=gen).to(dtype)
    weight = torch.randn(11, 16, generator=gen).to(dtype)
    return hidden, weight, torch.randn(11, generator=gen).to(dtype) if bias else None


@pytest.mark.parametrize("bias", (False, True))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_lm_head_is_linear_and_fp32_is_the_strict_reference(bias, dtype):
    hidden, weight, b = _inputs(bias, dtype)
    out = batchinv.lm_head(hidden, weight, b)
    assert out.shape == (2, 3, 11) and out.dtype == dtype
    assert_bitwise_equal(out, batchinv.linear(hidden, weight, b))
    strict = batchinv.lm_head_fp32(hidden, weight, b)
    assert strict.dtype == torch.float32
    assert_bitwise_equal(strict, linear_fp32(hidden, weight, b))


def test_registry_entries():
    ops = batchinv.registry.registered_ops()
    assert ops["lm_head"] == ("cpu", "cuda", "hip")
    assert ops["lm_head.fp32"] == ("cpu", "cuda", "hip")


def test_bad_input_is_rejected_before_dispatch():
    hidden, weight, _ = _inputs(False)
    with pytest.raises(ValueError, match="weight.shape\\[1\\]"):
        batchinv.lm_head(hidden, weight[:, :8])
    with pytest.raises(ValueError, match="weight.shape\\[1\\]"):
        batchinv.lm_head_fp32(hidden, weight[:, :8])


@pytest.mark.parametrize("bias", (False, True))
def test_custom_op_passes_opcheck_and_gives_the_eager_bits_and_gradients(bias):
    hidden, weight, b = (t.requires_grad_() if t is not None else None for t in _inputs(bias))
    args = (hidden, weight, b)
    torch.library.opcheck(torch.ops.batchinv.lm_head.default, args)
    grad = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(1))
    leaves = [t for t in args if t is not None]

    def run(fn):
        out = fn(*args)
        grads = torch.autograd.grad(out, leaves, grad)
        return out, grads

    custom_out, custom_grads = run(torch.ops.batchinv.lm_head)
    eager_out, eager_grads = run(batchinv.lm_head)
    assert_bitwise_equal(custom_out, eager_out)
    for got, want in zip(custom_grads, eager_grads, strict=True):
        assert_bitwise_equal(got, want)


def test_compiles_fullgraph_with_eager_bits():
    hidden, weight, _ = _inputs(False)
    compiled = torch.compile(batchinv.lm_head, fullgraph=True, backend="eager")
    assert_bitwise_equal(compiled(hidden, weight), batchinv.lm_head(hidden, weight))

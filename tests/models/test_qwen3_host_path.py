"""The host-path shortcuts of the batchinv op table (CPU side; the GPU side, where they matter,
is tests/gpu/test_qwen3_host_path_cuda.py): ops without gradients skip the autograd node with
the same bits, and the RoPE position check is remembered per position tensor only while that
tensor is unmodified."""

from __future__ import annotations

import pytest
import torch

import batchinv
from batchinv.contract import assert_bitwise_equal
from batchinv.models.qwen3 import ops as model_ops
from batchinv.reference.qwen3_chain import REFERENCE_OPS


def _linear_args(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 24, generator=gen).to(dtype)
    w = torch.randn(16, 24, generator=gen).to(dtype).requires_grad_()
    b = torch.randn(16, generator=gen).to(dtype).requires_grad_()
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_without_grad_has_no_node_and_the_same_bits(dtype):
    x, w, b = _linear_args(dtype)
    with_grad = batchinv.linear(x, w, b)
    assert with_grad.grad_fn is not None
    with torch.no_grad():
        without = batchinv.linear(x, w, b)
    assert without.grad_fn is None
    assert_bitwise_equal(without, with_grad.detach())


def test_linear_bad_input_still_raises_without_grad():
    x, w, b = _linear_args()
    with torch.no_grad(), pytest.raises(ValueError, match="x.shape"):
        batchinv.linear(x[..., :20], w, b)
    with torch.no_grad(), pytest.raises(TypeError, match="weight"):
        batchinv.linear(x, w.double(), b)


def test_embedding_without_grad_has_no_node_and_the_same_bits():
    weight = torch.randn(40, 8).requires_grad_()
    ids = torch.tensor([[3, 0, 39], [7, 7, 1]])
    with_grad = batchinv.embedding(ids, weight)
    with torch.no_grad():
        without = batchinv.embedding(ids, weight)
        with pytest.raises(IndexError, match="ids"):
            batchinv.embedding(torch.tensor([1, 40]), weight)
    assert without.grad_fn is None
    assert_bitwise_equal(without, with_grad.detach())


def test_residual_add_on_the_cpu_is_the_reference():
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(4, 32, generator=gen).bfloat16()
    delta = torch.randn(4, 32, generator=gen).bfloat16()
    got = model_ops.BATCHINV_OPS.residual_add(h, delta)
    assert_bitwise_equal(got, REFERENCE_OPS.residual_add(h, delta))


def test_checked_positions_hold_only_for_the_same_unmodified_tensor():
    memo = model_ops._CheckedPositions()
    positions = torch.arange(6).reshape(2, 3)
    assert not memo.holds(positions, 100)
    memo.remember(positions, 100)
    assert memo.holds(positions, 100)
    assert not memo.holds(positions, 50)  # another bound: checked again
    assert not memo.holds(positions.clone(), 100)  # another tensor with the same values
    positions[0, 0] = 99  # an in-place write bumps the version counter
    assert not memo.holds(positions, 100)
    memo.remember(positions, 100)
    positions.view(-1)[1] = 5  # a write through a view too
    assert not memo.holds(positions, 100)


def test_inference_tensors_are_never_remembered():
    memo = model_ops._CheckedPositions()
    with torch.inference_mode():
        positions = torch.arange(4)
    memo.remember(positions, 100)
    assert not memo.holds(positions, 100)


def test_rope_of_the_table_still_raises_for_a_bad_position():
    q = torch.randn(1, 3, 2, 8)
    k = torch.randn(1, 3, 1, 8)
    positions = torch.tensor([[0, 1, 2]])
    kwargs = dict(theta=10000.0, head_dim=8, max_position=3)
    model_ops.BATCHINV_OPS.rope(q, k, positions, **kwargs)
    positions[0, 2] = 3
    with pytest.raises(IndexError, match="position_ids"):
        model_ops.BATCHINV_OPS.rope(q, k, positions, **kwargs)

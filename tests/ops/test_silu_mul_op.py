"""batchinv.silu_mul / silu_mul_fused on CPU: the registry, the reference path, autograd,
the module, bad input; and the GPU tiling, which must cover every element."""

from __future__ import annotations

import pytest
import torch

import batchinv
from batchinv import registry
from batchinv.contract import assert_bitwise_equal
from batchinv.gpu import silu_mul as gpu_silu_mul
from batchinv.reference import silu_mul as reference

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def test_every_backend_is_registered():
    ops = registry.registered_ops()
    assert ops["silu_mul"] == ("cpu", "cuda", "hip")
    assert ops["silu_mul_fused"] == ("cpu", "cuda", "hip")


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_forward_and_gradients_are_the_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    gate, up, grad = (torch.randn(3, 4, 21, generator=gen).to(dtype) for _ in range(3))
    assert_bitwise_equal(batchinv.silu_mul(gate, up), reference.silu_mul(gate, up))
    gl, ul = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
    batchinv.silu_mul(gl, ul).backward(grad)
    grad_gate, grad_up = reference.silu_mul_backward(grad, gate, up)
    assert_bitwise_equal(gl.grad, grad_gate)
    assert_bitwise_equal(ul.grad, grad_up)
    fused = torch.cat((gate, up), dim=-1)
    assert_bitwise_equal(batchinv.silu_mul_fused(fused), reference.silu_mul_fused(fused))


def test_module_takes_either_layout():
    module = batchinv.nn.SiluMul()
    gate, up = torch.randn(2, 5), torch.randn(2, 5)
    assert_bitwise_equal(module(gate, up), batchinv.silu_mul(gate, up))
    assert_bitwise_equal(module(torch.cat((gate, up), -1)), batchinv.silu_mul(gate, up))


def test_bad_input_names_the_argument():
    gate = torch.randn(2, 6)
    with pytest.raises(ValueError, match="up must have the shape of gate"):
        batchinv.silu_mul(gate, gate[:, :3])
    with pytest.raises(TypeError, match="up has dtype"):
        batchinv.silu_mul(gate, gate.bfloat16())
    with pytest.raises(ValueError, match="up is on meta but gate is on cpu"):
        batchinv.silu_mul(gate, gate.to("meta"))
    with pytest.raises(ValueError, match="gate_up must have an even"):
        batchinv.silu_mul_fused(gate[:, :5])
    with pytest.raises(TypeError, match="gate_up must have dtype"):
        batchinv.silu_mul_fused(gate.long())


def test_gpu_tiling_covers_every_element_once():
    for inter in [1, 3, 8, 111, 2047, 2048, 4096, 8191, 8192, 8193, 12288, 14336, 20000, 100000]:
        grid, tiles, tile = gpu_silu_mul._tiling(7, inter)
        assert grid == 7 * tiles
        assert tile % gpu_silu_mul.TILE_QUANTUM == 0 and tile <= max(
            gpu_silu_mul.MAX_TILE_ELEMENTS, gpu_silu_mul.TILE_QUANTUM
        )
        assert (tiles - 1) * tile < inter <= tiles * tile

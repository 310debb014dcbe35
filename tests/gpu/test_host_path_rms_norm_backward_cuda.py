"""``rms_norm``'s kept backward launches give the general path's bits on the GPU: the row
kernel's grad_x and the separate weight gradient, with and without the fused form's residual
gradient, eager, through autograd and replayed from a CUDA graph.  The host logic is
``tests/ops/test_host_path_rms_norm_backward.py``'s."""

from __future__ import annotations

import pytest
import torch

import batchinv
from _streams import capture_graph
from batchinv.contract import assert_bitwise_equal
from batchinv.gpu import rms_norm as gpu_rms_norm

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
SHAPES = [(1024, 4096, torch.bfloat16), (1024, 4096, torch.float16), (37, 200, torch.float32)]


def _case(rows, d, dtype, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(rows, d, device=DEVICE, generator=gen).to(dtype)
    grad = torch.randn(rows, d, device=DEVICE, generator=gen).to(dtype)
    extra = torch.randn(rows, d, device=DEVICE, generator=gen).to(dtype)
    weight = (torch.rand(d, device=DEVICE, generator=gen) + 0.5).to(dtype)
    rstd = torch.rand(rows, device=DEVICE, generator=gen) + 0.5
    return x, grad, extra, weight, rstd


def _general(monkeypatch, *args, **options):
    with monkeypatch.context() as patch:
        patch.setattr(gpu_rms_norm, "_lean_backward", lambda *a: None)
        return gpu_rms_norm.backward(*args, **options)


@pytest.mark.parametrize(("rows", "d", "dtype"), SHAPES)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("weight_grad", [True, False])
def test_kept_backward_gives_the_general_path_bits(
    rows, d, dtype, residual, weight_grad, monkeypatch
):
    x, grad, extra, weight, rstd = _case(rows, d, dtype)
    extra = extra if residual else None
    gpu_rms_norm._LEAN_BACKWARD.clear()
    want = _general(monkeypatch, grad, x, weight, rstd, extra, weight_grad=weight_grad)
    for call in ("first", "kept"):
        got = gpu_rms_norm.backward(grad, x, weight, rstd, extra, weight_grad=weight_grad)
        assert_bitwise_equal(got[0], want[0], name=f"grad_x {call}")
        if weight_grad:
            assert_bitwise_equal(got[1], want[1], name=f"grad_weight {call}")
        else:
            assert got[1] is None
    assert None not in gpu_rms_norm._LEAN_BACKWARD.values()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autograd_takes_the_kept_launches_with_the_general_bits(dtype, monkeypatch):
    x, grad, _, weight, _ = _case(1024, 4096, dtype)
    x.requires_grad_(True)
    weight.requires_grad_(True)
    gpu_rms_norm._LEAN_BACKWARD.clear()
    got = torch.autograd.grad(batchinv.rms_norm(x, weight, 1e-6), (x, weight), grad)
    assert len(gpu_rms_norm._LEAN_BACKWARD) == 1
    with monkeypatch.context() as patch:
        patch.setattr(gpu_rms_norm, "_lean_backward", lambda *a: None)
        want = torch.autograd.grad(batchinv.rms_norm(x, weight, 1e-6), (x, weight), grad)
    assert_bitwise_equal(list(got), list(want), name="autograd")


def test_kept_backward_replays_in_a_cuda_graph(monkeypatch):
    x, grad, _, weight, rstd = _case(1024, 4096, torch.bfloat16)
    gpu_rms_norm.backward(grad, x, weight, rstd)  # the plan, made outside the capture
    graph, captured = capture_graph(lambda: gpu_rms_norm.backward(grad, x, weight, rstd))
    grad.copy_(torch.randn_like(grad.float()).to(grad.dtype))
    graph.replay()
    torch.cuda.synchronize()
    want = _general(monkeypatch, grad, x, weight, rstd)
    assert_bitwise_equal(list(captured), list(want), name="replay")

"""``batchinv.rms_norm`` and ``batchinv.fused_add_rms_norm``: batch-invariant RMSNorm.

On the CPU the op is the reference (``batchinv.reference.rms_norm``, fixed left-to-right
order).  On CUDA/HIP it is ``kernels_cu/rms_norm.cu``: a row is reduced by a fixed tree whose
shape depends only on the row length, so a row's output and input gradient are bitwise the
same in any batch; the weight gradient is a fixed-order (no atomics) sum, bitwise the same run
to run.  The two backends compute the same function (within the contract's tolerance), not
the same bits: their reduction orders differ.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import registry
from ..gpu import rms_norm as gpu
from ..reference import rms_norm as reference


class _RMSNormGPU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        y, rstd = gpu.forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        x, weight, rstd = ctx.saved_tensors
        need_x, need_weight, _ = ctx.needs_input_grad
        grad_x, grad_weight = gpu.backward(grad_y, x, weight, rstd, weight_grad=need_weight)
        return (grad_x if need_x else None), grad_weight, None


class _FusedAddRMSNormGPU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, residual: Tensor, weight: Tensor, eps: float):
        y, new_residual, rstd = gpu.fused_add_forward(x, residual, weight, eps)
        ctx.save_for_backward(new_residual, weight, rstd)
        return y, new_residual

    @staticmethod
    def backward(ctx, grad_y: Tensor, grad_new_residual: Tensor):
        new_residual, weight, rstd = ctx.saved_tensors
        need_weight = ctx.needs_input_grad[2]
        # As in the reference: the gradient reaching new_residual from both outputs is summed
        # in fp32 (inside the kernel) and rounded once; it is the gradient of x and residual.
        grad_h, grad_weight = gpu.backward(
            grad_y, new_residual, weight, rstd, grad_new_residual, weight_grad=need_weight
        )
        return grad_h, grad_h.clone(), grad_weight, None


def _gpu_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return _RMSNormGPU.apply(x, weight, eps)


def _gpu_fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float):
    return _FusedAddRMSNormGPU.apply(x, residual, weight, eps)


for _backend in ("cuda", "hip"):
    registry.register("rms_norm", _backend)(_gpu_rms_norm)
    registry.register("fused_add_rms_norm", _backend)(_gpu_fused_add_rms_norm)
registry.register("rms_norm", "cpu")(reference.rms_norm)
registry.register("fused_add_rms_norm", "cpu")(reference.fused_add_rms_norm)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``x / sqrt(mean(x^2 over the last dim) + eps) * weight``, fp32 inside, x's dtype out.

    ``x: [..., d]`` in bf16/fp16/fp32 (any leading shape and strides: the per-head q/k norm
    is ``x: [..., heads, head_dim]``, ``weight: [head_dim]``); ``weight: [d]`` of x's dtype;
    ``eps`` a Python float > 0 (also in fp32).  Differentiable in x and weight.  Bad input
    raises TypeError/ValueError naming the argument; inputs are never modified.
    """
    reference.check_rms_norm_args(x, weight, eps)
    return registry.lookup("rms_norm", x.device)(x, weight, eps)


def fused_add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """``(rms_norm(new_residual, weight, eps), new_residual)``, ``new_residual = x + residual``
    added in fp32 and rounded once to x's dtype (the norm reads the rounded value).

    Returns new tensors (x and residual are not updated in place).  Differentiable; the
    gradient of x and of residual is the same tensor's values.
    """
    reference.check_fused_add_rms_norm_args(x, residual, weight, eps)
    return registry.lookup("fused_add_rms_norm", x.device)(x, residual, weight, eps)

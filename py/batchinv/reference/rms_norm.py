"""RMSNorm and fused residual-add + RMSNorm (Qwen3), the strict references.

``y = x / sqrt(mean(x^2 over the last dim) + eps) * weight``, one row per index of the
leading dimensions, so the per-head q/k norm (``x: [..., heads, head_dim]``,
``weight: [head_dim]``) is the same op.

Arithmetic of the low-precision path (bf16/fp16/fp32 in, the same dtype out), all in fp32:

1. ``sum_sq = x[0]^2 + x[1]^2 + ... + x[d-1]^2``: each square rounded to fp32, then added left
   to right, one rounding per add (``fixed_order_sum``).  The order is a function of ``d``
   alone, so a row's sum is the same whatever rows surround it: this is why the op is
   batch invariant by construction (torch's ``sum``/``mean`` would pick a blocking from the
   shape of the whole tensor).
2. ``mean_sq = sum_sq / d``; ``inv_rms = 1 / sqrt(mean_sq + eps)`` with ``eps`` rounded to
   fp32 and the square root the IEEE (correctly rounded) fp32 one.  torch's fp32 ``sqrt`` on
   x86 CPUs goes through MKL VML and is one ulp off for about 17% of random inputs, so
   the square root is taken in float64 and rounded to fp32, which is exactly the correctly
   rounded fp32 result (double rounding is harmless for sqrt as 53 >= 2 * 24 + 2).  On CUDA the
   same value is ``__fdiv_rn(1.0f, __fsqrt_rn(v))`` (two IEEE operations, no ``rsqrtf``).
3. ``y = (x * inv_rms) * weight``, two fp32 products, then one rounding to the input dtype.

Hugging Face's ``Qwen3RMSNorm`` differs in where it rounds: it computes ``x * rsqrt(var + eps)``
in fp32, rounds that to the input dtype, and multiplies by ``weight`` in the weight's dtype
(a second rounding for bf16/fp16).  In fp32 the two differ only by the order of the mean
and ``rsqrt`` vs ``1 / sqrt`` (a few ulp).

Backward, all in fp32 from the saved inputs (``inv_rms`` recomputed with the same bits):
``x_hat = x * inv_rms``, ``gw = grad_y * weight``,
``grad_x = inv_rms * (gw - x_hat * (sum(gw * x_hat) / d))`` with the sum in fixed order over
the row (per row, so batch invariant like the forward), rounded once to x's dtype.
``grad_weight = sum over rows of grad_y * x_hat`` is a reduction over the whole batch: the
reference adds the rows in increasing row-major index of x's leading dimensions, in fp32,
and rounds once to weight's dtype.  That is bitwise reproducible run to run and independent
of how the leading dimensions are shaped, but it depends on which rows are in the batch (it is
their sum); rows whose ``grad_y`` is zero (masked padding) add exactly zero and leave it unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..contract import deterministic_context
from ..validation import (
    FLOAT_DTYPES,
    check_eps,
    check_fused_add_rms_norm_args,
    check_rms_norm_args,
    check_tensor,
)
from ._fixed_order import fixed_order_sum

SUPPORTED_DTYPES = FLOAT_DTYPES
QWEN3_RMS_NORM_EPS = 1e-6


def _ieee_sqrt(v: Tensor) -> Tensor:
    """Correctly rounded fp32 square root (see the module docstring)."""
    return torch.sqrt(v.double()).float()


def _inv_rms(x32: Tensor, eps: float) -> Tensor:
    """``1 / sqrt(mean(x^2) + eps)`` per row in fp32, shape ``x.shape[:-1] + (1,)``."""
    sum_sq = fixed_order_sum(x32 * x32, dim=-1)
    mean_sq = sum_sq / x32.shape[-1]
    return _ieee_sqrt(mean_sq + torch.tensor(eps, dtype=torch.float32)).reciprocal().unsqueeze(-1)


def _forward32(x32: Tensor, w32: Tensor, eps: float) -> Tensor:
    return (x32 * _inv_rms(x32, eps)) * w32


def _backward32(g32: Tensor, x32: Tensor, w32: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """fp32 ``(grad_x, grad_weight)``; grad_weight sums rows in increasing row-major index."""
    hidden = x32.shape[-1]
    inv_rms = _inv_rms(x32, eps)
    x_hat = x32 * inv_rms
    gw = g32 * w32
    mean_gw_xhat = (fixed_order_sum(gw * x_hat, dim=-1) / hidden).unsqueeze(-1)
    grad_x = inv_rms * (gw - x_hat * mean_gw_xhat)
    grad_weight = fixed_order_sum((g32 * x_hat).reshape(-1, hidden), dim=0)
    return grad_x, grad_weight


def rms_norm_backward(
    grad_y: Tensor, x: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """``(grad_x, grad_weight)`` in x's and weight's dtypes (fp32 inside, one rounding each)."""
    check_rms_norm_args(x, weight, eps)
    check_tensor("grad_y", grad_y, dtypes=(x.dtype,))
    if grad_y.shape != x.shape:
        raise ValueError(
            f"grad_y must have the shape of x {tuple(x.shape)}, got {tuple(grad_y.shape)}"
        )
    grad_x, grad_weight = _backward32(grad_y.float(), x.float(), weight.float(), eps)
    return grad_x.to(x.dtype), grad_weight.to(weight.dtype)


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return _forward32(x.float(), weight.float(), eps).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        x, weight = ctx.saved_tensors
        grad_x, grad_weight = _backward32(grad_y.float(), x.float(), weight.float(), ctx.eps)
        return grad_x.to(x.dtype), grad_weight.to(weight.dtype), None


class _FusedAddRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, residual: Tensor, weight: Tensor, eps: float):
        # fp32 add then one rounding: the correctly rounded sum for bf16/fp16, and what a
        # trainer stores as the residual stream.
        new_residual = (x.float() + residual.float()).to(x.dtype)
        ctx.save_for_backward(new_residual, weight)
        ctx.eps = eps
        y = _forward32(new_residual.float(), weight.float(), eps).to(x.dtype)
        return y, new_residual

    @staticmethod
    def backward(ctx, grad_y: Tensor, grad_new_residual: Tensor):
        new_residual, weight = ctx.saved_tensors
        grad_h, grad_weight = _backward32(
            grad_y.float(), new_residual.float(), weight.float(), ctx.eps
        )
        # Both paths into new_residual are summed in fp32 and rounded once.
        grad_h = (grad_h + grad_new_residual.float()).to(new_residual.dtype)
        return grad_h, grad_h.clone(), grad_weight.to(weight.dtype), None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Low-precision path: RMSNorm over the last dim in fp32, one rounding to x's dtype.

    ``x: [..., d]`` (any leading shape, zero rows allowed: the result is then empty),
    ``weight: [d]`` of x's dtype; differentiable with the fixed-order backward.
    """
    check_rms_norm_args(x, weight, eps)
    return _RMSNormFunction.apply(x, weight, eps)


def rms_norm_fp32(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Strict fp32 path: the same definition on upcast inputs, returned in fp32."""
    check_rms_norm_args(x, weight, eps)
    with deterministic_context():
        return _RMSNormFunction.apply(x.float(), weight.float(), eps)


def fused_add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """``(rms_norm(new_residual), new_residual)`` with ``new_residual = x + residual``.

    ``new_residual`` is rounded to the input dtype and the norm reads the rounded value, as
    a trainer that stores the residual stream in bf16 would.  In the backward, the gradient
    reaching ``new_residual`` from both outputs is summed in fp32 and rounded once; it is
    the gradient of both ``x`` and ``residual``.
    """
    check_fused_add_rms_norm_args(x, residual, weight, eps)
    return _FusedAddRMSNormFunction.apply(x, residual, weight, eps)


def fused_add_rms_norm_fp32(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """Strict fp32 path: the residual sum stays in fp32 (no rounding to the input dtype)."""
    check_fused_add_rms_norm_args(x, residual, weight, eps)
    with deterministic_context():
        return _FusedAddRMSNormFunction.apply(x.float(), residual.float(), weight.float(), eps)


class RMSNormReference(nn.Module):
    """The reference as a module; ``forward(x, residual)`` is the fused form when given a residual.

    ``forward`` keeps the input dtype, ``forward_fp32`` returns fp32.  ``eps`` defaults to
    Qwen3's ``rms_norm_eps``.
    """

    def __init__(self, weight: Tensor, eps: float = QWEN3_RMS_NORM_EPS):
        super().__init__()
        check_eps(eps)
        self.weight = nn.Parameter(weight)
        self.eps = eps

    def forward(self, x: Tensor, residual: Tensor | None = None):
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)

    def forward_fp32(self, x: Tensor, residual: Tensor | None = None):
        if residual is None:
            return rms_norm_fp32(x, self.weight, self.eps)
        return fused_add_rms_norm_fp32(x, residual, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"

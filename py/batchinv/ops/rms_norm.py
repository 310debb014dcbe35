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
from ..validation import check_fused_add_rms_norm_args, check_rms_norm_args
from ._checked import CheckedCalls
from ._custom_op import CustomOp, recompute_grads


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``x / sqrt(mean(x^2 over the last dim) + eps) * weight``, fp32 inside, x's dtype out.

    ``x: [..., d]`` in bf16/fp16/fp32 (any leading shape and strides: the per-head q/k norm
    is ``x: [..., heads, head_dim]``, ``weight: [head_dim]``); ``weight: [d]`` of x's dtype;
    ``eps`` a Python float > 0 (also in fp32).  Differentiable in x and weight.  Bad input
    raises TypeError/ValueError naming the argument; inputs are never modified.
    """
    if torch.compiler.is_compiling():  # one opaque node (the custom ops below)
        return torch.ops.batchinv.rms_norm(x, weight, eps)
    signature = _signature(x, weight, eps)
    if signature is not None:
        table = _RMS_NORM_GRAD if _needs_grad(x, weight) else _RMS_NORM_NO_GRAD
        return table.lookup(signature, x, weight, eps)(x, weight, eps)
    check_rms_norm_args(x, weight, eps)
    return registry.lookup("rms_norm", x.device)(x, weight, eps)


def fused_add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """``(rms_norm(new_residual, weight, eps), new_residual)``, ``new_residual = x + residual``
    added in fp32 and rounded once to x's dtype (the norm reads the rounded value).

    Returns new tensors (x and residual are not updated in place).  Differentiable; the
    gradient of x and of residual is the same tensor's values.
    """
    if torch.compiler.is_compiling():
        return torch.ops.batchinv.fused_add_rms_norm(x, residual, weight, eps)
    signature = _signature(x, weight, eps, residual)
    if signature is not None:
        if _needs_grad(x, weight, residual):
            run = _FUSED_ADD_RMS_NORM_GRAD.lookup(signature, x, residual, weight, eps)
        else:
            run = _FUSED_ADD_RMS_NORM_NO_GRAD.lookup(signature, x, residual, weight, eps)
        return run(x, weight, eps, residual)
    check_fused_add_rms_norm_args(x, residual, weight, eps)
    return registry.lookup("fused_add_rms_norm", x.device)(x, residual, weight, eps)


# ----------------------------------------------------------------------------- host path
# Every call runs its signature's checks once (``_checked``): what the checks read is the
# tensors' class, shape, dtype and device, and eps.  A call that needs a gradient looks up its
# own table, whose entry records the autograd node; which inputs get a gradient is the node's
# ``needs_input_grad``, so ``requires_grad`` is not part of the signature.


def _signature(x, weight, eps, residual=None) -> tuple | None:
    """What ``check_(fused_add_)rms_norm_args`` read, or None where a full check must run
    (an eps that is not a float, arguments without tensor attributes)."""
    if eps.__class__ is not float:
        return None
    try:
        signature = (
            x.__class__, x.shape, x.dtype, x.device,
            weight.__class__, weight.shape, weight.dtype, weight.device, eps,
        )  # fmt: skip
        if residual is not None:
            signature += (residual.__class__, residual.shape, residual.dtype, residual.device)
    except AttributeError:
        return None
    return signature


def _resolve_rms_norm(x: Tensor, weight: Tensor, eps: float):
    check_rms_norm_args(x, weight, eps)
    return registry.lookup("rms_norm.no_grad", x.device)


def _resolve_fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float):
    check_fused_add_rms_norm_args(x, residual, weight, eps)
    return registry.lookup("fused_add_rms_norm.no_grad", x.device)


def _resolve_rms_norm_grad(x: Tensor, weight: Tensor, eps: float):
    check_rms_norm_args(x, weight, eps)
    return registry.lookup("rms_norm.grad", x.device)


def _resolve_fused_add_rms_norm_grad(x: Tensor, residual: Tensor, weight: Tensor, eps: float):
    check_fused_add_rms_norm_args(x, residual, weight, eps)
    return registry.lookup("fused_add_rms_norm.grad", x.device)


_RMS_NORM_NO_GRAD = CheckedCalls(_resolve_rms_norm)
_FUSED_ADD_RMS_NORM_NO_GRAD = CheckedCalls(_resolve_fused_add_rms_norm)
_RMS_NORM_GRAD = CheckedCalls(_resolve_rms_norm_grad)
_FUSED_ADD_RMS_NORM_GRAD = CheckedCalls(_resolve_fused_add_rms_norm_grad)


# The implementations take (x, weight, eps, residual): one call shape for both tables.
def _reference_fused_add(x: Tensor, weight: Tensor, eps: float, residual: Tensor):
    return reference.fused_add_rms_norm(x, residual, weight, eps)


def _gpu_fused_add_grad(x: Tensor, weight: Tensor, eps: float, residual: Tensor):
    return _FusedAddRMSNormGPU.apply(x, residual, weight, eps)


class _RMSNormGPU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        # x as the kernels read it ([rows, d], unit stride; a copy only for a layout without
        # one row stride) is what is saved: the backward then reads the forward's own rows
        # instead of copying x again.
        x_rows = gpu.as_rows(x, x.shape[-1])
        y, _, rstd = gpu.run_forward(x_rows, weight, eps)
        ctx.save_for_backward(x_rows, weight, rstd)
        ctx.x_shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        x_rows, weight, rstd = ctx.saved_tensors
        need_x, need_weight, _ = ctx.needs_input_grad
        grad_x, grad_weight = gpu.backward(grad_y, x_rows, weight, rstd, weight_grad=need_weight)
        return (grad_x.view(ctx.x_shape) if need_x else None), grad_weight, None


class _FusedAddRMSNormGPU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, residual: Tensor, weight: Tensor, eps: float):
        y, new_residual, rstd = gpu.run_forward(x, weight, eps, residual)
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
        # One tensor for both inputs, as torch's own add gives (no copy of the size of x): the
        # engine never accumulates into a gradient another holder still reads, and two leaves'
        # .grad end up distinct (AccumulateGrad copies one still shared).
        return grad_h, grad_h, grad_weight, None


def _needs_grad(x: Tensor, weight: Tensor, residual: Tensor | None = None) -> bool:
    if not torch.is_grad_enabled():
        return False
    return (
        x.requires_grad or weight.requires_grad or (residual is not None and residual.requires_grad)
    )


# Without gradients the kernels run directly: no autograd node and no saved inv_rms (the same
# kernels, so the same bits), which keeps the host path of an inference call short.
def _gpu_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    if _needs_grad(x, weight):
        return _RMSNormGPU.apply(x, weight, eps)
    return gpu.forward_no_grad(x, weight, eps)


def _gpu_fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float):
    if _needs_grad(x, weight, residual):
        return _FusedAddRMSNormGPU.apply(x, residual, weight, eps)
    return gpu.forward_no_grad(x, weight, eps, residual)


for _backend in ("cuda", "hip"):
    registry.register("rms_norm", _backend)(_gpu_rms_norm)
    registry.register("fused_add_rms_norm", _backend)(_gpu_fused_add_rms_norm)
    registry.register("rms_norm.no_grad", _backend)(gpu.forward_no_grad)
    registry.register("fused_add_rms_norm.no_grad", _backend)(gpu.forward_no_grad)
    registry.register("rms_norm.grad", _backend)(_RMSNormGPU.apply)
    registry.register("fused_add_rms_norm.grad", _backend)(_gpu_fused_add_grad)
registry.register("rms_norm", "cpu")(reference.rms_norm)
registry.register("fused_add_rms_norm", "cpu")(reference.fused_add_rms_norm)
registry.register("rms_norm.no_grad", "cpu")(reference.rms_norm)
registry.register("fused_add_rms_norm.no_grad", "cpu")(_reference_fused_add)
registry.register("rms_norm.grad", "cpu")(reference.rms_norm)
registry.register("fused_add_rms_norm.grad", "cpu")(_reference_fused_add)


# ----------------------------------------------------------------------------- custom ops


def _rms_norm_fake(x, weight, eps):
    check_rms_norm_args(x, weight, eps)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _fused_add_rms_norm_fake(x, residual, weight, eps):
    check_fused_add_rms_norm_args(x, residual, weight, eps)
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format),
        torch.empty_like(x, memory_format=torch.contiguous_format),
    )


CustomOp(
    "rms_norm",
    "(Tensor x, Tensor weight, float eps) -> Tensor",
    rms_norm,
    _rms_norm_fake,
    (0, 1),
)


def _fused_add_rms_norm_backward(grads, needs, outputs, x, residual, weight, eps):
    got = recompute_grads(fused_add_rms_norm, (x, residual, weight, eps), (0, 1, 2), needs, grads)
    # The GPU autograd node gives x and residual one gradient tensor; a custom op's outputs
    # must not alias each other, so here the residual's is a copy.
    grad_x, grad_residual = got[0], got[1]
    if (
        grad_x.numel()
        and grad_x.untyped_storage().data_ptr() == grad_residual.untyped_storage().data_ptr()
    ):
        got[1] = grad_residual.clone()
    return got


CustomOp(
    "fused_add_rms_norm",
    "(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)",
    fused_add_rms_norm,
    _fused_add_rms_norm_fake,
    (0, 1, 2),
    backward=_fused_add_rms_norm_backward,
)

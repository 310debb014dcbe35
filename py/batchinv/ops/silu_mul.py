"""``batchinv.silu_mul`` and ``batchinv.silu_mul_fused``: SwiGLU's ``silu(gate) * up``.

On the CPU the op is the reference (``batchinv.reference.silu_mul``); on CUDA/HIP it is
``kernels_cu/silu_mul.cu``.  Elementwise, so every element is bitwise the same in any batch;
the two backends agree within the contract's elementwise tolerance (their ``exp`` differ by
an ulp or two).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import registry
from ..gpu import silu_mul as gpu
from ..reference import silu_mul as reference
from ..validation import check_silu_mul_args, check_silu_mul_fused_args
from ._checked import CheckedCalls
from ._custom_op import CustomOp


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up`` elementwise in fp32 (``silu(g) = g / (1 + exp(-g))``), rounded once
    to the inputs' dtype.  ``gate``, ``up``: the same shape ``[..., I]``, dtype (bf16, fp16,
    fp32) and device; any strides.  Differentiable; the inputs are never modified."""
    if torch.compiler.is_compiling():  # one opaque node (the custom ops below)
        return torch.ops.batchinv.silu_mul(gate, up)
    signature = _signature(gate, up)
    if signature is not None:
        table = _SILU_MUL_GRAD if _needs_grad(gate, up) else _SILU_MUL_NO_GRAD
        return table.lookup(signature, gate, up)(gate, up)
    check_silu_mul_args(gate, up)
    return registry.lookup("silu_mul", gate.device)(gate, up)


def silu_mul_fused(gate_up: Tensor) -> Tensor:
    """``silu_mul(gate_up[..., :I], gate_up[..., I:])`` for ``gate_up: [..., 2 * I]`` (vLLM's
    ``SiluAndMul`` order: a merged ``[gate_proj; up_proj]`` output).  Returns ``[..., I]``."""
    if torch.compiler.is_compiling():
        return torch.ops.batchinv.silu_mul_fused(gate_up)
    signature = _signature(gate_up)
    if signature is not None:
        table = _SILU_MUL_FUSED_GRAD if _needs_grad(gate_up) else _SILU_MUL_FUSED_NO_GRAD
        return table.lookup(signature, gate_up)(gate_up)
    check_silu_mul_fused_args(gate_up)
    return registry.lookup("silu_mul_fused", gate_up.device)(gate_up)


# ----------------------------------------------------------------------------- host path
# Every call runs its signature's checks once (``_checked``): what the checks read is the
# tensors' class, shape, dtype and device.  A call that needs a gradient looks up its own
# table, whose entry records the autograd node (which inputs get a gradient is the node's
# ``needs_input_grad``, so ``requires_grad`` is not part of the signature).


def _signature(gate: Tensor, up: Tensor | None = None) -> tuple | None:
    """What the checks read, or None for arguments without tensor attributes."""
    try:
        signature = (gate.__class__, gate.shape, gate.dtype, gate.device)
        if up is not None:
            signature += (up.__class__, up.shape, up.dtype, up.device)
    except AttributeError:
        return None
    return signature


def _needs_grad(gate: Tensor, up: Tensor | None = None) -> bool:
    if not torch.is_grad_enabled():
        return False
    return gate.requires_grad or (up is not None and up.requires_grad)


def _resolve_silu_mul(gate: Tensor, up: Tensor):
    check_silu_mul_args(gate, up)
    return registry.lookup("silu_mul.no_grad", gate.device)


def _resolve_silu_mul_fused(gate_up: Tensor):
    check_silu_mul_fused_args(gate_up)
    return registry.lookup("silu_mul_fused.no_grad", gate_up.device)


def _resolve_silu_mul_grad(gate: Tensor, up: Tensor):
    check_silu_mul_args(gate, up)
    return registry.lookup("silu_mul.grad", gate.device)


def _resolve_silu_mul_fused_grad(gate_up: Tensor):
    check_silu_mul_fused_args(gate_up)
    return registry.lookup("silu_mul_fused.grad", gate_up.device)


_SILU_MUL_NO_GRAD = CheckedCalls(_resolve_silu_mul)
_SILU_MUL_FUSED_NO_GRAD = CheckedCalls(_resolve_silu_mul_fused)
_SILU_MUL_GRAD = CheckedCalls(_resolve_silu_mul_grad)
_SILU_MUL_FUSED_GRAD = CheckedCalls(_resolve_silu_mul_fused_grad)


class _SiluMulGPU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor) -> Tensor:
        ctx.save_for_backward(gate, up)
        return gpu.forward(gate, up)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        gate, up = ctx.saved_tensors
        return gpu.backward(grad_out, gate, up)


class _SiluMulFusedGPU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up: Tensor) -> Tensor:
        ctx.save_for_backward(gate_up)
        return gpu.forward_fused(gate_up)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        (gate_up,) = ctx.saved_tensors
        return gpu.backward_fused(grad_out, gate_up)


# Without gradients the kernel runs directly (no autograd node): the same kernel and bits.
def _gpu_silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    if _needs_grad(gate, up):
        return _SiluMulGPU.apply(gate, up)
    return gpu.forward_no_grad(gate, up)


def _gpu_silu_mul_fused(gate_up: Tensor) -> Tensor:
    if _needs_grad(gate_up):
        return _SiluMulFusedGPU.apply(gate_up)
    return gpu.forward_fused_no_grad(gate_up)


for _backend in ("cuda", "hip"):
    registry.register("silu_mul", _backend)(_gpu_silu_mul)
    registry.register("silu_mul_fused", _backend)(_gpu_silu_mul_fused)
    registry.register("silu_mul.no_grad", _backend)(gpu.forward_no_grad)
    registry.register("silu_mul_fused.no_grad", _backend)(gpu.forward_fused_no_grad)
    registry.register("silu_mul.grad", _backend)(_SiluMulGPU.apply)
    registry.register("silu_mul_fused.grad", _backend)(_SiluMulFusedGPU.apply)
registry.register("silu_mul", "cpu")(reference.silu_mul)
registry.register("silu_mul_fused", "cpu")(reference.silu_mul_fused)
registry.register("silu_mul.no_grad", "cpu")(reference.silu_mul)
registry.register("silu_mul_fused.no_grad", "cpu")(reference.silu_mul_fused)
registry.register("silu_mul.grad", "cpu")(reference.silu_mul)
registry.register("silu_mul_fused.grad", "cpu")(reference.silu_mul_fused)


# ----------------------------------------------------------------------------- custom ops


def _silu_mul_fake(gate, up):
    check_silu_mul_args(gate, up)
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


def _silu_mul_fused_fake(gate_up):
    check_silu_mul_fused_args(gate_up)
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


CustomOp("silu_mul", "(Tensor gate, Tensor up) -> Tensor", silu_mul, _silu_mul_fake, (0, 1))
CustomOp("silu_mul_fused", "(Tensor gate_up) -> Tensor", silu_mul_fused, _silu_mul_fused_fake, (0,))

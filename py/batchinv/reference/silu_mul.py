"""SiLU-and-multiply (the SwiGLU activation of Qwen3's MLP), the strict reference.

``out = silu(gate) * up`` with ``silu(g) = g / (1 + exp(-g))``, elementwise in fp32, rounded
once to the input dtype.  (That is the formula of PyTorch's CUDA ``silu`` kernel; HF's Qwen3MLP
computes ``F.silu(gate_proj(x)) * up_proj(x)``, which in bf16 rounds ``silu(gate)`` to bf16
before the product.)  ``silu_mul_fused(gate_up)`` takes one ``[..., 2 * I]`` tensor, the
first half the gate and the second half the up projection: the order of vLLM's
``SiluAndMul`` (``silu(x[..., :d]) * x[..., d:]``) and of a merged ``gate_up_proj`` that
stacks ``[gate_proj; up_proj]``.

There is no reduction.  ``exp`` is the only step whose bits could depend on an element's
place in a call: torch's CPU elementwise kernels run a vector body and a scalar tail that may
use different code (``torch.sigmoid`` and ``F.silu`` do: on torch 2.11 with AVX512 about 4% of
random inputs get other bits in the scalar tail than in the vector body), so the reference
never calls them, and evaluates ``exp`` one row at a time, each row ``[I]`` in a fresh buffer:
element ``j`` of a row is always element ``j`` of a same-shaped call, whatever the batch
holds.  The other steps (negation, add, divide, multiply) are single IEEE operations.
``gate = -inf`` gives NaN (``-inf / inf``), as PyTorch's ``silu`` does.

Backward, elementwise in fp32 with ``e = exp(-g)``, ``s = 1 / (1 + e)``:
``grad_up = grad_out * (g / (1 + e))`` and
``grad_gate = (grad_out * up) * (s * (1 + g * (1 - s)))``, each rounded once to the input
dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..contract import deterministic_context
from ..validation import (
    FLOAT_DTYPES,
    check_silu_mul_args,
    check_silu_mul_fused_args,
    check_tensor,
)

SUPPORTED_DTYPES = FLOAT_DTYPES


def _exp_neg_rowwise(g32: Tensor) -> Tensor:
    """``exp(-g)`` with each row of the last dim evaluated in its own fresh ``[I]`` call."""
    rows = g32.reshape(-1, g32.shape[-1])
    out = torch.empty_like(rows)
    for r in range(rows.shape[0]):
        # neg() writes a fresh buffer, so every call sees the same shape and alignment.
        out[r] = torch.exp(rows[r].neg())
    return out.reshape(g32.shape)


def _forward32(g32: Tensor, u32: Tensor) -> Tensor:
    silu = g32 / (1.0 + _exp_neg_rowwise(g32))
    return silu * u32


def _backward32(grad32: Tensor, g32: Tensor, u32: Tensor) -> tuple[Tensor, Tensor]:
    one_plus_e = 1.0 + _exp_neg_rowwise(g32)
    sigmoid = 1.0 / one_plus_e
    dsilu = sigmoid * (1.0 + g32 * (1.0 - sigmoid))
    grad_gate = (grad32 * u32) * dsilu
    grad_up = grad32 * (g32 / one_plus_e)
    return grad_gate, grad_up


class _SiluMulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor) -> Tensor:
        ctx.save_for_backward(gate, up)
        return _forward32(gate.float(), up.float()).to(gate.dtype)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        gate, up = ctx.saved_tensors
        grad_gate, grad_up = _backward32(grad_out.float(), gate.float(), up.float())
        return grad_gate.to(gate.dtype), grad_up.to(up.dtype)


def silu_mul_backward(grad_out: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    """``(grad_gate, grad_up)`` in the inputs' dtype (fp32 inside, one rounding each)."""
    check_silu_mul_args(gate, up)
    check_tensor("grad_out", grad_out, dtypes=(gate.dtype,))
    if grad_out.shape != gate.shape:
        raise ValueError(
            f"grad_out must have the shape of gate {tuple(gate.shape)}, got {tuple(grad_out.shape)}"
        )
    grad_gate, grad_up = _backward32(grad_out.float(), gate.float(), up.float())
    return grad_gate.to(gate.dtype), grad_up.to(up.dtype)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """Low-precision path: ``silu(gate) * up`` in fp32, one rounding to the input dtype.

    Zero rows give an empty result.  Differentiable; the inputs are never modified.
    """
    check_silu_mul_args(gate, up)
    return _SiluMulFunction.apply(gate, up)


def silu_mul_fp32(gate: Tensor, up: Tensor) -> Tensor:
    """Strict fp32 path: the same definition on upcast inputs, returned in fp32."""
    check_silu_mul_args(gate, up)
    with deterministic_context():
        return _SiluMulFunction.apply(gate.float(), up.float())


def _split(gate_up: Tensor) -> tuple[Tensor, Tensor]:
    inter = gate_up.shape[-1] // 2
    return gate_up[..., :inter], gate_up[..., inter:]


def silu_mul_fused(gate_up: Tensor) -> Tensor:
    """``silu_mul(gate_up[..., :I], gate_up[..., I:])`` for ``gate_up: [..., 2 * I]``."""
    check_silu_mul_fused_args(gate_up)
    return _SiluMulFunction.apply(*_split(gate_up))


def silu_mul_fused_fp32(gate_up: Tensor) -> Tensor:
    """Strict fp32 path of ``silu_mul_fused``."""
    check_silu_mul_fused_args(gate_up)
    with deterministic_context():
        return _SiluMulFunction.apply(*_split(gate_up.float()))


class SiluMulReference(nn.Module):
    """The reference as a module (no parameters).

    ``forward(gate, up)`` or ``forward(gate_up)`` (the fused layout when ``up`` is None);
    ``forward_fp32`` likewise, returning fp32.
    """

    def forward(self, gate: Tensor, up: Tensor | None = None) -> Tensor:
        return silu_mul_fused(gate) if up is None else silu_mul(gate, up)

    def forward_fp32(self, gate: Tensor, up: Tensor | None = None) -> Tensor:
        return silu_mul_fused_fp32(gate) if up is None else silu_mul_fp32(gate, up)

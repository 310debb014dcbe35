"""``batchinv.linear``: ``x · weightᵀ + bias`` with a K order that never depends on M.

On CUDA each output element is reduced over K in 64-wide tiles of four k16 tensor-core
steps, in increasing k, whatever the number of rows (kernels_cu/linear.cu); on HIP by one
FMA chain in increasing k (a portable loop, never run on AMD hardware: docs/amd.md); on the
CPU the strict reference reduces K one element at a time.  Gradients use the same kernels:
grad_x is a per-row reduction (batch-invariant), grad_weight and grad_bias reduce over
tokens in increasing order (bitwise identical run to run).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .. import registry
from ..gpu import linear as gpu_linear
from ..gpu import linear_cublaslt
from ..reference import linear as reference
from ..validation import check_linear_args
from ._checked import CheckedCalls
from ._custom_op import CustomOp, empty_grad


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x [..., in] · weight[out, in]ᵀ (+ bias[out])`` in ``x``'s dtype, fp32 accumulation.

    A row's result is bitwise the same whatever other rows are in the batch.  The GPU path
    takes bf16/fp16 with ``in_features % 8 == 0``; the CPU path is the strict reference.
    """
    if torch.compiler.is_compiling():  # one opaque node (the custom op below)
        return torch.ops.batchinv.linear(x, weight, bias)
    signature = _signature(x, weight, bias)
    if signature is not None:
        table = _GRAD if _needs_grad(x, weight, bias) else _FORWARD
        return table.lookup(signature, x, weight, bias)(x, weight, bias)
    check_linear_args(x, weight, bias)
    return checked_linear(x, weight, bias)


# Every call runs its signature's checks once (``_checked``): what ``check_linear_args``
# reads is the tensors' class, shape, dtype and device.  A call that needs a gradient looks up
# its own table, whose entry records the autograd node (which inputs get a gradient is the
# node's ``needs_input_grad``, so ``requires_grad`` is not part of the signature).


def _signature(x: Tensor, weight: Tensor, bias: Tensor | None) -> tuple | None:
    """What ``check_linear_args`` reads, or None for arguments without tensor attributes."""
    try:
        signature = (
            x.__class__, x.shape, x.dtype, x.device,
            weight.__class__, weight.shape, weight.dtype, weight.device,
        )  # fmt: skip
        if bias is not None:
            signature += (bias.__class__, bias.shape, bias.dtype, bias.device)
    except AttributeError:
        return None
    return signature


def _resolve_forward(x: Tensor, weight: Tensor, bias: Tensor | None):
    check_linear_args(x, weight, bias)
    run = registry.lookup("linear.forward", x.device)
    # CUDA's forward without an autograd node keeps its launch per shape (the same kernels).
    return gpu_linear.forward_no_grad if run is gpu_linear.forward else run


def _resolve_grad(x: Tensor, weight: Tensor, bias: Tensor | None):
    check_linear_args(x, weight, bias)
    return _Linear.apply


_FORWARD = CheckedCalls(_resolve_forward)
_GRAD = CheckedCalls(_resolve_grad)


def checked_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``linear`` after ``check_linear_args``: ops built on linear (``lm_head``) check once."""
    if _needs_grad(x, weight, bias):
        return _Linear.apply(x, weight, bias)
    # No gradient wanted: the registry's forward without an autograd node (the same kernels
    # and bits); it keeps an inference call's host path short.
    return registry.lookup("linear.forward", x.device)(x, weight, bias)


def linear_group(
    x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor | None] | None = None
) -> tuple[Tensor, ...] | None:
    """``linear(x, weights[i], biases[i])`` for every weight in one launch where the grouped
    small-M kernel applies (no gradient, CUDA sm_90a, decode-sized batches): column views of
    one ``[..., N_0 + N_1 + ...]`` output, each bitwise ``linear``'s result for its weight.
    Elsewhere None, and the caller runs the separate ``linear`` calls."""
    return gpu_linear.linear_group(x, weights, biases)


def linear_path(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> str:
    """Which path ``linear(x, weight, bias)`` takes for its forward: ``"own"`` (batchinv's
    kernels), ``"cublaslt"`` (cuBLASLt's pinned algorithm, checked to give the same bits) or
    ``"reference"`` (the strict CPU reference).

    The answer follows the switch (``set_linear_path``, ``BATCHINV_LINEAR_PATH``) and, under
    ``"auto"``, the pinned path's self-check, which this may run on first use per shape just
    as the call would; it is then fixed for the process.  ``grad_x`` follows the same rule for
    the product ``grad_y @ weight`` (``batchinv.gpu.linear.rows_path`` on ``weightᵀ``).  Under
    ``"cublaslt"`` it raises where the call would."""
    check_linear_args(x, weight, bias)
    if x.device.type != "cuda":
        return "reference"
    gpu_linear.check_gpu_args(x, weight, bias)
    if registry.backend_of(x.device) == "hip":
        return "own"  # the portable loop: no cuBLASLt on HIP
    return gpu_linear.rows_path(math.prod(x.shape[:-1]), weight, bias is not None)


def set_linear_path(path: str | None) -> None:
    """Selects which path serves ``linear``'s large products from now on in this process:
    ``"auto"``, ``"own"`` or ``"cublaslt"`` (see ``docs/operators/linear.md``); ``None`` goes
    back to ``BATCHINV_LINEAR_PATH`` (default ``"auto"``).  An unknown name raises
    ``ValueError``.  Every path gives a row the same bits (``"auto"`` and ``"cublaslt"`` only
    use the pinned algorithm where its self-check found batchinv's bits)."""
    linear_cublaslt.set_path(path)


def _needs_grad(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    if not torch.is_grad_enabled():
        return False
    return x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)


def linear_function(forward_op: str) -> type[torch.autograd.Function]:
    """An autograd Function whose forward is the registry's ``forward_op`` (``x, weight,
    bias``) and whose backward is ``linear.backward``: every op computing ``x · weightᵀ +
    bias`` in some fixed K order shares the linear's gradients (their formulas do not depend
    on the forward's K order)."""

    class _LinearFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
            ctx.save_for_backward(x, weight)
            ctx.bias_dtype = None if bias is None else bias.dtype
            return registry.lookup(forward_op, x.device)(x, weight, bias)

        @staticmethod
        def backward(ctx, grad_out: Tensor):
            x, weight = ctx.saved_tensors
            backward = registry.lookup("linear.backward", grad_out.device)
            return backward(grad_out, x, weight, ctx.bias_dtype, ctx.needs_input_grad)

    return _LinearFunction


_Linear = linear_function("linear.forward")


def _reference_forward(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return reference.linear_forward_fp32(x, weight, bias).to(x.dtype)


registry.register("linear.forward", "cpu")(_reference_forward)
registry.register("linear.backward", "cpu")(reference.linear_backward)
registry.register("linear.forward", "cuda")(gpu_linear.forward)
registry.register("linear.backward", "cuda")(gpu_linear.backward)
registry.register("linear.forward", "hip")(gpu_linear.hip_forward)
registry.register("linear.backward", "hip")(gpu_linear.hip_backward)


# ----------------------------------------------------------------------------- custom op


def _fake(x, weight, bias):
    check_linear_args(x, weight, bias)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _custom_backward(grads, needs, outputs, x, weight, bias):
    # The registry's backward (the fixed-order kernels) directly: nothing to recompute.
    (grad_out,) = grads
    bias_dtype = None if bias is None else bias.dtype
    backward = registry.lookup("linear.backward", grad_out.device)
    got = backward(grad_out, x, weight, bias_dtype, tuple(needs))
    return [empty_grad(grad_out) if g is None else g for g in got]


CustomOp(
    "linear",
    "(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
    linear,
    _fake,
    (0, 1, 2),
    backward=_custom_backward,
)

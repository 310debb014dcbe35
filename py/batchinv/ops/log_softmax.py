"""``batchinv.log_softmax``: log-softmax over the last dimension, fp32 statistics.

On the CPU the op is the reference (``batchinv.reference.log_softmax``, the chunked online
log-sum-exp in a fixed order); on CUDA/HIP it is ``kernels_cu/log_softmax.cu``: one CTA per
row and a fixed tree chosen from the row length alone, so a row's output and input gradient
are bitwise the same in any batch.  The two backends agree within the contract's logprob
tolerance, not bitwise (different fixed orders).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import registry
from ..gpu import log_softmax as gpu
from ..reference import log_softmax as reference
from ..reference.log_softmax import LSE_CHUNK
from ..validation import check_log_softmax_args
from ._checked import CheckedCalls
from ._custom_op import CustomOp


def log_softmax(
    x: Tensor,
    dim: int = -1,
    out_dtype: torch.dtype = torch.float32,
    *,
    chunk_size: int = LSE_CHUNK,
) -> Tensor:
    """``x - logsumexp(x)`` over the last dimension with fp32 statistics, rounded once to
    ``out_dtype`` (fp32 by default, also bf16/fp16).

    ``x: [..., V]`` in bf16/fp16/fp32, any strides; ``dim`` must be the last dimension.  A row
    of all ``-inf`` gives ``-inf`` everywhere and a zero gradient.  ``chunk_size`` sets the
    CPU reference's summation order (see ``batchinv.reference.log_softmax``) and is validated
    but unused on the GPU.  Differentiable: ``dx = dy - exp(out) * sum(dy)``.
    """
    if torch.compiler.is_compiling():  # one opaque node (the custom op below)
        return torch.ops.batchinv.log_softmax(x, dim, out_dtype, chunk_size)
    signature = _signature(x, dim, out_dtype, chunk_size)
    if signature is not None and not (torch.is_grad_enabled() and x.requires_grad):
        run = _NO_GRAD.lookup(signature, x, dim, out_dtype, chunk_size)
        return run(x, dim, out_dtype, chunk_size=chunk_size)
    check_log_softmax_args(x, dim, out_dtype, chunk_size)
    return registry.lookup("log_softmax", x.device)(x, dim, out_dtype, chunk_size=chunk_size)


def _signature(x: Tensor, dim: int, out_dtype: torch.dtype, chunk_size: int) -> tuple | None:
    """What ``check_log_softmax_args`` reads (``_checked``), or None where the full checks
    must run (arguments of other types than the op takes)."""
    if not (
        dim.__class__ is int and chunk_size.__class__ is int and out_dtype.__class__ is torch.dtype
    ):
        return None
    try:
        return (x.__class__, x.shape, x.dtype, x.device, dim, out_dtype, chunk_size)
    except AttributeError:
        return None


def _resolve_no_grad(x: Tensor, dim: int, out_dtype: torch.dtype, chunk_size: int):
    check_log_softmax_args(x, dim, out_dtype, chunk_size)
    return registry.lookup("log_softmax.no_grad", x.device)


_NO_GRAD = CheckedCalls(_resolve_no_grad)


class _LogSoftmaxGPU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, out_dtype: torch.dtype) -> Tensor:
        out, lse = gpu.forward(x, out_dtype)
        ctx.save_for_backward(x, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, lse = ctx.saved_tensors
        return gpu.backward(grad_out, x, lse), None


def _gpu_log_softmax(x: Tensor, dim: int, out_dtype: torch.dtype, *, chunk_size: int) -> Tensor:
    # chunk_size defines the CPU reference's order; the kernel's order is its own fixed tree.
    if torch.is_grad_enabled() and x.requires_grad:
        return _LogSoftmaxGPU.apply(x, out_dtype)
    return _gpu_log_softmax_no_grad(x, dim, out_dtype, chunk_size=chunk_size)


def _gpu_log_softmax_no_grad(x: Tensor, dim: int, out_dtype: torch.dtype, *, chunk_size: int):
    return gpu.forward_no_grad(x, out_dtype)  # the same kernel, no autograd node


for _backend in ("cuda", "hip"):
    registry.register("log_softmax", _backend)(_gpu_log_softmax)
    registry.register("log_softmax.no_grad", _backend)(_gpu_log_softmax_no_grad)
registry.register("log_softmax", "cpu")(reference.log_softmax)
registry.register("log_softmax.no_grad", "cpu")(reference.log_softmax)


# ----------------------------------------------------------------------------- custom op


def _eager(x, dim, out_dtype, chunk_size):
    return log_softmax(x, dim, out_dtype, chunk_size=chunk_size)


def _fake(x, dim, out_dtype, chunk_size):
    check_log_softmax_args(x, dim, out_dtype, chunk_size)
    return x.new_empty(x.shape, dtype=out_dtype)


CustomOp(
    "log_softmax",
    "(Tensor x, int dim, ScalarType out_dtype, int chunk_size) -> Tensor",
    _eager,
    _fake,
    (0,),
)

"""Linear: ``y = x @ weight.T + bias``, the strict reference (Hugging Face layout).

``weight`` is ``[out_features, in_features]`` as in ``nn.Linear`` and every Hugging Face
checkpoint; ``x`` is ``[..., in_features]``; ``bias`` (optional) is ``[out_features]``.
The lm_head is the same op with one weight row per vocabulary entry.

Forward, for every output element: ``acc = 0; for k = 0 .. K-1: acc = acc + x[k] * w[k]``
in fp32 (one rounded product and one rounded add per step), then ``acc + bias`` in fp32,
then one rounding to the input dtype.  The loop runs over K only and is elementwise over
the rows (``fixed_order_matmul``), so a row's result cannot depend on how many other rows
are in the batch or where it sits among them: BLAS would choose its K blocking from the
shape, which is why it is not used here.

Backward (``_LinearFunction``), all in fp32 and rounded once to the parameter dtypes:
- ``grad_x = grad_y @ weight``: reduced over out_features in increasing order, one row at
  a time, so a row's input gradient is as batch-independent as its output;
- ``grad_weight = grad_y.T @ x``: reduced over the tokens in increasing token order;
- ``grad_bias``: the sum of ``grad_y`` over the tokens in increasing token order.
The weight and bias gradients depend on the whole batch by definition; their order is
fixed, so they are bitwise identical from run to run.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..contract import deterministic_context
from ..validation import FLOAT_DTYPES, check_linear_args
from ._fixed_order import fixed_order_matmul, fixed_order_sum

SUPPORTED_DTYPES = FLOAT_DTYPES


def linear_forward_fp32(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """The unrounded fp32 result ``[..., out]``: K reduced in order, then ``+ bias`` in fp32."""
    x_rows = x.reshape(x.shape[:-1].numel(), x.shape[-1]).float()
    acc = fixed_order_matmul(x_rows, weight.float().t())
    if bias is not None:
        acc = acc + bias.float()
    return acc.reshape(*x.shape[:-1], weight.shape[0])


def linear_backward(
    grad_out: Tensor,
    x: Tensor,
    weight: Tensor,
    bias_dtype: torch.dtype | None,
    needs_input_grad: tuple[bool, bool, bool] = (True, True, True),
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``(grad_x, grad_weight, grad_bias)`` in fp32 with fixed orders, each rounded once.

    ``bias_dtype`` is None when the layer has no bias.  Entries whose ``needs_input_grad``
    flag is False are returned as None and not computed.
    """
    grad_rows = grad_out.reshape(x.shape[:-1].numel(), weight.shape[0]).float()
    grad_x = grad_weight = grad_bias = None
    if needs_input_grad[0]:
        # [M, N] @ [N, K]: each row reduces its own N entries in order.
        grad_x = fixed_order_matmul(grad_rows, weight.float()).to(x.dtype).reshape(x.shape)
    if needs_input_grad[1]:
        # [N, M] @ [M, K]: reduced over the tokens in increasing token order.
        x_rows = x.reshape(x.shape[:-1].numel(), x.shape[-1]).float()
        grad_weight = fixed_order_matmul(grad_rows.t(), x_rows).to(weight.dtype)
    if bias_dtype is not None and needs_input_grad[2]:
        grad_bias = fixed_order_sum(grad_rows, dim=0).to(bias_dtype)
    return grad_x, grad_weight, grad_bias


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return linear_forward_fp32(x, weight, bias).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, weight = ctx.saved_tensors
        return linear_backward(grad_out, x, weight, ctx.bias_dtype, ctx.needs_input_grad)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """Low-precision path: fp32 accumulation in K order, ``+ bias`` in fp32, one rounding.

    Returns ``x.dtype``.  Differentiable, with the fixed-order backward of this module.
    """
    check_linear_args(x, weight, bias)
    return _LinearFunction.apply(x, weight, bias)


def linear_fp32(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """Strict fp32 path: inputs upcast, same definition, fp32 out (differentiable)."""
    check_linear_args(x, weight, bias)
    with deterministic_context():
        bias32 = bias.float() if bias is not None else None
        return _LinearFunction.apply(x.float(), weight.float(), bias32)


class LinearReference(nn.Module):
    """``nn.Linear``-shaped reference: ``forward`` keeps the input dtype, ``forward_fp32`` fp32."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight)
        if bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = nn.Parameter(bias)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)

    def forward_fp32(self, x: Tensor) -> Tensor:
        return linear_fp32(x, self.weight, self.bias)

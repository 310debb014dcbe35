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

The K-group tree (``linear_k_groups``, the order tensor parallelism can reproduce): K is cut
into ``K_GROUPS`` groups of ``k_group_width(K)`` columns (whole 64-wide boxes); group g
reduces columns ``[g*w, min((g+1)*w, K))`` as above from a zero accumulator (an empty group
is all ``+0.0``); the fp32 group partials are summed in one fixed balanced tree
(``k_group_tree_sum``), then ``+ bias`` in fp32, then one rounding.  Each group and the tree
follow K alone, so a row's result cannot depend on the batch either; its bits differ from
``linear``'s (another K order).  The gradients are ``linear``'s: they do not depend on the
forward's K order.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..contract import deterministic_context
from ..validation import FLOAT_DTYPES, check_int, check_linear_args
from ._fixed_order import fixed_order_matmul, fixed_order_sum

SUPPORTED_DTYPES = FLOAT_DTYPES

K_GROUPS = 8  # a constant of the build: kKGroups in kernels_cu/linear.cu
K_GROUP_BOX = 64  # groups are whole boxes of the GPU kernels' 64-wide k-tiles


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


def _rounded_linear_function(forward_fp32) -> type[torch.autograd.Function]:
    """An autograd Function: ``forward_fp32(x, weight, bias)`` rounded once to ``x.dtype``,
    with ``linear_backward`` (the gradients do not depend on the forward's K order)."""

    class _Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
            ctx.save_for_backward(x, weight)
            ctx.bias_dtype = bias.dtype if bias is not None else None
            return forward_fp32(x, weight, bias).to(x.dtype)

        @staticmethod
        def backward(ctx, grad_out: Tensor):
            x, weight = ctx.saved_tensors
            return linear_backward(grad_out, x, weight, ctx.bias_dtype, ctx.needs_input_grad)

    return _Function


_LinearFunction = _rounded_linear_function(linear_forward_fp32)


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


# ----------------------------------------------------------------------------- K-group tree


def k_group_width(in_features: int) -> int:
    """Columns per K group: ``ceil(ceil(K / 64) / K_GROUPS) * 64``, a function of K alone."""
    in_features = check_int("in_features", in_features)
    if in_features < 1:
        raise ValueError(f"in_features must be >= 1, got {in_features}")
    boxes = -(-in_features // K_GROUP_BOX)
    return -(-boxes // K_GROUPS) * K_GROUP_BOX


def check_k_group_args(x: Tensor, weight: Tensor, group_width: object, groups: object) -> None:
    """``check_linear_args`` plus the group layout: ``group_width`` a positive multiple of 64,
    ``1 <= groups <= K_GROUPS``, and ``groups * group_width >= K`` (no column left over).

    Groups that start at or past K are allowed and are empty (all ``+0.0``), and the last
    non-empty group may be partial: a full call with a small K has empty trailing groups, and a
    rank's shard of whole groups ends wherever K ends."""
    check_linear_args(x, weight)
    group_width = check_int("group_width", group_width)
    groups = check_int("groups", groups)
    if group_width < 1 or group_width % K_GROUP_BOX != 0:
        raise ValueError(
            f"group_width must be a positive multiple of {K_GROUP_BOX}, got {group_width}"
        )
    if not 1 <= groups <= K_GROUPS:
        raise ValueError(f"groups must be in [1, {K_GROUPS}], got {groups}")
    k = weight.shape[1]
    if groups * group_width < k:
        raise ValueError(
            f"groups * group_width = {groups} * {group_width} = {groups * group_width} < "
            f"in_features = {k}: columns would be left over"
        )


def k_group_bounds(in_features: int, group_width: int, groups: int) -> list[tuple[int, int]]:
    """The column range ``[begin, end)`` of each group (``begin == end`` for an empty one)."""
    return [
        (min(g * group_width, in_features), min((g + 1) * group_width, in_features))
        for g in range(groups)
    ]


def linear_k_group_partials(x: Tensor, weight: Tensor, group_width: int, groups: int) -> Tensor:
    """fp32 ``[groups, *x.shape[:-1], out]``: group g is ``x[..., b:e] · weight[:, b:e]ᵀ``
    over its columns ``[b, e)``, reduced in increasing k from zero (``fixed_order_matmul``)."""
    check_k_group_args(x, weight, group_width, groups)
    n, k = weight.shape
    x_rows = x.reshape(x.shape[:-1].numel(), k).float()
    weight32 = weight.float()
    partials = torch.zeros(groups, x_rows.shape[0], n, dtype=torch.float32, device=x.device)
    for g, (begin, end) in enumerate(k_group_bounds(k, group_width, groups)):
        if begin < end:
            partials[g] = fixed_order_matmul(x_rows[:, begin:end], weight32[:, begin:end].t())
    return partials.reshape(groups, *x.shape[:-1], n)


def k_group_tree_sum(partials: Tensor) -> Tensor:
    """The fixed balanced tree over ``partials [P, ...]`` (fp32, P in 1, 2, 4, 8): pairs added
    level by level, ``((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))`` for P = 8, i.e.
    ``tree(first half) + tree(second half)``.  For P = 1 it returns the view ``partials[0]``
    (no copy, no add).  Elementwise fp32 adds only, so every device gives the same bits."""
    check_k_group_partials(partials)
    level = partials
    while level.shape[0] > 1:
        level = level[0::2] + level[1::2]
    return level[0]


def k_group_tree_finish(partials: Tensor, bias: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    """``k_group_tree_sum(partials)``, then ``+ fp32(bias)``, then one rounding to
    ``out_dtype``: the end of ``linear_k_groups``, from node sums."""
    acc = k_group_tree_sum(partials)
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(out_dtype)


def check_k_group_partials(partials: Tensor) -> None:
    """``partials`` is an fp32 tensor ``[P, ...]`` with P in 1, 2, 4, 8."""
    if not isinstance(partials, Tensor):
        raise TypeError(f"partials must be a tensor, got {type(partials).__name__}")
    if partials.dtype != torch.float32:
        raise TypeError(
            f"partials must be float32 (partial sums are combined in fp32), got {partials.dtype}"
        )
    count = partials.shape[0] if partials.dim() > 0 else 0
    if count not in (1, 2, 4, 8):
        raise ValueError(
            f"partials.shape[0] must be 1, 2, 4 or 8 (a power of two <= {K_GROUPS}), "
            f"got shape {tuple(partials.shape)}"
        )


def linear_k_groups_fp32(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """The unrounded fp32 result of the K-group tree: partials, tree, then ``+ bias``."""
    check_linear_args(x, weight, bias)
    k = weight.shape[1]
    partials = linear_k_group_partials(x, weight, k_group_width(k), K_GROUPS)
    acc = k_group_tree_sum(partials)
    if bias is not None:
        acc = acc + bias.float()
    return acc


_LinearKGroupsFunction = _rounded_linear_function(linear_k_groups_fp32)


def linear_k_groups(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """The K-group tree in ``x.dtype``: one rounding of ``linear_k_groups_fp32``.

    Differentiable, with ``linear``'s fixed-order backward."""
    check_linear_args(x, weight, bias)
    return _LinearKGroupsFunction.apply(x, weight, bias)

"""``batchinv.linear_k_groups``: ``x · weightᵀ + bias`` in the K order tensor parallelism can
reproduce.

K is cut into ``K_GROUPS = 8`` groups of ``k_group_width(K)`` columns (whole 64-wide boxes, a
function of K alone).  Group g reduces columns ``[g*w, min((g+1)*w, K))`` exactly as
``batchinv.linear`` reduces K (on CUDA: 64-wide k-tiles of four k16 steps in increasing k; on
the CPU: one element at a time), from a zero accumulator, into an fp32 partial; an empty group
is all ``+0.0``.  The eight partials are summed in one fixed balanced tree
``((g0+g1)+(g2+g3))+((g4+g5)+(g6+g7))``, then ``+ fp32(bias)``, then one rounding.

Why: a row-parallel layer on T GPUs gives each rank whole groups; each rank reduces its
complete subtrees and the ranks exchange those fp32 node sums (transport moves bits, it never
adds), so every T whose ranges cut at group boundaries gives bitwise this op's result.  The
bits differ from ``batchinv.linear``'s (another K order) and, like them, cannot depend on M.

Gradients are ``batchinv.linear``'s backward (the registry's ``linear.backward``): the
gradient formulas do not depend on the forward's K order.

- ``linear_k_group_partials(x, weight, *, group_width, groups)``: the fp32 group partials
  ``[groups, *x.shape[:-1], out]`` of a shard of whole groups (never carries a gradient).
- ``k_group_tree_sum(partials)``: the tree over ``P`` in 1, 2, 4, 8 fp32 partials;
  ``k_group_tree_finish(partials, bias, out_dtype)``: the tree, the bias, one rounding.
- ``linear_k_groups(x, weight, bias=None)``: the whole op, in ``x.dtype``.

CPU runs the strict reference (``batchinv.reference.linear``); CUDA the kernels of
``kernels_cu/linear.cu`` (``linear_kgroup_*``); HIP has no kernels for it and raises
``BackendNotImplementedError`` (no fallback).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import registry
from ..gpu import linear as gpu_linear
from ..reference import linear as reference
from ..reference.linear import K_GROUPS, k_group_width
from ..validation import check_linear_args
from ._custom_op import CustomOp
from .linear import _custom_backward, _fake, _needs_grad, linear_function

__all__ = [
    "K_GROUPS",
    "k_group_tree_finish",
    "k_group_tree_sum",
    "k_group_width",
    "linear_k_group_partials",
    "linear_k_groups",
]


def linear_k_groups(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x [..., in] · weight[out, in]ᵀ (+ bias[out])`` in ``x``'s dtype over the K-group
    tree (module docstring): ``K_GROUPS`` partials of ``k_group_width(in)`` columns, the fixed
    tree, ``+ bias`` in fp32, one rounding.  Bitwise the same for a row whatever the batch,
    and bitwise what a row-parallel layer of whole groups gives on any number of GPUs.
    Differentiable, with ``batchinv.linear``'s backward."""
    if torch.compiler.is_compiling():  # one opaque node (the custom op below)
        return torch.ops.batchinv.linear_k_groups(x, weight, bias)
    check_linear_args(x, weight, bias)
    if _needs_grad(x, weight, bias):
        return _LinearKGroups.apply(x, weight, bias)
    return registry.lookup("linear_k_groups.forward", x.device)(x, weight, bias)


def linear_k_group_partials(x: Tensor, weight: Tensor, *, group_width: int, groups: int) -> Tensor:
    """fp32 ``[groups, *x.shape[:-1], out]``: group g reduces the columns
    ``[g*group_width, min((g+1)*group_width, K))`` of ``x`` and ``weight`` (K = their
    ``in_features``) as ``linear_k_groups`` does; a group starting at or past K is all ``+0.0``.

    ``group_width`` must be a positive multiple of 64 and ``1 <= groups <= K_GROUPS``, with
    ``groups * group_width >= K`` (no column left over); the last non-empty group may be
    partial, so a rank passes its shard ``x[..., g_lo*w : min(g_hi*w, K)]`` with
    ``groups = g_hi - g_lo`` and ``group_width = k_group_width(K)`` of the full K.

    Not differentiable: the result never carries a gradient, on any backend.  A row-parallel
    layer's backward is ``batchinv.linear``'s on its shard (the gradients do not depend on the
    forward's K order, and each input column's gradient is its own reduction)."""
    if torch.compiler.is_compiling():
        return torch.ops.batchinv.linear_k_group_partials(x, weight, group_width, groups)
    reference.check_k_group_args(x, weight, group_width, groups)
    run = registry.lookup("linear_k_groups.partials", x.device)
    with torch.no_grad():  # the CPU reference's torch ops would otherwise record a graph
        return run(x, weight, group_width, groups)


def k_group_tree_sum(partials: Tensor) -> Tensor:
    """fp32: the fixed balanced tree over ``partials [P, ...]`` (fp32, P in 1, 2, 4, 8), pairs
    added level by level: ``((p0+p1)+(p2+p3))+((p4+p5)+(p6+p7))`` for P = 8, which is
    ``tree(first half) + tree(second half)``.  P = 1 returns the view ``partials[0]`` (no copy).
    A non-fp32 ``partials`` is a TypeError: partial sums are combined in fp32."""
    if torch.compiler.is_compiling() or not isinstance(partials, Tensor):
        # Elementwise adds only: traced as they are, with the same bits on every device.
        return reference.k_group_tree_sum(partials)
    reference.check_k_group_partials(partials)
    if partials.shape[0] == 1:
        return partials[0]
    return registry.lookup("linear_k_groups.tree_sum", partials.device)(partials)


def k_group_tree_finish(partials: Tensor, bias: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    """``k_group_tree_sum(partials) + fp32(bias)`` rounded once to ``out_dtype``: how
    ``linear_k_groups`` ends, from the node sums of a row-parallel layer's ranks (one launch on
    CUDA).  ``partials`` fp32 ``[P, ..., out]`` with P in 1, 2, 4, 8; ``bias`` None or
    ``[out]`` of ``out_dtype``."""
    reference.check_k_group_partials(partials)
    if bias is not None and (bias.shape != partials.shape[-1:] or bias.dtype != out_dtype):
        raise ValueError(
            f"bias must be [{partials.shape[-1]}] of {out_dtype}, got "
            f"{tuple(bias.shape)} {bias.dtype}"
        )
    with torch.no_grad():
        return registry.lookup("linear_k_groups.tree_finish", partials.device)(
            partials, bias, out_dtype
        )


def _cuda_tree_finish(partials: Tensor, bias: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    if out_dtype == torch.float32:  # the fp32 node sum, then the bias: no rounding to do
        acc = gpu_linear.k_group_tree(partials.contiguous())
        return acc if bias is None else acc + bias
    return gpu_linear.k_group_tree(partials.contiguous(), bias, out_dtype)


_LinearKGroups = linear_function("linear_k_groups.forward")


def _reference_forward(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return reference.linear_k_groups_fp32(x, weight, bias).to(x.dtype)


registry.register("linear_k_groups.forward", "cpu")(_reference_forward)
registry.register("linear_k_groups.partials", "cpu")(reference.linear_k_group_partials)
registry.register("linear_k_groups.tree_sum", "cpu")(reference.k_group_tree_sum)
registry.register("linear_k_groups.forward", "cuda")(gpu_linear.k_groups_forward)
registry.register("linear_k_groups.partials", "cuda")(gpu_linear.k_group_partials_forward)
registry.register("linear_k_groups.tree_sum", "cuda")(gpu_linear.k_group_tree_sum)
registry.register("linear_k_groups.tree_finish", "cpu")(reference.k_group_tree_finish)
registry.register("linear_k_groups.tree_finish", "cuda")(_cuda_tree_finish)


# ----------------------------------------------------------------------------- custom ops


def _partials_eager(x, weight, group_width, groups):
    return linear_k_group_partials(x, weight, group_width=group_width, groups=groups)


def _partials_fake(x, weight, group_width, groups):
    reference.check_k_group_args(x, weight, group_width, groups)
    return x.new_empty((groups, *x.shape[:-1], weight.shape[0]), dtype=torch.float32)


CustomOp(
    "linear_k_groups",
    "(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
    linear_k_groups,
    _fake,
    (0, 1, 2),
    backward=_custom_backward,  # batchinv.linear's: the gradients do not follow the K order
)
CustomOp(
    "linear_k_group_partials",
    "(Tensor x, Tensor weight, int group_width, int groups) -> Tensor",
    _partials_eager,
    _partials_fake,
    (),
)

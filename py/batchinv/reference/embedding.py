"""Embedding: ``out[i] = weight[ids[i]]``, the strict reference.

A gather has no reduction in the forward pass, so the low-precision path and the
fp32 path only differ by the output dtype.  The weight gradient does reduce: every
row of ``grad_weight`` is the sum of ``grad_out`` over the positions holding that id.
The reference accumulates those in fp32, in increasing position order, one add per
occurrence, and rounds once to the weight dtype; nothing in that order depends on
which other ids are in the batch.  This is also what the CUDA kernel computes, so the
two agree bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..validation import check_embedding_args

SUPPORTED_TABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def embedding(ids: Tensor, weight: Tensor, check_ids: bool = True) -> Tensor:
    """Low-precision path: ``weight[ids]`` in ``weight``'s dtype (any shape of ``ids``).

    On the CPU the ids are always checked (it costs no device synchronisation here);
    ``check_ids`` exists so the signature matches the GPU implementation.
    """
    check_embedding_args(ids, weight)
    return weight.index_select(0, ids.reshape(-1).long()).reshape(*ids.shape, weight.shape[1])


def embedding_fp32(ids: Tensor, weight: Tensor) -> Tensor:
    """Strict fp32 path: the gathered rows upcast to fp32 (the table itself is not upcast)."""
    return embedding(ids, weight).float()


def embedding_backward(
    ids: Tensor, grad_out: Tensor, num_embeddings: int, dtype: torch.dtype
) -> Tensor:
    """``grad_weight`` with per-id sums in fp32 over increasing positions, rounded once.

    The adds are done in rounds: round r adds the r-th occurrence of every id that
    occurs more than r times.  Within a round every id appears once, so an indexed
    add has no collisions, and each row of the result sees its adds in position order.
    An id outside ``[0, num_embeddings)`` (reachable only with the id check skipped) has no
    row: its gradient is dropped, as on the GPU.
    """
    flat_ids = ids.reshape(-1).long()
    grads = grad_out.reshape(flat_ids.numel(), -1).float()
    in_range = (flat_ids >= 0) & (flat_ids < num_embeddings)
    if not bool(in_range.all()):
        flat_ids, grads = flat_ids[in_range], grads[in_range]
    hidden = grads.shape[1]
    acc = torch.zeros(num_embeddings, hidden, dtype=torch.float32, device=grads.device)
    if flat_ids.numel() == 0:
        return acc.to(dtype)
    sorted_ids, order = torch.sort(flat_ids, stable=True)
    starts = torch.ones_like(sorted_ids, dtype=torch.bool)
    starts[1:] = sorted_ids[1:] != sorted_ids[:-1]
    positions = torch.arange(len(sorted_ids), device=sorted_ids.device)
    group_start = torch.cummax(torch.where(starts, positions, 0), 0).values
    rank = positions - group_start
    for r in range(int(rank.max()) + 1):
        take = rank == r
        rows = sorted_ids[take]
        acc[rows] = acc[rows] + grads[order[take]]
    return acc.to(dtype)


class _EmbeddingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(ids)
        ctx.weight_shape = weight.shape
        ctx.weight_dtype = weight.dtype
        return embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        (ids,) = ctx.saved_tensors
        grad_weight = embedding_backward(ids, grad_out, ctx.weight_shape[0], ctx.weight_dtype)
        return None, grad_weight


def embedding_with_grad(ids: Tensor, weight: Tensor) -> Tensor:
    """``embedding`` with the fixed-order weight gradient above under autograd."""
    return _EmbeddingFunction.apply(ids, weight)


class EmbeddingReference(nn.Module):
    """The reference as a module: ``forward`` keeps the table dtype, ``forward_fp32`` gives fp32."""

    def __init__(self, weight: Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight)

    def forward(self, ids: Tensor) -> Tensor:
        return embedding_with_grad(ids, self.weight)

    def forward_fp32(self, ids: Tensor) -> Tensor:
        return embedding_fp32(ids, self.weight)

"""``batchinv.embedding``: ``weight[ids]`` with a deterministic weight gradient.

The forward is a gather, bitwise equal to ``weight[ids]`` on every backend.  The weight
gradient sums each id's rows in fp32 in increasing position order and rounds once, so it
is bitwise identical run to run on its own, not through ``torch.use_deterministic_algorithms``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import registry
from ..gpu import embedding as gpu_embedding
from ..reference import embedding as reference
from ..validation import check_embedding_args
from ._checked import CheckedCalls
from ._custom_op import CustomOp


def embedding(ids: Tensor, weight: Tensor, *, check_ids: bool = True) -> Tensor:
    """Rows of ``weight`` ([vocab, hidden]; fp32, bf16 or fp16) picked by ``ids`` (int32/int64).

    Returns ``[*ids.shape, hidden]`` in ``weight``'s dtype.  An id outside ``[0, vocab)``
    raises ``IndexError`` naming its position.  On a GPU that check reads a flag back from
    the device (one synchronisation per call); ``check_ids=False`` skips the read, and
    rows of out-of-range ids then come back filled with NaN (never read from memory).
    Differentiable with respect to ``weight``.
    """
    if torch.compiler.is_compiling():  # one opaque node (the custom op below)
        return torch.ops.batchinv.embedding(ids, weight, check_ids)
    signature = _signature(ids, weight)
    if signature is not None:
        # Its signature's checks run once; no gradient wanted: the forward without an
        # autograd node (the same gather and check).
        table = _GRAD if torch.is_grad_enabled() and weight.requires_grad else _FORWARD
        return table.lookup(signature, ids, weight)(ids, weight, check_ids)
    check_embedding_args(ids, weight, check_values=False)
    if torch.is_grad_enabled() and weight.requires_grad:
        return _Embedding.apply(ids, weight, check_ids)
    return registry.lookup("embedding.forward", weight.device)(ids, weight, check_ids)


def _signature(ids: Tensor, weight: Tensor) -> tuple | None:
    """What ``check_embedding_args`` reads without values (``_checked``), or None for
    arguments without tensor attributes."""
    try:
        return (
            ids.__class__, ids.shape, ids.dtype, ids.device,
            weight.__class__, weight.shape, weight.dtype, weight.device,
        )  # fmt: skip
    except AttributeError:
        return None


def _resolve_forward(ids: Tensor, weight: Tensor):
    check_embedding_args(ids, weight, check_values=False)
    return registry.lookup("embedding.forward", weight.device)


def _resolve_grad(ids: Tensor, weight: Tensor):
    check_embedding_args(ids, weight, check_values=False)
    return _Embedding.apply


_FORWARD = CheckedCalls(_resolve_forward)
_GRAD = CheckedCalls(_resolve_grad)


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: Tensor, weight: Tensor, check_ids: bool) -> Tensor:
        out = registry.lookup("embedding.forward", weight.device)(ids, weight, check_ids)
        ctx.save_for_backward(ids)
        ctx.num_embeddings = weight.shape[0]
        ctx.weight_dtype = weight.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        (ids,) = ctx.saved_tensors
        backward = registry.lookup("embedding.backward", grad_out.device)
        return None, backward(ids, grad_out, ctx.num_embeddings, ctx.weight_dtype), None


for _backend in ("cuda", "hip"):
    registry.register("embedding.forward", _backend)(gpu_embedding.forward)
    registry.register("embedding.backward", _backend)(gpu_embedding.backward)
registry.register("embedding.forward", "cpu")(reference.embedding)
registry.register("embedding.backward", "cpu")(reference.embedding_backward)


# ----------------------------------------------------------------------------- custom op


def _eager(ids, weight, check_ids):
    return embedding(ids, weight, check_ids=check_ids)


def _fake(ids, weight, check_ids):
    check_embedding_args(ids, weight, check_values=False)
    return weight.new_empty((*ids.shape, weight.shape[1]))


CustomOp("embedding", "(Tensor ids, Tensor weight, bool check_ids) -> Tensor", _eager, _fake, (1,))

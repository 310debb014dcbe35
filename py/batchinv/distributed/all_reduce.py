"""Collectives that move bits and never add: the invariant all-reduce and a padded gather.

``torch.distributed.all_reduce`` sums in an order chosen by the backend (ring, tree, the
arrival of chunks), so its result can differ with the world size, the algorithm and even
between ranks.  Here every rank gathers every contribution (``all_gather_into_tensor``
copies bytes) and adds them itself in one fixed tree over the ranks: the result is the same
bits on every rank and independent of timing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .tree import rank_tree_sum

# ``all_gather_single`` is the newer name of ``all_gather_into_tensor`` (same arguments).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def world_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """``(world size, rank)`` in ``group`` (the default group for None)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group "
            "first (gloo on the CPU, nccl on CUDA)"
        )
    return dist.get_world_size(group), dist.get_rank(group)


def gather_stacked(t: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """``[world, *t.shape]``: every rank's ``t`` (same shape and dtype on every rank), in
    rank order; a copy of bytes, no arithmetic."""
    world, _ = world_and_rank(group)
    flat = t.contiguous().reshape(-1)
    # The concatenated form (world * n elements) is the one every backend takes (gloo only
    # that one).
    out = torch.empty(world * flat.numel(), dtype=t.dtype, device=t.device)
    if flat.numel():
        if flat.is_cuda and dist.get_backend(group) == "gloo":
            # gloo moves host memory: the bytes go through the CPU (several ranks may share a
            # GPU this way); the result is the same bytes as NCCL's gather.
            host = torch.empty(out.shape, dtype=out.dtype)
            _all_gather_single(host, flat.cpu(), group=group)
            out.copy_(host)
        else:
            _all_gather_single(out, flat, group=group)
    return out.view(world, *t.shape)


def backend_all_reduce(t: Tensor, group: dist.ProcessGroup | None = None) -> None:
    """The backend's own in-place sum of ``t`` over the ranks (its order, its arithmetic: not
    invariant; the stock layers' anchor).  On a gloo group a CUDA ``t`` goes through host
    memory, as in ``gather_stacked``."""
    if t.is_cuda and dist.get_backend(group) == "gloo":
        host = t.cpu()
        dist.all_reduce(host, group=group)
        t.copy_(host)
    else:
        dist.all_reduce(t, group=group)


def invariant_all_reduce(t: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """The sum of every rank's ``t`` (fp32, same shape on every rank), bitwise identical on
    every rank and whatever the order in which contributions arrive.

    Gathers ``[world, ...]`` and adds in the fixed tree over ranks (``tree.rank_tree_sum``:
    neighbours paired level by level, an odd last one carried up).  Partial sums must travel
    in fp32: a bf16 or fp16 ``t`` is a TypeError.  Not by itself equal to a single GPU's
    result: that needs the K-group layout (``row_parallel_linear``).
    """
    if not isinstance(t, Tensor):
        raise TypeError(f"t must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise TypeError(
            f"t must be float32 (partial sums travel in fp32 and are rounded once, after the "
            f"tree), got {t.dtype}"
        )
    return rank_tree_sum(gather_stacked(t, group))


def gather_variable(
    tensors: Sequence[Tensor],
    counts: Sequence[int],
    group: dist.ProcessGroup | None = None,
    *,
    shape: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
) -> list[list[Tensor]]:
    """Every rank's list of same-shape tensors: ``result[r]`` is rank r's list.

    ``counts[r]`` is how many tensors rank r sends, known to every rank in advance (so no
    count is exchanged); each rank pads its stack to ``max(counts)`` and one
    ``all_gather_into_tensor`` moves everything.  ``shape``, ``dtype`` and ``device`` describe
    one tensor (needed only when this rank sends none)."""
    world, rank = world_and_rank(group)
    if len(counts) != world:
        raise ValueError(f"counts must have one entry per rank ({world}), got {len(counts)}")
    if len(tensors) != counts[rank]:
        raise ValueError(
            f"tensors must hold counts[{rank}] = {counts[rank]} tensors on rank {rank}, "
            f"got {len(tensors)}"
        )
    if tensors:
        shape, dtype, device = tensors[0].shape, tensors[0].dtype, tensors[0].device
        for i, t in enumerate(tensors):
            if t.shape != shape or t.dtype != dtype:
                raise ValueError(
                    f"tensors must share a shape and dtype: tensors[{i}] is "
                    f"{tuple(t.shape)} {t.dtype}, tensors[0] {tuple(shape)} {dtype}"
                )
    elif shape is None or dtype is None or device is None:
        raise ValueError("shape, dtype and device are needed when this rank sends no tensor")
    most = max(counts)
    stack = torch.zeros((most, *shape), dtype=dtype, device=device)
    for i, t in enumerate(tensors):
        stack[i].copy_(t)
    gathered = gather_stacked(stack, group)
    return [list(gathered[r, : counts[r]].unbind(0)) for r in range(world)]


__all__ = [
    "backend_all_reduce",
    "gather_stacked",
    "gather_variable",
    "invariant_all_reduce",
    "world_and_rank",
]

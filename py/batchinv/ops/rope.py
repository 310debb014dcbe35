"""``batchinv.rope``: rotary position embedding (Qwen3 / HF rotate-half), batch invariant.

On the CPU the op is the reference (``batchinv.reference.rope``); on CUDA/HIP it is
``kernels_cu/rope.cu``.  There is no reduction: a token's rotation depends only on its own
vectors and its absolute position id, so prefill, chunked prefill and decode give it the
same bits.  The two backends agree within the contract's elementwise tolerance (their
cos/sin differ by an ulp or two).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import registry
from ..gpu import rope as gpu
from ..reference import rope as reference
from ..validation import DEFAULT_MAX_POSITION, check_rope_args
from ._checked import CheckedCalls
from ._custom_op import CustomOp


def rope(
    q: Tensor,
    k: Tensor,
    position_ids: Tensor,
    *,
    theta: float,
    head_dim: int | None = None,
    max_position: int = DEFAULT_MAX_POSITION,
    check_positions: bool = True,
) -> tuple[Tensor, Tensor]:
    """Rotates ``q: [*tokens, Hq, d]`` and ``k: [*tokens, Hkv, d]`` by their tokens' absolute
    ``position_ids: [*tokens]`` (int32/int64); returns new tensors ``(q_rot, k_rot)``.

    ``inv_freq = 1 / theta^(2j/d)`` (HF's fp32 formula), ``angle = position * inv_freq`` in
    fp32, ``out[:h] = x1*cos - x2*sin``, ``out[h:] = x2*cos + x1*sin`` in fp32, one rounding
    to the inputs' dtype.  A position outside ``[0, max_position)`` raises IndexError naming
    it; on a GPU that check reads a flag back from the device (one synchronisation per call),
    and ``check_positions=False`` skips it (such tokens then come back as NaN).
    Differentiable in q and k (the backward is the inverse rotation); inputs never modified.
    """
    if torch.compiler.is_compiling():  # one opaque node (the custom op below)
        args = (theta, head_dim, max_position, check_positions)
        return torch.ops.batchinv.rope(q, k, position_ids, *args)
    signature = _signature(q, k, position_ids, theta, head_dim, max_position, check_positions)
    if signature is None:
        run = _resolve(q, k, position_ids, theta, head_dim, max_position, check_positions)
    else:
        run = _CHECKED.lookup(
            signature, q, k, position_ids, theta, head_dim, max_position, check_positions
        )
    return run(
        q,
        k,
        position_ids,
        theta=theta,
        head_dim=head_dim,
        max_position=max_position,
        check_positions=check_positions,
    )


def _check_args(q, k, position_ids, theta, head_dim, max_position) -> None:
    """Every check of ``rope``'s arguments that reads no tensor values (the positions are
    checked by the implementation: the kernel's flag, or the reference on the CPU)."""
    check_rope_args(
        q,
        k,
        position_ids,
        theta=theta,
        head_dim=head_dim,
        max_position=max_position,
        check_values=False,
    )


# ----------------------------------------------------------------------------- host path
# Every call runs its signature's checks once (``_checked``), with or without gradients: what
# the checks read is the tensors' class, shape, dtype and device and the plain arguments
# with their class (the checks tell ``1`` from ``True``).  Whether a call records an autograd
# node is decided by the implementation on each call, so ``requires_grad`` is not part of it.


_SCALAR_CLASSES = ({float, int}, {int, type(None)}, {int}, {bool})


def _signature(q, k, position_ids, theta, head_dim, max_position, check_positions):
    """What the checks read, or None where a full check must run (arguments without tensor
    attributes, plain arguments of another type: they may not even be hashable)."""
    scalars = (theta, head_dim, max_position, check_positions)
    for value, classes in zip(scalars, _SCALAR_CLASSES, strict=True):
        if value.__class__ not in classes:
            return None
    try:
        return (
            q.__class__, q.shape, q.dtype, q.device,
            k.__class__, k.shape, k.dtype, k.device,
            position_ids.__class__, position_ids.shape, position_ids.dtype, position_ids.device,
            theta.__class__, theta, head_dim.__class__, head_dim,
            max_position.__class__, max_position, check_positions.__class__, check_positions,
        )  # fmt: skip
    except AttributeError:
        return None


def _resolve(q, k, position_ids, theta, head_dim, max_position, check_positions):
    _check_args(q, k, position_ids, theta, head_dim, max_position)
    if not isinstance(check_positions, bool):
        raise TypeError(f"check_positions must be a bool, got {type(check_positions).__name__}")
    return registry.lookup("rope", q.device)


_CHECKED = CheckedCalls(_resolve)


class _RopeGPU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, position_ids, theta, max_position, check_positions):
        q_rot, k_rot = gpu.forward(q, k, position_ids, theta, max_position, check_positions)
        # The positions as the kernel reads them (a view unless they were not contiguous), so
        # the backward needs no reshape or copy of its own.
        ctx.save_for_backward(position_ids.reshape(-1).contiguous())
        ctx.theta = theta
        ctx.max_position = max_position
        return q_rot, k_rot

    @staticmethod
    def backward(ctx, grad_q_rot: Tensor, grad_k_rot: Tensor):
        (position_ids,) = ctx.saved_tensors
        grad_q, grad_k = gpu.backward(
            grad_q_rot, grad_k_rot, position_ids, ctx.theta, ctx.max_position
        )
        return grad_q, grad_k, None, None, None, None


def _gpu_rope(q, k, position_ids, *, theta, head_dim, max_position, check_positions):
    # Arguments were validated by ``rope``; head_dim only states the expected last dimension.
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return _RopeGPU.apply(q, k, position_ids, theta, max_position, check_positions)
    # No gradient wanted: the same kernel without an autograd node.
    return gpu.forward(q, k, position_ids, theta, max_position, check_positions)


def _cpu_rope(q, k, position_ids, *, theta, head_dim, max_position, check_positions):
    # The reference always checks the position ids (reading them costs nothing on the CPU).
    return reference.rope(
        q, k, position_ids, theta=theta, head_dim=head_dim, max_position=max_position
    )


for _backend in ("cuda", "hip"):
    registry.register("rope", _backend)(_gpu_rope)
registry.register("rope", "cpu")(_cpu_rope)


# ----------------------------------------------------------------------------- custom op


def _eager(q, k, position_ids, theta, head_dim, max_position, check_positions):
    return rope(
        q,
        k,
        position_ids,
        theta=theta,
        head_dim=head_dim,
        max_position=max_position,
        check_positions=check_positions,
    )


def _fake(q, k, position_ids, theta, head_dim, max_position, check_positions):
    # The validator wants a Python int; the head dim is a constant of the model.
    head_dim = int(q.shape[-1]) if head_dim is None else head_dim
    _check_args(q, k, position_ids, theta, head_dim, max_position)
    return (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        torch.empty_like(k, memory_format=torch.contiguous_format),
    )


CustomOp(
    "rope",
    "(Tensor q, Tensor k, Tensor position_ids, float theta, int? head_dim, int max_position, "
    "bool check_positions) -> (Tensor, Tensor)",
    _eager,
    _fake,
    (0, 1),
)

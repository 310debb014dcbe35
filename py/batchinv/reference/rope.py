"""Rotary position embedding (Qwen3 / Hugging Face rotate-half convention), the strict reference.

Layout (token-major, as vLLM and flash-attn use it; HF's ``[B, H, S, d]`` is its transpose):
``q: [*tokens, Hq, d]``, ``k: [*tokens, Hkv, d]``, ``position_ids: [*tokens]`` (int32/int64),
with the same ``tokens`` shape for all three: ``[B, S, H, d]`` with ``[B, S]``, or a packed
varlen batch ``[T, H, d]`` with ``[T]``.  Each token's position id applies to all its heads.

With ``h = d / 2``, ``inv_freq[j] = 1 / theta^(2j / d)`` in fp32 exactly as HF computes it
(``rope_inv_freq``), ``angle[t, j] = float32(position_ids[t]) * inv_freq[j]`` (the position
converts exactly because it is below 2^24), ``cos``/``sin`` of it in fp32, and for every head

    out[..., :h] = x[..., :h] * cos - x[..., h:] * sin
    out[..., h:] = x[..., h:] * cos + x[..., :h] * sin

in fp32, rounded once to the input dtype.  (HF's ``x * cos + rotate_half(x) * sin`` is the
same arithmetic in fp32, since ``a + (-b)`` is ``a - b`` in IEEE.  In bf16/fp16 HF rounds cos
and sin to the model dtype and rounds every product and the sum; this path does not.)

There is no reduction, so batch invariance comes from the angles: a token's cos/sin depend
only on its own position id.  The position ids are absolute, so chunked prefill and decode
give a token the same bits.  cos/sin are evaluated in fixed blocks of ``ROPE_TABLE_BLOCK``
consecutive positions (block ``b`` covers ``[64 b, 64 b + 64)``), each block one fresh
``[64, h]`` call: entry ``(p, j)`` is always element ``(p mod 64, j)`` of the same-shaped call,
whatever other positions the batch holds.  torch's CPU elementwise kernels may take a
different code path for an element depending on where it falls in a call (vector body or
scalar tail; measured for ``torch.sigmoid``), so the reference does not rely on them being
position-independent.

Backward: the transpose of the rotation, elementwise in fp32 with the same cos/sin,
``dx[..., :h] = dy[..., :h] * cos + dy[..., h:] * sin``,
``dx[..., h:] = dy[..., h:] * cos - dy[..., :h] * sin``, rounded once to the input dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..contract import deterministic_context
from ..validation import (
    DEFAULT_MAX_POSITION,
    FLOAT_DTYPES,
    check_rope_args,
    check_rope_params,
)
from ..validation import MAX_EXACT_POSITION as MAX_EXACT_POSITION  # the reference's limit

SUPPORTED_DTYPES = FLOAT_DTYPES
ROPE_TABLE_BLOCK = 64


def rope_inv_freq(head_dim: int, theta: float) -> Tensor:
    """``1 / theta^(arange(0, d, 2) / d)`` in fp32 on the CPU, HF's formula and bits.

    A GPU op should take this tensor rather than recompute it, so the two agree.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    return 1.0 / (theta**exponents)


def rope_cos_sin(position_ids: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """fp32 ``(cos, sin)`` of shape ``[*position_ids.shape, head_dim // 2]`` (CPU).

    Built per block of ``ROPE_TABLE_BLOCK`` positions with a fixed-shape call, so an entry
    depends on its position id only (see the module docstring).
    """
    inv_freq = rope_inv_freq(head_dim, theta)
    flat = position_ids.reshape(-1).to(device="cpu", dtype=torch.int64)
    half = head_dim // 2
    cos = torch.empty(flat.numel(), half, dtype=torch.float32)
    sin = torch.empty(flat.numel(), half, dtype=torch.float32)
    block_of = torch.div(flat, ROPE_TABLE_BLOCK, rounding_mode="floor")
    for block in torch.unique(block_of).tolist():
        first = block * ROPE_TABLE_BLOCK
        positions = torch.arange(first, first + ROPE_TABLE_BLOCK, dtype=torch.float32)
        angles = positions.unsqueeze(-1) * inv_freq
        take = block_of == block
        offsets = flat[take] - first
        cos[take] = torch.cos(angles)[offsets]
        sin[take] = torch.sin(angles)[offsets]
    shape = (*position_ids.shape, half)
    return cos.reshape(shape), sin.reshape(shape)


def _rotate32(x32: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x32.shape[-1] // 2
    x1, x2 = x32[..., :half], x32[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _rotate_transpose32(g32: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = g32.shape[-1] // 2
    g1, g2 = g32[..., :half], g32[..., half:]
    return torch.cat((g1 * cos + g2 * sin, g2 * cos - g1 * sin), dim=-1)


def _head_broadcast(table: Tensor, device: torch.device) -> Tensor:
    """``[*tokens, h] -> [*tokens, 1, h]`` so it broadcasts over heads."""
    return table.to(device).unsqueeze(-2)


class _RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, position_ids: Tensor, theta: float):
        cos, sin = rope_cos_sin(position_ids, q.shape[-1], theta)
        cos, sin = _head_broadcast(cos, q.device), _head_broadcast(sin, q.device)
        ctx.save_for_backward(cos, sin)
        ctx.dtypes = (q.dtype, k.dtype)
        q_rot = _rotate32(q.float(), cos, sin).to(q.dtype)
        k_rot = _rotate32(k.float(), cos, sin).to(k.dtype)
        return q_rot, k_rot

    @staticmethod
    def backward(ctx, grad_q_rot: Tensor, grad_k_rot: Tensor):
        cos, sin = ctx.saved_tensors
        q_dtype, k_dtype = ctx.dtypes
        grad_q = _rotate_transpose32(grad_q_rot.float(), cos, sin).to(q_dtype)
        grad_k = _rotate_transpose32(grad_k_rot.float(), cos, sin).to(k_dtype)
        return grad_q, grad_k, None, None


def rope(
    q: Tensor,
    k: Tensor,
    position_ids: Tensor,
    *,
    theta: float,
    head_dim: int | None = None,
    max_position: int = DEFAULT_MAX_POSITION,
) -> tuple[Tensor, Tensor]:
    """Low-precision path: rotate ``q`` and ``k`` in fp32, one rounding to their dtype.

    ``head_dim`` (optional) states the expected last dimension; partial rotary is not
    supported.  Position ids must lie in ``[0, max_position)`` (IndexError otherwise).
    Zero tokens give empty outputs.  Differentiable; the inputs are never modified.
    """
    check_rope_args(q, k, position_ids, theta=theta, head_dim=head_dim, max_position=max_position)
    return _RopeFunction.apply(q, k, position_ids, theta)


def rope_fp32(
    q: Tensor,
    k: Tensor,
    position_ids: Tensor,
    *,
    theta: float,
    head_dim: int | None = None,
    max_position: int = DEFAULT_MAX_POSITION,
) -> tuple[Tensor, Tensor]:
    """Strict fp32 path: the same definition on upcast ``q``/``k``, returned in fp32."""
    check_rope_args(q, k, position_ids, theta=theta, head_dim=head_dim, max_position=max_position)
    with deterministic_context():
        return _RopeFunction.apply(q.float(), k.float(), position_ids, theta)


def rope_backward(
    grad_q_rot: Tensor,
    grad_k_rot: Tensor,
    position_ids: Tensor,
    *,
    theta: float,
    max_position: int = DEFAULT_MAX_POSITION,
) -> tuple[Tensor, Tensor]:
    """``(grad_q, grad_k)``: the rotation's transpose in fp32, rounded to the grads' dtypes."""
    check_rope_args(
        grad_q_rot,
        grad_k_rot,
        position_ids,
        theta=theta,
        max_position=max_position,
        names=("grad_q_rot", "grad_k_rot"),
    )
    cos, sin = rope_cos_sin(position_ids, grad_q_rot.shape[-1], theta)
    cos = _head_broadcast(cos, grad_q_rot.device)
    sin = _head_broadcast(sin, grad_q_rot.device)
    grad_q = _rotate_transpose32(grad_q_rot.float(), cos, sin).to(grad_q_rot.dtype)
    grad_k = _rotate_transpose32(grad_k_rot.float(), cos, sin).to(grad_k_rot.dtype)
    return grad_q, grad_k


class RopeReference(nn.Module):
    """The reference as a module (no parameters); ``theta`` is Qwen3's ``rope_theta``."""

    def __init__(self, head_dim: int, theta: float, max_position: int = DEFAULT_MAX_POSITION):
        super().__init__()
        check_rope_params(head_dim, theta, max_position)
        self.head_dim = head_dim
        self.theta = theta
        self.max_position = max_position

    def forward(self, q: Tensor, k: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        return rope(
            q,
            k,
            position_ids,
            theta=self.theta,
            head_dim=self.head_dim,
            max_position=self.max_position,
        )

    def forward_fp32(self, q: Tensor, k: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        return rope_fp32(
            q,
            k,
            position_ids,
            theta=self.theta,
            head_dim=self.head_dim,
            max_position=self.max_position,
        )

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}, max_position={self.max_position}"

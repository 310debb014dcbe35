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

import math

import torch
from torch import Tensor, nn

from .._validate import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_index_range,
    check_same_device,
    check_same_dtype,
    check_tensor,
)
from ..contract import deterministic_context

SUPPORTED_DTYPES = FLOAT_DTYPES
# Every integer below 2^24 is exact in fp32, so angle = position * inv_freq has one rounding
# and distinct positions stay distinct.  Callers pass the model's max_position_embeddings.
MAX_EXACT_POSITION = 1 << 24
DEFAULT_MAX_POSITION = MAX_EXACT_POSITION
ROPE_TABLE_BLOCK = 64


def _check_number(name: str, value: object, *, integer: bool) -> None:
    kinds = int if integer else int | float
    if isinstance(value, bool) or not isinstance(value, kinds):
        want = "int" if integer else "float"
        raise TypeError(f"{name} must be a Python {want}, got {type(value).__name__}")


def check_rope_params(head_dim: int, theta: float, max_position: int) -> None:
    """Validates the scalar parameters: even ``head_dim`` > 0, ``theta`` > 0, ``max_position``."""
    _check_number("head_dim", head_dim, integer=True)
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be even and > 0 (rotate-half pairs), got {head_dim}")
    _check_number("theta", theta, integer=False)
    if not math.isfinite(theta) or theta <= 0:
        raise ValueError(f"theta must be a finite number > 0, got {theta!r}")
    _check_number("max_position", max_position, integer=True)
    if not 1 <= max_position <= MAX_EXACT_POSITION:
        raise ValueError(
            f"max_position must be in [1, {MAX_EXACT_POSITION}] (positions must be exact in "
            f"float32), got {max_position}"
        )


def check_rope_args(
    q: Tensor,
    k: Tensor,
    position_ids: Tensor,
    *,
    theta: float,
    head_dim: int | None = None,
    max_position: int = DEFAULT_MAX_POSITION,
    check_values: bool = True,
    names: tuple[str, str] = ("q", "k"),
) -> None:
    """Validates ``rope``'s arguments; ``check_values`` reads the position ids (a device sync).

    ``names`` are the names reported for ``q`` and ``k`` (the backward passes its grads).
    """
    q_name, k_name = names
    check_tensor(q_name, q, dtypes=SUPPORTED_DTYPES)
    check_tensor(k_name, k, dtypes=SUPPORTED_DTYPES)
    check_tensor("position_ids", position_ids, dtypes=INDEX_DTYPES)
    check_same_device(**{q_name: q, k_name: k, "position_ids": position_ids})
    check_same_dtype(**{q_name: q, k_name: k})
    for name, t in ((q_name, q), (k_name, k)):
        if t.dim() < 3:
            raise ValueError(
                f"{name} must be [*tokens, heads, head_dim] with at least one token dimension, "
                f"got shape {tuple(t.shape)}"
            )
        if t.shape[-2] == 0:
            raise ValueError(f"{name} must have at least one head, got shape {tuple(t.shape)}")
    if head_dim is None:
        head_dim = q.shape[-1]
    check_rope_params(head_dim, theta, max_position)
    for name, t in ((q_name, q), (k_name, k)):
        if t.shape[-1] != head_dim:
            raise ValueError(
                f"{name}.shape[-1] must equal head_dim ({head_dim}), got shape {tuple(t.shape)}"
            )
    if q.shape[:-2] != k.shape[:-2]:
        raise ValueError(
            f"{q_name} and {k_name} must have the same token dimensions, got "
            f"{q_name} {tuple(q.shape)} and {k_name} {tuple(k.shape)}"
        )
    if position_ids.shape != q.shape[:-2]:
        raise ValueError(
            f"position_ids must have shape {q_name}.shape[:-2] = {tuple(q.shape[:-2])}, "
            f"got {tuple(position_ids.shape)}"
        )
    if check_values:
        check_index_range("position_ids", position_ids, max_position)


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

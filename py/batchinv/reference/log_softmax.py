"""Log-softmax over the last dimension, the strict reference.

Definition (fp32 throughout, for each row ``x`` of length V):
1. Cut the row into chunks of ``chunk_size`` columns (a constant, default ``LSE_CHUNK``;
   the last chunk is shorter).  For each chunk c: ``m_c = max(x_c)`` (exact in any order;
   ``+ 0.0`` turns a ``-0`` maximum into ``+0`` so the sign of zero is canonical) and
   ``l_c = sum_j exp(x_cj - m_c)`` left to right (``fixed_order_sum``).
2. Merge the chunk states left to right, starting from chunk 0, with one formula:
   ``m = max(m_a, m_b); l = l_a * exp(m_a - m) + l_b * exp(m_b - m)``.
3. ``lse = m + log(l)`` and ``out = x - lse``; one rounding to ``out_dtype`` (fp32 default).

A row of V <= chunk_size is the classic two-pass log-softmax.  The chunked form is what
the GPU kernel and the fused ``token_logprobs`` compute, so the unfused chain
``log_softmax(linear_fp32(h, W))`` gathers exactly the bits of ``token_logprobs_fp32``.
Every step is elementwise over the rows or a Python loop over one row's columns, so a
row's result cannot depend on the other rows (torch's own softmax/logsumexp choose their
blocking from the shape and are not used).

Rows of all ``-inf`` have no distribution: by definition their output is ``-inf`` in
every position and their gradient is zero (never NaN).  ``-inf - (-inf)`` is avoided by
shifting with 0 instead of ``m`` when ``m = -inf``.  Inputs holding ``+inf`` or NaN give
NaN, as in torch; values are not scanned.

Backward: ``dx = dy - exp(out) * sum(dy)`` in fp32 with the row sum left to right,
``out`` recomputed from ``x`` and the saved fp32 ``lse`` (the unrounded output), one
rounding to ``x.dtype``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..contract import deterministic_context
from ..validation import FLOAT_DTYPES, check_log_softmax_args
from ._fixed_order import fixed_order_sum

SUPPORTED_DTYPES = FLOAT_DTYPES

# Columns per chunk of the online log-sum-exp; a constant of the definition, not of the batch.
LSE_CHUNK = 4096

_NEG_INF = float("-inf")


def _shift(m: Tensor) -> Tensor:
    """The value subtracted before ``exp``: ``m``, or 0 where ``m = -inf`` (no ``-inf - -inf``)."""
    return torch.where(m == _NEG_INF, torch.zeros_like(m), m)


def chunk_lse_state(z: Tensor) -> tuple[Tensor, Tensor]:
    """``(m, l)`` of a chunk ``z [R, C]`` (fp32): exact max, left-to-right sum of ``exp(z - m)``."""
    m = z.amax(dim=-1) + 0.0
    l = fixed_order_sum(torch.exp(z - _shift(m).unsqueeze(-1)), dim=-1)
    return m, l


def lse_merge_scales(m_a: Tensor, m_b: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(m, exp(m_a - m), exp(m_b - m))`` with ``m = max(m_a, m_b)``; both scales 0 if m = -inf."""
    m = torch.maximum(m_a, m_b)
    shift = _shift(m)
    return m, torch.exp(m_a - shift), torch.exp(m_b - shift)


def merge_lse_state(m_a: Tensor, l_a: Tensor, m_b: Tensor, l_b: Tensor) -> tuple[Tensor, Tensor]:
    """The one merge formula: ``l = l_a * exp(m_a - m) + l_b * exp(m_b - m)``."""
    m, scale_a, scale_b = lse_merge_scales(m_a, m_b)
    return m, l_a * scale_a + l_b * scale_b


def lse_state_rows(x32: Tensor, chunk_size: int = LSE_CHUNK) -> tuple[Tensor, Tensor]:
    """The merged ``(m, l)`` of every row of ``x32 [R, V]`` (fp32), chunks left to right."""
    m = l = None
    for start in range(0, x32.shape[-1], chunk_size):
        m_c, l_c = chunk_lse_state(x32[:, start : start + chunk_size])
        m, l = (m_c, l_c) if m is None else merge_lse_state(m, l, m_c, l_c)
    return m, l


def log_sum_exp_rows(x32: Tensor, chunk_size: int = LSE_CHUNK) -> Tensor:
    """``lse = m + log(l)`` of every row of ``x32 [R, V]`` (fp32) by the definition above."""
    m, l = lse_state_rows(x32, chunk_size)
    return m + torch.log(l)


def _output_from_lse(x32: Tensor, lse: Tensor) -> Tensor:
    """``x - lse`` per row; ``-inf`` everywhere in rows whose ``lse`` is ``-inf`` (all ``-inf``)."""
    empty_row = (lse == _NEG_INF).unsqueeze(-1)
    return torch.where(empty_row, torch.full_like(x32, _NEG_INF), x32 - lse.unsqueeze(-1))


def log_softmax_backward(grad_out: Tensor, x: Tensor, lse: Tensor) -> Tensor:
    """``dx = dy - exp(out) * sum(dy)`` per row (fp32, sum left to right), rounded to x.dtype.

    ``lse`` is the fp32 ``[R]`` saved by the forward for ``x`` viewed as ``[R, V]``.
    """
    x32 = x.reshape(-1, x.shape[-1]).float()
    grad = grad_out.reshape(x32.shape).float()
    grad_sum = fixed_order_sum(grad, dim=-1)
    grad_x = grad - torch.exp(_output_from_lse(x32, lse)) * grad_sum.unsqueeze(-1)
    grad_x = torch.where((lse == _NEG_INF).unsqueeze(-1), torch.zeros_like(grad_x), grad_x)
    return grad_x.to(x.dtype).reshape(x.shape)


class _LogSoftmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, out_dtype: torch.dtype, chunk_size: int) -> Tensor:
        x32 = x.reshape(-1, x.shape[-1]).float()
        lse = log_sum_exp_rows(x32, chunk_size)
        ctx.save_for_backward(x, lse)
        return _output_from_lse(x32, lse).to(out_dtype).reshape(x.shape)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, lse = ctx.saved_tensors
        return log_softmax_backward(grad_out, x, lse), None, None


def log_softmax(
    x: Tensor,
    dim: int = -1,
    out_dtype: torch.dtype = torch.float32,
    *,
    chunk_size: int = LSE_CHUNK,
) -> Tensor:
    """Low-precision path: fp32 statistics, output rounded once to ``out_dtype`` (fp32 default).

    ``dim`` must be the last dimension.  Differentiable (fixed-order backward above).
    """
    check_log_softmax_args(x, dim, out_dtype, chunk_size)
    return _LogSoftmaxFunction.apply(x, out_dtype, chunk_size)


def log_softmax_fp32(x: Tensor, dim: int = -1, *, chunk_size: int = LSE_CHUNK) -> Tensor:
    """Strict fp32 path: ``x`` upcast, same definition, fp32 out (differentiable)."""
    check_log_softmax_args(x, dim, torch.float32, chunk_size)
    with deterministic_context():
        return _LogSoftmaxFunction.apply(x.float(), torch.float32, chunk_size)


class LogSoftmaxReference(nn.Module):
    """``forward`` returns ``out_dtype`` (fp32 default), ``forward_fp32`` upcasts the input."""

    def __init__(self, out_dtype: torch.dtype = torch.float32, chunk_size: int = LSE_CHUNK):
        super().__init__()
        self.out_dtype = out_dtype
        self.chunk_size = chunk_size

    def forward(self, x: Tensor) -> Tensor:
        return log_softmax(x, -1, self.out_dtype, chunk_size=self.chunk_size)

    def forward_fp32(self, x: Tensor) -> Tensor:
        return log_softmax_fp32(x, -1, chunk_size=self.chunk_size)

"""``batchinv.enable()``: run an unmodified model with batchinv's batch-invariant ops.

Inside ``with batchinv.enable():`` (or under ``@batchinv.enable()``) these calls are routed:

================================================  ==============================================
stock call                                        routed to
================================================  ==============================================
``F.linear``                                      ``batchinv.linear``
``torch.matmul`` / ``@``, ``mm``, ``bmm``,        ``batchinv.linear`` (fixed K order), once per
``addmm`` (functions and Tensor methods)          batch element for batched products
``F.scaled_dot_product_attention``                ``batchinv.attention`` / ``attention_varlen``
                                                  (masks: ``attention_masks``)
``F.rms_norm`` / ``torch.rms_norm``               ``batchinv.rms_norm``
``mean`` (function and method, any dims)          a fixed pairwise tree over the reduced
                                                  elements (its shape depends on their number
                                                  only), fp32 for bf16/fp16 inputs, ÷ count
``log_softmax``, ``F.log_softmax``                ``batchinv.log_softmax`` (any dim, moved last)
``softmax``, ``F.softmax``                        ``exp(batchinv.log_softmax(x))``
================================================  ==============================================

Why a ``TorchFunctionMode``: it sees the calls as the model wrote them, above autograd, so
(1) a routed call is a batchinv op with batchinv's own fixed-order backward, (2) composite
calls arrive whole (SDPA with its mask, ``is_causal``, ``scale``, ``enable_gqa``; ``F.linear``
rather than a transpose and an ``addmm``), which is what lets a mask be checked and mapped to
lengths.  A ``TorchDispatchMode`` sits below autograd and sees decompositions (SDPA becomes a
backend-specific kernel or a chain of matmul/softmax), so the backward would be the stock
one.  The cost: calls that bypass ``__torch_function__`` (``torch.ops.aten.*`` called
directly, C++ code) are not seen.

Exact or an error: a call the route cannot reproduce (dropout > 0, a float64 input, a mask
that is not padding/causal, ``log_softmax`` without ``dim``, a multi-dimensional
``normalized_shape``) raises ``ValueError``/``TypeError`` inside ``enable()``; it never falls
back to the stock kernel.  Integer matmuls are exact and pass through.  Other stock ops
(``sum``, ``cumsum``, ``norm``, ``var``, stock ``F.embedding`` is a gather and bitwise anyway)
are not routed: a model that reduces with them is not made invariant by ``enable()``.

Differences from stock that are by design: a softmax or attention row that sees no
(unmasked) key gives zeros instead of NaN; ``mean``'s order is the pairwise tree, so its
bits differ from torch's (within fp32 rounding).

``enable()`` is re-entrant (nesting keeps one mode active) and per thread; leaving the
outermost block restores torch exactly.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from ..ops.linear import linear
from ..ops.log_softmax import log_softmax
from ..ops.rms_norm import rms_norm
from .attention_masks import attention_with_mask

__all__ = ["enable", "is_enabled"]

_STATE = threading.local()


# ----------------------------------------------------------------------------- products


def _weight_layout(b: Tensor) -> Tensor:
    """``b [K, N]`` as a linear weight ``[N, K]``; contiguous, as the GPU kernel requires."""
    return b.t().contiguous()


def _matmul(a: Tensor, b: Tensor) -> Tensor:
    """``torch.matmul`` semantics; every output element reduced over K in batchinv's order."""
    if not (a.is_floating_point() and b.is_floating_point()):
        return torch.matmul(a, b)  # integer products are exact
    if a.dim() == 0 or b.dim() == 0:
        raise ValueError("matmul needs tensors of at least 1 dimension")
    if b.dim() == 1:
        return _matmul(a, b.unsqueeze(-1)).squeeze(-1)
    if a.dim() == 1:
        return _matmul(a.unsqueeze(0), b).squeeze(-2)
    if b.dim() == 2:
        return linear(a, _weight_layout(b))
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a3 = a.expand(*batch, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
    b3 = b.expand(*batch, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
    # One fixed-order GEMM per batch element: no element's order depends on the others.
    out = torch.stack([linear(a3[i], _weight_layout(b3[i])) for i in range(a3.shape[0])])
    return out.reshape(*batch, a.shape[-2], b.shape[-1])


def _mm(a: Tensor, b: Tensor) -> Tensor:
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"mm needs 2-d tensors, got {tuple(a.shape)} and {tuple(b.shape)}")
    return _matmul(a, b)


def _bmm(a: Tensor, b: Tensor) -> Tensor:
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0]:
        raise ValueError(
            f"bmm needs [B, M, K] and [B, K, N], got {tuple(a.shape)}, {tuple(b.shape)}"
        )
    return _matmul(a, b)


def _addmm(bias: Tensor, a: Tensor, b: Tensor, *, beta=1, alpha=1) -> Tensor:
    product = _mm(a, b)
    if beta == 1 and alpha == 1 and bias.dim() == 1 and bias.dtype == product.dtype:
        # nn.Linear's addmm: the bias added in fp32 before the one rounding, like F.linear.
        return linear(a, _weight_layout(b), bias)
    if alpha != 1:
        product = product * alpha
    return product + (bias if beta == 1 else bias * beta)  # elementwise: row-local


def _linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    return linear(x, weight, bias)


# ----------------------------------------------------------------------------- reductions


def _tree_sum_last(x: Tensor) -> Tensor:
    """Sum over the last dim by pairwise halving: the tree depends only on its length."""
    while x.shape[-1] > 1:
        n = x.shape[-1]
        half = n // 2
        paired = x[..., :half] + x[..., half : 2 * half]
        x = torch.cat([paired, x[..., 2 * half :]], dim=-1) if n % 2 else paired
    return x[..., 0]


def _mean(x: Tensor, dim=None, keepdim: bool = False, *, dtype: torch.dtype | None = None):
    if not x.is_floating_point() and dtype is None:
        raise TypeError(f"mean needs a floating point input or dtype, got {x.dtype}")
    out_dtype = dtype or x.dtype
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"batchinv.enable() routes mean in fp32/bf16/fp16 only, got {out_dtype}")
    dims = list(range(x.dim())) if dim is None or dim == [] else dim
    dims = sorted({d % max(x.dim(), 1) for d in ([dims] if isinstance(dims, int) else dims)})
    count = 1
    for d in dims:
        count *= x.shape[d]
    kept = [d for d in range(x.dim()) if d not in dims]
    rows = x.permute(*kept, *dims).reshape(*[x.shape[d] for d in kept], count)
    # fp32 accumulation for bf16/fp16, as torch's mean does; one rounding at the end.
    total = _tree_sum_last(rows.to(torch.float32)) if count else rows.new_zeros(rows.shape[:-1])
    out = (total / count).to(out_dtype)
    if keepdim:
        for d in dims:
            out = out.unsqueeze(d)
    return out


def _log_softmax(x: Tensor, dim: int | None = None, _stacklevel: int = 3, dtype=None) -> Tensor:
    if dim is None:
        raise ValueError("log_softmax needs an explicit dim inside batchinv.enable()")
    out_dtype = dtype or x.dtype
    moved = x.movedim(dim, -1)
    return log_softmax(moved, -1, out_dtype).movedim(-1, dim)


def _softmax(x: Tensor, dim: int | None = None, _stacklevel: int = 3, dtype=None) -> Tensor:
    if dim is None:
        raise ValueError("softmax needs an explicit dim inside batchinv.enable()")
    return torch.exp(_log_softmax(x, dim, dtype=torch.float32)).to(dtype or x.dtype)


def _rms_norm(x: Tensor, normalized_shape, weight: Tensor | None = None, eps=None) -> Tensor:
    shape = (
        tuple(normalized_shape) if not isinstance(normalized_shape, int) else (normalized_shape,)
    )
    if shape != tuple(x.shape[-1:]):
        raise ValueError(
            f"batchinv.enable() routes rms_norm over the last dim only: normalized_shape must "
            f"be {tuple(x.shape[-1:])}, got {shape}"
        )
    if weight is None:
        weight = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    return rms_norm(x, weight, float(torch.finfo(x.dtype).eps if eps is None else eps))


# ----------------------------------------------------------------------------- attention


def _sdpa(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    if dropout_p != 0.0:
        raise ValueError(f"batchinv.enable() routes attention without dropout, got {dropout_p}")
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(
            "batchinv.enable() routes scaled_dot_product_attention on [B, H, S, d] inputs, got "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(
            f"query has {query.shape[1]} heads and key {key.shape[1]}: pass enable_gqa=True"
        )
    if is_causal and attn_mask is not None:
        raise ValueError("scaled_dot_product_attention takes attn_mask or is_causal, not both")
    sq, sk = query.shape[2], key.shape[2]
    if is_causal and sq != sk:
        # torch's is_causal is top-left aligned; batchinv's causal is bottom-right.
        attn_mask = torch.ones(sq, sk, dtype=torch.bool, device=query.device).tril()
        is_causal = False
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    out = attention_with_mask(q, k, v, attn_mask, causal=is_causal, softmax_scale=scale)
    return out.transpose(1, 2)


_ROUTES = {
    F.linear: _linear,
    torch.matmul: _matmul,
    Tensor.matmul: _matmul,
    Tensor.__matmul__: _matmul,
    Tensor.__rmatmul__: lambda b, a: _matmul(a, b),
    torch.mm: _mm,
    Tensor.mm: _mm,
    torch.bmm: _bmm,
    Tensor.bmm: _bmm,
    torch.addmm: _addmm,
    Tensor.addmm: _addmm,
    torch.mean: _mean,
    Tensor.mean: _mean,
    torch.log_softmax: _log_softmax,
    Tensor.log_softmax: _log_softmax,
    F.log_softmax: _log_softmax,
    torch.softmax: _softmax,
    Tensor.softmax: _softmax,
    F.softmax: _softmax,
    F.rms_norm: _rms_norm,
    torch.rms_norm: _rms_norm,
    F.scaled_dot_product_attention: _sdpa,
}


class _BatchinvFunctionMode(TorchFunctionMode):
    # torch pops this mode while its handler runs, so batchinv's own calls below are stock.
    def __torch_function__(self, func, types, args=(), kwargs=None):
        route = _ROUTES.get(func)
        if route is None:
            return func(*args, **(kwargs or {}))
        return route(*args, **(kwargs or {}))


class _Enabled(contextlib.ContextDecorator):
    def __enter__(self):
        depth = getattr(_STATE, "depth", 0)
        if depth == 0:
            _STATE.mode = _BatchinvFunctionMode()
            _STATE.mode.__enter__()
        _STATE.depth = depth + 1
        return self

    def __exit__(self, *exc_info):
        _STATE.depth -= 1
        if _STATE.depth == 0:
            mode, _STATE.mode = _STATE.mode, None
            mode.__exit__(*exc_info)
        return False


def enable() -> _Enabled:
    """Context manager and decorator routing stock torch calls to batchinv (module docstring)."""
    return _Enabled()


def is_enabled() -> bool:
    """Whether this thread is inside ``batchinv.enable()``."""
    return getattr(_STATE, "depth", 0) > 0

"""Scaled dot-product attention, the strict reference (GQA, causal, padding, varlen, KV cache).

Definition, for a query row ``q`` of head ``h`` at absolute position ``p`` of its sequence,
with the sequence's keys ``k_0 .. k_{L-1}`` and values ``v_j`` of kv head
``h // (Hq // Hkv)``::

    visible(p) = {j : j < L}                 (non-causal)
               = {j : j <= p and j < L}      (causal)
    s_j  = (q . k_j) * scale                 scale defaults to 1/sqrt(d)
    out  = sum_j softmax(s)_j v_j            over j in visible(p)
    lse  = log sum_j exp(s_j)                (natural log, fp32)

A row with no visible key is "fully masked": ``out = 0`` and ``lse = -inf`` by definition.

Positions.  Queries are the *last* tokens of their sequence: query ``i`` of a sequence with
``Lq`` queries and ``Lk`` keys sits at absolute position ``p = (Lk - Lq) + i``.  The offset
``Lk - Lq`` is the number of keys before the first query (the cached prefix in decode and
chunked prefill; 0 in a plain prefill).  This is flash-attention's bottom-right alignment.

The fixed order, and why decode equals prefill bit for bit.  Keys are processed in blocks
of ``KV_BLOCK = 128`` at fixed *absolute* positions
``[j*128, (j+1)*128)``, intersected with the row's visible keys, blocks in increasing ``j``.
For each non-empty block::

    s    = fixed_order_matmul(q, k_block^T) * scale      fp32, over d in order 0..d-1
    m_b  = max over the block's visible s                (exact; fixed sequential scan)
    p    = exp(s - m_b)                                  0 for invisible keys
    l_b  = fixed_order_sum(p)                            keys in increasing position
    acc_b= sum over visible keys in increasing position of p_j * v_j
    m    = max(m_a, m_b)
    l    = l_a*exp(m_a - m) + l_b*exp(m_b - m)
    acc  = acc_a*exp(m_a - m) + acc_b*exp(m_b - m)

starting from the empty state ``(m, l, acc) = (-inf, 0, 0)``; ``-inf - -inf`` is guarded
so a row that has seen no key keeps that state exactly.  Finally ``out = acc / l`` and
``lse = m + log(l)``.  Every operation is elementwise over rows; the only loops that
reduce are the loops over d, over the keys of a block and over the blocks, and their
lengths and order depend on nothing but the row's absolute position and its own keys.
Other rows in the batch, the padding, the batch size, whether the row is computed in a
prefill, in a chunk of a chunked prefill, alone in a decode step against a KV cache, or
packed in a varlen batch: none of these enters the arithmetic of the row.  Prefill,
chunked prefill, decode and varlen are therefore equal bit for bit *by construction*.
Blocks that hold no visible key for a row (a later block of a shorter row) are skipped by
selection (``torch.where`` on the whole state), not by merging an empty partial, so a
row's bits also do not depend on how many blocks its batch needs.

Padding is never read into the arithmetic: queries and keys are gathered by length into a
working layout whose padding slots come from an appended zero row, and a key that is not
visible to a row is excluded by selection (``-inf`` score, skipped update), never by
multiplying with a mask.  Padding full of NaN therefore cannot leak.

The max is a scan with ``where(x > m, x, m)`` rather than ``torch.maximum``/``amax``:
``torch.maximum(+0.0, -0.0)`` returns different zeros in torch's scalar and vectorised CPU
paths, i.e. depending on where the element sits in the tensor.

Precision.  ``attention`` (the low-precision path) takes bf16/fp16/fp32 inputs, upcasts to
fp32, does all of the above in fp32 (P is *not* rounded to bf16 before PV, unlike flash
kernels) and rounds the output once to the input dtype.  ``lse`` is always fp32.
``attention_fp32`` upcasts and runs the same arithmetic inside ``deterministic_context``.

Backward (``torch.autograd.Function``, fixed order): ``P`` is recomputed from the saved
LSE (``P = exp(s - lse)`` on visible keys), ``D = fixed_order_sum(dO * O)`` over d with the
fp32 forward output ``O``, ``dP = fixed_order_matmul(dO, V^T)``, ``dS = P * (dP - D)``;
``dQ = (sum over visible keys in increasing position of dS_j k_j) * scale``;
``dK = (sum over the group's query heads in increasing order, then over queries in
increasing position, of dS q) * scale``; ``dV`` likewise with ``P`` and ``dO``.  Gradients
are fp32 rounded once to the input dtypes; padding positions get zero gradient.  The LSE
output carries no gradient.

Layouts: padded ``q [B, Sq, Hq, d]``, ``k, v [B, Sk, Hkv, d]``, ``lse [B, Hq, Sq]``;
varlen packed ``q [Tq, Hq, d]``, ``k, v [Tk, Hkv, d]`` with ``cu_seqlens_q/k [B+1]``,
``lse [Hq, Tq]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..kv_cache import KVCache, host_index_copies
from ..validation import (
    MAX_HEAD_DIM,
    check_attention_args,
    check_kv_cache_attention_args,
    check_seqlens_new,
    is_supported_head_dim,
)
from ._fixed_order import fixed_order_matmul, fixed_order_sum

__all__ = [
    "KV_BLOCK",
    "MAX_HEAD_DIM",
    "AttentionReference",
    "attention",
    "attention_fp32",
    "attention_varlen",
    "attention_varlen_fp32",
    "attention_with_kv_cache",
    "is_supported_head_dim",
]

KV_BLOCK = 128  # the CUDA kernels' kBlockKeys (kernels_cu/common/attention_rows.cuh)

_NEG_INF = float("-inf")


# ----------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class _Layout:
    """Where each sequence's rows live in the flat (packed) q and k tensors.

    ``q_index[b, i]`` is the flat row of query ``i`` of sequence ``b`` for ``i < seqlens_q[b]``
    and ``num_q_rows`` (an appended zero row) otherwise; ``k_index`` likewise for keys,
    in increasing absolute key position.
    """

    q_index: Tensor
    k_index: Tensor
    seqlens_q: Tensor
    seqlens_k: Tensor
    num_q_rows: int
    num_k_rows: int


def _index_table(starts: Tensor, lengths: Tensor, width: int, pad_row: int) -> Tensor:
    offsets = torch.arange(width, device=starts.device)
    index = starts[:, None] + offsets[None, :]
    return torch.where(offsets[None, :] < lengths[:, None], index, pad_row)


def _padded_layout(
    q: Tensor,
    k: Tensor,
    seqlens_q: Tensor | None,
    seqlens_k: Tensor | None,
    key_padding_mask: Tensor | None,
) -> _Layout:
    batch, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    device = q.device
    lq = (
        torch.full((batch,), sq, dtype=torch.int64, device=device)
        if seqlens_q is None
        else seqlens_q.to(device, torch.int64)
    )
    lk = (
        torch.full((batch,), sk, dtype=torch.int64, device=device)
        if seqlens_k is None
        else seqlens_k.to(device, torch.int64)
    )
    q_index = _index_table(torch.arange(batch, device=device) * sq, lq, sq, batch * sq)
    positions = torch.arange(sk, device=device)
    if key_padding_mask is None:
        k_index = _index_table(torch.arange(batch, device=device) * sk, lk, sk, batch * sk)
    else:
        # Kept keys are compacted to the front in storage order; a key's absolute position
        # is the number of kept keys before it, so holes in the mask move no block boundary.
        kept = key_padding_mask & (positions[None, :] < lk[:, None])
        order = torch.sort((~kept).to(torch.int8), dim=1, stable=True).indices
        lk = kept.sum(dim=1)
        k_index = torch.where(
            positions[None, :] < lk[:, None],
            order + (torch.arange(batch, device=device) * sk)[:, None],
            batch * sk,
        )
    return _Layout(q_index, k_index, lq, lk, batch * sq, batch * sk)


def _varlen_layout(
    cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, tq: int, tk: int, device: torch.device
) -> _Layout:
    cu_q = cu_seqlens_q.to(device, torch.int64)  # lengths may be CPU tensors
    cu_k = cu_seqlens_k.to(device, torch.int64)
    lq = cu_q[1:] - cu_q[:-1]
    lk = cu_k[1:] - cu_k[:-1]
    width_q = int(lq.max()) if lq.numel() else 0
    width_k = int(lk.max()) if lk.numel() else 0
    q_index = _index_table(cu_q[:-1], lq, width_q, tq)
    k_index = _index_table(cu_k[:-1], lk, width_k, tk)
    return _Layout(q_index, k_index, lq, lk, tq, tk)


def _gather_rows(flat: Tensor, index: Tensor) -> Tensor:
    """``flat[index]`` in fp32, where ``index == len(flat)`` selects an appended zero row."""
    flat32 = flat.float()
    padded = torch.cat([flat32, flat32.new_zeros((1, *flat32.shape[1:]))], dim=0)
    return padded[index]


# ----------------------------------------------------------------------------- fixed-order core


def _scan_max(s: Tensor) -> Tensor:
    """Max over the last dim as a left-to-right scan of ``where(x > m, x, m)`` from -inf."""
    m = torch.full(s.shape[:-1], _NEG_INF, dtype=s.dtype, device=s.device)
    for j in range(s.shape[-1]):
        m = torch.where(s[..., j] > m, s[..., j], m)
    return m


def _visible_counts(layout: _Layout, causal: bool) -> Tensor:
    """Number of visible keys (a prefix of the sequence) of every query row: ``[B, Sqm]``."""
    width_q = layout.q_index.shape[1]
    offsets = torch.arange(width_q, device=layout.q_index.device)
    lq, lk = layout.seqlens_q[:, None], layout.seqlens_k[:, None]
    if causal:
        position = (lk - lq) + offsets[None, :]
        count = torch.clamp(position + 1, min=0)
        count = torch.minimum(count, lk)
    else:
        count = lk.expand(-1, width_q)
    return torch.where(offsets[None, :] < lq, count, 0)


def _to_core(rows: Tensor, num_kv_heads: int) -> Tensor:
    """``[B, S, Hq, d] -> [B, Hkv, G, S, d]``: query head ``h = hkv * G + g``."""
    b, s, hq, d = rows.shape
    return rows.reshape(b, s, num_kv_heads, hq // num_kv_heads, d).permute(0, 2, 3, 1, 4)


def _from_core(core: Tensor) -> Tensor:
    """``[B, Hkv, G, S, ...] -> [B, S, Hq, ...]``."""
    b, hkv, g, s = core.shape[:4]
    return core.permute(0, 3, 1, 2, *range(4, core.dim())).reshape(b, s, hkv * g, *core.shape[4:])


def _scatter_rows(core_rows: Tensor, index: Tensor, num_rows: int, fill: float) -> Tensor:
    """Inverse of ``_gather_rows``: core rows back to flat rows (unused rows get ``fill``)."""
    flat = torch.full(
        (num_rows, *core_rows.shape[2:]), fill, dtype=core_rows.dtype, device=core_rows.device
    )
    real = index < num_rows
    # Each real flat row appears once in ``index``: a plain copy, no accumulation.
    flat[index[real]] = core_rows[real]
    return flat


def _forward_core(
    q: Tensor, k: Tensor, v: Tensor, layout: _Layout, causal: bool, scale: Tensor
) -> tuple[Tensor, Tensor]:
    """fp32 output ``[Nq, Hq, d]`` and LSE ``[Nq, Hq]`` of flat rows, in the fixed order."""
    hkv = k.shape[-2]
    qc = _to_core(_gather_rows(q, layout.q_index), hkv)  # [B, Hkv, G, Sqm, d]
    kc = _gather_rows(k, layout.k_index).permute(0, 2, 1, 3)  # [B, Hkv, Skm, d]
    vc = _gather_rows(v, layout.k_index).permute(0, 2, 1, 3)
    n_visible = _visible_counts(layout, causal)[:, None, None, :]  # [B, 1, 1, Sqm]
    width_k = kc.shape[2]
    state_shape = qc.shape[:-1]
    m = torch.full(state_shape, _NEG_INF, dtype=torch.float32, device=qc.device)
    l = torch.zeros(state_shape, dtype=torch.float32, device=qc.device)
    acc = torch.zeros(qc.shape, dtype=torch.float32, device=qc.device)
    for start in range(0, width_k, KV_BLOCK):
        stop = min(start + KV_BLOCK, width_k)
        key_pos = torch.arange(start, stop, device=qc.device)
        visible = key_pos < n_visible[..., None]  # [B, 1, 1, Sqm, nk]
        k_block = kc[:, :, None, start:stop]  # [B, Hkv, 1, nk, d]
        v_block = vc[:, :, start:stop]  # [B, Hkv, nk, d]
        s = fixed_order_matmul(qc, k_block.transpose(-1, -2)) * scale
        s = torch.where(visible, s, _NEG_INF)
        m_b = _scan_max(s)
        m_b_ref = torch.where(m_b == _NEG_INF, 0.0, m_b)
        p = torch.exp(s - m_b_ref[..., None])  # exactly +0 on invisible keys
        # p is +0 on invisible keys and the sum starts at +0, so they add nothing.
        l_b = fixed_order_sum(p, dim=-1)
        acc_b = torch.zeros_like(acc)
        for j in range(stop - start):
            # Skipped by selection: a future key's V is never multiplied in, even by 0.
            acc_b = torch.where(
                visible[..., j : j + 1],
                acc_b + p[..., j : j + 1] * v_block[:, :, None, j : j + 1, :],
                acc_b,
            )
        m_new = torch.where(m_b > m, m_b, m)
        m_ref = torch.where(m_new == _NEG_INF, 0.0, m_new)
        alpha = torch.exp(m - m_ref)
        beta = torch.exp(m_b - m_ref)
        l_new = l * alpha + l_b * beta
        acc_new = acc * alpha[..., None] + acc_b * beta[..., None]
        block_used = start < n_visible
        m = torch.where(block_used, m_new, m)
        l = torch.where(block_used, l_new, l)
        acc = torch.where(block_used[..., None], acc_new, acc)
    has_keys = n_visible > 0
    out = torch.where(has_keys[..., None], acc / torch.where(has_keys, l, 1.0)[..., None], 0.0)
    lse = torch.where(has_keys, m + torch.log(torch.where(has_keys, l, 1.0)), _NEG_INF)
    out_flat = _scatter_rows(_from_core(out), layout.q_index, layout.num_q_rows, 0.0)
    lse_flat = _scatter_rows(_from_core(lse), layout.q_index, layout.num_q_rows, _NEG_INF)
    return out_flat, lse_flat


def _backward_core(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    grad_out: Tensor,
    layout: _Layout,
    causal: bool,
    scale: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """fp32 ``dq [Nq, Hq, d]``, ``dk, dv [Nk, Hkv, d]`` in the fixed order of the docstring."""
    hkv = k.shape[-2]
    qc = _to_core(_gather_rows(q, layout.q_index), hkv)  # [B, Hkv, G, Sqm, d]
    do = _to_core(_gather_rows(grad_out, layout.q_index), hkv)
    oc = _to_core(_gather_rows(out, layout.q_index), hkv)
    lse_c = _gather_rows(lse, layout.q_index)  # [B, Sqm, Hq]
    b, sqm, hq = lse_c.shape
    lse_c = lse_c.reshape(b, sqm, hkv, hq // hkv).permute(0, 2, 3, 1)  # [B, Hkv, G, Sqm]
    kc = _gather_rows(k, layout.k_index).permute(0, 2, 1, 3)  # [B, Hkv, Skm, d]
    vc = _gather_rows(v, layout.k_index).permute(0, 2, 1, 3)
    width_k = kc.shape[2]
    n_visible = _visible_counts(layout, causal)[:, None, None, :]
    key_pos = torch.arange(width_k, device=qc.device)
    visible = key_pos < n_visible[..., None]  # [B, 1, 1, Sqm, Skm]

    # Scores element by element as in the forward (same dot product, same rounding).
    s = fixed_order_matmul(qc, kc[:, :, None].transpose(-1, -2)) * scale
    p = torch.where(visible, torch.exp(s - lse_c[..., None]), 0.0)
    dp = fixed_order_matmul(do, vc[:, :, None].transpose(-1, -2))
    delta = fixed_order_sum(do * oc, dim=-1)
    ds = torch.where(visible, p * (dp - delta[..., None]), 0.0)

    dq = torch.zeros_like(qc)
    for j in range(width_k):
        dq = torch.where(
            visible[..., j : j + 1], dq + ds[..., j : j + 1] * kc[:, :, None, j : j + 1, :], dq
        )
    dq = dq * scale

    dk = torch.zeros_like(kc)
    dv = torch.zeros_like(vc)
    for g in range(qc.shape[2]):
        for i in range(sqm):
            seen = visible[:, :, 0, i, :, None]  # [B, 1, Skm, 1]
            dk = torch.where(seen, dk + ds[:, :, g, i, :, None] * qc[:, :, g, i, None, :], dk)
            dv = torch.where(seen, dv + p[:, :, g, i, :, None] * do[:, :, g, i, None, :], dv)
    dk = dk * scale

    dq_flat = _scatter_rows(_from_core(dq), layout.q_index, layout.num_q_rows, 0.0)
    dk_flat = _scatter_rows(dk.permute(0, 2, 1, 3), layout.k_index, layout.num_k_rows, 0.0)
    dv_flat = _scatter_rows(dv.permute(0, 2, 1, 3), layout.k_index, layout.num_k_rows, 0.0)
    return dq_flat, dk_flat, dv_flat


class _AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout: _Layout, causal: bool, scale: Tensor):
        out32, lse = _forward_core(q, k, v, layout, causal, scale)
        ctx.save_for_backward(q, k, v, out32, lse)
        ctx.layout = layout
        ctx.causal = causal
        ctx.scale = scale
        ctx.mark_non_differentiable(lse)
        return out32.to(q.dtype), lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out32, lse = ctx.saved_tensors
        dq, dk, dv = _backward_core(
            q, k, v, out32, lse, grad_out, ctx.layout, ctx.causal, ctx.scale
        )
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def _scale_tensor(softmax_scale: float | None, head_dim: int, device) -> Tensor:
    value = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    # Rounded to fp32 once, so every path multiplies by the same fp32 number.
    return torch.tensor(value, dtype=torch.float32, device=device)


# ----------------------------------------------------------------------------- public API


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    seqlens_q: Tensor | None = None,
    seqlens_k: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Padded attention: ``q [B, Sq, Hq, d]``, ``k, v [B, Sk, Hkv, d]`` -> ``[B, Sq, Hq, d]``.

    ``seqlens_q [B]``: sequence ``b`` has queries ``q[b, :seqlens_q[b]]`` (default Sq); the
    other query rows are padding and give zeros (LSE -inf).  ``seqlens_k [B]``: keys
    ``k[b, :seqlens_k[b]]`` (default Sk).  ``key_padding_mask [B, Sk]`` (bool, True = keep)
    additionally drops keys; kept keys are renumbered 0, 1, ... in storage order, so
    absolute key positions count kept keys only.  The query offset of sequence ``b`` is
    ``Lk - Lq`` with ``Lk`` its number of kept keys and ``Lq = seqlens_q[b]``.
    With ``return_lse`` returns ``(out, lse)``, ``lse [B, Hq, Sq]`` fp32.
    """
    check_attention_args(
        q,
        k,
        v,
        seqlens_q=seqlens_q,
        seqlens_k=seqlens_k,
        key_padding_mask=key_padding_mask,
        softmax_scale=softmax_scale,
        causal=causal,
    )
    batch, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    layout = _padded_layout(q, k, seqlens_q, seqlens_k, key_padding_mask)
    scale = _scale_tensor(softmax_scale, d, q.device)
    out, lse = _AttentionFunction.apply(
        q.reshape(batch * sq, hq, d),
        k.reshape(batch * sk, hkv, d),
        v.reshape(batch * sk, hkv, d),
        layout,
        causal,
        scale,
    )
    out = out.reshape(batch, sq, hq, d)
    if not return_lse:
        return out
    return out, lse.reshape(batch, sq, hq).permute(0, 2, 1).contiguous()


def attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Packed attention: ``q [Tq, Hq, d]``, ``k, v [Tk, Hkv, d]`` -> ``[Tq, Hq, d]``.

    Sequence ``b`` owns query rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and key rows
    ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` (int32 or int64, starting at 0, non-decreasing,
    last entry = number of rows).  With ``return_lse`` returns ``(out, lse)``,
    ``lse [Hq, Tq]`` fp32 (flash-attention's varlen layout).
    """
    check_attention_args(
        q,
        k,
        v,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        softmax_scale=softmax_scale,
        causal=causal,
    )
    layout = _varlen_layout(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], q.device)
    scale = _scale_tensor(softmax_scale, q.shape[-1], q.device)
    out, lse = _AttentionFunction.apply(q, k, v, layout, causal, scale)
    if not return_lse:
        return out
    return out, lse.t().contiguous()


def attention_fp32(q: Tensor, k: Tensor, v: Tensor, **kwargs) -> Tensor | tuple[Tensor, Tensor]:
    """Strict fp32 path of ``attention``: upcast inputs, same arithmetic, fp32 output."""
    from ..contract import deterministic_context

    with deterministic_context():
        return attention(q.float(), k.float(), v.float(), **kwargs)


def attention_varlen_fp32(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, **kwargs
) -> Tensor | tuple[Tensor, Tensor]:
    """Strict fp32 path of ``attention_varlen``."""
    from ..contract import deterministic_context

    with deterministic_context():
        return attention_varlen(
            q.float(), k.float(), v.float(), cu_seqlens_q, cu_seqlens_k, **kwargs
        )


def attention_with_kv_cache(
    q: Tensor,
    k_new: Tensor,
    v_new: Tensor,
    cache: KVCache,
    seq_ids: Tensor | None = None,
    *,
    seqlens_new: Tensor | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Decode / chunked-prefill step: append ``k_new, v_new`` to ``cache``, then attend.

    ``q [n, S_new, Hq, d]`` are the new tokens of slots ``seq_ids`` (default all), row ``i``
    holding ``seqlens_new[i]`` of them (default ``S_new``).  They are the last tokens of
    their sequences, so query ``t`` of row ``i`` sits at absolute position
    ``cache_length_before + t`` and (causal) sees the cached prefix and the new keys up to
    itself.  Returns what ``attention`` returns for ``q`` against the cache.
    """
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a KVCache, got {type(cache).__name__}")
    # Everything is checked before the append (which checks ids, lengths and capacity before
    # it writes): a call that raises leaves the cache as it was.
    check_kv_cache_attention_args(
        q, k_new, v_new, cache, seqlens_new=seqlens_new, causal=causal, softmax_scale=softmax_scale
    )
    seq_ids, seqlens_new = host_index_copies(seq_ids=seq_ids, seqlens_new=seqlens_new)
    check_seqlens_new(seqlens_new, q.shape[1])
    # Host ids and lengths (the cache keeps its lengths on the host): no device sync below.
    ids, seqlens_k = cache.append_host(k_new, v_new, seq_ids, seqlens_new)
    k, v, _ = cache.read(ids)
    # Storage past the longest sequence is never visible; dropping it changes no row's bits.
    longest = int(seqlens_k.max())
    k, v = k[:, :longest], v[:, :longest]
    seqlens_q = seqlens_new if seqlens_new is not None else None
    return attention(
        q,
        k,
        v,
        causal=causal,
        softmax_scale=softmax_scale,
        seqlens_q=seqlens_q,
        seqlens_k=seqlens_k,
        return_lse=return_lse,
    )


class AttentionReference(nn.Module):
    """The reference as a module; ``cu_seqlens_q/k`` keyword arguments select varlen."""

    def __init__(self, *, causal: bool = False, softmax_scale: float | None = None):
        super().__init__()
        self.causal = causal
        self.softmax_scale = softmax_scale

    def _call(self, fn_padded, fn_varlen, q, k, v, kwargs):
        kwargs = {"causal": self.causal, "softmax_scale": self.softmax_scale, **kwargs}
        if "cu_seqlens_q" in kwargs or "cu_seqlens_k" in kwargs:
            cu_q = kwargs.pop("cu_seqlens_q", None)
            cu_k = kwargs.pop("cu_seqlens_k", None)
            return fn_varlen(q, k, v, cu_q, cu_k, **kwargs)
        return fn_padded(q, k, v, **kwargs)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, **kwargs):
        return self._call(attention, attention_varlen, q, k, v, kwargs)

    def forward_fp32(self, q: Tensor, k: Tensor, v: Tensor, **kwargs):
        return self._call(attention_fp32, attention_varlen_fp32, q, k, v, kwargs)

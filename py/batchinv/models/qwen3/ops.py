"""The two op tables the Qwen3 model runs with besides the references: batchinv and stock.

``BATCHINV_OPS`` calls batchinv's public ops, which dispatch through the registry (CPU: the
strict references; CUDA: the batch-invariant kernels; a missing kernel raises
``BackendNotImplementedError``, never a fallback); where no gradient is needed it adds the
residual and norms the sum in one ``fused_add_rms_norm`` and, at decode sizes on sm_90a,
runs q/k/v and gate/up as one launch each (``linear_group``): the same bits.  ``STOCK_OPS``
is what a stock PyTorch / Hugging Face stack runs: ``F.linear`` (cuBLAS / CPU BLAS),
``F.scaled_dot_product_attention`` with ``enable_gqa`` and a boolean mask for padding, packing
and KV caches, HF's RMSNorm and RoPE formulas, ``F.silu(g) * u`` and ``torch.log_softmax``.
The audit compares the two; stock drift across batches is expected and shown, never a failure.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import replace
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

import batchinv

from ...kv_cache import KVCache
from ...ops.linear import linear_group
from ...reference.qwen3_chain import REFERENCE_OPS, Qwen3Ops, add_then_rms_norm

__all__ = ["BATCHINV_OPS", "OPS_BY_NAME", "REFERENCE_OPS", "STOCK_OPS", "ops_by_name"]


# ----- batchinv ------------------------------------------------------------------------------

_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _batchinv_embedding(ids: Tensor, weight: Tensor) -> Tensor:
    return batchinv.embedding(ids, weight)


def _batchinv_log_softmax(x: Tensor) -> Tensor:
    return batchinv.log_softmax(x, -1, torch.float32)


def _unfused_token_logprobs(
    hidden: Tensor,
    lm_head_weight: Tensor,
    target_ids: Tensor,
    ignore_index: int,
    *,
    linear,
    log_softmax,
) -> Tensor:
    """``log_softmax(hidden @ W.T)[target]`` (0.0 where ignored), fp32, differentiable."""
    logprobs = log_softmax(linear(hidden, lm_head_weight, None))
    keep = target_ids != ignore_index
    safe = torch.where(keep, target_ids, torch.zeros_like(target_ids)).long()
    picked = logprobs.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    return torch.where(keep, picked, torch.zeros_like(picked))


def _batchinv_token_logprobs(
    hidden: Tensor, lm_head_weight: Tensor, target_ids: Tensor, ignore_index: int
) -> Tensor:
    # Fused: the [tokens, vocab] logits are never materialised (fp32 logits inside).
    return batchinv.token_logprobs(hidden, lm_head_weight, target_ids, ignore_index)


def _batchinv_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return batchinv.linear(x, weight, bias)


def _batchinv_linear_group(
    x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor | None]
) -> tuple[Tensor, ...] | None:
    """The projections of one ``x`` (q/k/v, gate/up) as one launch of the grouped small-M
    kernel where it applies (``gpu.linear.grouped_applies``: no gradient, CUDA sm_90a, decode-
    sized batches): views of its ``[..., N_0 + N_1 + ...]`` output, each the bits of
    ``batchinv.linear`` for its weight (kernels_cu/linear.cu).  Elsewhere None: the chain
    calls the table's ``linear`` per weight."""
    return linear_group(x, weights, biases)


class _CheckedPositions:
    """The position-id tensor whose values batchinv's RoPE last checked, so that the other
    layers of the same forward (which the chain gives the same, unmodified tensor) skip the
    device read: on a GPU the check costs one host sync per forward instead of one per layer.

    A tensor counts as checked only while it is the same object with the same version counter
    (an in-place write bumps it) and the same ``max_position``.  Inference-mode tensors have
    no version counter, so they are checked at every call."""

    def __init__(self) -> None:
        self._tensor: weakref.ref | None = None
        self._version = -1
        self._max_position = -1

    def holds(self, position_ids: Tensor, max_position: int) -> bool:
        return (
            self._tensor is not None
            and self._tensor() is position_ids
            and self._max_position == max_position
            and position_ids._version == self._version
        )

    def remember(self, position_ids: Tensor, max_position: int) -> None:
        if position_ids.is_inference():
            return
        self._tensor = weakref.ref(position_ids)
        self._version = position_ids._version
        self._max_position = max_position


_CHECKED_POSITIONS = _CheckedPositions()


def _batchinv_rope(q, k, position_ids, *, theta, head_dim, max_position):
    if torch.compiler.is_compiling():  # the custom op checks every call (no memo in a graph)
        return batchinv.rope(
            q, k, position_ids, theta=theta, head_dim=head_dim, max_position=max_position
        )
    check = not _CHECKED_POSITIONS.holds(position_ids, max_position)
    q_rot, k_rot = batchinv.rope(
        q,
        k,
        position_ids,
        theta=theta,
        head_dim=head_dim,
        max_position=max_position,
        check_positions=check,
    )
    if check:  # reached only when every position was in range
        _CHECKED_POSITIONS.remember(position_ids, max_position)
    return q_rot, k_rot


def _batchinv_residual_add(h: Tensor, delta: Tensor) -> Tensor:
    """``h + delta`` in fp32, one rounding to ``h``'s dtype (the reference's definition).

    On CUDA with one low-precision dtype this is ``torch.add(h, delta)``: PyTorch's CUDA add
    loads both operands into fp32 (its opmath type), adds them once and rounds once, the same
    bits as the reference's ``(h.float() + delta.float()).to(h.dtype)`` (tested bit for bit,
    special values included) in one kernel instead of three, without the fp32 temporaries.
    Elsewhere (CPU, fp32, mixed dtypes) the reference runs."""
    if h.is_cuda and h.dtype == delta.dtype and h.dtype in _LOW_PRECISION and delta.is_cuda:
        return torch.add(h, delta)
    return REFERENCE_OPS.residual_add(h, delta)


def _batchinv_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return batchinv.rms_norm(x, weight, eps)


_batchinv_add_then_rms_norm = add_then_rms_norm(_batchinv_residual_add, _batchinv_rms_norm)


def _batchinv_add_rms_norm(h: Tensor, delta: Tensor, weight: Tensor, eps: float):
    """``residual_add`` then ``rms_norm`` as one ``fused_add_rms_norm`` (the chain calls it
    only where no gradient is needed): ``h + delta`` added in fp32 and rounded once, then the
    norm of the rounded sum, the bits of the two ops (on the GPU the fused and the plain
    forward of kernels_cu/rms_norm.cu share the row tree; on the CPU both are the reference).
    Operands the fused op does not take (mixed dtypes, shapes or devices) run the two ops."""
    if h.dtype == delta.dtype == weight.dtype and h.shape == delta.shape:
        if h.device == delta.device == weight.device:
            return batchinv.fused_add_rms_norm(h, delta, weight, eps)
    return _batchinv_add_then_rms_norm(h, delta, weight, eps)


def _batchinv_attention(q, k, v, *, causal, seqlens_q, seqlens_k):
    return batchinv.attention(q, k, v, causal=causal, seqlens_q=seqlens_q, seqlens_k=seqlens_k)


def _batchinv_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal):
    return batchinv.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal)


def _batchinv_attention_with_kv_cache(q, k_new, v_new, cache, seq_ids, *, seqlens_new, causal):
    return batchinv.attention_with_kv_cache(
        q, k_new, v_new, cache, seq_ids, seqlens_new=seqlens_new, causal=causal
    )


BATCHINV_OPS = Qwen3Ops(
    name="batchinv",
    embedding=_batchinv_embedding,
    linear=_batchinv_linear,
    rms_norm=_batchinv_rms_norm,
    rope=_batchinv_rope,
    attention=_batchinv_attention,
    attention_varlen=_batchinv_attention_varlen,
    attention_with_kv_cache=_batchinv_attention_with_kv_cache,
    silu_mul=lambda gate, up: batchinv.silu_mul(gate, up),
    residual_add=_batchinv_residual_add,  # fp32 add, one rounding: elementwise
    log_softmax=_batchinv_log_softmax,
    token_logprobs=_batchinv_token_logprobs,
    add_rms_norm=_batchinv_add_rms_norm,
    linear_group=_batchinv_linear_group,
)


# ----- stock PyTorch -------------------------------------------------------------------------


def _stock_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Hugging Face's Qwen3RMSNorm."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _stock_rope(q, k, position_ids, *, theta, head_dim, max_position):
    """Hugging Face's default RoPE: fp32 angles, cos/sin rounded to the model dtype."""
    del max_position  # stock RoPE does not check positions
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=q.device).float()
    inv_freq = 1.0 / (theta ** (exponents / head_dim))
    freqs = position_ids.float()[..., None] * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)
    cos = angles.cos().to(q.dtype).unsqueeze(-2)  # broadcast over heads
    sin = angles.sin().to(q.dtype).unsqueeze(-2)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _sdpa(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, repeat_kv: bool = False
) -> Tensor:
    """SDPA on ``[B, S, H, d]`` layouts: GQA through ``enable_gqa``, or with ``repeat_kv``
    each kv head repeated for its query heads first (transformers' SDPA path where a mask is
    given: ``enable_gqa`` with a mask leaves SDPA only its math backend)."""
    if repeat_kv and k.shape[2] != q.shape[2]:
        group = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=causal and mask is None,
        enable_gqa=not repeat_kv,
    )
    return out.transpose(1, 2)


def _visibility_mask(
    query_positions: Tensor, key_lengths: Tensor, num_keys: int, causal: bool
) -> Tensor:
    """``[B, 1, Sq, Sk]`` bool: key ``j`` visible to a query at position ``p`` iff
    ``j < length`` (and ``j <= p`` when causal)."""
    keys = torch.arange(num_keys, device=key_lengths.device)
    mask = keys[None, None, :] < key_lengths[:, None, None]
    if causal:
        mask = mask & (keys[None, None, :] <= query_positions[:, :, None])
    return mask[:, None]


def _stock_attention(q, k, v, *, causal, seqlens_q, seqlens_k):
    batch, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    if seqlens_k is None and seqlens_q is None:
        if causal and sq != sk:
            raise NotImplementedError("stock attention: causal with Sq != Sk needs seqlens")
        return _sdpa(q, k, v, None, causal)
    device = q.device
    lengths_k = (
        seqlens_k.to(device).long()
        if seqlens_k is not None
        else torch.full((batch,), sk, device=device)
    )
    lengths_q = seqlens_q.to(device).long() if seqlens_q is not None else lengths_k
    positions = (lengths_k - lengths_q)[:, None] + torch.arange(sq, device=device)[None, :]
    return _sdpa(q, k, v, _visibility_mask(positions, lengths_k, sk, causal), causal)


def _stock_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal):
    """Packing as stock stacks do it: one sequence of all tokens with a block-diagonal mask."""
    if not torch.equal(cu_seqlens_q, cu_seqlens_k):
        raise NotImplementedError("stock varlen attention: cu_seqlens_q must equal cu_seqlens_k")
    total = q.shape[0]
    cu = cu_seqlens_q.to(q.device).long()
    tokens = torch.arange(total, device=q.device)
    owner = torch.searchsorted(cu[1:], tokens, right=True)
    mask = owner[:, None] == owner[None, :]
    if causal:
        mask = mask & (tokens[None, :] <= tokens[:, None])
    out = _sdpa(q[None], k[None], v[None], mask[None, None], causal)
    return out[0]


def _stock_attention_with_kv_cache(
    q, k_new, v_new, cache, seq_ids, *, seqlens_new, causal, repeat_kv=False
):
    """Append to the cache, then SDPA over the cached keys with a length/causal mask
    (``repeat_kv``: see ``_sdpa``)."""
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a batchinv KVCache, got {type(cache).__name__}")
    ids = seq_ids if seq_ids is not None else torch.arange(cache.batch, device=cache.k.device)
    before = cache.slot_lengths(seq_ids)
    lengths = cache.append(k_new, v_new, seq_ids, seqlens_new)
    longest = max(int(lengths.max()), 1)
    if seq_ids is None:  # every slot: views of the storage, no gather
        k, v = cache.k[:, :longest], cache.v[:, :longest]
    else:
        k, v = cache.k[ids, :longest], cache.v[ids, :longest]
    if bool((lengths < longest).any()):
        # Unwritten storage holds NaN; a stock engine never reads it, so zero it out.
        keys = torch.arange(longest, device=k.device)
        valid = (keys[None, :] < lengths[:, None])[..., None, None]
        k = torch.where(valid, k, torch.zeros((), dtype=k.dtype, device=k.device))
        v = torch.where(valid, v, torch.zeros((), dtype=v.dtype, device=v.device))
    positions = before[:, None] + torch.arange(q.shape[1], device=q.device)[None, :]
    mask = _visibility_mask(positions, lengths, longest, causal)
    return _sdpa(q, k, v, mask, causal, repeat_kv=repeat_kv)


def with_repeated_kv_heads(table: Qwen3Ops) -> Qwen3Ops:
    """``table`` (a stock table) with its cached attention repeating each kv head for its
    query heads before SDPA, as transformers does: the form SDPA's mem-efficient backend
    takes (``enable_gqa`` with a mask leaves only the math backend)."""
    return replace(
        table,
        name=f"{table.name}-repeat-kv",
        attention_with_kv_cache=partial(_stock_attention_with_kv_cache, repeat_kv=True),
    )


def _stock_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return F.linear(x, weight, bias)


def _stock_residual_add(h: Tensor, delta: Tensor) -> Tensor:
    return h + delta


def _stock_log_softmax(x: Tensor) -> Tensor:
    return torch.log_softmax(x.float(), dim=-1)


def _stock_token_logprobs(hidden, lm_head_weight, target_ids, ignore_index):
    return _unfused_token_logprobs(
        hidden,
        lm_head_weight,
        target_ids,
        ignore_index,
        linear=_stock_linear,
        log_softmax=_stock_log_softmax,
    )


STOCK_OPS = Qwen3Ops(
    name="stock",
    embedding=lambda ids, weight: F.embedding(ids, weight),
    linear=_stock_linear,
    rms_norm=_stock_rms_norm,
    rope=_stock_rope,
    attention=_stock_attention,
    attention_varlen=_stock_attention_varlen,
    attention_with_kv_cache=_stock_attention_with_kv_cache,
    silu_mul=lambda gate, up: F.silu(gate) * up,
    residual_add=_stock_residual_add,
    log_softmax=_stock_log_softmax,
    token_logprobs=_stock_token_logprobs,
    add_rms_norm=add_then_rms_norm(_stock_residual_add, _stock_rms_norm),
)

OPS_BY_NAME = {ops.name: ops for ops in (REFERENCE_OPS, BATCHINV_OPS, STOCK_OPS)}


def ops_by_name(name: str | Qwen3Ops) -> Qwen3Ops:
    """An op table by name ("batchinv", "stock", "reference"), or the table itself."""
    if isinstance(name, Qwen3Ops):
        return name
    if name not in OPS_BY_NAME:
        raise ValueError(f"ops must be one of {sorted(OPS_BY_NAME)}, got {name!r}")
    return OPS_BY_NAME[name]

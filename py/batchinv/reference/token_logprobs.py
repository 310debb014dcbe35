"""Token log-probabilities through the lm_head, fused and chunked: the strict reference.

``logprob[t] = log_softmax(hidden[t] @ lm_head_weight.T)[target_ids[t]]`` (and optionally
the entropy of that distribution) without ever holding the fp32 ``[T, V]`` logits.

Forward, per token, in fp32, vocabulary chunks of ``vocab_chunk`` columns (a constant,
default 4096; the last chunk is shorter) taken left to right:
1. ``z_c = hidden @ W[c0:c1].T`` by the fixed-order linear (K reduced in order, exactly the
   bits ``linear_fp32`` gives for those columns);
2. the chunk state ``m_c = max(z_c)``, ``l_c = sum exp(z_c - m_c)`` (left to right) and, for
   the entropy, ``s_c = sum exp(z_c - m_c) * (z_c - m_c)`` (left to right);
3. merged into the running state with the log_softmax merge (``m = max(m_a, m_b)``,
   ``l = l_a*exp(m_a - m) + l_b*exp(m_b - m)``) and, for the entropy,
   ``s = exp(m_a - m)*(s_a + (m_a - m)*l_a) + exp(m_b - m)*(s_b + (m_b - m)*l_b)``;
4. the target's logit is picked from the chunk that holds it.
Then ``lse = m + log(l)``, ``logprob = z_target - lse`` and ``entropy = log(l) - s / l``
(``= lse - sum p*z``, written relative to ``m`` so nothing cancels and it is never < 0).

Only ``[T, vocab_chunk]`` fp32 tensors exist at once, and only a ``[vocab_chunk, H]`` slice
of the weight is upcast at a time.  Every step is elementwise over the tokens or a Python
loop over one chunk's columns, so a token's results cannot depend on the other tokens.
With one chunk definition shared with ``log_softmax``, the unfused chain
``log_softmax(linear_fp32(h, W), chunk_size=vocab_chunk).gather(target)`` gives the same
bits as ``token_logprobs_fp32``.

Positions whose target is ``ignore_index`` give logprob 0.0 and entropy 0.0 and get zero
gradient; they are left out of the weight-gradient reduction, so their hidden rows (even
NaN padding) never reach another token's result.

Backward (recomputing each chunk's logits; only ``lse`` and the entropy are saved):
``p = exp(z - lse)``, ``d_z = g * (onehot(target) - p) - g_ent * (p * ((z - lse) + entropy))``
(the entropy term only when the entropy's gradient is asked for), zero for ignored tokens;
``d_hidden = sum over chunks, left to right, of d_z_c @ W_c`` (each reduced over its
columns in order) and ``d_W_c = d_z_c.T @ hidden`` reduced over the non-ignored tokens in
increasing token order; fp32 throughout, rounded once to the parameter dtypes.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..contract import deterministic_context
from ..validation import (
    FLOAT_DTYPES,
    check_positive_int,
    check_token_logprobs_args,
)
from ._fixed_order import fixed_order_matmul, fixed_order_sum
from .log_softmax import (
    LSE_CHUNK,
    _shift,
    chunk_lse_state,
    lse_merge_scales,
)

SUPPORTED_DTYPES = FLOAT_DTYPES

# Vocabulary columns per chunk; a constant of the definition (151936 = 37 * 4096 + 512).
# The same as log_softmax's chunk, so the fused and unfused chains give the same bits.
VOCAB_CHUNK = LSE_CHUNK

DEFAULT_IGNORE_INDEX = -100


def _chunk_logits(hidden32: Tensor, lm_head_weight: Tensor, start: int, stop: int) -> Tensor:
    """fp32 logits ``[T, stop - start]`` of one vocabulary chunk (K reduced in order)."""
    return fixed_order_matmul(hidden32, lm_head_weight[start:stop].float().t())


def _chunk_entropy_sum(z: Tensor, m: Tensor) -> Tensor:
    """``s_c = sum exp(z - m) * (z - m)`` left to right (0 for ``exp = 0``, never ``0 * -inf``)."""
    shifted = z - _shift(m).unsqueeze(-1)
    weights = torch.exp(shifted)
    terms = torch.where(weights == 0, torch.zeros_like(shifted), weights * shifted)
    return fixed_order_sum(terms, dim=-1)


def _merged_entropy_sum(
    s: Tensor, l: Tensor, m_old: Tensor, scale: Tensor, m_new: Tensor
) -> Tensor:
    """One side's ``exp(m_old - m)*(s + (m_old - m)*l)``; 0 where its scale is 0 (no NaN)."""
    term = scale * (s + (m_old - _shift(m_new)) * l)
    return torch.where(scale == 0, torch.zeros_like(term), term)


def _forward_rows(
    hidden32: Tensor,
    lm_head_weight: Tensor,
    targets: Tensor,
    valid: Tensor,
    vocab_chunk: int,
    with_entropy: bool,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(logprob, lse, entropy or None)`` for ``hidden32 [T, H]`` fp32 and ``targets [T]``."""
    vocab = lm_head_weight.shape[0]
    target_logit = torch.zeros(hidden32.shape[0], dtype=torch.float32, device=hidden32.device)
    m = l = s = None
    for start in range(0, vocab, vocab_chunk):
        stop = min(vocab, start + vocab_chunk)
        z = _chunk_logits(hidden32, lm_head_weight, start, stop)
        in_chunk = (targets >= start) & (targets < stop)
        column = (targets - start).clamp(0, stop - start - 1).unsqueeze(-1)
        target_logit = torch.where(in_chunk, z.gather(-1, column).squeeze(-1), target_logit)
        m_c, l_c = chunk_lse_state(z)
        s_c = _chunk_entropy_sum(z, m_c) if with_entropy else None
        if m is None:
            m, l, s = m_c, l_c, s_c
            continue
        m_new, scale_a, scale_b = lse_merge_scales(m, m_c)
        if with_entropy:
            s = _merged_entropy_sum(s, l, m, scale_a, m_new) + _merged_entropy_sum(
                s_c, l_c, m_c, scale_b, m_new
            )
        l = l * scale_a + l_c * scale_b
        m = m_new
    lse = m + torch.log(l)
    zero = torch.zeros_like(lse)
    logprob = torch.where(valid, target_logit - lse, zero)
    entropy = torch.where(valid, torch.log(l) - s / l, zero) if with_entropy else None
    return logprob, lse, entropy


def _backward_rows(
    grad_logprob: Tensor,
    grad_entropy: Tensor | None,
    hidden: Tensor,
    lm_head_weight: Tensor,
    targets: Tensor,
    valid: Tensor,
    lse: Tensor,
    entropy: Tensor | None,
    vocab_chunk: int,
    needs_hidden: bool,
    needs_weight: bool,
) -> tuple[Tensor | None, Tensor | None]:
    """``(d_hidden [T, H], d_weight [V, H])``, recomputing chunk logits; see the module doc."""
    hidden32 = hidden.float()
    vocab, hidden_size = lm_head_weight.shape
    zero = torch.zeros_like(lse)
    g = torch.where(valid, grad_logprob.float(), zero).unsqueeze(-1)
    g_ent = None
    if grad_entropy is not None:
        g_ent = torch.where(valid, grad_entropy.float(), zero).unsqueeze(-1)
    valid_rows = valid.unsqueeze(-1)
    grad_hidden = torch.zeros_like(hidden32) if needs_hidden else None
    grad_weight = hidden_valid = None
    if needs_weight:
        # Ignored tokens are left out of the token reduction: garbage there never reaches d_W.
        hidden_valid = hidden32[valid]
        grad_weight = torch.empty(
            vocab, hidden_size, dtype=lm_head_weight.dtype, device=lm_head_weight.device
        )
    for start in range(0, vocab, vocab_chunk):
        stop = min(vocab, start + vocab_chunk)
        z = _chunk_logits(hidden32, lm_head_weight, start, stop)
        log_p = z - lse.unsqueeze(-1)
        p = torch.exp(log_p)
        columns = torch.arange(start, stop, device=z.device)
        onehot = (columns.unsqueeze(0) == targets.unsqueeze(-1)).to(torch.float32)
        d_z = g * (onehot - p)
        if g_ent is not None:
            d_z = d_z - g_ent * (p * (log_p + entropy.unsqueeze(-1)))
        d_z = torch.where(valid_rows, d_z, torch.zeros_like(d_z))
        if needs_hidden:
            grad_hidden = grad_hidden + fixed_order_matmul(d_z, lm_head_weight[start:stop].float())
        if needs_weight:
            grad_weight[start:stop] = fixed_order_matmul(d_z[valid].t(), hidden_valid).to(
                lm_head_weight.dtype
            )
    if grad_hidden is not None:
        grad_hidden = grad_hidden.to(hidden.dtype)
    return grad_hidden, grad_weight


class _TokenLogprobsFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        lm_head_weight: Tensor,
        target_ids: Tensor,
        ignore_index: int,
        vocab_chunk: int,
        with_entropy: bool,
    ):
        hidden_rows = hidden.reshape(hidden.shape[:-1].numel(), hidden.shape[-1])
        targets = target_ids.reshape(-1).long()
        valid = targets != ignore_index
        logprob, lse, entropy = _forward_rows(
            hidden_rows.float(), lm_head_weight, targets, valid, vocab_chunk, with_entropy
        )
        ctx.save_for_backward(hidden, lm_head_weight, targets, valid, lse, entropy)
        ctx.vocab_chunk = vocab_chunk
        ctx.with_entropy = with_entropy
        # Unused outputs give None, so an unused entropy adds no term to the gradient.
        ctx.set_materialize_grads(False)
        logprob = logprob.reshape(target_ids.shape)
        if with_entropy:
            return logprob, entropy.reshape(target_ids.shape)
        return logprob

    @staticmethod
    def backward(ctx, grad_logprob: Tensor | None, grad_entropy: Tensor | None = None):
        hidden, lm_head_weight, targets, valid, lse, entropy = ctx.saved_tensors
        needs_hidden, needs_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if grad_logprob is None:
            grad_logprob = torch.zeros_like(lse)
        grad_hidden, grad_weight = _backward_rows(
            grad_logprob.reshape(-1),
            grad_entropy.reshape(-1) if grad_entropy is not None else None,
            hidden.reshape(hidden.shape[:-1].numel(), hidden.shape[-1]),
            lm_head_weight,
            targets,
            valid,
            lse,
            entropy,
            ctx.vocab_chunk,
            needs_hidden,
            needs_weight,
        )
        if grad_hidden is not None:
            grad_hidden = grad_hidden.reshape(hidden.shape)
        return grad_hidden, grad_weight, None, None, None, None


def token_logprobs(
    hidden: Tensor,
    lm_head_weight: Tensor,
    target_ids: Tensor,
    ignore_index: int = DEFAULT_IGNORE_INDEX,
    *,
    vocab_chunk: int = VOCAB_CHUNK,
    return_entropy: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Low-precision path: fp32 logprobs ``[...]`` (and fp32 entropy ``[...]`` if asked).

    ``hidden [..., H]`` and ``lm_head_weight [V, H]`` share a dtype (bf16/fp16/fp32);
    ``target_ids [...]`` is int32/int64.  The chunk logits are fp32 and never rounded to
    the input dtype, and the outputs are fp32 for every input dtype (RL needs fp32
    logprobs).  Differentiable in ``hidden`` and ``lm_head_weight`` (both outputs).
    """
    check_token_logprobs_args(hidden, lm_head_weight, target_ids, ignore_index, vocab_chunk)
    return _TokenLogprobsFunction.apply(
        hidden, lm_head_weight, target_ids, ignore_index, vocab_chunk, bool(return_entropy)
    )


def token_logprobs_fp32(
    hidden: Tensor,
    lm_head_weight: Tensor,
    target_ids: Tensor,
    ignore_index: int = DEFAULT_IGNORE_INDEX,
    *,
    vocab_chunk: int = VOCAB_CHUNK,
    return_entropy: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Strict fp32 path: ``hidden`` and the weight upcast, same definition (differentiable)."""
    check_token_logprobs_args(hidden, lm_head_weight, target_ids, ignore_index, vocab_chunk)
    with deterministic_context():
        return _TokenLogprobsFunction.apply(
            hidden.float(),
            lm_head_weight.float(),
            target_ids,
            ignore_index,
            vocab_chunk,
            bool(return_entropy),
        )


class TokenLogprobsReference(nn.Module):
    """Holds the lm_head weight; ``forward(hidden, target_ids)`` gives fp32 logprobs."""

    def __init__(
        self,
        lm_head_weight: Tensor,
        ignore_index: int = DEFAULT_IGNORE_INDEX,
        vocab_chunk: int = VOCAB_CHUNK,
    ):
        super().__init__()
        check_positive_int("vocab_chunk", vocab_chunk)
        self.weight = nn.Parameter(lm_head_weight)
        self.ignore_index = ignore_index
        self.vocab_chunk = vocab_chunk

    def forward(
        self, hidden: Tensor, target_ids: Tensor, *, return_entropy: bool = False
    ) -> Tensor | tuple[Tensor, Tensor]:
        return token_logprobs(
            hidden,
            self.weight,
            target_ids,
            self.ignore_index,
            vocab_chunk=self.vocab_chunk,
            return_entropy=return_entropy,
        )

    def forward_fp32(
        self, hidden: Tensor, target_ids: Tensor, *, return_entropy: bool = False
    ) -> Tensor | tuple[Tensor, Tensor]:
        return token_logprobs_fp32(
            hidden,
            self.weight,
            target_ids,
            self.ignore_index,
            vocab_chunk=self.vocab_chunk,
            return_entropy=return_entropy,
        )


# ------------------------------------------------- vocabulary tiles (vocab-parallel lm_head)
#
# A vocab-parallel lm_head (``batchinv.distributed.lm_head``) gives each rank whole tiles of
# ``VOCAB_TILE`` columns; the ranks exchange each tile's ``(m, l)`` state and the target's
# logit, and every rank merges all the tiles in the global order.  On the CPU these are the
# tile states and the merge: the same formulas as ``_forward_rows`` with
# ``vocab_chunk = VOCAB_TILE``, so ``token_logprobs_tiled`` is bitwise
# ``token_logprobs(..., vocab_chunk=VOCAB_TILE)``'s forward.  It is not bitwise the default
# chunking (``VOCAB_CHUNK``) and not the CUDA kernels' bits (another merge order); TP = T on
# the CPU equals this function (TP = 1) bitwise.

VOCAB_TILE = 256  # the CUDA forward's tile (kVocabTile in kernels_cu/token_logprobs.cu)


def tile_states(
    hidden32: Tensor, lm_head_weight: Tensor, targets: Tensor, tile: int = VOCAB_TILE
) -> tuple[Tensor, Tensor, Tensor]:
    """``(part_m, part_l, target_logit)``: the ``(m, l)`` state ``[T, ceil(V / tile)]`` of each
    ``tile``-column piece of ``hidden32 [T, H] @ lm_head_weight[V, H].T`` (fp32, K reduced in
    order; the last tile may be short) and the logit of ``targets [T]`` (ids into this
    weight's rows; an id outside ``[0, V)`` matches no column and leaves ``0.0``)."""
    vocab = lm_head_weight.shape[0]
    tokens = hidden32.shape[0]
    tiles = -(-vocab // tile)
    part_m = torch.empty(tokens, tiles, dtype=torch.float32, device=hidden32.device)
    part_l = torch.empty_like(part_m)
    target_logit = torch.zeros(tokens, dtype=torch.float32, device=hidden32.device)
    for index, start in enumerate(range(0, vocab, tile)):
        stop = min(vocab, start + tile)
        z = _chunk_logits(hidden32, lm_head_weight, start, stop)
        in_tile = (targets >= start) & (targets < stop)
        column = (targets - start).clamp(0, stop - start - 1).unsqueeze(-1)
        target_logit = torch.where(in_tile, z.gather(-1, column).squeeze(-1), target_logit)
        part_m[:, index], part_l[:, index] = chunk_lse_state(z)
    return part_m, part_l, target_logit


def merge_tile_states(
    part_m: Tensor, part_l: Tensor, target_logit: Tensor, valid: Tensor
) -> tuple[Tensor, Tensor]:
    """``(logprob [T], lse [T])``: the tile states merged left to right (``_forward_rows``'
    merge), ``lse = m + log(l)``, ``logprob = target_logit - lse`` (0.0 where not ``valid``)."""
    m, l = part_m[:, 0], part_l[:, 0]
    for index in range(1, part_m.shape[1]):
        m_new, scale_a, scale_b = lse_merge_scales(m, part_m[:, index])
        l = l * scale_a + part_l[:, index] * scale_b
        m = m_new
    lse = m + torch.log(l)
    logprob = torch.where(valid, target_logit - lse, torch.zeros_like(lse))
    return logprob, lse


def token_logprobs_tiled(
    hidden: Tensor,
    lm_head_weight: Tensor,
    target_ids: Tensor,
    ignore_index: int = DEFAULT_IGNORE_INDEX,
) -> Tensor:
    """fp32 logprobs ``[...]`` through ``tile_states`` and ``merge_tile_states``: the CPU's
    single-rank form of the vocab-parallel token logprobs (no gradient).  Bitwise
    ``token_logprobs(..., vocab_chunk=VOCAB_TILE)``; see the section comment above."""
    check_token_logprobs_args(hidden, lm_head_weight, target_ids, ignore_index, VOCAB_TILE)
    rows = hidden.reshape(hidden.shape[:-1].numel(), hidden.shape[-1])
    targets = target_ids.reshape(-1).long()
    valid = targets != ignore_index
    if rows.shape[0] == 0:
        return torch.zeros(target_ids.shape, dtype=torch.float32, device=hidden.device)
    with torch.no_grad():
        part_m, part_l, target_logit = tile_states(rows.float(), lm_head_weight, targets)
        logprob, _ = merge_tile_states(part_m, part_l, target_logit, valid)
    return logprob.reshape(target_ids.shape)

"""Attention under a boolean or additive mask, routed to batchinv's attention exactly or refused.

Stock attention APIs (``F.scaled_dot_product_attention``, Hugging Face's attention interface)
describe visibility with a mask ``[B, 1 or H, Sq, Sk]``.  batchinv's attention takes lengths:
a sequence's queries are its last tokens and query ``r`` of ``Lq`` sees the first
``Lk - Lq + r + 1`` of its ``Lk`` keys (causal, bottom-right) or all of them.  This module
reads a mask back into that form:

- a *kept key* is one that some query of its batch row sees;
- every query must see an interval of its row's kept keys (``c`` of them from the
  ``first``-th, ``c = 0`` allowed), and two consecutive queries either start at the same kept
  key or see intervals that do not overlap.  Right or left padding, causal or not, decode and
  chunked prefill against a cache, and several sequences packed in one row (a block-diagonal
  causal mask, as Hugging Face builds from restarting ``position_ids``) all have this form.
  Anything else (holes, sliding windows, a per-head mask, an additive bias other than
  0 / -inf) raises ``ValueError``; it is never sent to a stock kernel;
- consecutive queries with the same first key whose counts grow by one form a causal run
  (``Lq`` queries, ``Lk`` = the last count keys from the first); consecutive other queries
  with the same first key and count form a non-causal run.  A sequence's real tokens are one
  causal run, so they are computed exactly as the sequence alone, packed or padded; the padded
  queries HF lets see the real keys are computed as the mask says.

The runs are packed and run through ``batchinv.attention_varlen`` (one call for the causal
runs, one for the others); a query that sees no key gives zeros (stock SDPA gives NaN
there).  Without a mask the call goes to ``batchinv.attention`` directly.  Reading the mask
needs its values: a host sync per call.

Decode on CUDA (one query per row, a mask, no gradient) takes another route, with no host
sync, so a decode step can be captured in a CUDA graph (Hugging Face's static cache under
``torch.compile``): ``decode_with_mask``.  A decode row's visible keys must be one run
``[first, first + count)`` of its cache (left or right padding, keys past the end); the run is
read on the device into the kernels' layout (``k_start = first``, ``k_len = count``), so the
row computes exactly what the packed route computes for it: the same keys in the same order,
the same kernels, whose split boundaries count from the row's first key.  A batch with a row
that breaks the rule (holes in its visible keys, values other than 0/-inf, masks that differ
between heads) takes the packed route in eager code, which computes it or names the problem
(one host sync); under capture such a row gives zeros and the error is raised by
``batchinv.device_checks.raise_device_errors()``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import device_checks
from ..ops.attention import attention, attention_varlen


def visible_keys(mask: Tensor, batch: int, sq: int, sk: int) -> Tensor:
    """``[B, Sq, Sk]`` bool (True = the query sees the key) from a bool or additive mask
    broadcastable to ``[B, H, Sq, Sk]``; one mask for all heads."""
    if not isinstance(mask, Tensor):
        raise TypeError(f"attention mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype == torch.bool:
        visible = mask
    elif mask.is_floating_point():
        # HF's eager masks use finfo.min for "masked"; anything else is a bias we cannot route.
        masked = (mask == float("-inf")) | (mask <= torch.finfo(mask.dtype).min)
        if not bool(((mask == 0) | masked).all()):
            raise ValueError(
                "attention mask holds values other than 0 and -inf (an additive bias); "
                "batchinv routes only masks that select keys"
            )
        visible = mask == 0
    else:
        raise TypeError(f"attention mask must be bool or floating point, got {mask.dtype}")
    if visible.dim() > 4:
        raise ValueError(f"attention mask must have at most 4 dimensions, got {tuple(mask.shape)}")
    while visible.dim() < 4:
        visible = visible.unsqueeze(0)
    try:
        visible = visible.expand(batch, visible.shape[1], sq, sk)
    except RuntimeError as err:
        raise ValueError(
            f"attention mask of shape {tuple(mask.shape)} does not broadcast to "
            f"[B={batch}, H, Sq={sq}, Sk={sk}]"
        ) from err
    if visible.shape[1] > 1 and not bool((visible == visible[:, :1]).all()):
        raise ValueError("attention mask differs between heads; batchinv needs one mask per row")
    return visible[:, 0]


def _link_to_previous(flags: Tensor) -> Tensor:
    """``[B, Sq-1]`` flags about pairs ``(i-1, i)`` shifted to ``[B, Sq]`` (False at ``i = 0``)."""
    return torch.cat([flags.new_zeros((flags.shape[0], 1)), flags], dim=1)


def query_runs(visible: Tensor) -> dict[str, Tensor]:
    """Splits the queries of ``visible [B, Sq, Sk]`` into runs (module docstring), or raises.

    Returns flat query rows (``b * Sq + i``) in order, each row's run, and per run its batch
    row, the rank of its first key among the row's kept keys, ``lq``, ``lk`` and whether it is
    causal; and the flat kept keys (``b * Sk + j``) with each batch row's start among them.
    """
    batch, sq, sk = visible.shape
    counts = visible.sum(dim=-1)
    kept = visible.any(dim=-2)
    key_rank = kept.cumsum(dim=-1) - 1
    real = counts > 0
    first = torch.where(visible, key_rank[:, None, :], sk).amin(dim=-1)
    first = torch.where(real, first, 0)
    rank = key_rank[:, None, :]
    interval = kept[:, None, :] & (rank >= first[..., None]) & (rank < (first + counts)[..., None])
    both_real = real[:, 1:] & real[:, :-1]
    same_first = first[:, 1:] == first[:, :-1]
    overlapping = (first[:, 1:] < first[:, :-1] + counts[:, :-1]) & (
        first[:, :-1] < first[:, 1:] + counts[:, 1:]
    )
    if not torch.equal(visible, interval) or bool((both_real & ~same_first & overlapping).any()):
        raise ValueError(
            "attention mask is not padding / causal / packed sequences: some query sees keys "
            "that are not one interval of its row's visible keys, or two neighbouring queries "
            "see overlapping intervals that start apart (sliding windows and arbitrary masks "
            "are not routed to batchinv)"
        )
    step = counts[:, 1:] - counts[:, :-1]
    causal_link = _link_to_previous(both_real & same_first & (step == 1))
    in_causal = causal_link | torch.cat([causal_link[:, 1:], real.new_zeros((batch, 1))], 1)
    prev_in_causal = _link_to_previous(in_causal[:, :-1])
    same_link = (
        _link_to_previous(both_real & same_first & (step == 0)) & ~in_causal & ~prev_in_causal
    )
    starts = (real & ~causal_link & ~same_link).flatten()
    rows = real.flatten().nonzero().squeeze(1)
    run = (starts.cumsum(0) - 1)[rows]
    num_runs = int(starts.sum())
    first_rows = starts.nonzero().squeeze(1)
    row_counts = counts.flatten()[rows]
    lk = torch.zeros(num_runs, dtype=counts.dtype, device=counts.device)
    lk = lk.scatter_reduce(0, run, row_counts, reduce="amax")
    causal = torch.zeros(num_runs, dtype=torch.int64, device=counts.device)
    causal = causal.scatter_reduce(0, run, causal_link.flatten()[rows].long(), reduce="amax")
    return {
        "rows": rows,
        "run": run,
        "run_batch": first_rows // sq,
        "run_first": first.flatten()[first_rows],
        "lq": torch.bincount(run, minlength=num_runs),
        "lk": lk,
        "causal": causal.bool(),
        "kept_keys": kept.flatten().nonzero().squeeze(1),
        "kept_start": torch.cat([kept.new_zeros(1, dtype=torch.int64), kept.sum(-1).cumsum(0)]),
    }


def _exclusive_cumsum(x: Tensor) -> Tensor:
    return torch.cat([x.new_zeros(1), x.cumsum(0)])


def attention_with_mask(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    *,
    causal: bool,
    softmax_scale: float | None,
) -> Tensor:
    """``q [B, Sq, Hq, d]``, ``k, v [B, Sk, Hkv, d]`` -> ``[B, Sq, Hq, d]``.

    ``mask`` None: batchinv's attention with ``causal`` (bottom-right).  Otherwise the mask
    alone decides (``causal`` must be False): see the module docstring.
    """
    if mask is None:
        return attention(q, k, v, causal=causal, softmax_scale=softmax_scale)
    if causal:
        raise ValueError("pass either an attention mask or causal=True, not both")
    wants_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if q.shape[1] == 1 and q.device.type == "cuda" and not torch.version.hip and not wants_grad:
        return decode_with_mask(q, k, v, mask, softmax_scale=softmax_scale)
    return packed_with_mask(q, k, v, mask, softmax_scale=softmax_scale)


def packed_with_mask(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor, *, softmax_scale: float | None
) -> Tensor:
    """The mask read on the host into runs packed through ``attention_varlen`` (module
    docstring); any number of queries, any backend."""
    batch, sq, hq, d = q.shape
    sk = k.shape[1]
    runs = query_runs(visible_keys(mask.to(q.device), batch, sq, sk))
    q_rows = q.reshape(batch * sq, hq, d)
    k_rows, v_rows = (t.reshape(batch * sk, *t.shape[2:]) for t in (k, v))
    out = q.new_zeros(batch * sq, hq, d)
    for run_is_causal in (True, False):
        selected = (runs["causal"] == run_is_causal).nonzero().squeeze(1)
        if selected.numel() == 0:
            continue
        rows = runs["rows"][runs["causal"][runs["run"]] == run_is_causal]
        lq, lk = runs["lq"][selected], runs["lk"][selected]
        cu_q, cu_k = _exclusive_cumsum(lq), _exclusive_cumsum(lk)
        # Run r reads lk[r] kept keys of its batch row from its first one.
        first_key = runs["kept_start"][runs["run_batch"][selected]] + runs["run_first"][selected]
        offset = torch.arange(int(cu_k[-1]), device=q.device)
        offset = offset - torch.repeat_interleave(cu_k[:-1], lk)
        keys = runs["kept_keys"][torch.repeat_interleave(first_key, lk) + offset]
        packed = attention_varlen(
            q_rows[rows],
            k_rows[keys],
            v_rows[keys],
            cu_q,
            cu_k,
            causal=run_is_causal,
            softmax_scale=softmax_scale,
        )
        # index_put (not in place) keeps the gradient path to ``packed``.
        out = out.index_put((rows,), packed)
    return out.reshape(batch, sq, hq, d)


# ----------------------------------------------------------------------------- decode, on device


def decode_with_mask(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor, *, softmax_scale: float | None
) -> Tensor:
    """``q [B, 1, Hq, d]`` against ``k, v [B, Sk, Hkv, d]`` under ``mask`` (bool or additive,
    broadcastable to ``[B, H, 1, Sk]``) -> ``[B, 1, Hq, d]``, with no host sync (module
    docstring).  CUDA only; ``k``/``v`` laid out ``[B, Sk, Hkv, d]`` contiguously are read in
    place (otherwise copied once)."""
    batch, sq, hq, d = q.shape
    if sq != 1:
        raise ValueError(
            f"decode_with_mask takes one query per row, got q of shape {tuple(q.shape)}"
        )
    if not isinstance(mask, Tensor) or not (mask.dtype == torch.bool or mask.is_floating_point()):
        raise TypeError("attention mask must be a bool or floating-point torch.Tensor")
    if mask.dim() > 4:
        raise ValueError(f"attention mask must have at most 4 dimensions, got {tuple(mask.shape)}")
    sk = k.shape[1]
    rows = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    try:
        rows = rows.expand(batch, rows.shape[1], 1, sk)[:, :, 0]  # [B, H or 1, Sk]
    except RuntimeError as err:
        raise ValueError(
            f"attention mask of shape {tuple(mask.shape)} does not broadcast to "
            f"[B={batch}, H, 1, Sk={sk}]"
        ) from err
    scale = 0.0 if softmax_scale is None else float(softmax_scale)
    return torch.ops.batchinv.attention_decode_with_mask(
        q, k, v, rows.to(q.device), scale, softmax_scale is None
    )


def _run_of_visible_keys(rows: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(first, count, usable)`` per row of ``rows [B, H, Sk]`` (bool or additive): the run of
    visible keys of head 0 and whether the row follows the rule (0/-inf values, the same mask
    for every head, one run).  Device ops only."""
    if rows.dtype == torch.bool:
        visible = rows
        values_ok = torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
    else:
        masked = (rows == float("-inf")) | (rows <= torch.finfo(rows.dtype).min)
        values_ok = ((rows == 0) | masked).flatten(1).all(dim=1)
        visible = rows == 0
    heads_ok = (visible == visible[:, :1]).flatten(1).all(dim=1)
    visible = visible[:, 0]
    sk = visible.shape[1]
    flags = visible.to(torch.int32)
    count = flags.sum(dim=1)
    first = flags.argmax(dim=1)  # first True (0 when none)
    end = sk - flags.flip(1).argmax(dim=1)  # one past the last True
    one_run = (count == 0) | (end - first == count)
    return first, count, values_ok & heads_ok & one_run


@torch.library.custom_op("batchinv::attention_decode_with_mask", mutates_args=())
def _attention_decode_with_mask(
    q: Tensor, k: Tensor, v: Tensor, rows: Tensor, softmax_scale: float, default_scale: bool
) -> Tensor:
    from ..gpu import attention as gpu

    batch, _, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    gpu.check_supported(q, k, v)
    first, count, usable = _run_of_visible_keys(rows)
    if device_checks.deferring(q.device):
        device_checks.record(device_checks.DECODE_ATTENTION_MASK, ~usable)
    elif not bool(usable.all()):  # eager: the one sync of this route
        scale_arg = None if default_scale else softmax_scale
        return packed_with_mask(q, k, v, rows[:, :, None], softmax_scale=scale_arg)
    k_len = torch.where(usable, count, 0)
    arange = torch.arange(batch, device=q.device)
    layout = gpu.make_layout(
        arange, (k_len > 0).to(torch.int32), arange * sk + first, k_len, 1, sk, device=q.device
    )
    scale = gpu.scale_of(None if default_scale else softmax_scale, d)
    out, _ = gpu.forward(
        q.reshape(batch, hq, d),
        k.reshape(batch * sk, hkv, d),
        v.reshape(batch * sk, hkv, d),
        layout,
        False,
        scale,
        prefill_zero=True,  # rows with no visible key (or a refused mask) stay zero
    )
    return out.view(batch, 1, hq, d)


@_attention_decode_with_mask.register_fake
def _(q, k, v, rows, softmax_scale, default_scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)

"""Attention backward: batchinv's CUDA kernels against stock PyTorch's backward, same run,
same card.

Cases (Hq=32, Hkv=8 (GQA), causal, bf16):
- B=8 sequences of S=4096, d=128: SDPA's backward with the default backend and with the flash
  backend when it is selectable (GQA through ``enable_gqa``; if a backend refuses it, k/v are
  expanded to Hq heads and the row says so), then batchinv's ``attention_backward.backward`` in
  each kernel variant (same bits, different speed; ``KERNEL_VARIANT`` is the default; on sm_90a
  its dK/dV and dQ kernels are the wgmma ones, and rows "tiled, mma.sync _wide dK/dV" and
  "tiled, mma.sync _tiled dQ" time the former kernels), and each of its kernels timed alone
  (rows ending in "kernel").
- The same at d=64: SDPA's rows and batchinv's default variant.
- Varlen packing, d=128: 16 sequences of mixed lengths (``VARLEN_LENGTHS``, 32768 tokens) in
  one packed batch.  Anchors: ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention's
  varlen kernels, packed like batchinv) where this torch has it, and SDPA's default backend on
  the batch padded to the longest sequence (what a padded-batch user runs; it computes the
  padding too); batchinv's default variant.
The stock rows time ``autograd.grad`` of a forward recorded once (backward only); batchinv's
rows time the backward call (argument checks with their one host sync, zeroed outputs and the
launches), whose inputs (out, lse) come from one fp32 forward computed per sequence here.

TFLOP/s use the 2.5x-forward convention: forward = 4 * Hq * S^2 * d per sequence (two
matmuls), halved for causal; backward = 2.5 x forward (five matmuls instead of two); the
padded SDPA row is credited with the packed work only.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from _common import median_ms, parse_args, report, require_cuda, summary_row

from batchinv.gpu import attention_backward as gpu_attention_backward

SHAPES = [
    # (batch, seq_len, Hq, Hkv, d, causal, dtype, every variant)
    (8, 4096, 32, 8, 128, True, torch.bfloat16, True),
    (8, 4096, 32, 8, 64, True, torch.bfloat16, False),
]
# The varlen case: 16 sequences, 32768 tokens, lengths not multiples of the 64-query blocks.
VARLEN_LENGTHS = [
    1300,
    4096,
    700,
    2600,
    1900,
    3500,
    972,
    2200,
    1100,
    3000,
    1500,
    2400,
    900,
    2900,
    1700,
    2000,
]
VARLEN_HEADS = (32, 8, 128)  # Hq, Hkv, d


def summary_rows(rows: list[dict], variant: str) -> list[dict]:
    """The uniform summary from the detailed ``rows``: per case, batchinv's backward with the
    default kernel ``variant`` against the fastest stock row (SDPA's default backend for the
    uniform batches; the faster of varlen_attn and padded SDPA for varlen), goal 0.9x.  A case
    without a stock row or without that variant's row has no summary row."""
    cases: dict[tuple, dict[str, dict]] = {}
    for row in rows:
        key = (row["B"], row["S"], row["Hq/Hkv"], row["d"], row["causal"], row["dtype"])
        cases.setdefault(key, {})[row["path"]] = row
    summary = []
    for (batch, seq_len, heads, d, causal, dtype), paths in cases.items():
        stock = [p for p in paths if not p.startswith("batchinv")]
        mine = paths.get(f"batchinv ({variant})")
        if not stock or mine is None:
            continue
        anchor = min(stock, key=lambda p: paths[p]["ms"])
        mask = "causal, " if causal else ""
        summary.append(
            summary_row(
                "attention_backward",
                f"B={batch} S={seq_len} (GQA {heads}, d={d}, {mask}{dtype})",
                f"backward ({variant} kernels)",
                mine["ms"],
                anchor,
                paths[anchor]["ms"],
                0.9,
            )
        )
    return summary


def _backward_flops(lengths: list[int], hq: int, d: int, causal: bool) -> float:
    forward = sum(4.0 * hq * n * n * d for n in lengths)
    if causal:
        forward /= 2
    return 2.5 * forward


def _forward_stats(q, k, v, lengths, causal, scale):
    """out [T, Hq, d] (input dtype) and lse [Hq, T] fp32, one sequence at a time in fp32."""
    hq, hkv = q.shape[1], k.shape[1]
    out = torch.empty_like(q)
    lse = torch.empty(hq, q.shape[0], dtype=torch.float32, device=q.device)
    start = 0
    for n in lengths:
        rows = slice(start, start + n)
        start += n
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device)
        if causal:
            mask = mask.tril()
        qb = q[rows].float().transpose(0, 1)  # [Hq, S, d]
        kb = k[rows].float().transpose(0, 1).repeat_interleave(hq // hkv, dim=0)
        vb = v[rows].float().transpose(0, 1).repeat_interleave(hq // hkv, dim=0)
        scores = torch.matmul(qb, kb.transpose(1, 2)) * scale
        scores.masked_fill_(~mask, -math.inf)
        row_lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - row_lse[..., None])
        del scores
        out[rows] = torch.matmul(probs, vb).transpose(0, 1).to(q.dtype)
        lse[:, rows] = row_lse
        del probs
    return out, lse


def _kernel_split_ms(call, max_len, causal, scale, variant):
    """Median ms of each launch of batchinv's backward alone (delta, dK/dV, dQ), CUDA events;
    the argument checks and the zeroing of the outputs are not in these rows."""
    _, launches = gpu_attention_backward.kernel_launches(*call, max_len, max_len, causal, scale)
    return [(f"batchinv ({variant}) {stage} kernel", median_ms(run)) for stage, run in launches]


def _padded(t, lengths, max_len):
    """Packed [T, H, d] rows -> SDPA's [B, H, max_len, d], zero rows past each sequence."""
    out = t.new_zeros(len(lengths), max_len, *t.shape[1:])
    start = 0
    for i, n in enumerate(lengths):
        out[i, :n] = t[start : start + n]
        start += n
    return out.transpose(1, 2)


def _sdpa_backward_ms(q, k, v, grad, lengths, causal, backend):
    """Median ms of SDPA's backward on the batch padded to the longest sequence; (ms, note)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"default": None, "flash": SDPBackend.FLASH_ATTENTION}
    max_len = max(lengths)
    qs, ks, vs, gs = (_padded(t, lengths, max_len) for t in (q, k, v, grad))
    note = "enable_gqa"

    def run(expand: bool):
        nonlocal note
        qq = qs.detach().clone().requires_grad_(True)
        kk, vv = ks.detach().clone(), vs.detach().clone()
        if expand:
            group = q.shape[1] // k.shape[1]
            kk, vv = kk.repeat_interleave(group, dim=1), vv.repeat_interleave(group, dim=1)
            note = "k/v expanded to Hq heads"
        kk.requires_grad_(True)
        vv.requires_grad_(True)
        kwargs = {} if expand else {"enable_gqa": True}
        if backends[backend] is None:
            out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal, **kwargs)
        else:
            with sdpa_kernel(backends[backend]):
                out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal, **kwargs)
        return median_ms(lambda: torch.autograd.grad(out, (qq, kk, vv), gs, retain_graph=True))

    try:
        return run(expand=False), note
    except RuntimeError:
        return run(expand=True), note


def _varlen_attn_backward_ms(q, k, v, grad, lengths, causal):
    """Median ms of ``torch.nn.attention.varlen.varlen_attn``'s backward on the packed batch;
    (ms, note).  Its signature changed across torch versions: causal is ``is_causal`` or a
    window (-1, 0); GQA is ``enable_gqa`` where it exists, else k/v are expanded."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=q.device)
    kwargs = {}
    if "is_causal" in params:
        kwargs["is_causal"] = causal
    elif causal:
        kwargs["window_size"] = (-1, 0)
    kk, vv, note = k, v, "packed"
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    else:
        group = q.shape[1] // k.shape[1]
        kk, vv = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        note = "packed, k/v expanded to Hq heads"
    qq = q.detach().clone().requires_grad_(True)
    kk = kk.detach().clone().requires_grad_(True)
    vv = vv.detach().clone().requires_grad_(True)
    n = max(lengths)
    out = varlen_attn(qq, kk, vv, cu, cu, n, n, **kwargs)
    return median_ms(lambda: torch.autograd.grad(out, (qq, kk, vv), grad, retain_graph=True)), note


def _batchinv_ms(call, max_len, causal, scale, label):
    """batchinv's backward call, then each of its kernels alone."""
    ms = median_ms(lambda: gpu_attention_backward.backward(*call, max_len, max_len, causal, scale))
    return [(f"batchinv ({label})", ms), *_kernel_split_ms(call, max_len, causal, scale, label)]


def _batchinv_rows(q, call, max_len, causal, scale, every_variant):
    """batchinv's rows: the default variant, or every variant with the former sm_90a kernels."""
    api = gpu_attention_backward
    default_variant = api.KERNEL_VARIANT
    timings = []
    for variant in api.VARIANTS if every_variant else (default_variant,):
        api.KERNEL_VARIANT = variant
        timings += _batchinv_ms(call, max_len, causal, scale, variant)
        # The same variant with a former kernel where a newer one runs (same bits): the
        # mma.sync dK/dV and dQ.
        former = (
            ("USE_WGMMA_DKDV", api.dkdv_uses_wgmma, "mma.sync _wide dK/dV"),
            ("USE_WGMMA_DQ", api.dq_uses_wgmma, "mma.sync _tiled dQ"),
        )
        for switch, uses_wgmma, kernel in former:
            if not every_variant or variant != "tiled" or not uses_wgmma(q, variant):
                continue
            setattr(api, switch, False)
            timings += _batchinv_ms(call, max_len, causal, scale, f"tiled, {kernel}")
            setattr(api, switch, True)
    api.KERNEL_VARIANT = default_variant
    return timings


def _case_rows(lengths, hq, hkv, d, causal, dtype, every_variant, device) -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(0)
    total = sum(lengths)
    q = torch.randn(total, hq, d, device=device, generator=gen).to(dtype)
    k = torch.randn(total, hkv, d, device=device, generator=gen).to(dtype)
    v = torch.randn(total, hkv, d, device=device, generator=gen).to(dtype)
    grad = torch.randn(total, hq, d, device=device, generator=gen).to(dtype)
    scale = 1.0 / math.sqrt(d)
    out, lse = _forward_stats(q, k, v, lengths, causal, scale)
    starts = torch.tensor(
        [0, *itertools.accumulate(lengths)][:-1], dtype=torch.int32, device=device
    )
    sizes = torch.tensor(lengths, dtype=torch.int32, device=device)
    uniform = len(set(lengths)) == 1
    base = {
        "B": len(lengths),
        "S": lengths[0] if uniform else f"mixed, {total} tokens",
        "Hq/Hkv": f"{hq}/{hkv}",
        "d": d,
        "causal": causal,
        "dtype": str(dtype).removeprefix("torch."),
    }
    timings = []
    for backend in ("default", "flash"):
        try:
            ms, note = _sdpa_backward_ms(q, k, v, grad, lengths, causal, backend)
        except RuntimeError as error:
            print(f"SDPA {backend} backend not selectable here: {str(error)[:200]}")
            continue
        padded = "" if uniform else ", padded to the longest"
        timings.append((f"SDPA {backend} ({note}{padded})", ms))
    if not uniform:
        try:
            ms, note = _varlen_attn_backward_ms(q, k, v, grad, lengths, causal)
            timings.append((f"torch varlen_attn ({note})", ms))
        except (ImportError, RuntimeError, TypeError) as error:
            print(f"torch varlen_attn not usable here: {str(error)[:200]}")
    call = (q, k, v, out, lse, grad, starts, sizes, starts, sizes)
    timings += _batchinv_rows(q, call, max(lengths), causal, scale, every_variant)
    flops = _backward_flops(lengths, hq, d, causal)
    anchor = next((ms for path, ms in timings if path.startswith("SDPA default")), None)
    rows = []
    for path, ms in timings:
        whole = not path.endswith(" kernel")
        rows.append(
            {
                **base,
                "path": path,
                "ms": ms,
                "TFLOP/s": flops / ms / 1e9 if whole else None,
                "vs_sdpa_default": (anchor / ms) if anchor and whole else None,
            }
        )
    return rows


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    device = require_cuda()
    rows = []
    for batch, seq_len, hq, hkv, d, causal, dtype, every_variant in SHAPES:
        rows += _case_rows([seq_len] * batch, hq, hkv, d, causal, dtype, every_variant, device)
    hq, hkv, d = VARLEN_HEADS
    rows += _case_rows(VARLEN_LENGTHS, hq, hkv, d, True, torch.bfloat16, False, device)
    report(
        "attention_backward (TFLOP/s: backward = 2.5 x forward flops)",
        rows,
        ["B", "S", "Hq/Hkv", "d", "causal", "dtype", "path", "ms", "TFLOP/s", "vs_sdpa_default"],
        args.json,
        summary_rows(rows, gpu_attention_backward.KERNEL_VARIANT),
    )


if __name__ == "__main__":
    main()

"""Attention backward: batchinv's CUDA kernels against SDPA's backward, same run, same card.

Shape: B=8 sequences of S=4096, Hq=32, Hkv=8 (GQA), d=128, causal, bf16.  Rows:
SDPA's backward with the default backend and with the flash backend when it is selectable
(GQA through ``enable_gqa``; if a backend refuses it, k/v are expanded to Hq heads and the row
says so), then batchinv's ``attention_backward.backward`` in each kernel variant (same bits,
different speed; ``KERNEL_VARIANT`` is the default; on sm_90a its dK/dV and dQ kernels are the
wgmma ones, and rows "tiled, mma.sync _wide dK/dV" and "tiled, mma.sync _tiled dQ" time the
former kernels), and each of its three kernels timed
alone (rows ending in "kernel").  The SDPA rows time ``autograd.grad`` of a forward recorded
once (backward only); batchinv's rows time the backward call (argument checks with their one
host sync, zeroed outputs and the three launches), whose inputs (out, lse) come from one fp32
forward computed per sequence here.

TFLOP/s use the 2.5x-forward convention: forward = 4 * B * Hq * S^2 * d (two matmuls), halved
for causal; backward = 2.5 x forward (five matmuls instead of two).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from _common import median_ms, parse_args, report, require_cuda, summary_row

from batchinv.gpu import attention_backward as gpu_attention_backward

SHAPES = [
    # (batch, seq_len, Hq, Hkv, d, causal, dtype)
    (8, 4096, 32, 8, 128, True, torch.bfloat16),
]


def summary_rows(rows: list[dict], variant: str) -> list[dict]:
    """The uniform summary from the detailed ``rows``: per shape, batchinv's backward with
    the default kernel ``variant`` against SDPA's default backend (no goal).  A
    shape without an SDPA default row or without that variant's row has no summary row."""
    cases: dict[tuple, dict[str, dict]] = {}
    for row in rows:
        key = (row["B"], row["S"], row["Hq/Hkv"], row["d"], row["causal"], row["dtype"])
        cases.setdefault(key, {})[row["path"]] = row
    summary = []
    for (batch, seq_len, heads, d, causal, dtype), paths in cases.items():
        anchor = next((p for p in paths if p.startswith("SDPA default")), None)
        mine = paths.get(f"batchinv ({variant})")
        if anchor is None or mine is None:
            continue
        mask = "causal, " if causal else ""
        summary.append(
            summary_row(
                "attention_backward",
                f"B={batch} S={seq_len} (GQA {heads}, d={d}, {mask}{dtype})",
                f"backward ({variant} kernels)",
                mine["ms"],
                anchor,
                paths[anchor]["ms"],
                None,
            )
        )
    return summary


def _backward_flops(batch, seq_len, hq, d, causal) -> float:
    forward = 4.0 * batch * hq * seq_len * seq_len * d
    if causal:
        forward /= 2
    return 2.5 * forward


def _forward_stats(q, k, v, batch, seq_len, causal, scale):
    """out [T, Hq, d] (input dtype) and lse [Hq, T] fp32, one sequence at a time in fp32."""
    hq, hkv = q.shape[1], k.shape[1]
    out = torch.empty_like(q)
    lse = torch.empty(hq, q.shape[0], dtype=torch.float32, device=q.device)
    mask = torch.ones(seq_len, seq_len, dtype=torch.bool, device=q.device)
    if causal:
        mask = mask.tril()
    for b in range(batch):
        rows = slice(b * seq_len, (b + 1) * seq_len)
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


def _kernel_split_ms(call, seq_len, causal, scale, variant):
    """Median ms of each launch of batchinv's backward alone (delta, dK/dV, dQ), CUDA events;
    the argument checks and the zeroing of the outputs are not in these rows."""
    _, launches = gpu_attention_backward.kernel_launches(*call, seq_len, seq_len, causal, scale)
    return [(f"batchinv ({variant}) {stage} kernel", median_ms(run)) for stage, run in launches]


def _batched(t, batch, seq_len):
    """[B * S, H, d] rows -> SDPA's [B, H, S, d] (a view)."""
    return t.view(batch, seq_len, *t.shape[1:]).transpose(1, 2)


def _sdpa_backward_ms(q, k, v, grad, batch, seq_len, causal, backend):
    """Median ms of SDPA's backward; (ms, note)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"default": None, "flash": SDPBackend.FLASH_ATTENTION}
    qs, ks, vs = (_batched(t, batch, seq_len) for t in (q, k, v))
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
        g = _batched(grad, batch, seq_len)
        return median_ms(lambda: torch.autograd.grad(out, (qq, kk, vv), g, retain_graph=True))

    try:
        return run(expand=False), note
    except RuntimeError:
        return run(expand=True), note


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    device = require_cuda()
    rows_out = []
    default_variant = gpu_attention_backward.KERNEL_VARIANT
    for batch, seq_len, hq, hkv, d, causal, dtype in SHAPES:
        gen = torch.Generator(device=device).manual_seed(0)
        total = batch * seq_len
        q = torch.randn(total, hq, d, device=device, generator=gen).to(dtype)
        k = torch.randn(total, hkv, d, device=device, generator=gen).to(dtype)
        v = torch.randn(total, hkv, d, device=device, generator=gen).to(dtype)
        grad = torch.randn(total, hq, d, device=device, generator=gen).to(dtype)
        scale = 1.0 / math.sqrt(d)
        out, lse = _forward_stats(q, k, v, batch, seq_len, causal, scale)
        starts = torch.arange(batch, dtype=torch.int32, device=device) * seq_len
        lengths = torch.full((batch,), seq_len, dtype=torch.int32, device=device)
        flops = _backward_flops(batch, seq_len, hq, d, causal)
        base = {
            "B": batch,
            "S": seq_len,
            "Hq/Hkv": f"{hq}/{hkv}",
            "d": d,
            "causal": causal,
            "dtype": str(dtype).removeprefix("torch."),
        }
        timings = []
        for backend in ("default", "flash"):
            try:
                ms, note = _sdpa_backward_ms(q, k, v, grad, batch, seq_len, causal, backend)
            except RuntimeError as error:
                print(f"SDPA {backend} backend not selectable here: {str(error)[:200]}")
                continue
            timings.append((f"SDPA {backend} ({note})", ms))
        for variant in gpu_attention_backward.VARIANTS:
            gpu_attention_backward.KERNEL_VARIANT = variant
            call = (q, k, v, out, lse, grad, starts, lengths, starts, lengths)
            ms = median_ms(
                lambda call=call: gpu_attention_backward.backward(
                    *call, seq_len, seq_len, causal, scale
                )
            )
            timings.append((f"batchinv ({variant})", ms))
            timings.extend(_kernel_split_ms(call, seq_len, causal, scale, variant))
            # The same variant with a former kernel where a newer one runs (same bits): the
            # mma.sync dK/dV and dQ.
            former = (
                ("USE_WGMMA_DKDV", gpu_attention_backward.dkdv_uses_wgmma, "mma.sync _wide dK/dV"),
                ("USE_WGMMA_DQ", gpu_attention_backward.dq_uses_wgmma, "mma.sync _tiled dQ"),
            )
            for switch, uses_wgmma, kernel in former:
                if variant != "tiled" or not uses_wgmma(q, variant):
                    continue
                setattr(gpu_attention_backward, switch, False)
                label = f"tiled, {kernel}"
                ms = median_ms(
                    lambda call=call: gpu_attention_backward.backward(
                        *call, seq_len, seq_len, causal, scale
                    )
                )
                timings.append((f"batchinv ({label})", ms))
                timings.extend(_kernel_split_ms(call, seq_len, causal, scale, label))
                setattr(gpu_attention_backward, switch, True)
        gpu_attention_backward.KERNEL_VARIANT = default_variant
        anchor = next((ms for path, ms in timings if path.startswith("SDPA default")), None)
        for path, ms in timings:
            whole = not path.endswith(" kernel")
            rows_out.append(
                {
                    **base,
                    "path": path,
                    "ms": ms,
                    "TFLOP/s": flops / ms / 1e9 if whole else None,
                    "vs_sdpa_default": (anchor / ms) if anchor and whole else None,
                }
            )
    report(
        "attention_backward (TFLOP/s: backward = 2.5 x forward flops)",
        rows_out,
        ["B", "S", "Hq/Hkv", "d", "causal", "dtype", "path", "ms", "TFLOP/s", "vs_sdpa_default"],
        args.json,
        summary_rows(rows_out, default_variant),
    )


if __name__ == "__main__":
    main()

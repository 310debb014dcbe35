"""Attention forward (prefill and KV-cache decode) against torch SDPA in the same run.

Goals (issue 5): prefill >= 0.9x SDPA default, decode B=64 @ 4096 >= 0.9x, decode B=1 @ 32768
>= 0.8x.  Anchors: SDPA's default backend (cuDNN on Hopper) and, where selectable, its flash
backend.  Decode times batchinv's kernels on the cache storage (the append is a copy, not
timed); SDPA decode uses a length-1 query against the same keys (enable_gqa=True).  Decode
bandwidth counts the K and V bytes that must be read.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import cuda_graph_replay, median_ms, report, require_cuda, summary_row
from torch.nn.attention import SDPBackend, sdpa_kernel

from batchinv.gpu import attention as gpu
from batchinv.gpu import attention_hopper

HQ, HKV, D = 32, 8, 128  # D: the decode cases' head dim
PREFILL = [(8, 4096, 128), (8, 4096, 64)]  # (batch, sequence length, head dim), causal
DECODE = [(64, 4096), (1, 32768)]  # (batch, context)
DTYPE = torch.bfloat16
GOALS = {  # of SDPA's default backend, by (phase, batch, sequence length or context) (issue 5)
    ("prefill", 8, 4096): 0.9,
    ("decode", 64, 4096): 0.9,
    ("decode", 1, 32768): 0.8,
}


def summary_rows(results: list[dict]) -> list[dict]:
    """The uniform summary: batchinv's default path against SDPA's default backend.

    ``results`` holds one dict per comparison: ``phase`` ("prefill" or "decode"), ``batch``,
    ``length`` (sequence length or context), ``d`` (head dim; D where absent), ``timing``
    ("eager" or "CUDA graph"),
    ``batchinv_ms`` and ``sdpa_ms`` (SDPA default, timed the same way).  The forced kernel
    modes and the flash backend stay in the detailed rows only.
    """
    rows = []
    for r in results:
        suffix = "" if r["timing"] == "eager" else f", {r['timing']}"
        length = "S" if r["phase"] == "prefill" else "ctx"
        rows.append(
            summary_row(
                "attention",
                f"B={r['batch']} {length}={r['length']} (GQA {HQ}/{HKV}, d={r.get('d', D)}, bf16)",
                ("prefill (causal)" if r["phase"] == "prefill" else "decode") + suffix,
                r["batchinv_ms"],
                "SDPA default" + suffix,
                r["sdpa_ms"],
                GOALS.get((r["phase"], r["batch"], r["length"])),
            )
        )
    return rows


def _sdpa(q, k, v, causal, backend=None):
    def run():
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

    if backend is None:
        return run

    def with_backend():
        with sdpa_kernel(backend):
            return run()

    return with_backend


def _decode_label(mode: str, warps: int, pdl: bool) -> str:
    """What the default decode path runs: split launches of one-warp (16-row) tiles run the
    cooperative split kernel (4 warps per tile) and the combine kernel, the combine with
    programmatic dependent launch (``pdl``) on sm_90."""
    if mode == "split" and warps == 1:
        return f"batchinv (coop split + combine{', PDL' if pdl else ''})"
    tag = ", PDL" if pdl and mode == "split" else ""
    return f"batchinv ({mode}, {warps} warp{'s' if warps > 1 else ''}{tag})"


def _time_or_none(fn):
    try:
        fn()
        torch.cuda.synchronize()
    except RuntimeError as error:
        print(f"note: skipped ({error.__class__.__name__}: {str(error)[:100]})")
        return None
    return median_ms(fn)


def _graphed(fn):
    """``fn`` replayed from a CUDA graph, or None (with a note) where capture fails."""
    try:
        return cuda_graph_replay(fn)
    except RuntimeError as error:
        print(f"note: graph capture failed ({error.__class__.__name__}: {str(error)[:100]})")
        return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument(
        "--phase",
        choices=("all", "prefill", "decode"),
        default="all",
        help="time only the prefill or only the decode cases (all)",
    )
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    device = require_cuda()
    gen = torch.Generator(device=device).manual_seed(0)
    rows, results = [], []
    pdl = gpu.combine_uses_pdl(device)
    prefill_cases = PREFILL if args.phase in ("all", "prefill") else []
    decode_cases = DECODE if args.phase in ("all", "decode") else []
    for batch, seq, d in prefill_cases:
        q = torch.randn(batch, seq, HQ, d, device=device, generator=gen).to(DTYPE)
        k = torch.randn(batch, seq, HKV, d, device=device, generator=gen).to(DTYPE)
        v = torch.randn(batch, seq, HKV, d, device=device, generator=gen).to(DTYPE)
        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        flops = 4 * batch * HQ * seq * seq * d / 2  # causal: half of the score matrix
        anchor = median_ms(_sdpa(qt, kt, vt, True))
        paths = {
            "SDPA default": anchor,
            "SDPA flash": _time_or_none(_sdpa(qt, kt, vt, True, SDPBackend.FLASH_ATTENTION)),
            "batchinv": median_ms(lambda: gpu.attention(q, k, v, causal=True)),
            # The mma.sync tile kernel, which sm_90 devices no longer run by default for this
            # case (attention_hopper: same bits).
            "batchinv (mma.sync tile, forced)": median_ms(
                lambda: gpu.attention(q, k, v, causal=True, mode="tile", warps=4, hopper=False)
            ),
        }
        rows_q = q.view(batch * seq, HQ, d)
        rows_k, rows_v = k.view(-1, HKV, d), v.view(-1, HKV, d)
        kernel = "hopper" if attention_hopper.applies(rows_q, rows_k, rows_v) else "mma.sync"
        print(f"prefill B={batch} S={seq} d={d}: the default path runs the {kernel} tile kernel")
        results.append(
            {
                "phase": "prefill",
                "batch": batch,
                "length": seq,
                "d": d,
                "timing": "eager",
                "batchinv_ms": paths["batchinv"],
                "sdpa_ms": anchor,
            }
        )
        for path, ms in paths.items():
            if ms is None:
                continue
            rows.append(
                {
                    "case": f"prefill B={batch} S={seq} d={d}",
                    "path": path,
                    "ms": ms,
                    "TFLOP/s": flops / ms / 1e9,
                    "ratio_vs_sdpa": anchor / ms,
                }
            )
    for batch, ctx in decode_cases:
        k = torch.randn(batch, ctx, HKV, D, device=device, generator=gen).to(DTYPE)
        v = torch.randn(batch, ctx, HKV, D, device=device, generator=gen).to(DTYPE)
        q = torch.randn(batch, 1, HQ, D, device=device, generator=gen).to(DTYPE)
        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        kv_bytes = 2 * k.numel() * k.element_size()
        layout = gpu.make_layout(
            torch.arange(batch, device=device),
            torch.ones(batch, device=device),
            torch.arange(batch, device=device) * ctx,
            torch.full((batch,), ctx, device=device),
            1,
            ctx,
        )
        scale = gpu.scale_of(None, D)
        q_rows = q.view(batch, HQ, D)
        k_rows, v_rows = k.view(batch * ctx, HKV, D), v.view(batch * ctx, HKV, D)
        mode, warps = gpu.choose(layout, HQ, HKV, device, "auto", None)
        anchor = median_ms(_sdpa(qt, kt, vt, False))
        split = mode == "split"
        default_path = _decode_label(mode, warps, pdl and split)

        def run(pdl=None, **tuning):
            return gpu.forward(
                q_rows, k_rows, v_rows, layout, True, scale, prefill_zero=False, pdl=pdl, **tuning
            )

        paths = {
            "SDPA default": anchor,
            "SDPA flash": _time_or_none(_sdpa(qt, kt, vt, False, SDPBackend.FLASH_ATTENTION)),
            default_path: median_ms(run),
        }
        if pdl and split:
            # The same kernels with the combine launched in plain stream order; then both
            # again, alternating, to show the spread of the difference.
            paths[_decode_label(mode, warps, False)[:-1] + ", no PDL, forced)"] = median_ms(
                lambda: run(pdl=False)
            )
            again = [median_ms(lambda on=on: run(pdl=on)) for on in (True, False, True, False)]
            print(
                f"decode B={batch} ctx={ctx}: PDL on/off/on/off "
                + " / ".join(f"{ms * 1e3:.1f}" for ms in again)
                + " us"
            )
        decode = {"phase": "decode", "batch": batch, "length": ctx}
        results.append(
            {**decode, "timing": "eager", "batchinv_ms": paths[default_path], "sdpa_ms": anchor}
        )
        pdl_tag = ", PDL" if pdl and split else ""
        graph_path = f"batchinv ({mode}{pdl_tag}, CUDA graph)"
        batchinv_graph = _graphed(run)
        sdpa_graph = _graphed(_sdpa(qt, kt, vt, False))
        if batchinv_graph is not None and sdpa_graph is not None:
            paths["SDPA default (CUDA graph)"] = median_ms(sdpa_graph)
            paths[graph_path] = median_ms(batchinv_graph)
            results.append(
                {
                    **decode,
                    "timing": "CUDA graph",
                    "batchinv_ms": paths[graph_path],
                    "sdpa_ms": paths["SDPA default (CUDA graph)"],
                }
            )
            if pdl_tag:
                no_pdl_graph = _graphed(lambda: run(pdl=False))
                if no_pdl_graph is not None:
                    paths[f"batchinv ({mode}, no PDL, CUDA graph, forced)"] = median_ms(
                        no_pdl_graph
                    )
        if split:
            # The cooperative kernel with each K/V pipeline, and the one-warp kernel.
            variants = [(True, s) for s in gpu.COOP_STAGES] + [(False, gpu.TILE_STAGES)]
            for coop, stages in variants:
                kernel = f"{'coop' if coop else '1 warp'}, {stages}-block ring"
                paths[f"batchinv (split, {kernel}{pdl_tag}, forced)"] = median_ms(
                    lambda coop=coop, stages=stages: run(stages=stages, coop=coop)
                )
        for other in ("tile", "split"):
            if other != mode:
                tag = ", PDL" if pdl and other == "split" else ""
                paths[f"batchinv ({other}{tag}, forced)"] = median_ms(
                    lambda other=other: run(mode=other)
                )
        for path, ms in paths.items():
            if ms is None:
                continue
            rows.append(
                {
                    "case": f"decode B={batch} ctx={ctx}",
                    "path": path,
                    "ms": ms,
                    "TB/s": kv_bytes / ms / 1e9,
                    "ratio_vs_sdpa": anchor / ms,
                }
            )
    report(
        "attention forward (GQA 32/8, bf16; prefill d=128 and 64, decode d=128)",
        rows,
        ["case", "path", "ms", "TFLOP/s", "TB/s", "ratio_vs_sdpa"],
        args.json,
        summary_rows(results),
    )


if __name__ == "__main__":
    main()

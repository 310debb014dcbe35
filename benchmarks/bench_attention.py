"""Attention forward (prefill and KV-cache decode) against torch SDPA in the same run.

Goals: prefill >= 0.9x SDPA default, decode B=64 @ 4096 >= 0.9x, decode B=1 @ 32768
>= 0.8x.  Anchors: SDPA's default backend (cuDNN on Hopper) and, where selectable, its flash
backend.  Prefill: SDPA default, batchinv and the forced mma.sync tile kernel are
timed in PREFILL_ROUNDS interleaved rounds (the order rotated each round and reversed every
other round), each a do_bench median; a path's time is the median over its rounds, and every
round's value is printed and kept in the JSON row (``rounds_ms``), so the spread is visible.
Decode times batchinv's kernels on the cache storage (the append is a copy, not timed); SDPA
decode uses a length-1 query against the same keys (enable_gqa=True).  Decode bandwidth counts
the K and V bytes that must be read.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import cuda_graph_replay, median_ms, report, require_cuda, summary_row
from torch.nn.attention import SDPBackend, sdpa_kernel

from batchinv.gpu import attention as gpu
from batchinv.gpu import attention_hopper

HQ, HKV, D = 32, 8, 128  # D: the decode cases' head dim
PREFILL = [(8, 4096, 128), (8, 4096, 64)]  # (batch, sequence length, head dim), causal
PREFILL_ROUNDS = 5  # interleaved timing rounds of the prefill paths (medians over rounds)
DECODE = [(64, 4096), (1, 32768)]  # (batch, context)
DTYPE = torch.bfloat16
GOALS = {  # of SDPA's default backend, by (phase, batch, sequence length or context)
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
                # The goals are for d = 128; the d = 64 case has none.
                GOALS.get((r["phase"], r["batch"], r["length"])) if r.get("d", D) == D else None,
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


def round_orders(names: list[str], rounds: int) -> list[list[str]]:
    """The order of ``names`` in each timing round: rotated by one each round and reversed
    every other round, so that no path always runs first or always follows the same path."""
    orders = []
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        orders.append(order[::-1] if r % 2 else order)
    return orders


def interleaved_rounds(paths: dict, rounds: int, label: str) -> dict[str, list[float]]:
    """Times every callable of ``paths`` once per round (a do_bench median each) in the orders
    of :func:`round_orders`; prints each round and returns every path's per-round times."""
    names = list(paths)
    times = {name: [] for name in names}
    for r, order in enumerate(round_orders(names, rounds)):
        for name in order:
            times[name].append(median_ms(paths[name]))
        print(
            f"{label} round {r + 1}/{rounds} (order: {', '.join(order)}): "
            + ", ".join(f"{name} {times[name][-1]:.3f} ms" for name in names)
        )
    return times


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
        label = f"prefill B={batch} S={seq} d={d}"
        # SDPA default, batchinv and the mma.sync tile kernel (which sm_90 devices do not run
        # by default for this case; attention_hopper: same bits) in interleaved rounds: one
        # do_bench median per path moved by several percent between runs (clocks, other work).
        rounds = interleaved_rounds(
            {
                "SDPA default": _sdpa(qt, kt, vt, True),
                "batchinv": lambda: gpu.attention(q, k, v, causal=True),
                "batchinv (mma.sync tile, forced)": lambda: gpu.attention(
                    q, k, v, causal=True, mode="tile", warps=4, hopper=False
                ),
            },
            PREFILL_ROUNDS,
            label,
        )
        medians = {name: statistics.median(values) for name, values in rounds.items()}
        anchor = medians["SDPA default"]
        round_ratios = [
            a / b for a, b in zip(rounds["SDPA default"], rounds["batchinv"], strict=True)
        ]
        print(
            f"{label}: batchinv / SDPA default per round "
            + " ".join(f"{ratio:.3f}x" for ratio in round_ratios)
            + f"; ratio of the medians {anchor / medians['batchinv']:.3f}x"
        )
        paths = {
            "SDPA default": anchor,
            "SDPA flash": _time_or_none(_sdpa(qt, kt, vt, True, SDPBackend.FLASH_ATTENTION)),
            "batchinv": medians["batchinv"],
            "batchinv (mma.sync tile, forced)": medians["batchinv (mma.sync tile, forced)"],
        }
        rows_q = q.view(batch * seq, HQ, d)
        rows_k, rows_v = k.view(-1, HKV, d), v.view(-1, HKV, d)
        kernel = "hopper" if attention_hopper.applies(rows_q, rows_k, rows_v) else "mma.sync"
        print(f"{label}: the default path runs the {kernel} tile kernel")
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
            row = {
                "case": label,
                "path": path,
                "ms": ms,
                "TFLOP/s": flops / ms / 1e9,
                "ratio_vs_sdpa": anchor / ms,
            }
            if path in rounds:  # ms is the median of these rounds
                row["rounds_ms"] = rounds[path]
            if path == "batchinv":
                row["round_ratios_vs_sdpa"] = round_ratios
            rows.append(row)
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

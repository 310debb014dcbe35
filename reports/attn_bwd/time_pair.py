"""attn-bwd device call (session 10): the two-warpgroup wgmma dK/dV kernel (``pair``, 128 keys
per CTA, the branch's default) against the one-warpgroup wgmma dK/dV kernel (``one``, main's
default, forced with ``USE_WGMMA_DKDV_PAIR = False``) and SDPA's default backward, in paired
interleaved rounds (the order rotated each round), ``median_ms`` (``do_bench`` medians);
B = 8, S = 4096, Hq/Hkv = 32/8, d = 128, causal, bf16 (the benchmark's shape).

First, bits at that shape: dq, dk and dv of ``pair`` against ``one`` (bitwise, every element).
Per round: the dK/dV launch alone (each kernel) and the whole backward (argument checks, zeroed
outputs, the three launches) with each kernel, and SDPA's backward.  Writes JSON to argv[1].

    python reports/attn_bwd/time_pair.py OUT.json
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import median_ms  # noqa: E402
from bench_attention_backward import _forward_stats, _sdpa_backward_ms  # noqa: E402

from batchinv.contract import assert_bitwise_equal  # noqa: E402
from batchinv.gpu import attention_backward as gab  # noqa: E402

ROUNDS = 5
B, S, HQ, HKV, D = 8, 4096, 32, 8, 128


def main() -> None:
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    total = B * S
    q = torch.randn(total, HQ, D, device=device, generator=gen).bfloat16()
    k = torch.randn(total, HKV, D, device=device, generator=gen).bfloat16()
    v = torch.randn(total, HKV, D, device=device, generator=gen).bfloat16()
    grad = torch.randn(total, HQ, D, device=device, generator=gen).bfloat16()
    scale = 1.0 / math.sqrt(D)
    out, lse = _forward_stats(q, k, v, B, S, True, scale)
    starts = torch.arange(B, dtype=torch.int32, device=device) * S
    lengths = torch.full((B,), S, dtype=torch.int32, device=device)
    call = (q, k, v, out, lse, grad, starts, lengths, starts, lengths, S, S, True, scale)

    def with_pair(pair: bool):
        gab.USE_WGMMA_DKDV_PAIR = pair
        assert gab.dkdv_uses_wgmma_pair(q) == pair and gab.dkdv_uses_wgmma(q)

    results: dict = {"gpu": torch.cuda.get_device_name(), "rounds": []}
    grads = {}
    for pair in (True, False):
        with_pair(pair)
        grads[pair] = gab.backward(*call)
    for name, a, b in zip(("dq", "dk", "dv"), grads[True], grads[False], strict=True):
        assert_bitwise_equal(a, b, name=f"{name}, pair vs one warpgroup (benchmark shape)")
    results["bits"] = "dq, dk, dv bitwise equal (pair vs one) at the benchmark shape"
    print(results["gpu"], results["bits"], flush=True)
    del grads

    def dkdv_launch(pair: bool):
        with_pair(pair)
        _, launches = gab.kernel_launches(*call)
        return dict(launches)["dkdv"]

    def timed(label: str) -> float:
        if label == "sdpa":
            return _sdpa_backward_ms(q, k, v, grad, B, S, True, "default")[0]
        kind, which = label.split(":")
        pair = which == "pair"
        if kind == "dkdv":
            return median_ms(dkdv_launch(pair))
        with_pair(pair)
        return median_ms(lambda: gab.backward(*call))

    labels = ["dkdv:pair", "dkdv:one", "whole:pair", "whole:one", "sdpa"]
    for r in range(ROUNDS):
        order = labels[r % len(labels) :] + labels[: r % len(labels)]
        row = {label: timed(label) for label in order}
        row["order"] = order
        results["rounds"].append(row)
        print(
            f"round {r}: dK/dV pair {row['dkdv:pair']:.3f} one {row['dkdv:one']:.3f} | whole pair "
            f"{row['whole:pair']:.3f} one {row['whole:one']:.3f} | SDPA {row['sdpa']:.3f} ms",
            flush=True,
        )
    with_pair(True)
    for key in labels:
        values = sorted(row[key] for row in results["rounds"])
        results[f"median {key}"] = values[len(values) // 2]
    results["pair faster in every round (dK/dV, whole)"] = [
        all(row["dkdv:pair"] < row["dkdv:one"] for row in results["rounds"]),
        all(row["whole:pair"] < row["whole:one"] for row in results["rounds"]),
    ]
    print(json.dumps({k: v for k, v in results.items() if k != "rounds"}, indent=1))
    Path(sys.argv[1]).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

"""attn-bwd device call 2 (session 10): the two-warpgroup wgmma dQ kernel (``pair``, 128 queries
per CTA, the branch's default) against the one-warpgroup wgmma dQ kernel (``one``, main's
default, forced with ``USE_WGMMA_DQ_PAIR = False``) and SDPA's default backward, in paired
interleaved rounds (the order rotated each round), ``median_ms`` (``do_bench`` medians);
B = 8, S = 4096, Hq/Hkv = 32/8, d = 128, causal, bf16 (the benchmark's shape).  The dK/dV
launch is the pair dK/dV kernel (call 1's) throughout.  ``time_pair.py`` with the dQ switch in
place of the dK/dV one.  Ran at commit ``e7b5dfd``; the pair dQ kernel was then reverted (not
faster in every round of the whole backward), so this script needs that commit's tree.

First, bits at that shape: dq, dk and dv of ``pair`` against ``one`` (bitwise, every element).
Per round: the dQ launch alone (each kernel) and the whole backward (argument checks, zeroed
outputs, the three launches) with each kernel, and SDPA's backward.  Writes JSON to argv[1].

    python reports/attn_bwd/time_dq_pair.py OUT.json
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
        gab.USE_WGMMA_DQ_PAIR = pair
        assert gab.dq_uses_wgmma_pair(q) == pair and gab.dq_uses_wgmma(q)
        assert gab.dkdv_uses_wgmma_pair(q)

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

    def dq_launch(pair: bool):
        with_pair(pair)
        _, launches = gab.kernel_launches(*call)
        return dict(launches)["dq"]

    def timed(label: str) -> float:
        if label == "sdpa":
            return _sdpa_backward_ms(q, k, v, grad, B, S, True, "default")[0]
        kind, which = label.split(":")
        pair = which == "pair"
        if kind == "dq":
            return median_ms(dq_launch(pair))
        with_pair(pair)
        return median_ms(lambda: gab.backward(*call))

    labels = ["dq:pair", "dq:one", "whole:pair", "whole:one", "sdpa"]
    for r in range(ROUNDS):
        order = labels[r % len(labels) :] + labels[: r % len(labels)]
        row = {label: timed(label) for label in order}
        row["order"] = order
        results["rounds"].append(row)
        print(
            f"round {r}: dQ pair {row['dq:pair']:.3f} one {row['dq:one']:.3f} | whole pair "
            f"{row['whole:pair']:.3f} one {row['whole:one']:.3f} | SDPA {row['sdpa']:.3f} ms",
            flush=True,
        )
    with_pair(True)
    for key in labels:
        values = sorted(row[key] for row in results["rounds"])
        results[f"median {key}"] = values[len(values) // 2]
    results["pair faster in every round (dQ, whole)"] = [
        all(row["dq:pair"] < row["dq:one"] for row in results["rounds"]),
        all(row["whole:pair"] < row["whole:one"] for row in results["rounds"]),
    ]
    print(json.dumps({k: v for k, v in results.items() if k != "rounds"}, indent=1))
    Path(sys.argv[1]).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

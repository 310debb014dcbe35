"""attn-hopper-d64 device calls: prefill at d = 64 and d = 128, the Hopper kernel and the
mma.sync tile kernel (checked bitwise equal first) against SDPA's default backend, interleaved
with the order rotated each round; GQA 32/8, bf16, ``do_bench`` medians.  Calls 1 and 2 ran
this script with one more d = 64 path each, the experiment entries of those builds (ring depths
3 and 4; three consumer warpgroups): see README.md."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, "benchmarks")
from _common import median_ms  # noqa: E402

from batchinv.contract import assert_bitwise_equal  # noqa: E402
from batchinv.gpu import attention as gpu  # noqa: E402

HQ, HKV = 32, 8
# (batch, sequence length, head dim, causal, rounds)
SHAPES = [
    (8, 4096, 64, True, 3),
    (8, 4096, 64, False, 2),
    (32, 2048, 64, True, 2),
    (8, 4096, 128, True, 3),
]


def run_hopper(q, k, v, causal):
    """The Hopper kernel (forced)."""
    return gpu.attention(q, k, v, causal=causal, return_lse=True, mode="tile", warps=4, hopper=True)


def time_shape(batch, seq, d, causal, rounds):
    gen = torch.Generator(device="cuda").manual_seed(seq + d)
    q, k, v = (
        torch.randn(batch, seq, h, d, device="cuda", generator=gen).bfloat16()
        for h in (HQ, HKV, HKV)
    )
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    paths = {
        "sdpa": lambda: F.scaled_dot_product_attention(
            qt, kt, vt, is_causal=causal, enable_gqa=True
        ),
        "hopper": lambda: run_hopper(q, k, v, causal),
        "mma_sync": lambda: gpu.attention(
            q, k, v, causal=causal, return_lse=True, mode="tile", warps=4, hopper=False
        ),
    }
    ref = paths["hopper"]()
    for name in paths:
        if name == "mma_sync":
            try:
                assert_bitwise_equal(paths[name](), ref, name=f"{name} vs hopper d={d}")
                print(f"B={batch} S={seq} d={d} causal={causal}: {name} bitwise equal to hopper")
            except AssertionError as error:  # timed anyway; the tests decide
                print(f"B={batch} S={seq} d={d} causal={causal}: {name} DIFFERS: {error}"[:400])
    names = list(paths)
    rows = []
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        times = {name: median_ms(paths[name], warmup_ms=50, rep_ms=250) for name in order}
        rows.append({"batch": batch, "seq": seq, "d": d, "causal": causal, "round": r + 1} | times)
        line = " ".join(f"{n}={times[n]:.3f}" for n in names)
        ratios = ", ".join(f"{n} {times['sdpa'] / times[n]:.3f}x" for n in names if n != "sdpa")
        print(
            f"B={batch} S={seq} d={d} causal={causal} round {r + 1}: {line} ms | of SDPA: {ratios}"
        )
    return rows


def main() -> None:
    print(torch.cuda.get_device_name())
    rows = []
    for shape in SHAPES:
        rows += time_shape(*shape)
        torch.cuda.empty_cache()
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

# The script as it ran on the device (loop lambdas are called inside their iteration).
# ruff: noqa: B023, E501, F821
"""One build's prefill/decode times vs SDPA default, interleaved rounds (split-size experiment)."""

import json
import statistics
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from batchinv.gpu import attention as gpu

HQ, HKV, D = 32, 8, 128
dev = torch.device("cuda")
gen = torch.Generator(device=dev).manual_seed(0)
out = {"build": sys.argv[1], "split_keys": gpu.SPLIT_KEYS}


def ms(fn):
    return float(do_bench(fn, warmup=50, rep=200, return_mode="median"))


def rounds(paths, n):
    t = {k: [] for k in paths}
    for r in range(n):
        for k in list(paths)[:: 1 if r % 2 == 0 else -1]:
            t[k].append(ms(paths[k]))
    return t


for batch, seq, d in [(8, 4096, 128), (8, 4096, 64), (32, 2048, 128)]:
    q = torch.randn(batch, seq, HQ, d, device=dev, generator=gen).bfloat16()
    k = torch.randn(batch, seq, HKV, d, device=dev, generator=gen).bfloat16()
    v = torch.randn(batch, seq, HKV, d, device=dev, generator=gen).bfloat16()
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    t = rounds(
        {
            "sdpa": lambda: F.scaled_dot_product_attention(
                qt, kt, vt, is_causal=True, enable_gqa=True
            ),
            "batchinv": lambda: gpu.attention(q, k, v, causal=True),
        },
        4,
    )
    key = f"prefill {batch}x{seq} d{d}"
    out[key] = {p: statistics.median(x) for p, x in t.items()} | {"rounds": t}
    print(
        key,
        {p: round(statistics.median(x), 4) for p, x in t.items()},
        "ratio",
        round(statistics.median(t["sdpa"]) / statistics.median(t["batchinv"]), 4),
        flush=True,
    )

for batch, ctx in [(64, 4096), (1, 32768), (8, 8192)]:
    k = torch.randn(batch, ctx, HKV, D, device=dev, generator=gen).bfloat16()
    v = torch.randn(batch, ctx, HKV, D, device=dev, generator=gen).bfloat16()
    q = torch.randn(batch, 1, HQ, D, device=dev, generator=gen).bfloat16()
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    layout = gpu.make_layout(
        torch.arange(batch, device=dev),
        torch.ones(batch, device=dev),
        torch.arange(batch, device=dev) * ctx,
        torch.full((batch,), ctx, device=dev),
        1,
        ctx,
    )
    scale = gpu.scale_of(None, D)
    qr, kr, vr = q.view(batch, HQ, D), k.view(batch * ctx, HKV, D), v.view(batch * ctx, HKV, D)
    t = rounds(
        {
            "sdpa": lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True),
            "batchinv": lambda: gpu.forward(qr, kr, vr, layout, True, scale, prefill_zero=False),
        },
        4,
    )
    key = f"decode B={batch} ctx={ctx}"
    out[key] = {p: statistics.median(x) for p, x in t.items()} | {"rounds": t}
    print(
        key,
        {p: round(statistics.median(x) * 1e3, 2) for p, x in t.items()},
        "us ratio",
        round(statistics.median(t["sdpa"]) / statistics.median(t["batchinv"]), 4),
        flush=True,
    )

json.dump(out, open(sys.argv[2], "w"), indent=1)

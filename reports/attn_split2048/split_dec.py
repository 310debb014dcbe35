# The script as it ran on the device (loop lambdas are called inside their iteration).
# ruff: noqa: B023, E501, F821
"""Decode times of one build: SDPA default vs batchinv coop stages 1/2/3 (split-size experiment 2)."""

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
    return float(do_bench(fn, warmup=30, rep=120, return_mode="median"))


for batch, ctx in [
    (1, 1000),
    (1, 2000),
    (1, 4096),
    (1, 8192),
    (1, 32768),
    (8, 8192),
    (64, 4096),
    (16, 2000),
]:
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
    paths = {"sdpa": lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)}
    for s in (1, 2, 3):
        paths[f"s{s}"] = lambda s=s: gpu.forward(
            qr, kr, vr, layout, True, scale, prefill_zero=False, stages=s
        )
    ref = paths["s1"]()[0]
    t = {p: [] for p in paths}
    for r in range(3):
        for p in list(paths)[:: 1 if r % 2 == 0 else -1]:
            try:
                t[p].append(ms(paths[p]))
            except Exception as e:  # a stage count that does not fit
                t[p].append(float("nan"))
                print("note", p, type(e).__name__, str(e)[:100])
    for s in (2, 3):
        try:
            same = torch.equal(paths[f"s{s}"]()[0].view(torch.int16), ref.view(torch.int16))
        except Exception:
            same = None
        t[f"s{s}_same_bits"] = same
    key = f"B={batch} ctx={ctx}"
    med = {p: statistics.median(x) * 1e3 for p, x in t.items() if isinstance(x, list)}
    out[key] = {"median_us": med, "rounds": t}
    print(
        key,
        {p: round(x, 1) for p, x in med.items()},
        "us; ratios",
        {p: round(med["sdpa"] / x, 3) for p, x in med.items() if p != "sdpa"},
        "same bits s2/s3",
        t["s2_same_bits"],
        t["s3_same_bits"],
        flush=True,
    )

json.dump(out, open(sys.argv[2], "w"), indent=1)

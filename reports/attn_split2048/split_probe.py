# The script as it ran on the device (loop lambdas are called inside their iteration).
# ruff: noqa: B023, E501, F821
"""B=1 @ 32768 decode: fresh K/V allocations in one process, each timed (bimodality probe)."""

import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from batchinv.gpu import attention as gpu

HQ, HKV, D = 32, 8, 128
dev = torch.device("cuda")
gen = torch.Generator(device=dev).manual_seed(0)
keep = []


def ms(fn):
    return float(do_bench(fn, warmup=30, rep=100, return_mode="median")) * 1e3


for batch, ctx in [(1, 32768), (64, 4096)]:
    for trial in range(5):
        k = torch.randn(batch, ctx, HKV, D, device=dev, generator=gen).bfloat16()
        v = torch.randn(batch, ctx, HKV, D, device=dev, generator=gen).bfloat16()
        q = torch.randn(batch, 1, HQ, D, device=dev, generator=gen).bfloat16()
        keep.append(
            torch.empty(trial * 3 + 1, 1 << 20, dtype=torch.uint8, device=dev)
        )  # shift addresses
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
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        row = {"sdpa": ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True))}
        for s in (1, 2):
            row[f"s{s}"] = ms(
                lambda s=s: gpu.forward(
                    qr, kr, vr, layout, True, scale, prefill_zero=False, stages=s
                )
            )
        print(
            sys.argv[1],
            gpu.SPLIT_KEYS,
            f"B={batch} ctx={ctx} trial {trial} k@{k.data_ptr() % (1 << 30):#x}",
            {p: round(x, 1) for p, x in row.items()},
            flush=True,
        )
        del k, v, q, qt, kt, vt

"""A/B timing of cooperative decode launch layouts (attn-dec, session 6); SDPA in the same run."""

import json
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, "benchmarks")
from _common import median_ms  # noqa: E402

from batchinv.gpu import attention as gpu  # noqa: E402

HQ, HKV, D, DT = 32, 8, 128, torch.bfloat16
dev = torch.device("cuda")
print(torch.cuda.get_device_name(), flush=True)
res = {"gpu": torch.cuda.get_device_name(), "cases": {}}
for batch, ctx, rounds in ((64, 4096, 4), (1, 32768, 3)):
    gen = torch.Generator(device=dev).manual_seed(0)
    k = torch.randn(batch, ctx, HKV, D, device=dev, generator=gen).to(DT)
    v = torch.randn(batch, ctx, HKV, D, device=dev, generator=gen).to(DT)
    q = torch.randn(batch, 1, HQ, D, device=dev, generator=gen).to(DT)
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    layout = gpu.make_layout(
        torch.arange(batch, device=dev), torch.ones(batch, device=dev),
        torch.arange(batch, device=dev) * ctx, torch.full((batch,), ctx, device=dev), 1, ctx,
    )
    scale = gpu.scale_of(None, D)
    rows = (q.view(batch, HQ, D), k.view(-1, HKV, D), v.view(-1, HKV, D))

    def run(**kw):
        return gpu.forward(*rows, layout, True, scale, prefill_zero=False, **kw)

    def sdpa():
        return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

    variants = {
        "SDPA default": sdpa,
        "default": run,
        "s1 tma": lambda: run(stages=1, tma=True),
        "s1 cp.async": lambda: run(stages=1, tma=False),
        "s2 tma": lambda: run(stages=2, tma=True),
        "s2 cp.async": lambda: run(stages=2, tma=False),
        "s3 tma": lambda: run(stages=3, tma=True),
    }
    # bits: every variant equals the default path
    base = run()
    for name, fn in variants.items():
        if name.startswith("SDPA"):
            continue
        o = fn()
        same = torch.equal(o[0].view(torch.int16), base[0].view(torch.int16)) and torch.equal(
            o[1].view(torch.int32), base[1].view(torch.int32)
        )
        assert same, f"bits differ: {name}"
    times = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            times[name].append(median_ms(variants[name]) * 1e3)
    sd = sorted(times["SDPA default"])[len(times["SDPA default"]) // 2]
    case = f"decode B={batch} ctx={ctx}"
    print(case, flush=True)
    for name in names:
        t = times[name]
        med = sorted(t)[len(t) // 2]
        print(f"  {name:28s} " + " / ".join(f"{x:7.1f}" for x in t) + f" us  median {med:7.1f}  ratio {sd / med:.3f}", flush=True)
    res["cases"][case] = times
json.dump(res, open(sys.argv[1], "w"), indent=1)

# ruff: noqa
# fmt: off
# One process: the two-group first level's rows per group S under three host rules (the kernels
# take S as an argument; bf16 t128k4g2 keeps 16), interleaved rounds, do_bench medians of
# gpu.rms_norm.backward (all levels) against a copy of the bytes moved (dy, x read, dx written).
import math, sys, torch
from triton.testing import do_bench
from batchinv.gpu import rms_norm as g
rules = {
    "s16": lambda rows: 16,                                               # round 2: 2 x 16
    "p256": g.two_groups_sequence,                                        # merged: <= 256 partials
    "cap32": lambda rows: min(32, max(16, math.ceil(rows / 512))),        # P256 up to 16384 rows
}
dev = torch.device("cuda")
shapes = [(r, 5120, torch.bfloat16) for r in (8192, 12288, 16384, 24576, 32768, 65536)]
shapes += [(16384, 5120, torch.float16), (32768, 5120, torch.float16), (16384, 2560, torch.float32), (32768, 2560, torch.float32), (32768, 2048, torch.float32)]
for rows, d, dt in shapes:
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(rows, d, device=dev, generator=gen).to(dt)
    w = torch.randn(d, device=dev, generator=gen).to(dt)
    dy = torch.randn(rows, d, device=dev, generator=gen).to(dt)
    rstd = g.forward(x, w, 1e-6)[1]
    nbytes = x.numel() * x.element_size()
    src = torch.empty(3 * nbytes // 2, dtype=torch.uint8, device=dev); dst = torch.empty_like(src)
    res = {k: [] for k in rules}; copies = []
    for rnd in range(3):
        copies.append(do_bench(lambda: dst.copy_(src), warmup=20, rep=60, return_mode="median"))
        for name, rule in rules.items():
            g.two_groups_sequence = rule
            res[name].append(do_bench(lambda: g.backward(dy, x, w, rstd), warmup=20, rep=60, return_mode="median"))
    copy = sorted(copies)[1]
    line = f"{rows}x{d} {str(dt)[6:]} copy {copy*1e3:.1f}"
    for name, ts in res.items():
        m = sorted(ts)[1]
        line += f" | {name} S={rules[name](rows)} " + "/".join(f"{t*1e3:.1f}" for t in ts) + f" ({copy/m:.3f})"
    print(line, flush=True)

# ruff: noqa
# fmt: off
# One process: gpu.rms_norm.backward (all levels) with the last-levels grid overlapped with the
# first level (per-run counts) against the form that waits for the whole first level, same
# build, interleaved rounds; do_bench medians; ratio to a copy of the bytes moved (dy, x read,
# dx written).  Also level 1 alone (the fused kernel) for reference.
import sys, torch
from triton.testing import do_bench
from batchinv.gpu import rms_norm as g
dev = torch.device("cuda")
print(torch.cuda.get_device_name(0), flush=True)
shapes = [(16384, 4096, torch.bfloat16), (16384, 5120, torch.bfloat16), (16384, 5120, torch.float16),
          (16384, 4096, torch.float16), (16384, 2048, torch.float32), (16384, 2560, torch.float32),
          (8192, 4096, torch.bfloat16), (32768, 4096, torch.bfloat16), (65536, 4096, torch.bfloat16),
          (32768, 5120, torch.bfloat16), (4096, 4096, torch.bfloat16), (65536, 128, torch.bfloat16),
          (524288, 128, torch.bfloat16)]
if len(sys.argv) > 1: shapes = shapes[: int(sys.argv[1])]
rounds = 4
for rows, d, dt in shapes:
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(rows, d, device=dev, generator=gen).to(dt)
    w = torch.randn(d, device=dev, generator=gen).to(dt)
    dy = torch.randn(rows, d, device=dev, generator=gen).to(dt)
    rstd = g.forward(x, w, 1e-6)[1]
    nbytes = x.numel() * x.element_size()
    src = torch.empty(3 * nbytes // 2, dtype=torch.uint8, device=dev); dst = torch.empty_like(src)
    name, blocks, cta, shape = g.fused_backward_plan(d, dt, rows)
    partials = torch.empty(blocks, d, device=dev); gx = torch.empty_like(x)
    def level1():
        g.launch_fused_backward(name, dt, dev, blocks, cta, (gx, partials, dy, x, w, rstd, 0, rows, d, d), shape=shape)
    modes = {"stream": (True, "stream"), "call": (True, "call"), "wait": (False, "stream")}
    res = {k: [] for k in modes}; res["level1"] = []; copies = []
    bits = []
    for key, (overlap, where) in modes.items():
        g.OVERLAP_LAST_LEVELS, g.RUN_COUNTERS = overlap, where
        for _ in range(3):
            bits.append(g.backward(dy, x, w, rstd)[1].view(torch.int16 if dt != torch.float32 else torch.int32).clone())
    same = all(bool(torch.equal(bits[0], b)) for b in bits)
    for rnd in range(rounds):
        copies.append(do_bench(lambda: dst.copy_(src), warmup=20, rep=60, return_mode="median"))
        for key, (overlap, where) in modes.items():
            g.OVERLAP_LAST_LEVELS, g.RUN_COUNTERS = overlap, where
            res[key].append(do_bench(lambda: g.backward(dy, x, w, rstd), warmup=20, rep=60, return_mode="median"))
        res["level1"].append(do_bench(level1, warmup=20, rep=60, return_mode="median"))
    g.OVERLAP_LAST_LEVELS, g.RUN_COUNTERS = True, "stream"
    copy = sorted(copies)[rounds // 2]
    used = g.run_counters_for(dev, blocks) is not None
    line = f"{rows}x{d} {str(dt)[6:]} {name} {blocks} partials counters={used} bits_equal={same} copy {copy*1e3:.1f}"
    for key, ts in res.items():
        m = sorted(ts)[rounds // 2]
        line += f" | {key} " + "/".join(f"{t*1e3:.1f}" for t in ts) + f" ({copy/m:.3f})"
    print(line, flush=True)

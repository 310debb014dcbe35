# ruff: noqa
# fmt: off
# Kernel timeline of gpu.rms_norm.backward (torch.profiler / CUPTI timestamps): for each mode,
# per iteration the kernels' start offsets and durations relative to the first kernel, so the
# time from the first level's end to the last-levels grid's end is visible.
import torch
from torch.profiler import profile, ProfilerActivity
from batchinv.gpu import rms_norm as g
dev = torch.device("cuda")
print(torch.cuda.get_device_name(0), flush=True)
for rows, d, dt in ((16384, 4096, torch.bfloat16), (16384, 5120, torch.bfloat16)):
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(rows, d, device=dev, generator=gen).to(dt)
    w = torch.randn(d, device=dev, generator=gen).to(dt)
    dy = torch.randn(rows, d, device=dev, generator=gen).to(dt)
    rstd = g.forward(x, w, 1e-6)[1]
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device=dev)
    for mode in (True, False):
        g.OVERLAP_LAST_LEVELS = mode
        for _ in range(5):
            g.backward(dy, x, w, rstd)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(6):
                flush.zero_()
                g.backward(dy, x, w, rstd)
            torch.cuda.synchronize()
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        events.sort(key=lambda e: e.time_range.start)
        lines = []
        base = None
        for e in events:
            name = e.name
            short = "flush" if "fill" in name.lower() else ("L1" if "backward_weight_grad" in name else ("LL" if "last_levels" in name else name[:30]))
            if short == "flush":
                if base is not None: print(f"{rows}x{d} overlap={mode}: " + " ".join(lines), flush=True)
                base = e.time_range.end; lines = []
                continue
            if base is None: continue
            lines.append(f"{short}[{e.time_range.start - base:.1f}..{e.time_range.end - base:.1f}]")
        if lines: print(f"{rows}x{d} overlap={mode}: " + " ".join(lines), flush=True)
    g.OVERLAP_LAST_LEVELS = True
    name, blocks, cta, shape = g.fused_backward_plan(d, dt, rows)
    partials = torch.empty(blocks, d, device=dev); gx = torch.empty_like(x)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(6):
            flush.zero_()
            g.launch_fused_backward(name, dt, dev, blocks, cta, (gx, partials, dy, x, w, rstd, 0, rows, d, d), shape=shape)
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e.time_range.start)
    prev_end = None
    for e in events:
        if "backward_weight_grad" in e.name:
            print(f"{rows}x{d} level1 alone: L1 {e.time_range.end - e.time_range.start:.1f} us after flush end +{e.time_range.start - prev_end:.1f}", flush=True)
        prev_end = e.time_range.end

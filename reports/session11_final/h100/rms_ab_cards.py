# ruff: noqa
# fmt: off
# One process: RMSNorm backward kernels (gpu.rms_norm.backward, all levels) and forward at the
# bench's shapes, with a device copy of the same bytes in the same process (do_bench medians).
import sys, torch
from triton.testing import do_bench
from batchinv.gpu import rms_norm as g
tag = sys.argv[1]
dev = torch.device("cuda")
for rows, d in ((16384, 5120), (16384, 4096), (8192, 5120), (32768, 5120)):
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(rows, d, device=dev, generator=gen).bfloat16()
    w = torch.randn(d, device=dev, generator=gen).bfloat16()
    dy = torch.randn(rows, d, device=dev, generator=gen).bfloat16()
    y, rstd = g.forward(x, w, 1e-6)[:2]
    nbytes = x.numel() * 2
    src = torch.empty(3 * nbytes, dtype=torch.uint8, device=dev); dst = torch.empty_like(src)
    copy3 = do_bench(lambda: dst.copy_(src), warmup=20, rep=60, return_mode="median")
    bwd = do_bench(lambda: g.backward(dy, x, w, rstd), warmup=20, rep=60, return_mode="median")
    fwd = do_bench(lambda: g.forward(x, w, 1e-6), warmup=20, rep=60, return_mode="median")
    copy2 = do_bench(lambda: dst[: 2 * nbytes].copy_(src[: 2 * nbytes]), warmup=20, rep=60, return_mode="median")
    print(f"{tag} {rows}x{d} bwd {bwd*1e3:.1f} us copy3 {copy3*1e3:.1f} ratio {copy3/bwd:.3f} | fwd {fwd*1e3:.1f} copy2 {copy2*1e3:.1f} ratio {copy2/fwd:.3f}", flush=True)

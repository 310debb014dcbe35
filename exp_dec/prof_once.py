"""Two cooperative split launches each of the 1-block ring with cp.async and with TMA copies
(B=64 ctx 4096 GQA 32/8 d=128 bf16), for ncu."""
import torch

from batchinv.gpu import attention as gpu

dev = torch.device("cuda")
batch, ctx, HQ, HKV, D = 64, 4096, 32, 8, 128
gen = torch.Generator(device=dev).manual_seed(0)
k = torch.randn(batch * ctx, HKV, D, device=dev, generator=gen).to(torch.bfloat16)
v = torch.randn(batch * ctx, HKV, D, device=dev, generator=gen).to(torch.bfloat16)
q = torch.randn(batch, HQ, D, device=dev, generator=gen).to(torch.bfloat16)
layout = gpu.make_layout(
    torch.arange(batch, device=dev), torch.ones(batch, device=dev),
    torch.arange(batch, device=dev) * ctx, torch.full((batch,), ctx, device=dev), 1, ctx,
)
for kw in (dict(stages=1, tma=False), dict(stages=1, tma=False), dict(stages=1, tma=True), dict(stages=1, tma=True)):
    gpu.forward(q, k, v, layout, True, gpu.scale_of(None, D), prefill_zero=False, **kw)
torch.cuda.synchronize()

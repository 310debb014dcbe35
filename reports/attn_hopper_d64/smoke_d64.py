"""attn-hopper-d64 device call, first step: one small d = 64 launch per dtype on the Hopper
kernel, bitwise against the mma.sync tile kernel (a hang or a mismatch shows here first)."""

from __future__ import annotations

import torch

from batchinv.contract import assert_bitwise_equal
from batchinv.gpu import attention as gpu

for dtype in (torch.bfloat16, torch.float16):
    for causal in (True, False):
        gen = torch.Generator(device="cuda").manual_seed(1)
        q, k, v = (
            torch.randn(2, 300, h, 64, device="cuda", generator=gen).to(dtype) for h in (8, 2, 2)
        )
        new = gpu.attention(
            q, k, v, causal=causal, return_lse=True, mode="tile", warps=4, hopper=True
        )
        old = gpu.attention(
            q, k, v, causal=causal, return_lse=True, mode="tile", warps=4, hopper=False
        )
        torch.cuda.synchronize()
        try:
            assert_bitwise_equal(new, old, name=f"d=64 {dtype} causal={causal}")
            print(f"d=64 {dtype} causal={causal}: bitwise equal")
        except AssertionError as error:
            diff = (new[0].float() - old[0].float()).abs()
            print(
                f"d=64 {dtype} causal={causal}: MISMATCH max|diff| {diff.max().item():.3e}, "
                f"{(diff > 0).float().mean().item():.2%} differ; lse max|diff| "
                f"{(new[1] - old[1]).abs().nan_to_num().max().item():.3e}; first (b, s, h, col) "
                f"{(diff > 0).nonzero()[:6].tolist()}\n{str(error)[:300]}"
            )

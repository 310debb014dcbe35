"""Quick GPU smoke check of the linear kernels against torch.mm, one config at a time."""

import torch

from batchinv.gpu import linear as L

torch.manual_seed(0)
for m, k, n in [(65, 128, 64), (1, 64, 32), (300, 4096, 1000)]:
    x = torch.randn(m, k, device="cuda").bfloat16()
    w = torch.randn(n, k, device="cuda").bfloat16()
    ref = x.float() @ w.float().t()
    for family, configs in (("mma", [None]), ("hopper", list(L.hopper_configs()))):
        for config in configs:
            out = L.matmul_nt(x, w, family=family, config=config)
            torch.cuda.synchronize()
            err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
            print(f"{m}x{k}x{n} {family} {config}: max rel err {err:.2e}", flush=True)

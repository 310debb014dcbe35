"""One warm-up and one profiled launch of the Hopper prefill kernel at the bench shape (B=8
S=4096 causal, GQA 32/8, d = 128, bf16), for Nsight Compute: ``python3 prof_one.py [old]``
(``old``: main's 64-key kernel from the temporary ``hopper_old`` module)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from time_kv128 import run_with  # noqa: E402

module = None
if len(sys.argv) > 1 and sys.argv[1] == "old":
    import hopper_old

    module = hopper_old
q = torch.randn(8, 4096, 32, 128, device="cuda").bfloat16()
k = torch.randn(8, 4096, 8, 128, device="cuda").bfloat16()
v = torch.randn(8, 4096, 8, 128, device="cuda").bfloat16()
for _ in range(2):
    run_with(module, q, k, v, True)
torch.cuda.synchronize()

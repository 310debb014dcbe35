"""Times every compiled Hopper linear configuration against cuBLAS on one GPU.

All configurations give identical bits, so the choice in ``choose_config`` is pure
performance; this prints the data that choice is based on.
    python tools/tune_linear.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

from batchinv.gpu.linear import hopper_configs, matmul_nt
from batchinv.shapes import QWEN3_8B_LINEAR

M_VALUES = (1, 64, 256, 1024, 4096)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = []
    print(f"GPU: {torch.cuda.get_device_name()}")
    for name, k, n in QWEN3_8B_LINEAR:
        w = (torch.randn(n, k, device="cuda") / k**0.5).bfloat16()
        for m in M_VALUES:
            x = torch.randn(m, k, device="cuda").bfloat16()
            cublas = do_bench(
                lambda x=x, w=w: torch.mm(x, w.t()), warmup=25, rep=100, return_mode="median"
            )
            timings = {}
            for config in hopper_configs():
                fn = lambda c=config, x=x, w=w: matmul_nt(x, w, family="hopper", config=c)  # noqa: E731
                timings[str(config)] = do_bench(fn, warmup=25, rep=100, return_mode="median")
            best = min(timings, key=timings.get)
            ranked = sorted(timings.items(), key=lambda kv: kv[1])[:3]
            summary = ", ".join(f"{c}: {cublas / t:.3f}" for c, t in ranked)
            print(f"{name:13s} M={m:5d}  best vs cuBLAS {cublas / timings[best]:.3f}  [{summary}]")
            results.append({"layer": name, "M": m, "cublas_ms": cublas, "configs_ms": timings})
        del w
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

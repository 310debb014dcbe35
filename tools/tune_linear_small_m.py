"""Times the small-M linear kernels against the Hopper tile kernels and cuBLAS at decode sizes.

Every configuration gives identical bits (checked here too, against the big-M tile), so the
choice of ``SMALL_M_MAX_ROWS`` and ``choose_small_m_config`` is pure performance; this prints
the data behind it.
    python tools/tune_linear_small_m.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

from batchinv.gpu.linear import (
    TileConfig,
    choose_config,
    matmul_nt,
    small_m_configs,
)
from batchinv.runtime import multiprocessors
from batchinv.shapes import QWEN3_8B_LINEAR

M_VALUES = (1, 2, 4, 8, 16, 32, 64)
BIG_M_TILE = TileConfig(128, 256, 64, 4)


def _ms(fn) -> float:
    return float(do_bench(fn, warmup=10, rep=40, return_mode="median"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--m", type=int, nargs="+", default=M_VALUES, help="token counts")
    args = parser.parse_args()
    sms = multiprocessors(torch.cuda.current_device())
    print(f"GPU: {torch.cuda.get_device_name()} ({sms} SMs)")
    results = []
    for name, k, n in QWEN3_8B_LINEAR:
        w = (torch.randn(n, k, device="cuda") / k**0.5).bfloat16()
        for m in args.m:
            x = torch.randn(m, k, device="cuda").bfloat16()
            big = matmul_nt(x, w, family="hopper", config=BIG_M_TILE)
            cublas = _ms(lambda x=x, w=w: torch.mm(x, w.t()))
            hopper = choose_config(m, n, sms)
            timings = {
                f"hopper {hopper}": _ms(
                    lambda x=x, w=w, c=hopper: matmul_nt(x, w, family="hopper", config=c)
                )
            }
            mismatches = []
            for config in small_m_configs():
                fn = lambda c=config, x=x, w=w: matmul_nt(x, w, family="small_m", config=c)  # noqa: E731
                if not torch.equal(fn().view(torch.int16), big.view(torch.int16)):
                    mismatches.append(str(config))
                timings[str(config)] = _ms(fn)
            ranked = sorted(timings.items(), key=lambda kv: kv[1])
            line = ", ".join(f"{c}: {cublas / t:.2f}" for c, t in ranked)
            flag = f"  BITS DIFFER: {mismatches}" if mismatches else ""
            print(f"{name:13s} M={m:3d} cuBLAS {cublas * 1e3:7.1f} us  [{line}]{flag}")
            results.append(
                {
                    "layer": name,
                    "M": m,
                    "N": n,
                    "K": k,
                    "cublas_ms": cublas,
                    "configs_ms": timings,
                    "bits_differ": mismatches,
                }
            )
        del w
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

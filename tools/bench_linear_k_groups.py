"""EXPERIMENTAL: the cost and gain of the K-group tree at M = 1 and M = 4096.

Times cuBLAS (``torch.mm``), batchinv's linear (sequential K) and
``batchinv.gpu.linear.matmul_nt_k_groups`` (4 K groups, fp32 partials, fixed tree) in the
same run, bf16, Qwen3-8B shapes.
    python tools/bench_linear_k_groups.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

from batchinv.gpu.linear import matmul_nt_k_groups, matmul_rows
from batchinv.shapes import QWEN3_8B_LINEAR

M_VALUES = (1, 4096)


def _ms(fn) -> float:
    return float(do_bench(fn, warmup=10, rep=50, return_mode="median"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    print(f"GPU: {torch.cuda.get_device_name()}")
    results = []
    for name, k, n in QWEN3_8B_LINEAR:
        w = (torch.randn(n, k, device="cuda") / k**0.5).bfloat16()
        for m in M_VALUES:
            x = torch.randn(m, k, device="cuda").bfloat16()
            times = {
                "cuBLAS": _ms(lambda x=x, w=w: torch.mm(x, w.t())),
                "batchinv": _ms(lambda x=x, w=w: matmul_rows(x, w)),
                "k_groups": _ms(lambda x=x, w=w: matmul_nt_k_groups(x, w)),
            }
            print(
                f"{name:13s} M={m:5d}  cuBLAS {times['cuBLAS'] * 1e3:8.1f} us  "
                f"batchinv {times['cuBLAS'] / times['batchinv']:.2f}x  "
                f"k-groups {times['cuBLAS'] / times['k_groups']:.2f}x "
                f"(k-groups / batchinv time {times['k_groups'] / times['batchinv']:.2f})"
            )
            results.append({"layer": name, "M": m, "N": n, "K": k, "ms": times})
            del x
        del w
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

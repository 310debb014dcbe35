"""batchinv.linear against cuBLAS (torch.mm) at the Qwen3-8B shapes, in the same run.

Goals (issue 4): >= 0.9x cuBLAS at M = 4096, >= 0.8x at M = 64 and M = 1 (M = 16, a
common decode batch, is timed without a goal).  Small M is also
timed as a CUDA-graph replay (both paths), which removes Python launch overhead from both.
The Triton matmul of thinking-machines-lab/batch_invariant_ops is added when importable.
"""

from __future__ import annotations

import torch
from _common import cuda_graph_replay, median_ms, parse_args, report, require_cuda, summary_row

from batchinv.gpu.linear import (
    choose_config,
    choose_small_m_config,
    matmul_rows,
    takes_small_m,
    uses_hopper,
)
from batchinv.shapes import LINEAR_BENCH_M, QWEN3_8B_LINEAR

GOALS = {1: 0.8, 64: 0.8, 4096: 0.9}  # of cuBLAS, by M (issue 4)


def _triton_batch_invariant():
    try:
        from batch_invariant_ops import matmul_persistent  # type: ignore[import-not-found]
    except ImportError:
        print("note: batch_invariant_ops is not importable; its row is skipped")
        return None
    return matmul_persistent


def _config_label(path: str, m: int, n: int, sms: int, device) -> str:
    if path == "batchinv" and uses_hopper(device):
        if takes_small_m(m, n):
            return str(choose_small_m_config(m))
        return f"hopper {choose_config(m, n, sms)}"
    return ""


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    device = require_cuda()
    triton_bi = _triton_batch_invariant()
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    rows, summary = [], []
    for name, k, n in QWEN3_8B_LINEAR:
        weight = (torch.randn(n, k, device=device) / k**0.5).bfloat16()
        weight_t = weight.t()
        for m in LINEAR_BENCH_M:
            x = torch.randn(m, k, device=device).bfloat16()
            flops = 2 * m * n * k
            paths = {
                "cuBLAS": lambda x=x, w=weight_t: torch.mm(x, w),
                "batchinv": lambda x=x, w=weight: matmul_rows(x, w),
            }
            if triton_bi is not None:
                paths["batch_invariant_ops"] = lambda x=x, w=weight_t: triton_bi(x, w)
            timing_modes = [("eager", lambda f: f)]
            if m == 1:
                timing_modes.append(("graph", cuda_graph_replay))
            for mode, wrap in timing_modes:
                times = {path: median_ms(wrap(fn)) for path, fn in paths.items()}
                suffix = "" if mode == "eager" else ", CUDA graph"
                summary.append(
                    summary_row(
                        "linear",
                        f"{name} M={m} (N={n}, K={k}), bf16",
                        "forward" + suffix,
                        times["batchinv"],
                        "cuBLAS (torch.mm)" + suffix,
                        times["cuBLAS"],
                        GOALS.get(m),
                    )
                )
                for path, ms in times.items():
                    rows.append(
                        {
                            "layer": name,
                            "M": m,
                            "N": n,
                            "K": k,
                            "timing": mode,
                            "path": path,
                            "config": _config_label(path, m, n, sms, device),
                            "ms": ms,
                            "TFLOP/s": flops / ms / 1e9,
                            "vs_cuBLAS": times["cuBLAS"] / ms,
                        }
                    )
            del x
        del weight, weight_t
        torch.cuda.empty_cache()
    report(
        "linear (bf16)",
        rows,
        ["layer", "M", "N", "K", "timing", "path", "ms", "TFLOP/s", "vs_cuBLAS", "config"],
        args.json,
        summary,
    )


if __name__ == "__main__":
    main()

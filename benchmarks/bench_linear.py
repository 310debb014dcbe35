"""batchinv.linear on each of its GPU paths against cuBLAS (torch.mm), Qwen3-8B shapes, same run.

``batchinv.linear`` runs one of two paths (``docs/operators/linear.md``): batchinv's own kernels
(every M), or, for bias-free batches of ``MIN_ROWS`` rows or more on sm_90, cuBLASLt with one
pinned algorithm that its self-check found to give the same bits.  Each path is timed on its
own through the public op with ``batchinv.set_linear_path``: "own" at every M, "cublaslt" where
it applies, and every row names what actually ran (``batchinv.gpu.linear.describe``), so a
cuBLASLt measurement is never credited to batchinv's kernels.  ``default_path`` marks the path
that the default setting ("auto") takes for that case.

Goals: >= 0.9x cuBLAS at M = 4096, >= 0.8x at M = 64 and M = 1 (M = 16, a common
decode batch, is timed without a goal).  M = 1 is also timed as a CUDA-graph replay (both
sides), which removes Python launch overhead from both.  The Triton matmul of
thinking-machines-lab/batch_invariant_ops is added to ``rows`` when importable.
"""

from __future__ import annotations

import torch
from _common import cuda_graph_replay, median_ms, parse_args, report, require_cuda, summary_row

import batchinv
from batchinv.gpu.linear import describe, rows_path
from batchinv.gpu.linear_cublaslt import MIN_ROWS
from batchinv.shapes import LINEAR_BENCH_M, QWEN3_8B_LINEAR

GOALS = {1: 0.8, 64: 0.8, 4096: 0.9}  # of cuBLAS, by M
ANCHOR = "cuBLAS (torch.mm)"
# The summary variant of each path; tools/results_table.py expects these names.
VARIANTS = {"own": "forward, own kernels", "cublaslt": "forward, pinned cuBLASLt"}


def _triton_batch_invariant():
    try:
        from batch_invariant_ops import matmul_persistent  # type: ignore[import-not-found]
    except ImportError:
        print("note: batch_invariant_ops is not importable; its row is skipped")
        return None
    return matmul_persistent


def _on_path(path: str, fn):
    """``fn`` run with ``batchinv.set_linear_path(path)`` (the setting restored after)."""

    def run():
        batchinv.set_linear_path(path)
        try:
            return fn()
        finally:
            batchinv.set_linear_path(None)

    return run


def _paths_at(m: int) -> tuple[str, ...]:
    return ("own", "cublaslt") if m >= MIN_ROWS else ("own",)


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    device = require_cuda()
    triton_bi = _triton_batch_invariant()
    rows, summary = [], []
    for name, k, n in QWEN3_8B_LINEAR:
        weight = (torch.randn(n, k, device=device) / k**0.5).bfloat16()
        weight_t = weight.t()
        for m in LINEAR_BENCH_M:
            x = torch.randn(m, k, device=device).bfloat16()
            flops = 2 * m * n * k
            case = f"{name} M={m} (N={n}, K={k}), bf16"
            default = rows_path(m, weight, False, "auto")
            ran = {}
            for path in _paths_at(m):
                try:
                    ran[path] = rows_path(m, weight, False, path)  # raises if refused
                except RuntimeError as error:  # the pinned path refused: reported, not timed
                    print(f"note: {case}: path {path} not measured: {error}")
                    rows.append({"layer": name, "M": m, "N": n, "K": k, "path": path,
                                 "ran": None, "ms": None, "note": str(error)})  # fmt: skip
            timing_modes = [("eager", lambda f: f)]
            if m == 1:
                timing_modes.append(("graph", cuda_graph_replay))
            for mode, wrap in timing_modes:
                suffix = "" if mode == "eager" else ", CUDA graph"
                anchor_ms = median_ms(wrap(lambda x=x, w=weight_t: torch.mm(x, w)))
                measured = {"cuBLAS": (anchor_ms, "cuBLAS (torch.mm)")}
                for path, taken in ran.items():
                    fn = _on_path(path, lambda x=x, w=weight: batchinv.linear(x, w))
                    ms = median_ms(wrap(fn))
                    label = describe(m, n, taken, device)
                    measured[path] = (ms, label)
                    summary.append(
                        summary_row(
                            "linear",
                            case,
                            VARIANTS[path] + suffix,
                            ms,
                            ANCHOR + suffix,
                            anchor_ms,
                            GOALS.get(m),
                            scope="op",
                            ran=label,
                        )
                        | {"default_path": taken == default}
                    )
                if triton_bi is not None:
                    fn = lambda x=x, w=weight_t: triton_bi(x, w)  # noqa: E731
                    measured["batch_invariant_ops"] = (median_ms(wrap(fn)), "Triton persistent")
                for path, (ms, label) in measured.items():
                    rows.append(
                        {
                            "layer": name,
                            "M": m,
                            "N": n,
                            "K": k,
                            "timing": mode,
                            "path": path,
                            "ran": label,
                            "default_path": path == default,
                            "ms": ms,
                            "TFLOP/s": flops / ms / 1e9,
                            "vs_cuBLAS": anchor_ms / ms,
                        }
                    )
            del x
        del weight, weight_t
        torch.cuda.empty_cache()
    report(
        "linear (bf16)",
        rows,
        ["layer", "M", "N", "K", "timing", "path", "ms", "TFLOP/s", "vs_cuBLAS", "ran"],
        args.json,
        summary,
    )


if __name__ == "__main__":
    main()

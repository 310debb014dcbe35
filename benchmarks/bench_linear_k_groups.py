"""batchinv.linear_k_groups (the K-group tree) against cuBLAS and batchinv.linear, Qwen3-8B
shapes, bf16, same run.

The K-group tree is the K order a row-parallel layer reproduces on any number of GPUs
(``docs/operators/linear.md``); this measures what it costs on one: 8 fp32 group partials
written and read back by the tree kernel, against ``batchinv.linear`` (its default path, named
in ``ran``) and cuBLAS (``torch.mm``).  The partials kernels alone are timed too (scope
"kernel": quoted, never counted).  No goal: the cost is reported, not judged.
"""

from __future__ import annotations

import torch
from _common import median_ms, parse_args, report, require_cuda, summary_row

import batchinv
from batchinv.gpu import linear as gpu_linear
from batchinv.shapes import QWEN3_8B_LINEAR

M_VALUES = (1, 64, 4096)
ANCHOR = "cuBLAS (torch.mm)"


def _k_group_label(m: int) -> str:
    config = (
        gpu_linear.K_GROUP_SMALL_M if m <= gpu_linear.SMALL_M_MAX_ROWS else gpu_linear.K_GROUP_TILE
    )
    return f"k-group partials ({config}) + tree"


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    device = require_cuda()
    rows, summary = [], []
    for name, k, n in QWEN3_8B_LINEAR:
        weight = (torch.randn(n, k, device=device) / k**0.5).bfloat16()
        weight_t = weight.t()
        width = batchinv.k_group_width(k)
        for m in M_VALUES:
            x = torch.randn(m, k, device=device).bfloat16()
            case = f"{name} M={m} (N={n}, K={k}), bf16"
            linear_path = gpu_linear.rows_path(m, weight, False)
            measured = {
                "cuBLAS": (median_ms(lambda x=x, w=weight_t: torch.mm(x, w)), ANCHOR),
                "linear": (
                    median_ms(lambda x=x, w=weight: batchinv.linear(x, w)),
                    gpu_linear.describe(m, n, linear_path, device),
                ),
                "k_groups": (
                    median_ms(lambda x=x, w=weight: batchinv.linear_k_groups(x, w)),
                    _k_group_label(m),
                ),
                "k_group_partials": (
                    median_ms(
                        lambda x=x, w=weight: gpu_linear.k_group_partials(
                            x, w, width, gpu_linear.K_GROUPS
                        )
                    ),
                    _k_group_label(m).removesuffix(" + tree"),
                ),
            }
            anchor_ms = measured["cuBLAS"][0]
            linear_ms = measured["linear"][0]
            for variant, (ms, label) in measured.items():
                rows.append(
                    {
                        "layer": name,
                        "M": m,
                        "N": n,
                        "K": k,
                        "variant": variant,
                        "ran": label,
                        "ms": ms,
                        "vs_cuBLAS": anchor_ms / ms,
                        "vs_linear": linear_ms / ms,
                    }
                )
            for variant, scope in (("k_groups", "op"), ("k_group_partials", "kernel")):
                ms, label = measured[variant]
                summary.append(
                    summary_row(
                        "linear_k_groups",
                        case,
                        "forward" if scope == "op" else "partials kernels alone",
                        ms,
                        ANCHOR,
                        anchor_ms,
                        None,
                        scope=scope,
                        ran=label,
                    )
                )
            del x
            torch.cuda.empty_cache()
        del weight, weight_t
        torch.cuda.empty_cache()
    report(
        "linear_k_groups (bf16)",
        rows,
        ["layer", "M", "N", "K", "variant", "ms", "vs_cuBLAS", "vs_linear", "ran"],
        args.json,
        summary,
    )


if __name__ == "__main__":
    main()

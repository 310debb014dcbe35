"""RMSNorm (plain, fused residual add, per-head q/k norm) against a copy of the same bytes.

Goal: >= 0.9 of the copy's bandwidth at 16384 tokens x hidden 4096, bf16.  Rows per
shape: the copy (the anchor, measured in this run), stock ``F.rms_norm``, Liger-Kernel's
``LigerRMSNormFunction`` when importable, and batchinv; forward and backward.  Bandwidth is
counted from the bytes the op must move at least (read x, write y; the backward reads dy and
x and writes dx), so a kernel that reads a tensor twice shows it as a lower ratio.

Shapes of at most ``GRAPH_ROWS_MAX`` rows move a few MB: a kernel takes microseconds and an
eager call measures the host's launch work as much as the GPU.  Their forward and backward
kernels are also timed as CUDA-graph replays (paths marked "(CUDA graph)", ratio to a graphed
copy), which shows the GPU time without Python's launch overhead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _common import (
    copy_ms_for,
    cuda_graph_replay,
    median_ms,
    parse_args,
    report,
    require_cuda,
    summary_row,
)

import batchinv
from batchinv.gpu import rms_norm as gpu_rms_norm

SHAPES = [
    # (rows, hidden, dtype, what)
    (16384, 4096, torch.bfloat16, "hidden norm"),
    (16384, 5120, torch.bfloat16, "hidden norm"),
    (1024, 4096, torch.bfloat16, "hidden norm"),
    (16384 * 32, 128, torch.bfloat16, "q/k norm (32 heads)"),
]
EPS = 1e-6
GOAL = 0.9  # of the copy's bandwidth
GRAPH_ROWS_MAX = 1024  # shapes this small are also timed as CUDA-graph replays
GRAPHED = " (CUDA graph)"


def _liger():
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except Exception as error:  # not installed, or no Triton
        print(f"note: Liger-Kernel rows skipped ({type(error).__name__}: {error})")
        return None
    return LigerRMSNormFunction


def _backward_ms(fn, x, weight, grad):
    x = x.detach().requires_grad_(True)
    w = weight.detach().requires_grad_(True)
    y = fn(x, w)
    return median_ms(lambda: torch.autograd.grad(y, (x, w), grad, retain_graph=True))


def _graphed_timings(x, weight, grad, rstd, liger) -> list[tuple[str, str, int, float]]:
    """The copy, the forward kernels and the backward kernels replayed from CUDA graphs:
    ``(direction, path, tensors moved, ms)`` rows whose paths end in ``GRAPHED``."""
    hidden = x.shape[-1]
    tensor_bytes = x.numel() * x.element_size()
    src = torch.empty(tensor_bytes, dtype=torch.uint8, device=x.device)
    dst = torch.empty_like(src)
    fns = {
        ("-", "copy"): (2, lambda: dst.copy_(src)),
        ("forward", "torch F.rms_norm"): (2, lambda: F.rms_norm(x, (hidden,), weight, EPS)),
        ("forward", "batchinv"): (2, lambda: gpu_rms_norm.forward(x, weight, EPS)),
        ("backward kernel (no autograd)", "batchinv"): (
            3,
            lambda: gpu_rms_norm.backward(grad, x, weight, rstd),
        ),
    }
    if liger is not None:
        fns[("forward", "Liger-Kernel")] = (2, lambda: liger.apply(x, weight, EPS))
    timings = []
    for (direction, path), (tensors, fn) in fns.items():
        try:
            timings.append((direction, path + GRAPHED, tensors, median_ms(cuda_graph_replay(fn))))
        except Exception as error:  # a path that cannot be captured: say so, time the rest
            print(f"note: graph row {path!r} skipped ({type(error).__name__}: {error})")
    return timings


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    device = require_cuda()
    liger = _liger()
    rows_out, summary = [], []
    for rows, hidden, dtype, what in SHAPES:
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(rows, hidden, device=device, generator=gen).to(dtype)
        residual = torch.randn(rows, hidden, device=device, generator=gen).to(dtype)
        weight = torch.randn(hidden, device=device, generator=gen).to(dtype)
        grad = torch.randn(rows, hidden, device=device, generator=gen).to(dtype)
        tensor_bytes = x.numel() * x.element_size()
        copy_src = torch.empty(2 * tensor_bytes, dtype=torch.uint8, device=device)
        copy_dst = torch.empty_like(copy_src)
        one_copy = median_ms(lambda: copy_dst[:tensor_bytes].copy_(copy_src[:tensor_bytes]))
        copy_tbs = 2 * tensor_bytes / one_copy / 1e9
        candidates = {
            "forward": (
                2,
                {
                    "torch F.rms_norm": lambda: F.rms_norm(x, (hidden,), weight, EPS),
                    "batchinv": lambda: batchinv.rms_norm(x, weight, EPS),
                },
            ),
            "fused add forward": (
                4,
                {
                    "torch add + F.rms_norm": lambda: F.rms_norm(
                        x + residual, (hidden,), weight, EPS
                    ),
                    "batchinv": lambda: batchinv.fused_add_rms_norm(x, residual, weight, EPS),
                },
            ),
        }
        if liger is not None:
            candidates["forward"][1]["Liger-Kernel"] = lambda: liger.apply(x, weight, EPS)
        timings = []
        for direction, (tensors, fns) in candidates.items():
            for path, fn in fns.items():
                timings.append((direction, path, tensors, median_ms(fn)))
        backward = {
            "torch F.rms_norm": lambda a, w: F.rms_norm(a, (hidden,), w, EPS),
            "batchinv": lambda a, w: batchinv.rms_norm(a, w, EPS),
        }
        if liger is not None:
            backward["Liger-Kernel"] = lambda a, w: liger.apply(a, w, EPS)
        for path, fn in backward.items():
            try:
                timings.append(("backward", path, 3, _backward_ms(fn, x, weight, grad)))
            except Exception as error:
                print(f"note: backward row {path!r} skipped ({type(error).__name__}: {error})")
        # The kernels alone (the op's backward without the autograd engine): through autograd
        # the host work of one call (about 0.14 ms measured on an H200 host) can
        # exceed the kernels' time, and then the row above measures the host.
        rstd = gpu_rms_norm.forward(x, weight, EPS)[1]
        timings.append(
            (
                "backward kernel (no autograd)",
                "batchinv",
                3,
                median_ms(lambda: gpu_rms_norm.backward(grad, x, weight, rstd)),
            )
        )
        if rows <= GRAPH_ROWS_MAX:
            timings += _graphed_timings(x, weight, grad, rstd, liger)
        rows_out.append(
            {
                "rows": rows,
                "hidden": hidden,
                "dtype": str(dtype).removeprefix("torch."),
                "what": what,
                "direction": "-",
                "path": "copy (anchor)",
                "ms": one_copy,
                "TB/s": copy_tbs,
                "vs_copy": 1.0,
            }
        )
        case = f"{rows}x{hidden}, {str(dtype).removeprefix('torch.')}"
        case += "" if what == "hidden norm" else f" ({what})"
        graph_copy_tbs = next(
            (2 * tensor_bytes / ms / 1e9 for _, path, _, ms in timings if path == "copy" + GRAPHED),
            None,
        )
        for direction, path, tensors, ms in timings:
            anchor_tbs = graph_copy_tbs if path.endswith(GRAPHED) else copy_tbs
            if path == "batchinv":
                anchor_ms = copy_ms_for(one_copy, 2 * tensor_bytes, tensors * tensor_bytes)
                summary.append(
                    summary_row("rms_norm", case, direction, ms, "device copy", anchor_ms, GOAL)
                )
            tbs = tensors * tensor_bytes / ms / 1e9
            rows_out.append(
                {
                    "rows": rows,
                    "hidden": hidden,
                    "dtype": str(dtype).removeprefix("torch."),
                    "what": what,
                    "direction": direction,
                    "path": path,
                    "ms": ms,
                    "TB/s": tbs,
                    "vs_copy": tbs / anchor_tbs,
                }
            )
    report(
        "rms_norm",
        rows_out,
        ["rows", "hidden", "dtype", "what", "direction", "path", "ms", "TB/s", "vs_copy"],
        args.json,
        summary,
    )


if __name__ == "__main__":
    main()

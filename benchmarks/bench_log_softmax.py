"""Log-softmax over a large vocabulary against a copy of the same bytes.

Goal: >= 0.9 of the copy's bandwidth at 4096 rows x vocab 151936, bf16 in, fp32
out.  Rows per shape: the copy (the anchor, measured in this run; it moves as many bytes as
the op must: read x, write out), stock ``torch.log_softmax(x, -1, dtype=float32)`` and
batchinv; forward and backward (reads dy and x, writes dx).  Liger-Kernel has no standalone
log-softmax, so it has no row here.  Tuning rows ("T=1024 ...") rerun batchinv with another
block size for long rows; that changes the reduction tree (other bits), so they are for
choosing ``LARGE_ROW_THREADS``, not a mode to ship.  Where batchinv takes the sm_90a cluster
form, a "one-CTA form" row reruns it with the cluster form off: the same bits, what a card
without clusters (or a misaligned row) runs.  The copy is timed again after each shape's other
rows ("copy (anchor, again after)", its vs_copy = first / second copy time): the ratios use the
first copy, so a device that slows down during a shape shows there (the same fp32 forward on
the same buffers can take about 5% longer in one round than in the one before).
"""

from __future__ import annotations

import torch
from _common import copy_ms_for, median_ms, parse_args, report, require_cuda, summary_row

import batchinv
from batchinv.gpu import log_softmax as gpu_log_softmax

TUNING_THREADS = (1024,)  # compared with gpu_log_softmax.LARGE_ROW_THREADS in the same run
SHAPES = [
    # (rows, vocab, input dtype)
    (4096, 151936, torch.bfloat16),
    (1024, 151936, torch.bfloat16),
    (4096, 151936, torch.float32),
    (4096, 32000, torch.bfloat16),
]
GOAL = 0.9  # of the copy's bandwidth


def _backward_ms(fn, x, grad):
    x = x.detach().requires_grad_(True)
    out = fn(x)
    return median_ms(lambda: torch.autograd.grad(out, (x,), grad, retain_graph=True))


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    device = require_cuda()
    print("note: Liger-Kernel has no standalone log-softmax; no Liger row")
    rows_out, summary = [], []
    for rows, vocab, dtype in SHAPES:
        gen = torch.Generator(device=device).manual_seed(0)
        x = (4 * torch.randn(rows, vocab, device=device, generator=gen)).to(dtype)
        grad = torch.randn(rows, vocab, device=device, generator=gen)
        in_bytes = x.numel() * x.element_size()
        out_bytes = x.numel() * 4
        forward_bytes = in_bytes + out_bytes
        backward_bytes = out_bytes + 2 * in_bytes  # read dy (fp32) and x, write dx
        src = torch.empty(forward_bytes // 2, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        copy_ms = median_ms(lambda: dst.copy_(src))
        copy_tbs = 2 * src.numel() / copy_ms / 1e9
        stock = lambda a: torch.log_softmax(a, -1, dtype=torch.float32)  # noqa: E731
        timings = [
            ("forward", "torch log_softmax", forward_bytes, median_ms(lambda: stock(x))),
            ("forward", "batchinv", forward_bytes, median_ms(lambda: batchinv.log_softmax(x))),
            ("backward", "torch log_softmax", backward_bytes, _backward_ms(stock, x, grad)),
            ("backward", "batchinv", backward_bytes, _backward_ms(batchinv.log_softmax, x, grad)),
        ]
        paths = (gpu_log_softmax.forward_path(x), gpu_log_softmax.backward_path(x))
        if any(path.startswith("cluster") for path in paths):
            gpu_log_softmax.USE_CLUSTER = False
            try:
                path = "batchinv one-CTA form (same bits)"
                fwd = median_ms(lambda: batchinv.log_softmax(x))
                bwd = _backward_ms(batchinv.log_softmax, x, grad)
            finally:
                gpu_log_softmax.USE_CLUSTER = True
            timings += [
                ("forward", path, forward_bytes, fwd),
                ("backward", path, backward_bytes, bwd),
            ]
        default_threads = gpu_log_softmax.LARGE_ROW_THREADS
        for threads in TUNING_THREADS:
            if gpu_log_softmax.threads_for(vocab, dtype) != default_threads:
                continue  # a short row or the Hopper form: the tuning knob does not apply
            gpu_log_softmax.LARGE_ROW_THREADS = threads
            try:
                path = f"batchinv T={threads} (tuning, other bits)"
                fwd = median_ms(lambda: batchinv.log_softmax(x))
                bwd = _backward_ms(batchinv.log_softmax, x, grad)
            finally:
                gpu_log_softmax.LARGE_ROW_THREADS = default_threads
            timings += [
                ("forward", path, forward_bytes, fwd),
                ("backward", path, backward_bytes, bwd),
            ]
        copy_again_ms = median_ms(lambda: dst.copy_(src))
        base = {
            "rows": rows,
            "vocab": vocab,
            "dtype": f"{str(dtype).removeprefix('torch.')}->float32",
        }
        rows_out.append(
            {
                **base,
                "direction": "-",
                "path": "copy (anchor)",
                "ms": copy_ms,
                "TB/s": copy_tbs,
                "vs_copy": 1.0,
            }
        )
        rows_out.append(
            {
                **base,
                "direction": "-",
                "path": "copy (anchor, again after)",
                "ms": copy_again_ms,
                "TB/s": 2 * src.numel() / copy_again_ms / 1e9,
                "vs_copy": copy_ms / copy_again_ms,
            }
        )
        case = f"{rows}x{vocab}, {base['dtype']}"
        for direction, path, moved, ms in timings:
            if path == "batchinv":
                anchor_ms = copy_ms_for(copy_ms, 2 * src.numel(), moved)
                summary.append(
                    summary_row("log_softmax", case, direction, ms, "device copy", anchor_ms, GOAL)
                )
            tbs = moved / ms / 1e9
            rows_out.append(
                {
                    **base,
                    "direction": direction,
                    "path": path,
                    "ms": ms,
                    "TB/s": tbs,
                    "vs_copy": tbs / copy_tbs,
                }
            )
    report(
        "log_softmax",
        rows_out,
        ["rows", "vocab", "dtype", "direction", "path", "ms", "TB/s", "vs_copy"],
        args.json,
        summary,
    )


if __name__ == "__main__":
    main()

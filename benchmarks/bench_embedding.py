"""Embedding gather bandwidth against a device-to-device copy of the same bytes.

Goal: >= 0.85 of the copy's bandwidth at vocab 151936, hidden 4096, 16384 tokens.
Rows: the copy (the anchor), stock ``F.embedding``, batchinv's kernel alone, and the
whole op, which also reads the bad-id flag back (one synchronisation per call).  The backward
rows (no goal): ``torch.autograd.grad`` of an output recorded once, for ``F.embedding`` and
batchinv, and batchinv's backward alone (``gpu.embedding.backward``: the difference is the
autograd engine's and the op's host time).  batchinv's backward rows come twice: with the
default sync-free segments (static sizes, the strided kernel) and with the segments of
``torch.unique_consecutive`` (one synchronisation per call, one CTA per distinct id); the
gradients are the same bits.  Their bytes are the forward's (read a gradient row, write a
table row per token); the zero fill of the ``[vocab, hidden]`` gradient, which all do, is not
counted.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _common import copy_ms_for, median_ms, parse_args, report, require_cuda, summary_row

import batchinv
from batchinv.gpu import embedding as gpu_embedding
from batchinv.gpu.embedding import launch_forward

SHAPES = [
    # (vocab, hidden, tokens, dtype)
    (151936, 4096, 16384, torch.bfloat16),
    (151936, 4096, 1024, torch.bfloat16),
    (151936, 5120, 16384, torch.bfloat16),
    (32000, 4096, 16384, torch.float32),
]
GOAL = 0.85  # of the copy's bandwidth
SUMMARY_PATHS = {"batchinv kernel": "kernel", "batchinv op (+id check)": "op (+id check)"}
BACKWARD_KERNEL_PATHS = {
    "static": "backward batchinv kernel (no autograd)",
    "unique": "backward batchinv kernel, unique segments (no autograd)",
}


def _with_segments(segments: str, call):
    """``call()`` with the registry's backward finding its segments by ``segments``."""
    default = gpu_embedding.BACKWARD_SEGMENTS
    gpu_embedding.BACKWARD_SEGMENTS = segments
    try:
        return call()
    finally:
        gpu_embedding.BACKWARD_SEGMENTS = default


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    device = require_cuda()
    rows, summary = [], []
    for vocab, hidden, tokens, dtype in SHAPES:
        gen = torch.Generator(device=device).manual_seed(0)
        weight = torch.randn(vocab, hidden, device=device, generator=gen).to(dtype)
        ids = torch.randint(0, vocab, (tokens,), device=device, generator=gen)
        source = torch.randn(tokens, hidden, device=device, generator=gen).to(dtype)
        target = torch.empty_like(source)
        row_bytes = hidden * weight.element_size()
        moved = 2 * tokens * row_bytes + ids.numel() * ids.element_size()
        paths = {
            "copy": lambda s=source, t=target: t.copy_(s),
            "torch F.embedding": lambda i=ids, w=weight: F.embedding(i, w),
            "batchinv kernel": lambda i=ids, w=weight: launch_forward(i, w),
            "batchinv op (+id check)": lambda i=ids, w=weight: batchinv.embedding(i, w),
        }
        timings = {path: median_ms(fn) for path, fn in paths.items()}
        grad = torch.randn(tokens, hidden, device=device, generator=gen).to(dtype)
        leaf = weight.detach().requires_grad_()
        outputs = {
            "backward torch F.embedding": F.embedding(ids, leaf),
            "backward batchinv (autograd)": batchinv.embedding(ids, leaf, check_ids=False),
        }
        for path, out in outputs.items():
            timings[path] = median_ms(
                lambda o=out, w=leaf: torch.autograd.grad(o, w, grad, retain_graph=True)
            )
        unique_out = outputs["backward batchinv (autograd)"]
        timings["backward batchinv (autograd, unique segments)"] = median_ms(
            lambda o=unique_out, w=leaf: _with_segments(
                "unique", lambda: torch.autograd.grad(o, w, grad, retain_graph=True)
            )
        )
        for segments, path in BACKWARD_KERNEL_PATHS.items():
            timings[path] = median_ms(
                lambda s=segments: gpu_embedding.backward(ids, grad, vocab, dtype, segments=s)
            )
        copy_tbs = 2 * tokens * row_bytes / timings["copy"] / 1e9  # bytes per ms / 1e9 = TB/s
        case = f"{vocab}x{hidden}, {tokens} tokens, {str(dtype).removeprefix('torch.')}"
        for path, variant in SUMMARY_PATHS.items():
            anchor_ms = copy_ms_for(timings["copy"], 2 * tokens * row_bytes, moved)
            summary.append(
                summary_row(
                    "embedding", case, variant, timings[path], "device copy", anchor_ms, GOAL
                )
            )
        for path, ms in timings.items():
            bytes_moved = 2 * tokens * row_bytes if path == "copy" else moved
            tbs = bytes_moved / ms / 1e9
            rows.append(
                {
                    "vocab": vocab,
                    "hidden": hidden,
                    "tokens": tokens,
                    "dtype": str(dtype).removeprefix("torch."),
                    "path": path,
                    "ms": ms,
                    "TB/s": tbs,
                    "vs_copy": tbs / copy_tbs,
                }
            )
    report(
        "embedding",
        rows,
        ["vocab", "hidden", "tokens", "dtype", "path", "ms", "TB/s", "vs_copy"],
        args.json,
        summary,
    )


if __name__ == "__main__":
    main()

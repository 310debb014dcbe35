"""SiLU-mul (SwiGLU) against a copy of the same bytes.

Goal: >= 0.9 of the copy's bandwidth.  Rows per shape: the copy (the anchor,
measured in this run), stock ``F.silu(g) * u``, Liger-Kernel's ``LigerSiLUMulFunction`` when
importable, batchinv on two tensors and on the fused ``[.., 2I]`` layout; forward and
backward, the backward through autograd and its kernel alone (``gpu.silu_mul.backward``: the
difference is the autograd engine's and the op's host time per call).  Bytes: forward reads
gate and up and writes out (3 tensors); backward reads dy, gate, up and writes two grads (5).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _common import copy_ms_for, median_ms, parse_args, report, require_cuda, summary_row

import batchinv
from batchinv.gpu import silu_mul as gpu_silu_mul

SHAPES = [
    # (tokens, intermediate, dtype)
    (16384, 4096, torch.bfloat16),
    (16384, 12288, torch.bfloat16),
    (1024, 12288, torch.bfloat16),
]
GOAL = 0.9  # of the copy's bandwidth


def _liger():
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except Exception as error:
        print(f"note: Liger-Kernel rows skipped ({type(error).__name__}: {error})")
        return None
    return LigerSiLUMulFunction


def _backward_ms(fn, inputs, grad):
    leaves = [t.detach().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    return median_ms(lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True))


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    device = require_cuda()
    liger = _liger()
    rows_out, summary = [], []
    for tokens, inter, dtype in SHAPES:
        gen = torch.Generator(device=device).manual_seed(0)
        gate_up = torch.randn(tokens, 2 * inter, device=device, generator=gen).to(dtype)
        gate, up = gate_up[:, :inter].contiguous(), gate_up[:, inter:].contiguous()
        grad = torch.randn(tokens, inter, device=device, generator=gen).to(dtype)
        tensor_bytes = gate.numel() * gate.element_size()
        src = torch.empty(tensor_bytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        copy_ms = median_ms(lambda: dst.copy_(src))
        copy_tbs = 2 * tensor_bytes / copy_ms / 1e9
        timings = [
            ("forward", "torch F.silu(g) * u", 3, median_ms(lambda: F.silu(gate) * up)),
            ("forward", "batchinv silu_mul", 3, median_ms(lambda: batchinv.silu_mul(gate, up))),
            (
                "forward",
                "batchinv silu_mul_fused",
                3,
                median_ms(lambda: batchinv.silu_mul_fused(gate_up)),
            ),
            (
                "backward",
                "torch F.silu(g) * u",
                5,
                _backward_ms(lambda g, u: F.silu(g) * u, (gate, up), grad),
            ),
            ("backward", "batchinv silu_mul", 5, _backward_ms(batchinv.silu_mul, (gate, up), grad)),
            (
                "backward",
                "batchinv silu_mul_fused",
                5,
                _backward_ms(batchinv.silu_mul_fused, (gate_up,), grad),
            ),
            (
                "backward kernel (no autograd)",
                "batchinv silu_mul",
                5,
                median_ms(lambda: gpu_silu_mul.backward(grad, gate, up)),
            ),
            (
                "backward kernel (no autograd)",
                "batchinv silu_mul_fused",
                5,
                median_ms(lambda: gpu_silu_mul.backward_fused(grad, gate_up)),
            ),
        ]
        if liger is not None:
            try:
                timings.append(
                    ("forward", "Liger-Kernel", 3, median_ms(lambda: liger.apply(gate, up)))
                )
                # Liger's backward writes its gradients into its inputs' storage: give it copies.
                liger_inputs = (gate.clone(), up.clone())
                timings.append(
                    ("backward", "Liger-Kernel", 5, _backward_ms(liger.apply, liger_inputs, grad))
                )
            except Exception as error:
                print(f"note: Liger-Kernel row failed ({type(error).__name__}: {error})")
        base = {"tokens": tokens, "intermediate": inter, "dtype": str(dtype).removeprefix("torch.")}
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
        case = f"{tokens}x{inter}, {base['dtype']}"
        for direction, path, tensors, ms in timings:
            if path.startswith("batchinv"):
                variant = direction + (" (fused [.., 2I] input)" if "fused" in path else "")
                anchor_ms = copy_ms_for(copy_ms, 2 * tensor_bytes, tensors * tensor_bytes)
                summary.append(
                    summary_row("silu_mul", case, variant, ms, "device copy", anchor_ms, GOAL)
                )
            tbs = tensors * tensor_bytes / ms / 1e9
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
        "silu_mul",
        rows_out,
        ["tokens", "intermediate", "dtype", "direction", "path", "ms", "TB/s", "vs_copy"],
        args.json,
        summary,
    )


if __name__ == "__main__":
    main()

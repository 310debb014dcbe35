"""RoPE on q and k against a copy of the same bytes.

Goal: >= 0.9 of the copy's bandwidth.  Rows per shape: the copy (the anchor,
measured in this run), stock HF-style ``q * cos + rotate_half(q) * sin`` with cos/sin tables
gathered by position, Liger-Kernel's ``LigerRopeFunction`` when importable (its own
``[B, H, S, d]`` layout), batchinv with ``check_positions=False`` (the kernel alone) and the
checked op (one flag read, a synchronisation, per call); forward and backward (through autograd,
and the backward kernel alone).  Bytes: read q and k, write their rotations.
"""

from __future__ import annotations

import torch
from _common import copy_ms_for, median_ms, parse_args, report, require_cuda, summary_row

import batchinv
from batchinv.gpu import rope as gpu_rope

SHAPES = [
    # (tokens, query heads, kv heads, head_dim, dtype)
    (16384, 32, 8, 128, torch.bfloat16),
    (1024, 32, 8, 128, torch.bfloat16),
    (16384, 64, 4, 128, torch.bfloat16),
]
THETA = 1_000_000.0
MAX_POSITION = 40960
GOAL = 0.9  # of the copy's bandwidth


def _liger():
    try:
        from liger_kernel.ops.rope import LigerRopeFunction
    except Exception as error:
        print(f"note: Liger-Kernel rows skipped ({type(error).__name__}: {error})")
        return None
    return LigerRopeFunction


def _tables(head_dim, dtype, device):
    inv_freq = 1.0 / (
        THETA ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    )
    angles = torch.arange(MAX_POSITION, device=device, dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _hf_rope(q, k, cos_table, sin_table, positions):
    cos, sin = cos_table[positions].unsqueeze(1), sin_table[positions].unsqueeze(1)
    half = q.shape[-1] // 2

    def rotate_half(x):
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _backward_ms(fn, q, k, grads):
    q, k = q.detach().requires_grad_(True), k.detach().requires_grad_(True)
    out = fn(q, k)
    return median_ms(lambda: torch.autograd.grad(out, (q, k), grads, retain_graph=True))


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    device = require_cuda()
    liger = _liger()
    rows_out, summary = [], []
    for tokens, hq, hk, head_dim, dtype in SHAPES:
        gen = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(tokens, hq, head_dim, device=device, generator=gen).to(dtype)
        k = torch.randn(tokens, hk, head_dim, device=device, generator=gen).to(dtype)
        positions = torch.randint(0, MAX_POSITION, (tokens,), device=device, generator=gen)
        grads = (torch.randn_like(q), torch.randn_like(k))
        cos_table, sin_table = _tables(head_dim, dtype, device)
        moved = (q.numel() + k.numel()) * q.element_size()
        src = torch.empty(moved, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        copy_ms = median_ms(lambda: dst.copy_(src))
        copy_tbs = 2 * moved / copy_ms / 1e9

        def ours(a, b, check=False):
            return batchinv.rope(
                a, b, positions, theta=THETA, max_position=MAX_POSITION, check_positions=check
            )

        timings = [
            (
                "forward",
                "torch HF-style",
                median_ms(lambda: _hf_rope(q, k, cos_table, sin_table, positions)),
            ),
            ("forward", "batchinv kernel (no check)", median_ms(lambda: ours(q, k))),
            ("forward", "batchinv op (+position check)", median_ms(lambda: ours(q, k, True))),
            (
                "backward",
                "torch HF-style",
                _backward_ms(
                    lambda a, b: _hf_rope(a, b, cos_table, sin_table, positions), q, k, grads
                ),
            ),
            ("backward", "batchinv", _backward_ms(ours, q, k, grads)),
            # The same inverse-rotation kernel without the autograd engine, whose host time per
            # call (about 0.12 ms measured on an H200 host) can exceed the kernel's.
            (
                "backward",
                "batchinv kernel (no autograd)",
                median_ms(
                    lambda: gpu_rope.backward(grads[0], grads[1], positions, THETA, MAX_POSITION)
                ),
            ),
        ]
        if liger is not None:
            try:
                # Liger's layout: q [1, H, S, d], cos/sin [1, S, d] gathered by position.
                ql, kl = (
                    q.transpose(0, 1).unsqueeze(0).contiguous(),
                    k.transpose(0, 1).unsqueeze(0).contiguous(),
                )
                cos, sin = cos_table[positions].unsqueeze(0), sin_table[positions].unsqueeze(0)
                timings.append(
                    ("forward", "Liger-Kernel", median_ms(lambda: liger.apply(ql, kl, cos, sin)))
                )
                grads_l = (torch.randn_like(ql), torch.randn_like(kl))
                timings.append(
                    (
                        "backward",
                        "Liger-Kernel",
                        _backward_ms(lambda a, b: liger.apply(a, b, cos, sin), ql, kl, grads_l),
                    )
                )
            except Exception as error:
                print(f"note: Liger-Kernel row failed ({type(error).__name__}: {error})")
        base = {
            "tokens": tokens,
            "heads": f"{hq}/{hk}",
            "head_dim": head_dim,
            "dtype": str(dtype).removeprefix("torch."),
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
        case = f"{tokens} tokens, {hq}/{hk} heads x {head_dim}, {base['dtype']}"
        for direction, path, ms in timings:
            if path.startswith("batchinv"):
                variant = direction + path.removeprefix("batchinv")
                anchor_ms = copy_ms_for(copy_ms, 2 * moved, 2 * moved)
                summary.append(
                    summary_row("rope", case, variant, ms, "device copy", anchor_ms, GOAL)
                )
            tbs = 2 * moved / ms / 1e9
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
        "rope",
        rows_out,
        ["tokens", "heads", "head_dim", "dtype", "direction", "path", "ms", "TB/s", "vs_copy"],
        args.json,
        summary,
    )


if __name__ == "__main__":
    main()

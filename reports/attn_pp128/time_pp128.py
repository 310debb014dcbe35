"""attn-pp128 device call: the ping-pong variant of the 128-key Hopper kernel (this branch's
default) against the current kernel (main's file built as a temporary extra module,
``hopper_old.py`` + ``kernels_cu/attention_hopper_old.cu``, see README.md) and SDPA's default
backend, interleaved, the order rotated each round; GQA 32/8, d = 128, bf16, causal,
``do_bench`` medians.  Also checks that both kernels give the same bits at each shape."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, "benchmarks")
sys.path.insert(0, str(Path(__file__).parent))
import hopper_old  # noqa: E402
from _common import median_ms  # noqa: E402

from batchinv.contract import assert_bitwise_equal  # noqa: E402
from batchinv.gpu import attention as gpu  # noqa: E402

HQ, HKV, D = 32, 8, 128
SHAPES = [(8, 4096, 8), (32, 2048, 4)]  # (batch, seq, rounds)


def run_with(module, q, k, v):
    """``gpu.attention`` (causal) with its Hopper launcher swapped for ``module`` (None: as is)."""
    if module is None:
        return gpu.attention(q, k, v, causal=True, return_lse=True)
    saved = gpu.attention_hopper
    gpu.attention_hopper = module
    try:
        return gpu.attention(q, k, v, causal=True, return_lse=True)
    finally:
        gpu.attention_hopper = saved


def time_shape(batch: int, seq: int, rounds: int) -> list[dict]:
    q = torch.randn(batch, seq, HQ, D, device="cuda").bfloat16()
    k = torch.randn(batch, seq, HKV, D, device="cuda").bfloat16()
    v = torch.randn(batch, seq, HKV, D, device="cuda").bfloat16()
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    paths = {
        "sdpa": lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True),
        "cur": lambda: run_with(hopper_old, q, k, v),
        "pp": lambda: run_with(None, q, k, v),
    }
    assert_bitwise_equal(paths["pp"](), paths["cur"](), name=f"ping-pong vs current {batch}x{seq}")
    print(f"{batch}x{seq}: ping-pong and current kernel bitwise equal (out, lse)")
    names = list(paths)
    rows = []
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        if r % 2:
            order = order[::-1]
        times = {name: median_ms(paths[name], warmup_ms=50, rep_ms=300) for name in order}
        rows.append({"batch": batch, "seq": seq, "round": r + 1, "order": order} | times)
        print(
            f"{batch}x{seq} round {r + 1} ({','.join(order)}) "
            + " ".join(f"{n}={times[n]:.4f}" for n in names)
            + f" | cur {times['sdpa'] / times['cur']:.3f}x SDPA,"
            + f" pp {times['sdpa'] / times['pp']:.3f}x SDPA,"
            + f" pp/cur {times['pp'] / times['cur'] - 1:+.2%}"
        )
    return rows


def main() -> None:
    print(torch.cuda.get_device_name())
    rows = []
    for batch, seq, rounds in SHAPES:
        rows += time_shape(batch, seq, rounds)
        torch.cuda.empty_cache()
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

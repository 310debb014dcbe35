"""attn-kv128-hopper device call: the 128-key Hopper kernel (this branch) against main's 64-key
kernel (built from main's file as a temporary extra module, ``hopper_old.py`` +
``kernels_cu/attention_hopper_old.cu``, not committed) and SDPA's default backend, interleaved
with the order rotated each round; GQA 32/8, d = 128, bf16, ``do_bench`` medians.  Without the
temporary module only SDPA and this branch are timed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, "benchmarks")
sys.path.insert(0, str(Path(__file__).parent))
from _common import median_ms  # noqa: E402

from batchinv.contract import assert_bitwise_equal  # noqa: E402
from batchinv.gpu import attention as gpu  # noqa: E402

try:
    import hopper_old  # noqa: E402
except ImportError:
    hopper_old = None
try:  # the same kernel with Q read by descriptor (kQInRegisters = false), temporary too
    import hopper_ss  # noqa: E402
except ImportError:
    hopper_ss = None

HQ, HKV, D = 32, 8, 128
SHAPES = [(8, 4096, True, 3), (32, 2048, True, 2), (128, 1024, True, 2)]


def run_with(module, q, k, v, causal):
    """``gpu.attention`` with its Hopper launcher swapped for ``module`` (None: unchanged)."""
    if module is None:
        return gpu.attention(q, k, v, causal=causal, return_lse=True)
    saved = gpu.attention_hopper
    gpu.attention_hopper = module
    try:
        return gpu.attention(q, k, v, causal=causal, return_lse=True)
    finally:
        gpu.attention_hopper = saved


def time_shape(batch: int, seq: int, causal: bool, rounds: int) -> list[dict]:
    q = torch.randn(batch, seq, HQ, D, device="cuda").bfloat16()
    k = torch.randn(batch, seq, HKV, D, device="cuda").bfloat16()
    v = torch.randn(batch, seq, HKV, D, device="cuda").bfloat16()
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    paths = {
        "sdpa": lambda: F.scaled_dot_product_attention(
            qt, kt, vt, is_causal=causal, enable_gqa=True
        ),
        "kv128": lambda: run_with(None, q, k, v, causal),
    }
    if hopper_old is not None:
        paths["main64"] = lambda: run_with(hopper_old, q, k, v, causal)
        new, old = paths["kv128"](), paths["main64"]()
        diff = (new[0].float() - old[0].float()).abs()
        print(
            f"{batch}x{seq}: 128-key vs 64-key kernel: out max |diff| {diff.max().item():.3e}, "
            f"{(diff > 0).float().mean().item():.2%} of elements differ"
        )
    if hopper_ss is not None:
        paths["ss128"] = lambda: run_with(hopper_ss, q, k, v, causal)
        assert_bitwise_equal(paths["ss128"](), paths["kv128"](), name="Q by descriptor")
    names = list(paths)
    rows = []
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        times = {name: median_ms(paths[name], warmup_ms=50, rep_ms=300) for name in order}
        row = {"batch": batch, "seq": seq, "causal": causal, "round": r + 1, "order": order}
        rows.append(row | times)
        line = " ".join(f"{n}={times[n]:.3f}" for n in names)
        ratios = f" | kv128 {times['sdpa'] / times['kv128']:.3f}x SDPA"
        if "ss128" in times:
            ratios += f", ss128/kv128 {times['ss128'] / times['kv128'] - 1:+.1%}"
        if "main64" in times:
            ratios += f", main64 {times['sdpa'] / times['main64']:.3f}x SDPA"
            ratios += f", kv128/main64 {times['kv128'] / times['main64'] - 1:+.1%}"
        print(f"{batch}x{seq} causal={causal} round {r + 1} ({','.join(order)}) {line}{ratios}")
    return rows


def main() -> None:
    print(torch.cuda.get_device_name(), "| main's kernel timed:", hopper_old is not None)
    rows = []
    for batch, seq, causal, rounds in SHAPES:
        rows += time_shape(batch, seq, causal, rounds)
        torch.cuda.empty_cache()
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

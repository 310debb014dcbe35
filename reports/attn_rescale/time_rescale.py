"""attn-rescale device call: the Hopper kernel with the rescale skip (the branch's default at
the call, commit ``1a7aaea``; ``skip``) against main's kernel (``main``: main's file built as a
temporary extra module, ``hopper_main.py`` + ``kernels_cu/attention_hopper_main.cu``, see
README.md) and SDPA's default backend, in interleaved rounds (the order rotated each round and
reversed every other round), ``do_bench`` medians; GQA 32/8, d = 128, bf16.

First, bits: ``skip`` against ``main`` (out, lse) at every timed shape, and on data where every
steady block skips (all keys equal: the row max never grows after a split's first block) with
NaN and +-inf in V (NaN accumulators in skipped blocks), against ``main`` and the forced
mma.sync tile kernel.  Last, the ceiling: the timing on that all-skip data."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, "benchmarks")
sys.path.insert(0, str(Path(__file__).parent))
import hopper_main  # noqa: E402
from _common import median_ms  # noqa: E402

from batchinv.contract import assert_bitwise_equal  # noqa: E402
from batchinv.gpu import attention as gpu  # noqa: E402

HQ, HKV, D = 32, 8, 128
# (batch, seq, causal, all keys equal, rounds)
SHAPES = [
    (8, 4096, True, False, 6),
    (32, 2048, True, False, 3),
    (8, 4096, False, False, 3),
    (8, 4096, True, True, 2),
]


def run_with(module, q, k, v, causal, **tuning):
    """``gpu.attention`` with its Hopper launcher swapped for ``module`` (None: unchanged)."""
    if module is None:
        return gpu.attention(q, k, v, causal=causal, return_lse=True, **tuning)
    saved = gpu.attention_hopper
    gpu.attention_hopper = module
    try:
        return gpu.attention(q, k, v, causal=causal, return_lse=True, **tuning)
    finally:
        gpu.attention_hopper = saved


def inputs(batch: int, seq: int, equal_keys: bool, special_v: bool = False):
    gen = torch.Generator(device="cuda").manual_seed(batch * seq)
    q = torch.randn(batch, seq, HQ, D, device="cuda", generator=gen).bfloat16()
    k = torch.randn(batch, seq, HKV, D, device="cuda", generator=gen).bfloat16()
    v = torch.randn(batch, seq, HKV, D, device="cuda", generator=gen).bfloat16()
    if equal_keys:  # every score of a row equal: alpha = 1 after a split's first block
        k = k[:, :1].expand(-1, seq, -1, -1).contiguous()
    if special_v:
        v[:, 5, 0, :] = float("nan")  # every row that sees key 5: NaN accumulators
        v[:, :, 1, 3] = float("inf")  # 0 * inf = NaN at masked keys of a block
        v[:, 0::2, 2, 4] = float("inf")
        v[:, 1::2, 2, 4] = -float("inf")  # inf - inf = NaN
        v[:, :, 3, 7] = -float("inf")
    return q, k, v


def check_all_skip() -> None:
    """Bits where every steady block skips, NaN / inf accumulators included."""
    for causal in (True, False):
        q, k, v = inputs(2, 3000, equal_keys=True, special_v=True)
        skip = run_with(None, q, k, v, causal)
        assert_bitwise_equal(skip, run_with(hopper_main, q, k, v, causal), name="skip vs main")
        mma = run_with(None, q, k, v, causal, mode="tile", warps=4, hopper=False)
        assert_bitwise_equal(skip, mma, name="skip vs mma.sync tile")
        nan_share = skip[0].float().isnan().float().mean().item()
        print(
            f"all-skip data, 2 x 3000, causal={causal}: skip == main == mma.sync tile "
            f"bitwise (out, lse); {nan_share:.1%} of the outputs NaN"
        )


def time_shape(batch, seq, causal, equal_keys, rounds) -> list[dict]:
    q, k, v = inputs(batch, seq, equal_keys)
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    label = f"{batch}x{seq} causal={causal}" + (" all-keys-equal" if equal_keys else "")
    assert_bitwise_equal(
        run_with(None, q, k, v, causal), run_with(hopper_main, q, k, v, causal), name=label
    )
    print(f"{label}: skip and main bitwise equal (out, lse)")
    paths = {
        "sdpa": lambda: F.scaled_dot_product_attention(
            qt, kt, vt, is_causal=causal, enable_gqa=True
        ),
        "main": lambda: run_with(hopper_main, q, k, v, causal),
        "skip": lambda: run_with(None, q, k, v, causal),
    }
    names = list(paths)
    rows = []
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        if r % 2:
            order = order[::-1]
        times = {name: median_ms(paths[name], warmup_ms=50, rep_ms=300) for name in order}
        rows.append({"shape": label, "round": r + 1, "order": order} | times)
        print(
            f"{label} round {r + 1} ({','.join(order)}) "
            + " ".join(f"{n}={times[n]:.4f}" for n in names)
            + f" | main {times['sdpa'] / times['main']:.3f}x SDPA,"
            + f" skip {times['sdpa'] / times['skip']:.3f}x SDPA,"
            + f" skip/main {times['skip'] / times['main'] - 1:+.2%}"
        )
    return rows


def main() -> None:
    print(torch.cuda.get_device_name())
    check_all_skip()
    rows = []
    for shape in SHAPES:
        rows += time_shape(*shape)
        torch.cuda.empty_cache()
        if len(sys.argv) > 1:
            Path(sys.argv[1]).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

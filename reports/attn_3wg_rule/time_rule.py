"""attn-3wg-rule device call: the attention op with the shape rule (``WG3_MAX_LEN``) against
forced 2 and 3 consumer warpgroups and SDPA's default backend, interleaved (the order rotated
each round), GQA 32/8, d = 128, bf16; out and lse of both kernels bitwise equal at each shape."""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, "benchmarks")
from _common import median_ms  # noqa: E402

from batchinv.contract import assert_bitwise_equal  # noqa: E402
from batchinv.gpu import attention as gpu  # noqa: E402
from batchinv.gpu import attention_hopper as hopper  # noqa: E402

HQ, HKV, D = 32, 8, 128
SHAPES = [(8, 4096, True), (32, 2048, True), (128, 1024, True), (64, 1024, False), (64, 512, True)]
ROUNDS = 3


def time_shape(batch: int, seq: int, causal: bool) -> list[dict]:
    q = torch.randn(batch, seq, HQ, D, device="cuda").bfloat16()
    k = torch.randn(batch, seq, HKV, D, device="cuda").bfloat16()
    v = torch.randn(batch, seq, HKV, D, device="cuda").bfloat16()
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))

    def op(count=None):
        if count is None:
            return gpu.attention(q, k, v, causal=causal, return_lse=True)
        with hopper.forced_warpgroups(count):
            return gpu.attention(q, k, v, causal=causal, return_lse=True)

    assert_bitwise_equal(op(3), op(2), name=f"{batch}x{seq}: 3 vs 2 warpgroups")
    rule = hopper.warpgroups_for(seq, seq)
    paths = {
        "sdpa": lambda: F.scaled_dot_product_attention(
            qt, kt, vt, is_causal=causal, enable_gqa=True
        ),
        "rule": op,
        "wg2": lambda: op(2),
        "wg3": lambda: op(3),
    }
    names = list(paths)
    rows = []
    for r in range(ROUNDS):
        order = names[r:] + names[:r]
        times = {name: median_ms(paths[name], warmup_ms=50, rep_ms=300) for name in order}
        rows.append(
            {"batch": batch, "seq": seq, "causal": causal, "round": r + 1, "order": order}
            | {"rule_warpgroups": rule, **times}
        )
        print(
            f"{batch}x{seq} {'causal' if causal else 'non-causal'} round {r + 1} "
            f"(rule: {rule} WG) "
            + " ".join(f"{n}={times[n]:.3f}" for n in names)
            + f" | rule/wg2 {times['rule'] / times['wg2'] - 1:+.1%}"
            + f" wg3/wg2 {times['wg3'] / times['wg2'] - 1:+.1%}"
            + f" sdpa/rule {times['sdpa'] / times['rule']:.3f}x",
            flush=True,
        )
    return rows


def main() -> None:
    torch.manual_seed(0)
    card = torch.cuda.get_device_name()
    print(card)
    results = []
    for batch, seq, causal in SHAPES:
        results += time_shape(batch, seq, causal)
        torch.cuda.empty_cache()
    with open(sys.argv[1], "w") as f:
        json.dump({"card": card, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

"""The Qwen3 model end to end: batchinv against stock PyTorch, Qwen3-8B shapes, random weights.

Goal: batchinv <= 1.10x the stock time.  One model (Qwen3-8B layer shapes:
hidden 4096, intermediate 12288, 32 query / 8 KV heads of 128, vocab 151936; ``--layers N``
layers, random bf16 weights) runs with both op tables in the same process:

- prefill: ``--prefill-batch`` x ``--prefill-len`` tokens (8 x 4096) through the layers;
- decode: one step of ``--decode-batch`` sequences (64) against KV caches holding
  ``--context`` tokens (4096) each.

Per phase and path: the layers' time (embedding + layers + final norm: ``final_hidden``),
per-layer time (that / N), the lm_head on the tokens that need logits (the last token of
each sequence), and the ratio to stock.  Both paths share the model code, the weights and the
KV-cache class (whose append costs the same in both paths).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from _common import positive_int

from batchinv.shapes import QWEN3_8B_CONFIG

PATHS = ("stock", "batchinv")
GOAL = 1 / 1.10  # batchinv <= 1.10x the stock time, as stock / batchinv
QWEN3_8B = QWEN3_8B_CONFIG


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--layers", type=positive_int, default=2, help="decoder layers (2)")
    parser.add_argument("--prefill-batch", type=positive_int, default=8)
    parser.add_argument("--prefill-len", type=positive_int, default=4096)
    parser.add_argument("--decode-batch", type=positive_int, default=64)
    parser.add_argument("--context", type=positive_int, default=4096, help="cached tokens (4096)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.prefill_len + 1 > QWEN3_8B["max_position_embeddings"]:
        parser.error("--prefill-len exceeds max_position_embeddings (40960)")
    if args.context + 1 > QWEN3_8B["max_position_embeddings"]:
        parser.error("--context exceeds max_position_embeddings (40960)")
    return args


def summary_rows(rows: list[dict], args: argparse.Namespace) -> list[dict]:
    """The uniform summary from the detailed ``rows``: per phase, batchinv's total (layers +
    lm_head) against stock PyTorch's, goal 1 / 1.10."""
    from _common import summary_row

    cases = {
        "prefill": f"B={args.prefill_batch} S={args.prefill_len}",
        "decode": f"B={args.decode_batch} ctx={args.context}",
    }
    totals: dict[str, dict[str, float]] = {}
    for row in rows:
        totals.setdefault(row["phase"], {})[row["path"]] = row["total_ms"]
    summary = []
    for phase, by_path in totals.items():
        if "stock" not in by_path or "batchinv" not in by_path:
            continue
        summary.append(
            summary_row(
                "qwen3_e2e",
                f"{cases.get(phase, phase)}, {args.layers} layers + lm_head (Qwen3-8B shapes)",
                phase,
                by_path["batchinv"],
                "stock PyTorch",
                by_path["stock"],
                GOAL,
            )
        )
    return summary


def random_weights(config, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """bf16 weights drawn on the GPU: N(0, 1/fan_in) matrices, 1 + 0.3 N(0, 1) norms."""
    from batchinv.reference.qwen3_chain import qwen3_state_dict_shapes

    gen = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, shape in qwen3_state_dict_shapes(config).items():
        w = torch.randn(shape, device=device, generator=gen, dtype=torch.float32)
        if len(shape) == 1:
            w = 1.0 + 0.3 * w
        elif name != "model.embed_tokens.weight":
            w = w / math.sqrt(shape[1])
        weights[name] = w.to(torch.bfloat16)
    return weights


def filled_caches(model, batch: int, context: int, seed: int):
    """KV caches of ``batch`` sequences holding ``context`` random keys/values each."""
    caches = model.new_caches(batch, context + 1)
    gen = torch.Generator(device=model.device).manual_seed(seed)
    for cache in caches:
        for storage in (cache.k, cache.v):
            values = torch.randn(storage[:, :context].shape, device=model.device, generator=gen)
            storage[:, :context] = values.to(storage.dtype)
        cache.set_lengths(context)  # the keys written above
    return caches


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from _common import median_ms, report, require_cuda

    from batchinv.models.qwen3 import Qwen3, Qwen3Config, ops_by_name
    from batchinv.reference.qwen3_chain import lm_head_weight

    device = require_cuda()
    config = Qwen3Config(num_hidden_layers=args.layers, **QWEN3_8B)
    model = Qwen3(config, random_weights(config, device, args.seed))
    head = lm_head_weight(model.hf_state_dict(), config)
    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    prefill_ids = torch.randint(
        0, config.vocab_size, (args.prefill_batch, args.prefill_len), device=device, generator=gen
    )
    decode_ids = torch.randint(
        0, config.vocab_size, (args.decode_batch, 1), device=device, generator=gen
    )
    caches = filled_caches(model, args.decode_batch, args.context, args.seed + 2)

    def decode_step(path: str):
        for cache in caches:  # every timed step decodes the same token at the same position
            cache.set_lengths(args.context)
        return model.final_hidden(decode_ids, caches=caches, ops=path)

    rows = []
    with torch.no_grad():
        for phase, tokens, fn in (
            (
                "prefill",
                args.prefill_batch * args.prefill_len,
                lambda p: model.final_hidden(prefill_ids, ops=p),
            ),
            ("decode", args.decode_batch, decode_step),
        ):
            last_rows = args.prefill_batch if phase == "prefill" else args.decode_batch
            hidden = torch.randn(last_rows, config.hidden_size, device=device).bfloat16()
            timings = {}
            for path in PATHS:
                ops = ops_by_name(path)
                layers_ms = median_ms(lambda path=path: fn(path))
                head_ms = median_ms(lambda ops=ops: ops.linear(hidden, head, None))
                timings[path] = (layers_ms, head_ms)
            stock_total = sum(timings["stock"])
            for path, (layers_ms, head_ms) in timings.items():
                rows.append(
                    {
                        "phase": phase,
                        "tokens": tokens,
                        "layers": args.layers,
                        "path": path,
                        "layers_ms": layers_ms,
                        "ms_per_layer": layers_ms / args.layers,
                        "lm_head_ms": head_ms,
                        "total_ms": layers_ms + head_ms,
                        "vs_stock": (layers_ms + head_ms) / stock_total,
                        "per_layer_vs_stock": layers_ms / timings["stock"][0],
                    }
                )
    report(
        "qwen3_e2e",
        rows,
        [
            "phase",
            "tokens",
            "layers",
            "path",
            "layers_ms",
            "ms_per_layer",
            "lm_head_ms",
            "total_ms",
            "vs_stock",
            "per_layer_vs_stock",
        ],
        args.json,
        summary_rows(rows, args),
    )
    print("goal: vs_stock <= 1.10 for both phases")


if __name__ == "__main__":
    main()

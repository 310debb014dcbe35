"""Hugging Face ``generate`` with a static cache, eager and under ``torch.compile``: stock
transformers against the batchinv-patched model.

A transformers ``Qwen3ForCausalLM`` with Qwen3-8B layer shapes and random bf16 weights
(``--layers`` of the 36), greedy decoding of a left-padded batch.  Per path, the time per
decode token is the difference between two generations of different lengths divided by the
extra tokens (the prefill and the compile cancel out; both generations run once untimed
first).  Paths, all in this process:

- stock, eager: HF's static cache (``cache_implementation="static"``), ``disable_compile``;
- stock, compiled: the same with transformers' automatic ``torch.compile`` of the decode step
  (CUDA graphs);
- batchinv, eager / compiled: the model patched by ``apply_batchinv_to_qwen3``, with
  ``batchinv.integrations.transformers.static_cache`` (token-major keys and values).

Goal: batchinv compiled no slower than stock compiled (ratio >= 1.0).  The compiled batchinv
generation is also checked bitwise against its eager generation (tokens and logits).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from _common import report, require_cuda, summary_row

from batchinv.contract import bitwise_equal
from batchinv.integrations import transformers as hf
from batchinv.shapes import QWEN3_8B_CONFIG

GOAL = 1.0


def _model(layers: int, patched: bool):
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3Config(**QWEN3_8B_CONFIG, num_hidden_layers=layers)
    config._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16).eval()
    if patched:
        hf.apply_batchinv_to_qwen3(model)
    return model


def _generate(model, ids, mask, new_tokens, patched, compiled, capacity):
    kwargs = dict(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    if patched:
        kwargs["past_key_values"] = hf.static_cache(model, capacity)
    else:
        kwargs["cache_implementation"] = "static"
    if not compiled:
        kwargs["disable_compile"] = True
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, **kwargs)
    return out.sequences, torch.stack(out.logits)


def _ms_per_token(model, ids, mask, short, long, patched, compiled, capacity):
    times = {}
    for n in (short, long, short, long):  # the first two warm up (compile, capture)
        torch.cuda.synchronize()
        start = time.perf_counter()
        _generate(model, ids, mask, n, patched, compiled, capacity)
        torch.cuda.synchronize()
        times[n] = time.perf_counter() - start
    return (times[long] - times[short]) * 1e3 / (long - short)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--short", type=int, default=16)
    parser.add_argument("--long", type=int, default=80)
    args = parser.parse_args()
    require_cuda()
    capacity = args.prompt + args.long + 8
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(
        0, QWEN3_8B_CONFIG["vocab_size"], (args.batch, args.prompt), generator=gen
    ).cuda()
    mask = torch.ones_like(ids)
    for b in range(1, args.batch, 2):
        mask[b, : 7 * b] = 0  # left padding of different lengths
    rows, ms = [], {}
    for patched in (False, True):
        model = _model(args.layers, patched)
        for compiled in (False, True):
            label = f"{'batchinv' if patched else 'stock'}, {'compiled' if compiled else 'eager'}"
            ms[label] = _ms_per_token(
                model, ids, mask, args.short, args.long, patched, compiled, capacity
            )
            rows.append({"path": label, "ms_per_token": ms[label], "layers": args.layers})
            print(f"{label}: {ms[label]:.3f} ms per token", flush=True)
        if patched:
            eager = _generate(model, ids, mask, args.short, True, False, capacity)
            compiled_run = _generate(model, ids, mask, args.short, True, True, capacity)
            same = bitwise_equal(list(eager), list(compiled_run))
            for row in rows[-2:]:
                row["compiled_equals_eager_bitwise"] = same
        del model
        torch.cuda.empty_cache()
    case = f"B={args.batch}, prompt {args.prompt}, {args.layers} layers"
    summary = [
        summary_row(
            "hf_generate",
            case,
            f"{mode}, static cache",
            ms[f"batchinv, {mode}"],
            f"stock transformers, {mode}",
            ms[f"stock, {mode}"],
            GOAL if mode == "compiled" else None,
        )
        for mode in ("eager", "compiled")
    ]
    columns = ["path", "ms_per_token", "layers", "compiled_equals_eager_bitwise"]
    report("HF generate with a static cache", rows, columns, args.json, summary)


if __name__ == "__main__":
    main()

"""Token logprobs through the lm_head against the unfused stock chain and Liger-Kernel.

Goal: at 8192 tokens, H 4096, V 151936, bf16, batchinv is no slower than Liger's
fused linear cross-entropy (reduction="none", logprob = -loss) and uses no more peak extra
memory, while bitwise batch-invariant.  Rows, forward and forward+backward (gradients of
hidden and weight, a random per-token cotangent), each with its time and peak extra memory
(``torch.cuda.max_memory_allocated`` above what was allocated before the call, which
includes the 1.3 GB of gradients every path returns in fwd+bwd), the largest difference
from the stock values and the largest error against float64 logprobs of the first 64 rows:
- stock (the anchor): ``hidden @ W.T`` (cuBLAS, bf16) -> fp32 ``log_softmax`` -> gather;
- Liger-Kernel ``liger_fused_linear_cross_entropy(..., reduction="none")`` if importable;
- batchinv.token_logprobs.
The ratios are time(anchor or Liger) / time(batchinv): above 1 means batchinv is faster.
"""

from __future__ import annotations

import torch
from _common import median_ms, parse_args, report, require_cuda, summary_row

import batchinv

SHAPES = [
    # (tokens, H, V)
    (8192, 4096, 151936),
    (1024, 4096, 151936),
]
IGNORE = -100
GOALS = {(8192, 4096, 151936): 1.0}  # of Liger's fused time, by (tokens, H, V)


def summary_rows(rows: list[dict]) -> list[dict]:
    """The uniform summary from the detailed ``rows``: per shape, batchinv's forward and
    forward+backward against Liger's fused linear cross-entropy (a goal at the shape in GOALS),
    or against the stock unfused chain (no goal) when Liger was not importable."""
    shapes: dict[tuple, dict[str, dict]] = {}
    for row in rows:
        shapes.setdefault((row["tokens"], row["H"], row["V"]), {})[row["path"]] = row
    summary = []
    for shape, paths in shapes.items():
        if "batchinv" not in paths:
            continue
        if "liger fused" in paths:
            anchor, name, goal = (
                paths["liger fused"],
                "Liger fused linear cross-entropy",
                GOALS.get(shape),
            )
        elif "stock (anchor)" in paths:
            anchor, name, goal = paths["stock (anchor)"], "stock (mm, log_softmax, gather)", None
        else:
            continue
        case = "{} tokens, H {}, V {}, bf16".format(*shape)
        for variant, column in (("forward", "fwd ms"), ("forward+backward", "fwd+bwd ms")):
            summary.append(
                summary_row(
                    "token_logprobs",
                    case,
                    variant,
                    paths["batchinv"][column],
                    name,
                    anchor[column],
                    goal,
                )
            )
    return summary


def stock(hidden, weight, targets):
    logits = hidden @ weight.t()
    logprobs = torch.log_softmax(logits.float(), -1)
    valid = targets != IGNORE
    picked = logprobs.gather(-1, torch.where(valid, targets, 0).unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, picked, torch.zeros_like(picked))


def liger_or_none():
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except Exception as error:  # not installed, or no Triton for this card
        print(f"note: Liger-Kernel not importable ({error}); no Liger row")
        return None

    def liger(hidden, weight, targets):
        loss = liger_fused_linear_cross_entropy(
            hidden, weight, targets, ignore_index=IGNORE, reduction="none"
        )
        return -loss

    return liger


def peak_extra_gb(fn, *params) -> float:
    for p in params:  # the gradients of an earlier call are not part of the baseline
        p.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 1e9


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    device = require_cuda()
    paths = {"stock (anchor)": stock}
    liger = liger_or_none()
    if liger is not None:
        paths["liger fused"] = liger
    paths["batchinv"] = lambda h, w, t: batchinv.token_logprobs(h, w, t, IGNORE)
    rows_out = []
    for tokens, hidden_size, vocab in SHAPES:
        gen = torch.Generator(device=device).manual_seed(0)
        weight = (torch.randn(vocab, hidden_size, device=device, generator=gen) / 8).bfloat16()
        hidden = torch.randn(tokens, hidden_size, device=device, generator=gen).bfloat16()
        targets = torch.randint(0, vocab, (tokens,), device=device, generator=gen)
        targets[::97] = IGNORE
        cotangent = torch.randn(tokens, device=device, generator=gen)
        hidden_g = hidden.clone().requires_grad_(True)
        weight_g = weight.clone().requires_grad_(True)
        results = {}
        for name, fn in paths.items():
            forward = lambda fn=fn: fn(hidden, weight, targets)  # noqa: E731

            def forward_backward(fn=fn, h=hidden_g, w=weight_g):
                h.grad = w.grad = None
                fn(h, w, targets).backward(cotangent)

            value = forward()
            results[name] = {
                "forward ms": median_ms(forward, rep_ms=300),
                "forward GB": peak_extra_gb(forward),
                "fwd+bwd ms": median_ms(forward_backward, warmup_ms=200, rep_ms=600),
                "fwd+bwd GB": peak_extra_gb(forward_backward, hidden_g, weight_g),
                "value": value,
            }
            hidden_g.grad = weight_g.grad = None
        # float64 logprobs of the first rows: how far each path is from the exact value.
        exact = torch.log_softmax(hidden[:64].double() @ weight.double().t(), -1)
        exact = exact.gather(-1, targets[:64].clamp(min=0).unsqueeze(-1)).squeeze(-1)
        exact = torch.where(targets[:64] != IGNORE, exact, torch.zeros_like(exact))
        anchor = results["stock (anchor)"]
        for name, r in results.items():
            diff = (r["value"] - anchor["value"]).abs().max().item()
            error = (r["value"][:64].double() - exact).abs().max().item()
            row = {
                "tokens": tokens,
                "H": hidden_size,
                "V": vocab,
                "path": name,
                "fwd ms": r["forward ms"],
                "fwd GB": r["forward GB"],
                "fwd+bwd ms": r["fwd+bwd ms"],
                "fwd+bwd GB": r["fwd+bwd GB"],
                "max |d| vs stock": diff,
                "max |err| vs f64": error,
            }
            if name == "batchinv":
                for other, label in (("stock (anchor)", "stock"), ("liger fused", "liger")):
                    if other in results:
                        row[f"fwd {label}/bi"] = results[other]["forward ms"] / r["forward ms"]
                        row[f"f+b {label}/bi"] = results[other]["fwd+bwd ms"] / r["fwd+bwd ms"]
            rows_out.append(row)
        del hidden_g, weight_g, results
        torch.cuda.empty_cache()
    columns = ["tokens", "H", "V", "path", "fwd ms", "fwd GB", "fwd+bwd ms", "fwd+bwd GB"]
    columns += [
        "max |d| vs stock",
        "max |err| vs f64",
        "fwd stock/bi",
        "f+b stock/bi",
        "fwd liger/bi",
        "f+b liger/bi",
    ]
    report("token_logprobs", rows_out, columns, args.json, summary_rows(rows_out))


if __name__ == "__main__":
    main()

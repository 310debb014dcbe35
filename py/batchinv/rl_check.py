"""``batchinv rl-check``: is the sampler on-policy for the trainer?

An RL step samples completions with small, changing decode batches and then recomputes their
logprobs in the trainer's packed batch; the importance ratio ``exp(trainer - sampler)`` of a
token is 1 only if both computed the same bits.  This check does exactly that on a Qwen3 model,
once with stock PyTorch ops and once with batchinv:

- sampler: prompts join in waves of different sizes and finish after different numbers of
  tokens, so the decode batch changes from step to step; each token is sampled (exponential
  race with noise hashed from the prompt's seed and position, the same for both paths) and its
  fp32 logprob recorded.  batchinv samples with ``Qwen3DecodeRunner`` (CUDA graphs on CUDA);
  stock with the model's eager KV-cache decode and ``log_softmax`` of the logits, as engines do.
- trainer: ``Qwen3.token_logprobs`` of all sequences packed back to back (varlen).

Per path it reports the tokens compared, max |Δ logprob|, the mean KL(sampler ‖ trainer) as
estimated from the sampled tokens (k1: mean of sampler - trainer; k3: mean of
``r - 1 - log r`` with ``r`` the ratio), and the share of tokens whose ratio is exactly 1.
Exit code 0 when batchinv shows 0, 0 and 100%; 1 when not; 2 for bad input (before any work).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field

import torch

WAVES = (1, 3, 2, 5)  # prompts that join together; the rest join last


@dataclass
class PathResult:
    path: str
    tokens: int
    max_abs_diff: float
    kl_k1: float
    kl_k3: float
    exact_share: float
    diffs: list[float] = field(default_factory=list, repr=False)

    @property
    def on_policy(self) -> bool:
        return self.max_abs_diff == 0.0 and self.exact_share == 1.0


def _prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 24, (count,), generator=gen).tolist()
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def _waves(count: int) -> list[range]:
    waves, start = [], 0
    for size in WAVES:
        if start >= count:
            break
        waves.append(range(start, min(count, start + size)))
        start += size
    if start < count:
        waves.append(range(start, count))
    return waves


def _budget(index: int, new_tokens: int) -> int:
    """Tokens prompt ``index`` samples: sequences finish at different steps."""
    return max(1, new_tokens - (index * 5) % max(1, new_tokens // 2))


def _sample_batchinv(model, prompts, new_tokens, temperature):
    from .models.qwen3.decode import Qwen3DecodeRunner

    capacity = max(len(p) for p in prompts) + new_tokens
    runner = Qwen3DecodeRunner(
        model, max_batch=len(prompts), capacity=capacity, temperature=temperature
    )
    slots: dict[int, int] = {}
    for wave in _waves(len(prompts)):
        added = runner.add([prompts[i] for i in wave], seeds=list(wave))
        slots.update(zip(wave, added, strict=True))
        active = _unfinished(runner, slots, new_tokens)
        if active:
            runner.step(active)
    while active := _unfinished(runner, slots, new_tokens):
        runner.step(active)
    sequences = [runner.tokens(slots[i]) for i in range(len(prompts))]
    logprobs = [runner.logprobs(slots[i]) for i in range(len(prompts))]
    return sequences, logprobs


def _unfinished(runner, slots: dict[int, int], new_tokens: int) -> list[int]:
    return [s for i, s in slots.items() if runner.sampled_count(s) < _budget(i, new_tokens)]


def _sample_stock(model, prompts, new_tokens, temperature):
    """Eager decode with stock ops, one KV-cache batch per wave, sequences dropping out."""
    from .models.qwen3.decode import exponential_noise

    device = model.device
    sequences, logprobs = [None] * len(prompts), [None] * len(prompts)
    for wave in _waves(len(prompts)):
        rows = list(wave)
        lengths = torch.tensor([len(prompts[i]) for i in rows], device=device)
        ids = torch.zeros(len(rows), int(lengths.max()), dtype=torch.int64, device=device)
        for b, i in enumerate(rows):
            ids[b, : len(prompts[i])] = torch.tensor(prompts[i])
        caches = model.new_caches(len(rows), ids.shape[1] + new_tokens)
        logits = model(ids, seqlens=lengths, caches=caches, ops="stock")
        last = logits[torch.arange(len(rows), device=device), lengths - 1]
        tokens = {i: [] for i in rows}
        picked_logprobs = {i: [] for i in rows}
        positions = lengths.clone()
        live = list(range(len(rows)))
        while True:
            logp = torch.log_softmax(last.float() / temperature, dim=-1)
            seeds = torch.tensor([rows[b] for b in live], device=device)
            noise = exponential_noise(seeds, positions[live], logp.shape[-1])
            token = (logp - noise.log()).argmax(dim=-1)
            for j, b in enumerate(live):
                tokens[rows[b]].append(int(token[j]))
                picked_logprobs[rows[b]].append(float(logp[j, token[j]]))
            live_next = [b for b in live if len(tokens[rows[b]]) < _budget(rows[b], new_tokens)]
            if not live_next:
                break
            keep = [live.index(b) for b in live_next]
            seq_ids = torch.tensor(live_next, device=device)
            step_ids = token[keep][:, None]
            last = model(step_ids, caches=caches, seq_ids=seq_ids, ops="stock")[:, 0]
            positions[live_next] += 1
            live = live_next
        for i in rows:
            sequences[i] = prompts[i] + tokens[i]
            logprobs[i] = torch.tensor(picked_logprobs[i], dtype=torch.float32)
    return sequences, logprobs


def _compare(path: str, model, prompts, sequences, sampler_logprobs) -> PathResult:
    trainer = model.token_logprobs(
        [torch.tensor(s, device=model.device) for s in sequences],
        [len(p) for p in prompts],
        ops=path,
    )
    sampler = torch.cat([lp.float().cpu() for lp in sampler_logprobs])
    trainer = torch.cat([t.detach().float().cpu() for t in trainer])
    diff = sampler - trainer
    log_ratio = trainer - sampler
    exact = sampler.view(torch.int32) == trainer.view(torch.int32)
    return PathResult(
        path=path,
        tokens=int(sampler.numel()),
        max_abs_diff=float(diff.abs().max()),
        kl_k1=float(diff.mean()),
        kl_k3=float((log_ratio.exp() - 1 - log_ratio).mean()),
        exact_share=float(exact.float().mean()),
        diffs=diff.tolist(),
    )


def run_rl_check(
    model, *, prompts: int = 16, new_tokens: int = 16, temperature: float = 1.0, seed: int = 0
) -> list[PathResult]:
    """The check on ``model``: one ``PathResult`` for stock, one for batchinv."""
    ids = _prompts(prompts, model.config.vocab_size, seed)
    results = []
    with torch.no_grad():
        stock = _sample_stock(model, ids, new_tokens, temperature)
    results.append(_compare("stock", model, ids, *stock))
    batchinv = _sample_batchinv(model, ids, new_tokens, temperature)
    results.append(_compare("batchinv", model, ids, *batchinv))
    return results


def format_results(results: list[PathResult], label: str) -> str:
    lines = [
        f"rl-check on {label}: sampler (changing decode batches) vs trainer (packed batch)",
        f"{'path':<10}{'tokens':>8}{'max |Δ logprob|':>18}{'KL k1':>12}{'KL k3':>12}"
        f"{'ratio == 1':>12}",
    ]
    for r in results:
        lines.append(
            f"{r.path:<10}{r.tokens:>8}{r.max_abs_diff:>18.3e}{r.kl_k1:>12.2e}{r.kl_k3:>12.2e}"
            f"{r.exact_share:>11.1%}"
        )
    return "\n".join(lines)


def _histogram(results: list[PathResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stock = next(r for r in results if r.path == "stock")
    figure, axes = plt.subplots(figsize=(7, 4))
    axes.hist(stock.diffs, bins=60, color="tab:red")
    axes.set_xlabel("sampler logprob - trainer logprob (stock PyTorch)")
    axes.set_ylabel("tokens")
    axes.set_title(
        f"stock: {1 - stock.exact_share:.1%} of {stock.tokens} tokens off-policy; "
        "batchinv: all equal"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .audit import DTYPES

    parser.add_argument(
        "--model",
        default=None,
        metavar="PATH",
        help="local Qwen3 checkpoint; default: the built-in tiny configuration",
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--prompts", type=int, default=16, help="number of prompts (16)")
    parser.add_argument(
        "--new-tokens", type=int, default=16, help="tokens per prompt, at most (16)"
    )
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, metavar="OUT", help="also write the result here")
    parser.add_argument(
        "--png",
        default=None,
        metavar="OUT",
        help="a histogram of the stock path's Δ logprob (needs matplotlib)",
    )


def run(args: argparse.Namespace) -> int:
    from .audit import _load_model
    from .cli import check_writable  # cli imports this module

    try:
        for name in ("prompts", "new_tokens"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        if not (args.temperature > 0 and math.isfinite(args.temperature)):
            raise ValueError("--temperature must be a positive number")
        if args.json:
            check_writable(args.json, "--json")
        if args.png:
            check_writable(args.png, "--png")
            import matplotlib  # noqa: F401
        model, label = _load_model(args)
    except ImportError:
        print(
            "batchinv rl-check: error: --png needs matplotlib (pip install matplotlib)",
            file=sys.stderr,
        )
        return 2
    except (OSError, KeyError, TypeError, ValueError) as err:
        print(f"batchinv rl-check: error: {err}", file=sys.stderr)
        return 2
    results = run_rl_check(
        model,
        prompts=args.prompts,
        new_tokens=args.new_tokens,
        temperature=args.temperature,
        seed=args.seed,
    )
    print(format_results(results, label))
    if args.json:
        from pathlib import Path

        from .provenance import source_commit

        payload = {
            "model": label,
            "device": str(model.device),
            "dtype": str(model.dtype).removeprefix("torch."),
            "commit": source_commit(Path(__file__).resolve().parents[2]),
            "results": [asdict(r) for r in results],
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
        print(f"JSON written to {args.json}")
    if args.png:
        _histogram(results, args.png)
        print(f"histogram written to {args.png}")
    batchinv = next(r for r in results if r.path == "batchinv")
    return 0 if batchinv.on_policy else 1

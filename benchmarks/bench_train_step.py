"""One training step (forward + backward of the token-logprob loss): batchinv against stock.

Goal: a batchinv step <= 1.05x the stock step time, same run.  The model
has Qwen3-8B layer shapes (hidden 4096, intermediate 12288, 32 query / 8 KV heads of 128,
vocab 151936), ``--layers`` decoder layers (2) and random bf16 weights.  The batch is
``--sequences`` sequences (16) of mixed lengths (0.5x to 1.5x the mean, fixed pattern) summing
to each of ``--tokens`` (16384 and 32768); the first quarter of each sequence is its prompt.
Loss = -mean over the completion tokens of ``log p(token | prefix)``; a step is the forward
and ``torch.autograd.grad`` of the loss w.r.t. every parameter (no optimizer).

Paths, each timed as whole steps (one warm-up step, then the median of ``--reps`` steps,
CUDA events):

- ``batchinv.models.Qwen3``: the batch packed (varlen), ``Qwen3.token_logprobs`` on the
  batchinv op table (batch-invariant kernels, the fused lm_head + logprobs);
- stock, the anchor of the goal: the same model, weights and packed batch on the stock op
  table (``F.linear`` = cuBLAS, Hugging Face's RMSNorm and RoPE formulas, ``silu(g) * u``,
  ``F.linear`` + ``log_softmax`` + gather for the logprobs) with one change: attention runs
  SDPA per sequence (``is_causal``, ``enable_gqa``, SDPA's own choice of backend), not the
  stock table's single SDPA call under a dense block-diagonal mask, which would spend most
  of its time on masked-out blocks;
- transformers ``Qwen3ForCausalLM`` holding the same weights, unpatched (``sdpa``) and
  patched with ``apply_batchinv_to_qwen3``: both run the sequences as a right-padded batch
  with an attention mask (the patched model is also given the packed row once, untimed, and
  a refusal of its block-diagonal mask is recorded in the rows).  Their loss takes the final
  hidden states of the completion positions through the lm_head (``batchinv.token_logprobs``
  when patched, the stock table's unfused logprobs otherwise);
- transformers with Liger-Kernel's Qwen3 patch (RMSNorm, RoPE, SwiGLU) and its fused linear
  cross entropy as the loss (the same loss), padded likewise, when liger_kernel is
  importable; otherwise a row says "not installed".

Breakdown (batchinv and stock tables): each component is timed alone with CUDA events
(``_common.median_ms``) on the step's shapes and inputs, through the same op table, and
multiplied by its count per step: linear forward, grad_x and grad_w (the 7 projections of
each layer), attention forward and backward, the RMSNorms (2 per layer on the hidden
states, the q/k head norms, the final norm) forward and backward, RoPE and SiLU-mul forward +
backward, and the lm_head + logprobs forward + backward.  "other" is the step time minus
their sum: embedding, residual adds, reshapes, the loss, host gaps, and whatever running the
components in one step changes (caches, overlap).

A case that runs out of GPU memory is recorded as skipped (a row with a ``note``).  A path or
breakdown that fails otherwise is recorded the same way, the other paths still run, and the
script exits with status 1 after writing the results (Liger-Kernel's failures are recorded
only).

    python benchmarks/bench_train_step.py [--layers N] [--tokens 16384 32768] [--json PATH]
    python benchmarks/bench_train_step.py --smoke     # tiny model; runs on the CPU too
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import bench_device, positive_int

from batchinv.shapes import QWEN3_8B_CONFIG

GOAL = 1 / 1.05  # batchinv <= 1.05x the stock step time, as stock / batchinv
ANCHOR = "stock PyTorch (cuBLAS, SDPA per sequence)"
HF_ANCHOR = "transformers, stock (sdpa, padded)"
IGNORE_INDEX = -100
# Sequence lengths as multiples of the mean: pairs that average 1, so the batch sums exactly.
LENGTH_PATTERN = (0.5, 1.5, 0.75, 1.25, 0.625, 1.375, 0.875, 1.125)
SMOKE_TOKENS = (48,)
SMOKE_SEQUENCES = 4
STEP_COLUMNS = ["tokens", "path", "layout", "step_ms", "vs_anchor", "peak_GiB", "note"]
COMPONENT_COLUMNS = ["tokens", "component", "count", "batchinv_ms", "stock_ms", "vs_stock"]
# The result file's rows: the steps ("kind" "step") then the breakdown ("kind" "component").
ROW_COLUMNS = ["kind", *STEP_COLUMNS[:-1], *COMPONENT_COLUMNS[1:], "note"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--layers", type=positive_int, default=2, help="decoder layers (2)")
    parser.add_argument("--tokens", type=positive_int, nargs="+", default=[16384, 32768])
    parser.add_argument("--sequences", type=positive_int, default=16, help="sequences per batch")
    parser.add_argument("--reps", type=positive_int, default=3, help="timed steps per path (3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--smoke", action="store_true", help="the tiny model, one small batch; runs on the CPU"
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.tokens, args.sequences = list(SMOKE_TOKENS), SMOKE_SEQUENCES
    for tokens in args.tokens:
        if tokens < 2 * args.sequences:
            parser.error(f"--tokens {tokens} leaves fewer than 2 tokens per sequence")
        longest = max(sequence_lengths(tokens, args.sequences))
        if not args.smoke and longest > QWEN3_8B_CONFIG["max_position_embeddings"]:
            parser.error(f"--tokens {tokens}: a sequence of {longest} passes 40960 positions")
    return args


def sequence_lengths(total: int, count: int) -> list[int]:
    """``count`` lengths following ``LENGTH_PATTERN`` around ``total / count``, summing to
    ``total`` (the last one takes the rounding), each at least 2."""
    mean = total / count
    lengths = [max(2, round(mean * LENGTH_PATTERN[i % len(LENGTH_PATTERN)])) for i in range(count)]
    lengths[-1] += total - sum(lengths)
    if lengths[-1] < 2:
        raise ValueError(f"cannot split {total} tokens into {count} sequences of >= 2")
    return lengths


@dataclasses.dataclass
class Batch:
    """The step's batch: packed for the Qwen3 model, right-padded for transformers."""

    sequences: list[torch.Tensor]  # one 1-D id tensor per sequence
    prompt_lens: list[int]
    padded_ids: torch.Tensor  # [n, longest]
    padded_mask: torch.Tensor  # [n, longest], 1 = token
    target_rows: torch.Tensor  # flat indices into [n * longest] of the predicting positions
    targets: torch.Tensor  # the token each of those rows predicts
    cu_seqlens: torch.Tensor  # [n + 1] of the packed batch
    packed_targets: torch.Tensor  # [tokens], IGNORE_INDEX where nothing is predicted

    @property
    def completion_tokens(self) -> int:
        return int(self.targets.numel())


def make_batch(total: int, count: int, vocab: int, device, seed: int) -> Batch:
    lengths = sequence_lengths(total, count)
    gen = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
    prompts = [max(1, n // 4) for n in lengths]
    longest = max(lengths)
    padded = torch.zeros(count, longest, dtype=torch.int64)
    mask = torch.zeros(count, longest, dtype=torch.int64)
    rows, targets, packed_targets = [], [], []
    for b, (seq, p) in enumerate(zip(sequences, prompts, strict=True)):
        n = seq.numel()
        padded[b, :n], mask[b, :n] = seq, 1
        rows.append(b * longest + torch.arange(p - 1, n - 1))  # position t predicts t + 1
        targets.append(seq[p:])
        tail = torch.full((n,), IGNORE_INDEX, dtype=torch.int64)
        tail[p - 1 : n - 1] = seq[p:]
        packed_targets.append(tail)
    cu = torch.tensor([0, *lengths]).cumsum(0)
    return Batch(
        sequences=[s.to(device) for s in sequences],
        prompt_lens=prompts,
        padded_ids=padded.to(device),
        padded_mask=mask.to(device),
        target_rows=torch.cat(rows).to(device),
        targets=torch.cat(targets).to(device),
        cu_seqlens=cu.to(device),
        packed_targets=torch.cat(packed_targets).to(device),
    )


# ----- the stock table with per-sequence attention ---------------------------------------


def sdpa_per_sequence(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal):
    """Packed ``[T, H, d]`` attention as stock PyTorch runs it without a varlen kernel: one
    ``F.scaled_dot_product_attention`` per sequence (GQA through ``enable_gqa``)."""
    if not torch.equal(cu_seqlens_q, cu_seqlens_k):
        raise NotImplementedError("per-sequence SDPA: cu_seqlens_q must equal cu_seqlens_k")
    bounds = cu_seqlens_q.tolist()
    pieces = []
    for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
        qs, ks, vs = (t[start:stop].transpose(0, 1)[None] for t in (q, k, v))
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, enable_gqa=True)
        pieces.append(out[0].transpose(0, 1))
    return torch.cat(pieces)


def stock_table():
    from batchinv.models.qwen3.ops import STOCK_OPS

    return dataclasses.replace(
        STOCK_OPS, name="stock, SDPA per sequence", attention_varlen=sdpa_per_sequence
    )


# ----- timing --------------------------------------------------------------------------------


class Clock:
    """Times on the step's device: CUDA events on a GPU, wall time on the CPU (smoke runs)."""

    def __init__(self, device: torch.device, smoke: bool):
        self.device, self.smoke = device, smoke

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def steps_ms(self, fn, reps: int) -> float:
        """One warm-up call, then the median of ``reps`` timed calls."""
        fn()
        self.sync()
        times = []
        for _ in range(reps):
            if self.device.type == "cuda":
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                begin = time.perf_counter()
                fn()
                times.append((time.perf_counter() - begin) * 1e3)
        return sorted(times)[len(times) // 2]

    def op_ms(self, fn) -> float:
        """A component's median time (``_common.median_ms`` on a GPU)."""
        if self.device.type == "cuda" and not self.smoke:
            from _common import median_ms

            return median_ms(fn, warmup_ms=10, rep_ms=40)
        return self.steps_ms(fn, 1)

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def peak_gib(self) -> float | None:
        if self.device.type != "cuda":
            return None
        return torch.cuda.max_memory_allocated() / 2**30


# ----- the steps -----------------------------------------------------------------------------


def qwen3_step(model, batch: Batch, ops):
    params = [p for p in model.parameters() if p.requires_grad]

    def step():
        logprobs = model.token_logprobs(batch.sequences, batch.prompt_lens, ops=ops)
        loss = -torch.cat(logprobs).sum() / batch.completion_tokens
        return torch.autograd.grad(loss, params)

    return step


def hf_step(hf_model, batch: Batch, loss_of):
    """A step of ``hf_model`` on the padded batch: its final hidden states at the completion
    positions, ``loss_of(rows, lm_head_weight, targets)`` and the gradients."""
    params = [p for p in hf_model.parameters() if p.requires_grad]

    def step():
        hidden = hf_model.model(
            input_ids=batch.padded_ids, attention_mask=batch.padded_mask, use_cache=False
        ).last_hidden_state
        rows = hidden.reshape(-1, hidden.shape[-1])[batch.target_rows]
        loss = loss_of(rows, hf_model.lm_head.weight, batch.targets)
        return torch.autograd.grad(loss, params)

    return step


def logprob_loss(token_logprobs):
    """``loss_of`` for ``hf_step`` from a ``token_logprobs(hidden, weight, targets, ignore)``:
    minus the mean logprob of the targets."""

    def loss_of(rows, weight, targets):
        return -token_logprobs(rows, weight, targets, IGNORE_INDEX).sum() / targets.numel()

    return loss_of


def packed_refusal(hf_model, batch: Batch) -> str | None:
    """The error the patched transformers model raises for the packed batch (one row,
    positions restarting per sequence), or None if it runs it."""
    ids = torch.cat(batch.sequences)[None]
    positions = torch.cat([torch.arange(s.numel(), device=ids.device) for s in batch.sequences])
    try:
        with torch.no_grad():
            hf_model.model(input_ids=ids, position_ids=positions[None], use_cache=False)
    except Exception as error:  # a probe: whatever stops the packed row is the answer
        return f"{type(error).__name__}: {error}"
    return None


def build_hf(config, state_dict, device):
    import transformers

    hf_config = transformers.Qwen3Config(**config.to_dict(), attn_implementation="sdpa")
    with torch.device(device):
        model = transformers.Qwen3ForCausalLM(hf_config)
    model.to(state_dict["model.embed_tokens.weight"].dtype)
    model.load_state_dict({name: t.detach() for name, t in state_dict.items()}, strict=True)
    return model.train()


def liger_patch(hf_model):
    """``(note, loss_of)``: patches ``hf_model`` in place with Liger-Kernel's Qwen3 ops (RoPE,
    RMSNorm, SwiGLU) and returns its fused linear cross entropy as the loss (the mean of
    ``-log p(target)``, the same loss); or the reason it cannot, and None."""
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger_kernel not installed", None
    try:
        from liger_kernel.transformers import (
            LigerFusedLinearCrossEntropyLoss,
            apply_liger_kernel_to_qwen3,
        )

        apply_liger_kernel_to_qwen3(
            rope=True,
            rms_norm=True,
            swiglu=True,
            cross_entropy=False,
            fused_linear_cross_entropy=False,  # the loss below is the fused one, called directly
            model=hf_model,
        )
        fused = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="mean")
    except Exception as error:  # an API change is reported in the row, not fatal
        return f"Liger-Kernel's Qwen3 patch failed: {type(error).__name__}: {error}", None

    def loss_of(rows, weight, targets):
        out = fused(weight, rows, targets)
        return out[0] if isinstance(out, tuple) else out

    return None, loss_of


# ----- the breakdown -------------------------------------------------------------------------


def components(config, model, batch: Batch, ops, clock: Clock) -> dict[str, tuple[int, float]]:
    """``{component: (count per step, ms of one)}`` for one op table (module docstring)."""
    device, dtype = model.device, model.dtype
    tokens = int(batch.cu_seqlens[-1])
    hidden, inter = config.hidden_size, config.intermediate_size
    heads, kv_heads, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    layers = config.num_hidden_layers
    gen = torch.Generator(device=device).manual_seed(7)

    def rand(*shape, grad=False):
        t = torch.randn(*shape, device=device, generator=gen).to(dtype)
        return t.requires_grad_(grad)

    def backward_ms(out, inputs) -> float:
        grad = torch.randn_like(out)
        return clock.op_ms(lambda: torch.autograd.grad(out, inputs, grad, retain_graph=True))

    result: dict[str, tuple[int, float]] = {}
    # (in, out, projections per layer) of the chain's linears: q+o, k+v, gate+up, down.
    projections = (
        (hidden, heads * d, 1),
        (heads * d, hidden, 1),
        (hidden, kv_heads * d, 2),
        (hidden, inter, 2),
        (inter, hidden, 1),
    )
    fwd = dx = dw = 0.0
    count = 0
    for k, n, per_layer in projections:
        weight = (rand(n, k) / math.sqrt(k)).requires_grad_(False)
        x = rand(tokens, k)
        with torch.no_grad():
            fwd += per_layer * clock.op_ms(lambda x=x, w=weight: ops.linear(x, w, None))
        x.requires_grad_(True)
        dx += per_layer * backward_ms(ops.linear(x, weight, None), [x])
        x.requires_grad_(False)
        weight.requires_grad_(True)
        dw += per_layer * backward_ms(ops.linear(x, weight, None), [weight])
        count += per_layer
    result["linear forward"] = (count * layers, fwd / count)
    result["linear grad_x"] = (count * layers, dx / count)
    result["linear grad_w"] = (count * layers, dw / count)

    q, k, v = (
        rand(tokens, heads, d, grad=True),
        rand(tokens, kv_heads, d),
        rand(tokens, kv_heads, d),
    )
    k.requires_grad_(True)
    v.requires_grad_(True)
    cu = batch.cu_seqlens
    with torch.no_grad():
        result["attention forward"] = (
            layers,
            clock.op_ms(lambda: ops.attention_varlen(q, k, v, cu, cu, causal=True)),
        )
    out = ops.attention_varlen(q, k, v, cu, cu, causal=True)
    result["attention backward"] = (layers, backward_ms(out, [q, k, v]))
    del out

    norm_fwd = norm_bwd = 0.0
    norm_count = 0
    for shape, per_step in (
        ((tokens, hidden), 2 * layers + 1),
        ((tokens, heads, d), layers),
        ((tokens, kv_heads, d), layers),
    ):
        x, weight = rand(*shape, grad=True), (1 + 0.3 * rand(shape[-1])).requires_grad_(True)
        eps = config.rms_norm_eps
        with torch.no_grad():
            norm_fwd += per_step * clock.op_ms(lambda x=x, w=weight: ops.rms_norm(x, w, eps))
        norm_bwd += per_step * backward_ms(ops.rms_norm(x, weight, eps), [x, weight])
        norm_count += per_step
    result["rms_norm forward"] = (norm_count, norm_fwd / norm_count)
    result["rms_norm backward"] = (norm_count, norm_bwd / norm_count)

    positions = torch.cat(
        [torch.arange(int(n), device=device) for n in batch.cu_seqlens.diff().tolist()]
    )
    rope_args = dict(
        theta=config.rope_theta, head_dim=d, max_position=config.max_position_embeddings
    )

    def rope_step():
        q_rot, k_rot = ops.rope(q, k, positions, **rope_args)
        return torch.autograd.grad((q_rot, k_rot), (q, k), (q_rot.detach(), k_rot.detach()))

    result["rope forward + backward"] = (layers, clock.op_ms(rope_step))

    gate, up = rand(tokens, inter, grad=True), rand(tokens, inter, grad=True)

    def silu_step():
        out = ops.silu_mul(gate, up)
        return torch.autograd.grad(out, (gate, up), out.detach())

    result["silu_mul forward + backward"] = (layers, clock.op_ms(silu_step))

    final = rand(tokens, hidden, grad=True)
    head = model.lm_head.weight

    def head_step():
        logprobs = ops.token_logprobs(final, head, batch.packed_targets, IGNORE_INDEX)
        return torch.autograd.grad(logprobs.sum(), (final, head))

    result["lm_head + logprobs forward + backward"] = (1, clock.op_ms(head_step))
    return result


# ----- the run -------------------------------------------------------------------------------


def run_path(name: str, layout: str, step, clock: Clock, reps: int, tokens: int) -> dict:
    print(f"  {name} ({layout}) ...", flush=True)
    clock.reset_peak()
    row = {"kind": "step", "tokens": tokens, "path": name, "layout": layout}
    try:
        row["step_ms"] = clock.steps_ms(step, reps)
        row["peak_GiB"] = clock.peak_gib()
    except torch.cuda.OutOfMemoryError as error:
        row["step_ms"], row["note"] = None, f"out of GPU memory: {str(error).splitlines()[0]}"
        print(f"  note: {name}: {row['note']}")
    except Exception as error:  # recorded, the other paths still run; main() exits 1 after
        traceback.print_exc()
        row["step_ms"], row["failed"] = None, True
        row["note"] = f"failed: {type(error).__name__}: {str(error)[:300]}"
    clock.reset_peak()
    return row


def breakdown_rows(config, model, batch, stock, clock, step_rows, tokens) -> list[dict]:
    """The component rows of one token count (batchinv's table against ``stock``), closed by
    "other": each table's step time minus the sum of its components."""
    from batchinv.models.qwen3.ops import BATCHINV_OPS

    try:
        mine = components(config, model, batch, BATCHINV_OPS, clock)
        theirs = components(config, model, batch, stock, clock)
    except torch.cuda.OutOfMemoryError as error:
        note = f"breakdown skipped: out of GPU memory: {str(error).splitlines()[0]}"
        print(f"  note: {note}")
        return [{"kind": "component", "tokens": tokens, "note": note}]
    except Exception as error:  # recorded like a failed step
        traceback.print_exc()
        note = f"breakdown failed: {type(error).__name__}: {str(error)[:300]}"
        return [{"kind": "component", "tokens": tokens, "note": note, "failed": True}]
    rows = []
    sums = {"batchinv": 0.0, "stock": 0.0}
    for component, (count, mine_ms) in mine.items():
        stock_ms = theirs[component][1]
        sums["batchinv"] += count * mine_ms
        sums["stock"] += count * stock_ms
        rows.append(
            {
                "kind": "component",
                "tokens": tokens,
                "component": component,
                "count": count,
                "batchinv_ms": count * mine_ms,
                "stock_ms": count * stock_ms,
                "vs_stock": mine_ms / stock_ms,
            }
        )
    totals = {r["path"]: r.get("step_ms") for r in step_rows if r["tokens"] == tokens}
    steps = {"batchinv": totals.get("batchinv.models.Qwen3"), "stock": totals.get("stock PyTorch")}
    if None not in steps.values():
        other = {path: steps[path] - sums[path] for path in sums}
        rows.append(
            {
                "kind": "component",
                "tokens": tokens,
                "component": "other (step - components)",
                "count": 1,
                "batchinv_ms": other["batchinv"],
                "stock_ms": other["stock"],
                "vs_stock": other["batchinv"] / other["stock"] if other["stock"] else None,
            }
        )
    return rows


def summary_rows(
    rows: list[dict], args, batches: dict[int, Batch], shapes: str = "Qwen3-8B shapes"
) -> list[dict]:
    """Per token count: batchinv.models.Qwen3 against the stock table, and the patched
    transformers model against the unpatched one (goal 1 / 1.05), and against Liger-Kernel
    (no goal) when it ran."""
    from _common import summary_row

    pairs = (
        ("batchinv.models.Qwen3", "stock PyTorch", ANCHOR, GOAL),
        ("transformers + batchinv", "transformers, stock", HF_ANCHOR, GOAL),
        ("transformers + batchinv", "transformers + Liger-Kernel", "transformers + Liger", None),
    )
    times = {(r["tokens"], r["path"]): r.get("step_ms") for r in rows}
    summary = []
    for tokens, batch in batches.items():
        case = (
            f"{tokens} tokens ({len(batch.sequences)} sequences), {args.layers} layers + lm_head "
            f"({shapes}), bf16"
        )
        for mine, anchor_path, anchor, goal in pairs:
            mine_ms, anchor_ms = times.get((tokens, mine)), times.get((tokens, anchor_path))
            if mine_ms is None or anchor_ms is None:
                continue
            variant = f"train step, {mine}"
            summary.append(
                summary_row("train_step", case, variant, mine_ms, anchor, anchor_ms, goal)
            )
    return summary


def main(argv: list[str] | None = None) -> tuple[list[dict], list[dict], list[dict]]:
    """Runs the benchmark; returns (step rows, component rows, summary) for the smoke test."""
    args = parse_args(argv)
    from batchinv.models.qwen3 import Qwen3, Qwen3Config
    from batchinv.models.qwen3.ops import BATCHINV_OPS
    from batchinv.ops.token_logprobs import token_logprobs as batchinv_token_logprobs

    device = bench_device(args.smoke, args.json)
    clock = Clock(device, args.smoke)
    if args.smoke:
        config = Qwen3Config.tiny()
    else:
        config = Qwen3Config(num_hidden_layers=args.layers, **QWEN3_8B_CONFIG)
    args.layers = config.num_hidden_layers
    from bench_qwen3_e2e import random_weights

    print(f"building the model ({config.num_hidden_layers} layers) ...", flush=True)
    model = Qwen3(config, random_weights(config, device, args.seed))
    hf_model = build_hf(config, model.hf_state_dict(), device)
    stock = stock_table()
    batches = {
        tokens: make_batch(tokens, args.sequences, config.vocab_size, device, args.seed + tokens)
        for tokens in args.tokens
    }

    step_rows, component_rows = [], []
    for tokens, batch in batches.items():
        print(f"{tokens} tokens, {len(batch.sequences)} sequences:", flush=True)
        padded = f"padded {tuple(batch.padded_ids.shape)}"
        for name, ops in (("batchinv.models.Qwen3", BATCHINV_OPS), ("stock PyTorch", stock)):
            step = qwen3_step(model, batch, ops)
            step_rows.append(run_path(name, "packed", step, clock, args.reps, tokens))
        step = hf_step(hf_model, batch, logprob_loss(stock.token_logprobs))
        step_rows.append(run_path("transformers, stock", padded, step, clock, args.reps, tokens))
        from batchinv.integrations.transformers import apply_batchinv_to_qwen3

        undo = apply_batchinv_to_qwen3(hf_model)
        try:
            refusal = packed_refusal(hf_model, batch)
            step = hf_step(hf_model, batch, logprob_loss(batchinv_token_logprobs))
            row = run_path("transformers + batchinv", padded, step, clock, args.reps, tokens)
        finally:
            undo()
        if refusal is not None:
            row["note"] = f"packed row refused ({refusal[:160]}); timed padded"
        step_rows.append(row)

        print("  components ...", flush=True)
        component_rows += breakdown_rows(config, model, batch, stock, clock, step_rows, tokens)

    liger_note, liger_loss = liger_patch(hf_model)
    for tokens, batch in batches.items():
        name = "transformers + Liger-Kernel"
        row = {"kind": "step", "tokens": tokens, "path": name, "note": liger_note}
        if liger_loss is not None:
            print(f"{tokens} tokens:", flush=True)
            layout = f"padded {tuple(batch.padded_ids.shape)}"
            row = run_path(
                name, layout, hf_step(hf_model, batch, liger_loss), clock, args.reps, tokens
            )
            row.pop("failed", None)  # a third-party failure is reported, not ours to fail on
        step_rows.append(row)

    anchors = {
        "batchinv.models.Qwen3": "stock PyTorch",
        "transformers + batchinv": "transformers, stock",
        "transformers + Liger-Kernel": "transformers, stock",
    }
    times = {(r["tokens"], r["path"]): r.get("step_ms") for r in step_rows}
    for row in step_rows:
        anchor_ms = times.get((row["tokens"], anchors.get(row["path"], row["path"])))
        if row.get("step_ms") is not None and anchor_ms:
            row["vs_anchor"] = row["step_ms"] / anchor_ms  # time ratio: <= 1.05 meets the goal
    shapes = "the tiny model" if args.smoke else "Qwen3-8B shapes"
    summary = summary_rows(step_rows, args, batches, shapes)
    name = f"train_step ({args.layers} layers, {shapes}, bf16)"
    from _common import print_table, report

    if device.type == "cuda":
        report(name, step_rows + component_rows, ROW_COLUMNS, args.json, summary)
    else:
        print(f"\n{name}, CPU smoke run (strict references; the times mean nothing)")
    print("\nsteps")
    print_table(step_rows, STEP_COLUMNS)
    print("\nbreakdown (each component alone; ms per step = count x one call)")
    print_table(component_rows, COMPONENT_COLUMNS)
    print("goal: batchinv step / stock step <= 1.05 (vs_anchor)")
    failed = [r for r in step_rows + component_rows if r.get("failed")]
    for row in failed:
        print(f"FAILED: {row.get('path', 'breakdown')} at {row['tokens']} tokens: {row['note']}")
    if failed:
        sys.exit(1)
    return step_rows, component_rows, summary


if __name__ == "__main__":
    main()

"""A whole tensor-parallel decode step: batchinv TP against a stock TP step, and one GPU.

A Qwen3 with Qwen3-8B layer shapes (hidden 4096, 32 q / 8 kv heads of 128, intermediate
12288, vocab 151936), ``--layers`` decoder layers (default 4) and random bf16 weights, at
batch 1, 8 and 64 (``--batch``) with KV caches holding ``--context`` tokens (default 4096,
random keys and values as after a prefill).  One decode step, one new token per sequence:
embedding, the layers, final norm, the logits, an fp32 ``log_softmax``, the greedy pick and
its logprob (as eager ``Qwen3.generate`` does; ``bench_decode.py``'s runner takes the logprob
from ``token_logprobs`` instead, and refuses TP tables).  Three rows per case, one run:

- batchinv TP: ``tensor_parallel_qwen3`` (``row_parallel_linear`` for o_proj and down_proj,
  vocab-parallel logits), bitwise one GPU running ``tp_compatible_ops``;
- stock TP: ``stock_tensor_parallel_qwen3`` (``STOCK_OPS``; o_proj and down_proj are
  ``F.linear`` of the K shard + NCCL's bf16 ``all_reduce``; the logits column-parallel and
  all_gathered), the same shards, its cached attention as transformers runs SDPA with a mask
  (kv heads repeated: ``with_repeated_kv_heads``) and, on CUDA, pinned to SDPA's
  mem-efficient backend.  SDPA's own pick for that call on Hopper is cuDNN, whose forward
  took tens of milliseconds of host time per decode step in torch's profiler (the key length
  changes every step; a new plan per length would explain it, not checked), a cost a serving
  engine's decode kernel does not pay; ``STOCK_OPS`` as it is (``enable_gqa``, SDPA's own
  pick) is timed too (``stock_tp_sdpa_default_ms``, CUDA only) but is not the anchor;
- batchinv on one GPU with ``tp_compatible_ops`` (rank 0 only), for reference.

Every step is eager: the CUDA-graph decode runner (``Qwen3DecodeRunner``) runs the single-GPU
table and refuses TP tables, and capturing NCCL collectives is not attempted.  Before timing,
rank 0 checks that the batchinv TP step's logits equal the one-GPU step's bit for bit (the
``tp_bitwise_one_gpu`` column; a mismatch stops every rank with an error).

World = every GPU (``--world`` to choose; at least 2), through its own spawn or
``torchrun --nproc-per-node N benchmarks/bench_tp_decode.py``.  Every rank runs the same
fixed number of steps (collectives must match); a step's time is its wall time, host
included, synced after each step; a case's time is the slowest rank's median.  Rank 0 prints
and writes the JSON (``--json``); summary ratio = stock TP / batchinv TP (no goal).  Without
2 GPUs it prints why, writes nothing and exits with status 1.  NVLink multicast stays off
(``NCCL_NVLS_ENABLE=0`` etc.).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import keep_nvlink_multicast_off, positive_int, report, summary_row
from bench_decode import random_weights
from torch.nn.attention import SDPBackend, sdpa_kernel

from batchinv.contract import bitwise_equal
from batchinv.distributed.qwen3 import (
    qwen3_tp_layout,
    stock_tensor_parallel_qwen3,
    tensor_parallel_qwen3,
    tp_compatible_qwen3,
)
from batchinv.models.qwen3 import Qwen3, Qwen3Config
from batchinv.models.qwen3.ops import with_repeated_kv_heads
from batchinv.shapes import QWEN3_8B_CONFIG as QWEN3_8B

keep_nvlink_multicast_off()  # before any process group

BATCHES = (1, 8, 64)
CONTEXT = 4096
LAYERS = 4
CHECK_STEPS = 1  # the bitwise check's step, before the timed ones
WARMUP, REPS = 5, 30  # steps per variant, the same on every rank
COLUMNS = [
    "case",
    "world",
    "layers",
    "batch",
    "context",
    "batchinv_tp_ms",
    "stock_tp_ms",
    "stock_attention",
    "stock_tp_sdpa_default_ms",
    "batchinv_one_gpu_ms",
    "stock_tp_vs_batchinv_tp",
    "tp_bitwise_one_gpu",
]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--layers", type=positive_int, default=LAYERS)
    parser.add_argument("--batch", type=positive_int, nargs="+", default=list(BATCHES))
    parser.add_argument("--context", type=positive_int, default=CONTEXT)
    parser.add_argument("--world", type=int, default=None, help="GPUs to use (default: all)")
    args = parser.parse_args(argv)
    limit = QWEN3_8B["max_position_embeddings"]
    if capacity(args.context) > limit:
        parser.error(
            f"--context {args.context} + {capacity(args.context) - args.context} steps passes "
            f"max_position_embeddings ({limit})"
        )
    return args


def capacity(context: int) -> int:
    """Cache slots per sequence: the context and every step a variant runs."""
    return context + CHECK_STEPS + WARMUP + REPS


def model_config(layers: int) -> Qwen3Config:
    return Qwen3Config(num_hidden_layers=layers, **QWEN3_8B)


def fill_caches(caches, kv_heads: tuple[int, int], config, context: int, seed: int) -> None:
    """Layer ``i``'s keys and values for positions ``[0, context)``: the kv heads
    ``kv_heads`` of one full draw from ``seed + i``, so every rank's heads are slices of the
    one-GPU cache's."""
    lo, hi = kv_heads
    for i, cache in enumerate(caches):
        generator = torch.Generator(device=cache.device).manual_seed(seed + i)
        shape = (cache.batch, context, config.num_key_value_heads, config.head_dim)
        for storage in (cache.k, cache.v):
            full = torch.randn(shape, generator=generator, device=cache.device, dtype=cache.dtype)
            storage[:, :context].copy_(full[:, :, lo:hi])
        cache.set_lengths(context)


def decode_step(model: Qwen3, caches, tokens: torch.Tensor):
    """One token per sequence: ``(logits, logprob of the greedy pick)``; the pick goes into
    ``tokens`` for the next step."""
    logits = model(tokens[:, None], caches=caches)[:, 0]
    logprobs = model.ops.log_softmax(logits.float())
    picked = logprobs.argmax(dim=-1)
    tokens.copy_(picked)
    return logits, logprobs.gather(-1, picked[:, None])[:, 0]


def stock_sdpa_backend(device: torch.device) -> SDPBackend | None:
    """The SDPA backend the stock step runs under: mem-efficient on CUDA; ``None``
    elsewhere (SDPA's own pick)."""
    return SDPBackend.EFFICIENT_ATTENTION if device.type == "cuda" else None


def pinned_step(backend: SDPBackend | None, step):
    """``step`` run under ``sdpa_kernel([backend])`` (as is when ``backend`` is None)."""

    def run():
        with nullcontext() if backend is None else sdpa_kernel([backend]):
            return step()

    return run


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(step, device: torch.device, *, collective: bool = True) -> float:
    """The median wall time of ``REPS`` steps after ``WARMUP``: the slowest rank's
    (a barrier before, a max after), or this rank's alone with ``collective=False`` (the
    one-GPU variant, which rank 0 runs by itself)."""
    for _ in range(WARMUP):
        step()
    _sync(device)
    if collective:
        dist.barrier()
    times = []
    for _ in range(REPS):
        start = time.perf_counter()
        step()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    median = sorted(times)[len(times) // 2]
    if not collective:
        return median
    slowest = torch.tensor(median, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest)


def measure(rank: int, world: int, args, device: torch.device, config=None):
    """Every rank: the cases' rows and summary (meaningful on rank 0).  ``config`` defaults
    to Qwen3-8B shapes with ``args.layers`` layers."""
    config = model_config(args.layers) if config is None else config
    layout = qwen3_tp_layout(config, world)[rank]
    all_heads = (0, config.num_key_value_heads)
    with torch.no_grad():
        whole = Qwen3(config, random_weights(config, device, seed=0))  # the same on every rank
        tp = tensor_parallel_qwen3(whole)
        stock = stock_tensor_parallel_qwen3(whole)
        stock_default_ops = stock.ops
        stock_anchor_ops = with_repeated_kv_heads(stock.ops)
        one = tp_compatible_qwen3(whole) if rank == 0 else None
        del whole
    backend = stock_sdpa_backend(device)
    rows, summary = [], []
    for batch in args.batch:
        ids = torch.randint(
            0, config.vocab_size, (batch,), generator=torch.Generator().manual_seed(batch)
        )
        ids = ids.to(device)

        def prepared(model, heads, batch=batch, ids=ids):
            caches = model.new_caches(batch, capacity(args.context))
            fill_caches(caches, heads, config, args.context, seed=batch)
            return caches, ids.clone()

        with torch.no_grad():
            tp_caches, tp_tokens = prepared(tp, layout.kv_heads)
            tp_logits, _ = decode_step(tp, tp_caches, tp_tokens)
            equal = torch.zeros(1, dtype=torch.int32, device=device)
            if rank == 0:
                one_caches, one_tokens = prepared(one, all_heads)
                one_logits, _ = decode_step(one, one_caches, one_tokens)
                equal.fill_(int(bitwise_equal(tp_logits, one_logits)))
                del one_logits
            del tp_logits
            dist.broadcast(equal, src=0)  # every rank stops together on a mismatch
            if not bool(equal):
                raise RuntimeError(
                    f"batch {batch}: the TP={world} decode step's logits differ from one GPU's "
                    "(tp_compatible_ops); nothing timed"
                )
            tp_ms = median_ms(partial(decode_step, tp, tp_caches, tp_tokens), device)
            del tp_caches
            stock_caches, stock_tokens = prepared(stock, layout.kv_heads)
            stock.ops = stock_anchor_ops
            stock_step = partial(decode_step, stock, stock_caches, stock_tokens)
            stock_ms = median_ms(pinned_step(backend, stock_step), device)
            del stock_caches, stock_step
            default_ms = None
            if backend is not None:
                stock.ops = stock_default_ops
                stock_caches, stock_tokens = prepared(stock, layout.kv_heads)
                default_ms = median_ms(
                    partial(decode_step, stock, stock_caches, stock_tokens), device
                )
                del stock_caches
            one_ms = None
            if rank == 0:
                one_ms = median_ms(
                    partial(decode_step, one, one_caches, one_tokens), device, collective=False
                )
                del one_caches
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        case = (
            f"B={batch} ctx={args.context}, {config.num_hidden_layers} layers + lm_head "
            f"(Qwen3-8B shapes) T={world}"
        )
        rows.append(
            {
                "case": case,
                "world": world,
                "layers": config.num_hidden_layers,
                "batch": batch,
                "context": args.context,
                "batchinv_tp_ms": tp_ms,
                "stock_tp_ms": stock_ms,
                "stock_attention": "SDPA, kv heads repeated, "
                + ("its own pick" if backend is None else backend.name),
                "stock_tp_sdpa_default_ms": default_ms,
                "batchinv_one_gpu_ms": one_ms,
                "stock_tp_vs_batchinv_tp": stock_ms / tp_ms,
                "tp_bitwise_one_gpu": True,  # checked above: a mismatch raised
            }
        )
        summary.append(
            summary_row(
                "tp_decode",
                case,
                "batchinv TP step (eager)",
                tp_ms,
                f"stock TP step (eager, {rows[-1]['stock_attention']}, NCCL bf16 all_reduce)",
                stock_ms,
            )
        )
        if rank == 0:
            print(rows[-1], flush=True)
    dist.barrier()  # the other ranks wait for rank 0's one-GPU steps before leaving
    return rows, summary


def _run(rank: int, world: int, args, device: torch.device) -> None:
    rows, summary = measure(rank, world, args, device)
    if rank == 0:
        report("tp_decode", rows, COLUMNS, args.json, summary)


def _spawned(rank: int, world: int, rendezvous: str, args) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=rendezvous, rank=rank, world_size=world)
    try:
        _run(rank, world, args, torch.device("cuda", rank))
    finally:
        dist.destroy_process_group()


def _refuse(why: str):
    print(f"bench_tp_decode: {why}; nothing measured, nothing written", file=sys.stderr)
    raise SystemExit(1)


def _check_world(world: int, layers: int, *, torchrun: bool = False) -> None:
    """Refuses (status 1) without 2 GPUs, or a world the GPUs or the layout cannot hold.
    Under torchrun the world is the launcher's (its ranks may span hosts)."""
    present = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if present < (1 if torchrun else 2):
        _refuse(f"tensor parallelism needs 2 or more NVIDIA GPUs, {present} present")
    if world < 2 or (not torchrun and world > present):
        _refuse(f"the world must be 2 or more ranks, one per GPU ({present} present), got {world}")
    try:
        qwen3_tp_layout(model_config(layers), world)
    except ValueError as err:
        _refuse(str(err))


def main(argv=None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ:  # under torchrun
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        _check_world(world, args.layers, torchrun=True)
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl")
        try:
            _run(rank, world, args, torch.device("cuda", local))
        finally:
            dist.destroy_process_group()
        return
    world = args.world if args.world is not None else torch.cuda.device_count()
    _check_world(world, args.layers)
    with tempfile.TemporaryDirectory() as tmp:
        rendezvous = f"file://{Path(tmp) / 'rendezvous'}"
        mp.spawn(_spawned, args=(world, rendezvous, args), nprocs=world, join=True)


if __name__ == "__main__":
    main()

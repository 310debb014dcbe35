"""Tensor parallelism's cost: batchinv's invariant collectives and layers against NCCL's own.

Runs on every GPU of the machine (``--world`` to choose; at least 2), through its own spawn
or ``torchrun --nproc-per-node N benchmarks/bench_tensor_parallel.py``:
- ``invariant_all_reduce`` (all_gather + a fixed tree on every rank) against
  ``dist.all_reduce`` on the same fp32 tensor, rows x 4096 at decode sizes (1, 8, 64 rows)
  and a prefill (2048 rows);
- the row-parallel Qwen3-8B o_proj and down_proj layers at M = 1, 64, 2048, bf16:
  ``batchinv.distributed.row_parallel_linear`` (bitwise one GPU's ``linear_k_groups``)
  against the stock layer (``torch.mm`` of the shard + ``dist.all_reduce`` of bf16 partials,
  which is not bitwise one GPU's).
Every rank runs the same fixed number of iterations (collectives must match), each timed
with CUDA events; a case's time is the slowest rank's median.  Rank 0 prints and writes the
JSON (``world`` in every row).  NVLink multicast stays off (``NCCL_NVLS_ENABLE=0`` etc.).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import keep_nvlink_multicast_off, report, summary_row

from batchinv import K_GROUPS
from batchinv.distributed import (
    invariant_all_reduce,
    k_range,
    node_counts,
    row_parallel_linear,
    shard_k,
)
from batchinv.shapes import QWEN3_8B_CONFIG, QWEN3_8B_LINEAR

keep_nvlink_multicast_off()  # before any process group

REDUCE_ROWS = (1, 8, 64, 2048)
HIDDEN = QWEN3_8B_CONFIG["hidden_size"]
ROW_LAYERS = tuple(layer for layer in QWEN3_8B_LINEAR if layer[0] in ("o_proj", "down_proj"))
ROW_M = (1, 64, 2048)
WARMUP, REPS = 10, 50


def _row_parallel_path(world: int) -> str:
    """Which path ``row_parallel_linear`` takes at ``world`` ranks (the row's label)."""
    if all(count == 1 for count in node_counts(K_GROUPS, world)):
        return "K-group partials + one gather + tree kernel"
    return "K-group partials + node gather + tree"


def _median_ms(fn) -> float:
    """The slowest rank's median of ``REPS`` timed calls (same count on every rank)."""
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    times = []
    for _ in range(REPS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    median = torch.tensor(sorted(times)[len(times) // 2], device="cuda")
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return float(median)


def _bench(rank: int, world: int) -> tuple[list[dict], list[dict]]:
    rows, summary = [], []
    generator = torch.Generator(device="cuda").manual_seed(rank)
    for count in REDUCE_ROWS:
        t = torch.randn(count, HIDDEN, generator=generator, device="cuda")
        stock = torch.zeros_like(t)  # in place: zeros keep the values finite
        ours = _median_ms(lambda t=t: invariant_all_reduce(t))
        theirs = _median_ms(lambda s=stock: dist.all_reduce(s))
        case = f"{count}x{HIDDEN} fp32 T={world}"
        rows.append(_row("invariant_all_reduce", case, world, ours, theirs))
        summary.append(
            summary_row(
                "invariant_all_reduce",
                case,
                "all_gather + fixed tree",
                ours,
                "dist.all_reduce (NCCL)",
                theirs,
                scope="op",
            )
        )
    for name, in_features, out_features in ROW_LAYERS:
        start, stop = k_range(in_features, rank, world)
        weight = torch.randn(out_features, in_features, generator=generator, device="cuda")
        w_shard = shard_k(weight.to(torch.bfloat16), rank, world).contiguous()
        for m in ROW_M:
            x = torch.randn(m, in_features, generator=generator, device="cuda")
            x_shard = x[:, start:stop].to(torch.bfloat16).contiguous()

            def invariant(x_shard=x_shard, w_shard=w_shard, in_features=in_features):
                return row_parallel_linear(x_shard, w_shard, in_features=in_features)

            def stock(x_shard=x_shard, w_shard=w_shard):
                partial = torch.mm(x_shard, w_shard.t())
                dist.all_reduce(partial)
                return partial

            ours, theirs = _median_ms(invariant), _median_ms(stock)
            case = f"{name} M={m} bf16 T={world}"
            rows.append(_row("row_parallel_linear", case, world, ours, theirs))
            summary.append(
                summary_row(
                    "row_parallel_linear",
                    case,
                    _row_parallel_path(world),
                    ours,
                    "torch.mm + dist.all_reduce (bf16)",
                    theirs,
                    scope="op",
                )
            )
    return rows, summary


def _row(op: str, case: str, world: int, ours: float, theirs: float) -> dict:
    return {
        "op": op,
        "case": case,
        "world": world,
        "batchinv_ms": ours,
        "stock_ms": theirs,
        "ratio": theirs / ours,
    }


def _run(rank: int, world: int, json_path: Path | None) -> None:
    rows, summary = _bench(rank, world)
    if rank == 0:
        columns = ["op", "case", "world", "batchinv_ms", "stock_ms", "ratio"]
        report("tensor_parallel", rows, columns, json_path, summary)


def _spawned(rank: int, world: int, rendezvous: str, json_path: Path | None) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=rendezvous, rank=rank, world_size=world)
    try:
        _run(rank, world, json_path)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--world", type=int, default=None, help="GPUs to use (default: all)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs NVIDIA GPUs (torch.cuda.is_available() is False)")
    if "RANK" in os.environ:  # under torchrun
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group("nccl")
        try:
            _run(rank, world, args.json)
        finally:
            dist.destroy_process_group()
        return
    world = args.world or torch.cuda.device_count()
    if world < 2 or world > torch.cuda.device_count():
        print(
            f"note: tensor parallelism needs 2 or more GPUs and at most the "
            f"{torch.cuda.device_count()} present; asked for {world}, nothing measured"
        )
        return
    with tempfile.TemporaryDirectory() as tmp:
        rendezvous = f"file://{Path(tmp) / 'rendezvous'}"
        mp.spawn(_spawned, args=(world, rendezvous, args.json), nprocs=world, join=True)


if __name__ == "__main__":
    main()

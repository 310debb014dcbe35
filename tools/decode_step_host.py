"""Host time, wall time and host syncs of one Qwen3 decode step per op table (the e2e shapes).

The e2e bench's decode case (``benchmarks/bench_qwen3_e2e.py``: Qwen3-8B layer shapes, random
bf16 weights, ``--layers`` layers, batch 64 against KV caches of 4096 tokens, each step
resetting the caches' lengths and running ``final_hidden``), measured three ways per path:

- host / wall ms per step: ``--steps`` steps without a sync (host = until the calls return,
  wall = after the final synchronize), ``--rounds`` rounds;
- the bench's decode row: ``median_ms`` of the step plus that of the lm_head on 64 rows;
- host syncs per step (torch's sync debug mode), and with ``--profile`` the torch.profiler CPU
  table of 5 steps (``--stack``: ``aten::arange`` grouped by Python stack; with torch 2.11 on an
  H200 the groups have come back without stacks).

``--save FILE`` writes the batchinv step's hidden states, to compare two trees bit for bit.
Run it once per tree (old and new code) in the same device call, alternating:

    PYTHONPATH=py python tools/decode_step_host.py --tag new [--profile] [--save new.pt]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from batchinv.host_syncs import count_host_syncs, host_and_wall_seconds

PATHS = ("stock", "batchinv")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tag", default="new", help="label of the tree measured (old / new)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="torch.profiler CPU table")
    parser.add_argument("--stack", action="store_true", help="callers of aten::arange")
    parser.add_argument("--save", type=Path, default=None, help="batchinv hidden states here")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import bench_qwen3_e2e as bench
    from _common import median_ms

    from batchinv.models.qwen3 import Qwen3, Qwen3Config, ops_by_name
    from batchinv.reference.qwen3_chain import lm_head_weight

    device = torch.device("cuda")
    config = Qwen3Config(num_hidden_layers=args.layers, **bench.QWEN3_8B)
    model = Qwen3(config, bench.random_weights(config, device, 0))
    head = lm_head_weight(model.hf_state_dict(), config)
    gen = torch.Generator(device=device).manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (args.batch, 1), device=device, generator=gen)
    caches = bench.filled_caches(model, args.batch, args.context, 2)
    hidden = torch.randn(args.batch, config.hidden_size, device=device).bfloat16()
    print(
        f"{args.tag}: {torch.cuda.get_device_name(device)}, {args.layers} layers, "
        f"B={args.batch}, context {args.context}"
    )

    def step(path: str):
        for cache in caches:
            cache.set_lengths(args.context)
        return model.final_hidden(ids, caches=caches, ops=path)

    with torch.no_grad():
        for path in PATHS:
            for _ in range(5):
                step(path)
            for rnd in range(args.rounds):
                host, wall = (
                    1e3 * t for t in host_and_wall_seconds(lambda path=path: step(path), args.steps)
                )
                print(
                    f"{args.tag} {path} round {rnd}: host {host:.3f} ms/step, "
                    f"wall {wall:.3f} ms/step"
                )
            _, syncs = count_host_syncs(lambda path=path: step(path))
            print(f"{args.tag} {path} syncs per step: {syncs}")
            layers_ms = median_ms(lambda path=path: step(path))
            ops = ops_by_name(path)
            head_ms = median_ms(lambda ops=ops: ops.linear(hidden, head, None))
            print(
                f"{args.tag} {path} decode row: layers {layers_ms:.3f} ms + lm_head "
                f"{head_ms:.3f} ms = {layers_ms + head_ms:.3f} ms"
            )
        if args.save is not None:
            torch.save(step("batchinv").cpu(), args.save)
        if args.profile:
            activities = [torch.profiler.ProfilerActivity.CPU]
            for path in PATHS:
                with torch.profiler.profile(activities=activities, with_stack=args.stack) as prof:
                    for _ in range(5):
                        step(path)
                    torch.cuda.synchronize()
                print(f"== {args.tag} {path}: CPU ops of 5 steps")
                table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22)
                print(table)
                if args.stack:
                    grouped = prof.key_averages(group_by_stack_n=6)
                    rows = [e for e in grouped if e.key == "aten::arange"]
                    for event in sorted(rows, key=lambda e: -e.cpu_time_total)[:6]:
                        print(f"aten::arange x{event.count} {event.cpu_time_total:.0f} us")
                        print("    " + "\n    ".join(event.stack))


if __name__ == "__main__":
    main()

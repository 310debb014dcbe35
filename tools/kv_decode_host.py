"""Host time and host syncs of one KV-cache decode step on CUDA (attention's decode path).

B=64 sequences at context 4096, GQA 32/8, d=128, bf16 (the e2e decode shapes).  Per case:
host us/call (the loop of ``--calls`` calls without a sync), wall us/call (after the final
sync), synchronizing CUDA calls per call (torch's sync debug mode, as the sync tests count
them), then a cProfile and a torch.profiler CPU breakdown of the attention call.

    PYTHONPATH=py python tools/kv_decode_host.py [--calls 200] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import torch

import batchinv
from batchinv.host_syncs import count_host_syncs, host_and_wall_seconds
from batchinv.kv_cache import KVCache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--profile", action="store_true", help="cProfile + torch.profiler")
    args = parser.parse_args()
    dev = torch.device("cuda")
    b, ctx, hq, hkv, d = 64, 4096, 32, 8, 128
    print(torch.cuda.get_device_name(dev))
    cache = KVCache(b, ctx + 2 * (args.calls + 40), hkv, d, dtype=torch.bfloat16, device=dev)
    kv = torch.randn(b, ctx, hkv, d, device=dev).bfloat16()
    cache.append(kv, kv)
    del kv
    q = torch.randn(b, 1, hq, d, device=dev).bfloat16()
    knew = torch.randn(b, 1, hkv, d, device=dev).bfloat16()
    ids_cpu = torch.arange(b)
    ids_gpu = ids_cpu.to(dev)
    cases = {
        "attention_with_kv_cache (seq_ids=None)": lambda: batchinv.attention_with_kv_cache(
            q, knew, knew, cache
        ),
        "attention_with_kv_cache (seq_ids CPU)": lambda: batchinv.attention_with_kv_cache(
            q, knew, knew, cache, ids_cpu
        ),
        "attention_with_kv_cache (seq_ids GPU)": lambda: batchinv.attention_with_kv_cache(
            q, knew, knew, cache, ids_gpu
        ),
        "KVCache.append (seq_ids=None)": lambda: cache.append(knew, knew),
    }
    with torch.no_grad():
        for name, fn in cases.items():
            cache.set_lengths(ctx)
            host, wall = (1e6 * t for t in host_and_wall_seconds(fn, args.calls, warmup=20))
            syncs = count_host_syncs(fn)[1]
            print(f"{name:42s} host {host:7.1f} us/call  wall {wall:7.1f} us/call  syncs {syncs}")
        if args.profile:
            step = cases["attention_with_kv_cache (seq_ids=None)"]
            cache.set_lengths(ctx)
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(50):
                step()
            profiler.disable()
            torch.cuda.synchronize()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(18)
            print(text.getvalue())
            cache.set_lengths(ctx)
            activities = [torch.profiler.ProfilerActivity.CPU]
            with torch.profiler.profile(activities=activities) as prof:
                for _ in range(50):
                    step()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


if __name__ == "__main__":
    main()

"""Host time of one ``gpu.forward`` decode call (decode B=1 @ 32768 is host-bound).

The decode cases of ``benchmarks/bench_attention.py`` (GQA 32/8, d=128, bf16, a prebuilt
layout, ``prefill_zero=False``): per round and case, host us/call (``--calls`` calls without a
sync, after 20 warm-up calls) and wall us/call (after the final sync) of this tree's
``forward``, of ``--old`` (another ``attention.py``, e.g. main's, loaded as a second module of
the same package: the same kernels, the same process) and of SDPA's default decode call;
the order of the two trees alternates between rounds (the host's speed drifts).  Then the
host cost of the three output allocations alone, the bits of both trees (equal), and a
cProfile and a torch.profiler CPU table of each tree's call.

    PYTHONPATH=py python tools/attention_decode_host.py [--old PATH] [--rounds 4] [--json F]
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import io
import json
import pstats
import sys

import torch
import torch.nn.functional as F

from batchinv.contract import assert_bitwise_equal
from batchinv.gpu import attention as gpu
from batchinv.host_syncs import host_and_wall_seconds

HQ, HKV, D = 32, 8, 128
CASES = ((1, 32768), (64, 4096))


def load_old(path: str):
    """``path`` as module ``batchinv.gpu._attention_old`` (its relative imports resolve in
    ``batchinv.gpu``)."""
    spec = importlib.util.spec_from_file_location("batchinv.gpu._attention_old", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def decode_case(module, batch: int, ctx: int, device: torch.device):
    """The bench's decode inputs and a no-argument call of ``module.forward`` on them."""
    gen = torch.Generator(device=device).manual_seed(0)
    k = torch.randn(batch, ctx, HKV, D, device=device, generator=gen).to(torch.bfloat16)
    v = torch.randn(batch, ctx, HKV, D, device=device, generator=gen).to(torch.bfloat16)
    q = torch.randn(batch, 1, HQ, D, device=device, generator=gen).to(torch.bfloat16)
    ar = torch.arange(batch, device=device)
    full = torch.full((batch,), ctx, device=device)
    tensors = (q.view(batch, HQ, D), k.view(-1, HKV, D), v.view(-1, HKV, D))
    sdpa_args = tuple(t.transpose(1, 2).contiguous() for t in (q, k, v))
    scale = gpu.scale_of(None, D)

    def calls_of(mod):
        layout = mod.make_layout(ar, torch.ones(batch, device=device), ar * ctx, full, 1, ctx)

        def call():
            return mod.forward(*tensors, layout, True, scale, prefill_zero=False)

        return call

    def sdpa():
        return F.scaled_dot_product_attention(*sdpa_args, enable_gqa=True)

    return {"new": calls_of(gpu), "old": calls_of(module) if module else None, "sdpa": sdpa}


def alloc_only(batch: int, ctx: int, device: torch.device):
    """The three allocations of a split decode call (out, lse, partials), nothing else."""
    q = torch.empty(batch, HQ, D, dtype=torch.bfloat16, device=device)
    split = -(-ctx // gpu.SPLIT_KEYS)

    def call():
        q.new_empty((batch, HQ, D))
        q.new_empty((HQ, batch), dtype=torch.float32)
        q.new_empty((split, batch, HQ, D + 2), dtype=torch.float32)

    return call


def cprofile_table(fn, calls: int) -> str:
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        fn()
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(14)
    return text.getvalue()


def torch_profile_table(fn, calls: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", help="another attention.py to compare (e.g. main's)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--profile", action="store_true", help="cProfile + torch.profiler")
    parser.add_argument("--json", help="write the rounds here")
    args = parser.parse_args()
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    print(name)
    old = load_old(args.old) if args.old else None
    results = {"device": name, "calls": args.calls, "rounds": []}
    for batch, ctx in CASES:
        calls = decode_case(old, batch, ctx, device)
        label = f"decode B={batch} ctx={ctx}"
        if old is not None:
            assert_bitwise_equal(calls["new"](), calls["old"]())
            print(f"{label}: out and lse of both trees bitwise equal")
        trees = ["new", "old"] if old is not None else ["new"]
        for r in range(args.rounds):
            order = trees if r % 2 == 0 else trees[::-1]
            for tree in [*order, "sdpa", "alloc"]:
                fn = alloc_only(batch, ctx, device) if tree == "alloc" else calls[tree]
                host, wall = (1e6 * t for t in host_and_wall_seconds(fn, args.calls, warmup=20))
                results["rounds"].append(
                    {"case": label, "round": r, "tree": tree, "host_us": host, "wall_us": wall}
                )
                print(f"{label} round {r} {tree:5s} host {host:7.1f} us/call  wall {wall:7.1f}")
        if args.profile:
            for tree in trees:
                print(f"--- {label} {tree}: cProfile, {args.calls} calls")
                print(cprofile_table(calls[tree], args.calls))
                print(f"--- {label} {tree}: torch.profiler CPU, {args.calls} calls")
                print(torch_profile_table(calls[tree], args.calls))
        del calls
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

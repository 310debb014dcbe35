"""Session-7 device probe: host syncs and host time per attention fwd+bwd step for the code on
PYTHONPATH, plus the token_logprobs d_W-row check variants (label "after" only).

Run as ``python3 attention_probe.py LABEL OUT.json``; "before" ran on a copy of ``py/`` whose
four attention modules (gpu/attention.py, gpu/attention_backward.py, ops/attention.py,
reference/attention.py) were those of 8780af1.  Results: the JSON files beside this one
(NVIDIA H200, one call); summarised in docs/tuning/attention.md "Host syncs, measured" and
docs/tuning/token_logprobs.md.  (Lint fixes after the run: the two timed lambdas bind their
loop variables as default arguments; same values.)"""

import json
import sys
import time
import warnings

import torch

import batchinv

label = sys.argv[1]
DEV = "cuda"
results = []


def count_syncs(fn):
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            r = fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return r, sum("synchronizing" in str(w.message) for w in caught)


def make(kind, lengths_device, nseq, seqlen, hq, hkv, d):
    gen = torch.Generator(device=DEV).manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, device=DEV, generator=gen).bfloat16().requires_grad_()

    if kind == "varlen":
        total = nseq * seqlen
        q, k, v = leaf(total, hq, d), leaf(total, hkv, d), leaf(total, hkv, d)
        do = leaf(total, hq, d).detach()
        cu = torch.arange(0, total + 1, seqlen, dtype=torch.int32, device=lengths_device)
        return (lambda: batchinv.attention_varlen(q, k, v, cu, cu, causal=True)), (q, k, v), do
    q, k, v = leaf(nseq, seqlen, hq, d), leaf(nseq, seqlen, hkv, d), leaf(nseq, seqlen, hkv, d)
    do = leaf(nseq, seqlen, hq, d).detach()
    lens = torch.tensor(
        [seqlen - 3 * i for i in range(nseq)], dtype=torch.int32, device=lengths_device
    )
    return (
        (lambda: batchinv.attention(q, k, v, causal=True, seqlens_q=lens, seqlens_k=lens)),
        (q, k, v),
        do,
    )


shapes = [("small 4x64 8/2 d64", 4, 64, 8, 2, 64), ("medium 8x512 16/4 d128", 8, 512, 16, 4, 128)]
for name, nseq, seqlen, hq, hkv, d in shapes:
    for kind in ("varlen", "padded"):
        for ld in ("cuda", "cpu"):
            row = {"label": label, "shape": name, "kind": kind, "lengths": ld}
            try:
                fn, inputs, do = make(kind, ld, nseq, seqlen, hq, hkv, d)
                for _ in range(3):
                    torch.autograd.grad(fn(), inputs, do)
            except Exception as e:  # the old code refuses CPU lengths
                row["refused"] = f"{type(e).__name__}: {str(e)[:90]}"
                results.append(row)
                print(json.dumps(row), flush=True)
                continue
            out, row["fwd_syncs"] = count_syncs(fn)
            _, row["bwd_syncs"] = count_syncs(
                lambda o=out, i=inputs, g=do: torch.autograd.grad(o, i, g)
            )
            del out
            steps = 50
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                torch.autograd.grad(fn(), inputs, do)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            row["host_us_per_step"] = round((t1 - t0) / steps * 1e6, 1)
            row["wall_us_per_step"] = round((t2 - t0) / steps * 1e6, 1)
            results.append(row)
            print(json.dumps(row), flush=True)

if label == "after":
    # token_logprobs backward: the d_W rows check, old (two syncs) vs one sync vs none.
    from batchinv.gpu import token_logprobs as tl

    def one_sync(rows, targets32):
        ignored = targets32 < 0
        if not bool((ignored & ~torch.isfinite(rows).all(dim=1)).any()):
            return rows
        return rows.masked_fill(ignored[:, None], 0)

    def zero_sync(rows, targets32):
        return rows.masked_fill((targets32 < 0)[:, None], 0)

    gen = torch.Generator(device=DEV).manual_seed(1)
    rows = torch.randn(8192, 4096, device=DEV, generator=gen).bfloat16()
    targets = torch.randint(0, 1000, (8192,), device=DEV, generator=gen).int()
    targets[::20] = -1
    for fname, f in (
        ("old", tl._weight_gradient_rows),
        ("one_sync", one_sync),
        ("zero", zero_sync),
    ):
        for _ in range(3):
            f(rows, targets)
        _, syncs = count_syncs(lambda f=f: f(rows, targets))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            f(rows, targets)
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / 20 * 1e6
        row = {"tl_rows_check": fname, "syncs": syncs, "wall_us_incl_sync": round(wall, 1)}
        results.append(row)
        print(json.dumps(row), flush=True)

with open(sys.argv[2], "w") as fh:
    json.dump(results, fh, indent=1)

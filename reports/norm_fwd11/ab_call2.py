# ruff: noqa
"""Issue 6, session 11, device call 2: the branch's op (its *_vec entries) against main's kernels.

Run from the staged tree's root with ``PYTHONPATH=py`` (Liger-Kernel importable), after building
``reports/norm_fwd11/main.cubin`` from main's ``kernels_cu/rms_norm.cu`` (commit 48a63d8):

    python3 reports/norm_fwd11/ab_call2.py OUTDIR ROUNDS

Bits of the op's y / new_residual / rstd against main's kernel on the same inputs (random rows
with NaN, inf and tiny rows), then interleaved rounds of triton ``do_bench`` medians (eager, us)
and ``do_bench_cudagraph`` medians (graph, us): main's kernel, the op, Liger-Kernel (plain bf16)
and a device copy of the same bytes.
"""

from __future__ import annotations

import json
import sys

import torch
import triton.testing as tt

from batchinv import _native
from batchinv.contract import assert_bitwise_equal
from batchinv.gpu import rms_norm as g
from batchinv.gpu._launch import launch

EPS = 1e-6
DEV = torch.device("cuda", 0)
SIG = "ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, f32"
SUFFIX = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
with open("reports/norm_fwd11/main.cubin", "rb") as f:
    MAIN = _native.RawModule(f.read())


def main_launcher(x, w, r):
    rows, d = x.shape
    name, threads, cta = g.geometry(d, x.dtype)
    kind = "fused_forward" if r is not None else "forward"
    kern = MAIN.get_function(f"rms_norm_{kind}_{SUFFIX[x.dtype]}_{name}", signature=SIG)
    y = torch.empty_like(x)
    nr = torch.empty_like(x) if r is not None else None
    rstd = torch.empty(rows, device=DEV)
    args = (
        y,
        nr if nr is not None else 0,
        rstd,
        x,
        r if r is not None else 0,
        w,
        rows,
        d,
        x.stride(0),
        r.stride(0) if r is not None else 0,
        EPS,
    )

    def run():
        launch(kern, DEV, grid=(-(-rows // (cta // threads)),), block=(cta,), args=args)

    return run, ((y, nr, rstd) if r is not None else (y, rstd))


def inputs(rows, d, dtype, fused, specials):
    gen = torch.Generator(device=DEV).manual_seed(rows + d)
    x = (2.0 * torch.randn(rows, d, device=DEV, generator=gen)).to(dtype)
    w = torch.randn(d, device=DEV, generator=gen).to(dtype)
    r = torch.randn(rows, d, device=DEV, generator=gen).to(dtype) if fused else None
    if specials:
        x[1, 3] = float("nan")
        x[2, 5] = float("inf")
        x[3] *= 1e-30
        w[7] = float("nan")
        w[9] = float("-inf")
        if fused:
            r[4, 6] = float("nan")
    return x, w, r


CASES = [
    # (rows, d, dtype, fused, liger)
    (16384, 4096, torch.bfloat16, False, True),
    (1024, 4096, torch.bfloat16, False, True),
    (16384, 4096, torch.bfloat16, True, False),
    (16384, 5120, torch.bfloat16, True, False),
    (16384, 4096, torch.float16, False, False),
    (16384, 4096, torch.float16, True, False),
    (16384, 2048, torch.float32, False, False),
    (16384, 2048, torch.float32, True, False),
]


def bench(fn, graph):
    if graph:
        return 1000.0 * tt.do_bench_cudagraph(fn, rep=40, return_mode="median")
    return 1000.0 * tt.do_bench(fn, warmup=10, rep=40, return_mode="median")


def main():
    out, rounds = sys.argv[1], int(sys.argv[2])
    lines = []

    def log(s):
        print(s, flush=True)
        lines.append(s)

    props = torch.cuda.get_device_properties(0)
    log(f"{props.name} {getattr(props, 'uuid', '')}")
    ok = bad = 0
    for rows, d, dtype, fused, _ in CASES:
        for n, specials in ((rows, False), (1001, True)):
            x, w, r = inputs(n, d, dtype, fused, specials)
            run, ref = main_launcher(x, w, r)
            run()
            got = g.fused_add_forward(x, r, w, EPS) if fused else g.forward(x, w, EPS)
            torch.cuda.synchronize()
            try:
                for a, b in zip(got, ref, strict=True):
                    assert_bitwise_equal(a, b)
                ok += 1
            except AssertionError as error:
                bad += 1
                log(f"BITS DIFFER {n}x{d} {dtype} fused={fused}: {str(error)[:300]}")
    log(f"bits (op vs main's kernel): {ok} equal, {bad} differ")
    results = {}
    for rows, d, dtype, fused, liger in CASES:
        x, w, r = inputs(rows, d, dtype, fused, False)
        fns = {"main": main_launcher(x, w, r)[0]}
        if fused:
            fns["op (branch)"] = lambda: g.fused_add_forward(x, r, w, EPS)
        else:
            fns["op (branch)"] = lambda: g.forward(x, w, EPS)
        if liger:
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction

            fns["Liger"] = lambda: LigerRMSNormFunction.apply(x, w, EPS)
        n = x.numel() * x.element_size() * (2 if fused else 1)
        src = torch.empty(n, dtype=torch.uint8, device=DEV)
        dst = torch.empty_like(src)
        fns["copy"] = lambda: dst.copy_(src)
        for fn in fns.values():
            fn()
        res = {k: {"eager": [], "graph": []} for k in fns}
        for _ in range(rounds):
            for k, fn in fns.items():
                res[k]["eager"].append(round(bench(fn, False), 2))
        for _ in range(2):
            for k, fn in fns.items():
                res[k]["graph"].append(round(bench(fn, True), 2))
        key = f"{rows}x{d} {SUFFIX[dtype]}{' fused' if fused else ''}"
        results[key] = res
        log(f"== {key} (us; eager | graph)")
        for k, v in res.items():
            log(
                f"  {k:12s} {' / '.join(f'{t:.2f}' for t in v['eager'])} | "
                f"{' / '.join(f'{t:.2f}' for t in v['graph'])}"
            )
        with open(f"{out}/ab2.json", "w") as f:
            json.dump(results, f, indent=1)
    with open(f"{out}/ab2.log", "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

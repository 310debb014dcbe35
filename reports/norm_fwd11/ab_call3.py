# ruff: noqa
"""Issue 6, session 11, second round (helper norm-fwd12), device call: bits and paired timings.

Run from the staged tree's root with ``PYTHONPATH=py`` (Liger-Kernel importable), with the
cubins built here (sm_90a, ``nvcc -cubin -O3 -std=c++17 -arch=sm_90a -I kernels_cu``):
``main.cubin`` (main's kernels_cu/rms_norm.cu), ``branch.cubin`` (the branch's rms_norm.cu before
this round, commit 53f941e) and ``exp12.cubin`` (``exp12_rms_norm.cu`` against this round's file):

    python3 reports/norm_fwd11/ab_call3.py OUTDIR EAGER_ROUNDS

Bits: every variant's y / rstd (and new_residual) against the branch's kernel (t64_vec, fused
t64_vec / t128k5_vec; t4 and t128k5: main's entries, which the branch runs) on vector launches:
random rows, rows with NaN / inf / tiny values and special weights, odd row counts, padded row
strides.  Timings: interleaved rounds of triton ``do_bench`` medians (eager, us) and
``do_bench_cudagraph`` medians (graph, us): main's kernel, the branch's kernel, the op of this
build, the variants, Liger-Kernel 0.8.5 and a device copy of the same bytes.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import triton.testing as tt

from batchinv import _native
from batchinv.contract import assert_bitwise_equal
from batchinv.gpu import rms_norm as g
from batchinv.gpu._launch import launch

EPS = 1e-6
DEV = torch.device("cuda", 0)
SIG = "ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, f32"
HERE = "reports/norm_fwd11"
_MODULES = {}


def kernel(image: str, name: str):
    if image not in _MODULES:
        with open(f"{HERE}/{image}.cubin", "rb") as f:
            _MODULES[image] = _native.RawModule(f.read())
    return _MODULES[image].get_function(name, signature=SIG)


# (d, fused) -> (main entry, branch (image, entry)), geometry (T, G, R)
BASE = {
    (4096, False): ("rms_norm_forward_bf16_t64", "rms_norm_forward_bf16_t64_vec", (64, 2, 1)),
    (128, False): ("rms_norm_forward_bf16_t4", "rms_norm_forward_bf16_t4", (4, 32, 1)),
    (5120, False): ("rms_norm_forward_bf16_t128k5", "rms_norm_forward_bf16_t128k5", (128, 1, 1)),
    (4096, True): (
        "rms_norm_fused_forward_bf16_t64",
        "rms_norm_fused_forward_bf16_t64_vec",
        (64, 2, 1),
    ),
    (5120, True): (
        "rms_norm_fused_forward_bf16_t128k5",
        "rms_norm_fused_forward_bf16_t128k5_vec",
        (128, 1, 1),
    ),
}

# (d, fused) -> [(label, exp12 entry, T, G, R)]
VARIANTS = {
    (4096, False): [
        ("t64 vec b2 m5 (restructured)", "x12_t64_g2_r1_b2_m5", 64, 2, 1),
        ("t64 vec b1 m5 (op)", "x12_t64_g2_r1_b1_m5", 64, 2, 1),
        ("t64 vec b1 m6", "x12_t64_g2_r1_b1_m6", 64, 2, 1),
        ("t64 vec named bar m5", "x12_t64_g2_r1_n_m5", 64, 2, 1),
        ("t64 vec 1 row/CTA b1 m10", "x12_t64_g1_r1_b1_m10", 64, 1, 1),
        ("t64 vec 2 rows/group b1 m4", "x12_t64_g2_r2_b1_m4", 64, 2, 2),
        ("t64 vec 2 rows/group b1 m3", "x12_t64_g2_r2_b1_m3", 64, 2, 2),
    ],
    (128, False): [
        ("t4 vec m9", "x12_t4_g32_r1_m9", 4, 32, 1),
        ("t4 vec 2 rows/group m7 (op)", "x12_t4_g32_r2_m7", 4, 32, 2),
        ("t4 vec 2 rows/group m6", "x12_t4_g32_r2_m6", 4, 32, 2),
        ("t4 vec 4 rows/group m4", "x12_t4_g32_r4_m4", 4, 32, 4),
        ("t4 vec 4 rows/group", "x12_t4_g32_r4_m1", 4, 32, 4),
        ("t4 vec 16 groups 2 rows m14", "x12_t4_g16_r2_m14", 4, 16, 2),
    ],
    (5120, False): [("t128k5 vec b1 m8", "x12_t128k5_g1_r1_b1_m8", 128, 1, 1)],
    (4096, True): [
        ("fused t64 vec b2 m4 (restructured)", "x12_fused_t64_g2_r1_b2_m4", 64, 2, 1),
        ("fused t64 vec b1 m4 (op)", "x12_fused_t64_g2_r1_b1_m4", 64, 2, 1),
    ],
    (5120, True): [
        ("fused t128k5 vec b2 m6 (restructured)", "x12_fused_t128k5_g1_r1_b2_m6", 128, 1, 1),
        ("fused t128k5 vec b1 m6 (op)", "x12_fused_t128k5_g1_r1_b1_m6", 128, 1, 1),
    ],
}


def launcher(kern, threads, groups, rows_per_group, x, w, residual=None):
    rows, d = x.shape
    y = torch.empty(rows, d, dtype=x.dtype, device=DEV)
    rstd = torch.empty(rows, dtype=torch.float32, device=DEV)
    new_residual = torch.empty_like(y) if residual is not None else None
    args = (
        y,
        new_residual if new_residual is not None else 0,
        rstd,
        x,
        residual if residual is not None else 0,
        w,
        rows,
        d,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        EPS,
    )
    grid = (-(-rows // (groups * rows_per_group)),)
    block = (threads * groups,)

    def run():
        launch(kern, DEV, grid=grid, block=block, args=args)

    outs = (y, rstd) if residual is None else (y, new_residual, rstd)
    return run, outs


def make_inputs(rows, d, seed, stride=None, specials=False, fused=False):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    width = stride or d
    x = (2.0 * torch.randn(rows, width, device=DEV, generator=gen)).to(torch.bfloat16)[:, :d]
    w = torch.randn(d, device=DEV, generator=gen).to(torch.bfloat16)
    r = None
    if fused:
        r = torch.randn(rows, width, device=DEV, generator=gen).to(torch.bfloat16)[:, :d]
    if specials:
        x[1 % rows, 3] = float("nan")
        x[2 % rows, 5] = float("inf")
        x[3 % rows] *= 1e-30
        x[(rows - 1), 7] = float("nan")  # the last row (an odd half of a pair)
        bits = w.view(torch.int16)
        w[7] = float("nan")
        w[9] = float("inf")
        w[10] = float("-inf")
        bits[11] = -63  # 0xffc1
        w[12] = 0.0
        w[13] = -0.0
        if fused:
            r[4 % rows, 6] = float("nan")
            r[5 % rows, 8] = -float("inf")
    return x, w, r


BIT_CASES = {
    4096: [
        (16384, None, False),
        (1001, None, True),
        (77, 4104, True),
        (33, None, False),
        (1, None, True),
    ],
    128: [
        (524288, None, False),
        (999, None, True),
        (77, 136, True),
        (35, None, False),
        (97, None, True),
        (1, None, True),
    ],
    5120: [(4099, None, False), (333, None, True), (77, 5128, True)],
}


def base_run(d, fused, x, w, r):
    _, entry, (t, gr, rr) = BASE[(d, fused)]
    return launcher(kernel("branch", entry), t, gr, rr, x, w, r)


def check_bits(log):
    ok = bad = 0
    for (d, fused), variants in VARIANTS.items():
        for rows, stride, specials in BIT_CASES[d]:
            x, w, r = make_inputs(rows, d, rows + d, stride, specials, fused)
            ref_run, ref = base_run(d, fused, x, w, r)
            ref_run()
            cands = [("op (this build)", None, 0, 0, 0)] + variants
            for label, entry, t, gr, rr in cands:
                if entry is None:
                    outs = g.fused_add_forward(x, r, w, EPS) if fused else g.forward(x, w, EPS)
                else:
                    run, outs = launcher(kernel("exp12", entry), t, gr, rr, x, w, r)
                    run()
                torch.cuda.synchronize()
                tag = f"d={d} fused={fused} rows={rows} stride={stride} specials={specials} {label}"
                try:
                    for got, want in zip(outs, ref):
                        assert_bitwise_equal(got.reshape(want.shape), want)
                    ok += 1
                except AssertionError as error:
                    bad += 1
                    log(f"BITS DIFFER {tag}: {str(error)[:300]}")
    log(f"bits: {ok} equal, {bad} differ (against the branch's kernels)")


def bench(fn, graph):
    if graph:
        return 1000.0 * tt.do_bench_cudagraph(fn, rep=40, return_mode="median")
    return 1000.0 * tt.do_bench(fn, warmup=10, rep=40, return_mode="median")


SHAPES = [
    # (rows, d, fused, variant labels (None: all))
    (16384, 4096, False, None),
    (524288, 128, False, None),
    (1024, 4096, False, ["t64 vec b1 m5 (op)", "t64 vec 2 rows/group b1 m4"]),
    (16384, 5120, False, None),
    (16384, 4096, True, None),
    (16384, 5120, True, None),
]


def timing_fns(rows, d, fused, labels):
    x, w, r = make_inputs(rows, d, 0, fused=fused)
    main_entry, branch_entry, (t, gr, rr) = BASE[(d, fused)]
    fns = {}
    fns["main"] = launcher(kernel("main", main_entry), t, gr, rr, x, w, r)[0]
    if branch_entry != main_entry:
        fns["branch"] = launcher(kernel("branch", branch_entry), t, gr, rr, x, w, r)[0]
    if fused:
        fns["op (this build)"] = lambda: g.fused_add_forward(x, r, w, EPS)
    else:
        fns["op (this build)"] = lambda: g.forward(x, w, EPS)
    for label, entry, vt, vg, vr in VARIANTS[(d, fused)]:
        if labels is None or label in labels:
            fns[label] = launcher(kernel("exp12", entry), vt, vg, vr, x, w, r)[0]
    if not fused:
        try:
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction

            fns["Liger"] = lambda: LigerRMSNormFunction.apply(x, w, EPS)
            fns["Liger"]()
        except Exception as error:  # noqa: BLE001
            print(f"Liger skipped: {error}")
            fns.pop("Liger", None)
    n = x.numel() * x.element_size() * (2 if fused else 1)
    src = torch.empty(n, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    fns["copy"] = lambda: dst.copy_(src)
    return fns


def main():
    out = sys.argv[1]
    rounds = int(sys.argv[2])
    lines = []

    def log(s):
        print(s, flush=True)
        lines.append(s)

    props = torch.cuda.get_device_properties(0)
    log(f"{props.name} {getattr(props, 'uuid', '')} SMs {props.multi_processor_count}")
    t0 = time.time()
    check_bits(log)
    log(f"bits took {time.time() - t0:.1f} s")
    results = {}
    for rows, d, fused, labels in SHAPES:
        fns = timing_fns(rows, d, fused, labels)
        key = f"{rows}x{d}{' fused' if fused else ''}"
        res = {label: {"eager": [], "graph": []} for label in fns}
        for fn in fns.values():
            fn()
        torch.cuda.synchronize()
        for _ in range(rounds):
            for label, fn in fns.items():
                res[label]["eager"].append(round(bench(fn, False), 2))
        for _ in range(2):
            for label, fn in fns.items():
                try:
                    res[label]["graph"].append(round(bench(fn, True), 2))
                except Exception as error:  # noqa: BLE001
                    res[label]["graph"].append(None)
                    print(f"graph {label}: {error}")
        results[key] = res
        log(f"== {key} (us; eager rounds | graph rounds) t={time.time() - t0:.0f}s")
        for label, v in res.items():
            log(
                f"  {label:38s} {' / '.join(f'{t:.2f}' for t in v['eager'])} | "
                f"{' / '.join(f'{t:.2f}' if t else '-' for t in v['graph'])}"
            )
        with open(f"{out}/ab3.json", "w") as f:
            json.dump(results, f, indent=1)
        with open(f"{out}/ab3.log", "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

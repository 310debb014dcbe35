# ruff: noqa
"""Issue 6, session 11, device call 1: bits and paired timings of the forward variants.

Run from the staged tree's root with ``PYTHONPATH=py`` (Liger-Kernel importable), after building
``reports/norm_fwd11/main.cubin`` (main's ``kernels_cu/rms_norm.cu``, commit 48a63d8) and
``reports/norm_fwd11/exp.cubin`` (``exp_rms_norm.cu`` against the branch's file):

    python3 reports/norm_fwd11/ab_call1.py OUTDIR ROUNDS

Bits: every same-tree variant's y / rstd (and new_residual) against main's kernel, on random rows,
rows with NaN and inf (x and weight), odd row counts; "both" variants also on element launches
(row stride not a multiple of 8).  Timings: interleaved rounds of triton ``do_bench`` medians
(eager, us) and ``do_bench_cudagraph`` medians (graph, us) of main's kernel, the op of this build,
the variants, Liger-Kernel 0.8.5 and a device copy of the same bytes.
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


# geometry of main's entries: d -> (name, T, rows per CTA)
MAIN = {4096: ("t64", 64, 2), 128: ("t4", 4, 32), 5120: ("t128k5", 128, 1)}

# (d, fused) -> [(label, exp entry, T, rows per CTA, same tree as main, takes element launches)]
VARIANTS = {
    (4096, False): [
        ("t64 vec", "exp_t64_vec_h0", 64, 2, True, False),
        ("t64 vec minb5", "exp_t64_vec_h0_m5", 64, 2, True, False),
        ("t64 vec minb6", "exp_t64_vec_h0_m6", 64, 2, True, False),
        ("t64 vec minb7", "exp_t64_vec_h0_m7", 64, 2, True, False),
        ("t64 vec minb6 x no-L1", "exp_t64_vec_h1_m6", 64, 2, True, False),
        ("t64 vec minb6 x L2 evict_first", "exp_t64_vec_h2_m6", 64, 2, True, False),
        ("t64 vec minb6 y st.cs", "exp_t64_vec_h4_m6", 64, 2, True, False),
        ("t64 vec minb6 w evict_last", "exp_t64_vec_h8_m6", 64, 2, True, False),
        ("t64 vec minb6 all hints", "exp_t64_vec_h15_m6", 64, 2, True, False),
        ("t64 vec minb6 loads in order", "exp_t64_vec_h16_m6", 64, 2, True, False),
        ("t64 vec minb5 loads in order", "exp_t64_vec_h16_m5", 64, 2, True, False),
        ("t64 both minb6", "exp_t64_both_h0_m6", 64, 2, True, True),
        ("t64 both minb5", "exp_t64_both_h0_m5", 64, 2, True, True),
        ("t64 both-light minb6", "exp_t64_bothlight_h0_m6", 64, 2, True, True),
        ("t64 both-light minb5", "exp_t64_bothlight_h0_m5", 64, 2, True, True),
        ("t256k2 vec (Liger's shape)", "exp_t256k2_vec_h0", 256, 1, False, False),
        ("t128k4 vec", "exp_t128k4_vec_h0", 128, 1, False, False),
        ("t128k4 vec 2 rows/CTA minb4", "exp_t128k4g2_vec_h0_m4", 128, 2, False, False),
    ],
    (128, False): [
        ("t4 vec", "exp_t4_vec_h0", 4, 32, True, False),
        ("t4 vec minb9", "exp_t4_vec_h0_m9", 4, 32, True, False),
        ("t4 vec minb10", "exp_t4_vec_h0_m10", 4, 32, True, False),
        ("t4 vec minb9 x no-L1", "exp_t4_vec_h1_m9", 4, 32, True, False),
        ("t4 vec minb9 y st.cs", "exp_t4_vec_h4_m9", 4, 32, True, False),
        ("t4 vec minb9 loads in order", "exp_t4_vec_h16_m9", 4, 32, True, False),
        ("t4 both minb9", "exp_t4_both_h0_m9", 4, 32, True, True),
        ("t4 both", "exp_t4_both_h0_m1", 4, 32, True, True),
    ],
    (5120, False): [
        ("t128k5 vec", "exp_t128k5_vec_h0", 128, 1, True, False),
        ("t128k5 vec minb8", "exp_t128k5_vec_h0_m8", 128, 1, True, False),
        ("t128k5 vec minb8 loads in order", "exp_t128k5_vec_h16_m8", 128, 1, True, False),
        ("t128k5 both minb8", "exp_t128k5_both_h0_m8", 128, 1, True, True),
        ("t128k5 both", "exp_t128k5_both_h0_m1", 128, 1, True, True),
    ],
    (4096, True): [
        ("fused t64 vec minb4", "exp_fused_t64_vec_h0_m4", 64, 2, True, False),
        ("fused t64 both minb4", "exp_fused_t64_both_h0_m4", 64, 2, True, True),
    ],
    (128, True): [("fused t4 vec minb8", "exp_fused_t4_vec_h0_m8", 4, 32, True, False)],
    (5120, True): [("fused t128k5 vec minb6", "exp_fused_t128k5_vec_h0_m6", 128, 1, True, False)],
}


def launcher(kern, threads, per_cta, x, w, residual=None):
    """A closure running one forward entry; returns (run, outputs)."""
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
    grid = (-(-rows // per_cta),)
    block = (threads * per_cta,)

    def run():
        launch(kern, DEV, grid=grid, block=block, args=args)

    outs = (y, rstd) if residual is None else (y, new_residual, rstd)
    return run, outs


def main_kernel(d, fused):
    name = MAIN[d][0]
    kind = "fused_forward" if fused else "forward"
    return kernel("main", f"rms_norm_{kind}_bf16_{name}")


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
        x[3 % rows] *= 1e-30  # tiny rows: subnormal squares
        bits = w.view(torch.int16)
        w[7] = float("nan")
        w[9] = float("inf")
        w[10] = float("-inf")
        bits[11] = -63  # 0xffc1: a negative NaN with a payload
        w[12] = 0.0
        w[13] = -0.0
        if fused:
            r[4 % rows, 6] = float("nan")
            r[5 % rows, 8] = -float("inf")
    return x, w, r


BIT_CASES = {
    # d: [(rows, row stride or None, specials)]
    4096: [(16384, None, False), (1001, None, True), (77, 4097, True), (33, 4104, False)],
    128: [(524288, None, False), (999, None, True), (77, 129, True), (35, 136, False)],
    5120: [(4099, None, False), (333, None, True), (77, 5121, True)],
}


def check_bits(log):
    ok = bad = 0
    summary = []
    for (d, fused), variants in VARIANTS.items():
        for rows, stride, specials in BIT_CASES[d]:
            element = stride is not None and stride % 8 != 0
            x, w, r = make_inputs(rows, d, rows + d, stride, specials, fused)
            name, threads, per_cta = MAIN[d]
            ref_run, ref = launcher(main_kernel(d, fused), threads, per_cta, x, w, r)
            ref_run()
            # the op of this build (embedded kernels) as one more variant
            cands = [("op (this build)", None, threads, per_cta, True, True)] + variants
            for label, entry, t, per, same_tree, takes_element in cands:
                if element and not takes_element:
                    continue
                if entry is None:
                    if fused:
                        outs = g.fused_add_forward(x, r, w, EPS)
                    else:
                        outs = g.forward(x, w, EPS)
                else:
                    run, outs = launcher(kernel("exp", entry), t, per, x, w, r)
                    run()
                torch.cuda.synchronize()
                tag = f"d={d} fused={fused} rows={rows} stride={stride} specials={specials} {label}"
                if not same_tree:
                    diff = int((outs[0].view(torch.int16) != ref[0].view(torch.int16)).sum())
                    rdiff = int((outs[-1].view(torch.int32) != ref[-1].view(torch.int32)).sum())
                    summary.append(
                        f"other tree {tag}: y differs in {diff} elements, rstd in {rdiff} rows"
                    )
                    continue
                try:
                    for got, want in zip(outs, ref):
                        assert_bitwise_equal(got.reshape(want.shape), want)
                    ok += 1
                except AssertionError as error:
                    bad += 1
                    log(f"BITS DIFFER {tag}: {str(error)[:300]}")
    for line in summary[:12]:
        log(line)
    log(f"bits: {ok} equal, {bad} differ")
    return bad == 0


def bench(fn, graph):
    if graph:
        return 1000.0 * tt.do_bench_cudagraph(fn, rep=40, return_mode="median")
    return 1000.0 * tt.do_bench(fn, warmup=10, rep=40, return_mode="median")


def liger_fn(x, w):
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    return lambda: LigerRMSNormFunction.apply(x, w, EPS)


SHAPES = [
    # (rows, d, fused, variant labels to time (None: all), graph rounds)
    (16384, 4096, False, None),
    (
        1024,
        4096,
        False,
        [
            "t64 vec",
            "t64 vec minb5",
            "t64 vec minb6",
            "t64 both minb6",
            "t64 both minb5",
            "t64 both-light minb6",
            "t256k2 vec (Liger's shape)",
            "t128k4 vec",
        ],
    ),
    (524288, 128, False, None),
    (16384, 5120, False, None),
    (16384, 4096, True, None),
    (524288, 128, True, None),
    (16384, 5120, True, None),
]


def timing_rows(rows, d, fused, labels):
    x, w, r = make_inputs(rows, d, 0, fused=fused)
    name, threads, per_cta = MAIN[d]
    fns = {}
    fns["main " + name] = launcher(main_kernel(d, fused), threads, per_cta, x, w, r)[0]
    if fused:
        fns["op (this build)"] = lambda: g.fused_add_forward(x, r, w, EPS)
    else:
        fns["op (this build)"] = lambda: g.forward(x, w, EPS)
    for label, entry, t, per, _, _ in VARIANTS[(d, fused)]:
        if labels is None or label in labels:
            fns[label] = launcher(kernel("exp", entry), t, per, x, w, r)[0]
    if not fused:
        try:
            fns["Liger"] = liger_fn(x, w)
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
        fns = timing_rows(rows, d, fused, labels)
        key = f"{rows}x{d}{' fused' if fused else ''}"
        res = {label: {"eager": [], "graph": []} for label in fns}
        for fn in fns.values():
            fn()
        torch.cuda.synchronize()
        for _ in range(rounds):
            for label, fn in fns.items():
                res[label]["eager"].append(round(bench(fn, False), 2))
        graph_rounds = 2 if rows * d >= 16384 * 4096 else 3
        for _ in range(graph_rounds):
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
                f"  {label:36s} {' / '.join(f'{t:.2f}' for t in v['eager'])} | "
                f"{' / '.join(f'{t:.2f}' if t else '-' for t in v['graph'])}"
            )
        with open(f"{out}/ab.json", "w") as f:
            json.dump(results, f, indent=1)
    with open(f"{out}/ab.log", "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

"""Issue 6, session 10, device call 1: bits and paired timings of the fused backward variants.

Run from the repository root with ``PYTHONPATH=py`` after building
``reports/norm_bwd/exp.cubin`` (see ``exp_rms_norm.cu``).  Modes:

- ``ab``: every variant's ``grad_x`` and first-level partials against main's (the build's
  embedded entries), then interleaved rounds of ``do_bench`` medians (us) of main, the variants,
  the op's whole backward, the ``grad_x``-only kernel and a copy of the bytes moved.
- ``ncu_full``: one launch each of main's fused ``t128k5`` (16384 x 5120) and ``t4``
  (524288 x 128) kernels, for ``ncu --set full``.
- ``ncu_seq``: the op's backward once per shape, for per-kernel durations under ``ncu``.
"""

from __future__ import annotations

import json
import sys

import torch

from batchinv import _native
from batchinv.contract import assert_bitwise_equal
from batchinv.gpu import rms_norm as g
from batchinv.gpu._launch import allow_dynamic_shared, kernel_for, launch

EPS = 1e-6
DEV = torch.device("cuda", 0)
FUSED_SIG = "ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64"
REDUCE_SIG = "ptr, ptr, i64, i64"
SUFFIX = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
_MODULE = None


def exp_kernel(name: str, sig: str = FUSED_SIG):
    global _MODULE
    if _MODULE is None:
        with open("reports/norm_bwd/exp.cubin", "rb") as f:
            _MODULE = _native.RawModule(f.read())
    return _MODULE.get_function(name, signature=sig)


def inputs(rows, d, dtype, stride=None, residual=False, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    width = stride or d
    x = torch.randn(rows, width, device=DEV, generator=gen).to(dtype)[:, :d]
    w = torch.randn(d, device=DEV, generator=gen).to(dtype)
    dy = torch.randn(rows, d, device=DEV, generator=gen).to(dtype)
    extra = torch.randn(rows, d, device=DEV, generator=gen).to(dtype) if residual else None
    _, rstd = g.forward(x, w, EPS)
    return x, w, dy, rstd, extra


def fused_launcher(kernel, rows, d, dtype, x, w, dy, rstd, extra, shared=0):
    """A closure launching one fused level-1 kernel of 1 x 16 / 32 x 1 rows per CTA."""
    name, threads, cta = g.backward_geometry(d, dtype)
    groups, seq = g.weight_grad_chunking(d, dtype, min(rows, 1))
    blocks = -(-rows // (groups * seq))
    grad_x = torch.empty(rows, d, dtype=dtype, device=DEV)
    partials = torch.empty(blocks, d, dtype=torch.float32, device=DEV)
    if shared:
        allow_dynamic_shared(kernel, shared, 0)
    args = (
        grad_x,
        partials,
        dy,
        x,
        w,
        rstd,
        extra if extra is not None else 0,
        rows,
        d,
        x.stride(0),
    )

    def run():
        launch(kernel, DEV, grid=(blocks,), block=(cta,), args=args, shared_mem=shared)

    return run, grad_x, partials


def main_fused(dtype, d):
    name, _, _ = g.backward_geometry(d, dtype)
    return kernel_for("rms_norm", f"rms_norm_backward_weight_grad_{SUFFIX[dtype]}_{name}", DEV)


STAGED_K5 = 2 * 2 * 128 * 5 * 16
VARIANTS = {
    # (dtype, d): [(label, kernel name in exp.cubin, dynamic shared bytes)]
    (torch.bfloat16, 5120): [
        ("main (exp image)", "rms_norm_backward_weight_grad_bf16_t128k5", 0),
        ("lb5", "exp_bf16_t128k5_lb5", 0),
        ("staged", "exp_bf16_t128k5_staged", STAGED_K5),
    ],
    (torch.float16, 5120): [("staged", "exp_f16_t128k5_staged", STAGED_K5)],
    (torch.bfloat16, 128): [
        ("fresh", "exp_bf16_t4_fresh", 0),
        ("fresh lb7", "exp_bf16_t4_fresh_lb7", 0),
        ("lb8", "exp_bf16_t4_lb8", 0),
        ("fresh lb8", "exp_bf16_t4_fresh_lb8", 0),
    ],
    (torch.float16, 128): [("fresh", "exp_f16_t4_fresh", 0)],
    (torch.float32, 64): [("fresh", "exp_f32_t4_fresh", 0)],
}

BIT_CASES = {
    # (dtype, d): [(rows, row stride or None, residual gradient)]
    (torch.bfloat16, 5120): [
        (16384, None, False),
        (67, None, False),
        (1001, None, True),
        (333, 5128, False),
        (77, 5121, True),
    ],
    (torch.float16, 5120): [(16384, None, False), (1001, None, True), (77, 5121, False)],
    (torch.bfloat16, 128): [
        (524288, None, False),
        (1001, None, False),
        (999, None, True),
        (333, 136, False),
        (77, 129, True),
    ],
    (torch.float16, 128): [(70001, None, True), (77, 129, False)],
    (torch.float32, 64): [(70001, None, True), (77, 65, False)],
}


def check_bits(log):
    ok = bad = 0
    for (dtype, d), cases in BIT_CASES.items():
        for rows, stride, residual in cases:
            x, w, dy, rstd, extra = inputs(rows, d, dtype, stride, residual, seed=rows)
            ref, ref_gx, ref_p = fused_launcher(
                main_fused(dtype, d), rows, d, dtype, x, w, dy, rstd, extra
            )
            ref()
            for label, kname, shared in VARIANTS[(dtype, d)]:
                run, gx, p = fused_launcher(
                    exp_kernel(kname), rows, d, dtype, x, w, dy, rstd, extra, shared
                )
                run()
                torch.cuda.synchronize()
                tag = f"{dtype} d={d} rows={rows} stride={stride} residual={residual} {label}"
                try:
                    assert_bitwise_equal(gx, ref_gx)
                    assert_bitwise_equal(p, ref_p)
                    ok += 1
                except AssertionError as error:
                    bad += 1
                    log(f"BITS DIFFER {tag}: {str(error)[:300]}")
    # The split reduce level against main's, on random partial rows.
    for n, d in ((16384, 128), (5000, 130), (8193, 1000), (4097, 4096)):
        gen = torch.Generator(device=DEV).manual_seed(n)
        parts = torch.randn(n, d, device=DEV, generator=gen)
        parts[::7] = 0.0
        parts[1::11] = -0.0
        chunks = -(-n // 64)
        a = torch.empty(chunks, d, device=DEV)
        b = torch.empty(chunks, d, device=DEV)
        launch(
            kernel_for("rms_norm", "rms_norm_weight_grad_reduce", DEV),
            DEV,
            grid=(chunks, -(-d // 256)),
            block=(256,),
            args=(a, parts, n, d),
        )
        launch(
            exp_kernel("exp_weight_grad_reduce_split", REDUCE_SIG),
            DEV,
            grid=(chunks, -(-d // 64)),
            block=(256,),
            args=(b, parts, n, d),
        )
        torch.cuda.synchronize()
        try:
            assert_bitwise_equal(b, a)
            ok += 1
        except AssertionError as error:
            bad += 1
            log(f"BITS DIFFER reduce {n} x {d}: {str(error)[:300]}")
    log(f"bits: {ok} equal, {bad} differ")
    return bad == 0


def sequence(level1, partials, d, dtype, reduce_split=False):
    """The op's levels after ``level1`` as gpu.rms_norm.backward launches them (programmatic)."""
    n = partials.shape[0]
    out = torch.empty(d, dtype=dtype, device=DEV)
    steps = []
    src = partials
    while src.shape[0] > 4096:
        chunks = -(-src.shape[0] // 64)
        dst = torch.empty(chunks, d, device=DEV)
        if reduce_split:
            k, grid = exp_kernel("exp_weight_grad_reduce_split", REDUCE_SIG), (chunks, -(-d // 64))
        else:
            k = kernel_for("rms_norm", "rms_norm_weight_grad_reduce", DEV)
            grid = (chunks, -(-d // 256))
        steps.append((k, grid, (256,), (dst, src, src.shape[0], d)))
        src = dst
    last = kernel_for("rms_norm", f"rms_norm_weight_grad_last_levels_{SUFFIX[dtype]}", DEV)
    steps.append((last, (-(-d // 32),), (512,), (out, src, src.shape[0], d)))
    del n

    def run():
        level1()
        for k, grid, block, args in steps:
            launch(k, DEV, grid=grid, block=block, args=args, programmatic=True)

    return run, out


def launch_fn(kernel, grid, block, args, shared=0):
    def run():
        launch(kernel, DEV, grid=grid, block=block, args=args, shared_mem=shared)

    return run


def shape_fns(dtype, d, rows):
    """The timed closures of one shape, by label."""
    x, w, dy, rstd, _ = inputs(rows, d, dtype)
    name, threads, cta = g.backward_geometry(d, dtype)
    fns = {}
    main_run, _, main_p = fused_launcher(main_fused(dtype, d), rows, d, dtype, x, w, dy, rstd, None)
    fns["main level 1"] = main_run
    variant_p = {}
    for label, kname, shared in VARIANTS[(dtype, d)]:
        run, _, p = fused_launcher(exp_kernel(kname), rows, d, dtype, x, w, dy, rstd, None, shared)
        fns[f"{label} level 1"] = run
        variant_p[label] = (run, p)
    for label, (run, p) in variant_p.items():
        if label in ("staged", "lb5", "fresh", "fresh lb7"):
            fns[f"{label} + levels"] = sequence(run, p, d, dtype)[0]
    fns["op backward (all levels)"] = lambda: g.backward(dy, x, w, rstd)
    fns["main + levels (emulated)"] = sequence(main_run, main_p, d, dtype)[0]
    if main_p.shape[0] > 4096:
        fns["main + split reduce"] = sequence(main_run, main_p, d, dtype, True)[0]
        for label in ("fresh", "fresh lb7"):
            run, p = variant_p[label]
            fns[f"{label} + split reduce"] = sequence(run, p, d, dtype, True)[0]
        chunks = -(-main_p.shape[0] // 64)
        reduced = torch.empty(chunks, d, device=DEV)
        args = (reduced, main_p, main_p.shape[0], d)
        fns["reduce level alone"] = launch_fn(
            kernel_for("rms_norm", "rms_norm_weight_grad_reduce", DEV),
            (chunks, -(-d // 256)),
            (256,),
            args,
        )
        fns["split reduce alone"] = launch_fn(
            exp_kernel("exp_weight_grad_reduce_split", REDUCE_SIG),
            (chunks, -(-d // 64)),
            (256,),
            args,
        )
    gx = torch.empty(rows, d, dtype=dtype, device=DEV)
    fns["grad_x-only kernel"] = launch_fn(
        kernel_for("rms_norm", f"rms_norm_backward_{SUFFIX[dtype]}_{name}", DEV),
        (-(-rows // (cta // threads)),),
        (cta,),
        (gx, dy, x, w, rstd, 0, rows, d, x.stride(0)),
    )
    nbytes = 3 * rows * d * x.element_size() // 2
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    fns["copy of the bytes moved"] = lambda: dst.copy_(src)
    return fns


def timing(log, rounds):
    from triton.testing import do_bench

    results = {}
    shapes = [
        (torch.bfloat16, 5120, 16384),
        (torch.bfloat16, 128, 524288),
        (torch.float16, 5120, 16384),
    ]
    for dtype, d, rows in shapes:
        fns = shape_fns(dtype, d, rows)
        table = {label: [] for label in fns}
        for _ in range(rounds):
            for label, fn in fns.items():
                ms = do_bench(fn, warmup=20, rep=60, return_mode="median")
                table[label].append(round(1000 * ms, 1))
        key = f"{rows} x {d} {dtype}"
        results[key] = table
        copy = sorted(table["copy of the bytes moved"])[rounds // 2]
        log(f"\n{key} (us; ratio: median copy / median)")
        for label, times in table.items():
            med = sorted(times)[rounds // 2]
            log(f"  {label:32s} {' / '.join(f'{t:.1f}' for t in times)}  ({copy / med:.3f})")
        del fns
        torch.cuda.empty_cache()
    return results


def main():
    mode = sys.argv[1]
    out = sys.argv[2] if len(sys.argv) > 2 else "."
    lines = []

    def log(s):
        print(s, flush=True)
        lines.append(s)

    log(f"{torch.cuda.get_device_name(0)} {torch.cuda.get_device_properties(0).uuid}")
    if mode == "ab":
        check_bits(log)
        results = timing(log, int(sys.argv[3]) if len(sys.argv) > 3 else 4)
        with open(f"{out}/ab.json", "w") as f:
            json.dump(results, f, indent=1)
    elif mode == "ncu_full":
        for dtype, d, rows in ((torch.bfloat16, 5120, 16384), (torch.bfloat16, 128, 524288)):
            x, w, dy, rstd, _ = inputs(rows, d, dtype)
            run, _, _ = fused_launcher(main_fused(dtype, d), rows, d, dtype, x, w, dy, rstd, None)
            run()
            torch.cuda.synchronize()
    elif mode == "ncu_seq":
        for dtype, d, rows in ((torch.bfloat16, 5120, 16384), (torch.bfloat16, 128, 524288)):
            x, w, dy, rstd, _ = inputs(rows, d, dtype)
            g.backward(dy, x, w, rstd)
            torch.cuda.synchronize()
    with open(f"{out}/{mode}.log", "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

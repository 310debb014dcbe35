# ruff: noqa
"""Issue 6, session 11, second round, the one device call: level 1's instruction waste.

Run from the repository root with ``PYTHONPATH=py`` after gunzipping the cubins named in
BUILDS (``nvcc -cubin -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -I kernels_cu``;
see README.md).  Every build's rms_norm kernels come from its cubin (swapped into
``gpu.rms_norm``'s ``kernel_for``) with the host rules of BUILDS: "main" (main's file and
rules: t128k5 always 1 x 16), "base" (this branch's kernels before this round, commit 749aa51,
with its rule: t128k5 two groups from 8192 rows), "base@16384" (the same kernels, t128k5 two
groups from 16384 rows as in round 1), and the variants (same operations in the same order):
"hint" (add_chunk_dot told that a vector launch's chunks are whole: no 64-bit test per chunk),
"hint+cnt" (and t128k5's chunk tests as k < lane_chunks, one 32-bit compare), "hint+cnt+res"
(and t128k5's bf16/fp16 fused backward in two copies, with and without grad_residual, instead
of the residual's 16 predicated instructions per chunk).  Bits: every build's grad_x,
grad_weight and level-1 partials against "base" where the tree is the same.  Time:
``do_bench`` medians (us) in interleaved rounds, the copy of the bytes moved in the same
rounds.
"""

from __future__ import annotations

import json
import sys

import torch

from batchinv import _native
from batchinv.contract import assert_bitwise_equal
from batchinv.gpu import rms_norm as g

EPS = 1e-6
DEV = torch.device("cuda", 0)
SIGNATURES = {
    "rms_norm_backward_weight_grad_": "ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64",
    "rms_norm_backward_": "ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64",
    "rms_norm_weight_grad_partials_": "ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64",
    "rms_norm_weight_grad_reduce": "ptr, ptr, i64, i64",
    "rms_norm_weight_grad_last_levels_": "ptr, ptr, i64, i64",
    "rms_norm_forward_": "ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, f32",
    "rms_norm_fused_forward_": "ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, f32",
}
K4 = (torch.bfloat16, torch.float32)
ALL = (torch.bfloat16, torch.float16, torch.float32)
RULE = {"t128k4": (K4, 16384), "t128k5": (ALL, 8192)}
BUILDS = {
    "main": ("reports/norm_wgrad/main.cubin", {"t128k4": (K4, 16384)}),
    "base": ("reports/norm_wgrad/base.cubin", RULE),
    "base@16384": (
        "reports/norm_wgrad/base.cubin",
        {"t128k4": (K4, 16384), "t128k5": (ALL, 16384)},
    ),
    "hint": ("reports/norm_wgrad/c4.cubin", RULE),
    "hint+cnt": ("reports/norm_wgrad/c5.cubin", RULE),
    "hint+cnt+res": ("reports/norm_wgrad/c6.cubin", RULE),
}
VARIANTS = ("base", "hint", "hint+cnt", "hint+cnt+res")
MODULES = {}
KERNELS = {}


def _signature(name):
    for prefix in sorted(SIGNATURES, key=len, reverse=True):
        if name.startswith(prefix):
            return SIGNATURES[prefix]
    raise KeyError(name)


def _kernel(cubin, name):
    if cubin not in MODULES:
        with open(cubin, "rb") as f:
            MODULES[cubin] = _native.RawModule(f.read())
    if (cubin, name) not in KERNELS:
        KERNELS[cubin, name] = MODULES[cubin].get_function(name, signature=_signature(name))
    return KERNELS[cubin, name]


def use(which):
    cubin, rule = BUILDS[which]
    g.kernel_for = lambda module, name, device, cubin=cubin: _kernel(cubin, name)
    g.TWO_GROUPS = rule


def inputs(rows, d, dtype, stride=None, residual=False, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    width = stride or d
    x = torch.randn(rows, width, device=DEV, generator=gen).to(dtype)[:, :d]
    w = (1.0 + 0.5 * torch.randn(d, device=DEV, generator=gen)).to(dtype)
    dy = torch.randn(rows, d, device=DEV, generator=gen).to(dtype)
    extra = torch.randn(rows, d, device=DEV, generator=gen).to(dtype) if residual else None
    use("base")
    _, rstd = g.forward(x, w, EPS)
    return x, w, dy, rstd, extra


def level1(which, x, w, dy, rstd, extra):
    """grad_x and the first-level partials as the op's plan launches them (fused kernel)."""
    use(which)
    rows, d = x.shape
    name, blocks, cta, shape = g.fused_backward_plan(d, x.dtype, rows)
    grad_x = torch.empty(rows, d, dtype=x.dtype, device=DEV)
    partials = torch.empty(blocks, d, device=DEV)
    args = (dy, x, w, rstd, extra if extra is not None else 0, rows, d, x.stride(0))

    def run():
        use(which)
        g.launch_fused_backward(
            name, x.dtype, DEV, blocks, cta, (grad_x, partials, *args), shape=shape
        )

    return run, grad_x, partials


BIT_CASES = [
    # (dtype, rows, d, row stride, residual gradient)
    (torch.bfloat16, 16384, 5120, None, False),
    (torch.bfloat16, 16400, 5120, None, True),
    (torch.bfloat16, 8191, 5120, None, False),
    (torch.bfloat16, 8192, 5120, None, True),
    (torch.bfloat16, 8208, 5114, None, False),  # element path, a last CTA's group past the end
    (torch.bfloat16, 4097, 5117, 5121, True),
    (torch.bfloat16, 4097, 4104, None, False),  # t128k5's smallest rows: chunk 4 of few lanes
    (torch.float16, 16384, 5120, None, True),
    (torch.float16, 8192, 4360, None, False),
    (torch.float32, 16384, 2560, None, False),
    (torch.float32, 8193, 2557, 2561, True),
    (torch.bfloat16, 524288, 128, None, False),
    (torch.bfloat16, 9001, 128, None, True),
    (torch.bfloat16, 9000, 500, None, False),
    (torch.bfloat16, 9000, 1000, None, True),
    (torch.bfloat16, 16384, 4096, None, False),
    (torch.bfloat16, 16400, 4093, 4097, True),
    (torch.bfloat16, 8192, 4096, None, True),
    (torch.float16, 16384, 4096, None, False),
    (torch.float32, 16384, 2048, None, False),
    (torch.float32, 16400, 2047, 2049, True),
    (torch.bfloat16, 140000, 8, None, False),
    (torch.float16, 4097, 125, 125, False),
]


def check_bits(log):
    ok = bad = 0
    for dtype, rows, d, stride, residual in BIT_CASES:
        x, w, dy, rstd, extra = inputs(rows, d, dtype, stride, residual, rows)
        results = {}
        for which in ("main", *VARIANTS):
            use(which)
            shape = g.weight_grad_chunking(d, dtype, rows)
            gx, gw = g.backward(dy, x, w, rstd, extra)
            parts = None
            if g.fused_backward_fits(d, dtype):
                parts = level1(which, x, w, dy, rstd, extra)
                parts[0]()
            results[which] = (shape, gx, gw, parts)
        torch.cuda.synchronize()
        base = results["base"]
        for which, got in results.items():
            if which == "base":
                continue
            same_tree = got[0] == base[0]
            tag = f"{which}: {dtype} {rows} x {d} stride {stride} residual {residual} tree {got[0]}"
            try:
                assert_bitwise_equal(got[1], base[1], name="grad_x")
                if base[3] is not None:
                    assert_bitwise_equal(got[3][1], base[3][1], name="fused grad_x")
                if same_tree:
                    assert_bitwise_equal(got[2], base[2], name="grad_weight")
                    if base[3] is not None:
                        assert_bitwise_equal(got[3][2], base[3][2], name="partials")
                ok += 1
                log(f"equal to base: {tag} ({'all' if same_tree else 'grad_x only: another tree'})")
            except AssertionError as error:
                bad += 1
                log(f"BITS DIFFER {tag}: {str(error)[:300]}")
    use("base")
    log(f"bits against base: {ok} equal, {bad} differ")


OP = "op"
SHAPES = [
    # (dtype, rows, d, residual, op builds, level-1 builds)
    (torch.bfloat16, 16384, 5120, False, ("main", *VARIANTS), VARIANTS),
    (torch.bfloat16, 16384, 4096, False, ("main", *VARIANTS), VARIANTS),
    (torch.float16, 16384, 5120, False, ("main", *VARIANTS), ()),
    (torch.float32, 16384, 2560, False, ("main", *VARIANTS), ()),
    (torch.bfloat16, 16384, 5120, True, (), VARIANTS),
    (torch.bfloat16, 8192, 5120, False, ("main", "base@16384", *VARIANTS), ()),
    (torch.bfloat16, 12288, 5120, False, ("base@16384", "base", "hint+cnt+res"), ()),
    (torch.float16, 8192, 5120, False, ("base@16384", "base"), ()),
    (torch.bfloat16, 4096, 5120, False, VARIANTS, ()),
    (torch.bfloat16, 32768, 5120, False, ("main", "base", "hint+cnt+res"), ()),
    (torch.bfloat16, 524288, 128, False, ("base", "hint"), ()),
    (torch.bfloat16, 16384, 1024, False, ("base", "hint"), ()),
]


def op_fn(which, x, w, dy, rstd, extra):
    def run():
        use(which)
        g.backward(dy, x, w, rstd, extra)

    return run


def timing(log, rounds):
    from triton.testing import do_bench

    results = {}
    for dtype, rows, d, residual, op_builds, level_builds in SHAPES:
        x, w, dy, rstd, extra = inputs(rows, d, dtype, residual=residual)
        fns = {}
        for which in op_builds:
            fns[f"{which} op"] = op_fn(which, x, w, dy, rstd, extra)
        for which in level_builds:
            fns[f"{which} level 1"] = level1(which, x, w, dy, rstd, extra)[0]
        nbytes = (4 if residual else 3) * rows * d * x.element_size() // 2
        src = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
        dst = torch.empty_like(src)
        fns["copy of the bytes moved"] = lambda dst=dst, src=src: dst.copy_(src)
        table = {label: [] for label in fns}
        for _ in range(rounds):
            for label, fn in fns.items():
                ms = do_bench(fn, warmup=15, rep=45, return_mode="median")
                table[label].append(round(1000 * ms, 1))
        key = f"{rows} x {d} {dtype}{' + grad_residual' if residual else ''}"
        results[key] = table
        copy = sorted(table["copy of the bytes moved"])[rounds // 2]
        log(f"\n{key} (us; ratio: median copy / median)")
        for label, times in table.items():
            med = sorted(times)[rounds // 2]
            log(f"  {label:28s} {' / '.join(f'{t:.1f}' for t in times)}  ({copy / med:.3f})")
        del fns, x, w, dy, rstd, extra, src, dst
        torch.cuda.empty_cache()
    return results


def main():
    out = sys.argv[1]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    lines = []

    def log(s):
        print(s, flush=True)
        lines.append(s)

    try:
        log(f"{torch.cuda.get_device_name(0)} {torch.cuda.get_device_properties(0).uuid}")
        check_bits(log)
        results = timing(log, rounds)
        with open(f"{out}/ab3.json", "w") as f:
            json.dump(results, f, indent=1)
    finally:
        with open(f"{out}/ab3.log", "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

# ruff: noqa
"""Issue 6, session 11, device call 1: this branch's RMSNorm backward against main's.

Run from the repository root with ``PYTHONPATH=py`` after compiling main's
``kernels_cu/rms_norm.cu`` (commit 48a63d8) to ``reports/norm_wgrad/main.cubin``
(``nvcc -cubin -O3 -std=c++17 -arch=sm_90a -I kernels_cu``).  ``gpu.rms_norm.backward`` runs
with the build's kernels and rules ("branch"), with main's cubin swapped into ``kernel_for``
and main's rules (first-level partition, last-levels grid: "main"), or with main's kernels and
rules except the build's last-levels grid ("main+ll": the new last levels alone).  Bits:
grad_x (every case) and grad_weight / level-1 partials (where main's and the branch's first
level are the same partition) of the branch equal main's.  Time: ``do_bench`` medians (us) in
interleaved rounds, the copy of the bytes moved in the same rounds.
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
}
BUILD = {
    "kernel_for": g.kernel_for,
    "LAST_LEVELS_COLUMNS": g.LAST_LEVELS_COLUMNS,
    "LAST_LEVELS_THREADS": g.LAST_LEVELS_THREADS,
    "TWO_GROUPS": dict(g.TWO_GROUPS),
}
BUILD_MIN_ROWS = g.TWO_GROUPS_MIN_ROWS
MAIN = {
    "LAST_LEVELS_COLUMNS": 16,
    "LAST_LEVELS_THREADS": 512,
    "TWO_GROUPS": {"t128k4": (torch.bfloat16, torch.float32)},
}
# Other last-levels grids: cubins of rms_norm.cu with other tile constants (untracked; see
# README.md), with the host's (columns, threads).
LAST_LEVELS_VARIANTS = {"ll16": ("reports/norm_wgrad/ll16.cubin", 16, 512)}
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
    """Makes gpu.rms_norm launch ``which``'s kernels and rules: "branch", "branch@all-rows" (the
    two-group rule from 0 rows), "main", "main+ll" (main with the build's last levels) or
    "main+<variant>" (main with a LAST_LEVELS_VARIANTS grid)."""
    if which.startswith("branch"):
        for key, value in BUILD.items():
            setattr(g, key, value)
        g.TWO_GROUPS_MIN_ROWS = 0 if which == "branch@all-rows" else BUILD_MIN_ROWS
        return
    g.TWO_GROUPS_MIN_ROWS = BUILD_MIN_ROWS
    extra = which.partition("+")[2]
    main_cubin = "reports/norm_wgrad/main.cubin"

    def kernel_for(module, name, device):
        if name.startswith("rms_norm_weight_grad_last_levels_"):
            if extra == "ll":
                return BUILD["kernel_for"](module, name, device)
            if extra:
                return _kernel(LAST_LEVELS_VARIANTS[extra][0], name)
        return _kernel(main_cubin, name)

    g.kernel_for = kernel_for
    g.TWO_GROUPS = MAIN["TWO_GROUPS"]
    if extra == "ll":
        columns, threads = BUILD["LAST_LEVELS_COLUMNS"], BUILD["LAST_LEVELS_THREADS"]
    elif extra:
        columns, threads = LAST_LEVELS_VARIANTS[extra][1:]
    else:
        columns, threads = MAIN["LAST_LEVELS_COLUMNS"], MAIN["LAST_LEVELS_THREADS"]
    g.LAST_LEVELS_COLUMNS = columns
    g.LAST_LEVELS_THREADS = threads


def inputs(rows, d, dtype, stride=None, residual=False, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    width = stride or d
    x = torch.randn(rows, width, device=DEV, generator=gen).to(dtype)[:, :d]
    w = (1.0 + 0.5 * torch.randn(d, device=DEV, generator=gen)).to(dtype)
    dy = torch.randn(rows, d, device=DEV, generator=gen).to(dtype)
    extra = torch.randn(rows, d, device=DEV, generator=gen).to(dtype) if residual else None
    use("branch")
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
    (torch.bfloat16, 16384, 5120, None, False),  # t128k5g2 in the branch: grad_x only
    (torch.bfloat16, 16400, 5120, None, True),
    (torch.bfloat16, 16383, 5120, None, False),  # 1 x 16 both: all bits
    (torch.bfloat16, 4097, 5117, 5121, True),
    (torch.float16, 16384, 5120, None, True),
    (torch.float32, 16384, 2560, None, False),
    (torch.float32, 16385, 2557, 2561, True),  # element path of t128k5g2
    (torch.bfloat16, 16385, 5117, 5121, False),
    (torch.bfloat16, 524288, 128, None, False),  # q/k: levels of 16384 partials
    (torch.bfloat16, 9001, 128, None, True),
    (torch.bfloat16, 16384, 4096, None, False),
    (torch.bfloat16, 16400, 4093, 4097, True),
    (torch.bfloat16, 65536, 4096, None, False),  # 2048 partial rows: two tiles
    (torch.bfloat16, 8192, 4096, None, False),
    (torch.float32, 16384, 2048, None, False),  # fp32 t128k4g2 (named barriers now)
    (torch.float32, 16400, 2047, 2049, True),
    (torch.bfloat16, 140000, 8, None, False),
    (torch.bfloat16, 9000, 1000, None, True),
    (torch.float16, 4097, 125, 125, False),
]


def check_bits(log):
    ok = bad = 0
    for dtype, rows, d, stride, residual in BIT_CASES:
        x, w, dy, rstd, extra = inputs(rows, d, dtype, stride, residual, rows)
        results = {}
        same_tree = True
        for which in ("main", "branch"):
            use(which)
            shape = g.weight_grad_chunking(d, dtype, rows)
            results[which] = [shape]
            gx, gw = g.backward(dy, x, w, rstd, extra)
            fits = g.fused_backward_fits(d, dtype)
            parts = level1(which, x, w, dy, rstd, extra) if fits else None
            if parts is not None:
                parts[0]()
            results[which] += [gx, gw, parts]
        torch.cuda.synchronize()
        m, b = results["main"], results["branch"]
        same_tree = m[0] == b[0]
        tag = f"{dtype} {rows} x {d} stride {stride} residual {residual} tree {m[0]} -> {b[0]}"
        try:
            assert_bitwise_equal(b[1], m[1], name="grad_x")
            if m[3] is not None:
                assert_bitwise_equal(b[3][1], m[3][1], name="fused grad_x")
            if same_tree:
                assert_bitwise_equal(b[2], m[2], name="grad_weight")
                if m[3] is not None:
                    assert_bitwise_equal(b[3][2], m[3][2], name="partials")
            ok += 1
            log(f"equal: {tag} ({'all' if same_tree else 'grad_x only: another tree'})")
        except AssertionError as error:
            bad += 1
            log(f"BITS DIFFER {tag}: {str(error)[:300]}")
    use("branch")
    log(f"bits (branch vs main): {ok} cases equal, {bad} differ")


LL = ("main", "main+ll", "main+ll16", "branch")
SHAPES = [
    # (dtype, rows, d, builds, level 1 too)
    (torch.bfloat16, 16384, 5120, LL, True),
    (torch.bfloat16, 16384, 4096, LL, True),
    (torch.bfloat16, 524288, 128, LL, False),
    (torch.float16, 16384, 5120, ("main", "main+ll", "branch"), True),
    (torch.float32, 16384, 2560, ("main", "main+ll", "branch"), False),
    (torch.float32, 16384, 2048, ("main", "main+ll", "branch"), False),
    (torch.bfloat16, 24576, 5120, ("main", "branch"), False),
    (torch.bfloat16, 32768, 5120, ("main", "branch"), False),
    (torch.bfloat16, 8192, 5120, ("main", "branch", "branch@all-rows"), False),
    (torch.bfloat16, 8192, 4096, ("main", "main+ll16", "branch"), False),
    (torch.bfloat16, 65536, 4096, LL, False),
]


def op_fn(which, x, w, dy, rstd):
    def run():
        use(which)
        g.backward(dy, x, w, rstd)

    return run


def timing(log, rounds):
    from triton.testing import do_bench

    results = {}
    for dtype, rows, d, builds, with_level1 in SHAPES:
        x, w, dy, rstd, _ = inputs(rows, d, dtype)
        fns = {}
        for which in builds:
            fns[f"{which} op (all levels)"] = op_fn(which, x, w, dy, rstd)
        if with_level1:
            for which in ("main", "branch"):
                fns[f"{which} level 1"] = level1(which, x, w, dy, rstd, None)[0]
        nbytes = 3 * rows * d * x.element_size() // 2
        src = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
        dst = torch.empty_like(src)
        fns["copy of the bytes moved"] = lambda dst=dst, src=src: dst.copy_(src)
        table = {label: [] for label in fns}
        for _ in range(rounds):
            for label, fn in fns.items():
                ms = do_bench(fn, warmup=20, rep=60, return_mode="median")
                table[label].append(round(1000 * ms, 1))
        use("branch")
        key = f"{rows} x {d} {dtype}"
        results[key] = table
        copy = sorted(table["copy of the bytes moved"])[rounds // 2]
        log(f"\n{key} (us; ratio: median copy / median)")
        for label, times in table.items():
            med = sorted(times)[rounds // 2]
            log(f"  {label:28s} {' / '.join(f'{t:.1f}' for t in times)}  ({copy / med:.3f})")
        del fns, x, w, dy, rstd, src, dst
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
        with open(f"{out}/ab1.json", "w") as f:
            json.dump(results, f, indent=1)
    finally:
        with open(f"{out}/ab1.log", "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

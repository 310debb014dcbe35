"""Issue 6, session 10, device call 2: this branch's backward against main's, bits and time.

Run from the repository root with ``PYTHONPATH=py`` after compiling main's
``kernels_cu/rms_norm.cu`` (commit 857498d) to ``reports/norm_bwd/main.cubin`` and the first
step's (f9406e6: the t4 changes alone) to ``reports/norm_bwd/step1.cubin`` (sm_90a cubins,
``nvcc -cubin -O3 -std=c++17 -arch=sm_90a -I kernels_cu``).  ``gpu.rms_norm.backward`` runs with
the build's kernels ("branch") or with those of a cubin swapped into its ``kernel_for`` (and
main's 32-column last-levels grid).  Bits: grad_x, first-level partials and grad_weight of the
branch equal main's.  Time: ``do_bench`` medians (us) in interleaved rounds.
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
BUILD_KERNEL_FOR = g.kernel_for
BUILD_COLUMNS = g.LAST_LEVELS_COLUMNS
MODULES = {}
KERNELS = {}


def _signature(name):
    for prefix in sorted(SIGNATURES, key=len, reverse=True):
        if name.startswith(prefix):
            return SIGNATURES[prefix]
    raise KeyError(name)


def use(which):
    """Makes gpu.rms_norm launch ``which``'s kernels: "branch" (the build) or a cubin name."""
    if which == "branch":
        g.kernel_for = BUILD_KERNEL_FOR
        g.LAST_LEVELS_COLUMNS = BUILD_COLUMNS
        return
    if which not in MODULES:
        with open(f"reports/norm_bwd/{which}.cubin", "rb") as f:
            MODULES[which] = _native.RawModule(f.read())

    def kernel_for(module, name, device):
        key = (which, name)
        if key not in KERNELS:
            KERNELS[key] = MODULES[which].get_function(name, signature=_signature(name))
        return KERNELS[key]

    g.kernel_for = kernel_for
    g.LAST_LEVELS_COLUMNS = 32  # main's grid for the last two levels


def inputs(rows, d, dtype, stride=None, residual=False, seed=0, nan_row=False):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    width = stride or d
    x = torch.randn(rows, width, device=DEV, generator=gen).to(dtype)[:, :d]
    w = (1.0 + 0.5 * torch.randn(d, device=DEV, generator=gen)).to(dtype)
    dy = torch.randn(rows, d, device=DEV, generator=gen).to(dtype)
    if nan_row:
        dy[rows // 2, 1] = float("nan")
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
    (torch.bfloat16, 16384, 5120, None, False),
    (torch.bfloat16, 67, 5120, None, True),
    (torch.bfloat16, 4097, 5120, 5121, True),
    (torch.bfloat16, 524288, 128, None, False),
    (torch.bfloat16, 9001, 128, None, True),
    (torch.bfloat16, 77, 128, 129, True),
    (torch.bfloat16, 16384, 4096, None, False),
    (torch.bfloat16, 16400, 4096, None, True),
    (torch.bfloat16, 8192, 4096, None, False),
    (torch.bfloat16, 4099, 4093, 4097, False),
    (torch.bfloat16, 300, 4096, None, False),
    (torch.bfloat16, 9000, 1000, None, True),
    (torch.bfloat16, 65536, 512, None, False),
    (torch.bfloat16, 140000, 8, None, False),
    (torch.float16, 524288, 128, None, True),
    (torch.float16, 4097, 125, 125, False),
    (torch.float16, 16384, 5120, None, False),
    (torch.float16, 16384, 4096, None, True),
    (torch.float32, 70001, 64, None, True),
    (torch.float32, 16384, 2048, None, False),
    (torch.float32, 9000, 2560, None, False),
]


def check_bits(log):
    ok = bad = 0
    for dtype, rows, d, stride, residual in BIT_CASES:
        for nan_row in (False, True) if rows == 9001 else (False,):
            x, w, dy, rstd, extra = inputs(rows, d, dtype, stride, residual, rows, nan_row)
            results = {}
            for which in ("main", "branch"):
                use(which)
                gx, gw = g.backward(dy, x, w, rstd, extra)
                fits = g.fused_backward_fits(d, dtype)
                parts = level1(which, x, w, dy, rstd, extra) if fits else None
                if parts is not None:
                    parts[0]()
                results[which] = (gx, gw, parts)
            torch.cuda.synchronize()
            tag = f"{dtype} {rows} x {d} stride {stride} residual {residual} nan {nan_row}"
            try:
                m, b = results["main"], results["branch"]
                assert_bitwise_equal(b[0], m[0], name="grad_x")
                assert_bitwise_equal(b[1], m[1], name="grad_weight")
                if m[2] is not None:
                    assert_bitwise_equal(b[2][1], m[2][1], name="fused grad_x")
                    assert_bitwise_equal(b[2][2], m[2][2], name="partials")
                ok += 1
            except AssertionError as error:
                bad += 1
                log(f"BITS DIFFER {tag}: {str(error)[:300]}")
    use("branch")
    log(
        f"bits (branch vs main: grad_x, grad_weight, fused grad_x, partials): {ok} cases equal, "
        f"{bad} differ"
    )


SHAPES = [
    # (dtype, rows, d, which builds, level 1 too)
    (torch.bfloat16, 16384, 5120, ("main", "branch"), True),
    (torch.bfloat16, 524288, 128, ("main", "step1", "branch"), True),
    (torch.bfloat16, 16384, 4096, ("main", "branch"), True),
    (torch.float16, 524288, 128, ("main", "branch"), False),
    (torch.bfloat16, 8192, 4096, ("main", "branch"), False),
    (torch.bfloat16, 65536, 512, ("main", "branch"), False),
    (torch.float16, 16384, 5120, ("main", "branch"), False),
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
            fns[f"{which} op backward (all levels)"] = op_fn(which, x, w, dy, rstd)
        if with_level1:
            for which in builds:
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
            log(f"  {label:32s} {' / '.join(f'{t:.1f}' for t in times)}  ({copy / med:.3f})")
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

    log(f"{torch.cuda.get_device_name(0)} {torch.cuda.get_device_properties(0).uuid}")
    check_bits(log)
    results = timing(log, rounds)
    with open(f"{out}/ab2.json", "w") as f:
        json.dump(results, f, indent=1)
    with open(f"{out}/ab2.log", "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

# ruff: noqa
"""Issue 6, session 11, third round, the one device call: a first level of a fixed number of
partial rows for the two-group geometries.

Run from the repository root with ``PYTHONPATH=py`` after gunzipping ``r2.cubin`` (round 2's
kernels, commit 1f13471's ``kernels_cu/rms_norm.cu``) and ``new.cubin`` (this round's:
the *g2 entries take the rows per group as an argument), both
``nvcc -cubin -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -I kernels_cu``.  Builds:
"r2" (round 2's kernels and rule: two groups of 16 rows, t128k4 from 16384 rows, t128k5 from
8192), "s16" (this round's kernels with round 2's tree: S = 16 passed at run time: the cost of
the runtime loop bound, and the same bits), "P256" / "P264" / "P512" (S = max(16,
ceil(rows / (2 P))): at most P partial rows), "P256k4@8192" (P256 with t128k4's two groups
from 8192 rows).  Bits: grad_x of every build against r2, grad_weight and the partials where
the tree is r2's.  Time: ``do_bench`` medians (us) in interleaved rounds, the copy of the bytes
moved in the same rounds.
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
R2 = "reports/norm_wgrad/r2.cubin"
NEW = "reports/norm_wgrad/new.cubin"
BIG = 1 << 40  # P: S = 16 at any row count
# build -> (cubin, two-group rule, P)
BUILDS = {
    "r2": (R2, RULE, BIG),
    "s16": (NEW, RULE, BIG),
    "P256": (NEW, RULE, 256),
    "P264": (NEW, RULE, 264),
    "P512": (NEW, RULE, 512),
    "P256k4@8192": (NEW, {"t128k4": (K4, 8192), "t128k5": (ALL, 8192)}, 256),
}
MODULES = {}
KERNELS = {}


def _signature(cubin, name):
    for prefix in sorted(SIGNATURES, key=len, reverse=True):
        if name.startswith(prefix):
            sig = SIGNATURES[prefix]
            if cubin == NEW and name.endswith("g2"):
                sig += ", i64"
            return sig
    raise KeyError(name)


class DropLast:
    """Round 2's *g2 kernels: called with this round's argument list, without its last
    argument (the rows per group, 16 there as in the kernel)."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __call__(self, grid, block, args, **kw):
        assert args[-1] == 16, args[-1]
        return self.kernel(grid, block, args[:-1], **kw)

    def attributes(self, *a):
        return self.kernel.attributes(*a)

    def set_max_dynamic_shared_memory(self, *a, **kw):
        return self.kernel.set_max_dynamic_shared_memory(*a, **kw)


def _kernel(cubin, name):
    if cubin not in MODULES:
        with open(cubin, "rb") as f:
            MODULES[cubin] = _native.RawModule(f.read())
    if (cubin, name) not in KERNELS:
        k = MODULES[cubin].get_function(name, signature=_signature(cubin, name))
        if cubin == R2 and name.endswith("g2"):
            k = DropLast(k)
        KERNELS[cubin, name] = k
    return KERNELS[cubin, name]


def use(which):
    cubin, rule, p = BUILDS[which]
    g.kernel_for = lambda module, name, device, cubin=cubin: _kernel(cubin, name)
    g.TWO_GROUPS = rule
    g.WEIGHT_GRAD_PARTIAL_ROWS = p


def inputs(rows, d, dtype, stride=None, residual=False, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    width = stride or d
    x = torch.randn(rows, width, device=DEV, generator=gen).to(dtype)[:, :d]
    w = (1.0 + 0.5 * torch.randn(d, device=DEV, generator=gen)).to(dtype)
    dy = torch.randn(rows, d, device=DEV, generator=gen).to(dtype)
    extra = torch.randn(rows, d, device=DEV, generator=gen).to(dtype) if residual else None
    use("r2")
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
    (torch.bfloat16, 8192, 5120, None, True),
    (torch.bfloat16, 8208, 5114, None, False),
    (torch.bfloat16, 24577, 5120, None, False),
    (torch.float16, 16384, 5120, None, True),
    (torch.float32, 16384, 2560, None, False),
    (torch.float32, 8193, 2557, 2561, True),
    (torch.bfloat16, 16384, 4096, None, False),
    (torch.bfloat16, 16400, 4093, 4097, True),
    (torch.bfloat16, 32768, 4096, None, True),
    (torch.float16, 16384, 4096, None, False),
    (torch.float32, 16384, 2048, None, False),
    (torch.float32, 16400, 2047, 2049, True),
    (torch.bfloat16, 9000, 1000, None, True),
]
BIT_BUILDS = ("s16", "P256", "P264")


def check_bits(log):
    ok = bad = 0
    for dtype, rows, d, stride, residual in BIT_CASES:
        x, w, dy, rstd, extra = inputs(rows, d, dtype, stride, residual, rows)
        results = {}
        for which in ("r2", *BIT_BUILDS):
            use(which)
            shape = g.weight_grad_chunking(d, dtype, rows)
            gx, gw = g.backward(dy, x, w, rstd, extra)
            parts = None
            if g.fused_backward_fits(d, dtype):
                parts = level1(which, x, w, dy, rstd, extra)
                parts[0]()
            results[which] = (shape, gx, gw, parts)
        torch.cuda.synchronize()
        base = results["r2"]
        for which, got in results.items():
            if which == "r2":
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
                log(f"equal to r2: {tag} ({'all' if same_tree else 'grad_x only: another tree'})")
            except AssertionError as error:
                bad += 1
                log(f"BITS DIFFER {tag}: {str(error)[:300]}")
        del results, x, w, dy, rstd, extra
        torch.cuda.empty_cache()
    use("r2")
    log(f"bits against r2: {ok} equal, {bad} differ")


BF = torch.bfloat16
MAIN = ("r2", "s16", "P256", "P264", "P512")
SHAPES = [
    # (dtype, rows, d, residual, op builds, level-1 builds)
    (BF, 16384, 4096, False, MAIN, ("r2", "s16", "P256")),
    (BF, 16384, 5120, False, MAIN, ("r2", "s16", "P256")),
    (BF, 24576, 4096, False, ("r2", "P256", "P264", "P512"), ()),
    (BF, 24576, 5120, False, ("r2", "P256", "P264", "P512"), ()),
    (BF, 32768, 4096, False, ("r2", "P256", "P264"), ()),
    (BF, 32768, 5120, False, ("r2", "P256", "P264"), ()),
    (BF, 65536, 4096, False, ("r2", "P256"), ()),
    (BF, 65536, 5120, False, ("r2", "P256"), ()),
    (BF, 12288, 5120, False, ("r2", "s16", "P256"), ()),
    (BF, 8192, 5120, False, ("r2", "s16"), ()),
    (BF, 12288, 4096, False, ("r2", "P256k4@8192"), ()),
    (BF, 8192, 4096, False, ("r2", "P256k4@8192"), ()),
    (torch.float16, 16384, 5120, False, ("r2", "s16", "P256"), ()),
    (torch.float32, 16384, 2560, False, ("r2", "s16", "P256"), ()),
    (torch.float32, 16384, 2048, False, ("r2", "s16", "P256"), ()),
    (BF, 16384, 5120, True, ("r2", "P256"), ()),
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
                ms = do_bench(fn, warmup=15, rep=40, return_mode="median")
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
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    lines = []

    def log(s):
        print(s, flush=True)
        lines.append(s)

    try:
        log(f"{torch.cuda.get_device_name(0)} {torch.cuda.get_device_properties(0).uuid}")
        check_bits(log)
        results = timing(log, rounds)
        with open(f"{out}/ab4.json", "w") as f:
            json.dump(results, f, indent=1)
    finally:
        with open(f"{out}/ab4.log", "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

"""batchinv.linear's gradients (grad_x, grad_w) against cuBLAS, Qwen3-8B shapes, 16k/32k tokens.

Goal: >= 0.9x cuBLAS for grad_x and grad_w, bits deterministic run to run.
Shapes: ``batchinv.shapes.QWEN3_8B_LINEAR`` (qkv, o, gate_up, down, lm_head) with
``TOKENS`` = 16384 and 32768 tokens, bf16.  A case that runs out of GPU memory is recorded as
skipped (a row with a ``note``), not timed.

Timed per case, each against cuBLAS in the same run:

- the public op through autograd (``scope`` "op", the rows with the goal): the output of
  ``batchinv.linear`` and of ``F.linear`` recorded once, then ``torch.autograd.grad`` of it
  for grad_x alone (only ``x`` requires grad), grad_w alone (only the weight does) and both;
  batchinv's backward runs its default route (``path`` says which: "in place" reads dY, X
  and W where they lie, "copies" makes transposed copies first);
- the backward launcher on each route (``scope`` "kernel", no goal): ``gpu_linear.backward``
  for grad_x alone and grad_w alone, in place and with ``transposed_copies=True`` (the copies
  inside the time), against the same cuBLAS autograd times;
- the GEMMs alone (``scope`` "kernel", no goal): in place, grad_x as ``matmul_nn(grad_y, W)``
  and grad_w as ``matmul_tn(grad_y, x)``; on copies, grad_x as ``matmul_rows(grad_y, Wᵀ)`` on
  a contiguous ``Wᵀ`` and grad_w as ``matmul_nt(grad_yᵀ, xᵀ)`` on contiguous transposes; against
  ``torch.mm(grad_y, W)`` and ``torch.mm(grad_yᵀ, x)``.

Bits (``docs/operators/linear.md``, "Backward"): grad_x reduces over out_features per token,
so a token's row is the same whatever other tokens are present or where they sit; grad_w
reduces over the tokens, in increasing token order, as one fp32 chain of k16 tensor-core
steps (16 tokens per step, 64 per pipeline tile), no split, no atomics.  The contract is:

- grad_w and grad_x are bitwise identical run to run for the same inputs in the same order
  (checked here: ``deterministic``);
- grad_x follows the tokens: permuting the tokens permutes grad_x's rows, bit for bit
  (``grad_x_rows_follow``);
- grad_w depends on the token order.  No chunk is promised to be order-free: the 16 products
  of one k16 step are added inside one MMA instruction in a hardware-defined way, and the
  steps are chained in order.  The benchmark records what this card does when the tokens are
  permuted within each 16-token step (``grad_w_perm16_same``) and within each 64-token tile
  (``grad_w_perm64_same``); those columns are measurements, not promises.

The two routes must give the same bits (``in_place_equals_copies``, grad_x and grad_w).  A
violated contract check, or routes that differ, is printed and makes the script exit with
status 1 after the tables.

    python benchmarks/bench_linear_grad.py [--json PATH]
    python benchmarks/bench_linear_grad.py --smoke     # tiny shapes, runs on the CPU too
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import bench_device

import batchinv
from batchinv.contract import bitwise_equal
from batchinv.shapes import QWEN3_8B_LINEAR

TOKENS = (16384, 32768)
GOAL = 0.9  # of cuBLAS
OP_ANCHOR = "cuBLAS (F.linear autograd)"
KERNEL_ANCHOR = "cuBLAS (torch.mm)"
# The summary variant of each measurement; grads "x", "w" or "x+w".
OP_VARIANTS = {"x": "grad_x", "w": "grad_w", "x+w": "grad_x + grad_w"}
KERNEL_VARIANTS = {"x": "grad_x GEMM kernel", "w": "grad_w GEMM kernel"}
SMOKE_SHAPES = (("tiny", 64, 48),)
SMOKE_TOKENS = (128,)
STEP_TOKENS, TILE_TOKENS = 16, 64  # tokens per k16 step and per pipeline tile (linear.cu)
COLUMNS = ["layer", "tokens", "N", "K", "grad", "scope", "path", "ms", "TFLOP/s", "vs_cuBLAS"]
CHECK_COLUMNS = [
    "layer",
    "tokens",
    "deterministic",
    "grad_x_rows_follow",
    "in_place_equals_copies",
    "grad_w_perm16_same",
    "grad_w_perm64_same",
    "note",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes, a few repetitions; runs on the CPU"
    )
    return parser.parse_args(argv)


def timer(device: torch.device, smoke: bool):
    """``ms(fn)``: the median time of ``fn()``; CUDA events on a GPU (``_common.median_ms``),
    wall time on the CPU (smoke runs only)."""
    if device.type == "cuda":
        from _common import median_ms

        if smoke:
            return lambda fn: median_ms(fn, warmup_ms=5, rep_ms=20)
        return lambda fn: median_ms(fn, warmup_ms=50, rep_ms=300)

    def cpu_ms(fn) -> float:
        fn()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return sorted(times)[1]

    return cpu_ms


def within_blocks(tokens: int, block: int, generator: torch.Generator) -> torch.Tensor:
    """A permutation of ``range(tokens)`` that moves tokens only inside aligned blocks of
    ``block`` (the last, partial block included)."""
    perm = torch.arange(tokens)
    for start in range(0, tokens, block):
        stop = min(start + block, tokens)
        perm[start:stop] = start + torch.randperm(stop - start, generator=generator)
    return perm


def recorded(linear, x, weight, which: str):
    """``(y, wanted)``: ``y = linear(x, weight)`` recorded for autograd with only the inputs
    in ``wanted`` (``x`` for "x", the weight for "w", both for "x+w") requiring grad."""
    x = x.detach().requires_grad_("x" in which)
    weight = weight.detach().requires_grad_("w" in which)
    y = linear(x, weight)
    wanted = [t for t in (x, weight) if t.requires_grad]
    return y, wanted


def timed_backward(linear, x, weight, grad_y, which: str):
    """A callable running the backward of ``linear`` recorded once (autograd.grad)."""
    y, wanted = recorded(linear, x, weight, which)
    return lambda: torch.autograd.grad(y, wanted, grad_y, retain_graph=True)


def contract_checks(x, weight, grad_y) -> dict:
    """The bit checks of one case (module docstring)."""
    gen = torch.Generator().manual_seed(1)
    tokens = x.shape[0]

    def backward(x_in, g_in):
        y, wanted = recorded(batchinv.linear, x_in, weight, "x+w")
        return torch.autograd.grad(y, wanted, g_in)

    gx, gw = backward(x, grad_y)
    gx2, gw2 = backward(x, grad_y)
    checks = {"deterministic": bitwise_equal(gx, gx2) and bitwise_equal(gw, gw2)}
    del gx2, gw2
    if x.device.type == "cuda":
        from batchinv.gpu import linear as gpu_linear

        gx2, gw2, _ = gpu_linear.backward(grad_y, x, weight, None, transposed_copies=True)
        checks["in_place_equals_copies"] = bitwise_equal(gx, gx2) and bitwise_equal(gw, gw2)
        del gx2, gw2
    for block, key in ((STEP_TOKENS, "grad_w_perm16_same"), (TILE_TOKENS, "grad_w_perm64_same")):
        perm = within_blocks(tokens, block, gen).to(x.device)
        gx_p, gw_p = backward(x[perm], grad_y[perm])
        checks[key] = bitwise_equal(gw_p, gw)
        if block == TILE_TOKENS:
            checks["grad_x_rows_follow"] = bitwise_equal(gx_p, gx[perm])
        del gx_p, gw_p
    return checks


def measure_case(name, k, n, tokens, device, ms) -> tuple[list[dict], list[dict], dict]:
    """Rows, summary rows and the checks of one (shape, tokens) case."""
    from _common import summary_row

    gen = torch.Generator(device=device).manual_seed(0)
    weight = (torch.randn(n, k, device=device, generator=gen) / k**0.5).bfloat16()
    x = torch.randn(tokens, k, device=device, generator=gen).bfloat16()
    grad_y = torch.randn(tokens, n, device=device, generator=gen).bfloat16()
    case = f"{name} {tokens} tokens (N={n}, K={k}), bf16"
    base = {"layer": name, "tokens": tokens, "N": n, "K": k}
    ran_x, ran_w = _ran_labels(x, weight, grad_y)
    rows, summary = [], []

    def record(grad, scope, ran, mine_ms, anchor, anchor_ms, flops, variant, goal=None):
        for path, t in (("batchinv", mine_ms), (anchor, anchor_ms)):
            rows.append(
                base
                | {
                    "grad": grad,
                    "scope": scope,
                    "path": path if path != "batchinv" else f"batchinv ({ran})",
                    "ms": t,
                    "TFLOP/s": flops / t / 1e9,
                    "vs_cuBLAS": anchor_ms / t,
                }
            )
        summary.append(
            summary_row(
                "linear", case, variant, mine_ms, anchor, anchor_ms, goal, scope=scope, ran=ran
            )
        )

    flops_one = 2.0 * tokens * n * k
    anchors = {}  # cuBLAS autograd time per grad, for the launcher rows
    for which, variant in OP_VARIANTS.items():
        ran = {"x": ran_x, "w": ran_w, "x+w": f"{ran_x}; {ran_w}"}[which]
        mine = ms(timed_backward(batchinv.linear, x, weight, grad_y, which))
        anchor = ms(timed_backward(F.linear, x, weight, grad_y, which))
        flops = flops_one * (2 if which == "x+w" else 1)
        record(which, "op", ran, mine, OP_ANCHOR, anchor, flops, variant, GOAL)
        anchors[which] = anchor
    if device.type == "cuda":  # the launcher and the GEMMs alone exist on the GPU only
        from batchinv.gpu import linear as gpu_linear

        copies = dict(zip("xw", _copies_labels(x, weight), strict=True))
        default = {"x": ran_x, "w": ran_w}
        for transposed_copies, labels in ((False, default), (True, copies)):
            for which, needs in (("x", (True, False, False)), ("w", (False, True, False))):

                def launcher(needs=needs, transposed_copies=transposed_copies):
                    return gpu_linear.backward(
                        grad_y, x, weight, None, needs, transposed_copies=transposed_copies
                    )

                ran = labels[which]  # "in place: ..." or "copies: ..."
                variant = f"{OP_VARIANTS[which]} backward, {ran.split(':')[0]}"
                mine = ms(launcher)
                record(which, "kernel", ran, mine, OP_ANCHOR, anchors[which], flops_one, variant)
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        in_place_x = f"in place: {gpu_linear.choose_transposed_config('tb', tokens, k, sms)}"
        in_place_w = f"in place: {gpu_linear.choose_transposed_config('tab', n, k, sms)}"
        mm_x, mm_w = ms(lambda: torch.mm(grad_y, weight)), ms(lambda: torch.mm(grad_y.t(), x))
        mine = ms(lambda: gpu_linear.matmul_nn(grad_y, weight))
        variant = KERNEL_VARIANTS["x"]
        record("x", "kernel", in_place_x, mine, KERNEL_ANCHOR, mm_x, flops_one, variant)
        mine = ms(lambda: gpu_linear.matmul_tn(grad_y, x))
        variant = KERNEL_VARIANTS["w"]
        record("w", "kernel", in_place_w, mine, KERNEL_ANCHOR, mm_w, flops_one, variant)
        weight_t = weight.t().contiguous()
        mine = ms(lambda: gpu_linear.matmul_rows(grad_y, weight_t))
        variant = f"{KERNEL_VARIANTS['x']} on copies"
        record("x", "kernel", copies["x"], mine, KERNEL_ANCHOR, mm_x, flops_one, variant)
        del weight_t
        grad_t, x_t = grad_y.t().contiguous(), x.t().contiguous()
        mine = ms(lambda: gpu_linear.matmul_nt(grad_t, x_t))
        variant = f"{KERNEL_VARIANTS['w']} on copies"
        record("w", "kernel", copies["w"], mine, KERNEL_ANCHOR, mm_w, flops_one, variant)
        del grad_t, x_t
    check = base | contract_checks(x, weight, grad_y)
    return rows, summary, check


def _ran_labels(x: torch.Tensor, weight: torch.Tensor, grad_y: torch.Tensor) -> tuple[str, str]:
    """What the backward's default route runs for grad_x (``grad_y · W``) and grad_w
    (``grad_yᵀ · x``), e.g. ``"in place: hopper tb bm128 bn256 k64 s4"``."""
    if x.device.type != "cuda":
        return "reference", "reference"
    from batchinv.gpu.linear import describe_backward

    return describe_backward(grad_y, x, weight)


def _copies_labels(x: torch.Tensor, weight: torch.Tensor) -> tuple[str, str]:
    """What ``backward(..., transposed_copies=True)`` runs: grad_x on the rows path of the
    ``Wᵀ`` copy, grad_w on batchinv's kernels over token-major copies."""
    from batchinv.gpu.linear import describe, rows_path

    (tokens, k), n, device = x.shape, weight.shape[0], x.device
    path_x = rows_path(tokens, weight.t().contiguous(), False)
    return (
        f"copies: {describe(tokens, k, path_x, device)}",
        f"copies: {describe(n, k, 'own', device)}",
    )


def main(argv: list[str] | None = None) -> tuple[list[dict], list[dict], list[dict]]:
    """Runs the benchmark; returns (rows, summary, checks) for the smoke test."""
    args = parse_args(argv)
    device = bench_device(args.smoke, args.json)
    ms = timer(device, args.smoke)
    shapes = SMOKE_SHAPES if args.smoke else QWEN3_8B_LINEAR
    token_counts = SMOKE_TOKENS if args.smoke else TOKENS
    rows, summary, checks = [], [], []
    for name, k, n in shapes:
        for tokens in token_counts:
            print(f"{name} (N={n}, K={k}), {tokens} tokens ...", flush=True)
            try:
                case_rows, case_summary, check = measure_case(name, k, n, tokens, device, ms)
            except torch.cuda.OutOfMemoryError as error:
                note = f"skipped: out of GPU memory ({str(error).splitlines()[0]})"
                print(f"note: {name} {tokens} tokens {note}")
                checks.append({"layer": name, "tokens": tokens, "N": n, "K": k, "note": note})
                rows.append(
                    {"layer": name, "tokens": tokens, "N": n, "K": k, "ms": None, "note": note}
                )
                torch.cuda.empty_cache()
                continue
            for row in case_rows:  # each timed row carries its case's bit checks
                row.update({key: check[key] for key in CHECK_COLUMNS if key in check})
            rows += case_rows
            summary += case_summary
            checks.append(check)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    contract = ("deterministic", "grad_x_rows_follow", "in_place_equals_copies")
    violated = [c for c in checks if any(c.get(key) is False for key in contract)]
    name = "linear_grad (bf16)"
    from _common import print_table, report

    if device.type == "cuda":
        report(name, rows, COLUMNS, args.json, summary)
    else:
        print(f"\n{name}, CPU smoke run (the strict reference; times mean nothing)")
        print_table(rows, COLUMNS)
    print("\nbit checks (module docstring: the first two are the contract)")
    print_table(checks, CHECK_COLUMNS)
    for c in violated:
        print(f"CONTRACT VIOLATED: {c['layer']} {c['tokens']} tokens: {c}")
    if violated:
        sys.exit(1)
    return rows, summary, checks


if __name__ == "__main__":
    main()

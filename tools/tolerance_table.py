"""Builds batchinv's tolerance table from the measured error of each op (docs/tolerances.md).

Two measurements feed the entry of an op, dtype and kind (forward value or input gradient):

* ``gpu``: ``tools/measure_op_error.py`` on a card: the CUDA op against its strict fp32
  reference on the same inputs, at Qwen3-8B shapes.
* ``cpu`` (``measure`` below, run on the CPU): the op's CPU path -- the reference in reduced
  precision, which is what ``batchinv.<op>`` runs on a CPU tensor -- against a float64
  computation of the same definition from the same rounded inputs.  It is the floor of the
  entry: the reference's own rounding and summation error, which every backend's check
  includes and the tests that compare the fp32 reference with float64 measure directly.

Each measured output records the absolute term it needs at fixed relative terms
(``atol_at_rtol``) and its fit ``atol_fit + rtol_fit*|ref|`` (``calibrate_tolerances.fit_error``).
The outputs of an entry (every case and output of the op, both measurements) get one joint
bound ``atol_j + rtol_j*|ref|`` (``joint_bound``), and the entry is::

    atol = ATOL_MARGIN * max(atol_j, the dtype's smallest subnormal)
    rtol = RTOL_MARGIN * rtol_j

The relative term of a low-precision output is at least the unit roundoff of its dtype (one
rounding); RTOL_MARGIN = 2 allows one rounding on each side (a GPU test may round the
reference's gradient to the input dtype).  The absolute term holds what summation order
leaves (cancellation, values near zero), which varies with the shape and the seed; the
measured shapes are the largest of the Qwen3-8B chain and ATOL_MARGIN = 4 covers the rest.
An op class's entry (``elementwise``, ``reduction``, ``attention``, ``logprob``) is the
envelope of its ops' entries (py/batchinv/contract/tolerances.py).

    python tools/tolerance_table.py measure --out reports/tolerances/cpu.json  # ~15 min
    python tools/tolerance_table.py build --cpu reports/tolerances/cpu.json \\
        --gpu reports/tolerances/nvidia-h200.json --python --markdown
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "py"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from calibrate_tolerances import fit_error, python_literal, smallest_subnormal  # noqa: E402

# The ops of the table and their classes, in the table's order.
from batchinv.contract.tolerances import OPS  # noqa: E402

ATOL_MARGIN = 4
RTOL_MARGIN = 2
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
KINDS = ("forward", "grad")

INPUT_DTYPE_KEYED = ("token_logprobs",)
FP32_ON_CPU_ONLY = ("linear", "attention", "token_logprobs")

# Reduction lengths of the Qwen3-8B chain; the other dimensions are cut to keep the CPU
# measurement to minutes (a row's error does not depend on how many rows there are).
HIDDEN, INTERMEDIATE, VOCAB, HEAD_DIM = 4096, 12288, 151936, 128
THETA, EPS = 1_000_000.0, 1e-6
# The float64 weight and its gradient of the full vocabulary would not fit this machine's
# memory; the log-sum-exp over 151936 columns is measured by the log_softmax case.
LOGPROB_VOCAB = 32768


# The relative terms at which the measurements record the absolute term each one needs:
# 0 and the powers of two from fp32's unit roundoff to 2^-3.
RTOL_STEPS = (0.0, *(2.0**-e for e in range(24, 2, -1)))


def atol_at_rtol(actual: torch.Tensor, exact: torch.Tensor) -> dict[str, float]:
    """For each relative term in RTOL_STEPS, the smallest absolute term that bounds every
    element: ``max(|d| - rtol*|ref|, 0)``.  Several outputs (or measurements) then share one
    bound exactly: at a given rtol, the atol they need is the largest of theirs."""
    diff = (actual.double() - exact.double()).abs()
    magnitude = exact.double().abs()
    return {repr(rtol): float((diff - rtol * magnitude).clamp_min(0).max()) for rtol in RTOL_STEPS}


def _randn(shape, gen, dtype, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


def _pairs(low_fn, exact_fn, inputs, grad_on, cotangents):
    """Forward and input-gradient pairs (actual, float64) of ``low_fn`` vs ``exact_fn``."""
    low = [t.detach().clone().requires_grad_(i in grad_on) for i, t in enumerate(inputs)]
    hi = [
        (t.detach().double() if t.is_floating_point() else t).requires_grad_(i in grad_on)
        for i, t in enumerate(inputs)
    ]
    out_low, out_hi = low_fn(*low), exact_fn(*hi)
    if not isinstance(out_low, tuple):
        out_low, out_hi = (out_low,), (out_hi,)
    pairs = [
        ("forward", f"out{i}", a, b) for i, (a, b) in enumerate(zip(out_low, out_hi, strict=True))
    ]
    if grad_on:
        cots = cotangents(out_low)
        grads_low = torch.autograd.grad(out_low, [low[i] for i in grad_on], cots)
        grads_hi = torch.autograd.grad(out_hi, [hi[i] for i in grad_on], [c.double() for c in cots])
        for i, a, b in zip(grad_on, grads_low, grads_hi, strict=True):
            pairs.append(("grad", f"grad{i}", a, b))
    return pairs


def _cotangents(gen):
    def make(outputs):
        return [_randn(o.shape, gen, o.dtype) for o in outputs]

    return make


# ----- float64 definitions (plain torch, the same inputs) -------------------------------------


def _silu_mul64(g, u):
    return g * torch.sigmoid(g) * u


def _rope64(q, k, positions):
    from batchinv.reference.rope import rope_inv_freq

    # The definition's angles are fp32 (HF's inv_freq and product); cos/sin are exact here.
    angles = (positions.float()[:, None] * rope_inv_freq(q.shape[-1], THETA)).double()
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]

    def rotate(x):
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    return rotate(q), rotate(k)


def _rms_norm64(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def _fused_add_rms_norm64(x, residual, w):
    new_residual = x + residual
    return _rms_norm64(new_residual, w), new_residual


def _attention64(q, k, v):
    """Causal GQA, queries the last tokens (bottom-right); [B, S, H, d] layout."""
    group = q.shape[2] // k.shape[2]
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    kh, vh = kh.repeat_interleave(group, 1), vh.repeat_interleave(group, 1)
    scores = qh @ kh.transpose(-1, -2) / math.sqrt(q.shape[-1])
    sq, sk = q.shape[1], k.shape[1]
    visible = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq)
    scores = scores.masked_fill(~visible, float("-inf"))
    return (torch.softmax(scores, -1) @ vh).transpose(1, 2)


def _token_logprobs64(h, w, targets):
    logp = torch.log_softmax(h @ w.t(), -1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, targets[:, None])[:, 0], entropy


def _embedding64(ids, w):
    return w[ids]


# ----- CPU cases ------------------------------------------------------------------------------


def cpu_cases():
    """(op, case, shape, function(dtype, gen) -> pairs)."""
    # Imported here: building the table from measurements needs no batchinv.
    import batchinv.reference as ref

    def silu(dtype, gen):
        g, u = _randn((16, INTERMEDIATE), gen, dtype, 2.0), _randn((16, INTERMEDIATE), gen, dtype)
        return _pairs(ref.silu_mul.silu_mul, _silu_mul64, (g, u), (0, 1), _cotangents(gen))

    def rope(dtype, gen):
        q = _randn((64, 8, HEAD_DIM), gen, dtype)
        k = _randn((64, 2, HEAD_DIM), gen, dtype)
        positions = torch.randint(0, 40960, (64,), generator=gen)

        def low(q, k, positions):
            return ref.rope.rope(q, k, positions, theta=THETA, max_position=40960)

        return _pairs(low, _rope64, (q, k, positions), (0, 1), _cotangents(gen))

    def embedding(dtype, gen):
        w = _randn((1000, 256), gen, dtype)
        ids = torch.randint(0, 50, (400,), generator=gen)
        return _pairs(
            lambda ids, w: ref.embedding.embedding_with_grad(ids, w),
            _embedding64,
            (ids, w),
            (1,),
            _cotangents(gen),
        )

    def rms_norm(dtype, gen):
        scales = torch.logspace(-3, 1, 32)[:, None]
        x = (torch.randn((32, HIDDEN), generator=gen) * scales).to(dtype)
        w = (1.0 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(dtype)

        def low(x, w):
            return ref.rms_norm.rms_norm(x, w, EPS)

        return _pairs(low, _rms_norm64, (x, w), (0, 1), _cotangents(gen))

    def fused_add_rms_norm(dtype, gen):
        # The reference rounds the residual sum to dtype and normalises the rounded value;
        # float64 does neither: the measurement holds that rounding carried through the norm.
        scales = torch.logspace(-3, 1, 32)[:, None]
        x = (torch.randn((32, HIDDEN), generator=gen) * scales).to(dtype)
        residual = _randn((32, HIDDEN), gen, dtype, 4.0)
        w = (1.0 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(dtype)

        def low(x, residual, w):
            return ref.rms_norm.fused_add_rms_norm(x, residual, w, EPS)

        return _pairs(low, _fused_add_rms_norm64, (x, residual, w), (0, 1, 2), _cotangents(gen))

    def linear(dtype, gen):
        x = _randn((8, INTERMEDIATE), gen, dtype)
        w = _randn((512, INTERMEDIATE), gen, dtype, INTERMEDIATE**-0.5)
        return _pairs(ref.linear.linear, F.linear, (x, w), (0, 1), _cotangents(gen))

    def attention(dtype, gen):
        q = _randn((1, 512, 4, HEAD_DIM), gen, dtype)
        k = _randn((1, 512, 1, HEAD_DIM), gen, dtype)
        v = _randn((1, 512, 1, HEAD_DIM), gen, dtype)

        def low(q, k, v):
            return ref.attention.attention(q, k, v, causal=True)

        return _pairs(low, _attention64, (q, k, v), (0, 1, 2), _cotangents(gen))

    def attention_decode(dtype, gen):
        q = _randn((2, 1, 4, HEAD_DIM), gen, dtype)
        k = _randn((2, 4100, 1, HEAD_DIM), gen, dtype)
        v = _randn((2, 4100, 1, HEAD_DIM), gen, dtype)

        def low(q, k, v):
            return ref.attention.attention(q, k, v, causal=True)

        return _pairs(low, _attention64, (q, k, v), (), None)

    def log_softmax(dtype, gen):
        x = _randn((4, VOCAB), gen, dtype, 3.0)
        pairs = _pairs(
            ref.log_softmax.log_softmax,
            lambda x: torch.log_softmax(x, -1),
            (x,),
            (0,),
            _cotangents(gen),
        )
        with torch.no_grad():
            rounded = ref.log_softmax.log_softmax(x, out_dtype=dtype)
        pairs.append(("forward", "out_in_dtype", rounded, torch.log_softmax(x.double(), -1)))
        return pairs

    def token_logprobs(dtype, gen):
        h = _randn((4, HIDDEN), gen, dtype)
        w = _randn((LOGPROB_VOCAB, HIDDEN), gen, dtype, 3.0 * HIDDEN**-0.5)
        targets = torch.randint(0, LOGPROB_VOCAB, (4,), generator=gen)

        def low(h, w, targets):
            return ref.token_logprobs.token_logprobs(h, w, targets, return_entropy=True)

        def cot(outputs):  # fp32 outputs: fp32 cotangents
            return [torch.randn(o.shape, generator=gen) for o in outputs]

        return _pairs(low, _token_logprobs64, (h, w, targets), (0, 1), cot)

    return [
        ("silu_mul", "silu_mul", f"gate,up [16, {INTERMEDIATE}]", silu),
        ("rope", "rope", f"q [64, 8, {HEAD_DIM}] k [64, 2, {HEAD_DIM}], positions < 40960", rope),
        ("embedding", "embedding", "ids [400] (50 distinct) weight [1000, 256]", embedding),
        ("rms_norm", "rms_norm", f"x [32, {HIDDEN}], row scales 1e-3..10", rms_norm),
        (
            "fused_add_rms_norm",
            "fused_add_rms_norm",
            f"x, residual [32, {HIDDEN}], row scales 1e-3..10",
            fused_add_rms_norm,
        ),
        ("linear", "linear", f"x [8, {INTERMEDIATE}] W [512, {INTERMEDIATE}]", linear),
        ("attention", "attention causal", f"B=1 S=512 heads 4/1 d={HEAD_DIM}", attention),
        (
            "attention",
            "attention decode",
            f"B=2 Sq=1 Sk=4100 heads 4/1 d={HEAD_DIM}",
            attention_decode,
        ),
        ("log_softmax", "log_softmax", f"logits [4, {VOCAB}]", log_softmax),
        (
            "token_logprobs",
            "token_logprobs",
            f"h [4, {HIDDEN}] W [{LOGPROB_VOCAB}, {HIDDEN}]",
            token_logprobs,
        ),
    ]


def measure(out_path: str, seed: int, only: set[str]) -> None:
    """Writes the CPU measurement to ``out_path``; with ``only``, re-measures those ops and
    keeps the other ops' results already in the file."""
    torch.set_float32_matmul_precision("highest")
    report = {
        "tool": "tools/tolerance_table.py measure",
        "torch": torch.__version__,
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "against": "float64 on the same rounded inputs",
        "results": [],
    }
    if only and Path(out_path).exists():
        kept = json.loads(Path(out_path).read_text())["results"]
        report["results"] = [r for r in kept if r["op"] not in only]
    for op, name, shape, fn in cpu_cases():
        if only and op not in only:
            continue
        for dtype_name, dtype in DTYPES.items():
            start = time.perf_counter()
            for kind, output, actual, exact in fn(dtype, torch.Generator().manual_seed(seed)):
                actual, exact = actual.detach(), exact.detach()
                fit = fit_error(actual, exact)
                report["results"].append(
                    {
                        "op": op,
                        "case": name,
                        "shape": shape,
                        "dtype": dtype_name,
                        "kind": kind,
                        "output": output,
                        "actual_dtype": str(actual.dtype).removeprefix("torch."),
                        "seed": seed,
                        "max_abs": fit.max_abs,
                        "max_rel_above_median": fit.max_rel,
                        "atol_fit": fit.atol,
                        "rtol_fit": fit.rtol,
                        "median_ref": float(exact.abs().median()),
                        "atol_at_rtol": atol_at_rtol(actual, exact),
                    }
                )
            print(f"{name:<20} {dtype_name:<9} {time.perf_counter() - start:6.1f} s", flush=True)
            Path(out_path).write_text(json.dumps(report, indent=1) + "\n")


# ----- the table ------------------------------------------------------------------------------


def _envelope(rows):
    """(atol_fit, rtol_fit, max_abs, case names) over fitted rows, or None."""
    fitted = [r for r in rows if "atol_fit" in r]
    if not fitted:
        return None
    return (
        max(r["atol_fit"] for r in fitted),
        max(r["rtol_fit"] for r in fitted),
        max(r["max_abs"] for r in fitted),
        sorted({r["case"] for r in fitted}),
    )


def _round_up(value: float) -> float:
    """Two significant digits, rounded up, so the literal is readable and never tighter."""
    if value == 0:
        return 0.0
    exponent = math.floor(math.log10(abs(value))) - 1
    return math.ceil(value / 10**exponent * (1 - 1e-12)) * 10**exponent


def entry_dtype(row: dict) -> str:
    """The table dtype a measured output belongs to: its own dtype, as the check looks the
    entry up (an fp32 LSE or log-softmax from bf16 inputs is judged as fp32), except for the
    ops whose fp32 outputs are judged at their inputs' precision (``dtype=`` in the check)."""
    if row["op"] in INPUT_DTYPE_KEYED or "actual_dtype" not in row:
        return row["dtype"]
    return row["actual_dtype"]


def _atol_needed(row: dict, rtol: float) -> float:
    """The absolute term ``row`` needs at ``rtol``.  Measured at the steps of RTOL_STEPS (at
    another rtol, the step below it: the need only falls as rtol grows).  A measurement that
    predates ``atol_at_rtol`` gives the bound its fit implies,
    ``|d| - rtol|ref| <= min(a + max(r - rtol, 0) * max|ref|, max|d|)``."""
    if "atol_at_rtol" in row:
        below = max(step for step in RTOL_STEPS if step <= rtol)
        return row["atol_at_rtol"][repr(below)]
    implied = row["atol_fit"] + max(row["rtol_fit"] - rtol, 0.0) * row["max_ref"]
    return min(implied, row["max_abs"])


def joint_bound(rows: list[dict]) -> tuple[float, float, float]:
    """(atol, rtol, typical |ref|): one bound that holds for every row's elements.

    Candidates: the relative terms of RTOL_STEPS and the fits' own.  At each, the rows need
    the largest of their absolute terms; the candidate with the smallest bound at the largest
    of the rows' median |ref| is taken (a gradient whose median element is negligible, such as
    the lm_head's, would otherwise buy a small absolute term with a large relative one).
    """
    medians = [r["median_ref"] for r in rows if "median_ref" in r]
    typical = max(medians) if medians else 1.0
    candidates = sorted({*RTOL_STEPS, *(r["rtol_fit"] for r in rows if "atol_at_rtol" not in r)})
    best = None
    for rtol in candidates:
        atol = max(_atol_needed(r, rtol) for r in rows)
        if best is None or atol + rtol * typical < best[0] + best[1] * typical:
            best = (atol, rtol)
    return best[0], best[1], typical


def _describe(label: str, rows: list[dict]) -> str:
    env = _envelope(rows)
    outputs = sorted({f"{r['case']}/{r['output']}" for r in rows})
    return (
        f"{label}: max abs {env[2]:.3g}, fit {env[0]:.3g} + {env[1]:.3g}*|ref| "
        f"({', '.join(outputs)})"
    )


def _no_gpu_reason(op: str, dtype_name: str) -> str:
    if op == "embedding":
        return (
            "no GPU measurement: a gather copies rows (no rounding), the GPU tests compare "
            "it bitwise, and its gradient's per-id fp32 sums are measured on the CPU"
        )
    if dtype_name == "float32" and op in FP32_ON_CPU_ONLY:
        return "no GPU measurement: the CUDA kernels take bf16/fp16 (fp32 stays on the CPU)"
    return "no GPU measurement"


def build(cpu: dict, gpu: dict | None) -> dict:
    """{(op, dtype, kind): (atol, rtol, note)} for every op, dtype and kind measured."""
    gpu_name = gpu.get("device", "GPU") if gpu else "GPU"
    rows = {"cpu": cpu["results"], "gpu": gpu["results"] if gpu else []}
    for row in rows["gpu"]:
        if row["case"] == "fused_add_rms_norm":  # filed under rms_norm by earlier runs
            row["op"] = "fused_add_rms_norm"
    table = {}
    for op in OPS:
        for dtype_name, dtype in DTYPES.items():
            for kind in KINDS:
                picked = {
                    side: [
                        r
                        for r in side_rows
                        if r["op"] == op
                        and entry_dtype(r) == dtype_name
                        and r["kind"] == kind
                        and "atol_fit" in r
                    ]
                    for side, side_rows in rows.items()
                }
                every = picked["cpu"] + picked["gpu"]
                if not every:
                    continue
                atol_fit, rtol_fit, typical = joint_bound(every)
                atol = _round_up(ATOL_MARGIN * max(atol_fit, smallest_subnormal(dtype)))
                rtol = _round_up(RTOL_MARGIN * rtol_fit)
                parts = [
                    f"{ATOL_MARGIN}x atol and {RTOL_MARGIN}x rtol of the joint bound "
                    f"{atol_fit:.3g} + {rtol_fit:.3g}*|ref| (chosen at |ref| = {typical:.3g})"
                ]
                if picked["gpu"]:
                    parts.append(_describe(f"{gpu_name} op vs fp32 reference", picked["gpu"]))
                else:
                    parts.append(_no_gpu_reason(op, dtype_name))
                if picked["cpu"]:
                    parts.append(_describe("CPU reference vs float64", picked["cpu"]))
                table[(op, dtype_name, kind)] = (atol, rtol, ". ".join(parts))
    return table


def markdown(table) -> str:
    lines = [
        "| op | dtype | kind | atol | rtol | derivation |",
        "|---|---|---|---|---|---|",
    ]
    for (op, dtype_name, kind), (atol, rtol, note) in table.items():
        cell = note.replace("|", "\\|")
        lines.append(f"| {op} | {dtype_name} | {kind} | {atol:.2g} | {rtol:.2g} | {cell} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="measure the CPU references against float64")
    m.add_argument("--out", required=True)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--only", default="", help="comma-separated ops to re-measure")
    b = sub.add_parser("build", help="print the table from the measurements")
    b.add_argument("--cpu", required=True, help="JSON from `measure`")
    b.add_argument("--gpu", help="JSON from tools/measure_op_error.py on a card")
    b.add_argument("--python", action="store_true", help="print the _TABLE literal")
    b.add_argument("--markdown", action="store_true", help="print the derivation table")
    args = parser.parse_args()
    if args.command == "measure":
        measure(args.out, args.seed, set(filter(None, args.only.split(","))))
        return
    cpu = json.loads(Path(args.cpu).read_text())
    gpu = json.loads(Path(args.gpu).read_text()) if args.gpu else None
    table = build(cpu, gpu)
    for (op, dtype_name, kind), (atol, rtol, _) in table.items():
        print(f"{op:<15} {dtype_name:<9} {kind:<8} {atol:10.2g} {rtol:10.2g}")
    if args.python:
        print()
        print(python_literal(table))
    if args.markdown:
        print()
        print(markdown(table))


if __name__ == "__main__":
    main()

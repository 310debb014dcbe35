"""Measures the error of every public batchinv op against its strict fp32 reference.

For each op, dtype and kind (forward value, input gradient), at Qwen3-8B shapes (the
151936-column vocabulary for log_softmax and token_logprobs, contexts past the 2048-key
split for attention, a 1024-row linear), the op runs on ``--device`` and its reference
(``batchinv.reference.<op>_fp32``) runs on the same device from the same inputs.  The
reference's gradient is taken with respect to fp32 copies of the inputs, so it is never
rounded.  Each error is fitted as ``|d| <= atol + rtol*|ref|`` by
``calibrate_tolerances.fit_error``; the tolerance table is built from these fits
(docs/tolerances.md).

A case that raises (an op without a kernel for a dtype, say) is recorded with its error
and the run goes on; ``--budget-s`` stops starting new cases once that much time has
passed, and records the rest as not run.

    python tools/measure_op_error.py --out op_error.json                 # CUDA, full shapes
    python tools/measure_op_error.py --device cpu --quick --out cpu.json # plumbing check
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "py"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from calibrate_tolerances import fit_error  # noqa: E402
from tolerance_table import atol_at_rtol  # noqa: E402

import batchinv  # noqa: E402
from batchinv.contract import deterministic_context  # noqa: E402
from batchinv.provenance import source_commit  # noqa: E402
from batchinv.reference import attention as attention_ref  # noqa: E402
from batchinv.reference import embedding as embedding_ref  # noqa: E402
from batchinv.reference import linear as linear_ref  # noqa: E402
from batchinv.reference import log_softmax as log_softmax_ref  # noqa: E402
from batchinv.reference import rms_norm as rms_norm_ref  # noqa: E402
from batchinv.reference import rope as rope_ref  # noqa: E402
from batchinv.reference import silu_mul as silu_mul_ref  # noqa: E402
from batchinv.reference import token_logprobs as token_logprobs_ref  # noqa: E402
from batchinv.shapes import QWEN3_8B_LINEAR  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# Qwen3-8B.
HIDDEN, INTERMEDIATE, VOCAB = 4096, 12288, 151936
Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
ROPE_THETA, RMS_EPS = 1_000_000.0, 1e-6
LINEAR_SHAPES = {name: (k, n) for name, k, n in QWEN3_8B_LINEAR}


@dataclass
class Sizes:
    """The shapes of one run: full Qwen3-8B ones, or small ones for a CPU check."""

    tokens: int = 64
    hidden: int = HIDDEN
    intermediate: int = INTERMEDIATE
    vocab: int = VOCAB
    q_heads: int = Q_HEADS
    kv_heads: int = KV_HEADS
    head_dim: int = HEAD_DIM
    linear: tuple[tuple[str, int, int, int], ...] = (
        ("o_proj", 64, *LINEAR_SHAPES["o_proj"]),
        ("down_proj", 64, *LINEAR_SHAPES["down_proj"]),
        ("o_proj", 1024, *LINEAR_SHAPES["o_proj"]),
    )
    prefill: int = 2560  # keys past the 2048-key split
    decode_context: int = 4100  # two split boundaries, a short last block
    chunk_queries: int = 64
    max_position: int = 40960
    embedding_tokens: int = 512
    embedding_vocab: int = 16384  # its error does not depend on the vocabulary size


QUICK = Sizes(
    tokens=6,
    hidden=256,
    intermediate=384,
    vocab=3000,
    q_heads=4,
    kv_heads=2,
    head_dim=64,
    linear=(("small", 5, 192, 96),),
    prefill=160,
    decode_context=300,
    chunk_queries=8,
    max_position=4096,
    embedding_tokens=40,
    embedding_vocab=1000,
)


@dataclass
class Measured:
    """What one case returns: named (actual, reference) pairs per kind."""

    pairs: list[tuple[str, str, torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def add(self, kind: str, output: str, actual: torch.Tensor, ref: torch.Tensor) -> None:
        self.pairs.append((kind, output, actual.detach(), ref.detach()))


def _randn(shape, gen, device, dtype, scale=1.0):
    # Drawn on the device: the vocabulary-sized weights would take seconds on the host.
    return (torch.randn(shape, generator=gen, device=device) * scale).to(dtype)


def _randint(high, shape, gen, device):
    return torch.randint(0, high, shape, generator=gen, device=device)


def _leaves(*tensors, dtype=None):
    """Fresh leaves requiring grad; ``dtype`` converts (fp32 leaves for the reference)."""
    return [
        (t.detach().to(dtype) if dtype else t.detach().clone()).requires_grad_(True)
        for t in tensors
    ]


def _grads(outputs, inputs, cotangents):
    return torch.autograd.grad(outputs, inputs, cotangents)


def _ref(fn, *args, **kwargs):
    with deterministic_context():
        return fn(*args, **kwargs)


def _two_inputs(op, ref_op, a, b, cot, grad_names, *args) -> Measured:
    """``op(a, b, *args)`` and its gradients in ``a`` and ``b`` (cotangent ``cot``) against
    ``ref_op`` on fp32 copies of the same inputs."""
    al, bl = _leaves(a, b)
    out = op(al, bl, *args)
    grads = _grads(out, (al, bl), cot)
    a32, b32 = _leaves(a, b, dtype=torch.float32)
    ref = _ref(ref_op, a32, b32, *args)
    ref_grads = _grads(ref, (a32, b32), cot.float())
    m = Measured()
    m.add("forward", "out", out, ref)
    for name, got, want in zip(grad_names, grads, ref_grads, strict=True):
        m.add("grad", name, got, want)
    return m


# ----- cases ---------------------------------------------------------------------------------
# Each case: (inputs on device in dtype) -> Measured.  Gradients use a random cotangent.


def case_silu_mul(s: Sizes, dtype, device, gen) -> Measured:
    gate = _randn((s.tokens, s.intermediate), gen, device, dtype, 2.0)
    up = _randn((s.tokens, s.intermediate), gen, device, dtype)
    cot = _randn((s.tokens, s.intermediate), gen, device, dtype)
    names = ("grad_gate", "grad_up")
    return _two_inputs(batchinv.silu_mul, silu_mul_ref.silu_mul_fp32, gate, up, cot, names)


def case_rope(s: Sizes, dtype, device, gen) -> Measured:
    q = _randn((s.tokens, s.q_heads, s.head_dim), gen, device, dtype)
    k = _randn((s.tokens, s.kv_heads, s.head_dim), gen, device, dtype)
    positions = _randint(s.max_position, (s.tokens,), gen, device)
    cq = _randn(q.shape, gen, device, dtype)
    ck = _randn(k.shape, gen, device, dtype)
    opts = {"theta": ROPE_THETA, "max_position": s.max_position}
    ql, kl = _leaves(q, k)
    out_q, out_k = batchinv.rope(ql, kl, positions, **opts)
    grads = _grads((out_q, out_k), (ql, kl), (cq, ck))
    q32, k32 = _leaves(q, k, dtype=torch.float32)
    ref_q, ref_k = _ref(rope_ref.rope_fp32, q32, k32, positions, **opts)
    ref_grads = _grads((ref_q, ref_k), (q32, k32), (cq.float(), ck.float()))
    m = Measured()
    m.add("forward", "q_rot", out_q, ref_q)
    m.add("forward", "k_rot", out_k, ref_k)
    m.add("grad", "grad_q", grads[0], ref_grads[0])
    m.add("grad", "grad_k", grads[1], ref_grads[1])
    return m


def _rms_rows(s: Sizes, width, gen, device, dtype, rows):
    # Rows of very different scales: small rows are where eps matters.
    scales = torch.logspace(-3, 1, rows, device=device)[:, None]
    x = torch.randn((rows, width), generator=gen, device=device) * scales
    weight = 1.0 + 0.1 * torch.randn(width, generator=gen, device=device)
    return x.to(dtype), weight.to(dtype)


def _rms_case(s: Sizes, dtype, device, gen, rows, width) -> Measured:
    x, weight = _rms_rows(s, width, gen, device, dtype, rows)
    cot = _randn(x.shape, gen, device, dtype)
    names = ("grad_x", "grad_weight")
    ref_op = rms_norm_ref.rms_norm_fp32
    return _two_inputs(batchinv.rms_norm, ref_op, x, weight, cot, names, RMS_EPS)


def case_rms_norm_hidden(s: Sizes, dtype, device, gen) -> Measured:
    return _rms_case(s, dtype, device, gen, s.tokens, s.hidden)


def case_rms_norm_head(s: Sizes, dtype, device, gen) -> Measured:
    # The per-head q/k norm: rows of head_dim.
    return _rms_case(s, dtype, device, gen, s.tokens * s.q_heads, s.head_dim)


def case_fused_add_rms_norm(s: Sizes, dtype, device, gen) -> Measured:
    x, weight = _rms_rows(s, s.hidden, gen, device, dtype, s.tokens)
    residual = _randn(x.shape, gen, device, dtype, 4.0)
    cot_y = _randn(x.shape, gen, device, dtype)
    cot_r = _randn(x.shape, gen, device, dtype)
    xl, rl, wl = _leaves(x, residual, weight)
    y, new_res = batchinv.fused_add_rms_norm(xl, rl, wl, RMS_EPS)
    grads = _grads((y, new_res), (xl, wl), (cot_y, cot_r))
    # The reference keeps the residual sum in fp32; the op rounds it to dtype (by design),
    # so the norm is compared from the op's rounded residual.
    n32, w32 = _leaves(new_res, weight, dtype=torch.float32)
    ref_y = _ref(rms_norm_ref.rms_norm_fp32, n32, w32, RMS_EPS)
    ref_sum = x.float() + residual.float()
    m = Measured()
    m.add("forward", "out", y, ref_y)
    m.add("forward", "new_residual", new_res, ref_sum)
    ref_grads = _grads(ref_y, (n32, w32), cot_y.float())
    m.add("grad", "grad_x", grads[0], ref_grads[0] + cot_r.float())
    m.add("grad", "grad_weight", grads[1], ref_grads[1])
    return m


def _linear_case(rows, k, n):
    def run(s: Sizes, dtype, device, gen) -> Measured:
        x = _randn((rows, k), gen, device, dtype)
        weight = _randn((n, k), gen, device, dtype, k**-0.5)
        cot = _randn((rows, n), gen, device, dtype)
        names = ("grad_x", "grad_weight")
        return _two_inputs(batchinv.linear, linear_ref.linear_fp32, x, weight, cot, names)

    return run


def _qkv(s: Sizes, gen, device, dtype, batch, sq, sk):
    q = _randn((batch, sq, s.q_heads, s.head_dim), gen, device, dtype)
    k = _randn((batch, sk, s.kv_heads, s.head_dim), gen, device, dtype)
    v = _randn((batch, sk, s.kv_heads, s.head_dim), gen, device, dtype)
    return q, k, v


def case_attention_prefill(s: Sizes, dtype, device, gen) -> Measured:
    q, k, v = _qkv(s, gen, device, dtype, 1, s.prefill, s.prefill)
    cot = _randn(q.shape, gen, device, dtype)
    leaves = _leaves(q, k, v)
    out, lse = batchinv.attention(*leaves, causal=True, return_lse=True)
    grads = _grads(out, leaves, cot)
    leaves32 = _leaves(q, k, v, dtype=torch.float32)
    ref, ref_lse = attention_ref.attention_fp32(*leaves32, causal=True, return_lse=True)
    ref_grads = _grads(ref, leaves32, cot.float())
    m = Measured()
    m.add("forward", "out", out, ref)
    m.add("forward", "lse", lse, ref_lse)
    for name, got, want in zip(("grad_q", "grad_k", "grad_v"), grads, ref_grads, strict=True):
        m.add("grad", name, got, want)
    return m


def case_attention_decode(s: Sizes, dtype, device, gen) -> Measured:
    # One query per sequence against a long context, and a chunk of queries: the split-KV
    # decode path and the chunked-prefill alignment.
    m = Measured()
    for label, sq in (("decode", 1), ("chunk", s.chunk_queries)):
        q, k, v = _qkv(s, gen, device, dtype, 2, sq, s.decode_context)
        with torch.no_grad():
            out, lse = batchinv.attention(q, k, v, causal=True, return_lse=True)
            ref, ref_lse = attention_ref.attention_fp32(q, k, v, causal=True, return_lse=True)
        m.add("forward", f"{label}_out", out, ref)
        m.add("forward", f"{label}_lse", lse, ref_lse)
    return m


def case_log_softmax(s: Sizes, dtype, device, gen) -> Measured:
    x = _randn((s.tokens, s.vocab), gen, device, dtype, 3.0)
    cot = _randn(x.shape, gen, device, torch.float32)
    (xl,) = _leaves(x)
    out = batchinv.log_softmax(xl)  # fp32 out, the default
    (grad,) = _grads(out, (xl,), cot)
    with torch.no_grad():
        out_low = batchinv.log_softmax(x, out_dtype=dtype)
    (x32,) = _leaves(x, dtype=torch.float32)
    ref = log_softmax_ref.log_softmax_fp32(x32)
    (ref_grad,) = _grads(ref, (x32,), cot)
    m = Measured()
    m.add("forward", "out", out, ref)
    m.add("forward", "out_in_dtype", out_low, ref)
    m.add("grad", "grad_x", grad, ref_grad)
    return m


def case_token_logprobs(s: Sizes, dtype, device, gen) -> Measured:
    return _token_logprobs(s.tokens, s.hidden, s.vocab, 3.0 * s.hidden**-0.5, dtype, device, gen)


def case_token_logprobs_sharp(s: Sizes, dtype, device, gen) -> Measured:
    # A small H with larger weights: logits of std ~4 and a sharper softmax, where the bf16
    # rounding of d_z leaves a larger absolute error in d_hidden than at the Qwen3 shape; the
    # partial token tiles, column tiles and vocabulary chunks of the kernels' backward.
    tokens, hidden, vocab = SHARP_TOKEN_LOGPROBS
    return _token_logprobs(tokens, hidden, vocab, hidden**-0.25, dtype, device, gen)


SHARP_TOKEN_LOGPROBS = (300, 320, 9000)  # tokens, hidden, vocab


def _token_logprobs(tokens, hidden_size, vocab, weight_scale, dtype, device, gen) -> Measured:
    hidden = _randn((tokens, hidden_size), gen, device, dtype)
    weight = _randn((vocab, hidden_size), gen, device, dtype, weight_scale)
    targets = _randint(vocab, (tokens,), gen, device)
    cot_lp = _randn((tokens,), gen, device, torch.float32)
    cot_ent = _randn((tokens,), gen, device, torch.float32)
    hl, wl = _leaves(hidden, weight)
    logprob, entropy = batchinv.token_logprobs(hl, wl, targets, return_entropy=True)
    grads = _grads((logprob, entropy), (hl, wl), (cot_lp, cot_ent))
    h32, w32 = _leaves(hidden, weight, dtype=torch.float32)
    ref_lp, ref_ent = token_logprobs_ref.token_logprobs_fp32(h32, w32, targets, return_entropy=True)
    ref_grads = _grads((ref_lp, ref_ent), (h32, w32), (cot_lp, cot_ent))
    m = Measured()
    m.add("forward", "logprob", logprob, ref_lp)
    m.add("forward", "entropy", entropy, ref_ent)
    m.add("grad", "grad_hidden", grads[0], ref_grads[0])
    m.add("grad", "grad_weight", grads[1], ref_grads[1])
    return m


def case_embedding(s: Sizes, dtype, device, gen) -> Measured:
    weight = _randn((s.embedding_vocab, s.hidden), gen, device, dtype)
    # Repeated ids: their gradients are sums.
    ids = _randint(64, (s.embedding_tokens,), gen, device)
    cot = _randn((s.embedding_tokens, s.hidden), gen, device, dtype)
    (wl,) = _leaves(weight)
    out = batchinv.embedding(ids, wl)
    (grad,) = _grads(out, (wl,), cot)
    # On the host: the reference's backward builds its index tensors on the CPU.
    (w32,) = _leaves(weight.cpu(), dtype=torch.float32)
    ref = embedding_ref.embedding_with_grad(ids.cpu(), w32)
    (ref_grad,) = _grads(ref, (w32,), cot.float().cpu())
    m = Measured()
    m.add("forward", "out", out, ref.to(device))
    m.add("grad", "grad_weight", grad, ref_grad.to(device))
    return m


def cases(s: Sizes) -> list[tuple[str, str, str, Callable]]:
    """(op, case name, shape, function); cheap cases first, so a time limit cuts the dearest."""
    out = [
        ("silu_mul", "silu_mul", f"gate,up [{s.tokens}, {s.intermediate}]", case_silu_mul),
        (
            "rope",
            "rope",
            f"q [{s.tokens}, {s.q_heads}, {s.head_dim}] k [.., {s.kv_heads}, ..] "
            f"positions < {s.max_position}",
            case_rope,
        ),
        ("rms_norm", "rms_norm hidden", f"x [{s.tokens}, {s.hidden}]", case_rms_norm_hidden),
        (
            "rms_norm",
            "rms_norm per head",
            f"x [{s.tokens * s.q_heads}, {s.head_dim}]",
            case_rms_norm_head,
        ),
        (
            "fused_add_rms_norm",
            "fused_add_rms_norm",
            f"x,residual [{s.tokens}, {s.hidden}]",
            case_fused_add_rms_norm,
        ),
        (
            "embedding",
            "embedding",
            f"ids [{s.embedding_tokens}] weight [{s.embedding_vocab}, {s.hidden}]",
            case_embedding,
        ),
    ]
    for name, rows, k, n in s.linear:
        out.append(
            (
                "linear",
                f"linear {name} M={rows}",
                f"x [{rows}, {k}] W [{n}, {k}]",
                _linear_case(rows, k, n),
            )
        )
    out += [
        (
            "attention",
            "attention decode/chunk",
            f"B=2 Sq=1 and {s.chunk_queries}, Sk={s.decode_context}, heads "
            f"{s.q_heads}/{s.kv_heads}, d={s.head_dim}",
            case_attention_decode,
        ),
        (
            "attention",
            "attention prefill causal",
            f"B=1 S={s.prefill}, heads {s.q_heads}/{s.kv_heads}, d={s.head_dim}",
            case_attention_prefill,
        ),
        ("log_softmax", "log_softmax", f"logits [{s.tokens}, {s.vocab}]", case_log_softmax),
        (
            "token_logprobs",
            "token_logprobs",
            f"hidden [{s.tokens}, {s.hidden}] W [{s.vocab}, {s.hidden}]",
            case_token_logprobs,
        ),
        (
            "token_logprobs",
            "token_logprobs sharp",
            "hidden [{0}, {1}] W [{2}, {1}], W std {1}^-1/4".format(*SHARP_TOKEN_LOGPROBS),
            case_token_logprobs_sharp,
        ),
    ]
    return out


# ----- driver --------------------------------------------------------------------------------


def _fit(actual: torch.Tensor, ref: torch.Tensor) -> dict:
    a = actual.double()
    r = ref.double()
    finite = r.isfinite()
    record = {"elements": actual.numel()}
    mismatched = int((~finite & (a != r)).sum())
    if mismatched:
        record["nonfinite_mismatches"] = mismatched
    if not bool(finite.all()):  # a copy only where needed: the tensors can be large
        a, r = a[finite], r[finite]
    del finite
    if not bool(a.isfinite().all()):
        record["nonfinite_actual"] = int((~a.isfinite()).sum())
        return record
    if a.numel() == 0:
        return record
    fit = fit_error(a, r)
    record.update(
        max_abs=fit.max_abs,
        max_rel_above_median=fit.max_rel,
        atol_fit=fit.atol,
        rtol_fit=fit.rtol,
        max_ref=float(r.abs().max()),
        median_ref=float(r.abs().median()),
        bitwise_equal_fraction=float((a == r).double().mean()),
        atol_at_rtol=atol_at_rtol(a, r),
    )
    return record


def run_case(op, name, shape, fn, sizes, dtype_name, device, seed) -> list[dict]:
    dtype = DTYPES[dtype_name]
    gen = torch.Generator(device=device).manual_seed(seed)
    measured = fn(sizes, dtype, device, gen)
    rows = []
    for kind, output, actual, ref in measured.pairs:
        row = {
            "op": op,
            "case": name,
            "shape": shape,
            "dtype": dtype_name,
            "kind": kind,
            "output": output,
            "actual_dtype": str(actual.dtype).removeprefix("torch."),
            "seed": seed,
        }
        row.update(_fit(actual, ref))
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="small shapes (a plumbing check)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtypes", default="bfloat16,float16,float32")
    parser.add_argument("--only", default="", help="comma-separated ops to measure")
    parser.add_argument("--budget-s", type=float, default=90.0)
    args = parser.parse_args()

    start = time.perf_counter()
    torch.set_float32_matmul_precision("highest")
    device = torch.device(args.device)
    sizes = QUICK if args.quick else Sizes()
    only = set(filter(None, args.only.split(",")))
    dtype_names = [d for d in args.dtypes.split(",") if d]
    report = {
        "tool": "tools/measure_op_error.py",
        "commit": source_commit(ROOT),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "quick": args.quick,
        "fit": "|d| <= atol_fit + rtol_fit*|ref| (calibrate_tolerances.fit_error)",
        "results": [],
        "errors": [],
        "not_run": [],
    }

    def write():
        report["elapsed_s"] = round(time.perf_counter() - start, 2)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")

    for op, name, shape, fn in cases(sizes):
        if only and op not in only:
            continue
        for dtype_name in dtype_names:
            label = f"{name} {dtype_name}"
            if time.perf_counter() - start > args.budget_s:
                report["not_run"].append({"op": op, "case": name, "dtype": dtype_name})
                print(f"not run (time budget): {label}", flush=True)
                continue
            case_start = time.perf_counter()
            try:
                rows = run_case(op, name, shape, fn, sizes, dtype_name, device, args.seed)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                for row in rows:
                    row["case_seconds"] = round(time.perf_counter() - case_start, 3)
                report["results"] += rows
                worst = max(
                    (r.get("max_abs", math.nan) for r in rows), default=math.nan, key=_nan_low
                )
                print(
                    f"{label:<44} {time.perf_counter() - case_start:6.2f} s  max abs {worst:.3g}",
                    flush=True,
                )
            except Exception as error:  # one failing case must not lose the others
                report["errors"].append(
                    {
                        "op": op,
                        "case": name,
                        "dtype": dtype_name,
                        "error": f"{type(error).__name__}: {error}"[:2000],
                        "traceback": traceback.format_exc()[-4000:],
                    }
                )
                print(f"{label:<44} ERROR {type(error).__name__}: {error}"[:300], flush=True)
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            write()
    write()
    print(
        f"{len(report['results'])} results, {len(report['errors'])} errors, "
        f"{len(report['not_run'])} not run, {report['elapsed_s']} s -> {args.out}"
    )


def _nan_low(value: float) -> float:
    return -math.inf if math.isnan(value) else value


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()

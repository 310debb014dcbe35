"""Measures the error that defines batchinv's Axis-B tolerance table.

For every op class and dtype, a stock PyTorch computation in that dtype (the same-precision
baseline) is compared against a float64 computation of the same definition from the SAME
inputs (the low-precision inputs upcast exactly), forward and input gradient (autograd
with a random cotangent).  Only the computation's error is measured, not the rounding of
the inputs, because Axis-B also gives the reference the already-rounded inputs.

Each measured error is summarised as a two-term bound ``|d| <= atol_fit + rtol_fit*|ref|``
(see ``fit_error``: ``rtol_fit`` is the largest relative error over the elements with large
|ref|, ``atol_fit`` the largest remainder ``|d| - rtol_fit*|ref|``, i.e. what relative error
cannot explain: cancellation, values near zero).  The table
entry is ``MULTIPLE`` times the envelope of these over the cases of the class and seeds,
with atol floored at the dtype's smallest subnormal (fp16 has a wide subnormal range where
relative error is meaningless).

Plain torch only (no batchinv import), CPU, a few minutes on two cores:

    python tools/calibrate_tolerances.py            # measure, print tables
    python tools/calibrate_tolerances.py --python   # also print the _TABLE literal for
                                                    # py/batchinv/contract/tolerances.py
    python tools/calibrate_tolerances.py --markdown # also print the table for the docs
"""

from __future__ import annotations

import argparse
import json
import math
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MULTIPLE = 4
SEEDS = (0, 1)
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


@dataclass
class Case:
    op_class: str
    name: str
    shape: str
    # make(dtype, generator) -> inputs (tuple of tensors in dtype); the grad flows to those
    # listed in grad_inputs.
    make: Callable[[torch.dtype, torch.Generator], tuple[torch.Tensor, ...]]
    # run gets the inputs in the low-precision dtype, run_reference the same values in
    # float64; both implement one definition.
    run: Callable[[tuple[torch.Tensor, ...]], torch.Tensor]
    run_reference: Callable[[tuple[torch.Tensor, ...]], torch.Tensor]
    grad_inputs: tuple[int, ...]  # empty: forward only


def _randn(shape, dtype, gen, scale=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * scale).to(dtype)


# ----- elementwise -------------------------------------------------------------------------

SILU_SHAPE = (128, 12288)


def _silu_mul(inputs):
    g, u = inputs
    return F.silu(g) * u


def _silu_mul_ref(inputs):
    g, u = inputs
    return g * torch.sigmoid(g) * u


ROPE_TOKENS, ROPE_HEADS, ROPE_DIM = 512, 8, 128


def _rope_make(dtype, gen):
    x = _randn((ROPE_TOKENS, ROPE_HEADS, ROPE_DIM), dtype, gen)
    inv_freq = 1.0 / (1_000_000.0 ** (torch.arange(0, ROPE_DIM, 2, dtype=torch.float64) / ROPE_DIM))
    angles = torch.arange(ROPE_TOKENS, dtype=torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    # cos/sin as the HF stock code hands them to the rotation: in the activation dtype.
    cos = angles.cos()[:, None, :].to(dtype)
    sin = angles.sin()[:, None, :].to(dtype)
    return x, cos, sin


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _rope(inputs):
    x, cos, sin = inputs
    return x * cos + _rotate_half(x) * sin


# ----- reduction ---------------------------------------------------------------------------

NORM_ROWS, NORM_HIDDEN, NORM_EPS = 128, 4096, 1e-6


def _rms_make(dtype, gen):
    x = _randn((NORM_ROWS, NORM_HIDDEN), dtype, gen)
    weight = (1.0 + 0.1 * torch.randn(NORM_HIDDEN, generator=gen)).to(dtype)
    return x, weight


def _rms_norm(inputs):
    x, weight = inputs
    return F.rms_norm(x, (NORM_HIDDEN,), weight, eps=NORM_EPS)


def _rms_norm_ref(inputs):
    x, weight = inputs
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + NORM_EPS) * weight


# K = 12288 is the longest reduction of the Qwen3-8B chain (down_proj); errors grow with K.
LINEAR_M, LINEAR_K, LINEAR_N = 16, 12288, 4096


def _linear_make(dtype, gen):
    x = _randn((LINEAR_M, LINEAR_K), dtype, gen)
    weight = _randn((LINEAR_N, LINEAR_K), dtype, gen, scale=LINEAR_K**-0.5)
    return x, weight


def _linear(inputs):
    x, weight = inputs
    return F.linear(x, weight)


# ----- attention ---------------------------------------------------------------------------

ATTN_SEQ, ATTN_DIM, ATTN_Q_HEADS, ATTN_KV_HEADS = 512, 128, 8, 2


def _attn_make(dtype, gen):
    q = _randn((1, ATTN_Q_HEADS, ATTN_SEQ, ATTN_DIM), dtype, gen)
    k = _randn((1, ATTN_KV_HEADS, ATTN_SEQ, ATTN_DIM), dtype, gen)
    v = _randn((1, ATTN_KV_HEADS, ATTN_SEQ, ATTN_DIM), dtype, gen)
    return q, k, v


def _sdpa_math(inputs):
    q, k, v = inputs
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _sdpa_flash_cpu(inputs):
    """torch's CPU flash kernel: like GPU flash kernels it rounds P to the input dtype."""
    q, k, v = inputs
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _attention_ref(inputs):
    q, k, v = inputs
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


# ----- logprob -----------------------------------------------------------------------------

LOGITS_ROWS, VOCAB = 32, 32768
TOKENS, HIDDEN = 16, 2048


def _logits_make(dtype, gen):
    return (_randn((LOGITS_ROWS, VOCAB), dtype, gen, scale=3.0),)


def _log_softmax(inputs):
    (logits,) = inputs
    return torch.log_softmax(logits, dim=-1)


def _token_logprob_make(dtype, gen):
    hidden = _randn((TOKENS, HIDDEN), dtype, gen)
    lm_head = _randn((VOCAB, HIDDEN), dtype, gen, scale=3.0 * HIDDEN**-0.5)
    targets = torch.randint(0, VOCAB, (TOKENS,), generator=gen)
    return hidden, lm_head, targets


def _token_logprob(inputs):
    """The stock unfused path: linear in the input dtype -> fp32 log_softmax -> gather."""
    hidden, lm_head, targets = inputs
    logits = F.linear(hidden, lm_head)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return logprobs.gather(-1, targets[:, None])[:, 0]


def _token_logprob_ref(inputs):
    hidden, lm_head, targets = inputs
    logprobs = torch.log_softmax(F.linear(hidden, lm_head), dim=-1)
    return logprobs.gather(-1, targets[:, None])[:, 0]


# ----- fixed-order fp32 variants ------------------------------------------------------------
# batchinv's references (and kernels that follow them) accumulate in fp32 in a fixed,
# sequential order and round once.  For float32 inputs a sequential sum over K = 4096 has a
# few times the error of BLAS's blocked sums, so the float32 entries must cover it too.
# Their backward passes are written out with the same sequential sums (autograd through the
# loops would store every step and reduce with torch's own order).


def _seq_sum(terms):
    """Left-to-right fp32 sum of the last dim of ``terms``."""
    acc = torch.zeros(terms.shape[:-1], dtype=torch.float32)
    for k in range(terms.shape[-1]):
        acc = acc + terms[..., k]
    return acc


def _seq_linear_fp32(x, weight):
    """``x @ weight.T`` in fp32, summed over the inner dim left to right."""
    xf, weight_t = x.float(), weight.float().t().contiguous()
    acc = torch.zeros(x.shape[0], weight.shape[0], dtype=torch.float32)
    for k in range(x.shape[1]):
        acc = acc + xf[:, k : k + 1] * weight_t[k : k + 1, :]
    return acc


class _SeqLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(weight)
        return _seq_linear_fp32(x, weight).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        (weight,) = ctx.saved_tensors
        return _seq_linear_fp32(grad_out, weight.t()).to(grad_out.dtype), None


def _seq_linear(inputs):
    return _SeqLinear.apply(*inputs)


class _SeqRmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        xf, wf = x.float(), weight.float()
        rstd = torch.rsqrt(_seq_sum(xf * xf) / NORM_HIDDEN + NORM_EPS)[:, None]
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd * wf).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, rstd = ctx.saved_tensors
        xf, gw = x.float(), grad_out.float() * weight.float()
        dot = _seq_sum(gw * xf)[:, None]
        grad_x = rstd * gw - xf * (rstd**3) * dot / NORM_HIDDEN
        return grad_x.to(x.dtype), None


def _seq_rms_norm(inputs):
    return _SeqRmsNorm.apply(*inputs)


def _seq_log_softmax_fp32(logits):
    xf = logits.float()
    row_max = xf.max(dim=-1, keepdim=True).values  # max is exact in any order
    lse = row_max[:, 0] + torch.log(_seq_sum(torch.exp(xf - row_max)))
    return xf - lse[:, None]


class _SeqLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits):
        logprobs = _seq_log_softmax_fp32(logits)
        ctx.save_for_backward(logprobs)
        return logprobs.to(logits.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        (logprobs,) = ctx.saved_tensors
        g = grad_out.float()
        return (g - torch.exp(logprobs) * _seq_sum(g)[:, None]).to(grad_out.dtype)


def _seq_log_softmax(inputs):
    return _SeqLogSoftmax.apply(*inputs)


def _seq_attention(inputs):
    """Online softmax over keys one at a time, fp32 state, one rounding at the end (forward
    only: its backward is the kernels' business; the grad entry comes from the math backend)."""
    q, k, v = (t.float() for t in inputs)
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scale = q.shape[-1] ** -0.5
    rows = torch.arange(q.shape[-2])[None, None, :]
    m = torch.full(q.shape[:-1], float("-inf"))
    denom = torch.zeros(q.shape[:-1])
    acc = torch.zeros(q.shape)
    for j in range(k.shape[-2]):
        score = _seq_sum(q * k[:, :, j : j + 1, :]) * scale
        visible = rows >= j
        m_new = torch.where(visible, torch.maximum(m, score), m)
        alpha = torch.exp(m - m_new).nan_to_num(0.0)  # exp(-inf - -inf) before the first key
        p = torch.where(visible, torch.exp(score - m_new), 0.0)
        denom = denom * alpha + p
        acc = acc * alpha[..., None] + p[..., None] * v[:, :, j : j + 1, :]
        m = m_new
    return (acc / denom[..., None]).to(inputs[0].dtype)


def _seq_token_logprob(inputs):
    """Fused path: fp32 logits (not rounded), fixed-order linear and log-sum-exp."""
    hidden, lm_head, targets = inputs
    logprobs = _seq_log_softmax_fp32(_seq_linear_fp32(hidden, lm_head))
    return logprobs.gather(-1, targets[:, None])[:, 0]


CASES = (
    Case(
        "elementwise",
        "silu(g)*u",
        f"g,u {SILU_SHAPE}",
        lambda d, g: (_randn(SILU_SHAPE, d, g, 2.0), _randn(SILU_SHAPE, d, g)),
        _silu_mul,
        _silu_mul_ref,
        (0, 1),
    ),
    Case(
        "elementwise",
        "rope rotation",
        f"x ({ROPE_TOKENS}, {ROPE_HEADS}, {ROPE_DIM})",
        _rope_make,
        _rope,
        _rope,
        (0,),
    ),
    Case(
        "reduction",
        "rms_norm",
        f"x ({NORM_ROWS}, {NORM_HIDDEN})",
        _rms_make,
        _rms_norm,
        _rms_norm_ref,
        (0,),
    ),
    Case(
        "reduction",
        "F.linear",
        f"x ({LINEAR_M}, {LINEAR_K}) W ({LINEAR_N}, {LINEAR_K})",
        _linear_make,
        _linear,
        _linear,
        (0,),
    ),
    Case(
        "reduction",
        "fixed-order rms_norm",
        f"x ({NORM_ROWS}, {NORM_HIDDEN})",
        _rms_make,
        _seq_rms_norm,
        _rms_norm_ref,
        (0,),
    ),
    Case(
        "reduction",
        "fixed-order linear",
        f"x ({LINEAR_M}, {LINEAR_K}) W ({LINEAR_N}, {LINEAR_K})",
        _linear_make,
        _seq_linear,
        _linear,
        (0,),
    ),
    Case(
        "attention",
        "math SDPA causal GQA",
        f"S={ATTN_SEQ} d={ATTN_DIM} heads {ATTN_Q_HEADS}/{ATTN_KV_HEADS}",
        _attn_make,
        _sdpa_math,
        _attention_ref,
        (0, 1, 2),
    ),
    # Forward only: its backward's bf16 error (max abs ~0.12) is ~5x the math backend's and
    # would make the attention grad entry too loose to catch anything.
    Case(
        "attention",
        "flash SDPA (CPU) causal GQA (fwd)",
        f"S={ATTN_SEQ} d={ATTN_DIM} heads {ATTN_Q_HEADS}/{ATTN_KV_HEADS}",
        _attn_make,
        _sdpa_flash_cpu,
        _attention_ref,
        (),
    ),
    Case(
        "attention",
        "fixed-order online softmax (fwd)",
        f"S={ATTN_SEQ} d={ATTN_DIM} heads {ATTN_Q_HEADS}/{ATTN_KV_HEADS}",
        _attn_make,
        _seq_attention,
        _attention_ref,
        (),
    ),
    Case(
        "logprob",
        "log_softmax",
        f"logits ({LOGITS_ROWS}, {VOCAB})",
        _logits_make,
        _log_softmax,
        _log_softmax,
        (0,),
    ),
    Case(
        "logprob",
        "fixed-order log_softmax",
        f"logits ({LOGITS_ROWS}, {VOCAB})",
        _logits_make,
        _seq_log_softmax,
        _log_softmax,
        (0,),
    ),
    Case(
        "logprob",
        "linear -> fp32 log_softmax -> gather",
        f"h ({TOKENS}, {HIDDEN}) W ({VOCAB}, {HIDDEN})",
        _token_logprob_make,
        _token_logprob,
        _token_logprob_ref,
        (0,),
    ),
    Case(
        "logprob",
        "fixed-order fused linear+logprob (fwd)",
        f"h ({TOKENS}, {HIDDEN}) W ({VOCAB}, {HIDDEN})",
        _token_logprob_make,
        _seq_token_logprob,
        _token_logprob_ref,
        (),
    ),
)


@dataclass
class Fit:
    max_abs: float
    max_rel: float  # over elements with |ref| >= median |ref|
    atol: float
    rtol: float


# The relative term of a fit is the largest relative error over the elements whose |ref| is
# at or above one of these quantiles of |ref|; the absolute term covers everything else.
RTOL_QUANTILES = (0.5, 0.75, 0.9, 0.99, 0.999, 1.0)


def fit_error(actual: torch.Tensor, reference: torch.Tensor) -> Fit:
    """The tightest two-term bound ``|d| <= atol + rtol*|ref|`` among a few candidates.

    Each candidate takes ``rtol`` from the elements above one quantile of |ref| and the
    smallest ``atol`` that makes the bound hold for every element; the candidate with the
    smallest bound at the median |ref| wins.  Pure rounding error comes out relative
    (atol ~ 0); error from rounded intermediates (flash attention rounds P) comes out with
    an absolute part, which is what a different but valid kernel also incurs.
    """
    diff = (actual.double() - reference).abs().reshape(-1)
    magnitude = reference.abs().reshape(-1)
    if not bool(diff.isfinite().all()):
        raise RuntimeError("non-finite error in calibration; the inputs are not realistic")
    magnitude_sorted, order = magnitude.sort()
    rel_sorted = diff[order] / magnitude_sorted.clamp_min(torch.finfo(torch.float64).tiny)
    rel_max_above = rel_sorted.flip(0).cummax(0).values.flip(0)  # max rel over [i:]
    count = magnitude.numel()
    typical = float(magnitude.median())
    best = None
    for q in RTOL_QUANTILES:
        start = min(int(q * count), count)
        rtol = float(rel_max_above[start]) if start < count else 0.0
        atol = float((diff - rtol * magnitude).clamp_min(0).max())
        if best is None or atol + rtol * typical < best[0] + best[1] * typical:
            best = (atol, rtol)
    max_rel = float(rel_max_above[min(count // 2, count - 1)])
    return Fit(float(diff.max()), max_rel, best[0], best[1])


def _envelope(fits: list[Fit]) -> Fit:
    return Fit(
        max(f.max_abs for f in fits),
        max(f.max_rel for f in fits),
        max(f.atol for f in fits),
        max(f.rtol for f in fits),
    )


def measure(case: Case, dtype: torch.dtype, seed: int) -> tuple[Fit, Fit | None]:
    """(forward fit, input-gradient fit or None) of the path in ``dtype`` vs float64."""
    gen = torch.Generator().manual_seed(seed)
    inputs = case.make(dtype, gen)
    cotangent_gen = torch.Generator().manual_seed(seed + 1000)

    def leaves(cast):
        out = []
        for i, t in enumerate(inputs):
            t = cast(t) if t.is_floating_point() else t
            if i in case.grad_inputs:
                t = t.detach().requires_grad_(True)
            out.append(t)
        return tuple(out)

    low = leaves(lambda t: t)
    ref = leaves(lambda t: t.double())
    if not case.grad_inputs:
        with torch.no_grad():
            return fit_error(case.run(low), case.run_reference(ref)), None
    out_low = case.run(low)
    out_ref = case.run_reference(ref)
    cotangent = torch.randn(out_ref.shape, generator=cotangent_gen, dtype=torch.float32)
    out_low.backward(cotangent.to(out_low.dtype))
    out_ref.backward(cotangent.double())
    forward = fit_error(out_low.detach(), out_ref.detach())
    grads = [fit_error(low[i].grad, ref[i].grad) for i in case.grad_inputs]
    return forward, _envelope(grads)


def smallest_subnormal(dtype: torch.dtype) -> float:
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps


def calibrate(verbose: bool = True):
    """Returns {(op_class, dtype_name, kind): (atol, rtol, note)} and prints the measurements."""
    per_case: dict[tuple[str, str, str, str], Fit] = {}
    for case in CASES:
        for dtype in DTYPES:
            start = time.perf_counter()
            fits = [measure(case, dtype, seed) for seed in SEEDS]
            for kind, index in (("forward", 0), ("grad", 1)):
                if fits[0][index] is None:
                    continue
                per_case[(case.op_class, case.name, DTYPE_NAMES[dtype], kind)] = _envelope(
                    [f[index] for f in fits]
                )
            if verbose:
                print(
                    f"  measured {case.name:<38} {DTYPE_NAMES[dtype]:<9} "
                    f"{time.perf_counter() - start:5.1f} s",
                    flush=True,
                )

    if verbose:
        print(
            "\nmeasured error of each path vs float64 (max over seeds "
            f"{SEEDS}; rel over |ref| >= median)"
        )
        print(
            f"{'class':<12} {'case':<38} {'dtype':<9} {'kind':<8} {'max abs':>10} "
            f"{'max rel':>10} {'atol fit':>10} {'rtol fit':>10}"
        )
        for (op_class, name, dtype_name, kind), f in per_case.items():
            print(
                f"{op_class:<12} {name:<38} {dtype_name:<9} {kind:<8} {f.max_abs:10.3g} "
                f"{f.max_rel:10.3g} {f.atol:10.3g} {f.rtol:10.3g}"
            )

    table = {}
    shapes = {case.name: case.shape for case in CASES}
    for op_class in dict.fromkeys(c.op_class for c in CASES):
        names = [c.name for c in CASES if c.op_class == op_class]
        for dtype in DTYPES:
            dtype_name = DTYPE_NAMES[dtype]
            for kind in ("forward", "grad"):
                fits = {
                    n: per_case[(op_class, n, dtype_name, kind)]
                    for n in names
                    if (op_class, n, dtype_name, kind) in per_case
                }
                env = _envelope(list(fits.values()))
                atol = MULTIPLE * max(env.atol, smallest_subnormal(dtype))
                rtol = MULTIPLE * env.rtol
                measured = "; ".join(
                    f"{n} [{shapes[n]}]: max abs {f.max_abs:.3g}, max rel {f.max_rel:.3g}, "
                    f"fit {f.atol:.3g} + {f.rtol:.3g}*|ref|"
                    for n, f in fits.items()
                )
                note = (
                    f"{MULTIPLE}x the envelope of the error of the {dtype_name} paths vs float64 "
                    f"(CPU, seeds {list(SEEDS)}). {measured}"
                )
                table[(op_class, dtype_name, kind)] = (_round_up(atol), _round_up(rtol), note)
    return table


def _round_up(value: float) -> float:
    """Two significant digits, rounded up, so the literal is readable and never tighter."""
    if value == 0:
        return 0.0
    exponent = math.floor(math.log10(abs(value))) - 1
    return math.ceil(value / 10**exponent) * 10**exponent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", action="store_true", help="print the _TABLE literal")
    parser.add_argument("--markdown", action="store_true", help="print the markdown table")
    args = parser.parse_args()
    torch.manual_seed(0)
    # Strict fp32 for the float32 baseline: no TF32 (CPU has none, but keep the intent clear).
    torch.set_float32_matmul_precision("highest")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU")
    table = calibrate()
    print(f"\nproposed table ({MULTIPLE}x the envelope of the measured fits)")
    print(f"{'class':<12} {'dtype':<9} {'kind':<8} {'atol':>10} {'rtol':>10}")
    for (op_class, dtype_name, kind), (atol, rtol, _) in table.items():
        print(f"{op_class:<12} {dtype_name:<9} {kind:<8} {atol:10.3g} {rtol:10.3g}")
    if args.markdown:
        print()
        print(markdown_table(table))
    if args.python:
        print()
        print(python_literal(table))


def markdown_table(table) -> str:
    lines = ["| op class | dtype | kind | atol | rtol |", "|---|---|---|---|---|"]
    for (op_class, dtype_name, kind), (atol, rtol, _) in table.items():
        lines.append(f"| {op_class} | {dtype_name} | {kind} | {atol:.2g} | {rtol:.2g} |")
    return "\n".join(lines)


def python_literal(table) -> str:
    """The ``_TABLE`` literal of batchinv/contract/tolerances.py, within 100 columns."""
    lines = ["_TABLE: dict[tuple[str, str, str], tuple[float, float, str]] = {"]
    for (op_class, dtype_name, kind), (atol, rtol, note) in table.items():
        key = ", ".join(json.dumps(k) for k in (op_class, dtype_name, kind))
        lines.append(f"    ({key}): (")
        lines.append(f"        {atol:.2g},")
        lines.append(f"        {rtol:.2g},")
        for chunk in textwrap.wrap(note, 84, drop_whitespace=False):
            lines.append(f"        {json.dumps(chunk)}")
        lines[-1] += ","
        lines.append("    ),")
    lines.append("}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

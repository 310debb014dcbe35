"""Host time of one eager call of each public op at decode shapes, against its torch equivalent.

At 1-64 rows a kernel takes a few microseconds and an eager call's time is the host's: Python
checks, dispatch and the launches.  Each row times ``CALLS`` back-to-back calls without a
synchronisation; the time until the calls return, per call, is the host time launch to
launch (the GPU never holds the host back: fewer launches than the queue holds; the
``token_logprobs`` rows, whose calls carry ~0.35 ms of GPU work each, time fewer calls,
``CALLS_PER_OP``).  The wall
time (after the final synchronize) is printed beside it.  Goal: a batchinv call costs at most
1.5x the host time of the torch code a user would write instead (ratio >= 1 / 1.5).

Ops whose default checks read values back (``embedding``'s id check, ``rope``'s position
check, ``token_logprobs``' target check) synchronise once per call by design; they are
measured with the check (the default), without it (``check_ids=False`` /
``check_positions=False``) and with it deferred (rows labelled "check deferred": the whole
timing loop runs inside ``batchinv.device_checks.deferred()``, as a decode loop would, and
the checks are read once afterwards), each row labelled.

The backward rows time one ``torch.autograd.grad(out, inputs, grad_out)`` of an output
recorded once (``retain_graph``), at ``BACKWARD_TOKENS`` tokens, against the same call on the
torch code's output: the host time of the autograd engine and the op's backward, launch to
launch, with the same goal.  ``embedding``'s backward finds the runs of equal ids in its
kernel, so it reads nothing back (no synchronisation per call).

``--profile DIR`` also writes a cProfile table per batchinv op and backward (the functions
the host time goes to).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import report, require_cuda, summary_row

import batchinv
from batchinv import device_checks
from batchinv.gpu import linear as gpu_linear
from batchinv.host_syncs import host_and_wall_seconds

ROWS = (1, 8, 64)
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB = 4096, 32, 8, 128, 12288, 151936
CONTEXT = 256  # keys per sequence in the attention rows: small, so the host dominates
THETA = 1_000_000.0
EPS = 1e-6
CALLS, WARMUP, ROUNDS = 200, 50, 5
# token_logprobs reads the whole lm_head per call (~0.35 ms on an H200): fewer calls keep the
# launches queued behind that GPU work few, so the host does not wait for queue space (a
# cProfile of 200 calls of the earlier eight-launch version showed one small launch taking
# ~45 us, the sign of such a wait; not measured further).
CALLS_PER_OP = {"token_logprobs": 40}
GOAL = 1 / 1.5
DEFERRED = "check deferred (device_checks.deferred())"


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _cases(rows: int, device: torch.device):
    """(op, variant, batchinv call, torch call, torch code) for ``rows`` rows."""
    bf16 = dict(device=device, dtype=torch.bfloat16)
    x = torch.randn(rows, HIDDEN, **bf16)
    residual = torch.randn(rows, HIDDEN, **bf16)
    norm_w = torch.randn(HIDDEN, **bf16)
    w = torch.randn(HIDDEN, HIDDEN, **bf16) / 64
    gate, up = torch.randn(rows, INTERMEDIATE, **bf16), torch.randn(rows, INTERMEDIATE, **bf16)
    table = torch.randn(VOCAB, HIDDEN, **bf16)
    ids = torch.randint(0, VOCAB, (rows,), device=device)
    q = torch.randn(rows, 1, HEADS, HEAD_DIM, **bf16)
    k1 = torch.randn(rows, 1, KV_HEADS, HEAD_DIM, **bf16)
    positions = torch.randint(0, 4096, (rows, 1), device=device)
    inv_freq = 1.0 / THETA ** (torch.arange(0, HEAD_DIM, 2, device=device).float() / HEAD_DIM)
    angles = torch.outer(torch.arange(40960, device=device).float(), inv_freq)
    cos_table = torch.cat((angles, angles), -1).cos().to(torch.bfloat16)
    sin_table = torch.cat((angles, angles), -1).sin().to(torch.bfloat16)
    k = torch.randn(rows, CONTEXT, KV_HEADS, HEAD_DIM, **bf16)
    v = torch.randn(rows, CONTEXT, KV_HEADS, HEAD_DIM, **bf16)
    logits = torch.randn(rows, VOCAB, **bf16)
    targets = torch.randint(0, VOCAB, (rows,), device=device)

    def torch_rope():
        cos, sin = cos_table[positions].unsqueeze(2), sin_table[positions].unsqueeze(2)
        return q * cos + _rotate_half(q) * sin, k1 * cos + _rotate_half(k1) * sin

    def torch_token_logprobs():
        logp = torch.log_softmax(F.linear(x, table).float(), dim=-1)
        return logp.gather(-1, targets[:, None]).squeeze(-1)

    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    rope = dict(theta=THETA)
    return [
        (
            "rms_norm",
            "",
            lambda: batchinv.rms_norm(x, norm_w, EPS),
            lambda: F.rms_norm(x, (HIDDEN,), norm_w, EPS),
            "F.rms_norm",
        ),
        (
            "fused_add_rms_norm",
            "",
            lambda: batchinv.fused_add_rms_norm(x, residual, norm_w, EPS),
            lambda: F.rms_norm(x + residual, (HIDDEN,), norm_w, EPS),
            "x + residual; F.rms_norm",
        ),
        (
            "linear",
            f"{HIDDEN}x{HIDDEN}",
            lambda: batchinv.linear(x, w),
            lambda: F.linear(x, w),
            "F.linear",
        ),
        (
            "silu_mul",
            "",
            lambda: batchinv.silu_mul(gate, up),
            lambda: F.silu(gate) * up,
            "F.silu(gate) * up",
        ),
        (
            "embedding",
            "check_ids=True (default)",
            lambda: batchinv.embedding(ids, table),
            lambda: F.embedding(ids, table),
            "F.embedding",
        ),
        (
            "embedding",
            "check_ids=False",
            lambda: batchinv.embedding(ids, table, check_ids=False),
            lambda: F.embedding(ids, table),
            "F.embedding",
        ),
        (
            "embedding",
            DEFERRED,
            lambda: batchinv.embedding(ids, table),
            lambda: F.embedding(ids, table),
            "F.embedding",
        ),
        (
            "rope",
            "check_positions=True (default)",
            lambda: batchinv.rope(q, k1, positions, **rope),
            torch_rope,
            "HF rotate_half on cos/sin tables",
        ),
        (
            "rope",
            "check_positions=False",
            lambda: batchinv.rope(q, k1, positions, check_positions=False, **rope),
            torch_rope,
            "HF rotate_half on cos/sin tables",
        ),
        (
            "rope",
            DEFERRED,
            lambda: batchinv.rope(q, k1, positions, **rope),
            torch_rope,
            "HF rotate_half on cos/sin tables",
        ),
        (
            "attention",
            f"decode, {CONTEXT} keys",
            lambda: batchinv.attention(q, k, v),
            lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True),
            "F.scaled_dot_product_attention (GQA)",
        ),
        (
            "log_softmax",
            f"vocab {VOCAB}",
            lambda: batchinv.log_softmax(logits),
            lambda: torch.log_softmax(logits, -1, dtype=torch.float32),
            "torch.log_softmax(dtype=fp32)",
        ),
        (
            "token_logprobs",
            f"vocab {VOCAB}",
            lambda: batchinv.token_logprobs(x, table, targets),
            torch_token_logprobs,
            "F.linear; log_softmax; gather",
        ),
        (
            "token_logprobs",
            f"vocab {VOCAB}, {DEFERRED}",
            lambda: batchinv.token_logprobs(x, table, targets),
            torch_token_logprobs,
            "F.linear; log_softmax; gather",
        ),
    ]


# The backward rows: a trainer's micro-batch.  Where the GPU time per call exceeds the host's
# (linear's products) the wall time exceeds the host time, which stays the host's while the
# launch queue does not fill (fewer calls per round than the forward rows).
BACKWARD_TOKENS = 1024
BACKWARD_VOCAB = 32000  # the embedding row: its backward zero-fills [vocab, hidden] per call
BACKWARD_CALLS, BACKWARD_WARMUP = 50, 10


def _grad_call(forward, inputs, grads):
    """A callable running one ``torch.autograd.grad`` of ``forward(*inputs)``, recorded once
    (only the backward is timed)."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = forward(*leaves)
    return lambda: torch.autograd.grad(out, leaves, grads, retain_graph=True)


def _backward_cases(tokens: int, device: torch.device):
    """(op, variant, batchinv backward, torch backward, torch code) at ``tokens`` tokens."""
    bf16 = dict(device=device, dtype=torch.bfloat16)
    x, residual = torch.randn(tokens, HIDDEN, **bf16), torch.randn(tokens, HIDDEN, **bf16)
    norm_w = torch.randn(HIDDEN, **bf16)
    grad_x, grad_h = torch.randn_like(x), torch.randn_like(x)
    w = torch.randn(HIDDEN, HIDDEN, **bf16) / 64
    gate, up = torch.randn(tokens, INTERMEDIATE, **bf16), torch.randn(tokens, INTERMEDIATE, **bf16)
    gate_up = torch.cat((gate, up), dim=-1)
    grad_inter = torch.randn_like(gate)
    table = torch.randn(BACKWARD_VOCAB, HIDDEN, **bf16)
    ids = torch.randint(0, BACKWARD_VOCAB, (tokens,), device=device)
    q = torch.randn(tokens, HEADS, HEAD_DIM, **bf16)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, **bf16)
    grad_q, grad_k = torch.randn_like(q), torch.randn_like(k)
    positions = torch.randint(0, 4096, (tokens,), device=device)
    inv_freq = 1.0 / THETA ** (torch.arange(0, HEAD_DIM, 2, device=device).float() / HEAD_DIM)
    angles = torch.outer(positions.float(), inv_freq)
    cos = torch.cat((angles, angles), -1).cos().to(torch.bfloat16).unsqueeze(1)
    sin = torch.cat((angles, angles), -1).sin().to(torch.bfloat16).unsqueeze(1)

    def torch_rope(a, b):
        return a * cos + _rotate_half(a) * sin, b * cos + _rotate_half(b) * sin

    def torch_fused_add_rms_norm(a, r, b):
        h = a + r
        return F.rms_norm(h, (HIDDEN,), b, EPS), h

    def torch_silu_mul_fused(both):
        return F.silu(both[..., :INTERMEDIATE]) * both[..., INTERMEDIATE:]

    def case(op, variant, ours, theirs, inputs, grads, anchor):
        return (
            op,
            variant,
            _grad_call(ours, inputs, grads),
            _grad_call(theirs, inputs, grads),
            anchor,
        )

    return [
        case(
            "rms_norm",
            "",
            lambda a, b: batchinv.rms_norm(a, b, EPS),
            lambda a, b: F.rms_norm(a, (HIDDEN,), b, EPS),
            (x, norm_w),
            grad_x,
            "F.rms_norm",
        ),
        case(
            "fused_add_rms_norm",
            "",
            lambda a, r, b: batchinv.fused_add_rms_norm(a, r, b, EPS),
            torch_fused_add_rms_norm,
            (x, residual, norm_w),
            (grad_x, grad_h),
            "x + residual; F.rms_norm",
        ),
        case(
            "linear",
            f"{HIDDEN}x{HIDDEN}",
            batchinv.linear,
            F.linear,
            (x, w),
            grad_x,
            "F.linear",
        ),
        case(
            "silu_mul",
            "",
            batchinv.silu_mul,
            lambda g, u: F.silu(g) * u,
            (gate, up),
            grad_inter,
            "F.silu(gate) * up",
        ),
        case(
            "silu_mul_fused",
            "",
            batchinv.silu_mul_fused,
            torch_silu_mul_fused,
            (gate_up,),
            grad_inter,
            "F.silu(gate_up[..., :I]) * gate_up[..., I:]",
        ),
        case(
            "embedding",
            f"vocab {BACKWARD_VOCAB}",
            lambda t: batchinv.embedding(ids, t),
            lambda t: F.embedding(ids, t),
            (table,),
            grad_x,
            "F.embedding",
        ),
        case(
            "rope",
            "",
            lambda a, b: batchinv.rope(a, b, positions, theta=THETA, check_positions=False),
            torch_rope,
            (q, k),
            (grad_q, grad_k),
            "HF rotate_half on gathered cos/sin",
        ),
    ]


def _rows_for(op, case, what, ours, theirs, anchor, ran=None) -> tuple[dict, dict]:
    """A result row and its summary row from ``(host, wall)`` microseconds of each side."""
    (ours_host, ours_wall), (torch_host, torch_wall) = ours, theirs
    row = {
        "op": op,
        "case": case,
        "batchinv_host_us": ours_host,
        "batchinv_wall_us": ours_wall,
        "torch_host_us": torch_host,
        "torch_wall_us": torch_wall,
        "torch_code": anchor,
        "ratio": torch_host / ours_host,
    }
    summary = summary_row(
        op, case, what, ours_host / 1e3, f"{anchor} (host time)", torch_host / 1e3, GOAL,
        scope="op", ran=ran,
    )  # fmt: skip
    return row, summary


def _backward_rows(device: torch.device, profile: Path | None) -> tuple[list[dict], list[dict]]:
    """The backward rows and their summary rows (``main``'s columns)."""
    rows_out, summary = [], []
    for op, variant, ours, theirs, anchor in _backward_cases(BACKWARD_TOKENS, device):
        timed = [_best_host_us(fn, BACKWARD_CALLS, BACKWARD_WARMUP) for fn in (ours, theirs)]
        if profile is not None:
            profile.mkdir(parents=True, exist_ok=True)
            _profile(ours, profile / f"{op}_backward.txt", BACKWARD_CALLS)
        case = f"backward, {BACKWARD_TOKENS} tokens" + (f", {variant}" if variant else "")
        what = "autograd.grad host time per call"
        ran = _backward_path(op, BACKWARD_TOKENS, device)
        row, summary_entry = _rows_for(op, case, what, *timed, anchor, ran=ran)
        rows_out.append(row)
        summary.append(summary_entry)
    return rows_out, summary


def _backward_path(op: str, tokens: int, device: torch.device) -> str | None:
    """The products a ``linear`` backward row ran (``describe_backward``: in place or on
    copies, each with its kernel); None for the other ops."""
    if op != "linear":
        return None
    grad = torch.empty(tokens, HIDDEN, device=device, dtype=torch.bfloat16)
    x = torch.empty(tokens, HIDDEN, device=device, dtype=torch.bfloat16)
    w = torch.empty(HIDDEN, HIDDEN, device=device, dtype=torch.bfloat16)
    label_x, label_w = gpu_linear.describe_backward(grad, x, w)
    return f"grad_x {label_x}; grad_w {label_w}"


def _path(op: str, rows: int, device: torch.device) -> str | None:
    """The GEMM path a ``linear`` row took (the op with several paths); None for the others."""
    if op != "linear":
        return None
    x = torch.empty(rows, HIDDEN, device=device, dtype=torch.bfloat16)
    w = torch.empty(HIDDEN, HIDDEN, device=device, dtype=torch.bfloat16)
    return batchinv.linear_path(x, w)


def _best_host_us(fn, calls: int = CALLS, warmup: int = WARMUP) -> tuple[float, float]:
    """(host, wall) microseconds per call: the best of ``ROUNDS`` rounds (the least disturbed)."""
    runs = [host_and_wall_seconds(fn, calls, warmup=warmup) for _ in range(ROUNDS)]
    host, wall = min(runs)
    return host * 1e6, wall * 1e6


def _profile(fn, path: Path, calls: int) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(40)
    path.write_text(text.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--profile", type=Path, default=None, help="cProfile tables to this dir")
    args = parser.parse_args()
    device = require_cuda()
    torch.manual_seed(0)
    rows_out, summary = [], []
    for rows in ROWS:
        for op, variant, ours, theirs, anchor in _cases(rows, device):
            deferred = DEFERRED in variant
            with device_checks.deferred() if deferred else contextlib.nullcontext():
                ours_timed = _best_host_us(ours, CALLS_PER_OP.get(op, CALLS))
            device_checks.raise_device_errors()  # the deferred checks, read once (all pass)
            theirs_timed = _best_host_us(theirs, CALLS_PER_OP.get(op, CALLS))
            case = f"rows {rows}" + (f", {variant}" if variant else "")
            row, summary_entry = _rows_for(
                op, case, "eager host time per call", ours_timed, theirs_timed, anchor,
                ran=_path(op, rows, device),
            )  # fmt: skip
            rows_out.append(row)
            summary.append(summary_entry)
            if args.profile is not None and rows == ROWS[-1]:
                args.profile.mkdir(parents=True, exist_ok=True)
                name = f"{op}_{'deferred' if deferred else variant.split(' ')[0] or 'default'}"
                with device_checks.deferred() if deferred else contextlib.nullcontext():
                    path = args.profile / f"{name.replace('=', '_')}.txt"
                    _profile(ours, path, CALLS_PER_OP.get(op, CALLS))
    backward_rows, backward_summary = _backward_rows(device, args.profile)
    rows_out += backward_rows
    summary += backward_summary
    columns = ["op", "case", "batchinv_host_us", "torch_host_us", "ratio"]
    columns += ["batchinv_wall_us", "torch_wall_us", "torch_code"]
    report("host overhead per eager call", rows_out, columns, args.json, summary)


if __name__ == "__main__":
    main()

"""Plausible bugs, injected by wrapping a public op, for the mutation tests.

Each mutant takes the same inputs as the op, calls the real op (the CUDA kernels on a GPU
tensor, the reference path on a CPU one) and changes what a kernel bug would change.  No
kernel has a hook: a mutant is the op with its inputs or outputs altered around it.  The
tests (tests/contract/test_mutants.py on the CPU, tests/gpu/test_mutants_cuda.py on a GPU)
check that the unmutated op passes its tolerance entry and every mutant fails it: a table
that let these through would not guard the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import batchinv
from batchinv.contract import assert_within_tolerance
from batchinv.reference.attention import KV_BLOCK, attention_fp32
from batchinv.reference.linear import linear_fp32
from batchinv.reference.log_softmax import log_softmax_fp32
from batchinv.reference.rms_norm import rms_norm_fp32
from batchinv.reference.token_logprobs import token_logprobs_fp32

LOGIT_SCALE = 1.0 + 2.0**-7
VOCAB_TILE = 256  # the CUDA token_logprobs kernel's vocabulary tile
ACCUMULATE_K = 16  # columns of K per fp16-accumulated partial product
RMS_EPS = 1e-6


@dataclass(frozen=True)
class Sizes:
    tokens: int
    hidden: int
    vocab: int
    q_heads: int
    kv_heads: int
    head_dim: int
    context: int
    linear_k: int
    linear_n: int


CPU_SIZES = Sizes(
    tokens=8,
    hidden=256,
    vocab=2048,
    q_heads=4,
    kv_heads=2,
    head_dim=64,
    context=384,
    linear_k=512,
    linear_n=64,
)
# Qwen3-8B's: the full vocabulary, contexts past the 2048-key split, the down_proj K.
GPU_SIZES = Sizes(
    tokens=16,
    hidden=4096,
    vocab=151936,
    q_heads=32,
    kv_heads=8,
    head_dim=128,
    context=2304,
    linear_k=12288,
    linear_n=4096,
)


def _randn(shape, gen, device, dtype, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)


# ----- logprobs: logits scaled by 1 + 2^-7, a dropped last vocabulary tile -----------------------


def logprob_inputs(sizes: Sizes, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = _randn((sizes.tokens, sizes.hidden), gen, device, dtype)
    weight = _randn((sizes.vocab, sizes.hidden), gen, device, dtype, 3.0 * sizes.hidden**-0.5)
    # Targets outside the last tile, so the dropped-tile mutant still has their logits.
    targets = torch.randint(0, sizes.vocab - VOCAB_TILE, (sizes.tokens,), generator=gen)
    return hidden, weight, targets.to(device)


def token_logprobs_reference(hidden, weight, targets):
    return token_logprobs_fp32(hidden, weight, targets)


def token_logprobs_op(hidden, weight, targets):
    return batchinv.token_logprobs(hidden, weight, targets)


def token_logprobs_scaled_logits(hidden, weight, targets):
    """Logits scaled by 1 + 2^-7 (through the hidden state, rounded to its dtype)."""
    scaled = (hidden.float() * LOGIT_SCALE).to(hidden.dtype)
    return batchinv.token_logprobs(scaled, weight, targets)


def token_logprobs_dropped_tile(hidden, weight, targets):
    """The log-sum-exp misses the last vocabulary tile."""
    return batchinv.token_logprobs(hidden, weight[:-VOCAB_TILE].contiguous(), targets)


def token_logprobs_without_target_term(hidden, weight, targets):
    """The backward drops the target's one-hot term of d_z (d_z = -g * p instead of
    g * (onehot - p)): the forward's value, with the target logit's gradient taken away."""
    out = batchinv.token_logprobs(hidden, weight, targets)
    picked = (hidden.float() * weight[targets].float()).sum(-1)
    return out - picked + picked.detach()


def log_softmax_inputs(sizes: Sizes, dtype, device, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return (_randn((sizes.tokens, sizes.vocab), gen, device, dtype, 3.0),)


def log_softmax_reference(x):
    return log_softmax_fp32(x)


def log_softmax_op(x):
    return batchinv.log_softmax(x)


def log_softmax_scaled_logits(x):
    """Logits scaled by 1 + 2^-7 in fp32 before the (fp32-out) log-softmax."""
    return batchinv.log_softmax(x.float() * LOGIT_SCALE)


# ----- attention: one skipped KV block, an off-by-one causal offset ------------------------------


def attention_inputs(sizes: Sizes, dtype, device, queries, seed=2):
    gen = torch.Generator().manual_seed(seed)
    q = _randn((1, queries, sizes.q_heads, sizes.head_dim), gen, device, dtype)
    k = _randn((1, sizes.context, sizes.kv_heads, sizes.head_dim), gen, device, dtype)
    v = _randn((1, sizes.context, sizes.kv_heads, sizes.head_dim), gen, device, dtype)
    return q, k, v


def attention_reference(q, k, v):
    return attention_fp32(q, k, v, causal=True)


def attention_op(q, k, v):
    return batchinv.attention(q, k, v, causal=True)


def attention_skipped_block(q, k, v):
    """Keys [128, 256) never reach the softmax (a block the loop or the split merge skipped)."""
    keep = torch.cat((k[:, :KV_BLOCK], k[:, 2 * KV_BLOCK :]), dim=1)
    keep_v = torch.cat((v[:, :KV_BLOCK], v[:, 2 * KV_BLOCK :]), dim=1)
    return batchinv.attention(q, keep, keep_v, causal=True)


def attention_causal_off_by_one(q, k, v):
    """Each query also sees the next key (``j <= i + 1``); the last query has none to see.

    Queries are the last tokens of their sequence, so dropping the last query moves every
    other one a position later: query i then sits at i + 1 against the same keys."""
    assert q.shape[1] == k.shape[1], "a prefill: as many queries as keys"
    shifted = batchinv.attention(q[:, :-1], k, v, causal=True)
    last = batchinv.attention(q, k, v, causal=True)[:, -1:]
    return torch.cat((shifted, last), dim=1)


def attention_delta_dropped(q, k, v):
    """The backward forgets delta = rowsum(dO * O) (ds = p * dp): the forward's value, with the
    gradient taken through p = exp(s - lse) as if lse were a constant (torch ops, fp32)."""
    out, lse = batchinv.attention(q, k, v, causal=True, return_lse=True)
    group = q.shape[2] // k.shape[2]
    keys = k.float().repeat_interleave(group, dim=2)
    values = v.float().repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), keys) * q.shape[-1] ** -0.5
    n, m = q.shape[1], k.shape[1]
    visible = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n)
    p = torch.where(visible, torch.exp(s - lse.detach().float()[..., None]), 0.0)
    unnormalised = torch.einsum("bhqk,bkhd->bqhd", p, values).to(out.dtype)
    return out.detach() + (unnormalised - unnormalised.detach())


# ----- linear: an fp16 accumulator ---------------------------------------------------------------


def linear_inputs(sizes: Sizes, dtype, device, seed=3):
    gen = torch.Generator().manual_seed(seed)
    x = _randn((sizes.tokens, sizes.linear_k), gen, device, dtype)
    weight = _randn((sizes.linear_n, sizes.linear_k), gen, device, dtype, sizes.linear_k**-0.5)
    return x, weight


def linear_reference(x, weight):
    return linear_fp32(x, weight)


def linear_op(x, weight):
    return batchinv.linear(x, weight)


def linear_fp16_accumulator(x, weight):
    """The sum over K kept in fp16: partial products over ACCUMULATE_K columns (the op) added
    into an fp16 accumulator, rounded to fp16 after every add."""
    acc = torch.zeros(x.shape[0], weight.shape[0], dtype=torch.float16, device=x.device)
    for start in range(0, x.shape[1], ACCUMULATE_K):
        stop = start + ACCUMULATE_K
        partial = batchinv.linear(x[:, start:stop].contiguous(), weight[:, start:stop].contiguous())
        acc = (acc.float() + partial.float()).to(torch.float16)
    return acc.to(x.dtype)


# ----- RMSNorm: eps applied outside the root -----------------------------------------------------


def rms_norm_inputs(sizes: Sizes, dtype, device, seed=4):
    gen = torch.Generator().manual_seed(seed)
    # Rows from 1e-3 to 10 in scale: in small rows eps is a large part of the mean square.
    scales = torch.logspace(-3, 1, 4 * sizes.tokens)[:, None]
    x = torch.randn((4 * sizes.tokens, sizes.hidden), generator=gen) * scales
    weight = 1.0 + 0.1 * torch.randn(sizes.hidden, generator=gen)
    return x.to(dtype).to(device), weight.to(dtype).to(device)


def rms_norm_reference(x, weight):
    return rms_norm_fp32(x, weight, RMS_EPS)


def rms_norm_op(x, weight):
    return batchinv.rms_norm(x, weight, RMS_EPS)


def rms_norm_eps_outside_root(x, weight):
    """``x / (sqrt(mean(x^2)) + eps)`` instead of ``x / sqrt(mean(x^2) + eps)``: the op's
    output rescaled by the ratio of the two denominators (fp32), rounded to x's dtype."""
    mean_sq = x.double().pow(2).mean(-1, keepdim=True)
    ratio = (mean_sq + RMS_EPS).sqrt() / (mean_sq.sqrt() + RMS_EPS)
    return (batchinv.rms_norm(x, weight, RMS_EPS).double() * ratio).to(x.dtype)


# ----- the table of mutants ----------------------------------------------------------------------

# name: (op of the tolerance table, inputs(sizes, dtype, device), reference, op, mutant).
# token_logprobs returns fp32 from bf16/fp16 inputs: its entry is the inputs' dtype.
# log_softmax's fp32 output is judged by its fp32 entry.
MUTANTS = {
    "logits scaled by 1 + 2^-7 (token_logprobs)": (
        "token_logprobs",
        logprob_inputs,
        token_logprobs_reference,
        token_logprobs_op,
        token_logprobs_scaled_logits,
    ),
    "dropped last vocabulary tile (token_logprobs)": (
        "token_logprobs",
        logprob_inputs,
        token_logprobs_reference,
        token_logprobs_op,
        token_logprobs_dropped_tile,
    ),
    "logits scaled by 1 + 2^-7 (log_softmax)": (
        "log_softmax",
        log_softmax_inputs,
        log_softmax_reference,
        log_softmax_op,
        log_softmax_scaled_logits,
    ),
    "one skipped KV block (decode)": (
        "attention",
        lambda sizes, dtype, device: attention_inputs(sizes, dtype, device, queries=1),
        attention_reference,
        attention_op,
        attention_skipped_block,
    ),
    "off-by-one causal offset (prefill)": (
        "attention",
        lambda sizes, dtype, device: attention_inputs(sizes, dtype, device, queries=sizes.context),
        attention_reference,
        attention_op,
        attention_causal_off_by_one,
    ),
    "fp16 accumulator (linear)": (
        "linear",
        linear_inputs,
        linear_reference,
        linear_op,
        linear_fp16_accumulator,
    ),
    "eps outside the root (rms_norm)": (
        "rms_norm",
        rms_norm_inputs,
        rms_norm_reference,
        rms_norm_op,
        rms_norm_eps_outside_root,
    ),
}


# Mutants of a backward: name -> (op, inputs, reference, op, mutant), each a function of the
# inputs whose gradients (of sum(cotangent * output)) are judged by the op's "grad" entry.
GRAD_MUTANTS = {
    "target term dropped from d_z (token_logprobs backward)": (
        "token_logprobs",
        logprob_inputs,
        token_logprobs_reference,
        token_logprobs_op,
        token_logprobs_without_target_term,
    ),
    "delta dropped from ds (attention backward)": (
        "attention",
        lambda sizes, dtype, device: attention_inputs(sizes, dtype, device, queries=sizes.context),
        attention_reference,
        attention_op,
        attention_delta_dropped,
    ),
}


def _input_grads(fn, inputs, cotangent, dtype=None):
    """Gradients of ``sum(cotangent * fn(*inputs))`` for the floating inputs (cast to
    ``dtype`` first when given: the reference runs on fp32 copies)."""
    leaves = [
        t.detach().to(dtype or t.dtype).requires_grad_(True) if t.is_floating_point() else t
        for t in inputs
    ]
    out = fn(*leaves)
    floating = [t for t in leaves if t.is_floating_point()]
    return torch.autograd.grad(out, floating, cotangent.to(out.dtype))


def assert_grads_pass_and_mutant_fails(mutant: str, dtype: torch.dtype, sizes, device) -> None:
    """The op's input gradients are within its "grad" entry of the fp32 reference's on
    ``sizes``; the mutant's are not (at least one gradient fails)."""
    op, make_inputs, reference_fn, op_fn, mutant_fn = GRAD_MUTANTS[mutant]
    inputs = make_inputs(sizes, dtype, device)
    with torch.no_grad():
        shape = reference_fn(*inputs).shape
    cotangent = torch.randn(shape, generator=torch.Generator().manual_seed(9)).to(device)
    reference = _input_grads(reference_fn, inputs, cotangent, torch.float32)

    def failures(grads) -> list[str]:
        failed = []
        for i, (got, ref) in enumerate(zip(grads, reference, strict=True)):
            try:
                assert_within_tolerance(got, ref, op=op, dtype=dtype, kind="grad", name=f"d{i}")
            except AssertionError as exc:
                failed.append(str(exc).splitlines()[0])
        return failed

    assert failures(_input_grads(op_fn, inputs, cotangent)) == []
    assert failures(_input_grads(mutant_fn, inputs, cotangent)), f"{mutant} passed"


def judged_dtype(op: str, input_dtype: torch.dtype, output: torch.Tensor) -> torch.dtype:
    """The table dtype of a result: token_logprobs is judged at its inputs' precision."""
    return input_dtype if op == "token_logprobs" else output.dtype


def assert_op_passes_and_mutant_fails(mutant: str, dtype: torch.dtype, sizes, device) -> None:
    """The op is within its table entry of the reference on ``sizes``; the mutant is not."""
    op, make_inputs, reference_fn, op_fn, mutant_fn = MUTANTS[mutant]
    inputs = make_inputs(sizes, dtype, device)

    def check(actual, label):
        judged = judged_dtype(op, dtype, actual)
        assert_within_tolerance(actual, reference, op=op, dtype=judged, name=label)

    with torch.no_grad():
        reference = reference_fn(*inputs)
        check(op_fn(*inputs), "op")
        mutated = mutant_fn(*inputs)
    with pytest.raises(AssertionError, match="elements outside"):
        check(mutated, mutant)

"""Fused token_logprobs reference: definition, memory, ignore_index, Axis-A/B, errors."""

from __future__ import annotations

import pytest
import torch
from _helpers_reduction import (
    ALL_FLOAT,
    LOW_PRECISION,
    LargestTensorRecorder,
    assert_unchanged,
    generator,
    grads_of,
    randn,
    scalar_lse_definition,
    snapshot,
)

from batchinv.contract import (
    assert_bitwise_equal,
    assert_no_drift,
    assert_within_tolerance,
    row_invariance_sweep,
)
from batchinv.reference.linear import linear_fp32
from batchinv.reference.log_softmax import log_softmax
from batchinv.reference.token_logprobs import (
    VOCAB_CHUNK,
    TokenLogprobsReference,
    token_logprobs,
    token_logprobs_fp32,
)

IGNORE = -100
# (leading shape of hidden, H, V, vocab_chunk): one chunk, a short last chunk, chunk of 1,
# chunk larger than V, and the default chunk with V just above it.
CASES = [
    ((1,), 4, 1, VOCAB_CHUNK),
    ((9,), 16, 300, 64),
    ((2, 5), 24, 200, 37),
    ((4,), 8, 19, 1),
    ((6,), 12, 50, 1000),
    ((3,), 8, VOCAB_CHUNK + 77, VOCAB_CHUNK),
]
SWEEP_H, SWEEP_V, SWEEP_CHUNK = 16, 150, 32


def _problem(lead, h, v, *, seed, dtype=torch.float32, ignore_every=4):
    hidden = randn(*lead, h, seed=seed, scale=2.0, dtype=dtype)
    weight = randn(v, h, seed=seed + 1, scale=h**-0.5 * 3, dtype=dtype)
    targets = torch.randint(0, v, lead, generator=generator(seed + 2))
    flat = targets.view(-1)
    if ignore_every:
        flat[1::ignore_every] = IGNORE
    return hidden, weight, targets


def _float64_logprobs(hidden, weight, targets, ignore_index=IGNORE):
    """Full float64 logits, log_softmax and gather: the plain-PyTorch definition."""
    logp = torch.log_softmax(hidden.double() @ weight.double().T, dim=-1)
    valid = targets != ignore_index
    picked = logp.gather(-1, torch.where(valid, targets, 0).unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    zero = torch.zeros((), dtype=torch.float64)
    return torch.where(valid, picked, zero), torch.where(valid, entropy, zero)


# ---- accuracy and the definition ------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_forward_matches_float64_full_logits(case):
    lead, h, v, chunk = case
    hidden, weight, targets = _problem(lead, h, v, seed=1)
    logprob, entropy = token_logprobs(
        hidden, weight, targets, vocab_chunk=chunk, return_entropy=True
    )
    assert logprob.dtype == entropy.dtype == torch.float32
    assert logprob.shape == entropy.shape == targets.shape
    want_logprob, want_entropy = _float64_logprobs(hidden, weight, targets)
    assert_within_tolerance(logprob, want_logprob, op_class="logprob", kind="forward")
    assert_within_tolerance(entropy, want_entropy, op_class="logprob", kind="forward")
    assert bool((entropy >= 0).all())


@pytest.mark.parametrize("case", CASES[:-1])
def test_grads_match_float64_autograd(case):
    lead, h, v, chunk = case
    hidden, weight, targets = _problem(lead, h, v, seed=2)
    hidden.requires_grad_()
    weight.requires_grad_()
    g_logprob, g_entropy = randn(*lead, seed=3), randn(*lead, seed=4)
    outputs = token_logprobs(hidden, weight, targets, vocab_chunk=chunk, return_entropy=True)
    grads = grads_of(outputs, (g_logprob, g_entropy), [hidden, weight])
    h64, w64 = (t.detach().double().requires_grad_() for t in (hidden, weight))
    want = grads_of(_float64_logprobs(h64, w64, targets), (g_logprob, g_entropy), [h64, w64])
    for got, expected in zip(grads, want, strict=True):
        assert got.dtype == torch.float32
        assert_within_tolerance(got, expected, op_class="logprob", kind="grad")


def test_logprob_only_grads_match_float64_autograd():
    hidden, weight, targets = _problem((11,), 16, 150, seed=5)
    hidden.requires_grad_()
    weight.requires_grad_()
    grad = randn(11, seed=6)
    logprob = token_logprobs(hidden, weight, targets, vocab_chunk=40)
    grads = grads_of(logprob, grad, [hidden, weight])
    h64, w64 = (t.detach().double().requires_grad_() for t in (hidden, weight))
    want = grads_of(_float64_logprobs(h64, w64, targets)[0], grad.double(), [h64, w64])
    for got, expected in zip(grads, want, strict=True):
        assert_within_tolerance(got, expected, op_class="logprob", kind="grad")


@pytest.mark.parametrize("case", CASES)
def test_fused_equals_unfused_chain_bitwise(case):
    """linear_fp32 -> chunked log_softmax -> gather gives the fused result bit for bit."""
    lead, h, v, chunk = case
    hidden, weight, targets = _problem(lead, h, v, seed=7, dtype=torch.bfloat16)
    fused = token_logprobs_fp32(hidden, weight, targets, vocab_chunk=chunk)
    logp = log_softmax(linear_fp32(hidden, weight), chunk_size=chunk)
    valid = targets != IGNORE
    picked = logp.gather(-1, torch.where(valid, targets, 0).unsqueeze(-1)).squeeze(-1)
    assert_bitwise_equal(fused, torch.where(valid, picked, 0.0), name="fused vs unfused")


@pytest.mark.parametrize("chunk", [1, 4, 11])
def test_matches_scalar_definition_bitwise(chunk):
    """logprob and entropy re-done from the docs one fp32 scalar at a time."""
    hidden, weight, targets = _problem((3,), 5, 11, seed=28, ignore_every=0)
    logprob, entropy = token_logprobs(
        hidden, weight, targets, vocab_chunk=chunk, return_entropy=True
    )
    for t in range(3):
        logits = torch.zeros(11)
        for j in range(11):
            acc = torch.zeros(())
            for k in range(5):
                acc = acc + hidden[t, k] * weight[j, k]
            logits[j] = acc
        m, l, s = scalar_lse_definition(logits, chunk)
        lse = m + torch.log(l)
        assert_bitwise_equal(logprob[t], logits[targets[t]] - lse, name=f"logprob {t}")
        assert_bitwise_equal(entropy[t], torch.log(l) - s / l, name=f"entropy {t}")


def test_backward_matches_scalar_definition_bitwise():
    """The documented backward, re-done one fp32 scalar at a time (T=16, V=24, chunk 16)."""
    tokens, h, v, chunk = 16, 16, 24, 16
    hidden, weight, targets = _problem((tokens,), h, v, seed=29, ignore_every=6)
    hidden.requires_grad_()
    weight.requires_grad_()
    g, g_ent = randn(tokens, seed=30), randn(tokens, seed=31)
    outputs = token_logprobs(hidden, weight, targets, vocab_chunk=chunk, return_entropy=True)
    grad_hidden, grad_weight = grads_of(outputs, (g, g_ent), [hidden, weight])
    hs, ws = hidden.detach(), weight.detach()
    d_z = torch.zeros(tokens, v)
    for t in range(tokens):
        if targets[t] == IGNORE:
            continue
        logits = torch.zeros(v)
        for j in range(v):
            acc = torch.zeros(())
            for k in range(h):
                acc = acc + hs[t, k] * ws[j, k]
            logits[j] = acc
        m, l, s = scalar_lse_definition(logits, chunk)
        lse, entropy = m + torch.log(l), torch.log(l) - s / l
        for j in range(v):
            log_p = logits[j] - lse
            p = torch.exp(log_p)
            onehot = torch.tensor(1.0 if j == targets[t] else 0.0)
            d_z[t, j] = g[t] * (onehot - p) - g_ent[t] * (p * (log_p + entropy))
    want_hidden = torch.zeros(tokens, h)
    for t in range(tokens):
        for k in range(h):
            total = torch.zeros(())
            for start in range(0, v, chunk):
                partial = torch.zeros(())
                for j in range(start, min(v, start + chunk)):
                    partial = partial + d_z[t, j] * ws[j, k]
                total = total + partial
            want_hidden[t, k] = total
    want_weight = torch.zeros(v, h)
    for j in range(v):
        for k in range(h):
            acc = torch.zeros(())
            for t in range(tokens):
                if targets[t] != IGNORE:
                    acc = acc + d_z[t, j] * hs[t, k]
            want_weight[j, k] = acc
    assert_bitwise_equal(grad_hidden, want_hidden, name="grad_hidden")
    assert_bitwise_equal(grad_weight, want_weight, name="grad_weight")


def test_never_materialises_full_logits():
    tokens, h, v, chunk = 64, 8, 2000, 256
    hidden, weight, targets = _problem((tokens,), h, v, seed=8)
    hidden.requires_grad_()
    weight.requires_grad_()
    forward_recorder, backward_recorder = LargestTensorRecorder(), LargestTensorRecorder()
    with forward_recorder:
        logprob, entropy = token_logprobs(
            hidden, weight, targets, vocab_chunk=chunk, return_entropy=True
        )
    with backward_recorder:
        (logprob.sum() + entropy.sum()).backward()
    # Forward: nothing beyond [T, chunk]. Backward: also the [V, H] weight gradient itself.
    assert forward_recorder.largest <= tokens * chunk, forward_recorder.largest_op
    assert backward_recorder.largest <= max(tokens * chunk, v * h), backward_recorder.largest_op
    assert max(tokens * chunk, v * h) * 4 < tokens * v  # the bound above really excludes [T, V]
    # The recorder does see a full-logits computation when there is one.
    check = LargestTensorRecorder()
    with check:
        log_softmax(linear_fp32(hidden.detach(), weight.detach()), chunk_size=chunk)
    assert check.largest >= tokens * v


# ---- ignore_index ---------------------------------------------------------------------------


def test_ignored_positions_are_zero_with_zero_grad_and_never_leak():
    hidden, weight, targets = _problem((12,), 16, 90, seed=9, ignore_every=3)
    ignored = targets == IGNORE
    hidden[ignored] = float("nan")  # padding garbage must not reach anything
    hidden.requires_grad_()
    weight.requires_grad_()
    logprob, entropy = token_logprobs(hidden, weight, targets, vocab_chunk=32, return_entropy=True)
    assert_bitwise_equal(logprob[ignored], torch.zeros(int(ignored.sum())), name="ignored logprob")
    assert_bitwise_equal(entropy[ignored], torch.zeros(int(ignored.sum())), name="ignored entropy")
    cotangents = (randn(12, seed=10), randn(12, seed=11))
    g_h, g_w = grads_of((logprob, entropy), cotangents, [hidden, weight])
    assert_bitwise_equal(g_h[ignored], torch.zeros(int(ignored.sum()), 16), name="ignored grad")
    assert not g_h.isnan().any() and not g_w.isnan().any()
    # The kept tokens alone give the same bits (forward, hidden grad and weight grad).
    kept = ~ignored
    h2, w2 = hidden.detach()[kept].requires_grad_(), weight.detach().clone().requires_grad_()
    lp2, ent2 = token_logprobs(h2, w2, targets[kept], vocab_chunk=32, return_entropy=True)
    g_h2, g_w2 = grads_of((lp2, ent2), tuple(c[kept] for c in cotangents), [h2, w2])
    assert_bitwise_equal(logprob[kept], lp2, name="kept logprob")
    assert_bitwise_equal(entropy[kept], ent2, name="kept entropy")
    assert_bitwise_equal(g_h[kept], g_h2, name="kept hidden grad")
    assert_bitwise_equal(g_w, g_w2, name="weight grad with and without ignored tokens")


def test_custom_ignore_index_inside_the_vocabulary():
    hidden, weight, _ = _problem((8,), 8, 30, seed=12)
    targets = torch.tensor([3, 7, 7, 0, 29, 7, 1, 2])
    logprob = token_logprobs(hidden, weight, targets, ignore_index=7, vocab_chunk=8)
    want, _ = _float64_logprobs(hidden, weight, targets, ignore_index=7)
    assert_bitwise_equal(logprob[targets == 7], torch.zeros(3), name="ignored id 7")
    assert_within_tolerance(logprob, want, op_class="logprob", kind="forward")


# ---- Axis-B ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("case", CASES)
def test_low_precision_within_tolerance_of_fp32(case, dtype):
    lead, h, v, chunk = case
    hidden, weight, targets = _problem(lead, h, v, seed=13, dtype=dtype)
    module = TokenLogprobsReference(weight, vocab_chunk=chunk)
    actual = module(hidden, targets, return_entropy=True)
    reference = module.forward_fp32(hidden, targets, return_entropy=True)
    for got, want in zip(actual, reference, strict=True):
        assert got.dtype == torch.float32
        # fp32 out from bf16/fp16 inputs: the entry of the input precision applies.
        assert_within_tolerance(got, want, op_class="logprob", kind="forward", dtype=dtype)
        # The low-precision path rounds no intermediate: same bits as the fp32 path.
        assert_bitwise_equal(got, want)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_low_precision_grads_within_tolerance_of_fp32(dtype):
    hidden, weight, targets = _problem((10,), 16, 140, seed=14, dtype=dtype)
    hidden.requires_grad_()
    weight.requires_grad_()
    cotangents = (randn(10, seed=15), randn(10, seed=16))
    grads = grads_of(
        token_logprobs(hidden, weight, targets, vocab_chunk=48, return_entropy=True),
        cotangents,
        [hidden, weight],
    )
    h32, w32 = (t.detach().float().requires_grad_() for t in (hidden, weight))
    reference = grads_of(
        token_logprobs_fp32(h32, w32, targets, vocab_chunk=48, return_entropy=True),
        cotangents,
        [h32, w32],
    )
    for got, want in zip(grads, reference, strict=True):
        assert got.dtype == dtype
        assert_within_tolerance(got, want, op_class="logprob", kind="grad")


# ---- Axis-A ---------------------------------------------------------------------------------


def _sweep_weight(dtype):
    return randn(SWEEP_V, SWEEP_H, seed=17, scale=0.75, dtype=dtype)


def _make_sweep_rows(dtype):
    """One row = a hidden row, a target id (1 in 5 ignored), logprob and entropy cotangents."""

    def make_rows(n, gen):
        hidden = (torch.randn(n, SWEEP_H, generator=gen) * 2).to(dtype)
        targets = torch.randint(0, SWEEP_V, (n,), generator=gen)
        targets = targets.masked_fill(torch.randint(0, 5, (n,), generator=gen) == 0, IGNORE)
        return hidden, targets, torch.randn(n, generator=gen), torch.randn(n, generator=gen)

    return make_rows


def _sweep(op, dtype):
    # Integer padding rows hold random ids in [0, V): valid targets.
    return row_invariance_sweep(op, _make_sweep_rows(dtype), int_high=SWEEP_V)


@pytest.mark.parametrize("dtype", ALL_FLOAT)
def test_forward_row_invariance(dtype):
    weight = _sweep_weight(dtype)

    def op(rows):
        hidden, targets = rows[0], rows[1]
        return token_logprobs(hidden, weight, targets, vocab_chunk=SWEEP_CHUNK, return_entropy=True)

    assert_no_drift(_sweep(op, dtype))


@pytest.mark.parametrize("dtype", ALL_FLOAT)
def test_hidden_grad_row_invariance(dtype):
    weight = _sweep_weight(dtype)

    def op(rows):
        hidden, targets, g_logprob, g_entropy = rows
        hidden = hidden.clone().requires_grad_()
        outputs = token_logprobs(
            hidden, weight, targets, vocab_chunk=SWEEP_CHUNK, return_entropy=True
        )
        return grads_of(outputs, (g_logprob, g_entropy), [hidden])[0]

    assert_no_drift(_sweep(op, dtype))


@pytest.mark.parametrize("dtype", ALL_FLOAT)
def test_weight_grad_bitwise_run_to_run(dtype):
    hidden, weight, targets = _problem((33,), 16, 100, seed=18, dtype=dtype)
    cotangents = (randn(33, seed=19), randn(33, seed=20))

    def weight_grad():
        w = weight.clone().requires_grad_()
        outputs = token_logprobs(hidden, w, targets, vocab_chunk=24, return_entropy=True)
        return grads_of(outputs, cotangents, [w])[0]

    first = weight_grad()
    assert first.dtype == dtype
    assert_bitwise_equal(weight_grad(), first, name="grad of lm_head_weight")


# ---- paths, module, edge cases --------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_FLOAT)
def test_module_matches_functional(dtype):
    hidden, weight, targets = _problem((2, 4), 8, 40, seed=21, dtype=dtype)
    module = TokenLogprobsReference(weight, vocab_chunk=16)
    got = module(hidden, targets)
    assert_bitwise_equal(got, token_logprobs(hidden, weight, targets, vocab_chunk=16))
    assert_bitwise_equal(
        module.forward_fp32(hidden, targets),
        token_logprobs_fp32(hidden, weight, targets, vocab_chunk=16),
    )
    got.sum().backward()
    assert module.weight.grad.dtype == dtype


def test_int32_targets_and_unused_entropy_give_the_same_bits():
    hidden, weight, targets = _problem((7,), 8, 60, seed=22)
    hidden.requires_grad_()
    grad = randn(7, seed=23)
    plain = token_logprobs(hidden, weight, targets, vocab_chunk=16)
    lp32, _ = token_logprobs(hidden, weight, targets.int(), vocab_chunk=16, return_entropy=True)
    assert_bitwise_equal(lp32, plain, name="int32 targets")
    (g_plain,) = grads_of(plain, grad, [hidden])
    (g_unused,) = grads_of(lp32, grad, [hidden])
    assert_bitwise_equal(g_unused, g_plain, name="hidden grad, entropy unused")


def test_empty_batch():
    weight = randn(20, 8, seed=24).requires_grad_()
    hidden = torch.zeros(0, 8, requires_grad=True)
    logprob, entropy = token_logprobs(
        hidden, weight, torch.zeros(0, dtype=torch.long), vocab_chunk=8, return_entropy=True
    )
    assert logprob.shape == entropy.shape == (0,)
    g_h, g_w = grads_of((logprob, entropy), (torch.zeros(0), torch.zeros(0)), [hidden, weight])
    assert g_h.shape == (0, 8)
    assert_bitwise_equal(g_w, torch.zeros(20, 8), name="weight grad of no tokens")


def test_inputs_not_mutated():
    hidden, weight, targets = _problem((6,), 8, 50, seed=25)
    hidden.requires_grad_()
    weight.requires_grad_()
    cotangents = (randn(6, seed=26), randn(6, seed=27))
    before = snapshot(hidden, weight, targets, *cotangents)
    for fn in (token_logprobs, token_logprobs_fp32):
        outputs = fn(hidden, weight, targets, vocab_chunk=16, return_entropy=True)
        grads_of(outputs, cotangents, [hidden, weight])
    assert_unchanged(before, [hidden, weight, targets, *cotangents])


# ---- bad input ------------------------------------------------------------------------------

_H = torch.zeros(2, 3, 8)
_W = torch.zeros(10, 8)
_T = torch.zeros(2, 3, dtype=torch.long)

BAD_INPUTS = [
    ((_H.tolist(), _W, _T), {}, TypeError, "hidden must be a torch.Tensor"),
    ((_H, None, _T), {}, TypeError, "lm_head_weight must be a torch.Tensor"),
    ((_H, _W, [[0, 1, 2]]), {}, TypeError, "target_ids must be a torch.Tensor"),
    ((_H.bfloat16(), _W, _T), {}, TypeError, "lm_head_weight has dtype"),
    ((_H.double(), _W.double(), _T), {}, TypeError, "hidden must have dtype"),
    ((_H, _W, _T.float()), {}, TypeError, "target_ids must have dtype"),
    ((_H, _W, _T.short()), {}, TypeError, "target_ids must have dtype"),
    ((torch.zeros(2, 3, 7), _W, _T), {}, ValueError, r"hidden\.shape\[-1\]"),
    ((_H, torch.zeros(80), _T), {}, ValueError, "lm_head_weight must have 2 dimensions"),
    ((_H, torch.zeros(0, 8), _T), {}, ValueError, "vocabulary size 0"),
    ((_H, _W, _T[0]), {}, ValueError, "target_ids must have shape"),
    ((_H, _W, _T.reshape(6)), {}, ValueError, "target_ids must have shape"),
    ((torch.zeros(()), _W, _T[0, 0]), {}, ValueError, "hidden must have at least 1"),
    ((_H, _W.to("meta"), _T), {}, ValueError, "lm_head_weight is on meta"),
    ((_H, _W, _T.to("meta")), {}, ValueError, "target_ids is on meta"),
    ((_H, _W, _T), {"ignore_index": -100.0}, TypeError, "ignore_index must be an int"),
    ((_H, _W, _T), {"vocab_chunk": 0}, ValueError, "vocab_chunk must be >= 1"),
    ((_H, _W, _T), {"vocab_chunk": 2.5}, TypeError, "vocab_chunk must be an int"),
]


@pytest.mark.parametrize("fn", [token_logprobs, token_logprobs_fp32])
@pytest.mark.parametrize(("args", "kwargs", "error", "message"), BAD_INPUTS)
def test_bad_input_names_the_argument(fn, args, error, message, kwargs):
    with pytest.raises(error, match=message):
        fn(*args, **kwargs)


@pytest.mark.parametrize(
    ("position", "value"), [((1, 2), 10), ((0, 0), -1), ((1, 0), 12345), ((0, 2), -101)]
)
def test_out_of_range_target_names_target_ids_and_position(position, value):
    targets = _T.clone()
    targets[position] = value
    where = rf"target_ids\[{position[0]}, {position[1]}\] = {value}"
    with pytest.raises(IndexError, match=where):
        token_logprobs(_H, _W, targets)
    assert_bitwise_equal(targets[position], torch.tensor(value), name="targets untouched")

"""The CUDA token_logprobs kernels: within the contract's logprob tolerance of the strict fp32
reference (forward, entropy and both gradients), rows bitwise invariant to the batch
(logprob, entropy and hidden gradient, up to 8191 tokens at the Qwen3-8B lm_head shape), the
gradients within tolerance of float64 across backward chunks and token tiles, the weight
gradient bitwise identical run to run and untouched by ignored rows (NaN or finite garbage),
bad input errors."""

from __future__ import annotations

import os

import pytest
import torch

import batchinv
from batchinv.contract import (
    assert_bitwise_equal,
    assert_no_drift,
    assert_within_tolerance,
    deterministic_context,
    row_invariance_sweep,
)
from batchinv.gpu import token_logprobs as gpu_token_logprobs
from batchinv.reference.token_logprobs import token_logprobs_fp32

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
QUICK = os.environ.get("BATCHINV_QUICK") == "1"
DTYPES = (torch.bfloat16, torch.float16)
IGNORE = -100
# (tokens, H, V): a vocabulary with a short last tile and a short last backward chunk, one
# below a tile, and one over a backward chunk.
PARITY_CASES = [(37, 128, 5000), (5, 64, 200), (70, 256, 9000)]
SWEEP_BATCH_SIZES = (1, 3, 17, 257)
QWEN3_H, QWEN3_V = 4096, 151936
BIG_BATCH_SIZES = (1, 3, 257, 8191) if not QUICK else (1, 257)


def _inputs(tokens, hidden_size, vocab, dtype, seed=0, ignored=()):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, hidden_size, generator=gen).to(dtype)
    weight = (torch.randn(vocab, hidden_size, generator=gen) / hidden_size**0.25).to(dtype)
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    for position in ignored:
        targets[position] = IGNORE
    return hidden.to(DEVICE), weight.to(DEVICE), targets.to(DEVICE)


def _reference(hidden, weight, targets, **kwargs):
    with deterministic_context():
        return token_logprobs_fp32(hidden, weight, targets, IGNORE, **kwargs)


def _grads(fn, hidden, weight, targets, g, g_ent=None):
    hidden = hidden.detach().clone().requires_grad_(True)
    weight = weight.detach().clone().requires_grad_(True)
    out = fn(hidden, weight, targets, return_entropy=g_ent is not None)
    if g_ent is None:
        out.backward(g)
    else:
        torch.autograd.backward(out, (g, g_ent))
    return out, hidden.grad, weight.grad


def _batchinv(hidden, weight, targets, **kwargs):
    return batchinv.token_logprobs(hidden, weight, targets, IGNORE, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", PARITY_CASES)
def test_forward_and_entropy_match_reference(case, dtype):
    hidden, weight, targets = _inputs(*case, dtype, ignored=(1,))
    logprob, entropy = _batchinv(hidden, weight, targets, return_entropy=True)
    ref_logprob, ref_entropy = _reference(hidden, weight, targets, return_entropy=True)
    assert logprob.dtype == entropy.dtype == torch.float32
    assert_within_tolerance(logprob, ref_logprob, op_class="logprob", dtype=dtype, name="logprob")
    assert_within_tolerance(entropy, ref_entropy, op_class="logprob", dtype=dtype, name="entropy")
    # Ignored tokens give +0 by definition.
    zero = torch.zeros(1, device=DEVICE)
    assert_bitwise_equal(logprob[1:2], zero)
    assert_bitwise_equal(entropy[1:2], zero)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_entropy", (False, True))
@pytest.mark.parametrize("case", PARITY_CASES[:2])
def test_gradients_match_reference(case, with_entropy, dtype):
    hidden, weight, targets = _inputs(*case, dtype, ignored=(2,))
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(case[0], generator=gen).to(DEVICE)
    g_ent = torch.randn(case[0], generator=gen).to(DEVICE) if with_entropy else None
    _, grad_h, grad_w = _grads(_batchinv, hidden, weight, targets, g, g_ent)
    _, ref_h, ref_w = _grads(_reference, hidden, weight, targets, g, g_ent)
    assert grad_h.dtype == hidden.dtype and grad_w.dtype == weight.dtype
    opts = {"op_class": "logprob", "kind": "grad", "dtype": dtype}
    assert_within_tolerance(grad_h.float(), ref_h.float(), name="d_hidden", **opts)
    assert_within_tolerance(grad_w.float(), ref_w.float(), name="d_weight", **opts)
    assert_bitwise_equal(grad_h[2:3], torch.zeros_like(grad_h[2:3]))


def _float64_grads(hidden, weight, targets, g):
    """Dense float64 autograd of sum(g * logprob) on the same rounded inputs."""
    hidden = hidden.double().requires_grad_(True)
    weight = weight.double().requires_grad_(True)
    valid = targets != IGNORE
    logp = torch.log_softmax(hidden @ weight.t(), -1)
    picked = logp.gather(-1, torch.where(valid, targets, 0).unsqueeze(-1)).squeeze(-1)
    (torch.where(valid, picked, 0.0) * g).sum().backward()
    return hidden.grad, weight.grad


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_match_float64_across_chunks_and_token_tiles(dtype):
    """300 tokens (five 64-token k-tiles of the weight gradient, the last partial), H 320 (a
    partial 256-column tile and a partial 64-column box of the N-major operands), V 9000
    (three backward chunks, the last 808 wide).  The cotangent is N(0, 1), as in the
    measurement the tolerance entry comes from (docs/tolerances.md): the entry's absolute term
    is per unit of cotangent (the bf16 rounding of d_z, which the GPU path shares with Liger,
    grows with it), so a scaled cotangent would need a scaled entry."""
    tokens, hidden_size, vocab = 300, 320, 9000
    ignored = (0, 63, 64, 299)
    hidden, weight, targets = _inputs(tokens, hidden_size, vocab, dtype, seed=11, ignored=ignored)
    g = torch.randn(tokens, generator=torch.Generator().manual_seed(12)).to(DEVICE)
    _, grad_h, grad_w = _grads(_batchinv, hidden, weight, targets, g)
    ref_h, ref_w = _float64_grads(hidden, weight, targets, g)
    opts = {"op_class": "logprob", "kind": "grad", "dtype": dtype}
    assert_within_tolerance(grad_h.float(), ref_h, name="d_hidden", **opts)
    assert_within_tolerance(grad_w.float(), ref_w, name="d_weight", **opts)
    zeros = torch.zeros(len(ignored), hidden_size, dtype=dtype, device=DEVICE)
    assert_bitwise_equal(grad_h[list(ignored)], zeros)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_are_batch_invariant(dtype):
    hidden_size, vocab = 128, 5000
    gen = torch.Generator().manual_seed(3)
    weight = (torch.randn(vocab, hidden_size, generator=gen) / 4).to(dtype).to(DEVICE)

    def make(n, generator):
        return (
            torch.randn(n, hidden_size, generator=generator).to(dtype),
            torch.randint(0, vocab, (n,), generator=generator),
        )

    def op(rows):
        hidden, targets = rows
        return _batchinv(hidden.to(DEVICE), weight, targets.to(DEVICE), return_entropy=True)

    reports = row_invariance_sweep(op, make, batch_sizes=SWEEP_BATCH_SIZES, int_high=vocab)
    assert_no_drift(reports)


def _row_grad(hidden, weight, targets, g, g_ent):
    hidden = hidden.detach().clone().requires_grad_(True)
    outputs = _batchinv(hidden, weight, targets, return_entropy=True)
    torch.autograd.backward(outputs, (g, g_ent))
    return hidden.grad


@pytest.mark.parametrize("dtype", DTYPES)
def test_hidden_gradient_rows_are_batch_invariant(dtype):
    """Logprob and entropy cotangents; rows alone, in slices and in the full batch."""
    tokens, hidden_size, vocab = 257, 128, 9000
    hidden, weight, targets = _inputs(tokens, hidden_size, vocab, dtype, seed=4, ignored=(7,))
    gen = torch.Generator().manual_seed(5)
    g, g_ent = torch.randn(2, tokens, generator=gen).to(DEVICE)
    full = _row_grad(hidden, weight, targets, g, g_ent)
    for start, stop in ((0, 1), (100, 101), (256, 257), (3, 20), (90, 257)):
        rows = slice(start, stop)
        part = _row_grad(hidden[rows], weight, targets[rows], g[rows], g_ent[rows])
        assert_bitwise_equal(part, full[start:stop], name=f"d_hidden rows {start}:{stop}")


@pytest.mark.parametrize("tokens", BIG_BATCH_SIZES)
def test_qwen3_lm_head_rows_match_alone(tokens):
    """Rows 0, the middle and the last of a batch equal the same rows computed alone, at the
    Qwen3-8B lm_head shape (forward and hidden gradient)."""
    dtype = torch.bfloat16
    gen = torch.Generator(device=DEVICE).manual_seed(6)
    weight = (torch.randn(QWEN3_V, QWEN3_H, generator=gen, device=DEVICE) / 8).to(dtype)
    hidden = torch.randn(tokens, QWEN3_H, generator=gen, device=DEVICE).to(dtype)
    targets = torch.randint(0, QWEN3_V, (tokens,), generator=gen, device=DEVICE)
    g = torch.randn(tokens, generator=gen, device=DEVICE)
    batch_hidden = hidden.clone().requires_grad_(True)
    logprob = _batchinv(batch_hidden, weight, targets)
    logprob.backward(g)
    for row in sorted({0, tokens // 2, tokens - 1}):
        alone = hidden[row : row + 1].clone().requires_grad_(True)
        alone_logprob = _batchinv(alone, weight, targets[row : row + 1])
        alone_logprob.backward(g[row : row + 1])
        assert_bitwise_equal(alone_logprob, logprob[row : row + 1], name=f"logprob row {row}")
        assert_bitwise_equal(alone.grad, batch_hidden.grad[row : row + 1], name=f"d_h row {row}")
    if tokens == BIG_BATCH_SIZES[-1]:
        # A float64 reference (the fp32 one steps through H and V in Python: too slow here).
        logits = hidden[:4].double() @ weight.double().t()
        ref = torch.log_softmax(logits, -1).gather(-1, targets[:4, None]).squeeze(-1)
        assert_within_tolerance(logprob[:4], ref, op_class="logprob", dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_weight_gradient_is_deterministic_and_ignores_padding(dtype):
    tokens, hidden_size, vocab = 300, 128, 5000
    hidden, weight, targets = _inputs(tokens, hidden_size, vocab, dtype, seed=8)
    g = torch.randn(tokens, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    _, _, first = _grads(_batchinv, hidden, weight, targets, g)
    _, _, second = _grads(_batchinv, hidden, weight, targets, g)
    assert_bitwise_equal(first, second, name="d_weight run to run")
    # NaN rows at ignored positions reach neither the weight gradient nor other rows.
    padded_hidden = hidden.clone()
    padded_targets = targets.clone()
    padded_hidden[[5, 77]] = float("nan")
    padded_targets[[5, 77]] = IGNORE
    out, grad_h, grad_w = _grads(_batchinv, padded_hidden, weight, padded_targets, g)
    assert torch.isfinite(grad_w).all() and torch.isfinite(out).all()
    assert torch.isfinite(grad_h).all()
    assert_bitwise_equal(out[[5, 77]], torch.zeros(2, device=DEVICE))
    assert_bitwise_equal(grad_h[[5, 77]], torch.zeros_like(grad_h[[5, 77]]))
    # Finite garbage in the ignored rows (read as they are, no cleaned copy) gives the same
    # weight gradient as zero rows: its products with d_z = 0 are exact zeros.
    zero_hidden, garbage_hidden = hidden.clone(), hidden.clone()
    zero_hidden[[5, 77]] = 0
    garbage = 1000 * torch.randn(2, hidden_size, generator=torch.Generator().manual_seed(10))
    garbage_hidden[[5, 77]] = garbage.to(dtype).to(DEVICE)
    _, _, zero_w = _grads(_batchinv, zero_hidden, weight, padded_targets, g)
    _, _, garbage_w = _grads(_batchinv, garbage_hidden, weight, padded_targets, g)
    assert_bitwise_equal(garbage_w, zero_w, name="d_weight, garbage vs zero ignored rows")
    assert_bitwise_equal(grad_w, zero_w, name="d_weight, NaN vs zero ignored rows")


def test_empty_batch():
    _, weight, _ = _inputs(1, 64, 300, torch.bfloat16)
    hidden = torch.empty(0, 64, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    targets = torch.empty(0, dtype=torch.int64, device=DEVICE)
    w = weight.clone().requires_grad_(True)
    out = _batchinv(hidden, w, targets)
    assert out.shape == (0,) and out.dtype == torch.float32
    out.sum().backward()
    assert_bitwise_equal(w.grad, torch.zeros_like(weight))


def test_bad_target_raises_index_error_naming_position():
    hidden, weight, targets = _inputs(6, 64, 300, torch.bfloat16)
    targets = targets.reshape(2, 3).clone()
    targets[1, 2] = 300
    with pytest.raises(IndexError, match=r"target_ids\[1, 2\] = 300 is outside"):
        _batchinv(hidden.reshape(2, 3, 64), weight, targets)
    targets[1, 2] = -1
    with pytest.raises(IndexError, match=r"target_ids\[1, 2\] = -1"):
        _batchinv(hidden.reshape(2, 3, 64), weight, targets)


def test_bad_gpu_arguments():
    hidden, weight, targets = _inputs(4, 64, 300, torch.bfloat16)
    with pytest.raises(TypeError, match="bf16 or fp16"):
        _batchinv(hidden.float(), weight.float(), targets)
    odd_hidden, odd_weight, _ = _inputs(4, 12, 300, torch.bfloat16)
    with pytest.raises(ValueError, match="multiple"):
        _batchinv(odd_hidden, odd_weight, targets)
    with pytest.raises(ValueError, match="contiguous"):
        _batchinv(hidden[:, :32], weight.t().contiguous().t()[:, :32], targets)


@pytest.mark.parametrize("id_dtype", (torch.int32, torch.int64))
@pytest.mark.parametrize("ignore_index", (IGNORE, 7, 5000, -(2**40)))
@pytest.mark.parametrize("count", (1, 255, 257, 4099))
def test_target_marking_kernel_matches_its_reference(id_dtype, ignore_index, count):
    # Ids inside and outside [0, vocab), ignore_index among them; one beyond int32 is taken by
    # the torch route (torch's comparison).  Several CTAs, so the first bad position is an
    # atomicMin across them.
    vocab = 5000
    gen = torch.Generator().manual_seed(count)
    ids = torch.randint(-3, vocab + 3, (count,), generator=gen)
    ids[torch.rand(count, generator=gen) < 0.2] = ignore_index
    ids = ids.to(id_dtype).to(DEVICE)
    want, bad = gpu_token_logprobs.mark_targets_reference(ids, ignore_index, vocab)
    flag = torch.full((1,), -1, dtype=torch.int64, device=DEVICE)
    got = gpu_token_logprobs.mark_targets(ids, ignore_index, vocab, flag)
    assert_bitwise_equal(got, want)
    first = int(bad.nonzero()[0, 0]) if bad.any() else -1
    assert flag.item() == first
    clean = torch.where(bad, 0, ids)  # no bad id: the flag stays UINT64_MAX
    flag.fill_(-1)
    gpu_token_logprobs.mark_targets(clean, ignore_index, vocab, flag)
    assert flag.item() == -1
    if count > 1:  # a flag already below a later call's first bad position keeps its value
        flag.fill_(0)
        gpu_token_logprobs.mark_targets(ids, ignore_index, vocab, flag)
        assert flag.item() == 0


def test_target_marking_reads_strided_ids_as_the_op_does():
    ids = torch.arange(20, device=DEVICE).reshape(4, 5)[:, ::2]  # [4, 3], strided
    flag = torch.full((1,), -1, dtype=torch.int64, device=DEVICE)
    got = gpu_token_logprobs.mark_targets(ids, IGNORE, 11, flag)
    assert got.tolist() == [0, 2, 4, 5, 7, 9, 10, -1, -1, -1, -1, -1]
    assert flag.item() == 7

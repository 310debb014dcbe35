"""HIP's kernels run on an NVIDIA GPU: the portable entries (``linear_simt_*``,
``kernels_cu/token_logprobs_portable.cu``) are in the CUDA build too, so this is the one place
their arithmetic runs (no AMD GPU exists for this project: docs/amd.md).

The ``hip_dispatch`` fixture makes the registry answer "hip" for CUDA tensors, so the public
ops take their HIP entries end to end (validation, autograd, custom op), while the kernels load
from the CUDA image, which holds the same portable sources.  Checked: accuracy against the
strict fp32 references (the contract's table), rows bitwise invariant to the batch, the token
reductions (grad_weight, d_W) bitwise identical run to run, bad input errors.  These are the
portable code's bits under nvcc and libdevice; HIP's come from clang and ROCm's ocml (expf,
logf), so they are checked here for their order, not for HIP's exact values.
"""

from __future__ import annotations

import pytest
import torch

import batchinv
from batchinv import registry
from batchinv.contract import (
    assert_bitwise_equal,
    assert_no_drift,
    assert_within_tolerance,
    deterministic_context,
    row_invariance_sweep,
)
from batchinv.gpu import linear as gpu_linear
from batchinv.gpu import token_logprobs_portable as portable
from batchinv.reference.linear import linear_backward, linear_fp32
from batchinv.reference.token_logprobs import token_logprobs_fp32

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
DTYPES = (torch.bfloat16, torch.float16)
IGNORE = -100
# (tokens, H, V): a short last 256-column tile, a vocabulary below one tile, and one over a
# forward logits chunk and two backward chunks (both 4096 columns).
PARITY_CASES = [(37, 128, 5000), (5, 64, 200), (70, 256, 9000)]
SWEEP_BATCH_SIZES = (1, 3, 17, 257)
QWEN3_H, QWEN3_V = 4096, 151936


@pytest.fixture
def hip_dispatch(monkeypatch):
    """The registry's HIP entries for CUDA tensors; the kernels still come from the CUDA image
    (batchinv.runtime resolves the image by its own backend lookup)."""
    real = registry.backend_of
    monkeypatch.setattr(
        registry, "backend_of", lambda device: "hip" if device.type == "cuda" else real(device)
    )
    assert registry.lookup("token_logprobs", torch.device(DEVICE)) is portable.token_logprobs


def _randn(*shape, dtype, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


# ---- linear and lm_head: the SIMT loop -----------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", (False, True))
@pytest.mark.parametrize("m, k, n", [(1, 64, 33), (70, 256, 300), (257, 1024, 129)])
def test_linear_forward_matches_reference(hip_dispatch, dtype, with_bias, m, k, n):
    x = _randn(m, k, dtype=dtype, seed=1)
    w = _randn(n, k, dtype=dtype, seed=2, scale=k**-0.5)
    bias = _randn(n, dtype=dtype, seed=3) if with_bias else None
    out = batchinv.linear(x, w, bias)
    assert out.dtype == dtype
    assert_bitwise_equal(out, gpu_linear.simt_matmul_nt(x, w, bias), name="op vs loop")
    assert_within_tolerance(out, linear_fp32(x, w, bias), op_class="reduction", name="linear")
    logits = batchinv.lm_head(x, w, bias)
    assert_bitwise_equal(logits, out, name="lm_head is linear")


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_rows_are_batch_invariant(hip_dispatch, dtype):
    k, n = 256, 300
    w = _randn(n, k, dtype=dtype, seed=4, scale=k**-0.5)

    def make(rows, generator):
        return torch.randn(rows, k, generator=generator).to(dtype)

    def op(rows):
        return batchinv.linear(rows.to(DEVICE), w)

    assert_no_drift(row_invariance_sweep(op, make, batch_sizes=SWEEP_BATCH_SIZES))


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_gradients_match_reference_and_repeat_bitwise(hip_dispatch, dtype):
    m, k, n = 70, 128, 96
    x = _randn(m, k, dtype=dtype, seed=5)
    w = _randn(n, k, dtype=dtype, seed=6, scale=k**-0.5)
    bias = _randn(n, dtype=dtype, seed=7)
    grad = _randn(m, n, dtype=dtype, seed=8)

    def grads():
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, w, bias)]
        batchinv.linear(*leaves).backward(grad)
        return [t.grad for t in leaves]

    got = grads()
    expected = linear_backward(grad.float(), x.float(), w.float(), torch.float32)
    for what, g, want in zip(("grad_x", "grad_weight", "grad_bias"), got, expected, strict=True):
        assert g.dtype == dtype
        assert_within_tolerance(g, want, op_class="reduction", kind="grad", name=what)
    assert_bitwise_equal(grads(), got, name="gradients run to run")


# ---- token_logprobs --------------------------------------------------------------------------


def _inputs(tokens, hidden_size, vocab, dtype, seed=0, ignored=()):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, hidden_size, generator=gen).to(dtype)
    weight = (torch.randn(vocab, hidden_size, generator=gen) / hidden_size**0.25).to(dtype)
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    for position in ignored:
        targets[position] = IGNORE
    return hidden.to(DEVICE), weight.to(DEVICE), targets.to(DEVICE)


def _batchinv(hidden, weight, targets, **kwargs):
    return batchinv.token_logprobs(hidden, weight, targets, IGNORE, **kwargs)


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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", PARITY_CASES)
def test_token_logprobs_forward_and_entropy_match_reference(hip_dispatch, case, dtype):
    hidden, weight, targets = _inputs(*case, dtype, ignored=(1,))
    logprob, entropy = _batchinv(hidden, weight, targets, return_entropy=True)
    ref_logprob, ref_entropy = _reference(hidden, weight, targets, return_entropy=True)
    assert logprob.dtype == entropy.dtype == torch.float32
    assert_within_tolerance(logprob, ref_logprob, op_class="logprob", dtype=dtype, name="logprob")
    assert_within_tolerance(entropy, ref_entropy, op_class="logprob", dtype=dtype, name="entropy")
    zero = torch.zeros(1, device=DEVICE)
    assert_bitwise_equal(logprob[1:2], zero)
    assert_bitwise_equal(entropy[1:2], zero)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_entropy", (False, True))
@pytest.mark.parametrize("case", PARITY_CASES)
def test_token_logprobs_gradients_match_reference(hip_dispatch, case, with_entropy, dtype):
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
    _, _, again = _grads(_batchinv, hidden, weight, targets, g, g_ent)
    assert_bitwise_equal(again, grad_w, name="d_weight run to run")


@pytest.mark.parametrize("dtype", DTYPES)
def test_token_logprobs_rows_are_batch_invariant(hip_dispatch, dtype):
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
def test_token_logprobs_hidden_gradient_rows_are_batch_invariant(hip_dispatch, dtype):
    tokens, hidden_size, vocab = 257, 128, 9000
    hidden, weight, targets = _inputs(tokens, hidden_size, vocab, dtype, seed=4, ignored=(7,))
    gen = torch.Generator().manual_seed(5)
    g, g_ent = torch.randn(2, tokens, generator=gen).to(DEVICE)
    full = _row_grad(hidden, weight, targets, g, g_ent)
    for start, stop in ((0, 1), (100, 101), (256, 257), (3, 20), (90, 257)):
        rows = slice(start, stop)
        part = _row_grad(hidden[rows], weight, targets[rows], g[rows], g_ent[rows])
        assert_bitwise_equal(part, full[start:stop], name=f"d_hidden rows {start}:{stop}")


def test_token_logprobs_forward_chunk_changes_no_bit(hip_dispatch, monkeypatch):
    """The forward's logits chunk bounds memory only: every tile state is the same."""
    hidden, weight, targets = _inputs(37, 128, 9000, torch.bfloat16, seed=9)
    default = _batchinv(hidden, weight, targets, return_entropy=True)
    monkeypatch.setattr(portable, "LOGITS_CHUNK", 256)
    assert_bitwise_equal(_batchinv(hidden, weight, targets, return_entropy=True), default)


def test_token_logprobs_qwen3_rows_match_alone(hip_dispatch):
    """Rows 0, the middle and the last of 17 equal the same rows alone at the Qwen3-8B lm_head
    shape (forward and hidden gradient); a float64 check of four rows."""
    tokens, dtype = 17, torch.bfloat16
    gen = torch.Generator(device=DEVICE).manual_seed(6)
    weight = (torch.randn(QWEN3_V, QWEN3_H, generator=gen, device=DEVICE) / 8).to(dtype)
    hidden = torch.randn(tokens, QWEN3_H, generator=gen, device=DEVICE).to(dtype)
    targets = torch.randint(0, QWEN3_V, (tokens,), generator=gen, device=DEVICE)
    g = torch.randn(tokens, generator=gen, device=DEVICE)
    batch_hidden = hidden.clone().requires_grad_(True)
    logprob = _batchinv(batch_hidden, weight, targets)
    logprob.backward(g)
    for row in (0, tokens // 2, tokens - 1):
        alone = hidden[row : row + 1].clone().requires_grad_(True)
        alone_logprob = _batchinv(alone, weight, targets[row : row + 1])
        alone_logprob.backward(g[row : row + 1])
        assert_bitwise_equal(alone_logprob, logprob[row : row + 1], name=f"logprob row {row}")
        assert_bitwise_equal(alone.grad, batch_hidden.grad[row : row + 1], name=f"d_h row {row}")
    logits = hidden[:4].double() @ weight.double().t()
    ref = torch.log_softmax(logits, -1).gather(-1, targets[:4, None]).squeeze(-1)
    assert_within_tolerance(logprob[:4], ref, op_class="logprob", dtype=dtype)


def test_token_logprobs_custom_op_gives_the_eager_bits(hip_dispatch):
    """The custom op's saving forward and saved backward (the HIP entries) against autograd."""
    hidden, weight, targets = _inputs(37, 128, 5000, torch.bfloat16, seed=10, ignored=(4,))
    gen = torch.Generator().manual_seed(11)
    g, g_ent = torch.randn(2, 37, generator=gen).to(DEVICE)
    eager, eager_h, eager_w = _grads(_batchinv, hidden, weight, targets, g, g_ent)
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    logprob, entropy, _lse = torch.ops.batchinv.token_logprobs(h, w, targets, IGNORE, 4096, True)
    torch.autograd.backward((logprob, entropy), (g, g_ent))
    assert_bitwise_equal((logprob, entropy), eager)
    assert_bitwise_equal((h.grad, w.grad), (eager_h, eager_w))


def test_token_logprobs_bad_input_errors_as_on_cuda(hip_dispatch):
    hidden, weight, targets = _inputs(6, 64, 300, torch.float16)
    targets[4] = 300
    with pytest.raises(IndexError, match="target_ids"):
        _batchinv(hidden, weight, targets)
    with pytest.raises(ValueError, match="multiple of 8"):
        _batchinv(hidden[:, :60], weight[:, :60].contiguous(), targets)
    with pytest.raises(TypeError, match="bf16 or fp16"):
        _batchinv(hidden.float(), weight.float(), targets)

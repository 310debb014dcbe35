"""Tests of the log_softmax reference: definition, -inf rows, Axis-A, Axis-B, errors."""

from __future__ import annotations

import pytest
import torch
from _helpers_reduction import (
    ALL_FLOAT,
    LOW_PRECISION,
    assert_unchanged,
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
from batchinv.reference.log_softmax import (
    LSE_CHUNK,
    LogSoftmaxReference,
    log_softmax,
    log_softmax_fp32,
    lse_state_rows,
)

# (shape of x, chunk_size): one chunk, several chunks with a short last one, one column each.
ACCURACY_CASES = [
    ((1, 1), LSE_CHUNK),
    ((5, 37), LSE_CHUNK),
    ((4, 300), 64),
    ((2, 3, 50), 7),
    ((3, 9), 1),
    ((2, LSE_CHUNK + 100), LSE_CHUNK),
]
SWEEP_V, SWEEP_CHUNK = 50, 16
NEG_INF = float("-inf")


def _float64_grad(x, grad_out):
    x64 = x.detach().double().requires_grad_()
    out = torch.log_softmax(x64, dim=-1)
    return out, grads_of(out, grad_out.double(), [x64])[0]


# ---- accuracy and the definition ------------------------------------------------------------


@pytest.mark.parametrize(("shape", "chunk"), ACCURACY_CASES)
def test_forward_matches_float64_torch(shape, chunk):
    x = randn(*shape, seed=1, scale=4.0)
    out = log_softmax(x, chunk_size=chunk)
    assert out.dtype == torch.float32 and out.shape == x.shape
    expected = torch.log_softmax(x.double(), dim=-1)
    assert_within_tolerance(out, expected, op_class="logprob", kind="forward")


@pytest.mark.parametrize(("shape", "chunk"), ACCURACY_CASES)
def test_grad_matches_float64_autograd(shape, chunk):
    x = randn(*shape, seed=2, scale=4.0).requires_grad_()
    grad_out = randn(*shape, seed=3)
    (grad_x,) = grads_of(log_softmax(x, chunk_size=chunk), grad_out, [x])
    _, expected = _float64_grad(x, grad_out)
    assert_within_tolerance(grad_x, expected, op_class="logprob", kind="grad")


def test_chunk_sizes_agree_within_tolerance():
    x = randn(6, 333, seed=4, scale=8.0)
    one_chunk = log_softmax(x, chunk_size=LSE_CHUNK)
    for chunk in (1, 10, 128):
        assert_within_tolerance(
            log_softmax(x, chunk_size=chunk), one_chunk, op_class="logprob", kind="forward"
        )


@pytest.mark.parametrize("chunk", [1, 7, 40, LSE_CHUNK])
def test_matches_scalar_definition_bitwise(chunk):
    """The documented chunk order, re-done one fp32 scalar at a time.

    ``l`` itself is compared: a different summation order can vanish in ``m + log(l)``.
    """
    x = randn(3, 40, seed=17, scale=5.0)
    m, l = lse_state_rows(x, chunk)
    out = log_softmax(x, chunk_size=chunk)
    for i in range(3):
        m_i, l_i, _ = scalar_lse_definition(x[i], chunk)
        assert_bitwise_equal(m[i], m_i, name=f"m of row {i}")
        assert_bitwise_equal(l[i], l_i, name=f"l of row {i}")
        assert_bitwise_equal(out[i], x[i] - (m_i + torch.log(l_i)), name=f"row {i}")


def test_backward_matches_scalar_definition_bitwise():
    """``dx = dy - exp(out) * sum(dy)`` with the row sum taken left to right."""
    x = randn(3, 40, seed=18, scale=5.0).requires_grad_()
    grad_out = randn(3, 40, seed=19)
    out = log_softmax(x, chunk_size=16)
    (grad_x,) = grads_of(out, grad_out, [x])
    for i in range(3):
        total = torch.zeros(())
        for j in range(40):
            total = total + grad_out[i, j]
        expected = grad_out[i] - torch.exp(out[i].detach()) * total
        assert_bitwise_equal(grad_x[i], expected, name=f"grad of row {i}")


@pytest.mark.parametrize("out_dtype", LOW_PRECISION)
def test_out_dtype_rounds_the_fp32_result_once(out_dtype):
    x = randn(4, 70, seed=5, scale=6.0)
    rounded = log_softmax(x, out_dtype=out_dtype, chunk_size=32)
    assert_bitwise_equal(rounded, log_softmax(x, chunk_size=32).to(out_dtype), name="rounded out")


def test_lse_of_equal_logits_is_exact():
    # V equal logits: every exp is exactly 1, the sum is V, out = -log(V) up to log's rounding.
    x = torch.full((3, 64), 2.5)
    out = log_softmax(x, chunk_size=16)
    assert_bitwise_equal(out, torch.full((3, 64), 2.5) - (2.5 + torch.log(torch.tensor(64.0))))


# ---- masked rows ----------------------------------------------------------------------------


def test_partially_masked_rows():
    x = randn(4, 40, seed=6, scale=3.0)
    x[0, :16] = NEG_INF  # the whole first chunk is masked
    x[1, 5] = NEG_INF
    x[2, 16:32] = NEG_INF  # a middle chunk
    x[3, ::2] = NEG_INF
    mask = x == NEG_INF
    x.requires_grad_()
    out = log_softmax(x, chunk_size=16)
    grad_out = randn(4, 40, seed=7)
    (grad_x,) = grads_of(out, grad_out, [x])
    expected, expected_grad = _float64_grad(x, grad_out)
    assert not out.isnan().any() and not grad_x.isnan().any()
    assert bool((out[mask] == NEG_INF).all())
    finite = ~mask
    assert_within_tolerance(out[finite], expected[finite], op_class="logprob")
    assert_within_tolerance(grad_x, expected_grad, op_class="logprob", kind="grad")


@pytest.mark.parametrize("dtype", ALL_FLOAT)
def test_fully_masked_row_is_minus_inf_with_zero_grad(dtype):
    x = randn(3, 20, seed=8, dtype=dtype)
    x[1] = NEG_INF
    x.requires_grad_()
    out = log_softmax(x, chunk_size=8)
    (grad_x,) = grads_of(out, randn(3, 20, seed=9), [x])
    assert_bitwise_equal(out[1], torch.full((20,), NEG_INF), name="fully masked row")
    assert_bitwise_equal(grad_x[1], torch.zeros(20, dtype=dtype), name="its gradient")
    assert not out.isnan().any() and not grad_x.isnan().any()
    # The other rows are untouched by it (checked against the same rows alone).
    alone = log_softmax(x.detach()[[0, 2]], chunk_size=8)
    assert_bitwise_equal(out[[0, 2]], alone, name="other rows")


# ---- Axis-B ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize(("shape", "chunk"), ACCURACY_CASES)
def test_low_precision_within_tolerance_of_fp32(shape, chunk, dtype):
    x = randn(*shape, seed=10, scale=4.0, dtype=dtype)
    module = LogSoftmaxReference(out_dtype=dtype, chunk_size=chunk)
    actual = module(x)
    assert actual.dtype == dtype
    assert_within_tolerance(actual, module.forward_fp32(x), op_class="logprob", kind="forward")
    # With the default fp32 output nothing is rounded: the two paths are the same bits.
    assert_bitwise_equal(log_softmax(x, chunk_size=chunk), log_softmax_fp32(x, chunk_size=chunk))


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_low_precision_grad_within_tolerance_of_fp32(dtype):
    x = randn(5, 90, seed=11, scale=4.0, dtype=dtype).requires_grad_()
    grad_out = randn(5, 90, seed=12, dtype=dtype)
    (grad_x,) = grads_of(log_softmax(x, out_dtype=dtype, chunk_size=32), grad_out, [x])
    assert grad_x.dtype == dtype
    x32 = x.detach().float().requires_grad_()
    (expected,) = grads_of(log_softmax_fp32(x32, chunk_size=32), grad_out.float(), [x32])
    assert_within_tolerance(grad_x, expected, op_class="logprob", kind="grad")


# ---- Axis-A ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_FLOAT)
def test_forward_row_invariance(dtype):
    def make_rows(n, gen):
        return (torch.randn(n, SWEEP_V, generator=gen) * 5).to(dtype)

    reports = row_invariance_sweep(lambda x: log_softmax(x, chunk_size=SWEEP_CHUNK), make_rows)
    assert_no_drift(reports)


@pytest.mark.parametrize("dtype", ALL_FLOAT)
def test_grad_row_invariance(dtype):
    def make_rows(n, gen):
        # One row = an input row and its own cotangent row.
        x = (torch.randn(n, SWEEP_V, generator=gen) * 5).to(dtype)
        return x, torch.randn(n, SWEEP_V, generator=gen).to(dtype)

    def grad_x(rows):
        x = rows[0].clone().requires_grad_()
        out = log_softmax(x, out_dtype=dtype, chunk_size=SWEEP_CHUNK)
        return grads_of(out, rows[1], [x])[0]

    assert_no_drift(row_invariance_sweep(grad_x, make_rows))


# ---- edge cases and errors ------------------------------------------------------------------


def test_empty_batch_and_leading_dims():
    assert log_softmax(torch.zeros(0, 7)).shape == (0, 7)
    assert log_softmax(torch.zeros(2, 0, 7)).shape == (2, 0, 7)
    x = randn(7, seed=13)
    assert_bitwise_equal(log_softmax(x), log_softmax(x[None])[0], name="1-d input")


def test_dim_spelled_as_last_index():
    x = randn(2, 3, 11, seed=14)
    assert_bitwise_equal(log_softmax(x, dim=2), log_softmax(x, dim=-1), name="dim=2")


def test_inputs_not_mutated():
    x = randn(3, 33, seed=15).requires_grad_()
    grad_out = randn(3, 33, seed=16)
    before = snapshot(x, grad_out)
    grads_of(log_softmax(x, chunk_size=8), grad_out, [x])
    grads_of(log_softmax_fp32(x, chunk_size=8), grad_out, [x])
    assert_unchanged(before, [x, grad_out])


_X = torch.zeros(2, 5)

BAD_INPUTS = [
    ((_X.tolist(),), {}, TypeError, "x must be a torch.Tensor"),
    ((_X.double(),), {}, TypeError, "x must have dtype"),
    ((_X.long(),), {}, TypeError, "x must have dtype"),
    ((torch.zeros(()),), {}, ValueError, "x must have at least 1 dimension"),
    ((torch.zeros(3, 0),), {}, ValueError, r"x\.shape\[-1\] must be >= 1"),
    ((_X, 0), {}, ValueError, "dim must be the last dimension"),
    ((_X, -2), {}, ValueError, "dim must be the last dimension"),
    ((_X, 1.0), {}, TypeError, "dim must be an int"),
    ((_X, -1, torch.int64), {}, TypeError, "out_dtype must be one of"),
    ((_X,), {"chunk_size": 0}, ValueError, "chunk_size must be >= 1"),
    ((_X,), {"chunk_size": True}, TypeError, "chunk_size must be an int"),
]


@pytest.mark.parametrize(("args", "kwargs", "error", "message"), BAD_INPUTS)
def test_bad_input_names_the_argument(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        log_softmax(*args, **kwargs)
    if len(args) < 3:  # log_softmax_fp32 has no out_dtype
        with pytest.raises(error, match=message):
            log_softmax_fp32(*args, **kwargs)

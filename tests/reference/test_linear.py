"""Tests of the linear reference: definition, invariance (Axis-A), accuracy (Axis-B), errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _helpers_reduction import (
    ALL_FLOAT,
    LOW_PRECISION,
    assert_unchanged,
    grads_of,
    randn,
    snapshot,
)

from batchinv.contract import (
    assert_bitwise_equal,
    assert_no_drift,
    assert_within_tolerance,
    row_invariance_sweep,
)
from batchinv.reference.linear import LinearReference, linear, linear_fp32

# (leading shape of x, in_features K, out_features N); K stays small: the loop is O(K) steps.
ACCURACY_SHAPES = [((1,), 1, 1), ((7,), 33, 5), ((3, 5), 64, 17), ((2, 3, 4), 128, 9)]
LONG_K_SHAPE = ((17,), 1024, 8)
SWEEP_K, SWEEP_N = 48, 24


def _params(k, n, *, seed, dtype=torch.float32, with_bias=True):
    weight = randn(n, k, seed=seed, scale=k**-0.5, dtype=dtype)
    bias = randn(n, seed=seed + 1, dtype=dtype) if with_bias else None
    return weight, bias


def _float64_grads(x, weight, bias, grad_y):
    leaves = [t.detach().double().requires_grad_() for t in (x, weight)]
    bias64 = bias.detach().double().requires_grad_() if bias is not None else None
    y = F.linear(leaves[0], leaves[1], bias64)
    inputs = leaves + ([bias64] if bias64 is not None else [])
    return y, grads_of(y, grad_y.double(), inputs)


# ---- the definition itself ------------------------------------------------------------------


def test_matches_scalar_fp32_loop_bitwise():
    """The documented order, re-done one scalar at a time in numpy float32."""
    x = randn(3, 11, seed=1)
    weight, bias = _params(11, 4, seed=2)
    y = linear(x, weight, bias)
    xs, ws, bs = x.numpy(), weight.numpy(), bias.numpy()
    expected = np.empty((3, 4), dtype=np.float32)
    for i in range(3):
        for j in range(4):
            acc = np.float32(0.0)
            for k in range(11):
                acc = np.float32(acc + np.float32(xs[i, k] * ws[j, k]))
            expected[i, j] = np.float32(acc + bs[j])
    assert_bitwise_equal(y, torch.from_numpy(expected), name="linear vs scalar loop")


def test_backward_matches_scalar_fp32_loops_bitwise():
    """grad_x over out_features in order; grad_weight and grad_bias over tokens in order."""
    m, k, n = 24, 6, 20
    x = randn(m, k, seed=30).requires_grad_()
    weight, bias = _params(k, n, seed=31)
    weight.requires_grad_()
    bias.requires_grad_()
    grad_y = randn(m, n, seed=32)
    grads = grads_of(linear(x, weight, bias), grad_y, [x, weight, bias])
    xs, ws, gs = x.detach().numpy(), weight.detach().numpy(), grad_y.numpy()
    expected = [np.zeros((m, k), np.float32), np.zeros((n, k), np.float32), np.zeros(n, np.float32)]
    for i in range(m):
        for c in range(k):
            acc = np.float32(0.0)
            for j in range(n):
                acc = np.float32(acc + np.float32(gs[i, j] * ws[j, c]))
            expected[0][i, c] = acc
    for j in range(n):
        for c in range(k):
            acc = np.float32(0.0)
            for i in range(m):
                acc = np.float32(acc + np.float32(gs[i, j] * xs[i, c]))
            expected[1][j, c] = acc
        acc = np.float32(0.0)
        for i in range(m):
            acc = np.float32(acc + gs[i, j])
        expected[2][j] = acc
    names = ("grad_x", "grad_weight", "grad_bias")
    for name, got, want in zip(names, grads, expected, strict=True):
        assert_bitwise_equal(got, torch.from_numpy(want), name=name)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_low_precision_rounds_once(dtype):
    x = randn(5, 40, seed=3, dtype=dtype)
    weight, bias = _params(40, 6, seed=4, dtype=dtype)
    expected = linear_fp32(x, weight, bias).to(dtype)
    assert_bitwise_equal(linear(x, weight, bias), expected, name=f"{dtype} = round(fp32)")


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("shape", ACCURACY_SHAPES + [LONG_K_SHAPE])
def test_forward_matches_float64_f_linear(shape, with_bias):
    lead, k, n = shape
    x = randn(*lead, k, seed=5)
    weight, bias = _params(k, n, seed=6, with_bias=with_bias)
    y = linear(x, weight, bias)
    assert y.dtype == torch.float32 and y.shape == (*lead, n)
    expected = F.linear(x.double(), weight.double(), bias.double() if with_bias else None)
    assert_within_tolerance(y, expected, op_class="reduction", kind="forward")


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("shape", ACCURACY_SHAPES)
def test_grads_match_float64_autograd(shape, with_bias):
    lead, k, n = shape
    x = randn(*lead, k, seed=7).requires_grad_()
    weight, bias = _params(k, n, seed=8, with_bias=with_bias)
    weight.requires_grad_()
    if bias is not None:
        bias.requires_grad_()
    grad_y = randn(*lead, n, seed=9)
    inputs = [x, weight] + ([bias] if bias is not None else [])
    grads = grads_of(linear(x, weight, bias), grad_y, inputs)
    _, expected = _float64_grads(x, weight, bias, grad_y)
    for name, got, want in zip(("x", "weight", "bias"), grads, expected, strict=False):
        assert got.dtype == torch.float32, name
        assert_within_tolerance(got, want, op_class="reduction", kind="grad")


# ---- Axis-B ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("shape", ACCURACY_SHAPES + [LONG_K_SHAPE])
def test_low_precision_within_tolerance_of_fp32(shape, dtype):
    lead, k, n = shape
    x = randn(*lead, k, seed=10, dtype=dtype)
    weight, bias = _params(k, n, seed=11, dtype=dtype)
    module = LinearReference(weight, bias)
    actual = module(x)
    assert actual.dtype == dtype
    reference = module.forward_fp32(x)
    assert reference.dtype == torch.float32
    assert_within_tolerance(actual, reference, op_class="reduction", kind="forward")


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_low_precision_grads_within_tolerance_of_fp32(dtype):
    x = randn(9, 64, seed=12, dtype=dtype).requires_grad_()
    weight, bias = _params(64, 20, seed=13, dtype=dtype)
    weight.requires_grad_()
    bias.requires_grad_()
    grad_y = randn(9, 20, seed=14, dtype=dtype)
    grads = grads_of(linear(x, weight, bias), grad_y, [x, weight, bias])
    # The fp32 path on fp32 leaves holding the same values, so its gradients stay unrounded.
    leaves = [t.detach().float().requires_grad_() for t in (x, weight, bias)]
    reference = grads_of(linear_fp32(*leaves), grad_y.float(), leaves)
    for got, want in zip(grads, reference, strict=True):
        assert got.dtype == dtype and want.dtype == torch.float32
        assert_within_tolerance(got, want, op_class="reduction", kind="grad")


# ---- Axis-A ---------------------------------------------------------------------------------


def _sweep_params(dtype, with_bias):
    return _params(SWEEP_K, SWEEP_N, seed=15, dtype=dtype, with_bias=with_bias)


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("dtype", ALL_FLOAT)
def test_forward_row_invariance(dtype, with_bias):
    weight, bias = _sweep_params(dtype, with_bias)

    def make_rows(n, gen):
        return torch.randn(n, SWEEP_K, generator=gen).to(dtype)

    reports = row_invariance_sweep(lambda rows: linear(rows, weight, bias), make_rows)
    assert_no_drift(reports)


@pytest.mark.parametrize("dtype", ALL_FLOAT)
def test_input_grad_row_invariance(dtype):
    weight, bias = _sweep_params(dtype, True)

    def make_rows(n, gen):
        # One row = an input row and its own cotangent row.
        x = torch.randn(n, SWEEP_K, generator=gen).to(dtype)
        return x, torch.randn(n, SWEEP_N, generator=gen).to(dtype)

    def grad_x(rows):
        x = rows[0].clone().requires_grad_()
        return grads_of(linear(x, weight, bias), rows[1], [x])[0]

    assert_no_drift(row_invariance_sweep(grad_x, make_rows))


@pytest.mark.parametrize("dtype", ALL_FLOAT)
def test_param_grads_bitwise_run_to_run(dtype):
    x = randn(33, 40, seed=16, dtype=dtype)
    weight, bias = _params(40, 12, seed=17, dtype=dtype)
    grad_y = randn(33, 12, seed=18, dtype=dtype)

    def param_grads():
        w, b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
        return grads_of(linear(x, w, b), grad_y, [w, b])

    first, second = param_grads(), param_grads()
    assert_bitwise_equal(second[0], first[0], name="grad_weight")
    assert_bitwise_equal(second[1], first[1], name="grad_bias")


def test_param_grads_unchanged_by_tokens_with_zero_cotangent():
    """Tokens are reduced in order, so appending tokens that add +-0 changes no bit."""
    x = randn(17, 32, seed=19)
    weight, bias = _params(32, 8, seed=20)
    grad_y = randn(17, 8, seed=21)
    extra_x = randn(16, 32, seed=22, scale=1e3)
    x_all = torch.cat([x, extra_x])
    grad_all = torch.cat([grad_y, torch.zeros(16, 8)])

    def param_grads(inputs, cotangent):
        w, b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
        return grads_of(linear(inputs, w, b), cotangent, [w, b])

    short, long = param_grads(x, grad_y), param_grads(x_all, grad_all)
    assert_bitwise_equal(long[0], short[0], name="grad_weight")
    assert_bitwise_equal(long[1], short[1], name="grad_bias")


# ---- paths, module, edge cases --------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_FLOAT)
def test_module_and_dtypes(dtype):
    weight, bias = _params(16, 6, seed=23, dtype=dtype)
    module = LinearReference(weight, bias)
    assert (module.in_features, module.out_features) == (16, 6)
    x = randn(4, 16, seed=24, dtype=dtype)
    assert_bitwise_equal(module(x), linear(x, weight, bias), name="module.forward")
    assert_bitwise_equal(module.forward_fp32(x), linear_fp32(x, weight, bias), name="forward_fp32")
    module(x).float().sum().backward()
    assert module.weight.grad.dtype == dtype and module.bias.grad.dtype == dtype


def test_empty_batch():
    weight, bias = _params(8, 5, seed=25)
    weight.requires_grad_()
    bias.requires_grad_()
    x = torch.zeros(0, 8, requires_grad=True)
    y = linear(x, weight, bias)
    assert y.shape == (0, 5)
    gx, gw, gb = grads_of(y, torch.zeros(0, 5), [x, weight, bias])
    assert gx.shape == (0, 8)
    assert_bitwise_equal(gw, torch.zeros(5, 8), name="grad_weight of no tokens")
    assert_bitwise_equal(gb, torch.zeros(5), name="grad_bias of no tokens")


def test_zero_in_features_is_an_error():
    # The GPU GEMM has no empty reduction; every backend gives the same error.
    bias = randn(3, seed=26)
    with pytest.raises(ValueError, match="in_features must be >= 1"):
        linear(torch.zeros(2, 0), torch.zeros(3, 0), bias)


def test_inputs_not_mutated():
    x = randn(6, 12, seed=27).requires_grad_()
    weight, bias = _params(12, 7, seed=28)
    weight.requires_grad_()
    bias.requires_grad_()
    grad_y = randn(6, 7, seed=29)
    before = snapshot(x, weight, bias, grad_y)
    grads_of(linear(x, weight, bias), grad_y, [x, weight, bias])
    grads_of(linear_fp32(x, weight, bias), grad_y, [x, weight, bias])
    assert_unchanged(before, [x, weight, bias, grad_y])


# ---- bad input ------------------------------------------------------------------------------

_W = torch.zeros(4, 8)
_B = torch.zeros(4)
_X = torch.zeros(2, 8)

BAD_INPUTS = [
    ((_X.tolist(), _W, _B), TypeError, "x must be a torch.Tensor"),
    ((_X, "weight", _B), TypeError, "weight must be a torch.Tensor"),
    ((_X, _W, 1.0), TypeError, "bias must be a torch.Tensor"),
    ((_X.bfloat16(), _W, _B), TypeError, "weight has dtype"),
    ((_X, _W, _B.half()), TypeError, "bias has dtype"),
    ((_X.double(), _W.double(), None), TypeError, "x must have dtype"),
    ((_X.long(), _W, None), TypeError, "x must have dtype"),
    ((torch.zeros(2, 7), _W, _B), ValueError, r"x\.shape\[-1\]"),
    ((torch.zeros(()), _W, _B), ValueError, "x must have at least 1 dimension"),
    ((_X, torch.zeros(32), None), ValueError, "weight must have 2 dimensions"),
    ((_X, torch.zeros(1, 4, 8), None), ValueError, "weight must have 2 dimensions"),
    ((_X, _W, torch.zeros(5)), ValueError, r"bias\.shape\[0\]"),
    ((_X, _W, torch.zeros(1, 4)), ValueError, "bias must have 1 dimensions"),
    ((_X, _W.to("meta"), None), ValueError, "weight is on meta"),
    ((_X, _W, _B.to("meta")), ValueError, "bias is on meta"),
]


@pytest.mark.parametrize("fn", [linear, linear_fp32])
@pytest.mark.parametrize(("args", "error", "message"), BAD_INPUTS)
def test_bad_input_names_the_argument(fn, args, error, message):
    with pytest.raises(error, match=message):
        fn(*args)

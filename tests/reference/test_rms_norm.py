"""rms_norm / fused_add_rms_norm reference: invariance, accuracy, gradients, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _helpers_elementwise import (
    ALL_FLOAT,
    LOW_PRECISION,
    assert_unchanged,
    grads_with_cotangent,
    leaves,
    randn,
    snapshot,
)

from batchinv.contract import (
    assert_bitwise_equal,
    assert_no_drift,
    assert_within_tolerance,
    row_invariance_sweep,
)
from batchinv.reference.rms_norm import (
    RMSNormReference,
    fused_add_rms_norm,
    fused_add_rms_norm_fp32,
    rms_norm,
    rms_norm_backward,
    rms_norm_fp32,
)

EPS = 1e-6
HIDDEN = 40  # not a multiple of a vector width, so tails are exercised
# Leading shapes x takes in the accuracy tests: rows, [B, S], per-head q/k norm [B, S, H].
LEADING_SHAPES = [(7,), (2, 5), (2, 3, 4)]


def _weight(hidden: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return (1.0 + 0.25 * randn(hidden, seed=seed)).to(dtype)


def _rms_norm_f64(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The definition in float64, written independently of the reference."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


# ---------------------------------------------------------------- Axis-A (bitwise, CPU)


@pytest.mark.parametrize("dtype", ALL_FLOAT)
def test_forward_is_row_invariant(dtype):
    weight = _weight(HIDDEN, dtype)

    def make_rows(n, gen):
        return torch.randn(n, HIDDEN, generator=gen).to(dtype)

    assert_no_drift(row_invariance_sweep(lambda x: rms_norm(x, weight, EPS), make_rows))


@pytest.mark.parametrize("dtype", ALL_FLOAT)
def test_input_grad_is_row_invariant(dtype):
    """Each row carries its input and its own cotangent; the op returns y and grad_x per row."""
    weight = _weight(HIDDEN, dtype)

    def make_rows(n, gen):
        x = torch.randn(n, HIDDEN, generator=gen).to(dtype)
        return x, torch.randn(n, HIDDEN, generator=gen).to(dtype)

    def forward_backward(rows):
        x, cotangent = rows
        (x,) = leaves(x)
        y = rms_norm(x, weight, EPS)
        (grad_x,) = torch.autograd.grad(y, x, cotangent)
        return y.detach(), grad_x

    assert_no_drift(row_invariance_sweep(forward_backward, make_rows))


@pytest.mark.parametrize("dtype", ALL_FLOAT)
def test_fused_forward_and_grads_are_row_invariant(dtype):
    weight = _weight(HIDDEN, dtype)

    def make_rows(n, gen):
        return tuple(torch.randn(n, HIDDEN, generator=gen).to(dtype) for _ in range(4))

    def forward_backward(rows):
        x, residual, cot_y, cot_residual = rows
        x, residual = leaves(x, residual)
        y, new_residual = fused_add_rms_norm(x, residual, weight, EPS)
        grad_x, grad_residual = torch.autograd.grad(
            (y, new_residual), (x, residual), (cot_y, cot_residual)
        )
        return y.detach(), new_residual.detach(), grad_x, grad_residual

    assert_no_drift(row_invariance_sweep(forward_backward, make_rows))


@pytest.mark.parametrize("dtype", ALL_FLOAT)
def test_per_head_norm_equals_each_head_alone(dtype):
    """q/k norm layout [B, S, H, head_dim]: every (b, s, h) row has the bits it has alone."""
    head_dim = 16
    x = randn(2, 3, 4, head_dim, seed=3, dtype=dtype)
    weight = _weight(head_dim, dtype)
    y = rms_norm(x, weight, EPS)
    for b, s, h in np.ndindex(*x.shape[:-1]):
        alone = rms_norm(x[b, s, h].clone().unsqueeze(0), weight, EPS)[0]
        assert_bitwise_equal(y[b, s, h], alone, name=f"row {(b, s, h)}")


@pytest.mark.parametrize("dtype", ALL_FLOAT)
def test_forward_follows_the_documented_fp32_arithmetic(dtype):
    """Bitwise against the documented sequence, redone in numpy float32 (IEEE, no MKL).

    Squares added left to right from 0, / d, + eps, the correctly rounded sqrt, 1 / that,
    (x * inv_rms) * weight, then one rounding to the input dtype.
    """
    x = randn(11, HIDDEN, seed=30, scale=3.0, dtype=dtype)
    weight = _weight(HIDDEN, dtype)
    x32, w32 = x.float().numpy(), weight.float().numpy()
    sum_sq = np.zeros(x32.shape[0], dtype=np.float32)
    for j in range(HIDDEN):
        sum_sq = sum_sq + x32[:, j] * x32[:, j]
    mean_sq = sum_sq / np.float32(HIDDEN)
    inv_rms = np.float32(1.0) / np.sqrt(mean_sq + np.float32(EPS))
    expected = torch.from_numpy((x32 * inv_rms[:, None]) * w32).to(dtype)
    assert_bitwise_equal(rms_norm(x, weight, EPS), expected)


def test_non_contiguous_input_gives_the_contiguous_bits():
    x = randn(HIDDEN, 9, seed=4, dtype=torch.bfloat16).t()  # rows are strided
    weight = _weight(HIDDEN, torch.bfloat16)
    assert not x.is_contiguous()
    assert_bitwise_equal(rms_norm(x, weight, EPS), rms_norm(x.contiguous(), weight, EPS))


# ---------------------------------------------------------------- grad_weight


def _weight_grad(x, weight, cotangent):
    x_leaf, w_leaf = leaves(x, weight)
    return grads_with_cotangent(lambda a, w: rms_norm(a, w, EPS), (x_leaf, w_leaf), cotangent)[1]


@pytest.mark.parametrize("dtype", ALL_FLOAT)
def test_weight_grad_is_reproducible_and_layout_independent(dtype):
    x = randn(2, 5, HIDDEN, seed=5, dtype=dtype)
    cotangent = randn(2, 5, HIDDEN, seed=6, dtype=dtype)
    weight = _weight(HIDDEN, dtype)
    first = _weight_grad(x, weight, cotangent)
    assert_bitwise_equal(_weight_grad(x, weight, cotangent), first, name="second run")
    flat = _weight_grad(x.reshape(-1, HIDDEN), weight, cotangent.reshape(-1, HIDDEN))
    assert_bitwise_equal(flat, first, name="[B*S, d] vs [B, S, d]")
    _, direct = rms_norm_backward(cotangent, x, weight, EPS)
    assert_bitwise_equal(direct, first, name="rms_norm_backward")


@pytest.mark.parametrize("dtype", ALL_FLOAT)
def test_weight_grad_ignores_padding_rows_with_zero_cotangent(dtype):
    """Masked padding rows (finite garbage, zero cotangent) add exactly zero."""
    x = randn(6, HIDDEN, seed=7, dtype=dtype)
    cotangent = randn(6, HIDDEN, seed=8, dtype=dtype)
    weight = _weight(HIDDEN, dtype)
    expected = _weight_grad(x, weight, cotangent)
    padding = randn(3, HIDDEN, seed=9, scale=100.0, dtype=dtype)
    padded_x = torch.cat((padding[:1], x[:4], padding[1:], x[4:]))
    padded_cot = torch.cat(
        (
            torch.zeros(1, HIDDEN),
            cotangent[:4].float(),
            torch.zeros(2, HIDDEN),
            cotangent[4:].float(),
        )
    ).to(dtype)
    assert_bitwise_equal(_weight_grad(padded_x, weight, padded_cot), expected)


def test_weight_grad_sums_rows_in_increasing_order_in_fp32():
    """Checks the documented order against an independent sequential fp32 sum.

    Rows of +-1 have mean square 1 and, with eps below fp32's resolution at 1, inv_rms = 1
    exactly, so each row adds exactly cotangent * x.  Cotangents of very different sizes
    make the order visible (the reversed order gives other bits on this data).
    """
    rows, hidden, eps = 9, 8, 1e-9
    x = torch.where(randn(rows, hidden, seed=10) > 0, 1.0, -1.0)
    magnitude = 10.0 ** torch.randint(
        -3, 9, (rows, hidden), generator=torch.Generator().manual_seed(11)
    )
    cotangent = randn(rows, hidden, seed=12) * magnitude
    _, grad_weight = rms_norm_backward(cotangent, x, torch.ones(hidden), eps)

    terms = (cotangent * x).numpy()  # exact products of fp32 values by +-1

    def sequential_fp32(order):
        acc = np.zeros(hidden, dtype=np.float32)
        for r in order:
            acc = (acc + terms[r]).astype(np.float32)
        return torch.from_numpy(acc)

    assert_bitwise_equal(grad_weight, sequential_fp32(range(rows)))
    assert not torch.equal(sequential_fp32(reversed(range(rows))), grad_weight), (
        "test data does not distinguish the summation order"
    )


# ---------------------------------------------------------------- Axis-B (accuracy)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("leading", LEADING_SHAPES)
def test_low_precision_forward_and_grads_within_tolerance(dtype, leading):
    shape = (*leading, HIDDEN)
    x = randn(*shape, seed=13, scale=3.0, dtype=dtype)
    weight = _weight(HIDDEN, dtype)
    cotangent = randn(*shape, seed=14, dtype=dtype)
    module = RMSNormReference(weight.clone(), eps=EPS)
    assert_within_tolerance(module(x), module.forward_fp32(x), op_class="reduction")

    low = grads_with_cotangent(lambda a, w: rms_norm(a, w, EPS), leaves(x, weight), cotangent)
    ref = grads_with_cotangent(
        lambda a, w: rms_norm_fp32(a, w, EPS), leaves(x, weight, dtype=torch.float32), cotangent
    )
    for name, got, want in zip(("grad_x", "grad_weight"), low, ref, strict=True):
        assert got.dtype == dtype, name
        assert_within_tolerance(got, want, op_class="reduction", kind="grad")


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_fused_low_precision_within_tolerance(dtype):
    x = randn(5, HIDDEN, seed=15, dtype=dtype)
    residual = randn(5, HIDDEN, seed=16, scale=4.0, dtype=dtype)
    weight = _weight(HIDDEN, dtype)
    cotangents = (randn(5, HIDDEN, seed=17), randn(5, HIDDEN, seed=18))
    y, new_residual = fused_add_rms_norm(x, residual, weight, EPS)
    y_ref, new_residual_ref = fused_add_rms_norm_fp32(x, residual, weight, EPS)
    assert_within_tolerance(y, y_ref, op_class="reduction")
    assert_within_tolerance(new_residual, new_residual_ref, op_class="elementwise")

    def fused(fn):
        return lambda a, r, w: fn(a, r, w, EPS)

    low = grads_with_cotangent(fused(fused_add_rms_norm), leaves(x, residual, weight), cotangents)
    ref = grads_with_cotangent(
        fused(fused_add_rms_norm_fp32),
        leaves(x, residual, weight, dtype=torch.float32),
        cotangents,
    )
    for got, want in zip(low, ref, strict=True):
        assert_within_tolerance(got, want, op_class="reduction", kind="grad")


def test_fused_residual_is_the_rounded_sum_and_feeds_the_norm():
    x = randn(4, HIDDEN, seed=19, dtype=torch.bfloat16)
    residual = randn(4, HIDDEN, seed=20, scale=30.0, dtype=torch.bfloat16)
    weight = _weight(HIDDEN, torch.bfloat16)
    y, new_residual = fused_add_rms_norm(x, residual, weight, EPS)
    assert_bitwise_equal(new_residual, x + residual)  # torch's bf16 add: fp32 sum, one rounding
    assert_bitwise_equal(y, rms_norm(x + residual, weight, EPS))


@pytest.mark.parametrize("leading", LEADING_SHAPES)
def test_fp32_grads_match_float64_autograd(leading):
    shape = (*leading, HIDDEN)
    x = randn(*shape, seed=21, scale=2.0)
    weight = _weight(HIDDEN, torch.float32)
    cotangent = randn(*shape, seed=22)
    got = grads_with_cotangent(lambda a, w: rms_norm(a, w, EPS), leaves(x, weight), cotangent)
    want = grads_with_cotangent(
        lambda a, w: _rms_norm_f64(a, w, EPS), leaves(x, weight, dtype=torch.float64), cotangent
    )
    for g, w in zip(got, want, strict=True):
        assert_within_tolerance(g, w, op_class="reduction", kind="grad")


def test_fused_fp32_grads_match_float64_autograd():
    x, residual = randn(6, HIDDEN, seed=23), randn(6, HIDDEN, seed=24)
    weight = _weight(HIDDEN, torch.float32)
    cotangents = (randn(6, HIDDEN, seed=25), randn(6, HIDDEN, seed=26))

    def fused_f64(a, r, w):
        h = a + r
        return _rms_norm_f64(h, w, EPS), h

    got = grads_with_cotangent(
        lambda a, r, w: fused_add_rms_norm(a, r, w, EPS), leaves(x, residual, weight), cotangents
    )
    want = grads_with_cotangent(
        fused_f64, leaves(x, residual, weight, dtype=torch.float64), cotangents
    )
    for g, w in zip(got, want, strict=True):
        assert_within_tolerance(g, w, op_class="reduction", kind="grad")


def test_matches_hugging_face_qwen3_rms_norm_in_fp32():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    head_dim = 16
    hf = Qwen3RMSNorm(head_dim, eps=EPS)
    with torch.no_grad():
        hf.weight.copy_(_weight(head_dim, torch.float32))
    x = randn(2, 3, 4, head_dim, seed=27, scale=5.0)
    with torch.no_grad():
        expected = hf(x)
    assert_within_tolerance(rms_norm(x, hf.weight.detach(), EPS), expected, op_class="reduction")


# ---------------------------------------------------------------- edge cases and bad input


def test_empty_batch_gives_empty_output_and_zero_weight_grad():
    x = torch.empty(0, HIDDEN, dtype=torch.bfloat16)
    weight = _weight(HIDDEN, torch.bfloat16)
    assert rms_norm(x, weight, EPS).shape == (0, HIDDEN)
    grad_x, grad_weight = rms_norm_backward(torch.empty_like(x), x, weight, EPS)
    assert grad_x.shape == (0, HIDDEN)
    assert_bitwise_equal(grad_weight, torch.zeros(HIDDEN, dtype=torch.bfloat16))


def test_zero_row_gives_zeros():
    y = rms_norm(torch.zeros(2, HIDDEN), _weight(HIDDEN, torch.float32), EPS)
    assert_bitwise_equal(y, torch.zeros(2, HIDDEN))


def test_inputs_are_not_modified():
    x, residual = randn(3, HIDDEN, seed=28), randn(3, HIDDEN, seed=29)
    weight = _weight(HIDDEN, torch.float32)
    before = snapshot(x, residual, weight)
    x_leaf, residual_leaf, weight_leaf = leaves(x, residual, weight)
    y, h = fused_add_rms_norm(x_leaf, residual_leaf, weight_leaf, EPS)
    (y.sum() + h.sum()).backward()
    rms_norm(x, weight, EPS)
    assert_unchanged(before, (x_leaf, residual_leaf, weight_leaf))
    assert_unchanged(before, (x, residual, weight))


_X = torch.ones(3, HIDDEN)
_W = torch.ones(HIDDEN)

BAD_CALLS = [
    (
        "x not a tensor",
        lambda: rms_norm(_X.tolist(), _W, EPS),
        TypeError,
        "x must be a torch.Tensor",
    ),
    ("x integer", lambda: rms_norm(_X.int(), _W, EPS), TypeError, "^x must have dtype"),
    ("x float64", lambda: rms_norm(_X.double(), _W.double(), EPS), TypeError, "^x must have dtype"),
    ("weight other dtype", lambda: rms_norm(_X, _W.half(), EPS), TypeError, "weight"),
    ("weight wrong size", lambda: rms_norm(_X, torch.ones(HIDDEN + 1), EPS), ValueError, "weight"),
    ("weight 2-d", lambda: rms_norm(_X, torch.ones(1, HIDDEN), EPS), ValueError, "weight"),
    ("weight other device", lambda: rms_norm(_X, _W.to("meta"), EPS), ValueError, "weight"),
    ("x scalar", lambda: rms_norm(torch.tensor(1.0), torch.ones(1), EPS), ValueError, "^x must"),
    (
        "x empty last dim",
        lambda: rms_norm(torch.ones(3, 0), torch.ones(0), EPS),
        ValueError,
        "^x must",
    ),
    ("eps zero", lambda: rms_norm(_X, _W, 0.0), ValueError, "eps"),
    ("eps negative", lambda: rms_norm(_X, _W, -1e-6), ValueError, "eps"),
    ("eps nan", lambda: rms_norm(_X, _W, float("nan")), ValueError, "eps"),
    ("eps zero in fp32", lambda: rms_norm(_X, _W, 1e-50), ValueError, "eps"),
    ("eps a tensor", lambda: rms_norm(_X, _W, torch.tensor(EPS)), TypeError, "eps"),
    ("residual shape", lambda: fused_add_rms_norm(_X, _X[:2], _W, EPS), ValueError, "residual"),
    ("residual dtype", lambda: fused_add_rms_norm(_X, _X.half(), _W, EPS), TypeError, "residual"),
    ("residual not a tensor", lambda: fused_add_rms_norm(_X, 1.0, _W, EPS), TypeError, "residual"),
    ("module eps", lambda: RMSNormReference(_W, eps=0.0), ValueError, "eps"),
    ("grad_y shape", lambda: rms_norm_backward(_X[:2], _X, _W, EPS), ValueError, "grad_y"),
    ("grad_y dtype", lambda: rms_norm_backward(_X.half(), _X, _W, EPS), TypeError, "grad_y"),
]


@pytest.mark.parametrize(
    ("call", "error", "match"), [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS]
)
def test_bad_input_raises_naming_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()

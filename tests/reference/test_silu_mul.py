"""silu_mul / silu_mul_fused reference: invariance, accuracy, gradients, bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
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
from batchinv.reference.silu_mul import (
    SiluMulReference,
    silu_mul,
    silu_mul_backward,
    silu_mul_fused,
    silu_mul_fused_fp32,
)

INTER = 37  # odd, so rows end in a partial vector and start at every alignment
LEADING_SHAPES = [(9,), (2, 5)]
GATE_SCALE = 4.0  # gates reach the flat and the linear parts of silu


def _silu_mul_f64(gate, up):
    """The definition in float64 through torch's own silu, independent of the reference."""
    return F.silu(gate) * up


# ---------------------------------------------------------------- Axis-A (bitwise, CPU)


def _gate_up_rows(n: int, gen: torch.Generator, dtype: torch.dtype):
    gate = (torch.randn(n, INTER, generator=gen) * GATE_SCALE).to(dtype)
    return gate, torch.randn(n, INTER, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", ALL_FLOAT)
def test_forward_is_row_invariant(dtype):
    # Contiguous [N, I] operands: a flat elementwise loop spans row boundaries, so a row's
    # elements would land in a vector body or a scalar tail depending on N.
    reports = row_invariance_sweep(
        lambda rows: silu_mul(*rows), lambda n, gen: _gate_up_rows(n, gen, dtype)
    )
    assert_no_drift(reports)


@pytest.mark.parametrize("dtype", ALL_FLOAT)
def test_fused_forward_and_grad_are_row_invariant(dtype):
    """Rows carry gate_up [2I] and a cotangent [I]; the op returns out and grad_gate_up."""

    def make_rows(n, gen):
        gate, up = _gate_up_rows(n, gen, dtype)
        return torch.cat((gate, up), dim=-1), torch.randn(n, INTER, generator=gen).to(dtype)

    def forward_backward(rows):
        gate_up, cotangent = rows
        (gate_up,) = leaves(gate_up)
        out = silu_mul_fused(gate_up)
        (grad,) = torch.autograd.grad(out, gate_up, cotangent)
        return out.detach(), grad

    assert_no_drift(row_invariance_sweep(forward_backward, make_rows))


def test_non_contiguous_inputs_give_the_contiguous_bits():
    gate_up = randn(INTER * 2, 6, seed=51, dtype=torch.bfloat16).t()
    assert not gate_up.is_contiguous()
    assert_bitwise_equal(silu_mul_fused(gate_up), silu_mul_fused(gate_up.contiguous()))


# ---------------------------------------------------------------- Axis-B (accuracy)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("leading", LEADING_SHAPES)
def test_low_precision_forward_and_grads_within_tolerance(dtype, leading):
    shape = (*leading, INTER)
    gate = randn(*shape, seed=52, scale=GATE_SCALE, dtype=dtype)
    up = randn(*shape, seed=53, dtype=dtype)
    cotangent = randn(*shape, seed=54, dtype=dtype)
    module = SiluMulReference()
    out = module(gate, up)
    assert out.dtype == dtype
    assert_within_tolerance(out, module.forward_fp32(gate, up), op_class="elementwise")

    low = grads_with_cotangent(module, leaves(gate, up), cotangent)
    ref = grads_with_cotangent(
        module.forward_fp32, leaves(gate, up, dtype=torch.float32), cotangent
    )
    for got, want in zip(low, ref, strict=True):
        assert got.dtype == dtype
        assert_within_tolerance(got, want, op_class="elementwise", kind="grad")


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_fused_low_precision_within_tolerance(dtype):
    gate_up = torch.cat(
        (randn(5, INTER, seed=55, scale=GATE_SCALE), randn(5, INTER, seed=56)), dim=-1
    ).to(dtype)
    cotangent = randn(5, INTER, seed=57, dtype=dtype)
    module = SiluMulReference()
    assert_within_tolerance(module(gate_up), silu_mul_fused_fp32(gate_up), op_class="elementwise")
    (low,) = grads_with_cotangent(module, leaves(gate_up), cotangent)
    (ref,) = grads_with_cotangent(
        module.forward_fp32, leaves(gate_up, dtype=torch.float32), cotangent
    )
    assert_within_tolerance(low, ref, op_class="elementwise", kind="grad")


@pytest.mark.parametrize("leading", LEADING_SHAPES)
def test_fp32_forward_and_grads_match_float64_autograd(leading):
    shape = (*leading, INTER)
    gate, up = randn(*shape, seed=58, scale=GATE_SCALE), randn(*shape, seed=59)
    cotangent = randn(*shape, seed=60)
    assert_within_tolerance(
        silu_mul(gate, up),
        _silu_mul_f64(gate.double(), up.double()),
        op_class="elementwise",
    )
    got = grads_with_cotangent(silu_mul, leaves(gate, up), cotangent)
    want = grads_with_cotangent(_silu_mul_f64, leaves(gate, up, dtype=torch.float64), cotangent)
    for g, w in zip(got, want, strict=True):
        assert_within_tolerance(g, w, op_class="elementwise", kind="grad")
    assert_bitwise_equal(silu_mul_backward(cotangent, gate, up), got, name="silu_mul_backward")


def test_fused_takes_gate_first_and_up_second():
    gate, up = randn(4, INTER, seed=61, scale=GATE_SCALE), randn(4, INTER, seed=62)
    fused = silu_mul_fused(torch.cat((gate, up), dim=-1))
    assert_bitwise_equal(fused, silu_mul(gate, up))
    assert not torch.equal(fused, silu_mul(up, gate))


def test_matches_hugging_face_qwen3_mlp_activation_in_fp32():
    from transformers import Qwen3Config
    from transformers.activations import ACT2FN

    act = ACT2FN[Qwen3Config().hidden_act]  # what Qwen3MLP applies to gate_proj(x)
    gate, up = randn(3, 4, INTER, seed=63, scale=GATE_SCALE), randn(3, 4, INTER, seed=64)
    assert_within_tolerance(silu_mul(gate, up), act(gate) * up, op_class="elementwise")


# ---------------------------------------------------------------- edge cases and bad input


def test_special_values():
    gate = torch.tensor([0.0, -0.0, -200.0, 200.0, float("inf"), float("nan"), -float("inf")])
    out = silu_mul(gate, torch.ones_like(gate))
    # silu(-200) = -200 / inf = -0; -inf gives -inf / inf = NaN, as torch's silu does.
    assert_bitwise_equal(out[:5], torch.tensor([0.0, -0.0, -0.0, 200.0, float("inf")]))
    assert out[5:].isnan().all()


def test_empty_batch_gives_empty_output():
    assert silu_mul(torch.empty(0, INTER), torch.empty(0, INTER)).shape == (0, INTER)
    assert silu_mul_fused(torch.empty(2, 0, 2 * INTER)).shape == (2, 0, INTER)


def test_inputs_are_not_modified():
    gate, up = randn(3, INTER, seed=65), randn(3, INTER, seed=66)
    gate_up = torch.cat((gate, up), dim=-1)
    before = snapshot(gate, up, gate_up)
    leaf_gate, leaf_up, leaf_gate_up = leaves(gate, up, gate_up)
    (silu_mul(leaf_gate, leaf_up).sum() + silu_mul_fused(leaf_gate_up).sum()).backward()
    assert_unchanged(before, (leaf_gate, leaf_up, leaf_gate_up))


_G = torch.ones(3, INTER)

BAD_CALLS = [
    (
        "gate not a tensor",
        lambda: silu_mul(_G.tolist(), _G),
        TypeError,
        "gate must be a torch.Tensor",
    ),
    ("up not a tensor", lambda: silu_mul(_G, 1.0), TypeError, "up must be a torch.Tensor"),
    ("gate integer", lambda: silu_mul(_G.int(), _G), TypeError, "^gate must have dtype"),
    ("up other dtype", lambda: silu_mul(_G, _G.bfloat16()), TypeError, "up has dtype"),
    ("up other shape", lambda: silu_mul(_G, _G[:, :-1]), ValueError, "up must have the shape"),
    ("up broadcastable", lambda: silu_mul(_G, _G[:1]), ValueError, "up must have the shape"),
    ("up other device", lambda: silu_mul(_G, _G.to("meta")), ValueError, "up is on meta"),
    ("gate scalar", lambda: silu_mul(torch.tensor(1.0), torch.tensor(1.0)), ValueError, "^gate"),
    ("gate empty width", lambda: silu_mul(_G[:, :0], _G[:, :0]), ValueError, "^gate"),
    ("gate_up odd", lambda: silu_mul_fused(torch.ones(3, 7)), ValueError, "gate_up"),
    ("gate_up empty", lambda: silu_mul_fused(torch.ones(3, 0)), ValueError, "gate_up"),
    (
        "gate_up integer",
        lambda: silu_mul_fused(torch.ones(3, 8, dtype=torch.int64)),
        TypeError,
        "gate_up",
    ),
    ("gate_up not a tensor", lambda: silu_mul_fused([1.0, 2.0]), TypeError, "gate_up"),
    ("grad_out dtype", lambda: silu_mul_backward(_G.half(), _G, _G), TypeError, "grad_out"),
    ("grad_out shape", lambda: silu_mul_backward(_G[:1], _G, _G), ValueError, "grad_out"),
]


@pytest.mark.parametrize(
    ("call", "error", "match"), [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS]
)
def test_bad_input_raises_naming_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()

"""The host-light path of the public ops (``batchinv.ops._checked``): a call runs its checks
once per signature, with or without gradients.  These tests pin what that must never cost: a
bad argument still raises its own error after good calls of a nearby signature, a call that
fails is not remembered, and a call that needs a gradient still records one."""

from __future__ import annotations

import pytest
import torch

import batchinv
from batchinv import registry
from batchinv.ops import _checked
from batchinv.ops import attention as attention_op
from batchinv.ops import embedding as embedding_op
from batchinv.ops import linear as linear_op
from batchinv.ops import log_softmax as log_softmax_op
from batchinv.ops import rms_norm as rms_norm_op
from batchinv.ops import rope as rope_op
from batchinv.ops import silu_mul as silu_mul_op

EPS = 1e-6


def _fused_add(residual):
    return batchinv.fused_add_rms_norm(torch.randn(3, 8), residual, torch.ones(8), EPS)


def _case():
    return torch.randn(3, 8), torch.ones(8), EPS


THETA = 10000.0


def _rope_args(tokens=3, key_dim=8, positions_shape=None, requires_grad=False):
    q = torch.randn(tokens, 2, 8, requires_grad=requires_grad)
    k = torch.randn(tokens, 1, key_dim, requires_grad=requires_grad)
    positions = torch.arange(tokens) if positions_shape is None else torch.zeros(positions_shape)
    return q, k, positions.long()


def _grad(tensor):
    return tensor.requires_grad_()


def _attention(key_dim=8, **options):
    q, k, v = torch.randn(1, 2, 2, 8), torch.randn(1, 3, 1, key_dim), torch.randn(1, 3, 1, 8)
    return batchinv.attention(q, k, v, **options)


def test_a_signature_is_checked_once_and_a_failure_is_not_remembered():
    resolved = []

    def resolve(value):
        resolved.append(value)
        if value < 0:
            raise ValueError("negative")
        return abs

    calls = _checked.CheckedCalls(resolve)
    assert calls.lookup(("a",), 1)(-3) == 3
    assert calls.lookup(("a",), 1) is abs
    assert resolved == [1]
    for _ in range(2):  # a failing signature raises every time: nothing was stored
        with pytest.raises(ValueError, match="negative"):
            calls.lookup(("b",), -1)
    assert resolved == [1, -1, -1] and len(calls) == 1


def test_the_table_starts_again_at_its_limit():
    calls = _checked.CheckedCalls(lambda value: abs, limit=3)
    for key in range(3):
        calls.lookup(key, key)
    assert len(calls) == 3
    calls.lookup("one more", 0)
    assert len(calls) == 1


def _counting(monkeypatch, module, name):
    """Counts the calls of the check ``module.name`` (the op module's own reference)."""
    seen = []
    check = getattr(module, name)

    def counted(*args, **kwargs):
        seen.append(1)
        return check(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return seen


def test_rms_norm_checks_a_signature_once(monkeypatch):
    rms_norm_op._RMS_NORM_NO_GRAD.clear()
    seen = _counting(monkeypatch, rms_norm_op, "check_rms_norm_args")
    x, w = torch.randn(3, 8), torch.ones(8)
    first = batchinv.rms_norm(x, w, EPS)
    again = batchinv.rms_norm(x.clone(), w.clone(), EPS)
    assert len(seen) == 1
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    batchinv.rms_norm(torch.randn(4, 8), w, EPS)  # another shape: checked
    assert len(seen) == 2


def test_a_gradient_call_is_checked_once_per_signature(monkeypatch):
    seen = _counting(monkeypatch, rms_norm_op, "check_rms_norm_args")
    x, w = torch.randn(3, 8, requires_grad=True), torch.ones(8)
    batchinv.rms_norm(x, w, EPS)
    batchinv.rms_norm(x.detach().clone().requires_grad_(), w, EPS)
    assert len(seen) == 1
    batchinv.rms_norm(torch.randn(4, 8, requires_grad=True), w, EPS)  # another shape: checked
    assert len(seen) == 2


def test_rope_checks_a_signature_once(monkeypatch):
    seen = _counting(monkeypatch, rope_op, "check_rope_args")
    for requires_grad in (False, False, True, True):
        batchinv.rope(*_rope_args(requires_grad=requires_grad), theta=THETA)
    # The grad and no-grad calls share one table (the implementation decides per call).
    assert len(seen) == 1
    batchinv.rope(*_rope_args(), theta=THETA, check_positions=False)  # another flag: checked
    assert len(seen) == 2


def _grad_case(name):
    """A call of op ``name`` on inputs that require a gradient, and those inputs."""
    leaf = lambda *shape: torch.randn(*shape).requires_grad_()  # noqa: E731
    if name == "rms_norm":
        x, w = leaf(3, 8), leaf(8)
        return lambda: batchinv.rms_norm(x, w, EPS), (x, w)
    if name == "fused_add_rms_norm":
        x, r, w = leaf(3, 8), leaf(3, 8), leaf(8)
        return lambda: batchinv.fused_add_rms_norm(x, r, w, EPS)[0], (x, r, w)
    if name == "silu_mul":
        g, u = leaf(3, 8), leaf(3, 8)
        return lambda: batchinv.silu_mul(g, u), (g, u)
    if name == "silu_mul_fused":
        gu = leaf(3, 8)
        return lambda: batchinv.silu_mul_fused(gu), (gu,)
    if name == "embedding":
        w = leaf(5, 4)
        return lambda: batchinv.embedding(torch.tensor([1, 2, 1]), w), (w,)
    if name == "linear":
        x, w, b = leaf(3, 8), leaf(4, 8), leaf(4)
        return lambda: batchinv.linear(x, w, b), (x, w, b)
    q, k, positions = _rope_args(requires_grad=True)
    return lambda: batchinv.rope(q, k, positions, theta=THETA)[0], (q, k)


# Each op and the registry entry its no-grad calls run (the grad calls' autograd node runs it
# too, inside its forward, where grad mode is off).
NO_GRAD_IMPLEMENTATIONS = {
    "rms_norm": "rms_norm.no_grad",
    "fused_add_rms_norm": "fused_add_rms_norm.no_grad",
    "silu_mul": "silu_mul.no_grad",
    "silu_mul_fused": "silu_mul_fused.no_grad",
    "embedding": "embedding.forward",
    "linear": "linear.forward",
}


@pytest.mark.parametrize("name", NO_GRAD_IMPLEMENTATIONS)
def test_a_gradient_call_never_runs_the_no_grad_entry(name, monkeypatch):
    # Grad and no-grad calls of one signature must not share an entry: a grad call that ran
    # the no-grad implementation would record no node on a GPU (the CPU references record
    # one anyway, so the entry itself is watched).
    op = NO_GRAD_IMPLEMENTATIONS[name]
    implementation = registry._IMPLEMENTATIONS[op]["cpu"]

    def watched(*args, **kwargs):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            raise AssertionError(f"{op} ran for a call that needs a gradient")
        return implementation(*args, **kwargs)

    monkeypatch.setitem(registry._IMPLEMENTATIONS[op], "cpu", watched)
    call, inputs = _grad_case(name)
    with torch.no_grad():
        call()  # the no-grad entry of this signature first
    out = call()
    assert out.grad_fn is not None
    assert all(g is not None for g in torch.autograd.grad(out, inputs, torch.ones_like(out)))


# Each case: a good call, then calls that differ in one thing the checks read; every one must
# raise its own error although the good signature is known.
BAD_AFTER_GOOD = [
    (
        "rms_norm weight shape",
        lambda: batchinv.rms_norm(torch.randn(3, 8), torch.ones(8), EPS),
        lambda: batchinv.rms_norm(torch.randn(3, 8), torch.ones(9), EPS),
        ValueError,
        "weight must have shape",
    ),
    (
        "rms_norm weight dtype",
        lambda: batchinv.rms_norm(torch.randn(3, 8), torch.ones(8), EPS),
        lambda: batchinv.rms_norm(torch.randn(3, 8), torch.ones(8, dtype=torch.float64), EPS),
        TypeError,
        "weight must have dtype",
    ),
    (
        "rms_norm eps value",
        lambda: batchinv.rms_norm(torch.randn(3, 8), torch.ones(8), EPS),
        lambda: batchinv.rms_norm(torch.randn(3, 8), torch.ones(8), -EPS),
        ValueError,
        "eps must be",
    ),
    (
        "rms_norm eps type",
        lambda: batchinv.rms_norm(torch.randn(3, 8), torch.ones(8), EPS),
        lambda: batchinv.rms_norm(torch.randn(3, 8), torch.ones(8), True),
        TypeError,
        "eps must be",
    ),
    (
        "rms_norm x not a tensor",
        lambda: batchinv.rms_norm(torch.randn(3, 8), torch.ones(8), EPS),
        lambda: batchinv.rms_norm([[0.0] * 8], torch.ones(8), EPS),
        TypeError,
        "x must be a torch.Tensor",
    ),
    (
        "fused_add_rms_norm residual shape",
        lambda: _fused_add(torch.randn(3, 8)),
        lambda: _fused_add(torch.randn(2, 8)),
        ValueError,
        "residual must have the shape",
    ),
    (
        "fused_add_rms_norm residual dtype",
        lambda: _fused_add(torch.randn(3, 8)),
        lambda: _fused_add(torch.randn(3, 8).bfloat16()),
        TypeError,
        "residual has dtype",
    ),
    (
        "silu_mul up shape",
        lambda: batchinv.silu_mul(torch.randn(3, 8), torch.randn(3, 8)),
        lambda: batchinv.silu_mul(torch.randn(3, 8), torch.randn(3, 9)),
        ValueError,
        "up must have the shape",
    ),
    (
        "silu_mul_fused odd width",
        lambda: batchinv.silu_mul_fused(torch.randn(3, 8)),
        lambda: batchinv.silu_mul_fused(torch.randn(3, 9)),
        ValueError,
        "even, non-empty last dimension",
    ),
    (
        "embedding ids dtype",
        lambda: batchinv.embedding(torch.tensor([1, 2]), torch.randn(5, 4)),
        lambda: batchinv.embedding(torch.tensor([1.0, 2.0]), torch.randn(5, 4)),
        TypeError,
        "ids must have dtype",
    ),
    (
        "linear weight in_features",
        lambda: batchinv.linear(torch.randn(3, 8), torch.randn(4, 8)),
        lambda: batchinv.linear(torch.randn(3, 8), torch.randn(4, 7)),
        ValueError,
        "in_features",
    ),
    (
        "linear bias shape",
        lambda: batchinv.linear(torch.randn(3, 8), torch.randn(4, 8), torch.randn(4)),
        lambda: batchinv.linear(torch.randn(3, 8), torch.randn(4, 8), torch.randn(5)),
        ValueError,
        "bias.shape",
    ),
    (
        "rms_norm grad weight shape",
        lambda: batchinv.rms_norm(_grad(torch.randn(3, 8)), torch.ones(8), EPS),
        lambda: batchinv.rms_norm(_grad(torch.randn(3, 8)), torch.ones(9), EPS),
        ValueError,
        "weight must have shape",
    ),
    (
        "rms_norm grad eps value",
        lambda: batchinv.rms_norm(_grad(torch.randn(3, 8)), torch.ones(8), EPS),
        lambda: batchinv.rms_norm(_grad(torch.randn(3, 8)), torch.ones(8), -EPS),
        ValueError,
        "eps must be",
    ),
    (
        "fused_add_rms_norm grad residual shape",
        lambda: _fused_add(_grad(torch.randn(3, 8))),
        lambda: _fused_add(_grad(torch.randn(2, 8))),
        ValueError,
        "residual must have the shape",
    ),
    (
        "silu_mul grad up dtype",
        lambda: batchinv.silu_mul(_grad(torch.randn(3, 8)), torch.randn(3, 8)),
        lambda: batchinv.silu_mul(_grad(torch.randn(3, 8)), torch.randn(3, 8).double()),
        TypeError,
        "up",
    ),
    (
        "silu_mul_fused grad odd width",
        lambda: batchinv.silu_mul_fused(_grad(torch.randn(3, 8))),
        lambda: batchinv.silu_mul_fused(_grad(torch.randn(3, 9))),
        ValueError,
        "even, non-empty last dimension",
    ),
    (
        "embedding grad ids dtype",
        lambda: batchinv.embedding(torch.tensor([1, 2]), _grad(torch.randn(5, 4))),
        lambda: batchinv.embedding(torch.tensor([1.0, 2.0]), _grad(torch.randn(5, 4))),
        TypeError,
        "ids must have dtype",
    ),
    (
        "linear grad bias shape",
        lambda: batchinv.linear(_grad(torch.randn(3, 8)), torch.randn(4, 8), torch.randn(4)),
        lambda: batchinv.linear(_grad(torch.randn(3, 8)), torch.randn(4, 8), torch.randn(5)),
        ValueError,
        "bias.shape",
    ),
    (
        "rope k head dim",
        lambda: batchinv.rope(*_rope_args(), theta=THETA),
        lambda: batchinv.rope(*_rope_args(key_dim=6), theta=THETA),
        ValueError,
        "head_dim",
    ),
    (
        "rope positions shape",
        lambda: batchinv.rope(*_rope_args(), theta=THETA),
        lambda: batchinv.rope(*_rope_args(positions_shape=(2,)), theta=THETA),
        ValueError,
        "position_ids must have shape",
    ),
    (
        "rope theta value",
        lambda: batchinv.rope(*_rope_args(), theta=THETA),
        lambda: batchinv.rope(*_rope_args(), theta=-THETA),
        ValueError,
        "theta",
    ),
    (
        "rope max_position bool",
        # position 0 is valid for max_position=1, and True == 1: only its class tells them apart
        lambda: batchinv.rope(*_rope_args(positions_shape=(3,)), theta=THETA, max_position=1),
        lambda: batchinv.rope(*_rope_args(positions_shape=(3,)), theta=THETA, max_position=True),
        TypeError,
        "max_position",
    ),
    (
        "rope check_positions type",
        lambda: batchinv.rope(*_rope_args(), theta=THETA),
        lambda: batchinv.rope(*_rope_args(), theta=THETA, check_positions=1),
        TypeError,
        "check_positions",
    ),
    (
        "rope grad theta value",
        lambda: batchinv.rope(*_rope_args(requires_grad=True), theta=THETA),
        lambda: batchinv.rope(*_rope_args(requires_grad=True), theta=float("nan")),
        ValueError,
        "theta",
    ),
    (
        "log_softmax dim",
        lambda: batchinv.log_softmax(torch.randn(3, 8), -1),
        lambda: batchinv.log_softmax(torch.randn(3, 8), 0),
        ValueError,
        "dim",
    ),
    (
        "log_softmax out_dtype",
        lambda: batchinv.log_softmax(torch.randn(3, 8), -1, torch.float32),
        lambda: batchinv.log_softmax(torch.randn(3, 8), -1, torch.int32),
        TypeError,
        "out_dtype",
    ),
    (
        "attention head dim",
        lambda: _attention(),
        lambda: _attention(key_dim=4),
        ValueError,
        "k",
    ),
    (
        "attention softmax_scale",
        lambda: _attention(),
        lambda: _attention(softmax_scale=float("nan")),
        ValueError,
        "softmax_scale must be finite",
    ),
]  # fmt: skip


# The op module and the name of its check, by the case's first word.  The CPU references
# check their own arguments too, so each case also asserts that the *op's* check ran on the
# bad call: a signature that missed what differs would skip it (and on a GPU, nothing else
# would catch the argument).
OP_CHECKS = {
    "rms_norm": (rms_norm_op, "check_rms_norm_args"),
    "fused_add_rms_norm": (rms_norm_op, "check_fused_add_rms_norm_args"),
    "silu_mul": (silu_mul_op, "check_silu_mul_args"),
    "silu_mul_fused": (silu_mul_op, "check_silu_mul_fused_args"),
    "embedding": (embedding_op, "check_embedding_args"),
    "linear": (linear_op, "check_linear_args"),
    "log_softmax": (log_softmax_op, "check_log_softmax_args"),
    "attention": (attention_op, "_check_padded"),
    "rope": (rope_op, "check_rope_args"),
}


@pytest.mark.parametrize("case", BAD_AFTER_GOOD, ids=[c[0] for c in BAD_AFTER_GOOD])
def test_a_bad_call_raises_after_good_calls(case, monkeypatch):
    name, good, bad, error, match = case
    module, check = OP_CHECKS[name.split()[0]]
    for _ in range(2):
        good()
    seen = _counting(monkeypatch, module, check)
    for attempt in (1, 2):  # and again: a failing call leaves nothing behind
        with pytest.raises(error, match=match):
            bad()
        assert len(seen) == attempt, f"{name}: the op's check did not run on the bad call"
    good()


def test_id_values_are_checked_on_every_call():
    # Values are not part of a signature: the implementation checks them each call.
    weight = torch.randn(5, 4)
    batchinv.embedding(torch.tensor([1, 2]), weight)
    with pytest.raises(IndexError, match="ids"):
        batchinv.embedding(torch.tensor([1, 5]), weight)


# Each op's table and a call that fills it (the suite clears the tables before each test).
TABLE_CALLS = [
    (rms_norm_op._RMS_NORM_NO_GRAD, lambda: batchinv.rms_norm(*_case())),
    (rms_norm_op._FUSED_ADD_RMS_NORM_NO_GRAD, lambda: _fused_add(torch.randn(3, 8))),
    (silu_mul_op._SILU_MUL_NO_GRAD, lambda: batchinv.silu_mul(*torch.randn(2, 3, 8).unbind(0))),
    (silu_mul_op._SILU_MUL_FUSED_NO_GRAD, lambda: batchinv.silu_mul_fused(torch.randn(3, 8))),
    (embedding_op._FORWARD, lambda: batchinv.embedding(torch.tensor([1, 2]), torch.randn(5, 4))),
    (linear_op._FORWARD, lambda: batchinv.linear(torch.randn(3, 8), torch.randn(4, 8))),
    (log_softmax_op._NO_GRAD, lambda: batchinv.log_softmax(torch.randn(3, 8), -1)),
    (attention_op._PADDED_WITHOUT_LENGTHS, lambda: _attention()),
    (rms_norm_op._RMS_NORM_GRAD, lambda: _grad_case("rms_norm")[0]()),
    (rms_norm_op._FUSED_ADD_RMS_NORM_GRAD, lambda: _grad_case("fused_add_rms_norm")[0]()),
    (silu_mul_op._SILU_MUL_GRAD, lambda: _grad_case("silu_mul")[0]()),
    (silu_mul_op._SILU_MUL_FUSED_GRAD, lambda: _grad_case("silu_mul_fused")[0]()),
    (embedding_op._GRAD, lambda: _grad_case("embedding")[0]()),
    (linear_op._GRAD, lambda: _grad_case("linear")[0]()),
    (rope_op._CHECKED, lambda: _grad_case("rope")[0]()),
]  # fmt: skip


@pytest.mark.parametrize("table, call", TABLE_CALLS)
def test_every_op_table_holds_signatures_not_tensors(table, call):
    # A remembered entry must be the implementation alone: keeping a tensor alive would hold a
    # batch's memory for as long as the process runs.
    assert len(table) == 0
    call()
    assert len(table) == 1
    for run in table._known.values():
        assert callable(run) and not isinstance(run, torch.Tensor)
        # a function's closure, or a bound method's object (``Function.apply``): no tensor
        cells = getattr(run, "__closure__", None) or ()
        assert not any(isinstance(c.cell_contents, torch.Tensor) for c in cells)
        assert not isinstance(getattr(run, "__self__", None), torch.Tensor)


def test_fused_add_custom_op_gradients_of_x_and_residual_do_not_alias(monkeypatch):
    # The GPU node returns one gradient tensor for x and residual; a custom op's outputs may
    # not alias, so the custom op's backward copies one.  A CPU stand-in returns one tensor.
    class OneGradient(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, eps, residual):
            return x + residual, x + residual

        @staticmethod
        def backward(ctx, grad_y, grad_h):
            grad = grad_y + grad_h
            return grad, None, None, grad

    monkeypatch.setitem(
        registry._IMPLEMENTATIONS["fused_add_rms_norm.grad"], "cpu", OneGradient.apply
    )
    x, r = torch.randn(3, 8, requires_grad=True), torch.randn(3, 8, requires_grad=True)
    w = torch.ones(8, requires_grad=True)
    grads = (torch.randn(3, 8), torch.randn(3, 8))
    eager = torch.autograd.grad(batchinv.fused_add_rms_norm(x, r, w, EPS), (x, r), grads)
    assert eager[0] is eager[1]  # the stand-in is what runs
    got = torch.autograd.grad(torch.ops.batchinv.fused_add_rms_norm(x, r, w, EPS), (x, r), grads)
    assert got[0].untyped_storage().data_ptr() != got[1].untyped_storage().data_ptr()
    torch.testing.assert_close(got[0], eager[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], eager[0], rtol=0, atol=0)


def test_clear_all_forgets_the_kept_launch_plans_too():
    from batchinv.gpu import attention, linear, log_softmax

    modules = (attention, linear, log_softmax)
    for module in modules:
        module._LEAN[("a key",)] = None
    _checked.clear_all()
    assert [len(module._LEAN) for module in modules] == [0, 0, 0]

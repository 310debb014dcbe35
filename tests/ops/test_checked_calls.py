"""The host-light path of the public ops (``batchinv.ops._checked``): a call that needs no
gradient runs its checks once per signature.  These tests pin what that must never cost: a
bad argument still raises its own error after good calls of a nearby signature, and a call
that fails is not remembered."""

from __future__ import annotations

import pytest
import torch

import batchinv
from batchinv.ops import _checked
from batchinv.ops import attention as attention_op
from batchinv.ops import embedding as embedding_op
from batchinv.ops import linear as linear_op
from batchinv.ops import log_softmax as log_softmax_op
from batchinv.ops import rms_norm as rms_norm_op
from batchinv.ops import silu_mul as silu_mul_op

EPS = 1e-6


def _fused_add(residual):
    return batchinv.fused_add_rms_norm(torch.randn(3, 8), residual, torch.ones(8), EPS)


def _case():
    return torch.randn(3, 8), torch.ones(8), EPS


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


def test_a_gradient_call_is_checked_every_time(monkeypatch):
    seen = _counting(monkeypatch, rms_norm_op, "check_rms_norm_args")
    x, w = torch.randn(3, 8, requires_grad=True), torch.ones(8)
    batchinv.rms_norm(x, w, EPS)
    batchinv.rms_norm(x, w, EPS)
    assert len(seen) == 2


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
        assert not any(isinstance(c.cell_contents, torch.Tensor) for c in (run.__closure__ or ()))


def test_clear_all_forgets_the_kept_launch_plans_too():
    from batchinv.gpu import attention, linear, log_softmax

    modules = (attention, linear, log_softmax)
    for module in modules:
        module._LEAN[("a key",)] = None
    _checked.clear_all()
    assert [len(module._LEAN) for module in modules] == [0, 0, 0]

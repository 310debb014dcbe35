"""The public ops under bad input (CPU): each raises the documented error naming the argument,
changes none of its inputs, and the next valid call gives the bits it gave before."""

from __future__ import annotations

import pytest
import torch

import batchinv
from _adversarial import Case, host_ids, ids, randn, run_case
from batchinv.contract import assert_bitwise_equal


def _inputs():
    return {
        "x": randn(3, 16, seed=20),
        "w": randn(8, 16, seed=21),
        "b": randn(8, seed=22),
        "norm_w": randn(16, seed=23),
        "table": randn(10, 16, seed=24),
        "token_ids": host_ids(1, 9, 0),
        "q": randn(2, 3, 4, 8, seed=25),
        "k": randn(2, 3, 2, 8, seed=26),
        "v": randn(2, 3, 2, 8, seed=27),
        "positions": host_ids(0, 1, 2),
        "hidden": randn(3, 16, seed=28),
        "head": randn(10, 16, seed=29),
        "targets": host_ids(1, 2, 3),
    }


def _table(name, good, rows):
    return [Case(f"{name}_{n}", _inputs, bad, e, m, good) for n, bad, e, m in rows]


def _embedding_cases():
    def good(s):
        return batchinv.embedding(s["token_ids"], s["table"])

    def call(ids_=None, table=None, **kw):
        def run(s):
            chosen = s["token_ids"] if ids_ is None else ids_(s)
            return batchinv.embedding(chosen, s["table"] if table is None else table(s), **kw)

        return run

    return _table(
        "embedding",
        good,
        [
            ("ids_negative", call(lambda s: host_ids(1, -1)), IndexError, r"ids\[1\] = -1"),
            ("ids_vocab", call(lambda s: host_ids(10)), IndexError, r"ids\[0\] = 10"),
            ("ids_2_40", call(lambda s: host_ids(2**40)), IndexError, "ids"),
            ("ids_unchecked", call(lambda s: host_ids(10), check_ids=False), IndexError, "ids"),
            ("ids_float", call(lambda s: torch.ones(2)), TypeError, "ids"),
            ("ids_bool", call(lambda s: torch.ones(2, dtype=torch.bool)), TypeError, "ids"),
            ("ids_list", call(lambda s: [1, 2]), TypeError, "ids"),
            ("weight_1d", call(table=lambda s: s["table"][0]), ValueError, "weight"),
            ("weight_int", call(table=lambda s: s["table"].long()), TypeError, "weight"),
            ("weight_empty", call(table=lambda s: s["table"][:0]), ValueError, "weight"),
        ],
    )


def _linear_cases():
    def good(s):
        return batchinv.linear(s["x"], s["w"], s["b"])

    def call(x=None, w=None, b=None):
        def run(s):
            pick = {"x": x, "w": w, "b": b}
            args = [s[k] if f is None else f(s) for k, f in pick.items()]
            return batchinv.linear(*args)

        return run

    return _table(
        "linear",
        good,
        [
            (
                "in_features_zero",
                call(x=lambda s: s["x"][:, :0], w=lambda s: s["w"][:, :0]),
                ValueError,
                "in_features",
            ),
            ("in_features_mismatch", call(x=lambda s: s["x"][:, :8]), ValueError, "in_features"),
            ("x_int", call(x=lambda s: s["x"].long()), TypeError, "x"),
            ("x_not_tensor", call(x=lambda s: 1.0), TypeError, "x"),
            ("weight_3d", call(w=lambda s: s["w"][None]), ValueError, "weight"),
            ("bias_shape", call(b=lambda s: s["b"][:4]), ValueError, "bias"),
            ("dtype_mix", call(w=lambda s: s["w"].double()), TypeError, "weight"),
        ],
    )


def _rms_norm_cases():
    def good(s):
        return batchinv.rms_norm(s["x"], s["norm_w"], 1e-6)

    def call(eps=1e-6, w=None):
        return lambda s: batchinv.rms_norm(s["x"], s["norm_w"] if w is None else w(s), eps)

    return _table(
        "rms_norm",
        good,
        [
            ("eps_zero", call(0.0), ValueError, "eps"),
            ("eps_negative", call(-1e-6), ValueError, "eps"),
            ("eps_nan", call(float("nan")), ValueError, "eps"),
            ("eps_bool", call(True), TypeError, "eps"),
            ("eps_str", call("1e-6"), TypeError, "eps"),
            ("eps_underflow", call(1e-50), ValueError, "eps"),
            ("weight_shape", call(w=lambda s: s["norm_w"][:8]), ValueError, "weight"),
        ],
    )


def _rope_cases():
    def good(s):
        return batchinv.rope(s["q"][0], s["k"][0], s["positions"], theta=10000.0)

    def call(positions=None, **kw):
        def run(s):
            chosen = s["positions"] if positions is None else positions
            options = {"theta": 10000.0} | kw
            return batchinv.rope(s["q"][0], s["k"][0], chosen, **options)

        return run

    return _table(
        "rope",
        good,
        [
            ("positions_float", call(torch.zeros(3)), TypeError, "position_ids"),
            ("positions_negative", call(host_ids(0, -1, 2)), IndexError, "position_ids"),
            ("positions_past", call(host_ids(0, 1, 9), max_position=9), IndexError, "position_ids"),
            ("positions_shape", call(host_ids(0, 1)), ValueError, "position_ids"),
            ("theta_zero", call(theta=0.0), ValueError, "theta"),
            ("theta_bool", call(theta=True), TypeError, "theta"),
        ],
    )


def _softmax_and_logprob_cases():
    def good(s):
        return batchinv.token_logprobs(s["hidden"], s["head"], s["targets"])

    def logprobs(targets=None, **kw):
        def run(s):
            chosen = s["targets"] if targets is None else targets
            return batchinv.token_logprobs(s["hidden"], s["head"], chosen, **kw)

        return run

    def log_softmax(**kw):
        return lambda s: batchinv.log_softmax(s["x"], **kw)

    return _table(
        "logprobs",
        good,
        [
            ("targets_vocab", logprobs(host_ids(1, 10, 2)), IndexError, "target_ids"),
            ("targets_float", logprobs(torch.zeros(3)), TypeError, "target_ids"),
            ("targets_shape", logprobs(host_ids(1, 2)), ValueError, "target_ids"),
            ("ignore_index_float", logprobs(ignore_index=-100.0), TypeError, "ignore_index"),
            ("vocab_chunk_zero", logprobs(vocab_chunk=0), ValueError, "vocab_chunk"),
            ("vocab_chunk_bool", logprobs(vocab_chunk=True), TypeError, "vocab_chunk"),
            ("log_softmax_dim", log_softmax(dim=0), ValueError, "dim"),
            ("log_softmax_chunk", log_softmax(chunk_size=0), ValueError, "chunk_size"),
        ],
    )


def _attention_cases():
    def good(s):
        return batchinv.attention(s["q"], s["k"], s["v"], causal=True)

    def call(**kw):
        return lambda s: batchinv.attention(s["q"], s["k"], s["v"], **kw)

    def varlen(cu_q, cu_k):
        def run(s):
            q, k, v = (s[n].reshape(-1, *s[n].shape[2:]) for n in ("q", "k", "v"))
            return batchinv.attention_varlen(q, k, v, cu_q, cu_k)

        return run

    return _table(
        "attention",
        good,
        [
            ("scale_nan", call(softmax_scale=float("nan")), ValueError, "softmax_scale"),
            ("causal_int", call(causal=1), TypeError, "causal"),
            ("seqlens_q_past", call(seqlens_q=host_ids(1, 4)), ValueError, "seqlens_q"),
            ("seqlens_k_float", call(seqlens_k=torch.ones(2)), TypeError, "seqlens_k"),
            ("mask_dtype", call(key_padding_mask=torch.ones(2, 3)), TypeError, "key_padding_mask"),
            (
                "cu_seqlens_start",
                varlen(host_ids(1, 6), host_ids(0, 6)),
                ValueError,
                "cu_seqlens_q",
            ),
            ("cu_seqlens_end", varlen(host_ids(0, 6), host_ids(0, 5)), ValueError, "cu_seqlens_k"),
            (
                "cu_seqlens_order",
                varlen(host_ids(0, 4, 3, 6), host_ids(0, 2, 4, 6)),
                ValueError,
                "non-decreasing",
            ),
        ],
    )


CASES = (
    _embedding_cases()
    + _linear_cases()
    + _rms_norm_cases()
    + _rope_cases()
    + _softmax_and_logprob_cases()
    + _attention_cases()
)


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_bad_call_changes_nothing(case):
    run_case(case)


def test_embedding_backward_drops_out_of_range_ids():
    """The weight gradient of an id outside [0, vocab) (reachable only with the id check off)
    is dropped: no row outside grad_weight is written (the GPU kernel's defined result)."""
    from batchinv.reference.embedding import embedding_backward

    ids_ = host_ids(2, -1, 10, 2**40, 2, 9)
    grad = randn(6, 4, seed=30)
    got = embedding_backward(ids_, grad, 10, torch.float32)
    in_range = host_ids(2, 2, 9)
    expected = embedding_backward(in_range, grad[[0, 4, 5]], 10, torch.float32)
    assert_bitwise_equal(got, expected, name="grad_weight without the out-of-range ids")
    assert got.shape == (10, 4)

"""``batchinv.enable()``: routing, exactness-or-error, restoration, and a stock HF Qwen3 made
batch-invariant on the CPU."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

import batchinv
from _hf_tiny_qwen3 import logits, make_hf_model, sweep_cases, token_ids
from batchinv.contract import assert_bitwise_equal, assert_within_tolerance, bitwise_equal
from batchinv.integrations.enable import is_enabled


def _randn(*shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# ----------------------------------------------------------------------------- routing


def test_linear_and_products_are_batchinv_linear():
    x, w, b = _randn(5, 16, seed=0), _randn(7, 16, seed=1), _randn(7, seed=2)
    want = batchinv.linear(x, w, b)
    with batchinv.enable():
        got = {
            "F.linear": F.linear(x, w, b),
            "nn.Linear": torch.nn.Linear(16, 7).requires_grad_(False),
            "addmm": torch.addmm(b, x, w.t()),
            "matmul": torch.matmul(x, w.t()) + 0,
            "@": x @ w.t(),
            "mm": x.mm(w.t()),
        }
        layer = got.pop("nn.Linear")
        layer.weight.copy_(w)
        layer.bias.copy_(b)
        got["nn.Linear"] = layer(x)
    for name in ("F.linear", "addmm", "nn.Linear"):
        assert_bitwise_equal(got[name], want, name=name)
    no_bias = batchinv.linear(x, w)
    for name in ("matmul", "@", "mm"):
        assert_bitwise_equal(got[name], no_bias, name=name)


def test_batched_matmul_is_per_element_linear_and_row_invariant():
    """Eager attention's QK^T: each batch element is the fixed-order GEMM, so an element's
    product does not depend on the others or on how many rows it has."""
    a, b = _randn(3, 4, 9, 8, seed=3), _randn(3, 4, 8, 11, seed=4)
    with batchinv.enable():
        full = torch.matmul(a, b)
        one = torch.matmul(a[1:2, 2:3, :5], b[1:2, 2:3])
        bmm = torch.bmm(a[0], b[0])
    for i in range(3):
        for h in range(4):
            assert_bitwise_equal(full[i, h], batchinv.linear(a[i, h], b[i, h].t()))
    assert_bitwise_equal(one, full[1:2, 2:3, :5], name="fewer rows, one element")
    assert_bitwise_equal(bmm, full[0], name="bmm")


def test_mean_rms_norm_log_softmax_rows_do_not_depend_on_the_batch():
    x = _randn(37, 96, seed=5)
    weight = _randn(96, seed=6)
    with batchinv.enable():
        outs = [
            x.pow(2).mean(-1, keepdim=True),
            torch.mean(x, dim=-1),
            F.rms_norm(x, (96,), weight, 1e-6),
            F.log_softmax(x, dim=-1),
            torch.softmax(x, dim=-1),
            x.log_softmax(dim=0).t(),
        ]
        for row in (0, 17, 36):
            alone = [
                x[row : row + 1].pow(2).mean(-1, keepdim=True),
                torch.mean(x[row : row + 1], dim=-1),
                F.rms_norm(x[row : row + 1], (96,), weight, 1e-6),
                F.log_softmax(x[row : row + 1], dim=-1),
                torch.softmax(x[row : row + 1], dim=-1),
            ]
            for i, single in enumerate(alone):
                assert_bitwise_equal(single, outs[i][row : row + 1], name=f"route {i} row {row}")
    assert_bitwise_equal(outs[2], batchinv.rms_norm(x, weight, 1e-6), name="F.rms_norm")
    assert_bitwise_equal(outs[3], batchinv.log_softmax(x), name="log_softmax")
    # Accuracy against stock, with the contract's tolerances.
    assert_within_tolerance(outs[0], x.pow(2).mean(-1, keepdim=True), op_class="reduction")
    assert_within_tolerance(outs[4], torch.softmax(x, dim=-1), op_class="reduction")
    assert_within_tolerance(outs[5], x.log_softmax(dim=0).t(), op_class="logprob")


def test_mean_bf16_and_all_dims():
    x = _randn(6, 10, 12, seed=7, dtype=torch.bfloat16)
    with batchinv.enable():
        all_dims = x.mean()
        two = x.mean(dim=(0, 2), keepdim=True)
    assert all_dims.dtype == torch.bfloat16 and two.shape == (1, 10, 1)
    assert_within_tolerance(all_dims, x.float().mean(), op_class="reduction")
    assert_within_tolerance(two, x.float().mean(dim=(0, 2), keepdim=True), op_class="reduction")


def test_sdpa_padding_mask_routes_and_rows_equal_alone():
    b, hq, hkv, s, d = 3, 4, 2, 9, 16
    q, k, v = (
        _randn(b, hq, s, d, seed=8),
        _randn(b, hkv, s, d, seed=9),
        _randn(b, hkv, s, d, seed=10),
    )
    lengths = torch.tensor([9, 4, 7])
    keep = torch.arange(s)[None, :] < lengths[:, None]
    mask = (torch.ones(s, s, dtype=torch.bool).tril() & keep[:, None, :])[:, None]
    with batchinv.enable():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        for i, n in enumerate(lengths.tolist()):
            alone = F.scaled_dot_product_attention(
                q[i : i + 1, :, :n],
                k[i : i + 1, :, :n],
                v[i : i + 1, :, :n],
                is_causal=True,
                enable_gqa=True,
            )
            assert_bitwise_equal(out[i : i + 1, :, :n], alone, name=f"sequence {i}")
    stock = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert_within_tolerance(out, stock, op_class="attention")  # padded query rows included


def test_sdpa_decode_against_a_longer_key_row_is_bottom_right():
    q, k = _randn(2, 4, 1, 16, seed=11), _randn(2, 4, 10, 16, seed=12)
    keep = torch.tensor([[True] * 10, [True] * 6 + [False] * 4])[:, None, None, :]
    with batchinv.enable():
        out = F.scaled_dot_product_attention(q, k, k, attn_mask=keep)
        top_left = F.scaled_dot_product_attention(q, k, k, is_causal=True)
    assert_within_tolerance(
        out, F.scaled_dot_product_attention(q, k, k, attn_mask=keep), op_class="attention"
    )
    # torch's is_causal with Sq < Sk is top-left: query 0 sees key 0 only.
    assert_within_tolerance(
        top_left, F.scaled_dot_product_attention(q, k, k, is_causal=True), op_class="attention"
    )


@pytest.mark.parametrize(
    "make_call, error, match",
    [
        (
            lambda q, k: F.scaled_dot_product_attention(q, k, k, dropout_p=0.1),
            ValueError,
            "dropout",
        ),
        (
            lambda q, k: F.scaled_dot_product_attention(q, k, k, attn_mask=torch.randn(4, 4)),
            ValueError,
            "additive bias",
        ),
        (
            lambda q, k: F.scaled_dot_product_attention(
                q, k, k, attn_mask=torch.ones(4, 4, dtype=torch.bool).tril().triu(-1)
            ),
            ValueError,
            "not padding / causal",
        ),
        (
            lambda q, k: F.scaled_dot_product_attention(
                q,
                k,
                k,
                attn_mask=torch.rand(1, 2, 4, 4, generator=torch.Generator().manual_seed(0)) > 0.3,
            ),
            ValueError,
            "differs between heads",
        ),
        (
            lambda q, k: F.scaled_dot_product_attention(q, k[:, :1], k[:, :1]),
            ValueError,
            "enable_gqa",
        ),
        (lambda q, k: torch.matmul(q.double(), k.double().mT), TypeError, "dtype"),
        (lambda q, k: F.log_softmax(q), ValueError, "explicit dim"),
        (lambda q, k: F.rms_norm(q, (4, 8)), ValueError, "last dim only"),
    ],
)
def test_calls_that_cannot_be_routed_exactly_raise(make_call, error, match):
    q, k = _randn(1, 2, 4, 8, seed=13), _randn(1, 2, 4, 8, seed=14)
    with batchinv.enable(), pytest.raises(error, match=match):
        make_call(q, k)


def test_integer_matmul_passes_through():
    a = torch.arange(6).reshape(2, 3)
    with batchinv.enable():
        assert torch.equal(a @ a.t(), torch.tensor([[5, 14], [14, 50]]))


def test_gradients_flow_through_batchinv_backward():
    x, w = _randn(4, 8, seed=15).requires_grad_(), _randn(3, 8, seed=16).requires_grad_()
    with batchinv.enable():
        F.linear(x, w).pow(2).mean().backward()
    gx, gw = x.grad, w.grad
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    with batchinv.enable():
        y = batchinv.linear(x2, w2)  # direct batchinv call inside enable() is unchanged
        y.pow(2).mean().backward()
    assert_bitwise_equal([gx, gw], [x2.grad, w2.grad], name="grads")


# ----------------------------------------------------------------------------- restoration


def _stock_bits(x, w):
    return F.linear(x, w)


def test_reentrant_decorator_and_restoration():
    x, w = _randn(6, 32, seed=17), _randn(5, 32, seed=18)
    before = _stock_bits(x, w)
    assert not is_enabled()

    @batchinv.enable()
    def decorated():
        assert is_enabled()
        with batchinv.enable():  # nested: still one mode, still routed
            inner = F.linear(x, w)
        assert is_enabled()
        return inner, F.linear(x, w)

    inner, outer = decorated()
    assert not is_enabled()
    assert_bitwise_equal(inner, batchinv.linear(x, w), name="nested")
    assert_bitwise_equal(outer, batchinv.linear(x, w), name="after the nested block")
    with pytest.raises(RuntimeError, match="boom"), batchinv.enable():
        raise RuntimeError("boom")
    assert not is_enabled()
    assert torch.overrides._get_current_function_mode_stack() == []
    assert_bitwise_equal(_stock_bits(x, w), before, name="stock after exit")


def test_enable_is_per_thread():
    seen = []
    with batchinv.enable():
        thread = threading.Thread(target=lambda: seen.append(is_enabled()))
        thread.start()
        thread.join()
    assert seen == [False]


# ----------------------------------------------------------------------------- HF Qwen3

transformers = pytest.importorskip("transformers")


def _sweep(model, target) -> list[tuple[str, bool]]:
    """(case, bitwise equal to the sequence alone) for every case of the sweep."""
    alone = logits(model, target[None])[0]
    results = []
    for case in sweep_cases(target):
        got = logits(model, case.ids, case.mask)[case.row, : target.numel()]
        results.append((case.name, bitwise_equal(got, alone)))
    return results


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_stock_hf_qwen3_is_batch_invariant_under_enable(attn_implementation):
    model = make_hf_model(attn_implementation)
    target = token_ids(1, 11, seed=1)[0]
    with batchinv.enable():
        alone = logits(model, target[None])[0]
        for case in sweep_cases(target):
            got = logits(model, case.ids, case.mask)[case.row, : target.numel()]
            assert_bitwise_equal(got, alone, name=f"{attn_implementation}: {case.name}")
    # Still the same model: within the contract's tolerance of the stock logits.
    assert_within_tolerance(alone, logits(model, target[None])[0], op_class="reduction")


def test_the_same_sweep_runs_without_enable():
    """Without enable() the sweep is run too (stock CPU kernels may or may not drift here;
    only that every comparison ran is asserted).  With enable() every case is equal."""
    model = make_hf_model("sdpa")
    target = token_ids(1, 11, seed=1)[0]
    stock = _sweep(model, target)
    with batchinv.enable():
        routed = _sweep(model, target)
    assert [name for name, _ in stock] == [name for name, _ in routed]
    assert len(stock) == len(sweep_cases(target)) == 7
    assert all(equal for _, equal in routed), routed
    drifted = [name for name, equal in stock if not equal]
    print(f"stock CPU: {len(drifted)} of {len(stock)} cases drift: {drifted}")

"""The bitwise comparator on crafted cases whose expected verdict is known by construction."""

from __future__ import annotations

import re

import pytest
import torch

from batchinv.contract import assert_bitwise_equal, bitwise_equal

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
INT_VIEW = {
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


def _from_bits(bits: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Floats with exactly these bit patterns (given as signed integers of the same width)."""
    return torch.tensor(bits, dtype=INT_VIEW[dtype]).view(dtype)


def _flip_lowest_mantissa_bit(t: torch.Tensor, flat_index: int) -> torch.Tensor:
    bits = t.clone().view(INT_VIEW[t.dtype]).reshape(-1)
    bits[flat_index] ^= 1
    return bits.view(t.dtype).reshape(t.shape)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_equal_tensors_pass(dtype):
    x = torch.randn(5, 7, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert bitwise_equal(x, x.clone())
    assert_bitwise_equal(x, x.clone(), name="x")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_signed_zeros_differ(dtype):
    pos = torch.zeros(3, dtype=dtype)
    neg = pos.clone()
    neg[1] = -0.0
    assert bool((pos == neg).all()), "sanity: == cannot see the sign of zero"
    assert not bitwise_equal(pos, neg)
    with pytest.raises(AssertionError, match=r"index \(1,\)"):
        assert_bitwise_equal(pos, neg)


def test_nan_payloads_differ_in_bf16():
    a = _from_bits([0x3F80, 0x7FC0], torch.bfloat16)
    b = _from_bits([0x3F80, 0x7FC1], torch.bfloat16)
    assert bool(a[1].isnan()) and bool(b[1].isnan())
    assert not bitwise_equal(a, b)
    with pytest.raises(AssertionError) as info:
        assert_bitwise_equal(a, b, name="logits")
    message = str(info.value)
    assert "0x7fc0" in message and "0x7fc1" in message
    assert "1 of 2" in message


def test_identical_nans_are_equal():
    a = _from_bits([0x7FC0, 0x7F81], torch.bfloat16)
    assert bitwise_equal(a, a.clone())


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_lowest_mantissa_bit_flip_is_caught(dtype):
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(2)).to(dtype)
    y = _flip_lowest_mantissa_bit(x, flat_index=13)
    assert not bitwise_equal(x, y)
    with pytest.raises(AssertionError) as info:
        assert_bitwise_equal(y, x, name="probe")
    message = str(info.value)
    assert message.startswith("probe: 1 of 24 elements differ")
    assert "first mismatch at index (2, 1)" in message  # 13 = 2 * 6 + 1
    max_diff = float(re.search(r"max abs diff over mismatches: (\S+)", message).group(1))
    one_ulp = float((y[2, 1].double() - x[2, 1].double()).abs())
    assert max_diff == pytest.approx(one_ulp, rel=1e-5) and max_diff > 0


def test_message_has_values_and_hex_bits():
    expected = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float32)
    actual = expected.clone()
    actual[1, 0] = 3.5
    actual[1, 1] = 5.0
    with pytest.raises(AssertionError) as info:
        assert_bitwise_equal(actual, expected, name="out")
    message = str(info.value)
    assert "out: 2 of 4 elements differ" in message
    assert "first mismatch at index (1, 0): actual 3.5 (0x40600000), expected 3.0 (0x40400000)" in (
        message
    )
    assert "max abs diff over mismatches: 1" in message


def test_dtype_mismatch_is_reported_as_such():
    x = torch.ones(3)
    with pytest.raises(TypeError, match="dtype mismatch"):
        bitwise_equal(x, x.to(torch.bfloat16))
    with pytest.raises(AssertionError, match="dtype mismatch"):
        assert_bitwise_equal(x, x.double(), name="h")


def test_shape_mismatch_is_reported_as_such():
    x = torch.ones(3, 4)
    with pytest.raises(ValueError, match="shape mismatch"):
        bitwise_equal(x, x.reshape(4, 3))
    with pytest.raises(
        AssertionError, match=r"shape mismatch, actual \(3, 4\) vs expected \(12,\)"
    ):
        assert_bitwise_equal(x, x.reshape(12))


def test_non_tensor_is_a_type_error():
    with pytest.raises(TypeError, match="must be a torch.Tensor, got float"):
        assert_bitwise_equal(1.0, torch.ones(()))
    with pytest.raises(TypeError, match="expected is a Tensor"):
        bitwise_equal([torch.ones(1)], torch.ones(1))


def test_non_contiguous_views_compare_logically():
    base = torch.randn(6, 8, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    view = base.t()[::2]  # [4, 6], strided
    assert not view.is_contiguous()
    assert bitwise_equal(view, view.contiguous())
    changed = base.clone()
    changed[3, 4] = -changed[3, 4] if changed[3, 4] != 0 else 1.0
    # base.t()[::2][r, c] is base[c, 2 r]: (3, 4) shows up at (2, 3) of the view.
    with pytest.raises(AssertionError, match=r"first mismatch at index \(2, 3\)"):
        assert_bitwise_equal(changed.t()[::2], view.contiguous())


def test_empty_and_scalar_tensors():
    assert bitwise_equal(torch.empty(0, 5), torch.empty(0, 5))
    assert_bitwise_equal(
        torch.empty(2, 0, dtype=torch.float16), torch.empty(2, 0, dtype=torch.float16)
    )
    assert bitwise_equal(torch.tensor(1.5), torch.tensor(1.5))
    with pytest.raises(AssertionError, match=r"index \(\)"):
        assert_bitwise_equal(torch.tensor(1.5), torch.tensor(-1.5))


def test_integers_and_bools_compare_directly():
    assert_bitwise_equal(torch.tensor([1, -2, 3]), torch.tensor([1, -2, 3]))
    with pytest.raises(AssertionError, match="1 of 3"):
        assert_bitwise_equal(torch.tensor([1, -2, 3]), torch.tensor([1, -2, 4]))
    with pytest.raises(AssertionError, match=r"index \(1,\)"):
        assert_bitwise_equal(torch.tensor([True, False]), torch.tensor([True, True]))


def test_sequences_compare_pairwise_with_indexed_names():
    x = torch.randn(3, 2)
    lse = torch.randn(3)
    other = lse.clone()
    other[2] = other[2] + 1
    assert bitwise_equal((x, lse), [x.clone(), lse.clone()])
    assert not bitwise_equal((x, lse), (x, other))
    with pytest.raises(AssertionError, match=r"attn\[1\]: 1 of 3"):
        assert_bitwise_equal((x, lse), (x, other), name="attn")
    with pytest.raises(AssertionError, match="2 tensors"):
        assert_bitwise_equal((x, lse), (x,))
    with pytest.raises(TypeError):
        assert_bitwise_equal((x, lse), x)


def test_inputs_are_not_modified():
    a = torch.tensor([0.0, float("nan")])
    b = torch.tensor([-0.0, 1.0])
    a_bits, b_bits = a.view(torch.int32).clone(), b.view(torch.int32).clone()
    with pytest.raises(AssertionError):
        assert_bitwise_equal(a, b)
    assert torch.equal(a.view(torch.int32), a_bits) and torch.equal(b.view(torch.int32), b_bits)


def test_infinities():
    a = torch.tensor([float("inf"), 1.0])
    b = torch.tensor([float("-inf"), 1.0])
    assert bitwise_equal(a, a.clone())
    with pytest.raises(AssertionError, match="involve NaN/inf"):
        assert_bitwise_equal(a, b)


def test_contract_does_not_import_what_it_judges():
    import ast
    import pathlib

    import batchinv.contract

    package = pathlib.Path(batchinv.contract.__file__).parent
    for path in package.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                module = ("." * node.level) + (node.module or "")
                names = [module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                assert not any(part in name.split(".") for part in ("reference", "ops")), (
                    f"{path.name} imports {name}"
                )

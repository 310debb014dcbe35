"""Bitwise comparison of tensors, the Axis-A judge.

Invariance means the same bits, not close values: ``+0`` and ``-0`` differ, and two NaNs
with different payloads differ.  ``==`` on floats gets both of these wrong (``-0 == +0``,
``nan != nan``), so floating-point tensors are compared through a same-width integer view
of their storage (bf16/fp16 -> int16, fp32 -> int32, fp64 -> int64, fp8 -> int8).
Integer and bool tensors are compared with ``==``, which is already exact.

The comparison runs on the tensors' device (no copy of a large GPU tensor to the host just
to compare it); only the few values quoted in a failure message are brought to the CPU.
Tensors on two different devices are both compared on the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "BitwiseComparison",
    "DtypeMismatchError",
    "ShapeMismatchError",
    "assert_bitwise_equal",
    "bitwise_equal",
    "compare_bits",
]

# Mismatches quoted in a failure message besides the count (the first is the one that matters).
_QUOTED_MISMATCHES = 3

_INT_VIEW_BY_ITEMSIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class DtypeMismatchError(AssertionError, TypeError):
    """The two sides have different dtypes; caught as AssertionError or as TypeError."""


class ShapeMismatchError(AssertionError, ValueError):
    """The two sides have different shapes; caught as AssertionError or as ValueError."""


def _label(name: str) -> str:
    return name if name else "tensor"


def _check_comparable(actual: object, expected: object, name: str) -> None:
    for side, value in (("actual", actual), ("expected", expected)):
        if not isinstance(value, Tensor):
            raise TypeError(
                f"{_label(name)}: {side} must be a torch.Tensor, got {type(value).__name__}"
            )
    assert isinstance(actual, Tensor) and isinstance(expected, Tensor)
    if actual.dtype != expected.dtype:
        raise DtypeMismatchError(
            f"{_label(name)}: dtype mismatch, actual {actual.dtype} vs expected {expected.dtype} "
            "(bitwise comparison needs the same dtype; cast explicitly if that is intended)"
        )
    if actual.shape != expected.shape:
        raise ShapeMismatchError(
            f"{_label(name)}: shape mismatch, actual {tuple(actual.shape)} vs expected "
            f"{tuple(expected.shape)}"
        )


def _same_device(actual: Tensor, expected: Tensor) -> tuple[Tensor, Tensor]:
    if actual.device == expected.device:
        return actual, expected
    return actual.cpu(), expected.cpu()


def _bit_view(t: Tensor) -> Tensor:
    """A view whose ``==`` compares bit patterns (no copy, any strides)."""
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.is_floating_point():
        return t.view(_INT_VIEW_BY_ITEMSIZE[t.element_size()])
    return t


def _mismatch_mask(actual: Tensor, expected: Tensor) -> Tensor:
    return _bit_view(actual) != _bit_view(expected)


def bitwise_equal(a: Tensor | Sequence[Tensor], b: Tensor | Sequence[Tensor]) -> bool:
    """True iff ``a`` and ``b`` hold the same bit patterns (same dtype and shape required).

    Sequences (tuples/lists) of tensors are compared pairwise and must have equal lengths.
    A dtype or shape mismatch is an error, not ``False``: comparing a bf16 result with an
    fp32 one is a bug in the caller, and a quiet ``False`` would hide it.
    """
    if isinstance(a, Sequence) and not isinstance(a, Tensor | str):
        _check_sequences(a, b, "")
        return all(bitwise_equal(x, y) for x, y in zip(a, b, strict=True))
    _check_comparable(a, b, "")
    if a.numel() == 0:
        return True
    a, b = _same_device(a, b)
    return not bool(_mismatch_mask(a, b).any())


def _check_sequences(actual: object, expected: object, name: str) -> None:
    if not isinstance(expected, Sequence) or isinstance(expected, Tensor | str):
        raise TypeError(
            f"{_label(name)}: actual is a {type(actual).__name__} of tensors but expected is a "
            f"{type(expected).__name__}"
        )
    assert isinstance(actual, Sequence)
    if len(actual) != len(expected):
        raise ShapeMismatchError(
            f"{_label(name)}: actual has {len(actual)} tensors, expected has {len(expected)}"
        )


def _bits_hex(value: Tensor) -> str:
    """Hex of one element's bit pattern, as an unsigned number of the element's width."""
    bits = int(_bit_view(value.reshape(1)).reshape(-1)[0]) if value.is_floating_point() else None
    if bits is None:
        return ""
    width = value.element_size() * 8
    return f" (0x{bits & ((1 << width) - 1):0{width // 4}x})"


def _format_element(t: Tensor, index: tuple[int, ...]) -> str:
    element = t[index].cpu()
    if element.is_complex():
        return f"{complex(element)!r}"
    if element.is_floating_point():
        return f"{float(element)!r}{_bits_hex(element)}"
    return f"{element.item()!r}"


def _max_abs_diff(actual: Tensor, expected: Tensor, mask: Tensor) -> str:
    """Largest |actual - expected| over mismatching elements where both sides are finite."""
    if actual.dtype == torch.bool:
        return "n/a (bool)"
    a = actual[mask]
    e = expected[mask]
    if a.is_complex():
        diff = (a.to(torch.complex128) - e.to(torch.complex128)).abs()
    else:
        diff = (a.to(torch.float64) - e.to(torch.float64)).abs()
    finite = diff.isfinite()
    nonfinite = int((~finite).sum())
    note = f" ({nonfinite} mismatches involve NaN/inf)" if nonfinite else ""
    if not bool(finite.any()):
        return f"n/a{note}"
    return f"{float(diff[finite].max()):.6g}{note}"


def _mismatches(actual: Tensor, expected: Tensor) -> tuple[Tensor, Tensor, Tensor, int]:
    """``(actual, expected, mask, count)``: both tensors on one device, the mask of elements
    whose bits differ (a complex element where either part does) and how many there are."""
    actual, expected = _same_device(actual, expected)
    mask = _mismatch_mask(actual, expected)
    if actual.is_complex():
        mask = mask.any(dim=-1)
    return actual, expected, mask, int(mask.sum())


@dataclass(frozen=True)
class BitwiseComparison:
    """What ``compare_bits`` found: the mismatch count, the first one, the largest |diff|."""

    mismatches: int
    numel: int
    first_mismatch: tuple[int, ...] | None
    max_abs_diff: float  # over mismatches where both sides are finite; nan if none is

    @property
    def equal(self) -> bool:
        return self.mismatches == 0


def compare_bits(actual: Tensor, expected: Tensor, *, name: str = "") -> BitwiseComparison:
    """Counts bitwise mismatches (same dtype and shape required, as for ``bitwise_equal``)."""
    _check_comparable(actual, expected, name)
    numel = actual.numel()
    if numel == 0:
        return BitwiseComparison(0, 0, None, 0.0)
    actual, expected, mask, count = _mismatches(actual, expected)
    if count == 0:
        return BitwiseComparison(0, numel, None, 0.0)
    first = tuple(int(i) for i in mask.nonzero()[0].cpu().tolist())
    if actual.dtype == torch.bool:
        max_diff = 1.0
    else:
        wide = torch.complex128 if actual.is_complex() else torch.float64
        diff = (actual[mask].to(wide) - expected[mask].to(wide)).abs()
        finite = diff[diff.isfinite()]
        max_diff = float(finite.max()) if finite.numel() else float("nan")
    return BitwiseComparison(count, numel, first, max_diff)


def assert_bitwise_equal(
    actual: Tensor | Sequence[Tensor],
    expected: Tensor | Sequence[Tensor],
    *,
    name: str = "",
) -> None:
    """Raises AssertionError unless ``actual`` and ``expected`` have identical bit patterns.

    The message gives ``name``, the number of mismatching elements out of ``numel``, the
    first mismatching index (row-major), both values with their hex bit patterns, and the
    largest absolute difference.  Tuples/lists are compared pairwise; element ``i`` is
    reported as ``name[i]``.  A dtype or shape mismatch raises an AssertionError that is
    also a TypeError / ValueError and says which it is.
    """
    if isinstance(actual, Sequence) and not isinstance(actual, Tensor | str):
        _check_sequences(actual, expected, name)
        assert isinstance(expected, Sequence)
        failures = []
        for i, (x, y) in enumerate(zip(actual, expected, strict=True)):
            try:
                assert_bitwise_equal(x, y, name=f"{_label(name)}[{i}]")
            except (DtypeMismatchError, ShapeMismatchError):
                raise
            except AssertionError as err:
                failures.append(str(err))
        if failures:
            raise AssertionError("\n".join(failures))
        return
    _check_comparable(actual, expected, name)
    assert isinstance(actual, Tensor) and isinstance(expected, Tensor)
    numel = actual.numel()
    if numel == 0:
        return
    actual, expected, mask, count = _mismatches(actual, expected)
    if count == 0:
        return
    positions = mask.nonzero()[:_QUOTED_MISMATCHES].cpu().tolist()
    lines = [
        f"{_label(name)}: {count} of {numel} elements differ bitwise "
        f"(dtype {actual.dtype}, shape {tuple(actual.shape)})"
    ]
    for k, position in enumerate(positions):
        index = tuple(position)
        tag = "first mismatch" if k == 0 else "next mismatch"
        lines.append(
            f"  {tag} at index {index}: actual {_format_element(actual, index)}, "
            f"expected {_format_element(expected, index)}"
        )
    lines.append(f"  max abs diff over mismatches: {_max_abs_diff(actual, expected, mask)}")
    raise AssertionError("\n".join(lines))

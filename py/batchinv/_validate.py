"""Argument checks shared by the references and the GPU ops.

Every failure names the argument, says what was expected and what was given.  Checks
never convert, broadcast or copy: a caller that passes the wrong thing gets an error.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LOW_PRECISION_DTYPES = (torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor(
    name: str,
    value: object,
    *,
    dtypes: Iterable[torch.dtype] | None = None,
    ndim: int | Iterable[int] | None = None,
    contiguous: bool = False,
) -> Tensor:
    """Checks that ``value`` is a tensor with an allowed dtype and rank; returns it."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if value.dtype not in dtypes:
            raise TypeError(
                f"{name} must have dtype in ({_dtype_names(dtypes)}), got "
                f"{str(value.dtype).removeprefix('torch.')}"
            )
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if value.dim() not in allowed:
            want = " or ".join(str(n) for n in allowed)
            raise ValueError(f"{name} must have {want} dimensions, got shape {tuple(value.shape)}")
    if contiguous and not value.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")
    return value


def check_same_device(**tensors: Tensor) -> torch.device:
    """Checks that all named tensors live on one device; returns it."""
    items = list(tensors.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(
                f"{name} is on {t.device} but {first_name} is on {first.device}; "
                "all tensors must be on one device"
            )
    return first.device


def check_same_dtype(**tensors: Tensor) -> torch.dtype:
    """Checks that all named tensors share one dtype; returns it."""
    items = list(tensors.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.dtype != first.dtype:
            raise TypeError(
                f"{name} has dtype {t.dtype} but {first_name} has {first.dtype}; "
                "mixed dtypes are not supported"
            )
    return first.dtype


def check_dim_size(name: str, t: Tensor, dim: int, expected: int, what: str) -> None:
    """Checks ``t.shape[dim] == expected``; ``what`` says where ``expected`` comes from."""
    if t.shape[dim] != expected:
        raise ValueError(
            f"{name}.shape[{dim}] must equal {what} ({expected}), got shape {tuple(t.shape)}"
        )


def check_index_range(name: str, index: Tensor, upper: int, *, allowed: int | None = None) -> None:
    """Checks ``0 <= index < upper`` (``allowed`` is a sentinel such as ignore_index).

    Reading the tensor's values synchronises with the device; callers on the GPU do this
    check in the kernel instead and report through ``report_bad_index``.
    """
    if index.numel() == 0:
        return
    bad = (index < 0) | (index >= upper)
    if allowed is not None:
        bad &= index != allowed
    if bool(bad.any()):
        position = int(bad.reshape(-1).nonzero()[0, 0])
        report_bad_index(name, index, position, upper)


def report_bad_index(name: str, index: Tensor, flat_position: int, upper: int) -> None:
    """Raises the error for an out-of-range entry at ``flat_position`` of ``index``."""
    value = int(index.reshape(-1)[flat_position])
    where = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat_position), index.shape))
    raise IndexError(
        f"{name}[{', '.join(map(str, where))}] = {value} is outside the valid range [0, {upper})"
    )

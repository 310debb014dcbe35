"""Helpers shared by the rms_norm / rope / silu_mul reference tests."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from batchinv.contract import assert_bitwise_equal

LOW_PRECISION = (torch.bfloat16, torch.float16)
ALL_FLOAT = (torch.float32, torch.bfloat16, torch.float16)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, seed: int, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> Tensor:
    return (torch.randn(*shape, generator=generator(seed)) * scale).to(dtype)


def snapshot(*tensors: Tensor) -> list[Tensor]:
    """Detached copies, to check later that the op did not write into its inputs."""
    return [t.detach().clone() for t in tensors]


def assert_unchanged(before: Sequence[Tensor], after: Sequence[Tensor]) -> None:
    for i, (old, new) in enumerate(zip(before, after, strict=True)):
        assert_bitwise_equal(new.detach(), old, name=f"input {i} after the call")


def leaves(*tensors: Tensor, dtype: torch.dtype | None = None) -> list[Tensor]:
    """Fresh leaf copies that require grad, optionally cast (e.g. to fp32 or fp64)."""
    return [t.detach().to(dtype or t.dtype).clone().requires_grad_(True) for t in tensors]


def grads_with_cotangent(
    fn: Callable[..., Tensor | tuple[Tensor, ...]],
    inputs: Sequence[Tensor],
    cotangents: Tensor | Sequence[Tensor],
) -> tuple[Tensor, ...]:
    """Gradients of ``sum(fn(*inputs) * cotangent)`` w.r.t. ``inputs``, via autograd.

    ``inputs`` must be leaves that require grad; cotangents are cast to the outputs' dtypes.
    """
    outputs = fn(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    cotangents = (cotangents,) if isinstance(cotangents, Tensor) else tuple(cotangents)
    cotangents = tuple(c.to(o.dtype) for c, o in zip(cotangents, outputs, strict=True))
    return torch.autograd.grad(outputs, list(inputs), cotangents)

"""Helpers shared by the linear / log_softmax / token_logprobs reference tests."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from batchinv.contract import assert_bitwise_equal

LOW_PRECISION = (torch.bfloat16, torch.float16)
ALL_FLOAT = (torch.float32, torch.bfloat16, torch.float16)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, seed: int, scale: float = 1.0, dtype=torch.float32) -> Tensor:
    return (torch.randn(*shape, generator=generator(seed)) * scale).to(dtype)


def snapshot(*tensors: Tensor | None) -> list[Tensor | None]:
    """Detached copies, to check later that the op did not write into its inputs."""
    return [t.detach().clone() if t is not None else None for t in tensors]


def assert_unchanged(before: Sequence[Tensor | None], after: Sequence[Tensor | None]) -> None:
    for i, (old, new) in enumerate(zip(before, after, strict=True)):
        if old is not None:
            assert_bitwise_equal(new.detach(), old, name=f"input {i} after the call")


def grads_of(output, cotangents, inputs: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """``torch.autograd.grad`` of ``sum(output * cotangent)`` with respect to ``inputs``."""
    outputs = output if isinstance(output, tuple) else (output,)
    cotangents = cotangents if isinstance(cotangents, tuple) else (cotangents,)
    return torch.autograd.grad(outputs, inputs, cotangents)


class LargestTensorRecorder(TorchDispatchMode):
    """Records the largest number of elements of any tensor an aten op returns.

    Runs under forward and under backward (autograd's engine dispatches through the mode
    on this thread), so it sees every intermediate the reference creates.
    """

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.largest_op = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, Tensor) and leaf.numel() > self.largest:
                self.largest = leaf.numel()
                self.largest_op = str(func)
        return out


def scalar_lse_definition(row: Tensor, chunk: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(m, l, s)`` of one fp32 row, re-done one 0-d fp32 scalar at a time from the docs.

    Chunk state: ``m_c = max + 0``, ``l_c = sum exp(z - m_c)``, ``s_c = sum exp(z - m_c) *
    (z - m_c)`` left to right; merge ``m = max(m_a, m_b)``, ``l = l_a*exp(m_a - m) +
    l_b*exp(m_b - m)``, ``s = exp(m_a - m)*(s_a + (m_a - m)*l_a) + (same for b)``.
    Only for finite rows (the -inf guards are tested separately).
    """
    values = [row[j].float() for j in range(row.shape[0])]
    state = None
    for start in range(0, len(values), chunk):
        part = values[start : start + chunk]
        m_c = part[0]
        for v in part[1:]:
            m_c = torch.maximum(m_c, v)
        m_c = m_c + 0.0
        l_c = torch.zeros((), dtype=torch.float32)
        s_c = torch.zeros((), dtype=torch.float32)
        for v in part:
            shifted = v - m_c
            weight = torch.exp(shifted)
            l_c = l_c + weight
            s_c = s_c + weight * shifted
        if state is None:
            state = (m_c, l_c, s_c)
            continue
        m_a, l_a, s_a = state
        m = torch.maximum(m_a, m_c)
        scale_a, scale_b = torch.exp(m_a - m), torch.exp(m_c - m)
        state = (
            m,
            l_a * scale_a + l_c * scale_b,
            scale_a * (s_a + (m_a - m) * l_a) + scale_b * (s_c + (m_c - m) * l_c),
        )
    return state

"""Reductions whose order is fixed by construction, for the CPU references.

BLAS and torch's reduction kernels choose their blocking from the shape, so a row's
result can change with the number of rows.  The helpers here only use elementwise
tensor ops inside a Python loop over the reduced dimension, so every output element
is accumulated left to right, one rounding per step, whatever else is in the batch.
They are slow by design and meant for the reference paths and small test shapes.
"""

from __future__ import annotations

import torch
from torch import Tensor


def fixed_order_matmul(a: Tensor, b: Tensor, *, k_chunk: int = 1) -> Tensor:
    """``a @ b`` for ``a: [..., M, K]`` and ``b: [..., K, N]``, reduced over K in order.

    Computes in the common dtype of ``a`` and ``b`` (callers upcast first).  For
    ``k_chunk == 1`` each step is ``acc = acc + a[..., :, k] * b[..., k, :]``: a product
    rounded to the dtype, then a sum rounded to the dtype, for k = 0, 1, ..., K-1.
    Larger ``k_chunk`` values are not offered: a chunk would hide a shape-dependent
    reduction inside torch.
    """
    if k_chunk != 1:
        raise ValueError("k_chunk must be 1: larger chunks reduce through torch's own order")
    if a.dtype != b.dtype:
        raise TypeError(f"a and b must share a dtype, got {a.dtype} and {b.dtype}")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"inner dimensions differ: a {tuple(a.shape)}, b {tuple(b.shape)}")
    k_dim = a.shape[-1]
    out_shape = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
    acc = torch.zeros(out_shape, dtype=a.dtype, device=a.device)
    for k in range(k_dim):
        acc = acc + a[..., :, k : k + 1] * b[..., k : k + 1, :]
    return acc


def fixed_order_sum(x: Tensor, dim: int = -1) -> Tensor:
    """Sum over ``dim`` left to right, one rounding per step, in ``x``'s dtype."""
    x = x.movedim(dim, -1)
    acc = torch.zeros(x.shape[:-1], dtype=x.dtype, device=x.device)
    for k in range(x.shape[-1]):
        acc = acc + x[..., k]
    return acc

"""Large-M row invariance of ``batchinv.linear`` on one GPU path, forward and grad_x: shared by
tests/gpu/test_linear_cuda.py (batchinv's kernels) and tests/gpu/test_linear_cublaslt_cuda.py
(the pinned cuBLASLt path), which the sanitizer session treats differently."""

from __future__ import annotations

import contextlib
import os

import torch

import batchinv
from batchinv.contract import assert_bitwise_equal
from batchinv.gpu import linear as gpu_linear
from batchinv.gpu import linear_cublaslt
from batchinv.shapes import LINEAR_LARGE_M, LINEAR_LARGE_M_ROWS, QWEN3_8B_LINEAR

QUICK = os.environ.get("BATCHINV_QUICK") == "1"
# Under BATCHINV_QUICK (the sanitizer's runs) one shape and the two smallest batches, which
# still reach the pinned path's threshold.
LARGE_M = (linear_cublaslt.MIN_ROWS, linear_cublaslt.MIN_ROWS + 3) if QUICK else LINEAR_LARGE_M
LARGE_M_SHAPES = QWEN3_8B_LINEAR[1:2] if QUICK else QWEN3_8B_LINEAR
LARGE_M_DTYPES = (torch.bfloat16,) if QUICK else (torch.bfloat16, torch.float16)
_GRAD_X_ONLY = (True, False, False)


@contextlib.contextmanager
def linear_path(path: str):
    """``batchinv.set_linear_path(path)`` for the block, then the setting from before."""
    previous = linear_cublaslt._chosen
    batchinv.set_linear_path(path)
    try:
        yield
    finally:
        batchinv.set_linear_path(previous)


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    out = torch.randn(*shape, device="cuda", generator=gen, dtype=dtype)
    return out.mul_(scale) if scale != 1.0 else out


def forward_rows_match_rows_alone(shape, dtype: torch.dtype, path: str) -> None:
    """Every batch of ``LARGE_M`` on ``path``: the chosen rows are bitwise the rows computed
    alone (batchinv's small-M kernel).  On the pinned path the largest batch is also compared
    whole with batchinv's kernels."""
    name, k, n = shape
    m_max = max(LARGE_M)
    x = _randn(m_max, k, dtype=dtype, seed=11)
    w = _randn(n, k, dtype=dtype, seed=12, scale=k**-0.5)
    rows = [i for i in LINEAR_LARGE_M_ROWS if i < m_max]
    alone = {i: batchinv.linear(x[i : i + 1], w) for i in rows}
    out = None
    with linear_path(path):
        for m in LARGE_M:
            assert batchinv.linear_path(x[:m], w) == path, f"{name} M={m} did not take {path}"
            out = batchinv.linear(x[:m], w)
            for i in rows:
                if i < m:
                    assert_bitwise_equal(
                        out[i : i + 1], alone[i], name=f"{name} {path} row {i} of M={m}"
                    )
            if m != m_max:
                del out
    if path != "own":
        with linear_path("own"):
            assert_bitwise_equal(
                out, batchinv.linear(x, w), name=f"{name} M={m_max}, {path} vs own"
            )


def grad_x_rows_match_rows_alone(shape, dtype: torch.dtype, path: str) -> None:
    """The same for grad_x (the registry's backward, which autograd calls)."""
    name, k, n = shape
    m_max = max(LARGE_M)
    w = _randn(n, k, dtype=dtype, seed=13, scale=k**-0.5)
    grad = _randn(m_max, n, dtype=dtype, seed=14)
    x_shape_only = torch.empty(m_max, k, device="cuda", dtype=dtype)
    rows = [i for i in LINEAR_LARGE_M_ROWS if i < m_max]

    def grad_x(m_slice: slice) -> torch.Tensor:
        return gpu_linear.backward(grad[m_slice], x_shape_only[m_slice], w, None, _GRAD_X_ONLY)[0]

    alone = {i: grad_x(slice(i, i + 1)) for i in rows}
    weight_t = gpu_linear._pad_columns(w.t().contiguous())  # the product grad_x runs
    out = None
    with linear_path(path):
        for m in LARGE_M:
            assert gpu_linear.rows_path(m, weight_t, False) == path, f"{name} grad_x M={m}"
            out = grad_x(slice(0, m))
            for i in rows:
                if i < m:
                    assert_bitwise_equal(
                        out[i : i + 1], alone[i], name=f"{name} {path} grad_x row {i} of M={m}"
                    )
            if m != m_max:
                del out
    if path != "own":
        with linear_path("own"):
            whole = grad_x(slice(0, m_max))
        assert_bitwise_equal(out, whole, name=f"{name} grad_x M={m_max}, {path} vs own")

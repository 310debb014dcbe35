"""The pinned cuBLASLt path of ``batchinv.linear`` (batches of ``MIN_ROWS`` rows or more on
sm_90): it must serve the Qwen3-8B shapes on the cards it was studied on (H100/H200) and give
exactly the bits of batchinv's own kernels, so a row alone (batchinv's kernel) equals the same
row inside a large batch (cuBLASLt), forward and grad_x."""

from __future__ import annotations

import pytest
import torch

import batchinv
from batchinv.contract import assert_bitwise_equal
from batchinv.gpu import linear as gpu_linear
from batchinv.gpu import linear_cublaslt
from batchinv.shapes import QWEN3_8B_LINEAR

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
DTYPES = (torch.bfloat16, torch.float16)


def _hopper() -> bool:
    return torch.cuda.is_available() and gpu_linear.uses_hopper(torch.device(DEVICE))


def _data(m: int, k: int, n: int, dtype: torch.dtype, seed: int = 3):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(m, k, device=DEVICE, generator=gen).to(dtype)
    w = (torch.randn(n, k, device=DEVICE, generator=gen) / k**0.5).to(dtype)
    return x, w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", QWEN3_8B_LINEAR, ids=[s[0] for s in QWEN3_8B_LINEAR])
def test_pinned_path_serves_and_equals_batchinv_kernels(shape, dtype):
    if not _hopper():
        pytest.skip("the pinned cuBLASLt path exists on sm_90 only")
    _, k, n = shape
    m = linear_cublaslt.MIN_ROWS + 3  # odd, above the threshold
    x, w = _data(m, k, n, dtype)
    out = torch.empty(m, n, dtype=dtype, device=DEVICE)
    assert linear_cublaslt.serves(x, w, None, out, gpu_linear.matmul_nt), (
        "pinned path refused a Qwen3-8B shape"
    )
    pinned = linear_cublaslt.matmul_nt(x, w, out)
    ours = gpu_linear.matmul_nt(x, w, family="hopper")
    assert_bitwise_equal(pinned, ours, name=f"{shape[0]} pinned cuBLASLt vs batchinv kernel")
    # The public op at this M takes the pinned path; rows alone take batchinv's kernel.
    batch = batchinv.linear(x, w)
    assert_bitwise_equal(batch, ours, name="batchinv.linear at M >= MIN_ROWS")
    for i in (0, m // 2, m - 1):
        assert_bitwise_equal(batchinv.linear(x[i : i + 1], w), batch[i : i + 1], name=f"row {i}")


def test_grad_x_rows_alone_equal_rows_in_a_large_batch():
    if not _hopper():
        pytest.skip("the pinned cuBLASLt path exists on sm_90 only")
    _, k, n = QWEN3_8B_LINEAR[3]  # down_proj: grad_x reduces over 4096, returns 12288 columns
    m = 2 * linear_cublaslt.MIN_ROWS
    x, w = _data(m, k, n, torch.bfloat16, seed=9)
    grad_y = _data(m, n, 8, torch.bfloat16, seed=10)[0]

    def grad_x(rows, cotangent):
        leaf = rows.clone().requires_grad_(True)
        batchinv.linear(leaf, w).backward(cotangent)
        return leaf.grad

    full = grad_x(x, grad_y)
    for i in (0, 1000, m - 1):
        alone = grad_x(x[i : i + 1], grad_y[i : i + 1])
        assert_bitwise_equal(alone, full[i : i + 1], name=f"grad_x row {i}")


def test_switch_bias_and_small_batches_stay_on_batchinv_kernels(monkeypatch):
    if not _hopper():
        pytest.skip("the pinned cuBLASLt path exists on sm_90 only")
    x, w = _data(linear_cublaslt.MIN_ROWS, 4096, 4096, torch.bfloat16)
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=DEVICE)
    bias = torch.zeros(4096, dtype=x.dtype, device=DEVICE)
    assert linear_cublaslt.serves(x, w, None, out, gpu_linear.matmul_nt)
    assert not linear_cublaslt.serves(x, w, bias, out, gpu_linear.matmul_nt)
    assert not linear_cublaslt.serves(x[:-1], w, None, out[:-1], gpu_linear.matmul_nt)
    monkeypatch.setenv("BATCHINV_LINEAR_CUBLASLT", "0")
    assert not linear_cublaslt.serves(x, w, None, out, gpu_linear.matmul_nt)

"""The pinned cuBLASLt path of ``batchinv.linear`` (bias-free batches of ``MIN_ROWS`` rows or more
on sm_90) and its switch: on the H200 and cuBLAS build measured it serves the fp16 Qwen3-8B
shapes and gives exactly the bits of batchinv's own kernels, so a row alone (batchinv's kernel)
equals the same row inside a large batch (cuBLASLt), forward and grad_x, up to 32768 rows.  It
refuses bf16: cuBLASLt writes a bf16 NaN as 0x7fff where batchinv's kernels write PyTorch's
0x7fc0, which the self-check's NaN rows catch.  When its self-check fails or it is unavailable,
``"auto"`` keeps a shape on batchinv's kernels (bits consistent within the process) and
``"cublaslt"`` raises.

compute-sanitizer's racecheck cannot follow cuBLASLt's kernel (reports/sanitize/), so every test
that runs it lives in this file, which the sanitize session runs under memcheck only."""

from __future__ import annotations

import pytest
import torch

import batchinv
from _linear_rows import (
    LARGE_M,
    LARGE_M_SHAPES,
    forward_rows_match_rows_alone,
    grad_x_rows_match_rows_alone,
    linear_path,
)
from batchinv.contract import assert_bitwise_equal
from batchinv.gpu import linear as gpu_linear
from batchinv.gpu import linear_cublaslt
from batchinv.shapes import QWEN3_8B_LINEAR

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
# The dtypes the pinned algorithm serves on the cards measured (bf16: see the module docstring).
SERVED_DTYPES = (torch.float16,)
PINNED_LARGE_M_DTYPES = SERVED_DTYPES


@pytest.fixture(autouse=True)
def needs_hopper():
    if not gpu_linear.uses_hopper(torch.device(DEVICE)):
        pytest.skip("the pinned cuBLASLt path exists on sm_90 only")


@pytest.fixture
def fresh_checks(monkeypatch):
    """No shape checked or refused yet, so the self-check runs again in this test."""
    monkeypatch.setattr(linear_cublaslt, "_CHECKED", {})
    monkeypatch.setattr(linear_cublaslt, "_REFUSED", {})


def _data(m: int, k: int, n: int, dtype: torch.dtype, seed: int = 3):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(m, k, device=DEVICE, generator=gen).to(dtype)
    w = (torch.randn(n, k, device=DEVICE, generator=gen) / k**0.5).to(dtype)
    return x, w


@pytest.mark.parametrize("dtype", SERVED_DTYPES, ids=str)
@pytest.mark.parametrize("shape", QWEN3_8B_LINEAR, ids=[s[0] for s in QWEN3_8B_LINEAR])
def test_pinned_path_serves_and_equals_batchinv_kernels(shape, dtype):
    _, k, n = shape
    m = linear_cublaslt.MIN_ROWS + 3  # odd, above the threshold
    x, w = _data(m, k, n, dtype)
    with linear_path("auto"):
        assert batchinv.linear_path(x, w) == "cublaslt", (
            f"pinned path refused a Qwen3-8B shape: {linear_cublaslt.refusals()}"
        )
        batch = batchinv.linear(x, w)
    out = torch.empty(m, n, dtype=dtype, device=DEVICE)
    pinned = linear_cublaslt.matmul_nt(x, w, out)
    ours = gpu_linear.matmul_nt(x, w, family="hopper")
    assert_bitwise_equal(pinned, ours, name=f"{shape[0]} pinned cuBLASLt vs batchinv kernel")
    # The public op at this M takes the pinned path; rows alone take batchinv's kernel.
    assert_bitwise_equal(batch, ours, name="batchinv.linear at M >= MIN_ROWS")
    for i in (0, m // 2, m - 1):
        assert_bitwise_equal(batchinv.linear(x[i : i + 1], w), batch[i : i + 1], name=f"row {i}")


@pytest.mark.parametrize("dtype", PINNED_LARGE_M_DTYPES, ids=str)
@pytest.mark.parametrize("shape", LARGE_M_SHAPES, ids=[s[0] for s in LARGE_M_SHAPES])
def test_large_m_forward_rows_on_the_pinned_path(shape, dtype):
    """Up to 32768 rows with ``set_linear_path("cublaslt")`` (which raises rather than fall
    back); the largest batch also equals batchinv's kernels whole."""
    forward_rows_match_rows_alone(shape, dtype, "cublaslt")


@pytest.mark.parametrize("dtype", PINNED_LARGE_M_DTYPES, ids=str)
@pytest.mark.parametrize("shape", LARGE_M_SHAPES, ids=[s[0] for s in LARGE_M_SHAPES])
def test_large_m_grad_x_rows_on_the_pinned_path(shape, dtype):
    grad_x_rows_match_rows_alone(shape, dtype, "cublaslt")


def test_grad_x_rows_alone_equal_rows_in_a_large_batch():
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


def test_bias_small_batches_and_own_stay_on_batchinv_kernels():
    x, w = _data(linear_cublaslt.MIN_ROWS, 4096, 4096, torch.float16)
    bias = torch.zeros(4096, dtype=x.dtype, device=DEVICE)
    with linear_path("cublaslt"):
        assert batchinv.linear_path(x, w) == "cublaslt"
        assert batchinv.linear_path(x, w, bias) == "own"
        assert batchinv.linear_path(x[:-1], w) == "own"
    with linear_path("own"):
        assert batchinv.linear_path(x, w) == "own"
    assert gpu_linear.describe(x.shape[0], 4096, "cublaslt", x.device).startswith(
        "cublaslt: cuBLASLt algo 66 tile 24"
    )
    assert gpu_linear.describe(x.shape[0], 4096, "own", x.device).startswith("own: hopper bm")


def _rows_stay_consistent(x: torch.Tensor, w: torch.Tensor) -> None:
    """Under the current setting every batch of ``LARGE_M`` (capped at x's rows) takes
    batchinv's kernels and its rows equal the rows alone; the whole equals the "own" path."""
    alone = {i: batchinv.linear(x[i : i + 1], w) for i in (0, 5, x.shape[0] - 1)}
    for m in [m for m in LARGE_M if m <= x.shape[0]] + [x.shape[0]]:
        assert batchinv.linear_path(x[:m], w) == "own"
        out = batchinv.linear(x[:m], w)
        for i, expected in alone.items():
            if i < m:
                assert_bitwise_equal(out[i : i + 1], expected, name=f"row {i} of M={m}")
    with linear_path("own"):
        assert_bitwise_equal(out, batchinv.linear(x, w), name="auto after a refusal vs own")


def test_a_failing_self_check_keeps_the_shape_on_batchinv_kernels(monkeypatch, fresh_checks):
    """A pinned algorithm whose bits differ in one element of one probe (injected into the
    real self-check): "auto" warns, records, and serves the shape with batchinv's kernels for
    every M from then on; "cublaslt" raises."""
    real_run = linear_cublaslt._run

    def off_by_one_bit(x, weight, out, plan):
        real_run(x, weight, out, plan)
        if x.shape[0] == linear_cublaslt.PROBE_ROWS[-1]:
            out.view(torch.int16)[-1, 0] ^= 1
        return out

    monkeypatch.setattr(linear_cublaslt, "_run", off_by_one_bit)
    x, w = _data(max(LARGE_M[:2]) + 2000, 4096, 4096, torch.float16, seed=21)
    with linear_path("cublaslt"):
        with pytest.raises(RuntimeError, match="differ from batchinv's kernels in 1 of"):
            batchinv.linear(x, w)
    with linear_path("auto"):
        with pytest.warns(RuntimeWarning, match="differ from batchinv's kernels"):
            assert batchinv.linear_path(x, w) == "own"
        _rows_stay_consistent(x, w)
    ((key, reason),) = linear_cublaslt.refusals().items()
    assert key[1:] == (4096, 4096, torch.float16) and "self-check probe" in reason


@pytest.mark.parametrize("missing", ("library", "algo_check"))
def test_an_unavailable_algorithm(monkeypatch, fresh_checks, missing):
    if missing == "library":
        monkeypatch.setattr(
            linear_cublaslt, "_library_error", lambda index: "libcublasLt is not usable (test)"
        )
        message = "libcublasLt is not usable"
    else:
        monkeypatch.setattr(linear_cublaslt, "_plan", lambda *args: None)
        message = "cublasLtMatmulAlgoCheck refuses"
    x, w = _data(linear_cublaslt.MIN_ROWS + 1000, 4096, 6144, torch.float16, seed=22)
    with linear_path("cublaslt"):
        with pytest.raises(RuntimeError, match=message):
            batchinv.linear(x, w)
    with linear_path("auto"):
        with pytest.warns(RuntimeWarning, match=message):
            assert batchinv.linear_path(x, w) == "own"
        _rows_stay_consistent(x, w)


def test_bf16_is_refused_for_its_nan_bits_and_served_by_batchinv_kernels(fresh_checks):
    """On the cards measured cuBLASLt rounds a NaN to bf16 0x7fff, batchinv's kernels to 0x7fc0:
    a NaN row would change bits with the batch size, so "auto" serves bf16 with batchinv's
    kernels at every M and "cublaslt" raises naming the two patterns.  Should a cuBLAS build
    write 0x7fc0, this test fails and SERVED_DTYPES can take bf16 again."""
    x, w = _data(linear_cublaslt.MIN_ROWS + 3, 4096, 4096, torch.bfloat16, seed=23)
    with linear_path("cublaslt"):
        with pytest.raises(RuntimeError, match="batchinv 0x7fc0, cuBLASLt 0x7fff"):
            batchinv.linear(x, w)
    with linear_path("auto"):
        assert batchinv.linear_path(x, w) == "own"
        _rows_stay_consistent(x, w)

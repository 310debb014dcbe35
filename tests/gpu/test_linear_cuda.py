"""The CUDA linear: bitwise M-invariance at every Qwen3-8B shape, forward and grad_x;
identical bits across tile configurations and instruction families; accuracy against the
strict reference; deterministic weight gradients; bad input."""

from __future__ import annotations

import os

import pytest
import torch

import batchinv
from _linear_rows import (
    LARGE_M_DTYPES,
    LARGE_M_SHAPES,
    forward_rows_match_rows_alone,
    grad_x_rows_match_rows_alone,
)
from batchinv.contract import assert_bitwise_equal, assert_within_tolerance
from batchinv.gpu import linear as gpu_linear
from batchinv.reference.linear import linear_backward, linear_fp32
from batchinv.shapes import LINEAR_M_SWEEP, QWEN3_8B_LINEAR

pytestmark = pytest.mark.cuda

QUICK = os.environ.get("BATCHINV_QUICK") == "1"
SHAPES = QWEN3_8B_LINEAR[:2] if QUICK else QWEN3_8B_LINEAR
M_SWEEP = (1, 3, 65, 257) if QUICK else LINEAR_M_SWEEP
DTYPES = (torch.bfloat16,) if QUICK else (torch.bfloat16, torch.float16)
PROBE_ROWS = (0, 1, 2, 16, 64, 256, 1023, 4095, 8190)


def _inputs(m, k, n, dtype, seed=0, scale=1.0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(m, k, device="cuda", generator=gen) * scale).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(dtype)
    return x, w


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name, k, n", SHAPES, ids=[s[0] for s in SHAPES])
def test_forward_row_is_bitwise_the_same_for_every_m(name, k, n, dtype):
    x, w = _inputs(max(M_SWEEP), k, n, dtype)
    alone = {i: batchinv.linear(x[i : i + 1], w) for i in PROBE_ROWS if i < x.shape[0]}
    for m in M_SWEEP:
        out = batchinv.linear(x[:m], w)
        for i, expected in alone.items():
            if i < m:
                assert_bitwise_equal(out[i : i + 1], expected, name=f"{name} row {i} of M={m}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name, k, n", SHAPES, ids=[s[0] for s in SHAPES])
def test_grad_x_row_is_bitwise_the_same_for_every_m(name, k, n, dtype):
    m_max = max(M_SWEEP)
    _, w = _inputs(1, k, n, dtype)
    gen = torch.Generator(device="cuda").manual_seed(1)
    grad = torch.randn(m_max, n, device="cuda", generator=gen).to(dtype)
    x_dummy = torch.empty(m_max, k, device="cuda", dtype=dtype)
    needs = (True, False, False)
    alone = {
        i: gpu_linear.backward(grad[i : i + 1], x_dummy[i : i + 1], w, None, needs)[0]
        for i in PROBE_ROWS
        if i < m_max
    }
    for m in M_SWEEP:
        grad_x = gpu_linear.backward(grad[:m], x_dummy[:m], w, None, needs)[0]
        for i, expected in alone.items():
            if i < m:
                assert_bitwise_equal(
                    grad_x[i : i + 1], expected, name=f"{name} grad_x row {i} of M={m}"
                )


@pytest.mark.parametrize("dtype", LARGE_M_DTYPES, ids=str)
@pytest.mark.parametrize("shape", LARGE_M_SHAPES, ids=[s[0] for s in LARGE_M_SHAPES])
def test_large_m_forward_rows_on_own_kernels(shape, dtype):
    """Up to 32768 rows (trainer recompute batches) on batchinv's kernels alone
    (``set_linear_path("own")``); the pinned path's twin is in test_linear_cublaslt_cuda.py."""
    forward_rows_match_rows_alone(shape, dtype, "own")


@pytest.mark.parametrize("dtype", LARGE_M_DTYPES, ids=str)
@pytest.mark.parametrize("shape", LARGE_M_SHAPES, ids=[s[0] for s in LARGE_M_SHAPES])
def test_large_m_grad_x_rows_on_own_kernels(shape, dtype):
    grad_x_rows_match_rows_alone(shape, dtype, "own")


@pytest.mark.parametrize("scale", (1.0, 2.0**40), ids=("unit", "wide-exponent"))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_every_tile_config_and_instruction_family_gives_the_same_bits(dtype, scale):
    if not gpu_linear.uses_hopper(torch.device("cuda")):
        pytest.skip("compares Hopper tile configurations; this GPU has none")
    if dtype == torch.float16 and scale > 1:
        scale = 2.0**4  # fp16 overflows above 65504
    x, w = _inputs(200, 4096, 1000, dtype, seed=3, scale=scale)
    results = {}
    for config in gpu_linear.hopper_configs():
        results[f"hopper {config}"] = gpu_linear.matmul_nt(x, w, family="hopper", config=config)
    for config in gpu_linear.small_m_configs():
        results[str(config)] = gpu_linear.matmul_nt(x, w, family="small_m", config=config)
    results["mma.sync"] = gpu_linear.matmul_nt(x, w, family="mma")
    first_name, first = next(iter(results.items()))
    for name, out in results.items():
        assert_bitwise_equal(out, first, name=f"{name} vs {first_name}")
    for rows in (1, 5, 64):  # few rows through the same families
        for family in ("hopper", "small_m", "mma"):
            out = gpu_linear.matmul_nt(x[:rows], w, family=family)
            assert_bitwise_equal(out, first[:rows], name=f"{family} M={rows} vs {first_name}")


# The tile of the largest batches batchinv's own kernels serve; the small-M kernel is pinned
# against it explicitly (decode rows must equal the same rows computed in a prefill).
BIG_M_TILE = gpu_linear.TileConfig(128, 256, 64, 4)


def _require_small_m_kernels():
    if not gpu_linear.uses_hopper(torch.device("cuda")):
        pytest.skip("the small-M kernel is built for sm_90a only; this GPU has none")
    if not gpu_linear.small_m_configs():
        pytest.fail("this build has no linear_small_m_* kernels")


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("name, k, n", QWEN3_8B_LINEAR, ids=[s[0] for s in QWEN3_8B_LINEAR])
def test_small_m_kernel_gives_the_big_m_tile_bits_at_qwen3_shapes(name, k, n, dtype):
    _require_small_m_kernels()
    x, w = _inputs(17, k, n, dtype, seed=13)
    big = gpu_linear.matmul_nt(x, w, family="hopper", config=BIG_M_TILE)
    for config in gpu_linear.small_m_configs():
        for m in (1, 3, 8, 17):  # one partial, one full and three token tiles
            small = gpu_linear.matmul_nt(x[:m], w, family="small_m", config=config)
            assert_bitwise_equal(small, big[:m], name=f"{name} {config} M={m} vs {BIG_M_TILE}")
    auto = batchinv.linear(x[:1], w)  # what decode runs
    assert_bitwise_equal(auto, big[:1], name=f"{name} batchinv.linear M=1 vs {BIG_M_TILE}")


@pytest.mark.parametrize("m, k, n", [(1, 8, 1), (3, 72, 1000), (5, 4104, 33), (9, 200, 40)])
def test_small_m_kernel_matches_the_big_m_tile_on_odd_shapes_with_bias(m, k, n):
    # K not a multiple of 64 (a partial last box), N not a multiple of 16, bias added.
    _require_small_m_kernels()
    x, w = _inputs(m, k, n, torch.bfloat16, seed=14)
    bias = torch.randn(n, device="cuda").bfloat16()
    big = gpu_linear.matmul_nt(x, w, bias, family="hopper", config=BIG_M_TILE)
    for config in gpu_linear.small_m_configs():
        small = gpu_linear.matmul_nt(x, w, bias, family="small_m", config=config)
        assert_bitwise_equal(small, big, name=f"{m}x{k}x{n} {config} vs {BIG_M_TILE}")


def test_family_and_config_mismatch_is_a_clear_error():
    if not gpu_linear.uses_hopper(torch.device("cuda")):
        pytest.skip("the Hopper families exist on sm_90 only")
    x, w = _inputs(2, 64, 32, torch.bfloat16)
    with pytest.raises(TypeError, match="family 'small_m' takes a SmallMConfig"):
        gpu_linear.matmul_nt(x, w, family="small_m", config=BIG_M_TILE)
    with pytest.raises(TypeError, match="family 'hopper' takes a TileConfig"):
        gpu_linear.matmul_nt(x, w, family="hopper", config=gpu_linear.SmallMConfig(16, 128, 8))


@pytest.mark.parametrize(
    "m, k, n", [(1, 8, 1), (3, 24, 7), (65, 72, 1000), (130, 4104, 33), (257, 4096, 4097)]
)
@pytest.mark.parametrize("with_bias", (False, True))
def test_odd_shapes_match_the_strict_reference(m, k, n, with_bias):
    x, w = _inputs(m, k, n, torch.bfloat16, seed=5)
    gen = torch.Generator(device="cuda").manual_seed(7)  # not the global RNG: other tests move it
    bias = torch.randn(n, device="cuda", generator=gen).bfloat16() if with_bias else None
    out = batchinv.linear(x, w, bias)
    reference = linear_fp32(x, w, bias)  # strict fp32, fixed order (runs on the GPU tensors)
    assert_within_tolerance(out, reference, op_class="reduction", name=f"linear {m}x{k}x{n}")


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("name, k, n", QWEN3_8B_LINEAR[:4], ids=[s[0] for s in QWEN3_8B_LINEAR[:4]])
def test_qwen3_shapes_match_the_strict_reference(name, k, n, dtype):
    x, w = _inputs(5, k, n, dtype, seed=6)
    assert_within_tolerance(
        batchinv.linear(x, w), linear_fp32(x, w), op_class="reduction", name=name
    )


def test_gradients_match_the_reference_and_repeat_bitwise():
    m, k, n = 300, 256, 136
    x, w = _inputs(m, k, n, torch.bfloat16, seed=7)
    bias = torch.randn(n, device="cuda").bfloat16()
    grad = torch.randn(m, n, device="cuda").bfloat16()
    runs = []
    for _ in range(2):
        xg, wg, bg = (t.detach().clone().requires_grad_(True) for t in (x, w, bias))
        batchinv.linear(xg, wg, bg).backward(grad)
        runs.append((xg.grad, wg.grad, bg.grad))
    for a, b in zip(runs[0], runs[1], strict=True):
        assert_bitwise_equal(a, b)
    expected = linear_backward(grad.float(), x.float(), w.float(), torch.float32)
    for got, want, what in zip(
        runs[0], expected, ("grad_x", "grad_weight", "grad_bias"), strict=True
    ):
        assert_within_tolerance(got, want, op_class="reduction", kind="grad", name=what)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name, k, n", SHAPES, ids=[s[0] for s in SHAPES])
def test_grad_weight_repeats_bitwise_at_qwen3_shapes(name, k, n, dtype):
    # 257 tokens: a partial 64-token tile, so the zeros read past the last token are part of
    # the check.
    x, w = _inputs(257, k, n, dtype, seed=9)
    gen = torch.Generator(device="cuda").manual_seed(10)
    grad = torch.randn(257, n, device="cuda", generator=gen).to(dtype)
    needs = (False, True, False)
    first = gpu_linear.backward(grad, x, w, None, needs)[1]
    second = gpu_linear.backward(grad, x, w, None, needs)[1]
    assert_bitwise_equal(second, first, name=f"{name} grad_weight, second run")
    wg = w.detach().clone().requires_grad_(True)
    batchinv.linear(x, wg).backward(grad)  # the public autograd path
    assert_bitwise_equal(wg.grad, first, name=f"{name} grad_weight through autograd")


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_grad_x_through_autograd_is_row_invariant(dtype):
    # The M sweep above calls the backward launcher; this checks the public autograd path
    # gives those bits too, for a row alone and inside batches.
    name, k, n = QWEN3_8B_LINEAR[1]
    x, w = _inputs(257, k, n, dtype, seed=11)
    gen = torch.Generator(device="cuda").manual_seed(12)
    grad = torch.randn(257, n, device="cuda", generator=gen).to(dtype)

    def grad_x(rows: slice) -> torch.Tensor:
        xg = x[rows].detach().clone().requires_grad_(True)
        batchinv.linear(xg, w).backward(grad[rows])
        return xg.grad

    launcher = gpu_linear.backward(grad, x, w, None, (True, False, False))[0]
    assert_bitwise_equal(grad_x(slice(0, 257)), launcher, name=f"{name} autograd vs launcher")
    for i in (0, 16, 256):
        alone = grad_x(slice(i, i + 1))
        for m in (17, 257):
            if i < m:
                batch = grad_x(slice(0, m))
                assert_bitwise_equal(batch[i : i + 1], alone, name=f"{name} row {i} of M={m}")


def test_weight_gradient_with_token_count_not_a_multiple_of_8():
    x, w = _inputs(13, 64, 24, torch.bfloat16, seed=8)
    grad = torch.randn(13, 24, device="cuda").bfloat16()
    _, grad_w, _ = gpu_linear.backward(grad, x, w, None, (False, True, False))
    expected = linear_backward(grad.float(), x.float(), w.float(), None, (False, True, False))[1]
    assert_within_tolerance(grad_w, expected, op_class="reduction", kind="grad")


def test_batched_input_keeps_its_leading_dims():
    x, w = _inputs(6, 64, 40, torch.bfloat16)
    out = batchinv.linear(x.reshape(2, 3, 64), w)
    assert out.shape == (2, 3, 40)
    assert_bitwise_equal(out.reshape(6, 40), batchinv.linear(x, w))


@pytest.mark.parametrize(
    "make, error, message",
    [
        (
            lambda: (
                torch.randn(2, 8, device="cuda").bfloat16(),
                torch.randn(4, 8, device="cuda").half(),
            ),
            TypeError,
            "mixed dtypes",
        ),
        (
            lambda: (
                torch.randn(2, 8, device="cuda").bfloat16(),
                torch.randn(4, 16, device="cuda").bfloat16(),
            ),
            ValueError,
            r"x.shape\[-1\] must equal",
        ),
        (
            lambda: (
                torch.randn(2, 12, device="cuda").bfloat16(),
                torch.randn(4, 12, device="cuda").bfloat16(),
            ),
            ValueError,
            "in_features % 8 == 0",
        ),
        (
            lambda: (torch.randn(2, 8, device="cuda"), torch.randn(4, 8, device="cuda")),
            TypeError,
            "the GPU linear takes bf16 or fp16",
        ),
        (
            lambda: (
                torch.randn(2, 8, device="cuda").bfloat16(),
                torch.randn(8, 4, device="cuda").bfloat16().t(),
            ),
            ValueError,
            "weight must be contiguous",
        ),
        (
            lambda: (torch.randn(2, 8).bfloat16(), torch.randn(4, 8, device="cuda").bfloat16()),
            ValueError,
            "is on",
        ),
    ],
)
def test_bad_input_is_a_clear_error(make, error, message):
    x, w = make()
    with pytest.raises(error, match=message):
        batchinv.linear(x, w)


def test_inputs_are_not_mutated():
    x, w = _inputs(70, 64, 48, torch.bfloat16)
    before = (x.clone(), w.clone())
    batchinv.linear(x, w)
    assert_bitwise_equal(x, before[0])
    assert_bitwise_equal(w, before[1])


def test_misaligned_input_view_is_handled():
    x, w = _inputs(10, 72, 16, torch.bfloat16)
    storage = torch.empty(10 * 72 + 4, device="cuda", dtype=torch.bfloat16)
    view = storage[4:].view(10, 72)  # 8-byte aligned, not 16
    view.copy_(x)
    assert_bitwise_equal(batchinv.linear(view, w), batchinv.linear(x, w))

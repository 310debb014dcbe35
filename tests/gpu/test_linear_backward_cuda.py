"""The CUDA linear backward with its operands read in place (sm_90: ``matmul_nn`` for grad_x
and grad_bias, ``matmul_tn`` for grad_weight) against the copy-based products it replaced
(``backward(..., transposed_copies=True)``), bit for bit: every configuration, the Qwen3-8B
shapes up to 16384 tokens, odd shapes, special values and the shapes that keep the copies;
then the gradients' contract (docs/operators/linear.md): grad_x rows invariant to the batch
across the routes, grad_weight the same bits run to run and for every configuration that
serves the same token sequence."""

from __future__ import annotations

import os

import pytest
import torch

import batchinv
from _linear_rows import linear_path
from batchinv.contract import assert_bitwise_equal, assert_within_tolerance
from batchinv.gpu import linear as gpu_linear
from batchinv.reference.linear import linear_backward
from batchinv.shapes import QWEN3_8B_LINEAR

pytestmark = pytest.mark.cuda

QUICK = os.environ.get("BATCHINV_QUICK") == "1"
DTYPES = (torch.bfloat16,) if QUICK else (torch.bfloat16, torch.float16)
SHAPES = QWEN3_8B_LINEAR[1:2] if QUICK else QWEN3_8B_LINEAR
# Tokens of the Qwen3-8B comparisons: a partial 64-token tile, not a multiple of 8, and the
# benchmark's smaller batch.
QWEN_TOKENS = (257,) if QUICK else (257, 1000, 16384)
# (tokens, out_features, in_features): partial tiles along every dimension, K of one 8-wide
# chunk, tokens below one k16 step; out_features a multiple of 8 (else the copies serve).
ODD_SHAPES = [(1, 8, 8), (3, 40, 72), (17, 1000, 200), (65, 24, 4104), (203, 4104, 1000)]
# Shapes TMA cannot read in place: out_features % 8 != 0 (dY's rows).
COPY_SHAPES = [(13, 33, 64), (257, 1001, 4096), (70, 7, 24)]
ALL_GRADS = (True, True, True)
# The largest K-major tile, the one the forward's large batches run.
BIG_M_TILE = gpu_linear.TileConfig(128, 256, 64, 4)


@pytest.fixture(autouse=True)
def _require_hopper():
    if not gpu_linear.uses_hopper(torch.device("cuda")):
        pytest.skip("the in-place backward kernels are built for sm_90a only; this GPU has none")


def _randn(*shape, dtype, seed, scale=1.0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(dtype)


def _case(m, n, k, dtype, seed=0, scale=1.0):
    """``(grad_y [m, n], x [m, k], weight [n, k], bias [n])``."""
    grad = _randn(m, n, dtype=dtype, seed=seed, scale=scale)
    x = _randn(m, k, dtype=dtype, seed=seed + 1, scale=scale)
    w = _randn(n, k, dtype=dtype, seed=seed + 2, scale=k**-0.5)
    bias = _randn(n, dtype=dtype, seed=seed + 3)
    return grad, x, w, bias


def _both_routes(grad, x, w, bias_dtype, needs=ALL_GRADS):
    in_place = gpu_linear.backward(grad, x, w, bias_dtype, needs)
    copies = gpu_linear.backward(grad, x, w, bias_dtype, needs, transposed_copies=True)
    return in_place, copies


def _assert_routes_agree(in_place, copies, what):
    for got, expected, name in zip(
        in_place, copies, ("grad_x", "grad_weight", "grad_bias"), strict=True
    ):
        assert (got is None) == (expected is None), f"{what} {name}"
        if got is not None:
            assert_bitwise_equal(got, expected, name=f"{what} {name}: in place vs copies")


def test_the_build_has_every_transposed_kernel():
    expected = {
        gpu_linear.TransposedConfig(layout, block_m)
        for layout in ("tb", "tab")
        for block_m in gpu_linear.TRANSPOSED_BLOCK_M
    }
    assert set(gpu_linear.transposed_configs()) == expected


@pytest.mark.parametrize("scale", (1.0, 2.0**40), ids=("unit", "wide-exponent"))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_every_transposed_config_gives_the_k_major_kernels_bits(dtype, scale):
    if dtype == torch.float16 and scale > 1:
        scale = 2.0**4  # fp16 overflows above 65504
    tokens, n, k = 203, 1000, 4096
    grad, x, w, _ = _case(tokens, n, k, dtype, seed=3, scale=scale)
    # grad_x = dY · W: the K-major kernels on Wᵀ, every tile family of the forward.
    weight_t = w.t().contiguous()
    expected_x = gpu_linear.matmul_nt(grad, weight_t, family="hopper", config=BIG_M_TILE)
    assert_bitwise_equal(
        gpu_linear.matmul_nt(grad, weight_t, family="mma"), expected_x, name="mma.sync grad_x"
    )
    # grad_W = dYᵀ · X: the K-major kernels on token-major copies (tokens padded to 208).
    grad_t, x_t = gpu_linear._token_major(grad), gpu_linear._token_major(x)
    expected_w = gpu_linear.matmul_nt(grad_t, x_t, family="hopper", config=BIG_M_TILE)
    for config in gpu_linear.transposed_configs():
        if config.layout == "tb":
            got = gpu_linear.matmul_nn(grad, w, config=config)
            assert_bitwise_equal(got, expected_x, name=f"{config} grad_x vs {BIG_M_TILE}")
            for rows in (1, 5, 64):
                got = gpu_linear.matmul_nn(grad[:rows], w, config=config)
                assert_bitwise_equal(got, expected_x[:rows], name=f"{config} M={rows}")
        else:
            got = gpu_linear.matmul_tn(grad, x, config=config)
            assert_bitwise_equal(got, expected_w, name=f"{config} grad_W vs {BIG_M_TILE}")


@pytest.mark.parametrize("tokens", QWEN_TOKENS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name, k, n", SHAPES, ids=[s[0] for s in SHAPES])
def test_in_place_gives_the_copies_bits_at_qwen3_shapes(name, k, n, dtype, tokens):
    grad, x, w, _ = _case(tokens, n, k, dtype, seed=5)
    with linear_path("own"):  # grad_x on batchinv's kernels at every M (fp16 too)
        in_place, copies = _both_routes(grad, x, w, None, (True, True, False))
    _assert_routes_agree(in_place, copies, f"{name} {tokens} tokens")


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("m, n, k", ODD_SHAPES)
def test_in_place_gives_the_copies_bits_on_odd_shapes_with_bias(m, n, k, dtype):
    grad, x, w, bias = _case(m, n, k, dtype, seed=7)
    assert gpu_linear.tma_readable(grad) and gpu_linear.tma_readable(x)
    in_place, copies = _both_routes(grad, x, w, bias.dtype)
    _assert_routes_agree(in_place, copies, f"{m}x{n}x{k}")


def test_in_place_gives_the_copies_bits_with_special_values():
    # Infinities, NaN, signed zeros and subnormals in dY and X: both routes must propagate
    # them identically (NaN payloads included, the comparator's rule).
    m, n, k = 130, 256, 200
    grad, x, w, bias = _case(m, n, k, torch.bfloat16, seed=9)
    grad[3, :5] = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0])
    grad[70] = -0.0
    x[5, 7] = float("nan")
    x[100] = 1e-40  # subnormal in bf16
    x[101, :4] = float("inf")
    in_place, copies = _both_routes(grad, x, w, bias.dtype)
    _assert_routes_agree(in_place, copies, "special values")


@pytest.mark.parametrize("m, n, k", COPY_SHAPES)
def test_shapes_tma_cannot_read_in_place_keep_the_copies_bits(m, n, k):
    grad, x, w, bias = _case(m, n, k, torch.bfloat16, seed=11)
    assert not gpu_linear.tma_readable(grad)
    in_place, copies = _both_routes(grad, x, w, bias.dtype)
    _assert_routes_agree(in_place, copies, f"{m}x{n}x{k}")
    expected = linear_backward(grad.float(), x.float(), w.float(), torch.float32)
    for got, want, what in zip(in_place, expected, ("grad_x", "grad_w", "grad_b"), strict=True):
        assert_within_tolerance(got, want, op_class="reduction", kind="grad", name=what)


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` whose base is 8 bytes past a 16-byte boundary."""
    storage = torch.empty(t.numel() + 4, dtype=t.dtype, device=t.device)
    view = storage[4:].view(t.shape)
    view.copy_(t)
    assert view.data_ptr() % 16 == 8
    return view


@pytest.mark.parametrize("which", ("grad_y", "x", "both"))
def test_misaligned_operands_keep_the_copies_bits(which):
    grad, x, w, bias = _case(257, 1000, 200, torch.bfloat16, seed=13)
    aligned = gpu_linear.backward(grad, x, w, bias.dtype, transposed_copies=True)
    if which in ("grad_y", "both"):
        grad = _misaligned(grad)
    if which in ("x", "both"):
        x = _misaligned(x)
    in_place, copies = _both_routes(grad, x, w, bias.dtype)
    _assert_routes_agree(in_place, copies, f"misaligned {which}")
    _assert_routes_agree(in_place, aligned, f"misaligned {which} vs aligned")


def test_a_strided_input_is_read_in_place_with_the_copies_bits():
    grad, x, w, _ = _case(257, 1000, 200, torch.bfloat16, seed=15)
    wide = torch.zeros(257, 264, dtype=x.dtype, device="cuda")
    wide[:, :200] = x
    view = wide[:, :200]
    assert gpu_linear.tma_readable(view) and not view.is_contiguous()
    in_place, copies = _both_routes(grad, view, w, None, (False, True, False))
    _assert_routes_agree(in_place, copies, "strided x")


# ---------------------------------------------------------------- the gradients' contract

ROW_M = (1, 3, 16, 17, 64, 65, 257, 1024, 4099)  # copies up to 16 rows, in place above
ROW_PROBES = (0, 1, 2, 15, 16, 64, 256, 1023, 4098)
ROW_SHAPES = SHAPES if QUICK else QWEN3_8B_LINEAR[1:4]  # o_proj, gate_up_proj, down_proj


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name, k, n", ROW_SHAPES, ids=[s[0] for s in ROW_SHAPES])
def test_grad_x_rows_are_the_same_bits_in_every_batch_across_the_routes(name, k, n, dtype):
    grad = _randn(max(ROW_M), n, dtype=dtype, seed=17)
    w = _randn(n, k, dtype=dtype, seed=18, scale=k**-0.5)
    x_shape_only = torch.empty(max(ROW_M), k, dtype=dtype, device="cuda")
    needs = (True, False, False)

    def grad_x(m_slice: slice) -> torch.Tensor:
        return gpu_linear.backward(grad[m_slice], x_shape_only[m_slice], w, None, needs)[0]

    with linear_path("own"):
        alone = {i: grad_x(slice(i, i + 1)) for i in ROW_PROBES}  # the small-M kernel on Wᵀ
        for m in ROW_M:
            route = gpu_linear.grad_x_route(grad[:m], w)[0]
            assert route == ("copies" if m <= 16 else "in place"), f"{name} M={m}: {route}"
            batch = grad_x(slice(0, m))
            for i, expected in alone.items():
                if i < m:
                    assert_bitwise_equal(
                        batch[i : i + 1], expected, name=f"{name} grad_x row {i} of M={m}"
                    )


def test_grad_x_rows_follow_their_tokens_when_the_batch_is_permuted():
    _, k, n = QWEN3_8B_LINEAR[1]
    grad, x, w, _ = _case(1000, n, k, torch.bfloat16, seed=19)
    perm = torch.randperm(1000, generator=torch.Generator().manual_seed(0)).cuda()
    needs = (True, False, False)
    base = gpu_linear.backward(grad, x, w, None, needs)[0]
    permuted = gpu_linear.backward(grad[perm], x[perm], w, None, needs)[0]
    assert_bitwise_equal(permuted, base[perm], name="grad_x rows after a permutation")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name, k, n", SHAPES, ids=[s[0] for s in SHAPES])
def test_grad_weight_is_the_same_bits_run_to_run_and_for_every_configuration(name, k, n, dtype):
    # The contract: the same token sequence gives the same grad_W on every run, whichever
    # tile configuration or route serves it.
    tokens = 1000
    grad, x, w, _ = _case(tokens, n, k, dtype, seed=21)
    needs = (False, True, False)
    first = gpu_linear.backward(grad, x, w, None, needs)[1]
    assert_bitwise_equal(gpu_linear.backward(grad, x, w, None, needs)[1], first, name="rerun")
    copies = gpu_linear.backward(grad, x, w, None, needs, transposed_copies=True)[1]
    assert_bitwise_equal(copies, first, name=f"{name} grad_W copies vs in place")
    for config in gpu_linear.transposed_configs():
        if config.layout == "tab":
            got = gpu_linear.matmul_tn(grad, x, config=config)
            assert_bitwise_equal(got, first, name=f"{name} grad_W {config}")
    wg = w.detach().clone().requires_grad_(True)
    batchinv.linear(x, wg).backward(grad)
    assert_bitwise_equal(wg.grad, first, name=f"{name} grad_W through autograd")


def test_gradients_through_autograd_give_the_copies_bits():
    m, k, n = 300, 256, 136
    grad, x, w, bias = _case(m, n, k, torch.bfloat16, seed=23)
    xg, wg, bg = (t.detach().clone().requires_grad_(True) for t in (x, w, bias))
    batchinv.linear(xg.reshape(3, 100, k), wg, bg).backward(grad.reshape(3, 100, n))
    copies = gpu_linear.backward(grad, x, w, bias.dtype, transposed_copies=True)
    _assert_routes_agree((xg.grad, wg.grad, bg.grad), copies, "autograd")

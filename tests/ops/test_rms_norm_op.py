"""batchinv.rms_norm / fused_add_rms_norm on CPU: the registry, the reference path,
autograd, the module, bad input; and the GPU launch geometry, which must follow the row
length and dtype only."""

from __future__ import annotations

import pytest
import torch

import batchinv
from batchinv import registry
from batchinv.contract import assert_bitwise_equal
from batchinv.gpu import rms_norm as gpu_rms_norm
from batchinv.reference import rms_norm as reference

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
EPS = 1e-6


def _case(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(*shape, generator=gen)).to(dtype)
    weight = (1 + 0.3 * torch.randn(shape[-1], generator=gen)).to(dtype)
    return x, weight


def test_every_backend_is_registered():
    ops = registry.registered_ops()
    assert ops["rms_norm"] == ("cpu", "cuda", "hip")
    assert ops["fused_add_rms_norm"] == ("cpu", "cuda", "hip")


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_forward_is_the_reference(dtype):
    x, weight = _case((3, 5, 37), dtype)
    assert_bitwise_equal(batchinv.rms_norm(x, weight, EPS), reference.rms_norm(x, weight, EPS))
    residual, _ = _case((3, 5, 37), dtype, seed=1)
    got = batchinv.fused_add_rms_norm(x, residual, weight, EPS)
    assert_bitwise_equal(list(got), list(reference.fused_add_rms_norm(x, residual, weight, EPS)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_gradients_are_the_reference_backward(dtype):
    x, weight = _case((4, 19), dtype)
    grad = torch.randn(4, 19, generator=torch.Generator().manual_seed(2)).to(dtype)
    xl, wl = x.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    batchinv.rms_norm(xl, wl, EPS).backward(grad)
    grad_x, grad_w = reference.rms_norm_backward(grad, x, weight, EPS)
    assert_bitwise_equal(xl.grad, grad_x)
    assert_bitwise_equal(wl.grad, grad_w)


def test_fused_gradient_reaches_x_and_residual_equally():
    x, weight = _case((4, 19), torch.float32)
    residual, _ = _case((4, 19), torch.float32, seed=3)
    xl, rl = x.clone().requires_grad_(True), residual.clone().requires_grad_(True)
    y, h = batchinv.fused_add_rms_norm(xl, rl, weight, EPS)
    (y.sum() + 2 * h.sum()).backward()
    assert_bitwise_equal(xl.grad, rl.grad)


def test_module_plain_and_fused():
    norm = batchinv.nn.RMSNorm(16, eps=1e-5)
    assert_bitwise_equal(norm.weight.detach(), torch.ones(16))
    x, _ = _case((2, 16), torch.float32)
    assert_bitwise_equal(norm(x), reference.rms_norm(x, norm.weight, 1e-5))
    y, h = norm(x, x)
    assert_bitwise_equal(h, x + x)
    with pytest.raises(ValueError, match="eps must be a finite number > 0"):
        batchinv.nn.RMSNorm(16, eps=-1.0)
    with pytest.raises(ValueError, match="hidden_size must be a positive int"):
        batchinv.nn.RMSNorm(0)


def test_bad_input_names_the_argument():
    x, weight = _case((2, 8), torch.float32)
    with pytest.raises(ValueError, match="eps must be a finite number > 0"):
        batchinv.rms_norm(x, weight, 0.0)
    with pytest.raises(TypeError, match="eps must be a Python float"):
        batchinv.rms_norm(x, weight, torch.tensor(1e-6))
    with pytest.raises(ValueError, match="weight must have shape"):
        batchinv.rms_norm(x, weight[:4], EPS)
    with pytest.raises(TypeError, match="weight has dtype"):
        batchinv.rms_norm(x, weight.half(), EPS)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        batchinv.rms_norm([1.0], weight, EPS)
    with pytest.raises(ValueError, match="weight is on meta but x is on cpu"):
        batchinv.rms_norm(x, weight.to("meta"), EPS)
    with pytest.raises(ValueError, match="residual must have the shape of x"):
        batchinv.fused_add_rms_norm(x, x[:1], weight, EPS)


@pytest.mark.parametrize("eps", [1e-46, 2.0**-150])
def test_eps_that_rounds_to_zero_in_fp32_is_refused(eps):
    assert float(torch.tensor(eps, dtype=torch.float32)) == 0.0  # what the check stands for
    x, weight = _case((2, 8), torch.float32)
    with pytest.raises(ValueError, match="rounds to 0"):
        batchinv.rms_norm(x, weight, eps)


def test_smallest_fp32_eps_is_accepted():
    x, weight = _case((2, 8), torch.float32)
    batchinv.rms_norm(x, weight, 2.0**-149)


def test_inputs_are_not_mutated():
    x, weight = _case((3, 8), torch.bfloat16)
    residual = x.flip(0)
    before = [t.clone() for t in (x, residual, weight)]
    batchinv.fused_add_rms_norm(x, residual, weight, EPS)
    for t, b in zip((x, residual, weight), before, strict=True):
        assert_bitwise_equal(t, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("direction", ("forward", "backward"))
def test_gpu_geometry_follows_the_row_length_only(dtype, direction):
    elems = 16 // dtype.itemsize
    table, pick = {
        "forward": (gpu_rms_norm.GEOMETRIES, gpu_rms_norm.geometry),
        "backward": (gpu_rms_norm.BACKWARD_GEOMETRIES, gpu_rms_norm.backward_geometry),
    }[direction]
    # name -> (threads, chunks it holds), in the order the launcher tries them
    capacity = {gpu_rms_norm.geometry_name(t, k): (t, t * k) for t, k in table}
    order = list(capacity)
    seen = set()
    sizes = [2048, 2560, 4095, 4096, 4097, 5120, 5121, 8192, 16384, 32768, 32769, 70000]
    for d in list(range(1, 600)) + sizes:
        name, threads, cta = pick(d, dtype)
        assert (name, threads, cta) == pick(d, dtype)
        chunks = -(-d // elems)
        if name == "stream":
            assert chunks > max(c for _, c in capacity.values())
            assert threads == cta == gpu_rms_norm.STREAMING_THREADS
        else:
            assert capacity[name][0] == threads and capacity[name][1] >= chunks
            earlier = order[: order.index(name)]
            assert all(capacity[n][1] < chunks for n in earlier)  # the first that holds the row
        assert cta % threads == 0 and cta >= 128
        seen.add(name)
    assert seen == set(capacity) | {"stream"}
    assert len(capacity) == len(table)  # names are distinct


def test_backward_geometry_differs_from_the_forward_only_where_documented():
    # Rows of 129 .. 512 chunks (bf16 hidden 2048 .. 4096): the forward runs 128 threads of 2
    # chunks (up to 256 chunks) or 64 of 8, the backward 128 of 4; elsewhere the lists agree.
    differs = {"t128k2": ("t128k4", 128, 128), "t64": ("t128k4", 128, 128)}
    for dtype in DTYPES:
        elems = 16 // dtype.itemsize
        for d in range(1, 1024 * elems + 2, 7):
            forward, backward = (
                gpu_rms_norm.geometry(d, dtype),
                gpu_rms_norm.backward_geometry(d, dtype),
            )
            assert backward == differs.get(forward[0], forward), d
    assert gpu_rms_norm.geometry(2048, torch.bfloat16) == ("t128k2", 128, 128)
    assert gpu_rms_norm.geometry(2056, torch.bfloat16) == ("t64", 64, 128)
    assert gpu_rms_norm.geometry(4096, torch.bfloat16) == ("t64", 64, 128)
    assert gpu_rms_norm.backward_geometry(4096, torch.bfloat16)[0] == "t128k4"
    assert gpu_rms_norm.weight_grad_chunking(4096, torch.bfloat16, 9000) == (1, 16)


def test_weight_grad_first_level_of_t128k4_and_t128k5_from_the_row_threshold_on():
    # A function of d, the dtype and the row count, never of the device: 2 groups x 16 rows for
    # t128k4 in bf16 and fp32 from 16384 rows on and for t128k5 in every dtype from 8192 rows
    # on, the geometry's 1 x 16 otherwise.  The edges are
    # written out here, not read from the code under test.
    assert gpu_rms_norm.TWO_GROUPS_SHAPE == (2, 16)
    cases = (
        ("t128k4", torch.bfloat16, 4096, 16384),
        ("t128k4", torch.float16, 1032, None),
        ("t128k4", torch.float32, 2048, 16384),
        ("t128k5", torch.bfloat16, 5120, 8192),
        ("t128k5", torch.float16, 4104, 8192),
        ("t128k5", torch.float32, 2560, 8192),
    )
    for geometry, dtype, d, edge in cases:
        assert gpu_rms_norm.backward_geometry(d, dtype)[0] == geometry
        if edge is None:
            for rows in (1, 8191, 8192, 16384, 163840):
                assert gpu_rms_norm.weight_grad_chunking(d, dtype, rows) == (1, 16), rows
                assert gpu_rms_norm.fused_backward_plan(d, dtype, rows)[3] is None
            continue
        assert gpu_rms_norm.weight_grad_chunking(d, dtype, edge - 1) == (1, 16)
        assert gpu_rms_norm.weight_grad_chunking(d, dtype, edge) == (2, 16)
        assert gpu_rms_norm.weight_grad_chunking(d, dtype, 10 * edge) == (2, 16)
        name, blocks, cta, shape = gpu_rms_norm.fused_backward_plan(d, dtype, edge - 1)
        assert (name, blocks, cta, shape) == (geometry, edge // 16, 128, None)
        name, blocks, cta, shape = gpu_rms_norm.fused_backward_plan(d, dtype, edge + 1)
        assert (name, blocks, cta, shape) == (geometry, edge // 32 + 1, 256, (2, 16))
    # t128k4 keeps 1 x 16 between t128k5's edge and its own.
    assert gpu_rms_norm.weight_grad_chunking(4096, torch.bfloat16, 12288) == (1, 16)
    # Other geometries keep their first level at any row count.
    for d, want in ((128, (32, 1)), (1000, (4, 4)), (8192, (1, 16))):
        for rows in (1, 8192, 16384, 163840):
            assert gpu_rms_norm.weight_grad_chunking(d, torch.bfloat16, rows) == want, (d, rows)
    # The host's table says the same.
    assert {k: (tuple(v[0]), v[1]) for k, v in gpu_rms_norm.TWO_GROUPS.items()} == {
        "t128k4": ((torch.bfloat16, torch.float32), 16384),
        "t128k5": ((torch.bfloat16, torch.float16, torch.float32), 8192),
    }


def test_as_rows_views_when_it_can_and_copies_when_it_must():
    base = torch.randn(4, 6, 10)
    view = gpu_rms_norm.as_rows(base[:, :, :8], 8)
    assert view.shape == (24, 8) and view.stride() == (10, 1)
    assert view.data_ptr() == base.data_ptr()
    transposed = gpu_rms_norm.as_rows(base.transpose(1, 2), 6)
    assert transposed.stride(1) == 1
    assert_bitwise_equal(transposed, base.transpose(1, 2).reshape(-1, 6))


def test_forward_vector_launch_condition():
    # The host's copy of the kernels' 16-byte condition (it picks the *_vec entries): every
    # pointer (0 = absent), both row strides and d * itemsize multiples of 16 bytes.
    x = torch.zeros(4, 4104, dtype=torch.bfloat16)
    w = torch.zeros(4096, dtype=torch.bfloat16)
    y = torch.zeros(4, 4096, dtype=torch.bfloat16)
    rows = x[:, :4096]

    def args(x_rows, residual=0, new_residual=0, d=4096):
        strides = (x_rows.stride(0), 0 if isinstance(residual, int) else residual.stride(0))
        return (y, new_residual, 0, x_rows, residual, w, 4, d, *strides, 1e-6)

    vector = gpu_rms_norm._forward_vector_launch
    assert vector(args(rows), 2)  # plain forward: residual and new_residual absent
    assert vector(args(rows, rows, y), 2)  # fused
    assert not vector(args(x[:, 1:4097]), 2)  # base one element past 16 bytes
    assert not vector(args(torch.zeros(4, 4097, dtype=torch.bfloat16)[:, :4096]), 2)  # stride
    assert not vector(args(rows, d=4092), 2)  # d * itemsize not a multiple of 16


def test_backward_overlaps_its_last_levels_from_16384_rows_of_wide_geometries():
    # Written out here, not read from the code under test: from 16384 rows, for geometries of
    # at least 128 threads per row.
    assert gpu_rms_norm.overlap_rule(4096, torch.bfloat16, 16384)
    assert gpu_rms_norm.overlap_rule(5120, torch.float16, 16384)
    assert gpu_rms_norm.overlap_rule(2048, torch.float32, 65536)
    assert not gpu_rms_norm.overlap_rule(4096, torch.bfloat16, 16383)
    assert not gpu_rms_norm.overlap_rule(128, torch.bfloat16, 524288)  # t4: 4 threads per row
    assert not gpu_rms_norm.overlap_rule(1024, torch.bfloat16, 65536)  # t32

"""batchinv.linear_k_groups on CPU: the public ops, their registry entries, validation before
dispatch, autograd (batchinv.linear's backward) and the torch custom ops."""

from __future__ import annotations

import pytest
import torch

import batchinv
from batchinv import registry
from batchinv.contract import assert_bitwise_equal
from batchinv.reference import linear as reference


def _inputs(bias: bool, dtype=torch.float32, k: int = 200):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, k, generator=gen).to(dtype)
    weight = (torch.randn(11, k, generator=gen) * k**-0.5).to(dtype)
    return x, weight, torch.randn(11, generator=gen).to(dtype) if bias else None


@pytest.mark.parametrize("bias", (False, True))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16), ids=str)
def test_cpu_runs_the_strict_reference(bias, dtype):
    x, weight, b = _inputs(bias, dtype)
    out = batchinv.linear_k_groups(x, weight, b)
    assert out.shape == (2, 3, 11) and out.dtype == dtype
    assert_bitwise_equal(out, reference.linear_k_groups(x, weight, b))
    width = batchinv.k_group_width(200)
    partials = batchinv.linear_k_group_partials(x, weight, group_width=width, groups=8)
    assert_bitwise_equal(partials, reference.linear_k_group_partials(x, weight, width, 8))
    tree = batchinv.k_group_tree_sum(partials)
    expected = tree if b is None else tree + b.float()
    assert_bitwise_equal(out, expected.to(dtype))


def test_registry_entries_have_no_hip_backend():
    ops = registry.registered_ops()
    for name in ("forward", "partials", "tree_sum"):
        assert ops[f"linear_k_groups.{name}"] == ("cpu", "cuda")


def test_a_rocm_device_raises_instead_of_falling_back(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.2")
    device = torch.device("cuda", 0)
    for name in ("forward", "partials", "tree_sum"):
        with pytest.raises(registry.BackendNotImplementedError, match="no hip implementation"):
            registry.lookup(f"linear_k_groups.{name}", device)


def test_bad_input_is_rejected_before_dispatch(monkeypatch):
    def never(*args):
        raise AssertionError("dispatched")

    for name in ("forward", "partials", "tree_sum"):
        monkeypatch.setitem(registry._IMPLEMENTATIONS[f"linear_k_groups.{name}"], "cpu", never)
    x, weight, _ = _inputs(False)
    with pytest.raises(ValueError, match="weight.shape\\[1\\]"):
        batchinv.linear_k_groups(x, weight[:, :64])
    with pytest.raises(ValueError, match="bias"):
        batchinv.linear_k_groups(x, weight, torch.zeros(3))
    with pytest.raises(ValueError, match="group_width"):
        batchinv.linear_k_group_partials(x, weight, group_width=96, groups=8)
    with pytest.raises(ValueError, match="groups"):
        batchinv.linear_k_group_partials(x, weight, group_width=64, groups=9)
    with pytest.raises(ValueError, match="left over"):
        batchinv.linear_k_group_partials(x, weight, group_width=64, groups=3)
    with pytest.raises(TypeError, match="partials"):
        batchinv.k_group_tree_sum(torch.zeros(2, 3, dtype=torch.float16))
    with pytest.raises(ValueError, match="partials"):
        batchinv.k_group_tree_sum(torch.zeros(3, 3))


def test_partials_are_keyword_only():
    x, weight, _ = _inputs(False)
    with pytest.raises(TypeError):
        batchinv.linear_k_group_partials(x, weight, 64, 8)


@pytest.mark.parametrize("bias", (False, True))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_gradients_are_the_linears_bitwise(bias, dtype):
    x, weight, b = _inputs(bias, dtype)
    leaves = [t.clone().requires_grad_() for t in (x, weight, b) if t is not None]
    others = [t.clone().requires_grad_() for t in (x, weight, b) if t is not None]
    grad_y = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = torch.autograd.grad(batchinv.linear_k_groups(*leaves), leaves, grad_y)
    expected = torch.autograd.grad(batchinv.linear(*others), others, grad_y)
    assert_bitwise_equal(list(got), list(expected))


def test_only_the_gradients_asked_for_are_computed():
    x, weight, b = _inputs(True)
    x.requires_grad_()
    out = batchinv.linear_k_groups(x, weight, b)
    (grad_x,) = torch.autograd.grad(out, (x,), torch.ones_like(out))
    assert grad_x.shape == x.shape


def test_partials_never_carry_a_gradient():
    x, weight, _ = _inputs(False)
    partials = batchinv.linear_k_group_partials(
        x.requires_grad_(), weight.requires_grad_(), group_width=64, groups=8
    )
    assert not partials.requires_grad and partials.grad_fn is None


def test_tree_sum_of_one_partial_is_a_view():
    partials = torch.randn(1, 4, 5)
    assert batchinv.k_group_tree_sum(partials).data_ptr() == partials.data_ptr()


@pytest.mark.parametrize("bias", (False, True))
def test_custom_op_passes_opcheck_and_gives_the_eager_bits_and_gradients(bias):
    x, weight, b = (t.requires_grad_() if t is not None else None for t in _inputs(bias))
    args = (x, weight, b)
    torch.library.opcheck(torch.ops.batchinv.linear_k_groups.default, args)
    out = torch.ops.batchinv.linear_k_groups(*args)
    assert_bitwise_equal(out, batchinv.linear_k_groups(*args))
    inputs = [t for t in args if t is not None]
    got = torch.autograd.grad(out, inputs, torch.ones_like(out))
    expected = torch.autograd.grad(batchinv.linear(*args), inputs, torch.ones_like(out))
    assert_bitwise_equal(list(got), list(expected))


def test_partials_custom_op_passes_opcheck():
    x, weight, _ = _inputs(False)
    args = (x, weight, 64, 8)
    torch.library.opcheck(torch.ops.batchinv.linear_k_group_partials.default, args)
    assert_bitwise_equal(
        torch.ops.batchinv.linear_k_group_partials(*args),
        batchinv.linear_k_group_partials(x, weight, group_width=64, groups=8),
    )


def test_compiles_fullgraph_with_eager_bits_and_gradients():
    """The row-parallel pattern (partials of two shards, tree, bias) and the whole op under
    torch.compile(fullgraph=True) on aot_eager: one graph, the eager bits."""
    x, weight, b = _inputs(True, k=456)  # every half has columns
    weight = weight.requires_grad_()

    def fn(x, weight, b):
        width = batchinv.k_group_width(x.shape[-1])
        halves = [
            batchinv.linear_k_group_partials(
                x[..., lo * width : hi * width], weight[:, lo * width : hi * width],
                group_width=width, groups=hi - lo,
            )
            for lo, hi in ((0, 4), (4, 8))
        ]  # fmt: skip
        nodes = torch.stack([batchinv.k_group_tree_sum(h) for h in halves])
        sharded = (batchinv.k_group_tree_sum(nodes) + b).to(x.dtype)
        return sharded, batchinv.linear_k_groups(x, weight, b)

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fn, fullgraph=True, backend=counter)
    eager_sharded, eager_out = fn(x, weight, b)
    sharded, out = compiled(x, weight, b)
    assert counter.frame_count == 1
    assert_bitwise_equal(sharded, eager_sharded)
    assert_bitwise_equal(out, eager_out)
    assert_bitwise_equal(sharded, out.detach())
    (grad,) = torch.autograd.grad(out, (weight,), torch.ones_like(out))
    (eager_grad,) = torch.autograd.grad(eager_out, (weight,), torch.ones_like(out))
    assert_bitwise_equal(grad, eager_grad)
    graph_ops = {str(n.target) for n in counter.graphs[0].graph.nodes if n.op == "call_function"}
    assert any("batchinv.linear_k_groups" in t for t in graph_ops), graph_ops
    assert any("batchinv.linear_k_group_partials" in t for t in graph_ops), graph_ops


# ---- the CUDA launchers, recorded on the CPU (no GPU here: the arguments, not the numbers) ----


@pytest.fixture
def launches(monkeypatch):
    """gpu/linear.py's K-group launchers with every launch recorded instead of run."""
    from batchinv.gpu import linear as gpu_linear

    recorded = []

    def record(kernel, device, grid, block, args, **options):
        recorded.append(
            {"kernel": kernel[1], "grid": grid, "block": block, "args": args, **options}
        )

    monkeypatch.setattr(gpu_linear, "uses_hopper", lambda device: True)
    monkeypatch.setattr(gpu_linear, "multiprocessors", lambda index: 132)
    monkeypatch.setattr(gpu_linear, "kernel_for", lambda module, kernel, device: (module, kernel))
    monkeypatch.setattr(gpu_linear, "launch", record)
    monkeypatch.setattr(gpu_linear, "_tensor_map", lambda *args: ("map", *args[2:5]))
    monkeypatch.setattr(gpu_linear, "allow_dynamic_shared", lambda *args: None)
    gpu_linear._k_group_kernel.cache_clear()
    yield gpu_linear, recorded
    gpu_linear._k_group_kernel.cache_clear()


@pytest.mark.parametrize(
    ("m", "family", "kernel", "tiles", "threads", "box_rows"),
    [
        (8, "auto", "linear_kgroup_small_m_bf16_bn32_k128_s8", 10 * 1, 96, 8),
        (9, "auto", "linear_kgroup_hopper_bf16_bm128_bn256_k64_s4", 2 * 1, 384, 128),
        (257, "small_m", "linear_kgroup_small_m_bf16_bn32_k128_s8", 10 * 33, 96, 8),
        (3, "hopper", "linear_kgroup_hopper_bf16_bm128_bn256_k64_s4", 2 * 1, 384, 128),
    ],
)
def test_partials_launch(launches, m, family, kernel, tiles, threads, box_rows):
    gpu_linear, recorded = launches
    x = torch.zeros(m, 456, dtype=torch.bfloat16)
    weight = torch.zeros(300, 456, dtype=torch.bfloat16)
    partials = gpu_linear.k_group_partials(x, weight, 64, 8, family=family)
    assert partials.shape == (8, m, 300) and partials.dtype == torch.float32
    (launch,) = recorded
    assert launch["kernel"] == kernel
    assert launch["grid"] == (tiles, 8) and launch["block"] == (threads,)
    map_x, map_w, out, rows, cols, k, width = launch["args"]
    assert map_x == ("map", m, 456, box_rows) and map_w[1:3] == (300, 456)
    assert out is partials and (rows, cols, k, width) == (m, 300, 456, 64)


@pytest.mark.parametrize("count", (1, 2, 4, 8))
@pytest.mark.parametrize("out_dtype", (torch.float32, torch.bfloat16, torch.float16), ids=str)
def test_tree_launch(launches, count, out_dtype):
    gpu_linear, recorded = launches
    partials = torch.zeros(count, 3, 1001)
    bias = None if out_dtype == torch.float32 else torch.zeros(1001, dtype=out_dtype)
    out = gpu_linear.k_group_tree(partials, bias, out_dtype)
    assert out.shape == (3, 1001) and out.dtype == out_dtype
    (launch,) = recorded
    name = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}[out_dtype]
    assert launch["kernel"] == f"linear_kgroup_tree_{name}"
    assert launch["grid"] == (-(-3003 // 256),) and launch["block"] == (256,)
    assert launch["args"] == (partials, count, 0 if bias is None else bias, out, 3003, 1001)


def test_forward_launches_partials_then_tree(launches):
    gpu_linear, recorded = launches
    x = torch.zeros(2, 5, 4096, dtype=torch.float16)
    weight = torch.zeros(40, 4096, dtype=torch.float16)
    bias = torch.zeros(40, dtype=torch.float16)
    out = gpu_linear.k_groups_forward(x, weight, bias)
    assert out.shape == (2, 5, 40) and out.dtype == torch.float16
    partials_launch, tree_launch = recorded
    assert partials_launch["kernel"] == "linear_kgroup_hopper_f16_bm128_bn256_k64_s4"
    assert partials_launch["grid"] == (1, 8) and partials_launch["args"][-1] == 512
    assert tree_launch["kernel"] == "linear_kgroup_tree_f16"
    assert tree_launch["args"][1] == 8 and tree_launch["args"][2] is bias


def test_launchers_reject_bad_layouts(launches):
    gpu_linear, recorded = launches
    x = torch.zeros(3, 200, dtype=torch.bfloat16)
    weight = torch.zeros(40, 200, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="group_width"):
        gpu_linear.k_group_partials(x, weight, 96, 8)
    with pytest.raises(ValueError, match="groups"):
        gpu_linear.k_group_partials(x, weight, 64, 9)
    with pytest.raises(ValueError, match="in_features"):
        gpu_linear.k_group_partials(x, weight, 64, 3)
    with pytest.raises(ValueError, match="% 8"):
        gpu_linear.k_group_partials(x[:, :196], weight[:, :196], 64, 4)
    with pytest.raises(ValueError, match="family"):
        gpu_linear.k_group_partials(x, weight, 64, 8, family="mma")
    with pytest.raises(ValueError, match="P in 1, 2, 4, 8"):
        gpu_linear.k_group_tree(torch.zeros(3, 4))
    with pytest.raises(TypeError, match="float32"):
        gpu_linear.k_group_tree(torch.zeros(2, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="no bias"):
        gpu_linear.k_group_tree(torch.zeros(2, 4), torch.zeros(4))
    assert recorded == []


def test_kernel_names_are_instantiated_in_linear_cu():
    """The launchers' kernel names are the ones kernels_cu/linear.cu instantiates."""
    from pathlib import Path

    from batchinv.gpu import linear as gpu_linear

    source = (Path(__file__).parents[2] / "kernels_cu" / "linear.cu").read_text()
    for dtype, codec in ((torch.bfloat16, "Bf16Codec"), (torch.float16, "F16Codec")):
        name = gpu_linear._DTYPE_NAMES[dtype]
        assert (
            f"BATCHINV_LINEAR_KGROUP_HOPPER({name}, batchinv::{codec}, 128, 256, 64, 4)" in source
        )
        assert f"BATCHINV_LINEAR_KGROUP_SMALL_M({name}, batchinv::{codec}, 32, 128, 8)" in source
        assert f"BATCHINV_LINEAR_KGROUP_TREE({name}, batchinv::{codec})" in source
        assert gpu_linear.k_group_kernel_name(gpu_linear.K_GROUP_TILE, dtype) == (
            f"linear_kgroup_hopper_{name}_bm128_bn256_k64_s4"
        )
        assert gpu_linear.k_group_kernel_name(gpu_linear.K_GROUP_SMALL_M, dtype) == (
            f"linear_kgroup_small_m_{name}_bn32_k128_s8"
        )
    assert "BATCHINV_LINEAR_KGROUP_TREE(f32, batchinv::F32Codec)" in source
    assert "constexpr int kKGroups = 8;" in source and gpu_linear.K_GROUPS == 8

"""``rms_norm``'s backward on CUDA keeps its launches per key where the weight gradient takes
the separate route.  On the CPU the CUDA module runs against recording stand-ins for its
kernels, so these tests pin the host logic: a kept call launches the kernels, grids, integer
arguments and programmatic flags of the general path, chains its partial levels through one
workspace as the general path chains its buffers, and leaves the fused route to the general
path.  The bits on a GPU are ``tests/gpu/test_rms_norm_cuda.py``'s."""

from __future__ import annotations

import pytest
import torch

from _fake_kernels import FakeKernel
from batchinv.gpu import rms_norm as gpu_rms_norm


@pytest.fixture
def launches(monkeypatch):
    recorded = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(gpu_rms_norm, "current_raw_stream", lambda index: 7)
    monkeypatch.setattr(gpu_rms_norm, "backend_of", lambda device: "cuda")
    monkeypatch.setattr(gpu_rms_norm, "uses_hopper", lambda device: True)
    monkeypatch.setattr(gpu_rms_norm, "allow_dynamic_shared", lambda *args: None)
    monkeypatch.setattr(
        gpu_rms_norm, "kernel_for", lambda module, name, device: FakeKernel(name, recorded)
    )

    def stand_in_launch(kernel, device, grid, block, args, shared_mem=0, programmatic=False):
        kernel(grid, block, args, shared_mem, 7, 0, programmatic)

    monkeypatch.setattr(gpu_rms_norm, "launch", stand_in_launch)
    gpu_rms_norm._LEAN_BACKWARD.clear()
    yield recorded
    gpu_rms_norm._LEAN_BACKWARD.clear()


# Per kernel, the pointer arguments of buffers each path allocates itself: compared by how
# they chain, not by address.
_FRESH = {
    "rms_norm_backward": (0,),
    "rms_norm_weight_grad_partials": (0,),
    "rms_norm_weight_grad_reduce": (0, 1),
    "rms_norm_weight_grad_last_levels": (0, 1),
}


def _kind(name: str) -> str:
    return next(kind for kind in _FRESH if name.startswith(kind))


def _without_fresh(record):
    name, grid, block, args, shared, _stream, programmatic = record
    fresh = _FRESH[_kind(name)]
    kept = tuple(0 if i in fresh else a for i, a in enumerate(args))
    return name, grid, block, kept, shared, programmatic


def _chain(records) -> list[tuple[str, int]]:
    """Each weight-gradient launch's input buffer as the index of the launch that wrote it."""
    written, chain = {}, []
    for i, (name, _, _, args, _, _, _) in enumerate(records):
        kind = _kind(name)
        if kind in ("rms_norm_weight_grad_reduce", "rms_norm_weight_grad_last_levels"):
            chain.append((kind, written[args[1]]))
        if kind != "rms_norm_backward":
            written[args[0]] = i
    return chain


def _case(rows, d, dtype, residual=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, d, generator=gen).to(dtype)
    grad = torch.randn(rows, d, generator=gen).to(dtype)
    weight = torch.randn(d, generator=gen).to(dtype)
    rstd = torch.rand(rows, generator=gen) + 0.5
    extra = torch.randn(rows, d, generator=gen).to(dtype) if residual else None
    return grad, x, weight, rstd, extra


# (rows, d, dtype): the benchmark's trainer row, small and odd shapes, one the fused route
# takes.
SHAPES = [
    (1024, 4096, torch.bfloat16),
    (3, 64, torch.float16),
    (37, 200, torch.float32),
    (70000, 8, torch.float32),
]


@pytest.mark.parametrize(("rows", "d", "dtype"), SHAPES)
@pytest.mark.parametrize("weight_grad", [True, False])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("last_levels_rows", [None, 2])
def test_kept_backward_launches_what_the_general_path_launches(
    launches, monkeypatch, rows, d, dtype, weight_grad, residual, last_levels_rows
):
    if last_levels_rows is not None:  # reduce levels before the last levels at these sizes
        monkeypatch.setattr(gpu_rms_norm, "WEIGHT_GRAD_LAST_LEVELS_ROWS", last_levels_rows)
        monkeypatch.setattr(gpu_rms_norm, "WEIGHT_GRAD_REDUCE_ROWS", 2)
    grad, x, weight, rstd, extra = _case(rows, d, dtype, residual)
    for _ in range(2):
        got = gpu_rms_norm.backward(grad, x, weight, rstd, extra, weight_grad=weight_grad)
    kept = list(launches)
    launches.clear()
    monkeypatch.setattr(gpu_rms_norm, "_lean_backward", lambda *args: None)
    want = gpu_rms_norm.backward(grad, x, weight, rstd, extra, weight_grad=weight_grad)
    general = list(launches)
    plans = list(gpu_rms_norm._LEAN_BACKWARD.values())
    assert len(plans) == 1
    if plans[0] is None:  # the fused route: the general path ran both times
        assert [r[:3] for r in kept] == [r[:3] for r in general + general]
        return
    assert [_without_fresh(r) for r in kept] == [_without_fresh(r) for r in general + general]
    half = len(kept) // 2
    assert _chain(kept[:half]) == _chain(kept[half:]) == _chain(general)
    assert kept[half][3][0] == got[0].data_ptr()  # grad_x where the row kernel wrote it
    if weight_grad:
        assert kept[-1][3][0] == got[1].data_ptr()  # grad_weight where the last levels write
        assert got[1].shape == (d,) and got[1].dtype == weight.dtype
    else:
        assert got[1] is None and want[1] is None
    assert got[0].shape == want[0].shape == x.shape


def test_reduce_levels_are_kept_and_launched_programmatically(launches, monkeypatch):
    monkeypatch.setattr(gpu_rms_norm, "WEIGHT_GRAD_LAST_LEVELS_ROWS", 2)
    monkeypatch.setattr(gpu_rms_norm, "WEIGHT_GRAD_REDUCE_ROWS", 2)
    grad, x, weight, rstd, _ = _case(1024, 4096, torch.bfloat16)
    gpu_rms_norm.backward(grad, x, weight, rstd)
    kinds = [_kind(r[0]) for r in launches]
    assert kinds.count("rms_norm_weight_grad_reduce") >= 2
    reduce_and_last = [r for r in launches if _kind(r[0]).endswith(("reduce", "last_levels"))]
    assert all(r[6] for r in reduce_and_last)  # programmatic, as the general path launches them
    assert None not in gpu_rms_norm._LEAN_BACKWARD.values()


def test_the_fused_route_is_left_to_the_general_path(launches, monkeypatch):
    monkeypatch.setattr(gpu_rms_norm, "FUSED_WEIGHT_GRAD_MIN_BLOCKS", 1)
    grad, x, weight, rstd, _ = _case(1024, 4096, torch.bfloat16)
    gpu_rms_norm.backward(grad, x, weight, rstd)
    assert list(gpu_rms_norm._LEAN_BACKWARD.values()) == [None]
    assert any("rms_norm_backward_weight_grad" in r[0] for r in launches)
    monkeypatch.setattr(gpu_rms_norm, "FUSED_WEIGHT_GRAD_MIN_BLOCKS", 10**9)  # a new key
    gpu_rms_norm.backward(grad, x, weight, rstd)
    assert len(gpu_rms_norm._LEAN_BACKWARD) == 2 and None in gpu_rms_norm._LEAN_BACKWARD.values()


def test_strided_operands_take_the_general_path(launches):
    grad, x, weight, rstd, _ = _case(64, 256, torch.bfloat16)
    gpu_rms_norm.backward(grad, torch.randn(64, 512).to(torch.bfloat16)[:, :256], weight, rstd)
    assert len(gpu_rms_norm._LEAN_BACKWARD) == 0

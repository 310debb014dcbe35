"""CPU checks of linear's HIP entries (no AMD GPU exists for this project: docs/amd.md).

On HIP, ``linear.forward`` and ``linear.backward`` launch ``kernels_cu/linear.cu``'s
``linear_simt_*`` entries, the portable SIMT loop, for every product, and never reach the
CUDA-only paths (Hopper kernels, cuBLASLt).  These tests pretend
to be a ROCm build of torch and record the launches instead of running them: they check the
dispatch and the launch arguments, not the kernel's numbers.
"""

from __future__ import annotations

import pytest
import torch

from batchinv import registry
from batchinv.gpu import linear as gpu_linear
from batchinv.gpu import linear_cublaslt

_KERNELS = {torch.bfloat16: "linear_simt_bf16", torch.float16: "linear_simt_f16"}


@pytest.fixture
def launches(monkeypatch):
    """A ROCm build of torch (``torch.version.hip`` set) whose linear launches are recorded;
    every CUDA-only step of the linear raises."""
    monkeypatch.setattr(torch.version, "hip", "6.2")
    recorded = []

    def record(kernel, device, grid, block, args, **options):
        recorded.append({"kernel": kernel, "grid": grid, "block": block, "args": args, **options})

    def cuda_only(*args, **kwargs):
        raise AssertionError("linear asked for a CUDA-only path on HIP")

    monkeypatch.setattr(gpu_linear, "kernel_for", lambda module, kernel, device: (module, kernel))
    monkeypatch.setattr(gpu_linear, "launch", record)
    for name in ("uses_hopper", "multiprocessors", "tensor_map_2d", "_require_sm80"):
        monkeypatch.setattr(gpu_linear, name, cuda_only)
    monkeypatch.setattr(linear_cublaslt, "configured_path", cuda_only)
    return recorded


def test_linear_has_hip_entries():
    ops = registry.registered_ops()
    assert ops["linear.forward"] == ("cpu", "cuda", "hip")
    assert ops["linear.backward"] == ("cpu", "cuda", "hip")


def test_a_rocm_device_looks_up_the_hip_entries(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.2")
    device = torch.device("cuda", 0)
    assert registry.backend_of(device) == "hip"
    assert registry.lookup("linear.forward", device) is gpu_linear.hip_forward
    assert registry.lookup("linear.backward", device) is gpu_linear.hip_backward
    # Every op has a hip entry now: remove one to see the error of an op without one.
    monkeypatch.delitem(registry._IMPLEMENTATIONS["linear.backward"], "hip")
    with pytest.raises(registry.BackendNotImplementedError, match="no hip implementation"):
        registry.lookup("linear.backward", device)


@pytest.mark.parametrize("dtype", sorted(_KERNELS, key=str))
@pytest.mark.parametrize("with_bias", [False, True])
def test_hip_forward_is_one_launch_of_the_portable_loop(launches, dtype, with_bias):
    x = torch.randn(3, 67, 40, dtype=dtype)  # 201 rows
    weight = torch.randn(33, 40, dtype=dtype)
    bias = torch.randn(33, dtype=dtype) if with_bias else None
    out = gpu_linear.hip_forward(x, weight, bias)
    assert out.shape == (3, 67, 33) and out.dtype == dtype
    (launch,) = launches
    assert launch["kernel"] == ("linear", _KERNELS[dtype])
    # 32 output columns and 64 rows per 128-thread CTA (kernels_cu/linear.cu's simt_gemm).
    assert launch["grid"] == (2, 4) and launch["block"] == (128,)
    rows, w, result, bias_arg, m, n, k = launch["args"]
    assert rows.shape == (201, 40) and torch.equal(rows, x.reshape(201, 40))
    assert w is weight and result.data_ptr() == out.data_ptr()
    assert (bias_arg is bias) if with_bias else bias_arg == 0
    assert (m, n, k) == (201, 33, 40)


@pytest.mark.parametrize("m", [1, 3, 64, 65, 1000])
def test_hip_forward_geometry_of_a_row_does_not_follow_the_batch(launches, m):
    gpu_linear.hip_forward(torch.randn(m, 16, dtype=torch.bfloat16), torch.randn(48, 16).bfloat16())
    (launch,) = launches
    # Only the number of row tiles changes with M; a CTA's shape and its columns do not.
    assert launch["block"] == (128,) and launch["grid"] == (2, -(-m // 64))


def test_hip_backward_runs_every_product_on_the_portable_loop(launches):
    x = torch.randn(5, 24, dtype=torch.float16)
    weight = torch.randn(12, 24, dtype=torch.float16)
    grad = torch.randn(5, 12, dtype=torch.float16)
    grad_x, grad_weight, grad_bias = gpu_linear.hip_backward(grad, x, weight, torch.float16)
    assert grad_x.shape == x.shape and grad_weight.shape == weight.shape
    assert grad_bias.shape == (12,)
    assert [launch["kernel"] for launch in launches] == [("linear", "linear_simt_f16")] * 3
    # (M, N, K) of each product; reduced dimensions are zero-padded to a multiple of 8.
    shapes = [launch["args"][4:] for launch in launches]
    assert shapes == [
        (5, 24, 16),  # grad_x = grad_y · weight: K = out_features 12 -> 16
        (12, 24, 8),  # grad_weight = grad_yᵀ · x: K = tokens 5 -> 8
        (1, 12, 8),  # grad_bias = 1ᵀ · grad_y
    ]


def test_hip_backward_launches_only_what_is_asked_for(launches):
    x = torch.randn(5, 24, dtype=torch.bfloat16)
    weight = torch.randn(12, 24, dtype=torch.bfloat16)
    grad = torch.randn(5, 12, dtype=torch.bfloat16)
    got = gpu_linear.hip_backward(grad, x, weight, None, (False, True, False))
    assert got[0] is None and got[2] is None and got[1].shape == weight.shape
    assert [launch["args"][4:] for launch in launches] == [(12, 24, 8)]


def test_an_amd_gpu_reporting_capability_9_0_is_not_taken_for_sm90(monkeypatch):
    # ROCm's torch reports gfx90a as capability (9, 0): the sm_90a-only kernels (cluster
    # log_softmax, wgmma, TMA) must not be chosen for it, whatever the build holds.
    from batchinv import runtime

    runtime._hopper_device.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(runtime, "build_info", lambda: {"cuda_archs": "80;90a"})
    try:
        assert runtime._hopper_device(0) is True  # the CUDA build on an sm_90 card
        runtime._hopper_device.cache_clear()
        monkeypatch.setattr(torch.version, "hip", "6.2")
        assert runtime._hopper_device(0) is False
    finally:
        runtime._hopper_device.cache_clear()

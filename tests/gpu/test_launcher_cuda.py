"""The launcher on a real GPU: context sharing with PyTorch, streams, limits, NVRTC."""

from __future__ import annotations

import pytest
import torch

from batchinv.contract import assert_bitwise_equal

pytestmark = pytest.mark.cuda
native = pytest.importorskip("batchinv._native")

SCALE_SOURCE = r"""
extern "C" __global__ void scale(float* out, const float* x, float alpha, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) out[i] = alpha * x[i];
}
extern "C" __global__ void uses_shared(float* out) {
    extern __shared__ float buffer[];
    buffer[threadIdx.x] = (float)threadIdx.x;
    __syncthreads();
    out[threadIdx.x] = buffer[blockDim.x - 1 - threadIdx.x];
}
"""


@pytest.fixture(scope="module")
def user_module():
    return native.RawModule(code=SCALE_SOURCE, device=0)


def test_driver_sees_the_same_gpu_as_torch():
    assert native.driver_status("cuda") == (True, "")
    assert native.device_count() == torch.cuda.device_count()
    props = native.device_properties(0)
    assert props["name"] == torch.cuda.get_device_name(0)
    assert props["compute_capability"] == torch.cuda.get_device_capability(0)


def test_nvrtc_module_runs_on_torch_tensors_and_streams(user_module):
    kernel = user_module.get_function("scale", signature="ptr, ptr, f32, i64")
    x = torch.randn(1000, device="cuda")
    out = torch.full_like(x, float("nan"))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        kernel((4,), (256,), (out, x, 2.5, x.numel()), stream=stream)
    stream.synchronize()
    assert_bitwise_equal(out, x * 2.5)


def test_dynamic_shared_memory_above_48k_needs_opt_in(user_module):
    kernel = user_module.get_function("uses_shared", signature="ptr")
    out = torch.zeros(1024, device="cuda")
    big = 64 * 1024
    with pytest.raises(ValueError, match="set_max_dynamic_shared_memory"):
        kernel((1,), (1024,), (out,), shared_mem=big)
    kernel.set_max_dynamic_shared_memory(big, device=0)
    assert kernel.attributes(0)["max_dynamic_shared_bytes"] == big
    kernel((1,), (1024,), (out,), shared_mem=big)
    torch.cuda.synchronize()
    assert_bitwise_equal(out, torch.arange(1023, -1, -1, device="cuda", dtype=torch.float32))
    with pytest.raises(ValueError, match="exceed what this device allows"):
        kernel.set_max_dynamic_shared_memory(10**6, device=0)


def test_compile_error_carries_the_log():
    with pytest.raises(native.CompileError, match="undefined"):
        native.RawModule(code='extern "C" __global__ void k() { undefined_symbol(); }', device=0)


@pytest.mark.provokes_driver_error  # the sanitizer would flag the deliberate error
def test_missing_kernel_is_named():
    module = native.RawModule(code=SCALE_SOURCE, device=0)
    kernel = module.get_function("not_there", signature="ptr")
    with pytest.raises(ValueError, match="kernel 'not_there' is not in the module"):
        kernel((1,), (1,), (0,), device=0)


def test_bad_device_is_named():
    kernel = native.RawModule(embedded="embedding").get_function("embedding_forward_i64")
    with pytest.raises(ValueError, match="CUDA device 99 does not exist"):
        kernel((1,), (32,), (0, 0, 0, 0, 0, 0, 0), device=99)


def test_wrong_arguments_fail_before_the_driver():
    kernel = native.RawModule(embedded="embedding").get_function("embedding_forward_i64")
    x = torch.zeros(4, device="cuda")
    with pytest.raises(TypeError, match="takes 7 arguments"):
        kernel((1,), (32,), (x, x), device=0)
    with pytest.raises(TypeError, match="argument 3 must be an int"):
        kernel((1,), (32,), (x, x, x, 1.0, 1, 1, x), device=0)
    # The context is untouched: torch still works and a correct launch still runs.
    torch.cuda.synchronize()
    assert float(x.sum()) == 0.0

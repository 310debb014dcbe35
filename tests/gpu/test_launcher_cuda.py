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


CLUSTER16_SOURCE = r"""
extern "C" __global__ void __cluster_dims__(16, 1, 1) cluster_ranks(unsigned* out) {
    unsigned rank, size;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(size));
    if (threadIdx.x == 0) out[blockIdx.x] = size * 1000u + rank;
}
"""


def _is_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)


@pytest.mark.skipif(not _is_sm90(), reason="clusters of 16 CTAs need an sm_90 GPU")
def test_a_cluster_of_16_ctas_runs_after_opting_in():
    module = native.RawModule(code=CLUSTER16_SOURCE, device=0)
    kernel = module.get_function("cluster_ranks", signature="ptr")
    kernel.allow_non_portable_cluster_size(device=0)
    assert kernel.max_active_clusters((64,), (64,), device=0) >= 1
    out = torch.zeros(64, dtype=torch.int32, device="cuda")
    kernel((64,), (64,), (out,), device=0)
    expected = torch.tensor([16 * 1000 + i % 16 for i in range(64)], dtype=torch.int32)
    assert_bitwise_equal(out.cpu(), expected)


@pytest.mark.skipif(_is_sm90(), reason="checks a device without non-portable clusters (sm_90)")
def test_non_portable_clusters_are_an_error_before_sm90(user_module):
    kernel = user_module.get_function("scale", signature="ptr, ptr, f32, i64")
    with pytest.raises(native.BackendUnavailableError, match=r"need compute capability 9\.0"):
        kernel.allow_non_portable_cluster_size(device=0)


# A primary kernel that lets its dependent launch at once, then spins for spin_ns before it
# writes data; the secondary stamps its start and copies data after griddepcontrol.wait.
PDL_SOURCE = r"""
__device__ unsigned long long now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
extern "C" __global__ void primary(unsigned long long* stamps, float* data, long long spin_ns) {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    const unsigned long long t0 = now();
    unsigned long long t = t0;
    while (t - t0 < (unsigned long long)spin_ns) t = now();
    data[threadIdx.x] = (float)threadIdx.x + 1.0f;
    if (threadIdx.x == 0) stamps[0] = t;
}
extern "C" __global__ void secondary(unsigned long long* stamps, const float* data, float* out) {
    if (threadIdx.x == 0) stamps[1] = now();
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    out[threadIdx.x] = data[threadIdx.x];
}
"""


@pytest.fixture(scope="module")
def pdl_pair():
    # Compiled and resolved once: a kernel resolved while another runs may wait for it (lazy
    # module loading), which would hide the overlap being tested.
    module = native.RawModule(code=PDL_SOURCE, device=0)
    return (
        module.get_function("primary", signature="ptr, ptr, i64"),
        module.get_function("secondary", signature="ptr, ptr, ptr"),
    )


def _run_pair(pdl_pair, programmatic: bool):
    """``(out, primary end, secondary start)`` of one primary/secondary pair on a side stream."""
    primary, secondary = pdl_pair
    stamps = torch.zeros(2, dtype=torch.int64, device="cuda")
    data = torch.zeros(128, device="cuda")
    out = torch.full((128,), float("nan"), device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        primary((1,), (128,), (stamps, data, 2_000_000), stream=stream, device=0)
        secondary(
            (1,), (128,), (stamps, data, out), stream=stream, device=0, programmatic=programmatic
        )
    stream.synchronize()
    return out, int(stamps[0]), int(stamps[1])


@pytest.mark.skipif(not _is_sm90(), reason="programmatic dependent launch needs an sm_90 GPU")
def test_a_programmatic_launch_runs_and_its_wait_sees_the_finished_primary(pdl_pair):
    want = torch.arange(1, 129, dtype=torch.float32, device="cuda")
    out, primary_end, secondary_start = _run_pair(pdl_pair, programmatic=False)
    assert_bitwise_equal(out, want)
    assert secondary_start >= primary_end  # ordinary stream order
    for _ in range(3):
        # The secondary may start during the primary's 2 ms spin (the primary lets it launch
        # at once); after griddepcontrol.wait it must read what the primary wrote at its end.
        out, _, _ = _run_pair(pdl_pair, programmatic=True)
        assert_bitwise_equal(out, want)


@pytest.mark.skipif(_is_sm90(), reason="checks a device without programmatic dependent launch")
def test_programmatic_launch_is_an_error_before_sm90(pdl_pair):
    with pytest.raises(native.BackendUnavailableError, match=r"needs compute capability 9\.0"):
        _run_pair(pdl_pair, programmatic=True)

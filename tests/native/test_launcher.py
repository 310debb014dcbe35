"""The raw-kernel launcher without a GPU: signatures, launch limits, clear errors."""

from __future__ import annotations

import pytest
import torch

native = pytest.importorskip("batchinv._native", reason="the extension is built by `nox -s tests`")

FORWARD_SIGNATURE = "(ptr, ptr, ptr, i64, i64, i64, ptr)"


@pytest.fixture()
def forward_kernel():
    return native.RawModule(embedded="embedding").get_function("embedding_forward_i64")


def valid_args():
    return (16, 32, 48, 1, 2, 3, 64)


def test_embedded_module_declares_signatures(forward_kernel):
    module = native.RawModule(embedded="embedding")
    declared = module.declared_kernels()
    assert declared["embedding_forward_i64"] == "ptr, ptr, ptr, i64, i64, i64, ptr"
    assert forward_kernel.signature == FORWARD_SIGNATURE
    assert forward_kernel.name == "embedding_forward_i64"
    assert "embedding" in native.embedded_modules()


def test_check_accepts_a_valid_call(forward_kernel):
    forward_kernel.check((4,), (128,), valid_args())
    forward_kernel.check(4, 128, list(valid_args()))


def test_wrong_arity_is_a_type_error(forward_kernel):
    with pytest.raises(TypeError, match=r"takes 7 arguments .*got 6"):
        forward_kernel.check((1,), (32,), valid_args()[:-1])


@pytest.mark.parametrize(
    "index, value, message",
    [
        (3, 1.5, r"argument 3 must be an int \(i64\), got float"),
        (3, True, r"argument 3 must be an int \(i64\), got bool"),
        (0, "x", r"argument 0 must be a pointer"),
        (0, 1.0, r"argument 0 must be a pointer"),
    ],
)
def test_wrong_argument_type_is_a_type_error(forward_kernel, index, value, message):
    args = list(valid_args())
    args[index] = value
    with pytest.raises(TypeError, match=message):
        forward_kernel.check((1,), (32,), args)


def test_out_of_range_integer_is_a_value_error(forward_kernel):
    args = list(valid_args())
    args[3] = 2**70
    with pytest.raises(ValueError, match=r"argument 3 = .* does not fit in i64"):
        forward_kernel.check((1,), (32,), args)


def test_tensor_is_accepted_as_pointer(forward_kernel):
    args = list(valid_args())
    args[0] = torch.zeros(4)  # data_ptr() of a CPU tensor is just an address here
    forward_kernel.check((1,), (32,), args)


@pytest.mark.parametrize(
    "grid, block, shared, message",
    [
        ((0,), (32,), 0, r"grid\[0\] = 0 must be at least 1"),
        ((1, 70000), (32,), 0, r"grid.y = 70000 exceeds the limit of 65535"),
        ((1,), (2048,), 0, r"block.x = 2048 exceeds the limit of 1024"),
        ((1,), (32, 32, 2), 0, r"block of 2048 threads exceeds"),
        ((1,), (1, 1, 65), 0, r"block.z = 65 exceeds the limit of 64"),
        ((1,), (32,), 10**6, r"1000000 bytes of dynamic shared memory"),
        ((1, 1, 1, 1), (32,), 0, r"grid must have 1 to 3 dimensions"),
        ((-1,), (32,), 0, r"grid\[0\] = -1 must be at least 1"),
    ],
)
def test_bad_launch_config_is_a_value_error(forward_kernel, grid, block, shared, message):
    with pytest.raises(ValueError, match=message):
        forward_kernel.check(grid, block, valid_args(), shared_mem=shared)


def test_bad_grid_type(forward_kernel):
    with pytest.raises(TypeError, match="grid must be an int or a tuple"):
        forward_kernel.check([1], (32,), valid_args())


def test_unknown_kernel_and_module_names():
    with pytest.raises(
        ValueError, match=r"no embedded module named 'nope' \(built modules: .*embedding"
    ):
        native.RawModule(embedded="nope")
    module = native.RawModule(embedded="embedding")
    with pytest.raises(ValueError, match=r"has no kernel 'nope' \(it has: .*embedding_forward_i32"):
        module.get_function("nope")


def test_declared_signature_must_match():
    module = native.RawModule(embedded="embedding")
    with pytest.raises(TypeError, match="differs from the kernel's declared"):
        module.get_function("embedding_forward_i64", signature="ptr, ptr")
    kernel = module.get_function(
        "embedding_forward_i64", signature="ptr, ptr, ptr, i64, i64, i64, ptr"
    )
    assert kernel.signature == FORWARD_SIGNATURE


def test_user_module_needs_a_signature():
    module = native.RawModule(b"\x7fELF not really a cubin")
    with pytest.raises(TypeError, match="needs signature="):
        module.get_function("k")
    with pytest.raises(ValueError, match="unknown parameter type 'int'"):
        module.get_function("k", signature="ptr, int")
    kernel = module.get_function("k", signature="ptr, f32, u32")
    assert kernel.signature == "(ptr, f32, u32)"


def test_raw_module_takes_exactly_one_source():
    with pytest.raises(ValueError, match="exactly one of"):
        native.RawModule()
    with pytest.raises(ValueError, match="exactly one of"):
        native.RawModule(b"abc", embedded="embedding")
    with pytest.raises(ValueError, match="image is empty"):
        native.RawModule(b"")
    with pytest.raises(ValueError, match="unknown backend 'rocm'"):
        native.RawModule(embedded="embedding", backend="rocm")


def test_stream_argument_forms(forward_kernel):
    class NotAStream:
        pass

    with pytest.raises(TypeError, match="stream must be None, an int handle"):
        forward_kernel((1,), (32,), valid_args(), stream=NotAStream())


def test_build_info_reports_how_kernels_were_built():
    info = native.build_info()
    assert set(info) >= {"cuda_kernels", "cuda_archs", "nvcc_version", "hip_kernels", "version"}
    if info["cuda_kernels"]:
        assert "90a" in info["cuda_archs"].split(";")
        assert "13.0" in info["nvcc_version"]
        image = native.embedded_image("embedding")
        assert image[:4] == bytes([0x50, 0xED, 0x55, 0xBA])  # fatbin magic


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-driver path")
def test_without_a_driver_a_launch_says_cuda_is_not_available(forward_kernel):
    ok, reason = native.driver_status("cuda")
    assert not ok and "libcuda" in reason
    with pytest.raises(native.BackendUnavailableError, match="CUDA is not available"):
        forward_kernel((1,), (32,), valid_args())
    with pytest.raises(native.BackendUnavailableError, match="CUDA is not available"):
        native.device_count()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-driver path")
def test_without_hip_runtime_hip_is_unavailable():
    ok, reason = native.driver_status("hip")
    if ok:
        pytest.skip("a HIP runtime with a device is present")
    assert "HIP is not available" in reason


@pytest.mark.parametrize(
    "grid, block, shared, message",
    [
        ((0,), (64,), 0, r"grid\[0\] = 0 must be at least 1"),
        ((16,), (2048,), 0, r"block.x = 2048 exceeds the limit of 1024"),
        ((16,), (64,), 10**6, r"1000000 bytes of dynamic shared memory"),
    ],
)
def test_max_active_clusters_checks_the_shape_before_the_device(
    forward_kernel, grid, block, shared, message
):
    with pytest.raises(ValueError, match=message):
        forward_kernel.max_active_clusters(grid, block, shared_mem=shared)


def test_max_active_clusters_bad_block_type(forward_kernel):
    with pytest.raises(TypeError, match="block must be an int or a tuple"):
        forward_kernel.max_active_clusters((16,), [64])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-driver path")
def test_without_a_driver_non_portable_clusters_say_cuda_is_not_available(forward_kernel):
    with pytest.raises(native.BackendUnavailableError, match="CUDA is not available"):
        forward_kernel.allow_non_portable_cluster_size()
    with pytest.raises(native.BackendUnavailableError, match="CUDA is not available"):
        forward_kernel.max_active_clusters((16,), (64,))


def test_programmatic_must_be_a_bool(forward_kernel):
    for value in (1, "yes", None):
        with pytest.raises(TypeError):
            forward_kernel((1,), (32,), valid_args(), programmatic=value)


def test_programmatic_launch_of_a_hip_module_is_unavailable_before_the_driver():
    # Refused by the launch checks, before any HIP runtime is opened (none is here).
    kernel = native.RawModule(b"\x7fELF not really a code object", backend="hip").get_function(
        "k", signature="ptr"
    )
    with pytest.raises(
        native.BackendUnavailableError,
        match=r"kernel 'k': programmatic dependent launch is a CUDA feature",
    ):
        kernel((1,), (64,), (0,), programmatic=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-driver path")
def test_without_a_driver_a_programmatic_launch_says_cuda_is_not_available(forward_kernel):
    with pytest.raises(native.BackendUnavailableError, match="CUDA is not available"):
        forward_kernel((1,), (32,), valid_args(), programmatic=True)

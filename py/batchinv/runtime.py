"""The Python side of the boundary with the compiled extension ``batchinv._native``.

This is the only module that imports ``batchinv._native``; the rest of the package reaches the
native code through it: loading batchinv's embedded kernels, launching them on PyTorch's
current stream, the device queries the launch code needs (``uses_hopper``,
``multiprocessors``) and the extension's own helpers (``native()``: TMA maps, build info).
"""

from __future__ import annotations

import functools

import torch

from .registry import backend_of

try:
    from . import _native
except ImportError as error:  # a source checkout that was never built
    _native = None
    _NATIVE_IMPORT_ERROR = error
else:
    _NATIVE_IMPORT_ERROR = None


class NativeModuleMissingError(RuntimeError):
    """batchinv was imported from sources without its compiled extension."""


def native():
    """The compiled extension, or a clear error if this install has none."""
    if _native is None:
        raise NativeModuleMissingError(
            "batchinv's native module (batchinv._native) is not built, so GPU ops cannot run; "
            f"install the wheel or run `maturin develop` ({_NATIVE_IMPORT_ERROR})"
        )
    return _native


def build_info() -> dict:
    """What the extension was built with (``cuda_archs``, ``hip_archs``, versions)."""
    return native().build_info()


def declared_kernels(module: str) -> dict[str, str]:
    """The kernels (name -> signature) that ``kernels_cu/<module>.cu`` declares (CUDA build)."""
    return native().RawModule(embedded=module).declared_kernels()


def tensor_map_2d(
    address: int,
    dtype_name: str,
    rows: int,
    cols: int,
    row_bytes: int,
    box_rows: int,
    box_cols: int,
    swizzle_bytes: int,
    device: int | None = None,
) -> bytes:
    """An encoded TMA descriptor of a ``rows x cols`` matrix at ``address`` (rows ``row_bytes``
    apart), read in ``box_rows x box_cols`` boxes with a ``swizzle_bytes`` swizzle.  ``device``
    (the CUDA device the matrix is on) is made current for the encoding: the driver needs a
    current context, which a thread PyTorch has not launched on (autograd's backward thread)
    does not have."""
    return native().tensor_map_2d(
        address, dtype_name, rows, cols, row_bytes, box_rows, box_cols, swizzle_bytes, device
    )


@functools.cache
def _module(name: str, backend: str):
    return native().RawModule(embedded=name, backend=backend)


@functools.cache
def _kernel(module: str, kernel: str, backend: str):
    return _module(module, backend).get_function(kernel)


def kernel_for(module: str, kernel: str, device: torch.device):
    """The kernel ``kernel`` of ``kernels_cu/<module>.cu`` for ``device``'s backend."""
    return _kernel(module, kernel, backend_of(device))


def uses_hopper(device: torch.device) -> bool:
    """Whether ``device`` runs the Hopper kernels: an sm_90 GPU and a build with the sm_90a
    image (wgmma, TMA, clusters)."""
    return _hopper_device(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def multiprocessors(index: int | None) -> int:
    """The SM count of CUDA device ``index`` (None: the current device), asked once."""
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _hopper_device(index: int) -> bool:
    # Asked on every call of the ops that use it: capability and build do not change.  ROCm's
    # torch reports an AMD GPU's own version numbers as the capability (gfx90a: 9.0), so a HIP
    # device is never taken for sm_90.
    if torch.version.hip:
        return False
    return torch.cuda.get_device_capability(index) == (9, 0) and "90a" in build_info()["cuda_archs"]


# The dynamic shared-memory limit each (kernel, device) has now: CUDA's default (48 KiB less
# the kernel's static shared memory) until raised.
_DYNAMIC_SHARED_LIMITS: dict[tuple[int, int], int] = {}


def allow_dynamic_shared(kernel, shared_bytes: int, device_index: int) -> None:
    """Lets ``kernel`` launch with ``shared_bytes`` of dynamic shared memory on the device.

    Raises the kernel's limit only when ``shared_bytes`` is above the limit it has (a launch
    above it would fail), so a later call that needs more raises it again.  A size the device
    cannot give is the native module's error, naming the kernel.
    """
    key = (id(kernel), device_index)
    limit = _DYNAMIC_SHARED_LIMITS.get(key)
    if limit is None:
        limit = int(kernel.attributes(device_index)["max_dynamic_shared_bytes"])
    if shared_bytes > limit:
        kernel.set_max_dynamic_shared_memory(shared_bytes, device=device_index)
        limit = shared_bytes
    _DYNAMIC_SHARED_LIMITS[key] = limit


def launch(
    kernel, device: torch.device, grid, block, args, shared_mem: int = 0, programmatic: bool = False
) -> None:
    """Launches on ``device`` on PyTorch's current stream there.

    ``programmatic=True``: programmatic dependent launch (sm_90): the kernel may start while
    the previous kernel on the stream finishes, and must execute ``griddepcontrol.wait`` before
    it reads that kernel's output (an error on devices without it; see ``uses_hopper``).
    """
    index = torch.cuda.current_device() if device.index is None else device.index
    kernel(
        grid,
        block,
        args,
        shared_mem=shared_mem,
        stream=current_raw_stream(index),
        device=device.index,
        programmatic=programmatic,
    )


def current_raw_stream(index: int) -> int:
    """The handle of PyTorch's current stream on CUDA device ``index``: what
    ``torch.cuda.current_stream(index).cuda_stream`` returns, without building a ``Stream``
    object (a few microseconds per launch; Triton launches the same way)."""
    return torch._C._cuda_getCurrentRawStream(index)

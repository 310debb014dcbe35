"""Log-softmax over the last dimension on CUDA/HIP: launches ``kernels_cu/log_softmax.cu``.

One CTA per row.  The block size, and with it the reduction tree, is chosen from the row
length V alone (``threads_for``), so a row's bits are the same in any batch.  How much of the
row stays on chip between the two passes (registers, then dynamic shared memory sized from
the device's limits, then a second read from global memory) changes speed only: the
arithmetic is defined on element indices.  The GPU's reduction order is its own fixed tree
(see the kernel), not the reference's ``chunk_size`` order, so the two backends agree within
the contract's tolerance, not bitwise.  No call synchronises.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ._launch import kernel_for, launch
from .rms_norm import as_rows

# Keep in step with kernels_cu/log_softmax.cu.
GROUP = 8  # kGroup: elements per group
REGISTER_BYTES = 64  # RegGroups: bytes of a row each thread keeps in registers
SMALL_ROW_THREADS = 128
LARGE_ROW_THREADS = 512  # 128, 512 or 1024 are compiled; changing it changes the tree (bits)
_CTAS_PER_SM = {128: 8, 512: 2, 1024: 1}  # the occupancy the shared-memory budget aims at
_DRIVER_RESERVED_SHARED = 1024  # per CTA on sm_80+
_DEFAULT_SHARED = 48 * 1024
_MAX_GRID_X = 2**31 - 1
_SUFFIX = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}


def _register_groups(dtype: torch.dtype) -> int:
    return REGISTER_BYTES // (GROUP * dtype.itemsize)


def threads_for(vocab: int, dtype: torch.dtype) -> int:
    """The block size for rows of ``vocab`` elements of ``dtype`` (the input's dtype)."""
    groups = -(-vocab // GROUP)
    return (
        SMALL_ROW_THREADS
        if groups <= SMALL_ROW_THREADS * _register_groups(dtype)
        else LARGE_ROW_THREADS
    )


@functools.cache
def _shared_budget(device_index: int, threads: int, static_bytes: int) -> int:
    """Dynamic shared memory one CTA may use while ``_CTAS_PER_SM`` of them fit on an SM."""
    props = torch.cuda.get_device_properties(device_index)
    per_block = getattr(props, "shared_memory_per_block_optin", 0) or _DEFAULT_SHARED
    per_sm = getattr(props, "shared_memory_per_multiprocessor", 0) or per_block
    share = per_sm // _CTAS_PER_SM[threads] - _DRIVER_RESERVED_SHARED
    return max(0, min(per_block, share) - static_bytes)


_RAISED_LIMITS: set[tuple[str, int]] = set()
_STATIC_SHARED: dict[tuple[str, int], int] = {}


def _static_shared(kernel, device_index: int) -> int:
    key = (kernel.name, device_index)
    if key not in _STATIC_SHARED:
        _STATIC_SHARED[key] = int(kernel.attributes(device_index)["static_shared_bytes"])
    return _STATIC_SHARED[key]


def _raise_shared_limit(kernel, device_index: int, bytes_: int) -> None:
    """Opts the kernel in to ``bytes_`` of dynamic shared memory (once per kernel and device)."""
    key = (kernel.name, device_index)
    if key not in _RAISED_LIMITS:
        kernel.set_max_dynamic_shared_memory(bytes_, device=device_index)
        _RAISED_LIMITS.add(key)


def _tiering(
    kernel, device: torch.device, vocab: int, threads: int, dtype: torch.dtype
) -> tuple[int, int]:
    """``(smem_groups, shared bytes)``: groups per thread cached in shared memory."""
    group_bytes = GROUP * dtype.itemsize
    groups_in_row = -(-vocab // GROUP)
    per_thread = -(-groups_in_row // threads)
    wanted = per_thread - _register_groups(dtype)
    if wanted <= 0:
        return 0, 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    static = _static_shared(kernel, index)
    budget = _shared_budget(index, threads, static)
    groups = min(wanted, budget // (threads * group_bytes))
    shared = groups * threads * group_bytes
    if shared > _DEFAULT_SHARED - static:
        _raise_shared_limit(kernel, index, budget)
    return groups, shared


def forward(
    x: Tensor, out_dtype: torch.dtype = torch.float32, *, need_lse: bool = True
) -> tuple[Tensor, Tensor | None]:
    """``(out, lse)``: out in x's shape and ``out_dtype``, lse the fp32 ``[rows]`` for the
    backward (x viewed as ``[rows, V]``; None unless ``need_lse``).  Arguments are validated by
    the caller."""
    vocab = x.shape[-1]
    rows_view = as_rows(x, vocab)
    rows = rows_view.shape[0]
    out = torch.empty((rows, vocab), dtype=out_dtype, device=x.device)
    lse = torch.empty(rows, dtype=torch.float32, device=x.device) if need_lse else None
    if rows > 0:
        if rows > _MAX_GRID_X:
            raise ValueError(f"x has {rows} rows; at most {_MAX_GRID_X} are supported")
        threads = threads_for(vocab, x.dtype)
        kernel = kernel_for(
            "log_softmax",
            f"log_softmax_forward_{_SUFFIX[x.dtype]}_{_SUFFIX[out_dtype]}_t{threads}",
            x.device,
        )
        smem_groups, shared = _tiering(kernel, x.device, vocab, threads, x.dtype)
        launch(
            kernel,
            x.device,
            grid=(rows,),
            block=(threads,),
            args=(
                out,
                lse if lse is not None else 0,
                rows_view,
                rows,
                vocab,
                rows_view.stride(0),
                smem_groups,
            ),
            shared_mem=shared,
        )
    return out.view(x.shape), lse


def backward(grad_out: Tensor, x: Tensor, lse: Tensor) -> Tensor:
    """``dx = dy - exp(x - lse) * sum(dy)`` per row (zero in all -inf rows), x's dtype."""
    vocab = x.shape[-1]
    rows_view = as_rows(x, vocab)
    rows = rows_view.shape[0]
    grad_rows = grad_out.reshape(rows, vocab).contiguous()
    grad_x = torch.empty((rows, vocab), dtype=x.dtype, device=x.device)
    if rows > 0:
        threads = threads_for(vocab, x.dtype)
        name = f"log_softmax_backward_{_SUFFIX[x.dtype]}_{_SUFFIX[grad_rows.dtype]}_t{threads}"
        kernel = kernel_for("log_softmax", name, x.device)
        smem_groups, shared = _tiering(kernel, x.device, vocab, threads, grad_rows.dtype)
        launch(
            kernel,
            x.device,
            grid=(rows,),
            block=(threads,),
            args=(grad_x, grad_rows, rows_view, lse, rows, vocab, rows_view.stride(0), smem_groups),
            shared_mem=shared,
        )
    return grad_x.reshape(x.shape)

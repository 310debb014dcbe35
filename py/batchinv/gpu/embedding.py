"""Embedding on CUDA/HIP: launches ``kernels_cu/embedding.cu``.

Out-of-range ids are found by the kernel itself (it never reads their rows, fills them
with NaN and records the first bad position), so a bad id becomes a Python IndexError and
never an illegal memory access.  Reading that flag synchronises with the device once per
call; ``check_ids=False`` skips the read (bad rows then come back as NaN), and under CUDA-graph
capture or ``device_checks.deferred()`` the kernel writes the device's persistent flag, read
by ``device_checks.raise_device_errors()``.  The backward
drops the gradient of an out-of-range id (the kernel writes nothing for it), so no
combination of flags lets it store outside ``grad_weight``.  It reads nothing back from the
device (its kernel finds the runs of equal ids in the sorted ids), so it can be captured in a
CUDA graph.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .. import device_checks
from ..runtime import allow_dynamic_shared, current_raw_stream, kernel_for, launch
from ..validation import report_bad_index

_MAX_GRID_X = 2**31 - 1
_BACKWARD_KERNELS = {
    torch.bfloat16: "embedding_backward_bf16",
    torch.float16: "embedding_backward_f16",
    torch.float32: "embedding_backward_f32",
}
_RUNS_KERNELS = {
    torch.bfloat16: "embedding_backward_runs_bf16",
    torch.float16: "embedding_backward_runs_f16",
    torch.float32: "embedding_backward_runs_f32",
}
_BACKWARD_THREADS = 128  # one thread per gradient column
_RUNS_CTAS = 32768
# The backward sorts at most SORT_MAX_IDS ids with its own one-CTA kernel (embedding_sort_ids:
# 8 bytes of shared memory per key, 64 KB here) instead of torch.sort: the same order in one
# launch (torch.sort was the backward's largest single host cost in a cProfile).
SORT_MAX_IDS = 8192
_SORT_THREADS = 1024
# How ``backward`` finds the segments of equal ids: "static" (no host sync, capturable) or
# "unique" (one sync per call); the same bits either way.  Kept switchable for the benchmark
# and for the test that compares the two.
BACKWARD_SEGMENTS = "static"


def _threads_for(row_bytes: int) -> int:
    # One CTA per row: enough threads for four 16-byte words each, 32 to 256.
    words = -(-row_bytes // 16)
    threads = -(-words // 4)
    return min(256, max(32, -(-threads // 32) * 32))


def launch_forward(
    ids: Tensor, weight: Tensor, first_bad: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Launches the gather; returns ``(out [num_ids, hidden], first_bad_position [1])``
    without reading the flag (no synchronisation).  ``first_bad``: the flag the kernel
    writes (default: a fresh one).  ``forward`` is the checked op; the arguments were
    validated by ``batchinv.embedding``."""
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous on the GPU (call .contiguous() first)")
    flat_ids = ids.reshape(-1).contiguous()  # a copy only if ids is not contiguous
    num_ids, (vocab, hidden) = flat_ids.numel(), weight.shape
    if num_ids > _MAX_GRID_X:
        raise ValueError(f"ids has {num_ids} elements; at most {_MAX_GRID_X} are supported")
    out = torch.empty(num_ids, hidden, dtype=weight.dtype, device=weight.device)
    if first_bad is None:
        first_bad = torch.full((1,), -1, dtype=torch.int64, device=weight.device)  # UINT64_MAX
    if num_ids == 0 or hidden == 0:
        return out, first_bad
    name = "embedding_forward_i64" if flat_ids.dtype == torch.int64 else "embedding_forward_i32"
    row_bytes = hidden * weight.element_size()
    launch(
        kernel_for("embedding", name, weight.device),
        weight.device,
        grid=(num_ids,),
        block=(_threads_for(row_bytes),),
        args=(out, weight, flat_ids, num_ids, row_bytes, vocab, first_bad),
    )
    return out, first_bad


def forward(ids: Tensor, weight: Tensor, check_ids: bool = True) -> Tensor:
    # Under CUDA-graph capture or device_checks.deferred() (no sync allowed), the kernel writes
    # the device's persistent flag, which accumulates over calls: no launch added.
    deferred = check_ids and device_checks.deferring(weight.device)
    flag = device_checks.flag(device_checks.EMBEDDING_IDS, weight.device) if deferred else None
    if ids.is_contiguous() and weight.is_contiguous():
        out, first_bad = _launch_contiguous(ids, weight, check_ids, flag)
    else:
        out, first_bad = launch_forward(ids, weight, flag)
        out = out.reshape(*ids.shape, weight.shape[1])
    if check_ids and not deferred:
        position = int(first_bad.item())  # the one synchronisation: bad ids must raise here
        if position != -1:
            report_bad_index("ids", ids, position, weight.shape[0])
    return out


def _launch_contiguous(
    ids: Tensor, weight: Tensor, check_ids: bool, flag: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``launch_forward`` for contiguous ids and weight, in fewer host steps: the output
    allocated in its final shape, pointers passed as ints.  The kernel writes ``flag`` if
    given, else a fresh flag, or ``device_checks.unread_flag`` for an unchecked call (the
    same kernel, hence bits)."""
    vocab, hidden = weight.shape
    num_ids = ids.numel()
    if num_ids > _MAX_GRID_X:
        raise ValueError(f"ids has {num_ids} elements; at most {_MAX_GRID_X} are supported")
    device = weight.device
    out = weight.new_empty((*ids.shape, hidden))
    if flag is not None:
        first_bad = flag
    elif check_ids:
        first_bad = torch.full((1,), -1, dtype=torch.int64, device=device)  # UINT64_MAX
    else:
        first_bad = device_checks.unread_flag(device)
    if num_ids == 0 or hidden == 0:
        return out, first_bad
    row_bytes = hidden * weight.element_size()
    index = device.index
    _forward_kernel(ids.dtype, device)(
        (num_ids,),
        (_threads_for(row_bytes),),
        (
            out.data_ptr(),
            weight.data_ptr(),
            ids.data_ptr(),
            num_ids,
            row_bytes,
            vocab,
            first_bad.data_ptr(),
        ),
        0,
        current_raw_stream(index),
        index,
        False,
    )
    return out, first_bad


@functools.cache
def _forward_kernel(ids_dtype: torch.dtype, device: torch.device):
    name = "embedding_forward_i64" if ids_dtype == torch.int64 else "embedding_forward_i32"
    return kernel_for("embedding", name, device)


def backward(
    ids: Tensor,
    grad_out: Tensor,
    num_embeddings: int,
    dtype: torch.dtype,
    segments: str | None = None,
) -> Tensor:
    """``grad_weight [num_embeddings, hidden]``: each id's gradient rows summed in fp32 in
    increasing position order, rounded once; out-of-range ids dropped.

    ``segments`` (default ``BACKWARD_SEGMENTS``) picks how the runs of equal sorted ids are
    found, with the same sums either way: ``"static"`` lets the kernel find them in the
    sorted ids (``embedding_backward_runs``), so nothing is read back to the host and the
    call can be captured in a CUDA graph; ``"unique"`` (``torch.unique_consecutive``) sizes
    the segment arrays to the number of distinct ids, which costs one synchronisation per
    call."""
    segments = BACKWARD_SEGMENTS if segments is None else segments
    if segments not in ("static", "unique"):
        raise ValueError(f"segments must be 'static' or 'unique', not {segments!r}")
    flat_ids = ids.reshape(-1).long()
    hidden = grad_out.shape[-1]
    grad_rows = grad_out.reshape(flat_ids.numel(), hidden).to(dtype).contiguous()
    grad_weight = torch.zeros(num_embeddings, hidden, dtype=dtype, device=grad_out.device)
    if flat_ids.numel() == 0 or hidden == 0:
        return grad_weight
    # A stable sort keeps equal ids in increasing position order: the order of the sums.
    if segments == "static" and sort_ids_applies(flat_ids.numel(), num_embeddings):
        sorted_ids, sorted_positions = sort_ids(flat_ids, num_embeddings)
    else:
        sorted_ids, sorted_positions = torch.sort(flat_ids, stable=True)
    if segments == "static":
        _launch_runs(grad_weight, grad_rows, sorted_ids, sorted_positions)
    else:
        segment_ids, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
        segment_offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=grad_out.device)
        torch.cumsum(counts, 0, out=segment_offsets[1:])
        threads = _BACKWARD_THREADS
        launch(
            kernel_for("embedding", _BACKWARD_KERNELS[dtype], grad_out.device),
            grad_out.device,
            grid=(segment_ids.numel(), -(-hidden // threads)),
            block=(threads,),
            args=(
                grad_weight,
                grad_rows,
                sorted_positions,
                segment_offsets,
                segment_ids,
                hidden,
                num_embeddings,
            ),
        )
    return grad_weight


def sort_ids_applies(num_ids: int, num_embeddings: int) -> bool:
    """Whether ``sort_ids`` takes these ids: at most ``SORT_MAX_IDS`` (one CTA's shared memory)
    and ids that fit the key's upper 32 bits."""
    return 0 < num_ids <= SORT_MAX_IDS and num_embeddings <= 2**31


def sort_ids(flat_ids: Tensor, num_embeddings: int) -> tuple[Tensor, Tensor]:
    """``(sorted_ids, sorted_positions)`` of the int64 ``flat_ids`` in one launch
    (``embedding_sort_ids``): the order of ``torch.sort(flat_ids, stable=True)``, with every id
    outside ``[0, num_embeddings)`` replaced by -1 (the runs kernel drops both alike).  Only
    where ``sort_ids_applies``."""
    flat_ids = flat_ids.contiguous()  # the kernel reads them by address
    num_ids = flat_ids.numel()
    keys = max(2, 1 << (num_ids - 1).bit_length())  # a power of two >= num_ids
    shared = 8 * keys
    device = flat_ids.device
    index = device.index
    kernel = _sort_kernel(device)
    allow_dynamic_shared(kernel, shared, index)
    out = torch.empty(2, num_ids, dtype=torch.int64, device=device)
    kernel(
        (1,),
        (min(_SORT_THREADS, keys),),
        (flat_ids.data_ptr(), num_ids, num_embeddings, out[0].data_ptr(), out[1].data_ptr(), keys),
        shared,
        current_raw_stream(index),
        index,
        False,
    )
    return out[0], out[1]


@functools.cache
def _sort_kernel(device: torch.device):
    return kernel_for("embedding", "embedding_sort_ids", device)


def _launch_runs(
    grad_weight: Tensor, grad_rows: Tensor, sorted_ids: Tensor, sorted_positions: Tensor
) -> None:
    num_ids = sorted_ids.numel()
    vocab, hidden = grad_weight.shape
    column_blocks = -(-hidden // _BACKWARD_THREADS)
    device = grad_weight.device
    index = device.index
    _runs_kernel(grad_weight.dtype, device)(
        (runs_grid_x(num_ids, hidden), column_blocks),
        (_BACKWARD_THREADS,),
        (
            grad_weight.data_ptr(),
            grad_rows.data_ptr(),
            sorted_ids.data_ptr(),
            sorted_positions.data_ptr(),
            num_ids,
            hidden,
            vocab,
        ),
        0,
        current_raw_stream(index),
        index,
        False,
    )


def runs_grid_x(num_ids: int, hidden: int) -> int:
    """CTAs along the sorted ids for the runs backward, ``_RUNS_CTAS`` in all at most: a CTA
    walks the positions x, x + grid.x, ... and sums the runs that start there, so any count
    covers them, while a 132-SM GPU still gets many waves.  Only the speed depends on it,
    never the bits."""
    column_blocks = -(-hidden // _BACKWARD_THREADS)
    return max(1, min(num_ids, _RUNS_CTAS // column_blocks))


@functools.cache
def _runs_kernel(dtype: torch.dtype, device: torch.device):
    return kernel_for("embedding", _RUNS_KERNELS[dtype], device)

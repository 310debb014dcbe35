"""SiLU-and-multiply on CUDA/HIP: launches ``kernels_cu/silu_mul.cu``.

Elementwise: every output element is one function of its own inputs, computed by the same
code on every path, so it is bitwise the same in any batch.  The fused ``[..., 2I]`` layout
is read in place (gate and up are two strided views of it).  No call synchronises.
Arguments are validated once by the op (``batchinv.ops.silu_mul``), not here.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ..runtime import current_raw_stream, kernel_for, launch
from .rms_norm import as_rows

THREADS = 128  # kThreads in kernels_cu/silu_mul.cu
# A CTA covers at most this many elements of one row: 128 threads x 2 chunks of each input
# (kUnroll forward, kBackwardUnroll backward) x 8 bf16, so each thread issues all its loads
# before it computes; tiles are multiples of TILE_QUANTUM elements so that, on the vector path,
# they are whole 16-byte chunks for every dtype and every thread gets work (2 chunks measured
# faster than 4 for the forward's arithmetic: docs/tuning/silu_mul.md).  Elementwise: the
# tiling changes speed only, never bits.
MAX_TILE_ELEMENTS = 2048
MAX_BACKWARD_TILE_ELEMENTS = 2048
TILE_QUANTUM = 8 * THREADS

_MAX_GRID_X = 2**31 - 1
_SUFFIX = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}


def _tiling(rows: int, inter: int, max_tile: int = MAX_TILE_ELEMENTS) -> tuple[int, int, int]:
    """``(grid, tiles_per_row, tile_elements)``, tiles of at most ``max_tile`` elements."""
    tiles = -(-inter // max_tile)
    tile = -(-inter // tiles)
    tile = -(-tile // TILE_QUANTUM) * TILE_QUANTUM
    tiles = -(-inter // tile)
    grid = rows * tiles
    if grid > _MAX_GRID_X:
        raise ValueError(f"{rows} rows of {inter} elements are more than one launch supports")
    return grid, tiles, tile


def _forward_rows(out: Tensor, gate: Tensor, up: Tensor, rows: int, inter: int) -> None:
    if rows == 0:
        return
    grid, tiles, tile = _tiling(rows, inter)
    launch(
        kernel_for("silu_mul", f"silu_mul_forward_{_SUFFIX[gate.dtype]}", gate.device),
        gate.device,
        grid=(grid,),
        block=(THREADS,),
        args=(out, gate, up, rows, inter, out.stride(0), gate.stride(0), up.stride(0), tiles, tile),
    )


def forward(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up``; gate and up ``[..., I]``, any strides (copied only if needed)."""
    inter = gate.shape[-1]
    gate_rows, up_rows = as_rows(gate, inter), as_rows(up, inter)
    rows = gate_rows.shape[0]
    out = torch.empty((rows, inter), dtype=gate.dtype, device=gate.device)
    _forward_rows(out, gate_rows, up_rows, rows, inter)
    return out.reshape(gate.shape)


@functools.cache
def _forward_launch(inter: int, dtype: torch.dtype, device: torch.device):
    """``(kernel, tiles per row, tile elements)`` of a forward over rows of ``inter``."""
    _, tiles, tile = _tiling(1, inter)
    return kernel_for("silu_mul", f"silu_mul_forward_{_SUFFIX[dtype]}", device), tiles, tile


def _launch_contiguous(out: Tensor, gate_ptr: int, up_ptr: int, in_stride: int, rows: int):
    """The forward on ``rows`` rows of ``out.shape[-1]`` elements, gate and up rows
    ``in_stride`` apart, out contiguous: the launch of ``_forward_rows`` with its arguments
    as ints."""
    inter = out.shape[-1]
    device = out.device
    kernel, tiles, tile = _forward_launch(inter, out.dtype, device)
    grid = rows * tiles
    if grid > _MAX_GRID_X:
        raise ValueError(f"{rows} rows of {inter} elements are more than one launch supports")
    index = device.index
    kernel(
        (grid,),
        (THREADS,),
        (out.data_ptr(), gate_ptr, up_ptr, rows, inter, inter, in_stride, in_stride, tiles, tile),
        0,
        current_raw_stream(index),
        index,
        False,
    )


def forward_no_grad(gate: Tensor, up: Tensor) -> Tensor:
    """``forward`` for a call that needs no backward, in fewer host steps when gate and up
    are contiguous (the same kernel, hence bits); other layouts take ``forward``."""
    if not (gate.is_contiguous() and up.is_contiguous()):
        return forward(gate, up)
    out = torch.empty_like(gate)
    rows = gate.numel() // gate.shape[-1]
    if rows:
        _launch_contiguous(out, gate.data_ptr(), up.data_ptr(), gate.shape[-1], rows)
    return out


def forward_fused_no_grad(gate_up: Tensor) -> Tensor:
    """``forward_fused`` for a call that needs no backward, in fewer host steps when gate_up
    is contiguous; other layouts take ``forward_fused``."""
    if not gate_up.is_contiguous():
        return forward_fused(gate_up)
    width = gate_up.shape[-1]
    inter = width // 2
    out = gate_up.new_empty((*gate_up.shape[:-1], inter))
    rows = gate_up.numel() // width
    if rows:
        base = gate_up.data_ptr()
        _launch_contiguous(out, base, base + inter * gate_up.element_size(), width, rows)
    return out


def forward_fused(gate_up: Tensor) -> Tensor:
    """``silu(gate_up[..., :I]) * gate_up[..., I:]``, read in place."""
    inter = gate_up.shape[-1] // 2
    both = as_rows(gate_up, 2 * inter)
    rows = both.shape[0]
    out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    _forward_rows(out, both[:, :inter], both[:, inter:], rows, inter)
    return out.reshape(*gate_up.shape[:-1], inter)


def _backward_rows(
    grad_gate: Tensor,
    grad_up: Tensor,
    grad_out: Tensor,
    gate: Tensor,
    up: Tensor,
    rows: int,
    inter: int,
) -> None:
    if rows == 0:
        return
    grid, tiles, tile = _tiling(rows, inter, MAX_BACKWARD_TILE_ELEMENTS)
    launch(
        kernel_for("silu_mul", f"silu_mul_backward_{_SUFFIX[gate.dtype]}", gate.device),
        gate.device,
        grid=(grid,),
        block=(THREADS,),
        args=(
            grad_gate,
            grad_up,
            grad_out,
            gate,
            up,
            rows,
            inter,
            grad_gate.stride(0),
            grad_up.stride(0),
            grad_out.stride(0),
            gate.stride(0),
            up.stride(0),
            tiles,
            tile,
        ),
    )


@functools.cache
def _backward_launch(inter: int, dtype: torch.dtype, device: torch.device):
    """``(kernel, tiles per row, tile elements)`` of a backward over rows of ``inter``."""
    _, tiles, tile = _tiling(1, inter, MAX_BACKWARD_TILE_ELEMENTS)
    return kernel_for("silu_mul", f"silu_mul_backward_{_SUFFIX[dtype]}", device), tiles, tile


def _launch_backward_contiguous(
    grad_gate_ptr: int,
    grad_up_ptr: int,
    grad_out: Tensor,
    gate_ptr: int,
    up_ptr: int,
    stride: int,
    rows: int,
) -> None:
    """``_backward_rows`` with its arguments as ints: ``grad_out`` contiguous, the gradients
    and the inputs rows ``stride`` elements apart (the same kernel and arguments)."""
    inter = grad_out.shape[-1]
    device = grad_out.device
    kernel, tiles, tile = _backward_launch(inter, grad_out.dtype, device)
    grid = rows * tiles
    if grid > _MAX_GRID_X:
        raise ValueError(f"{rows} rows of {inter} elements are more than one launch supports")
    index = device.index
    kernel(
        (grid,),
        (THREADS,),
        (
            grad_gate_ptr,
            grad_up_ptr,
            grad_out.data_ptr(),
            gate_ptr,
            up_ptr,
            rows,
            inter,
            stride,
            stride,
            inter,
            stride,
            stride,
            tiles,
            tile,
        ),
        0,
        current_raw_stream(index),
        index,
        False,
    )


def backward(grad_out: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    """``(grad_gate, grad_up)`` in the inputs' shape and dtype.  Contiguous operands of one
    dtype (the common case in a backward) take one native call with pointers as ints and the
    gradients allocated in their final shape; other layouts reshape and copy as needed."""
    if (
        grad_out.dtype == gate.dtype
        and grad_out.is_contiguous()
        and gate.is_contiguous()
        and up.is_contiguous()
    ):
        grad_gate, grad_up = torch.empty_like(gate), torch.empty_like(up)
        rows = gate.numel() // gate.shape[-1]
        if rows:
            _launch_backward_contiguous(
                grad_gate.data_ptr(),
                grad_up.data_ptr(),
                grad_out,
                gate.data_ptr(),
                up.data_ptr(),
                gate.shape[-1],
                rows,
            )
        return grad_gate, grad_up
    inter = gate.shape[-1]
    gate_rows, up_rows = as_rows(gate, inter), as_rows(up, inter)
    rows = gate_rows.shape[0]
    grad_rows = as_rows(grad_out.to(gate.dtype), inter)
    grad_gate = torch.empty((rows, inter), dtype=gate.dtype, device=gate.device)
    grad_up = torch.empty_like(grad_gate)
    _backward_rows(grad_gate, grad_up, grad_rows, gate_rows, up_rows, rows, inter)
    return grad_gate.reshape(gate.shape), grad_up.reshape(up.shape)


def backward_fused(grad_out: Tensor, gate_up: Tensor) -> Tensor:
    """The gradient of ``gate_up`` ``[..., 2I]``: grad_gate in the first half, grad_up after.
    Contiguous operands of one dtype take one native call, as in ``backward``."""
    if grad_out.dtype == gate_up.dtype and grad_out.is_contiguous() and gate_up.is_contiguous():
        width = gate_up.shape[-1]
        inter = width // 2
        grad = torch.empty_like(gate_up)
        rows = gate_up.numel() // width
        if rows:
            half = inter * gate_up.element_size()
            grad_ptr, base = grad.data_ptr(), gate_up.data_ptr()
            _launch_backward_contiguous(
                grad_ptr, grad_ptr + half, grad_out, base, base + half, width, rows
            )
        return grad
    inter = gate_up.shape[-1] // 2
    both = as_rows(gate_up, 2 * inter)
    rows = both.shape[0]
    grad_rows = as_rows(grad_out.to(gate_up.dtype), inter)
    grad = torch.empty((rows, 2 * inter), dtype=gate_up.dtype, device=gate_up.device)
    _backward_rows(
        grad[:, :inter], grad[:, inter:], grad_rows, both[:, :inter], both[:, inter:], rows, inter
    )
    return grad.reshape(gate_up.shape)

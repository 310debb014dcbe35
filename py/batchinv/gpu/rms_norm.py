"""RMSNorm and fused residual-add + RMSNorm on CUDA/HIP: launches ``kernels_cu/rms_norm.cu``.

The launch geometry (threads per row, chunks per thread, rows per CTA, kept in registers or
streamed) is chosen from the row length ``d`` and the dtype alone (``geometry``), never from
the number of rows, so a row's reduction order, and its bits, are the same in any batch.  The
forward can also write ``inv_rms`` per row (fp32), which the backward reads instead of
recomputing it.  No call synchronises with the device.

``forward``/``fused_add_forward``/``backward`` validate their arguments; the ``*_unchecked``
variants are for callers that already did (the ops), to keep the host path short.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ..reference.rms_norm import check_fused_add_rms_norm_args, check_rms_norm_args
from ._launch import kernel_for, launch

# Keep in step with kernels_cu/rms_norm.cu: (threads per row, 16-byte chunks per thread).
GEOMETRIES = ((4, 4), (16, 4), (32, 4), (64, 8), (128, 8), (256, 8), (512, 8))
STREAMING_THREADS = 1024
MIN_CTA_THREADS = 128
WEIGHT_GRAD_ROWS = 64  # rows per partial of grad_weight (a constant, not a tuning knob)
WEIGHT_GRAD_THREADS = 256

_MAX_GRID_X = 2**31 - 1
_MAX_GRID_Y = 65535
_SUFFIX = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}


@functools.cache
def geometry(d: int, dtype: torch.dtype) -> tuple[str, int, int]:
    """``(kernel geometry name, threads per row, CTA threads)`` for rows of ``d`` elements."""
    chunk_elems = 16 // dtype.itemsize
    chunks = -(-d // chunk_elems)
    for threads, per_thread in GEOMETRIES:
        if threads * per_thread >= chunks:
            return f"t{threads}", threads, max(threads, MIN_CTA_THREADS)
    return "stream", STREAMING_THREADS, STREAMING_THREADS


def as_rows(t: Tensor, width: int) -> Tensor:
    """``t`` as ``[rows, width]`` with unit stride along ``width`` and one row stride.

    A view when ``t``'s layout allows it, else a contiguous copy (the input is never changed).
    """
    rows = t.reshape(-1, width)
    if width > 1 and rows.stride(1) != 1:
        rows = rows.contiguous()
    return rows


def _launch_rows(
    kernel: str, device: torch.device, d: int, dtype: torch.dtype, rows: int, args
) -> None:
    name, threads, cta = geometry(d, dtype)
    rows_per_cta = cta // threads
    grid = -(-rows // rows_per_cta)
    if grid > _MAX_GRID_X:
        raise ValueError(f"x has {rows} rows; at most {_MAX_GRID_X * rows_per_cta} are supported")
    launch(
        kernel_for("rms_norm", f"{kernel}_{_SUFFIX[dtype]}_{name}", device),
        device,
        grid=(grid,),
        block=(cta,),
        args=args,
    )


def forward_unchecked(
    x: Tensor,
    weight: Tensor,
    eps: float,
    residual: Tensor | None = None,
    *,
    need_rstd: bool = True,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``(y, new_residual, rstd)`` for already validated arguments; ``new_residual`` is None
    without a residual, ``rstd`` None when ``need_rstd`` is False (nothing saved for a
    backward: one allocation less)."""
    d = x.shape[-1]
    x_rows = as_rows(x, d)
    rows = x_rows.shape[0]
    residual_rows = as_rows(residual, d) if residual is not None else None
    y = torch.empty((rows, d), dtype=x.dtype, device=x.device)
    new_residual = torch.empty_like(y) if residual is not None else None
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device) if need_rstd else None
    if rows > 0:
        _launch_rows(
            "rms_norm_forward" if residual is None else "rms_norm_fused_forward",
            x.device,
            d,
            x.dtype,
            rows,
            (
                y,
                new_residual if new_residual is not None else 0,
                rstd if rstd is not None else 0,
                x_rows,
                residual_rows if residual_rows is not None else 0,
                weight if weight.is_contiguous() else weight.contiguous(),
                rows,
                d,
                x_rows.stride(0),
                residual_rows.stride(0) if residual_rows is not None else 0,
                float(eps),
            ),
        )
    y = y.view(x.shape)
    if new_residual is not None:
        new_residual = new_residual.view(x.shape)
    return y, new_residual, rstd


def forward(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``(y, rstd)``: y in x's shape and dtype, rstd the fp32 ``inv_rms`` of each row."""
    check_rms_norm_args(x, weight, eps)
    y, _, rstd = forward_unchecked(x, weight, eps)
    return y, rstd


def fused_add_forward(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, new_residual, rstd)`` with ``new_residual = round(x + residual)``."""
    check_fused_add_rms_norm_args(x, residual, weight, eps)
    return forward_unchecked(x, weight, eps, residual)


def _weight_grad(grad_rows: Tensor, x_rows: Tensor, rstd: Tensor, dtype: torch.dtype) -> Tensor:
    """``sum over rows of grad_y * x_hat`` by the fixed tree of kernels_cu/rms_norm.cu."""
    rows, d = grad_rows.shape
    device = grad_rows.device
    grad_weight = torch.empty(d, dtype=dtype, device=device)
    if rows == 0:
        return grad_weight.zero_()
    col_blocks = -(-d // WEIGHT_GRAD_THREADS)
    if col_blocks > _MAX_GRID_Y:
        raise ValueError(f"x.shape[-1] = {d} is too large for the weight gradient kernel")
    chunks = -(-rows // WEIGHT_GRAD_ROWS)
    partials = torch.empty((chunks, d), dtype=torch.float32, device=device)
    launch(
        kernel_for("rms_norm", f"rms_norm_weight_grad_partials_{_SUFFIX[dtype]}", device),
        device,
        grid=(chunks, col_blocks),
        block=(WEIGHT_GRAD_THREADS,),
        args=(partials, grad_rows, x_rows, rstd, rows, d, x_rows.stride(0)),
    )
    while partials.shape[0] > WEIGHT_GRAD_ROWS:
        count = partials.shape[0]
        chunks = -(-count // WEIGHT_GRAD_ROWS)
        reduced = torch.empty((chunks, d), dtype=torch.float32, device=device)
        launch(
            kernel_for("rms_norm", "rms_norm_weight_grad_reduce", device),
            device,
            grid=(chunks, col_blocks),
            block=(WEIGHT_GRAD_THREADS,),
            args=(reduced, partials, count, d),
        )
        partials = reduced
    launch(
        kernel_for("rms_norm", f"rms_norm_weight_grad_final_{_SUFFIX[dtype]}", device),
        device,
        grid=(col_blocks,),
        block=(WEIGHT_GRAD_THREADS,),
        args=(grad_weight, partials, partials.shape[0], d),
    )
    return grad_weight


def backward(
    grad_y: Tensor,
    x: Tensor,
    weight: Tensor,
    rstd: Tensor,
    grad_residual: Tensor | None = None,
    *,
    weight_grad: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """``(grad_x, grad_weight)`` from the forward's saved ``x`` (for the fused form, the new
    residual) and ``rstd``; ``grad_residual`` (fused form) is added to grad_x in fp32 before
    its one rounding.  ``weight_grad=False`` skips grad_weight (returned as None)."""
    d = x.shape[-1]
    x_rows = as_rows(x, d)
    rows = x_rows.shape[0]
    grad_rows = grad_y.to(x.dtype).reshape(rows, d).contiguous()
    extra = (
        grad_residual.to(x.dtype).reshape(rows, d).contiguous()
        if grad_residual is not None
        else None
    )
    grad_x = torch.empty((rows, d), dtype=x.dtype, device=x.device)
    if rows > 0:
        _launch_rows(
            "rms_norm_backward",
            x.device,
            d,
            x.dtype,
            rows,
            (
                grad_x,
                grad_rows,
                x_rows,
                weight.contiguous(),
                rstd,
                extra if extra is not None else 0,
                rows,
                d,
                x_rows.stride(0),
            ),
        )
    grad_weight = _weight_grad(grad_rows, x_rows, rstd, weight.dtype) if weight_grad else None
    return grad_x.reshape(x.shape), grad_weight

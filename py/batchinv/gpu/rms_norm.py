"""RMSNorm and fused residual-add + RMSNorm on CUDA/HIP: launches ``kernels_cu/rms_norm.cu``.

The launch geometry (threads per row, chunks per thread, rows per CTA, kept in registers or
streamed) is chosen from the row length ``d`` and the dtype alone (``geometry``), never from
the number of rows, so a row's reduction order, and its bits, are the same in any batch.  The
forward can also write ``inv_rms`` per row (fp32), which the backward reads instead of
recomputing it.  No call synchronises with the device.

Arguments are validated once by the op (``batchinv.ops.rms_norm``); nothing here checks them
again, so the host path of a call is the launch alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading

import torch
from torch import Tensor

from ..registry import backend_of
from ..runtime import allow_dynamic_shared, current_raw_stream, kernel_for, launch, uses_hopper

# Keep in step with kernels_cu/rms_norm.cu: (threads per row, 16-byte chunks per thread), the
# first that holds the row is used.  The tree follows the threads per row only, so (128, 2),
# (128, 5) and (128, 8) reduce a row alike; fewer chunks only bound the registers.  (128, 2): rows
# of 129 .. 256 chunks (bf16 hidden 2048), faster there than (64, 8) (docs/tuning/rms_norm.md);
# (128, 5): bf16 d in (4096, 5120] (Qwen3-14B/32B).
GEOMETRIES = ((4, 4), (16, 4), (32, 4), (128, 2), (64, 8), (128, 5), (128, 8), (256, 8), (512, 8))
# The backward's list: the same, except that rows of 129 .. 512 chunks (bf16 hidden 2048 .. 4096)
# use 128 threads of 4 chunks instead of (128, 2) and (64, 8) (the fused backward with 8 chunks of
# x and dy per thread is latency bound).  It fixes the backward's row tree (grad_x)
# and grad_weight's first level, as the forward's list fixes the forward's; both depend on d and
# the dtype only.
BACKWARD_GEOMETRIES = ((4, 4), (16, 4), (32, 4), (128, 4), (128, 5), (128, 8), (256, 8), (512, 8))
# Forward kernels with an entry of their own for 16-byte vector launches (``*_vec``: no
# per-element tests, the same operations and bits; kernels_cu/rms_norm.cu's
# BATCHINV_RMS_NORM_FORWARD_VECTOR_KERNELS), where it measured faster; for the other geometries
# it was level or slower (docs/tuning/rms_norm.md).
VECTOR_ENTRIES = frozenset(
    {
        ("rms_norm_forward", "t64"),
        ("rms_norm_fused_forward", "t64"),
        ("rms_norm_fused_forward", "t128k5"),
    }
)
STREAMING_THREADS = 1024
MIN_CTA_THREADS = 128
# grad_weight's tree (kernels_cu/rms_norm.cu): first-level partials of at least this many rows
# (a constant, not a tuning knob), then sums of 64 consecutive partial rows.
WEIGHT_GRAD_CHUNK_ROWS = 16
# The fused backward of each geometry in TWO_GROUPS, in the dtypes listed there and from the
# row count listed there on, runs 256-thread CTAs of two row groups of 16 rows (kernel entries
# ``*_<geometry>g2``): a first-level partial of 2 x 16 rows, so half the partial rows to write
# and reduce with as many row groups in flight as 1 x 16.  A function of the row count, d and
# the dtype only, never of the SM count.  t128k4 (bf16 hidden 4096, fp32 512 < d <= 2048) from
# 16384 rows: below that it was slower, and fp16's entry (164 registers, one CTA per SM) slower
# at every row count, so those keep 1 x 16.  t128k5 (bf16/fp16 hidden 5120, fp32
# 2048 < d <= 2560), every dtype, from 8192 rows: faster than 1 x 16 from there on, level at
# 4096 rows.  Not kept: more rows per group at large row counts (at most 256 partial rows),
# faster on one GPU and slower on another.  Measurements: docs/tuning/rms_norm.md.
# geometry -> (dtypes, first row count with two groups)
TWO_GROUPS = {
    "t128k4": ((torch.bfloat16, torch.float32), 16384),
    "t128k5": ((torch.bfloat16, torch.float16, torch.float32), 8192),
}
TWO_GROUPS_SHAPE = (2, 16)
WEIGHT_GRAD_REDUCE_ROWS = 64
WEIGHT_GRAD_THREADS = 256
# The last two levels (runs of 64 partial rows, then the run sums) run as one grid once at most
# 64 * 64 partial rows remain: 16 columns per CTA, 32 threads per column summing runs
# (kLastLevelsColumns, kLastLevelsRunSlots in kernels_cu/rms_norm.cu).
WEIGHT_GRAD_LAST_LEVELS_ROWS = WEIGHT_GRAD_REDUCE_ROWS * WEIGHT_GRAD_REDUCE_ROWS
LAST_LEVELS_COLUMNS = 16
LAST_LEVELS_THREADS = 512
# The fused backward keeps a CTA's per-column sums in shared memory (fp32, CTA threads * chunks
# per thread * elements per chunk), at most this many bytes; longer rows take grad_x and a
# column pass for the first level separately (the same tree, so the same bits).
FUSED_WEIGHT_GRAD_SHARED_BYTES = 32768
# Below this many CTAs (counted in 128-thread CTAs: blocks * CTA threads / 128) the fused
# backward leaves SMs idle (1024 x 4096 bf16: 64 CTAs, about twice the time of the two passes);
# the two passes then run instead, with the same bits.
FUSED_WEIGHT_GRAD_MIN_BLOCKS = 256
# The last-levels grid sums each run of partial rows as soon as the fused backward has stored
# it (per-run counts, programmatic launch; same sums, same bits), instead of waiting for the
# whole first level: ``run_counters_for``.  False: it waits for the first level to end.
OVERLAP_LAST_LEVELS = True
# ... for the fused backward of at least this many rows on geometries of at least this many
# threads per row (CTAs that live long): it ran faster from 16384 rows at hidden 2048-5120, but
# slower at fewer rows and for short CTAs (t4), each of which ends with a fence and a count
# (docs/tuning/rms_norm.md).
OVERLAP_MIN_ROWS = 16384
OVERLAP_MIN_THREADS = 128
# Where the counts live: "stream", one set per (device, stream), reused call after call (every
# call adds 64 to each counter; no zeroing); "call", zeroed for each call (kept for comparing the
# two).  A CUDA graph capture always takes zeroed counters of its own (each replay runs the
# captured zeroing again).
RUN_COUNTERS = "stream"
RUN_COUNTER_RUNS = WEIGHT_GRAD_LAST_LEVELS_ROWS // WEIGHT_GRAD_REDUCE_ROWS  # kMaxRuns
RUN_COUNTER_STRIDE = 32  # 32-bit words from one run's counter to the next (128 bytes)
# t128k4's bf16/fp16 fused backward on CUDA stages the next row's dy and x in shared memory
# (two stages of 128 threads x 4 chunks x 16 bytes, both tensors: kStagedRows and
# kStagedRowsBytes in kernels_cu/rms_norm.cu), passed as dynamic shared memory.
STAGED_ROWS_GEOMETRY = "t128k4"
STAGED_ROWS_DTYPES = (torch.bfloat16, torch.float16)
STAGED_ROWS_BYTES = 2 * 2 * 128 * 4 * 16

_MAX_GRID_X = 2**31 - 1
_MAX_GRID_Y = 65535
_SUFFIX = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}


def geometry_name(threads: int, per_thread: int) -> str:
    """The kernels' name for a geometry: ``t<threads>``, or ``t<threads>k<chunks>`` for a
    thread count that also has a geometry with more chunks per thread."""
    most = max(k for t, k in GEOMETRIES if t == threads)
    return f"t{threads}" if per_thread == most else f"t{threads}k{per_thread}"


def _holding(d: int, dtype: torch.dtype, table) -> tuple[int, int] | None:
    """The first ``(threads, chunks per thread)`` of ``table`` that holds a row of ``d``
    elements (None: streaming)."""
    chunks = -(-d // (16 // dtype.itemsize))
    for threads, per_thread in table:
        if threads * per_thread >= chunks:
            return threads, per_thread
    return None


def _named(held: tuple[int, int] | None) -> tuple[str, int, int]:
    if held is None:
        return "stream", STREAMING_THREADS, STREAMING_THREADS
    threads, per_thread = held
    return geometry_name(threads, per_thread), threads, max(threads, MIN_CTA_THREADS)


@functools.cache
def backward_chunks_per_thread(d: int, dtype: torch.dtype) -> int | None:
    """The backward geometry's chunks per thread for rows of ``d`` elements (None: streaming)."""
    held = _holding(d, dtype, BACKWARD_GEOMETRIES)
    return None if held is None else held[1]


@functools.cache
def geometry(d: int, dtype: torch.dtype) -> tuple[str, int, int]:
    """``(kernel geometry name, threads per row, CTA threads)`` of the forward for rows of
    ``d`` elements."""
    return _named(_holding(d, dtype, GEOMETRIES))


@functools.cache
def backward_geometry(d: int, dtype: torch.dtype) -> tuple[str, int, int]:
    """``(kernel geometry name, threads per row, CTA threads)`` of the backward."""
    return _named(_holding(d, dtype, BACKWARD_GEOMETRIES))


def as_rows(t: Tensor, width: int) -> Tensor:
    """``t`` as ``[rows, width]`` with unit stride along ``width`` and one row stride.

    A view when ``t``'s layout allows it, else a contiguous copy (the input is never changed).
    """
    rows = t.reshape(-1, width)
    if width > 1 and rows.stride(1) != 1:
        rows = rows.contiguous()
    return rows


def _forward_vector_launch(args, itemsize: int) -> bool:
    """Whether a forward launch's ``args`` (the kernels' order: y, new_residual, rstd, x,
    residual, weight, rows, d, x_stride, residual_stride, eps) take 16-byte vectors: every
    pointer, row stride and ``d * itemsize`` a multiple of 16 (forward_rows' condition)."""
    y, new_residual, _, x, residual, weight, _, d, x_stride, residual_stride, _ = args
    pointers = (y, new_residual, x, residual, weight)
    # an absent tensor is passed as the null pointer 0, which the kernels count as aligned
    aligned = all((p if isinstance(p, int) else p.data_ptr()) % 16 == 0 for p in pointers)
    return aligned and all((n * itemsize) % 16 == 0 for n in (d, x_stride, residual_stride))


def _launch_rows(
    kernel: str, device: torch.device, d: int, dtype: torch.dtype, rows: int, args
) -> None:
    """One row per group of threads; ``rms_norm_backward`` takes the backward's geometry,
    vector launches of ``VECTOR_ENTRIES`` their ``*_vec`` entry (CUDA)."""
    pick = backward_geometry if kernel == "rms_norm_backward" else geometry
    name, threads, cta = pick(d, dtype)
    rows_per_cta = cta // threads
    grid = -(-rows // rows_per_cta)
    if grid > _MAX_GRID_X:
        raise ValueError(f"x has {rows} rows; at most {_MAX_GRID_X * rows_per_cta} are supported")
    entry = f"{kernel}_{_SUFFIX[dtype]}_{name}"
    if (
        (kernel, name) in VECTOR_ENTRIES
        and backend_of(device) == "cuda"  # measured on CUDA only
        and _forward_vector_launch(args, dtype.itemsize)
    ):
        entry += "_vec"
    launch(
        kernel_for("rms_norm", entry, device),
        device,
        grid=(grid,),
        block=(cta,),
        args=args,
    )


def run_forward(
    x: Tensor,
    weight: Tensor,
    eps: float,
    residual: Tensor | None = None,
    *,
    need_rstd: bool = True,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``(y, new_residual, rstd)``; ``new_residual`` is None without a residual, ``rstd`` None
    when ``need_rstd`` is False (nothing saved for a backward: one allocation less)."""
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


@functools.cache
def _forward_launch(kernel: str, d: int, dtype: torch.dtype, device: torch.device):
    """``(kernel, its *_vec entry or None, rows per CTA, CTA threads)`` of a forward launch on
    contiguous rows of ``d`` elements (what ``_launch_rows`` picks, looked up once)."""
    name, threads, cta = geometry(d, dtype)
    entry = f"{kernel}_{_SUFFIX[dtype]}_{name}"
    vector = (
        (kernel, name) in VECTOR_ENTRIES
        and backend_of(device) == "cuda"  # measured on CUDA only
        and (d * dtype.itemsize) % 16 == 0
    )
    vec_kernel = kernel_for("rms_norm", entry + "_vec", device) if vector else None
    return kernel_for("rms_norm", entry, device), vec_kernel, cta // threads, cta


def forward_no_grad(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    """``y``, or ``(y, new_residual)`` with a residual: ``run_forward`` for a call that needs
    no backward, in as few host steps as the launch allows when x, weight (and residual) are
    contiguous: one allocation per output, no reshapes, pointers passed as ints, the same
    kernels (hence bits) as ``run_forward``.  Other layouts take ``run_forward``."""
    if not (
        x.is_contiguous()
        and weight.is_contiguous()
        and (residual is None or residual.is_contiguous())
    ):
        y, new_residual, _ = run_forward(x, weight, eps, residual, need_rstd=False)
        return y if residual is None else (y, new_residual)
    d = x.shape[-1]
    rows = x.numel() // d
    y = torch.empty_like(x)
    new_residual = None if residual is None else torch.empty_like(x)
    if rows == 0:
        return y if residual is None else (y, new_residual)
    device = x.device
    kernel, vec_kernel, rows_per_cta, cta = _forward_launch(
        "rms_norm_forward" if residual is None else "rms_norm_fused_forward", d, x.dtype, device
    )
    grid = -(-rows // rows_per_cta)
    if grid > _MAX_GRID_X:
        raise ValueError(f"x has {rows} rows; at most {_MAX_GRID_X * rows_per_cta} are supported")
    x_ptr, w_ptr, y_ptr = x.data_ptr(), weight.data_ptr(), y.data_ptr()
    if residual is None:
        r_ptr = n_ptr = 0
    else:
        r_ptr, n_ptr = residual.data_ptr(), new_residual.data_ptr()
    if vec_kernel is not None and not (x_ptr | w_ptr | y_ptr | r_ptr | n_ptr) & 15:
        kernel = vec_kernel
    index = device.index
    kernel(
        (grid,),
        (cta,),
        (y_ptr, n_ptr, 0, x_ptr, r_ptr, w_ptr, rows, d, d, 0 if residual is None else d, eps),
        0,
        current_raw_stream(index),
        index,
        False,
    )
    return y if residual is None else (y, new_residual)


def forward(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``(y, rstd)``: y in x's shape and dtype, rstd the fp32 ``inv_rms`` of each row."""
    y, _, rstd = run_forward(x, weight, eps)
    return y, rstd


def fused_add_forward(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, new_residual, rstd)`` with ``new_residual = round(x + residual)``."""
    return run_forward(x, weight, eps, residual)


def _two_groups(name: str, dtype: torch.dtype) -> bool:
    """Whether geometry ``name`` has two-group entries in ``dtype`` (at any row count)."""
    return name in TWO_GROUPS and dtype in TWO_GROUPS[name][0]


def weight_grad_chunking(d: int, dtype: torch.dtype, rows: int) -> tuple[int, int]:
    """``(row groups, rows in sequence per group)`` of grad_weight's first level for ``rows``
    rows of ``d`` elements: a partial row sums ``groups * rows_in_sequence`` consecutive rows,
    each group its own consecutive run in order, then the groups in order (a function of ``d``,
    the dtype and the row count only: from the backward's geometry, and ``TWO_GROUPS_SHAPE``
    for the geometries and dtypes of ``TWO_GROUPS`` from the row count listed there on
    (bf16/fp32 ``t128k4`` from 16384 rows, every dtype's ``t128k5`` from 8192))."""
    name, threads, cta = backward_geometry(d, dtype)
    if _two_groups(name, dtype) and rows >= TWO_GROUPS[name][1]:
        return TWO_GROUPS_SHAPE
    groups = cta // threads
    return groups, max(1, WEIGHT_GRAD_CHUNK_ROWS // groups)


def _programmatic(device: torch.device) -> bool:
    """Whether grids after the first level are launched with programmatic dependent launch
    (the sm_90a kernels on CUDA)."""
    return backend_of(device) == "cuda" and uses_hopper(device)


class _StreamCounters:
    """One (device, stream)'s counters: zeroed once, then every call adds 64 to each.  The lock
    keeps a call's two launches (first level, last levels) next to each other on the stream
    when several threads launch on it, so that no other call's first level counts between."""

    def __init__(self, counters: Tensor):
        self.counters = counters
        self.calls = 0  # fused backwards launched on these counters
        self.lock = threading.Lock()

    def next_generation(self) -> int:
        """The next call's number on these counters (mod 2**32, as the kernels count)."""
        return (self.calls + 1) % 2**32


class RunCounters:
    """The per-run counts of a fused backward and its call number on them (the kernels'
    ``RunCounters``: the counters read ``64 * (generation - 1)`` before the call).  Use as a
    context around the call's two launches (``backward`` does): counters shared by a stream are
    then held by this call, and ``generation`` is read under that hold."""

    def __init__(self, counters: Tensor, generation: int, stream: _StreamCounters | None = None):
        self.counters = counters
        self.generation = generation
        self._stream = stream

    def __enter__(self) -> RunCounters:
        if self._stream is not None:
            self._stream.lock.acquire()
            self.generation = self._stream.next_generation()
        return self

    def __exit__(self, *exc) -> None:
        if self._stream is not None:
            self._stream.lock.release()

    def args(self) -> tuple:
        return self.counters, self.generation

    def launched(self) -> None:
        """Records that a fused backward counting into these counters was launched: the next
        call on them is the next generation (not counted before: a launch that raised leaves
        the counters as they were)."""
        if self._stream is not None:
            self._stream.calls = self.generation


_STREAM_COUNTERS: dict[tuple[int, int], _StreamCounters] = {}


def run_counters_for(device: torch.device, first_level_rows: int) -> RunCounters | None:
    """Counters for a fused backward of ``first_level_rows`` partial rows whose last-levels grid
    follows it directly and may overlap it (None where it may not: only with a programmatic
    launch and no reduce level between)."""
    if not (
        OVERLAP_LAST_LEVELS
        and _programmatic(device)
        and first_level_rows <= WEIGHT_GRAD_LAST_LEVELS_ROWS
    ):
        return None
    size = RUN_COUNTER_RUNS * RUN_COUNTER_STRIDE
    if RUN_COUNTERS == "call" or torch.cuda.is_current_stream_capturing():
        return RunCounters(torch.zeros(size, dtype=torch.int32, device=device), 1)
    # Calls on one stream run one after the other (a fused backward starts after the
    # last-levels grid before it, which ends after its own first level), so they may share
    # counters.
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, current_raw_stream(index))  # the stream's handle, without a Stream object
    shared = _STREAM_COUNTERS.get(key)
    if shared is None:
        counters = torch.zeros(size, dtype=torch.int32, device=device)
        shared = _STREAM_COUNTERS.setdefault(key, _StreamCounters(counters))
    return RunCounters(shared.counters, shared.next_generation(), shared)


def overlap_rule(d: int, dtype: torch.dtype, rows: int) -> bool:
    """Whether ``backward`` overlaps the last-levels grid with the fused backward of ``rows``
    rows of ``d`` elements where it can (``run_counters_for``): ``OVERLAP_MIN_ROWS`` and
    ``OVERLAP_MIN_THREADS``.  The bits are the same either way."""
    return rows >= OVERLAP_MIN_ROWS and backward_geometry(d, dtype)[1] >= OVERLAP_MIN_THREADS


def _counter_args(run_counters: RunCounters | None) -> tuple:
    """The kernels' (counters, generation) arguments; (0, 0): no hand-off."""
    return run_counters.args() if run_counters is not None else (0, 0)


def _reduce_partials(
    partials: Tensor, dtype: torch.dtype, run_counters: RunCounters | None = None
) -> Tensor:
    """grad_weight from first-level partial rows: sums of 64 consecutive partial rows while
    more than 64 remain, then the rest added in order and rounded once to ``dtype``.  The last
    two levels run as one grid.  Where the sm_90a kernels run, each grid is launched with
    programmatic dependent launch: it starts while the grid before it (the one writing its
    partial rows) finishes, and waits for it before reading them (same bits).
    ``run_counters`` (``run_counters_for``, counted by the fused backward that wrote
    ``partials``): the last-levels grid waits for each run's count instead of for the whole
    grid before it (same bits)."""
    d = partials.shape[1]
    device = partials.device
    programmatic = _programmatic(device)
    if run_counters is not None and (
        partials.shape[0] > WEIGHT_GRAD_LAST_LEVELS_ROWS or not programmatic
    ):
        raise ValueError(
            "run_counters: only for a programmatic last-levels grid right after the first level"
        )
    while partials.shape[0] > WEIGHT_GRAD_LAST_LEVELS_ROWS:
        count = partials.shape[0]
        chunks = -(-count // WEIGHT_GRAD_REDUCE_ROWS)
        reduced = torch.empty((chunks, d), dtype=torch.float32, device=device)
        launch(
            kernel_for("rms_norm", "rms_norm_weight_grad_reduce", device),
            device,
            grid=(chunks, -(-d // WEIGHT_GRAD_THREADS)),
            block=(WEIGHT_GRAD_THREADS,),
            args=(reduced, partials, count, d),
            programmatic=programmatic,
        )
        partials = reduced
    grad_weight = torch.empty(d, dtype=dtype, device=device)
    launch(
        kernel_for("rms_norm", f"rms_norm_weight_grad_last_levels_{_SUFFIX[dtype]}", device),
        device,
        grid=(-(-d // LAST_LEVELS_COLUMNS),),
        block=(LAST_LEVELS_THREADS,),
        args=(grad_weight, partials, partials.shape[0], d, *_counter_args(run_counters)),
        programmatic=programmatic,
    )
    return grad_weight


def launch_fused_backward(
    name: str,
    dtype: torch.dtype,
    device: torch.device,
    blocks: int,
    cta: int,
    args,
    *,
    shape: tuple[int, int] | None = None,
    run_counters: RunCounters | None = None,
) -> None:
    """Launches ``rms_norm_backward_weight_grad_*`` of backward geometry ``name`` (grad_x and
    grad_weight's first level) with the dynamic shared memory it needs.  ``shape``: the first
    level's (row groups per CTA, rows per group): ``TWO_GROUPS_SHAPE`` (then ``cta`` is 256),
    or None for the geometry's own.  ``run_counters``: ``run_counters_for``'s counts, which
    each CTA increments once its partial row is stored (None: not counted)."""
    if run_counters is not None and blocks > WEIGHT_GRAD_LAST_LEVELS_ROWS:
        raise ValueError(
            f"run_counters: {blocks} partial rows, more than the "
            f"{WEIGHT_GRAD_LAST_LEVELS_ROWS} the counters cover"
        )
    entry = name
    if shape is not None:
        if shape != TWO_GROUPS_SHAPE or not _two_groups(name, dtype):
            raise ValueError(f"{name} {dtype} has no fused backward of {shape} first-level rows")
        entry = f"{name}g2"
    kernel = kernel_for(
        "rms_norm", f"rms_norm_backward_weight_grad_{_SUFFIX[dtype]}_{entry}", device
    )
    shared = 0
    if (
        name == STAGED_ROWS_GEOMETRY
        and dtype in STAGED_ROWS_DTYPES
        and backend_of(device) == "cuda"
    ):
        shared = STAGED_ROWS_BYTES * (cta // 128)  # one ring per row group
        allow_dynamic_shared(kernel, shared, device.index or 0)
    launch(
        kernel,
        device,
        grid=(blocks,),
        block=(cta,),
        args=(*args, *_counter_args(run_counters)),
        shared_mem=shared,
    )
    if run_counters is not None:
        run_counters.launched()


def fused_backward_plan(
    d: int, dtype: torch.dtype, rows: int
) -> tuple[str, int, int, tuple[int, int] | None]:
    """``(geometry name, CTAs, CTA threads, shape)`` of the fused backward for ``rows`` rows of
    ``d`` elements; ``shape`` as ``launch_fused_backward`` takes it."""
    name, threads, cta = backward_geometry(d, dtype)
    groups, in_sequence = weight_grad_chunking(d, dtype, rows)
    two_groups = _two_groups(name, dtype) and (groups, in_sequence) == TWO_GROUPS_SHAPE
    shape = TWO_GROUPS_SHAPE if two_groups else None
    return name, -(-rows // (groups * in_sequence)), max(cta, groups * threads), shape


def _check_weight_grad_width(d: int) -> None:
    if -(-d // WEIGHT_GRAD_THREADS) > _MAX_GRID_Y:
        raise ValueError(f"x.shape[-1] = {d} is too large for the weight gradient kernel")


def _weight_grad_separately(
    grad_rows: Tensor, x_rows: Tensor, rstd: Tensor, groups: int, in_sequence: int
) -> Tensor:
    """First-level partials by a column kernel that reads grad_y and x again, in the fused
    kernel's tree (``groups`` runs of ``in_sequence`` rows per partial row)."""
    rows, d = grad_rows.shape
    device = grad_rows.device
    chunks = -(-rows // (groups * in_sequence))
    partials = torch.empty((chunks, d), dtype=torch.float32, device=device)
    launch(
        kernel_for("rms_norm", f"rms_norm_weight_grad_partials_{_SUFFIX[grad_rows.dtype]}", device),
        device,
        grid=(chunks, -(-d // WEIGHT_GRAD_THREADS)),
        block=(WEIGHT_GRAD_THREADS,),
        args=(partials, grad_rows, x_rows, rstd, rows, d, x_rows.stride(0), groups, in_sequence),
    )
    return partials


@functools.cache
def fused_backward_fits(d: int, dtype: torch.dtype) -> bool:
    """Whether rows of ``d`` elements have a fused grad_x + grad_weight kernel."""
    _, _, cta = backward_geometry(d, dtype)
    per_thread = backward_chunks_per_thread(d, dtype)
    if per_thread is None:  # streaming
        return False
    sums_per_chunk = 16 // dtype.itemsize  # one fp32 sum per element
    return cta * per_thread * sums_per_chunk * 4 <= FUSED_WEIGHT_GRAD_SHARED_BYTES


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
    dtype = x.dtype
    if (
        x.is_contiguous()
        and grad_y.is_contiguous()
        and weight.is_contiguous()
        and grad_y.dtype == dtype
        and (
            grad_residual is None
            or (grad_residual.dtype == dtype and grad_residual.is_contiguous())
        )
    ):
        done = _lean_backward(grad_y, x, weight, rstd, grad_residual, weight_grad)
        if done is not None:
            return done
    if (
        x.is_contiguous()
        and x.numel() >= 2 * d  # two rows or more: then x's rows are exactly d apart
        and grad_y.dtype == dtype
        and grad_y.is_contiguous()
        and (
            grad_residual is None
            or (grad_residual.dtype == dtype and grad_residual.is_contiguous())
        )
    ):
        # What an autograd backward hands over: every operand already holds its rows d apart,
        # so it is passed as it is (a [rows, d] view, no cast or copy) and grad_x is allocated
        # in its final shape; the kernels get the same pointers and strides either way.
        rows = x.numel() // d
        x_rows, grad_rows, extra = x.view(rows, d), grad_y.view(rows, d), grad_residual
        grad_x = torch.empty_like(x)
        x_stride = d
    else:
        x_rows = as_rows(x, d)
        rows = x_rows.shape[0]
        grad_rows = grad_y.to(dtype).reshape(rows, d).contiguous()
        extra = (
            grad_residual.to(dtype).reshape(rows, d).contiguous()
            if grad_residual is not None
            else None
        )
        grad_x = torch.empty((rows, d), dtype=dtype, device=x.device)
        x_stride = x_rows.stride(0)
    if weight_grad:
        _check_weight_grad_width(d)
    args = (
        grad_rows,
        x_rows,
        weight if weight.is_contiguous() else weight.contiguous(),
        rstd,
        extra if extra is not None else 0,
        rows,
        d,
        x_stride,
    )
    name, blocks, fused_cta, shape = fused_backward_plan(d, dtype, rows)
    grad_weight = None
    if rows == 0:
        grad_weight = torch.zeros(d, dtype=weight.dtype, device=x.device) if weight_grad else None
    elif (
        weight_grad
        and fused_backward_fits(d, dtype)
        and blocks * fused_cta >= FUSED_WEIGHT_GRAD_MIN_BLOCKS * MIN_CTA_THREADS
    ):
        if blocks > _MAX_GRID_X:
            raise ValueError(f"x has {rows} rows; too many for the weight gradient kernel")
        partials = torch.empty((blocks, d), dtype=torch.float32, device=x.device)
        counters = run_counters_for(x.device, blocks) if overlap_rule(d, dtype, rows) else None
        with counters if counters is not None else contextlib.nullcontext():
            launch_fused_backward(
                name,
                dtype,
                x.device,
                blocks,
                fused_cta,
                (grad_x, partials, *args),
                shape=shape,
                run_counters=counters,
            )
            grad_weight = _reduce_partials(partials, weight.dtype, counters)
    else:
        _launch_rows("rms_norm_backward", x.device, d, dtype, rows, (grad_x, *args))
        if weight_grad:
            groups, in_sequence = weight_grad_chunking(d, dtype, rows)
            partials = _weight_grad_separately(grad_rows, x_rows, rstd, groups, in_sequence)
            grad_weight = _reduce_partials(partials, weight.dtype)
    return grad_x.reshape(x.shape), grad_weight


# ----------------------------------------------------------------------------- lean backward
# A backward on contiguous operands whose weight gradient (if asked) takes the separate route
# (the row kernel, the column partials, the reduce levels: no fused kernel, so no run
# counters) keeps its launches per key: kernels, grids, integer arguments and programmatic
# flags as ``backward`` chooses them (the module's tuning switches that decide them are in the
# key).  A call allocates grad_x, one fp32 workspace for every partial level and grad_weight,
# and launches with pointers as ints: the general path's kernels and arguments, hence its bits.

_LEAN_SEGMENT = 64  # fp32 elements: each partial level starts on a 256-byte boundary


@dataclasses.dataclass(frozen=True)
class _Launch:
    kernel: object
    grid: tuple[int, ...]
    block: tuple[int]
    programmatic: bool


@dataclasses.dataclass(frozen=True)
class _LeanBackward:
    rows: int
    d: int
    row_launch: _Launch  # rms_norm_backward: grad_x
    partials: _Launch | None  # rms_norm_weight_grad_partials: (chunks, groups, in_sequence)
    chunking: tuple[int, int, int]  # chunks, groups, rows in sequence
    reduces: tuple[tuple[_Launch, int, int], ...]  # (launch, rows read, rows written)
    last_levels: _Launch | None
    levels: tuple[int, ...]  # fp32 offset of each partial level in the workspace, then its size


_LEAN_BACKWARD: dict[tuple, _LeanBackward | None] = {}
_MAX_LEAN_BACKWARD = 1024


def _switches() -> tuple:
    # What decides the route and the reduce tree besides the shapes (tests change some).
    return (
        FUSED_WEIGHT_GRAD_MIN_BLOCKS,
        WEIGHT_GRAD_CHUNK_ROWS,
        WEIGHT_GRAD_REDUCE_ROWS,
        WEIGHT_GRAD_LAST_LEVELS_ROWS,
    )


def _lean_backward_plan(x: Tensor, weight: Tensor, weight_grad: bool) -> _LeanBackward | None:
    """``backward``'s launches for contiguous operands, or None where it takes the fused
    kernel (or has no rows)."""
    d = x.shape[-1]
    dtype, device = x.dtype, x.device
    rows = x.numel() // d
    if rows == 0 or x.numel() < 2 * d:
        return None
    _, blocks, fused_cta, _ = fused_backward_plan(d, dtype, rows)
    if (
        weight_grad
        and fused_backward_fits(d, dtype)
        and blocks * fused_cta >= FUSED_WEIGHT_GRAD_MIN_BLOCKS * MIN_CTA_THREADS
    ):
        return None
    geometry, threads, cta = backward_geometry(d, dtype)
    grid = -(-rows // (cta // threads))
    if grid > _MAX_GRID_X:
        return None  # the general path raises
    row_launch = _Launch(
        kernel_for("rms_norm", f"rms_norm_backward_{_SUFFIX[dtype]}_{geometry}", device),
        (grid,),
        (cta,),
        False,
    )
    if not weight_grad:
        return _LeanBackward(rows, d, row_launch, None, (0, 0, 0), (), None, (0,))
    _check_weight_grad_width(d)
    groups, in_sequence = weight_grad_chunking(d, dtype, rows)
    chunks = -(-rows // (groups * in_sequence))
    columns = -(-d // WEIGHT_GRAD_THREADS)
    partials = _Launch(
        kernel_for("rms_norm", f"rms_norm_weight_grad_partials_{_SUFFIX[dtype]}", device),
        (chunks, columns),
        (WEIGHT_GRAD_THREADS,),
        False,
    )
    programmatic = _programmatic(device)
    levels = [0]
    size = _lean_segment(chunks * d)
    reduces = []
    count = chunks
    while count > WEIGHT_GRAD_LAST_LEVELS_ROWS:
        written = -(-count // WEIGHT_GRAD_REDUCE_ROWS)
        launch_ = _Launch(
            kernel_for("rms_norm", "rms_norm_weight_grad_reduce", device),
            (written, columns),
            (WEIGHT_GRAD_THREADS,),
            programmatic,
        )
        reduces.append((launch_, count, written))
        levels.append(size)
        size += _lean_segment(written * d)
        count = written
    last_levels = _Launch(
        kernel_for("rms_norm", f"rms_norm_weight_grad_last_levels_{_SUFFIX[weight.dtype]}", device),
        (-(-d // LAST_LEVELS_COLUMNS),),
        (LAST_LEVELS_THREADS,),
        programmatic,
    )
    return _LeanBackward(
        rows,
        d,
        row_launch,
        partials,
        (chunks, groups, in_sequence),
        tuple(reduces),
        last_levels,
        (*levels, size),
    )


def _lean_segment(elements: int) -> int:
    return -(-elements // _LEAN_SEGMENT) * _LEAN_SEGMENT


def _lean_backward(
    grad_y: Tensor,
    x: Tensor,
    weight: Tensor,
    rstd: Tensor,
    grad_residual: Tensor | None,
    weight_grad: bool,
) -> tuple[Tensor, Tensor | None] | None:
    """``backward`` from the launches kept for its key, or None where no plan applies."""
    device = x.device
    index = torch.cuda.current_device() if device.index is None else device.index
    key = (x.shape, x.dtype, weight.shape, weight.dtype, grad_residual is not None)
    key += (weight_grad, index, _switches())
    plan = _LEAN_BACKWARD.get(key, _NO_PLAN)
    if plan is _NO_PLAN:
        plan = _lean_backward_plan(x, weight, weight_grad)
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            if len(_LEAN_BACKWARD) >= _MAX_LEAN_BACKWARD:
                _LEAN_BACKWARD.clear()
            _LEAN_BACKWARD[key] = plan
    if plan is None:
        return None
    rows, d = plan.rows, plan.d
    grad_x = torch.empty_like(x)
    g_ptr, x_ptr, w_ptr, r_ptr = grad_y.data_ptr(), x.data_ptr(), weight.data_ptr(), rstd.data_ptr()
    extra = 0 if grad_residual is None else grad_residual.data_ptr()
    stream = current_raw_stream(index)
    step = plan.row_launch
    args = (grad_x.data_ptr(), g_ptr, x_ptr, w_ptr, r_ptr, extra, rows, d, d)
    step.kernel(step.grid, step.block, args, 0, stream, index, step.programmatic)
    if plan.partials is None:
        return grad_x, None
    work = torch.empty(plan.levels[-1], dtype=torch.float32, device=device)
    base = work.data_ptr()
    chunks, groups, in_sequence = plan.chunking
    step = plan.partials
    args = (base, g_ptr, x_ptr, r_ptr, rows, d, d, groups, in_sequence)
    step.kernel(step.grid, step.block, args, 0, stream, index, step.programmatic)
    count = chunks
    for level, (step, read, written) in enumerate(plan.reduces, start=1):
        source, target = base + 4 * plan.levels[level - 1], base + 4 * plan.levels[level]
        step.kernel(
            step.grid, step.block, (target, source, read, d), 0, stream, index, step.programmatic
        )
        count = written
    grad_weight = torch.empty(d, dtype=weight.dtype, device=device)
    step = plan.last_levels
    source = base + 4 * plan.levels[len(plan.reduces)]
    args = (grad_weight.data_ptr(), source, count, d, 0, 0)
    step.kernel(step.grid, step.block, args, 0, stream, index, step.programmatic)
    return grad_x, grad_weight


_NO_PLAN = object()

"""Log-softmax over the last dimension on CUDA/HIP: launches ``kernels_cu/log_softmax.cu``.

One CTA per row (on sm_90, for some long-row cases, a thread-block cluster of 8 or 16 CTAs per
row instead; clusters can also loop over rows, see PERSISTENT_CASES).  The tree width T, and
with it the reduction tree, is chosen from the row length V and the dtypes alone
(``threads_for``), so a row's bits are the same in any batch and on any card; the one-CTA form
runs T threads, or for T = 2048 (the backward only) 1024 threads playing two tree threads each
(``block_threads``).  How much of the row stays on chip between the two passes (registers,
then dynamic shared memory sized from the device's limits, then a second read from global
memory) changes speed only: the arithmetic is defined on element indices.  The GPU's
reduction order is its own fixed tree (see the kernel), not the reference's ``chunk_size``
order, so the two backends agree within the contract's tolerance, not bitwise.  No call
synchronises.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import Tensor

from ..runtime import allow_dynamic_shared, current_raw_stream, kernel_for, launch, uses_hopper
from .rms_norm import as_rows

# Keep in step with kernels_cu/log_softmax.cu.
GROUP = 8  # kGroup: elements per group
REGISTER_BYTES = 64  # RegGroups: bytes of a row each thread keeps in registers
SMALL_ROW_THREADS = 128
LARGE_ROW_THREADS = 512  # 128, 512 or 1024 are compiled; changing it changes the tree (bits)
MAX_BLOCK_THREADS = 1024  # a CTA's limit: wider trees are played two tree threads per thread
_CTAS_PER_SM = {128: 8, 512: 2, 1024: 1}  # the occupancy the shared-memory budget aims at
_DRIVER_RESERVED_SHARED = 1024  # per CTA on sm_80+
_DEFAULT_SHARED = 48 * 1024
_MAX_GRID_X = 2**31 - 1
_SUFFIX = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
# The Hopper form's cluster shapes compiled in both directions: (CTAs per row, threads per CTA),
# T = CTAs x threads.  Keep in step with the cluster kernels of kernels_cu/log_softmax.cu.  The
# shape changes speed only: the cluster form computes the one-CTA form's tree for its T.
CLUSTER_SHAPES = frozenset({(8, 64), (8, 128), (16, 64)})
# T = 2048, compiled for the backward with fp32 grad_out only (x: these kernel suffixes), as a
# 16 x 128 cluster and as a one-CTA kernel of 1024 threads that computes the same tree.
WIDE_THREADS = 2048
WIDE_CLUSTER_SHAPE = (16, 128)
WIDE_BACKWARD_SUFFIXES = frozenset({"bf16_f32", "f16_f32", "f32_f32"})
# The shape for each T and bytes per cached element.  For T = 1024, 8 CTAs of 128 threads
# measured faster than 16 of 64 (docs/tuning/log_softmax.md); a row of 4-byte elements is too
# long for 8 CTAs to stay resident, so it is split over 16.
CLUSTER_SHAPE = {
    (512, 2): (8, 64),
    (512, 4): (8, 64),
    (1024, 2): (8, 128),
    (1024, 4): (16, 64),
    (WIDE_THREADS, 4): WIDE_CLUSTER_SHAPE,
}
CLUSTER_THREADS = (512, 1024)  # the T compiled in the Hopper form in both directions
_PORTABLE_CLUSTER_CTAS = 8  # larger clusters need the kernel's non-portable opt-in
USE_CLUSTER = True  # the Hopper form where it applies (tests switch it off to compare bits)
# For the cases in PERSISTENT_CASES (None: every case) the Hopper form launches at most as many
# clusters as fit on the device at once; each loops over rows and refills its shared memory with
# its next row while it finishes the current one.  Elsewhere, or with PERSISTENT_CLUSTERS off: one
# cluster per row.  Which cluster handles a row changes speed only.  MAX_CLUSTERS caps the count
# (tests use it to give each cluster many rows).  With the push exchange (no cluster barrier per
# row) one cluster per row measured faster in every case (docs/tuning/log_softmax.md), so no
# case loops by default; the form stays for tests and future measurements.
PERSISTENT_CLUSTERS = True
PERSISTENT_CASES: frozenset[tuple[str, str]] | None = frozenset()
MAX_CLUSTERS: int | None = None
_BARRIER_BYTES = 8  # one mbarrier per shared-memory segment
# T for long rows, by (direction, x dtype, out / grad_out dtype): T = 1024 where the Hopper form
# with that T measured faster than the one-CTA form with T = 512 at 4096 x 151936, T = 2048
# (16 x 128) for the backward of bf16/fp16 rows with fp32 dy, where it measured faster than
# T = 1024 (docs/tuning/log_softmax.md).  Other cases keep LARGE_ROW_THREADS.  T is chosen from
# V and the dtypes only, never from the card: every card computes the same tree (a card without
# the Hopper form runs the one-CTA kernel with this T), so a row's bits are the same on every GPU.
LONG_ROW_THREADS = {
    ("forward", torch.bfloat16, torch.float32): 1024,
    ("forward", torch.float16, torch.float32): 1024,
    ("backward", torch.bfloat16, torch.bfloat16): 1024,
    ("backward", torch.bfloat16, torch.float32): WIDE_THREADS,
    ("backward", torch.float16, torch.float32): WIDE_THREADS,
    ("forward", torch.float32, torch.float32): 1024,
    ("backward", torch.float32, torch.float32): 1024,
}
# A row takes LONG_ROW_THREADS once what the kernel keeps of it on chip (x in the forward,
# grad_out in the backward) exceeds this many bytes: what one 512-thread CTA keeps on an sm_90 SM
# (64 bytes of registers per thread plus half of 228 KiB of shared memory, less the driver's
# 1 KiB).  A constant, so the choice does not follow the card.
LONG_ROW_BYTES = 512 * REGISTER_BYTES + 228 * 1024 // 2 - _DRIVER_RESERVED_SHARED
_MIN_CLUSTER_CTAS_PER_SM = 4  # a guard for rows far longer than measured


def _register_groups(dtype: torch.dtype) -> int:
    return REGISTER_BYTES // (GROUP * dtype.itemsize)


def block_threads(threads: int) -> int:
    """Threads of the one-CTA form's block for a tree ``threads`` wide."""
    return min(threads, MAX_BLOCK_THREADS)


def threads_for(
    vocab: int,
    dtype: torch.dtype,
    out_dtype: torch.dtype | None = None,
    *,
    backward: bool = False,
) -> int:
    """The block size (the reduction tree) for rows of ``vocab`` elements of ``dtype`` (the
    input's dtype) with output (forward) or grad_out (``backward``) of ``out_dtype``: a
    function of V and the dtypes, never of the batch or the card."""
    groups = -(-vocab // GROUP)
    if groups <= SMALL_ROW_THREADS * _register_groups(dtype):
        return SMALL_ROW_THREADS
    long_row = _long_row_threads(vocab, dtype, out_dtype or torch.float32, backward)
    return long_row if long_row is not None else LARGE_ROW_THREADS


def _long_row_threads(
    vocab: int, dtype: torch.dtype, out_dtype: torch.dtype, backward: bool
) -> int | None:
    """T of LONG_ROW_THREADS for these rows, or None where LARGE_ROW_THREADS applies.  Only
    these cases take the Hopper form where it can run: elsewhere it was not measured faster."""
    direction = "backward" if backward else "forward"
    threads = LONG_ROW_THREADS.get((direction, dtype, out_dtype))
    cached_dtype = out_dtype if backward else dtype  # what the kernel keeps on chip
    if threads is None or vocab % GROUP != 0 or vocab * cached_dtype.itemsize <= LONG_ROW_BYTES:
        return None
    return threads


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def cluster_shape(threads: int, cached_dtype: torch.dtype) -> tuple[int, int] | None:
    """``(CTAs, threads per CTA)`` of the Hopper form for T = ``threads`` keeping elements of
    ``cached_dtype`` on chip, or None where T has no cluster form."""
    return CLUSTER_SHAPE.get((threads, cached_dtype.itemsize))


def _compiled(kind: str, suffix: str, threads: int) -> bool:
    """Whether kernels of tree width ``threads`` exist for ``kind`` and ``suffix``."""
    if threads != WIDE_THREADS:
        return True
    return kind == "backward" and suffix in WIDE_BACKWARD_SUFFIXES


@functools.cache
def _shared_budget(device_index: int, threads: int, static_bytes: int) -> int:
    """Dynamic shared memory one CTA may use while ``_CTAS_PER_SM`` of them fit on an SM."""
    props = torch.cuda.get_device_properties(device_index)
    per_block = getattr(props, "shared_memory_per_block_optin", 0) or _DEFAULT_SHARED
    per_sm = getattr(props, "shared_memory_per_multiprocessor", 0) or per_block
    share = per_sm // _CTAS_PER_SM[threads] - _DRIVER_RESERVED_SHARED
    return max(0, min(per_block, share) - static_bytes)


_STATIC_SHARED: dict[tuple[str, int], int] = {}


def _static_shared(kernel, device_index: int) -> int:
    key = (kernel.name, device_index)
    if key not in _STATIC_SHARED:
        _STATIC_SHARED[key] = int(kernel.attributes(device_index)["static_shared_bytes"])
    return _STATIC_SHARED[key]


@functools.cache
def _properties(device_index: int):
    """The device's properties, asked once (torch builds a new object per call)."""
    return torch.cuda.get_device_properties(device_index)


def _cluster_capable(device_index: int) -> bool:
    """The cluster forms need an sm_90 device and the build's sm_90a image."""
    return uses_hopper(torch.device("cuda", device_index))


def cluster_shared_bytes(vocab: int, threads: int, dtype: torch.dtype) -> int:
    """Dynamic shared memory of one CTA of the Hopper form: its slice of a row of ``dtype``."""
    groups = -(-vocab // GROUP)
    segments = -(-groups // threads)
    ctas, cta_threads = CLUSTER_SHAPE[(threads, dtype.itemsize)]
    return segments * (cta_threads * GROUP * dtype.itemsize + _BARRIER_BYTES)


_OPTED_IN_CLUSTERS: set[tuple[str, int]] = set()


def _allow_cluster_size(kernel, device_index: int, ctas: int) -> None:
    """Opts a kernel in to its non-portable cluster size (once per kernel and device); the
    runtime raises where the device cannot run such clusters."""
    key = (kernel.name, device_index)
    if ctas > _PORTABLE_CLUSTER_CTAS and key not in _OPTED_IN_CLUSTERS:
        kernel.allow_non_portable_cluster_size(device=device_index)
        _OPTED_IN_CLUSTERS.add(key)


def _cluster_plan(
    kind: str,
    suffix: str,
    device: torch.device,
    vocab: int,
    threads: tuple[int, int | None],
    cached_dtype: torch.dtype,
    tensors: tuple[Tensor, ...],
    rows: int,
) -> tuple[object, int, int, int] | None:
    """``(kernel, CTAs per cluster, shared bytes, clusters)`` of the Hopper form for this call,
    or None where it does not apply: T (``threads[0]``) is not this case's long-row T
    (``threads[1]``, from ``_long_row_threads``) or has no cluster kernel for ``kind`` and
    ``suffix``, the device has no cluster form, a row start is not 16-byte aligned, or too few
    clusters fit.  There the one-CTA form runs with the same
    T: the same bits.  ``kind`` is "forward" or "backward"."""
    threads, long_row_threads = threads
    shape = cluster_shape(threads, cached_dtype)
    if not USE_CLUSTER or shape is None or vocab % GROUP != 0 or threads != long_row_threads:
        return None
    if not _compiled(kind, suffix, threads):
        return None
    if any(t.data_ptr() % 16 != 0 or (t.stride(0) * t.element_size()) % 16 != 0 for t in tensors):
        return None
    index = _device_index(device)
    if not _cluster_capable(index):
        return None
    props = _properties(index)
    shared = cluster_shared_bytes(vocab, threads, cached_dtype)
    if props.shared_memory_per_multiprocessor // (shared + _DRIVER_RESERVED_SHARED) < (
        _MIN_CLUSTER_CTAS_PER_SM
    ):
        return None
    ctas, cta_threads = shape
    name = f"log_softmax_cluster_{kind}_{suffix}_c{ctas}_t{cta_threads}"
    kernel = kernel_for("log_softmax", name, device)
    if shared > props.shared_memory_per_block_optin - _static_shared(kernel, index):
        return None
    allow_dynamic_shared(kernel, shared, index)
    _allow_cluster_size(kernel, index, ctas)
    resident = _resident_clusters(kernel, index, ctas, cta_threads, shared)
    if resident == 0:
        return None
    clusters = _cluster_count(rows, resident, (kind, suffix))
    if clusters * ctas > _MAX_GRID_X:
        raise ValueError(f"x has {rows} rows; at most {_MAX_GRID_X // ctas} are supported here")
    return kernel, ctas, shared, clusters


def _cluster_count(rows: int, resident: int, case: tuple[str, str]) -> int:
    """Clusters to launch for ``rows`` rows of ``case`` ((kind, suffix)): one per row, or for
    the persistent cases at most those that fit at once (or MAX_CLUSTERS), each looping over
    rows."""
    if not PERSISTENT_CLUSTERS or (PERSISTENT_CASES is not None and case not in PERSISTENT_CASES):
        return rows
    cap = resident if MAX_CLUSTERS is None else min(resident, MAX_CLUSTERS)
    return min(rows, cap)


_RESIDENT: dict[tuple[str, int, int], int] = {}


def _resident_clusters(kernel, device_index: int, ctas: int, cta_threads: int, shared: int) -> int:
    """How many clusters of this shape fit on the device at once (a device limit; cached)."""
    key = (kernel.name, device_index, shared)
    if key not in _RESIDENT:
        _RESIDENT[key] = int(
            kernel.max_active_clusters((ctas,), (cta_threads,), shared, device=device_index)
        )
    return _RESIDENT[key]


def _tiering(
    kernel, device: torch.device, vocab: int, threads: int, dtype: torch.dtype
) -> tuple[int, int]:
    """``(smem_groups, shared bytes)``: groups per thread cached in shared memory, for a block
    of ``threads`` threads (``block_threads`` of T)."""
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
    allow_dynamic_shared(kernel, shared, index)
    return groups, shared


def forward(
    x: Tensor, out_dtype: torch.dtype = torch.float32, *, need_lse: bool = True
) -> tuple[Tensor, Tensor | None]:
    """``(out, lse)``: out in x's shape and ``out_dtype``, lse the fp32 ``[rows]`` for the
    backward (x viewed as ``[rows, V]``; None unless ``need_lse``).  Arguments are validated by
    the caller."""
    vocab = x.shape[-1]
    # A 2-D x with unit column stride is its own rows view and out needs no reshape.
    two_d = x.dim() == 2 and (vocab <= 1 or x.stride(1) == 1)
    rows_view = x if two_d else as_rows(x, vocab)
    rows = rows_view.shape[0]
    out = torch.empty((rows, vocab), dtype=out_dtype, device=x.device)
    lse = torch.empty(rows, dtype=torch.float32, device=x.device) if need_lse else None
    if rows > 0:
        if rows > _MAX_GRID_X:
            raise ValueError(f"x has {rows} rows; at most {_MAX_GRID_X} are supported")
        _forward_into(out, lse, rows_view)
    return (out if two_d else out.view(x.shape)), lse


def _forward_choice(rows_view: Tensor, out_dtype: torch.dtype) -> tuple[int, int | None, str]:
    """``(T, the long-row T or None, kernel suffix)`` of a forward."""
    vocab = rows_view.shape[1]
    threads = threads_for(vocab, rows_view.dtype, out_dtype)
    long_row = _long_row_threads(vocab, rows_view.dtype, out_dtype, False)
    return threads, long_row, f"{_SUFFIX[rows_view.dtype]}_{_SUFFIX[out_dtype]}"


def _forward_into(out: Tensor, lse: Tensor | None, rows_view: Tensor) -> None:
    """Launches the forward of ``rows_view`` ``[rows, V]`` into ``out`` (and ``lse``)."""
    rows, vocab = rows_view.shape
    threads, long_row, suffix = _forward_choice(rows_view, out.dtype)
    lse_arg = lse if lse is not None else 0
    args = (out, lse_arg, rows_view, rows, vocab, rows_view.stride(0))
    _launch_rows("forward", suffix, rows_view, threads, long_row, rows_view.dtype, (out,), args)


def forward_path(x: Tensor, out_dtype: torch.dtype = torch.float32) -> str:
    """Which form ``forward`` launches for ``x`` (rows over the last dimension): ``"cluster
    x<CTAs> T<T>"`` (the Hopper form) or ``"one-cta T<T>"``; the launch's own decisions,
    nothing launched.  ``forward``'s output is a fresh tensor whose rows are 16-byte
    multiples wherever the cluster form applies, so only ``x``'s rows can rule it out."""
    rows_view = as_rows(x, x.shape[-1])
    rows, vocab = rows_view.shape
    threads, long_row, suffix = _forward_choice(rows_view, out_dtype)
    plan = _cluster_plan(
        "forward",
        suffix,
        rows_view.device,
        vocab,
        (threads, long_row),
        rows_view.dtype,
        (rows_view,),
        rows,
    )
    if plan is not None:
        return f"cluster x{plan[1]} T{threads}"
    return f"one-cta T{threads}"


def _launch_rows(
    kind: str,
    suffix: str,
    rows_view: Tensor,
    threads: int,
    long_row_threads: int | None,
    cached_dtype: torch.dtype,
    others: tuple[Tensor, ...],
    args: tuple,
) -> None:
    """Launches the ``kind`` ("forward" or "backward") kernel over ``rows_view`` ``[rows, V]``
    with ``args`` (its pointers, rows, V and row stride), as ``_launch_choice`` decides."""
    kernel, grid, block, shared, extra = _launch_choice(
        kind, suffix, rows_view, threads, long_row_threads, cached_dtype, others
    )
    launch(
        kernel,
        rows_view.device,
        grid=grid,
        block=block,
        args=(*args, *extra),
        shared_mem=shared,
    )


def _launch_choice(
    kind: str,
    suffix: str,
    rows_view: Tensor,
    threads: int,
    long_row_threads: int | None,
    cached_dtype: torch.dtype,
    others: tuple[Tensor, ...],
) -> tuple[object, tuple[int], tuple[int], int, tuple[int, ...]]:
    """``(kernel, grid, block, shared bytes, arguments after the row stride)`` of a launch over
    ``rows_view``: the Hopper cluster form where ``_cluster_plan`` gives one (``others``: the
    other tensors of rows it reads or writes, whose alignment it checks), else the one-CTA form
    with its shared-memory tier (``cached_dtype``: what the kernel keeps on chip)."""
    rows, vocab = rows_view.shape
    device = rows_view.device
    plan = _cluster_plan(
        kind,
        suffix,
        device,
        vocab,
        (threads, long_row_threads),
        cached_dtype,
        (rows_view, *others),
        rows,
    )
    if plan is not None:
        kernel, ctas, shared, clusters = plan
        return kernel, (clusters * ctas,), (threads // ctas,), shared, ()
    if not _compiled(kind, suffix, threads):
        raise RuntimeError(f"log_softmax: no {kind} kernel of T = {threads} for {suffix}")
    kernel = kernel_for("log_softmax", f"log_softmax_{kind}_{suffix}_t{threads}", device)
    block = block_threads(threads)
    smem_groups, shared = _tiering(kernel, device, vocab, block, cached_dtype)
    return kernel, (rows,), (block,), shared, (smem_groups,)


# ----------------------------------------------------------------------------- eager no-grad path
# A forward that needs no lse (no gradient) on contiguous rows keeps its launch per
# ``_lean_key``: what ``_launch_choice`` decided for the first call (kernel, grid, block, shared
# memory, trailing arguments) is a function of the key, which holds every tuning switch the
# choice reads, so a switch changed at run time takes effect at the next call (the tables of
# T and cluster shapes are constants of the kernels, not switches: code that edits them clears
# ``_LEAN``).  A call then allocates its output in its final shape and launches once with
# pointers as ints.


@dataclasses.dataclass(frozen=True)
class _Lean:
    kernel: object
    grid: tuple[int]
    block: tuple[int]
    shared: int
    tail: tuple[int, ...]  # rows, V, row stride and the form's trailing arguments


_LEAN: dict[tuple, _Lean | None] = {}
_MAX_LEAN = 512
_NO_LEAN = object()  # ``_LEAN.get``'s default: no plan made yet (a kept None: the general path)


def _lean_key(x: Tensor, out_dtype: torch.dtype, index: int, aligned: bool) -> tuple:
    """A contiguous ``x``'s shape, dtype, base alignment and device, the output dtype and the
    switches and hooks ``_launch_choice`` reads (tests change them at run time)."""
    tuning = (USE_CLUSTER, PERSISTENT_CLUSTERS, PERSISTENT_CASES, MAX_CLUSTERS, _shared_budget)
    return (x.shape, x.dtype, out_dtype, index, aligned, tuning)


def forward_no_grad(x: Tensor, out_dtype: torch.dtype = torch.float32) -> Tensor:
    """``forward(x, out_dtype, need_lse=False)[0]`` in as few host steps as the launch allows
    when x is contiguous: the launch kept for its key, one allocation, pointers as ints; the
    same kernel and arguments as ``forward``, hence the same bits."""
    vocab = x.shape[-1]
    if not x.is_contiguous() or vocab == 0:
        return forward(x, out_dtype, need_lse=False)[0]
    x_ptr = x.data_ptr()
    device = x.device
    index = torch.cuda.current_device() if device.index is None else device.index
    key = _lean_key(x, out_dtype, index, not x_ptr & 15)
    lean = _LEAN.get(key, _NO_LEAN)
    if lean is _NO_LEAN:
        lean = _lean_plan(x, out_dtype)
        if len(_LEAN) >= _MAX_LEAN:
            _LEAN.clear()
        _LEAN[key] = lean
    if lean is None:
        return forward(x, out_dtype, need_lse=False)[0]
    out = torch.empty(x.shape, dtype=out_dtype, device=device)
    lean.kernel(
        lean.grid,
        lean.block,
        (out.data_ptr(), 0, x_ptr, *lean.tail),
        lean.shared,
        current_raw_stream(index),
        index,
        False,
    )
    return out


def _lean_plan(x: Tensor, out_dtype: torch.dtype) -> _Lean | None:
    """The launch ``forward`` makes for a contiguous ``x`` (None: no rows, the general path).
    Its output is fresh, so 16-byte aligned like every output of a call with this key."""
    vocab = x.shape[-1]
    rows = x.numel() // vocab
    if rows == 0:
        return None
    if rows > _MAX_GRID_X:
        raise ValueError(f"x has {rows} rows; at most {_MAX_GRID_X} are supported")
    rows_view = x.as_strided((rows, vocab), (vocab, 1))  # the rows of a contiguous x
    out = torch.empty((rows, vocab), dtype=out_dtype, device=x.device)
    threads, long_row, suffix = _forward_choice(rows_view, out_dtype)
    kernel, grid, block, shared, extra = _launch_choice(
        "forward", suffix, rows_view, threads, long_row, rows_view.dtype, (out,)
    )
    return _Lean(kernel, grid, block, shared, (rows, vocab, vocab, *extra))


def backward(grad_out: Tensor, x: Tensor, lse: Tensor) -> Tensor:
    """``dx = dy - exp(x - lse) * sum(dy)`` per row (zero in all -inf rows), x's dtype."""
    vocab = x.shape[-1]
    rows_view = as_rows(x, vocab)
    rows = rows_view.shape[0]
    grad_rows = grad_out.reshape(rows, vocab).contiguous()
    grad_x = torch.empty((rows, vocab), dtype=x.dtype, device=x.device)
    if rows > 0:
        _backward_into(grad_x, grad_rows, rows_view, lse)
    return grad_x.reshape(x.shape)


def _backward_choice(rows_view: Tensor, grad_dtype: torch.dtype) -> tuple[int, int | None, str]:
    """``(T, the long-row T or None, kernel suffix)`` of a backward."""
    vocab = rows_view.shape[1]
    threads = threads_for(vocab, rows_view.dtype, grad_dtype, backward=True)
    long_row = _long_row_threads(vocab, rows_view.dtype, grad_dtype, True)
    return threads, long_row, f"{_SUFFIX[rows_view.dtype]}_{_SUFFIX[grad_dtype]}"


def _backward_into(grad_x: Tensor, grad_rows: Tensor, rows_view: Tensor, lse: Tensor) -> None:
    """Launches the backward of ``rows_view`` ``[rows, V]`` into ``grad_x``."""
    rows, vocab = rows_view.shape
    threads, long_row, suffix = _backward_choice(rows_view, grad_rows.dtype)
    args = (grad_x, grad_rows, rows_view, lse, rows, vocab, rows_view.stride(0))
    others = (grad_rows, grad_x)
    _launch_rows("backward", suffix, rows_view, threads, long_row, grad_rows.dtype, others, args)


def backward_path(x: Tensor, grad_dtype: torch.dtype = torch.float32) -> str:
    """Which form ``backward`` launches for ``x`` with a grad_out of ``grad_dtype`` whose rows
    start 16-byte aligned (a fresh tensor's do), in ``forward_path``'s words; nothing launched.
    grad_x is always fresh, so only ``x``'s rows (or a misaligned grad_out) can rule the
    cluster form out."""
    rows_view = as_rows(x, x.shape[-1])
    rows, vocab = rows_view.shape
    threads, long_row, suffix = _backward_choice(rows_view, grad_dtype)
    plan = _cluster_plan(
        "backward",
        suffix,
        rows_view.device,
        vocab,
        (threads, long_row),
        grad_dtype,
        (rows_view,),
        rows,
    )
    if plan is not None:
        return f"cluster x{plan[1]} T{threads}"
    return f"one-cta T{threads}"

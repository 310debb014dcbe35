"""Linear on CUDA: picks a tile configuration of ``kernels_cu/linear.cu`` and launches it
(on HIP: the portable loop at the end of this module).

Every configuration reduces K in the same order (see the kernel's contract), so the choice
below may follow M freely: it is a performance decision, not a numerical one.  Tests run
the same inputs through every configuration and both kernel families and compare bits.

The backward on sm_90 reads its operands where they lie: grad_x = dY · W takes W ``[N, K]``
as an N-major operand (``matmul_nn``), grad_weight = dYᵀ · X takes dY ``[M, N]`` and X
``[M, K]`` as M- and N-major operands (``matmul_tn``), grad_bias = 1ᵀ · dY reads dY the same
way; no transposed or padded copy is made.  TMA cannot read an operand in place when its row
stride is not a multiple of 16 bytes (``out_features % 8 != 0`` for dY) or its base is not
16-byte aligned; those products, decode-sized grad_x (``takes_small_m``: the small-M kernel
wants ``Wᵀ``), grad_x where cuBLASLt's pinned algorithm serves (it was checked on ``Wᵀ``),
other GPUs and HIP keep the copy-based products (``backward(..., transposed_copies=True)``
runs those everywhere).  Both give the same bits: the same k16 steps in the same order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re
import threading
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

from ..reference.linear import K_GROUPS, k_group_width
from ..runtime import (
    allow_dynamic_shared,
    current_raw_stream,
    declared_kernels,
    kernel_for,
    launch,
    multiprocessors,
    tensor_map_2d,
    uses_hopper,
)
from . import linear_cublaslt

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "f16"}
_HOPPER_NAME = re.compile(r"linear_hopper_(bf16|f16)_bm(\d+)_bn(\d+)_k(\d+)_s(\d+)$")
_SMALL_M_NAME = re.compile(r"linear_small_m_(bf16|f16)_bn(\d+)_k(\d+)_s(\d+)$")
_TRANSPOSED_NAME = re.compile(r"linear_hopper_(tb|tab)_(bf16|f16)_bm(\d+)_bn256_k64_s4$")
_MAX_DIM = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """One compiled Hopper kernel: tile rows (BM), tile columns (BN), k-columns per pipeline
    stage, pipeline stages."""

    block_m: int
    block_n: int
    stage_k: int
    stages: int

    def kernel_name(self, dtype: torch.dtype) -> str:
        return (
            f"linear_hopper_{_DTYPE_NAMES[dtype]}_bm{self.block_m}_bn{self.block_n}"
            f"_k{self.stage_k}_s{self.stages}"
        )

    def __str__(self) -> str:
        return f"bm{self.block_m} bn{self.block_n} k{self.stage_k} s{self.stages}"

    @property
    def threads(self) -> int:
        return 128 * (self.block_m // 64 + 1)

    @property
    def shared_bytes(self) -> int:
        # Stages of (BM + BN) rows x stage_k elements x 2 bytes, two barriers per stage, and
        # slack to align the tiles to 1024 bytes (kernels_cu/linear.cu).
        stage_bytes = (self.block_m + self.block_n) * self.stage_k * 2
        return self.stages * stage_bytes + 16 * self.stages + 1024


@functools.cache
def hopper_configs() -> tuple[TileConfig, ...]:
    """The configurations built into this extension (read from the kernel names)."""
    names = declared_kernels("linear")
    configs = {
        TileConfig(int(m[2]), int(m[3]), int(m[4]), int(m[5]))
        for name in names
        if (m := _HOPPER_NAME.match(name))
    }
    return tuple(sorted(configs, key=lambda c: (c.block_m, c.block_n, c.stage_k, c.stages)))


@dataclasses.dataclass(frozen=True)
class SmallMConfig:
    """One compiled small-M kernel: weight rows (output columns) per CTA, k-columns per
    pipeline stage, pipeline stages.  Each CTA covers 8 tokens (the mma's n8)."""

    block_n: int
    stage_k: int
    stages: int

    TOKENS_PER_CTA = 8

    def kernel_name(self, dtype: torch.dtype) -> str:
        return (
            f"linear_small_m_{_DTYPE_NAMES[dtype]}_bn{self.block_n}_k{self.stage_k}_s{self.stages}"
        )

    def __str__(self) -> str:
        return f"small-m bn{self.block_n} k{self.stage_k} s{self.stages}"

    @property
    def threads(self) -> int:
        return 32 * (self.block_n // 16 + 1)  # one warp per 16 weight rows, one producer

    @property
    def shared_bytes(self) -> int:
        stage_bytes = (self.block_n + self.TOKENS_PER_CTA) * self.stage_k * 2
        return self.stages * stage_bytes + 16 * self.stages + 1024


@functools.cache
def small_m_configs() -> tuple[SmallMConfig, ...]:
    """The small-M configurations built into this extension (read from the kernel names)."""
    names = declared_kernels("linear")
    configs = {
        SmallMConfig(int(m[2]), int(m[3]), int(m[4]))
        for name in names
        if (m := _SMALL_M_NAME.match(name))
    }
    return tuple(sorted(configs, key=lambda c: (c.block_n, c.stage_k, c.stages)))


# Which batches take the small-M kernel on sm_90 (a speed choice: it gives the bits of every
# other configuration), from tools/tune_linear_small_m.py (docs/tuning/linear.md): at M <= 8 it
# beats the Hopper tiles at every Qwen3-8B shape; at M = 16 its 64-row CTAs do where
# N <= 32768 and lose at the lm_head; at M = 32 the tiles win at most shapes, so from 17 rows
# on the tiles run.
SMALL_M_MAX_ROWS = 8
SMALL_M_WIDE_MAX_ROWS = 16
SMALL_M_WIDE_MAX_N = 32768


def takes_small_m(m: int, n: int) -> bool:
    """Whether ``batchinv.linear`` runs an ``[m, k] x [n, k]^T`` product on the small-M kernel."""
    return m <= SMALL_M_MAX_ROWS or (m <= SMALL_M_WIDE_MAX_ROWS and n <= SMALL_M_WIDE_MAX_N)


def choose_small_m_config(m: int) -> SmallMConfig:
    """Up to 8 rows: 32 weight rows per CTA (two consumer warps), 128-wide stages, 8 stages,
    within the noise of the best small-M configuration at every Qwen3-8B shape; 9-16 rows:
    64 weight rows per CTA, 6 stages (the same tuning runs)."""
    return SmallMConfig(32, 128, 8) if m <= SMALL_M_MAX_ROWS else SmallMConfig(64, 128, 6)


# Relative throughput of one tile of each shape (bigger tiles reuse more of what they load),
# fitted to tools/tune_linear.py runs (docs/tuning/linear.md): with it, choose_config picks the
# fastest configuration, or one within 5% of it, at every Qwen3-8B shape and M measured.
_TILE_EFFICIENCY = {(128, 256): 1.0, (128, 128): 0.85, (64, 256): 0.8, (64, 128): 0.7}
_SMALL_TILE_EFFICIENCY = {64: 0.55, 32: 0.5}  # (64, BN) tiles with 128-wide k stages


def _tile_efficiency(config: TileConfig) -> float:
    key = (config.block_m, config.block_n)
    return _TILE_EFFICIENCY.get(key) or _SMALL_TILE_EFFICIENCY.get(config.block_n, 0.5)


def choose_config(m: int, n: int, multiprocessors: int) -> TileConfig:
    """The configuration with the least estimated time: waves of CTAs over the GPU times the
    cost of one tile (its area over its efficiency).  Every choice gives the same bits."""

    def estimated_time(config: TileConfig) -> float:
        tiles = -(-m // config.block_m) * -(-n // config.block_n)
        waves = -(-tiles // multiprocessors)
        return waves * config.block_m * config.block_n / _tile_efficiency(config)

    return min(hopper_configs(), key=estimated_time)


@functools.lru_cache(maxsize=256)
def _tensor_map(
    address: int,
    dtype_name: str,
    rows: int,
    cols: int,
    box_rows: int,
    row_elements: int,
    device_index: int,
) -> bytes:
    """A TMA map of ``rows x cols`` elements, rows ``row_elements`` apart (0: ``cols``)."""
    row_bytes = 2 * (row_elements or cols)
    return tensor_map_2d(
        address, dtype_name, rows, cols, row_bytes, box_rows, 64, 128, device_index
    )


def _aligned(t: Tensor) -> Tensor:
    """``t`` itself when TMA can read it (16-byte aligned base), else an aligned copy."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


_prefetch = threading.local()


@contextlib.contextmanager
def prefetching_weights() -> Iterator[None]:
    """Inside (this thread), small-M products (``matmul_nt``'s small-M family, ``linear``'s
    kept launch of it, ``matmul_grouped``) are launched with programmatic dependent launch:
    their CTAs may start while the previous kernel on the stream runs, request the weight's
    first stages, and wait for that kernel (griddepcontrol.wait) before they read x, the bias
    or write the output (kernels_cu/linear.cu).  The same bits.

    Only for code in which the kernel before each such product writes none of its weight
    (nor its bias): the decode runner's steps, where the model's weights are read-only."""
    _prefetch.depth = getattr(_prefetch, "depth", 0) + 1
    try:
        yield
    finally:
        _prefetch.depth -= 1


def prefetches_weights() -> bool:
    """Whether small-M launches on this thread prefetch their weight (``prefetching_weights``)."""
    return getattr(_prefetch, "depth", 0) > 0


def matmul_nt(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    family: str = "auto",
    config: TileConfig | SmallMConfig | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """``x[M, K] @ weight[N, K]ᵀ (+ bias)`` for contiguous 2-D bf16/fp16 CUDA tensors.

    ``family`` is ``"auto"`` (on sm_90 the small-M kernel where ``takes_small_m`` says so and
    the Hopper tile kernels otherwise, else mma.sync), ``"hopper"``, ``"small_m"`` or ``"mma"``;
    ``config`` forces a configuration of that family (tests use both to compare bits).
    ``out``: a contiguous ``[M, N]`` tensor of ``x``'s dtype to write into (else a new one).
    """
    out, done = _product_output(x, weight, bias, out)
    if done:
        return out
    m, k = x.shape
    n = weight.shape[0]
    bias_arg = 0 if bias is None else bias
    dtype_name = _DTYPE_NAMES[x.dtype]
    if family == "auto" and config is None:
        family, config = _auto_choice(m, n, x.device.index)
    if family == "auto":
        if not uses_hopper(x.device):
            family = "mma"
        elif isinstance(config, SmallMConfig) or (config is None and takes_small_m(m, n)):
            family = "small_m"
        else:
            family = "hopper"
    if family in ("hopper", "small_m") and not uses_hopper(x.device):
        raise RuntimeError("the Hopper linear kernels need an sm_90 GPU and a build with 90a")
    if family == "small_m":
        config = config or choose_small_m_config(m)
        if not isinstance(config, SmallMConfig):
            raise TypeError(f"family 'small_m' takes a SmallMConfig, got {type(config).__name__}")
        _launch_tma_gemm(config, config.TOKENS_PER_CTA, x, weight, out, bias_arg)
    elif family == "hopper":
        config = config or choose_config(m, n, multiprocessors(x.device.index))
        if not isinstance(config, TileConfig):
            raise TypeError(f"family 'hopper' takes a TileConfig, got {type(config).__name__}")
        _launch_tma_gemm(config, config.block_m, x, weight, out, bias_arg)
    elif family == "mma":
        if not torch.version.hip:  # on HIP these entries are the portable loop (simt_gemm)
            _require_sm80(x.device)
        launch(
            kernel_for("linear", f"linear_mma_{dtype_name}", x.device),
            x.device,
            grid=(-(-n // 32), -(-m // 64)),
            block=(128,),
            args=(x, weight, out, bias_arg, m, n, k),
        )
    else:
        raise ValueError(f"family must be 'auto', 'hopper', 'small_m' or 'mma', got {family!r}")
    return out


def _product_output(
    x: Tensor, weight: Tensor, bias: Tensor | None, out: Tensor | None
) -> tuple[Tensor, bool]:
    """The checks every GPU product makes, and its output: ``(out, True)`` when nothing is
    left to compute (an empty product, or K = 0: the bias alone)."""
    m, k = x.shape
    n = weight.shape[0]
    _check_product(m, n, k)
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{m}, {n}] {x.dtype} tensor")
    if m == 0 or n == 0:
        return out, True
    if k == 0:
        return (out.zero_() if bias is None else out.copy_(bias.expand(m, n))), True
    return out, False


def _check_product(m: int, n: int, k: int) -> None:
    if k % 8 != 0:
        raise ValueError(
            f"the GPU linear needs in_features % 8 == 0 (rows must be 16-byte multiples), got {k}"
        )
    for name, value in (("rows of x", m), ("out_features", n), ("in_features", k)):
        if value > _MAX_DIM:
            raise ValueError(f"{name} = {value} exceeds {_MAX_DIM}")


@functools.lru_cache(maxsize=1024)
def _auto_choice(m: int, n: int, device_index: int) -> tuple[str, TileConfig | SmallMConfig | None]:
    """``matmul_nt``'s ``family="auto"`` decision for an ``[m, k] x [n, k]^T`` product, made
    once per shape and device (a function of ``m``, ``n`` and the device only): on sm_90 the
    small-M kernel or the Hopper tile of least estimated time, elsewhere mma.sync."""
    if not uses_hopper(torch.device("cuda", device_index)):
        return "mma", None
    if takes_small_m(m, n):
        return "small_m", choose_small_m_config(m)
    return "hopper", choose_config(m, n, multiprocessors(device_index))


@functools.lru_cache(maxsize=256)
def _gemm_kernel(
    config: TileConfig | SmallMConfig | TransposedConfig, dtype: torch.dtype, device: torch.device
):
    return kernel_for("linear", config.kernel_name(dtype), device)


def _launch_tma_gemm(
    config: TileConfig | SmallMConfig, rows_per_cta: int, x: Tensor, weight: Tensor, out, bias_arg
) -> None:
    """One CTA per (``rows_per_cta`` rows of x) x (``config.block_n`` rows of the weight), both
    operands read through TMA boxes of those heights (the Hopper and small-M families)."""
    m, k = x.shape
    n = weight.shape[0]
    dtype_name = _DTYPE_NAMES[x.dtype]
    x, weight = _aligned(x), _aligned(weight)
    map_x = _tensor_map(x.data_ptr(), dtype_name, m, k, rows_per_cta, 0, x.device.index)
    map_w = _tensor_map(weight.data_ptr(), dtype_name, n, k, config.block_n, 0, x.device.index)
    kernel = _gemm_kernel(config, x.dtype, x.device)
    allow_dynamic_shared(kernel, config.shared_bytes, x.device.index)
    launch(
        kernel,
        x.device,
        grid=(-(-n // config.block_n) * -(-m // rows_per_cta),),
        block=(config.threads,),
        args=(map_x, map_w, out, bias_arg, m, n, k),
        shared_mem=config.shared_bytes,
        programmatic=isinstance(config, SmallMConfig) and prefetches_weights(),
    )


def _require_sm80(device: torch.device) -> None:
    if torch.cuda.get_device_capability(device) < (8, 0):
        raise RuntimeError("the mma.sync linear kernels need compute capability 8.0 or newer")


def _pad_columns(t: Tensor, multiple: int = 8) -> Tensor:
    """``t`` with zero columns appended up to a multiple (TMA wants 16-byte rows).

    Padding is in the reduced dimension only: each padded term adds an exact zero product.
    """
    extra = -t.shape[1] % multiple
    return t if extra == 0 else torch.nn.functional.pad(t, (0, extra))


def forward(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """The registry's ``linear.forward`` on CUDA: ``x [..., K]`` -> ``[..., N]``."""
    check_gpu_args(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    return matmul_rows(rows, weight, bias).reshape(*x.shape[:-1], weight.shape[0])


# ----------------------------------------------------------------------------- eager no-grad path
# A forward that needs no gradient, on contiguous 16-byte aligned operands, whose path does not
# hang on the pinned path's self-check (a bias, the switch at "own", or fewer than
# ``linear_cublaslt.MIN_ROWS`` rows: batchinv's kernels), keeps its launch per ``_lean_key``:
# kernel, grid, block, shared memory and sizes, as ``matmul_nt`` chooses them with
# ``family="auto"``.  The key holds the switch's value, read on every call, so
# ``set_linear_path`` takes effect at once.  A TMA map holds its operand's address, so maps
# are kept per address beside the launch.  A call allocates its output in its final shape and
# launches once with pointers as ints: the general path's kernel and arguments, its bits.

_MAX_MAPS = 64  # per launch and operand: the addresses a decode loop's activations cycle through


@dataclasses.dataclass(frozen=True)
class _Lean:
    kernel: object
    grid: tuple[int, ...]
    block: tuple[int]
    shared: int
    out_shape: tuple[int, ...]
    sizes: tuple[int, int, int]  # m, n, k
    boxes: tuple[str, int, int] | None  # TMA maps: dtype name, box rows of x, of the weight
    maps: tuple[dict, dict]  # address -> encoded TMA map, of x and of the weight
    small_m: bool = False  # the small-M kernel (may prefetch its weight: prefetching_weights)


_LEAN: dict[tuple, _Lean | None] = {}
_MAX_LEAN = 1024
_NO_LEAN = object()  # ``_LEAN.get``'s default: no plan made yet (a kept None: the general path)


def _lean_plan(x: Tensor, weight: Tensor, bias: Tensor | None, path: str) -> _Lean | None:
    """The launch ``forward`` makes for contiguous, aligned operands, or None where it is not
    one launch of ``matmul_nt``'s "auto" choice (an empty product, K = 0, a path that may be
    cuBLASLt's)."""
    check_gpu_args(x, weight, bias)
    k, n = x.shape[-1], weight.shape[0]
    m = math.prod(x.shape[:-1])
    _check_product(m, n, k)
    if m == 0 or n == 0 or k == 0:
        return None
    if not (bias is not None or path == "own" or m < linear_cublaslt.MIN_ROWS):
        return None
    device = x.device
    index = torch.cuda.current_device() if device.index is None else device.index
    family, config = _auto_choice(m, n, index)
    out_shape = (*x.shape[:-1], n)
    if family == "mma":
        _require_sm80(device)
        kernel = kernel_for("linear", f"linear_mma_{_DTYPE_NAMES[x.dtype]}", device)
        grid = (-(-n // 32), -(-m // 64))
        return _Lean(kernel, grid, (128,), 0, out_shape, (m, n, k), None, ({}, {}))
    rows_per_cta = config.TOKENS_PER_CTA if family == "small_m" else config.block_m
    kernel = _gemm_kernel(config, x.dtype, device)
    allow_dynamic_shared(kernel, config.shared_bytes, index)
    grid = (-(-n // config.block_n) * -(-m // rows_per_cta),)
    boxes = (_DTYPE_NAMES[x.dtype], rows_per_cta, config.block_n)
    block = (config.threads,)
    shared, small_m = config.shared_bytes, family == "small_m"
    return _Lean(kernel, grid, block, shared, out_shape, (m, n, k), boxes, ({}, {}), small_m)


def _lean_map(lean: _Lean, operand: int, address: int, rows: int, k: int, index: int) -> bytes:
    """The TMA map of operand 0 (x) or 1 (the weight) at ``address``, kept per address."""
    maps = lean.maps[operand]
    encoded = maps.get(address)
    if encoded is None:
        dtype_name, *box_rows = lean.boxes
        encoded = _tensor_map(address, dtype_name, rows, k, box_rows[operand], 0, index)
        if len(maps) >= _MAX_MAPS:
            maps.clear()
        maps[address] = encoded
    return encoded


def forward_no_grad(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``forward`` for a call that needs no gradient: the launch kept for its key where it
    applies (see above), else ``forward``."""
    if x.is_contiguous() and weight.is_contiguous() and (bias is None or bias.is_contiguous()):
        x_ptr, w_ptr = x.data_ptr(), weight.data_ptr()
        device = x.device
        index = torch.cuda.current_device() if device.index is None else device.index
        path = linear_cublaslt.configured_path()
        bias_dtype = None if bias is None else bias.dtype
        aligned = not (x_ptr | w_ptr) & 15
        key = (x.shape, weight.shape, x.dtype, weight.dtype, bias_dtype, index, path, aligned)
        lean = _LEAN.get(key, _NO_LEAN)
        if lean is _NO_LEAN:
            lean = _lean_plan(x, weight, bias, path) if aligned else None
            if len(_LEAN) >= _MAX_LEAN:
                _LEAN.clear()
            _LEAN[key] = lean
        if lean is not None:
            out = torch.empty(lean.out_shape, dtype=x.dtype, device=device)
            m, n, k = lean.sizes
            b_ptr = 0 if bias is None else bias.data_ptr()
            if lean.boxes is None:
                args = (x_ptr, w_ptr, out.data_ptr(), b_ptr, m, n, k)
            else:
                map_x = _lean_map(lean, 0, x_ptr, m, k, index)
                map_w = _lean_map(lean, 1, w_ptr, n, k, index)
                args = (map_x, map_w, out.data_ptr(), b_ptr, m, n, k)
            stream = current_raw_stream(index)
            programmatic = lean.small_m and prefetches_weights()
            lean.kernel(lean.grid, lean.block, args, lean.shared, stream, index, programmatic)
            return out
    return forward(x, weight, bias)


def rows_path(m: int, weight: Tensor, has_bias: bool, path: str | None = None) -> str:
    """``"own"`` or ``"cublaslt"``: which path ``matmul_rows`` takes for ``[m, K] @ weightᵀ``.

    ``path`` is the switch's value (``None``: ``linear_cublaslt.configured_path()``).  On first
    use per shape this may run the pinned path's self-check, as the call itself would; the
    answer is then fixed for the process (see ``linear_cublaslt``)."""
    path = (
        linear_cublaslt.configured_path() if path is None else linear_cublaslt.validate_path(path)
    )
    if has_bias or path == "own" or m < linear_cublaslt.MIN_ROWS:
        return "own"
    return "cublaslt" if linear_cublaslt.takes_pinned(m, weight, path, matmul_nt) else "own"


def describe(m: int, n: int, path: str, device: torch.device) -> str:
    """What runs an ``[m, K] x [n, K]ᵀ`` product on ``path`` (as ``rows_path`` answered), e.g.
    ``"own: hopper bm128 bn256 k64 s4"`` or ``"cublaslt: cuBLASLt algo 66 tile 24 ..."``."""
    if path == "cublaslt":
        return f"cublaslt: {linear_cublaslt.pinned_label(n)}"
    index = torch.cuda.current_device() if device.index is None else device.index
    family, config = _auto_choice(m, n, index)
    if family == "mma":
        return "own: mma.sync"
    return f"own: {config}" if family == "small_m" else f"own: hopper {config}"


def matmul_rows(
    rows: Tensor, weight: Tensor, bias: Tensor | None = None, *, path: str | None = None
) -> Tensor:
    """``matmul_nt`` for products whose rows are tokens (the forward and grad_x), on the path
    that ``rows_path`` names: on sm_90, under the switch's ``"auto"`` or ``"cublaslt"``,
    batches of ``linear_cublaslt.MIN_ROWS`` rows or more without bias take cuBLASLt's pinned
    algorithm, checked to give the same bits as batchinv's kernels (see that module)."""
    if rows_path(rows.shape[0], weight, bias is not None, path) == "cublaslt":
        return _pinned_rows(rows, weight)
    return matmul_nt(rows, weight, bias)


def _pinned_rows(rows: Tensor, weight: Tensor) -> Tensor:
    """``rows @ weightᵀ`` on cuBLASLt's pinned algorithm, where ``rows_path`` chose it."""
    rows, weight = _aligned(rows), _aligned(weight)
    out = torch.empty(rows.shape[0], weight.shape[0], dtype=rows.dtype, device=rows.device)
    return linear_cublaslt.matmul_nt(rows, weight, out)


# ---- several small-M products of one x in one launch (q/k/v, gate/up) -----------------------
# ``matmul_grouped`` runs up to ``MAX_GROUPED`` weights in one launch of
# ``linear_small_m_grouped_*``: the CTAs of the separate small-M launches back to back, each
# running the small-M kernel's body on its own weight, so the columns of weight g are the bits
# of the small-M launch for that weight alone (which ``batchinv.linear`` runs at these row
# counts): the same k16 steps in the same order, the bias added the same way, one rounding.
# One ramp-up and one tail instead of one per weight, and more CTAs in flight where a weight
# alone gives few (N = 1024: 32 bands of 32 rows on a 132-SM GPU).

MAX_GROUPED = 3  # the kernel's weight slots
_SMALL_M_GROUPED_NAME = re.compile(r"linear_small_m_grouped_(bf16|f16)_bn(\d+)_k(\d+)_s(\d+)$")


def grouped_kernel_name(config: SmallMConfig, dtype: torch.dtype) -> str:
    """The grouped kernel of a small-M configuration (same tiles, stages and shared memory)."""
    return (
        f"linear_small_m_grouped_{_DTYPE_NAMES[dtype]}_bn{config.block_n}"
        f"_k{config.stage_k}_s{config.stages}"
    )


@functools.cache
def small_m_grouped_configs() -> tuple[SmallMConfig, ...]:
    """The small-M configurations built with a grouped kernel (read from the kernel names)."""
    names = declared_kernels("linear")
    configs = {
        SmallMConfig(int(m[2]), int(m[3]), int(m[4]))
        for name in names
        if (m := _SMALL_M_GROUPED_NAME.match(name))
    }
    return tuple(sorted(configs, key=lambda c: (c.block_n, c.stage_k, c.stages)))


def takes_grouped(m: int, out_features: Sequence[int]) -> bool:
    """Whether ``m`` rows are within the small-M rule (``takes_small_m``) of every weight."""
    return all(takes_small_m(m, n) for n in out_features)


def check_grouped_args(
    x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor | None] | None
) -> tuple[Tensor | None, ...]:
    """``matmul_grouped``'s checks (no device is touched); returns one bias (or None) per
    weight."""
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if x.dtype not in _DTYPE_NAMES:
        raise TypeError(f"x must be bf16 or fp16, got {x.dtype}")
    if not x.is_contiguous():
        raise ValueError("x must be contiguous (call .contiguous() first)")
    if isinstance(weights, Tensor) or not isinstance(weights, Sequence):
        raise TypeError(f"weights must be a list or tuple of tensors, got {type(weights).__name__}")
    if not 1 <= len(weights) <= MAX_GROUPED:
        raise ValueError(f"weights must hold 1 to {MAX_GROUPED} tensors, got {len(weights)}")
    if biases is None:
        biases = (None,) * len(weights)
    elif isinstance(biases, Tensor) or not isinstance(biases, Sequence):
        raise TypeError(
            f"biases must be None or a list or tuple (None or a tensor per weight), "
            f"got {type(biases).__name__}"
        )
    elif len(biases) != len(weights):
        raise ValueError(
            f"biases must hold one entry per weight ({len(weights)}), got {len(biases)}"
        )
    m, k = x.shape
    if k == 0:  # as batchinv.linear: the GPU GEMM has no empty reduction
        raise ValueError(f"in_features must be >= 1, got x of shape {tuple(x.shape)}")
    for i, (weight, bias) in enumerate(zip(weights, biases, strict=True)):
        name = f"weights[{i}]"
        if not isinstance(weight, Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(weight).__name__}")
        if weight.dim() != 2 or weight.shape[1] != k:
            raise ValueError(f"{name} must be [N, {k}] (x's K), got shape {tuple(weight.shape)}")
        if weight.dtype != x.dtype:
            raise TypeError(f"{name} has dtype {weight.dtype} but x has {x.dtype}")
        if weight.device != x.device:
            raise ValueError(f"{name} is on {weight.device} but x is on {x.device}")
        if not weight.is_contiguous():
            raise ValueError(f"{name} must be contiguous (call .contiguous() first)")
        if bias is not None:
            name = f"biases[{i}]"
            if not isinstance(bias, Tensor):
                raise TypeError(f"{name} must be a Tensor or None, got {type(bias).__name__}")
            if tuple(bias.shape) != (weight.shape[0],):
                raise ValueError(f"{name} must be [{weight.shape[0]}], got {tuple(bias.shape)}")
            if bias.dtype != x.dtype:
                raise TypeError(f"{name} has dtype {bias.dtype} but x has {x.dtype}")
            if bias.device != x.device:
                raise ValueError(f"{name} is on {bias.device} but x is on {x.device}")
            if not bias.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
        _check_product(m, weight.shape[0], k)
    out_features = [w.shape[0] for w in weights]
    if sum(out_features) > _MAX_DIM:
        raise ValueError(f"the weights' out_features add up to more than {_MAX_DIM}")
    if not takes_grouped(m, out_features):
        raise ValueError(
            f"x has {m} rows: the grouped small-M kernel takes at most {SMALL_M_MAX_ROWS} rows, "
            f"or {SMALL_M_WIDE_MAX_ROWS} where every weight has at most {SMALL_M_WIDE_MAX_N} "
            f"rows (out_features {out_features}); run separate linears"
        )
    return tuple(biases)


@functools.lru_cache(maxsize=1024)
def _grouped_weight_map(
    address: int, dtype_name: str, rows: int, cols: int, box_rows: int, device_index: int
) -> bytes:
    # Its own cache: a model's q/k/v and gate/up weights (5 per layer) stay encoded.
    return _tensor_map(address, dtype_name, rows, cols, box_rows, 0, device_index)


@functools.lru_cache(maxsize=64)
def _grouped_kernel(config: SmallMConfig, dtype: torch.dtype, device: torch.device):
    return kernel_for("linear", grouped_kernel_name(config, dtype), device)


def matmul_grouped(
    x: Tensor,
    weights: Sequence[Tensor],
    biases: Sequence[Tensor | None] | None = None,
    *,
    config: SmallMConfig | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """``[x @ weights[0]ᵀ (+ biases[0]), x @ weights[1]ᵀ, ...]`` side by side: one
    ``[M, N_0 + N_1 + ...]`` tensor from one launch, for 1 to ``MAX_GROUPED`` contiguous
    ``[N_i, K]`` weights of ``x``'s dtype (bf16, fp16), ``x [M, K]`` contiguous on an sm_90a
    GPU, M within the small-M rule of every weight (``takes_grouped``).  Each weight's columns
    are the bits of ``matmul_nt(x, weights[i], biases[i])`` (see above).  ``biases``: None or
    one entry (None or ``[N_i]``) per weight; ``config`` forces a small-M configuration (tests
    compare them; default ``choose_small_m_config``).  ``out``: a contiguous
    ``[M, N_0 + N_1 + ...]`` tensor of ``x``'s dtype to write into (else a new one).  No
    autograd: for calls that need no gradient."""
    biases = check_grouped_args(x, weights, biases)
    if x.device.type != "cuda" or torch.version.hip or not uses_hopper(x.device):
        raise RuntimeError("the grouped small-M kernel needs an sm_90 GPU and a build with 90a")
    shape = (x.shape[0], sum(w.shape[0] for w in weights))
    if out is not None and (
        not isinstance(out, Tensor)
        or tuple(out.shape) != shape
        or out.dtype != x.dtype
        or out.device != x.device
        or not out.is_contiguous()
    ):
        raise ValueError(f"out must be a contiguous {list(shape)} {x.dtype} tensor on {x.device}")
    if config is not None and not isinstance(config, SmallMConfig):
        raise TypeError(f"config must be a SmallMConfig, got {type(config).__name__}")
    return _launch_grouped(x, weights, biases, config, out)


def _launch_grouped(
    x: Tensor,
    weights: Sequence[Tensor],
    biases: Sequence[Tensor | None],
    config: SmallMConfig | None,
    out: Tensor | None,
) -> Tensor:
    """``matmul_grouped`` on checked arguments (one bias entry per weight)."""
    m, k = x.shape
    out_features = [w.shape[0] for w in weights]
    if out is None:
        out = torch.empty(m, sum(out_features), dtype=x.dtype, device=x.device)
    if m == 0 or out.shape[1] == 0:
        return out
    config = config or choose_small_m_config(m)
    device = x.device
    index = torch.cuda.current_device() if device.index is None else device.index
    dtype_name = _DTYPE_NAMES[x.dtype]
    x, weights = _aligned(x), [_aligned(w) for w in weights]
    maps = [
        _grouped_weight_map(w.data_ptr(), dtype_name, n, k, config.block_n, index) if n else None
        for w, n in zip(weights, out_features, strict=True)
    ]
    # A slot without rows (an empty weight, or no weight) has no CTAs: its map is never read,
    # and any valid map fills the argument.
    spare = next(encoded for encoded in maps if encoded is not None)
    unused = MAX_GROUPED - len(weights)
    maps = [spare if encoded is None else encoded for encoded in maps] + [spare] * unused
    sizes = out_features + [0] * unused
    bias_args = [0 if b is None else b for b in biases] + [0] * unused
    tokens = config.TOKENS_PER_CTA
    ctas = sum(-(-n // config.block_n) for n in sizes) * -(-m // tokens)
    kernel = _grouped_kernel(config, x.dtype, device)
    allow_dynamic_shared(kernel, config.shared_bytes, index)
    launch(
        kernel,
        device,
        grid=(ctas,),
        block=(config.threads,),
        args=(
            _tensor_map(x.data_ptr(), dtype_name, m, k, tokens, 0, index),
            *maps,
            out,
            *bias_args,
            m,
            *sizes,
            k,
        ),
        shared_mem=config.shared_bytes,
        programmatic=prefetches_weights(),
    )
    return out


def _grouped_biases(
    x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor | None] | None
) -> tuple[Tensor | None, ...] | None:
    """``grouped_applies``' answer as the checked biases (one entry per weight), or None."""
    try:
        if torch.compiler.is_compiling() or not isinstance(x, Tensor) or x.dim() < 1:
            return None
        if x.device.type != "cuda" or torch.version.hip:
            return None
        tensors = [x, *weights, *(b for b in biases or () if b is not None)]
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            return None
        if not x.is_contiguous():  # the chain's x is a norm's fresh output
            return None
        checked = check_grouped_args(x.reshape(-1, x.shape[-1]), weights, biases)
        return checked if uses_hopper(x.device) else None
    except (TypeError, ValueError, AttributeError):
        return None


def grouped_applies(
    x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor | None] | None
) -> bool:
    """Whether ``linear_group`` runs ``matmul_grouped`` for ``x [..., K]``: no gradient
    needed, not tracing under ``torch.compile``, a CUDA sm_90a device, and arguments
    ``matmul_grouped`` takes once x's leading dimensions are flattened (x contiguous; its
    checks, the small-M rule of every weight included).  Never raises: anything else is
    False."""
    return _grouped_biases(x, weights, biases) is not None


def describe_grouped(m: int) -> str:
    """What ``linear_group`` launches for ``m`` rows, as ``describe`` labels a path."""
    return f"own: grouped {choose_small_m_config(m)}"


def linear_group(
    x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor | None] | None
) -> tuple[Tensor, ...] | None:
    """``linear(x, weights[i], biases[i])`` for each weight as column views of one
    ``matmul_grouped`` output ``[..., N_0 + N_1 + ...]`` (x ``[..., K]``, each view the bits of
    ``batchinv.linear`` for its weight) where ``grouped_applies``, else None (the caller runs
    the separate linears, which raise what they raise).  The arguments are checked once per
    signature (``_grouped_signature``), whose launch is then kept."""
    if torch.compiler.is_compiling():  # declined before any pointer is read (dynamo cannot)
        return None
    signature = _grouped_signature(x, weights, biases)
    plan = _GENERAL
    if signature is not None:
        plan = _LEAN_GROUPED.get(signature, _NO_LEAN)
        if plan is _NO_LEAN:
            plan = _grouped_plan(x, weights, biases)
            if not (x.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
                if len(_LEAN_GROUPED) >= _MAX_LEAN:
                    _LEAN_GROUPED.clear()
                _LEAN_GROUPED[signature] = plan
    if plan is None:
        return None
    if plan is _GENERAL:
        checked = _grouped_biases(x, weights, biases)
        if checked is None:
            return None
        out = _launch_grouped(x.reshape(-1, x.shape[-1]), weights, checked, None, None)
    else:
        out = _run_grouped(plan, x, weights, biases)
    out = out.reshape(*x.shape[:-1], out.shape[-1])
    return tuple(out.split([w.shape[0] for w in weights], dim=-1))


# ---- linear_group's kept launch ----------------------------------------------------------
# What ``_grouped_biases`` reads is the signature: the classes, shapes, dtypes, devices,
# contiguity and gradient flags of x, the weights and the biases, whether gradients are
# recorded, and whether every pointer is 16-byte aligned (``_launch_grouped`` copies one that
# is not).  A signature seen before replays ``_launch_grouped``'s kernel, grid and integer
# arguments with the pointers as ints and TMA maps kept per address: its bits.


@dataclasses.dataclass(frozen=True)
class _LeanGrouped:
    kernel: object
    grid: tuple[int]
    block: tuple[int]
    shared: int
    m: int
    k: int
    sizes: tuple[int, ...]  # out_features, then zeros for the unused slots
    total: int  # the output's columns
    boxes: tuple[str, int, int]  # TMA maps: dtype name, box rows of x, of a weight
    maps: dict  # (address, rows, box rows) -> encoded TMA map, of x and of each weight


_LEAN_GROUPED: dict[tuple, object] = {}  # signature -> _LeanGrouped, None or _GENERAL
_GENERAL = object()  # a kept answer: the checked path (no rows, no columns)


def _grouped_signature(
    x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor | None] | None
) -> tuple | None:
    """The key of a kept grouped launch, or None where the arguments are not plain tensors
    (or parameters) in lists or tuples, or a pointer is not 16-byte aligned: the checked path
    then decides (and copies a misaligned operand)."""
    try:
        if not isinstance(weights, (list, tuple)) or not (
            biases is None or isinstance(biases, (list, tuple))
        ):
            return None
        tensors = (x, *weights, *(b for b in biases or () if b is not None))
        pointers = 0
        described = []
        for t in tensors:
            if t.__class__ not in _PLAIN_TENSORS:
                return None
            pointers |= t.data_ptr()
            described.append(
                (t.__class__, t.shape, t.dtype, t.device, t.is_contiguous(), t.requires_grad)
            )
        if pointers & 15:
            return None
        pattern = None if biases is None else tuple(b is not None for b in biases)
        return len(weights), pattern, tuple(described), torch.is_grad_enabled()
    except AttributeError:
        return None


_PLAIN_TENSORS = (Tensor, torch.nn.Parameter)


def _grouped_plan(
    x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor | None] | None
) -> object:
    """``_launch_grouped``'s launch for these (aligned) arguments; None where ``linear_group``
    returns None, ``_GENERAL`` for an empty product (the checked path returns its output)."""
    checked = _grouped_biases(x, weights, biases)
    if checked is None:
        return None
    rows = x.reshape(-1, x.shape[-1])
    m, k = rows.shape
    out_features = [w.shape[0] for w in weights]
    if m == 0 or sum(out_features) == 0:
        return _GENERAL
    config = choose_small_m_config(m)
    device = x.device
    index = torch.cuda.current_device() if device.index is None else device.index
    unused = MAX_GROUPED - len(weights)
    sizes = tuple(out_features) + (0,) * unused
    tokens = config.TOKENS_PER_CTA
    ctas = sum(-(-n // config.block_n) for n in sizes) * -(-m // tokens)
    kernel = _grouped_kernel(config, x.dtype, device)
    allow_dynamic_shared(kernel, config.shared_bytes, index)
    boxes = (_DTYPE_NAMES[x.dtype], tokens, config.block_n)
    total = sum(out_features)
    return _LeanGrouped(
        kernel, (ctas,), (config.threads,), config.shared_bytes, m, k, sizes, total, boxes, {}
    )


def _grouped_map(plan: _LeanGrouped, address: int, rows: int, box: int, index: int) -> bytes:
    """A TMA map of ``rows x K`` at ``address`` (x: box rows ``boxes[1]``, a weight:
    ``boxes[2]``), kept per address and shape."""
    key = (address, rows, box)
    encoded = plan.maps.get(key)
    if encoded is None:
        encoded = _tensor_map(address, plan.boxes[0], rows, plan.k, box, 0, index)
        if len(plan.maps) >= 4 * _MAX_MAPS:
            plan.maps.clear()
        plan.maps[key] = encoded
    return encoded


def _run_grouped(
    plan: _LeanGrouped,
    x: Tensor,
    weights: Sequence[Tensor],
    biases: Sequence[Tensor | None] | None,
) -> Tensor:
    """One grouped launch from ``plan``: ``_launch_grouped``'s arguments, pointers as ints."""
    device = x.device
    index = torch.cuda.current_device() if device.index is None else device.index
    out = torch.empty(plan.m, plan.total, dtype=x.dtype, device=device)
    _, x_box, w_box = plan.boxes
    maps = [
        _grouped_map(plan, w.data_ptr(), n, w_box, index) if n else None
        for w, n in zip(weights, plan.sizes, strict=False)
    ]
    spare = next(encoded for encoded in maps if encoded is not None)
    maps = [spare if encoded is None else encoded for encoded in maps]
    maps += [spare] * (MAX_GROUPED - len(weights))
    bias_args = [0 if b is None else b.data_ptr() for b in biases or (None,) * len(weights)]
    bias_args += [0] * (MAX_GROUPED - len(weights))
    args = (
        _grouped_map(plan, x.data_ptr(), plan.m, x_box, index),
        *maps,
        out.data_ptr(),
        *bias_args,
        plan.m,
        *plan.sizes,
        plan.k,
    )
    stream = current_raw_stream(index)
    plan.kernel(plan.grid, plan.block, args, plan.shared, stream, index, prefetches_weights())
    return out


# ---- the backward's products with operands read in place (sm_90) ---------------------------


@dataclasses.dataclass(frozen=True)
class TransposedConfig:
    """One compiled backward kernel that reads M/N-major operands in place (``layout`` "tb":
    B N-major, for ``matmul_nn``; "tab": A M-major too, for ``matmul_tn``) with tiles of
    ``block_m`` rows; always 256 columns, 64-wide k stages, 4 stages (kernels_cu/linear.cu:
    the transposed wgmma is built for n256 only)."""

    layout: str
    block_m: int

    @property
    def tile(self) -> TileConfig:
        """The tile shape, threads and shared memory, those of the K-major kernel alike."""
        return TileConfig(self.block_m, 256, 64, 4)

    def kernel_name(self, dtype: torch.dtype) -> str:
        return f"linear_hopper_{self.layout}_{_DTYPE_NAMES[dtype]}_bm{self.block_m}_bn256_k64_s4"

    def __str__(self) -> str:
        return f"hopper {self.layout} bm{self.block_m} bn256 k64 s4"


TRANSPOSED_BLOCK_M = (64, 128)  # the tile rows built for each layout and dtype


@functools.cache
def transposed_configs() -> tuple[TransposedConfig, ...]:
    """The transposed configurations built into this extension (read from the kernel names)."""
    names = declared_kernels("linear")
    configs = {
        TransposedConfig(m[1], int(m[3])) for name in names if (m := _TRANSPOSED_NAME.match(name))
    }
    return tuple(sorted(configs, key=lambda c: (c.layout, c.block_m)))


def choose_transposed_config(
    layout: str, rows: int, cols: int, multiprocessors: int
) -> TransposedConfig:
    """The tile rows of least estimated time (``choose_config``'s model: waves of CTAs times
    one tile's area over its efficiency) for a ``rows x cols`` result: a speed choice, since
    the K order is the same for both (64-row tiles win where 128-row tiles leave SMs idle)."""

    def estimated_time(block_m: int) -> float:
        config = TileConfig(block_m, 256, 64, 4)
        tiles = -(-rows // block_m) * -(-cols // 256)
        return -(-tiles // multiprocessors) * block_m * 256 / _tile_efficiency(config)

    return TransposedConfig(layout, min(TRANSPOSED_BLOCK_M, key=estimated_time))


def tma_readable(t: Tensor) -> bool:
    """Whether TMA can read the 2-D ``t`` where it lies: non-empty, unit column stride, a row
    stride of a multiple of 16 bytes (and at least a row), a 16-byte aligned base."""
    return (
        t.dim() == 2
        and t.shape[0] > 0
        and t.shape[1] > 0
        and t.stride(1) == 1
        and (t.stride(0) * t.element_size()) % 16 == 0
        and (t.shape[0] == 1 or t.stride(0) >= t.shape[1])
        and t.data_ptr() % 16 == 0
    )


def _check_transposed_operands(a: Tensor, b: Tensor, depth_a: int, depth_b: int) -> None:
    if a.dtype not in _DTYPE_NAMES or b.dtype != a.dtype:
        raise TypeError(f"the operands must be both bf16 or both fp16, got {a.dtype}, {b.dtype}")
    if depth_a != depth_b:
        raise ValueError(f"the reduced dimensions differ: {depth_a} and {depth_b}")
    for name, t in (("a", a), ("b", b)):
        if not tma_readable(t):
            raise ValueError(
                f"{name} cannot be read in place by TMA (shape {tuple(t.shape)}, strides "
                f"{t.stride()}, base {t.data_ptr() % 16} bytes past 16): see tma_readable"
            )
        if max(t.shape) > _MAX_DIM:
            raise ValueError(f"{name} has a dimension above {_MAX_DIM}")
    if not uses_hopper(a.device):
        raise RuntimeError("the in-place backward kernels need an sm_90 GPU and a build with 90a")


def matmul_nn(a: Tensor, b: Tensor, *, config: TransposedConfig | None = None) -> Tensor:
    """``a[M, K] @ b[K, N]`` with ``b`` read N-major where it lies (grad_x = dY · W with
    ``b`` the ``[out, in]`` weight, grad_bias = 1ᵀ · dY); both TMA-readable (``tma_readable``).
    ``config`` forces a ``"tb"`` configuration (tests compare them)."""
    _check_transposed_operands(a, b, a.shape[1], b.shape[0])
    (m, k), n = a.shape, b.shape[1]
    config = config or choose_transposed_config("tb", m, n, multiprocessors(a.device.index))
    if config.layout != "tb":
        raise ValueError(f"matmul_nn runs the 'tb' kernels, got {config}")
    dtype_name = _DTYPE_NAMES[a.dtype]
    map_a = _tensor_map(a.data_ptr(), dtype_name, m, k, config.block_m, a.stride(0), a.device.index)
    map_b = _tensor_map(b.data_ptr(), dtype_name, k, n, 64, b.stride(0), a.device.index)
    return _launch_transposed(config, map_a, map_b, m, n, k, a)


def matmul_tn(a: Tensor, b: Tensor, *, config: TransposedConfig | None = None) -> Tensor:
    """``a[K, M]ᵀ @ b[K, N]`` with both read where they lie, ``a`` M-major and ``b`` N-major
    (grad_weight = dYᵀ · X, K = the tokens); both TMA-readable.  ``config`` forces a
    ``"tab"`` configuration."""
    _check_transposed_operands(a, b, a.shape[0], b.shape[0])
    (k, m), n = a.shape, b.shape[1]
    config = config or choose_transposed_config("tab", m, n, multiprocessors(a.device.index))
    if config.layout != "tab":
        raise ValueError(f"matmul_tn runs the 'tab' kernels, got {config}")
    dtype_name = _DTYPE_NAMES[a.dtype]
    map_a = _tensor_map(a.data_ptr(), dtype_name, k, m, 64, a.stride(0), a.device.index)
    map_b = _tensor_map(b.data_ptr(), dtype_name, k, n, 64, b.stride(0), a.device.index)
    return _launch_transposed(config, map_a, map_b, m, n, k, a)


def _launch_transposed(
    config: TransposedConfig, map_a: bytes, map_b: bytes, m: int, n: int, k: int, like: Tensor
) -> Tensor:
    """One CTA per ``block_m x 256`` tile of the ``[m, n]`` result, k reduced in order."""
    out = torch.empty(m, n, dtype=like.dtype, device=like.device)
    kernel = _gemm_kernel(config, like.dtype, like.device)
    tile = config.tile
    allow_dynamic_shared(kernel, tile.shared_bytes, like.device.index)
    launch(
        kernel,
        like.device,
        grid=(-(-m // tile.block_m) * -(-n // tile.block_n),),
        block=(tile.threads,),
        args=(map_a, map_b, out, 0, m, n, k),  # no bias (kernels_cu/linear.cu says why an argument)
        shared_mem=tile.shared_bytes,
    )
    return out


def _pinned_may_serve_grad_x(m: int, weight: Tensor) -> bool:
    """Whether cuBLASLt's pinned algorithm may serve grad_x's ``[m, N] x [K, N]ᵀ`` under the
    switch (it serves the ``Wᵀ`` layout its self-check compared): never under ``"own"`` or
    below ``MIN_ROWS``, and not once ``"auto"`` has refused the shape (a refusal sticks for
    the process), so a refused shape makes no copy of ``Wᵀ``."""
    path = linear_cublaslt.configured_path()
    if path == "own" or m < linear_cublaslt.MIN_ROWS:
        return False
    n, k = weight.shape
    refused = (weight.device.index, k, n, weight.dtype) in linear_cublaslt.refusals()
    return not (path == "auto" and refused)


def grad_x_route(grad_rows: Tensor, weight: Tensor) -> tuple[str, Tensor | None]:
    """How ``backward`` on sm_90 computes grad_x = ``grad_rows[M, N] · weight[N, K]``:
    ``("in place", None)`` (``matmul_nn``), ``("cublaslt", Wᵀ)`` (the pinned algorithm on
    the contiguous ``Wᵀ`` made for it) or ``("copies", None)`` (``matmul_rows`` on padded
    copies: operands TMA cannot read in place, and decode-sized batches, where the small-M
    kernel beats 64-row tiles of mostly zero rows).  A speed choice: every route gives the
    bits of the forward kernel's K order."""
    m = grad_rows.shape[0]
    k = weight.shape[1]
    if takes_small_m(m, k) or not (tma_readable(grad_rows) and tma_readable(weight)):
        return "copies", None
    if _pinned_may_serve_grad_x(m, weight):
        weight_t = weight.t().contiguous()
        if rows_path(m, weight_t, False) == "cublaslt":
            return "cublaslt", weight_t
    return "in place", None


def backward(
    grad_out: Tensor,
    x: Tensor,
    weight: Tensor,
    bias_dtype: torch.dtype | None,
    needs_input_grad: tuple[bool, bool, bool] = (True, True, True),
    *,
    transposed_copies: bool = False,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``(grad_x, grad_weight, grad_bias)`` with the forward kernel's fixed K order.

    grad_x = grad_y · weight reduces over out_features (per row, so batch-invariant);
    grad_weight = grad_yᵀ · x and grad_bias = 1ᵀ · grad_y reduce over the tokens in
    increasing token order (64-token tiles, k16 steps), bitwise identical run to run.
    On sm_90 the operands are read in place where TMA can (module docstring);
    ``transposed_copies=True`` (tests and benchmarks) runs every product on transposed,
    padded copies instead, as other GPUs do: the same bits.
    """
    if transposed_copies or not uses_hopper(weight.device):
        return _backward(grad_out, x, weight, bias_dtype, needs_input_grad, matmul_rows, matmul_nt)
    if grad_out.is_contiguous() and x.is_contiguous() and weight.is_contiguous():
        done = _lean_backward(grad_out, x, weight, bias_dtype, needs_input_grad)
        if done is not None:
            return done
    n, k = weight.shape
    grad_rows = grad_out.reshape(-1, n).to(x.dtype).contiguous()
    grad_x = grad_weight = grad_bias = None
    if needs_input_grad[0]:
        route, weight_t = grad_x_route(grad_rows, weight)
        if route == "in place":
            grad_x = matmul_nn(grad_rows, weight)
        elif route == "cublaslt":  # grad_x_route has asked rows_path: not asked again
            grad_x = _pinned_rows(grad_rows, weight_t)
        else:
            grad_x = matmul_rows(_pad_columns(grad_rows), _pad_columns(weight.t().contiguous()))
        grad_x = grad_x.reshape(x.shape)
    if needs_input_grad[1]:
        x_rows = x.reshape(-1, k)
        if tma_readable(grad_rows) and tma_readable(x_rows):
            grad_weight = matmul_tn(grad_rows, x_rows)
        else:
            grad_weight = matmul_nt(_token_major(grad_rows), _token_major(x_rows))
    if bias_dtype is not None and needs_input_grad[2]:
        grad_bias = _bias_gradient(grad_rows).reshape(n).to(bias_dtype)
    return grad_x, grad_weight, grad_bias


# ----------------------------------------------------------------------------- lean backward
# A backward whose grad_x (if needed) takes the in-place route and whose weight gradient reads
# its operands in place, on contiguous 16-byte aligned operands with the output's dtype and no
# bias gradient to compute, keeps its launches per key (shapes, dtype, device, the pinned
# path's switch, the gradients asked for, alignment): ``matmul_nn``'s and ``matmul_tn``'s
# configurations, kernels, grids and sizes, and their TMA maps per operand address, as
# ``backward`` chooses them.  A call allocates the gradients and launches with the maps it
# finds: the general path's kernels and arguments, hence its bits.


@dataclasses.dataclass(frozen=True)
class _BackwardLaunch:
    kernel: object
    grid: tuple[int]
    block: tuple[int]
    shared: int
    sizes: tuple[int, int, int]  # the product's m, n, k (matmul_nn's / matmul_tn's names)
    boxes: tuple[tuple[int, int, int], tuple[int, int, int]]  # per operand: rows, cols, box rows
    maps: tuple[dict, dict]  # address -> encoded TMA map, of operand a and of operand b


@dataclasses.dataclass(frozen=True)
class _LeanBackward:
    dtype_name: str
    grad_x: _BackwardLaunch | None  # matmul_nn(grad_rows, weight)
    grad_weight: _BackwardLaunch | None  # matmul_tn(grad_rows, x_rows)


_LEAN_BACKWARD: dict[tuple, _LeanBackward | None] = {}


def _backward_launch(
    layout: str, m: int, n: int, k: int, a_rows_cols: tuple[int, int], a_box: int,
    b_rows_cols: tuple[int, int], dtype: torch.dtype, device: torch.device,
) -> _BackwardLaunch:  # fmt: skip
    """What ``matmul_nn`` (``"tb"``) or ``matmul_tn`` (``"tab"``) launches for an ``[m, n]``
    result reduced over ``k``; operand maps of ``rows x cols`` with the given box rows."""
    config = choose_transposed_config(layout, m, n, multiprocessors(device.index))
    tile = config.tile
    kernel = _gemm_kernel(config, dtype, device)
    allow_dynamic_shared(kernel, tile.shared_bytes, device.index)
    box_a = config.block_m if layout == "tb" else a_box
    return _BackwardLaunch(
        kernel,
        (-(-m // tile.block_m) * -(-n // tile.block_n),),
        (tile.threads,),
        tile.shared_bytes,
        (m, n, k),
        ((*a_rows_cols, box_a), (*b_rows_cols, 64)),
        ({}, {}),
    )


def _lean_backward_plan(
    grad_rows: Tensor, x_rows: Tensor, weight: Tensor, needs: tuple[bool, bool]
) -> _LeanBackward | None:
    """The launches ``backward`` makes, or None where it takes another route for grad_x
    (copies, cuBLASLt) or copies for the weight gradient."""
    (m, n), k = grad_rows.shape, weight.shape[1]
    if m == 0 or n == 0 or k == 0:
        return None
    readable = tma_readable(grad_rows) and tma_readable(x_rows) and tma_readable(weight)
    if not readable or (needs[0] and grad_x_route(grad_rows, weight)[0] != "in place"):
        return None
    dtype, device = grad_rows.dtype, grad_rows.device
    grad_x = grad_weight = None
    if needs[0]:  # matmul_nn(grad_rows, weight): [m, k] reduced over n
        _check_transposed_operands(grad_rows, weight, n, n)
        grad_x = _backward_launch("tb", m, k, n, (m, n), 0, (n, k), dtype, device)
    if needs[1]:  # matmul_tn(grad_rows, x_rows): [n, k] reduced over the m tokens
        _check_transposed_operands(grad_rows, x_rows, m, m)
        grad_weight = _backward_launch("tab", n, k, m, (m, n), 64, (m, k), dtype, device)
    return _LeanBackward(_DTYPE_NAMES[dtype], grad_x, grad_weight)


def _backward_map(
    launch_plan: _BackwardLaunch, operand: int, address: int, index: int, dtype_name: str
) -> bytes:
    """The TMA map of operand 0 (a) or 1 (b) at ``address``, kept per address."""
    maps = launch_plan.maps[operand]
    encoded = maps.get(address)
    if encoded is None:
        rows, cols, box_rows = launch_plan.boxes[operand]
        encoded = _tensor_map(address, dtype_name, rows, cols, box_rows, cols, index)
        if len(maps) >= _MAX_MAPS:
            maps.clear()
        maps[address] = encoded
    return encoded


def _run_backward_launch(
    launch_plan: _BackwardLaunch, a_ptr: int, b_ptr: int, out: Tensor, index: int, name: str
) -> None:
    map_a = _backward_map(launch_plan, 0, a_ptr, index, name)
    map_b = _backward_map(launch_plan, 1, b_ptr, index, name)
    m, n, k = launch_plan.sizes
    stream = current_raw_stream(index)
    args = (map_a, map_b, out.data_ptr(), 0, m, n, k)
    launch_plan.kernel(
        launch_plan.grid, launch_plan.block, args, launch_plan.shared, stream, index, False
    )


def _lean_backward(
    grad_out: Tensor,
    x: Tensor,
    weight: Tensor,
    bias_dtype: torch.dtype | None,
    needs_input_grad: tuple[bool, bool, bool],
) -> tuple[Tensor | None, Tensor | None, None] | None:
    """``backward`` from the launches kept for its key, or None where no plan applies."""
    needs_x, needs_weight = bool(needs_input_grad[0]), bool(needs_input_grad[1])
    if (bias_dtype is not None and needs_input_grad[2]) or grad_out.dtype != x.dtype:
        return None
    g_ptr, x_ptr, w_ptr = grad_out.data_ptr(), x.data_ptr(), weight.data_ptr()
    device = weight.device
    index = torch.cuda.current_device() if device.index is None else device.index
    aligned = not (g_ptr | x_ptr | w_ptr) & 15
    path = linear_cublaslt.configured_path()
    key = (grad_out.shape, x.shape, weight.shape, x.dtype, index, path, needs_x, needs_weight)
    key += (aligned,)
    plan = _LEAN_BACKWARD.get(key, _NO_LEAN)
    if plan is _NO_LEAN:
        plan = None
        if aligned and (needs_x or needs_weight):
            n, k = weight.shape
            rows = grad_out.reshape(-1, n)
            plan = _lean_backward_plan(rows, x.reshape(-1, k), weight, (needs_x, needs_weight))
        if not torch.cuda.is_current_stream_capturing():
            if len(_LEAN_BACKWARD) >= _MAX_LEAN:
                _LEAN_BACKWARD.clear()
            _LEAN_BACKWARD[key] = plan
    if plan is None:
        return None
    grad_x = grad_weight = None
    if plan.grad_x is not None:
        grad_x = torch.empty(x.shape, dtype=x.dtype, device=device)
        _run_backward_launch(plan.grad_x, g_ptr, w_ptr, grad_x, index, plan.dtype_name)
    if plan.grad_weight is not None:
        grad_weight = torch.empty(weight.shape, dtype=x.dtype, device=device)
        _run_backward_launch(plan.grad_weight, g_ptr, x_ptr, grad_weight, index, plan.dtype_name)
    return grad_x, grad_weight, None


def describe_backward(grad_rows: Tensor, x_rows: Tensor, weight: Tensor) -> tuple[str, str]:
    """What ``backward`` runs on sm_90 for grad_x and grad_weight, e.g.
    ``"in place: hopper tb bm128 bn256 k64 s4"`` or ``"copies: own: hopper bm128 bn256 k64 s4"``
    (may run the pinned path's self-check on first use per shape, as the call itself would)."""
    (m, n), k, device = grad_rows.shape, weight.shape[1], weight.device
    sms = multiprocessors(device.index)
    route, weight_t = grad_x_route(grad_rows, weight)
    if route == "in place":
        label_x = f"in place: {choose_transposed_config('tb', m, k, sms)}"
    elif route == "cublaslt":
        label_x = f"copies: {describe(m, k, 'cublaslt', device)}"
    else:
        path_x = rows_path(m, _pad_columns(weight.t().contiguous()), False)
        label_x = f"copies: {describe(m, k, path_x, device)}"
    if tma_readable(grad_rows) and tma_readable(x_rows):
        label_w = f"in place: {choose_transposed_config('tab', n, k, sms)}"
    else:
        label_w = f"copies: {describe(n, k, 'own', device)}"
    return label_x, label_w


def _token_major(rows: Tensor) -> Tensor:
    """``rows[M, C]`` as a contiguous ``[C, M]`` copy, zero-padded to a multiple of 8 tokens
    (the copy path's operands for the products over the tokens)."""
    return _pad_columns(rows.t().contiguous())


def _bias_gradient(grad_rows: Tensor) -> Tensor:
    """``1ᵀ · grad_rows`` as ``[1, N]``: in place where TMA can read ``grad_rows``, from a row
    of ones allocated to a multiple of 8 (a 16-byte row stride) of which the map reads M."""
    m = grad_rows.shape[0]
    if not tma_readable(grad_rows):
        grad_t = _token_major(grad_rows)
        ones = torch.ones(1, grad_t.shape[1], dtype=grad_t.dtype, device=grad_t.device)
        return matmul_nt(ones, grad_t)
    ones = torch.ones(1, -(-m // 8) * 8, dtype=grad_rows.dtype, device=grad_rows.device)
    return matmul_nn(ones[:, :m], grad_rows)


def _backward(
    grad_out: Tensor,
    x: Tensor,
    weight: Tensor,
    bias_dtype: torch.dtype | None,
    needs_input_grad: tuple[bool, bool, bool],
    rows_matmul: Callable[[Tensor, Tensor], Tensor],
    matmul: Callable[[Tensor, Tensor], Tensor],
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``backward``'s products: ``rows_matmul`` for grad_x (its rows are tokens), ``matmul``
    for the two that reduce over the tokens."""
    n, k = weight.shape
    grad_rows = grad_out.reshape(-1, n).to(x.dtype).contiguous()
    grad_x = grad_weight = grad_bias = None
    if needs_input_grad[0]:
        weight_t = _pad_columns(
            weight.t().contiguous()
        )  # [K, N]: out_features become the reduction
        grad_x = rows_matmul(_pad_columns(grad_rows), weight_t).reshape(x.shape)
    needs_tokens_major = needs_input_grad[1] or (bias_dtype is not None and needs_input_grad[2])
    if needs_tokens_major:
        grad_t = _pad_columns(grad_rows.t().contiguous())  # [N, M]: tokens become the reduction
    if needs_input_grad[1]:
        x_t = _pad_columns(x.reshape(-1, k).t().contiguous())  # [K, M]
        grad_weight = matmul(grad_t, x_t)
    if bias_dtype is not None and needs_input_grad[2]:
        ones = torch.ones(1, grad_t.shape[1], dtype=grad_t.dtype, device=grad_t.device)
        grad_bias = matmul(ones, grad_t).reshape(n).to(bias_dtype)
    return grad_x, grad_weight, grad_bias


# ---- HIP: the portable loop ---------------------------------------------------------------
# On HIP every product runs kernels_cu/linear.cu's SIMT loop, linear_simt_* (no matrix cores):
# each output is one fp32 FMA chain over k in increasing order, rounded once, so a row's bits
# cannot depend on the batch, and the products over tokens are bitwise identical run to run.
# Neither the Hopper kernels nor cuBLASLt exist there.  Compiled for gfx90a and gfx942, never
# run on AMD hardware (docs/amd.md).  The CUDA build exports the same loop under the same
# names, so hip_forward and hip_backward also run on an NVIDIA GPU (the tests' only way to run
# HIP's arithmetic).


def simt_matmul_nt(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x[M, K] @ weight[N, K]ᵀ (+ bias)`` for contiguous 2-D bf16/fp16 GPU tensors on the
    portable loop (``linear_simt_*``), whatever the backend."""
    out, done = _product_output(x, weight, bias, None)
    if done:
        return out
    m, k = x.shape
    n = weight.shape[0]
    launch(
        kernel_for("linear", f"linear_simt_{_DTYPE_NAMES[x.dtype]}", x.device),
        x.device,
        grid=(-(-n // 32), -(-m // 64)),
        block=(128,),
        args=(x, weight, out, 0 if bias is None else bias, m, n, k),
    )
    return out


def hip_forward(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """The registry's ``linear.forward`` on HIP: ``x [..., K]`` -> ``[..., N]`` (see above)."""
    check_gpu_args(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    return simt_matmul_nt(rows, weight, bias).reshape(*x.shape[:-1], weight.shape[0])


def hip_backward(
    grad_out: Tensor,
    x: Tensor,
    weight: Tensor,
    bias_dtype: torch.dtype | None,
    needs_input_grad: tuple[bool, bool, bool] = (True, True, True),
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The registry's ``linear.backward`` on HIP: ``backward``'s products on the loop."""
    return _backward(
        grad_out, x, weight, bias_dtype, needs_input_grad, simt_matmul_nt, simt_matmul_nt
    )


def check_gpu_args(x: Tensor, weight: Tensor, bias: Tensor | None) -> None:
    """What only the GPU path needs; ``batchinv.linear`` has already run check_linear_args."""
    if x.dtype not in _DTYPE_NAMES:
        raise TypeError(
            f"the GPU linear takes bf16 or fp16 inputs, got {x.dtype} "
            "(use the fp32 reference batchinv.reference.linear.linear_fp32 on the CPU)"
        )
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous on the GPU (call .contiguous() first)")
    if bias is not None and not bias.is_contiguous():
        raise ValueError("bias must be contiguous on the GPU")


# ---- the K-group tree (batchinv.linear_k_groups) ---------------------------------------------
# kernels_cu/linear.cu's linear_kgroup_* kernels: the partials run the linear's main loops over
# one group's columns each (grid (tiles, groups)), the tree sums P partials elementwise.  Which
# family computes the partials follows M as batchinv.linear's choice does (a speed choice: both
# give each group the same bits); the group width is an argument, so a rank's shard of whole
# groups reduces the columns the full call's groups do.  No host sync and no host state that
# changes between calls of one shape: capturable in a CUDA graph.
# K_GROUPS (batchinv.reference.linear) is kKGroups in kernels_cu/linear.cu.
K_GROUP_TILE = TileConfig(128, 256, 64, 4)
K_GROUP_SMALL_M = SmallMConfig(32, 128, 8)
_TREE_COUNTS = (1, 2, 4, 8)
_TREE_BLOCK = 256


def k_group_kernel_name(config: TileConfig | SmallMConfig, dtype: torch.dtype) -> str:
    """The partials kernel of ``config`` (``K_GROUP_TILE`` or ``K_GROUP_SMALL_M``)."""
    return config.kernel_name(dtype).replace("linear_", "linear_kgroup_", 1)


def k_group_partials(
    x: Tensor, weight: Tensor, group_width: int, groups: int, *, family: str = "auto"
) -> Tensor:
    """fp32 ``[groups, M, N]``: group g is ``x[:, b:e] @ weight[:, b:e]ᵀ`` over its columns
    ``[b, e) = [g*group_width, min((g+1)*group_width, K))`` (+0.0 where ``b >= K``), for
    contiguous 2-D bf16/fp16 CUDA tensors ``x [M, K]`` and ``weight [N, K]`` on sm_90.

    ``family``: ``"auto"`` (the small-M kernel up to ``SMALL_M_MAX_ROWS`` rows, the 128x256
    tile above), ``"small_m"`` or ``"hopper"`` (tests compare them).  The caller has checked
    the layout (``batchinv.reference.linear.check_k_group_args``)."""
    if not uses_hopper(x.device):
        raise RuntimeError("the K-group linear kernels need an sm_90 GPU and a build with 90a")
    if group_width < 64 or group_width % 64 != 0 or not 1 <= groups <= K_GROUPS:
        raise ValueError(
            f"group_width must be a positive multiple of 64 and groups in [1, {K_GROUPS}], "
            f"got group_width = {group_width}, groups = {groups}"
        )
    m, k = x.shape
    n = weight.shape[0]
    _check_product(m, n, k)
    if groups * group_width < k:
        raise ValueError(f"groups * group_width = {groups * group_width} < in_features = {k}")
    partials = torch.empty(groups, m, n, dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return partials
    if family == "auto":
        family = "small_m" if m <= SMALL_M_MAX_ROWS else "hopper"
    if family == "small_m":
        config, box_rows_x = K_GROUP_SMALL_M, K_GROUP_SMALL_M.TOKENS_PER_CTA
    elif family == "hopper":
        config, box_rows_x = K_GROUP_TILE, K_GROUP_TILE.block_m
    else:
        raise ValueError(f"family must be 'auto', 'hopper' or 'small_m', got {family!r}")
    x, weight = _aligned(x), _aligned(weight)
    dtype_name = _DTYPE_NAMES[x.dtype]
    map_x = _tensor_map(x.data_ptr(), dtype_name, m, k, box_rows_x, 0, x.device.index)
    map_w = _tensor_map(weight.data_ptr(), dtype_name, n, k, config.block_n, 0, x.device.index)
    kernel = _k_group_kernel(config, x.dtype, x.device)
    allow_dynamic_shared(kernel, config.shared_bytes, x.device.index)
    launch(
        kernel,
        x.device,
        grid=(-(-n // config.block_n) * -(-m // box_rows_x), groups),
        block=(config.threads,),
        args=(map_x, map_w, partials, m, n, k, group_width),
        shared_mem=config.shared_bytes,
    )
    return partials


@functools.lru_cache(maxsize=64)
def _k_group_kernel(config: TileConfig | SmallMConfig, dtype: torch.dtype, device: torch.device):
    return kernel_for("linear", k_group_kernel_name(config, dtype), device)


def k_group_tree(
    partials: Tensor, bias: Tensor | None = None, out_dtype: torch.dtype = torch.float32
) -> Tensor:
    """The fixed tree over a contiguous fp32 CUDA ``partials [P, ..., N]`` (P in 1, 2, 4, 8):
    ``((p0+p1)+(p2+p3))+((p4+p5)+(p6+p7))`` elementwise, then, for a bf16/fp16 ``out_dtype``,
    ``+ bias[N]`` in fp32 and one rounding; for fp32, the node sum itself (no bias)."""
    if partials.dtype != torch.float32 or not partials.is_contiguous():
        raise TypeError("partials must be a contiguous float32 tensor")
    if partials.dim() < 1 or partials.shape[0] not in _TREE_COUNTS:
        raise ValueError(f"partials must be [P, ...] with P in 1, 2, 4, 8, got {partials.shape}")
    if out_dtype == torch.float32:
        if bias is not None:
            raise ValueError("an fp32 node sum takes no bias (it is added once, after the tree)")
        dtype_name = "f32"
    elif out_dtype in _DTYPE_NAMES:
        dtype_name = _DTYPE_NAMES[out_dtype]
        if bias is not None and (bias.dtype != out_dtype or not bias.is_contiguous()):
            raise ValueError(f"bias must be a contiguous {out_dtype} tensor")
    else:
        raise TypeError(f"out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    count = partials.shape[0]
    out = torch.empty(partials.shape[1:], dtype=out_dtype, device=partials.device)
    elements = out.numel()
    if elements == 0:
        return out
    index = partials.device.index
    launch(
        kernel_for("linear", f"linear_kgroup_tree_{dtype_name}", partials.device),
        partials.device,
        grid=(min(-(-elements // _TREE_BLOCK), 8 * multiprocessors(index)),),
        block=(_TREE_BLOCK,),
        args=(partials, count, 0 if bias is None else bias, out, elements, out.shape[-1:].numel()),
    )
    return out


def k_groups_forward(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """The registry's ``linear_k_groups.forward`` on CUDA: ``x [..., K]`` -> ``[..., N]``:
    ``K_GROUPS`` partials of ``k_group_width(K)`` columns, the tree, the bias, one rounding."""
    check_gpu_args(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    partials = k_group_partials(rows, weight, k_group_width(x.shape[-1]), K_GROUPS)
    out = k_group_tree(partials, bias, x.dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def k_group_partials_forward(x: Tensor, weight: Tensor, group_width: int, groups: int) -> Tensor:
    """The registry's ``linear_k_groups.partials`` on CUDA: fp32 ``[groups, *x.shape[:-1], N]``."""
    check_gpu_args(x, weight, None)
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    partials = k_group_partials(rows, weight, group_width, groups)
    return partials.reshape(groups, *x.shape[:-1], weight.shape[0])


def k_group_tree_sum(partials: Tensor) -> Tensor:
    """The registry's ``linear_k_groups.tree_sum`` on CUDA: the fp32 node sum of ``partials``."""
    return k_group_tree(partials.contiguous())

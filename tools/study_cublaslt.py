"""Issue 4 study: can cuBLASLt with one pinned algorithm serve as a batch-invariant linear?

For each Qwen3-8B linear shape and dtype: ask cuBLASLt's heuristic (no workspace allowed) for
its top algorithm at M = 4096, pin it (algo id, tile, stages, swizzle, custom option, inner and
cluster shape as the heuristic chose; split-K 1, reduction scheme none), then run that one
algorithm at every M of the sweep.  ``cublasLtMatmulAlgoCheck`` decides whether the pinned
algorithm can serve an M at all, and with how much workspace (0 is the goal; where it asks for
some, the run gets exactly that much and the table says so).  Where it can, every probe row
computed alone must be bitwise equal to the same row inside the batch (the contract's
comparator), and every row of the batch must be bitwise equal to the same row of the M = 8191
batch.  Stock ``torch.mm`` gets
the same checks for contrast.  bf16 is also timed against ``torch.mm`` and
``batchinv.linear`` (the same kernel, ``matmul_nt``) in the same run.

Writes a JSON (``--json``) and a markdown table (``--markdown``).  Needs an NVIDIA GPU and the
libcublasLt that PyTorch loads; not a dependency of anything else in the repository.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "py"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import environment, median_ms  # noqa: E402

from batchinv.contract import assert_bitwise_equal, assert_within_tolerance  # noqa: E402
from batchinv.gpu.linear import matmul_nt  # noqa: E402
from batchinv.shapes import LINEAR_BENCH_M, LINEAR_M_SWEEP, QWEN3_8B_LINEAR  # noqa: E402

PROBE_ROWS = (0, 1, 2, 16, 64, 256, 1023, 4095, 8190)
PIN_AT_M = 4096
# Pinnings tried: the heuristic's configuration as it is, and the same with custom option 0
# (the heuristic's custom option may select a tile scheduler that adapts to the grid).
VARIANTS = (("heuristic", {}), ("custom option 0", {"custom_option": 0}))

# Values from cublasLt.h, cublas_api.h and library_types.h (CUDA 13.0).
CUBLAS_COMPUTE_32F = 68
CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF = 0, 2, 14
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
MATMUL_DESC_TRANSA, MATMUL_DESC_TRANSB = 3, 4
PREF_MAX_WORKSPACE_BYTES = 1
CAP_NUMERICAL_IMPL_FLAGS = 15
STATUS_NAMES = {
    0: "SUCCESS",
    1: "NOT_INITIALIZED",
    3: "ALLOC_FAILED",
    7: "INVALID_VALUE",
    8: "ARCH_MISMATCH",
    11: "MAPPING_ERROR",
    13: "EXECUTION_FAILED",
    14: "INTERNAL_ERROR",
    15: "NOT_SUPPORTED",
    16: "LICENSE_ERROR",
}
# (attribute id, name, ctypes type) of cublasLtMatmulAlgoConfigAttributes_t, in the order
# they are set on the pinned algorithm.  The id is read-only (set by AlgoInit).
ALGO_CONFIG = (
    (0, "algo_id", ctypes.c_int32),
    (1, "tile_id", ctypes.c_uint32),
    (2, "splitk_num", ctypes.c_int32),
    (3, "reduction_scheme", ctypes.c_uint32),
    (4, "cta_swizzling", ctypes.c_uint32),
    (5, "custom_option", ctypes.c_uint32),
    (6, "stages_id", ctypes.c_uint32),
    (7, "inner_shape_id", ctypes.c_uint16),
    (8, "cluster_shape_id", ctypes.c_uint16),
)
DATA_TYPES = {torch.bfloat16: CUDA_R_16BF, torch.float16: CUDA_R_16F}


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class HeuristicResult(ctypes.Structure):
    _fields_ = [
        ("algo", Algo),
        ("workspace_size", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("waves_count", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


def _declare(lib: ctypes.CDLL) -> None:
    """Argument types from cublasLt.h: without them ctypes passes every Python int as a C
    int, which leaves the upper half of a 64-bit size_t argument undefined."""
    ptr, size, i32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    out_ptr, algo, result = (
        ctypes.POINTER(ptr),
        ctypes.POINTER(Algo),
        ctypes.POINTER(HeuristicResult),
    )
    signatures = {
        "cublasLtCreate": [out_ptr],
        "cublasLtMatmulDescCreate": [out_ptr, i32, i32],
        "cublasLtMatmulDescSetAttribute": [ptr, i32, ptr, size],
        "cublasLtMatmulDescDestroy": [ptr],
        "cublasLtMatrixLayoutCreate": [
            out_ptr,
            i32,
            ctypes.c_uint64,
            ctypes.c_uint64,
            ctypes.c_int64,
        ],
        "cublasLtMatrixLayoutDestroy": [ptr],
        "cublasLtMatmulPreferenceCreate": [out_ptr],
        "cublasLtMatmulPreferenceSetAttribute": [ptr, i32, ptr, size],
        "cublasLtMatmulPreferenceDestroy": [ptr],
        "cublasLtMatmulAlgoGetHeuristic": [ptr] * 7 + [i32, result, ctypes.POINTER(i32)],
        "cublasLtMatmulAlgoInit": [ptr] + [i32] * 7 + [algo],
        "cublasLtMatmulAlgoConfigSetAttribute": [algo, i32, ptr, size],
        "cublasLtMatmulAlgoConfigGetAttribute": [algo, i32, ptr, size, ctypes.POINTER(size)],
        "cublasLtMatmulAlgoCapGetAttribute": [algo, i32, ptr, size, ctypes.POINTER(size)],
        "cublasLtMatmulAlgoCheck": [ptr] * 6 + [algo, result],
        "cublasLtMatmul": [ptr] * 12 + [algo, ptr, size, ptr],
    }
    for name, argtypes in signatures.items():
        function = getattr(lib, name)
        function.argtypes = argtypes
        function.restype = i32
    lib.cublasLtGetVersion.argtypes = []
    lib.cublasLtGetVersion.restype = size


class CublasLtError(RuntimeError):
    def __init__(self, call: str, status: int):
        super().__init__(f"{call} returned {STATUS_NAMES.get(status, status)}")
        self.status = status


def _find_cublaslt() -> str:
    """The libcublasLt this process already has loaded (torch loads it), else the wheel's."""
    torch.mm(torch.ones(8, 8, device="cuda"), torch.ones(8, 8, device="cuda"))
    torch.cuda.synchronize()
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "libcublasLt.so" in path:
                return path
    import nvidia  # the CUDA wheels torch depends on

    for base in nvidia.__path__:
        found = sorted(glob.glob(os.path.join(base, "*", "lib", "libcublasLt.so*")))
        if found:
            return found[0]
    raise SystemExit("libcublasLt is neither loaded by torch nor in the nvidia wheels")


class CublasLt:
    """Thin ctypes bindings: one handle, NT matmul of row-major x[M, K] and weight[N, K]."""

    def __init__(self, path: str):
        self.path = path
        self.lib = ctypes.CDLL(path)
        _declare(self.lib)
        self.version = int(self.lib.cublasLtGetVersion())
        self.handle = ctypes.c_void_p()
        self._call("cublasLtCreate", ctypes.byref(self.handle))

    def _call(self, name: str, *args) -> None:
        status = getattr(self.lib, name)(*args)
        if status != 0:
            raise CublasLtError(name, status)

    def _try(self, name: str, *args) -> int:
        return int(getattr(self.lib, name)(*args))

    def descriptors(self, m: int, n: int, k: int, dtype: torch.dtype):
        """Column-major view: D[N, M] = op(A = weight)[N, K] * B (= xᵀ)[K, M], i.e. the
        row-major y[M, N] = x · weightᵀ."""
        data_type = DATA_TYPES[dtype]
        desc = ctypes.c_void_p()
        self._call(
            "cublasLtMatmulDescCreate",
            ctypes.byref(desc),
            CUBLAS_COMPUTE_32F,
            CUDA_R_32F,
        )
        for attr, value in ((MATMUL_DESC_TRANSA, CUBLAS_OP_T), (MATMUL_DESC_TRANSB, CUBLAS_OP_N)):
            op = ctypes.c_int32(value)
            self._call(
                "cublasLtMatmulDescSetAttribute", desc, attr, ctypes.byref(op), ctypes.sizeof(op)
            )
        layouts = []
        for rows, cols, ld in ((k, n, k), (k, m, k), (n, m, n)):  # A, B, C = D
            layout = ctypes.c_void_p()
            self._call(
                "cublasLtMatrixLayoutCreate",
                ctypes.byref(layout),
                data_type,
                ctypes.c_uint64(rows),
                ctypes.c_uint64(cols),
                ctypes.c_int64(ld),
            )
            layouts.append(layout)
        return desc, layouts

    def destroy(self, desc, layouts) -> None:
        for layout in layouts:
            self.lib.cublasLtMatrixLayoutDestroy(layout)
        self.lib.cublasLtMatmulDescDestroy(desc)

    def heuristic_top(self, m: int, n: int, k: int, dtype: torch.dtype) -> HeuristicResult:
        desc, (a, b, c) = self.descriptors(m, n, k, dtype)
        pref = ctypes.c_void_p()
        self._call("cublasLtMatmulPreferenceCreate", ctypes.byref(pref))
        workspace = ctypes.c_size_t(0)
        self._call(
            "cublasLtMatmulPreferenceSetAttribute",
            pref,
            PREF_MAX_WORKSPACE_BYTES,
            ctypes.byref(workspace),
            ctypes.sizeof(workspace),
        )
        result = HeuristicResult()
        count = ctypes.c_int(0)
        try:
            self._call(
                "cublasLtMatmulAlgoGetHeuristic",
                self.handle,
                desc,
                a,
                b,
                c,
                c,
                pref,
                1,
                ctypes.byref(result),
                ctypes.byref(count),
            )
        finally:
            self.lib.cublasLtMatmulPreferenceDestroy(pref)
            self.destroy(desc, [a, b, c])
        if count.value < 1 or result.state != 0:
            raise RuntimeError(f"the heuristic returned no algorithm for M={m} N={n} K={k}")
        return result

    def read_config(self, algo: Algo) -> dict[str, int]:
        config = {}
        for attr, name, ctype in ALGO_CONFIG:
            value, written = ctype(0), ctypes.c_size_t(0)
            self._call(
                "cublasLtMatmulAlgoConfigGetAttribute",
                ctypes.byref(algo),
                attr,
                ctypes.byref(value),
                ctypes.sizeof(value),
                ctypes.byref(written),
            )
            config[name] = int(value.value)
        flags, written = ctypes.c_uint64(0), ctypes.c_size_t(0)
        status = self._try(
            "cublasLtMatmulAlgoCapGetAttribute",
            ctypes.byref(algo),
            CAP_NUMERICAL_IMPL_FLAGS,
            ctypes.byref(flags),
            ctypes.sizeof(flags),
            ctypes.byref(written),
        )
        config["numerical_impl_flags"] = hex(flags.value) if status == 0 else None
        return config

    def pinned_algo(self, config: dict[str, int], dtype: torch.dtype) -> Algo:
        """A fresh algorithm with the given configuration, split-K 1, no reduction scheme."""
        data_type = DATA_TYPES[dtype]
        algo = Algo()
        self._call(
            "cublasLtMatmulAlgoInit",
            self.handle,
            CUBLAS_COMPUTE_32F,
            CUDA_R_32F,
            data_type,
            data_type,
            data_type,
            data_type,
            config["algo_id"],
            ctypes.byref(algo),
        )
        pinned = {**config, "splitk_num": 1, "reduction_scheme": 0}
        for attr, name, ctype in ALGO_CONFIG[1:]:
            value = ctype(pinned[name])
            self._call(
                "cublasLtMatmulAlgoConfigSetAttribute",
                ctypes.byref(algo),
                attr,
                ctypes.byref(value),
                ctypes.sizeof(value),
            )
        return algo

    def check(self, algo: Algo, m: int, n: int, k: int, dtype: torch.dtype) -> tuple[int, int]:
        """(status of cublasLtMatmulAlgoCheck, workspace bytes it says the algo needs)."""
        desc, (a, b, c) = self.descriptors(m, n, k, dtype)
        result = HeuristicResult()
        try:
            status = self._try(
                "cublasLtMatmulAlgoCheck",
                self.handle,
                desc,
                a,
                b,
                c,
                c,
                ctypes.byref(algo),
                ctypes.byref(result),
            )
        finally:
            self.destroy(desc, [a, b, c])
        return status, int(result.workspace_size)

    def matmul_fn(self, algo: Algo, x: torch.Tensor, weight: torch.Tensor, workspace: int = 0):
        """A callable writing ``x · weightᵀ`` with ``algo`` and ``workspace`` bytes of
        workspace; returns the output tensor.  Descriptors are built once (timing reuses them)."""
        m, k = x.shape
        n = weight.shape[0]
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        scratch = torch.empty(max(workspace, 1), dtype=torch.uint8, device=x.device)
        desc, (a, b, c) = self.descriptors(m, n, k, x.dtype)
        alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        args = (
            self.handle,
            desc,
            ctypes.byref(alpha),
            ctypes.c_void_p(weight.data_ptr()),
            a,
            ctypes.c_void_p(x.data_ptr()),
            b,
            ctypes.byref(beta),
            ctypes.c_void_p(out.data_ptr()),
            c,
            ctypes.c_void_p(out.data_ptr()),
            c,
            ctypes.byref(algo),
            ctypes.c_void_p(scratch.data_ptr()) if workspace else None,
            ctypes.c_size_t(workspace),
            stream,
        )
        operands = (x, weight, scratch)  # the raw pointers in ``args`` must outlive every call

        def run() -> torch.Tensor:
            assert operands
            self._call("cublasLtMatmul", *args)
            return out

        return run


def _mismatching_rows(batch: torch.Tensor, full_prefix: torch.Tensor) -> int:
    """Rows whose bit patterns differ (an integer view; no tolerance)."""
    bits = torch.int16
    return int((batch.view(bits) != full_prefix.view(bits)).any(dim=1).sum())


def _probe_failures(batch: torch.Tensor, alone: dict[int, torch.Tensor], label: str) -> list:
    failures = []
    for i, expected in alone.items():
        if i < batch.shape[0]:
            try:
                assert_bitwise_equal(batch[i : i + 1], expected, name=f"{label} row {i}")
            except AssertionError as error:
                failures.append({"row": i, "message": str(error).splitlines()[0]})
    return failures


def study_shape(
    lt: CublasLt, name, k, n, dtype, sweep, variant, timed_m: tuple, rep_ms: float
) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    m_max = max(sweep)
    x = torch.randn(m_max, k, device="cuda", generator=gen).to(dtype)
    weight = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(dtype)
    top = lt.heuristic_top(PIN_AT_M, n, k, dtype)
    heuristic_config = lt.read_config(top.algo)
    heuristic_check = lt.check(top.algo, PIN_AT_M, n, k, dtype)
    entry = {
        "layer": name,
        "N": n,
        "K": k,
        "dtype": str(dtype).removeprefix("torch."),
        "heuristic_at_m": PIN_AT_M,
        "heuristic_config": heuristic_config,
        "heuristic_workspace_bytes": int(top.workspace_size),
        "heuristic_waves": float(top.waves_count),
        "heuristic_algo_check": {
            "status": STATUS_NAMES.get(heuristic_check[0], heuristic_check[0]),
            "workspace_bytes": heuristic_check[1],
        },
        "variant": variant[0],
        "pinned_from": "cublasLtMatmulAlgoInit + the heuristic's configuration",
    }
    overrides = variant[1]
    algo = lt.pinned_algo({**heuristic_config, **overrides}, dtype)
    status, _ = lt.check(algo, PIN_AT_M, n, k, dtype)
    if status != 0:  # the rebuilt descriptor is refused: pin the heuristic's own struct
        entry["pinned_from"] = (
            f"the heuristic's descriptor with split-K forced to 1 (AlgoInit rebuild was "
            f"{STATUS_NAMES.get(status, status)})"
        )
        algo = top.algo
        pins = {"splitk_num": 1, "reduction_scheme": 0, **overrides}
        for attr, name_, ctype in ALGO_CONFIG:
            if name_ not in pins:
                continue
            value = ctype(pins[name_])
            lt._call(
                "cublasLtMatmulAlgoConfigSetAttribute",
                ctypes.byref(algo),
                attr,
                ctypes.byref(value),
                ctypes.sizeof(value),
            )
    entry["pinned_config"] = lt.read_config(algo)

    checks = {m: lt.check(algo, m, n, k, dtype) for m in sweep}
    served = [m for m in sweep if checks[m][0] == 0]

    def run_lt(rows: torch.Tensor) -> torch.Tensor:
        return lt.matmul_fn(algo, rows, weight, checks[rows.shape[0]][1])()

    alone_lt = {i: run_lt(x[i : i + 1]).clone() for i in PROBE_ROWS if 1 in served}
    if alone_lt:  # bits that never change are worthless if wrong: Axis-B on the probe rows
        probes = list(alone_lt)
        reference = torch.mm(x[probes].float(), weight.float().t())  # fp32, TF32 off
        try:
            assert_within_tolerance(
                torch.cat([alone_lt[i] for i in probes]),
                reference,
                op_class="reduction",
                name=f"cuBLASLt pinned {name}",
            )
            entry["probe_rows_within_tolerance"] = True
        except AssertionError as error:
            entry["probe_rows_within_tolerance"] = False
            entry["tolerance_failure"] = str(error).splitlines()[0]
    alone_mm = {i: torch.mm(x[i : i + 1], weight.t()) for i in PROBE_ROWS}
    full_lt = run_lt(x).clone() if m_max in served else None
    full_mm = torch.mm(x, weight.t())
    per_m = []
    for m in sweep:
        status, workspace = checks[m]
        row = {
            "M": m,
            "algo_check": STATUS_NAMES.get(status, status),
            "workspace_bytes": workspace,
        }
        mm = torch.mm(x[:m], weight.t())
        row["torch_mm_probe_failures"] = len(_probe_failures(mm, alone_mm, f"torch.mm M={m}"))
        row["torch_mm_rows_differing_from_M_max"] = _mismatching_rows(mm, full_mm[:m])
        if status == 0:
            try:
                out = run_lt(x[:m])
            except CublasLtError as error:  # the check passed but the launch did not
                row["lt_run_error"] = str(error)
                row["lt_bitwise_invariant"] = False
                per_m.append(row)
                continue
            failures = _probe_failures(out, alone_lt, f"cuBLASLt M={m}") if alone_lt else None
            row["lt_probe_failures"] = failures
            row["lt_rows_differing_from_M_max"] = (
                _mismatching_rows(out, full_lt[:m]) if full_lt is not None else None
            )
            # None: M = 1 or M = 8191 is not served, so a reference row is missing.
            row["lt_bitwise_invariant"] = (
                None
                if not alone_lt or full_lt is None
                else not failures and row["lt_rows_differing_from_M_max"] == 0
            )
            if m in timed_m:
                lt_fn = lt.matmul_fn(algo, x[:m].contiguous(), weight, workspace)
                row["lt_ms"] = median_ms(lt_fn, warmup_ms=25, rep_ms=rep_ms)
        else:
            row["lt_bitwise_invariant"] = None  # not served: nothing to compare
        if m in timed_m:
            xm = x[:m].contiguous()
            row["torch_mm_ms"] = median_ms(
                lambda a=xm: torch.mm(a, weight.t()), warmup_ms=25, rep_ms=rep_ms
            )
            try:
                row["batchinv_ms"] = median_ms(
                    lambda a=xm: matmul_nt(a, weight), warmup_ms=25, rep_ms=rep_ms
                )
            except Exception as error:  # batchinv's own failure must not hide cuBLASLt's data
                row["batchinv_error"] = f"{type(error).__name__}: {error}"
        per_m.append(row)
        del mm
    entry["per_m"] = per_m
    entry["served_every_m"] = len(served) == len(sweep)
    entry["served_every_m_without_workspace"] = all(checks[m] == (0, 0) for m in sweep)
    entry["bitwise_at_every_m"] = all(r["lt_bitwise_invariant"] for r in per_m)
    return entry


def _markdown(result: dict) -> str:
    env = result["environment"]
    lines = [
        "# cuBLASLt with one pinned algorithm (issue 4 study)",
        "",
        f"{env['gpu']}, driver {env['driver']}, torch {env['versions']['torch']}, "
        f"cuBLASLt {result['cublaslt_version']}, commit {env['commit']}, {env['date_utc']}.",
        f"Produced by `tools/study_cublaslt.py`. Algorithm pinned from the heuristic's top "
        f"choice at M = {PIN_AT_M} (heuristic allowed no workspace), split-K 1, reduction none. "
        "`AlgoCheck` = `cublasLtMatmulAlgoCheck` for that M, with the workspace it asks for "
        "(`ws`, bytes; the run gets exactly that); `bitwise` = every probe row "
        "alone equals the row in the batch and every row equals the same row at M = 8191. "
        "Times: medians in ms (bf16 only); ratio = torch.mm time / time.",
        "",
        "Adoptable (served and bitwise at every M of every shape), by pinning: "
        + ", ".join(f"{v}: **{ok}**" for v, ok in result["adoptable_by_variant"].items())
        + ("" if result["complete"] else " (incomplete run)"),
        "",
        *(f"- error: {error}" for error in result["errors"]),
        "",
    ]
    for entry in result["shapes"]:
        cfg = entry["pinned_config"]
        lines += [
            f"## {entry['layer']} (N = {entry['N']}, K = {entry['K']}, {entry['dtype']}), "
            f"pinning: {entry['variant']}",
            "",
            f"Pinned: algo {cfg['algo_id']}, tile {cfg['tile_id']}, stages {cfg['stages_id']}, "
            f"swizzle {cfg['cta_swizzling']}, custom {cfg['custom_option']}, inner "
            f"{cfg['inner_shape_id']}, cluster {cfg['cluster_shape_id']}, split-K "
            f"{cfg['splitk_num']} (heuristic had {entry['heuristic_config']['splitk_num']}); "
            f"{entry['pinned_from']}. Probe rows within the `reduction` tolerance of fp32: "
            f"{entry.get('probe_rows_within_tolerance')}. Heuristic's own descriptor at "
            f"M = {PIN_AT_M}: {entry['heuristic_algo_check']}.",
            "",
            "| M | AlgoCheck | cuBLASLt bitwise | torch.mm rows off | cuBLASLt ms | torch.mm ms "
            "| batchinv ms | cuBLASLt ratio | batchinv ratio |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for row in entry["per_m"]:
            lt_ms, mm_ms, bi_ms = (row.get(key) for key in ("lt_ms", "torch_mm_ms", "batchinv_ms"))
            lines.append(
                f"| {row['M']} | {row['algo_check']}"
                + (f" (ws {row['workspace_bytes']})" if row["workspace_bytes"] else "")
                + f" | {_yes_no(row['lt_bitwise_invariant'])}"
                + f" ({_count(row.get('lt_rows_differing_from_M_max'))} rows off,"
                + f" {_count(row.get('lt_probe_failures'))} probes off)"
                + f" | {row['torch_mm_rows_differing_from_M_max']}"
                + f" | {_num(lt_ms)} | {_num(mm_ms)} | {_num(bi_ms)}"
                + f" | {_ratio(mm_ms, lt_ms)} | {_ratio(mm_ms, bi_ms)} |"
            )
        lines.append("")
    return "\n".join(lines)


def _yes_no(value) -> str:
    return "not served" if value is None else ("yes" if value else "**no**")


def _count(value) -> str:
    if value is None:
        return "-"
    return str(len(value)) if isinstance(value, list) else str(value)


def _num(value) -> str:
    return "" if value is None else f"{value:.4f}"


def _ratio(anchor, value) -> str:
    return "" if anchor is None or value is None else f"{anchor / value:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=ROOT / "reports/cublaslt/study.json")
    parser.add_argument("--markdown", type=Path, default=ROOT / "reports/cublaslt/study.md")
    parser.add_argument("--quick", action="store_true", help="two shapes, M up to 257, bf16")
    parser.add_argument("--rep-ms", type=float, default=100.0, help="timing window per point")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this study needs an NVIDIA GPU (torch.cuda.is_available() is False)")
    torch.backends.cuda.matmul.allow_tf32 = False
    lt = CublasLt(_find_cublaslt())
    shapes = QWEN3_8B_LINEAR[:2] if args.quick else QWEN3_8B_LINEAR
    sweep = tuple(m for m in LINEAR_M_SWEEP if m <= 257) if args.quick else LINEAR_M_SWEEP
    dtypes = (torch.bfloat16,) if args.quick else (torch.bfloat16, torch.float16)
    result = {
        "study": "cuBLASLt pinned algorithm, bitwise M sweep",
        "environment": environment(),
        "cublaslt_library": lt.path,
        "cublaslt_version": lt.version,
        "m_sweep": list(sweep),
        "probe_rows": list(PROBE_ROWS),
        "shapes": [],
        "errors": [],
        "complete": False,
    }
    runs = [(v, s, d) for v in VARIANTS for s in shapes for d in dtypes]
    for variant, (name, k, n), dtype in runs:  # the heuristic's pinning first, every shape
        # bf16 is timed: every M for the heuristic's pinning, the benchmark's M for the other.
        timed = (
            () if dtype != torch.bfloat16 else sweep if variant is VARIANTS[0] else LINEAR_BENCH_M
        )
        label = f"{variant[0]}: {name} {dtype}"
        try:
            entry = study_shape(lt, name, k, n, dtype, sweep, variant, timed, args.rep_ms)
        except (CublasLtError, RuntimeError) as error:  # recorded, the study goes on
            print(f"{label}: {type(error).__name__}: {error}", flush=True)
            result["errors"].append(f"{label}: {type(error).__name__}: {error}")
            continue
        result["shapes"].append(entry)
        torch.cuda.empty_cache()  # the lm_head batches are large
        _write(args, result)  # after every shape, so a time limit keeps what ran
        print(
            f"{label}: served every M {entry['served_every_m']}, "
            f"bitwise at every M {entry['bitwise_at_every_m']}, "
            f"pinned {entry['pinned_config']}",
            flush=True,
        )
    result["complete"] = True
    _write(args, result)
    print(_markdown(result))


def _write(args: argparse.Namespace, result: dict) -> None:
    # A pinning is adoptable if it serves and is bitwise at every M of every shape run.
    result["adoptable_by_variant"] = {
        variant: bool(entries)
        and all(e["served_every_m"] and e["bitwise_at_every_m"] for e in entries)
        for variant, _ in VARIANTS
        for entries in [[e for e in result["shapes"] if e["variant"] == variant]]
    }
    result["adoptable"] = any(result["adoptable_by_variant"].values())
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    args.markdown.parent.mkdir(parents=True, exist_ok=True)
    args.markdown.write_text(_markdown(result) + "\n")


if __name__ == "__main__":
    main()

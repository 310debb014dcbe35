"""ctypes bindings to cuBLASLt, just enough for one pinned NT matmul algorithm.

Used by ``linear_cublaslt.py`` (the pinned large-M path of ``batchinv.linear``) and by
``tools/study_cublaslt.py`` (the study that found the pinned algorithm).  The library
is the libcublasLt that PyTorch loads (the nvidia-cublas wheel); nothing is compiled.
"""

from __future__ import annotations

import ctypes
import glob
import os

import torch

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


def find_cublaslt() -> str:
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
    raise RuntimeError("libcublasLt is neither loaded by torch nor in the nvidia wheels")


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

    def matmul(
        self,
        desc,
        layouts,
        algo: Algo,
        x: torch.Tensor,
        weight: torch.Tensor,
        out: torch.Tensor,
        workspace: torch.Tensor | None,
        stream: int,
    ) -> None:
        """``out = x · weightᵀ`` (one ``cublasLtMatmul``) with descriptors from ``descriptors``
        and ``workspace``'s bytes (none if None) on ``stream``."""
        a, b, c = layouts
        alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self._call(
            "cublasLtMatmul",
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
            None if workspace is None else ctypes.c_void_p(workspace.data_ptr()),
            ctypes.c_size_t(0 if workspace is None else workspace.numel()),
            ctypes.c_void_p(stream),
        )

    def matmul_fn(self, algo: Algo, x: torch.Tensor, weight: torch.Tensor, workspace: int = 0):
        """A callable writing ``x · weightᵀ`` with ``algo`` and ``workspace`` bytes of
        workspace; returns the output tensor.  Descriptors are built once (timing reuses them)."""
        m, k = x.shape
        n = weight.shape[0]
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        scratch = torch.empty(workspace, dtype=torch.uint8, device=x.device) if workspace else None
        desc, layouts = self.descriptors(m, n, k, x.dtype)
        stream = torch.cuda.current_stream().cuda_stream

        def run() -> torch.Tensor:
            self.matmul(desc, layouts, algo, x, weight, out, scratch, stream)
            return out

        return run

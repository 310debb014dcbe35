# ruff: noqa
"""Compile Liger-Kernel 0.8.5's bf16 RMSNorm forward kernels offline for sm_90a (no GPU).

Run with PYTHONPATH=/work/tools-triton (triton 3.6.0 + liger_kernel 0.8.5, installed there with
pip --target).  Specialisation as Triton's launcher gives it for contiguous bf16 tensors from the
caching allocator: pointers and multiples-of-16 ints get tt.divisibility 16, ints equal to 1
become constexprs; eps and offset are Python floats (fp32).  Writes <name>.{ptx,cubin,ttgir}.
"""

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from liger_kernel.ops import rms_norm as liger

OUT = sys.argv[1] if len(sys.argv) > 1 else "."
target = GPUTarget("cuda", 90, 32)
backend = triton.compiler.make_backend(target)


def build(fn, name, types, constants, num_warps):
    signature = {}
    attrs = {}
    for i, arg in enumerate(fn.arg_names):
        if arg in constants:
            signature[arg] = "constexpr"
        else:
            ty = types[arg]
            signature[arg] = ty
            if ty.startswith("*") or ty == "i32":
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    opts = backend.parse_options({"num_warps": num_warps, "num_stages": 3})
    k = triton.compile(src, target=target, options=opts.__dict__)
    for ext in ("ptx", "cubin", "ttgir", "llir"):
        mode = "wb" if ext == "cubin" else "w"
        with open(f"{OUT}/{name}.{ext}", mode) as f:
            f.write(k.asm[ext])
    print(
        name,
        "registers?",
        getattr(k.metadata, "num_regs", "n/a"),
        "shared",
        k.metadata.shared,
        "name",
        k.metadata.name,
    )


common = {
    "Y_ptr": "*bf16",
    "Y_row_stride": "i32",
    "X_ptr": "*bf16",
    "X_row_stride": "i32",
    "W_ptr": "*bf16",
    "RSTD_ptr": "*fp32",
    "n_cols": "i32",
    "n_rows": "i32",
    "eps": "fp32",
    "offset": "fp32",
}
# hidden 4096: one row per program, BLOCK_SIZE 4096, 8 warps (calculate_settings(4096)).
build(
    liger._rms_norm_forward_kernel,
    "liger_fwd_4096",
    common,
    {
        "W_row_stride": 1,
        "RSTD_row_stride": 1,
        "casting_mode": 0,
        "elementwise_affine": True,
        "BLOCK_SIZE": 4096,
    },
    8,
)
# q/k norm d = 128 with >= 32768 rows: the block kernel, 16 rows per program, 4 warps.
build(
    liger._block_rms_norm_forward_kernel,
    "liger_block_fwd_128",
    common,
    {
        "W_row_stride": 1,
        "RSTD_row_stride": 1,
        "casting_mode": 0,
        "elementwise_affine": True,
        "BLOCK_SIZE": 128,
        "BLOCK_ROW": 16,
    },
    4,
)

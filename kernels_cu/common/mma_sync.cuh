// ldmatrix fragment loads and the mma.sync m16n8k16 with fp32 accumulators (sm_80+): one
// definition each, so that every mma.sync kernel issues the same instructions.  CUDA only (HIP
// builds compile none of their callers).
#pragma once

#include "cp_async.cuh"
#include "portability.cuh"

#if !defined(__HIPCC__)
namespace batchinv {

// ---- ldmatrix: four (or two) 8x8 b16 matrices from shared memory, one row address per lane
// (lanes 8i .. 8i + 7 address matrix i); .trans delivers each matrix transposed.

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) { ldmatrix_x4(r, smem_address(row)); }

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
    ldmatrix_x4_trans(r, smem_address(row));
}

__device__ __forceinline__ void ldmatrix_x2(uint32_t& r0, uint32_t& r1, uint32_t address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];" : "=r"(r0), "=r"(r1) : "r"(address));
}

// ---- mma.sync m16n8k16, d += a * b with fp32 accumulators, bf16 or fp16 operands (Codec).
// Fragments (g = lane / 4, c = 2 * (lane % 4)):
//   A 16x16 row-major: a0 (g, c..c+1), a1 (g+8, c..), a2 (g, c+8..), a3 (g+8, c+8..)
//   B 16x8 (k x n):    b0 (k = c..c+1, n = g), b1 (k = c+8..c+9, n = g)
//   C 16x8:            c0, c1 (g, c..c+1), c2, c3 (g+8, c..c+1)
template <typename Codec>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    if constexpr (Codec::kIsBf16) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
            "{%8, %9}, {%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
            "{%8, %9}, {%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

}  // namespace batchinv
#endif

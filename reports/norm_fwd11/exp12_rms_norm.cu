// Issue 6, session 11, second round (helper norm-fwd12, branch norm-fwd11): forward variants for
// the A/B of its device call, built against the call's kernels_cu/rms_norm.cu (the branch's file
// of 53f941e with round2_as_run.patch applied; included, so the op's entries are in the same
// image; the patch was not kept):
//   nvcc -cubin -O3 -std=c++17 -arch=sm_90a -I kernels_cu reports/norm_fwd11/exp12_rms_norm.cu
// Every x12_* entry has the forward entries' signature and runs forward_rows_vector only (vector
// launches).  Knobs: G row groups per CTA, R rows per group (one weight load for R rows), B
// barriers of the row reduction (2: row_group_sum's; 1: the first only; N: the group's named
// barrier, one), M the __launch_bounds__ minimum of CTAs per SM.
#include "../../kernels_cu/rms_norm.cu"

namespace exp12 {
using namespace batchinv;
using namespace batchinv::rms;

template <typename Codec, int T, int K, bool kFused, int G, int R, int kBarriers, bool kNamed>
__device__ __forceinline__ void vec(const ForwardArgs& a) {
    __shared__ float warp_partials[kMaxWarps * R];
    forward_rows_vector<Codec, T, K, kFused, G, R, kBarriers, kNamed>(a, warp_partials);
}
}  // namespace exp12

#define X12_ARGS                                                                      \
    bf16_bits *y, bf16_bits *new_residual, float *rstd, const bf16_bits *x,           \
        const bf16_bits *residual, const bf16_bits *weight, int64_t rows, int64_t d,  \
        int64_t x_stride, int64_t residual_stride, float eps
#define X12(NAME, T, K, FUSED, G, R, B, NAMED, MINB)                                   \
    extern "C" __global__ void __launch_bounds__(T * G, MINB) NAME(X12_ARGS) {        \
        const batchinv::rms::ForwardArgs args{y,        new_residual, rstd, x,        \
                                              residual, weight,       rows, d,        \
                                              x_stride, residual_stride, eps};        \
        exp12::vec<batchinv::Bf16Codec, T, K, FUSED, G, R, B, NAMED>(args);           \
    }

using batchinv::bf16_bits;

// hidden 4096, t64 (64 threads x 8 chunks)
X12(x12_t64_g2_r1_b2_m5, 64, 8, false, 2, 1, 2, false, 5)  // the op's entry of this tree
X12(x12_t64_g2_r1_b1_m5, 64, 8, false, 2, 1, 1, false, 5)
X12(x12_t64_g2_r1_b1_m6, 64, 8, false, 2, 1, 1, false, 6)
X12(x12_t64_g2_r1_n_m5, 64, 8, false, 2, 1, 1, true, 5)
X12(x12_t64_g1_r1_b1_m10, 64, 8, false, 1, 1, 1, false, 10)
X12(x12_t64_g2_r2_b1_m4, 64, 8, false, 2, 2, 1, false, 4)
X12(x12_t64_g2_r2_b1_m3, 64, 8, false, 2, 2, 1, false, 3)
// q/k d = 128, t4 (4 threads x 4 chunks, 32 groups per CTA)
X12(x12_t4_g32_r1_m9, 4, 4, false, 32, 1, 2, false, 9)
X12(x12_t4_g32_r2_m7, 4, 4, false, 32, 2, 2, false, 7)
X12(x12_t4_g32_r2_m6, 4, 4, false, 32, 2, 2, false, 6)
X12(x12_t4_g32_r4_m4, 4, 4, false, 32, 4, 2, false, 4)
X12(x12_t4_g32_r4_m1, 4, 4, false, 32, 4, 2, false, 1)
X12(x12_t4_g16_r2_m14, 4, 4, false, 16, 2, 2, false, 14)
// hidden 5120, t128k5 (one row per CTA)
X12(x12_t128k5_g1_r1_b1_m8, 128, 5, false, 1, 1, 1, false, 8)
// fused add forward
X12(x12_fused_t64_g2_r1_b2_m4, 64, 8, true, 2, 1, 2, false, 4)  // the op's entry of this tree
X12(x12_fused_t64_g2_r1_b1_m4, 64, 8, true, 2, 1, 1, false, 4)
X12(x12_fused_t128k5_g1_r1_b2_m6, 128, 5, true, 1, 1, 2, false, 6)  // the op's entry
X12(x12_fused_t128k5_g1_r1_b1_m6, 128, 5, true, 1, 1, 1, false, 6)

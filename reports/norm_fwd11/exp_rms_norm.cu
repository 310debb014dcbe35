// Issue 6, session 11 (helper norm-fwd11): forward variants for the A/B of the first device call,
// built against the branch's kernels_cu/rms_norm.cu (which this file includes, so its own
// entries are in the same image):
//   nvcc -cubin -O3 -std=c++17 -arch=sm_90a -I kernels_cu reports/norm_fwd11/exp_rms_norm.cu
// Every exp_* entry has the forward entries' signature.  "vec" entries run forward_rows_vector
// only (the script launches them on 16-byte aligned tensors); "both" entries also compile
// forward_rows_resident for element launches into the kernel, as an op entry would.
#include "../../kernels_cu/rms_norm.cu"

namespace exp11 {
using namespace batchinv;
using namespace batchinv::rms;

template <typename Codec, int T, int K, bool kFused, int kHints, int G>
__device__ __forceinline__ void vec_only(const ForwardArgs& a) {
    __shared__ float warp_partials[kMaxWarps];
    forward_rows_vector<Codec, T, K, kFused, kHints, G>(a, warp_partials);
}

// The vector path and, for element launches, forward_rows_resident: what an op entry would be.
template <typename Codec, int T, int K, bool kFused, int kHints>
__device__ __forceinline__ void both(const ForwardArgs& a) {
    __shared__ float warp_partials[kMaxWarps];
    if (forward_vector_launch<typename Codec::storage>(a)) {
        forward_rows_vector<Codec, T, K, kFused, kHints>(a, warp_partials);
    } else {
        forward_rows_resident<Codec, T, K, kFused>(a, warp_partials);
    }
}
// The vector path and, for element launches, forward_rows (the weight after the reduction:
// fewer registers than forward_rows_resident).
template <typename Codec, int T, int K, bool kFused, int kHints>
__device__ __forceinline__ void both_light(const ForwardArgs& a) {
    __shared__ float warp_partials[kMaxWarps];
    if (forward_vector_launch<typename Codec::storage>(a)) {
        forward_rows_vector<Codec, T, K, kFused, kHints>(a, warp_partials);
    } else {
        forward_rows<Codec, T, K, false, kFused>(a, warp_partials);
    }
}
}  // namespace exp11

#define EXP_ARGS                                                                             \
    bf16_bits *y, bf16_bits *new_residual, float *rstd, const bf16_bits *x,                  \
        const bf16_bits *residual, const bf16_bits *weight, int64_t rows, int64_t d,         \
        int64_t x_stride, int64_t residual_stride, float eps
#define EXP_PACK                                                                              \
    const batchinv::rms::ForwardArgs args{y,    new_residual, rstd,     x,               \
                                          residual, weight,   rows,     d,               \
                                          x_stride, residual_stride, eps}

#define EXP_VEC(NAME, T, K, FUSED, HINTS, G, MINB)                                            \
    extern "C" __global__ void __launch_bounds__(T * G, MINB) NAME(EXP_ARGS) {                \
        EXP_PACK;                                                                             \
        exp11::vec_only<batchinv::Bf16Codec, T, K, FUSED, HINTS, G>(args);                    \
    }
#define EXP_BOTH(NAME, T, K, FUSED, HINTS, MINB)                                              \
    extern "C" __global__ void __launch_bounds__(batchinv::rms::Cta<T>::kThreads, MINB)       \
        NAME(EXP_ARGS) {                                                                      \
        EXP_PACK;                                                                             \
        exp11::both<batchinv::Bf16Codec, T, K, FUSED, HINTS>(args);                           \
    }

#define EXP_BOTH_LIGHT(NAME, T, K, FUSED, HINTS, MINB)                                        \
    extern "C" __global__ void __launch_bounds__(batchinv::rms::Cta<T>::kThreads, MINB)       \
        NAME(EXP_ARGS) {                                                                      \
        EXP_PACK;                                                                             \
        exp11::both_light<batchinv::Bf16Codec, T, K, FUSED, HINTS>(args);                     \
    }

using batchinv::bf16_bits;

// hidden 4096 (t64: 64 threads x 8 chunks, 2 rows per 128-thread CTA); hint bits: 1 x no L1
// allocate, 2 x L2 evict_first, 4 y st.cs, 8 weight evict_last, 16 loads in program order.
// Last number: __launch_bounds__ minimum CTAs per SM.
EXP_VEC(exp_t64_vec_h0, 64, 8, false, 0, 2, 1)
EXP_VEC(exp_t64_vec_h0_m5, 64, 8, false, 0, 2, 5)
EXP_VEC(exp_t64_vec_h0_m6, 64, 8, false, 0, 2, 6)
EXP_VEC(exp_t64_vec_h0_m7, 64, 8, false, 0, 2, 7)
EXP_VEC(exp_t64_vec_h1_m6, 64, 8, false, 1, 2, 6)
EXP_VEC(exp_t64_vec_h2_m6, 64, 8, false, 2, 2, 6)
EXP_VEC(exp_t64_vec_h4_m6, 64, 8, false, 4, 2, 6)
EXP_VEC(exp_t64_vec_h8_m6, 64, 8, false, 8, 2, 6)
EXP_VEC(exp_t64_vec_h15_m6, 64, 8, false, 15, 2, 6)
EXP_VEC(exp_t64_vec_h16_m6, 64, 8, false, 16, 2, 6)
EXP_VEC(exp_t64_vec_h16_m5, 64, 8, false, 16, 2, 5)
EXP_BOTH(exp_t64_both_h0_m6, 64, 8, false, 0, 6)
EXP_BOTH(exp_t64_both_h0_m5, 64, 8, false, 0, 5)
EXP_BOTH_LIGHT(exp_t64_bothlight_h0_m6, 64, 8, false, 0, 6)
EXP_BOTH_LIGHT(exp_t64_bothlight_h0_m5, 64, 8, false, 0, 5)
// Other trees at hidden 4096 (bits differ from t64's): Liger's shape (256 x 2, one row per
// CTA), 128 x 4 with one and with two rows per CTA.
EXP_VEC(exp_t256k2_vec_h0, 256, 2, false, 0, 1, 1)
EXP_VEC(exp_t256k2_vec_h0_m8, 256, 2, false, 0, 1, 8)
EXP_VEC(exp_t128k4_vec_h0, 128, 4, false, 0, 1, 1)
EXP_VEC(exp_t128k4_vec_h0_m8, 128, 4, false, 0, 1, 8)
EXP_VEC(exp_t128k4g2_vec_h0_m4, 128, 4, false, 0, 2, 4)
// q/k norm d = 128 (t4: 4 threads x 4 chunks, 32 rows per CTA)
EXP_VEC(exp_t4_vec_h0, 4, 4, false, 0, 32, 1)
EXP_VEC(exp_t4_vec_h0_m9, 4, 4, false, 0, 32, 9)
EXP_VEC(exp_t4_vec_h0_m10, 4, 4, false, 0, 32, 10)
EXP_VEC(exp_t4_vec_h1_m9, 4, 4, false, 1, 32, 9)
EXP_VEC(exp_t4_vec_h4_m9, 4, 4, false, 4, 32, 9)
EXP_VEC(exp_t4_vec_h16_m9, 4, 4, false, 16, 32, 9)
EXP_BOTH(exp_t4_both_h0_m9, 4, 4, false, 0, 9)
EXP_BOTH(exp_t4_both_h0_m1, 4, 4, false, 0, 1)
// hidden 5120 (t128k5, one row per CTA)
EXP_VEC(exp_t128k5_vec_h0, 128, 5, false, 0, 1, 1)
EXP_VEC(exp_t128k5_vec_h0_m8, 128, 5, false, 0, 1, 8)
EXP_VEC(exp_t128k5_vec_h16_m8, 128, 5, false, 16, 1, 8)
EXP_BOTH(exp_t128k5_both_h0_m8, 128, 5, false, 0, 8)
EXP_BOTH(exp_t128k5_both_h0_m1, 128, 5, false, 0, 1)
// fused add forward (same trees)
EXP_VEC(exp_fused_t64_vec_h0_m4, 64, 8, true, 0, 2, 4)
EXP_BOTH(exp_fused_t64_both_h0_m4, 64, 8, true, 0, 4)
EXP_VEC(exp_fused_t4_vec_h0_m8, 4, 4, true, 0, 32, 8)
EXP_VEC(exp_fused_t128k5_vec_h0_m6, 128, 5, true, 0, 1, 6)

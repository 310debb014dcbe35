// The rotary position embedding's per-token arithmetic (Qwen3 / Hugging Face rotate-half), shared
// by rope.cu and qk_norm_rope.cu so that a head rotated inside the fused kernel has rope's bits
// by construction.
//
// For position p, half = head_dim / 2 and j in [0, half):
//   angle = __fmul_rn(float(p), inv_freq[j]);  c, s = sincosf(angle)  (the accurate one)
//   out[j]        = x[j] * c - x[j + half] * s
//   out[j + half] = x[j + half] * c + x[j] * s
// each product and sum one IEEE operation; the caller rounds once to the storage type.
#pragma once

#include "portability.cuh"

namespace batchinv {
namespace rope {

__device__ __forceinline__ float rotate_first(float x1, float x2, float c, float s) {
    return ieee_sub(ieee_mul(x1, c), ieee_mul(x2, s));
}

__device__ __forceinline__ float rotate_second(float x1, float x2, float c, float s) {
    return ieee_add(ieee_mul(x2, c), ieee_mul(x1, s));
}

// cos_table[j] = cos(angle_j), sin_table[j] = sin(angle_j) (negated when `inverse` is nonzero:
// the transpose of the rotation) for j in [0, half), the CTA's kThreads threads striding over j.
// The caller synchronises before reading the tables.
template <int kThreads>
__device__ __forceinline__ void fill_rotation_table(float* cos_table, float* sin_table,
                                                    int64_t position, const float* inv_freq,
                                                    int64_t half, int32_t inverse) {
    const float p = static_cast<float>(position);
    for (int64_t j = threadIdx.x; j < half; j += kThreads) {
        float s, c;
        sincosf(ieee_mul(p, inv_freq[j]), &s, &c);
        cos_table[j] = c;
        sin_table[j] = inverse ? -s : s;
    }
}

}  // namespace rope
}  // namespace batchinv

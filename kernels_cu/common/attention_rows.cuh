// The per-row arithmetic every attention forward kernel shares: attention.cu's mma.sync tile,
// split and combine kernels and attention_hopper.cu's wgmma tile kernel include this one
// definition (block and split sizes, the scaled block max, P's exponent, exp2 and rounding, the
// split merge, finalize), so their bits cannot drift apart.  The contract they implement:
// attention.cu's header.  attention_portable.cu (CUDA and HIP) includes it too; everything
// but pack_pair (the mma fragments' packing, CUDA only) is portable.
#pragma once

#if !defined(__HIPCC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

#include "approx.cuh"
#include "portability.cuh"

namespace batchinv {
namespace attn {

constexpr int kBlockKeys = 128;
constexpr int kSplitKeys = 2048;
constexpr int kBlocksPerSplit = kSplitKeys / kBlockKeys;
constexpr float kLn2 = 0.693147180559945309f;
constexpr float kNegInf = -__builtin_huge_valf();

// ---- merge and finalize (split mode's combine uses the same functions) ---------------------

// pick: 0 = weighted combination, 1 = keep a (b empty), 2 = take b (a empty).
__device__ __forceinline__ void merge_weights(float ma, float la, float mb, float lb, float& m, float& l,
                                              float& wa, float& wb, int& pick) {
    if (mb == kNegInf) {
        pick = 1;
        m = ma;
        l = la;
        wa = 1.0f;
        wb = 0.0f;
    } else if (ma == kNegInf) {
        pick = 2;
        m = mb;
        l = lb;
        wa = 0.0f;
        wb = 1.0f;
    } else {
        pick = 0;
        m = mb > ma ? mb : ma;
        wa = exp2f(__fsub_rn(ma, m));
        wb = exp2f(__fsub_rn(mb, m));
        l = __fadd_rn(__fmul_rn(la, wa), __fmul_rn(lb, wb));
    }
}

__device__ __forceinline__ float merge_value(float a, float b, float wa, float wb, int pick) {
    if (pick == 1) return a;
    if (pick == 2) return b;
    return __fadd_rn(__fmul_rn(a, wa), __fmul_rn(b, wb));
}

__device__ __forceinline__ float finalize_out(float acc, float l) { return l > 0.0f ? __fdiv_rn(acc, l) : 0.0f; }

__device__ __forceinline__ float finalize_lse(float m, float l) {
    return l > 0.0f ? __fmul_rn(__fadd_rn(m, log2f(l)), kLn2) : kNegInf;
}

// The block max of a row's RAW scores (invisible keys -inf) in the log2 domain: scaled once, a
// zero normalised to +0.  Rounding is monotone and c = scale_log2 > 0 (the host refuses a
// softmax_scale <= 0), so this is the max of the scaled scores, whatever the scan order.
__device__ __forceinline__ float scaled_block_max(float mx_raw, float scale_log2) {
    const float mx = __fmul_rn(mx_raw, scale_log2);
    return mx == 0.0f ? 0.0f : mx;
}

// P of a raw score s: exp2_ftz (common/approx.cuh: a result below 2^-126 is +0, equal to exp2f
// elsewhere) of s * c - m_new rounded ONCE (one FFMA, the contract's only fused step).  Used for
// every P element in every mode.  s = -inf (an invisible key) gives +0 where m_new is finite.
__device__ __forceinline__ float p_of_score(float s, float scale_log2, float m_new) {
    return exp2_ftz(__fmaf_rn(s, scale_log2, -m_new));
}

#if !defined(__HIPCC__)
// Two fp32 probabilities rounded to nearest-even into the input dtype, packed for the mma.
template <typename Codec>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
    if constexpr (Codec::kIsBf16) {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&v);
    } else {
        __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&v);
    }
}
#endif

}  // namespace attn
}  // namespace batchinv

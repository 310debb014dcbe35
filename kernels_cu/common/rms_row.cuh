// One row of RMSNorm reduced by a group of T threads: the per-row arithmetic that rms_norm.cu's
// forward and qk_norm_rope.cu share, so that a q/k head normed inside the fused kernel has the
// bits of rms_norm's output by construction.
//
// A row of d elements is cut into 16-byte chunks (Chunk16); chunk c belongs to thread c % T of
// the row's group, which adds the squares of its elements in increasing element order
// (add_row_squares, over its chunks in increasing c).  row_group_sum combines the T partials
// by a butterfly (and, for T above the warp size, the per-warp results in warp order);
// inv_rms_of turns the sum into 1 / sqrt(sum / d + eps) and normed_chunk gives
// y = (h * inv_rms) * weight, rounded once.  Every step is one IEEE operation, fixed by d and T.
#pragma once

#include "chunk16.cuh"
#include "portability.cuh"

namespace batchinv {
namespace rms {

// A row chunk is common/chunk16.cuh's 16-byte vector (its round_chunk rounds one).
template <typename Codec>
using Chunk = Chunk16<Codec>;

template <typename Codec>
__device__ __forceinline__ void load_chunk(Chunk<Codec>& out, const typename Codec::storage* row,
                                           int64_t chunk, int64_t d, bool vector) {
    constexpr int E = Chunk<Codec>::kElems;
    const int64_t first = chunk * E;
    if (vector) {
        *reinterpret_cast<uint4*>(out.v) = *reinterpret_cast<const uint4*>(row + first);
    } else {
#pragma unroll
        for (int e = 0; e < E; ++e) out.v[e] = first + e < d ? row[first + e] : Codec::store(0.0f);
    }
}

template <typename Codec>
__device__ __forceinline__ void store_chunk(typename Codec::storage* row, const Chunk<Codec>& in,
                                            int64_t chunk, int64_t d, bool vector) {
    constexpr int E = Chunk<Codec>::kElems;
    const int64_t first = chunk * E;
    if (vector) {
        *reinterpret_cast<uint4*>(row + first) = *reinterpret_cast<const uint4*>(in.v);
    } else {
#pragma unroll
        for (int e = 0; e < E; ++e) {
            if (first + e < d) row[first + e] = in.v[e];
        }
    }
}

// The barrier of row_group_sum: the CTA's, or (kGroupBarrier, CUDA only) named barrier
// 1 + group over the T threads of row group `group` alone, so that the row groups of a CTA do
// not wait for each other (the t128k4g2 and t128k5g2 fused backward).
template <int T, bool kGroupBarrier>
__device__ __forceinline__ void row_group_barrier(int group) {
#if !defined(__HIPCC__)
    if constexpr (kGroupBarrier) {
        asm volatile("bar.sync %0, %1;\n" ::"r"(1 + group), "n"(T) : "memory");
        return;
    }
#endif
    __syncthreads();
}

// Sum of one value per thread over the T threads of a row group (see the header).  Every
// thread of the CTA (kGroupBarrier: of the group) must call it; all threads of a group get the
// same bits.  kReuse = false: the caller never passes the same warp_partials to the next call
// (it alternates two), so the barrier that lets a later call overwrite them is not needed: the
// next call's barrier on the other buffer orders this call's reads before the call after it
// writes here again.  Which barrier is used does not change the additions.
template <int T, bool kReuse = true, bool kGroupBarrier = false>
__device__ __forceinline__ float row_group_sum(float value, float* warp_partials, int group = 0) {
    constexpr int W = BATCHINV_WARP_SIZE;
    constexpr int kLanes = T < W ? T : W;
#pragma unroll
    for (int offset = kLanes / 2; offset > 0; offset >>= 1) {
        value = ieee_add(value, BATCHINV_SHFL_XOR(value, offset));
    }
    if constexpr (T > W) {
        constexpr int kWarpsPerRow = T / W;
        const int warp = threadIdx.x / W;
        const int first_warp = warp - warp % kWarpsPerRow;
        if (threadIdx.x % W == 0) warp_partials[warp] = value;
        row_group_barrier<T, kGroupBarrier>(group);
        value = warp_partials[first_warp];
#pragma unroll
        for (int w = 1; w < kWarpsPerRow; ++w) value = ieee_add(value, warp_partials[first_warp + w]);
        if constexpr (kReuse) {
            row_group_barrier<T, kGroupBarrier>(group);  // a later reduction may reuse them
        }
    }
    return value;
}

__device__ __forceinline__ float inv_rms_of(float sum_sq, int64_t d, float eps) {
    const float mean_sq = __fdiv_rn(sum_sq, static_cast<float>(d));
    return __fdiv_rn(1.0f, __fsqrt_rn(ieee_add(mean_sq, eps)));
}

// sum_sq plus the squares of chunk c's elements inside the row (c * E + e < d), each square and
// each sum rounded, in increasing e.
template <typename Codec>
__device__ __forceinline__ float add_row_squares(float sum_sq, const Chunk<Codec>& h, int64_t c,
                                                 int64_t d) {
    constexpr int E = Chunk<Codec>::kElems;
#pragma unroll
    for (int e = 0; e < E; ++e) {
        if (c * E + e >= d) continue;
        const float v = Codec::load(h.v[e]);
        sum_sq = ieee_add(sum_sq, ieee_mul(v, v));
    }
    return sum_sq;
}

// The output chunk: (h * inv_rms) * weight per element, rounded once to the storage type.
template <typename Codec>
__device__ __forceinline__ void normed_chunk(Chunk<Codec>& out, const Chunk<Codec>& h,
                                             const Chunk<Codec>& w, float inv_rms) {
    constexpr int E = Chunk<Codec>::kElems;
    float f[E];
#pragma unroll
    for (int e = 0; e < E; ++e) {
        f[e] = ieee_mul(ieee_mul(Codec::load(h.v[e]), inv_rms), Codec::load(w.v[e]));
    }
    round_chunk(out, f);
}

}  // namespace rms
}  // namespace batchinv

// 16-byte chunks of bf16/fp16/fp32 for the memory-bound kernels (silu_mul, rope, rms_norm): one
// vector load or store moves a chunk; elements are converted to fp32 and back one at a time.
//
// store_chunk rounds each fp32 value once to the storage type with the same bits as the codec's
// store(): for bf16 the CUDA path uses the hardware's paired round-to-nearest-even conversion
// (cvt.rn.bf16x2.f32, one instruction per two elements instead of the integer rounding
// sequence of float_to_bf16) and maps NaN to PyTorch's canonical 0x7fc0 as float_to_bf16 does.
// Round-to-nearest-even on the bit pattern (float_to_bf16) and IEEE RNE (cvt.rn, no flush of
// subnormals) agree on every non-NaN input, overflow to infinity and signed zeros included.
#pragma once

#include "portability.cuh"

namespace batchinv {

template <typename Codec>
struct alignas(16) Chunk16 {
    static constexpr int kElems = 16 / static_cast<int>(sizeof(typename Codec::storage));
    typename Codec::storage v[kElems];
};

template <typename Codec>
__device__ __forceinline__ void load_chunk(Chunk16<Codec>& c, const typename Codec::storage* p) {
    *reinterpret_cast<uint4*>(c.v) = *reinterpret_cast<const uint4*>(p);
}

#if !defined(__HIPCC__)
// Two fp32 values -> two bf16 in one word (lo in the low half), NaN -> 0x7fc0.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    if (lo != lo) r = (r & 0xffff0000u) | 0x7fc0u;
    if (hi != hi) r = (r & 0x0000ffffu) | 0x7fc00000u;
    return r;
}
#endif

// Rounds f[0 .. kElems) once each to the storage type into c (the bits of Codec::store).
template <typename Codec>
__device__ __forceinline__ void round_chunk(Chunk16<Codec>& c, const float* f) {
    constexpr int E = Chunk16<Codec>::kElems;
#if !defined(__HIPCC__)
    constexpr bool kHardwareBf16 = Codec::kIsBf16;
#else
    constexpr bool kHardwareBf16 = false;
#endif
    if constexpr (kHardwareBf16) {
#if !defined(__HIPCC__)
        uint32_t* words = reinterpret_cast<uint32_t*>(c.v);
#pragma unroll
        for (int w = 0; w < E / 2; ++w) words[w] = pack_bf16x2(f[2 * w], f[2 * w + 1]);
#endif
    } else {
#pragma unroll
        for (int e = 0; e < E; ++e) c.v[e] = Codec::store(f[e]);
    }
}

// Rounds f[0 .. kElems) once each to the storage type and stores them as one 16-byte vector.
template <typename Codec>
__device__ __forceinline__ void store_chunk(typename Codec::storage* p, const float* f) {
    Chunk16<Codec> c;
    round_chunk(c, f);
    *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(c.v);
}

}  // namespace batchinv

// 16-byte chunks of bf16/fp16/fp32 for the memory-bound kernels (silu_mul, rope, rms_norm,
// log_softmax's alignment tests): one vector load or store moves a chunk; elements are converted
// to fp32 and back one at a time.
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

// Whether a pointer, or a row stride of `elements` elements of type S, allows 16-byte vector
// accesses (the kernels' vector paths test every pointer and stride of a launch).
__device__ __forceinline__ bool aligned16(const void* p) {
    return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

template <typename S>
__device__ __forceinline__ bool stride_aligned16(int64_t elements) {
    return ((elements * static_cast<int64_t>(sizeof(S))) & 15) == 0;
}

template <typename Codec>
__device__ __forceinline__ void load_chunk(Chunk16<Codec>& c, const typename Codec::storage* p) {
    *reinterpret_cast<uint4*>(c.v) = *reinterpret_cast<const uint4*>(p);
}

#if !defined(__HIPCC__)
// cvt.rn.bf16x2.f32: two fp32 values -> two bf16 in one word (lo in the low half), rounded to
// nearest even; a NaN becomes a bf16 NaN that is not necessarily 0x7fc0.
__device__ __forceinline__ uint32_t cvt_bf16x2(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Two fp32 values -> two bf16 in one word (lo in the low half), NaN -> 0x7fc0.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
    uint32_t r = cvt_bf16x2(lo, hi);
    if (lo != lo) r = (r & 0xffff0000u) | 0x7fc0u;
    if (hi != hi) r = (r & 0x0000ffffu) | 0x7fc00000u;
    return r;
}

// f[0 .. E) packed pairwise by cvt_bf16x2 into words[0 .. E / 2) when none is NaN (one test per
// chunk, where pack_bf16x2 tests every pair); false, and nothing written, when one is.
template <int E>
__device__ __forceinline__ bool cvt_bf16_chunk_without_nan(uint32_t* words, const float* f) {
    bool nan = false;
#pragma unroll
    for (int e = 0; e < E; ++e) nan |= f[e] != f[e];
    if (nan) return false;
#pragma unroll
    for (int w = 0; w < E / 2; ++w) words[w] = cvt_bf16x2(f[2 * w], f[2 * w + 1]);
    return true;
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

// round_chunk with the NaN test moved off the common path (the same bits): bf16 on CUDA packs
// every pair with cvt.rn.bf16x2.f32 first, tests the packed words for a NaN half with two
// integer operations per word ((h & 0x7fff) + 0x7f carries into bit 15 only for h & 0x7fff >
// 0x7f80, a bf16 NaN; cvt gives a NaN half exactly for a NaN input) and only then maps NaN
// halves to 0x7fc0, where round_chunk tests both floats of every pair.  rms_norm.cu's
// round_grad_chunk (the backward) gets the same bits by testing the floats before packing; each
// form is kept where it was timed, a single helper was not measured.
template <typename Codec>
__device__ __forceinline__ void round_chunk_rare_nan(Chunk16<Codec>& c, const float* f) {
#if !defined(__HIPCC__)
    if constexpr (Codec::kIsBf16) {
        constexpr int kWords = Chunk16<Codec>::kElems / 2;
        uint32_t* words = reinterpret_cast<uint32_t*>(c.v);
        uint32_t nan_halves = 0;
#pragma unroll
        for (int w = 0; w < kWords; ++w) {
            const uint32_t r = cvt_bf16x2(f[2 * w], f[2 * w + 1]);
            words[w] = r;
            nan_halves |= ((r & 0x7fff7fffu) + 0x007f007fu) & 0x80008000u;
        }
        if (nan_halves != 0) {
#pragma unroll
            for (int w = 0; w < kWords; ++w) {
                const uint32_t r = words[w];
                const uint32_t lo = (r & 0x7fffu) > 0x7f80u ? 0x7fc0u : (r & 0xffffu);
                const uint32_t hi = (r & 0x7fff0000u) > 0x7f800000u ? 0x7fc00000u : (r & 0xffff0000u);
                words[w] = hi | lo;
            }
        }
        return;
    }
#endif
    round_chunk(c, f);
}

// Rounds f[0 .. kElems) once each to the storage type and stores them as one 16-byte vector.
template <typename Codec>
__device__ __forceinline__ void store_chunk(typename Codec::storage* p, const float* f) {
    Chunk16<Codec> c;
    round_chunk(c, f);
    *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(c.v);
}

}  // namespace batchinv

// The one place where CUDA and HIP differ for batchinv kernels.
//
// Kernels include only this header.  It gives them fixed-width integers, the half type,
// bit-exact bf16 <-> fp32 conversions and warp primitives under one set of names, so a
// kernel source compiles unchanged with nvcc and hipcc.  bf16 is handled as raw 16-bit
// storage with our own conversions because the bf16 headers differ between CUDA and the
// ROCm releases we build with; the conversions round to nearest even and produce the same
// canonical NaN (0x7fc0) as PyTorch, so a kernel's bf16 output matches torch's `.to(bf16)`.
#pragma once

#if defined(__HIPCC__)
// hipcc fuses a * b + c into an FMA by default, and its __fadd_rn / __fmul_rn are plain + and *
// (they would fuse too, differently at different call sites).  Contraction is off in every
// kernel file, and ieee_add/sub/mul below are plain IEEE operations there; CUDA never fuses
// its _rn intrinsics.
#pragma clang fp contract(off)
#include <hip/hip_fp16.h>
#include <hip/hip_runtime.h>
#define BATCHINV_WARP_SIZE 64
#define BATCHINV_SHFL_XOR(value, mask) __shfl_xor((value), (mask))
// The HIP reductions are written for CDNA's 64-lane wavefronts (gfx90a, gfx942, docs/amd.md).
// RDNA targets compile for 32 lanes by default, where a 64-lane butterfly would read lanes that
// do not exist: refuse to build for them rather than compute wrong sums.
#if defined(__HIP_DEVICE_COMPILE__) && defined(__AMDGCN_WAVEFRONT_SIZE__) && \
    __AMDGCN_WAVEFRONT_SIZE__ != BATCHINV_WARP_SIZE
#error "batchinv's HIP kernels need 64-lane wavefronts (CDNA targets such as gfx90a and gfx942)"
#endif
#else
#include <cuda_fp16.h>
#include <stdint.h>
#define BATCHINV_WARP_SIZE 32
#define BATCHINV_SHFL_XOR(value, mask) __shfl_xor_sync(0xffffffffu, (value), (mask))
#endif

namespace batchinv {

using bf16_bits = uint16_t;

// A TMA descriptor (CUtensorMap) as a by-value kernel parameter; the launcher passes the
// 128 bytes made by batchinv._native.tensor_map_2d.  Only CUDA kernels use it.
struct alignas(64) TensorMap {
    unsigned long long opaque[16];
};

__device__ __forceinline__ float bf16_to_float(bf16_bits bits) {
    return __uint_as_float(static_cast<uint32_t>(bits) << 16);
}

__device__ __forceinline__ bf16_bits float_to_bf16(float value) {
    uint32_t bits = __float_as_uint(value);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        return 0x7fc0;  // PyTorch's canonical NaN
    }
    bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest, ties to even
    return static_cast<bf16_bits>(bits >> 16);
}

// One IEEE fp32 operation each, never fused with a neighbour (see the pragma above).
__device__ __forceinline__ float ieee_add(float a, float b) {
#if defined(__HIPCC__)
    return a + b;
#else
    return __fadd_rn(a, b);
#endif
}

__device__ __forceinline__ float ieee_sub(float a, float b) {
#if defined(__HIPCC__)
    return a - b;
#else
    return __fsub_rn(a, b);
#endif
}

__device__ __forceinline__ float ieee_mul(float a, float b) {
#if defined(__HIPCC__)
    return a * b;
#else
    return __fmul_rn(a, b);
#endif
}

// Element codecs: how a storage type is read into fp32 and written back from it.
struct Bf16Codec {
    using storage = bf16_bits;
    static constexpr bool kIsBf16 = true;
    __device__ __forceinline__ static float load(storage v) { return bf16_to_float(v); }
    __device__ __forceinline__ static storage store(float v) { return float_to_bf16(v); }
};

struct F16Codec {
    using storage = __half;
    static constexpr bool kIsBf16 = false;
    __device__ __forceinline__ static float load(storage v) { return __half2float(v); }
    __device__ __forceinline__ static storage store(float v) { return __float2half_rn(v); }
};

struct F32Codec {
    using storage = float;
    static constexpr bool kIsBf16 = false;
    __device__ __forceinline__ static float load(storage v) { return v; }
    __device__ __forceinline__ static storage store(float v) { return v; }
};

}  // namespace batchinv

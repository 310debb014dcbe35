// The special function unit's 2^x and 1/x, and IEEE division built on that reciprocal.
//
// exp2_ftz / rcp_ftz: one MUFU.EX2 / MUFU.RCP each on CUDA, subnormal inputs and results flushed
// to zero.  Their bits are the hardware's, not IEEE's: deterministic on one GPU (that is all
// invariance needs).  HIP's v_exp_f32 / v_rcp_f32 are other approximations, so HIP bits differ
// from CUDA bits.  exp2_ftz equals exp2f for results >= 2^-126 (exp2f adds a rescale below).
//
// divisor_reciprocal / divide_in_range (CUDA): the instructions of __fdiv_rn(n, d)'s fast path
// without nvcc's operand check (FCHK) and its branch to a slow path: the reciprocal of d refined
// by two FMAs, then q = n * r and one correcting FMA.  Where the quotient and the residual are
// normal and far from overflow this is correctly rounded, so __fdiv_rn's bits; each caller tests
// its own operand range first.  One reciprocal serves several numerators.
#pragma once

#include "portability.cuh"

namespace batchinv {

constexpr float kLog2e = 1.44269502162933349609375f;  // log2(e) rounded to fp32: e^x = 2^(x log2 e)

__device__ __forceinline__ float exp2_ftz(float x) {
    float y;
#if defined(__HIPCC__)
    asm("v_exp_f32 %0, %1" : "=v"(y) : "v"(x));  // no clang builtin before LLVM 17
#else
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
#endif
    return y;
}

__device__ __forceinline__ float rcp_ftz(float x) {
#if defined(__HIPCC__)
    return __builtin_amdgcn_rcpf(x);
#else
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#endif
}

#if !defined(__HIPCC__)
__device__ __forceinline__ float divisor_reciprocal(float d) {
    const float r = rcp_ftz(d);
    return __fmaf_rn(r, __fmaf_rn(-d, r, 1.0f), r);
}

// n / d given r = divisor_reciprocal(d).
__device__ __forceinline__ float divide_in_range(float n, float d, float r) {
    const float q = __fmul_rn(n, r);
    return __fmaf_rn(r, __fmaf_rn(-d, q, n), q);
}
#endif

}  // namespace batchinv

// cp.async, global -> shared memory asynchronously (sm_80+), and shared-memory addresses: one
// definition of each form, used by the mma.sync kernels, the Hopper kernels' Q copies and
// rms_norm's staged rows.  CUDA only (HIP builds compile none of their callers).
#pragma once

#include "portability.cuh"

#if !defined(__HIPCC__)
namespace batchinv {

// The 32-bit shared-memory address of a generic pointer into shared memory.
__device__ __forceinline__ uint32_t smem_address(const void* pointer) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// Copies are asynchronous: a thread commits its copies in groups and waits for them.  The _zfill
// forms copy when `valid` and otherwise read nothing and write zeros.  Destinations are
// shared-memory addresses or pointers into shared memory.  Every statement carries a memory
// clobber, so the compiler moves no shared-memory access across one.

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
// src keeps the caller's element type: converting it to void* changes how the compiler forms the
// source address of a copy loop (and so the code of attention_backward.cu's tile loads).
template <typename T>
__device__ __forceinline__ void cp_async16(void* dst, const T* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_address(dst)), "l"(src) : "memory");
}

__device__ __forceinline__ void cp_async16_zfill(uint32_t dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_async16_zfill(void* dst, const void* src, bool valid) {
    cp_async16_zfill(smem_address(dst), src, valid);
}

// 4 bytes (cp.async.cg moves 16 only; .ca also caches the line in L1).
__device__ __forceinline__ void cp_async4_zfill(uint32_t dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Waits until at most `Pending` of this thread's committed groups are in flight.
template <int Pending>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(Pending) : "memory");
}

}  // namespace batchinv
#endif

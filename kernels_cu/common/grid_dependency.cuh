// Programmatic dependent launch (PTX griddepcontrol, sm_90; compiled out of older targets and
// HIP, where the host never asks for it).  launch_dependents lets the next grid on the stream
// start once every CTA of this one has executed it or exited; wait blocks until the previous
// grid has completed and its memory is visible (it returns at once without a programmatic
// launch).  Used by attention.cu (split -> combine), rms_norm.cu (grad_weight's levels) and
// linear.cu's small-M kernel, which streams its weight before it waits (gpu/linear.py's
// weight prefetch); the kernels that come before it in a decode step (the RMSNorm forwards,
// silu_mul's forward, attention's combine) let it launch early.
#pragma once

#include "portability.cuh"

namespace batchinv {

__device__ __forceinline__ void grid_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_wait_primary() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

}  // namespace batchinv

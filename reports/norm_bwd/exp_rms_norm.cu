// Issue 6, session 10: experiment entries next to main's (this file includes kernels_cu/rms_norm.cu,
// so the image also holds main's entries, compiled with the same flags).  Build (sm_90a cubin):
//   nvcc -cubin -O3 -std=c++17 -arch=sm_90a -I kernels_cu reports/norm_bwd/exp_rms_norm.cu \
//        -o reports/norm_bwd/exp.cubin
// Variants move loads, registers or shared-memory traffic only: each must give main's bits.
#include "rms_norm.cu"

namespace batchinv {
namespace rms {
namespace exp10 {

// grad_weight's reduce level with kSplit threads per column each loading 64 / kSplit rows of the
// run into shared memory, then one thread per column adding the 64 values in row order from +0
// (column_sum's operations: the same bits), so that 4x the loads are in flight.
constexpr int kColumns = 64;
constexpr int kSplit = 4;
__device__ __forceinline__ void weight_grad_reduce_split(float* rows_out, const float* rows_in,
                                                         int64_t num_rows_in, int64_t d) {
    constexpr int kRun = kWeightGradReduceRows;
    constexpr int kPer = kRun / kSplit;
    __shared__ float tile[kRun][kColumns];
    grid_launch_dependents();
    grid_wait_primary();
    const int x = threadIdx.x % kColumns;
    const int part = threadIdx.x / kColumns;
    const int64_t col = static_cast<int64_t>(blockIdx.y) * kColumns + x;
    const int64_t begin = static_cast<int64_t>(blockIdx.x) * kRun;
    const int64_t count = begin + kRun < num_rows_in ? kRun : num_rows_in - begin;
    if (col < d) {
        float v[kPer];
#pragma unroll
        for (int u = 0; u < kPer; ++u) {
            const int r = part * kPer + u;
            v[u] = r < count ? rows_in[(begin + r) * d + col] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < kPer; ++u) tile[part * kPer + u][x] = v[u];
    }
    __syncthreads();
    if (part != 0 || col >= d) return;
    float sum = 0.0f;
    if (count == kRun) {
#pragma unroll
        for (int r = 0; r < kRun; ++r) sum = ieee_add(sum, tile[r][x]);
    } else {
        for (int r = 0; r < count; ++r) sum = ieee_add(sum, tile[r][x]);
    }
    rows_out[static_cast<int64_t>(blockIdx.x) * d + col] = sum;
}

}  // namespace exp10
}  // namespace rms
}  // namespace batchinv

#define EXP_BWG(NAME, CODEC, T, K, MINB, STAGED, FRESH)                                         \
    extern "C" __global__ void __launch_bounds__(batchinv::rms::Cta<T>::kThreads, MINB) NAME(    \
        CODEC::storage* grad_x, float* partials, const CODEC::storage* grad_y,                  \
        const CODEC::storage* x, const CODEC::storage* weight, const float* rstd,               \
        const CODEC::storage* grad_residual, int64_t rows, int64_t d, int64_t x_stride) {       \
        const batchinv::rms::BackwardArgs args{grad_x,        grad_y, x, weight,  rstd,         \
                                               grad_residual, rows,   d, x_stride};             \
        batchinv::rms::backward_weight_grad_kernel<CODEC, T, K, batchinv::rms::WeightGradChunk<T>, \
                                                   STAGED, FRESH>(args, partials);              \
    }

// d = 5120 (t128k5): a register cap of 5 CTAs per SM; the rows staged by cp.async (40 KiB ring).
EXP_BWG(exp_bf16_t128k5_lb5, batchinv::Bf16Codec, 128, 5, 5, false, false)
EXP_BWG(exp_bf16_t128k5_lb6, batchinv::Bf16Codec, 128, 5, 6, false, false)
EXP_BWG(exp_bf16_t128k5_staged, batchinv::Bf16Codec, 128, 5, 1, true, false)
EXP_BWG(exp_f16_t128k5_staged, batchinv::F16Codec, 128, 5, 1, true, false)
// q/k (t4, 32 runs of one row): fresh sums (no clearing pass, no read-back), a cap of 8 CTAs.
EXP_BWG(exp_bf16_t4_fresh, batchinv::Bf16Codec, 4, 4, 1, false, true)
EXP_BWG(exp_bf16_t4_fresh_lb7, batchinv::Bf16Codec, 4, 4, 7, false, true)
EXP_BWG(exp_bf16_t4_lb8, batchinv::Bf16Codec, 4, 4, 8, false, false)
EXP_BWG(exp_bf16_t4_fresh_lb8, batchinv::Bf16Codec, 4, 4, 8, false, true)
EXP_BWG(exp_f16_t4_fresh, batchinv::F16Codec, 4, 4, 1, false, true)
EXP_BWG(exp_f32_t4_fresh, batchinv::F32Codec, 4, 4, 1, false, true)

extern "C" __global__ void __launch_bounds__(256) exp_weight_grad_reduce_split(
    float* rows_out, const float* rows_in, int64_t num_rows_in, int64_t d) {
    batchinv::rms::exp10::weight_grad_reduce_split(rows_out, rows_in, num_rows_in, d);
}

// Token log-probabilities from portable pieces: HIP's token_logprobs, and the same kernels in the
// CUDA build so an NVIDIA GPU runs HIP's arithmetic.  No tensor cores, TMA or matrix cores,
// and no cross-lane work, so nothing depends on the wavefront width (32 or 64 lanes).
//
//   logprob[t] = z[t, target[t]] - logsumexp_v z[t, v],   z = hidden · weightᵀ (fp32),
//   entropy[t] = -sum_v p[t, v] log p[t, v]  (optional),   and the gradients of both.
//
// Kernels (the host, py/batchinv/gpu/token_logprobs_portable.py, runs them per vocabulary
// chunk of a multiple of 256 columns):
// - token_logprobs_gemm_{f32,acc,store}_{bf16,f16}: out[m, n] = sum_k A(m, k) · B(n, k), the
//   operands bf16/fp16 at A[m * a_row + k * a_k] and B[n * b_row + k * b_k] (any strides, so
//   the backward reads W, d_z and hidden as they lie, with no transposed copy), out row-major
//   with leading dimension ld_out.  `f32` stores the fp32 sum (the logits), `acc` adds it to out
//   with one fp32 add (d_hidden, once per chunk), `store` rounds it once to the input dtype
//   (d_W).  Grid (ceil(M / 16), ceil(N / 16)); block (16, 16); one thread per output.
// - token_logprobs_tile_states: each 256-column tile of a row of fp32 logits reduced to its
//   online log-sum-exp state (m, l, s), the tiles token_logprobs.cu's forward defines, and the
//   target's logit copied out; token_logprobs.cu's token_logprobs_finalize then merges the
//   states (the same kernel as the CUDA forward).  Grid ceil(rows * tiles / 128); block 128.
// - token_logprobs_grad_logits_{bf16,f16}: d_z = g * (onehot - p) - g_ent * p * ((z - lse) +
//   entropy) from the fp32 logits, rounded once to the input dtype (token_logprobs.cu's
//   formula).  Grid (rows, ceil(width / 256)); block 256.
//
// Invariance contract.  Every output of the GEMM is one fp32 FMA chain over k in increasing
// order from zero: the order of linear.cu's SIMT loop (linear_simt_*), so the logits are the
// bits that loop has before its rounding.  A tile state is one thread's sequential pass over
// its tile's columns in increasing order (max, then the sums).  d_hidden reduces each chunk's
// columns in one chain and adds the chunk to its fp32 buffer, chunks in increasing order; d_W
// reduces the tokens in increasing order.  Which thread or CTA computes an element follows the
// shape, never its order: a row's logprob, entropy, lse and d_hidden do not depend on the other
// rows, and d_W is bitwise identical run to run.  The bits are not the CUDA kernels' (whose
// GEMM runs wgmma's k16 steps and whose tiles reduce in a quad tree), and HIP's need not be
// these (ROCm's expf and logf are not libdevice's).
#include "common/portability.cuh"

namespace batchinv {
namespace token_logprobs_portable {

constexpr int kVocabTile = 256;  // token_logprobs.cu's kVocabTile: the forward's tiles
constexpr int kGemmTile = 16;    // outputs per CTA side in the GEMM (block 16 x 16)

// One operand of the GEMM: element (row, k) at base[row * row_stride + k * k_stride].
template <typename Codec>
struct Operand {
    const typename Codec::storage* base;
    int64_t row_stride, k_stride;
    __device__ __forceinline__ float load(int row, int k) const {
        return Codec::load(base[row * row_stride + k * k_stride]);
    }
};

struct StoreF32 {
    float* out;
    int64_t ld;
    __device__ __forceinline__ void operator()(int m, int n, float v) const { out[m * ld + n] = v; }
};

struct AccumulateF32 {
    float* out;
    int64_t ld;
    __device__ __forceinline__ void operator()(int m, int n, float v) const {
        out[m * ld + n] = ieee_add(out[m * ld + n], v);
    }
};

template <typename Codec>
struct StoreRounded {
    typename Codec::storage* out;
    int64_t ld;
    __device__ __forceinline__ void operator()(int m, int n, float v) const { out[m * ld + n] = Codec::store(v); }
};

template <typename Codec, typename Epilogue>
__device__ __forceinline__ void gemm(const Operand<Codec>& a, const Operand<Codec>& b, int M, int N, int K,
                                     const Epilogue& epilogue) {
    const int m = blockIdx.x * kGemmTile + threadIdx.y;
    const int n = blockIdx.y * kGemmTile + threadIdx.x;
    if (m >= M || n >= N) return;
    float acc = 0.0f;
    for (int k = 0; k < K; ++k) acc = __fmaf_rn(a.load(m, k), b.load(n, k), acc);
    epilogue(m, n, acc);
}

// One row's tile: (m, l, s) as token_logprobs.cu's PartialsEpilogue defines them (m = max + 0;
// l = sum exp(z - m); s = sum exp(z - m) (z - m) over the terms whose exp is not 0), each in
// increasing column order.
__device__ __forceinline__ void tile_state(const float* logits, int64_t ld, int rows, int width, int vocab_offset,
                                           const int32_t* targets, float* target_logit, float* part_m,
                                           float* part_l, float* part_s, int tiles) {
    const int chunk_tiles = (width + kVocabTile - 1) / kVocabTile;
    const int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (index >= static_cast<int64_t>(rows) * chunk_tiles) return;
    const int row = static_cast<int>(index / chunk_tiles);
    const int local_tile = static_cast<int>(index % chunk_tiles);
    const int begin = local_tile * kVocabTile;
    const int end = min(begin + kVocabTile, width);
    const float* z = logits + row * ld;
    float m = -INFINITY;
    for (int col = begin; col < end; ++col) m = fmaxf(m, z[col]);
    m = ieee_add(m, 0.0f);  // -0 -> +0, as the reference does
    float l = 0.0f, s = 0.0f;
    for (int col = begin; col < end; ++col) {
        const float shifted = ieee_sub(z[col], m);
        const float weight = expf(shifted);
        l = ieee_add(l, weight);
        if (part_s != nullptr && weight != 0.0f) s = ieee_add(s, ieee_mul(weight, shifted));
    }
    const int target = targets[row] - vocab_offset;
    if (target >= begin && target < end) target_logit[row] = z[target];
    const int64_t at = static_cast<int64_t>(row) * tiles + vocab_offset / kVocabTile + local_tile;
    part_m[at] = m;
    part_l[at] = l;
    if (part_s != nullptr) part_s[at] = s;
}

// d_z of one chunk of columns from its fp32 logits (token_logprobs.cu's GradLogitsEpilogue).
template <typename Codec>
__device__ __forceinline__ void grad_logits(const float* logits, int64_t ld_logits, const int32_t* targets,
                                            const float* lse, const float* grad_logprob, const float* grad_entropy,
                                            const float* entropy, typename Codec::storage* grad_z,
                                            int64_t grad_z_stride, int width, int vocab_offset) {
    const int row = blockIdx.x;
    const int col = blockIdx.y * blockDim.x + threadIdx.x;
    if (col >= width) return;
    const int target = targets[row];
    float d = 0.0f;  // ignored token
    if (target >= 0) {
        const float log_p = ieee_sub(logits[row * ld_logits + col], lse[row]);
        const float p = expf(log_p);
        const float onehot = (col + vocab_offset == target) ? 1.0f : 0.0f;
        d = ieee_mul(grad_logprob[row], ieee_sub(onehot, p));
        if (grad_entropy != nullptr) {
            d = ieee_sub(d, ieee_mul(grad_entropy[row], ieee_mul(p, ieee_add(log_p, entropy[row]))));
        }
    }
    grad_z[row * grad_z_stride + col] = Codec::store(d);
}

}  // namespace token_logprobs_portable
}  // namespace batchinv

#define BATCHINV_TLP_PORTABLE_GEMM(DTYPE, CODEC)                                                                     \
    extern "C" __global__ void __launch_bounds__(256) token_logprobs_gemm_f32_##DTYPE(                              \
        const CODEC::storage* a, long long a_row, long long a_k, const CODEC::storage* b, long long b_row,          \
        long long b_k, float* out, long long ld_out, int M, int N, int K) {                                         \
        using namespace batchinv::token_logprobs_portable;                                                          \
        gemm<CODEC>(Operand<CODEC>{a, a_row, a_k}, Operand<CODEC>{b, b_row, b_k}, M, N, K, StoreF32{out, ld_out});  \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(256) token_logprobs_gemm_acc_##DTYPE(                              \
        const CODEC::storage* a, long long a_row, long long a_k, const CODEC::storage* b, long long b_row,          \
        long long b_k, float* out, long long ld_out, int M, int N, int K) {                                         \
        using namespace batchinv::token_logprobs_portable;                                                          \
        gemm<CODEC>(Operand<CODEC>{a, a_row, a_k}, Operand<CODEC>{b, b_row, b_k}, M, N, K,                          \
                    AccumulateF32{out, ld_out});                                                                     \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(256) token_logprobs_gemm_store_##DTYPE(                            \
        const CODEC::storage* a, long long a_row, long long a_k, const CODEC::storage* b, long long b_row,          \
        long long b_k, CODEC::storage* out, long long ld_out, int M, int N, int K) {                                \
        using namespace batchinv::token_logprobs_portable;                                                          \
        gemm<CODEC>(Operand<CODEC>{a, a_row, a_k}, Operand<CODEC>{b, b_row, b_k}, M, N, K,                          \
                    StoreRounded<CODEC>{out, ld_out});                                                               \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(256) token_logprobs_grad_logits_##DTYPE(                           \
        const float* logits, long long ld_logits, const int32_t* targets, const float* lse,                         \
        const float* grad_logprob, const float* grad_entropy, const float* entropy, CODEC::storage* grad_z,         \
        long long grad_z_stride, int width, int vocab_offset) {                                                     \
        batchinv::token_logprobs_portable::grad_logits<CODEC>(logits, ld_logits, targets, lse, grad_logprob,        \
                                                              grad_entropy, entropy, grad_z, grad_z_stride, width,  \
                                                              vocab_offset);                                        \
    }

extern "C" __global__ void __launch_bounds__(128)
    token_logprobs_tile_states(const float* logits, long long ld, int rows, int width, int vocab_offset,
                               const int32_t* targets, float* target_logit, float* part_m, float* part_l,
                               float* part_s, int tiles) {
    batchinv::token_logprobs_portable::tile_state(logits, ld, rows, width, vocab_offset, targets, target_logit,
                                                  part_m, part_l, part_s, tiles);
}

BATCHINV_TLP_PORTABLE_GEMM(bf16, batchinv::Bf16Codec)
BATCHINV_TLP_PORTABLE_GEMM(f16, batchinv::F16Codec)

// Token log-probabilities through the lm_head without the [T, V] logits:
//   logprob[t] = z[t, target[t]] - logsumexp_v z[t, v],   z = hidden · weightᵀ (fp32),
//   entropy[t] = -sum_v p[t, v] log p[t, v]  (optional),   and the gradients of both.
//
//   hidden   [T, H]  bf16 or fp16, row-major, read through a TMA map (H % 8 == 0)
//   weight   [V, H]  same dtype (Hugging Face lm_head layout), through a TMA map
//   targets  [T]     int32: the target id, or -1 for an ignored or out-of-range token
//                    (token_logprobs_mark_targets_*, which also records the first bad one)
//
// Invariance contract.  The logits come from linear.cu's main loop (hopper_gemm_tiles): each
// z[t, v] is one K reduction in a constant order, the same bits whatever M and tile shape.
// Forward, pass 1 (token_logprobs_partials_*): tiles of kVocabTile = 256 vocabulary columns,
// a constant of the build.  For each row of its tile a thread reduces its own 64 columns in
// increasing column order, then the four threads of a quad combine with a fixed xor tree, giving
// the tile's (m, l, s): m = max z + 0, l = sum exp(z - m), s = sum exp(z - m) * (z - m).  The
// thread that holds the target column writes its logit (exactly one tile does).  Pass 2
// (token_logprobs_finalize): one warp per row merges the ceil(V / 256) tile states, lane k
// taking tiles k, k + 32, ... in order, then a fixed xor tree over the 32 lanes; the merge is
// commutative bit for bit, so every lane ends with the same state.  Nothing here depends on T
// or on which rows share a CTA: BM (64 or 128) only decides which CTA computes a row.
// Backward (token_logprobs_grad_logits_*): recomputes z for a vocabulary chunk with the same
// main loop and writes d_z = g * (onehot - p) - g_ent * p * ((z - lse) + entropy), elementwise
// per token, rounded once to the input dtype, into one [T, chunk] buffer; then
// token_logprobs_accumulate_* adds d_z · W_chunk to an fp32 [T, H] buffer (K = the chunk's
// columns in increasing order, one fp32 add per element per chunk, chunks in increasing order):
// per token, so batch-invariant.  token_logprobs_weight_grad_* computes d_W_chunk = d_zᵀ · hidden
// (K = tokens in increasing order, 64-token tiles, four k16 steps each) and rounds each element
// once to the weight dtype: a fixed order, so bitwise identical run to run.  Both read their
// transposed operands (W_chunk, d_z and hidden, all N- or M-contiguous) straight from the
// row-major tensors through the wgmma transpose flags: no transposed copy exists.
#define BATCHINV_LINEAR_NO_KERNELS
#include "linear.cu"

namespace batchinv {
namespace token_logprobs {

constexpr int kVocabTile = 256;  // columns per forward tile: part of the definition (bits)

// The online log-sum-exp state of a set of columns of one row (see the contract above).
struct LseState {
    float m;  // max logit + 0 (-inf when empty)
    float l;  // sum exp(z - m)
    float s;  // sum exp(z - m) * (z - m), for the entropy
};

__device__ __forceinline__ float merge_scale(float m_old, float m_new) {
    // exp(m_old - m) with an empty side giving 0, never exp(-inf - -inf) = NaN.
    return m_old == -INFINITY ? 0.0f : expf(ieee_sub(m_old, m_new));
}

__device__ __forceinline__ float merged_entropy_term(const LseState& side, float scale, float m_new) {
    if (scale == 0.0f) return 0.0f;
    return ieee_mul(scale, ieee_add(side.s, ieee_mul(ieee_sub(side.m, m_new), side.l)));
}

// Commutative bit for bit (max, and sums of two products), so an xor tree leaves every lane
// with the same state.
__device__ __forceinline__ LseState merge(const LseState& a, const LseState& b) {
    const float m = fmaxf(a.m, b.m);
    const float scale_a = merge_scale(a.m, m);
    const float scale_b = merge_scale(b.m, m);
    LseState out;
    out.m = m;
    out.l = ieee_add(ieee_mul(a.l, scale_a), ieee_mul(b.l, scale_b));
    out.s = ieee_add(merged_entropy_term(a, scale_a, m), merged_entropy_term(b, scale_b, m));
    return out;
}

__device__ __forceinline__ LseState shfl_xor_state(const LseState& state, int mask) {
    LseState other;
    other.m = BATCHINV_SHFL_XOR(state.m, mask);
    other.l = BATCHINV_SHFL_XOR(state.l, mask);
    other.s = BATCHINV_SHFL_XOR(state.s, mask);
    return other;
}

// Pass 1 epilogue: the tile's (m, l, s) per row and the target's logit.
struct PartialsEpilogue {
    const int32_t* targets;
    float* target_logit;  // [T]
    float* part_m;        // [T, tiles]
    float* part_l;
    float* part_s;  // null without the entropy
    int M, N, tiles;

    template <int kAcc>
    __device__ __forceinline__ void operator()(const float (&acc)[kAcc], int row, int n0, int lane) const {
        const int tile = n0 / kVocabTile;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = row + 8 * half;
            float m = -INFINITY;
#pragma unroll
            for (int j = 0; j < kAcc / 4; ++j) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int col = n0 + j * 8 + (lane % 4) * 2 + e;
                    if (col < N) m = fmaxf(m, acc[4 * j + 2 * half + e]);
                }
            }
            m = fmaxf(m, BATCHINV_SHFL_XOR(m, 1));
            m = fmaxf(m, BATCHINV_SHFL_XOR(m, 2));
            m = ieee_add(m, 0.0f);  // -0 -> +0, as the reference does
            float l = 0.0f, s = 0.0f;
#pragma unroll
            for (int j = 0; j < kAcc / 4; ++j) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int col = n0 + j * 8 + (lane % 4) * 2 + e;
                    if (col < N) {
                        const float shifted = ieee_sub(acc[4 * j + 2 * half + e], m);
                        const float weight = expf(shifted);
                        l = ieee_add(l, weight);
                        if (part_s != nullptr && weight != 0.0f) s = ieee_add(s, ieee_mul(weight, shifted));
                    }
                }
            }
            l = ieee_add(l, BATCHINV_SHFL_XOR(l, 1));
            l = ieee_add(l, BATCHINV_SHFL_XOR(l, 2));
            s = ieee_add(s, BATCHINV_SHFL_XOR(s, 1));
            s = ieee_add(s, BATCHINV_SHFL_XOR(s, 2));
            if (r >= M) continue;
            const int target = targets[r];
            if (target >= n0 && target < n0 + kVocabTile) {
#pragma unroll
                for (int j = 0; j < kAcc / 4; ++j) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int col = n0 + j * 8 + (lane % 4) * 2 + e;
                        if (col == target) target_logit[r] = acc[4 * j + 2 * half + e];
                    }
                }
            }
            if (lane % 4 == 0) {
                const int64_t at = static_cast<int64_t>(r) * tiles + tile;
                part_m[at] = m;
                part_l[at] = l;
                if (part_s != nullptr) part_s[at] = s;
            }
        }
    }
};

// Backward epilogue: d_z of one vocabulary chunk, rounded to the input dtype, [T, chunk].
template <typename Codec>
struct GradLogitsEpilogue {
    const int32_t* targets;
    const float* lse;
    const float* grad_logprob;  // [T]
    const float* grad_entropy;  // [T] or null: no entropy term
    const float* entropy;       // [T] or null
    typename Codec::storage* grad_z;  // [T, grad_z_stride]
    int64_t grad_z_stride;
    int M, N, vocab_offset;

    // One token's inputs to d_z, loaded once per row rather than once per element.
    struct Row {
        int target;  // -1: ignored
        float lse, g, g_ent, entropy;
    };

    __device__ __forceinline__ Row load_row(int r) const {
        Row row{targets[r], lse[r], grad_logprob[r], 0.0f, 0.0f};
        if (grad_entropy != nullptr) {
            row.g_ent = grad_entropy[r];
            row.entropy = entropy[r];
        }
        return row;
    }

    __device__ __forceinline__ float grad_at(float z, const Row& row, int col) const {
        if (row.target < 0) return 0.0f;  // ignored token
        const float log_p = ieee_sub(z, row.lse);
        const float p = expf(log_p);
        const float onehot = (col + vocab_offset == row.target) ? 1.0f : 0.0f;
        float d = ieee_mul(row.g, ieee_sub(onehot, p));
        if (grad_entropy != nullptr) {
            d = ieee_sub(d, ieee_mul(row.g_ent, ieee_mul(p, ieee_add(log_p, row.entropy))));
        }
        return d;
    }

    template <int kAcc>
    __device__ __forceinline__ void operator()(const float (&acc)[kAcc], int row, int n0, int lane) const {
        using storage = typename Codec::storage;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = row + 8 * half;
            if (r >= M) continue;
            const Row inputs = load_row(r);
#pragma unroll
            for (int j = 0; j < kAcc / 4; ++j) {
                const int col = n0 + j * 8 + (lane % 4) * 2;
                if (col >= N) continue;
                const storage d0 = Codec::store(grad_at(acc[4 * j + 2 * half], inputs, col));
                storage* dst = grad_z + r * grad_z_stride + col;
                if (col + 1 < N) {
                    const storage d1 = Codec::store(grad_at(acc[4 * j + 2 * half + 1], inputs, col + 1));
                    // grad_z_stride is even, so the pair is 4-byte aligned.
                    *reinterpret_cast<uint32_t*>(dst) =
                        static_cast<uint32_t>(linear::storage_bits<Codec>(d0)) |
                        (static_cast<uint32_t>(linear::storage_bits<Codec>(d1)) << 16);
                } else {
                    dst[0] = d0;
                }
            }
        }
    }
};

// Backward epilogue: out[r, col] += acc in fp32 (one add per element and chunk).  Adjacent
// column pairs move as one 8-byte access when aligned; the arithmetic is the same either way.
struct AccumulateEpilogue {
    float* out;  // [M, N]
    int M, N;

    template <int kAcc>
    __device__ __forceinline__ void operator()(const float (&acc)[kAcc], int row, int n0, int lane) const {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = row + 8 * half;
            if (r >= M) continue;
#pragma unroll
            for (int j = 0; j < kAcc / 4; ++j) {
                const int col = n0 + j * 8 + (lane % 4) * 2;
                if (col >= N) continue;
                float* dst = out + static_cast<int64_t>(r) * N + col;
                const float a0 = acc[4 * j + 2 * half], a1 = acc[4 * j + 2 * half + 1];
                if (col + 1 < N && N % 2 == 0) {
                    float2 v = *reinterpret_cast<float2*>(dst);
                    v.x = ieee_add(v.x, a0);
                    v.y = ieee_add(v.y, a1);
                    *reinterpret_cast<float2*>(dst) = v;
                } else {
                    dst[0] = ieee_add(dst[0], a0);
                    if (col + 1 < N) dst[1] = ieee_add(dst[1], a1);
                }
            }
        }
    }
};

// ---- the backward's GEMMs, with M- or N-major operands ---------------------------------------
//
// The backward's two other GEMMs read operands that are contiguous along M or N in memory
// (W_chunk [chunk, H] for d_hidden; d_z [T, chunk] and hidden [T, H] for d_W), so they run the
// shared main loop (common/hopper_gemm.cuh) with its transpose options: TMA boxes of 64
// M/N-elements (128 bytes) by 64 k-rows, read by wgmma with its transpose flags.  The K order is
// linear.cu's: 64-wide k-tiles in increasing k, four k16 steps each, fp32 accumulators, no
// split-K; BN = 256, STAGE_K = 64, 4 stages.

// out tile = A[M, K] · B[K, N]: A is K-major ([M, K] rows, map box BM x 64) or, with kTransA,
// M-major ([K, M] rows, map box 64 x 64); B is K-major ([N, K] rows, box 256 x 64) or, with
// kTransB, N-major ([K, N] rows, box 64 x 64).  Zeros arrive past every edge.
template <typename Codec, int BM, int kTransA, int kTransB, typename Epilogue>
__device__ __forceinline__ void backward_gemm_tiles(const TensorMap& map_a, const TensorMap& map_b, int M, int N,
                                                    int K, const Epilogue& epilogue) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ uint8_t shared_raw[];
    hopper::gemm_k_range<Codec, BM, 256, 64, 4, kTransA, kTransB, false>(shared_raw, map_a, map_b, M, N, 0, K,
                                                                         epilogue);
#elif defined(__CUDA_ARCH__)
    __trap();  // built only into sm_90a images; the host never launches it elsewhere
#endif
}

// Pass 2: one warp per row merges the tile states (see the contract).
__device__ __forceinline__ void finalize_row(const float* part_m, const float* part_l, const float* part_s,
                                             const float* target_logit, const int32_t* targets, int tiles,
                                             int row, float* logprob, float* lse, float* entropy) {
    const int lane = threadIdx.x % 32;
    LseState state{-INFINITY, 0.0f, 0.0f};
    const int64_t base = static_cast<int64_t>(row) * tiles;
    for (int tile = lane; tile < tiles; tile += 32) {
        const LseState next{part_m[base + tile], part_l[base + tile], part_s != nullptr ? part_s[base + tile] : 0.0f};
        state = merge(state, next);
    }
#pragma unroll
    for (int mask = 16; mask >= 1; mask /= 2) state = merge(state, shfl_xor_state(state, mask));
    if (lane != 0) return;
    const float log_l = logf(state.l);
    const float row_lse = ieee_add(state.m, log_l);
    const bool valid = targets[row] >= 0;
    lse[row] = row_lse;
    logprob[row] = valid ? ieee_sub(target_logit[row], row_lse) : 0.0f;
    if (entropy != nullptr) entropy[row] = valid ? ieee_sub(log_l, __fdiv_rn(state.s, state.l)) : 0.0f;
}

}  // namespace token_logprobs
}  // namespace batchinv

extern "C" __global__ void __launch_bounds__(128)
    token_logprobs_finalize(const float* part_m, const float* part_l, const float* part_s, const float* target_logit,
                            const int32_t* targets, int tiles, int rows, float* logprob, float* lse, float* entropy) {
    const int row = blockIdx.x * 4 + threadIdx.x / 32;
    if (row >= rows) return;
    batchinv::token_logprobs::finalize_row(part_m, part_l, part_s, target_logit, targets, tiles, row, logprob, lse,
                                           entropy);
}

// The targets the kernels read, from the user's ids in one launch: the id, or -1 where it is
// ignore_index or outside [0, vocab); the smallest position of an outside id that is not
// ignore_index goes to first_bad (atomicMin; the caller presets UINT64_MAX and reads it, or
// leaves it to a deferred check).  The host launches it only where ignore_index fits the ids'
// dtype, so comparing after widening both to int64 is the comparison torch makes.
namespace batchinv {
namespace token_logprobs {
template <typename Id>
__device__ __forceinline__ void mark_target(const Id* ids, int64_t count, int64_t vocab, int64_t ignore_index,
                                            int32_t* targets, unsigned long long* first_bad) {
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= count) return;
    const int64_t id = static_cast<int64_t>(ids[i]);
    const bool outside = id < 0 || id >= vocab;
    targets[i] = outside || id == ignore_index ? -1 : static_cast<int32_t>(id);
    if (outside && id != ignore_index) atomicMin(first_bad, static_cast<unsigned long long>(i));
}
}  // namespace token_logprobs
}  // namespace batchinv

extern "C" __global__ void __launch_bounds__(256)
    token_logprobs_mark_targets_i32(const int32_t* ids, int64_t count, int64_t vocab, int64_t ignore_index,
                                    int32_t* targets, unsigned long long* first_bad) {
    batchinv::token_logprobs::mark_target(ids, count, vocab, ignore_index, targets, first_bad);
}

extern "C" __global__ void __launch_bounds__(256)
    token_logprobs_mark_targets_i64(const int64_t* ids, int64_t count, int64_t vocab, int64_t ignore_index,
                                    int32_t* targets, unsigned long long* first_bad) {
    batchinv::token_logprobs::mark_target(ids, count, vocab, ignore_index, targets, first_bad);
}

// BN is fixed at kVocabTile for the forward (the tile is part of the definition); BM is free.
#define BATCHINV_TLP_PARTIALS(DTYPE, CODEC, BM)                                                                    \
    extern "C" __global__ void __launch_bounds__(128 * (BM / 64 + 1), 1)                                            \
        token_logprobs_partials_##DTYPE##_bm##BM(                                                                   \
            const __grid_constant__ batchinv::TensorMap map_hidden,                                                \
            const __grid_constant__ batchinv::TensorMap map_weight, const int32_t* targets, float* target_logit,   \
            float* part_m, float* part_l, float* part_s, int M, int N, int K, int tiles) {                          \
        const batchinv::token_logprobs::PartialsEpilogue epilogue{targets, target_logit, part_m, part_l,           \
                                                                  part_s,  M,            N,      tiles};            \
        batchinv::linear::hopper_gemm_tiles<CODEC, BM, batchinv::token_logprobs::kVocabTile, 64, 4>(              \
            map_hidden, map_weight, M, N, K, epilogue);                                                             \
    }

#define BATCHINV_TLP_GRAD_LOGITS(DTYPE, CODEC, BM)                                                                  \
    extern "C" __global__ void __launch_bounds__(128 * (BM / 64 + 1), 1) token_logprobs_grad_logits_##DTYPE##_bm##BM( \
        const __grid_constant__ batchinv::TensorMap map_hidden, const __grid_constant__ batchinv::TensorMap map_weight, \
        const int32_t* targets, const float* lse, const float* grad_logprob, const float* grad_entropy,             \
        const float* entropy, CODEC::storage* grad_z, int64_t grad_z_stride, int M, int N, int K, int vocab_offset) { \
        const batchinv::token_logprobs::GradLogitsEpilogue<CODEC> epilogue{                                         \
            targets, lse, grad_logprob, grad_entropy, entropy, grad_z, grad_z_stride, M, N, vocab_offset};          \
        batchinv::linear::hopper_gemm_tiles<CODEC, BM, 256, 64, 4>(map_hidden, map_weight, M, N, K, epilogue);      \
    }

// d_hidden += d_z · W_chunk: d_z [T, chunk] K-major, W_chunk [chunk, H] read N-major.
#define BATCHINV_TLP_ACCUMULATE(DTYPE, CODEC, BM)                                                                   \
    extern "C" __global__ void __launch_bounds__(128 * (BM / 64 + 1), 1) token_logprobs_accumulate_##DTYPE##_bm##BM(  \
        const __grid_constant__ batchinv::TensorMap map_grad_z, const __grid_constant__ batchinv::TensorMap map_w,  \
        float* out, int M, int N, int K) {                                                                          \
        const batchinv::token_logprobs::AccumulateEpilogue epilogue{out, M, N};                                     \
        batchinv::token_logprobs::backward_gemm_tiles<CODEC, BM, 0, 1>(map_grad_z, map_w, M, N, K, epilogue);      \
    }

// d_W_chunk = d_zᵀ · hidden, rounded once: d_z [T, chunk] read M-major, hidden [T, H] N-major.
#define BATCHINV_TLP_WEIGHT_GRAD(DTYPE, CODEC)                                                                      \
    extern "C" __global__ void __launch_bounds__(384, 1) token_logprobs_weight_grad_##DTYPE(                       \
        const __grid_constant__ batchinv::TensorMap map_grad_z, const __grid_constant__ batchinv::TensorMap map_hidden, \
        CODEC::storage* out, int M, int N, int K) {                                                                 \
        const batchinv::linear::StoreEpilogue<CODEC> epilogue{out, nullptr, M, N};                                  \
        batchinv::token_logprobs::backward_gemm_tiles<CODEC, 128, 1, 1>(map_grad_z, map_hidden, M, N, K, epilogue); \
    }

#if !defined(__HIPCC__)
BATCHINV_TLP_PARTIALS(bf16, batchinv::Bf16Codec, 64)
BATCHINV_TLP_PARTIALS(bf16, batchinv::Bf16Codec, 128)
BATCHINV_TLP_PARTIALS(f16, batchinv::F16Codec, 64)
BATCHINV_TLP_PARTIALS(f16, batchinv::F16Codec, 128)
BATCHINV_TLP_GRAD_LOGITS(bf16, batchinv::Bf16Codec, 64)
BATCHINV_TLP_GRAD_LOGITS(bf16, batchinv::Bf16Codec, 128)
BATCHINV_TLP_GRAD_LOGITS(f16, batchinv::F16Codec, 64)
BATCHINV_TLP_GRAD_LOGITS(f16, batchinv::F16Codec, 128)
BATCHINV_TLP_ACCUMULATE(bf16, batchinv::Bf16Codec, 64)
BATCHINV_TLP_ACCUMULATE(bf16, batchinv::Bf16Codec, 128)
BATCHINV_TLP_ACCUMULATE(f16, batchinv::F16Codec, 64)
BATCHINV_TLP_ACCUMULATE(f16, batchinv::F16Codec, 128)
BATCHINV_TLP_WEIGHT_GRAD(bf16, batchinv::Bf16Codec)
BATCHINV_TLP_WEIGHT_GRAD(f16, batchinv::F16Codec)
#endif

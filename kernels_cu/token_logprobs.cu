// Token log-probabilities through the lm_head without the [T, V] logits:
//   logprob[t] = z[t, target[t]] - logsumexp_v z[t, v],   z = hidden · weightᵀ (fp32),
//   entropy[t] = -sum_v p[t, v] log p[t, v]  (optional),   and the gradients of both.
//
//   hidden   [T, H]  bf16 or fp16, row-major, read through a TMA map (H % 8 == 0)
//   weight   [V, H]  same dtype (Hugging Face lm_head layout), through a TMA map
//   targets  [T]     int32: the target id, or -1 for an ignored token (the host maps
//                    ignore_index and checks the range before the launch)
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
// per token, rounded once to the input dtype, both [T, chunk] and transposed [chunk, T]; then
// token_logprobs_accumulate_* adds d_z · W_chunk to an fp32 [T, H] buffer (one fp32 add per
// element per chunk, chunks in increasing order): per token, so batch-invariant.  The weight
// gradient is linear.cu's own kernel on the transposed d_z (tokens reduced in order).
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

// Backward epilogue: d_z of one vocabulary chunk, rounded to the input dtype, stored twice.
template <typename Codec>
struct GradLogitsEpilogue {
    const int32_t* targets;
    const float* lse;
    const float* grad_logprob;  // [T]
    const float* grad_entropy;  // [T] or null: no entropy term
    const float* entropy;       // [T] or null
    typename Codec::storage* grad_z;    // [T, grad_z_stride]
    typename Codec::storage* grad_z_t;  // [chunk, grad_z_t_stride]
    int64_t grad_z_stride, grad_z_t_stride;
    int M, N, vocab_offset;

    __device__ __forceinline__ float grad_at(float z, int r, int col) const {
        const int target = targets[r];
        if (target < 0) return 0.0f;  // ignored token
        const float log_p = ieee_sub(z, lse[r]);
        const float p = expf(log_p);
        const float onehot = (col + vocab_offset == target) ? 1.0f : 0.0f;
        float d = ieee_mul(grad_logprob[r], ieee_sub(onehot, p));
        if (grad_entropy != nullptr) {
            d = ieee_sub(d, ieee_mul(grad_entropy[r], ieee_mul(p, ieee_add(log_p, entropy[r]))));
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
#pragma unroll
            for (int j = 0; j < kAcc / 4; ++j) {
                const int col = n0 + j * 8 + (lane % 4) * 2;
                if (col >= N) continue;
                const storage d0 = Codec::store(grad_at(acc[4 * j + 2 * half], r, col));
                grad_z_t[col * grad_z_t_stride + r] = d0;
                storage* dst = grad_z + r * grad_z_stride + col;
                if (col + 1 < N) {
                    const storage d1 = Codec::store(grad_at(acc[4 * j + 2 * half + 1], r, col + 1));
                    grad_z_t[(col + 1) * grad_z_t_stride + r] = d1;
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
        const float* entropy, CODEC::storage* grad_z, CODEC::storage* grad_z_t, int64_t grad_z_stride,              \
        int64_t grad_z_t_stride, int M, int N, int K, int vocab_offset) {                                            \
        const batchinv::token_logprobs::GradLogitsEpilogue<CODEC> epilogue{                                         \
            targets, lse, grad_logprob, grad_entropy, entropy, grad_z, grad_z_t, grad_z_stride, grad_z_t_stride, M, \
            N,       vocab_offset};                                                                                 \
        batchinv::linear::hopper_gemm_tiles<CODEC, BM, 256, 64, 4>(map_hidden, map_weight, M, N, K, epilogue);      \
    }

#define BATCHINV_TLP_ACCUMULATE(DTYPE, CODEC, BM)                                                                   \
    extern "C" __global__ void __launch_bounds__(128 * (BM / 64 + 1), 1) token_logprobs_accumulate_##DTYPE##_bm##BM(  \
        const __grid_constant__ batchinv::TensorMap map_x, const __grid_constant__ batchinv::TensorMap map_w,       \
        float* out, int M, int N, int K) {                                                                          \
        const batchinv::token_logprobs::AccumulateEpilogue epilogue{out, M, N};                                     \
        batchinv::linear::hopper_gemm_tiles<CODEC, BM, 256, 64, 4>(map_x, map_w, M, N, K, epilogue);                \
    }

#if !defined(__HIPCC__)
// batchinv-signature: token_logprobs_partials_bf16_bm64(tmap, tmap, ptr, ptr, ptr, ptr, ptr, i32, i32, i32, i32)
BATCHINV_TLP_PARTIALS(bf16, batchinv::Bf16Codec, 64)
// batchinv-signature: token_logprobs_partials_bf16_bm128(tmap, tmap, ptr, ptr, ptr, ptr, ptr, i32, i32, i32, i32)
BATCHINV_TLP_PARTIALS(bf16, batchinv::Bf16Codec, 128)
// batchinv-signature: token_logprobs_partials_f16_bm64(tmap, tmap, ptr, ptr, ptr, ptr, ptr, i32, i32, i32, i32)
BATCHINV_TLP_PARTIALS(f16, batchinv::F16Codec, 64)
// batchinv-signature: token_logprobs_partials_f16_bm128(tmap, tmap, ptr, ptr, ptr, ptr, ptr, i32, i32, i32, i32)
BATCHINV_TLP_PARTIALS(f16, batchinv::F16Codec, 128)
// batchinv-signature: token_logprobs_grad_logits_bf16_bm64(tmap, tmap, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i32, i32, i32, i32)
BATCHINV_TLP_GRAD_LOGITS(bf16, batchinv::Bf16Codec, 64)
// batchinv-signature: token_logprobs_grad_logits_bf16_bm128(tmap, tmap, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i32, i32, i32, i32)
BATCHINV_TLP_GRAD_LOGITS(bf16, batchinv::Bf16Codec, 128)
// batchinv-signature: token_logprobs_grad_logits_f16_bm64(tmap, tmap, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i32, i32, i32, i32)
BATCHINV_TLP_GRAD_LOGITS(f16, batchinv::F16Codec, 64)
// batchinv-signature: token_logprobs_grad_logits_f16_bm128(tmap, tmap, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i32, i32, i32, i32)
BATCHINV_TLP_GRAD_LOGITS(f16, batchinv::F16Codec, 128)
// batchinv-signature: token_logprobs_accumulate_bf16_bm64(tmap, tmap, ptr, i32, i32, i32)
BATCHINV_TLP_ACCUMULATE(bf16, batchinv::Bf16Codec, 64)
// batchinv-signature: token_logprobs_accumulate_bf16_bm128(tmap, tmap, ptr, i32, i32, i32)
BATCHINV_TLP_ACCUMULATE(bf16, batchinv::Bf16Codec, 128)
// batchinv-signature: token_logprobs_accumulate_f16_bm64(tmap, tmap, ptr, i32, i32, i32)
BATCHINV_TLP_ACCUMULATE(f16, batchinv::F16Codec, 64)
// batchinv-signature: token_logprobs_accumulate_f16_bm128(tmap, tmap, ptr, i32, i32, i32)
BATCHINV_TLP_ACCUMULATE(f16, batchinv::F16Codec, 128)
#endif

// Rotary position embedding, Qwen3 / Hugging Face rotate-half convention; forward and the
// inverse rotation (the backward).
//
// For token t with position p = positions[t], half = head_dim / 2 and j in [0, half):
//   angle = __fmul_rn(float(p), inv_freq[j])       (p < 2^24 converts exactly)
//   c, s  = sincosf(angle)                          (the accurate one: no fast math)
//   out[j]        = x[j] * c - x[j + half] * s
//   out[j + half] = x[j + half] * c + x[j] * s
// for every head of q and of k, each product and sum an explicit IEEE intrinsic, rounded once
// to the storage type.  inverse = 1 (the backward) uses -s: the transpose of the rotation,
// g1 * c + g2 * s and g2 * c - g1 * s bit for bit, since negation and x - (-y) = x + y are
// exact.
//
//   q        [tokens, hq, head_dim]  bf16/fp16/fp32, unit stride along head_dim, strides
//                                    q_token_stride, q_head_stride (elements)
//   k        [tokens, hk, head_dim]  same dtype, strides k_token_stride, k_head_stride
//   q_out, k_out                     contiguous [tokens, h, head_dim], same dtype
//   positions [tokens]               int32 or int64 (one kernel each)
//   inv_freq  [half] fp32            computed on the host exactly like the reference
//   first_bad [1] u64                preset to UINT64_MAX; receives the smallest token whose
//                                    position is outside [0, max_position).  Such tokens'
//                                    outputs are NaN (their angle is never computed).
//   Launch: grid.x = tokens (one CTA per token), block = 128, dynamic shared memory
//   2 * half * 4 bytes (the token's cos and sin table).
//
// Why the bits cannot depend on the batch: there is no reduction.  An output element is the
// function above of its own x pair and of cos/sin of its own token's position, computed by the
// same code in every CTA; which tokens share the launch, the grid size and the load width
// (16-byte vectors when pointers, strides and half * sizeof are multiples of 16, single
// elements otherwise; each element gets the same per-pair arithmetic) do not enter.  The vector
// path rounds bf16 with the hardware conversion, the element path with float_to_bf16: the same
// bits (common/chunk16.cuh).  The per-element arithmetic is common/rotary.cuh's, which
// qk_norm_rope.cu shares.  The positions are absolute, so prefill, chunked prefill and decode
// give a token the same bits.
#include "common/chunk16.cuh"
#include "common/portability.cuh"
#include "common/rotary.cuh"


namespace batchinv {
namespace rope {


constexpr int kThreads = 128;
constexpr int kUnroll = 3;  // 16-byte pairs per thread in flight: 320 units of 32/8 heads in one pass

struct Args {
    void* q_out;
    void* k_out;
    const void* q;
    const void* k;
    const void* positions;
    const float* inv_freq;
    unsigned long long* first_bad;
    int64_t tokens;
    int64_t hq;
    int64_t hk;
    int64_t head_dim;
    int64_t q_token_stride;
    int64_t q_head_stride;
    int64_t k_token_stride;
    int64_t k_head_stride;
    int64_t max_position;
    int32_t inverse;
};

// The source and destination of head `head` (q heads first, then k heads) of this token.
template <typename S>
__device__ __forceinline__ void head_pointers(const Args& a, int64_t token, int64_t head, const S*& src,
                                              S*& dst) {
    if (head < a.hq) {
        src = static_cast<const S*>(a.q) + token * a.q_token_stride + head * a.q_head_stride;
        dst = static_cast<S*>(a.q_out) + (token * a.hq + head) * a.head_dim;
    } else {
        const int64_t kh = head - a.hq;
        src = static_cast<const S*>(a.k) + token * a.k_token_stride + kh * a.k_head_stride;
        dst = static_cast<S*>(a.k_out) + (token * a.hk + kh) * a.head_dim;
    }
}

template <typename Codec, typename Index>
__device__ __forceinline__ void rope_token(const Args& a) {
    using S = typename Codec::storage;
    constexpr int E = Chunk16<Codec>::kElems;
    extern __shared__ float table[];  // cos[half], then sin[half]
    const int64_t token = blockIdx.x;
    if (token >= a.tokens) return;
    const int64_t half = a.head_dim / 2;
    const int64_t heads = a.hq + a.hk;
    const int64_t position = static_cast<int64_t>(static_cast<const Index*>(a.positions)[token]);
    if (position < 0 || position >= a.max_position) {
        if (threadIdx.x == 0) atomicMin(a.first_bad, static_cast<unsigned long long>(token));
        const S nan = Codec::store(__int_as_float(0x7fc00000));
        for (int64_t i = threadIdx.x; i < heads * a.head_dim; i += kThreads) {
            const int64_t head = i / a.head_dim;
            const S* src;
            S* dst;
            head_pointers(a, token, head, src, dst);
            dst[i - head * a.head_dim] = nan;
        }
        return;
    }
    float* cos_table = table;
    float* sin_table = table + half;
    fill_rotation_table<kThreads>(cos_table, sin_table, position, a.inv_freq, half, a.inverse);
    __syncthreads();

    const bool vector = (half % E) == 0 && aligned16(a.q) && aligned16(a.k) && aligned16(a.q_out) &&
                        aligned16(a.k_out) && stride_aligned16<S>(a.q_token_stride) &&
                        stride_aligned16<S>(a.q_head_stride) && stride_aligned16<S>(a.k_token_stride) &&
                        stride_aligned16<S>(a.k_head_stride);
    if (vector) {
        // int indices: heads * half / E is far below 2^31 (half <= 6144, a CTA's table).
        const int units_per_head = static_cast<int>(half / E);
        const int units = static_cast<int>(heads) * units_per_head;
        for (int base = threadIdx.x; base < units; base += kThreads * kUnroll) {
            Chunk16<Codec> x1[kUnroll], x2[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                const int unit = base + u * kThreads;
                if (unit >= units) continue;
                const int head = unit / units_per_head;
                const int j = (unit - head * units_per_head) * E;
                const S* src;
                S* dst;
                head_pointers(a, token, head, src, dst);
                load_chunk(x1[u], src + j);
                load_chunk(x2[u], src + half + j);
            }
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                const int unit = base + u * kThreads;
                if (unit >= units) continue;
                const int head = unit / units_per_head;
                const int j = (unit - head * units_per_head) * E;
                const S* src;
                S* dst;
                head_pointers(a, token, head, src, dst);
                float o1[E], o2[E];
#pragma unroll
                for (int e = 0; e < E; ++e) {
                    const float v1 = Codec::load(x1[u].v[e]);
                    const float v2 = Codec::load(x2[u].v[e]);
                    const float c = cos_table[j + e];
                    const float s = sin_table[j + e];
                    o1[e] = rotate_first(v1, v2, c, s);
                    o2[e] = rotate_second(v1, v2, c, s);
                }
                store_chunk<Codec>(dst + j, o1);
                store_chunk<Codec>(dst + half + j, o2);
            }
        }
    } else {
        const int64_t units = heads * half;
        for (int64_t unit = threadIdx.x; unit < units; unit += kThreads) {
            const int64_t head = unit / half;
            const int64_t j = unit - head * half;
            const S* src;
            S* dst;
            head_pointers(a, token, head, src, dst);
            const float v1 = Codec::load(src[j]);
            const float v2 = Codec::load(src[half + j]);
            dst[j] = Codec::store(rotate_first(v1, v2, cos_table[j], sin_table[j]));
            dst[half + j] = Codec::store(rotate_second(v1, v2, cos_table[j], sin_table[j]));
        }
    }
}

}  // namespace rope
}  // namespace batchinv

#define BATCHINV_ROPE_KERNEL(SUFFIX, CODEC, INDEX)                                                \
    extern "C" __global__ void __launch_bounds__(batchinv::rope::kThreads) rope_##SUFFIX(       \
        CODEC::storage* q_out, CODEC::storage* k_out, const CODEC::storage* q,                   \
        const CODEC::storage* k, const INDEX* positions, const float* inv_freq,                  \
        unsigned long long* first_bad, int64_t tokens, int64_t hq, int64_t hk, int64_t head_dim,  \
        int64_t q_token_stride, int64_t q_head_stride, int64_t k_token_stride,                   \
        int64_t k_head_stride, int64_t max_position, int32_t inverse) {                          \
        const batchinv::rope::Args args{q_out,          k_out,          q,              k,       \
                                        positions,      inv_freq,       first_bad,      tokens,  \
                                        hq,             hk,             head_dim,       q_token_stride, \
                                        q_head_stride,  k_token_stride, k_head_stride,  max_position, \
                                        inverse};                                                \
        batchinv::rope::rope_token<CODEC, INDEX>(args);                                          \
    }

BATCHINV_ROPE_KERNEL(bf16_i32, batchinv::Bf16Codec, int32_t)
BATCHINV_ROPE_KERNEL(bf16_i64, batchinv::Bf16Codec, int64_t)
BATCHINV_ROPE_KERNEL(f16_i32, batchinv::F16Codec, int32_t)
BATCHINV_ROPE_KERNEL(f16_i64, batchinv::F16Codec, int64_t)
BATCHINV_ROPE_KERNEL(f32_i32, batchinv::F32Codec, int32_t)
BATCHINV_ROPE_KERNEL(f32_i64, batchinv::F32Codec, int64_t)

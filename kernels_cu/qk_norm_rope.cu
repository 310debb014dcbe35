// The per-head q/k RMSNorm, the rotary embedding and the KV-cache append of one decode (or
// prefill) step in one launch, with the bits of rms_norm.cu followed by rope.cu and a copy:
//
//   q_out[t, h]         = rope(rms_norm(q[t, h, :], q_weight), positions[t])
//   k_cache[rows[t], h] = rope(rms_norm(k[t, h, :], k_weight), positions[t])
//   v_cache[rows[t], h] = v[t, h, :]
//
// rms_norm is the forward of rms_norm.cu for rows of head_dim elements in the geometry the host
// passes (t4 or t16: T threads per row, kChunksPerThread 16-byte chunks per thread, the
// geometry rms_norm.cu's host picks for that head_dim and dtype), through common/rms_row.cuh's
// steps: a thread's squares in element order, the row group's butterfly, inv_rms, then
// (h * inv_rms) * weight rounded once to the storage type.  rope reads that rounded value and
// rotates it with common/rotary.cuh's table and products, rounded once.  So each output has the
// bits of rms_norm then rope, by construction.
//
//   q            [tokens, hq, head_dim]  bf16/fp16/fp32, unit stride along head_dim, strides
//                                        q_token_stride, q_head_stride (elements)
//   k, v         [tokens, hk, head_dim]  same dtype, strides k_* and v_*
//   q_weight, k_weight [head_dim]        same dtype, contiguous
//   q_out        [tokens, hq, head_dim]  contiguous
//   k_cache, v_cache [storage rows, hk, head_dim] contiguous (one layer of a StaticKVCache)
//   rows         [tokens] int64          the storage row of each token's key and value (the
//                                        step's plan: a failed step's rows are all the scratch
//                                        row, so it writes nothing a slot owns)
//   positions    [tokens] int32 or int64 (one kernel each)
//   inv_freq     [head_dim / 2] fp32     rope's, computed on the host
//   first_bad    [1] u64 or null         receives the smallest token whose position is outside
//                                        [0, max_position), as rope.cu's; such a token's q and
//                                        k heads are NaN (rope's output for it), v is copied
//   Launch: grid.x = tokens (one CTA per token), block = kThreads, dynamic shared memory
//   2 * (head_dim / 2) * 4 bytes (the token's cos and sin table).
//
// Why the bits cannot depend on the batch: a head's norm is one row reduced by a tree fixed by
// head_dim and the dtype (the geometry), its rotation is elementwise in the head and the token's
// own position, and the copy is a copy.  Which tokens share the launch, the grid size, which
// pass of a CTA a head falls in and the load width (16-byte vectors when every pointer and
// stride allows, single elements otherwise: the same per-element arithmetic) do not enter.
#include "common/chunk16.cuh"
#include "common/portability.cuh"
#include "common/rms_row.cuh"
#include "common/rotary.cuh"


namespace batchinv {
namespace qk_norm_rope {


constexpr int kThreads = 128;
constexpr int kChunksPerThread = 4;  // K of rms_norm.cu's t4 and t16 geometries

struct Args {
    void* q_out;
    void* k_cache;
    void* v_cache;
    const void* q;
    const void* k;
    const void* v;
    const void* q_weight;
    const void* k_weight;
    const void* positions;
    const int64_t* rows;
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
    int64_t v_token_stride;
    int64_t v_head_stride;
    int64_t max_position;
    float eps;
};

// Head `head` of this token (q heads first, then k heads): its input row, norm weight and
// destination (q_out, or the token's storage row of k_cache).
template <typename S>
__device__ __forceinline__ void head_pointers(const Args& a, int64_t token, int64_t row, int64_t head,
                                              const S*& src, const S*& weight, S*& dst) {
    if (head < a.hq) {
        src = static_cast<const S*>(a.q) + token * a.q_token_stride + head * a.q_head_stride;
        weight = static_cast<const S*>(a.q_weight);
        dst = static_cast<S*>(a.q_out) + (token * a.hq + head) * a.head_dim;
    } else {
        const int64_t kh = head - a.hq;
        src = static_cast<const S*>(a.k) + token * a.k_token_stride + kh * a.k_head_stride;
        weight = static_cast<const S*>(a.k_weight);
        dst = static_cast<S*>(a.k_cache) + (row * a.hk + kh) * a.head_dim;
    }
}

// v[token] into its storage row, as it is.
template <typename S>
__device__ __forceinline__ void copy_values(const Args& a, int64_t token, int64_t row) {
    constexpr int E = 16 / static_cast<int>(sizeof(S));
    const int64_t d = a.head_dim;
    const S* v = static_cast<const S*>(a.v) + token * a.v_token_stride;
    S* out = static_cast<S*>(a.v_cache) + row * a.hk * d;
    const bool vector = d % E == 0 && aligned16(a.v) && aligned16(a.v_cache) &&
                        stride_aligned16<S>(a.v_token_stride) && stride_aligned16<S>(a.v_head_stride);
    if (vector) {
        const int64_t per_head = d / E;
        for (int64_t unit = threadIdx.x; unit < a.hk * per_head; unit += kThreads) {
            const int64_t head = unit / per_head;
            const int64_t first = (unit - head * per_head) * E;
            *reinterpret_cast<uint4*>(out + head * d + first) =
                *reinterpret_cast<const uint4*>(v + head * a.v_head_stride + first);
        }
    } else {
        for (int64_t i = threadIdx.x; i < a.hk * d; i += kThreads) {
            const int64_t head = i / d;
            out[i] = v[head * a.v_head_stride + (i - head * d)];
        }
    }
}

template <typename Codec, typename Index, int T>
__device__ __forceinline__ void token_kernel(const Args& a) {
    using S = typename Codec::storage;
    using Chunk = rms::Chunk<Codec>;
    constexpr int E = Chunk::kElems;
    constexpr int K = kChunksPerThread;
    constexpr int kGroups = kThreads / T;  // heads normed at once, one per row group
    // The normed heads of a pass, rounded: group g's row in chunks [g * T * K, (g + 1) * T * K).
    __shared__ Chunk normed[kThreads * K];
    extern __shared__ float table[];  // cos[half], then sin[half]
    const int64_t token = blockIdx.x;
    if (token >= a.tokens) return;
    const int64_t d = a.head_dim;
    const int64_t half = d / 2;
    const int64_t heads = a.hq + a.hk;
    const int64_t row = a.rows[token];
    copy_values<S>(a, token, row);
    const int64_t position = static_cast<int64_t>(static_cast<const Index*>(a.positions)[token]);
    if (position < 0 || position >= a.max_position) {
        if (threadIdx.x == 0 && a.first_bad != nullptr) {
            atomicMin(a.first_bad, static_cast<unsigned long long>(token));
        }
        const S nan = Codec::store(__int_as_float(0x7fc00000));
        for (int64_t i = threadIdx.x; i < heads * d; i += kThreads) {
            const int64_t head = i / d;
            const S* src;
            const S* weight;
            S* dst;
            head_pointers(a, token, row, head, src, weight, dst);
            dst[i - head * d] = nan;
        }
        return;
    }
    float* cos_table = table;
    float* sin_table = table + half;
    rope::fill_rotation_table<kThreads>(cos_table, sin_table, position, a.inv_freq, half, 0);

    const int64_t chunks = (d + E - 1) / E;
    const int lane = threadIdx.x % T;
    const int group = threadIdx.x / T;
    const bool vector = aligned16(a.q) && aligned16(a.k) && aligned16(a.q_weight) &&
                        aligned16(a.k_weight) && stride_aligned16<S>(a.q_token_stride) &&
                        stride_aligned16<S>(a.q_head_stride) && stride_aligned16<S>(a.k_token_stride) &&
                        stride_aligned16<S>(a.k_head_stride) && stride_aligned16<S>(d);
    // Rotated chunks go out as 16-byte vectors when every head's halves start on 16 bytes.
    const bool pairs_vector = half % E == 0 && aligned16(a.q_out) && aligned16(a.k_cache);
    Chunk* mine = normed + group * T * K;
    for (int64_t base = 0; base < heads; base += kGroups) {
        // rms_norm.cu's forward_rows_resident for row `head`: the same loads, sums and tree.
        const int64_t head = base + group;
        const bool active = head < heads;
        const S* src;
        const S* weight;
        S* dst;
        head_pointers(a, token, row, active ? head : 0, src, weight, dst);
        Chunk h[K], w[K];
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int64_t c = lane + static_cast<int64_t>(k) * T;
            if (active && c < chunks) rms::load_chunk(h[k], src, c, d, vector);
        }
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int64_t c = lane + static_cast<int64_t>(k) * T;
            if (c < chunks) rms::load_chunk(w[k], weight, c, d, vector);
        }
        float sum_sq = 0.0f;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int64_t c = lane + static_cast<int64_t>(k) * T;
            if (!(active && c < chunks)) continue;
            sum_sq = rms::add_row_squares(sum_sq, h[k], c, d);
        }
        const float inv_rms = rms::inv_rms_of(rms::row_group_sum<T>(sum_sq, nullptr), d, a.eps);
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int64_t c = lane + static_cast<int64_t>(k) * T;
            if (active && c < chunks) rms::normed_chunk(mine[c], h[k], w[k], inv_rms);
        }
        __syncthreads();  // the normed heads (and, in the first pass, the cos/sin table)

        // rope.cu's rotation of the pass's heads, reading the rounded normed values.
        const int64_t pass_heads = heads - base < kGroups ? heads - base : kGroups;
        if (half % E == 0) {
            const int64_t half_chunks = half / E;
            for (int64_t unit = threadIdx.x; unit < pass_heads * half_chunks; unit += kThreads) {
                const int64_t g = unit / half_chunks;
                const int64_t jc = unit - g * half_chunks;
                head_pointers(a, token, row, base + g, src, weight, dst);
                const Chunk& x1 = normed[g * T * K + jc];
                const Chunk& x2 = normed[g * T * K + jc + half_chunks];
                float o1[E], o2[E];
#pragma unroll
                for (int e = 0; e < E; ++e) {
                    const float v1 = Codec::load(x1.v[e]);
                    const float v2 = Codec::load(x2.v[e]);
                    const float c = cos_table[jc * E + e];
                    const float s = sin_table[jc * E + e];
                    o1[e] = rope::rotate_first(v1, v2, c, s);
                    o2[e] = rope::rotate_second(v1, v2, c, s);
                }
                if (pairs_vector) {
                    store_chunk<Codec>(dst + jc * E, o1);
                    store_chunk<Codec>(dst + half + jc * E, o2);
                } else {
#pragma unroll
                    for (int e = 0; e < E; ++e) {
                        dst[jc * E + e] = Codec::store(o1[e]);
                        dst[half + jc * E + e] = Codec::store(o2[e]);
                    }
                }
            }
        } else {
            const S* flat = reinterpret_cast<const S*>(normed);
            for (int64_t unit = threadIdx.x; unit < pass_heads * half; unit += kThreads) {
                const int64_t g = unit / half;
                const int64_t j = unit - g * half;
                head_pointers(a, token, row, base + g, src, weight, dst);
                const float v1 = Codec::load(flat[g * T * K * E + j]);
                const float v2 = Codec::load(flat[g * T * K * E + half + j]);
                dst[j] = Codec::store(rope::rotate_first(v1, v2, cos_table[j], sin_table[j]));
                dst[half + j] = Codec::store(rope::rotate_second(v1, v2, cos_table[j], sin_table[j]));
            }
        }
        __syncthreads();  // the next pass overwrites the normed heads
    }
}

}  // namespace qk_norm_rope
}  // namespace batchinv

#define BATCHINV_QK_NORM_ROPE_KERNEL(SUFFIX, CODEC, GEOMETRY, T, INDEX_SUFFIX, INDEX)              \
    extern "C" __global__ void __launch_bounds__(batchinv::qk_norm_rope::kThreads)                 \
        qk_norm_rope_##SUFFIX##_##GEOMETRY##_##INDEX_SUFFIX(                                      \
            CODEC::storage* q_out, CODEC::storage* k_cache, CODEC::storage* v_cache,              \
            const CODEC::storage* q, const CODEC::storage* k, const CODEC::storage* v,            \
            const CODEC::storage* q_weight, const CODEC::storage* k_weight, const INDEX* positions, \
            const int64_t* rows, const float* inv_freq, unsigned long long* first_bad,            \
            int64_t tokens, int64_t hq, int64_t hk, int64_t head_dim, int64_t q_token_stride,     \
            int64_t q_head_stride, int64_t k_token_stride, int64_t k_head_stride,                 \
            int64_t v_token_stride, int64_t v_head_stride, int64_t max_position, float eps) {     \
        const batchinv::qk_norm_rope::Args args{                                                  \
            q_out,          k_cache,       v_cache,        q,              k,                     \
            v,              q_weight,      k_weight,       positions,      rows,                  \
            inv_freq,       first_bad,     tokens,         hq,             hk,                    \
            head_dim,       q_token_stride, q_head_stride, k_token_stride, k_head_stride,         \
            v_token_stride, v_head_stride, max_position,   eps};                                  \
        batchinv::qk_norm_rope::token_kernel<CODEC, INDEX, T>(args);                              \
    }

// The geometries of rms_norm.cu's forward that a head of at most MAX_HEAD_DIM (256) elements
// takes: t4 (up to 16 chunks) and t16 (up to 64).  Keep in step with GEOMETRIES in
// py/batchinv/gpu/qk_norm_rope.py.
#define BATCHINV_QK_NORM_ROPE_KERNELS(SUFFIX, CODEC)                                 \
    BATCHINV_QK_NORM_ROPE_KERNEL(SUFFIX, CODEC, t4, 4, i32, int32_t)                 \
    BATCHINV_QK_NORM_ROPE_KERNEL(SUFFIX, CODEC, t4, 4, i64, int64_t)                 \
    BATCHINV_QK_NORM_ROPE_KERNEL(SUFFIX, CODEC, t16, 16, i32, int32_t)               \
    BATCHINV_QK_NORM_ROPE_KERNEL(SUFFIX, CODEC, t16, 16, i64, int64_t)

BATCHINV_QK_NORM_ROPE_KERNELS(bf16, batchinv::Bf16Codec)
BATCHINV_QK_NORM_ROPE_KERNELS(f16, batchinv::F16Codec)
BATCHINV_QK_NORM_ROPE_KERNELS(f32, batchinv::F32Codec)

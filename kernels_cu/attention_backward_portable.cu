// Attention backward from portable pieces: HIP's gradients of attention and attention_varlen,
// and the same kernels in the CUDA build so an NVIDIA GPU runs HIP's arithmetic.  No tensor
// cores, matrix cores, async copies, atomics or cross-lane operations: nothing depends on the
// wavefront width (32 or 64 lanes).
//
// Layout (attention_backward.cu's canonical layout, all contiguous, one dtype: bf16 or fp16):
//   q, out, dout, dq  [Tq, Hq, D]    D <= 128; Hq % Hkv == 0, G = Hq / Hkv
//   k, v, dk, dv      [Tk, Hkv, D]
//   lse, delta        [Hq, Tq] fp32; lse = the forward's natural-log sum-exp of the scaled scores
//   q_start, q_len, k_start, k_len  int32 [B]
// Query i < q_len[b] of sequence b is row q_start[b] + i at position p = k_len[b] - q_len[b] + i;
// its keys are rows k_start[b] + j, j < k_len[b] (causal: j <= p).  q head h reads kv head h / G.
// Rows covered by no sequence are never read or written (the host zero-fills dq, dk, dv).
//
// Formula (fp32; each step an explicit IEEE operation or fmaf, contraction off under HIP):
//   delta[h, r] = sum over d in increasing order of dout[r, h, d] * out[r, h, d]
//   s   = one fmaf chain over d in increasing order of q[d] * k[d]
//   dp  = one fmaf chain over d in increasing order of dout[d] * v[d]
//   p   = expf(s * scale - lse)   on the row's visible keys; 0 when lse = -inf
//   ds  = p * (dp - delta)
//   p and ds are rounded to the input dtype (as the mma kernels feed them to their products),
//   then, each one fmaf chain in a fixed order:
//   dq[i] = (sum over visible keys j in increasing order of ds_ij * k_j) * scale
//   dv[j] =  sum over heads of the group in increasing order, then over the queries that see
//            key j in increasing order, of p_ij * dout_i
//   dk[j] = (the same walk of ds_ij * q_i) * scale
//
// Kernels (block kThreads = 128 threads; thread t owns output column t, t < D):
//   attn_bwd_portable_delta_*: grid (ceil(max_q_len / 128), Hq, B); thread t the row 128 x + t.
//   attn_bwd_portable_dq_*:    grid (max_q_len, Hq, B); one CTA per (query row, head).  Per
//     block of 128 keys, thread t computes ds of key 128 blk + t into shared memory, then each
//     column thread adds the block's keys in increasing order to its running sum.
//   attn_bwd_portable_dkdv_*:  grid (max_k_len, Hkv, B); one CTA per (key, kv head).  Per head
//     of the group and block of 128 queries (from the first query that sees the key), thread t
//     computes p and ds of one query into shared memory, then each column thread adds the
//     block's queries in increasing order to its dk and dv sums.
//
// Invariance contract: each output element is written by exactly one thread of one CTA, no
// atomics, no partial sums; its chain of operations depends on its sequence's lengths and rows
// and on D only.  The blocks of 128 only decide which thread computes a score; the sums run one
// element after another in increasing key or query order, so nothing about the batch, max_q_len,
// max_k_len, the grid or the rows around the sequence changes a bit, and two runs give the same
// bits.  Not attention_backward.cu's bits (its sums are mma k16 chains), and HIP's need not be
// these (expf comes from ROCm's ocml there).
#include "common/portability.cuh"

namespace batchinv {
namespace attn_bwd_portable {

constexpr int kThreads = 128;  // keys or queries per block; output columns (D <= kThreads)
constexpr float kNegInf = -__builtin_huge_valf();

struct Params {
    const void* q;
    const void* k;
    const void* v;
    const void* out;
    const void* dout;
    const float* lse;
    float* delta;
    const int* q_start;
    const int* q_len;
    const int* k_start;
    const int* k_len;
    void* dq;
    void* dk;
    void* dv;
    int64_t tq;
    int hq, hkv, d, causal;
    float scale;
};

// The value an operand has after rounding to the input dtype.
template <typename Codec>
__device__ __forceinline__ float rounded(float value) {
    return Codec::load(Codec::store(value));
}

// A row's d elements dotted with an fp32 row in shared memory: one fmaf chain in increasing d.
template <typename Codec>
__device__ __forceinline__ float dot(const float* shared_row, const typename Codec::storage* row, int d) {
    float sum = 0.0f;
    for (int c = 0; c < d; ++c) sum = __fmaf_rn(shared_row[c], Codec::load(row[c]), sum);
    return sum;
}

// p and ds of one (query, key) pair from its two dot products (the one formula of both kernels).
__device__ __forceinline__ void probability_and_grad(float s, float dp, float lse, float delta, float scale,
                                                     float& p, float& ds) {
    p = lse == kNegInf ? 0.0f : expf(ieee_sub(ieee_mul(s, scale), lse));
    ds = ieee_mul(p, ieee_sub(dp, delta));
}

template <typename Codec>
__device__ __forceinline__ void delta_rows(const Params& p) {
    using T = typename Codec::storage;
    const int b = blockIdx.z;
    const int h = blockIdx.y;
    const int i = blockIdx.x * kThreads + threadIdx.x;
    if (i >= p.q_len[b]) return;
    const int64_t row = static_cast<int64_t>(p.q_start[b]) + i;
    const int64_t at = (row * p.hq + h) * p.d;
    const T* o = static_cast<const T*>(p.out) + at;
    const T* g = static_cast<const T*>(p.dout) + at;
    float sum = 0.0f;
    for (int c = 0; c < p.d; ++c) sum = ieee_add(sum, ieee_mul(Codec::load(g[c]), Codec::load(o[c])));
    p.delta[h * p.tq + row] = sum;
}

template <typename Codec>
__device__ __forceinline__ void dq_row(const Params& p) {
    using T = typename Codec::storage;
    __shared__ float q_row[kThreads];
    __shared__ float dout_row[kThreads];
    __shared__ float ds_block[kThreads];
    const int t = threadIdx.x;
    const int b = blockIdx.z;
    const int h = blockIdx.y;
    const int qi = blockIdx.x;
    const int q_len = p.q_len[b];
    if (qi >= q_len) return;
    const int k_len = p.k_len[b];
    const int position = k_len - q_len + qi;
    const int kvh = h / (p.hq / p.hkv);
    const int64_t row = static_cast<int64_t>(p.q_start[b]) + qi;
    const int64_t q_at = (row * p.hq + h) * p.d;
    const float lse = p.lse[h * p.tq + row];
    const float delta = p.delta[h * p.tq + row];
    // A row with lse = -inf sees no key (its p is 0 everywhere): its dq stays 0.
    const int visible = lse == kNegInf ? 0 : (p.causal ? max(0, min(k_len, position + 1)) : k_len);
    const int64_t kv_row = static_cast<int64_t>(p.hkv) * p.d;
    const T* kp = static_cast<const T*>(p.k) + static_cast<int64_t>(p.k_start[b]) * kv_row + kvh * p.d;
    const T* vp = static_cast<const T*>(p.v) + static_cast<int64_t>(p.k_start[b]) * kv_row + kvh * p.d;
    if (t < p.d) {
        q_row[t] = Codec::load(static_cast<const T*>(p.q)[q_at + t]);
        dout_row[t] = Codec::load(static_cast<const T*>(p.dout)[q_at + t]);
    }
    __syncthreads();

    float acc = 0.0f;
    for (int key0 = 0; key0 < visible; key0 += kThreads) {
        const int key = key0 + t;
        if (key < visible) {
            const float s = dot<Codec>(q_row, kp + key * kv_row, p.d);
            const float dp = dot<Codec>(dout_row, vp + key * kv_row, p.d);
            float prob, ds;
            probability_and_grad(s, dp, lse, delta, p.scale, prob, ds);
            ds_block[t] = rounded<Codec>(ds);
        }
        __syncthreads();
        if (t < p.d) {
            const int keys = min(kThreads, visible - key0);
            const T* kr = kp + key0 * kv_row + t;
            for (int j = 0; j < keys; ++j) acc = __fmaf_rn(ds_block[j], Codec::load(kr[j * kv_row]), acc);
        }
        __syncthreads();  // every column has read the block before the next one is written
    }
    if (t < p.d) static_cast<T*>(p.dq)[q_at + t] = Codec::store(ieee_mul(acc, p.scale));
}

template <typename Codec>
__device__ __forceinline__ void dkdv_key(const Params& p) {
    using T = typename Codec::storage;
    __shared__ float k_row[kThreads];
    __shared__ float v_row[kThreads];
    __shared__ float p_block[kThreads];
    __shared__ float ds_block[kThreads];
    const int t = threadIdx.x;
    const int b = blockIdx.z;
    const int kvh = blockIdx.y;
    const int kj = blockIdx.x;
    const int k_len = p.k_len[b];
    if (kj >= k_len) return;
    const int q_len = p.q_len[b];
    const int group = p.hq / p.hkv;
    // The first query that sees key kj: its position k_len - q_len + i reaches kj (causal).
    const int first = p.causal ? max(0, kj - (k_len - q_len)) : 0;
    const int64_t key_row = static_cast<int64_t>(p.k_start[b]) + kj;
    const int64_t kv_at = (key_row * p.hkv + kvh) * p.d;
    const int64_t q_row_stride = static_cast<int64_t>(p.hq) * p.d;
    const int64_t q_start = p.q_start[b];
    if (t < p.d) {
        k_row[t] = Codec::load(static_cast<const T*>(p.k)[kv_at + t]);
        v_row[t] = Codec::load(static_cast<const T*>(p.v)[kv_at + t]);
    }
    __syncthreads();

    float dk = 0.0f, dv = 0.0f;
    for (int g = 0; g < group; ++g) {
        const int h = kvh * group + g;
        const T* qp = static_cast<const T*>(p.q) + q_start * q_row_stride + h * p.d;
        const T* gp = static_cast<const T*>(p.dout) + q_start * q_row_stride + h * p.d;
        const float* lse = p.lse + h * p.tq + q_start;
        const float* delta = p.delta + h * p.tq + q_start;
        for (int i0 = first; i0 < q_len; i0 += kThreads) {
            const int i = i0 + t;
            if (i < q_len) {
                const float s = dot<Codec>(k_row, qp + i * q_row_stride, p.d);
                const float dp = dot<Codec>(v_row, gp + i * q_row_stride, p.d);
                float prob, ds;
                probability_and_grad(s, dp, lse[i], delta[i], p.scale, prob, ds);
                p_block[t] = rounded<Codec>(prob);
                ds_block[t] = rounded<Codec>(ds);
            }
            __syncthreads();
            if (t < p.d) {
                const int rows = min(kThreads, q_len - i0);
                const T* qr = qp + i0 * q_row_stride + t;
                const T* gr = gp + i0 * q_row_stride + t;
                for (int r = 0; r < rows; ++r) {
                    dv = __fmaf_rn(p_block[r], Codec::load(gr[r * q_row_stride]), dv);
                    dk = __fmaf_rn(ds_block[r], Codec::load(qr[r * q_row_stride]), dk);
                }
            }
            __syncthreads();  // every column has read the block before the next one is written
        }
    }
    if (t < p.d) {
        static_cast<T*>(p.dv)[kv_at + t] = Codec::store(dv);
        static_cast<T*>(p.dk)[kv_at + t] = Codec::store(ieee_mul(dk, p.scale));
    }
}

}  // namespace attn_bwd_portable
}  // namespace batchinv

// Every kernel takes the same arguments (the host passes one list to the three launches).
#define BATCHINV_ATTN_BWD_PORTABLE_KERNEL(NAME, DTYPE, CODEC, BODY)                                               \
    extern "C" __global__ void __launch_bounds__(128) attn_bwd_portable_##NAME##_##DTYPE(                         \
        const void* q, const void* k, const void* v, const void* out, const void* dout, const float* lse,         \
        float* delta, const int* q_start, const int* q_len, const int* k_start, const int* k_len, void* dq,       \
        void* dk, void* dv, long long tq, int hq, int hkv, int d, int causal, float scale) {                       \
        const batchinv::attn_bwd_portable::Params p{q,     k,       v,     out, dout, lse, delta, q_start,      \
                                                    q_len, k_start, k_len, dq,  dk,   dv,  tq,    hq,           \
                                                    hkv,   d,       causal, scale};                             \
        batchinv::attn_bwd_portable::BODY<CODEC>(p);                                                              \
    }

#define BATCHINV_ATTN_BWD_PORTABLE(DTYPE, CODEC)                               \
    BATCHINV_ATTN_BWD_PORTABLE_KERNEL(delta, DTYPE, CODEC, delta_rows)         \
    BATCHINV_ATTN_BWD_PORTABLE_KERNEL(dq, DTYPE, CODEC, dq_row)                \
    BATCHINV_ATTN_BWD_PORTABLE_KERNEL(dkdv, DTYPE, CODEC, dkdv_key)

BATCHINV_ATTN_BWD_PORTABLE(bf16, batchinv::Bf16Codec)
BATCHINV_ATTN_BWD_PORTABLE(f16, batchinv::F16Codec)

// Attention forward from portable pieces: HIP's attention (padded, varlen and KV-cache calls,
// all reduced by the host to attention.cu's canonical layout), and the same kernel in the CUDA
// build so an NVIDIA GPU runs HIP's arithmetic.  No tensor cores, matrix cores, async copies or
// cross-lane operations: nothing depends on the wavefront width (32 or 64 lanes).
//
//   q    [Tq rows, Hq, D]   bf16/fp16, unit stride along D, strides q_row/q_head
//   k, v [Tk rows, Hkv, D]  same dtype, strides k_row/k_head, v_row/v_head
//   out  [Tq, Hq, D]        strides out_row/out_head;  lse [Hq, Tq] fp32, natural log
//   q_start, q_len, k_start, k_len  int32 [B]: attention.cu's canonical layout (query i <
//   q_len[b] is row q_start[b] + i at position k_len[b] - q_len[b] + i, its keys rows
//   k_start[b] + j, j < k_len[b], causal: j <= position).  Rows covered by no sequence are not
//   written (the host pre-fills out = 0, lse = -inf where there are such rows).
//
// Grid (max q_len, Hq, B); block kBlockKeys = 128 threads; D <= 128.  One CTA computes one
// (query row, head): thread t owns key t of each block and output column t.
//
// Per-row arithmetic (attention.cu's structure with its shared definitions,
// common/attention_rows.cuh: kBlockKeys = 128-key blocks and kSplitKeys = 2048-key splits at
// ABSOLUTE key positions, scaled_block_max, p_of_score (exp2_ftz), merge_weights/merge_value,
// finalize_out/finalize_lse; c = scale_log2 > 0):
//   1. Each split is reduced from the empty state by an online softmax over its blocks in
//      increasing order.  s_j = q . k_j is one fp32 FMA chain over d in increasing order
//      (keys at or past the row's visible end are -inf).  The block max is scanned over the
//      block's keys (any order gives the same max) and scaled once; m_new, alpha = exp2f(m -
//      m_new) (0 from the empty state), P_j = p_of_score(s_j); the block sum of P is one chain
//      over the block's keys in increasing order, l = l * alpha + sum; acc_d = acc_d * alpha,
//      then one FMA chain over the visible keys in increasing order of (P_j rounded to the
//      input dtype, as the mma kernels feed P to their P V product) times v_j[d].  A block
//      with no finite score (all NaN) leaves the state unchanged.
//   2. The splits' states are merged left to right (merge_weights/merge_value).
//   3. out = finalize_out(acc, l) rounded once to the input dtype; lse = finalize_lse(m, l).
// Every fp32 step is an explicit _rn intrinsic or a contract-off IEEE operation.  A row's
// chain reads only its own query, its sequence's keys and values, and the layout; the rows
// beside it, the batch and the grid change nothing in its bits.  The bits are not attention.cu's
// (whose S and P V are mma k16 chains and whose block sums are quad trees), and HIP's need not
// be these (exp2_ftz is each vendor's hardware approximation; exp2f and log2f come from ROCm's
// ocml there).
#include "common/attention_rows.cuh"

namespace batchinv {
namespace attn_portable {

using attn::kBlockKeys;
using attn::kNegInf;
using attn::kSplitKeys;

struct Params {
    const void* q;
    const void* k;
    const void* v;
    void* out;
    float* lse;
    const int* q_start;
    const int* q_len;
    const int* k_start;
    const int* k_len;
    int64_t q_row, q_head, k_row, k_head, v_row, v_head, out_row, out_head;
    int tq, hq, hkv, d, causal;
    float scale_log2;
};

template <typename Codec>
__device__ __forceinline__ void attention_row(const Params& p) {
    using T = typename Codec::storage;
    __shared__ float q_row[kBlockKeys];   // the query row in fp32 (D <= kBlockKeys)
    __shared__ float block[kBlockKeys];   // the block's scores, then its P
    const int t = threadIdx.x;
    const int b = blockIdx.z;
    const int h = blockIdx.y;
    const int qi = blockIdx.x;
    const int q_len = p.q_len[b];
    if (qi >= q_len) return;
    const int k_len = p.k_len[b];
    const int position = k_len - q_len + qi;
    const int visible = p.causal ? max(0, min(k_len, position + 1)) : k_len;
    const int kvh = h / (p.hq / p.hkv);
    const int64_t row = static_cast<int64_t>(p.q_start[b]) + qi;
    const int64_t k_base = p.k_start[b];
    const T* qp = static_cast<const T*>(p.q);
    const T* kp = static_cast<const T*>(p.k) + kvh * p.k_head;
    const T* vp = static_cast<const T*>(p.v) + kvh * p.v_head;
    if (t < p.d) q_row[t] = Codec::load(qp[row * p.q_row + h * p.q_head + t]);
    __syncthreads();

    // The running merge of the splits so far, and the current split's state (every thread
    // holds the same m, l; thread t < d its acc column).
    float run_m = kNegInf, run_l = 0.0f, run_acc = 0.0f;
    const int blocks = (visible + kBlockKeys - 1) / kBlockKeys;
    for (int split_begin = 0; split_begin < blocks; split_begin += kSplitKeys / kBlockKeys) {
        const int split_end = min(split_begin + kSplitKeys / kBlockKeys, blocks);
        float m = kNegInf, l = 0.0f, acc = 0.0f;
        for (int blk = split_begin; blk < split_end; ++blk) {
            const int key = blk * kBlockKeys + t;
            float s = kNegInf;
            if (key < visible) {
                const T* kr = kp + (k_base + key) * p.k_row;
                s = 0.0f;
                for (int d = 0; d < p.d; ++d) s = __fmaf_rn(q_row[d], Codec::load(kr[d]), s);
            }
            block[t] = s;
            __syncthreads();
            float mx = kNegInf;
            for (int j = 0; j < kBlockKeys; ++j) mx = fmaxf(mx, block[j]);
            mx = attn::scaled_block_max(mx, p.scale_log2);
            __syncthreads();  // every thread has read the scores
            if (mx == kNegInf) continue;  // no finite score: the state is unchanged (uniform)
            const float m_new = mx > m ? mx : m;
            const float alpha = m == kNegInf ? 0.0f : exp2f(__fsub_rn(m, m_new));
            block[t] = attn::p_of_score(s, p.scale_log2, m_new);  // -inf -> +0
            __syncthreads();
            float sum = 0.0f;
            for (int j = 0; j < kBlockKeys; ++j) sum = __fadd_rn(sum, block[j]);
            l = __fadd_rn(__fmul_rn(l, alpha), sum);
            m = m_new;
            if (t < p.d) {
                acc = __fmul_rn(acc, alpha);
                // Only visible keys: rows past k_len may hold anything (0 * NaN is NaN).
                const int keys = min(kBlockKeys, visible - blk * kBlockKeys);
                const T* vr = vp + (k_base + blk * kBlockKeys) * p.v_row + t;
                for (int j = 0; j < keys; ++j) {
                    const float pj = Codec::load(Codec::store(block[j]));
                    acc = __fmaf_rn(pj, Codec::load(vr[j * p.v_row]), acc);
                }
            }
            __syncthreads();  // every thread has read P before the next block's scores
        }
        float merged_m, merged_l, wa, wb;
        int pick;
        attn::merge_weights(run_m, run_l, m, l, merged_m, merged_l, wa, wb, pick);
        run_acc = attn::merge_value(run_acc, acc, wa, wb, pick);
        run_m = merged_m;
        run_l = merged_l;
    }
    T* out = static_cast<T*>(p.out);
    if (t < p.d) out[row * p.out_row + h * p.out_head + t] = Codec::store(attn::finalize_out(run_acc, run_l));
    if (t == 0) p.lse[static_cast<int64_t>(h) * p.tq + row] = attn::finalize_lse(run_m, run_l);
}

}  // namespace attn_portable
}  // namespace batchinv

#define BATCHINV_ATTN_PORTABLE(DTYPE, CODEC)                                                                        \
    extern "C" __global__ void __launch_bounds__(128) attn_portable_##DTYPE(                                       \
        const void* q, const void* k, const void* v, void* out, float* lse, const int* q_start, const int* q_len,  \
        const int* k_start, const int* k_len, long long q_row, long long q_head, long long k_row, long long k_head, \
        long long v_row, long long v_head, long long out_row, long long out_head, int tq, int hq, int hkv, int d,  \
        int causal, float scale_log2) {                                                                             \
        const batchinv::attn_portable::Params p{q,      k,      v,      out,      lse,      q_start, q_len, k_start, \
                                                k_len,  q_row,  q_head, k_row,    k_head,   v_row,   v_head,        \
                                                out_row, out_head, tq, hq, hkv, d, causal, scale_log2};             \
        batchinv::attn_portable::attention_row<CODEC>(p);                                                          \
    }

BATCHINV_ATTN_PORTABLE(bf16, batchinv::Bf16Codec)
BATCHINV_ATTN_PORTABLE(f16, batchinv::F16Codec)

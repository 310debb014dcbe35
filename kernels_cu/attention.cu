// Attention forward (prefill, chunked prefill, varlen, KV-cache decode with split-KV):
// FlashAttention-2 style, mma.sync m16n8k16 (bf16/fp16 in, fp32 accumulate), sm_80+.
//
// Canonical layout (the host reduces padded, varlen and KV-cache calls to it):
//   q    [Tq rows, Hq, D]   bf16/fp16, unit stride along D, row stride q_row, head stride q_head
//   k, v [Tk rows, Hkv, D]  same dtype, strides k_row/k_head, v_row/v_head (16-byte aligned)
//   out  [Tq, Hq, D]        strides out_row/out_head;  lse [Hq, Tq] fp32, natural log
//   q_start, q_len, k_start, k_len  int32 [B]: query i < q_len[b] of sequence b is row
//   q_start[b] + i at absolute position k_len[b] - q_len[b] + i; its keys are rows
//   k_start[b] + j, j < k_len[b] (causal: j <= position).  Rows covered by no sequence are
//   not written (the host pre-fills out = 0, lse = -inf).
//
// Per-row arithmetic (the same for every schedule; m is kept in the log2 domain, c =
// scale_log2 = scale * log2 e in fp32, c > 0):
//   Keys are processed in blocks of kBlockKeys = 128 at fixed ABSOLUTE positions
//   [128j, 128j+128), grouped in splits of kSplitKeys = 2048 keys (kBlocksPerSplit = 16 blocks),
//   also at absolute positions.
//   1. Each split is reduced from the empty state (m, l, acc) = (-inf, 0, 0) by an online
//      softmax over its blocks in increasing order (block_softmax): s = q . k by mma over d in
//      k16 steps in increasing order; invisible keys get s = -inf by selection; then per row
//        mx    = __fmul_rn(max_j s_j, c), a zero max normalised to +0 (max of the RAW scores:
//                rounding is monotone and c > 0, so this equals the max of __fmul_rn(s_j, c))
//        m_new = max(m, mx);  alpha = exp2f(__fsub_rn(m, m_new))  (0 if m = -inf)
//        P_j   = exp2_ftz(__fmaf_rn(s_j, c, -m_new))   (ONE rounding of s_j * c - m_new)
//        l     = __fadd_rn(__fmul_rn(l, alpha), sum_j P_j);  acc = acc * alpha + P V
//      the block max and sum are a per-thread scan in fixed column order (the thread's n8
//      tiles t = 0..15 of the block, each its two columns e = 0, 1) plus a fixed quad butterfly
//      (xor 1, then xor 2); P is rounded to the input dtype for the PV mma, whose acc chain runs
//      over the block's 8 k16 steps in increasing order from the rescaled acc.  A block with no visible key
//      for a row (mx = -inf) leaves that row's state exactly unchanged (selection; the sign of
//      a zero acc is restored).
//   2. Split partials are merged left to right by ONE function (merge_weights/merge_value);
//      an empty partial is skipped by selection.
//   3. finalize_out/finalize_lse: out = acc / l, lse = (m + log2 l) * ln 2; a row with no
//      visible key gets out = 0, lse = -inf.
//   The constants, the scaled block max, P's exponent (scaled_block_max, p_of_score), merge,
//   finalize, exp2_ftz and P's rounding are common/attention_rows.cuh, shared with
//   attention_hopper.cu.
//   Every fp32 step outside the mma is an explicit _rn intrinsic: P's exponent is the one
//   fused step (__fmaf_rn, written out), nothing else is contracted; exp2f,
//   exp2_ftz (P only: ex2.approx.ftz, a result below 2^-126 is +0, equal to exp2f elsewhere)
//   and log2f in every mode, no fast math.  A block that every real row of a warp sees in
//   full skips the selection (it would select every score: same bits).
//
// Execution modes (same arithmetic, only the number of CTAs changes):
//   (a) attn_fwd_*: one CTA per (query tile, head group, sequence) walks all splits of its tile
//       and merges them as it goes (running state in shared memory); writes out and lse.
//   (b) attn_split_*: one CTA per (query tile, head group, sequence x split) writes its split's
//       fp32 partial (m, l, acc) to a workspace [splits, Tq, Hq, D + 2]; attn_combine_* merges a
//       row's partials in split order with the same merge/finalize functions.
//       attn_split_coop_* (decode, 16-row tiles): the same split CTA run by 4 warps that share
//       the loads, the S columns and the PV output columns; each S and acc element is the same
//       mma chain, and every warp runs the same softmax on the whole S tile (see there).
//       attn_split_coop_*_tma (sm_90a): the same kernel with K/V copied by TMA boxes (128-byte
//       swizzle) instead of cp.async; the tile it builds in shared memory holds the same values
//       (rows past k_len zeroed), so every product is the same.
//       On sm_90 the host launches attn_combine_* with programmatic dependent launch: every split
//       CTA lets it launch at its start (griddepcontrol.launch_dependents), and the combine
//       waits (griddepcontrol.wait: the whole split grid completed, its writes visible) before
//       it reads a partial or writes out/lse.  Only when the combine's CTAs start changes; what
//       they read is the finished workspace, so no bit changes (elsewhere both are no-ops and
//       the combine is an ordinary stream-ordered launch).
//   Tile rows: M = 16 * NWARPS rows; row r = (query qtile * QPT + r / P, head hg * P + r % P),
//   P query heads sharing one kv head packed in M (QPT = M / P).  mma rows are independent and
//   a warp's quad butterfly has the same shape for every row, so which tile slot a row lands
//   in, the rows beside it (other heads, other positions, padding), NWARPS and the mode change
//   nothing in that row's bits.  Never used: key/value rows at j >= k_len (zero-filled in
//   shared memory; the cp.async paths never read them, the TMA path copies whole 64-row boxes
//   and zeroes those rows before any warp reads the stage), query rows past q_len (never read).
//   K/V stages in shared memory (every kernel here): D / 64 slabs of [128 keys][64 columns],
//   128-byte rows whose 16-byte chunks are permuted by XOR with key % 8 (the TMA 128-byte
//   swizzle: no padding, conflict-free ldmatrix); only addresses, never values, depend on it.
#include "common/portability.cuh"

#if !defined(__HIPCC__)
#include "common/attention_rows.cuh"
#include "common/grid_dependency.cuh"
#include "common/hopper.cuh"
#include "common/mma_sync.cuh"

namespace batchinv {
namespace attn {

// ---- the tile kernel ----------------------------------------------------------------------

struct Params {
    const void* q;
    const void* k;
    const void* v;
    void* out;
    float* lse;
    float* ws;  // mode (b): [splits, Tq, Hq, D + 2] partials (acc[D], m, l)
    const int* q_start;
    const int* q_len;
    const int* k_start;
    const int* k_len;
    int64_t q_row, q_head, k_row, k_head, v_row, v_head, out_row, out_head;
    int tq, hq, hkv, pack, causal, split_grid;
    float scale_log2;
};

// S n8 tiles and P V k16 steps of one block.
constexpr int kScoreTiles = kBlockKeys / 8;
constexpr int kPvSteps = kBlockKeys / 16;

template <int D>
struct Smem {
    static constexpr int kStride = D + 8;  // Q tile row (elements); 16-byte pad: conflict-free ldmatrix
    static constexpr int kTileElems = kBlockKeys * D;  // one K or V stage (swizzled, kv_offset)
};

// Element offset of (key, col) in a K/V stage: D / 64 slabs [kBlockKeys keys][64 columns] side
// by side; key row r of a slab is 128 bytes at r * 128 whose 16-byte chunks are permuted by XOR
// with r % 8 (the TMA 128-byte swizzle, so a TMA box lands in this layout unchanged; the 8 rows
// an ldmatrix phase reads hit 8 different chunk positions, and no padding is needed).  `col` is
// a multiple of 8 (one 16-byte chunk).
template <int D>
__device__ __forceinline__ int kv_offset(int key, int col) {
    return (col / 64) * (kBlockKeys * 64) + key * 64 + ((((col % 64) / 8) ^ (key % 8)) * 8);
}

// This thread's rows first_row and first_row + 8 of a tile whose queries start at q0 (qpt per
// head, P = p.pack heads interleaved): query index in the sequence (-1: padding), head, and the
// count of keys it sees (0 for padding).
__device__ __forceinline__ void thread_rows(const Params& p, int first_row, int q0, int qpt, int hg, int q_len,
                                            int k_len, int offset, int (&row_q)[2], int (&row_h)[2],
                                            int (&vis_end)[2]) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int r = first_row + 8 * i;
        const int qi = q0 + r / p.pack;
        const bool valid = r < qpt * p.pack && qi < q_len;
        row_q[i] = valid ? qi : -1;
        row_h[i] = hg * p.pack + r % p.pack;
        vis_end[i] = !valid ? 0 : (p.causal ? max(0, min(k_len, offset + qi + 1)) : k_len);
    }
}

// The smallest visible-key count of the warp's real rows (padding rows never need a mask: their
// results are not stored).
__device__ __forceinline__ int warp_visible_min(const int (&row_q)[2], const int (&vis_end)[2]) {
    int vis_min = 0x7fffffff;
#pragma unroll
    for (int i = 0; i < 2; ++i)
        if (row_q[i] >= 0) vis_min = min(vis_min, vis_end[i]);
    return __reduce_min_sync(0xffffffffu, vis_min);
}

// The tile's M query rows -> sq ([M][Smem<D>::kStride]) by cp.async, zeros for rows that are not
// a query; the caller commits the group.
template <int D, int M, int kThreads, typename T>
__device__ __forceinline__ void copy_q_tile(T* sq, const T* qp, const Params& p, int q0, int qpt, int hg, int q_len,
                                            int64_t q_base, int tid) {
    constexpr int kStride = Smem<D>::kStride;
    constexpr int kChunksPerRow = D / 8;  // 16-byte chunks per row
    for (int idx = tid; idx < M * kChunksPerRow; idx += kThreads) {
        const int r = idx / kChunksPerRow;
        const int ch = idx % kChunksPerRow;
        const int qi = q0 + r / p.pack;
        const bool valid = r < qpt * p.pack && qi < q_len;
        const int h = hg * p.pack + r % p.pack;
        const T* src = valid ? qp + (q_base + qi) * p.q_row + h * p.q_head + ch * 8 : qp;
        cp_async16_zfill(sq + r * kStride + ch * 8, src, valid);
    }
}

// The online softmax of one 128-key block for a warp's two rows (g and g + 8 of its 16; s[t][e]
// is mma.sync's n8 tile t = 0..15): raw scores (keys at or past vis_end -inf where `masked`),
// their block max by column scan (t = 0..15, e = 0..1) + quad butterfly scaled once to the log2
// domain, m, alpha, P = exp2_ftz(fma(s, c, -m_new)) with its sum by the same order and tree, l;
// P rounded to the input dtype into the A fragments of the eight k16 steps of P V.  The tile
// kernel and the cooperative decode kernel both run it, so their per-row arithmetic is one piece
// of code (attention_hopper.cu runs the same order on its wgmma fragments).  Rows 8..15 of a warp
// with none (!hi_rows) are skipped.
template <typename Codec>
__device__ __forceinline__ void block_softmax(float (&s)[kScoreTiles][4], bool masked, bool hi_rows, int key0,
                                              int c, const int (&vis_end)[2], float scale_log2, float (&m)[2],
                                              float (&l)[2], bool (&empty)[2], float (&alpha)[2],
                                              uint32_t (&pa)[kPvSteps][4]) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        if (i == 1 && !hi_rows) {
            empty[1] = true;
            alpha[1] = 1.0f;
#pragma unroll
            for (int t = 0; t < kScoreTiles; ++t) s[t][2] = s[t][3] = 0.0f;
            continue;
        }
        // The max of the raw scores (invisible keys -inf), scaled once (scaled_block_max).
        // fmaxf never returns a NaN score (as "x > mx ? x : mx").
        float mx = kNegInf;
        if (masked) {
#pragma unroll
            for (int t = 0; t < kScoreTiles; ++t) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int j = key0 + t * 8 + 2 * c + e;
                    const float x = j < vis_end[i] ? s[t][2 * i + e] : kNegInf;
                    s[t][2 * i + e] = x;
                    mx = fmaxf(mx, x);
                }
            }
        } else {
#pragma unroll
            for (int t = 0; t < kScoreTiles; ++t) {
#pragma unroll
                for (int e = 0; e < 2; ++e) mx = fmaxf(mx, s[t][2 * i + e]);
            }
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        mx = scaled_block_max(mx, scale_log2);  // one zero (+0) whatever the lanes' order
        empty[i] = mx == kNegInf;
        const float m_new = empty[i] ? m[i] : (mx > m[i] ? mx : m[i]);
        alpha[i] = empty[i] ? 1.0f : (m[i] == kNegInf ? 0.0f : exp2f(__fsub_rn(m[i], m_new)));
        float sum = 0.0f;
#pragma unroll
        for (int t = 0; t < kScoreTiles; ++t) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                // An invisible key (s = -inf) gives exp2(-inf) = +0: m_new is not -inf here.
                const float pe = empty[i] ? 0.0f : p_of_score(s[t][2 * i + e], scale_log2, m_new);
                s[t][2 * i + e] = pe;
                sum = __fadd_rn(sum, pe);
            }
        }
        sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, 1));
        sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, 2));
        l[i] = empty[i] ? l[i] : __fadd_rn(__fmul_rn(l[i], alpha[i]), sum);
        m[i] = m_new;
    }
#pragma unroll
    for (int kk = 0; kk < kPvSteps; ++kk) {
        pa[kk][0] = pack_pair<Codec>(s[2 * kk][0], s[2 * kk][1]);
        pa[kk][1] = pack_pair<Codec>(s[2 * kk][2], s[2 * kk][3]);
        pa[kk][2] = pack_pair<Codec>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        pa[kk][3] = pack_pair<Codec>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }
}

// acc *= alpha of its row (alpha[0] for a thread's row g, alpha[1] for g + 8); the upper row's
// half only where the warp has a real row there (hi_rows).
template <int NT>
__device__ __forceinline__ void rescale_acc(float (&acc)[NT][4], const float (&alpha)[2], bool hi_rows) {
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        acc[t][0] = __fmul_rn(acc[t][0], alpha[0]);
        acc[t][1] = __fmul_rn(acc[t][1], alpha[0]);
    }
    if (hi_rows) {
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            acc[t][2] = __fmul_rn(acc[t][2], alpha[1]);
            acc[t][3] = __fmul_rn(acc[t][3], alpha[1]);
        }
    }
}

// The tile kernels keep one K buffer and one V buffer (py/batchinv/gpu/attention.py
// TILE_STAGES = 1 block) and split their loads as FlashAttention-2 does: V of block j loads
// while S_j = Q K_j^T and its softmax run, K of block j + 1 while P_j V_j runs.
template <typename Codec, int D, int NWARPS, bool SPLIT>
__device__ __forceinline__ void attn_tile(const Params& p) {
    using T = typename Codec::storage;
    constexpr int M = 16 * NWARPS;
    constexpr int kThreads = 32 * NWARPS;
    constexpr int kStride = Smem<D>::kStride;
    constexpr int kTile = Smem<D>::kTileElems;
    constexpr int NT = D / 8;  // n8 tiles of the output
    constexpr int KS = D / 16; // k16 steps of QK^T
    constexpr int kChunksPerRow = D / 8;  // 16-byte chunks per row

    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* sk = reinterpret_cast<T*>(smem_raw);  // [kTile] (kv_offset)
    T* sv = sk + kTile;                      // [kTile]
    // Q stays in shared memory and is read per k16 step of every block's QK^T (32 registers at
    // d = 128 that S, acc and P's fragments need: held in registers they spilled).
    T* sq = sv + kTile;                                       // [M][kStride]
    float* srun = reinterpret_cast<float*>(sq + M * kStride);  // mode (a): [NT*4][kThreads]

    const int tid = threadIdx.x;
    const int lane = tid % 32;
    const int warp = tid / 32;
    const int g = lane / 4;
    const int c = lane % 4;

    const int b = SPLIT ? blockIdx.z / p.split_grid : blockIdx.z;
    const int split = SPLIT ? blockIdx.z % p.split_grid : 0;
    const int hg = blockIdx.y;
    const int qpt = M / p.pack;
    const int qtile = gridDim.x - 1 - blockIdx.x;  // heavy (late) causal tiles first
    const int q_len = p.q_len[b];
    const int k_len = p.k_len[b];
    const int q0 = qtile * qpt;
    if (q0 >= q_len) return;
    const int q_last = min(q_len - 1, q0 + qpt - 1);
    const int offset = k_len - q_len;
    // Visible keys of the tile's last row bound the tile's key range.
    const int tile_end = p.causal ? max(0, min(k_len, offset + q_last + 1)) : k_len;
    const int group = p.hq / p.hkv;
    const int kvh = (hg * p.pack) / group;
    const int64_t q_base = p.q_start[b];
    const int64_t k_base = p.k_start[b];

    int blk_begin, blk_end;
    if (SPLIT) {
        blk_begin = split * kBlocksPerSplit;
        blk_end = min(blk_begin + kBlocksPerSplit, (tile_end + kBlockKeys - 1) / kBlockKeys);
        if (blk_begin >= blk_end) return;  // no row of the tile sees this split
    } else {
        blk_begin = 0;
        blk_end = (tile_end + kBlockKeys - 1) / kBlockKeys;
    }

    // This thread's two rows (g and g + 8 of its warp), and whether any real row of the warp sits
    // in the upper half-tile.
    int vis_end[2];
    int row_q[2], row_h[2];
    thread_rows(p, warp * 16 + g, q0, qpt, hg, q_len, k_len, offset, row_q, row_h, vis_end);
    const int warp_vis_min = warp_visible_min(row_q, vis_end);
    const bool hi_rows = __any_sync(0xffffffffu, row_q[1] >= 0);

    const T* qp = static_cast<const T*>(p.q);
    const T* kp = static_cast<const T*>(p.k);
    const T* vp = static_cast<const T*>(p.v);

    copy_q_tile<D, M, kThreads>(sq, qp, p, q0, qpt, hg, q_len, q_base, tid);
    cp_async_commit();

    // One K or V block into its buffer (src: p.k or p.v), zeros for keys at or past k_len.
    auto load_block = [&](T* dst, const T* src, int64_t row_stride, int64_t head_stride, int blk) {
#pragma unroll 1
        for (int idx = tid; idx < kBlockKeys * kChunksPerRow; idx += kThreads) {
            const int r = idx / kChunksPerRow;
            const int ch = idx % kChunksPerRow;
            const int j = blk * kBlockKeys + r;
            const bool valid = j < k_len;
            const T* from = valid ? src + (k_base + j) * row_stride + kvh * head_stride + ch * 8 : src;
            cp_async16_zfill(dst + kv_offset<D>(r, ch * 8), from, valid);
        }
    };
    auto load_k = [&](int blk) { load_block(sk, kp, p.k_row, p.k_head, blk); };
    auto load_v = [&](int blk) { load_block(sv, vp, p.v_row, p.v_head, blk); };

    // cp.async groups, in order: Q, K_begin, V_begin, then K_{j+1}, V_{j+1} per block j (possibly
    // empty: one K and one V group per block keeps the counting uniform).
    if (blk_begin < blk_end) load_k(blk_begin);
    cp_async_commit();
    if (blk_begin < blk_end) load_v(blk_begin);
    cp_async_commit();

    // Q's ldmatrix address of this lane (k16 step 0).
    const T* q_frag = sq + (warp * 16 + (lane % 8) + 8 * ((lane / 8) % 2)) * kStride + 8 * (lane / 16);
    // This lane's ldmatrix rows in the K and V buffers: kv_offset(key, col) for key = 16 n + row
    // and col = 64 slab + 16 q + 8 half keeps key % 8 == lane % 8, so the swizzle depends only on
    // the lane and q % 4: four lane offsets per buffer, the rest folds into the instruction
    // (computed per (key, col) the addresses took about 64 registers and spilled).
    const int k_row = (lane % 8) + 8 * (lane / 16), k_half = (lane / 8) % 2;
    const int v_row = (lane % 8) + 8 * ((lane / 8) % 2), v_half = lane / 16;
    int k_lane[4], v_lane[4];
#pragma unroll
    for (int q4 = 0; q4 < 4; ++q4) {
        k_lane[q4] = k_row * 64 + (((2 * q4 + k_half) ^ (lane % 8)) * 8);
        v_lane[q4] = v_row * 64 + (((2 * q4 + v_half) ^ (lane % 8)) * 8);
    }

    float m[2] = {kNegInf, kNegInf};
    float l[2] = {0.0f, 0.0f};
    float acc[NT][4];
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.0f;
    float run_m[2] = {kNegInf, kNegInf};
    float run_l[2] = {0.0f, 0.0f};

    for (int blk = blk_begin; blk < blk_end; ++blk) {
        cp_async_wait<1>();  // Q and K_blk are complete (V_blk may be in flight)
        __syncthreads();
        const int key0 = blk * kBlockKeys;

        // S = Q K^T over d in increasing k16 steps.
        float s[kScoreTiles][4];
#pragma unroll
        for (int t = 0; t < kScoreTiles; ++t) s[t][0] = s[t][1] = s[t][2] = s[t][3] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
            uint32_t qf[4];
            ldmatrix_x4(qf, q_frag + ks * 16);
#pragma unroll
            for (int tp = 0; tp < kScoreTiles / 2; ++tp) {
                uint32_t bk[4];  // keys 16 tp + k_row, columns 16 ks + 8 k_half (kv_offset)
                ldmatrix_x4(bk, sk + (ks / 4) * (kBlockKeys * 64) + tp * 16 * 64 + k_lane[ks % 4]);
                mma_m16n8k16<Codec>(s[2 * tp], qf, bk[0], bk[1]);
                mma_m16n8k16<Codec>(s[2 * tp + 1], qf, bk[2], bk[3]);
            }
        }
        __syncthreads();  // every warp has read K_blk: the next block's K may overwrite it
        if (blk + 1 < blk_end) load_k(blk + 1);
        cp_async_commit();

        // Online softmax of the block, row by row (rows g and g + 8).  A block every real row
        // of the warp sees in full skips the selection (it would select every score: same
        // bits); half-tiles holding only padding rows (decode) skip the softmax (their P is 0
        // and their state is never stored).
        const bool masked = key0 + kBlockKeys > warp_vis_min;
        bool empty[2];
        float alpha[2];
        uint32_t pa[kPvSteps][4];  // P as A fragments of the eight k16 steps of PV
        block_softmax<Codec>(s, masked, hi_rows, key0, c, vis_end, p.scale_log2, m, l, empty, alpha, pa);
        rescale_acc(acc, alpha, hi_rows);
        // A row with no visible key here adds only zero products; P = 0 could still turn an
        // acc of -0 into +0, so those signs are remembered and restored (warp-uniform branch).
        // (Padding rows are always empty and never written: they do not need the fix-up.)
        const bool any_empty =
            __any_sync(0xffffffffu, (empty[0] && row_q[0] >= 0) || (empty[1] && row_q[1] >= 0));
        uint32_t negzero[(NT * 4 + 31) / 32] = {};
        if (any_empty) {
#pragma unroll
            for (int t = 0; t < NT; ++t)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (__float_as_uint(acc[t][e]) == 0x80000000u) negzero[(t * 4 + e) / 32] |= 1u << ((t * 4 + e) % 32);
        }
        cp_async_wait<1>();  // V_blk is complete (K_{blk+1} may be in flight)
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < kPvSteps; ++kk) {
#pragma unroll
            for (int dp = 0; dp < NT / 2; ++dp) {
                uint32_t bv[4];  // keys 16 kk + v_row, columns 16 dp + 8 v_half (kv_offset)
                ldmatrix_x4_trans(bv, sv + (dp / 4) * (kBlockKeys * 64) + kk * 16 * 64 + v_lane[dp % 4]);
                mma_m16n8k16<Codec>(acc[2 * dp], pa[kk], bv[0], bv[1]);
                mma_m16n8k16<Codec>(acc[2 * dp + 1], pa[kk], bv[2], bv[3]);
            }
        }
        if (any_empty) {
#pragma unroll
            for (int t = 0; t < NT; ++t)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const bool was_neg_zero = (negzero[(t * 4 + e) / 32] >> ((t * 4 + e) % 32)) & 1u;
                    if (empty[e / 2] && acc[t][e] == 0.0f) acc[t][e] = was_neg_zero ? -0.0f : 0.0f;
                }
        }

        // End of a split: mode (b) stores the partial; mode (a) merges it into the running state.
        const bool split_end = (blk + 1) % kBlocksPerSplit == 0 || blk + 1 == blk_end;
        if (!SPLIT && split_end) {
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                float mm, ll, wa, wb;
                int pick;
                merge_weights(run_m[i], run_l[i], m[i], l[i], mm, ll, wa, wb, pick);
#pragma unroll
                for (int t = 0; t < NT; ++t)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        float& slot = srun[(t * 4 + 2 * i + e) * kThreads + tid];
                        const float prev = blk + 1 <= kBlocksPerSplit ? 0.0f : slot;  // first split
                        slot = merge_value(prev, acc[t][2 * i + e], wa, wb, pick);
                        acc[t][2 * i + e] = 0.0f;
                    }
                run_m[i] = mm;
                run_l[i] = ll;
                m[i] = kNegInf;
                l[i] = 0.0f;
            }
        }
        __syncthreads();  // every warp has read V_blk: the next block's V may overwrite it
        if (blk + 1 < blk_end) load_v(blk + 1);
        cp_async_commit();
    }
    cp_async_wait<0>();  // nothing in flight leaves the kernel (the Q group of an empty tile)

    if (SPLIT) {
        float* ws = p.ws;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            if (row_q[i] < 0) continue;
            const int64_t row = ((static_cast<int64_t>(split) * p.tq + q_base + row_q[i]) * p.hq + row_h[i]) * (D + 2);
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                *reinterpret_cast<float2*>(ws + row + t * 8 + 2 * c) = make_float2(acc[t][2 * i], acc[t][2 * i + 1]);
            }
            if (c == 0) {
                ws[row + D] = m[i];
                ws[row + D + 1] = l[i];
            }
        }
        return;
    }

    T* op = static_cast<T*>(p.out);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        if (row_q[i] < 0) continue;
        const int64_t t_row = q_base + row_q[i];
        T* dst = op + t_row * p.out_row + row_h[i] * p.out_head;
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            const float a0 = srun[(t * 4 + 2 * i) * kThreads + tid];
            const float a1 = srun[(t * 4 + 2 * i + 1) * kThreads + tid];
            T pair[2] = {Codec::store(finalize_out(a0, run_l[i])), Codec::store(finalize_out(a1, run_l[i]))};
            *reinterpret_cast<uint32_t*>(dst + t * 8 + 2 * c) = *reinterpret_cast<uint32_t*>(pair);
        }
        if (c == 0) p.lse[static_cast<int64_t>(row_h[i]) * p.tq + t_row] = finalize_lse(run_m[i], run_l[i]);
    }
}

// ---- the cooperative split kernel (decode) -------------------------------------------------
//
// Mode (b) for 16-row tiles executed by NW warps instead of one (same arithmetic, same bits):
// the NW warps of a CTA share ONE 16-row tile and one split.  They load each K/V block
// together (NW times the copies in flight per block), each computes the S columns of
// kBlockKeys / NW keys (warp w: keys [32w, 32w + 32) with 4 warps; whole k16 chains over d: an
// S element is the same mma chain as in attn_tile), S goes through shared memory, and every
// warp then runs attn_tile's online softmax on the whole 16 x 128 S tile (the same per-thread
// column scan and quad butterfly, so every warp holds the same m, l and P bits) and the PV
// products of D / NW output columns (each acc element is the same mma chain over the block's
// k16 steps, rescaled by the same alpha).  Decode has few rows (4 real of 16 for GQA 4:1): one
// warp per tile was bound by its own instruction latency.
// K/V stages: the swizzled layout of kv_offset for both copy paths (cp.async writes it chunk by
// chunk; the TMA boxes of the 128-byte-swizzled tensor maps land in it as they are).
// TMA: K/V blocks by TMA boxes of map_k / map_v (the K/V rows as [rows, Hkv * D], 64 x 64
// boxes; sm_90a only) into the swizzled stages, one mbarrier per stage, rows at or past k_len
// zeroed after the copy lands; the tile and every product are the same as with cp.async.
template <typename Codec, int D, int NW, int STAGES, bool TMA>
__device__ __forceinline__ void attn_split_coop(const Params& p, [[maybe_unused]] const TensorMap* map_k,
                                                [[maybe_unused]] const TensorMap* map_v) {
#if !defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if constexpr (TMA) {
#if defined(__CUDA_ARCH__)
        __trap();  // built for sm_90a images; the host launches the TMA kernels only there
#endif
        return;
    }
#endif
    using T = typename Codec::storage;
    constexpr int M = 16;
    constexpr int kThreads = 32 * NW;
    constexpr int kStride = Smem<D>::kStride;
    constexpr int kTile = Smem<D>::kTileElems;
    constexpr int NT = D / 8;
    constexpr int KS = D / 16;
    constexpr int kChunksPerRow = D / 8;
    constexpr int kStages = STAGES;
    constexpr int kSStride = kBlockKeys + 4;       // fp32 S row stride (words)
    constexpr int kKeyPairs = kBlockKeys / 16 / NW;  // 16-key column pairs of S per warp
    constexpr int kOutTiles = NT / NW;        // n8 output tiles per warp
    static_assert(NW == 2 || NW == 4, "16-key S column pairs and n8 output tiles per warp");

    extern __shared__ __align__(16) unsigned char smem_raw[];
    // TMA: the swizzled boxes need 1024-byte alignment (the host adds 1024 bytes).
    unsigned char* smem_base =
        TMA ? smem_raw + ((1024 - (smem_address(smem_raw) & 1023)) & 1023) : smem_raw;
    T* sk = reinterpret_cast<T*>(smem_base);  // [kStages][kTile]
    T* sv = sk + kStages * kTile;             // [kStages][kTile]
    // Q [16][kStride], then (once every warp holds Q in registers) S [16][kSStride] fp32:
    // max(16 * kStride * 2, 16 * kSStride * 4) bytes (py/batchinv/gpu/attention.py).
    T* sq = sv + kStages * kTile;
    float* ss = reinterpret_cast<float*>(sq);
    // TMA: one mbarrier per stage after the Q / S region (py/batchinv/gpu/attention.py).
    constexpr int kQsBytes = (M * kStride * 2 > M * kSStride * 4) ? M * kStride * 2 : M * kSStride * 4;
    [[maybe_unused]] uint64_t* full = reinterpret_cast<uint64_t*>(reinterpret_cast<unsigned char*>(sq) + kQsBytes);

    const int tid = threadIdx.x;
    const int lane = tid % 32;
    const int warp = tid / 32;
    const int g = lane / 4;
    const int c = lane % 4;

    const int b = blockIdx.z / p.split_grid;
    const int split = blockIdx.z % p.split_grid;
    const int hg = blockIdx.y;
    const int qpt = M / p.pack;
    const int qtile = gridDim.x - 1 - blockIdx.x;
    const int q_len = p.q_len[b];
    const int k_len = p.k_len[b];
    const int q0 = qtile * qpt;
    if (q0 >= q_len) return;
    const int q_last = min(q_len - 1, q0 + qpt - 1);
    const int offset = k_len - q_len;
    const int tile_end = p.causal ? max(0, min(k_len, offset + q_last + 1)) : k_len;
    const int group = p.hq / p.hkv;
    const int kvh = (hg * p.pack) / group;
    const int64_t q_base = p.q_start[b];
    const int64_t k_base = p.k_start[b];

    const int blk_begin = split * kBlocksPerSplit;
    const int blk_end = min(blk_begin + kBlocksPerSplit, (tile_end + kBlockKeys - 1) / kBlockKeys);
    if (blk_begin >= blk_end) return;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if constexpr (TMA) {
        if (tid == 0) {
#pragma unroll
            for (int i = 0; i < kStages; ++i) hopper::barrier_init(&full[i], 1);
            hopper::fence_barrier_init();
        }
        __syncthreads();
    }
#endif

    // Every warp holds the tile's rows g and g + 8 (the same rows in every warp).
    int vis_end[2];
    int row_q[2], row_h[2];
    thread_rows(p, g, q0, qpt, hg, q_len, k_len, offset, row_q, row_h, vis_end);
    const int warp_vis_min = warp_visible_min(row_q, vis_end);
    const bool hi_rows = __any_sync(0xffffffffu, row_q[1] >= 0);

    const T* qp = static_cast<const T*>(p.q);
    const T* kp = static_cast<const T*>(p.k);
    const T* vp = static_cast<const T*>(p.v);

    copy_q_tile<D, M, kThreads>(sq, qp, p, q0, qpt, hg, q_len, q_base, tid);
    cp_async_commit();

    // Each thread copies the same 16-byte chunk column of rows r0, r0 + kRowStep, ... of a block.
    constexpr int kRowStep = kThreads / kChunksPerRow;
    static_assert(kThreads % kChunksPerRow == 0 && kBlockKeys % kRowStep == 0, "load mapping");
    const int r0 = tid / kChunksPerRow;
    const int ch0 = (tid % kChunksPerRow) * 8;
    const T* k_thread = kp + k_base * p.k_row + kvh * p.k_head + ch0;  // + key * k_row
    const T* v_thread = vp + k_base * p.v_row + kvh * p.v_head + ch0;
    // TMA: thread 0 copies block blk as 64-row x 64-column boxes of K and of V: D / 64 column
    // slabs, each of kBlockKeys / 64 boxes stacked by rows (a box lands 8 KB further, 1024-byte
    // aligned, so the swizzle of each box is the slab's).  Whole boxes: rows past the tensor
    // arrive as zeros, rows past k_len inside it are zeroed by wait_kv_tma; a box that would hold
    // no key below k_len is not issued (wait_kv_tma zeroes its rows).
    constexpr int kBoxRows = 64;
    constexpr int kBoxes = kBlockKeys / kBoxRows;
    [[maybe_unused]] auto load_kv_tma = [&](int blk, int stage) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
        if (tid == 0) {
            // The stage's last readers passed a __syncthreads before this point; order their
            // generic reads (and any zero stores) before the async proxy's writes.
            hopper::fence_proxy_async_shared();
            const int keys = k_len - blk * kBlockKeys;  // > 0: the block holds a visible key
            const int boxes = min(kBoxes, (keys + kBoxRows - 1) / kBoxRows);
            hopper::barrier_expect_bytes(&full[stage], 2u * boxes * kBoxRows * D * sizeof(T));
            const int row = static_cast<int>(k_base) + blk * kBlockKeys;
#pragma unroll
            for (int h = 0; h < D / 64; ++h) {
#pragma unroll
                for (int bx = 0; bx < kBoxes; ++bx) {
                    if (bx < boxes) {
                        const int dst = stage * kTile + h * kBlockKeys * 64 + bx * kBoxRows * 64;
                        const int col = kvh * D + h * 64;
                        hopper::tma_load_2d(sk + dst, *map_k, &full[stage], col, row + bx * kBoxRows);
                        hopper::tma_load_2d(sv + dst, *map_v, &full[stage], col, row + bx * kBoxRows);
                    }
                }
            }
        }
#endif
    };
    [[maybe_unused]] auto wait_kv_tma = [&](int blk, int stage) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
        hopper::barrier_wait(&full[stage], ((blk - blk_begin) / kStages) & 1);
        const int rows = k_len - blk * kBlockKeys;
        if (rows < kBlockKeys) {  // whole 128-byte box rows: the swizzle only permutes within a row
            const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
            constexpr int kRowChunks = 8;  // 16-byte chunks per box row
            for (int idx = rows * kRowChunks + tid; idx < kBlockKeys * kRowChunks; idx += kThreads) {
#pragma unroll
                for (int h = 0; h < D / 64; ++h) {
                    *reinterpret_cast<uint4*>(sk + stage * kTile + h * kBlockKeys * 64 + idx * 8) = zero;
                    *reinterpret_cast<uint4*>(sv + stage * kTile + h * kBlockKeys * 64 + idx * 8) = zero;
                }
            }
        }
#endif
    };
    auto load_kv = [&](int blk, int stage) {
        T* dk = sk + stage * kTile;
        T* dv = sv + stage * kTile;
        const int j0 = blk * kBlockKeys + r0;
#pragma unroll
        for (int r = 0; r < kBlockKeys; r += kRowStep) {
            const bool valid = j0 + r < k_len;
            const T* srck = valid ? k_thread + static_cast<int64_t>(j0 + r) * p.k_row : kp;
            const T* srcv = valid ? v_thread + static_cast<int64_t>(j0 + r) * p.v_row : vp;
            cp_async16_zfill(dk + kv_offset<D>(r0 + r, ch0), srck, valid);
            cp_async16_zfill(dv + kv_offset<D>(r0 + r, ch0), srcv, valid);
        }
    };

#pragma unroll
    for (int i = 0; i < kStages - 1; ++i) {
        if constexpr (TMA) {
            if (blk_begin + i < blk_end) load_kv_tma(blk_begin + i, i);
        } else {
            if (blk_begin + i < blk_end) load_kv(blk_begin + i, i);
            cp_async_commit();
        }
    }
    cp_async_wait<TMA ? 0 : kStages - 1>();  // TMA: Q is the only cp.async group
    __syncthreads();

    uint32_t qf[KS][4];
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
        const int r = (lane % 8) + 8 * ((lane / 8) % 2);
        const int col = ks * 16 + 8 * (lane / 16);
        ldmatrix_x4(qf[ks], sq + r * kStride + col);
    }

    float m[2] = {kNegInf, kNegInf};
    float l[2] = {0.0f, 0.0f};
    float acc[kOutTiles][4];
#pragma unroll
    for (int t = 0; t < kOutTiles; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.0f;

    for (int blk = blk_begin; blk < blk_end; ++blk) {
        const int stage = (blk - blk_begin) % kStages;
        const int ahead = blk + kStages - 1;
        if constexpr (TMA) {
            if (ahead < blk_end) load_kv_tma(ahead, (ahead - blk_begin) % kStages);
            wait_kv_tma(blk, stage);
        } else {
            if (ahead < blk_end) load_kv(ahead, (ahead - blk_begin) % kStages);
            cp_async_commit();
            cp_async_wait<kStages - 1>();
        }
        __syncthreads();  // this block's K/V are in; every warp has read Q / the last S
        const T* tk = sk + stage * kTile;
        const T* tv = sv + stage * kTile;
        const int key0 = blk * kBlockKeys;

        // This warp's S columns: keys [16 tp, 16 tp + 16) for its kKeyPairs pairs tp.
#pragma unroll
        for (int pi = 0; pi < kKeyPairs; ++pi) {
            const int tp = warp * kKeyPairs + pi;
            float s2[2][4] = {};
#pragma unroll
            for (int ks = 0; ks < KS; ++ks) {
                uint32_t bk[4];
                const int key = tp * 16 + (lane % 8) + 8 * (lane / 16);
                const int col = ks * 16 + 8 * ((lane / 8) % 2);
                ldmatrix_x4(bk, tk + kv_offset<D>(key, col));
                mma_m16n8k16<Codec>(s2[0], qf[ks], bk[0], bk[1]);
                mma_m16n8k16<Codec>(s2[1], qf[ks], bk[2], bk[3]);
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int col = (2 * tp + h) * 8 + 2 * c;
                *reinterpret_cast<float2*>(ss + g * kSStride + col) = make_float2(s2[h][0], s2[h][1]);
                *reinterpret_cast<float2*>(ss + (g + 8) * kSStride + col) = make_float2(s2[h][2], s2[h][3]);
            }
        }
        __syncthreads();
        float s[kScoreTiles][4];
#pragma unroll
        for (int t = 0; t < kScoreTiles; ++t) {
            const float2 lo = *reinterpret_cast<const float2*>(ss + g * kSStride + t * 8 + 2 * c);
            const float2 hi = *reinterpret_cast<const float2*>(ss + (g + 8) * kSStride + t * 8 + 2 * c);
            s[t][0] = lo.x;
            s[t][1] = lo.y;
            s[t][2] = hi.x;
            s[t][3] = hi.y;
        }

        // The tile kernel's online softmax of the block (block_softmax).
        const bool masked = key0 + kBlockKeys > warp_vis_min;
        bool empty[2];
        float alpha[2];
        uint32_t pa[kPvSteps][4];
        block_softmax<Codec>(s, masked, hi_rows, key0, c, vis_end, p.scale_log2, m, l, empty, alpha, pa);
        rescale_acc(acc, alpha, hi_rows);
        const bool any_empty =
            __any_sync(0xffffffffu, (empty[0] && row_q[0] >= 0) || (empty[1] && row_q[1] >= 0));
        uint32_t negzero = 0;  // kOutTiles * 4 <= 32 bits
        if (any_empty) {
#pragma unroll
            for (int t = 0; t < kOutTiles; ++t)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (__float_as_uint(acc[t][e]) == 0x80000000u) negzero |= 1u << (t * 4 + e);
        }
        // This warp's output columns: n8 tiles [warp * kOutTiles, (warp + 1) * kOutTiles).
#pragma unroll
        for (int kk = 0; kk < kPvSteps; ++kk) {
#pragma unroll
            for (int dp = 0; dp < kOutTiles / 2; ++dp) {
                uint32_t bv[4];
                const int key = kk * 16 + (lane % 8) + 8 * ((lane / 8) % 2);
                const int col = (warp * kOutTiles / 2 + dp) * 16 + 8 * (lane / 16);
                ldmatrix_x4_trans(bv, tv + kv_offset<D>(key, col));
                mma_m16n8k16<Codec>(acc[2 * dp], pa[kk], bv[0], bv[1]);
                mma_m16n8k16<Codec>(acc[2 * dp + 1], pa[kk], bv[2], bv[3]);
            }
        }
        if (any_empty) {
#pragma unroll
            for (int t = 0; t < kOutTiles; ++t)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const bool was_neg_zero = (negzero >> (t * 4 + e)) & 1u;
                    if (empty[e / 2] && acc[t][e] == 0.0f) acc[t][e] = was_neg_zero ? -0.0f : 0.0f;
                }
        }
        __syncthreads();  // the stage just read is the next load's target
    }
    cp_async_wait<0>();

#pragma unroll
    for (int i = 0; i < 2; ++i) {
        if (row_q[i] < 0) continue;
        const int64_t row =
            ((static_cast<int64_t>(split) * p.tq + q_base + row_q[i]) * p.hq + row_h[i]) * (D + 2);
#pragma unroll
        for (int t = 0; t < kOutTiles; ++t) {
            const int col = (warp * kOutTiles + t) * 8 + 2 * c;
            *reinterpret_cast<float2*>(p.ws + row + col) = make_float2(acc[t][2 * i], acc[t][2 * i + 1]);
        }
        if (warp == 0 && c == 0) {
            p.ws[row + D] = m[i];
            p.ws[row + D + 1] = l[i];
        }
    }
}

// Mode (b)'s second kernel: CTA (query i, head h, sequence b), thread e = element of d.
template <typename Codec, int D>
__device__ __forceinline__ void attn_combine(const float* ws, void* out, float* lse, const int* q_start,
                                             const int* q_len, const int* k_len, int64_t out_row, int64_t out_head,
                                             int tq, int hq, int causal) {
    grid_launch_dependents();  // a prefetching small-M linear (o_proj) may start
    const int qi = blockIdx.x;
    const int h = blockIdx.y;
    const int b = blockIdx.z;
    const int e = threadIdx.x;
    const int lq = q_len[b];
    if (qi >= lq) return;
    const int lk = k_len[b];
    const int vis = causal ? max(0, min(lk, lk - lq + qi + 1)) : lk;
    const int splits = (vis + kSplitKeys - 1) / kSplitKeys;
    const int64_t t_row = q_start[b] + qi;
    // Partials are loaded kBatch at a time (independent loads in flight; a 32768-key context has
    // 16 splits), then merged one by one in split order as before.
    constexpr int kBatch = 8;
    const int64_t split_stride = static_cast<int64_t>(tq) * hq * (D + 2);
    const float* part = ws + (t_row * hq + h) * (D + 2);
    // The split kernel wrote ws (and nothing this kernel reads above); with a programmatic
    // launch this CTA may have started before it finished.
    grid_wait_primary();
    float m = kNegInf, l = 0.0f, acc = 0.0f;
    for (int s0 = 0; s0 < splits; s0 += kBatch) {
        float pm[kBatch], pl[kBatch], pv[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
            if (s0 + u < splits) {
                const float* ps = part + (s0 + u) * split_stride;
                pm[u] = ps[D];
                pl[u] = ps[D + 1];
                pv[u] = ps[e];
            }
        }
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
            if (s0 + u < splits) {
                float mm, ll, wa, wb;
                int pick;
                merge_weights(m, l, pm[u], pl[u], mm, ll, wa, wb, pick);
                acc = merge_value(acc, pv[u], wa, wb, pick);
                m = mm;
                l = ll;
            }
        }
    }
    using T = typename Codec::storage;
    static_cast<T*>(out)[t_row * out_row + h * out_head + e] = Codec::store(finalize_out(acc, l));
    if (e == 0) lse[static_cast<int64_t>(h) * tq + t_row] = finalize_lse(m, l);
}

}  // namespace attn
}  // namespace batchinv

#define BATCHINV_ATTN_PARAMS                                                                                   \
    const void *q, const void *k, const void *v, void *out, float *lse, float *ws, const int *q_start,        \
        const int *q_len, const int *k_start, const int *k_len, int64_t q_row, int64_t q_head, int64_t k_row, \
        int64_t k_head, int64_t v_row, int64_t v_head, int64_t out_row, int64_t out_head, int tq, int hq,     \
        int hkv, int pack, int causal, int split_grid, float scale_log2

#define BATCHINV_ATTN_MAKE_PARAMS                                                                               \
    batchinv::attn::Params p{q,     k,      v,      out,   lse,    ws,      q_start, q_len,   k_start,           \
                             k_len, q_row,  q_head, k_row, k_head, v_row,   v_head,  out_row, out_head,          \
                             tq,    hq,     hkv,    pack,  causal, split_grid, scale_log2}

#define BATCHINV_ATTN_KERNELS(DTYPE, CODEC, D, NW)                                                             \
    extern "C" __global__ void __launch_bounds__(32 * NW) attn_fwd_##DTYPE##_d##D##_w##NW(BATCHINV_ATTN_PARAMS) { \
        BATCHINV_ATTN_MAKE_PARAMS;                                                                              \
        batchinv::attn::attn_tile<CODEC, D, NW, false>(p);                                                                           \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(32 * NW)                                                       \
        attn_split_##DTYPE##_d##D##_w##NW(BATCHINV_ATTN_PARAMS) {                                               \
        batchinv::grid_launch_dependents(); /* the combine may launch (it waits for this grid) */          \
        BATCHINV_ATTN_MAKE_PARAMS;                                                                              \
        batchinv::attn::attn_tile<CODEC, D, NW, true>(p);                                                                             \
    }

#define BATCHINV_ATTN_SPLIT_COOP(DTYPE, CODEC, D, NW, S, MINB)                                                   \
    extern "C" __global__ void __launch_bounds__(32 * NW, MINB)                                                 \
        attn_split_coop_##DTYPE##_d##D##_w##NW##_s##S(BATCHINV_ATTN_PARAMS) {                                   \
        batchinv::grid_launch_dependents(); /* the combine may launch (it waits for this grid) */          \
        BATCHINV_ATTN_MAKE_PARAMS;                                                                              \
        batchinv::attn::attn_split_coop<CODEC, D, NW, S, false>(p, nullptr, nullptr);                           \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(32 * NW, MINB) attn_split_coop_##DTYPE##_d##D##_w##NW##_s##S##_tma( \
        const __grid_constant__ batchinv::TensorMap map_k, const __grid_constant__ batchinv::TensorMap map_v,   \
        BATCHINV_ATTN_PARAMS) {                                                                                 \
        batchinv::grid_launch_dependents(); /* the combine may launch (it waits for this grid) */          \
        BATCHINV_ATTN_MAKE_PARAMS;                                                                              \
        batchinv::attn::attn_split_coop<CODEC, D, NW, S, true>(p, &map_k, &map_v);                              \
    }

#define BATCHINV_ATTN_COMBINE(DTYPE, CODEC, D)                                                                  \
    extern "C" __global__ void __launch_bounds__(D) attn_combine_##DTYPE##_d##D(                                \
        const float* ws, void* out, float* lse, const int* q_start, const int* q_len, const int* k_len,         \
        int64_t out_row, int64_t out_head, int tq, int hq, int causal) {                                        \
        batchinv::attn::attn_combine<CODEC, D>(ws, out, lse, q_start, q_len, k_len, out_row, out_head, tq, hq,  \
                                               causal);                                                         \
    }

// Arguments of every attn_fwd_* / attn_split_* kernel:
//   (q, k, v, out, lse, ws, q_start, q_len, k_start, k_len, q_row, q_head, k_row, k_head, v_row,
//    v_head, out_row, out_head, tq, hq, hkv, pack, causal, split_grid, scale_log2)
BATCHINV_ATTN_KERNELS(bf16, batchinv::Bf16Codec, 64, 1)
BATCHINV_ATTN_KERNELS(bf16, batchinv::Bf16Codec, 64, 4)
BATCHINV_ATTN_KERNELS(bf16, batchinv::Bf16Codec, 128, 1)
BATCHINV_ATTN_KERNELS(bf16, batchinv::Bf16Codec, 128, 4)
BATCHINV_ATTN_KERNELS(f16, batchinv::F16Codec, 64, 1)
BATCHINV_ATTN_KERNELS(f16, batchinv::F16Codec, 64, 4)
BATCHINV_ATTN_KERNELS(f16, batchinv::F16Codec, 128, 1)
BATCHINV_ATTN_KERNELS(f16, batchinv::F16Codec, 128, 4)
// Cooperative split kernels (16-row tiles, NW warps): decode.  MINB (CTAs per SM the register
// cap allows): 2 at 1 stage (shared memory would allow 3 at d = 128, 73-75 KB each, but the
// 168-register cap of 3 spills and measures slower: docs/tuning/attention.md), 1 at 2 and 3
// stages (137-202 KB of shared memory at d = 128).
BATCHINV_ATTN_SPLIT_COOP(bf16, batchinv::Bf16Codec, 64, 4, 1, 2)
BATCHINV_ATTN_SPLIT_COOP(bf16, batchinv::Bf16Codec, 64, 4, 2, 1)
BATCHINV_ATTN_SPLIT_COOP(bf16, batchinv::Bf16Codec, 64, 4, 3, 1)
BATCHINV_ATTN_SPLIT_COOP(bf16, batchinv::Bf16Codec, 128, 4, 1, 2)
BATCHINV_ATTN_SPLIT_COOP(bf16, batchinv::Bf16Codec, 128, 4, 2, 1)
BATCHINV_ATTN_SPLIT_COOP(bf16, batchinv::Bf16Codec, 128, 4, 3, 1)
BATCHINV_ATTN_SPLIT_COOP(f16, batchinv::F16Codec, 64, 4, 1, 2)
BATCHINV_ATTN_SPLIT_COOP(f16, batchinv::F16Codec, 64, 4, 2, 1)
BATCHINV_ATTN_SPLIT_COOP(f16, batchinv::F16Codec, 64, 4, 3, 1)
BATCHINV_ATTN_SPLIT_COOP(f16, batchinv::F16Codec, 128, 4, 1, 2)
BATCHINV_ATTN_SPLIT_COOP(f16, batchinv::F16Codec, 128, 4, 2, 1)
BATCHINV_ATTN_SPLIT_COOP(f16, batchinv::F16Codec, 128, 4, 3, 1)
BATCHINV_ATTN_COMBINE(bf16, batchinv::Bf16Codec, 64)
BATCHINV_ATTN_COMBINE(bf16, batchinv::Bf16Codec, 128)
BATCHINV_ATTN_COMBINE(f16, batchinv::F16Codec, 64)
BATCHINV_ATTN_COMBINE(f16, batchinv::F16Codec, 128)
#endif

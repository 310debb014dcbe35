// Attention backward (FlashAttention-2 style, deterministic: no atomics, no split reductions).
//
// Layout (the canonical layout of the forward, all contiguous):
//   q, out, dout, dq  [Tq, Hq, D]    bf16/fp16 (one dtype per launch)
//   k, v, dk, dv      [Tk, Hkv, D]   same dtype; D in {64, 128}; Hq % Hkv == 0, G = Hq / Hkv
//   lse, delta        [Hq, Tq]       fp32; lse = natural-log sum-exp of the scaled scores
//   q_start, q_len, k_start, k_len   int32 [B]
// Query i of sequence b is row q_start[b] + i at absolute position p = (k_len[b] - q_len[b]) + i;
// its keys are rows k_start[b] + j, j < k_len[b] (causal: j <= p).  q head h reads kv head h / G.
//
// Formula (fp32 throughout, each step an explicit IEEE operation or the one exp2_ftz, no fast math):
//   delta[h, r] = sum over d of dout[r, h, d] * out[r, h, d]: D / 8 chains of 8 elements in
//                 order, then a fixed pairwise tree over the chains (delta_kernel)
//   s  = q . k                      mma.sync m16n8k16, fp32 accumulation over d in k16 steps
//   p  = exp2_ftz(fma(s, scale log2 e, -(lse log2 e)))   (the forward's exponent form; each
//                                   product rounded to fp32) on visible keys of rows with
//                                   lse != -inf; exactly 0 elsewhere
//   dp = dout . v                   mma, as s
//   ds = p * (dp - delta)           0 where p is 0 by selection (never a product with a mask)
//   dv = sum of p * dout,  dk = (sum of ds * q) * scale,  dq = (sum of ds * k) * scale
// p and ds are rounded to the input dtype before they enter an mma (as FlashAttention does);
// every other operand is an input.  Rows and keys outside a sequence are never read (their
// tile slots are zero-filled in shared memory), so NaN padding cannot leak in.
//
// Kernels and launch geometry:
//   attention_bwd_delta_*: grid (ceil(max_q_len * Hq * D / 8 / 128), B), block 128; D / 8
//     lanes per (query row, head) of a sequence, 8 elements each, then a butterfly.
//   attention_bwd_dkdv_*: grid (ceil(max_k_len / 64), Hkv, B), block 128 (4 warps).  One CTA
//     owns the 64 keys [64 j, 64 j + 64) of a sequence (absolute key positions; warp w owns 16)
//     for one kv head, and walks the group's query heads in increasing order, and for each the
//     sequence's query blocks of kKvQueryRows rows (aligned to the sequence's first query) in
//     increasing position, skipping only the leading blocks that see none of its keys (causal).
//     dV += P^T dO and dK += dS^T Q accumulate in registers, one mma k16 step after another.
//   attention_bwd_dq_*: grid (ceil(max_q_len / 64), Hq, B), block 128.  One CTA owns 64 query
//     rows of a sequence (aligned to its first query) for one head and walks the key blocks of
//     64 absolute positions in increasing order, up to the last one its rows can see;
//     dQ += dS K accumulates in registers.
//   The default ("tiled") variant launches attention_bwd_dkdv_*_wide: grid
//     (Hkv, B, ceil(max_k_len / 64)), block 256, the same 64 keys per CTA and walk, with
//     32-row warp tiles and P^T / dS^T through shared memory; and attention_bwd_dq_*_tiled:
//     grid (Hq, B, ceil(max_q_len / 128)), block 128, 128 query rows per CTA (32 per warp) and
//     key blocks of 32 absolute positions.  Their grids put the block index slowest so that
//     the heaviest causal blocks go first (tiled_cta_place).  See the "tiled" section below.
//     On sm_90 devices with the sm_90a image (D = 64 and 128), the host launches
//     attention_bwd_dkdv_*_wgmma_pair instead of _wide: grid (Hkv, B, ceil(max_k_len / 128)),
//     two warpgroups per CTA, each doing for its 64 keys exactly what one CTA of _wide does,
//     sharing the Q / dO tiles; wgmma, bitwise the same dk and dv (see the "wgmma pair"
//     section at the end); and
//     attention_bwd_dq_*_wgmma instead of _tiled: grid (Hq, B, ceil(max_q_len / 64)),
//     one warpgroup per 64 queries, wgmma, bitwise the same dq (the k16 key chunks of _tiled).
//
// Invariance contract: a sequence's dq, dk and dv are bitwise the same whatever batch it is in,
// wherever its rows sit in the packed tensors, whatever its neighbours and the padding hold,
// and run to run.  Why: every output element is owned by exactly one CTA (no atomics, no
// partial sums), and that CTA's sequence of floating-point operations is a function of the
// sequence's own lengths, its own rows and constants of the build (D, the block sizes, the
// instruction): the query blocks start at the sequence's first query, the key blocks at
// absolute key position 0, the loops run in a fixed order, and the blocks that are skipped
// are chosen from the sequence's lengths alone.  The batch size, B, max_q_len / max_k_len
// and the other sequences only change how many CTAs run (and the order the hardware schedules
// them in, which no result depends on).  Shared-memory fragment loads use ldmatrix or plain
// loads (kLdmatrix); both give the mma the same operand bits, so the same results.
#include "common/approx.cuh"
#include "common/hopper.cuh"
#include "common/mma_sync.cuh"
#include "common/portability.cuh"
#include "common/wgmma.cuh"

#if !defined(__HIPCC__)

namespace batchinv {
namespace attn_bwd {

constexpr int kThreads = 128;
constexpr int kKeyBlock = 64;   // keys per dK/dV CTA and per dQ step; absolute positions
constexpr int kDqQueryRows = 64;  // query rows per dQ CTA (16 per warp)
constexpr int kPad = 8;         // shared-memory row padding (elements): conflict-free fragments

// Query rows per step of the dK/dV kernel: fewer for D = 128 to keep the dK and dV
// accumulators (2 * D / 8 * 4 fp32 per thread) in registers.  Changes speed, not bits: the
// mma k16 steps over queries are the same sequence for any multiple of 16.
template <int D>
struct KvQueryRows {
    static constexpr int value = D >= 128 ? 32 : 64;
};

template <int D, int Rows>
struct TileBytes {
    static constexpr int value = Rows * (D + kPad) * 2;
};

// Dynamic shared memory of each kernel (the host computes the same numbers).  kBuffers = 2
// double-buffers the tiles a CTA streams (cp.async prefetch of the next step), 1 does not.
template <int D, int kBuffers>
struct DkdvShared {
    static constexpr int kRows = KvQueryRows<D>::value;
    static constexpr int value =
        2 * TileBytes<D, kKeyBlock>::value + kBuffers * (2 * TileBytes<D, kRows>::value + 2 * kRows * 4);
};
template <int D, int kBuffers>
struct DqShared {
    static constexpr int value = kBuffers * 2 * TileBytes<D, kKeyBlock>::value +
                                 2 * TileBytes<D, kDqQueryRows>::value + 2 * kDqQueryRows * 4;
};

// ---- elements ---------------------------------------------------------------------------

template <typename Codec>
__device__ __forceinline__ float load_bits(uint16_t bits) {
    if constexpr (Codec::kIsBf16) {
        return bf16_to_float(bits);
    } else {
        return __half2float(__ushort_as_half(bits));
    }
}

template <typename Codec>
__device__ __forceinline__ uint16_t store_bits(float value) {
    if constexpr (Codec::kIsBf16) {
        return float_to_bf16(value);
    } else {
        return __half_as_ushort(__float2half_rn(value));
    }
}

__device__ __forceinline__ uint32_t pack(uint16_t lo, uint16_t hi) {
    return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}

template <typename Codec>
__device__ __forceinline__ uint32_t pack_floats(float lo, float hi) {
    return pack(store_bits<Codec>(lo), store_bits<Codec>(hi));
}

// ---- fragment loads from shared memory (row stride S elements) -----------------------------

__device__ __forceinline__ uint32_t lds32(const uint16_t* p) { return *reinterpret_cast<const uint32_t*>(p); }

// A operand, rows m0..m0+15 and columns k0..k0+15 of a row-major [m][k] tile.
template <bool kLdmatrix, int S>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const uint16_t* tile, int m0, int k0, int lane) {
    if constexpr (kLdmatrix) {
        const int j = lane / 8;
        ldmatrix_x4(a, tile + (m0 + lane % 8 + (j & 1) * 8) * S + k0 + (j >> 1) * 8);
    } else {
        const int g = lane / 4, c = 2 * (lane % 4);
        a[0] = lds32(tile + (m0 + g) * S + k0 + c);
        a[1] = lds32(tile + (m0 + g + 8) * S + k0 + c);
        a[2] = lds32(tile + (m0 + g) * S + k0 + c + 8);
        a[3] = lds32(tile + (m0 + g + 8) * S + k0 + c + 8);
    }
}

// B operands of two n8 tiles (n0 and n0 + 8), k0..k0+15, from a tile stored [n][k]:
// b[0], b[1] for tile n0, b[2], b[3] for tile n0 + 8.
template <bool kLdmatrix, int S>
__device__ __forceinline__ void load_b_nk(uint32_t (&b)[4], const uint16_t* tile, int n0, int k0, int lane) {
    if constexpr (kLdmatrix) {
        const int j = lane / 8;
        ldmatrix_x4(b, tile + (n0 + lane % 8 + (j >> 1) * 8) * S + k0 + (j & 1) * 8);
    } else {
        const int g = lane / 4, c = 2 * (lane % 4);
        b[0] = lds32(tile + (n0 + g) * S + k0 + c);
        b[1] = lds32(tile + (n0 + g) * S + k0 + c + 8);
        b[2] = lds32(tile + (n0 + 8 + g) * S + k0 + c);
        b[3] = lds32(tile + (n0 + 8 + g) * S + k0 + c + 8);
    }
}

// The same from a tile stored [k][n] (transposed reads).
template <bool kLdmatrix, int S>
__device__ __forceinline__ void load_b_kn(uint32_t (&b)[4], const uint16_t* tile, int n0, int k0, int lane) {
    if constexpr (kLdmatrix) {
        const int j = lane / 8;
        ldmatrix_x4_trans(b, tile + (k0 + lane % 8 + (j & 1) * 8) * S + n0 + (j >> 1) * 8);
    } else {
        const int g = lane / 4, c = 2 * (lane % 4);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const uint16_t* col = tile + n0 + half * 8 + g;
            b[2 * half] = pack(col[(k0 + c) * S], col[(k0 + c + 1) * S]);
            b[2 * half + 1] = pack(col[(k0 + c + 8) * S], col[(k0 + c + 9) * S]);
        }
    }
}

// A operand of k-step t from accumulator tiles n = 2t and 2t + 1 (C layout -> A layout),
// rounded to the input dtype.
template <typename Codec>
__device__ __forceinline__ void a_from_acc(uint32_t (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
    a[0] = pack_floats<Codec>(lo[0], lo[1]);
    a[1] = pack_floats<Codec>(lo[2], lo[3]);
    a[2] = pack_floats<Codec>(hi[0], hi[1]);
    a[3] = pack_floats<Codec>(hi[2], hi[3]);
}

// ---- global -> shared ---------------------------------------------------------------------

// Rows [first_row, first_row + valid) of a [rows, heads, D] tensor (base points at the head's
// first element, row_stride = heads * D) into a Rows x (D + kPad) tile; slots of rows >= valid
// are zero-filled, never read from global memory.  kAsync: cp.async copies (the caller
// commits and waits), else plain loads.  Either way the tile holds the same bits.
template <int D, int Rows, bool kAsync, int kThreadCount = kThreads>
__device__ __forceinline__ void load_tile(uint16_t* tile, const uint16_t* base, int64_t row_stride,
                                          int first_row, int valid) {
    constexpr int kVectors = D / 8;
    for (int idx = threadIdx.x; idx < Rows * kVectors; idx += kThreadCount) {
        const int r = idx / kVectors;
        const int col = (idx % kVectors) * 8;
        uint16_t* dst = tile + r * (D + kPad) + col;
        const uint16_t* src = base + static_cast<int64_t>(first_row + r) * row_stride + col;
        if (r >= valid) {
            *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
        } else if constexpr (kAsync) {
            cp_async16(dst, src);
        } else {
            *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
        }
    }
}

// lse and delta of rows [first_row, first_row + valid) of head `head`; -inf / 0 past valid,
// so "lse != -inf" is the test for a row that takes part.
template <int Rows, int kThreadCount = kThreads>
__device__ __forceinline__ void load_row_stats(float* s_lse, float* s_delta, const float* lse,
                                               const float* delta, int64_t head_offset, int first_row,
                                               int valid) {
    for (int r = threadIdx.x; r < Rows; r += kThreadCount) {
        const bool ok = r < valid;
        s_lse[r] = ok ? lse[head_offset + first_row + r] : -INFINITY;
        s_delta[r] = ok ? delta[head_offset + first_row + r] : 0.0f;
    }
}

// p of one score in the forward's exponent form: 2^(s c - lse log2 e), c = scale log2 e, one
// rounding of the FMA, then the special function unit's 2^x (two instructions per score where
// expf takes eight; the two products depend on the row, not on the key).
__device__ __forceinline__ float score_probability(float s, float scale, float lse) {
    return exp2_ftz(__fmaf_rn(s, ieee_mul(scale, kLog2e), -ieee_mul(lse, kLog2e)));
}

// ds of one visible score.
__device__ __forceinline__ float score_grad(float p, float dp, float delta) {
    return ieee_mul(p, ieee_sub(dp, delta));
}

// p and ds of one score, the one formula both kernels use.
__device__ __forceinline__ void probability_and_grad(float& s_in_p_out, float& dp_in_ds_out, bool visible,
                                                     float lse, float delta, float scale) {
    const float p = visible ? score_probability(s_in_p_out, scale, lse) : 0.0f;
    dp_in_ds_out = visible ? score_grad(p, dp_in_ds_out, delta) : 0.0f;
    s_in_p_out = p;
}

// ---- delta = rowsum(dO * O) ------------------------------------------------------------------

// delta of one (query row, head): kDeltaLanes<D> = D / 8 adjacent lanes, lane j adding the
// products of elements 8 j .. 8 j + 7 in order from +0, then the lanes' sums added by an xor
// butterfly, a fixed tree ((c0 + c1) + (c2 + c3)) + ...; each lane adds the same two values at
// every level (fp32 addition commutes), so every lane ends with the tree's bits.  A row's 16-byte
// loads are adjacent: a warp reads 512 contiguous bytes of out and of dout.
template <int D>
constexpr int kDeltaLanes = D / 8;

template <typename Codec, int D>
__device__ __forceinline__ void delta_kernel(const uint16_t* out, const uint16_t* dout, const int* q_start,
                                             const int* q_len, float* delta, int num_q_heads, int64_t total_q) {
    constexpr int kLanes = kDeltaLanes<D>;
    static_assert(kLanes <= 32 && 32 % kLanes == 0 && kThreads % kLanes == 0, "a lane group within a warp");
    const int seq = blockIdx.y;
    const int64_t pair = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / kLanes;
    const int part = threadIdx.x % kLanes;
    const int64_t i = pair / num_q_heads;
    const int head = static_cast<int>(pair % num_q_heads);
    if (i >= q_len[seq]) return;  // the group's lanes share i: they leave together
    const int64_t row = q_start[seq] + i;
    const int64_t at = (row * num_q_heads + head) * D + 8 * part;
    const uint4 o4 = *reinterpret_cast<const uint4*>(out + at);
    const uint4 g4 = *reinterpret_cast<const uint4*>(dout + at);
    const uint16_t* o = reinterpret_cast<const uint16_t*>(&o4);
    const uint16_t* g = reinterpret_cast<const uint16_t*>(&g4);
    float sum = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) sum = ieee_add(sum, ieee_mul(load_bits<Codec>(g[e]), load_bits<Codec>(o[e])));
    const unsigned group = ((1u << kLanes) - 1u) << (threadIdx.x % 32 / kLanes * kLanes);
#pragma unroll
    for (int offset = 1; offset < kLanes; offset *= 2)
        sum = ieee_add(sum, __shfl_xor_sync(group, sum, offset, kLanes));
    if (part == 0) delta[head * total_q + row] = sum;
}

// ---- dK, dV ------------------------------------------------------------------------------------

// The two score products of a step for this warp's 16 rows m0.. of the A tiles: x = A1 B1^T and
// y = A2 B2^T over d in increasing k16 steps, accumulated into x and y (zero on entry); the B
// tiles are stored [n][k], NT n8 tiles.  The dK/dV step computes S^T and dP^T (A = K, V;
// B = Q, dO), the dQ step S and dP (A = Q, dO; B = K, V).
template <typename Codec, int D, bool kLdmatrix, int NT>
__device__ __forceinline__ void score_products(float (&x)[NT][4], float (&y)[NT][4], const uint16_t* a1,
                                               const uint16_t* a2, const uint16_t* b1, const uint16_t* b2, int m0,
                                               int lane) {
    constexpr int S = D + kPad;
#pragma unroll
    for (int k0 = 0; k0 < D; k0 += 16) {
        uint32_t a_1[4], a_2[4];
        load_a<kLdmatrix, S>(a_1, a1, m0, k0, lane);
        load_a<kLdmatrix, S>(a_2, a2, m0, k0, lane);
#pragma unroll
        for (int n = 0; n < NT; n += 2) {
            uint32_t b[4];
            load_b_nk<kLdmatrix, S>(b, b1, n * 8, k0, lane);
            mma_m16n8k16<Codec>(x[n], a_1, b[0], b[1]);
            mma_m16n8k16<Codec>(x[n + 1], a_1, b[2], b[3]);
            load_b_nk<kLdmatrix, S>(b, b2, n * 8, k0, lane);
            mma_m16n8k16<Codec>(y[n], a_2, b[0], b[1]);
            mma_m16n8k16<Codec>(y[n + 1], a_2, b[2], b[3]);
        }
    }
}

// One step of the dK/dV kernel: this warp's 16 keys against kRows queries of one head.
template <typename Codec, int D, bool kLdmatrix>
__device__ __forceinline__ void dkdv_step(float (&acc_dk)[D / 8][4], float (&acc_dv)[D / 8][4], const uint16_t* s_k,
                                          const uint16_t* s_v, const uint16_t* s_q, const uint16_t* s_do,
                                          const float* s_lse, const float* s_delta, int key0, int i0, int k_len,
                                          int offset, int causal, float scale) {
    constexpr int kRows = KvQueryRows<D>::value;
    constexpr int S = D + kPad;
    const int lane = threadIdx.x % 32;
    const int m0 = (threadIdx.x / 32) * 16;  // this warp's 16 keys within the block
    const int g = lane / 4, c = 2 * (lane % 4);

    // S^T = K Q^T and dP^T = V dO^T for this warp's 16 keys x kRows queries.
    float st[kRows / 8][4] = {};
    float dpt[kRows / 8][4] = {};
    score_products<Codec, D, kLdmatrix>(st, dpt, s_k, s_v, s_q, s_do, m0, lane);
    // P^T and dS^T in place.
#pragma unroll
    for (int n = 0; n < kRows / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int key = key0 + m0 + g + (e >= 2 ? 8 : 0);
            const int r = n * 8 + c + (e & 1);
            const float row_lse = s_lse[r];
            const bool visible = key < k_len && row_lse != -INFINITY && (!causal || key <= offset + i0 + r);
            probability_and_grad(st[n][e], dpt[n][e], visible, row_lse, s_delta[r], scale);
        }
    }
    // dV += P^T dO, dK += dS^T Q over the block's queries, k16 step by k16 step.
#pragma unroll
    for (int t = 0; t < kRows / 16; ++t) {
        uint32_t a_p[4], a_ds[4];
        a_from_acc<Codec>(a_p, st[2 * t], st[2 * t + 1]);
        a_from_acc<Codec>(a_ds, dpt[2 * t], dpt[2 * t + 1]);
#pragma unroll
        for (int n = 0; n < D / 8; n += 2) {
            uint32_t b[4];
            load_b_kn<kLdmatrix, S>(b, s_do, n * 8, t * 16, lane);
            mma_m16n8k16<Codec>(acc_dv[n], a_p, b[0], b[1]);
            mma_m16n8k16<Codec>(acc_dv[n + 1], a_p, b[2], b[3]);
            load_b_kn<kLdmatrix, S>(b, s_q, n * 8, t * 16, lane);
            mma_m16n8k16<Codec>(acc_dk[n], a_ds, b[0], b[1]);
            mma_m16n8k16<Codec>(acc_dk[n + 1], a_ds, b[2], b[3]);
        }
    }
}

// The step loop of the dK/dV and dQ kernels: step s's tiles are staged into buffer s % 2 by
// cp.async one step ahead (kAsync: the copy runs during the previous step) or into buffer 0 by
// plain loads at the top of the step; body(step, buffer) runs between two barriers.
template <bool kAsync, typename Stage, typename Body>
__device__ __forceinline__ void staged_steps(int steps, const Stage& stage, const Body& body) {
    if constexpr (kAsync) {
        if (steps > 0) stage(0, 0);
        cp_async_commit();
    }
    for (int step = 0; step < steps; ++step) {
        const int buffer = kAsync ? (step & 1) : 0;
        if constexpr (kAsync) {
            if (step + 1 < steps) stage(step + 1, buffer ^ 1);  // prefetch during this step
            cp_async_commit();
            cp_async_wait<1>();  // everything but the prefetch has landed
        } else {
            stage(step, 0);
        }
        __syncthreads();
        body(step, buffer);
        __syncthreads();  // this buffer is restaged next (or in two steps)
    }
    if constexpr (kAsync) cp_async_wait<0>();
}

template <typename Codec, int D, bool kLdmatrix, bool kAsync>
__device__ __forceinline__ void dkdv_kernel(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                            const uint16_t* dout, const float* lse, const float* delta,
                                            const int* q_start_of, const int* q_len_of, const int* k_start_of,
                                            const int* k_len_of, uint16_t* dk, uint16_t* dv, int num_q_heads,
                                            int num_kv_heads, int64_t total_q, int causal, float scale) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    constexpr int kRows = KvQueryRows<D>::value;
    constexpr int S = D + kPad;
    constexpr int kBuffers = kAsync ? 2 : 1;
    const int seq = blockIdx.z;
    const int kv_head = blockIdx.y;
    const int key_block = gridDim.x - 1 - blockIdx.x;  // most work first (causal); speed only
    const int k_len = k_len_of[seq];
    const int key0 = key_block * kKeyBlock;
    if (key0 >= k_len) return;
    const int q_len = q_len_of[seq];
    const int q_start = q_start_of[seq];
    const int k_start = k_start_of[seq];
    const int offset = k_len - q_len;  // absolute position of query 0
    const int group = num_q_heads / num_kv_heads;
    const int64_t q_stride = static_cast<int64_t>(num_q_heads) * D;
    const int64_t kv_stride = static_cast<int64_t>(num_kv_heads) * D;

    extern __shared__ __align__(16) uint16_t smem[];
    uint16_t* s_k = smem;
    uint16_t* s_v = s_k + kKeyBlock * S;
    uint16_t* s_q = s_v + kKeyBlock * S;        // kBuffers tiles
    uint16_t* s_do = s_q + kBuffers * kRows * S;  // kBuffers tiles
    float* s_lse = reinterpret_cast<float*>(s_do + kBuffers * kRows * S);
    float* s_delta = s_lse + kBuffers * kRows;

    const int key_rows = min(kKeyBlock, k_len - key0);
    load_tile<D, kKeyBlock, kAsync>(s_k, k + kv_head * D, kv_stride, k_start + key0, key_rows);
    load_tile<D, kKeyBlock, kAsync>(s_v, v + kv_head * D, kv_stride, k_start + key0, key_rows);

    // Steps: the group's query heads in increasing order, for each the query blocks from the
    // first that can see key0 (causal; queries before position key0 see none of these keys).
    const int first_query = causal ? max(0, key0 - offset) : 0;
    const int first_block = first_query / kRows;
    const int blocks_per_head = max(0, (q_len + kRows - 1) / kRows - first_block);
    const int steps = group * blocks_per_head;

    // Stage step `step` into buffer `buffer`: its Q and dO tiles, lse and delta.
    auto stage = [&](int step, int buffer) {
        const int head = kv_head * group + step / blocks_per_head;
        const int i0 = (first_block + step % blocks_per_head) * kRows;
        const int rows = min(kRows, q_len - i0);
        load_tile<D, kRows, kAsync>(s_q + buffer * kRows * S, q + head * D, q_stride, q_start + i0, rows);
        load_tile<D, kRows, kAsync>(s_do + buffer * kRows * S, dout + head * D, q_stride, q_start + i0, rows);
        load_row_stats<kRows>(s_lse + buffer * kRows, s_delta + buffer * kRows, lse, delta, head * total_q,
                              q_start + i0, rows);
    };

    float acc_dk[D / 8][4] = {};
    float acc_dv[D / 8][4] = {};
    staged_steps<kAsync>(steps, stage, [&](int step, int buffer) {
        const int i0 = (first_block + step % blocks_per_head) * kRows;
        dkdv_step<Codec, D, kLdmatrix>(acc_dk, acc_dv, s_k, s_v, s_q + buffer * kRows * S,
                                       s_do + buffer * kRows * S, s_lse + buffer * kRows,
                                       s_delta + buffer * kRows, key0, i0, k_len, offset, causal, scale);
    });

    const int lane = threadIdx.x % 32;
    const int m0 = (threadIdx.x / 32) * 16;
    const int g = lane / 4, c = 2 * (lane % 4);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int key = key0 + m0 + g + half * 8;
        if (key >= k_len) continue;
        const int64_t row = (static_cast<int64_t>(k_start) + key) * kv_stride + kv_head * D;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            const int col = n * 8 + c;
            *reinterpret_cast<uint32_t*>(dk + row + col) = pack_floats<Codec>(
                ieee_mul(acc_dk[n][2 * half], scale), ieee_mul(acc_dk[n][2 * half + 1], scale));
            *reinterpret_cast<uint32_t*>(dv + row + col) =
                pack_floats<Codec>(acc_dv[n][2 * half], acc_dv[n][2 * half + 1]);
        }
    }
#else
    __trap();  // mma.sync needs sm_80; the host refuses older devices
#endif
}

// ---- dQ ------------------------------------------------------------------------------------------

// One step of the dQ kernel: this warp's 16 queries against one block of 64 keys.
template <typename Codec, int D, bool kLdmatrix>
__device__ __forceinline__ void dq_step(float (&acc_dq)[D / 8][4], const uint16_t* s_q, const uint16_t* s_do,
                                        const uint16_t* s_k, const uint16_t* s_v, const float* s_lse,
                                        const float* s_delta, int key0, int i0, int k_len, int offset, int causal,
                                        float scale) {
    constexpr int S = D + kPad;
    const int lane = threadIdx.x % 32;
    const int m0 = (threadIdx.x / 32) * 16;  // this warp's 16 query rows within the block
    const int g = lane / 4, c = 2 * (lane % 4);

    // S = Q K^T and dP = dO V^T for this warp's 16 queries x kKeyBlock keys.
    float s[kKeyBlock / 8][4] = {};
    float dp[kKeyBlock / 8][4] = {};
    score_products<Codec, D, kLdmatrix>(s, dp, s_q, s_do, s_k, s_v, m0, lane);
#pragma unroll
    for (int n = 0; n < kKeyBlock / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = m0 + g + (e >= 2 ? 8 : 0);
            const int key = key0 + n * 8 + c + (e & 1);
            const float row_lse = s_lse[r];
            const bool visible = key < k_len && row_lse != -INFINITY && (!causal || key <= offset + i0 + r);
            probability_and_grad(s[n][e], dp[n][e], visible, row_lse, s_delta[r], scale);
        }
    }
    // dQ += dS K over the block's keys, k16 step by k16 step.
#pragma unroll
    for (int t = 0; t < kKeyBlock / 16; ++t) {
        uint32_t a_ds[4];
        a_from_acc<Codec>(a_ds, dp[2 * t], dp[2 * t + 1]);
#pragma unroll
        for (int n = 0; n < D / 8; n += 2) {
            uint32_t b[4];
            load_b_kn<kLdmatrix, S>(b, s_k, n * 8, t * 16, lane);
            mma_m16n8k16<Codec>(acc_dq[n], a_ds, b[0], b[1]);
            mma_m16n8k16<Codec>(acc_dq[n + 1], a_ds, b[2], b[3]);
        }
    }
}

template <typename Codec, int D, bool kLdmatrix, bool kAsync>
__device__ __forceinline__ void dq_kernel(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                          const uint16_t* dout, const float* lse, const float* delta,
                                          const int* q_start_of, const int* q_len_of, const int* k_start_of,
                                          const int* k_len_of, uint16_t* dq, int num_q_heads, int num_kv_heads,
                                          int64_t total_q, int causal, float scale) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    constexpr int kRows = kDqQueryRows;
    constexpr int S = D + kPad;
    constexpr int kBuffers = kAsync ? 2 : 1;
    const int seq = blockIdx.z;
    const int head = blockIdx.y;
    const int query_block = gridDim.x - 1 - blockIdx.x;  // most work first (causal); speed only
    const int q_len = q_len_of[seq];
    const int i0 = query_block * kRows;
    if (i0 >= q_len) return;
    const int k_len = k_len_of[seq];
    const int q_start = q_start_of[seq];
    const int k_start = k_start_of[seq];
    const int offset = k_len - q_len;
    const int kv_head = head / (num_q_heads / num_kv_heads);
    const int64_t q_stride = static_cast<int64_t>(num_q_heads) * D;
    const int64_t kv_stride = static_cast<int64_t>(num_kv_heads) * D;
    const int rows = min(kRows, q_len - i0);

    extern __shared__ __align__(16) uint16_t smem[];
    uint16_t* s_q = smem;
    uint16_t* s_do = s_q + kRows * S;
    uint16_t* s_k = s_do + kRows * S;                // kBuffers tiles
    uint16_t* s_v = s_k + kBuffers * kKeyBlock * S;  // kBuffers tiles
    float* s_lse = reinterpret_cast<float*>(s_v + kBuffers * kKeyBlock * S);
    float* s_delta = s_lse + kRows;

    load_tile<D, kRows, kAsync>(s_q, q + head * D, q_stride, q_start + i0, rows);
    load_tile<D, kRows, kAsync>(s_do, dout + head * D, q_stride, q_start + i0, rows);
    load_row_stats<kRows>(s_lse, s_delta, lse, delta, head * total_q, q_start + i0, rows);

    // Key blocks in increasing position, up to the last one any row of the block can see.
    int steps = (k_len + kKeyBlock - 1) / kKeyBlock;
    if (causal) {
        const int last_position = offset + i0 + rows - 1;
        steps = last_position < 0 ? 0 : min(steps, last_position / kKeyBlock + 1);
    }
    auto stage = [&](int step, int buffer) {
        const int key0 = step * kKeyBlock;
        const int valid = min(kKeyBlock, k_len - key0);
        load_tile<D, kKeyBlock, kAsync>(s_k + buffer * kKeyBlock * S, k + kv_head * D, kv_stride, k_start + key0,
                                        valid);
        load_tile<D, kKeyBlock, kAsync>(s_v + buffer * kKeyBlock * S, v + kv_head * D, kv_stride, k_start + key0,
                                        valid);
    };

    float acc_dq[D / 8][4] = {};
    staged_steps<kAsync>(steps, stage, [&](int step, int buffer) {
        dq_step<Codec, D, kLdmatrix>(acc_dq, s_q, s_do, s_k + buffer * kKeyBlock * S, s_v + buffer * kKeyBlock * S,
                                     s_lse, s_delta, step * kKeyBlock, i0, k_len, offset, causal, scale);
    });

    const int lane = threadIdx.x % 32;
    const int m0 = (threadIdx.x / 32) * 16;
    const int g = lane / 4, c = 2 * (lane % 4);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = m0 + g + half * 8;
        if (r >= rows) continue;
        const int64_t row = (static_cast<int64_t>(q_start) + i0 + r) * q_stride + head * D;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            *reinterpret_cast<uint32_t*>(dq + row + n * 8 + c) = pack_floats<Codec>(
                ieee_mul(acc_dq[n][2 * half], scale), ieee_mul(acc_dq[n][2 * half + 1], scale));
        }
    }
#else
    __trap();
#endif
}


// ---- "tiled" variant (the default): 32-row warp tiles, more warps per SM ---------------------
//
// The kernels above give each warp 16 rows of every product and, for the dK/dV kernel at
// D = 128, 236 registers per thread: two CTAs of 4 warps per SM, too few warps to hide the
// latency of the mma / ldmatrix chains behind the exp-heavy elementwise work.  Here:
//   dK/dV ("_wide" kernels, WideKv): a CTA owns the same 64 keys with 8 warps.  Per step of 64
//     queries, warp w computes S^T and dP^T for keys [32 (w / 4), +32) x queries
//     [16 (w % 4), +16), writes P^T and dS^T (rounded to the input dtype: exactly the bits the
//     other kernels feed the mma from registers) to shared memory, and after a barrier
//     accumulates dV and dK for keys [32 (w / 4), +32) x columns [D/4 (w % 4), +D/4) over the
//     step's queries in k16 steps.  125 registers and 88 KB of shared memory (Q/dO loaded at
//     the top of each step, no prefetch): two CTAs, 16 warps per SM.
//   dQ ("_tiled" kernels): a CTA owns 128 queries (4 warps of 32 rows: two m16 tiles share every
//     K/V fragment a warp loads) and walks the keys in blocks of 32, cp.async double buffered.
// Every element's arithmetic is the one of the other variants: s and dp are mma chains over d
// in k16 steps from zero, p and ds come from probability_and_grad with the same visibility,
// and dk/dv (dq) accumulate over the same k16 chunks of queries (keys) in the same order.  The
// only difference is how many chunks that are entirely invisible to an element (p = ds = +0
// by selection, so the mma adds exact zeros) run before its first or after its last visible
// one; that is a function of the sequence's lengths and the build constants, never of the
// batch, and the tests check that all variants give the same bits.  Selection is the same
// expression everywhere; a warp whose whole tile is inside the sequence and below the causal
// diagonal skips the position tests (they would all pass), never the selection on lse.

constexpr int kTiledDqRows = 128;     // queries per dQ CTA
constexpr int kTiledDqKeys = 32;      // keys per dQ step
constexpr int kTiledDqThreads = 128;  // 4 warps of 32 queries

// Shapes of a dK/dV CTA with P^T / dS^T through shared memory.  Phase 1 (S^T, dP^T) splits
// the kKeys x kRows tile over kWarpsK1 x (warps / kWarpsK1) warps, phase 2 (dK, dV) splits the
// kKeys x D accumulators over kWarpsK2 x (warps / kWarpsK2) warps.  kBuffers = 2 prefetches the
// next step's Q/dO with cp.async, 1 loads them at the top of each step (less shared memory,
// so that two CTAs fit an SM).
template <int D, int Keys, int Rows, int Threads, int WarpsK1, int WarpsK2, int Buffers, int MinBlocks>
struct KvShape {
    static constexpr int kKeys = Keys, kRows = Rows, kThreadCount = Threads, kBuffers = Buffers;
    static constexpr int kMinBlocks = MinBlocks;
    static constexpr int kWarps = Threads / 32;
    static constexpr int kKeysPerWarp1 = Keys / WarpsK1;
    static constexpr int kRowsPerWarp1 = Rows / (kWarps / WarpsK1);
    static constexpr int kQueryWarps1 = kWarps / WarpsK1;
    static constexpr int kKeysPerWarp2 = Keys / WarpsK2;
    static constexpr int kColsPerWarp2 = D / (kWarps / WarpsK2);
    static constexpr int kColWarps2 = kWarps / WarpsK2;
    static constexpr int kMt1 = kKeysPerWarp1 / 16, kNt1 = kRowsPerWarp1 / 8;
    static constexpr int kMt2 = kKeysPerWarp2 / 16, kNt2 = kColsPerWarp2 / 8;
    static constexpr int kScoreStride = Rows + kPad;
    static_assert(kMt1 >= 1 && kNt1 % 2 == 0 && kMt2 >= 1 && kNt2 % 2 == 0, "warp tiles of m16 x n16");
    static constexpr int kSharedBytes = 2 * TileBytes<D, Keys>::value +
                                        Buffers * (2 * TileBytes<D, Rows>::value + 2 * Rows * 4) +
                                        2 * Keys * kScoreStride * 2;
};
// 64 keys, 8 warps of 32 x 16 (phase 1) and 32 keys x D/4 (phase 2), no prefetch: two CTAs per
// SM.  (Measured slower: 128 keys with 8 warps of 32 x 32 and prefetch, one CTA per SM; 64 keys
// with 32-query steps and prefetch; see docs/tuning/attention_backward.md.)
template <int D>
using WideKv = KvShape<D, 64, 64, 256, 2, 2, 1, 2>;

template <int D>
struct TiledDqShared {
    static constexpr int value = 2 * TileBytes<D, kTiledDqRows>::value + 2 * 2 * TileBytes<D, kTiledDqKeys>::value +
                                 2 * kTiledDqRows * 4;
};

// Phase 1 of a dK/dV step: this warp's P^T and dS^T tile into s_pt / s_dst ([key][query]).
template <typename Codec, int D, typename Shape>
__device__ __forceinline__ void dkdv_tiled_scores(uint16_t* s_pt, uint16_t* s_dst, const uint16_t* s_k,
                                                  const uint16_t* s_v, const uint16_t* s_q, const uint16_t* s_do,
                                                  const float* s_lse, const float* s_delta, int key0, int i0,
                                                  int k_len, int offset, int causal, float scale) {
    constexpr int S = D + kPad;
    constexpr int SP = Shape::kScoreStride;
    constexpr int kMt = Shape::kMt1, kNt = Shape::kNt1;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int k_base = (warp / Shape::kQueryWarps1) * Shape::kKeysPerWarp1;  // keys within the block
    const int q_base = (warp % Shape::kQueryWarps1) * Shape::kRowsPerWarp1;  // queries within the step
    const int g = lane / 4, c = 2 * (lane % 4);

    float st[kMt][kNt][4] = {};
    float dpt[kMt][kNt][4] = {};
#pragma unroll
    for (int k0 = 0; k0 < D; k0 += 16) {
        uint32_t a_k[kMt][4], a_v[kMt][4];
#pragma unroll
        for (int mi = 0; mi < kMt; ++mi) {
            load_a<true, S>(a_k[mi], s_k, k_base + 16 * mi, k0, lane);
            load_a<true, S>(a_v[mi], s_v, k_base + 16 * mi, k0, lane);
        }
#pragma unroll
        for (int np = 0; np < kNt / 2; ++np) {
            uint32_t b[4];
            load_b_nk<true, S>(b, s_q, q_base + 16 * np, k0, lane);
#pragma unroll
            for (int mi = 0; mi < kMt; ++mi) {
                mma_m16n8k16<Codec>(st[mi][2 * np], a_k[mi], b[0], b[1]);
                mma_m16n8k16<Codec>(st[mi][2 * np + 1], a_k[mi], b[2], b[3]);
            }
            load_b_nk<true, S>(b, s_do, q_base + 16 * np, k0, lane);
#pragma unroll
            for (int mi = 0; mi < kMt; ++mi) {
                mma_m16n8k16<Codec>(dpt[mi][2 * np], a_v[mi], b[0], b[1]);
                mma_m16n8k16<Codec>(dpt[mi][2 * np + 1], a_v[mi], b[2], b[3]);
            }
        }
    }
    const int last_key = key0 + k_base + Shape::kKeysPerWarp1 - 1;
    const bool interior = last_key < k_len && (!causal || last_key <= offset + i0 + q_base);
#pragma unroll
    for (int mi = 0; mi < kMt; ++mi) {
#pragma unroll
        for (int ni = 0; ni < kNt; ++ni) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = key0 + k_base + 16 * mi + g + (e >= 2 ? 8 : 0);
                const int r = q_base + 8 * ni + c + (e & 1);
                const float row_lse = s_lse[r];
                const bool visible =
                    row_lse != -INFINITY && (interior || (key < k_len && (!causal || key <= offset + i0 + r)));
                probability_and_grad(st[mi][ni][e], dpt[mi][ni][e], visible, row_lse, s_delta[r], scale);
            }
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int at = (k_base + 16 * mi + g + 8 * half) * SP + q_base + 8 * ni + c;
                *reinterpret_cast<uint32_t*>(s_pt + at) =
                    pack_floats<Codec>(st[mi][ni][2 * half], st[mi][ni][2 * half + 1]);
                *reinterpret_cast<uint32_t*>(s_dst + at) =
                    pack_floats<Codec>(dpt[mi][ni][2 * half], dpt[mi][ni][2 * half + 1]);
            }
        }
    }
}

// Phase 2: dV += P^T dO and dK += dS^T Q for this warp's keys x columns, k16 query steps.
template <typename Codec, int D, typename Shape>
__device__ __forceinline__ void dkdv_tiled_accumulate(float (&acc_dk)[Shape::kMt2][Shape::kNt2][4],
                                                      float (&acc_dv)[Shape::kMt2][Shape::kNt2][4],
                                                      const uint16_t* s_pt, const uint16_t* s_dst,
                                                      const uint16_t* s_q, const uint16_t* s_do) {
    constexpr int S = D + kPad;
    constexpr int SP = Shape::kScoreStride;
    constexpr int kMt = Shape::kMt2, kNt = Shape::kNt2;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int k_base = (warp / Shape::kColWarps2) * Shape::kKeysPerWarp2;
    const int d_base = (warp % Shape::kColWarps2) * Shape::kColsPerWarp2;
#pragma unroll
    for (int t = 0; t < Shape::kRows / 16; ++t) {
        uint32_t a_p[kMt][4], a_ds[kMt][4];
#pragma unroll
        for (int mi = 0; mi < kMt; ++mi) {
            load_a<true, SP>(a_p[mi], s_pt, k_base + 16 * mi, 16 * t, lane);
            load_a<true, SP>(a_ds[mi], s_dst, k_base + 16 * mi, 16 * t, lane);
        }
#pragma unroll
        for (int np = 0; np < kNt / 2; ++np) {
            uint32_t b[4];
            load_b_kn<true, S>(b, s_do, d_base + 16 * np, 16 * t, lane);
#pragma unroll
            for (int mi = 0; mi < kMt; ++mi) {
                mma_m16n8k16<Codec>(acc_dv[mi][2 * np], a_p[mi], b[0], b[1]);
                mma_m16n8k16<Codec>(acc_dv[mi][2 * np + 1], a_p[mi], b[2], b[3]);
            }
            load_b_kn<true, S>(b, s_q, d_base + 16 * np, 16 * t, lane);
#pragma unroll
            for (int mi = 0; mi < kMt; ++mi) {
                mma_m16n8k16<Codec>(acc_dk[mi][2 * np], a_ds[mi], b[0], b[1]);
                mma_m16n8k16<Codec>(acc_dk[mi][2 * np + 1], a_ds[mi], b[2], b[3]);
            }
        }
    }
}

// Which CTA does which block (speed only, never the arithmetic): grid (heads, B, blocks) with
// the block slowest, so that the heaviest causal blocks (dK/dV: key block 0, dQ: the last
// query block) of every sequence and head are dispatched first and the light ones fill the
// tail (measured faster than (blocks, heads, B) with the light blocks first).
__device__ __forceinline__ void tiled_cta_place(int& seq, int& head, int& block, bool heaviest_is_last) {
    head = blockIdx.x;
    seq = blockIdx.y;
    block = heaviest_is_last ? gridDim.z - 1 - blockIdx.z : blockIdx.z;
}

template <typename Codec, int D, typename Shape>
__device__ __forceinline__ void dkdv_tiled_kernel(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                                  const uint16_t* dout, const float* lse, const float* delta,
                                                  const int* q_start_of, const int* q_len_of, const int* k_start_of,
                                                  const int* k_len_of, uint16_t* dk, uint16_t* dv, int num_q_heads,
                                                  int num_kv_heads, int64_t total_q, int causal, float scale) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    constexpr int kKeys = Shape::kKeys;
    constexpr int kRows = Shape::kRows;
    constexpr int kNT = Shape::kThreadCount;
    constexpr int kBuffers = Shape::kBuffers;
    constexpr int S = D + kPad;
    constexpr int SP = Shape::kScoreStride;
    int seq, kv_head, key_block;
    tiled_cta_place(seq, kv_head, key_block, false);
    const int k_len = k_len_of[seq];
    const int key0 = key_block * kKeys;
    if (key0 >= k_len) return;
    const int q_len = q_len_of[seq];
    const int q_start = q_start_of[seq];
    const int k_start = k_start_of[seq];
    const int offset = k_len - q_len;  // absolute position of query 0
    const int group = num_q_heads / num_kv_heads;
    const int64_t q_stride = static_cast<int64_t>(num_q_heads) * D;
    const int64_t kv_stride = static_cast<int64_t>(num_kv_heads) * D;

    extern __shared__ __align__(16) uint16_t smem[];
    uint16_t* s_k = smem;
    uint16_t* s_v = s_k + kKeys * S;
    uint16_t* s_q = s_v + kKeys * S;                 // kBuffers tiles
    uint16_t* s_do = s_q + kBuffers * kRows * S;     // kBuffers tiles
    uint16_t* s_pt = s_do + kBuffers * kRows * S;    // [kKeys][SP]
    uint16_t* s_dst = s_pt + kKeys * SP;             // [kKeys][SP]
    float* s_lse = reinterpret_cast<float*>(s_dst + kKeys * SP);  // kBuffers x kRows
    float* s_delta = s_lse + kBuffers * kRows;                     // kBuffers x kRows

    const int key_rows = min(kKeys, k_len - key0);
    load_tile<D, kKeys, true, kNT>(s_k, k + kv_head * D, kv_stride, k_start + key0, key_rows);
    load_tile<D, kKeys, true, kNT>(s_v, v + kv_head * D, kv_stride, k_start + key0, key_rows);

    // The group's query heads in increasing order, for each the query blocks from the first
    // that can see key0 (causal).
    const int first_query = causal ? max(0, key0 - offset) : 0;
    const int first_block = first_query / kRows;
    const int blocks_per_head = max(0, (q_len + kRows - 1) / kRows - first_block);
    const int steps = group * blocks_per_head;

    auto stage = [&](int step, int buffer) {
        const int head = kv_head * group + step / blocks_per_head;
        const int i0 = (first_block + step % blocks_per_head) * kRows;
        const int rows = min(kRows, q_len - i0);
        load_tile<D, kRows, true, kNT>(s_q + buffer * kRows * S, q + head * D, q_stride, q_start + i0, rows);
        load_tile<D, kRows, true, kNT>(s_do + buffer * kRows * S, dout + head * D, q_stride, q_start + i0, rows);
        load_row_stats<kRows, kNT>(s_lse + buffer * kRows, s_delta + buffer * kRows, lse, delta, head * total_q,
                                   q_start + i0, rows);
    };

    float acc_dk[Shape::kMt2][Shape::kNt2][4] = {};
    float acc_dv[Shape::kMt2][Shape::kNt2][4] = {};
    if (kBuffers == 2 && steps > 0) stage(0, 0);
    cp_async_commit();
    for (int step = 0; step < steps; ++step) {
        const int buffer = kBuffers == 2 ? (step & 1) : 0;
        if constexpr (kBuffers == 2) {
            if (step + 1 < steps) stage(step + 1, buffer ^ 1);  // prefetch during this step
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            stage(step, 0);
            cp_async_commit();
            cp_async_wait<0>();
        }
        __syncthreads();
        const int i0 = (first_block + step % blocks_per_head) * kRows;
        dkdv_tiled_scores<Codec, D, Shape>(s_pt, s_dst, s_k, s_v, s_q + buffer * kRows * S,
                                           s_do + buffer * kRows * S, s_lse + buffer * kRows,
                                           s_delta + buffer * kRows, key0, i0, k_len, offset, causal, scale);
        __syncthreads();  // P^T and dS^T are complete
        dkdv_tiled_accumulate<Codec, D, Shape>(acc_dk, acc_dv, s_pt, s_dst, s_q + buffer * kRows * S,
                                               s_do + buffer * kRows * S);
        __syncthreads();  // s_pt/s_dst and this buffer are rewritten next
    }
    cp_async_wait<0>();

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int k_base = (warp / Shape::kColWarps2) * Shape::kKeysPerWarp2;
    const int d_base = (warp % Shape::kColWarps2) * Shape::kColsPerWarp2;
    const int g = lane / 4, c = 2 * (lane % 4);
#pragma unroll
    for (int mi = 0; mi < Shape::kMt2; ++mi) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int key = key0 + k_base + 16 * mi + g + 8 * half;
            if (key >= k_len) continue;
            const int64_t row = (static_cast<int64_t>(k_start) + key) * kv_stride + kv_head * D;
#pragma unroll
            for (int j = 0; j < Shape::kNt2; ++j) {
                const int col = d_base + 8 * j + c;
                *reinterpret_cast<uint32_t*>(dk + row + col) = pack_floats<Codec>(
                    ieee_mul(acc_dk[mi][j][2 * half], scale), ieee_mul(acc_dk[mi][j][2 * half + 1], scale));
                *reinterpret_cast<uint32_t*>(dv + row + col) =
                    pack_floats<Codec>(acc_dv[mi][j][2 * half], acc_dv[mi][j][2 * half + 1]);
            }
        }
    }
#else
    __trap();
#endif
}

// One dQ step: this warp's 32 queries against one block of 32 keys.
template <typename Codec, int D>
__device__ __forceinline__ void dq_tiled_step(float (&acc_dq)[2][D / 8][4], const uint16_t* s_q,
                                              const uint16_t* s_do, const uint16_t* s_k, const uint16_t* s_v,
                                              const float* s_lse, const float* s_delta, int key0, int i0,
                                              int k_len, int offset, int causal, float scale) {
    constexpr int S = D + kPad;
    const int lane = threadIdx.x % 32;
    const int q_base = (threadIdx.x / 32) * 32;
    const int g = lane / 4, c = 2 * (lane % 4);

    float s[2][4][4] = {};
    float dp[2][4][4] = {};
#pragma unroll
    for (int k0 = 0; k0 < D; k0 += 16) {
        uint32_t a[2][4];
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) load_a<true, S>(a[mi], s_q, q_base + 16 * mi, k0, lane);
#pragma unroll
        for (int np = 0; np < 2; ++np) {
            uint32_t b[4];
            load_b_nk<true, S>(b, s_k, 16 * np, k0, lane);
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) {
                mma_m16n8k16<Codec>(s[mi][2 * np], a[mi], b[0], b[1]);
                mma_m16n8k16<Codec>(s[mi][2 * np + 1], a[mi], b[2], b[3]);
            }
        }
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) load_a<true, S>(a[mi], s_do, q_base + 16 * mi, k0, lane);
#pragma unroll
        for (int np = 0; np < 2; ++np) {
            uint32_t b[4];
            load_b_nk<true, S>(b, s_v, 16 * np, k0, lane);
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) {
                mma_m16n8k16<Codec>(dp[mi][2 * np], a[mi], b[0], b[1]);
                mma_m16n8k16<Codec>(dp[mi][2 * np + 1], a[mi], b[2], b[3]);
            }
        }
    }
    const int last_key = key0 + kTiledDqKeys - 1;
    const bool interior = last_key < k_len && (!causal || last_key <= offset + i0 + q_base);
#pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = q_base + 16 * mi + g + (e >= 2 ? 8 : 0);
                const int key = key0 + 8 * ni + c + (e & 1);
                const float row_lse = s_lse[r];
                const bool visible =
                    row_lse != -INFINITY && (interior || (key < k_len && (!causal || key <= offset + i0 + r)));
                probability_and_grad(s[mi][ni][e], dp[mi][ni][e], visible, row_lse, s_delta[r], scale);
            }
        }
    }
    // dQ += dS K over the block's keys, k16 step by k16 step.
#pragma unroll
    for (int t = 0; t < kTiledDqKeys / 16; ++t) {
        uint32_t a_ds[2][4];
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) a_from_acc<Codec>(a_ds[mi], dp[mi][2 * t], dp[mi][2 * t + 1]);
#pragma unroll
        for (int np = 0; np < D / 16; ++np) {
            uint32_t b[4];
            load_b_kn<true, S>(b, s_k, 16 * np, 16 * t, lane);
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) {
                mma_m16n8k16<Codec>(acc_dq[mi][2 * np], a_ds[mi], b[0], b[1]);
                mma_m16n8k16<Codec>(acc_dq[mi][2 * np + 1], a_ds[mi], b[2], b[3]);
            }
        }
    }
}

template <typename Codec, int D>
__device__ __forceinline__ void dq_tiled_kernel(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                                const uint16_t* dout, const float* lse, const float* delta,
                                                const int* q_start_of, const int* q_len_of, const int* k_start_of,
                                                const int* k_len_of, uint16_t* dq, int num_q_heads,
                                                int num_kv_heads, int64_t total_q, int causal, float scale) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    constexpr int kRows = kTiledDqRows;
    constexpr int kKeys = kTiledDqKeys;
    constexpr int kNT = kTiledDqThreads;
    constexpr int S = D + kPad;
    int seq, head, query_block;
    tiled_cta_place(seq, head, query_block, true);
    const int q_len = q_len_of[seq];
    const int i0 = query_block * kRows;
    if (i0 >= q_len) return;
    const int k_len = k_len_of[seq];
    const int q_start = q_start_of[seq];
    const int k_start = k_start_of[seq];
    const int offset = k_len - q_len;
    const int kv_head = head / (num_q_heads / num_kv_heads);
    const int64_t q_stride = static_cast<int64_t>(num_q_heads) * D;
    const int64_t kv_stride = static_cast<int64_t>(num_kv_heads) * D;
    const int rows = min(kRows, q_len - i0);

    extern __shared__ __align__(16) uint16_t smem[];
    uint16_t* s_q = smem;
    uint16_t* s_do = s_q + kRows * S;
    uint16_t* s_k = s_do + kRows * S;      // 2 tiles
    uint16_t* s_v = s_k + 2 * kKeys * S;  // 2 tiles
    float* s_lse = reinterpret_cast<float*>(s_v + 2 * kKeys * S);
    float* s_delta = s_lse + kRows;

    load_tile<D, kRows, true, kNT>(s_q, q + head * D, q_stride, q_start + i0, rows);
    load_tile<D, kRows, true, kNT>(s_do, dout + head * D, q_stride, q_start + i0, rows);
    load_row_stats<kRows, kNT>(s_lse, s_delta, lse, delta, head * total_q, q_start + i0, rows);

    // Key blocks in increasing position, up to the last one any row of the block can see.
    int steps = (k_len + kKeys - 1) / kKeys;
    if (causal) {
        const int last_position = offset + i0 + rows - 1;
        steps = last_position < 0 ? 0 : min(steps, last_position / kKeys + 1);
    }
    auto stage = [&](int step, int buffer) {
        const int key0 = step * kKeys;
        const int valid = min(kKeys, k_len - key0);
        load_tile<D, kKeys, true, kNT>(s_k + buffer * kKeys * S, k + kv_head * D, kv_stride, k_start + key0, valid);
        load_tile<D, kKeys, true, kNT>(s_v + buffer * kKeys * S, v + kv_head * D, kv_stride, k_start + key0, valid);
    };

    float acc_dq[2][D / 8][4] = {};
    if (steps > 0) stage(0, 0);
    cp_async_commit();
    for (int step = 0; step < steps; ++step) {
        const int buffer = step & 1;
        if (step + 1 < steps) stage(step + 1, buffer ^ 1);  // prefetch during this step
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        dq_tiled_step<Codec, D>(acc_dq, s_q, s_do, s_k + buffer * kKeys * S, s_v + buffer * kKeys * S, s_lse,
                                s_delta, step * kKeys, i0, k_len, offset, causal, scale);
        __syncthreads();  // this buffer is restaged next
    }
    cp_async_wait<0>();

    const int lane = threadIdx.x % 32;
    const int q_base = (threadIdx.x / 32) * 32;
    const int g = lane / 4, c = 2 * (lane % 4);
#pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = q_base + 16 * mi + g + 8 * half;
            if (r >= rows) continue;
            const int64_t row = (static_cast<int64_t>(q_start) + i0 + r) * q_stride + head * D;
#pragma unroll
            for (int n = 0; n < D / 8; ++n) {
                *reinterpret_cast<uint32_t*>(dq + row + n * 8 + c) = pack_floats<Codec>(
                    ieee_mul(acc_dq[mi][n][2 * half], scale), ieee_mul(acc_dq[mi][n][2 * half + 1], scale));
            }
        }
    }
#else
    __trap();
#endif
}

// ---- wgmma kernels (sm_90a, D = 64, 128): constants and helpers of the pair dK/dV and dQ kernels

[[maybe_unused]] constexpr int kWgKeys = 64;                // keys per warpgroup (16 per warp)
[[maybe_unused]] constexpr int kWgRows = 64;                // queries per step
[[maybe_unused]] constexpr int kWgThreads = 128;
[[maybe_unused]] constexpr int kWgBoxBytes = 64 * 128;      // 64 rows x 64 columns of 2 bytes
// A 64-row tile of D columns (D = 64 or 128): D / 64 boxes of 64 columns.
template <int D>
constexpr int kWgTileBytesOf = kWgRows * D * 2;

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Rows [first_row, first_row + valid) of a [rows, heads, D] tensor (base at the head's first
// element) into a swizzled 64 x D tile, by the 128 threads tid = 0..127 of one warpgroup:
// 16-byte chunk ch of row r at box ch / 8, chunk (ch % 8) ^ (r % 8).  Thread tid copies chunk
// tid % (D / 8) of rows tid / (D / 8) + (1024 / D) n: its swizzled column is the same for all
// of them.  Rows >= valid are zero-filled, never read.  Tid: the caller's type (threadIdx.x's
// unsigned, or int), kept because the index arithmetic, and so the kernel's code, differs
// between the two.
template <int D, typename Tid>
__device__ __forceinline__ void wg_load_tile(uint8_t* tile, const uint16_t* base, int64_t row_stride, int first_row,
                                             int valid, Tid tid) {
    constexpr int kChunks = D / 8;               // 16-byte chunks per row
    constexpr int kPassRows = kWgThreads / kChunks;  // rows per pass of the 128 threads: 8 or 16
    const int ch = tid % kChunks;
    const int r0 = tid / kChunks;
    const int swizzle = kPassRows == 8 ? r0 : r0 % 8;  // r0 % 8 (r0 < 8 at D = 128)
    const uint32_t dst = smem_address(tile + (ch / 8) * kWgBoxBytes + r0 * 128 + (((ch % 8) ^ swizzle) << 4));
    const uint16_t* src = base + static_cast<int64_t>(first_row + r0) * row_stride + ch * 8;
    const int64_t pass_stride = kPassRows * row_stride;  // one add per pass, no multiply
#pragma unroll
    for (int n = 0; n < kWgRows / kPassRows; ++n, src += pass_stride) {
        const bool ok = r0 + kPassRows * n < valid;
        cp_async16_zfill(dst + n * kPassRows * 128, ok ? src : base, ok);
    }
}

// N-major B operand descriptor (dO / Q as the B of dV / dK: k = query rows, n = d): the two
// 64-column boxes kWgBoxBytes apart (leading byte offset), 8-row groups 1024 bytes apart.
__device__ __forceinline__ uint64_t wg_desc_nmajor(const void* tile) {
    uint64_t desc = (smem_address(tile) & 0x3FFFF) >> 4;
    desc |= static_cast<uint64_t>(kWgBoxBytes >> 4) << 16;
    desc |= static_cast<uint64_t>(1024 >> 4) << 32;
    desc |= 1ull << 62;
    return desc;
}

// `desc` with its start address moved by `offset` 16-byte units: a 32-bit add on the low word,
// which holds the address field (bits 0-13; shared-memory addresses < 256 KB never carry into
// the next field), so that no 64-bit add is issued per wgmma.
__device__ __forceinline__ uint64_t wg_desc_offset(uint64_t desc, uint32_t offset) {
    uint64_t moved;
    asm("mov.b64 %0, {%1, %2};"
        : "=l"(moved)
        : "r"(static_cast<uint32_t>(desc) + offset), "r"(static_cast<uint32_t>(desc >> 32)));
    return moved;
}

using hopper::fence_operands;  // register fences around wgmma (common/hopper.cuh)
using hopper::fence_registers;



// ---- What the wgmma kernels (pair dK/dV, dQ) do the same way (one copy, so that the two cannot
// drift apart: their bits must match the mma.sync kernels step for step).

// Bytes from raw (the dynamic shared memory) to its first 1024-byte boundary, where swizzled
// tiles must start.  The caller adds it to the array itself, so that the compiler keeps knowing
// these are shared-memory pointers (a helper returning the pointer changed the compiled code).
__device__ __forceinline__ uint32_t wg_bytes_to_1024(const void* raw) {
    return (1024u - (smem_address(raw) & 1023u)) & 1023u;
}

// The head of a dQ key block: the block's cp.async copies landed in every thread and are
// visible to the wgmma (async proxy).
__device__ __forceinline__ void wg_wait_staged() {
    cp_async_wait<0>();
    hopper::fence_proxy_async_shared();  // the cp.async writes before the wgmma (async proxy) reads
    __syncthreads();                     // every thread's copies landed
}

// A step's two score products over d = D (S and dP, or their transposes): each from a zero
// accumulator in D / 16 increasing k16 steps (32 bytes along a swizzled row, box ks / 4), the
// mma.sync chain whose bits they must match; one commit group each, so that the caller can
// wait for the first while the second runs.  A descriptors are the caller's, B tiles K-major.
template <typename Codec, int D>
__device__ __forceinline__ void wg_issue_score_products(float (&first)[32], uint64_t desc_a_first,
                                                        const uint8_t* tile_b_first, float (&second)[32],
                                                        uint64_t desc_a_second, const uint8_t* tile_b_second) {
#pragma unroll
    for (int i = 0; i < 32; ++i) first[i] = second[i] = 0.0f;
    const uint64_t desc_b_first = hopper::smem_descriptor_128b(tile_b_first);
    const uint64_t desc_b_second = hopper::smem_descriptor_128b(tile_b_second);
    fence_operands<32>(first);
    fence_operands<32>(second);
    hopper::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
        const int off = ((ks / 4) * kWgBoxBytes + (ks % 4) * 32) >> 4;
        wgmma::mma<Codec>(first, wg_desc_offset(desc_a_first, off), wg_desc_offset(desc_b_first, off));
    }
    hopper::wgmma_commit();
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
        const int off = ((ks / 4) * kWgBoxBytes + (ks % 4) * 32) >> 4;
        wgmma::mma<Codec>(second, wg_desc_offset(desc_a_second, off), wg_desc_offset(desc_b_second, off));
    }
    hopper::wgmma_commit();
}

// pack_floats<Codec>(lo, hi) in one instruction: cvt.rn rounds to nearest even, as pack_floats'
// software rounding does, so every non-NaN value gives the same bits.  A NaN may get another NaN
// pattern, which only ever feeds a wgmma (NaN in, NaN out; outputs are rounded by pack_floats).
template <typename Codec>
__device__ __forceinline__ uint32_t wg_pack_rn(float lo, float hi) {
    uint32_t packed;
    if constexpr (Codec::kIsBf16) {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(hi), "f"(lo));
    }
    return packed;
}

// Accumulator pairs rounded to the input dtype as the register A operand of four k16 steps:
// a_from_acc's packing, the bits the mma.sync kernels write to shared memory and read back.
template <typename Codec>
__device__ __forceinline__ void wg_pack_a(uint32_t (&a)[4][4], const float (&x)[32]) {
#pragma unroll
    for (int t = 0; t < 4; ++t)
#pragma unroll
        for (int j = 0; j < 4; ++j) a[t][j] = wg_pack_rn<Codec>(x[8 * t + 2 * j], x[8 * t + 2 * j + 1]);
}

// ds = p * (dp - delta) (probability_and_grad's second line) in place of dp, computed for every
// element and then selected by the visibility bit that p's pass kept; delta_of(i) is the
// element's row delta (the kernels hold their rows differently).  Callers capture by value: a
// by-reference lambda changed the compiled code (the PTX is kept identical to the unshared form).
template <typename DeltaOf>
__device__ __forceinline__ void wg_select_ds(float (&dp)[32], const float (&p)[32], uint32_t visible_mask,
                                             DeltaOf delta_of) {
#pragma unroll
    for (int i = 0; i < 32; ++i) {
        const bool visible = (visible_mask >> i) & 1u;
        float ds = score_grad(p[i], dp[i], delta_of(i));
        asm volatile("" : "+f"(ds));  // computed unconditionally, then selected
        dp[i] = visible ? ds : 0.0f;
    }
}

// wg_select_ds where every element is visible: the same expression, no selection.
template <typename DeltaOf>
__device__ __forceinline__ void wg_grad_ds(float (&dp)[32], const float (&p)[32], DeltaOf delta_of) {
#pragma unroll
    for (int i = 0; i < 32; ++i) dp[i] = score_grad(p[i], dp[i], delta_of(i));
}

// acc += A B over the first `Chunks` k16 steps in increasing order (B N-major: step t is 16
// rows of 128 bytes further; N = 2 * Acc, the product's shape chosen by the array), one commit
// group.
template <typename Codec, int Chunks, int Acc>
__device__ __forceinline__ void wg_issue_grad_product(float (&acc)[Acc], const uint32_t (&a)[4][4], uint64_t ndesc_b) {
    hopper::wgmma_fence();
#pragma unroll
    for (int t = 0; t < Chunks; ++t) wgmma::mma_rs<Codec>(acc, a[t], wg_desc_offset(ndesc_b, (t * 16 * 128) >> 4));
    hopper::wgmma_commit();
}

#endif

// ---- "wgmma pair" dK/dV kernel (sm_90a, D = 64 and 128): `_wide`'s arithmetic on wgmma ---
//
// Replaces the `_wide` dK/dV launch of the "tiled" variant on sm_90 devices with the sm_90a
// image (py/batchinv/gpu/attention_backward.py; USE_WGMMA_DKDV = False forces `_wide`); dk and
// dv are bitwise those of `_wide` (tested).  Grid (Hkv, B, ceil(max_k_len / 128)), heavy-first.
// One CTA of two warpgroups (8 warps) owns 128 keys [128 J, 128 J + 128) of a sequence and kv
// head; warpgroup w owns the 64 keys [128 J + 64 w, 128 J + 64 w + 64) (warp w' of it 16 of
// them), the keys of one `_wide` CTA, and does for them exactly `_wide`'s per-key work:
//   - The walk: the group's query heads in increasing order, for each the query blocks of 64
//     from the first that sees the warpgroup's first key (causal), in increasing position.
//   - Shared memory: K and V of each warpgroup (loaded once) and two buffers of Q and dO (64
//     rows each, prefetched one step ahead with cp.async) as 128-byte-swizzled tiles of D / 64
//     64-column boxes (the layout of attention_hopper.cu's K/V stages); rows past the sequence
//     are zero-filled (cp.async with source size 0), never read.  lse and delta of the step's
//     rows likewise (zero-filled past the rows; the selection treats those rows as lse = -inf,
//     as `_wide`).
//   - S^T = K Q^T and dP^T = V dO^T: wgmma m64n64k16 (A = K / V, B = Q / dO, both K-major
//     from shared memory) over d in increasing k16 steps from a zero accumulator: the mma.sync
//     chain of `_wide`.  Two commit groups: p is computed once S^T is complete, while dP^T
//     runs.  Warp w' holds keys 16w'..16w'+15 of the warpgroup's tile exactly as mma.sync holds
//     a 16-row tile (accumulator i = element i % 4 of n8 tile i / 4), so p and ds are the same
//     selection and the same IEEE steps (probability_and_grad's expressions, split in two
//     passes: p first, then ds, with the visibility kept as a bit mask).  Where the warp's 16
//     keys are visible to every row of the step (most steps), both passes skip the selection.
//   - P^T and dS^T rounded to the input dtype become the register A operand (a_from_acc's
//     packing, the bits `_wide` writes to shared memory and reads back with ldmatrix) of
//     dV += P^T dO and dK += dS^T Q: wgmma m64nDk16 with dO / Q N-major from shared memory,
//     the four k16 query steps in increasing order.  The dV product is issued before dS is
//     computed and runs meanwhile.
//   - dk = round(acc_dk * scale), dv = round(acc_dv): `_wide`'s final step.
// That wgmma and mma.sync give the same bits for the same k16 step sequence is a measured
// property of the GPU (linear.cu, attention_hopper.cu), checked bitwise against `_wide` by
// tests/gpu/test_attention_backward_cuda.py.
// What the two warpgroups share is the copy of each step's Q, dO, lse and delta tiles in shared
// memory (half the fill traffic per key of one warpgroup per CTA): the CTA walks warpgroup 0's
// steps (its first block is <= warpgroup 1's), warpgroup 0 copies Q, lse and delta, warpgroup 1
// dO, and a warpgroup whose keys cannot see a step's queries (causal: the steps before its own
// first block; or it has no keys in the sequence) only copies and releases the buffer: it skips
// the step, it never adds zero chunks.  Per buffer, a "full" mbarrier completes when every
// thread's copies into it landed (cp.async arrivals) and an "empty" one when both warpgroups
// are done with it, so the warpgroups meet only through the buffers, not at a barrier per step.
// Shared memory: K and V of each warpgroup, two buffers of Q, dO, lse and delta, four
// mbarriers: 133 152 bytes at D = 128 (67 616 at D = 64), one CTA (8 warps) per SM.

[[maybe_unused]] constexpr int kWgPairThreads = 256;
[[maybe_unused]] constexpr int kWgPairKeys = 128;  // keys per CTA (64 per warpgroup)
// Buffers of a step's Q, dO, lse and delta, each released by an mbarrier rather than a CTA
// barrier: a warpgroup starts a step's products as soon as the step's copies landed, while the
// other may still finish the previous step (three buffers measured no faster).
[[maybe_unused]] constexpr int kWgPairStages = 2;
// K and V of both warpgroups, the stages' Q, dO, lse and delta, a full and an empty mbarrier
// per stage, 1024 of alignment.
template <int D>
constexpr int kWgPairSharedBytes =
    (4 + 2 * kWgPairStages) * kWgTileBytesOf<D> + kWgPairStages * (2 * kWgRows * 4 + 2 * 8) + 1024;

template <typename Codec, int D>
__device__ __forceinline__ void dkdv_wgmma_pair_kernel(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                                       const uint16_t* dout, const float* lse, const float* delta,
                                                       const int* q_start_of, const int* q_len_of,
                                                       const int* k_start_of, const int* k_len_of, uint16_t* dk,
                                                       uint16_t* dv, int num_q_heads, int num_kv_heads,
                                                       int64_t total_q, int causal, float scale) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using namespace hopper;
    constexpr int kTile = kWgTileBytesOf<D>;
    int seq, kv_head, key_block;
    tiled_cta_place(seq, kv_head, key_block, false);
    const int k_len = k_len_of[seq];
    const int cta_key0 = key_block * kWgPairKeys;
    if (cta_key0 >= k_len) return;
    const int q_len = q_len_of[seq];
    const int q_start = q_start_of[seq];
    const int k_start = k_start_of[seq];
    const int offset = k_len - q_len;  // absolute position of query 0
    const int group = num_q_heads / num_kv_heads;
    const int64_t q_stride = static_cast<int64_t>(num_q_heads) * D;
    const int64_t kv_stride = static_cast<int64_t>(num_kv_heads) * D;
    // The warpgroup, broadcast from lane 0 so that the compiler knows it is warp-uniform (the
    // wgmma descriptors derived from it then live in uniform registers).
    const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / kWgThreads), 0);
    const int t = threadIdx.x % kWgThreads;   // thread within the warpgroup
    const int key0 = cta_key0 + wg * kWgKeys;  // this warpgroup's first key (absolute position)

    extern __shared__ __align__(16) uint16_t smem[];
    uint8_t* raw = reinterpret_cast<uint8_t*>(smem);
    uint8_t* shared = raw + wg_bytes_to_1024(raw);
    uint8_t* s_k = shared + wg * kTile;            // this warpgroup's K
    uint8_t* s_v = shared + (2 + wg) * kTile;      // and V
    uint8_t* s_q = shared + 4 * kTile;                          // kWgPairStages buffers
    uint8_t* s_do = s_q + kWgPairStages * kTile;                // kWgPairStages buffers
    float* s_stats = reinterpret_cast<float*>(s_do + kWgPairStages * kTile);  // [stage][lse 64, delta 64]
    // full[b]: every thread's copies into buffer b landed (each thread arrives once its own
    // copies did); empty[b]: every thread is done reading buffer b (its products retired).
    uint64_t* full = reinterpret_cast<uint64_t*>(s_stats + kWgPairStages * 2 * kWgRows);
    uint64_t* empty = full + kWgPairStages;
    if (threadIdx.x == 0) {
#pragma unroll
        for (int b = 0; b < kWgPairStages; ++b) {
            barrier_init(full + b, kWgPairThreads);
            barrier_init(empty + b, kWgPairThreads);
        }
    }
    __syncthreads();  // the barriers exist before any thread arrives on them

    // Keys past the sequence (all of warpgroup 1's when k_len <= key0) are zero-filled.  Their
    // copies land before the first step's full barrier completes (it counts every earlier copy).
    const int key_rows = min(kWgKeys, k_len - key0);
    wg_load_tile<D>(s_k, k + kv_head * D, kv_stride, k_start + key0, key_rows, t);
    wg_load_tile<D>(s_v, v + kv_head * D, kv_stride, k_start + key0, key_rows, t);

    // The CTA walks warpgroup 0's steps (`_wide`'s walk for key cta_key0); this warpgroup's
    // own walk is the subsequence of steps whose block is >= its own first block.
    const int blocks = (q_len + kWgRows - 1) / kWgRows;
    const int cta_first_block = (causal ? max(0, cta_key0 - offset) : 0) / kWgRows;
    // No keys in the sequence (warpgroup 1 when k_len <= key0): no step at all.
    const int own_first_block =
        key0 < k_len ? (causal ? max(0, key0 - offset) : 0) / kWgRows : 0x7fffffff;
    const int blocks_per_head = max(0, blocks - cta_first_block);
    const int steps = group * blocks_per_head;

    // Step `step`'s copies into its buffer, once the step that used the buffer before is done
    // in both warpgroups: warpgroup 0 copies Q (and lse, delta), warpgroup 1 dO.  Everything
    // from the kernel's parameters and threadIdx (no derived pointers: the step already takes
    // all 255 registers).
    auto stage = [&](int head, int block, int step) {
        const int buffer = step % kWgPairStages;
        if (step >= kWgPairStages) barrier_wait(empty + buffer, (step / kWgPairStages - 1) & 1);
        const int i0 = block * kWgRows;
        const int rows = min(kWgRows, q_len - i0);
        if (threadIdx.x < kWgThreads) {
            wg_load_tile<D>(s_q + buffer * kTile, q + head * D, q_stride, q_start + i0, rows,
                         static_cast<int>(threadIdx.x));
            const int r = threadIdx.x % kWgRows;
            const bool ok = r < rows;
            const float* src = threadIdx.x < kWgRows ? lse : delta;
            const int64_t at = static_cast<int64_t>(head) * total_q + q_start + i0 + r;
            cp_async4_zfill(smem_address(s_stats + buffer * 2 * kWgRows + threadIdx.x), ok ? src + at : src, ok);
        } else {
            wg_load_tile<D>(s_do + buffer * kTile, dout + head * D, q_stride, q_start + i0, rows,
                         static_cast<int>(threadIdx.x - kWgThreads));
        }
        barrier_arrive_on_copies(full + buffer);
    };

    const int lane = threadIdx.x % 32;
    const int g = lane / 4, c = 2 * (lane % 4);
    // This warp's first key (absolute position): key0 + 16 * (warp within the warpgroup).
    const int warp_key0 = cta_key0 + 16 * static_cast<int>(threadIdx.x / 32);
    const uint64_t desc_k = smem_descriptor_128b(s_k);
    const uint64_t desc_v = smem_descriptor_128b(s_v);

    constexpr int kAcc = D / 2;  // accumulators of a 64 x D product per thread
    float acc_dk[kAcc], acc_dv[kAcc];
#pragma unroll
    for (int i = 0; i < kAcc; ++i) acc_dk[i] = acc_dv[i] = 0.0f;

    // The CTA's walk as (head, block) carried from step to step (no division per step: fewer
    // live registers); `advance` moves to the next step and stages it.
    int head = kv_head * group, block = cta_first_block;
    auto advance = [&](int step) {
        if (++block == blocks) {
            block = cta_first_block;
            ++head;
        }
        if (step + 1 < steps) stage(head, block, step + 1);
    };
    // Steps this warpgroup's keys cannot see (causal: before its own first block; all of them
    // when it has no keys) are skipped, as its own walk (that of `_wide`'s CTA for these keys)
    // never takes them: the warpgroup only stages the next step and releases the buffer.
    // Warpgroup-uniform.  (A `continue` inside the step loop instead makes ptxas spill in the
    // bf16 build.)
    auto skip_invisible = [&](int& step) {
        while (step < steps && block < own_first_block) {
            advance(step);
            barrier_arrive(empty + step % kWgPairStages);
            ++step;
        }
    };

    if (steps > 0) stage(head, block, 0);
    int step = 0;
    skip_invisible(step);
    for (; step < steps; ++step, skip_invisible(step)) {
        const int buffer = step % kWgPairStages;
        barrier_wait(full + buffer, (step / kWgPairStages) & 1);  // both warpgroups' copies landed
        fence_proxy_async_shared();  // the cp.async writes before the wgmma (async proxy) reads

        const uint8_t* tq = s_q + buffer * kTile;
        const uint8_t* tdo = s_do + buffer * kTile;
        const float* s_lse = s_stats + buffer * 2 * kWgRows;
        const float* s_delta = s_lse + kWgRows;
        const int i0 = block * kWgRows;
        const int rows = min(kWgRows, q_len - i0);

        // From here on the warpgroup's own step, as for 64 keys alone.
        float st[32], dpt[32];
        wg_issue_score_products<Codec, D>(st, desc_k, tq, dpt, desc_v, tdo);
        advance(step);  // the next step's Q, dO, lse and delta while the products run
        wgmma_wait<1>();  // S^T is complete; dP^T may still run
        fence_operands<32>(st);

        // Interior steps (most of them): the warp's 16 keys are visible to all 64 rows (a full
        // block, before the first row's position and the sequence's end, every row with an lse),
        // so p and ds need no selection: the visible elements' expressions, hence their bits.
        const int warp_last_key = warp_key0 + 15;
        bool interior = rows == kWgRows && warp_last_key < k_len && (!causal || warp_last_key <= offset + i0);
        if (interior) {
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) interior &= s_lse[8 * j + c + e] != -INFINITY;
        }
        interior = __all_sync(0xffffffffu, interior);
        uint32_t visible_mask = 0u;
        if (interior) {
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float row_lse = s_lse[8 * j + c + e];
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int i = 4 * j + 2 * h + e;
                        st[i] = score_probability(st[i], scale, row_lse);
                    }
                }
        } else {
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int r = 8 * j + c + e;
                    const float row_lse = r < rows ? s_lse[r] : -INFINITY;
                    const int last_seen =
                        row_lse == -INFINITY ? -1 : (causal ? min(k_len - 1, offset + i0 + r) : k_len - 1);
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int i = 4 * j + 2 * h + e;
                        const bool visible = warp_key0 + g + 8 * h <= last_seen;
                        visible_mask |= static_cast<uint32_t>(visible) << i;
                        float p = score_probability(st[i], scale, row_lse);
                        asm volatile("" : "+f"(p));  // computed unconditionally, then selected
                        st[i] = visible ? p : 0.0f;
                    }
                }
        }
        uint32_t a_p[4][4], a_ds[4][4];
        wg_pack_a<Codec>(a_p, st);
        const uint64_t ndesc_do = wg_desc_nmajor(tdo);
        const uint64_t ndesc_q = wg_desc_nmajor(tq);
        fence_operands<kAcc>(acc_dv);
        fence_registers(a_p);
        wg_issue_grad_product<Codec, 4>(acc_dv, a_p, ndesc_do);
        wgmma_wait<1>();  // dP^T is complete; dV may still run
        fence_operands<32>(dpt);

        if (interior)
            wg_grad_ds(dpt, st, [=](int i) { return s_delta[8 * (i / 4) + c + (i % 2)]; });
        else
            wg_select_ds(dpt, st, visible_mask, [=](int i) { return s_delta[8 * (i / 4) + c + (i % 2)]; });
        wg_pack_a<Codec>(a_ds, dpt);
        fence_operands<kAcc>(acc_dk);
        fence_registers(a_ds);
        wg_issue_grad_product<Codec, 4>(acc_dk, a_ds, ndesc_q);
        wgmma_wait<0>();
        fence_operands<kAcc>(acc_dv);
        fence_operands<kAcc>(acc_dk);
        fence_registers(a_p);
        fence_registers(a_ds);
        barrier_arrive(empty + buffer);  // this warpgroup's reads of the buffer retired
    }
    cp_async_commit();  // (the copies were never committed in groups)
    cp_async_wait<0>();

    // Accumulator i: key 16 * warp + g + 8 * ((i / 2) % 2), column 8 * (i / 4) + c + i % 2.
    // The sequence's first key row read again (a memory clobber of the loop keeps the compiler
    // from reusing the first read): one register fewer live through the loop.
    const int k_start_out = k_start_of[seq];
#pragma unroll
    for (int i = 0; i < kAcc; i += 2) {
        const int key = warp_key0 + g + ((i / 2) % 2) * 8;
        if (key >= k_len) continue;
        const int64_t at = (static_cast<int64_t>(k_start_out) + key) * kv_stride + kv_head * D + 8 * (i / 4) + c;
        *reinterpret_cast<uint32_t*>(dk + at) =
            pack_floats<Codec>(ieee_mul(acc_dk[i], scale), ieee_mul(acc_dk[i + 1], scale));
        *reinterpret_cast<uint32_t*>(dv + at) = pack_floats<Codec>(acc_dv[i], acc_dv[i + 1]);
    }
#elif defined(__CUDA_ARCH__)
    __trap();  // built only into sm_90a images; the host never launches it elsewhere
#endif
}

// ---- "wgmma" dQ kernel (sm_90a, D = 64 and 128): the `_tiled` dQ kernel's arithmetic on wgmma
//
// Replaces the `_tiled` dQ launch of the "tiled" variant where the wgmma dK/dV kernel runs
// (py/batchinv/gpu/attention_backward.py); dq is bitwise that of `_tiled` (tested).  One
// warpgroup (128 threads) per CTA owns 64 query rows of a sequence and head (aligned to its
// first query; warp w holds rows 16w..16w+15 as mma.sync holds a 16-row tile), grid
// (Hq, B, ceil(max_q_len / 64)) heavy-first.
//   - Q and dO of the rows loaded once; K and V in blocks of 64 absolute key positions,
//     copied with cp.async at the top of each block into one buffer (no prefetch: three CTAs per
//     SM, which one buffer allows, hide the copies better than two CTAs with a prefetch did),
//     128-byte-swizzled 64 x D tiles as in the dK/dV kernel, rows past the sequence zero-filled.
//   - S = Q K^T and dP = dO V^T: wgmma m64n64k16 (A = Q / dO, B = K / V, K-major) over d in
//     increasing k16 steps from zero, the mma.sync chains of `_tiled`; p and ds are
//     probability_and_grad's steps with the same visibility, computed for every element and
//     then selected (as in the dK/dV kernel).
//   - dS rounded to the input dtype is the register A operand of dQ += dS K (m64nDk16, K
//     N-major from shared memory), the key block's k16 chunks in increasing order.
//   - The k16 key chunks are exactly `_tiled`'s: that kernel walks 128-row blocks in 32-key
//     steps up to the last key its 128 rows can see, so a row of this CTA takes the chunks
//     [0, 32 * steps) with `steps` computed for the enclosing 128-row block (the last 64-key
//     block may take only its first two chunks).  Chunks a row cannot see add exact zeros
//     (ds = +0 by selection); taking the same ones keeps even the sign of a zero the same.
//   - dq = round(acc * scale): `_tiled`'s final step.

[[maybe_unused]] constexpr int kWgDqRows = 64;  // queries per CTA (one warpgroup, 16 per warp)
[[maybe_unused]] constexpr int kWgDqCtasPerSm = 3;  // registers and the shared memory below fit three
// Q, dO, one buffer of K and V, 1024 bytes of alignment.
template <int D>
constexpr int kWgDqSharedBytes = 4 * kWgTileBytesOf<D> + 1024;

template <typename Codec, int D>
__device__ __forceinline__ void dq_wgmma_kernel(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                                const uint16_t* dout, const float* lse, const float* delta,
                                                const int* q_start_of, const int* q_len_of, const int* k_start_of,
                                                const int* k_len_of, uint16_t* dq, int num_q_heads,
                                                int num_kv_heads, int64_t total_q, int causal, float scale) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using namespace hopper;
    constexpr int kTile = kWgTileBytesOf<D>;
    int seq, head, query_block;
    tiled_cta_place(seq, head, query_block, true);
    const int q_len = q_len_of[seq];
    const int i0 = query_block * kWgDqRows;
    if (i0 >= q_len) return;
    const int k_len = k_len_of[seq];
    const int q_start = q_start_of[seq];
    const int k_start = k_start_of[seq];
    const int offset = k_len - q_len;
    const int kv_head = head / (num_q_heads / num_kv_heads);
    const int64_t q_stride = static_cast<int64_t>(num_q_heads) * D;
    const int64_t kv_stride = static_cast<int64_t>(num_kv_heads) * D;
    const int rows = min(kWgDqRows, q_len - i0);

    extern __shared__ __align__(16) uint16_t smem[];
    uint8_t* raw = reinterpret_cast<uint8_t*>(smem);
    uint8_t* shared = raw + wg_bytes_to_1024(raw);
    uint8_t* s_q = shared;
    uint8_t* s_do = s_q + kTile;
    uint8_t* s_k = s_do + kTile;
    uint8_t* s_v = s_k + kTile;

    wg_load_tile<D>(s_q, q + head * D, q_stride, q_start + i0, rows, threadIdx.x);
    wg_load_tile<D>(s_do, dout + head * D, q_stride, q_start + i0, rows, threadIdx.x);

    // `_tiled`'s key chunks: 32-key steps up to the last key its 128-row block can see.
    int chunks;
    {
        const int tiled_i0 = (i0 / kTiledDqRows) * kTiledDqRows;
        const int tiled_rows = min(kTiledDqRows, q_len - tiled_i0);
        int steps = (k_len + kTiledDqKeys - 1) / kTiledDqKeys;
        if (causal) {
            const int last_position = offset + tiled_i0 + tiled_rows - 1;
            steps = last_position < 0 ? 0 : min(steps, last_position / kTiledDqKeys + 1);
        }
        chunks = steps * (kTiledDqKeys / 16);
    }
    const int blocks = (chunks + 3) / 4;  // key blocks of 64 (four k16 chunks)

    auto stage = [&](int block) {
        const int key0 = block * kWgKeys;
        const int valid = min(kWgKeys, k_len - key0);
        wg_load_tile<D>(s_k, k + kv_head * D, kv_stride, k_start + key0, valid, threadIdx.x);
        wg_load_tile<D>(s_v, v + kv_head * D, kv_stride, k_start + key0, valid, threadIdx.x);
    };

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, c = 2 * (lane % 4);
    // This thread's two rows (16 warp + g + 8 h): lse, delta, and the last key each sees
    // (-1: none; rows past the CTA's rows or with lse = -inf see none), `_tiled`'s predicate
    // "lse != -inf, key < k_len and, causal, key <= position".
    float row_lse[2], row_delta[2];
    int last_seen[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = 16 * warp + g + 8 * h;
        const bool ok = r < rows;
        const int64_t at = static_cast<int64_t>(head) * total_q + q_start + i0 + r;
        row_lse[h] = ok ? lse[at] : -INFINITY;
        row_delta[h] = ok ? delta[at] : 0.0f;
        last_seen[h] = row_lse[h] == -INFINITY ? -1 : (causal ? min(k_len - 1, offset + i0 + r) : k_len - 1);
    }

    const uint64_t desc_q = smem_descriptor_128b(s_q);
    const uint64_t desc_do = smem_descriptor_128b(s_do);

    constexpr int kAcc = D / 2;  // accumulators of a 64 x D product per thread
    float acc_dq[kAcc];
#pragma unroll
    for (int i = 0; i < kAcc; ++i) acc_dq[i] = 0.0f;

    cp_async_commit();  // Q and dO (waited for with the first block)
    for (int block = 0; block < blocks; ++block) {
        stage(block);
        cp_async_commit();
        wg_wait_staged();

        const uint8_t* tk = s_k;
        const uint8_t* tv = s_v;
        const int key0 = block * kWgKeys;

        // S and dP over d in increasing k16 steps (32 bytes along a swizzled row).
        float s[32], dp[32];
        wg_issue_score_products<Codec, D>(s, desc_q, tk, dp, desc_do, tv);
        wgmma_wait<1>();  // S is complete; dP may still run
        fence_operands<32>(s);

        // p: accumulator i is row 16 warp + g + 8 ((i / 2) % 2), key key0 + 8 (i / 4) + c + i % 2.
        // Interior blocks (the whole block visible to the warp's 16 rows; most blocks) take p
        // and ds with no selection: the visible elements' expressions, hence their bits.
        const bool interior = __all_sync(0xffffffffu, key0 + kWgKeys - 1 <= min(last_seen[0], last_seen[1]));
        uint32_t visible_mask = 0u;
        if (interior) {
#pragma unroll
            for (int i = 0; i < 32; ++i) s[i] = score_probability(s[i], scale, row_lse[(i / 2) % 2]);
        } else {
#pragma unroll
            for (int i = 0; i < 32; ++i) {
                const int h = (i / 2) % 2;
                const int key = key0 + 8 * (i / 4) + c + (i % 2);
                const bool visible = key <= last_seen[h];
                visible_mask |= static_cast<uint32_t>(visible) << i;
                float p = score_probability(s[i], scale, row_lse[h]);
                asm volatile("" : "+f"(p));  // computed unconditionally, then selected
                s[i] = visible ? p : 0.0f;
            }
        }
        wgmma_wait<0>();  // dP is complete
        fence_operands<32>(dp);
        uint32_t a_ds[4][4];
        if (interior)
            wg_grad_ds(dp, s, [=](int i) { return row_delta[(i / 2) % 2]; });
        else
            wg_select_ds(dp, s, visible_mask, [=](int i) { return row_delta[(i / 2) % 2]; });
        wg_pack_a<Codec>(a_ds, dp);

        // dQ += dS K over the block's k16 chunks in increasing order (`_tiled`'s chunks only).
        const uint64_t ndesc_k = wg_desc_nmajor(tk);
        fence_operands<kAcc>(acc_dq);
        fence_registers(a_ds);
        if (chunks - 4 * block >= 4)
            wg_issue_grad_product<Codec, 4>(acc_dq, a_ds, ndesc_k);
        else
            wg_issue_grad_product<Codec, 2>(acc_dq, a_ds, ndesc_k);
        wgmma_wait<0>();
        fence_operands<kAcc>(acc_dq);
        fence_registers(a_ds);
        __syncthreads();  // every warp's products read the buffer before the next block's copies
    }
    cp_async_wait<0>();

    // Accumulator i: row 16 * warp + g + 8 * ((i / 2) % 2), column 8 * (i / 4) + c + i % 2.
#pragma unroll
    for (int i = 0; i < kAcc; i += 2) {
        const int r = 16 * warp + g + ((i / 2) % 2) * 8;
        if (r >= rows) continue;
        const int64_t at = (static_cast<int64_t>(q_start) + i0 + r) * q_stride + head * D + 8 * (i / 4) + c;
        *reinterpret_cast<uint32_t*>(dq + at) =
            pack_floats<Codec>(ieee_mul(acc_dq[i], scale), ieee_mul(acc_dq[i + 1], scale));
    }
#elif defined(__CUDA_ARCH__)
    __trap();  // built only into sm_90a images; the host never launches it elsewhere
#endif
}

}  // namespace attn_bwd
}  // namespace batchinv

#define BATCHINV_ATTN_BWD_DELTA(DTYPE, CODEC, D)                                                              \
    extern "C" __global__ void __launch_bounds__(batchinv::attn_bwd::kThreads)                                \
        attention_bwd_delta_##DTYPE##_d##D(const uint16_t* out, const uint16_t* dout, const int* q_start,      \
                                           const int* q_len, float* delta, int num_q_heads, int64_t total_q) { \
        batchinv::attn_bwd::delta_kernel<CODEC, D>(out, dout, q_start, q_len, delta, num_q_heads, total_q);    \
    }

#define BATCHINV_ATTN_BWD_DKDV(DTYPE, CODEC, D, SUFFIX, LDMATRIX, ASYNC)                                               \
    extern "C" __global__ void __launch_bounds__(batchinv::attn_bwd::kThreads)                                \
        attention_bwd_dkdv_##DTYPE##_d##D##SUFFIX(                                                              \
        const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* dout, const float* lse,        \
        const float* delta, const int* q_start, const int* q_len, const int* k_start, const int* k_len,         \
        uint16_t* dk, uint16_t* dv, int num_q_heads, int num_kv_heads, int64_t total_q, int causal,             \
        float scale) {                                                                                          \
        batchinv::attn_bwd::dkdv_kernel<CODEC, D, LDMATRIX, ASYNC>(q, k, v, dout, lse, delta, q_start, q_len, k_start,  \
                                                            k_len, dk, dv, num_q_heads, num_kv_heads, total_q,   \
                                                            causal, scale);                                     \
    }

#define BATCHINV_ATTN_BWD_DQ(DTYPE, CODEC, D, SUFFIX, LDMATRIX, ASYNC)                                                 \
    extern "C" __global__ void __launch_bounds__(batchinv::attn_bwd::kThreads)                                \
        attention_bwd_dq_##DTYPE##_d##D##SUFFIX(                                                                \
        const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* dout, const float* lse,        \
        const float* delta, const int* q_start, const int* q_len, const int* k_start, const int* k_len,         \
        uint16_t* dq, int num_q_heads, int num_kv_heads, int64_t total_q, int causal, float scale) {            \
        batchinv::attn_bwd::dq_kernel<CODEC, D, LDMATRIX, ASYNC>(q, k, v, dout, lse, delta, q_start, q_len, k_start,    \
                                                          k_len, dq, num_q_heads, num_kv_heads, total_q, causal, \
                                                          scale);                                               \
    }

#define BATCHINV_ATTN_BWD_DKDV_SHAPED(DTYPE, CODEC, D, SUFFIX, SHAPE)                                         \
    extern "C" __global__ void __launch_bounds__(SHAPE<D>::kThreadCount, SHAPE<D>::kMinBlocks)                \
        attention_bwd_dkdv_##DTYPE##_d##D##SUFFIX(                                                              \
        const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* dout, const float* lse,        \
        const float* delta, const int* q_start, const int* q_len, const int* k_start, const int* k_len,         \
        uint16_t* dk, uint16_t* dv, int num_q_heads, int num_kv_heads, int64_t total_q, int causal,             \
        float scale) {                                                                                          \
        batchinv::attn_bwd::dkdv_tiled_kernel<CODEC, D, SHAPE<D>>(q, k, v, dout, lse, delta, q_start, q_len,    \
                                                                  k_start, k_len, dk, dv, num_q_heads,          \
                                                                  num_kv_heads, total_q, causal, scale);        \
    }

#define BATCHINV_ATTN_BWD_TILED(DTYPE, CODEC, D)                                                               \
    BATCHINV_ATTN_BWD_DKDV_SHAPED(DTYPE, CODEC, D, _wide, batchinv::attn_bwd::WideKv)                          \
    extern "C" __global__ void __launch_bounds__(batchinv::attn_bwd::kTiledDqThreads)                          \
        attention_bwd_dq_##DTYPE##_d##D##_tiled(                                                                \
        const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* dout, const float* lse,        \
        const float* delta, const int* q_start, const int* q_len, const int* k_start, const int* k_len,         \
        uint16_t* dq, int num_q_heads, int num_kv_heads, int64_t total_q, int causal, float scale) {            \
        batchinv::attn_bwd::dq_tiled_kernel<CODEC, D>(q, k, v, dout, lse, delta, q_start, q_len, k_start,       \
                                                      k_len, dq, num_q_heads, num_kv_heads, total_q, causal,    \
                                                      scale);                                                   \
    }

// Variants: dtype x head dim x how tiles reach the mma ("_ldsm": ldmatrix; "_lds": plain shared
// loads; "_async": ldmatrix with cp.async double buffering).  All give the mma the same operand
// bits in the same order, so the same results (tested); they differ in speed only.
#define BATCHINV_ATTN_BWD_ALL(DTYPE, CODEC, D)                                  \
    BATCHINV_ATTN_BWD_DELTA(DTYPE, CODEC, D)                                    \
    BATCHINV_ATTN_BWD_DKDV(DTYPE, CODEC, D, _ldsm, true, false)                 \
    BATCHINV_ATTN_BWD_DKDV(DTYPE, CODEC, D, _lds, false, false)                 \
    BATCHINV_ATTN_BWD_DKDV(DTYPE, CODEC, D, _async, true, true)                 \
    BATCHINV_ATTN_BWD_DQ(DTYPE, CODEC, D, _ldsm, true, false)                   \
    BATCHINV_ATTN_BWD_DQ(DTYPE, CODEC, D, _lds, false, false)                   \
    BATCHINV_ATTN_BWD_DQ(DTYPE, CODEC, D, _async, true, true)                   \
    BATCHINV_ATTN_BWD_TILED(DTYPE, CODEC, D)

BATCHINV_ATTN_BWD_ALL(bf16, batchinv::Bf16Codec, 64)
BATCHINV_ATTN_BWD_ALL(bf16, batchinv::Bf16Codec, 128)
BATCHINV_ATTN_BWD_ALL(f16, batchinv::F16Codec, 64)
BATCHINV_ATTN_BWD_ALL(f16, batchinv::F16Codec, 128)

#define BATCHINV_ATTN_BWD_DKDV_WGMMA_PAIR(DTYPE, CODEC, D)                                                     \
    extern "C" __global__ void __launch_bounds__(batchinv::attn_bwd::kWgPairThreads, 1)                        \
        attention_bwd_dkdv_##DTYPE##_d##D##_wgmma_pair(                                                         \
        const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* dout, const float* lse,        \
        const float* delta, const int* q_start, const int* q_len, const int* k_start, const int* k_len,         \
        uint16_t* dk, uint16_t* dv, int num_q_heads, int num_kv_heads, int64_t total_q, int causal,             \
        float scale) {                                                                                          \
        batchinv::attn_bwd::dkdv_wgmma_pair_kernel<CODEC, D>(q, k, v, dout, lse, delta, q_start, q_len, k_start, \
                                                          k_len, dk, dv, num_q_heads, num_kv_heads, total_q,    \
                                                          causal, scale);                                       \
    }

BATCHINV_ATTN_BWD_DKDV_WGMMA_PAIR(bf16, batchinv::Bf16Codec, 64)
BATCHINV_ATTN_BWD_DKDV_WGMMA_PAIR(bf16, batchinv::Bf16Codec, 128)
BATCHINV_ATTN_BWD_DKDV_WGMMA_PAIR(f16, batchinv::F16Codec, 64)
BATCHINV_ATTN_BWD_DKDV_WGMMA_PAIR(f16, batchinv::F16Codec, 128)

#define BATCHINV_ATTN_BWD_DQ_WGMMA(DTYPE, CODEC, D)                                                            \
    extern "C" __global__ void __launch_bounds__(batchinv::attn_bwd::kWgThreads,                               \
                                                 batchinv::attn_bwd::kWgDqCtasPerSm)                           \
        attention_bwd_dq_##DTYPE##_d##D##_wgmma(                                                                \
        const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* dout, const float* lse,        \
        const float* delta, const int* q_start, const int* q_len, const int* k_start, const int* k_len,         \
        uint16_t* dq, int num_q_heads, int num_kv_heads, int64_t total_q, int causal, float scale) {            \
        batchinv::attn_bwd::dq_wgmma_kernel<CODEC, D>(q, k, v, dout, lse, delta, q_start, q_len, k_start, k_len, \
                                                   dq, num_q_heads, num_kv_heads, total_q, causal, scale);      \
    }

BATCHINV_ATTN_BWD_DQ_WGMMA(bf16, batchinv::Bf16Codec, 64)
BATCHINV_ATTN_BWD_DQ_WGMMA(bf16, batchinv::Bf16Codec, 128)
BATCHINV_ATTN_BWD_DQ_WGMMA(f16, batchinv::F16Codec, 64)
BATCHINV_ATTN_BWD_DQ_WGMMA(f16, batchinv::F16Codec, 128)

#endif  // !__HIPCC__

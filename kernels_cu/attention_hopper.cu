// Attention forward, tile mode, on Hopper (sm_90a): the FlashAttention-3 structure (TMA
// producer warpgroup, two wgmma consumer warpgroups) computing EXACTLY the per-row arithmetic
// of kernels_cu/attention.cu's tile kernel.  d = 128, bf16 and fp16, causal and not.
//
// Canonical layout and row contract: those of kernels_cu/attention.cu (read its header), mode
// (a) only: one CTA per (query tile, head group, sequence) walks all splits of its tile and
// merges them as it goes.  Differences are in who computes what, never in the arithmetic:
//   - Tile rows: M = 128 (two consumer warpgroups of 64 rows, four warps of 16 rows each),
//     row r = (query qtile * QPT + r / P, head hg * P + r % P) as in attention.cu.  A warp's 16
//     rows are held exactly as mma.sync holds them: wgmma's accumulator i of a thread is
//     element (i / 4, i % 4) of mma.sync's n8 tile, so every per-row step (block max scan in
//     column order + quad butterfly, exp2_ftz, the sum scan + butterfly, alpha, P rounding,
//     the -0 restore, the split merge, finalize) is the same code on the same values.
//   - S = Q K^T of two 64-key blocks (j even, j + 1) as one wgmma m64n128k16 chain, Q and K
//     from 128B-swizzled shared memory, over d in increasing k16 steps (D += A * B from a zero
//     accumulator, as the mma.sync chain): each S element is the same dot product as in a
//     per-block product.  The softmax stays per 64-key block: the two max trees are
//     independent, m and l are updated block j then block j + 1, and the two exp2 / sum chains
//     are independent (twice the work between waits).  A tile with an odd block count computes
//     a phantom block j + 1 past its end (its stage not loaded); every real row masks all its
//     keys (m, l unchanged) and its P V product is never issued.
//   - O += P V: wgmma m64n128k16 with P (rounded to the input dtype) as the register A
//     operand, V N-major from shared memory, the four k16 key steps in increasing order.
//   That wgmma and mma.sync give the same bits for the same k16 step sequence is a measured
//   property of the GPU (as in linear.cu), checked bitwise on every run by
//   tests/gpu/test_attention_hopper_cuda.py against the mma.sync tile and split kernels.
//   - Overlap (pair step j): P V of block j - 2 is issued with the pair's S; once it is
//     complete acc *= alpha_{j-1} and P V of block j - 1 is issued, and runs while the pair's
//     softmax is computed.  acc is rescaled by alpha_{j+1} only after P_j V_j completes, so
//     acc = (acc * alpha_j + P_j V_j) * alpha_{j+1} ... as in attention.cu.
//     The two consumer warpgroups interleave on the SM.  When block j ends a split, block
//     j+1's softmax starts the new split from the empty state (the ended split's m, l are
//     kept) while P_j V_j runs; the split is merged (attention.cu's merge_weights /
//     merge_value) once that product completes, and acc restarts from +0.  That step is its
//     own copy of the loop body, so the other steps rescale acc in place (no register copies).
//   - The softmax of a thread's two rows runs as one pass (padding rows are computed and never
//     written); the block max is a tree (exact), and P's selection for rows that see no key of
//     the block runs only in warps that have such a row.  Same values as attention.cu's code.
//   - No register that an in-flight wgmma reads or writes is touched before its wait: P of
//     block j+1 is packed into the A registers only after P_j V_j completes, and nothing but
//     wgmma runs between the two issues (ptxas would otherwise serialise every wgmma, C7513).
//   - Loads: one producer thread issues TMA copies of 64-key K and V blocks (two 64-column
//     boxes each, 128B swizzle) into a ring of kStages = 4 shared-memory stages (K stored
//     [column half][stage][key] so that a pair's 128 keys are contiguous; K and V each with
//     their own mbarriers full / empty, a K stage freed once its S product is complete);
//     blocks no row of the tile sees are not loaded.  Q is copied once per consumer
//     warpgroup with cp.async (zeros for rows that are not a query).
//   - Key rows past k_len: TMA reads whole 64-row boxes inside the K/V tensors, so the last
//     block of a sequence can bring rows j >= k_len (the next sequence's rows, cache slots
//     never written, NaN).  Before any consumer reads that stage the producer warp overwrites
//     those K and V rows with zeros in shared memory, so the consumers see exactly the
//     zero-filled tile attention.cu's cp.async builds.  Such rows are read from global memory
//     but never used.  Query rows past q_len are never read.
// Launch: grid (ceil(max_q_len / QPT), Hq / P, B), block 384 threads (warpgroup 0 = producer),
// dynamic shared memory attn_hopper_shared_bytes (py/batchinv/gpu/attention_hopper.py).
#include "common/hopper.cuh"
#include "common/wgmma.cuh"

#if !defined(__HIPCC__)
#include "common/attention_rows.cuh"

#include <type_traits>

namespace batchinv {
namespace attn_hopper {

using namespace attn;  // the shared per-row arithmetic (common/attention_rows.cuh)

[[maybe_unused]] constexpr int kD = 128;
[[maybe_unused]] constexpr int kRows = 128;          // tile rows: two consumer warpgroups of 64
[[maybe_unused]] constexpr int kConsumerThreads = 256;
[[maybe_unused]] constexpr int kStages = 4;  // K/V ring depth, even: a block pair's K stages are adjacent
[[maybe_unused]] constexpr int kBoxBytes = 64 * 128;  // 64 rows x 64 columns x 2 bytes
[[maybe_unused]] constexpr int kTileBytes = 2 * kBoxBytes;  // 64 rows x 128 columns
[[maybe_unused]] constexpr int kQBytes = 2 * 2 * kBoxBytes;  // two warpgroups x two column halves
[[maybe_unused]] constexpr int kRunBytes = 64 * kConsumerThreads * 4;  // fp32 running acc: 64 per thread

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}


// Pins register values around an asynchronous wgmma: without it the compiler may move their
// reads or writes across the issue or the wait, and ptxas then serialises the pipeline.
template <int N>
__device__ __forceinline__ void fence_operands(float* r) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// N-major descriptor of a V tile (two 64-column boxes of 64 key rows, 128B swizzle): 8-key
// row groups 1024 bytes apart (stride byte offset), the two 64-column halves 8192 bytes apart
// (leading byte offset).
__device__ __forceinline__ uint64_t v_descriptor(const void* tile) {
    const uint64_t address = hopper::smem_address(tile);
    uint64_t desc = (address & 0x3FFFF) >> 4;
    desc |= static_cast<uint64_t>(kBoxBytes >> 4) << 16;
    desc |= static_cast<uint64_t>(1024 >> 4) << 32;
    desc |= 1ull << 62;
    return desc;
}

__device__ __forceinline__ void fence_registers(uint32_t (&r)[4][4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
}

template <typename Codec>
__device__ __forceinline__ void mma_qk(float (&s)[64], uint64_t desc_q, uint64_t desc_k) {
    if constexpr (Codec::kIsBf16)
        wgmma::mma_m64n128k16_bf16(s, desc_q, desc_k);
    else
        wgmma::mma_m64n128k16_f16(s, desc_q, desc_k);
}

template <typename Codec>
__device__ __forceinline__ void mma_pv(float (&acc)[64], const uint32_t (&a)[4], uint64_t desc_v) {
    if constexpr (Codec::kIsBf16)
        wgmma::mma_rs_m64n128k16_bf16(acc, a, desc_v);
    else
        wgmma::mma_rs_m64n128k16_f16(acc, a, desc_v);
}

#endif

struct Params {
    const void* q;
    void* out;
    float* lse;
    const int* q_start;
    const int* q_len;
    const int* k_start;
    const int* k_len;
    int64_t q_row, q_head, out_row, out_head;
    int tq, hq, hkv, pack, causal;
    float scale_log2;
};

template <typename Codec>
__device__ __forceinline__ void attn_hopper_tile(const TensorMap& map_k, const TensorMap& map_v, const Params& p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using namespace hopper;
    using T = typename Codec::storage;
    extern __shared__ uint8_t shared_raw[];
    // 128-byte swizzled tiles start on a 1024-byte boundary.
    uint8_t* shared = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(shared_raw) + 1023) & ~uintptr_t(1023));
    uint8_t* sq = shared;                                   // [2 warpgroups][2 halves][64][64]
    uint8_t* sk = sq + kQBytes;                             // [2 halves][kStages][64][64]
    uint8_t* sv = sk + kStages * kTileBytes;                // [kStages][2 halves][64][64]
    float* srun = reinterpret_cast<float*>(sv + kStages * kTileBytes);  // [64][256]
    // K and V have their own full / empty barriers: a K stage is free once the pair's S
    // product is complete, long before its V stage (free after P V), which gives the pair
    // step's S (two K stages at once) a block of slack in a 4-stage ring.
    uint64_t* full_k = reinterpret_cast<uint64_t*>(reinterpret_cast<uint8_t*>(srun) + kRunBytes);
    uint64_t* full_v = full_k + kStages;
    uint64_t* empty_k = full_v + kStages;
    uint64_t* empty_v = empty_k + kStages;
    uint64_t* side = empty_v + kStages;  // the producer's own barrier for a boundary block

    const int b = blockIdx.z;
    const int hg = blockIdx.y;
    const int qpt = kRows / p.pack;
    const int qtile = gridDim.x - 1 - blockIdx.x;  // heavy (late) causal tiles first
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
    const int k_base = p.k_start[b];
    const int blk_end = (tile_end + kBlockKeys - 1) / kBlockKeys;  // blocks [0, blk_end)

    if (threadIdx.x == 0) {
        for (int s = 0; s < kStages; ++s) {
            barrier_init(&full_k[s], 1);
            barrier_init(&full_v[s], 1);
            barrier_init(&empty_k[s], 8);  // lane 0 of each consumer warp
            barrier_init(&empty_v[s], 8);
        }
        barrier_init(side, 1);
        fence_barrier_init();
    }
    __syncthreads();

    const int warpgroup = threadIdx.x / 128;
    const int lane = threadIdx.x % 32;

    if (warpgroup == 0) {
        release_registers<40>();
        if (threadIdx.x >= 32) return;
        // Producer warp: lane 0 issues the copies; the whole warp zeroes a boundary block.
        uint32_t side_phase = 0;
        for (int blk = 0; blk < blk_end; ++blk) {
            const int s = blk % kStages;
            const int round = blk / kStages;
            const int key0 = blk * kBlockKeys;
            const bool boundary = key0 + kBlockKeys > k_len;
            uint8_t* dk = sk + s * kBoxBytes;  // K column half h at dk + h * kStages * kBoxBytes
            uint8_t* dv = sv + s * kTileBytes;
            if (round > 0) barrier_wait(&empty_k[s], (round - 1) & 1);
            uint64_t* bar_k = boundary ? side : &full_k[s];
            if (lane == 0) {
                barrier_expect_bytes(bar_k, boundary ? 2 * kTileBytes : kTileBytes);
                for (int h = 0; h < 2; ++h)
                    tma_load_2d(dk + h * kStages * kBoxBytes, map_k, bar_k, kvh * kD + h * 64, k_base + key0);
            }
            if (round > 0) barrier_wait(&empty_v[s], (round - 1) & 1);
            uint64_t* bar_v = boundary ? side : &full_v[s];
            if (lane == 0) {
                if (!boundary) barrier_expect_bytes(bar_v, kTileBytes);
                for (int h = 0; h < 2; ++h)
                    tma_load_2d(dv + h * kBoxBytes, map_v, bar_v, kvh * kD + h * 64, k_base + key0);
            }
            if (boundary) {
                barrier_wait(side, side_phase);
                side_phase ^= 1;
                // Rows j >= k_len (another sequence's keys, unwritten cache slots): zeros, as
                // attention.cu's zero-filling copy leaves them.  Each row is 128 contiguous
                // bytes of a box whatever the swizzle.
                const int first = k_len - key0;
                const int chunks = (kBlockKeys - first) * 8;  // 16-byte chunks per box
                for (int idx = lane; idx < 4 * chunks; idx += 32) {
                    const int box = idx / chunks;
                    const int within = idx % chunks;
                    uint8_t* base = box < 2 ? dk + box * kStages * kBoxBytes : dv + (box % 2) * kBoxBytes;
                    *reinterpret_cast<uint4*>(base + first * 128 + within * 16) = make_uint4(0, 0, 0, 0);
                }
                fence_proxy_async();  // generic writes before the consumers' wgmma reads
                __syncwarp();
                if (lane == 0) {
                    barrier_arrive(&full_k[s]);
                    barrier_arrive(&full_v[s]);
                }
            }
        }
        return;
    }

    claim_registers<232>();
    const int cw = warpgroup - 1;           // consumer warpgroup 0 or 1
    const int ctid = threadIdx.x - 128;     // 0 .. 255
    const int wtid = threadIdx.x % 128;
    const int warp = wtid / 32;
    const int g = lane / 4;
    const int c = lane % 4;

    // Q rows of this warpgroup -> shared memory (128B swizzle: chunk ch of row r at ch ^ (r % 8)).
    {
        const T* qp = static_cast<const T*>(p.q);
        uint8_t* dq = sq + cw * 2 * kBoxBytes;
        for (int idx = wtid; idx < 64 * 16; idx += 128) {
            const int rl = idx / 16;
            const int ch = idx % 16;
            const int r = cw * 64 + rl;
            const int qi = q0 + r / p.pack;
            const bool valid = r < qpt * p.pack && qi < q_len;
            const int h = hg * p.pack + r % p.pack;
            const T* src = valid ? qp + (q_base + qi) * p.q_row + h * p.q_head + ch * 8 : qp;
            const uint32_t dst = smem_address(dq + (ch / 8) * kBoxBytes + rl * 128 + (((ch % 8) ^ (rl % 8)) << 4));
            cp_async16(dst, src, valid);
        }
        asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
        fence_proxy_async();
        named_barrier_sync(1 + cw, 128);
    }

    int vis_end[2];
    int row_q[2], row_h[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int r = cw * 64 + warp * 16 + g + 8 * i;
        const int qi = q0 + r / p.pack;
        const bool valid = r < qpt * p.pack && qi < q_len;
        row_q[i] = valid ? qi : -1;
        row_h[i] = hg * p.pack + r % p.pack;
        vis_end[i] = !valid ? 0 : (p.causal ? max(0, min(k_len, offset + qi + 1)) : k_len);
    }
    int vis_min = 0x7fffffff;
#pragma unroll
    for (int i = 0; i < 2; ++i)
        if (row_q[i] >= 0) vis_min = min(vis_min, vis_end[i]);
    const int warp_vis_min = __reduce_min_sync(0xffffffffu, vis_min);
    float m[2] = {kNegInf, kNegInf};
    float l[2] = {0.0f, 0.0f};
    float run_m[2] = {kNegInf, kNegInf};
    float run_l[2] = {0.0f, 0.0f};
    float acc[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
    float s[64];                // S of a block pair (block j: s[0..31], j + 1: s[32..63]), then P
    uint32_t pa[4][4];          // P of the pair's first block, the A operand of its P V product
    uint32_t pb[4][4];          // P of the pair's second block
    bool prev_empty[2] = {false, false};
    bool prev_any_empty = false;
    uint32_t negzero[2] = {0u, 0u};

    // Descriptors computed once: a k16 step, a stage or a V key step is a constant added to
    // the start-address field (every tile lies below 256 KB, so the field never carries).
    const uint64_t desc_q = smem_descriptor_128b(sq + cw * 2 * kBoxBytes);
    const uint64_t desc_k = smem_descriptor_128b(sk);
    const uint64_t desc_v = v_descriptor(sv);

    // m, l of a split that ended with the previous block, kept for its merge while the next
    // block's softmax already starts the new split from the empty state.
    float end_m[2], end_l[2];

    // Finishes the P V product of block `blk` (A registers `a`, its wait done by the caller):
    // restore -0 signs of rows that saw no key in it, free its stage, and if SPLIT_END (the
    // block ends a split) merge acc into the running state (acc restarts from +0 in the next
    // rescale).
    auto finish_pv = [&](int blk, uint32_t(&a)[4][4], auto split_end) {
        // The product read a and wrote acc until here: keep both live to this point, or
        // the compiler reuses their registers (softmax's P) while the wgmma still reads them.
        fence_operands<64>(acc);
        fence_registers(a);
        if (prev_any_empty) {
#pragma unroll
            for (int i = 0; i < 64; ++i) {
                const bool was_neg_zero = (negzero[i / 32] >> (i % 32)) & 1u;
                if (prev_empty[(i / 2) % 2] && acc[i] == 0.0f) acc[i] = was_neg_zero ? -0.0f : 0.0f;
            }
        }
        __syncwarp();
        if (lane == 0) barrier_arrive(&empty_v[blk % kStages]);
        if constexpr (decltype(split_end)::value) {
            const bool first_split = blk + 1 <= kBlocksPerSplit;  // no running state yet: 0
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                float mm, ll, wa, wb;
                int pick;
                merge_weights(run_m[i], run_l[i], end_m[i], end_l[i], mm, ll, wa, wb, pick);
                // merge_value with the row's pick as a constant: one loop without a selection
                // per element (the same function, so the same bits).
                auto merge_row = [&](auto pick_constant) {
#pragma unroll
                    for (int t = 0; t < 16; ++t)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            float& slot = srun[(t * 4 + 2 * i + e) * kConsumerThreads + ctid];
                            const float prev = first_split ? 0.0f : slot;
                            slot = merge_value(prev, acc[t * 4 + 2 * i + e], wa, wb, decltype(pick_constant)::value);
                        }
                };
                if (pick == 0)
                    merge_row(std::integral_constant<int, 0>{});
                else if (pick == 1)
                    merge_row(std::integral_constant<int, 1>{});
                else
                    merge_row(std::integral_constant<int, 2>{});
                run_m[i] = mm;
                run_l[i] = ll;
            }
        }
    };

    // The -0 signs of acc before a P V product (rows of a block with no visible key keep
    // their state exactly, zeros included).
    auto note_negzero = [&]() {
        negzero[0] = negzero[1] = 0u;
        if (prev_any_empty) {
#pragma unroll
            for (int i = 0; i < 64; ++i)
                if (__float_as_uint(acc[i]) == 0x80000000u) negzero[i / 32] |= 1u << (i % 32);
        }
    };
    auto wait_k = [&](int blk) { barrier_wait(&full_k[blk % kStages], (blk / kStages) & 1); };
    auto wait_v = [&](int blk) { barrier_wait(&full_v[blk % kStages], (blk / kStages) & 1); };
    // The pair's S product is complete: its K stages are free.
    auto free_k = [&](int blk) {
        __syncwarp();
        if (lane == 0) {
            barrier_arrive(&empty_k[blk % kStages]);
            if (blk + 1 < blk_end) barrier_arrive(&empty_k[(blk + 1) % kStages]);
        }
    };
    // S = Q K^T of blocks blk and blk + 1 (blk even: stages blk % kStages and the next one,
    // whose K rows are contiguous in shared memory) as one m64n128 product over d in
    // increasing k16 steps: each S element is the same dot product as a block's m64n64
    // product.  Block blk + 1 may lie past the tile's last block (blk_end odd): its stage is
    // not loaded then (stale or uninitialised shared memory) and every real row masks it.
    auto mma_s = [&](int blk) {
        const uint64_t k_stage = desc_k + static_cast<uint64_t>(((blk % kStages) * kBoxBytes) >> 4);
#pragma unroll
        for (int ks = 0; ks < 8; ++ks) {
            const int off_q = ((ks / 4) * kBoxBytes + (ks % 4) * 32) >> 4;
            const int off_k = ((ks / 4) * kStages * kBoxBytes + (ks % 4) * 32) >> 4;
            mma_qk<Codec>(s, desc_q + off_q, k_stage + off_k);
        }
        wgmma_commit();
    };
    // O += P V of block blk (A registers a), the four k16 key steps in increasing order.
    auto mma_pv_block = [&](int blk, const uint32_t(&a)[4][4]) {
        const uint64_t v_stage = desc_v + static_cast<uint64_t>((blk % kStages) * (kTileBytes >> 4));
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) mma_pv<Codec>(acc, a[kk], v_stage + ((kk * 16 * 128) >> 4));
        wgmma_commit();
    };

    // Online softmax of blocks blk and blk + 1, attention.cu's arithmetic with
    // s[t][e] = s[32 * half + 4t + e], in two parts.  scale(): x = S * scale_log2, or -inf for
    // an invisible key.  softmax(): the two blocks' max trees are independent; then
    // m_j = fmaxf(mx_j, m), m_{j+1} = fmaxf(mx_{j+1}, m_j) (the same fmaxf in the same order as
    // one block at a time), alpha of each; then the two blocks' exp2 / sum chains are
    // independent, and l is updated block by block in order.  Leaves P in s, the rescale
    // factors in alpha[half].  Written for few instructions: the block max is a tree (max is
    // exact in any order; the zero is normalised after the butterfly as in attention.cu),
    // alpha is computed then selected, both rows in one pass, and P's selection (rows that see
    // no key of a block) runs only where a real row of the warp sees no key of a block of the
    // pair (padding rows are never written; their P may be anything).
    float alpha[2][2];
    bool empty_now[2][2];
    bool any_empty[2];  // some real row of the warp sees no key of block half
    auto scale = [&](int blk, auto half) {
        constexpr int base = 32 * decltype(half)::value;
        const int key0 = blk * kBlockKeys;
        if (key0 + kBlockKeys > warp_vis_min) {
#pragma unroll
            for (int t = 0; t < 8; ++t)
#pragma unroll
                for (int i = 0; i < 2; ++i)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int j = key0 + t * 8 + 2 * c + e;
                        const float y = __fmul_rn(s[base + 4 * t + 2 * i + e], p.scale_log2);
                        s[base + 4 * t + 2 * i + e] = j < vis_end[i] ? y : kNegInf;
                    }
        } else {
#pragma unroll
            for (int i = 0; i < 32; ++i) s[base + i] = __fmul_rn(s[base + i], p.scale_log2);
        }
    };
    auto softmax = [&]() {
        float mx[2][2];
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const float* sh = s + 32 * h;
                float mx8[8], mx4[4];
#pragma unroll
                for (int k = 0; k < 8; ++k)
                    mx8[k] = fmaxf(sh[4 * (k / 2) + 2 * i + k % 2], sh[4 * (k / 2 + 4) + 2 * i + k % 2]);
#pragma unroll
                for (int k = 0; k < 4; ++k) mx4[k] = fmaxf(mx8[k], mx8[k + 4]);
                float v = fmaxf(fmaxf(mx4[0], mx4[2]), fmaxf(mx4[1], mx4[3]));
                v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
                v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
                mx[h][i] = v == 0.0f ? 0.0f : v;  // one zero (+0) whatever the lanes' order
            }
        float m_new[2][2];
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float m_old = h == 0 ? m[i] : m_new[0][i];
                empty_now[h][i] = mx[h][i] == kNegInf;
                m_new[h][i] = fmaxf(mx[h][i], m_old);
                const float a = exp2f(__fsub_rn(m_old, m_new[h][i]));  // selected away where undefined
                alpha[h][i] = empty_now[h][i] ? 1.0f : (m_old == kNegInf ? 0.0f : a);
            }
#pragma unroll
        for (int h = 0; h < 2; ++h)
            any_empty[h] = __any_sync(0xffffffffu, (empty_now[h][0] && row_q[0] >= 0) || (empty_now[h][1] && row_q[1] >= 0));
        // P and the block sums.  An invisible key (x = -inf) gives exp2(-inf) = +0 where m_new
        // is finite; a row with no visible key gets P = 0 by selection.
        auto exp_sum = [&](auto select) {
            float sum[2][2];
#pragma unroll
            for (int t = 0; t < 8; ++t)
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int i = 0; i < 2; ++i)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            float& x = s[32 * h + 4 * t + 2 * i + e];
                            float pe = exp2_ftz(__fsub_rn(x, m_new[h][i]));
                            if constexpr (decltype(select)::value) pe = empty_now[h][i] ? 0.0f : pe;
                            x = pe;
                            // P >= +0 (or NaN): 0 + P is P, so the scan starts at the first term.
                            sum[h][i] = t == 0 && e == 0 ? pe : __fadd_rn(sum[h][i], pe);
                        }
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    sum[h][i] = __fadd_rn(sum[h][i], __shfl_xor_sync(0xffffffffu, sum[h][i], 1));
                    sum[h][i] = __fadd_rn(sum[h][i], __shfl_xor_sync(0xffffffffu, sum[h][i], 2));
                }
#pragma unroll
            for (int i = 0; i < 2; ++i) {
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    l[i] = empty_now[h][i] ? l[i] : __fadd_rn(__fmul_rn(l[i], alpha[h][i]), sum[h][i]);
                m[i] = m_new[1][i];
            }
        };
        if (any_empty[0] || any_empty[1])
            exp_sum(std::true_type{});
        else
            exp_sum(std::false_type{});
    };

    // After the previous block's product is complete: acc *= alpha of block half (or +0 at a
    // split start: attention.cu zeroes it in the merge), and the facts about that block that
    // its own P V product will need.
    auto rescale = [&](auto half, auto split_start) {
        constexpr int h = decltype(half)::value;
#pragma unroll
        for (int i = 0; i < 64; ++i)
            acc[i] = decltype(split_start)::value ? 0.0f : __fmul_rn(acc[i], alpha[h][(i / 2) % 2]);
        prev_empty[0] = empty_now[h][0];
        prev_empty[1] = empty_now[h][1];
        // Padding rows are never written: they do not need the -0 fix-up.
        prev_any_empty = any_empty[h];
    };
    // P of the pair into pa and pb, once the products that read them are complete.
    auto pack_p = [&]() {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                pa[kk][j] = pack_pair<Codec>(s[8 * kk + 2 * j], s[8 * kk + 2 * j + 1]);
                pb[kk][j] = pack_pair<Codec>(s[32 + 8 * kk + 2 * j], s[32 + 8 * kk + 2 * j + 1]);
            }
    };
    auto start_split = [&]() {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            end_m[i] = m[i];
            end_l[i] = l[i];
            m[i] = kNegInf;
            l[i] = 0.0f;
        }
    };
    // Waits for the pair's K/V and zeroes s (the S product accumulates from +0).
    auto prepare_s = [&](int blk) {
        wait_k(blk);
        if (blk + 1 < blk_end) wait_k(blk + 1);
#pragma unroll
        for (int i = 0; i < 64; ++i) s[i] = 0.0f;
    };

    using Yes = std::true_type;
    using No = std::false_type;
    using First = std::integral_constant<int, 0>;
    using Second = std::integral_constant<int, 1>;
    if (blk_end > 0) {
        prepare_s(0);
        fence_operands<64>(s);
        wgmma_fence();
        mma_s(0);
        fence_operands<64>(s);
        wgmma_wait<0>();
        fence_operands<64>(s);
        free_k(0);
        scale(0, First{});
        scale(1, Second{});
        softmax();
        pack_p();
        rescale(First{}, No{});
    }
    // Pair step (blocks blk, blk + 1; blk even; pa = P_{blk-2}, pb = P_{blk-1}, acc rescaled
    // for blk - 2): P V of blk - 2 and S of the pair in flight; once P V is complete, acc *=
    // alpha_{blk-1} and P V of blk - 1 is issued behind S; the pair's softmax runs while that
    // product executes.  acc = (acc * alpha_j + P_j V_j) * alpha_{j+1} ... in block order, as
    // in attention.cu.  Splits (16 blocks) start at even blocks, so only the pair's first
    // block can start one; such a step is its own copy.  No branch between a product's issue
    // and its wait.
    auto step = [&](int blk, auto split_start) {
        prepare_s(blk);
        wait_v(blk - 2);
        note_negzero();
        fence_operands<64>(s);
        fence_operands<64>(acc);
        fence_registers(pa);
        fence_registers(pb);
        wgmma_fence();
        mma_pv_block(blk - 2, pa);
        mma_s(blk);
        fence_operands<64>(s);
        fence_operands<64>(acc);
        wgmma_wait<1>();  // P V of blk - 2 is complete; S may still run
        finish_pv(blk - 2, pa, No{});
        rescale(Second{}, No{});
        wait_v(blk - 1);
        note_negzero();
        fence_operands<64>(acc);
        fence_registers(pb);
        wgmma_fence();
        mma_pv_block(blk - 1, pb);
        fence_operands<64>(acc);
        wgmma_wait<1>();  // S of the pair is complete; P V of blk - 1 may still run
        fence_operands<64>(s);
        free_k(blk);
        if constexpr (decltype(split_start)::value) start_split();
        scale(blk, First{});
        scale(blk + 1, Second{});
        softmax();
        wgmma_wait<0>();
        finish_pv(blk - 1, pb, split_start);
        pack_p();
        rescale(First{}, split_start);
    };
    for (int blk = 2; blk < blk_end; blk += 2) {
        if (blk % kBlocksPerSplit == 0)
            step(blk, Yes{});
        else
            step(blk, No{});
    }
    if (blk_end > 0) {
        const int last = (blk_end - 1) & ~1;  // the last pair's first block
        wait_v(last);
        note_negzero();
        fence_operands<64>(acc);
        fence_registers(pa);
        wgmma_fence();
        mma_pv_block(last, pa);
        fence_operands<64>(acc);
        if (last + 1 < blk_end) {
            wgmma_wait<0>();
            finish_pv(last, pa, No{});
            rescale(Second{}, No{});
            wait_v(last + 1);
            note_negzero();
            fence_operands<64>(acc);
            fence_registers(pb);
            wgmma_fence();
            mma_pv_block(last + 1, pb);
            fence_operands<64>(acc);
            start_split();  // keeps the last split's m, l in end_m, end_l for its merge
            wgmma_wait<0>();
            finish_pv(last + 1, pb, Yes{});  // the last block always ends a split
        } else {
            start_split();
            wgmma_wait<0>();
            finish_pv(last, pa, Yes{});
        }
    }

    T* op = static_cast<T*>(p.out);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        if (row_q[i] < 0) continue;
        const int64_t t_row = q_base + row_q[i];
        T* dst = op + t_row * p.out_row + row_h[i] * p.out_head;
#pragma unroll
        for (int t = 0; t < 16; ++t) {
            // A tile with no block leaves srun unwritten: run_l = 0 then, and finalize gives 0.
            const float a0 = blk_end > 0 ? srun[(t * 4 + 2 * i) * kConsumerThreads + ctid] : 0.0f;
            const float a1 = blk_end > 0 ? srun[(t * 4 + 2 * i + 1) * kConsumerThreads + ctid] : 0.0f;
            T pair[2] = {Codec::store(finalize_out(a0, run_l[i])), Codec::store(finalize_out(a1, run_l[i]))};
            *reinterpret_cast<uint32_t*>(dst + t * 8 + 2 * c) = *reinterpret_cast<uint32_t*>(pair);
        }
        if (c == 0) p.lse[static_cast<int64_t>(row_h[i]) * p.tq + t_row] = finalize_lse(run_m[i], run_l[i]);
    }
#elif defined(__CUDA_ARCH__)
    __trap();  // built only into sm_90a images; the host never launches it elsewhere
#endif
}

}  // namespace attn_hopper
}  // namespace batchinv

#define BATCHINV_ATTN_HOPPER(DTYPE, CODEC)                                                                      \
    extern "C" __global__ void __launch_bounds__(384, 1) attn_hopper_fwd_##DTYPE##_d128(                          \
        const __grid_constant__ batchinv::TensorMap map_k, const __grid_constant__ batchinv::TensorMap map_v,   \
        const void* q, void* out, float* lse, const int* q_start, const int* q_len, const int* k_start,        \
        const int* k_len, int64_t q_row, int64_t q_head, int64_t out_row, int64_t out_head, int tq, int hq,     \
        int hkv, int pack, int causal, float scale_log2) {                                                      \
        const batchinv::attn_hopper::Params p{q,     out,   lse,      q_start, q_len, k_start, k_len, q_row,    \
                                              q_head, out_row, out_head, tq,   hq,    hkv,     pack,  causal,   \
                                              scale_log2};                                                       \
        batchinv::attn_hopper::attn_hopper_tile<CODEC>(map_k, map_v, p);                                         \
    }

// Signature: (map_k, map_v, q, out, lse, q_start, q_len, k_start, k_len, q_row, q_head, out_row,
//             out_head, tq, hq, hkv, pack, causal, scale_log2)
// batchinv-signature: attn_hopper_fwd_bf16_d128(tmap, tmap, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i32, i32, i32, i32, i32, f32)
BATCHINV_ATTN_HOPPER(bf16, batchinv::Bf16Codec)
// batchinv-signature: attn_hopper_fwd_f16_d128(tmap, tmap, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i32, i32, i32, i32, i32, f32)
BATCHINV_ATTN_HOPPER(f16, batchinv::F16Codec)
#endif

// Attention forward, tile mode, on Hopper (sm_90a): the FlashAttention-3 structure (TMA
// producer warpgroup, two wgmma consumer warpgroups) computing EXACTLY the per-row arithmetic
// of kernels_cu/attention.cu's tile kernel.  d = 128 and d = 64 (one body, templated on the head
// dim D), bf16 and fp16, causal and not.
//
// Canonical layout and row contract: those of kernels_cu/attention.cu (read its header), mode
// (a) only: one CTA per work item (query tile, head group, sequence) walks all splits of its
// tile and merges them as it goes.  The grid is persistent: min(SMs, items) CTAs take the items
// from a queue (an atomic counter, zeroed for each launch) in the order a one-CTA-per-item grid
// would dispatch them (tile_at); the K/V rings run on across a CTA's items, so the next
// item's first blocks load while this one finishes, and the next item's Q is copied while this
// one runs.  Which CTA computes an item, and in which order, never changes an operation of a
// row: the grid size depends on the batch, the arithmetic does not.  Differences from
// attention.cu are in who computes what, never in the arithmetic:
//   - Blocks of kBlockKeys = 128 keys (the contract's block size; 16 blocks per 2048-key
//     split).  Tile rows: M = 128 (two consumer warpgroups of 64 rows, four warps of 16 rows
//     each), row r = (query qtile * QPT + r / P, head hg * P + r % P) as in attention.cu.  A warp's 16 rows are held exactly as mma.sync holds them: wgmma's
//     accumulator i of a thread is element (i / 4, i % 4) of mma.sync's n8 tile i / 4, so every
//     per-row step (block max over the 16 n8 tiles + quad butterfly, exp2_ftz, the sum scan over
//     t = 0..15 + butterfly, alpha, P rounding, the -0 restore, the split merge, finalize) is
//     the same arithmetic on the same values.
//   - S = Q K^T: wgmma m64n128k16 with Q from registers (a warp's 16 rows as mma.sync's A
//     fragments, read once from the swizzled Q tile) and K (128 keys) from 128B-swizzled shared
//     memory, over d in increasing k16 steps (D / 16 of them; D += A * B from a zero
//     accumulator, as the mma.sync chain).
//   - O += P V: wgmma m64nDk16 (m64n128k16 at d = 128, m64n64k16 at d = 64) with P (rounded to
//     the input dtype) as the register A operand, V N-major from shared memory, the eight k16
//     key steps in increasing order.  A thread holds D / 2 fp32 accumulators.
//   That wgmma and mma.sync give the same bits for the same k16 step sequence is a measured
//   property of the GPU (as in linear.cu), checked bitwise on every run by
//   tests/gpu/test_attention_hopper_cuda.py against the mma.sync tile and split kernels.
//   - Overlap: block j's P V product is issued right after block j+1's Q K^T and runs while
//     block j+1's softmax is computed; its accumulator is rescaled by alpha_{j+1} only after
//     it completes, so acc = (acc * alpha_j + P_j V_j) * alpha_{j+1} ... as in attention.cu.
//     The two consumer warpgroups interleave on the SM.  When block j ends a split, block
//     j+1's softmax starts the new split from the empty state (the ended split's m, l are
//     kept) while P_j V_j runs; the split is merged (attention.cu's merge_weights /
//     merge_value) once that product completes, and acc restarts from +0.  That step is its
//     own copy of the loop body, so the other steps rescale acc in place (no register copies),
//     and the other steps of a split form an inner loop of their own (no split test per block,
//     no register copies at a back edge shared with the split-start copy).
//   - The softmax of a thread's two rows runs as one pass (padding rows are computed and never
//     written); the block max is a tree (exact), and P's selection for rows that see no key of
//     the block runs only in warps that have such a row.  Same values as attention.cu's code.
//   - No register that an in-flight wgmma reads or writes is touched before its wait: P of
//     block j+1 is packed into the A registers only after P_j V_j completes, and nothing but
//     wgmma runs between the two issues (ptxas would otherwise serialise every wgmma, C7513).
//   - Loads: one producer thread issues TMA copies of 128-key K and V blocks (D / 64 boxes of
//     128 rows x 64 columns each, 128B swizzle) into two rings of kStages = 2 shared-memory stages,
//     K and V with their own mbarriers (full / empty): a K stage is freed once its S product is
//     complete, a V stage once its P V product is; blocks no row of the tile sees are not
//     loaded.  Q is copied once per consumer warpgroup and work item with cp.async (zeros for
//     rows that are not a query).
//   - Key rows past k_len: TMA reads whole 128-row boxes inside the K/V tensors, so the last
//     block of a sequence can bring rows j >= k_len (the next sequence's rows, cache slots
//     never written, NaN).  Before any consumer reads that stage the producer warp overwrites
//     those K and V rows with zeros in shared memory, so the consumers see exactly the
//     zero-filled tile attention.cu's cp.async builds.  Such rows are read from global memory
//     but never used.  Query rows past q_len are never read.
//   - finalize (out = acc / l) divides by one reciprocal per row where l and the thread's D / 4
//     values of the row are in range, finalize_out otherwise: finalize_out's bits either way
//     (finalize_row; tested against finalize_out by the test kernel attn_hopper_finalize_check).
//     The last split's merge goes to registers, not through shared memory.
// Launch: grid min(SMs, items), items = ceil(max_q_len / QPT) x Hq / P x B (q_tiles, batch
// arguments; queue: 1 + 2 * grid int32, the first +0), block 384 threads (warpgroup 0 =
// producer), dynamic shared memory shared_bytes (py/batchinv/gpu/attention_hopper.py).
#include "common/cp_async.cuh"
#include "common/hopper.cuh"
#include "common/wgmma.cuh"

#if !defined(__HIPCC__)
#include "common/approx.cuh"
#include "common/attention_rows.cuh"
#include "common/chunk16.cuh"

#include <type_traits>

namespace batchinv {
namespace attn_hopper {

using namespace attn;  // the shared per-row arithmetic (common/attention_rows.cuh)

// The contract's key block (128 keys) and blocks per split: the shared constants of
// common/attention_rows.cuh.  The shared-memory layout, the TMA boxes and the register tiles
// below are written for 128-key blocks.
[[maybe_unused]] constexpr int kHopperBlockKeys = kBlockKeys;
[[maybe_unused]] constexpr int kHopperBlocksPerSplit = kBlocksPerSplit;
static_assert(kHopperBlockKeys == 128, "the Hopper kernel's S tile is 16 n8 tiles (wgmma n128)");
static_assert(kHopperBlocksPerSplit * kHopperBlockKeys == kSplitKeys, "a split is whole blocks");

[[maybe_unused]] constexpr int kQHalfBytes = 64 * 128;  // Q: 64 rows x 64 columns x 2 bytes
[[maybe_unused]] constexpr int kKVHalfBytes = kHopperBlockKeys * 128;  // K/V: 128 rows x 64 columns

// The CTA: a producer warpgroup and 2 consumer warpgroups of 64 rows each (384 threads).
// Registers: 128 x 24 (producer) + 256 x 240 (consumers) = 64512 = 384 x 168, the launch
// allocation (__launch_bounds__(384, 1)): setmaxnreg moves registers within it, so a larger sum
// makes the consumers' setmaxnreg.inc wait forever (32 / 240 hangs).
[[maybe_unused]] constexpr int kWarpgroups = 2;
[[maybe_unused]] constexpr int kRows = 64 * kWarpgroups;  // tile rows
[[maybe_unused]] constexpr int kConsumerThreads = 128 * kWarpgroups;
[[maybe_unused]] constexpr int kProducerRegisters = 24;
[[maybe_unused]] constexpr int kConsumerRegisters = 240;

// K and V ring depth, both head dims: 2 x 32 KB per ring at d = 128, 2 x 16 KB at d = 64 (there 3
// and 4 stages time the same; three consumer warpgroups, FA3's choice at d = 64, spill at 160
// registers and measure slower: docs/tuning/attention.md).
[[maybe_unused]] constexpr int kRingStages = 2;

// What depends on the head dim D (128 or 64): a row of Q, K or V is D / 64 swizzled 64-column
// halves (one TMA box each per 128-key block), S takes D / 16 k16 steps, and a thread holds
// D / 2 fp32 accumulators (the D / 8 n8 tiles of its 16-row warp slice, 4 values each).
template <int D>
struct Shape {
    static_assert(D == 64 || D == 128, "the Hopper kernel is built for d = 64 and d = 128");
    static constexpr int kHalves = D / 64;
    static constexpr int kKSteps = D / 16;
    static constexpr int kAcc = D / 2;
    static constexpr int kStages = kRingStages;  // K and V ring depth
    static constexpr int kStageBytes = kHalves * kKVHalfBytes;  // one K (or V) block: 128 x D
    static constexpr int kQBytes = kWarpgroups * kHalves * kQHalfBytes;  // warpgroups x halves
    static constexpr int kRunBytes = kAcc * kConsumerThreads * 4;  // the fp32 split state
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

using hopper::fence_operands;  // register fences around wgmma (common/hopper.cuh)
using hopper::fence_registers;

__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Descriptors of the K and V ring stages, built from 32-bit low words (start address / 16 in
// bits 0-13, leading byte offset / 16 in bits 16-29; shared::cta addresses lie below 2^18, so
// the start-address field never carries) and the high word all share: stride byte offset 1024
// (one 8-row group) and the 128-byte swizzle.  The same bits as smem_descriptor_128b (K, leading
// byte offset 16, unused when swizzled; V: the two 64-column halves kKVHalfBytes apart),
// without 64-bit arithmetic per block.
[[maybe_unused]] constexpr uint32_t kDescHigh = (1024 >> 4) | (1u << 30);
template <int kStageBytes>
__device__ __forceinline__ uint64_t stage_descriptor(uint32_t low0, int stage) {
    const uint32_t lo = low0 + static_cast<uint32_t>(stage) * (kStageBytes >> 4);
    uint64_t out;
    asm("mov.b64 %0, {%1, %2};" : "=l"(out) : "r"(lo), "r"(kDescHigh));
    return out;
}

// finalize_out's division (__fdiv_rn) for a row's values, the reciprocal of l computed once
// (divisor_reciprocal / divide_in_range, common/approx.cuh: __fdiv_rn's fast path without its
// per-element operand check, branch and reconvergence).  For l in [2^-32, 2^32] and |n| in
// [2^-64, 2^64] (quotient and residual normal, far from overflow) the sequence is correctly
// rounded, so it gives __fdiv_rn's bits (compared against __fdiv_rn on the device,
// docs/tuning/attention.md).  Outside that range (l = 0, +-0, subnormal, huge, inf or NaN
// values) finalize_out runs.
__device__ __forceinline__ bool divisor_in_range(float l) { return l >= 0x1p-32f && l <= 0x1p32f; }

__device__ __forceinline__ bool numerator_in_range(float n) {
    return fabsf(n) >= 0x1p-64f && fabsf(n) <= 0x1p64f;
}

// finalize_out for the N = D / 4 values of a row a thread holds (the same bits, see above).
template <int N>
__device__ __forceinline__ void finalize_row(float (&o)[N], float l) {
    bool in_range = divisor_in_range(l);
#pragma unroll
    for (int k = 0; k < N; ++k) in_range &= numerator_in_range(o[k]);
    if (in_range) {
        const float r = divisor_reciprocal(l);
#pragma unroll
        for (int k = 0; k < N; ++k) o[k] = divide_in_range(o[k], l, r);
    } else {
#pragma unroll
        for (int k = 0; k < N; ++k) o[k] = finalize_out(o[k], l);
    }
}

// Two output values rounded to the storage type as one 32-bit word (lo in the low half), the
// bits of Codec::store: bf16 by the paired hardware conversion (common/chunk16.cuh).
template <typename Codec>
__device__ __forceinline__ uint32_t store_pair(float lo, float hi) {
    if constexpr (Codec::kIsBf16) {
        return pack_bf16x2(lo, hi);
    } else {
        typename Codec::storage pair[2] = {Codec::store(lo), Codec::store(hi)};
        return *reinterpret_cast<uint32_t*>(pair);
    }
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
    int* queue;          // [0]: work-item counter, +0 at launch; [1 + 2 * CTA ..]: its item ring
    int q_tiles, batch;  // work items: q_tiles x (hq / pack) head groups x batch
};

// One work item (query tile, head group, sequence) and what its rows see.
struct Tile {
    int hg, q0, q_len, k_len, offset, kvh, k_base, blk_end;
    int64_t q_base;
};

// Work item w in the order of a one-CTA-per-item grid (grid x fastest): the query
// tiles of one (head group, sequence), heaviest (latest, most causal blocks) first, then the
// next head group, then the next sequence.  CTAs take items from the queue in this order, the
// greedy longest-first schedule the hardware's dispatch of that grid gave.
__device__ __forceinline__ Tile tile_at(const Params& p, int w) {
    const int groups = p.hq / p.pack;
    const int qtile = p.q_tiles - 1 - w % p.q_tiles;
    const int rest = w / p.q_tiles;
    const int b = rest / groups;
    Tile t;
    t.hg = rest % groups;
    const int qpt = kRows / p.pack;
    t.q_len = p.q_len[b];
    t.k_len = p.k_len[b];
    t.q0 = qtile * qpt;
    const int q_last = min(t.q_len - 1, t.q0 + qpt - 1);
    t.offset = t.k_len - t.q_len;
    const int tile_end = p.causal ? max(0, min(t.k_len, t.offset + q_last + 1)) : t.k_len;
    t.kvh = (t.hg * p.pack) / (p.hq / p.hkv);
    t.q_base = p.q_start[b];
    t.k_base = p.k_start[b];
    t.blk_end = (tile_end + kHopperBlockKeys - 1) / kHopperBlockKeys;  // blocks [0, blk_end)
    return t;
}

template <typename Codec, int D>
__device__ __forceinline__ void attn_hopper_tile(const TensorMap& map_k, const TensorMap& map_v, const Params& p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using namespace hopper;
    using T = typename Codec::storage;
    using Sh = Shape<D>;
    constexpr int kHalves = Sh::kHalves;
    constexpr int kKSteps = Sh::kKSteps;
    constexpr int kAcc = Sh::kAcc;
    constexpr int kOut = kAcc / 2;  // values of one row a thread holds
    constexpr int kStages = Sh::kStages;
    constexpr int kStageBytes = Sh::kStageBytes;
    constexpr int kQBytes = Sh::kQBytes;
    constexpr int kRunBytes = Sh::kRunBytes;
    extern __shared__ uint8_t shared_raw[];
    // 128-byte swizzled tiles start on a 1024-byte boundary.  Offset from shared_raw (not an
    // integer round trip) so that the compiler knows every pointer below is shared memory and
    // emits LDS / STS (with the round trip it emits generic LD / ST for the running state, the
    // Q fragments and the producer's zero fill).
    uint8_t* shared = shared_raw + ((1024u - (smem_address(shared_raw) & 1023u)) & 1023u);
    uint8_t* sq = shared;                       // [warpgroups][kHalves][64][64]
    uint8_t* sk = sq + kQBytes;                 // [kStages][kHalves][128][64]
    uint8_t* sv = sk + kStages * kStageBytes;   // [kStages][kHalves][128][64]
    // The split running state [kAcc][consumer threads].
    float* srun = reinterpret_cast<float*>(sv + kStages * kStageBytes);
    uint64_t* k_full = reinterpret_cast<uint64_t*>(sv + kStages * kStageBytes + kRunBytes);
    uint64_t* k_empty = k_full + kStages;
    uint64_t* v_full = k_empty + kStages;
    uint64_t* v_empty = v_full + kStages;
    uint64_t* side = v_empty + kStages;  // the producer's own barrier for a boundary block
    // The work items the producer took from the queue, in a ring of two slots (full: written,
    // empty: read by every consumer warp).  The slots are this CTA's two ints after the counter
    // in global memory, not shared memory: the mbarriers order them either way (release on
    // arrive, acquire on wait, CTA scope), but compute-sanitizer's racecheck does not model
    // mbarrier ordering of generic shared-memory accesses and reported the shared slots as races.
    uint64_t* item_full = side + 1;
    uint64_t* item_empty = item_full + 2;
    volatile int* item_slot = p.queue + 1 + 2 * blockIdx.x;

    const int qpt = kRows / p.pack;
    const int items = p.q_tiles * (p.hq / p.pack) * p.batch;

    if (threadIdx.x == 0) {
        for (int s = 0; s < kStages; ++s) {
            barrier_init(&k_full[s], 1);
            barrier_init(&v_full[s], 1);
            barrier_init(&k_empty[s], 4 * kWarpgroups);  // lane 0 of each consumer warp
            barrier_init(&v_empty[s], 4 * kWarpgroups);
        }
        barrier_init(side, 1);
        for (int s = 0; s < 2; ++s) {
            barrier_init(&item_full[s], 1);
            barrier_init(&item_empty[s], 4 * kWarpgroups);
        }
        fence_barrier_init();
    }
    __syncthreads();

    const int warpgroup = threadIdx.x / 128;
    const int lane = threadIdx.x % 32;

    if (warpgroup == 0) {
        release_registers<kProducerRegisters>();
        if (threadIdx.x >= 32) return;
        // Producer warp: lane 0 takes the work items from the queue (item n + 1 when item n's
        // loads start, so that the consumers know it before they finish item n) and issues the
        // copies; the whole warp zeroes a boundary block.  The K/V rings run on across items
        // (`it` counts every block this CTA loads): the next item's first blocks load while the
        // consumers finish the current one.  Per block: K once its stage's S product is done,
        // then V once its stage's P V product is done.
        auto fetch = [&]() {
            int w = 0;
            if (lane == 0) w = atomicAdd(p.queue, 1);
            return __shfl_sync(0xffffffffu, w, 0);
        };
        auto publish = [&](int n, int w) {
            if (n >= 2) barrier_wait(&item_empty[n % 2], ((n / 2) - 1) & 1);
            if (lane == 0) {
                item_slot[n % 2] = w;
                barrier_arrive(&item_full[n % 2]);
            }
        };
        uint32_t side_phase = 0;
        int it = 0;
        int w = fetch();
        publish(0, w);
        for (int n = 0; w < items; ++n) {
            const int w_next = fetch();  // >= items once the queue is empty: the consumers stop
            publish(n + 1, w_next);
            const Tile tl = tile_at(p, w);
            const int blk_end = tl.q0 < tl.q_len ? tl.blk_end : 0;  // a tile past q_len: nothing
            for (int blk = 0; blk < blk_end; ++blk, ++it) {
                const int s = it % kStages;
                const int round = it / kStages;
                const int key0 = blk * kBlockKeys;
                const bool boundary = key0 + kBlockKeys > tl.k_len;
                uint8_t* dk = sk + s * kStageBytes;
                uint8_t* dv = sv + s * kStageBytes;
                const int column = tl.kvh * D;
                const int row = tl.k_base + key0;
                if (round > 0) barrier_wait(&k_empty[s], (round - 1) & 1);
                if (!boundary) {
                    if (lane == 0) {
                        barrier_expect_bytes(&k_full[s], kStageBytes);
                        for (int h = 0; h < kHalves; ++h)
                            tma_load_2d(dk + h * kKVHalfBytes, map_k, &k_full[s], column + h * 64, row);
                    }
                    if (round > 0) barrier_wait(&v_empty[s], (round - 1) & 1);
                    if (lane == 0) {
                        barrier_expect_bytes(&v_full[s], kStageBytes);
                        for (int h = 0; h < kHalves; ++h)
                            tma_load_2d(dv + h * kKVHalfBytes, map_v, &v_full[s], column + h * 64, row);
                    }
                } else {
                    if (round > 0) barrier_wait(&v_empty[s], (round - 1) & 1);
                    if (lane == 0) {
                        barrier_expect_bytes(side, 2 * kStageBytes);
                        for (int h = 0; h < kHalves; ++h) {
                            tma_load_2d(dk + h * kKVHalfBytes, map_k, side, column + h * 64, row);
                            tma_load_2d(dv + h * kKVHalfBytes, map_v, side, column + h * 64, row);
                        }
                    }
                    barrier_wait(side, side_phase);
                    side_phase ^= 1;
                    // Rows j >= k_len (another sequence's keys, unwritten cache slots): zeros, as
                    // attention.cu's zero-filling copy leaves them.  Each row is 128 contiguous
                    // bytes of a box whatever the swizzle.
                    const int first = tl.k_len - key0;
                    const int chunks = (kBlockKeys - first) * 8;  // 16-byte chunks per box
                    for (int idx = lane; idx < 2 * kHalves * chunks; idx += 32) {
                        const int box = idx / chunks;
                        const int within = idx % chunks;
                        uint8_t* base = (box < kHalves ? dk : dv) + (box % kHalves) * kKVHalfBytes;
                        *reinterpret_cast<uint4*>(base + first * 128 + within * 16) = make_uint4(0, 0, 0, 0);
                    }
                    fence_proxy_async_shared();  // generic writes before the consumers' wgmma reads
                    __syncwarp();
                    if (lane == 0) {
                        barrier_arrive(&k_full[s]);
                        barrier_arrive(&v_full[s]);
                    }
                }
            }
            w = w_next;
        }
        return;
    }

    claim_registers<kConsumerRegisters>();
    // The consumers' code (cw: 0 or 1, the consumer warpgroup).
    const int cw = warpgroup - 1;
    const int ctid = threadIdx.x - 128;  // 0 .. 255
    const int wtid = threadIdx.x % 128;
    const int warp = wtid / 32;
    const int g = lane / 4;
    const int c = lane % 4;

    // Q rows of this warpgroup for work item tl -> shared memory by cp.async (128B swizzle:
    // chunk ch of row r at ch ^ (r % 8)); waited for when the item starts.
    auto load_q = [&](const Tile& tl) {
        const T* qp = static_cast<const T*>(p.q);
        uint8_t* dq = sq + cw * kHalves * kQHalfBytes;
        for (int idx = wtid; idx < 64 * (D / 8); idx += 128) {
            const int rl = idx / (D / 8);
            const int ch = idx % (D / 8);
            const int r = cw * 64 + rl;
            const int qi = tl.q0 + r / p.pack;
            const bool valid = r < qpt * p.pack && qi < tl.q_len;
            const int h = tl.hg * p.pack + r % p.pack;
            const T* src = valid ? qp + (tl.q_base + qi) * p.q_row + h * p.q_head + ch * 8 : qp;
            const uint32_t dst = smem_address(dq + (ch / 8) * kQHalfBytes + rl * 128 + (((ch % 8) ^ (rl % 8)) << 4));
            cp_async16_zfill(dst, src, valid);
        }
        cp_async_commit();
    };

    // Descriptors: a k16 step, a stage or a V key step is a constant added to the start-address
    // field (every tile lies below 256 KB, so the field never carries).  Low words of stage 0
    // (`shared` is 1024-byte aligned, so each field is a plain sum).
    const uint32_t shared16 = smem_address(shared) >> 4;
    const uint32_t desc_k = shared16 + (kQBytes >> 4) + (1u << 16);
    const uint32_t desc_v = shared16 + ((kQBytes + kStages * kStageBytes) >> 4) + ((kKVHalfBytes >> 4) << 16);
    int s_stage = 0;       // stage of the next block whose S is issued (runs on across items)
    uint32_t s_phase = 0;  // its full-barrier phase

    // Work item n from the producer's ring (every consumer warp reads it once).
    auto read_item = [&](int n) {
        barrier_wait(&item_full[n % 2], (n / 2) & 1);
        const int w = item_slot[n % 2];
        __syncwarp();
        if (lane == 0) barrier_arrive(&item_empty[n % 2]);
        return w;
    };
    int w = read_item(0);
    if (w < items) {
        const Tile first = tile_at(p, w);
        if (first.q0 < first.q_len) load_q(first);
    }
    for (int n = 0; w < items; ++n) {
        const int w_next = read_item(n + 1);
        const Tile tl = tile_at(p, w);
        const bool has_rows = tl.q0 < tl.q_len;
        // Q of the warp's 16 rows as the A fragments of the eight k16 steps of S (row g / g + 8,
        // columns 2c, 2c + 1 and 2c + 8, 2c + 9 of the step), read from the swizzled tile; then
        // the next item's Q copy into the same buffer (once every warp of the warpgroup read it).
        uint32_t qa[kKSteps][4];
        if (has_rows) {
            cp_async_wait<0>();
            fence_proxy_async_shared();
            named_barrier_sync(1 + cw, 128);
        }
        if (has_rows) {
            const uint8_t* dq = sq + cw * kHalves * kQHalfBytes;
#pragma unroll
            for (int ks = 0; ks < kKSteps; ++ks)
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int rl = warp * 16 + g + 8 * (j % 2);
                    const int col = ks * 16 + 8 * (j / 2) + 2 * c;
                    const int ch = (col % 64) / 8;
                    qa[ks][j] = *reinterpret_cast<const uint32_t*>(dq + (col / 64) * kQHalfBytes + rl * 128 +
                                                                   ((ch ^ (rl % 8)) << 4) + (col % 8) * 2);
                }
            named_barrier_sync(1 + cw, 128);
        }
        auto load_next_q = [&]() {
            if (w_next < items) {
                const Tile next = tile_at(p, w_next);
                if (next.q0 < next.q_len) load_q(next);
            }
        };
        const int blk_end = has_rows ? tl.blk_end : 0;
        load_next_q();
        if (has_rows) {
            const int hg = tl.hg;
            const int q0 = tl.q0;
            const int q_len = tl.q_len;
            const int k_len = tl.k_len;
            const int offset = tl.offset;
            const int64_t q_base = tl.q_base;

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
            float acc[kAcc];
#pragma unroll
            for (int i = 0; i < kAcc; ++i) acc[i] = 0.0f;
            float s[64];           // S of a block (invisible keys -inf), then its P
            uint32_t pa[8][4];     // P of a block, the A operand of its P V product
            bool prev_empty[2] = {false, false};
            bool prev_any_empty = false;
            uint32_t negzero[(kAcc + 31) / 32] = {};

            int cur_stage = 0;        // stage of the block whose softmax runs
            uint32_t cur_phase = 0;   // its full-barrier phase
            int pv_stage = 0;         // stage of the block whose P V product is pending
            uint32_t pv_phase = 0;

            // m, l of a split that ended with the previous block, kept for its merge while the next
            // block's softmax already starts the new split from the empty state.
            float end_m[2], end_l[2];

            // Finishes the pending P V product (block `blk`, its wait done by the caller): restore -0
            // signs of rows that saw no key in it, free its V stage, and if SPLIT_END (the block ends
            // a split) merge acc into the running state (acc restarts from +0 in the next rescale).
            // LAST (the tile's last block): the merged state goes into acc, which finalize reads (the
            // same values as through srun, without the shared-memory round trip).
            auto finish_pv = [&](int blk, auto split_end, auto last) {
                // The product read pa and wrote acc until here: keep both live to this point, or
                // the compiler reuses their registers (softmax's P) while the wgmma still reads them.
                fence_operands<kAcc>(acc);
                fence_registers(pa);
                if (prev_any_empty) {
#pragma unroll
                    for (int i = 0; i < kAcc; ++i) {
                        const bool was_neg_zero = (negzero[i / 32] >> (i % 32)) & 1u;
                        if (prev_empty[(i / 2) % 2] && acc[i] == 0.0f) acc[i] = was_neg_zero ? -0.0f : 0.0f;
                    }
                }
                __syncwarp();
                if (lane == 0) barrier_arrive(&v_empty[pv_stage]);
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
                            for (int t = 0; t < kAcc / 4; ++t)
#pragma unroll
                                for (int e = 0; e < 2; ++e) {
                                    float& slot = srun[(t * 4 + 2 * i + e) * kConsumerThreads + ctid];
                                    const float prev = first_split ? 0.0f : slot;
                                    const float merged =
                                        merge_value(prev, acc[t * 4 + 2 * i + e], wa, wb, decltype(pick_constant)::value);
                                    if constexpr (decltype(last)::value)
                                        acc[t * 4 + 2 * i + e] = merged;
                                    else
                                        slot = merged;
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
                if (prev_any_empty) {
#pragma unroll
                    for (int w32 = (kAcc + 31) / 32 - 1; w32 >= 0; --w32) negzero[w32] = 0u;
#pragma unroll
                    for (int i = 0; i < kAcc; ++i)
                        if (__float_as_uint(acc[i]) == 0x80000000u) negzero[i / 32] |= 1u << (i % 32);
                }
            };
            // S = Q K^T of the block at stage s_stage (128 keys) over d in increasing k16 steps (32
            // bytes along a 128-byte swizzled row), into s; moves s_stage on.  Q (a warp's 16 rows
            // as mma.sync's A fragment) from registers, K K-major from shared memory.
            auto mma_s = [&]() {
                const uint64_t k_stage = stage_descriptor<kStageBytes>(desc_k, s_stage);
#pragma unroll
                for (int ks = 0; ks < kKSteps; ++ks) {
                    const int off_k = ((ks / 4) * kKVHalfBytes + (ks % 4) * 32) >> 4;
                    wgmma::mma_rs_kmajor<Codec>(s, qa[ks], k_stage + off_k);
                }
                wgmma_commit();
                if (++s_stage == kStages) {
                    s_stage = 0;
                    s_phase ^= 1u;
                }
            };
            // O += P V of the block at pv_stage (pa), the eight k16 key steps in increasing order:
            // m64n128k16 at d = 128, m64n64k16 at d = 64 (one 64-column half of V, so the
            // descriptor's leading byte offset is unused).
            auto mma_pv_block = [&]() {
                const uint64_t v_stage = stage_descriptor<kStageBytes>(desc_v, pv_stage);
#pragma unroll
                for (int kk = 0; kk < 8; ++kk) {
                    wgmma::mma_rs<Codec>(acc, pa[kk], v_stage + ((kk * 16 * 128) >> 4));
                }
                wgmma_commit();
            };

            // Issues the next block's S if WITH_S, then the P V product of block pv_stage if WITH_PV
            // (the -0 signs noted first); each product is one commit group, S first.  Every register
            // the products read is defined before the wgmma fence, so nothing but wgmma runs between
            // the two issues (ptxas would otherwise serialise them).
            auto issue = [&](auto with_s, auto with_pv) {
                if constexpr (decltype(with_s)::value) {
                    barrier_wait(&k_full[s_stage], s_phase);
#pragma unroll
                    for (int i = 0; i < 64; ++i) s[i] = 0.0f;
                }
                if constexpr (decltype(with_pv)::value) {
                    barrier_wait(&v_full[pv_stage], pv_phase);
                    note_negzero();
                }
                fence_operands<64>(s);
                fence_operands<kAcc>(acc);
                fence_registers(pa);
                wgmma_fence();
                if constexpr (decltype(with_s)::value) mma_s();
                if constexpr (decltype(with_pv)::value) mma_pv_block();
                fence_operands<64>(s);
                fence_operands<kAcc>(acc);
            };
            // S of the block at cur_stage is complete in this warp: its K stage may be refilled once
            // every consumer warp has arrived.
            auto free_k = [&]() {
                if (lane == 0) barrier_arrive(&k_empty[cur_stage]);
            };

            // Online softmax of block `blk`, attention.cu's arithmetic with s[t][e] = s[4t + e] (t =
            // 0..15, the block's 16 n8 tiles), in two parts.  scale(): -inf for an invisible key (the
            // raw scores stay in s; a block every real row of the warp sees in full is left as it
            // is).  The rest: the max of the raw scores scaled once, updates m, l, leaves P =
            // exp2_ftz(fma(s, c, -m_new)) in s and the rescale factors in alpha.  Written for few
            // instructions: the block max is a tree (max is exact in any order; scaled and its zero
            // normalised after the butterfly as in attention.cu), m_new = fmaxf(mx, m) (m is never NaN
            // or -0, and an empty row has mx = -inf: the same selection), alpha is computed then
            // selected, both rows in one pass, and a warp whose real rows all see a key skips the
            // selections of P (padding rows are never written; their P may be anything).
            float alpha[2];
            bool empty_now[2];
            bool any_empty = false;  // some real row of the warp sees no key of this block
            auto scale = [&](int blk) {
                const int key0 = blk * kBlockKeys;
                if (key0 + kBlockKeys > warp_vis_min) {
#pragma unroll
                    for (int t = 0; t < 16; ++t)
#pragma unroll
                        for (int i = 0; i < 2; ++i)
#pragma unroll
                            for (int e = 0; e < 2; ++e) {
                                const int j = key0 + t * 8 + 2 * c + e;
                                if (j >= vis_end[i]) s[4 * t + 2 * i + e] = kNegInf;
                            }
                }
            };
            auto softmax = [&]() {
                float m_new[2];
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    float mx16[16], mx8[8], mx4[4];
#pragma unroll
                    for (int k = 0; k < 16; ++k)
                        mx16[k] = fmaxf(s[4 * (k / 2) + 2 * i + k % 2], s[4 * (k / 2 + 8) + 2 * i + k % 2]);
#pragma unroll
                    for (int k = 0; k < 8; ++k) mx8[k] = fmaxf(mx16[k], mx16[k + 8]);
#pragma unroll
                    for (int k = 0; k < 4; ++k) mx4[k] = fmaxf(mx8[k], mx8[k + 4]);
                    float mx = fmaxf(fmaxf(mx4[0], mx4[2]), fmaxf(mx4[1], mx4[3]));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                    mx = scaled_block_max(mx, p.scale_log2);  // one zero (+0) whatever the lanes' order
                    empty_now[i] = mx == kNegInf;
                    m_new[i] = fmaxf(mx, m[i]);
                    const float a = exp2f(__fsub_rn(m[i], m_new[i]));  // selected away where undefined
                    alpha[i] = empty_now[i] ? 1.0f : (m[i] == kNegInf ? 0.0f : a);
                }
                any_empty = __any_sync(0xffffffffu, (empty_now[0] && row_q[0] >= 0) || (empty_now[1] && row_q[1] >= 0));
                // P and the block sums: one FFMA per score (s * c - m_new, one rounding).  An
                // invisible key (s = -inf) gives exp2(-inf) = +0 where m_new is finite; a row with no
                // visible key gets P = 0 by selection.  The sum runs over t = 0..15, e = 0..1 in this
                // order (the spec's order), then the quad butterfly.
                auto exp_sum = [&](auto select) {
                    float sum[2];
#pragma unroll
                    for (int t = 0; t < 16; ++t)
#pragma unroll
                        for (int i = 0; i < 2; ++i)
#pragma unroll
                            for (int e = 0; e < 2; ++e) {
                                float pe = p_of_score(s[4 * t + 2 * i + e], p.scale_log2, m_new[i]);
                                if constexpr (decltype(select)::value) pe = empty_now[i] ? 0.0f : pe;
                                s[4 * t + 2 * i + e] = pe;
                                // P >= +0 (or NaN): 0 + P is P, so the scan starts at the first term.
                                sum[i] = t == 0 && e == 0 ? pe : __fadd_rn(sum[i], pe);
                            }
#pragma unroll
                    for (int i = 0; i < 2; ++i) {
                        sum[i] = __fadd_rn(sum[i], __shfl_xor_sync(0xffffffffu, sum[i], 1));
                        sum[i] = __fadd_rn(sum[i], __shfl_xor_sync(0xffffffffu, sum[i], 2));
                        // Without a selection no real row of the warp is empty, so the update applies to
                        // all of them (a padding row's l is never written): no branch per row.
                        const float l_new = __fadd_rn(__fmul_rn(l[i], alpha[i]), sum[i]);
                        if constexpr (decltype(select)::value)
                            l[i] = empty_now[i] ? l[i] : l_new;
                        else
                            l[i] = l_new;
                        m[i] = m_new[i];
                    }
                };
                if (any_empty)
                    exp_sum(std::true_type{});
                else
                    exp_sum(std::false_type{});
            };

            // After the previous block's product is complete: P of this block into pa, acc *= alpha,
            // and the facts about this block that its own P V product will need.  At a split start
            // acc was merged away: it restarts from +0 (attention.cu zeroes it in the merge).
            auto rescale = [&](auto split_start) {
                // P -> pa only now: the previous block's P V product read pa until its wait.
#pragma unroll
                for (int kk = 0; kk < 8; ++kk)
#pragma unroll
                    for (int j = 0; j < 4; ++j) pa[kk][j] = pack_pair<Codec>(s[8 * kk + 2 * j], s[8 * kk + 2 * j + 1]);
#pragma unroll
                for (int i = 0; i < kAcc; ++i)
                    acc[i] = decltype(split_start)::value ? 0.0f : __fmul_rn(acc[i], alpha[(i / 2) % 2]);
                prev_empty[0] = empty_now[0];
                prev_empty[1] = empty_now[1];
                // Padding rows are never written: they do not need the -0 fix-up.
                prev_any_empty = any_empty;
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

            using Yes = std::true_type;
            using No = std::false_type;
            // Block blk's S product, then block blk-1's P V product behind it; block blk's
            // softmax runs while P V executes.  No branch between a product's issue and its wait.
            if (blk_end > 0) {
                cur_stage = s_stage;
                cur_phase = s_phase;
                issue(Yes{}, No{});
                wgmma_wait<0>();
                fence_operands<64>(s);
                free_k();
                scale(0);
                softmax();
                rescale(No{});
            }
            // A block that starts a split (blk-1 ended one) is a separate copy of the step, so that
            // the merge and the restart of acc cost nothing in the other blocks.
            auto step = [&](int blk, auto split_start) {
                pv_stage = cur_stage;
                pv_phase = cur_phase;
                cur_stage = s_stage;
                cur_phase = s_phase;
                issue(Yes{}, Yes{});
                wgmma_wait<1>();  // S of block blk is complete; P V of block blk-1 may still run
                fence_operands<64>(s);
                free_k();
                if constexpr (decltype(split_start)::value) start_split();
                scale(blk);
                softmax();
                wgmma_wait<0>();
                finish_pv(blk - 1, split_start, No{});
                rescale(split_start);
            };
            // One inner loop per split: the steady step is a loop of its own (no split test per block,
            // and no join with the split-start copy at its back edge, which made ptxas copy registers).
            for (int blk = 1; blk < blk_end;) {
                if (blk % kBlocksPerSplit == 0) step(blk++, Yes{});
                const int seg_end = min(blk_end, (blk + kBlocksPerSplit - 1) / kBlocksPerSplit * kBlocksPerSplit);
                for (; blk < seg_end; ++blk) step(blk, No{});
            }
            if (blk_end > 0) {
                pv_stage = cur_stage;
                pv_phase = cur_phase;
                issue(No{}, Yes{});
                start_split();  // keeps the last split's m, l in end_m, end_l for its merge
                wgmma_wait<0>();
                finish_pv(blk_end - 1, Yes{}, Yes{});  // the last block always ends a split
            }

            // finalize: out = acc / l (finalize_out's bits, finalize_row), both rows of the thread in turn.
            T* op = static_cast<T*>(p.out);
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                if (row_q[i] < 0) continue;
                const int64_t t_row = q_base + row_q[i];
                T* dst = op + t_row * p.out_row + row_h[i] * p.out_head;
                const float l_row = run_l[i];
                float o[kOut];
#pragma unroll
                for (int k = 0; k < kOut; ++k) o[k] = acc[(k / 2) * 4 + 2 * i + k % 2];
                finalize_row(o, l_row);
#pragma unroll
                for (int t = 0; t < kOut / 2; ++t)
                    *reinterpret_cast<uint32_t*>(dst + t * 8 + 2 * c) = store_pair<Codec>(o[2 * t], o[2 * t + 1]);
                if (c == 0) p.lse[static_cast<int64_t>(row_h[i]) * p.tq + t_row] = finalize_lse(run_m[i], l_row);
            }
        }  // has_rows
        w = w_next;
    }  // work items
#elif defined(__CUDA_ARCH__)
    __trap();  // built only into sm_90a images; the host never launches it elsewhere
#endif
}

}  // namespace attn_hopper
}  // namespace batchinv

#define BATCHINV_ATTN_HOPPER(SUFFIX, CODEC, D)                                                                  \
    extern "C" __global__ void __launch_bounds__(384, 1) attn_hopper_fwd_##SUFFIX(                              \
        const __grid_constant__ batchinv::TensorMap map_k, const __grid_constant__ batchinv::TensorMap map_v,   \
        const void* q, void* out, float* lse, const int* q_start, const int* q_len, const int* k_start,         \
        const int* k_len, int64_t q_row, int64_t q_head, int64_t out_row, int64_t out_head, int tq, int hq,     \
        int hkv, int pack, int causal, float scale_log2, int* queue, int q_tiles, int batch) {                  \
        const batchinv::attn_hopper::Params p{q,     out,   lse,      q_start, q_len, k_start, k_len, q_row,    \
                                              q_head, out_row, out_head, tq,   hq,    hkv,     pack,  causal,   \
                                              scale_log2, queue, q_tiles, batch};                               \
        batchinv::attn_hopper::attn_hopper_tile<CODEC, D>(map_k, map_v, p);                                     \
    }

// Arguments: (map_k, map_v, q, out, lse, q_start, q_len, k_start, k_len, q_row, q_head, out_row,
//             out_head, tq, hq, hkv, pack, causal, scale_log2, queue, q_tiles, batch).
BATCHINV_ATTN_HOPPER(bf16_d128, batchinv::Bf16Codec, 128)
BATCHINV_ATTN_HOPPER(f16_d128, batchinv::F16Codec, 128)
BATCHINV_ATTN_HOPPER(bf16_d64, batchinv::Bf16Codec, 64)
BATCHINV_ATTN_HOPPER(f16_d64, batchinv::F16Codec, 64)

// Test kernel: finalize_row (the tile kernel's division) next to finalize_out, element by element,
// on rows of 32 given values and a given l each: out_row[r * 32 + k] and out_ref[r * 32 + k].
// tests/gpu/test_attention_hopper_cuda.py compares the two bitwise over wide value ranges.
extern "C" __global__ void attn_hopper_finalize_check(const float* values, const float* l, float* out_row,
                                                      float* out_ref, int64_t rows) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    float o[32];
#pragma unroll
    for (int k = 0; k < 32; ++k) {
        o[k] = values[r * 32 + k];
        out_ref[r * 32 + k] = batchinv::attn::finalize_out(o[k], l[r]);
    }
    batchinv::attn_hopper::finalize_row(o, l[r]);
#pragma unroll
    for (int k = 0; k < 32; ++k) out_row[r * 32 + k] = o[k];
#elif defined(__CUDA_ARCH__)
    __trap();  // built only into sm_90a images; the host never launches it elsewhere
#endif
}
#endif

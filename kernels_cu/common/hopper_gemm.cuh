// The Hopper (sm_90a) GEMM main loop, one copy for linear.cu and token_logprobs.cu (the logits
// and both backward GEMMs), so that every product they compute is reduced in the same K order:
// 64-wide k-tiles in increasing k, four k16 wgmma steps each, fp32 accumulators, no split-K.
//
// One CTA computes one BM x BN tile of out = A · B.  A is K-major ([M, K] rows, boxes of BM
// rows by 64 k) or, with kTransA, M-major ([K, M] rows, boxes of 64 M by 64 k-rows); B is
// K-major ([N, K] rows) or, with kTransB, N-major ([K, N] rows).  TMA loads the boxes, 128-byte
// swizzled, into a ring of STAGES shared-memory stages of STAGE_K k-columns (STAGE_K / 64 boxes
// per operand, box after box); one producer warpgroup issues the copies, BM/64 consumer
// warpgroups run wgmma m64nBNk16 (the transpose flags read the M/N-major boxes as they lie).
// Tiles are numbered in groups of 16 tile rows for L2 reuse.  Block 128 * (BM/64 + 1) threads;
// dynamic shared memory STAGES * (BM + BN) * 2 * STAGE_K + 16 * STAGES + 1024 bytes.
#pragma once

#include "hopper.cuh"
#include "wgmma.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
namespace batchinv {
namespace hopper {

constexpr int kGemmTileK = 64;                    // k-columns per box: one 128-byte swizzled row
constexpr int kMnBoxBytes = 64 * kGemmTileK * 2;  // an M/N-major box: 64 k-rows of 128 bytes

// One k16 step of a consumer warpgroup: D += A * B for its 64 rows and the tile's BN columns.
template <typename Codec, int BN, int kTransA, int kTransB>
__device__ __forceinline__ void gemm_mma_k16(float (&acc)[BN / 2], uint64_t desc_a, uint64_t desc_b) {
    if constexpr (kTransA || kTransB) {
        static_assert(BN == 256, "M/N-major operands are wrapped for m64n256k16 only");
        wgmma::mma_trans<Codec, kTransA, kTransB>(acc, desc_a, desc_b);
    } else {
        wgmma::mma<Codec>(acc, desc_a, desc_b);  // m64n{BN}k16
    }
}

// Copies one operand's box of kRows rows (M or N) by 64 k-columns at (k, row0): one TMA box
// when K-major, kRows / 64 boxes of 64 x 64 when M/N-major.
template <int kTrans, int kRows>
__device__ __forceinline__ void gemm_load_box(uint8_t* box, const TensorMap& map, uint64_t* barrier, int k,
                                              int row0) {
    if constexpr (kTrans) {
#pragma unroll
        for (int c = 0; c < kRows / 64; ++c) tma_load_2d(box + c * kMnBoxBytes, map, barrier, row0 + 64 * c, k);
    } else {
        tma_load_2d(box, map, barrier, k, row0);
    }
}

// Descriptor of k16 step `step` of a box: 32 bytes along a K-major row, or 16 rows of 128
// bytes M/N-major.
template <int kTrans>
__device__ __forceinline__ uint64_t gemm_step_descriptor(const uint8_t* box, int step) {
    return kTrans ? smem_descriptor_128b(box + 2048 * step, kMnBoxBytes) : smem_descriptor_128b(box + 32 * step);
}

// The main loop over the k-columns [k_begin, k_end) (k_begin a multiple of 64), then
// epilogue(acc, row, n0, lane) with each consumer thread's accumulators (layout: wgmma.cuh),
// its first row (the other is row + 8), the tile's first column and its lane.
// shared_raw: the caller's `extern __shared__` array.  Its PTX symbol is named after the
// namespace that declares it, so each file keeps its own (and its own PTX).
// kKRange: true (linear.cu): any STAGE_K and any [k_begin, k_end); boxes wholly past k_end (a
// stage's second box with STAGE_K = 128, or past a K-group's end) are skipped.  false
// (token_logprobs.cu's backward): one box per stage over [0, K), nothing to skip.  The two
// producer branches issue the same copies, each in its own spelling: the compiler keeps the
// address arithmetic in written order, so the spelling decides each file's PTX.
template <typename Codec, int BM, int BN, int STAGE_K, int STAGES, int kTransA, int kTransB, bool kKRange,
          typename Epilogue>
__device__ __forceinline__ void gemm_k_range(uint8_t* shared_raw, const TensorMap& map_a, const TensorMap& map_b,
                                             int M, int N, int k_begin, int k_end, const Epilogue& epilogue) {
    static_assert(kKRange || STAGE_K == kGemmTileK, "without kKRange a stage holds one box");
    constexpr int kConsumers = BM / 64;
    constexpr int kBoxes = STAGE_K / kGemmTileK;
    constexpr int kBoxABytes = BM * kGemmTileK * 2;
    constexpr int kBoxBBytes = BN * kGemmTileK * 2;
    constexpr int kStageABytes = kBoxes * kBoxABytes;
    constexpr int kStageBBytes = kBoxes * kBoxBBytes;
    // 128-byte swizzled tiles must start on a 1024-byte boundary.
    uint8_t* shared = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(shared_raw) + 1023) & ~uintptr_t(1023));
    uint8_t* tiles_a = shared;
    uint8_t* tiles_b = shared + STAGES * kStageABytes;
    uint64_t* full = reinterpret_cast<uint64_t*>(tiles_b + STAGES * kStageBBytes);
    uint64_t* empty = full + STAGES;

    // Tiles are numbered in groups of kGroupM tile rows, tile rows fastest, so the CTAs that
    // run at the same time share a band of A and a band of B small enough for L2.
    constexpr int kGroupM = 16;
    const int tiles_m = (M + BM - 1) / BM;
    const int tiles_n = (N + BN - 1) / BN;
    const int tiles_per_group = kGroupM * tiles_n;
    const int first_tile_m = (static_cast<int>(blockIdx.x) / tiles_per_group) * kGroupM;
    const int group_rows = min(tiles_m - first_tile_m, kGroupM);
    const int in_group = static_cast<int>(blockIdx.x) % tiles_per_group;
    const int m0 = (first_tile_m + in_group % group_rows) * BM;
    const int n0 = (in_group / group_rows) * BN;
    const int k_tiles = (k_end - k_begin + STAGE_K - 1) / STAGE_K;
    const int warpgroup = threadIdx.x / 128;

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            barrier_init(&full[s], 1);
            barrier_init(&empty[s], kConsumers);
        }
        fence_barrier_init();
    }
    __syncthreads();

    if (warpgroup == 0) {
        release_registers<40>();
        if (threadIdx.x == 0) {
            for (int kt = 0; kt < k_tiles; ++kt) {
                const int s = kt % STAGES;
                const int round = kt / STAGES;
                // Past K (or M, N) a box arrives as zeros.
                if constexpr (kKRange) {
                    if (round > 0) barrier_wait(&empty[s], (round - 1) & 1);
                    barrier_expect_bytes(&full[s], kStageABytes + kStageBBytes);
#pragma unroll
                    for (int b = 0; b < kBoxes; ++b) {
                        const int k = k_begin + kt * STAGE_K + b * kGemmTileK;
                        gemm_load_box<kTransA, BM>(tiles_a + s * kStageABytes + b * kBoxABytes, map_a, &full[s], k, m0);
                        gemm_load_box<kTransB, BN>(tiles_b + s * kStageBBytes + b * kBoxBBytes, map_b, &full[s], k, n0);
                    }
                } else {
                    const int k = kt * kGemmTileK;
                    if (round > 0) barrier_wait(&empty[s], (round - 1) & 1);
                    barrier_expect_bytes(&full[s], kStageABytes + kStageBBytes);
                    uint8_t* box_a = tiles_a + s * kStageABytes;
                    uint8_t* box_b = tiles_b + s * kStageBBytes;
                    gemm_load_box<kTransA, BM>(box_a, map_a, &full[s], k, m0);
                    gemm_load_box<kTransB, BN>(box_b, map_b, &full[s], k, n0);
                }
            }
        }
        return;
    }

    claim_registers<232>();
    const int consumer = warpgroup - 1;
    float acc[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.0f;

    for (int kt = 0; kt < k_tiles; ++kt) {
        const int s = kt % STAGES;
        barrier_wait(&full[s], (kt / STAGES) & 1);
        wgmma_fence();
#pragma unroll
        for (int b = 0; b < kBoxes; ++b) {
            // Boxes wholly past k_end are skipped, so every configuration runs exactly the k16
            // steps that cover [k_begin, k_end), in the same order.
            if (kKRange && k_begin + kt * STAGE_K + b * kGemmTileK >= k_end) break;
            // This consumer's 64 rows of A: the same offset in both layouts (one 64-row box).
            const uint8_t* box_a = tiles_a + s * kStageABytes + b * kBoxABytes + consumer * kMnBoxBytes;
            const uint8_t* box_b = tiles_b + s * kStageBBytes + b * kBoxBBytes;
#pragma unroll
            for (int k = 0; k < kGemmTileK / 16; ++k) {
                gemm_mma_k16<Codec, BN, kTransA, kTransB>(acc, gemm_step_descriptor<kTransA>(box_a, k),
                                                          gemm_step_descriptor<kTransB>(box_b, k));
            }
        }
        wgmma_commit();
        // Keep this tile's MMAs in flight; once the previous tile's have finished, its stage
        // can be refilled.  (The MMAs still execute in issue order: the bits do not change.)
        wgmma_wait<1>();
        if (kt > 0 && threadIdx.x % 128 == 0) barrier_arrive(&empty[(kt - 1) % STAGES]);
    }
    wgmma_wait<0>();

    const int lane = threadIdx.x % 32;
    const int warp = (threadIdx.x % 128) / 32;
    const int row = m0 + consumer * 64 + warp * 16 + lane / 4;
    epilogue(acc, row, n0, lane);
}

}  // namespace hopper
}  // namespace batchinv
#endif

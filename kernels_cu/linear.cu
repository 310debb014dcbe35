// Linear: out[M, N] = x[M, K] · weight[N, K]ᵀ (+ bias[N]), Hugging Face [out, in] weights.
//
//   x       [M, K]  bf16 or fp16, row-major (K contiguous), 16-byte aligned, K % 8 == 0
//   weight  [N, K]  same dtype and layout
//   bias    [N]     same dtype, or a null pointer
//   out     [M, N]  same dtype, row-major
//
// Invariance contract.  Every output element is one K reduction in fp32, and its order is a
// constant of the build: k-tiles of 64 in increasing k, each as four k16 tensor-core steps in
// increasing k; no split-K, no atomics.  The bias is added in fp32 after the reduction and the
// sum is rounded once.  What follows M — which tile shape runs (BM, BN), how many CTAs, which
// rows share a tile — only decides *which thread* computes an element, never the order of its
// arithmetic; rows beyond M in a tile are zero-filled by the copy engine and discarded.  That
// wgmma (any BM/BN) and mma.sync give identical bits for the same k16 step sequence is a
// measured property of the GPU, checked by tests/gpu/test_linear_cuda.py on every run.
//
// Two kernel families:
// - linear_hopper_*: sm_90a.  TMA loads 64-wide k-tiles of x and weight into a ring of shared
//   memory stages (STAGE_K = 64 or 128 k-columns each, as 64-wide boxes); one producer
//   warpgroup issues the copies, BM/64 consumer warpgroups run wgmma m64nBNk16.  Grid
//   ceil(M/BM) * ceil(N/BN) (1-D, grouped for L2 reuse); block 128 * (BM/64 + 1) threads;
//   dynamic shared memory STAGES * (BM + BN) * 2 * STAGE_K + 16 * STAGES + 1024 bytes.
// - linear_mma_*: sm_80 (mma.sync m16n8k16), the same k-step order; on HIP a SIMT loop (its
//   own order, fixed the same way).  Grid (ceil(N/32), ceil(M/64)); block 128.
#include "common/hopper.cuh"
#include "common/wgmma.cuh"

namespace batchinv {
namespace linear {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
constexpr int kTileK = 64;
#endif

template <typename Codec>
__device__ __forceinline__ uint16_t storage_bits(typename Codec::storage value) {
    return *reinterpret_cast<uint16_t*>(&value);
}

// Writes one pair of adjacent outputs (col, col + 1) of a row, with the bias added in fp32.
template <typename Codec>
__device__ __forceinline__ void store_pair(typename Codec::storage* out, const typename Codec::storage* bias,
                                           int row, int col, int M, int N, float v0, float v1) {
    if (row >= M || col >= N) return;
    if (bias != nullptr) {
        v0 = __fadd_rn(v0, Codec::load(bias[col]));
        if (col + 1 < N) v1 = __fadd_rn(v1, Codec::load(bias[col + 1]));
    }
    typename Codec::storage* dst = out + static_cast<int64_t>(row) * N + col;
    if (col + 1 < N && (N % 2) == 0) {
        const uint32_t packed = static_cast<uint32_t>(storage_bits<Codec>(Codec::store(v0))) |
                                (static_cast<uint32_t>(storage_bits<Codec>(Codec::store(v1))) << 16);
        *reinterpret_cast<uint32_t*>(dst) = packed;
    } else {
        dst[0] = Codec::store(v0);
        if (col + 1 < N) dst[1] = Codec::store(v1);
    }
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
template <typename Codec, int BN>
__device__ __forceinline__ void mma_k16(float (&acc)[BN / 2], uint64_t desc_x, uint64_t desc_w) {
    constexpr bool kBf16 = sizeof(typename Codec::storage) == 2 && Codec::kIsBf16;
    if constexpr (kBf16) {
        if constexpr (BN == 32) wgmma::mma_m64n32k16_bf16(acc, desc_x, desc_w);
        if constexpr (BN == 64) wgmma::mma_m64n64k16_bf16(acc, desc_x, desc_w);
        if constexpr (BN == 128) wgmma::mma_m64n128k16_bf16(acc, desc_x, desc_w);
        if constexpr (BN == 256) wgmma::mma_m64n256k16_bf16(acc, desc_x, desc_w);
    } else {
        if constexpr (BN == 32) wgmma::mma_m64n32k16_f16(acc, desc_x, desc_w);
        if constexpr (BN == 64) wgmma::mma_m64n64k16_f16(acc, desc_x, desc_w);
        if constexpr (BN == 128) wgmma::mma_m64n128k16_f16(acc, desc_x, desc_w);
        if constexpr (BN == 256) wgmma::mma_m64n256k16_f16(acc, desc_x, desc_w);
    }
}
#endif

// The linear's epilogue: bias added in fp32, each element rounded once and stored.  Other
// ops (token_logprobs.cu) pass their own epilogue to hopper_gemm_tiles and so reuse the same
// main loop, hence the same K order and the same bits for every product.
template <typename Codec>
struct StoreEpilogue {
    typename Codec::storage* out;
    const typename Codec::storage* bias;
    int M, N;
    // acc: the wgmma accumulators of one thread; row: its first row (the other is row + 8);
    // n0: the tile's first column; lane: the thread's lane (see common/wgmma.cuh's layout).
    template <int kAcc>
    __device__ __forceinline__ void operator()(const float (&acc)[kAcc], int row, int n0, int lane) const {
#pragma unroll
        for (int j = 0; j < kAcc / 4; ++j) {
            const int col = n0 + j * 8 + (lane % 4) * 2;
            store_pair<Codec>(out, bias, row, col, M, N, acc[4 * j], acc[4 * j + 1]);
            store_pair<Codec>(out, bias, row + 8, col, M, N, acc[4 * j + 2], acc[4 * j + 3]);
        }
    }
};

template <typename Codec, int BM, int BN, int STAGE_K, int STAGES, typename Epilogue>
__device__ __forceinline__ void hopper_gemm_tiles(const TensorMap& map_x, const TensorMap& map_w, int M, int N,
                                                  int K, const Epilogue& epilogue) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using namespace hopper;
    constexpr int kConsumers = BM / 64;
    // A stage holds STAGE_K / 64 boxes of 64 k-columns for each operand, box after box.
    constexpr int kBoxes = STAGE_K / kTileK;
    constexpr int kBoxXBytes = BM * kTileK * 2;
    constexpr int kBoxWBytes = BN * kTileK * 2;
    constexpr int kTileXBytes = kBoxes * kBoxXBytes;
    constexpr int kTileWBytes = kBoxes * kBoxWBytes;
    extern __shared__ uint8_t shared_raw[];
    // 128-byte swizzled tiles must start on a 1024-byte boundary.
    uint8_t* shared = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(shared_raw) + 1023) & ~uintptr_t(1023));
    uint8_t* tiles_x = shared;
    uint8_t* tiles_w = shared + STAGES * kTileXBytes;
    uint64_t* full = reinterpret_cast<uint64_t*>(tiles_w + STAGES * kTileWBytes);
    uint64_t* empty = full + STAGES;

    // Tiles are numbered in groups of kGroupM tile rows, tile rows fastest, so the CTAs that
    // run at the same time share a band of x and a band of weight small enough for L2.
    constexpr int kGroupM = 16;
    const int tiles_m = (M + BM - 1) / BM;
    const int tiles_n = (N + BN - 1) / BN;
    const int tiles_per_group = kGroupM * tiles_n;
    const int first_tile_m = (static_cast<int>(blockIdx.x) / tiles_per_group) * kGroupM;
    const int group_rows = min(tiles_m - first_tile_m, kGroupM);
    const int in_group = static_cast<int>(blockIdx.x) % tiles_per_group;
    const int m0 = (first_tile_m + in_group % group_rows) * BM;
    const int n0 = (in_group / group_rows) * BN;
    const int k_tiles = (K + STAGE_K - 1) / STAGE_K;
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
                if (round > 0) barrier_wait(&empty[s], (round - 1) & 1);
                barrier_expect_bytes(&full[s], kTileXBytes + kTileWBytes);
#pragma unroll
                for (int b = 0; b < kBoxes; ++b) {
                    const int k = kt * STAGE_K + b * kTileK;  // past K the box arrives as zeros
                    tma_load_2d(tiles_x + s * kTileXBytes + b * kBoxXBytes, map_x, &full[s], k, m0);
                    tma_load_2d(tiles_w + s * kTileWBytes + b * kBoxWBytes, map_w, &full[s], k, n0);
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
            // Boxes wholly past K are skipped, so every configuration runs exactly the k16
            // steps that cover K, in the same order.
            if (kt * STAGE_K + b * kTileK >= K) break;
            const uint8_t* tile_x = tiles_x + s * kTileXBytes + b * kBoxXBytes + consumer * 64 * kTileK * 2;
            const uint8_t* tile_w = tiles_w + s * kTileWBytes + b * kBoxWBytes;
#pragma unroll
            for (int k = 0; k < kTileK / 16; ++k) {
                // One k16 step is 32 bytes along a 128-byte swizzled row.
                mma_k16<Codec, BN>(acc, smem_descriptor_128b(tile_x + 32 * k),
                                   smem_descriptor_128b(tile_w + 32 * k));
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
#elif defined(__CUDA_ARCH__)
    __trap();  // built only into sm_90a images; the host never launches it elsewhere
#endif
}

template <typename Codec, int BM, int BN, int STAGE_K, int STAGES>
__device__ __forceinline__ void hopper_gemm(const TensorMap& map_x, const TensorMap& map_w,
                                            typename Codec::storage* out, const typename Codec::storage* bias,
                                            int M, int N, int K) {
    const StoreEpilogue<Codec> epilogue{out, bias, M, N};
    hopper_gemm_tiles<Codec, BM, BN, STAGE_K, STAGES>(map_x, map_w, M, N, K, epilogue);
}

// ---- the sm_80 / HIP kernel -----------------------------------------------------------

// Two consecutive elements (k, k + 1) of a row as one 32-bit register; zeros past the end.
template <typename Codec>
__device__ __forceinline__ uint32_t load_pair(const typename Codec::storage* matrix, int row, int rows, int k, int K) {
    if (row >= rows || k >= K) return 0u;
    return *reinterpret_cast<const uint32_t*>(matrix + static_cast<int64_t>(row) * K + k);
}

template <typename Codec>
__device__ __forceinline__ void mma_gemm(const typename Codec::storage* x, const typename Codec::storage* w,
                                         typename Codec::storage* out, const typename Codec::storage* bias, int M,
                                         int N, int K) {
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int row0 = blockIdx.y * 64 + warp * 16;  // this warp's 16 rows
    const int col0 = blockIdx.x * 32;              // the CTA's 32 columns, four n8 tiles
#if defined(__HIPCC__) || !defined(__CUDA_ARCH__) || __CUDA_ARCH__ < 800
    // SIMT: each lane owns (row0 + lane / 2, 16 columns), K reduced in order with FMAs.
    const int row = row0 + lane / 2;
    for (int c = 0; c < 16; c += 2) {
        const int col = col0 + (lane % 2) * 16 + c;
        float v0 = 0.0f, v1 = 0.0f;
        if (row < M) {
            for (int k = 0; k < K; ++k) {
                const float a = Codec::load(x[static_cast<int64_t>(row) * K + k]);
                if (col < N) v0 = __fmaf_rn(a, Codec::load(w[static_cast<int64_t>(col) * K + k]), v0);
                if (col + 1 < N) v1 = __fmaf_rn(a, Codec::load(w[static_cast<int64_t>(col + 1) * K + k]), v1);
            }
        }
        store_pair<Codec>(out, bias, row, col, M, N, v0, v1);
    }
#else
    float acc[4][4] = {};
    const int group = lane / 4;       // fragment row (A, C) or column (B)
    const int pair = (lane % 4) * 2;  // fragment k (A, B) or column pair (C)
    for (int k0 = 0; k0 < K; k0 += 16) {
        uint32_t a[4];
        a[0] = load_pair<Codec>(x, row0 + group, M, k0 + pair, K);
        a[1] = load_pair<Codec>(x, row0 + group + 8, M, k0 + pair, K);
        a[2] = load_pair<Codec>(x, row0 + group, M, k0 + pair + 8, K);
        a[3] = load_pair<Codec>(x, row0 + group + 8, M, k0 + pair + 8, K);
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const int n = col0 + t * 8 + group;
            const uint32_t b0 = load_pair<Codec>(w, n, N, k0 + pair, K);
            const uint32_t b1 = load_pair<Codec>(w, n, N, k0 + pair + 8, K);
            if constexpr (Codec::kIsBf16) {
                asm volatile(
                    "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                    "{%8, %9}, {%0, %1, %2, %3};"
                    : "+f"(acc[t][0]), "+f"(acc[t][1]), "+f"(acc[t][2]), "+f"(acc[t][3])
                    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
            } else {
                asm volatile(
                    "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                    "{%8, %9}, {%0, %1, %2, %3};"
                    : "+f"(acc[t][0]), "+f"(acc[t][1]), "+f"(acc[t][2]), "+f"(acc[t][3])
                    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
            }
        }
    }
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        const int col = col0 + t * 8 + pair;
        store_pair<Codec>(out, bias, row0 + group, col, M, N, acc[t][0], acc[t][1]);
        store_pair<Codec>(out, bias, row0 + group + 8, col, M, N, acc[t][2], acc[t][3]);
    }
#endif
}

}  // namespace linear
}  // namespace batchinv

// Kernel names encode the configuration the host reads back: dtype, BM, BN, stages.
#define BATCHINV_LINEAR_HOPPER(DTYPE, CODEC, BM, BN, STAGE_K, STAGES)                                           \
    extern "C" __global__ void __launch_bounds__(128 * (BM / 64 + 1), 1)                                         \
        linear_hopper_##DTYPE##_bm##BM##_bn##BN##_k##STAGE_K##_s##STAGES(                                      \
            const __grid_constant__ batchinv::TensorMap map_x, const __grid_constant__ batchinv::TensorMap map_w, \
            CODEC::storage* out, const CODEC::storage* bias, int M, int N, int K) {                              \
        batchinv::linear::hopper_gemm<CODEC, BM, BN, STAGE_K, STAGES>(map_x, map_w, out, bias, M, N, K);         \
    }

#define BATCHINV_LINEAR_MMA(DTYPE, CODEC)                                                                         \
    extern "C" __global__ void __launch_bounds__(128)                                                            \
        linear_mma_##DTYPE(const CODEC::storage* x, const CODEC::storage* w, CODEC::storage* out,                \
                           const CODEC::storage* bias, int M, int N, int K) {                                    \
        batchinv::linear::mma_gemm<CODEC>(x, w, out, bias, M, N, K);                                             \
    }

// token_logprobs.cu includes this file for hopper_gemm_tiles and defines this to leave the
// linear's own kernels out of its module.
#if !defined(BATCHINV_LINEAR_NO_KERNELS)
#if !defined(__HIPCC__)
// batchinv-signature: linear_hopper_bf16_bm64_bn32_k128_s8(tmap, tmap, ptr, ptr, i32, i32, i32)
BATCHINV_LINEAR_HOPPER(bf16, batchinv::Bf16Codec, 64, 32, 128, 8)
// batchinv-signature: linear_hopper_bf16_bm64_bn64_k128_s6(tmap, tmap, ptr, ptr, i32, i32, i32)
BATCHINV_LINEAR_HOPPER(bf16, batchinv::Bf16Codec, 64, 64, 128, 6)
// batchinv-signature: linear_hopper_bf16_bm64_bn128_k64_s6(tmap, tmap, ptr, ptr, i32, i32, i32)
BATCHINV_LINEAR_HOPPER(bf16, batchinv::Bf16Codec, 64, 128, 64, 6)
// batchinv-signature: linear_hopper_bf16_bm64_bn256_k64_s4(tmap, tmap, ptr, ptr, i32, i32, i32)
BATCHINV_LINEAR_HOPPER(bf16, batchinv::Bf16Codec, 64, 256, 64, 4)
// batchinv-signature: linear_hopper_bf16_bm128_bn128_k64_s6(tmap, tmap, ptr, ptr, i32, i32, i32)
BATCHINV_LINEAR_HOPPER(bf16, batchinv::Bf16Codec, 128, 128, 64, 6)
// batchinv-signature: linear_hopper_bf16_bm128_bn256_k64_s4(tmap, tmap, ptr, ptr, i32, i32, i32)
BATCHINV_LINEAR_HOPPER(bf16, batchinv::Bf16Codec, 128, 256, 64, 4)
// batchinv-signature: linear_hopper_f16_bm64_bn32_k128_s8(tmap, tmap, ptr, ptr, i32, i32, i32)
BATCHINV_LINEAR_HOPPER(f16, batchinv::F16Codec, 64, 32, 128, 8)
// batchinv-signature: linear_hopper_f16_bm64_bn64_k128_s6(tmap, tmap, ptr, ptr, i32, i32, i32)
BATCHINV_LINEAR_HOPPER(f16, batchinv::F16Codec, 64, 64, 128, 6)
// batchinv-signature: linear_hopper_f16_bm64_bn128_k64_s6(tmap, tmap, ptr, ptr, i32, i32, i32)
BATCHINV_LINEAR_HOPPER(f16, batchinv::F16Codec, 64, 128, 64, 6)
// batchinv-signature: linear_hopper_f16_bm64_bn256_k64_s4(tmap, tmap, ptr, ptr, i32, i32, i32)
BATCHINV_LINEAR_HOPPER(f16, batchinv::F16Codec, 64, 256, 64, 4)
// batchinv-signature: linear_hopper_f16_bm128_bn128_k64_s6(tmap, tmap, ptr, ptr, i32, i32, i32)
BATCHINV_LINEAR_HOPPER(f16, batchinv::F16Codec, 128, 128, 64, 6)
// batchinv-signature: linear_hopper_f16_bm128_bn256_k64_s4(tmap, tmap, ptr, ptr, i32, i32, i32)
BATCHINV_LINEAR_HOPPER(f16, batchinv::F16Codec, 128, 256, 64, 4)
#endif

// batchinv-signature: linear_mma_bf16(ptr, ptr, ptr, ptr, i32, i32, i32)
BATCHINV_LINEAR_MMA(bf16, batchinv::Bf16Codec)
// batchinv-signature: linear_mma_f16(ptr, ptr, ptr, ptr, i32, i32, i32)
BATCHINV_LINEAR_MMA(f16, batchinv::F16Codec)
#endif  // BATCHINV_LINEAR_NO_KERNELS

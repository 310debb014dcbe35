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
// Kernel families (plus, at the end, the K-group tree kernels of batchinv.linear_k_groups, which
// reuse the Hopper and small-M main loops over one group's k-range each):
// - linear_hopper_*: sm_90a, the main loop of common/hopper_gemm.cuh (token_logprobs.cu runs the
//   same one).  TMA loads 64-wide k-tiles of x and weight into a ring of shared memory stages
//   (STAGE_K = 64 or 128 k-columns each, as 64-wide boxes); one producer warpgroup issues the
//   copies, BM/64 consumer warpgroups run wgmma m64nBNk16.  Grid
//   ceil(M/BM) * ceil(N/BN) (1-D, grouped for L2 reuse); block 128 * (BM/64 + 1) threads;
//   dynamic shared memory STAGES * (BM + BN) * 2 * STAGE_K + 16 * STAGES + 1024 bytes.
// - linear_small_m_*: sm_90a, for decode-sized M.  The weight is the MMA's M side
//   (out^T = W x^T): mma.sync m16n8k16 with 16 weight rows (output columns) per consumer warp
//   and 8 tokens per CTA, so almost no tensor-core work is spent on padding rows and a CTA
//   covers as few as 16 output columns (many CTAs even at N = 4096).  The same TMA ring as
//   the Hopper kernels (STAGE_K k-columns per stage, 64-wide boxes, 128-byte swizzle), read
//   with ldmatrix; the same k16 steps in the same order.  Grid ceil(N/BN) * ceil(M/8); block
//   32 * (BN/16 + 1) threads (the last warp issues the copies); dynamic shared memory
//   STAGES * (BN + 8) * 2 * STAGE_K + 16 * STAGES + 1024 bytes.
// - linear_small_m_grouped_*: sm_90a, up to three small-M products of one x in one launch
//   (q/k/v, gate/up): out[M, N0 + N1 + N2] holds x W_g^T (+ b_g) in columns
//   [N0 + ... + N_{g-1}, + N_g).  Grid: the small-M grids of the groups back to back
//   (sum of ceil(N_g/BN) * ceil(M/8)); each CTA runs the small-M body above on its group's
//   weight, so each element has the bits of the separate small-M launch.  Block and shared
//   memory as the small-M kernel of the same BN.
// - linear_hopper_tb_* / linear_hopper_tab_*: sm_90a, the backward's products with operands
//   read in place where they lie M- or N-major (no transposed copy): the same main loop with
//   its transpose options (TMA boxes of 64 M/N-elements by 64 k-rows, wgmma's transpose
//   flags), BN = 256 (the transposed wgmma is built for n256), 64-wide stages, 4 stages.
//   "tb": out[M, N] = A[M, K] · B[K, N] with B's rows along K (B N-major): grad_x = dY · W
//   (K = out_features, W [out, in] as it lies) and grad_bias = 1ᵀ · dY (K = tokens).
//   "tab": A read M-major too, out[M, N] = A[K, M]ᵀ · B[K, N]: grad_W = dYᵀ · X (K = tokens,
//   dY [tokens, out] and X [tokens, in] as they lie).  The K order is the one above (64-wide
//   k-tiles in increasing k, four k16 steps each), so each gives the bits of the K-major
//   kernels run on transposed copies; that wgmma's transpose flags change no bits is a
//   measured property of the GPU, checked by tests/gpu/test_linear_backward_cuda.py.  Grid
//   ceil(M/BM) * ceil(N/256); block 128 * (BM/64 + 1); dynamic shared memory as the Hopper
//   kernels with BN = 256, STAGE_K = 64, STAGES = 4.
// - linear_mma_*: sm_80 (mma.sync m16n8k16), the same k-step order; on HIP a SIMT loop (its
//   own order, fixed the same way).  Grid (ceil(N/32), ceil(M/64)); block 128.
// - linear_simt_*: that SIMT loop in every build (CUDA and HIP): one FMA chain per output over k
//   in increasing order.  HIP's linear runs it; on NVIDIA it lets tests run HIP's arithmetic.
#include "common/grid_dependency.cuh"
#include "common/hopper_gemm.cuh"
#include "common/mma_sync.cuh"

namespace batchinv {
namespace linear {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
constexpr int kTileK = hopper::kGemmTileK;  // the small-M kernel reads the same 64-wide boxes
#endif
// The transposed kernels' tile columns, k-columns per stage and stages (their names say so).
constexpr int kTransposedBN = 256;
constexpr int kTransposedStageK = 64;
constexpr int kTransposedStages = 4;

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

// The main loop over the k-columns [k_begin, k_end) (k_begin a multiple of 64), both operands
// K-major (common/hopper_gemm.cuh); the linear reduces [0, K), the K-group kernels one group
// each.
template <typename Codec, int BM, int BN, int STAGE_K, int STAGES, typename Epilogue>
__device__ __forceinline__ void hopper_gemm_k_range(const TensorMap& map_x, const TensorMap& map_w, int M, int N,
                                                    int k_begin, int k_end, const Epilogue& epilogue) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ uint8_t shared_raw[];
    hopper::gemm_k_range<Codec, BM, BN, STAGE_K, STAGES, 0, 0, true>(shared_raw, map_x, map_w, M, N, k_begin,
                                                                       k_end, epilogue);
#elif defined(__CUDA_ARCH__)
    __trap();  // built only into sm_90a images; the host never launches it elsewhere
#endif
}

template <typename Codec, int BM, int BN, int STAGE_K, int STAGES, typename Epilogue>
__device__ __forceinline__ void hopper_gemm_tiles(const TensorMap& map_x, const TensorMap& map_w, int M, int N,
                                                  int K, const Epilogue& epilogue) {
    hopper_gemm_k_range<Codec, BM, BN, STAGE_K, STAGES>(map_x, map_w, M, N, 0, K, epilogue);
}

template <typename Codec, int BM, int BN, int STAGE_K, int STAGES>
__device__ __forceinline__ void hopper_gemm(const TensorMap& map_x, const TensorMap& map_w,
                                            typename Codec::storage* out, const typename Codec::storage* bias,
                                            int M, int N, int K) {
    const StoreEpilogue<Codec> epilogue{out, bias, M, N};
    hopper_gemm_tiles<Codec, BM, BN, STAGE_K, STAGES>(map_x, map_w, M, N, K, epilogue);
}

// The backward's products with M/N-major operands (see the kernel families above): A K-major
// or (kTransA) M-major, B N-major, the linear's K order over [0, K), the linear's epilogue.
// The bias is a kernel argument although the backward passes null: with a constant null,
// ptxas serialises the bf16 wgmma chain (C7511, "insufficient register resources"); with a
// run-time pointer it does not, as for the forward kernels.
template <typename Codec, int BM, int kTransA>
__device__ __forceinline__ void hopper_gemm_transposed(const TensorMap& map_a, const TensorMap& map_b,
                                                       typename Codec::storage* out,
                                                       const typename Codec::storage* bias, int M, int N, int K) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ uint8_t shared_raw[];
    const StoreEpilogue<Codec> epilogue{out, bias, M, N};
    hopper::gemm_k_range<Codec, BM, kTransposedBN, kTransposedStageK, kTransposedStages, kTransA, 1, true>(
        shared_raw, map_a, map_b, M, N, 0, K, epilogue);
#elif defined(__CUDA_ARCH__)
    __trap();  // built only into sm_90a images; the host never launches it elsewhere
#endif
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Byte offset of the 16-byte chunk `chunk` (8 elements) of row `row` inside a TMA box of
// 64-element rows written with the 128-byte swizzle (box base 1024-byte aligned).
__device__ __forceinline__ uint32_t swizzled_128b(int row, int chunk) {
    return static_cast<uint32_t>(row * 128 + ((chunk ^ (row % 8)) << 4));
}
#endif

// The small-M kernel: out^T[N, M] = W[N, K] x^T, the weight on the MMA's M side.  BN weight
// rows (BN/16 consumer warps, 16 rows each) by 8 tokens per CTA; the K order is that of the
// Hopper kernels: 64-wide boxes in increasing k, four k16 steps each, every box that starts
// below K run whole (zeros past K), one fp32 accumulator chain per element.
// `block`: the CTA's index among the CTAs of this product (blockIdx.x for one product; the
// grouped kernel's index within its group).
template <typename Codec, int BN, int STAGE_K, int STAGES, typename ElementEpilogue>
__device__ __forceinline__ void small_m_k_range(const TensorMap& map_x, const TensorMap& map_w, int M, int N,
                                                int k_begin, int k_end, int block,
                                                const ElementEpilogue& epilogue) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using namespace hopper;
    constexpr int kWarps = BN / 16;
    constexpr int kTokens = 8;
    constexpr int kBoxes = STAGE_K / kTileK;
    constexpr int kBoxWBytes = BN * kTileK * 2;
    constexpr int kBoxXBytes = kTokens * kTileK * 2;
    constexpr int kStageWBytes = kBoxes * kBoxWBytes;
    constexpr int kStageXBytes = kBoxes * kBoxXBytes;
    static_assert(kBoxWBytes % 1024 == 0 && kBoxXBytes % 1024 == 0, "boxes must keep 1024-byte alignment");
    extern __shared__ uint8_t shared_raw[];
    uint8_t* shared = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(shared_raw) + 1023) & ~uintptr_t(1023));
    uint8_t* tiles_w = shared;
    uint8_t* tiles_x = shared + STAGES * kStageWBytes;
    uint64_t* full = reinterpret_cast<uint64_t*>(tiles_x + STAGES * kStageXBytes);
    uint64_t* empty = full + STAGES;

    // Token tiles of the same weight rows are neighbours in launch order, so with more than
    // 8 tokens the weight is read from HBM once and from L2 by the other token tiles.
    const int tiles_m = (M + kTokens - 1) / kTokens;
    const int n0 = (block / tiles_m) * BN;
    const int m0 = (block % tiles_m) * kTokens;
    const int k_tiles = (k_end - k_begin + STAGE_K - 1) / STAGE_K;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            barrier_init(&full[s], 1);
            barrier_init(&empty[s], kWarps);
        }
        fence_barrier_init();
    }
    __syncthreads();

    if (warp == kWarps) {  // the producer warp
        if (lane == 0) {
            // The weight's first stages are requested before griddepcontrol.wait, x's only after
            // it: with a programmatic launch (the host's weight prefetch, gpu/linear.py) the
            // weight streams in while the previous kernel, which writes x, still runs.  Without
            // one the wait returns at once; the stages hold the same bytes either way.
            const int first = k_tiles < STAGES ? k_tiles : STAGES;
            for (int kt = 0; kt < first; ++kt) {
                barrier_expect_bytes(&full[kt], kStageWBytes + kStageXBytes);
#pragma unroll
                for (int b = 0; b < kBoxes; ++b) {
                    const int k = k_begin + kt * STAGE_K + b * kTileK;  // past K the box arrives as zeros
                    tma_load_2d(tiles_w + kt * kStageWBytes + b * kBoxWBytes, map_w, &full[kt], k, n0);
                }
            }
            grid_wait_primary();
            for (int kt = 0; kt < first; ++kt) {
#pragma unroll
                for (int b = 0; b < kBoxes; ++b) {
                    const int k = k_begin + kt * STAGE_K + b * kTileK;
                    tma_load_2d(tiles_x + kt * kStageXBytes + b * kBoxXBytes, map_x, &full[kt], k, m0);
                }
            }
            for (int kt = first; kt < k_tiles; ++kt) {
                const int s = kt % STAGES;
                const int round = kt / STAGES;
                barrier_wait(&empty[s], (round - 1) & 1);
                barrier_expect_bytes(&full[s], kStageWBytes + kStageXBytes);
#pragma unroll
                for (int b = 0; b < kBoxes; ++b) {
                    const int k = k_begin + kt * STAGE_K + b * kTileK;  // past K the box arrives as zeros
                    tma_load_2d(tiles_w + s * kStageWBytes + b * kBoxWBytes, map_w, &full[s], k, n0);
                    tma_load_2d(tiles_x + s * kStageXBytes + b * kBoxXBytes, map_x, &full[s], k, m0);
                }
            }
        }
        return;
    }
    // The epilogue reads the bias and writes out, which the previous kernel may still read
    // under a programmatic launch (see the producer above).
    grid_wait_primary();

    // ldmatrix addresses: x4 gives the A fragment (rows 0-7 / 8-15 by k 0-7 / 8-15 of the
    // warp's 16 weight rows), x2 the B fragment (8 tokens by k 0-7 / 8-15).
    const int a_row = warp * 16 + (lane % 8) + 8 * ((lane / 8) % 2);
    const int a_half = lane / 16;
    const int b_row = lane % 8;
    const int b_half = (lane / 8) % 2;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int kt = 0; kt < k_tiles; ++kt) {
        const int s = kt % STAGES;
        barrier_wait(&full[s], (kt / STAGES) & 1);
        const uint32_t stage_w = smem_address(tiles_w + s * kStageWBytes);
        const uint32_t stage_x = smem_address(tiles_x + s * kStageXBytes);
#pragma unroll
        for (int b = 0; b < kBoxes; ++b) {
            if (k_begin + kt * STAGE_K + b * kTileK >= k_end) break;  // the same boxes as the Hopper kernels
            uint32_t a[kTileK / 16][4], b0[kTileK / 16], b1[kTileK / 16];
#pragma unroll
            for (int k = 0; k < kTileK / 16; ++k) {
                ldmatrix_x4(a[k], stage_w + b * kBoxWBytes + swizzled_128b(a_row, 2 * k + a_half));
                ldmatrix_x2(b0[k], b1[k], stage_x + b * kBoxXBytes + swizzled_128b(b_row, 2 * k + b_half));
            }
#pragma unroll
            for (int k = 0; k < kTileK / 16; ++k) mma_m16n8k16<Codec>(acc, a[k], b0[k], b1[k]);
        }
        __syncwarp();
        if (lane == 0) barrier_arrive(&empty[s]);
    }

    // acc: rows (weight rows = output columns) n0 + 16 warp + lane / 4 (+ 8 for acc[2], acc[3]),
    // columns (tokens) m0 + 2 (lane % 4) (+ 1 for acc[1], acc[3]).
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int col = n0 + warp * 16 + lane / 4 + 8 * (i / 2);
        const int row = m0 + 2 * (lane % 4) + i % 2;
        if (row < M && col < N) epilogue(row, col, acc[i]);
    }
#elif defined(__CUDA_ARCH__)
    __trap();  // built only into sm_90a images; the host never launches it elsewhere
#endif
}

// The linear's epilogue for one element: bias added in fp32 (as store_pair does), rounded once.
template <typename Codec>
struct StoreElement {
    typename Codec::storage* out;
    const typename Codec::storage* bias;
    int N;
    __device__ __forceinline__ void operator()(int row, int col, float v) const {
        if (bias != nullptr) v = __fadd_rn(v, Codec::load(bias[col]));
        out[static_cast<int64_t>(row) * N + col] = Codec::store(v);
    }
};

template <typename Codec, int BN, int STAGE_K, int STAGES>
__device__ __forceinline__ void small_m_gemm(const TensorMap& map_x, const TensorMap& map_w,
                                             typename Codec::storage* out, const typename Codec::storage* bias,
                                             int M, int N, int K) {
    const StoreElement<Codec> epilogue{out, bias, N};
    const int block = static_cast<int>(blockIdx.x);
    small_m_k_range<Codec, BN, STAGE_K, STAGES>(map_x, map_w, M, N, 0, K, block, epilogue);
}

constexpr int kSmallMTokens = 8;  // small_m_k_range's tokens per CTA (kTokens)

// The grouped small-M kernel's epilogue for one element of group g: StoreElement's arithmetic
// (bias added in fp32, rounded once) into the group's columns [offset, offset + N_g) of the
// shared [M, row_elements] output; `out` already points at the group's first column.
template <typename Codec>
struct GroupStoreElement {
    typename Codec::storage* out;
    const typename Codec::storage* bias;
    int row_elements;
    __device__ __forceinline__ void operator()(int row, int col, float v) const {
        if (bias != nullptr) v = __fadd_rn(v, Codec::load(bias[col]));
        out[static_cast<int64_t>(row) * row_elements + col] = Codec::store(v);
    }
};

// Up to three products of one x in one launch: out[:, off_g : off_g + N_g] = x W_g^T (+ b_g),
// off_g = N_0 + ... + N_{g-1}.  The CTAs of group 0 come first, then group 1's, then group
// 2's; within a group, the band/token-tile order of small_m_gemm.  Each CTA runs
// small_m_k_range on its group's map and sizes with its index within the group, so every
// element is computed by the code, K order and rounding of small_m_gemm: the bits of the
// separate launches.  An unused group has N_g = 0 (no CTAs; its map is never read).
template <typename Codec, int BN, int STAGE_K, int STAGES>
__device__ __forceinline__ void small_m_grouped_gemm(const TensorMap& map_x, const TensorMap& map_w0,
                                                     const TensorMap& map_w1, const TensorMap& map_w2,
                                                     typename Codec::storage* out,
                                                     const typename Codec::storage* bias0,
                                                     const typename Codec::storage* bias1,
                                                     const typename Codec::storage* bias2, int M, int N0, int N1,
                                                     int N2, int K) {
    const int tiles_m = (M + kSmallMTokens - 1) / kSmallMTokens;
    const int ctas0 = (N0 + BN - 1) / BN * tiles_m;
    const int ctas1 = (N1 + BN - 1) / BN * tiles_m;
    const int row_elements = N0 + N1 + N2;
    int block = static_cast<int>(blockIdx.x);
    if (block < ctas0) {
        const GroupStoreElement<Codec> epilogue{out, bias0, row_elements};
        small_m_k_range<Codec, BN, STAGE_K, STAGES>(map_x, map_w0, M, N0, 0, K, block, epilogue);
        return;
    }
    block -= ctas0;
    if (block < ctas1) {
        const GroupStoreElement<Codec> epilogue{out + N0, bias1, row_elements};
        small_m_k_range<Codec, BN, STAGE_K, STAGES>(map_x, map_w1, M, N1, 0, K, block, epilogue);
        return;
    }
    block -= ctas1;
    const GroupStoreElement<Codec> epilogue{out + N0 + N1, bias2, row_elements};
    small_m_k_range<Codec, BN, STAGE_K, STAGES>(map_x, map_w2, M, N2, 0, K, block, epilogue);
}

// ---- the K-group tree (batchinv.linear_k_groups) -------------------------------------------
// K is cut into groups of `width` columns (whole 64-wide boxes; the host passes
// k_group_width(K) of the full K, so a rank's shard of whole groups cuts where the full call's
// groups do).  Group g = blockIdx.y (gridDim.y groups) reduces [g*width, min((g+1)*width, K))
// with the main loops above, from a zero accumulator, into partial[g][M][N] (fp32, no bias): the
// same k16 steps in the same order as the linear over that range, whatever M.  A group that
// starts at or past K runs no k-tile and writes +0.0.  The tree kernel then sums P = 1, 2, 4
// or 8 partials level by level, ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7)), and writes
// either that fp32 node sum or, with the dtype's codec, sum + bias in fp32 rounded once: a
// fixed elementwise tree, so nothing depends on M or on which thread adds.
constexpr int kKGroups = 8;

struct PartialElement {
    float* partial;  // this group's [M, N] slice
    int N;
    __device__ __forceinline__ void operator()(int row, int col, float v) const {
        partial[static_cast<int64_t>(row) * N + col] = v;
    }
};

// The same element layout as StoreEpilogue, fp32 values, no bias.
struct PartialTileEpilogue {
    float* partial;
    int M, N;
    template <int kAcc>
    __device__ __forceinline__ void operator()(const float (&acc)[kAcc], int row, int n0, int lane) const {
        // A thread's two adjacent columns as one 8-byte store where N is even (then every
        // group's [M, N] block and every row start at an even element, so the pair is aligned).
        const bool pairs = (N & 1) == 0;
#pragma unroll
        for (int j = 0; j < kAcc / 4; ++j) {
            const int col = n0 + j * 8 + (lane % 4) * 2;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int r = row + 8 * half;
                if (r >= M) continue;
                float* dst = partial + static_cast<int64_t>(r) * N + col;
                const float first = acc[4 * j + 2 * half], second = acc[4 * j + 2 * half + 1];
                if (pairs && col + 1 < N) {
                    *reinterpret_cast<float2*>(dst) = make_float2(first, second);
                } else {
                    if (col < N) dst[0] = first;
                    if (col + 1 < N) dst[1] = second;
                }
            }
        }
    }
};

// This CTA's group: its columns [k_begin, k_end) (empty past K) and its [M, N] partial.
__device__ __forceinline__ float* k_group_bounds(float* partial, int M, int N, int K, int width, int& k_begin,
                                                 int& k_end) {
    const int64_t begin = static_cast<int64_t>(blockIdx.y) * width;  // no int overflow for any K
    k_begin = static_cast<int>(min(begin, static_cast<int64_t>(K)));
    k_end = static_cast<int>(min(begin + width, static_cast<int64_t>(K)));
    return partial + static_cast<int64_t>(blockIdx.y) * M * N;
}

// The fixed tree over kCount partials of one element, pairs added level by level.
template <int kCount>
__device__ __forceinline__ float k_group_tree_element(const float* partial, int64_t elements, int64_t i) {
    float level[kCount];
#pragma unroll
    for (int p = 0; p < kCount; ++p) level[p] = partial[p * elements + i];
#pragma unroll
    for (int width = kCount; width > 1; width /= 2) {
#pragma unroll
        for (int p = 0; p < width / 2; ++p) level[p] = __fadd_rn(level[2 * p], level[2 * p + 1]);
    }
    return level[0];
}

// out[i] = tree(partial[0..count)[i]) (+ bias[i % N] in fp32), rounded once by OutCodec
// (F32Codec: the node sum itself, which the host passes no bias).  Grid-stride over elements.
template <typename OutCodec, int kCount>
__device__ __forceinline__ void k_group_tree_loop(const float* partial, const typename OutCodec::storage* bias,
                                                  typename OutCodec::storage* out, int64_t elements, int N) {
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < elements; i += stride) {
        float v = k_group_tree_element<kCount>(partial, elements, i);
        if (bias != nullptr) v = __fadd_rn(v, OutCodec::load(bias[i % N]));
        out[i] = OutCodec::store(v);
    }
}

template <typename OutCodec>
__device__ __forceinline__ void k_group_tree(const float* partial, int count, const typename OutCodec::storage* bias,
                                             typename OutCodec::storage* out, int64_t elements, int N) {
    switch (count) {  // the host passes 1, 2, 4 or 8; any other count writes nothing
        case 1: k_group_tree_loop<OutCodec, 1>(partial, bias, out, elements, N); break;
        case 2: k_group_tree_loop<OutCodec, 2>(partial, bias, out, elements, N); break;
        case 4: k_group_tree_loop<OutCodec, 4>(partial, bias, out, elements, N); break;
        case kKGroups: k_group_tree_loop<OutCodec, kKGroups>(partial, bias, out, elements, N); break;
        default: break;
    }
}

// ---- the sm_80 / HIP kernel -----------------------------------------------------------

// Two consecutive elements (k, k + 1) of a row as one 32-bit register; zeros past the end.
template <typename Codec>
__device__ __forceinline__ uint32_t load_pair(const typename Codec::storage* matrix, int row, int rows, int k, int K) {
    if (row >= rows || k >= K) return 0u;
    return *reinterpret_cast<const uint32_t*>(matrix + static_cast<int64_t>(row) * K + k);
}

// The portable SIMT loop (no matrix cores, no cross-lane work, so nothing depends on the
// wavefront width): a "warp" here is a group of 32 threads owning 16 rows, and each lane owns
// (one row, 16 columns), every output one fp32 FMA chain over k in increasing order, the bias
// added after, rounded once.  The same geometry as mma_gemm: grid (ceil(N/32), ceil(M/64)),
// block 128.  HIP runs it for linear_mma_*; both builds export it as linear_simt_*.
template <typename Codec>
__device__ __forceinline__ void simt_gemm(const typename Codec::storage* x, const typename Codec::storage* w,
                                          typename Codec::storage* out, const typename Codec::storage* bias, int M,
                                          int N, int K) {
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int row0 = blockIdx.y * 64 + warp * 16;  // this group's 16 rows
    const int col0 = blockIdx.x * 32;              // the CTA's 32 columns
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
}

template <typename Codec>
__device__ __forceinline__ void mma_gemm(const typename Codec::storage* x, const typename Codec::storage* w,
                                         typename Codec::storage* out, const typename Codec::storage* bias, int M,
                                         int N, int K) {
#if defined(__HIPCC__) || !defined(__CUDA_ARCH__) || __CUDA_ARCH__ < 800
    simt_gemm<Codec>(x, w, out, bias, M, N, K);
#else
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int row0 = blockIdx.y * 64 + warp * 16;  // this warp's 16 rows
    const int col0 = blockIdx.x * 32;              // the CTA's 32 columns, four n8 tiles
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
            mma_m16n8k16<Codec>(acc[t], a, b0, b1);
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

#define BATCHINV_LINEAR_SMALL_M(DTYPE, CODEC, BN, STAGE_K, STAGES)                                            \
    extern "C" __global__ void __launch_bounds__(32 * (BN / 16 + 1))                                           \
        linear_small_m_##DTYPE##_bn##BN##_k##STAGE_K##_s##STAGES(                                              \
            const __grid_constant__ batchinv::TensorMap map_x, const __grid_constant__ batchinv::TensorMap map_w, \
            CODEC::storage* out, const CODEC::storage* bias, int M, int N, int K) {                              \
        batchinv::linear::small_m_gemm<CODEC, BN, STAGE_K, STAGES>(map_x, map_w, out, bias, M, N, K);            \
    }

// The grouped form: up to three weights (maps, biases, N) and one [M, N0 + N1 + N2] output.
#define BATCHINV_LINEAR_SMALL_M_GROUPED(DTYPE, CODEC, BN, STAGE_K, STAGES)                                    \
    extern "C" __global__ void __launch_bounds__(32 * (BN / 16 + 1))                                           \
        linear_small_m_grouped_##DTYPE##_bn##BN##_k##STAGE_K##_s##STAGES(                                      \
            const __grid_constant__ batchinv::TensorMap map_x, const __grid_constant__ batchinv::TensorMap map_w0, \
            const __grid_constant__ batchinv::TensorMap map_w1, const __grid_constant__ batchinv::TensorMap map_w2, \
            CODEC::storage* out, const CODEC::storage* bias0, const CODEC::storage* bias1,                       \
            const CODEC::storage* bias2, int M, int N0, int N1, int N2, int K) {                                 \
        batchinv::linear::small_m_grouped_gemm<CODEC, BN, STAGE_K, STAGES>(map_x, map_w0, map_w1, map_w2, out,   \
                                                                           bias0, bias1, bias2, M, N0, N1, N2,   \
                                                                           K);                                   \
    }

// LAYOUT "tb" (TRANS_A 0) or "tab" (TRANS_A 1); B is always read N-major.
#define BATCHINV_LINEAR_HOPPER_TRANSPOSED(LAYOUT, TRANS_A, DTYPE, CODEC, BM)                                   \
    extern "C" __global__ void __launch_bounds__(128 * (BM / 64 + 1), 1)                                         \
        linear_hopper_##LAYOUT##_##DTYPE##_bm##BM##_bn256_k64_s4(                                               \
            const __grid_constant__ batchinv::TensorMap map_a, const __grid_constant__ batchinv::TensorMap map_b, \
            CODEC::storage* out, const CODEC::storage* bias, int M, int N, int K) {                              \
        batchinv::linear::hopper_gemm_transposed<CODEC, BM, TRANS_A>(map_a, map_b, out, bias, M, N, K);        \
    }

// The K-group tree: partials (grid (tiles, groups); width = the group width in columns), then
// the tree (grid-stride over M * N elements).
#define BATCHINV_LINEAR_KGROUP_HOPPER(DTYPE, CODEC, BM, BN, STAGE_K, STAGES)                                   \
    extern "C" __global__ void __launch_bounds__(128 * (BM / 64 + 1), 1)                                         \
        linear_kgroup_hopper_##DTYPE##_bm##BM##_bn##BN##_k##STAGE_K##_s##STAGES(                               \
            const __grid_constant__ batchinv::TensorMap map_x, const __grid_constant__ batchinv::TensorMap map_w, \
            float* partial, int M, int N, int K, int width) {                                                    \
        int k_begin, k_end;                                                                                      \
        float* group = batchinv::linear::k_group_bounds(partial, M, N, K, width, k_begin, k_end);                \
        const batchinv::linear::PartialTileEpilogue epilogue{group, M, N};                                       \
        batchinv::linear::hopper_gemm_k_range<CODEC, BM, BN, STAGE_K, STAGES>(map_x, map_w, M, N, k_begin,      \
                                                                              k_end, epilogue);                  \
    }

#define BATCHINV_LINEAR_KGROUP_SMALL_M(DTYPE, CODEC, BN, STAGE_K, STAGES)                                     \
    extern "C" __global__ void __launch_bounds__(32 * (BN / 16 + 1))                                           \
        linear_kgroup_small_m_##DTYPE##_bn##BN##_k##STAGE_K##_s##STAGES(                                       \
            const __grid_constant__ batchinv::TensorMap map_x, const __grid_constant__ batchinv::TensorMap map_w, \
            float* partial, int M, int N, int K, int width) {                                                    \
        int k_begin, k_end;                                                                                      \
        float* group = batchinv::linear::k_group_bounds(partial, M, N, K, width, k_begin, k_end);                \
        const batchinv::linear::PartialElement epilogue{group, N};                                               \
        batchinv::linear::small_m_k_range<CODEC, BN, STAGE_K, STAGES>(map_x, map_w, M, N, k_begin, k_end,       \
                                                                      static_cast<int>(blockIdx.x), epilogue);   \
    }

// DTYPE f32: the node sum (no bias, the host passes null); bf16 / f16: + bias, rounded once.
#define BATCHINV_LINEAR_KGROUP_TREE(DTYPE, CODEC)                                                                \
    extern "C" __global__ void __launch_bounds__(256) linear_kgroup_tree_##DTYPE(                                \
        const float* partial, int count, const CODEC::storage* bias, CODEC::storage* out, long long elements,   \
        int N) {                                                                                                 \
        batchinv::linear::k_group_tree<CODEC>(partial, count, bias, out, elements, N);                           \
    }

#define BATCHINV_LINEAR_MMA(DTYPE, CODEC)                                                                         \
    extern "C" __global__ void __launch_bounds__(128)                                                            \
        linear_mma_##DTYPE(const CODEC::storage* x, const CODEC::storage* w, CODEC::storage* out,                \
                           const CODEC::storage* bias, int M, int N, int K) {                                    \
        batchinv::linear::mma_gemm<CODEC>(x, w, out, bias, M, N, K);                                             \
    }

// The portable loop under its own name in both builds, so an NVIDIA GPU can run what HIP runs.
#define BATCHINV_LINEAR_SIMT(DTYPE, CODEC)                                                                        \
    extern "C" __global__ void __launch_bounds__(128)                                                            \
        linear_simt_##DTYPE(const CODEC::storage* x, const CODEC::storage* w, CODEC::storage* out,               \
                            const CODEC::storage* bias, int M, int N, int K) {                                   \
        batchinv::linear::simt_gemm<CODEC>(x, w, out, bias, M, N, K);                                            \
    }

// token_logprobs.cu includes this file for hopper_gemm_tiles and defines this to leave the
// linear's own kernels out of its module.
#if !defined(BATCHINV_LINEAR_NO_KERNELS)
#if !defined(__HIPCC__)
BATCHINV_LINEAR_HOPPER(bf16, batchinv::Bf16Codec, 64, 32, 128, 8)
BATCHINV_LINEAR_HOPPER(bf16, batchinv::Bf16Codec, 64, 64, 128, 6)
BATCHINV_LINEAR_HOPPER(bf16, batchinv::Bf16Codec, 64, 128, 64, 6)
BATCHINV_LINEAR_HOPPER(bf16, batchinv::Bf16Codec, 64, 256, 64, 4)
BATCHINV_LINEAR_HOPPER(bf16, batchinv::Bf16Codec, 128, 128, 64, 6)
BATCHINV_LINEAR_HOPPER(bf16, batchinv::Bf16Codec, 128, 256, 64, 4)
BATCHINV_LINEAR_HOPPER(f16, batchinv::F16Codec, 64, 32, 128, 8)
BATCHINV_LINEAR_HOPPER(f16, batchinv::F16Codec, 64, 64, 128, 6)
BATCHINV_LINEAR_HOPPER(f16, batchinv::F16Codec, 64, 128, 64, 6)
BATCHINV_LINEAR_HOPPER(f16, batchinv::F16Codec, 64, 256, 64, 4)
BATCHINV_LINEAR_HOPPER(f16, batchinv::F16Codec, 128, 128, 64, 6)
BATCHINV_LINEAR_HOPPER(f16, batchinv::F16Codec, 128, 256, 64, 4)
BATCHINV_LINEAR_SMALL_M(bf16, batchinv::Bf16Codec, 16, 128, 8)
BATCHINV_LINEAR_SMALL_M(bf16, batchinv::Bf16Codec, 32, 128, 8)
BATCHINV_LINEAR_SMALL_M(bf16, batchinv::Bf16Codec, 64, 128, 6)
BATCHINV_LINEAR_SMALL_M(f16, batchinv::F16Codec, 16, 128, 8)
BATCHINV_LINEAR_SMALL_M(f16, batchinv::F16Codec, 32, 128, 8)
BATCHINV_LINEAR_SMALL_M(f16, batchinv::F16Codec, 64, 128, 6)
BATCHINV_LINEAR_SMALL_M_GROUPED(bf16, batchinv::Bf16Codec, 16, 128, 8)
BATCHINV_LINEAR_SMALL_M_GROUPED(bf16, batchinv::Bf16Codec, 32, 128, 8)
BATCHINV_LINEAR_SMALL_M_GROUPED(bf16, batchinv::Bf16Codec, 64, 128, 6)
BATCHINV_LINEAR_SMALL_M_GROUPED(f16, batchinv::F16Codec, 16, 128, 8)
BATCHINV_LINEAR_SMALL_M_GROUPED(f16, batchinv::F16Codec, 32, 128, 8)
BATCHINV_LINEAR_SMALL_M_GROUPED(f16, batchinv::F16Codec, 64, 128, 6)
BATCHINV_LINEAR_HOPPER_TRANSPOSED(tb, 0, bf16, batchinv::Bf16Codec, 64)
BATCHINV_LINEAR_HOPPER_TRANSPOSED(tb, 0, bf16, batchinv::Bf16Codec, 128)
BATCHINV_LINEAR_HOPPER_TRANSPOSED(tab, 1, bf16, batchinv::Bf16Codec, 64)
BATCHINV_LINEAR_HOPPER_TRANSPOSED(tab, 1, bf16, batchinv::Bf16Codec, 128)
BATCHINV_LINEAR_HOPPER_TRANSPOSED(tb, 0, f16, batchinv::F16Codec, 64)
BATCHINV_LINEAR_HOPPER_TRANSPOSED(tb, 0, f16, batchinv::F16Codec, 128)
BATCHINV_LINEAR_HOPPER_TRANSPOSED(tab, 1, f16, batchinv::F16Codec, 64)
BATCHINV_LINEAR_HOPPER_TRANSPOSED(tab, 1, f16, batchinv::F16Codec, 128)
BATCHINV_LINEAR_KGROUP_HOPPER(bf16, batchinv::Bf16Codec, 128, 256, 64, 4)
BATCHINV_LINEAR_KGROUP_HOPPER(f16, batchinv::F16Codec, 128, 256, 64, 4)
BATCHINV_LINEAR_KGROUP_SMALL_M(bf16, batchinv::Bf16Codec, 32, 128, 8)
BATCHINV_LINEAR_KGROUP_SMALL_M(f16, batchinv::F16Codec, 32, 128, 8)
BATCHINV_LINEAR_KGROUP_TREE(bf16, batchinv::Bf16Codec)
BATCHINV_LINEAR_KGROUP_TREE(f16, batchinv::F16Codec)
BATCHINV_LINEAR_KGROUP_TREE(f32, batchinv::F32Codec)
#endif

BATCHINV_LINEAR_MMA(bf16, batchinv::Bf16Codec)
BATCHINV_LINEAR_MMA(f16, batchinv::F16Codec)
BATCHINV_LINEAR_SIMT(bf16, batchinv::Bf16Codec)
BATCHINV_LINEAR_SIMT(f16, batchinv::F16Codec)
#endif  // BATCHINV_LINEAR_NO_KERNELS

// Token log-probabilities through the lm_head without the [T, V] logits:
//   logprob[t] = z[t, target[t]] - logsumexp_v z[t, v],   z = hidden · weightᵀ (fp32),
//   entropy[t] = -sum_v p[t, v] log p[t, v]  (optional),   and the gradients of both.
//
//   hidden   [T, H]  bf16 or fp16, row-major, read through a TMA map (H % 8 == 0)
//   weight   [V, H]  same dtype (Hugging Face lm_head layout), through a TMA map
//   targets  [T]     int32: the target id, or -1 for an ignored token (the host maps
//                    ignore_index and checks the range before the launch)
//
// Invariance contract.  The logits come from linear.cu's main loop (hopper_gemm_tiles): each
// z[t, v] is one K reduction in a constant order, the same bits whatever M and tile shape.
// Forward, pass 1 (token_logprobs_partials_*): tiles of kVocabTile = 256 vocabulary columns,
// a constant of the build.  For each row of its tile a thread reduces its own 64 columns in
// increasing column order, then the four threads of a quad combine with a fixed xor tree, giving
// the tile's (m, l, s): m = max z + 0, l = sum exp(z - m), s = sum exp(z - m) * (z - m).  The
// thread that holds the target column writes its logit (exactly one tile does).  Pass 2
// (token_logprobs_finalize): one warp per row merges the ceil(V / 256) tile states, lane k
// taking tiles k, k + 32, ... in order, then a fixed xor tree over the 32 lanes; the merge is
// commutative bit for bit, so every lane ends with the same state.  Nothing here depends on T
// or on which rows share a CTA: BM (64 or 128) only decides which CTA computes a row.
// Backward (token_logprobs_grad_logits_*): recomputes z for a vocabulary chunk with the same
// main loop and writes d_z = g * (onehot - p) - g_ent * p * ((z - lse) + entropy), elementwise
// per token, rounded once to the input dtype, into one [T, chunk] buffer; then
// token_logprobs_accumulate_* adds d_z · W_chunk to an fp32 [T, H] buffer (K = the chunk's
// columns in increasing order, one fp32 add per element per chunk, chunks in increasing order):
// per token, so batch-invariant.  token_logprobs_weight_grad_* computes d_W_chunk = d_zᵀ · hidden
// (K = tokens in increasing order, 64-token tiles, four k16 steps each) and rounds each element
// once to the weight dtype: a fixed order, so bitwise identical run to run.  Both read their
// transposed operands (W_chunk, d_z and hidden, all N- or M-contiguous) straight from the
// row-major tensors through the wgmma transpose flags: no transposed copy exists.
#define BATCHINV_LINEAR_NO_KERNELS
#include "linear.cu"

namespace batchinv {
namespace token_logprobs {

constexpr int kVocabTile = 256;  // columns per forward tile: part of the definition (bits)

// The online log-sum-exp state of a set of columns of one row (see the contract above).
struct LseState {
    float m;  // max logit + 0 (-inf when empty)
    float l;  // sum exp(z - m)
    float s;  // sum exp(z - m) * (z - m), for the entropy
};

__device__ __forceinline__ float merge_scale(float m_old, float m_new) {
    // exp(m_old - m) with an empty side giving 0, never exp(-inf - -inf) = NaN.
    return m_old == -INFINITY ? 0.0f : expf(ieee_sub(m_old, m_new));
}

__device__ __forceinline__ float merged_entropy_term(const LseState& side, float scale, float m_new) {
    if (scale == 0.0f) return 0.0f;
    return ieee_mul(scale, ieee_add(side.s, ieee_mul(ieee_sub(side.m, m_new), side.l)));
}

// Commutative bit for bit (max, and sums of two products), so an xor tree leaves every lane
// with the same state.
__device__ __forceinline__ LseState merge(const LseState& a, const LseState& b) {
    const float m = fmaxf(a.m, b.m);
    const float scale_a = merge_scale(a.m, m);
    const float scale_b = merge_scale(b.m, m);
    LseState out;
    out.m = m;
    out.l = ieee_add(ieee_mul(a.l, scale_a), ieee_mul(b.l, scale_b));
    out.s = ieee_add(merged_entropy_term(a, scale_a, m), merged_entropy_term(b, scale_b, m));
    return out;
}

__device__ __forceinline__ LseState shfl_xor_state(const LseState& state, int mask) {
    LseState other;
    other.m = BATCHINV_SHFL_XOR(state.m, mask);
    other.l = BATCHINV_SHFL_XOR(state.l, mask);
    other.s = BATCHINV_SHFL_XOR(state.s, mask);
    return other;
}

// Pass 1 epilogue: the tile's (m, l, s) per row and the target's logit.
struct PartialsEpilogue {
    const int32_t* targets;
    float* target_logit;  // [T]
    float* part_m;        // [T, tiles]
    float* part_l;
    float* part_s;  // null without the entropy
    int M, N, tiles;

    template <int kAcc>
    __device__ __forceinline__ void operator()(const float (&acc)[kAcc], int row, int n0, int lane) const {
        const int tile = n0 / kVocabTile;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = row + 8 * half;
            float m = -INFINITY;
#pragma unroll
            for (int j = 0; j < kAcc / 4; ++j) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int col = n0 + j * 8 + (lane % 4) * 2 + e;
                    if (col < N) m = fmaxf(m, acc[4 * j + 2 * half + e]);
                }
            }
            m = fmaxf(m, BATCHINV_SHFL_XOR(m, 1));
            m = fmaxf(m, BATCHINV_SHFL_XOR(m, 2));
            m = ieee_add(m, 0.0f);  // -0 -> +0, as the reference does
            float l = 0.0f, s = 0.0f;
#pragma unroll
            for (int j = 0; j < kAcc / 4; ++j) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int col = n0 + j * 8 + (lane % 4) * 2 + e;
                    if (col < N) {
                        const float shifted = ieee_sub(acc[4 * j + 2 * half + e], m);
                        const float weight = expf(shifted);
                        l = ieee_add(l, weight);
                        if (part_s != nullptr && weight != 0.0f) s = ieee_add(s, ieee_mul(weight, shifted));
                    }
                }
            }
            l = ieee_add(l, BATCHINV_SHFL_XOR(l, 1));
            l = ieee_add(l, BATCHINV_SHFL_XOR(l, 2));
            s = ieee_add(s, BATCHINV_SHFL_XOR(s, 1));
            s = ieee_add(s, BATCHINV_SHFL_XOR(s, 2));
            if (r >= M) continue;
            const int target = targets[r];
            if (target >= n0 && target < n0 + kVocabTile) {
#pragma unroll
                for (int j = 0; j < kAcc / 4; ++j) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int col = n0 + j * 8 + (lane % 4) * 2 + e;
                        if (col == target) target_logit[r] = acc[4 * j + 2 * half + e];
                    }
                }
            }
            if (lane % 4 == 0) {
                const int64_t at = static_cast<int64_t>(r) * tiles + tile;
                part_m[at] = m;
                part_l[at] = l;
                if (part_s != nullptr) part_s[at] = s;
            }
        }
    }
};

// Backward epilogue: d_z of one vocabulary chunk, rounded to the input dtype, [T, chunk].
template <typename Codec>
struct GradLogitsEpilogue {
    const int32_t* targets;
    const float* lse;
    const float* grad_logprob;  // [T]
    const float* grad_entropy;  // [T] or null: no entropy term
    const float* entropy;       // [T] or null
    typename Codec::storage* grad_z;  // [T, grad_z_stride]
    int64_t grad_z_stride;
    int M, N, vocab_offset;

    // One token's inputs to d_z, loaded once per row rather than once per element.
    struct Row {
        int target;  // -1: ignored
        float lse, g, g_ent, entropy;
    };

    __device__ __forceinline__ Row load_row(int r) const {
        Row row{targets[r], lse[r], grad_logprob[r], 0.0f, 0.0f};
        if (grad_entropy != nullptr) {
            row.g_ent = grad_entropy[r];
            row.entropy = entropy[r];
        }
        return row;
    }

    __device__ __forceinline__ float grad_at(float z, const Row& row, int col) const {
        if (row.target < 0) return 0.0f;  // ignored token
        const float log_p = ieee_sub(z, row.lse);
        const float p = expf(log_p);
        const float onehot = (col + vocab_offset == row.target) ? 1.0f : 0.0f;
        float d = ieee_mul(row.g, ieee_sub(onehot, p));
        if (grad_entropy != nullptr) {
            d = ieee_sub(d, ieee_mul(row.g_ent, ieee_mul(p, ieee_add(log_p, row.entropy))));
        }
        return d;
    }

    template <int kAcc>
    __device__ __forceinline__ void operator()(const float (&acc)[kAcc], int row, int n0, int lane) const {
        using storage = typename Codec::storage;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = row + 8 * half;
            if (r >= M) continue;
            const Row inputs = load_row(r);
#pragma unroll
            for (int j = 0; j < kAcc / 4; ++j) {
                const int col = n0 + j * 8 + (lane % 4) * 2;
                if (col >= N) continue;
                const storage d0 = Codec::store(grad_at(acc[4 * j + 2 * half], inputs, col));
                storage* dst = grad_z + r * grad_z_stride + col;
                if (col + 1 < N) {
                    const storage d1 = Codec::store(grad_at(acc[4 * j + 2 * half + 1], inputs, col + 1));
                    // grad_z_stride is even, so the pair is 4-byte aligned.
                    *reinterpret_cast<uint32_t*>(dst) =
                        static_cast<uint32_t>(linear::storage_bits<Codec>(d0)) |
                        (static_cast<uint32_t>(linear::storage_bits<Codec>(d1)) << 16);
                } else {
                    dst[0] = d0;
                }
            }
        }
    }
};

// Backward epilogue: out[r, col] += acc in fp32 (one add per element and chunk).  Adjacent
// column pairs move as one 8-byte access when aligned; the arithmetic is the same either way.
struct AccumulateEpilogue {
    float* out;  // [M, N]
    int M, N;

    template <int kAcc>
    __device__ __forceinline__ void operator()(const float (&acc)[kAcc], int row, int n0, int lane) const {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = row + 8 * half;
            if (r >= M) continue;
#pragma unroll
            for (int j = 0; j < kAcc / 4; ++j) {
                const int col = n0 + j * 8 + (lane % 4) * 2;
                if (col >= N) continue;
                float* dst = out + static_cast<int64_t>(r) * N + col;
                const float a0 = acc[4 * j + 2 * half], a1 = acc[4 * j + 2 * half + 1];
                if (col + 1 < N && N % 2 == 0) {
                    float2 v = *reinterpret_cast<float2*>(dst);
                    v.x = ieee_add(v.x, a0);
                    v.y = ieee_add(v.y, a1);
                    *reinterpret_cast<float2*>(dst) = v;
                } else {
                    dst[0] = ieee_add(dst[0], a0);
                    if (col + 1 < N) dst[1] = ieee_add(dst[1], a1);
                }
            }
        }
    }
};

// ---- the backward's GEMM main loop, with M- or N-major operands ----------------------------
//
// linear.cu's hopper_gemm_tiles reads both operands K-major.  The backward's two other GEMMs
// read operands that are contiguous along M or N in memory (W_chunk [chunk, H] for d_hidden;
// d_z [T, chunk] and hidden [T, H] for d_W), so this loop loads them as they lie: TMA boxes of
// 64 M/N-elements (128 bytes) by 64 k-rows, 128-byte swizzled, read by wgmma with its transpose
// flag.  The K order is the same as linear.cu's: 64-wide k-tiles in increasing k, four k16
// steps each, fp32 accumulators, no split-K; BN = 256, STAGE_K = 64, 4 stages.

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
constexpr int kBackwardBN = 256;
constexpr int kStages = 4;
constexpr int kTileK = 64;
constexpr int kMnBoxBytes = 64 * kTileK * 2;  // one 64 x 64 box: 64 k-rows of 128 bytes

// Descriptor of an M/N-major operand (CUTLASS's canonical 128B-swizzled MN-major layout
// ((8 x 8 elements, m), (8, k)) : ((1, 8, LBO), (64, SBO))): 64-element M/N blocks kMnBoxBytes
// apart (leading byte offset), 8-k-row groups 1024 bytes apart (stride byte offset).
__device__ __forceinline__ uint64_t mn_major_descriptor(const void* tile) {
    const uint64_t address = hopper::smem_address(tile);
    uint64_t desc = (address & 0x3FFFF) >> 4;
    desc |= static_cast<uint64_t>(kMnBoxBytes >> 4) << 16;  // leading byte offset: next 64 M/N
    desc |= static_cast<uint64_t>(1024 >> 4) << 32;         // stride byte offset: next 8 k-rows
    desc |= 1ull << 62;                                     // 128-byte swizzle
    return desc;
}

// The 128 accumulator registers of one m64n256 wgmma, as PTX operands %0..%127 and as C++ operands.
#define BATCHINV_TLP_ACC_REGS \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20," \
    "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39," \
    "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58," \
    "%59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77," \
    "%78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96," \
    "%97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112," \
    "%113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define BATCHINV_TLP_ACC_OPERANDS \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
    "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
    "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
    "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
    "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
    "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), \
    "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), \
    "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), \
    "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), \
    "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
#define BATCHINV_TLP_WGMMA_N256(TYPE)                                                                 \
    asm volatile("{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %130, 0;\n"                         \
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32." TYPE "." TYPE " {" BATCHINV_TLP_ACC_REGS    \
                 "}, %128, %129, accumulate, 1, 1, %131, %132;\n}\n"                                       \
                 : BATCHINV_TLP_ACC_OPERANDS                                                              \
                 : "l"(desc_a), "l"(desc_b), "r"(1), "n"(kTransA), "n"(kTransB))

// D += A * B, m64n256k16, fp32 accumulators (the layout of common/wgmma.cuh); kTransA / kTransB
// select M-major A / N-major B.
template <typename Codec, int kTransA, int kTransB>
__device__ __forceinline__ void mma_m64n256k16(float (&d)[128], uint64_t desc_a, uint64_t desc_b) {
    if constexpr (Codec::kIsBf16) {
        BATCHINV_TLP_WGMMA_N256("bf16");
    } else {
        BATCHINV_TLP_WGMMA_N256("f16");
    }
}
#undef BATCHINV_TLP_WGMMA_N256
#undef BATCHINV_TLP_ACC_OPERANDS
#undef BATCHINV_TLP_ACC_REGS
#endif

// out tile = A[M, K] · B[K, N]: A is K-major ([M, K] rows, map box BM x 64) or, with kTransA,
// M-major ([K, M] rows, map box 64 x 64); B is K-major ([N, K] rows, box 256 x 64) or, with
// kTransB, N-major ([K, N] rows, box 64 x 64).  Zeros arrive past every edge.
template <typename Codec, int BM, int kTransA, int kTransB, typename Epilogue>
__device__ __forceinline__ void backward_gemm_tiles(const TensorMap& map_a, const TensorMap& map_b, int M, int N,
                                                    int K, const Epilogue& epilogue) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using namespace hopper;
    constexpr int BN = kBackwardBN;
    constexpr int kConsumers = BM / 64;
    constexpr int kTileABytes = BM * kTileK * 2;
    constexpr int kTileBBytes = BN * kTileK * 2;
    extern __shared__ uint8_t shared_raw[];
    // 128-byte swizzled tiles must start on a 1024-byte boundary.
    uint8_t* shared = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(shared_raw) + 1023) & ~uintptr_t(1023));
    uint8_t* tiles_a = shared;
    uint8_t* tiles_b = shared + kStages * kTileABytes;
    uint64_t* full = reinterpret_cast<uint64_t*>(tiles_b + kStages * kTileBBytes);
    uint64_t* empty = full + kStages;

    // The same grouped tile order as linear.cu (groups of 16 tile rows, rows fastest).
    constexpr int kGroupM = 16;
    const int tiles_m = (M + BM - 1) / BM;
    const int tiles_n = (N + BN - 1) / BN;
    const int tiles_per_group = kGroupM * tiles_n;
    const int first_tile_m = (static_cast<int>(blockIdx.x) / tiles_per_group) * kGroupM;
    const int group_rows = min(tiles_m - first_tile_m, kGroupM);
    const int in_group = static_cast<int>(blockIdx.x) % tiles_per_group;
    const int m0 = (first_tile_m + in_group % group_rows) * BM;
    const int n0 = (in_group / group_rows) * BN;
    const int k_tiles = (K + kTileK - 1) / kTileK;
    const int warpgroup = threadIdx.x / 128;

    if (threadIdx.x == 0) {
        for (int s = 0; s < kStages; ++s) {
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
                const int s = kt % kStages;
                const int round = kt / kStages;
                const int k = kt * kTileK;
                if (round > 0) barrier_wait(&empty[s], (round - 1) & 1);
                barrier_expect_bytes(&full[s], kTileABytes + kTileBBytes);
                uint8_t* tile_a = tiles_a + s * kTileABytes;
                uint8_t* tile_b = tiles_b + s * kTileBBytes;
                if constexpr (kTransA) {
#pragma unroll
                    for (int c = 0; c < BM / 64; ++c) tma_load_2d(tile_a + c * kMnBoxBytes, map_a, &full[s], m0 + 64 * c, k);
                } else {
                    tma_load_2d(tile_a, map_a, &full[s], k, m0);
                }
                if constexpr (kTransB) {
#pragma unroll
                    for (int c = 0; c < BN / 64; ++c) tma_load_2d(tile_b + c * kMnBoxBytes, map_b, &full[s], n0 + 64 * c, k);
                } else {
                    tma_load_2d(tile_b, map_b, &full[s], k, n0);
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
        const int s = kt % kStages;
        barrier_wait(&full[s], (kt / kStages) & 1);
        wgmma_fence();
        // This consumer's 64 rows of A: the same offset in both layouts (one 64-row box).
        const uint8_t* tile_a = tiles_a + s * kTileABytes + consumer * kMnBoxBytes;
        const uint8_t* tile_b = tiles_b + s * kTileBBytes;
#pragma unroll
        for (int k = 0; k < kTileK / 16; ++k) {
            // A k16 step is 32 bytes along a K-major row, or 16 rows of 128 bytes M/N-major.
            const uint64_t desc_a = kTransA ? mn_major_descriptor(tile_a + 2048 * k)
                                            : smem_descriptor_128b(tile_a + 32 * k);
            const uint64_t desc_b = kTransB ? mn_major_descriptor(tile_b + 2048 * k)
                                            : smem_descriptor_128b(tile_b + 32 * k);
            mma_m64n256k16<Codec, kTransA, kTransB>(acc, desc_a, desc_b);
        }
        wgmma_commit();
        // Keep this tile's MMAs in flight; once the previous tile's have finished, its stage
        // can be refilled.  (The MMAs still execute in issue order: the bits do not change.)
        wgmma_wait<1>();
        if (kt > 0 && threadIdx.x % 128 == 0) barrier_arrive(&empty[(kt - 1) % kStages]);
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

// Pass 2: one warp per row merges the tile states (see the contract).
__device__ __forceinline__ void finalize_row(const float* part_m, const float* part_l, const float* part_s,
                                             const float* target_logit, const int32_t* targets, int tiles,
                                             int row, float* logprob, float* lse, float* entropy) {
    const int lane = threadIdx.x % 32;
    LseState state{-INFINITY, 0.0f, 0.0f};
    const int64_t base = static_cast<int64_t>(row) * tiles;
    for (int tile = lane; tile < tiles; tile += 32) {
        const LseState next{part_m[base + tile], part_l[base + tile], part_s != nullptr ? part_s[base + tile] : 0.0f};
        state = merge(state, next);
    }
#pragma unroll
    for (int mask = 16; mask >= 1; mask /= 2) state = merge(state, shfl_xor_state(state, mask));
    if (lane != 0) return;
    const float log_l = logf(state.l);
    const float row_lse = ieee_add(state.m, log_l);
    const bool valid = targets[row] >= 0;
    lse[row] = row_lse;
    logprob[row] = valid ? ieee_sub(target_logit[row], row_lse) : 0.0f;
    if (entropy != nullptr) entropy[row] = valid ? ieee_sub(log_l, __fdiv_rn(state.s, state.l)) : 0.0f;
}

}  // namespace token_logprobs
}  // namespace batchinv

extern "C" __global__ void __launch_bounds__(128)
    token_logprobs_finalize(const float* part_m, const float* part_l, const float* part_s, const float* target_logit,
                            const int32_t* targets, int tiles, int rows, float* logprob, float* lse, float* entropy) {
    const int row = blockIdx.x * 4 + threadIdx.x / 32;
    if (row >= rows) return;
    batchinv::token_logprobs::finalize_row(part_m, part_l, part_s, target_logit, targets, tiles, row, logprob, lse,
                                           entropy);
}

// BN is fixed at kVocabTile for the forward (the tile is part of the definition); BM is free.
#define BATCHINV_TLP_PARTIALS(DTYPE, CODEC, BM)                                                                    \
    extern "C" __global__ void __launch_bounds__(128 * (BM / 64 + 1), 1)                                            \
        token_logprobs_partials_##DTYPE##_bm##BM(                                                                   \
            const __grid_constant__ batchinv::TensorMap map_hidden,                                                \
            const __grid_constant__ batchinv::TensorMap map_weight, const int32_t* targets, float* target_logit,   \
            float* part_m, float* part_l, float* part_s, int M, int N, int K, int tiles) {                          \
        const batchinv::token_logprobs::PartialsEpilogue epilogue{targets, target_logit, part_m, part_l,           \
                                                                  part_s,  M,            N,      tiles};            \
        batchinv::linear::hopper_gemm_tiles<CODEC, BM, batchinv::token_logprobs::kVocabTile, 64, 4>(              \
            map_hidden, map_weight, M, N, K, epilogue);                                                             \
    }

#define BATCHINV_TLP_GRAD_LOGITS(DTYPE, CODEC, BM)                                                                  \
    extern "C" __global__ void __launch_bounds__(128 * (BM / 64 + 1), 1) token_logprobs_grad_logits_##DTYPE##_bm##BM( \
        const __grid_constant__ batchinv::TensorMap map_hidden, const __grid_constant__ batchinv::TensorMap map_weight, \
        const int32_t* targets, const float* lse, const float* grad_logprob, const float* grad_entropy,             \
        const float* entropy, CODEC::storage* grad_z, int64_t grad_z_stride, int M, int N, int K, int vocab_offset) { \
        const batchinv::token_logprobs::GradLogitsEpilogue<CODEC> epilogue{                                         \
            targets, lse, grad_logprob, grad_entropy, entropy, grad_z, grad_z_stride, M, N, vocab_offset};          \
        batchinv::linear::hopper_gemm_tiles<CODEC, BM, 256, 64, 4>(map_hidden, map_weight, M, N, K, epilogue);      \
    }

// d_hidden += d_z · W_chunk: d_z [T, chunk] K-major, W_chunk [chunk, H] read N-major.
#define BATCHINV_TLP_ACCUMULATE(DTYPE, CODEC, BM)                                                                   \
    extern "C" __global__ void __launch_bounds__(128 * (BM / 64 + 1), 1) token_logprobs_accumulate_##DTYPE##_bm##BM(  \
        const __grid_constant__ batchinv::TensorMap map_grad_z, const __grid_constant__ batchinv::TensorMap map_w,  \
        float* out, int M, int N, int K) {                                                                          \
        const batchinv::token_logprobs::AccumulateEpilogue epilogue{out, M, N};                                     \
        batchinv::token_logprobs::backward_gemm_tiles<CODEC, BM, 0, 1>(map_grad_z, map_w, M, N, K, epilogue);      \
    }

// d_W_chunk = d_zᵀ · hidden, rounded once: d_z [T, chunk] read M-major, hidden [T, H] N-major.
#define BATCHINV_TLP_WEIGHT_GRAD(DTYPE, CODEC)                                                                      \
    extern "C" __global__ void __launch_bounds__(384, 1) token_logprobs_weight_grad_##DTYPE(                       \
        const __grid_constant__ batchinv::TensorMap map_grad_z, const __grid_constant__ batchinv::TensorMap map_hidden, \
        CODEC::storage* out, int M, int N, int K) {                                                                 \
        const batchinv::linear::StoreEpilogue<CODEC> epilogue{out, nullptr, M, N};                                  \
        batchinv::token_logprobs::backward_gemm_tiles<CODEC, 128, 1, 1>(map_grad_z, map_hidden, M, N, K, epilogue); \
    }

#if !defined(__HIPCC__)
// batchinv-signature: token_logprobs_partials_bf16_bm64(tmap, tmap, ptr, ptr, ptr, ptr, ptr, i32, i32, i32, i32)
BATCHINV_TLP_PARTIALS(bf16, batchinv::Bf16Codec, 64)
// batchinv-signature: token_logprobs_partials_bf16_bm128(tmap, tmap, ptr, ptr, ptr, ptr, ptr, i32, i32, i32, i32)
BATCHINV_TLP_PARTIALS(bf16, batchinv::Bf16Codec, 128)
// batchinv-signature: token_logprobs_partials_f16_bm64(tmap, tmap, ptr, ptr, ptr, ptr, ptr, i32, i32, i32, i32)
BATCHINV_TLP_PARTIALS(f16, batchinv::F16Codec, 64)
// batchinv-signature: token_logprobs_partials_f16_bm128(tmap, tmap, ptr, ptr, ptr, ptr, ptr, i32, i32, i32, i32)
BATCHINV_TLP_PARTIALS(f16, batchinv::F16Codec, 128)
// batchinv-signature: token_logprobs_grad_logits_bf16_bm64(tmap, tmap, ptr, ptr, ptr, ptr, ptr, ptr, i64, i32, i32, i32, i32)
BATCHINV_TLP_GRAD_LOGITS(bf16, batchinv::Bf16Codec, 64)
// batchinv-signature: token_logprobs_grad_logits_bf16_bm128(tmap, tmap, ptr, ptr, ptr, ptr, ptr, ptr, i64, i32, i32, i32, i32)
BATCHINV_TLP_GRAD_LOGITS(bf16, batchinv::Bf16Codec, 128)
// batchinv-signature: token_logprobs_grad_logits_f16_bm64(tmap, tmap, ptr, ptr, ptr, ptr, ptr, ptr, i64, i32, i32, i32, i32)
BATCHINV_TLP_GRAD_LOGITS(f16, batchinv::F16Codec, 64)
// batchinv-signature: token_logprobs_grad_logits_f16_bm128(tmap, tmap, ptr, ptr, ptr, ptr, ptr, ptr, i64, i32, i32, i32, i32)
BATCHINV_TLP_GRAD_LOGITS(f16, batchinv::F16Codec, 128)
// batchinv-signature: token_logprobs_accumulate_bf16_bm64(tmap, tmap, ptr, i32, i32, i32)
BATCHINV_TLP_ACCUMULATE(bf16, batchinv::Bf16Codec, 64)
// batchinv-signature: token_logprobs_accumulate_bf16_bm128(tmap, tmap, ptr, i32, i32, i32)
BATCHINV_TLP_ACCUMULATE(bf16, batchinv::Bf16Codec, 128)
// batchinv-signature: token_logprobs_accumulate_f16_bm64(tmap, tmap, ptr, i32, i32, i32)
BATCHINV_TLP_ACCUMULATE(f16, batchinv::F16Codec, 64)
// batchinv-signature: token_logprobs_accumulate_f16_bm128(tmap, tmap, ptr, i32, i32, i32)
BATCHINV_TLP_ACCUMULATE(f16, batchinv::F16Codec, 128)
// batchinv-signature: token_logprobs_weight_grad_bf16(tmap, tmap, ptr, i32, i32, i32)
BATCHINV_TLP_WEIGHT_GRAD(bf16, batchinv::Bf16Codec)
// batchinv-signature: token_logprobs_weight_grad_f16(tmap, tmap, ptr, i32, i32, i32)
BATCHINV_TLP_WEIGHT_GRAD(f16, batchinv::F16Codec)
#endif

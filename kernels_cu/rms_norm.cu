// RMSNorm and fused residual-add + RMSNorm, forward and backward (Qwen3 layer norms and the
// per-head q/k norm, which is the same op over rows of length head_dim).
//
// Forward   inv_rms = 1 / sqrt(sum(h^2) / d + eps);  y = (h * inv_rms) * weight
//           h = x                          (rms_norm_forward_*; residual is not read)
//           h = round(x + residual)        (rms_norm_fused_forward_*: the sum added in fp32,
//                                           rounded once to the storage type, written to
//                                           new_residual; the norm reads the rounded value)
//   x, residual  [rows, d]  bf16/fp16/fp32, unit stride along d, row strides x_stride and
//                           residual_stride (elements)
//   weight       [d]        same dtype, contiguous
//   y, new_residual [rows, d] same dtype, contiguous (new_residual only when fused)
//   rstd         [rows] fp32: inv_rms of each row (nullptr: not written); the backward reads it
//   eps          fp32 (the host rounds the Python float once)
//   Arithmetic in fp32, every step one IEEE operation (no FMA contraction): squares rounded,
//   sums rounded, sum / d, __fsqrt_rn, 1 / that, then two products, one rounding at the end
//   (bf16 on CUDA by the paired conversion cvt.rn.bf16x2.f32: Codec::store's bits).
//
// Backward  x_hat = h * inv_rms;  gw = grad_y * weight;
//           grad_h = inv_rms * (gw - x_hat * (sum(gw * x_hat) / d))  [+ grad_residual]
//           rounded once to the storage type (the fused backward adds the gradient reaching
//           new_residual in fp32 before that rounding).
//           grad_weight[c] = sum over rows of grad_y[r, c] * x_hat[r, c], fp32, by a fixed tree
//           whose shape depends on the row count and d only (never the SM count), no atomics:
//           level 1: partial row b sums rows [b * R, (b + 1) * R), R = G * S, as G runs of S
//             consecutive rows: run g = rows b * R + g * S + s, s = 0 .. S - 1, added in order
//             from +0, then the G run sums added in order g = 0 .. G - 1 from +0 (rows past the
//             end are skipped).  G = the backward geometry's row groups per CTA (128 / T, or 1
//             for T >= 128), S = max(1, 16 / G): q/k norm (T = 4) G = 32, S = 1; T = 16: 8 x 2;
//             T = 32: 4 x 4; T >= 128 (hidden 4096 and 5120 bf16) and streaming: 1 x 16; except
//             t128k4 (bf16 hidden 4096, fp32 512 < d <= 2048) in bf16 and fp32 from 16384 rows
//             on, and t128k5 (bf16/fp16 4096 < d <= 5120, fp32 2048 < d <= 2560) in every dtype
//             from 8192 rows on: G = 2, S = 16 (entries *_t128k4g2, *_t128k5g2: two row groups in a
//             256-thread CTA).
//           level 2+: while more than 64 partial rows remain, each run of 64 consecutive ones is
//             summed in order; the last <= 64 are added in order and rounded once.  Grids:
//             rms_norm_weight_grad_reduce for one level while more than 64 * 64 rows remain, then
//             rms_norm_weight_grad_last_levels for the last two (the runs' sums and their sum, or
//             the one sum of <= 64 rows).  On sm_90 each is launched with programmatic
//             dependent launch (griddepcontrol): it starts while the grid writing its rows ends
//             and waits for it before reading them; where the last-levels grid follows the
//             fused backward directly, the host may instead have it wait for each run of 64
//             partial rows alone (per-run counts, signal_partial_row_stored / wait_for_run), so
//             that it sums the runs stored first while the first level ends.  Same sums, same
//             order, same bits.
//           Bitwise the same run to run; zero-gradient rows appended at the end add +0 to sums
//           that start at +0 (never -0) and leave the bits unchanged.  Level 1 is computed by
//           rms_norm_backward_weight_grad_* (grad_x and the partials in one pass: CTA b's row
//           groups take their S rows in sequence, each thread adding grad_y * x_hat of its
//           elements to fp32 sums in shared memory, which the CTA then adds over groups, one
//           column per thread), or, for rows whose sums exceed kWeightGradSharedBytes and for
//           few rows (CTAs of fewer than 256 * 128 threads in all, decided by the host), by the
//           grad_x kernel plus the column pass rms_norm_weight_grad_partials_* in the same
//           order: the same bits.
//           grad_x is per row and does not depend on which kernel computed it (tested).
//
// Launch geometry (the host picks it from d and the dtype only, never from rows): the first
//   (T threads per row, K chunks per thread) of (4, 4), (16, 4), (32, 4), (128, 2), (64, 8),
//   (128, 5), (128, 8), (256, 8), (512, 8) with T * K 16-byte chunks >= the row (forward), each
//   thread keeping its chunks in registers (the row is read once; a tree follows T only: (128, 2),
//   (128, 4), (128, 5) and (128, 8) have the same tree, K only bounds the registers); longer
//   rows (bf16 d > 32768, fp32 d > 16384) use the streaming form, T = 1024, which reads the row
//   twice.  Up to T = 128 the forward loads the weight's chunks with the row's, before the
//   reduction; the fused backward keeps them in registers for a row group's rows when K <= 5,
//   and for t128k4 issues the next row's dy and x loads before the current row's work
//   (bf16/fp16 vector launches on CUDA: as cp.async copies into a two-stage ring in shared
//   memory, kStagedRows).  Where loads are issued changes no arithmetic.
//   CTA = max(T, 128) threads holding 128 / T rows (T < 128) or one row;
//   grid.x = ceil(rows / rows per CTA).  The backward's list is the same except that rows of
//   129 .. 512 chunks (bf16 d in (1024, 4096]) take (128, 4) instead of (128, 2) and (64, 8):
//   its row tree (grad_x) and grad_weight's first level follow its own list, again from d and
//   the dtype only.
//   The fused backward gives a CTA R = G * S rows (above), grid.x = ceil(rows / R).  The batch
//   changes only grid.x.
//
// Why a row's bits cannot depend on the batch: element e of a row belongs to 16-byte chunk
// c = e / (16 / sizeof(storage)), chunk c to thread c % T of the row's group, and a thread
// adds its elements in increasing e.  The T per-thread partials are combined by a butterfly
// (xor offsets T/2 .. 1 inside a warp, each step one commutative IEEE add, so every lane
// ends with the same bits) and, for T above the warp size, the per-warp results are added in
// warp order.  All of this is fixed by d; which CTA or group slot a row lands in, the rows
// beside it and how many CTAs run do not enter.  Loads are 16-byte vectors when every base
// pointer, row stride and d*sizeof are multiples of 16 (the same for all rows of a launch) and
// element loads otherwise; both fill the same per-thread chunks, so the arithmetic, and the
// bits, do not depend on the load width: a row alone in a fresh tensor and the same row at an
// odd offset of a batch get the same result.  Vector launches of the plain forward's t64 and
// the fused forward's t64 and t128k5 run entries of their own (*_vec, forward_rows_vector: the
// same operations in the same order, without per-element bounds tests), picked by the host.
#include "common/chunk16.cuh"
#include "common/cp_async.cuh"
#include "common/grid_dependency.cuh"
#include "common/portability.cuh"
#include "common/rms_row.cuh"


namespace batchinv {
namespace rms {


constexpr int kChunkBytes = 16;
constexpr int kStreamingThreads = 1024;
constexpr int kStreamingChunks = 4;          // chunks per thread and round, streaming forward
constexpr int kStreamingBackwardChunks = 2;  // and backward (four would spill at 64 registers)
constexpr int kMinCtaThreads = 128;
constexpr int kMaxWarps = 1024 / BATCHINV_WARP_SIZE;
constexpr int kWeightGradChunkRows = 16;  // rows per first-level partial of grad_weight, at least
constexpr int kWeightGradReduceRows = 64;  // partial rows per sum of the further levels
constexpr int kWeightGradSharedBytes = 32768;  // per-column sums of a CTA in the fused backward
constexpr int kWeightGradThreads = 256;  // columns per pass-1 / pass-2 CTA
constexpr int kWeightGradUnroll = 8;     // rows loaded before they are added (loads in flight)
// weight_grad_last_levels: columns per CTA, and threads per column (run slots), each summing
// runs of 64 partial rows.  16 columns (64-byte row segments), not 32: at 16384 x 5120 bf16 (16
// runs of 1024 partial rows) 32 gives 160 CTAs for 132 SMs, so 28 SMs read two CTAs' 128 KiB in
// series; 320 CTAs of 64 KiB spread it.
constexpr int kLastLevelsColumns = 16;
constexpr int kLastLevelsRunSlots = 32;
// Rows of a run loaded before they are added, per thread (ptxas keeps part of them in flight;
// 64 measures faster than 16: docs/tuning/rms_norm.md).
constexpr int kLastLevelsUnroll = 64;
constexpr int64_t kWeightGradLastLevelsRows =
    static_cast<int64_t>(kWeightGradReduceRows) * kWeightGradReduceRows;
constexpr int kResidentWeightMaxChunks = 5;  // fused backward: weight in registers up to this K
// Fused backward: t128k4 (bf16 hidden 4096) issues the next row's dy and x loads before the current
// row's work (128 registers, 4 CTAs per SM), which measures faster; the same for t128k5 measures
// slower (146 registers, 3 CTAs per SM), for t32 no faster.
template <int T, int K>
constexpr bool kPrefetchNextRow = T == 128 && K == 4;
// Fused backward, t128k4 bf16/fp16 on CUDA, vector launches: the next row's dy and x are copied
// into a two-stage ring in dynamic shared memory by cp.async (each thread copies the chunks it
// reads, so no barrier) while the CTA works on the current row, which it reads from the ring
// (faster for bf16, on par for fp16; fp32 measures slower, so it keeps the register prefetch,
// as do element launches).
#if defined(__HIPCC__)
template <typename Codec, int T, int K>
constexpr bool kStagedRows = false;
#else
template <typename Codec, int T, int K>
constexpr bool kStagedRows = T == 128 && K == 4 && sizeof(typename Codec::storage) == 2;
#endif
constexpr int kStagedRowStages = 2;
// Fused backward, one row group over several warps (T > warp size): row s of a group reduces
// through warp partials s % 2, so its row_group_sum needs one barrier instead of two (measured
// slightly faster).
template <int T>
constexpr bool kAlternatePartials = T > BATCHINV_WARP_SIZE;
// t4's (q/k norm) fused backward, CTAs per SM that ptxas must leave room for (CUDA's
// __launch_bounds__ minimum; the other geometries have none): unbounded, its runs of one row
// writing fresh sums take 85 registers (5 CTAs per SM); held to 7 CTAs (72 registers, no
// spill) it measures faster.
constexpr int kT4FusedBackwardMinBlocks = 7;
// Forward: the weight is loaded with the row up to this many threads per row.  Its 32 registers
// per thread cost t256 half its CTAs per SM (2 instead of 4), which measures slower, while t128
// gains a little.
constexpr int kResidentForwardMaxThreads = 128;

// A row chunk is common/rms_row.cuh's Chunk (chunk16.cuh's 16-byte vector).
static_assert(kChunkBytes == sizeof(Chunk16<F32Codec>), "a row chunk is one 16-byte vector");


// The partial rows of grad_weight's levels are handed on by programmatic dependent launch
// (common/grid_dependency.cuh): the next level's launch overlaps the end of the grid that
// writes them.  The forward entries let the next grid launch at once: only a grid that
// waits (griddepcontrol.wait) before it reads their output is ever launched that way after
// them (the small-M linear under a weight prefetch, linear.cu).

struct ForwardArgs {
    void* y;
    void* new_residual;
    float* rstd;
    const void* x;
    const void* residual;
    const void* weight;
    int64_t rows;
    int64_t d;
    int64_t x_stride;
    int64_t residual_stride;
    float eps;
};

// One row per group of T threads, each holding up to K chunks.  kStreaming: the row does not fit
// per thread; it is processed in rounds and read again for the output (for the fused form
// the second read is of new_residual, which this thread wrote itself in the first).  The
// kernels use it for the streaming form and for T > kResidentForwardMaxThreads; other rows
// take forward_rows_resident (the same arithmetic, the weight loaded before the reduction).
template <typename Codec, int T, int K, bool kStreaming, bool kFusedAdd>
__device__ __forceinline__ void forward_rows(const ForwardArgs& a, float* warp_partials) {
    using S = typename Codec::storage;
    constexpr int E = Chunk<Codec>::kElems;
    constexpr int kCta = T < kMinCtaThreads ? kMinCtaThreads : T;
    constexpr int kRowsPerCta = kCta / T;
    const int lane = threadIdx.x % T;
    const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerCta + threadIdx.x / T;
    const bool active = row < a.rows;
    const int64_t d = a.d;
    const int64_t chunks = (d + E - 1) / E;
    const int64_t safe_row = active ? row : 0;
    const S* x = static_cast<const S*>(a.x) + safe_row * a.x_stride;
    const S* residual = kFusedAdd ? static_cast<const S*>(a.residual) + safe_row * a.residual_stride
                                  : nullptr;
    S* y = static_cast<S*>(a.y) + safe_row * d;
    S* new_residual = kFusedAdd ? static_cast<S*>(a.new_residual) + safe_row * d : nullptr;
    const S* weight = static_cast<const S*>(a.weight);
    const bool vector = aligned16(a.x) && aligned16(a.y) && aligned16(a.weight) &&
                        aligned16(a.residual) && aligned16(a.new_residual) &&
                        stride_aligned16<S>(a.x_stride) && stride_aligned16<S>(a.residual_stride) &&
                        stride_aligned16<S>(d);

    Chunk<Codec> h[K];
    float sum_sq = 0.0f;
    // Pass 1: h (x, or round(x + residual)) and the thread's sum of squares in element order.
    for (int64_t base = 0; base < (kStreaming ? chunks : 1); base += static_cast<int64_t>(K) * T) {
        Chunk<Codec> r[kFusedAdd ? K : 1];
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int64_t c = base + lane + static_cast<int64_t>(k) * T;
            if (active && c < chunks) {
                load_chunk(h[k], x, c, d, vector);
                if constexpr (kFusedAdd) load_chunk(r[k], residual, c, d, vector);
            }
        }
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int64_t c = base + lane + static_cast<int64_t>(k) * T;
            if (!(active && c < chunks)) continue;
#pragma unroll
            for (int e = 0; e < E; ++e) {
                if (c * E + e >= d) continue;
                if constexpr (kFusedAdd) {
                    h[k].v[e] = Codec::store(ieee_add(Codec::load(h[k].v[e]), Codec::load(r[k].v[e])));
                }
                const float v = Codec::load(h[k].v[e]);
                sum_sq = ieee_add(sum_sq, ieee_mul(v, v));
            }
            if constexpr (kFusedAdd) store_chunk(new_residual, h[k], c, d, vector);
        }
    }
    const float inv_rms = inv_rms_of(row_group_sum<T>(sum_sq, warp_partials), d, a.eps);
    if (!active) return;
    if (a.rstd != nullptr && lane == 0) a.rstd[row] = inv_rms;
    // Pass 2: y = (h * inv_rms) * weight.
    for (int64_t base = 0; base < (kStreaming ? chunks : 1); base += static_cast<int64_t>(K) * T) {
        if constexpr (kStreaming) {
#pragma unroll
            for (int k = 0; k < K; ++k) {
                const int64_t c = base + lane + static_cast<int64_t>(k) * T;
                if (c < chunks) load_chunk(h[k], kFusedAdd ? new_residual : x, c, d, vector);
            }
        }
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int64_t c = base + lane + static_cast<int64_t>(k) * T;
            if (c >= chunks) continue;
            Chunk<Codec> w, out;
            load_chunk(w, weight, c, d, vector);
            float f[E];
#pragma unroll
            for (int e = 0; e < E; ++e) {
                f[e] = ieee_mul(ieee_mul(Codec::load(h[k].v[e]), inv_rms), Codec::load(w.v[e]));
            }
            round_chunk(out, f);
            store_chunk(y, out, c, d, vector);
        }
    }
}

struct BackwardArgs {
    void* grad_x;
    const void* grad_y;
    const void* x;
    const void* weight;
    const float* rstd;
    const void* grad_residual;
    int64_t rows;
    int64_t d;
    int64_t x_stride;
};

template <int T>
struct Cta {
    static constexpr int kThreads = T < kMinCtaThreads ? kMinCtaThreads : T;
    static constexpr int kRowGroups = kThreads / T;
};

// grad_weight's first level for a row kept in registers: a CTA of the fused backward owns kRows
// consecutive rows, its kGroups row groups kRowsInSequence consecutive rows each (see the
// header).  By default the geometry's CTA (Cta<T>::kRowGroups groups) and
// max(1, kWeightGradChunkRows / groups) rows per group; the t128k4g2 and t128k5g2 entries take
// 2 groups of 16 rows in a CTA of 256 threads.
template <int T, int G = Cta<T>::kRowGroups,
          int S = (kWeightGradChunkRows > G ? kWeightGradChunkRows / G : 1)>
struct WeightGradChunk {
    static constexpr int kGroups = G;
    static constexpr int kRowsInSequence = S;
    static constexpr int kRows = kGroups * kRowsInSequence;
    static constexpr int kThreads = kGroups * T;  // of the fused backward's CTA
    static_assert(kThreads >= Cta<T>::kThreads, "at least the geometry's CTA");
};
// The *g2 entries' shape (a name without commas: HIP's __launch_bounds__ is a macro).
using TwoGroupsT128 = WeightGradChunk<128, 2, 16>;

template <typename S>
__device__ __forceinline__ bool backward_vector_ok(const BackwardArgs& a) {
    return aligned16(a.x) && aligned16(a.grad_y) && aligned16(a.weight) &&
           aligned16(a.grad_residual) && aligned16(a.grad_x) && stride_aligned16<S>(a.x_stride) &&
           stride_aligned16<S>(a.d);
}

// A row group's per-column sums of grad_y * x_hat live in shared memory (T * K * E floats; in
// registers they cost a third of the CTAs per SM): float4 number (k * E / 4 + q) * kPlane + lane
// of the group's sums holds elements 4q .. 4q + 3 of the thread's chunk k, so a warp's accesses
// are contiguous.  kPlane = T (SumsLayout): each group's sums in a block of their own.
template <int T, int E, int kPlane = T>
__device__ __forceinline__ int group_sums_slot(int lane, int k, int q) {
    return (k * (E / 4) + q) * kPlane + lane;
}

// Where the row groups' sums of a CTA lie.  By default group g's T * K * E / 4 float4s follow
// group g - 1's.  Where a warp holds several groups (kInterleavedSums: t4, t16) that put the
// float4s a warp stores for one (k, q) 2 KiB (t16) or 512 bytes (t4) apart, on the same banks:
// 8-way conflicts at t4 (seen in a profile).  Interleaved, the groups'
// float4s of one (k, q) are contiguous (a plane of G * T), so a warp's stores are too, and
// planes are kSumsPlanePad float4s (16 banks) apart, so that a warp's column reads in
// store_group_sums (two planes, q = 0 and 1) do not meet on the same banks.
template <int T>
constexpr bool kInterleavedSums = T == 4;
constexpr int kSumsPlanePad = 4;
template <int T, int K, int E, int G>
struct SumsLayout {
    static constexpr bool kInterleaved = kInterleavedSums<T> && G > 1;
    static constexpr int kPlane = kInterleaved ? G * T + kSumsPlanePad : T;  // float4s per (k, q)
    static constexpr int kGroupOffset = kInterleaved ? T : T * K * E / 4;  // float4s per group
    static constexpr int kFloat4s = kInterleaved ? K * E / 4 * kPlane : G * T * K * E / 4;
};

// Clears this thread's K x E sums in its row group's slots.
template <int T, int K, int E, int kPlane = T>
__device__ __forceinline__ void zero_group_sums(float4* mine, int lane) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
#pragma unroll
        for (int q = 0; q < E / 4; ++q) {
            mine[group_sums_slot<T, E, kPlane>(lane, k, q)] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
    }
}

// The float index of column col (element col of the row) in a row group's sums.
template <int T, int E, int kPlane = T>
__device__ __forceinline__ int group_sums_index(int64_t col) {
    const int c = static_cast<int>(col / E);
    const int e = static_cast<int>(col % E);
    return group_sums_slot<T, E, kPlane>(c % T, c / T, e / 4) * 4 + e % 4;
}

// Once every row group has added its rows: the groups' sums of each column added in group order
// from +0 (one column per thread) into this CTA's row of partials (fp32, [blocks, d]).
template <int T, int K, int E, int kGroups, typename Layout = SumsLayout<T, K, E, kGroups>>
__device__ __forceinline__ void store_group_sums(const float4* group_sums, float* partials, int64_t d) {
    __syncthreads();
    const float* sums = reinterpret_cast<const float*>(group_sums);
    float* out = partials + static_cast<int64_t>(blockIdx.x) * d;
    for (int64_t col = threadIdx.x; col < d; col += kGroups * T) {
        const int index = group_sums_index<T, E, Layout::kPlane>(col);
        float sum = 0.0f;
#pragma unroll
        for (int g = 0; g < kGroups; ++g) {
            sum = ieee_add(sum, sums[g * Layout::kGroupOffset * 4 + index]);
        }
        out[col] = sum;
    }
}

// Element e of a chunk in fp32: Codec::load's value.  For bf16 it is taken from the chunk's
// 32-bit words, w << 16 (even e) or w & 0xffff0000 (odd e): one instruction, where nvcc turned
// Codec::load of the 16-bit element into two for the odd ones (a PRMT extracting the half, then
// a shift); the backward unpacks each of dy, x and the weight twice per row, and its bf16 kernels
// are bound by instruction issue (seen in a profile).  kWords = false: Codec::load (the K = 8
// geometries: ptxas gives bf16 t128's grad_x kernel 108 registers instead of 96 with the words,
// a CTA per SM less; kLeanBackward).
template <typename Codec, bool kWords = true>
__device__ __forceinline__ float chunk_value(const Chunk<Codec>& chunk, int e) {
    if constexpr (Codec::kIsBf16 && kWords) {
        const uint32_t word = reinterpret_cast<const uint32_t*>(chunk.v)[e / 2];
        return __uint_as_float(e % 2 == 0 ? word << 16 : word & 0xffff0000u);
    } else {
        return Codec::load(chunk.v[e]);
    }
}

// round_chunk's bits for grad_x with one NaN test per chunk: bf16 pairs packed by
// cvt.rn.bf16x2.f32 and, only for a chunk that holds a NaN (else round_chunk's NaN patch does
// nothing), by round_chunk itself.  round_chunk tests and patches every element (3 of the
// backward's ~32 instructions per element; its bf16 kernels are bound by instruction issue).
// The forward's *_vec entries use chunk16.cuh's round_chunk_rare_nan instead (same bits, NaN
// tested on the packed words); the two were not timed against each other.
template <typename Codec>
__device__ __forceinline__ void round_grad_chunk(Chunk<Codec>& chunk, const float* f) {
#if !defined(__HIPCC__)
    if constexpr (Codec::kIsBf16) {
        constexpr int E = Chunk<Codec>::kElems;
        if (cvt_bf16_chunk_without_nan<E>(reinterpret_cast<uint32_t*>(chunk.v), f)) return;
    }
#endif
    round_chunk(chunk, f);
}
// The fused backward's row groups of 16 and 32 threads keep round_chunk: with round_grad_chunk
// ptxas gives their kernels 107-112 registers instead of 95, a CTA per SM less.
template <int T>
constexpr bool kGradNanTestPerChunk = T != 16 && T != 32;
// Where backward_row (grad_x kernels, the K = 8 fused ones) unpacks words and tests NaN once per
// chunk: up to 5 chunks per thread (more registers for K = 8, above).
template <int K>
constexpr bool kLeanBackward = K <= kResidentWeightMaxChunks;

// dot + sum over the chunk's elements inside the row (first + e < d), in increasing e, of
// (dy * w) * (x * inv_rms): the backward's per-thread dot.  A chunk wholly inside the row (every
// chunk on the vector path, where d is a multiple of E) takes the loop without per-element
// checks: nvcc keeps a 64-bit compare and a branch per element there, and t128k4's fused kernel
// measures faster without them.  Both loops add the same values in the same order, so the bits
// do not change.  whole: the caller knows the chunk is whole (a vector launch's chunk inside the
// row), so not even the chunk's 64-bit test is needed (measured faster again).
template <typename Codec, bool kWords = true>
__device__ __forceinline__ float add_chunk_dot(float dot, const Chunk<Codec>& gs,
                                               const Chunk<Codec>& w, const Chunk<Codec>& xs,
                                               float inv_rms, int64_t first, int64_t d,
                                               bool whole = false) {
    constexpr int E = Chunk<Codec>::kElems;
    if (whole || first + E <= d) {
#pragma unroll
        for (int e = 0; e < E; ++e) {
            const float gw =
                ieee_mul(chunk_value<Codec, kWords>(gs, e), chunk_value<Codec, kWords>(w, e));
            const float x_hat = ieee_mul(chunk_value<Codec, kWords>(xs, e), inv_rms);
            dot = ieee_add(dot, ieee_mul(gw, x_hat));
        }
    } else {
#pragma unroll
        for (int e = 0; e < E; ++e) {
            if (first + e >= d) continue;
            const float gw =
                ieee_mul(chunk_value<Codec, kWords>(gs, e), chunk_value<Codec, kWords>(w, e));
            const float x_hat = ieee_mul(chunk_value<Codec, kWords>(xs, e), inv_rms);
            dot = ieee_add(dot, ieee_mul(gw, x_hat));
        }
    }
    return dot;
}

// grad_h of `row` by the T threads of its group (`lane` = this thread's index in it), with the
// forward's layout and tree.  kWeightGrad (rows held in registers only): also adds
// grad_y * x_hat of each of the thread's elements to its slots of the row group's sums in
// shared memory (group_sums_slot); a row past the end adds nothing.
// Every thread of the CTA must call it (row_group_sum synchronises the CTA when T > warp size).
template <typename Codec, int T, int K, bool kStreaming, bool kWeightGrad>
__device__ __forceinline__ void backward_row(const BackwardArgs& a, int64_t row, int lane,
                                             bool vector, float* warp_partials,
                                             float4* group_sums) {
    using S = typename Codec::storage;
    constexpr int E = Chunk<Codec>::kElems;
    static_assert(!(kStreaming && kWeightGrad), "the streaming form keeps no per-column sums");
    constexpr bool kLean = kLeanBackward<K>;
    const bool active = row < a.rows;
    const int64_t d = a.d;
    const int64_t chunks = (d + E - 1) / E;
    const int64_t safe_row = active ? row : 0;
    const S* x = static_cast<const S*>(a.x) + safe_row * a.x_stride;
    const S* grad_y = static_cast<const S*>(a.grad_y) + safe_row * d;
    const S* grad_residual =
        a.grad_residual != nullptr ? static_cast<const S*>(a.grad_residual) + safe_row * d : nullptr;
    S* grad_x = static_cast<S*>(a.grad_x) + safe_row * d;
    const S* weight = static_cast<const S*>(a.weight);
    const float inv_rms = active ? a.rstd[row] : 0.0f;

    Chunk<Codec> xs[K], gs[K];
    float dot = 0.0f;
    for (int64_t base = 0; base < (kStreaming ? chunks : 1); base += static_cast<int64_t>(K) * T) {
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int64_t c = base + lane + static_cast<int64_t>(k) * T;
            if (active && c < chunks) {
                load_chunk(xs[k], x, c, d, vector);
                load_chunk(gs[k], grad_y, c, d, vector);
            }
        }
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int64_t c = base + lane + static_cast<int64_t>(k) * T;
            if (!(active && c < chunks)) continue;
            Chunk<Codec> w;
            load_chunk(w, weight, c, d, vector);
            dot = add_chunk_dot<Codec, kLean>(dot, gs[k], w, xs[k], inv_rms, c * E, d);
        }
    }
    const float mean_dot = __fdiv_rn(row_group_sum<T>(dot, warp_partials), static_cast<float>(d));
    if (!active) return;
    for (int64_t base = 0; base < (kStreaming ? chunks : 1); base += static_cast<int64_t>(K) * T) {
        if constexpr (kStreaming) {
#pragma unroll
            for (int k = 0; k < K; ++k) {
                const int64_t c = base + lane + static_cast<int64_t>(k) * T;
                if (c < chunks) {
                    load_chunk(xs[k], x, c, d, vector);
                    load_chunk(gs[k], grad_y, c, d, vector);
                }
            }
        }
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int64_t c = base + lane + static_cast<int64_t>(k) * T;
            if (c >= chunks) continue;
            Chunk<Codec> w, extra, out;
            load_chunk(w, weight, c, d, vector);
            if (grad_residual != nullptr) load_chunk(extra, grad_residual, c, d, vector);
            float product[E], gx[E];
#pragma unroll
            for (int e = 0; e < E; ++e) {
                const float dy = chunk_value<Codec, kLean>(gs[k], e);
                const float gw = ieee_mul(dy, chunk_value<Codec, kLean>(w, e));
                const float x_hat = ieee_mul(chunk_value<Codec, kLean>(xs[k], e), inv_rms);
                float g = ieee_mul(inv_rms, ieee_sub(gw, ieee_mul(x_hat, mean_dot)));
                if (grad_residual != nullptr) g = ieee_add(g, chunk_value<Codec, kLean>(extra, e));
                gx[e] = g;
                product[e] = ieee_mul(dy, x_hat);
            }
            if constexpr (kLean) {
                round_grad_chunk(out, gx);
            } else {
                round_chunk(out, gx);
            }
            store_chunk(grad_x, out, c, d, vector);
            if constexpr (kWeightGrad) {
                // Elements past d in the last chunk were loaded as zeros: they add +0.
#pragma unroll
                for (int q = 0; q < E / 4; ++q) {
                    float4* slot = group_sums + group_sums_slot<T, E>(lane, k, q);
                    float4 sum = *slot;
                    sum.x = ieee_add(sum.x, product[4 * q]);
                    sum.y = ieee_add(sum.y, product[4 * q + 1]);
                    sum.z = ieee_add(sum.z, product[4 * q + 2]);
                    sum.w = ieee_add(sum.w, product[4 * q + 3]);
                    *slot = sum;
                }
            }
        }
    }
}

// grad_h only (grad_weight not wanted, or the streaming form): one row per group of T threads.
template <typename Codec, int T, int K, bool kStreaming>
__device__ __forceinline__ void backward_rows(const BackwardArgs& a, float* warp_partials) {
    const int64_t row = static_cast<int64_t>(blockIdx.x) * Cta<T>::kRowGroups + threadIdx.x / T;
    backward_row<Codec, T, K, kStreaming, false>(
        a, row, threadIdx.x % T, backward_vector_ok<typename Codec::storage>(a), warp_partials,
        nullptr);
}

// grad_h and grad_weight's first level: CTA b owns rows [b * kRows, (b + 1) * kRows); row group
// g takes rows b * kRows + g * kRowsInSequence + s, s = 0, 1, ... in order, summing
// grad_y * x_hat per column from +0; the groups' sums are then added in group order from +0
// (one column per thread) into partials[b, :] (fp32, [blocks, d]).
template <typename Codec, int T, int K>
__device__ __forceinline__ void backward_weight_grad_rows(const BackwardArgs& a, float* partials,
                                                          float* warp_partials,
                                                          float4* group_sums) {
    constexpr int E = Chunk<Codec>::kElems;
    using Chunking = WeightGradChunk<T>;
    constexpr int kGroups = Chunking::kGroups;
    constexpr int kSequence = Chunking::kRowsInSequence;
    constexpr int kGroupFloat4s = T * K * E / 4;
    const int lane = threadIdx.x % T;
    const int group = threadIdx.x / T;
    const int64_t first_row =
        static_cast<int64_t>(blockIdx.x) * Chunking::kRows + group * kSequence;
    const bool vector = backward_vector_ok<typename Codec::storage>(a);
    float4* mine = group_sums + group * kGroupFloat4s;
    zero_group_sums<T, K, E>(mine, lane);
    for (int s = 0; s < kSequence; ++s) {
        backward_row<Codec, T, K, false, true>(a, first_row + s, lane, vector, warp_partials, mine);
    }
    store_group_sums<T, K, E, kGroups>(group_sums, partials, a.d);
}

// ---- Rows held in registers (every geometry but the streaming one) -------------------------
// The same per-row arithmetic and trees as forward_rows / backward_row (so the same bits), with
// the loads moved: the weight's chunks are loaded with the row's, before the reduction instead
// of after it (the sweep is in docs/tuning/rms_norm.md).  The forward's per-chunk steps are
// common/rms_row.cuh's, which qk_norm_rope.cu's q/k norm runs too.

// Forward: one row per group of T threads (CTA b's group g takes row b * G + g).
template <typename Codec, int T, int K, bool kFusedAdd>
__device__ __forceinline__ void forward_rows_resident(const ForwardArgs& a, float* warp_partials) {
    using S = typename Codec::storage;
    constexpr int E = Chunk<Codec>::kElems;
    const int lane = threadIdx.x % T;
    const int64_t row = static_cast<int64_t>(blockIdx.x) * Cta<T>::kRowGroups + threadIdx.x / T;
    const bool active = row < a.rows;
    const int64_t d = a.d;
    const int64_t chunks = (d + E - 1) / E;
    const int64_t safe_row = active ? row : 0;
    const S* x = static_cast<const S*>(a.x) + safe_row * a.x_stride;
    const S* weight = static_cast<const S*>(a.weight);
    const bool vector = aligned16(a.x) && aligned16(a.y) && aligned16(a.weight) &&
                        aligned16(a.residual) && aligned16(a.new_residual) &&
                        stride_aligned16<S>(a.x_stride) && stride_aligned16<S>(a.residual_stride) &&
                        stride_aligned16<S>(d);
    Chunk<Codec> h[K], w[K];
    Chunk<Codec> r[kFusedAdd ? K : 1];
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int64_t c = lane + static_cast<int64_t>(k) * T;
        if (active && c < chunks) load_chunk(h[k], x, c, d, vector);
    }
    if constexpr (kFusedAdd) {
        const S* residual = static_cast<const S*>(a.residual) + safe_row * a.residual_stride;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int64_t c = lane + static_cast<int64_t>(k) * T;
            if (active && c < chunks) load_chunk(r[k], residual, c, d, vector);
        }
    }
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int64_t c = lane + static_cast<int64_t>(k) * T;
        if (c < chunks) load_chunk(w[k], weight, c, d, vector);
    }
    S* new_residual = kFusedAdd ? static_cast<S*>(a.new_residual) + safe_row * d : nullptr;
    float sum_sq = 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int64_t c = lane + static_cast<int64_t>(k) * T;
        if (!(active && c < chunks)) continue;
        if constexpr (kFusedAdd) {
            float f[E];
#pragma unroll
            for (int e = 0; e < E; ++e) {
                f[e] = ieee_add(Codec::load(h[k].v[e]), Codec::load(r[k].v[e]));
            }
            round_chunk(h[k], f);
        }
        sum_sq = add_row_squares(sum_sq, h[k], c, d);
        if constexpr (kFusedAdd) store_chunk(new_residual, h[k], c, d, vector);
    }
    const float inv_rms = inv_rms_of(row_group_sum<T>(sum_sq, warp_partials), d, a.eps);
    if (!active) return;
    if (a.rstd != nullptr && lane == 0) a.rstd[row] = inv_rms;
    S* y = static_cast<S*>(a.y) + row * d;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int64_t c = lane + static_cast<int64_t>(k) * T;
        if (c >= chunks) continue;
        Chunk<Codec> out;
        normed_chunk(out, h[k], w[k], inv_rms);
        store_chunk(y, out, c, d, vector);
    }
}

// ---- Forward, vector launches --------------------------------------------------------------
// When every pointer, row stride and d * sizeof are multiples of 16 bytes, every chunk is whole:
// forward_rows_vector runs forward_rows_resident's operations in the same order (the same bits)
// with 32-bit chunk indices, no per-element bounds tests and round_chunk_rare_nan for the
// output, about half the instructions per element.  Kernel entries of their own (*_vec), which
// the host picks for vector launches (forward_vector_launch's condition), so that the element
// path's registers and code do not shape them.

template <typename Codec>
__device__ __forceinline__ uint4 as_vector(const Chunk<Codec>& c) {
    return *reinterpret_cast<const uint4*>(c.v);
}

template <typename Codec>
__device__ __forceinline__ Chunk<Codec> as_chunk(uint4 v) {
    Chunk<Codec> c;
    *reinterpret_cast<uint4*>(c.v) = v;
    return c;
}

// An empty asm that "changes" the chunk's words once `after` is known: values computed from
// the words before it are not reused, nor can their conversions be moved above it (no
// instruction is emitted).
template <typename Codec>
__device__ __forceinline__ void keep_packed(Chunk<Codec>& c, float after) {
#if !defined(__HIPCC__)
    uint32_t* words = reinterpret_cast<uint32_t*>(c.v);
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(words[i]) : "f"(after));
#endif
}

// forward_rows_resident for a vector launch: G rows per CTA of T * G threads (CTA b's group g
// takes row b * G + g).
template <typename Codec, int T, int K, bool kFusedAdd, int G = Cta<T>::kRowGroups>
__device__ __forceinline__ void forward_rows_vector(const ForwardArgs& a, float* warp_partials) {
    using S = typename Codec::storage;
    constexpr int E = Chunk<Codec>::kElems;
    const int lane = threadIdx.x % T;
    const int64_t row = static_cast<int64_t>(blockIdx.x) * G + threadIdx.x / T;
    const bool active = row < a.rows;
    const int chunks = static_cast<int>(a.d / E);  // whole chunks (a vector launch)
    const int64_t safe_row = active ? row : 0;
    const uint4* x =
        reinterpret_cast<const uint4*>(static_cast<const S*>(a.x) + safe_row * a.x_stride);
    const uint4* weight = static_cast<const uint4*>(a.weight);
    Chunk<Codec> h[K], w[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int c = lane + k * T;
        if (active && c < chunks) h[k] = as_chunk<Codec>(x[c]);
    }
    Chunk<Codec> r[kFusedAdd ? K : 1];
    if constexpr (kFusedAdd) {
        const uint4* residual = reinterpret_cast<const uint4*>(static_cast<const S*>(a.residual) +
                                                               safe_row * a.residual_stride);
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int c = lane + k * T;
            if (active && c < chunks) r[k] = as_chunk<Codec>(residual[c]);
        }
    }
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int c = lane + k * T;
        if (c < chunks) w[k] = as_chunk<Codec>(weight[c]);
    }
    uint4* new_residual =
        kFusedAdd ? reinterpret_cast<uint4*>(static_cast<S*>(a.new_residual) + safe_row * a.d)
                  : nullptr;
    float sum_sq = 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int c = lane + k * T;
        if (!(active && c < chunks)) continue;
        if constexpr (kFusedAdd) {
            float f[E];
#pragma unroll
            for (int e = 0; e < E; ++e) {
                f[e] = ieee_add(Codec::load(h[k].v[e]), Codec::load(r[k].v[e]));
            }
            round_chunk_rare_nan(h[k], f);
            new_residual[c] = as_vector(h[k]);
        }
#pragma unroll
        for (int e = 0; e < E; ++e) {
            const float v = Codec::load(h[k].v[e]);
            sum_sq = ieee_add(sum_sq, ieee_mul(v, v));
        }
    }
    const float inv_rms = inv_rms_of(row_group_sum<T>(sum_sq, warp_partials), a.d, a.eps);
    if (!active) return;
    // The row and the weight stay packed until inv_rms is known (half the registers): otherwise
    // the compiler keeps the squares' fp32 values of h for the output and converts the weight
    // during the reduction (t64: 114 registers instead of 80).
#pragma unroll
    for (int k = 0; k < K; ++k) {
        keep_packed(h[k], inv_rms);
        keep_packed(w[k], inv_rms);
    }
    if (a.rstd != nullptr && lane == 0) a.rstd[row] = inv_rms;
    uint4* y = reinterpret_cast<uint4*>(static_cast<S*>(a.y) + row * a.d);
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int c = lane + k * T;
        if (c >= chunks) continue;
        float f[E];
#pragma unroll
        for (int e = 0; e < E; ++e) {
            f[e] = ieee_mul(ieee_mul(Codec::load(h[k].v[e]), inv_rms), Codec::load(w[k].v[e]));
        }
        Chunk<Codec> out;
        round_chunk_rare_nan(out, f);
        y[c] = as_vector(out);
    }
}

// Fused backward, t128k5: chunk k of a thread is tested against the thread's count of chunks
// inside the row (lane_chunks: one 32-bit compare per chunk) instead of lane + k * T < chunks in
// 64 bits, which nvcc recomputed for every chunk of every pass of every row.  With the copies
// below and add_chunk_dot's whole-chunk hint, t128k5's fused entries take 125 / 127 / 94
// registers (bf16 / fp16 / fp32; g2: 125 / 128 / 98) and measure faster.  Only t128k5: for every
// geometry ptxas gives t128k4's bf16 / fp16 entries 144 / 164 registers, not 128.
template <int T, int K>
constexpr bool kLaneChunkCount = T == 128 && K == 5;
// Fused backward, t128k5 in bf16 and fp16: separate copies for launches with and without
// grad_residual, chosen once per CTA (else 16 predicated instructions per chunk, the residual's
// unpacks and additions, issued even where it is absent).  Not fp32 (t128k5's entry took 150
// registers instead of 94: 3 CTAs per SM instead of 5), nor the other geometries (the first
// try, for all of them: bf16 t128k4 168 and t128k4g2 158 registers instead of 128).
template <typename Codec, int K>
constexpr bool kResidualCopies = K == 5 && sizeof(typename Codec::storage) == 2;
// How many of this thread's K chunks (lane + k * T, k = 0 .. K - 1) lie inside a row of `chunks`
// chunks: chunk k does iff k < lane_chunks.
template <int T, int K>
__device__ __forceinline__ int lane_chunks(int64_t chunks, int lane) {
    const int64_t rest = chunks - lane;
    if (rest <= 0) return 0;
    const int64_t held = (rest + T - 1) / T;
    return held < K ? static_cast<int>(held) : K;
}

// dy and x of `row` into the thread's chunks (nothing for a row past the end).
template <typename Codec, int T, int K>
__device__ __forceinline__ void load_backward_row(Chunk<Codec> (&xs)[K], Chunk<Codec> (&gs)[K],
                                                  const BackwardArgs& a, int64_t row, int lane,
                                                  bool vector) {
    using S = typename Codec::storage;
    constexpr int E = Chunk<Codec>::kElems;
    if (row >= a.rows) return;
    const int64_t chunks = (a.d + E - 1) / E;
    const int held = kLaneChunkCount<T, K> ? lane_chunks<T, K>(chunks, lane) : K;
    const S* x = static_cast<const S*>(a.x) + row * a.x_stride;
    const S* grad_y = static_cast<const S*>(a.grad_y) + row * a.d;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int64_t c = lane + static_cast<int64_t>(k) * T;
        if (kLaneChunkCount<T, K> ? k < held : c < chunks) {
            load_chunk(xs[k], x, c, a.d, vector);
            load_chunk(gs[k], grad_y, c, a.d, vector);
        }
    }
}

// inv_rms of `row` as the backward reads it (0 for a row past the end, which adds nothing).
__device__ __forceinline__ float saved_inv_rms(const BackwardArgs& a, int64_t row) {
    return row < a.rows ? a.rstd[row] : 0.0f;
}

// backward_row (kWeightGrad) for a row already loaded, the weight's chunks in w and the row's
// inv_rms (saved_inv_rms) given: the same operations in the same order.  xs, gs: the row's
// chunks by k, in registers (Chunk arrays) or staged in shared memory (StagedChunks, read at
// each use).  kReuse, kGroupBarrier: row_group_sum's (kReuse false where the caller alternates
// two warp_partials buffers); group: this thread's row group in the CTA.
template <typename Codec, int T, int K, int kResidual, bool kReuse, bool kGroupBarrier = false,
          bool kFreshSums = false, int kPlane = T, typename Xs, typename Gs>
__device__ __forceinline__ void backward_resident_row(const BackwardArgs& a, int64_t row,
                                                      int lane, bool vector, const Xs& xs,
                                                      const Gs& gs, const Chunk<Codec> (&w)[K],
                                                      float inv_rms, float* warp_partials,
                                                      float4* group_sums, int group = 0) {
    using S = typename Codec::storage;
    constexpr int E = Chunk<Codec>::kElems;
    const bool active = row < a.rows;
    const int64_t d = a.d;
    const int64_t chunks = (d + E - 1) / E;
    const int held = kLaneChunkCount<T, K> ? lane_chunks<T, K>(chunks, lane) : K;
    float dot = 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int64_t c = lane + static_cast<int64_t>(k) * T;
        if (!(active && (kLaneChunkCount<T, K> ? k < held : c < chunks))) continue;
        dot = add_chunk_dot<Codec>(dot, gs[k], w[k], xs[k], inv_rms, c * E, d, vector);
    }
    const float mean_dot = __fdiv_rn(
        row_group_sum<T, kReuse, kGroupBarrier>(dot, warp_partials, group), static_cast<float>(d));
    if (!active) return;
    S* grad_x = static_cast<S*>(a.grad_x) + row * d;
    // kResidual: 1 (0) the caller's copy is for launches with (without) grad_residual; -1: test.
    const bool residual = kResidual < 0 ? a.grad_residual != nullptr : kResidual == 1;
    const S* grad_residual =
        residual ? static_cast<const S*>(a.grad_residual) + row * d : nullptr;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int64_t c = lane + static_cast<int64_t>(k) * T;
        if (kLaneChunkCount<T, K> ? k >= held : c >= chunks) continue;
        // Array elements by reference (the code of a register row is unchanged), a staged
        // chunk read from shared memory once into a local.
        decltype(auto) x_k = xs[k];
        decltype(auto) g_k = gs[k];
        Chunk<Codec> extra, out;
        if (residual) load_chunk(extra, grad_residual, c, d, vector);
        float g[E], product[E];
#pragma unroll
        for (int e = 0; e < E; ++e) {
            const float dy = chunk_value<Codec>(g_k, e);
            const float gw = ieee_mul(dy, chunk_value(w[k], e));
            const float x_hat = ieee_mul(chunk_value<Codec>(x_k, e), inv_rms);
            g[e] = ieee_mul(inv_rms, ieee_sub(gw, ieee_mul(x_hat, mean_dot)));
            if (residual) g[e] = ieee_add(g[e], chunk_value(extra, e));
            product[e] = ieee_mul(dy, x_hat);
        }
        if constexpr (kGradNanTestPerChunk<T>) {
            round_grad_chunk(out, g);
        } else {
            round_chunk(out, g);
        }
        store_chunk(grad_x, out, c, d, vector);
        // Elements past d in the last chunk were loaded as zeros: they add +0.
#pragma unroll
        for (int q = 0; q < E / 4; ++q) {
            float4* slot = group_sums + group_sums_slot<T, E, kPlane>(lane, k, q);
            // kFreshSums: the run's sums start here, at +0 (not read back from cleared slots).
            float4 sum = kFreshSums ? make_float4(0.0f, 0.0f, 0.0f, 0.0f) : *slot;
            sum.x = ieee_add(sum.x, product[4 * q]);
            sum.y = ieee_add(sum.y, product[4 * q + 1]);
            sum.z = ieee_add(sum.z, product[4 * q + 2]);
            sum.w = ieee_add(sum.w, product[4 * q + 3]);
            *slot = sum;
        }
    }
}

// backward_weight_grad_rows' rows, order and sums, with the weight's chunks loaded once per row
// group (they are the same for its kRowsInSequence rows) together with the first row's.  Used
// for K <= kResidentWeightMaxChunks: with 8 chunks the weight's 32 more registers per thread
// cost a CTA per SM and it measures slower.
// kAlternatePartials<T>: row s reduces through warp partials s % 2 (one barrier per row).
template <typename Codec, int T, int K, typename Chunking, int kResidual>
__device__ __forceinline__ void backward_weight_grad_resident(const BackwardArgs& a,
                                                              float* partials,
                                                              float* warp_partials,
                                                              float4* group_sums) {
    using S = typename Codec::storage;
    constexpr int E = Chunk<Codec>::kElems;
    constexpr int kGroups = Chunking::kGroups;
    constexpr int kSequence = Chunking::kRowsInSequence;
    using Layout = SumsLayout<T, K, E, kGroups>;
    constexpr bool kAlternate = kAlternatePartials<T>;
    // Several row groups of whole warps (t128k4g2, t128k5g2): each reduces its rows at a named
    // barrier of its own (row_group_sum's kGroupBarrier), as on the staged path.
    constexpr bool kGroupBarrier = kGroups > 1 && T > BATCHINV_WARP_SIZE;
    const int lane = threadIdx.x % T;
    const int group = threadIdx.x / T;
    const int64_t first_row =
        static_cast<int64_t>(blockIdx.x) * Chunking::kRows + group * kSequence;
    const bool vector = backward_vector_ok<S>(a);
    const int64_t chunks = (a.d + E - 1) / E;
    float4* mine = group_sums + group * Layout::kGroupOffset;
    // Runs of one row (kFresh): the row writes +0 + its products, so only a group whose row is
    // past the end (it writes nothing) clears its sums to +0.
    constexpr bool kFresh = kSequence == 1;
    if (!kFresh || first_row >= a.rows) zero_group_sums<T, K, E, Layout::kPlane>(mine, lane);
    Chunk<Codec> w[K], xs[K], gs[K];
    load_backward_row<Codec, T, K>(xs, gs, a, first_row, lane, vector);
    const S* weight = static_cast<const S*>(a.weight);
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int64_t c = lane + static_cast<int64_t>(k) * T;
        if (c < chunks) load_chunk(w[k], weight, c, a.d, vector);
    }
    for (int s = 0; s < kSequence; ++s) {
        float* row_partials = kAlternate ? warp_partials + (s % 2) * kMaxWarps : warp_partials;
        if constexpr (kPrefetchNextRow<T, K>) {
            // The next row's loads go out before this row's reduction, stores and sums, so a
            // row group has loads in flight while it works.
            Chunk<Codec> next_xs[K], next_gs[K];
            if (s + 1 < kSequence) {
                load_backward_row<Codec, T, K>(next_xs, next_gs, a, first_row + s + 1, lane,
                                               vector);
            }
            backward_resident_row<Codec, T, K, kResidual, !kAlternate, kGroupBarrier, false,
                                  Layout::kPlane>(
                a, first_row + s, lane, vector, xs, gs, w, saved_inv_rms(a, first_row + s),
                row_partials, mine, group);
#pragma unroll
            for (int k = 0; k < K; ++k) {
                xs[k] = next_xs[k];
                gs[k] = next_gs[k];
            }
        } else {
            if (s > 0) load_backward_row<Codec, T, K>(xs, gs, a, first_row + s, lane, vector);
            backward_resident_row<Codec, T, K, kResidual, !kAlternate, kGroupBarrier, kFresh,
                                  Layout::kPlane>(
                a, first_row + s, lane, vector, xs, gs, w, saved_inv_rms(a, first_row + s),
                row_partials, mine, group);
        }
    }
    store_group_sums<T, K, E, kGroups>(group_sums, partials, a.d);
}

#if !defined(__HIPCC__)
// A staged row's chunks of one tensor: chunk k of this thread is slot k * T + lane of its
// stage, written by this thread's own cp.async.
template <typename Codec, int T>
struct StagedChunks {
    const uint4* stage;
    int lane;
    __device__ __forceinline__ Chunk<Codec> operator[](int k) const {
        Chunk<Codec> chunk;
        *reinterpret_cast<uint4*>(chunk.v) = stage[k * T + lane];
        return chunk;
    }
};

// Bytes of the ring: stages x (x, dy) x T * K chunks of 16 bytes (the host passes them as
// dynamic shared memory: kernels' rms_norm_backward_weight_grad_*_t128k4).
template <int T, int K>
constexpr int kStagedRowsBytes = kStagedRowStages * 2 * T * K * kChunkBytes;

// backward_weight_grad_resident's rows, order and sums (row groups of kRowsInSequence rows,
// T >= warp size; vector launches only), with the rows staged in `ring` (one ring per group) by
// cp.async kStagedRowStages - 1 rows ahead instead of loaded into registers: the same
// operations in the same order.  Each row's inv_rms is loaded one row ahead too: read after
// the row's cp.async wait it is the kernel's top stall in a profile of t128k4g2.  Where a CTA
// holds two row groups, each reduces its rows across its warps at a named barrier of its own.
template <typename Codec, int T, int K, typename Chunking, int kResidual>
__device__ __forceinline__ void backward_weight_grad_staged(const BackwardArgs& a,
                                                            float* partials,
                                                            float* warp_partials,
                                                            float4* group_sums, uint4* ring) {
    using S = typename Codec::storage;
    constexpr int E = Chunk<Codec>::kElems;
    constexpr int kStages = kStagedRowStages;
    constexpr int kSequence = Chunking::kRowsInSequence;
    constexpr int kGroupFloat4s = T * K * E / 4;
    static_assert(Cta<T>::kRowGroups == 1, "row groups of whole warps");
    const int lane = Chunking::kGroups == 1 ? static_cast<int>(threadIdx.x) : threadIdx.x % T;
    const int group = Chunking::kGroups == 1 ? 0 : threadIdx.x / T;
    const int64_t first_row =
        static_cast<int64_t>(blockIdx.x) * Chunking::kRows + group * kSequence;
    const int64_t d = a.d;
    const int64_t chunks = d / E;  // a vector launch: d is a multiple of E
    // The group's ring: stage st holds x at [(2 * st) * T * K ..] and dy at
    // [(2 * st + 1) * T * K ..].
    uint4* const group_ring = ring + group * (kStages * 2 * T * K);
    auto stage_of = [&](int st, int tensor) { return group_ring + (2 * st + tensor) * (T * K); };
    auto stage_row = [&](int64_t row, int st) {
        if (row < a.rows) {
            const S* x = static_cast<const S*>(a.x) + row * a.x_stride;
            const S* grad_y = static_cast<const S*>(a.grad_y) + row * d;
#pragma unroll
            for (int k = 0; k < K; ++k) {
                const int64_t c = lane + static_cast<int64_t>(k) * T;
                if (c < chunks) {
                    // Sources as void*: element-typed ones reorder this loop's address arithmetic
                    // (common/cp_async.cuh).
                    cp_async16(stage_of(st, 0) + k * T + lane, static_cast<const void*>(x + c * E));
                    cp_async16(stage_of(st, 1) + k * T + lane, static_cast<const void*>(grad_y + c * E));
                }
            }
        }
        cp_async_commit();  // one group per row, empty past the end, so the wait counts rows
    };
#pragma unroll
    for (int i = 0; i < kStages - 1; ++i) stage_row(first_row + i, i);
    Chunk<Codec> w[K];
    const S* weight = static_cast<const S*>(a.weight);
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int64_t c = lane + static_cast<int64_t>(k) * T;
        if (c < chunks) load_chunk(w[k], weight, c, d, true);
    }
    float4* mine = group_sums + group * kGroupFloat4s;
    zero_group_sums<T, K, E>(mine, lane);
    constexpr bool kGroupBarrier = Chunking::kGroups > 1;
    float next_inv_rms = saved_inv_rms(a, first_row);
    for (int s = 0; s < kSequence; ++s) {
        const int st = s % kStages;
        const float inv_rms = next_inv_rms;
        if (s + 1 < kSequence) next_inv_rms = saved_inv_rms(a, first_row + s + 1);
        // Stage (s - 1) % kStages was read by this thread only, in row s - 1: free again.
        if (s + kStages - 1 < kSequence) {
            stage_row(first_row + s + kStages - 1, (s + kStages - 1) % kStages);
        } else {
            cp_async_commit();
        }
        cp_async_wait<kStages - 1>();  // row s has landed (this thread's chunks)
        const StagedChunks<Codec, T> xs{stage_of(st, 0), lane};
        const StagedChunks<Codec, T> gs{stage_of(st, 1), lane};
        backward_resident_row<Codec, T, K, kResidual, false, kGroupBarrier>(
            a, first_row + s, lane, true, xs, gs, w, inv_rms, warp_partials + (s % 2) * kMaxWarps,
            mine, group);
    }
    store_group_sums<T, K, E, Chunking::kGroups>(group_sums, partials, d);
}
#endif

// The plain and the fused forward are separate entries: the plain one then needs fewer
// registers (more CTAs per SM, more bytes in flight).  They share T and K, so
// fused_add_rms_norm's y is bitwise rms_norm of its new_residual.
template <typename Codec, int T, int K, bool kStreaming, bool kFusedAdd>
__device__ __forceinline__ void forward_kernel(const ForwardArgs& a) {
    __shared__ float warp_partials[kMaxWarps];
    if constexpr (kStreaming || T > kResidentForwardMaxThreads) {
        forward_rows<Codec, T, K, kStreaming, kFusedAdd>(a, warp_partials);
    } else {
        forward_rows_resident<Codec, T, K, kFusedAdd>(a, warp_partials);
    }
}

// The *_vec entries: vector launches only (the host checks the alignment).
template <typename Codec, int T, int K, bool kFusedAdd>
__device__ __forceinline__ void forward_vector_kernel(const ForwardArgs& a) {
    __shared__ float warp_partials[kMaxWarps];
    forward_rows_vector<Codec, T, K, kFusedAdd>(a, warp_partials);
}

template <typename Codec, int T, int K, bool kStreaming>
__device__ __forceinline__ void backward_kernel(const BackwardArgs& a) {
    __shared__ float warp_partials[kMaxWarps];
    backward_rows<Codec, T, K, kStreaming>(a, warp_partials);
}

// The fused backward for K <= kResidentWeightMaxChunks (kResidual as backward_resident_row's):
// the staged rows where they apply, else the rows in registers.
template <typename Codec, int T, int K, typename Chunking, int kResidual>
__device__ __forceinline__ void backward_weight_grad_fused(const BackwardArgs& a,
                                                           float* partials,
                                                           float* warp_partials,
                                                           float4* group_sums) {
#if !defined(__HIPCC__)
    if constexpr (kStagedRows<Codec, T, K>) {
        static_assert(kAlternatePartials<T>, "the staged rows alternate two warp-partials buffers");
        extern __shared__ uint4 staged_rows[];  // kStagedRowsBytes<T, K>, from the host
        if (backward_vector_ok<typename Codec::storage>(a)) {
            backward_weight_grad_staged<Codec, T, K, Chunking, kResidual>(
                a, partials, warp_partials, group_sums, staged_rows);
            return;
        }
    }
#endif
    backward_weight_grad_resident<Codec, T, K, Chunking, kResidual>(a, partials, warp_partials,
                                                                     group_sums);
}

// Hand-off from the fused backward (grad_weight's first level) to the last-levels grid, where
// one follows the other directly (at most kWeightGradLastLevelsRows partial rows, so at most
// kMaxRuns runs; CUDA sm_90, programmatic launch): the fused backward counts, per run of
// kWeightGradReduceRows partial rows, the CTAs whose partial row is stored, and the last-levels
// grid sums each run as soon as its count is complete instead of waiting for the whole first
// level to end.  The sums, their order and the bits are the same.
// Counting without atomics that wait (an atomic compare-and-swap per CTA measures slower): every
// call adds exactly kWeightGradReduceRows to every one of the kMaxRuns counters (one per CTA of a
// run, the missing CTAs of the last run by the last CTA, the runs past the last by CTA 0), so
// before call n (1, 2, ...) of a set of counters each one reads 64 * (n - 1) and a run of call n
// is complete when its counter reads 64 * n (mod 2^32): the host passes n as `generation` and
// may reuse the counters without zeroing them.
constexpr int kMaxRuns = static_cast<int>(kWeightGradLastLevelsRows / kWeightGradReduceRows);
constexpr int kRunCounterStride = 32;  // 32-bit words from one run's counter to the next (128 B)
static_assert(kMinCtaThreads >= kMaxRuns, "CTA 0's threads advance the runs past the last");
struct RunCounters {
    unsigned* counters;  // null: no hand-off (the grid after waits for this one)
    unsigned generation;
};

__device__ __forceinline__ void signal_partial_row_stored(const RunCounters& runs) {
    if (runs.counters == nullptr) return;
    const unsigned used_runs = (gridDim.x + kWeightGradReduceRows - 1) / kWeightGradReduceRows;
    __syncthreads();  // every thread's part of this CTA's partial row is stored
    if (threadIdx.x == 0) {
        __threadfence();  // those stores are visible at gpu scope before the count is
        unsigned add = 1;
        if (blockIdx.x == gridDim.x - 1) add += used_runs * kWeightGradReduceRows - gridDim.x;
        atomicAdd(runs.counters + (blockIdx.x / kWeightGradReduceRows) * kRunCounterStride, add);
    }
    if (blockIdx.x == 0 && threadIdx.x >= used_runs && threadIdx.x < kMaxRuns) {
        atomicAdd(runs.counters + threadIdx.x * kRunCounterStride,
                  static_cast<unsigned>(kWeightGradReduceRows));
    }
}

#if !defined(__HIPCC__)
// The waiting side is CUDA only: HIP has no programmatic launch, so its host never passes
// counters (weight_grad_last_levels then waits for the whole first level).
__device__ __forceinline__ unsigned load_acquire(const unsigned* address) {
    unsigned value;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(value) : "l"(address) : "memory");
    return value;
}

// Waits until a run's counter reads `complete`.  A count that never completes (a bug, not a
// slow first level: it takes milliseconds at most) ends the launch with an error after
// kRunWaitLimitNs instead of hanging the device.
constexpr unsigned long long kRunWaitLimitNs = 10ull * 1000 * 1000 * 1000;
__device__ __forceinline__ void wait_for_run(const unsigned* counter, unsigned complete) {
    if (load_acquire(counter) == complete) return;
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    while (load_acquire(counter) != complete) {
        __nanosleep(128);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        if (now - start > kRunWaitLimitNs) __trap();
    }
}
#endif

template <typename Codec, int T, int K, typename Chunking = WeightGradChunk<T>>
__device__ __forceinline__ void backward_weight_grad_kernel(const BackwardArgs& a,
                                                            float* partials,
                                                            const RunCounters& runs) {
    // The geometry's own CTA's sums fit kWeightGradSharedBytes (the host's rule); a CTA of two
    // row groups of it (t128k4g2, t128k5g2) holds twice that, within the 48 KiB of static
    // shared memory.
    constexpr int kSumBytes = Cta<T>::kThreads * K * Chunk<Codec>::kElems * 4;
    static_assert(kSumBytes <= kWeightGradSharedBytes, "instantiate only geometries that fit");
    constexpr bool kAlternate = K <= kResidentWeightMaxChunks && kAlternatePartials<T>;
    __shared__ float warp_partials[kAlternate ? 2 * kMaxWarps : kMaxWarps];
    __shared__ float4 group_sums[SumsLayout<T, K, Chunk<Codec>::kElems, Chunking::kGroups>::kFloat4s];
    grid_launch_dependents();  // the next grid (the further levels) may start; it waits
    if constexpr (K <= kResidentWeightMaxChunks) {
        if constexpr (!kResidualCopies<Codec, K>) {
            backward_weight_grad_fused<Codec, T, K, Chunking, -1>(a, partials, warp_partials,
                                                                  group_sums);
        } else if (a.grad_residual != nullptr) {
            backward_weight_grad_fused<Codec, T, K, Chunking, 1>(a, partials, warp_partials,
                                                                 group_sums);
        } else {
            backward_weight_grad_fused<Codec, T, K, Chunking, 0>(a, partials, warp_partials,
                                                                 group_sums);
        }
    } else {
        static_assert(Chunking::kRows == WeightGradChunk<T>::kRows, "other shapes: resident rows");
        backward_weight_grad_rows<Codec, T, K>(a, partials, warp_partials, group_sums);
    }
    signal_partial_row_stored(runs);
}

// grad_weight's first level as a separate pass over columns, for rows whose sums do not fit
// the fused backward (and for few rows, where that one has too few CTAs): the same tree,
// partials[b, col] = sum over g < groups (in order, from +0) of the sum over rows
// b * groups * in_sequence + g * in_sequence + s, s < in_sequence (in order, from +0; rows
// past the end skipped) of grad_y[r, col] * (x[r, col] * rstd[r]), fp32.  It reads grad_y and
// x a second time.
// Launch: grid = (ceil(rows / (groups * in_sequence)), ceil(d / kWeightGradThreads)), block = 256.
template <typename Codec>
__device__ __forceinline__ void weight_grad_partials(float* partials,
                                                     const typename Codec::storage* grad_y,
                                                     const typename Codec::storage* x,
                                                     const float* rstd, int64_t rows, int64_t d,
                                                     int64_t x_stride, int64_t groups,
                                                     int64_t in_sequence) {
    grid_launch_dependents();  // the next level may start; it waits for this grid
    const int64_t col = static_cast<int64_t>(blockIdx.y) * kWeightGradThreads + threadIdx.x;
    if (col >= d) return;
    const int64_t chunk = blockIdx.x;
    float total = 0.0f;
    for (int64_t g = 0; g < groups; ++g) {
        const int64_t begin = (chunk * groups + g) * in_sequence;
        const int64_t end = begin + in_sequence < rows ? begin + in_sequence : rows;
        float sum = 0.0f;
        int64_t r = begin;
        for (; r + kWeightGradUnroll <= end; r += kWeightGradUnroll) {
            float gv[kWeightGradUnroll], xv[kWeightGradUnroll], inv[kWeightGradUnroll];
#pragma unroll
            for (int u = 0; u < kWeightGradUnroll; ++u) {
                gv[u] = Codec::load(grad_y[(r + u) * d + col]);
                xv[u] = Codec::load(x[(r + u) * x_stride + col]);
                inv[u] = rstd[r + u];
            }
#pragma unroll
            for (int u = 0; u < kWeightGradUnroll; ++u) {
                sum = ieee_add(sum, ieee_mul(gv[u], ieee_mul(xv[u], inv[u])));
            }
        }
        for (; r < end; ++r) {
            const float gv = Codec::load(grad_y[r * d + col]);
            const float xv = Codec::load(x[r * x_stride + col]);
            sum = ieee_add(sum, ieee_mul(gv, ieee_mul(xv, rstd[r])));
        }
        total = ieee_add(total, sum);
    }
    partials[chunk * d + col] = total;
}

// Sum of rows [begin, end) of an fp32 [*, d] matrix in increasing row order, column col;
// kUnroll rows are loaded before they are added (loads in flight).
template <int kUnroll>
__device__ __forceinline__ float column_sum(const float* rows_in, int64_t begin, int64_t end,
                                            int64_t d, int64_t col) {
    float sum = 0.0f;
    int64_t r = begin;
    for (; r + kUnroll <= end; r += kUnroll) {
        float v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) v[u] = rows_in[(r + u) * d + col];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) sum = ieee_add(sum, v[u]);
    }
    for (; r < end; ++r) sum = ieee_add(sum, rows_in[r * d + col]);
    return sum;
}

// grad_weight, further levels while more than kWeightGradLastLevelsRows partial rows remain (the
// last two levels are weight_grad_last_levels): each run of 64 consecutive partial rows summed
// in order (a fixed tree whose shape depends on the row count only).
// Launch: grid = (ceil(rows_in / kWeightGradReduceRows), ceil(d / kWeightGradThreads)), block = 256.
__device__ __forceinline__ void weight_grad_reduce(float* rows_out, const float* rows_in,
                                                   int64_t num_rows_in, int64_t d) {
    grid_launch_dependents();
    grid_wait_primary();  // rows_in is the previous grid's output
    const int64_t col = static_cast<int64_t>(blockIdx.y) * kWeightGradThreads + threadIdx.x;
    if (col >= d) return;
    const int64_t chunk = blockIdx.x;
    const int64_t begin = chunk * kWeightGradReduceRows;
    const int64_t end =
        begin + kWeightGradReduceRows < num_rows_in ? begin + kWeightGradReduceRows : num_rows_in;
    rows_out[chunk * d + col] = column_sum<kWeightGradUnroll>(rows_in, begin, end, d, col);
}

// grad_weight's last two levels in one grid, from at most kWeightGradLastLevelsRows (64 * 64)
// partial rows: the runs of 64 consecutive rows summed in order from +0 (the level below the
// last; with at most 64 rows there is one run and no level below), then, with more than one
// run, the run sums added in run order from +0 (the last level); rounded once.  The same
// operations as a reduce level followed by a final level of one thread per column.  Run slot y
// of a CTA (threads y * kLastLevelsColumns ..) sums runs y, y + kLastLevelsRunSlots, ...
// runs.counters: null, the grid waits for the grid before it (griddepcontrol) before reading any
// partial row; else the fused backward's per-run counts (signal_partial_row_stored): a run slot
// waits for its run's count only (one thread polls, the slot's others wait at a warp barrier), so
// the runs stored first are summed while the first level's last CTAs still run.  Then it waits
// for that grid at its end only, so that the work after this grid on the stream still finds the
// fused backward complete.
// Launch: grid = ceil(d / kLastLevelsColumns), block = kLastLevelsColumns * kLastLevelsRunSlots.
template <typename Codec>
__device__ __forceinline__ void weight_grad_last_levels(typename Codec::storage* grad_weight,
                                                        const float* partials,
                                                        int64_t num_partials, int64_t d,
                                                        const RunCounters& handoff) {
#if defined(__HIPCC__)
    const bool overlapped = false;  // see wait_for_run
#else
    static_assert(kLastLevelsColumns == 16 && BATCHINV_WARP_SIZE == 32, "a run slot: half a warp");
    const bool overlapped = handoff.counters != nullptr;
#endif
    __shared__ float run_sums[kWeightGradReduceRows][kLastLevelsColumns];
    if (!overlapped) grid_wait_primary();  // partials are the previous grid's output
    const int x = threadIdx.x % kLastLevelsColumns;
    const int y = threadIdx.x / kLastLevelsColumns;
    const int64_t col = static_cast<int64_t>(blockIdx.x) * kLastLevelsColumns + x;
    const int64_t runs = (num_partials + kWeightGradReduceRows - 1) / kWeightGradReduceRows;
    for (int64_t run = y; run < runs; run += kLastLevelsRunSlots) {
        const int64_t begin = run * kWeightGradReduceRows;
        const int64_t end = begin + kWeightGradReduceRows < num_partials
                                ? begin + kWeightGradReduceRows
                                : num_partials;
#if !defined(__HIPCC__)
        if (overlapped) {
            if (x == 0) {
                wait_for_run(handoff.counters + run * kRunCounterStride,
                             handoff.generation * static_cast<unsigned>(kWeightGradReduceRows));
            }
            __syncwarp(0xffffu << (threadIdx.x % 32 / kLastLevelsColumns * kLastLevelsColumns));
        }
#endif
        if (col < d) run_sums[run][x] = column_sum<kLastLevelsUnroll>(partials, begin, end, d, col);
    }
    __syncthreads();
    if (y == 0 && col < d) {
        float total = run_sums[0][x];
        if (runs > 1) {
            total = 0.0f;
            for (int64_t run = 0; run < runs; ++run) total = ieee_add(total, run_sums[run][x]);
        }
        grad_weight[col] = Codec::store(total);
    }
    if (overlapped) grid_wait_primary();
}

}  // namespace rms
}  // namespace batchinv

// Kernel entries.  Geometry names: t<T> keeps the row in registers, T threads per row and up
// to K chunks per thread; stream is T = 1024 reading the row twice.
#define BATCHINV_RMS_NORM_FORWARD_ENTRY(KIND, SUFFIX, GEOMETRY, CODEC, T, K, STREAMING, FUSED) \
    extern "C" __global__ void __launch_bounds__(batchinv::rms::Cta<T>::kThreads)                \
        rms_norm_##KIND##_##SUFFIX##_##GEOMETRY(                                                 \
        CODEC::storage* y, CODEC::storage* new_residual, float* rstd, const CODEC::storage* x,   \
        const CODEC::storage* residual, const CODEC::storage* weight, int64_t rows, int64_t d,   \
        int64_t x_stride, int64_t residual_stride, float eps) {                                  \
        const batchinv::rms::ForwardArgs args{y,        new_residual, rstd, x,        residual,  \
                                              weight,   rows,         d,    x_stride,            \
                                              residual_stride, eps};                             \
        batchinv::grid_launch_dependents(); /* a prefetching small-M linear may start */         \
        batchinv::rms::forward_kernel<CODEC, T, K, STREAMING, FUSED>(args);                      \
    }

#define BATCHINV_RMS_NORM_FORWARD_KERNELS(SUFFIX, CODEC, GEOMETRY, T, K, STREAMING)            \
    BATCHINV_RMS_NORM_FORWARD_ENTRY(forward, SUFFIX, GEOMETRY, CODEC, T, K, STREAMING, false)     \
    BATCHINV_RMS_NORM_FORWARD_ENTRY(fused_forward, SUFFIX, GEOMETRY, CODEC, T, K, STREAMING, true)

// forward_rows_vector for 16-byte vector launches (the host picks these entries when every
// pointer, row stride and d * sizeof are multiples of 16 bytes; another launch would fault),
// where they measure faster than the entries above: the plain forward's t64 and the fused
// forward's t64 and t128k5.  MIN_BLOCKS: CTAs per SM that ptxas must leave registers for (t64:
// 86 registers, 5 CTAs; without the bound 88 registers, slower; the fused t128k5 6 CTAs).
// (HIP's __launch_bounds__ is a macro whose second argument means something else: HIP builds
// the entries without the minimum; the host picks them on CUDA only.)
#if defined(__HIPCC__)
#define BATCHINV_RMS_NORM_VECTOR_BOUNDS(THREADS, MIN_BLOCKS) __launch_bounds__(THREADS)
#else
#define BATCHINV_RMS_NORM_VECTOR_BOUNDS(THREADS, MIN_BLOCKS) __launch_bounds__(THREADS, MIN_BLOCKS)
#endif
// BOUNDS: the entry's BATCHINV_RMS_NORM_VECTOR_BOUNDS(Cta<T>::kThreads, MIN_BLOCKS).
#define BATCHINV_RMS_NORM_FORWARD_VECTOR_ENTRY(KIND, SUFFIX, GEOMETRY, CODEC, T, K, FUSED, BOUNDS) \
    extern "C" __global__ void BOUNDS rms_norm_##KIND##_##SUFFIX##_##GEOMETRY##_vec(             \
        CODEC::storage* y, CODEC::storage* new_residual, float* rstd, const CODEC::storage* x,   \
        const CODEC::storage* residual, const CODEC::storage* weight, int64_t rows, int64_t d,   \
        int64_t x_stride, int64_t residual_stride, float eps) {                                  \
        const batchinv::rms::ForwardArgs args{y,        new_residual, rstd, x,        residual,  \
                                              weight,   rows,         d,    x_stride,            \
                                              residual_stride, eps};                             \
        batchinv::grid_launch_dependents(); /* a prefetching small-M linear may start */         \
        batchinv::rms::forward_vector_kernel<CODEC, T, K, FUSED>(args);                          \
    }

#define BATCHINV_RMS_NORM_FORWARD_VECTOR_KERNELS(SUFFIX, CODEC)                                 \
    BATCHINV_RMS_NORM_FORWARD_VECTOR_ENTRY(forward, SUFFIX, t64, CODEC, 64, 8, false,            \
                                           BATCHINV_RMS_NORM_VECTOR_BOUNDS(128, 5))            \
    BATCHINV_RMS_NORM_FORWARD_VECTOR_ENTRY(fused_forward, SUFFIX, t64, CODEC, 64, 8, true,       \
                                           BATCHINV_RMS_NORM_VECTOR_BOUNDS(128, 4))            \
    BATCHINV_RMS_NORM_FORWARD_VECTOR_ENTRY(fused_forward, SUFFIX, t128k5, CODEC, 128, 5, true,   \
                                           BATCHINV_RMS_NORM_VECTOR_BOUNDS(128, 6))

// grad_x only (no grad_weight wanted, or rows the fused kernel below does not take).
#define BATCHINV_RMS_NORM_BACKWARD_ENTRY(SUFFIX, CODEC, GEOMETRY, T, K, STREAMING)               \
    extern "C" __global__ void __launch_bounds__(batchinv::rms::Cta<T>::kThreads)                \
        rms_norm_backward_##SUFFIX##_##GEOMETRY(                                                 \
            CODEC::storage* grad_x, const CODEC::storage* grad_y, const CODEC::storage* x,       \
            const CODEC::storage* weight, const float* rstd,                                     \
            const CODEC::storage* grad_residual, int64_t rows, int64_t d, int64_t x_stride) {    \
        const batchinv::rms::BackwardArgs args{grad_x,        grad_y, x, weight,  rstd,          \
                                               grad_residual, rows,   d, x_stride};              \
        batchinv::rms::backward_kernel<CODEC, T, K, STREAMING>(args);                            \
    }

// grad_x and grad_weight's first level in one pass (rows held in registers; see the header);
// CHUNKING: WeightGradChunk<T> (the geometry's first level) or another shape of it, named
// without commas.
// BOUNDS: __launch_bounds__(CHUNKING::kThreads), or with a minimum of CTAs per SM (t4 on CUDA).
#define BATCHINV_RMS_NORM_BACKWARD_WEIGHT_GRAD_ENTRY_BOUNDED(SUFFIX, CODEC, GEOMETRY, T, K,      \
                                                             CHUNKING, BOUNDS)                   \
    extern "C" __global__ void BOUNDS                                                            \
        rms_norm_backward_weight_grad_##SUFFIX##_##GEOMETRY(                                     \
            CODEC::storage* grad_x, float* partials, const CODEC::storage* grad_y,               \
            const CODEC::storage* x, const CODEC::storage* weight, const float* rstd,            \
            const CODEC::storage* grad_residual, int64_t rows, int64_t d, int64_t x_stride,      \
            unsigned* run_counters, unsigned generation) {                                       \
        const batchinv::rms::BackwardArgs args{grad_x,        grad_y, x, weight,  rstd,          \
                                               grad_residual, rows,   d, x_stride};              \
        batchinv::rms::backward_weight_grad_kernel<CODEC, T, K, CHUNKING>(                      \
            args, partials, batchinv::rms::RunCounters{run_counters, generation});               \
    }
#define BATCHINV_RMS_NORM_BACKWARD_WEIGHT_GRAD_ENTRY_SHAPED(SUFFIX, CODEC, GEOMETRY, T, K,       \
                                                            CHUNKING)                            \
    BATCHINV_RMS_NORM_BACKWARD_WEIGHT_GRAD_ENTRY_BOUNDED(SUFFIX, CODEC, GEOMETRY, T, K, CHUNKING, \
                                                         __launch_bounds__(CHUNKING::kThreads))
#define BATCHINV_RMS_NORM_BACKWARD_WEIGHT_GRAD_ENTRY(SUFFIX, CODEC, GEOMETRY, T, K)              \
    BATCHINV_RMS_NORM_BACKWARD_WEIGHT_GRAD_ENTRY_SHAPED(SUFFIX, CODEC, GEOMETRY, T, K,           \
                                                        batchinv::rms::WeightGradChunk<T>)
// t4 (q/k norm): held to kT4FusedBackwardMinBlocks CTAs per SM on CUDA (a name without commas:
// HIP's __launch_bounds__ is a macro, and its second argument means something else).
#if defined(__HIPCC__)
#define BATCHINV_RMS_NORM_T4_FUSED_BOUNDS __launch_bounds__(batchinv::rms::kMinCtaThreads)
#else
#define BATCHINV_RMS_NORM_T4_FUSED_BOUNDS \
    __launch_bounds__(batchinv::rms::kMinCtaThreads, batchinv::rms::kT4FusedBackwardMinBlocks)
#endif

#define BATCHINV_RMS_NORM_WEIGHT_GRAD_KERNELS(SUFFIX, CODEC)                                   \
    extern "C" __global__ void __launch_bounds__(256) rms_norm_weight_grad_partials_##SUFFIX( \
        float* partials, const CODEC::storage* grad_y, const CODEC::storage* x,                \
        const float* rstd, int64_t rows, int64_t d, int64_t x_stride, int64_t groups,          \
        int64_t in_sequence) {                                                                 \
        batchinv::rms::weight_grad_partials<CODEC>(partials, grad_y, x, rstd, rows, d,         \
                                                   x_stride, groups, in_sequence);             \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(                                            \
        batchinv::rms::kLastLevelsColumns * batchinv::rms::kLastLevelsRunSlots)                \
        rms_norm_weight_grad_last_levels_##SUFFIX(CODEC::storage* grad_weight,                 \
                                                  const float* partials,                       \
                                                  int64_t num_partials, int64_t d,             \
                                                  unsigned* run_counters,                      \
                                                  unsigned generation) {                       \
        batchinv::rms::weight_grad_last_levels<CODEC>(                                         \
            grad_weight, partials, num_partials, d,                                            \
            batchinv::rms::RunCounters{run_counters, generation});                             \
    }

// The geometry lists: (name, threads per row T, chunks per thread K).  Keep in step with
// GEOMETRIES and BACKWARD_GEOMETRIES in py/batchinv/gpu/rms_norm.py.  Forward: four chunks for
// the sub-warp rows (q/k norm); rows of 129 .. 256 chunks (bf16 hidden 2048) on 128 threads of 2
// chunks (measured faster than t64); eight from 64 threads up otherwise, so that each thread has
// 128 bytes in flight before the reduction (a row-per-CTA kernel with less is latency bound).
// t128k2 and t128k5 are t128 with room for 2 and 5 chunks: the same tree (a thread's chunks are
// c = lane + k*T in increasing k either way), fewer registers, more CTAs per SM.  Backward: the
// same, except that rows of 129 .. 512 chunks (bf16 hidden 2048 .. 4096) take t128k4 instead of
// t128k2 and t64 (t64's 8 chunks of x and dy per thread leave the fused backward latency bound).
#define BATCHINV_RMS_NORM_ALL_GEOMETRIES(SUFFIX, CODEC)                                          \
    BATCHINV_RMS_NORM_FORWARD_KERNELS(SUFFIX, CODEC, t4, 4, 4, false)                            \
    BATCHINV_RMS_NORM_FORWARD_KERNELS(SUFFIX, CODEC, t16, 16, 4, false)                          \
    BATCHINV_RMS_NORM_FORWARD_KERNELS(SUFFIX, CODEC, t32, 32, 4, false)                          \
    BATCHINV_RMS_NORM_FORWARD_KERNELS(SUFFIX, CODEC, t128k2, 128, 2, false)                      \
    BATCHINV_RMS_NORM_FORWARD_KERNELS(SUFFIX, CODEC, t64, 64, 8, false)                          \
    BATCHINV_RMS_NORM_FORWARD_KERNELS(SUFFIX, CODEC, t128k5, 128, 5, false)                      \
    BATCHINV_RMS_NORM_FORWARD_KERNELS(SUFFIX, CODEC, t128, 128, 8, false)                        \
    BATCHINV_RMS_NORM_FORWARD_KERNELS(SUFFIX, CODEC, t256, 256, 8, false)                        \
    BATCHINV_RMS_NORM_FORWARD_KERNELS(SUFFIX, CODEC, t512, 512, 8, false)                        \
    BATCHINV_RMS_NORM_FORWARD_KERNELS(SUFFIX, CODEC, stream, batchinv::rms::kStreamingThreads,   \
                                      batchinv::rms::kStreamingChunks, true)                     \
    BATCHINV_RMS_NORM_BACKWARD_ENTRY(SUFFIX, CODEC, t4, 4, 4, false)                             \
    BATCHINV_RMS_NORM_BACKWARD_ENTRY(SUFFIX, CODEC, t16, 16, 4, false)                           \
    BATCHINV_RMS_NORM_BACKWARD_ENTRY(SUFFIX, CODEC, t32, 32, 4, false)                           \
    BATCHINV_RMS_NORM_BACKWARD_ENTRY(SUFFIX, CODEC, t128k4, 128, 4, false)                       \
    BATCHINV_RMS_NORM_BACKWARD_ENTRY(SUFFIX, CODEC, t128k5, 128, 5, false)                       \
    BATCHINV_RMS_NORM_BACKWARD_ENTRY(SUFFIX, CODEC, t128, 128, 8, false)                         \
    BATCHINV_RMS_NORM_BACKWARD_ENTRY(SUFFIX, CODEC, t256, 256, 8, false)                         \
    BATCHINV_RMS_NORM_BACKWARD_ENTRY(SUFFIX, CODEC, t512, 512, 8, false)                         \
    BATCHINV_RMS_NORM_BACKWARD_ENTRY(SUFFIX, CODEC, stream, batchinv::rms::kStreamingThreads,    \
                                     batchinv::rms::kStreamingBackwardChunks, true)              \
    BATCHINV_RMS_NORM_WEIGHT_GRAD_KERNELS(SUFFIX, CODEC)

extern "C" __global__ void __launch_bounds__(256) rms_norm_weight_grad_reduce(
    float* rows_out, const float* rows_in, int64_t num_rows_in, int64_t d) {
    batchinv::rms::weight_grad_reduce(rows_out, rows_in, num_rows_in, d);
}

BATCHINV_RMS_NORM_ALL_GEOMETRIES(bf16, batchinv::Bf16Codec)
BATCHINV_RMS_NORM_ALL_GEOMETRIES(f16, batchinv::F16Codec)
BATCHINV_RMS_NORM_ALL_GEOMETRIES(f32, batchinv::F32Codec)
BATCHINV_RMS_NORM_FORWARD_VECTOR_KERNELS(bf16, batchinv::Bf16Codec)
BATCHINV_RMS_NORM_FORWARD_VECTOR_KERNELS(f16, batchinv::F16Codec)
BATCHINV_RMS_NORM_FORWARD_VECTOR_KERNELS(f32, batchinv::F32Codec)

// The fused backward for the geometries whose per-column sums fit kWeightGradSharedBytes
// (CTA threads * K * 16 bytes); longer rows take grad_x and the column pass separately.
#define BATCHINV_RMS_NORM_FUSED_BACKWARD_UP_TO_T128(SUFFIX, CODEC)                     \
    BATCHINV_RMS_NORM_BACKWARD_WEIGHT_GRAD_ENTRY_BOUNDED(SUFFIX, CODEC, t4, 4, 4,      \
        batchinv::rms::WeightGradChunk<4>, BATCHINV_RMS_NORM_T4_FUSED_BOUNDS)          \
    BATCHINV_RMS_NORM_BACKWARD_WEIGHT_GRAD_ENTRY(SUFFIX, CODEC, t16, 16, 4)            \
    BATCHINV_RMS_NORM_BACKWARD_WEIGHT_GRAD_ENTRY(SUFFIX, CODEC, t32, 32, 4)            \
    BATCHINV_RMS_NORM_BACKWARD_WEIGHT_GRAD_ENTRY(SUFFIX, CODEC, t128k4, 128, 4)        \
    BATCHINV_RMS_NORM_BACKWARD_WEIGHT_GRAD_ENTRY(SUFFIX, CODEC, t128k5, 128, 5)        \
    BATCHINV_RMS_NORM_BACKWARD_WEIGHT_GRAD_ENTRY(SUFFIX, CODEC, t128, 128, 8)

BATCHINV_RMS_NORM_FUSED_BACKWARD_UP_TO_T128(bf16, batchinv::Bf16Codec)
BATCHINV_RMS_NORM_FUSED_BACKWARD_UP_TO_T128(f16, batchinv::F16Codec)
BATCHINV_RMS_NORM_FUSED_BACKWARD_UP_TO_T128(f32, batchinv::F32Codec)
BATCHINV_RMS_NORM_BACKWARD_WEIGHT_GRAD_ENTRY(f32, batchinv::F32Codec, t256, 256, 8)
// t128k4 in 256-thread CTAs of two row groups, 16 rows each (a partial row of 2 x 16 rows), for
// bf16 and fp32 from 16384 rows on (the host decides).  Not fp16: ptxas gives its entry 164
// registers, one CTA per SM, which measures slower.
BATCHINV_RMS_NORM_BACKWARD_WEIGHT_GRAD_ENTRY_SHAPED(bf16, batchinv::Bf16Codec, t128k4g2, 128, 4,
                                                    batchinv::rms::TwoGroupsT128)
BATCHINV_RMS_NORM_BACKWARD_WEIGHT_GRAD_ENTRY_SHAPED(f32, batchinv::F32Codec, t128k4g2, 128, 4,
                                                    batchinv::rms::TwoGroupsT128)
// t128k5 (bf16/fp16 hidden 5120, fp32 2048 < d <= 2560) likewise, in every dtype, from 8192 rows
// on (measured faster than 1 x 16 from there on: docs/tuning/rms_norm.md; 125 / 128 / 98
// registers, so 2 CTAs (4 row groups) per SM as t128k5's 4 CTAs of one in bf16 and fp16).
BATCHINV_RMS_NORM_BACKWARD_WEIGHT_GRAD_ENTRY_SHAPED(bf16, batchinv::Bf16Codec, t128k5g2, 128, 5,
                                                    batchinv::rms::TwoGroupsT128)
BATCHINV_RMS_NORM_BACKWARD_WEIGHT_GRAD_ENTRY_SHAPED(f16, batchinv::F16Codec, t128k5g2, 128, 5,
                                                    batchinv::rms::TwoGroupsT128)
BATCHINV_RMS_NORM_BACKWARD_WEIGHT_GRAD_ENTRY_SHAPED(f32, batchinv::F32Codec, t128k5g2, 128, 5,
                                                    batchinv::rms::TwoGroupsT128)

// SiLU-and-multiply (SwiGLU), forward and backward.
//
// Forward   out = silu(gate) * up,  silu(g) = g / (1 + exp(-g))
//   gate, up  [rows, I]  bf16/fp16/fp32, unit stride along I, row strides gate_stride and
//                        up_stride in elements (the fused [rows, 2I] layout is gate = base,
//                        up = base + I, both with stride 2I)
//   out       [rows, I]  same dtype, row stride out_stride
//   fp32 arithmetic (silu_mul_value):
//     e = ex2.approx.ftz(g * -log2 e), s = rcp.approx.ftz(fma(e, 0.25, 0.25)) * 0.25,
//     out = (g * s) * up, every step one explicit operation; one rounding to the storage type.
//   ex2/rcp.approx are the GPU's special-function approximations (not IEEE): a fixed function
//   of the element on a given GPU, within the elementwise tolerance of the fp32 reference for
//   every fp32 gate value (checked on an H200, docs/operators/silu_mul.md).
//
// Backward  e = expf(-g), s = 1 / (1 + e)   (the accurate expf and IEEE division, unchanged)
//           grad_gate = (grad_out * up) * (s * (1 + g * (1 - s)))
//           grad_up   = grad_out * (g / (1 + e))
//   grad_out [rows, I] (stride grad_stride), gate/up as above; grad_gate and grad_up written
//   with their own row strides (the fused backward writes both halves of one [rows, 2I]).
//
// Launch: block = 128 threads; grid.x = rows * tiles_per_row.  CTA b works on row
// b / tiles_per_row, elements [tile * tile_elements, (tile + 1) * tile_elements) of it
// (tile_elements a multiple of 8 * 128, so a tile is whole 16-byte chunks for every dtype;
// at most 2048 forward and backward, so that a bf16 thread loads all its kUnroll /
// kBackwardUnroll chunks of each input at once),
// processed in 16-byte chunks on the vector path and one element at a time otherwise.
//
// Why the bits cannot depend on the batch: there is no reduction.  Every output element is
// one call of silu_mul_value / silu_mul_grads on its own inputs, the same function on every
// path (vector body or element loop, any CTA, any grid size), written with explicit IEEE
// intrinsics so that no path can contract a multiply and an add differently.  The vector path
// is taken when all pointers, row strides and I*sizeof are multiples of 16 bytes; either path
// computes the same per-element function (the forward's is one instruction sequence for every
// element).  The vector path rounds bf16 with the hardware conversion, the element path with
// float_to_bf16: the same bits (common/chunk16.cuh).  The backward's vector path divides
// without nvcc's per-element operand check when all gate values of a chunk are in range
// (in_fast_division_range), so which instructions an element takes depends on its chunk's
// other gate values; both give __fdiv_rn's bits (compared for every fp32, bf16 and fp16 gate
// value on an H200; tests/gpu/test_silu_mul_cuda.py checks them side by side).
#include "common/approx.cuh"
#include "common/chunk16.cuh"
#include "common/grid_dependency.cuh"
#include "common/portability.cuh"


namespace batchinv {
namespace silu {


constexpr int kThreads = 128;
// Forward: 16-byte chunks of each input per thread loaded before use.  2 chunks (tiles of 2048,
// 48 registers, 10 CTAs per SM) measure faster than 4 (64 registers, 8 CTAs) with this
// arithmetic (docs/tuning/silu_mul.md).
constexpr int kUnroll = 2;
// Backward: 2 chunks of each of its 3 inputs (6 in flight); with 4 the 89 registers per thread
// hold 5 CTAs per SM instead of 8 and it measures slower.
constexpr int kBackwardUnroll = 2;
// Register caps (CTAs of 128 threads per SM): the backward at 8 (64 registers) measures no
// slower than at 7 (docs/tuning/silu_mul.md).  The forward needs 48 at 8 (no spill; 10 CTAs
// per SM resident).
constexpr int kForwardMinCtasPerSm = 8;
constexpr int kBackwardMinCtasPerSm = 8;

// The backward vector path's cheaper division for the same functions.  nvcc compiles each
// __fdiv_rn into a reciprocal, five FMAs and an operand check (FCHK) branching to a slow path;
// the branch, its reconvergence and the constants reloaded around the call cost a sixth
// (forward) to a quarter (backward) of the kernel's instructions (profiles in
// docs/tuning/silu_mul.md).  div_rn_checked_range runs the same reciprocal and FMAs without
// the check, for operands where that sequence is the correctly rounded quotient: a chunk whose
// gate values all pass in_fast_division_range, 2^-60 <= |g| <= 40 (so the numerator g or 1 and
// the denominator 1 + exp(-g) in [1, 2.4e17] are normal and far from overflow and underflow).  A chunk with any
// gate value outside (zero, tiny, large, inf, NaN) takes the checked division (kInRange = false).
// Both give the bits of __fdiv_rn: compared on the device for all 2^32 fp32 gate patterns
// and every bf16/fp16 one, forward and backward (docs/tuning/silu_mul.md).
__device__ __forceinline__ bool in_fast_division_range(float g) {
    return fabsf(g) >= 0x1p-60f && fabsf(g) <= 40.0f;
}

__device__ __forceinline__ float div_rn_checked_range(float n, float d) {
#if defined(__HIPCC__)
    return __fdiv_rn(n, d);
#else
    return divide_in_range(n, d, divisor_reciprocal(d));  // common/approx.cuh
#endif
}

// n / d with __fdiv_rn's bits: the checked division, or (kInRange) the unchecked sequence for a
// chunk whose gate values all pass in_fast_division_range.
template <bool kInRange>
__device__ __forceinline__ float silu_div(float n, float d) {
    if constexpr (kInRange) return div_rn_checked_range(n, d);
    return __fdiv_rn(n, d);
}


// The forward's function of one element, on every path (vector body, element loop, any CTA):
//   e   = exp2_ftz(g * -log2(e))         2^x of the rounded product (e^-g, x rounded once)
//   r4  = rcp_ftz(fma(e, 0.25, 0.25))    4 / (1 + e): (1 + e) / 4 rounded once, >= 0.25
//   s   = r4 * 0.25                      1 / (1 + e): exact, or rounded where subnormal
//   out = (g * s) * u                    silu(g) rounded, times up rounded
// exp2_ftz and rcp_ftz are the special function unit's (common/approx.cuh); HIP's
// approximations differ, so HIP bits differ from CUDA bits (as expf's do).
// The quarter keeps the reciprocal normal for every finite 1 + e (< 2^128), so silu(g) of
// -88.7 < g < -87.3 (1 + e > 2^126) is ~-1e-36, not a flushed -0.  Special values: e = inf
// (g < -88.7) gives s = 0, silu = -0; g = -inf gives NaN (-inf * 0); g = +inf gives e = 0,
// s = 1, silu = inf; +-0 and subnormal g give g * 0.5 (e = 1, r4 = 2 exactly); NaN stays NaN.
// Error: __expf's (2 + 1.17 |g| ulp in e, from rounding g * log2 e) times e / (1 + e), plus
// the reciprocal's and four roundings: measured over all 2^32 fp32 gate values with up = 1 on
// an H200, at most 3.1 ulp for g > -1, 4 ulp for g > -2, growing to 67 ulp near g = -88 where
// silu(g) ~ g e^g is tiny (expf and __fdiv_rn: 3.4 ulp), every value within the contract's
// elementwise fp32 tolerance (docs/operators/silu_mul.md).  7 instructions per element, where
// expf and IEEE division take 19.
__device__ __forceinline__ float silu_mul_value(float g, float u) {
    const float e = exp2_ftz(ieee_mul(g, -kLog2e));
    const float quarter_d = __fmaf_rn(e, 0.25f, 0.25f);
    const float s = ieee_mul(rcp_ftz(quarter_d), 0.25f);
    return ieee_mul(ieee_mul(g, s), u);
}

template <bool kInRange = false>
__device__ __forceinline__ void silu_mul_grads(float grad, float g, float u, float& grad_gate,
                                               float& grad_up) {
    const float one_plus_e = ieee_add(1.0f, expf(-g));
    const float s = silu_div<kInRange>(1.0f, one_plus_e);
    const float dsilu = ieee_mul(s, ieee_add(1.0f, ieee_mul(g, ieee_sub(1.0f, s))));
    grad_gate = ieee_mul(ieee_mul(grad, u), dsilu);
    grad_up = ieee_mul(grad, silu_div<kInRange>(g, one_plus_e));
}

template <typename Codec>
__device__ __forceinline__ bool chunk_in_fast_division_range(const float (&g)[Chunk16<Codec>::kElems]) {
    bool in_range = true;
#pragma unroll
    for (int e = 0; e < Chunk16<Codec>::kElems; ++e) in_range &= in_fast_division_range(g[e]);
    return in_range;
}

// A chunk's elements in fp32.  bf16 on CUDA: from the chunk's 32-bit words (the high element is
// the word with its low half cleared, one instruction instead of a shift of the extracted half);
// the same values as Codec::load.
template <typename Codec>
__device__ __forceinline__ void unpack_chunk(const Chunk16<Codec>& c, float (&f)[Chunk16<Codec>::kElems]) {
    constexpr int E = Chunk16<Codec>::kElems;
#if !defined(__HIPCC__)
    constexpr bool kWordwiseBf16 = Codec::kIsBf16;
#else
    constexpr bool kWordwiseBf16 = false;
#endif
    if constexpr (kWordwiseBf16) {
        const uint32_t* words = reinterpret_cast<const uint32_t*>(c.v);
#pragma unroll
        for (int w = 0; w < E / 2; ++w) {
            f[2 * w] = __uint_as_float(words[w] << 16);
            f[2 * w + 1] = __uint_as_float(words[w] & 0xffff0000u);
        }
    } else {
#pragma unroll
        for (int e = 0; e < E; ++e) f[e] = Codec::load(c.v[e]);
    }
}

// store_chunk's bits.  bf16 on CUDA: a chunk without NaN is packed by the paired conversion alone
// (store_chunk tests every pair for NaN to write PyTorch's 0x7fc0); a chunk with one goes
// through store_chunk.
template <typename Codec>
__device__ __forceinline__ void store_result_chunk(typename Codec::storage* p,
                                                   const float (&f)[Chunk16<Codec>::kElems]) {
    constexpr int E = Chunk16<Codec>::kElems;
#if !defined(__HIPCC__)
    if constexpr (Codec::kIsBf16) {
        uint4 words;
        if (cvt_bf16_chunk_without_nan<E>(reinterpret_cast<uint32_t*>(&words), f)) {
            *reinterpret_cast<uint4*>(p) = words;
            return;
        }
    }
#endif
    store_chunk<Codec>(p, f);
}

// The CTA's tile: row blockIdx.x / tiles_per_row, units [tile * tile_units, +tile_units) of
// that row, a unit being a 16-byte chunk (vector path) or one element.  The host gives the
// tile in elements, a multiple of every chunk size.
struct Tile {
    int64_t row;
    int64_t first;
    int64_t end;
};

__device__ __forceinline__ Tile tile_of(int64_t tiles_per_row, int64_t tile_units, int64_t row_units) {
    const int64_t block = blockIdx.x;
    const int64_t row = block / tiles_per_row;
    const int64_t first = (block - row * tiles_per_row) * tile_units;
    const int64_t end = first + tile_units < row_units ? first + tile_units : row_units;
    return {row, first, end};
}

struct ForwardArgs {
    void* out;
    const void* gate;
    const void* up;
    int64_t rows;
    int64_t inter;
    int64_t out_stride;
    int64_t gate_stride;
    int64_t up_stride;
    int64_t tiles_per_row;
    int64_t tile_elements;
};

template <typename Codec>
__device__ __forceinline__ void forward(const ForwardArgs& a) {
    using S = typename Codec::storage;
    constexpr int E = Chunk16<Codec>::kElems;
    const bool vector = aligned16(a.out) && aligned16(a.gate) && aligned16(a.up) &&
                        stride_aligned16<S>(a.out_stride) && stride_aligned16<S>(a.gate_stride) &&
                        stride_aligned16<S>(a.up_stride) && stride_aligned16<S>(a.inter);
    const int64_t row_units = vector ? a.inter / E : a.inter;
    const Tile t = tile_of(a.tiles_per_row, vector ? a.tile_elements / E : a.tile_elements, row_units);
    if (t.row >= a.rows) return;
    S* out = static_cast<S*>(a.out) + t.row * a.out_stride;
    const S* gate = static_cast<const S*>(a.gate) + t.row * a.gate_stride;
    const S* up = static_cast<const S*>(a.up) + t.row * a.up_stride;
    constexpr int64_t kStep = static_cast<int64_t>(kThreads) * kUnroll;
    if (vector) {
        for (int64_t base = t.first + threadIdx.x; base < t.end; base += kStep) {
            Chunk16<Codec> g[kUnroll], u[kUnroll];
#pragma unroll
            for (int k = 0; k < kUnroll; ++k) {
                const int64_t unit = base + k * kThreads;
                if (unit >= t.end) continue;
                load_chunk(g[k], gate + unit * E);
                load_chunk(u[k], up + unit * E);
            }
#pragma unroll
            for (int k = 0; k < kUnroll; ++k) {
                const int64_t unit = base + k * kThreads;
                if (unit >= t.end) continue;
                float gf[E], uf[E], o[E];
                unpack_chunk<Codec>(g[k], gf);
                unpack_chunk<Codec>(u[k], uf);
#pragma unroll
                for (int e = 0; e < E; ++e) o[e] = silu_mul_value(gf[e], uf[e]);
                store_result_chunk<Codec>(out + unit * E, o);
            }
        }
    } else {
        for (int64_t base = t.first + threadIdx.x; base < t.end; base += kStep) {
            float g[kUnroll], u[kUnroll];
#pragma unroll
            for (int k = 0; k < kUnroll; ++k) {
                const int64_t j = base + static_cast<int64_t>(k) * kThreads;
                if (j >= t.end) continue;
                g[k] = Codec::load(gate[j]);
                u[k] = Codec::load(up[j]);
            }
#pragma unroll
            for (int k = 0; k < kUnroll; ++k) {
                const int64_t j = base + static_cast<int64_t>(k) * kThreads;
                if (j < t.end) out[j] = Codec::store(silu_mul_value(g[k], u[k]));
            }
        }
    }
}

struct BackwardArgs {
    void* grad_gate;
    void* grad_up;
    const void* grad_out;
    const void* gate;
    const void* up;
    int64_t rows;
    int64_t inter;
    int64_t grad_gate_stride;
    int64_t grad_up_stride;
    int64_t grad_out_stride;
    int64_t gate_stride;
    int64_t up_stride;
    int64_t tiles_per_row;
    int64_t tile_elements;
};

template <typename Codec>
__device__ __forceinline__ void backward(const BackwardArgs& a) {
    using S = typename Codec::storage;
    constexpr int E = Chunk16<Codec>::kElems;
    const bool vector = aligned16(a.grad_gate) && aligned16(a.grad_up) && aligned16(a.grad_out) &&
                        aligned16(a.gate) && aligned16(a.up) && stride_aligned16<S>(a.grad_gate_stride) &&
                        stride_aligned16<S>(a.grad_up_stride) && stride_aligned16<S>(a.grad_out_stride) &&
                        stride_aligned16<S>(a.gate_stride) && stride_aligned16<S>(a.up_stride) &&
                        stride_aligned16<S>(a.inter);
    const int64_t row_units = vector ? a.inter / E : a.inter;
    const Tile t = tile_of(a.tiles_per_row, vector ? a.tile_elements / E : a.tile_elements, row_units);
    if (t.row >= a.rows) return;
    S* grad_gate = static_cast<S*>(a.grad_gate) + t.row * a.grad_gate_stride;
    S* grad_up = static_cast<S*>(a.grad_up) + t.row * a.grad_up_stride;
    const S* grad_out = static_cast<const S*>(a.grad_out) + t.row * a.grad_out_stride;
    const S* gate = static_cast<const S*>(a.gate) + t.row * a.gate_stride;
    const S* up = static_cast<const S*>(a.up) + t.row * a.up_stride;
    constexpr int64_t kStep = static_cast<int64_t>(kThreads) * kBackwardUnroll;
    if (vector) {
        for (int64_t base = t.first + threadIdx.x; base < t.end; base += kStep) {
            Chunk16<Codec> dy[kBackwardUnroll], g[kBackwardUnroll], u[kBackwardUnroll];
#pragma unroll
            for (int k = 0; k < kBackwardUnroll; ++k) {
                const int64_t unit = base + k * kThreads;
                if (unit >= t.end) continue;
                load_chunk(dy[k], grad_out + unit * E);
                load_chunk(g[k], gate + unit * E);
                load_chunk(u[k], up + unit * E);
            }
#pragma unroll
            for (int k = 0; k < kBackwardUnroll; ++k) {
                const int64_t unit = base + k * kThreads;
                if (unit >= t.end) continue;
                float dyf[E], gf[E], uf[E], gg[E], gu[E];
                unpack_chunk<Codec>(dy[k], dyf);
                unpack_chunk<Codec>(g[k], gf);
                unpack_chunk<Codec>(u[k], uf);
                if (chunk_in_fast_division_range<Codec>(gf)) {
#pragma unroll
                    for (int e = 0; e < E; ++e) silu_mul_grads<true>(dyf[e], gf[e], uf[e], gg[e], gu[e]);
                } else {
#pragma unroll
                    for (int e = 0; e < E; ++e) silu_mul_grads(dyf[e], gf[e], uf[e], gg[e], gu[e]);
                }
                store_result_chunk<Codec>(grad_gate + unit * E, gg);
                store_result_chunk<Codec>(grad_up + unit * E, gu);
            }
        }
    } else {
        for (int64_t base = t.first + threadIdx.x; base < t.end; base += kStep) {
            float dy[kBackwardUnroll], g[kBackwardUnroll], u[kBackwardUnroll];
#pragma unroll
            for (int k = 0; k < kBackwardUnroll; ++k) {
                const int64_t j = base + static_cast<int64_t>(k) * kThreads;
                if (j >= t.end) continue;
                dy[k] = Codec::load(grad_out[j]);
                g[k] = Codec::load(gate[j]);
                u[k] = Codec::load(up[j]);
            }
#pragma unroll
            for (int k = 0; k < kBackwardUnroll; ++k) {
                const int64_t j = base + static_cast<int64_t>(k) * kThreads;
                if (j >= t.end) continue;
                float dg, du;
                silu_mul_grads(dy[k], g[k], u[k], dg, du);
                grad_gate[j] = Codec::store(dg);
                grad_up[j] = Codec::store(du);
            }
        }
    }
}

}  // namespace silu
}  // namespace batchinv

#define BATCHINV_SILU_MUL_KERNELS(SUFFIX, CODEC)                                              \
    extern "C" __global__ void __launch_bounds__(batchinv::silu::kThreads, batchinv::silu::kForwardMinCtasPerSm) silu_mul_forward_##SUFFIX(               \
        CODEC::storage* out, const CODEC::storage* gate, const CODEC::storage* up, int64_t rows, \
        int64_t inter, int64_t out_stride, int64_t gate_stride, int64_t up_stride,              \
        int64_t tiles_per_row, int64_t tile_elements) {                                            \
        const batchinv::silu::ForwardArgs args{out,        gate,        up,        rows,        \
                                               inter,      out_stride,  gate_stride, up_stride, \
                                               tiles_per_row, tile_elements};                      \
        batchinv::grid_launch_dependents(); /* a prefetching small-M linear may start */       \
        batchinv::silu::forward<CODEC>(args);                                                   \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(batchinv::silu::kThreads, batchinv::silu::kBackwardMinCtasPerSm) silu_mul_backward_##SUFFIX(              \
        CODEC::storage* grad_gate, CODEC::storage* grad_up, const CODEC::storage* grad_out,      \
        const CODEC::storage* gate, const CODEC::storage* up, int64_t rows, int64_t inter,       \
        int64_t grad_gate_stride, int64_t grad_up_stride, int64_t grad_out_stride,               \
        int64_t gate_stride, int64_t up_stride, int64_t tiles_per_row, int64_t tile_elements) {     \
        const batchinv::silu::BackwardArgs args{grad_gate,       grad_up,        grad_out,       \
                                                gate,            up,             rows,           \
                                                inter,           grad_gate_stride, grad_up_stride, \
                                                grad_out_stride, gate_stride,    up_stride,      \
                                                tiles_per_row,   tile_elements};                    \
        batchinv::silu::backward<CODEC>(args);                                                  \
    }

BATCHINV_SILU_MUL_KERNELS(bf16, batchinv::Bf16Codec)
BATCHINV_SILU_MUL_KERNELS(f16, batchinv::F16Codec)
BATCHINV_SILU_MUL_KERNELS(f32, batchinv::F32Codec)

// SiLU-and-multiply (SwiGLU), forward and backward.
//
// Forward   out = silu(gate) * up,  silu(g) = g / (1 + exp(-g))
//   gate, up  [rows, I]  bf16/fp16/fp32, unit stride along I, row strides gate_stride and
//                        up_stride in elements (the fused [rows, 2I] layout is gate = base,
//                        up = base + I, both with stride 2I)
//   out       [rows, I]  same dtype, row stride out_stride
//   fp32 arithmetic: e = expf(-g) (the accurate expf, no fast math), 1 + e, g / (1 + e),
//   times up, each an explicit IEEE intrinsic; one rounding to the storage type.
//
// Backward  e = expf(-g), s = 1 / (1 + e)
//           grad_gate = (grad_out * up) * (s * (1 + g * (1 - s)))
//           grad_up   = grad_out * (g / (1 + e))
//   grad_out [rows, I] (stride grad_stride), gate/up as above; grad_gate and grad_up written
//   with their own row strides (the fused backward writes both halves of one [rows, 2I]).
//
// Launch: block = 128 threads; grid.x = rows * tiles_per_row.  CTA b works on row
// b / tiles_per_row, elements [tile * tile_elements, (tile + 1) * tile_elements) of it
// (tile_elements a multiple of 8 * 128, so a tile is whole 16-byte chunks for every dtype;
// at most 4096 forward and 2048 backward, so that a bf16 thread loads all its kUnroll /
// kBackwardUnroll chunks of each input at once),
// processed in 16-byte chunks on the vector path and one element at a time otherwise.
//
// Why the bits cannot depend on the batch: there is no reduction.  Every output element is
// one call of silu_mul_value / silu_mul_grads on its own inputs, the same function on every
// path (vector body or element loop, any CTA, any grid size), written with explicit IEEE
// intrinsics so that no path can contract a multiply and an add differently.  The vector path
// is taken when all pointers, row strides and I*sizeof are multiples of 16 bytes; either path
// computes the same per-element function.  The vector path rounds bf16 with the hardware
// conversion, the element path with float_to_bf16: the same bits (common/chunk16.cuh).
#include "common/chunk16.cuh"
#include "common/portability.cuh"


namespace batchinv {
namespace silu {


constexpr int kThreads = 128;
constexpr int kUnroll = 4;  // forward: 16-byte chunks of each input per thread loaded before use
// Backward: 2 chunks of each of its 3 inputs (6 in flight); with 4 the 89 registers per thread
// held 5 CTAs per SM instead of 8 and it ran 6% slower (H200, 16384 x 4096 bf16).
constexpr int kBackwardUnroll = 2;

__device__ __forceinline__ float silu_mul_value(float g, float u) {
    const float e = expf(-g);
    return ieee_mul(__fdiv_rn(g, ieee_add(1.0f, e)), u);
}

__device__ __forceinline__ void silu_mul_grads(float grad, float g, float u, float& grad_gate,
                                               float& grad_up) {
    const float one_plus_e = ieee_add(1.0f, expf(-g));
    const float s = __fdiv_rn(1.0f, one_plus_e);
    const float dsilu = ieee_mul(s, ieee_add(1.0f, ieee_mul(g, ieee_sub(1.0f, s))));
    grad_gate = ieee_mul(ieee_mul(grad, u), dsilu);
    grad_up = ieee_mul(grad, __fdiv_rn(g, one_plus_e));
}

__device__ __forceinline__ bool aligned16(const void* p) {
    return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

template <typename S>
__device__ __forceinline__ bool stride_aligned16(int64_t elements) {
    return ((elements * static_cast<int64_t>(sizeof(S))) & 15) == 0;
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
                float o[E];
#pragma unroll
                for (int e = 0; e < E; ++e) o[e] = silu_mul_value(Codec::load(g[k].v[e]), Codec::load(u[k].v[e]));
                store_chunk<Codec>(out + unit * E, o);
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
                float gg[E], gu[E];
#pragma unroll
                for (int e = 0; e < E; ++e) {
                    silu_mul_grads(Codec::load(dy[k].v[e]), Codec::load(g[k].v[e]), Codec::load(u[k].v[e]),
                                   gg[e], gu[e]);
                }
                store_chunk<Codec>(grad_gate + unit * E, gg);
                store_chunk<Codec>(grad_up + unit * E, gu);
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
    extern "C" __global__ void __launch_bounds__(batchinv::silu::kThreads) silu_mul_forward_##SUFFIX(               \
        CODEC::storage* out, const CODEC::storage* gate, const CODEC::storage* up, int64_t rows, \
        int64_t inter, int64_t out_stride, int64_t gate_stride, int64_t up_stride,              \
        int64_t tiles_per_row, int64_t tile_elements) {                                            \
        const batchinv::silu::ForwardArgs args{out,        gate,        up,        rows,        \
                                               inter,      out_stride,  gate_stride, up_stride, \
                                               tiles_per_row, tile_elements};                      \
        batchinv::silu::forward<CODEC>(args);                                                   \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(batchinv::silu::kThreads) silu_mul_backward_##SUFFIX(              \
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

// batchinv-signature: silu_mul_forward_bf16(ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64)
// batchinv-signature: silu_mul_backward_bf16(ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, i64, i64)
BATCHINV_SILU_MUL_KERNELS(bf16, batchinv::Bf16Codec)
// batchinv-signature: silu_mul_forward_f16(ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64)
// batchinv-signature: silu_mul_backward_f16(ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, i64, i64)
BATCHINV_SILU_MUL_KERNELS(f16, batchinv::F16Codec)
// batchinv-signature: silu_mul_forward_f32(ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64)
// batchinv-signature: silu_mul_backward_f32(ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, i64, i64)
BATCHINV_SILU_MUL_KERNELS(f32, batchinv::F32Codec)

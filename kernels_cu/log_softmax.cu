// Log-softmax over the last dimension for large vocabularies, forward and backward.
//
// Forward, per row x of length V (fp32 statistics):
//   The row is cut into groups of kGroup = 8 consecutive elements; group g belongs to thread
//   g % T of the row's CTA, and a thread visits its groups in increasing g.
//   Group state:  m_g = max of its elements (+0.0 added, so a -0 maximum becomes +0),
//                 l_g = sum in element order of expf(x - shift_g), shift_g = m_g, or 0 when
//                 m_g = -inf (no -inf - -inf).
//   Merge:        m = max(m_a, m_b); shift = m or 0 if m = -inf;
//                 l = l_a * expf(m_a - shift) + l_b * expf(m_b - shift)
//   A thread merges its groups left to right into (m, l), starting from (-inf, 0), which the
//   merge leaves unchanged.  The T thread states are merged by a butterfly inside each warp
//   (xor offsets W/2 .. 1; the merge is symmetric in its operands, so every lane ends with the
//   same bits) and the per-warp states in warp order.
//   lse = m + logf(l);  out = x - lse, or -inf everywhere when lse = -inf (a row of all -inf),
//   rounded once to the output dtype.  lse is written to lse[row] (fp32) for the backward.
//   expf/logf are the accurate ones (no fast math); every step is an explicit IEEE intrinsic.
// Backward: dx = dy - expf(x - lse) * sum(dy), zero in rows whose lse is -inf; sum(dy) in the
//   same layout: per thread over its groups in index order, then the same butterfly and warp
//   order; rounded once to x's dtype.
//
//   x    [rows, V]  bf16/fp16/fp32, unit stride along V, row stride x_stride (elements)
//   out  [rows, V]  bf16/fp16/fp32 (the output dtype; fp32 by default), contiguous
//   lse  [rows]     fp32
//   dy   [rows, V]  the output dtype, contiguous;  dx [rows, V] x's dtype, contiguous
//   Launch: grid.x = rows (one CTA per row), block = T from {128, 512, 1024}: the host picks it
//   from V alone.  Dynamic shared memory = smem_groups * T groups (see "where a row lives").
//
// Where a row lives (this changes speed, never bits): a thread keeps its first kRegGroups
// groups in registers, the next smem_groups in shared memory, and reads any further ones from
// global memory again in the second pass.  Which tier holds a group does not change the
// arithmetic above, which is defined on element indices only; nor does the load width (16-byte
// vectors when V % 8 == 0 and the pointers and row stride are 16-byte aligned, the same for
// every row of a launch; single elements otherwise).
//
// Why a row's bits cannot depend on the batch: the grid is one CTA per row, T and the group
// layout follow from V only, and nothing a CTA computes reads another row.
#include "common/portability.cuh"


namespace batchinv {
namespace lsm {


constexpr int kGroup = 8;
// Groups loaded before use in the shared-memory and global tiers: 64 bytes per thread.
template <typename Codec>
struct Unroll {
    static constexpr int value = 64 / static_cast<int>(sizeof(typename Codec::storage) * 8);
};
constexpr int kBackwardUnroll = 2;  // the backward holds grad_out and x groups: fewer at once
constexpr int kMaxWarps = 1024 / BATCHINV_WARP_SIZE;

template <typename Codec>
struct alignas(16) Group {
    typename Codec::storage v[kGroup];
    static constexpr int kWords = static_cast<int>(sizeof(typename Codec::storage)) * kGroup / 16;
};

// Groups a thread keeps in registers: 16 registers' worth of storage (with more, a 512- or
// 1024-thread CTA would exceed 64 registers per thread and spill or halve the occupancy).
template <typename Codec>
struct RegGroups {
    static constexpr int value = 64 / static_cast<int>(sizeof(Group<Codec>));
};

struct State {
    float m;
    float l;
};

__device__ __forceinline__ float shift_of(float m) { return m == -INFINITY ? 0.0f : m; }

__device__ __forceinline__ State merge(State a, State b) {
    const float m = fmaxf(a.m, b.m);
    const float shift = shift_of(m);
    const float l = ieee_add(ieee_mul(a.l, expf(ieee_sub(a.m, shift))),
                              ieee_mul(b.l, expf(ieee_sub(b.m, shift))));
    return {m, l};
}

template <typename Codec>
__device__ __forceinline__ State group_state(const Group<Codec>& g, int valid) {
    float m = -INFINITY;
#pragma unroll
    for (int e = 0; e < kGroup; ++e) {
        if (e < valid) m = fmaxf(m, Codec::load(g.v[e]));
    }
    m = ieee_add(m, 0.0f);  // -0 -> +0: the sign of a zero maximum is canonical
    const float shift = shift_of(m);
    float l = 0.0f;
#pragma unroll
    for (int e = 0; e < kGroup; ++e) {
        if (e < valid) l = ieee_add(l, expf(ieee_sub(Codec::load(g.v[e]), shift)));
    }
    return {m, l};
}

template <typename Codec>
__device__ __forceinline__ float group_sum(const Group<Codec>& g, int valid, float sum) {
#pragma unroll
    for (int e = 0; e < kGroup; ++e) {
        if (e < valid) sum = ieee_add(sum, Codec::load(g.v[e]));
    }
    return sum;
}

__device__ __forceinline__ int valid_in(int group, int64_t vocab) {
    const int64_t left = vocab - static_cast<int64_t>(group) * kGroup;
    return left < kGroup ? static_cast<int>(left) : kGroup;
}

template <typename Codec>
__device__ __forceinline__ void load_group(Group<Codec>& out, const typename Codec::storage* row,
                                           int group, int64_t vocab, bool vector) {
    const int64_t first = static_cast<int64_t>(group) * kGroup;
    if (vector) {
#pragma unroll
        for (int w = 0; w < Group<Codec>::kWords; ++w) {
            reinterpret_cast<uint4*>(out.v)[w] = reinterpret_cast<const uint4*>(row + first)[w];
        }
    } else {
#pragma unroll
        for (int e = 0; e < kGroup; ++e) out.v[e] = first + e < vocab ? row[first + e] : Codec::store(0.0f);
    }
}

template <typename Codec>
__device__ __forceinline__ void store_group(typename Codec::storage* row, const Group<Codec>& in,
                                            int group, int64_t vocab, bool vector) {
    const int64_t first = static_cast<int64_t>(group) * kGroup;
    if (vector) {
#pragma unroll
        for (int w = 0; w < Group<Codec>::kWords; ++w) {
            reinterpret_cast<uint4*>(row + first)[w] = reinterpret_cast<const uint4*>(in.v)[w];
        }
    } else {
#pragma unroll
        for (int e = 0; e < kGroup; ++e) {
            if (first + e < vocab) row[first + e] = in.v[e];
        }
    }
}

template <typename Codec>
__device__ __forceinline__ void smem_put(uint4* smem, int slot, const Group<Codec>& g) {
#pragma unroll
    for (int w = 0; w < Group<Codec>::kWords; ++w) {
        smem[slot * Group<Codec>::kWords + w] = reinterpret_cast<const uint4*>(g.v)[w];
    }
}

template <typename Codec>
__device__ __forceinline__ void smem_get(Group<Codec>& g, const uint4* smem, int slot) {
#pragma unroll
    for (int w = 0; w < Group<Codec>::kWords; ++w) {
        reinterpret_cast<uint4*>(g.v)[w] = smem[slot * Group<Codec>::kWords + w];
    }
}

// The CTA's merged state; every thread gets the same bits.
template <int T>
__device__ __forceinline__ State block_merge(State s, float2* warp_states) {
    constexpr int W = BATCHINV_WARP_SIZE;
#pragma unroll
    for (int offset = W / 2; offset > 0; offset >>= 1) {
        const State other{BATCHINV_SHFL_XOR(s.m, offset), BATCHINV_SHFL_XOR(s.l, offset)};
        s = merge(s, other);
    }
    constexpr int kWarps = T / W;
    if constexpr (kWarps > 1) {
        if (threadIdx.x % W == 0) warp_states[threadIdx.x / W] = make_float2(s.m, s.l);
        __syncthreads();
        s = {warp_states[0].x, warp_states[0].y};
#pragma unroll
        for (int w = 1; w < kWarps; ++w) s = merge(s, State{warp_states[w].x, warp_states[w].y});
    }
    return s;
}

template <int T>
__device__ __forceinline__ float block_sum(float v, float* warp_sums) {
    constexpr int W = BATCHINV_WARP_SIZE;
#pragma unroll
    for (int offset = W / 2; offset > 0; offset >>= 1) v = ieee_add(v, BATCHINV_SHFL_XOR(v, offset));
    constexpr int kWarps = T / W;
    if constexpr (kWarps > 1) {
        if (threadIdx.x % W == 0) warp_sums[threadIdx.x / W] = v;
        __syncthreads();
        v = warp_sums[0];
#pragma unroll
        for (int w = 1; w < kWarps; ++w) v = ieee_add(v, warp_sums[w]);
    }
    return v;
}

__device__ __forceinline__ bool aligned16(const void* p) {
    return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

template <typename S>
__device__ __forceinline__ bool stride_aligned16(int64_t elements) {
    return ((elements * static_cast<int64_t>(sizeof(S))) & 15) == 0;
}

template <typename InCodec, typename OutCodec>
__device__ __forceinline__ void write_output(typename OutCodec::storage* out, const Group<InCodec>& g,
                                             int group, int64_t vocab, float lse, bool vector) {
    Group<OutCodec> o;
    const bool empty_row = lse == -INFINITY;
#pragma unroll
    for (int e = 0; e < kGroup; ++e) {
        o.v[e] = OutCodec::store(empty_row ? -INFINITY : ieee_sub(InCodec::load(g.v[e]), lse));
    }
    store_group(out, o, group, vocab, vector);
}

struct ForwardArgs {
    void* out;
    float* lse;
    const void* x;
    int64_t rows;
    int64_t vocab;
    int64_t x_stride;
    int64_t smem_groups;
};

template <typename InCodec, typename OutCodec, int T>
__device__ __forceinline__ void forward(const ForwardArgs& a) {
    using S = typename InCodec::storage;
    using O = typename OutCodec::storage;
    constexpr int R = RegGroups<InCodec>::value;
    constexpr int kUnroll = Unroll<InCodec>::value;
    extern __shared__ uint4 tier[];
    __shared__ float2 warp_states[kMaxWarps];
    const int64_t row = blockIdx.x;
    if (row >= a.rows) return;
    const int64_t vocab = a.vocab;
    const int groups = static_cast<int>((vocab + kGroup - 1) / kGroup);
    const S* x = static_cast<const S*>(a.x) + row * a.x_stride;
    O* out = static_cast<O*>(a.out) + row * vocab;
    const bool vector = vocab % kGroup == 0 && aligned16(a.x) && aligned16(a.out) &&
                        stride_aligned16<S>(a.x_stride);
    const int t = threadIdx.x;
    const int cached = R + static_cast<int>(a.smem_groups);  // groups per thread held on chip

    // Pass 1: load, cache and merge the thread's groups in increasing index.
    State st{-INFINITY, 0.0f};
    Group<InCodec> regs[R];
#pragma unroll
    for (int k = 0; k < R; ++k) {
        const int g = t + k * T;
        if (g < groups) load_group(regs[k], x, g, vocab, vector);
    }
#pragma unroll
    for (int k = 0; k < R; ++k) {
        const int g = t + k * T;
        if (g < groups) st = merge(st, group_state(regs[k], valid_in(g, vocab)));
    }
    for (int k0 = R; t + k0 * T < groups; k0 += kUnroll) {
        Group<InCodec> buf[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int g = t + (k0 + u) * T;
            if (g < groups) load_group(buf[u], x, g, vocab, vector);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int k = k0 + u;
            const int g = t + k * T;
            if (g >= groups) continue;
            if (k < cached) smem_put(tier, (k - R) * T + t, buf[u]);
            st = merge(st, group_state(buf[u], valid_in(g, vocab)));
        }
    }
    st = block_merge<T>(st, warp_states);
    const float lse = ieee_add(st.m, logf(st.l));
    if (a.lse != nullptr && t == 0) a.lse[row] = lse;

    // Pass 2: out = x - lse from wherever each group lives.
#pragma unroll
    for (int k = 0; k < R; ++k) {
        const int g = t + k * T;
        if (g < groups) write_output<InCodec, OutCodec>(out, regs[k], g, vocab, lse, vector);
    }
    for (int k0 = R; t + k0 * T < groups; k0 += kUnroll) {
        Group<InCodec> buf[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int k = k0 + u;
            const int g = t + k * T;
            if (g >= groups) continue;
            if (k < cached) {
                smem_get(buf[u], tier, (k - R) * T + t);
            } else {
                load_group(buf[u], x, g, vocab, vector);
            }
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int g = t + (k0 + u) * T;
            if (g < groups) write_output<InCodec, OutCodec>(out, buf[u], g, vocab, lse, vector);
        }
    }
}

struct BackwardArgs {
    void* grad_x;
    const void* grad_out;
    const void* x;
    const float* lse;
    int64_t rows;
    int64_t vocab;
    int64_t x_stride;
    int64_t smem_groups;
};

template <typename InCodec, typename OutCodec>
__device__ __forceinline__ void write_grad(typename InCodec::storage* grad_x, const Group<OutCodec>& dy,
                                           const Group<InCodec>& x, int group, int64_t vocab,
                                           float lse, float dy_sum, bool vector) {
    Group<InCodec> o;
    const bool empty_row = lse == -INFINITY;
#pragma unroll
    for (int e = 0; e < kGroup; ++e) {
        const float p = expf(ieee_sub(InCodec::load(x.v[e]), lse));
        o.v[e] = InCodec::store(empty_row ? 0.0f : ieee_sub(OutCodec::load(dy.v[e]), ieee_mul(p, dy_sum)));
    }
    store_group(grad_x, o, group, vocab, vector);
}

// The grad_out row is cached like x in the forward (it is read twice); x is read once.
template <typename InCodec, typename OutCodec, int T>
__device__ __forceinline__ void backward(const BackwardArgs& a) {
    using S = typename InCodec::storage;
    using O = typename OutCodec::storage;
    constexpr int R = RegGroups<OutCodec>::value;
    extern __shared__ uint4 tier[];
    __shared__ float warp_sums[kMaxWarps];
    const int64_t row = blockIdx.x;
    if (row >= a.rows) return;
    const int64_t vocab = a.vocab;
    const int groups = static_cast<int>((vocab + kGroup - 1) / kGroup);
    const S* x = static_cast<const S*>(a.x) + row * a.x_stride;
    const O* grad_out = static_cast<const O*>(a.grad_out) + row * vocab;
    S* grad_x = static_cast<S*>(a.grad_x) + row * vocab;
    const bool vector = vocab % kGroup == 0 && aligned16(a.x) && aligned16(a.grad_out) &&
                        aligned16(a.grad_x) && stride_aligned16<S>(a.x_stride);
    const int t = threadIdx.x;
    const int cached = R + static_cast<int>(a.smem_groups);
    const float lse = a.lse[row];

    float sum = 0.0f;
    Group<OutCodec> regs[R];
#pragma unroll
    for (int k = 0; k < R; ++k) {
        const int g = t + k * T;
        if (g < groups) load_group(regs[k], grad_out, g, vocab, vector);
    }
#pragma unroll
    for (int k = 0; k < R; ++k) {
        const int g = t + k * T;
        if (g < groups) sum = group_sum(regs[k], valid_in(g, vocab), sum);
    }
    for (int k0 = R; t + k0 * T < groups; k0 += kBackwardUnroll) {
        Group<OutCodec> buf[kBackwardUnroll];
#pragma unroll
        for (int u = 0; u < kBackwardUnroll; ++u) {
            const int g = t + (k0 + u) * T;
            if (g < groups) load_group(buf[u], grad_out, g, vocab, vector);
        }
#pragma unroll
        for (int u = 0; u < kBackwardUnroll; ++u) {
            const int k = k0 + u;
            const int g = t + k * T;
            if (g >= groups) continue;
            if (k < cached) smem_put(tier, (k - R) * T + t, buf[u]);
            sum = group_sum(buf[u], valid_in(g, vocab), sum);
        }
    }
    const float dy_sum = block_sum<T>(sum, warp_sums);

#pragma unroll
    for (int k = 0; k < R; ++k) {
        const int g = t + k * T;
        if (g < groups) {
            Group<InCodec> xg;
            load_group(xg, x, g, vocab, vector);
            write_grad<InCodec, OutCodec>(grad_x, regs[k], xg, g, vocab, lse, dy_sum, vector);
        }
    }
    for (int k0 = R; t + k0 * T < groups; k0 += kBackwardUnroll) {
        Group<OutCodec> buf[kBackwardUnroll];
        Group<InCodec> xg[kBackwardUnroll];
#pragma unroll
        for (int u = 0; u < kBackwardUnroll; ++u) {
            const int k = k0 + u;
            const int g = t + k * T;
            if (g >= groups) continue;
            if (k < cached) {
                smem_get(buf[u], tier, (k - R) * T + t);
            } else {
                load_group(buf[u], grad_out, g, vocab, vector);
            }
            load_group(xg[u], x, g, vocab, vector);
        }
#pragma unroll
        for (int u = 0; u < kBackwardUnroll; ++u) {
            const int g = t + (k0 + u) * T;
            if (g < groups) write_grad<InCodec, OutCodec>(grad_x, buf[u], xg[u], g, vocab, lse, dy_sum, vector);
        }
    }
}

}  // namespace lsm
}  // namespace batchinv

#define BATCHINV_LOG_SOFTMAX_KERNELS(SUFFIX, IN, OUT, T)                                          \
    extern "C" __global__ void __launch_bounds__(T) log_softmax_forward_##SUFFIX##_t##T(          \
        OUT::storage* out, float* lse, const IN::storage* x, int64_t rows, int64_t vocab,        \
        int64_t x_stride, int64_t smem_groups) {                                                 \
        const batchinv::lsm::ForwardArgs args{out, lse, x, rows, vocab, x_stride, smem_groups};   \
        batchinv::lsm::forward<IN, OUT, T>(args);                                                \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(T) log_softmax_backward_##SUFFIX##_t##T(         \
        IN::storage* grad_x, const OUT::storage* grad_out, const IN::storage* x, const float* lse, \
        int64_t rows, int64_t vocab, int64_t x_stride, int64_t smem_groups) {                    \
        const batchinv::lsm::BackwardArgs args{grad_x, grad_out, x,        lse,                  \
                                               rows,   vocab,    x_stride, smem_groups};         \
        batchinv::lsm::backward<IN, OUT, T>(args);                                               \
    }

// The block sizes (keep in step with py/batchinv/gpu/log_softmax.py: THREADS).
#define BATCHINV_LOG_SOFTMAX_ALL_THREADS(SUFFIX, IN, OUT)  \
    BATCHINV_LOG_SOFTMAX_KERNELS(SUFFIX, IN, OUT, 128)      \
    BATCHINV_LOG_SOFTMAX_KERNELS(SUFFIX, IN, OUT, 512)      \
    BATCHINV_LOG_SOFTMAX_KERNELS(SUFFIX, IN, OUT, 1024)

BATCHINV_LOG_SOFTMAX_ALL_THREADS(bf16_f32, batchinv::Bf16Codec, batchinv::F32Codec)
BATCHINV_LOG_SOFTMAX_ALL_THREADS(bf16_bf16, batchinv::Bf16Codec, batchinv::Bf16Codec)
BATCHINV_LOG_SOFTMAX_ALL_THREADS(bf16_f16, batchinv::Bf16Codec, batchinv::F16Codec)
BATCHINV_LOG_SOFTMAX_ALL_THREADS(f16_f32, batchinv::F16Codec, batchinv::F32Codec)
BATCHINV_LOG_SOFTMAX_ALL_THREADS(f16_bf16, batchinv::F16Codec, batchinv::Bf16Codec)
BATCHINV_LOG_SOFTMAX_ALL_THREADS(f16_f16, batchinv::F16Codec, batchinv::F16Codec)
BATCHINV_LOG_SOFTMAX_ALL_THREADS(f32_f32, batchinv::F32Codec, batchinv::F32Codec)
BATCHINV_LOG_SOFTMAX_ALL_THREADS(f32_bf16, batchinv::F32Codec, batchinv::Bf16Codec)
BATCHINV_LOG_SOFTMAX_ALL_THREADS(f32_f16, batchinv::F32Codec, batchinv::F16Codec)

// Signatures of the entries above (<in>_<out>_t<T>), for the launcher's argument checks.
// batchinv-signature: log_softmax_forward_bf16_f32_t128(ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_backward_bf16_f32_t128(ptr, ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_forward_bf16_f32_t512(ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_backward_bf16_f32_t512(ptr, ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_forward_bf16_f32_t1024(ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_backward_bf16_f32_t1024(ptr, ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_forward_bf16_bf16_t128(ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_backward_bf16_bf16_t128(ptr, ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_forward_bf16_bf16_t512(ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_backward_bf16_bf16_t512(ptr, ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_forward_bf16_bf16_t1024(ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_backward_bf16_bf16_t1024(ptr, ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_forward_bf16_f16_t128(ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_backward_bf16_f16_t128(ptr, ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_forward_bf16_f16_t512(ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_backward_bf16_f16_t512(ptr, ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_forward_bf16_f16_t1024(ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_backward_bf16_f16_t1024(ptr, ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_forward_f16_f32_t128(ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_backward_f16_f32_t128(ptr, ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_forward_f16_f32_t512(ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_backward_f16_f32_t512(ptr, ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_forward_f16_f32_t1024(ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_backward_f16_f32_t1024(ptr, ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_forward_f16_bf16_t128(ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_backward_f16_bf16_t128(ptr, ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_forward_f16_bf16_t512(ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_backward_f16_bf16_t512(ptr, ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_forward_f16_bf16_t1024(ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_backward_f16_bf16_t1024(ptr, ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_forward_f16_f16_t128(ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_backward_f16_f16_t128(ptr, ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_forward_f16_f16_t512(ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_backward_f16_f16_t512(ptr, ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_forward_f16_f16_t1024(ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_backward_f16_f16_t1024(ptr, ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_forward_f32_f32_t128(ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_backward_f32_f32_t128(ptr, ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_forward_f32_f32_t512(ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_backward_f32_f32_t512(ptr, ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_forward_f32_f32_t1024(ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_backward_f32_f32_t1024(ptr, ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_forward_f32_bf16_t128(ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_backward_f32_bf16_t128(ptr, ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_forward_f32_bf16_t512(ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_backward_f32_bf16_t512(ptr, ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_forward_f32_bf16_t1024(ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_backward_f32_bf16_t1024(ptr, ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_forward_f32_f16_t128(ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_backward_f32_f16_t128(ptr, ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_forward_f32_f16_t512(ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_backward_f32_f16_t512(ptr, ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_forward_f32_f16_t1024(ptr, ptr, ptr, i64, i64, i64, i64)
// batchinv-signature: log_softmax_backward_f32_f16_t1024(ptr, ptr, ptr, ptr, i64, i64, i64, i64)

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
//                 (the factor of the operand holding a finite maximum is expf(0) = 1 and is not
//                 evaluated: the same bits, see merge())
//   A thread merges its groups left to right into (m, l), starting from (-inf, 0), which the
//   merge leaves unchanged.  The T thread states are merged by a butterfly inside each warp
//   (xor offsets W/2 .. 1; the merge is symmetric in its operands, so every lane ends with the
//   same bits) and the per-warp states in warp order.
//   lse = m + logf(l);  out = x - lse, or -inf everywhere when lse = -inf (a row of all -inf),
//   rounded once to the output dtype.  lse is written to lse[row] (fp32) for the backward.
//   expf/logf are the accurate ones (no fast math); every step is an explicit IEEE intrinsic.
// Backward: dx = dy - expf(x - lse) * sum(dy), zero in rows whose lse is -inf; sum(dy) in the
//   same layout: per thread over its groups in index order, then the same butterfly and warp
//   order; rounded once to x's dtype.  T = 2048 (the backward only) orders the warps in two
//   levels instead: the warps of each run of 128 threads in order, then the 16 run sums in order
//   (the tree of a cluster of 16 CTAs of 128 threads; see wide_block_sum).
//
//   x    [rows, V]  bf16/fp16/fp32, unit stride along V, row stride x_stride (elements)
//   out  [rows, V]  bf16/fp16/fp32 (the output dtype; fp32 by default), contiguous
//   lse  [rows]     fp32
//   dy   [rows, V]  the output dtype, contiguous;  dx [rows, V] x's dtype, contiguous
//   Launch: grid.x = rows (one CTA per row), T from {128, 512, 1024, and 2048 for the backward}:
//   the host picks it from V and the dtypes alone; block = T threads, or 1024 for T = 2048, each
//   thread then playing two threads of the tree (see Block).  Dynamic shared memory =
//   smem_groups * block groups (see "where a row lives").
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
//
// On sm_90a the host launches the cluster form below instead for some cases (one cluster of 8 or
// 16 CTAs per row, the row read once into shared memory) wherever V % 8 == 0, the rows are
// 16-byte aligned and the slice fits: for the same T it performs the same operations in the same
// order, so which form runs changes speed, never bits.  Every compiled T has a one-CTA kernel,
// so every card can compute every tree.  A cluster exchanges state only inside itself (its one
// row).
#include "common/chunk16.cuh"
#include "common/hopper.cuh"


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

// The formula's two factors are expf(a.m - shift) and expf(b.m - shift); the one of the operand
// that holds the maximum is expf(0) = 1 exactly when m is finite, so only the other is evaluated
// (the same bits, one expf instead of two).  When m = -inf (shift 0) both operands are empty
// states with l = 0, or l = NaN for a group of NaNs: 0 or NaN either way.  When m = +inf, l is
// NaN already.
__device__ __forceinline__ State merge(State a, State b) {
    const float m = fmaxf(a.m, b.m);
    const float shift = shift_of(m);
    const bool a_holds_max = a.m == m;
    const float other = expf(ieee_sub(a_holds_max ? b.m : a.m, shift));
    const float fa = a_holds_max ? 1.0f : other;
    const float fb = a_holds_max ? other : 1.0f;
    const float l = ieee_add(ieee_mul(a.l, fa), ieee_mul(b.l, fb));
    return {m, l};
}

// kFull: every element is valid (all groups but a row's last when V % 8 != 0).  The full form
// is the same operations in the same order without the per-element `e < valid` tests, which
// cost a branch and a reconvergence per element (speed only, never bits).
template <typename Codec, bool kFull>
__device__ __forceinline__ State group_state_of(const Group<Codec>& g, int valid) {
    float m = -INFINITY;
#pragma unroll
    for (int e = 0; e < kGroup; ++e) {
        if (kFull || e < valid) m = fmaxf(m, Codec::load(g.v[e]));
    }
    m = ieee_add(m, 0.0f);  // -0 -> +0: the sign of a zero maximum is canonical
    const float shift = shift_of(m);
    float l = 0.0f;
#pragma unroll
    for (int e = 0; e < kGroup; ++e) {
        if (kFull || e < valid) l = ieee_add(l, expf(ieee_sub(Codec::load(g.v[e]), shift)));
    }
    return {m, l};
}

template <typename Codec>
__device__ __forceinline__ State group_state(const Group<Codec>& g, int valid) {
    return valid == kGroup ? group_state_of<Codec, true>(g, valid) : group_state_of<Codec, false>(g, valid);
}

template <typename Codec, bool kFull>
__device__ __forceinline__ float group_sum_of(const Group<Codec>& g, int valid, float sum) {
#pragma unroll
    for (int e = 0; e < kGroup; ++e) {
        if (kFull || e < valid) sum = ieee_add(sum, Codec::load(g.v[e]));
    }
    return sum;
}

template <typename Codec>
__device__ __forceinline__ float group_sum(const Group<Codec>& g, int valid, float sum) {
    return valid == kGroup ? group_sum_of<Codec, true>(g, valid, sum) : group_sum_of<Codec, false>(g, valid, sum);
}

__device__ __forceinline__ int valid_in(int group, int64_t vocab) {
    const int64_t left = vocab - static_cast<int64_t>(group) * kGroup;
    return left < kGroup ? static_cast<int>(left) : kGroup;
}

// kStream: data read or written once (evict-first cache hints, CUDA only); speed only.
template <bool kStream>
__device__ __forceinline__ uint4 load16(const uint4* source) {
#if !defined(__HIPCC__)
    if constexpr (kStream) return __ldcs(source);
#endif
    return *source;
}

template <bool kStream>
__device__ __forceinline__ void store16(uint4* target, uint4 value) {
#if !defined(__HIPCC__)
    if constexpr (kStream) {
        __stcs(target, value);
        return;
    }
#endif
    *target = value;
}

template <typename Codec, bool kStream = false>
__device__ __forceinline__ void load_group(Group<Codec>& out, const typename Codec::storage* row,
                                           int group, int64_t vocab, bool vector) {
    const int64_t first = static_cast<int64_t>(group) * kGroup;
    if (vector) {
#pragma unroll
        for (int w = 0; w < Group<Codec>::kWords; ++w) {
            const uint4* source = reinterpret_cast<const uint4*>(row + first) + w;
            reinterpret_cast<uint4*>(out.v)[w] = load16<kStream>(source);
        }
    } else {
#pragma unroll
        for (int e = 0; e < kGroup; ++e) out.v[e] = first + e < vocab ? row[first + e] : Codec::store(0.0f);
    }
}

template <typename Codec, bool kStream = false>
__device__ __forceinline__ void store_group(typename Codec::storage* row, const Group<Codec>& in,
                                            int group, int64_t vocab, bool vector) {
    const int64_t first = static_cast<int64_t>(group) * kGroup;
    if (vector) {
#pragma unroll
        for (int w = 0; w < Group<Codec>::kWords; ++w) {
            uint4* target = reinterpret_cast<uint4*>(row + first) + w;
            store16<kStream>(target, reinterpret_cast<const uint4*>(in.v)[w]);
        }
    } else {
#pragma unroll
        for (int e = 0; e < kGroup; ++e) {
            if (first + e < vocab) row[first + e] = in.v[e];
        }
    }
}

// Whether every lane of this thread's warp holds a group below `groups` (lanes hold consecutive
// groups: g = warp base + lane); uniform across the warp.
__device__ __forceinline__ bool warp_full(int group, int groups) {
    const int lane = static_cast<int>(threadIdx.x) % BATCHINV_WARP_SIZE;
    return group - lane + BATCHINV_WARP_SIZE - 1 < groups;
}

// A 32-byte group (8 fp32) stored by a plain per-lane vector store writes 16 of each 32-byte
// sector's bytes per instruction (lanes are 32 bytes apart), so every sector takes two L2 write
// requests, which bound the fp32-output kernels (docs/tuning/log_softmax.md).  Here lanes 2j and 2j + 1 (groups g and g + 1) swap halves through a shuffle and each
// instruction writes two whole sectors per lane pair.  Stores only: the values are unchanged.
// Needs the whole warp present (warp_full) and the vector path.
template <typename Codec, bool kStream>
__device__ __forceinline__ void store_group_paired(typename Codec::storage* row, const Group<Codec>& in, int group) {
    static_assert(Group<Codec>::kWords == 2, "32-byte groups only");
    const uint32_t odd = threadIdx.x & 1u;
    const uint4 lo = reinterpret_cast<const uint4*>(in.v)[0];
    const uint4 hi = reinterpret_cast<const uint4*>(in.v)[1];
    const uint4 send = odd ? lo : hi;  // the half the neighbour's sector needs
    uint4 got;
    got.x = BATCHINV_SHFL_XOR(send.x, 1);
    got.y = BATCHINV_SHFL_XOR(send.y, 1);
    got.z = BATCHINV_SHFL_XOR(send.z, 1);
    got.w = BATCHINV_SHFL_XOR(send.w, 1);
    // Half `odd` of group g - odd, then half `odd` of group g - odd + 1.
    uint4* pair = reinterpret_cast<uint4*>(row + static_cast<int64_t>(group - static_cast<int>(odd)) * kGroup);
    store16<kStream>(pair + odd, odd ? got : lo);
    store16<kStream>(pair + 2 + odd, odd ? hi : got);
}

// store_group, with the paired form for 32-byte groups where it applies (see above).
template <typename Codec, bool kStream = false>
__device__ __forceinline__ void store_group_of_warp(typename Codec::storage* row, const Group<Codec>& in,
                                                    int group, int64_t vocab, bool vector, bool whole_warp) {
#if !defined(__HIPCC__)
    if constexpr (Group<Codec>::kWords == 2) {
        if (vector && whole_warp) {
            store_group_paired<Codec, kStream>(row, in, group);
            return;
        }
    }
#endif
    store_group<Codec, kStream>(row, in, group, vocab, vector);
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

// The CTA's merged state; every thread gets the same bits.  Warp 0 alone merges the warp states
// in order (the chain is sequential; the other warps would only repeat it) and broadcasts the
// result through warp_states[kWarps]: `warp_states` holds kMaxWarps + 1 entries.
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
        if (threadIdx.x < W) {
            s = {warp_states[0].x, warp_states[0].y};
#pragma unroll
            for (int w = 1; w < kWarps; ++w) s = merge(s, State{warp_states[w].x, warp_states[w].y});
            if (threadIdx.x == 0) warp_states[kWarps] = make_float2(s.m, s.l);
        }
        __syncthreads();
        s = {warp_states[kWarps].x, warp_states[kWarps].y};
    }
    return s;
}

// `warp_sums` holds kMaxWarps + 1 entries (see block_merge).
template <int T>
__device__ __forceinline__ float block_sum(float v, float* warp_sums) {
    constexpr int W = BATCHINV_WARP_SIZE;
#pragma unroll
    for (int offset = W / 2; offset > 0; offset >>= 1) v = ieee_add(v, BATCHINV_SHFL_XOR(v, offset));
    constexpr int kWarps = T / W;
    if constexpr (kWarps > 1) {
        if (threadIdx.x % W == 0) warp_sums[threadIdx.x / W] = v;
        __syncthreads();
        if (threadIdx.x < W) {
            v = warp_sums[0];
#pragma unroll
            for (int w = 1; w < kWarps; ++w) v = ieee_add(v, warp_sums[w]);
            if (threadIdx.x == 0) warp_sums[kWarps] = v;
        }
        __syncthreads();
        v = warp_sums[kWarps];
    }
    return v;
}

// The block of the one-CTA form for a tree T threads wide: T threads, or for T = 2048 (the
// backward only) 1024 threads that each play two threads of the tree, t and t + 1024 (a CTA holds
// at most 1024 threads).  Thread t's k-th group t + k * kThreads is then the group of tree thread
// t + (k % kPlays) * kThreads, whose groups it visits in the same increasing order.
template <int T>
struct Block {
    static constexpr int kThreads = T < 1024 ? T : 1024;
    static constexpr int kPlays = T / kThreads;
    static_assert(kPlays * kThreads == T && kPlays <= 2, "T = 128, 512, 1024 or 2048");
};

// sum(dy) over the tree T = 2048 played by 1024 threads (`sums[j]`: this thread's sum for tree
// thread threadIdx.x + j * 1024): the tree the cluster form with 16 CTAs of 128 threads computes.
// Each tree warp (W consecutive tree threads) by the butterfly; then each run of 128 tree threads
// (one CTA of that cluster) adds its warps in order; then the 16 run sums are added in order.
// `warp_sums` holds 2 * kMaxWarps + 1 entries.  Every thread gets the same bits.
__device__ __forceinline__ float wide_block_sum(float (&sums)[2], float* warp_sums) {
    constexpr int W = BATCHINV_WARP_SIZE;
    constexpr int kWarpsPerRun = 128 / W;
    constexpr int kRuns = 2048 / 128;
#pragma unroll
    for (int offset = W / 2; offset > 0; offset >>= 1) {
        sums[0] = ieee_add(sums[0], BATCHINV_SHFL_XOR(sums[0], offset));
        sums[1] = ieee_add(sums[1], BATCHINV_SHFL_XOR(sums[1], offset));
    }
    // Tree warp w: tree threads [w * W, (w + 1) * W); tree thread t + 1024 is in warp
    // kMaxWarps + t / W.
    if (threadIdx.x % W == 0) {
        warp_sums[threadIdx.x / W] = sums[0];
        warp_sums[kMaxWarps + threadIdx.x / W] = sums[1];
    }
    __syncthreads();
    if (threadIdx.x < W) {
        float total = 0.0f;
#pragma unroll
        for (int run = 0; run < kRuns; ++run) {
            float v = warp_sums[run * kWarpsPerRun];
#pragma unroll
            for (int w = 1; w < kWarpsPerRun; ++w) v = ieee_add(v, warp_sums[run * kWarpsPerRun + w]);
            total = run == 0 ? v : ieee_add(total, v);
        }
        if (threadIdx.x == 0) warp_sums[2 * kMaxWarps] = total;
    }
    __syncthreads();
    return warp_sums[2 * kMaxWarps];
}

template <typename InCodec, typename OutCodec, bool kStream = false>
__device__ __forceinline__ void write_output(typename OutCodec::storage* out, const Group<InCodec>& g,
                                             int group, int64_t vocab, float lse, bool vector,
                                             bool whole_warp) {
    Group<OutCodec> o;
    const bool empty_row = lse == -INFINITY;
#pragma unroll
    for (int e = 0; e < kGroup; ++e) {
        o.v[e] = OutCodec::store(empty_row ? -INFINITY : ieee_sub(InCodec::load(g.v[e]), lse));
    }
    store_group_of_warp<OutCodec, kStream>(out, o, group, vocab, vector, whole_warp);
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
    __shared__ float2 warp_states[kMaxWarps + 1];
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
        if (g < groups) write_output<InCodec, OutCodec>(out, regs[k], g, vocab, lse, vector, warp_full(g, groups));
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
            if (g < groups) {
                write_output<InCodec, OutCodec>(out, buf[u], g, vocab, lse, vector, warp_full(g, groups));
            }
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

template <typename InCodec, typename OutCodec, bool kStream = false>
__device__ __forceinline__ void write_grad(typename InCodec::storage* grad_x, const Group<OutCodec>& dy,
                                           const Group<InCodec>& x, int group, int64_t vocab,
                                           float lse, float dy_sum, bool vector, bool whole_warp) {
    Group<InCodec> o;
    const bool empty_row = lse == -INFINITY;
#pragma unroll
    for (int e = 0; e < kGroup; ++e) {
        const float p = expf(ieee_sub(InCodec::load(x.v[e]), lse));
        o.v[e] = InCodec::store(empty_row ? 0.0f : ieee_sub(OutCodec::load(dy.v[e]), ieee_mul(p, dy_sum)));
    }
    store_group_of_warp<InCodec, kStream>(grad_x, o, group, vocab, vector, whole_warp);
}

// The grad_out row is cached like x in the forward (it is read twice); x is read once.  The
// block is Block<T>::kThreads threads; for T = 2048 each plays two tree threads (see Block), and
// the row is laid out over the block exactly as for T = 1024: the tiers and loads are the same,
// only the sum a group is added to alternates.
template <typename InCodec, typename OutCodec, int T>
__device__ __forceinline__ void backward(const BackwardArgs& a) {
    using S = typename InCodec::storage;
    using O = typename OutCodec::storage;
    constexpr int B = Block<T>::kThreads;
    constexpr int P = Block<T>::kPlays;
    constexpr int R = RegGroups<OutCodec>::value;
    // k % P is then u % P in the unrolled loops below (k0 is a multiple of P).
    static_assert(R % P == 0 && kBackwardUnroll % P == 0, "tree threads alternate with k");
    extern __shared__ uint4 tier[];
    __shared__ float warp_sums[P * kMaxWarps + 1];
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

    float sums[P];
#pragma unroll
    for (int j = 0; j < P; ++j) sums[j] = 0.0f;
    Group<OutCodec> regs[R];
#pragma unroll
    for (int k = 0; k < R; ++k) {
        const int g = t + k * B;
        if (g < groups) load_group(regs[k], grad_out, g, vocab, vector);
    }
#pragma unroll
    for (int k = 0; k < R; ++k) {
        const int g = t + k * B;
        if (g < groups) sums[k % P] = group_sum(regs[k], valid_in(g, vocab), sums[k % P]);
    }
    for (int k0 = R; t + k0 * B < groups; k0 += kBackwardUnroll) {
        Group<OutCodec> buf[kBackwardUnroll];
#pragma unroll
        for (int u = 0; u < kBackwardUnroll; ++u) {
            const int g = t + (k0 + u) * B;
            if (g < groups) load_group(buf[u], grad_out, g, vocab, vector);
        }
#pragma unroll
        for (int u = 0; u < kBackwardUnroll; ++u) {
            const int k = k0 + u;
            const int g = t + k * B;
            if (g >= groups) continue;
            if (k < cached) smem_put(tier, (k - R) * B + t, buf[u]);
            sums[u % P] = group_sum(buf[u], valid_in(g, vocab), sums[u % P]);
        }
    }
    float dy_sum;
    if constexpr (P == 1) {
        dy_sum = block_sum<T>(sums[0], warp_sums);
    } else {
        dy_sum = wide_block_sum(sums, warp_sums);
    }

#pragma unroll
    for (int k = 0; k < R; ++k) {
        const int g = t + k * B;
        if (g < groups) {
            Group<InCodec> xg;
            load_group(xg, x, g, vocab, vector);
            write_grad<InCodec, OutCodec>(grad_x, regs[k], xg, g, vocab, lse, dy_sum, vector, warp_full(g, groups));
        }
    }
    for (int k0 = R; t + k0 * B < groups; k0 += kBackwardUnroll) {
        Group<OutCodec> buf[kBackwardUnroll];
        Group<InCodec> xg[kBackwardUnroll];
#pragma unroll
        for (int u = 0; u < kBackwardUnroll; ++u) {
            const int k = k0 + u;
            const int g = t + k * B;
            if (g >= groups) continue;
            if (k < cached) {
                smem_get(buf[u], tier, (k - R) * B + t);
            } else {
                load_group(buf[u], grad_out, g, vocab, vector);
            }
            load_group(xg[u], x, g, vocab, vector);
        }
#pragma unroll
        for (int u = 0; u < kBackwardUnroll; ++u) {
            const int g = t + (k0 + u) * B;
            if (g < groups) {
                write_grad<InCodec, OutCodec>(grad_x, buf[u], xg[u], g, vocab, lse, dy_sum, vector,
                                              warp_full(g, groups));
            }
        }
    }
}


// ---------------------------------------------------------------------------------------------
// Hopper (sm_90a) form: the row is split over a thread-block cluster of C CTAs of T / C threads
// and kept entirely in shared memory, so x (forward) or grad_out (backward) is read from global
// memory once.  Thread i = rank * (T / C) + threadIdx.x of the cluster plays thread i of the
// one-CTA form above: it owns groups g = i + k * T and visits them in increasing k, the warp
// butterfly is the same, and the 32-lane warps' states are merged in global warp order (warp w
// lives in CTA w / (T / C / 32)) after an exchange through distributed shared memory.  So for
// equal T <= 1024 the two forms compute the same operations in the same order: the same bits
// (tested).  For T = 2048 (16 x 128, the backward) each CTA first adds its 4 warps in order and
// the 16 CTA sums are then added in rank order: the tree of the one-CTA T = 2048 kernel
// (wide_block_sum), so the same bits again (test_wide_backward_* compare the two).
// Shared memory of CTA `rank`: segment k = the T / C groups [k * T + rank * T / C, + T / C),
// contiguous in the row, copied by one bulk async copy (cp.async.bulk) with its own mbarrier,
// so a thread can start on segment 0 while later segments are still in flight.  The segments
// come first, then one 8-byte mbarrier per segment.  Needs V % 8 == 0 and 16-byte aligned row
// starts (the host checks; otherwise it uses the one-CTA form with the same T: the same bits).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
namespace cluster {

__device__ __forceinline__ uint32_t cta_rank() {
    uint32_t rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    return rank;
}

__device__ __forceinline__ void cluster_wait() {
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// The address of `local` (a shared variable of this CTA) in the CTA of cluster rank `rank`.
__device__ __forceinline__ uint32_t remote_address(const void* local, uint32_t rank) {
    uint32_t remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
                 : "=r"(remote)
                 : "r"(hopper::smem_address(local)), "r"(rank));
    return remote;
}

__device__ __forceinline__ void cluster_arrive_relaxed() {
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}

// Writes `v` into the shared memory of another CTA of the cluster (`address`, from
// remote_address) and counts its 8 bytes on that CTA's mbarrier `barrier` (also a remote address).
__device__ __forceinline__ void push_float2(uint32_t address, float2 v, uint32_t barrier) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];" ::"r"(address),
                 "f"(v.x), "f"(v.y), "r"(barrier)
                 : "memory");
}

// Waits for the phase of parity `phase` of a local mbarrier that other CTAs' st.async complete.
__device__ __forceinline__ void barrier_wait_cluster(uint64_t* barrier, uint32_t phase) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "wait:\n"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra wait;\n"
        "}\n" ::"r"(hopper::smem_address(barrier)),
        "r"(phase)
        : "memory");
}

__device__ __forceinline__ void bulk_load(void* destination, const void* source, uint32_t bytes,
                                          uint64_t* barrier) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
            hopper::smem_address(destination)),
        "l"(reinterpret_cast<uint64_t>(source)), "r"(bytes), "r"(hopper::smem_address(barrier))
        : "memory");
}

// Row layout seen by one CTA of the cluster.
template <typename S, int C, int TC>
struct Slice {
    static constexpr int kSegmentBytes = TC * kGroup * static_cast<int>(sizeof(S));
    int segments;  // k = 0 .. segments - 1
    int groups;    // groups in the row
    uint32_t rank;

    __device__ __forceinline__ int group_of(int k) const {
        return k * C * TC + static_cast<int>(rank) * TC + static_cast<int>(threadIdx.x);
    }
    __device__ __forceinline__ uint32_t bytes_of(int k, int64_t vocab) const {
        const int64_t first = static_cast<int64_t>(k * C * TC + static_cast<int>(rank) * TC) * kGroup;
        const int64_t left = vocab - first;
        const int64_t n = left < TC * kGroup ? left : TC * kGroup;
        return n > 0 ? static_cast<uint32_t>(n * static_cast<int64_t>(sizeof(S))) : 0u;
    }
};

// This CTA's part of a row of `vocab` elements: its rank, the row's groups and the segments per
// CTA; returns the segments' mbarriers, which follow the segments in shared memory.
template <typename S, int C, int TC>
__device__ __forceinline__ uint64_t* init_slice(Slice<S, C, TC>& slice, uint8_t* shared_row, int64_t vocab) {
    slice.rank = cta_rank();
    slice.groups = static_cast<int>((vocab + kGroup - 1) / kGroup);
    slice.segments = (slice.groups + C * TC - 1) / (C * TC);
    return reinterpret_cast<uint64_t*>(shared_row + static_cast<int64_t>(slice.segments) *
                                                        Slice<S, C, TC>::kSegmentBytes);
}

// Issues the copy of segment k of `row` (a row of the same length) into its slot; thread 0 only.
template <typename S, int C, int TC>
__device__ __forceinline__ void refill_segment(const Slice<S, C, TC>& slice, const S* row, int64_t vocab,
                                               uint8_t* segments, uint64_t* barriers, int k) {
    const uint32_t bytes = slice.bytes_of(k, vocab);
    if (bytes == 0) return;  // nobody waits on it: its groups are past the row
    hopper::barrier_expect_bytes(&barriers[k], bytes);
    const int64_t first = static_cast<int64_t>(k * C * TC + static_cast<int>(slice.rank) * TC) * kGroup;
    bulk_load(segments + static_cast<int64_t>(k) * Slice<S, C, TC>::kSegmentBytes, row + first, bytes, &barriers[k]);
}

// Warp 0 starts every segment's copy of the CTA's first row; each segment completes on its own
// barrier.
template <typename S, int C, int TC>
__device__ __forceinline__ void start_row_copies(const Slice<S, C, TC>& slice, const S* row, int64_t vocab,
                                                 uint8_t* segments, uint64_t* barriers) {
    const int lane = static_cast<int>(threadIdx.x);
    if (lane < BATCHINV_WARP_SIZE) {
        for (int k = lane; k < slice.segments; k += BATCHINV_WARP_SIZE) hopper::barrier_init(&barriers[k], 1);
        hopper::fence_barrier_init();
    }
    __syncthreads();
    if (lane < BATCHINV_WARP_SIZE) {
        for (int k = lane; k < slice.segments; k += BATCHINV_WARP_SIZE) {
            refill_segment(slice, row, vocab, segments, barriers, k);
        }
    }
}

template <typename Codec, int C, int TC>
__device__ __forceinline__ void read_group(Group<Codec>& g, const uint8_t* segments, int k) {
    using S = typename Codec::storage;
    smem_get(g, reinterpret_cast<const uint4*>(segments + static_cast<int64_t>(k) * Slice<S, C, TC>::kSegmentBytes),
             static_cast<int>(threadIdx.x));
}

// How the cluster's warp results are combined.  T = C * TC <= 1024 (kFlat): the warps of the
// whole cluster in global warp order, exactly the one-CTA form's tree for that T.  T = 2048
// (16 x 128, the backward only): each CTA combines its own warps in order, then the C CTA
// results in rank order, exactly the tree of the one-CTA form's 1024 threads playing two tree
// threads each (wide_block_sum).  The kParts parts are exchanged by push_reduce below; every
// thread of every CTA gets the same bits.
template <int C, int TC>
struct Exchange {
    static_assert(C * TC <= 1024 || (C == 16 && TC == 128), "a tree the one-CTA form computes");
    static constexpr int kLocalWarps = TC / BATCHINV_WARP_SIZE;
    static constexpr bool kFlat = C * TC <= 1024;
    static constexpr int kParts = kFlat ? C * kLocalWarps : C;
    static constexpr int kPerLane = (kParts + BATCHINV_WARP_SIZE - 1) / BATCHINV_WARP_SIZE;
};

// The exchange, without cluster barriers per row (two barrier.cluster rounds per row in which
// warp 0 of each CTA fetches the parts from the other CTAs measure slower): every part (a warp's
// value, or for T = 2048 a CTA's) is pushed by its owner into slot `part` of every CTA of the
// cluster (st.async, counted in bytes on that CTA's `full` mbarrier), and each CTA's warp 0 waits
// on its own mbarrier, combines the parts in part order (lane j reads part j, a chain over
// shuffles) and broadcasts the result through shared memory: every CTA performs the same
// operations in the same order, the same bits.  Row i of a CTA uses buffer i % 2 and waits on
// parity (i / 2) % 2.  A peer pushes row i + 2 into a buffer only after it has received this
// CTA's row i + 1 parts, which this CTA pushes after it has read the buffer for row i: no slot is
// overwritten unread.  Set up once per kernel (init_push_exchange): the peers' mbarriers must be
// initialised before the first push, hence one cluster barrier per kernel, whose wait comes after
// the first pass.  V: float2 (a state (m, l)) or float (a sum).
template <int C, int TC, typename V>
struct PushExchange {
    V parts[2][Exchange<C, TC>::kParts];
    V result[2];
    uint64_t full[2];
};

template <int C, int TC, typename V>
__device__ __forceinline__ void init_push_exchange(PushExchange<C, TC, V>& ex) {
    if (threadIdx.x == 0) {
        hopper::barrier_init(&ex.full[0], 1);
        hopper::barrier_init(&ex.full[1], 1);
        hopper::fence_barrier_init();
    }
    cluster_arrive_relaxed();  // waited for before the first push
}

__device__ __forceinline__ void push_value(uint32_t address, float v, uint32_t barrier) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [%0], %1, [%2];" ::"r"(address), "f"(v),
                 "r"(barrier)
                 : "memory");
}
__device__ __forceinline__ void push_value(uint32_t address, float2 v, uint32_t barrier) { push_float2(address, v, barrier); }

__device__ __forceinline__ float shfl_value(float v, int lane) { return __shfl_sync(0xffffffffu, v, lane); }
__device__ __forceinline__ float2 shfl_value(float2 v, int lane) {
    return make_float2(__shfl_sync(0xffffffffu, v.x, lane), __shfl_sync(0xffffffffu, v.y, lane));
}

// `v`: the warp's value (every lane the same bits).  Returns the cluster's combined value.
template <int C, int TC, typename V, typename Combine>
__device__ __forceinline__ V push_reduce(V v, PushExchange<C, TC, V>& ex, uint32_t rank, int buffer, uint32_t parity,
                                         bool first, Combine combine) {
    using X = Exchange<C, TC>;
    constexpr int W = BATCHINV_WARP_SIZE;
    static_assert(C <= W, "one pushing lane per CTA of the cluster");
    const int lane = static_cast<int>(threadIdx.x) % W;
    const int warp = static_cast<int>(threadIdx.x) / W;
    int part = static_cast<int>(rank) * X::kLocalWarps + warp;
    bool pushes = true;
    if constexpr (!X::kFlat) {
        // The CTA's warps in order first (warp 0 reads `local` before the __syncthreads below,
        // which every thread passes before it writes `local` again for its next row).
        __shared__ V local[X::kLocalWarps];
        if (lane == 0) local[warp] = v;
        __syncthreads();
        if (warp == 0) {
            V c = local[0];
#pragma unroll
            for (int w = 1; w < X::kLocalWarps; ++w) c = combine(c, local[w]);
            v = c;
        }
        part = static_cast<int>(rank);
        pushes = warp == 0;
    }
    if (first) cluster_wait();  // every CTA's mbarriers are initialised
    if (pushes && lane < C) {
        const uint32_t peer = static_cast<uint32_t>(lane);
        push_value(remote_address(&ex.parts[buffer][part], peer), v, remote_address(&ex.full[buffer], peer));
    }
    if (warp == 0) {
        if (lane == 0) hopper::barrier_expect_bytes(&ex.full[buffer], X::kParts * sizeof(V));
        barrier_wait_cluster(&ex.full[buffer], parity);
        V mine[X::kPerLane];
#pragma unroll
        for (int j = 0; j < X::kPerLane; ++j) {
            const int p = lane + j * W;
            mine[j] = p < X::kParts ? ex.parts[buffer][p] : V{};
        }
        V r = shfl_value(mine[0], 0);
#pragma unroll
        for (int p = 1; p < X::kParts; ++p) r = combine(r, shfl_value(mine[p / W], p % W));
        if (lane == 0) ex.result[buffer] = r;
    }
    __syncthreads();
    return ex.result[buffer];
}

template <int C, int TC>
__device__ __forceinline__ State push_merge(State s, PushExchange<C, TC, float2>& ex, uint32_t rank, int buffer,
                                            uint32_t parity, bool first) {
    constexpr int W = BATCHINV_WARP_SIZE;
#pragma unroll
    for (int offset = W / 2; offset > 0; offset >>= 1) {
        const State other{BATCHINV_SHFL_XOR(s.m, offset), BATCHINV_SHFL_XOR(s.l, offset)};
        s = merge(s, other);
    }
    const float2 r = push_reduce<C, TC>(make_float2(s.m, s.l), ex, rank, buffer, parity, first, [](float2 a, float2 b) {
        const State m = merge(State{a.x, a.y}, State{b.x, b.y});
        return make_float2(m.m, m.l);
    });
    return State{r.x, r.y};
}

// sum(dy): the parts added in part order, one rounding per add, through push_reduce.
template <int C, int TC>
__device__ __forceinline__ float push_sum(float v, PushExchange<C, TC, float>& ex, uint32_t rank, int buffer,
                                          uint32_t parity, bool first) {
    constexpr int W = BATCHINV_WARP_SIZE;
#pragma unroll
    for (int offset = W / 2; offset > 0; offset >>= 1) v = ieee_add(v, BATCHINV_SHFL_XOR(v, offset));
    return push_reduce<C, TC>(v, ex, rank, buffer, parity, first, [](float a, float b) { return ieee_add(a, b); });
}

// Evict-first stores (st.global.cs) for the cluster forward's output, written once; speed only.
// The backward keeps plain loads and stores: with the same hints on x and grad_x it measures
// slower, while the forward gains a little (docs/tuning/log_softmax.md).
constexpr bool kForwardStreamStores = true;
constexpr bool kBackwardStreamHints = false;

// Refills segments k0 .. k0 + count - 1 with the same segments of the next row once every thread of
// the CTA is done with them.  Callers have already used the values they read from these segments
// (stored results computed from them), so each thread's shared-memory reads have completed before
// it reaches the barrier; the bulk copy (async proxy) cannot overwrite a slot that is still being
// read.  (A barrier right after the reads, before their values are used, is not enough: with it
// the backward's results differed from those of one cluster per row.)
template <typename S, int C, int TC>
__device__ __forceinline__ void refill_after_reading(const Slice<S, C, TC>& slice, const S* next_row, int64_t vocab,
                                                     uint8_t* segments, uint64_t* barriers, int k0, int count) {
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int k = k0; k < k0 + count && k < slice.segments; ++k) {
            refill_segment(slice, next_row, vocab, segments, barriers, k);
        }
    }
}

// The thread's merged state over its groups of the slice, in increasing k.  Two segments per
// step (both group states first, then the two merges in order): the same operations in the same
// order, with two independent group states in flight instead of one (speed only).
template <typename Codec, int C, int TC>
__device__ __forceinline__ State slice_state(const Slice<typename Codec::storage, C, TC>& slice,
                                             const uint8_t* shared_row, uint64_t* barriers, uint32_t parity,
                                             int64_t vocab) {
    State st{-INFINITY, 0.0f};
    int k = 0;
    for (; k + 1 < slice.segments && slice.group_of(k + 1) < slice.groups; k += 2) {
        hopper::barrier_wait(&barriers[k], parity);
        hopper::barrier_wait(&barriers[k + 1], parity);
        Group<Codec> first, second;
        read_group<Codec, C, TC>(first, shared_row, k);
        read_group<Codec, C, TC>(second, shared_row, k + 1);
        const State a = group_state(first, valid_in(slice.group_of(k), vocab));
        const State b = group_state(second, valid_in(slice.group_of(k + 1), vocab));
        st = merge(merge(st, a), b);
    }
    for (; k < slice.segments; ++k) {
        const int g = slice.group_of(k);
        if (g >= slice.groups) break;
        hopper::barrier_wait(&barriers[k], parity);
        Group<Codec> grp;
        read_group<Codec, C, TC>(grp, shared_row, k);
        st = merge(st, group_state(grp, valid_in(g, vocab)));
    }
    return st;
}

// Segments read before a refill of their slots in the second pass (one CTA barrier per batch).
constexpr int kRefillBatch = 4;

// Rows: a cluster handles rows blockIdx.x / C, + gridDim.x / C, ... (the host can launch at most
// as many clusters as fit at once, so that each loops over several rows: PERSISTENT_CASES, none by
// default; otherwise one cluster per row, and the loop runs once).  While the second pass of a row
// runs, the slots it has finished reading are refilled with the same segments of the cluster's
// next row, so that row's copies overlap this row's work.  Which cluster handles a row, and how
// many rows it handles, changes no operation of the row (speed only).  Each mbarrier completes one
// phase per row: row i of this CTA waits on parity i % 2.
template <typename InCodec, typename OutCodec, int C, int TC>
__device__ __forceinline__ void forward(const ForwardArgs& a) {
    using S = typename InCodec::storage;
    using O = typename OutCodec::storage;
    static_assert(TC % BATCHINV_WARP_SIZE == 0, "whole warps per CTA");
    extern __shared__ __align__(16) uint8_t shared_row[];
    __shared__ PushExchange<C, TC, float2> exchange;
    const int64_t vocab = a.vocab;
    const int64_t first_row = blockIdx.x / C;  // the same for every CTA of the cluster
    const int64_t row_step = gridDim.x / C;
    if (first_row >= a.rows) return;
    Slice<S, C, TC> slice;
    uint64_t* barriers = init_slice(slice, shared_row, vocab);
    const S* x_rows = static_cast<const S*>(a.x);
    init_push_exchange(exchange);
    start_row_copies(slice, x_rows + first_row * a.x_stride, vocab, shared_row, barriers);

    uint32_t parity = 0;
    uint32_t local_row = 0;  // rows of this cluster so far
    for (int64_t row = first_row; row < a.rows; row += row_step, parity ^= 1u, ++local_row) {
        const int64_t next = row + row_step;
        const S* next_x = next < a.rows ? x_rows + next * a.x_stride : nullptr;
        O* out = static_cast<O*>(a.out) + row * vocab;
        State st = slice_state<InCodec, C, TC>(slice, shared_row, barriers, parity, vocab);
        st = push_merge<C, TC>(st, exchange, slice.rank, static_cast<int>(local_row & 1u), (local_row >> 1) & 1u,
                               row == first_row);
        const float lse = ieee_add(st.m, logf(st.l));
        if (a.lse != nullptr && slice.rank == 0 && threadIdx.x == 0) a.lse[row] = lse;

        for (int k0 = 0; k0 < slice.segments; k0 += kRefillBatch) {
#pragma unroll
            for (int u = 0; u < kRefillBatch; ++u) {
                const int k = k0 + u;
                const int g = slice.group_of(k);
                if (k < slice.segments && g < slice.groups) {
                    Group<InCodec> grp;
                    read_group<InCodec, C, TC>(grp, shared_row, k);
                    write_output<InCodec, OutCodec, kForwardStreamStores>(out, grp, g, vocab, lse, true,
                                                                          warp_full(g, slice.groups));
                }
            }
            if (next_x != nullptr) refill_after_reading(slice, next_x, vocab, shared_row, barriers, k0, kRefillBatch);
        }
    }
    // Every part pushed to this CTA has arrived (its last wait) and nothing reads another CTA's
    // memory, so no CTA waits for the others before it exits.  (A cluster barrier here measures
    // slower.)
}

// How the backward's second pass loads x (speed only; the same operations on the same values):
// kBatch x groups per thread are loaded before their first use, and with kEarly the first batch
// is loaded at the start of the row, before the sum(dy) pass and its exchange wait, so the x
// stream's latency overlaps that work.  Loading 12 groups early measured faster for bf16 x /
// fp32 dy in 16 CTAs of 128 threads (T = 2048) but slower in 16 CTAs of 64 (1.87 ms against
// 1.63 with 4 loaded after the exchange, 4096 x 151936 on an H200); for bf16 x / bf16 dy
// (8 x 128) every deeper form measures slower.  Every other case loads 4 groups after the
// exchange (docs/tuning/log_softmax.md).
template <typename InCodec, typename OutCodec, int C, int TC>
struct XLoads {
    static constexpr int kBatch = 4;
    static constexpr bool kEarly = false;
};
template <>
struct XLoads<Bf16Codec, F32Codec, 16, 128> {
    static constexpr int kBatch = 12;
    static constexpr bool kEarly = true;
};

// Loads this thread's x groups of segments k0 .. k0 + kBatch - 1 (those inside the row).
template <typename InCodec, int kBatch, typename SliceT>
__device__ __forceinline__ void load_x_batch(Group<InCodec> (&xg)[kBatch], const SliceT& slice,
                                             const typename InCodec::storage* x, int k0, int64_t vocab) {
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
        const int g = slice.group_of(k0 + u);
        if (k0 + u < slice.segments && g < slice.groups) {
            load_group<InCodec, kBackwardStreamHints>(xg[u], x, g, vocab, true);
        }
    }
}

// Rows and refills as in forward above; the slots hold grad_out, x is streamed (see XLoads).
template <typename InCodec, typename OutCodec, int C, int TC>
__device__ __forceinline__ void backward(const BackwardArgs& a) {
    using S = typename InCodec::storage;
    using O = typename OutCodec::storage;
    static_assert(TC % BATCHINV_WARP_SIZE == 0, "whole warps per CTA");
    constexpr int kBatch = XLoads<InCodec, OutCodec, C, TC>::kBatch;
    constexpr bool kEarly = XLoads<InCodec, OutCodec, C, TC>::kEarly;
    extern __shared__ __align__(16) uint8_t shared_row[];
    __shared__ PushExchange<C, TC, float> exchange;
    const int64_t vocab = a.vocab;
    const int64_t first_row = blockIdx.x / C;
    const int64_t row_step = gridDim.x / C;
    if (first_row >= a.rows) return;
    Slice<O, C, TC> slice;
    uint64_t* barriers = init_slice(slice, shared_row, vocab);
    const O* grad_rows = static_cast<const O*>(a.grad_out);
    init_push_exchange(exchange);
    start_row_copies(slice, grad_rows + first_row * vocab, vocab, shared_row, barriers);

    uint32_t parity = 0;
    uint32_t local_row = 0;  // rows of this cluster so far
    for (int64_t row = first_row; row < a.rows; row += row_step, parity ^= 1u, ++local_row) {
        const int64_t next = row + row_step;
        const O* next_grad = next < a.rows ? grad_rows + next * vocab : nullptr;
        const S* x = static_cast<const S*>(a.x) + row * a.x_stride;
        S* grad_x = static_cast<S*>(a.grad_x) + row * vocab;
        const float lse = a.lse[row];

        Group<InCodec> xg[kBatch];
        if constexpr (kEarly) load_x_batch<InCodec, kBatch>(xg, slice, x, 0, vocab);

        float sum = 0.0f;
        for (int k = 0; k < slice.segments; ++k) {
            const int g = slice.group_of(k);
            if (g >= slice.groups) break;
            hopper::barrier_wait(&barriers[k], parity);
            Group<OutCodec> dy;
            read_group<OutCodec, C, TC>(dy, shared_row, k);
            sum = group_sum(dy, valid_in(g, vocab), sum);
        }
        const float dy_sum = push_sum<C, TC>(sum, exchange, slice.rank, static_cast<int>(local_row & 1u),
                                             (local_row >> 1) & 1u, row == first_row);

        for (int k0 = 0; k0 < slice.segments; k0 += kBatch) {
            if (!kEarly || k0 > 0) load_x_batch<InCodec, kBatch>(xg, slice, x, k0, vocab);
#pragma unroll
            for (int u = 0; u < kBatch; ++u) {
                const int g = slice.group_of(k0 + u);
                if (k0 + u >= slice.segments || g >= slice.groups) continue;
                Group<OutCodec> dy;
                read_group<OutCodec, C, TC>(dy, shared_row, k0 + u);
                write_grad<InCodec, OutCodec, kBackwardStreamHints>(grad_x, dy, xg[u], g, vocab, lse, dy_sum, true,
                                                                    warp_full(g, slice.groups));
            }
            if (next_grad != nullptr) refill_after_reading(slice, next_grad, vocab, shared_row, barriers, k0, kBatch);
        }
    }
    // As in forward: no wait for the other CTAs before exit.
}
}  // namespace cluster
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace lsm
}  // namespace batchinv

#define BATCHINV_LOG_SOFTMAX_FORWARD_KERNEL(SUFFIX, IN, OUT, T)                                   \
    extern "C" __global__ void __launch_bounds__(T) log_softmax_forward_##SUFFIX##_t##T(          \
        OUT::storage* out, float* lse, const IN::storage* x, int64_t rows, int64_t vocab,        \
        int64_t x_stride, int64_t smem_groups) {                                                 \
        const batchinv::lsm::ForwardArgs args{out, lse, x, rows, vocab, x_stride, smem_groups};   \
        batchinv::lsm::forward<IN, OUT, T>(args);                                                \
    }

// block = Block<T>::kThreads threads (T, or 1024 for T = 2048).
#define BATCHINV_LOG_SOFTMAX_BACKWARD_KERNEL(SUFFIX, IN, OUT, T)                                 \
    extern "C" __global__ void __launch_bounds__(batchinv::lsm::Block<T>::kThreads)             \
        log_softmax_backward_##SUFFIX##_t##T(                                                   \
            IN::storage* grad_x, const OUT::storage* grad_out, const IN::storage* x,            \
            const float* lse, int64_t rows, int64_t vocab, int64_t x_stride,                    \
            int64_t smem_groups) {                                                              \
        const batchinv::lsm::BackwardArgs args{grad_x, grad_out, x,        lse,                 \
                                               rows,   vocab,    x_stride, smem_groups};        \
        batchinv::lsm::backward<IN, OUT, T>(args);                                              \
    }

#define BATCHINV_LOG_SOFTMAX_KERNELS(SUFFIX, IN, OUT, T)     \
    BATCHINV_LOG_SOFTMAX_FORWARD_KERNEL(SUFFIX, IN, OUT, T)  \
    BATCHINV_LOG_SOFTMAX_BACKWARD_KERNEL(SUFFIX, IN, OUT, T)

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

// T = 2048: the backward with fp32 grad_out only, 1024 threads playing two tree threads each
// (keep in step with py/batchinv/gpu/log_softmax.py: WIDE_BACKWARD_SUFFIXES).
BATCHINV_LOG_SOFTMAX_BACKWARD_KERNEL(bf16_f32, batchinv::Bf16Codec, batchinv::F32Codec, 2048)
BATCHINV_LOG_SOFTMAX_BACKWARD_KERNEL(f16_f32, batchinv::F16Codec, batchinv::F32Codec, 2048)
BATCHINV_LOG_SOFTMAX_BACKWARD_KERNEL(f32_f32, batchinv::F32Codec, batchinv::F32Codec, 2048)

// Hopper cluster entries: C CTAs of TC threads per row (T = C * TC), grid.x = clusters * C with
// 1 <= clusters <= rows (each cluster loops over rows: see cluster::forward); dynamic
// shared memory = segments * (TC * 8 * sizeof(storage) + 8) bytes (see "Hopper (sm_90a) form").
// Other architectures get an entry that traps: the host launches these on sm_90 only.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define BATCHINV_LSM_HOPPER_ONLY(call) call
#define BATCHINV_LSM_CLUSTER_DIMS(C) __cluster_dims__(C, 1, 1)
#else
#define BATCHINV_LSM_HOPPER_ONLY(call) __trap()
#define BATCHINV_LSM_CLUSTER_DIMS(C)
#endif

#if !defined(__HIPCC__)
#define BATCHINV_LOG_SOFTMAX_CLUSTER_FORWARD_KERNEL(SUFFIX, IN, OUT, C, TC)                           \
    extern "C" BATCHINV_LSM_CLUSTER_DIMS(C) __global__ void __launch_bounds__(TC)                             \
        log_softmax_cluster_forward_##SUFFIX##_c##C##_t##TC(OUT::storage* out, float* lse,               \
                                                            const IN::storage* x, int64_t rows,          \
                                                            int64_t vocab, int64_t x_stride) {           \
        BATCHINV_LSM_HOPPER_ONLY((batchinv::lsm::cluster::forward<IN, OUT, C, TC>(                      \
            batchinv::lsm::ForwardArgs{out, lse, x, rows, vocab, x_stride, 0})));                       \
    }

#define BATCHINV_LOG_SOFTMAX_CLUSTER_BACKWARD_KERNEL(SUFFIX, IN, OUT, C, TC)                          \
    extern "C" BATCHINV_LSM_CLUSTER_DIMS(C) __global__ void __launch_bounds__(TC)                             \
        log_softmax_cluster_backward_##SUFFIX##_c##C##_t##TC(                                            \
            IN::storage* grad_x, const OUT::storage* grad_out, const IN::storage* x, const float* lse,  \
            int64_t rows, int64_t vocab, int64_t x_stride) {                                            \
        BATCHINV_LSM_HOPPER_ONLY((batchinv::lsm::cluster::backward<IN, OUT, C, TC>(                     \
            batchinv::lsm::BackwardArgs{grad_x, grad_out, x, lse, rows, vocab, x_stride, 0})));         \
    }

#define BATCHINV_LOG_SOFTMAX_CLUSTER_KERNELS(SUFFIX, IN, OUT, C, TC)     \
    BATCHINV_LOG_SOFTMAX_CLUSTER_FORWARD_KERNEL(SUFFIX, IN, OUT, C, TC)  \
    BATCHINV_LOG_SOFTMAX_CLUSTER_BACKWARD_KERNEL(SUFFIX, IN, OUT, C, TC)

// Cluster shapes (keep in step with py/batchinv/gpu/log_softmax.py: CLUSTER_SHAPES): 8 CTAs of 64
// threads (T = 512), 8 CTAs of 128 or 16 CTAs of 64 threads (T = 1024); and for the backward
// with fp32 grad_out 16 CTAs of 128 threads (T = 2048, WIDE_BACKWARD_SUFFIXES).  16 CTAs is a
// non-portable cluster size: the host opts each kernel in first.
#define BATCHINV_LOG_SOFTMAX_ALL_CLUSTERS(SUFFIX, IN, OUT)          \
    BATCHINV_LOG_SOFTMAX_CLUSTER_KERNELS(SUFFIX, IN, OUT, 8, 64)    \
    BATCHINV_LOG_SOFTMAX_CLUSTER_KERNELS(SUFFIX, IN, OUT, 8, 128)   \
    BATCHINV_LOG_SOFTMAX_CLUSTER_KERNELS(SUFFIX, IN, OUT, 16, 64)

BATCHINV_LOG_SOFTMAX_ALL_CLUSTERS(bf16_f32, batchinv::Bf16Codec, batchinv::F32Codec)
BATCHINV_LOG_SOFTMAX_ALL_CLUSTERS(bf16_bf16, batchinv::Bf16Codec, batchinv::Bf16Codec)
BATCHINV_LOG_SOFTMAX_ALL_CLUSTERS(bf16_f16, batchinv::Bf16Codec, batchinv::F16Codec)
BATCHINV_LOG_SOFTMAX_ALL_CLUSTERS(f16_f32, batchinv::F16Codec, batchinv::F32Codec)
BATCHINV_LOG_SOFTMAX_ALL_CLUSTERS(f16_bf16, batchinv::F16Codec, batchinv::Bf16Codec)
BATCHINV_LOG_SOFTMAX_ALL_CLUSTERS(f16_f16, batchinv::F16Codec, batchinv::F16Codec)
BATCHINV_LOG_SOFTMAX_ALL_CLUSTERS(f32_f32, batchinv::F32Codec, batchinv::F32Codec)
BATCHINV_LOG_SOFTMAX_ALL_CLUSTERS(f32_bf16, batchinv::F32Codec, batchinv::Bf16Codec)
BATCHINV_LOG_SOFTMAX_ALL_CLUSTERS(f32_f16, batchinv::F32Codec, batchinv::F16Codec)

BATCHINV_LOG_SOFTMAX_CLUSTER_BACKWARD_KERNEL(bf16_f32, batchinv::Bf16Codec, batchinv::F32Codec, 16, 128)
BATCHINV_LOG_SOFTMAX_CLUSTER_BACKWARD_KERNEL(f16_f32, batchinv::F16Codec, batchinv::F32Codec, 16, 128)
BATCHINV_LOG_SOFTMAX_CLUSTER_BACKWARD_KERNEL(f32_f32, batchinv::F32Codec, batchinv::F32Codec, 16, 128)
#endif  // !__HIPCC__

// Embedding: a row gather and its weight gradient.
//
// Forward  out[i, :] = weight[ids[i], :]
//   out     [num_ids, row_bytes]  any dtype, viewed as bytes; contiguous
//   weight  [vocab, row_bytes]    same dtype as out; contiguous
//   ids     [num_ids]             int32 or int64 (one kernel each)
//   first_bad_position  [1] u64, preset to UINT64_MAX by the caller; receives the smallest
//                       position whose id is outside [0, vocab).  Such rows are not read:
//                       their output bytes are set to 0xFF, a NaN in fp32, bf16 and fp16,
//                       so a caller that skips the check still cannot miss them.
//   Launch: grid.x = num_ids (one CTA per output row), any block.x.
//   Invariance: a copy, no arithmetic.  The access width (16/8/4/2/1 bytes) follows the
//   pointers' alignment but moves the same bytes, so the output is weight[ids] bit for bit.
//
// Backward grad_weight[v, c] = sum over positions p with ids[p] == v of grad_out[p, c]
//   sorted_positions [num_ids] i64   positions ordered by id, stable (equal ids keep
//                                    increasing position order): torch.sort(stable=True)
//   segment_offsets  [num_segments + 1] i64   segment s covers sorted_positions[off[s]:off[s+1]]
//   segment_ids      [num_segments] i64       the id shared by segment s
//   grad_out [num_ids, hidden], grad_weight [vocab, hidden] (zeroed by the caller), same dtype
//   A segment whose id is outside [0, vocab) (possible only when the caller skipped the id
//   check) writes nothing: its gradient is dropped, never stored out of bounds.
//   Launch: grid = (num_segments, ceil(hidden / block.x)), any block.x.
//   Invariance: each output element is a sequential fp32 sum over its own occurrences in
//   increasing position order, rounded once.  No atomics, so the result does not depend on
//   scheduling, and no other id's occurrences change it.
//
// Backward, runs: the same sums, with the runs of equal ids found in the sorted ids
// themselves, so the caller builds no segment arrays and reads nothing back to the host.
//   sorted_ids       [num_ids] i64   the ids in sorted order (the stable sort's keys)
//   sorted_positions [num_ids] i64   their positions, as above
//   The run [begin, end) of one id is summed where the walk reaches `begin` (begin = 0, or
//   sorted_ids[begin - 1] differs); an id outside [0, vocab) writes nothing.
//   Launch: grid = (any x >= 1, ceil(hidden / block.x)), any block.x; CTA x takes the sorted
//   positions x, x + grid.x, ... and sums the runs that start there.
//   Invariance: each (run, column) is summed by one thread with segment_sum, as above; the
//   grid only decides which thread, never the adds' order.
//
// Backward, the sort of the ids (num_ids <= the host's SORT_MAX_IDS): one CTA sorts the keys
// (id << 32) + position with a bitonic network in shared memory and writes them back split.
//   ids              [num_ids] i64
//   sorted_ids       [num_ids] i64   the ids in increasing order, an id outside [0, vocab)
//                                    replaced by -1 (the runs kernel drops both alike)
//   sorted_positions [num_ids] i64   positions in the order of their keys: equal ids keep
//                                    increasing position order, torch.sort(stable=True)'s
//   Launch: grid = (1), block = (any power of two <= 1024), dynamic shared memory 8 * keys
//   bytes, keys = the power of two >= max(num_ids, 2) (padding keys INT64_MAX sort last).
//   Every key is distinct (its low 32 bits are its position), so the sorted order is the one
//   total order of the keys whatever the network or the thread count: one result.
#include "common/portability.cuh"

namespace batchinv {

template <typename Word, typename Index>
__device__ __forceinline__ void copy_row(uint8_t* out, const uint8_t* weight, const Index* ids,
                                         int64_t row, int64_t row_bytes) {
    const int64_t id = static_cast<int64_t>(ids[row]);
    const Word* src = reinterpret_cast<const Word*>(weight + id * row_bytes);
    Word* dst = reinterpret_cast<Word*>(out + row * row_bytes);
    const int64_t words = row_bytes / static_cast<int64_t>(sizeof(Word));
    constexpr int kUnroll = 4;
    int64_t w = threadIdx.x;
    // Issue several independent loads before the first store to keep memory busy.
    for (; w + (kUnroll - 1) * blockDim.x < words; w += kUnroll * blockDim.x) {
        Word buffer[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) buffer[u] = src[w + u * blockDim.x];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) dst[w + u * blockDim.x] = buffer[u];
    }
    for (; w < words; w += blockDim.x) dst[w] = src[w];
}

template <typename Index>
__device__ __forceinline__ void embedding_forward(uint8_t* out, const uint8_t* weight,
                                                  const Index* ids, int64_t num_ids,
                                                  int64_t row_bytes, int64_t vocab,
                                                  unsigned long long* first_bad_position) {
    const int64_t row = blockIdx.x;
    if (row >= num_ids) return;
    const int64_t id = static_cast<int64_t>(ids[row]);
    if (id < 0 || id >= vocab) {
        if (threadIdx.x == 0) atomicMin(first_bad_position, static_cast<unsigned long long>(row));
        uint8_t* dst = out + row * row_bytes;
        for (int64_t b = threadIdx.x; b < row_bytes; b += blockDim.x) dst[b] = 0xFF;
        return;
    }
    const uintptr_t alignment =
        reinterpret_cast<uintptr_t>(out) | reinterpret_cast<uintptr_t>(weight) |
        static_cast<uintptr_t>(row_bytes);
    if ((alignment & 15) == 0) {
        copy_row<uint4>(out, weight, ids, row, row_bytes);
    } else if ((alignment & 7) == 0) {
        copy_row<uint2>(out, weight, ids, row, row_bytes);
    } else if ((alignment & 3) == 0) {
        copy_row<uint32_t>(out, weight, ids, row, row_bytes);
    } else if ((alignment & 1) == 0) {
        copy_row<uint16_t>(out, weight, ids, row, row_bytes);
    } else {
        copy_row<uint8_t>(out, weight, ids, row, row_bytes);
    }
}

// The gradient of one column of one segment: grad_out's rows at sorted_positions[begin:end],
// added in that order in fp32 and rounded once by the caller's store.
template <typename Codec>
__device__ __forceinline__ float segment_sum(const typename Codec::storage* grad_out,
                                             const int64_t* sorted_positions, int64_t begin,
                                             int64_t end, int64_t hidden, int64_t column) {
    float sum = 0.0f;
    for (int64_t k = begin; k < end; ++k) {
        sum = __fadd_rn(sum, Codec::load(grad_out[sorted_positions[k] * hidden + column]));
    }
    return sum;
}

template <typename Codec>
__device__ __forceinline__ void embedding_backward(typename Codec::storage* grad_weight,
                                                   const typename Codec::storage* grad_out,
                                                   const int64_t* sorted_positions,
                                                   const int64_t* segment_offsets,
                                                   const int64_t* segment_ids, int64_t hidden,
                                                   int64_t vocab) {
    const int64_t segment = blockIdx.x;
    const int64_t column = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
    if (column >= hidden) return;
    const int64_t id = segment_ids[segment];
    if (id < 0 || id >= vocab) return;
    grad_weight[id * hidden + column] = Codec::store(segment_sum<Codec>(
        grad_out, sorted_positions, segment_offsets[segment], segment_offsets[segment + 1],
        hidden, column));
}

template <typename Codec>
__device__ __forceinline__ void embedding_backward_runs(typename Codec::storage* grad_weight,
                                                        const typename Codec::storage* grad_out,
                                                        const int64_t* sorted_ids,
                                                        const int64_t* sorted_positions,
                                                        int64_t num_ids, int64_t hidden,
                                                        int64_t vocab) {
    const int64_t column = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
    if (column >= hidden) return;
    for (int64_t begin = blockIdx.x; begin < num_ids; begin += gridDim.x) {
        const int64_t id = sorted_ids[begin];
        if (begin > 0 && sorted_ids[begin - 1] == id) continue;  // inside a run: its start sums it
        if (id < 0 || id >= vocab) continue;
        int64_t end = begin + 1;
        while (end < num_ids && sorted_ids[end] == id) ++end;
        grad_weight[id * hidden + column] = Codec::store(
            segment_sum<Codec>(grad_out, sorted_positions, begin, end, hidden, column));
    }
}

// Bitonic sort of `keys` ascending in shared memory by the CTA's threads (a power of two).
__device__ __forceinline__ void bitonic_sort(long long* keys, int keys_count) {
    for (int size = 2; size <= keys_count; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int i = threadIdx.x; i < keys_count; i += blockDim.x) {
                const int partner = i ^ stride;
                if (partner > i) {
                    const long long a = keys[i];
                    const long long b = keys[partner];
                    const bool ascending = (i & size) == 0;
                    if ((a > b) == ascending) {
                        keys[i] = b;
                        keys[partner] = a;
                    }
                }
            }
            __syncthreads();
        }
    }
}

__device__ __forceinline__ void embedding_sort_ids(const int64_t* ids, int64_t num_ids, int64_t vocab,
                                                   int64_t* sorted_ids, int64_t* sorted_positions,
                                                   int keys_count) {
    extern __shared__ long long keys[];  // [keys_count]
    for (int i = threadIdx.x; i < keys_count; i += blockDim.x) {
        long long key = 0x7fffffffffffffffLL;  // padding: after every real key
        if (i < num_ids) {
            const int64_t id = ids[i];
            const long long row = (id >= 0 && id < vocab) ? static_cast<long long>(id) : -1LL;
            key = static_cast<long long>(static_cast<unsigned long long>(row) << 32) + i;
        }
        keys[i] = key;
    }
    __syncthreads();
    bitonic_sort(keys, keys_count);
    for (int64_t i = threadIdx.x; i < num_ids; i += blockDim.x) {
        const long long key = keys[i];
        sorted_ids[i] = key >> 32;  // arithmetic: -1 stays -1
        sorted_positions[i] = key & 0xffffffffLL;
    }
}

}  // namespace batchinv

extern "C" __global__ void __launch_bounds__(1024)
    embedding_sort_ids(const int64_t* ids, int64_t num_ids, int64_t vocab, int64_t* sorted_ids,
                       int64_t* sorted_positions, int keys_count) {
    batchinv::embedding_sort_ids(ids, num_ids, vocab, sorted_ids, sorted_positions, keys_count);
}

extern "C" __global__ void embedding_forward_i32(uint8_t* out, const uint8_t* weight,
                                                 const int32_t* ids, int64_t num_ids,
                                                 int64_t row_bytes, int64_t vocab,
                                                 unsigned long long* first_bad_position) {
    batchinv::embedding_forward(out, weight, ids, num_ids, row_bytes, vocab, first_bad_position);
}

extern "C" __global__ void embedding_forward_i64(uint8_t* out, const uint8_t* weight,
                                                 const int64_t* ids, int64_t num_ids,
                                                 int64_t row_bytes, int64_t vocab,
                                                 unsigned long long* first_bad_position) {
    batchinv::embedding_forward(out, weight, ids, num_ids, row_bytes, vocab, first_bad_position);
}

#define BATCHINV_EMBEDDING_BACKWARD(SUFFIX, CODEC)                                           \
    extern "C" __global__ void embedding_backward_##SUFFIX(                                  \
        CODEC::storage* grad_weight, const CODEC::storage* grad_out,                          \
        const int64_t* sorted_positions, const int64_t* segment_offsets,                      \
        const int64_t* segment_ids, int64_t hidden, int64_t vocab) {                          \
        batchinv::embedding_backward<CODEC>(grad_weight, grad_out, sorted_positions,          \
                                            segment_offsets, segment_ids, hidden, vocab);     \
    }

BATCHINV_EMBEDDING_BACKWARD(bf16, batchinv::Bf16Codec)
BATCHINV_EMBEDDING_BACKWARD(f16, batchinv::F16Codec)
BATCHINV_EMBEDDING_BACKWARD(f32, batchinv::F32Codec)

#define BATCHINV_EMBEDDING_BACKWARD_RUNS(SUFFIX, CODEC)                                      \
    extern "C" __global__ void embedding_backward_runs_##SUFFIX(                             \
        CODEC::storage* grad_weight, const CODEC::storage* grad_out, const int64_t* sorted_ids, \
        const int64_t* sorted_positions, int64_t num_ids, int64_t hidden, int64_t vocab) {    \
        batchinv::embedding_backward_runs<CODEC>(grad_weight, grad_out, sorted_ids,           \
                                                 sorted_positions, num_ids, hidden, vocab);   \
    }

BATCHINV_EMBEDDING_BACKWARD_RUNS(bf16, batchinv::Bf16Codec)
BATCHINV_EMBEDDING_BACKWARD_RUNS(f16, batchinv::F16Codec)
BATCHINV_EMBEDDING_BACKWARD_RUNS(f32, batchinv::F32Codec)

// Hopper (sm_90a) building blocks: TMA copies, mbarriers, wgmma descriptors and fences.
// Everything here compiles to nothing outside an sm_90a pass, so files that include it
// still build for sm_80, PTX and HIP; kernels guard their Hopper bodies the same way.
#pragma once

#include "cp_async.cuh"
#include "portability.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
namespace batchinv {
namespace hopper {

using batchinv::smem_address;  // common/cp_async.cuh

// Shared-memory matrix descriptor for a tile written by TMA with 128-byte swizzling, 8-row
// core groups 1024 bytes apart.  K-major (rows of 64 bf16/f16, 128 bytes): the leading byte
// offset is unused, 16.  M/N-major (CUTLASS's canonical 128B-swizzled MN-major layout
// ((8 x 8 elements, m), (8, k)) : ((1, 8, LBO), (64, SBO)), read with the wgmma transpose
// flags): leading_bytes is the distance between 64-element M/N blocks.
__device__ __forceinline__ uint64_t smem_descriptor_128b(const void* tile, uint32_t leading_bytes = 16) {
    const uint64_t address = smem_address(tile);
    uint64_t desc = (address & 0x3FFFF) >> 4;
    desc |= static_cast<uint64_t>(leading_bytes >> 4) << 16;  // leading byte offset
    desc |= static_cast<uint64_t>(1024 >> 4) << 32;           // stride byte offset: one 8-row group
    desc |= 1ull << 62;                                       // 128-byte swizzle
    return desc;
}

__device__ __forceinline__ void barrier_init(uint64_t* barrier, uint32_t arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_address(barrier)), "r"(arrivals));
}

__device__ __forceinline__ void fence_barrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void barrier_expect_bytes(uint64_t* barrier, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_address(barrier)), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void barrier_arrive(uint64_t* barrier) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_address(barrier)) : "memory");
}

__device__ __forceinline__ void barrier_wait(uint64_t* barrier, uint32_t phase) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "wait:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra wait;\n"
        "}\n" ::"r"(smem_address(barrier)),
        "r"(phase)
        : "memory");
}

// Arrives on `barrier` once every cp.async this thread issued before has landed.  .noinc: the
// arrival is one of the barrier's expected arrivals (counted at init), not an extra one.
__device__ __forceinline__ void barrier_arrive_on_copies(uint64_t* barrier) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_address(barrier)) : "memory");
}

// Copies the box at (column, row) of a 2-D tensor map into shared memory; completion is
// counted in bytes on `barrier`.  Out-of-bounds elements arrive as zeros.
__device__ __forceinline__ void tma_load_2d(void* destination, const TensorMap& map, uint64_t* barrier,
                                            int32_t column, int32_t row) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], "
        "[%2];" ::"r"(smem_address(destination)),
        "l"(reinterpret_cast<uint64_t>(&map)), "r"(smem_address(barrier)), "r"(column), "r"(row)
        : "memory");
}

// Orders this thread's generic-proxy accesses to shared memory (cp.async writes, plain stores
// and reads) before later async-proxy ones (wgmma operand reads, TMA and bulk-copy writes).
__device__ __forceinline__ void fence_proxy_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int Pending>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(Pending) : "memory");
}

// Pins register values around an asynchronous wgmma: without it the compiler may move their
// reads or writes across the issue or the wait, and ptxas then serialises the pipeline.
template <int N>
__device__ __forceinline__ void fence_operands(float* r) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
// The same for a 16-bit register A operand: N k16 steps of mma.sync's 4-register fragments.
template <int N>
__device__ __forceinline__ void fence_registers(uint32_t (&r)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
}

template <uint32_t Registers>
__device__ __forceinline__ void release_registers() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(Registers));
}
template <uint32_t Registers>
__device__ __forceinline__ void claim_registers() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(Registers));
}

}  // namespace hopper
}  // namespace batchinv
#endif

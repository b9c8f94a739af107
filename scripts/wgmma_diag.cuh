// Shared pieces of the stand-alone wgmma diagnostics (scripts/wgmma_ceiling.cu, scripts/attn_loop_model.cu; not
// part of the library): shared-memory operand setup, wgmma sync helpers, and the host-side timing of one kernel.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
// 128B-swizzled K-major operand, rows of 128 bytes, k0 = byte offset of the k step
__device__ __forceinline__ uint64_t desc128(uint32_t img, int k0) {
    return (uint64_t)(((img + k0) & 0x3FFFF) >> 4) | (1ull << 16) | ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
template <int N, typename T> __device__ __forceinline__ void rfence(T (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(*reinterpret_cast<uint32_t*>(&r[i]))::"memory");
}
// 1024-aligned operand area of `bytes` filled with a fixed pattern (bits limited by `mask`: no e4m3 NaNs with 0x77),
// made visible to the async proxy; every thread of the CTA calls it
__device__ __forceinline__ uint8_t* fill_operands(uint8_t* sm_raw, int bytes, uint8_t mask) {
    uint8_t* sm = sm_raw + ((1024u - (smem_u32(sm_raw) & 1023u)) & 1023u);
    for (int i = threadIdx.x; i < bytes; i += blockDim.x) sm[i] = (uint8_t)((i * 37 + 11) & mask);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    return sm;
}

// Runs launch(iters, cycles, sink) once as warm-up (iters / 10) and once timed with CUDA events. The kernel writes
// its clock64 cycles per warpgroup to cycles[] (up to 3 per CTA); returned: milliseconds and CTA 0's first value.
struct Timed { float ms; long long cycles; };
template <typename Launch> Timed time_launch(int nsm, int iters, Launch launch) {
    long long* cyc;
    float* sink;
    cudaMalloc(&cyc, nsm * 3 * sizeof(long long));
    cudaMalloc(&sink, 1024 * sizeof(float));
    launch(iters / 10, cyc, sink);
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    cudaEventRecord(e0);
    launch(iters, cyc, sink);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    Timed t{0.f, 0};
    cudaEventElapsedTime(&t.ms, e0, e1);
    cudaMemcpy(&t.cycles, cyc, sizeof(long long), cudaMemcpyDeviceToHost);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaFree(cyc);
    cudaFree(sink);
    return t;
}

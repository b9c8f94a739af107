// Issue rate of the exponential on one SM (issue 4 diagnostics): cycles per warp instruction per SM sub-partition
// for MUFU.EX2 (f32), ex2.approx.f16x2 (two results per lane) and a mixed FFMA + EX2 stream, with 1, 2 or 4 warps
// per sub-partition. Build: nvcc -O3 -arch=sm_90a -o mufu_rate mufu_rate.cu; run: ./mufu_rate
#include <cstdint>
#include <cstdio>
#include <cuda_fp16.h>

constexpr int kVals = 32, kIters = 512;

template <int MODE>
__global__ void rate(float* out, long long* cyc) {
    float v[kVals];
    uint32_t h[kVals];
#pragma unroll
    for (int i = 0; i < kVals; ++i) {
        v[i] = -0.001f * (threadIdx.x + i);
        h[i] = 0x3c003c00u ^ (threadIdx.x + i);
    }
    __syncthreads();
    const long long t0 = clock64();
    for (int it = 0; it < kIters; ++it) {
#pragma unroll
        for (int i = 0; i < kVals; ++i) {
            if constexpr (MODE == 0) {
                asm volatile("ex2.approx.ftz.f32 %0, %0;" : "+f"(v[i]));
            } else if constexpr (MODE == 1) {
                asm volatile("ex2.approx.f16x2 %0, %0;" : "+r"(h[i]));
            } else {  // the softmax's mix per score: FFMA (argument) + EX2
                asm volatile("fma.rn.f32 %0, %0, 0.5, -1.0;\n ex2.approx.ftz.f32 %0, %0;" : "+f"(v[i]));
            }
        }
    }
    __syncthreads();
    const long long t1 = clock64();
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < kVals; ++i) s += v[i] + __half2float(__ushort_as_half((unsigned short)h[i]));
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
    if (threadIdx.x == 0) cyc[blockIdx.x] = t1 - t0;
}

int main() {
    float* out;
    long long* cyc;
    cudaMalloc(&out, 132 * 1024 * sizeof(float));
    cudaMalloc(&cyc, 132 * sizeof(long long));
    const char* names[3] = {"ex2.f32", "ex2.f16x2", "ffma+ex2.f32"};
    for (int mode = 0; mode < 3; ++mode)
        for (int threads : {128, 256, 512}) {
            for (int rep = 0; rep < 2; ++rep) {
                if (mode == 0) rate<0><<<132, threads>>>(out, cyc);
                if (mode == 1) rate<1><<<132, threads>>>(out, cyc);
                if (mode == 2) rate<2><<<132, threads>>>(out, cyc);
            }
            long long c[132];
            cudaMemcpy(c, cyc, sizeof(c), cudaMemcpyDeviceToHost);
            const int warps_per_smsp = threads / 32 / 4;
            const double per = (double)c[0] / ((double)kIters * kVals * warps_per_smsp);
            printf("%-14s %d warps/SMSP: %.2f cycles per warp instruction (per SMSP)\n", names[mode], warps_per_smsp, per);
        }
    return cudaDeviceSynchronize() != cudaSuccess;
}

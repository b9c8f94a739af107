// Which pipes the softmax's slow instructions share (issue 4): per-SM throughput of MUFU.EX2, of the e4m3x2
// conversion (F2FP), of both interleaved as in the kernel (2 EX2 per conversion), and of PRMT/IADD for comparison.
// If "ex2+cvt" takes as long as "ex2" plus "cvt", they share one pipe and the conversion, not only the exponential,
// bounds the softmax. Build: nvcc -O3 -arch=sm_90a -o pipe_probe scripts/pipe_probe.cu; run: ./pipe_probe
#include <cstdio>
#include <cuda_runtime.h>
#include <stdint.h>

constexpr int kIters = 4096, kChains = 8;

__device__ __forceinline__ float ex2(float x) {
    float y;
    asm volatile("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ uint32_t cvt(float a, float b) {
    uint16_t r;
    asm volatile("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(r) : "f"(a), "f"(b));
    return r;
}

// mode 0: ex2 only; 1: cvt only; 2: 2 ex2 + 1 cvt per step; 3: prmt only; 4: 2 ex2 + 1 cvt + 2 ffma + 2 iadd
template <int MODE>
__global__ void probe(float* out, float seed) {
    float x[kChains];
    uint32_t u[kChains];
#pragma unroll
    for (int c = 0; c < kChains; ++c) { x[c] = seed * (threadIdx.x + c); u[c] = threadIdx.x * 7u + c; }
    for (int i = 0; i < kIters; ++i) {
#pragma unroll
        for (int c = 0; c < kChains; ++c) {
            if (MODE == 0) { x[c] = ex2(x[c]); }
            if (MODE == 1) { u[c] += cvt(x[c], __uint_as_float(u[c])); }
            if (MODE == 2) { const float a = ex2(x[c]), b = ex2(a); u[c] += cvt(a, b); x[c] = b; }
            if (MODE == 3) { u[c] = __byte_perm(u[c], u[(c + 1) % kChains], 0x5140); }
            if (MODE == 4) {
                const float a = ex2(fmaf(__int_as_float(u[c] + 0x4B400000), 0.5f, x[c]));
                const float b = ex2(fmaf(__int_as_float(u[c] + 0x4B400001), 0.25f, a));
                u[c] += cvt(a, b);
                x[c] = b;
            }
        }
    }
    float s = 0.f;
#pragma unroll
    for (int c = 0; c < kChains; ++c) s += x[c] + (float)u[c];
    if (s == 1.2345f) out[threadIdx.x] = s;
}

template <int MODE>
float run(const char* name, int per_step_insts) {
    float* out;
    cudaMalloc(&out, 4096 * sizeof(float));
    int dev = 0, sms = 0, clk = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    cudaDeviceGetAttribute(&clk, cudaDevAttrClockRate, dev);  // kHz
    const int blocks = sms * 2, threads = 512;
    probe<MODE><<<blocks, threads>>>(out, 1e-3f);
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    cudaEventRecord(a);
    for (int r = 0; r < 5; ++r) probe<MODE><<<blocks, threads>>>(out, 1e-3f);
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms = 0.f;
    cudaEventElapsedTime(&ms, a, b);
    ms /= 5;
    const double steps = (double)blocks * threads * kIters * kChains;  // lane-steps
    const double per_sm_clk = steps / sms / (ms * 1e-3 * clk * 1e3);  // lane-steps per SM per clock (nominal clock)
    printf("%-16s %8.3f ms  %7.2f lane-steps/SM/clk  %7.2f lane-insts/SM/clk (%d insts/step)\n", name, ms,
           per_sm_clk, per_sm_clk * per_step_insts, per_step_insts);
    cudaFree(out);
    return ms;
}

int main() {
    run<0>("ex2", 1);
    run<1>("cvt e4m3x2", 1);
    run<2>("2 ex2 + cvt", 3);
    run<3>("prmt", 1);
    run<4>("softmax-like", 7);
    return 0;
}

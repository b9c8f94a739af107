// Model of the Hopper attention kernel's consumer loop (issue 4 diagnostics, not part of the library): 2 consumer
// warpgroups, operands resident in shared memory (no loads, no producer), the real softmax instruction mix, and
// switchable issue orders / ping-pong / exp2 emulated on the FMA pipe for EMU of every 16 scores. Shows which loop
// schedule can reach what speed before it is built into the kernel.
// Build: nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -o attn_loop_model scripts/attn_loop_model.cu
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "wgmma_diag.cuh"

__device__ __forceinline__ void rfence_pa(uint32_t (&r)[4][4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
}
__device__ __forceinline__ void named_sync(int id, int n) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void named_arrive(int id, int n) { asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ float ex2(float x) { float y; asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x)); return y; }
__device__ __forceinline__ uint32_t cvt2(float lo, float hi) {
    uint16_t r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}
// 2^y on the FMA pipe: round to nearest integer j with the 1.5 * 2^23 trick, 2^(y - j) by a degree-3 polynomial
// (relative error 7.5e-5 on [-0.5, 0.5]), j added to the exponent field
__device__ __forceinline__ float ex2_fma(float y) {
    y = fmaxf(y, -126.f);
    const float t = y + 12582912.f;
    const float f = y - (t - 12582912.f);
    float p = fmaf(0.05517132f, f, 0.24261054f);
    p = fmaf(p, f, 0.69326099f);
    p = fmaf(p, f, 0.99992811f);
    return __int_as_float(__float_as_int(p) + (__float_as_int(t) << 23));
}

__device__ __forceinline__ void wgmma_s8_ss(int (&d)[64], uint64_t da, uint64_t db, int accum) {
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p;\n}\n"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]), "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]), "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31]), "+r"(d[32]), "+r"(d[33]), "+r"(d[34]), "+r"(d[35]), "+r"(d[36]), "+r"(d[37]), "+r"(d[38]), "+r"(d[39]), "+r"(d[40]), "+r"(d[41]), "+r"(d[42]), "+r"(d[43]), "+r"(d[44]), "+r"(d[45]), "+r"(d[46]), "+r"(d[47]), "+r"(d[48]), "+r"(d[49]), "+r"(d[50]), "+r"(d[51]), "+r"(d[52]), "+r"(d[53]), "+r"(d[54]), "+r"(d[55]), "+r"(d[56]), "+r"(d[57]), "+r"(d[58]), "+r"(d[59]), "+r"(d[60]), "+r"(d[61]), "+r"(d[62]), "+r"(d[63]) : "l"(da), "l"(db), "r"(accum));
}
__device__ __forceinline__ void wgmma_e4_rs(float (&d)[64], const uint32_t* a, uint64_t db, int accum) {
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accum));
}

__device__ __forceinline__ void wgmma_e4_rs64(float* d, const uint32_t* a, uint64_t db, int accum) {
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accum));
}

// P~V with 8 extra V^T rows of ones: columns 128..135 of the accumulator are the row sums of P~
__device__ __forceinline__ void wgmma_e4_rs136(float (&d)[68], const uint32_t* a, uint64_t db, int accum) {
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %73, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n136k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67}, {%68, %69, %70, %71}, %72, p, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accum));
}
__device__ __forceinline__ uint32_t h2_of(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ uint32_t ex2_h2(uint32_t x) {
    uint32_t r;
    asm("ex2.approx.f16x2 %0, %1;\n" : "=r"(r) : "r"(x));
    return r;
}
__device__ __forceinline__ uint32_t e4m3_of_h2(uint32_t x) {
    uint16_t r;
    asm("cvt.rn.satfinite.e4m3x2.f16x2 %0, %1;\n" : "=h"(r) : "r"(x));
    return r;
}
__device__ __forceinline__ uint32_t hadd2(uint32_t a, uint32_t b) {
    uint32_t r;
    asm("add.rn.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

// the first wgmma of a chain (scale-d = 0) with write-only accumulators: the old values are not live
__device__ __forceinline__ void wgmma_s8_ss_first(int (&d)[64], uint64_t da, uint64_t db) {
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, 0, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p;\n}\n"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]), "=r"(d[4]), "=r"(d[5]), "=r"(d[6]), "=r"(d[7]), "=r"(d[8]), "=r"(d[9]), "=r"(d[10]), "=r"(d[11]), "=r"(d[12]), "=r"(d[13]), "=r"(d[14]), "=r"(d[15]), "=r"(d[16]), "=r"(d[17]), "=r"(d[18]), "=r"(d[19]), "=r"(d[20]), "=r"(d[21]), "=r"(d[22]), "=r"(d[23]), "=r"(d[24]), "=r"(d[25]), "=r"(d[26]), "=r"(d[27]), "=r"(d[28]), "=r"(d[29]), "=r"(d[30]), "=r"(d[31]), "=r"(d[32]), "=r"(d[33]), "=r"(d[34]), "=r"(d[35]), "=r"(d[36]), "=r"(d[37]), "=r"(d[38]), "=r"(d[39]), "=r"(d[40]), "=r"(d[41]), "=r"(d[42]), "=r"(d[43]), "=r"(d[44]), "=r"(d[45]), "=r"(d[46]), "=r"(d[47]), "=r"(d[48]), "=r"(d[49]), "=r"(d[50]), "=r"(d[51]), "=r"(d[52]), "=r"(d[53]), "=r"(d[54]), "=r"(d[55]), "=r"(d[56]), "=r"(d[57]), "=r"(d[58]), "=r"(d[59]), "=r"(d[60]), "=r"(d[61]), "=r"(d[62]), "=r"(d[63]) : "l"(da), "l"(db));
}
__device__ __forceinline__ void wgmma_e4_rs136_first(float (&d)[68], const uint32_t* a, uint64_t db) {
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, 0, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n136k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67}, {%68, %69, %70, %71}, %72, p, 1, 1;\n}\n"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7]), "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]), "=f"(d[14]), "=f"(d[15]), "=f"(d[16]), "=f"(d[17]), "=f"(d[18]), "=f"(d[19]), "=f"(d[20]), "=f"(d[21]), "=f"(d[22]), "=f"(d[23]), "=f"(d[24]), "=f"(d[25]), "=f"(d[26]), "=f"(d[27]), "=f"(d[28]), "=f"(d[29]), "=f"(d[30]), "=f"(d[31]), "=f"(d[32]), "=f"(d[33]), "=f"(d[34]), "=f"(d[35]), "=f"(d[36]), "=f"(d[37]), "=f"(d[38]), "=f"(d[39]), "=f"(d[40]), "=f"(d[41]), "=f"(d[42]), "=f"(d[43]), "=f"(d[44]), "=f"(d[45]), "=f"(d[46]), "=f"(d[47]), "=f"(d[48]), "=f"(d[49]), "=f"(d[50]), "=f"(d[51]), "=f"(d[52]), "=f"(d[53]), "=f"(d[54]), "=f"(d[55]), "=f"(d[56]), "=f"(d[57]), "=f"(d[58]), "=f"(d[59]), "=f"(d[60]), "=f"(d[61]), "=f"(d[62]), "=f"(d[63]), "=f"(d[64]), "=f"(d[65]), "=f"(d[66]), "=f"(d[67]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

__device__ int g_random_operands;
template <int ORDER, int PP, int EMU, int EXH, int NWG>
__global__ void __launch_bounds__(128 * NWG, 1) model_kernel(int iters, long long* cycles, float* sink, float scale) {
    extern __shared__ __align__(1024) uint8_t sm_raw[];
    uint8_t* sm = fill_operands(sm_raw, 48 * 1024, 0x37);
    if (g_random_operands) {  // dense random bytes (no e4m3 NaN): the tensor cores' power depends on the data
        for (int i = threadIdx.x; i < 48 * 1024; i += blockDim.x) {
            uint32_t h = (uint32_t)i * 2654435761u;
            h ^= h >> 15;
            h *= 2246822519u;
            h ^= h >> 13;
            uint8_t b = (uint8_t)h;
            if ((b & 0x7F) == 0x7F) b ^= 1;
            sm[i] = b;
        }
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
    }
    const int cw = threadIdx.x >> 7, lane = threadIdx.x & 31;
    const uint32_t sQ = smem_u32(sm) + cw * 8192, sK = smem_u32(sm) + 16384, sV = smem_u32(sm) + 32768;
    int acc[64];
    uint32_t pa[4][4];
    constexpr int NB = EXH == 2 ? 68 : 64;
    float blk[NB], o[64];
#pragma unroll
    for (int i = 0; i < NB; ++i) blk[i] = 0.f;
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.f;
    float m0 = -1e30f, m1 = -1e30f, l0 = 0.f, l1 = 0.f, al0 = 1.f, al1 = 1.f;
    const float sc = scale * (1.f + 1e-3f * (threadIdx.x & 3));
    auto issue_qk = [&](int k) {
        if (ORDER == 6 && k == 0) wgmma_s8_ss_first(acc, desc128(sQ, 0), desc128(sK, 0));
        else wgmma_s8_ss(acc, desc128(sQ, 32 * k), desc128(sK, 32 * k), k);
    };
    auto issue_pv = [&](int k) {
        if constexpr (EXH == 2 && ORDER == 6) {
            if (k == 0) wgmma_e4_rs136_first(blk, pa[0], desc128(sV, 0));
            else wgmma_e4_rs136(blk, pa[k], desc128(sV, 32 * k), k);
        } else if constexpr (EXH == 2) wgmma_e4_rs136(blk, pa[k], desc128(sV, 32 * k), k);
        else wgmma_e4_rs(blk, pa[k], desc128(sV, 32 * k), k);
    };
    auto softmax = [&](float (&sf)[64], float& b0, float& b1) {
        int im0 = acc[0], im1 = acc[2];
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            im0 = max(im0, max(acc[4 * j], acc[4 * j + 1]));
            im1 = max(im1, max(acc[4 * j + 2], acc[4 * j + 3]));
        }
        float mx0 = (float)im0 * sc, mx1 = (float)im1 * sc;
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(m0, fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2)));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(m1, fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2)));
        b0 = ex2(m0 - mx0); b1 = ex2(m1 - mx1);
        m0 = mx0; m1 = mx1;
        const float c0 = fmaf(12582912.f, sc, mx0 - 8.807f), c1 = fmaf(12582912.f, sc, mx1 - 8.807f);
        if constexpr (EXH == 0) {
#pragma unroll
            for (int i = 0; i < 64; ++i) {
                const float y = fmaf(__int_as_float(acc[i] + 0x4B400000), sc, (i & 2) ? -c1 : -c0);
                sf[i] = (i % 16) < EMU ? ex2_fma(y) : ex2(y);
            }
            float rs0 = 0.f, rs1 = 0.f;
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                rs0 += sf[4 * j] + sf[4 * j + 1];
                rs1 += sf[4 * j + 2] + sf[4 * j + 3];
            }
            l0 = l0 * b0 + rs0; l1 = l1 * b1 + rs1;
        } else {  // f16x2 exponentials: sf holds half2 pairs as bits (sf[2 * j] = keys (4j, 4j+1) row 0, +1 row 1)
            uint32_t r0 = 0, r1 = 0;
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                const uint32_t h0 = ex2_h2(h2_of(fmaf(__int_as_float(acc[4 * j] + 0x4B400000), sc, -c0),
                                                 fmaf(__int_as_float(acc[4 * j + 1] + 0x4B400000), sc, -c0)));
                const uint32_t h1 = ex2_h2(h2_of(fmaf(__int_as_float(acc[4 * j + 2] + 0x4B400000), sc, -c1),
                                                 fmaf(__int_as_float(acc[4 * j + 3] + 0x4B400000), sc, -c1)));
                sf[2 * j] = __uint_as_float(h0);
                sf[2 * j + 1] = __uint_as_float(h1);
                if constexpr (EXH == 1) { r0 = hadd2(r0, h0); r1 = hadd2(r1, h1); }
            }
            if constexpr (EXH == 1) {
                const __half2 a = *reinterpret_cast<__half2*>(&r0), b = *reinterpret_cast<__half2*>(&r1);
                l0 = l0 * b0 + __low2float(a) + __high2float(a);
                l1 = l1 * b1 + __low2float(b) + __high2float(b);
            } else if constexpr (ORDER != 6) {
                l0 = l0 * b0 + blk[64]; l1 = l1 * b1 + blk[66];  // stand-in for the merged row sums
            }
        }
    };
    auto pack = [&](const float (&sf)[64]) {
        if constexpr (EXH != 0) {
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {  // half2 (4j, 4j+1) of row 0 / row 1 -> e4m3 pairs
                const float* q = sf + 8 * kk;
                pa[kk][0] = e4m3_of_h2(__float_as_uint(q[0])) | (e4m3_of_h2(__float_as_uint(q[2])) << 16);
                pa[kk][1] = e4m3_of_h2(__float_as_uint(q[1])) | (e4m3_of_h2(__float_as_uint(q[3])) << 16);
                pa[kk][2] = e4m3_of_h2(__float_as_uint(q[4])) | (e4m3_of_h2(__float_as_uint(q[6])) << 16);
                pa[kk][3] = e4m3_of_h2(__float_as_uint(q[5])) | (e4m3_of_h2(__float_as_uint(q[7])) << 16);
            }
            return;
        }
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            const float* q = sf + 16 * kk;
            pa[kk][0] = cvt2(q[0], q[1]) | (cvt2(q[4], q[5]) << 16);
            pa[kk][1] = cvt2(q[2], q[3]) | (cvt2(q[6], q[7]) << 16);
            pa[kk][2] = cvt2(q[8], q[9]) | (cvt2(q[12], q[13]) << 16);
            pa[kk][3] = cvt2(q[10], q[11]) | (cvt2(q[14], q[15]) << 16);
        }
    };
    auto merge = [&](float a0, float a1) {
        if constexpr (ORDER == 6 && EXH == 2) { l0 = l0 * a0 + blk[64]; l1 = l1 * a1 + blk[66]; }
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            o[4 * i] = fmaf(o[4 * i], a0, blk[4 * i]);
            o[4 * i + 1] = fmaf(o[4 * i + 1], a0, blk[4 * i + 1]);
            o[4 * i + 2] = fmaf(o[4 * i + 2], a1, blk[4 * i + 2]);
            o[4 * i + 3] = fmaf(o[4 * i + 3], a1, blk[4 * i + 3]);
        }
    };
    if (PP && cw == 1) named_arrive(3, 256);
    const long long t0 = clock64();
    {  // first block: S only
        if (PP) named_sync(3 + cw, 256);
        wg_fence();
#pragma unroll
        for (int k = 0; k < 4; ++k) issue_qk(k);
        wg_commit();
        if (PP == 1) named_arrive(3 + (cw ^ 1), 256);
        wg_wait<0>();
        rfence<64>(acc);
        if (PP == 2) named_arrive(3 + (cw ^ 1), 256);
        float sf[64];
        softmax(sf, al0, al1);
        pack(sf);
    }
    for (int it = 1; it < iters; ++it) {
        if (PP) named_sync(3 + cw, 256);
        wg_fence();
        float sf[64], b0, b1;
        if constexpr (ORDER == 0) {  // the kernel today: S group, then P~V group; softmax while P~V runs
#pragma unroll
            for (int k = 0; k < 4; ++k) issue_qk(k);
            wg_commit();
#pragma unroll
            for (int k = 0; k < 4; ++k) issue_pv(k);
            wg_commit();
            if (PP == 1) named_arrive(3 + (cw ^ 1), 256);
            wg_wait<1>();
            rfence<64>(acc);
            if (PP == 2) named_arrive(3 + (cw ^ 1), 256);
            softmax(sf, b0, b1);
            wg_wait<0>();
            rfence<NB>(blk); rfence_pa(pa);
        } else if constexpr (ORDER == 1) {  // interleaved, one group: wait for both, then softmax
#pragma unroll
            for (int k = 0; k < 4; ++k) { issue_qk(k); issue_pv(k); }
            wg_commit();
            if (PP == 1) named_arrive(3 + (cw ^ 1), 256);
            wg_wait<0>();
            rfence<64>(acc); rfence<NB>(blk); rfence_pa(pa);
            if (PP == 2) named_arrive(3 + (cw ^ 1), 256);
            softmax(sf, b0, b1);
        } else if constexpr (ORDER == 2) {  // interleaved, S complete in the first group, last two P~V after
            issue_qk(0); issue_pv(0); issue_qk(1); issue_pv(1); issue_qk(2); issue_qk(3);
            wg_commit();
            issue_pv(2); issue_pv(3);
            wg_commit();
            if (PP == 1) named_arrive(3 + (cw ^ 1), 256);
            wg_wait<1>();
            rfence<64>(acc);
            softmax(sf, b0, b1);
            wg_wait<0>();
            rfence<NB>(blk); rfence_pa(pa);
        } else if constexpr (ORDER == 4) {  // interleaved; only the last P~V after S's group
            issue_qk(0); issue_pv(0); issue_qk(1); issue_pv(1); issue_qk(2); issue_pv(2); issue_qk(3);
            wg_commit();
            issue_pv(3);
            wg_commit();
            if (PP == 1) named_arrive(3 + (cw ^ 1), 256);
            wg_wait<1>();
            rfence<64>(acc);
            softmax(sf, b0, b1);
            wg_wait<0>();
            rfence<NB>(blk); rfence_pa(pa);
        } else if constexpr (ORDER == 5) {  // as 0, P~V as two interleaved n64 chains (column halves)
#pragma unroll
            for (int k = 0; k < 4; ++k) issue_qk(k);
            wg_commit();
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                wgmma_e4_rs64(blk, pa[k], desc128(sV, 32 * k), k);
                wgmma_e4_rs64(blk + 32, pa[k], desc128(sV + 8192, 32 * k), k);
            }
            wg_commit();
            if (PP == 1) named_arrive(3 + (cw ^ 1), 256);
            wg_wait<1>();
            rfence<64>(acc);
            softmax(sf, b0, b1);
            wg_wait<0>();
            rfence<NB>(blk); rfence_pa(pa);
        } else if constexpr (ORDER == 6) {  // serial: P~V(kb-1), wait, merge, then S(kb), wait: S and the P~V
            // block accumulator are never live together (fits 3 consumer warpgroups' 168 registers)
#pragma unroll
            for (int k = 0; k < 4; ++k) issue_pv(k);
            wg_commit();
            wg_wait<0>();
            rfence<NB>(blk); rfence_pa(pa);
            merge(al0, al1);
            wg_fence();
#pragma unroll
            for (int k = 0; k < 4; ++k) issue_qk(k);
            wg_commit();
            if (PP == 1) named_arrive(3 + (cw ^ 1), 256);
            wg_wait<0>();
            rfence<64>(acc);
            if (PP == 2) named_arrive(3 + (cw ^ 1), 256);
            softmax(sf, b0, b1);
        } else {  // P~V group first, then S
#pragma unroll
            for (int k = 0; k < 4; ++k) issue_pv(k);
            wg_commit();
#pragma unroll
            for (int k = 0; k < 4; ++k) issue_qk(k);
            wg_commit();
            if (PP == 1) named_arrive(3 + (cw ^ 1), 256);
            wg_wait<0>();
            rfence<64>(acc); rfence<NB>(blk); rfence_pa(pa);
            softmax(sf, b0, b1);
        }
        if constexpr (ORDER != 6) merge(al0, al1);
        pack(sf);
        al0 = b0; al1 = b1;
    }
    const long long t1 = clock64();
    float res = l0 + l1;
#pragma unroll
    for (int i = 0; i < 64; ++i) res += o[i];
    if (threadIdx.x % 128 == 0) cycles[blockIdx.x * 3 + cw] = t1 - t0;
    if (res == 12345.f) sink[threadIdx.x] = res;
    if (PP && cw == 0) named_sync(3, 256);  // balance the ping-pong barrier before exit
}

template <int ORDER, int PP, int EMU, int EXH = 0, int NWG = 2> void run(int nsm) {
    const int smem = 48 * 1024 + 1024, iters = 20000;
    auto k = model_kernel<ORDER, PP, EMU, EXH, NWG>;
    cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    const Timed t = time_launch(nsm, iters, [&](int n, long long* cyc, float* sink) {
        k<<<nsm, 128 * NWG, smem>>>(n, cyc, sink, 1e-5f);
    });
    const double flops = 4.0 * 64 * 128 * 128 * (double)iters * NWG * nsm;  // 2 GEMMs x 2 flops per warpgroup
    printf("%d WG order %d pingpong %d emu %2d/16 exh %d: %7.1f TOPS, %6.0f cycles per iteration, %5.0f MHz  (%s)\n",
           NWG, ORDER, PP, EMU, EXH, flops / (t.ms * 1e-3) / 1e12, (double)t.cycles / iters,
           (double)t.cycles / (t.ms * 1e3), cudaGetErrorString(cudaGetLastError()));
}

int main(int argc, char** argv) {
    int nsm = 0;
    cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, 0);
    const int only = argc > 1 ? atoi(argv[1]) : -1;  // one configuration (for a profiler)
    const int rnd = getenv("MODEL_RANDOM") ? 1 : 0;  // MODEL_RANDOM=1: random operand bytes instead of a pattern
    cudaMemcpyToSymbol(g_random_operands, &rnd, sizeof(int));
    int idx = 0;
#define RUN(...) do { if (only < 0 || only == idx) run<__VA_ARGS__>(nsm); ++idx; } while (0)
    // the kernel's loop today (2 WG, n136 row sums) vs the serial order with 2 and 3 consumer warpgroups
    RUN(0, 0, 0, 2, 2); RUN(6, 0, 0, 2, 2); RUN(1, 0, 0, 2, 2); RUN(0, 1, 0, 2, 2); RUN(0, 2, 0, 2, 2);
    RUN(1, 1, 0, 2, 2); RUN(1, 2, 0, 2, 2); RUN(6, 2, 0, 2, 2);
    RUN(0, 1, 0, 0, 2); RUN(0, 0, 0, 0, 1); RUN(0, 0, 0, 1, 1); RUN(0, 0, 0, 2, 1); RUN(0, 1, 0, 1, 2);
    RUN(0, 0, 2, 0, 1); RUN(4, 0, 0, 0, 1); RUN(5, 0, 0, 0, 1); RUN(1, 0, 0, 0, 1);
    return 0;
}

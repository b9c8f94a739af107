// Does an in-flight wgmma slow down ALU/MUFU work on the same SM? (issue 4 diagnostics, not part of the library.)
// The attention loop's softmax takes ~1350 cycles while its warpgroup's P~V wgmma is in flight and ~390 without it
// (SAGE_HOP_TRACE=2). Here warpgroup 0 times a fixed instruction stream (clock64 around it) while a chain of 4
// dependent wgmmas X is in flight: issued by itself just before the stream ("own"), by warpgroup 1 at the same time
// ("other"), or by both ("both": each warpgroup issues its chain, then runs the stream, as the kernel does).
// Streams: "softmax" (per thread 64 scores: max, FFMA, EX2, sum, e4m3 pack), "ffma" (256 FFMA), "ex2" (64 EX2),
// "nothing" (the chain alone). The stream's own clock is approximate (ptxas may move independent instructions
// across the clock reads); the iteration time (barrier to barrier, includes the chain's wait) is the measure.
// Build: nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -o wgmma_interference scripts/wgmma_interference.cu
// Run:   ./wgmma_interference   (one line per stream x chain x mode: cycles of the stream, cycles per iteration)
//        ./wgmma_interference busy   (warpgroups 1 and 2 keep the tensor cores busy the whole time, as the other
//        consumers of the 3-consumer kernel do; H200, session 13: the softmax stream takes 650 cycles alone and
//        1050-1100 under any chain type, s8 or e4m3, SS or RS, n64 or n128: GEMMs of other warpgroups DO slow ALU
//        work, the "other" mode above overlaps only the first few hundred cycles of the stream)
#include <cstdint>
#include <cstdio>
#include <cuda_runtime.h>

#include "wgmma_diag.cuh"

__device__ __forceinline__ void w_s8_ss(int (&d)[64], uint64_t da, uint64_t db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, 1;\n"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]), "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]), "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31]), "+r"(d[32]), "+r"(d[33]), "+r"(d[34]), "+r"(d[35]), "+r"(d[36]), "+r"(d[37]), "+r"(d[38]), "+r"(d[39]), "+r"(d[40]), "+r"(d[41]), "+r"(d[42]), "+r"(d[43]), "+r"(d[44]), "+r"(d[45]), "+r"(d[46]), "+r"(d[47]), "+r"(d[48]), "+r"(d[49]), "+r"(d[50]), "+r"(d[51]), "+r"(d[52]), "+r"(d[53]), "+r"(d[54]), "+r"(d[55]), "+r"(d[56]), "+r"(d[57]), "+r"(d[58]), "+r"(d[59]), "+r"(d[60]), "+r"(d[61]), "+r"(d[62]), "+r"(d[63]) : "l"(da), "l"(db));
}
__device__ __forceinline__ void w_e4_rs(float (&d)[64], const uint32_t* a, uint64_t db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, 1, 1, 1;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
__device__ __forceinline__ void w_e4_ss(float (&d)[64], uint64_t da, uint64_t db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, 1, 1, 1;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) : "l"(da), "l"(db));
}
__device__ __forceinline__ void w_f16_rs(float (&d)[64], const uint32_t* a, uint64_t db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, 1, 1, 1, 0;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
__device__ __forceinline__ void w_f16_ss(float (&d)[64], uint64_t da, uint64_t db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, 1, 1, 1, 0, 0;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) : "l"(da), "l"(db));
}
__device__ __forceinline__ void w_e4_rs256(float (&d)[128], const uint32_t* a, uint64_t db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, 1, 1, 1;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

__device__ __forceinline__ void w_e4_rs64(float (&d)[32], const uint32_t* a, uint64_t db) {  // the kernel's P~V half
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, 1, 1, 1;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

enum Chain { NONE = 0, S8SS, E4RS, E4SS, F16RS, F16SS, E4RS256, E4RS64, NCHAINS };
static const char* kChain[] = {"none", "s8 SS n128", "e4m3 RS n128", "e4m3 SS n128", "f16 RS n128k16",
                               "f16 SS n128k16", "e4m3 RS n256", "e4m3 RS n64"};
enum Stream { SOFTMAX = 0, FFMA, EX2, NOSTREAM };
static const char* kStream[] = {"softmax", "ffma", "ex2", "nothing"};
enum Who { OWN = 0, OTHER, BOTH };
static const char* kWho[] = {"own", "other", "both"};

// 4 dependent wgmmas into one accumulator (the P~V step of one 128-key block), committed as one group
template <int C> struct ChainAcc { float d[C == E4RS256 ? 128 : C == E4RS64 ? 32 : 64]; };
template <int C> __device__ __forceinline__ void issue_chain(ChainAcc<C>& acc, const uint32_t (&a)[4][4], uint32_t sa,
                                                             uint32_t sb) {
    wg_fence();
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        if constexpr (C == S8SS) w_s8_ss(reinterpret_cast<int (&)[64]>(acc.d), desc128(sa, 32 * k), desc128(sb, 32 * k));
        if constexpr (C == E4RS) w_e4_rs(acc.d, a[k], desc128(sb, 32 * k));
        if constexpr (C == E4SS) w_e4_ss(acc.d, desc128(sa, 32 * k), desc128(sb, 32 * k));
        if constexpr (C == F16RS) w_f16_rs(acc.d, a[k], desc128(sb, 32 * k));
        if constexpr (C == F16SS) w_f16_ss(acc.d, desc128(sa, 32 * k), desc128(sb, 32 * k));
        if constexpr (C == E4RS256) w_e4_rs256(acc.d, a[k], desc128(sb, 32 * k));
        if constexpr (C == E4RS64) w_e4_rs64(acc.d, a[k], desc128(sb, 32 * k));
    }
    wg_commit();
}

template <int S> __device__ __forceinline__ float run_stream(float (&v)[64], uint32_t (&pk)[32], float c) {
    float sum = 0.f;
    if constexpr (S == SOFTMAX) {
        float mx = v[0];
#pragma unroll
        for (int i = 1; i < 64; ++i) mx = fmaxf(mx, v[i]);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
#pragma unroll
        for (int i = 0; i < 64; i += 2) {
            float e0 = fmaf(v[i], c, -mx), e1 = fmaf(v[i + 1], c, -mx);
            asm volatile("ex2.approx.ftz.f32 %0, %0;" : "+f"(e0));
            asm volatile("ex2.approx.ftz.f32 %0, %0;" : "+f"(e1));
            sum += e0 + e1;
            uint16_t r;
            asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(r) : "f"(e0), "f"(e1));
            pk[i / 2] = (pk[i / 2] << 16) | r;
        }
    } else if constexpr (S == FFMA) {
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
            for (int i = 0; i < 64; ++i) asm volatile("fma.rn.f32 %0, %0, %1, 0f3E800000;" : "+f"(v[i]) : "f"(c));
        sum = v[0];
    } else if constexpr (S == EX2) {
#pragma unroll
        for (int i = 0; i < 64; ++i) asm volatile("ex2.approx.ftz.f32 %0, %0;" : "+f"(v[i]));
        sum = v[0];
    }
#pragma unroll
    for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(v[i]));
    return sum;
}

// operands of a chain (P~-like register A fragments, a zero accumulator) and of a stream
template <int C> __device__ __forceinline__ void init_chain(uint32_t (&a)[4][4], ChainAcc<C>& acc) {
#pragma unroll
    for (int k = 0; k < 4; ++k)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            a[k][j] = 0x30303030u + (threadIdx.x & 7) + k + j;
            asm volatile("" : "+r"(a[k][j]));  // opaque: rematerialising them would serialize the wgmmas
        }
#pragma unroll
    for (int i = 0; i < (int)(sizeof(acc.d) / 4); ++i) acc.d[i] = 0.f;
}
__device__ __forceinline__ void init_stream(float (&v)[64], uint32_t (&pk)[32]) {
#pragma unroll
    for (int i = 0; i < 64; ++i) v[i] = 1e-3f * (float)((threadIdx.x * 7 + i) & 63);
#pragma unroll
    for (int i = 0; i < 32; ++i) pk[i] = 0u;
}

// one warpgroup's loop; the roles are template constants so that no wgmma sits in a divergent path (ptxas would
// serialize the chain)
template <int S, int C, bool CHAIN, bool STREAM>
__device__ __forceinline__ void role_loop(int iters, uint32_t sa, uint32_t sb, long long* cycles, float* sink) {
    uint32_t a[4][4];
    ChainAcc<C> acc;
    constexpr int NA = (int)(sizeof(acc.d) / 4);
    init_chain<C>(a, acc);
    float v[64];
    uint32_t pk[32];
    init_stream(v, pk);
    long long t_stream = 0;
    float res = 0.f;
    const long long t0 = clock64();
    for (int it = 0; it < iters; ++it) {
        asm volatile("bar.sync 1, 256;\n" ::: "memory");
        if constexpr (CHAIN && C != NONE) issue_chain<C>(acc, a, sa, sb);
        if constexpr (STREAM && S != NOSTREAM) {
            const long long s0 = clock64();
            res += run_stream<S>(v, pk, 0.999f + 1e-6f * it);
            asm volatile("" : "+f"(res));
            t_stream += clock64() - s0;
        }
        if constexpr (CHAIN && C != NONE && !(STREAM && S != NOSTREAM)) {
            // a few FFMA between issue and wait: with nothing there ptxas serializes the chain (C7514)
#pragma unroll
            for (int i = 0; i < 8; ++i) asm volatile("fma.rn.f32 %0, %0, %0, 0f3E800000;" : "+f"(v[i]));
        }
        if constexpr (CHAIN && C != NONE) wg_wait<0>();
    }
    const long long t1 = clock64();
    rfence<NA>(acc.d);
#pragma unroll
    for (int i = 0; i < NA; ++i) res += acc.d[i];
#pragma unroll
    for (int i = 0; i < 32; ++i) res += (float)pk[i];
    if (threadIdx.x == 0) { cycles[blockIdx.x * 3] = t1 - t0; cycles[blockIdx.x * 3 + 1] = t_stream; }
    if (res == 12345.f) sink[threadIdx.x] = res;
}

template <int S, int C, int W>
__global__ void __launch_bounds__(256, 1) interference_kernel(int iters, long long* cycles, float* sink) {
    extern __shared__ __align__(1024) uint8_t sm_raw[];
    uint8_t* sm = fill_operands(sm_raw, 64 * 1024, 0x37);
    const int wg = threadIdx.x >> 7;
    const uint32_t sa = smem_u32(sm) + wg * 8192, sb = smem_u32(sm) + 32768;
    if (wg == 0) role_loop<S, C, W != OTHER, true>(iters, sa, sb, cycles, sink);
    else role_loop<S, C, W != OWN, W == BOTH>(iters, sa, sb, cycles, sink);
}

template <int S, int C, int W> void run1(int nsm) {
    const int smem = 64 * 1024 + 1024, iters = 4000;
    auto k = interference_kernel<S, C, W>;
    cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    long long* cyc;
    float* sink;
    cudaMalloc(&cyc, nsm * 3 * sizeof(long long));
    cudaMalloc(&sink, 1024 * sizeof(float));
    k<<<nsm, 256, smem>>>(iters / 10, cyc, sink);
    k<<<nsm, 256, smem>>>(iters, cyc, sink);
    long long c[2];
    cudaMemcpy(c, cyc, sizeof(c), cudaMemcpyDeviceToHost);
    printf("%-8s %-16s %-6s stream %7.1f  iteration %7.1f cycles\n", kStream[S], kChain[C], C == NONE ? "-" : kWho[W],
           (double)c[1] / iters, (double)c[0] / iters);
    cudaFree(cyc);
    cudaFree(sink);
}
template <int S, int C> void run_chain(int nsm) {
    if constexpr (C == NONE) { run1<S, C, OWN>(nsm); run1<S, C, BOTH>(nsm); }
    else { run1<S, C, OWN>(nsm); run1<S, C, OTHER>(nsm); run1<S, C, BOTH>(nsm); }
}
template <int S> void run_stream_all(int nsm) {
    run_chain<S, NONE>(nsm); run_chain<S, S8SS>(nsm); run_chain<S, E4RS>(nsm); run_chain<S, E4SS>(nsm);
    run_chain<S, F16RS>(nsm); run_chain<S, F16SS>(nsm); run_chain<S, E4RS256>(nsm);
}

// "busy": warpgroup 0 runs the stream `iters` times while warpgroups 1 and 2 keep the tensor cores fed with chains
// of type C until it is done (as in the kernel with 3 consumers: one runs its softmax, the others their GEMMs).
// Printed: cycles per stream, and the load's cycles per wgmma (per load warpgroup: 4 wgmmas per chain).
template <int S, int C>
__global__ void __launch_bounds__(384, 1) busy_kernel(int iters, long long* cycles, float* sink) {
    extern __shared__ __align__(1024) uint8_t sm_raw[];
    __shared__ int done;
    if (threadIdx.x == 0) done = 0;
    uint8_t* sm = fill_operands(sm_raw, 64 * 1024, 0x37);  // (its __syncthreads publishes `done`)
    const int wg = threadIdx.x >> 7;
    const uint32_t sa = smem_u32(sm) + (wg & 1) * 8192, sb = smem_u32(sm) + 32768;
    if (wg == 0) {
        float v[64];
        uint32_t pk[32];
        init_stream(v, pk);
        float res = 0.f;
        const long long t0 = clock64();
        for (int it = 0; it < iters; ++it) {
            res += run_stream<S>(v, pk, 0.999f + 1e-6f * it);
            asm volatile("" : "+f"(res));
        }
        const long long t1 = clock64();
        __syncwarp();
        if (threadIdx.x == 0) { atomicExch(&done, 1); cycles[blockIdx.x * 3] = t1 - t0; }
#pragma unroll
        for (int i = 0; i < 32; ++i) res += (float)pk[i];
        if (res == 12345.f) sink[threadIdx.x] = res;
    } else if constexpr (C != NONE) {
        uint32_t a[4][4];
        ChainAcc<C> acc;
        constexpr int NA = (int)(sizeof(acc.d) / 4);
        init_chain<C>(a, acc);
        long long n = 0;
        const long long t0 = clock64();
        uint32_t stop = 0;
        while (!stop) {
            issue_chain<C>(acc, a, sa, sb);
            wg_wait<0>();
            ++n;
            const uint32_t f = *reinterpret_cast<volatile int*>(&done);
            // the warpgroup leaves together (wgmma is warpgroup-collective): OR of the flag over its 128 threads
            asm volatile("{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.or.pred q, %2, 128, p;\n"
                         " selp.u32 %0, 1, 0, q;\n}\n" : "=r"(stop) : "r"(f), "r"(wg) : "memory");
        }
        const long long t1 = clock64();
        rfence<NA>(acc.d);
        float res = 0.f;
#pragma unroll
        for (int i = 0; i < NA; ++i) res += acc.d[i];
        if (threadIdx.x == 128) { cycles[blockIdx.x * 3 + 1] = t1 - t0; cycles[blockIdx.x * 3 + 2] = 4 * n; }
        if (res == 12345.f) sink[threadIdx.x] = res;
    }
}
template <int S, int C> void run_busy(int nsm) {
    const int smem = 64 * 1024 + 1024, iters = 400;
    auto k = busy_kernel<S, C>;
    cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    long long* cyc;
    float* sink;
    cudaMalloc(&cyc, nsm * 3 * sizeof(long long));
    cudaMemset(cyc, 0, nsm * 3 * sizeof(long long));
    cudaMalloc(&sink, 1024 * sizeof(float));
    k<<<nsm, 384, smem>>>(iters / 10, cyc, sink);
    k<<<nsm, 384, smem>>>(iters, cyc, sink);
    long long c[3];
    cudaMemcpy(c, cyc, sizeof(c), cudaMemcpyDeviceToHost);
    printf("busy  %-8s %-16s stream %7.1f cycles; load %6.1f cycles per wgmma per warpgroup\n", kStream[S], kChain[C],
           (double)c[0] / iters, c[2] ? (double)c[1] / c[2] : 0.0);
    cudaFree(cyc);
    cudaFree(sink);
}
template <int S> void run_busy_all(int nsm) {
    run_busy<S, NONE>(nsm); run_busy<S, S8SS>(nsm); run_busy<S, E4SS>(nsm); run_busy<S, E4RS>(nsm);
    run_busy<S, E4RS64>(nsm); run_busy<S, F16SS>(nsm);
}

int main(int argc, char** argv) {
    int nsm = 0;
    cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, 0);
    if (argc > 1 && argv[1][0] == 'b') {  // ./wgmma_interference busy
        run_busy_all<SOFTMAX>(nsm); run_busy_all<FFMA>(nsm); run_busy_all<EX2>(nsm);
        const cudaError_t e = cudaDeviceSynchronize();
        printf("status: %s\n", cudaGetErrorString(e));
        return e == cudaSuccess ? 0 : 1;
    }
    printf("SMs %d; per iteration: 4 dependent wgmmas (one chain) and the stream; cycles of warp 0\n", nsm);
    run_stream_all<SOFTMAX>(nsm);
    run_stream_all<FFMA>(nsm);
    run_stream_all<EX2>(nsm);
    run_stream_all<NOSTREAM>(nsm);
    const cudaError_t e = cudaDeviceSynchronize();
    printf("status: %s\n", cudaGetErrorString(e));
    return e == cudaSuccess ? 0 : 1;
}

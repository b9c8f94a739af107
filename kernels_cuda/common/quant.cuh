// Quantization and number-format helpers shared by both kernel families: fp16/bf16 loads, INT8 rounding, the
// NaN-propagating maxima of the pre-passes (fmax_nan, finite_or_nan), FP8 E4M3 conversions, exp2.
#pragma once
#include "params.cuh"

namespace sage {

// ----------------------------------------------------------------------------------------------
// small device helpers
template <typename T> struct Vec8;
template <> struct Vec8<__half> {
    static __device__ __forceinline__ void load(const __half* p, float* x) {
        uint4 u = *reinterpret_cast<const uint4*>(p);
        const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
        for (int i = 0; i < 4; ++i) { float2 f = __half22float2(h[i]); x[2 * i] = f.x; x[2 * i + 1] = f.y; }
    }
};
template <> struct Vec8<__nv_bfloat16> {
    static __device__ __forceinline__ void load(const __nv_bfloat16* p, float* x) {
        uint4 u = *reinterpret_cast<const uint4*>(p);
        const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
        for (int i = 0; i < 4; ++i) { float2 f = __bfloat1622float2(h[i]); x[2 * i] = f.x; x[2 * i + 1] = f.y; }
    }
};

template <typename T> __device__ __forceinline__ uint32_t pack2(float a, float b);
template <> __device__ __forceinline__ uint32_t pack2<__half>(float a, float b) {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
}
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float a, float b) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
}

__device__ __forceinline__ int quant_i8(float x, float scale, int qmax = 127) {
    if (!(scale > 0.f)) return 0;
    int q = __float2int_rn(x / scale);
    return q > qmax ? qmax : (q < -qmax ? -qmax : q);
}
// x / scale rounded to the nearest integer (ties to even, as quant_i8) without the IEEE division's slow path:
// x * (1 / scale) plus one remainder correction gives the correctly rounded quotient (the reference rounds exactly
// that); inv = 1 / scale, 0 for a zero scale. For |x| <= 127 * scale (no clamp needed). Returned as the bits of
// 1.5 * 2^23 + q: the FP32 add does the rounding and the low byte is q as int8, so the quantization passes stay off
// the 16/clk/SM conversion pipe (F2I).
__device__ __forceinline__ uint32_t quant_i8_bits(float x, float scale, float inv) {
    const float q0 = x * inv;
    return __float_as_uint(fmaf(fmaf(-q0, scale, x), inv, q0) + 12582912.f);
}
// the low bytes of a, b, c, d -> one word (a in byte 0)
__device__ __forceinline__ uint32_t pack_low_bytes(uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
    return __byte_perm(__byte_perm(a, b, 0x0040), __byte_perm(c, d, 0x0040), 0x5410);
}

// Non-finite inputs (issue 28): a NaN or Inf in Q, K or V must reach the output rows that use it, never turn into
// finite garbage. It would vanish in the pre-passes' maxima (fmaxf drops NaN), in scales (an infinite maximum gives
// 1 / scale = 0 or a saturated e4m3 value) and in the epilogues' "l > 0" tests. So every maximum that builds a
// quantization scale or statistic propagates NaN (fmax_nan), a non-finite maximum becomes a NaN scale
// (finite_or_nan), and NaN then flows through the products with that scale into every row that uses it; a row is
// empty (output 0, LSE -inf) only when its row sum is exactly 0. For finite values fmax_nan / fmin_nan are fmaxf /
// fminf (the same FMNMX, with .NAN) and finite_or_nan is the identity: finite outputs stay bitwise the same.
__device__ __forceinline__ float fmax_nan(float a, float b) {  // max, NaN if either operand is NaN (sm_80+)
    float r;
    asm("max.NaN.f32 %0, %1, %2;\n" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float fmin_nan(float a, float b) {  // min, NaN if either operand is NaN (sm_80+)
    float r;
    asm("min.NaN.f32 %0, %1, %2;\n" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
// x for finite x, NaN for +-Inf and NaN (x * 0 + x: one FFMA, exact for finite x; never folded without fast math)
__device__ __forceinline__ float finite_or_nan(float x) { return fmaf(x, 0.f, x); }


// FP8 E4M3, round to nearest even, saturating to +-448 (NaN stays NaN). Needs sm_89.
[[maybe_unused]] __device__ __forceinline__ uint32_t cvt_e4m3x2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    uint16_t r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
#else
    (void)lo; (void)hi;
    return 0u;
#endif
}

// four floats -> e4m3 bytes (a in byte 0), packed in the conversions themselves (no masks of 16-bit results)
[[maybe_unused]] __device__ __forceinline__ uint32_t cvt_e4m3x4(float a, float b, float c, float d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    uint32_t r;
    asm("{\n .reg .b16 lo, hi;\n cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
        " mov.b32 %0, {lo, hi};\n}\n" : "=r"(r) : "f"(a), "f"(b), "f"(c), "f"(d));
    return r;
#else
    (void)a; (void)b; (void)c; (void)d;
    return 0u;
#endif
}

// two e4m3 (low byte first) -> f16x2 (low half first). Needs sm_89.
[[maybe_unused]] __device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    uint32_t r;
    const uint16_t h = (uint16_t)x;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(r) : "h"(h));
    return r;
#else
    (void)x;
    return 0u;
#endif
}

__device__ __forceinline__ float fast_exp2(float x) {  // MUFU.EX2; exp2(-inf) = 0
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
// exact int32 -> fp32 for |x| < 2^22 on the FP32 pipe (no I2F): |QK^T| <= 127*127*128 < 2^21
__device__ __forceinline__ float small_i2f(int x) { return __int_as_float(x + 0x4B400000) - 12582912.f; }

}  // namespace sage

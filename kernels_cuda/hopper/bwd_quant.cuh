// Hopper SageBwd backward (bwd_kernel.cuh): the per-row (P s_dO, dS s_Q) and per-column (dS s_K) INT8
// quantizations of a 64 x 64 tile and the INT8 products with A from registers (issue, fold, update).
#pragma once
#include "bwd_traits.cuh"
#include "wgmma.cuh"
#include "../common/quant.cuh"

namespace sage::hopper {

// x rounded half to even as the low byte of the result (x * inv, |x * inv| <= 127): quant.to_int8's rounding add,
// the product rounded first as Triton and the reference compute it
__device__ __forceinline__ uint32_t bwd_i8_bits(float x, float inv) { return __float_as_uint(__fmul_rn(x, inv) + 12582912.f); }

// The quantizations' quotients amax / 127 (the scale) and 127 / amax (0 unless amax > 0), bitwise the IEEE
// quotients (div.rn) of the reference and the Triton kernels, without nvcc's general division: it refines 1 / 127
// at run time, checks the operands (FCHK) and branches around a slow path, ~11 and ~16 instructions per quotient
// with 2-3 branches, 12 quotients per thread and tile. Here: the same fast-path arithmetic (the reciprocal, the exact
// remainder, one correction) where it is exact, checked against div.rn on an H200 for every fp32 bit pattern an
// amax can take (>= 0 or NaN; bwd_div127 of -0 and -Inf differs, of no concern here).
// x / 127, x >= 0 or NaN: exact for every finite x (127 is a normal divisor and x / 127 neither overflows nor loses
// the remainder's exactness in the subnormal range); +Inf gives a NaN remainder, hence the select
__device__ __forceinline__ float bwd_div127(float x) {
    constexpr float r = 0x1.020408p-7f;  // RN(1 / 127)
    const float q0 = __fmul_rn(x, r);
    const float q = __fmaf_rn(__fmaf_rn(-q0, 127.f, x), r, q0);
    return x == __int_as_float(0x7f800000) ? x : q;
}
// 127 / m for m > 0, 0 for m = 0, +Inf or NaN (the quantization's 1 / scale; 127 / Inf = 0): the reciprocal's Newton
// step and the corrected quotient (nvcc's fast path) on m scaled by a power of two s into 2^-100..2^100, where that
// path is exact, then the quotient scaled back by s: exact too (s keeps every rounding boundary, overflow included,
// and 127 / m has no subnormal values), so no branch around a slow path
__device__ __forceinline__ float bwd_inv127(float m) {
    const float s = m < 0x1p-100f ? 0x1p64f : m > 0x1p100f ? 0x1p-64f : 1.f;
    const float ms = __fmul_rn(m, s);
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(ms));
    r = __fmaf_rn(r, __fmaf_rn(-ms, r, 1.f), r);
    const float q0 = __fmul_rn(127.f, r);
    const float q = __fmul_rn(__fmaf_rn(r, __fmaf_rn(-ms, q0, 127.f), q0), s);
    return m > 0.f && m < __int_as_float(0x7f800000) ? q : 0.f;
}

// One 64 x 64 fp32 tile x (accumulator layout: x[4 i + 2 hh + e] = row g + 8 hh, column 8 i + 2 t4 + e) quantized
// per row to INT8 A fragments of two k32 steps (columns in slot_of_key order within each 32), and the rows'
// scales amax / 127 (NaN where the row holds a NaN: it must reach the product, quant.row_amax)
__device__ __forceinline__ void bwd_quantize_rows(const float (&x)[32], uint32_t (&a)[2][4], float& sc0, float& sc1) {
    // the maxima as trees (depth 4, not a chain of 9): max is exact and NaN-propagating in any order
    float a0[8], a1[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        a0[i] = fmax_nan(fabsf(x[4 * i]), fabsf(x[4 * i + 1]));
        a1[i] = fmax_nan(fabsf(x[4 * i + 2]), fabsf(x[4 * i + 3]));
    }
#pragma unroll
    for (int w = 4; w >= 1; w >>= 1)
#pragma unroll
        for (int i = 0; i < w; ++i) {
            a0[i] = fmax_nan(a0[i], a0[i + w]);
            a1[i] = fmax_nan(a1[i], a1[i + w]);
        }
    float m0 = a0[0], m1 = a1[0];
#pragma unroll
    for (int o = 1; o <= 2; o <<= 1) {
        m0 = fmax_nan(m0, __shfl_xor_sync(0xffffffffu, m0, o));
        m1 = fmax_nan(m1, __shfl_xor_sync(0xffffffffu, m1, o));
    }
    const float inv0 = bwd_inv127(m0), inv1 = bwd_inv127(m1);
    sc0 = bwd_div127(m0);
    sc1 = bwd_div127(m1);
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
        const float* q = x + 16 * kk;
        a[kk][0] = pack_low_bytes(bwd_i8_bits(q[0], inv0), bwd_i8_bits(q[1], inv0), bwd_i8_bits(q[4], inv0),
                                  bwd_i8_bits(q[5], inv0));
        a[kk][1] = pack_low_bytes(bwd_i8_bits(q[2], inv1), bwd_i8_bits(q[3], inv1), bwd_i8_bits(q[6], inv1),
                                  bwd_i8_bits(q[7], inv1));
        a[kk][2] = pack_low_bytes(bwd_i8_bits(q[8], inv0), bwd_i8_bits(q[9], inv0), bwd_i8_bits(q[12], inv0),
                                  bwd_i8_bits(q[13], inv0));
        a[kk][3] = pack_low_bytes(bwd_i8_bits(q[10], inv1), bwd_i8_bits(q[11], inv1), bwd_i8_bits(q[14], inv1),
                                  bwd_i8_bits(q[15], inv1));
    }
}

// t (64 x 64 int32, accumulator layout) = A8 B^T for the 64 channels of the transposed image at bt (64 rows of 64
// query slots) that start at channel 64 nh: one commit group, in flight on return
__device__ __forceinline__ void bwd_int8_issue(int (&t)[32], const uint32_t (&a)[2][4], uint32_t bt, int nh) {
    const uint32_t lo = desc_lo(bt + nh * 4096);
    wg_fence();
    wgmma_s8_n64_rs<false>(t, a[0], desc_make(lo, desc_hi(64)));
    wgmma_s8_n64_rs<true>(t, a[1], desc_make(lo + desc_step(32), desc_hi(64)));
    wg_commit();
}
// acc (32 fp32 of one 64-channel block) += t * row scale, t complete
__device__ __forceinline__ void bwd_int8_fold(float* acc, const int (&t)[32], float sc0, float sc1) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        acc[4 * i] += (float)t[4 * i] * sc0;
        acc[4 * i + 1] += (float)t[4 * i + 1] * sc0;
        acc[4 * i + 2] += (float)t[4 * i + 2] * sc1;
        acc[4 * i + 3] += (float)t[4 * i + 3] * sc1;
    }
}
// acc (D/2 fp32, this lane's rows g, g + 8 and columns 64 nh + 8 i + 2 t4 + e) += (A8 B^T) * row scale, B = the
// transposed image at bt (D rows of 64 query slots), one n64 product per 64 channels, each waited for
template <int D>
__device__ __forceinline__ void bwd_int8_update(float (&acc)[D / 2], const uint32_t (&a)[2][4], uint32_t bt, float sc0,
                                                float sc1) {
#pragma unroll
    for (int nh = 0; nh < D / 64; ++nh) {
        int t[32];
        bwd_int8_issue(t, a, bt, nh);
        wg_wait<0>();
        reg_fence(t);
        bwd_int8_fold(acc + 32 * nh, t, sc0, sc1);
    }
}

// one butterfly step of bwd_quantize_cols: cm[k] (k < N) <- the max of this lane's and its partner's column k or
// k + N (lane bit 2 + log2(N / 2), a bit of g, picks which half it keeps)
template <int N>
__device__ __forceinline__ void bwd_halve(float (&cm)[16], int lane) {
    constexpr int bit = N == 8 ? 4 : N == 4 ? 3 : 2;
    const int up = (lane >> bit) & 1;
#pragma unroll
    for (int k = 0; k < N; ++k) {
        const float lo = cm[k], hi = cm[k + N];  // (values, not addresses: no local-memory copy of cm)
        float keep, send;
        asm("{\n .reg .pred u;\n setp.ne.b32 u, %4, 0;\n selp.f32 %0, %2, %3, u;\n selp.f32 %1, %3, %2, u;\n}\n"
            : "=f"(keep), "=f"(send) : "f"(hi), "f"(lo), "r"(up));
        cm[k] = fmax_nan(keep, __shfl_xor_sync(0xffffffffu, send, 1 << bit));
    }
}

// One 64 x 64 fp32 tile x (accumulator layout, rows = the warpgroup's keys, columns = query slots) quantized per
// column (per query over the 64 keys: dQ's dS s_K groups) into the dS image at ds (rows = queries in natural
// order, K = keys at bwd_kpos), and the columns' scales amax / 127 into sc[query] (NaN where the column holds a
// NaN). The column maxima: a butterfly over the 8 lanes of a column within the warp (each exchange halves the
// columns a lane carries: lane g ends with columns 8 g + 2 t4, +1), then the 4 warps' through red (shared memory),
// each lane's two quotients 127 / amax handed to the 7 other lanes that quantize those columns.
__device__ __forceinline__ void bwd_quantize_cols(const float (&x)[32], uint8_t* ds, float* red, float* sc, int wg_bar,
                                                  int warp, int lane) {
    const int g = lane >> 2, t4 = lane & 3;
    float cm[16];  // cm[2 i + e]: column 8 i + 2 t4 + e over this lane's rows g, g + 8
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int e = 0; e < 2; ++e) cm[2 * i + e] = fmax_nan(fabsf(x[4 * i + e]), fabsf(x[4 * i + 2 + e]));
    bwd_halve<8>(cm, lane);
    bwd_halve<4>(cm, lane);
    bwd_halve<2>(cm, lane);
    *reinterpret_cast<float2*>(red + 64 * warp + 8 * g + 2 * t4) = make_float2(cm[0], cm[1]);
    named_sync(wg_bar, 128);
    float inv[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        float m = red[8 * g + 2 * t4 + e];
#pragma unroll
        for (int w = 1; w < 4; ++w) m = fmax_nan(m, red[64 * w + 8 * g + 2 * t4 + e]);
        inv[e] = bwd_inv127(m);
        if (warp == 0) sc[bwd_query_of(8 * g + 2 * t4 + e)] = bwd_div127(m);
    }
    // keys 16 warp + g (low byte) and + 8 (high byte) at bytes 2 g of chunk warp of row bwd_query_of(8 i + 2 t4 + e)
    // = 4 t4 + e + (32 (i >> 2) + 16 ((i >> 1) & 1) + 2 (i & 1)), whose 64B-swizzle phase (bits 1-2) is
    // (i & 1) | 2 (t4 & 1): img_off as a per-lane base (one per parity of i) plus a constant
    const int ph = (t4 & 1) << 1;
    const int base0 = 256 * t4 + 2 * g + ((warp ^ ph) << 4), base1 = 256 * t4 + 2 * g + ((warp ^ ph ^ 1) << 4);
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const float iv = __shfl_sync(0xffffffffu, inv[e], 4 * i + t4);
            const uint32_t b0 = bwd_i8_bits(x[4 * i + e], iv) & 0xFFu, b1 = bwd_i8_bits(x[4 * i + 2 + e], iv) & 0xFFu;
            const int row_c = e + 32 * (i >> 2) + 16 * ((i >> 1) & 1) + 2 * (i & 1);
            *reinterpret_cast<uint16_t*>(ds + (i & 1 ? base1 : base0) + 64 * row_c) = (uint16_t)(b0 | (b1 << 8));
        }
}

}  // namespace sage::hopper

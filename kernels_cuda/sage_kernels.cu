// sage_patch compiled kernels: SageAttention2-8b with warp-level mma.sync (sm_80+).
// See sage_kernels.h for the ABI and docs/kernels.md for the design and data layouts.
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>
#include <type_traits>

#include "sage_kernels.h"

#ifndef SAGE_ARCHS
#define SAGE_ARCHS "unknown"
#endif

namespace {

constexpr int kThreads = 128;  // 4 warps everywhere
// rows per warp (WQ) in the attention kernel: 32 = two m16 tiles sharing every K/V fragment (half the shared-memory
// traffic per MMA of WQ = 16, at the price of registers). The Q scale groups follow: Grouping(WQ, 8, 1).
#ifndef SAGE_WQ_D64
#define SAGE_WQ_D64 32
#endif
#ifndef SAGE_WQ_D128
#define SAGE_WQ_D128 32
#endif
__host__ __device__ constexpr int warp_rows(int D) { return D == 64 ? SAGE_WQ_D64 : SAGE_WQ_D128; }
constexpr int kBK = 64;        // keys per KV block
constexpr int kMaxSplit = 32;  // partial-reduction chunks for mean(K) and amax(V)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kFp8Max = 448.f;
constexpr float kLog2Fp8Max = 8.807354922057604f;  // log2(448)
constexpr float kLnFp8Max = 6.104793232414985f;    // ln(448)
// P~V variants (SageAttnParams.pv_mode)
constexpr int PV_FP8_MMA = 0;  // e4m3 operands, mma.sync m16n8k32 e4m3 (sm_89+; native FP8 rate on Ada)
constexpr int PV_FP16 = 1;     // fp16 P~ and V, m16n8k16 (SageAttention1-style, sm_80+)
constexpr int PV_WGMMA = 3;    // sm_90a: the Hopper kernel (hopper_attn.cuh): INT8 + FP8 wgmma, warp-specialized
constexpr int PV_FP8_F16 = 2;  // e4m3 VALUES (same numerics as PV_FP8_MMA) carried in fp16 through m16n8k16: on
                               // sm_90 mma.sync e4m3 is lowered to fp16 MMAs anyway; this skips per-MMA converts

// Q/K modes (from SageAttnParams.qk_bits / qk_mma)
constexpr int QK_I8 = 0;      // "8b": INT8 values, mma.sync m16n8k32 s8
constexpr int QK_I4_I8 = 1;   // "4b": INT4 values in [-7, 7] stored as int8, mma.sync m16n8k32 s8 (any arch; sm_90)
constexpr int QK_I4_MMA = 2;  // "4b": INT4 values packed two per byte, mma.sync m16n8k64 s4 (native on sm_80-89)
__host__ __device__ constexpr int qk_row_bytes(int D, int qkm) { return qkm == QK_I4_MMA ? D / 2 : D; }
inline int qk_mode(const SageAttnParams& p) { return p.qk_bits != 4 ? QK_I8 : (p.qk_mma ? QK_I4_MMA : QK_I4_I8); }

struct Layout {  // workspace carve-up, all offsets 256-byte aligned
    int64_t sq_pad, skv_pad, nsplit, nqb;
    int64_t qi8, qscale, qshift, ki8, kscale, kpart, vt, vscale, vpart, kmean, vmax, vmean, qmean, ds, total;
};

__host__ __device__ inline int64_t align256(int64_t x) { return (x + 255) & ~int64_t(255); }

inline Layout make_layout(const SageAttnParams& p) {
    Layout L;
    const int64_t bq = 4 * warp_rows(p.D);  // query rows per attention CTA
    L.sq_pad = (p.Sq + bq - 1) / bq * bq;
    L.skv_pad = (p.Skv + kBK - 1) / kBK * kBK;
    int64_t ns = (p.Skv + 255) / 256;
    L.nsplit = ns < 1 ? 1 : (ns > kMaxSplit ? kMaxSplit : ns);
    L.nqb = L.sq_pad / bq;  // Q-smoothing blocks ("4b"): one per attention CTA
    const bool q4 = p.qk_bits == 4;
    const int64_t bhq = (int64_t)p.B * p.Hq, bhk = (int64_t)p.B * p.Hkv, D = p.D;
    int64_t off = 0;
    const int64_t DB = qk_row_bytes(p.D, qk_mode(p));  // bytes per quantized Q/K row
    L.qi8 = off;    off = align256(off + bhq * L.sq_pad * DB);
    L.qscale = off; off = align256(off + bhq * (L.sq_pad / 16) * 8 * 4);  // enough for any WQ >= 16
    L.qshift = off; off = align256(off + bhq * L.sq_pad * 4);
    L.ki8 = off;    off = align256(off + bhk * L.skv_pad * DB);
    L.kscale = off; off = align256(off + bhk * (L.skv_pad / kBK) * 4 * 4);
    L.kpart = off;  off = align256(off + bhk * L.nsplit * D * 4);
    L.vt = off;     off = align256(off + bhk * D * L.skv_pad * (p.pv_mode == PV_FP8_MMA ? 1 : 2));
    L.vscale = off; off = align256(off + bhk * D * 4);
    L.vpart = off;  off = align256(off + bhk * L.nsplit * 3 * D * 4);  // max|V| (or sum, max, min with smooth_v)
    L.kmean = off;  off = align256(off + bhk * D * 4);
    L.vmax = off;   off = align256(off + bhk * D * 4);
    L.vmean = off;  off = align256(off + bhk * D * 4);
    L.qmean = off;  off = align256(off + (q4 ? bhq * L.nqb * D * 4 : 0));
    L.ds = off;     off = align256(off + (q4 ? bhq * L.nqb * L.skv_pad * 4 : 0));  // Delta S, fp32, log2 domain
    L.total = off;
    return L;
}

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
__host__ __device__ __forceinline__ int qk_max(const SageAttnParams& p) { return p.qk_bits == 4 ? 7 : 127; }

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

// sequence b: its lengths (the max lengths Sq/Skv unless varlen) and the token offset of its first row
__device__ __forceinline__ int len_q(const SageAttnParams& p, int b) {
    if (!p.cu_seqlens_q) return p.Sq;
    return min(p.Sq, max(0, p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b]));
}
__device__ __forceinline__ int len_k(const SageAttnParams& p, int b) {
    if (!p.cu_seqlens_k) return p.Skv;
    return min(p.Skv, max(0, p.cu_seqlens_k[b + 1] - p.cu_seqlens_k[b]));
}
__device__ __forceinline__ int64_t tok0_q(const SageAttnParams& p, int b) {
    return p.cu_seqlens_q ? (int64_t)p.cu_seqlens_q[b] : 0;
}
__device__ __forceinline__ int64_t tok0_k(const SageAttnParams& p, int b) {
    return p.cu_seqlens_k ? (int64_t)p.cu_seqlens_k[b] : 0;
}

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

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(smem)), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
__device__ __forceinline__ void mma_s8(int* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_s4(int* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k64.row.col.s32.s4.s4.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// 8 signed 4-bit values (low nibble first = lower column): the m16n8k64 s4 fragments then have exactly the byte
// layout of the m16n8k32 s8 ones over the packed row (D/2 bytes)
__device__ __forceinline__ uint32_t pack_s4x8(const int* v) {
    uint32_t r = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) r |= (uint32_t)(v[i] & 0xf) << (4 * i);
    return r;
}
[[maybe_unused]] __device__ __forceinline__ void mma_e4m3(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    (void)c; (void)a; (void)b0; (void)b1;
#endif
}
__device__ __forceinline__ void mma_f16(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Programmatic dependent launch (sm_90): a kernel launched with the PDL attribute (hop_launch) may start while its
// predecessor in the stream finishes; it must call pdl_wait() before its first global memory access (read or
// write: the caching allocator reuses memory in stream order). pdl_launch_dependents() lets the next kernel start.
// Both are no-ops for kernels launched without the attribute and compile to nothing below sm_90.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// ----------------------------------------------------------------------------------------------
// 1. stats: partial sums of K (z = 0) and, for V (z = 1), partial max |V| per (b, kv-head, split, channel), or with
// smooth_v partial sum, max and min of V (max|V - mean| = max(max - mean, mean - min) exactly: rounding is monotone).
template <int D, typename T>
__global__ void __launch_bounds__(kThreads) stats_kernel(SageAttnParams p, float* kpart, float* vpart, int nsplit) {
    constexpr int NC = D / 8, NR = kThreads / NC;
    __shared__ float red[3][NR][D];
    const int z = blockIdx.z, bh = blockIdx.y, split = blockIdx.x;
    const int b = bh / p.Hkv, h = bh % p.Hkv;
    const int skv = len_k(p, b);
    const int chunk = (skv + nsplit - 1) / nsplit;
    const int s0 = split * chunk;
    const int s1 = min(skv, s0 + chunk);
    const int col = threadIdx.x % NC, rl = threadIdx.x / NC;
    const T* base = z == 0 ? static_cast<const T*>(p.k) + b * p.k_sb + h * p.k_sh + tok0_k(p, b) * p.k_ss
                           : static_cast<const T*>(p.v) + b * p.v_sb + h * p.v_sh + tok0_k(p, b) * p.v_ss;
    const int64_t ss = z == 0 ? p.k_ss : p.v_ss;
    const bool sv = z == 1 && p.smooth_v;
    float acc[8], amx[8], amn[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) { acc[i] = 0.f; amx[i] = -INFINITY; amn[i] = INFINITY; }
    constexpr int U = 4;  // rows loaded before any is used: 4 x 16 bytes in flight per thread (1 left it latency-bound)
    for (int s = s0 + rl; s < s1; s += U * NR) {
        uint4 raw[U];
#pragma unroll
        for (int u = 0; u < U; ++u)
            raw[u] = s + u * NR < s1 ? *reinterpret_cast<const uint4*>(base + (int64_t)(s + u * NR) * ss + col * 8)
                                     : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (s + u * NR >= s1) break;
            float x[8];
            Vec8<T>::load(reinterpret_cast<const T*>(&raw[u]), x);
            if (z == 0) {
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[i] += x[i];
            } else if (sv) {
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    acc[i] += x[i]; amx[i] = fmax_nan(amx[i], x[i]); amn[i] = fmin_nan(amn[i], x[i]);
                }
            } else {
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[i] = fmax_nan(acc[i], fabsf(x[i]));
            }
        }
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        red[0][rl][col * 8 + i] = acc[i];
        red[1][rl][col * 8 + i] = amx[i];
        red[2][rl][col * 8 + i] = amn[i];
    }
    __syncthreads();
    if (threadIdx.x < D) {
        const int d = threadIdx.x;
        if (z == 0) {
            float r = 0.f;
            for (int j = 0; j < NR; ++j) r += red[0][j][d];
            kpart[((int64_t)bh * nsplit + split) * D + d] = r;
        } else if (sv) {
            float r = 0.f, mx = -INFINITY, mn = INFINITY;
            for (int j = 0; j < NR; ++j) {
                r += red[0][j][d]; mx = fmax_nan(mx, red[1][j][d]); mn = fmin_nan(mn, red[2][j][d]);
            }
            float* out = vpart + ((int64_t)bh * nsplit + split) * 3 * D;
            out[d] = r; out[D + d] = mx; out[2 * D + d] = mn;
        } else {
            float r = 0.f;
            for (int j = 0; j < NR; ++j) r = fmax_nan(r, red[0][j][d]);
            vpart[((int64_t)bh * nsplit + split) * 3 * D + d] = r;
        }
    }
}

// 1b. reduce the partials once per (b, kv-head): mean(K), and max|V| (max|V - mean(V)| and mean(V) with smooth_v)
// per channel. Empty sequences (varlen) get a zero mean.
template <int D>
__global__ void __launch_bounds__(D) finalize_stats_kernel(SageAttnParams p, const float* kpart, const float* vpart,
                                                           int nsplit, float* kmean, float* vmax, float* vmean,
                                                           int do_v) {
    const int64_t bh = blockIdx.x;
    const int d = threadIdx.x;
    const int skv = len_k(p, (int)(bh / p.Hkv));
    float s = 0.f;
    for (int j = 0; j < nsplit; ++j) s += kpart[(bh * nsplit + j) * D + d];
    kmean[bh * D + d] = skv > 0 ? s / (float)skv : 0.f;
    if (!do_v) return;
    const float* vp = vpart + bh * nsplit * 3 * D;
    if (p.smooth_v) {
        float sum = 0.f, mx = -INFINITY, mn = INFINITY;
        for (int j = 0; j < nsplit; ++j) {
            sum += vp[j * 3 * D + d];
            mx = fmax_nan(mx, vp[j * 3 * D + D + d]);
            mn = fmin_nan(mn, vp[j * 3 * D + 2 * D + d]);
        }
        const float mean = skv > 0 ? sum / (float)skv : 0.f;
        vmean[bh * D + d] = mean;
        vmax[bh * D + d] = skv > 0 ? finite_or_nan(fmax_nan(0.f, fmax_nan(mx - mean, mean - mn))) : 0.f;
    } else {
        float m = 0.f;
        for (int j = 0; j < nsplit; ++j) m = fmax_nan(m, vp[j * 3 * D + d]);
        vmax[bh * D + d] = finite_or_nan(m);  // NaN: the channel's V scale is NaN (quant_v_kernel, epilogue)
    }
}

// 2a. Q -> INT8 (INT4 values for "4b"), groups Grouping(WQ, 8, 1): in each WQ-row warp tile, rows with equal r % 8
// share a scale (the rows one lane holds in the m16n8 accumulators: g, g+8 of each of the WQ/16 m-tiles).
// Also writes qshift[row] = sm_scale * q . mean(K) (from the unsmoothed q): the LSE of the smoothed scores plus it
// is the true LSE. "4b": the CTA's 4*WQ rows are one Q-smoothing block: q_mean (over its rows < Sq) is subtracted
// before quantization and written to qmean for the Delta S pass.
template <int D, typename T, int WQ>
__global__ void __launch_bounds__(kThreads) quant_q_kernel(SageAttnParams p, int8_t* qi8, float* qscale,
                                                           float* qshift, float* qmean, const float* kmean,
                                                           int sq_pad) {
    constexpr int CPL = D / 32;  // 8-element chunks per lane per row
    constexpr int NR = WQ / 8;   // rows per lane
    constexpr int BQ = 4 * WQ;
    __shared__ float smean[D];
    __shared__ float qsum[4][D];
    const int bh = blockIdx.y, b = bh / p.Hq, h = bh % p.Hq;
    const int sq = len_q(p, b);
    if (blockIdx.x * BQ >= sq) return;  // varlen: past this sequence's end (never read)
    if (threadIdx.x < D) {
        const int64_t bhk = (int64_t)b * p.Hkv + h / (p.Hq / p.Hkv);
        smean[threadIdx.x] = kmean[bhk * D + threadIdx.x];
    }
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int tile = blockIdx.x * 4 + warp;
    const T* base = static_cast<const T*>(p.q) + b * p.q_sb + h * p.q_sh + tok0_q(p, b) * p.q_ss;
    float x[NR][CPL][8];
#pragma unroll
    for (int r = 0; r < NR; ++r) {
        const int row = tile * WQ + g + 8 * r;
#pragma unroll
        for (int i = 0; i < CPL; ++i) {
            if (row < sq) Vec8<T>::load(base + row * p.q_ss + (t + 4 * i) * 8, x[r][i]);
            else {
#pragma unroll
                for (int e = 0; e < 8; ++e) x[r][i][e] = 0.f;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < NR; ++r) {
        const int row = tile * WQ + g + 8 * r;
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < CPL; ++i)
#pragma unroll
            for (int e = 0; e < 8; ++e) dot = fmaf(x[r][i][e], smean[(t + 4 * i) * 8 + e], dot);
        dot += __shfl_xor_sync(0xffffffffu, dot, 1);
        dot += __shfl_xor_sync(0xffffffffu, dot, 2);
        if (t == 0) qshift[(int64_t)bh * sq_pad + row] = dot * p.sm_scale;
    }
    if (p.qk_bits == 4) {  // Q smoothing: subtract the block mean from the valid rows (padding rows stay 0)
#pragma unroll
        for (int i = 0; i < CPL; ++i)
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                float s = 0.f;
#pragma unroll
                for (int r = 0; r < NR; ++r) s += x[r][i][e];
                s += __shfl_xor_sync(0xffffffffu, s, 4);
                s += __shfl_xor_sync(0xffffffffu, s, 8);
                s += __shfl_xor_sync(0xffffffffu, s, 16);
                if (g == 0) qsum[warp][(t + 4 * i) * 8 + e] = s;
            }
        __syncthreads();
        const float cnt = (float)min(BQ, sq - (int)blockIdx.x * BQ);
#pragma unroll
        for (int i = 0; i < CPL; ++i)
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const int c = (t + 4 * i) * 8 + e;
                const float qm = (((qsum[0][c] + qsum[1][c]) + qsum[2][c]) + qsum[3][c]) / cnt;
                if (warp == 0 && g == 0) qmean[((int64_t)bh * (sq_pad / BQ) + blockIdx.x) * D + c] = qm;
#pragma unroll
                for (int r = 0; r < NR; ++r)
                    if (tile * WQ + g + 8 * r < sq) x[r][i][e] -= qm;
            }
    }
    float am = 0.f;
#pragma unroll
    for (int r = 0; r < NR; ++r)
#pragma unroll
        for (int i = 0; i < CPL; ++i)
#pragma unroll
            for (int e = 0; e < 8; ++e) am = fmax_nan(am, fabsf(x[r][i][e]));
    am = fmax_nan(am, __shfl_xor_sync(0xffffffffu, am, 1));
    am = fmax_nan(am, __shfl_xor_sync(0xffffffffu, am, 2));
    const int qmax = qk_max(p);
    // non-finite group: NaN scale (its values quantize to 0, the attention's scores of these rows are NaN)
    const float sc = finite_or_nan(am) / (float)qmax;
    if (t == 0) qscale[((int64_t)bh * (sq_pad / WQ) + tile) * 8 + g] = sc;
    if (p.qk_mma && p.qk_bits == 4) {  // packed INT4 rows of D/2 bytes
#pragma unroll
        for (int r = 0; r < NR; ++r) {
            const int row = tile * WQ + g + 8 * r;
            uint8_t* o = reinterpret_cast<uint8_t*>(qi8) + ((int64_t)bh * sq_pad + row) * (D / 2);
#pragma unroll
            for (int i = 0; i < CPL; ++i) {
                int v[8];
#pragma unroll
                for (int e = 0; e < 8; ++e) v[e] = quant_i8(x[r][i][e], sc, qmax);
                *reinterpret_cast<uint32_t*>(o + (t + 4 * i) * 4) = pack_s4x8(v);
            }
        }
        return;
    }
#pragma unroll
    for (int r = 0; r < NR; ++r) {
        const int row = tile * WQ + g + 8 * r;
        int8_t* o = qi8 + ((int64_t)bh * sq_pad + row) * D;
#pragma unroll
        for (int i = 0; i < CPL; ++i) {
            uint32_t w[2];
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                uint32_t a = 0;
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    a |= (uint32_t)(quant_i8(x[r][i][4 * hh + e], sc, qmax) & 0xff) << (8 * e);
                w[hh] = a;
            }
            *reinterpret_cast<uint2*>(o + (t + 4 * i) * 8) = make_uint2(w[0], w[1]);
        }
    }
}

// 2b. K - mean(K) -> INT8 (INT4 values for "4b"), groups Grouping(64, 8, 2): in each 64-key block keys with equal
// (c % 8) / 2 share a scale. Varlen: per sequence (its own mean; blocks restart at the sequence start).
template <int D, typename T>
__global__ void __launch_bounds__(kThreads) quant_k_kernel(SageAttnParams p, const float* kmean, int8_t* ki8,
                                                           float* kscale, int skv_pad) {
    constexpr int H = D / 2, CH = H / 8;
    __shared__ float smean[D];
    __shared__ float rowmax[kBK];
    const int kb = blockIdx.x, bh = blockIdx.y, b = bh / p.Hkv, h = bh % p.Hkv;
    const int skv = len_k(p, b);
    if (kb * kBK >= skv) return;  // varlen: past this sequence's end (never read)
    if (threadIdx.x < D) smean[threadIdx.x] = kmean[(int64_t)bh * D + threadIdx.x];
    __syncthreads();
    const int c = threadIdx.x >> 1, hh = threadIdx.x & 1;
    const int key = kb * kBK + c;
    const T* src = static_cast<const T*>(p.k) + b * p.k_sb + h * p.k_sh + (tok0_k(p, b) + key) * p.k_ss + hh * H;
    float x[CH][8];
    float am = 0.f;
#pragma unroll
    for (int j = 0; j < CH; ++j) {
        if (key < skv) {
            Vec8<T>::load(src + 8 * j, x[j]);
#pragma unroll
            for (int e = 0; e < 8; ++e) x[j][e] -= smean[hh * H + 8 * j + e];
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) x[j][e] = 0.f;
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) am = fmax_nan(am, fabsf(x[j][e]));
    }
    am = fmax_nan(am, __shfl_xor_sync(0xffffffffu, am, 1));
    if (hh == 0) rowmax[c] = am;
    __syncthreads();
    const int grp = (c & 7) >> 1;
    float gm = 0.f;
#pragma unroll
    for (int a = 0; a < 8; ++a) gm = fmax_nan(gm, fmax_nan(rowmax[8 * a + 2 * grp], rowmax[8 * a + 2 * grp + 1]));
    const int qmax = qk_max(p);
    const float sc = finite_or_nan(gm) / (float)qmax;  // non-finite group: NaN scale (its scores are NaN)
    if (hh == 0 && c < 8 && (c & 1) == 0) kscale[((int64_t)bh * (skv_pad / kBK) + kb) * 4 + grp] = sc;
    if (p.qk_mma && p.qk_bits == 4) {  // packed INT4 rows of D/2 bytes
        uint8_t* dst4 = reinterpret_cast<uint8_t*>(ki8) + ((int64_t)bh * skv_pad + key) * (D / 2) + hh * (H / 2);
#pragma unroll
        for (int j = 0; j < CH; ++j) {
            int v[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) v[e] = quant_i8(x[j][e], sc, qmax);
            *reinterpret_cast<uint32_t*>(dst4 + 4 * j) = pack_s4x8(v);
        }
        return;
    }
    int8_t* dst = ki8 + ((int64_t)bh * skv_pad + key) * D + hh * H;
#pragma unroll
    for (int j = 0; j < CH; ++j) {
        uint32_t w[2];
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            uint32_t a = 0;
#pragma unroll
            for (int e = 0; e < 4; ++e) a |= (uint32_t)(quant_i8(x[j][4 * q + e], sc, qmax) & 0xff) << (8 * e);
            w[q] = a;
        }
        *reinterpret_cast<uint2*>(dst + 8 * j) = make_uint2(w[0], w[1]);
    }
}

// 2c. V -> FP8 E4M3 per channel (scale amax/448), transposed to [d][key slot] per 64-key block, with the keys of
// each 32-key half permuted so that the m16n8k32 accumulator fragment of S is directly the A fragment of P~:
// slot s (0..31) holds key 16*(s/16) + 8*((s%4)/2) + 2*((s%16)/4) + (s%2).
// PV_FP16: V as fp16, transposed, natural key order (m16n8k16 fragments match the S layout).
// PV_FP8_F16: like PV_FP16 but each value is e4m3(v / scale) (exactly representable in fp16).
// smooth_v: mean(V) (per sequence and channel) is subtracted first; vmax is then max|V - mean|.
template <int D, typename T, int PV>
__global__ void __launch_bounds__(kThreads) quant_v_kernel(SageAttnParams p, const float* vmax, const float* vmean,
                                                           uint8_t* vt, float* vscale, int skv_pad) {
    __shared__ float tile[kBK][D + 1];
    __shared__ float sscale[D];
    __shared__ float svmean[D];
    const int kb = blockIdx.x, bh = blockIdx.y, b = bh / p.Hkv, h = bh % p.Hkv;
    const int skv = len_k(p, b);
    if (kb > 0 && kb * kBK >= skv) return;  // varlen: past this sequence's end (block 0 always writes vscale)
    if (threadIdx.x < D) {
        if (PV != PV_FP16) {
            const float sc = vmax[(int64_t)bh * D + threadIdx.x] / kFp8Max;
            sscale[threadIdx.x] = sc;
            if (kb == 0) vscale[(int64_t)bh * D + threadIdx.x] = sc;
        }
        svmean[threadIdx.x] = p.smooth_v ? vmean[(int64_t)bh * D + threadIdx.x] : 0.f;
    }
    __syncthreads();
    const T* src = static_cast<const T*>(p.v) + b * p.v_sb + h * p.v_sh + tok0_k(p, b) * p.v_ss;
    for (int i = threadIdx.x; i < kBK * (D / 8); i += kThreads) {
        const int r = i / (D / 8), c = i % (D / 8);
        const int key = kb * kBK + r;
        float x[8];
        if (key < skv) {
            Vec8<T>::load(src + (int64_t)key * p.v_ss + c * 8, x);
            if (p.smooth_v) {
#pragma unroll
                for (int e = 0; e < 8; ++e) x[e] -= svmean[c * 8 + e];
            }
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) x[e] = 0.f;
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) tile[r][c * 8 + e] = x[e];
    }
    __syncthreads();
    if constexpr (PV == PV_FP8_MMA) {
        for (int task = threadIdx.x; task < D * 4; task += kThreads) {
            const int d = task >> 2, sg = task & 3;
            const float sc = sscale[d];
            uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
            for (int i = 0; i < 16; i += 2) {
                float x2[2];
#pragma unroll
                for (int u = 0; u < 2; ++u) {
                    const int slot = sg * 16 + i + u;
                    const int s = slot & 31;
                    const int key = (slot >> 5) * 32 + (s >> 4) * 16 + ((s & 3) >> 1) * 8 + ((s & 15) >> 2) * 2 + (s & 1);
                    // (a NaN scale, non-finite channel: 0 here, NaN in the epilogue's multiply by vscale)
                    x2[u] = sc > 0.f ? tile[key][d] / sc : 0.f;
                }
                w[i >> 2] |= cvt_e4m3x2(x2[0], x2[1]) << (8 * (i & 3));
            }
            *reinterpret_cast<uint4*>(vt + ((int64_t)bh * D + d) * skv_pad + kb * kBK + sg * 16) =
                make_uint4(w[0], w[1], w[2], w[3]);
        }
    } else {
        for (int task = threadIdx.x; task < D * 8; task += kThreads) {
            const int d = task >> 3, grp = task & 7;
            uint32_t w[4];
            if constexpr (PV == PV_FP16) {
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    w[i] = pack2<__half>(tile[grp * 8 + 2 * i][d], tile[grp * 8 + 2 * i + 1][d]);
            } else {
                const float sc = sscale[d];
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float a = sc > 0.f ? tile[grp * 8 + 2 * i][d] / sc : 0.f;
                    const float c = sc > 0.f ? tile[grp * 8 + 2 * i + 1][d] / sc : 0.f;
                    w[i] = e4m3x2_to_f16x2(cvt_e4m3x2(a, c));
                }
            }
            *reinterpret_cast<uint4*>(vt + (((int64_t)bh * D + d) * skv_pad + kb * kBK + grp * 8) * 2) =
                make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
}

// 2d. "4b" Delta S = q_mean(block) . (K - mean(K))^T in fp32 (K unquantized, as in the reference), times
// sm_scale * log2(e): ds[(b, hq, qblock), key], added to the scores of every row of the Q-smoothing block.
// CTA = 64 keys of one (b, q-head); 2 threads per key (half the channels each).
template <int D, typename T>
__global__ void __launch_bounds__(kThreads) delta_s_kernel(SageAttnParams p, const float* kmean, const float* qmean,
                                                           float* ds, int nqb, int bq, int skv_pad) {
    constexpr int H = D / 2, CH = H / 8;
    __shared__ float smean[D];
    const int kb = blockIdx.x, bhq = blockIdx.y, b = bhq / p.Hq, h = bhq % p.Hq;
    const int hk = h / (p.Hq / p.Hkv);
    const int64_t bhk = (int64_t)b * p.Hkv + hk;
    const int skv = len_k(p, b), sq = len_q(p, b);
    if (kb * kBK >= skv) return;
    if (threadIdx.x < D) smean[threadIdx.x] = kmean[bhk * D + threadIdx.x];
    __syncthreads();
    const int c = threadIdx.x >> 1, hh = threadIdx.x & 1;
    const int key = kb * kBK + c;
    const T* src = static_cast<const T*>(p.k) + b * p.k_sb + hk * p.k_sh + (tok0_k(p, b) + key) * p.k_ss + hh * H;
    float x[CH][8];
#pragma unroll
    for (int j = 0; j < CH; ++j) {
        if (key < skv) {
            Vec8<T>::load(src + 8 * j, x[j]);
#pragma unroll
            for (int e = 0; e < 8; ++e) x[j][e] -= smean[hh * H + 8 * j + e];
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) x[j][e] = 0.f;
        }
    }
    const int nq = min(nqb, (sq + bq - 1) / bq);
    const float mul = p.sm_scale * kLog2e;
    for (int qb = 0; qb < nq; ++qb) {
        const float4* qm = reinterpret_cast<const float4*>(qmean + ((int64_t)bhq * nqb + qb) * D + hh * H);
        float d = 0.f;
#pragma unroll
        for (int j = 0; j < CH; ++j) {
            const float4 a = __ldg(qm + 2 * j), bb = __ldg(qm + 2 * j + 1);
            d = fmaf(x[j][0], a.x, d); d = fmaf(x[j][1], a.y, d); d = fmaf(x[j][2], a.z, d); d = fmaf(x[j][3], a.w, d);
            d = fmaf(x[j][4], bb.x, d); d = fmaf(x[j][5], bb.y, d); d = fmaf(x[j][6], bb.z, d); d = fmaf(x[j][7], bb.w, d);
        }
        d += __shfl_xor_sync(0xffffffffu, d, 1);
        if (hh == 0) ds[((int64_t)bhq * nqb + qb) * skv_pad + key] = d * mul;
    }
}

// ----------------------------------------------------------------------------------------------
// 3. attention.
// CTA = 4 warps x WQ query rows (WQ/16 m16 tiles per warp, sharing every K/V fragment);
// KV blocks of 64 keys, double-buffered with cp.async.
// Q fragments: in registers for WQ = 16; for WQ = 32 the Q tile stays in shared memory (registers go to the two
// m-tiles' accumulators) and each k-step reloads its A fragments with ldmatrix.
template <int D, int PV, int WQ, int DB>
struct AttnSmem {
    static constexpr bool QSMEM = WQ > 16;
    static constexpr int KSTR = DB + 16;                      // bytes per quantized K (and Q) row + pad
    static constexpr int VROWB = PV != PV_FP8_MMA ? kBK * 2 : kBK;  // bytes per V^T row
    static constexpr int VSTR = VROWB + 16;
    static constexpr int KBYTES = kBK * KSTR, VBYTES = D * VSTR;
    static constexpr int QBYTES = QSMEM ? 4 * WQ * KSTR : 0;
    static constexpr int TOTAL = 2 * (KBYTES + VBYTES) + QBYTES;
};

struct AttnWs {  // the pre-passes' outputs the attention kernel reads
    const int8_t* qi8; const float* qscale; const float* qshift;
    const int8_t* ki8; const float* kscale;
    const uint8_t* vt; const float* vscale; const float* vmean;
    const float* ds; int nqb;
    int sq_pad, skv_pad;
};

template <int D, int PV, typename T, int WQ, int QKM>
__device__ __forceinline__ void attn_body(const SageAttnParams& p, const AttnWs& w) {
    constexpr bool Q4 = QKM != QK_I8;              // "4b": + Delta S
    constexpr int DB = qk_row_bytes(D, QKM);       // bytes per quantized Q/K row; one MMA k-step = 32 bytes
    const int8_t* qi8 = w.qi8; const float* qscale = w.qscale; const float* qshift = w.qshift;
    const int8_t* ki8 = w.ki8; const float* kscale = w.kscale;
    const uint8_t* vt = w.vt; const float* vscale = w.vscale;
    const int sq_pad = w.sq_pad, skv_pad = w.skv_pad;
    using S = AttnSmem<D, PV, WQ, DB>;
    constexpr int MT = WQ / 16, BQ = 4 * WQ;
    constexpr int QR = S::QSMEM ? 1 : MT;  // Q fragment sets held in registers
    extern __shared__ __align__(128) uint8_t smem[];
    uint8_t* sK = smem;
    uint8_t* sV = smem + 2 * S::KBYTES;
    uint8_t* sQ = smem + 2 * (S::KBYTES + S::VBYTES);

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int qb = gridDim.x - 1 - blockIdx.x;  // heaviest (causal) blocks first
    const int h = blockIdx.y, b = blockIdx.z;
    const int hk = h / (p.Hq / p.Hkv);
    const int q0 = qb * BQ;
    const int sq = len_q(p, b), skv = len_k(p, b);  // this sequence (varlen) or Sq/Skv
    if (q0 >= sq) return;  // varlen: past this sequence's end
    const int64_t bhq = (int64_t)b * p.Hq + h, bhk = (int64_t)b * p.Hkv + hk;
    const int wrow = q0 + warp * WQ;  // first row of this warp

    // Q fragments (A operand, row-major 16 x 32 per k-step) straight from global memory (WQ = 16)
    uint32_t qf[QR][DB / 32][4];
#pragma unroll
    for (int mt = 0; mt < QR; ++mt) {
        if constexpr (S::QSMEM) break;
        const int8_t* Qp = qi8 + (bhq * sq_pad + wrow + mt * 16) * DB;
#pragma unroll
        for (int c = 0; c < DB / 32; ++c) {
            qf[mt][c][0] = *reinterpret_cast<const uint32_t*>(Qp + g * DB + 32 * c + 4 * t);
            qf[mt][c][1] = *reinterpret_cast<const uint32_t*>(Qp + (g + 8) * DB + 32 * c + 4 * t);
            qf[mt][c][2] = *reinterpret_cast<const uint32_t*>(Qp + g * DB + 32 * c + 16 + 4 * t);
            qf[mt][c][3] = *reinterpret_cast<const uint32_t*>(Qp + (g + 8) * DB + 32 * c + 16 + 4 * t);
        }
    }
    const float qs = qscale[(bhq * (sq_pad / WQ) + wrow / WQ) * 8 + g] * p.sm_scale * kLog2e;

    const int diag = skv - sq;  // key j visible to row i iff j <= i + diag
    int kv_end = skv;
    if (p.causal) kv_end = min(kv_end, q0 + BQ + diag);
    const int nkb = kv_end > 0 ? (kv_end + kBK - 1) / kBK : 0;
    const uint8_t* mrow = p.kmask ? p.kmask + (int64_t)b * p.kmask_sb : nullptr;

    float o[MT][D / 8][4];
    float m[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int i = 0; i < D / 8; ++i) o[mt][i][0] = o[mt][i][1] = o[mt][i][2] = o[mt][i][3] = 0.f;
        m[mt][0] = m[mt][1] = -INFINITY;
        l[mt][0] = l[mt][1] = 0.f;
    }

    const uint8_t* Kg = reinterpret_cast<const uint8_t*>(ki8) + bhk * skv_pad * DB;
    constexpr int VEL = PV != PV_FP8_MMA ? 2 : 1;
    const uint8_t* Vg = vt + bhk * D * (int64_t)skv_pad * VEL;
    const float* ksc = kscale + bhk * (skv_pad / kBK) * 4;

    auto load_tile = [&](int kb, int buf) {
        uint8_t* dK = sK + buf * S::KBYTES;
        uint8_t* dV = sV + buf * S::VBYTES;
#pragma unroll
        for (int it = 0; it < kBK * DB / 16 / kThreads; ++it) {
            const int i = tid + it * kThreads;
            const int r = i / (DB / 16), c = i % (DB / 16);
            cp_async16(dK + r * S::KSTR + c * 16, Kg + (int64_t)(kb * kBK + r) * DB + c * 16);
        }
#pragma unroll
        for (int it = 0; it < D * S::VROWB / 16 / kThreads; ++it) {
            const int i = tid + it * kThreads;
            const int r = i / (S::VROWB / 16), c = i % (S::VROWB / 16);
            cp_async16(dV + r * S::VSTR + c * 16, Vg + (int64_t)r * skv_pad * VEL + (int64_t)kb * S::VROWB + c * 16);
        }
    };

    if constexpr (S::QSMEM) {  // the CTA's Q tile joins the first cp.async group
        const uint8_t* Qg = reinterpret_cast<const uint8_t*>(qi8) + (bhq * sq_pad + q0) * DB;
#pragma unroll
        for (int it = 0; it < BQ * DB / 16 / kThreads; ++it) {
            const int i = tid + it * kThreads;
            const int r = i / (DB / 16), c = i % (DB / 16);
            cp_async16(sQ + r * S::KSTR + c * 16, Qg + (int64_t)r * DB + c * 16);
        }
        if (nkb == 0) cp_async_commit();
    }
    if (nkb > 0) { load_tile(0, 0); cp_async_commit(); }
    // ldmatrix addresses of the A (Q) fragments: matrix mi covers rows +8*(mi%2), bytes +16*(mi/2)
    const uint32_t cQ = smem_u32(sQ) + (warp * WQ + ((lane >> 3) & 1) * 8 + (lane & 7)) * S::KSTR + (lane >> 4) * 16;
    // ldmatrix lane address pieces: matrix mi = lane / 8 covers rows +8*(mi/2), bytes +16*(mi%2)
    const int lrow = (lane >> 4) * 8 + (lane & 7), lbyte = ((lane >> 3) & 1) * 16;

    for (int kb = 0; kb < nkb; ++kb) {
        if (kb + 1 < nkb) {
            load_tile(kb + 1, (kb + 1) & 1);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const uint32_t cK = smem_u32(sK + (kb & 1) * S::KBYTES);
        const uint32_t cV = smem_u32(sV + (kb & 1) * S::VBYTES);

        // S = Q K^T (int32); each K fragment feeds the MT m-tiles
        int acc[MT][8][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[mt][j][0] = acc[mt][j][1] = acc[mt][j][2] = acc[mt][j][3] = 0;
#pragma unroll
        for (int c = 0; c < DB / 32; ++c) {  // k-steps of 32 bytes (k32 s8 or k64 s4)
            uint32_t qa[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                if constexpr (S::QSMEM) {
                    ldsm_x4(cQ + mt * 16 * S::KSTR + c * 32, qa[mt][0], qa[mt][1], qa[mt][2], qa[mt][3]);
                } else {
#pragma unroll
                    for (int i = 0; i < 4; ++i) qa[mt][i] = qf[mt < QR ? mt : 0][c][i];
                }
            }
#pragma unroll
            for (int np = 0; np < 4; ++np) {
                uint32_t b0, b1, b2, b3;
                ldsm_x4(cK + (np * 16 + lrow) * S::KSTR + c * 32 + lbyte, b0, b1, b2, b3);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    if constexpr (QKM == QK_I4_MMA) {
                        mma_s4(acc[mt][2 * np], qa[mt], b0, b1);
                        mma_s4(acc[mt][2 * np + 1], qa[mt], b2, b3);
                    } else {
                        mma_s8(acc[mt][2 * np], qa[mt], b0, b1);
                        mma_s8(acc[mt][2 * np + 1], qa[mt], b2, b3);
                    }
                }
            }
        }
        const float sc = qs * ksc[kb * 4 + t];  // one Q scale and one K scale per thread; log2 domain
        const int kbase = kb * kBK;
        const bool need_mask = (kbase + kBK > skv) || (mrow != nullptr) || (p.causal && kbase + kBK - 1 > q0 + diag);
        bool kok[8][2];
        if (need_mask) {
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int key = kbase + 8 * j + 2 * t + e;
                    bool ok = key < skv;
                    if (ok && mrow) ok = mrow[key] != 0;
                    kok[j][e] = ok;
                }
        }
        float2 dsv[Q4 ? 8 : 1];
        if constexpr (Q4) {
            const float* dr = w.ds + (bhq * w.nqb + qb) * (int64_t)skv_pad + kbase + 2 * t;
#pragma unroll
            for (int j = 0; j < 8; ++j) dsv[j] = *reinterpret_cast<const float2*>(dr + 8 * j);
        }
        float al[MT][2];
        // P~ (scaled by 448 in the FP8 modes) in the S registers; row sums into l
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            float (&s)[8][4] = *reinterpret_cast<float (*)[8][4]>(&acc[mt][0][0]);
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[j][e] = small_i2f(acc[mt][j][e]) * sc;
            if constexpr (Q4) {  // + Delta S of the CTA's Q-smoothing block (already x sm_scale x log2 e)
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    s[j][0] += dsv[j].x; s[j][1] += dsv[j].y;
                    s[j][2] += dsv[j].x; s[j][3] += dsv[j].y;
                }
            }
            if (need_mask) {
                const int r0 = wrow + mt * 16 + g, r1 = r0 + 8;
#pragma unroll
                for (int j = 0; j < 8; ++j)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int key = kbase + 8 * j + 2 * t + e;
                        if (!kok[j][e] || (p.causal && key > r0 + diag)) s[j][e] = -INFINITY;
                        if (!kok[j][e] || (p.causal && key > r1 + diag)) s[j][2 + e] = -INFINITY;
                    }
            }
            float mx0 = m[mt][0], mx1 = m[mt][1];
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                mx0 = fmaxf(mx0, fmaxf(s[j][0], s[j][1]));
                mx1 = fmaxf(mx1, fmaxf(s[j][2], s[j][3]));
            }
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
            const float mu0 = mx0 == -INFINITY ? 0.f : mx0;
            const float mu1 = mx1 == -INFINITY ? 0.f : mx1;
            al[mt][0] = fast_exp2(m[mt][0] - mu0);
            al[mt][1] = fast_exp2(m[mt][1] - mu1);
            m[mt][0] = mx0;
            m[mt][1] = mx1;
            // FP8 modes: P~ * 448 directly (exp2 of s - m + log2 448); l then carries the factor 448 too
            const float pm0 = PV == PV_FP16 ? mu0 : mu0 - kLog2Fp8Max;
            const float pm1 = PV == PV_FP16 ? mu1 : mu1 - kLog2Fp8Max;
            float rs0 = 0.f, rs1 = 0.f;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                s[j][0] = fast_exp2(s[j][0] - pm0); s[j][1] = fast_exp2(s[j][1] - pm0);
                s[j][2] = fast_exp2(s[j][2] - pm1); s[j][3] = fast_exp2(s[j][3] - pm1);
                rs0 += s[j][0] + s[j][1];
                rs1 += s[j][2] + s[j][3];
            }
            l[mt][0] = l[mt][0] * al[mt][0] + rs0;
            l[mt][1] = l[mt][1] * al[mt][1] + rs1;
        }

        // P~ fragments (A operand of the P~V MMA)
        constexpr int NKK = PV == PV_FP8_MMA ? 2 : 4;  // k-steps over the 64 keys
        uint32_t pa[MT][NKK][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const float (&s)[8][4] = *reinterpret_cast<const float (*)[8][4]>(&acc[mt][0][0]);
#pragma unroll
            for (int kk = 0; kk < NKK; ++kk) {
                if constexpr (PV == PV_FP8_MMA) {
                    // slots follow the permuted key order of V^T (see quant_v_kernel)
                    const int j = 4 * kk;
                    pa[mt][kk][0] = cvt_e4m3x2(s[j][0], s[j][1]) | (cvt_e4m3x2(s[j + 1][0], s[j + 1][1]) << 16);
                    pa[mt][kk][1] = cvt_e4m3x2(s[j][2], s[j][3]) | (cvt_e4m3x2(s[j + 1][2], s[j + 1][3]) << 16);
                    pa[mt][kk][2] = cvt_e4m3x2(s[j + 2][0], s[j + 2][1]) | (cvt_e4m3x2(s[j + 3][0], s[j + 3][1]) << 16);
                    pa[mt][kk][3] = cvt_e4m3x2(s[j + 2][2], s[j + 2][3]) | (cvt_e4m3x2(s[j + 3][2], s[j + 3][3]) << 16);
                } else if constexpr (PV == PV_FP16) {
                    pa[mt][kk][0] = pack2<__half>(s[2 * kk][0], s[2 * kk][1]);
                    pa[mt][kk][1] = pack2<__half>(s[2 * kk][2], s[2 * kk][3]);
                    pa[mt][kk][2] = pack2<__half>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
                    pa[mt][kk][3] = pack2<__half>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
                } else {  // P~ * 448 rounded to e4m3, carried as fp16
                    pa[mt][kk][0] = e4m3x2_to_f16x2(cvt_e4m3x2(s[2 * kk][0], s[2 * kk][1]));
                    pa[mt][kk][1] = e4m3x2_to_f16x2(cvt_e4m3x2(s[2 * kk][2], s[2 * kk][3]));
                    pa[mt][kk][2] = e4m3x2_to_f16x2(cvt_e4m3x2(s[2 * kk + 1][0], s[2 * kk + 1][1]));
                    pa[mt][kk][3] = e4m3x2_to_f16x2(cvt_e4m3x2(s[2 * kk + 1][2], s[2 * kk + 1][3]));
                }
            }
        }
        // two-level accumulation: each block's P~V in its own fp32 accumulator, then O = O*alpha + block
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
            float tmp[MT][2][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int n = 0; n < 2; ++n) tmp[mt][n][0] = tmp[mt][n][1] = tmp[mt][n][2] = tmp[mt][n][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < NKK; ++kk) {
                uint32_t b0, b1, b2, b3;
                ldsm_x4(cV + (dp * 16 + lrow) * S::VSTR + kk * 32 + lbyte, b0, b1, b2, b3);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    if constexpr (PV == PV_FP8_MMA) {
                        mma_e4m3(tmp[mt][0], pa[mt][kk], b0, b1);
                        mma_e4m3(tmp[mt][1], pa[mt][kk], b2, b3);
                    } else {
                        mma_f16(tmp[mt][0], pa[mt][kk], b0, b1);
                        mma_f16(tmp[mt][1], pa[mt][kk], b2, b3);
                    }
                }
            }
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int n = 0; n < 2; ++n) {
                    float* oo = o[mt][2 * dp + n];
                    oo[0] = oo[0] * al[mt][0] + tmp[mt][n][0];
                    oo[1] = oo[1] * al[mt][0] + tmp[mt][n][1];
                    oo[2] = oo[2] * al[mt][1] + tmp[mt][n][2];
                    oo[3] = oo[3] * al[mt][1] + tmp[mt][n][3];
                }
        }
        __syncthreads();  // this buffer is refilled two iterations later
    }

    // epilogue
    T* O = static_cast<T*>(p.o) + b * p.o_sb + h * p.o_sh + tok0_q(p, b) * p.o_ss;
    const float* vsc = vscale + bhk * D;
    const float* vmn = p.smooth_v ? w.vmean + bhk * D : nullptr;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        float l0 = l[mt][0], l1 = l[mt][1];
        l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
        l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
        l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
        l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
        // empty row (no visible key): l == 0 exactly; a NaN l (non-finite input) must not pass as empty
        const float inv0 = l0 != 0.f ? 1.f / l0 : 0.f;
        const float inv1 = l1 != 0.f ? 1.f / l1 : 0.f;
        const int row0 = wrow + mt * 16 + g, row1 = row0 + 8;
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) {
            const int col = nt * 8 + 2 * t;
            float v0 = 1.f, v1 = 1.f;
            if constexpr (PV != PV_FP16) {
                v0 = vsc[col];  // l already carries the 448 of P~
                v1 = vsc[col + 1];
            }
            float a00 = o[mt][nt][0] * inv0 * v0, a01 = o[mt][nt][1] * inv0 * v1;
            float a10 = o[mt][nt][2] * inv1 * v0, a11 = o[mt][nt][3] * inv1 * v1;
            if (vmn) {  // smooth_v: the mean comes back on rows with a visible key
                const float m0 = vmn[col], m1 = vmn[col + 1];
                if (l0 != 0.f) { a00 += m0; a01 += m1; }
                if (l1 != 0.f) { a10 += m0; a11 += m1; }
            }
            if (row0 < sq) *reinterpret_cast<uint32_t*>(O + (int64_t)row0 * p.o_ss + col) = pack2<T>(a00, a01);
            if (row1 < sq) *reinterpret_cast<uint32_t*>(O + (int64_t)row1 * p.o_ss + col) = pack2<T>(a10, a11);
        }
        if (p.lse && t == 0) {
            // (B, Hq, Sq); varlen: (Hq, total_q)
            float* L = p.cu_seqlens_q ? p.lse + h * p.lse_sh + tok0_q(p, b) : p.lse + bhq * p.Sq;
            const float* sh = qshift + bhq * sq_pad;
            const float lo = PV == PV_FP16 ? 0.f : kLnFp8Max;
            if (row0 < sq) L[row0] = l0 != 0.f ? m[mt][0] * kLn2 + (logf(l0) - lo) + sh[row0] : -INFINITY;
            if (row1 < sq) L[row1] = l1 != 0.f ? m[mt][1] * kLn2 + (logf(l1) - lo) + sh[row1] : -INFINITY;
        }
    }
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
constexpr bool kArchHasFp8 = false;
#else
constexpr bool kArchHasFp8 = true;
#endif

// CTAs per SM the register allocation must allow (register cap 65536 / (128 * n))
#ifndef SAGE_ATTN_MIN_BLOCKS_D128
#define SAGE_ATTN_MIN_BLOCKS_D128 (SAGE_WQ_D128 == 32 ? 2 : 3)
#endif
#ifndef SAGE_ATTN_MIN_BLOCKS_D64
#define SAGE_ATTN_MIN_BLOCKS_D64 (SAGE_WQ_D64 == 32 ? 2 : 4)
#endif
template <int D, int PV, typename T, int QKM>
__global__ void __launch_bounds__(kThreads, D == 64 ? SAGE_ATTN_MIN_BLOCKS_D64 : SAGE_ATTN_MIN_BLOCKS_D128)
    attn_kernel(SageAttnParams p, AttnWs w) {
    if constexpr (PV == PV_FP16 || kArchHasFp8) {
        attn_body<D, PV, T, warp_rows(D), QKM>(p, w);
    }
    // FP8 P~V below sm_89: never launched (the host checks device_cc >= 89)
}

// ----------------------------------------------------------------------------------------------
template <int D, typename T, int PV, int QKM>
int launch_attn(const SageAttnParams& p, const AttnWs& w, cudaStream_t st) {
    constexpr int WQ = warp_rows(D), BQ = 4 * WQ;
    constexpr int smem = AttnSmem<D, PV, WQ, qk_row_bytes(D, QKM)>::TOTAL;
    auto kern = attn_kernel<D, PV, T, QKM>;
    const int dev = p.device;
    if (smem > 48 * 1024) {  // dynamic shared-memory opt-in: once per kernel instantiation and device
        static bool done[64] = {};
        if (dev < 0 || dev >= 64 || !done[dev]) {
            cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
            if (e != cudaSuccess) return (int)e;
            if (dev >= 0 && dev < 64) done[dev] = true;
        }
    }
    kern<<<dim3(w.sq_pad / BQ, p.Hq, p.B), kThreads, smem, st>>>(p, w);
    return (int)cudaGetLastError();
}

template <int D, typename T, int PV>
int launch_all(const SageAttnParams& p, cudaStream_t st) {
    const Layout L = make_layout(p);
    uint8_t* ws = static_cast<uint8_t*>(p.workspace);
    int8_t* qi8 = reinterpret_cast<int8_t*>(ws + L.qi8);
    float* qscale = reinterpret_cast<float*>(ws + L.qscale);
    float* qshift = reinterpret_cast<float*>(ws + L.qshift);
    int8_t* ki8 = reinterpret_cast<int8_t*>(ws + L.ki8);
    float* kscale = reinterpret_cast<float*>(ws + L.kscale);
    float* kpart = reinterpret_cast<float*>(ws + L.kpart);
    uint8_t* vt = ws + L.vt;
    float* vscale = reinterpret_cast<float*>(ws + L.vscale);
    float* vpart = reinterpret_cast<float*>(ws + L.vpart);
    float* kmean = reinterpret_cast<float*>(ws + L.kmean);
    float* vmax = reinterpret_cast<float*>(ws + L.vmax);
    float* vmean = reinterpret_cast<float*>(ws + L.vmean);
    float* qmean = reinterpret_cast<float*>(ws + L.qmean);
    float* ds = reinterpret_cast<float*>(ws + L.ds);
    const int ns = (int)L.nsplit, sqp = (int)L.sq_pad, skp = (int)L.skv_pad, nqb = (int)L.nqb;
    const int bhq = p.B * p.Hq, bhk = p.B * p.Hkv;
    const bool q4 = p.qk_bits == 4;
    const int do_v = (PV != PV_FP16 || p.smooth_v) ? 1 : 0;

    stats_kernel<D, T><<<dim3(ns, bhk, 1 + do_v), kThreads, 0, st>>>(p, kpart, vpart, ns);
    constexpr int WQ = warp_rows(D), BQ = 4 * WQ;
    finalize_stats_kernel<D><<<bhk, D, 0, st>>>(p, kpart, vpart, ns, kmean, vmax, vmean, do_v);
    quant_q_kernel<D, T, WQ><<<dim3(sqp / BQ, bhq), kThreads, 0, st>>>(p, qi8, qscale, qshift, qmean, kmean, sqp);
    quant_k_kernel<D, T><<<dim3(skp / kBK, bhk), kThreads, 0, st>>>(p, kmean, ki8, kscale, skp);
    quant_v_kernel<D, T, PV><<<dim3(skp / kBK, bhk), kThreads, 0, st>>>(p, vmax, vmean, vt, vscale, skp);
    if (q4) delta_s_kernel<D, T><<<dim3(skp / kBK, bhq), kThreads, 0, st>>>(p, kmean, qmean, ds, nqb, BQ, skp);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return (int)e;

    const AttnWs w{qi8, qscale, qshift, ki8, kscale, vt, vscale, vmean, ds, nqb, sqp, skp};
    const int qkm = qk_mode(p);
    if (qkm == QK_I4_MMA) return launch_attn<D, T, PV, QK_I4_MMA>(p, w, st);
    if (qkm == QK_I4_I8) return launch_attn<D, T, PV, QK_I4_I8>(p, w, st);
    return launch_attn<D, T, PV, QK_I8>(p, w, st);
}

template <int D, typename T>
int dispatch_pv(const SageAttnParams& p, cudaStream_t st) {
    if (p.pv_mode == PV_FP16) return launch_all<D, T, PV_FP16>(p, st);
    if (p.pv_mode == PV_FP8_F16) return launch_all<D, T, PV_FP8_F16>(p, st);
    return launch_all<D, T, PV_FP8_MMA>(p, st);
}

template <typename T>
int dispatch_d(const SageAttnParams& p, cudaStream_t st) {
    if (p.D == 64) return dispatch_pv<64, T>(p, st);
    if (p.D == 128) return dispatch_pv<128, T>(p, st);
    return SAGE_E_HEADDIM;
}

#include "hopper_attn.cuh"

}  // namespace

extern "C" {

// Most parts a tail tile of the Hopper kernel is split into (1: no split; default and most 4); returns the previous one.
// For A/B measurements and tests: the workspace size depends on it, so set it before sizing a call.
int sage_hop_set_split_max(int parts) {
    const int prev = g_hop_split_max;
    if (parts >= 1) g_hop_split_max = parts;
    return prev;
}

int64_t sage_attn_workspace_bytes(const SageAttnParams* p) {
    if (!p) return -1;
    if (p->pv_mode == PV_WGMMA) return make_hop_layout(*p).total;
    return make_layout(*p).total;
}

int sage_attn_fwd(const SageAttnParams* p, void* stream) {
    if (!p || !p->q || !p->k || !p->v || !p->o || !p->workspace) return SAGE_E_BADARG;
    if (p->B <= 0 || p->Hq <= 0 || p->Hkv <= 0 || p->Sq <= 0 || p->Skv <= 0 || p->Hq % p->Hkv != 0) return SAGE_E_BADARG;
    if (p->pv_mode < 0 || p->pv_mode > 3) return SAGE_E_BADARG;
    if ((p->qk_bits != 0 && p->qk_bits != 8 && p->qk_bits != 4) || (p->smooth_v != 0 && p->smooth_v != 1) ||
        (p->qk_mma != 0 && p->qk_mma != 1))
        return SAGE_E_BADARG;
    if ((p->cu_seqlens_q == nullptr) != (p->cu_seqlens_k == nullptr)) return SAGE_E_BADARG;
    if (p->cu_seqlens_q && p->kmask) return SAGE_E_BADARG;
    if ((int64_t)p->B * p->Hq > 65535) return SAGE_E_BADARG;  // grid.y of the pre-passes
    if (p->device_cc < 80 || (p->pv_mode != PV_FP16 && p->device_cc < 89)) return SAGE_E_ARCH;
    cudaStream_t st = static_cast<cudaStream_t>(stream);
    // our (static) runtime keeps its own current device: follow the caller's
    int cur = -1;
    if (cudaGetDevice(&cur) != cudaSuccess || cur != p->device) {
        cudaError_t e = cudaSetDevice(p->device);
        if (e != cudaSuccess) return (int)e;
    }
    if (p->pv_mode == PV_WGMMA) {
        if (!hop_supported(*p)) return p->device_cc != 90 || !hop_compiled() ? SAGE_E_ARCH : SAGE_E_BADARG;
        if (p->dtype == 0) return hop_dispatch<__half>(*p, st);
        if (p->dtype == 1) return hop_dispatch<__nv_bfloat16>(*p, st);
        return SAGE_E_BADARG;
    }
    if (p->dtype == 0) return dispatch_d<__half>(*p, st);
    if (p->dtype == 1) return dispatch_d<__nv_bfloat16>(*p, st);
    return SAGE_E_BADARG;
}

const char* sage_error_string(int code) {
    switch (code) {
        case 0: return "ok";
        case SAGE_E_BADARG: return "bad argument";
        case SAGE_E_ARCH: return "device compute capability not supported by this kernel variant";
        case SAGE_E_HEADDIM: return "head dim not supported (64 and 128 only)";
        default: return cudaGetErrorString(static_cast<cudaError_t>(code));
    }
}

int sage_abi_version(void) { return SAGE_ABI_VERSION; }
#if SAGE_HOP_TRACE
// diagnostics builds only (-DSAGE_HOP_TRACE=1): copies the Hopper kernel's phase clocks of the last launch
int sage_hop_trace_read(long long* dst, int n) {
    const int cap = (int)(sizeof(g_hop_trace) / sizeof(long long));
    cudaError_t e = cudaMemcpyFromSymbol(dst, g_hop_trace, sizeof(long long) * (n < cap ? n : cap));
    void* sym = nullptr;  // cleared for the next launch
    if (e == cudaSuccess) e = cudaGetSymbolAddress(&sym, g_hop_trace);
    if (e == cudaSuccess) e = cudaMemset(sym, 0, sizeof(g_hop_trace));
    return (int)e;
}
#endif
#if SAGE_HOP_TRACE >= 2
int sage_hop_ltrace_read(long long* dst, int n) {
    const int cap = (int)(sizeof(g_hop_ltrace) / sizeof(long long));
    return (int)cudaMemcpyFromSymbol(dst, g_hop_ltrace, sizeof(long long) * (n < cap ? n : cap));
}
#endif

const char* sage_compiled_archs(void) { return SAGE_ARCHS; }

int sage_q_group_rows(int head_dim) { return warp_rows(head_dim); }

int sage_hopper_compiled(void) { return hop_compiled() ? 1 : 0; }

int sage_hopper_probe(const uint8_t* a, const uint8_t* b, float* d, int steps, int mode, void* stream) {
    if (!a || !b || !d || steps < 1 || (mode != 0 && mode != 1)) return SAGE_E_BADARG;
    if (!hop_compiled()) return SAGE_E_ARCH;
    hopper_probe_kernel<<<1, 128, 0, static_cast<cudaStream_t>(stream)>>>(a, b, d, steps, mode);
    return (int)cudaGetLastError();
}

}  // extern "C"

// sage_patch compiled kernels: SageAttention2-8b with warp-level mma.sync (sm_80+).
// See sage_kernels.h for the ABI and docs/kernels.md for the design and data layouts.
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "sage_kernels.h"

#ifndef SAGE_ARCHS
#define SAGE_ARCHS "unknown"
#endif

namespace {

constexpr int kThreads = 128;  // 4 warps everywhere
constexpr int kBQ = 64;        // query rows per attention CTA (4 warps x 16 rows)
constexpr int kBK = 64;        // keys per KV block
constexpr int kMaxSplit = 32;  // partial-reduction chunks for mean(K) and amax(V)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kFp8Max = 448.f;

struct Layout {  // workspace carve-up, all offsets 256-byte aligned
    int64_t sq_pad, skv_pad, nsplit;
    int64_t qi8, qscale, ki8, kscale, kpart, vt, vscale, vpart, total;
};

__host__ __device__ inline int64_t align256(int64_t x) { return (x + 255) & ~int64_t(255); }

inline Layout make_layout(const SageAttnParams& p) {
    Layout L;
    L.sq_pad = (p.Sq + kBQ - 1) / kBQ * kBQ;
    L.skv_pad = (p.Skv + kBK - 1) / kBK * kBK;
    int64_t ns = (p.Skv + 255) / 256;
    L.nsplit = ns < 1 ? 1 : (ns > kMaxSplit ? kMaxSplit : ns);
    const int64_t bhq = (int64_t)p.B * p.Hq, bhk = (int64_t)p.B * p.Hkv, D = p.D;
    int64_t off = 0;
    L.qi8 = off;    off = align256(off + bhq * L.sq_pad * D);
    L.qscale = off; off = align256(off + bhq * (L.sq_pad / 16) * 8 * 4);
    L.ki8 = off;    off = align256(off + bhk * L.skv_pad * D);
    L.kscale = off; off = align256(off + bhk * (L.skv_pad / kBK) * 4 * 4);
    L.kpart = off;  off = align256(off + bhk * L.nsplit * D * 4);
    L.vt = off;     off = align256(off + bhk * D * L.skv_pad * (p.pv_fp16 ? 2 : 1));
    L.vscale = off; off = align256(off + bhk * D * 4);
    L.vpart = off;  off = align256(off + bhk * L.nsplit * D * 4);
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

__device__ __forceinline__ int quant_i8(float x, float scale) {
    if (!(scale > 0.f)) return 0;
    int q = __float2int_rn(x / scale);
    return q > 127 ? 127 : (q < -127 ? -127 : q);
}

// FP8 E4M3, round to nearest even, saturating to +-448 (NaN stays NaN). Needs sm_89.
__device__ __forceinline__ uint32_t cvt_e4m3x2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    uint16_t r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
#else
    (void)lo; (void)hi;
    return 0u;
#endif
}

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
__device__ __forceinline__ void mma_e4m3(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
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

// ----------------------------------------------------------------------------------------------
// 1. stats: partial sums of K (z = 0) and partial max |V| (z = 1) per (b, kv-head, split, channel)
template <int D, typename T>
__global__ void __launch_bounds__(kThreads) stats_kernel(SageAttnParams p, float* kpart, float* vpart, int nsplit) {
    constexpr int NC = D / 8, NR = kThreads / NC;
    __shared__ float red[NR][D];
    const int z = blockIdx.z, bh = blockIdx.y, split = blockIdx.x;
    const int b = bh / p.Hkv, h = bh % p.Hkv;
    const int chunk = (p.Skv + nsplit - 1) / nsplit;
    const int s0 = split * chunk;
    const int s1 = min(p.Skv, s0 + chunk);
    const int col = threadIdx.x % NC, rl = threadIdx.x / NC;
    const T* base = z == 0 ? static_cast<const T*>(p.k) + b * p.k_sb + h * p.k_sh
                           : static_cast<const T*>(p.v) + b * p.v_sb + h * p.v_sh;
    const int64_t ss = z == 0 ? p.k_ss : p.v_ss;
    float acc[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = 0.f;
    for (int s = s0 + rl; s < s1; s += NR) {
        float x[8];
        Vec8<T>::load(base + s * ss + col * 8, x);
        if (z == 0) {
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[i] += x[i];
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[i] = fmaxf(acc[i], fabsf(x[i]));
        }
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) red[rl][col * 8 + i] = acc[i];
    __syncthreads();
    if (threadIdx.x < D) {
        float r = 0.f;
        for (int j = 0; j < NR; ++j) r = z == 0 ? r + red[j][threadIdx.x] : fmaxf(r, red[j][threadIdx.x]);
        float* out = z == 0 ? kpart : vpart;
        out[((int64_t)bh * nsplit + split) * D + threadIdx.x] = r;
    }
}

// 2a. Q -> INT8, groups Grouping(16, 8, 1): in each 16-row warp tile rows r and r+8 share a scale.
template <int D, typename T>
__global__ void __launch_bounds__(kThreads) quant_q_kernel(SageAttnParams p, int8_t* qi8, float* qscale, int sq_pad) {
    constexpr int CPL = D / 32;  // 8-element chunks per lane per row
    const int bh = blockIdx.y, b = bh / p.Hq, h = bh % p.Hq;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int tile = blockIdx.x * 4 + warp;
    const int r0 = tile * 16 + g, r1 = r0 + 8;
    const T* base = static_cast<const T*>(p.q) + b * p.q_sb + h * p.q_sh;
    float x0[CPL][8], x1[CPL][8];
    float am = 0.f;
#pragma unroll
    for (int i = 0; i < CPL; ++i) {
        const int c = (t + 4 * i) * 8;
        if (r0 < p.Sq) Vec8<T>::load(base + r0 * p.q_ss + c, x0[i]);
        else {
#pragma unroll
            for (int e = 0; e < 8; ++e) x0[i][e] = 0.f;
        }
        if (r1 < p.Sq) Vec8<T>::load(base + r1 * p.q_ss + c, x1[i]);
        else {
#pragma unroll
            for (int e = 0; e < 8; ++e) x1[i][e] = 0.f;
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) am = fmaxf(am, fmaxf(fabsf(x0[i][e]), fabsf(x1[i][e])));
    }
    am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, 1));
    am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, 2));
    const float sc = am / 127.f;
    if (t == 0) qscale[((int64_t)bh * (sq_pad / 16) + tile) * 8 + g] = sc;
    int8_t* o0 = qi8 + ((int64_t)bh * sq_pad + r0) * D;
    int8_t* o1 = qi8 + ((int64_t)bh * sq_pad + r1) * D;
#pragma unroll
    for (int i = 0; i < CPL; ++i) {
        const int c = (t + 4 * i) * 8;
        uint32_t w0[2], w1[2];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            uint32_t a = 0, bb = 0;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                a |= (uint32_t)(quant_i8(x0[i][4 * hh + e], sc) & 0xff) << (8 * e);
                bb |= (uint32_t)(quant_i8(x1[i][4 * hh + e], sc) & 0xff) << (8 * e);
            }
            w0[hh] = a; w1[hh] = bb;
        }
        *reinterpret_cast<uint2*>(o0 + c) = make_uint2(w0[0], w0[1]);
        *reinterpret_cast<uint2*>(o1 + c) = make_uint2(w1[0], w1[1]);
    }
}

// 2b. K - mean(K) -> INT8, groups Grouping(64, 8, 2): in each 64-key block keys with equal (c % 8) / 2 share a scale.
template <int D, typename T>
__global__ void __launch_bounds__(kThreads) quant_k_kernel(SageAttnParams p, const float* kpart, int nsplit,
                                                           int8_t* ki8, float* kscale, int skv_pad) {
    constexpr int H = D / 2, CH = H / 8;
    __shared__ float smean[D];
    __shared__ float rowmax[kBK];
    const int kb = blockIdx.x, bh = blockIdx.y, b = bh / p.Hkv, h = bh % p.Hkv;
    if (threadIdx.x < D) {
        float s = 0.f;
        for (int j = 0; j < nsplit; ++j) s += kpart[((int64_t)bh * nsplit + j) * D + threadIdx.x];
        smean[threadIdx.x] = s / (float)p.Skv;
    }
    __syncthreads();
    const int c = threadIdx.x >> 1, hh = threadIdx.x & 1;
    const int key = kb * kBK + c;
    const T* src = static_cast<const T*>(p.k) + b * p.k_sb + h * p.k_sh + (int64_t)key * p.k_ss + hh * H;
    float x[CH][8];
    float am = 0.f;
#pragma unroll
    for (int j = 0; j < CH; ++j) {
        if (key < p.Skv) {
            Vec8<T>::load(src + 8 * j, x[j]);
#pragma unroll
            for (int e = 0; e < 8; ++e) x[j][e] -= smean[hh * H + 8 * j + e];
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) x[j][e] = 0.f;
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) am = fmaxf(am, fabsf(x[j][e]));
    }
    am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, 1));
    if (hh == 0) rowmax[c] = am;
    __syncthreads();
    const int grp = (c & 7) >> 1;
    float gm = 0.f;
#pragma unroll
    for (int a = 0; a < 8; ++a) gm = fmaxf(gm, fmaxf(rowmax[8 * a + 2 * grp], rowmax[8 * a + 2 * grp + 1]));
    const float sc = gm / 127.f;
    if (hh == 0 && c < 8 && (c & 1) == 0) kscale[((int64_t)bh * (skv_pad / kBK) + kb) * 4 + grp] = sc;
    int8_t* dst = ki8 + ((int64_t)bh * skv_pad + key) * D + hh * H;
#pragma unroll
    for (int j = 0; j < CH; ++j) {
        uint32_t w[2];
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            uint32_t a = 0;
#pragma unroll
            for (int e = 0; e < 4; ++e) a |= (uint32_t)(quant_i8(x[j][4 * q + e], sc) & 0xff) << (8 * e);
            w[q] = a;
        }
        *reinterpret_cast<uint2*>(dst + 8 * j) = make_uint2(w[0], w[1]);
    }
}

// 2c. V -> FP8 E4M3 per channel (scale amax/448), transposed to [d][key slot] per 64-key block, with the keys of
// each 32-key half permuted so that the m16n8k32 accumulator fragment of S is directly the A fragment of P~:
// slot s (0..31) holds key 16*(s/16) + 8*((s%4)/2) + 2*((s%16)/4) + (s%2).
// FP16 variant (PV_FP16): V as fp16, transposed, natural key order (m16n8k16 fragments match the S layout).
template <int D, typename T, bool PV_FP16>
__global__ void __launch_bounds__(kThreads) quant_v_kernel(SageAttnParams p, const float* vpart, int nsplit,
                                                           uint8_t* vt, float* vscale, int skv_pad) {
    __shared__ float tile[kBK][D + 1];
    __shared__ float sscale[D];
    const int kb = blockIdx.x, bh = blockIdx.y, b = bh / p.Hkv, h = bh % p.Hkv;
    if (!PV_FP16 && threadIdx.x < D) {
        float m = 0.f;
        for (int j = 0; j < nsplit; ++j) m = fmaxf(m, vpart[((int64_t)bh * nsplit + j) * D + threadIdx.x]);
        const float sc = m / kFp8Max;
        sscale[threadIdx.x] = sc;
        if (kb == 0) vscale[(int64_t)bh * D + threadIdx.x] = sc;
    }
    const T* src = static_cast<const T*>(p.v) + b * p.v_sb + h * p.v_sh;
    for (int i = threadIdx.x; i < kBK * (D / 8); i += kThreads) {
        const int r = i / (D / 8), c = i % (D / 8);
        const int key = kb * kBK + r;
        float x[8];
        if (key < p.Skv) Vec8<T>::load(src + (int64_t)key * p.v_ss + c * 8, x);
        else {
#pragma unroll
            for (int e = 0; e < 8; ++e) x[e] = 0.f;
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) tile[r][c * 8 + e] = x[e];
    }
    __syncthreads();
    if constexpr (!PV_FP16) {
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
#pragma unroll
            for (int i = 0; i < 4; ++i)
                w[i] = pack2<__half>(tile[grp * 8 + 2 * i][d], tile[grp * 8 + 2 * i + 1][d]);
            *reinterpret_cast<uint4*>(vt + (((int64_t)bh * D + d) * skv_pad + kb * kBK + grp * 8) * 2) =
                make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
}

// ----------------------------------------------------------------------------------------------
// 3. attention. CTA = 4 warps x 16 query rows; KV blocks of 64 keys, double-buffered with cp.async.
template <int D, bool PV_FP16>
struct AttnSmem {
    static constexpr int KSTR = D + 16;                       // bytes per K row (int8) + pad
    static constexpr int VROWB = PV_FP16 ? kBK * 2 : kBK;     // bytes per V^T row
    static constexpr int VSTR = VROWB + 16;
    static constexpr int KBYTES = kBK * KSTR, VBYTES = D * VSTR;
    static constexpr int TOTAL = 2 * (KBYTES + VBYTES);
};

template <int D, bool PV_FP16, typename T>
__device__ __forceinline__ void attn_body(const SageAttnParams& p, const int8_t* qi8, const float* qscale,
                                          const int8_t* ki8, const float* kscale, const uint8_t* vt,
                                          const float* vscale, int sq_pad, int skv_pad) {
    using S = AttnSmem<D, PV_FP16>;
    extern __shared__ __align__(128) uint8_t smem[];
    uint8_t* sK = smem;
    uint8_t* sV = smem + 2 * S::KBYTES;

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int qb = gridDim.x - 1 - blockIdx.x;  // heaviest (causal) blocks first
    const int h = blockIdx.y, b = blockIdx.z;
    const int hk = h / (p.Hq / p.Hkv);
    const int q0 = qb * kBQ;
    const int64_t bhq = (int64_t)b * p.Hq + h, bhk = (int64_t)b * p.Hkv + hk;

    // Q fragments (A operand, row-major 16 x 32 per k-step) straight from global memory
    uint32_t qf[D / 32][4];
    {
        const int8_t* Qp = qi8 + (bhq * sq_pad + q0 + warp * 16) * D;
#pragma unroll
        for (int c = 0; c < D / 32; ++c) {
            qf[c][0] = *reinterpret_cast<const uint32_t*>(Qp + g * D + 32 * c + 4 * t);
            qf[c][1] = *reinterpret_cast<const uint32_t*>(Qp + (g + 8) * D + 32 * c + 4 * t);
            qf[c][2] = *reinterpret_cast<const uint32_t*>(Qp + g * D + 32 * c + 16 + 4 * t);
            qf[c][3] = *reinterpret_cast<const uint32_t*>(Qp + (g + 8) * D + 32 * c + 16 + 4 * t);
        }
    }
    const float qs = qscale[(bhq * (sq_pad / 16) + q0 / 16 + warp) * 8 + g] * p.sm_scale * kLog2e;

    const int diag = p.Skv - p.Sq;  // key j visible to row i iff j <= i + diag
    int kv_end = p.Skv;
    if (p.causal) kv_end = min(kv_end, q0 + kBQ + diag);
    const int nkb = kv_end > 0 ? (kv_end + kBK - 1) / kBK : 0;
    const int row0 = q0 + warp * 16 + g, row1 = row0 + 8;
    const uint8_t* mrow = p.kmask ? p.kmask + (int64_t)b * p.kmask_sb : nullptr;

    float o[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;

    const uint8_t* Kg = reinterpret_cast<const uint8_t*>(ki8) + bhk * skv_pad * D;
    constexpr int VEL = PV_FP16 ? 2 : 1;
    const uint8_t* Vg = vt + bhk * D * (int64_t)skv_pad * VEL;
    const float* ksc = kscale + bhk * (skv_pad / kBK) * 4;

    auto load_tile = [&](int kb, int buf) {
        uint8_t* dK = sK + buf * S::KBYTES;
        uint8_t* dV = sV + buf * S::VBYTES;
#pragma unroll
        for (int it = 0; it < kBK * D / 16 / kThreads; ++it) {
            const int i = tid + it * kThreads;
            const int r = i / (D / 16), c = i % (D / 16);
            cp_async16(dK + r * S::KSTR + c * 16, Kg + (int64_t)(kb * kBK + r) * D + c * 16);
        }
#pragma unroll
        for (int it = 0; it < D * S::VROWB / 16 / kThreads; ++it) {
            const int i = tid + it * kThreads;
            const int r = i / (S::VROWB / 16), c = i % (S::VROWB / 16);
            cp_async16(dV + r * S::VSTR + c * 16, Vg + (int64_t)r * skv_pad * VEL + (int64_t)kb * S::VROWB + c * 16);
        }
    };

    if (nkb > 0) { load_tile(0, 0); cp_async_commit(); }
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

        // S = Q K^T (int32)
        int acc[8][4];
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0;
#pragma unroll
        for (int c = 0; c < D / 32; ++c) {
#pragma unroll
            for (int np = 0; np < 4; ++np) {
                uint32_t b0, b1, b2, b3;
                ldsm_x4(cK + (np * 16 + lrow) * S::KSTR + c * 32 + lbyte, b0, b1, b2, b3);
                mma_s8(acc[2 * np], qf[c], b0, b1);
                mma_s8(acc[2 * np + 1], qf[c], b2, b3);
            }
        }
        // dequantize (one Q scale and one K scale per thread), log2 domain
        const float sc = qs * ksc[kb * 4 + t];
        float s[8][4];
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[j][e] = (float)acc[j][e] * sc;

        const int kbase = kb * kBK;
        const bool need_mask = (kbase + kBK > p.Skv) || (mrow != nullptr) || (p.causal && kbase + kBK - 1 > q0 + diag);
        if (need_mask) {
#pragma unroll
            for (int j = 0; j < 8; ++j) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int key = kbase + 8 * j + 2 * t + e;
                    bool ok = key < p.Skv;
                    if (ok && mrow) ok = mrow[key] != 0;
                    const bool ok0 = ok && (!p.causal || key <= row0 + diag);
                    const bool ok1 = ok && (!p.causal || key <= row1 + diag);
                    if (!ok0) s[j][e] = -INFINITY;
                    if (!ok1) s[j][2 + e] = -INFINITY;
                }
            }
        }
        // online softmax
        float mx0 = m0, mx1 = m1;
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
        const float al0 = exp2f(m0 - mu0), al1 = exp2f(m1 - mu1);
        m0 = mx0; m1 = mx1;
        float rs0 = 0.f, rs1 = 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            s[j][0] = exp2f(s[j][0] - mu0); s[j][1] = exp2f(s[j][1] - mu0);
            s[j][2] = exp2f(s[j][2] - mu1); s[j][3] = exp2f(s[j][3] - mu1);
            rs0 += s[j][0] + s[j][1];
            rs1 += s[j][2] + s[j][3];
        }
        l0 = l0 * al0 + rs0;
        l1 = l1 * al1 + rs1;

        if constexpr (!PV_FP16) {
            // P~ * 448 -> FP8 E4M3; fragment slots follow the permuted key order of V^T (see quant_v_kernel)
            uint32_t pa[2][4];
#pragma unroll
            for (int kk = 0; kk < 2; ++kk) {
                const int j = 4 * kk;
                pa[kk][0] = cvt_e4m3x2(s[j][0] * kFp8Max, s[j][1] * kFp8Max) |
                            (cvt_e4m3x2(s[j + 1][0] * kFp8Max, s[j + 1][1] * kFp8Max) << 16);
                pa[kk][1] = cvt_e4m3x2(s[j][2] * kFp8Max, s[j][3] * kFp8Max) |
                            (cvt_e4m3x2(s[j + 1][2] * kFp8Max, s[j + 1][3] * kFp8Max) << 16);
                pa[kk][2] = cvt_e4m3x2(s[j + 2][0] * kFp8Max, s[j + 2][1] * kFp8Max) |
                            (cvt_e4m3x2(s[j + 3][0] * kFp8Max, s[j + 3][1] * kFp8Max) << 16);
                pa[kk][3] = cvt_e4m3x2(s[j + 2][2] * kFp8Max, s[j + 2][3] * kFp8Max) |
                            (cvt_e4m3x2(s[j + 3][2] * kFp8Max, s[j + 3][3] * kFp8Max) << 16);
            }
            // two-level accumulation: each block's P~V in its own fp32 accumulator, then O = O*alpha + block
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                float tmp[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
                for (int kk = 0; kk < 2; ++kk) {
                    uint32_t b0, b1, b2, b3;
                    ldsm_x4(cV + (dp * 16 + lrow) * S::VSTR + kk * 32 + lbyte, b0, b1, b2, b3);
                    mma_e4m3(tmp[0], pa[kk], b0, b1);
                    mma_e4m3(tmp[1], pa[kk], b2, b3);
                }
#pragma unroll
                for (int n = 0; n < 2; ++n) {
                    float* oo = o[2 * dp + n];
                    oo[0] = oo[0] * al0 + tmp[n][0];
                    oo[1] = oo[1] * al0 + tmp[n][1];
                    oo[2] = oo[2] * al1 + tmp[n][2];
                    oo[3] = oo[3] * al1 + tmp[n][3];
                }
            }
        } else {
            uint32_t pa[4][4];
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                pa[kk][0] = pack2<__half>(s[2 * kk][0], s[2 * kk][1]);
                pa[kk][1] = pack2<__half>(s[2 * kk][2], s[2 * kk][3]);
                pa[kk][2] = pack2<__half>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
                pa[kk][3] = pack2<__half>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
            }
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                float tmp[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
                for (int kk = 0; kk < 4; ++kk) {
                    uint32_t b0, b1, b2, b3;
                    ldsm_x4(cV + (dp * 16 + lrow) * S::VSTR + kk * 32 + lbyte, b0, b1, b2, b3);
                    mma_f16(tmp[0], pa[kk], b0, b1);
                    mma_f16(tmp[1], pa[kk], b2, b3);
                }
#pragma unroll
                for (int n = 0; n < 2; ++n) {
                    float* oo = o[2 * dp + n];
                    oo[0] = oo[0] * al0 + tmp[n][0];
                    oo[1] = oo[1] * al0 + tmp[n][1];
                    oo[2] = oo[2] * al1 + tmp[n][2];
                    oo[3] = oo[3] * al1 + tmp[n][3];
                }
            }
        }
        __syncthreads();  // this buffer is refilled two iterations later
    }

    // epilogue
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float inv0 = l0 > 0.f ? 1.f / l0 : 0.f;
    const float inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
    T* O = static_cast<T*>(p.o) + b * p.o_sb + h * p.o_sh;
    const float* vsc = vscale + bhk * D;
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
        const int col = nt * 8 + 2 * t;
        float v0 = 1.f, v1 = 1.f;
        if constexpr (!PV_FP16) {
            v0 = vsc[col] * (1.f / kFp8Max);
            v1 = vsc[col + 1] * (1.f / kFp8Max);
        }
        if (row0 < p.Sq)
            *reinterpret_cast<uint32_t*>(O + (int64_t)row0 * p.o_ss + col) =
                pack2<T>(o[nt][0] * inv0 * v0, o[nt][1] * inv0 * v1);
        if (row1 < p.Sq)
            *reinterpret_cast<uint32_t*>(O + (int64_t)row1 * p.o_ss + col) =
                pack2<T>(o[nt][2] * inv1 * v0, o[nt][3] * inv1 * v1);
    }
    if (p.lse && t == 0) {
        float* L = p.lse + bhq * p.Sq;
        if (row0 < p.Sq) L[row0] = l0 > 0.f ? m0 * kLn2 + logf(l0) : -INFINITY;
        if (row1 < p.Sq) L[row1] = l1 > 0.f ? m1 * kLn2 + logf(l1) : -INFINITY;
    }
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
constexpr bool kArchHasFp8 = false;
#else
constexpr bool kArchHasFp8 = true;
#endif

template <int D, bool PV_FP16, typename T>
__global__ void __launch_bounds__(kThreads) attn_kernel(SageAttnParams p, const int8_t* qi8, const float* qscale,
                                                        const int8_t* ki8, const float* kscale, const uint8_t* vt,
                                                        const float* vscale, int sq_pad, int skv_pad) {
    if constexpr (PV_FP16 || kArchHasFp8) {
        attn_body<D, PV_FP16, T>(p, qi8, qscale, ki8, kscale, vt, vscale, sq_pad, skv_pad);
    }
    // FP8 P~V below sm_89: never launched (the host checks device_cc >= 89)
}

// ----------------------------------------------------------------------------------------------
template <typename Kern>
cudaError_t set_smem(Kern kern, int bytes, int device) {
    // the dynamic shared-memory opt-in is per function and device; done once each
    static bool done[64] = {};
    if (bytes <= 48 * 1024) return cudaSuccess;
    if (device >= 0 && device < 64 && done[device]) return cudaSuccess;
    cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (e == cudaSuccess && device >= 0 && device < 64) done[device] = true;
    return e;
}

template <int D, typename T, bool PV_FP16>
int launch_all(const SageAttnParams& p, cudaStream_t st) {
    const Layout L = make_layout(p);
    uint8_t* ws = static_cast<uint8_t*>(p.workspace);
    int8_t* qi8 = reinterpret_cast<int8_t*>(ws + L.qi8);
    float* qscale = reinterpret_cast<float*>(ws + L.qscale);
    int8_t* ki8 = reinterpret_cast<int8_t*>(ws + L.ki8);
    float* kscale = reinterpret_cast<float*>(ws + L.kscale);
    float* kpart = reinterpret_cast<float*>(ws + L.kpart);
    uint8_t* vt = ws + L.vt;
    float* vscale = reinterpret_cast<float*>(ws + L.vscale);
    float* vpart = reinterpret_cast<float*>(ws + L.vpart);
    const int ns = (int)L.nsplit, sqp = (int)L.sq_pad, skp = (int)L.skv_pad;
    const int bhq = p.B * p.Hq, bhk = p.B * p.Hkv;

    stats_kernel<D, T><<<dim3(ns, bhk, PV_FP16 ? 1 : 2), kThreads, 0, st>>>(p, kpart, vpart, ns);
    quant_q_kernel<D, T><<<dim3(sqp / kBQ, bhq), kThreads, 0, st>>>(p, qi8, qscale, sqp);
    quant_k_kernel<D, T><<<dim3(skp / kBK, bhk), kThreads, 0, st>>>(p, kpart, ns, ki8, kscale, skp);
    quant_v_kernel<D, T, PV_FP16><<<dim3(skp / kBK, bhk), kThreads, 0, st>>>(p, vpart, ns, vt, vscale, skp);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return (int)e;

    const int dev = p.device;
    constexpr int smem = AttnSmem<D, PV_FP16>::TOTAL;
    auto kern = attn_kernel<D, PV_FP16, T>;
    e = set_smem(kern, smem, dev);
    if (e != cudaSuccess) return (int)e;
    kern<<<dim3(sqp / kBQ, p.Hq, p.B), kThreads, smem, st>>>(p, qi8, qscale, ki8, kscale, vt, vscale, sqp, skp);
    return (int)cudaGetLastError();
}

template <int D, typename T>
int dispatch_pv(const SageAttnParams& p, cudaStream_t st) {
    if (p.pv_fp16) return launch_all<D, T, true>(p, st);
    return launch_all<D, T, false>(p, st);
}

template <typename T>
int dispatch_d(const SageAttnParams& p, cudaStream_t st) {
    if (p.D == 64) return dispatch_pv<64, T>(p, st);
    if (p.D == 128) return dispatch_pv<128, T>(p, st);
    return SAGE_E_HEADDIM;
}

}  // namespace

extern "C" {

int64_t sage_attn_workspace_bytes(const SageAttnParams* p) {
    if (!p) return -1;
    return make_layout(*p).total;
}

int sage_attn_fwd(const SageAttnParams* p, void* stream) {
    if (!p || !p->q || !p->k || !p->v || !p->o || !p->workspace) return SAGE_E_BADARG;
    if (p->B <= 0 || p->Hq <= 0 || p->Hkv <= 0 || p->Sq <= 0 || p->Skv <= 0 || p->Hq % p->Hkv != 0) return SAGE_E_BADARG;
    if (p->device_cc < 80 || (!p->pv_fp16 && p->device_cc < 89)) return SAGE_E_ARCH;
    cudaStream_t st = static_cast<cudaStream_t>(stream);
    // our (static) runtime keeps its own current device: follow the caller's
    int cur = -1;
    if (cudaGetDevice(&cur) != cudaSuccess || cur != p->device) {
        cudaError_t e = cudaSetDevice(p->device);
        if (e != cudaSuccess) return (int)e;
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

const char* sage_compiled_archs(void) { return SAGE_ARCHS; }

}  // extern "C"

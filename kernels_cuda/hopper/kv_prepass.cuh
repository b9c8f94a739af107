// Hopper path: the pre-passes. Sampled K/V statistics (means, V's base scale) and the K/V quantization pass that
// writes K - mean -> INT8 and V - mean -> FP8 in the exact shared-memory image of one 128-key block.
#pragma once
#include "traits.cuh"
#include "wgmma.cuh"
#include "../common/quant.cuh"
#include "../common/ptx.cuh"

namespace sage::hopper {

// ------------------------------------------------------------------------------------------------------------------
// Pre-pass: one CTA per (128-key block, kv-head, batch) and channel slice: at D = 256 a cluster of two CTAs, each
// with 128 of the channels (kv_split), which exchange their K group maxima and V saturation flags through
// distributed shared memory (one CTA of 1024 threads per SM ran its load, math and store phases in lockstep on
// every SM, the memory idle between them: B=4 H=16 N=4K, 150 us for 400 MB; D = 128's two CTAs per SM overlap them).
// Each thread owns 4 keys and 8 channels of its CTA's DC = D / kv_split channels: owner o = tid / (DC/8)
// (0..31) holds the keys of V^T slots 4o..4o+3 (kv_key), so per channel its 4 e4m3 bytes are one 32-bit word of the
// V^T image (one shared store per channel instead of 4 byte stores and their shifts), and its 4 keys are in one K
// scale group (Grouping(128, 8, 2): group (key % 8) / 2 = o % 4, one running max). A key row's slice is read by
// DC/8 adjacent lanes, 16 bytes each, so every warp load covers whole slices (256 or 128 contiguous bytes per row).
__host__ __device__ constexpr int kv_split(int D) { return D > 128 ? 2 : 1; }  // CTAs (a cluster) per block
__host__ __device__ constexpr int kv_dc(int D) { return D / kv_split(D); }     // channels per CTA
__host__ __device__ constexpr int kv_threads(int D) { return 4 * kv_dc(D); }  // 32 owners x DC / 8 lanes
// 64 registers per thread: 2 CTAs per SM at D = 128 and 256, 4 at D = 64
__host__ __device__ constexpr int kv_ctas(int D) { return 1024 / kv_threads(D); }
// block-local key of owner o's load i: V^T slot 4o + i (slot_of_key: slot bits 0, 1, 2-3, 4 = key bits 0, 3, 1-2, 4)
__host__ __device__ constexpr int kv_key(int o, int i) {
    return 32 * (o >> 3) + 16 * ((o >> 2) & 1) + 2 * (o & 3) + (i & 1) + 8 * (i >> 1);
}
__host__ __device__ constexpr bool kv_keys_ok() {  // (checked at compile time)
    for (int o = 0; o < 32; ++o)
        for (int i = 0; i < 4; ++i) {
            const int k = kv_key(o, i);
            if ((k & ~31) + slot_of_key(k & 31) != 4 * o + i) return false;
        }
    return true;
}
static_assert(kv_keys_ok(), "owner o's keys are V^T slots 4o..4o+3");
// V's quantized value before the e4m3 rounding: one FFMA, v (1 / scale) + (-mean / scale) with the shift precomputed
__device__ __forceinline__ float kv_vq(float v, float inv, float shift) { return fmaf(v, inv, shift); }
// 8 raw values (16 bytes) -> floats; bf16 by shifts (exact, as __bfloat1622float2, but without the temporaries that
// made the bf16 pre-pass spill at 64 registers)
template <typename T> __device__ __forceinline__ void raw8_to_float(const uint4& u, float (&x)[8]) {
    if constexpr (std::is_same<T, __nv_bfloat16>::value) {
        const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            x[2 * i] = __uint_as_float(w[i] << 16);
            x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
        }
    } else {
        Vec8<T>::load(reinterpret_cast<const T*>(&u), x);
    }
}
// 2 raw values (one 32-bit word) -> floats
template <typename T> __device__ __forceinline__ float2 raw2_to_float(uint32_t w) {
    if constexpr (std::is_same<T, __nv_bfloat16>::value) {
        return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
    } else {
        return __half22float2(*reinterpret_cast<const __half2*>(&w));
    }
}
// ------------------------------------------------------------------------------------------------------------------
// Statistics from a sample, the Hopper path's only reduction over a whole head (it replaced a full stats pass that
// read K and V once more: 15% of a 1K call). Exact means are not needed: any per-channel shift of K leaves the
// softmax unchanged (q . mu is constant along a row; the LSE adds it back) and any mean subtracted from V is added
// back exactly, so sampled means cost accuracy only through weaker smoothing. The V scale is a per-channel base
// (kVHeadroom x the sample's max |V - mean|, floored) times a power of two per 128-key block (vfac, chosen by the
// K/V pass from the block's own values), so no value saturates whatever the sample missed.
// Sample: ns = min(kSample, skv) tokens t_i = floor(i skv / ns). One CTA per (b, kv-head); the reference
// simulates it (SimConfig.stats_sample).
constexpr int kSample = 128;
constexpr float kVHeadroom = 8.f;        // base = headroom x sample max: blocks beyond it get vfac > 1
constexpr float kVRelFloor = 1.f / 1024.f;  // a channel's base >= this x the largest channel's (bounds vfac)
constexpr float kVAbsFloor = 1e-20f;
constexpr int kVMaxExp = 64;             // vfac <= 2^64 (larger values saturate: |V| > ~1e3 x 2^64 x base)
constexpr int kStatThreads = 256;
template <int D, typename T>
__global__ void __launch_bounds__(kStatThreads) hopper_sample_stats_kernel(SageAttnParams p, float* kmean,
                                                                              float* vscale, float* vmean, int* zero,
                                                                              int nzero) {
    pdl_launch_dependents();
    constexpr int LPK = D / 8, RPP = kStatThreads / LPK;  // lanes per row (8 channels each), rows per pass
    __shared__ float red[4][RPP][D];  // per row slot: K sum, V sum, V max, V min
    __shared__ float wmx[D / 32];
    const int bh = blockIdx.x, b = bh / p.Hkv, h = bh % p.Hkv;
    if (zero && bh == 0)  // the attention kernel's tile and split counters, reset in stream order
        for (int i = threadIdx.x; i < nzero; i += kStatThreads) zero[i] = 0;
    const int skv = len_k(p, b), ns = min(skv, kSample);
    const int cc = threadIdx.x % LPK, rr = threadIdx.x / LPK;
    const T* kb = static_cast<const T*>(p.k) + b * p.k_sb + h * p.k_sh + tok0_k(p, b) * p.k_ss + 8 * cc;
    const T* vb = static_cast<const T*>(p.v) + b * p.v_sb + h * p.v_sh + tok0_k(p, b) * p.v_ss + 8 * cc;
    float ks[8], vs[8], vmx[8], vmn[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) { ks[e] = 0.f; vs[e] = 0.f; vmx[e] = -INFINITY; vmn[e] = INFINITY; }
    constexpr int NI = kSample / RPP;
    uint4 kr[NI], vr[NI];
#pragma unroll
    for (int i = 0; i < NI; ++i) {  // all loads in flight first
        const int j = rr + RPP * i;
        const int64_t t = j < ns ? (int64_t)j * skv / ns : 0;
        kr[i] = j < ns ? *reinterpret_cast<const uint4*>(kb + t * p.k_ss) : make_uint4(0u, 0u, 0u, 0u);
        vr[i] = j < ns ? *reinterpret_cast<const uint4*>(vb + t * p.v_ss) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int i = 0; i < NI; ++i) {
        if (rr + RPP * i >= ns) break;
        float x[8], y[8];
        raw8_to_float<T>(kr[i], x);
        raw8_to_float<T>(vr[i], y);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            ks[e] += x[e]; vs[e] += y[e]; vmx[e] = fmax_nan(vmx[e], y[e]); vmn[e] = fmin_nan(vmn[e], y[e]);
        }
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        red[0][rr][8 * cc + e] = ks[e]; red[1][rr][8 * cc + e] = vs[e];
        red[2][rr][8 * cc + e] = vmx[e]; red[3][rr][8 * cc + e] = vmn[e];
    }
    __syncthreads();
    if (threadIdx.x >= D) return;
    const int d = threadIdx.x;
    float sk = 0.f, sv = 0.f, mx = -INFINITY, mn = INFINITY;
    for (int j = 0; j < RPP; ++j) {
        sk += red[0][j][d]; sv += red[1][j][d]; mx = fmax_nan(mx, red[2][j][d]); mn = fmin_nan(mn, red[3][j][d]);
    }
    const float km = ns > 0 ? sk / (float)ns : 0.f;
    const float vm = ns > 0 && p.smooth_v ? sv / (float)ns : 0.f;
    // max |V - vm| over the sample, exactly (rounding is monotone); 0 for an empty sequence
    const float a = ns > 0 ? fmax_nan(0.f, fmax_nan(mx - vm, vm - mn)) : 0.f;
    float am = a;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) am = fmax_nan(am, __shfl_xor_sync(0xffffffffu, am, o));
    if ((d & 31) == 0) wmx[d >> 5] = am;
    asm volatile("bar.sync 1, %0;\n" ::"n"(D) : "memory");  // the D threads still running
    am = wmx[0];
#pragma unroll
    for (int w = 1; w < D / 32; ++w) am = fmax_nan(am, wmx[w]);
    // a non-finite sampled value: NaN base (every V value of the head then quantizes to NaN, see hopper_quant_kv_kernel)
    const float base = finite_or_nan(fmax_nan(fmax_nan(kVHeadroom * a, kVHeadroom * am * kVRelFloor),
                                              kVAbsFloor)) / kFp8Max;
    kmean[(int64_t)bh * D + d] = km;
    vmean[(int64_t)bh * D + d] = vm;
    vscale[(int64_t)bh * D + d] = base;
}

// ---- the K/V pass's pieces (small functor structs bound to the kernel's registers and shared memory)

// offset of the owner's key i (keys c0 + {0, 1, 8, 9}) in elements, from the token stride
struct KvKeyOff {
    __device__ __forceinline__ int64_t operator()(int i, int64_t ss) const { return (i & 1 ? ss : 0) + (i >> 1 ? 8 * ss : 0); }
};
// quantity q (0 K mean, 1 1 / V scale, 2 V shift) of the lane's 8 channels, from the staged float4 table
template <int LPK>
struct KvChan {
    const float4 (&skc)[3][2][LPK];
    const int& cc;
    __device__ __forceinline__ void operator()(int q, float (&x)[8]) const {
        const float4 a = skc[q][0][cc], bq = skc[q][1][cc];
        x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w; x[4] = bq.x; x[5] = bq.y; x[6] = bq.z; x[7] = bq.w;
    }
};
// whether the owner's key i is inside the sequence (partial blocks), or always (full blocks)
struct KvValid {
    const int& kbase;
    const int& o;
    const int& skv;
    __device__ __forceinline__ bool operator()(int i) const { return kbase + kv_key(o, i) < skv; }
};
struct KvAlways {
    __device__ __forceinline__ bool operator()(int) const { return true; }
};
// byte offset of the owner's word of channel d0 + e in the V^T image
struct KvVaddr {
    const int (&vaddr)[2];
    __device__ __forceinline__ int operator()(int e) const { return vaddr[e & 1] + (e >> 1) * 8 * kBN; }
};
// V: e4m3 bytes of (V - mean) / (base vmul^-1) of the owner's 4 keys into the V^T image (raw(i): the owner's 16 bytes
// of key i; ok(i): key i inside the sequence); returns nonzero if a byte is +-448 or NaN (possibly saturated)
template <int D, typename T>
struct KvQuantV {
    const KvChan<kv_dc(D) / 8>& chan;
    uint8_t (&vt)[kv_dc(D) * kBN];
    const KvVaddr& vaddr_of;
    const int& rot;
    template <typename Raw, typename Ok>
    __device__ __forceinline__ uint32_t operator()(Raw raw, float vmul, Ok ok) const {
        uint32_t sat = 0u;
        float vi[8], vs[8];
        chan(1, vi);
        chan(2, vs);
        uint4 u[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) u[i] = raw(i);  // (each reload is one load)
#pragma unroll
        for (int pp = 0; pp < 4; ++pp) {  // channels d0 + 2 pp, + 1
            float2 y[4];
#pragma unroll
            for (int i = 0; i < 4; ++i)
                y[i] = raw2_to_float<T>(pp == 0 ? u[i].x : pp == 1 ? u[i].y : pp == 2 ? u[i].z : u[i].w);
            uint32_t wd[2];
#pragma unroll
            for (int s = 0; s < 2; ++s) {
                const int e = 2 * pp + s;
                const float m = vi[e] * vmul, a = vs[e] * vmul;  // exact: vmul = 2^-k
                float z[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float x = s ? y[i].y : y[i].x;
                    z[i] = ok(i) ? kv_vq(x, m, a) : 0.f;
                }
                wd[s] = cvt_e4m3x4(z[0], z[1], z[2], z[3]);
                // a byte's magnitude bits >= 0x7e (448, or NaN): + 2 sets its bit 7 (no carry into the next byte)
                sat |= ((wd[s] & 0x7f7f7f7fu) + 0x02020202u) & 0x80808080u;
            }
            *reinterpret_cast<uint32_t*>(vt + vaddr_of(2 * pp)) = rot ? wd[1] : wd[0];
            *reinterpret_cast<uint32_t*>(vt + vaddr_of(2 * pp + 1)) = rot ? wd[0] : wd[1];
        }
        return sat;
    }
};
// the owner's raw V of key i: from the first load's registers, or reloaded (from L2)
struct KvFirst {
    const uint4 (&vraw)[4];
    __device__ __forceinline__ uint4 operator()(int i) const { return vraw[i]; }
};
template <typename T>
struct KvReload {
    const KvValid& valid;
    const T* const& vsrc;
    const KvKeyOff& key_off;
    const SageAttnParams& p;
    __device__ __forceinline__ uint4 operator()(int i) const {
        return valid(i) ? *reinterpret_cast<const uint4*>(vsrc + key_off(i, p.v_ss)) : make_uint4(0u, 0u, 0u, 0u);
    }
};
// K - mean of the owner's keys kept in registers (padded keys: 0, they load as 0 and |0 - mean| must not count) and
// its running |max|
template <int D, typename T>
struct KvKdiff {
    const KvChan<kv_dc(D) / 8>& chan;
    const uint4 (&kraw)[4];
    float (&kd)[4][8];
    float& am;
    template <typename Ok>
    __device__ __forceinline__ void operator()(Ok ok) const {
        float m[8];
        chan(0, m);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float x[8];
            raw8_to_float<T>(kraw[i], x);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                kd[i][e] = ok(i) ? x[e] - m[e] : 0.f;
                am = fmax_nan(am, fabsf(kd[i][e]));
            }
        }
    }
};

// The V factor of a block holding a value beyond the sampled range (any byte of the first pass saturated):
// vfac = 2^e, the least e >= 0 with max |V - mean| / base <= 448 vfac (e <= kVMaxExp), written to *vfac, and
// its inverse to gscale[8] for the requantization. A non-finite value in the block (NaN, or Inf, which the first pass
// saturated to 448: both flag the block) makes the maximum NaN: the block is requantized with a NaN factor, so its V^T
// image is NaN and so are P~V and O of every row that runs the block (vfac itself stays a power of two: the attention
// kernel divides by it with integer arithmetic on the exponent). reload(i): the owner's raw V of key i, from L2.
// SPLIT > 1 (a cluster of channel slices, kv_split): the maximum over the slices through xr (this CTA's slot),
// half: this CTA's slice; the caller has arrived at the cluster barrier after the exchange of the group maxima.
template <int NT, int SPLIT, typename T, typename Chan>
__device__ __forceinline__ void kv_block_vfac(const KvReload<T>& reload, const KvValid& valid,
                                                  const Chan& chan, float* omax, float* gscale, float* vfac,
                                                  float* xr, int half) {
    float r = 0.f;
    {
        float vi[8], vs[8];
        chan(1, vi);
        chan(2, vs);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float y[8];
            raw8_to_float<T>(reload(i), y);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const float z = kv_vq(y[e], vi[e], vs[e]);
                r = valid(i) ? fmax_nan(r, fabsf(z)) : r;
            }
        }
    }
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) r = fmax_nan(r, __shfl_xor_sync(0xffffffffu, r, s));
    // (the caller last read omax before a barrier)
    if ((threadIdx.x & 31) == 0) omax[threadIdx.x >> 5] = r;
    __syncthreads();
    if (threadIdx.x == 0) {
        r = 0.f;
#pragma unroll
        for (int w = 0; w < NT / 32; ++w) r = fmax_nan(r, omax[w]);
        if constexpr (SPLIT > 1) *xr = r;
    }
    if constexpr (SPLIT > 1) {  // (the saturation flag that brought this CTA here is the cluster's: all CTAs are here)
        cluster_wait();
        cluster_arrive();
        cluster_wait();  // every slice's maximum written
        if (threadIdx.x == 0) r = fmax_nan(r, ld_cluster_f32(xr, (uint32_t)(half ^ 1)));
        cluster_arrive_relaxed();  // (waited for before the CTA exits: its xr is read until then)
    }
    if (threadIdx.x == 0) {
        r = finite_or_nan(r);
        int e = 0;
        if (r > kFp8Max) {  // (false for NaN)
            const uint32_t u = __float_as_uint(r / kFp8Max);  // >= 1
            e = min((int)(u >> 23) - 127 + ((u & 0x7fffffu) != 0u), kVMaxExp);
        }
        if (half == 0) *vfac = __uint_as_float((uint32_t)(127 + e) << 23);
        gscale[8] = r == r ? __uint_as_float((uint32_t)(127 - e) << 23) : r;  // NaN: the block's V^T image NaN
    }
    __syncthreads();
}

// K: the owner's 4 keys of K - mean (kd) as INT8 with its group's scale sc (inverse inv), 8 channels of a key = 8
// bytes of its row in the block's K image kdst
template <int D>
__device__ __forceinline__ void kv_store_k(int8_t* kdst, const float (&kd)[4][8], float sc, float inv, int o,
                                               int d0) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        uint32_t w[2];
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            uint32_t bt[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) bt[e] = quant_i8_bits(kd[i][4 * q + e], sc, inv);
            w[q] = pack_low_bytes(bt[0], bt[1], bt[2], bt[3]);
        }
        *reinterpret_cast<uint2*>(kdst + img_off(kv_key(o, i), d0, D)) = make_uint2(w[0], w[1]);
    }
}

template <int D, typename T>
__global__ void __launch_bounds__(kv_threads(D), kv_ctas(D)) hopper_quant_kv_kernel(SageAttnParams p,
        const float* kmean, const float* vscale, const float* vmean, int8_t* kimg, float* kscale, uint8_t* vimg,
        float* vfac, int* kmflag, int nkb) {
    constexpr int NT = kv_threads(D), SPLIT = kv_split(D), DC = kv_dc(D), LPK = DC / 8;  // lanes per key row slice
    static_assert(kBN == 128 && NT / LPK == 32, "32 owners of 4 keys");
    // per-channel K mean, 1 / V scale and V's shift (-mean / scale, or the mean) as float4 [quantity][half][lane
    // chunk]: a lane's 8 channels are two LDS.128 without bank conflicts
    __shared__ float4 skc[3][2][LPK];
    __shared__ float omax[32], gscale[9];
    // the cluster's exchange (SPLIT > 1): this slice's K group maxima, its saturation flag, its V maximum; the flag
    // of the whole block
    __shared__ float xch[6];
    __shared__ int any_sat_all;
    __shared__ __align__(16) uint8_t vt[DC * kBN];  // this slice's V^T rows of the block image, copied out at the end
    pdl_wait();
    pdl_launch_dependents();
    // grid (block x slice, kv-head, batch): no division for the head index; a cluster's CTAs are a block's slices
    const int kb = blockIdx.x / SPLIT, half = blockIdx.x % SPLIT, h = blockIdx.y, b = blockIdx.z;
    const int bh = b * p.Hkv + h;
    const int skv = len_k(p, b);
    if (kb > 0 && kb * kBN >= skv) return;  // varlen: past this sequence's end (never read)
    const int o = threadIdx.x / LPK, cc = threadIdx.x % LPK, d0 = 8 * cc;  // owner, its lane's 8 channels (slice)
    const int ch0 = half * DC;  // the slice's first channel
    const int kbase = kb * kBN;
    const bool full = kbase + kBN <= skv;  // CTA-uniform: no per-value validity selects
    // the owner's keys c0 + {0, 1, 8, 9}: one 64-bit address product, the others by adds
    const int c0 = kv_key(o, 0);
    const int64_t tok = tok0_k(p, b) + kbase + c0;
    const T* ksrc = static_cast<const T*>(p.k) + b * p.k_sb + h * p.k_sh + tok * p.k_ss + ch0 + d0;
    const T* vsrc = static_cast<const T*>(p.v) + b * p.v_sb + h * p.v_sh + tok * p.v_ss + ch0 + d0;
    KvKeyOff key_off{};
    uint4 kraw[4], vraw[4];  // all loads in flight before any use (raw: half the registers of floats)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        if (kbase + kv_key(o, i) < skv) {
            kraw[i] = *reinterpret_cast<const uint4*>(ksrc + key_off(i, p.k_ss));
            vraw[i] = *reinterpret_cast<const uint4*>(vsrc + key_off(i, p.v_ss));
        } else {
            kraw[i] = make_uint4(0u, 0u, 0u, 0u);
            vraw[i] = make_uint4(0u, 0u, 0u, 0u);
        }
    }
    if (threadIdx.x < DC) {  // (after the loads are issued: these are small L2 reads)
        const int d = threadIdx.x, dg = ch0 + d;
        float* kc = reinterpret_cast<float*>(skc) + ((d >> 2) & 1) * LPK * 4 + (d >> 3) * 4 + (d & 3);
        const float vi = 1.f / vscale[(int64_t)bh * D + dg];  // the sampled base scale (> 0: floored)
        const float vm = vmean[(int64_t)bh * D + dg];         // 0 without smooth V
        kc[0] = kmean[(int64_t)bh * D + dg];
        kc[2 * LPK * 4] = vi;
        kc[4 * LPK * 4] = -vm * vi;
    }
    __syncthreads();
    KvChan<LPK> chan{skc, cc};  // quantity q (0 K mean, 1 1 / V scale, 2 V shift) of the lane's channels
    KvValid valid{kbase, o, skv};
    KvAlways always{};
    // V: e4m3 bytes of (V - mean) / (base vfac) into the V^T image, first with vfac = 1 (returning nonzero if a byte
    // is +-448 or NaN: possibly saturated), again with the block's vfac if one is. Channel d's word (the owner's 4
    // keys) goes to row vcol(d), bytes 4o..4o+3. Rows vcol(8 cc + e) of a store fall on 4 of the 8 16-byte
    // bank groups; lanes with (cc / 4) odd store the odd channel of each pair first, which spreads them over 8.
    const int rot = (cc >> 2) & 1;
    // (rows of the slice: vcol only permutes channel bits 1-4, so the slice's rows are ch0.. ch0 + DC - 1)
    // img_off(row, 4o, 128) = (row * 128 | (row % 8) * 16) ^ 4o; row = vcol(d0 + c) for c = 2 pp + s is
    // (s ^ rot) | ((cc % 4) << 1) | (pp << 3) | ((cc / 4) << 5): pp only adds pp * 1024
    int vaddr[2];
#pragma unroll
    for (int s = 0; s < 2; ++s) {
        const int row = vcol(d0 + (s ^ rot));
        vaddr[s] = (row * kBN | ((row & 7) << 4)) ^ (4 * o);
    }
    KvVaddr vaddr_of{vaddr};
    KvQuantV<D, T> quant_v{chan, vt, vaddr_of, rot};
    KvFirst first{vraw};
    const uint32_t sat = full ? quant_v(first, 1.f, always) : quant_v(first, 1.f, valid);
    // K - mean kept in registers for the quantization after the group maxima
    float kd[4][8];
    float am = 0.f;
    KvKdiff<D, T> kdiff{chan, kraw, kd, am};
    if (full) kdiff(always); else kdiff(valid);
#pragma unroll
    for (int s = LPK / 2; s > 0; s >>= 1) am = fmax_nan(am, __shfl_xor_sync(0xffffffffu, am, s));
    if (cc == 0) omax[o] = am;
    // key-padding mask: one flag per (batch, block), "some key of this block is masked", so the attention kernel
    // masks (reads the mask) only in those blocks
    if (p.kmask) {
        const int masked = threadIdx.x < kBN && kbase + (int)threadIdx.x < skv &&
                           p.kmask[(int64_t)b * p.kmask_sb + kbase + threadIdx.x] == 0;
        const int any_masked = __syncthreads_or(masked);
        if (h == 0 && half == 0 && threadIdx.x == 0) kmflag[(int64_t)b * nkb + kb] = any_masked;
    }
    int any_sat = __syncthreads_or(sat != 0u);
    int sat_all = any_sat;  // (thread 4, SPLIT > 1: the cluster's flag, kept in its register: an early read of the
                            // shared copy by every thread would race with its write, compute-sanitizer racecheck)
    const int64_t blk = (int64_t)bh * nkb + kb;
    float m = 0.f;  // group g = threadIdx.x < 4: owners g, g + 4, ..., g + 28
    if (threadIdx.x < 4) {
#pragma unroll
        for (int r = 0; r < 8; ++r) m = fmax_nan(m, omax[threadIdx.x + 4 * r]);
    }
    if constexpr (SPLIT > 1) {  // the other slice's group maxima and flag (the same maxima as over all channels)
        if (threadIdx.x < 4) xch[threadIdx.x] = m;
        if (threadIdx.x == 4) xch[4] = any_sat ? 1.f : 0.f;
        cluster_arrive();
        cluster_wait();
        if (threadIdx.x < 4) m = fmax_nan(m, ld_cluster_f32(&xch[threadIdx.x], (uint32_t)(half ^ 1)));
        if (threadIdx.x == 4) {
            sat_all = any_sat | (ld_cluster_f32(&xch[4], (uint32_t)(half ^ 1)) != 0.f);
            any_sat_all = sat_all;  // for the other threads, after the barrier below
        }
    }
    if (threadIdx.x < 4) {  // scales and inverses once
        const int g = threadIdx.x;
        const float sc = finite_or_nan(m) / 127.f;  // non-finite group: NaN scale, the scores using it are NaN
        gscale[g] = sc;
        gscale[4 + g] = sc > 0.f ? 1.f / sc : 0.f;
        if (half == 0) kscale[blk * 4 + g] = sc;
    }
    if (threadIdx.x == 4 && half == 0 && !sat_all) vfac[blk] = 1.f;  // else set below
    __syncthreads();
    if constexpr (SPLIT > 1) {
        any_sat = any_sat_all;
        cluster_arrive_relaxed();  // this CTA's reads of the other's shared memory done (waited for before exiting)
    }
    kv_store_k<D>(kimg + blk * kBN * D, kd, gscale[o & 3], gscale[4 + (o & 3)], o, ch0 + d0);
    if (any_sat) {  // rare (a value beyond the sampled range): V reloaded (from L2) here, where K's registers are free
        KvReload<T> reload{valid, vsrc, key_off, p};
        kv_block_vfac<NT, SPLIT, T>(reload, valid, chan, omax, gscale, vfac + blk, &xch[5], half);
        quant_v(reload, gscale[8], valid);  // rewrites this thread's own image words
    }
    __syncthreads();  // the V^T image complete
    // V^T image out: 16-byte chunks, linear (the staging is already in the image layout)
    uint8_t* vdst = vimg + blk * kBN * D + ch0 * kBN;
#pragma unroll
    for (int i = threadIdx.x; i < DC * kBN / 16; i += NT)
        reinterpret_cast<uint4*>(vdst)[i] = reinterpret_cast<const uint4*>(vt)[i];
    if constexpr (SPLIT > 1) cluster_wait();  // the other CTA's reads of this one's exchange slots done
}

}  // namespace sage::hopper

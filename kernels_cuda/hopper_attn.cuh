// sage_patch Hopper (sm_90a) "8b" attention: INT8 wgmma for Q K^T, FP8 wgmma for P~ V, warp-specialized.
// Included by sage_kernels.cu inside its anonymous namespace (shares its helpers, stats pass and params).
//
// Structure (one CTA per SM, persistent over (batch, head, q-block) tiles, q-blocks of a head together (hop_tile),
// taken from a global counter after the first (SAGE_HOP_DYNAMIC)):
//   warpgroup 0  producer: one thread streams pre-quantized K and V^T blocks with cp.async.bulk into an NSTAGE ring
//                of shared-memory stages (mbarriers: full = bytes landed, empty = both consumers done with it);
//   warpgroups 1..NWG  consumers (hop_nwg: 3 at D = 128, 4 at D = 64), 64 query rows each (CTA tile 64 NWG rows),
//                each runs its blocks serially while the others keep the tensor cores busy; quantize their Q rows in the prologue
//                (per-thread groups Grouping(16, 8, 1), written straight into the wgmma operand layout), then per
//                128-key block: S = wgmma s8 (Q from smem, K from smem), online softmax in fp32, P~ = e4m3(448 p)
//                in registers, block = wgmma e4m3 (P~ from registers, V^T from smem) in its own accumulator,
//                O = O * alpha + block (two-level accumulation), then the stage is released.
// Pre-pass (hopper_quant_kv_kernel, after hopper_sample_stats_kernel: means and V's base scale from 128 sampled
// tokens): K - mean(K) -> INT8 with Grouping(128, 8, 2) scales and V - mean -> FP8 with the per-channel base scale
// times a power of two per block, both written in the exact shared-memory image of one 128-key block (no-swizzle
// "core matrix" layout of wgmma), so the producer copies each block with one bulk copy, no tensor maps.
//
// Launches (hop_launch): sample statistics, then the K/V pre-pass and the attention kernel with programmatic
// dependent launch (each waits in pdl_wait() before touching global memory; their launch and set-up overlap the
// previous kernel's end).
//
// Operand image (K-major, no swizzle): a (rows x kbytes) tile is a grid of 8-row x 16-byte core matrices stored
// contiguously (128 B each), core (r/8, c/16) at ((r/8) * (kbytes/16) + c/16) * 128. wgmma descriptor: leading
// byte offset (next core matrix along K) = 128, stride byte offset (next 8 rows) = kbytes / 16 * 128.

constexpr int kHopBN = 128;        // keys per block (one wgmma N for S; four k32 steps for P~V)
// consumer warpgroups per CTA (64 query rows each; CTA tile 64 NWG rows, 128 (NWG + 1) threads) per head dim.
// NWG >= 3 runs each warpgroup's blocks serially (S, softmax, P~V, merge: S and the P~V block never live together,
// so 160 registers (3 consumers) or 112 (4, D = 64) hold it; at D = 128 P~V in two column halves) and relies on the
// other warpgroups to keep the tensor cores busy; NWG = 2 overlaps S(kb) with P~V(kb-1) inside the warpgroup (~230
// registers). H200, same-run A/B (device run 15): D = 128 3 vs 2: +4% at 1K, +7% at 2K, +5% at 16K; D = 64 4 vs 2:
// +13-14% (3: +7-11%); bitwise identical outputs.
#ifndef SAGE_HOP_NWG64
#define SAGE_HOP_NWG64 4
#endif
#ifndef SAGE_HOP_NWG128
#define SAGE_HOP_NWG128 3
#endif
__host__ __device__ constexpr int hop_nwg(int D) { return D == 64 ? SAGE_HOP_NWG64 : SAGE_HOP_NWG128; }
__host__ __device__ constexpr int hop_bm(int nwg) { return 64 * nwg; }          // query rows per CTA tile
__host__ __device__ constexpr int hop_threads(int nwg) { return 128 * (nwg + 1); }  // + the producer warpgroup
#ifndef SAGE_HOP_STAGES
#define SAGE_HOP_STAGES 3
#endif
constexpr int kHopStages = SAGE_HOP_STAGES;
#ifndef SAGE_HOP_DIAG  // diagnostics for timing only: 1 = no softmax, 2 = no P~V GEMM (wrong results)
#define SAGE_HOP_DIAG 0
#endif

// P~V accumulator columns: D, plus 8 columns (V^T rows of e4m3 ones) that hold the row sums of P~: the tensor cores
// sum exactly the quantized P~ the output is made of (one FADD per score less; the output normalised by the sum of
// its own weights is more accurate, docs/benchmarks.md), all 8 columns equal.
__host__ __device__ constexpr int hop_pv_n(int D) { return D + 8; }

#ifndef SAGE_HOP_SWIZZLE
#define SAGE_HOP_SWIZZLE 1
#endif
// Shared-memory images of the wgmma operands (Q, K blocks, V^T blocks), K-major, rows of kbytes (64 or 128) bytes.
// SAGE_HOP_SWIZZLE: rows stored one after the other, the 16-byte chunks of row r XOR-permuted by r's place in its
// 8-row atom (wgmma's 128B / 64B swizzle modes, atoms of 8 * kbytes bytes); else the no-swizzle core-matrix layout
// (8 rows x 16 bytes per core matrix, core matrices along K adjacent).
__host__ __device__ constexpr int hop_img_off_plain(int r, int c, int kbytes) {
    return ((r >> 3) * (kbytes >> 4) + (c >> 4)) * 128 + (r & 7) * 16 + (c & 15);
}
__host__ __device__ constexpr int hop_img_off(int r, int c, int kbytes) {
#if SAGE_HOP_SWIZZLE
    return r * kbytes + ((((c >> 4) ^ (kbytes == 128 ? (r & 7) : ((r >> 1) & 3)))) << 4) + (c & 15);
#else
    return hop_img_off_plain(r, c, kbytes);
#endif
}
// V^T slot of key k within its 32-key group: slot s holds key 16(s/16) + 8((s%4)/2) + 2((s%16)/4) + s%2, the order in
// which the S accumulator fragment of a lane is directly the A fragment of P~ (same rule as quant_v_kernel)
__host__ __device__ constexpr int hop_slot_of_key(int k) {
    return (k & 16) | (k & 1) | (((k >> 3) & 1) << 1) | (((k >> 1) & 3) << 2);
}

// V channel order in the P~V accumulator: column j (in the wgmma layout lane t4 holds columns 8i + 2 t4, +1) carries
// channel hop_vcol(j), bit fields [1:2] and [3:4] swapped, so that lane t4's 32 values of a row are the channels
// 8 (4c + t4) .. + 7 for c = 0..D/32-1: 16 contiguous bytes of output per c, stored with one 16-byte store (the
// natural order needs four 4-byte stores, each touching 8 rows' lines: the epilogue was bound by them). An
// involution: V^T row hop_vcol(d) holds channel d.
__host__ __device__ constexpr int hop_vcol(int j) { return (j & ~0x1E) | ((j >> 2) & 6) | ((j << 2) & 0x18); }

inline int hop_num_sms(int dev) {
    static int cache[64] = {};
    if (dev >= 0 && dev < 64 && cache[dev] > 0) return cache[dev];
    int n = 0;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0) n = 132;
    if (dev >= 0 && dev < 64) cache[dev] = n;
    return n;
}

// Split tail. The persistent grid (one CTA per SM) runs equal non-causal tiles in waves; the ntiles mod nsm tiles of
// the last wave leave the other SMs idle for a whole tile (Flux, B=1 H=24 N=4608: 576 tiles on 132 SMs, the 5th wave
// 36% full). Those tiles are split along the keys into `parts` items of consecutive 128-key blocks, each on its own
// CTA: an item writes its rows' normalised partial output and log2 row sum to the workspace, and the last of a
// tile's parts to finish (a counter per tile and consumer) combines them in part order (deterministic) and stores
// the output. Not for causal (heavy-first order already balances), varlen or LSE calls. Items: tiles 0 .. nfull - 1
// whole, then the parts of tiles nfull .. ntiles - 1 (a tile's parts consecutive).
constexpr int kHopMinPartBlocks = 4;      // a part's fixed costs (Q prologue, epilogue, combine) ~ 2 blocks
constexpr int kHopMaxParts = 4;           // (HopWs::pkb)
inline int g_hop_split_max = kHopMaxParts;  // most parts per tile (1: no split); sage_hop_set_split_max
struct HopPlan { int nqb, ntiles, nsplit, parts, nitems; };
inline HopPlan hop_plan(const SageAttnParams& p) {
    const int nwg = hop_nwg(p.D), bm = hop_bm(nwg), nsm = hop_num_sms(p.device);
    const int nkb = (p.Skv + kHopBN - 1) / kHopBN;
    HopPlan P;
    P.nqb = (p.Sq + bm - 1) / bm;
    P.ntiles = P.nqb * p.B * p.Hq;
    P.nsplit = 0;
    P.parts = 1;
    const int rem = P.ntiles % nsm;
    if (!p.causal && !p.cu_seqlens_q && !p.lse && nwg != 2 && rem > 0) {
        int parts = nsm / rem < g_hop_split_max ? nsm / rem : g_hop_split_max;
        parts = parts < kHopMaxParts ? parts : kHopMaxParts;
        parts = nkb / kHopMinPartBlocks < parts ? nkb / kHopMinPartBlocks : parts;
        if (parts >= 2) { P.nsplit = rem; P.parts = parts; }
    }
    P.nitems = P.ntiles + P.nsplit * (P.parts - 1);
    return P;
}

struct HopLayout {
    int64_t nkb;  // 128-key blocks per (b, kv-head)
    int64_t kimg, kscale, vimg, vscale, vfac, kmean, vmean, kmflag, tilectr, part, total;
    int nzero;    // ints from tilectr on that the statistics kernel zeroes: the tile counter, the split counters
};

inline HopLayout make_hop_layout(const SageAttnParams& p) {
    HopLayout L;
    L.nkb = (p.Skv + kHopBN - 1) / kHopBN;
    const HopPlan P = hop_plan(p);
    const int nwg = hop_nwg(p.D);
    const int64_t bhk = (int64_t)p.B * p.Hkv, D = p.D;
    int64_t off = 0;
    L.kimg = off;   off = align256(off + bhk * L.nkb * kHopBN * D);
    L.kscale = off; off = align256(off + bhk * L.nkb * 4 * 4);
    L.vimg = off;   off = align256(off + bhk * L.nkb * kHopBN * D);
    L.vscale = off; off = align256(off + bhk * D * 4);
    L.vfac = off;   off = align256(off + bhk * L.nkb * 4);
    L.kmean = off;  off = align256(off + bhk * D * 4);
    L.vmean = off;  off = align256(off + bhk * D * 4);
    L.kmflag = off; off = align256(off + (p.kmask ? (int64_t)p.B * L.nkb * 4 : 0));
    // the dynamic tile scheduler's counter, then one arrival counter per split tile and consumer
    L.nzero = 1 + P.nsplit * nwg;
    L.tilectr = off; off = align256(off + 4 * L.nzero);
    // split parts' partials: per (split tile, part, consumer) D/8 + 1 float4 per thread (normalised output, log2 sums)
    L.part = off;   off = align256(off + (int64_t)P.nsplit * P.parts * nwg * (p.D / 8 + 1) * 128 * 16);
    L.total = off;
    return L;
}

// ------------------------------------------------------------------------------------------------------------------
// Pre-pass: one CTA per (128-key block, kv-head, batch). Each thread owns 4 keys and 8 channels: owner o = tid / (D/8)
// (0..31) holds the keys of V^T slots 4o..4o+3 (hop_kv_key), so per channel its 4 e4m3 bytes are one 32-bit word of the
// V^T image (one shared store per channel instead of 4 byte stores and their shifts), and its 4 keys are in one K
// scale group (Grouping(128, 8, 2): group (key % 8) / 2 = o % 4, one running max). A key row is read by D/8 adjacent
// lanes, 16 bytes each, so every warp load covers whole rows (256 or 128 contiguous bytes per row).
#ifndef SAGE_HOP_KV_FMA
#define SAGE_HOP_KV_FMA 1  // V as one FFMA per value: v (1 / scale) + (-mean / scale); 0: (v - mean) (1 / scale)
#endif
__host__ __device__ constexpr int hop_kv_threads(int D) { return 4 * D; }  // 32 owners x D / 8 lanes
// 64 registers per thread: 2 CTAs per SM at D = 128, 4 at D = 64
__host__ __device__ constexpr int hop_kv_ctas(int D) { return 1024 / hop_kv_threads(D); }
// block-local key of owner o's load i: V^T slot 4o + i (hop_slot_of_key: slot bits 0, 1, 2-3, 4 = key bits 0, 3, 1-2, 4)
__host__ __device__ constexpr int hop_kv_key(int o, int i) {
    return 32 * (o >> 3) + 16 * ((o >> 2) & 1) + 2 * (o & 3) + (i & 1) + 8 * (i >> 1);
}
__host__ __device__ constexpr bool hop_kv_keys_ok() {  // (checked at compile time)
    for (int o = 0; o < 32; ++o)
        for (int i = 0; i < 4; ++i) {
            const int k = hop_kv_key(o, i);
            if ((k & ~31) + hop_slot_of_key(k & 31) != 4 * o + i) return false;
        }
    return true;
}
static_assert(hop_kv_keys_ok(), "owner o's keys are V^T slots 4o..4o+3");
// V's quantized value before the e4m3 rounding: v (1 / scale) + (-mean / scale) with the shift precomputed, or
// (v - mean) (1 / scale) (SAGE_HOP_KV_FMA = 0: the previous arithmetic, for bitwise comparisons)
__device__ __forceinline__ float hop_kv_vq(float v, float inv, float shift) {
    return SAGE_HOP_KV_FMA ? fmaf(v, inv, shift) : (v - shift) * inv;
}
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
// (kHopVHeadroom x the sample's max |V - mean|, floored) times a power of two per 128-key block (vfac, chosen by the
// K/V pass from the block's own values), so no value saturates whatever the sample missed.
// Sample: ns = min(kHopSample, skv) tokens t_i = floor(i skv / ns). One CTA per (b, kv-head); the reference
// simulates it (SimConfig.stats_sample).
constexpr int kHopSample = 128;
constexpr float kHopVHeadroom = 8.f;        // base = headroom x sample max: blocks beyond it get vfac > 1
constexpr float kHopVRelFloor = 1.f / 1024.f;  // a channel's base >= this x the largest channel's (bounds vfac)
constexpr float kHopVAbsFloor = 1e-20f;
constexpr int kHopVMaxExp = 64;             // vfac <= 2^64 (larger values saturate: |V| > ~1e3 x 2^64 x base)
constexpr int kHopStatThreads = 256;
template <int D, typename T>
__global__ void __launch_bounds__(kHopStatThreads) hopper_sample_stats_kernel(SageAttnParams p, float* kmean,
                                                                              float* vscale, float* vmean, int* zero,
                                                                              int nzero) {
    pdl_launch_dependents();
    constexpr int LPK = D / 8, RPP = kHopStatThreads / LPK;  // lanes per row (8 channels each), rows per pass
    __shared__ float red[4][RPP][D];  // per row slot: K sum, V sum, V max, V min
    __shared__ float wmx[D / 32];
    const int bh = blockIdx.x, b = bh / p.Hkv, h = bh % p.Hkv;
    if (zero && bh == 0)  // the attention kernel's tile and split counters, reset in stream order
        for (int i = threadIdx.x; i < nzero; i += kHopStatThreads) zero[i] = 0;
    const int skv = len_k(p, b), ns = min(skv, kHopSample);
    const int cc = threadIdx.x % LPK, rr = threadIdx.x / LPK;
    const T* kb = static_cast<const T*>(p.k) + b * p.k_sb + h * p.k_sh + tok0_k(p, b) * p.k_ss + 8 * cc;
    const T* vb = static_cast<const T*>(p.v) + b * p.v_sb + h * p.v_sh + tok0_k(p, b) * p.v_ss + 8 * cc;
    float ks[8], vs[8], vmx[8], vmn[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) { ks[e] = 0.f; vs[e] = 0.f; vmx[e] = -INFINITY; vmn[e] = INFINITY; }
    constexpr int NI = kHopSample / RPP;
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
    const float base = finite_or_nan(fmax_nan(fmax_nan(kHopVHeadroom * a, kHopVHeadroom * am * kHopVRelFloor),
                                              kHopVAbsFloor)) / kFp8Max;
    kmean[(int64_t)bh * D + d] = km;
    vmean[(int64_t)bh * D + d] = vm;
    vscale[(int64_t)bh * D + d] = base;
}

template <int D, typename T>
__global__ void __launch_bounds__(hop_kv_threads(D), hop_kv_ctas(D)) hopper_quant_kv_kernel(SageAttnParams p,
        const float* kmean, const float* vscale, const float* vmean, int8_t* kimg, float* kscale, uint8_t* vimg,
        float* vfac, int* kmflag, int nkb) {
    constexpr int NT = hop_kv_threads(D), LPK = D / 8;  // threads, lanes per key row
    static_assert(kHopBN == 128 && NT / LPK == 32, "32 owners of 4 keys");
    // per-channel K mean, 1 / V scale and V's shift (-mean / scale, or the mean) as float4 [quantity][half][lane
    // chunk]: a lane's 8 channels are two LDS.128 without bank conflicts
    __shared__ float4 skc[3][2][LPK];
    __shared__ float omax[32], gscale[9];
    __shared__ __align__(16) uint8_t vt[D * kHopBN];  // the V^T block image, copied out linearly at the end
    pdl_wait();
    pdl_launch_dependents();
    // grid (block, kv-head, batch): no division for the head index
    const int kb = blockIdx.x, h = blockIdx.y, b = blockIdx.z, bh = b * p.Hkv + h;
    const int skv = len_k(p, b);
    if (kb > 0 && kb * kHopBN >= skv) return;  // varlen: past this sequence's end (never read)
    const int o = threadIdx.x / LPK, cc = threadIdx.x % LPK, d0 = 8 * cc;  // owner, its lane's 8 channels
    const int kbase = kb * kHopBN;
    const bool full = kbase + kHopBN <= skv;  // CTA-uniform: no per-value validity selects
    // the owner's keys c0 + {0, 1, 8, 9}: one 64-bit address product, the others by adds
    const int c0 = hop_kv_key(o, 0);
    const int64_t tok = tok0_k(p, b) + kbase + c0;
    const T* ksrc = static_cast<const T*>(p.k) + b * p.k_sb + h * p.k_sh + tok * p.k_ss + d0;
    const T* vsrc = static_cast<const T*>(p.v) + b * p.v_sb + h * p.v_sh + tok * p.v_ss + d0;
    auto key_off = [](int i, int64_t ss) { return (i & 1 ? ss : 0) + (i >> 1 ? 8 * ss : 0); };
    uint4 kraw[4], vraw[4];  // all loads in flight before any use (raw: half the registers of floats)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        if (kbase + hop_kv_key(o, i) < skv) {
            kraw[i] = *reinterpret_cast<const uint4*>(ksrc + key_off(i, p.k_ss));
            vraw[i] = *reinterpret_cast<const uint4*>(vsrc + key_off(i, p.v_ss));
        } else {
            kraw[i] = make_uint4(0u, 0u, 0u, 0u);
            vraw[i] = make_uint4(0u, 0u, 0u, 0u);
        }
    }
    if (threadIdx.x < D) {  // (after the loads are issued: these are small L2 reads)
        const int d = threadIdx.x;
        float* kc = reinterpret_cast<float*>(skc) + ((d >> 2) & 1) * LPK * 4 + (d >> 3) * 4 + (d & 3);
        const float vi = 1.f / vscale[(int64_t)bh * D + d];  // the sampled base scale (> 0: floored)
        const float vm = vmean[(int64_t)bh * D + d];         // 0 without smooth V
        kc[0] = kmean[(int64_t)bh * D + d];
        kc[2 * LPK * 4] = vi;
        kc[4 * LPK * 4] = SAGE_HOP_KV_FMA ? -vm * vi : vm;
    }
    __syncthreads();
    auto chan = [&](int q, float (&x)[8]) {  // quantity q (0 K mean, 1 1 / V scale, 2 V shift) of the lane's channels
        const float4 a = skc[q][0][cc], bq = skc[q][1][cc];
        x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w; x[4] = bq.x; x[5] = bq.y; x[6] = bq.z; x[7] = bq.w;
    };
    auto valid = [&](int i) { return kbase + hop_kv_key(o, i) < skv; };
    auto always = [](int) { return true; };
    // V: e4m3 bytes of (V - mean) / (base vfac) into the V^T image, first with vfac = 1 (returning nonzero if a byte
    // is +-448 or NaN: possibly saturated), again with the block's vfac if one is. Channel d's word (the owner's 4
    // keys) goes to row hop_vcol(d), bytes 4o..4o+3. Rows hop_vcol(8 cc + e) of a store fall on 4 of the 8 16-byte
    // bank groups; lanes with (cc / 4) odd store the odd channel of each pair first, which spreads them over 8.
    const int rot = (cc >> 2) & 1;
#if SAGE_HOP_SWIZZLE
    // hop_img_off(row, 4o, 128) = (row * 128 | (row % 8) * 16) ^ 4o; row = hop_vcol(d0 + c) for c = 2 pp + s is
    // (s ^ rot) | ((cc % 4) << 1) | (pp << 3) | ((cc / 4) << 5): pp only adds pp * 1024
    int vaddr[2];
#pragma unroll
    for (int s = 0; s < 2; ++s) {
        const int row = hop_vcol(d0 + (s ^ rot));
        vaddr[s] = (row * kHopBN | ((row & 7) << 4)) ^ (4 * o);
    }
    auto vaddr_of = [&](int e) { return vaddr[e & 1] + (e >> 1) * 8 * kHopBN; };
#else
    auto vaddr_of = [&](int e) { return hop_img_off(hop_vcol(d0 + (e ^ rot)), 4 * o, kHopBN); };
#endif
    auto quant_v = [&](auto raw, float vmul, auto ok) {  // raw(i): the owner's 16 bytes of key i
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
                const float m = vi[e] * vmul, a = SAGE_HOP_KV_FMA ? vs[e] * vmul : vs[e];  // exact: vmul = 2^-k
                float z[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float x = s ? y[i].y : y[i].x;
                    z[i] = ok(i) ? hop_kv_vq(x, m, a) : 0.f;
                }
                wd[s] = cvt_e4m3x4(z[0], z[1], z[2], z[3]);
                // a byte's magnitude bits >= 0x7e (448, or NaN): + 2 sets its bit 7 (no carry into the next byte)
                sat |= ((wd[s] & 0x7f7f7f7fu) + 0x02020202u) & 0x80808080u;
            }
            *reinterpret_cast<uint32_t*>(vt + vaddr_of(2 * pp)) = rot ? wd[1] : wd[0];
            *reinterpret_cast<uint32_t*>(vt + vaddr_of(2 * pp + 1)) = rot ? wd[0] : wd[1];
        }
        return sat;
    };
    auto first = [&](int i) { return vraw[i]; };
    const uint32_t sat = full ? quant_v(first, 1.f, always) : quant_v(first, 1.f, valid);
    // K - mean kept in registers for the quantization after the group maxima
    float kd[4][8];
    float am = 0.f;
    auto kdiff = [&](auto ok) {
        float m[8];
        chan(0, m);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float x[8];
            raw8_to_float<T>(kraw[i], x);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                kd[i][e] = ok(i) ? x[e] - m[e] : 0.f;  // padded keys: 0 (they load as 0; |0 - mean| must not count)
                am = fmax_nan(am, fabsf(kd[i][e]));
            }
        }
    };
    if (full) kdiff(always); else kdiff(valid);
#pragma unroll
    for (int s = LPK / 2; s > 0; s >>= 1) am = fmax_nan(am, __shfl_xor_sync(0xffffffffu, am, s));
    if (cc == 0) omax[o] = am;
    // key-padding mask: one flag per (batch, block), "some key of this block is masked", so the attention kernel
    // masks (reads the mask) only in those blocks
    if (p.kmask) {
        const int masked = threadIdx.x < kHopBN && kbase + (int)threadIdx.x < skv &&
                           p.kmask[(int64_t)b * p.kmask_sb + kbase + threadIdx.x] == 0;
        const int any_masked = __syncthreads_or(masked);
        if (h == 0 && threadIdx.x == 0) kmflag[(int64_t)b * nkb + kb] = any_masked;
    }
    const int any_sat = __syncthreads_or(sat != 0u);
    const int64_t blk = (int64_t)bh * nkb + kb;
    if (threadIdx.x < 4) {  // group g: owners g, g + 4, ..., g + 28; scales and inverses once
        const int g = threadIdx.x;
        float m = 0.f;
#pragma unroll
        for (int r = 0; r < 8; ++r) m = fmax_nan(m, omax[g + 4 * r]);
        const float sc = finite_or_nan(m) / 127.f;  // non-finite group: NaN scale, the scores using it are NaN
        gscale[g] = sc;
        gscale[4 + g] = sc > 0.f ? 1.f / sc : 0.f;
        kscale[blk * 4 + g] = sc;
    }
    if (threadIdx.x == 4 && !any_sat) vfac[blk] = 1.f;  // else set below
    __syncthreads();
    // K: 8 channels of a key = 8 bytes of its image row
    int8_t* kdst = kimg + blk * kHopBN * D;
    {
        const float sc = gscale[o & 3], inv = gscale[4 + (o & 3)];
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
            *reinterpret_cast<uint2*>(kdst + hop_img_off(hop_kv_key(o, i), d0, D)) = make_uint2(w[0], w[1]);
        }
    }
    if (any_sat) {  // rare (a value beyond the sampled range): V reloaded (from L2) here, where K's registers are
        // free; vfac = 2^e, the least e >= 0 with max |V - mean| / base <= 448 vfac (e <= kHopVMaxExp). A
        // non-finite value in the block (NaN, or Inf, which the first pass saturated to 448: both flag the block)
        // makes the maximum NaN: the block is requantized with a NaN factor, so its V^T image is NaN and so are
        // P~V and O of every row that runs the block (vfac itself stays a power of two: the attention kernel
        // divides by it with integer arithmetic on the exponent)
        auto reload = [&](int i) {
            return valid(i) ? *reinterpret_cast<const uint4*>(vsrc + key_off(i, p.v_ss)) : make_uint4(0u, 0u, 0u, 0u);
        };
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
                    const float z = hop_kv_vq(y[e], vi[e], vs[e]);
                    r = valid(i) ? fmax_nan(r, fabsf(z)) : r;
                }
            }
        }
#pragma unroll
        for (int s = 16; s > 0; s >>= 1) r = fmax_nan(r, __shfl_xor_sync(0xffffffffu, r, s));
        if ((threadIdx.x & 31) == 0) omax[threadIdx.x >> 5] = r;  // (omax was last read before the barrier above)
        __syncthreads();
        if (threadIdx.x == 0) {
            r = 0.f;
#pragma unroll
            for (int w = 0; w < NT / 32; ++w) r = fmax_nan(r, omax[w]);
            r = finite_or_nan(r);
            int e = 0;
            if (r > kFp8Max) {  // (false for NaN)
                const uint32_t u = __float_as_uint(r / kFp8Max);  // >= 1
                e = min((int)(u >> 23) - 127 + ((u & 0x7fffffu) != 0u), kHopVMaxExp);
            }
            vfac[blk] = __uint_as_float((uint32_t)(127 + e) << 23);
            gscale[8] = r == r ? __uint_as_float((uint32_t)(127 - e) << 23) : r;  // NaN: the block's V^T image NaN
        }
        __syncthreads();
        quant_v(reload, gscale[8], valid);  // rewrites this thread's own image words
    }
    __syncthreads();  // the V^T image complete
    // V^T image out: 16-byte chunks, linear (the staging is already in the image layout)
    uint8_t* vdst = vimg + blk * kHopBN * D;
#pragma unroll
    for (int i = threadIdx.x; i < D * kHopBN / 16; i += NT)
        reinterpret_cast<uint4*>(vdst)[i] = reinterpret_cast<const uint4*>(vt)[i];
}

// ------------------------------------------------------------------------------------------------------------------
// sm_90a primitives
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define SAGE_HOP_DEVICE 1
#else
#define SAGE_HOP_DEVICE 0
#endif

#if SAGE_HOP_DEVICE
__device__ __forceinline__ uint64_t hop_desc_plain(uint32_t saddr, uint32_t sbo) {
    // start address, leading byte offset 128 (next core matrix along K), stride byte offset sbo, no swizzle
    return (uint64_t)((saddr & 0x3FFFF) >> 4) | ((uint64_t)(128 >> 4) << 16) | ((uint64_t)(sbo >> 4) << 32);
}
// Descriptor of an hop_img_off image with rows of kbytes, in two halves: the low word holds the start address (and
// the leading byte offset), the high word is a compile-time constant (stride, swizzle mode). Moving along K or to
// another stage adds to the low word only (hop_desc_step): shared-memory addresses are < 2^18, so the 14-bit address
// field never carries into the rest, and the loop pays one add per wgmma instead of a mask-shift-or sequence.
__host__ __device__ constexpr uint32_t hop_desc_hi(int kbytes) {
#if SAGE_HOP_SWIZZLE
    // swizzled K-major: 8-row atoms kbytes * 8 apart (SBO), LBO unused; mode 1 = 128B, 2 = 64B swizzle. The
    // hardware applies the XOR to the address bits, so images start 8 * kbytes aligned and K steps add to the start.
    return (uint32_t)((8 * kbytes) >> 4) | ((kbytes == 128 ? 1u : 2u) << 30);
#else
    return (uint32_t)((kbytes / 16 * 128) >> 4);
#endif
}
__device__ __forceinline__ uint32_t hop_desc_lo(uint32_t img) {
#if SAGE_HOP_SWIZZLE
    return ((img & 0x3FFFF) >> 4) | (1u << 16);
#else
    return ((img & 0x3FFFF) >> 4) | ((128u >> 4) << 16);
#endif
}
// low-word increment for starting k0 bytes (a multiple of 32) further along K
__host__ __device__ constexpr uint32_t hop_desc_step(int k0) {
#if SAGE_HOP_SWIZZLE
    return (uint32_t)(k0 >> 4);
#else
    return (uint32_t)((k0 >> 4) * 128 >> 4);
#endif
}
__device__ __forceinline__ uint64_t hop_desc_make(uint32_t lo, uint32_t hi) { return ((uint64_t)hi << 32) | lo; }
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    uint32_t ok;
    do {
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(ok) : "r"(bar), "r"(parity) : "memory");
    } while (!ok);
}
__device__ __forceinline__ void bulk_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
template <int N> __device__ __forceinline__ void reg_fence(int (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}
template <int N> __device__ __forceinline__ void reg_fence(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
__device__ __forceinline__ void named_sync(int id, int n) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
template <int N, int M> __device__ __forceinline__ void reg_fence(uint32_t (&r)[N][M]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int j = 0; j < M; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
}

// operand lists for 64 / 32 accumulator registers; C: "+r" / "+f" (accumulate) or "=r" / "=f" (first k step: the
// accumulator is only written, so its old values are dead for the compiler and cost no registers across the softmax)
#define SAGE_D8(C, i) C(d[i + 0]), C(d[i + 1]), C(d[i + 2]), C(d[i + 3]), C(d[i + 4]), C(d[i + 5]), C(d[i + 6]), \
                      C(d[i + 7])
#define SAGE_D64(C) SAGE_D8(C, 0), SAGE_D8(C, 8), SAGE_D8(C, 16), SAGE_D8(C, 24), SAGE_D8(C, 32), SAGE_D8(C, 40), \
                    SAGE_D8(C, 48), SAGE_D8(C, 56)
#define SAGE_LIST32 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
    "%24, %25, %26, %27, %28, %29, %30, %31"
#define SAGE_LIST64 \
    SAGE_LIST32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, " \
    "%51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"

// S (64 x 128, int32) (+)= Q (64 x 32 int8, smem) . K (128 x 32 int8, smem)^T; ACC: add to d, else overwrite it
#define SAGE_WGMMA_S8(SCALE_D, C) \
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 {" SAGE_LIST64 "}, %64, %65, " SCALE_D ";\n" \
                 : SAGE_D64(C) : "l"(da), "l"(db))
template <bool ACC> __device__ __forceinline__ void wgmma_s8_n128(int (&d)[64], uint64_t da, uint64_t db) {
    if constexpr (ACC) SAGE_WGMMA_S8("1", "+r");
    else SAGE_WGMMA_S8("0", "=r");
}
// O (64 x D + 8, fp32) (+)= P~ (64 x 32 e4m3, registers) . V^T (D + 8 x 32 e4m3, smem)^T; columns D.. are row sums
#define SAGE_WGMMA_E4_N136(SCALE_D, C) \
    asm volatile("wgmma.mma_async.sync.aligned.m64n136k32.f32.e4m3.e4m3 {" SAGE_LIST64 ", %64, %65, %66, %67}, " \
                 "{%68, %69, %70, %71}, %72, " SCALE_D ", 1, 1;\n" \
                 : SAGE_D64(C), C(d[64]), C(d[65]), C(d[66]), C(d[67]) \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db))
#define SAGE_WGMMA_E4_N72(SCALE_D, C) \
    asm volatile("wgmma.mma_async.sync.aligned.m64n72k32.f32.e4m3.e4m3 {" SAGE_LIST32 ", %32, %33, %34, %35}, " \
                 "{%36, %37, %38, %39}, %40, " SCALE_D ", 1, 1;\n" \
                 : SAGE_D8(C, 0), SAGE_D8(C, 8), SAGE_D8(C, 16), SAGE_D8(C, 24), C(d[32]), C(d[33]), C(d[34]), \
                   C(d[35]) \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db))
#define SAGE_WGMMA_E4_N64(SCALE_D, C) \
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {" SAGE_LIST32 "}, " \
                 "{%32, %33, %34, %35}, %36, " SCALE_D ", 1, 1;\n" \
                 : SAGE_D8(C, 0), SAGE_D8(C, 8), SAGE_D8(C, 16), SAGE_D8(C, 24) \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db))
// P~V over the first 64 V^T rows only (channels hop_vcol(0..63)): the first half of a column-split P~V at D = 128
template <bool ACC> __device__ __forceinline__ void wgmma_pv64(float (&d)[32], const uint32_t* a, uint64_t db) {
    if constexpr (ACC) SAGE_WGMMA_E4_N64("1", "+f");
    else SAGE_WGMMA_E4_N64("0", "=f");
}
// P~V over V^T rows 64..135 (the second half of a split P~V at D = 128, with the row sums), or all rows at D = 64
template <bool ACC> __device__ __forceinline__ void wgmma_pv72(float (&d)[36], const uint32_t* a, uint64_t db) {
    if constexpr (ACC) SAGE_WGMMA_E4_N72("1", "+f");
    else SAGE_WGMMA_E4_N72("0", "=f");
}
template <int D, bool ACC>
__device__ __forceinline__ void wgmma_pv(float (&d)[hop_pv_n(D) / 2], const uint32_t* a, uint64_t db) {
    if constexpr (D == 128) {
        if constexpr (ACC) SAGE_WGMMA_E4_N136("1", "+f");
        else SAGE_WGMMA_E4_N136("0", "=f");
    } else {
        if constexpr (ACC) SAGE_WGMMA_E4_N72("1", "+f");
        else SAGE_WGMMA_E4_N72("0", "=f");
    }
}
#endif  // SAGE_HOP_DEVICE

#ifndef SAGE_HOP_TILE_ORDER
#define SAGE_HOP_TILE_ORDER 1
#endif
// persistent tile order. 1: (batch, head) outer, q-blocks inner from the last (longest causal rows) to the first: the
// CTAs running at the same time work on the same few heads, so each K/V block comes from HBM once and then from L2
// (with (batch, head) inner, 132 CTAs stream 132 different heads' K/V: at B=4 H=32 N>=4K that working set is larger
// than L2 and the kernel re-reads K/V from HBM per q-block). 0: q-blocks outer (globally heaviest first), heads inner.
// Heads sharing K/V (GQA) are adjacent in both.
struct HopTile { int b, h, qb; };
#ifndef SAGE_HOP_DYNAMIC
#define SAGE_HOP_DYNAMIC 1
#endif
// SAGE_HOP_DYNAMIC: after its first tile (blockIdx.x) a CTA takes the next unclaimed tile from a global counter
// (the producer thread, one atomic per tile, ahead of the consumers), so CTAs that drew short causal tiles take more
// of them; 0: static round-robin (tile blockIdx.x + i * gridDim.x). The producer hands tile indices to the consumers
// through a small mbarrier ring in shared memory (it runs up to kHopStages blocks ahead, so possibly several tiles).
constexpr int kHopTileRing = 4;
__device__ __forceinline__ HopTile hop_tile(int t, int B, int Hq, int nqb) {
#if SAGE_HOP_TILE_ORDER == 1
    const int bh = t / nqb;
    return HopTile{bh / Hq, bh % Hq, nqb - 1 - t % nqb};
#else
    const int bh = t % (B * Hq);
    return HopTile{bh / Hq, bh % Hq, nqb - 1 - t / (B * Hq)};
#endif
}
__device__ __forceinline__ int hop_num_kv_blocks(const SageAttnParams& p, int q0, int bm, int sq, int skv) {
    int kv_end = skv;
    if (p.causal) kv_end = min(kv_end, q0 + bm + (skv - sq));
    return kv_end > 0 ? (kv_end + kHopBN - 1) / kHopBN : 0;
}

template <int D, int NWG>
struct HopSmem {
    static constexpr int QBYTES = 64 * D;          // per consumer warpgroup
    static constexpr int KBYTES = kHopBN * D;      // one K block image
    static constexpr int VBYTES = kHopBN * D;      // one V^T block image (what the producer copies)
    static constexpr int ONES = (hop_pv_n(D) - D) * kHopBN;  // + 8 rows of e4m3 ones below it (row sums), set once
    static constexpr int VSTRIDE = VBYTES + ONES;
    static constexpr int Q_OFF = 0;
    static constexpr int K_OFF = NWG * QBYTES;
    static constexpr int V_OFF = K_OFF + kHopStages * KBYTES;
    static constexpr int EPI_OFF = V_OFF + kHopStages * VSTRIDE;  // V scale, V mean, K mean per consumer x tile parity
    static constexpr int EPI_FLOATS = 3 * D;
    static constexpr int BAR_OFF = EPI_OFF + NWG * 2 * EPI_FLOATS * 4;
    static constexpr int TBAR_OFF = BAR_OFF + 2 * kHopStages * 8;  // tile ring: full / empty mbarriers
    static constexpr int TILE_OFF = TBAR_OFF + 2 * kHopTileRing * 8;  // tile ring: tile indices
    static constexpr int FLAG_OFF = TILE_OFF + kHopTileRing * 4;  // per consumer: its split counter's old value
    static constexpr int TOTAL = FLAG_OFF + NWG * 4 + 1024;  // + slack to align the images to 1024 bytes
    static_assert(TOTAL < (1 << 18), "descriptor low words (hop_desc_step) assume shared addresses < 2^18");
};

struct HopWs {
    const int8_t* kimg; const float* kscale; const uint8_t* vimg; const float* vscale; const float* vfac;
    const float* kmean; const float* vmean; const int* kmflag; int* tilectr; int nkb; int nqb;
    float4* part; int* splitctr;  // split tail (hop_plan): partials, arrival counters
    int nitems, nfull, parts;     // work items; items < nfull are whole tiles
    uint32_t pmul;                // ceil(2^32 / parts): u / parts as one multiply-high (no division per tile)
    int pkb[kHopMaxParts + 1];    // part j of a split tile: blocks pkb[j] .. pkb[j + 1] - 1 (their nkb is w.nkb)
};
// work item -> tile, and for a part of a split tile its index among the split tiles (else -1) and part number
struct HopItem { int tile, split, part; };
__device__ __forceinline__ HopItem hop_item(int t, const HopWs& w) {
    if (t < w.nfull) return HopItem{t, -1, 0};
    const int u = t - w.nfull, sp = (int)__umulhi((uint32_t)u, w.pmul);
    return HopItem{w.nfull + sp, sp, u - sp * w.parts};
}
// blocks [kb0, kb1) of an item whose tile has nkb blocks
__device__ __forceinline__ int hop_part_kb0(const HopItem& it, const HopWs& w) {
    return it.split < 0 ? 0 : w.pkb[it.part];
}
__device__ __forceinline__ int hop_part_kb1(const HopItem& it, int nkb, const HopWs& w) {
    return it.split < 0 ? nkb : w.pkb[it.part + 1];
}

#ifndef SAGE_HOP_TRACE
#define SAGE_HOP_TRACE 0  // diagnostics: clock64 per phase of each CTA's first tiles (sage_hop_trace_read)
#endif
#if SAGE_HOP_TRACE
constexpr int kTraceCtas = 132, kTraceTiles = 8, kTraceEv = 8;
__device__ long long g_hop_trace[kTraceCtas * 2 * kTraceTiles * kTraceEv];
#define HOP_TRACE(ev, val)                                                                                        \
    if (ltid == 0 && cw < 2 && blockIdx.x < kTraceCtas && ntrace < kTraceTiles)                                             \
        g_hop_trace[((blockIdx.x * 2 + cw) * kTraceTiles + ntrace) * kTraceEv + (ev)] = (val)
#else
#define HOP_TRACE(ev, val)
#endif
// and clock64 at 7 points of the first tile's first loop iterations of every consumer (sage_hop_ltrace_read; in the
// serial loop: loop top, stage landed, S ready, P~ packed, P~V half a ready, half b ready, merged)
#if SAGE_HOP_TRACE >= 2
constexpr int kLtIters = 16, kLtEv = 8;
__device__ long long g_hop_ltrace[kTraceCtas * 4 * kLtIters * kLtEv];  // up to 4 consumer warpgroups
#define HOP_LTRACE(kb, ev)                                                                                        \
    if (ltid == 0 && ntrace == 0 && blockIdx.x < kTraceCtas && (kb) < kLtIters)                                   \
        g_hop_ltrace[((blockIdx.x * 4 + cw) * kLtIters + (kb)) * kLtEv + (ev)] = clock64()
#define HOP_LFENCE(x) reg_fence(x)
#else
#define HOP_LTRACE(kb, ev)
#define HOP_LFENCE(x)
#endif

// LSE: whether p.lse is written (a template parameter: its fp32 row sums cost registers the loop needs otherwise)
template <int D, typename T, bool LSE, int NWG>
__global__ void __launch_bounds__(hop_threads(NWG), 1) hopper_attn_kernel(const __grid_constant__ SageAttnParams p,
                                                                           const HopWs w) {
#if SAGE_HOP_DEVICE
    using S = HopSmem<D, NWG>;
    constexpr int BM = hop_bm(NWG);
    extern __shared__ __align__(1024) uint8_t hsmem_raw[];
    // swizzled operand images need 1024-byte aligned atoms: align the base ourselves
    const uint32_t spad = (1024u - (smem_u32(hsmem_raw) & 1023u)) & 1023u;
    uint8_t* hsmem = hsmem_raw + spad;
    const uint32_t sbase = smem_u32(hsmem);
    const uint32_t bar_full = sbase + S::BAR_OFF, bar_empty = bar_full + 8 * kHopStages;
    const uint32_t tbar_full = sbase + S::TBAR_OFF, tbar_empty = tbar_full + 8 * kHopTileRing;
    volatile int* tring = reinterpret_cast<volatile int*>(hsmem + S::TILE_OFF);
    const int wg = threadIdx.x >> 7;
    if (threadIdx.x == 0) {
        for (int s = 0; s < kHopStages; ++s) {
            mbar_init(bar_full + 8 * s, 1);
            mbar_init(bar_empty + 8 * s, 4 * NWG);  // one arrival per consumer warp
        }
        for (int r = 0; r < kHopTileRing; ++r) {
            mbar_init(tbar_full + 8 * r, 1);
            mbar_init(tbar_empty + 8 * r, 4 * NWG);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    {  // e4m3 1.0 = 0x38 in the rows below every V^T stage (the bulk copies never touch them)
        for (int i = threadIdx.x; i < kHopStages * S::ONES / 4; i += hop_threads(NWG)) {
            const int st = i / (S::ONES / 4), wd = i % (S::ONES / 4);
            *reinterpret_cast<uint32_t*>(hsmem + S::V_OFF + st * S::VSTRIDE + S::VBYTES + 4 * wd) = 0x38383838u;
        }
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // visible to wgmma (async proxy)
    }
    __syncthreads();
    pdl_wait();  // launched early (PDL): the pre-passes' outputs are complete and visible from here on
    const int group = p.Hq / p.Hkv;

    if (wg == 0) {  // ---------------- producer
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
        if (threadIdx.x != 0) return;
        int it = 0, ti = 0;
        auto publish = [&](int t) {  // hand work item t (>= nitems: no more) to the consumers
            const int r = ti % kHopTileRing;
            mbar_wait(tbar_empty + 8 * r, ((uint32_t)(ti / kHopTileRing) & 1u) ^ 1u);
            tring[r] = t;
            mbar_arrive(tbar_full + 8 * r);
            ++ti;
        };
        for (int t = blockIdx.x; t < w.nitems;) {
#if SAGE_HOP_DYNAMIC
            const int tn = (int)gridDim.x + atomicAdd(w.tilectr, 1);  // in flight while this tile's loads issue
#else
            const int tn = t + (int)gridDim.x;
#endif
            const HopItem itm = hop_item(t, w);
            const HopTile tl = hop_tile(itm.tile, p.B, p.Hq, w.nqb);
            const int sq = len_q(p, tl.b), skv = len_k(p, tl.b), q0 = tl.qb * BM;
            if (q0 >= sq) { t = tn; continue; }  // varlen: past this sequence's end
            publish(t);
            const int nkb = hop_num_kv_blocks(p, q0, BM, sq, skv);
            const int64_t blk0 = ((int64_t)tl.b * p.Hkv + tl.h / group) * w.nkb;
            const int kb1 = hop_part_kb1(itm, nkb, w);
            for (int kb = hop_part_kb0(itm, w); kb < kb1; ++kb, ++it) {
                const int s = it % kHopStages;
                const uint32_t ph = (uint32_t)(it / kHopStages) & 1u;
                mbar_wait(bar_empty + 8 * s, ph ^ 1u);
                mbar_expect_tx(bar_full + 8 * s, S::KBYTES + S::VBYTES);
                bulk_g2s(sbase + S::K_OFF + s * S::KBYTES, w.kimg + (blk0 + kb) * S::KBYTES, S::KBYTES, bar_full + 8 * s);
                bulk_g2s(sbase + S::V_OFF + s * S::VSTRIDE, w.vimg + (blk0 + kb) * S::VBYTES, S::VBYTES, bar_full + 8 * s);
            }
            t = tn;
        }
        publish(w.nitems);
        return;
    }

    // ---------------- consumers
    // setmaxnreg.inc takes only what the producer's .dec released from the CTA's launch allocation (the launch
    // bound's 65536 / threads, a multiple of 8; asking for more hangs): 240 for 2 consumers (capped), 160 for 3, 112 for 4
    constexpr int kLaunchRegs = (65536 / hop_threads(NWG)) & ~7;
    constexpr int kPool = ((kLaunchRegs * hop_threads(NWG) - 128 * 24) / (128 * NWG)) & ~7;
    constexpr int kRegs = kPool > 240 ? 240 : kPool;
    static_assert(NWG != 4 || kRegs == 112, "4 consumers: 640 threads launch with 96 registers each");
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs) : "memory");
    // consumer warpgroup cw (0..NWG-1): rows 64cw..64cw+63 of the tile. Through __shfl_sync ptxas knows it is warp-uniform and
    // keeps the Q descriptor in uniform registers (no per-block rebuild + R2UR before the S group: +1-3% on the H200)
    const int cw = __shfl_sync(0xffffffffu, wg, 0) - 1;
    const int ltid = threadIdx.x & 127, warp = ltid >> 5, lane = ltid & 31, g = lane >> 2, t4 = lane & 3;
    const uint32_t sQ = sbase + S::Q_OFF + cw * S::QBYTES;
    // descriptor low words of this warpgroup's Q image and of stage 0's K and V^T images (hop_desc_lo)
    const uint32_t dq = hop_desc_lo(sQ), dk0 = hop_desc_lo(sbase + S::K_OFF), dv0 = hop_desc_lo(sbase + S::V_OFF);
    uint8_t* sQp = hsmem + S::Q_OFF + cw * S::QBYTES;
    int it = 0, tpar = 0;
    const int lrow0 = warp * 16 + g;  // this lane's rows in the warpgroup's 64: lrow0, lrow0 + 8
    constexpr int kBlk = hop_pv_n(D) / 2;  // P~V block accumulator registers (the last 4: row sums)
    // The next tile's Q rows, K mean and V scale/mean are loaded into registers before the current tile's epilogue,
    // so their latency hides under it (the prologue used to wait on them with the tensor cores idle).
    // q . mean(K) per row (K's smoothing shift) only enters the LSE: without one the prologue skips it
    constexpr bool kQShift = LSE;
    constexpr int QC = D / 4;  // Q channels per lane: the 8-channel chunks 4c + t4 (a quad reads 64 contiguous bytes)
    struct Pre { uint4 q0[QC / 8], q1[QC / 8]; float vsc, vmn, km; };  // km, vsc, vmn: channel ltid
    int ci = 0;
    auto take_tile = [&]() {  // the next work item from the producer (>= nitems: no more)
        const int r = ci % kHopTileRing;
        mbar_wait(tbar_full + 8 * r, (uint32_t)(ci / kHopTileRing) & 1u);
        const int t = tring[r];
        __syncwarp();
        if (lane == 0) mbar_arrive(tbar_empty + 8 * r);
        ++ci;
        return t;
    };
    auto prefetch = [&](int t, Pre& pf) {
        const HopTile x = hop_tile(hop_item(t, w).tile, p.B, p.Hq, w.nqb);
        const int sqx = len_q(p, x.b), r0 = x.qb * BM + cw * 64 + lrow0;
        const int64_t hk = (int64_t)x.b * p.Hkv + x.h / group;
        const T* qb = static_cast<const T*>(p.q) + x.b * p.q_sb + x.h * p.q_sh + tok0_q(p, x.b) * p.q_ss + 8 * t4;
#pragma unroll
        for (int j = 0; j < QC / 8; ++j) {
            pf.q0[j] = r0 < sqx ? *reinterpret_cast<const uint4*>(qb + (int64_t)r0 * p.q_ss + 32 * j) : make_uint4(0, 0, 0, 0);
            pf.q1[j] = r0 + 8 < sqx ? *reinterpret_cast<const uint4*>(qb + (int64_t)(r0 + 8) * p.q_ss + 32 * j)
                                    : make_uint4(0, 0, 0, 0);
        }
        pf.km = ltid < D && kQShift ? w.kmean[hk * D + ltid] : 0.f;
        pf.vsc = ltid < D ? w.vscale[hk * D + ltid] : 0.f;
        pf.vmn = ltid < D && p.smooth_v ? w.vmean[hk * D + ltid] : 0.f;
    };
    Pre pf;
    int tt = take_tile();
#if SAGE_HOP_TRACE
    int ntrace = 0;
#endif
    if (tt < w.nitems) prefetch(tt, pf);
    while (tt < w.nitems) {
        const HopItem itm = hop_item(tt, w);
        const HopTile tl = hop_tile(itm.tile, p.B, p.Hq, w.nqb);
        const int b = tl.b, h = tl.h;
        const int sq = len_q(p, b), skv = len_k(p, b), q0 = tl.qb * BM;
        const int nkb = hop_num_kv_blocks(p, q0, BM, sq, skv);
        // this item's blocks (a whole tile: 0 .. nkb - 1); the 2-consumer loop below runs whole tiles only (hop_plan)
        const int kb0 = hop_part_kb0(itm, w), kb1 = hop_part_kb1(itm, nkb, w);
        const int64_t bhq = (int64_t)b * p.Hq + h, bhk = (int64_t)b * p.Hkv + h / group;
        const int row0 = q0 + cw * 64 + lrow0, row1 = row0 + 8;
        HOP_TRACE(0, clock64());
        HOP_TRACE(6, nkb);

        // ---- Q prologue: rows row0/row1, this lane's quarter of the channels; scale per (row0, row1) pair
        float qshift0 = 0.f, qshift1 = 0.f, qs;
        float* se = reinterpret_cast<float*>(hsmem + S::EPI_OFF) + (cw * 2 + tpar) * S::EPI_FLOATS;
        {
            // per-channel values into shared memory (buffer by tile parity: the previous tile's epilogue may still
            // read the other one): V scale and mean for the epilogue, K mean for the Q shift below
            if (ltid < D) {
                se[ltid] = pf.vsc;
                se[D + ltid] = pf.vmn;
                if constexpr (kQShift) se[2 * D + ltid] = pf.km;
            }
            named_sync(1 + cw, 128);  // (also: every warp's last wgmma on the previous Q image is complete)
            float x0[QC], x1[QC];
#pragma unroll
            for (int j = 0; j < QC / 8; ++j) {
                Vec8<T>::load(reinterpret_cast<const T*>(&pf.q0[j]), x0 + 8 * j);
                Vec8<T>::load(reinterpret_cast<const T*>(&pf.q1[j]), x1 + 8 * j);
            }
            float am = 0.f;
#pragma unroll
            for (int j = 0; j < QC; ++j) {
                if constexpr (kQShift) {
                    const float m = se[2 * D + 32 * (j >> 3) + 8 * t4 + (j & 7)];
                    qshift0 = fmaf(x0[j], m, qshift0);
                    qshift1 = fmaf(x1[j], m, qshift1);
                }
                am = fmax_nan(am, fmax_nan(fabsf(x0[j]), fabsf(x1[j])));
            }
#pragma unroll
            for (int o = 1; o <= 2; o <<= 1) {
                am = fmax_nan(am, __shfl_xor_sync(0xffffffffu, am, o));
                if constexpr (kQShift) {
                    qshift0 += __shfl_xor_sync(0xffffffffu, qshift0, o);
                    qshift1 += __shfl_xor_sync(0xffffffffu, qshift1, o);
                }
            }
            // a non-finite value in the two rows: NaN scale, so every score (and the output) of both rows is NaN
            const float sc = finite_or_nan(am) / 127.f, inv = sc > 0.f ? 1.f / sc : 0.f;
            qs = sc * p.sm_scale * kLog2e;
            // the previous tile's Q reads (wgmma) are complete: every consumer waited on its last wgmma group
#pragma unroll
            for (int j = 0; j < QC; j += 8) {  // chunk 4 (j / 8) + t4: 8 channels, 8 bytes of the image
                uint32_t w0[2], w1[2];
#pragma unroll
                for (int q = 0; q < 2; ++q) {
                    const float* y0 = x0 + j + 4 * q;
                    const float* y1 = x1 + j + 4 * q;
                    w0[q] = pack_low_bytes(quant_i8_bits(y0[0], sc, inv), quant_i8_bits(y0[1], sc, inv),
                                           quant_i8_bits(y0[2], sc, inv), quant_i8_bits(y0[3], sc, inv));
                    w1[q] = pack_low_bytes(quant_i8_bits(y1[0], sc, inv), quant_i8_bits(y1[1], sc, inv),
                                           quant_i8_bits(y1[2], sc, inv), quant_i8_bits(y1[3], sc, inv));
                }
                const int col = 4 * j + 8 * t4;  // = 8 (4 (j / 8) + t4)
                *reinterpret_cast<uint2*>(sQp + hop_img_off(lrow0, col, D)) = make_uint2(w0[0], w0[1]);
                *reinterpret_cast<uint2*>(sQp + hop_img_off(lrow0 + 8, col, D)) = make_uint2(w1[0], w1[1]);
            }
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            named_sync(1 + cw, 128);
        }
        const float* sepi = se;
        tpar ^= 1;
        HOP_TRACE(1, clock64());

        const int diag = skv - sq;
        const uint8_t* mrow = p.kmask ? p.kmask + (int64_t)b * p.kmask_sb : nullptr;
        const float* ksc = w.kscale + bhk * w.nkb * 4;
        const float* vfc = w.vfac + bhk * w.nkb;  // per block: V's power-of-two factor over the base scale
        const int* kmf = mrow ? w.kmflag + (int64_t)b * w.nkb : nullptr;
        float o[D / 2];
#pragma unroll
        for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
        float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;  // l: tensor-core row sums of P~ (whole rows)
        float ls0 = 0.f, ls1 = 0.f;  // fp32 sums of 448 p over this lane's keys, for the LSE only
        const int wrow_min = q0 + cw * 64;  // first row of this warpgroup

        // masked blocks: key attended by the row (inside the sequence, not padded, not past the causal diagonal)
        auto key_ok = [&](int key, int row) {
            return key < skv && (!mrow || mrow[key] != 0) && !(p.causal && key > row + diag);
        };
        // S of block kb (int32 wgmma accumulator) -> 448 p per score (fp32, before the e4m3 conversion of pack_p)
        // and the rescale factors alpha. kscale: this thread's K scale of block kb (prefetched one block ahead)
        auto softmax_block = [&](const int (&acc)[64], int kb, float kscale, int kmasked, float (&sf)[64],
                                 float& al0, float& al1) {
            const int kbase = kb * kHopBN;
            const bool need_mask = (kbase + kHopBN > skv) || kmasked ||
                                   (p.causal && kbase + kHopBN - 1 > wrow_min + diag);
            const float sc = qs * kscale;  // one Q and one K scale per thread (>= 0); log2 domain
            // blocks without padded keys: row r attends to keys kbase + k for k < lim (sequence end, causal
            // diagonal), one compare and select per score instead of the general test with its branches
            // (computed where used: kept live across the exponentials they cost registers in the unmasked path)
            auto lim = [&](int row) { return min(skv, p.causal ? row + diag + 1 : skv) - kbase; };
#if SAGE_HOP_DIAG == 1
            // diagnostic: no softmax (one LOP per score), to time the GEMMs and the pipeline alone
            (void)need_mask; (void)sc; (void)lim;
#pragma unroll
            for (int i = 0; i < 64; ++i) sf[i] = __int_as_float((acc[i] & 0xff) | 0x3f800000);
            al0 = al1 = 1.f;
            m0 = m1 = 0.f;  // (l comes from the P~V row sums in merge)
#else
            // Row max on the int32 scores (a lane's scale is >= 0, so the order is the same), then per score one IADD
            // (int -> float bits: 1.5 * 2^23 + x, exact for |x| < 2^22), one FFMA (scale, subtract the max and the
            // 1.5 * 2^23 offset, add log2 448) and EX2. The offset folded into c costs one rounding of c, the same for
            // every score of the row in this block: a uniform factor of at most 1 + 2^-20 relative.
            constexpr int kMagic = 0x4B400000;
            constexpr float kMagicF = 12582912.f;
            int im0 = INT_MIN, im1 = INT_MIN;
            // masked blocks, for a per-row visibility test of the key 2 t4 + c within the block (prefix or general),
            // c = 8 j + e a compile-time constant (the lane's offset 2 t4 is folded into the prefix limits, so the
            // test is one compare with an immediate): the row max over visible scores (hidden ones as INT_MIN, the
            // chain runs through the max only), and zeros for the hidden ones after the exponentials
            auto masked_max = [&](auto vis0, auto vis1) {
#pragma unroll
                for (int j = 0; j < 16; ++j)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int c = 8 * j + e;
                        im0 = max(im0, vis0(c) ? acc[4 * j + e] : INT_MIN);
                        im1 = max(im1, vis1(c) ? acc[4 * j + 2 + e] : INT_MIN);
                    }
            };
            auto zero_hidden = [&](auto vis0, auto vis1) {
#pragma unroll
                for (int j = 0; j < 16; ++j)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int c = 8 * j + e;
                        if (!vis0(c)) sf[4 * j + e] = 0.f;
                        if (!vis1(c)) sf[4 * j + 2 + e] = 0.f;
                    }
            };
            auto general0 = [&](int c) { return key_ok(kbase + 2 * t4 + c, row0); };
            auto general1 = [&](int c) { return key_ok(kbase + 2 * t4 + c, row1); };
            if (!need_mask) {
#pragma unroll
                for (int j = 0; j < 16; ++j) {
                    im0 = max(im0, max(acc[4 * j], acc[4 * j + 1]));
                    im1 = max(im1, max(acc[4 * j + 2], acc[4 * j + 3]));
                }
            } else if (!kmasked) {  // sequence end / causal diagonal: a row's keys are a prefix of the block
                const int l0 = lim(row0) - 2 * t4, l1 = lim(row1) - 2 * t4;
                masked_max([&](int c) { return c < l0; }, [&](int c) { return c < l1; });
            } else {
                masked_max(general0, general1);
            }
            // the 4 lanes of a row hold different K scale groups: compare them as scaled floats
            float mx0 = im0 == INT_MIN ? -INFINITY : (float)im0 * sc;
            float mx1 = im1 == INT_MIN ? -INFINITY : (float)im1 * sc;
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
            mx0 = fmaxf(m0, fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2)));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
            mx1 = fmaxf(m1, fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2)));
            const float mu0 = mx0 == -INFINITY ? 0.f : mx0;
            const float mu1 = mx1 == -INFINITY ? 0.f : mx1;
            al0 = fast_exp2(m0 - mu0);
            al1 = fast_exp2(m1 - mu1);
            m0 = mx0; m1 = mx1;
            const float c0 = fmaf(kMagicF, sc, mu0 - kLog2Fp8Max), c1 = fmaf(kMagicF, sc, mu1 - kLog2Fp8Max);
            auto arg = [&](int i, float c) { return fmaf(__int_as_float(acc[i] + kMagic), sc, -c); };
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                sf[4 * j] = fast_exp2(arg(4 * j, c0));
                sf[4 * j + 1] = fast_exp2(arg(4 * j + 1, c0));
                sf[4 * j + 2] = fast_exp2(arg(4 * j + 2, c1));
                sf[4 * j + 3] = fast_exp2(arg(4 * j + 3, c1));
            }
            if (need_mask && !kmasked) {
                const int l0 = lim(row0) - 2 * t4, l1 = lim(row1) - 2 * t4;
                zero_hidden([&](int c) { return c < l0; }, [&](int c) { return c < l1; });
            } else if (need_mask) {
                zero_hidden(general0, general1);
            }
            // the output is normalised by the tensor cores' row sums (merge); the LSE keeps fp32 sums of p (the FP8
            // accumulator keeps ~13 bits: its sums run up to ~1% low, which cancels in the output, not in the LSE)
            if constexpr (!LSE) return;
            float rs0 = 0.f, rs1 = 0.f;
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                rs0 += sf[4 * j] + sf[4 * j + 1];
                rs1 += sf[4 * j + 2] + sf[4 * j + 3];
            }
            ls0 = ls0 * al0 + rs0;
            ls1 = ls1 * al1 + rs1;
#endif
        };
        auto pack_p = [&](const float (&sf)[64], uint32_t (&pa)[4][4]) {
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {  // slots follow V^T's permuted key order
                const float* q = sf + 16 * kk;
                pa[kk][0] = cvt_e4m3x2(q[0], q[1]) | (cvt_e4m3x2(q[4], q[5]) << 16);
                pa[kk][1] = cvt_e4m3x2(q[2], q[3]) | (cvt_e4m3x2(q[6], q[7]) << 16);
                pa[kk][2] = cvt_e4m3x2(q[8], q[9]) | (cvt_e4m3x2(q[12], q[13]) << 16);
                pa[kk][3] = cvt_e4m3x2(q[10], q[11]) | (cvt_e4m3x2(q[14], q[15]) << 16);
            }
        };
        auto issue_qk = [&](int (&acc)[64], int s) {
            const uint32_t dk = dk0 + (uint32_t)s * (S::KBYTES >> 4);
            wgmma_s8_n128<false>(acc, hop_desc_make(dq, hop_desc_hi(D)), hop_desc_make(dk, hop_desc_hi(D)));
#pragma unroll
            for (int k = 1; k < D / 32; ++k)
                wgmma_s8_n128<true>(acc, hop_desc_make(dq + hop_desc_step(32 * k), hop_desc_hi(D)),
                                    hop_desc_make(dk + hop_desc_step(32 * k), hop_desc_hi(D)));
            wg_commit();
        };
        // two-level accumulation: each block's P~V lands in its own accumulator (blk), then O = O * alpha + blk.
        // V~ of block kb is V / (base vfac_kb): O and l are kept divided by the current block's vfac (the softmax's
        // alpha times vfac_prev / vfac_kb, exact powers of two, and the block's row sums times 1 / vfac_kb), so O / l
        // needs no factor at the end.
        auto issue_pv = [&](float (&blk)[kBlk], uint32_t (&pa)[4][4], int s) {
            const uint32_t dv = dv0 + (uint32_t)s * (S::VSTRIDE >> 4);
#if SAGE_HOP_DIAG != 2
            wgmma_pv<D, false>(blk, pa[0], hop_desc_make(dv, hop_desc_hi(kHopBN)));
#pragma unroll
            for (int kk = 1; kk < 4; ++kk)
                wgmma_pv<D, true>(blk, pa[kk], hop_desc_make(dv + hop_desc_step(32 * kk), hop_desc_hi(kHopBN)));
#else
            (void)dv;
#endif
            wg_commit();
        };
        // o's n8 column chunks off.. off + nch - 1 = o * alpha + the block accumulator's chunks 0.. (rows row0 / row1)
        auto fold = [&](const float* b, int off, int nch, float al0, float al1) {
#pragma unroll
            for (int i = 0; i < nch; ++i) {
                o[4 * (off + i)] = o[4 * (off + i)] * al0 + b[4 * i];
                o[4 * (off + i) + 1] = o[4 * (off + i) + 1] * al0 + b[4 * i + 1];
                o[4 * (off + i) + 2] = o[4 * (off + i) + 2] * al1 + b[4 * i + 2];
                o[4 * (off + i) + 3] = o[4 * (off + i) + 3] * al1 + b[4 * i + 3];
            }
        };
        auto merge = [&](const float (&blk)[kBlk], float al0, float al1, float vinv) {
            l0 = l0 * al0 + blk[D / 2] * vinv;  // the block's row sums: columns D.. (row0: blk[D/2], row1: blk[D/2 + 2])
            l1 = l1 * al1 + blk[D / 2 + 2] * vinv;
            fold(blk, 0, D / 8, al0, al1);
        };
        auto stage_of = [&](int i, uint32_t& ph) { ph = (uint32_t)(i / kHopStages) & 1u; return i % kHopStages; };
        // powers of two as bits: a / b and 1 / b for a, b in [1, 2^64] (one integer add each)
        auto pow2_div = [](float a, float b) { return __int_as_float(__float_as_int(a) - __float_as_int(b) + 0x3f800000); };
        auto pow2_inv = [](float b) { return __int_as_float(0x7f000000 - __float_as_int(b)); };
        float vfac_prev = 1.f;

        // Software pipeline inside the warpgroup: S(kb) = Q K(kb)^T is issued together with P~(kb-1) V(kb-1), and the
        // softmax of S(kb) runs while the tensor cores still work on P~V. (Ping-pong turns between the two consumers,
        // measured in sessions 5, 7 and 9 in several forms, were equal or slower: removed, see HOPPER.md.)
        if constexpr (NWG != 2) {
            // serial blocks: S(kb), softmax, P~V(kb), merge. While one warpgroup runs its softmax the other two
            // keep the tensor cores busy; no wgmma of its own is in flight during its ALU work (which would slow it)
            float kscale_next = kb1 > kb0 ? ksc[kb0 * 4 + t4] : 0.f;
            float vfac_next = kb1 > kb0 ? vfc[kb0] : 1.f;
            int kmask_next = kmf && kb1 > kb0 ? kmf[kb0] : 0;
            // causal: the tile's last blocks may lie wholly past this warpgroup's diagonal (nkb_own <= kb < nkb);
            // a warpgroup whose rows all lie past the sequence's end (the last tile) computes nothing
            const int nkb_own = wrow_min < sq ? hop_num_kv_blocks(p, wrow_min, 64, sq, skv) : 0;
            const int kend = min(nkb_own, kb1);
            int kb = kb0;
            for (; kb < kend; ++kb, ++it) {
                uint32_t ph;
                const int s = stage_of(it, ph);
                const float kscale_cur = kscale_next, vfac_cur = vfac_next;
                const int kmask_cur = kmask_next;
                if (kb + 1 < kb1) {  // in flight during this block
                    kscale_next = ksc[(kb + 1) * 4 + t4];
                    vfac_next = vfc[kb + 1];
                    if (kmf) kmask_next = kmf[kb + 1];
                }
                int acc[64];
                uint32_t pa[4][4];
                float al0, al1;
                HOP_LTRACE(kb, 0);
                mbar_wait(bar_full + 8 * s, ph);
                HOP_LTRACE(kb, 1);
                wg_fence();
                issue_qk(acc, s);
                wg_wait<0>();
                HOP_LTRACE(kb, 2);
                reg_fence(acc);
                {
                    float sf[64];
                    softmax_block(acc, kb, kscale_cur, kmask_cur, sf, al0, al1);
                    pack_p(sf, pa);
                }
                {
                    const float r = pow2_div(vfac_prev, vfac_cur);
                    al0 *= r;
                    al1 *= r;
                    vfac_prev = vfac_cur;
                }
                HOP_LFENCE(pa);
                HOP_LTRACE(kb, 3);
                const uint32_t dv = dv0 + (uint32_t)s * (S::VSTRIDE >> 4);
                if constexpr (D == 128) {
                    // P~V in two column halves: 32 + 36 accumulator registers (all 68 live at once do not fit)
                    float ba[32], bb[36];
                    const uint32_t dvb = dv + ((64 * kHopBN) >> 4);  // V^T rows 64.. (rows of kHopBN bytes)
                    // one half: m64n64 into ba (V^T rows from dv) or m64n72 into bb (rows from dvb)
                    auto issue_half = [&](auto& acc, uint32_t dvh) {
                        constexpr bool kA = sizeof(acc) == sizeof(ba);
                        auto mma = [&](auto first, int kk) {
                            const uint64_t db = hop_desc_make(dvh + hop_desc_step(32 * kk), hop_desc_hi(kHopBN));
                            if constexpr (kA) wgmma_pv64<!decltype(first)::value>(acc, pa[kk], db);
                            else wgmma_pv72<!decltype(first)::value>(acc, pa[kk], db);
                        };
                        wg_fence();
#if SAGE_HOP_DIAG == 2
                        for (auto& x : acc) x = 0.f;
                        return;
#endif
                        mma(std::true_type{}, 0);
#pragma unroll
                        for (int kk = 1; kk < 4; ++kk) mma(std::false_type{}, kk);
                        wg_commit();
                    };
                    auto issue_a = [&]() { issue_half(ba, dv); };
                    auto issue_b = [&]() { issue_half(bb, dvb); };
                    auto merge_a = [&]() { fold(ba, 0, 8, al0, al1); };
                    auto merge_b = [&]() {
                        const float vinv = pow2_inv(vfac_prev);
                        l0 = l0 * al0 + bb[32] * vinv;
                        l1 = l1 * al1 + bb[34] * vinv;
                        fold(bb, 8, 8, al0, al1);
                    };
                    // one half after the other (both in flight, or the second issued before the first merge:
                    // 1-2% slower, they spill)
                    issue_a();
                    wg_wait<0>();
                    HOP_LTRACE(kb, 4);
                    reg_fence(ba);
                    merge_a();
                    issue_b();
                    wg_wait<0>();
                    HOP_LTRACE(kb, 5);
                    reg_fence(bb);
                    reg_fence(pa);
                    if (lane == 0) mbar_arrive(bar_empty + 8 * s);
                    merge_b();
                    HOP_LFENCE(o);
                    HOP_LTRACE(kb, 6);
                } else {
                    float blk[kBlk];
                    wg_fence();
                    issue_pv(blk, pa, s);
                    wg_wait<0>();
                    reg_fence(blk);
                    reg_fence(pa);
                    if (lane == 0) mbar_arrive(bar_empty + 8 * s);
                    merge(blk, al0, al1, pow2_inv(vfac_prev));
                }
            }
            // blocks past the diagonal: only released, after they landed (an early arrival would count towards the
            // stage's previous use). A separate loop keeps the main loop's code as it is without causal masks.
            for (; kb < kb1; ++kb, ++it) {
                uint32_t ph;
                const int s = stage_of(it, ph);
                mbar_wait(bar_full + 8 * s, ph);
                __syncwarp();
                if (lane == 0) mbar_arrive(bar_empty + 8 * s);
            }
        } else if (nkb > 0) {
            int acc[64];
            uint32_t pa[4][4];
            float blk[kBlk];
#if SAGE_HOP_DIAG == 2
#pragma unroll
            for (int i = 0; i < kBlk; ++i) blk[i] = 0.f;
#endif
            float al0, al1;
            uint32_t ph;
            int s = stage_of(it, ph);
            float kscale_cur = ksc[t4];
            float kscale_next = nkb > 1 ? ksc[4 + t4] : 0.f;
            float vfac_next = nkb > 1 ? vfc[1] : 1.f;
            vfac_prev = vfc[0];  // O is 0 before block 0: no rescale
            int kmask_cur = kmf ? kmf[0] : 0;
            int kmask_next = kmf && nkb > 1 ? kmf[1] : 0;
            mbar_wait(bar_full + 8 * s, ph);
            wg_fence();
            issue_qk(acc, s);
            wg_wait<0>();
            reg_fence(acc);
            {
                float sf[64];
                softmax_block(acc, 0, kscale_cur, kmask_cur, sf, al0, al1);
                pack_p(sf, pa);
            }
            HOP_TRACE(2, clock64());
            for (int kb = 1; kb < nkb; ++kb) {
                uint32_t phn;
                const int sn = stage_of(it + 1, phn);
                kscale_cur = kscale_next;
                kmask_cur = kmask_next;
                const float vfac_cur = vfac_next;
                if (kb + 1 < nkb) {  // in flight during this block
                    kscale_next = ksc[(kb + 1) * 4 + t4];
                    vfac_next = vfc[kb + 1];
                    if (kmf) kmask_next = kmf[kb + 1];
                }
                HOP_LTRACE(kb, 0);
                mbar_wait(bar_full + 8 * sn, phn);
                HOP_LTRACE(kb, 1);
                wg_fence();
                issue_qk(acc, sn);
                issue_pv(blk, pa, s);
                HOP_LTRACE(kb, 2);
                wg_wait<1>();  // S(kb) is ready; P~V(kb-1) may still run
                reg_fence(acc);
                HOP_LTRACE(kb, 3);
                float sf[64];
                float bl0, bl1;
                softmax_block(acc, kb, kscale_cur, kmask_cur, sf, bl0, bl1);
                HOP_LFENCE(sf);
                HOP_LTRACE(kb, 4);
                wg_wait<0>();
                reg_fence(blk);
                reg_fence(pa);
                HOP_LTRACE(kb, 5);
                if (lane == 0) mbar_arrive(bar_empty + 8 * s);
                merge(blk, al0, al1, pow2_inv(vfac_prev));
                pack_p(sf, pa);  // P~(kb-1)'s registers are rewritten only once its wgmma is complete
                HOP_LTRACE(kb, 6);
                const float r = pow2_div(vfac_prev, vfac_cur);
                vfac_prev = vfac_cur;
                al0 = bl0 * r; al1 = bl1 * r;
                s = sn; ++it;
            }
            wg_fence();
            issue_pv(blk, pa, s);
            wg_wait<0>();
            reg_fence(blk);
            reg_fence(pa);
            if (lane == 0) mbar_arrive(bar_empty + 8 * s);
            merge(blk, al0, al1, pow2_inv(vfac_prev));
            ++it;
        }

        // ---- split tail: a part's rows as normalised partial output + log2 row sum; the last part to arrive
        // combines all parts (in part order: deterministic) into o, l and stores below; the others store nothing
        bool skip = false;
        const HopItem sit = hop_item(tt, w);  // again: kept live across the loop it costs D=64 registers
        if (!LSE && sit.split >= 0) {  // (hop_plan splits no LSE call)
            constexpr int kSlot = (D / 8 + 1) * 128;  // float4 per (part, consumer): D/8 per thread + the sums
            const int64_t pstride = (int64_t)NWG * kSlot;
            float4* mine = w.part + ((int64_t)sit.split * w.parts * NWG + cw) * kSlot + ltid;
            {
                const float i0 = l0 != 0.f ? 1.f / l0 : 0.f, i1 = l1 != 0.f ? 1.f / l1 : 0.f;  // NaN l stays NaN
                float4* dst = mine + sit.part * pstride;
#pragma unroll
                for (int i = 0; i < D / 8; ++i)
                    dst[i * 128] = make_float4(o[4 * i] * i0, o[4 * i + 1] * i0, o[4 * i + 2] * i1, o[4 * i + 3] * i1);
                // l is kept divided by the last block's vfac: the row's sum of 2^(score - m) is l vfac / 448
                dst[(D / 8) * 128] = make_float4(l0 != 0.f ? m0 + log2f(l0 * vfac_prev) : -INFINITY,
                                                 l1 != 0.f ? m1 + log2f(l1 * vfac_prev) : -INFINITY, 0.f, 0.f);
            }
            __threadfence();  // the partial is visible before the arrival is counted
            named_sync(1 + cw, 128);
            volatile int* flag = reinterpret_cast<volatile int*>(hsmem + S::FLAG_OFF) + cw;
            if (ltid == 0) *flag = atomicAdd(w.splitctr + sit.split * NWG + cw, 1);
            named_sync(1 + cw, 128);
            skip = *flag != w.parts - 1;
            if (!skip) {
                __threadfence();
                float mx0 = -INFINITY, mx1 = -INFINITY;
                for (int q = 0; q < w.parts; ++q) {
                    const float4 lq = __ldcg(mine + q * pstride + (D / 8) * 128);
                    mx0 = fmaxf(mx0, lq.x);
                    mx1 = fmaxf(mx1, lq.y);
                }
                const float mu0 = mx0 == -INFINITY ? 0.f : mx0, mu1 = mx1 == -INFINITY ? 0.f : mx1;
#pragma unroll
                for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
                l0 = 0.f;
                l1 = 0.f;
                for (int q = 0; q < w.parts; ++q) {
                    const float4* src = mine + q * pstride;
                    const float4 lq = __ldcg(src + (D / 8) * 128);
                    // 0 for a part without keys; NaN for a NaN part (fmaxf above skipped it: mu is another's)
                    const float a0 = exp2f(lq.x - mu0), a1 = exp2f(lq.y - mu1);
                    l0 += a0;
                    l1 += a1;
#pragma unroll
                    for (int i = 0; i < D / 8; ++i) {
                        const float4 y = __ldcg(src + i * 128);
                        o[4 * i] = fmaf(a0, y.x, o[4 * i]);
                        o[4 * i + 1] = fmaf(a0, y.y, o[4 * i + 1]);
                        o[4 * i + 2] = fmaf(a1, y.z, o[4 * i + 2]);
                        o[4 * i + 3] = fmaf(a1, y.w, o[4 * i + 3]);
                    }
                }
            }
        }

        HOP_TRACE(3, clock64());
        const int tnext = take_tile();
        // in flight during the epilogue; unconditional (the current tile again after the last one) so that the
        // compiler sees pf redefined every iteration and does not keep it alive across the main loop
        prefetch(tnext < w.nitems ? tnext : tt, pf);

        // ---- epilogue

        // empty row (no visible key): l == 0 exactly; a NaN l (non-finite input) must not pass as empty
        const float inv0 = l0 != 0.f ? 1.f / l0 : 0.f, inv1 = l1 != 0.f ? 1.f / l1 : 0.f;
        T* O = static_cast<T*>(p.o) + b * p.o_sb + h * p.o_sh + tok0_q(p, b) * p.o_ss;
        T* O0 = O + (int64_t)row0 * p.o_ss + 8 * t4;
        T* O1 = O + (int64_t)row1 * p.o_ss + 8 * t4;
        const bool st0 = row0 < sq && !skip, st1 = row1 < sq && !skip;
        // smooth V: + mean(V) on rows that attended to something (the staged mean is 0 without smooth V)
        const float f0 = l0 != 0.f ? 1.f : 0.f, f1 = l1 != 0.f ? 1.f : 0.f;
#pragma unroll
        for (int c = 0; c < D / 32; ++c) {  // o[4i ..] with i = 4c + q holds channels 32c + 8 t4 + 2q, + 1 (hop_vcol)
            uint32_t r0[4], r1[4];
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int i = 4 * c + q, ch = 32 * c + 8 * t4 + 2 * q;
                const float2 vv = *reinterpret_cast<const float2*>(sepi + ch);
                const float2 mv = *reinterpret_cast<const float2*>(sepi + D + ch);
                r0[q] = pack2<T>(fmaf(mv.x, f0, o[4 * i] * inv0 * vv.x), fmaf(mv.y, f0, o[4 * i + 1] * inv0 * vv.y));
                r1[q] = pack2<T>(fmaf(mv.x, f1, o[4 * i + 2] * inv1 * vv.x), fmaf(mv.y, f1, o[4 * i + 3] * inv1 * vv.y));
            }
            if (st0) *reinterpret_cast<uint4*>(O0 + 32 * c) = make_uint4(r0[0], r0[1], r0[2], r0[3]);
            if (st1) *reinterpret_cast<uint4*>(O1 + 32 * c) = make_uint4(r1[0], r1[1], r1[2], r1[3]);
        }
        if constexpr (LSE) {
            ls0 += __shfl_xor_sync(0xffffffffu, ls0, 1);
            ls0 += __shfl_xor_sync(0xffffffffu, ls0, 2);
            ls1 += __shfl_xor_sync(0xffffffffu, ls1, 1);
            ls1 += __shfl_xor_sync(0xffffffffu, ls1, 2);
        }
        if (LSE && t4 == 0 && !skip) {
            float* L = p.cu_seqlens_q ? p.lse + h * p.lse_sh + tok0_q(p, b) : p.lse + bhq * p.Sq;
            const float ss = p.sm_scale;
            if (row0 < sq) L[row0] = ls0 != 0.f ? m0 * kLn2 + (logf(ls0) - kLnFp8Max) + qshift0 * ss : -INFINITY;
            if (row1 < sq) L[row1] = ls1 != 0.f ? m1 * kLn2 + (logf(ls1) - kLnFp8Max) + qshift1 * ss : -INFINITY;
        }
        HOP_TRACE(4, clock64());

#if SAGE_HOP_TRACE
        ++ntrace;
#endif
        tt = tnext;
    }
#else
    (void)p; (void)w;
#endif
}

// ------------------------------------------------------------------------------------------------------------------
// FP8 wgmma probe (diagnostics, issue 4: accumulator width; also checks the operand layouts end to end):
// D (64 x 16, fp32) = sum over `steps` chained m64n16k32 e4m3 wgmmas of A (64 x 32*steps, registers) . B^T
// (B: 16 x 32*steps, smem image). a, b: row-major e4m3 bytes in device memory; d: 64 x 16 fp32.
// Mode 1: Q K^T style int8 (A from smem), D = int32 converted to float.
__global__ void __launch_bounds__(128) hopper_probe_kernel(const uint8_t* a, const uint8_t* bm, float* dout, int steps,
                                                           int mode) {
#if SAGE_HOP_DEVICE
    __shared__ __align__(128) uint8_t sa[64 * 32], sb[16 * 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t4 = lane & 3;
    const int K = 32 * steps;
    float d[8];
    int di[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) { d[i] = 0.f; di[i] = 0; }
    for (int st = 0; st < steps; ++st) {
        for (int i = threadIdx.x; i < 16 * 32; i += 128) sb[hop_img_off_plain(i / 32, i % 32, 32)] = bm[(i / 32) * K + 32 * st + i % 32];
        for (int i = threadIdx.x; i < 64 * 32; i += 128) sa[hop_img_off_plain(i / 32, i % 32, 32)] = a[(i / 32) * K + 32 * st + i % 32];
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        const uint64_t db = hop_desc_plain(smem_u32(sb), 2 * 128);
        wg_fence();
        if (mode == 0) {
            uint32_t af[4];
            const int r = 16 * warp + g;
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int row = r + 8 * (q & 1), col = 32 * st + 4 * t4 + 16 * (q >> 1);
                af[q] = *reinterpret_cast<const uint32_t*>(a + row * K + col);
            }
            asm volatile(
                "{\n .reg .pred p;\n setp.ne.b32 p, %13, 0;\n"
                "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7}, "
                "{%8, %9, %10, %11}, %12, p, 1, 1;\n}\n"
                : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
                : "r"(af[0]), "r"(af[1]), "r"(af[2]), "r"(af[3]), "l"(db), "r"(st));
        } else {
            const uint64_t da = hop_desc_plain(smem_u32(sa), 2 * 128);
            asm volatile(
                "{\n .reg .pred p;\n setp.ne.b32 p, %10, 0;\n"
                "wgmma.mma_async.sync.aligned.m64n16k32.s32.s8.s8 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p;\n}\n"
                : "+r"(di[0]), "+r"(di[1]), "+r"(di[2]), "+r"(di[3]), "+r"(di[4]), "+r"(di[5]), "+r"(di[6]), "+r"(di[7])
                : "l"(da), "l"(db), "r"(st));
        }
        wg_commit();
        wg_wait<0>();
        reg_fence(d);
        reg_fence(di);
        __syncthreads();
    }
    const int r = 16 * warp + g;
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int row = r + 8 * (e >> 1), col = 8 * j + 2 * t4 + (e & 1);
            dout[row * 16 + col] = mode == 0 ? d[4 * j + e] : (float)di[4 * j + e];
        }
#else
    (void)a; (void)bm; (void)dout; (void)steps; (void)mode;
#endif
}

// ------------------------------------------------------------------------------------------------------------------
// host side
inline bool hop_compiled() {
    static const bool yes = [] {
        const char* a = SAGE_ARCHS;
        for (const char* s = a; *s; ++s)
            if (s[0] == '9' && s[1] == '0' && s[2] == 'a') return true;
        return false;
    }();
    return yes;
}

// whether the Hopper kernel serves these parameters (else the portable kernel does)
inline bool hop_supported(const SageAttnParams& p) {
    // the epilogue stores 16 bytes per lane: O rows 16-byte aligned (as the Python side allocates them)
    const bool o16 = reinterpret_cast<uintptr_t>(p.o) % 16 == 0 && p.o_ss % 8 == 0 && p.o_sh % 8 == 0 &&
                     p.o_sb % 8 == 0;
    return p.device_cc == 90 && hop_compiled() && (p.D == 64 || p.D == 128) && p.qk_bits != 4 && o16;
}

#ifndef SAGE_HOP_PDL
#define SAGE_HOP_PDL 1
#endif
// a launch that may overlap the end of the previous kernel in the stream (programmatic dependent launch: the
// kernel's pdl_wait() holds it before any global memory access); SAGE_HOP_PDL=0: a plain stream-ordered launch
template <typename... Params, typename... Args>
cudaError_t hop_launch_pdl(void (*kern)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t st,
                           Args... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = SAGE_HOP_PDL;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    return cudaLaunchKernelEx(&cfg, kern, args...);
}

template <int D, typename T>
int hop_launch(const SageAttnParams& p, cudaStream_t st) {
    const HopLayout L = make_hop_layout(p);
    uint8_t* ws = static_cast<uint8_t*>(p.workspace);
    int8_t* kimg = reinterpret_cast<int8_t*>(ws + L.kimg);
    float* kscale = reinterpret_cast<float*>(ws + L.kscale);
    uint8_t* vimg = ws + L.vimg;
    float* vscale = reinterpret_cast<float*>(ws + L.vscale);
    float* vfac = reinterpret_cast<float*>(ws + L.vfac);
    float* kmean = reinterpret_cast<float*>(ws + L.kmean);
    float* vmean = reinterpret_cast<float*>(ws + L.vmean);
    const int bhk = p.B * p.Hkv, nkb = (int)L.nkb;
    // the first kernel follows whatever the caller ran before: a plain launch; the next two with PDL
    hopper_sample_stats_kernel<D, T><<<bhk, kHopStatThreads, 0, st>>>(p, kmean, vscale, vmean,
                                                                       reinterpret_cast<int*>(ws + L.tilectr), L.nzero);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return (int)e;
    int* kmflag = reinterpret_cast<int*>(ws + L.kmflag);
    e = hop_launch_pdl(hopper_quant_kv_kernel<D, T>, dim3(nkb, p.Hkv, p.B), dim3(hop_kv_threads(D)), 0, st, p,
                       (const float*)kmean, (const float*)vscale, (const float*)vmean, kimg, kscale, vimg, vfac,
                       kmflag, nkb);
    if (e != cudaSuccess) return (int)e;

    constexpr int NWG = hop_nwg(D);
    using S = HopSmem<D, NWG>;
    const bool lse = p.lse != nullptr;
    auto kern = lse ? hopper_attn_kernel<D, T, true, NWG> : hopper_attn_kernel<D, T, false, NWG>;
    const int dev = p.device;
    {
        static bool done[2][64] = {};
        if (dev < 0 || dev >= 64 || !done[lse][dev]) {
            e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, S::TOTAL);
            if (e != cudaSuccess) return (int)e;
            if (dev >= 0 && dev < 64) done[lse][dev] = true;
        }
    }
    HopWs w;
    w.kmflag = kmflag;
    w.kimg = kimg; w.kscale = kscale; w.vimg = vimg; w.vscale = vscale; w.vfac = vfac; w.kmean = kmean; w.vmean = vmean;
    w.tilectr = reinterpret_cast<int*>(ws + L.tilectr);
    w.nkb = nkb;
    const HopPlan P = hop_plan(p);  // the same plan as the workspace layout's
    w.nqb = P.nqb;
    w.splitctr = w.tilectr + 1;
    w.part = reinterpret_cast<float4*>(ws + L.part);
    w.nitems = P.nitems;
    w.nfull = P.ntiles - P.nsplit;
    w.parts = P.parts;
    w.pmul = P.parts > 1 ? (uint32_t)((0x100000000ull + P.parts - 1) / P.parts) : 0u;  // exact for u < 2^30
    for (int j = 0; j <= kHopMaxParts; ++j) w.pkb[j] = j <= P.parts ? (int)((int64_t)j * nkb / P.parts) : nkb;
    const int nsm = hop_num_sms(dev), grid = w.nitems < nsm ? w.nitems : nsm;
    return (int)hop_launch_pdl(kern, dim3(grid), dim3(hop_threads(NWG)), S::TOTAL, st, p, w);
}

template <typename T>
int hop_dispatch(const SageAttnParams& p, cudaStream_t st) {
    if (p.D == 64) return hop_launch<64, T>(p, st);
    return hop_launch<128, T>(p, st);
}

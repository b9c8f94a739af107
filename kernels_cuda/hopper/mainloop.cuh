// Hopper path: the mainloop. The CTA's shared memory and barriers (HopCta: the K/V stage ring and the tile ring), the
// producer warpgroup (one thread streaming K and V^T block images into the stage ring, handing work items to the
// consumers), and the consumer's pieces: taking work items, prefetching the next tile's Q rows and per-channel
// values, issuing S = Q K^T and P~V, and the two-level accumulation (small functor structs bound to the consumer's
// registers: the same code the compiler saw when they were lambdas, tools/sass_diff.py).
#pragma once
#include "pipeline.cuh"
#include "softmax.cuh"
#include "tile_scheduler.cuh"

namespace sage {

// the CTA's shared memory (1024-byte aligned) and the mbarrier addresses of the stage ring and the tile ring
template <int D, int NWG>
struct HopCta {
    using S = HopSmem<D, NWG>;
    uint8_t* smem;
    uint32_t sbase, bar_full, bar_empty, tbar_full, tbar_empty;
    volatile int* tring;  // the tile ring's work items
};

template <int D, int NWG>
__device__ __forceinline__ HopCta<D, NWG> hop_cta_init(uint8_t* hsmem_raw) {
    using S = HopSmem<D, NWG>;
    HopCta<D, NWG> c;
    // swizzled operand images need 1024-byte aligned atoms: align the base ourselves
    const uint32_t spad = (1024u - (smem_u32(hsmem_raw) & 1023u)) & 1023u;
    c.smem = hsmem_raw + spad;
    c.sbase = smem_u32(c.smem);
    c.bar_full = c.sbase + S::BAR_OFF;
    c.bar_empty = c.bar_full + 8 * S::NST;
    c.tbar_full = c.sbase + S::TBAR_OFF;
    c.tbar_empty = c.tbar_full + 8 * kHopTileRing;
    c.tring = reinterpret_cast<volatile int*>(c.smem + S::TILE_OFF);
    if (threadIdx.x == 0) {
        for (int s = 0; s < S::NST; ++s) {
            mbar_init(c.bar_full + 8 * s, 1);
            mbar_init(c.bar_empty + 8 * s, 4 * NWG);  // one arrival per consumer warp
        }
        for (int r = 0; r < kHopTileRing; ++r) {
            mbar_init(c.tbar_full + 8 * r, 1);
            mbar_init(c.tbar_empty + 8 * r, 4 * NWG);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    {  // e4m3 1.0 = 0x38 in the rows below every V^T stage (the bulk copies never touch them)
        for (int i = threadIdx.x; i < S::NST * S::ONES / 4; i += hop_threads(NWG)) {
            const int st = i / (S::ONES / 4), wd = i % (S::ONES / 4);
            *reinterpret_cast<uint32_t*>(c.smem + S::V_OFF + st * S::VSTRIDE + S::VBYTES + 4 * wd) = 0x38383838u;
        }
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // visible to wgmma (async proxy)
    }
    __syncthreads();
    return c;
}

// the producer's side of the tile ring: hand work item t (>= nitems: no more) to the consumers
template <int D, int NWG>
__device__ __forceinline__ void hop_publish(const HopCta<D, NWG>& c, int& ti, int t) {
    const int r = ti % kHopTileRing;
    mbar_wait(c.tbar_empty + 8 * r, ((uint32_t)(ti / kHopTileRing) & 1u) ^ 1u);
    c.tring[r] = t;
    mbar_arrive(c.tbar_full + 8 * r);
    ++ti;
}

// warpgroup 0: one thread takes work items (the next from a global counter, in flight while this one's loads
// issue), publishes them and streams their K and V^T block images into the stage ring with bulk copies
template <int D, int NWG>
__device__ __forceinline__ void hop_producer(const SageAttnParams& p, const HopWs& w, const HopCta<D, NWG>& c,
                                             int group) {
    using S = HopSmem<D, NWG>;
    constexpr int BM = hop_bm(NWG);
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
    if (threadIdx.x != 0) return;
    int it = 0, ti = 0;
    for (int t = blockIdx.x; t < w.nitems;) {
        const int tn = (int)gridDim.x + atomicAdd(w.tilectr, 1);  // in flight while this tile's loads issue
        const HopItem itm = hop_item(t, w);
        const HopTile tl = hop_tile(itm.tile, p.B, p.Hq, w.nqb);
        const int sq = len_q(p, tl.b), skv = len_k(p, tl.b), q0 = tl.qb * BM;
        if (q0 >= sq) { t = tn; continue; }  // varlen: past this sequence's end
        hop_publish(c, ti, t);
        const int nkb = hop_num_kv_blocks(p, q0, BM, sq, skv);
        const int64_t blk0 = ((int64_t)tl.b * p.Hkv + tl.h / group) * w.nkb;
        const int kb1 = hop_part_kb1(itm, nkb, w);
        for (int kb = hop_part_kb0(itm, w, p, q0, sq, skv); kb < kb1; ++kb, ++it) {
            const int s = it % S::NST;
            const uint32_t ph = (uint32_t)(it / S::NST) & 1u;
            mbar_wait(c.bar_empty + 8 * s, ph ^ 1u);
            mbar_expect_tx(c.bar_full + 8 * s, S::KBYTES + S::VBYTES);
            bulk_g2s(c.sbase + S::K_OFF + s * S::KBYTES, w.kimg + (blk0 + kb) * S::KBYTES, S::KBYTES, c.bar_full + 8 * s);
            bulk_g2s(c.sbase + S::V_OFF + s * S::VSTRIDE, w.vimg + (blk0 + kb) * S::VBYTES, S::VBYTES, c.bar_full + 8 * s);
        }
        t = tn;
    }
    hop_publish(c, ti, w.nitems);
}

// ---- consumer pieces

// the consumers' side of the tile ring: the next work item from the producer (>= nitems: no more)
struct HopTakeTile {  // the next work item from the producer (>= nitems: no more)
    int& ci;
    const uint32_t& tbar_full;
    volatile int* const& tring;
    const int& lane;
    const uint32_t& tbar_empty;
    __device__ __forceinline__ int operator()() const {
        const int r = ci % kHopTileRing;
        mbar_wait(tbar_full + 8 * r, (uint32_t)(ci / kHopTileRing) & 1u);
        const int t = tring[r];
        __syncwarp();
        if (lane == 0) mbar_arrive(tbar_empty + 8 * r);
        ++ci;
        return t;
    }
};

// The next tile's Q rows, K mean and V scale/mean, loaded into registers before the current tile's epilogue so
// their latency hides under it (the prologue used to wait on them with the tensor cores idle): per lane rows lrow0,
// lrow0 + 8, the 8-channel chunks 4c + t4 (a quad reads 64 contiguous bytes); km, vsc, vmn: channel ltid.
// channels per consumer thread of the per-channel values (D = 256: ltid and ltid + 128)
__host__ __device__ constexpr int hop_chan_per_thread(int D) { return D > 128 ? D / 128 : 1; }
template <int D>
struct HopQPre {  // km, vsc, vmn: channels ltid + 128 u
    uint4 q0[D / 4 / 8], q1[D / 4 / 8];
    float vsc[hop_chan_per_thread(D)], vmn[hop_chan_per_thread(D)], km[hop_chan_per_thread(D)];
};
// (q . mean(K) per row, K's smoothing shift, only enters the LSE: without one the prologue skips it)
template <int D, typename T, bool LSE, int NWG>
struct HopPrefetch {
    const HopWs& w;
    const SageAttnParams& p;
    const int& cw;
    const int& lrow0;
    const int& group;
    const int& t4;
    const int& ltid;
    __device__ __forceinline__ void operator()(int t, HopQPre<D>& pf) const {
        constexpr int BM = hop_bm(NWG), QC = D / 4;
        constexpr bool kQShift = LSE;
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
#pragma unroll
        for (int u = 0; u < hop_chan_per_thread(D); ++u) {
            const int ch = ltid + 128 * u;
            pf.km[u] = ch < D && kQShift ? w.kmean[hk * D + ch] : 0.f;
            pf.vsc[u] = ch < D ? w.vscale[hk * D + ch] : 0.f;
            pf.vmn[u] = ch < D && p.smooth_v ? w.vmean[hk * D + ch] : 0.f;
        }
    }
};

// S = Q K^T of the block in stage s
template <int D, int NWG>
struct HopIssueQK {
    const uint32_t& dk0;
    const uint32_t& dq;
    __device__ __forceinline__ void operator()(int (&acc)[64], int s) const {
        using S = HopSmem<D, NWG>;
        const uint32_t dk = dk0 + (uint32_t)s * (S::KBYTES >> 4);
        wgmma_s8_n128<false>(acc, hop_desc_make(dq, hop_desc_hi(D)), hop_desc_make(dk, hop_desc_hi(D)));
#pragma unroll
        for (int k = 1; k < D / 32; ++k)
            wgmma_s8_n128<true>(acc, hop_desc_make(dq + hop_desc_kstep(32 * k, D), hop_desc_hi(D)),
                                hop_desc_make(dk + hop_desc_kstep(32 * k, D), hop_desc_hi(D)));
        wg_commit();
    }
};

// P~V of the block in stage s into its own accumulator (two-level accumulation)
template <int D, int NWG>
struct HopIssuePV {
    const uint32_t& dv0;
    __device__ __forceinline__ void operator()(float (&blk)[hop_pv_n(D) / 2], uint32_t (&pa)[4][4], int s) const {
        using S = HopSmem<D, NWG>;
        const uint32_t dv = dv0 + (uint32_t)s * (S::VSTRIDE >> 4);
        wgmma_pv<D, false>(blk, pa[0], hop_desc_make(dv, hop_desc_hi(kHopBN)));
#pragma unroll
        for (int kk = 1; kk < 4; ++kk)
            wgmma_pv<D, true>(blk, pa[kk], hop_desc_make(dv + hop_desc_step(32 * kk), hop_desc_hi(kHopBN)));
        wg_commit();
    }
};

// o's n8 column chunks off.. off + nch - 1 = o * alpha + the block accumulator's chunks 0.. (rows row0 / row1)
template <int D>
struct HopFold {
    float (&o)[D / 2];
    __device__ __forceinline__ void operator()(const float* b, int off, int nch, float al0, float al1) const {
#pragma unroll
        for (int i = 0; i < nch; ++i) {
            o[4 * (off + i)] = o[4 * (off + i)] * al0 + b[4 * i];
            o[4 * (off + i) + 1] = o[4 * (off + i) + 1] * al0 + b[4 * i + 1];
            o[4 * (off + i) + 2] = o[4 * (off + i) + 2] * al1 + b[4 * i + 2];
            o[4 * (off + i) + 3] = o[4 * (off + i) + 3] * al1 + b[4 * i + 3];
        }
    }
};

// O = O * alpha + block, l likewise with the block's row sums (columns D..; row0: [D/2], row1: [D/2 + 2])
template <int D>
struct HopMerge {
    float& l0;
    float& l1;
    const HopFold<D>& fold;
    __device__ __forceinline__ void operator()(const float (&blk)[hop_pv_n(D) / 2], float al0, float al1, float vinv) const {
        l0 = l0 * al0 + blk[D / 2] * vinv;
        l1 = l1 * al1 + blk[D / 2 + 2] * vinv;
        fold(blk, 0, D / 8, al0, al1);
    }
};

// stage and phase of the it-th block a consumer takes (NST stages: HopSmem::NST)
template <int NST = kHopStages>
struct HopStageOf {
    __device__ __forceinline__ int operator()(int i, uint32_t& ph) const {
        ph = (uint32_t)(i / NST) & 1u;
        return i % NST;
    }
};
// a block this warpgroup does not compute (wholly past its causal diagonal or before its sliding window): only
// released, after it landed (an early arrival would count towards the stage's previous use)
template <int NST>
__device__ __forceinline__ void hop_release_block(const HopStageOf<NST>& stage_of, int it, uint32_t bar_full,
                                                  uint32_t bar_empty, int lane) {
    uint32_t ph;
    const int s = stage_of(it, ph);
    mbar_wait(bar_full + 8 * s, ph);
    __syncwarp();
    if (lane == 0) mbar_arrive(bar_empty + 8 * s);
}
// powers of two as bits: a / b and 1 / b for a, b in [1, 2^64] (one integer add each)
struct HopPow2Div {
    __device__ __forceinline__ float operator()(float a, float b) const {
        return __int_as_float(__float_as_int(a) - __float_as_int(b) + 0x3f800000);
    }
};
struct HopPow2Inv {
    __device__ __forceinline__ float operator()(float b) const { return __int_as_float(0x7f000000 - __float_as_int(b)); }
};

// D = 128: P~V in two column halves, m64n64 into ba (V^T rows from dv) or m64n72 into bb (rows from dvb, with the
// 8 rows of ones: the row sums); one k32 step of a half
template <int N>
struct HopPVHalfMma {
    const uint32_t& dvh;
    float (&acc)[N];
    uint32_t (&pa)[4][4];
    template <typename First>
    __device__ __forceinline__ void operator()(First, int kk) const {
        const uint64_t db = hop_desc_make(dvh + hop_desc_step(32 * kk), hop_desc_hi(kHopBN));
        if constexpr (N == 32) wgmma_pv64<!First::value>(acc, pa[kk], db);
        else wgmma_pv72<!First::value>(acc, pa[kk], db);
    }
};
// one half: the four k32 steps, committed as one group
struct HopPVHalf {
    uint32_t (&pa)[4][4];
    template <int N>
    __device__ __forceinline__ void operator()(float (&acc)[N], uint32_t dvh) const {
        HopPVHalfMma<N> mma{dvh, acc, pa};
        wg_fence();
        mma(std::true_type{}, 0);
#pragma unroll
        for (int kk = 1; kk < 4; ++kk) mma(std::false_type{}, kk);
        wg_commit();
    }
};
template <int N>
struct HopPVHalfIssue {
    const HopPVHalf& issue_half;
    float (&acc)[N];
    const uint32_t& dvh;
    __device__ __forceinline__ void operator()() const { issue_half(acc, dvh); }
};
// merging the halves: o's first 8 column chunks from ba; the row sums and the last 8 chunks from bb
template <int D>
struct HopMergeA {
    const HopFold<D>& fold;
    float (&ba)[32];
    float& al0;
    float& al1;
    __device__ __forceinline__ void operator()() const { fold(ba, 0, 8, al0, al1); }
};
template <int D>
struct HopMergeB {
    const HopPow2Inv& pow2_inv;
    float& vfac_prev;
    float& l0;
    float& al0;
    float (&bb)[36];
    float& l1;
    float& al1;
    const HopFold<D>& fold;
    __device__ __forceinline__ void operator()() const {
        const float vinv = pow2_inv(vfac_prev);
        l0 = l0 * al0 + bb[32] * vinv;
        l1 = l1 * al1 + bb[34] * vinv;
        fold(bb, 8, 8, al0, al1);
    }
};

}  // namespace sage

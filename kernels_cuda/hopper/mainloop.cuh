// Hopper path: the CTA's shared memory and barriers (HopCta: the K/V stage ring and the tile ring) and the producer
// warpgroup (one thread streaming K and V^T block images into the stage ring, handing work items to the consumers).
#pragma once
#include "pipeline.cuh"
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
    c.bar_empty = c.bar_full + 8 * kHopStages;
    c.tbar_full = c.sbase + S::TBAR_OFF;
    c.tbar_empty = c.tbar_full + 8 * kHopTileRing;
    c.tring = reinterpret_cast<volatile int*>(c.smem + S::TILE_OFF);
    if (threadIdx.x == 0) {
        for (int s = 0; s < kHopStages; ++s) {
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
        for (int i = threadIdx.x; i < kHopStages * S::ONES / 4; i += hop_threads(NWG)) {
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
        for (int kb = hop_part_kb0(itm, w); kb < kb1; ++kb, ++it) {
            const int s = it % kHopStages;
            const uint32_t ph = (uint32_t)(it / kHopStages) & 1u;
            mbar_wait(c.bar_empty + 8 * s, ph ^ 1u);
            mbar_expect_tx(c.bar_full + 8 * s, S::KBYTES + S::VBYTES);
            bulk_g2s(c.sbase + S::K_OFF + s * S::KBYTES, w.kimg + (blk0 + kb) * S::KBYTES, S::KBYTES, c.bar_full + 8 * s);
            bulk_g2s(c.sbase + S::V_OFF + s * S::VSTRIDE, w.vimg + (blk0 + kb) * S::VBYTES, S::VBYTES, c.bar_full + 8 * s);
        }
        t = tn;
    }
    hop_publish(c, ti, w.nitems);
}

}  // namespace sage

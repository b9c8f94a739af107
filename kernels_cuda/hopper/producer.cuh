// Hopper path: the producer warpgroup (one thread streaming K and V^T block images into the stage ring, handing
// work items to the consumers through the tile ring).
#pragma once
#include "pipeline.cuh"
#include "tile_scheduler.cuh"

namespace sage::hopper {

// warpgroup 0: one thread takes work items (the next from a global counter, in flight while this one's loads
// issue), publishes them and streams their K and V^T block images into the stage ring with bulk copies
template <int D, int NWG>
__device__ __forceinline__ void producer(const SageAttnParams& p, const Ws& w, const Cta<D, NWG>& c,
                                             int group) {
    using S = Smem<D, NWG>;
    constexpr int BM = bm(NWG);
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
    if (threadIdx.x != 0) return;
    int it = 0, ti = 0;
    for (int t = blockIdx.x; t < w.nitems;) {
        const int tn = (int)gridDim.x + atomicAdd(w.tilectr, 1);  // in flight while this tile's loads issue
        const Item itm = item(t, w);
        const Tile tl = tile(itm.tile, w, p.Hq);
        const int sq = len_q(p, tl.b), skv = len_k(p, tl.b), q0 = tl.qb * BM;
        if (q0 >= sq) { t = tn; continue; }  // varlen: past this sequence's end
        publish(c, ti, t);
        const int nkb = num_kv_blocks(p, q0, BM, sq, skv);
        const int64_t blk0 = ((int64_t)tl.b * p.Hkv + tl.h / group) * w.nkb;
        const int kb1 = part_kb1(itm, nkb, w);
        for (int kb = part_kb0(itm, w, p, q0, sq, skv); kb < kb1; ++kb, ++it) {
            const int s = it % S::NST;
            const uint32_t ph = (uint32_t)(it / S::NST) & 1u;
            mbar_wait(c.bar_empty + 8 * s, ph ^ 1u);
            mbar_expect_tx(c.bar_full + 8 * s, S::KBYTES + S::VBYTES);
            bulk_g2s(c.sbase + S::K_OFF + s * S::KBYTES, w.kimg + (blk0 + kb) * S::KBYTES, S::KBYTES, c.bar_full + 8 * s);
            bulk_g2s(c.sbase + S::V_OFF + s * S::VSTRIDE, w.vimg + (blk0 + kb) * S::VBYTES, S::VBYTES, c.bar_full + 8 * s);
        }
        t = tn;
    }
    publish(c, ti, w.nitems);
}

}  // namespace sage::hopper

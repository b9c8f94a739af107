// Hopper path: the shared-memory pipeline. The CTA's shared memory and barriers (Cta: the K/V stage ring and the
// tile ring), both ends of the tile ring (the producer publishes work items, the consumers take them) and the
// consumers' view of the stage ring (stage and phase of a block; releasing a block not computed).
#pragma once
#include "wgmma.cuh"
#include "tile_scheduler.cuh"
#include "../common/ptx.cuh"

namespace sage::hopper {

// the CTA's shared memory (1024-byte aligned) and the mbarrier addresses of the stage ring and the tile ring
template <int D, int NWG>
struct Cta {
    using S = Smem<D, NWG>;
    uint8_t* smem;
    uint32_t sbase, bar_full, bar_empty, tbar_full, tbar_empty;
    volatile int* tring;  // the tile ring's work items
};

template <int D, int NWG>
__device__ __forceinline__ Cta<D, NWG> cta_init(uint8_t* hsmem_raw) {
    using S = Smem<D, NWG>;
    Cta<D, NWG> c;
    c.smem = hsmem_raw + smem_pad_1024(hsmem_raw);
    c.sbase = smem_u32(c.smem);
    c.bar_full = c.sbase + S::BAR_OFF;
    c.bar_empty = c.bar_full + 8 * S::NST;
    c.tbar_full = c.sbase + S::TBAR_OFF;
    c.tbar_empty = c.tbar_full + 8 * kTileRing;
    c.tring = reinterpret_cast<volatile int*>(c.smem + S::TILE_OFF);
    if (threadIdx.x == 0) {
        // empty: one arrival per consumer warp
        mbar_init_ring(c.bar_full, c.bar_empty, S::NST, 1, 4 * NWG);
        mbar_init_ring(c.tbar_full, c.tbar_empty, kTileRing, 1, 4 * NWG);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    {  // e4m3 1.0 = 0x38 in the rows below every V^T stage (the bulk copies never touch them)
        for (int i = threadIdx.x; i < S::NST * S::ONES / 4; i += threads(NWG)) {
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
__device__ __forceinline__ void publish(const Cta<D, NWG>& c, int& ti, int t) {
    const int r = ti % kTileRing;
    mbar_wait(c.tbar_empty + 8 * r, ((uint32_t)(ti / kTileRing) & 1u) ^ 1u);
    c.tring[r] = t;
    mbar_arrive(c.tbar_full + 8 * r);
    ++ti;
}

// the consumers' side of the tile ring: the next work item from the producer (>= nitems: no more)
struct TakeTile {  // the next work item from the producer (>= nitems: no more)
    int& ci;
    const uint32_t& tbar_full;
    volatile int* const& tring;
    const int& lane;
    const uint32_t& tbar_empty;
    __device__ __forceinline__ int operator()() const {
        const int r = ci % kTileRing;
        mbar_wait(tbar_full + 8 * r, (uint32_t)(ci / kTileRing) & 1u);
        const int t = tring[r];
        __syncwarp();
        if (lane == 0) mbar_arrive(tbar_empty + 8 * r);
        ++ci;
        return t;
    }
};

// stage and phase of the it-th block a consumer takes (NST stages: Smem::NST)
template <int NST = kStages>
__device__ __forceinline__ int stage_of(int i, uint32_t& ph) {
    ph = (uint32_t)(i / NST) & 1u;
    return i % NST;
}
// a block this warpgroup does not compute (wholly past its causal diagonal or before its sliding window): only
// released, after it landed (an early arrival would count towards the stage's previous use)
template <int NST>
__device__ __forceinline__ void release_block(int it, uint32_t bar_full, uint32_t bar_empty, int lane) {
    uint32_t ph;
    const int s = stage_of<NST>(it, ph);
    mbar_wait(bar_full + 8 * s, ph);
    __syncwarp();
    if (lane == 0) mbar_arrive(bar_empty + 8 * s);
}

}  // namespace sage::hopper

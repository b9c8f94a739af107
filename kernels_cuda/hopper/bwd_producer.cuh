// Hopper SageBwd backward (bwd_kernel.cuh): the producer warpgroup, which streams each query tile's operands
// into the stage ring (TMA from one thread; cp.async from all where a map cannot serve a tile), and the CTA's tile
// list (BwdTiles) it walks with the consumers.
#pragma once
#include <cuda.h>  // CUtensorMap
#include "bwd_traits.cuh"
#include "wgmma.cuh"
#include "../common/ptx.cuh"

namespace sage::hopper {

// The tensor maps of the producer's TMA loads, built per launch in bwd_launch.cu (bwd_maps) and passed as a
// __grid_constant__ kernel parameter beside SageBwdParams, whose C ABI they leave alone.
// - Q^T and dO^T, the (B * Hq, D, t_stride) INT8 buffers, as 3D tensors (query, channel, row bh) of extent Sq along
//   the queries (a box past Sq lands as zeros): one box of 64 queries x D channels per tile, 64-byte swizzled (TMA's
//   64B swizzle, address bits [4:5] ^= [7:8], is img_off(.., 64)'s on 1024-aligned images).
// - Q^, dO and the stats, whose image rows are in the permuted query order (bwd_query_of): a box lands in dimension
//   order, so their maps walk a 16-row group's query bits in slot order, 5D (channels, q0, q2q3, q1, 16-row group)
//   with strides (row, 4 rows, 2 rows, 16 rows): non-monotonic, which the driver takes (H200, driver of CUDA 13,
//   probed). A box (the channels, 2, 4, 2, 4) is a tile's 64 rows in image order with img_off's swizzle. Used for
//   the tiles wholly below Sq whose rows start on a 16-row group of the map (perm: Sq % 16 == 0 for Q^ and the
//   stats, dO's head offsets in whole 16-row groups or inside a row, BSHD); a head's last, partial tile and the
//   other layouts keep the cp.async copies (zero-fill past Sq: the next head's rows, NaN there included, must not
//   reach this head's dK and dV through a 0 x NaN)
struct BwdMaps {
    CUtensorMap qt, dot, q, dout, st;
    // perm: the permuted maps serve the whole tiles; dO's 16-row group of (batch b, head h, tile m0) is
    // b do_gb + h do_gh + m0 / 16 and its first channel element h do_ch (BSHD: the head's place within the row)
    int perm, do_gb, do_gh, do_ch;
};

// 16 bytes global -> shared, zero-filled where !ok (src is then not read)
__device__ __forceinline__ void bwd_cp16(uint8_t* dst, const void* src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(ok ? 16 : 0));
}

// one query tile's Q^, dO and stats into stage memory st (cp.async by the producer's kBwdLoaders threads, one
// commit group): rows m0.. of query head bh
template <int D, typename T>
__device__ __forceinline__ void bwd_issue_tile(const SageBwdParams& p, uint8_t* st, int64_t bh, const T* dop, int m0,
                                               int tid) {
    using S = BwdSmem<D>;
    // A thread's chunks are rows a multiple of 16 apart within each image, which keeps the swizzle phase and (bit 4
    // up) the query permutation, so every address after the first is a constant further (unrolled; the row and
    // column of the first are the only divisions).
    const int sq = p.Sq;
    const int8_t* qp = p.q_int + bh * sq * D;
    // a tile wholly below sq (all but a head's last): no per-row clamp or test, the rows a constant stride apart
    const bool whole = m0 + kBwdQueries <= sq;
    {  // Q^: row r = query m0 + bwd_query_of(r)
        constexpr int per_row = D / 16, step = kBwdLoaders / per_row;
        static_assert(step % 16 == 0, "bwd_query_of(r + step) = bwd_query_of(r) + step needs 16-row steps");
        const int r = tid / per_row, c = tid % per_row, qi = m0 + bwd_query_of(r);
        uint8_t* dst = st + S::Q_OFF + img_off(r, 16 * c, D);
        if (whole) {
            const int8_t* src = qp + (int64_t)qi * D + 16 * c;
#pragma unroll
            for (int k = 0; k < 64 * D / 16 / kBwdLoaders; ++k) bwd_cp16(dst + k * step * D, src + k * step * D, true);
        } else {
#pragma unroll
            for (int k = 0; k < 64 * D / 16 / kBwdLoaders; ++k)
                bwd_cp16(dst + k * step * D, qp + (int64_t)min(qi + k * step, sq - 1) * D + 16 * c, qi + k * step < sq);
        }
    }
    {  // dO (16-bit): the same row order; 8 threads per row, each its chunks c, c + 8 (16-row steps at D = 128)
        constexpr int per_row = 8, chunks = D / 8 / per_row, step = kBwdLoaders / per_row;
        static_assert(step % 16 == 0, "bwd_query_of(r + step) = bwd_query_of(r) + step needs 16-row steps");
        const int r = tid / per_row, c = tid % per_row, qi = m0 + bwd_query_of(r);
        const T* src = dop + 8 * c;
        uint8_t* dst = st + S::DO_OFF + bwd_h16_off(r, c);
        if (whole) {
            const T* row = src + (int64_t)qi * p.do_ss;
            const int64_t rstep = (int64_t)step * p.do_ss;
#pragma unroll
            for (int k = 0; k < 64 / step; ++k)
#pragma unroll
                for (int j = 0; j < chunks; ++j) bwd_cp16(dst + j * 8192 + k * step * 128, row + k * rstep + 64 * j, true);
        } else {
#pragma unroll
            for (int k = 0; k < 64 / step; ++k)
#pragma unroll
                for (int j = 0; j < chunks; ++j)
                    bwd_cp16(dst + j * 8192 + k * step * 128,
                             src + 64 * j + (int64_t)min(qi + k * step, sq - 1) * p.do_ss, qi + k * step < sq);
        }
    }
    if (tid < 64) {  // stats in the images' row order: row r holds query bwd_query_of(r)'s
        const int qi = m0 + bwd_query_of(tid);
        bwd_cp16(st + S::ST_OFF + 16 * tid, p.stats + 4 * (bh * sq + min(qi, sq - 1)), qi < sq);
    }
    cp_async_commit();
}

// The CTA's query tiles: (query head gi of the group, query tile) pairs, gi outer (the Triton kernel's summation
// order); causal: from the first tile that sees the CTA's first key (a warpgroup's tiles before its own first
// visible one are wholly masked: they add exact zeros). The producer and the consumers walk the same list.
struct BwdTiles {
    int lo, ntq, ntiles, b, h0;
    __device__ __forceinline__ BwdTiles(const SageBwdParams& p, int ncta, int b_, int hkv) {
        const int group = p.Hq / p.Hkv, sq = p.Sq;
        lo = p.causal ? max(ncta - (p.Skv - sq), 0) / kBwdQueries * kBwdQueries : 0;
        ntq = lo < sq ? (sq - lo + kBwdQueries - 1) / kBwdQueries : 0;
        ntiles = group * ntq;
        b = b_;
        h0 = hkv * group;
    }
    // the tile of head gi and query tile qt: its first query (returned), (batch, query head) row index bh and dO
    // rows dop
    template <typename T>
    __device__ __forceinline__ int at(const SageBwdParams& p, int gi, int qt, int64_t& bh, const T*& dop) const {
        const int h = h0 + gi;
        bh = (int64_t)b * p.Hq + h;
        dop = static_cast<const T*>(p.dout) + b * p.do_sb + h * p.do_sh;
        return lo + qt * kBwdQueries;
    }
};
// a walk over BwdTiles and the stage ring, by increments (no division per tile): head gi, query tile qt, stage stg
// and its phase ph
struct BwdCursor {
    int gi = 0, qt = 0, stg = 0;
    uint32_t ph = 0;
    __device__ __forceinline__ void next(const BwdTiles& tl) {
        if (++qt == tl.ntq) qt = 0, ++gi;
        if (++stg == kBwdStages) stg = 0, ph ^= 1u;
    }
};

// the full barrier's arrivals per tile: the producer threads' (cp.async, one tile behind) and the TMA issuer's
// expect_tx (the TMA bytes complete it: the barrier's transaction count)
constexpr int kBwdFullArrivals = kBwdLoaders + 1;

// warpgroup 0: streams the tiles into the stage ring. Thread 0 first issues the tile's TMA loads (Q^T and dO^T;
// Q^, dO and the stats where the permuted maps serve the tile), their bytes counted on the tile's full barrier;
// then every thread its cp.async copies of the rest (none where TMA took all), and tile t's arrivals
// come after tile t + 1's copies are issued (cp.async completes per thread: wait_group, then the proxy fence that
// makes the bytes visible to wgmma, then the arrival), so each tile's copies overlap the previous tile's wait
template <int D, typename T>
__device__ __forceinline__ void bwd_producer(const SageBwdParams& p, const BwdMaps& maps, const BwdTiles& tl,
                                             uint8_t* sm, uint32_t full, uint32_t empty, int tid) {
    using S = BwdSmem<D>;
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
    if (tid == 0) {
        tma_prefetch_map(&maps.qt);
        tma_prefetch_map(&maps.dot);
        if (maps.perm) {
            tma_prefetch_map(&maps.q);
            tma_prefetch_map(&maps.dout);
            tma_prefetch_map(&maps.st);
        }
    }
    BwdCursor cu;
    int sprev = 0;
    for (int t = 0; t < tl.ntiles; ++t, cu.next(tl)) {
        mbar_wait(empty + 8 * cu.stg, cu.ph ^ 1u);
        int64_t bh;
        const T* dop;
        const int m0 = tl.at(p, cu.gi, cu.qt, bh, dop);
        uint8_t* st = sm + S::STAGE0 + cu.stg * S::STAGE;
        const bool rows = maps.perm && m0 + kBwdQueries <= p.Sq;  // Q^, dO, stats by TMA too
        if (tid == 0) {
            const uint32_t sst = smem_u32(st), bar = full + 8 * cu.stg;
            mbar_expect_tx(bar, rows ? 3 * S::I8 + S::H16 + 1024 : 2 * S::I8);
            tma_load(sst + S::QT_OFF, &maps.qt, bar, m0, 0, (int)bh);
            tma_load(sst + S::DOT_OFF, &maps.dot, bar, m0, 0, (int)bh);
            if (rows) {
                const int g = (int)bh * (p.Sq / 16) + m0 / 16, h = tl.h0 + cu.gi;
                tma_load(sst + S::Q_OFF, &maps.q, bar, 0, 0, 0, 0, g);
                tma_load(sst + S::ST_OFF, &maps.st, bar, 0, 0, 0, 0, g);
                const int gd = tl.b * maps.do_gb + h * maps.do_gh + m0 / 16;
#pragma unroll
                for (int j = 0; j < D / 64; ++j)
                    tma_load(sst + S::DO_OFF + j * 8192, &maps.dout, bar, h * maps.do_ch + 64 * j, 0, 0, 0, gd);
            }
        }
        if (!rows) bwd_issue_tile<D, T>(p, st, bh, dop, m0, tid);
        else cp_async_commit();  // (an empty group: wait_group below counts one per tile)
        if (t > 0) {
            cp_async_wait<1>();
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            mbar_arrive(full + 8 * sprev);
        }
        sprev = cu.stg;
    }
    if (tl.ntiles > 0) {
        cp_async_wait<0>();
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        mbar_arrive(full + 8 * sprev);
    }
}

}  // namespace sage::hopper

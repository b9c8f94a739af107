// Hopper SageBwd backward (bwd_kernel.cuh): the producer warpgroup, which streams each query tile's operands
// into the stage ring with cp.async, and the CTA's tile list (BwdTiles) it walks with the consumers.
#pragma once
#include "bwd_traits.cuh"
#include "wgmma.cuh"
#include "../common/ptx.cuh"

namespace sage::hopper {

// 16 bytes global -> shared, zero-filled where !ok (src is then not read)
__device__ __forceinline__ void bwd_cp16(uint8_t* dst, const void* src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(ok ? 16 : 0));
}

// one query tile's operands into stage memory st (cp.async by the producer's kBwdLoaders threads, one commit
// group): rows m0.. of query head bh
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
    // Q^T and dO^T: channel rows of 64 query bytes in natural order (a row is padded to 16 bytes: a chunk that
    // starts below sq stays inside it; its bytes past sq meet zero P / dS entries)
    {
        const int ch = tid >> 2, c0 = 16 * (tid & 3);
        const bool ok = m0 + c0 < sq;
        const int64_t src = bh * D * p.t_stride + ch * p.t_stride + (ok ? m0 + c0 : 0);
        constexpr int step = kBwdLoaders / 4;
#pragma unroll
        for (int k = 0; k < D * 4 / kBwdLoaders; ++k) {
            bwd_cp16(st + S::QT_OFF + img_off(ch, c0, 64) + k * step * 64, p.q_t + src + k * step * p.t_stride, ok);
            bwd_cp16(st + S::DOT_OFF + img_off(ch, c0, 64) + k * step * 64, p.do_t + src + k * step * p.t_stride, ok);
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

// warpgroup 0: streams the tiles into the stage ring; tile t's full barrier is signalled after tile t + 1's copies
// are issued (cp.async completes per thread: wait_group, then the proxy fence that makes the bytes visible to
// wgmma, then the arrival), so each tile's copies overlap the previous tile's wait
template <int D, typename T>
__device__ __forceinline__ void bwd_producer(const SageBwdParams& p, const BwdTiles& tl, uint8_t* sm, uint32_t full,
                                             uint32_t empty, int tid) {
    using S = BwdSmem<D>;
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
    BwdCursor cu;
    int sprev = 0;
    for (int t = 0; t < tl.ntiles; ++t, cu.next(tl)) {
        mbar_wait(empty + 8 * cu.stg, cu.ph ^ 1u);
        int64_t bh;
        const T* dop;
        const int m0 = tl.at(p, cu.gi, cu.qt, bh, dop);
        bwd_issue_tile<D, T>(p, sm + S::STAGE0 + cu.stg * S::STAGE, bh, dop, m0, tid);
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

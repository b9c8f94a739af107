// Hopper (sm_90a) SageBwd training backward, dQ, dK and dV: INT8 and 16-bit wgmma on the transposed problem.
//
// One CTA per 64 kBwdNwg keys of one (batch, KV head), one warpgroup per 64 keys; it walks the query heads of the GQA
// group and their 64-query tiles (the numerics' block_q) that see its keys (causal: from the first visible tile),
// so dK and dV are summed over the group in registers. Per query tile, with the keys as the wgmma M dimension:
//   S^T  = K^ Q^^T                INT8 m64n64k32, both operands K-major shared-memory images (img_off)
//   dP^T = V dO^T                 16-bit m64n64k16 (fp32 accumulation), V and dO images in 64-channel chunks
//   P^T  = exp2(S^T s_K tau log2e s_Q - LSE)   (masked pairs 0)
//   dV  += q8(P^T s_dO) dO^       INT8, A from registers: quantized per key row over the tile's 64 queries (a row
//   dS^T = P^T o (dP^T - Delta)                 lives in the 4 lanes of a quad), B = the transposed dO^ image
//   dK  += q8(dS^T s_Q) Q^        likewise with the transposed Q^ image; dK is scaled by tau at the end
//   dQ  += q8(dS s_K) K^          INT8, dS s_K quantized per query over the warpgroup's 64 keys (the numerics'
//                                 block_k: column maxima across the 4 warps through shared memory) into a dS image
//                                 (queries x keys), B = a K^T image made once per CTA; each warpgroup computes half
//                                 the channels over both warpgroups' key blocks (their int32 products scaled and
//                                 summed in registers), stored per warp into a shared-memory block and added by one
//                                 bulk reduction (cp.reduce.async.bulk .add.f32) into an fp32 buffer in blocks
//                                 (bwd_dq_tile) that the caller scales by tau, casts and reorders (5 products per
//                                 tile, as FA3's backward)
// Query order: row c of the Q^ and dO images (the N dimension of S^T and dP^T) holds query slot_of_key(c) of
// its 32-query group, so the accumulator fragment of a lane is directly its A fragment for the transposed INT8
// images in natural query order (the forward's V^T trick, applied to the other operand): every tile lands in its
// swizzled place (TMA maps that walk the query bits in slot order, or 16-byte cp.async), no byte shuffles. The numerics are those of
// sage_patch/kernels/sagebwd/bwd.py's dkdv_kernel and dq_kernel (SageBwdConfig(**KERNEL_LAYOUT)): the same products,
// scale foldings, per-row quantization (127 / amax, round half to even, NaN amax -> NaN scale); the accumulation
// order too, except dQ's sum over key blocks (floating-point reductions: no fixed order, but in Det's).
//
// Det (the deterministic mode, p.dq_sem; FlashAttention-3's): the key blocks (CTAs) of a (batch, KV head) add to each
// query tile's dQ one after another, in one order: per (batch, query head, tile) an int32 counter in p.dq_sem
// counts the consumer warps that added their blocks (before a tile's dQ, one lane of each warp waits until every
// warp of the key blocks before it in the tile's order has, bwd_dq_wait; it releases its own reductions, complete,
// with one increment half a tile later, in the next tile's math, so that no warp waits for its own to land). The
// key blocks that add to a tile are always a prefix 0..n-1 (causal: a CTA's first tile is nondecreasing in its
// keys; key padding and odd lengths skip no CTA's tiles). Order: kb = 0, 1, .., n - 1, except causal: n - 1, .., 0,
// with the grid reversed (blockIdx.x 0 = the last key block), FA3's order there: a higher key block starts at a
// later tile, so it reaches each tile first and nobody waits; in ascending order each CTA would wait at its first
// tile until key block 0 walked the tiles before it (all of a head's CTAs as long as the longest). No deadlock: a
// CTA waits only for CTAs of the same (batch, KV head) with a lower blockIdx.x (the same blockIdx.y), and the CTAs
// of a grid are dispatched in blockIdx order (x fastest), so those are resident or done; by induction over that
// order, each makes progress (the lowest unfinished one waits on nobody unfinished), whatever the number of SMs.
//
// Warp-specialized (the forward's shape): warpgroup 0 is the producer, which streams each query tile's operands (Q^,
// dO, Q^T, dO^T, stats) with TMA from one thread (cp.async from all where no map serves a tile: bwd_producer.cuh)
// into a ring of kBwdStages stages guarded by mbarriers (full: the TMA bytes and the producer threads' arrivals,
// one tile behind, after their copies landed and a proxy fence; empty: one arrival per consumer thread after its
// last read of the stage), and gives its registers to the two consumer warpgroups (setmaxnreg 24 / 240). The consumers
// never meet at a CTA-wide barrier, nor wait for each other at one point of the tile: their dS images are double-
// buffered by tile parity, a warpgroup announces its dS of tile t (bar.arrive) and computes tile t's dQ only at the
// start of tile t + 1 (bar.sync on the other's), and may overwrite its image of tile t at tile t + 2 once the
// other's dQ of tile t announced it free: either may run up to about a tile ahead, so that one's math overlaps the
// other's products. Within a warpgroup, the previous tile's dQ products run with this tile's S^T (D = 128) or S^T
// and dP^T (D = 64, FA3's order) in flight, and at D = 64 the dV product with dS s_K's quantization (kBwdOverlap:
// D = 128's dK and dV accumulators leave no room for more). dQ over both key blocks at once: one reduction per
// (query, channel) and 128 keys, not per 64 (per-warpgroup dQ, no barrier but twice the reductions, measured 1.18x
// slower at D=128 before the producer split). Before the split (all threads loading, two CTA barriers per tile),
// H200, B=4 H=32 bf16 N=16K, backward alone: D=128 0.93x (full) / 0.94x (causal) of the Triton backward, D=64
// 0.87x / 0.86x, issue- and latency-bound (ncu: 46% of issue slots used with 2 warps per scheduler, ~2500
// instructions per warp and 64 x 64 tile, tensor pipes ~15% busy). With the split and the bulk dQ reductions (same
// run, ms): D=128 141.2 (Triton 151.4, the vector reductions 157.0), causal 72.9 (78.6, 80.9); D=64 105.1 (100.1,
// 110.8), causal 53.8 (50.9, 56.7). Bulk reductions per row (64 per warpgroup and tile, each lane its own
// address) were slower than the vector reductions: ptxas serializes per-lane bulk operations (uniform operands).
// With the stats in the images' row order and the quantizations' quotients without nvcc's division (bwd_quant),
// 16K: D=128 125.7 (Triton 151.8), causal 64.7 (78.7); D=64 86.0 (100.3), causal 44.3 (51.1).
//
// The pieces, included side by side: bwd_traits.cuh (constants, shared memory, layouts), bwd_quant.cuh (the
// INT8 quantizations and register-A products), bwd_dq.cuh (dQ), bwd_producer.cuh (the producer warpgroup).
#pragma once
#include "wgmma.cuh"
#include "../common/ptx.cuh"
#include "../common/quant.cuh"
#include "bwd_traits.cuh"
#include "bwd_quant.cuh"
#include "bwd_dq.cuh"
#include "bwd_producer.cuh"

namespace sage::hopper {

template <int D, typename T, bool Det>
__global__ void __launch_bounds__(kBwdThreads, 1) hopper_bwd_kernel(const __grid_constant__ SageBwdParams p,
                                                                   const __grid_constant__ BwdMaps maps) {
    using S = BwdSmem<D>;
    extern __shared__ __align__(1024) uint8_t bsmem_raw[];
    uint8_t* sm = bsmem_raw + smem_pad_1024(bsmem_raw);
    // through __shfl_sync ptxas knows the shared base is warp-uniform and keeps the wgmma descriptors in uniform
    // registers (as the forward's consumer does)
    const uint32_t sb = __shfl_sync(0xffffffffu, smem_u32(sm), 0);
    const uint32_t full = sb + S::BAR_OFF, empty = full + 8 * kBwdStages;
    const int tid = threadIdx.x;
    constexpr int keys = kBwdKeys * kBwdNwg;
    const int kb = Det && p.causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;  // key block (Det: order above)
    const int ncta = kb * keys;  // the CTA's keys
    const int bkv = blockIdx.y, b = bkv / p.Hkv, hkv = bkv % p.Hkv;
    const BwdTiles tl(p, ncta, b, hkv);
    if (tid == 0) {
        // empty: one arrival per consumer thread (the main loop's comment)
        mbar_init_ring(full, empty, kBwdStages, kBwdFullArrivals, 128 * kBwdNwg);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (tid < kBwdLoaders) {
        bwd_producer<D, T>(p, maps, tl, sm, full, empty, tid);
        return;
    }
    // ---------------- consumers: 240 registers (the producer's .dec released 144 of its launch 168 per thread)
    static_assert(kBwdThreads == 384, "setmaxnreg: 168 * 384 = 24 * 128 + 240 * 256 registers");
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n" ::: "memory");
    const int wg = __shfl_sync(0xffffffffu, (tid - kBwdLoaders) >> 7, 0), ltid = tid & 127;
    const int warp = ltid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    const int n0 = ncta + wg * kBwdKeys;  // the warpgroup's keys
    const int sq = p.Sq, skv = p.Skv, diag = skv - sq;
    const float tau_log2e = p.sm_scale * kLog2e;

    // K^ and V of this warpgroup's keys, once (0 past skv)
    uint8_t* skv_img = sm + S::KV_OFF + wg * S::KV_STRIDE;
    const uint32_t kimg = sb + S::KV_OFF + wg * S::KV_STRIDE, vimg = kimg + S::V_IN_KV;
    const int8_t* kp = p.k_int + ((int64_t)bkv * skv) * D;
    for (int i = ltid; i < 64 * D / 16; i += 128) {
        const int r = i / (D / 16), c = i % (D / 16);
        uint4 x = make_uint4(0, 0, 0, 0);
        if (n0 + r < skv) x = *reinterpret_cast<const uint4*>(kp + (int64_t)(n0 + r) * D + 16 * c);
        *reinterpret_cast<uint4*>(skv_img + img_off(r, 16 * c, D)) = x;
        // and K^T (dQ's B operand: channel rows, keys at bwd_kpos), byte by byte (once per CTA)
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const uint32_t w = j < 4 ? x.x : j < 8 ? x.y : j < 12 ? x.z : x.w;
            skv_img[S::KT_IN_KV + img_off(16 * c + j, bwd_kpos(r), 64)] = (uint8_t)(w >> (8 * (j & 3)));
        }
    }
    const T* vp = static_cast<const T*>(p.v) + b * p.v_sb + hkv * p.v_sh;
    for (int i = ltid; i < 64 * D / 8; i += 128) {
        const int r = i / (D / 8), c = i % (D / 8);
        uint4 x = make_uint4(0, 0, 0, 0);
        if (n0 + r < skv) x = *reinterpret_cast<const uint4*>(vp + (int64_t)(n0 + r) * p.v_ss + 8 * c);
        *reinterpret_cast<uint4*>(skv_img + S::V_IN_KV + bwd_h16_off(r, c)) = x;
    }
    // visible to this warpgroup's wgmma (the other's reads of K^T come after the first tile's dS barrier)
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    named_sync(1 + wg, 128);
    // this lane's keys (rows of the transposed tiles): g and g + 8 of its warp's 16
    const int key0 = n0 + 16 * warp + g, key1 = key0 + 8;
    const uint8_t* mrow = p.kmask ? p.kmask + (int64_t)b * p.kmask_sb : nullptr;
    const bool kok0 = key0 < skv && (!mrow || mrow[key0]), kok1 = key1 < skv && (!mrow || mrow[key1]);
    const float ksr0 = key0 < skv ? p.k_scale[(int64_t)bkv * skv + key0] : 0.f;  // dQ's dS s_K
    const float ksr1 = key1 < skv ? p.k_scale[(int64_t)bkv * skv + key1] : 0.f;
    const float ks0 = ksr0 * tau_log2e, ks1 = ksr1 * tau_log2e;

    float dk[D / 2], dv[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.f;
    // dQ of tile tq (query rows m0q.. of bhq) over both warpgroups' dS images: once the other's is written (every
    // thread of both meets at the ready barrier: this warpgroup's own image is complete too), then this one's read of
    // the other's image announced (unless nothing will wait for it)
    static_assert(kBwdNwg == 2, "dQ pairs the two consumer warpgroups");
    // (the staging block: a warp's previous tile's bulk reduction read it before its issuer (lane 0) reaches the
    // ready barrier, which the whole warp passes before writing it again)
    const uint32_t dq_stg = kimg + S::DQ_IN_KV;
    const int ntq_all = (sq + kBwdQueries - 1) / kBwdQueries;  // the dQ buffer's tiles per head
    int* sem_prev = nullptr;  // Det: the counter of the tile whose increment is pending (its reductions in flight)
    auto dq_tile = [&](int tq, int64_t bhq, int m0q) {
        const int pq = tq & 1;
        if ((ltid & 31) == 0) bulk_wait<true>();
        if constexpr (Det) {
            // this CTA's place in the tile's order (above) times the increments per key block (its warps), waited
            // for before the barrier, where the warp may wait anyway (H200, B=4 H=32, with the release below:
            // 1.17-1.33x the default mode's time, against 1.15-1.44x waiting just before the first bulk reduction
            // and releasing at the next tile's dQ)
            sem_prev = p.dq_sem + bhq * ntq_all + m0q / kBwdQueries;
            const int n = p.causal ? min((int)gridDim.x, (m0q + kBwdQueries + diag + keys - 1) / keys) : 0;
            if ((ltid & 31) == 0) bwd_dq_wait(sem_prev, 4 * kBwdNwg * (p.causal ? n - 1 - kb : kb));
        }
        named_sync(kBarDsReady + 2 * (1 - wg) + pq, 128 * kBwdNwg);
        const float* sc = reinterpret_cast<const float*>(sm + S::KV_OFF + S::SC_IN_KV) + 64 * pq;
        bwd_dq_update<D>(sb + S::KV_OFF, S::DS_IN_KV + pq * S::DS_BYTES, sc, sc + S::KV_STRIDE / 4, dq_stg,
                         p.dq_acc + bwd_dq_tile<D>(bhq, ntq_all, m0q / kBwdQueries), wg * (D / 2), ltid);
        if (tq + 2 < tl.ntiles) named_arrive(kBarDsFree + 2 * (1 - wg) + pq, 128 * kBwdNwg);
    };
    int mprev = 0;
    int64_t bhprev = 0;
    int gi = 0, qt = 0;
    for (int t = 0; t < tl.ntiles; ++t) {
        int64_t bh;
        const T* dop;
        const int m0 = tl.at(p, gi, qt, bh, dop);
        if (++qt == tl.ntq) qt = 0, ++gi;
        const int stg = t % kBwdStages, par = t & 1;
        mbar_wait(full + 8 * stg, (uint32_t)(t / kBwdStages) & 1u);  // this tile's operands landed
        const uint32_t sst = __shfl_sync(0xffffffffu, sb + S::STAGE0 + stg * S::STAGE, 0);
        const float4* st = reinterpret_cast<const float4*>(sm + S::STAGE0 + stg * S::STAGE + S::ST_OFF);
        {
            // S^T = K^ Q^^T and dP^T = V dO^T, in flight together
            int sacc[32];
            float dpt[32];
            wg_fence();
            {
                const uint32_t ka = desc_lo(kimg), qa = desc_lo(sst + S::Q_OFF);
                wgmma_s8_n64_ss<false>(sacc, desc_make(ka, desc_hi(D)), desc_make(qa, desc_hi(D)));
#pragma unroll
                for (int k = 1; k < D / 32; ++k)
                    wgmma_s8_n64_ss<true>(sacc, desc_make(ka + desc_step(32 * k), desc_hi(D)),
                                    desc_make(qa + desc_step(32 * k), desc_hi(D)));
                wg_commit();
                // D = 128: the previous tile's dQ products with S^T in flight (room for S^T's 32 accumulators only)
                if (!kBwdOverlap<D> && t > 0) {
                    dq_tile(t - 1, bhprev, mprev);
                    wg_fence();
                }
#pragma unroll
                for (int cc = 0; cc < D / 64; ++cc) {
                    const uint32_t va = desc_lo(vimg + cc * 8192),
                                   da = desc_lo(sst + S::DO_OFF + cc * 8192);
#pragma unroll
                    for (int kk = 0; kk < 4; ++kk) {
                        const uint64_t x = desc_make(va + desc_step(32 * kk), desc_hi(128));
                        const uint64_t y = desc_make(da + desc_step(32 * kk), desc_hi(128));
                        if (cc == 0 && kk == 0) wgmma_h16_n64<T, false>(dpt, x, y);
                        else wgmma_h16_n64<T, true>(dpt, x, y);
                    }
                }
                wg_commit();
            }
            // FA3's order where registers allow: the previous tile's dQ products run with S^T and dP^T in flight (its
            // wait_group waits for them too)
            if (kBwdOverlap<D> && t > 0) dq_tile(t - 1, bhprev, mprev);
            wg_wait<1>();
            reg_fence(sacc);
            // P^T (masked pairs 0: keys past skv or padded, past the causal diagonal, queries past sq); a lane whose
            // pairs of this tile are all visible (most tiles at long lengths) skips the per-pair tests
            float pt[32];
            auto probs = [&](auto masked) {
#pragma unroll
                for (int i = 0; i < 8; ++i) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int c = 8 * i + 2 * t4 + e, qi = m0 + bwd_query_of(c);
                        const float4 s4 = st[c];  // q scale, LSE (log2), Delta, dO scale of query qi
                        const float x0 = fast_exp2((float)sacc[4 * i + e] * ks0 * s4.x - s4.y);
                        const float x1 = fast_exp2((float)sacc[4 * i + 2 + e] * ks1 * s4.x - s4.y);
                        if constexpr (decltype(masked)::value) {
                            const bool qok = qi < sq;
                            const bool v0 = qok && kok0 && (!p.causal || key0 <= qi + diag);
                            const bool v1 = qok && kok1 && (!p.causal || key1 <= qi + diag);
                            pt[4 * i + e] = v0 ? x0 : 0.f;
                            pt[4 * i + 2 + e] = v1 ? x1 : 0.f;
                        } else {
                            pt[4 * i + e] = x0;
                            pt[4 * i + 2 + e] = x1;
                        }
                    }
                }
            };
            if (kok0 && kok1 && m0 + kBwdQueries <= sq && (!p.causal || key1 <= m0 + diag))
                probs(std::false_type{});
            else
                probs(std::true_type{});
            // in place (registers): dpt <- dS^T = P^T o (dP^T - Delta), pt <- P^T s_dO, quantized per key row and
            // dV += q8(P^T s_dO) dO^
            wg_wait<0>();  // (dP^T, issued with S^T)
            reg_fence(dpt);
#pragma unroll
            for (int i = 0; i < 8; ++i)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float4 s4 = st[8 * i + 2 * t4 + e];
#pragma unroll
                    for (int hh = 0; hh < 2; ++hh) {
                        const int j = 4 * i + 2 * hh + e;
                        dpt[j] = pt[j] * (dpt[j] - s4.z);
                        pt[j] = pt[j] * s4.w;
                    }
                }
            uint32_t adv[2][4];
            float pv0, pv1;
            int tv[32];
            bwd_quantize_rows(pt, adv, pv0, pv1);
            if constexpr (kBwdOverlap<D>) bwd_int8_issue(tv, adv, sst + S::DOT_OFF, 0);
            else bwd_int8_update<D>(dv, adv, sst + S::DOT_OFF, pv0, pv1);
            // dQ's operand dS s_K, quantized per query over this warpgroup's 64 keys into its dS image (free once the
            // other warpgroup's dQ of tile t - 2 read it), announced to the other warpgroup (generic stores read by
            // wgmma: the async proxy)
#pragma unroll
            for (int j = 0; j < 32; ++j) pt[j] = dpt[j] * ((j & 2) ? ksr1 : ksr0);
            if (t >= 2) named_sync(kBarDsFree + 2 * wg + par, 128 * kBwdNwg);
            bwd_quantize_cols(pt, skv_img + S::DS_IN_KV + par * S::DS_BYTES,
                              reinterpret_cast<float*>(skv_img + S::RED_IN_KV),
                              reinterpret_cast<float*>(skv_img + S::SC_IN_KV) + 64 * par, 1 + wg, warp, lane);
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            named_arrive(kBarDsReady + 2 * wg + par, 128 * kBwdNwg);
            if constexpr (Det) {
                // the previous tile's dQ reductions (issued early in this tile) complete and released here, half a
                // tile later: no warp waits for its own reductions to land, the next key block not a whole tile
                if (lane == 0 && sem_prev) {
                    bulk_wait<false>();
                    bwd_dq_signal(sem_prev);
                }
                sem_prev = nullptr;
            }
            if constexpr (kBwdOverlap<D>) {
                wg_wait<0>();
                reg_fence(tv);
                bwd_int8_fold(dv, tv, pv0, pv1);
            }
            // dK += q8(dS^T s_Q) Q^
#pragma unroll
            for (int i = 0; i < 8; ++i)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float qs = st[8 * i + 2 * t4 + e].x;
                    dpt[4 * i + e] *= qs;
                    dpt[4 * i + 2 + e] *= qs;
                }
            {
                uint32_t adk[2][4];
                float pk0, pk1;
                bwd_quantize_rows(dpt, adk, pk0, pk1);
                bwd_int8_update<D>(dk, adk, sst + S::QT_OFF, pk0, pk1);
            }
        }
        // this thread's last read of the stage (the dK product is complete): the producer may refill it. Every
        // thread arrives: an arrival releases the arriving thread's own reads, and the stats rows read by all lanes
        // may be refilled by per-thread cp.async writes (one lane's arrival after __syncwarp left compute-sanitizer's
        // racecheck reporting the refill against the other lanes' reads)
        mbar_arrive(empty + 8 * stg);
        mprev = m0;
        bhprev = bh;
    }
    if (tl.ntiles > 0) dq_tile(tl.ntiles - 1, bhprev, mprev);
    if ((ltid & 31) == 0) {
        bulk_wait<false>();  // (the staging block stays allocated until the last reduction read it)
        if constexpr (Det) if (sem_prev) bwd_dq_signal(sem_prev);
    }
    // epilogue: rows key0 / key1, channels 64 nh + 8 i + 2 t4 (+1); dK times tau
    T* dkp = static_cast<T*>(p.dk) + ((int64_t)bkv * skv) * D;
    T* dvp = static_cast<T*>(p.dv) + ((int64_t)bkv * skv) * D;
#pragma unroll
    for (int nh = 0; nh < D / 64; ++nh)
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int ch = 64 * nh + 8 * i + 2 * t4, j = 32 * nh + 4 * i;
            if (key0 < skv) {
                *reinterpret_cast<uint32_t*>(dkp + (int64_t)key0 * D + ch) = pack2<T>(dk[j] * p.sm_scale, dk[j + 1] * p.sm_scale);
                *reinterpret_cast<uint32_t*>(dvp + (int64_t)key0 * D + ch) = pack2<T>(dv[j], dv[j + 1]);
            }
            if (key1 < skv) {
                *reinterpret_cast<uint32_t*>(dkp + (int64_t)key1 * D + ch) = pack2<T>(dk[j + 2] * p.sm_scale, dk[j + 3] * p.sm_scale);
                *reinterpret_cast<uint32_t*>(dvp + (int64_t)key1 * D + ch) = pack2<T>(dv[j + 2], dv[j + 3]);
            }
        }
}

}  // namespace sage::hopper

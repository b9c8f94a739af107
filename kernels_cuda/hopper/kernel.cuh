// Hopper path: the warp-specialized persistent attention kernel. Warpgroup 0 is the producer (producer.cuh); each of
// the NWG consumer warpgroups owns 64 rows of the CTA tile and, per work item: Q prologue, the serial block loop
// (S = Q K^T, online softmax (softmax.cuh), P~V, two-level accumulation (consumer.cuh)), split-tail combine, epilogue
// (epilogue.cuh). The pieces are included side by side (FlashAttention-3's hopper/ shape); the shared-memory
// pipeline they meet in is pipeline.cuh, the PTX wrappers wgmma.cuh.
#pragma once
#include "traits.cuh"
#include "tile_scheduler.cuh"
#include "pipeline.cuh"
#include "producer.cuh"
#include "softmax.cuh"
#include "consumer.cuh"
#include "epilogue.cuh"

namespace sage::hopper {

// LSE: whether p.lse is written (a template parameter: its fp32 row sums cost registers the loop needs otherwise);
// WIN: a sliding window (p.window_keys > 0; its limits cost registers too: without it D = 64 ran 1-3% slower)
template <int D, typename T, bool LSE, int NWG, bool WIN>
__global__ void __launch_bounds__(threads(NWG), 1) hopper_attn_kernel(const __grid_constant__ SageAttnParams p,
                                                                           const Ws w) {
    using S = Smem<D, NWG>;
    constexpr int BM = bm(NWG);
    extern __shared__ __align__(1024) uint8_t hsmem_raw[];
    const int wg = threadIdx.x >> 7;
    const Cta<D, NWG> c = cta_init<D, NWG>(hsmem_raw);
    uint8_t* hsmem = c.smem;
    const uint32_t sbase = c.sbase;
    const uint32_t bar_full = c.bar_full, bar_empty = c.bar_empty;
    const uint32_t tbar_full = c.tbar_full, tbar_empty = c.tbar_empty;
    volatile int* tring = c.tring;
    pdl_wait();
    const int group = p.Hq / p.Hkv;
    if (wg == 0) {
        producer<D, NWG>(p, w, c, group);
        return;
    }
    // ---------------- consumers
    // setmaxnreg.inc takes only what the producer's .dec released from the CTA's launch allocation (the launch
    // bound's 65536 / threads, a multiple of 8; asking for more hangs): 240 for 2 consumers (capped), 160 for 3, 112 for 4
    constexpr int kLaunchRegs = (65536 / threads(NWG)) & ~7;
    constexpr int kPool = ((kLaunchRegs * threads(NWG) - 128 * 24) / (128 * NWG)) & ~7;
    constexpr int kRegs = kPool > 240 ? 240 : kPool;
    static_assert(NWG != 4 || kRegs == 112, "4 consumers: 640 threads launch with 96 registers each");
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs) : "memory");
    // consumer warpgroup cw (0..NWG-1): rows 64cw..64cw+63 of the tile. Through __shfl_sync ptxas knows it is warp-uniform and
    // keeps the Q descriptor in uniform registers (no per-block rebuild + R2UR before the S group: +1-3% on the H200)
    const int cw = __shfl_sync(0xffffffffu, wg, 0) - 1;
    const int ltid = threadIdx.x & 127, warp = ltid >> 5, lane = ltid & 31, g = lane >> 2, t4 = lane & 3;
    const uint32_t sQ = sbase + S::Q_OFF + cw * S::QBYTES;
    // descriptor low words of this warpgroup's Q image and of stage 0's K and V^T images (desc_lo)
    const uint32_t dq = desc_lo(sQ), dk0 = desc_lo(sbase + S::K_OFF), dv0 = desc_lo(sbase + S::V_OFF);
    uint8_t* sQp = hsmem + S::Q_OFF + cw * S::QBYTES;
    int it = 0, tpar = 0;
    const int lrow0 = warp * 16 + g;  // this lane's rows in the warpgroup's 64: lrow0, lrow0 + 8
    // The next tile's Q rows, K mean and V scale/mean are loaded into registers before the current tile's epilogue,
    // so their latency hides under it (the prologue used to wait on them with the tensor cores idle).
    int ci = 0;
    TakeTile take_tile{ci, tbar_full, tring, lane, tbar_empty};
    Prefetch<D, T, LSE, NWG> prefetch{w, p, cw, lrow0, group, t4, ltid};
    QPre<D> pf;
    int tt = take_tile();
    if (tt < w.nitems) prefetch(tt, pf);
    while (tt < w.nitems) {
        const Item itm = item(tt, w);
        const Tile tl = tile(itm.tile, w, p.Hq);
        const int b = tl.b, h = tl.h;
        const int sq = len_q(p, b), skv = len_k(p, b), q0 = tl.qb * BM;
        const int nkb = num_kv_blocks(p, q0, BM, sq, skv);
        // this item's blocks (a whole tile: its first block in the window .. nkb - 1)
        const int kb0 = part_kb0(itm, w, p, q0, sq, skv), kb1 = part_kb1(itm, nkb, w);
        const int64_t bhq = (int64_t)b * p.Hq + h, bhk = (int64_t)b * p.Hkv + h / group;
        const int row0 = q0 + cw * 64 + lrow0, row1 = row0 + 8;

        RowState<D, LSE, WIN> st;  // this work item's row state: O, l, the softmax's maxima and sums, Q shifts
        float qs;
        float* se = reinterpret_cast<float*>(hsmem + S::EPI_OFF) + (cw * 2 + tpar) * S::EPI_FLOATS;
        q_prologue<D, T, LSE>(p, pf, se, sQp, cw, ltid, lrow0, t4, qs, st.qshift0, st.qshift1);
        const float* sepi = se;
        tpar ^= 1;

        const int diag = skv - sq;
        const uint8_t* mrow = p.kmask ? p.kmask + (int64_t)b * p.kmask_sb : nullptr;
        const float* ksc = w.kscale + bhk * w.nkb * 4;
        const float* vfc = w.vfac + bhk * w.nkb;  // per block: V's power-of-two factor over the base scale
        const int* kmf = mrow ? w.kmflag + (int64_t)b * w.nkb : nullptr;
        const int wrow_min = q0 + cw * 64;  // first row of this warpgroup

        // masked blocks: key attended by the row (inside the sequence, not padded, not past the causal diagonal)
        KeyOk key_ok{skv, mrow, p, diag};
        const SoftmaxRows rows{skv, p, wrow_min, diag, qs, key_ok, t4, row0, row1};
        IssueQK<D, NWG> issue_qk{dk0, dq};
        IssuePV<D, NWG> issue_pv{dv0};
        // O's stashed values (D = 256, o_stash): this thread's float4 0 of the warpgroup's stash (stride 128 float4)
        float4* const stash =
            reinterpret_cast<float4*>(hsmem + S::STASH_OFF) + cw * (o_stash(D, true) / 4) * 128 + ltid;
        if constexpr (o_stash(D, LSE) > 0) PvAccum<D, LSE>::stash_zero(stash);
        const BlockStep<D, NWG, LSE, WIN> consume_block{st,       rows,      issue_qk, issue_pv, dv0,
                                                        bar_full, bar_empty, lane,     stash};
        // serial blocks need >= 3 consumer warpgroups to keep the tensor cores busy; D = 256 fits only 2 (its O)
        static_assert(NWG >= 3 || D == 256, "serial blocks need >= 3 consumer warpgroups");
        {
            // (ping-pong turns between the consumers, or S(kb) issued with P~V(kb-1), were equal or slower in every
            // form measured: docs/design/tried_and_rejected.md)
            // causal: the tile's last blocks may lie wholly past this warpgroup's diagonal (nkb_own <= kb < nkb);
            // a warpgroup whose rows all lie past the sequence's end (the last tile) computes nothing
            const int nkb_own = wrow_min < sq ? num_kv_blocks(p, wrow_min, 64, sq, skv) : 0;
            const int kend = min(nkb_own, kb1);
            // sliding window: the tile's first blocks may lie wholly before this warpgroup's window
            const int kbeg = WIN ? max(kb0, min(first_kv_block(p, wrow_min, sq, skv), kend)) : kb0;
            int kb = kb0;
            for (; kb < kbeg; ++kb, ++it) release_block<S::NST>(it, bar_full, bar_empty, lane);
            float kscale_next = kb1 > kb ? ksc[kb * 4 + t4] : 0.f;
            float vfac_next = kb1 > kb ? vfc[kb] : 1.f;
            int kmask_next = kmf && kb1 > kb ? kmf[kb] : 0;
            // sliding window: blocks before kb_wfull are cut by the window of some row of the warpgroup (the last,
            // wrow_min + 63, starts latest): the visible keys are no prefix there, the general per-key test applies
            const int wlast = wrow_min + 63 + (skv - sq) - p.window_keys;  // the last row's last hidden key
            const int kb_wfull = WIN && wlast >= 0 ? wlast / kBN + 1 : 0;
            for (; kb < kend; ++kb, ++it) {
                uint32_t ph;
                const int s = stage_of<S::NST>(it, ph);
                const float kscale_cur = kscale_next, vfac_cur = vfac_next;
                const int kmask_cur = kmask_next | (kb < kb_wfull);
                if (kb + 1 < kb1) {  // in flight during this block
                    kscale_next = ksc[(kb + 1) * 4 + t4];
                    vfac_next = vfc[kb + 1];
                    if (kmf) kmask_next = kmf[kb + 1];
                }
                consume_block(s, ph, kb, kscale_cur, vfac_cur, kmask_cur);
            }
            // blocks past the diagonal: only released (a separate loop keeps the main loop's code as it is)
            for (; kb < kb1; ++kb, ++it) release_block<S::NST>(it, bar_full, bar_empty, lane);
        }

        if constexpr (o_stash(D, LSE) > 0) st.pv.unstash(stash);
        bool skip = false;
        split_combine<D, NWG>(w, item(tt, w), hsmem, cw, ltid, st, skip);

        const int tnext = take_tile();
        // in flight during the epilogue; unconditional (the current tile again after the last one) so that the
        // compiler sees pf redefined every iteration and does not keep it alive across the main loop
        prefetch(tnext < w.nitems ? tnext : tt, pf);

        // ---- epilogue
        // empty row (no visible key): l == 0 exactly; a NaN l (non-finite input) must not pass as empty
        const float l0 = st.pv.l0, l1 = st.pv.l1;
        const float inv0 = l0 != 0.f ? 1.f / l0 : 0.f, inv1 = l1 != 0.f ? 1.f / l1 : 0.f;
        T* O = static_cast<T*>(p.o) + b * p.o_sb + h * p.o_sh + tok0_q(p, b) * p.o_ss;
        T* O0 = O + (int64_t)row0 * p.o_ss + 8 * t4;
        T* O1 = O + (int64_t)row1 * p.o_ss + 8 * t4;
        const bool st0 = row0 < sq && !skip, st1 = row1 < sq && !skip;
        epilogue<D>(p, sepi, OutRows<T>{b, h, bhq, sq, row0, row1, t4, O0, O1, st0, st1, skip, inv0, inv1}, st);
        tt = tnext;
    }
}

}  // namespace sage::hopper

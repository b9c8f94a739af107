// Hopper path: the warp-specialized persistent attention kernel. Warpgroup 0 is the producer (mainloop.cuh); each of
// the NWG consumer warpgroups owns 64 rows of the CTA tile and, per work item: Q prologue, the serial block loop
// (S = Q K^T, online softmax (softmax.cuh), P~V, two-level accumulation (mainloop.cuh)), split-tail combine, epilogue.
#pragma once
#include "mainloop.cuh"
#include "../common/quant.cuh"
#include "../common/ptx.cuh"

namespace sage {

// LSE: whether p.lse is written (a template parameter: its fp32 row sums cost registers the loop needs otherwise)
template <int D, typename T, bool LSE, int NWG>
__global__ void __launch_bounds__(hop_threads(NWG), 1) hopper_attn_kernel(const __grid_constant__ SageAttnParams p,
                                                                           const HopWs w) {
    using S = HopSmem<D, NWG>;
    constexpr int BM = hop_bm(NWG);
    extern __shared__ __align__(1024) uint8_t hsmem_raw[];
    const int wg = threadIdx.x >> 7;
    const HopCta<D, NWG> c = hop_cta_init<D, NWG>(hsmem_raw);
    uint8_t* hsmem = c.smem;
    const uint32_t sbase = c.sbase;
    const uint32_t bar_full = c.bar_full, bar_empty = c.bar_empty;
    const uint32_t tbar_full = c.tbar_full, tbar_empty = c.tbar_empty;
    volatile int* tring = c.tring;
    pdl_wait();
    const int group = p.Hq / p.Hkv;
    if (wg == 0) {
        hop_producer<D, NWG>(p, w, c, group);
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
    using Pre = HopQPre<D>;
    int ci = 0;
    HopTakeTile take_tile{ci, tbar_full, tring, lane, tbar_empty};
    HopPrefetch<D, T, LSE, NWG> prefetch{w, p, cw, lrow0, group, t4, ltid};
    Pre pf;
    int tt = take_tile();
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
        HopKeyOk key_ok{skv, mrow, p, diag};
        HopSoftmax<LSE> softmax_block{skv, p, wrow_min, diag, qs, key_ok, t4, row0, row1, m0, m1, ls0, ls1};
        HopPackP pack_p{};
        HopIssueQK<D, NWG> issue_qk{dk0, dq};
        // two-level accumulation: each block's P~V lands in its own accumulator (blk), then O = O * alpha + blk.
        // V~ of block kb is V / (base vfac_kb): O and l are kept divided by the current block's vfac (the softmax's
        // alpha times vfac_prev / vfac_kb, exact powers of two, and the block's row sums times 1 / vfac_kb), so O / l
        // needs no factor at the end.
        HopIssuePV<D, NWG> issue_pv{dv0};
        // o's n8 column chunks off.. off + nch - 1 = o * alpha + the block accumulator's chunks 0.. (rows row0 / row1)
        HopFold<D> fold{o};
        HopMerge<D> merge{l0, l1, fold};
        HopStageOf stage_of{};
        // powers of two as bits: a / b and 1 / b for a, b in [1, 2^64] (one integer add each)
        HopPow2Div pow2_div{};
        HopPow2Inv pow2_inv{};
        float vfac_prev = 1.f;

        // Software pipeline inside the warpgroup: S(kb) = Q K(kb)^T is issued together with P~(kb-1) V(kb-1), and the
        // softmax of S(kb) runs while the tensor cores still work on P~V. (Ping-pong turns between the consumers were
        // equal or slower in every form measured: docs/design/tried_and_rejected.md.)
        static_assert(NWG >= 3, "serial blocks need >= 3 consumer warpgroups to keep the tensor cores busy");
        {
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
                mbar_wait(bar_full + 8 * s, ph);
                wg_fence();
                issue_qk(acc, s);
                wg_wait<0>();
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
                const uint32_t dv = dv0 + (uint32_t)s * (S::VSTRIDE >> 4);
                if constexpr (D == 128) {
                    // P~V in two column halves: 32 + 36 accumulator registers (all 68 live at once do not fit)
                    float ba[32], bb[36];
                    const uint32_t dvb = dv + ((64 * kHopBN) >> 4);  // V^T rows 64.. (rows of kHopBN bytes)
                    // one half: m64n64 into ba (V^T rows from dv) or m64n72 into bb (rows from dvb)
                    HopPVHalf issue_half{pa};
                    HopPVHalfIssue<32> issue_a{issue_half, ba, dv};
                    HopPVHalfIssue<36> issue_b{issue_half, bb, dvb};
                    HopMergeA<D> merge_a{fold, ba, al0, al1};
                    HopMergeB<D> merge_b{pow2_inv, vfac_prev, l0, al0, bb, l1, al1, fold};
                    // one half after the other (both in flight, or the second issued before the first merge:
                    // 1-2% slower, they spill)
                    issue_a();
                    wg_wait<0>();
                    reg_fence(ba);
                    merge_a();
                    issue_b();
                    wg_wait<0>();
                    reg_fence(bb);
                    reg_fence(pa);
                    if (lane == 0) mbar_arrive(bar_empty + 8 * s);
                    merge_b();
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

        tt = tnext;
    }
}

}  // namespace sage

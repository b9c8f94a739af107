// Hopper path: the warp-specialized persistent attention kernel: warpgroup 0 the producer (mainloop.cuh), warpgroups
// 1..NWG the consumers, 64 rows of the CTA tile each: per work item the Q prologue, the serial block loop (S = Q K^T,
// online softmax, P~V, two-level accumulation), the split-tail combine and the epilogue.
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
    pdl_wait();  // launched early (PDL): the pre-passes' outputs are complete and visible from here on
    const int group = p.Hq / p.Hkv;
    if (wg == 0) {  // ---------------- producer
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
            wgmma_pv<D, false>(blk, pa[0], hop_desc_make(dv, hop_desc_hi(kHopBN)));
#pragma unroll
            for (int kk = 1; kk < 4; ++kk)
                wgmma_pv<D, true>(blk, pa[kk], hop_desc_make(dv + hop_desc_step(32 * kk), hop_desc_hi(kHopBN)));
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
                    auto issue_half = [&](auto& acc, uint32_t dvh) {
                        constexpr bool kA = sizeof(acc) == sizeof(ba);
                        auto mma = [&](auto first, int kk) {
                            const uint64_t db = hop_desc_make(dvh + hop_desc_step(32 * kk), hop_desc_hi(kHopBN));
                            if constexpr (kA) wgmma_pv64<!decltype(first)::value>(acc, pa[kk], db);
                            else wgmma_pv72<!decltype(first)::value>(acc, pa[kk], db);
                        };
                        wg_fence();
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

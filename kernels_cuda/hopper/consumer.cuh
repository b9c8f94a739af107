// Hopper path: a consumer warpgroup's work on one work item, before its epilogue: the Q prologue (this warpgroup's 64
// rows of the tile quantized into its wgmma Q image) and one block of the loop (S = Q K^T, online softmax, P~V,
// two-level accumulation) on the row state the consumer loop owns (RowState: the P~V accumulation PvAccum, the
// softmax, the Q shifts), and the pieces they use: taking work items, prefetching the next tile's Q rows and
// per-channel values, issuing S = Q K^T and P~V (small functor structs bound to the consumer's registers: the same
// code the compiler saw when they were lambdas, tools/sass_diff.py); the online softmax is softmax.cuh's.
#pragma once
#include "pipeline.cuh"
#include "softmax.cuh"
#include "tile_scheduler.cuh"
#include "../common/quant.cuh"
#include "../common/ptx.cuh"

namespace sage::hopper {

// The next tile's Q rows, K mean and V scale/mean, loaded into registers before the current tile's epilogue so
// their latency hides under it (the prologue used to wait on them with the tensor cores idle): per lane rows lrow0,
// lrow0 + 8, the 8-channel chunks 4c + t4 (a quad reads 64 contiguous bytes); km, vsc, vmn: channel ltid.
// channels per consumer thread of the per-channel values (D = 256: ltid and ltid + 128)
__host__ __device__ constexpr int chan_per_thread(int D) { return D > 128 ? D / 128 : 1; }
template <int D>
struct QPre {  // km, vsc, vmn: channels ltid + 128 u
    uint4 q0[D / 4 / 8], q1[D / 4 / 8];
    float vsc[chan_per_thread(D)], vmn[chan_per_thread(D)], km[chan_per_thread(D)];
};
// (q . mean(K) per row, K's smoothing shift, only enters the LSE: without one the prologue skips it)
template <int D, typename T, bool LSE, int NWG>
struct Prefetch {
    const Ws& w;
    const SageAttnParams& p;
    const int& cw;
    const int& lrow0;
    const int& group;
    const int& t4;
    const int& ltid;
    __device__ __forceinline__ void operator()(int t, QPre<D>& pf) const {
        constexpr int BM = bm(NWG), QC = D / 4;
        constexpr bool kQShift = LSE;
        const Tile x = tile(item(t, w).tile, w, p.Hq);
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
        for (int u = 0; u < chan_per_thread(D); ++u) {
            const int ch = ltid + 128 * u;
            pf.km[u] = ch < D && kQShift ? w.kmean[hk * D + ch] : 0.f;
            pf.vsc[u] = ch < D ? w.vscale[hk * D + ch] : 0.f;
            pf.vmn[u] = ch < D && p.smooth_v ? w.vmean[hk * D + ch] : 0.f;
        }
    }
};

// S = Q K^T of the block in stage s
template <int D, int NWG>
struct IssueQK {
    const uint32_t& dk0;
    const uint32_t& dq;
    __device__ __forceinline__ void operator()(int (&acc)[64], int s) const {
        using S = Smem<D, NWG>;
        const uint32_t dk = dk0 + (uint32_t)s * (S::KBYTES >> 4);
        wgmma_s8_n128<false>(acc, desc_make(dq, desc_hi(D)), desc_make(dk, desc_hi(D)));
#pragma unroll
        for (int k = 1; k < D / 32; ++k)
            wgmma_s8_n128<true>(acc, desc_make(dq + desc_kstep(32 * k, D), desc_hi(D)),
                                desc_make(dk + desc_kstep(32 * k, D), desc_hi(D)));
        wg_commit();
    }
};

// P~V of the block in stage s into its own accumulator (two-level accumulation)
template <int D, int NWG>
struct IssuePV {
    const uint32_t& dv0;
    __device__ __forceinline__ void operator()(float (&blk)[pv_n(D) / 2], uint32_t (&pa)[4][4], int s) const {
        using S = Smem<D, NWG>;
        const uint32_t dv = dv0 + (uint32_t)s * (S::VSTRIDE >> 4);
        wgmma_pv<D, false>(blk, pa[0], desc_make(dv, desc_hi(kBN)));
#pragma unroll
        for (int kk = 1; kk < 4; ++kk)
            wgmma_pv<D, true>(blk, pa[kk], desc_make(dv + desc_step(32 * kk), desc_hi(kBN)));
        wg_commit();
    }
};

// powers of two as bits: a / b and 1 / b for a, b in [1, 2^64] (one integer add each)
__device__ __forceinline__ float pow2_div(float a, float b) {
    return __int_as_float(__float_as_int(a) - __float_as_int(b) + 0x3f800000);
}
__device__ __forceinline__ float pow2_inv(float b) { return __int_as_float(0x7f000000 - __float_as_int(b)); }

// The P~V accumulation (two-level: each block's P~V lands in its own accumulator, then merges into O and l): one
// object owning the rows' O accumulators and tensor-core row sums l (rows row0 / row1). V~ of block kb is
// V / (base vfac_kb): O and l are kept divided by the last block's vfac (vfac_prev): O / l needs no factor at the end.
template <int D, bool LSE>
struct PvAccum {
    float o[D / 2] = {};
    float l0 = 0.f;
    float l1 = 0.f;
    float vfac_prev = 1.f;
    // block with V factor vfac next: alpha times vfac_prev / vfac (exact powers of two)
    __device__ __forceinline__ void next_vfac(float vfac, float& al0, float& al1) {
        const float q = pow2_div(vfac_prev, vfac);
        al0 *= q;
        al1 *= q;
        vfac_prev = vfac;
    }
    // o's n8 column chunks off.. off + nch - 1 = o * alpha + the block accumulator's chunks 0..
    __device__ __forceinline__ void fold(const float* b, int off, int nch, float al0, float al1) {
#pragma unroll
        for (int i = 0; i < nch; ++i) {
            o[4 * (off + i)] = o[4 * (off + i)] * al0 + b[4 * i];
            o[4 * (off + i) + 1] = o[4 * (off + i) + 1] * al0 + b[4 * i + 1];
            o[4 * (off + i) + 2] = o[4 * (off + i) + 2] * al1 + b[4 * i + 2];
            o[4 * (off + i) + 3] = o[4 * (off + i) + 3] * al1 + b[4 * i + 3];
        }
    }
    // l = l * alpha + the block's row sums (sums[0]: row0, sums[2]: row1) / vfac
    __device__ __forceinline__ void add_sums(const float* sums, float al0, float al1) {
        const float vinv = pow2_inv(vfac_prev);
        l0 = l0 * al0 + sums[0] * vinv;
        l1 = l1 * al1 + sums[2] * vinv;
    }
    // The stash (o_stash(D, LSE) > 0, traits.cuh): o's last o_stash values live in shared memory during the block
    // loop, at sp[128 j] (this thread's float4 j, j < o_stash / 4: a warp's accesses are contiguous). Zeroed at a
    // work item's start, folded by fold_stashed (as fold: the same FFMA per value), loaded back into o by unstash.
    static constexpr int kStashOff = D / 2 - o_stash(D, LSE);  // first stashed value of o
    __device__ __forceinline__ static void stash_zero(float4* sp) {
#pragma unroll
        for (int j = 0; j < o_stash(D, LSE) / 4; ++j) sp[128 * j] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    // the stashed chunks = stash * alpha + b's chunks 0.. (b: the block accumulator's chunks of the stashed columns)
    __device__ __forceinline__ static void fold_stashed(float4* sp, const float* b, float al0, float al1) {
#pragma unroll
        for (int j = 0; j < o_stash(D, LSE) / 4; ++j) {
            float4 v = sp[128 * j];
            v.x = v.x * al0 + b[4 * j];
            v.y = v.y * al0 + b[4 * j + 1];
            v.z = v.z * al1 + b[4 * j + 2];
            v.w = v.w * al1 + b[4 * j + 3];
            sp[128 * j] = v;
        }
    }
    __device__ __forceinline__ void unstash(const float4* sp) {
#pragma unroll
        for (int j = 0; j < o_stash(D, LSE) / 4; ++j) {
            const float4 v = sp[128 * j];
            o[kStashOff + 4 * j] = v.x;
            o[kStashOff + 4 * j + 1] = v.y;
            o[kStashOff + 4 * j + 2] = v.z;
            o[kStashOff + 4 * j + 3] = v.w;
        }
    }
    // O = O * alpha + block, l likewise with the block's row sums (columns D..; row0: [D/2], row1: [D/2 + 2])
    __device__ __forceinline__ void merge(const float (&blk)[pv_n(D) / 2], float al0, float al1) {
        add_sums(blk + D / 2, al0, al1);
        fold(blk, 0, D / 8, al0, al1);
    }
};

// A consumer thread's row state on one work item, owned by the consumer loop: the P~V accumulation (O, l, V factor),
// the softmax (running maxima, LSE sums) and the rows' Q shifts (q . mean(K), K's smoothing shift: LSE only)
template <int D, bool LSE, bool WIN>
struct RowState {
    static constexpr bool kLse = LSE;
    PvAccum<D, LSE> pv;
    Softmax<LSE, WIN> softmax;
    float qshift0 = 0.f;  // set by the Q prologue
    float qshift1 = 0.f;
};

// D = 128: P~V in two column halves, m64n64 into ba (V^T rows from dv) or m64n72 into bb (rows from dvb, with the
// 8 rows of ones: the row sums); one k32 step of a half
template <int N>
struct PVHalfMma {
    const uint32_t& dvh;
    float (&acc)[N];
    uint32_t (&pa)[4][4];
    template <typename First>
    __device__ __forceinline__ void operator()(First, int kk) const {
        const uint64_t db = desc_make(dvh + desc_step(32 * kk), desc_hi(kBN));
        if constexpr (N == 32) wgmma_pv64<!First::value>(acc, pa[kk], db);
        else wgmma_pv72<!First::value>(acc, pa[kk], db);
    }
};
// one half: the four k32 steps, committed as one group
struct PVHalf {
    uint32_t (&pa)[4][4];
    template <int N>
    __device__ __forceinline__ void operator()(float (&acc)[N], uint32_t dvh) const {
        PVHalfMma<N> mma{dvh, acc, pa};
        wg_fence();
        mma(std::true_type{}, 0);
#pragma unroll
        for (int kk = 1; kk < 4; ++kk) mma(std::false_type{}, kk);
        wg_commit();
    }
};
template <int N>
struct PVHalfIssue {
    const PVHalf& issue_half;
    float (&acc)[N];
    const uint32_t& dvh;
    __device__ __forceinline__ void operator()() const { issue_half(acc, dvh); }
};
// merging the halves: o's first 8 column chunks from ba; the row sums and the last 8 chunks from bb
template <typename PV>
struct MergeA {
    PV& pv;
    float (&ba)[32];
    float& al0;
    float& al1;
    __device__ __forceinline__ void operator()() const { pv.fold(ba, 0, 8, al0, al1); }
};
template <typename PV>
struct MergeB {
    PV& pv;
    float (&bb)[36];
    float& al0;
    float& al1;
    __device__ __forceinline__ void operator()() const {
        pv.add_sums(bb + 32, al0, al1);
        pv.fold(bb, 8, 8, al0, al1);
    }
};

// Q prologue: rows lrow0 / lrow0 + 8 of the prefetched registers pf, this lane's quarter of the channels (the 8-channel
// chunks 4c + t4), quantized to INT8 with one scale per row pair into the warpgroup's Q image sQp; the per-channel
// values go to shared memory se (buffer by tile parity: the previous tile's epilogue may still read the other one):
// V scale and mean for the epilogue, K mean for the Q shift.
// Sets qs, the rows' Q scale (log2 domain, sm_scale folded in), and with the LSE qshift0 / qshift1 (q . mean(K) per
// row: K's smoothing shift, which only enters the LSE).
template <int D, typename T, bool LSE>
__device__ __forceinline__ void q_prologue(const SageAttnParams& p, const QPre<D>& pf, float* se, uint8_t* sQp,
                                               int cw, int ltid, int lrow0, int t4, float& qs, float& qshift0,
                                               float& qshift1) {
    constexpr bool kQShift = LSE;
    constexpr int QC = D / 4;  // Q channels per lane
#pragma unroll
    for (int u = 0; u < chan_per_thread(D); ++u) {
        const int ch = ltid + 128 * u;
        if (ch < D) {
            se[ch] = pf.vsc[u];
            se[D + ch] = pf.vmn[u];
            if constexpr (kQShift) se[2 * D + ch] = pf.km[u];
        }
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
        *reinterpret_cast<uint2*>(sQp + img_off(lrow0, col, D)) = make_uint2(w0[0], w0[1]);
        *reinterpret_cast<uint2*>(sQp + img_off(lrow0 + 8, col, D)) = make_uint2(w1[0], w1[1]);
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    named_sync(1 + cw, 128);
}

// One block of a consumer's loop, landed in stage s (serial: S(kb), softmax, P~V(kb), merge). While one warpgroup
// runs its softmax the other two keep the tensor cores busy; no wgmma of its own is in flight during its ALU work
// (which would slow it). kscale: this thread's K scale of the block, vfac: its V factor, kmask: some key of it is
// padding-masked (all prefetched one block ahead).
// Two-level accumulation on the row state st (PvAccum): each block's P~V lands in its own accumulator, then
// O = O * alpha + block; O and l stay divided by the current block's V factor (alpha times vfac_prev / vfac_kb).
template <int D, int NWG, bool LSE, bool WIN>
struct BlockStep {
    RowState<D, LSE, WIN>& st;
    const SoftmaxRows& rows;
    const IssueQK<D, NWG>& issue_qk;
    const IssuePV<D, NWG>& issue_pv;
    const uint32_t& dv0;
    const uint32_t& bar_full;
    const uint32_t& bar_empty;
    const int& lane;
    float4* const& stash;  // this thread's O stash (D = 256)
    __device__ __forceinline__ void operator()(int s, uint32_t ph, int kb, float kscale, float vfac, int kmask) const {
        using S = Smem<D, NWG>;
        constexpr int kBlk = pv_n(D) / 2;  // P~V block accumulator registers (the last 4: row sums)
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
            st.softmax.online_softmax(rows, acc, kb, kscale, kmask, sf, al0, al1);
            pack_p(sf, pa);
        }
        PvAccum<D, LSE>& pv = st.pv;
        pv.next_vfac(vfac, al0, al1);
        const uint32_t dv = dv0 + (uint32_t)s * (S::VSTRIDE >> 4);
        if constexpr (D == 128) {
            // P~V in two column halves: 32 + 36 accumulator registers (all 68 live at once do not fit)
            float ba[32], bb[36];
            const uint32_t dvb = dv + ((64 * kBN) >> 4);  // V^T rows 64.. (rows of kBN bytes)
            // one half: m64n64 into ba (V^T rows from dv) or m64n72 into bb (rows from dvb)
            PVHalf issue_half{pa};
            PVHalfIssue<32> issue_a{issue_half, ba, dv};
            PVHalfIssue<36> issue_b{issue_half, bb, dvb};
            MergeA<PvAccum<D, LSE>> merge_a{pv, ba, al0, al1};
            MergeB<PvAccum<D, LSE>> merge_b{pv, bb, al0, al1};
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
        } else if constexpr (D == 256) {
            // P~V in four 64-column quarters, one after the other (32, 32, 32, 36 accumulator registers: O takes 128)
            PVHalf issue_half{pa};
#pragma unroll
            for (int q = 0; q < 3; ++q) {
                float ba[32];
                issue_half(ba, dv + (uint32_t)q * ((64 * kBN) >> 4));
                wg_wait<0>();
                reg_fence(ba);
                pv.fold(ba, 8 * q, 8, al0, al1);
            }
            float bb[36];  // V^T rows 192..263: the last 64 channels and the 8 rows of ones (the row sums)
            issue_half(bb, dv + 3u * ((64 * kBN) >> 4));
            wg_wait<0>();
            reg_fence(bb);
            reg_fence(pa);
            if (lane == 0) mbar_arrive(bar_empty + 8 * s);
            pv.add_sums(bb + 32, al0, al1);
            constexpr int kRegCh = 8 - o_stash(D, LSE) / 4;  // this quarter's chunks in registers, then the stash
            pv.fold(bb, 24, kRegCh, al0, al1);
            PvAccum<D, LSE>::fold_stashed(stash, bb + 4 * kRegCh, al0, al1);
        } else {
            float blk[kBlk];
            wg_fence();
            issue_pv(blk, pa, s);
            wg_wait<0>();
            reg_fence(blk);
            reg_fence(pa);
            if (lane == 0) mbar_arrive(bar_empty + 8 * s);
            pv.merge(blk, al0, al1);
        }
    }
};

}  // namespace sage::hopper

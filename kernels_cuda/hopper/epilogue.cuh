// Hopper path: a consumer's end of a work item. The split-tail combine (parts of a split tile meet in the workspace;
// the last to arrive combines them) and the epilogue (O / l x V scale (+ mean(V)) in the caller's layout and dtype,
// the LSE on request).
#pragma once
#include "wgmma.cuh"
#include "tile_scheduler.cuh"
#include "../common/quant.cuh"

namespace sage::hopper {

// Split tail: a part's rows as normalised partial output + log2 row sum; the last part to arrive combines all parts
// (in part order: deterministic) into o and l for the epilogue. skip (false on entry) is set when this part stores
// nothing (another part combines). sit: the work item (item again, not kept live across the block loop: that cost D=64 registers).
template <int D, int NWG, typename RS>
__device__ __forceinline__ void split_combine(const Ws& w, const Item& sit, uint8_t* hsmem, int cw, int ltid, RS& st,
                                              bool& skip) {
    using S = Smem<D, NWG>;
    constexpr bool LSE = RS::kLse;
    float(&o)[D / 2] = st.pv.o;
    float &l0 = st.pv.l0, &l1 = st.pv.l1;
    const float m0 = st.softmax.m0, m1 = st.softmax.m1, vfac_prev = st.pv.vfac_prev;
    if (!LSE && sit.split >= 0) {  // (plan splits no LSE call)
        constexpr int kSlot = (D / 8 + 1) * 128;  // float4 per (part, consumer): D/8 per thread + the sums
        const int64_t pstride = (int64_t)NWG * kSlot;
        float4* mine = w.part + ((int64_t)sit.split * w.parts * NWG + cw) * kSlot + ltid;
        {
            const float i0 = l0 != 0.f ? 1.f / l0 : 0.f, i1 = l1 != 0.f ? 1.f / l1 : 0.f;  // NaN l stays NaN
            float4* dst = mine + sit.part * pstride;
#pragma unroll
            for (int i = 0; i < D / 8; ++i)
                dst[i * 128] = make_float4(o[4 * i] * i0, o[4 * i + 1] * i0, o[4 * i + 2] * i1,
                                           o[4 * i + 3] * i1);
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
}

// Where a consumer thread's two rows of a work item go: rows row0 / row1 of batch b, head h (bhq: b Hq + h) of a
// sequence of sq rows; O0 / O1: their first channel of this lane in the output, stored where st0 / st1 (the row
// inside the sequence and not skipped: another split part stores it); inv0 / inv1: 1 / l (0 for an empty row).
// (The caller computes the addresses and predicates: inside the epilogue the compiler shaped the store predicates
// differently, and the SASS changed.)
template <typename T>
struct OutRows {
    int b, h;
    int64_t bhq;
    int sq, row0, row1, t4;
    T* O0;
    T* O1;
    bool st0, st1, skip;
    float inv0, inv1;
};

// Epilogue of a work item: the rows' final state st (O, l, the softmax's maxima and LSE sums, the Q shifts) into
// the output rows r; sepi: the per-channel V scale and mean staged by the Q prologue.
template <int D, typename T, typename RS>
__device__ __forceinline__ void epilogue(const SageAttnParams& p, const float* sepi, const OutRows<T>& r, RS& st) {
    constexpr bool LSE = RS::kLse;
    const float(&o)[D / 2] = st.pv.o;
    const float l0 = st.pv.l0, l1 = st.pv.l1, inv0 = r.inv0, inv1 = r.inv1;
    const int t4 = r.t4;
    // smooth V: + mean(V) on rows that attended to something (the staged mean is 0 without smooth V)
    const float f0 = l0 != 0.f ? 1.f : 0.f, f1 = l1 != 0.f ? 1.f : 0.f;
#pragma unroll
    for (int c = 0; c < D / 32; ++c) {  // o[4i ..] with i = 4c + q holds channels 32c + 8 t4 + 2q, + 1 (vcol)
        uint32_t r0[4], r1[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const int i = 4 * c + q, ch = 32 * c + 8 * t4 + 2 * q;
            const float2 vv = *reinterpret_cast<const float2*>(sepi + ch);
            const float2 mv = *reinterpret_cast<const float2*>(sepi + D + ch);
            r0[q] = pack2<T>(fmaf(mv.x, f0, o[4 * i] * inv0 * vv.x), fmaf(mv.y, f0, o[4 * i + 1] * inv0 * vv.y));
            r1[q] = pack2<T>(fmaf(mv.x, f1, o[4 * i + 2] * inv1 * vv.x), fmaf(mv.y, f1, o[4 * i + 3] * inv1 * vv.y));
        }
        if (r.st0) *reinterpret_cast<uint4*>(r.O0 + 32 * c) = make_uint4(r0[0], r0[1], r0[2], r0[3]);
        if (r.st1) *reinterpret_cast<uint4*>(r.O1 + 32 * c) = make_uint4(r1[0], r1[1], r1[2], r1[3]);
    }
    st.softmax.finalize();
    if (LSE && t4 == 0 && !r.skip) {
        float* L = p.cu_seqlens_q ? p.lse + r.h * p.lse_sh + tok0_q(p, r.b) : p.lse + r.bhq * p.Sq;
        const float ss = p.sm_scale;
        const auto& sm = st.softmax;
        if (r.row0 < r.sq) L[r.row0] = sm.lse(sm.m0, sm.ls0, st.qshift0, ss);
        if (r.row1 < r.sq) L[r.row1] = sm.lse(sm.m1, sm.ls1, st.qshift1, ss);
    }
}

}  // namespace sage::hopper

// The portable path's attention body (mma.sync): INT8/INT4 Q K^T, fp32 online softmax, FP8 or FP16 P~V.
#pragma once
#include "traits.cuh"
#include "../common/quant.cuh"
#include "../common/ptx.cuh"

namespace sage::portable {

// ----------------------------------------------------------------------------------------------
// 3. attention.
// CTA = 4 warps x WQ query rows (WQ/16 m16 tiles per warp, sharing every K/V fragment);
// KV blocks of 64 keys, double-buffered with cp.async.
// Q fragments: the CTA's Q tile stays in shared memory (registers go to the warp's two m-tiles' accumulators) and
// each k-step reloads its A fragments with ldmatrix.
template <int D, int PV, int WQ, int DB>
struct AttnSmem {
    static constexpr int KSTR = DB + 16;                      // bytes per quantized K (and Q) row + pad
    static constexpr int VROWB = PV != PV_FP8_MMA ? kBK * 2 : kBK;  // bytes per V^T row
    static constexpr int VSTR = VROWB + 16;
    static constexpr int KBYTES = kBK * KSTR, VBYTES = D * VSTR;
    static constexpr int QBYTES = 4 * WQ * KSTR;
    static constexpr int TOTAL = 2 * (KBYTES + VBYTES) + QBYTES;
};

struct AttnWs {  // the pre-passes' outputs the attention kernel reads
    const int8_t* qi8; const float* qscale; const float* qshift;
    const int8_t* ki8; const float* kscale;
    const uint8_t* vt; const float* vscale; const float* vmean;
    const float* ds; int nqb;
    int sq_pad, skv_pad;
};

// cp.async of KV block kb (K rows, V^T rows) into shared-memory buffer buf
template <int D, int PV, int WQ, int DB>
struct AttnLoadTile {
    using S = AttnSmem<D, PV, WQ, DB>;
    uint8_t* const& sK;
    uint8_t* const& sV;
    const int& tid;
    const uint8_t* const& Kg;
    const uint8_t* const& Vg;
    const int& skv_pad;
    __device__ __forceinline__ void operator()(int kb, int buf) const {
        constexpr int VEL = PV != PV_FP8_MMA ? 2 : 1;
        uint8_t* dK = sK + buf * S::KBYTES;
        uint8_t* dV = sV + buf * S::VBYTES;
#pragma unroll
        for (int it = 0; it < kBK * DB / 16 / kThreads; ++it) {
            const int i = tid + it * kThreads;
            const int r = i / (DB / 16), c = i % (DB / 16);
            cp_async16(dK + r * S::KSTR + c * 16, Kg + (int64_t)(kb * kBK + r) * DB + c * 16);
        }
#pragma unroll
        for (int it = 0; it < D * S::VROWB / 16 / kThreads; ++it) {
            const int i = tid + it * kThreads;
            const int r = i / (S::VROWB / 16), c = i % (S::VROWB / 16);
            cp_async16(dV + r * S::VSTR + c * 16, Vg + (int64_t)r * skv_pad * VEL + (int64_t)kb * S::VROWB + c * 16);
        }
    }
};

// zero a set of MMA accumulator fragments ([m-tile][n8 tile][4])
template <typename X, int M, int N>
__device__ __forceinline__ void zero_frags(X (&a)[M][N][4]) {
#pragma unroll
    for (int mt = 0; mt < M; ++mt)
#pragma unroll
        for (int j = 0; j < N; ++j) a[mt][j][0] = a[mt][j][1] = a[mt][j][2] = a[mt][j][3] = 0;
}

// S = Q K^T (int32) of the KV block in shared memory at cK, for the warp's MT m-tiles; each K fragment feeds the MT
// m-tiles. Q fragments: reloaded with ldmatrix from the CTA's Q tile (cQ). lrow / lbyte: this lane's ldmatrix row and
// byte offset.
template <int D, int PV, int WQ, int QKM>
__device__ __forceinline__ void attn_qk(int (&acc)[WQ / 16][8][4], uint32_t cQ, uint32_t cK, int lrow, int lbyte) {
    constexpr int DB = qk_row_bytes(D, QKM);
    using S = AttnSmem<D, PV, WQ, DB>;
    constexpr int MT = WQ / 16;
    zero_frags(acc);
#pragma unroll
    for (int c = 0; c < DB / 32; ++c) {  // k-steps of 32 bytes (k32 s8 or k64 s4)
        uint32_t qa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            ldsm_x4(cQ + mt * 16 * S::KSTR + c * 32, qa[mt][0], qa[mt][1], qa[mt][2], qa[mt][3]);
#pragma unroll
        for (int np = 0; np < 4; ++np) {
            uint32_t b0, b1, b2, b3;
            ldsm_x4(cK + (np * 16 + lrow) * S::KSTR + c * 32 + lbyte, b0, b1, b2, b3);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                if constexpr (QKM == QK_I4_MMA) {
                    mma_s4(acc[mt][2 * np], qa[mt], b0, b1);
                    mma_s4(acc[mt][2 * np + 1], qa[mt], b2, b3);
                } else {
                    mma_s8(acc[mt][2 * np], qa[mt], b0, b1);
                    mma_s8(acc[mt][2 * np + 1], qa[mt], b2, b3);
                }
            }
        }
    }
}

// The online softmax of one 64-key block for the warp's MT m-tiles: the scores in acc (int32) become fp32 in place,
// times one Q scale (qs) and one K scale per thread, + Delta S ("4b"), masked (sequence end, key padding, causal
// diagonal); then P~ (scaled by 448 in the FP8 modes) in the same registers, the running max m and row sums l
// updated, al the factors that rescale O.
template <int PV, int WQ, int QKM>
__device__ __forceinline__ void attn_softmax(int (&acc)[WQ / 16][8][4], float (&m)[WQ / 16][2], float (&l)[WQ / 16][2],
                                             float (&al)[WQ / 16][2], const SageAttnParams& p, const AttnWs& w,
                                             const float* ksc, float qs, int kb, int skv, int q0, int diag, int wrow,
                                             const uint8_t* mrow, int64_t bhq, int qb, int skv_pad, int g, int t) {
    constexpr bool Q4 = QKM != QK_I8;
    constexpr int MT = WQ / 16;
    const float sc = qs * ksc[kb * 4 + t];  // one Q scale and one K scale per thread; log2 domain
    const int kbase = kb * kBK;
    // a sliding window cuts the block for some row of the warp (its last row has the latest window start)
    const bool wcut = p.window_keys > 0 && kbase <= wrow + WQ - 1 + diag - p.window_keys;
    const bool need_mask = (kbase + kBK > skv) || (mrow != nullptr) || wcut ||
                           (p.causal && kbase + kBK - 1 > q0 + diag);
    bool kok[8][2];
    if (need_mask) {
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int key = kbase + 8 * j + 2 * t + e;
                bool ok = key < skv;
                if (ok && mrow) ok = mrow[key] != 0;
                kok[j][e] = ok;
            }
    }
    float2 dsv[Q4 ? 8 : 1];
    if constexpr (Q4) {
        const float* dr = w.ds + (bhq * w.nqb + qb) * (int64_t)skv_pad + kbase + 2 * t;
#pragma unroll
        for (int j = 0; j < 8; ++j) dsv[j] = *reinterpret_cast<const float2*>(dr + 8 * j);
    }
    // P~ (scaled by 448 in the FP8 modes) in the S registers; row sums into l
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        float (&s)[8][4] = *reinterpret_cast<float (*)[8][4]>(&acc[mt][0][0]);
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[j][e] = small_i2f(acc[mt][j][e]) * sc;
        if constexpr (Q4) {  // + Delta S of the CTA's Q-smoothing block (already x sm_scale x log2 e)
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                s[j][0] += dsv[j].x; s[j][1] += dsv[j].y;
                s[j][2] += dsv[j].x; s[j][3] += dsv[j].y;
            }
        }
        if (need_mask) {
            const int r0 = wrow + mt * 16 + g, r1 = r0 + 8;
            // row r sees the keys (lo_r, hi_r]: the causal diagonal and the sliding window
            const int hi0 = p.causal ? r0 + diag : INT_MAX, hi1 = p.causal ? r1 + diag : INT_MAX;
            const int lo0 = p.window_keys > 0 ? r0 + diag - p.window_keys : INT_MIN;
            const int lo1 = p.window_keys > 0 ? r1 + diag - p.window_keys : INT_MIN;
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int key = kbase + 8 * j + 2 * t + e;
                    if (!kok[j][e] || key > hi0 || key <= lo0) s[j][e] = -INFINITY;
                    if (!kok[j][e] || key > hi1 || key <= lo1) s[j][2 + e] = -INFINITY;
                }
        }
        float mx0 = m[mt][0], mx1 = m[mt][1];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            mx0 = fmaxf(mx0, fmaxf(s[j][0], s[j][1]));
            mx1 = fmaxf(mx1, fmaxf(s[j][2], s[j][3]));
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        const float mu0 = mx0 == -INFINITY ? 0.f : mx0;
        const float mu1 = mx1 == -INFINITY ? 0.f : mx1;
        al[mt][0] = fast_exp2(m[mt][0] - mu0);
        al[mt][1] = fast_exp2(m[mt][1] - mu1);
        m[mt][0] = mx0;
        m[mt][1] = mx1;
        // FP8 modes: P~ * 448 directly (exp2 of s - m + log2 448); l then carries the factor 448 too
        const float pm0 = PV == PV_FP16 ? mu0 : mu0 - kLog2Fp8Max;
        const float pm1 = PV == PV_FP16 ? mu1 : mu1 - kLog2Fp8Max;
        float rs0 = 0.f, rs1 = 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            s[j][0] = fast_exp2(s[j][0] - pm0); s[j][1] = fast_exp2(s[j][1] - pm0);
            s[j][2] = fast_exp2(s[j][2] - pm1); s[j][3] = fast_exp2(s[j][3] - pm1);
            rs0 += s[j][0] + s[j][1];
            rs1 += s[j][2] + s[j][3];
        }
        l[mt][0] = l[mt][0] * al[mt][0] + rs0;
        l[mt][1] = l[mt][1] * al[mt][1] + rs1;
    }
}

// P~ fragments (A operand of the P~V MMA) from the fp32 P~ in the S registers
template <int PV, int MT>
__device__ __forceinline__ void attn_pack_p(int (&acc)[MT][8][4], uint32_t (&pa)[MT][PV == PV_FP8_MMA ? 2 : 4][4]) {
    constexpr int NKK = PV == PV_FP8_MMA ? 2 : 4;  // k-steps over the 64 keys
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const float (&s)[8][4] = *reinterpret_cast<const float (*)[8][4]>(&acc[mt][0][0]);
#pragma unroll
        for (int kk = 0; kk < NKK; ++kk) {
            if constexpr (PV == PV_FP8_MMA) {
                // slots follow the permuted key order of V^T (see quant_v_kernel)
                const int j = 4 * kk;
                pa[mt][kk][0] = cvt_e4m3x2(s[j][0], s[j][1]) | (cvt_e4m3x2(s[j + 1][0], s[j + 1][1]) << 16);
                pa[mt][kk][1] = cvt_e4m3x2(s[j][2], s[j][3]) | (cvt_e4m3x2(s[j + 1][2], s[j + 1][3]) << 16);
                pa[mt][kk][2] = cvt_e4m3x2(s[j + 2][0], s[j + 2][1]) | (cvt_e4m3x2(s[j + 3][0], s[j + 3][1]) << 16);
                pa[mt][kk][3] = cvt_e4m3x2(s[j + 2][2], s[j + 2][3]) | (cvt_e4m3x2(s[j + 3][2], s[j + 3][3]) << 16);
            } else if constexpr (PV == PV_FP16) {
                pa[mt][kk][0] = pack2<__half>(s[2 * kk][0], s[2 * kk][1]);
                pa[mt][kk][1] = pack2<__half>(s[2 * kk][2], s[2 * kk][3]);
                pa[mt][kk][2] = pack2<__half>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
                pa[mt][kk][3] = pack2<__half>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
            } else {  // P~ * 448 rounded to e4m3, carried as fp16
                pa[mt][kk][0] = e4m3x2_to_f16x2(cvt_e4m3x2(s[2 * kk][0], s[2 * kk][1]));
                pa[mt][kk][1] = e4m3x2_to_f16x2(cvt_e4m3x2(s[2 * kk][2], s[2 * kk][3]));
                pa[mt][kk][2] = e4m3x2_to_f16x2(cvt_e4m3x2(s[2 * kk + 1][0], s[2 * kk + 1][1]));
                pa[mt][kk][3] = e4m3x2_to_f16x2(cvt_e4m3x2(s[2 * kk + 1][2], s[2 * kk + 1][3]));
            }
        }
    }
}

// P~V of the block in shared memory at cV with two-level accumulation: each 64-key block's P~V in its own fp32
// accumulator, then O = O*alpha + block
template <int D, int PV, int WQ, int DB, int MT>
__device__ __forceinline__ void attn_pv(float (&o)[MT][D / 8][4], uint32_t (&pa)[MT][PV == PV_FP8_MMA ? 2 : 4][4],
                                        float (&al)[MT][2], uint32_t cV, int lrow, int lbyte) {
    using S = AttnSmem<D, PV, WQ, DB>;
    constexpr int NKK = PV == PV_FP8_MMA ? 2 : 4;
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
        float tmp[MT][2][4];
        zero_frags(tmp);
#pragma unroll
        for (int kk = 0; kk < NKK; ++kk) {
            uint32_t b0, b1, b2, b3;
            ldsm_x4(cV + (dp * 16 + lrow) * S::VSTR + kk * 32 + lbyte, b0, b1, b2, b3);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                if constexpr (PV == PV_FP8_MMA) {
                    mma_e4m3(tmp[mt][0], pa[mt][kk], b0, b1);
                    mma_e4m3(tmp[mt][1], pa[mt][kk], b2, b3);
                } else {
                    mma_f16(tmp[mt][0], pa[mt][kk], b0, b1);
                    mma_f16(tmp[mt][1], pa[mt][kk], b2, b3);
                }
            }
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int n = 0; n < 2; ++n) {
                float* oo = o[mt][2 * dp + n];
                oo[0] = oo[0] * al[mt][0] + tmp[mt][n][0];
                oo[1] = oo[1] * al[mt][0] + tmp[mt][n][1];
                oo[2] = oo[2] * al[mt][1] + tmp[mt][n][2];
                oo[3] = oo[3] * al[mt][1] + tmp[mt][n][3];
            }
    }
}

// Epilogue: O / l (x V scale in the FP8 modes, + mean(V) with smooth V) in the caller's layout and dtype for the rows
// < sq of the warp's m-tiles; the LSE on request
template <int D, int PV, typename T, int MT>
__device__ __forceinline__ void attn_epilogue(const SageAttnParams& p, const AttnWs& w, float (&o)[MT][D / 8][4],
                                              float (&m)[MT][2], float (&l)[MT][2], int b, int h, int64_t bhq,
                                              int64_t bhk, int sq, int sq_pad, int wrow, int g, int t) {
    const float* vscale = w.vscale;
    const float* qshift = w.qshift;
    T* O = static_cast<T*>(p.o) + b * p.o_sb + h * p.o_sh + tok0_q(p, b) * p.o_ss;
    const float* vsc = vscale + bhk * D;
    const float* vmn = p.smooth_v ? w.vmean + bhk * D : nullptr;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        float l0 = l[mt][0], l1 = l[mt][1];
        l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
        l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
        l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
        l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
        // empty row (no visible key): l == 0 exactly; a NaN l (non-finite input) must not pass as empty
        const float inv0 = l0 != 0.f ? 1.f / l0 : 0.f;
        const float inv1 = l1 != 0.f ? 1.f / l1 : 0.f;
        const int row0 = wrow + mt * 16 + g, row1 = row0 + 8;
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) {
            const int col = nt * 8 + 2 * t;
            float v0 = 1.f, v1 = 1.f;
            if constexpr (PV != PV_FP16) {
                v0 = vsc[col];  // l already carries the 448 of P~
                v1 = vsc[col + 1];
            }
            float a00 = o[mt][nt][0] * inv0 * v0, a01 = o[mt][nt][1] * inv0 * v1;
            float a10 = o[mt][nt][2] * inv1 * v0, a11 = o[mt][nt][3] * inv1 * v1;
            if (vmn) {  // smooth_v: the mean comes back on rows with a visible key
                const float m0 = vmn[col], m1 = vmn[col + 1];
                if (l0 != 0.f) { a00 += m0; a01 += m1; }
                if (l1 != 0.f) { a10 += m0; a11 += m1; }
            }
            if (row0 < sq) *reinterpret_cast<uint32_t*>(O + (int64_t)row0 * p.o_ss + col) = pack2<T>(a00, a01);
            if (row1 < sq) *reinterpret_cast<uint32_t*>(O + (int64_t)row1 * p.o_ss + col) = pack2<T>(a10, a11);
        }
        if (p.lse && t == 0) {
            // (B, Hq, Sq); varlen: (Hq, total_q)
            float* L = p.cu_seqlens_q ? p.lse + h * p.lse_sh + tok0_q(p, b) : p.lse + bhq * p.Sq;
            const float* sh = qshift + bhq * sq_pad;
            const float lo = PV == PV_FP16 ? 0.f : kLnFp8Max;
            if (row0 < sq) L[row0] = l0 != 0.f ? m[mt][0] * kLn2 + (logf(l0) - lo) + sh[row0] : -INFINITY;
            if (row1 < sq) L[row1] = l1 != 0.f ? m[mt][1] * kLn2 + (logf(l1) - lo) + sh[row1] : -INFINITY;
        }
    }
}

template <int D, int PV, typename T, int WQ, int QKM>
__device__ __forceinline__ void attn_body(const SageAttnParams& p, const AttnWs& w) {
    constexpr int DB = qk_row_bytes(D, QKM);       // bytes per quantized Q/K row; one MMA k-step = 32 bytes
    const int8_t* qi8 = w.qi8; const float* qscale = w.qscale;
    const int8_t* ki8 = w.ki8; const float* kscale = w.kscale;
    const uint8_t* vt = w.vt;
    const int sq_pad = w.sq_pad, skv_pad = w.skv_pad;
    using S = AttnSmem<D, PV, WQ, DB>;
    constexpr int MT = WQ / 16, BQ = 4 * WQ;
    extern __shared__ __align__(128) uint8_t smem[];
    uint8_t* sK = smem;
    uint8_t* sV = smem + 2 * S::KBYTES;
    uint8_t* sQ = smem + 2 * (S::KBYTES + S::VBYTES);

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int qb = gridDim.x - 1 - blockIdx.x;  // heaviest (causal) blocks first
    const int h = blockIdx.y, b = blockIdx.z;
    const int hk = h / (p.Hq / p.Hkv);
    const int q0 = qb * BQ;
    const int sq = len_q(p, b), skv = len_k(p, b);  // this sequence (varlen) or Sq/Skv
    if (q0 >= sq) return;  // varlen: past this sequence's end
    const int64_t bhq = (int64_t)b * p.Hq + h, bhk = (int64_t)b * p.Hkv + hk;
    const int wrow = q0 + warp * WQ;  // first row of this warp

    const float qs = qscale[(bhq * (sq_pad / WQ) + wrow / WQ) * 8 + g] * p.sm_scale * kLog2e;

    const int diag = skv - sq;  // key j visible to row i iff j <= i + diag
    int kv_end = skv;
    if (p.causal) kv_end = min(kv_end, q0 + BQ + diag);
    const int nkb = kv_end > 0 ? (kv_end + kBK - 1) / kBK : 0;
    // sliding window: blocks before the window of the CTA's first row lie outside every row's window; skipped
    const int wlo = p.window_keys > 0 ? q0 + diag - p.window_keys + 1 : 0;
    const int kb_first = wlo > 0 ? wlo / kBK : 0;
    const uint8_t* mrow = p.kmask ? p.kmask + (int64_t)b * p.kmask_sb : nullptr;

    float o[MT][D / 8][4];
    float m[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int i = 0; i < D / 8; ++i) o[mt][i][0] = o[mt][i][1] = o[mt][i][2] = o[mt][i][3] = 0.f;
        m[mt][0] = m[mt][1] = -INFINITY;
        l[mt][0] = l[mt][1] = 0.f;
    }

    const uint8_t* Kg = reinterpret_cast<const uint8_t*>(ki8) + bhk * skv_pad * DB;
    constexpr int VEL = PV != PV_FP8_MMA ? 2 : 1;
    const uint8_t* Vg = vt + bhk * D * (int64_t)skv_pad * VEL;
    const float* ksc = kscale + bhk * (skv_pad / kBK) * 4;

    AttnLoadTile<D, PV, WQ, DB> load_tile{sK, sV, tid, Kg, Vg, skv_pad};

    {  // the CTA's Q tile joins the first cp.async group
        const uint8_t* Qg = reinterpret_cast<const uint8_t*>(qi8) + (bhq * sq_pad + q0) * DB;
#pragma unroll
        for (int it = 0; it < BQ * DB / 16 / kThreads; ++it) {
            const int i = tid + it * kThreads;
            const int r = i / (DB / 16), c = i % (DB / 16);
            cp_async16(sQ + r * S::KSTR + c * 16, Qg + (int64_t)r * DB + c * 16);
        }
        if (nkb <= kb_first) cp_async_commit();
    }
    if (nkb > kb_first) { load_tile(kb_first, kb_first & 1); cp_async_commit(); }
    // ldmatrix addresses of the A (Q) fragments: matrix mi covers rows +8*(mi%2), bytes +16*(mi/2)
    const uint32_t cQ = smem_u32(sQ) + (warp * WQ + ((lane >> 3) & 1) * 8 + (lane & 7)) * S::KSTR + (lane >> 4) * 16;
    // ldmatrix lane address pieces: matrix mi = lane / 8 covers rows +8*(mi/2), bytes +16*(mi%2)
    const int lrow = (lane >> 4) * 8 + (lane & 7), lbyte = ((lane >> 3) & 1) * 16;

    for (int kb = kb_first; kb < nkb; ++kb) {
        if (kb + 1 < nkb) {
            load_tile(kb + 1, (kb + 1) & 1);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const uint32_t cK = smem_u32(sK + (kb & 1) * S::KBYTES);
        const uint32_t cV = smem_u32(sV + (kb & 1) * S::VBYTES);

        // S = Q K^T (int32); each K fragment feeds the MT m-tiles
        int acc[MT][8][4];
        attn_qk<D, PV, WQ, QKM>(acc, cQ, cK, lrow, lbyte);
        float al[MT][2];
        attn_softmax<PV, WQ, QKM>(acc, m, l, al, p, w, ksc, qs, kb, skv, q0, diag, wrow, mrow, bhq, qb, skv_pad, g, t);
        constexpr int NKK = PV == PV_FP8_MMA ? 2 : 4;  // k-steps over the 64 keys
        uint32_t pa[MT][NKK][4];
        attn_pack_p<PV>(acc, pa);
        attn_pv<D, PV, WQ, DB>(o, pa, al, cV, lrow, lbyte);
        __syncthreads();  // this buffer is refilled two iterations later
    }

    attn_epilogue<D, PV, T>(p, w, o, m, l, b, h, bhq, bhk, sq, sq_pad, wrow, g, t);
}

}  // namespace sage::portable

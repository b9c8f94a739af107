// Hopper path: the consumer's online softmax over 128-key blocks (Softmax: a thread's two rows, row0 = its warp
// row g and row1 = g + 8; it owns their running maxima and LSE sums) and the P~ packing into the FP8 wgmma A
// fragments. The masking pieces are small functor structs bound to the consumer's registers (the same code the
// compiler saw when they were lambdas, tools/sass_diff.py).
#pragma once
#include "tile_scheduler.cuh"
#include "../common/quant.cuh"

namespace sage::hopper {

// masked blocks: key attended by the row (inside the sequence, not padded, not past the causal diagonal; the
// sliding window is General's)
struct KeyOk {
    const int& skv;
    const uint8_t* const& mrow;
    const SageAttnParams& p;
    const int& diag;
    __device__ __forceinline__ bool operator()(int key, int row) const {
        return key < skv && (!mrow || mrow[key] != 0) && !(p.causal && key > row + diag);
    }
};

// blocks without padded keys: row r attends to keys kbase + k for k < lim (sequence end, causal diagonal), one
// compare and select per score instead of the general test with its branches
struct Lim {
    const int& skv;
    const SageAttnParams& p;
    const int& diag;
    const int& kbase;
    __device__ __forceinline__ int operator()(int row) const { return min(skv, p.causal ? row + diag + 1 : skv) - kbase; }
};
// per-row visibility of the key 2 t4 + c of the block: a prefix (c < l: the lane's offset folded into l) ...
struct Prefix {
    const int& l;
    __device__ __forceinline__ bool operator()(int c) const { return c < l; }
};
// ... or the general test (padded keys, a sliding window): c > wlo, the row's last key before its window with the
// lane's offset folded in (as the prefix limits: one compare with an immediate per score)
struct General {
    const KeyOk& key_ok;
    const int& kbase;
    const int& t4;
    const int& row;
    const int wlo;
    __device__ __forceinline__ bool operator()(int c) const { return c > wlo && key_ok(kbase + 2 * t4 + c, row); }
};
// General's wlo for a row: its last hidden key before the window (key <= row + diag - window_keys), relative to
// the lane's first key of the block; INT_MIN (a compile-time constant: no test) in kernels without a window
template <bool WIN>
__device__ __forceinline__ int window_lo(const SageAttnParams& p, int row, int diag, int kbase, int t4) {
    if constexpr (!WIN) return INT_MIN;
    return row + diag - p.window_keys - kbase - 2 * t4;
}
// Visits the thread's scores of a block, key 2 t4 + c of the block for c = 8 j + e (a compile-time constant once
// unrolled): step(c, i0, i1), with i0 / i1 the score's index in the accumulator layout for row0 / row1
template <typename Step>
__device__ __forceinline__ void each_key(const Step& step) {
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) step(8 * j + e, 4 * j + e, 4 * j + 2 + e);
}
// the row max over visible scores (hidden ones as INT_MIN, the chain runs through the max only); vis0 / vis1: the
// per-row visibility of key c
template <typename V0, typename V1>
struct MaskedMax {
    int& im0;
    int& im1;
    const int (&acc)[64];
    V0 vis0;
    V1 vis1;
    __device__ __forceinline__ void operator()(int c, int i0, int i1) const {
        im0 = max(im0, vis0(c) ? acc[i0] : INT_MIN);
        im1 = max(im1, vis1(c) ? acc[i1] : INT_MIN);
    }
};
// zeros for the hidden scores after the exponentials
template <typename V0, typename V1>
struct ZeroHidden {
    float (&sf)[64];
    V0 vis0;
    V1 vis1;
    __device__ __forceinline__ void operator()(int c, int i0, int i1) const {
        if (!vis0(c)) sf[i0] = 0.f;
        if (!vis1(c)) sf[i1] = 0.f;
    }
};
// the exponent of one score: int -> float bits (1.5 * 2^23 + x) times the scale minus c
struct Arg {
    const int (&acc)[64];
    const float& sc;
    __device__ __forceinline__ float operator()(int i, float c) const {
        constexpr int kMagic = 0x4B400000;
        return fmaf(__int_as_float(acc[i] + kMagic), sc, -c);
    }
};

// Where a consumer thread's two rows lie (row0, row1 = row0 + 8), for the masks and scales of the online softmax
// (bound to the consumer's registers: the same code as when they were the softmax's own references)
struct SoftmaxRows {
    const int& skv;
    const SageAttnParams& p;
    const int& wrow_min;  // first row of this warpgroup
    const int& diag;      // causal offset skv - sq
    const float& qs;      // this thread's Q scale (log2 domain, sm_scale folded in)
    const KeyOk& key_ok;
    const int& t4;
    const int& row0;
    const int& row1;
};

// The online softmax of a consumer thread's two rows over 128-key blocks (FlashAttention-3's Softmax): it owns the
// rows' running maxima (row_max) and, for the LSE, their fp32 sums (row_sum); online_softmax takes one block,
// finalize / lse end the rows. (O and the tensor-core row sums that normalise it are PvAccum's; the rescale of O by
// alpha is folded into the P~V merge, one FFMA per value.)
template <bool LSE, bool WIN>
struct Softmax {
    float m0 = -INFINITY;  // running row maxima (scaled scores, log2 domain)
    float m1 = -INFINITY;
    float ls0 = 0.f;       // fp32 sums of 448 p over this lane's keys, for the LSE only
    float ls1 = 0.f;
    // S of block kb (int32 wgmma accumulator) -> 448 p per score (fp32, before the e4m3 conversion of pack_p)
    // and the rescale factors alpha. kscale: this thread's K scale of block kb (prefetched one block ahead);
    // kmasked: the block needs the general per-key test (padded keys, or a sliding window cutting it)
    __device__ __forceinline__ void online_softmax(const SoftmaxRows& r, const int (&acc)[64], int kb, float kscale,
                                                   int kmasked, float (&sf)[64], float& al0, float& al1) {
        const int& skv = r.skv;
        const SageAttnParams& p = r.p;
        const int &diag = r.diag, &t4 = r.t4, &row0 = r.row0, &row1 = r.row1;
        const int kbase = kb * kBN;
        const bool need_mask = (kbase + kBN > skv) || kmasked ||
                               (p.causal && kbase + kBN - 1 > r.wrow_min + diag);
        const float sc = r.qs * kscale;  // one Q and one K scale per thread (>= 0); log2 domain
        // (the prefix limits are computed where used: kept live across the exponentials they cost registers)
        Lim lim{skv, p, diag, kbase};
        // Row max on the int32 scores (a lane's scale is >= 0, so the order is the same), then per score one IADD
        // (int -> float bits: 1.5 * 2^23 + x, exact for |x| < 2^22), one FFMA (scale, subtract the max and the
        // 1.5 * 2^23 offset, add log2 448) and EX2. The offset folded into c costs one rounding of c, the same for
        // every score of the row in this block: a uniform factor of at most 1 + 2^-20 relative.
        constexpr float kMagicF = 12582912.f;
        int im0 = INT_MIN, im1 = INT_MIN;
        // masked blocks: a per-row visibility test of the key 2 t4 + c within the block, c = 8 j + e a compile-time
        // constant (the lane's offset 2 t4 is folded into the prefix limits: one compare with an immediate)
        // (the window limits as the prefix limits: computed where used)
        if (!need_mask) {
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                im0 = max(im0, max(acc[4 * j], acc[4 * j + 1]));
                im1 = max(im1, max(acc[4 * j + 2], acc[4 * j + 3]));
            }
        } else if (!kmasked) {  // sequence end / causal diagonal: a row's keys are a prefix of the block
            const int l0 = lim(row0) - 2 * t4, l1 = lim(row1) - 2 * t4;
            each_key(MaskedMax<Prefix, Prefix>{im0, im1, acc, Prefix{l0}, Prefix{l1}});
        } else {
            const General general0{r.key_ok, kbase, t4, row0, window_lo<WIN>(p, row0, diag, kbase, t4)};
            const General general1{r.key_ok, kbase, t4, row1, window_lo<WIN>(p, row1, diag, kbase, t4)};
            each_key(MaskedMax<General, General>{im0, im1, acc, general0, general1});
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
        Arg arg{acc, sc};
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            sf[4 * j] = fast_exp2(arg(4 * j, c0));
            sf[4 * j + 1] = fast_exp2(arg(4 * j + 1, c0));
            sf[4 * j + 2] = fast_exp2(arg(4 * j + 2, c1));
            sf[4 * j + 3] = fast_exp2(arg(4 * j + 3, c1));
        }
        if (need_mask && !kmasked) {
            const int l0 = lim(row0) - 2 * t4, l1 = lim(row1) - 2 * t4;
            each_key(ZeroHidden<Prefix, Prefix>{sf, Prefix{l0}, Prefix{l1}});
        } else if (need_mask) {
            const General general0{r.key_ok, kbase, t4, row0, window_lo<WIN>(p, row0, diag, kbase, t4)};
            const General general1{r.key_ok, kbase, t4, row1, window_lo<WIN>(p, row1, diag, kbase, t4)};
            each_key(ZeroHidden<General, General>{sf, general0, general1});
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
    }
    // the rows' fp32 sums over their four lanes (LSE only)
    __device__ __forceinline__ void finalize() {
        if constexpr (LSE) {
            ls0 += __shfl_xor_sync(0xffffffffu, ls0, 1);
            ls0 += __shfl_xor_sync(0xffffffffu, ls0, 2);
            ls1 += __shfl_xor_sync(0xffffffffu, ls1, 1);
            ls1 += __shfl_xor_sync(0xffffffffu, ls1, 2);
        }
    }
    // after finalize: a row's natural-log LSE (m, ls: the row's maximum and sum; qshift: q . mean(K), K's smoothing
    // shift, times the softmax scale ss); -inf for a row without a visible key
    __device__ __forceinline__ static float lse(float m, float ls, float qshift, float ss) {
        return ls != 0.f ? m * kLn2 + (logf(ls) - kLnFp8Max) + qshift * ss : -INFINITY;
    }
};

// 448 p (fp32) -> the e4m3 A fragments of the four k32 steps of P~V
__device__ __forceinline__ void pack_p(const float (&sf)[64], uint32_t (&pa)[4][4]) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {  // slots follow V^T's permuted key order
        const float* q = sf + 16 * kk;
        pa[kk][0] = cvt_e4m3x2(q[0], q[1]) | (cvt_e4m3x2(q[4], q[5]) << 16);
        pa[kk][1] = cvt_e4m3x2(q[2], q[3]) | (cvt_e4m3x2(q[6], q[7]) << 16);
        pa[kk][2] = cvt_e4m3x2(q[8], q[9]) | (cvt_e4m3x2(q[12], q[13]) << 16);
        pa[kk][3] = cvt_e4m3x2(q[10], q[11]) | (cvt_e4m3x2(q[14], q[15]) << 16);
    }
}

}  // namespace sage::hopper

// Hopper (sm_90a) SageBwd training forward: O, the caller's LSE and the smoothed scores' LSE (what the backward,
// bwd_kernel.cuh, recomputes P from), from the operands sage_patch.kernels.sagebwd prepares (Q^ and K^ INT8 per
// token, K smoothed by its mean, q . mean(K)); the numerics of its Triton forward_kernel (fwd.py) and of the
// reference SageBwdConfig(**KERNEL_LAYOUT):
//   S  = Q^ K^^T                  INT8 wgmma m64n64k32 (exact int32), both operands K-major shared-memory images
//   s  = S k_scale q_scale (tau log2e) in fp32, masked pairs -inf (bottom-right causal, key padding, keys past Skv);
//        s - m in one FFMA (Triton rounds S q_scale, then s, then s - m: P~ may differ in the last fp32 bit)
//   online softmax over blocks of 64 keys (the numerics' block_k: P~ depends on the running maximum), exp2 in fp32,
//   the row sum from the fp32 P~;  O = O alpha + P~ V  with P~ cast to the input dtype in registers as the A operand
//   of a 16-bit wgmma m64n64k16 (fp32 accumulation) and V row-major in shared memory (the transposed-B bit: the
//   image is V's rows as the producer copies them, no transpose)
//   O = O / l (0 on rows with no visible key), lse_s = (m + log2 l) ln 2, lse = lse_s + tau q . mean(K)
// Non-finite inputs: a NaN scale (Q's, K's rows) reaches its row / column through the products and the NaN-propagating
// maximum; V through IEEE arithmetic; rows with no visible key stay 0 (sage_patch/reference/sagebwd.py's rule).
//
// Warp-specialized like the other Hopper kernels: warpgroup 0 is the producer, whose one thread streams each 64-key
// block with TMA (tensor maps built per launch, TfMaps) into a ring of kTfStages stages guarded by mbarriers: K^ and
// V land as their swizzled wgmma images (the maps' 128B / 64B swizzle is img_off's pattern), rows past Skv as zeros,
// with the block's key scales and key padding bytes (full: the copies' bytes, counted by the barrier's transaction
// count; empty: one arrival per consumer thread after its last read); the warpgroup gives its registers to the
// consumers (setmaxnreg). Each of the kTfNwg consumer warpgroups owns 64
// query rows of the CTA's tile and pipelines its blocks as FlashAttention-3 does: S of block j + 1 and P~V of block j
// in flight together, block j + 1's softmax under P~V(j); the other warpgroups' products fill the rest. A warpgroup
// whose rows see no key of a block (causal: blocks past its diagonal) only releases it.
#pragma once
#include <cuda.h>  // CUtensorMap
#include "wgmma.cuh"
#include "../common/ptx.cuh"
#include "../common/quant.cuh"
#include "bwd_traits.cuh"

namespace sage::hopper {

constexpr int kTfKeys = 64;     // keys per block: SageBwd's block_k (the online softmax's step)
// consumer warpgroups (64 query rows each): D = 128 2 (512 threads would cap ptxas at 128 registers per thread, and
// the pipelined loop's O, S and two P~ fragment sets spilled there), D = 64 3 (fits 128)
template <int D> constexpr int kTfNwg = D == 64 ? 3 : 2;
template <int D> constexpr int kTfThreads = 128 * (kTfNwg<D> + 1);
// K/V blocks in the ring: how far the producer's copies run ahead of the consumers (each block's TMA completes on its
// own full barrier, so every free stage has its copies in flight)
constexpr int kTfStages = 6;
// setmaxnreg: the launch gives 65536 / threads registers per thread (a multiple of 8); the producer keeps 24, the
// consumers take the rest (at most 240): 3 consumers 160, 2 240
template <int D>
constexpr int kTfRegs = ((65536 / kTfThreads<D> / 8 * 8) * kTfThreads<D> - 24 * 128) / (128 * kTfNwg<D>) / 8 * 8 > 240
                            ? 240
                            : ((65536 / kTfThreads<D> / 8 * 8) * kTfThreads<D> - 24 * 128) / (128 * kTfNwg<D>) / 8 * 8;

static_assert(kTfRegs<128> == 240 && kTfRegs<64> == 160, "setmaxnreg: the producer's 24 and the consumers' share");

// the key scales' box: a TMA copy must start at a 16-byte aligned global address (a 1D box at another element is an
// illegal instruction), so a block's 64 scales come in a box of 68 from the multiple of 4 at or below their first, at
// element (B Hkv row Skv) % 4 of it
constexpr int kTfScaleBox = 68;

template <int D>
struct TfSmem {
    // per consumer warpgroup its Q^ image (64 rows of D bytes, K-major); per stage the K^ image (64 keys x D bytes),
    // the V image (D / 64 chunks of 64 key rows x 128 bytes: 64 channels of the input dtype, bwd_h16_off), the 64
    // key scales (fp32, in a box of kTfScaleBox from a 16-byte boundary) and 64 key padding bytes (1 = attend; copied
    // only with a mask). The stages start
    // 1024-aligned (the swizzle atoms of the K^ and V images), the scales and padding bytes 128-aligned (TMA's
    // shared-memory alignment)
    static constexpr int QBYTES = 64 * D, Q_OFF = 0;
    static constexpr int K_IN = 0, V_IN = 64 * D, KS_IN = V_IN + 128 * D, VIS_IN = KS_IN + 384;
    static constexpr int STAGE = (VIS_IN + 64 + 1023) / 1024 * 1024;
    static constexpr int STAGE0 = Q_OFF + kTfNwg<D> * QBYTES;
    static constexpr int BAR_OFF = STAGE0 + kTfStages * STAGE;  // full[kTfStages], then empty[kTfStages]
    static constexpr int TOTAL = BAR_OFF + 16 * kTfStages + 1024;  // + slack to align the base to 1024 bytes
    static_assert(4 * kTfScaleBox <= VIS_IN - KS_IN, "the key scales' box overlaps the padding bytes");
    static_assert(TOTAL <= 232448, "more than the 227 KB of shared memory per block");
};

// the CTA's query tile (rows m0..) and its key blocks: [0, nblk) (causal: up to its last row's diagonal)
template <int D>
struct TfTile {
    int m0, nblk;
    __device__ __forceinline__ TfTile(const SageTrainFwdParams& p, int tile) {
        m0 = tile * 64 * kTfNwg<D>;
        const int kend = p.causal ? min(p.Skv, max(m0 + 64 * kTfNwg<D> + p.Skv - p.Sq, 0)) : p.Skv;
        nblk = (kend + kTfKeys - 1) / kTfKeys;
    }
};

// The producer's tensor maps (fwd_train_launch.cu builds them per launch; a __grid_constant__ parameter). Parts of a
// box past a tensor's end land as zeros.
struct TfMaps {
    CUtensorMap k;      // K^ (D, Skv, B Hkv) int8, box (D, 64): one K^ image (128B swizzle at D = 128, 64B at 64)
    CUtensorMap v;      // V (D, Skv, Hkv, B) with the caller's strides, box (64, 64), 128B swizzle: one V chunk
    CUtensorMap ks;     // the key scales flat (B Hkv Skv) fp32, box kTfScaleBox: rank 1, so any Skv (a row of Skv
                        // scales needs no 16-byte stride); around a row the neighbours' scales, which multiply only
                        // masked keys (past Skv) or none
    CUtensorMap kmask;  // key padding (Skv, B or 1 with kmask_sb 0) uint8, box (64, 1); unset without a mask
};

// warpgroup 0: one thread streams the key blocks into the stage ring, each stage's copies counted on its full barrier
template <int D, typename T>
__device__ __forceinline__ void tf_producer(const SageTrainFwdParams& p, const TfMaps& mp, const TfTile<D>& tl,
                                            uint32_t sb, uint32_t full, uint32_t empty, int b, int bkv, int hkv) {
    using S = TfSmem<D>;
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
    if (threadIdx.x != 0) return;
    tma_prefetch_map(&mp.k);
    tma_prefetch_map(&mp.v);
    tma_prefetch_map(&mp.ks);
    if (p.kmask) tma_prefetch_map(&mp.kmask);
    const uint32_t bytes = 64 * D + 128 * D + 4 * kTfScaleBox + (p.kmask ? 64 : 0);
    const int mrow = p.kmask_sb ? b : 0, ks0 = bkv * p.Skv & ~3;
    for (int j = 0; j < tl.nblk; ++j) {
        const int stg = j % kTfStages;
        mbar_wait(empty + 8 * stg, ((uint32_t)(j / kTfStages) & 1u) ^ 1u);
        const uint32_t st = sb + S::STAGE0 + stg * S::STAGE, bar = full + 8 * stg;
        const int n0 = j * kTfKeys;
        mbar_expect_tx(bar, bytes);
        tma_load(st + S::K_IN, &mp.k, bar, 0, n0, bkv);
#pragma unroll
        for (int c = 0; c < D / 64; ++c) tma_load(st + S::V_IN + 8192 * c, &mp.v, bar, 64 * c, n0, hkv, b);
        tma_load(st + S::KS_IN, &mp.ks, bar, ks0 + n0);
        if (p.kmask) tma_load(st + S::VIS_IN, &mp.kmask, bar, n0, mrow);
    }
}

// O (64 x 64 fp32 per 64-channel chunk) (+)= P~ (64 x 16, registers, fp16 / bf16) V (16 keys x 64 channels, smem,
// row-major: the transposed-B bit)
#define SAGE_WGMMA_H16_N64_RS_T(TY, SCALE_D, C) \
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {" SAGE_LIST32 "}, {%32, %33, %34, %35}, " \
                 "%36, " SCALE_D ", 1, 1, 1;\n" \
                 : SAGE_D8(C, 0), SAGE_D8(C, 8), SAGE_D8(C, 16), SAGE_D8(C, 24) \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db))
template <typename T, bool ACC>
__device__ __forceinline__ void wgmma_h16_n64_rs_t(float* d, const uint32_t* a, uint64_t db) {
    if constexpr (std::is_same<T, __half>::value) {
        if constexpr (ACC) SAGE_WGMMA_H16_N64_RS_T("f16", "1", "+f");
        else SAGE_WGMMA_H16_N64_RS_T("f16", "0", "=f");
    } else {
        if constexpr (ACC) SAGE_WGMMA_H16_N64_RS_T("bf16", "1", "+f");
        else SAGE_WGMMA_H16_N64_RS_T("bf16", "0", "=f");
    }
}

template <int D, typename T>
__global__ void __launch_bounds__(kTfThreads<D>, 1) hopper_train_fwd_kernel(const __grid_constant__ SageTrainFwdParams p,
                                                                       const __grid_constant__ TfMaps mp) {
    using S = TfSmem<D>;
    extern __shared__ __align__(1024) uint8_t tsmem_raw[];
    uint8_t* sm = tsmem_raw + smem_pad_1024(tsmem_raw);
    const uint32_t sb = __shfl_sync(0xffffffffu, smem_u32(sm), 0);
    const uint32_t full = sb + S::BAR_OFF, empty = full + 8 * kTfStages;
    const int tid = threadIdx.x;
    // causal calls: the longest tiles (last queries) first
    const int tile = p.causal ? (int)(gridDim.x - 1 - blockIdx.x) : (int)blockIdx.x;
    const TfTile<D> tl(p, tile);
    const int bh = blockIdx.y, b = bh / p.Hq, h = bh % p.Hq, hkv = h / (p.Hq / p.Hkv), bkv = b * p.Hkv + hkv;
    if (tid == 0) {
        // full: the producer's arrival with the stage's byte count; empty: one arrival per consumer thread
        mbar_init_ring(full, empty, kTfStages, 1, 128 * kTfNwg<D>);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (tid < 128) {
        tf_producer<D, T>(p, mp, tl, sb, full, empty, b, bkv, hkv);
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kTfRegs<D>) : "memory");
    const int wg = __shfl_sync(0xffffffffu, (tid >> 7) - 1, 0), ltid = tid & 127;
    const int warp = ltid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    const int sq = p.Sq, skv = p.Skv, diag = skv - sq;
    const int m0 = tl.m0 + 64 * wg;  // this warpgroup's rows
    const int row0 = m0 + 16 * warp + g, row1 = row0 + 8;
    const float tau_log2e = p.sm_scale * kLog2e;

    // Q^ rows of this warpgroup, once (0 past Sq)
    const uint32_t qimg = sb + S::Q_OFF + wg * S::QBYTES;
    {
        uint8_t* qs = sm + S::Q_OFF + wg * S::QBYTES;
        const int8_t* qp = p.q_int + (int64_t)bh * sq * D;
        for (int i = ltid; i < 64 * D / 16; i += 128) {
            const int r = i / (D / 16), c = i % (D / 16);
            uint4 x = make_uint4(0, 0, 0, 0);
            if (m0 + r < sq) x = *reinterpret_cast<const uint4*>(qp + (int64_t)(m0 + r) * D + 16 * c);
            *reinterpret_cast<uint4*>(qs + img_off(r, 16 * c, D)) = x;
        }
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        named_sync(1 + wg, 128);
    }
    const float qs0 = row0 < sq ? p.q_scale[(int64_t)bh * sq + row0] * tau_log2e : 0.f;
    const float qs1 = row1 < sq ? p.q_scale[(int64_t)bh * sq + row1] * tau_log2e : 0.f;
    // the row factor of the scores (below): a zero scale (a zero row of Q, whose S is 0) as the smallest normal, so a
    // masked -inf stays -inf (not -inf * 0 = NaN) and a visible score stays 0; NaN stays NaN
    const float qe0 = qs0 == 0.f ? 1.17549435e-38f : qs0, qe1 = qs1 == 0.f ? 1.17549435e-38f : qs1;
    // this warpgroup's blocks: causal, up to its last row's diagonal (the CTA's later blocks are only released)
    const int kend = p.causal ? min(skv, max(m0 + 64 + diag, 0)) : skv;
    const int nblk = m0 < sq ? (kend + kTfKeys - 1) / kTfKeys : 0;

    constexpr int NC = D / 64;  // 64-channel chunks of O
    float o[NC][32];
#pragma unroll
    for (int c = 0; c < NC; ++c)
#pragma unroll
        for (int i = 0; i < 32; ++i) o[c][i] = 0.f;
    float mx0 = -INFINITY, mx1 = -INFINITY, l0 = 0.f, l1 = 0.f;
    // FlashAttention-3's order within the warpgroup: S of block j + 1 is issued with P~V of block j, and block
    // j + 1's softmax runs while P~V(j) is still in flight (its A fragments stay untouched until it completes: the
    // next block's go to the other set, pa0 / pa1); O is rescaled by block j + 1's alpha after P~V(j) completed,
    // before P~V(j + 1) is issued: the same operations in the same order as a serial loop, so the same results
    const uint32_t qa = desc_lo(qimg);
    auto issue_s = [&](int j, int (&acc)[32], float (&kv)[16]) {
        const int stg = j % kTfStages;
        mbar_wait(full + 8 * stg, (uint32_t)(j / kTfStages) & 1u);
        {
            // this lane's 16 key scales (in their kTfScaleBox box), read here, before the products' wait: read after
            // it (nvcc keeps shared-memory loads behind the wait) their latency was exposed in every block
            const float* ks = reinterpret_cast<const float*>(sm + S::STAGE0 + stg * S::STAGE + S::KS_IN) +
                              (bkv * skv & 3);
#pragma unroll
            for (int i = 0; i < 8; ++i)
#pragma unroll
                for (int e = 0; e < 2; ++e) kv[2 * i + e] = ks[8 * i + 2 * t4 + e];
        }
        const uint32_t ka = desc_lo(sb + S::STAGE0 + stg * S::STAGE + S::K_IN);
        wg_fence();
        wgmma_s8_n64_ss<false>(acc, desc_make(qa, desc_hi(D)), desc_make(ka, desc_hi(D)));
#pragma unroll
        for (int k = 1; k < D / 32; ++k)
            wgmma_s8_n64_ss<true>(acc, desc_make(qa + desc_step(32 * k), desc_hi(D)),
                                  desc_make(ka + desc_step(32 * k), desc_hi(D)));
        wg_commit();
    };
    // block j's softmax from its S (complete): the running maximum and sum, P~ as A fragments into pa, and the
    // factors al0 / al1 by which O is to be rescaled before P~V(j)
    auto softmax = [&](int j, int (&sacc)[32], const float (&kv)[16], uint32_t (&pa)[4][4], float& al0, float& al1) {
        const uint8_t* stp = sm + S::STAGE0 + (j % kTfStages) * S::STAGE;
        const int n0 = j * kTfKeys;
        // s (log2 domain) = S q_scale tau log2e k_scale, as t q with t = S k_scale per key and q per row (the row
        // maximum of s is q times t's, q > 0: rounding is monotone), so exp2(s - m) is one FFMA and MUFU per
        // score. S converts on the FP32 pipe (small_i2f: exact, |S| <= 127 * 127 * 128 < 2^22), not I2F, which
        // shares the quarter-rate pipe with MUFU.EX2 and the F2FP packs (with it that pipe bound the loop: ~1050
        // cycles per 64 x 64 tile and SM at D = 128). Accumulator element 4 i + 2 hh + e: row g + 8 hh, key
        // 8 i + 2 t4 + e
        const uint8_t* vis = stp + S::VIS_IN;
        float s[32];
        // the per-pair tests only in blocks that need them (past Skv, key padding, above a row's causal
        // diagonal): one branch per block, not per score
        auto scores = [&](auto masked) {
#pragma unroll
            for (int i = 0; i < 8; ++i)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int c = 8 * i + 2 * t4 + e;
                    const float k = kv[2 * i + e];
                    const float x0 = small_i2f(sacc[4 * i + e]) * k, x1 = small_i2f(sacc[4 * i + 2 + e]) * k;
                    if constexpr (decltype(masked)::value) {
                        const int key = n0 + c;
                        const bool vk = key < skv && (!p.kmask || vis[c] != 0);
                        s[4 * i + e] = vk && (!p.causal || key <= row0 + diag) ? x0 : -INFINITY;
                        s[4 * i + 2 + e] = vk && (!p.causal || key <= row1 + diag) ? x1 : -INFINITY;
                    } else {
                        s[4 * i + e] = x0;
                        s[4 * i + 2 + e] = x1;
                    }
                }
        };
        if (p.kmask || n0 + kTfKeys > skv || (p.causal && n0 + kTfKeys - 1 > m0 + diag)) scores(std::true_type{});
        else scores(std::false_type{});
        float r0 = -INFINITY, r1 = -INFINITY;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            r0 = fmax_nan(r0, fmax_nan(s[4 * i], s[4 * i + 1]));
            r1 = fmax_nan(r1, fmax_nan(s[4 * i + 2], s[4 * i + 3]));
        }
#pragma unroll
        for (int o_ = 1; o_ <= 2; o_ <<= 1) {
            r0 = fmax_nan(r0, __shfl_xor_sync(0xffffffffu, r0, o_));
            r1 = fmax_nan(r1, __shfl_xor_sync(0xffffffffu, r1, o_));
        }
        const float mn0 = fmax_nan(mx0, r0 * qe0), mn1 = fmax_nan(mx1, r1 * qe1);
        const float ms0 = mn0 == -INFINITY ? 0.f : mn0, ms1 = mn1 == -INFINITY ? 0.f : mn1;
        al0 = fast_exp2(mx0 - ms0);
        al1 = fast_exp2(mx1 - ms1);
        float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                s[4 * i + e] = fast_exp2(__fmaf_rn(s[4 * i + e], qe0, -ms0));
                s[4 * i + 2 + e] = fast_exp2(__fmaf_rn(s[4 * i + 2 + e], qe1, -ms1));
                sum0 += s[4 * i + e];
                sum1 += s[4 * i + 2 + e];
            }
#pragma unroll
        for (int o_ = 1; o_ <= 2; o_ <<= 1) {
            sum0 += __shfl_xor_sync(0xffffffffu, sum0, o_);
            sum1 += __shfl_xor_sync(0xffffffffu, sum1, o_);
        }
        l0 = l0 * al0 + sum0;
        l1 = l1 * al1 + sum1;
        mx0 = mn0;
        mx1 = mn1;
        // P~ in the input dtype: the accumulator fragment of keys 16 kk.. is the A fragment of k step kk
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
            for (int r = 0; r < 4; ++r) pa[kk][r] = pack2<T>(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
    };
    // O *= alpha; skipped by a warp whose rows' maxima all stayed (alpha exactly 1: the product is O itself), most
    // blocks past the first few
    auto rescale = [&](float al0, float al1) {
        if (__all_sync(0xffffffffu, al0 == 1.f && al1 == 1.f)) return;
#pragma unroll
        for (int c = 0; c < NC; ++c)
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                o[c][2 * i] *= (i & 1) ? al1 : al0;
                o[c][2 * i + 1] *= (i & 1) ? al1 : al0;
            }
    };
    auto issue_pv = [&](int j, const uint32_t (&pa)[4][4]) {
        const uint32_t sv = sb + S::STAGE0 + (j % kTfStages) * S::STAGE + S::V_IN;
        wg_fence();
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            const uint32_t va = desc_lo(sv + c * 8192);
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
                wgmma_h16_n64_rs_t<T, true>(o[c], pa[kk], desc_make(va + desc_step(2048 * kk), desc_hi(128)));
        }
        wg_commit();
    };
    if (nblk > 0) {
        uint32_t pa0[4][4], pa1[4][4];  // P~ of blocks j (in flight in P~V(j)) and j + 1, alternately
        int sacc[32];
        float kv[16];
        float al0, al1;
        issue_s(0, sacc, kv);
        wg_wait<0>();
        reg_fence(sacc);
        softmax(0, sacc, kv, pa0, al0, al1);
        // block j (not the last): S(j + 1) issued first (its commit group retires first), then P~V(j); O was
        // rescaled for block j. No issue is conditional inside a step: with one, ptxas could not match the
        // wait_group to its products and serialized every wgmma (C7514)
        auto step = [&](int j, const uint32_t (&cur)[4][4], uint32_t (&next)[4][4]) {
            issue_s(j + 1, sacc, kv);
            issue_pv(j, cur);
            wg_wait<1>();  // S(j + 1); P~V(j) may still run
            reg_fence(sacc);
            softmax(j + 1, sacc, kv, next, al0, al1);
            wg_wait<0>();
#pragma unroll
            for (int c = 0; c < NC; ++c) reg_fence(o[c]);
            mbar_arrive(empty + 8 * (j % kTfStages));  // this thread's last read of block j's stage
            rescale(al0, al1);
        };
        auto last = [&](int j, const uint32_t (&cur)[4][4]) {
            issue_pv(j, cur);
            wg_wait<0>();
#pragma unroll
            for (int c = 0; c < NC; ++c) reg_fence(o[c]);
            mbar_arrive(empty + 8 * (j % kTfStages));
        };
        int j = 0;
        for (; j + 2 < nblk; j += 2) {  // by two: the fragments' roles swap with static names
            step(j, pa0, pa1);
            step(j + 1, pa1, pa0);
        }
        if (j + 1 < nblk) {
            step(j, pa0, pa1);
            last(j + 1, pa1);
        } else {
            last(j, pa0);
        }
    }
    // the CTA's blocks wholly past this warpgroup's diagonal: only released, once landed (an early arrival would
    // count towards the stage's previous use)
    for (int j = nblk; j < tl.nblk; ++j) {
        const int stg = j % kTfStages;
        mbar_wait(full + 8 * stg, (uint32_t)(j / kTfStages) & 1u);
        mbar_arrive(empty + 8 * stg);
    }
    // epilogue: O / l (0 on rows with no visible key), the LSEs. O times the rounded reciprocal of l, not the quotient
    // (nvcc's IEEE division calls a slow path that spilled; Triton's fp32 division is div.full, not IEEE either: the
    // two differ from the quotient by ~1 ulp of fp32, far below the output dtype's rounding)
    const bool ne0 = l0 != 0.f, ne1 = l1 != 0.f;
    const float il0 = __frcp_rn(ne0 ? l0 : 1.f), il1 = __frcp_rn(ne1 ? l1 : 1.f);
    T* op = static_cast<T*>(p.o) + b * p.o_sb + h * p.o_sh;
#pragma unroll
    for (int c = 0; c < NC; ++c)
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int ch = 64 * c + 8 * i + 2 * t4;
            if (row0 < sq)
                *reinterpret_cast<uint32_t*>(op + (int64_t)row0 * p.o_ss + ch) =
                    ne0 ? pack2<T>(o[c][4 * i] * il0, o[c][4 * i + 1] * il0) : 0u;
            if (row1 < sq)
                *reinterpret_cast<uint32_t*>(op + (int64_t)row1 * p.o_ss + ch) =
                    ne1 ? pack2<T>(o[c][4 * i + 2] * il1, o[c][4 * i + 3] * il1) : 0u;
        }
    if (t4 == 0) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int row = hh ? row1 : row0;
            if (row >= sq) continue;
            const float l = hh ? l1 : l0, m = hh ? mx1 : mx0;
            const float lse_s = l != 0.f ? (m + __log2f(l)) * kLn2 : -INFINITY;
            const int64_t at = (int64_t)bh * sq + row;
            p.lse_s[at] = lse_s;
            p.lse[at] = p.qdot ? lse_s + p.qdot[at] * p.sm_scale : lse_s;
        }
    }
}

}  // namespace sage::hopper

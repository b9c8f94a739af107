// Hopper (sm_90a) SageBwd training forward: O, the caller's LSE and the smoothed scores' LSE (what the backward,
// bwd_kernel.cuh, recomputes P from), from the operands sage_patch.kernels.sagebwd prepares (Q^ and K^ INT8 per
// token, K smoothed by its mean, q . mean(K)); the numerics of its Triton forward_kernel (fwd.py) and of the
// reference SageBwdConfig(**KERNEL_LAYOUT):
//   S  = Q^ K^^T                  INT8 wgmma m64n64k32 (exact int32), both operands K-major shared-memory images
//   s  = S q_scale (tau log2e) k_scale in fp32 (in that order), masked pairs -inf (bottom-right causal, key padding,
//        keys past Skv)
//   online softmax over blocks of 64 keys (the numerics' block_k: P~ depends on the running maximum), exp2 in fp32,
//   the row sum from the fp32 P~;  O = O alpha + P~ V  with P~ cast to the input dtype in registers as the A operand
//   of a 16-bit wgmma m64n64k16 (fp32 accumulation) and V row-major in shared memory (the transposed-B bit: the
//   image is V's rows as the producer copies them, no transpose)
//   O = O / l (0 on rows with no visible key), lse_s = (m + log2 l) ln 2, lse = lse_s + tau q . mean(K)
// Non-finite inputs: a NaN scale (Q's, K's rows) reaches its row / column through the products and the NaN-propagating
// maximum; V through IEEE arithmetic; rows with no visible key stay 0 (sage_patch/reference/sagebwd.py's rule).
//
// Warp-specialized like the other Hopper kernels: warpgroup 0 is the producer, which copies each 64-key block's K^
// and V rows with cp.async into their swizzled wgmma images (the backward producer's 16-byte copies, zero-filled past
// Skv) and the block's key scales and visibility bytes into a ring of kTfStages stages guarded by mbarriers (full:
// the producer, one block behind its copies, after a proxy fence; empty: one arrival per consumer thread after its
// last read), then gives its registers to the consumers (setmaxnreg). Each of the kTfNwg consumer warpgroups owns 64
// query rows of the CTA's tile and runs its blocks serially (S, softmax, P~V); the other warpgroups keep the tensor
// cores busy meanwhile (the inference kernel's NWG >= 3 shape). A warpgroup whose rows see no key of a block
// (causal: blocks past its diagonal) only releases it.
#pragma once
#include "wgmma.cuh"
#include "../common/ptx.cuh"
#include "../common/quant.cuh"
#include "bwd_traits.cuh"
#include "bwd_producer.cuh"

namespace sage::hopper {

constexpr int kTfKeys = 64;     // keys per block: SageBwd's block_k (the online softmax's step)
constexpr int kTfNwg = 3;       // consumer warpgroups (64 query rows each)
constexpr int kTfThreads = 128 * (kTfNwg + 1);
constexpr int kTfStages = 4;    // K/V blocks in the ring
// setmaxnreg: the launch gives 65536 / 512 = 128 registers per thread; the producer keeps 24, the consumers take
// (128 * 512 - 24 * 128) / 384 = 162, rounded down to a multiple of 8
constexpr int kTfRegs = ((65536 / kTfThreads) * kTfThreads - 24 * 128) / (128 * kTfNwg) / 8 * 8;

template <int D>
struct TfSmem {
    // per consumer warpgroup its Q^ image (64 rows of D bytes, K-major); per stage the K^ image (64 keys x D bytes),
    // the V image (D / 64 chunks of 64 key rows x 128 bytes: 64 channels of the input dtype, bwd_h16_off), the 64
    // key scales (fp32) and 64 visibility bytes (key < Skv and not padded)
    static constexpr int QBYTES = 64 * D, Q_OFF = 0;
    static constexpr int K_IN = 0, V_IN = 64 * D, KS_IN = V_IN + 128 * D, VIS_IN = KS_IN + 256;
    static constexpr int STAGE = (VIS_IN + 64 + 1023) / 1024 * 1024;
    static constexpr int STAGE0 = Q_OFF + kTfNwg * QBYTES;
    static constexpr int BAR_OFF = STAGE0 + kTfStages * STAGE;  // full[kTfStages], then empty[kTfStages]
    static constexpr int TOTAL = BAR_OFF + 16 * kTfStages + 1024;  // + slack to align the base to 1024 bytes
    static_assert(TOTAL <= 232448, "more than the 227 KB of shared memory per block");
};

// the CTA's query tile (rows m0..) and its key blocks: [0, nblk) (causal: up to its last row's diagonal)
struct TfTile {
    int m0, nblk;
    __device__ __forceinline__ TfTile(const SageTrainFwdParams& p, int tile) {
        m0 = tile * 64 * kTfNwg;
        const int kend = p.causal ? min(p.Skv, max(m0 + 64 * kTfNwg + p.Skv - p.Sq, 0)) : p.Skv;
        nblk = (kend + kTfKeys - 1) / kTfKeys;
    }
};

// warpgroup 0: streams the key blocks into the stage ring; block j's full barrier is signalled after block j + 1's
// copies are issued (the backward producer's order)
template <int D, typename T>
__device__ __forceinline__ void tf_producer(const SageTrainFwdParams& p, const TfTile& tl, uint8_t* sm, uint32_t full,
                                            uint32_t empty, int b, int bkv, int hkv, int tid) {
    using S = TfSmem<D>;
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
    const int skv = p.Skv;
    const int8_t* kp = p.k_int + (int64_t)bkv * skv * D;
    const T* vp = static_cast<const T*>(p.v) + b * p.v_sb + hkv * p.v_sh;
    const float* ksp = p.k_scale + (int64_t)bkv * skv;
    const uint8_t* mrow = p.kmask ? p.kmask + (int64_t)b * p.kmask_sb : nullptr;
    int sprev = 0;
    for (int j = 0; j < tl.nblk; ++j) {
        const int stg = j % kTfStages;
        mbar_wait(empty + 8 * stg, ((uint32_t)(j / kTfStages) & 1u) ^ 1u);
        uint8_t* st = sm + S::STAGE0 + stg * S::STAGE;
        const int n0 = j * kTfKeys;
        // a thread's chunks are rows a multiple of 8 apart (16 at D = 64's 64-byte rows), which keeps the swizzle
        // phase: every chunk after the first is a constant further in the image and in global memory
        {  // K^: row r = key n0 + r, 16-byte chunk c (D / 16 per row)
            constexpr int per_row = D / 16, step = 128 / per_row;
            const int r = tid / per_row, c = tid % per_row;
            uint8_t* dst = st + S::K_IN + img_off(r, 16 * c, D);
            const int8_t* src = kp + 16 * c;
#pragma unroll
            for (int k = 0; k < 64 / step; ++k) {
                const int key = n0 + r + k * step;
                bwd_cp16(dst + k * step * D, src + (int64_t)min(key, skv - 1) * D, key < skv);
            }
        }
        {  // V: row r = key n0 + r, chunk c of 8 channels (D / 8 per row)
            constexpr int per_row = D / 8, step = 128 / per_row;
            const int r = tid / per_row, c = tid % per_row;
            uint8_t* dst = st + S::V_IN + bwd_h16_off(r, c);
            const T* src = vp + 8 * c;
#pragma unroll
            for (int k = 0; k < 64 / step; ++k) {
                const int key = n0 + r + k * step;
                bwd_cp16(dst + k * step * 128, src + (int64_t)min(key, skv - 1) * p.v_ss, key < skv);
            }
        }
        cp_async_commit();
        if (tid < 64) {  // key scales and visibility (plain stores: released by this thread's full arrival)
            const int key = n0 + tid;
            const bool in = key < skv;
            reinterpret_cast<float*>(st + S::KS_IN)[tid] = in ? ksp[key] : 0.f;
            st[S::VIS_IN + tid] = (uint8_t)(in && (!mrow || mrow[key]));
        }
        if (j > 0) {
            cp_async_wait<1>();
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            mbar_arrive(full + 8 * sprev);
        }
        sprev = stg;
    }
    if (tl.nblk > 0) {
        cp_async_wait<0>();
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        mbar_arrive(full + 8 * sprev);
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
__global__ void __launch_bounds__(kTfThreads, 1) hopper_train_fwd_kernel(const __grid_constant__ SageTrainFwdParams p) {
    using S = TfSmem<D>;
    extern __shared__ __align__(1024) uint8_t tsmem_raw[];
    const uint32_t spad = (1024u - (smem_u32(tsmem_raw) & 1023u)) & 1023u;
    uint8_t* sm = tsmem_raw + spad;
    const uint32_t sb = __shfl_sync(0xffffffffu, smem_u32(sm), 0);
    const uint32_t full = sb + S::BAR_OFF, empty = full + 8 * kTfStages;
    const int tid = threadIdx.x;
    // causal calls: the longest tiles (last queries) first
    const int tile = p.causal ? (int)(gridDim.x - 1 - blockIdx.x) : (int)blockIdx.x;
    const TfTile tl(p, tile);
    const int bh = blockIdx.y, b = bh / p.Hq, h = bh % p.Hq, hkv = h / (p.Hq / p.Hkv), bkv = b * p.Hkv + hkv;
    if (tid == 0) {
        for (int s = 0; s < kTfStages; ++s) {
            mbar_init(full + 8 * s, 128);
            mbar_init(empty + 8 * s, 128 * kTfNwg);  // one arrival per consumer thread
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (tid < 128) {
        tf_producer<D, T>(p, tl, sm, full, empty, b, bkv, hkv, tid);
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kTfRegs) : "memory");
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
    for (int j = 0; j < tl.nblk; ++j) {
        const int stg = j % kTfStages;
        mbar_wait(full + 8 * stg, (uint32_t)(j / kTfStages) & 1u);
        if (j >= nblk) {  // wholly past this warpgroup's diagonal
            mbar_arrive(empty + 8 * stg);
            continue;
        }
        const uint32_t sst = sb + S::STAGE0 + stg * S::STAGE;
        const uint8_t* stp = sm + S::STAGE0 + stg * S::STAGE;
        const int n0 = j * kTfKeys;
        int sacc[32];
        wg_fence();
        {
            const uint32_t qa = desc_lo(qimg), ka = desc_lo(sst + S::K_IN);
            wgmma_s8_n64_ss<false>(sacc, desc_make(qa, desc_hi(D)), desc_make(ka, desc_hi(D)));
#pragma unroll
            for (int k = 1; k < D / 32; ++k)
                wgmma_s8_n64_ss<true>(sacc, desc_make(qa + desc_step(32 * k), desc_hi(D)),
                                      desc_make(ka + desc_step(32 * k), desc_hi(D)));
        }
        wg_commit();
        wg_wait<0>();
        reg_fence(sacc);
        // s (log2 domain); accumulator element 4 i + 2 hh + e: row g + 8 hh, key 8 i + 2 t4 + e
        const float* ks = reinterpret_cast<const float*>(stp + S::KS_IN);
        const uint8_t* vis = stp + S::VIS_IN;
        float s[32];
        const bool masked = p.kmask || n0 + kTfKeys > skv || (p.causal && n0 + kTfKeys - 1 > m0 + diag);
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int c = 8 * i + 2 * t4 + e;
                const float k = ks[c];
                s[4 * i + e] = (float)sacc[4 * i + e] * qs0 * k;
                s[4 * i + 2 + e] = (float)sacc[4 * i + 2 + e] * qs1 * k;
                if (masked) {
                    const bool vk = vis[c] != 0;
                    const int key = n0 + c;
                    if (!(vk && (!p.causal || key <= row0 + diag))) s[4 * i + e] = -INFINITY;
                    if (!(vk && (!p.causal || key <= row1 + diag))) s[4 * i + 2 + e] = -INFINITY;
                }
            }
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
        const float mn0 = fmax_nan(mx0, r0), mn1 = fmax_nan(mx1, r1);
        const float ms0 = mn0 == -INFINITY ? 0.f : mn0, ms1 = mn1 == -INFINITY ? 0.f : mn1;
        const float al0 = fast_exp2(mx0 - ms0), al1 = fast_exp2(mx1 - ms1);
        float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                s[4 * i + e] = fast_exp2(s[4 * i + e] - ms0);
                s[4 * i + 2 + e] = fast_exp2(s[4 * i + 2 + e] - ms1);
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
        uint32_t pa[4][4];
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
            for (int r = 0; r < 4; ++r) pa[kk][r] = pack2<T>(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
#pragma unroll
        for (int c = 0; c < NC; ++c)
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                o[c][2 * i] *= (i & 1) ? al1 : al0;
                o[c][2 * i + 1] *= (i & 1) ? al1 : al0;
            }
        wg_fence();
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            const uint32_t va = desc_lo(sst + S::V_IN + c * 8192);
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
                wgmma_h16_n64_rs_t<T, true>(o[c], pa[kk], desc_make(va + desc_step(2048 * kk), desc_hi(128)));
        }
        wg_commit();
        wg_wait<0>();
#pragma unroll
        for (int c = 0; c < NC; ++c) reg_fence(o[c]);
        mbar_arrive(empty + 8 * stg);  // this thread's last read of the stage
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

// The portable mma.sync path (sm_80 / 86 / 89 / 90): tile shapes, P~V and Q/K modes, the kernel-variant ids they
// come from, and the workspace carve-up of its pre-passes.
#pragma once
#include "../common/params.cuh"
#include "../common/host_launch.h"

namespace sage::portable {

constexpr int kThreads = 128;  // 4 warps everywhere
// rows per warp (WQ) in the attention kernel: 32 = two m16 tiles sharing every K/V fragment (half the shared-memory
// traffic per MMA of WQ = 16, at the price of registers); head dims above 128 take one m16 tile (WQ = 16), as two
// tiles' O accumulators (2 x D/2 fp32 per thread) would not fit the 255 registers. The Q scale groups follow:
// Grouping(WQ, 8, 1) (registry.portable_q_group_rows).
__host__ __device__ constexpr int warp_rows(int D) { return D > 128 ? 16 : 32; }
// CTAs per SM the attention kernel's register allocation must allow (register cap 65536 / (128 * n))
constexpr int kAttnMinBlocks = 2;
constexpr int kBK = 64;        // keys per KV block
constexpr int kMaxSplit = 32;  // partial-reduction chunks for mean(K) and amax(V)

// P~V variants
constexpr int PV_FP8_MMA = 0;  // e4m3 operands, mma.sync m16n8k32 e4m3 (sm_89+; native FP8 rate on Ada)
constexpr int PV_FP16 = 1;     // fp16 P~ and V, m16n8k16 (SageAttention1-style, sm_80+)
constexpr int PV_FP8_F16 = 2;  // e4m3 VALUES (same numerics as PV_FP8_MMA) carried in fp16 through m16n8k16: on
                               // sm_90 mma.sync e4m3 is lowered to fp16 MMAs anyway; this skips per-MMA converts

// Q/K modes (from SageAttnParams.qk_bits and the kernel id)
constexpr int QK_I8 = 0;      // "8b": INT8 values, mma.sync m16n8k32 s8
constexpr int QK_I4_I8 = 1;   // "4b": INT4 values in [-7, 7] stored as int8, mma.sync m16n8k32 s8 (any arch; sm_90)
constexpr int QK_I4_MMA = 2;  // "4b": INT4 values packed two per byte, mma.sync m16n8k64 s4 (native on sm_80-89)
__host__ __device__ constexpr int qk_row_bytes(int D, int qkm) { return qkm == QK_I4_MMA ? D / 2 : D; }

// kernel id (sage_kernels.h, SAGE_KERNEL_MMA_*) -> P~V mode and whether Q/K use the packed INT4 MMA
inline int pv_of_kernel(int kernel) {
    switch (kernel) {
        case SAGE_KERNEL_MMA_FP16: case SAGE_KERNEL_MMA_FP16_QK4: return PV_FP16;
        case SAGE_KERNEL_MMA_FP8F16: case SAGE_KERNEL_MMA_FP8F16_QK4: return PV_FP8_F16;
        default: return PV_FP8_MMA;
    }
}
inline bool qk4_of_kernel(int kernel) {
    return kernel == SAGE_KERNEL_MMA_FP8_QK4 || kernel == SAGE_KERNEL_MMA_FP16_QK4 || kernel == SAGE_KERNEL_MMA_FP8F16_QK4;
}
inline int qk_mode(const SageAttnParams& p) {
    return p.qk_bits != 4 ? QK_I8 : (qk4_of_kernel(p.kernel) ? QK_I4_MMA : QK_I4_I8);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
constexpr bool kArchHasFp8 = false;
#else
constexpr bool kArchHasFp8 = true;
#endif

// The portable path's workspace: the pre-passes' outputs the attention kernel reads, and the statistics partials
struct PortableWs {
    int64_t sq_pad, skv_pad, nsplit, nqb;
    int8_t* qi8; float* qscale; float* qshift;
    int8_t* ki8; float* kscale; float* kpart;
    uint8_t* vt; float* vscale; float* vpart;
    float* kmean; float* vmax; float* vmean;
    float* qmean; float* ds;
    int64_t total;  // bytes
};

// carve the workspace ws (null: sizes only, see WsCarver)
inline PortableWs carve_portable_ws(const SageAttnParams& p, void* ws) {
    PortableWs L;
    const int64_t bq = 4 * warp_rows(p.D);  // query rows per attention CTA
    L.sq_pad = (p.Sq + bq - 1) / bq * bq;
    L.skv_pad = (p.Skv + kBK - 1) / kBK * kBK;
    int64_t ns = (p.Skv + 255) / 256;
    L.nsplit = ns < 1 ? 1 : (ns > kMaxSplit ? kMaxSplit : ns);
    L.nqb = L.sq_pad / bq;  // Q-smoothing blocks ("4b"): one per attention CTA
    const bool q4 = p.qk_bits == 4;
    const int64_t bhq = (int64_t)p.B * p.Hq, bhk = (int64_t)p.B * p.Hkv, D = p.D;
    const int64_t DB = qk_row_bytes(p.D, qk_mode(p));  // bytes per quantized Q/K row
    WsCarver c(ws);
    L.qi8 = c.take<int8_t>(bhq * L.sq_pad * DB);
    L.qscale = c.take<float>(bhq * (L.sq_pad / 16) * 8 * 4);  // enough for any WQ >= 16
    L.qshift = c.take<float>(bhq * L.sq_pad * 4);
    L.ki8 = c.take<int8_t>(bhk * L.skv_pad * DB);
    L.kscale = c.take<float>(bhk * (L.skv_pad / kBK) * 4 * 4);
    L.kpart = c.take<float>(bhk * L.nsplit * D * 4);
    L.vt = c.take<uint8_t>(bhk * D * L.skv_pad * (pv_of_kernel(p.kernel) == PV_FP8_MMA ? 1 : 2));
    L.vscale = c.take<float>(bhk * D * 4);
    L.vpart = c.take<float>(bhk * L.nsplit * 3 * D * 4);  // max|V| (or sum, max, min with smooth_v)
    L.kmean = c.take<float>(bhk * D * 4);
    L.vmax = c.take<float>(bhk * D * 4);
    L.vmean = c.take<float>(bhk * D * 4);
    L.qmean = c.take<float>(q4 ? bhq * L.nqb * D * 4 : 0);
    L.ds = c.take<float>(q4 ? bhq * L.nqb * L.skv_pad * 4 : 0);  // Delta S, fp32, log2 domain
    L.total = c.size();
    return L;
}

}  // namespace sage::portable

// The portable mma.sync path, one translation unit compiled for every target (sm_80, 86, 89, 90a): the attention
// kernel's instantiations (head dim x P~V mode x dtype x Q/K mode) and the launch sequence pre-passes -> attention.
#include "../common/entry.h"
#include "prepass.cuh"
#include "attn_body.cuh"

namespace sage::portable {

template <int D, int PV, typename T, int QKM>
__global__ void __launch_bounds__(kThreads, kAttnMinBlocks) attn_kernel(SageAttnParams p, AttnWs w) {
    if constexpr (PV == PV_FP16 || kArchHasFp8) {
        attn_body<D, PV, T, warp_rows(D), QKM>(p, w);
    }
    // FP8 P~V below sm_89: never launched (the host checks device_cc >= 89)
}

// ----------------------------------------------------------------------------------------------
template <int D, typename T, int PV, int QKM>
int launch_attn(const SageAttnParams& p, const AttnWs& w, cudaStream_t st) {
    constexpr int WQ = warp_rows(D), BQ = 4 * WQ;
    constexpr int smem = AttnSmem<D, PV, WQ, qk_row_bytes(D, QKM)>::TOTAL;
    auto kern = attn_kernel<D, PV, T, QKM>;
    if (smem > 48 * 1024) {
        static bool done[64] = {};
        const cudaError_t e = opt_in_dynamic_smem(kern, smem, done, p.device);
        if (e != cudaSuccess) return (int)e;
    }
    kern<<<dim3(w.sq_pad / BQ, p.Hq, p.B), kThreads, smem, st>>>(p, w);
    return (int)cudaGetLastError();
}

template <int D, typename T, int PV>
int launch_all(const SageAttnParams& p, cudaStream_t st) {
    const PortableWs L = carve_portable_ws(p, p.workspace);
    const int ns = (int)L.nsplit, sqp = (int)L.sq_pad, skp = (int)L.skv_pad, nqb = (int)L.nqb;
    const int bhq = p.B * p.Hq, bhk = p.B * p.Hkv;
    const bool q4 = p.qk_bits == 4;
    const int do_v = (PV != PV_FP16 || p.smooth_v) ? 1 : 0;

    stats_kernel<D, T><<<dim3(ns, bhk, 1 + do_v), kThreads, 0, st>>>(p, L.kpart, L.vpart, ns);
    constexpr int WQ = warp_rows(D), BQ = 4 * WQ;
    finalize_stats_kernel<D><<<bhk, D, 0, st>>>(p, L.kpart, L.vpart, ns, L.kmean, L.vmax, L.vmean, do_v);
    quant_q_kernel<D, T, WQ><<<dim3(sqp / BQ, bhq), kThreads, 0, st>>>(p, L.qi8, L.qscale, L.qshift, L.qmean, L.kmean,
                                                                       sqp);
    quant_k_kernel<D, T><<<dim3(skp / kBK, bhk), kThreads, 0, st>>>(p, L.kmean, L.ki8, L.kscale, skp);
    quant_v_kernel<D, T, PV><<<dim3(skp / kBK, bhk), kThreads, 0, st>>>(p, L.vmax, L.vmean, L.vt, L.vscale, skp);
    if (q4) delta_s_kernel<D, T><<<dim3(skp / kBK, bhq), kThreads, 0, st>>>(p, L.kmean, L.qmean, L.ds, nqb, BQ, skp);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return (int)e;

    const AttnWs w{L.qi8, L.qscale, L.qshift, L.ki8, L.kscale, L.vt, L.vscale, L.vmean, L.ds, nqb, sqp, skp};
    const int qkm = qk_mode(p);
    if (qkm == QK_I4_MMA) return launch_attn<D, T, PV, QK_I4_MMA>(p, w, st);
    if (qkm == QK_I4_I8) return launch_attn<D, T, PV, QK_I4_I8>(p, w, st);
    return launch_attn<D, T, PV, QK_I8>(p, w, st);
}

template <int D, typename T>
int dispatch_pv(const SageAttnParams& p, cudaStream_t st) {
    const int pv = pv_of_kernel(p.kernel);
    if (pv == PV_FP16) return launch_all<D, T, PV_FP16>(p, st);
    if (pv == PV_FP8_F16) return launch_all<D, T, PV_FP8_F16>(p, st);
    return launch_all<D, T, PV_FP8_MMA>(p, st);
}

template <typename T>
int dispatch_d(const SageAttnParams& p, cudaStream_t st) {
    if (p.D == 64) return dispatch_pv<64, T>(p, st);
    if (p.D == 128) return dispatch_pv<128, T>(p, st);
    if (p.D == 256) return dispatch_pv<256, T>(p, st);
    return SAGE_E_HEADDIM;
}

}  // namespace sage::portable

namespace sage {

int64_t portable_workspace_bytes(const SageAttnParams& p) { return portable::carve_portable_ws(p, nullptr).total; }

int portable_fwd(const SageAttnParams& p, cudaStream_t st) {
    if (p.dtype == 0) return portable::dispatch_d<__half>(p, st);
    if (p.dtype == 1) return portable::dispatch_d<__nv_bfloat16>(p, st);
    return SAGE_E_BADARG;
}

}  // namespace sage

// The Hopper path, one translation unit compiled for sm_90a only: the workspace carve-up, the attention kernel's
// instantiations and the launch sequence (sampled statistics -> K/V pre-pass -> attention, the last two with PDL).
#include "../common/entry.h"
#include "kv_prepass.cuh"
#include "kernel.cuh"

namespace sage {

struct HopLayout {
    int64_t nkb;  // 128-key blocks per (b, kv-head)
    int64_t kimg, kscale, vimg, vscale, vfac, kmean, vmean, kmflag, tilectr, part, total;
    int nzero;    // ints from tilectr on that the statistics kernel zeroes: the tile counter, the split counters
};

inline HopLayout make_hop_layout(const SageAttnParams& p) {
    HopLayout L;
    L.nkb = (p.Skv + kHopBN - 1) / kHopBN;
    const HopPlan P = hop_plan(p);
    const int nwg = hop_nwg(p.D);
    const int64_t bhk = (int64_t)p.B * p.Hkv, D = p.D;
    int64_t off = 0;
    L.kimg = off;   off = align256(off + bhk * L.nkb * kHopBN * D);
    L.kscale = off; off = align256(off + bhk * L.nkb * 4 * 4);
    L.vimg = off;   off = align256(off + bhk * L.nkb * kHopBN * D);
    L.vscale = off; off = align256(off + bhk * D * 4);
    L.vfac = off;   off = align256(off + bhk * L.nkb * 4);
    L.kmean = off;  off = align256(off + bhk * D * 4);
    L.vmean = off;  off = align256(off + bhk * D * 4);
    L.kmflag = off; off = align256(off + (p.kmask ? (int64_t)p.B * L.nkb * 4 : 0));
    // the dynamic tile scheduler's counter, then one arrival counter per split tile and consumer
    L.nzero = 1 + P.nsplit * nwg;
    L.tilectr = off; off = align256(off + 4 * L.nzero);
    // split parts' partials: per (split tile, part, consumer) D/8 + 1 float4 per thread (normalised output, log2 sums)
    L.part = off;   off = align256(off + (int64_t)P.nsplit * P.parts * nwg * (p.D / 8 + 1) * 128 * 16);
    L.total = off;
    return L;
}

// a launch that may overlap the end of the previous kernel in the stream (programmatic dependent launch: the
// kernel's pdl_wait() holds it before any global memory access)
template <typename... Params, typename... Args>
cudaError_t hop_launch_pdl(void (*kern)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t st,
                           Args... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    return cudaLaunchKernelEx(&cfg, kern, args...);
}

template <int D, typename T>
int hop_launch(const SageAttnParams& p, cudaStream_t st) {
    const HopLayout L = make_hop_layout(p);
    int8_t* kimg = ws_at<int8_t>(p.workspace, L.kimg);
    float* kscale = ws_at<float>(p.workspace, L.kscale);
    uint8_t* vimg = ws_at<uint8_t>(p.workspace, L.vimg);
    float* vscale = ws_at<float>(p.workspace, L.vscale);
    float* vfac = ws_at<float>(p.workspace, L.vfac);
    float* kmean = ws_at<float>(p.workspace, L.kmean);
    float* vmean = ws_at<float>(p.workspace, L.vmean);
    const int bhk = p.B * p.Hkv, nkb = (int)L.nkb;
    // the first kernel follows whatever the caller ran before: a plain launch; the next two with PDL
    hopper_sample_stats_kernel<D, T><<<bhk, kHopStatThreads, 0, st>>>(p, kmean, vscale, vmean,
                                                                       ws_at<int>(p.workspace, L.tilectr), L.nzero);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return (int)e;
    int* kmflag = ws_at<int>(p.workspace, L.kmflag);
    e = hop_launch_pdl(hopper_quant_kv_kernel<D, T>, dim3(nkb, p.Hkv, p.B), dim3(hop_kv_threads(D)), 0, st, p,
                       (const float*)kmean, (const float*)vscale, (const float*)vmean, kimg, kscale, vimg, vfac,
                       kmflag, nkb);
    if (e != cudaSuccess) return (int)e;

    constexpr int NWG = hop_nwg(D);
    using S = HopSmem<D, NWG>;
    const bool lse = p.lse != nullptr;
    auto kern = lse ? hopper_attn_kernel<D, T, true, NWG> : hopper_attn_kernel<D, T, false, NWG>;
    const int dev = p.device;
    {
        static bool done[2][64] = {};
        if (dev < 0 || dev >= 64 || !done[lse][dev]) {
            e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, S::TOTAL);
            if (e != cudaSuccess) return (int)e;
            if (dev >= 0 && dev < 64) done[lse][dev] = true;
        }
    }
    HopWs w;
    w.kmflag = kmflag;
    w.kimg = kimg; w.kscale = kscale; w.vimg = vimg; w.vscale = vscale; w.vfac = vfac; w.kmean = kmean; w.vmean = vmean;
    w.tilectr = ws_at<int>(p.workspace, L.tilectr);
    w.nkb = nkb;
    const HopPlan P = hop_plan(p);  // the same plan as the workspace layout's
    w.nqb = P.nqb;
    w.splitctr = w.tilectr + 1;
    w.part = ws_at<float4>(p.workspace, L.part);
    w.nitems = P.nitems;
    w.nfull = P.ntiles - P.nsplit;
    w.parts = P.parts;
    w.pmul = P.parts > 1 ? (uint32_t)((0x100000000ull + P.parts - 1) / P.parts) : 0u;  // exact for u < 2^30
    for (int j = 0; j <= kHopMaxParts; ++j) w.pkb[j] = j <= P.parts ? (int)((int64_t)j * nkb / P.parts) : nkb;
    const int nsm = hop_num_sms(dev), grid = w.nitems < nsm ? w.nitems : nsm;
    return (int)hop_launch_pdl(kern, dim3(grid), dim3(hop_threads(NWG)), S::TOTAL, st, p, w);
}

// whether the Hopper kernel serves these parameters (the C ABI checks that the build has it)
bool hopper_supported(const SageAttnParams& p) {
    // the epilogue stores 16 bytes per lane: O rows 16-byte aligned (as the Python side allocates them)
    const bool o16 = reinterpret_cast<uintptr_t>(p.o) % 16 == 0 && p.o_ss % 8 == 0 && p.o_sh % 8 == 0 &&
                     p.o_sb % 8 == 0;
    return p.device_cc == 90 && (p.D == 64 || p.D == 128) && p.qk_bits != 4 && o16;
}

int64_t hopper_workspace_bytes(const SageAttnParams& p) { return make_hop_layout(p).total; }

int hopper_fwd(const SageAttnParams& p, cudaStream_t st) {
    if (p.dtype != 0 && p.dtype != 1) return SAGE_E_BADARG;
    if (p.D == 64) return p.dtype == 0 ? hop_launch<64, __half>(p, st) : hop_launch<64, __nv_bfloat16>(p, st);
    return p.dtype == 0 ? hop_launch<128, __half>(p, st) : hop_launch<128, __nv_bfloat16>(p, st);
}

}  // namespace sage

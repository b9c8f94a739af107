// The Hopper path, one translation unit compiled for sm_90a only: the workspace carve-up, the attention kernel's
// instantiations and the launch sequence (sampled statistics -> K/V pre-pass -> attention, the last two with PDL).
#include "../common/entry.h"
#include "../common/host_launch.h"
#include "kv_prepass.cuh"
#include "kernel.cuh"

namespace sage::hopper {

// The Hopper path's workspace: the K/V pass's block images and tables, the statistics, the scheduler's counters and
// the split tail's partials
struct Bufs {
    int64_t nkb;  // 128-key blocks per (b, kv-head)
    int8_t* kimg; float* kscale; uint8_t* vimg; float* vscale; float* vfac; float* kmean; float* vmean; int* kmflag;
    int* tilectr;  // the dynamic tile scheduler's counter, then one arrival counter per split tile and consumer
    float4* part;  // split parts' partials
    int nzero;     // ints from tilectr on that the statistics kernel zeroes: the tile counter, the split counters
    int64_t total;  // bytes
};

// carve the workspace ws (null: sizes only, see WsCarver)
inline Bufs carve_ws(const SageAttnParams& p, void* ws) {
    Bufs L;
    L.nkb = (p.Skv + kBN - 1) / kBN;
    const Plan P = plan(p);
    const int nw = nwg(p.D);
    const int64_t bhk = (int64_t)p.B * p.Hkv, D = p.D;
    WsCarver c(ws);
    L.kimg = c.take<int8_t>(bhk * L.nkb * kBN * D);
    L.kscale = c.take<float>(bhk * L.nkb * 4 * 4);
    L.vimg = c.take<uint8_t>(bhk * L.nkb * kBN * D);
    L.vscale = c.take<float>(bhk * D * 4);
    L.vfac = c.take<float>(bhk * L.nkb * 4);
    L.kmean = c.take<float>(bhk * D * 4);
    L.vmean = c.take<float>(bhk * D * 4);
    L.kmflag = c.take<int>(p.kmask ? (int64_t)p.B * L.nkb * 4 : 0);
    L.nzero = 1 + P.nsplit * nw;
    L.tilectr = c.take<int>(4 * L.nzero);
    // per (split tile, part, consumer) D/8 + 1 float4 per thread (normalised output, log2 sums)
    L.part = c.take<float4>((int64_t)P.nsplit * P.parts * nw * (p.D / 8 + 1) * 128 * 16);
    L.total = c.size();
    return L;
}

// a launch that may overlap the end of the previous kernel in the stream (programmatic dependent launch: the
// kernel's pdl_wait() holds it before any global memory access); cluster > 1: clusters of that many CTAs along x
template <typename... Params, typename... Args>
cudaError_t launch_pdl(void (*kern)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t st, int cluster,
                       Args... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    cudaLaunchAttribute attr[2];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    attr[1].id = cudaLaunchAttributeClusterDimension;
    attr[1].val.clusterDim.x = (unsigned)cluster;
    attr[1].val.clusterDim.y = 1;
    attr[1].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = cluster > 1 ? 2 : 1;
    return cudaLaunchKernelEx(&cfg, kern, args...);
}

template <int D, typename T>
int launch(const SageAttnParams& p, cudaStream_t st) {
    const Bufs L = carve_ws(p, p.workspace);
    const int bhk = p.B * p.Hkv, nkb = (int)L.nkb;
    // the first kernel follows whatever the caller ran before: a plain launch; the next two with PDL
    hopper_sample_stats_kernel<D, T><<<bhk, kStatThreads, 0, st>>>(p, L.kmean, L.vscale, L.vmean, L.tilectr,
                                                                   L.nzero);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return (int)e;
    e = launch_pdl(hopper_quant_kv_kernel<D, T>, dim3(nkb * kv_split(D), p.Hkv, p.B), dim3(kv_threads(D)), 0, st,
                   kv_split(D), p,
                   (const float*)L.kmean, (const float*)L.vscale, (const float*)L.vmean, L.kimg, L.kscale, L.vimg,
                   L.vfac, L.kmflag, nkb);
    if (e != cudaSuccess) return (int)e;

    constexpr int NWG = nwg(D);
    using S = Smem<D, NWG>;
    const bool lse = p.lse != nullptr, win = p.window_keys > 0;
    auto kern = lse ? (win ? hopper_attn_kernel<D, T, true, NWG, true> : hopper_attn_kernel<D, T, true, NWG, false>)
                    : (win ? hopper_attn_kernel<D, T, false, NWG, true> : hopper_attn_kernel<D, T, false, NWG, false>);
    const int dev = p.device;
    {
        static bool done[4][64] = {};
        e = opt_in_dynamic_smem(kern, S::TOTAL, done[2 * lse + win], dev);
        if (e != cudaSuccess) return (int)e;
    }
    Ws w;
    w.kimg = L.kimg; w.kscale = L.kscale; w.vimg = L.vimg; w.vscale = L.vscale; w.vfac = L.vfac;
    w.kmean = L.kmean; w.vmean = L.vmean; w.kmflag = L.kmflag;
    w.tilectr = L.tilectr;
    w.nkb = nkb;
    const Plan P = plan(p);  // the same plan as the workspace layout's
    w.nqb = P.nqb;
    w.secq = P.secq; w.secb = P.secb; w.hbig = P.hbig; w.tbig = P.hbig * P.nqb;
    w.splitctr = w.tilectr + 1;
    w.part = L.part;
    w.nitems = P.nitems;
    w.nfull = P.ntiles - P.nsplit;
    w.parts = P.parts;
    w.pmul = P.parts > 1 ? (uint32_t)((0x100000000ull + P.parts - 1) / P.parts) : 0u;  // exact for u < 2^30
    for (int j = 0; j <= kMaxParts; ++j) w.pkb[j] = j <= P.parts ? (int)((int64_t)j * nkb / P.parts) : nkb;
    const int nsm = num_sms(dev), grid = w.nitems < nsm ? w.nitems : nsm;
    return (int)launch_pdl(kern, dim3(grid), dim3(threads(NWG)), S::TOTAL, st, 1, p, w);
}

}  // namespace sage::hopper

namespace sage {

// whether the Hopper kernel serves these parameters (the C ABI checks that the build has it)
bool hopper_supported(const SageAttnParams& p) {
    // the epilogue stores 16 bytes per lane: O rows 16-byte aligned (as the Python side allocates them)
    const bool o16 = reinterpret_cast<uintptr_t>(p.o) % 16 == 0 && p.o_ss % 8 == 0 && p.o_sh % 8 == 0 &&
                     p.o_sb % 8 == 0;
    return p.device_cc == 90 && (p.D == 64 || p.D == 128 || p.D == 256) && p.qk_bits != 4 && o16;
}

int64_t hopper_workspace_bytes(const SageAttnParams& p) { return hopper::carve_ws(p, nullptr).total; }

int hopper_fwd(const SageAttnParams& p, cudaStream_t st) {
    if (p.dtype != 0 && p.dtype != 1) return SAGE_E_BADARG;
    if (p.D == 64) return p.dtype == 0 ? hopper::launch<64, __half>(p, st) : hopper::launch<64, __nv_bfloat16>(p, st);
    if (p.D == 256)
        return p.dtype == 0 ? hopper::launch<256, __half>(p, st) : hopper::launch<256, __nv_bfloat16>(p, st);
    return p.dtype == 0 ? hopper::launch<128, __half>(p, st) : hopper::launch<128, __nv_bfloat16>(p, st);
}

}  // namespace sage

// The Hopper SageBwd backward (dQ, dK, dV), one translation unit compiled for sm_90a only: the kernel's instantiations
// and its launch (bwd_kernel.cuh).
#include "../common/entry.h"
#include "../common/host_launch.h"
#include "bwd_kernel.cuh"

namespace sage::hopper {

// Det: the deterministic mode (p.dq_sem), its own instantiation so that the default one carries none of it
template <int D, typename T, bool Det>
int bwd_launch(const SageBwdParams& p, cudaStream_t st) {
    using S = BwdSmem<D>;
    auto kern = hopper_bwd_kernel<D, T, Det>;
    static bool done[64] = {};
    cudaError_t e = opt_in_dynamic_smem(kern, S::TOTAL, done, p.device);
    if (e != cudaSuccess) return (int)e;
    constexpr int keys = kBwdKeys * kBwdNwg;
    const dim3 grid((p.Skv + keys - 1) / keys, p.B * p.Hkv);
    kern<<<grid, kBwdThreads, S::TOTAL, st>>>(p);
    return (int)cudaGetLastError();
}

// the instantiation of p's head dim and dtype
template <bool Det>
int bwd_dispatch(const SageBwdParams& p, cudaStream_t st) {
    if (p.D == 64) return p.dtype == 0 ? bwd_launch<64, __half, Det>(p, st) : bwd_launch<64, __nv_bfloat16, Det>(p, st);
    return p.dtype == 0 ? bwd_launch<128, __half, Det>(p, st) : bwd_launch<128, __nv_bfloat16, Det>(p, st);
}

}  // namespace sage::hopper

namespace sage {

int hopper_bwd(const SageBwdParams& p, cudaStream_t st) {
    // 16-byte row loads of V and dO; bulk reductions of 16-byte aligned 2 KB blocks into dQ
    if (reinterpret_cast<uintptr_t>(p.dq_acc) % 16 != 0) return SAGE_E_BADARG;
    const bool v16 = reinterpret_cast<uintptr_t>(p.v) % 16 == 0 && p.v_sb % 8 == 0 && p.v_sh % 8 == 0 && p.v_ss % 8 == 0;
    const bool d16 = reinterpret_cast<uintptr_t>(p.dout) % 16 == 0 && p.do_sb % 8 == 0 && p.do_sh % 8 == 0 &&
                     p.do_ss % 8 == 0;
    if (!v16 || !d16) return SAGE_E_BADARG;
    if (reinterpret_cast<uintptr_t>(p.dq_sem) % 4 != 0) return SAGE_E_BADARG;
    return p.dq_sem ? hopper::bwd_dispatch<true>(p, st) : hopper::bwd_dispatch<false>(p, st);
}

}  // namespace sage

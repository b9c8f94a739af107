// The Hopper SageBwd training forward (O, both LSEs), one translation unit compiled for sm_90a only: the kernel's
// instantiations and its launch (fwd_train_kernel.cuh).
#include "../common/entry.h"
#include "../common/host_launch.h"
#include "fwd_train_kernel.cuh"

namespace sage::hopper {

template <int D, typename T>
int train_fwd_launch(const SageTrainFwdParams& p, cudaStream_t st) {
    using S = TfSmem<D>;
    auto kern = hopper_train_fwd_kernel<D, T>;
    static bool done[64] = {};
    cudaError_t e = opt_in_dynamic_smem(kern, S::TOTAL, done, p.device);
    if (e != cudaSuccess) return (int)e;
    constexpr int rows = 64 * kTfNwg<D>;
    const dim3 grid((p.Sq + rows - 1) / rows, p.B * p.Hq);
    kern<<<grid, kTfThreads<D>, S::TOTAL, st>>>(p);
    return (int)cudaGetLastError();
}

}  // namespace sage::hopper

namespace sage {

int hopper_train_fwd(const SageTrainFwdParams& p, cudaStream_t st) {
    // 16-byte cp.async of V's rows, 4-byte stores of O's channel pairs
    const bool v16 = reinterpret_cast<uintptr_t>(p.v) % 16 == 0 && p.v_sb % 8 == 0 && p.v_sh % 8 == 0 && p.v_ss % 8 == 0;
    const bool o4 = reinterpret_cast<uintptr_t>(p.o) % 4 == 0 && p.o_sb % 2 == 0 && p.o_sh % 2 == 0 && p.o_ss % 2 == 0;
    // the key padding rows are copied in 16-byte chunks (sage_kernels.h)
    const bool m16 = !p.kmask || (reinterpret_cast<uintptr_t>(p.kmask) % 16 == 0 && p.kmask_sb % 16 == 0);
    if (!v16 || !o4 || !m16) return SAGE_E_BADARG;
    if (p.D == 64)
        return p.dtype == 0 ? hopper::train_fwd_launch<64, __half>(p, st) : hopper::train_fwd_launch<64, __nv_bfloat16>(p, st);
    return p.dtype == 0 ? hopper::train_fwd_launch<128, __half>(p, st) : hopper::train_fwd_launch<128, __nv_bfloat16>(p, st);
}

}  // namespace sage

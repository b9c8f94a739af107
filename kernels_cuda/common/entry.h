// Host entry points of the kernel families, one translation unit each (portable/launch.cu for sm_80..sm_90a,
// hopper/launch.cu for sm_90a only), called by the C ABI (sage_api.cu) after it has checked the parameters.
#pragma once
#include "../sage_kernels.h"
#include <cuda_runtime.h>

namespace sage {

// the mma.sync path: kernel ids SAGE_KERNEL_MMA_*
int64_t portable_workspace_bytes(const SageAttnParams& p);
int portable_fwd(const SageAttnParams& p, cudaStream_t st);

// the Hopper path (SAGE_KERNEL_WGMMA_FP8): defined only when the build has sm_90a (SAGE_WITH_HOPPER)
bool hopper_supported(const SageAttnParams& p);
int64_t hopper_workspace_bytes(const SageAttnParams& p);
int hopper_fwd(const SageAttnParams& p, cudaStream_t st);
// the Hopper SageBwd backward kernel (dQ, dK, dV) (hopper/bwd_launch.cu, sm_90a builds only)
int hopper_bwd(const SageBwdParams& p, cudaStream_t st);
// the Hopper SageBwd training forward (hopper/fwd_train_launch.cu, sm_90a builds only)
int hopper_train_fwd(const SageTrainFwdParams& p, cudaStream_t st);

}  // namespace sage

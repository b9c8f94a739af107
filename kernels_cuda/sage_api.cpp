// The C ABI of libsage_kernels.so (sage_kernels.h) and nothing else: argument checks, the current device, and the
// dispatch of SageAttnParams.kernel to its kernel family (common/entry.h). Host code only.
#include <cuda_runtime.h>
#include <stdint.h>

#include "sage_kernels.h"
#include "common/entry.h"

#ifndef SAGE_ARCHS
#define SAGE_ARCHS "unknown"
#endif
#ifndef SAGE_WITH_HOPPER  // 1 when the build has sm_90a and links hopper/launch.cu
#define SAGE_WITH_HOPPER 0
#endif

#if !SAGE_WITH_HOPPER
namespace sage {  // no sm_90a in this build: sage_attn_fwd refuses the Hopper kernel id before these are reached
bool hopper_supported(const SageAttnParams&) { return false; }
int64_t hopper_workspace_bytes(const SageAttnParams&) { return -1; }
int hopper_fwd(const SageAttnParams&, cudaStream_t) { return SAGE_E_ARCH; }
int hopper_bwd(const SageBwdParams&, cudaStream_t) { return SAGE_E_ARCH; }
int hopper_train_fwd(const SageTrainFwdParams&, cudaStream_t) { return SAGE_E_ARCH; }
}  // namespace sage
#endif

namespace {

bool is_qk4(int kernel) {
    return kernel == SAGE_KERNEL_MMA_FP8_QK4 || kernel == SAGE_KERNEL_MMA_FP16_QK4 ||
           kernel == SAGE_KERNEL_MMA_FP8F16_QK4;
}
bool needs_fp8(int kernel) { return kernel != SAGE_KERNEL_MMA_FP16 && kernel != SAGE_KERNEL_MMA_FP16_QK4; }
// the caller's parameters plus the fields the library derives from them (qk_packed from the kernel id)
SageAttnParams with_derived(const SageAttnParams& p) {
    SageAttnParams q = p;
    q.qk_packed = is_qk4(p.kernel) ? 1 : 0;
    return q;
}
// our (static) runtime keeps its own current device: follow the caller's (0, or the CUDA error of setting it)
int follow_device(int device) {
    int cur = -1;
    if (cudaGetDevice(&cur) == cudaSuccess && cur == device) return 0;
    return (int)cudaSetDevice(device);
}

}  // namespace

extern "C" {

int64_t sage_attn_workspace_bytes(const SageAttnParams* p) {
    if (!p) return -1;
    if (p->kernel == SAGE_KERNEL_WGMMA_FP8) return sage::hopper_workspace_bytes(*p);
    return sage::portable_workspace_bytes(with_derived(*p));
}

int sage_attn_fwd(const SageAttnParams* p, void* stream) {
    if (!p || !p->q || !p->k || !p->v || !p->o || !p->workspace) return SAGE_E_BADARG;
    if (p->B <= 0 || p->Hq <= 0 || p->Hkv <= 0 || p->Sq <= 0 || p->Skv <= 0 || p->Hq % p->Hkv != 0) return SAGE_E_BADARG;
    if (p->kernel < 0 || p->kernel >= SAGE_KERNEL_COUNT) return SAGE_E_BADARG;
    if ((p->qk_bits != 0 && p->qk_bits != 8 && p->qk_bits != 4) || (p->smooth_v != 0 && p->smooth_v != 1))
        return SAGE_E_BADARG;
    if (is_qk4(p->kernel) && p->qk_bits != 4) return SAGE_E_BADARG;  // packed INT4 MMA: "4b" only
    if (p->hop_split_max < 0) return SAGE_E_BADARG;
    if (p->window_keys < 0) return SAGE_E_BADARG;
    if ((p->cu_seqlens_q == nullptr) != (p->cu_seqlens_k == nullptr)) return SAGE_E_BADARG;
    if (p->cu_seqlens_q && p->kmask) return SAGE_E_BADARG;
    if ((int64_t)p->B * p->Hq > 65535) return SAGE_E_BADARG;  // grid.y of the pre-passes
    if (p->device_cc < 80 || (needs_fp8(p->kernel) && p->device_cc < 89)) return SAGE_E_ARCH;
    cudaStream_t st = static_cast<cudaStream_t>(stream);
    if (const int e = follow_device(p->device)) return e;
    const SageAttnParams q = with_derived(*p);
    if (q.kernel == SAGE_KERNEL_WGMMA_FP8) {
        if (!SAGE_WITH_HOPPER || q.device_cc != 90) return SAGE_E_ARCH;
        if (!sage::hopper_supported(q)) return SAGE_E_BADARG;
        return sage::hopper_fwd(q, st);
    }
    return sage::portable_fwd(q, st);
}

int sage_bwd(const SageBwdParams* p, void* stream) {
    if (!p || !p->q_int || !p->q_t || !p->do_t || !p->stats || !p->k_int || !p->k_scale || !p->v || !p->dout ||
        !p->dk || !p->dv || !p->dq_acc)
        return SAGE_E_BADARG;
    if (p->B <= 0 || p->Hq <= 0 || p->Hkv <= 0 || p->Sq <= 0 || p->Skv <= 0 || p->Hq % p->Hkv != 0) return SAGE_E_BADARG;
    if ((int64_t)p->B * p->Hkv > 65535) return SAGE_E_BADARG;  // grid.y
    if (p->dtype != 0 && p->dtype != 1) return SAGE_E_BADARG;
    if (p->t_stride < p->Sq || p->t_stride % 16 != 0) return SAGE_E_BADARG;
    if (p->D != 64 && p->D != 128) return SAGE_E_HEADDIM;
    if (!SAGE_WITH_HOPPER || p->device_cc != 90) return SAGE_E_ARCH;
    if (const int e = follow_device(p->device)) return e;
    return sage::hopper_bwd(*p, static_cast<cudaStream_t>(stream));
}

int sage_train_fwd(const SageTrainFwdParams* p, void* stream) {
    if (!p || !p->q_int || !p->q_scale || !p->k_int || !p->k_scale || !p->v || !p->o || !p->lse || !p->lse_s)
        return SAGE_E_BADARG;
    if (p->B <= 0 || p->Hq <= 0 || p->Hkv <= 0 || p->Sq <= 0 || p->Skv <= 0 || p->Hq % p->Hkv != 0) return SAGE_E_BADARG;
    if ((int64_t)p->B * p->Hq > 65535) return SAGE_E_BADARG;  // grid.y
    if (p->dtype != 0 && p->dtype != 1) return SAGE_E_BADARG;
    if (p->D != 64 && p->D != 128) return SAGE_E_HEADDIM;
    if (!SAGE_WITH_HOPPER || p->device_cc != 90) return SAGE_E_ARCH;
    if (const int e = follow_device(p->device)) return e;
    return sage::hopper_train_fwd(*p, static_cast<cudaStream_t>(stream));
}

const char* sage_error_string(int code) {
    switch (code) {
        case 0: return "ok";
        case SAGE_E_BADARG: return "bad argument";
        case SAGE_E_ARCH: return "device compute capability not supported by this kernel variant";
        case SAGE_E_HEADDIM: return "head dim not supported (64, 128 and 256 only)";
        default: return cudaGetErrorString(static_cast<cudaError_t>(code));
    }
}

int sage_abi_version(void) { return SAGE_ABI_VERSION; }

const char* sage_compiled_archs(void) { return SAGE_ARCHS; }

int sage_hopper_compiled(void) { return SAGE_WITH_HOPPER; }

}  // extern "C"

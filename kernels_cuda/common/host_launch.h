// Host-side launch helpers shared by the kernel families: the workspace carve-up and the dynamic shared-memory opt-in.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

namespace sage {

// The workspace carve-up, written once per kernel family as a sequence of take() calls: regions in that order, each
// starting 256-byte aligned. Over a null base it only sizes (the family's *_workspace_bytes, which the caller
// allocates); over the workspace it gives each region's typed pointer. One sequence for both keeps them in step.
class WsCarver {
  public:
    explicit WsCarver(void* base) : base_(reinterpret_cast<uintptr_t>(base)) {}
    template <typename P>
    P* take(int64_t bytes) {
        P* r = base_ ? reinterpret_cast<P*>(base_ + (uintptr_t)off_) : nullptr;
        off_ = (off_ + bytes + 255) & ~int64_t(255);
        return r;
    }
    int64_t size() const { return off_; }

  private:
    uintptr_t base_;
    int64_t off_ = 0;
};

// Kernels with more than 48 KB of dynamic shared memory must opt in, once per kernel and device: done holds that
// kernel's flags per device (a static of the caller; devices past 64 opt in on every launch)
template <typename Kernel>
cudaError_t opt_in_dynamic_smem(Kernel kern, int smem, bool (&done)[64], int dev) {
    if (dev >= 0 && dev < 64 && done[dev]) return cudaSuccess;
    const cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e == cudaSuccess && dev >= 0 && dev < 64) done[dev] = true;
    return e;
}

}  // namespace sage

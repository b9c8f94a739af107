// Hopper SageBwd backward (bwd_kernel.cuh): dQ's products over both warpgroups' dS images, staged per warp in
// shared memory and added to the fp32 dQ buffer by bulk reductions.
#pragma once
#include "bwd_traits.cuh"
#include "wgmma.cuh"

namespace sage::hopper {

// dst[0 .. bytes / 4) += src[...] (fp32, elementwise atomic), one bulk reduction from shared memory (16-byte aligned,
// bytes a multiple of 16) in this thread's bulk group: the fused dQ's accumulation
__device__ __forceinline__ void bulk_red_add_f32(float* dst, uint32_t src, uint32_t bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                 ::"l"(dst), "r"(src), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// this thread's bulk reductions have read their sources (Read) or completed
template <bool Read> __device__ __forceinline__ void bulk_wait() {
    if constexpr (Read) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
    else asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}
// The deterministic mode's order (bwd_kernel.cuh): a tile's counter (int32, global) counts the warps whose bulk
// reductions into the tile have completed. One lane waits until it reaches target (every warp of the key blocks
// before this one in the tile's order; >=, not ==: the counter moves on once this key block's other warps add),
// acquire, then orders its following bulk reductions (async proxy) after it
__device__ __forceinline__ void bwd_dq_wait(const int* sem, int target) {
    for (uint32_t ns = 32;; ns = ns < 512 ? 2 * ns : ns) {
        int v;
        asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(sem) : "memory");
        if (v >= target) break;
        __nanosleep(ns);
    }
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
}
// this lane's bulk reductions complete (bulk_wait<false>), made visible to the generic proxy and released with one
// increment of the tile's counter
__device__ __forceinline__ void bwd_dq_signal(int* sem) {
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
    asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(sem) : "memory");
}
__device__ __forceinline__ void sts_v2(uint32_t a, float x, float y) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(a), "f"(x), "f"(y) : "memory");
}

// dQ (fp32, without tau) += sum over the CTA's key blocks kb of (q8(dS s_K)_kb K^_kb) scale_kb for the 64 queries of
// a tile from m0, this warpgroup's half of the channels (h0..h0 + D/2): the two warpgroups' products summed in
// registers (one reduction per key pair of blocks), 32 channels at a time, into the warp's staging block (free: its
// previous bulk reduction has read it), then added to the warp's block of the tile in the dQ buffer by one bulk
// reduction from lane 0 (FA3's dQ path, per warp: no barrier beyond the warp's; 1 bulk operation per warp and
// chunk instead of 8 vector reductions per thread). dq: the tile in the dQ buffer (bwd_dq_tile), kv0: the first
// warpgroup's region, ds: the dS images' offset in it (the tile's parity)
template <int D>
__device__ __forceinline__ void bwd_dq_update(uint32_t kv0, int ds, const float* sc0, const float* sc1, uint32_t stg,
                                              float* dq, int h0, int ltid) {
    using S = BwdSmem<D>;
    // (warp through __shfl_sync: warp-uniform to ptxas, so the staging block's and the buffer block's addresses
    // stay in uniform registers, the bulk reduction's operands, not rebuilt from threadIdx each tile)
    const int warp = __shfl_sync(0xffffffffu, ltid >> 5, 0), lane = ltid & 31, g = lane >> 2;
    const uint32_t wst = stg + warp * S::DQ_WARP;
    const int r0 = 16 * warp + g, r1 = r0 + 8;
    const float s00 = sc0[r0], s01 = sc0[r1], s10 = sc1[r0], s11 = sc1[r1];
#pragma unroll
    for (int ch = 0; ch < D / 64; ++ch) {  // 32 channels per product
        int t0[16], t1[16];
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
            const uint32_t a0 = desc_lo(kv0 + ds) + desc_step(32 * kk),
                           b0 = desc_lo(kv0 + S::KT_IN_KV + 64 * (h0 + 32 * ch)) + desc_step(32 * kk);
            const uint32_t a1 = a0 + desc_step(S::KV_STRIDE), b1 = b0 + desc_step(S::KV_STRIDE);
            if (kk == 0) {
                wgmma_s8_n32_ss<false>(t0, desc_make(a0, desc_hi(64)), desc_make(b0, desc_hi(64)));
                wgmma_s8_n32_ss<false>(t1, desc_make(a1, desc_hi(64)), desc_make(b1, desc_hi(64)));
            } else {
                wgmma_s8_n32_ss<true>(t0, desc_make(a0, desc_hi(64)), desc_make(b0, desc_hi(64)));
                wgmma_s8_n32_ss<true>(t1, desc_make(a1, desc_hi(64)), desc_make(b1, desc_hi(64)));
            }
        }
        wg_commit();
        wg_wait<0>();
        reg_fence(t0);
        reg_fence(t1);
        if (ch > 0) {  // the previous chunk's block read
            if (lane == 0) bulk_wait<true>();
            __syncwarp();
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint32_t a = wst + 8 * (64 * i + lane);
            sts_v2(a, (float)t0[4 * i] * s00 + (float)t1[4 * i] * s10,
                   (float)t0[4 * i + 1] * s00 + (float)t1[4 * i + 1] * s10);
            sts_v2(a + 8 * 32, (float)t0[4 * i + 2] * s01 + (float)t1[4 * i + 2] * s11,
                   (float)t0[4 * i + 3] * s01 + (float)t1[4 * i + 3] * s11);
        }
        // generic stores read by the bulk copy (the async proxy): every writer's fence, then the warp's barrier
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncwarp();
        if (lane == 0) bulk_red_add_f32(dq + bwd_dq_block(h0 / 32 + ch, warp), wst, S::DQ_WARP);
    }
}

}  // namespace sage::hopper

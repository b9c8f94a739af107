// Hopper path: the sm_90a PTX wrappers (the PTX header of kernels_cuda/hopper/; the sm_80+ ones are
// common/ptx.cuh). wgmma descriptors of the swizzled operand images, mbarriers, bulk global -> shared copies (the
// producer's), wgmma fences and the wgmma instructions (S = Q K^T in s8, P~V in e4m3).
#pragma once
#include "traits.cuh"
#include "../common/ptx.cuh"

#if defined(__CUDA_ARCH__) && !(__CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL))
#error "kernels_cuda/hopper/ is compiled for sm_90a only (build_kernels.py)"
#endif

namespace sage::hopper {

// Descriptor of an img_off image with rows of kbytes, in two halves: the low word holds the start address (and
// the leading byte offset), the high word is a compile-time constant (stride, swizzle mode). Moving along K or to
// another stage adds to the low word only (desc_step): shared-memory addresses are < 2^18, so the 14-bit address
// field never carries into the rest, and the loop pays one add per wgmma instead of a mask-shift-or sequence.
__host__ __device__ constexpr uint32_t desc_hi(int kbytes) {
    // swizzled K-major: 8-row atoms kbytes * 8 apart (SBO), LBO unused; mode 1 = 128B, 2 = 64B swizzle. The
    // hardware applies the XOR to the address bits, so images start 8 * kbytes aligned and K steps add to the start.
    return (uint32_t)((8 * kbytes) >> 4) | ((kbytes >= 128 ? 1u : 2u) << 30);
}
__device__ __forceinline__ uint32_t desc_lo(uint32_t img) { return ((img & 0x3FFFF) >> 4) | (1u << 16); }
// low-word increment for starting k0 bytes (a multiple of 32) further along K
__host__ __device__ constexpr uint32_t desc_step(int k0) { return (uint32_t)(k0 >> 4); }
// the same along the K of an image with rows of kbytes: past 128 bytes the next 1024-byte atom (img_off)
__host__ __device__ constexpr uint32_t desc_kstep(int k0, int kbytes) {
    return kbytes > 128 ? desc_step((k0 >> 7) * 1024 + (k0 & 127)) : desc_step(k0);
}
__device__ __forceinline__ uint64_t desc_make(uint32_t lo, uint32_t hi) { return ((uint64_t)hi << 32) | lo; }
// The bytes from the dynamic shared memory's start to its first 1024-byte boundary: the swizzled operand images'
// 8-row atoms (and TMA's swizzled boxes) must start there, which __align__ on an extern array does not promise; each
// kernel's shared-memory size carries 1024 bytes of slack for it
__device__ __forceinline__ uint32_t smem_pad_1024(const uint8_t* raw) {
    return (1024u - (smem_u32(raw) & 1023u)) & 1023u;
}
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// a ring of n stages' barriers, 8 bytes apart: full (arrival count nfull) and empty (nempty); the caller fences
// the initializations (fence.mbarrier_init) once after all its rings
__device__ __forceinline__ void mbar_init_ring(uint32_t full, uint32_t empty, int n, uint32_t nfull, uint32_t nempty) {
    for (int s = 0; s < n; ++s) {
        mbar_init(full + 8 * s, nfull);
        mbar_init(empty + 8 * s, nempty);
    }
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    uint32_t ok;
    do {
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(ok) : "r"(bar), "r"(parity) : "memory");
    } while (!ok);
}
// thread block clusters (the D = 256 K/V pre-pass: the two channel halves of a block exchange their maxima): the
// cluster barrier in two halves (arrive: this thread's shared-memory writes released; wait: the other CTAs' writes
// before their arrive visible), and a float of CTA rank r's shared memory at this CTA's address a
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory"); }
// (relaxed: no release of this thread's memory operations, no membar; for "this CTA's reads of the others' shared
// memory are done", whose values the thread has already used)
__device__ __forceinline__ void cluster_arrive_relaxed() {
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory"); }
__device__ __forceinline__ uint32_t cluster_rank() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
__device__ __forceinline__ float ld_cluster_f32(const void* a, uint32_t rank) {
    uint32_t ra;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(ra) : "r"(smem_u32(a)), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(ra) : "memory");
    return v;
}
__device__ __forceinline__ void bulk_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
// TMA (cp.async.bulk.tensor, tensor maps of common/tensor_map.h): the box of `map` (a __grid_constant__ kernel
// parameter) at element coordinates c (c[0] along the contiguous dimension) into shared memory at dst, its bytes
// counted on mbarrier bar (mbar_expect_tx); parts of the box outside the tensor land as zeros
__device__ __forceinline__ void tma_load(uint32_t dst, const void* map, uint32_t bar, int c0) {
    asm volatile("cp.async.bulk.tensor.1d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3}], [%2];\n"
                 ::"r"(dst), "l"(map), "r"(bar), "r"(c0) : "memory");
}
__device__ __forceinline__ void tma_load(uint32_t dst, const void* map, uint32_t bar, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n"
                 ::"r"(dst), "l"(map), "r"(bar), "r"(c0), "r"(c1) : "memory");
}
__device__ __forceinline__ void tma_load(uint32_t dst, const void* map, uint32_t bar, int c0, int c1, int c2) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];\n"
                 ::"r"(dst), "l"(map), "r"(bar), "r"(c0), "r"(c1), "r"(c2) : "memory");
}
__device__ __forceinline__ void tma_load(uint32_t dst, const void* map, uint32_t bar, int c0, int c1, int c2, int c3) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];\n"
                 ::"r"(dst), "l"(map), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}
__device__ __forceinline__ void tma_load(uint32_t dst, const void* map, uint32_t bar, int c0, int c1, int c2, int c3,
                                         int c4) {
    asm volatile("cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6, %7}], [%2];\n"
                 ::"r"(dst), "l"(map), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4) : "memory");
}
// the map's descriptor into the TMA unit's cache ahead of its first use
__device__ __forceinline__ void tma_prefetch_map(const void* map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(map) : "memory");
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
template <int N> __device__ __forceinline__ void reg_fence(int (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}
template <int N> __device__ __forceinline__ void reg_fence(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
__device__ __forceinline__ void named_sync(int id, int n) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
// arrive at named barrier id (n threads in all) without waiting: the other side of a named_sync
__device__ __forceinline__ void named_arrive(int id, int n) { asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
template <int N, int M> __device__ __forceinline__ void reg_fence(uint32_t (&r)[N][M]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int j = 0; j < M; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
}

// operand lists for 64 / 32 accumulator registers; C: "+r" / "+f" (accumulate) or "=r" / "=f" (first k step: the
// accumulator is only written, so its old values are dead for the compiler and cost no registers across the softmax)
#define SAGE_D8(C, i) C(d[i + 0]), C(d[i + 1]), C(d[i + 2]), C(d[i + 3]), C(d[i + 4]), C(d[i + 5]), C(d[i + 6]), \
                      C(d[i + 7])
#define SAGE_D64(C) SAGE_D8(C, 0), SAGE_D8(C, 8), SAGE_D8(C, 16), SAGE_D8(C, 24), SAGE_D8(C, 32), SAGE_D8(C, 40), \
                    SAGE_D8(C, 48), SAGE_D8(C, 56)
#define SAGE_LIST32 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
    "%24, %25, %26, %27, %28, %29, %30, %31"
#define SAGE_LIST64 \
    SAGE_LIST32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, " \
    "%51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"

// S (64 x 128, int32) (+)= Q (64 x 32 int8, smem) . K (128 x 32 int8, smem)^T; ACC: add to d, else overwrite it
#define SAGE_WGMMA_S8(SCALE_D, C) \
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 {" SAGE_LIST64 "}, %64, %65, " SCALE_D ";\n" \
                 : SAGE_D64(C) : "l"(da), "l"(db))
template <bool ACC> __device__ __forceinline__ void wgmma_s8_n128(int (&d)[64], uint64_t da, uint64_t db) {
    if constexpr (ACC) SAGE_WGMMA_S8("1", "+r");
    else SAGE_WGMMA_S8("0", "=r");
}
// O (64 x D + 8, fp32) (+)= P~ (64 x 32 e4m3, registers) . V^T (D + 8 x 32 e4m3, smem)^T; columns D.. are row sums
#define SAGE_WGMMA_E4_N136(SCALE_D, C) \
    asm volatile("wgmma.mma_async.sync.aligned.m64n136k32.f32.e4m3.e4m3 {" SAGE_LIST64 ", %64, %65, %66, %67}, " \
                 "{%68, %69, %70, %71}, %72, " SCALE_D ", 1, 1;\n" \
                 : SAGE_D64(C), C(d[64]), C(d[65]), C(d[66]), C(d[67]) \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db))
#define SAGE_WGMMA_E4_N72(SCALE_D, C) \
    asm volatile("wgmma.mma_async.sync.aligned.m64n72k32.f32.e4m3.e4m3 {" SAGE_LIST32 ", %32, %33, %34, %35}, " \
                 "{%36, %37, %38, %39}, %40, " SCALE_D ", 1, 1;\n" \
                 : SAGE_D8(C, 0), SAGE_D8(C, 8), SAGE_D8(C, 16), SAGE_D8(C, 24), C(d[32]), C(d[33]), C(d[34]), \
                   C(d[35]) \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db))
#define SAGE_WGMMA_E4_N64(SCALE_D, C) \
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {" SAGE_LIST32 "}, " \
                 "{%32, %33, %34, %35}, %36, " SCALE_D ", 1, 1;\n" \
                 : SAGE_D8(C, 0), SAGE_D8(C, 8), SAGE_D8(C, 16), SAGE_D8(C, 24) \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db))
// P~V over the first 64 V^T rows only (channels vcol(0..63)): the first half of a column-split P~V at D = 128
template <bool ACC> __device__ __forceinline__ void wgmma_pv64(float (&d)[32], const uint32_t* a, uint64_t db) {
    if constexpr (ACC) SAGE_WGMMA_E4_N64("1", "+f");
    else SAGE_WGMMA_E4_N64("0", "=f");
}
// P~V over V^T rows 64..135 (the second half of a split P~V at D = 128, with the row sums), or all rows at D = 64
template <bool ACC> __device__ __forceinline__ void wgmma_pv72(float (&d)[36], const uint32_t* a, uint64_t db) {
    if constexpr (ACC) SAGE_WGMMA_E4_N72("1", "+f");
    else SAGE_WGMMA_E4_N72("0", "=f");
}
template <int D, bool ACC>
__device__ __forceinline__ void wgmma_pv(float (&d)[pv_n(D) / 2], const uint32_t* a, uint64_t db) {
    if constexpr (D == 128) {
        if constexpr (ACC) SAGE_WGMMA_E4_N136("1", "+f");
        else SAGE_WGMMA_E4_N136("0", "=f");
    } else {
        if constexpr (ACC) SAGE_WGMMA_E4_N72("1", "+f");
        else SAGE_WGMMA_E4_N72("0", "=f");
    }
}

// The training backward's products (bwd_kernel.cuh), m64n64 and m64n32: INT8 with A from shared memory or
// registers, and 16-bit (fp16 / bf16, fp32 accumulation) with both operands K-major in shared memory.
// C (64 x 64 int32) (+)= A (64 x 32 int8, smem) B (64 x 32 int8, smem)^T
#define SAGE_WGMMA_S8_N64_SS(SCALE_D, C) \
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 {" SAGE_LIST32 "}, %32, %33, " SCALE_D ";\n" \
                 : SAGE_D8(C, 0), SAGE_D8(C, 8), SAGE_D8(C, 16), SAGE_D8(C, 24) : "l"(da), "l"(db))
template <bool ACC> __device__ __forceinline__ void wgmma_s8_n64_ss(int (&d)[32], uint64_t da, uint64_t db) {
    if constexpr (ACC) SAGE_WGMMA_S8_N64_SS("1", "+r");
    else SAGE_WGMMA_S8_N64_SS("0", "=r");
}
// C (64 x 32 int32) (+)= A (64 x 32 int8, smem) B (32 x 32 int8, smem)^T (the fused dQ's products, 32 channels each)
#define SAGE_WGMMA_S8_N32_SS(SCALE_D, C) \
    asm volatile("wgmma.mma_async.sync.aligned.m64n32k32.s32.s8.s8 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, " \
                 "%11, %12, %13, %14, %15}, %16, %17, " SCALE_D ";\n" \
                 : SAGE_D8(C, 0), SAGE_D8(C, 8) : "l"(da), "l"(db))
template <bool ACC> __device__ __forceinline__ void wgmma_s8_n32_ss(int (&d)[16], uint64_t da, uint64_t db) {
    if constexpr (ACC) SAGE_WGMMA_S8_N32_SS("1", "+r");
    else SAGE_WGMMA_S8_N32_SS("0", "=r");
}
// C (64 x 64 int32) (+)= A (64 x 32 int8, registers) B (64 x 32 int8, smem)^T
#define SAGE_WGMMA_S8_N64_RS(SCALE_D, C) \
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 {" SAGE_LIST32 "}, {%32, %33, %34, %35}, %36, " \
                 SCALE_D ";\n" \
                 : SAGE_D8(C, 0), SAGE_D8(C, 8), SAGE_D8(C, 16), SAGE_D8(C, 24) \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db))
template <bool ACC> __device__ __forceinline__ void wgmma_s8_n64_rs(int (&d)[32], const uint32_t* a, uint64_t db) {
    if constexpr (ACC) SAGE_WGMMA_S8_N64_RS("1", "+r");
    else SAGE_WGMMA_S8_N64_RS("0", "=r");
}
// C (64 x 64 fp32) (+)= A (64 x 16 fp16/bf16, smem) B (64 x 16, smem)^T, both K-major
#define SAGE_WGMMA_H16_N64(TY, SCALE_D, C) \
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {" SAGE_LIST32 "}, %32, %33, " SCALE_D \
                 ", 1, 1, 0, 0;\n" \
                 : SAGE_D8(C, 0), SAGE_D8(C, 8), SAGE_D8(C, 16), SAGE_D8(C, 24) : "l"(da), "l"(db))
template <typename T, bool ACC> __device__ __forceinline__ void wgmma_h16_n64(float (&d)[32], uint64_t da, uint64_t db) {
    if constexpr (std::is_same<T, __half>::value) {
        if constexpr (ACC) SAGE_WGMMA_H16_N64("f16", "1", "+f");
        else SAGE_WGMMA_H16_N64("f16", "0", "=f");
    } else {
        if constexpr (ACC) SAGE_WGMMA_H16_N64("bf16", "1", "+f");
        else SAGE_WGMMA_H16_N64("bf16", "0", "=f");
    }
}

}  // namespace sage::hopper

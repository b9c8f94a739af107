// Shared by every kernel family: the launch parameters (SageAttnParams, sage_kernels.h), numeric constants, the
// kernel-variant ids of the C ABI and the varlen sequence offsets.
#pragma once
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>
#include <type_traits>

#include "../sage_kernels.h"

namespace sage {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kFp8Max = 448.f;
constexpr float kLog2Fp8Max = 8.807354922057604f;  // log2(448)
constexpr float kLnFp8Max = 6.104793232414985f;    // ln(448)


__host__ __device__ __forceinline__ int qk_max(const SageAttnParams& p) { return p.qk_bits == 4 ? 7 : 127; }

// sequence b: its lengths (the max lengths Sq/Skv unless varlen) and the token offset of its first row
__device__ __forceinline__ int len_q(const SageAttnParams& p, int b) {
    if (!p.cu_seqlens_q) return p.Sq;
    return min(p.Sq, max(0, p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b]));
}
__device__ __forceinline__ int len_k(const SageAttnParams& p, int b) {
    if (!p.cu_seqlens_k) return p.Skv;
    return min(p.Skv, max(0, p.cu_seqlens_k[b + 1] - p.cu_seqlens_k[b]));
}
__device__ __forceinline__ int64_t tok0_q(const SageAttnParams& p, int b) {
    return p.cu_seqlens_q ? (int64_t)p.cu_seqlens_q[b] : 0;
}
__device__ __forceinline__ int64_t tok0_k(const SageAttnParams& p, int b) {
    return p.cu_seqlens_k ? (int64_t)p.cu_seqlens_k[b] : 0;
}

}  // namespace sage

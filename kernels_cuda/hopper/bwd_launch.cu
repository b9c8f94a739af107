// The Hopper SageBwd backward (dQ, dK, dV), one translation unit compiled for sm_90a only: the kernel's instantiations
// and its launch (bwd_kernel.cuh).
#include "../common/entry.h"
#include "../common/host_launch.h"
#include "../common/tensor_map.h"
#include "bwd_kernel.cuh"

namespace sage::hopper {

// the producer's tensor maps (BwdMaps) of this launch; false where the driver refuses those of Q^T and dO^T (those
// of the permuted operands, refused or not applicable: perm = 0, their cp.async copies)
template <int D>
bool bwd_maps(const SageBwdParams& p, BwdMaps& m) {
    const uint64_t dims[3] = {(uint64_t)p.Sq, (uint64_t)D, (uint64_t)p.B * p.Hq};
    const uint64_t strides[2] = {(uint64_t)p.t_stride, (uint64_t)p.t_stride * D};
    const uint32_t box[3] = {(uint32_t)kBwdQueries, (uint32_t)D, 1};
    if (!tensor_map_tiled(&m.qt, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, p.q_t, dims, strides, box,
                          CU_TENSOR_MAP_SWIZZLE_64B) ||
        !tensor_map_tiled(&m.dot, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, p.do_t, dims, strides, box,
                          CU_TENSOR_MAP_SWIZZLE_64B))
        return false;
    // the permuted ones (BwdMaps): rows of `row` bytes, a 16-row group's query bits in slot order (bwd_query_of:
    // slot bits 0, 1, 2-3 hold query bits 0, 3, 1-2), 16-row groups outermost
    auto perm_map = [](CUtensorMap* map, CUtensorMapDataType type, const void* base, uint64_t row_elems,
                       uint64_t row, uint64_t groups, uint32_t box0, CUtensorMapSwizzle sw) {
        const uint64_t d[5] = {row_elems, 2, 4, 2, groups};
        const uint64_t s[4] = {row, 4 * row, 2 * row, 16 * row};
        const uint32_t b[5] = {box0, 2, 4, 2, kBwdQueries / 16};
        return tensor_map_tiled(map, type, 5, base, d, s, b, sw);
    };
    m.perm = 0;
    m.do_gb = m.do_gh = m.do_ch = 0;
    // dO's heads start on whole 16-row groups (BHSD) or inside a row (BSHD: the head's channels at h do_sh);
    // a batch entry on whole groups (a single entry or head: whatever its stride)
    const int64_t grp = 16 * p.do_ss;
    const bool in_row = p.Hq == 1 || ((p.do_sh % grp != 0) && p.do_sh >= D && (p.Hq - 1) * p.do_sh + D <= p.do_ss);
    const bool heads = p.Hq == 1 || p.do_sh % grp == 0 || in_row;
    const bool batch = p.B == 1 || p.do_sb % grp == 0;
    if (p.Sq % 16 != 0 || !heads || !batch || p.do_ss < D) return true;
    const int64_t span = (int64_t)(p.B - 1) * p.do_sb + (int64_t)(p.Hq - 1) * p.do_sh + (int64_t)p.Sq * p.do_ss;
    const uint64_t rows16 = (uint64_t)p.B * p.Hq * p.Sq / 16;
    const CUtensorMapDataType h16 = p.dtype == 0 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    if (!perm_map(&m.q, CU_TENSOR_MAP_DATA_TYPE_UINT8, p.q_int, D, D, rows16, D,
                  D == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B) ||
        !perm_map(&m.st, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, p.stats, 4, 16, rows16, 4, CU_TENSOR_MAP_SWIZZLE_NONE) ||
        !perm_map(&m.dout, h16, p.dout, (uint64_t)p.do_ss, 2 * (uint64_t)p.do_ss, (uint64_t)(span / grp + 1), 64,
                  CU_TENSOR_MAP_SWIZZLE_128B))
        return true;
    m.do_gb = p.B == 1 ? 0 : (int)(p.do_sb / grp);
    m.do_gh = p.Hq == 1 || in_row ? 0 : (int)(p.do_sh / grp);
    m.do_ch = p.Hq > 1 && in_row ? (int)p.do_sh : 0;
    m.perm = 1;
    return true;
}

// Det: the deterministic mode (p.dq_sem), its own instantiation so that the default one carries none of it
template <int D, typename T, bool Det>
int bwd_launch(const SageBwdParams& p, cudaStream_t st) {
    using S = BwdSmem<D>;
    auto kern = hopper_bwd_kernel<D, T, Det>;
    static bool done[64] = {};
    cudaError_t e = opt_in_dynamic_smem(kern, S::TOTAL, done, p.device);
    if (e != cudaSuccess) return (int)e;
    BwdMaps maps;
    if (!bwd_maps<D>(p, maps)) return SAGE_E_BADARG;
    constexpr int keys = kBwdKeys * kBwdNwg;
    const dim3 grid((p.Skv + keys - 1) / keys, p.B * p.Hkv);
    kern<<<grid, kBwdThreads, S::TOTAL, st>>>(p, maps);
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
    // the TMA loads of Q^T and dO^T: 16-byte aligned bases (their row stride t_stride: sage_bwd checked it)
    if (reinterpret_cast<uintptr_t>(p.q_t) % 16 != 0 || reinterpret_cast<uintptr_t>(p.do_t) % 16 != 0)
        return SAGE_E_BADARG;
    return p.dq_sem ? hopper::bwd_dispatch<true>(p, st) : hopper::bwd_dispatch<false>(p, st);
}

}  // namespace sage

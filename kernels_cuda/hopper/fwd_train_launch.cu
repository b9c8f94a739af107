// The Hopper SageBwd training forward (O, both LSEs), one translation unit compiled for sm_90a only: the kernel's
// instantiations and its launch (fwd_train_kernel.cuh), with the producer's tensor maps.
#include "../common/entry.h"
#include "../common/host_launch.h"
#include "../common/tensor_map.h"
#include <cstring>
#include "fwd_train_kernel.cuh"

namespace sage::hopper {

// The producer's maps over the call's tensors (TfMaps); false where the driver refuses one (the launch then reports a
// bad argument: no kernel runs)
template <int D, typename T>
bool train_fwd_maps(const SageTrainFwdParams& p, TfMaps* m) {
    const uint64_t skv = (uint64_t)p.Skv, bhkv = (uint64_t)p.B * p.Hkv, e = sizeof(T);
    const uint64_t kd[3] = {D, skv, bhkv}, kst[2] = {D, skv * D};
    const uint32_t kb[3] = {D, 64, 1};
    // img_off's K-major image: D-byte rows, 16-byte chunk c of row r at chunk c ^ (r % 8) (128-byte rows) or
    // c ^ ((r / 2) % 4) (64-byte rows), the 128B / 64B swizzle of a box of 128- / 64-byte rows at a 1024-aligned base
    if (!tensor_map_tiled(&m->k, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, p.k_int, kd, kst, kb,
                          D == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B))
        return false;
    // bwd_h16_off's chunks: 64 channels (128 bytes) per key row, the 128B swizzle
    const uint64_t vd[4] = {D, skv, (uint64_t)p.Hkv, (uint64_t)p.B},
                   vst[3] = {(uint64_t)p.v_ss * e, (uint64_t)p.v_sh * e, (uint64_t)p.v_sb * e};
    const uint32_t vb[4] = {64, 64, 1, 1};
    const CUtensorMapDataType vt = std::is_same<T, __half>::value ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                                  : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    if (!tensor_map_tiled(&m->v, vt, 4, p.v, vd, vst, vb, CU_TENSOR_MAP_SWIZZLE_128B)) return false;
    const uint64_t sd[1] = {bhkv * skv};
    const uint32_t sbx[1] = {kTfScaleBox};
    if (!tensor_map_tiled(&m->ks, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 1, p.k_scale, sd, nullptr, sbx,
                          CU_TENSOR_MAP_SWIZZLE_NONE))
        return false;
    if (!p.kmask) return true;
    // one row for every batch entry where kmask_sb is 0 (its row stride then only has to be valid)
    const uint64_t md[2] = {skv, p.kmask_sb ? (uint64_t)p.B : 1},
                   mst[1] = {p.kmask_sb ? (uint64_t)p.kmask_sb : (skv + 15) / 16 * 16};
    const uint32_t mb[2] = {64, 1};
    return tensor_map_tiled(&m->kmask, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, p.kmask, md, mst, mb,
                            CU_TENSOR_MAP_SWIZZLE_NONE);
}

template <int D, typename T>
int train_fwd_launch(const SageTrainFwdParams& p, cudaStream_t st) {
    using S = TfSmem<D>;
    TfMaps maps;
    memset(&maps, 0, sizeof(maps));
    if (!train_fwd_maps<D, T>(p, &maps)) return SAGE_E_BADARG;
    auto kern = hopper_train_fwd_kernel<D, T>;
    static bool done[64] = {};
    cudaError_t e = opt_in_dynamic_smem(kern, S::TOTAL, done, p.device);
    if (e != cudaSuccess) return (int)e;
    constexpr int rows = 64 * kTfNwg<D>;
    const dim3 grid((p.Sq + rows - 1) / rows, p.B * p.Hq);
    kern<<<grid, kTfThreads<D>, S::TOTAL, st>>>(p, maps);
    return (int)cudaGetLastError();
}

}  // namespace sage::hopper

namespace sage {

int hopper_train_fwd(const SageTrainFwdParams& p, cudaStream_t st) {
    // TMA: 16-byte aligned bases and row strides (V, the key padding); 4-byte stores of O's channel pairs
    const bool v16 = reinterpret_cast<uintptr_t>(p.v) % 16 == 0 && p.v_sb % 8 == 0 && p.v_sh % 8 == 0 && p.v_ss % 8 == 0;
    const bool o4 = reinterpret_cast<uintptr_t>(p.o) % 4 == 0 && p.o_sb % 2 == 0 && p.o_sh % 2 == 0 && p.o_ss % 2 == 0;
    const bool m16 = !p.kmask || (reinterpret_cast<uintptr_t>(p.kmask) % 16 == 0 && p.kmask_sb % 16 == 0);
    // the key scales' map is one flat row, its box at element (B Hkv) row + key: a signed 32-bit coordinate
    const bool s32 = (int64_t)p.B * p.Hkv * p.Skv < ((int64_t)1 << 31) - 64;
    if (!v16 || !o4 || !m16 || !s32) return SAGE_E_BADARG;
    if (p.D == 64)
        return p.dtype == 0 ? hopper::train_fwd_launch<64, __half>(p, st) : hopper::train_fwd_launch<64, __nv_bfloat16>(p, st);
    return p.dtype == 0 ? hopper::train_fwd_launch<128, __half>(p, st) : hopper::train_fwd_launch<128, __nv_bfloat16>(p, st);
}

}  // namespace sage

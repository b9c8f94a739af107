// Host side of TMA (the Hopper kernels' producers): tiled tensor maps (CUtensorMap) over global tensors. The library
// links the static cudart only, not libcuda, so the driver's encoder is looked up once through the runtime's entry
// point query; a map is a kernel parameter (__grid_constant__), built per launch on the host (no device work, no
// synchronization, captured by CUDA graphs with the launch).
#pragma once
#include <cuda.h>  // CUtensorMap and its enums (types only: the function comes from the entry point below)
#include <cuda_runtime.h>
#include <stdint.h>

namespace sage {

using TensorMapEncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                          const cuuint64_t*, const cuuint32_t*, const cuuint32_t*,
                                          CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion,
                                          CUtensorMapFloatOOBfill);

inline TensorMapEncodeTiled tensor_map_encoder() {
    static const TensorMapEncodeTiled fn = [] {
        void* f = nullptr;
        cudaDriverEntryPointQueryResult q{};
        // the CUDA 12.0 signature (the one this typedef spells)
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) !=
                cudaSuccess || q != cudaDriverEntryPointSuccess)
            return (TensorMapEncodeTiled) nullptr;
        return reinterpret_cast<TensorMapEncodeTiled>(f);
    }();
    return fn;
}

// A tiled map of `rank` (1..5) dimensions over base: dims[0] is the contiguous one (elements), strides[i] the byte
// stride of dims[i + 1] (multiples of 16), box[] the elements one copy moves, landing in shared memory in box order
// (dims[0] fastest) with the given swizzle. Elements outside dims read as zero (a box may overhang a tensor's end).
// Returns false where the driver refuses the map (alignment, strides, box) or has no encoder: the caller falls
// back or reports a bad argument.
inline bool tensor_map_tiled(CUtensorMap* map, CUtensorMapDataType type, int rank, const void* base,
                             const uint64_t* dims, const uint64_t* strides, const uint32_t* box,
                             CUtensorMapSwizzle swizzle) {
    const TensorMapEncodeTiled enc = tensor_map_encoder();
    if (!enc || rank < 1 || rank > 5) return false;
    cuuint64_t d[5], s[4];
    cuuint32_t b[5], one[5] = {1, 1, 1, 1, 1};
    for (int i = 0; i < rank; ++i) d[i] = dims[i], b[i] = box[i];
    for (int i = 0; i + 1 < rank; ++i) s[i] = strides[i];
    return enc(map, type, (cuuint32_t)rank, const_cast<void*>(base), d, s, b, one, CU_TENSOR_MAP_INTERLEAVE_NONE,
               swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace sage

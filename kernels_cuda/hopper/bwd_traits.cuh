// Hopper SageBwd backward (bwd_kernel.cuh): its traits (warpgroups, stages, named barriers, tile size), the
// shared-memory layout (BwdSmem), the operand images' address helpers and the fp32 dQ buffer's block layout.
#pragma once
#include "traits.cuh"

namespace sage::hopper {

constexpr int kBwdKeys = 64;     // keys per warpgroup (wgmma M)
constexpr int kBwdNwg = 2;       // consumer warpgroups per CTA: they share each query tile's loads (half the traffic per key)
constexpr int kBwdLoaders = 128; // the producer warpgroup's threads (cp.async copies of what TMA does not load)
constexpr int kBwdThreads = kBwdLoaders + 128 * kBwdNwg;
constexpr int kBwdStages = 3;    // query tiles in the ring: the producer signals a tile one behind its copies
// named barriers (0: __syncthreads, 1 + w: consumer warpgroup w's own), each for one warpgroup's dS image of one
// tile parity par: ready (written; its owner arrives, the other warpgroup waits before dQ) and free (the other
// warpgroup's dQ read it; that one arrives, the owner waits before writing it again two tiles later)
constexpr int kBarDsReady = 3, kBarDsFree = kBarDsReady + 2 * kBwdNwg;
// products kept in flight across math where registers allow (D = 64: dK and dV hold 64 registers, not 128; at
// D = 128 either order below spills): the previous tile's dQ issued after this tile's S^T and dP^T (FA3's order:
// their 64 accumulators live across it), the dV product in flight during dS s_K's quantization. D = 128: the
// previous tile's dQ issued after S^T only (32 accumulators), dP^T after it
template <int D> constexpr bool kBwdOverlap = D == 64;
constexpr int kBwdQueries = 64;  // queries per tile: SageBwd's block_q (the P s_dO / dS s_Q quantization groups)

// shared-memory images, 1024-byte aligned: INT8 ones K-major with rows of D bytes (K^, Q^) or 64 bytes (the
// transposed Q^T, dO^T: D rows of 64 query slots; K^T: D rows of 64 key positions; dS: 64 query rows of 64 key
// positions); 16-bit ones (V, dO) as D / 64 chunks of 64 rows x 128 bytes
template <int D>
struct BwdSmem {
    static constexpr int I8 = 64 * D, H16 = 128 * D;
    // per consumer warpgroup w at KV_OFF + w KV_STRIDE: its K^, V and K^T images, its quantized dS s_K (dQ's A
    // operand; two, by tile parity), the column maxima of its 4 warps (64 floats each) and the per-query scales of
    // its dS (64 floats per parity)
    static constexpr int V_IN_KV = I8, KT_IN_KV = V_IN_KV + H16, DS_IN_KV = KT_IN_KV + I8, DS_BYTES = 4096,
                         RED_IN_KV = DS_IN_KV + 2 * DS_BYTES, SC_IN_KV = RED_IN_KV + 1024, DQ_IN_KV = SC_IN_KV + 1024;
    // and its dQ staging blocks: per warp, its 16 query rows of one 32-channel chunk (fp32, 2 KB) in the dQ buffer's
    // block order (bwd_dq_tile), added to that buffer by one bulk reduction (one block per warp: with two, for both
    // chunks of D = 128, the 3 stages would not fit)
    static constexpr int DQ_WARP = 16 * 32 * 4, DQ_BYTES = 4 * DQ_WARP;
    static constexpr int KV_OFF = 0, KV_STRIDE = DQ_IN_KV + DQ_BYTES;
    static constexpr int STAGE0 = KV_OFF + kBwdNwg * KV_STRIDE;
    // per stage (query tile): Q^, Q^T, dO, dO^T images and the 64 x 4 floats of bwd.row_stats, row c
    // holding query bwd_query_of(c)'s (the images' row order: column c of S^T and dP^T reads row c, so a lane's 16
    // columns are one base address plus constants and its LDS.64 hit 4 distinct banks; in query order each needed
    // an address computation and columns 2 t4 of lanes t4 and t4 + 2 shared banks)
    static constexpr int Q_OFF = 0, QT_OFF = Q_OFF + I8, DO_OFF = QT_OFF + I8, DOT_OFF = DO_OFF + H16,
                         ST_OFF = DOT_OFF + I8;
    static constexpr int STAGE = ST_OFF + 1024;  // a multiple of 1024: every stage's images stay aligned
    // the stage ring's mbarriers: full[kBwdStages], then empty[kBwdStages]
    static constexpr int BAR_OFF = STAGE0 + kBwdStages * STAGE;
    static constexpr int TOTAL = BAR_OFF + 16 * kBwdStages + 1024;  // + slack to align the base to 1024 bytes
    static_assert(TOTAL <= 232448, "more than the 227 KB of shared memory per block");
    static_assert(DQ_BYTES % 1024 == 0, "bulk reductions: 16-byte aligned blocks");
};
// query of row / column c of a tile in the permuted order (slot_of_key within each 32)
__host__ __device__ constexpr int bwd_query_of(int c) { return (c & ~31) | slot_of_key(c & 31); }

// position of key k (of a warpgroup's 64) along K in the dS and K^T images: the keys g and g + 8 of each warp's 16,
// which a lane holds in one accumulator column, side by side (one 2-byte store per query)
__host__ __device__ constexpr int bwd_kpos(int k) { return (k & 48) | ((k & 7) << 1) | ((k >> 3) & 1); }

// byte offset of the 16-byte chunk c8 (8 16-bit channels 8 c8..) of row r in a 16-bit image
__device__ __forceinline__ int bwd_h16_off(int r, int c8) { return (c8 >> 3) * 8192 + img_off(r, 16 * (c8 & 7), 128); }

// The fp32 dQ buffer (dq_acc) in blocks: per (batch, query head) row bh and 64-query tile qt (ceil(Sq / 64) of
// them, the last padded), per 32-channel chunk c and warp w (queries 16 w..16 w + 15 of the tile), one 2 KB block
// of 512 floats in accumulator-fragment order: element (k, hh, lane, e) at ((2 k + hh) 32 + lane) 2 + e holds query
// 16 w + 8 hh + lane / 4, channel 32 c + 8 k + 2 (lane % 4) + e, so that each float2 store of a warp's fragment is
// 256 contiguous bytes (no bank conflict) and a warp's block is one bulk reduction. sagebwd._backward undoes the
// order (one strided pass, with the scale and the cast). The tile's first float, then a block's within the tile:
template <int D>
__device__ __forceinline__ int64_t bwd_dq_tile(int64_t bh, int ntq, int qt) { return (bh * ntq + qt) * 64 * D; }
__device__ __forceinline__ int bwd_dq_block(int c, int w) { return c * 2048 + w * 512; }

}  // namespace sage::hopper

// sage_patch Hopper (sm_90a) "8b" attention: INT8 wgmma for Q K^T, FP8 wgmma for P~ V, warp-specialized.
// This file: the kernel's traits (warpgroups, stages, block sizes), its operand image layouts and shared memory.
//
// Structure (one CTA per SM, persistent over (batch, head, q-block) tiles, q-blocks of a head together (tile),
// taken from a global counter after the first (tile_scheduler.cuh)):
//   warpgroup 0  producer: one thread streams pre-quantized K and V^T blocks with cp.async.bulk into an NSTAGE ring
//                of shared-memory stages (mbarriers: full = bytes landed, empty = both consumers done with it);
//   warpgroups 1..NWG  consumers (nwg: 2 at D = 256, 3 at D = 128, 4 at D = 64), 64 query rows each (CTA tile 64 NWG rows),
//                each runs its blocks serially while the others keep the tensor cores busy; quantize their Q rows in the prologue
//                (per-thread groups Grouping(16, 8, 1), written straight into the wgmma operand layout), then per
//                128-key block: S = wgmma s8 (Q from smem, K from smem), online softmax in fp32, P~ = e4m3(448 p)
//                in registers, block = wgmma e4m3 (P~ from registers, V^T from smem) in its own accumulator,
//                O = O * alpha + block (two-level accumulation), then the stage is released.
// Pre-pass (hopper_quant_kv_kernel, after hopper_sample_stats_kernel: means and V's base scale from 128 sampled
// tokens): K - mean(K) -> INT8 with Grouping(128, 8, 2) scales and V - mean -> FP8 with the per-channel base scale
// times a power of two per block, both written in the exact shared-memory image of one 128-key block (the swizzled
// K-major layout of wgmma, img_off), so the producer copies each block with one bulk copy, no tensor maps.
//
// Launches (launch): sample statistics, then the K/V pre-pass and the attention kernel with programmatic
// dependent launch (each waits in pdl_wait() before touching global memory; their launch and set-up overlap the
// previous kernel's end).
//
#pragma once
#include "../common/params.cuh"

namespace sage::hopper {

constexpr int kBN = 128;        // keys per block (one wgmma N for S; four k32 steps for P~V)
// consumer warpgroups per CTA (64 query rows each; CTA tile 64 NWG rows, 128 (NWG + 1) threads) per head dim.
// NWG >= 3 runs each warpgroup's blocks serially (S, softmax, P~V, merge: S and the P~V block never live together,
// so 160 registers (3 consumers) or 112 (4, D = 64) hold it; at D = 128 P~V in two column halves) and relies on the
// other warpgroups to keep the tensor cores busy; NWG = 2 overlaps S(kb) with P~V(kb-1) inside the warpgroup (~230
// registers). H200, same-run A/B when the counts were chosen: D = 128 3 vs 2: +4% at 1K, +7% at 2K, +5% at 16K;
// D = 64 4 vs 2: +13-14% (3: +7-11%); bitwise identical outputs. D = 256: 2 (240 registers: O alone is 128 fp32 per
// thread), serial blocks too, P~V in four 64-column quarters, O's last 24-32 values in shared memory (o_stash).
__host__ __device__ constexpr int nwg(int D) { return D == 64 ? 4 : D == 128 ? 3 : 2; }
__host__ __device__ constexpr int bm(int nwg) { return 64 * nwg; }          // query rows per CTA tile
__host__ __device__ constexpr int threads(int nwg) { return 128 * (nwg + 1); }  // + the producer warpgroup
constexpr int kStages = 3;  // K/V shared-memory ring stages (stages: 2 at D = 256, whose 3 would pass 227 KB)
__host__ __device__ constexpr int stages(int D) { return D > 128 ? 2 : kStages; }
// the producer hands tile indices to the consumers through a small mbarrier ring in shared memory (it runs up to
// kStages blocks ahead, so possibly several tiles)
constexpr int kTileRing = 4;

// P~V accumulator columns: D, plus 8 columns (V^T rows of e4m3 ones) that hold the row sums of P~: the tensor cores
// sum exactly the quantized P~ the output is made of (one FADD per score less; the output normalised by the sum of
// its own weights is more accurate, docs/benchmarks.md), all 8 columns equal.
__host__ __device__ constexpr int pv_n(int D) { return D + 8; }

// Shared-memory images of the wgmma operands (Q, K blocks, V^T blocks), K-major, rows of kbytes (64 or 128) bytes,
// stored one after the other, the 16-byte chunks of row r XOR-permuted by r's place in its 8-row atom (wgmma's
// 128B / 64B swizzle modes, atoms of 8 * kbytes bytes). Rows of 256 bytes (D = 256) are two 128B-swizzle atoms
// along K: 8 rows x 128 bytes each, the two of an 8-row group side by side ([row group][k chunk], 1024 bytes each),
// so the descriptor's stride is 2048 bytes and a K step past byte 128 starts in the next atom (desc_kstep).
// (Not recursive: a recursive constexpr function is not inlined, and the call serializes the kernel's wgmma.)
__host__ __device__ constexpr int img_off(int r, int c, int kbytes) {
    return kbytes > 128
               ? ((r >> 3) * (kbytes / 128) + (c >> 7)) * 1024 + (r & 7) * 128 + ((((c >> 4) & 7) ^ (r & 7)) << 4) +
                     (c & 15)
               : r * kbytes + ((((c >> 4) ^ (kbytes == 128 ? (r & 7) : ((r >> 1) & 3)))) << 4) + (c & 15);
}
// V^T slot of key k within its 32-key group: slot s holds key 16(s/16) + 8((s%4)/2) + 2((s%16)/4) + s%2, the order in
// which the S accumulator fragment of a lane is directly the A fragment of P~ (same rule as quant_v_kernel)
__host__ __device__ constexpr int slot_of_key(int k) {
    return (k & 16) | (k & 1) | (((k >> 3) & 1) << 1) | (((k >> 1) & 3) << 2);
}

// V channel order in the P~V accumulator: column j (in the wgmma layout lane t4 holds columns 8i + 2 t4, +1) carries
// channel vcol(j), bit fields [1:2] and [3:4] swapped, so that lane t4's 32 values of a row are the channels
// 8 (4c + t4) .. + 7 for c = 0..D/32-1: 16 contiguous bytes of output per c, stored with one 16-byte store (the
// natural order needs four 4-byte stores, each touching 8 rows' lines: the epilogue was bound by them). An
// involution: V^T row vcol(d) holds channel d.
__host__ __device__ constexpr int vcol(int j) { return (j & ~0x1E) | ((j >> 2) & 6) | ((j << 2) & 0x18); }

// O values per consumer thread kept in shared memory during the block loop (the last o_stash / 4 n8 column chunks,
// folded there by the last P~V quarter): at D = 256 the softmax phase holds O (128 fp32) and S (64) within the 240
// registers setmaxnreg gives, and ptxas spilled 16 of O to local memory otherwise, with copies between spill slots
// at every block (~220 STL/LDL in the kernel); the stash costs o_stash / 4 LDS.128 + STS.128 per block and thread.
// Numerics unchanged (the same FFMA per value). The counts are ptxas's fewest spills (sm_90a, nvcc 13.0): without
// the LSE 24 (2 STL/LDL left; 16: 40, 32: 239), with it 32 (11-15; 24: 39-52). 0 below D = 256.
__host__ __device__ constexpr int o_stash(int D, bool lse) { return D == 256 ? (lse ? 32 : 24) : 0; }

template <int D, int NWG>
struct Smem {
    static constexpr int NST = stages(D);       // K/V ring stages
    static constexpr int QBYTES = 64 * D;          // per consumer warpgroup
    static constexpr int KBYTES = kBN * D;      // one K block image
    static constexpr int VBYTES = kBN * D;      // one V^T block image (what the producer copies)
    static constexpr int ONES = (pv_n(D) - D) * kBN;  // + 8 rows of e4m3 ones below it (row sums), set once
    static constexpr int VSTRIDE = VBYTES + ONES;
    static constexpr int Q_OFF = 0;
    static constexpr int K_OFF = NWG * QBYTES;
    static constexpr int V_OFF = K_OFF + NST * KBYTES;
    static constexpr int EPI_OFF = V_OFF + NST * VSTRIDE;  // V scale, V mean, K mean per consumer x tile parity
    static constexpr int EPI_FLOATS = 3 * D;
    static constexpr int STASH_OFF = EPI_OFF + NWG * 2 * EPI_FLOATS * 4;  // O's stashed values (o_stash, the larger)
    static constexpr int BAR_OFF = STASH_OFF + NWG * 128 * o_stash(D, true) * 4;
    static constexpr int TBAR_OFF = BAR_OFF + 2 * NST * 8;  // tile ring: full / empty mbarriers
    static constexpr int TILE_OFF = TBAR_OFF + 2 * kTileRing * 8;  // tile ring: tile indices
    static constexpr int FLAG_OFF = TILE_OFF + kTileRing * 4;  // per consumer: its split counter's old value
    static constexpr int TOTAL = FLAG_OFF + NWG * 4 + 1024;  // + slack to align the images to 1024 bytes
    static_assert(TOTAL < (1 << 18), "descriptor low words (desc_step) assume shared addresses < 2^18");
    static_assert(TOTAL <= 232448, "more than the 227 KB of shared memory per block");
};

}  // namespace sage::hopper

// Hopper path: the persistent tile scheduler. Work items (whole tiles, then the parts of split tail tiles), their
// order over (batch, head, q-block), and the host-side split-tail plan that sizes them.
#pragma once
#include "traits.cuh"

namespace sage::hopper {

inline int num_sms(int dev) {
    static int cache[64] = {};
    if (dev >= 0 && dev < 64 && cache[dev] > 0) return cache[dev];
    int n = 0;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0) n = 132;
    if (dev >= 0 && dev < 64) cache[dev] = n;
    return n;
}

// Split tail. The persistent grid (one CTA per SM) runs equal non-causal tiles in waves; the ntiles mod nsm tiles of
// the last wave leave the other SMs idle for a whole tile (Flux, B=1 H=24 N=4608: 576 tiles on 132 SMs, the 5th wave
// 36% full). Those tiles are split along the keys into `parts` items of consecutive 128-key blocks, each on its own
// CTA: an item writes its rows' normalised partial output and log2 row sum to the workspace, and the last of a
// tile's parts to finish (a counter per tile and consumer) combines them in part order (deterministic) and stores
// the output. Not for causal (heavy-first order already balances), varlen or LSE calls. Items: tiles 0 .. nfull - 1
// whole, then the parts of tiles nfull .. ntiles - 1 (a tile's parts consecutive).
constexpr int kMinPartBlocks = 4;      // a part's fixed costs (Q prologue, epilogue, combine) ~ 2 blocks
constexpr int kMaxParts = 4;           // (Ws::pkb); also the default of SageAttnParams.hop_split_max
struct Plan { int nqb, ntiles, nsplit, parts, nitems; };
inline Plan plan(const SageAttnParams& p) {
    const int nw = nwg(p.D), rows = bm(nw), nsm = num_sms(p.device);
    const int nkb = (p.Skv + kBN - 1) / kBN;
    Plan P;
    P.nqb = (p.Sq + rows - 1) / rows;
    P.ntiles = P.nqb * p.B * p.Hq;
    P.nsplit = 0;
    P.parts = 1;
    const int rem = P.ntiles % nsm;
    const int split_max = p.hop_split_max > 0 ? p.hop_split_max : kMaxParts;  // most parts per tile (1: no split)
    if (!p.causal && p.window_keys == 0 && !p.cu_seqlens_q && !p.lse && rem > 0) {
        int parts = nsm / rem < split_max ? nsm / rem : split_max;
        parts = parts < kMaxParts ? parts : kMaxParts;
        parts = nkb / kMinPartBlocks < parts ? nkb / kMinPartBlocks : parts;
        if (parts >= 2) { P.nsplit = rem; P.parts = parts; }
    }
    P.nitems = P.ntiles + P.nsplit * (P.parts - 1);
    return P;
}
// Persistent tile order: (batch, head) outer, q-blocks inner from the last (longest causal rows) to the first: the
// CTAs running at the same time work on the same few heads, so each K/V block comes from HBM once and then from L2
// (with (batch, head) inner, 132 CTAs stream 132 different heads' K/V: at B=4 H=32 N>=4K that working set is larger
// than L2 and the kernel re-reads K/V from HBM per q-block). Heads sharing K/V (GQA) are adjacent.
// Dynamic: after its first tile (blockIdx.x) a CTA takes the next unclaimed tile from a global counter (the producer
// thread, one atomic per tile, ahead of the consumers), so CTAs that drew short causal tiles take more of them.
struct Tile { int b, h, qb; };
__device__ __forceinline__ Tile tile(int t, int /*B*/, int Hq, int nqb) {
    const int bh = t / nqb;
    return Tile{bh / Hq, bh % Hq, nqb - 1 - t % nqb};
}
__device__ __forceinline__ int num_kv_blocks(const SageAttnParams& p, int q0, int bm, int sq, int skv) {
    int kv_end = skv;
    if (p.causal) kv_end = min(kv_end, q0 + bm + (skv - sq));
    return kv_end > 0 ? (kv_end + kBN - 1) / kBN : 0;
}
struct Ws {
    const int8_t* kimg; const float* kscale; const uint8_t* vimg; const float* vscale; const float* vfac;
    const float* kmean; const float* vmean; const int* kmflag; int* tilectr; int nkb; int nqb;
    float4* part; int* splitctr;  // split tail (plan): partials, arrival counters
    int nitems, nfull, parts;     // work items; items < nfull are whole tiles
    uint32_t pmul;                // ceil(2^32 / parts): u / parts as one multiply-high (no division per tile)
    int pkb[kMaxParts + 1];    // part j of a split tile: blocks pkb[j] .. pkb[j + 1] - 1 (their nkb is w.nkb)
};
// work item -> tile, and for a part of a split tile its index among the split tiles (else -1) and part number
struct Item { int tile, split, part; };
__device__ __forceinline__ Item item(int t, const Ws& w) {
    if (t < w.nfull) return Item{t, -1, 0};
    const int u = t - w.nfull, sp = (int)__umulhi((uint32_t)u, w.pmul);
    return Item{w.nfull + sp, sp, u - sp * w.parts};
}
// sliding window: the first key block row r0 (and every later row) sees any key of; blocks before it lie wholly
// outside the window of rows >= r0 and are neither loaded nor computed (work proportional to the window)
__device__ __forceinline__ int first_kv_block(const SageAttnParams& p, int r0, int sq, int skv) {
    if (p.window_keys <= 0) return 0;
    const int lo = r0 + (skv - sq) - p.window_keys + 1;  // row r0's first visible key
    return lo > 0 ? lo / kBN : 0;
}
// blocks [kb0, kb1) of an item whose tile has nkb blocks and starts at row q0 (split tiles have no window)
__device__ __forceinline__ int part_kb0(const Item& it, const Ws& w, const SageAttnParams& p, int q0,
                                            int sq, int skv) {
    return it.split < 0 ? first_kv_block(p, q0, sq, skv) : w.pkb[it.part];
}
__device__ __forceinline__ int part_kb1(const Item& it, int nkb, const Ws& w) {
    return it.split < 0 ? nkb : w.pkb[it.part + 1];
}

}  // namespace sage::hopper

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

// Persistent tile order: sections of (batch, head) pairs outer, within a section q-blocks from the last (longest
// causal rows) to the first, the section's heads inner. Dynamic: after its first tile (blockIdx.x) a CTA takes the
// next unclaimed tile from a global counter (the producer thread, one atomic per tile, ahead of the consumers).
// - Non-causal: sections of one head (heads outer, q-blocks inner): the CTAs running at the same time work on the
//   same few heads, so each K/V block comes from HBM once and then from L2 (with (batch, head) inner, 132 CTAs
//   stream 132 different heads' K/V: at B=4 H=32 N>=4K that working set is larger than L2 and the kernel re-reads
//   K/V from HBM per q-block).
// - Causal: sections of as many heads as their K/V images fit in kL2SectionBytes (FlashAttention-3's L2 swizzle),
//   longest tiles first across the section's heads, so the last tiles taken are the shortest (with sections of one
//   head the last head's longest tiles were taken last: B=4 H=16 D=256 2K, 1024 tiles of 1..16 blocks, the last
//   wave left SMs idle for ~12% of the kernel in a simulation of the dynamic order, ~6% at 4K).
// Heads sharing K/V (GQA) are adjacent and in one section.
constexpr int64_t kL2SectionBytes = 32ll << 20;  // of the H100/H200's 50 MB L2 (FlashAttention-3's figure)

// Split tail. The persistent grid (one CTA per SM) runs equal non-causal tiles in waves; the ntiles mod nsm tiles of
// the last wave leave the other SMs idle for a whole tile (Flux, B=1 H=24 N=4608: 576 tiles on 132 SMs, the 5th wave
// 36% full). Those tiles are split along the keys into `parts` items of consecutive 128-key blocks, each on its own
// CTA: an item writes its rows' normalised partial output and log2 row sum to the workspace, and the last of a
// tile's parts to finish (a counter per tile and consumer) combines them in part order (deterministic) and stores
// the output. Not for causal (heavy-first order already balances), varlen or LSE calls. Items: tiles 0 .. nfull - 1
// whole, then the parts of tiles nfull .. ntiles - 1 (a tile's parts consecutive).
constexpr int kMinPartBlocks = 4;      // a part's fixed costs (Q prologue, epilogue, combine) ~ 2 blocks
constexpr int kMaxParts = 4;           // (Ws::pkb); also the default of SageAttnParams.hop_split_max
struct Plan { int nqb, ntiles, nsplit, parts, nitems, secq, secb, hbig; };
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
    // tile order (tile): sections of one q-head (heads outer), causal sections of as many kv-heads as fit in
    // kL2SectionBytes, split into equal sections (sizes differ by one kv-head: a small last section would leave its
    // long tiles to the end again)
    const int group = p.Hq / p.Hkv, units = p.B * p.Hkv;
    int base = 1, extra = 0, unit_q = 1;
    if (p.causal) {
        const int64_t unit_bytes = (int64_t)nkb * kBN * p.D * 2;  // one kv-head's K and V^T block images
        const int64_t fit = kL2SectionBytes / (unit_bytes > 0 ? unit_bytes : 1);
        const int gu = fit < 1 ? 1 : fit > units ? units : (int)fit;
        const int nsec = (units + gu - 1) / gu;
        base = units / nsec;
        extra = units % nsec;
        unit_q = group;
    }
    P.secq = base * unit_q;
    P.secb = (base + 1) * unit_q;
    P.hbig = extra * P.secb;
    return P;
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
    int secq, secb, hbig, tbig;   // tile order (Plan): q-heads per section (secb: the first sections', hbig heads
                                  // and tbig tiles in all)
    uint32_t pmul;                // ceil(2^32 / parts): u / parts as one multiply-high (no division per tile)
    int pkb[kMaxParts + 1];    // part j of a split tile: blocks pkb[j] .. pkb[j + 1] - 1 (their nkb is w.nkb)
};
// tile index -> (batch, head, q-block) in the order above: sections of secb heads (tiles t < tbig), then of secq
struct Tile { int b, h, qb; };
__device__ __forceinline__ Tile tile(int t, const Ws& w, int Hq) {
    int g = w.secb, h0 = 0;
    if (t >= w.tbig) {
        g = w.secq;
        t -= w.tbig;
        h0 = w.hbig;
    }
    const int s = t / (g * w.nqb);
    t -= s * g * w.nqb;
    const int q = t / g, bh = h0 + s * g + (t - q * g);
    return Tile{bh / Hq, bh % Hq, w.nqb - 1 - q};
}
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

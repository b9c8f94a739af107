// Hopper (sm_90a) SageBwd training backward, dQ, dK and dV: INT8 and 16-bit wgmma on the transposed problem.
//
// One CTA per 64 kBwdNwg keys of one (batch, KV head), one warpgroup per 64 keys; it walks the query heads of the GQA
// group and their 64-query tiles (the numerics' block_q) that see its keys (causal: from the first visible tile),
// so dK and dV are summed over the group in registers. Per query tile, with the keys as the wgmma M dimension:
//   S^T  = K^ Q^^T                INT8 m64n64k32, both operands K-major shared-memory images (img_off)
//   dP^T = V dO^T                 16-bit m64n64k16 (fp32 accumulation), V and dO images in 64-channel chunks
//   P^T  = exp2(S^T s_K tau log2e s_Q - LSE)   (masked pairs 0)
//   dV  += q8(P^T s_dO) dO^       INT8, A from registers: quantized per key row over the tile's 64 queries (a row
//   dS^T = P^T o (dP^T - Delta)                 lives in the 4 lanes of a quad), B = the transposed dO^ image
//   dK  += q8(dS^T s_Q) Q^        likewise with the transposed Q^ image; dK is scaled by tau at the end
//   dQ  += q8(dS s_K) K^          INT8, dS s_K quantized per query over the warpgroup's 64 keys (the numerics'
//                                 block_k: column maxima across the 4 warps through shared memory) into a dS image
//                                 (queries x keys), B = a K^T image made once per CTA; each warpgroup computes half
//                                 the channels over both warpgroups' key blocks (their int32 products scaled and
//                                 summed in registers), stored per warp into a shared-memory block and added by one
//                                 bulk reduction (cp.reduce.async.bulk .add.f32) into an fp32 buffer in blocks
//                                 (bwd_dq_tile) that the caller scales by tau, casts and reorders (5 products per
//                                 tile, as FA3's backward)
// Query order: row c of the Q^ and dO images (the N dimension of S^T and dP^T) holds query slot_of_key(c) of
// its 32-query group, so the accumulator fragment of a lane is directly its A fragment for the transposed INT8
// images in natural query order (the forward's V^T trick, applied to the other operand): every tile is copied
// with 16-byte cp.async into its swizzled place, no byte shuffles. The numerics are those of
// sage_patch/kernels/sagebwd/bwd.py's dkdv_kernel and dq_kernel (SageBwdConfig(**KERNEL_LAYOUT)): the same products,
// scale foldings, per-row quantization (127 / amax, round half to even, NaN amax -> NaN scale); the accumulation
// order too, except dQ's sum over key blocks (floating-point reductions: no fixed order).
//
// Warp-specialized (the forward's shape): warpgroup 0 is the producer, which streams each query tile's operands (Q^,
// dO, Q^T, dO^T, stats) with cp.async into a ring of kBwdStages stages guarded by mbarriers (full: the producer,
// one tile behind, after its copies landed and a proxy fence; empty: one arrival per consumer thread after its last
// read of the stage), and gives its registers to the two consumer warpgroups (setmaxnreg 24 / 240). The consumers
// never meet at a CTA-wide barrier, nor wait for each other at one point of the tile: their dS images are double-
// buffered by tile parity, a warpgroup announces its dS of tile t (bar.arrive) and computes tile t's dQ only at the
// start of tile t + 1 (bar.sync on the other's), and may overwrite its image of tile t at tile t + 2 once the
// other's dQ of tile t announced it free: either may run up to about a tile ahead, so that one's math overlaps the
// other's products. Within a warpgroup, the previous tile's dQ products run with this tile's S^T (D = 128) or S^T
// and dP^T (D = 64, FA3's order) in flight, and at D = 64 the dV product with dS s_K's quantization (kBwdOverlap:
// D = 128's dK and dV accumulators leave no room for more). dQ over both key blocks at once: one reduction per
// (query, channel) and 128 keys, not per 64 (per-warpgroup dQ, no barrier but twice the reductions, measured 1.18x
// slower at D=128 before the producer split). Before the split (all threads loading, two CTA barriers per tile),
// H200, B=4 H=32 bf16 N=16K, backward alone: D=128 0.93x (full) / 0.94x (causal) of the Triton backward, D=64
// 0.87x / 0.86x, issue- and latency-bound (ncu: 46% of issue slots used with 2 warps per scheduler, ~2500
// instructions per warp and 64 x 64 tile, tensor pipes ~15% busy). With the split and the bulk dQ reductions (same
// run, ms): D=128 141.2 (Triton 151.4, the vector reductions 157.0), causal 72.9 (78.6, 80.9); D=64 105.1 (100.1,
// 110.8), causal 53.8 (50.9, 56.7). Bulk reductions per row (64 per warpgroup and tile, each lane its own
// address) were slower than the vector reductions: ptxas serializes per-lane bulk operations (uniform operands).
#pragma once
#include "wgmma.cuh"
#include "../common/ptx.cuh"
#include "../common/quant.cuh"

namespace sage::hopper {

constexpr int kBwdKeys = 64;     // keys per warpgroup (wgmma M)
constexpr int kBwdNwg = 2;       // consumer warpgroups per CTA: they share each query tile's loads (half the traffic per key)
constexpr int kBwdLoaders = 128; // the producer warpgroup's threads (cp.async copies of the query tiles)
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
    // per stage (query tile): Q^, Q^T, dO, dO^T images and the 64 x 4 floats of bwd.row_stats
    static constexpr int Q_OFF = 0, QT_OFF = Q_OFF + I8, DO_OFF = QT_OFF + I8, DOT_OFF = DO_OFF + H16,
                         ST_OFF = DOT_OFF + I8;
    static constexpr int STAGE = ST_OFF + 1024;  // a multiple of 1024: every stage's images stay aligned
    // the stage ring's mbarriers: full[kBwdStages], then empty[kBwdStages]
    static constexpr int BAR_OFF = STAGE0 + kBwdStages * STAGE;
    static constexpr int TOTAL = BAR_OFF + 16 * kBwdStages + 1024;  // + slack to align the base to 1024 bytes
    static_assert(TOTAL <= 232448, "more than the 227 KB of shared memory per block");
    static_assert(DQ_BYTES % 1024 == 0, "bulk reductions: 16-byte aligned blocks");
};
// 16 bytes global -> shared, zero-filled where !ok (src is then not read)
__device__ __forceinline__ void bwd_cp16(uint8_t* dst, const void* src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(ok ? 16 : 0));
}
// query of row / column c of a tile in the permuted order (slot_of_key within each 32)
__host__ __device__ constexpr int bwd_query_of(int c) { return (c & ~31) | slot_of_key(c & 31); }

// position of key k (of a warpgroup's 64) along K in the dS and K^T images: the keys g and g + 8 of each warp's 16,
// which a lane holds in one accumulator column, side by side (one 2-byte store per query)
__host__ __device__ constexpr int bwd_kpos(int k) { return (k & 48) | ((k & 7) << 1) | ((k >> 3) & 1); }

// byte offset of the 16-byte chunk c8 (8 16-bit channels 8 c8..) of row r in a 16-bit image
__device__ __forceinline__ int bwd_h16_off(int r, int c8) { return (c8 >> 3) * 8192 + img_off(r, 16 * (c8 & 7), 128); }

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
__device__ __forceinline__ void sts_v2(uint32_t a, float x, float y) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(a), "f"(x), "f"(y) : "memory");
}
// The fp32 dQ buffer (dq_acc) in blocks: per (batch, query head) row bh and 64-query tile qt (ceil(Sq / 64) of
// them, the last padded), per 32-channel chunk c and warp w (queries 16 w..16 w + 15 of the tile), one 2 KB block
// of 512 floats in accumulator-fragment order: element (k, hh, lane, e) at ((2 k + hh) 32 + lane) 2 + e holds query
// 16 w + 8 hh + lane / 4, channel 32 c + 8 k + 2 (lane % 4) + e, so that each float2 store of a warp's fragment is
// 256 contiguous bytes (no bank conflict) and a warp's block is one bulk reduction. sagebwd._backward undoes the
// order (one strided pass, with the scale and the cast). The tile's first float, then a block's within the tile:
template <int D>
__device__ __forceinline__ int64_t bwd_dq_tile(int64_t bh, int ntq, int qt) { return (bh * ntq + qt) * 64 * D; }
__device__ __forceinline__ int bwd_dq_block(int c, int w) { return c * 2048 + w * 512; }

// x rounded half to even as the low byte of the result (x * inv, |x * inv| <= 127): quant.to_int8's rounding add,
// the product rounded first as Triton and the reference compute it
__device__ __forceinline__ uint32_t bwd_i8_bits(float x, float inv) { return __float_as_uint(__fmul_rn(x, inv) + 12582912.f); }

// One 64 x 64 fp32 tile x (accumulator layout: x[4 i + 2 hh + e] = row g + 8 hh, column 8 i + 2 t4 + e) quantized
// per row to INT8 A fragments of two k32 steps (columns in slot_of_key order within each 32), and the rows'
// scales amax / 127 (NaN where the row holds a NaN: it must reach the product, quant.row_amax)
__device__ __forceinline__ void bwd_quantize_rows(const float (&x)[32], uint32_t (&a)[2][4], float& sc0, float& sc1) {
    float m0 = 0.f, m1 = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        m0 = fmax_nan(m0, fmax_nan(fabsf(x[4 * i]), fabsf(x[4 * i + 1])));
        m1 = fmax_nan(m1, fmax_nan(fabsf(x[4 * i + 2]), fabsf(x[4 * i + 3])));
    }
#pragma unroll
    for (int o = 1; o <= 2; o <<= 1) {
        m0 = fmax_nan(m0, __shfl_xor_sync(0xffffffffu, m0, o));
        m1 = fmax_nan(m1, __shfl_xor_sync(0xffffffffu, m1, o));
    }
    const float inv0 = m0 > 0.f ? 127.f / m0 : 0.f, inv1 = m1 > 0.f ? 127.f / m1 : 0.f;
    sc0 = m0 / 127.f;
    sc1 = m1 / 127.f;
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
        const float* q = x + 16 * kk;
        a[kk][0] = pack_low_bytes(bwd_i8_bits(q[0], inv0), bwd_i8_bits(q[1], inv0), bwd_i8_bits(q[4], inv0),
                                  bwd_i8_bits(q[5], inv0));
        a[kk][1] = pack_low_bytes(bwd_i8_bits(q[2], inv1), bwd_i8_bits(q[3], inv1), bwd_i8_bits(q[6], inv1),
                                  bwd_i8_bits(q[7], inv1));
        a[kk][2] = pack_low_bytes(bwd_i8_bits(q[8], inv0), bwd_i8_bits(q[9], inv0), bwd_i8_bits(q[12], inv0),
                                  bwd_i8_bits(q[13], inv0));
        a[kk][3] = pack_low_bytes(bwd_i8_bits(q[10], inv1), bwd_i8_bits(q[11], inv1), bwd_i8_bits(q[14], inv1),
                                  bwd_i8_bits(q[15], inv1));
    }
}

// t (64 x 64 int32, accumulator layout) = A8 B^T for the 64 channels of the transposed image at bt (64 rows of 64
// query slots) that start at channel 64 nh: one commit group, in flight on return
__device__ __forceinline__ void bwd_int8_issue(int (&t)[32], const uint32_t (&a)[2][4], uint32_t bt, int nh) {
    const uint32_t lo = desc_lo(bt + nh * 4096);
    wg_fence();
    wgmma_s8_n64_rs<false>(t, a[0], desc_make(lo, desc_hi(64)));
    wgmma_s8_n64_rs<true>(t, a[1], desc_make(lo + desc_step(32), desc_hi(64)));
    wg_commit();
}
// acc (32 fp32 of one 64-channel block) += t * row scale, t complete
__device__ __forceinline__ void bwd_int8_fold(float* acc, const int (&t)[32], float sc0, float sc1) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        acc[4 * i] += (float)t[4 * i] * sc0;
        acc[4 * i + 1] += (float)t[4 * i + 1] * sc0;
        acc[4 * i + 2] += (float)t[4 * i + 2] * sc1;
        acc[4 * i + 3] += (float)t[4 * i + 3] * sc1;
    }
}
// acc (D/2 fp32, this lane's rows g, g + 8 and columns 64 nh + 8 i + 2 t4 + e) += (A8 B^T) * row scale, B = the
// transposed image at bt (D rows of 64 query slots), one n64 product per 64 channels, each waited for
template <int D>
__device__ __forceinline__ void bwd_int8_update(float (&acc)[D / 2], const uint32_t (&a)[2][4], uint32_t bt, float sc0,
                                                float sc1) {
#pragma unroll
    for (int nh = 0; nh < D / 64; ++nh) {
        int t[32];
        bwd_int8_issue(t, a, bt, nh);
        wg_wait<0>();
        reg_fence(t);
        bwd_int8_fold(acc + 32 * nh, t, sc0, sc1);
    }
}

// one butterfly step of bwd_quantize_cols: cm[k] (k < N) <- the max of this lane's and its partner's column k or
// k + N (lane bit 2 + log2(N / 2), a bit of g, picks which half it keeps)
template <int N>
__device__ __forceinline__ void bwd_halve(float (&cm)[16], int lane) {
    constexpr int bit = N == 8 ? 4 : N == 4 ? 3 : 2;
    const int up = (lane >> bit) & 1;
#pragma unroll
    for (int k = 0; k < N; ++k) {
        const float lo = cm[k], hi = cm[k + N];  // (values, not addresses: no local-memory copy of cm)
        float keep, send;
        asm("{\n .reg .pred u;\n setp.ne.b32 u, %4, 0;\n selp.f32 %0, %2, %3, u;\n selp.f32 %1, %3, %2, u;\n}\n"
            : "=f"(keep), "=f"(send) : "f"(hi), "f"(lo), "r"(up));
        cm[k] = fmax_nan(keep, __shfl_xor_sync(0xffffffffu, send, 1 << bit));
    }
}

// One 64 x 64 fp32 tile x (accumulator layout, rows = the warpgroup's keys, columns = query slots) quantized per
// column (per query over the 64 keys: dQ's dS s_K groups) into the dS image at ds (rows = queries in natural
// order, K = keys at bwd_kpos), and the columns' scales amax / 127 into sc[query] (NaN where the column holds a
// NaN). The column maxima: a butterfly over the 8 lanes of a column within the warp (each exchange halves the
// columns a lane carries: lane g ends with columns 8 g + 2 t4, +1), then the 4 warps' through red (shared memory),
// each lane's two quotients 127 / amax handed to the 7 other lanes that quantize those columns.
__device__ __forceinline__ void bwd_quantize_cols(const float (&x)[32], uint8_t* ds, float* red, float* sc, int wg_bar,
                                                  int warp, int lane) {
    const int g = lane >> 2, t4 = lane & 3;
    float cm[16];  // cm[2 i + e]: column 8 i + 2 t4 + e over this lane's rows g, g + 8
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int e = 0; e < 2; ++e) cm[2 * i + e] = fmax_nan(fabsf(x[4 * i + e]), fabsf(x[4 * i + 2 + e]));
    bwd_halve<8>(cm, lane);
    bwd_halve<4>(cm, lane);
    bwd_halve<2>(cm, lane);
    *reinterpret_cast<float2*>(red + 64 * warp + 8 * g + 2 * t4) = make_float2(cm[0], cm[1]);
    named_sync(wg_bar, 128);
    float inv[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        float m = red[8 * g + 2 * t4 + e];
#pragma unroll
        for (int w = 1; w < 4; ++w) m = fmax_nan(m, red[64 * w + 8 * g + 2 * t4 + e]);
        inv[e] = m > 0.f ? 127.f / m : 0.f;
        if (warp == 0) sc[bwd_query_of(8 * g + 2 * t4 + e)] = m / 127.f;
    }
    // keys 16 warp + g (low byte) and + 8 (high byte) at bytes 2 g of chunk warp of row bwd_query_of(8 i + 2 t4 + e)
    // = 4 t4 + e + (32 (i >> 2) + 16 ((i >> 1) & 1) + 2 (i & 1)), whose 64B-swizzle phase (bits 1-2) is
    // (i & 1) | 2 (t4 & 1): img_off as a per-lane base (one per parity of i) plus a constant
    const int ph = (t4 & 1) << 1;
    const int base0 = 256 * t4 + 2 * g + ((warp ^ ph) << 4), base1 = 256 * t4 + 2 * g + ((warp ^ ph ^ 1) << 4);
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const float iv = __shfl_sync(0xffffffffu, inv[e], 4 * i + t4);
            const uint32_t b0 = bwd_i8_bits(x[4 * i + e], iv) & 0xFFu, b1 = bwd_i8_bits(x[4 * i + 2 + e], iv) & 0xFFu;
            const int row_c = e + 32 * (i >> 2) + 16 * ((i >> 1) & 1) + 2 * (i & 1);
            *reinterpret_cast<uint16_t*>(ds + (i & 1 ? base1 : base0) + 64 * row_c) = (uint16_t)(b0 | (b1 << 8));
        }
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
    const int warp = ltid >> 5, lane = ltid & 31, g = lane >> 2;
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

// one query tile's operands into stage memory st (cp.async by the producer's kBwdLoaders threads, one commit
// group): rows m0.. of query head bh
template <int D, typename T>
__device__ __forceinline__ void bwd_issue_tile(const SageBwdParams& p, uint8_t* st, int64_t bh, const T* dop, int m0,
                                               int tid) {
    using S = BwdSmem<D>;
    // A thread's chunks are rows a multiple of 16 apart within each image, which keeps the swizzle phase and (bit 4
    // up) the query permutation, so every address after the first is a constant further (unrolled; the row and
    // column of the first are the only divisions).
    const int sq = p.Sq;
    const int8_t* qp = p.q_int + bh * sq * D;
    // a tile wholly below sq (all but a head's last): no per-row clamp or test, the rows a constant stride apart
    const bool whole = m0 + kBwdQueries <= sq;
    {  // Q^: row r = query m0 + bwd_query_of(r)
        constexpr int per_row = D / 16, step = kBwdLoaders / per_row;
        static_assert(step % 16 == 0, "bwd_query_of(r + step) = bwd_query_of(r) + step needs 16-row steps");
        const int r = tid / per_row, c = tid % per_row, qi = m0 + bwd_query_of(r);
        uint8_t* dst = st + S::Q_OFF + img_off(r, 16 * c, D);
        if (whole) {
            const int8_t* src = qp + (int64_t)qi * D + 16 * c;
#pragma unroll
            for (int k = 0; k < 64 * D / 16 / kBwdLoaders; ++k) bwd_cp16(dst + k * step * D, src + k * step * D, true);
        } else {
#pragma unroll
            for (int k = 0; k < 64 * D / 16 / kBwdLoaders; ++k)
                bwd_cp16(dst + k * step * D, qp + (int64_t)min(qi + k * step, sq - 1) * D + 16 * c, qi + k * step < sq);
        }
    }
    {  // dO (16-bit): the same row order; 8 threads per row, each its chunks c, c + 8 (16-row steps at D = 128)
        constexpr int per_row = 8, chunks = D / 8 / per_row, step = kBwdLoaders / per_row;
        static_assert(step % 16 == 0, "bwd_query_of(r + step) = bwd_query_of(r) + step needs 16-row steps");
        const int r = tid / per_row, c = tid % per_row, qi = m0 + bwd_query_of(r);
        const T* src = dop + 8 * c;
        uint8_t* dst = st + S::DO_OFF + bwd_h16_off(r, c);
        if (whole) {
            const T* row = src + (int64_t)qi * p.do_ss;
            const int64_t rstep = (int64_t)step * p.do_ss;
#pragma unroll
            for (int k = 0; k < 64 / step; ++k)
#pragma unroll
                for (int j = 0; j < chunks; ++j) bwd_cp16(dst + j * 8192 + k * step * 128, row + k * rstep + 64 * j, true);
        } else {
#pragma unroll
            for (int k = 0; k < 64 / step; ++k)
#pragma unroll
                for (int j = 0; j < chunks; ++j)
                    bwd_cp16(dst + j * 8192 + k * step * 128,
                             src + 64 * j + (int64_t)min(qi + k * step, sq - 1) * p.do_ss, qi + k * step < sq);
        }
    }
    // Q^T and dO^T: channel rows of 64 query bytes in natural order (a row is padded to 16 bytes: a chunk that
    // starts below sq stays inside it; its bytes past sq meet zero P / dS entries)
    {
        const int ch = tid >> 2, c0 = 16 * (tid & 3);
        const bool ok = m0 + c0 < sq;
        const int64_t src = bh * D * p.t_stride + ch * p.t_stride + (ok ? m0 + c0 : 0);
        constexpr int step = kBwdLoaders / 4;
#pragma unroll
        for (int k = 0; k < D * 4 / kBwdLoaders; ++k) {
            bwd_cp16(st + S::QT_OFF + img_off(ch, c0, 64) + k * step * 64, p.q_t + src + k * step * p.t_stride, ok);
            bwd_cp16(st + S::DOT_OFF + img_off(ch, c0, 64) + k * step * 64, p.do_t + src + k * step * p.t_stride, ok);
        }
    }
    if (tid < 64)  // stats in natural query order
        bwd_cp16(st + S::ST_OFF + 16 * tid, p.stats + 4 * (bh * sq + min(m0 + tid, sq - 1)), m0 + tid < sq);
    cp_async_commit();
}

// The CTA's query tiles: (query head gi of the group, query tile) pairs, gi outer (the Triton kernel's summation
// order); causal: from the first tile that sees the CTA's first key (a warpgroup's tiles before its own first
// visible one are wholly masked: they add exact zeros). The producer and the consumers walk the same list.
struct BwdTiles {
    int lo, ntq, ntiles, b, h0;
    __device__ __forceinline__ BwdTiles(const SageBwdParams& p, int ncta, int b_, int hkv) {
        const int group = p.Hq / p.Hkv, sq = p.Sq;
        lo = p.causal ? max(ncta - (p.Skv - sq), 0) / kBwdQueries * kBwdQueries : 0;
        ntq = lo < sq ? (sq - lo + kBwdQueries - 1) / kBwdQueries : 0;
        ntiles = group * ntq;
        b = b_;
        h0 = hkv * group;
    }
    // the tile of head gi and query tile qt: its first query (returned), (batch, query head) row index bh and dO
    // rows dop
    template <typename T>
    __device__ __forceinline__ int at(const SageBwdParams& p, int gi, int qt, int64_t& bh, const T*& dop) const {
        const int h = h0 + gi;
        bh = (int64_t)b * p.Hq + h;
        dop = static_cast<const T*>(p.dout) + b * p.do_sb + h * p.do_sh;
        return lo + qt * kBwdQueries;
    }
};
// a walk over BwdTiles and the stage ring, by increments (no division per tile): head gi, query tile qt, stage stg
// and its phase ph
struct BwdCursor {
    int gi = 0, qt = 0, stg = 0;
    uint32_t ph = 0;
    __device__ __forceinline__ void next(const BwdTiles& tl) {
        if (++qt == tl.ntq) qt = 0, ++gi;
        if (++stg == kBwdStages) stg = 0, ph ^= 1u;
    }
};

// warpgroup 0: streams the tiles into the stage ring; tile t's full barrier is signalled after tile t + 1's copies
// are issued (cp.async completes per thread: wait_group, then the proxy fence that makes the bytes visible to
// wgmma, then the arrival), so each tile's copies overlap the previous tile's wait
template <int D, typename T>
__device__ __forceinline__ void bwd_producer(const SageBwdParams& p, const BwdTiles& tl, uint8_t* sm, uint32_t full,
                                             uint32_t empty, int tid) {
    using S = BwdSmem<D>;
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
    BwdCursor cu;
    int sprev = 0;
    for (int t = 0; t < tl.ntiles; ++t, cu.next(tl)) {
        mbar_wait(empty + 8 * cu.stg, cu.ph ^ 1u);
        int64_t bh;
        const T* dop;
        const int m0 = tl.at(p, cu.gi, cu.qt, bh, dop);
        bwd_issue_tile<D, T>(p, sm + S::STAGE0 + cu.stg * S::STAGE, bh, dop, m0, tid);
        if (t > 0) {
            cp_async_wait<1>();
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            mbar_arrive(full + 8 * sprev);
        }
        sprev = cu.stg;
    }
    if (tl.ntiles > 0) {
        cp_async_wait<0>();
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        mbar_arrive(full + 8 * sprev);
    }
}

template <int D, typename T>
__global__ void __launch_bounds__(kBwdThreads, 1) hopper_bwd_kernel(const __grid_constant__ SageBwdParams p) {
    using S = BwdSmem<D>;
    extern __shared__ __align__(1024) uint8_t bsmem_raw[];
    const uint32_t spad = (1024u - (smem_u32(bsmem_raw) & 1023u)) & 1023u;
    uint8_t* sm = bsmem_raw + spad;
    // through __shfl_sync ptxas knows the shared base is warp-uniform and keeps the wgmma descriptors in uniform
    // registers (as the forward's consumer does)
    const uint32_t sb = __shfl_sync(0xffffffffu, smem_u32(sm), 0);
    const uint32_t full = sb + S::BAR_OFF, empty = full + 8 * kBwdStages;
    const int tid = threadIdx.x;
    const int ncta = blockIdx.x * kBwdKeys * kBwdNwg;  // the CTA's keys
    const int bkv = blockIdx.y, b = bkv / p.Hkv, hkv = bkv % p.Hkv;
    const BwdTiles tl(p, ncta, b, hkv);
    if (tid == 0) {
        for (int s = 0; s < kBwdStages; ++s) {
            mbar_init(full + 8 * s, kBwdLoaders);
            mbar_init(empty + 8 * s, 128 * kBwdNwg);  // one arrival per consumer thread (main loop's comment)
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (tid < kBwdLoaders) {
        bwd_producer<D, T>(p, tl, sm, full, empty, tid);
        return;
    }
    // ---------------- consumers: 240 registers (the producer's .dec released 144 of its launch 168 per thread)
    static_assert(kBwdThreads == 384, "setmaxnreg: 168 * 384 = 24 * 128 + 240 * 256 registers");
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n" ::: "memory");
    const int wg = __shfl_sync(0xffffffffu, (tid - kBwdLoaders) >> 7, 0), ltid = tid & 127;
    const int warp = ltid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    const int n0 = ncta + wg * kBwdKeys;  // the warpgroup's keys
    const int sq = p.Sq, skv = p.Skv, diag = skv - sq;
    const float tau_log2e = p.sm_scale * kLog2e;

    // K^ and V of this warpgroup's keys, once (0 past skv)
    uint8_t* skv_img = sm + S::KV_OFF + wg * S::KV_STRIDE;
    const uint32_t kimg = sb + S::KV_OFF + wg * S::KV_STRIDE, vimg = kimg + S::V_IN_KV;
    const int8_t* kp = p.k_int + ((int64_t)bkv * skv) * D;
    for (int i = ltid; i < 64 * D / 16; i += 128) {
        const int r = i / (D / 16), c = i % (D / 16);
        uint4 x = make_uint4(0, 0, 0, 0);
        if (n0 + r < skv) x = *reinterpret_cast<const uint4*>(kp + (int64_t)(n0 + r) * D + 16 * c);
        *reinterpret_cast<uint4*>(skv_img + img_off(r, 16 * c, D)) = x;
        // and K^T (dQ's B operand: channel rows, keys at bwd_kpos), byte by byte (once per CTA)
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const uint32_t w = j < 4 ? x.x : j < 8 ? x.y : j < 12 ? x.z : x.w;
            skv_img[S::KT_IN_KV + img_off(16 * c + j, bwd_kpos(r), 64)] = (uint8_t)(w >> (8 * (j & 3)));
        }
    }
    const T* vp = static_cast<const T*>(p.v) + b * p.v_sb + hkv * p.v_sh;
    for (int i = ltid; i < 64 * D / 8; i += 128) {
        const int r = i / (D / 8), c = i % (D / 8);
        uint4 x = make_uint4(0, 0, 0, 0);
        if (n0 + r < skv) x = *reinterpret_cast<const uint4*>(vp + (int64_t)(n0 + r) * p.v_ss + 8 * c);
        *reinterpret_cast<uint4*>(skv_img + S::V_IN_KV + bwd_h16_off(r, c)) = x;
    }
    // visible to this warpgroup's wgmma (the other's reads of K^T come after the first tile's dS barrier)
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    named_sync(1 + wg, 128);
    // this lane's keys (rows of the transposed tiles): g and g + 8 of its warp's 16
    const int key0 = n0 + 16 * warp + g, key1 = key0 + 8;
    const uint8_t* mrow = p.kmask ? p.kmask + (int64_t)b * p.kmask_sb : nullptr;
    const bool kok0 = key0 < skv && (!mrow || mrow[key0]), kok1 = key1 < skv && (!mrow || mrow[key1]);
    const float ksr0 = key0 < skv ? p.k_scale[(int64_t)bkv * skv + key0] : 0.f;  // dQ's dS s_K
    const float ksr1 = key1 < skv ? p.k_scale[(int64_t)bkv * skv + key1] : 0.f;
    const float ks0 = ksr0 * tau_log2e, ks1 = ksr1 * tau_log2e;

    float dk[D / 2], dv[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.f;
    // dQ of tile tq (query rows m0q.. of bhq) over both warpgroups' dS images: once the other's is written (every
    // thread of both meets at the ready barrier: this warpgroup's own image is complete too), then this one's read of
    // the other's image announced (unless nothing will wait for it)
    static_assert(kBwdNwg == 2, "dQ pairs the two consumer warpgroups");
    // (the staging block: a warp's previous tile's bulk reduction read it before its issuer (lane 0) reaches the
    // ready barrier, which the whole warp passes before writing it again)
    const uint32_t dq_stg = kimg + S::DQ_IN_KV;
    const int ntq_all = (sq + kBwdQueries - 1) / kBwdQueries;  // the dQ buffer's tiles per head
    auto dq_tile = [&](int tq, int64_t bhq, int m0q) {
        const int pq = tq & 1;
        if ((ltid & 31) == 0) bulk_wait<true>();
        named_sync(kBarDsReady + 2 * (1 - wg) + pq, 128 * kBwdNwg);
        const float* sc = reinterpret_cast<const float*>(sm + S::KV_OFF + S::SC_IN_KV) + 64 * pq;
        bwd_dq_update<D>(sb + S::KV_OFF, S::DS_IN_KV + pq * S::DS_BYTES, sc, sc + S::KV_STRIDE / 4, dq_stg,
                         p.dq_acc + bwd_dq_tile<D>(bhq, ntq_all, m0q / kBwdQueries), wg * (D / 2), ltid);
        if (tq + 2 < tl.ntiles) named_arrive(kBarDsFree + 2 * (1 - wg) + pq, 128 * kBwdNwg);
    };
    int mprev = 0;
    int64_t bhprev = 0;
    int gi = 0, qt = 0;
    for (int t = 0; t < tl.ntiles; ++t) {
        int64_t bh;
        const T* dop;
        const int m0 = tl.at(p, gi, qt, bh, dop);
        if (++qt == tl.ntq) qt = 0, ++gi;
        const int stg = t % kBwdStages, par = t & 1;
        mbar_wait(full + 8 * stg, (uint32_t)(t / kBwdStages) & 1u);  // this tile's operands landed
        const uint32_t sst = __shfl_sync(0xffffffffu, sb + S::STAGE0 + stg * S::STAGE, 0);
        const float4* st = reinterpret_cast<const float4*>(sm + S::STAGE0 + stg * S::STAGE + S::ST_OFF);
        {
            // S^T = K^ Q^^T and dP^T = V dO^T, in flight together
            int sacc[32];
            float dpt[32];
            wg_fence();
            {
                const uint32_t ka = desc_lo(kimg), qa = desc_lo(sst + S::Q_OFF);
                wgmma_s8_n64_ss<false>(sacc, desc_make(ka, desc_hi(D)), desc_make(qa, desc_hi(D)));
#pragma unroll
                for (int k = 1; k < D / 32; ++k)
                    wgmma_s8_n64_ss<true>(sacc, desc_make(ka + desc_step(32 * k), desc_hi(D)),
                                    desc_make(qa + desc_step(32 * k), desc_hi(D)));
                wg_commit();
                // D = 128: the previous tile's dQ products with S^T in flight (room for S^T's 32 accumulators only)
                if (!kBwdOverlap<D> && t > 0) {
                    dq_tile(t - 1, bhprev, mprev);
                    wg_fence();
                }
#pragma unroll
                for (int cc = 0; cc < D / 64; ++cc) {
                    const uint32_t va = desc_lo(vimg + cc * 8192),
                                   da = desc_lo(sst + S::DO_OFF + cc * 8192);
#pragma unroll
                    for (int kk = 0; kk < 4; ++kk) {
                        const uint64_t x = desc_make(va + desc_step(32 * kk), desc_hi(128));
                        const uint64_t y = desc_make(da + desc_step(32 * kk), desc_hi(128));
                        if (cc == 0 && kk == 0) wgmma_h16_n64<T, false>(dpt, x, y);
                        else wgmma_h16_n64<T, true>(dpt, x, y);
                    }
                }
                wg_commit();
            }
            // FA3's order where registers allow: the previous tile's dQ products run with S^T and dP^T in flight (its
            // wait_group waits for them too)
            if (kBwdOverlap<D> && t > 0) dq_tile(t - 1, bhprev, mprev);
            wg_wait<1>();
            reg_fence(sacc);
            // P^T (masked pairs 0: keys past skv or padded, past the causal diagonal, queries past sq); a lane whose
            // pairs of this tile are all visible (most tiles at long lengths) skips the per-pair tests
            float pt[32];
            auto probs = [&](auto masked) {
#pragma unroll
                for (int i = 0; i < 8; ++i) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int qc = bwd_query_of(8 * i + 2 * t4 + e), qi = m0 + qc;
                        const float4 s4 = st[qc];  // q scale, LSE (log2), Delta, dO scale
                        const float x0 = fast_exp2((float)sacc[4 * i + e] * ks0 * s4.x - s4.y);
                        const float x1 = fast_exp2((float)sacc[4 * i + 2 + e] * ks1 * s4.x - s4.y);
                        if constexpr (decltype(masked)::value) {
                            const bool qok = qi < sq;
                            const bool v0 = qok && kok0 && (!p.causal || key0 <= qi + diag);
                            const bool v1 = qok && kok1 && (!p.causal || key1 <= qi + diag);
                            pt[4 * i + e] = v0 ? x0 : 0.f;
                            pt[4 * i + 2 + e] = v1 ? x1 : 0.f;
                        } else {
                            pt[4 * i + e] = x0;
                            pt[4 * i + 2 + e] = x1;
                        }
                    }
                }
            };
            if (kok0 && kok1 && m0 + kBwdQueries <= sq && (!p.causal || key1 <= m0 + diag))
                probs(std::false_type{});
            else
                probs(std::true_type{});
            // in place (registers): dpt <- dS^T = P^T o (dP^T - Delta), pt <- P^T s_dO, quantized per key row and
            // dV += q8(P^T s_dO) dO^
            wg_wait<0>();  // (dP^T, issued with S^T)
            reg_fence(dpt);
#pragma unroll
            for (int i = 0; i < 8; ++i)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float4 s4 = st[bwd_query_of(8 * i + 2 * t4 + e)];
#pragma unroll
                    for (int hh = 0; hh < 2; ++hh) {
                        const int j = 4 * i + 2 * hh + e;
                        dpt[j] = pt[j] * (dpt[j] - s4.z);
                        pt[j] = pt[j] * s4.w;
                    }
                }
            uint32_t adv[2][4];
            float pv0, pv1;
            int tv[32];
            bwd_quantize_rows(pt, adv, pv0, pv1);
            if constexpr (kBwdOverlap<D>) bwd_int8_issue(tv, adv, sst + S::DOT_OFF, 0);
            else bwd_int8_update<D>(dv, adv, sst + S::DOT_OFF, pv0, pv1);
            // dQ's operand dS s_K, quantized per query over this warpgroup's 64 keys into its dS image (free once the
            // other warpgroup's dQ of tile t - 2 read it), announced to the other warpgroup (generic stores read by
            // wgmma: the async proxy)
#pragma unroll
            for (int j = 0; j < 32; ++j) pt[j] = dpt[j] * ((j & 2) ? ksr1 : ksr0);
            if (t >= 2) named_sync(kBarDsFree + 2 * wg + par, 128 * kBwdNwg);
            bwd_quantize_cols(pt, skv_img + S::DS_IN_KV + par * S::DS_BYTES,
                              reinterpret_cast<float*>(skv_img + S::RED_IN_KV),
                              reinterpret_cast<float*>(skv_img + S::SC_IN_KV) + 64 * par, 1 + wg, warp, lane);
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            named_arrive(kBarDsReady + 2 * wg + par, 128 * kBwdNwg);
            if constexpr (kBwdOverlap<D>) {
                wg_wait<0>();
                reg_fence(tv);
                bwd_int8_fold(dv, tv, pv0, pv1);
            }
            // dK += q8(dS^T s_Q) Q^
#pragma unroll
            for (int i = 0; i < 8; ++i)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float qs = st[bwd_query_of(8 * i + 2 * t4 + e)].x;
                    dpt[4 * i + e] *= qs;
                    dpt[4 * i + 2 + e] *= qs;
                }
            {
                uint32_t adk[2][4];
                float pk0, pk1;
                bwd_quantize_rows(dpt, adk, pk0, pk1);
                bwd_int8_update<D>(dk, adk, sst + S::QT_OFF, pk0, pk1);
            }
        }
        // this thread's last read of the stage (the dK product is complete): the producer may refill it. Every
        // thread arrives: an arrival releases the arriving thread's own reads, and the stats rows read by all lanes
        // are refilled by per-thread cp.async writes (one lane's arrival after __syncwarp left compute-sanitizer's
        // racecheck reporting the refill against the other lanes' reads)
        mbar_arrive(empty + 8 * stg);
        mprev = m0;
        bhprev = bh;
    }
    if (tl.ntiles > 0) dq_tile(tl.ntiles - 1, bhprev, mprev);
    if ((ltid & 31) == 0) bulk_wait<false>();  // (the staging block stays allocated until the last reduction read it)
    // epilogue: rows key0 / key1, channels 64 nh + 8 i + 2 t4 (+1); dK times tau
    T* dkp = static_cast<T*>(p.dk) + ((int64_t)bkv * skv) * D;
    T* dvp = static_cast<T*>(p.dv) + ((int64_t)bkv * skv) * D;
#pragma unroll
    for (int nh = 0; nh < D / 64; ++nh)
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int ch = 64 * nh + 8 * i + 2 * t4, j = 32 * nh + 4 * i;
            if (key0 < skv) {
                *reinterpret_cast<uint32_t*>(dkp + (int64_t)key0 * D + ch) = pack2<T>(dk[j] * p.sm_scale, dk[j + 1] * p.sm_scale);
                *reinterpret_cast<uint32_t*>(dvp + (int64_t)key0 * D + ch) = pack2<T>(dv[j], dv[j + 1]);
            }
            if (key1 < skv) {
                *reinterpret_cast<uint32_t*>(dkp + (int64_t)key1 * D + ch) = pack2<T>(dk[j + 2] * p.sm_scale, dk[j + 3] * p.sm_scale);
                *reinterpret_cast<uint32_t*>(dvp + (int64_t)key1 * D + ch) = pack2<T>(dv[j + 2], dv[j + 3]);
            }
        }
}

}  // namespace sage::hopper

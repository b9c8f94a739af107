// The portable path's pre-passes: K/V statistics, Q/K INT8 (or INT4) and V FP8 (or FP16) quantization into the
// workspace, and the "4b" Delta S correction.
#pragma once
#include "traits.cuh"
#include "../common/quant.cuh"
#include "../common/ptx.cuh"

namespace sage::portable {

// passes of the kThreads threads over a head's D channels (one per thread up to D = 128: the loops below are then
// the single `threadIdx.x < D` step they were)
template <int D>
constexpr int kChanPasses = (D + kThreads - 1) / kThreads;

// ----------------------------------------------------------------------------------------------
// 1. stats: partial sums of K (z = 0) and, for V (z = 1), partial max |V| per (b, kv-head, split, channel), or with
// smooth_v partial sum, max and min of V (max|V - mean| = max(max - mean, mean - min) exactly: rounding is monotone).
template <int D, typename T>
__global__ void __launch_bounds__(kThreads) stats_kernel(SageAttnParams p, float* kpart, float* vpart, int nsplit) {
    constexpr int NC = D / 8, NR = kThreads / NC;
    __shared__ float red[3][NR][D];
    const int z = blockIdx.z, bh = blockIdx.y, split = blockIdx.x;
    const int b = bh / p.Hkv, h = bh % p.Hkv;
    const int skv = len_k(p, b);
    const int chunk = (skv + nsplit - 1) / nsplit;
    const int s0 = split * chunk;
    const int s1 = min(skv, s0 + chunk);
    const int col = threadIdx.x % NC, rl = threadIdx.x / NC;
    const T* base = z == 0 ? static_cast<const T*>(p.k) + b * p.k_sb + h * p.k_sh + tok0_k(p, b) * p.k_ss
                           : static_cast<const T*>(p.v) + b * p.v_sb + h * p.v_sh + tok0_k(p, b) * p.v_ss;
    const int64_t ss = z == 0 ? p.k_ss : p.v_ss;
    const bool sv = z == 1 && p.smooth_v;
    float acc[8], amx[8], amn[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) { acc[i] = 0.f; amx[i] = -INFINITY; amn[i] = INFINITY; }
    constexpr int U = 4;  // rows loaded before any is used: 4 x 16 bytes in flight per thread (1 left it latency-bound)
    for (int s = s0 + rl; s < s1; s += U * NR) {
        uint4 raw[U];
#pragma unroll
        for (int u = 0; u < U; ++u)
            raw[u] = s + u * NR < s1 ? *reinterpret_cast<const uint4*>(base + (int64_t)(s + u * NR) * ss + col * 8)
                                     : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (s + u * NR >= s1) break;
            float x[8];
            Vec8<T>::load(reinterpret_cast<const T*>(&raw[u]), x);
            if (z == 0) {
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[i] += x[i];
            } else if (sv) {
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    acc[i] += x[i]; amx[i] = fmax_nan(amx[i], x[i]); amn[i] = fmin_nan(amn[i], x[i]);
                }
            } else {
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[i] = fmax_nan(acc[i], fabsf(x[i]));
            }
        }
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        red[0][rl][col * 8 + i] = acc[i];
        red[1][rl][col * 8 + i] = amx[i];
        red[2][rl][col * 8 + i] = amn[i];
    }
    __syncthreads();
#pragma unroll
    for (int u = 0; u < kChanPasses<D>; ++u) {  // (D = 256: two channels per thread)
        const unsigned du = threadIdx.x + u * kThreads;
        if (du >= D) break;
        const int d = du;
        if (z == 0) {
            float r = 0.f;
            for (int j = 0; j < NR; ++j) r += red[0][j][d];
            kpart[((int64_t)bh * nsplit + split) * D + d] = r;
        } else if (sv) {
            float r = 0.f, mx = -INFINITY, mn = INFINITY;
            for (int j = 0; j < NR; ++j) {
                r += red[0][j][d]; mx = fmax_nan(mx, red[1][j][d]); mn = fmin_nan(mn, red[2][j][d]);
            }
            float* out = vpart + ((int64_t)bh * nsplit + split) * 3 * D;
            out[d] = r; out[D + d] = mx; out[2 * D + d] = mn;
        } else {
            float r = 0.f;
            for (int j = 0; j < NR; ++j) r = fmax_nan(r, red[0][j][d]);
            vpart[((int64_t)bh * nsplit + split) * 3 * D + d] = r;
        }
    }
}

// 1b. reduce the partials once per (b, kv-head): mean(K), and max|V| (max|V - mean(V)| and mean(V) with smooth_v)
// per channel. Empty sequences (varlen) get a zero mean.
template <int D>
__global__ void __launch_bounds__(D) finalize_stats_kernel(SageAttnParams p, const float* kpart, const float* vpart,
                                                           int nsplit, float* kmean, float* vmax, float* vmean,
                                                           int do_v) {
    const int64_t bh = blockIdx.x;
    const int d = threadIdx.x;
    const int skv = len_k(p, (int)(bh / p.Hkv));
    float s = 0.f;
    for (int j = 0; j < nsplit; ++j) s += kpart[(bh * nsplit + j) * D + d];
    kmean[bh * D + d] = skv > 0 ? s / (float)skv : 0.f;
    if (!do_v) return;
    const float* vp = vpart + bh * nsplit * 3 * D;
    if (p.smooth_v) {
        float sum = 0.f, mx = -INFINITY, mn = INFINITY;
        for (int j = 0; j < nsplit; ++j) {
            sum += vp[j * 3 * D + d];
            mx = fmax_nan(mx, vp[j * 3 * D + D + d]);
            mn = fmin_nan(mn, vp[j * 3 * D + 2 * D + d]);
        }
        const float mean = skv > 0 ? sum / (float)skv : 0.f;
        vmean[bh * D + d] = mean;
        vmax[bh * D + d] = skv > 0 ? finite_or_nan(fmax_nan(0.f, fmax_nan(mx - mean, mean - mn))) : 0.f;
    } else {
        float m = 0.f;
        for (int j = 0; j < nsplit; ++j) m = fmax_nan(m, vp[j * 3 * D + d]);
        vmax[bh * D + d] = finite_or_nan(m);  // NaN: the channel's V scale is NaN (quant_v_kernel, epilogue)
    }
}

// 8 values quantized to integers in [-qmax, qmax] (quant_i8), as 8 bytes in channel order (one 8-byte store)
__device__ __forceinline__ uint2 quant_i8x8(const float (&x)[8], float sc, int qmax) {
    uint32_t w[2];
#pragma unroll
    for (int q = 0; q < 2; ++q) {
        uint32_t a = 0;
#pragma unroll
        for (int e = 0; e < 4; ++e) a |= (uint32_t)(quant_i8(x[4 * q + e], sc, qmax) & 0xff) << (8 * e);
        w[q] = a;
    }
    return make_uint2(w[0], w[1]);
}

// 2a. Q -> INT8 (INT4 values for "4b"), groups Grouping(WQ, 8, 1): in each WQ-row warp tile, rows with equal r % 8
// share a scale (the rows one lane holds in the m16n8 accumulators: g, g+8 of each of the WQ/16 m-tiles).
// Also writes qshift[row] = sm_scale * q . mean(K) (from the unsmoothed q): the LSE of the smoothed scores plus it
// is the true LSE. "4b": the CTA's 4*WQ rows are one Q-smoothing block: q_mean (over its rows < Sq) is subtracted
// before quantization and written to qmean for the Delta S pass.
template <int D, typename T, int WQ>
__global__ void __launch_bounds__(kThreads) quant_q_kernel(SageAttnParams p, int8_t* qi8, float* qscale,
                                                           float* qshift, float* qmean, const float* kmean,
                                                           int sq_pad) {
    constexpr int CPL = D / 32;  // 8-element chunks per lane per row
    constexpr int NR = WQ / 8;   // rows per lane
    constexpr int BQ = 4 * WQ;
    __shared__ float smean[D];
    __shared__ float qsum[4][D];
    const int bh = blockIdx.y, b = bh / p.Hq, h = bh % p.Hq;
    const int sq = len_q(p, b);
    if (blockIdx.x * BQ >= sq) return;  // varlen: past this sequence's end (never read)
#pragma unroll
    for (int u = 0; u < kChanPasses<D>; ++u) {
        const unsigned d = threadIdx.x + u * kThreads;
        if (d < D) {
            const int64_t bhk = (int64_t)b * p.Hkv + h / (p.Hq / p.Hkv);
            smean[d] = kmean[bhk * D + d];
        }
    }
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int tile = blockIdx.x * 4 + warp;
    const T* base = static_cast<const T*>(p.q) + b * p.q_sb + h * p.q_sh + tok0_q(p, b) * p.q_ss;
    float x[NR][CPL][8];
#pragma unroll
    for (int r = 0; r < NR; ++r) {
        const int row = tile * WQ + g + 8 * r;
#pragma unroll
        for (int i = 0; i < CPL; ++i) {
            if (row < sq) Vec8<T>::load(base + row * p.q_ss + (t + 4 * i) * 8, x[r][i]);
            else {
#pragma unroll
                for (int e = 0; e < 8; ++e) x[r][i][e] = 0.f;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < NR; ++r) {
        const int row = tile * WQ + g + 8 * r;
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < CPL; ++i)
#pragma unroll
            for (int e = 0; e < 8; ++e) dot = fmaf(x[r][i][e], smean[(t + 4 * i) * 8 + e], dot);
        dot += __shfl_xor_sync(0xffffffffu, dot, 1);
        dot += __shfl_xor_sync(0xffffffffu, dot, 2);
        if (t == 0) qshift[(int64_t)bh * sq_pad + row] = dot * p.sm_scale;
    }
    if (p.qk_bits == 4) {  // Q smoothing: subtract the block mean from the valid rows (padding rows stay 0)
#pragma unroll
        for (int i = 0; i < CPL; ++i)
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                float s = 0.f;
#pragma unroll
                for (int r = 0; r < NR; ++r) s += x[r][i][e];
                s += __shfl_xor_sync(0xffffffffu, s, 4);
                s += __shfl_xor_sync(0xffffffffu, s, 8);
                s += __shfl_xor_sync(0xffffffffu, s, 16);
                if (g == 0) qsum[warp][(t + 4 * i) * 8 + e] = s;
            }
        __syncthreads();
        const float cnt = (float)min(BQ, sq - (int)blockIdx.x * BQ);
#pragma unroll
        for (int i = 0; i < CPL; ++i)
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const int c = (t + 4 * i) * 8 + e;
                const float qm = (((qsum[0][c] + qsum[1][c]) + qsum[2][c]) + qsum[3][c]) / cnt;
                if (warp == 0 && g == 0) qmean[((int64_t)bh * (sq_pad / BQ) + blockIdx.x) * D + c] = qm;
#pragma unroll
                for (int r = 0; r < NR; ++r)
                    if (tile * WQ + g + 8 * r < sq) x[r][i][e] -= qm;
            }
    }
    float am = 0.f;
#pragma unroll
    for (int r = 0; r < NR; ++r)
#pragma unroll
        for (int i = 0; i < CPL; ++i)
#pragma unroll
            for (int e = 0; e < 8; ++e) am = fmax_nan(am, fabsf(x[r][i][e]));
    am = fmax_nan(am, __shfl_xor_sync(0xffffffffu, am, 1));
    am = fmax_nan(am, __shfl_xor_sync(0xffffffffu, am, 2));
    const int qmax = qk_max(p);
    // non-finite group: NaN scale (its values quantize to 0, the attention's scores of these rows are NaN)
    const float sc = finite_or_nan(am) / (float)qmax;
    if (t == 0) qscale[((int64_t)bh * (sq_pad / WQ) + tile) * 8 + g] = sc;
    if (p.qk_packed && p.qk_bits == 4) {  // packed INT4 rows of D/2 bytes
#pragma unroll
        for (int r = 0; r < NR; ++r) {
            const int row = tile * WQ + g + 8 * r;
            uint8_t* o = reinterpret_cast<uint8_t*>(qi8) + ((int64_t)bh * sq_pad + row) * (D / 2);
#pragma unroll
            for (int i = 0; i < CPL; ++i) {
                int v[8];
#pragma unroll
                for (int e = 0; e < 8; ++e) v[e] = quant_i8(x[r][i][e], sc, qmax);
                *reinterpret_cast<uint32_t*>(o + (t + 4 * i) * 4) = pack_s4x8(v);
            }
        }
        return;
    }
#pragma unroll
    for (int r = 0; r < NR; ++r) {
        const int row = tile * WQ + g + 8 * r;
        int8_t* o = qi8 + ((int64_t)bh * sq_pad + row) * D;
#pragma unroll
        for (int i = 0; i < CPL; ++i) {
            *reinterpret_cast<uint2*>(o + (t + 4 * i) * 8) = quant_i8x8(x[r][i], sc, qmax);
        }
    }
}

// K - mean(K) of one key, channels 8 j .. 8 j + 7 of the half row at src (mean: that half's channel means, in shared
// memory), in fp32 as the quantization and Delta S passes both need it; a key past the sequence end (valid false)
// gives 0 (it is padding, and |0 - mean| must not count in a scale)
template <typename T>
__device__ __forceinline__ void load_k_centred(const T* src, const float* mean, int j, bool valid, float (&x)[8]) {
    if (valid) {
        Vec8<T>::load(src + 8 * j, x);
#pragma unroll
        for (int e = 0; e < 8; ++e) x[e] -= mean[8 * j + e];
    } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) x[e] = 0.f;
    }
}

// 2b. K - mean(K) -> INT8 (INT4 values for "4b"), groups Grouping(64, 8, 2): in each 64-key block keys with equal
// (c % 8) / 2 share a scale. Varlen: per sequence (its own mean; blocks restart at the sequence start).
template <int D, typename T>
__global__ void __launch_bounds__(kThreads) quant_k_kernel(SageAttnParams p, const float* kmean, int8_t* ki8,
                                                           float* kscale, int skv_pad) {
    constexpr int H = D / 2, CH = H / 8;
    __shared__ float smean[D];
    __shared__ float rowmax[kBK];
    const int kb = blockIdx.x, bh = blockIdx.y, b = bh / p.Hkv, h = bh % p.Hkv;
    const int skv = len_k(p, b);
    if (kb * kBK >= skv) return;  // varlen: past this sequence's end (never read)
#pragma unroll
    for (int u = 0; u < kChanPasses<D>; ++u) {
        const unsigned d = threadIdx.x + u * kThreads;
        if (d < D) smean[d] = kmean[(int64_t)bh * D + d];
    }
    __syncthreads();
    const int c = threadIdx.x >> 1, hh = threadIdx.x & 1;
    const int key = kb * kBK + c;
    const T* src = static_cast<const T*>(p.k) + b * p.k_sb + h * p.k_sh + (tok0_k(p, b) + key) * p.k_ss + hh * H;
    float x[CH][8];
    float am = 0.f;
#pragma unroll
    for (int j = 0; j < CH; ++j) {
        load_k_centred(src, smean + hh * H, j, key < skv, x[j]);
#pragma unroll
        for (int e = 0; e < 8; ++e) am = fmax_nan(am, fabsf(x[j][e]));
    }
    am = fmax_nan(am, __shfl_xor_sync(0xffffffffu, am, 1));
    if (hh == 0) rowmax[c] = am;
    __syncthreads();
    const int grp = (c & 7) >> 1;
    float gm = 0.f;
#pragma unroll
    for (int a = 0; a < 8; ++a) gm = fmax_nan(gm, fmax_nan(rowmax[8 * a + 2 * grp], rowmax[8 * a + 2 * grp + 1]));
    const int qmax = qk_max(p);
    const float sc = finite_or_nan(gm) / (float)qmax;  // non-finite group: NaN scale (its scores are NaN)
    if (hh == 0 && c < 8 && (c & 1) == 0) kscale[((int64_t)bh * (skv_pad / kBK) + kb) * 4 + grp] = sc;
    if (p.qk_packed && p.qk_bits == 4) {  // packed INT4 rows of D/2 bytes
        uint8_t* dst4 = reinterpret_cast<uint8_t*>(ki8) + ((int64_t)bh * skv_pad + key) * (D / 2) + hh * (H / 2);
#pragma unroll
        for (int j = 0; j < CH; ++j) {
            int v[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) v[e] = quant_i8(x[j][e], sc, qmax);
            *reinterpret_cast<uint32_t*>(dst4 + 4 * j) = pack_s4x8(v);
        }
        return;
    }
    int8_t* dst = ki8 + ((int64_t)bh * skv_pad + key) * D + hh * H;
#pragma unroll
    for (int j = 0; j < CH; ++j) {
        *reinterpret_cast<uint2*>(dst + 8 * j) = quant_i8x8(x[j], sc, qmax);
    }
}

// 2c. V -> FP8 E4M3 per channel (scale amax/448), transposed to [d][key slot] per 64-key block, with the keys of
// each 32-key half permuted so that the m16n8k32 accumulator fragment of S is directly the A fragment of P~:
// slot s (0..31) holds key 16*(s/16) + 8*((s%4)/2) + 2*((s%16)/4) + (s%2).
// PV_FP16: V as fp16, transposed, natural key order (m16n8k16 fragments match the S layout).
// PV_FP8_F16: like PV_FP16 but each value is e4m3(v / scale) (exactly representable in fp16).
// smooth_v: mean(V) (per sequence and channel) is subtracted first; vmax is then max|V - mean|.
template <int D, typename T, int PV>
__global__ void __launch_bounds__(kThreads) quant_v_kernel(SageAttnParams p, const float* vmax, const float* vmean,
                                                           uint8_t* vt, float* vscale, int skv_pad) {
    // channels per pass: at D = 256 the fp32 tile of all channels (64 x 257 x 4 bytes) would pass the 48 KB of
    // static shared memory, so wider heads take two passes of 128 channels
    constexpr int DC = D > 128 ? 128 : D;
    __shared__ float tile[kBK][DC + 1];
    __shared__ float sscale[D];
    __shared__ float svmean[D];
    const int kb = blockIdx.x, bh = blockIdx.y, b = bh / p.Hkv, h = bh % p.Hkv;
    const int skv = len_k(p, b);
    if (kb > 0 && kb * kBK >= skv) return;  // varlen: past this sequence's end (block 0 always writes vscale)
#pragma unroll
    for (int u = 0; u < kChanPasses<D>; ++u) {
        const unsigned d = threadIdx.x + u * kThreads;
        if (d >= D) break;
        if (PV != PV_FP16) {
            const float sc = vmax[(int64_t)bh * D + d] / kFp8Max;
            sscale[d] = sc;
            if (kb == 0) vscale[(int64_t)bh * D + d] = sc;
        }
        svmean[d] = p.smooth_v ? vmean[(int64_t)bh * D + d] : 0.f;
    }
    const T* src = static_cast<const T*>(p.v) + b * p.v_sb + h * p.v_sh + tok0_k(p, b) * p.v_ss;
#pragma unroll
    for (int c0 = 0; c0 < D; c0 += DC) {
        __syncthreads();  // sscale / svmean written; the previous pass's tile read
        for (int i = threadIdx.x; i < kBK * (DC / 8); i += kThreads) {
            const int r = i / (DC / 8), c = i % (DC / 8);
            const int key = kb * kBK + r;
            float x[8];
            if (key < skv) {
                Vec8<T>::load(src + (int64_t)key * p.v_ss + c0 + c * 8, x);
                if (p.smooth_v) {
    #pragma unroll
                    for (int e = 0; e < 8; ++e) x[e] -= svmean[c0 + c * 8 + e];
                }
            } else {
    #pragma unroll
                for (int e = 0; e < 8; ++e) x[e] = 0.f;
            }
    #pragma unroll
            for (int e = 0; e < 8; ++e) tile[r][c * 8 + e] = x[e];
        }
        __syncthreads();
        if constexpr (PV == PV_FP8_MMA) {
            for (int task = threadIdx.x; task < DC * 4; task += kThreads) {
                const int dc = task >> 2, d = c0 + dc, sg = task & 3;
                const float sc = sscale[d];
                uint32_t w[4] = {0u, 0u, 0u, 0u};
    #pragma unroll
                for (int i = 0; i < 16; i += 2) {
                    float x2[2];
    #pragma unroll
                    for (int u = 0; u < 2; ++u) {
                        const int slot = sg * 16 + i + u;
                        const int s = slot & 31;
                        const int key = (slot >> 5) * 32 + (s >> 4) * 16 + ((s & 3) >> 1) * 8 + ((s & 15) >> 2) * 2 + (s & 1);
                        // (a NaN scale, non-finite channel: 0 here, NaN in the epilogue's multiply by vscale)
                        x2[u] = sc > 0.f ? tile[key][dc] / sc : 0.f;
                    }
                    w[i >> 2] |= cvt_e4m3x2(x2[0], x2[1]) << (8 * (i & 3));
                }
                *reinterpret_cast<uint4*>(vt + ((int64_t)bh * D + d) * skv_pad + kb * kBK + sg * 16) =
                    make_uint4(w[0], w[1], w[2], w[3]);
            }
        } else {
            for (int task = threadIdx.x; task < DC * 8; task += kThreads) {
                const int dc = task >> 3, d = c0 + dc, grp = task & 7;
                uint32_t w[4];
                if constexpr (PV == PV_FP16) {
    #pragma unroll
                    for (int i = 0; i < 4; ++i)
                        w[i] = pack2<__half>(tile[grp * 8 + 2 * i][dc], tile[grp * 8 + 2 * i + 1][dc]);
                } else {
                    const float sc = sscale[d];
    #pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const float a = sc > 0.f ? tile[grp * 8 + 2 * i][dc] / sc : 0.f;
                        const float c = sc > 0.f ? tile[grp * 8 + 2 * i + 1][dc] / sc : 0.f;
                        w[i] = e4m3x2_to_f16x2(cvt_e4m3x2(a, c));
                    }
                }
                *reinterpret_cast<uint4*>(vt + (((int64_t)bh * D + d) * skv_pad + kb * kBK + grp * 8) * 2) =
                    make_uint4(w[0], w[1], w[2], w[3]);
            }
        }
    }
}

// 2d. "4b" Delta S = q_mean(block) . (K - mean(K))^T in fp32 (K unquantized, as in the reference), times
// sm_scale * log2(e): ds[(b, hq, qblock), key], added to the scores of every row of the Q-smoothing block.
// CTA = 64 keys of one (b, q-head); 2 threads per key (half the channels each).
template <int D, typename T>
__global__ void __launch_bounds__(kThreads) delta_s_kernel(SageAttnParams p, const float* kmean, const float* qmean,
                                                           float* ds, int nqb, int bq, int skv_pad) {
    constexpr int H = D / 2, CH = H / 8;
    __shared__ float smean[D];
    const int kb = blockIdx.x, bhq = blockIdx.y, b = bhq / p.Hq, h = bhq % p.Hq;
    const int hk = h / (p.Hq / p.Hkv);
    const int64_t bhk = (int64_t)b * p.Hkv + hk;
    const int skv = len_k(p, b), sq = len_q(p, b);
    if (kb * kBK >= skv) return;
#pragma unroll
    for (int u = 0; u < kChanPasses<D>; ++u) {
        const unsigned d = threadIdx.x + u * kThreads;
        if (d < D) smean[d] = kmean[bhk * D + d];
    }
    __syncthreads();
    const int c = threadIdx.x >> 1, hh = threadIdx.x & 1;
    const int key = kb * kBK + c;
    const T* src = static_cast<const T*>(p.k) + b * p.k_sb + hk * p.k_sh + (tok0_k(p, b) + key) * p.k_ss + hh * H;
    float x[CH][8];
#pragma unroll
    for (int j = 0; j < CH; ++j) load_k_centred(src, smean + hh * H, j, key < skv, x[j]);
    const int nq = min(nqb, (sq + bq - 1) / bq);
    const float mul = p.sm_scale * kLog2e;
    for (int qb = 0; qb < nq; ++qb) {
        const float4* qm = reinterpret_cast<const float4*>(qmean + ((int64_t)bhq * nqb + qb) * D + hh * H);
        float d = 0.f;
#pragma unroll
        for (int j = 0; j < CH; ++j) {
            const float4 a = __ldg(qm + 2 * j), bb = __ldg(qm + 2 * j + 1);
            d = fmaf(x[j][0], a.x, d); d = fmaf(x[j][1], a.y, d); d = fmaf(x[j][2], a.z, d); d = fmaf(x[j][3], a.w, d);
            d = fmaf(x[j][4], bb.x, d); d = fmaf(x[j][5], bb.y, d); d = fmaf(x[j][6], bb.z, d); d = fmaf(x[j][7], bb.w, d);
        }
        d += __shfl_xor_sync(0xffffffffu, d, 1);
        if (hh == 0) ds[((int64_t)bhq * nqb + qb) * skv_pad + key] = d * mul;
    }
}

}  // namespace sage::portable

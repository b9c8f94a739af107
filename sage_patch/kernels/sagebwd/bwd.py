"""SageBwd backward (Triton): dK/dV and dQ kernels, each recomputing P = exp(S - L) from the saved INT8 Q^, K^ and
their scales. No atomics: each output tile is written by one program, so the result is deterministic.

dkdv_kernel: one program per (BLOCK_N keys, batch x KV head), walking the query heads of its GQA group and their
query tiles of BLOCK_M rows (the numerics' block_q), so dK and dV are summed over the group in registers.
  dV_j += sum_i P_ij dO_i      as INT8: (P s_dO) per key column of the tile, dO^ per token
  dP    = dO V^T               in the input dtype (fp32 accumulation): quantizing it costs dQ most of its accuracy
  dS    = P o (dP - Delta)
  dK_j += sum_i dS_ij Q_i      as INT8: (dS s_Q) per key column of the tile, Q^ per token
dq_kernel: one program per (BLOCK_M query rows, batch x query head), walking key tiles of BLOCK_N keys (block_k):
  dQ_i += sum_j dS_ij K_j      as INT8: (dS s_K) per query row of the tile, K^ per token
Each operand's scale that varies along a product's reduction is folded into the other operand before that one is
quantized, so every scale factors out of the exact int32 product.

Why half-width accumulators and a dK/dV kernel that can run as two launches: an INT8 product's int32 result is
rescaled before it is added to its fp32 accumulator, so each product needs a temporary as large as its share of the
accumulator. At D=128, dK and dV in one launch (K^ and V held for the whole loop) spill (0.5 KB per thread); one
launch each, with every accumulator kept as two D/2-wide halves, does not and is faster there. At D=64 one launch for
both is faster (docs/design/kernels.md).

Every tile read inside the loops comes through a tensor descriptor (fwd.py says why); the transposed INT8 operands
are (B * H, D, S) with rows padded to 16 bytes, as a descriptor's strides must be.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .fwd import LOG2E, hide, key_end, key_tile, scores
from .quant import row_amax, to_int8


@triton.jit
def quantize_rows_of(x):
    """INT8 with one scale per row of x: (x^, scale), the scale NaN where the row holds a NaN (quant.row_amax: a
    NaN from a non-finite input reaches the product through it)."""
    amax = row_amax(x)
    inv = tl.where(amax > 0, 127.0 / amax, 0.0)
    return to_int8(x * inv[:, None]), amax / 127.0


@triton.jit
def half_product(a8, bt_desc, bh, h0, c0, HALF: tl.constexpr, C: tl.constexpr):
    """a8 (R, C) INT8 times B (C, D/2), the channels h0.. of the columns c0.. of head bh of the transposed operand
    B^T (B * H, D, S): the int32 product as fp32 (R, D/2)."""
    bt = bt_desc.load([bh, h0, c0]).reshape(HALF, C)
    return tl.dot(a8, tl.trans(bt), out_dtype=tl.int32).to(tl.float32)


@triton.jit
def row_stats(stats_desc, bh, m0, BLOCK_M: tl.constexpr):
    """The per-query values of a query tile, (B * Hq, Sq, 4) rows read by one descriptor load (per-element loads of
    four vectors cost the loop more instructions than its products): Q's scale, the LSE in the log2 domain (0 for
    an empty row, whose P the mask makes 0), Delta and dO's scale. Rows past Sq read as zeros: with their Q and dO
    scales 0, their share of dK and dV is 0."""
    even, odd = tl.split(stats_desc.load([bh, m0, 0]).reshape(BLOCK_M, 2, 2))
    qs, delta = tl.split(even)
    lse, dos = tl.split(odd)
    return qs, lse, delta, dos


@triton.jit
def probs_t(k, ks, q, qs, lse, b, m0, n0, offs_m, offs_n, Sq, Skv, kpm_ptr, skpm, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, KEY_PADDING: tl.constexpr):
    """P^T (BLOCK_N, BLOCK_M) of one query tile from the saved operands (ks carries tau log2(e))."""
    pt = tl.exp2(scores(k, ks, q, qs) - lse[None, :])
    return hide(pt, 0.0, m0, n0, offs_m, offs_n, b, Sq, Skv, kpm_ptr, skpm, BLOCK_M, BLOCK_N, CAUSAL, KEY_PADDING,
                True)


@triton.jit
def first_query_tile(pid_n, Sq, Skv, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Query i sees key j when j <= i + Skv - Sq: the first tile with a row at or past n0 - (Skv - Sq)."""
    lo = 0
    if CAUSAL:
        lo = tl.maximum(pid_n * BLOCK_N - (Skv - Sq), 0) // BLOCK_M * BLOCK_M
    return lo


@triton.jit
def dkdv_kernel(
    q_desc, qt_desc,                 # Q^ int8 (B * Hq, Sq, D) and Q^T (B * Hq, D, Sq) descriptors
    k_ptr, ks_ptr,                   # K^ int8 (B, Hkv, Skv, D), scales (B, Hkv, Skv)
    v_ptr, svb, svh, svs,            # V (B, Hkv, Skv, D) in the input dtype
    do_desc,                         # dO (B, Hq, Sq, D) in the input dtype, descriptor
    dot_desc,                        # dO^T int8 (B * Hq, D, Sq) descriptor
    stats_desc,                      # fp32 (B * Hq, Sq, 4) descriptor: row_stats
    dk_ptr, dv_ptr,                  # outputs (B, Hkv, Skv, D) contiguous
    kpm_ptr, skpm,
    Hq, Hkv, Sq, Skv, sm_scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, KEY_PADDING: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
):
    """dK (DK) and / or dV (DV) of BLOCK_N keys: one launch with both, or one launch for each, which holds half the
    accumulators (TILES in __init__ chooses per head dim)."""
    pid_n, bkv = tl.program_id(0), tl.program_id(1)
    b, hkv = bkv // Hkv, bkv % Hkv
    group = Hq // Hkv
    HALF: tl.constexpr = D // 2
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    offs_h = tl.arange(0, HALF)
    cols = offs_n < Skv
    k = tl.load(k_ptr + (bkv * Skv + offs_n[:, None]) * D + offs_d[None, :], mask=cols[:, None], other=0)
    ks = tl.load(ks_ptr + bkv * Skv + offs_n, mask=cols, other=0.0) * (sm_scale * LOG2E)
    if DK:
        v = tl.load(v_ptr + b * svb + hkv * svh + offs_n[:, None] * svs + offs_d[None, :], mask=cols[:, None],
                    other=0.0)
    dk0 = tl.zeros((BLOCK_N, HALF), tl.float32)
    dk1 = tl.zeros((BLOCK_N, HALF), tl.float32)
    dv0 = tl.zeros((BLOCK_N, HALF), tl.float32)
    dv1 = tl.zeros((BLOCK_N, HALF), tl.float32)
    lo = first_query_tile(pid_n, Sq, Skv, BLOCK_M, BLOCK_N, CAUSAL)
    for g in range(0, group):
        h = hkv * group + g
        bh = b * Hq + h
        for m0 in range(lo, Sq, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            q = q_desc.load([bh, m0, 0]).reshape(BLOCK_M, D)
            qs, lse, delta, dos = row_stats(stats_desc, bh, m0, BLOCK_M)
            pt = probs_t(k, ks, q, qs, lse, b, m0, pid_n * BLOCK_N, offs_m, offs_n, Sq, Skv, kpm_ptr, skpm, BLOCK_M,
                         BLOCK_N, CAUSAL, KEY_PADDING)
            if DV:
                p8, p_scale = quantize_rows_of(pt * dos[None, :])
                dv0 += half_product(p8, dot_desc, bh, 0, m0, HALF, BLOCK_M) * p_scale[:, None]
                dv1 += half_product(p8, dot_desc, bh, HALF, m0, HALF, BLOCK_M) * p_scale[:, None]
            if DK:
                do = do_desc.load([b, h, m0, 0]).reshape(BLOCK_M, D)
                dpt = tl.dot(v, tl.trans(do))                                        # fp32 accumulation
                ds8, ds_scale = quantize_rows_of(pt * (dpt - delta[None, :]) * qs[None, :])
                dk0 += half_product(ds8, qt_desc, bh, 0, m0, HALF, BLOCK_M) * ds_scale[:, None]
                dk1 += half_product(ds8, qt_desc, bh, HALF, m0, HALF, BLOCK_M) * ds_scale[:, None]
    out = (bkv * Skv + offs_n[:, None]) * D + offs_h[None, :]
    if DV:
        tl.store(dv_ptr + out, dv0.to(dv_ptr.dtype.element_ty), mask=cols[:, None])
        tl.store(dv_ptr + out + HALF, dv1.to(dv_ptr.dtype.element_ty), mask=cols[:, None])
    if DK:
        tl.store(dk_ptr + out, (dk0 * sm_scale).to(dk_ptr.dtype.element_ty), mask=cols[:, None])
        tl.store(dk_ptr + out + HALF, (dk1 * sm_scale).to(dk_ptr.dtype.element_ty), mask=cols[:, None])


@triton.jit
def dq_kernel(
    q_ptr,                           # Q^ int8 (B, Hq, Sq, D)
    k_desc, kt_desc, ks_desc,        # descriptors: K^ int8 (B * Hkv, Skv, D), K^T (B * Hkv, D, Skv), scales
    v_desc,                          # V (B, Hkv, Skv, D) in the input dtype, descriptor
    do_ptr, sdob, sdoh, sdos,        # dO (B, Hq, Sq, D) in the input dtype
    stats_ptr,                       # fp32 (B * Hq, Sq, 4): row_stats
    dq_ptr,                          # output (B, Hq, Sq, D) contiguous
    kpm_ptr, skpm,
    Hq, Hkv, Sq, Skv, sm_scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, KEY_PADDING: tl.constexpr,
):
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // Hq, bh % Hq
    hkv = h // (Hq // Hkv)
    bkv = b * Hkv + hkv
    HALF: tl.constexpr = D // 2
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    offs_h = tl.arange(0, HALF)
    rows = offs_m < Sq
    q = tl.load(q_ptr + (bh * Sq + offs_m[:, None]) * D + offs_d[None, :], mask=rows[:, None], other=0)
    row = stats_ptr + (bh * Sq + offs_m) * 4
    qs = tl.load(row, mask=rows, other=0.0) * (sm_scale * LOG2E)
    lse = tl.load(row + 1, mask=rows, other=float("inf"))
    do = tl.load(do_ptr + b * sdob + h * sdoh + offs_m[:, None] * sdos + offs_d[None, :], mask=rows[:, None],
                 other=0.0)
    delta = tl.load(row + 2, mask=rows, other=0.0)
    dq0 = tl.zeros((BLOCK_M, HALF), tl.float32)
    dq1 = tl.zeros((BLOCK_M, HALF), tl.float32)
    for n0 in range(0, key_end(pid_m, Sq, Skv, BLOCK_M, CAUSAL), BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k, ks = key_tile(k_desc, ks_desc, bkv, n0, BLOCK_N, D)
        p = tl.exp2(scores(q, qs, k, ks) - lse[:, None])
        p = hide(p, 0.0, pid_m * BLOCK_M, n0, offs_m, offs_n, b, Sq, Skv, kpm_ptr, skpm, BLOCK_M, BLOCK_N, CAUSAL,
                 KEY_PADDING, False)
        v = v_desc.load([b, hkv, n0, 0]).reshape(BLOCK_N, D)
        dp = tl.dot(do, tl.trans(v))
        ds8, ds_scale = quantize_rows_of(p * (dp - delta[:, None]) * ks[None, :])
        dq0 += half_product(ds8, kt_desc, bkv, 0, n0, HALF, BLOCK_N) * ds_scale[:, None]
        dq1 += half_product(ds8, kt_desc, bkv, HALF, n0, HALF, BLOCK_N) * ds_scale[:, None]
    dst = dq_ptr + (bh * Sq + offs_m[:, None]) * D + offs_h[None, :]
    tl.store(dst, (dq0 * sm_scale).to(dq_ptr.dtype.element_ty), mask=rows[:, None])
    tl.store(dst + HALF, (dq1 * sm_scale).to(dq_ptr.dtype.element_ty), mask=rows[:, None])

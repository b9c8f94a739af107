"""SageBwd backward (Triton): dK and dV in one kernel, dQ in another, both recomputing P = exp(S - L) from the
saved INT8 Q^, K^ and their scales. No atomics: each output tile is written by one program, so the result is
deterministic.

dkdv_kernel: one program per (BLOCK_N keys, batch x KV head); it walks the query heads of its GQA group and their
query tiles of BLOCK_M rows (the numerics' block_q), so dK and dV are summed over the group in registers.
  dV_j += sum_i P_ij dO_i      as INT8: (P s_dO) per key column of the tile, dO^ per token
  dP    = dO V^T               in the input dtype (fp32 accumulation): quantizing it costs dQ most of its accuracy
  dS    = P o (dP - Delta)
  dK_j += sum_i dS_ij Q_i      as INT8: (dS s_Q) per key column of the tile, Q^ per token
dq_kernel: one program per (BLOCK_M query rows, batch x query head), walking key tiles of BLOCK_N keys (block_k):
  dQ_i += sum_j dS_ij K_j      as INT8: (dS s_K) per query row of the tile, K^ per token
Each operand's scale that varies along a product's reduction is folded into the other operand before that one is
quantized, so every scale factors out of the exact int32 product.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .fwd import LOG2E, visible
from .quant import rint


@triton.jit
def quantize_rows_of(x, axis: tl.constexpr):
    """INT8 with one scale per slice along `axis` reduced (axis=1: per row, axis=0: per column): (x^, scale)."""
    amax = tl.max(tl.abs(x), axis=axis)
    inv = tl.where(amax > 0, 127.0 / amax, 0.0)
    if axis == 1:
        xq = rint(x * inv[:, None]).to(tl.int8)
    else:
        xq = rint(x * inv[None, :]).to(tl.int8)
    return xq, amax / 127.0


@triton.jit
def dkdv_kernel(
    q_ptr, qt_ptr, qs_ptr,           # Q^ int8 (B, Hq, Sq, D) and Q^T (B, Hq, D, Sq), scales (B, Hq, Sq)
    k_ptr, ks_ptr,                   # K^ int8 (B, Hkv, Skv, D), scales (B, Hkv, Skv)
    v_ptr, svb, svh, svs,            # V (B, Hkv, Skv, D) in the input dtype
    do_ptr, sdob, sdoh, sdos,        # dO (B, Hq, Sq, D) in the input dtype
    dot_ptr, dos_ptr,                # dO^T int8 (B, Hq, D, Sq), scales (B, Hq, Sq)
    lse_ptr, delta_ptr,              # fp32 (B, Hq, Sq): LSE of the smoothed scores, rowsum(dO o O)
    dk_ptr, dv_ptr,                  # outputs (B, Hkv, Skv, D) contiguous
    kpm_ptr, skpm,
    Hq, Hkv, Sq, Skv, sm_scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, KEY_PADDING: tl.constexpr,
):
    pid_n, bkv = tl.program_id(0), tl.program_id(1)
    b, hkv = bkv // Hkv, bkv % Hkv
    group = Hq // Hkv
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    cols = offs_n < Skv
    k = tl.load(k_ptr + (bkv * Skv + offs_n[:, None]) * D + offs_d[None, :], mask=cols[:, None], other=0)
    ks = tl.load(ks_ptr + bkv * Skv + offs_n, mask=cols, other=0.0) * (sm_scale * LOG2E)
    v = tl.load(v_ptr + b * svb + hkv * svh + offs_n[:, None] * svs + offs_d[None, :], mask=cols[:, None], other=0.0)
    dk = tl.zeros((BLOCK_N, D), tl.float32)
    dv = tl.zeros((BLOCK_N, D), tl.float32)
    lo = 0
    if CAUSAL:  # query i sees key j when j <= i + Skv - Sq: the first tile with a row at or past n0 - (Skv - Sq)
        lo = tl.maximum(pid_n * BLOCK_N - (Skv - Sq), 0) // BLOCK_M * BLOCK_M
    for g in range(0, group):
        bh = b * Hq + hkv * group + g
        for m0 in range(lo, Sq, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            rows = offs_m < Sq
            q = tl.load(q_ptr + (bh * Sq + offs_m[:, None]) * D + offs_d[None, :], mask=rows[:, None], other=0)
            qs = tl.load(qs_ptr + bh * Sq + offs_m, mask=rows, other=0.0)
            # +inf for rows past Sq makes their P exactly 0; an empty row's scores are all -inf (P = 0 too)
            lse = tl.load(lse_ptr + bh * Sq + offs_m, mask=rows, other=float("inf")) * LOG2E
            lse = tl.where(lse == float("-inf"), 0.0, lse)
            st = tl.dot(k, tl.trans(q), out_dtype=tl.int32).to(tl.float32) * ks[:, None] * qs[None, :]
            ok = tl.trans(visible(offs_m, offs_n, b, Sq, Skv, kpm_ptr, skpm, CAUSAL, KEY_PADDING))
            pt = tl.where(ok, tl.exp2(st - lse[None, :]), 0.0)                      # (BLOCK_N, BLOCK_M)
            dos = tl.load(dos_ptr + bh * Sq + offs_m, mask=rows, other=0.0)
            p8, p_scale = quantize_rows_of(pt * dos[None, :], 1)
            do8t = tl.load(dot_ptr + (bh * D + offs_d[:, None]) * Sq + offs_m[None, :], mask=rows[None, :],
                           other=0)
            dv += tl.dot(p8, tl.trans(do8t), out_dtype=tl.int32).to(tl.float32) * p_scale[:, None]
            do = tl.load(do_ptr + b * sdob + (hkv * group + g) * sdoh + offs_m[:, None] * sdos + offs_d[None, :],
                         mask=rows[:, None], other=0.0)
            dpt = tl.dot(v, tl.trans(do))                                            # fp32 accumulation
            delta = tl.load(delta_ptr + bh * Sq + offs_m, mask=rows, other=0.0)
            dst = pt * (dpt - delta[None, :])
            ds8, ds_scale = quantize_rows_of(dst * qs[None, :], 1)
            qt = tl.load(qt_ptr + (bh * D + offs_d[:, None]) * Sq + offs_m[None, :], mask=rows[None, :], other=0)
            dk += tl.dot(ds8, tl.trans(qt), out_dtype=tl.int32).to(tl.float32) * ds_scale[:, None]
    dst_off = (bkv * Skv + offs_n[:, None]) * D + offs_d[None, :]
    tl.store(dk_ptr + dst_off, (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=cols[:, None])
    tl.store(dv_ptr + dst_off, dv.to(dv_ptr.dtype.element_ty), mask=cols[:, None])


@triton.jit
def dq_kernel(
    q_ptr, qs_ptr,                   # Q^ int8 (B, Hq, Sq, D), scales (B, Hq, Sq)
    k_ptr, kt_ptr, ks_ptr,           # K^ int8 (B, Hkv, Skv, D) and K^T (B, Hkv, D, Skv), scales (B, Hkv, Skv)
    v_ptr, svb, svh, svs,            # V (B, Hkv, Skv, D) in the input dtype
    do_ptr, sdob, sdoh, sdos,        # dO (B, Hq, Sq, D) in the input dtype
    lse_ptr, delta_ptr,
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
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    rows = offs_m < Sq
    q = tl.load(q_ptr + (bh * Sq + offs_m[:, None]) * D + offs_d[None, :], mask=rows[:, None], other=0)
    qs = tl.load(qs_ptr + bh * Sq + offs_m, mask=rows, other=0.0) * (sm_scale * LOG2E)
    lse = tl.load(lse_ptr + bh * Sq + offs_m, mask=rows, other=float("inf")) * LOG2E
    lse = tl.where(lse == float("-inf"), 0.0, lse)
    do = tl.load(do_ptr + b * sdob + h * sdoh + offs_m[:, None] * sdos + offs_d[None, :], mask=rows[:, None],
                 other=0.0)
    delta = tl.load(delta_ptr + bh * Sq + offs_m, mask=rows, other=0.0)
    dq = tl.zeros((BLOCK_M, D), tl.float32)
    hi = Skv
    if CAUSAL:
        hi = tl.minimum(Skv, tl.maximum(pid_m * BLOCK_M + BLOCK_M + Skv - Sq, 0))
    for n0 in range(0, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        cols = offs_n < Skv
        k = tl.load(k_ptr + (bkv * Skv + offs_n[:, None]) * D + offs_d[None, :], mask=cols[:, None], other=0)
        ks = tl.load(ks_ptr + bkv * Skv + offs_n, mask=cols, other=0.0)
        s = tl.dot(q, tl.trans(k), out_dtype=tl.int32).to(tl.float32) * qs[:, None] * ks[None, :]
        ok = visible(offs_m, offs_n, b, Sq, Skv, kpm_ptr, skpm, CAUSAL, KEY_PADDING)
        p = tl.where(ok, tl.exp2(s - lse[:, None]), 0.0)
        v = tl.load(v_ptr + b * svb + hkv * svh + offs_n[:, None] * svs + offs_d[None, :], mask=cols[:, None],
                    other=0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        ds8, ds_scale = quantize_rows_of(ds * ks[None, :], 1)
        kt = tl.load(kt_ptr + (bkv * D + offs_d[:, None]) * Skv + offs_n[None, :], mask=cols[None, :], other=0)
        dq += tl.dot(ds8, tl.trans(kt), out_dtype=tl.int32).to(tl.float32) * ds_scale[:, None]
    tl.store(dq_ptr + (bh * Sq + offs_m[:, None]) * D + offs_d[None, :], (dq * sm_scale).to(dq_ptr.dtype.element_ty),
             mask=rows[:, None])

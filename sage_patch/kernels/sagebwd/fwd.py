"""SageBwd training forward (Triton): INT8 Q K^T, an fp32 online softmax, and P~ V in the input dtype (fp32
accumulation); writes O, the LSE the caller sees and the LSE of the smoothed scores the backward recomputes P from.

P~ V stays 16-bit because the forward's error reaches every gradient through Delta = rowsum(dO o O) (the reference
SageBwdConfig.pv explains the measurement). One program per (BLOCK_M query rows, batch x query head) walks the key
tiles of BLOCK_N keys. Scores are kept in the log2 domain (exp2, with log2(e) folded into the softmax scale).

Tiles read once per key step come through tensor descriptors (TMA on sm_90+: straight to shared memory, no address
registers; Triton lowers them to plain loads before sm_90). A descriptor's box stops at its own head's sequence end and
reads zeros past it, like the masked loads it replaces.
"""
from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def visible(offs_m, offs_n, b, Sq, Skv, kpm_ptr, skpm, CAUSAL: tl.constexpr, KEY_PADDING: tl.constexpr):
    """(BLOCK_M, BLOCK_N) bool: query offs_m sees key offs_n (a key in range, bottom-right causal, key padding).
    Queries past Sq are not masked: no kernel stores their rows, and the backward's zero scales for them (Q's, dO's)
    make their share of every product 0."""
    ok = (offs_n < Skv)[None, :]
    if CAUSAL:
        ok = ok & (offs_n[None, :] <= offs_m[:, None] + (Skv - Sq))
    if KEY_PADDING:
        keep = tl.load(kpm_ptr + b * skpm + offs_n, mask=offs_n < Skv, other=0)
        ok = ok & (keep != 0)[None, :]
    return ok


@triton.jit
def hide(x, fill, m0, n0, offs_m, offs_n, b, Sq, Skv, kpm_ptr, skpm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
         CAUSAL: tl.constexpr, KEY_PADDING: tl.constexpr, TRANSPOSED: tl.constexpr):
    """x (the tile of queries m0.. and keys n0.., or its transpose) with every pair `visible` hides set to fill.
    Causal calls mask only the tiles that reach above the diagonal, or past Skv, or have key padding (most tiles
    of a long causal call need no mask); other calls mask every tile, as a branch in their loop measured slower
    than the mask."""
    if CAUSAL:
        if (n0 + BLOCK_N > Skv) | (n0 + BLOCK_N - 1 > m0 + Skv - Sq) | KEY_PADDING:
            ok = visible(offs_m, offs_n, b, Sq, Skv, kpm_ptr, skpm, CAUSAL, KEY_PADDING)
            x = tl.where(tl.trans(ok) if TRANSPOSED else ok, x, fill)
    else:
        ok = visible(offs_m, offs_n, b, Sq, Skv, kpm_ptr, skpm, CAUSAL, KEY_PADDING)
        x = tl.where(tl.trans(ok) if TRANSPOSED else ok, x, fill)
    return x


@triton.jit
def scores(a, a_scale, b, b_scale):
    """A^ B^T (INT8 operands, exact int32 product) times the row scales of A and the row scales of B, in fp32."""
    return tl.dot(a, tl.trans(b), out_dtype=tl.int32).to(tl.float32) * a_scale[:, None] * b_scale[None, :]


@triton.jit
def key_tile(k_desc, ks_desc, bkv, n0, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """K^ rows n0.. of one KV head and their scales, 0 past Skv: (k (BLOCK_N, D) int8, ks (BLOCK_N,))."""
    k = k_desc.load([bkv, n0, 0]).reshape(BLOCK_N, D)
    return k, ks_desc.load([bkv, n0]).reshape(BLOCK_N)


@triton.jit
def key_end(pid_m, Sq, Skv, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """One past the last key a query tile sees: bottom-right causal, query i sees keys j <= i + Skv - Sq."""
    hi = Skv
    if CAUSAL:
        hi = tl.minimum(Skv, tl.maximum(pid_m * BLOCK_M + BLOCK_M + Skv - Sq, 0))
    return hi


@triton.jit
def forward_kernel(
    q_ptr, qs_ptr, qdot_ptr,         # Q^ int8 (B, Hq, Sq, D) contiguous, scales (B, Hq, Sq), q . mean(K) (B, Hq, Sq)
    k_desc, ks_desc,                 # K^ int8 (B * Hkv, Skv, D), its scales (B * Hkv, Skv): descriptors
    v_desc,                          # V (B, Hkv, Skv, D) in the input dtype, descriptor, box (1, 1, BLOCK_N, D)
    o_ptr, sob, soh, sos,            # O (B, Hq, Sq, D), channel stride 1
    lse_ptr, lse_s_ptr,              # fp32 (B, Hq, Sq): LSE of the scores, of the smoothed scores
    kpm_ptr, skpm,                   # key padding (B, Skv) uint8, 1 = attend (KEY_PADDING)
    Hq, Hkv, Sq, Skv, sm_scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, KEY_PADDING: tl.constexpr, SMOOTH_K: tl.constexpr,
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
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    for n0 in range(0, key_end(pid_m, Sq, Skv, BLOCK_M, CAUSAL), BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k, ks = key_tile(k_desc, ks_desc, bkv, n0, BLOCK_N, D)
        s = scores(q, qs, k, ks)
        s = hide(s, float("-inf"), pid_m * BLOCK_M, n0, offs_m, offs_n, b, Sq, Skv, kpm_ptr, skpm, BLOCK_M, BLOCK_N,
                 CAUSAL, KEY_PADDING, False)
        rowmax = tl.max(s, axis=1)
        m_new = tl.maximum(m, rowmax)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)
        l = l * alpha + tl.sum(p, axis=1)
        v = v_desc.load([b, hkv, n0, 0]).reshape(BLOCK_N, D)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    nonempty = l != 0.0
    l_safe = tl.where(nonempty, l, 1.0)
    out = tl.where(nonempty[:, None], acc / l_safe[:, None], 0.0)
    tl.store(o_ptr + b * sob + h * soh + offs_m[:, None] * sos + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=rows[:, None])
    lse_s = tl.where(nonempty, (m + tl.log2(l_safe)) * LN2, float("-inf"))
    tl.store(lse_s_ptr + bh * Sq + offs_m, lse_s, mask=rows)
    lse = lse_s
    if SMOOTH_K:  # softmax ignores the row shift tau q_i . mean(K); the LSE the caller sees does not
        lse = lse_s + tl.load(qdot_ptr + bh * Sq + offs_m, mask=rows, other=0.0) * sm_scale
    tl.store(lse_ptr + bh * Sq + offs_m, lse, mask=rows)

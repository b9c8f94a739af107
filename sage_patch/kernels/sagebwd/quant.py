"""SageBwd's quantization passes (Triton): the INT8 operands and scales the forward and backward kernels read.

Every scale is one per token (Q, the smoothed K, dO); what each kernel's products need from them is in fwd.py and
bwd.py, and the numerics are those of sage_patch.reference.sagebwd with SageBwdConfig(groups="token", pv="input").
"""
from __future__ import annotations

import triton
import triton.language as tl

from .fwd import LOG2E

# round half to even for |x| <= 127.5, as int8: adding 1.5 * 2**23 leaves no fraction bits (IEEE addition rounds to
# nearest even) and puts round(x) in the low bits, whose low byte (that of 1.5 * 2**23's bits is 0) is round(x) as
# int8: one add instead of a conversion (F2I issues at a quarter of the FP32 rate, and the backward quantizes two
# operands per tile). The int32 -> fp32 conversions of the products stay on the conversion unit: an identity of two
# instructions measured slower there once the loops had shed their other overheads.
ROUND_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def to_int8(x):
    return (x + ROUND_MAGIC).to(tl.int32, bitcast=True).to(tl.int8)


# Non-finite inputs (docs/semantics.md: NaN in, NaN out) travel through the scales, not through per-element tests:
# every INT8 operand's integer product is multiplied by its row's scale amax / 127, so a NaN scale makes every
# product, output and gradient that row enters NaN, whatever INT8 values the NaN row holds (the rounding add turns
# a NaN into some finite integer). tl.max would lose the NaN (it is a maxnum reduction, which returns the other
# operand), so the row maxima reduce with a NaN-propagating maximum instead: the same reduction tree, and on sm_80
# and newer one max.NaN.f32 where tl.max issues one max.f32 at the same rate, so the loops that quantize a tile per
# step pay nothing. For finite rows the two maxima are the same value, so finite inputs are bitwise unaffected.
@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def row_amax(x):
    """max_d |x| per row of a 2-D x, NaN where the row holds a NaN."""
    return tl.reduce(tl.abs(x), 1, _max_nan)


@triton.jit
def quantize_tokens_kernel(
    x_ptr, sxb, sxh, sxs,            # input (B, H, S, D), channel stride 1
    xq_ptr, qsh, qss, qsd,           # INT8 output, one head's offset qsh, token stride qss, channel stride qsd
    scale_ptr,                       # fp32 (B, H, S) contiguous (not STATS)
    mean_ptr, dot_ptr,               # fp32 (B, H_mean, D) and (B, H, S) (MEAN_MODE 1: subtract, 2: dot)
    o_ptr, sob, soh, sos,            # STATS: O (B, H, S, D) strides
    qs_ptr, lse_ptr, stats_ptr,      # STATS: Q's scales and the LSE (B, H, S), the rows out (B * H, S, 4)
    H, S, MEAN_GROUP,                # MEAN_GROUP: heads of x per head of mean (GQA)
    D: tl.constexpr, BLOCK_S: tl.constexpr, MEAN_MODE: tl.constexpr, STATS: tl.constexpr,
):
    """One scale per token: s = max_d |x| / 127, x^ = round(x / s) (0 where s = 0; s NaN where the token holds a
    NaN or Inf, so that it poisons what it reaches: row_amax). STATS (x = dO): instead of the
    scales, the backward's per-query rows (bwd.row_stats): Q's scale, the LSE in the log2 domain (0 for an empty
    row), Delta = rowsum(dO o O) and dO's scale."""
    pid_s, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    offs_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, D)
    rows = offs_s < S
    x = tl.load(x_ptr + b * sxb + h * sxh + offs_s[:, None] * sxs + offs_d[None, :], mask=rows[:, None],
                other=0.0).to(tl.float32)
    if MEAN_MODE != 0:
        mean = tl.load(mean_ptr + (b * (H // MEAN_GROUP) + h // MEAN_GROUP) * D + offs_d)
        if MEAN_MODE == 1:
            x = x - mean[None, :]
        else:
            tl.store(dot_ptr + bh * S + offs_s, tl.sum(x * mean[None, :], axis=1), mask=rows)
    # an Inf makes the maximum Inf, whose scale would quantize the row to NaN * 0: it becomes a NaN scale as well
    # (once per token here; inside the backward's loops an Inf can only come from overflow, and an Inf scale is
    # non-finite as it is)
    amax = row_amax(x)
    amax = tl.where(amax < float("inf"), amax, float("nan"))
    inv = tl.where(amax > 0, 127.0 / amax, 0.0)                   # 0 for a NaN scale: no division by it
    xq = to_int8(x * inv[:, None])
    if STATS:
        o = tl.load(o_ptr + b * sob + h * soh + offs_s[:, None] * sos + offs_d[None, :], mask=rows[:, None],
                    other=0.0).to(tl.float32)
        lse = tl.load(lse_ptr + bh * S + offs_s, mask=rows, other=0.0) * LOG2E
        lse = tl.where(lse == float("-inf"), 0.0, lse)
        row = tl.join(tl.join(tl.load(qs_ptr + bh * S + offs_s, mask=rows, other=0.0), tl.sum(x * o, axis=1)),
                      tl.join(lse, amax / 127.0))                 # row[s, i, j] is column 2 i + j
        tl.store(stats_ptr + (bh * S + offs_s[:, None]) * 4 + tl.arange(0, 4)[None, :], row.reshape(BLOCK_S, 4),
                 mask=rows[:, None])
    else:
        tl.store(scale_ptr + bh * S + offs_s, amax / 127.0, mask=rows)
    tl.store(xq_ptr + bh * qsh + offs_s[:, None] * qss + offs_d[None, :] * qsd, xq, mask=rows[:, None])


@triton.jit
def transpose_kernel(x_desc, xt_desc, BLOCK_S: tl.constexpr, D: tl.constexpr):
    """xt[bh, :, s] = x[bh, s, :] for one tile of BLOCK_S tokens of one head, through descriptors: the K-major INT8
    operands of the backward's products over tokens (a strided torch copy of int8 runs at a fraction of the
    bandwidth)."""
    pid_s, bh = tl.program_id(0), tl.program_id(1)
    x = x_desc.load([bh, pid_s * BLOCK_S, 0]).reshape(BLOCK_S, D)
    xt_desc.store([bh, 0, pid_s * BLOCK_S], tl.trans(x).reshape(1, D, BLOCK_S))

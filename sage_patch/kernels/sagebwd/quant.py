"""SageBwd's quantization passes (Triton): the INT8 operands and scales the forward and backward kernels read.

Every scale is one per token (Q, the smoothed K, dO); what each kernel's products need from them is in fwd.py and
bwd.py, and the numerics are those of sage_patch.reference.sagebwd with SageBwdConfig(groups="token", pv="input").
"""
from __future__ import annotations

import triton
import triton.language as tl

# Conversions between fp32 and integers without the conversion units (I2F / F2I issue at a quarter of the FP32 rate,
# and the backward converts every INT8 product's int32 result and quantizes two operands per tile: they, not the
# tensor cores, bounded its speed). Both rest on 1.5 * 2**23, whose fp32 mantissa holds an integer offset of up to
# 2**22 either way; both are exact, with the conversion units' results.
MAGIC_F32 = tl.constexpr(12582912.0)       # 1.5 * 2**23
MAGIC_BITS = tl.constexpr(0x4B400000)      # its bit pattern; its low byte is 0


@triton.jit
def to_int8(x):
    """Round-half-to-even of fp32 x, |x| <= 127.5, as int8: adding 1.5 * 2**23 leaves no fraction bits (IEEE
    addition rounds to nearest even) and puts round(x) in the low bits, whose low byte is round(x) as int8."""
    return (x + MAGIC_F32).to(tl.int32, bitcast=True).to(tl.int8)


@triton.jit
def int_to_float(x):
    """int32 x, |x| < 2**22, as fp32. An INT8 product of D <= 128 or 64-long reductions stays below 2**21
    (128 * 127 * 127); wider reductions would need the conversion unit."""
    return (x + MAGIC_BITS).to(tl.float32, bitcast=True) - MAGIC_F32


@triton.jit
def quantize_tokens_kernel(
    x_ptr, sxb, sxh, sxs,            # input (B, H, S, D), channel stride 1
    xq_ptr, qsh, qss, qsd,           # INT8 output, one head's offset qsh, token stride qss, channel stride qsd
    scale_ptr,                       # fp32 (B, H, S) contiguous
    mean_ptr, dot_ptr,               # fp32 (B, H_mean, D) and (B, H, S) (MEAN_MODE 1: subtract, 2: dot)
    o_ptr, sob, soh, sos, delta_ptr, # DELTA: O (B, H, S, D) strides and fp32 (B, H, S) output rowsum(x o O)
    H, S, MEAN_GROUP,                # MEAN_GROUP: heads of x per head of mean (GQA)
    D: tl.constexpr, BLOCK_S: tl.constexpr, MEAN_MODE: tl.constexpr, DELTA: tl.constexpr,
):
    """One scale per token: s = max_d |x| / 127, x^ = round(x / s) (0 where s = 0)."""
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
    if DELTA:
        o = tl.load(o_ptr + b * sob + h * soh + offs_s[:, None] * sos + offs_d[None, :], mask=rows[:, None],
                    other=0.0).to(tl.float32)
        tl.store(delta_ptr + bh * S + offs_s, tl.sum(x * o, axis=1), mask=rows)
    amax = tl.max(tl.abs(x), axis=1)
    inv = tl.where(amax > 0, 127.0 / amax, 0.0)
    xq = to_int8(x * inv[:, None])
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

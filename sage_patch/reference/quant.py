"""Number formats used by the simulations: INT8/INT4 symmetric, FP8 E4M3, FP4 E2M1 and NVFP4 microscaling.

Every function is pure (never writes its input) and computes in fp32 unless said otherwise.
"""
from __future__ import annotations

import torch

from .grouping import Grouping

FP8_E4M3_MAX = 448.0
FP4_E2M1_MAX = 6.0
_E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def round_fp8_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to FP8 E4M3 (round-to-nearest-even, saturating at +-448); returns fp32."""
    return x.float().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).float()


def round_fp4_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to FP4 E2M1 values {0, .5, 1, 1.5, 2, 3, 4, 6} (nearest, ties to even mantissa, saturating)."""
    x = x.float()
    a = x.abs().clamp(max=FP4_E2M1_MAX)
    # Spacing is 0.5 below 2, 1 in [2, 4), 2 in [4, 6]: scale so that spacing becomes 1, round half-even, scale back.
    step = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
    r = torch.round(a / step) * step  # torch.round is half-to-even, which matches E2M1 ties to even mantissa
    return torch.copysign(r.clamp(max=FP4_E2M1_MAX), x)


def round_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Truncate an fp32 tensor to `bits` explicit mantissa bits (models a narrow MMA accumulator)."""
    if bits >= 23:
        return x
    drop = 23 - bits
    i = x.float().contiguous().view(torch.int32)
    i = i & ~((1 << drop) - 1)
    return i.view(torch.float32)


def quantize_int(x: torch.Tensor, group_ids: torch.Tensor, n_groups: int, qmax: int, dim: int = -2):
    """Symmetric integer quantization with one scale per group of tokens.

    x: (..., S, D); group_ids: (S,) int64 in [0, n_groups); each group's scale covers its tokens over all of D.
    Returns (q, scale) where q holds integers in [-qmax, qmax] as fp32 and scale is (..., n_groups) fp32,
    so that x ~= q * scale[group_ids].
    """
    assert dim == -2
    amax_tok = x.float().abs().amax(dim=-1)  # (..., S)
    idx = group_ids.to(x.device).expand_as(amax_tok)
    amax = torch.zeros(*amax_tok.shape[:-1], n_groups, device=x.device, dtype=torch.float32)
    amax = amax.scatter_reduce(-1, idx, amax_tok, reduce="amax", include_self=True)
    scale = amax / qmax
    return quantize_int_with_scale(x, scale.gather(-1, idx).unsqueeze(-1), qmax), scale


def quantize_int_with_scale(x: torch.Tensor, scale: torch.Tensor, qmax: int) -> torch.Tensor:
    """round(x / scale) clamped to [-qmax, qmax] (round-half-to-even), as fp32 integers; `scale` broadcasts to x.
    A zero scale (an all-zero group) quantizes to 0. Used where the scale is known without a max pass (SageBwd's
    P~, whose row maximum the online softmax already has)."""
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(x.float() / safe).clamp(-qmax, qmax)


def quantize_int_tiles(x: torch.Tensor, block_rows: int, block_cols: int, qmax: int):
    """Symmetric integer quantization with one scale per (block_rows x block_cols) tile of the last two dims (the
    FlashAttention tiles of a score-shaped matrix, e.g. SageBwd's P and dS). x: (..., R, C).

    Returns (q, scale): q integers in [-qmax, qmax] as fp32, shape of x; scale (..., ceil(R/br), ceil(C/bc)) fp32
    with x ~= q * scale[tile]. Built on quantize_int: each tile is a group of rows of one column block.
    """
    r, c = x.shape[-2], x.shape[-1]
    pad = (-c) % block_cols  # zeros change no tile's amax
    xt = torch.nn.functional.pad(x.float(), (0, pad)).reshape(*x.shape[:-1], -1, block_cols).transpose(-3, -2)
    gid, n_groups = Grouping.per_block(block_rows).ids(r, x.device)
    q, scale = quantize_int(xt, gid, n_groups, qmax)               # q (..., Tc, R, bc), scale (..., Tc, Tr)
    q = q.transpose(-3, -2).reshape(*x.shape[:-1], -1)[..., :c]
    return q, scale.transpose(-2, -1)


def quantize_fp8_per_channel(v: torch.Tensor):
    """FP8 E4M3 with one scale per channel (amax over tokens / 448). v: (..., S, D). Returns (v8 as fp32, scale (..., 1, D))."""
    amax = v.float().abs().amax(dim=-2, keepdim=True)
    scale = amax / FP8_E4M3_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return round_fp8_e4m3(v.float() / safe), scale


# Sampled statistics (SimConfig.stats_sample; the Hopper kernel's hopper_sample_stats_kernel and K/V pass)
SAMPLED_V_HEADROOM = 8.0        # V's per-channel base scale: headroom x the sample's max |V| / 448
SAMPLED_V_REL_FLOOR = 2.0 ** -10  # ... at least this x the largest channel's
SAMPLED_V_ABS_FLOOR = 1e-20
SAMPLED_V_MAX_EXP = 64          # a block's power-of-two factor is at most 2^64


def sample_tokens(n_tokens: int, n: int, device=None) -> torch.Tensor:
    """Indices of min(n, n_tokens) evenly spaced tokens: floor(i * n_tokens / ns)."""
    ns = min(n, n_tokens)
    return torch.div(torch.arange(ns, device=device, dtype=torch.int64) * n_tokens, max(ns, 1), rounding_mode="floor")


def quantize_fp8_sampled_blocks(v: torch.Tensor, sample: torch.Tensor, block: int):
    """FP8 E4M3 with a per-channel base scale from a sample of tokens and a power-of-two factor per block of
    `block` tokens, so that no value saturates whatever the sample missed.

    v: (..., S, D) fp32 (already smoothed); sample: (..., ns, D), rows of v. base = max(H a, H max_d a 2^-10,
    1e-20) / 448 with a = the sample's max |v| per channel and H = SAMPLED_V_HEADROOM; a block's factor c = 2^e is
    the least e >= 0 (<= 64) with max |v / base| <= 448 c over the block. Returns (e4m3(v / base / c) * c as fp32,
    base (..., 1, D)): the operand times c is exact, so a block product needs only the per-channel base after it.
    Arithmetic as the kernel's: x = v * (1 / base) in fp32, then x * 2^-e.
    """
    v = v.float()
    if sample.shape[-2]:
        a = sample.float().abs().amax(dim=-2, keepdim=True)
    else:
        a = torch.zeros(*v.shape[:-2], 1, v.shape[-1], device=v.device)
    am = a.amax(dim=-1, keepdim=True)
    base = torch.maximum(torch.maximum(SAMPLED_V_HEADROOM * a, SAMPLED_V_HEADROOM * am * SAMPLED_V_REL_FLOOR),
                         torch.full_like(a, SAMPLED_V_ABS_FLOOR)) / FP8_E4M3_MAX
    x = v * (1.0 / base)
    s = v.shape[-2]
    pad = (-s) % block
    xb = torch.nn.functional.pad(x, (0, 0, 0, pad)).reshape(*x.shape[:-2], -1, block, x.shape[-1])
    r = xb.abs().amax(dim=(-2, -1), keepdim=True)                        # (..., nblk, 1, 1)
    mant, ex = torch.frexp(r / FP8_E4M3_MAX)                              # r / 448 = mant 2^ex, mant in [0.5, 1)
    e = torch.where(mant == 0.5, ex - 1, ex)                              # ceil(log2(r / 448))
    e = torch.where(r > FP8_E4M3_MAX, e.clamp(max=SAMPLED_V_MAX_EXP), torch.zeros_like(e)).float()
    # A non-finite value would saturate to a finite 448 c: its block's factor is NaN instead, so it propagates.
    c = torch.where(torch.isfinite(r), torch.exp2(e), torch.nan)
    e = torch.where(torch.isfinite(r), e, 0.0)
    q = round_fp8_e4m3(xb * torch.exp2(-e)) * c
    return q.reshape(*x.shape[:-2], -1, x.shape[-1])[..., :s, :], base


def quantize_nvfp4(x: torch.Tensor, block: int = 16, global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """NVFP4 microscaling along the last dim: E2M1 values with one E4M3 scale per 1 x `block` group.

    global_scale (broadcastable to x without its last dim, keepdim) is the fp32 first-level scale; values are
    divided by it before microscaling, so block scales land in E4M3's range. Returns the dequantized fp32 tensor.
    The last dim is zero-padded to a multiple of `block` internally (zeros do not change a block's amax).
    """
    x = x.float()
    if global_scale is not None:
        gs = torch.where(global_scale > 0, global_scale, torch.ones_like(global_scale))
        x = x / gs
    n = x.shape[-1]
    pad = (-n) % block
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    xb = x.reshape(*x.shape[:-1], -1, block)
    s = round_fp8_e4m3(xb.abs().amax(dim=-1, keepdim=True) / FP4_E2M1_MAX)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    deq = (round_fp4_e2m1(xb / safe) * s).reshape(x.shape)[..., :n]
    if global_scale is not None:  # the raw scale: a NaN or Inf one must reach the values (0 only scales zeros)
        deq = deq * global_scale
    return deq


def nvfp4_tensor_scale(x: torch.Tensor, dims) -> torch.Tensor:
    """First-level NVFP4 scale: amax / (448 * 6) over `dims` (keepdim), so block scales fit E4M3."""
    return x.float().abs().amax(dim=dims, keepdim=True) / (FP8_E4M3_MAX * FP4_E2M1_MAX)

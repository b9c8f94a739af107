"""Number formats used by the simulations: INT8/INT4 symmetric, FP8 E4M3, FP4 E2M1 and NVFP4 microscaling.

Every function is pure (never writes its input) and computes in fp32 unless said otherwise.
"""
from __future__ import annotations

import torch

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
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    per_tok = safe.gather(-1, idx).unsqueeze(-1)
    q = torch.round(x.float() / per_tok).clamp(-qmax, qmax)
    return q, scale


def quantize_fp8_per_channel(v: torch.Tensor):
    """FP8 E4M3 with one scale per channel (amax over tokens / 448). v: (..., S, D). Returns (v8 as fp32, scale (..., 1, D))."""
    amax = v.float().abs().amax(dim=-2, keepdim=True)
    scale = amax / FP8_E4M3_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return round_fp8_e4m3(v.float() / safe), scale


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
    if global_scale is not None:
        deq = deq * gs
    return deq


def nvfp4_tensor_scale(x: torch.Tensor, dims) -> torch.Tensor:
    """First-level NVFP4 scale: amax / (448 * 6) over `dims` (keepdim), so block scales fit E4M3."""
    return x.float().abs().amax(dim=dims, keepdim=True) / (FP8_E4M3_MAX * FP4_E2M1_MAX)

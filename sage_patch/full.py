"""Full precision: torch's fused attention in the input dtype, with the project's conventions.

Conventions on top of torch SDPA: causal is aligned bottom-right when Sq != Skv, and so is a sliding window
(window_left >= 0: key j hidden from query i when j < i + Skv - Sq - window_left, the kernels' rule, taken into the
dense bool mask sage_patch.masks builds); a row with no visible key gives 0
(LSE -inf), never NaN; the natural-log LSE, when asked for, comes from the same fused pass as the output (torch's
memory-efficient kernel on CUDA, its flash kernel for CPU), not from a second attention. Layout (B, H, S, D).
"""
from __future__ import annotations

import math

import torch

from .masks import MaskInfo, combined_bool_mask
from .sdpa_semantics import mask_to_4d

# Captured at import: routing may replace torch.nn.functional.scaled_dot_product_attention while active.
torch_sdpa = torch.nn.functional.scaled_dot_product_attention

# The memory-efficient kernel's custom_mask_type: 2 = causal aligned to the bottom-right corner.
_NO_MASK, _CAUSAL_BOTTOM_RIGHT = 0, 2


def full_attention(q, k, v, *, is_causal: bool, scale, mask: MaskInfo, dropout_p: float = 0.0,
                   return_lse: bool = False, window_left: int = -1):
    """q (B, Hq, Sq, D), k (B, Hkv, Skv, D), v (B, Hkv, Skv, Dv). Returns out (B, Hq, Sq, Dv) [, lse fp32 (B, Hq, Sq)]."""
    if return_lse:
        return _attention_with_lse(q, k, v, is_causal, scale, mask, dropout_p, window_left)
    sq, skv = q.shape[-2], k.shape[-2]
    gqa = q.shape[1] != k.shape[1]
    if mask.kind == "none" and (not is_causal or sq == skv) and window_left < 0:
        return torch_sdpa(q, k, v, dropout_p=dropout_p, is_causal=is_causal and sq > 1, scale=scale, enable_gqa=gqa)
    if mask.kind == "float":
        sdpa_mask = mask.mask.to(q.dtype)
        if is_causal or window_left >= 0:
            sdpa_mask = sdpa_mask.masked_fill(~combined_bool_mask(None, is_causal, sq, skv, q.device, window_left),
                                              -math.inf)
    else:
        sdpa_mask = combined_bool_mask(mask.mask, is_causal, sq, skv, q.device, window_left)
    out = torch_sdpa(q, k, v, attn_mask=sdpa_mask, dropout_p=dropout_p, scale=scale, enable_gqa=gqa)
    return _zero_rows(out, nonempty_rows(mask, is_causal, sq, skv, q.device, window_left))


def _zero_rows(out, nonempty, lse=None):
    """Rows with no visible key give 0 (SDPA may give NaN) and LSE -inf."""
    if nonempty is None:
        return out if lse is None else (out, lse)
    out = torch.where(nonempty.unsqueeze(-1), out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out if lse is None else (out, torch.where(nonempty, lse, -math.inf))


def nonempty_rows(mask: MaskInfo, is_causal: bool, sq: int, skv: int, device, window_left: int = -1):
    """Bool broadcastable to (B, H, Sq): rows that see at least one key; None when every row does. Key-padding and
    causal rows are derived from the first visible key (with a window, from counts of visible keys), without
    building an (Sq, Skv) mask. A window alone never empties a row (the diagonal key, or the last, stays)."""
    shift = skv - sq  # bottom-right: row i sees keys j <= i + shift
    rows = torch.arange(sq, device=device)
    if mask.kind == "none":
        return (rows + shift >= 0)[None, None] if is_causal and shift < 0 else None
    if mask.kind == "key_padding" and window_left >= 0:
        # row i sees the padding's True keys in [lo, hi]: a prefix count of them at hi minus that before lo
        kp = mask.mask
        count = torch.nn.functional.pad(kp.int().cumsum(-1), (1, 0))  # count[:, n]: True keys among the first n
        hi = (rows + shift).clamp(-1, skv - 1) if is_causal else torch.full_like(rows, skv - 1)
        lo = (rows + shift - window_left).clamp(0, skv)
        return ((count[:, hi + 1] - count[:, lo] > 0) & (hi >= lo))[:, None]
    if mask.kind == "key_padding":
        kp = mask.mask
        if not is_causal:
            return kp.any(-1)[:, None, None]
        first = torch.where(kp.any(-1), kp.int().argmax(-1), skv)  # first visible key of each batch entry
        return (first[:, None] <= rows[None] + shift)[:, None]
    visible = mask.mask > -math.inf if mask.kind == "float" else mask.mask
    if is_causal or window_left >= 0:
        visible = visible & combined_bool_mask(None, is_causal, sq, skv, device, window_left)
    return visible.any(-1)


def _additive_bias(mask: MaskInfo, causal: bool, sq: int, skv: int, dtype, device, window_left: int = -1):
    """The mask (and, if `causal`, the bottom-right causal rule; the window) as an additive bias broadcastable to
    (B, H, Sq, Skv), no larger than the mask itself, its rows stored with a stride that is a multiple of 16
    elements (the fused kernels' alignment). None when nothing is masked."""
    if mask.kind == "float":
        m = mask.mask.to(dtype)
        if causal or window_left >= 0:
            m = m.masked_fill(~combined_bool_mask(None, causal, sq, skv, device, window_left), -math.inf)
    elif mask.kind != "none" or causal or window_left >= 0:
        m = combined_bool_mask(mask.mask, causal, sq, skv, device, window_left)
    else:
        return None
    m = mask_to_4d(m)
    bias = torch.zeros(*m.shape[:-1], -(-skv // 16) * 16, dtype=dtype, device=device)[..., :skv]
    return bias.masked_fill_(~m, -math.inf) if m.dtype == torch.bool else bias.copy_(m)


def _pad_last(x, d):
    return x if x.shape[-1] == d else torch.nn.functional.pad(x, (0, d - x.shape[-1]))


def _attention_with_lse(q, k, v, is_causal, scale, mask, dropout_p, window_left=-1):
    b, hq, sq, d = q.shape
    hkv, skv, dv = k.shape[1], k.shape[-2], v.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if hq != hkv:  # neither fused kernel takes GQA together with its LSE: expand the K/V heads
        k, v = (x.repeat_interleave(hq // hkv, dim=1) for x in (k, v))
    # Both kernels need one head dim for Q, K and V (the CUDA one a multiple of 8): zero channels change no score.
    dp = -(-max(d, dv) // 8) * 8 if q.is_cuda else max(d, dv)
    qp, kp, vp = _pad_last(q, dp), _pad_last(k, dp), _pad_last(v, dp)
    if q.is_cuda:
        # The kernel's own bottom-right causal rule holds for Sq <= Skv (its offset Skv - Sq is clamped at 0, so
        # taller calls take the causal rule in the bias); the bias otherwise carries only the caller's mask.
        kernel_causal = is_causal and sq <= skv
        bias = _additive_bias(mask, is_causal and not kernel_causal, sq, skv, q.dtype, q.device, window_left)
        out, lse = torch.ops.aten._efficient_attention_forward(
            qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2),
            None if bias is None else bias.expand(b, hq, sq, skv), None, None, None, None, float(dropout_p),
            _CAUSAL_BOTTOM_RIGHT if kernel_causal else _NO_MASK, True, scale=scale)[:2]
        out, lse = out.transpose(1, 2), lse[..., :sq]
    else:
        if dropout_p > 0:
            raise ValueError(f"dropout_p={dropout_p} with return_lse=True is not supported on CPU (torch's CPU "
                             "kernel that returns the LSE has no dropout); pass dropout_p=0")
        # the kernel's own causal rule is top-left
        top_left = is_causal and sq == skv and mask.kind == "none" and window_left < 0
        bias = _additive_bias(mask, is_causal and not top_left, sq, skv, q.dtype, q.device, window_left)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qp, kp, vp, 0.0, top_left, attn_mask=bias, scale=scale)
    out, lse = out[..., :dv], lse.float()
    return _zero_rows(out, nonempty_rows(mask, is_causal, sq, skv, q.device, window_left), lse)

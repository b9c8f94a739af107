"""Attention masks: validation, classification and the bottom-right causal rule, in one place.

Conventions (documented in docs/semantics.md): bool masks, True = attend. A 2-D bool mask given to `attention` is a
key-padding mask (B, Skv); anything else must broadcast to (B, H, Sq, Skv). Causal is aligned bottom-right when
Sq != Skv: query i sees keys j <= i + Skv - Sq (the rule for KV-cache prefill and decoding). A sliding window
(`window_left` >= 0, FlashAttention's window_size=(window_left, 0)) hides key j from query i when
j < i + Skv - Sq - window_left, aligned bottom-right as causal is; -1 means no window.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from .sdpa_semantics import mask_to_4d


@dataclass
class MaskInfo:
    kind: str                 # "none" | "key_padding" | "dense" | "float"
    mask: torch.Tensor | None  # key_padding: (B, Skv) bool; dense: bool 4-D broadcastable; float: 4-D additive


def classify_mask(attn_mask, b: int, h: int, sq: int, skv: int) -> MaskInfo:
    """Validate `attn_mask` and say what kind it is. Raises ValueError/TypeError naming `attn_mask`."""
    if attn_mask is None:
        return MaskInfo("none", None)
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    m = attn_mask
    if m.dtype != torch.bool and not m.is_floating_point():
        raise TypeError(f"attn_mask must be bool (True = attend) or a float additive mask, got dtype {m.dtype}")
    if m.dtype == torch.bool and m.dim() == 2:
        if tuple(m.shape) != (b, skv):
            raise ValueError(f"a 2-D bool attn_mask is a key-padding mask and must have shape (B, Skv) = "
                             f"{(b, skv)}, got {tuple(m.shape)}")
        return MaskInfo("key_padding", m)
    if m.dim() > 4:
        raise ValueError(f"attn_mask must have at most 4 dims, got shape {tuple(m.shape)}")
    m4 = mask_to_4d(m)
    try:
        torch.broadcast_shapes(m4.shape, (b, h, sq, skv))
    except RuntimeError:
        raise ValueError(f"attn_mask of shape {tuple(m.shape)} does not broadcast to (B, H, Sq, Skv) = "
                         f"{(b, h, sq, skv)}") from None
    if m4.shape[-1] != skv:
        raise ValueError(f"attn_mask's last dim must be Skv = {skv}, got shape {tuple(m.shape)}")
    if not m.dtype == torch.bool:
        return MaskInfo("float", m4)
    if m4.shape[1] == 1 and m4.shape[2] == 1 and m4.shape[0] in (1, b):
        return MaskInfo("key_padding", m4[:, 0, 0, :].expand(b, skv))
    return MaskInfo("dense", m4)


def causal_mask(sq: int, skv: int, device=None) -> torch.Tensor:
    """(Sq, Skv) bool, bottom-right aligned: query i sees keys j <= i + Skv - Sq (the window (-1, 0))."""
    return window_mask(sq, skv, -1, 0, device)


WINDOW_SIZES = "None, (-1, -1) (no window) or (left, 0) with an int left >= 0"


def window_left_of(window_size) -> int:
    """The kernels' window_left (-1: no window) of a public `window_size` (FlashAttention's semantics): None or
    (-1, -1), no window; (left, 0), int left >= 0, causal plus the `left` keys before the query's diagonal. Raises
    ValueError naming window_size, the value and the allowed values for anything else."""
    if window_size is None:
        return -1
    ok = isinstance(window_size, (tuple, list)) and len(window_size) == 2 and all(
        isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in window_size)
    if ok:
        left, right = int(window_size[0]), int(window_size[1])
        if (left, right) == (-1, -1):
            return -1
        if left >= 0 and right == 0:
            return left
    raise ValueError(f"window_size must be {WINDOW_SIZES}, got {window_size!r} (for causal attention without a "
                     f"window pass is_causal=True)")


def window_mask(sq: int, skv: int, left: int, right: int = -1, device=None, *, shift: int | None = None):
    """(Sq, Skv) bool, True = visible: FlashAttention's window_size=(left, right) (-1 = unbounded on that side),
    around the diagonal j = i + shift, by default bottom-right (shift = Skv - Sq): key j is visible from query i
    when i + shift - left <= j <= i + shift + right. (left, 0) is causal with a window; `shift=0` aligns top-left."""
    shift = skv - sq if shift is None else shift
    i = torch.arange(sq, device=device).unsqueeze(-1) + shift
    j = torch.arange(skv, device=device)
    m = j >= i - left if left >= 0 else None  # each side one (Sq, Skv) comparison; no all-True tensor to start from
    if right >= 0:
        m = j <= i + right if m is None else m & (j <= i + right)
    return torch.ones(sq, skv, dtype=torch.bool, device=device) if m is None else m


def combined_bool_mask(attn_mask, is_causal: bool, sq: int, skv: int, device=None, window_left: int = -1):
    """One bool mask broadcastable to (B, H, Sq, Skv) from a key-padding/dense bool mask, the causal flag and the
    sliding window (window_left >= 0: the kernels' rule, independent of is_causal)."""
    m = None
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool:
            raise TypeError("combined_bool_mask takes bool masks only")
        m = attn_mask[:, None, None, :] if attn_mask.dim() == 2 else attn_mask
        m = mask_to_4d(m)
    if is_causal:
        c = causal_mask(sq, skv, device)
        m = c if m is None else (m & c)
    if window_left >= 0:
        w = window_mask(sq, skv, window_left, device=device)
        m = w if m is None else (m & w)
    return m

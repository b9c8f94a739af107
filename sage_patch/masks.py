"""Attention masks: validation, classification and the bottom-right causal rule, in one place.

Conventions (documented in docs/semantics.md): bool masks, True = attend. A 2-D bool mask given to `attention` is a
key-padding mask (B, Skv); anything else must broadcast to (B, H, Sq, Skv). Causal is aligned bottom-right when
Sq != Skv: query i sees keys j <= i + Skv - Sq (the rule for KV-cache prefill and decoding). A sliding window
(`window_left` >= 0, FlashAttention's window_size=(window_left, 0)) hides key j from query i when
j < i + Skv - Sq - window_left, aligned bottom-right as causal is; -1 means no window.
"""
from __future__ import annotations

import numbers
import weakref
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


# A dense bool mask shared by the layers of one forward (diffusers' Ideogram 4 builds one block-diagonal
# segment mask per forward and hands it to all 34 blocks): what `key_padding_of_dense` found, by the mask's id, as
# (weak reference, the mask's version counter, result). An entry is dropped when its mask is freed, and not reused
# when the mask was modified in place.
_DENSE_AS_KEYS: dict = {}
_SAME_MASK = object()   # the memo's "not a key padding" result (None means "every key visible")


def _forget_dense(ref) -> None:
    for k, entry in list(_DENSE_AS_KEYS.items()):
        if entry[0] is ref:
            del _DENSE_AS_KEYS[k]


def key_padding_of_dense(mask):
    """A 4-D bool mask (B, 1, Sq, Skv) whose query rows are all equal is a key padding: returns None when every key
    is visible, the key padding (B, 1, 1, Skv) when its rows agree, or `mask` itself (a dense mask, which runs full).
    The test is one host read per mask object (diffusers' models build one mask per forward for every layer: the
    read is paid once, as transformers' sdpa_mask pays its own); under torch.compile or CUDA-graph capture, where a
    host read cannot happen, the mask stays dense. Anything else is returned unchanged."""
    if not (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1] == 1
            and mask.shape[2] > 1):
        return mask
    if torch.compiler.is_compiling() or (mask.is_cuda and torch.cuda.is_current_stream_capturing()):
        return mask
    entry = _DENSE_AS_KEYS.get(id(mask))
    if entry is not None and entry[0]() is mask and entry[1] == mask._version:
        found = entry[2]
    else:
        first = mask[:, 0, :1, :]                                        # (B, 1, Skv)
        all_visible, rows_agree = torch.stack([first.all(), (mask[:, 0] == first).all()]).tolist()
        # a copy: the memo must not keep the (B, Sq, Skv) mask's storage alive
        found = None if all_visible and rows_agree else (first[:, None].clone() if rows_agree else _SAME_MASK)
        _DENSE_AS_KEYS[id(mask)] = (weakref.ref(mask, _forget_dense), mask._version, found)
    return mask if found is _SAME_MASK else found


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

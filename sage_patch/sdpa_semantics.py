"""torch SDPA semantics, in one place: what a call of `torch.nn.functional.scaled_dot_product_attention` (or of
diffusers' `dispatch_attention_fn`) means in sage_patch's own conventions (bool True = attend, causal bottom-right,
(B, Skv) key padding).

torch's rules translated here: 3-D inputs are (B, S, D) single-head; a mask of fewer than 4 dims broadcasts from the
right against (B, H, Sq, Skv) (a 2-D mask is (Sq, Skv)); `is_causal` is aligned top-left (so for Sq != Skv it becomes
an explicit (Sq, Skv) mask); different head counts need `enable_gqa=True`; attn_mask together with is_causal is an
error. Used by `api.sdpa`, `integrations.generic.route_sdpa` and the diffusers adapter. Depends on torch only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def mask_to_4d(mask):
    """A mask of fewer than 4 dims as torch broadcasts it: from the right, (Sq, Skv) -> (1, 1, Sq, Skv)."""
    if isinstance(mask, torch.Tensor) and mask.dim() < 4:
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    return mask


def top_left_causal(sq: int, skv: int, device=None) -> torch.Tensor:
    """(1, 1, Sq, Skv) bool: torch's is_causal, query i sees keys j <= i."""
    return torch.ones(sq, skv, dtype=torch.bool, device=device).tril()[None, None]


@dataclass
class Call:
    """One attention call in sage_patch's conventions: q/k/v 4-D in `layout`, the mask and causal flag meaning what
    `sage_patch.attention` means by them. `squeeze`: the caller passed 3-D tensors (drop the head dim again)."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    layout: str
    attn_mask: torch.Tensor | None
    is_causal: bool
    squeeze: bool = False

    def finish(self, out):
        return out.squeeze(1) if self.squeeze else out


def from_torch_sdpa(query, key, value, attn_mask=None, is_causal=False, enable_gqa=False) -> Call:
    """Translate a `torch.nn.functional.scaled_dot_product_attention` call ((..., H, S, D) layout). Raises
    ValueError/TypeError where torch would, naming what the caller passed."""
    if not all(isinstance(t, torch.Tensor) for t in (query, key, value)):
        raise TypeError("query, key and value must be tensors")
    squeeze = query.dim() == 3
    if squeeze:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
    if query.dim() != 4:
        raise ValueError(f"sdpa takes 3-D or 4-D query/key/value, got query of shape {tuple(query.shape)}")
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(f"query has {query.shape[1]} heads and key {key.shape[1]}: pass enable_gqa=True for GQA")
    if attn_mask is not None and is_causal:
        raise ValueError("sdpa: pass either attn_mask or is_causal=True, not both (as torch does)")
    sq, skv = query.shape[-2], key.shape[-2]
    if isinstance(attn_mask, torch.Tensor):
        attn_mask = _checked_broadcast(attn_mask, query, key)
    if is_causal and sq != skv:  # torch aligns is_causal top-left; sage_patch's causal is bottom-right
        attn_mask, is_causal = top_left_causal(sq, skv, query.device), False
    return Call(query, key, value, "bhsd", attn_mask, bool(is_causal), squeeze)


def from_diffusers_dispatch(query, key, value, attn_mask=None, is_causal=False) -> Call:
    """Translate a diffusers `dispatch_attention_fn` call: q/k/v (B, S, H, D); a (B, Skv) mask is key padding (as
    diffusers' native backend reads it), any other mask broadcasts as torch's. Causal is as for torch (top-left)."""
    if not (isinstance(attn_mask, torch.Tensor) and attn_mask.dim() == 2
            and tuple(attn_mask.shape) == (query.shape[0], key.shape[1])):
        attn_mask = mask_to_4d(attn_mask)
    sq, skv = query.shape[1], key.shape[1]
    if is_causal and sq != skv:
        attn_mask, is_causal = top_left_causal(sq, skv, query.device), False
    return Call(query, key, value, "bshd", attn_mask, bool(is_causal))


def _checked_broadcast(attn_mask, query, key):
    """torch's rule: a mask of fewer than 4 dims broadcasts from the right against (B, H, Sq, Skv); errors name the
    shape the caller passed, not the 4-D view of it."""
    full = (query.shape[0], query.shape[1], query.shape[-2], key.shape[-2])
    try:
        if attn_mask.dim() > 4 or torch.broadcast_shapes(attn_mask.shape, full) != full:
            raise RuntimeError
    except RuntimeError:
        hint = (" (a 2-D mask is (Sq, Skv) in torch's rule; for a (B, Skv) key-padding mask pass mask[:, None, None, :]"
                " or use sage_patch.attention)" if attn_mask.dim() == 2 else "")
        raise ValueError(f"sdpa: attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to (B, H, Sq, Skv) = "
                         f"{full}{hint}") from None
    return mask_to_4d(attn_mask)

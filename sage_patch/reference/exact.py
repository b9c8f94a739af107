"""Exact attention in float64 (or float32): the ground truth every precision and kernel is measured against, the
runtime guard's check, and the transformers path for what no quantized precision honours (softcap, sinks)."""
from __future__ import annotations

import math

import torch


def exact_attention(q, k, v, *, is_causal=False, scale=None, attn_mask=None, return_lse=False,
                    dtype=torch.float64, block_q: int | None = None, softcap=None, sinks=None, dropout_p=0.0,
                    window_left: int = -1):
    """Attention computed in `dtype` (float64 by default). Layout (B, H, S, D); GQA; bool or float additive mask.

    Causal is bottom-right aligned; rows with no visible key give 0 (and LSE -inf). `softcap`: logits become
    softcap * tanh(logits / softcap) (Gemma 2) before the mask; `sinks` (Hq,): one extra logit per head that takes
    part in the softmax's denominator only (attention sinks, transformers' s_aux; the LSE includes it);
    `dropout_p`: dropout on the probabilities (training); `window_left` >= 0: the kernels' sliding window (key j hidden
    from query i when j < i + Skv - Sq - window_left; sage_patch.masks). Processes queries in blocks to bound memory. Inputs are
    never modified.
    """
    from ..masks import combined_bool_mask
    from ..sdpa_semantics import mask_to_4d

    sq, skv = q.shape[-2], k.shape[-2]
    groups = q.shape[1] // k.shape[1]
    if block_q is None:  # bound the score block to about 512 MiB
        per_row = q.shape[0] * q.shape[1] * skv * torch.finfo(dtype).bits // 8
        block_q = max(1, min(1024, (512 << 20) // max(per_row, 1)))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    kd = k.to(dtype).repeat_interleave(groups, dim=1) if groups > 1 else k.to(dtype)
    vd = v.to(dtype).repeat_interleave(groups, dim=1) if groups > 1 else v.to(dtype)
    float_mask = attn_mask if attn_mask is not None and attn_mask.dtype != torch.bool else None
    visible = combined_bool_mask(None if float_mask is not None else attn_mask, is_causal, sq, skv, q.device,
                                 window_left)
    fm = None
    if float_mask is not None:
        fm = float_mask.to(dtype)
        fm = mask_to_4d(fm)
        fm = fm.expand(*fm.shape[:-2], sq, skv)
        visible = fm > -math.inf if visible is None else visible & (fm > -math.inf)
    if visible is not None:  # broadcast the query dim before slicing rows: a (.., 1, Skv) mask holds for every row
        visible = visible.expand(*visible.shape[:-2], sq, skv)
    outs, lses = [], []
    for i0 in range(0, sq, block_q):
        i1 = min(i0 + block_q, sq)
        s = (q[..., i0:i1, :].to(dtype) @ kd.transpose(-1, -2)) * scale
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        if fm is not None:
            s = s + fm[..., i0:i1, :]
        if visible is not None:
            s = s.masked_fill(~visible[..., i0:i1, :], -math.inf)
        lse = torch.logsumexp(s, dim=-1)
        if sinks is not None:
            lse = torch.logaddexp(lse, sinks.to(dtype).reshape(1, -1, 1))
        # Empty means no visible key (a structural fact), so a NaN or Inf input still poisons its rows.
        nonempty = (visible[..., i0:i1, :].any(-1) if visible is not None
                    else torch.ones((), dtype=torch.bool, device=q.device)).expand_as(lse)
        p = torch.exp(s - torch.where(nonempty, lse, 0.0).unsqueeze(-1))
        if dropout_p > 0:
            p = torch.nn.functional.dropout(p, p=dropout_p)
        o = torch.where(nonempty.unsqueeze(-1), p @ vd, 0.0)
        outs.append(o)
        lses.append(torch.where(nonempty, lse, -math.inf))
    out = torch.cat(outs, dim=-2)
    return (out, torch.cat(lses, dim=-1).float()) if return_lse else out

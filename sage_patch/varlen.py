"""Variable-length (packed) batches, as flash-attn's varlen API: sequences concatenated along the token dim.

    out = varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, is_causal=True, precision="8b")

q (total_q, Hq, D), k/v (total_k, Hkv, D); cu_seqlens_q/k int32 (B+1) token offsets (cu[0] = 0, non-decreasing).
Sequence b attends q[cu_q[b]:cu_q[b+1]] to k/v[cu_k[b]:cu_k[b+1]], causal aligned bottom-right per sequence; empty
sequences give no NaN (rows without a visible key are 0, their LSE -inf). lse: (Hq, total_q) fp32, natural log.

Routes: `sage_patch.resolve.resolve` decides for the whole packed call (policy, speed routing, reasons, recorded in
the stats like any call); one launch of the compiled kernel it picks, or else a loop over sequences through
`sage_patch.api.run_attention` (the reference simulation on CPU, any precision; on a GPU each sequence takes the path
the resolver picks for it, recorded per sequence). Both quantize per sequence (K mean and quantization groups restart
at each sequence start), so the kernel matches the loop up to summation order.
"""
from __future__ import annotations

import math

import torch

from . import kernels
from .api import run_attention
from .masks import MaskInfo
from .precisions import check_precision
from .report import GLOBAL_STATS, log_fallback_once
from .resolve import Varlen, resolve

__all__ = ["varlen_attention"]


def _validate(q, k, v, cu_q, cu_k):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor (total, H, D), got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k and v must have the same tokens and heads, got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k head dims differ: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"q heads must be a positive multiple of k/v heads (GQA), got q {q.shape[1]}, k/v {k.shape[1]}")
    for name, c in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if not isinstance(c, torch.Tensor) or c.dim() != 1 or c.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be a 1-D int32 or int64 tensor, got "
                             f"{tuple(c.shape) + (c.dtype,) if isinstance(c, torch.Tensor) else type(c).__name__}")
    if cu_q.shape != cu_k.shape or cu_q.shape[0] < 2:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must both have B+1 >= 2 entries")


def _check_offsets(name, cu: list[int], total: int) -> None:
    if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])) or cu[-1] > total:
        raise ValueError(f"{name} must start at 0, be non-decreasing and end <= {total}, got {cu}")


def _reference_loop(q, k, v, cu_q, cu_k, *, is_causal, scale, precision, return_lse):
    """The per-sequence loop through run_attention (the ground truth of the kernel path)."""
    cq, ck = [int(x) for x in cu_q.tolist()], [int(x) for x in cu_k.tolist()]
    _check_offsets("cu_seqlens_q", cq, q.shape[0])
    _check_offsets("cu_seqlens_k", ck, k.shape[0])
    out = q.new_zeros(*q.shape[:-1], v.shape[-1])  # the output has V's head dim
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf, device=q.device, dtype=torch.float32)
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if q1 == q0 or k1 == k0:  # no query, or no key: rows stay 0 and -inf
            continue
        res = run_attention(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], layout="bshd", is_causal=is_causal,
                            scale=scale, precision=precision, return_lse=return_lse)
        o, l = res if return_lse else (res, None)
        out[q0:q1] = o[0].to(out.dtype)
        if l is not None:
            lse[:, q0:q1] = l[0].float()
    return (out, lse) if return_lse else out


def _max_len(cu: torch.Tensor) -> int:
    return int((cu[1:] - cu[:-1]).max().item()) if cu.shape[0] > 1 else 0  # one host sync


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None, is_causal=False,
                     scale=None, precision="8b", return_lse=False):
    """Attention over packed variable-length sequences; returns out (total_q, Hq, D) [, lse (Hq, total_q)].

    max_seqlen_q/k: the longest sequence of each (as flash-attn); None computes them (one host synchronization).
    On the kernel path they must be >= every sequence's length.
    """
    check_precision(precision)
    _validate(q, k, v, cu_seqlens_q, cu_seqlens_k)
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise ValueError(f"scale must be a finite number, got {scale!r}")
    if q.is_cuda and precision in kernels.QK_BITS:
        cu_q, cu_k = cu_seqlens_q, cu_seqlens_k
        if cu_q.dtype != torch.int32:
            cu_q, cu_k = cu_q.int(), cu_k.int()
        mq = _max_len(cu_q) if max_seqlen_q is None else int(max_seqlen_q)
        mk = _max_len(cu_k) if max_seqlen_k is None else int(max_seqlen_k)
        decision = resolve(precision, q, k, v, layout="varlen", is_causal=bool(is_causal), mask=MaskInfo("none", None),
                           dropout_p=0.0, return_lse=return_lse, smooth_v=False, varlen=Varlen(cu_q, cu_k, mq, mk))
        if decision.path == "kernel":  # else the loop below records each sequence's own decision
            GLOBAL_STATS.record(decision)
            if decision.reason and not torch.compiler.is_compiling():
                log_fallback_once(decision.reason)
            return kernels.run_varlen(decision.variant, decision.precision, q, k, v, cu_q, cu_k, mq, mk,
                                      is_causal=is_causal, scale=scale, return_lse=return_lse)
    return _reference_loop(q, k, v, cu_seqlens_q, cu_seqlens_k, is_causal=is_causal, scale=scale,
                           precision=precision, return_lse=return_lse)

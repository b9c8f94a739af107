"""Public attention entry points: `attention`, the SDPA drop-in `sdpa`, and the familiar `sageattn`."""
from __future__ import annotations

import math

import torch

from . import kernels, layer_scope
from .full import full_attention
from .masks import classify_mask, window_left_of, window_mask
from .precisions import check_precision
from .reference import exact_attention, simulate
from .report import GLOBAL_STATS, log_fallback_once
from .resolve import Decision, resolve
from .sdpa_semantics import from_torch_sdpa
from .trainable import sagebwd_attention

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def attention(q, k, v, *, layout="bhsd", is_causal=False, scale=None, attn_mask=None, precision="8b",
              return_lse=False, smooth_v=False, window_size=None, sinks=None):
    """Attention with a SageAttention-family precision.

    q (B, Hq, Sq, D) and k, v (B, Hkv, Skv, D) for layout "bhsd"; (B, S, H, D) for "bshd". Hq must be a multiple
    of Hkv (GQA/MQA). Causal is aligned bottom-right when Sq != Skv: query i sees keys j <= i + Skv - Sq.
    attn_mask: bool, True = attend: (B, Skv) key padding, or broadcastable to (B, Hq, Sq, Skv); a float additive
    mask runs in full precision (reported). Rows with no visible key give 0.
    window_size: FlashAttention's sliding window. None or (-1, -1): none. (left, 0), int left >= 0: query i sees
    keys i + Skv - Sq - left <= j <= i + Skv - Sq (bottom-right, as causal here); as in FlashAttention this window is
    causal by itself, so is_causal=False gives the same result as is_causal=True. Combines with attn_mask. Any other
    value raises ValueError.
    sinks: attention sinks (gpt-oss's s_aux), a floating-point (Hq,) tensor on q's device: one logit per query
    head, natural-log and not multiplied by `scale`, that joins each row's softmax denominator only (no value).
    Every precision runs them: out = out_without_sinks * sigmoid(lse - sinks[h]), lse that of the real scores.
    Returns the output in the input layout and dtype; with return_lse also the natural-log LSE, fp32 (B, Hq, Sq)
    (with sinks, the LSE of the whole denominator, sink included).
    """
    left = window_left_of(window_size)
    if left >= 0 and isinstance(is_causal, bool):  # (left, 0) is causal by itself (a non-bool is refused below)
        is_causal = True
    return run_attention(q, k, v, layout=layout, is_causal=is_causal, scale=scale, attn_mask=attn_mask,
                         precision=precision, return_lse=return_lse, smooth_v=smooth_v, window_left=left,
                         sinks=sinks)


def run_attention(q, k, v, *, layout="bhsd", is_causal=False, scale=None, attn_mask=None, precision="8b",
                  return_lse=False, smooth_v=False, dropout_p=0.0, policy=None, stats=None, full=None,
                  window_left=-1, sinks=None):
    """`attention` plus what routed layers need: dropout, the policy's fallback rules, per-layer stats.
    full: a call that runs full precision (resolver impl "sdpa", no LSE) returns `full()` instead: an adapter's
    own function called as its library calls it (transformers' sdpa_attention_forward, the model's own torch SDPA
    call), so that a fallback costs only the decision (same mask object, GQA handling, contiguity and SDPA backend
    as without sage_patch); with a window, `full` must apply it too, and with `sinks` it must apply them itself
    (transformers' eager function of a model with sinks does). It returns the output in `layout`, of the input dtype.
    It may name what it runs in attributes `impl` and `reason`: the report then counts the call under that
    implementation, with that reason.
    window_left: the kernels' sliding window (sage_patch.masks; -1 none): key j is hidden from query i when
    j < i + Skv - Sq - window_left, whatever is_causal says (`attention`'s window_size adds causal).
    sinks: as in `attention`; applied to whatever ran (kernel, reference simulation or full precision) from its
    LSE, so every path computes the real scores only."""
    check_precision(precision)
    q, k, v = _autocast(q, k, v)
    b, hq, sq, skv = _validate(q, k, v, layout, scale, is_causal, dropout_p)
    if isinstance(window_left, bool) or not isinstance(window_left, int) or window_left < -1:
        raise ValueError(f"window_left must be an int >= -1 (-1: no window), got {window_left!r}")
    if sinks is not None:
        check_sinks(sinks, hq, q.device)
    mask = classify_mask(attn_mask, b, hq, sq, skv)
    if mask.mask is not None and mask.mask.device != q.device:
        raise ValueError(f"attn_mask is on {mask.mask.device} but q is on {q.device}")
    want_lse = return_lse or sinks is not None  # sinks are applied from the LSE
    decision = resolve(precision, q, k, v, layout=layout, is_causal=bool(is_causal), mask=mask,
                       dropout_p=dropout_p, return_lse=want_lse, smooth_v=smooth_v, policy=policy,
                       window_left=window_left)
    path = decision.path  # what runs the call: the one thing dispatched on below
    use_full = path == "sdpa" and full is not None and not return_lse
    if use_full and getattr(full, "impl", None):
        reason = "; ".join(r for r in (decision.reason, getattr(full, "reason", None)) if r) or None
        decision = Decision(decision.requested, decision.precision, full.impl, reason, path="sdpa")
    (stats or GLOBAL_STATS).record(decision)
    if decision.reason and not torch.compiler.is_compiling():
        log_fallback_once(decision.reason)

    if use_full:
        return full()
    if path != "kernel":
        qb, kb, vb = (x.transpose(1, 2) for x in (q, k, v)) if layout == "bshd" else (q, k, v)
        if path in ("training-kernel", "training-reference"):  # the resolver sends no LSE call (hence no sinks) here
            out = sagebwd_attention(qb, kb, vb, is_causal=bool(is_causal), scale=scale, attn_mask=mask.mask,
                                    kernel=decision.variant.key if path == "training-kernel" else False)
            return out.transpose(1, 2) if layout == "bshd" else out
        if path == "sdpa" and sinks is not None and (
                (dropout_p > 0 and not q.is_cuda) or (torch.is_grad_enabled() and (
                    q.requires_grad or k.requires_grad or v.requires_grad))):
            # The fused kernels' LSE has no gradient (the sigmoid correction would drop d lse), and the CPU one
            # has no dropout: exact attention with the sinks in its softmax, differentiable, in fp32.
            res = exact_attention(qb, kb, vb, is_causal=bool(is_causal), scale=scale, attn_mask=mask.mask,
                                  return_lse=return_lse, dtype=torch.float32, sinks=sinks, dropout_p=dropout_p,
                                  window_left=window_left)
            sinks = None  # applied
        elif path == "sdpa":
            res = full_attention(qb, kb, vb, is_causal=bool(is_causal), scale=scale, mask=mask,
                                 dropout_p=dropout_p, return_lse=want_lse, window_left=window_left)
        else:  # "reference": the kernels' numerics; a head dim they lack natively is simulated zero-padded
            def sim(q_, k_, v_, scale_):
                res = simulate(q_, k_, v_, decision.precision, is_causal=bool(is_causal), scale=scale_,
                               attn_mask=mask.mask, return_lse=want_lse, smooth_v=smooth_v, window_left=window_left)
                return res if want_lse else (res, None)

            out, lse = kernels.head_dims.padded(sim, qb, kb, vb, scale)
            res = (out, lse) if want_lse else out
        out, lse = res if (return_lse or sinks is not None) else (res, None)
        out = out.transpose(1, 2) if layout == "bshd" else out
    else:
        kmask = mask.mask if mask.kind == "key_padding" else None
        res = kernels.run(decision.variant, decision.precision, q, k, v, layout=layout, is_causal=bool(is_causal),
                          scale=scale, attn_mask=kmask, return_lse=want_lse, smooth_v=smooth_v,
                          window_left=window_left)
        out, lse = res if want_lse else (res, None)
    if sinks is not None:
        out, lse = apply_sinks(out, lse, sinks, layout)
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out


def check_sinks(sinks, hq: int, device) -> None:
    """Attention sinks must be a floating-point (Hq,) tensor on q's device (one logit per query head)."""
    allowed = (f"a floating-point tensor of shape (Hq,) = ({hq},) on q's device ({device}): one logit per query "
               f"head (natural-log, not multiplied by scale), or None")
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be {allowed}; got {type(sinks).__name__}")
    if tuple(sinks.shape) != (hq,) or not sinks.is_floating_point() or sinks.device != device:
        raise ValueError(f"sinks must be {allowed}; got shape {tuple(sinks.shape)}, dtype {sinks.dtype}, "
                         f"device {sinks.device}")


def apply_sinks(out, lse, sinks, layout: str):
    """Attention sinks from an attention's output and natural-log LSE of its real scores (the one place they are
    computed): a sink adds exp(sinks[h]) to each row's softmax denominator, so every probability, hence the output,
    scales by exp(lse) / (exp(lse) + exp(sinks[h])) = sigmoid(lse - sinks[h]) (exact; a row with no visible key,
    lse -inf, gives 0, as the sink-only softmax does). Elementwise, so it traces under torch.compile. Returns the
    output (its dtype, scaled in fp32 or wider) and the LSE of the whole denominator (lse's dtype, (B, Hq, Sq);
    -inf stays -inf: a row with no visible key keeps the project's LSE of an empty row, as exact_attention's)."""
    wide = torch.promote_types(torch.promote_types(out.dtype, lse.dtype), torch.float32)
    s = sinks.to(wide)[:, None]
    factor = torch.sigmoid(lse.to(wide) - s)
    factor = factor.transpose(1, 2) if layout == "bshd" else factor
    lse_all = torch.where(lse == -math.inf, lse.to(wide), torch.logaddexp(lse.to(wide), s))
    return (out.to(wide) * factor[..., None]).to(out.dtype), lse_all.to(lse.dtype)


def _autocast(q, k, v):
    """Under torch.autocast torch's SDPA (an autocast op of lower precision) runs in the autocast dtype, whatever the
    float dtypes it is given, mixed ones too (a model's RoPE in fp32 beside a bf16 V, as Llama's under bf16 autocast
    hands them): the same here. Outside autocast the inputs are taken as they are (and must share one dtype)."""
    if not isinstance(q, torch.Tensor) or not torch.is_autocast_enabled(q.device.type):
        return q, k, v
    dt = torch.get_autocast_dtype(q.device.type)
    return tuple(t.to(dt) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in (q, k, v))


def _validate(q, k, v, layout, scale, is_causal, dropout_p):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D ({'B, H, S, D' if layout == 'bhsd' else 'B, S, H, D'}), "
                             f"got shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} dtype must be float16, bfloat16 or float32, got {t.dtype}")
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    hd = 1 if layout == "bhsd" else 2
    sd = 2 if layout == "bhsd" else 1
    qs, ks, vs = q.shape, k.shape, v.shape  # read once: each .shape access builds a new torch.Size
    b, hq, sq, d = qs[0], qs[hd], qs[sd], qs[-1]
    hkv, skv = ks[hd], ks[sd]
    if ks[0] != b or vs[0] != b:
        raise ValueError(f"batch sizes differ: q {b}, k {ks[0]}, v {vs[0]}")
    if vs[hd] != hkv or vs[sd] != skv:
        raise ValueError(f"k and v must have the same heads and length, got k {tuple(ks)}, v {tuple(vs)}")
    if b < 1 or hq < 1 or hkv < 1:
        raise ValueError(f"batch and head counts must be >= 1, got B={b}, q heads {hq}, k/v heads {hkv} "
                         f"(q {tuple(qs)}, k {tuple(ks)}, layout {layout!r})")
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv}) for GQA/MQA")
    if ks[-1] != d:
        raise ValueError(f"q and k head dims differ: {d} vs {ks[-1]}")
    if not (1 <= d <= MAX_HEAD_DIM) or not (1 <= vs[-1] <= MAX_HEAD_DIM):
        raise ValueError(f"head dim must be in 1..{MAX_HEAD_DIM}, got q/k {d}, v {vs[-1]}")
    if sq < 1 or skv < 1:
        raise ValueError(f"sequence lengths must be >= 1, got Sq={sq}, Skv={skv}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale)):
        raise ValueError(f"scale must be None or a finite number, got {scale!r}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if not (0.0 <= dropout_p < 1.0):
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    return b, hq, sq, skv


def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
         precision=None, window_size=None):
    """Drop-in for torch.nn.functional.scaled_dot_product_attention, with torch's semantics (sdpa_semantics): (..., H,
    S, D) layout, 2-D masks broadcast as (Sq, Skv), is_causal aligned top-left as torch does. dropout_p > 0 runs in
    full precision. precision None means: inside a routed layer's forward (route_sdpa, inject, a diffusers or
    transformers adapter), that layer's attention (its policy, stats, guard), found through `layer_scope`; else "8b".
    window_size (keyword only; torch has none): None or (-1, -1), no window; (left, 0), int left >= 0, a causal
    sliding window aligned top-left like this function's is_causal: query i sees keys i - left <= j <= i. It is
    causal by itself (is_causal=False gives the same result) and may be combined with attn_mask (both apply). With
    Sq == Skv it runs on the kernels' window; with Sq != Skv top-left has no kernel rule and it becomes an explicit
    mask, as torch's own is_causal does here (full precision, reported). Any other value raises ValueError.
    """
    left = window_left_of(window_size)
    call = from_torch_sdpa(query, key, value, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa)
    window_left = _sdpa_window(call, left)
    layer = layer_scope.current() if precision is None else None
    if layer is not None:
        out = layer.attention(call.q, call.k, call.v, layout=call.layout, is_causal=call.is_causal, scale=scale,
                              attn_mask=call.attn_mask, dropout_p=dropout_p, window_left=window_left)
    else:
        out = run_attention(call.q, call.k, call.v, layout=call.layout, is_causal=call.is_causal, scale=scale,
                            attn_mask=call.attn_mask, precision=precision or "8b", dropout_p=dropout_p,
                            window_left=window_left)
    return call.finish(out)


def _sdpa_window(call, left: int) -> int:
    """Apply `sdpa`'s top-left window of `left` keys to `call` (a sdpa_semantics.Call, modified); returns the
    kernels' window_left for it (-1 where it became part of the mask, or there is none)."""
    if left < 0:
        return -1
    sq, skv = call.q.shape[-2], call.k.shape[-2]
    if sq == skv:  # top-left and bottom-right coincide: the kernels' window, causal
        call.is_causal = True
        return left
    w = window_mask(sq, skv, left, 0, call.q.device, shift=0)[None, None]
    m = call.attn_mask  # None, bool, or float additive (torch's is_causal was already made a mask for Sq != Skv)
    call.attn_mask = w if m is None else (m & w) if m.dtype == torch.bool else torch.where(w, m, -math.inf)
    call.is_causal = False
    return -1


def sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, return_lse=False, *, attn_mask=None,
             precision="8b", smooth_v=False, window_size=None):
    """The signature users of the public `sageattention` package know. tensor_layout "HND" = (B, H, S, D),
    "NHD" = (B, S, H, D). Unlike the public package, causal is bottom-right aligned, LSE is natural-log, and
    no argument is silently dropped (unknown keywords raise TypeError). window_size: as in `attention`
    (FlashAttention's (left, 0), bottom-right, causal by itself)."""
    layouts = {"HND": "bhsd", "NHD": "bshd"}
    if tensor_layout not in layouts:
        raise ValueError(f"tensor_layout must be 'HND' or 'NHD', got {tensor_layout!r}")
    return attention(q, k, v, layout=layouts[tensor_layout], is_causal=is_causal, scale=sm_scale,
                     attn_mask=attn_mask, precision=precision, return_lse=return_lse, smooth_v=smooth_v,
                     window_size=window_size)

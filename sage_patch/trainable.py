"""The trainable 8b attention (SageBwd) through autograd: two torch.library custom ops over a training variant's GPU
kernels (registry.KernelVariant with trains=True, launched by its `launch` module, e.g. sage_patch.kernels.sagebwd;
`kernel=` its key) or the reference simulation (sage_patch.reference.sagebwd, `kernel=""`), with fake
implementations so torch.compile(fullgraph=True) traces a training step, and their autograd formula.

    sage_patch::sagebwd_fwd  (q, k, v, ...) -> out, lse, and what the backward needs (INT8 Q^/K^ and block scales,
                              the smoothed scores' LSE); out doubles as the O the backward reads (input dtype)
    sage_patch::sagebwd_bwd  (dout, saved ...) -> dq, dk, dv in the input dtype

Layout (B, H, S, D). The output is differentiable; the LSE is not (the resolver runs return_lse calls that need a
gradient in full precision). Double backward raises: the backward is not itself differentiable.
"""
from __future__ import annotations

import importlib
import math
from typing import Optional, Tuple

import torch

from .kernels.sagebwd import KERNEL_LAYOUT
from .reference.sagebwd import DEFAULT_SAGEBWD_CONFIG, SageBwdConfig, SageBwdSaved, sagebwd_backward, sagebwd_forward

# What the Triton GPU kernels compute, as the simulation's config (the CPU default is the same:
# tests/test_training.py); kernel_config(key) is any training variant's
KERNEL_CONFIG = SageBwdConfig(**KERNEL_LAYOUT)


def _launch(key: str):
    """The module that launches training variant `key` (its forward, backward and KERNEL_LAYOUT)."""
    from .kernels import registry

    variant = registry.BY_KEY.get(key)
    if variant is None or not variant.trains:
        raise ValueError(f"kernel={key!r} is not a training kernel; allowed: the keys of the variants that train "
                         f"{[v.key for v in registry.VARIANTS if v.trains]}, True, False or None")
    return importlib.import_module(variant.launch)


def kernel_config(key: str) -> SageBwdConfig:
    """The numerics of training variant `key`, as the reference simulation's config (it simulates them exactly)."""
    return SageBwdConfig(**_launch(key).KERNEL_LAYOUT)

DOUBLE_BACKWARD_ERROR = (
    "sage_patch: double backward (a gradient of a gradient, e.g. create_graph=True followed by a second backward) "
    "through the trainable 8b attention (SageBwd) is not supported: its backward pass is not differentiable. Run "
    "these layers in full precision (precision='full', or policy key 'training: full')")


def _cdiv(a, b):
    return (a + b - 1) // b


@torch.library.custom_op("sage_patch::sagebwd_fwd", mutates_args=())
def sagebwd_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor],
                is_causal: bool, scale: float, groups: str, block_q: int, block_k: int, smooth_k: bool, dp: str,
                p_scale: str, pv: str, kernel: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                     torch.Tensor, torch.Tensor, torch.Tensor]:
    """SageBwd training forward. Returns (out (B, Hq, Sq, Dv) in q's dtype, lse fp32 (B, Hq, Sq), lse of the
    smoothed scores, q_int int8, q_scale, k_int int8, k_scale); attn_mask: bool (B, Skv) or broadcastable 4-D
    (the kernel: (B, Skv) only). kernel: a training variant's registry key, or "" for the reference simulation."""
    if kernel:
        return _launch(kernel).forward(q, k, v, is_causal=is_causal, scale=scale, key_padding_mask=attn_mask,
                                       smooth_k=smooth_k)
    cfg = SageBwdConfig(groups, block_q, block_k, smooth_k, dp, p_scale, pv)
    out, lse, s = sagebwd_forward(q, k, v, is_causal=is_causal, scale=scale, attn_mask=attn_mask, config=cfg)
    # contiguous, as the fake implementation says (elementwise ops keep a transposed input's strides)
    lse = lse.clone() if lse is s.lse else lse  # without K smoothing they are one tensor; an op's outputs may not alias
    return tuple(t.contiguous() for t in (s.out, lse, s.lse, s.q_int, s.q_scale, s.k_int, s.k_scale))


@sagebwd_fwd.register_fake
def _(q, k, v, attn_mask, is_causal, scale, groups, block_q, block_k, smooth_k, dp, p_scale, pv, kernel):
    b, hq, sq, _ = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    f32 = torch.float32
    tq, tk = (sq, skv) if groups == "token" else (_cdiv(sq, block_q), _cdiv(skv, block_k))
    return (q.new_empty((b, hq, sq, v.shape[3])), q.new_empty((b, hq, sq), dtype=f32),
            q.new_empty((b, hq, sq), dtype=f32), q.new_empty(q.shape, dtype=torch.int8),
            q.new_empty((b, hq, tq), dtype=f32), k.new_empty(k.shape, dtype=torch.int8),
            k.new_empty((b, hkv, tk), dtype=f32))


@torch.library.custom_op("sage_patch::sagebwd_bwd", mutates_args=())
def sagebwd_bwd(dout: torch.Tensor, q_int: torch.Tensor, q_scale: torch.Tensor, k_int: torch.Tensor,
                k_scale: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse_smoothed: torch.Tensor,
                attn_mask: Optional[torch.Tensor], is_causal: bool, scale: float, groups: str, block_q: int,
                block_k: int, smooth_k: bool, dp: str, p_scale: str, pv: str,
                kernel: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SageBwd backward from what sagebwd_fwd saved. Returns (dq, dk, dv) in the input dtype (v's)."""
    if kernel:
        return _launch(kernel).backward(dout, q_int, q_scale, k_int, k_scale, v, out, lse_smoothed, is_causal=is_causal,
                                scale=scale, key_padding_mask=attn_mask)
    cfg = SageBwdConfig(groups, block_q, block_k, smooth_k, dp, p_scale, pv)
    saved = SageBwdSaved(q_int, q_scale, k_int, k_scale, v, out, lse_smoothed, attn_mask, is_causal, scale, cfg)
    dq, dk, dv = sagebwd_backward(dout, saved)
    return tuple(t.to(v.dtype).contiguous() for t in (dq, dk, dv))


@sagebwd_bwd.register_fake
def _(dout, q_int, q_scale, k_int, k_scale, v, out, lse_smoothed, attn_mask, is_causal, scale, groups, block_q,
      block_k, smooth_k, dp, p_scale, pv, kernel):
    return v.new_empty(q_int.shape), v.new_empty(k_int.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, attn_mask, *args = inputs
    out, _, lse_s, q_int, q_scale, k_int, k_scale = output
    # only out is differentiable, and autograd must not materialize zero gradients for the others: it would allocate
    # them (the INT8 Q^ and K^ are as large as half of Q and K) before the backward runs, raising its peak memory
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q_int, q_scale, k_int, k_scale, v, out, lse_s, attn_mask)
    ctx.args = tuple(args)  # is_causal, scale, groups, block_q, block_k, smooth_k, dp, p_scale, pv, kernel


def _backward(ctx, dout, *unused_grads):
    no_grads = (None,) * (1 + len(ctx.args))   # attn_mask and the non-tensor arguments
    if dout is None:  # no gradient reached the output (grads are not materialized)
        return (None, None, None) + no_grads
    q_int, q_scale, k_int, k_scale, v, out, lse_s, attn_mask = ctx.saved_tensors
    dq, dk, dv = torch.ops.sage_patch.sagebwd_bwd(dout, q_int, q_scale, k_int, k_scale, v, out, lse_s, attn_mask,
                                                  *ctx.args)
    return (dq, dk, dv) + no_grads


def _no_double_backward(ctx, *grads):
    raise RuntimeError(DOUBLE_BACKWARD_ERROR)


def _bwd_setup_context(ctx, inputs, output):
    pass


sagebwd_fwd.register_autograd(_backward, setup_context=_setup_context)
sagebwd_bwd.register_autograd(_no_double_backward, setup_context=_bwd_setup_context)


def sagebwd_attention(q, k, v, *, is_causal: bool, scale, attn_mask, config: SageBwdConfig | None = None,
                      kernel: bool | str | None = None):
    """Trainable 8b attention, (B, H, S, D) layout: the output (q's dtype) of sage_patch::sagebwd_fwd, differentiable
    through sage_patch::sagebwd_bwd. attn_mask: None or bool, (B, Skv) key padding or broadcastable 4-D (the kernel:
    key padding only). kernel: a training variant's registry key (e.g. "sagebwd-triton"; numerics:
    kernel_config(key), `config` must be None or that), True = the training variant that serves this call here
    (kernels.can_run_training, no speed routing; an error says why none does), False = the reference simulation;
    None = True for CUDA tensors."""
    kernel = q.is_cuda if kernel is None else kernel
    if kernel is True:
        from . import kernels

        variant, why = kernels.can_run_training(q, k, v, layout="bhsd", attn_mask=attn_mask)
        if variant is None:
            raise ValueError(f"kernel=True: no training kernel serves this call: {why}")
        kernel = variant.key
    if kernel:
        kcfg = kernel_config(kernel)
        if config not in (None, kcfg):
            raise ValueError(f"config={config!r}: the {kernel} kernels compute {kcfg!r} only (kernel=False runs the "
                             f"reference simulation of any config)")
        if attn_mask is not None and attn_mask.dim() != 2:
            raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)}: the SageBwd kernels take a (B, Skv) key "
                             f"padding mask only")
        config = kcfg
    cfg = DEFAULT_SAGEBWD_CONFIG if config is None else config
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return torch.ops.sage_patch.sagebwd_fwd(q, k, v, attn_mask, bool(is_causal), scale, cfg.groups, cfg.block_q,
                                            cfg.block_k, cfg.smooth_k, cfg.dp, cfg.p_scale, cfg.pv,
                                            kernel or "")[0]

"""Context parallelism (diffusers' Ulysses and ring attention) for layers routed by the diffusers adapter: each rank
runs the layer's own attention (policy, stats, report) on its shard, inside diffusers' distributed engine.

diffusers' `enable_parallelism` gives every context-parallel-aware processor a `_parallel_config`; the processor passes
it to `dispatch_attention_fn`, whose backend hands the call to `_templated_context_parallel_attention` with a
per-backend forward op (the all-to-all of Ulysses, the K/V rotation and LSE merge of ring attention, both for
unified). A routed layer's dispatcher call (`diffusers._routed_backend`) comes here and calls the same template with
`forward_op`, which runs the layer's attention on what this rank holds (Ulysses: the whole sequence for its share of
the heads; ring: its queries against one K/V chunk at a time, with the LSE the merge needs, (B, S, H) as diffusers'
ops return it). The communication is diffusers' own; nothing is copied from it.

What stays with diffusers' backend (its own forward op, full precision, reported): calls that need a gradient
(sage_patch's quantized paths are forward-only, so `backward_op` is never reached and raises if it is), calls with
extra attention_kwargs, and "full" layers under Ulysses alone (bit-identical to not enabling sage). Under ring
attention "full" layers run `forward_op` at full precision (torch SDPA with its LSE): diffusers' default "native"
backend has no LSE and refuses ring attention, and its ring applies the local mask to every chunk (below).

Masks under ring attention: the template passes the rank's local key mask unchanged to every K/V chunk, which is
right only for the rank's own chunk. For the chunk of ring step i the mask of that chunk is needed: `forward_op`
gathers the local masks over the context-parallel mesh once per call (chunk order = the flattened (ring, ulysses)
rank order, as diffusers' sharder splits the sequence) and takes the rows of the ring step's chunk (ring step i
holds the K/V of ring rank (rank + i) mod ring_degree, as `TemplatedRingAttention` rotates them). A call with a mask
under ring attention that needs a gradient raises instead of running diffusers' wrong answer.

`check_model(model)`: under context parallelism every routed layer must be context-parallel aware (its processor
has `_parallel_config`), unless a shipped plan (`cp_plans`) declares the layer's input replicated on every rank;
SD3/SD3.5 (`JointAttnProcessor2_0`) and CogVideoX call torch's SDPA on the rank's shard and would be silently wrong,
so they raise, naming the model class.
"""
from __future__ import annotations

import functools

import torch

from sage_patch import layer_scope

# Set by cp_plans on a model whose shipped plan keeps some attention layers' inputs replicated: {layer name glob}.
REPLICATED_ATTR = "_sage_patch_cp_replicated"
_CHECKED_ATTR = "_sage_patch_cp_checked"   # the ParallelConfig check_model last accepted


def context_config(parallel_config):
    """The ContextParallelConfig of a dispatcher call's `_parallel_config`, or None."""
    return getattr(parallel_config, "context_parallel_config", None)


def describe(cp) -> str:
    """The report's note for a call run under `cp` on this rank."""
    return _note(cp.ulysses_degree, cp.ring_degree, cp._rank, cp._world_size)


# Fixed per config: torch.compile takes the note as a constant, not an f-string. Called with the config's ints, which
# dynamo makes constants (torch 2.11's dynamo cannot hand the config object itself to such a function).
@torch.compiler.assume_constant_result
def _note(ulysses: int, ring: int, rank: int, world_size: int) -> str:
    return f"context parallel (ulysses {ulysses} x ring {ring}) on rank {rank} of {world_size}"


# ---- the model check -------------------------------------------------------------------------------------------

def check_model(model, layers) -> None:
    """Raise ValueError if `model` runs under context parallelism with a routed attention layer that would see only
    this rank's shard without knowing it. `layers`: (name, module) of the routed layers. Cached per config."""
    pc = getattr(model, "_parallel_config", None)
    if context_config(pc) is None or getattr(model, _CHECKED_ATTR, None) is pc:
        return
    import fnmatch

    replicated = getattr(model, REPLICATED_ATTR, ())
    blind = [f"{name} ({type(mod.processor).__name__})" for name, mod in layers
             if not hasattr(mod.processor, "_parallel_config")
             and not any(fnmatch.fnmatchcase(name, g) for g in replicated)]
    if blind:
        raise ValueError(
            f"sage_patch: {type(model).__name__} is not supported under context parallelism: its attention "
            f"processors call torch's SDPA on each rank's shard of the sequence without a parallel config, so the "
            f"result would be wrong ({len(blind)} layer(s), e.g. {blind[0]}). Models whose processors pass "
            f"`parallel_config` to diffusers' dispatcher are supported (Flux, HunyuanVideo via "
            f"sage_patch.integrations.cp_plans.enable_parallelism, and the others diffusers ships a _cp_plan for)")
    object.__setattr__(model, _CHECKED_ATTR, pc)


def check_on_forward(model, layers_of) -> torch.utils.hooks.RemovableHandle:
    """A forward pre-hook on `model` that runs `check_model` (for enable_parallelism called after enabling sage).
    `layers_of(model)`: its routed layers now. Cheap when the model is not parallel (one attribute read)."""
    def pre(mod, _args):
        if context_config(getattr(mod, "_parallel_config", None)) is not None:
            check_model(mod, layers_of(mod))
    return model.register_forward_pre_hook(pre)


# ---- one dispatcher call -----------------------------------------------------------------------------------------

def routed_call(layer, original, kw: dict, keeps: str | None):
    """A dispatcher call with a `_parallel_config`, made inside routed layer `layer`. `original`: diffusers' backend;
    `keeps`: why the adapter leaves the call to it (or None)."""
    pc = kw["_parallel_config"]
    cp = context_config(pc)
    if cp is None:   # tensor parallelism only: processors are not given a config then; nothing to distribute here
        return _passthrough(layer, original, kw, "parallel config without context parallelism", None)
    note = describe(cp)
    q, k, v, mask = kw["query"], kw["key"], kw["value"], kw.get("attn_mask")
    ring, ring_mask = cp.ring_degree > 1, cp.ring_degree > 1 and mask is not None
    why = keeps
    if why is None and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        why = "autograd under context parallelism: sage_patch's attention is forward-only"
    if why is not None:
        if ring_mask:
            raise ValueError(f"sage_patch: layer {layer.name}: {why}, and diffusers' ring attention would apply this "
                             f"rank's local attn_mask to every rank's K/V chunk (a wrong result). Run this call "
                             f"without gradients, or use ulysses_degree instead of ring_degree with a mask")
        return _passthrough(layer, original, kw, f"{why}: diffusers' dispatcher runs it (full)", note)
    if layer.passes_full() and not ring:
        return _passthrough(layer, original, kw, None, note)
    _check_heads(q, k, cp)
    fwd = functools.partial(_forward_op, layer=layer, context=note)
    from diffusers.models.attention_dispatch import _templated_context_parallel_attention

    return _templated_context_parallel_attention(
        q, k, v, mask, kw.get("dropout_p", 0.0), kw.get("is_causal", False), kw.get("scale"),
        kw.get("enable_gqa", False), False, forward_op=fwd, backward_op=_backward_op, _parallel_config=pc)


def _passthrough(layer, original, kw, reason, note):
    layer.record_passthrough("diffusers-dispatch", reason, note)
    layer_scope.enter(None)   # the backend's own torch SDPA call is not a second routed call
    try:
        return original(**kw)
    finally:
        layer_scope.leave()


def _check_heads(q, k, cp) -> None:
    """Ulysses splits the heads: a head count it does not divide would fail in a reshape with no hint of why."""
    u = cp.ulysses_degree
    if u > 1 and not cp.ulysses_anything:
        for what, t in (("query", q), ("key/value", k)):
            if t.shape[2] % u:
                raise ValueError(f"ulysses_degree={u} must divide the number of attention heads; {what} has "
                                 f"{t.shape[2]} (q/k/v (B, S, H, D) {tuple(t.shape)}). Choose a ulysses_degree "
                                 f"that divides it, use ring_degree, or ulysses_anything=True")


def _forward_op(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False, return_lse=False, _save_ctx=True, _parallel_config=None, *, layer, context):
    """diffusers' forward-op contract (q/k/v (B, S, H, D)), running `layer`'s attention; returns out, or (out, lse)
    with lse fp32 (B, S, H) natural log. Counted once per dispatcher call: ring steps after the first are not."""
    cp = _parallel_config.context_parallel_config
    step = getattr(ctx, "_sage_ring_step", -1) + 1   # the ring template calls this once per K/V chunk, same ctx
    ctx._sage_ring_step = step
    if attn_mask is not None and cp.ring_degree > 1:
        attn_mask = _ring_chunk_mask(ctx, attn_mask, key.shape[1], step, cp)
    res = layer.run(query, key, value, layout="bshd", is_causal=bool(is_causal), scale=scale, attn_mask=attn_mask,
                    dropout_p=dropout_p, return_lse=return_lse, record=step == 0, context=context)
    if not return_lse:
        return res
    out, lse = res
    return out, lse.transpose(1, 2)   # (B, H, S) -> (B, S, H), the layout the templates reshape and merge


def _backward_op(ctx, grad_out, *args, **kwargs):
    raise RuntimeError("sage_patch: the context-parallel forward op of a routed layer has no backward; calls that "
                       "need a gradient are run by diffusers' own backend. Reaching this is a bug: please report it")


def _ring_chunk_mask(ctx, mask, skv: int, step: int, cp):
    """The key mask of the K/V chunk of ring step `step` (see the module docstring)."""
    if cp.ring_anything:
        raise ValueError("ring_anything does not take an attn_mask (diffusers refuses it too)")
    u = cp.ulysses_degree
    if mask.shape[-1] * u != skv:
        raise ValueError(f"under ring attention the attn_mask must cover this rank's local sequence: last dim "
                         f"{mask.shape[-1]} x ulysses_degree {u} != the K/V chunk length {skv}")
    if step == 0:
        from diffusers.hooks.context_parallel import EquipartitionSharder

        # every rank's local mask, in the flattened (ring, ulysses) order the sequence was split in
        wire = mask.to(torch.uint8) if mask.dtype == torch.bool else mask   # bool as bytes: every backend has them
        gathered = EquipartitionSharder.unshard(wire, mask.dim() - 1, cp._flattened_mesh)
        ctx._sage_ring_masks = gathered.to(mask.dtype).chunk(cp.ring_degree, dim=-1)
    return ctx._sage_ring_masks[(cp._ring_local_rank + step) % cp.ring_degree]

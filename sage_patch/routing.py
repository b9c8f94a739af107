"""Routing of attention calls from model layers through sage_patch, under a policy: the layer half of every adapter.

Adapters (the generic SDPA one here, transformers' and diffusers' in sage_patch.integrations) pick their modules with
`select_modules`, bind each to a `LayerBinding` with `attach` (name, index, policy, stats, shared step state; removed
by `detach`), and call `binding.attention(...)`; a call that goes elsewhere is recorded by `binding.record_fallback`.
`route_sdpa(model, policy)` is the generic mechanism: while active, every
`torch.nn.functional.scaled_dot_product_attention` call made inside one of the model's attention modules runs
through sage_patch with that layer's precision.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import re
import warnings
from dataclasses import dataclass

import torch

from .api import run_attention
from .guard import Guard
from .policy import Policy
from .report import STATS_ATTR, LayerStats, log_fallback_once
from .resolve import Decision
from .sdpa_semantics import from_torch_sdpa

logger = logging.getLogger("sage_patch")

BINDING_ATTR = "_sage_patch_binding"  # attribute holding a LayerBinding on each routed attention module

_current: contextvars.ContextVar["LayerBinding | None"] = contextvars.ContextVar("sage_patch_layer", default=None)


@dataclass
class StepState:
    """Denoising step shared by all layers of one model or pipeline (None outside a diffusion loop)."""
    step: int | None = None
    num_steps: int | None = None


class LayerBinding:
    """One attention layer's routing state. `observer`, when set (calibration), sees every call's q/k/v."""

    def __init__(self, name: str, index: int | None, policy: Policy, stats: LayerStats | None = None,
                 steps: StepState | None = None):
        self.name, self.index, self.policy = name, index, policy
        self.stats = stats or LayerStats(name)
        self.steps = steps or StepState()
        self.guard = Guard()
        self.observer = None

    def requested(self) -> str:
        """The policy's precision for this layer at the current step, after any runtime-guard demotion."""
        return self.guard.effective(
            self.policy.precision_for(self.name, self.index, self.steps.step, self.steps.num_steps))

    def attention(self, q, k, v, *, layout="bhsd", is_causal=False, scale=None, attn_mask=None, dropout_p=0.0,
                  return_lse=False):
        precision = self.requested()
        call = {"layout": layout, "is_causal": is_causal, "scale": scale, "attn_mask": attn_mask}
        if self.observer is not None:
            self.observer(self, q, k, v, call)
        res = run_attention(q, k, v, **call, precision=precision, return_lse=return_lse,
                            smooth_v=self.policy.smooth_v, dropout_p=dropout_p, policy=self.policy, stats=self.stats)
        if self.policy.guard_every:
            self.guard.after_call(self, precision, q, k, v, call, res[0] if return_lse else res)
        return res


    def record_fallback(self, impl: str, reason: str | None = None) -> None:
        """Record a call that this layer sent to `impl` in full precision instead of sage_patch's attention (the one
        way adapters report their own fallbacks); a reason is logged once per process."""
        self.stats.record(Decision(self.requested(), "full", impl, reason))
        if reason and not torch.compiler.is_compiling():
            log_fallback_once(reason)


def attach(module: torch.nn.Module, name: str, policy: Policy, steps: StepState | None = None,
           index: int | None = None) -> LayerBinding:
    """Bind `module` as layer `name` (a binding already there keeps its stats, guard and observer, and takes the new
    name and policy; otherwise the module's stats, if any, are kept). index None: from the name (layer_index)."""
    index = layer_index(name) if index is None else index
    b = getattr(module, BINDING_ATTR, None)
    if isinstance(b, LayerBinding):
        b.name, b.index, b.policy, b.stats.name = name, index, policy, name
        if steps is not None:
            b.steps = steps
    else:
        stats = getattr(module, STATS_ATTR, None)
        b = LayerBinding(name, index, policy, stats if isinstance(stats, LayerStats) else None, steps)
        b.stats.name = name
        setattr(module, BINDING_ATTR, b)
    setattr(module, STATS_ATTR, b.stats)
    return b


def detach(module: torch.nn.Module) -> None:
    """Undo `attach`: the module loses its binding and stats."""
    for attr in (BINDING_ATTR, STATS_ATTR):
        if attr in module.__dict__:
            delattr(module, attr)


def select_modules(model: torch.nn.Module, is_target) -> list:
    """The one module selector: (name, module) of every named sub-module accepted by `is_target(name, module)`,
    in named_modules order (the names policies match)."""
    return [(n, m) for n, m in model.named_modules() if n and is_target(n, m)]


def layer_index(name: str) -> int | None:
    """The block index in a module name ('model.layers.3.self_attn' -> 3; last number wins), or None."""
    nums = re.findall(r"\.(\d+)(?:\.|$)", name)
    return int(nums[-1]) if nums else None


ATTENTION_CLASS_SUFFIXES = ("Attention", "SelfAttention")


def is_attention_module(name: str, module: torch.nn.Module) -> bool:
    """The default `select` of route_sdpa: the module's class name ends in one of ATTENTION_CLASS_SUFFIXES."""
    return type(module).__name__.endswith(ATTENTION_CLASS_SUFFIXES)


def _nothing_selected(model: torch.nn.Module, select) -> None:
    """route_sdpa found no module to route: warn (logger and warnings), naming what it looked for and the
    modules that look like attention by name, so the caller can pass `select=`. A warning, not an error: the
    context manager stays a no-op on a model without attention, as it always was."""
    if select is is_attention_module:
        looked_for = f"module classes whose name ends in {' or '.join(repr(x) for x in ATTENTION_CLASS_SUFFIXES)}"
    else:
        looked_for = f"modules accepted by select={getattr(select, '__qualname__', repr(select))}"
    candidates = sorted({f"{n} ({type(m).__name__})" for n, m in model.named_modules()
                         if n and re.search(r"attn|attention", f"{n}.{type(m).__name__}", re.I)})
    hint = (f"; modules that look like attention: {', '.join(candidates[:5])}"
            f"{' ...' if len(candidates) > 5 else ''}") if candidates else ""
    msg = (f"sage_patch.route_sdpa: no module of {type(model).__name__} matched ({looked_for}), so no "
           f"attention call is routed{hint}; pass select=lambda name, module: ... to choose them")
    logger.warning(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=4)


@contextlib.contextmanager
def route_sdpa(model: torch.nn.Module, policy=None, *, select=is_attention_module):
    """Send every F.scaled_dot_product_attention call made inside `model`'s attention modules through
    sage_patch under `policy` (path, dict, Policy, precision name or None). Calls outside those modules are
    untouched. Restores everything on exit. Yields the dict of bindings by module name."""
    pol = Policy.from_any(policy)
    bindings, handles = {}, []
    steps = StepState()
    for name, mod in select_modules(model, select):
        b = bindings[name] = attach(mod, name, pol, steps)
        tokens = []

        def pre(_m, _args, b=b, tokens=tokens):
            tokens.append(_current.set(b))

        def post(_m, _args, _out, tokens=tokens):
            if tokens:
                _current.reset(tokens.pop())

        handles.append(mod.register_forward_pre_hook(pre))
        handles.append(mod.register_forward_hook(post, always_call=True))

    if not bindings:
        _nothing_selected(model, select)
    original = torch.nn.functional.scaled_dot_product_attention

    def routed(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        b = _current.get()
        if b is None:
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa)
        call = from_torch_sdpa(query, key, value, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa)
        return call.finish(b.attention(call.q, call.k, call.v, layout=call.layout, is_causal=call.is_causal,
                                       scale=scale, attn_mask=call.attn_mask, dropout_p=dropout_p))

    torch.nn.functional.scaled_dot_product_attention = routed
    try:
        yield bindings
    finally:
        torch.nn.functional.scaled_dot_product_attention = original
        for h in handles:
            h.remove()
        for name, mod in model.named_modules():
            if name in bindings and getattr(mod, BINDING_ATTR, None) is bindings[name]:
                delattr(mod, BINDING_ATTR)  # the stats stay: the report of a routed run outlives the run

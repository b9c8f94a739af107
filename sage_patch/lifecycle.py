"""One lifecycle for every mechanism, the PEFT way: `inject(model, policy)` routes a model's attention layers
through sage_patch, `unload(model)` restores exactly what was there.

The adapter is chosen by what the object is, one per mechanism:
- diffusers models and pipelines: `integrations.diffusers` (each attention module is the ambient layer while its
  forward runs, as in route_sdpa; processors are untouched; see there why);
- transformers models: `integrations.transformers` (the "sage" AttentionInterface; unload switches back to the
  implementation the model had, "sdpa" for one built with "sage");
- anything else: the generic SDPA adapter (`integrations.generic.route_sdpa`, kept open until unload; unload models in reverse
  order of injection, as nested `with` blocks would).
Every adapter selects modules with `binding.select_modules`, binds them with `binding.attach` (the policy is the
given one, or the family default from sage_patch/configs/families.yaml) and records its own fallbacks with
`LayerBinding.record_fallback`. `report`, `bindings_of` and `set_policy` go through the same adapters.
"""
from __future__ import annotations

import sys

import torch

from .report import Report, _modules_of
from .report import report as _collect
from .binding import BINDING_ATTR, LayerBinding
from .integrations.generic import GenericSdpa

def _library_adapter(obj):
    """The transformers or diffusers adapter for `obj`, or None. Only a library already imported is asked."""
    for lib in ("diffusers", "transformers"):
        if lib in sys.modules:
            from importlib import import_module

            adapter = import_module(f"sage_patch.integrations.{lib}")
            if adapter.handles(obj):
                return adapter
    return None


def adapter_for(obj):
    return _library_adapter(obj) or GenericSdpa


def family_policy(obj):
    """The policy `inject(obj)` uses when none is given (the family default, sage_patch/configs/families.yaml)."""
    return adapter_for(obj).family_policy(obj)


def inject(model, policy=None):
    """Route `model`'s attention (an nn.Module or a diffusers pipeline) through sage_patch under `policy` (a path,
    dict, YAML string, Policy or precision name; None: the family default). Injecting again changes the policy.
    Returns `model`."""
    adapter_for(model).inject(model, policy)
    return model


def unload(model):
    """Undo `inject` (or `attn_implementation="sage"`, or `enable_sage_attention()`): the model's attention runs
    exactly as it would without sage_patch. Returns `model`."""
    if GenericSdpa.holds(model):
        GenericSdpa.unload(model)
    else:
        adapter_for(model).unload(model)
    return model


def set_policy(obj, policy) -> None:
    """Set the attention policy of a transformers model, or of a diffusers model or pipeline. Runtime-guard
    demotions made under the previous policy are cleared (the report keeps them and notes that they were)."""
    if hasattr(obj, "enable_sage_attention"):
        obj.enable_sage_attention(policy=policy)
        return
    from .integrations import transformers as hf

    hf.set_policy(obj, policy)


def _sync(obj) -> None:
    """Let each adapter bind what it binds lazily (transformers models built with attn_implementation="sage")."""
    if "transformers" not in sys.modules:
        return
    from .integrations import transformers as hf

    for _prefix, module in _modules_of(obj):
        if hf.handles(module):
            hf.sync(module)


def report(obj=None) -> Report:
    """Report of a model (nn.Module), a diffusers pipeline (its module components), or, with no argument,
    of direct calls made outside any routed layer. Counts accumulate until `reset_report(obj)` (or `unload`).

    Counting rule, the same for transformers, diffusers and route_sdpa models: in eager mode every call is counted.
    Under torch.compile, a call that sage_patch's attention runs (a quantized layer: one opaque op in the graph) is
    counted each time it runs; a call traced into the graph (a "full" layer handing the call to torch's or the
    library's own attention, a call that needs a gradient, a fallback such as softcap) is counted once per
    compilation, when it is traced, since the compiled graph runs it without Python."""
    if obj is not None:
        _sync(obj)
    return _collect(obj)


def reset_report(obj=None) -> None:
    """Zero the counts `report(obj)` shows (every layer of a model or pipeline; with no argument, the direct
    calls'). Bindings, policies and runtime-guard demotions are unchanged."""
    for st in report(obj).layers.values():
        st.reset()


def bindings_of(obj) -> dict[str, LayerBinding]:
    """Every LayerBinding of a model or pipeline, by full module name."""
    _sync(obj)
    out = {}
    for prefix, module in _modules_of(obj):
        for name, sub in module.named_modules():
            b = getattr(sub, BINDING_ATTR, None)
            if isinstance(b, LayerBinding):
                out[f"{prefix}.{name}" if prefix and name else (prefix or name)] = b
    return out

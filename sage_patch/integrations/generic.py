"""The generic adapter, for any nn.Module: `route_sdpa(model, policy)` sends every F.scaled_dot_product_attention
call made inside the model's attention modules through sage_patch (the ambient-layer binding of `binding`), and
`GenericSdpa` holds one open between `inject` and `unload` (sage_patch.lifecycle)."""
from __future__ import annotations

import contextlib
import re
import warnings

import torch

from sage_patch.binding import (BINDING_ATTR, RECOGNISERS, SDPA, StepState, attach, detach, enter_on_forward,
                                select_modules, warn_unmatched_rules)
from sage_patch.policy import Policy


def _nothing_selected(model: torch.nn.Module, select) -> None:
    """route_sdpa found no module to route: warn (a RuntimeWarning only, so the user sees it once), naming what it
    looked for and the modules that look like attention by name, so the caller can pass `select=`. A warning, not
    an error: the context manager stays a no-op on a model without attention, as it always was."""
    if select is None:
        looked_for = RECOGNISERS["sdpa"].describe()
    elif callable(select):
        looked_for = f"modules accepted by select={getattr(select, '__qualname__', repr(select))}"
    else:
        looked_for = f"attention modules named {select!r}"
    candidates = sorted({f"{n} ({type(m).__name__})" for n, m in model.named_modules()
                         if n and re.search(r"attn|attention", f"{n}.{type(m).__name__}", re.I)})
    hint = (f"; modules that look like attention: {', '.join(candidates[:5])}"
            f"{' ...' if len(candidates) > 5 else ''}") if candidates else ""
    msg = (f"sage_patch.route_sdpa: no module of {type(model).__name__} matched ({looked_for}), so no "
           f"attention call is routed{hint}; pass select=lambda name, module: ... to choose them")
    warnings.warn(msg, RuntimeWarning, stacklevel=4)


@contextlib.contextmanager
def route_sdpa(model: torch.nn.Module, policy=None, *, select=None):
    """Send every F.scaled_dot_product_attention call made inside `model`'s attention modules through
    sage_patch under `policy` (path, dict, Policy, precision name or None). Calls outside those modules are
    untouched. `select`: which modules (select_modules' `targets`: None, globs, or (name, module) -> bool).
    Restores everything on exit. Yields the dict of bindings by module name."""
    pol = Policy.from_any(policy)
    steps = StepState()
    bindings, handles = {}, []
    for name, mod in select_modules(model, "sdpa", select):
        bindings[name] = attach(mod, name, pol, steps)
        handles += enter_on_forward(mod, bindings[name])
    if not bindings:
        _nothing_selected(model, select)
    warn_unmatched_rules(pol, bindings.values(), type(model).__name__)
    SDPA.acquire()
    try:
        yield bindings
    finally:
        SDPA.release()
        for h in handles:
            h.remove()
        for name, mod in model.named_modules():
            if name in bindings and getattr(mod, BINDING_ATTR, None) is bindings[name]:
                delattr(mod, BINDING_ATTR)  # the stats stay: the report of a routed run outlives the run


_ROUTE_ATTR = "_sage_patch_route"  # the open route_sdpa context of a model injected with the generic adapter


class GenericSdpa:
    """The generic adapter: route_sdpa, held open between inject and unload."""

    @staticmethod
    def family_policy(model) -> Policy:
        """The policy `inject(model)` uses when none is given: 8b everywhere, no fallback rules."""
        return Policy.from_any("8b")

    @staticmethod
    def inject(model, policy=None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"sage_patch.inject takes an nn.Module or a diffusers pipeline; got {type(model).__name__}")
        GenericSdpa.unload(model)
        ctx = route_sdpa(model, policy if policy is not None else GenericSdpa.family_policy(model))
        model.__dict__[_ROUTE_ATTR] = (ctx, list(ctx.__enter__()))

    @staticmethod
    def holds(model) -> bool:
        return isinstance(model, torch.nn.Module) and _ROUTE_ATTR in model.__dict__

    @staticmethod
    def unload(model):
        held = model.__dict__.pop(_ROUTE_ATTR, None) if isinstance(model, torch.nn.Module) else None
        if held is not None:
            held[0].__exit__(None, None, None)
            for name in held[1]:
                detach(model.get_submodule(name))

    @staticmethod
    def sync(model):
        pass

"""diffusers integration: `pipe.enable_sage_attention(policy=None)` / `model.enable_sage_attention(...)`.

How it works (the ambient-layer binding of `integrations.generic.route_sdpa`, nothing per processor):

- Every attention module of the denoiser (one with an attention processor, e.g. `transformer_blocks.3.attn`) is
  bound to a `LayerBinding` (name, policy, stats, step) and becomes the ambient layer while its forward runs
  (`binding.enter_on_forward`). Processors are not touched: whatever processor the layer has, or diffusers sets
  later (IP-Adapter load/unload, `set_attn_processor`), is called as diffusers calls it, and its attention call
  finds the layer.
- The processor's attention call arrives in one of two places, both process-wide pass-throughs while any model is
  enabled (reference-counted `binding.Interposer`s, restored by the last disable): torch's
  `F.scaled_dot_product_attention` (SD3/SD3.5 `JointAttnProcessor2_0`, `CogVideoXAttnProcessor2_0`,
  `AttnProcessor2_0`), replaced by `binding.routed_sdpa`; and the functions of diffusers' attention backend
  registry, which `dispatch_attention_fn` looks up per call (Flux, HunyuanVideo, most new models), each wrapped by
  `_routed_backend`. A call outside an enabled layer goes to the original unchanged.
- Layers whose precision is "full" (by policy or step rule) call the original function with the original arguments,
  so diffusers' `set_attention_backend(...)` / `attention_backend(...)` choice still applies to them and "full" is
  bit-identical to not enabling sage. Calls with attention_kwargs also go to the original (the report says so). A
  quantized layer sees the arguments the dispatcher passes to the selected backend.
- Context parallelism (`model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=..., ring_degree=...))`,
  before or after enabling sage): a dispatcher call with a `_parallel_config` runs diffusers' own Ulysses / ring
  template with a forward op that is the layer's attention on this rank's shard (with the LSE ring attention
  merges), see `diffusers_parallel`. Each rank's report counts the calls it ran, with a note naming the degrees and
  the rank. Calls that need a gradient stay with diffusers' backend; models whose processors call torch's SDPA on
  the shard without a parallel config (SD3/SD3.5, CogVideoX) are refused with an error naming the class, when
  enabling or at the first forward. HunyuanVideo has no diffusers plan: `cp_plans.enable_parallelism(model, config)`
  applies the one shipped here.
- A processor whose `__call__` does not itself call SDPA or the dispatcher (e.g. the classic `AttnProcessor` with
  `baddbmm`) is not bound and is listed in `sage_skipped(model)` with the reason (decided when enabling).
- Under torch.compile (fullgraph) the hooks, the pass-throughs and the binding's cached precision are traced; a
  quantized call is one opaque custom op (`LayerBinding.run`), counted when it runs. The precision is refreshed
  when the denoising step changes, so a recompile happens only when the pattern of precisions changes, never per
  step. "full" calls are traced as diffusers traces them and are not counted under compile (they are in eager).
- Denoising steps (for `steps:` rules) are counted by the pipeline, not by callbacks: `scheduler.set_timesteps`
  starts a loop (step 0; num_steps from the timesteps), `scheduler.set_begin_index` (img2img strength) shortens it,
  and each `scheduler.step(...)` call advances it. The pipeline class's `__call__` is wrapped (pass-through for
  pipelines without sage) so that a scheduler swapped after enabling is hooked too, and so that after the call
  the step is cleared. A custom loop can call `set_step(model_or_pipe, step, num_steps)`.
- `disable_sage_attention()` removes the hooks and bindings (and the pass-throughs, with the last enabled model).
  Enabling twice only updates the policy.

Why this design and not the alternatives. Cloning each processor's `__call__` with its globals rewritten per layer
(synthetic `sys.modules` entries, behind a proxy processor that must pass for the wrapped class: isinstance,
`__class__()`, copy, signature, and a `set_processor` hook per layer) gives the same behaviour (exact enable/disable,
compile fullgraph, CPU offload, LoRA, IP-Adapter, `set_attention_backend`; tests/test_diffusers_integration.py) in
about 830 lines against this design's 530, and touches the processors; the price here is two documented process-wide
pass-throughs while a model is enabled. Registering a "sage" backend in diffusers' own registry
(`set_attention_backend`) was weighed too: its names are a closed Enum, it would take over the user's backend choice
for full layers, and processors that call torch's SDPA directly (SD3, CogVideoX) never reach it.

Lifecycle (sage_patch.inject/unload call these): `enable(model, policy)`, `disable(model)`, `enable_pipeline(pipe,
policy, components=..., include_vae=...)`, `disable_pipeline(pipe)`; also `set_step(obj, step, num_steps)`,
`sage_skipped(model)`, `is_enabled(obj)`. `install()` adds the two methods to ModelMixin and DiffusionPipeline;
`uninstall()` removes them and restores every pipeline class `__call__` that enabling wrapped.
"""
from __future__ import annotations

import functools
import inspect
import logging
import types
import weakref

import torch

from sage_patch import layer_scope
from sage_patch.integrations import diffusers_parallel
from sage_patch.policy import Policy, default_policy
from sage_patch.binding import (BINDING_ATTR, SDPA, Interposer, LayerBinding, Recogniser, StepState, attach,
                                detach, enter_on_forward, register_recogniser, select_modules, warn_unmatched_rules)
from sage_patch.masks import key_padding_of_dense
from sage_patch.sdpa_semantics import from_diffusers_dispatch

logger = logging.getLogger("sage_patch")

_STATE_ATTR = "_sage_patch_diffusers"       # _ModelState on an enabled model
_PIPE_ATTR = "_sage_patch_diffusers_pipe"   # _PipeState on an enabled pipeline
_CALL_WRAPPED = "_sage_patch_call_wrapped"  # marker on a pipeline class whose __call__ we wrapped

LIBRARY = "diffusers"
# An attention module is one with an attention processor (diffusers' attn_processors order).
register_recogniser(LIBRARY, Recogniser(attributes=("get_processor", "set_processor", "processor")))


def default_policy_for(model) -> Policy:
    """The family default (sage_patch/configs/families.yaml) for the model's class."""
    return default_policy(LIBRARY, model)


# ---- step tracking -------------------------------------------------------------------------------------------

class StepTracker:
    """The denoising step shared by all denoisers of one pipeline (or one model), and the bindings to refresh."""

    def __init__(self):
        self.state = StepState()
        self._bindings: list[weakref.ref] = []

    def add(self, binding: LayerBinding) -> None:
        if not any(r() is binding for r in self._bindings):
            self._bindings.append(weakref.ref(binding))

    def set(self, step, num_steps=None) -> None:
        self.state.step = step
        self.state.num_steps = num_steps
        self.refresh()

    def advance(self) -> None:
        if self.state.step is not None:
            self.set(self.state.step + 1, self.state.num_steps)

    def refresh(self) -> None:
        self._bindings = [r for r in self._bindings if r() is not None]
        for r in self._bindings:
            r().refresh()


def set_step(obj, step: int | None, num_steps: int | None = None) -> None:
    """Set the denoising step for a custom loop (pipelines count steps themselves). None clears it."""
    tracker = _tracker_of(obj)
    if tracker is None:
        raise ValueError("sage attention is not enabled on this object")
    tracker.set(step, num_steps)


def _tracker_of(obj):
    ps = getattr(obj, _PIPE_ATTR, None) if not isinstance(obj, torch.nn.Module) else None
    if ps is not None:
        return ps.tracker
    st = getattr(obj, _STATE_ATTR, None)
    return st.tracker if st is not None else None


# ---- diffusers' dispatcher ------------------------------------------------------------------------------------

# What dispatch_attention_fn passes to a backend besides the entries of attention_kwargs.
_DISPATCH_ARGS = frozenset({"query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa",
                            "_parallel_config"})


def _dispatcher_keeps(kw: dict) -> str | None:
    """Why a dispatcher call inside a routed layer stays with diffusers' backend, or None."""
    extra = sorted(set(kw) - _DISPATCH_ARGS)
    if extra:
        return f"attention_kwargs {extra}: diffusers' dispatcher runs it (full)"
    if kw["query"].shape[2] != kw["key"].shape[2] and not kw.get("enable_gqa", False):
        return "head counts differ without enable_gqa: diffusers' dispatcher runs it (full)"
    if kw.get("attn_mask") is not None and kw.get("is_causal", False):
        return "attn_mask together with is_causal: diffusers' dispatcher runs it (full)"
    return None


def _routed_backend(original):
    """A registered attention backend of diffusers, routed: inside an enabled layer, that layer's attention (q/k/v
    (B, S, H, D)); a "full" layer, or a call sage_patch leaves to diffusers, the backend itself."""
    def backend(**kw):
        layer = layer_scope.current()
        if not isinstance(layer, LayerBinding):
            return original(**kw)
        if kw.get("_parallel_config") is not None:   # context parallelism: diffusers' engine, our attention per rank
            return diffusers_parallel.routed_call(layer, original, kw, _dispatcher_keeps(kw))
        full = layer.passes_full()
        why = None if full else _dispatcher_keeps(kw)
        if full or why is not None:
            layer.record_passthrough("diffusers-dispatch", why)
            layer_scope.enter(None)   # the backend's own torch SDPA call is not a second routed call
            try:
                return original(**kw)
            finally:
                layer_scope.leave()
        call = from_diffusers_dispatch(kw["query"], kw["key"], kw["value"], attn_mask=kw.get("attn_mask"),
                                       is_causal=kw.get("is_causal", False))
        # a per-forward dense mask that only pads keys (Ideogram 4's segment mask of unpacked samples) runs the kernel
        mask = key_padding_of_dense(call.attn_mask)
        return layer.run(call.q, call.k, call.v, layout=call.layout, is_causal=call.is_causal, scale=kw.get("scale"),
                         attn_mask=mask, dropout_p=kw.get("dropout_p", 0.0))

    backend.sage_original = original
    return backend


def _wrap_backends() -> None:
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry as registry

    for name, fn in list(registry._backends.items()):
        if not hasattr(fn, "sage_original"):
            registry._backends[name] = _routed_backend(fn)


def _unwrap_backends() -> None:
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry as registry

    for name, fn in list(registry._backends.items()):
        if hasattr(fn, "sage_original"):
            registry._backends[name] = fn.sage_original


DISPATCH = Interposer(_wrap_backends, _unwrap_backends)


# ---- model level ---------------------------------------------------------------------------------------------

def _not_routable(proc) -> str | None:
    """Why a layer with processor `proc` cannot be routed (its own __call__ must call torch's SDPA or diffusers'
    dispatcher by name), or None."""
    call = getattr(type(proc), "__call__", None)
    if isinstance(proc, torch.nn.Module) and call is torch.nn.Module.__call__:
        call = getattr(type(proc), "forward", None)
    if not isinstance(call, types.FunctionType):
        return f"{type(proc).__name__}: no Python __call__ to route"
    if {"scaled_dot_product_attention", "dispatch_attention_fn"}.isdisjoint(call.__code__.co_names):
        return (f"{type(proc).__name__}.__call__ calls neither F.scaled_dot_product_attention "
                f"nor dispatch_attention_fn directly: left as is")
    return None


def _release_interposers() -> None:
    SDPA.release()
    DISPATCH.release()


def _routed_layers(model) -> list:
    """(name, module) of the model's attention layers that are bound now."""
    return [(n, m) for n, m in select_modules(model, LIBRARY) if isinstance(getattr(m, BINDING_ATTR, None), LayerBinding)]


class _ModelState:
    def __init__(self, model, policy: Policy, tracker: StepTracker):
        self.policy = policy
        self.tracker = tracker
        self.hooks: dict[str, list] = {}         # layer name -> its forward hook handles
        self.skipped: dict[str, str] = {}        # layer name -> why it is not routed
        # enable_parallelism called after enabling: checked when the model runs
        self.cp_check = diffusers_parallel.check_on_forward(model, _routed_layers)
        SDPA.acquire()
        DISPATCH.acquire()
        self.release = weakref.finalize(model, _release_interposers)   # also if the model is freed while enabled


def _unbind(st: _ModelState, name: str, mod) -> None:
    for h in st.hooks.pop(name, ()):
        h.remove()
    detach(mod)


def enable(model, policy=None, *, tracker: StepTracker | None = None, check_rules: bool = True) -> dict:
    """Route every attention layer of a diffusers model through sage_patch. Returns {layer name: LayerBinding}.
    Enabling again updates the policy (and re-decides which layers can be routed). `check_rules`: warn about
    layer rules matching no layer (enable_pipeline checks them over all its components instead)."""
    pol = Policy.from_any(policy) if policy is not None else default_policy_for(model)
    # enabling on a model already context-parallel: refuse before binding anything
    diffusers_parallel.check_model(model, [(n, m) for n, m in select_modules(model, LIBRARY)
                                           if not _not_routable(m.processor)])
    st: _ModelState | None = getattr(model, _STATE_ATTR, None)
    if st is None:
        st = _ModelState(model, pol, tracker or StepTracker())
        object.__setattr__(model, _STATE_ATTR, st)
    else:
        st.policy = pol
        st.tracker = tracker or st.tracker
    bindings = {}
    for name, mod in select_modules(model, LIBRARY):
        why = _not_routable(mod.processor)
        if why:
            st.skipped[name] = why
            _unbind(st, name, mod)
            continue
        st.skipped.pop(name, None)
        b = bindings[name] = attach(mod, name, pol, st.tracker.state)
        st.tracker.add(b)
        if name not in st.hooks:
            st.hooks[name] = enter_on_forward(mod, b)
    if check_rules:
        warn_unmatched_rules(pol, bindings.values(), type(model).__name__)
    if st.skipped:
        logger.info("sage_patch: %d attention layer(s) of %s not routed: %s", len(st.skipped),
                    type(model).__name__, "; ".join(f"{k}: {v}" for k, v in list(st.skipped.items())[:3]))
    return bindings


def disable(model) -> None:
    """Remove every layer's hooks, binding and stats; processors were never touched."""
    st: _ModelState | None = getattr(model, _STATE_ATTR, None)
    if st is None:
        return
    for name, mod in select_modules(model, LIBRARY):
        _unbind(st, name, mod)
    st.cp_check.remove()
    st.release()
    object.__delattr__(model, _STATE_ATTR)


def sage_skipped(model) -> dict:
    """{layer name: reason} for attention layers that enable() could not route."""
    st = getattr(model, _STATE_ATTR, None)
    return dict(st.skipped) if st is not None else {}


def is_enabled(obj) -> bool:
    if isinstance(obj, torch.nn.Module):
        return getattr(obj, _STATE_ATTR, None) is not None
    return getattr(obj, _PIPE_ATTR, None) is not None


# ---- pipeline level ------------------------------------------------------------------------------------------

_VAE_WORDS = ("Autoencoder", "VQModel", "VAE", "Vae")


def denoiser_components(pipe, include_vae: bool = False) -> dict:
    """The pipeline's diffusers models that take part in denoising (transformer(s), unet(s), controlnets,
    priors); VAEs only with include_vae."""
    from diffusers import ModelMixin

    out = {}
    for key, comp in pipe.components.items():
        comp = getattr(comp, "_orig_mod", comp)   # pipe.transformer = torch.compile(pipe.transformer)
        if not isinstance(comp, ModelMixin):
            continue
        is_vae = key.startswith("vae") or any(w in type(comp).__name__ for w in _VAE_WORDS)
        if is_vae and not include_vae:
            continue
        out[key] = comp
    return out


class _PipeState:
    def __init__(self, tracker: StepTracker, components: tuple[str, ...]):
        self.tracker = tracker
        self.components = components
        self.scheduler = None      # the scheduler object whose methods we hooked
        self.depth = 0             # nested pipeline __call__s


def _main_denoiser(comps: dict):
    for key in ("transformer", "unet", "prior", "decoder"):
        if key in comps:
            return comps[key]
    return next(iter(comps.values()), None)


def family_policy(obj) -> Policy:
    """The policy enabling `obj` (a diffusers model or pipeline) with policy=None uses."""
    if isinstance(obj, torch.nn.Module):
        return default_policy_for(obj)
    return default_policy_for(_main_denoiser(denoiser_components(obj)))


def enable_pipeline(pipe, policy=None, *, components=None, include_vae: bool = False):
    """Route the attention of the pipeline's denoiser(s). policy None: the shipped policy for the main
    denoiser's class. components: names to route (default: every non-VAE diffusers model)."""
    comps = denoiser_components(pipe, include_vae=include_vae)
    if components is not None:
        missing = [c for c in components if c not in pipe.components]
        if missing:
            raise ValueError(f"no component(s) {missing} in {type(pipe).__name__}; have {sorted(pipe.components)}")
        comps = {c: getattr(pipe.components[c], "_orig_mod", pipe.components[c]) for c in components
                 if pipe.components[c] is not None}
    if not comps:
        raise ValueError(f"{type(pipe).__name__} has no diffusers model to route")
    pol = Policy.from_any(policy) if policy is not None else default_policy_for(_main_denoiser(comps))
    ps: _PipeState | None = getattr(pipe, _PIPE_ATTR, None)
    if ps is None:
        ps = _PipeState(StepTracker(), tuple(comps))
        object.__setattr__(pipe, _PIPE_ATTR, ps)
    else:
        for key in set(ps.components) - set(comps):
            if key in pipe.components and pipe.components[key] is not None:
                disable(pipe.components[key])
        ps.components = tuple(comps)
    bindings = []
    for comp in comps.values():
        bindings += enable(comp, pol, tracker=ps.tracker, check_rules=False).values()
    warn_unmatched_rules(pol, bindings, type(pipe).__name__)
    _hook_scheduler(pipe, ps)
    _wrap_pipeline_call(type(pipe))
    return pipe


def disable_pipeline(pipe) -> None:
    ps: _PipeState | None = getattr(pipe, _PIPE_ATTR, None)
    for comp in pipe.components.values():
        if isinstance(comp, torch.nn.Module):
            disable(getattr(comp, "_orig_mod", comp))
    if ps is None:
        return
    _unhook_scheduler(ps)
    object.__delattr__(pipe, _PIPE_ATTR)


def _hook_scheduler(pipe, ps: _PipeState) -> None:
    sched = getattr(pipe, "scheduler", None)
    if sched is ps.scheduler:
        return
    _unhook_scheduler(ps)
    if sched is None or not hasattr(sched, "step"):
        return
    tracker = ps.tracker
    orig_set_timesteps = getattr(sched, "set_timesteps", None)
    orig_step = sched.step
    orig_begin = getattr(sched, "set_begin_index", None)
    hooked = {}

    def _total():
        ts = getattr(sched, "timesteps", None)
        try:
            return len(ts) if ts is not None else None
        except TypeError:
            return None

    if orig_set_timesteps is not None:
        @functools.wraps(orig_set_timesteps)
        def set_timesteps(*args, **kwargs):
            out = orig_set_timesteps(*args, **kwargs)
            tracker.set(0, _total())
            return out
        hooked["set_timesteps"] = set_timesteps

    if orig_begin is not None:
        @functools.wraps(orig_begin)
        def set_begin_index(begin_index: int = 0, *args, **kwargs):
            out = orig_begin(begin_index, *args, **kwargs)
            total = _total()
            if total is not None:
                tracker.set(0, max(total - int(begin_index), 0))
            return out
        hooked["set_begin_index"] = set_begin_index

    @functools.wraps(orig_step)
    def step(*args, **kwargs):
        try:
            return orig_step(*args, **kwargs)
        finally:
            tracker.advance()
    hooked["step"] = step

    for k, fn in hooked.items():
        object.__setattr__(sched, k, fn)
    ps.scheduler = sched
    ps.hooked = tuple(hooked)


def _unhook_scheduler(ps: _PipeState) -> None:
    sched = ps.scheduler
    if sched is None:
        return
    for k in getattr(ps, "hooked", ()):
        if k in sched.__dict__:
            object.__delattr__(sched, k)
    ps.scheduler = None


def _wrap_pipeline_call(cls) -> None:
    """Wrap cls.__call__ once: pass-through for pipelines without sage; with sage, hook a swapped scheduler,
    start from step 0 (num_steps from num_inference_steps until set_timesteps says more) and clear the step
    at the end."""
    cls = next((c for c in cls.__mro__ if callable(c.__dict__.get("__call__"))), None)
    if cls is None or cls is object or cls.__dict__.get(_CALL_WRAPPED):
        return
    orig = cls.__dict__["__call__"]

    @functools.wraps(orig)
    def __call__(self, *args, **kwargs):
        ps: _PipeState | None = getattr(self, _PIPE_ATTR, None)
        if ps is None:
            return orig(self, *args, **kwargs)
        _hook_scheduler(self, ps)
        if ps.depth == 0:
            n = kwargs.get("num_inference_steps")
            if n is None:
                try:
                    n = inspect.signature(orig).parameters["num_inference_steps"].default
                except (KeyError, ValueError, TypeError):
                    n = None
            ps.tracker.set(0, n if isinstance(n, int) else None)
        ps.depth += 1
        try:
            return orig(self, *args, **kwargs)
        finally:
            ps.depth -= 1
            if ps.depth == 0:
                ps.tracker.set(None, None)

    setattr(cls, "__call__", __call__)
    setattr(cls, _CALL_WRAPPED, orig)


# ---- install -------------------------------------------------------------------------------------------------

def _model_enable(self, policy=None):
    """Route this model's attention layers through sage_patch (see sage_patch.integrations.diffusers)."""
    enable(self, policy)
    return self


def _model_disable(self):
    """Restore the original attention processors."""
    disable(self)
    return self


def _pipe_enable(self, policy=None, *, components=None, include_vae: bool = False):
    """Route the denoiser's attention layers through sage_patch; policy None picks the shipped policy for the
    model class. See sage_patch.integrations.diffusers."""
    return enable_pipeline(self, policy, components=components, include_vae=include_vae)


def _pipe_disable(self):
    """Restore the original attention processors and scheduler."""
    disable_pipeline(self)
    return self


_METHODS = {"enable_sage_attention": (_model_enable, _pipe_enable),
            "disable_sage_attention": (_model_disable, _pipe_disable)}


def install() -> None:
    """Add enable_sage_attention()/disable_sage_attention() to ModelMixin and DiffusionPipeline (new names only)."""
    from diffusers import DiffusionPipeline, ModelMixin

    for name, (model_fn, pipe_fn) in _METHODS.items():
        setattr(ModelMixin, name, model_fn)
        setattr(DiffusionPipeline, name, pipe_fn)


def uninstall() -> None:
    """Undo `install()` and restore the `__call__` of every pipeline class that enabling wrapped."""
    from diffusers import DiffusionPipeline, ModelMixin

    for name in _METHODS:
        for cls in (ModelMixin, DiffusionPipeline):
            if name in cls.__dict__:
                delattr(cls, name)
    stack = [DiffusionPipeline]
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        orig = cls.__dict__.get(_CALL_WRAPPED)
        if orig is not None:
            setattr(cls, "__call__", orig)
            delattr(cls, _CALL_WRAPPED)


# ---- the lifecycle sage_patch.inject/unload use --------------------------------------------------------------

def handles(obj) -> bool:
    return is_enabled(obj) or hasattr(obj, "attn_processors") or (
        not isinstance(obj, torch.nn.Module) and isinstance(getattr(obj, "components", None), dict))


def inject(obj, policy=None) -> None:
    if isinstance(obj, torch.nn.Module):
        enable(obj, policy)
    else:
        enable_pipeline(obj, policy)


def unload(obj) -> None:
    if isinstance(obj, torch.nn.Module):
        disable(obj)
    else:
        disable_pipeline(obj)

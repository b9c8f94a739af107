"""diffusers integration: `pipe.enable_sage_attention(policy=None)` / `model.enable_sage_attention(...)`.

How it works (per layer, no global monkey-patching of torch or diffusers):

- Every attention processor of the denoiser (`model.attn_processors`, e.g. `transformer_blocks.3.attn.processor`)
  is replaced by a `SageAttnProcessor` wrapper that holds the ORIGINAL processor object and a per-layer
  `_Route`. The wrapper calls a copy of the original processor's `__call__` whose globals are rebound for that
  layer only: `dispatch_attention_fn` (Flux, HunyuanVideo, most new models) and `F.scaled_dot_product_attention`
  (SD3/SD3.5 `JointAttnProcessor2_0`, `CogVideoXAttnProcessor2_0`, `AttnProcessor2_0` used e.g. by HunyuanVideo's
  token refiner) resolve to the layer's router. SD3.5-medium's `attn`/`attn2`, which share one processor object,
  get one wrapper each (each with its own layer name, policy and stats) around the same shared original.
- A processor whose `__call__` does not itself call SDPA or the dispatcher (e.g. the classic `AttnProcessor`
  with `baddbmm`) is left as it is and listed in `sage_skipped(model)` with the reason.
- Layers whose precision is "full" (by policy or step rule) call the ORIGINAL function with the original
  arguments, so diffusers' `set_attention_backend(...)` / `attention_backend(...)` choice still applies to them
  and "full" is bit-identical to not enabling sage. Calls with a context-parallel config also go to the original
  (ring/ulysses attention is diffusers' business); the report says so.
- The precision a layer asks for is a plain string attribute per layer (`_Route.precision`), refreshed only when
  the denoising step changes, outside the transformer's forward. Under `torch.compile` this costs one guard per
  layer and a recompile only when the pattern of precisions changes (e.g. "full" on the first two steps), never
  per step. While compiling, a quantized call is one opaque custom op (`sage_patch::diffusers_routed_attention`,
  with a fake implementation), so fullgraph works; its precision decision and stats happen when it runs. Calls
  that go to the original path ("full") are traced as diffusers traces them and are NOT counted in the report
  under compile (they are in eager mode).
- Denoising steps (for `steps:` rules) are counted by the pipeline, not by callbacks: `scheduler.set_timesteps`
  starts a loop (step 0; num_steps from the timesteps), `scheduler.set_begin_index` (img2img strength) shortens it,
  and each `scheduler.step(...)` call advances it. The pipeline class's `__call__` is wrapped (pass-through for
  pipelines without sage) so that a scheduler swapped after enabling is hooked too, and so that after the call
  the step is cleared. A custom loop can call `set_step(model_or_pipe, step, num_steps)`.
- `disable_sage_attention()` puts back the original processor objects (identity preserved) and removes hooks
  and stats. Enabling twice only updates the policy.
- nn.Module processors (IP-Adapter) stay registered as submodules (state_dict and .to() unchanged); the wrapper
  shadows them. Setting a plain processor on such a layer while enabled fails as nn.Module requires: disable first.

Public helpers: `enable(model, policy)`, `disable(model)`, `enable_pipeline(pipe, policy, components=...,
include_vae=...)`, `disable_pipeline(pipe)`, `set_step(obj, step, num_steps)`, `sage_skipped(model)`,
`default_policy_for(model)`, `is_enabled(obj)`.
"""
from __future__ import annotations

import functools
import inspect
import logging
import sys
import types
import weakref

import torch

from sage_patch.policy import Policy, shipped_policy_path
from sage_patch.report import STATS_ATTR, LayerStats
from sage_patch.routing import BINDING_ATTR, LayerBinding, StepState, layer_index

logger = logging.getLogger("sage_patch")

_STATE_ATTR = "_sage_patch_diffusers"       # _ModelState on an enabled model
_PIPE_ATTR = "_sage_patch_diffusers_pipe"   # _PipeState on an enabled pipeline
_CALL_WRAPPED = "_sage_patch_call_wrapped"  # marker on a pipeline class whose __call__ we wrapped

# ---- default policies ----------------------------------------------------------------------------------------

_FAMILIES = (  # substring of the model class name -> shipped policy
    ("Flux", "flux"),
    ("SD3", "sd35"),
    ("CogVideoX", "cogvideox"),
    ("HunyuanVideo", "hunyuanvideo"),
)
GENERIC_DEFAULT = {"name": "diffusers-default", "default": "8b", "fallback": {"min_seq_len": 128}}


def default_policy_for(model) -> Policy:
    """The shipped policy for the model's class (Flux, SD3/SD3.5, CogVideoX, HunyuanVideo), else a flux-like
    default: 8b everywhere, full below 128 tokens."""
    cls = type(model).__name__
    for key, family in _FAMILIES:
        if key in cls:
            return Policy.from_any(shipped_policy_path(family))
    return Policy.from_dict(GENERIC_DEFAULT, source="<diffusers default>")


# ---- step tracking -------------------------------------------------------------------------------------------

class StepTracker:
    """The denoising step shared by all denoisers of one pipeline (or one model), and the routes to refresh."""

    def __init__(self):
        self.state = StepState()
        self._routes: list[weakref.ref] = []

    def add(self, route) -> None:
        if not any(r() is route for r in self._routes):
            self._routes.append(weakref.ref(route))

    def routes(self):
        alive = [r for r in self._routes if r() is not None]
        self._routes = alive
        return [r() for r in alive]

    def set(self, step, num_steps=None) -> None:
        self.state.step = step
        self.state.num_steps = num_steps
        self.refresh()

    def advance(self) -> None:
        if self.state.step is not None:
            self.set(self.state.step + 1, self.state.num_steps)

    def refresh(self) -> None:
        for r in self.routes():
            r.refresh()


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


# ---- routing of one layer ------------------------------------------------------------------------------------

_ORIG_SDPA = torch.nn.functional.scaled_dot_product_attention


def _orig_dispatch():
    from diffusers.models import attention_dispatch

    return attention_dispatch.dispatch_attention_fn


def _record(stats: LayerStats, requested: str, impl: str, reason: str | None = None) -> None:
    from sage_patch.resolve import Decision

    stats.record(Decision(requested, "full", impl, reason))


def _torch_mask_to_4d(attn_mask):
    """torch SDPA semantics: a mask with fewer than 4 dims broadcasts from the right ((Sq, Skv) for 2-D)."""
    if isinstance(attn_mask, torch.Tensor) and attn_mask.dim() < 4:
        attn_mask = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    return attn_mask


_ROUTES: "weakref.WeakValueDictionary[int, _Route]" = weakref.WeakValueDictionary()
_NEXT_ID = 0


@torch.library.custom_op("sage_patch::diffusers_routed_attention", mutates_args=())
def _routed_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
                         route_id: int, layout: str, is_causal: bool, scale: float | None,
                         dropout_p: float) -> torch.Tensor:
    route = _ROUTES.get(route_id)
    if route is None:
        raise RuntimeError(f"sage_patch: routed layer {route_id} no longer exists (model freed or re-enabled)")
    return route.run_eager(q, k, v, layout, attn_mask, dropout_p, is_causal, scale).contiguous()


@_routed_attention_op.register_fake
def _(q, k, v, attn_mask, route_id, layout, is_causal, scale, dropout_p):
    return q.new_empty((q.shape[0], q.shape[1], q.shape[2], v.shape[3]))  # same layout as q, v's head dim


class _Route:
    """One attention layer: its binding (name, policy, stats, steps), the precision it asks for now, and the
    two routers that replace SDPA and the dispatcher inside its processor."""

    def __init__(self, binding: LayerBinding, orig_dispatch):
        global _NEXT_ID
        self.binding = binding
        self.id = _NEXT_ID
        _NEXT_ID += 1
        _ROUTES[self.id] = self
        self.modules: list[str] = []  # sys.modules entries holding the routed processor's globals
        self._precision = binding.requested()
        self._orig_dispatch = orig_dispatch
        self.functional = types.ModuleType("torch.nn.functional")
        self.functional.__dict__.update(torch.nn.functional.__dict__)
        self.functional.scaled_dot_product_attention = self.sdpa
        self.functional.__sage_route__ = True

    def refresh(self) -> None:
        self._precision = self.binding.requested()

    @property
    def precision(self) -> str:
        """Eager calls read the binding (policy, step, guard) each time; under torch.compile the value cached at
        the last step boundary is used, so the graph is specialized per step pattern, not per call."""
        if not torch.compiler.is_compiling():
            self._precision = self.binding.requested()
        return self._precision

    @property
    def shortcut_full(self) -> bool:
        """Full layers call the original function unchanged, unless calibration observes this layer."""
        return self.precision == "full" and self.binding.observer is None

    def _run(self, q, k, v, layout, attn_mask, dropout_p, is_causal, scale):
        if torch.compiler.is_compiling():
            # one opaque op for dynamo: the reference simulation and the kernels' launch are not traceable,
            # and a graph break inside a routed processor is not supported. Precision and stats are read and
            # written when the op runs, so the report stays exact under compile.
            return torch.ops.sage_patch.diffusers_routed_attention(
                q, k, v, attn_mask, self.id, layout, bool(is_causal), scale, float(dropout_p))
        return self.run_eager(q, k, v, layout, attn_mask, dropout_p, is_causal, scale)

    def run_eager(self, q, k, v, layout, attn_mask, dropout_p, is_causal, scale):
        # through the binding: its policy, stats, runtime guard and calibration observer
        return self.binding.attention(q, k, v, layout=layout, is_causal=bool(is_causal), scale=scale,
                                      attn_mask=attn_mask, dropout_p=dropout_p)

    def record_full(self, impl: str, reason: str | None = None) -> None:
        if not torch.compiler.is_compiling():  # under compile the original's "full" calls are not counted
            _record(self.binding.stats, self.precision, impl, reason)

    # torch.nn.functional.scaled_dot_product_attention, as called by JointAttnProcessor2_0 and friends
    def sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):
        if self.shortcut_full:
            self.record_full("sdpa")
            return _ORIG_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                              scale=scale, enable_gqa=enable_gqa)
        squeeze = query.dim() == 3
        if squeeze or query.dim() != 4 or (query.shape[-3] != key.shape[-3] and not enable_gqa) \
                or (attn_mask is not None and is_causal) or (is_causal and query.shape[-2] != key.shape[-2]):
            # shapes or flags whose torch semantics we do not replicate here: the original, reported
            self.record_full("sdpa", "unsupported SDPA call form (3-D, GQA without enable_gqa, causal with a "
                                     "mask or Sq != Skv): torch SDPA")
            return _ORIG_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                              scale=scale, enable_gqa=enable_gqa)
        return self._run(query, key, value, "bhsd", _torch_mask_to_4d(attn_mask), dropout_p, is_causal, scale)

    # diffusers.models.attention_dispatch.dispatch_attention_fn: q/k/v (B, S, H, D)
    def dispatch(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False, attention_kwargs=None, *, backend=None, parallel_config=None):
        orig_args = dict(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                         enable_gqa=enable_gqa, attention_kwargs=attention_kwargs, backend=backend,
                         parallel_config=parallel_config)
        if self.shortcut_full:
            self.record_full("diffusers-dispatch")
            return self._orig_dispatch(query, key, value, **orig_args)
        reason = None
        if parallel_config is not None:
            reason = "context parallelism: diffusers' dispatcher runs it (full)"
        elif attention_kwargs:
            reason = f"attention_kwargs {sorted(attention_kwargs)}: diffusers' dispatcher runs it (full)"
        elif query.shape[2] != key.shape[2] and not enable_gqa:
            reason = "head counts differ without enable_gqa: diffusers' dispatcher runs it (full)"
        elif attn_mask is not None and is_causal:
            reason = "attn_mask together with is_causal: diffusers' dispatcher runs it (full)"
        if reason:
            self.record_full("diffusers-dispatch", reason)
            return self._orig_dispatch(query, key, value, **orig_args)
        if isinstance(attn_mask, torch.Tensor) and attn_mask.dim() == 2 and \
                tuple(attn_mask.shape) == (query.shape[0], key.shape[1]):
            pass  # (B, Skv): key padding, as diffusers' native backend reads it
        else:
            attn_mask = _torch_mask_to_4d(attn_mask)
        return self._run(query, key, value, "bshd", attn_mask, dropout_p, is_causal, scale)


# ---- the processor wrapper -----------------------------------------------------------------------------------

class SageAttnProcessor:
    """Wraps one layer's original processor (kept in `.inner`, shared objects stay shared). Attribute reads,
    and writes of `_attention_backend` / `_parallel_config` (diffusers' set_attention_backend and
    enable_parallelism), go to the original."""

    _sage_wrapper = True

    def __init__(self, inner, route: _Route, fn, name: str):
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "route", route)
        object.__setattr__(self, "_sage_fn", fn)
        object.__setattr__(self, "layer_name", name)

    def __call__(self, *args, **kwargs):  # replaced per inner class by _wrapper_class (same signature)
        return self._sage_fn(self.inner, *args, **kwargs)

    def __getattr__(self, name):
        if name in ("inner", "route", "_sage_fn", "layer_name"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __setattr__(self, name, value):
        if name in ("_attention_backend", "_parallel_config") or hasattr(self.inner, name):
            setattr(self.inner, name, value)
        else:
            object.__setattr__(self, name, value)

    def __repr__(self):
        return f"{type(self).__name__}({self.layer_name}, precision={self.route.precision!r}, inner={self.inner!r})"


_WRAPPER_CLASSES: dict[type, type] = {}


def _call_function(proc):
    """The Python function that runs when `proc(...)` is called, or None."""
    cls = type(proc)
    call = getattr(cls, "__call__", None)
    if isinstance(proc, torch.nn.Module) and call is torch.nn.Module.__call__:
        call = getattr(cls, "forward", None)
    return call if isinstance(call, types.FunctionType) else None


def _wrapper_class(inner) -> type:
    inner_cls = type(inner)
    cls = _WRAPPER_CLASSES.get(inner_cls)
    if cls is None:
        fn = _call_function(inner)

        def __call__(self, *args, **kwargs):
            return self._sage_fn(self.inner, *args, **kwargs)

        try:  # diffusers filters processor kwargs by inspect.signature(processor.__call__)
            __call__.__signature__ = inspect.signature(fn)
        except (TypeError, ValueError):
            pass
        cls = type(f"Sage{inner_cls.__name__}", (SageAttnProcessor,), {"__call__": __call__,
                                                                       "__module__": __name__})
        _WRAPPER_CLASSES[inner_cls] = cls
    return cls


def _routed_function(fn, route: _Route):
    """A copy of `fn` whose global names for torch.nn.functional, F.scaled_dot_product_attention and
    dispatch_attention_fn resolve to `route`. None when `fn` references none of them directly."""
    g = fn.__globals__
    dispatch = _orig_dispatch()
    names = set(fn.__code__.co_names)
    override = {}
    for n in names:
        if n not in g:
            continue
        val = g[n]
        if val is dispatch:
            override[n] = route.dispatch
        elif val is torch.nn.functional and "scaled_dot_product_attention" in names:
            override[n] = route.functional
        elif val is _ORIG_SDPA:
            override[n] = route.sdpa
    if not override:
        return None
    # The copy's globals must be a registered module: torch.compile resolves a function's globals through
    # sys.modules[fn.__module__] when it builds guards.
    modname = f"{__name__}._routed_{route.id}_{fn.__module__.replace('.', '_')}"
    mod = types.ModuleType(modname)
    mod.__dict__.update(g)
    mod.__dict__.update(override)
    mod.__dict__["__name__"] = modname
    sys.modules[modname] = mod
    route.modules.append(modname)
    new = types.FunctionType(fn.__code__, mod.__dict__, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__module__ = modname
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__ = fn.__qualname__
    new.__doc__ = fn.__doc__
    return new


def _unwrap(proc):
    return proc.inner if isinstance(proc, SageAttnProcessor) else proc


# ---- model level ---------------------------------------------------------------------------------------------

class _ModelState:
    def __init__(self, policy: Policy, tracker: StepTracker):
        self.policy = policy
        self.tracker = tracker
        self.originals: dict[str, object] = {}   # layer name -> original processor object
        self.wrappers: dict[str, SageAttnProcessor] = {}
        self.skipped: dict[str, str] = {}        # layer name -> why it is not routed
        self.module_names: list[str] = []        # sys.modules entries of routed processors' globals


def _drop_modules(names: list) -> None:
    for n in names:
        sys.modules.pop(n, None)
    names.clear()


def _attention_modules(model):
    """(layer name, attention module) for every module with a processor (diffusers' attn_processors order)."""
    for name, mod in model.named_modules():
        if name and hasattr(mod, "get_processor") and hasattr(mod, "set_processor") and hasattr(mod, "processor"):
            yield name, mod


def _set_processor(module, proc) -> None:
    cur = module.__dict__.get("processor", None)
    if isinstance(proc, SageAttnProcessor) and "processor" in module._modules:
        # An nn.Module processor (e.g. IP-Adapter) stays registered as a submodule (state_dict, .to());
        # the wrapper shadows it in the instance dict.
        object.__setattr__(module, "processor", proc)
        return
    if isinstance(cur, SageAttnProcessor) and "processor" in module._modules:
        del module.__dict__["processor"]
        if proc is module._modules["processor"]:
            return
    module.set_processor(proc)


def enable(model, policy=None, *, tracker: StepTracker | None = None) -> dict:
    """Route every attention layer of a diffusers model through sage_patch. Returns {layer name: wrapper}.
    Enabling again updates the policy (and wraps processors set since); originals are kept from the first time."""
    pol = Policy.from_any(policy) if policy is not None else default_policy_for(model)
    st: _ModelState | None = getattr(model, _STATE_ATTR, None)
    if st is None:
        st = _ModelState(pol, tracker or StepTracker())
        object.__setattr__(model, _STATE_ATTR, st)
        weakref.finalize(model, _drop_modules, st.module_names)
    else:
        st.policy = pol
        if tracker is not None and tracker is not st.tracker:
            st.tracker = tracker
    dispatch = _orig_dispatch()
    for name, mod in _attention_modules(model):
        proc = mod.processor
        w = st.wrappers.get(name)
        if w is not None and proc is w:  # already ours: new policy / tracker
            w.route.binding.policy = pol
            w.route.binding.steps = st.tracker.state
            st.tracker.add(w.route)
            w.route.refresh()
            continue
        inner = _unwrap(proc)
        fn = _call_function(inner)
        if fn is None:
            st.skipped[name] = f"{type(inner).__name__}: no Python __call__ to route"
            continue
        stats = getattr(mod, STATS_ATTR, None)
        if not isinstance(stats, LayerStats):
            stats = LayerStats(name)
            setattr(mod, STATS_ATTR, stats)
        binding = LayerBinding(name, layer_index(name), pol, stats, st.tracker.state)
        route = _Route(binding, dispatch)
        routed = _routed_function(fn, route)
        if routed is None:
            st.skipped[name] = (f"{type(inner).__name__}.__call__ calls neither F.scaled_dot_product_attention "
                                f"nor dispatch_attention_fn directly: left as is")
            _drop_modules(route.modules)
            if getattr(mod, STATS_ATTR, None) is stats and stats.calls == 0:
                delattr(mod, STATS_ATTR)
            continue
        st.skipped.pop(name, None)
        st.module_names.extend(route.modules)
        old = st.wrappers.get(name)
        if old is not None:  # a processor set over our wrapper since: the old route's globals can go
            _drop_modules(old.route.modules)
        wrapper = _wrapper_class(inner)(inner, route, routed, name)
        st.originals[name] = inner
        st.wrappers[name] = wrapper
        st.tracker.add(route)
        _set_processor(mod, wrapper)
        setattr(mod, BINDING_ATTR, binding)  # found by sage_patch.calibrate (bindings_of)
    if st.skipped:
        logger.info("sage_patch: %d attention layer(s) of %s not routed: %s", len(st.skipped),
                    type(model).__name__, "; ".join(f"{k}: {v}" for k, v in list(st.skipped.items())[:3]))
    return dict(st.wrappers)


def disable(model) -> None:
    """Put back the original processor objects, remove the stats. Layers whose processor was replaced by
    someone else since enabling keep that processor."""
    st: _ModelState | None = getattr(model, _STATE_ATTR, None)
    if st is None:
        return
    mods = dict(_attention_modules(model))
    for name, orig in st.originals.items():
        mod = mods.get(name)
        if mod is None:
            continue
        if mod.processor is st.wrappers.get(name):
            _set_processor(mod, orig)
        for attr in (STATS_ATTR, BINDING_ATTR):
            if hasattr(mod, attr):
                delattr(mod, attr)
    _drop_modules(st.module_names)
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
    for comp in comps.values():
        enable(comp, pol, tracker=ps.tracker)
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
    setattr(cls, _CALL_WRAPPED, True)


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


def install() -> None:
    from diffusers import DiffusionPipeline, ModelMixin

    ModelMixin.enable_sage_attention = _model_enable
    ModelMixin.disable_sage_attention = _model_disable
    DiffusionPipeline.enable_sage_attention = _pipe_enable
    DiffusionPipeline.disable_sage_attention = _pipe_disable

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
- `disable_sage_attention()` unwraps every layer (the processor under each wrapper comes back, identity
  preserved) and removes hooks and stats. Enabling twice only updates the policy.
- nn.Module processors (IP-Adapter) stay registered as submodules (state_dict and .to() unchanged); the wrapper
  shadows them.
- diffusers' loaders keep working while enabled (IP-Adapter load/unload, `set_attn_processor`): a wrapper presents
  the wrapped processor's class (`__class__`, isinstance, `p.__class__()` builds a plain processor), and each
  layer's `set_processor` is hooked while enabled so that the processor diffusers sets is routed in turn with
  the layer's stats. A processor set before enabling is simply wrapped; after disabling, the layers keep
  whatever diffusers set last.

Why cloned functions and not the context-variable binding of `route_sdpa` (weighed for issue 31): reusing it would
mean replacing `torch.nn.functional.scaled_dot_product_attention` process-wide for as long as any model is enabled
(route_sdpa does so only inside its `with` block), plus `dispatch_attention_fn` in every diffusers module that
imported it by name, and tracing forward hooks that set a ContextVar under torch.compile fullgraph. The clone touches
nothing outside the layer it routes, compiles as plain Python, and disable() drops it; at equal behaviour (exact
enable/disable, compile, CPU offload, LoRA, IP-Adapter, set_attention_backend) it is the smaller design, so it stays.

Lifecycle (sage_patch.inject/unload call these): `enable(model, policy)`, `disable(model)`, `enable_pipeline(pipe,
policy, components=..., include_vae=...)`, `disable_pipeline(pipe)`; also `set_step(obj, step, num_steps)`,
`sage_skipped(model)`, `is_enabled(obj)`. `install()` adds the two methods to ModelMixin and DiffusionPipeline;
`uninstall()` removes them and restores every pipeline class `__call__` that enabling wrapped.
"""
from __future__ import annotations

import functools
import inspect
import logging
import sys
import types
import weakref

import torch

from sage_patch.policy import Policy, default_policy
from sage_patch.routing import LayerBinding, StepState, attach, detach, select_modules
from sage_patch.sdpa_semantics import from_diffusers_dispatch, from_torch_sdpa

logger = logging.getLogger("sage_patch")

_STATE_ATTR = "_sage_patch_diffusers"       # _ModelState on an enabled model
_PIPE_ATTR = "_sage_patch_diffusers_pipe"   # _PipeState on an enabled pipeline
_CALL_WRAPPED = "_sage_patch_call_wrapped"  # marker on a pipeline class whose __call__ we wrapped

LIBRARY = "diffusers"


def default_policy_for(model) -> Policy:
    """The family default (sage_patch/configs/families.yaml) for the model's class."""
    return default_policy(LIBRARY, model)


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
            self.binding.record_fallback(impl, reason)

    # torch.nn.functional.scaled_dot_product_attention, as called by JointAttnProcessor2_0 and friends
    def sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):
        if self.shortcut_full:
            self.record_full("sdpa")
            return _ORIG_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                              scale=scale, enable_gqa=enable_gqa)
        try:
            call = from_torch_sdpa(query, key, value, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa)
        except (TypeError, ValueError) as e:  # a call torch refuses: torch says so, in its own words
            self.record_full("sdpa", f"unsupported SDPA call ({e}): torch SDPA")
            return _ORIG_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                              scale=scale, enable_gqa=enable_gqa)
        return call.finish(self._run(call.q, call.k, call.v, call.layout, call.attn_mask, dropout_p, call.is_causal,
                                     scale))

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
        call = from_diffusers_dispatch(query, key, value, attn_mask=attn_mask, is_causal=is_causal)
        return self._run(call.q, call.k, call.v, call.layout, call.attn_mask, dropout_p, call.is_causal, scale)


# ---- the processor wrapper -----------------------------------------------------------------------------------

class SageAttnProcessor:
    """Wraps one layer's original processor (kept in `.inner`, shared objects stay shared). Attribute reads,
    and writes of `_attention_backend` / `_parallel_config` (diffusers' set_attention_backend and
    enable_parallelism), go to the original.

    The wrapper is a transparent proxy of the processor it wraps, as far as diffusers' loaders can tell:
    - `wrapper.__class__` is the wrapped processor's class, so `isinstance(p, FluxIPAdapterAttnProcessor)` and
      `p.__class__()` (how `load_ip_adapter` / `unload_ip_adapter` rebuild processors) behave as without sage;
    - calling the wrapper's own type with the wrapped class's arguments (`type(p)()`) builds a plain processor of
      the wrapped class, as it would without sage; wrappers themselves are made only by `enable()`;
    - copying or pickling a wrapper gives a copy of the wrapped processor (routing belongs to the model).
    The new processors diffusers sets while sage is enabled are wrapped by the layer's `set_processor` hook
    (see `_hook_set_processor`), so a layer stays routed across IP-Adapter loading and unloading."""

    _sage_wrapper = True
    _sage_inner_cls: type | None = None   # set on each generated subclass

    def __new__(cls, *args, **kwargs):
        inner_cls = cls.__dict__.get("_sage_inner_cls")
        if inner_cls is None:
            raise TypeError("SageAttnProcessor is created by enable_sage_attention(), not directly; to build a "
                            "processor, call its wrapped class (e.g. FluxAttnProcessor())")
        return inner_cls(*args, **kwargs)

    @classmethod
    def _wrap(cls, inner, route: _Route, fn, name: str) -> "SageAttnProcessor":
        self = object.__new__(cls)
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "route", route)
        object.__setattr__(self, "_sage_fn", fn)
        object.__setattr__(self, "layer_name", name)
        return self

    @property
    def __class__(self):
        return type(object.__getattribute__(self, "inner"))

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

    def __reduce_ex__(self, protocol):
        return self.inner.__reduce_ex__(protocol)

    def __repr__(self):
        return (f"Sage{type(self.inner).__name__}({self.layer_name}, precision={self.route.precision!r}, "
                f"inner={self.inner!r})")


_WRAPPER_CLASSES: dict[type, type] = {}


def _call_function(proc):
    """The Python function that runs when `proc(...)` is called, or None."""
    cls = type(proc)
    call = getattr(cls, "__call__", None)
    if isinstance(proc, torch.nn.Module) and call is torch.nn.Module.__call__:
        call = getattr(cls, "forward", None)
    return call if isinstance(call, types.FunctionType) else None


def _forwarding_call(fn):
    """`__call__(self, <fn's parameters>)` that calls `self._sage_fn(self.inner, ...)`, with fn's parameter names,
    kinds and default values: diffusers filters processor kwargs by `inspect.signature(processor.__call__)`, and
    torch.compile guards on the real `__defaults__` of the function it inlines, so both must be genuine."""
    try:
        params = list(inspect.signature(fn).parameters.values())[1:]   # drop the processor's own self
    except (TypeError, ValueError):
        params = None
    if params is None or any(not p.name.isidentifier() or p.name in ("self", "_d") for p in params):
        def __call__(self, *args, **kwargs):
            return self._sage_fn(self.inner, *args, **kwargs)
        return __call__
    head, call, star_seen = ["self"], [], False
    for p in params:
        if p.kind is p.POSITIONAL_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD:
            head.append(p.name if p.default is p.empty else f"{p.name}=_d")
            call.append(p.name)
        elif p.kind is p.VAR_POSITIONAL:
            head.append(f"*{p.name}")
            call.append(f"*{p.name}")
            star_seen = True
        elif p.kind is p.KEYWORD_ONLY:
            if not star_seen:
                head.append("*")
                star_seen = True
            head.append(p.name if p.default is p.empty else f"{p.name}=_d")
            call.append(f"{p.name}={p.name}")
        else:
            head.append(f"**{p.name}")
            call.append(f"**{p.name}")
    if any(p.kind is p.POSITIONAL_ONLY for p in params):
        last = max(i for i, p in enumerate(params) if p.kind is p.POSITIONAL_ONLY)
        head.insert(last + 2, "/")
    src = f"def __call__({', '.join(head)}):\n    return self._sage_fn(self.inner, {', '.join(call)})\n"
    ns: dict = {"_d": None}
    exec(compile(src, f"<sage_patch wrapper of {fn.__qualname__}>", "exec"), ns)
    call_fn = ns["__call__"]
    call_fn.__defaults__ = fn.__defaults__
    call_fn.__kwdefaults__ = fn.__kwdefaults__
    call_fn.__annotations__ = dict(getattr(fn, "__annotations__", {}))
    call_fn.__doc__ = fn.__doc__
    return call_fn


def _wrapper_class(inner) -> type:
    inner_cls = type(inner)
    cls = _WRAPPER_CLASSES.get(inner_cls)
    if cls is None:
        cls = type(f"Sage{inner_cls.__name__}", (SageAttnProcessor,),
                   {"__call__": _forwarding_call(_call_function(inner)), "_sage_inner_cls": inner_cls,
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
        self.wrappers: dict[str, SageAttnProcessor] = {}
        self.skipped: dict[str, str] = {}        # layer name -> why it is not routed
        self.module_names: list[str] = []        # sys.modules entries of routed processors' globals


def _drop_modules(names: list) -> None:
    for n in names:
        sys.modules.pop(n, None)
    names.clear()


def is_target(name: str, module) -> bool:
    """A module with an attention processor (diffusers' attn_processors order)."""
    return hasattr(module, "get_processor") and hasattr(module, "set_processor") and hasattr(module, "processor")


def _attention_modules(model):
    return select_modules(model, is_target)


def _install_wrapper(module, wrapper: SageAttnProcessor) -> None:
    """Put `wrapper` in front of the layer's processor. An nn.Module processor (e.g. IP-Adapter) stays registered
    as a submodule (state_dict, .to()); the wrapper shadows it in the instance dict, as a plain processor's own
    instance-dict entry is replaced."""
    module.__dict__["processor"] = wrapper


def _remove_wrapper(module) -> None:
    """Undo `_install_wrapper`: the wrapped processor is the layer's processor again (identity preserved)."""
    cur = module.__dict__.get("processor")
    if not isinstance(cur, SageAttnProcessor):
        return
    if module._modules.get("processor") is cur.inner:
        del module.__dict__["processor"]
    else:
        module.__dict__["processor"] = cur.inner


_HOOK_ATTR = "set_processor"   # instance attribute shadowing the class's set_processor while enabled


def _hook_set_processor(model, name: str, module) -> None:
    """While sage is enabled, diffusers (IP-Adapter load/unload, set_attn_processor, set_default_attn_processor)
    sets processors through `module.set_processor`. The hook runs diffusers' own set_processor on the unwrapped
    processor (its bookkeeping of nn.Module processors applies unchanged), then routes the new processor with
    this layer's stats, policy and step state, so the layer stays routed and the report stays one entry."""
    if _HOOK_ATTR in module.__dict__:
        return
    model_ref = weakref.ref(model)
    cls_set = type(module).set_processor

    def set_processor(processor, *args, **kwargs):
        _remove_wrapper(module)
        cls_set(module, _unwrap(processor), *args, **kwargs)
        m = model_ref()
        st = getattr(m, _STATE_ATTR, None) if m is not None else None
        if st is not None:
            _route_layer(st, name, module)

    set_processor.__doc__ = cls_set.__doc__
    module.__dict__[_HOOK_ATTR] = set_processor


def _unhook_set_processor(module) -> None:
    module.__dict__.pop(_HOOK_ATTR, None)


def _route_layer(st: _ModelState, name: str, mod) -> None:
    """Wrap the layer's current processor (unwrapped first) with a route under `st`'s policy, or record why not."""
    inner = _unwrap(mod.processor)
    fn = _call_function(inner)
    old = st.wrappers.pop(name, None)
    if old is not None:  # the old route's globals can go
        _drop_modules(old.route.modules)
        st.module_names[:] = [n for n in st.module_names if n not in old.route.modules]
    if fn is None:
        st.skipped[name] = f"{type(inner).__name__}: no Python __call__ to route"
        return
    binding = attach(mod, name, st.policy, st.tracker.state)
    route = _Route(binding, _orig_dispatch())
    routed = _routed_function(fn, route)
    if routed is None:
        st.skipped[name] = (f"{type(inner).__name__}.__call__ calls neither F.scaled_dot_product_attention "
                            f"nor dispatch_attention_fn directly: left as is")
        _drop_modules(route.modules)
        if binding.stats.calls == 0:
            detach(mod)
        return
    st.skipped.pop(name, None)
    st.module_names.extend(route.modules)
    wrapper = _wrapper_class(inner)._wrap(inner, route, routed, name)
    st.wrappers[name] = wrapper
    st.tracker.add(route)
    _install_wrapper(mod, wrapper)


def enable(model, policy=None, *, tracker: StepTracker | None = None) -> dict:
    """Route every attention layer of a diffusers model through sage_patch. Returns {layer name: wrapper}.
    Enabling again updates the policy (and wraps processors assigned directly since, bypassing set_processor)."""
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
    for name, mod in _attention_modules(model):
        w = st.wrappers.get(name)
        if w is not None and mod.processor is w:  # already ours: new policy / tracker
            w.route.binding.policy = pol
            w.route.binding.steps = st.tracker.state
            st.tracker.add(w.route)
            w.route.refresh()
        else:
            _route_layer(st, name, mod)
        _hook_set_processor(model, name, mod)
    if st.skipped:
        logger.info("sage_patch: %d attention layer(s) of %s not routed: %s", len(st.skipped),
                    type(model).__name__, "; ".join(f"{k}: {v}" for k, v in list(st.skipped.items())[:3]))
    return dict(st.wrappers)


def disable(model) -> None:
    """Unwrap every layer: each gets back the processor it had under the wrapper (the original object, or the
    one diffusers set while enabled, e.g. an IP-Adapter processor), and loses its stats and hook."""
    st: _ModelState | None = getattr(model, _STATE_ATTR, None)
    if st is None:
        return
    for name, mod in _attention_modules(model):
        _unhook_set_processor(mod)
        if name in st.wrappers or name in st.skipped:
            _remove_wrapper(mod)
            detach(mod)
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

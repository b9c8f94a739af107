"""The layer binding: how one attention module of a model is tied to sage_patch under a policy, the layer half of
every adapter.

Adapters (the generic SDPA one, transformers' and diffusers', all in sage_patch.integrations) pick their modules with
the one selector `select_modules` (each adapter's way of recognising an attention module is a `Recogniser`,
registered as data), bind each to a `LayerBinding` with `attach` (name, index, policy, stats, shared step state;
removed by `detach`), and call `binding.attention(...)` (or `binding.run(...)`, which is one opaque op under
torch.compile); a call that goes elsewhere is recorded by `binding.record_fallback`.

Calls an adapter does not receive itself find their layer through `layer_scope`: `enter_on_forward` makes a binding
the ambient layer while its module's forward runs, and `SDPA` (an `Interposer`) replaces
`torch.nn.functional.scaled_dot_product_attention` by `routed_sdpa` while any model needs it, which sends a call
made inside a routed layer to that layer and every other call to torch unchanged.
`integrations.generic.route_sdpa(model, policy)` is the generic mechanism built from these; the diffusers adapter
uses the same pieces.
"""
from __future__ import annotations

import fnmatch
import functools
import inspect
import logging
import re
import warnings
import weakref
from dataclasses import dataclass

import torch

from . import layer_scope
from .api import apply_sinks, check_sinks, run_attention
from .guard import Guard
from .policy import Policy
from .report import NO_STATS, STATS_ATTR, LayerStats, log_fallback_once
from .resolve import Decision, resolve_by_rule
from .sdpa_semantics import from_torch_sdpa

logger = logging.getLogger("sage_patch")

BINDING_ATTR = "_sage_patch_binding"  # attribute holding a LayerBinding on each routed attention module


@dataclass
class StepState:
    """Denoising step shared by all layers of one model or pipeline (None outside a diffusion loop)."""
    step: int | None = None
    num_steps: int | None = None


_LAYERS: "weakref.WeakValueDictionary[int, LayerBinding]" = weakref.WeakValueDictionary()  # by LayerBinding.id


class LayerBinding:
    """One attention layer's routing state. `observer`, when set (calibration), sees every call's q/k/v."""

    _next_id = 0

    def __init__(self, name: str, index: int | None, policy: Policy, stats: LayerStats | None = None,
                 steps: StepState | None = None):
        self.name, self.index, self.policy = name, index, policy
        self.stats = stats or LayerStats(name)
        self.steps = steps or StepState()
        self.guard = Guard()
        self.observer = None
        self.id = LayerBinding._next_id   # names the layer to the compiled op
        LayerBinding._next_id += 1
        _LAYERS[self.id] = self
        self.refresh()

    def requested(self) -> str:
        """The policy's precision for this layer at the current step, after any runtime-guard demotion."""
        return self.guard.effective(
            self.policy.precision_for(self.name, self.index, self.steps.step, self.steps.num_steps))

    def refresh(self) -> None:
        """Cache `requested()` for traced code (call when the policy or the step changes)."""
        self._precision = self.requested()

    def clear_demotions(self) -> None:
        """A policy was set: runtime-guard demotions made under the previous one no longer apply (the report keeps
        them, and says they were cleared)."""
        cleared = self.guard.clear()
        if cleared:
            self.stats.guard[f"runtime guard demotion(s) {', '.join(cleared)} cleared by a new policy"] += 1
            self.refresh()

    def passes_full(self) -> bool:
        """Whether a call should run the caller's own full-precision function unchanged (the layer is "full" and no
        calibration observer watches it). Eager calls read the policy each time; under torch.compile the value
        cached by `refresh` is used, so a graph is specialized per pattern of precisions, not per step or call."""
        if not torch.compiler.is_compiling():
            self._precision = self.requested()
        return self._precision == "full" and self.observer is None

    def full_by_rule(self, q, k, v, *, layout: str, attn_mask, dropout_p: float) -> bool:
        """Eager calls: whether this call runs full precision by a rule that needs neither the mask's shape nor the
        kernels (resolve_by_rule: a "full" layer, dropout, a float mask, the policy's fallback rules, such as
        min_seq_len at every decode step) while nothing else watches it (no calibration observer, no runtime guard,
        no gradient). Such a call is recorded here as `attention` records it, and the caller runs its own
        full-precision function (the library's own call, which validates its arguments as without sage_patch): a
        host-bound decode step pays this check and the count. False: the caller takes `attention` or `run`."""
        if self.observer is not None or self.policy.guard_every or torch.compiler.is_compiling() or (
                torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
            return False
        float_mask = isinstance(attn_mask, torch.Tensor) and attn_mask.is_floating_point()
        decision = resolve_by_rule(self.requested(), q, k, layout=layout, float_mask=float_mask,
                                   dropout_p=dropout_p, policy=self.policy)
        if decision is None:
            return False
        self.stats.record(decision)
        if decision.reason:
            log_fallback_once(decision.reason)
        return True

    def attention(self, q, k, v, *, layout="bhsd", is_causal=False, scale=None, attn_mask=None, dropout_p=0.0,
                  return_lse=False, record=True, context=None, full=None, window_left=-1, sinks=None):
        """This layer's attention under its policy. `record` False: the call is not counted (the later K/V chunks of
        one ring-attention call, counted once). `context`: how the call was distributed (context parallelism),
        counted in the layer's stats next to the call. `full`: what a full-precision call runs (run_attention).
        `window_left`: the kernels' sliding window (run_attention; -1 none). `sinks`: attention sinks
        (run_attention); the runtime guard checks against exact attention with them, calibration observes the
        attention of the real scores (the sinks' correction is exact at every precision)."""
        precision = self.requested()
        call = {"layout": layout, "is_causal": is_causal, "scale": scale, "attn_mask": attn_mask,
                "window_left": window_left}
        if self.observer is not None:
            self.observer(self, q, k, v, call)
        if sinks is not None:
            call["sinks"] = sinks
        res = run_attention(q, k, v, **call, precision=precision, return_lse=return_lse,
                            smooth_v=self.policy.smooth_v, dropout_p=dropout_p, policy=self.policy,
                            stats=self.stats if record else NO_STATS, full=full)
        if record and context:
            self.stats.record_context(context)
        if self.policy.guard_every:
            self.guard.after_call(self, precision, q, k, v, call, res[0] if return_lse else res)
        return res

    def run(self, q, k, v, *, layout, is_causal, scale, attn_mask, dropout_p, return_lse=False, record=True,
            context=None, full=None, window_left=-1, sinks=None):
        """`attention` for calls that torch.compile may trace: there it is one opaque op (the reference simulation
        and the kernels' launch are not traceable, and a graph break inside a routed forward is not supported);
        its precision decision and stats happen when the op runs, so the report stays exact under compile. Calls
        with LSE, uncounted or with a context (context parallelism) use a second op that returns (out, lse). A call
        that needs a gradient is traced instead (the ops have no backward): it runs torch SDPA or the trainable 8b's
        custom ops, both traceable. `sinks` (run_attention): traced, the op returns the LSE and the sinks' correction
        (api.apply_sinks, elementwise) is traced after it, so the ops' signatures do not carry them."""
        needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        if torch.compiler.is_compiling() and not needs_grad:
            want_lse = return_lse or sinks is not None
            if sinks is not None:
                check_sinks(sinks, q.shape[1] if layout == "bhsd" else q.shape[2], q.device)
            if not want_lse and record and context is None:
                return torch.ops.sage_patch.routed_attention(q, k, v, attn_mask, self.id, layout, bool(is_causal),
                                                             scale, float(dropout_p), int(window_left))
            out, lse = torch.ops.sage_patch.routed_attention_lse(q, k, v, attn_mask, self.id, layout,
                                                                 bool(is_causal), scale, float(dropout_p),
                                                                 bool(want_lse), bool(record), context or "",
                                                                 int(window_left))
            if sinks is not None:
                out, lse = apply_sinks(out, lse, sinks, layout)
            return (out, lse) if return_lse else out
        return self.attention(q, k, v, layout=layout, is_causal=bool(is_causal), scale=scale, attn_mask=attn_mask,
                              dropout_p=dropout_p, return_lse=return_lse, record=record, context=context, full=full,
                              window_left=window_left, sinks=sinks)

    def record_fallback(self, impl: str, reason: str | None = None, context: str | None = None) -> None:
        """Record a call that this layer sent to `impl` in full precision instead of sage_patch's attention (the one
        way adapters report their own fallbacks); a reason is logged once per process. `context`: as in
        `attention`."""
        self.stats.record(Decision(self.requested(), "full", impl, reason, path="sdpa"))
        if context:
            self.stats.record_context(context)
        if reason and not torch.compiler.is_compiling():
            log_fallback_once(reason)

    def record_passthrough(self, impl: str, reason: str | None = None, context: str | None = None) -> None:
        """`record_fallback` for a call handed back to the caller's own function (routed_sdpa, diffusers'
        dispatcher). Under torch.compile such calls are traced as the caller wrote them and counted once, when the
        graph is traced (the counting rule of `sage_patch.report`)."""
        self.record_fallback(impl, reason, context)


@torch.library.custom_op("sage_patch::routed_attention", mutates_args=())
def _routed_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
                         layer_id: int, layout: str, is_causal: bool, scale: float | None,
                         dropout_p: float, window_left: int = -1) -> torch.Tensor:
    layer = _LAYERS.get(layer_id)
    if layer is None:
        raise RuntimeError(f"sage_patch: routed layer {layer_id} no longer exists (model freed or unloaded)")
    return layer.attention(q, k, v, layout=layout, is_causal=is_causal, scale=scale, attn_mask=attn_mask,
                           dropout_p=dropout_p, window_left=window_left).contiguous()


@_routed_attention_op.register_fake
def _(q, k, v, attn_mask, layer_id, layout, is_causal, scale, dropout_p, window_left=-1):
    return q.new_empty((q.shape[0], q.shape[1], q.shape[2], v.shape[3]))  # q's layout, v's head dim


@torch.library.custom_op("sage_patch::routed_attention_lse", mutates_args=())
def _routed_attention_lse_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
                             layer_id: int, layout: str, is_causal: bool, scale: float | None, dropout_p: float,
                             return_lse: bool, record: bool, context: str,
                             window_left: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """`routed_attention` with the LSE (fp32 (B, H, Sq); an empty tensor unless return_lse), the `record` flag and
    the `context` note of `LayerBinding.attention` (context parallelism's per-rank calls)."""
    layer = _LAYERS.get(layer_id)
    if layer is None:
        raise RuntimeError(f"sage_patch: routed layer {layer_id} no longer exists (model freed or unloaded)")
    res = layer.attention(q, k, v, layout=layout, is_causal=is_causal, scale=scale, attn_mask=attn_mask,
                          dropout_p=dropout_p, return_lse=return_lse, record=record, context=context or None,
                          window_left=window_left)
    out, lse = res if return_lse else (res, q.new_empty((0,), dtype=torch.float32))
    return out.contiguous(), lse.contiguous()


@_routed_attention_lse_op.register_fake
def _(q, k, v, attn_mask, layer_id, layout, is_causal, scale, dropout_p, return_lse, record, context, window_left=-1):
    b, h, s = (q.shape[0], q.shape[1], q.shape[2]) if layout == "bhsd" else (q.shape[0], q.shape[2], q.shape[1])
    lse = q.new_empty((b, h, s), dtype=torch.float32) if return_lse else q.new_empty((0,), dtype=torch.float32)
    return q.new_empty((q.shape[0], q.shape[1], q.shape[2], v.shape[3])), lse


def attach(module: torch.nn.Module, name: str, policy: Policy, steps: StepState | None = None,
           index: int | None = None, *, new_policy: bool = True) -> LayerBinding:
    """Bind `module` as layer `name` (a binding already there keeps its stats, guard and observer, and takes the new
    name and policy; otherwise the module's stats, if any, are kept). index None: from the name (layer_index).
    `new_policy` False: `policy` is the one the binding already had (a rename), so runtime-guard demotions stay;
    otherwise they are cleared."""
    index = layer_index(name) if index is None else index
    b = getattr(module, BINDING_ATTR, None)
    if isinstance(b, LayerBinding):
        b.name, b.index, b.policy, b.stats.name = name, index, policy, name
        if steps is not None:
            b.steps = steps
        if new_policy:
            b.clear_demotions()
        b.refresh()
    else:
        stats = getattr(module, STATS_ATTR, None)
        b = LayerBinding(name, index, policy, stats if isinstance(stats, LayerStats) else None, steps)
        b.stats.name = name
        setattr(module, BINDING_ATTR, b)
    setattr(module, STATS_ATTR, b.stats)
    return b


_WARNED_RULES: set = set()


def warn_unmatched_rules(policy: Policy, bindings, model_name: str) -> None:
    """Warn (once per policy and rule) about layer rules of `policy` that match none of `bindings` (LayerBindings
    of one model or pipeline): a misspelt glob or an index past the last layer would otherwise change nothing,
    silently. The warning names the rule and a few of the layer names the rules are matched against."""
    bindings = list(bindings)
    if not bindings or not policy.layers:
        return
    for rule in policy.unmatched_layer_rules((b.name, b.index) for b in bindings):
        key = (policy.source, policy.layers, rule)
        if key in _WARNED_RULES:
            continue
        _WARNED_RULES.add(key)
        names = [b.name for b in bindings]
        indices = sorted({b.index for b in bindings if b.index is not None})
        span = f", layer indices {indices[0]}-{indices[-1]}" if indices else ""
        warnings.warn(f"sage_patch: policy {policy.source}: rule {rule} matches none of the {len(names)} attention "
                      f"layers of {model_name} (names such as {', '.join(names[:3])}"
                      f"{' ...' if len(names) > 3 else ''}{span}); it has no effect", RuntimeWarning, stacklevel=3)


def detach(module: torch.nn.Module) -> None:
    """Undo `attach`: the module loses its binding and stats."""
    for attr in (BINDING_ATTR, STATS_ATTR):
        if attr in module.__dict__:
            delattr(module, attr)


def layer_index(name: str) -> int | None:
    """The block index in a module name ('model.layers.3.self_attn' -> 3; last number wins), or None."""
    nums = re.findall(r"\.(\d+)(?:\.|$)", name)
    return int(nums[-1]) if nums else None


# ---- the one module selector ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Recogniser:
    """How one adapter recognises an attention module, as data. `attributes`: the module has all of them. Else
    `forward_mentions`: its class's forward source names one of them (when the source is unreadable,
    `class_suffixes` decide). Else `class_suffixes`: its class name ends in one of them."""
    class_suffixes: tuple[str, ...] = ()
    forward_mentions: tuple[str, ...] = ()
    attributes: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.attributes:
            return f"modules with {', '.join(self.attributes)}"
        what = f"module classes whose name ends in {' or '.join(repr(x) for x in self.class_suffixes)}"
        return (f"module classes whose forward names {' or '.join(self.forward_mentions)} (else {what})"
                if self.forward_mentions else what)


RECOGNISERS: dict[str, Recogniser] = {"sdpa": Recogniser(class_suffixes=("Attention", "SelfAttention"))}


def register_recogniser(adapter: str, recogniser: Recogniser) -> None:
    """Each adapter registers how it recognises its attention modules (at its import)."""
    RECOGNISERS[adapter] = recogniser


@functools.lru_cache(maxsize=None)
def _forward_mentions(cls: type, words: tuple[str, ...]) -> bool | None:
    try:
        src = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return None
    return any(w in src for w in words)


def is_attention_module(module: torch.nn.Module, adapter: str = "sdpa") -> bool:
    """The one attention-module predicate, applying `adapter`'s registered Recogniser."""
    r = RECOGNISERS[adapter]
    if r.attributes:
        return all(hasattr(module, a) for a in r.attributes)
    if r.forward_mentions:
        found = _forward_mentions(type(module), r.forward_mentions)
        if found is not None:
            return found
    return type(module).__name__.endswith(r.class_suffixes)


def select_modules(model: torch.nn.Module, adapter: str = "sdpa", targets=None) -> list:
    """The one module selector (PEFT's check_target_module_exists): (name, module) of every named sub-module the
    `targets` accept, in named_modules order (the names policies match). `targets`: None, every attention module
    of `adapter` (is_attention_module); a glob or list of globs on the module name, those attention modules whose
    name matches one; a callable (name, module) -> bool, the modules it accepts (it replaces the recogniser)."""
    if callable(targets):
        return [(n, m) for n, m in model.named_modules() if n and targets(n, m)]
    globs = (targets,) if isinstance(targets, str) else tuple(targets or ())
    return [(n, m) for n, m in model.named_modules() if n and is_attention_module(m, adapter)
            and (not globs or any(fnmatch.fnmatchcase(n, g) for g in globs))]


# ---- the ambient layer and torch's SDPA -------------------------------------------------------------------------

def enter_on_forward(module: torch.nn.Module, binding: LayerBinding) -> list:
    """Make `binding` the ambient layer (layer_scope) while `module`'s forward runs. Returns the hook handles."""
    entered = []  # a post hook runs even when the pre hook did not (an earlier hook raised): leave only what entered

    def pre(_m, _args):
        layer_scope.enter(binding)
        entered.append(True)

    def post(_m, _args, _out):
        if entered:
            entered.pop()
            layer_scope.leave()

    return [module.register_forward_pre_hook(pre), module.register_forward_hook(post, always_call=True)]


class Interposer:
    """A process-wide replacement, in place while at least one routed model needs it: `acquire` installs it for the
    first user, `release` restores the originals when the last one lets go."""

    def __init__(self, install, restore):
        self._install, self._restore, self.users = install, restore, 0

    def acquire(self) -> None:
        if self.users == 0:
            self._install()
        self.users += 1

    def release(self) -> None:
        self.users -= 1
        if self.users == 0:
            self._restore()


_torch_sdpa = [torch.nn.functional.scaled_dot_product_attention]  # the function routed_sdpa replaced


def routed_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """torch.nn.functional.scaled_dot_product_attention while `SDPA` is acquired: a call made inside a routed layer
    runs that layer's attention; a "full" layer, a call torch semantics refuse, or a call outside any routed
    layer run torch's own function with the caller's arguments."""
    layer, original = layer_scope.current(), _torch_sdpa[0]
    args = dict(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    if not isinstance(layer, LayerBinding):
        return original(query, key, value, **args)
    if layer.passes_full():
        layer.record_passthrough("sdpa")
        return original(query, key, value, **args)
    try:
        call = from_torch_sdpa(query, key, value, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa)
    except (TypeError, ValueError) as e:  # a call torch refuses: torch says so, in its own words
        layer.record_passthrough("sdpa", f"unsupported SDPA call ({e}): torch SDPA")
        return original(query, key, value, **args)
    # a full-precision decision runs the caller's own call (full): only the decision costs anything
    def full():
        out = original(query, key, value, **args)
        return out.unsqueeze(1) if call.squeeze else out  # call.finish drops the head dim again

    return call.finish(layer.run(call.q, call.k, call.v, layout=call.layout, is_causal=call.is_causal, scale=scale,
                                 attn_mask=call.attn_mask, dropout_p=dropout_p, full=full))


def _install_sdpa():
    _torch_sdpa[0] = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = routed_sdpa


def _restore_sdpa():
    if torch.nn.functional.scaled_dot_product_attention is routed_sdpa:
        torch.nn.functional.scaled_dot_product_attention = _torch_sdpa[0]


SDPA = Interposer(_install_sdpa, _restore_sdpa)

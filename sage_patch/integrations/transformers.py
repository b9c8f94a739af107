"""transformers hook: `attn_implementation="sage"` with per-layer policies.

`register()` (run at `import sage_patch`) registers "sage" with `transformers.AttentionInterface` and, with
`sdpa_mask`, with `transformers.masking_utils.AttentionMaskInterface` (without the mask function a custom name
silently receives attention_mask=None). It also wraps `PreTrainedModel.post_init` and
`PreTrainedModel.set_attn_implementation` so that every attention module of a model that uses "sage" is bound
to a `LayerBinding` (module name, layer index, policy, stats) as soon as the model is built or switched: the
report lists every layer before the first forward, and nothing is created inside a compiled graph.

Default policy: chosen from `config.model_type` through `DEFAULT_FAMILY`; every transformers model type,
Llama, Mistral, Qwen2, Gemma 2 and others, uses the shipped configs/llama.yaml (8b, full below 128 tokens, so
decode steps run full). Change it with `sage_patch.set_policy(model, policy)`.

Semantics (each item is tested in tests/test_transformers_integration.py):
- causal: `q_len > 1 and mask is None and module.is_causal` (or the `is_causal` kwarg), aligned bottom-right; when
  transformers skipped the mask of a prefill into a longer static cache (q_len < kv_len, mask None), the keys
  past q_len are empty cache slots and are cut, as transformers' sdpa does;
- masks are sdpa_mask's 4-D bool (True = attend); GQA/MQA K/V are passed with their own head count;
- `sliding_window`: carried by the mask; if the mask is None while the window would cut keys, it is built here;
- `scaling` is the module's; `dropout` applies only while `module.training` (then full, reported);
- `softcap` (Gemma 2) and `s_aux` (attention sinks) run an exact fp32 eager attention ("full", impl "eager");
  `position_bias` and a paged `cache` are delegated to transformers' own sdpa function ("full", impl "sdpa");
- keywords that cannot change the result (`ignored_kwargs()`: derived from transformers' TransformersKwargs,
  FlashAttentionKwargs and loss-function signatures, e.g. `shift_labels`) are ignored, as transformers' sdpa and
  eager functions ignore them; any other keyword with a non-None value raises TypeError instead of being dropped.
"""
from __future__ import annotations

import functools
import inspect
import logging
import math

import torch

from sage_patch.policy import Policy, load_policy, shipped_policy_path
from sage_patch.report import STATS_ATTR, LayerStats, log_fallback_once
from sage_patch.resolve import Decision
from sage_patch.routing import BINDING_ATTR, LayerBinding, StepState, layer_index

logger = logging.getLogger("sage_patch")

NAME = "sage"
_WRAPPED = "_sage_patch_wrapped"

# config.model_type -> shipped policy family (configs/<family>.yaml); anything else uses DEFAULT_FAMILY[None].
DEFAULT_FAMILY = {"llama": "llama", "mistral": "llama", "qwen2": "llama", None: "llama"}

# Keywords handled explicitly by sage_attention_forward (each can change the result).
_HANDLED_KWARGS = frozenset({"is_causal", "sliding_window", "softcap", "s_aux", "output_attentions",
                             "position_bias", "cache"})
# Names that change attention wherever they appear (masks, biases, dropout): never ignored, even if a typed dict
# or a loss signature of some transformers version were to list them.
_RESULT_CHANGING = frozenset({"attention_mask", "attn_mask", "dropout", "dropout_p", "scaling", "scale",
                              "head_mask", "layer_head_mask", "attn_bias", "alibi", "block_mask", "score_mod"})
# Bookkeeping that models and generate() pass down and that no typed dict lists (caches are updated by the
# attention module before the call; flash-only dtype/determinism switches do not apply here).
_BOOKKEEPING_KWARGS = frozenset({"cache_position", "use_cache", "past_key_values", "past_key_value",
                                 "return_dict", "layer_idx", "target_dtype", "deterministic", "logits_to_keep",
                                 "labels", "inputs_embeds", "token_type_ids"})


@functools.lru_cache(maxsize=None)
def ignored_kwargs() -> frozenset:
    """Keywords that transformers' own sdpa/eager attention functions ignore and that cannot change the
    attention result, derived from the installed transformers:

    - every key of `TransformersKwargs` (the `**kwargs` a model's forward passes down to its attention modules)
      and of `FlashAttentionKwargs` (packing metadata: with a non-flash implementation the mask already encodes
      packed sequences, built from position_ids by masking_utils);
    - every parameter of the loss functions in `transformers.loss.loss_utils.LOSS_MAPPING`: a causal-LM forward
      hands the same **kwargs to its loss and to its decoder (e.g. `shift_labels`, `ignore_index`);
    - `_BOOKKEEPING_KWARGS`.

    Minus the keywords handled explicitly (`_HANDLED_KWARGS`) and `_RESULT_CHANGING`."""
    names = set(_BOOKKEEPING_KWARGS)
    try:
        from transformers.utils.generic import TransformersKwargs
        names |= set(TransformersKwargs.__optional_keys__) | set(TransformersKwargs.__required_keys__)
    except ImportError:
        pass
    try:
        from transformers.modeling_flash_attention_utils import FlashAttentionKwargs
        names |= set(FlashAttentionKwargs.__optional_keys__) | set(FlashAttentionKwargs.__required_keys__)
    except ImportError:
        pass
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING, fixed_cross_entropy
        for fn in {*LOSS_MAPPING.values(), fixed_cross_entropy}:
            try:
                params = inspect.signature(fn).parameters.values()
            except (TypeError, ValueError):
                continue
            names |= {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    except ImportError:
        pass
    return frozenset(names - _HANDLED_KWARGS - _RESULT_CHANGING)


# ---- registration ----------------------------------------------------------------------------------------------

def register() -> None:
    """Register "sage" with transformers. Idempotent: calling it again (or re-importing) changes nothing."""
    from transformers import AttentionInterface, PreTrainedModel
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, sage_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    for meth in ("post_init", "set_attn_implementation"):
        orig = getattr(PreTrainedModel, meth)
        if not getattr(orig, _WRAPPED, False):
            setattr(PreTrainedModel, meth, _bind_after(orig))


def _bind_after(method):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        out = method(self, *args, **kwargs)
        if uses_sage(self):
            bind(self, only_sage=True)
        return out

    setattr(wrapper, _WRAPPED, True)
    return wrapper


def uses_sage(model: torch.nn.Module) -> bool:
    """Whether the model or any of its sub-models has attn_implementation "sage"."""
    return any(getattr(getattr(m, "config", None), "_attn_implementation", None) == NAME for m in model.modules())


# ---- bindings and policies -------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _shipped(family: str) -> Policy:
    return load_policy(shipped_policy_path(family))


def default_policy(model_type: str | None) -> Policy:
    """The shipped policy for a `config.model_type` (see DEFAULT_FAMILY)."""
    return _shipped(DEFAULT_FAMILY.get(model_type, DEFAULT_FAMILY[None]))


@functools.lru_cache(maxsize=None)
def _calls_attention_interface(cls) -> bool:
    try:
        src = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return cls.__name__.endswith("Attention")
    return "ALL_ATTENTION_FUNCTIONS" in src or "attention_interface" in src


def attention_modules(model: torch.nn.Module):
    """(name, module) of every module whose forward calls transformers' attention interface."""
    return [(n, m) for n, m in model.named_modules() if _calls_attention_interface(type(m))]


def bind(model: torch.nn.Module, policy=None, only_sage: bool = False) -> dict[str, LayerBinding]:
    """Bind every attention module of `model` (names relative to `model`); with `only_sage`, only those whose
    config uses "sage" (a composite model may run its vision tower on another implementation). An existing
    binding is kept (its stats, guard and observer too) and renamed; its policy is replaced only when `policy`
    is given, so a policy set before the model is switched to "sage" survives the switch. New bindings get the
    default policy."""
    explicit = None if policy is None else Policy.from_any(policy)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    steps = StepState()
    out = {}
    for name, mod in attention_modules(model):
        impl = getattr(getattr(mod, "config", None), "_attn_implementation", NAME)
        if only_sage and impl != NAME:
            continue
        idx = getattr(mod, "layer_idx", None)
        idx = idx if isinstance(idx, int) else layer_index(name)
        b = getattr(mod, BINDING_ATTR, None)
        if isinstance(b, LayerBinding):
            b.name, b.index, b.stats.name = name, idx, name
            if explicit is not None:
                b.policy = explicit
        else:
            b = LayerBinding(name, idx, explicit or default_policy(model_type), getattr(mod, STATS_ATTR, None), steps)
            b.stats.name = name
            setattr(mod, BINDING_ATTR, b)
        setattr(mod, STATS_ATTR, b.stats)
        out[name] = b
    return out


def set_policy(model: torch.nn.Module, policy) -> dict[str, LayerBinding]:
    """Set the policy of every attention layer of a transformers model: a path, dict, YAML string, Policy or
    precision name; None restores the default for `config.model_type`. Rules match the module names of `model`
    (e.g. "model.layers.3.self_attn") and `module.layer_idx`. Returns the bindings by name."""
    if not uses_sage(model):
        logger.warning("sage_patch.set_policy: %s does not use attn_implementation=%r yet; the policy applies once "
                       "it does (model.set_attn_implementation(%r))", type(model).__name__, NAME, NAME)
    if policy is None:
        policy = default_policy(getattr(getattr(model, "config", None), "model_type", None))
    return bind(model, policy)


def _orphan_binding(module) -> LayerBinding:
    """A module called before any bind() (e.g. config._attn_implementation set by hand): bind it alone."""
    idx = getattr(module, "layer_idx", None)
    name = f"{type(module).__name__}.{idx}"
    cfg = getattr(module, "config", None)
    b = LayerBinding(name, idx, default_policy(getattr(cfg, "model_type", None)), LayerStats(name))
    setattr(module, BINDING_ATTR, b)
    setattr(module, STATS_ATTR, b.stats)
    return b


# ---- the attention function -----------------------------------------------------------------------------------

def sage_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function. query (B, Hq, Sq, D) (often a non-contiguous view), key/value
    (B, Hkv, Skv, D). Returns (attn_output (B, Sq, Hq, D) contiguous, None)."""
    binding = getattr(module, BINDING_ATTR, None) or _orphan_binding(module)
    is_causal = kwargs.pop("is_causal", None)
    is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    sliding_window = kwargs.pop("sliding_window", None)
    softcap = kwargs.pop("softcap", None)
    s_aux = kwargs.pop("s_aux", None)
    if kwargs.pop("output_attentions", False) and not torch.compiler.is_compiling():
        log_fallback_once("output_attentions=True: attention weights are not returned by 'sage' (None)")
    for k in ("position_bias", "cache"):
        if kwargs.get(k) is not None:
            return _delegate_sdpa(binding, k, module, query, key, value, attention_mask, scaling, dropout,
                                  is_causal=is_causal, sliding_window=sliding_window, softcap=softcap,
                                  s_aux=s_aux, **kwargs)
    ignored = ignored_kwargs()
    unknown = sorted(k for k, v in kwargs.items() if v is not None and k not in ignored)
    if unknown:
        raise TypeError(f"sage_patch attention: keyword(s) {unknown} from {type(module).__name__} may change the "
                        f"attention result and are not supported; supported: attention_mask, scaling, dropout, "
                        f"{', '.join(sorted(_HANDLED_KWARGS))}, and ignored bookkeeping keywords "
                        f"(sage_patch.integrations.transformers.ignored_kwargs()); use attn_implementation='eager' "
                        f"for this model, or report it")

    dropout_p = float(dropout) if module.training else 0.0
    q_len, kv_len = query.shape[2], key.shape[2]
    causal_module = bool(is_causal)
    is_causal = q_len > 1 and attention_mask is None and causal_module
    if is_causal and kv_len > q_len:
        # transformers skips the mask of a prefill into an empty, longer (static) cache only when the keys past
        # q_len are unused slots; causal is top-left there (as in transformers' sdpa): keep the first q_len keys.
        key, value, kv_len = key[:, :, :q_len], value[:, :, :q_len], q_len
    if attention_mask is None and sliding_window is not None and kv_len > sliding_window:
        attention_mask = _window_mask(q_len, kv_len, sliding_window, causal_module, query.device)
        is_causal = False
    if softcap is not None or s_aux is not None:
        why = "softcap (logit soft-capping)" if softcap is not None else "s_aux (attention sinks)"
        _record(binding, "eager", f"{why} is not supported by quantized precisions: exact eager attention")
        out = eager_attention(query, key, value, attention_mask, is_causal=is_causal, scale=scaling,
                              softcap=softcap, s_aux=s_aux, dropout_p=dropout_p, training=module.training)
    else:
        out = binding.attention(query, key, value, layout="bhsd", is_causal=is_causal, scale=scaling,
                                attn_mask=attention_mask, dropout_p=dropout_p)
    return out.transpose(1, 2).contiguous(), None


def _record(binding: LayerBinding, impl: str, reason: str) -> None:
    binding.stats.record(Decision(binding.requested(), "full", impl, reason))
    if not torch.compiler.is_compiling():
        log_fallback_once(reason)


def _delegate_sdpa(binding, what, module, query, key, value, attention_mask, scaling, dropout, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise TypeError(f"sage_patch attention: {what} together with softcap/s_aux is not supported")
    _record(binding, "sdpa", f"{what} is not supported by quantized precisions: transformers sdpa")
    kwargs = {k: v for k, v in kwargs.items() if k not in ("softcap", "s_aux")}
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def _window_mask(q_len: int, kv_len: int, window: int, causal: bool, device) -> torch.Tensor:
    """(1, 1, Sq, Skv) bool, as transformers' overlays: causal, key j is visible from query i when
    q_pos - window < j <= q_pos; bidirectional, when |q_pos - j| <= window. q_pos = i + Skv - Sq (the queries
    are the last Sq positions)."""
    q_pos = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    kv = torch.arange(kv_len, device=device)[None, :]
    m = (kv > q_pos - window) & (kv <= q_pos) if causal else (kv - q_pos).abs() <= window
    return m[None, None]


def eager_attention(q, k, v, attn_mask, *, is_causal, scale, softcap=None, s_aux=None, dropout_p=0.0,
                    training=False):
    """Exact attention in fp32 with logit soft-capping (Gemma 2) and per-head sink logits (s_aux, shape (Hq,)).
    q (B, Hq, Sq, D), k/v (B, Hkv, Skv, D); attn_mask bool (True = attend) or float additive; causal bottom-right.
    Returns (B, Hq, Sq, Dv) in q's dtype; rows with no visible key give 0."""
    from sage_patch.masks import causal_mask

    groups = q.shape[1] // k.shape[1]
    kf, vf = (x.float().repeat_interleave(groups, dim=1) if groups > 1 else x.float() for x in (k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q.float() @ kf.transpose(-1, -2)) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        s = s + attn_mask.float()
    elif attn_mask is not None:
        s = s.masked_fill(~attn_mask, -math.inf)
    if is_causal:
        s = s.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], q.device), -math.inf)
    if s_aux is not None:
        sink = s_aux.float().reshape(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)
        s = torch.cat([s, sink], dim=-1)
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    p = torch.where(denom > 0, p / torch.where(denom > 0, denom, 1.0), 0.0)
    if s_aux is not None:
        p = p[..., :-1]
    if dropout_p > 0:
        p = torch.nn.functional.dropout(p, p=dropout_p, training=training)
    return (p @ vf).to(q.dtype)

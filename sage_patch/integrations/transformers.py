"""transformers hook: `attn_implementation="sage"` with per-layer policies.

`register()` registers "sage" with `transformers.AttentionInterface` and, with `sage_mask`, with
`transformers.masking_utils.AttentionMaskInterface` (without a mask function a custom name silently receives
attention_mask=None); `sage_patch.integrations` runs it when transformers is imported. Nothing of transformers is
wrapped: layers are bound (module name, layer index, policy, stats) when sage_patch asks about the model
(`inject`, `set_policy`, `report`, `calibrate`), and a layer called before that binds itself under a provisional name
(renamed, stats kept, at the next of those). Under torch.compile that first call is traced: the binding is then
made by a function dynamo runs as plain Python at trace time (`_bind_unbound`), since a traced forward can neither
create the binding's objects nor read the policy files. `unload(model)` removes the bindings and switches a model
that uses "sage" back to the implementation it had before `inject` ("sdpa" for a model built with "sage").

Default policy: from `config.model_type` through sage_patch/configs/families.yaml (every transformers model type
uses the shipped llama.yaml: 8b, full below 128 tokens, so decode steps run full).

Semantics (each item is tested in tests/test_transformers_integration.py):
- causal: `q_len > 1 and mask is None and module.is_causal` (or the `is_causal` kwarg), aligned bottom-right; when
  transformers skipped the mask of a prefill into a longer static cache (q_len < kv_len, mask None), the keys
  past q_len are empty cache slots and are cut, as transformers' sdpa does;
- masks: a padded batch of a full-attention or sliding-window layer arrives as `sage_mask`'s key padding (B, L)
  bool, which the kernels take (causal from the module, aligned bottom-right; keys past L are a static cache's unused
  slots, cut); every other pattern as sdpa_mask's 4-D bool (True = attend); GQA/MQA K/V are passed with their own
  head count;
- a call the resolver sends to full precision (a dense mask, dropout, a head dim without a
  kernel, the policy's fallback rules, a "full" layer) runs transformers' own `sdpa_attention_forward` with the
  arguments it would have had without sage_patch (a key padding turned back into sdpa_mask's mask): the same torch
  SDPA call, so the same backend and result (rows with no visible key included: what torch gives them), at the cost
  of the decision alone;
- head counts are read from the tensors, never from the config, so tensor parallelism (`tp_plan="auto"`: each rank
  holds Hq/P query and Hkv/P KV heads) needs nothing else; shapes that disagree with `module.num_key_value_groups`
  (q_proj and k_proj/v_proj sharded by different degrees) raise ValueError instead of pairing the wrong heads;
- `sliding_window` (W) with key padding or no mask, on a causal module: the kernels' window, window_left = W - 1
  (transformers' rule: key visible iff q_pos - W < kv_pos <= q_pos; bottom-right as causal, which is how sdpa_mask
  aligns it when a sliding cache holds fewer keys than the position: the keys start at kv_offset), passed only
  when it cuts (Skv > W); a bidirectional module's window (|q_pos - kv_pos| <= W) becomes a dense mask; a 4-D mask
  from sdpa_mask carries its window itself;
- `scaling` is the module's; `dropout` applies only while `module.training` (then full, reported);
- `s_aux` (attention sinks, gpt-oss) runs the layer's precision: the kernel's attention of the real scores, scaled
  by sigmoid(lse - s_aux[h]) from its LSE (sage_patch.api.apply_sinks; exact); a call that goes full (decode steps
  and short prompts under the shipped policy) runs the model's own `eager_attention_forward`, what
  attn_implementation="eager" runs for these models (transformers gives them no sdpa path), reported as impl
  "eager" with the reason;
- `softcap` (Gemma 2) changes every score before the softmax, so it cannot be applied afterwards: every call runs the
  model's own `eager_attention_forward` ("full", impl "eager"; a modeling file without one: exact fp32 attention,
  impl "exact-fp32");
  `position_bias` and a paged `cache` are delegated to transformers' own sdpa function ("full", impl "sdpa");
- keywords that cannot change the result (`ignored_kwargs()`: derived from transformers' TransformersKwargs,
  FlashAttentionKwargs and loss-function signatures, e.g. `shift_labels`) are ignored, as transformers' sdpa and
  eager functions ignore them; any other keyword with a non-None value raises TypeError instead of being dropped.
"""
from __future__ import annotations

import ctypes
import inspect
import logging
import sys
import weakref

import torch

from sage_patch.masks import combined_bool_mask, window_mask
from sage_patch.policy import Policy, default_policy
from sage_patch.reference import exact_attention
from sage_patch.report import log_fallback_once
from sage_patch.binding import (BINDING_ATTR, LayerBinding, Recogniser, StepState, attach, detach,
                                register_recogniser, select_modules, warn_unmatched_rules)

logger = logging.getLogger("sage_patch")

NAME = "sage"
LIBRARY = "transformers"
_PREVIOUS_IMPL = "_sage_patch_previous_attn_implementation"  # on a model that inject() switched to "sage"

# An attention module is one whose forward calls transformers' attention interface.
register_recogniser(LIBRARY, Recogniser(forward_mentions=("ALL_ATTENTION_FUNCTIONS", "attention_interface"),
                                        class_suffixes=("Attention",)))

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


_IGNORED: list[frozenset] = []  # ignored_kwargs(), computed once (a plain memo: every traced forward reads it)


def ignored_kwargs() -> frozenset:
    """Keywords that transformers' own sdpa/eager attention functions ignore and that cannot change the
    attention result, derived from the installed transformers:

    - every key of `TransformersKwargs` (the `**kwargs` a model's forward passes down to its attention modules)
      and of `FlashAttentionKwargs` (packing metadata: with a non-flash implementation the mask already encodes
      packed sequences, built from position_ids by masking_utils);
    - every parameter of the loss functions in `transformers.loss.loss_utils.LOSS_MAPPING`: a causal-LM forward
      hands the same **kwargs to its loss and to its decoder (e.g. `shift_labels`, `ignore_index`);
    - `_BOOKKEEPING_KWARGS`.

    Minus the keywords handled explicitly (`_HANDLED_KWARGS`) and `_RESULT_CHANGING`. Computed once, when a layer
    is bound (not functools.lru_cache: torch.compile warns at every trace that it ignores that wrapper)."""
    if not _IGNORED:
        _IGNORED.append(_derive_ignored_kwargs())
    return _IGNORED[0]


def _derive_ignored_kwargs() -> frozenset:
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


# ---- registration and lifecycle --------------------------------------------------------------------------------

def register() -> None:
    """Register "sage" with transformers. Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, sage_attention_forward)
    AttentionMaskInterface.register(NAME, sage_mask)


def unregister() -> None:
    """Undo `register()` (sage_patch.uninstall)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for iface in (AttentionInterface, AttentionMaskInterface):
        iface._global_mapping.pop(NAME, None)


# ---- the mask function ------------------------------------------------------------------------------------------

def sage_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
              allow_is_causal_skip=True, **kwargs):
    """The mask function of "sage" (transformers' AttentionMaskInterface). Two patterns of a causal decoder come back
    as what the kernels take, with no (Sq, Skv) tensor built: a padded batch of a full-attention layer
    (create_causal_mask with transformers' plain `causal_mask_function`: no overlay, no packed sequences) and of a
    sliding-window layer (create_sliding_window_causal_mask's plain pattern, `_is_sliding_pattern`; the window itself
    reaches the attention as its `sliding_window` keyword, as in transformers' flash path). What comes back is the
    2-D key-padding mask (B, L) bool, True = attend, over the L <= kv_length keys the layer attends (L < kv_length: a
    static cache, whose slots past the tokens seen are unused; the attention cuts them, as transformers' flash path
    does), or None when nothing is padded. A sliding layer's keys start at kv_offset (a sliding cache holds the last
    sliding_window - 1 tokens): its key padding is the 2-D mask's columns kv_offset.. kv_offset + L, as sdpa_mask
    indexes them. The attention function reads a 2-D mask as key padding under the module's causal rule, aligned
    bottom-right: the queries are the last Sq of the L keys (prefill, chunked prefill and decoding with a KV cache).
    Everything else gets transformers' `sdpa_mask`, unchanged: other patterns (chunked attention, overlays, packing,
    bidirectional), a full-attention layer without a 2-D mask, a caller that asks for the mask materialized
    (allow_is_causal_skip=False: models that add to it, bidirectional windows, and compileable caches at decode,
    where sdpa_mask's mask is (B, 1, 1, Skv) key padding anyway), and queries that are not the last of the keys
    (kv_offset != 0 on a full-attention layer, or a known q_offset + q_length != kv_offset + L: MTP and speculative
    caches). A sliding layer without a 2-D mask gets None (q_length == 1 or q_length == kv_length, and the window
    does not cut: sdpa_mask's own rule) or an all-True key padding, in eager mode; under torch.compile it keeps sdpa_mask (packed sequences are told apart only by the
    mask function's closure, which a traced call cannot read for them).

    Host syncs: the mask's values are read (one `fast_all`, once per forward, eager only) where sdpa_mask reads them
    (`_ignore_causal_mask_sdpa`: q_length == 1 or q_length == kv_length) to return None for an unpadded batch, which
    then keeps SDPA's speed routing; transformers' flash path reads `.all()` in flash_attention_mask too, and then
    a `.item()` per layer to unpad. While tracing (torch.compile) nothing is read: the mask is returned as is."""
    from transformers.masking_utils import causal_mask_function, fast_all, sdpa_mask
    from transformers.utils.import_utils import is_tracing

    mask_function = causal_mask_function if mask_function is None else mask_function
    mask = attention_mask
    two_d = isinstance(mask, torch.Tensor) and mask.dim() == 2
    sliding = (allow_is_causal_skip and (two_d or (mask is None and not torch.compiler.is_compiling()))
               and isinstance(kv_offset, int) and kv_offset >= 0 and _is_sliding_pattern(mask_function, kwargs))
    plain = sliding or (mask_function is causal_mask_function and allow_is_causal_skip and two_d
                        and isinstance(kv_offset, int) and kv_offset == 0)
    length = 0
    if plain:
        if mask is None:  # no padding: the keys up to the last query (a tensor q_offset, a static cache, is not read)
            length = q_offset + q_length - kv_offset if isinstance(q_offset, int) else 0
        else:
            if sliding and (kv_offset > 0 or mask.shape[-1] > kv_length):
                mask = mask[:, kv_offset:kv_offset + kv_length]
            length = mask.shape[-1]
        # a static cache's q_offset is a tensor (its fill level, not read here): the mask's length says it instead
        plain = 1 <= length <= kv_length and (not isinstance(q_offset, int)
                                              or q_offset + q_length == kv_offset + length)
    if not plain:
        return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                         kv_offset=kv_offset, mask_function=mask_function,
                         attention_mask=attention_mask, allow_is_causal_skip=allow_is_causal_skip, **kwargs)
    # what sdpa_mask skips (_ignore_causal_mask_sdpa): not a window that cuts, whose mask its sdpa path needs
    skippable = (q_length == 1 or q_length == kv_length) and length == kv_length and not (
        sliding and kv_length >= kwargs["local_size"])
    if mask is None:
        return None if skippable else _new_key_padding(
            torch.ones(batch_size, length, dtype=torch.bool, device=kwargs.get("device")))
    mask = mask.to(torch.bool)
    if skippable and not is_tracing(mask) and fast_all(mask):
        return None
    return _new_key_padding(mask)


_AND_MASK_CODE: list = []  # the code object of transformers' and_masks closure (read once)


def _is_sliding_pattern(mask_function, kwargs) -> bool:
    """Whether a mask request is create_sliding_window_causal_mask's plain pattern (causal, a window of `local_size`
    keys, nothing overlaid): the mask function is equivalent to transformers' own
    `sliding_window_causal_mask_function(local_size)`, rebuilt here and compared by code and closure values
    (`_same_function`), so an overlay, packed sequences or another window never pass. First the facts a traced call
    can read (a traced call hands `_same_mask_function` the function as a constant, which only works when its
    closure holds no tensor): local_size is the config's sliding_window and not its attention chunk, no overlay
    (use_vmap), and the function is an `and_masks` (an or_masks overlay, e.g. block_sequence_ids, is not)."""
    from transformers.masking_utils import and_masks, causal_mask_function

    local_size, config = kwargs.get("local_size"), kwargs.get("config")
    if isinstance(local_size, bool) or not isinstance(local_size, int) or local_size < 1 or kwargs.get("use_vmap"):
        return False
    if config is not None and (getattr(config, "sliding_window", None) != local_size
                               or getattr(config, "attention_chunk_size", None) == local_size):
        return False
    if not _AND_MASK_CODE:
        _AND_MASK_CODE.append(and_masks(causal_mask_function).__code__)
    if getattr(mask_function, "__code__", None) is not _AND_MASK_CODE[0]:
        return False
    return _same_mask_function(mask_function, local_size)


def _same_mask_function(mask_function, local_size: int) -> bool:
    """`mask_function` is transformers' sliding_window_causal_mask_function(local_size), up to identity. Plain
    Python at trace time under torch.compile (marked below: dynamo passes the function rebuilt from its closure's
    constants, and keeps the answer as a constant)."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    return _same_function(mask_function, sliding_window_causal_mask_function(local_size))


_same_mask_function._dynamo_marked_constant = True  # what torch._dynamo.assume_constant_result sets


def _same_function(a, b, depth: int = 0) -> bool:
    """Structural equality of two closures: the same code, defaults and closure values (functions compared the same
    way, tuples element-wise, ints/strings/None by value; anything else, a tensor included, only by identity)."""
    if a is b:
        return True
    if depth > 8:
        return False
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same_function(x, y, depth + 1) for x, y in zip(a, b))
    if inspect.isfunction(a) and inspect.isfunction(b):
        ca, cb = a.__closure__ or (), b.__closure__ or ()
        return (a.__code__ is b.__code__ and a.__defaults__ == b.__defaults__ and len(ca) == len(cb)
                and all(_same_function(x.cell_contents, y.cell_contents, depth + 1) for x, y in zip(ca, cb)))
    return type(a) is type(b) and isinstance(a, (int, float, str, type(None))) and a == b


def handles(model) -> bool:
    return isinstance(model, torch.nn.Module) and hasattr(model, "set_attn_implementation") and \
        hasattr(model, "config")


def uses_sage(model: torch.nn.Module) -> bool:
    """Whether the model or any of its sub-models has attn_implementation "sage"."""
    return any(getattr(getattr(m, "config", None), "_attn_implementation", None) == NAME for m in model.modules())


def bind(model: torch.nn.Module, policy=None, only_sage: bool = False) -> dict[str, LayerBinding]:
    """Bind every attention module of `model` (names relative to `model`); with `only_sage`, only those whose
    config uses "sage" (a composite model may run its vision tower on another implementation). An existing
    binding keeps its stats, observer and, unless `policy` is given, its policy and runtime-guard demotions (so a
    policy set before the model is switched to "sage" survives the switch; a given policy clears the demotions).
    New bindings get the default policy."""
    explicit = None if policy is None else Policy.from_any(policy)
    ignored_kwargs()  # computed here, in plain Python, before any traced forward reads it
    steps, out = StepState(), {}
    for name, mod in select_modules(model, LIBRARY):
        if only_sage and getattr(getattr(mod, "config", None), "_attn_implementation", NAME) != NAME:
            continue
        old = getattr(mod, BINDING_ATTR, None)
        pol = explicit or (old.policy if isinstance(old, LayerBinding) else default_policy(LIBRARY, model))
        idx = getattr(mod, "layer_idx", None)
        out[name] = attach(mod, name, pol, None if isinstance(old, LayerBinding) else steps,
                           idx if isinstance(idx, int) else None, new_policy=explicit is not None)
    if explicit is not None:
        warn_unmatched_rules(explicit, out.values(), type(model).__name__)
    return out


def sync(model) -> None:
    """Bind the layers of a model that uses "sage" (before report/calibrate read them)."""
    if uses_sage(model):
        bind(model, only_sage=True)


def inject(model: torch.nn.Module, policy=None) -> dict[str, LayerBinding]:
    """Switch `model` to "sage" (remembering its implementation for `unload`) and bind its layers under `policy`
    (None: the family default, or the policy already set)."""
    if not uses_sage(model):
        setattr(model, _PREVIOUS_IMPL, model.config._attn_implementation)
        model.set_attn_implementation(NAME)
    return bind(model, policy, only_sage=True)


def unload(model: torch.nn.Module) -> None:
    """Remove every binding; a model that uses "sage" goes back to its implementation before `inject` ("sdpa"
    for a model built with "sage")."""
    for _name, mod in select_modules(model, LIBRARY):
        detach(mod)
    if uses_sage(model):
        model.set_attn_implementation(model.__dict__.pop(_PREVIOUS_IMPL, None) or "sdpa")


def set_policy(model: torch.nn.Module, policy) -> dict[str, LayerBinding]:
    """Set the policy of every attention layer of a transformers model: a path, dict, YAML string, Policy or
    precision name; None restores the default for `config.model_type`. Rules match the module names of `model`
    (e.g. "model.layers.3.self_attn") and `module.layer_idx`. Returns the bindings by name."""
    if not uses_sage(model):
        logger.warning("sage_patch.set_policy: %s does not use attn_implementation=%r yet; the policy applies once "
                       "it does (model.set_attn_implementation(%r))", type(model).__name__, NAME, NAME)
    return bind(model, default_policy(LIBRARY, model) if policy is None else policy)


def family_policy(model) -> Policy:
    """The policy `inject(model)` uses when none is given: by config.model_type (sage_patch/configs/families.yaml)."""
    return default_policy(LIBRARY, model)


def _provisional_binding(module) -> LayerBinding:
    """A layer called before sage_patch bound its model: bind it alone, named by class and layer index."""
    idx = getattr(module, "layer_idx", None)
    ignored_kwargs()  # computed here, in plain Python, before any traced forward reads it
    return attach(module, f"{type(module).__name__}.{idx}", default_policy(LIBRARY, module), index=idx)


def _bind_unbound(module_id: int) -> None:
    """`_provisional_binding` for a layer without a binding, run at trace time as plain Python (marked below:
    torch.compile calls it with constant arguments and keeps its result, None, as a constant). The traced forward
    then reads the new binding as the module's attribute, as for a layer bound before (no recompile at the next
    call; tests/test_transformers_integration.py). The layer is passed as its id(), which dynamo makes a constant
    (guarded on the module's identity): torch 2.11's dynamo cannot hand a module to such a function (its modules
    inside a compiled model are not constants there); the module is alive, being called, so the id names it."""
    module = ctypes.cast(module_id, ctypes.py_object).value
    if getattr(module, BINDING_ATTR, None) is None:
        _provisional_binding(module)


_bind_unbound._dynamo_marked_constant = True  # what torch._dynamo.assume_constant_result sets, without dynamo


# ---- the attention function -----------------------------------------------------------------------------------

def sage_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function. query (B, Hq, Sq, D) (often a non-contiguous view), key/value
    (B, Hkv, Skv, D). Returns (attn_output (B, Sq, Hq, D) contiguous, None)."""
    _check_head_grouping(module, query, key)
    binding = getattr(module, BINDING_ATTR, None)
    if binding is None and torch.compiler.is_compiling():
        _bind_unbound(id(module))
        binding = getattr(module, BINDING_ATTR)
    binding = binding or _provisional_binding(module)
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
    unknown = [k for k, v in kwargs.items() if v is not None and k not in ignored]
    if unknown:
        raise TypeError(f"sage_patch attention: keyword(s) {sorted(unknown)} from {type(module).__name__} may change the "
                        f"attention result and are not supported; supported: attention_mask, scaling, dropout, "
                        f"{', '.join(sorted(_HANDLED_KWARGS))}, and ignored bookkeeping keywords "
                        f"(sage_patch.integrations.transformers.ignored_kwargs()); use attn_implementation='eager' "
                        f"for this model, or report it")

    dropout_p = float(dropout) if module.training else 0.0
    key_in, value_in, mask_in = key, value, attention_mask  # as received: transformers' sdpa does its own cuts
    q_len, kv_len = query.shape[2], key.shape[2]
    causal_module = bool(is_causal)
    key_padding = _is_key_padding(attention_mask)
    if key_padding:
        # sage_mask's key padding (B, L): causal is the module's, aligned bottom-right (the queries are the last of
        # the L keys); keys past L are a static cache's unused slots, cut as transformers' flash path cuts them.
        # Checked here: a call decided by rule (binding.full_by_rule) reaches no other check of the mask's shape.
        if attention_mask.shape[0] != query.shape[0] or attention_mask.shape[-1] > kv_len:
            raise ValueError(f"sage_patch attention: a 2-D bool attention_mask is key padding (B, L) over the first "
                             f"L <= Skv keys; got shape {tuple(attention_mask.shape)} with B={query.shape[0]}, "
                             f"Skv={kv_len}")
        if attention_mask.shape[-1] < kv_len:
            kv_len = attention_mask.shape[-1]
            key, value = key[:, :, :kv_len], value[:, :, :kv_len]
        is_causal = q_len > 1 and causal_module
    else:
        is_causal = q_len > 1 and attention_mask is None and causal_module
    if is_causal and kv_len > q_len and attention_mask is None:
        # transformers skips the mask of a prefill into an empty, longer (static) cache only when the keys past
        # q_len are unused slots; causal is top-left there (as in transformers' sdpa): keep the first q_len keys.
        key, value, kv_len = key[:, :, :q_len], value[:, :, :q_len], q_len
    window_left = -1
    if (attention_mask is None or key_padding) and sliding_window is not None and kv_len > sliding_window:
        if causal_module:  # transformers: q_pos - sliding_window < kv_pos <= q_pos; the kernels: FA's (left, 0)
            window_left = sliding_window - 1
        else:  # bidirectional, |q_pos - kv_pos| <= sliding_window: no one-sided kernel rule, a dense mask
            window = window_mask(q_len, kv_len, sliding_window, sliding_window, query.device)[None, None]
            attention_mask = window if attention_mask is None else window & attention_mask[:, None, None, :]
            is_causal = False
    if softcap is not None or s_aux is not None:
        # What transformers itself runs for these models (their _supports_sdpa is False): the model's own eager
        # function, on the mask its eager path would build from what sage_mask gave.
        eager = _ModelEager(module, query, key_in, value_in, mask_in, scaling, dropout, causal_module,
                            sliding_window, softcap, s_aux)
    if softcap is not None:
        # Soft-capping changes every score before the softmax: it cannot be applied after the kernel's attention.
        binding.record_fallback(eager.impl, "softcap (logit soft-capping) is not supported by quantized precisions: "
                                            + eager.what)
        out = eager()
    elif s_aux is not None:
        # Sinks are applied to the kernel's (or simulation's) output from its LSE (api.apply_sinks); a call the
        # policy sends to full precision runs the model's eager function.
        kw = dict(layout="bhsd", is_causal=is_causal, scale=scaling, attn_mask=attention_mask, dropout_p=dropout_p,
                  full=eager, sinks=s_aux, window_left=window_left)
        out = binding.attention(query, key, value, **kw) if binding.passes_full() else \
            binding.run(query, key, value, **kw)
    else:
        def transformers_sdpa():
            # A full-precision decision runs transformers' own sdpa function on what it would have received (its
            # mask object, GQA handling, contiguity, hence its SDPA backend): the fallback costs only the decision.
            # Returns its (B, Sq, H, D) contiguous output.
            if attention_mask is mask_in:  # key padding (and the window) back to what sdpa_mask would have given
                k_, v_ = (key, value) if mask_in is None and window_left >= 0 else (key_in, value_in)
                mask = sdpa_equivalent_mask(mask_in, causal_module, q_len, k_.shape[2], sliding_window,
                                            device=query.device)
            else:  # a window mask built here, over the keys it was built for
                k_, v_, mask = key, value, attention_mask
            return _transformers_sdpa()(module, query, k_, v_, mask, dropout=dropout_p, scaling=scaling,
                                        is_causal=causal_module)[0]

        def full():  # (B, H, Sq, D) view: the transpose(1, 2).contiguous() below is then free
            return transformers_sdpa().transpose(1, 2)

        if binding.full_by_rule(query, key, value, layout="bhsd", attn_mask=attention_mask, dropout_p=dropout_p):
            return transformers_sdpa(), None  # eager, full by a rule (decode steps under min_seq_len): counted
        if binding.passes_full():  # traced with the model under torch.compile (counted once per trace)
            out = binding.attention(query, key, value, layout="bhsd", is_causal=is_causal, scale=scaling,
                                    attn_mask=attention_mask, dropout_p=dropout_p, full=full,
                                    window_left=window_left)
        else:  # one opaque op under torch.compile, counted each time it runs (as in diffusers)
            out = binding.run(query, key, value, layout="bhsd", is_causal=is_causal, scale=scaling,
                              attn_mask=attention_mask, dropout_p=dropout_p, full=full, window_left=window_left)
    return out.transpose(1, 2).contiguous(), None


class _ModelEager:
    """The full-precision call of a layer with softcap or attention sinks: the module-level `eager_attention_forward`
    of the module's modeling file (what attn_implementation="eager" runs; transformers has no sdpa path for these,
    and flash/flex are other kernels), called as the model calls it, with the mask transformers' `eager_mask` gives
    it (sdpa_mask's bool mask, 0 / dtype-min additive; the window added where sage_mask left it out). A modeling file
    without one gets the exact attention in fp32 with softcap and sinks. Returns (B, Hq, Sq, D), as `full` does
    (run_attention); `impl` and `what` name it in the report."""

    def __init__(self, module, query, key, value, mask, scaling, dropout, causal, sliding_window, softcap, s_aux):
        self.args = (module, query, key, value, mask, scaling, dropout, causal, sliding_window, softcap, s_aux)
        self.fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        self.impl = "eager" if self.fn is not None else "exact-fp32"
        self.what = ("the model's eager attention (eager_attention_forward of "
                     f"{type(module).__module__}), as attn_implementation='eager' runs it" if self.fn is not None else
                     f"exact attention in fp32 ({type(module).__module__} has no eager_attention_forward)")
        self.reason = "attention sinks: full precision runs " + self.what

    def __call__(self):
        module, query, key, value, mask, scaling, dropout, causal, window, softcap, s_aux = self.args
        q_len, kv_len = query.shape[2], key.shape[2]
        # sdpa_mask's masks carry the window; None and sage_mask's key padding do not
        add_window = window is not None and (mask is None or _is_key_padding(mask))
        if _is_key_padding(mask):  # keys past the mask's length are a static cache's unused slots
            kv_len = mask.shape[-1]
            key, value = key[:, :, :kv_len], value[:, :, :kv_len]
            mask = sdpa_equivalent_mask(mask, causal, q_len, kv_len, window)
        elif mask is None:
            if causal and q_len > 1 and kv_len > q_len:  # a skipped prefill mask of an empty static cache
                key, value, kv_len = key[:, :, :q_len], value[:, :, :q_len], q_len
            mask = sdpa_equivalent_mask(None, causal, q_len, kv_len, window, device=query.device)
            if mask is None and causal and q_len > 1:  # the eager function does not apply causal itself
                mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
                mask = mask[None, None]
        if add_window and not causal and kv_len > window:  # a bidirectional window: |q_pos - kv_pos| <= W
            w = window_mask(q_len, kv_len, window, window, query.device)[None, None]
            mask = w if mask is None else mask & w
        if self.fn is None:
            return exact_attention(query, key, value, scale=scaling, attn_mask=mask, dtype=torch.float32,
                                   softcap=softcap, sinks=s_aux,
                                   dropout_p=dropout if module.training else 0.0).to(query.dtype)
        if mask is not None and mask.dtype == torch.bool:
            mask = torch.where(mask, torch.zeros((), dtype=query.dtype, device=mask.device),
                               torch.finfo(query.dtype).min)
        out, _ = self.fn(module, query, key, value, mask, dropout=dropout, scaling=scaling, softcap=softcap,
                         s_aux=s_aux, sliding_window=window)
        return out.transpose(1, 2)  # (B, H, Sq, D) view of the contiguous (B, Sq, H, D)


_SDPA_FORWARD: list = []  # transformers' sdpa_attention_forward, imported at the first full-precision call


def _transformers_sdpa():
    """transformers' own sdpa attention function (a module-level memo: an import statement at every decode step
    of every layer costs more than the rest of the decision)."""
    if not _SDPA_FORWARD:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        _SDPA_FORWARD.append(sdpa_attention_forward)
    return _SDPA_FORWARD[0]


def _check_head_grouping(module, query, key) -> None:
    """Head counts come from the tensors (under tensor parallelism each rank holds Hq/P query and Hkv/P KV heads);
    the module's `num_key_value_groups` is the one attribute they must agree with: transformers' own eager and sdpa
    functions repeat each KV head that many times. A tensor-parallel plan that shards q_proj but not k_proj/v_proj
    (or shards them by different degrees) breaks it; the grouping the shapes alone imply would pair query heads
    with the wrong KV heads, a silently wrong result (transformers' sdpa with enable_gqa runs it too). Shapes are
    the same on every rank, so every rank raises: no rank is left waiting in a collective."""
    groups = getattr(module, "num_key_value_groups", None)
    hq, hkv = query.shape[1], key.shape[1]
    if isinstance(groups, int) and hkv * groups != hq:
        raise ValueError(
            f"sage_patch attention: {type(module).__name__} (layer {getattr(module, 'layer_idx', None)}) received "
            f"{hq} query heads and {hkv} key/value heads, but its num_key_value_groups={groups} requires "
            f"{hkv * groups} query heads ({groups} per KV head). Under tensor parallelism q_proj, k_proj and "
            f"v_proj must be sharded by the same degree (tp_plan 'colwise' on all three), and the query and "
            f"key/value head counts must both divide by the TP size")


def _delegate_sdpa(binding, what, module, query, key, value, attention_mask, scaling, dropout, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise TypeError(f"sage_patch attention: {what} together with softcap/s_aux is not supported")
    binding.record_fallback("sdpa", f"{what} is not supported by quantized precisions: transformers sdpa")
    kwargs = {k: v for k, v in kwargs.items() if k not in ("softcap", "s_aux")}
    attention_mask = sdpa_equivalent_mask(attention_mask, bool(kwargs.get("is_causal")), query.shape[2], key.shape[2],
                                          kwargs.get("sliding_window"), device=query.device)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def _is_key_padding(mask) -> bool:
    """A mask from `sage_mask`: 2-D bool (B, L). Neither sdpa_mask nor a user's 4-D mask is 2-D."""
    return isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.dtype == torch.bool


# The key paddings `sage_mask` returned, and what `sdpa_equivalent_mask` turned each into: id -> (weak reference,
# {(causal, q_len, kv_len, window): dense mask}). transformers calls the mask function once per forward and mask
# type (a model with sliding and full layers: twice) and hands the object it returned to every layer of that type, so
# a forward whose layers run full (decode steps under the shipped policy, a head dim without a kernel) builds
# sdpa_mask's mask once per mask type, as transformers' sdpa does, not once per layer. An entry is replaced when
# `sage_mask` returns the same object again (so a mask modified in place between forwards is converted again) and
# dropped when the key padding is freed (so the dense masks do not outlive it).
_KEY_PADDINGS: dict = {}


def _forget_key_padding(ref) -> None:
    for k, (r, _) in list(_KEY_PADDINGS.items()):
        if r is ref:
            del _KEY_PADDINGS[k]


def _new_key_padding(mask: torch.Tensor) -> torch.Tensor:
    """`sage_mask` returns `mask`, the key padding of one forward: its dense forms are built at most once each."""
    if not torch.compiler.is_compiling():
        _KEY_PADDINGS[id(mask)] = (weakref.ref(mask, _forget_key_padding), {})
    return mask


def sdpa_equivalent_mask(mask, causal: bool, q_len: int, kv_len: int, sliding_window: int | None = None, *,
                         device=None):
    """The mask transformers' own sdpa function needs for what `mask` means here (a path that hands the call to it):
    `sage_mask`'s key padding (B, L) becomes the (B, 1, Sq, Skv) bool mask sdpa_mask builds (causal bottom-right
    over the first L keys, the unused static-cache slots past L masked), with a causal layer's `sliding_window`
    (transformers' rule q_pos - sliding_window < kv_pos <= q_pos, the queries the last of the L keys); None with a
    causal window that cuts (kv_len > sliding_window) becomes that window's (1, 1, Sq, Skv) mask on `device`; any
    other mask is returned as is (sdpa_mask's own masks carry their window). The layers of one forward asking about
    a key padding `sage_mask` returned get one dense mask object, built once (eager only: a traced forward builds it
    where it is used, in the graph)."""
    window_left = sliding_window - 1 if causal and sliding_window is not None else -1
    if mask is None and window_left >= 0 and kv_len > sliding_window:
        return combined_bool_mask(None, q_len > 1, q_len, kv_len, device, window_left)[None, None]
    if not _is_key_padding(mask):
        return mask
    causal = causal and q_len > 1
    memo = None
    if not torch.compiler.is_compiling():
        entry = _KEY_PADDINGS.get(id(mask))
        memo = entry[1] if entry is not None and entry[0]() is mask else None
        m = None if memo is None else memo.get((causal, q_len, kv_len, window_left))
        if m is not None:
            return m
    m = combined_bool_mask(mask, causal, q_len, mask.shape[-1], mask.device, window_left)
    m = m.expand(mask.shape[0], 1, q_len, mask.shape[-1])
    m = torch.nn.functional.pad(m, (0, kv_len - mask.shape[-1]), value=False)
    if memo is not None:
        memo[(causal, q_len, kv_len, window_left)] = m
    return m

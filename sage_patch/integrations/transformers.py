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
- masks: a padded batch of a full-attention layer arrives as `sage_mask`'s key padding (B, L) bool, which the
  kernels take (causal from the module, aligned bottom-right; keys past L are a static cache's unused slots, cut);
  every other pattern as sdpa_mask's 4-D bool (True = attend); GQA/MQA K/V are passed with their own head count;
- a call the resolver sends to full precision (a dense mask such as a sliding window, dropout, a head dim without a
  kernel, the policy's fallback rules, a "full" layer) runs transformers' own `sdpa_attention_forward` with the
  arguments it would have had without sage_patch (a key padding turned back into sdpa_mask's mask): the same torch
  SDPA call, so the same backend and result (rows with no visible key included: what torch gives them), at the cost
  of the decision alone;
- head counts are read from the tensors, never from the config, so tensor parallelism (`tp_plan="auto"`: each rank
  holds Hq/P query and Hkv/P KV heads) needs nothing else; shapes that disagree with `module.num_key_value_groups`
  (q_proj and k_proj/v_proj sharded by different degrees) raise ValueError instead of pairing the wrong heads;
- `sliding_window`: carried by the mask; if the mask is None while the window would cut keys, it is built here;
- `scaling` is the module's; `dropout` applies only while `module.training` (then full, reported);
- `softcap` (Gemma 2) and `s_aux` (attention sinks) run the exact attention in fp32 ("full", impl "eager");
  `position_bias` and a paged `cache` are delegated to transformers' own sdpa function ("full", impl "sdpa");
- keywords that cannot change the result (`ignored_kwargs()`: derived from transformers' TransformersKwargs,
  FlashAttentionKwargs and loss-function signatures, e.g. `shift_labels`) are ignored, as transformers' sdpa and
  eager functions ignore them; any other keyword with a non-None value raises TypeError instead of being dropped.
"""
from __future__ import annotations

import inspect
import logging
import weakref

import torch

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
    """The mask function of "sage" (transformers' AttentionMaskInterface). The pattern of a padded batch of a
    full-attention decoder (create_causal_mask with transformers' plain `causal_mask_function`: no overlay, no
    packed sequences) comes back as what the kernels take, with no (Sq, Skv) tensor built: the 2-D key-padding
    mask (B, L) bool, True = attend, over the first L <= kv_length keys (L < kv_length: a static cache, whose slots
    past the tokens seen are unused; the attention cuts them, as transformers' flash path does), or None when nothing
    is padded. The attention function reads a 2-D mask as key padding under the module's causal rule, aligned
    bottom-right: the queries are the last Sq of the L keys (prefill, chunked prefill and decoding with a KV cache).
    Everything else gets transformers' `sdpa_mask`, unchanged: other patterns (sliding windows, chunked attention,
    overlays, packing, bidirectional), no 2-D mask, a caller that asks for the mask materialized
    (allow_is_causal_skip=False: models that add to it, and compileable caches at decode, where sdpa_mask's mask is
    (B, 1, 1, Skv) key padding anyway), and queries that are not the last of the keys (kv_offset != 0, or a known
    q_offset + q_length != L: MTP and speculative caches).

    Host syncs: the mask's values are read (one `fast_all`, once per forward, eager only) where sdpa_mask reads them
    (`_ignore_causal_mask_sdpa`: q_length == 1 or q_length == kv_length) to return None for an unpadded batch, which
    then keeps SDPA's speed routing; transformers' flash path reads `.all()` in flash_attention_mask too, and then
    a `.item()` per layer to unpad. While tracing (torch.compile) nothing is read: the mask is returned as is."""
    from transformers.masking_utils import causal_mask_function, fast_all, sdpa_mask
    from transformers.utils.import_utils import is_tracing

    mask_function = causal_mask_function if mask_function is None else mask_function
    mask = attention_mask
    plain = (mask_function is causal_mask_function and allow_is_causal_skip and isinstance(mask, torch.Tensor)
             and mask.dim() == 2 and isinstance(kv_offset, int) and kv_offset == 0)
    if plain:
        length = mask.shape[-1]
        # a static cache's q_offset is a tensor (its fill level, not read here): the mask's length says it instead
        plain = length <= kv_length and (not isinstance(q_offset, int) or q_offset + q_length == length)
    if not plain:
        return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                         kv_offset=kv_offset, mask_function=mask_function,
                         attention_mask=attention_mask, allow_is_causal_skip=allow_is_causal_skip, **kwargs)
    mask = mask.to(torch.bool)
    if (q_length == 1 or q_length == kv_length) and length == kv_length and not is_tracing(mask) \
            and fast_all(mask):
        return None
    return _new_key_padding(mask)


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


def _bind_unbound(module) -> None:
    """`_provisional_binding` for a layer without a binding, run at trace time as plain Python (marked below:
    torch.compile calls it with the real module and keeps its result, None, as a constant). The traced forward
    then reads the new binding as the module's attribute, as for a layer bound before (no recompile at the next
    call; tests/test_transformers_integration.py)."""
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
        _bind_unbound(module)
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
    if (attention_mask is None or key_padding) and sliding_window is not None and kv_len > sliding_window:
        window = _window_mask(q_len, kv_len, sliding_window, causal_module, query.device)
        attention_mask = window if attention_mask is None else window & attention_mask[:, None, None, :]
        is_causal = False
    if softcap is not None or s_aux is not None:
        why = "softcap (logit soft-capping)" if softcap is not None else "s_aux (attention sinks)"
        binding.record_fallback("eager", f"{why} is not supported by quantized precisions: exact eager attention")
        out = exact_attention(query, key, value, is_causal=is_causal, scale=scaling, attn_mask=attention_mask,
                              dtype=torch.float32, softcap=softcap, sinks=s_aux, dropout_p=dropout_p).to(query.dtype)
    else:
        def transformers_sdpa():
            # A full-precision decision runs transformers' own sdpa function on what it would have received (its
            # mask object, GQA handling, contiguity, hence its SDPA backend): the fallback costs only the decision.
            # Returns its (B, Sq, H, D) contiguous output.
            if attention_mask is mask_in:  # key padding goes back to what sdpa_mask would have given
                k_, v_, mask = key_in, value_in, sdpa_equivalent_mask(mask_in, causal_module, q_len, key_in.shape[2])
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
                                    attn_mask=attention_mask, dropout_p=dropout_p, full=full)
        else:  # one opaque op under torch.compile, counted each time it runs (as in diffusers)
            out = binding.run(query, key, value, layout="bhsd", is_causal=is_causal, scale=scaling,
                              attn_mask=attention_mask, dropout_p=dropout_p, full=full)
    return out.transpose(1, 2).contiguous(), None


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
    attention_mask = sdpa_equivalent_mask(attention_mask, bool(kwargs.get("is_causal")), query.shape[2], key.shape[2])
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def _is_key_padding(mask) -> bool:
    """A mask from `sage_mask`: 2-D bool (B, L). Neither sdpa_mask nor a user's 4-D mask is 2-D."""
    return isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.dtype == torch.bool


# The key padding `sage_mask` returned last, and what `sdpa_equivalent_mask` turned it into: (weak reference to it,
# {(causal, q_len, kv_len): dense mask}). transformers calls the mask function once per forward and hands the object
# it returned to every layer, so a forward whose layers run full (decode steps under the shipped policy) builds
# sdpa_mask's mask once, as transformers' sdpa does, not once per layer. The entry is replaced at the next
# `sage_mask` (so a mask modified in place between forwards is converted again) and dropped when the key padding
# is freed (so the dense masks do not outlive it).
_KEY_PADDING: list = [None]


def _forget_key_padding(ref) -> None:
    entry = _KEY_PADDING[0]
    if entry is not None and entry[0] is ref:
        _KEY_PADDING[0] = None


def _new_key_padding(mask: torch.Tensor) -> torch.Tensor:
    """`sage_mask` returns `mask`, the key padding of one forward: its dense forms are built at most once each."""
    if not torch.compiler.is_compiling():
        _KEY_PADDING[0] = (weakref.ref(mask, _forget_key_padding), {})
    return mask


def sdpa_equivalent_mask(mask, causal: bool, q_len: int, kv_len: int):
    """The mask transformers' own sdpa function needs for what `mask` means here (a path that hands the call to it):
    `sage_mask`'s key padding (B, L) becomes the (B, 1, Sq, Skv) bool mask sdpa_mask builds (causal bottom-right
    over the first L keys, the unused static-cache slots past L masked); any other mask is returned as is. The
    layers of one forward asking about the key padding `sage_mask` returned get one dense mask object, built once
    (eager only: a traced forward builds it where it is used, in the graph)."""
    if not _is_key_padding(mask):
        return mask
    causal = causal and q_len > 1
    memo = None
    if not torch.compiler.is_compiling():
        entry = _KEY_PADDING[0]
        memo = entry[1] if entry is not None and entry[0]() is mask else None
        m = None if memo is None else memo.get((causal, q_len, kv_len))
        if m is not None:
            return m
    from sage_patch.masks import combined_bool_mask

    m = combined_bool_mask(mask, causal, q_len, mask.shape[-1], mask.device)
    m = m.expand(mask.shape[0], 1, q_len, mask.shape[-1])
    m = torch.nn.functional.pad(m, (0, kv_len - mask.shape[-1]), value=False)
    if memo is not None:
        memo[(causal, q_len, kv_len)] = m
    return m


def _window_mask(q_len: int, kv_len: int, window: int, causal: bool, device) -> torch.Tensor:
    """(1, 1, Sq, Skv) bool, as transformers' overlays: causal, key j is visible from query i when
    q_pos - window < j <= q_pos; bidirectional, when |q_pos - j| <= window. q_pos = i + Skv - Sq (the queries
    are the last Sq positions)."""
    q_pos = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    kv = torch.arange(kv_len, device=device)[None, :]
    m = (kv > q_pos - window) & (kv <= q_pos) if causal else (kv - q_pos).abs() <= window
    return m[None, None]

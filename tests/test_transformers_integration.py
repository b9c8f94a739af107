"""transformers integration (attn_implementation="sage") on tiny random-weight models, CPU.

Every model is built from a config in milliseconds; the reference is the same weights under transformers' own
"sdpa" (or "eager" for Gemma 2, whose softcapping sdpa refuses). Configs are deep-copied per model because
`_from_config(cfg, attn_implementation=...)` writes the implementation into the config object it is given.
"""
import importlib
import inspect
import warnings

import pytest
import torch
import transformers
from transformers import (
    CompileConfig,
    Gemma2Config,
    Gemma2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import sage_patch
from sage_patch.integrations import transformers as hf
from sage_patch.policy import Policy, shipped_policy_path
from sage_patch.binding import attach

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=0)
WINDOW = 16  # sliding window of the tiny Mistral and Gemma 2: shorter than the prompts, so it matters

MODELS = {
    "llama": (LlamaForCausalLM, lambda: LlamaConfig(**COMMON), "sdpa"),
    "mistral": (MistralForCausalLM, lambda: MistralConfig(**COMMON, sliding_window=WINDOW), "sdpa"),
    "qwen2": (Qwen2ForCausalLM, lambda: Qwen2Config(**COMMON, use_sliding_window=False), "sdpa"),
    "gemma2": (Gemma2ForCausalLM, lambda: Gemma2Config(**COMMON, head_dim=16, sliding_window=WINDOW,
                                                        attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                                        query_pre_attn_scalar=16), "eager"),
}
ALL = list(MODELS)


def build(kind, impl="sage", policy=None, seed=0, **overrides):
    cls, make_cfg, _ = MODELS[kind]
    cfg = make_cfg()
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    model = cls._from_config(cfg, attn_implementation=impl).eval()
    if policy is not None:
        sage_patch.set_policy(model, policy)
    return model


def pair(kind, policy=None, **overrides):
    """(sage model, reference model) with identical weights."""
    sage = build(kind, "sage", policy, **overrides)
    ref = build(kind, MODELS[kind][2], **overrides)
    ref.load_state_dict(sage.state_dict())
    return sage, ref


def batch(lengths, total, seed=1, left=True):
    """input_ids/attention_mask for rows of the given real lengths, padded (left by default) to `total`."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), total, dtype=torch.long)
    am = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        sl = slice(total - n, total) if left else slice(0, n)
        ids[i, sl] = torch.randint(1, 128, (n,), generator=g)
        am[i, sl] = 1
    return ids, am


def cosine(a, b):
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def layers_of(model):
    return sage_patch.report(model).to_dict()


# ---- registration ------------------------------------------------------------------------------------------------

def test_registered_at_import_with_mask_function():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert AttentionInterface._global_mapping["sage"] is hf.sage_attention_forward
    assert AttentionMaskInterface._global_mapping["sage"] is hf.sage_mask
    assert sage_patch.integrations.STATUS["transformers"] == "installed"


def test_register_twice_and_reimport_are_harmless():
    hf.register()
    hf.register()
    mod = importlib.reload(hf)
    mod.register()
    importlib.import_module("sage_patch")
    for meth in ("post_init", "set_attn_implementation"):  # nothing of transformers is wrapped
        assert not hasattr(getattr(transformers.PreTrainedModel, meth), "__wrapped__")
    sage, ref = pair("llama", "full")
    ids, am = batch([20, 14], 20)
    with torch.no_grad():
        torch.testing.assert_close(sage(ids, attention_mask=am).logits, ref(ids, attention_mask=am).logits)
    assert all(st["calls"] == 1 for st in layers_of(sage).values())


def test_all_entry_points_accept_sage():
    _, make_cfg, _ = MODELS["llama"]
    m1 = transformers.AutoModelForCausalLM.from_config(make_cfg(), attn_implementation="sage")
    m2 = build("llama", "sdpa")
    m2.set_attn_implementation("sage")
    for m in (m1, m2):
        assert m.config._attn_implementation == "sage"
        assert list(layers_of(m)) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]


# ---- correctness against transformers' own attention ----------------------------------------------------------

@pytest.mark.parametrize("kind", ALL)
def test_generate_full_matches_reference_batched_with_padding(kind):
    sage, ref = pair(kind, "full")
    ids, am = batch([24, 17, 9], 24)
    kw = dict(input_ids=ids, attention_mask=am, max_new_tokens=8, do_sample=False, output_logits=True,
              return_dict_in_generate=True)
    out, expected = sage.generate(**kw), ref.generate(**kw)
    assert torch.equal(out.sequences, expected.sequences)
    for got, exp in zip(out.logits, expected.logits):
        torch.testing.assert_close(got, exp, atol=1e-4, rtol=1e-4)
    rep = layers_of(sage)
    assert len(rep) == 2 and all(st["calls"] == 8 for st in rep.values())  # prefill + 7 decode steps, per layer


@pytest.mark.parametrize("kind", ALL)
def test_8b_logits_cosine_vs_reference(kind):
    sage, ref = pair(kind)  # default policy: llama.yaml, 8b from 128 tokens on
    ids, am = batch([160, 140], 160)
    with torch.no_grad():
        out, expected = sage(ids, attention_mask=am).logits, ref(ids, attention_mask=am).logits
    real = am.bool()
    assert cosine(out[real], expected[real]) >= 0.999
    for name, st in layers_of(sage).items():
        if kind == "gemma2":  # softcapping: no quantized precision, exact eager instead
            assert st["used"] == {"full": 1} and st["impl"] == {"eager": 1}
            assert any("softcap" in r for r in st["fallbacks"])
        else:
            assert st["used"] == {"8b": 1}, (name, st)


@pytest.mark.parametrize("kind,policy,min_cos", [("llama", "full", None), ("llama", "8b", 0.9995),
                                                 ("qwen2", "8b", 0.9995), ("mistral", "8b", 0.9995)])
def test_left_padded_rows_match_unpadded(kind, policy, min_cos):
    sage = build(kind, policy=policy)
    ids, am = batch([40, 28, 33], 40)
    with torch.no_grad():
        padded = sage(ids, attention_mask=am).logits
        for row, n in enumerate((40, 28, 33)):
            alone = sage(ids[row:row + 1, 40 - n:]).logits[0]
            if min_cos is None:
                torch.testing.assert_close(padded[row, 40 - n:], alone, atol=1e-4, rtol=1e-4)
            else:  # quantization groups differ when padding shifts the tokens; the result must not
                assert cosine(padded[row, 40 - n:], alone) >= min_cos


def test_sliding_window_is_honoured_and_matters():
    sage, ref = pair("mistral", "full")
    no_window = build("mistral", "sdpa", sliding_window=None)
    no_window.load_state_dict(sage.state_dict())
    ids, am = batch([40, 33], 40)
    with torch.no_grad():
        out = sage(ids, attention_mask=am).logits
        torch.testing.assert_close(out, ref(ids, attention_mask=am).logits, atol=1e-5, rtol=1e-5)
        assert (out - no_window(ids, attention_mask=am).logits).abs().max() > 1e-2  # the window cuts keys here


def test_right_padding_matches_reference():
    sage, ref = pair("qwen2", "8b")
    ids, am = batch([40, 25], 40, left=False)
    with torch.no_grad():
        out, expected = sage(ids, attention_mask=am).logits, ref(ids, attention_mask=am).logits
    assert cosine(out[am.bool()], expected[am.bool()]) >= 0.999


def test_chunked_prefill_matches_one_shot():
    """Second chunk: q_len < kv_len with a KV cache; causal must be aligned bottom-right."""
    sage = build("llama", policy="full")
    ids, _ = batch([48], 48)
    with torch.no_grad():
        whole = sage(ids).logits
        first = sage(ids[:, :30], use_cache=True)
        second = sage(ids[:, 30:], past_key_values=first.past_key_values, use_cache=True).logits
    torch.testing.assert_close(second, whole[:, 30:], atol=1e-5, rtol=1e-5)


# ---- policies and the report --------------------------------------------------------------------------------------

def test_report_lists_layers_before_first_forward():
    sage = build("llama", num_hidden_layers=3)
    rep = layers_of(sage)
    assert list(rep) == [f"model.layers.{i}.self_attn" for i in range(3)]
    assert all(st["calls"] == 0 for st in rep.values())


def test_default_policy_from_model_type_and_decode_runs_full():
    sage = build("mistral")
    llama = Policy.from_any(shipped_policy_path("llama"))
    assert all(b.policy == llama for b in hf.bind(sage).values())
    ids, am = batch([140, 130], 140)
    sage.generate(input_ids=ids, attention_mask=am, max_new_tokens=4, do_sample=False)
    for st in layers_of(sage).values():
        assert st["used"] == {"8b": 1, "full": 3}
        assert st["fallbacks"]["sequence length 1 < policy min_seq_len 128"] == 3


def test_per_layer_rules_land_on_the_right_layers(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("default: 8b\n"
                    "layers:\n"
                    "  - index: 0\n    precision: full\n"
                    "  - match: 'model.layers.2.*'\n    precision: 4b\n")
    sage = build("llama", num_hidden_layers=4)
    sage_patch.set_policy(sage, str(path))
    ids, _ = batch([32], 32)
    with torch.no_grad():
        sage(ids)
    used = {name: st["used"] for name, st in layers_of(sage).items()}
    assert used == {"model.layers.0.self_attn": {"full": 1}, "model.layers.1.self_attn": {"8b": 1},
                    "model.layers.2.self_attn": {"4b": 1}, "model.layers.3.self_attn": {"8b": 1}}
    sage_patch.set_policy(sage, None)  # back to the default for the model type
    assert all(b.policy.name == "llama" for b in hf.bind(sage).values())


def test_policy_set_before_switching_to_sage_survives_the_switch():
    model = build("llama", "sdpa")
    sage_patch.set_policy(model, {"default": "4b"})
    model.set_attn_implementation("sage")
    ids, _ = batch([20], 20)
    with torch.no_grad():
        model(ids)
    assert all(st["used"] == {"4b": 1} for st in layers_of(model).values())


def test_training_dropout_falls_back_to_full_with_reason():
    sage = build("llama", policy="8b", attention_dropout=0.1)
    sage.train()
    ids, _ = batch([20, 20], 20)
    loss = sage(ids, labels=ids).loss
    loss.backward()
    assert sage.model.layers[0].self_attn.q_proj.weight.grad is not None
    for st in layers_of(sage).values():
        assert st["used"] == {"full": 1}
        assert any("dropout_p=0.1" in r for r in st["fallbacks"])
    sage.config.attention_dropout = 0.0
    for layer in sage.model.layers:
        layer.self_attn.attention_dropout = 0.0
    sage(ids, labels=ids).loss.backward()  # without dropout: the trainable 8b (tests/test_training.py)
    assert all(st["impl"].get("reference-sagebwd") == 1 for st in layers_of(sage).values())


# ---- the attention function itself ------------------------------------------------------------------------------

class FakeAttention(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 2

    def __init__(self, policy="full"):
        super().__init__()
        self.layer_idx = 0
        attach(self, "fake", Policy.from_any(policy), index=0)


def qkv(b=2, hq=4, hkv=2, sq=12, skv=12, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, hq, d, generator=g).transpose(1, 2)  # non-contiguous view, as after RoPE
    k = torch.randn(b, hkv, skv, d, generator=g)
    v = torch.randn(b, hkv, skv, d, generator=g)
    return q, k, v


def sdpa_ref(q, k, v, mask, scale=None):
    rep = q.shape[1] // k.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


@pytest.mark.parametrize("policy", ["full", "8b"])
def test_noncontiguous_query_gqa_scaling_and_layout(policy):
    q, k, v = qkv()
    assert not q.is_contiguous()
    out, weights = hf.sage_attention_forward(FakeAttention(policy), q, k, v, None, scaling=0.3)
    assert weights is None and out.shape == (2, 12, 4, 16) and out.is_contiguous()
    expected = sdpa_ref(q, k, v, torch.ones(12, 12, dtype=torch.bool).tril(), scale=0.3)
    if policy == "full":
        torch.testing.assert_close(out, expected)
    else:
        assert cosine(out, expected) >= 0.999


def test_mask_none_with_sliding_window_is_built_not_dropped():
    q, k, v = qkv(sq=24, skv=24)
    out, _ = hf.sage_attention_forward(FakeAttention(), q, k, v, None, sliding_window=5)
    i, j = torch.arange(24)[:, None], torch.arange(24)[None, :]
    torch.testing.assert_close(out, sdpa_ref(q, k, v, (j <= i) & (j > i - 5)))


def test_mask_none_with_sliding_window_bidirectional_and_decode():
    q, k, v = qkv(sq=24, skv=24)
    mod = FakeAttention()
    mod.is_causal = False  # an encoder: transformers' bidirectional window is |i - j| <= window
    out, _ = hf.sage_attention_forward(mod, q, k, v, None, sliding_window=5)
    i, j = torch.arange(24)[:, None], torch.arange(24)[None, :]
    torch.testing.assert_close(out, sdpa_ref(q, k, v, (i - j).abs() <= 5))
    q, k, v = qkv(sq=1, skv=24)  # a decode step of a causal model: the last 5 keys
    out, _ = hf.sage_attention_forward(FakeAttention(), q, k, v, None, sliding_window=5)
    torch.testing.assert_close(out, sdpa_ref(q, k[:, :, -5:], v[:, :, -5:], None))


def test_mask_none_prefill_into_longer_static_cache_uses_first_keys():
    """transformers skips the mask when prefilling an empty static cache: keys past q_len are empty slots."""
    q, k, v = qkv(sq=10, skv=32)
    k[:, :, 10:], v[:, :, 10:] = 1e4, 1e4  # garbage in the unused slots must not leak in
    out, _ = hf.sage_attention_forward(FakeAttention(), q, k, v, None)
    expected = sdpa_ref(q, k[:, :, :10], v[:, :, :10], torch.ones(10, 10, dtype=torch.bool).tril())
    torch.testing.assert_close(out, expected)


def test_decode_step_is_not_causal_masked():
    q, k, v = qkv(sq=1, skv=20)
    out, _ = hf.sage_attention_forward(FakeAttention(), q, k, v, None)
    torch.testing.assert_close(out, sdpa_ref(q, k, v, None))  # the one query sees every cached key


def test_softcap_and_sinks_of_a_module_without_an_eager_function():
    """A module whose modeling file has no eager_attention_forward (this test file): softcap runs the exact
    attention in fp32, reported with the reason; sinks run the layer's precision (8b), corrected from its LSE.
    Models with sinks and softcap: tests/test_sinks_softcap.py."""
    q, k, v = qkv()
    mod = FakeAttention("8b")
    mask = torch.ones(2, 1, 12, 12, dtype=torch.bool).tril()
    out, _ = hf.sage_attention_forward(mod, q, k, v, mask, softcap=2.0)
    rep = 2
    s = (q @ k.repeat_interleave(rep, 1).transpose(-1, -2)) * 16 ** -0.5
    s = (torch.tanh(s / 2.0) * 2.0).masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(out, (s.softmax(-1) @ v.repeat_interleave(rep, 1)).transpose(1, 2))
    sinks = torch.randn(4)
    out2, _ = hf.sage_attention_forward(mod, q, k, v, mask, s_aux=sinks)
    s = ((q @ k.repeat_interleave(rep, 1).transpose(-1, -2)) * 16 ** -0.5).masked_fill(~mask, float("-inf"))
    p = torch.cat([s, sinks.reshape(1, -1, 1, 1).expand(2, -1, 12, 1)], -1).softmax(-1)[..., :-1]
    assert cosine(out2, (p @ v.repeat_interleave(rep, 1)).transpose(1, 2)) >= 0.999
    st = mod._sage_patch_binding.stats
    assert st.impls == {"exact-fp32": 1, "reference": 1} and st.used == {"full": 1, "8b": 1}
    assert any(r.startswith("softcap") and "has no eager_attention_forward" in r for r in st.fallbacks)


def test_unknown_semantic_kwarg_raises_and_bookkeeping_kwargs_pass():
    q, k, v = qkv()
    mod = FakeAttention()
    with pytest.raises(TypeError, match="block_indices"):
        hf.sage_attention_forward(mod, q, k, v, None, block_indices=torch.zeros(1))
    out, _ = hf.sage_attention_forward(mod, q, k, v, None, position_ids=torch.arange(12)[None], use_cache=True,
                                       cu_seq_lens_q=None, output_attentions=False, unknown_but_none=None)
    assert out.shape == (2, 12, 4, 16)


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_forward_only_kwargs_reach_attention_and_are_ignored_as_by_sdpa(kind):
    # A causal-LM forward hands its **kwargs both to the loss (shift_labels, ignore_index, num_items_in_batch)
    # and down to every attention call; transformers' sdpa ignores them, so must "sage".
    sage, ref = pair(kind, policy="full")
    torch.manual_seed(1)
    x = torch.randint(1, 128, (2, 20))
    y = torch.randint(1, 128, (2, 20))
    z = torch.randint(1, 128, (2, 20))
    kw = dict(labels=y, shift_labels=z, ignore_index=-100, num_items_in_batch=torch.tensor(40),
              output_hidden_states=True, output_router_logits=False)
    got, want = sage(x, **kw), ref(x, **kw)
    torch.testing.assert_close(got.logits, want.logits)
    torch.testing.assert_close(got.loss, want.loss)
    # shift_labels really reached the loss (else the loss would be computed from labels)
    assert not torch.allclose(got.loss, sage(x, labels=y).loss)
    assert sage.model.layers[0].self_attn._sage_patch_binding.stats.calls > 0


def test_ignored_kwargs_follow_transformers_typed_dicts_and_losses():
    from transformers.loss.loss_utils import ForCausalLMLoss
    from transformers.modeling_flash_attention_utils import FlashAttentionKwargs
    from transformers.utils.generic import TransformersKwargs

    ignored = hf.ignored_kwargs()
    handled = {"is_causal", "output_attentions"}
    assert set(TransformersKwargs.__optional_keys__) - handled <= ignored
    assert set(FlashAttentionKwargs.__optional_keys__) <= ignored
    assert {"shift_labels", "ignore_index", "num_items_in_batch"} <= ignored
    assert set(inspect.signature(ForCausalLMLoss).parameters) - {"kwargs"} <= ignored
    # never ignored: these change the attention result
    for name in ("sliding_window", "softcap", "s_aux", "position_bias", "is_causal", "attention_mask",
                 "head_mask", "scaling", "dropout"):
        assert name not in ignored


@pytest.mark.parametrize("name", ["head_mask", "attn_bias", "block_indices"])
def test_result_changing_kwargs_are_still_refused(name):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=f"{name}.*may change the attention result"):
        hf.sage_attention_forward(FakeAttention(), q, k, v, None, **{name: torch.ones(1)})


def test_position_bias_is_delegated_to_transformers_sdpa():
    q, k, v = qkv()
    mod = FakeAttention("8b")
    bias = torch.randn(1, 4, 12, 12)
    out, _ = hf.sage_attention_forward(mod, q, k, v, None, position_bias=bias, is_causal=False)
    rep = 2
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=bias).transpose(1, 2)
    torch.testing.assert_close(out, expected)
    assert any("position_bias" in r for r in mod._sage_patch_binding.stats.fallbacks)


# ---- torch.compile and static caches ----------------------------------------------------------------------------

def test_compile_fullgraph_8b_with_rules_no_recompile():
    policy = {"default": "8b", "layers": [{"match": "*.layers.1.*", "precision": "full"}]}
    sage = build("llama", policy=policy)
    ids, am = batch([40, 30], 40)
    with torch.no_grad():
        eager = sage(ids, attention_mask=am).logits
        compiled = torch.compile(sage, fullgraph=True, backend="aot_eager")
        out = compiled(ids, attention_mask=am).logits
        with torch._dynamo.config.patch(error_on_recompile=True):
            again = compiled(ids, attention_mask=am).logits
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(again, eager)
    rep = layers_of(sage)
    # the counting rule of sage_patch.report: a quantized call is one op, counted each time it runs (eager + 2
    # compiled); the full layer's call is traced with the model, counted in eager and once when traced
    assert rep["model.layers.0.self_attn"]["used"] == {"8b": 3}
    assert rep["model.layers.1.self_attn"]["used"] == {"full": 2}
    sage_patch.reset_report(sage)
    with torch.no_grad():
        compiled(ids, attention_mask=am)
    rep = layers_of(sage)
    assert rep["model.layers.0.self_attn"]["used"] == {"8b": 1} and rep["model.layers.1.self_attn"]["calls"] == 0


def test_compile_fullgraph_first_call_default_policy_without_warnings():
    """A model built with "sage" and never handed to sage_patch: its first call is the traced one (the layers
    bind, under the default policy, as plain Python at trace time). The next calls reuse the graph; compiling
    warns nothing."""
    sage, ref = pair("llama")
    ids, am = batch([140, 130], 140)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(sage, fullgraph=True, backend="aot_eager")
        out = compiled(ids, attention_mask=am).logits
        with torch._dynamo.config.patch(error_on_recompile=True):
            compiled(ids, attention_mask=am)
            compiled(ids, attention_mask=am)
    assert [str(w.message) for w in caught] == []
    assert cosine(out, ref(ids, attention_mask=am).logits) >= 0.999
    rep = layers_of(sage)
    assert list(rep) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert all(st["used"] == {"8b": 3} for st in rep.values()), rep  # the op: counted each time it runs


def test_compile_fullgraph_inductor():
    sage, ref = pair("qwen2", "full")
    ids, am = batch([24, 16], 24)
    with torch.no_grad():
        out = torch.compile(sage, fullgraph=True)(ids, attention_mask=am).logits
        torch.testing.assert_close(out, ref(ids, attention_mask=am).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind,prompt,pad", [("llama", 20, 6), ("llama", 20, 0), ("mistral", 24, 6),
                                            ("llama", 140, 6), ("llama", 140, 0)])
def test_static_cache_generate_compiled_matches_reference(kind, prompt, pad):
    """generate(cache_implementation="static") with its compiled decode step (fullgraph), as on GPU. Without
    padding, transformers passes no mask to the prefill although the static cache is longer than the prompt.
    Each case starts with dynamo's caches empty: graphs are specialized per layer binding (its op id), so the
    cases' fresh models would add up to dynamo's recompile limit for the one decode function."""
    torch._dynamo.reset()
    sage, ref = pair(kind, "full" if prompt < 128 else None)
    ids, am = batch([prompt, prompt - pad], prompt)
    kw = dict(input_ids=ids, attention_mask=am, max_new_tokens=6, do_sample=False, cache_implementation="static",
              output_logits=True, return_dict_in_generate=True)
    cc = CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
    cc._compile_all_devices = True  # transformers only auto-compiles on accelerators otherwise
    out, expected = sage.generate(**kw, compile_config=cc), ref.generate(**kw)
    assert torch.equal(out.sequences, expected.sequences)
    for got, exp in zip(out.logits, expected.logits):
        if prompt < 128:
            torch.testing.assert_close(got, exp, atol=1e-4, rtol=1e-4)
        else:
            assert cosine(got, exp) >= 0.999
    for st in layers_of(sage).values():
        assert st["calls"] >= 2  # eager prefill + traced decode step
        if prompt >= 128:
            assert st["used"]["8b"] == 1 and st["used"]["full"] >= 1

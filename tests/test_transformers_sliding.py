"""Sliding-window layers under attn_implementation="sage" reach the kernels' window, never a dense mask.

create_sliding_window_causal_mask's plain pattern comes back from "sage"'s mask function (`sage_mask`) as key
padding (or None), and the layer's `sliding_window` keyword becomes the kernels' window_left = sliding_window - 1.
On CPU the precision runs as the reference simulation, so what shows that a GPU would run the kernel is what each
call reaches the resolver with: a "key_padding" or "none" mask and the window, never a "dense" mask. References:
transformers' own sdpa on the same weights, in the same process.
"""
import pytest
import torch
from transformers import (CompileConfig, Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig, MistralForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)
from transformers.masking_utils import (chunked_causal_mask_function, create_sliding_window_causal_mask,
                                        or_masks, sdpa_mask, sliding_window_bidirectional_mask_function,
                                        sliding_window_causal_mask_function, sliding_window_overlay)
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import sage_patch
import sage_patch.api
from sage_patch.integrations import transformers as hf
from test_transformers_integration import FakeAttention, batch, cosine, layers_of, qkv  # noqa: E402
from test_transformers_padding import (assert_chunked_continuation_matches, assert_compiled_matches,  # noqa: E402
                                      assert_steps_match_teacher_forced)

W = 7  # the window: shorter than every prompt, so it cuts
COS_8B = 0.999
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
              pad_token_id=0)
LAYERS = ["sliding_attention", "full_attention"]
MODELS = {  # every model has sliding layers; Qwen2/3 and Gemma 3 full-attention ones too
    "mistral": (MistralForCausalLM, lambda: MistralConfig(**COMMON, sliding_window=W)),
    "qwen2": (Qwen2ForCausalLM, lambda: Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=W,
                                                     max_window_layers=1)),
    "qwen3": (Qwen3ForCausalLM, lambda: Qwen3Config(**COMMON, use_sliding_window=True, sliding_window=W,
                                                     max_window_layers=1)),
    "gemma3": (Gemma3ForCausalLM, lambda: Gemma3TextConfig(**COMMON, sliding_window=W, layer_types=LAYERS,
                                                            query_pre_attn_scalar=16)),
}
ALL = list(MODELS)
# the 8b logits bound per model: tiny Gemma 3 (embedding scale, q/k norms) is at 0.9991 unpadded, without a window
# cut, so its bound is looser; the "full" policy test shows the masks are exact for every model
COS = {"gemma3": 0.998}


def bound(kind):
    return COS.get(kind, COS_8B)


def build(kind, impl, seed=0):
    cls, make_cfg = MODELS[kind]
    torch.manual_seed(seed)
    return cls._from_config(make_cfg(), attn_implementation=impl).eval()


def pair(kind, policy="8b"):
    sage, ref = build(kind, "sage"), build(kind, "sdpa")
    ref.load_state_dict(sage.state_dict())
    sage_patch.set_policy(sage, policy)
    return sage, ref





def check_kernel_path(model, seen, windowed=True):
    """No dense mask reached the resolver, the window did (where it cuts), and the report shows no dense fallback."""
    assert seen and {k for k, _ in seen} <= {"key_padding", "none"}, seen
    if windowed:
        assert (W - 1) in {w for _, w in seen}, seen
    assert {w for _, w in seen} <= {-1, W - 1}, seen
    for name, st in layers_of(model).items():
        assert not any("dense" in r for r in st["fallbacks"]), (name, st["fallbacks"])


# ---- the mask function ------------------------------------------------------------------------------------------

def test_mask_function_gives_key_padding_for_the_sliding_pattern():
    am = torch.ones(2, 20, dtype=torch.bool)
    am[0, :6] = False
    kw = dict(batch_size=2, mask_function=sliding_window_causal_mask_function(W), local_size=W)
    assert hf.sage_mask(q_length=20, kv_length=20, attention_mask=am, **kw) is am
    # unpadded: None only where sdpa_mask skips its mask (_ignore_causal_mask_sdpa: not when the window may cut,
    # kv_length >= local_size), else the all-True key padding (its dense form, for full calls, built once per forward)
    ones = torch.ones(2, 20, dtype=torch.bool)
    assert hf.sage_mask(q_length=20, kv_length=20, attention_mask=ones, **kw) is ones
    assert hf.sage_mask(q_length=W - 1, kv_length=W - 1, attention_mask=ones[:, :W - 1], **kw) is None
    # a sliding cache holding W - 1 of 19 seen tokens, decoding one: the key padding of the keys it holds
    long_pad = am.clone()
    long_pad[0, :15] = False  # row 0's padding reaches into the keys held
    got = hf.sage_mask(q_length=1, kv_length=W, q_offset=19, kv_offset=13, attention_mask=long_pad, **kw)
    assert torch.equal(got, long_pad[:, 13:20])
    got = hf.sage_mask(q_length=1, kv_length=W, q_offset=19, kv_offset=13, attention_mask=am, **kw)
    assert torch.equal(got, am[:, 13:20]) and got.all()
    # no 2-D mask (eager): None where sdpa would use is_causal, else an all-True key padding of the keys attended
    assert hf.sage_mask(q_length=W - 1, kv_length=W - 1, attention_mask=None, **kw) is None
    full = hf.sage_mask(q_length=20, kv_length=20, attention_mask=None, **kw)
    assert full.shape == (2, 20) and full.all()
    cont = hf.sage_mask(q_length=4, kv_length=W - 1 + 4, q_offset=16, kv_offset=10, attention_mask=None, **kw)
    assert cont.shape == (2, W - 1 + 4) and cont.all()


@pytest.mark.parametrize("case", ["other_window", "chunked", "bidirectional", "overlay", "or_overlay", "no_skip",
                                  "misaligned"])
def test_mask_function_keeps_sdpa_mask_for_other_patterns(case):
    am = torch.ones(2, 20, dtype=torch.bool)
    am[0, :6] = False
    kw = dict(batch_size=2, q_length=20, kv_length=20, q_offset=0, kv_offset=0, attention_mask=am, local_size=W,
              mask_function=sliding_window_causal_mask_function(W))
    kw.update({
        "other_window": dict(mask_function=sliding_window_causal_mask_function(W + 1)),  # not local_size's window
        "chunked": dict(mask_function=chunked_causal_mask_function(W, torch.zeros(2, dtype=torch.long))),
        "bidirectional": dict(mask_function=sliding_window_bidirectional_mask_function(W)),
        "overlay": dict(mask_function=sliding_window_causal_mask_function(W), use_vmap=True),
        "or_overlay": dict(mask_function=or_masks(sliding_window_causal_mask_function(W),
                                                  sliding_window_overlay(3))),
        "no_skip": dict(allow_is_causal_skip=False),
        "misaligned": dict(q_length=4, q_offset=3),
    }[case])
    expected = sdpa_mask(**kw)
    got = hf.sage_mask(**kw)
    assert got is not None and got.dim() == 4 and torch.equal(got, expected)


def test_mask_function_recognises_the_pattern_under_compile():
    """Traced (fullgraph): the sliding pattern still comes back as the 2-D key padding (no values read)."""
    cfg = build("mistral", "sage").config

    def f(am):
        return create_sliding_window_causal_mask(config=cfg, inputs_embeds=torch.zeros(2, 20, 8), attention_mask=am,
                                                 cache=None)

    torch._dynamo.reset()
    am = torch.ones(2, 20, dtype=torch.long)
    am[1, :5] = 0
    out = torch.compile(f, fullgraph=True, backend="eager")(am)
    assert out.shape == (2, 20) and torch.equal(out, am.bool())


@pytest.mark.parametrize("sq,skv,length", [(12, 12, 12), (5, 12, 12), (1, 12, 12), (10, 32, 16)])
def test_sdpa_equivalent_mask_with_window_is_sdpa_masks(sq, skv, length):
    am = torch.ones(2, length, dtype=torch.bool)
    am[0, :3] = False
    expected = sdpa_mask(batch_size=2, q_length=sq, kv_length=skv, q_offset=length - sq, attention_mask=am,
                         mask_function=sliding_window_causal_mask_function(4), allow_is_causal_skip=False)
    got = hf.sdpa_equivalent_mask(am, True, sq, skv, 4)
    assert torch.equal(got, expected.expand_as(got))
    if sq == skv == length:  # no padding at all: the window alone
        got = hf.sdpa_equivalent_mask(None, True, sq, skv, 4)
        full = sdpa_mask(batch_size=1, q_length=sq, kv_length=skv, allow_is_causal_skip=False,
                         mask_function=sliding_window_causal_mask_function(4))
        assert torch.equal(got, full)


@pytest.mark.parametrize("policy", ["full", "8b"])
@pytest.mark.parametrize("sq,skv", [(20, 20), (5, 20), (1, 20)])
def test_attention_window_is_transformers_rule(policy, sq, skv):
    """sliding_window W: key visible iff q_pos - W < kv_pos <= q_pos (window_left = W - 1), with key padding."""
    q, k, v = qkv(sq=sq, skv=skv)
    am = torch.ones(2, skv, dtype=torch.bool)
    am[0, :4] = False
    out, _ = hf.sage_attention_forward(FakeAttention(policy), q, k, v, am, sliding_window=W)
    mask = sdpa_mask(batch_size=2, q_length=sq, kv_length=skv, q_offset=skv - sq, attention_mask=am,
                     mask_function=sliding_window_causal_mask_function(W), allow_is_causal_skip=False)
    expected = sdpa_attention_forward(FakeAttention(), q, k, v, mask)[0].nan_to_num(0.0)
    if policy == "full":
        torch.testing.assert_close(out, expected)
    else:
        assert cosine(out, expected) >= COS_8B


# ---- whole models ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ALL)
@pytest.mark.parametrize("left", [True, False])
def test_padded_batch_runs_the_window_and_matches_sdpa(kind, left, resolver_windows):
    sage, ref = pair(kind)
    lengths, total = (40, 29, 33), 40
    ids, am = batch(lengths, total, left=left)
    with torch.no_grad():
        out, expected = sage(ids, attention_mask=am).logits, ref(ids, attention_mask=am).logits
        real = am.bool()
        assert cosine(out[real], expected[real]) >= bound(kind)
        for row, n in enumerate(lengths):  # every real row vs the sequence alone, unpadded, no mask
            sl = slice(total - n, total) if left else slice(0, n)
            alone = ref(ids[row:row + 1, sl]).logits[0]
            assert cosine(out[row, sl], alone) >= bound(kind), row
    check_kernel_path(sage, resolver_windows)
    assert all(st["used"] == {"8b": 1} for st in layers_of(sage).values())


@pytest.mark.parametrize("kind", ALL)
def test_full_policy_is_sdpa_exactly(kind):
    """The full fallback hands transformers' sdpa the sliding mask sdpa_mask would have built."""
    sage, ref = pair(kind, "full")
    ids, am = batch([40, 27], 40)
    with torch.no_grad():
        torch.testing.assert_close(sage(ids, attention_mask=am).logits, ref(ids, attention_mask=am).logits,
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(sage(ids).logits, ref(ids).logits, atol=1e-5, rtol=1e-5)  # no mask at all


@pytest.mark.parametrize("kind", ALL)
def test_chunked_continuation_into_a_sliding_cache(kind, resolver_windows):
    """A second chunk into the cache of a left-padded batch: the sliding layers' cache holds W - 1 keys, the
    queries are the last of them (bottom-right), the key padding is the mask's columns from kv_offset on."""
    sage, ref = pair(kind)
    ids, am = batch([40, 31], 40)
    assert_chunked_continuation_matches(sage, ref, ids, am, 24, bound(kind))
    check_kernel_path(sage, resolver_windows)


@pytest.mark.parametrize("kind", ALL)
def test_generate_padded_batch_each_step_matches_sdpa(kind, resolver_windows):
    """Greedy generate() of a left-padded batch (8b prefill and decode steps, forced by the policy) into the
    model's own cache (sliding layers: DynamicSlidingWindowLayer, kv_offset > 0 once full); each step's logits vs
    sdpa teacher-forced on the same tokens."""
    sage, ref = pair(kind)
    ids, am = batch([30, 21], 30)
    assert_steps_match_teacher_forced(sage, ref, ids, am, 4, bound(kind))
    check_kernel_path(sage, resolver_windows)
    assert all(st["used"] == {"8b": 4} for st in layers_of(sage).values())


def test_static_cache_generate_matches_sdpa(resolver_windows):
    """generate(cache_implementation="static"): StaticSlidingWindowLayer (W slots, rolled) on the sliding layers."""
    kind = "qwen2"
    sage, ref = pair(kind)
    ids, am = batch([30, 22], 30)
    assert_steps_match_teacher_forced(sage, ref, ids, am, 3, bound(kind), cache_implementation="static")
    check_kernel_path(sage, resolver_windows)


@pytest.mark.parametrize("kind", ["mistral", "gemma3"])
def test_compile_fullgraph_padded_forward(kind, resolver_windows):
    sage, ref = pair(kind)
    ids, am = batch([40, 29], 40)
    assert_compiled_matches(sage, ref, ids, am, bound(kind))
    check_kernel_path(sage, resolver_windows)


def test_report_shows_no_dense_fallback_on_sliding_layers(resolver_windows):
    sage, _ = pair("qwen3")
    ids, am = batch([40, 30], 40)
    with torch.no_grad():
        sage(ids, attention_mask=am)
    text = str(sage_patch.report(sage))
    assert "dense" not in text
    rep = layers_of(sage)
    check_kernel_path(sage, resolver_windows)  # on CPU a dense mask would run the simulation too: the resolver's view says it
    cpu_only = {"reference simulation (tensors on CPU)"}  # the kernels' stand-in here; a GPU has no fallback
    assert len(rep) == 2 and all(st["used"] == {"8b": 1} and set(st["fallbacks"]) <= cpu_only for st in rep.values())

"""Padded batches under attn_implementation="sage" reach the kernels as key padding, never as a dense mask.

transformers builds a padded batch's mask with "sage"'s mask function (`sage_mask`): for a full-attention layer
it is the 2-D key-padding mask (B, L), which the kernels take with the bottom-right causal rule; every other pattern
but sliding windows (tests/test_transformers_sliding.py) keeps sdpa_mask's dense mask. On CPU the precision runs as the reference simulation, so what
shows that a GPU would run the kernel is the kind of mask each call reaches the resolver with ("key_padding" or
"none", never "dense"). References: transformers' own sdpa on the same weights, in the same process.
"""
import pytest
import torch
from transformers import CompileConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import causal_mask_function, create_causal_mask, sdpa_mask

import sage_patch
import sage_patch.api
from sage_patch.integrations import transformers as hf
from test_transformers_integration import FakeAttention, batch, build, cosine, layers_of, pair, qkv  # noqa: E402

COS_8B = 0.999  # the 8b logits bound of tests/test_transformers_integration.py
COS_ALONE = 0.9995  # a padded row vs the same sequence alone (quantization groups shift with the padding)


def no_dense_fallback(model):
    for name, st in layers_of(model).items():
        assert not any("dense" in r for r in st["fallbacks"]), (name, st["fallbacks"])


# ---- the mask function ------------------------------------------------------------------------------------------

def test_mask_function_gives_key_padding_for_plain_causal():
    am = torch.ones(2, 12, dtype=torch.bool)
    am[0, :4] = False
    kw = dict(batch_size=2, q_length=12, kv_length=12, mask_function=causal_mask_function)
    out = hf.sage_mask(**kw, attention_mask=am)
    assert out is am  # the 2-D mask itself: no (Sq, Skv) tensor
    assert hf.sage_mask(**kw, attention_mask=torch.ones(2, 12, dtype=torch.bool)) is None  # unpadded: plain causal
    # continuation into a cache (queries are the last 5 of 12 keys): the mask, even unpadded (None means q_len keys)
    cont = dict(batch_size=2, q_length=5, kv_length=12, q_offset=7, mask_function=causal_mask_function)
    assert hf.sage_mask(**cont, attention_mask=torch.ones(2, 12, dtype=torch.bool)).shape == (2, 12)
    # a static cache (32 slots, 12 seen): the mask of the tokens seen; the attention cuts the other slots
    static = dict(batch_size=2, q_length=12, kv_length=32, q_offset=torch.tensor(0), mask_function=causal_mask_function)
    assert hf.sage_mask(**static, attention_mask=am) is am


@pytest.mark.parametrize("case", ["no_skip", "kv_offset", "misaligned", "no_mask"])
def test_mask_function_gives_sdpa_mask_otherwise(case):
    am = torch.ones(2, 12, dtype=torch.bool)
    am[0, :4] = False
    kw = dict(batch_size=2, q_length=12, kv_length=12, q_offset=0, kv_offset=0, mask_function=causal_mask_function,
              attention_mask=am)
    kw.update({"no_skip": dict(allow_is_causal_skip=False),  # a model that adds to the materialized mask
               "kv_offset": dict(q_offset=2, kv_offset=2, kv_length=10),  # queries not the last of the keys
               "misaligned": dict(q_length=4, q_offset=3),  # q_offset + q_length != the mask's length
               "no_mask": dict(attention_mask=None, q_length=4, kv_length=12, q_offset=0)}[case])
    expected = sdpa_mask(**kw)
    got = hf.sage_mask(**kw)
    assert (got is None) == (expected is None)
    if expected is not None:
        assert got.dim() == 4 and torch.equal(got, expected)


def test_mask_function_reads_no_values_under_compile():
    """Traced (fullgraph), the unpadded mask is returned as is: no data-dependent branch, no host sync."""
    def f(am):
        return create_causal_mask(config=cfg, inputs_embeds=torch.zeros(2, 12, 8), attention_mask=am, cache=None)

    torch._dynamo.reset()
    cfg = build("llama").config
    am = torch.ones(2, 12, dtype=torch.long)
    assert f(am) is None  # eager: one fast_all, as sdpa_mask
    out = torch.compile(f, fullgraph=True, backend="eager")(am)
    assert out.shape == (2, 12) and out.all()


# ---- the attention function with a key-padding mask -------------------------------------------------------------

def _sdpa_expected(q, k, v, am, kv_len=None):
    """transformers' own sdpa with sdpa_mask's dense mask for the same padding; NaN rows (no visible key) -> 0."""
    b, sq, skv = q.shape[0], q.shape[2], k.shape[2] if kv_len is None else kv_len
    mask = sdpa_mask(batch_size=b, q_length=sq, kv_length=k.shape[2], q_offset=skv - sq, attention_mask=am,
                     allow_is_causal_skip=False)
    out, _ = sdpa_attention_forward(FakeAttention(), q, k, v, mask)
    return out.nan_to_num(0.0)


@pytest.mark.parametrize("policy", ["full", "8b"])
@pytest.mark.parametrize("sq,skv,left", [(12, 12, True), (12, 12, False), (5, 12, True), (1, 12, True)])
def test_key_padding_mask_matches_sdpa_dense(policy, sq, skv, left):
    """Left and right padding, prefill (Sq == Skv), a chunk into a cache (Sq < Skv, bottom-right) and a decode
    step; every row, padded ones included (a left-padded query row sees no key: 0)."""
    q, k, v = qkv(sq=sq, skv=skv)
    am = torch.ones(2, skv, dtype=torch.bool)
    am[0, :5] = False if left else True
    am[0, skv - 4:] = True if left else False
    out, _ = hf.sage_attention_forward(FakeAttention(policy), q, k, v, am)
    expected = _sdpa_expected(q, k, v, am)
    if policy == "full":
        torch.testing.assert_close(out, expected)
    else:
        assert cosine(out, expected) >= COS_8B
    if left and sq == skv:
        assert (out[0, :5] == 0).all()  # padded queries with no visible key


def test_key_padding_shorter_than_static_cache_cuts_unused_slots():
    q, k, v = qkv(sq=10, skv=32)
    k[:, :, 16:], v[:, :, 16:] = 1e4, 1e4  # garbage in the unused slots must not leak in
    am = torch.ones(2, 16, dtype=torch.bool)  # 6 tokens cached + 10 new, in a 32-slot cache
    am[1, :3] = False
    out, _ = hf.sage_attention_forward(FakeAttention(), q, k, v, am)
    torch.testing.assert_close(out, _sdpa_expected(q, k[:, :, :16], v[:, :, :16], am))


# ---- whole models ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("left", [True, False])
def test_padded_batch_runs_key_padding_and_matches_sdpa(kind, left, resolver_masks):
    sage, ref = pair(kind, "8b")
    lengths, total = (160, 131, 145), 160
    ids, am = batch(lengths, total, left=left)
    with torch.no_grad():
        out, expected = sage(ids, attention_mask=am).logits, ref(ids, attention_mask=am).logits
        real = am.bool()
        assert cosine(out[real], expected[real]) >= COS_8B
        for row, n in enumerate(lengths):  # every real row vs the sequence alone, unpadded
            sl = slice(total - n, total) if left else slice(0, n)
            alone = ref(ids[row:row + 1, sl]).logits[0]
            assert cosine(out[row, sl], alone) >= COS_ALONE, row
    assert resolver_masks and set(resolver_masks) == {"key_padding"}, resolver_masks
    no_dense_fallback(sage)
    assert all(st["used"] == {"8b": 1} for st in layers_of(sage).values())


def test_full_policy_padded_batch_is_sdpa_exactly(resolver_masks):
    sage, ref = pair("llama", "full")
    ids, am = batch([40, 28, 33], 40)
    with torch.no_grad():
        torch.testing.assert_close(sage(ids, attention_mask=am).logits, ref(ids, attention_mask=am).logits,
                                   atol=0, rtol=0)
    assert resolver_masks == []  # a "full" layer is decided by rule (binding.full_by_rule), before any mask is classified
    assert all(st["impl"] == {"sdpa": 1} and st["requested"] == {"full": 1} for st in layers_of(sage).values())


def assert_chunked_continuation_matches(sage, ref, ids, am, split, min_cos):
    """`sage` run in two chunks (the second, ids[:, split:], into the cache the first filled) gives `ref`'s logits of
    the whole sequence on the second chunk's real rows within min_cos."""
    with torch.no_grad():
        whole = ref(ids, attention_mask=am).logits
        first = sage(ids[:, :split], attention_mask=am[:, :split], use_cache=True)
        second = sage(ids[:, split:], attention_mask=am, past_key_values=first.past_key_values, use_cache=True).logits
    real = am[:, split:].bool()
    assert cosine(second[real], whole[:, split:][real]) >= min_cos


def test_chunked_continuation_into_a_padded_cache(resolver_masks):
    """A second chunk (Sq > 1) into a DynamicCache of a left-padded batch: bottom-right causal with key padding."""
    sage, ref = pair("llama", "8b")
    ids, am = batch([160, 137], 160)
    assert_chunked_continuation_matches(sage, ref, ids, am, 100, COS_8B)
    assert set(resolver_masks) == {"key_padding"}
    no_dense_fallback(sage)


def assert_steps_match_teacher_forced(sage, ref, ids, am, new_tokens, min_cos, **generate_kw):
    """Greedy generate() with `sage`; each step's logits vs `ref` teacher-forced on the same tokens (a tiny random
    model's near-ties may flip a token, so the tokens themselves are not compared)."""
    out = sage.generate(input_ids=ids, attention_mask=am, max_new_tokens=new_tokens, do_sample=False,
                        output_logits=True, return_dict_in_generate=True, **generate_kw)
    full_am = torch.cat([am, torch.ones(am.shape[0], new_tokens, dtype=am.dtype)], 1)
    with torch.no_grad():
        forced = ref(out.sequences[:, :-1], attention_mask=full_am[:, :-1]).logits[:, ids.shape[1] - 1:]
    for i, step in enumerate(out.logits):
        assert cosine(step, forced[:, i]) >= min_cos, i


def test_generate_padded_batch_each_step_matches_sdpa(resolver_masks):
    """Greedy generate() of a left-padded batch: the 8b prefill, then decode steps (8b too, forced by the policy)
    into the cache; each step's logits vs sdpa run on the same tokens (teacher-forced: a tiny random model's near-
    ties may flip a token)."""
    sage, ref = pair("llama", "8b")
    ids, am = batch([150, 129], 150)
    assert_steps_match_teacher_forced(sage, ref, ids, am, 5, COS_8B)
    assert set(resolver_masks) == {"key_padding"}, resolver_masks  # the decode steps too (q_len 1: key padding only)
    no_dense_fallback(sage)
    assert all(st["used"] == {"8b": 5} for st in layers_of(sage).values())


def assert_compiled_matches(sage, ref, ids, am, min_cos):
    """torch.compile(fullgraph=True) of `sage`'s padded forward gives its eager logits, and `ref`'s within min_cos on
    the real rows."""
    torch._dynamo.reset()  # a fresh recompile budget: other tests of the session compiled the same forward
    with torch.no_grad():
        eager = sage(ids, attention_mask=am).logits
        compiled = torch.compile(sage, fullgraph=True, backend="aot_eager")(ids, attention_mask=am).logits
        expected = ref(ids, attention_mask=am).logits
    torch.testing.assert_close(compiled, eager)
    real = am.bool()
    assert cosine(compiled[real], expected[real]) >= min_cos


def test_compile_fullgraph_padded_forward(resolver_masks):
    sage, ref = pair("qwen2", "8b")
    ids, am = batch([150, 131], 150)
    assert_compiled_matches(sage, ref, ids, am, COS_8B)
    assert set(resolver_masks) == {"key_padding"}
    no_dense_fallback(sage)


def test_static_cache_padded_generate_compiled(resolver_masks):
    """generate(cache_implementation="static"): the eager prefill takes the key padding of the tokens seen (the
    cache is longer), the compiled decode steps sdpa_mask's (B, 1, 1, Skv), which is key padding too."""
    torch._dynamo.reset()
    sage, ref = pair("llama", "8b")
    ids, am = batch([140, 131], 140)
    kw = dict(input_ids=ids, attention_mask=am, max_new_tokens=4, do_sample=False, cache_implementation="static",
              output_logits=True, return_dict_in_generate=True)
    cc = CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
    cc._compile_all_devices = True  # transformers only auto-compiles on accelerators otherwise
    out = sage.generate(**kw, compile_config=cc)
    full_am = torch.cat([am, torch.ones(2, 4, dtype=am.dtype)], 1)
    with torch.no_grad():
        forced = ref(out.sequences[:, :-1], attention_mask=full_am[:, :-1]).logits[:, 139:]
    for i, step in enumerate(out.logits):
        assert cosine(step, forced[:, i]) >= COS_8B, i
    assert set(resolver_masks) == {"key_padding"}, resolver_masks
    no_dense_fallback(sage)


@pytest.mark.parametrize("sq,skv,length", [(12, 12, 12), (5, 12, 12), (1, 12, 12), (10, 32, 16)])
def test_sdpa_equivalent_mask_is_sdpa_masks(sq, skv, length):
    """Paths that hand the call to transformers' own sdpa (position_bias) get sdpa_mask's dense mask back."""
    am = torch.ones(2, length, dtype=torch.bool)
    am[0, :3] = False
    expected = sdpa_mask(batch_size=2, q_length=sq, kv_length=skv, q_offset=length - sq, attention_mask=am,
                         allow_is_causal_skip=False)
    got = hf.sdpa_equivalent_mask(am, True, sq, skv)
    assert torch.equal(got, expected.expand_as(got))


def test_position_bias_with_key_padding_is_delegated_with_the_dense_mask():
    q, k, v = qkv()
    am = torch.ones(2, 12, dtype=torch.bool)
    am[1, :4] = False
    bias = torch.randn(1, 4, 12, 12)
    out, _ = hf.sage_attention_forward(FakeAttention("8b"), q, k, v, am, position_bias=bias)
    dense = hf.sdpa_equivalent_mask(am, True, 12, 12)
    expected, _ = sdpa_attention_forward(FakeAttention(), q, k, v, dense, position_bias=bias)
    torch.testing.assert_close(out, expected)

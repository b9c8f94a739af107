"""Attention sinks (gpt-oss's s_aux) and logit soft-capping (Gemma 2) under sage_patch.

Sinks run on every precision: the attention of the real scores, then out * sigmoid(lse - sinks[h]) from its LSE
(sage_patch.api.apply_sinks); a call the policy sends to full precision runs the model's own eager function, as
attn_implementation="eager" does. Softcap cannot be applied afterwards: it runs the model's eager function. On CPU
the reference simulation stands in for the kernel. References: float64 exact attention, and transformers' eager on
the same weights in the same process (transformers runs these models with eager: their _supports_sdpa is False).
"""
import copy

import pytest
import torch
import transformers

import sage_patch
import sage_patch.api
from sage_patch.api import apply_sinks
from sage_patch.kernels import head_dims
from sage_patch.reference import exact_attention, simulate
from test_transformers_integration import COMMON, batch, cosine, layers_of, pair  # noqa: E402
from test_transformers_padding import assert_chunked_continuation_matches  # noqa: E402

COS_8B = 0.999  # the 8b logits bound of tests/test_transformers_integration.py


def _qkv(b=2, hq=4, hkv=2, sq=13, skv=29, d=16, seed=0, layout="bhsd"):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, s, d, generator=g) for h, s in ((hq, sq), (hkv, skv), (hkv, skv)))
    if layout == "bshd":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    return q, k, v


def _sinks(h=4, seed=1):
    return torch.randn(h, generator=torch.Generator().manual_seed(seed)) * 3


def _as_bhsd(x, layout):
    return x.transpose(1, 2) if layout == "bshd" else x


def _lse64(q, k, causal, am):
    """The natural-log LSE of the real scores in float64 (exact_attention returns its LSE in fp32)."""
    from sage_patch.masks import combined_bool_mask

    s = q @ k.repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2) / q.shape[-1] ** 0.5
    visible = combined_bool_mask(am, causal, q.shape[2], k.shape[2])
    return torch.logsumexp(s if visible is None else s.masked_fill(~visible, float("-inf")), -1)


# ---- the identity -------------------------------------------------------------------------------------------------

MASKS = {
    "none": lambda b, sq, skv: None,
    # batch entry 1 has no visible key at all: its rows are empty (0, and the sink-only softmax gives 0 too)
    "key_padding_empty_rows": lambda b, sq, skv: torch.stack([torch.arange(skv) >= 5, torch.zeros(skv, dtype=bool)]),
    "key_padding": lambda b, sq, skv: torch.stack([torch.arange(skv) >= 7, torch.arange(skv) < skv - 3]),
}


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,skv", [(13, 29), (29, 13), (1, 7), (17, 17)])
def test_sigmoid_identity_is_exact_in_float64(mask, causal, sq, skv):
    """out * sigmoid(lse - s) from the attention of the real scores equals the softmax with the sink logit in its
    denominator, float64, GQA, odd lengths, causal (bottom-right: Sq > Skv leaves the first rows empty), key
    padding and empty rows; the LSE becomes that of the whole denominator."""
    q, k, v = (x.double() for x in _qkv(sq=sq, skv=skv))
    s = _sinks()
    am = MASKS[mask](2, sq, skv)
    out = exact_attention(q, k, v, is_causal=causal, attn_mask=am)
    want, want_lse = exact_attention(q, k, v, is_causal=causal, attn_mask=am, return_lse=True, sinks=s)
    got, got_lse = apply_sinks(out, _lse64(q, k, causal, am), s, "bhsd")
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(got_lse.double(), want_lse.double())
    if mask == "key_padding_empty_rows":
        assert (got[1] == 0).all()


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("causal", [False, True])
def test_attention_with_sinks_full_and_8b_vs_float64(layout, mask, causal):
    """sage_patch.attention(sinks=...): full precision within fp32 rounding of float64; the 8b (reference
    simulation on CPU) is the simulation's own output corrected from its own LSE, and within the 8b tolerance."""
    sq, skv = 37, 45
    q, k, v = _qkv(sq=sq, skv=skv, layout=layout)
    s = _sinks()
    am = MASKS[mask](2, sq, skv)
    qb, kb, vb = (_as_bhsd(x, layout) for x in (q, k, v))
    want, want_lse = exact_attention(qb, kb, vb, is_causal=causal, attn_mask=am, return_lse=True, sinks=s)
    full, full_lse = sage_patch.attention(q, k, v, layout=layout, is_causal=causal, attn_mask=am, precision="full",
                                          return_lse=True, sinks=s)
    torch.testing.assert_close(_as_bhsd(full, layout).double(), want, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(full_lse.double(), want_lse.double(), atol=2e-6, rtol=1e-5)

    got = sage_patch.attention(q, k, v, layout=layout, is_causal=causal, attn_mask=am, precision="8b", sinks=s)
    # the simulation of the kernels' layout: head dim 16 zero-padded to their next native one (kernels.head_dims)
    sim, sim_lse = head_dims.padded(lambda q_, k_, v_, sc: simulate(
        q_, k_, v_, "8b", scale=sc, is_causal=causal, attn_mask=None if am is None else am[:, None, None, :],
        return_lse=True), qb, kb, vb, None)
    torch.testing.assert_close(_as_bhsd(got, layout), apply_sinks(sim, sim_lse, s, "bhsd")[0], atol=0, rtol=0)
    assert cosine(_as_bhsd(got, layout), want) >= 0.9995


def test_sinks_gradients_are_exact_in_full_precision():
    """A call that needs a gradient runs full precision with the sinks inside a differentiable softmax (the fused
    kernels' LSE has no gradient): dq, dk, dv and d sinks match float64 autograd."""
    q, k, v = (x.requires_grad_() for x in _qkv(sq=11, skv=19))
    s = _sinks().requires_grad_()
    out = sage_patch.attention(q, k, v, is_causal=True, precision="8b", sinks=s)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, s), g)
    q64, k64, v64, s64 = (x.detach().double().requires_grad_() for x in (q, k, v, s))
    ref = exact_attention(q64, k64, v64, is_causal=True, sinks=s64)
    want = torch.autograd.grad(ref, (q64, k64, v64, s64), g.double())
    for a, b in zip(grads, want):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-4)


def test_sinks_gradient_through_the_correction_alone():
    """Only the sinks need a gradient (q, k, v do not): the quantized path runs and d sinks is exact, since the
    LSE of the real scores does not depend on the sinks."""
    q, k, v = _qkv(sq=9, skv=9)
    s = _sinks().requires_grad_()
    out = sage_patch.attention(q, k, v, precision="full", sinks=s)
    (ds,) = torch.autograd.grad(out.sum(), s)
    s64 = s.detach().double().requires_grad_()
    (want,) = torch.autograd.grad(exact_attention(q.double(), k.double(), v.double(), sinks=s64).sum(), s64)
    torch.testing.assert_close(ds.double(), want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("bad,what", [
    (lambda: torch.zeros(3), "shape (3,)"),
    (lambda: torch.zeros(4, 1), "shape (4, 1)"),
    (lambda: torch.zeros(4, dtype=torch.int64), "dtype torch.int64"),
    (lambda: torch.zeros(4, device="meta"), "device meta"),
    (lambda: [0.0] * 4, "list"),
])
def test_bad_sinks_raise_naming_them(bad, what):
    q, k, v = _qkv()
    with pytest.raises((TypeError, ValueError), match=r"sinks must be a floating-point tensor of shape \(Hq,\) = "
                                                      r"\(4,\).*") as e:
        sage_patch.attention(q, k, v, sinks=bad())
    assert what in str(e.value)


# ---- gpt-oss: sinks on the kernel path ----------------------------------------------------------------------------

needs_gpt_oss = pytest.mark.skipif(not hasattr(transformers, "GptOssConfig"),
                                   reason="the installed transformers has no gpt-oss")
WINDOW = 16


def _gpt_oss_cfg():
    # layer 0 sliding (window 16), layer 1 full attention, as gpt-oss alternates them; tiny experts
    cfg = transformers.GptOssConfig(**{**COMMON, "intermediate_size": 32}, head_dim=16, num_local_experts=4,
                                    num_experts_per_tok=2, sliding_window=WINDOW,
                                    layer_types=["sliding_attention", "full_attention"])
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 150000.0}
    return cfg


def gpt_oss_pair(policy=None):
    """(sage, eager) gpt-oss with identical weights; sinks drawn large enough to matter (init gives ~0.02; a sink
    of 4 weighs exp(4) ~ 55 against a 160-key row's ~160)."""
    cfg = _gpt_oss_cfg()
    torch.manual_seed(0)
    sage = transformers.GptOssForCausalLM._from_config(copy.deepcopy(cfg), attn_implementation="sage").eval()
    ref = transformers.GptOssForCausalLM._from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
    with torch.no_grad():
        for layer in sage.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape) * 2 + 4)
    ref.load_state_dict(sage.state_dict())
    if policy is not None:
        sage_patch.set_policy(sage, policy)
    return sage, ref





def _assert_full_layer_on_kernel_path(model, kinds, calls):
    """Layer 1 (full attention) ran the 8b with key padding or no mask (what the kernels take), every call; the
    sliding layer 0 is not asserted either way (its window is a dense mask until the kernels take the window)."""
    st = layers_of(model)["model.layers.1.self_attn"]
    assert st["used"] == {"8b": calls}, st
    assert set(kinds[1::2]) <= {"key_padding", "none"}, kinds


def _close_all_layers(sage, ref, ids, am, min_cos=COS_8B):
    """Logits and every layer's hidden states, on the real rows."""
    with torch.no_grad():
        got = sage(ids, attention_mask=am, output_hidden_states=True)
        want = ref(ids, attention_mask=am, output_hidden_states=True)
    real = am.bool()
    for i, (a, b) in enumerate(zip(got.hidden_states[1:], want.hidden_states[1:])):
        assert cosine(a[real], b[real]) >= min_cos, i
    assert cosine(got.logits[real], want.logits[real]) >= min_cos
    return got.logits, want.logits


@needs_gpt_oss
@pytest.mark.parametrize("left", [True, False])
def test_gpt_oss_padded_batch_sinks_on_the_kernel_path(left, resolver_masks):
    sage, ref = gpt_oss_pair()
    ids, am = batch((160, 131, 145), 160, left=left)
    _close_all_layers(sage, ref, ids, am)
    _assert_full_layer_on_kernel_path(sage, resolver_masks, 1)
    assert not any("sink" in r for st in layers_of(sage).values() for r in st["fallbacks"])


@needs_gpt_oss
def test_gpt_oss_sinks_matter():
    """The reference check above can fail: the same model without its sinks is far from eager's output."""
    sage, ref = gpt_oss_pair()
    ids, am = batch((160, 131), 160)
    with torch.no_grad():
        for layer in ref.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
        a, b = sage(ids, attention_mask=am).logits, ref(ids, attention_mask=am).logits
    assert cosine(a[am.bool()], b[am.bool()]) < 0.99


@needs_gpt_oss
def test_gpt_oss_full_calls_run_the_models_eager_function_exactly():
    """Short calls (prefill < 128 tokens, decode steps) go full under the shipped policy: they run gpt-oss's own
    eager_attention_forward, the same computation as attn_implementation="eager" (bitwise), reported as "eager"
    with the reason."""
    sage, ref = gpt_oss_pair()
    ids, am = batch((40, 28, 33), 40)
    kw = dict(input_ids=ids, attention_mask=am, max_new_tokens=6, do_sample=False, output_logits=True,
              return_dict_in_generate=True)
    out, expected = sage.generate(**kw), ref.generate(**kw)
    assert torch.equal(out.sequences, expected.sequences)
    for got, exp in zip(out.logits, expected.logits):
        torch.testing.assert_close(got, exp, atol=0, rtol=0)
    for st in layers_of(sage).values():
        assert st["used"] == {"full": 6} and st["impl"] == {"eager": 6}, st
        assert all("attention sinks: full precision runs the model's eager attention" in r for r in st["fallbacks"])


@needs_gpt_oss
def test_gpt_oss_chunked_continuation_into_a_padded_cache(resolver_masks):
    """A second chunk of 130 tokens into a DynamicCache of a left-padded batch: bottom-right causal, key padding,
    sinks, on the kernel path; vs eager on the whole sequence."""
    sage, ref = gpt_oss_pair()
    ids, am = batch((260, 241), 260)
    assert_chunked_continuation_matches(sage, ref, ids, am, 130, COS_8B)
    _assert_full_layer_on_kernel_path(sage, resolver_masks, 2)


@needs_gpt_oss
def test_gpt_oss_compile_fullgraph(resolver_masks):
    """Traced, the 8b call is the LSE op and the sinks' correction is traced after it; a "full" layer traces the
    model's eager function."""
    torch._dynamo.reset()
    sage, ref = gpt_oss_pair()
    ids, am = batch((150, 131), 150)
    with torch.no_grad():
        eager = sage(ids, attention_mask=am).logits
        compiled = torch.compile(sage, fullgraph=True, backend="aot_eager")(ids, attention_mask=am).logits
        expected = ref(ids, attention_mask=am).logits
    torch.testing.assert_close(compiled, eager)
    assert cosine(compiled[am.bool()], expected[am.bool()]) >= COS_8B
    _assert_full_layer_on_kernel_path(sage, resolver_masks, 2)  # the eager call and the compiled one (the op runs it)

    torch._dynamo.reset()
    sage, ref = gpt_oss_pair(policy="full")
    with torch.no_grad():
        compiled = torch.compile(sage, fullgraph=True, backend="aot_eager")(ids, attention_mask=am).logits
        expected = ref(ids, attention_mask=am).logits
    torch.testing.assert_close(compiled[am.bool()], expected[am.bool()])
    assert all(st["impl"] == {"eager": 1} for st in layers_of(sage).values())


# ---- Gemma 2: softcap runs the model's eager function -------------------------------------------------------------

@pytest.mark.parametrize("left", [True, False])
@pytest.mark.parametrize("length", [160, 40])
def test_gemma2_softcap_runs_eager_exactly(left, length):
    """Every Gemma 2 call (softcap) runs its eager_attention_forward: the same logits as attn_implementation=
    "eager", bitwise, on every row, reported as "eager" with the softcap reason."""
    sage, ref = pair("gemma2")
    ids, am = batch((length, length - 13), length, left=left)
    with torch.no_grad():
        torch.testing.assert_close(sage(ids, attention_mask=am).logits, ref(ids, attention_mask=am).logits,
                                   atol=0, rtol=0)
    for st in layers_of(sage).values():
        assert st["used"] == {"full": 1} and st["impl"] == {"eager": 1}, st
        assert all(r.startswith("softcap (logit soft-capping)") and "eager_attention_forward" in r
                   for r in st["fallbacks"])


def test_gemma2_continuation_and_compile():
    torch._dynamo.reset()
    sage, ref = pair("gemma2")
    ids, am = batch((60, 47), 60)
    with torch.no_grad():
        first = sage(ids[:, :40], attention_mask=am[:, :40], use_cache=True)
        second = sage(ids[:, 40:], attention_mask=am, past_key_values=first.past_key_values, use_cache=True).logits
        rf = ref(ids[:, :40], attention_mask=am[:, :40], use_cache=True)
        expected = ref(ids[:, 40:], attention_mask=am, past_key_values=rf.past_key_values, use_cache=True).logits
        torch.testing.assert_close(second, expected, atol=0, rtol=0)
        compiled = torch.compile(sage, fullgraph=True, backend="aot_eager")(ids, attention_mask=am).logits
        torch.testing.assert_close(compiled, ref(ids, attention_mask=am).logits)


@needs_gpt_oss
def test_gpt_oss_runtime_guard_checks_against_attention_with_sinks():
    """The runtime guard recomputes a head with the sinks: a right 8b call with sinks is not demoted."""
    sage, ref = gpt_oss_pair(policy={"default": "8b", "guard": {"every": 1}})
    ids, am = batch((160, 131), 160)
    _close_all_layers(sage, ref, ids, am)
    for layer in sage.model.layers:
        guard = layer.self_attn._sage_patch_binding.guard
        assert guard.calls == 1 and guard.last["cos"] >= 0.999 and not guard.demoted, guard.last


@needs_gpt_oss
def test_gpt_oss_training_step_gradients_match_eager():
    """A forward that needs a gradient runs full precision with the sinks inside the model's eager softmax: the
    gradients (the sinks' included) are eager's."""
    sage, ref = gpt_oss_pair()
    ids, am = batch((160, 131), 160)
    for m in (sage, ref):
        m(ids, attention_mask=am, labels=ids).loss.backward()
    for (name, a), (_, b) in zip(sage.named_parameters(), ref.named_parameters()):
        if "self_attn" in name:
            torch.testing.assert_close(a.grad, b.grad, msg=name)
    assert all(st["used"] == {"full": 1} and st["impl"] == {"eager": 1} for st in layers_of(sage).values())

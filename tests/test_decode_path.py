"""Decode steps under the shipped policy (q_len 1 < min_seq_len: full precision) cost what transformers' sdpa costs:
the call is decided by rule (LayerBinding.full_by_rule) and counted, then transformers' own sdpa function runs with
exactly the arguments it would have had, and the key padding of a forward is turned into sdpa_mask's mask once per
forward (one mask object for every layer, as transformers' sdpa), not once per layer. What must not change with it:
exact report() counts and reasons, calibration observers and the runtime guard seeing every call, a policy with 8b
at decode still running the quantized path with key padding, and bad key padding still raising."""
import gc

import pytest
import torch

import sage_patch
from sage_patch.integrations import transformers as hf
from test_fallback_parity import _assert_same_calls, _left_padded, _run, recorded  # noqa: F401  (fixture)
from test_transformers_integration import FakeAttention, batch, build, layers_of, pair, qkv

MIN_LEN = "sequence length 1 < policy min_seq_len 128"


def _generate(model, ids, am, n):
    return model.generate(ids, attention_mask=am, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          pad_token_id=0)


def test_decode_steps_make_transformers_own_sdpa_call_with_one_mask_per_forward(recorded):  # noqa: F811
    """Llama policy, prompts under min_seq_len: every call (prefill and 4 decode steps) runs full by rule. Each torch
    SDPA call is transformers' own (shapes, strides, mask values, keywords), the tokens are identical, and each
    forward hands its layers one mask object, as transformers' sdpa does (before: one new dense mask per layer)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from test_fallback_parity import COMMON

    torch.manual_seed(0)
    sage = LlamaForCausalLM._from_config(LlamaConfig(**COMMON), attn_implementation="sage").eval()
    sage_patch.set_policy(sage, "llama")
    ref = LlamaForCausalLM._from_config(LlamaConfig(**COMMON), attn_implementation="sdpa").eval()
    ref.load_state_dict(sage.state_dict())
    ids, am = _left_padded([40, 25, 33], 40)
    with torch.no_grad():
        out_ref, ref_calls = _run(ref, recorded, lambda m: _generate(m, ids, am, 5))
        out_sage, sage_calls = _run(sage, recorded, lambda m: _generate(m, ids, am, 5))
    _assert_same_calls(sage_calls, ref_calls)
    assert torch.equal(out_sage, out_ref)
    distinct = [len({id(m) for _, m in calls}) for calls in (sage_calls, ref_calls)]
    assert distinct[0] == distinct[1] == 5, distinct  # one mask per forward (prefill + 4 steps), shared by 2 layers
    for st in layers_of(sage).values():  # every call counted, with its reason
        assert st["calls"] == 5 and st["used"] == {"full": 5} and st["impl"] == {"sdpa": 5}
        assert st["requested"] == {"8b": 5}
        assert st["fallbacks"] == {"sequence length 40 < policy min_seq_len 128": 1, MIN_LEN: 4}


def test_counts_exact_with_an_8b_prefill_and_full_decode_steps():
    sage = build("llama", policy="llama")
    ids, am = batch([140, 131], 140)
    _generate(sage, ids, am, 6)
    for st in layers_of(sage).values():
        assert st["used"] == {"8b": 1, "full": 5} and st["requested"] == {"8b": 6}
        assert st["fallbacks"][MIN_LEN] == 5


def test_policy_with_8b_at_decode_runs_the_quantized_path_with_key_padding(monkeypatch):
    """No min length: decode steps are not decided by rule; the quantized path gets the 2-D key padding."""
    import sage_patch.api

    seen = []
    real = sage_patch.api.resolve

    def spy(*args, mask, **kwargs):
        seen.append((args[1].shape[2], mask.kind))
        return real(*args, mask=mask, **kwargs)

    monkeypatch.setattr(sage_patch.api, "resolve", spy)
    sage = build("llama", policy="8b")
    ids, am = batch([140, 131], 140)
    _generate(sage, ids, am, 3)
    assert [k for q_len, k in seen if q_len == 1] == ["key_padding"] * 4  # 2 decode steps x 2 layers
    assert all(st["used"] == {"8b": 3} for st in layers_of(sage).values())


def test_observer_and_guard_still_see_decode_calls():
    """A calibration observer and the runtime guard watch every call of their layer, decode steps included: such
    calls take the whole path (full_by_rule declines)."""
    sage = build("llama", policy={"default": "8b", "fallback": {"min_seq_len": 128}, "guard": {"every": 1}})
    seen = []
    for b in hf.bind(sage).values():
        b.observer = lambda binding, q, k, v, call: seen.append((binding.name, q.shape[2]))
    ids, am = batch([40, 31], 40)
    _generate(sage, ids, am, 3)
    assert sorted(seen) == sorted((n, q) for n in layers_of(sage) for q in (40, 1, 1))
    assert all(b.guard.calls == 3 for b in hf.bind(sage).values())
    assert all(st["fallbacks"] == {"sequence length 40 < policy min_seq_len 128": 1, MIN_LEN: 2}
               for st in layers_of(sage).values())


def test_key_padding_modified_in_place_between_forwards_is_converted_again():
    """The dense mask is remembered for one forward only: a bool mask the caller changes in place (inference
    tensors have no version counter) gets the new mask at the next forward."""
    sage, ref = pair("llama", "full")
    ids, am = batch([40, 28, 33], 40)
    with torch.inference_mode():
        am = am.bool()
        first = sage(ids, attention_mask=am).logits
        torch.testing.assert_close(first, ref(ids, attention_mask=am).logits, atol=0, rtol=0)
        am[1, :30] = False
        torch.testing.assert_close(sage(ids, attention_mask=am).logits, ref(ids, attention_mask=am).logits,
                                   atol=0, rtol=0)


def test_dense_mask_built_once_per_key_padding_and_freed_with_it():
    kp = torch.ones(2, 12, dtype=torch.bool)
    kp[0, :3] = False
    hf._new_key_padding(kp)  # what sage_mask does with the key padding of a forward
    a = hf.sdpa_equivalent_mask(kp, True, 1, 12)
    assert hf.sdpa_equivalent_mask(kp, True, 1, 12) is a  # the next layer: the same object
    assert hf.sdpa_equivalent_mask(kp, True, 4, 12) is not a  # another shape: its own mask
    other = kp.clone()  # not the forward's key padding: converted, not remembered
    assert hf.sdpa_equivalent_mask(other, True, 1, 12) is not hf.sdpa_equivalent_mask(other, True, 1, 12)
    # a second key padding of the same forward (a model with sliding and full layers): both remembered, and the
    # window is part of the key
    hf._new_key_padding(other)
    w = hf.sdpa_equivalent_mask(other, True, 4, 12, 5)
    assert hf.sdpa_equivalent_mask(other, True, 4, 12, 5) is w and hf.sdpa_equivalent_mask(kp, True, 1, 12) is a
    assert not torch.equal(w, hf.sdpa_equivalent_mask(other, True, 4, 12))
    ids = (id(kp), id(other))
    del kp, a, other, w
    gc.collect()
    assert not set(ids) & set(hf._KEY_PADDINGS)  # freed with the key padding: the dense masks do not outlive it


@pytest.mark.parametrize("shape", [(2, 13), (1, 12)])
def test_bad_key_padding_raises_on_the_decode_path(shape):
    """A call decided by rule reaches no other check of the mask: the attention function checks key padding."""
    mod = FakeAttention("llama")
    q, k, v = qkv(sq=1)
    with pytest.raises(ValueError, match=r"key.padding"):
        hf.sage_attention_forward(mod, q, k, v, torch.ones(shape, dtype=torch.bool))


def test_compile_fullgraph_decode_steps_with_the_shipped_policy():
    """torch.compile(fullgraph=True) of a decode step under the llama policy: no graph break (the rule is decided
    in the compiled op, not by full_by_rule), the same logits as eager, the calls counted."""
    torch._dynamo.reset()
    sage = build("llama", policy="llama")
    ids, am = batch([40, 31], 40)
    with torch.no_grad():
        pre = sage(ids, attention_mask=am, use_cache=True)
        nxt = pre.logits[:, -1:].argmax(-1)
        am2 = torch.cat([am, torch.ones(2, 1, dtype=am.dtype)], 1)
        import copy
        cache = copy.deepcopy(pre.past_key_values)
        eager = sage(nxt, attention_mask=am2, past_key_values=pre.past_key_values, use_cache=True).logits
        compiled = torch.compile(sage, fullgraph=True, backend="aot_eager")(
            nxt, attention_mask=am2, past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(compiled, eager)
    for st in layers_of(sage).values():
        assert st["used"] == {"full": st["calls"]} and st["fallbacks"][MIN_LEN] == st["calls"] - 1


def test_head_dim_without_a_kernel_is_decided_by_rule_on_a_gpu(monkeypatch):
    """On a GPU with the kernels loaded, a head dim no kernel has (above 256) is full by rule, with the reason
    resolve's kernel check gives, so such a layer's calls skip the rest of the decision; never on CPU (the reference
    runs any head dim), for float32 (its own reason) or without kernels (resolve's own path decides)."""
    import types

    import sage_patch.kernels as K
    from sage_patch import resolve as R

    monkeypatch.setattr(R, "_LAST_BY_RULE", [None])

    def fake(d, dtype=torch.bfloat16, cuda=True):
        return types.SimpleNamespace(is_cuda=cuda, dtype=dtype, shape=torch.Size((1, 8, 300, d)))

    monkeypatch.setattr(R, "_kernels_loaded", lambda: True)
    for prec in ("8b", "4b"):
        d = R.resolve_by_rule(prec, fake(320), fake(320), layout="bhsd", float_mask=False, dropout_p=0.0)
        assert d.precision == "full" and d.impl == "sdpa"
        assert d.reason == f"{prec} unavailable: {K.registry.head_dim_reason(320)}"
        assert d.reason.startswith(f"{prec} unavailable: head_dim 320: the kernel has head dims")
    # the reason is the one can_run's own check gives
    q = torch.zeros(1, 8, 4, 320, dtype=torch.bfloat16)
    assert K._dtype_dim_gqa_reason(q, q, q, 1, torch) == K.registry.head_dim_reason(320)
    for q_, why in ((fake(128), "a native head dim"), (fake(96), "a padded head dim"), (fake(320, cuda=False), "CPU"),
                    (fake(320, torch.float32), "float32")):
        assert R.resolve_by_rule("8b", q_, q_, layout="bhsd", float_mask=False, dropout_p=0.0) is None, why
    monkeypatch.setattr(R, "_kernels_loaded", lambda: False)
    assert R.resolve_by_rule("8b", fake(320), fake(320), layout="bhsd", float_mask=False, dropout_p=0.0) is None

"""A full-precision fallback costs only the decision: on tiny random-weight transformers models, every torch SDPA call
a "sage" model makes where the resolver chose full precision (left-padded batches, sliding windows, dropout, decode
steps) is the call transformers' own "sdpa" makes: same q/k/v shapes, strides and dtypes (GQA handled the same way:
enable_gqa or repeated K/V), the same mask (dtype, shape, strides, values), the same keywords; and the outputs are
bitwise equal. The generic route_sdpa adapter hands such calls to the model's own SDPA call the same way. CPU
tensors posing as an sm_90 GPU's."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

import sage_patch
import sage_patch.full as full_mod

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=0)
MODELS = {"llama": (LlamaForCausalLM, lambda **kw: LlamaConfig(**COMMON, **kw)),
          "mistral": (MistralForCausalLM, lambda **kw: MistralConfig(**COMMON, sliding_window=16, **kw))}


def _describe(x):
    return None if x is None else (x.dtype, tuple(x.shape), x.stride())


@pytest.fixture
def recorded(monkeypatch, fake_cuda):
    """Every torch SDPA call (transformers' and sage_patch's own full path alike): (description, mask). The tensors
    pose as CUDA ones on an sm_90 device (conftest.fake_cuda): on CPU the resolver runs the reference simulation,
    on a GPU these calls run full precision."""
    fake_cuda(["80", "86", "89", "90a"])["cc"] = (9, 0)
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def rec(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        calls.append(((_describe(q), _describe(k), _describe(v), _describe(attn_mask),
                       dict(dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)),
                      attn_mask))
        return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", rec)
    monkeypatch.setattr(full_mod, "torch_sdpa", rec)
    return calls


def _pair(kind, **cfg):
    cls, make = MODELS[kind]
    torch.manual_seed(0)
    sage = cls._from_config(make(**cfg), attn_implementation="sage").eval()
    sage_patch.set_policy(sage, "8b")  # no fallback rules: what runs full is the resolver's decision
    ref = cls._from_config(make(**cfg), attn_implementation="sdpa").eval()
    ref.load_state_dict(sage.state_dict())
    return sage, ref


def _left_padded(lengths, total):
    g = torch.Generator().manual_seed(1)
    ids = torch.zeros(len(lengths), total, dtype=torch.long)
    am = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, total - n:] = torch.randint(1, 128, (n,), generator=g)
        am[i, total - n:] = 1
    return ids, am


def _run(model, calls, fn):
    start = len(calls)
    torch.manual_seed(5)  # dropout draws the same numbers in both models
    out = fn(model)
    return out, calls[start:]


def _assert_same_calls(sage_calls, ref_calls):
    assert len(sage_calls) == len(ref_calls) > 0
    for (d_sage, m_sage), (d_ref, m_ref) in zip(sage_calls, ref_calls):
        assert d_sage == d_ref
        assert (m_sage is None) == (m_ref is None) and (m_sage is None or torch.equal(m_sage, m_ref))


CASES = {
    # a left-padded prefill (dense 4-D bool mask from sdpa_mask) of a GQA model
    "padded": ("llama", {}, lambda ids, am: (lambda m: m(ids, attention_mask=am).logits)),
    # a sliding window shorter than the prompt (the mask carries it)
    "sliding_window": ("mistral", {}, lambda ids, am: (lambda m: m(ids[:1, :]).logits)),
    # dropout (a training-mode forward without gradients)
    "dropout": ("llama", {"attention_dropout": 0.25}, lambda ids, am: (lambda m: m.train()(ids, attention_mask=am)
                                                                      .logits)),
    # prefill plus decode steps (one query row: transformers packs the GQA heads instead of repeating K/V)
    "generate": ("llama", {}, lambda ids, am: (lambda m: m.generate(ids, attention_mask=am, max_new_tokens=3,
                                                                    do_sample=False, pad_token_id=0))),
}


@pytest.mark.parametrize("case", list(CASES))
def test_full_fallback_makes_transformers_own_sdpa_call(recorded, case):
    kind, cfg, make_fn = CASES[case]
    sage, ref = _pair(kind, **cfg)
    ids, am = _left_padded([40, 25, 33], 40)
    fn = make_fn(ids, am)
    with torch.no_grad():
        out_ref, ref_calls = _run(ref, recorded, fn)
        out_sage, sage_calls = _run(sage, recorded, fn)
    _assert_same_calls(sage_calls, ref_calls)
    assert torch.equal(out_sage, out_ref)
    rep = sage_patch.report(sage).to_dict()
    assert all(st["impl"] == {"sdpa": st["calls"]} for st in rep.values()), rep  # the resolver's decision, recorded


def test_route_sdpa_full_fallback_is_the_models_own_call(recorded):
    """The generic adapter: a module calling torch SDPA with GQA and a dense mask keeps its own call."""
    class Attention(torch.nn.Module):
        def forward(self, q, k, v, mask):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = Attention()

        def forward(self, *a):
            return self.attn(*a)

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 24, 16, generator=g)
    k, v = (torch.randn(2, 2, 24, 16, generator=g) for _ in range(2))
    mask = torch.rand(2, 1, 24, 24, generator=g) > 0.3
    model = Model()
    out_ref, ref_calls = _run(model, recorded, lambda m: m(q, k, v, mask))
    sage_patch.route_sdpa(model, policy="8b")
    try:
        out_sage, sage_calls = _run(model, recorded, lambda m: m(q, k, v, mask))
    finally:
        sage_patch.unload(model)
    _assert_same_calls(sage_calls, ref_calls)
    assert torch.equal(out_sage, out_ref)

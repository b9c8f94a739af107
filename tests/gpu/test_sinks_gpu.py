"""Attention sinks on the compiled kernels (run with `pytest -m gpu tests/gpu`): the kernel's attention of the real
scores, corrected from its LSE (sage_patch.api.apply_sinks), against float64 exact attention with the sinks; and a
tiny gpt-oss in bf16 (head dim 64, as gpt-oss) against transformers' eager on the same weights."""
from __future__ import annotations

import copy

import pytest
import torch
import transformers

import sage_patch
import sage_patch.kernels as K
from sage_patch.api import run_attention
from sage_patch.reference import exact_attention
from sage_patch.report import LayerStats

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or not K.status()["loaded"]:  # pragma: no cover - CPU machines
    pytest.skip(f"compiled kernels not usable here: {K.status()['reason']}", allow_module_level=True)


def cosine(a, b):
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_kernel_with_sinks_vs_float64(d, causal, padded):
    g = torch.Generator(device="cuda").manual_seed(0)
    b, hq, hkv, sq, skv = 2, 8, 2, 777, 1031  # odd lengths, GQA, a chunk into a longer cache (bottom-right)
    q = torch.randn(b, hq, sq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(b, hkv, skv, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    sinks = torch.randn(hq, device="cuda", generator=g) * 2 + 4
    am = None
    if padded:
        am = torch.ones(b, skv, dtype=torch.bool, device="cuda")
        am[1, :300] = False
    stats = LayerStats("sinks")
    out, lse = run_attention(q, k, v, is_causal=causal, attn_mask=am, precision="8b", return_lse=True, sinks=sinks,
                             stats=stats)
    assert not set(stats.impls) & {"reference", "sdpa"}, dict(stats.impls)
    want, want_lse = exact_attention(q, k, v, is_causal=causal, attn_mask=am, return_lse=True, sinks=sinks)
    assert cosine(out, want) >= 0.999
    finite = want_lse.isfinite()
    torch.testing.assert_close(lse[finite].double(), want_lse[finite].double(), atol=5e-2, rtol=0)


def _gpt_oss_pair():
    # every expert active (top-4 of 4): a top-k router turns the attention's 8b noise into discrete expert switches
    # on some tokens (with top-2 of 4 and both layers quantized: logits cos 0.992), which is the MoE's, not ours
    cfg = transformers.GptOssConfig(vocab_size=1024, hidden_size=512, intermediate_size=256, num_hidden_layers=2,
                                    num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_local_experts=4,
                                    num_experts_per_tok=4, sliding_window=128, max_position_embeddings=4096,
                                    tie_word_embeddings=False, pad_token_id=0,
                                    layer_types=["sliding_attention", "full_attention"])
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 150000.0}
    torch.manual_seed(0)
    with torch.device("cuda"):
        sage = transformers.GptOssForCausalLM._from_config(copy.deepcopy(cfg), attn_implementation="sage",
                                                           dtype=torch.bfloat16).eval()
        ref = transformers.GptOssForCausalLM._from_config(copy.deepcopy(cfg), attn_implementation="eager",
                                                          dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for layer in sage.model.layers:
            layer.self_attn.sinks.copy_(torch.randn_like(layer.self_attn.sinks) * 2 + 4)
    ref.load_state_dict(sage.state_dict())
    return sage, ref


@pytest.mark.skipif(not hasattr(transformers, "GptOssConfig"), reason="the installed transformers has no gpt-oss")
@pytest.mark.parametrize("compiled", [False, True])
def test_gpt_oss_full_attention_layer_runs_the_kernel_and_matches_eager(compiled):
    torch._dynamo.reset()
    sage, ref = _gpt_oss_pair()
    ids = torch.randint(1, 1024, (2, 1000), device="cuda")
    am = torch.ones_like(ids)
    am[1, :200] = 0
    run = torch.compile(sage, fullgraph=True) if compiled else sage
    with torch.no_grad():
        out, expected = run(ids, attention_mask=am).logits, ref(ids, attention_mask=am).logits
    real = am.bool()
    assert cosine(out[real], expected[real]) >= 0.999
    st = sage_patch.report(sage).to_dict()["model.layers.1.self_attn"]  # the full-attention layer
    assert st["used"] == {"8b": 1} and not set(st["impl"]) & {"reference", "sdpa", "eager"}, st

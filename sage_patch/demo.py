"""`sage-patch demo`: tiny models with random weights, each precision against full precision, on any machine."""
from __future__ import annotations

import contextlib
import time

import torch

from .accuracy import compare
from .policy import Policy
from .report import report


def _tiny_flux(seed: int):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
                                   attention_head_dim=64, num_attention_heads=2, joint_attention_dim=32,
                                   pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(16, 24, 24)).eval()
    side, txt = 16, 32  # 256 image tokens + 32 text tokens
    ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(side).float(), torch.arange(side).float(), indexing="ij"), -1)
    inputs = dict(hidden_states=torch.randn(1, side * side, 16), encoder_hidden_states=torch.randn(1, txt, 32),
                  pooled_projections=torch.randn(1, 32), timestep=torch.tensor([0.5]), guidance=torch.tensor([3.5]),
                  img_ids=ids.reshape(-1, 3).float(), txt_ids=torch.zeros(txt, 3), return_dict=False)
    return "tiny Flux transformer (288 tokens, 2+2 blocks)", model, lambda m: m(**inputs)[0]


def _tiny_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()
    ids = torch.randint(0, 256, (1, 384))
    return "tiny Llama (384-token prefill, GQA 4/2)", model, lambda m: m(input_ids=ids).logits


def _timed(fn):
    t0 = time.perf_counter()
    with torch.no_grad():
        out = fn()
    return out, (time.perf_counter() - t0) * 1e3


@contextlib.contextmanager
def _sage(model, precision: str):
    """Route the model through its library's integration (or the generic route_sdpa) at one precision."""
    from .integrations import STATUS
    from .routing import route_sdpa

    policy = Policy(default=precision)  # min_seq_len 0: every call of these tiny models is quantized
    if hasattr(model, "enable_sage_attention"):  # diffusers model
        model.enable_sage_attention(policy=policy)
        try:
            yield "diffusers integration"
        finally:
            model.disable_sage_attention()
    elif STATUS.get("transformers") == "installed" and hasattr(model, "set_attn_implementation"):
        from . import set_policy

        before = model.config._attn_implementation
        model.set_attn_implementation("sage")
        set_policy(model, policy)
        try:
            yield 'transformers attn_implementation="sage"'
        finally:
            model.set_attn_implementation(before)
    else:
        with route_sdpa(model, policy):
            yield "generic route_sdpa"


def run_demo(precisions=("8b", "4b", "fp4", "full"), seed: int = 0) -> int:
    builders = []
    for build in (_tiny_flux, _tiny_llama):
        try:
            builders.append(build(seed))
        except ImportError as e:
            print(f"skipping {build.__name__[1:]}: {e}")
    rows = []
    for title, model, forward in builders:
        base, t_base = _timed(lambda: forward(model))
        rows.append((title, "original (torch SDPA)", 1.0, 0.0, t_base, "-"))
        for prec in precisions:
            with _sage(model, prec) as how:
                for st in report(model).layers.values():
                    st.reset()
                out, t = _timed(lambda: forward(model))
                impls = set()
                for st in report(model).layers.values():
                    impls.update(st.impls)
            title_how = f"{title} via {how}"
            m = compare(out, base)
            rows.append((title, prec, m["cos"], m["rel_l1"], t, ",".join(sorted(impls))))
        print(f"{title_how}")
    print(f"{'model':45s} {'precision':22s} {'cos vs orig':>12s} {'rel L1':>9s} {'ms':>8s}  impl")
    for title, prec, cos, l1, t, impl in rows:
        print(f"{title:45s} {prec:22s} {cos:12.6f} {l1:9.5f} {t:8.1f}  {impl}")
    print("Weights are random (no download); 8b/4b/fp4 run the reference simulation where no kernel is loaded.")
    return 0

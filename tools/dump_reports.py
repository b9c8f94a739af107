"""Dump `sage_patch.report(...)` of tiny Flux, SD3.5, CogVideoX, HunyuanVideo and Llama models after one forward
(CPU, default shipped policies) as JSON: layers, precisions, implementations and fallback reasons. Used to check
that a refactor leaves every report unchanged: `python tools/dump_reports.py > a.json` on two commits, diff."""
from __future__ import annotations

import json
import sys

import torch

import sage_patch


def _flux():
    from diffusers import FluxTransformer2DModel
    m = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
                               num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                               guidance_embeds=True, axes_dims_rope=(4, 6, 6)).eval()
    kw = dict(hidden_states=torch.randn(1, 64, 16), encoder_hidden_states=torch.randn(1, 13, 32),
              pooled_projections=torch.randn(1, 32), timestep=torch.tensor([1.0]), guidance=torch.tensor([3.5]),
              img_ids=torch.zeros(64, 3), txt_ids=torch.zeros(13, 3))
    return m, kw


def _sd35():
    from diffusers import SD3Transformer2DModel
    m = SD3Transformer2DModel(sample_size=32, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=8,
                              num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=32,
                              pooled_projection_dim=64, out_channels=4, pos_embed_max_size=96,
                              dual_attention_layers=(0,), qk_norm="rms_norm").eval()
    kw = dict(hidden_states=torch.randn(1, 4, 16, 16), encoder_hidden_states=torch.randn(1, 13, 32),
              pooled_projections=torch.randn(1, 64), timestep=torch.tensor([1.0]))
    return m, kw


def _cogvideox():
    from diffusers import CogVideoXTransformer3DModel
    from diffusers.models.embeddings import get_3d_rotary_pos_embed
    m = CogVideoXTransformer3DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
                                    time_embed_dim=8, text_embed_dim=8, num_layers=2, sample_width=8, sample_height=8,
                                    sample_frames=9, patch_size=2, temporal_compression_ratio=4,
                                    max_text_seq_length=8, use_rotary_positional_embeddings=True).eval()
    rope = get_3d_rotary_pos_embed(embed_dim=16, crops_coords=((0, 0), (4, 4)), grid_size=(4, 4), temporal_size=3)
    kw = dict(hidden_states=torch.randn(1, 3, 4, 8, 8), encoder_hidden_states=torch.randn(1, 8, 8),
              timestep=torch.tensor([1]), image_rotary_emb=rope)
    return m, kw


def _hunyuan():
    from diffusers import HunyuanVideoTransformer3DModel
    m = HunyuanVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16,
                                       num_layers=2, num_single_layers=2, num_refiner_layers=1, patch_size=1,
                                       patch_size_t=1, text_embed_dim=16, pooled_projection_dim=8,
                                       rope_axes_dim=(4, 6, 6), guidance_embeds=True).eval()
    mask = torch.ones(1, 12, dtype=torch.bool)
    mask[:, 9:] = False
    kw = dict(hidden_states=torch.randn(1, 4, 3, 8, 8), timestep=torch.tensor([1]),
              encoder_hidden_states=torch.randn(1, 12, 16), encoder_attention_mask=mask,
              pooled_projections=torch.randn(1, 8), guidance=torch.tensor([3.5]))
    return m, kw


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    m = LlamaForCausalLM._from_config(cfg, attn_implementation="sage").eval()
    ids = torch.randint(0, 128, (2, 160))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    return m, dict(input_ids=ids, attention_mask=mask)


MODELS = {"flux": _flux, "sd35": _sd35, "cogvideox": _cogvideox, "hunyuanvideo": _hunyuan, "llama": _llama}


def dump() -> dict:
    """{model[:policy][:before-forward]: report dict}, for the shipped default policy and for policy "8b"."""
    out = {}
    for policy in (None, "8b"):
        for name, build in MODELS.items():
            torch.manual_seed(0)
            model, kw = build()
            if hasattr(model, "enable_sage_attention"):
                model.enable_sage_attention(policy)
            elif policy is not None:
                sage_patch.set_policy(model, policy)
            key = name if policy is None else f"{name}:{policy}"
            out[f"{key}:before-forward"] = sage_patch.report(model).to_dict()
            with torch.no_grad():
                model(**kw)
            out[key] = sage_patch.report(model).to_dict()
    return out


if __name__ == "__main__":
    json.dump(dump(), sys.stdout, indent=1, sort_keys=True)
    print()

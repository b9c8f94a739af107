#!/usr/bin/env python
"""Benchmark: one transformer forward of full-size diffusion architectures, with and without sage attention.

Random bf16 weights from the real configs (no download; the configs are inlined below), batch 1, on CUDA:

    flux-1024      Flux.1-dev, 1024x1024         (4096 image + 512 text tokens, 57 attention layers)
    flux-2048      Flux.1-dev, 2048x2048         (16384 + 512 tokens)
    sd35-1024      SD3.5-large, 1024x1024        (4096 + 333 tokens, 38 layers, head dim 64)
    cogvideox-5b   CogVideoX-5b, 49 frames 480x720 (13 x 1350 + 226 = 17776 tokens, 42 layers)
    hunyuan-720p   HunyuanVideo, 720x1280, 129 frames (33 x 3600 + 256 = 119056 tokens, 62 layers incl. refiner)
    ideogram4-1024 Ideogram 4, 1024x1024 (4096 image + 512 text tokens in one packed sequence, 34 layers, 18 heads x
                   head dim 256; the model's segment mask of one sample)
    ideogram4-2048 Ideogram 4, 2048x2048 (16384 + 512 tokens)
                   (--frames reduces the frame count if memory or time demands; the JSON records it)

For each case, in the same process and on the same weights and inputs: the median time of one forward with the
original processors, and with `enable_sage_attention()` (the shipped policy of the model class; --policy to
override), timed with CUDA events after warm-up. A separate instrumented forward of each variant times every
attention call (CUDA events around each call) to give the share of time in attention and the attention
speed-up; from those, the Amdahl bound of the end-to-end speed-up and the fraction of it that was reached.
The sage output's cosine similarity to the original is recorded as a sanity check.

    python benchmarks/bench_diffusers.py --cases flux-1024 sd35-1024 --json out.json --md out.md
    python benchmarks/bench_diffusers.py --tiny          # CPU smoke test: tiny configs, reference numerics

Imports only torch, sage_patch and the diffusers transformer model classes (no pipelines, no text encoders).
Without loaded CUDA kernels the quantized path would be the PyTorch reference simulation, which is not a
meaningful speed: the sage timing is then skipped unless --allow-reference.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import Clock, run_meta  # noqa: E402

# ---- real configs (diffusers transformer/config.json of each release) ------------------------------------------

FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                axes_dims_rope=(16, 56, 56))
SD35_LARGE = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=38, attention_head_dim=64,
                  num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432,
                  pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192, qk_norm="rms_norm",
                  dual_attention_layers=())
COGVIDEOX_5B = dict(num_attention_heads=48, attention_head_dim=64, in_channels=16, out_channels=16,
                    flip_sin_to_cos=True, freq_shift=0, time_embed_dim=512, text_embed_dim=4096, num_layers=42,
                    dropout=0.0, attention_bias=True, sample_width=90, sample_height=60, sample_frames=49,
                    patch_size=2, temporal_compression_ratio=4, max_text_seq_length=226,
                    activation_fn="gelu-approximate", timestep_activation_fn="silu", norm_elementwise_affine=True,
                    norm_eps=1e-5, spatial_interpolation_scale=1.875, temporal_interpolation_scale=1.0,
                    use_rotary_positional_embeddings=True, use_learned_positional_embeddings=False)
HUNYUAN_VIDEO = dict(in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128, num_layers=20,
                     num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0, patch_size=2, patch_size_t=1,
                     qk_norm="rms_norm", guidance_embeds=True, text_embed_dim=4096, pooled_projection_dim=768,
                     rope_theta=256.0, rope_axes_dim=(16, 56, 56))
IDEOGRAM4 = dict(in_channels=128, num_layers=34, attention_head_dim=256, num_attention_heads=18, intermediate_size=12288,
                 adaln_dim=512, llm_features_dim=53248, rope_theta=5_000_000, mrope_section=(24, 20, 20))

# tiny stand-ins for --tiny (same code paths, CPU-sized)
TINY = {
    "flux": dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
                 num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
                 axes_dims_rope=(4, 6, 6)),
    "sd35": dict(sample_size=32, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=8, num_attention_heads=4,
                 joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=64, out_channels=4,
                 pos_embed_max_size=96, qk_norm="rms_norm", dual_attention_layers=(0,)),
    "cogvideox": dict(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=8,
                      text_embed_dim=8, num_layers=2, sample_width=16, sample_height=16, sample_frames=9, patch_size=2,
                      temporal_compression_ratio=4, max_text_seq_length=8, use_rotary_positional_embeddings=True),
    "hunyuan": dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
                    num_single_layers=2, num_refiner_layers=1, patch_size=1, patch_size_t=1, text_embed_dim=16,
                    pooled_projection_dim=8, rope_axes_dim=(4, 6, 6), guidance_embeds=True),
    "ideogram4": dict(in_channels=16, num_layers=2, attention_head_dim=64, num_attention_heads=2, intermediate_size=64,
                      adaln_dim=16, llm_features_dim=32, mrope_section=(12, 10, 10)),
}

CASES = {
    # name: (family, height, width, frames)
    "flux-1024": ("flux", 1024, 1024, None),
    "flux-2048": ("flux", 2048, 2048, None),
    "sd35-1024": ("sd35", 1024, 1024, None),
    "cogvideox-5b": ("cogvideox", 480, 720, 49),
    "hunyuan-720p": ("hunyuan", 720, 1280, 129),
    "ideogram4-1024": ("ideogram4", 1024, 1024, None),
    "ideogram4-2048": ("ideogram4", 2048, 2048, None),
}
# --tiny sizes (pixels; the VAE factor is 8 as in the real models)
TINY_SIZES = {"flux": (128, 128, None), "sd35": (128, 128, None), "cogvideox": (128, 128, 9),
              "hunyuan": (64, 64, 9), "ideogram4": (128, 128, None)}


# ---- inputs -------------------------------------------------------------------------------------------------

def _flux(cfg, h, w, frames, device, dtype, tiny):
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel(**cfg)
    lh, lw = h // 16, w // 16                      # VAE /8, then 2x2 packing
    n_img, n_txt = lh * lw, (16 if tiny else 512)
    ids = torch.zeros(lh, lw, 3)
    ids[..., 1] += torch.arange(lh)[:, None]
    ids[..., 2] += torch.arange(lw)[None, :]
    inputs = dict(hidden_states=torch.randn(1, n_img, cfg["in_channels"]),
                  encoder_hidden_states=torch.randn(1, n_txt, cfg["joint_attention_dim"]),
                  pooled_projections=torch.randn(1, cfg["pooled_projection_dim"]), timestep=torch.tensor([0.5]),
                  guidance=torch.tensor([3.5]), img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(n_txt, 3))
    return model, inputs, n_img + n_txt


def _sd35(cfg, h, w, frames, device, dtype, tiny):
    from diffusers import SD3Transformer2DModel

    model = SD3Transformer2DModel(**cfg)
    lh, lw = h // 8, w // 8
    n_txt = 24 if tiny else 333                    # 77 CLIP + 256 T5
    inputs = dict(hidden_states=torch.randn(1, cfg["in_channels"], lh, lw),
                  encoder_hidden_states=torch.randn(1, n_txt, cfg["joint_attention_dim"]),
                  pooled_projections=torch.randn(1, cfg["pooled_projection_dim"]), timestep=torch.tensor([500]))
    return model, inputs, (lh // cfg["patch_size"]) * (lw // cfg["patch_size"]) + n_txt


def _crop_region(src, tgt_width, tgt_height):  # = diffusers' get_resize_crop_region_for_grid (pipelines import)
    h, w = src
    if h / w > tgt_height / tgt_width:
        rh, rw = tgt_height, int(round(tgt_height / h * w))
    else:
        rw, rh = tgt_width, int(round(tgt_width / w * h))
    top, left = int(round((tgt_height - rh) / 2.0)), int(round((tgt_width - rw) / 2.0))
    return (top, left), (top + rh, left + rw)


def _cogvideox(cfg, h, w, frames, device, dtype, tiny):
    from diffusers import CogVideoXTransformer3DModel
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    model = CogVideoXTransformer3DModel(**cfg)
    p = cfg["patch_size"]
    lf, lh, lw = (frames - 1) // 4 + 1, h // 8, w // 8
    gh, gw = lh // p, lw // p
    n_txt = cfg["max_text_seq_length"]
    rope = get_3d_rotary_pos_embed(embed_dim=cfg["attention_head_dim"],
                                   crops_coords=_crop_region((gh, gw), cfg["sample_width"] // p,
                                                             cfg["sample_height"] // p),
                                   grid_size=(gh, gw), temporal_size=lf)
    inputs = dict(hidden_states=torch.randn(1, lf, cfg["in_channels"], lh, lw),
                  encoder_hidden_states=torch.randn(1, n_txt, cfg["text_embed_dim"]), timestep=torch.tensor([500]),
                  image_rotary_emb=rope)
    return model, inputs, lf * gh * gw + n_txt


def _hunyuan(cfg, h, w, frames, device, dtype, tiny):
    from diffusers import HunyuanVideoTransformer3DModel

    model = HunyuanVideoTransformer3DModel(**cfg)
    lf, lh, lw = (frames - 1) // 4 + 1, h // 8, w // 8
    n_txt = 12 if tiny else 256
    mask = torch.ones(1, n_txt, dtype=torch.long)
    mask[:, int(n_txt * 0.7):] = 0                 # text padding at the tail, as real prompts have
    inputs = dict(hidden_states=torch.randn(1, cfg["in_channels"], lf, lh, lw), timestep=torch.tensor([500]),
                  encoder_hidden_states=torch.randn(1, n_txt, cfg["text_embed_dim"]), encoder_attention_mask=mask,
                  pooled_projections=torch.randn(1, cfg["pooled_projection_dim"]), guidance=torch.tensor([6000.0]))
    ps, pt = cfg["patch_size"], cfg["patch_size_t"]
    return model, inputs, (lf // pt) * (lh // ps) * (lw // ps) + n_txt


def _ideogram4(cfg, h, w, frames, device, dtype, tiny):
    from diffusers.models.transformers import transformer_ideogram4 as ideo

    model = ideo.Ideogram4Transformer2DModel(**cfg)
    lh, lw = h // 16, w // 16                      # VAE /8, then 2x2 patches (in_channels = 32 x 4)
    n_img, n_txt = lh * lw, (16 if tiny else 512)
    n = n_txt + n_img
    pos = torch.zeros(1, n, 3, dtype=torch.long)   # text: t = token index; image: (h, w) grid after the text
    pos[0, :n_txt, 0] = torch.arange(n_txt)
    pos[0, n_txt:, 1] = torch.arange(lh).repeat_interleave(lw)
    pos[0, n_txt:, 2] = torch.arange(lw).repeat(lh)
    indicator = torch.tensor([ideo.LLM_TOKEN_INDICATOR] * n_txt + [ideo.OUTPUT_IMAGE_INDICATOR] * n_img)[None]
    inputs = dict(hidden_states=torch.randn(1, n, cfg["in_channels"]), timestep=torch.tensor([0.5]),
                  encoder_hidden_states=torch.randn(1, n, cfg["llm_features_dim"]), position_ids=pos,
                  segment_ids=torch.zeros(1, n, dtype=torch.long), indicator=indicator)
    return model, inputs, n


BUILDERS = {"flux": (_flux, FLUX_DEV), "sd35": (_sd35, SD35_LARGE), "cogvideox": (_cogvideox, COGVIDEOX_5B),
            "hunyuan": (_hunyuan, HUNYUAN_VIDEO), "ideogram4": (_ideogram4, IDEOGRAM4)}


def build(family, h, w, frames, device, dtype, tiny, seed=0, overrides=None):
    """The model (eval, no grad) and inputs of `family` at h x w (x frames); `overrides` replace config values
    (e.g. fewer blocks)."""
    fn, cfg = BUILDERS[family]
    cfg = {**(TINY[family] if tiny else cfg), **(overrides or {})}
    torch.manual_seed(seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)                 # random init directly in bf16 on the GPU: no fp32 copy
    try:
        with torch.device(device):
            model, inputs, tokens = fn(cfg, h, w, frames, device, dtype, tiny)
    finally:
        torch.set_default_dtype(prev)
    model = model.to(device=device).eval().requires_grad_(False)
    if any(p.is_floating_point() and p.dtype != dtype for p in model.parameters()):
        model = model.to(dtype=dtype)

    def to(x):
        if isinstance(x, torch.Tensor):
            return x.to(device=device, dtype=dtype if x.is_floating_point() else x.dtype)
        if isinstance(x, tuple):
            return tuple(to(y) for y in x)
        return x

    inputs = {k: to(v) for k, v in inputs.items()}
    inputs["return_dict"] = False
    return model, inputs, tokens


# ---- timing -------------------------------------------------------------------------------------------------

def time_forward(model, inputs, clock, warmup, reps):
    with torch.no_grad():
        for _ in range(warmup):
            out = model(**inputs)[0]
        times = []
        for _ in range(reps):
            a = clock.mark()
            out = model(**inputs)[0]
            b = clock.mark()
            times.append(clock.ms(a, b))
    return statistics.median(times), times, out


def attention_time(model, inputs, clock):
    """One forward with every routed attention call timed (needs sage enabled; policy "full" = the original
    attention path). A routed call arrives at torch's SDPA or at a backend of diffusers' registry (both routed
    while sage is enabled) inside a routed layer; only the outermost such call is timed. Returns (total attention
    ms, forward ms, calls)."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    from sage_patch import layer_scope
    from sage_patch.binding import LayerBinding

    marks, depth = [], [0]

    def timed(fn):
        def wrapper(*args, **kwargs):
            if depth[0] or not isinstance(layer_scope.current(), LayerBinding):
                return fn(*args, **kwargs)
            depth[0] += 1
            try:
                a = clock.mark()
                out = fn(*args, **kwargs)
                marks.append((a, clock.mark()))
                return out
            finally:
                depth[0] -= 1
        return wrapper

    backends = dict(_AttentionBackendRegistry._backends)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    _AttentionBackendRegistry._backends.update({k: timed(v) for k, v in backends.items()})
    torch.nn.functional.scaled_dot_product_attention = timed(sdpa)
    try:
        with torch.no_grad():
            a = clock.mark()
            model(**inputs)
            b = clock.mark()
        total = clock.ms(a, b)
        attn = sum(clock.ms(x, y) for x, y in marks)
    finally:
        _AttentionBackendRegistry._backends.update(backends)
        torch.nn.functional.scaled_dot_product_attention = sdpa
    return attn, total, len(marks)


def cosine(a, b):
    return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def run_case(name, family, h, w, frames, args, device, dtype):
    import sage_patch
    from sage_patch import kernels

    rec = {"case": name, "family": family, "height": h, "width": w, "frames": frames, "batch": 1,
           "dtype": str(dtype).replace("torch.", ""), "device": str(device)}
    if device.type == "cuda":
        rec["gpu"] = torch.cuda.get_device_name(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    model, inputs, tokens = build(family, h, w, frames, device, dtype, args.tiny)
    rec.update(tokens=tokens, attention_layers=len(model.attn_processors),
               params_b=round(sum(p.numel() for p in model.parameters()) / 1e9, 3),
               build_s=round(time.perf_counter() - t0, 1))
    clock = Clock(device)
    base_ms, base_all, base_out = time_forward(model, inputs, clock, args.warmup, args.reps)
    rec.update(base_ms=round(base_ms, 3), base_all_ms=[round(t, 3) for t in base_all],
               base_finite=bool(torch.isfinite(base_out).all()))

    # attention share of the original: route with "full" (= the original attention call) and time each call
    model.enable_sage_attention("full")
    attn_full, total_full, calls = attention_time(model, inputs, clock)
    model.disable_sage_attention()
    rec.update(attn_full_ms=round(attn_full, 3), attn_calls=calls,
               attn_share=round(attn_full / total_full, 4) if total_full else None)

    status = kernels.status()
    rec["kernels"] = {k: status.get(k) for k in ("loaded", "reason", "archs")}
    if device.type == "cuda" and not status["loaded"] and not args.allow_reference:
        rec["sage"] = f"skipped: compiled kernels not loaded ({status['reason']})"
        print(f"[{name}] {rec['sage']}", file=sys.stderr)
        return rec

    model.enable_sage_attention(args.policy)
    try:
        sage_ms, sage_all, sage_out = time_forward(model, inputs, clock, args.warmup, args.reps)
        attn_sage, total_sage, _ = attention_time(model, inputs, clock)
        rep = sage_patch.report(model)
        used, fallbacks = {}, {}
        for st in rep.layers.values():
            for p, n in st.used.items():
                used[p] = used.get(p, 0) + n
            for r, n in st.fallbacks.items():
                fallbacks[r] = fallbacks.get(r, 0) + n
    finally:
        model.disable_sage_attention()
    speedup = base_ms / sage_ms
    attn_speedup = attn_full / attn_sage if attn_sage else None
    # Amdahl: the end-to-end speed-up the attention share and the attention speed-up allow
    amdahl = base_ms / (base_ms - attn_full + attn_sage) if attn_sage else None
    rec.update(policy=args.policy or "shipped default", sage_ms=round(sage_ms, 3),
               sage_all_ms=[round(t, 3) for t in sage_all], speedup=round(speedup, 4),
               attn_sage_ms=round(attn_sage, 3), attn_speedup=round(attn_speedup, 3) if attn_speedup else None,
               amdahl_speedup=round(amdahl, 4) if amdahl else None,
               fraction_of_amdahl=round(speedup / amdahl, 4) if amdahl else None,
               gain_fraction=round((speedup - 1) / (amdahl - 1), 3) if amdahl and amdahl > 1.001 else None,
               cos_vs_original=round(cosine(sage_out, base_out), 6), precisions_used=used,
               fallbacks=fallbacks)
    if device.type == "cuda":
        rec["peak_mem_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    del model, inputs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rec


def markdown(records) -> str:
    head = ("| case | tokens | layers | original ms | sage ms | speed-up | attention share | attention speed-up "
            "| Amdahl bound | reached | cos |")
    lines = [head, "|" + "---|" * 11]
    for r in records:
        def f(k, fmt="{}"):
            v = r.get(k)
            return fmt.format(v) if isinstance(v, (int, float)) else "-"
        lines.append(" ".join([
            f"| {r['case']}" + (f" ({r['frames']} frames)" if r.get("frames") else ""), "|", f("tokens"), "|",
            f("attention_layers"), "|", f("base_ms", "{:.1f}"), "|",
            f("sage_ms", "{:.1f}") if "sage_ms" in r else str(r.get("sage", "-")), "|",
            f("speedup", "{:.3f}x"), "|", f("attn_share", "{:.1%}"), "|", f("attn_speedup", "{:.2f}x"), "|",
            f("amdahl_speedup", "{:.3f}x"), "|", f("fraction_of_amdahl", "{:.1%}"), "|",
            f("cos_vs_original", "{:.5f}"), "|"]))
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", choices=list(CASES), default=None,
                    help="default: all (the four image cases and both video cases)")
    ap.add_argument("--frames", type=int, default=None, help="override the frame count of the video cases")
    ap.add_argument("--policy", default=None, help="precision name, YAML path or YAML string; default: the "
                                                   "shipped policy of the model class")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test with tiny configs (fp32)")
    ap.add_argument("--allow-reference", action="store_true",
                    help="time the PyTorch reference simulation on GPU when kernels are not loaded")
    ap.add_argument("--json", default=None, help="write the records here ({meta, records})")
    ap.add_argument("--md", default=None, help="write the Markdown table here")
    args = ap.parse_args(argv)

    import sage_patch  # noqa: F401  (installs enable_sage_attention on diffusers models)

    if args.tiny:
        device, dtype = torch.device("cpu"), torch.float32
        args.warmup = 1 if args.warmup is None else args.warmup
        args.reps = 2 if args.reps is None else args.reps
        if args.policy is None:
            args.policy = "8b"   # the tiny shapes are below the shipped policies' min_seq_len
    else:
        if not torch.cuda.is_available():
            ap.error("needs a CUDA GPU (or --tiny)")
        device, dtype = torch.device("cuda"), torch.bfloat16
    names = args.cases or list(CASES)
    cli_warmup, cli_reps = args.warmup, args.reps
    records = []
    for name in names:
        family, h, w, frames = CASES[name]
        if args.tiny:
            h, w, frames = TINY_SIZES[family]
        if frames is not None and args.frames is not None:
            frames = args.frames
        if not args.tiny:  # HunyuanVideo 720p/129f takes tens of seconds per forward: fewer repetitions
            video = family in ("hunyuan",)
            args.warmup = cli_warmup if cli_warmup is not None else (1 if video else 2)
            args.reps = cli_reps if cli_reps is not None else (3 if video else 5)
        try:
            rec = run_case(name, family, h, w, frames, args, device, dtype)
        except torch.cuda.OutOfMemoryError as e:  # record and go on with the next case
            rec = {"case": name, "error": f"out of memory: {e}".splitlines()[0]}
            torch.cuda.empty_cache()
        records.append(rec)
        print(json.dumps(rec), flush=True)
    md = markdown(records)
    print(md)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": run_meta(policy=args.policy or "shipped default"), "records": records}, f, indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write(md + "\n")
    return records


if __name__ == "__main__":
    main()

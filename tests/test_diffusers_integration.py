"""diffusers integration on CPU: tiny Flux, SD3, SD3.5-medium-like, CogVideoX and HunyuanVideo transformers built from
configs, and a tiny FluxPipeline assembled from components (no download). On CPU the quantized precisions run the
reference simulation, so "8b" here checks the routing and the arithmetic of the 8-bit path, not speed."""
import pytest
import torch

pytest.importorskip("diffusers")

import sage_patch  # noqa: E402  (installs enable_sage_attention on diffusers classes)
from sage_patch.integrations import diffusers as sd  # noqa: E402
from sage_patch.lifecycle import bindings_of  # noqa: E402
from sage_patch.binding import layer_index  # noqa: E402

FULL_TOL = 1e-6
MIN_COS = 0.999


def cos(a, b):
    return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def processors(model):
    return dict(model.attn_processors)


# ---- tiny models -----------------------------------------------------------------------------------------------

def tiny_flux():
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    m = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
                               num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                               guidance_embeds=True, axes_dims_rope=(4, 6, 6)).eval()
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(2, 64, 16, generator=g), encoder_hidden_states=torch.randn(2, 13, 32, generator=g),
                  pooled_projections=torch.randn(2, 32, generator=g), timestep=torch.tensor([0.5, 0.7]),
                  guidance=torch.tensor([3.5, 3.5]), img_ids=torch.randn(64, 3, generator=g), txt_ids=torch.zeros(13, 3),
                  return_dict=False)
    return m, inputs


def tiny_sd3(dual=()):
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    m = SD3Transformer2DModel(sample_size=32, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=8,
                              num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=32,
                              pooled_projection_dim=64, out_channels=4, pos_embed_max_size=96,
                              dual_attention_layers=dual, qk_norm="rms_norm").eval()
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(2, 4, 16, 16, generator=g),
                  encoder_hidden_states=torch.randn(2, 13, 32, generator=g),
                  pooled_projections=torch.randn(2, 64, generator=g), timestep=torch.tensor([500, 700]),
                  return_dict=False)
    return m, inputs


def tiny_cogvideox():
    from diffusers import CogVideoXTransformer3DModel
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    torch.manual_seed(0)
    m = CogVideoXTransformer3DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
                                    time_embed_dim=8, text_embed_dim=8, num_layers=2, sample_width=8, sample_height=8,
                                    sample_frames=9, patch_size=2, temporal_compression_ratio=4,
                                    max_text_seq_length=8, use_rotary_positional_embeddings=True).eval()
    g = torch.Generator().manual_seed(1)
    rope = get_3d_rotary_pos_embed(embed_dim=16, crops_coords=((0, 0), (4, 4)), grid_size=(4, 4), temporal_size=3)
    inputs = dict(hidden_states=torch.randn(2, 3, 4, 8, 8, generator=g),
                  encoder_hidden_states=torch.randn(2, 8, 8, generator=g), timestep=torch.tensor([500, 700]),
                  image_rotary_emb=rope, return_dict=False)
    return m, inputs


def tiny_hunyuan():
    from diffusers import HunyuanVideoTransformer3DModel

    torch.manual_seed(0)
    m = HunyuanVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16,
                                       num_layers=2, num_single_layers=2, num_refiner_layers=1, patch_size=1,
                                       patch_size_t=1, text_embed_dim=16, pooled_projection_dim=8,
                                       rope_axes_dim=(4, 6, 6), guidance_embeds=True).eval()
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, 9:] = 0   # text padding at the tail, different per sample
    mask[1, 5:] = 0
    inputs = dict(hidden_states=torch.randn(2, 4, 3, 8, 8, generator=g), timestep=torch.tensor([500, 700]),
                  encoder_hidden_states=torch.randn(2, 12, 16, generator=g), encoder_attention_mask=mask,
                  pooled_projections=torch.randn(2, 8, generator=g), guidance=torch.tensor([3500.0, 3500.0]),
                  return_dict=False)
    return m, inputs


MODELS = {
    # name: (builder, number of attention layers, the shipped policy its class gets)
    "flux": (tiny_flux, 4, "flux"),
    "sd3": (lambda: tiny_sd3(()), 3, "sd35"),
    "sd35_medium": (lambda: tiny_sd3((0, 1)), 5, "sd35"),
    "cogvideox": (tiny_cogvideox, 2, "cogvideox"),
    "hunyuanvideo": (tiny_hunyuan, 5, "hunyuanvideo"),
}


@pytest.fixture(scope="module", params=list(MODELS))
def built(request):
    builder, n_layers, family = MODELS[request.param]
    model, inputs = builder()
    with torch.no_grad():
        ref = model(**inputs)[0]
    return request.param, model, inputs, ref, n_layers, family


def run(model, inputs):
    with torch.no_grad():
        return model(**inputs)[0]


# ---- every model: full == original, 8b close, report complete, disable restores -----------------------------

def test_full_equals_original_and_report(built):
    name, model, inputs, ref, n_layers, _ = built
    before = processors(model)
    model.enable_sage_attention("full")
    try:
        out = run(model, inputs)
        assert (out - ref).abs().max().item() <= FULL_TOL
        rep = sage_patch.report(model).to_dict()
        assert len(rep) == n_layers == len(before), rep.keys()
        assert set(rep) == {k.removesuffix(".processor") for k in before}
        for layer, st in rep.items():
            assert st["calls"] == 1 and st["used"] == {"full": 1}, (layer, st)
        assert sd.sage_skipped(model) == {}
    finally:
        model.disable_sage_attention()
    after = processors(model)
    assert before.keys() == after.keys() and all(after[k] is before[k] for k in before)
    assert len(sage_patch.report(model)) == 0
    assert (run(model, inputs) - ref).abs().max().item() == 0


def test_8b_close_and_really_8b(built):
    name, model, inputs, ref, n_layers, _ = built
    model.enable_sage_attention("8b")   # a bare precision name: no min_seq_len, so 8b runs on the tiny shapes
    try:
        out = run(model, inputs)
        c = cos(out, ref)
        assert c >= MIN_COS, (name, c)
        assert (out - ref).abs().max().item() > 0      # really quantized, not silently full
        rep = sage_patch.report(model).to_dict()
        assert len(rep) == n_layers
        for layer, st in rep.items():
            assert st["calls"] == 1 and st["used"] == {"8b": 1}, (layer, st)
            assert st["impl"] == {"reference": 1}
    finally:
        model.disable_sage_attention()


def test_default_policy_from_model_class(built):
    name, model, inputs, ref, n_layers, family = built
    model.enable_sage_attention()
    try:
        st = getattr(model, sd._STATE_ATTR)
        assert st.policy.name == family
        out = run(model, inputs)
        assert cos(out, ref) >= MIN_COS
        for layer, stats in sage_patch.report(model).to_dict().items():
            # no step outside a pipeline: the layer rules of the shipped policy decide
            assert stats["requested"] == {st.policy.layer_precision(layer, layer_index(layer)): 1}
            if "token_refiner" in layer:
                assert stats["used"] == {"full": 1}
    finally:
        model.disable_sage_attention()


def test_enable_twice_is_harmless(built):
    name, model, inputs, ref, n_layers, _ = built
    before = processors(model)
    model.enable_sage_attention("8b")
    first = processors(model)
    model.enable_sage_attention("8b")
    second = processors(model)
    try:
        bindings = bindings_of(model)
        model.enable_sage_attention("8b")
        assert all(bindings_of(model)[k] is b for k, b in bindings.items())   # the same bindings, hooked once
        assert all(first[k] is second[k] is before[k] for k in before)      # processors are never replaced
        assert all(len(m._forward_pre_hooks) == 1 for m in model.modules() if hasattr(m, "processor"))
        out = run(model, inputs)
        assert cos(out, ref) >= MIN_COS
        assert all(st["calls"] == 1 for st in sage_patch.report(model).to_dict().values())
        model.enable_sage_attention("full")                          # re-enabling changes the policy in place
        assert (run(model, inputs) - ref).abs().max().item() <= FULL_TOL
    finally:
        model.disable_sage_attention()
        model.disable_sage_attention()                               # disabling twice too
    after = processors(model)
    assert all(after[k] is before[k] for k in before)


# ---- model-specific ----------------------------------------------------------------------------------------

def test_sd35_medium_attn2_shares_one_processor_but_routes_per_layer():
    model, inputs = tiny_sd3((0, 1))
    before = processors(model)
    assert before["transformer_blocks.0.attn.processor"] is before["transformer_blocks.0.attn2.processor"]
    policy = {"default": "8b", "layers": [{"match": "*.attn2", "precision": "full"}]}
    model.enable_sage_attention(policy)
    try:
        now = processors(model)
        assert now["transformer_blocks.0.attn.processor"] is now["transformer_blocks.0.attn2.processor"] \
            is before["transformer_blocks.0.attn.processor"]
        assert bindings_of(model)["transformer_blocks.0.attn"] is not bindings_of(model)["transformer_blocks.0.attn2"]
        run(model, inputs)
        rep = sage_patch.report(model).to_dict()
        assert rep["transformer_blocks.0.attn2"]["used"] == {"full": 1}
        assert rep["transformer_blocks.1.attn2"]["used"] == {"full": 1}
        assert rep["transformer_blocks.0.attn"]["used"] == {"8b": 1}
        assert rep["transformer_blocks.2.attn"]["used"] == {"8b": 1}
    finally:
        model.disable_sage_attention()
    after = processors(model)
    assert after["transformer_blocks.0.attn.processor"] is after["transformer_blocks.0.attn2.processor"] \
        is before["transformer_blocks.0.attn.processor"]


def test_hunyuan_refiner_routed_and_text_mask_is_key_padding(mask_kinds):
    model, inputs = tiny_hunyuan()
    ref = run(model, inputs)
    model.enable_sage_attention("8b")
    try:
        out = run(model, inputs)
        assert cos(out, ref) >= MIN_COS
        rep = sage_patch.report(model).to_dict()
        assert "context_embedder.token_refiner.refiner_blocks.0.attn" in rep
        assert rep["context_embedder.token_refiner.refiner_blocks.0.attn"]["used"] == {"8b": 1}
        # 4 main blocks get the (B, 1, 1, N) text mask: key padding, kernel-servable, never densified;
        # the refiner's (B, 1, S, S) self-attention mask is dense.
        assert mask_kinds.count("key_padding") == 4 and mask_kinds.count("dense") == 1, mask_kinds
        for layer, st in rep.items():
            assert not [r for r in st["fallbacks"] if not r.startswith("reference simulation")], (layer, st)
    finally:
        model.disable_sage_attention()
    # the shipped policy keeps the refiner full
    model.enable_sage_attention()
    try:
        bindings = bindings_of(model)
        assert bindings["context_embedder.token_refiner.refiner_blocks.0.attn"].requested() == "full"
        assert bindings["transformer_blocks.0.attn"].requested() == "8b"
    finally:
        model.disable_sage_attention()


def test_generic_sdpa_processor_and_unroutable_processor():
    from diffusers import UNet2DConditionModel
    from diffusers.models.attention_processor import AttnProcessor

    torch.manual_seed(0)
    unet = UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
                                block_out_channels=(16, 32), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=16,
                                attention_head_dim=8, norm_num_groups=8).eval()
    inputs = dict(sample=torch.randn(1, 4, 8, 8), timestep=torch.tensor([10]),
                  encoder_hidden_states=torch.randn(1, 7, 16), return_dict=False)
    ref = run(unet, inputs)
    n = len(unet.attn_processors)
    unet.enable_sage_attention("8b")
    try:
        # the policy passed by name is the one in force: 8b everywhere, no layer rules, no fallback
        pol = getattr(unet, sd._STATE_ATTR).policy
        assert pol.default == "8b" and pol.layers == () and pol.min_seq_len == 0 and pol.name is None
        assert len(bindings_of(unet)) == n and all(b.policy is pol for b in bindings_of(unet).values())
        out = run(unet, inputs)
        assert cos(out, ref) >= MIN_COS
        rep = sage_patch.report(unet).to_dict()
        assert len(rep) == n and all(st["used"] == {"8b": 1} for st in rep.values())
    finally:
        unet.disable_sage_attention()
    # a processor that computes attention itself (baddbmm) is left alone and reported as skipped
    unet.set_attn_processor(AttnProcessor())
    unet.enable_sage_attention("8b")
    try:
        assert len(sd.sage_skipped(unet)) == n
        assert len(sage_patch.report(unet)) == 0
        assert (run(unet, inputs) - ref).abs().max().item() < 1e-5
    finally:
        unet.disable_sage_attention()
    # default policy for an unknown class: flux-like 8b with min_seq_len 128
    assert sd.default_policy_for(unet).default == "8b" and sd.default_policy_for(unet).min_seq_len == 128


def test_set_attention_backend_still_applies_to_full_layers(monkeypatch):
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    model, inputs = tiny_flux()
    ref = run(model, inputs)
    backend = AttentionBackendName("_native_math")
    orig_fn = _AttentionBackendRegistry._backends[backend]
    calls = []

    def counting(*a, **k):
        calls.append(1)
        return orig_fn(*a, **k)

    monkeypatch.setitem(_AttentionBackendRegistry._backends, backend, counting)
    model.enable_sage_attention({"default": "8b", "layers": [{"match": "single_transformer_blocks.*",
                                                               "precision": "full"}]})
    try:
        model.set_attention_backend("_native_math")    # after enabling: reaches the original processors
        assert all(p._attention_backend == backend for p in processors(model).values())
        out = run(model, inputs)
        assert len(calls) == 2                            # the two single blocks (full) used the user's backend
        assert cos(out, ref) >= MIN_COS
        rep = sage_patch.report(model).to_dict()
        assert rep["single_transformer_blocks.0.attn"]["used"] == {"full": 1}
        assert rep["transformer_blocks.0.attn"]["used"] == {"8b": 1}
    finally:
        model.disable_sage_attention()
        model.reset_attention_backend()
        _AttentionBackendRegistry.set_active_backend(AttentionBackendName.NATIVE)


def test_torch_compile_of_the_transformer():
    import torch._dynamo

    model, inputs = tiny_flux()
    ref = run(model, inputs)
    model.enable_sage_attention({"default": "8b", "steps": [{"first": 1, "precision": "full"}]})
    try:
        sd.set_step(model, 1, 4)
        eager = run(model, inputs)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        out = run(compiled, inputs)
        assert (out - eager).abs().max().item() <= 1e-5
        rep = sage_patch.report(model).to_dict()
        assert all(st["used"] == {"8b": 2} for st in rep.values()), rep   # counted when the op runs
        sage_patch.reset_report(model)
        assert all(st["calls"] == 0 for st in sage_patch.report(model).to_dict().values())
        sd.set_step(model, 0, 4)                            # step rule -> full: one recompile, original path
        assert (run(compiled, inputs) - ref).abs().max().item() <= FULL_TOL
        run(compiled, inputs)
        # the counting rule of sage_patch.report, as for transformers: a full call is traced with the model,
        # counted once, when traced
        rep = sage_patch.report(model).to_dict()
        assert all(st["used"] == {"full": 1} for st in rep.values()), rep
        sd.set_step(model, 2, 4)
        assert (run(compiled, inputs) - eager).abs().max().item() <= 1e-5
    finally:
        model.disable_sage_attention()
        torch._dynamo.reset()


def test_lora_loading_keeps_routing():
    pytest.importorskip("peft")
    model, inputs = tiny_flux()
    ref = run(model, inputs)
    model.enable_sage_attention("8b")
    try:
        g = torch.Generator().manual_seed(3)
        lora = {}
        for blk in ("transformer_blocks.0.attn", "single_transformer_blocks.1.attn"):
            for proj in ("to_q", "to_v"):
                lora[f"transformer.{blk}.{proj}.lora_A.weight"] = torch.randn(4, 32, generator=g) * 0.3
                lora[f"transformer.{blk}.{proj}.lora_B.weight"] = torch.randn(32, 4, generator=g) * 0.3
        model.load_lora_adapter(lora, adapter_name="tiny")
        assert len(bindings_of(model)) == 4
        out = run(model, inputs)
        assert cos(out, ref) < 0.9999                      # the adapter changed the output...
        assert all(st["used"] == {"8b": 1} for st in sage_patch.report(model).to_dict().values())  # ...routed
    finally:
        model.disable_sage_attention()


# ---- pipelines ---------------------------------------------------------------------------------------------

def tiny_flux_pipe():
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline

    transformer, _ = tiny_flux()
    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
                        latent_channels=4, norm_num_groups=4, sample_size=32, shift_factor=0.0,
                        scaling_factor=1.0).eval()
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None,
                        text_encoder_2=None, tokenizer_2=None, transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def pipe_call(pipe, steps=4, **kw):
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(1, 13, 32, generator=g)
    pooled = torch.randn(1, 32, generator=g)
    return pipe(prompt_embeds=emb, pooled_prompt_embeds=pooled, height=32, width=64, num_inference_steps=steps,
                guidance_scale=3.5, generator=torch.Generator().manual_seed(1), output_type="pt", **kw).images


@pytest.fixture(scope="module")
def flux_pipe():
    pipe = tiny_flux_pipe()
    return pipe, pipe_call(pipe)


def test_pipeline_full_equals_original_vae_untouched(flux_pipe):
    pipe, ref = flux_pipe
    before = processors(pipe.transformer)
    vae_before = processors(pipe.vae)
    sched_before = dict(pipe.scheduler.__dict__)
    pipe.enable_sage_attention("full")
    try:
        assert (pipe_call(pipe) - ref).abs().max().item() <= FULL_TOL
        rep = sage_patch.report(pipe).to_dict()
        assert len(rep) == 4 and all(k.startswith("transformer.") for k in rep)     # no VAE attention
        assert all(st["calls"] == 4 for st in rep.values())                          # 4 steps, 1 forward each
        assert sage_patch.report(pipe.transformer).to_dict().keys() == {k[len("transformer."):] for k in rep}
        assert all(p is vae_before[k] for k, p in processors(pipe.vae).items())
    finally:
        pipe.disable_sage_attention()
    assert all(p is before[k] for k, p in processors(pipe.transformer).items())
    assert set(pipe.scheduler.__dict__) == set(sched_before)                        # scheduler hooks removed
    assert len(sage_patch.report(pipe)) == 0
    assert (pipe_call(pipe) - ref).abs().max().item() == 0


def test_pipeline_8b_and_default_policy(flux_pipe):
    pipe, ref = flux_pipe
    pipe.enable_sage_attention()
    try:
        assert getattr(pipe.transformer, sd._STATE_ATTR).policy.name == "flux"
    finally:
        pipe.disable_sage_attention()
    sage_patch.set_policy(pipe, "8b")           # the package-level entry point reaches the same method
    try:
        out = pipe_call(pipe)
        assert cos(out, ref) >= MIN_COS
        rep = sage_patch.report(pipe).to_dict()
        assert all(st["used"] == {"8b": 4} for st in rep.values()), rep
    finally:
        pipe.disable_sage_attention()


STEP_POLICY = {"default": "8b", "layers": [{"match": "single_transformer_blocks.1.*", "precision": "full"}],
               "steps": [{"first": 1, "precision": "full"}, {"last": 2, "precision": "full"}]}
EXPECTED = {0: "full", 1: "8b", 2: "8b", 3: "full", 4: "full"}  # 5 steps


def _per_step_precisions(model, steps_seen):
    """A forward hook (observation only) that records, per transformer forward, the precision each layer used."""
    last = {}

    def hook(_m, _a, _o):
        rep = sage_patch.report(model).to_dict()
        now = {}
        for layer, st in rep.items():
            prev = last.get(layer, {})
            diff = [p for p, n in st["used"].items() if n > prev.get(p, 0)]
            now[layer] = diff[0] if len(diff) == 1 else diff
            last[layer] = dict(st["used"])
        steps_seen.append(now)

    return model.register_forward_hook(hook)


def test_pipeline_step_rules_switch_at_the_right_steps(flux_pipe):
    pipe, ref = flux_pipe
    pipe.enable_sage_attention(STEP_POLICY)
    seen = []
    h = _per_step_precisions(pipe.transformer, seen)
    try:
        pipe_call(pipe, steps=5)
        assert len(seen) == 5
        for step, layers in enumerate(seen):
            for layer, used in layers.items():
                want = "full" if layer.startswith("single_transformer_blocks.1.") else EXPECTED[step]
                assert used == want, (step, layer, used)
        tracker = sd._tracker_of(pipe)
        assert tracker.state.step is None              # cleared after the call
        # a second call starts again from step 0
        seen.clear()
        pipe_call(pipe, steps=5)
        assert [layers["transformer_blocks.0.attn"] for layers in seen] == [EXPECTED[i] for i in range(5)]
    finally:
        h.remove()
        pipe.disable_sage_attention()


def test_step_tracking_without_callbacks_and_swapped_scheduler(flux_pipe):
    """A pipeline whose loop has no callbacks at all, and a scheduler swapped after enabling."""
    from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler

    class LoopPipeline(DiffusionPipeline):
        def __init__(self, transformer, scheduler):
            super().__init__()
            self.register_modules(transformer=transformer, scheduler=scheduler)

        @torch.no_grad()
        def __call__(self, latents, enc, pooled, num_inference_steps=5):
            self.scheduler.set_timesteps(num_inference_steps)
            img_ids = torch.zeros(latents.shape[1], 3)
            txt_ids = torch.zeros(enc.shape[1], 3)
            for t in self.scheduler.timesteps:
                v = self.transformer(hidden_states=latents, encoder_hidden_states=enc, pooled_projections=pooled,
                                     timestep=(t / 1000).expand(latents.shape[0]),
                                     guidance=torch.full((latents.shape[0],), 3.5),
                                     img_ids=img_ids, txt_ids=txt_ids, return_dict=False)[0]
                latents = self.scheduler.step(v, t, latents, return_dict=False)[0]
            return latents

    pipe, _ = flux_pipe
    loop = LoopPipeline(pipe.transformer, FlowMatchEulerDiscreteScheduler())
    loop.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(1, 64, 16, generator=g), torch.randn(1, 13, 32, generator=g), torch.randn(1, 32, generator=g))
    loop.enable_sage_attention(STEP_POLICY)
    loop.scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)    # swapped after enabling
    seen = []
    h = _per_step_precisions(loop.transformer, seen)
    try:
        loop(*args)
        assert [layers["transformer_blocks.1.attn"] for layers in seen] == [EXPECTED[i] for i in range(5)]
        assert all(layers["single_transformer_blocks.1.attn"] == "full" for layers in seen)
    finally:
        h.remove()
        loop.disable_sage_attention()
    assert "step" not in loop.scheduler.__dict__
    assert not bindings_of(pipe.transformer) and not sd.is_enabled(pipe.transformer)


def test_pipeline_enable_twice_and_cpu_offload(flux_pipe):
    pipe, ref = flux_pipe
    before = processors(pipe.transformer)
    pipe.enable_sage_attention("8b")
    pipe.enable_sage_attention("8b")
    try:
        assert all(p is before[k] for k, p in processors(pipe.transformer).items())
        out = pipe_call(pipe)
        assert cos(out, ref) >= MIN_COS
        assert all(st["calls"] == 4 for st in sage_patch.report(pipe).to_dict().values())
    finally:
        pipe.disable_sage_attention()
    assert all(p is before[k] for k, p in processors(pipe.transformer).items())


def test_enable_model_cpu_offload_keeps_routing():
    pytest.importorskip("accelerate")
    pipe = tiny_flux_pipe()
    ref = pipe_call(pipe)
    pipe.enable_sage_attention("8b")
    try:
        pipe.enable_model_cpu_offload(device="cpu")
        out = pipe_call(pipe)
        assert cos(out, ref) >= MIN_COS
        assert all(st["used"] == {"8b": 4} for st in sage_patch.report(pipe).to_dict().values())
    finally:
        pipe.disable_sage_attention()


def test_true_cfg_two_forwards_per_step_count_as_one_step(flux_pipe):
    pipe, _ = flux_pipe
    pipe.enable_sage_attention(STEP_POLICY)
    seen = []
    h = _per_step_precisions(pipe.transformer, seen)
    g = torch.Generator().manual_seed(0)
    emb, pooled = torch.randn(1, 13, 32, generator=g), torch.randn(1, 32, generator=g)
    try:
        pipe(prompt_embeds=emb, pooled_prompt_embeds=pooled, negative_prompt_embeds=emb * 0,
             negative_pooled_prompt_embeds=pooled * 0, true_cfg_scale=2.0, height=32, width=64,
             num_inference_steps=5, output_type="latent")
        assert [layers["transformer_blocks.0.attn"] for layers in seen] == \
            [EXPECTED[i // 2] for i in range(10)]           # cond + uncond forward at every step
    finally:
        h.remove()
        pipe.disable_sage_attention()


def test_module_processor_stays_registered(flux_pipe):
    """An nn.Module processor (IP-Adapter) keeps its weights in state_dict and under .to() while routed."""
    from diffusers.models.transformers.transformer_flux import FluxIPAdapterAttnProcessor

    model, _ = tiny_flux()
    ip = FluxIPAdapterAttnProcessor(hidden_size=32, cross_attention_dim=32, num_tokens=(4,))
    attn = model.transformer_blocks[0].attn
    attn.set_processor(ip)
    keys = set(model.state_dict())
    assert any(".processor." in k for k in keys)
    model.enable_sage_attention("8b")
    try:
        assert attn.processor is ip and "transformer_blocks.0.attn" in bindings_of(model)
        assert set(model.state_dict()) == keys and attn._modules["processor"] is ip
    finally:
        model.disable_sage_attention()
    assert attn.processor is ip and "processor" not in attn.__dict__


# ---- IP-Adapter: diffusers rebuilds processors with proc.__class__() and checks isinstance -------------------

def _flux_ip_state_dict(model, seed=0):
    """IP-Adapter weights in the layout `_load_ip_adapter_weights` reads, from freshly initialised modules."""
    from diffusers.models.embeddings import ImageProjection
    from diffusers.models.transformers.transformer_flux import FluxIPAdapterAttnProcessor

    torch.manual_seed(seed)
    cfg = model.config
    ip = {}
    dual = [n for n in model.attn_processors if not n.startswith("single_transformer_blocks")]
    for i, _ in enumerate(dual):
        w = FluxIPAdapterAttnProcessor(hidden_size=cfg.num_attention_heads * cfg.attention_head_dim,
                                       cross_attention_dim=cfg.joint_attention_dim, scale=1.0).state_dict()
        for part in ("to_k_ip", "to_v_ip"):
            for t in ("weight", "bias"):
                ip[f"{i}.{part}.{t}"] = w[f"{part}.0.{t}"] * 20  # large enough that the adapter visibly matters
    proj = ImageProjection(cross_attention_dim=cfg.joint_attention_dim, image_embed_dim=cfg.pooled_projection_dim,
                           num_image_text_embeds=4).state_dict()
    image_proj = {"proj.weight": proj["image_embeds.weight"], "proj.bias": proj["image_embeds.bias"],
                  "norm.weight": proj["norm.weight"], "norm.bias": proj["norm.bias"]}
    return {"image_proj": image_proj, "ip_adapter": ip}


def _with_ip(inputs, model):
    g = torch.Generator().manual_seed(5)
    embeds = torch.randn(2, 1, model.config.pooled_projection_dim, generator=g)
    return dict(inputs, joint_attention_kwargs={"ip_adapter_image_embeds": [embeds]})


def _unload_ip_adapter(model):
    """FluxIPAdapterMixin.unload_ip_adapter on a pipeline holding `model` (it only needs .transformer)."""
    from diffusers.loaders.ip_adapter import FluxIPAdapterMixin

    class _Holder:
        transformer = model
    FluxIPAdapterMixin.unload_ip_adapter(_Holder())


def test_processors_are_untouched_while_enabled_and_build_plain_processors():
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    model, _ = tiny_flux()
    before = processors(model)
    model.enable_sage_attention({"default": "full"})
    try:
        p = model.attn_processors["single_transformer_blocks.0.attn.processor"]
        assert type(p) is FluxAttnProcessor and p is before["single_transformer_blocks.0.attn.processor"]
        fresh = type(p)()                      # what diffusers' loaders do (a TypeError under a proxy processor)
        assert type(fresh) is FluxAttnProcessor
        assert type(p.__class__()) is FluxAttnProcessor
        import copy
        assert type(copy.copy(p)) is FluxAttnProcessor and type(copy.deepcopy(p)) is FluxAttnProcessor
    finally:
        model.disable_sage_attention()


def test_ip_adapter_load_and_unload_while_enabled_match_no_sage():
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor, FluxIPAdapterAttnProcessor

    model, inputs = tiny_flux()
    twin, _ = tiny_flux()                                   # same weights, never enabled
    state = _flux_ip_state_dict(model)
    base = run(model, inputs)
    model.enable_sage_attention({"default": "full"})
    try:
        model._load_ip_adapter_weights([state], low_cpu_mem_usage=False)
        twin._load_ip_adapter_weights([_flux_ip_state_dict(twin)], low_cpu_mem_usage=False)
        procs = processors(model)
        assert set(bindings_of(model)) == {n.removesuffix(".processor") for n in procs}   # every layer still routed
        dual = [n for n in procs if not n.startswith("single_")]
        assert dual and all(isinstance(procs[n], FluxIPAdapterAttnProcessor) for n in dual)
        assert all(type(procs[n]) is FluxAttnProcessor for n in procs if n.startswith("single_"))
        # the adapter's weights stay registered where diffusers put them
        assert any(k.startswith("transformer_blocks.0.attn.processor.to_k_ip") for k in model.state_dict())
        calls = {k: v["calls"] for k, v in sage_patch.report(model).to_dict().items()}
        out = run(model, _with_ip(inputs, model))
        ref = run(twin, _with_ip(inputs, twin))
        assert (out - ref).abs().max().item() <= FULL_TOL
        assert (out - base).abs().max().item() > 1e-3                            # the adapter is in effect
        rep = sage_patch.report(model).to_dict()
        # one report entry per layer; the adapter's image attention is routed too (a second call in dual blocks)
        assert len(rep) == 4
        assert all(rep[k]["calls"] == calls[k] + (1 if k.startswith("single_") else 2) for k in rep)
        _unload_ip_adapter(model)
        procs = processors(model)
        assert all(type(p) is FluxAttnProcessor for p in procs.values()) and len(bindings_of(model)) == len(procs)
        assert not any(".processor." in k for k in model.state_dict())
        assert (run(model, inputs) - base).abs().max().item() <= FULL_TOL
    finally:
        model.disable_sage_attention()
    assert all(type(p) is FluxAttnProcessor for p in processors(model).values())
    assert not any("set_processor" in m.__dict__ for m in model.modules())


def test_ip_adapter_loaded_before_enabling_unloads_and_disable_keeps_latest():
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor, FluxIPAdapterAttnProcessor

    model, inputs = tiny_flux()
    base = run(model, inputs)
    model._load_ip_adapter_weights([_flux_ip_state_dict(model)], low_cpu_mem_usage=False)
    ip_procs = {k: p for k, p in processors(model).items() if isinstance(p, FluxIPAdapterAttnProcessor)}
    with_ip = run(model, _with_ip(inputs, model))
    model.enable_sage_attention({"default": "full"})
    try:
        assert all(processors(model)[k] is p for k, p in ip_procs.items())
        assert (run(model, _with_ip(inputs, model)) - with_ip).abs().max().item() <= FULL_TOL
        _unload_ip_adapter(model)           # isinstance(wrapper, FluxIPAdapterAttnProcessor) must hold here
        procs = processors(model)
        assert all(type(p) is FluxAttnProcessor for p in procs.values()) and len(bindings_of(model)) == len(procs)
        assert (run(model, inputs) - base).abs().max().item() <= FULL_TOL
        assert all(st["calls"] >= 2 for st in sage_patch.report(model).to_dict().values())
    finally:
        model.disable_sage_attention()
    # disabling keeps what diffusers set last (the plain processors from unloading), unwrapped
    assert all(type(p) is FluxAttnProcessor for p in processors(model).values())
    # and loading again after disabling works as without sage
    model._load_ip_adapter_weights([_flux_ip_state_dict(model)], low_cpu_mem_usage=False)
    assert sum(isinstance(p, FluxIPAdapterAttnProcessor) for p in processors(model).values()) == len(ip_procs)


# ---- Ideogram 4: one dense segment mask per forward ---------------------------------------------------------------

def tiny_ideogram4(segments, b=2, text=8, image=24):
    """A tiny Ideogram4Transformer2DModel (head dim 64) and its inputs; `segments` per token of each sample."""
    mod = pytest.importorskip("diffusers.models.transformers.transformer_ideogram4")
    torch.manual_seed(0)
    model = mod.Ideogram4Transformer2DModel(in_channels=16, num_layers=2, attention_head_dim=64, num_attention_heads=2,
                                            intermediate_size=128, adaln_dim=32, llm_features_dim=48,
                                            mrope_section=(12, 10, 10)).eval()
    n = text + image
    indicator = torch.tensor([mod.LLM_TOKEN_INDICATOR] * text + [mod.OUTPUT_IMAGE_INDICATOR] * image).expand(b, n)
    pos = torch.zeros(b, n, 3, dtype=torch.long)
    pos[:, :, 0] = torch.arange(n)
    inputs = dict(hidden_states=torch.randn(b, n, 16), timestep=torch.rand(b), encoder_hidden_states=torch.randn(b, n, 48),
                  position_ids=pos, segment_ids=torch.as_tensor(segments).expand(b, n).clone(), indicator=indicator)
    return model, inputs


@pytest.mark.parametrize("packed", [False, True])
def test_ideogram4_segment_mask_of_one_sample_runs_without_a_mask(mask_kinds, packed):
    """Ideogram 4 hands every block a (B, 1, L, L) bool mask built from segment ids. One sample per row (one segment)
    sees every key: the layers get no mask (the kernels' path on a GPU); a packed row (two segments) is a real dense
    mask and stays one. The outputs match the model without sage_patch either way."""
    segments = [0] * 16 + [1] * 16 if packed else [0] * 32
    model, inputs = tiny_ideogram4(segments)
    with torch.no_grad():
        ref = model(**inputs).sample
        model.enable_sage_attention("8b")
        try:
            out = model(**inputs).sample
        finally:
            model.disable_sage_attention()
    assert cos(out, ref) >= MIN_COS
    assert mask_kinds == (["dense"] * 2 if packed else ["none"] * 2), mask_kinds

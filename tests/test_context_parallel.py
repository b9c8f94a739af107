"""Sage attention inside diffusers' context parallelism (Ulysses, ring, both), on CPU: 2 and 4 gloo processes
(tests/cp_harness.py). Each rank builds the same tiny model (same seed), computes the single-process reference itself
and then the context-parallel output; the quantized precision runs the reference simulation, so "8b" under context
parallelism is compared with single-process "8b" at the simulation's own error (the quantization groups follow each
rank's token layout), and "full" within fp32 rounding.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")
import torch.distributed as dist  # noqa: E402

import cp_harness  # noqa: E402
from test_diffusers_integration import tiny_hunyuan  # noqa: E402  (text padding differs per sample)

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is needed", allow_module_level=True)


# ---- tiny models (integration-facts.md; text lengths divisible by 2 and 4, as diffusers' sharder requires) ------

def tiny_flux(heads=2, text=16):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    m = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
                               num_attention_heads=heads, joint_attention_dim=32, pooled_projection_dim=32,
                               guidance_embeds=True, axes_dims_rope=(4, 6, 6)).eval()
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(2, 64, 16, generator=g),
                  encoder_hidden_states=torch.randn(2, text, 32, generator=g),
                  pooled_projections=torch.randn(2, 32, generator=g), timestep=torch.tensor([0.5, 0.7]),
                  guidance=torch.tensor([3.5, 3.5]), img_ids=torch.randn(64, 3, generator=g),
                  txt_ids=torch.zeros(text, 3), return_dict=False)
    return m, inputs


def tiny_sd3():
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    m = SD3Transformer2DModel(sample_size=32, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
                              num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=32,
                              pooled_projection_dim=64, out_channels=4, pos_embed_max_size=96).eval()
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(2, 4, 16, 16, generator=g),
                  encoder_hidden_states=torch.randn(2, 16, 32, generator=g),
                  pooled_projections=torch.randn(2, 64, generator=g), timestep=torch.tensor([500, 700]),
                  return_dict=False)
    return m, inputs


def _run(model, inputs):
    with torch.no_grad():
        return model(**inputs)[0]


def rel_l1(a, b):
    return ((a - b).abs().sum() / b.abs().sum()).item()


def _references(builder):
    """Single-process outputs of a fresh model: (full, 8b)."""
    m, inputs = builder()
    full = _run(m, inputs)
    m.enable_sage_attention("8b")
    q8 = _run(m, inputs)
    m.disable_sage_attention()
    return inputs, full, q8


def _check_report(model, n_layers, precision, note):
    import sage_patch

    rep = sage_patch.report(model).to_dict()
    assert len(rep) == n_layers, rep
    for name, st in rep.items():
        # every call was counted once on this rank, ran our attention at `precision`, under context parallelism
        assert st["calls"] == 1, (name, st)
        assert st["used"] == {precision: 1}, (name, st)
        assert st.get("context") == {note: 1}, (name, st)
        if precision != "full":
            assert st["impl"] == {"reference": 1}, (name, st)   # our simulation, not diffusers' backend
    assert "context parallelism: the counts are the calls this rank ran" in str(sage_patch.report(model))


def _assert_cp_matches(out, full, q8, precision):
    if precision == "full":
        torch.testing.assert_close(out, full, rtol=1e-5, atol=2e-5)
    else:
        # the simulation's own error: CP 8b is as far from full as single-process 8b is, and not full itself
        err, ref_err = rel_l1(out, full), rel_l1(q8, full)
        assert 0 < err <= 1.5 * ref_err, (err, ref_err)
        assert rel_l1(out, q8) <= 1.5 * ref_err


# ---- Flux: Ulysses-2 and ring-2 (either order), the LSE merge contract -----------------------------------------

def _flux_two(rank, world):
    import sage_patch  # noqa: F401  (installs enable_sage_attention)
    from sage_patch.integrations.diffusers_parallel import describe

    inputs, full, q8 = _references(tiny_flux)
    for mode, sage_first in (({"ulysses_degree": 2}, True), ({"ring_degree": 2}, False)):
        m, _ = tiny_flux()
        if sage_first:
            m.enable_sage_attention("8b")
            cp_harness.enable_parallelism(m, **mode)
        else:
            cp_harness.enable_parallelism(m, **mode)
            m.enable_sage_attention("8b")
        note = describe(m._parallel_config.context_parallel_config)
        assert f"on rank {rank} of 2" in note
        out = _run(m, inputs)
        _assert_cp_matches(out, full, q8, "8b")
        _check_report(m, 4, "8b", note)
        m.enable_sage_attention("full")   # enabling again updates the policy; stats continue
        for st in sage_patch.report(m).layers.values():
            st.reset()
        _assert_cp_matches(_run(m, inputs), full, q8, "full")
        rep = sage_patch.report(m).to_dict()
        # full layers: diffusers' own backend under Ulysses; under ring (diffusers' native backend has no LSE) our
        # full precision, torch SDPA with its LSE, on diffusers' ring; counted with the context note
        impl = "diffusers-dispatch" if sage_first else "sdpa"
        assert all(st["impl"] == {impl: 1} and st["context"] == {note: 1} for st in rep.values()), rep
    _lse_merge_contract(m._parallel_config, rank)

    # torch.compile (fullgraph): diffusers' ring template traced, our attention one opaque op with its LSE
    m, _ = tiny_flux()
    cp_harness.enable_parallelism(m, ring_degree=2)
    m.enable_sage_attention("8b")
    _assert_cp_matches(_run(torch.compile(m, fullgraph=True, backend="aot_eager"), inputs), full, q8, "8b")
    _check_report(m, 4, "8b", describe(m._parallel_config.context_parallel_config))


def _lse_merge_contract(pc, rank):
    """Our forward op on this rank's K/V chunks, merged by diffusers' TemplatedRingAttention (LSE), equals our op on
    the whole sequence (full precision: fp32 rounding), with and without a key-padding mask."""
    from diffusers.models.attention_dispatch import TemplatedRingAttention

    from sage_patch.integrations.diffusers_parallel import _backward_op, _forward_op
    from sage_patch.policy import Policy
    from sage_patch.binding import LayerBinding

    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 24, 3, 16, generator=g) for _ in range(3))            # (B, S, H, D), whole sequence
    mask = torch.ones(2, 1, 1, 24, dtype=torch.bool)
    mask[0, ..., 20:] = False                                                        # rank 1's chunk partly masked
    mask[1, ..., 5:12] = False                                                       # both chunks partly masked
    layer = LayerBinding("contract", None, Policy.from_any("full"))
    sl = slice(12 * rank, 12 * (rank + 1))
    for m in (None, mask):
        whole, whole_lse = layer.attention(q, k, v, layout="bshd", attn_mask=m, return_lse=True)
        out, lse = TemplatedRingAttention.apply(q[:, sl], k[:, sl], v[:, sl], None if m is None else m[..., sl],
                                                0.0, False, None, False, True,
                                                lambda *a, **kw: _forward_op(*a, **kw, layer=layer, context="t"),
                                                _backward_op, pc)
        torch.testing.assert_close(out, whole[:, sl], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse, whole_lse.transpose(1, 2)[:, sl], rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="has no backward"):
        _backward_op(None, q)


def test_flux_ulysses2_and_ring2_either_order_lse_merge_and_compile():
    cp_harness.spawn(_flux_two, 2)


# ---- Flux: Ulysses-2 x ring-2 on 4 processes ------------------------------------------------------------------

def _flux_unified(rank, world):
    import sage_patch  # noqa: F401
    from sage_patch.integrations.diffusers_parallel import describe

    inputs, full, q8 = _references(tiny_flux)
    m, _ = tiny_flux()
    cp_harness.enable_parallelism(m, ulysses_degree=2, ring_degree=2)
    m.enable_sage_attention("8b")
    _assert_cp_matches(_run(m, inputs), full, q8, "8b")
    _check_report(m, 4, "8b", describe(m._parallel_config.context_parallel_config))


def test_flux_ulysses2_x_ring2_four_processes():
    cp_harness.spawn(_flux_unified, 4)


# ---- per-layer and per-step policies, per rank ------------------------------------------------------------------

MIXED = {"default": "8b", "layers": [{"match": "transformer_blocks.0.*", "precision": "full"}],
         "steps": [{"first": 1, "precision": "full"}]}


def _mixed_policy(rank, world):
    import sage_patch
    from sage_patch.integrations.diffusers import set_step

    m, inputs = tiny_flux()
    m.enable_sage_attention(MIXED)
    single = {}
    for step in (0, 1):
        set_step(m, step, 4)
        single[step] = _run(m, inputs)
    m.disable_sage_attention()
    full = _run(m, inputs)
    err = rel_l1(single[1], full)
    assert err > 0                                      # step 1 mixes full and 8b layers
    for mode in ({"ulysses_degree": 2}, {"ring_degree": 2}):
        m, _ = tiny_flux()
        cp_harness.enable_parallelism(m, **mode)
        m.enable_sage_attention(MIXED)
        set_step(m, 0, 4)                               # a step rule: every layer full on every rank
        torch.testing.assert_close(_run(m, inputs), full, rtol=1e-5, atol=2e-5)
        rep = sage_patch.report(m).to_dict()
        assert all(st["used"] == {"full": 1} for st in rep.values()), rep
        for st in sage_patch.report(m).layers.values():
            st.reset()
        set_step(m, 1, 4)                               # layer rules: block 0 full, the others 8b, on each rank
        out = _run(m, inputs)
        assert rel_l1(out, single[1]) <= 1.5 * err and rel_l1(out, full) <= 1.5 * err
        rep = sage_patch.report(m).to_dict()
        assert rep["transformer_blocks.0.attn"]["used"] == {"full": 1}, rep
        assert all(st["used"] == {"8b": 1} for name, st in rep.items() if not name.startswith("transformer_blocks.0.")), rep


def test_layer_and_step_policies_apply_on_every_rank():
    cp_harness.spawn(_mixed_policy, 2)


# ---- HunyuanVideo: the shipped plan, text key-padding mask, token refiner ---------------------------------------

def _hunyuan(rank, world):
    import sage_patch  # noqa: F401
    from sage_patch.integrations import cp_plans
    from sage_patch.integrations.diffusers_parallel import describe

    inputs, full, q8 = _references(tiny_hunyuan)
    for mode in ({"ulysses_degree": 2}, {"ring_degree": 2}):
        m, _ = tiny_hunyuan()
        m.enable_sage_attention("8b")
        with cp_harness.cpu_accelerator():
            from diffusers import ContextParallelConfig

            cp_plans.enable_parallelism(m, ContextParallelConfig(**mode))
        _assert_cp_matches(_run(m, inputs), full, q8, "8b")
        rep = sage_patch.report(m).to_dict()
        note = describe(m._parallel_config.context_parallel_config)
        main = {k: v for k, v in rep.items() if not k.startswith("context_embedder.")}
        refiner = {k: v for k, v in rep.items() if k.startswith("context_embedder.")}
        assert len(main) == 4 and len(refiner) == 1
        assert all(st["context"] == {note: 1} and st["used"] == {"8b": 1} for st in main.values()), main
        # the refiner runs on the whole text on every rank: plain routed calls, no context note
        assert all("context" not in st and st["used"] == {"8b": 1} for st in refiner.values()), refiner
        m.enable_sage_attention("full")   # full layers: diffusers' engine (Ulysses), ours with the chunk masks (ring)
        _assert_cp_matches(_run(m, inputs), full, q8, "full")


def test_hunyuan_video_plan_with_text_padding_ulysses2_and_ring2():
    cp_harness.spawn(_hunyuan, 2)


# ---- what is refused, clearly, before any collective could hang -------------------------------------------------

def _errors(rank, world):
    import sage_patch  # noqa: F401
    from diffusers import ContextParallelConfig
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    # SD3 (and CogVideoX, same processors kind) call torch's SDPA on the shard: refused, naming the class, either order
    plan = {"": {"encoder_hidden_states": ContextParallelInput(split_dim=1, expected_dims=3)},
            "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3)}
    m, inputs = tiny_sd3()
    with cp_harness.cpu_accelerator():
        m.enable_parallelism(config=ContextParallelConfig(ulysses_degree=2), cp_plan=plan)
    with pytest.raises(ValueError, match="SD3Transformer2DModel is not supported under context parallelism"):
        m.enable_sage_attention("8b")
    m, inputs = tiny_sd3()
    m.enable_sage_attention("8b")
    with cp_harness.cpu_accelerator():
        m.enable_parallelism(config=ContextParallelConfig(ulysses_degree=2), cp_plan=plan)
    with pytest.raises(ValueError, match="SD3Transformer2DModel is not supported"):
        _run(m, inputs)

    # Ulysses degree that does not divide the heads: our error (diffusers would fail in a reshape)
    m, inputs = tiny_flux(heads=3)
    cp_harness.enable_parallelism(m, ulysses_degree=2)
    m.enable_sage_attention("8b")
    with pytest.raises(ValueError, match="ulysses_degree=2 must divide the number of attention heads"):
        _run(m, inputs)

    # a sequence the ranks cannot split evenly: diffusers' sharder refuses it on every rank, before any collective
    m, inputs = tiny_flux(text=13)
    cp_harness.enable_parallelism(m, ring_degree=2)
    m.enable_sage_attention("8b")
    with pytest.raises(AssertionError, match="divisible by mesh size"):
        _run(m, inputs)

    # a degree product other than the world size: torch's mesh refuses it
    m, inputs = tiny_flux()
    with pytest.raises(Exception, match="(?i)world size|mesh"):
        cp_harness.enable_parallelism(m, ulysses_degree=2, ring_degree=2)

    # a gradient: diffusers' backend runs the call (ours is forward-only), reported
    m, inputs = tiny_flux()
    cp_harness.enable_parallelism(m, ulysses_degree=2)
    m.enable_sage_attention("8b")
    m(**inputs)[0].sum().backward()
    st = sage_patch.report(m).to_dict()["transformer_blocks.0.attn"]
    assert st["used"] == {"full": 1} and st["impl"] == {"diffusers-dispatch": 1}, st
    assert any("autograd under context parallelism" in r for r in st["fallbacks"]), st


def test_refused_models_and_degrees_raise_clearly():
    cp_harness.spawn(_errors, 2)


# ---- torch.compile: the op with LSE and the context note ------------------------------------------------------

def test_lse_op_traces_under_torch_compile():
    from sage_patch.policy import Policy
    from sage_patch.binding import LayerBinding

    layer = LayerBinding("compiled", None, Policy.from_any("8b"))
    q, k, v = (torch.randn(1, 32, 2, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))

    def f(q, k, v):
        return layer.run(q, k, v, layout="bshd", is_causal=False, scale=None, attn_mask=None, dropout_p=0.0,
                         return_lse=True, context="ctx")

    out, lse = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    ref, ref_lse = layer.attention(q, k, v, layout="bshd", return_lse=True, record=False)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)
    assert lse.shape == (1, 2, 32) and lse.dtype == torch.float32
    assert layer.stats.calls == 1 and layer.stats.context == {"ctx": 1}   # counted when the op ran

"""Calibration (per-layer precision from measured error) and the runtime guard."""
import math
import warnings

import pytest
import torch

import sage_patch
from sage_patch import load_policy
from sage_patch.calibrate import calibrate
from sage_patch.cli import main
from tests.test_report_routing import TinyNet


def tiny_llama(outlier_layer=1, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, attention_bias=True)
    m = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for layer in m.model.layers:  # peakier attention than random init gives, as trained models have
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
        if outlier_layer is not None:  # a huge channel bias in Q: INT8 Q without smoothing loses the rest
            m.model.layers[outlier_layer].self_attn.q_proj.bias[::16] += 300.0
    return m


def test_outlier_layer_is_demoted_and_thresholds_hold(tmp_path):
    m = tiny_llama()
    out = tmp_path / "calibrated.yaml"
    policy, res = calibrate(m, out=out, min_cos=0.998, precisions=["8b"], progress=False, return_details=True)
    assert res.choice["model.layers.1.self_attn"] == "full"
    assert res.choice["model.layers.0.self_attn"] == "8b" and res.choice["model.layers.2.self_attn"] == "8b"
    for name, p in res.choice.items():
        s = res.errors[name].summary("8b")
        assert s["n"] >= 2 and res.errors[name].calls >= 2
        assert (p == "8b") == (s["cos_worst"] >= 0.998)
    assert policy.precision_for("model.layers.1.self_attn", 1) == "full"
    assert policy.precision_for("model.layers.0.self_attn", 0) == "8b"
    # the YAML validates and round-trips
    assert load_policy(out) == policy
    assert sage_patch.Policy.from_yaml(policy.to_yaml()) == policy


def test_rel_l1_threshold_is_respected():
    m = tiny_llama(outlier_layer=None)
    _, res = calibrate(m, min_cos=0.0, max_rel_l1=1e-6, precisions=["8b", "4b"], progress=False,
                       return_details=True)
    assert set(res.choice.values()) == {"full"}  # nothing quantized is that exact
    _, res = calibrate(m, min_cos=0.0, max_rel_l1=10.0, precisions=["8b", "4b"], progress=False,
                       return_details=True)
    assert set(res.choice.values()) == {"4b"}  # the fastest candidate wins when all qualify


def test_calibration_restores_the_model_and_writes_heatmap(tmp_path):
    m = tiny_llama()
    ids = torch.randint(0, 128, (1, 200))
    with torch.no_grad():
        before = m(input_ids=ids).logits
    png = tmp_path / "heat.png"
    sdpa = torch.nn.functional.scaled_dot_product_attention
    calibrate(m, [ids, {"input_ids": ids[:, :150]}], heatmap=png, progress=False)
    assert png.stat().st_size > 1000
    assert torch.nn.functional.scaled_dot_product_attention is sdpa
    with torch.no_grad():
        torch.testing.assert_close(m(input_ids=ids).logits, before)


def test_bad_precision_and_inputs():
    with pytest.raises(ValueError, match="precisions"):
        calibrate(tiny_llama(), precisions=["int8"], progress=False)
    with pytest.raises(ValueError, match="needs `inputs`"):
        calibrate(TinyNet(), progress=False)


def test_speedup_estimate_from_bench_numbers():
    m = tiny_llama()
    _, res = calibrate(m, min_cos=0.998, precisions=["8b"], bench={"8b": 2.0}, progress=False, return_details=True)
    # two layers at 2x, one at 1x: 3 / (0.5 + 0.5 + 1) = 1.5
    assert res.speedup == pytest.approx(1.5)
    assert "1.50x" in res.table()


def test_cli_calibrate_on_saved_model(tmp_path, capsys):
    m = tiny_llama()
    m.save_pretrained(tmp_path / "model")
    out, png = tmp_path / "p.yaml", tmp_path / "h.png"
    rc = main(["calibrate", str(tmp_path / "model"), "--out", str(out), "--tokens", "160", "--batches", "1",
               "--min-cos", "0.998", "--precisions", "8b", "--heatmap", str(png)])
    assert rc == 0
    assert "model.layers.1.self_attn" in capsys.readouterr().out
    assert load_policy(out).precision_for("model.layers.1.self_attn", 1) == "full"
    assert png.exists()


def test_calibrated_policy_keeps_the_base_fallback_rules_and_warns_nothing(tmp_path):
    m = tiny_llama()
    m.save_pretrained(tmp_path / "model")
    out = tmp_path / "p.yaml"
    args = ["calibrate", str(tmp_path / "model"), "--out", str(out), "--tokens", "160", "--batches", "1",
            "--precisions", "8b"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(args) == 0
    assert [str(w.message) for w in caught] == []  # e.g. no torch_dtype deprecation from transformers
    assert load_policy(out).min_seq_len == 128  # the llama family default's: decode steps stay full
    assert main(args + ["--base", "8b"]) == 0   # a base without fallback rules: told to drop them
    assert load_policy(out).min_seq_len == 0
    # the API: the model's family default, or the policy it is routed under, or the one given
    assert calibrate(tiny_llama(), precisions=["8b"], progress=False).min_seq_len == 128
    routed = tiny_llama()
    sage_patch.inject(routed, {"default": "8b", "fallback": {"min_seq_len": 64, "head_dims": [256]}})
    p = calibrate(routed, precisions=["8b"], progress=False)
    assert p.min_seq_len == 64 and p.full_head_dims == (256,)
    p = calibrate(routed, precisions=["8b"], progress=False, base="sd35")  # a shipped policy by name
    assert p.steps == sage_patch.Policy.from_any("sd35").steps and p.full_head_dims == ()


def test_runtime_guard_demotes_a_drifting_layer():
    torch.manual_seed(0)
    net = TinyNet().eval()
    x = torch.randn(1, 160, 32)
    policy = {"default": "8b", "fallback": {"min_seq_len": 0}, "guard": {"every": 2, "min_cos": 0.999}}
    with torch.no_grad(), sage_patch.route_sdpa(net, policy):
        for _ in range(4):
            net(x)
        rep = sage_patch.report(net).to_dict()
        assert all(not r["guard"] for r in rep.values())  # healthy layers are not demoted
        with torch.no_grad():  # layer 1 drifts: a huge Q channel whose K channel is constant (so it adds
            qkv = net.layers[1].qkv  # nothing to S) takes every INT8 Q scale, and the rest of Q is lost
            for c in (0, 16):  # channel 0 of each head; K channels start at 32
                qkv.weight[32 + c].zero_()
                qkv.bias[32 + c] = 3.0
                qkv.bias[c] += 500.0
        for _ in range(4):
            net(x)
        rep = sage_patch.report(net).to_dict()
    assert len(rep["layers.1"]["guard"]) == 1
    assert "demoted 8b -> full" in next(iter(rep["layers.1"]["guard"]))
    assert rep["layers.1"]["used"]["full"] >= 1  # calls after the demotion run full
    assert not rep["layers.0"]["guard"]
    assert "demoted 8b -> full" in str(sage_patch.report(net))


def test_set_policy_clears_runtime_guard_demotions():
    m = tiny_llama()
    m.set_attn_implementation("sage")
    sage_patch.set_policy(m, {"default": "8b", "fallback": {"min_seq_len": 0}, "guard": {"every": 1, "min_cos": 0.998}})
    ids = torch.randint(0, 128, (1, 160))
    layer = "model.layers.1.self_attn"  # the outlier layer: its sampled head is below 0.998 in 8b
    with torch.no_grad():
        m(ids)
        m(ids)
    before = sage_patch.report(m).to_dict()[layer]
    assert "demoted 8b -> full" in next(iter(before["guard"])) and before["requested"] == {"8b": 1, "full": 1}
    sage_patch.set_policy(m, "8b")
    with torch.no_grad():
        m(ids)
    after = sage_patch.report(m)
    assert after.to_dict()[layer]["requested"] == {"8b": 2, "full": 1}  # the new call runs 8b, as now requested
    assert "runtime guard demotion(s) 8b -> full cleared by a new policy" in str(after)


def test_guard_policy_validation():
    p = sage_patch.Policy.from_yaml("guard:\n  every: 10\n  min_cos: 0.99\n")
    assert p.guard_every == 10 and p.guard_min_cos == 0.99
    assert sage_patch.Policy.from_yaml(p.to_yaml()) == p
    with pytest.raises(sage_patch.PolicyError, match="guard.every"):
        sage_patch.Policy.from_yaml("guard:\n  every: 0\n")
    with pytest.raises(sage_patch.PolicyError, match="guard.min_cos"):
        sage_patch.Policy.from_yaml("guard:\n  min_cos: 2\n")


def test_calibrate_a_diffusers_pipeline_over_steps(tmp_path):
    from tests.test_diffusers_integration import tiny_flux_pipe

    pipe = tiny_flux_pipe()
    g = torch.Generator().manual_seed(0)
    call = dict(prompt_embeds=torch.randn(1, 13, 32, generator=g), pooled_prompt_embeds=torch.randn(1, 32, generator=g),
                height=32, width=64, num_inference_steps=4, output_type="pt")
    policy, res = calibrate(pipe, [call], min_cos=0.99, precisions=["8b"], max_calls=2, progress=False,
                            return_details=True, out=tmp_path / "flux.yaml")
    assert len(res.choice) == 4  # 2 joint + 2 single blocks of the tiny Flux transformer
    for name, e in res.errors.items():
        assert e.calls == 4 and e.sampled == 2  # 4 steps seen, 2 sampled (spread over the steps)
    assert load_policy(tmp_path / "flux.yaml") == policy
    assert not hasattr(pipe.transformer, "_sage_patch_state")  # enabled for calibration, then disabled


def test_speedup_from_kernel_benchmark_json(tmp_path):
    import json

    from sage_patch.calibrate import bench_speedups

    rows = [{"sage8b": 300.0, "cudnn": 600.0, "flash": 330.0}, {"sage8b": 900.0, "cudnn": 600.0},
            {"sage8b": 600.0, "flash": 400.0}]
    assert bench_speedups({"rows": rows}) == {"8b": 1.5}  # median of 0.5, 1.5, 1.5
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"rows": rows}))
    _, res = calibrate(tiny_llama(), min_cos=0.998, precisions=["8b"], bench=str(path), progress=False,
                       return_details=True)
    assert res.speedup == pytest.approx(3 / (2 / 1.5 + 1))


def test_measured_speeds_order_the_candidates_and_slow_kernels_never_win():
    m = tiny_llama(outlier_layer=None)
    # 8b measured faster than 4b: 8b is preferred although 4b is nominally faster
    _, res = calibrate(m, min_cos=0.0, precisions=["8b", "4b"], bench={"8b": 1.8, "4b": 1.2}, progress=False,
                       return_details=True)
    assert set(res.choice.values()) == {"8b"}
    # a kernel slower than full precision (the portable kernel on Hopper) is never chosen
    _, res = calibrate(m, min_cos=0.0, precisions=["8b"], bench={"8b": 0.5}, progress=False, return_details=True)
    assert set(res.choice.values()) == {"full"}


def test_guard_head_error_is_layout_independent():
    from sage_patch.guard import head_error
    from tests.conftest import structured_qkv

    q, k, v = structured_qkv(b=1, h=4, hkv=2, sq=96, d=32, seed=3)
    out = sage_patch.attention(q, k, v, precision="4b", is_causal=True)
    call = {"layout": "bhsd", "is_causal": True, "scale": None, "attn_mask": None}
    a = head_error(q, k, v, out, 3, call)
    b = head_error(*(t.transpose(1, 2) for t in (q, k, v, out)), 3, {**call, "layout": "bshd"})
    assert a == pytest.approx(b) and 0.99 < a["cos"] < 1.0


def _windows(n=2, length=160, vocab=128, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (1, length), generator=g) for _ in range(n)]


def test_perplexity_objective_meets_its_target_in_every_window():
    from sage_patch.calibrate import window_perplexities

    m = tiny_llama()
    windows = _windows()
    policy, res = calibrate(m, windows, objective="perplexity", max_ppl_increase=0.002, precisions=["8b", "4b"],
                            progress=False, return_details=True)
    full = window_perplexities(m, windows)
    with sage_patch.route_sdpa(m, policy):
        got = window_perplexities(m, windows)
    for (f, _), (g, _) in zip(full, got):
        assert g <= f * 1.001  # the default margin 0.5 searches within half of max_ppl_increase
    assert res.ppl_full == pytest.approx(math.exp(sum(math.log(p) for p, _ in full) / len(full)))
    # 4b on every layer breaks the target, so only some layers move, and they are the least sensitive ones
    assert ("4b", 3, pytest.approx(res.trace[1][2]), False) == res.trace[1]
    at_4b = [n for n, p in res.choice.items() if p == "4b"]
    assert 1 <= len(at_4b) < 3
    rel = {n: e.summary("4b")["rel_l1_mean"] for n, e in res.errors.items()}
    assert max(rel[n] for n in at_4b) < min(rel[n] for n in rel if n not in at_4b)
    assert res.counts() == {"4b": len(at_4b), "8b": 3 - len(at_4b)}
    assert "rejected" in res.table() and "in every window" in res.table()


def test_perplexity_objective_with_a_loose_target_uses_the_fastest_candidate_everywhere():
    m = tiny_llama(outlier_layer=None)
    _, res = calibrate(m, _windows(1), objective="perplexity", max_ppl_increase=10.0, precisions=["8b", "4b"],
                       progress=False, return_details=True)
    assert set(res.choice.values()) == {"4b"}
    assert [(p, k) for p, k, _, _ in res.trace] == [("8b", 3), ("4b", 3)]  # all tried first, both accepted


def test_perplexity_objective_arguments():
    m = tiny_llama()
    with pytest.raises(ValueError, match="objective must be one of thresholds, perplexity; got 'ppl'"):
        calibrate(m, _windows(1), objective="ppl", progress=False)
    with pytest.raises(ValueError, match="max_ppl_increase must be a number >= 0"):
        calibrate(m, _windows(1), objective="perplexity", max_ppl_increase=-0.1, progress=False)
    with pytest.raises(ValueError, match="margin must be a number >= 0 and < 1"):
        calibrate(m, _windows(1), objective="perplexity", margin=1.0, progress=False)
    with pytest.raises(TypeError, match="perplexity needs token-id tensors"):
        calibrate(m, [{"inputs_embeds": torch.zeros(1, 4, 64)}], objective="perplexity", progress=False)

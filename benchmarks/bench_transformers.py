#!/usr/bin/env python3
"""Time to first token of the Llama-3.1-8B architecture (random bf16 weights): attn_implementation "sage" vs
"sdpa" in the same run, plus the share of the prefill spent in attention and the Amdahl bound it implies.

    python benchmarks/bench_transformers.py --out out/bench_tf                  # H200: 8K, 32K, 128K
    python benchmarks/bench_transformers.py --out out/bench_tf --seqs 8192      # one length
    python benchmarks/bench_transformers.py --tiny --out /tmp/bench_tf_tiny     # CPU smoke test, tiny Llama

Per sequence length, on ONE model switched with `model.set_attn_implementation(...)`:
- TTFT: one prefill forward (batch 1, DynamicCache filled as generate() would, logits_to_keep=1 so the LM head
  never materializes S x 128256 logits), CUDA events, warm-up, median of --iters.
- "stub": the same forward with attention replaced by a zero-cost stub (returns the query): T_stub is everything
  but attention, so the attention share is f = (T_sdpa - T_stub) / T_sdpa.
- The attention op alone at the model's shapes (1 x 32 q heads, 8 KV heads, D 128, causal, bf16): sdpa vs
  sage_patch under the policy's precision; its ratio s is the kernel speed-up.
- Amdahl bound 1 / ((1 - f) + f / s): the integration should reach >= 90% of it (anything less is overhead of its own).
Writes bench_transformers.json and bench_transformers.md into --out.

--fallback-cases: batched, windowed and fallback prefills against what transformers runs without sage_patch: the
Llama-3.1-8B architecture with 4 layers, batch 4 x 8192 left-padded as generate() pads prompts of different lengths
(key padding: the 8b kernel), the same batch unpadded (the speed-up the padded one is held to), the Mistral-7B
architecture (sliding_window 4096: the kernels' window) with 4 layers at 16384 and 32768 tokens, the Gemma-3-4B text
architecture (6 layers: 5 sliding (1024) + 1 full, head dim 256: full precision until the kernels take 256, so the
fallback's cost) at 8192, and the gpt-oss-20b architecture with 4 layers at 8192 tokens (attention sinks) against
transformers' "eager", what transformers runs for a model without an sdpa path. The baseline ("sdpa", or "eager"
there) and "sage" on the same model in the same run, in both orders, CUDA events, medians; writes
fallback_cases.json (report.py renders it; copy it to docs/data/<gpu>_fallback.json).

    python benchmarks/bench_transformers.py --fallback-cases --out out/fallback
    python benchmarks/bench_transformers.py --fallback-cases --cases gpt_oss_20b_4layers_sinks --out out/sinks

Refuses to time "sage" on CUDA when the
compiled kernels are not loaded (it would time the PyTorch reference simulation) unless --allow-reference.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import Timer, run_meta  # noqa: E402

import sage_patch  # noqa: E402
import sage_patch.kernels as K  # noqa: E402
from sage_patch.api import run_attention  # noqa: E402
from sage_patch.policy import Policy, shipped_policy_path  # noqa: E402
from sage_patch.report import LayerStats  # noqa: E402

STUB = "sage_patch_stub"  # no "sdpa"/"flash"/"flex_attention"/"/" in the name: those trigger special paths

LLAMA31_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001)
ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}
TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, vocab_size=1024, max_position_embeddings=4096,
            tie_word_embeddings=False)


def llama_config(tiny: bool, arch: dict = LLAMA31_8B, rope: dict = ROPE):
    """LlamaConfig of `arch` with llama3 RoPE scaling `rope` (theta 500000), in the keys of the installed
    transformers; `tiny`: the TINY stand-in with the same RoPE kind."""
    import transformers
    from transformers import LlamaConfig

    kw = dict(TINY if tiny else arch)
    if int(transformers.__version__.split(".")[0]) >= 5:
        kw["rope_parameters"] = {**rope, "rope_theta": 500000.0, **(
            {"original_max_position_embeddings": 1024} if tiny else {})}
    else:
        kw["rope_scaling"], kw["rope_theta"] = dict(rope), 500000.0
    return LlamaConfig(**kw)


def register_stub() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def stub(module, query, key, value, attention_mask, **kwargs):
        return query.transpose(1, 2), None

    AttentionInterface.register(STUB, stub)
    AttentionMaskInterface.register(STUB, sdpa_mask)


def _summed(model, field: str) -> dict:
    """Per-layer report counters (impls or fallbacks) summed over the model's layers."""
    out: dict = {}
    for st in sage_patch.report(model).layers.values():
        for k, v in getattr(st, field).items():
            out[k] = out.get(k, 0) + v
    return out


def impl_counts(model) -> dict:
    return _summed(model, "impls")


def fallback_reasons(model) -> dict:
    return _summed(model, "fallbacks")


def reset_stats(model) -> None:
    for st in sage_patch.report(model).layers.values():
        st.reset()


def time_prefill(model, ids, impl: str, timer: Timer, warmup: int, iters: int, use_cache: bool) -> dict:
    model.set_attn_implementation(impl)

    def step():
        out = model(input_ids=ids, use_cache=use_cache, logits_to_keep=1)
        del out

    if timer.cuda:
        torch.cuda.reset_peak_memory_stats()
    times = timer(step, warmup, iters)
    res = {"ms": statistics.median(times), "ms_all": times}
    if timer.cuda:
        res["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return res


def time_attention_op(cfg, seq: int, dtype, device, policy: Policy, timer: Timer, warmup: int, iters: int) -> dict:
    """The attention call alone at the model's shapes: torch SDPA vs sage_patch (the policy's precision)."""
    g = torch.Generator(device=device).manual_seed(0)
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = torch.randn(1, hq, seq, d, device=device, dtype=dtype, generator=g)
    k = torch.randn(1, hkv, seq, d, device=device, dtype=dtype, generator=g)
    v = torch.randn(1, hkv, seq, d, device=device, dtype=dtype, generator=g)
    precision = policy.precision_for(None, 0)
    sdpa = timer(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                 warmup, iters)
    stats = LayerStats("op")

    sage = timer(lambda: run_attention(q, k, v, is_causal=True, precision=precision, policy=policy, stats=stats),
                 warmup, iters)
    return {"sdpa_ms": statistics.median(sdpa), "sage_ms": statistics.median(sage), "precision": precision,
            "impl": dict(stats.impls), "fallbacks": dict(stats.fallbacks)}


def amdahl(f: float, s: float) -> float:
    return 1.0 / ((1.0 - f) + f / s)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="out/bench_transformers")
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny Llama, short sequences")
    p.add_argument("--seqs", type=int, nargs="+", default=None, help="prompt lengths (default 8192 32768 131072)")
    p.add_argument("--impls", nargs="+", default=["sdpa", "sage", STUB])
    p.add_argument("--policy", default=None, help="sage policy (path, precision name); default sage_patch/configs/llama.yaml")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--no-cache", action="store_true", help="prefill without filling a KV cache")
    p.add_argument("--skip-op", action="store_true", help="do not time the attention op alone")
    p.add_argument("--fallback-cases", action="store_true", help="time the two full-precision fallback cases instead")
    p.add_argument("--cases", nargs="+", default=None, help="with --fallback-cases: only the cases of these names")
    p.add_argument("--allow-reference", action="store_true",
                   help="time 'sage' on CUDA even when the kernels are not loaded (reference simulation: slow)")
    a = p.parse_args(argv)

    device = torch.device("cpu" if a.tiny or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not a.tiny:
        print("no CUDA device: use --tiny for the CPU smoke test", file=sys.stderr)
        return 2
    dtype = torch.float32 if a.tiny else torch.bfloat16
    seqs = a.seqs or ([256, 512] if a.tiny else [8192, 32768, 131072])
    warmup = a.warmup if a.warmup is not None else 1
    iters = a.iters if a.iters is not None else (2 if a.tiny else 3)
    policy = Policy.from_any(a.policy or shipped_policy_path("llama"))
    kstat = K.status()
    if device.type == "cuda" and "sage" in a.impls and not kstat["loaded"] and not a.allow_reference:
        print(f"compiled kernels not loaded ({kstat['reason']}): 'sage' would time the PyTorch reference. "
              f"Build them, or pass --allow-reference, or --impls sdpa {STUB}", file=sys.stderr)
        return 3
    os.makedirs(a.out, exist_ok=True)
    if a.fallback_cases:
        return fallback_cases(a, device, dtype, kstat)

    from transformers import LlamaForCausalLM

    register_stub()
    cfg = llama_config(a.tiny)
    t0 = time.time()
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(cfg, attn_implementation="sage", dtype=dtype).eval()
    sage_patch.set_policy(model, policy)
    print(f"model built in {time.time() - t0:.1f} s on {device}: {sum(x.numel() for x in model.parameters()) / 1e9:.2f}"
          f"B params, {next(model.parameters()).dtype}", flush=True)
    timer = Timer(device)

    results = []
    for seq in seqs:
        gen = torch.Generator(device).manual_seed(seq)
        ids = torch.randint(0, cfg.vocab_size, (1, seq), device=device, generator=gen)
        row: dict = {"seq": seq, "ttft": {}}
        with torch.inference_mode():
            for impl in a.impls:
                reset_stats(model)
                r = time_prefill(model, ids, impl, timer, warmup, iters, not a.no_cache)
                if impl == "sage":
                    r["impl"], r["fallbacks"] = impl_counts(model), fallback_reasons(model)
                row["ttft"][impl] = r
                print(f"seq {seq:>6} {impl:>16}: {r['ms']:10.2f} ms" + (f"  {r.get('impl')}" if impl == "sage" else ""),
                      flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            if not a.skip_op:
                row["op"] = time_attention_op(cfg, seq, dtype, device, policy, timer, warmup, iters)
                op = row["op"]
                print(f"seq {seq:>6} attention op: sdpa {op['sdpa_ms']:.2f} ms, sage {op['sage_ms']:.2f} ms "
                      f"({op['impl']})", flush=True)
        t = {k: v["ms"] for k, v in row["ttft"].items()}
        if "sdpa" in t and "sage" in t:
            row["speedup"] = t["sdpa"] / t["sage"]
        if "sdpa" in t and STUB in t:
            row["attention_share"] = max(0.0, (t["sdpa"] - t[STUB]) / t["sdpa"])
            if "op" in row and "speedup" in row:
                s = row["op"]["sdpa_ms"] / row["op"]["sage_ms"]
                row["op_speedup"] = s
                row["amdahl_bound"] = amdahl(row["attention_share"], s)
                row["amdahl_efficiency"] = row["speedup"] / row["amdahl_bound"]
        results.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()

    meta = run_meta(
            device=torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
            transformers=__import__("transformers").__version__,
            sage_patch=sage_patch.__version__, kernels=kstat, dtype=str(dtype).replace("torch.", ""),
            model="tiny Llama" if a.tiny else "Llama-3.1-8B architecture, random weights",
            policy=policy.to_dict(), warmup=warmup, iters=iters, use_cache=not a.no_cache)
    with open(os.path.join(a.out, "bench_transformers.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2)
    md = to_markdown(meta, results)
    with open(os.path.join(a.out, "bench_transformers.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


MISTRAL_7B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=128, vocab_size=32000, max_position_embeddings=32768,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=4096, rope_theta=10000.0)
# google/gemma-3-4b-it's text_config (its first 6 layers: 5 sliding, 1 full)
GEMMA3_4B = dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=6, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=256, vocab_size=262208, max_position_embeddings=131072,
                 sliding_window=1024, query_pre_attn_scalar=256, rms_norm_eps=1e-6, rope_theta=1000000.0)


# gpt-oss-20b (transformers' GptOssConfig defaults are the 120b's: 36 layers, 128 experts)
GPT_OSS_20B = dict(hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8,
                   head_dim=64, num_local_experts=32, num_experts_per_tok=4, vocab_size=201088, sliding_window=128,
                   max_position_embeddings=131072, tie_word_embeddings=False,
                   rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "truncate": False, "original_max_position_embeddings": 4096,
                                    "rope_theta": 150000.0})


def gpt_oss_config(tiny: bool, layers: int):
    """GptOssConfig of gpt-oss-20b with `layers` layers (sliding and full attention alternating, as in the model);
    `tiny`: the TINY stand-in with 4 small experts and a 64-token window."""
    from transformers import GptOssConfig

    kw = dict(TINY, num_local_experts=4, num_experts_per_tok=2, sliding_window=64) if tiny else dict(GPT_OSS_20B)
    kw.update(num_hidden_layers=layers, layer_types=["sliding_attention", "full_attention"] * (layers // 2))
    return GptOssConfig(**kw)


def baseline_of(cls) -> str:
    """What transformers runs for a model class: "sdpa", or "eager" where it has no sdpa path (gpt-oss's attention
    sinks, Gemma 2's softcap: _supports_sdpa False); sage is timed against it."""
    return "sdpa" if getattr(cls, "_supports_sdpa", True) else "eager"


def _fallback_models(tiny: bool):
    """(name, model class, config, batch, length, prompt lengths): the batch and fallback cases (4 layers each)."""
    from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, GptOssForCausalLM, LlamaForCausalLM, MistralConfig,
                              MistralForCausalLM)

    llama = llama_config(tiny)
    llama.num_hidden_layers = 2 if tiny else 4
    mistral = MistralConfig(**(dict(TINY, sliding_window=64) if tiny else dict(MISTRAL_7B, num_hidden_layers=4)))
    gemma = Gemma3TextConfig(**(dict(TINY, sliding_window=64, num_hidden_layers=6) if tiny else GEMMA3_4B))
    n_llama, n_mistral, n_gemma = (256, 512, 256) if tiny else (8192, 16384, 8192)
    # left padding as generate() pads a batch of prompts of different lengths
    lengths = [n_llama, n_llama * 7 // 8, n_llama * 3 // 4, n_llama * 5 // 8]
    # the same batch unpadded: the speed-up a padded batch is measured against (issue 43: >= 0.9x of it)
    return [("llama31_8b_4layers_padded_batch", LlamaForCausalLM, llama, n_llama, lengths),
            ("llama31_8b_4layers_unpadded_batch", LlamaForCausalLM, llama, n_llama, [n_llama] * len(lengths)),
            ("mistral_7b_4layers_sliding_window", MistralForCausalLM, mistral, n_mistral, [n_mistral]),
            ("mistral_7b_4layers_sliding_window", MistralForCausalLM, mistral, 2 * n_mistral, [2 * n_mistral]),
            ("gemma3_4b_6layers_sliding_d256", Gemma3ForCausalLM, gemma, n_gemma, [n_gemma]),
            # attention sinks (s_aux) on the kernel, vs transformers' eager (its only non-flash path for gpt-oss);
            # the sliding layers (window 128) on the kernels' window
            ("gpt_oss_20b_4layers_sinks", GptOssForCausalLM, gpt_oss_config(tiny, 4), n_llama, [n_llama])]


def fallback_cases(a, device, dtype, kstat) -> int:
    warmup = a.warmup if a.warmup is not None else 2
    iters = a.iters if a.iters is not None else (2 if a.tiny else 10)
    timer = Timer(device)
    cases = []
    models = _fallback_models(a.tiny)
    unknown = set(a.cases or ()) - {m[0] for m in models}
    if unknown:
        print(f"--cases: unknown {sorted(unknown)}; cases: {[m[0] for m in models]}", file=sys.stderr)
        return 2
    for name, cls, cfg, total, lengths in models:
        if a.cases and name not in a.cases:
            continue
        torch.manual_seed(0)
        with torch.device(device):
            model = cls._from_config(cfg, attn_implementation="sage", dtype=dtype).eval()
        sage_patch.set_policy(model, a.policy or shipped_policy_path("llama"))
        gen = torch.Generator(device).manual_seed(total)
        ids = torch.randint(1, cfg.vocab_size, (len(lengths), total), device=device, generator=gen)
        mask = torch.zeros_like(ids)
        for i, n in enumerate(lengths):
            mask[i, total - n:] = 1
        ids = ids * mask

        def step():
            model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)

        base = baseline_of(cls)
        row = {"case": name, "batch": len(lengths), "tokens": total, "prompt_lengths": lengths, "baseline": base,
               "orders": []}
        with torch.inference_mode():
            for order in ((base, "sage"), ("sage", base)):
                ms = {}
                for impl in order:
                    model.set_attn_implementation(impl)
                    reset_stats(model)
                    ms[impl] = statistics.median(timer(step, warmup, iters))
                    if impl == "sage":
                        row["sage_impl"], row["sage_fallbacks"] = impl_counts(model), fallback_reasons(model)
                row["orders"].append({"order": list(order), "baseline_ms": ms[base], "sage_ms": ms["sage"],
                                      "sage_over_baseline": ms["sage"] / ms[base]})
                print(f"{name} ({' then '.join(order)}): {base} {ms[base]:.2f} ms, sage {ms['sage']:.2f} ms "
                      f"({ms['sage'] / ms[base] - 1:+.2%})", flush=True)
        row["max_overhead"] = max(o["sage_over_baseline"] for o in row["orders"]) - 1
        cases.append(row)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    meta = run_meta(device=torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
                    transformers=__import__("transformers").__version__, sage_patch=sage_patch.__version__,
                    kernels=kstat, dtype=str(dtype).replace("torch.", ""), warmup=warmup, iters=iters)
    with open(os.path.join(a.out, "fallback_cases.json"), "w") as f:
        json.dump({"kind": "fallback", "meta": meta, "cases": cases}, f, indent=2)
    return 0


def to_markdown(meta: dict, results: list) -> str:
    lines = [f"{meta['model']}, {meta['dtype']}, batch 1, on {meta['device']} (torch {meta['torch']}, "
             f"transformers {meta['transformers']}, {meta['date']}). TTFT = one prefill forward with "
             f"logits_to_keep=1{', filling a DynamicCache' if meta['use_cache'] else ''}; median of "
             f"{meta['iters']} after {meta['warmup']} warm-up. Kernels: "
             f"{'loaded' if meta['kernels']['loaded'] else 'not loaded (' + meta['kernels']['reason'] + ')'}.", "",
             "| tokens | TTFT sdpa (ms) | TTFT sage (ms) | speed-up | attention share | attn op speed-up "
             "| Amdahl bound | achieved / bound | sage ran |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---|"]

    def fmt(x, spec):
        return "-" if x is None else format(x, spec)

    for r in results:
        t = r["ttft"]
        lines.append("| {} | {} | {} | {} | {} | {} | {} | {} | {} |".format(
            r["seq"], fmt(t.get("sdpa", {}).get("ms"), ".1f"), fmt(t.get("sage", {}).get("ms"), ".1f"),
            fmt(r.get("speedup"), ".3f") + ("x" if "speedup" in r else ""),
            fmt(r.get("attention_share") and 100 * r["attention_share"], ".1f")
            + ("%" if "attention_share" in r else ""),
            fmt(r.get("op_speedup"), ".2f") + ("x" if "op_speedup" in r else ""),
            fmt(r.get("amdahl_bound"), ".3f") + ("x" if "amdahl_bound" in r else ""),
            fmt(r.get("amdahl_efficiency") and 100 * r["amdahl_efficiency"], ".1f")
            + ("%" if "amdahl_efficiency" in r else ""),
            ", ".join(f"{k}:{v}" for k, v in t.get("sage", {}).get("impl", {}).items()) or "-"))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

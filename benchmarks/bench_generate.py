"""generate() end to end: greedy generation of a batch of prompts of different lengths (left-padded, as generate()
pads them), attn_implementation "sage" (the shipped llama policy: 8b prefill, decode steps in full precision) against
"sdpa" on the same model in the same run, interleaved call by call, the order alternating. Per implementation: time to first token (generate with one
new token), total time (all new tokens), and the generated tokens; per prompt, the first step where sage's token
differs from sdpa's and sdpa's logit margin (top-1 minus top-2) there: with random weights the logits are nearly flat,
so a small margin explains a divergence.

    python benchmarks/bench_generate.py --out docs/data/h200_generate.json          # Llama-3.1-8B architecture
    python benchmarks/bench_generate.py --tiny --out out/generate.json               # CPU smoke run
    python benchmarks/bench_generate.py --tiny --layers 4 --new-tokens 64 --reps 16 --device cpu   # decode cost

Decode steps (one query token each) run full precision under the shipped policy, so their time is the host's: the
"decode ms/step" line, (total - TTFT) / (new tokens - 1), compares what sage_patch's routing adds to each step.

Weights are random (no download): the full-size architecture from its released config.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_transformers import llama_config  # noqa: E402
from timing import Timer, run_meta  # noqa: E402

import sage_patch  # noqa: E402


def left_padded_batch(lengths: list[int], vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    total = max(lengths)
    gen = torch.Generator(device).manual_seed(total)
    ids = torch.randint(1, vocab, (len(lengths), total), device=device, generator=gen)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        mask[i, total - n:] = 1
    return ids * mask, mask


def divergence(sage: torch.Tensor, sdpa: torch.Tensor, scores: tuple) -> list[dict]:
    """Per prompt: the first new-token step where the tokens differ (None: identical) and sdpa's logit margin there."""
    out = []
    for row in range(sage.shape[0]):
        diff = (sage[row] != sdpa[row]).nonzero()
        if diff.numel() == 0:
            out.append({"first_divergence": None, "margin": None})
            continue
        step = int(diff[0])
        top2 = scores[step][row].float().topk(2).values
        out.append({"first_divergence": step, "margin": float(top2[0] - top2[1])})
    return out


def decode_ms_per_step(times: dict, new_tokens: int) -> float:
    """Median time of one decode step: (total - time to first token) / (new_tokens - 1), from the medians."""
    total, ttft = statistics.median(times["total_ms"]), statistics.median(times["ttft_ms"])
    return (total - ttft) / max(new_tokens - 1, 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a tiny config (CPU smoke run)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the config's)")
    ap.add_argument("--prompts", type=int, nargs="+", default=None, help="prompt lengths (default 8192 4096 2048 "
                                                                         "1024; tiny: 96 64 48 32)")
    ap.add_argument("--new-tokens", type=int, default=None, help="tokens generated (default 128; tiny: 8)")
    ap.add_argument("--reps", type=int, default=4, help="timed generate() calls per implementation, interleaved with "
                                                       "the other's, the order alternating (median)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    lengths = a.prompts or ([96, 64, 48, 32] if a.tiny else [8192, 4096, 2048, 1024])
    new_tokens = a.new_tokens or (8 if a.tiny else 128)
    cfg = llama_config(a.tiny)
    if a.layers:
        cfg.num_hidden_layers = a.layers
    torch.manual_seed(0)
    from transformers import LlamaForCausalLM

    with torch.device(device):
        model = LlamaForCausalLM._from_config(cfg, attn_implementation="sage", dtype=dtype).eval()
    sage_patch.set_policy(model, "llama")
    ids, mask = left_padded_batch(lengths, cfg.vocab_size, device)
    timer = Timer(device)

    def generate(n):
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_scores=True)

    impls = ("sdpa", "sage")
    times = {impl: {"ttft_ms": [], "total_ms": []} for impl in impls}
    tokens, scores = {}, {}
    with torch.inference_mode():
        for impl in impls:  # warm-up, and the tokens compared below (sage's report: what this one call ran)
            model.set_attn_implementation(impl)
            generate(1)
            sage_patch.reset_report(model)
            res = generate(new_tokens)
            tokens[impl], scores[impl] = res.sequences[:, ids.shape[1]:], res.scores
            if impl == "sage":
                used = {}
                for layer in sage_patch.report(model).to_dict().values():
                    for k, v in layer.get("impl", {}).items():
                        used[k] = used.get(k, 0) + v
        for rep in range(a.reps):  # interleaved, the order alternating: drift of clocks or memory hits both alike
            for impl in impls if rep % 2 == 0 else impls[::-1]:
                model.set_attn_implementation(impl)
                times[impl]["ttft_ms"] += timer(lambda: generate(1), 0, 1)
                times[impl]["total_ms"] += timer(lambda: generate(new_tokens), 0, 1)
    for impl in impls:
        t = times[impl]
        print(f"{impl}: TTFT {statistics.median(t['ttft_ms']):.1f} ms, {new_tokens} tokens "
              f"{statistics.median(t['total_ms']):.1f} ms, decode {decode_ms_per_step(t, new_tokens):.2f} ms/step "
              f"(each of {a.reps})", flush=True)
    div = divergence(tokens["sage"], tokens["sdpa"], scores["sdpa"])
    for n, d in zip(lengths, div):
        print(f"prompt {n}: " + ("tokens identical" if d["first_divergence"] is None else
                                 f"first divergence at step {d['first_divergence']}, sdpa margin {d['margin']:.4f}"))
    if a.out:
        meta = run_meta(model="Llama-3.1-8B architecture" if not a.tiny else "tiny Llama", layers=cfg.num_hidden_layers,
                        dtype=str(dtype).replace("torch.", ""), prompts=lengths, new_tokens=new_tokens, reps=a.reps,
                        transformers=__import__("transformers").__version__)
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump({"kind": "generate", "meta": meta, "times": times, "sage_impl": used,
                       "prompts": [{"tokens": n, **d} for n, d in zip(lengths, div)]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Benchmark: one transformer forward on 1 GPU vs P GPUs, torch SDPA (cuDNN) vs sage, under diffusers' context
parallelism (Ulysses, ring). Launched with torchrun, one process per GPU:

    torchrun --nproc-per-node 2 benchmarks/bench_multigpu.py --cases flux-2048 hunyuan-720p --out out/mgpu

Full-size architectures from their real configs with random bf16 weights (benchmarks/bench_diffusers.py builds them;
every rank draws the same weights and inputs from one seed), batch 1. Per case, on one set of weights:

- 1 GPU: the forward with torch SDPA (cuDNN backend) and with `enable_sage_attention()` (shipped policy), on every
  rank at once (each on its own GPU), so the ranks stay in step; rank 0's numbers are reported.
- P GPUs, for each of Ulysses-P and ring-P (SDPA of a model with a key-padding mask: Ulysses only, see run_case): `transformer.enable_parallelism(config=ContextParallelConfig(...))`
  (through `sage_patch.integrations.cp_plans.enable_parallelism`, which adds the plan sage_patch ships for
  HunyuanVideo; diffusers ships none), then the same two forwards. SDPA runs diffusers' "_native_cudnn" backend, the one torch SDPA backend whose
  context-parallel op returns the LSE that ring attention needs; sage runs our kernels on each rank's shard (and
  diffusers' cuDNN backend for layers its policy keeps full). diffusers has no disable_parallelism: between
  configurations the benchmark removes what enable_parallelism set (its hooks, the processors' config).
- Times: CUDA events, warm-up, median of --reps per rank; the slowest rank's median is the forward's time.
  Accuracy: cosine of each P-GPU output to the 1-GPU output of the same attention (sage to sage, SDPA to SDPA).

LLM case (`--cases llama-8b-tp`): the Llama-3.1-8B architecture (random bf16 weights; rank 0 builds it, times the
1-GPU prefill, saves it to --scratch), then every rank loads it with transformers' tensor parallelism
(`from_pretrained(..., tp_plan="auto")`) and times the TP-P prefill: time to first token of one --seq-token prompt
(batch 1, KV cache filled as generate() does, logits of the last token only), attn_implementation "sdpa" vs "sage".
Accuracy: cosine of the last token's logits to the 1-GPU logits of the same attention.

Writes bench_multigpu.json (records + run metadata) and bench_multigpu.md into --out on rank 0.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_diffusers import CASES, build, cosine  # noqa: E402
from timing import Clock, run_meta  # noqa: E402

LLM_CASE = "llama-8b-tp"

SDPA_BACKEND = "_native_cudnn"


def log(msg):
    if dist.get_rank() == 0:
        print(msg, file=sys.stderr, flush=True)


def timed(fn, clock, args, together=True):
    """Median ms of `fn()` over --reps after --warmup (with `together`, every rep starts on all ranks at once) and
    its last result."""
    times, out = [], None
    with torch.no_grad():
        for i in range(args.warmup + args.reps):
            if together:
                dist.barrier()
            a = clock.mark()
            out = fn()
            b = clock.mark()
            if i >= args.warmup:
                times.append(clock.ms(a, b))
    return statistics.median(times), out


def slowest(ms: float) -> float:
    t = torch.tensor([ms], dtype=torch.float64, device=torch.device("cuda", torch.cuda.current_device()))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def cp_config(kind: str, world: int):
    from diffusers import ContextParallelConfig

    if kind == "ulysses":
        return ContextParallelConfig(ulysses_degree=world)
    if kind == "ring":
        return ContextParallelConfig(ring_degree=world)
    if kind == "unified":   # Ulysses x ring (needs 4 GPUs: 2 x 2)
        return ContextParallelConfig(ulysses_degree=2, ring_degree=world // 2)
    raise ValueError(kind)


def reset_parallelism(model) -> None:
    """Undo `enable_parallelism` for context parallelism: the plan's split/gather hooks (and those of a plan shipped
    by sage_patch) and the processors' config (what enable_parallelism set; diffusers has no public inverse)."""
    from diffusers.hooks.context_parallel import remove_context_parallel

    from sage_patch.integrations import cp_plans

    remove_context_parallel(model, cp_plans.plan_for(model))
    cp_plans.remove_plan_hooks(model)
    for m in model.modules():
        proc = getattr(m, "processor", None)
        if proc is not None and hasattr(proc, "_parallel_config"):
            proc._parallel_config = None
    model._parallel_config = None


def run_variant(model, inputs, clock, args, sage: bool):
    import sage_patch

    if sage:
        model.enable_sage_attention(args.policy)
    try:
        ms, out = timed(lambda: model(**inputs)[0], clock, args)
        rep = sage_patch.report(model) if sage else None
    finally:
        if sage:
            model.disable_sage_attention()
    used = {}
    if rep is not None:
        for st in rep.layers.values():
            for p, n in st.used.items():
                used[p] = used.get(p, 0) + n
    return ms, out, used


def run_case(name, args, device, world):
    from sage_patch.integrations import cp_plans

    family, h, w, frames = CASES[name]
    if frames is not None and args.frames is not None:
        frames = args.frames
    model, inputs, tokens = build(family, h, w, frames, device, torch.bfloat16, tiny=False, seed=0)
    # A key-padding mask (HunyuanVideo's text) rules out cuDNN's context-parallel op: diffusers' ring template
    # applies each rank's local mask to every K/V chunk (wrong), so such a model's SDPA peer is torch SDPA ("native",
    # which picks its kernel per call) and runs Ulysses only.
    masked = "encoder_attention_mask" in inputs
    model.set_attention_backend("native" if masked else SDPA_BACKEND)
    clock = Clock(device)
    rec = {"case": name, "frames": frames, "tokens": tokens, "gpus": world, "gpu": torch.cuda.get_device_name(device)}
    ref = {}
    for attn in args.attn:
        ms, out, used = run_variant(model, inputs, clock, args, sage=attn == "sage")
        rec[f"1gpu_{attn}_ms"] = round(ms, 2)   # rank 0's (every rank ran the same forward on its own GPU)
        if used:
            rec["1gpu_sage_used"] = used
        ref[attn] = out.float()
        log(f"[{name}] 1 GPU {attn}: {ms:.1f} ms")
    for kind in args.parallel:
        try:
            cp_plans.enable_parallelism(model, cp_config(kind, world))   # diffusers' plan, or sage_patch's
        except Exception as e:  # a model diffusers (or sage-patch) has no context-parallel plan for
            rec[f"{kind}_error"] = f"{type(e).__name__}: {e}"
            log(f"[{name}] {kind}: {rec[f'{kind}_error']}")
            continue
        try:
            for attn in args.attn:
                if attn == "sdpa" and masked and kind != "ulysses":
                    rec[f"{kind}_sdpa_ms"] = "n/a: diffusers' ring applies the local mask to every K/V chunk"
                    continue
                ms, out, used = run_variant(model, inputs, clock, args, sage=attn == "sage")
                rec[f"{kind}_{attn}_ms"] = round(slowest(ms), 2)
                rec[f"{kind}_{attn}_cos_vs_1gpu"] = round(cosine(out.float(), ref[attn]), 6)
                if used:
                    rec[f"{kind}_sage_used"] = used
                log(f"[{name}] {kind}-{world} {attn}: {rec[f'{kind}_{attn}_ms']} ms, "
                    f"cos {rec[f'{kind}_{attn}_cos_vs_1gpu']}")
        finally:
            reset_parallelism(model)
        if "sage" not in args.attn:
            continue
        rec[f"{kind}_sage_vs_1gpu_sage"] = round(rec["1gpu_sage_ms"] / rec[f"{kind}_sage_ms"], 3)
        if isinstance(rec.get(f"{kind}_sdpa_ms"), float):
            rec[f"{kind}_sage_vs_{kind}_sdpa"] = round(rec[f"{kind}_sdpa_ms"] / rec[f"{kind}_sage_ms"], 3)
    del model, inputs, ref
    torch.cuda.empty_cache()
    return rec


def prefill(model, ids):
    """One prompt's prefill as generate() runs it: KV cache filled, logits of the last token only."""
    return model(input_ids=ids, use_cache=True, logits_to_keep=1).logits.float()


def run_llm(args, device, world):
    from bench_transformers import llama_config
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    cfg = llama_config(tiny=False)
    ids = torch.randint(0, cfg.vocab_size, (1, args.seq), generator=torch.Generator().manual_seed(0)).to(device)
    clock = Clock(device)
    rec = {"case": LLM_CASE, "tokens": args.seq, "gpus": world, "gpu": torch.cuda.get_device_name(device)}
    ref = {}
    path = os.path.join(args.scratch, "llama31_8b_random")
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        prev = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device(device):
                model = LlamaForCausalLM(cfg).eval()
        finally:
            torch.set_default_dtype(prev)
        for attn in ("sdpa", "sage"):
            model.set_attn_implementation(attn)
            ms, ref[attn] = timed(functools.partial(prefill, model, ids), clock, args, together=False)
            rec[f"1gpu_{attn}_ms"] = round(ms, 2)
            log(f"[{LLM_CASE}] 1 GPU {attn}: {rec[f'1gpu_{attn}_ms']} ms")
        model.save_pretrained(path)
        del model
        torch.cuda.empty_cache()
    dist.barrier()
    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", attn_implementation="sdpa",
                                                 dtype=torch.bfloat16)
    for attn in ("sdpa", "sage"):
        model.set_attn_implementation(attn)
        ms, logits = timed(functools.partial(prefill, model, ids), clock, args)
        rec[f"tp_{attn}_ms"] = round(slowest(ms), 2)
        if dist.get_rank() == 0:
            rec[f"tp_{attn}_cos_vs_1gpu"] = round(cosine(logits, ref[attn]), 6)
        log(f"[{LLM_CASE}] TP-{world} {attn}: {rec[f'tp_{attn}_ms']} ms")
    rec["tp_sage_vs_tp_sdpa"] = round(rec["tp_sdpa_ms"] / rec["tp_sage_ms"], 3)
    if "1gpu_sage_ms" in rec:
        rec["tp_sage_vs_1gpu_sage"] = round(rec["1gpu_sage_ms"] / rec["tp_sage_ms"], 3)
    del model
    torch.cuda.empty_cache()
    return rec


def times(ratio) -> str:
    return "-" if ratio is None else f"{ratio}x"


def markdown(records, parallel) -> str:
    head = "| case | tokens | GPUs | 1-GPU SDPA ms | 1-GPU sage ms |"
    sep = "|---|---|---|---|---|"
    for kind in parallel:
        head += (f" {kind} SDPA ms | {kind} sage ms | {kind} sage vs 1-GPU sage | {kind} sage vs {kind} SDPA "
                 f"| {kind} cos sage (SDPA) |")
        sep += "---|---|---|---|---|"
    lines = [head, sep]
    for r in records:
        if r["case"] == LLM_CASE:
            continue
        row = (f"| {r['case']}" + (f" ({r['frames']} frames)" if r.get("frames") else "")
               + f" | {r['tokens']} | {r['gpus']} | {r.get('1gpu_sdpa_ms', '-')} | {r.get('1gpu_sage_ms', '-')} |")
        for kind in parallel:
            if f"{kind}_error" in r:
                row += f" {r[f'{kind}_error'][:80]} | | | | |"
                continue
            row += (f" {r.get(f'{kind}_sdpa_ms', '-')} | {r.get(f'{kind}_sage_ms', '-')} "
                    f"| {times(r.get(f'{kind}_sage_vs_1gpu_sage'))} | {times(r.get(f'{kind}_sage_vs_{kind}_sdpa'))} "
                    f"| {r.get(f'{kind}_sage_cos_vs_1gpu', '-')} ({r.get(f'{kind}_sdpa_cos_vs_1gpu', '-')}) |")
        lines.append(row)
    llm = [r for r in records if r["case"] == LLM_CASE and "tp_sage_ms" in r]
    if llm:
        lines += ["", "| LLM prefill (TTFT) | tokens | GPUs | 1-GPU SDPA ms | 1-GPU sage ms | TP SDPA ms | TP sage ms "
                  "| TP sage vs TP SDPA | TP sage vs 1-GPU sage | cos sage (SDPA) vs 1 GPU |", "|---" * 10 + "|"]
        for r in llm:
            lines.append(f"| {r['case']} | {r['tokens']} | {r['gpus']} | {r.get('1gpu_sdpa_ms', '-')} "
                         f"| {r.get('1gpu_sage_ms', '-')} | {r['tp_sdpa_ms']} | {r['tp_sage_ms']} "
                         f"| {r['tp_sage_vs_tp_sdpa']}x | {times(r.get('tp_sage_vs_1gpu_sage'))} "
                         f"| {r.get('tp_sage_cos_vs_1gpu', '-')} ({r.get('tp_sdpa_cos_vs_1gpu', '-')}) |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", choices=list(CASES) + [LLM_CASE],
                    default=["flux-2048", "hunyuan-720p", LLM_CASE])
    ap.add_argument("--parallel", nargs="+", choices=("ulysses", "ring", "unified"), default=["ulysses", "ring"])
    ap.add_argument("--attn", nargs="+", choices=("sdpa", "sage"), default=["sdpa", "sage"],
                    help="attention variants of the diffusers cases")
    ap.add_argument("--frames", type=int, default=None, help="frame count of the video cases (default: the case's)")
    ap.add_argument("--policy", default=None, help="sage policy (default: the shipped policy of the model class)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seq", type=int, default=32768, help="prompt tokens of the LLM case")
    ap.add_argument("--scratch", default="/tmp", help="where the LLM case saves its random checkpoint")
    ap.add_argument("--out", default="out/bench_multigpu")
    args = ap.parse_args(argv)

    import sage_patch  # noqa: F401  (enable_sage_attention on diffusers models)
    from sage_patch import kernels

    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    device = torch.device("cuda", local)
    if not kernels.status()["loaded"]:
        raise SystemExit(f"compiled kernels not loaded: {kernels.status()['reason']}")
    records = []
    try:
        for name in args.cases:
            try:
                rec = run_llm(args, device, world) if name == LLM_CASE else run_case(name, args, device, world)
            except torch.cuda.OutOfMemoryError as e:
                rec = {"case": name, "error": f"out of memory: {e}".splitlines()[0]}
                torch.cuda.empty_cache()
            records.append(rec)
            if dist.get_rank() == 0:
                print(json.dumps(rec), flush=True)
    finally:
        if dist.get_rank() == 0:
            os.makedirs(args.out, exist_ok=True)
            md = markdown(records, args.parallel)
            print(md)
            with open(os.path.join(args.out, "bench_multigpu.json"), "w") as f:
                json.dump({"meta": run_meta(world_size=world, policy=args.policy or "shipped default"),
                           "records": records}, f, indent=1)
            with open(os.path.join(args.out, "bench_multigpu.md"), "w") as f:
                f.write(md + "\n")
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

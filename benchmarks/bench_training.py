#!/usr/bin/env python3
"""Training speed of the trainable 8b attention (SageBwd) against torch SDPA, in the same run: the attention call
forward + backward and backward alone, and whole training steps of two architectures (random weights).

    python benchmarks/bench_training.py --cases attention --out out/bench/training_attention.json
    python benchmarks/bench_training.py --cases llama flux --out out/bench/training_models.json
    python benchmarks/bench_training.py --smoke --out /tmp/bench_training.json      # tiny shapes; CPU or GPU

Cases (--cases, default all three):
- attention: B=4 H=32 (--batch, --heads), --dtype (bf16), D in --dims, causal and not, N in --seqs. Implementations
  (--impls): sage8b = `sage_patch.trainable.sagebwd_attention` with the Triton pair (kernel="sagebwd-triton", no
  routing), sage8b_hopper = the same with the sm_90a CUDA kernels (kernel="sagebwd-hopper": its forward, or the
  Triton one where that measured faster, and its backward; H100/H200), sage_api = `sage_patch.attention(...,
  precision="8b")` (the resolver: may run SDPA below a measured crossover; what it ran is recorded per case), and
  torch SDPA with one backend forced (cudnn, flash; on CPU math and flash, the backends torch has there). Every
  implementation gets the same inputs (randn; K and V with a per-channel bias of 4 sigma, as bench_kernel's accuracy
  inputs). "fwdbwd" times out = f(q, k, v) then torch.autograd.grad(out, (q, k, v), dO); "fwd" times out = f(q, k, v)
  alone (recording the autograd graph, as a training step does); "bwd" times torch.autograd.grad(...,
  retain_graph=True) of one forward done outside the timed region. Whole calls, every quantization pass included;
  timing.counted_ms (CUDA events, L2 flushed before each call, --warmup untimed calls, median of --reps). TFLOPS:
  forward 4*B*H*N*N*D (halved when causal), backward 2.5x that, forward + backward 3.5x. Ratios: baseline time /
  time (--baseline: cudnn; math on CPU). Peak memory: the most allocated during one forward + backward beyond what
  was allocated before it (q, k, v, dO). Accuracy at the first N of each
  D and causal (N <= 8192): cosine of out, dq, dk, dv (batch 0, the first 8 heads) to torch SDPA math in float64.
  A shape that raises (out of memory, a backend that cannot run it) is recorded with its error and skipped.
- llama: one training step of the Llama-3.2-1B architecture (its config.json values, hard-coded; random bf16
  weights), batch 1 at --llama-seqs tokens (8K, 16K): forward with labels (the model's own loss) + backward +
  optimizer step (--optim adamw, or sgd where optimizer state does not fit). attn_implementation "sage" (shipped
  policy) vs "sdpa" with each SDPA peer backend forced (--model-impls); median of --step-reps steps after
  --step-warmup. Gradient checkpointing (--grad-ckpt): "auto" runs without it and, when any implementation ran out
  of memory at a length, runs every implementation again with it (both kept, marked); "on"/"off" force it.
- flux: one training step of a FluxTransformer2DModel from the FLUX.1-dev config with fewer blocks (--flux-blocks,
  default 4 double + 8 single of its 19 + 38), random bf16 weights, --flux-size pixels (1024: 4096 image + 512 text
  tokens): forward + MSE loss to a random target + backward + optimizer step; `sage_patch.inject` (shipped flux
  policy) vs torch SDPA with each peer backend forced.
For both models, before the timed steps, one forward + backward per implementation on the same weights gives the
loss and the cosine of one weight's gradient (layer 0's query projection) to the baseline's ("probe"); the sage
rows record the implementations the report counted (e.g. {"triton-sagebwd": 112}); peak memory is the most
allocated during the timed steps (weights, gradients, optimizer state, activations).

Writes one JSON to --out (rewritten after every case, so a run cut short keeps what it measured):
{"kind": "training", "meta": {...}, "attention": [...], "llama": [...], "flux": [...]}; benchmarks/report.py
renders it (copy it to docs/data/<gpu>_training*.json). --training-routing off runs every sage row (sage_api and the
models' sage) under its policy with options.training_speed_routing: false (the training kernel at every length, as
sage8b; on: the resolver routes to SDPA below the training variant's measured crossover, the default). On a GPU,
refuses to time sage when a training call would
not run a SageBwd kernel (no kernel: the reference simulation or full precision) unless --allow-reference.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_transformers import impl_counts, llama_config, reset_stats  # noqa: E402
from timing import Timer, counted_ms, forced_sdpa, run_meta, tops  # noqa: E402

import sage_patch  # noqa: E402
from sage_patch.accuracy import cosine  # noqa: E402
from sage_patch.api import run_attention as sage_run_attention  # noqa: E402
from sage_patch.lifecycle import family_policy  # noqa: E402
from sage_patch.policy import Policy  # noqa: E402
from sage_patch.report import GLOBAL_STATS  # noqa: E402
from sage_patch.resolve import TRAINABLE_IMPL  # noqa: E402
from sage_patch.trainable import sagebwd_attention  # noqa: E402

CASES = ("attention", "llama", "flux")
OURS = ("sage8b", "sage8b_hopper", "sage_api")
TRAINING_VARIANTS = {"sage8b": "sagebwd-triton", "sage8b_hopper": "sagebwd-hopper"}  # the registry keys they force
PEERS = ("cudnn", "flash", "math", "efficient")   # torch SDPA with that one backend forced (timing.forced_sdpa)
MODEL_OURS = ("sage",)
FLOP_FACTOR = {"fwdbwd": 3.5, "fwd": 1.0, "bwd": 2.5}   # x the forward's 4*B*H*N*N*D (halved when causal)
ACC_MAX_N = 8192                                 # accuracy's float64 reference: scores of N x N per head
ACC_HEADS = 8
LR = 1e-5                                        # small: the timed steps must not move the weights far

# meta-llama/Llama-3.2-1B config.json (hard-coded: no download); 1.24B parameters, embeddings tied
LLAMA32_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
                  rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001,
                  hidden_act="silu", attention_bias=False, mlp_bias=False, attention_dropout=0.0)
LLAMA32_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
FLUX_BLOCKS = (4, 8)        # double, single (FLUX.1-dev has 19 + 38)
SMOKE = dict(batch=1, heads=2, seqs=[128, 256], llama_seqs=[256], flux_size=256, flux_blocks=(1, 1), warmup=1,
             reps=2)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    p.add_argument("--out", default="out/bench/bench_training.json")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes and models, a quick check of the whole script (without a GPU: on the CPU, "
                        "where sage runs the reference simulation and SDPA its math and flash backends)")
    p.add_argument("--seqs", type=int, nargs="+", default=None,
                   help="attention N (default 1024 2048 4096 8192 16384 32768)")
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128], help="attention head dims")
    p.add_argument("--batch", type=int, default=None, help="attention B (default 4)")
    p.add_argument("--heads", type=int, default=None, help="attention H (default 32)")
    p.add_argument("--impls", default=None,
                   help="attention implementations, comma list of sage8b, sage_api, cudnn, flash, math, efficient "
                        "(default sage8b,sage_api,cudnn,flash; on CPU sage8b,sage_api,math,flash)")
    p.add_argument("--model-impls", default=None,
                   help="training-step implementations, comma list of sage and SDPA backends "
                        "(default sage,cudnn,flash; on CPU sage,math,flash)")
    p.add_argument("--baseline", default=None, help="SDPA backend the ratios divide by (default cudnn; CPU math)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    p.add_argument("--warmup", type=int, default=None, help="attention: untimed calls first (default 3)")
    p.add_argument("--reps", type=int, default=None, help="attention: timed calls, median (default 10)")
    p.add_argument("--step-warmup", type=int, default=None, help="models: untimed steps first (default 2)")
    p.add_argument("--step-reps", type=int, default=None, help="models: timed steps, median (default 5)")
    p.add_argument("--llama-seqs", type=int, nargs="+", default=None, help="tokens per step (default 8192 16384)")
    p.add_argument("--optim", default="adamw", choices=("adamw", "sgd"),
                   help=f"optimizer of the training steps (lr {LR}); sgd keeps no state")
    p.add_argument("--grad-ckpt", default="auto", choices=("auto", "on", "off"))
    p.add_argument("--flux-blocks", type=int, nargs=2, default=None, metavar=("DOUBLE", "SINGLE"),
                   help=f"Flux blocks (default {FLUX_BLOCKS[0]} {FLUX_BLOCKS[1]})")
    p.add_argument("--flux-size", type=int, default=None,
                   help="Flux image side in pixels (default 1024: 4096 image tokens; 512 text tokens)")
    p.add_argument("--allow-reference", action="store_true",
                   help="on a GPU, time sage even when training calls would not run a SageBwd kernel")
    p.add_argument("--training-routing", default="on", choices=("on", "off"),
                   help="sage rows' policy options.training_speed_routing: on (default) routes training calls to "
                        "SDPA below the training kernel's measured crossover, off runs the kernel at every length")
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not a.smoke:
        p.error("no CUDA device: use --smoke for the CPU run (tiny shapes, reference simulation)")
    a.device = torch.device("cuda" if cuda else "cpu")
    a.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    pick = lambda given, smoke, full: given if given is not None else (smoke if a.smoke else full)  # noqa: E731
    a.seqs = pick(a.seqs, SMOKE["seqs"], [1024, 2048, 4096, 8192, 16384, 32768])
    a.batch = pick(a.batch, SMOKE["batch"], 4)
    a.heads = pick(a.heads, SMOKE["heads"], 32)
    a.llama_seqs = pick(a.llama_seqs, SMOKE["llama_seqs"], [8192, 16384])
    a.flux_size = pick(a.flux_size, SMOKE["flux_size"], 1024)
    a.flux_blocks = tuple(pick(a.flux_blocks, SMOKE["flux_blocks"], FLUX_BLOCKS))
    a.warmup = pick(a.warmup, SMOKE["warmup"], 3)
    a.reps = pick(a.reps, SMOKE["reps"], 10)
    a.step_warmup = pick(a.step_warmup, SMOKE["warmup"], 2)
    a.step_reps = pick(a.step_reps, SMOKE["reps"], 5)
    peers = ("cudnn", "flash") if cuda else ("math", "flash")
    hopper = ("sage8b_hopper",) if cuda and torch.cuda.get_device_capability() == (9, 0) else ()
    a.impls = a.impls.split(",") if a.impls else [x for x in OURS if x != "sage8b_hopper" or hopper] + list(peers)
    a.model_impls = a.model_impls.split(",") if a.model_impls else list(MODEL_OURS + peers)
    a.baseline = a.baseline or peers[0]
    for name in a.impls:
        if name not in OURS + PEERS:
            p.error(f"--impls: unknown implementation {name!r} (allowed: {', '.join(OURS + PEERS)})")
    for name in a.model_impls:
        if name not in MODEL_OURS + PEERS:
            p.error(f"--model-impls: unknown implementation {name!r} (allowed: {', '.join(MODEL_OURS + PEERS)})")
    if a.baseline not in PEERS:
        p.error(f"--baseline must be an SDPA backend ({', '.join(PEERS)}), got {a.baseline!r}")
    for name, vals in (("--seqs", a.seqs), ("--dims", a.dims), ("--llama-seqs", a.llama_seqs),
                       ("--flux-blocks", a.flux_blocks), ("--batch", [a.batch]), ("--heads", [a.heads]),
                       ("--reps", [a.reps]), ("--step-reps", [a.step_reps])):
        if any(v < 1 for v in vals):
            p.error(f"{name} must be >= 1, got {' '.join(map(str, vals))}")
    for name, val in (("--warmup", a.warmup), ("--step-warmup", a.step_warmup)):
        if val < 0:
            p.error(f"{name} must be >= 0, got {val}")
    if a.flux_size % 16:
        p.error(f"--flux-size must be a multiple of 16 (VAE /8, then 2x2 patches), got {a.flux_size}")
    return a


# ---- shared -------------------------------------------------------------------------------------------------------

def guarded(fn, cleanup=None):
    """(fn(), None), or (None, "Type: message") when fn raises (out of memory, a backend that cannot run the shape,
    a kernel that fails): the run goes on and the row records why. The traceback goes to stderr; memory is given
    back once the exception, and the frames it holds, are gone."""
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001  (recorded in the JSON and printed, never hidden)
        first = (str(e).strip().splitlines() or [""])[0]
        err = f"{'OOM' if isinstance(e, torch.cuda.OutOfMemoryError) else type(e).__name__}: {first[:240]}"
        traceback.print_exc(file=sys.stderr)
    if cleanup is not None:
        cleanup()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return None, err


def _version(module: str):
    """The module's version, None where it is not installed (the attention case needs neither library)."""
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def median(xs) -> float:
    return float(statistics.median(xs))


def routed(policy, routing: str):
    """`policy` (a Policy; None: the default one) with options.training_speed_routing as --training-routing says."""
    return dataclasses.replace(policy or Policy(), training_speed_routing=routing == "on")


def sage_training_impl(device, dtype, routing: str = "on") -> dict:
    """What a training call of the public API runs here (inputs that require grad; long enough for any measured
    crossover on a GPU; --training-routing's policy): the implementation the report counted and why, e.g.
    {"impl": "triton-sagebwd"}."""
    n = 16384 if device.type == "cuda" else 256
    x = torch.randn(1, 1, n, 128, device=device, dtype=dtype).requires_grad_()
    before = dict(GLOBAL_STATS.impls), dict(GLOBAL_STATS.fallbacks)
    with torch.enable_grad():
        sage_run_attention(x, x, x, layout="bhsd", precision="8b", policy=routed(None, routing))
    impls = {k: v - before[0].get(k, 0) for k, v in GLOBAL_STATS.impls.items() if v != before[0].get(k, 0)}
    reasons = [k for k, v in GLOBAL_STATS.fallbacks.items() if v != before[1].get(k, 0)]
    return {"impl": next(iter(impls), None), "reason": reasons[0] if reasons else None,
            "probe": f"sage_patch.attention(1 x 1 x {n} x 128, requires_grad)"}


def has_sagebwd_kernel(info: dict) -> bool:
    return info.get("impl") not in (None, "sdpa", TRAINABLE_IMPL)


def write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


# ---- attention ----------------------------------------------------------------------------------------------------

def attention_call(name: str, causal: bool, routing: str = "on"):
    """f(q, k, v) -> out for one implementation, (B, H, N, D); routing: --training-routing (sage_api's policy)."""
    if name in ("sage8b", "sage8b_hopper"):
        key = TRAINING_VARIANTS[name]
        return lambda q, k, v: sagebwd_attention(q, k, v, is_causal=causal, scale=None, attn_mask=None,
                                                 kernel=key if q.is_cuda else False)
    if name == "sage_api":
        policy = routed(None, routing)
        return lambda q, k, v: sage_run_attention(q, k, v, layout="bhsd", is_causal=causal, precision="8b",
                                                  policy=policy)

    def sdpa(q, k, v):
        with forced_sdpa(name):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return sdpa


def attention_inputs(b, h, n, d, dtype, device, seed):
    """q, k, v (requiring grad) and dO: randn, K and V with a per-channel bias of 4 sigma (real attention inputs
    have one; K's does not change the softmax, V's moves the output off zero)."""
    g = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=device, dtype=dtype, generator=g)  # noqa: E731
    q = r(b, h, n, d)
    k = r(b, h, n, d) + 4 * r(d)
    v = r(b, h, n, d) + 4 * r(d)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), r(b, h, n, d)


def peak_mib(fn, device):
    """MiB allocated at the peak of fn() beyond what was allocated before it; None on CPU (no allocator stats)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    res = fn()
    del res
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def measure_attention(call, q, k, v, do, device, warmup, reps) -> dict:
    def fwd_bwd():
        return torch.autograd.grad(call(q, k, v), (q, k, v), do)

    fb = counted_ms(fwd_bwd, warmup, reps, device)
    peak = peak_mib(fwd_bwd, device)   # after the timed calls: one-time autotuning is not the call's memory
    fw = counted_ms(lambda: call(q, k, v), warmup, reps, device)
    out = call(q, k, v)                # the forward of "bwd alone", outside the timed region
    bw = counted_ms(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True), warmup, reps, device)
    return {"fwdbwd_ms": median(fb), "fwd_ms": median(fw), "bwd_ms": median(bw), "peak_mib": peak}


def attention_accuracy(q, k, v, do, causal, impls, routing: str = "on") -> dict:
    """Cosine of out, dq, dk, dv of each implementation to torch SDPA math in float64 (batch 0, first heads)."""
    h = min(q.shape[1], ACC_HEADS)
    part = lambda t: t[:1, :h]  # noqa: E731  (no statistic of any implementation spans heads or batches)
    q64, k64, v64 = (part(t).detach().double().requires_grad_() for t in (q, k, v))
    with forced_sdpa("math"):
        o64 = F.scaled_dot_product_attention(q64, k64, v64, is_causal=causal)
    ref = (o64.detach(),) + torch.autograd.grad(o64, (q64, k64, v64), part(do).double())
    del o64, q64, k64, v64
    res = {"slice": f"batch 0, heads 0-{h - 1}"}
    for name in impls:
        call = attention_call(name, causal, routing)

        def one():
            out = call(q, k, v)
            got = (out.detach(),) + torch.autograd.grad(out, (q, k, v), do)
            return {key: cosine(part(t), r) for key, t, r in zip(("out", "dq", "dk", "dv"), got, ref)}

        m, err = guarded(one)
        res[name] = m if err is None else {"error": err}
    return res


def attention_case(args, n, d, causal, accuracy: bool) -> dict:
    b, h, device = args.batch, args.heads, args.device
    row = {"B": b, "H": h, "N": n, "D": d, "causal": causal, "impls": {}}
    inputs, err = guarded(lambda: attention_inputs(b, h, n, d, args.dtype, device, seed=n + d))
    if err:
        row["error"] = err
        return row
    q, k, v, do = inputs
    for name in args.impls:
        if name == "sage_api":
            GLOBAL_STATS.reset()
        m, err = guarded(lambda: measure_attention(attention_call(name, causal, args.training_routing), q, k, v, do,
                                                   device, args.warmup, args.reps))
        if err:
            row["impls"][name] = {"error": err}
            continue
        for mode, factor in FLOP_FACTOR.items():
            m[f"{mode}_tflops"] = factor * tops(b, h, n, d, causal, m[f"{mode}_ms"])
        if name == "sage_api":   # what the resolver ran for these calls (SDPA below its crossover, else the kernel)
            m["ran"] = dict(GLOBAL_STATS.impls)
        row["impls"][name] = m
    base = row["impls"].get(args.baseline, {})
    for m in row["impls"].values():
        for mode in FLOP_FACTOR:
            if f"{mode}_ms" in m and base.get(f"{mode}_ms"):
                m[f"{mode}_vs_baseline"] = base[f"{mode}_ms"] / m[f"{mode}_ms"]
    if accuracy:
        if n <= ACC_MAX_N:
            row["accuracy"] = attention_accuracy(q, k, v, do, causal, args.impls, args.training_routing)
        else:
            row["accuracy"] = {"skipped": f"N={n} > {ACC_MAX_N}: the float64 reference would not fit"}
    return row


def print_attention_row(row, impls) -> None:
    head = f"D={row['D']:<3} {'causal' if row['causal'] else 'full  '} N={row['N']:<6}"
    if "error" in row:
        print(f"{head} error: {row['error']}", flush=True)
        return
    for name in impls:
        m = row["impls"].get(name, {})
        if "error" in m:
            print(f"{head} {name:<9} {m['error']}", flush=True)
            continue
        ratio = lambda k: f"{m[k]:.2f}x" if m.get(k) else "-"  # noqa: E731
        peak = f"{m['peak_mib']:9.0f} MiB" if m.get("peak_mib") is not None else ""
        print(f"{head} {name:<9} fwd+bwd {m['fwdbwd_ms']:9.3f} ms {m['fwdbwd_tflops']:7.1f} TFLOPS "
              f"{ratio('fwdbwd_vs_baseline'):>6} | "
              + (f"fwd {m['fwd_ms']:8.3f} ms {ratio('fwd_vs_baseline'):>6} | " if "fwd_ms" in m else "")
              + f"bwd {m['bwd_ms']:9.3f} ms {m['bwd_tflops']:7.1f} TFLOPS "
              f"{ratio('bwd_vs_baseline'):>6} | {peak}" + (f"  ran {m['ran']}" if m.get("ran") else ""), flush=True)
    for name, c in (row.get("accuracy") or {}).items():
        if isinstance(c, dict):
            print(f"{head} {name:<9} cos " + (", ".join(f"{k} {v:.6f}" for k, v in c.items())
                                             if "error" not in c else c["error"]), flush=True)


def run_attention(args, result, save) -> None:
    print(f"attention: B={args.batch} H={args.heads} {str(args.dtype)[6:]}, impls {args.impls}, ratios vs "
          f"{args.baseline}", flush=True)
    for d in args.dims:
        for causal in (False, True):
            for i, n in enumerate(args.seqs):
                row = attention_case(args, n, d, causal, accuracy=i == 0)
                if args.device.type == "cuda":
                    torch.cuda.empty_cache()   # the case's inputs are gone with its frame
                result["attention"].append(row)
                print_attention_row(row, args.impls)
                save()


# ---- training steps -----------------------------------------------------------------------------------------------

@contextlib.contextmanager
def llama_attention(model, impl, routing: str = "on"):
    """The model's attention for `impl`; yields a function giving the report's implementation counts (sage, under
    the model family's policy with --training-routing's options.training_speed_routing)."""
    model.set_attn_implementation("sage" if impl == "sage" else "sdpa")
    if impl == "sage":
        sage_patch.set_policy(model, routed(family_policy(model), routing))
        reset_stats(model)
        yield lambda: impl_counts(model)
    else:
        with forced_sdpa(impl):
            yield None


@contextlib.contextmanager
def flux_attention(model, impl, routing: str = "on"):
    if impl == "sage":
        sage_patch.inject(model, routed(family_policy(model), routing))   # shipped flux policy
        try:
            reset_stats(model)
            yield lambda: impl_counts(model)
        finally:
            sage_patch.unload(model)
    else:
        with forced_sdpa(impl):
            yield None


def set_llama_ckpt(model, on: bool) -> None:
    # transformers >= 5.24 names it activation checkpointing (the gradient_checkpointing_* names are deprecated)
    new = hasattr(model, "activation_checkpointing_enable")
    if on:
        kw = {"use_reentrant": False}
        (model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw) if new
         else model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw))
    else:
        (model.activation_checkpointing_disable if new else model.gradient_checkpointing_disable)()


def set_flux_ckpt(model, on: bool) -> None:
    (model.enable_gradient_checkpointing if on else model.disable_gradient_checkpointing)()


def make_optimizer(model, kind: str):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=LR) if kind == "adamw" else torch.optim.SGD(params, lr=LR)


def probe(model, loss_fn, param):
    """Loss and the gradient of `param` of one forward + backward (no optimizer step: the weights stay)."""
    loss = loss_fn()
    loss.backward()
    grad = param.grad.detach().float().clone()
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grad


def timed_steps(model, opt, loss_fn, device, warmup, reps) -> dict:
    losses = []

    def step():
        loss = loss_fn()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    timer = Timer(device)
    timer(step, warmup, 0)                     # warm-up; AdamW allocates its state at the first step
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = timer(step, 0, reps)
    res = {"step_ms": median(times), "step_ms_all": [round(t, 3) for t in times],
           "losses": [float(x) for x in losses[-reps:]]}
    if device.type == "cuda":
        res["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return res


def model_rows(model, opt, loss_fn, probe_param, attention, set_ckpt, tokens, args) -> list:
    """Rows of one model at one length: every implementation, without gradient checkpointing and (--grad-ckpt auto,
    after an out-of-memory, or on) with it."""
    def cleanup():
        model.zero_grad(set_to_none=True)

    modes = {"off": [False], "on": [True], "auto": [False, True]}[args.grad_ckpt]
    rows: list = []
    for ckpt in modes:
        if ckpt and args.grad_ckpt == "auto" and not any(r.get("error", "").startswith("OOM") for r in rows):
            break
        set_ckpt(model, ckpt)
        probes = {}   # impl -> ((loss, grad), None) or (None, error)
        for impl in args.model_impls:   # all at the same weights: no optimizer step in between
            with attention(model, impl, args.training_routing):
                probes[impl] = guarded(lambda: probe(model, loss_fn, probe_param), cleanup)
        base_probe = probes.get(args.baseline, (None, None))[0]
        for impl in args.model_impls:
            row = {"tokens": tokens, "impl": impl, "grad_ckpt": ckpt, "optimizer": args.optim}
            got, err = probes[impl]
            if err:
                row["error"] = err
                rows.append(row)
                continue
            row["probe_loss"] = got[0]
            if base_probe is not None:
                row["probe_grad_cos_vs_baseline"] = cosine(got[1], base_probe[1])
            with attention(model, impl, args.training_routing) as ran:
                res, err = guarded(lambda: timed_steps(model, opt, loss_fn, args.device, args.step_warmup,
                                                       args.step_reps), cleanup)
                if ran is not None:
                    row["ran"] = ran()
            if err:
                row["error"] = err
            else:
                row.update(res)
                row["tokens_per_s"] = tokens / (res["step_ms"] * 1e-3)
            rows.append(row)
        del probes, base_probe
        base = next((r for r in rows if r["impl"] == args.baseline and r["grad_ckpt"] == ckpt and "step_ms" in r),
                    None)
        for r in rows:
            if base and r["grad_ckpt"] == ckpt and "step_ms" in r:
                r["vs_baseline"] = base["step_ms"] / r["step_ms"]
    set_ckpt(model, False)
    return rows


def print_model_row(label, r) -> None:
    head = f"{label} tokens={r['tokens']:<6} {r['impl']:<6} ckpt={'on ' if r['grad_ckpt'] else 'off'}"
    if "error" in r:
        print(f"{head} {r['error']}", flush=True)
        return
    peak = f"{r['peak_gib']:6.1f} GiB" if "peak_gib" in r else ""
    print(f"{head} step {r['step_ms']:10.2f} ms {r['tokens_per_s']:9.0f} tok/s "
          f"{(str(round(r['vs_baseline'], 3)) + 'x') if r.get('vs_baseline') else '-':>7} {peak} "
          f"loss {r['probe_loss']:.4f} grad cos {r.get('probe_grad_cos_vs_baseline', float('nan')):.6f}"
          + (f"  ran {r['ran']}" if r.get("ran") else ""), flush=True)


def run_llama(args, result, save) -> None:
    from transformers import LlamaForCausalLM

    cfg = llama_config(args.smoke, arch=LLAMA32_1B, rope=LLAMA32_ROPE)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM._from_config(cfg, attn_implementation="sage", dtype=args.dtype)
    model.train()
    opt = make_optimizer(model, args.optim)
    nparams = sum(p.numel() for p in model.parameters())
    result["meta"]["llama"] = {
        "model": ("tiny Llama (smoke)" if args.smoke else "Llama-3.2-1B architecture (config.json values)")
        + f", random {str(args.dtype)[6:]} weights, {nparams / 1e6:.1f}M parameters",
        "batch": 1, "loss": "the model's own (labels = input ids)", "optimizer": args.optim, "lr": LR,
        "grad_ckpt": args.grad_ckpt, "warmup": args.step_warmup, "reps": args.step_reps,
        "probe_param": "model.layers.0.self_attn.q_proj.weight"}
    param = model.model.layers[0].self_attn.q_proj.weight
    for seq in args.llama_seqs:
        ids = torch.randint(0, cfg.vocab_size, (1, seq), device=args.device,
                            generator=torch.Generator(args.device).manual_seed(seq))
        loss_fn = lambda: model(input_ids=ids, labels=ids, use_cache=False).loss  # noqa: E731
        for r in model_rows(model, opt, loss_fn, param, llama_attention, set_llama_ckpt, seq, args):
            result["llama"].append(r)
            print_model_row("llama", r)
        save()


def run_flux(args, result, save) -> None:
    from bench_diffusers import build

    nd, ns = args.flux_blocks
    model, inputs, tokens = build("flux", args.flux_size, args.flux_size, None, args.device, args.dtype,
                                  tiny=args.smoke, seed=0, overrides={"num_layers": nd, "num_single_layers": ns})
    model.train().requires_grad_(True)
    opt = make_optimizer(model, args.optim)
    target = torch.randn(inputs["hidden_states"].shape, device=args.device, dtype=args.dtype,
                         generator=torch.Generator(args.device).manual_seed(1))
    n_img = inputs["hidden_states"].shape[1]
    result["meta"]["flux"] = {
        "model": (f"tiny Flux (smoke), {nd} double + {ns} single blocks" if args.smoke else
                  f"FluxTransformer2DModel, FLUX.1-dev config with {nd} double + {ns} single blocks (of 19 + 38)")
        + f", random {str(args.dtype)[6:]} weights, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
          "parameters",
        "tokens": f"{n_img} image + {tokens - n_img} text ({args.flux_size}x{args.flux_size} pixels)",
        "batch": 1, "loss": "MSE of the output to a random target", "optimizer": args.optim, "lr": LR,
        "grad_ckpt": args.grad_ckpt, "warmup": args.step_warmup, "reps": args.step_reps,
        "probe_param": "transformer_blocks.0.attn.to_q.weight"}

    def loss_fn():
        return F.mse_loss(model(**inputs)[0].float(), target.float())

    param = model.transformer_blocks[0].attn.to_q.weight
    for r in model_rows(model, opt, loss_fn, param, flux_attention, set_flux_ckpt, tokens, args):
        result["flux"].append(r)
        print_model_row("flux", r)
    save()


# ---- main ---------------------------------------------------------------------------------------------------------

def main(argv=None) -> dict:
    args = parse_args(argv)
    device = args.device
    trainable = sage_training_impl(device, args.dtype, args.training_routing)
    wants_sage = ("attention" in args.cases and any(i in OURS for i in args.impls)) or (
        {"llama", "flux"} & set(args.cases) and "sage" in args.model_impls)
    if device.type == "cuda" and wants_sage and not has_sagebwd_kernel(trainable) and not args.allow_reference:
        sys.exit(f"training calls would not run a SageBwd kernel here ({trainable['impl']}: {trainable['reason']}); "
                 "timing sage would time that. Pass --allow-reference to time it anyway, or leave sage out "
                 "(--impls cudnn,flash --model-impls cudnn,flash)")
    meta = run_meta(
        device=torch.cuda.get_device_name() if device.type == "cuda" else "CPU",
        transformers=_version("transformers"), diffusers=_version("diffusers"),
        sage_patch=sage_patch.__version__, dtype=str(args.dtype)[6:], smoke=args.smoke, baseline=args.baseline,
        trainable=trainable, cases=args.cases, training_routing=args.training_routing)
    if argv is not None:   # called, not run: the command line is the arguments given, not the caller's sys.argv
        meta["command"] = " ".join(["benchmarks/bench_training.py"] + list(argv))
    if "attention" in args.cases:
        meta["attention"] = {
            "impls": args.impls, "B": args.batch, "H": args.heads, "dims": args.dims, "seqs": args.seqs,
            "warmup": args.warmup, "reps": args.reps,
            "timing": ("timing.counted_ms: CUDA events per call, L2 flushed before each, median of reps after "
                       "warmup" if device.type == "cuda" else "perf_counter per call, median of reps after warmup"),
            "tflops": "forward 4*B*H*N*N*D (halved when causal); backward 2.5x, forward + backward 3.5x",
            "peak_memory": "max allocated during one forward + backward minus what was allocated before (q, k, v, dO)",
            "accuracy": f"cosine to torch SDPA math in float64 at the first N of each D and causal (N <= {ACC_MAX_N})"}
    result = {"kind": "training", "meta": meta, "attention": [], "llama": [], "flux": []}
    t0 = time.time()

    def save():
        meta["seconds"] = round(time.time() - t0, 1)
        write_json(args.out, result)

    print(f"training benchmark on {meta['device']}: training calls run {trainable['impl']}"
          + (f" ({trainable['reason']})" if trainable["reason"] else ""), flush=True)
    for case, fn in (("attention", run_attention), ("llama", run_llama), ("flux", run_flux)):
        if case in args.cases:
            fn(args, result, save)
            gc.collect()   # the case's model and optimizer are gone with its frame
            if device.type == "cuda":
                torch.cuda.empty_cache()
    save()
    try:
        import report

        print("\n".join(report.render_training(result)))
    except Exception as e:  # noqa: BLE001  (the JSON is written; the table is a convenience)
        print(f"no table: {type(e).__name__}: {e}", file=sys.stderr)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""LoRA fine-tuning of SmolLM2-135M-Instruct (real weights) with full-precision attention and with the trainable 8b
(SageBwd): do the loss curves stay within the run-to-run spread of full attention?

    python benchmarks/finetune_smollm2.py --steps 300 --seq 256 --batch 1 --out docs/data/finetune_smollm2_cpu.json \
        --png docs/img/finetune_smollm2_cpu.png      # the committed evidence: ~15 min on 2 idle cores
    python benchmarks/finetune_smollm2.py --runs sage --merge --out docs/data/finetune_smollm2_cpu.json \
        --png docs/img/finetune_smollm2_cpu.png      # SageBwd's numerics changed: retrain the sage run only
    python benchmarks/finetune_smollm2.py --tiny --steps 2 --out /tmp/ft_tiny.json     # smoke test, random tiny Llama
    python benchmarks/finetune_smollm2.py --device cuda --runs full full1 sage sage1 \
        --out docs/data/h200_finetune_smollm2.json    # on a GPU: the SageBwd kernels (DEVELOPERS.md: the GGUF there)

Runs of the same base model, LoRA (peft) on q_proj, k_proj, v_proj, o_proj, AdamW, float32 weights:
- full, seed s0 and full1, seed s1: attn_implementation="sdpa" (torch SDPA, no sage_patch in the path);
- sage, seed s0 (and sage1, seed s1): attn_implementation="sage"; every training call (a gradient is needed) runs
  the trainable 8b. On CPU that is the reference simulation of SageBwd (impl "reference-sagebwd") under the model's
  default policy; on CUDA (--device cuda: bf16 autocast for every run, the attention's inputs bf16) the SageBwd
  kernels, at every length (CUDA_POLICY: the speed routing that would send slower-than-SDPA lengths to SDPA is
  off). The script fails if any training call of a sage run ran something else (checked from the report).
The seed sets the LoRA initialization and the order of the training windows: full s0 and sage s0 see the same
batches in the same order from the same initial weights, full s1 differs in both (the run-to-run spread).

Data: the prose of Python's pydoc_data/topics.py (sage_patch.demo.stdlib_text), tokenized whole and cut into
non-overlapping --seq windows; the last --heldout windows are held out (perplexity before and after training, with
torch SDPA for every run so the weights are compared, and for the sage run also with its own inference attention);
training batches are drawn from the rest, a fresh permutation per pass over it.

Writes --out (JSON: meta, per-step losses, perplexities, wall times, the spread statistics) and a PNG of the loss
curves next to it (or --png). --merge trains --runs only and keeps the other runs of the JSON --out holds (full
attention does not depend on SageBwd's numerics), each stamped with the date and command that made it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import textwrap
import time

import torch

from sage_patch.reference.sagebwd import DEFAULT_SAGEBWD_CONFIG

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_transformers import impl_counts, reset_stats  # noqa: E402  (summed over a model's report)
from timing import run_meta  # noqa: E402

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
# run name: (attention implementation, index of its seed in --seeds)
PLAN = {"full": ("sdpa", 0), "full1": ("sdpa", 1), "sage": ("sage", 0), "sage1": ("sage", 1)}
TRAIN_IMPL = "reference-sagebwd"  # what every training call of the sage run must report on CPU
# The sage runs' policy on CUDA: the trainable 8b's kernels for every training call (inference calls: 8b, the
# shipped policy's min_seq_len), whatever their measured speed against SDPA
CUDA_POLICY = {"name": "finetune-sagebwd-kernels", "default": "8b", "training": "8b",
               "fallback": {"min_seq_len": 128}, "options": {"training_speed_routing": False}}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    p.add_argument("--seq", type=int, default=256, help="tokens per training window (>= 128: the default policy "
                                                       "runs shorter calls in full precision)")
    p.add_argument("--batch", type=int, default=1, help="windows per step")
    p.add_argument("--lr", type=float, default=2e-4, help="AdamW learning rate (constant)")
    p.add_argument("--seeds", type=int, nargs=2, default=(0, 1), metavar=("S0", "S1"),
                   help="full attention runs both seeds, sage runs S0")
    p.add_argument("--lora-r", type=int, default=8, help="LoRA rank (alpha = 2r, no dropout)")
    p.add_argument("--heldout", type=int, default=8, help="held-out windows of --seq tokens from the text's end")
    p.add_argument("--runs", nargs="+", default=("full", "full1", "sage"), choices=PLAN,
                   help="which runs (full = full attention seed S0, full1 = seed S1, sage = SageBwd seed S0, "
                        "sage1 = SageBwd seed S1)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cpu: float32, SageBwd's reference simulation; cuda: bf16 autocast, the SageBwd kernels")
    p.add_argument("--tiny", action="store_true", help="a random tiny Llama on the text's bytes (smoke test)")
    p.add_argument("--out", required=True, help="JSON to write")
    p.add_argument("--png", default=None, help="loss-curve PNG (default: --out with .png)")
    p.add_argument("--merge", action="store_true",
                   help="keep the runs of the JSON --out holds that are not in --runs (same settings required)")
    p.add_argument("--replot", action="store_true",
                   help="no training: recompute the statistics and draw the PNG from the JSON --out holds")
    a = p.parse_args(argv)
    for name in ("steps", "batch", "lora_r", "heldout"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.seq < 2:
        p.error(f"--seq must be >= 2 (a window predicts seq - 1 tokens), got {a.seq}")
    if a.lr <= 0:
        p.error(f"--lr must be > 0, got {a.lr}")
    if a.seeds[0] == a.seeds[1]:
        p.error(f"--seeds must be two different seeds (the run-to-run spread), got {a.seeds[0]} twice")
    if a.merge and a.replot:
        p.error("--merge trains runs, --replot trains none: give one of them")
    return a


# ---- statistics (pure) ---------------------------------------------------------------------------------------------

def mean_abs_diff(a, b, start: int = 0) -> float:
    """Mean |a[i] - b[i]| over steps i >= start."""
    if len(a) != len(b):
        raise ValueError(f"curves of different lengths: {len(a)} and {len(b)}")
    if not 0 <= start < len(a):
        raise ValueError(f"start {start} outside curves of {len(a)} steps")
    return sum(abs(x - y) for x, y in zip(a[start:], b[start:])) / (len(a) - start)


def smooth(curve, window: int) -> list[float]:
    """Trailing moving average (the first window-1 points average what exists so far)."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    out, acc = [], 0.0
    for i, x in enumerate(curve):
        acc += x
        if i >= window:
            acc -= curve[i - window]
        out.append(acc / min(i + 1, window))
    return out


def loss_spread(candidate, full_s0, full_s1, skip_frac: float = 0.1) -> dict:
    """Distance of a candidate loss curve to full attention's (same seed) against full attention's run-to-run
    spread (other seed), overall and after the first skip_frac of the steps, on the raw and the smoothed curves.
    within_spread: the candidate's mean distance is no larger than the spread's, on the raw curves, both ranges."""
    n = len(full_s0)
    start = min(math.ceil(skip_frac * n), n - 1)
    w = max(1, n // 20)
    sm = {k: smooth(c, w) for k, c in (("c", candidate), ("f0", full_s0), ("f1", full_s1))}
    d = {"steps": n, "after_step": start, "smooth_window": w,
         "candidate_vs_full_s0": mean_abs_diff(candidate, full_s0),
         "full_s1_vs_full_s0": mean_abs_diff(full_s1, full_s0),
         "candidate_vs_full_s0_after": mean_abs_diff(candidate, full_s0, start),
         "full_s1_vs_full_s0_after": mean_abs_diff(full_s1, full_s0, start),
         "smoothed_candidate_vs_full_s0": mean_abs_diff(sm["c"], sm["f0"]),
         "smoothed_full_s1_vs_full_s0": mean_abs_diff(sm["f1"], sm["f0"])}
    d["ratio"] = d["candidate_vs_full_s0"] / d["full_s1_vs_full_s0"] if d["full_s1_vs_full_s0"] else math.inf
    d["ratio_after"] = (d["candidate_vs_full_s0_after"] / d["full_s1_vs_full_s0_after"]
                        if d["full_s1_vs_full_s0_after"] else math.inf)
    d["within_spread"] = d["ratio"] <= 1.0 and d["ratio_after"] <= 1.0
    return d


def batch_order(n_windows: int, steps: int, batch: int, seed: int) -> list[list[int]]:
    """Window indices of each step: consecutive slices of fresh seeded permutations (a pass over the training
    windows, then the next); a batch never holds a window twice."""
    if batch > n_windows:
        raise ValueError(f"batch {batch} > {n_windows} training windows")
    g = torch.Generator().manual_seed(seed)
    order, pool = [], []
    for _ in range(steps):
        if len(pool) < batch:
            pool = torch.randperm(n_windows, generator=g).tolist()
        order.append(pool[:batch])
        pool = pool[batch:]
    return order


# ---- model and data ------------------------------------------------------------------------------------------------

class ByteTokenizer:
    """The text's UTF-8 bytes as token ids (vocabulary 256), for the tiny random model."""

    class _Encoded:
        def __init__(self, ids):
            self.input_ids = ids

    def __call__(self, text, return_tensors="pt"):
        return self._Encoded(torch.tensor([list(text.encode())], dtype=torch.long))


def tiny_llama(attn_implementation: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)  # the same base weights for every run
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False)
    return LlamaForCausalLM._from_config(cfg, attn_implementation=attn_implementation, dtype=torch.float32)


def compute(device: str):
    """The context every forward runs in: on CUDA bf16 autocast (the weights stay float32, the attention's inputs
    are bf16, as the SageBwd kernels and cuDNN's SDPA take them), on CPU float32."""
    if device == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    import contextlib

    return contextlib.nullcontext()


def load_base(tiny: bool, attn_implementation: str, device: str = "cpu"):
    """(model, tokenizer, model description) for one run: a fresh copy of the base weights."""
    if tiny:
        model, tok, what = tiny_llama(attn_implementation), ByteTokenizer(), "tiny random Llama (2 layers, GQA 4:2, D 32)"
    else:
        from sage_patch.demo import REAL_MODEL, load_smollm2

        (model, tok), what = load_smollm2(attn_implementation), REAL_MODEL
    return model.to(device), tok, what


def split_windows(tok, seq: int, heldout: int, text: str):
    """(training windows, held-out windows) of seq tokens: the held-out ones are the text's last windows, the
    training ones are all the windows before them."""
    from sage_patch.demo import text_windows

    total = tok(text, return_tensors="pt").input_ids.shape[1]
    n_train = total // seq - heldout
    if n_train < 1:
        raise ValueError(f"the text has {total} tokens: no training window of {seq} left after {heldout} held out")
    return text_windows(tok, n_train, seq, text=text), text_windows(tok, heldout, seq, from_end=True, text=text)


def add_lora(model, r: int, seed: int):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)  # lora_A's initialization (lora_B starts at zero)
    cfg = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=list(LORA_TARGETS), bias="none",
                     task_type="CAUSAL_LM")
    return get_peft_model(model, cfg)


def held_out_ppl(model, windows, device: str, policy=None, train_policy=None) -> float:
    """Perplexity on the held-out windows; policy: for a sage model, the policy to evaluate under (train_policy,
    what the sage run trains with (None: the model's default policy), is set again after)."""
    from sage_patch.calibrate import perplexity

    was_training = model.training
    model.eval()
    try:
        with compute(device):
            if policy is None:
                return perplexity(model, windows)
            import sage_patch

            sage_patch.set_policy(model, policy)
            try:
                return perplexity(model, windows)
            finally:
                sage_patch.set_policy(model, train_policy)
    finally:
        model.train(was_training)


def training_impls_ok(impls: dict, device: str) -> bool:
    """Whether every training call of a sage run ran the trainable 8b: its reference simulation on CPU, a SageBwd
    kernel (a training variant of the registry) on CUDA."""
    from sage_patch.kernels import registry

    wanted = {TRAIN_IMPL} if device == "cpu" else {v.name for v in registry.VARIANTS if v.trains}
    return bool(impls) and set(impls) <= wanted


def train_run(name: str, attn: str, seed: int, args, text: str, log=print) -> dict:
    dev = args.device
    model, tok, what = load_base(args.tiny, attn, dev)
    train, held = split_windows(tok, args.seq, args.heldout, text)
    is_sage = attn == "sage"
    train_policy = CUDA_POLICY if is_sage and dev == "cuda" else None
    ppl_before = held_out_ppl(model, held, dev, "full" if is_sage else None, train_policy)
    model = add_lora(model, args.lora_r, seed)
    if train_policy is not None:
        import sage_patch

        sage_patch.set_policy(model, train_policy)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr)
    order = batch_order(len(train), args.steps, args.batch, seed)
    if is_sage:
        reset_stats(model)
    model.train()
    losses, t0 = [], time.perf_counter()
    for step, idx in enumerate(order):
        ids = torch.cat([train[i] for i in idx]).to(dev)
        with compute(dev):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if step == 0 or (step + 1) % max(1, args.steps // 20) == 0 or step + 1 == args.steps:
            el = time.perf_counter() - t0
            log(f"[{name}] step {step + 1}/{args.steps} loss {losses[-1]:.4f}  {el:.0f} s "
                f"({el / (step + 1):.2f} s/step)")
    train_s = time.perf_counter() - t0
    run = {"name": name, "attn_implementation": attn, "seed": seed, "model": what, "losses": losses,
           "train_windows": len(train), "heldout_windows": len(held), "train_s": train_s,
           "s_per_step": train_s / args.steps, "ppl_before": ppl_before}
    if is_sage:
        run["training_impls"] = impl_counts(model)
        if not training_impls_ok(run["training_impls"], dev):
            raise RuntimeError(f"the sage run's training calls ran {run['training_impls']}, not only the trainable "
                               f"8b ({'its reference simulation' if dev == 'cpu' else 'its kernels'})")
        run["ppl_after"] = held_out_ppl(model, held, dev, "full", train_policy)
        reset_stats(model)
        run["ppl_after_own_attention"] = held_out_ppl(model, held, dev)  # its policy, inference 8b (no grad)
        run["own_attention_impls"] = impl_counts(model)
    else:
        run["ppl_after"] = held_out_ppl(model, held, dev)
    run["wall_s"] = time.perf_counter() - t0
    log(f"[{name}] held-out perplexity {ppl_before:.3f} -> {run['ppl_after']:.3f}; training {train_s:.0f} s")
    return run


# ---- plot ----------------------------------------------------------------------------------------------------------

def plot(result: dict, path: str) -> None:
    """Loss curves (per step and smoothed); their difference to full attention seed S0 for the other seed and for
    SageBwd; SageBwd's difference alone at its own scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {r["name"]: r for r in result["runs"]}
    n = len(next(iter(runs.values()))["losses"])
    w = max(1, n // 20)
    steps = list(range(1, n + 1))
    # (color, line style, width, label): SageBwd dashed over full seed S0, which it would otherwise hide
    style = {"full": ("C0", "-", 2.6, "full attention, seed {seed}"),
             "full1": ("C2", "-", 1.6, "full attention, seed {seed}"),
             "sage": ("C3", "--", 1.6, "SageBwd 8b ({how}), seed {seed}"),
             "sage1": ("C1", "--", 1.6, "SageBwd 8b ({how}), seed {seed}")}
    how = "CPU reference simulation" if result["meta"]["args"].get("device", "cpu") == "cpu" else "GPU kernels"
    fig, axes = plt.subplots(1, 3, figsize=(19, 5))
    ax = axes[0]
    for name, r in runs.items():
        color, ls, lw, label = style[name]
        ax.plot(steps, r["losses"], color=color, alpha=0.2, lw=0.7)
        ax.plot(steps, smooth(r["losses"], w), color=color, ls=ls, lw=lw, label=label.format(seed=r["seed"], how=how))
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss (thin: per step, thick: moving average of {w})")
    ax.set_title("LoRA fine-tuning, " + result["meta"]["model"].split(" (")[0])
    ax.legend(fontsize=8)
    if "full" in runs:
        ref, s0 = runs["full"]["losses"], runs["full"]["seed"]
        diffs = {name: [x - y for x, y in zip(runs[name]["losses"], ref)] for name in ("full1", "sage", "sage1")
                 if name in runs}
        for ax, names, title in ((axes[1], ("full1", "sage", "sage1"), f"difference to full attention seed {s0}"),
                                 (axes[2], ("sage",), f"SageBwd - full seed {s0} (same init, same batches), zoomed")):
            for name in names:
                if name in diffs:
                    color, _, _, label = style[name]
                    ax.plot(steps, diffs[name], color=color, alpha=0.3, lw=0.8)
                    ax.plot(steps, smooth(diffs[name], w), color=color, lw=1.6,
                            label=label.format(seed=runs[name]["seed"], how=how))
            ax.axhline(0, color="k", lw=0.6)
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.set_ylabel(f"loss - loss(full, seed {s0})")
            ax.legend(fontsize=8)
    else:
        axes[1].set_visible(False)
        axes[2].set_visible(False)
    fig.text(0.01, 0.01, textwrap.fill(result["meta"]["what_ran"], 250), fontsize=7, color="0.35")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- merge --------------------------------------------------------------------------------------------------------

# What must be equal for runs of two invocations to share a JSON: the training settings and the software (the text
# and base weights are compared through what every run measures before training: check_same_start)
MERGE_ARGS = ("steps", "seq", "batch", "lr", "seeds", "lora_r", "heldout", "tiny", "device")
MERGE_META = ("torch", "transformers", "peft")


def kept_runs(path: str, args, meta_now: dict) -> list[dict]:
    """The runs of the JSON at path that a --merge invocation keeps (those not in args.runs), each stamped with the
    date and command that made it. Raises SystemExit naming what differs when the file was made with other training
    settings (MERGE_ARGS) or other software (MERGE_META, compared with meta_now)."""
    if not os.path.exists(path):
        raise SystemExit(f"--merge: no JSON at --out {path} to keep runs from")
    with open(path) as f:
        old = json.load(f)
    theirs, ours = old["meta"]["args"], vars(args)
    norm = (lambda v: list(v) if isinstance(v, (list, tuple)) else v)
    differ = [f"--{k.replace('_', '-')} {norm(theirs.get(k))} there, {norm(ours[k])} here" for k in MERGE_ARGS
              if norm(theirs.get(k)) != norm(ours[k])]
    differ += [f"{k} {old['meta'].get(k)!r} there, {meta_now[k]!r} here" for k in MERGE_META
               if old["meta"].get(k) != meta_now[k]]
    if differ:
        raise SystemExit(f"--merge: the runs of {path} were made otherwise ({'; '.join(differ)}): run all of them "
                         f"without --merge")
    kept = [r for r in old["runs"] if r["name"] not in args.runs]
    for r in kept:  # a run stamped by an earlier merge keeps its own stamp
        r.setdefault("date", old["meta"]["date"])
        r.setdefault("command", old["meta"]["command"])
    return kept


def check_same_start(kept: list[dict], runs: list[dict]) -> None:
    """Raises SystemExit unless the new runs started where the kept ones did: the same windows of the text and the
    same held-out perplexity of the base model (torch SDPA for every run)."""
    for old in kept:
        for new in runs:
            for k in ("train_windows", "heldout_windows"):
                if old[k] != new[k]:
                    raise SystemExit(f"--merge: {k} {old[k]} in run {old['name']}, {new[k]} in run {new['name']}: "
                                     f"another text or tokenizer; run all of them without --merge")
            if not math.isclose(old["ppl_before"], new["ppl_before"], rel_tol=1e-6):
                raise SystemExit(f"--merge: base model's held-out perplexity {old['ppl_before']} in run {old['name']}, "
                                 f"{new['ppl_before']} in run {new['name']}: other base weights or text; run all of "
                                 f"them without --merge")


# ---- main ----------------------------------------------------------------------------------------------------------

def summarize(result: dict) -> None:
    """Add the spread statistics of the loss curves to result (a pure function of its runs) and print them."""
    runs = {r["name"]: r for r in result["runs"]}
    if not {"full", "full1"} <= set(runs):
        return
    # each sage run against the full run of its own seed, the other full run giving the run-to-run spread
    for sage, same, other in (("sage", "full", "full1"), ("sage1", "full1", "full")):
        if sage not in runs:
            continue
        sp = loss_spread(runs[sage]["losses"], runs[same]["losses"], runs[other]["losses"])
        s_same, s_other = runs[same]["seed"], runs[other]["seed"]
        sp["note"] = (f"full seed {s_other} differs from full seed {s_same} in LoRA initialization and batch order; "
                      f"{sage} seed {runs[sage]['seed']} shares both with full seed {s_same}")
        ppl_spread = abs(runs["full1"]["ppl_after"] - runs["full"]["ppl_after"])
        sp["ppl_vs_same_seed_full"] = runs[sage]["ppl_after"] - runs[same]["ppl_after"]
        sp["ppl_within_seeds_spread"] = abs(sp["ppl_vs_same_seed_full"]) <= ppl_spread
        result["spread" if sage == "sage" else "spread_" + sage] = sp
        print(f"mean |{sage} - full s{s_same}| {sp['candidate_vs_full_s0']:.4f} vs mean |full s{s_other} - full "
              f"s{s_same}| {sp['full_s1_vs_full_s0']:.4f} (ratio {sp['ratio']:.3f}); after step {sp['after_step']}: "
              f"{sp['candidate_vs_full_s0_after']:.4f} vs {sp['full_s1_vs_full_s0_after']:.4f} "
              f"(ratio {sp['ratio_after']:.3f}); within the spread: {sp['within_spread']}; held-out perplexity "
              f"{sp['ppl_vs_same_seed_full']:+.4f} vs the same seed's full (seeds' spread {ppl_spread:.4f})")
    for name, r in runs.items():
        own = f", {r['ppl_after_own_attention']:.3f} with its own attention" if "ppl_after_own_attention" in r else ""
        print(f"{name:6s} seed {r['seed']}: final loss {r['losses'][-1]:.4f}, held-out perplexity "
              f"{r['ppl_before']:.3f} -> {r['ppl_after']:.3f}{own}; {r['s_per_step']:.2f} s/step, "
              f"{r['wall_s']:.0f} s")


def write(result: dict, out: str, png: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    plot(result, png)
    print(f"wrote {out} and {png}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    png = args.png or os.path.splitext(args.out)[0] + ".png"
    if args.replot:
        with open(args.out) as f:
            result = json.load(f)
        summarize(result)
        write(result, args.out, png)
        return result
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible to torch")
    import peft
    import transformers

    import sage_patch  # noqa: F401  registers attn_implementation="sage"
    from sage_patch.demo import stdlib_text

    text, source = stdlib_text()
    text_what = source if not args.tiny else f"UTF-8 bytes of {source}"
    software = {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__}
    kept = kept_runs(args.out, args, software) if args.merge else []  # before training: fail fast
    command = " ".join(["benchmarks/finetune_smollm2.py", *(sys.argv[1:] if argv is None else argv)])
    runs, result = [], None
    for name in args.runs:
        attn, which = PLAN[name]
        runs.append(train_run(name, attn, args.seeds[which], args, text))
        # written after every run: a run cut short (a time limit) keeps the finished ones, which a later
        # `--runs <the others> --merge` completes
        result = assemble(args, runs, kept, command, text_what, png, transformers.__version__, peft.__version__)
        write(result, args.out, png)
    summarize(result)
    write(result, args.out, png)
    return result


def assemble(args, runs, kept, command, text_what, png, transformers_version, peft_version) -> dict:
    """The JSON of the runs trained so far (and those --merge keeps)."""
    if args.device == "cpu":
        what = ("CPU, float32. full: attn_implementation='sdpa' (torch SDPA). sage: attn_implementation='sage', "
                "default policy; training calls run the trainable 8b = the reference simulation of SageBwd on CPU "
                f"(impl {TRAIN_IMPL}) with the numerics {DEFAULT_SAGEBWD_CONFIG}.")
        machine = f"CPU ({os.cpu_count()} cores)"
    else:
        impls = sorted({k for r in runs for k in r.get("training_impls", {})})
        what = ("CUDA, float32 weights, bf16 autocast. full: attn_implementation='sdpa' (torch SDPA). sage: "
                f"attn_implementation='sage', policy {CUDA_POLICY}; training calls ran the SageBwd kernels "
                f"{impls} with the numerics {DEFAULT_SAGEBWD_CONFIG}.")
        machine = torch.cuda.get_device_name()
    what += (f" LoRA r={args.lora_r} on {','.join(LORA_TARGETS)}, AdamW lr={args.lr}, {args.steps} steps x "
             f"{args.batch} x {args.seq} tokens")
    meta = run_meta(command=command, machine=machine, torch_threads=torch.get_num_threads(),
                    transformers=transformers_version, peft=peft_version, model=runs[0]["model"],
                    text=text_what, what_ran=what,
                    args={k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()})
    runs = list(runs)
    if args.merge:
        check_same_start(kept, runs)
        for r in runs:
            r.update(date=meta["date"], command=command)
        runs = sorted(kept + runs, key=lambda r: list(PLAN).index(r["name"]))
    meta["png"] = png
    return {"kind": "finetune", "meta": meta, "runs": runs}   # "kind": benchmarks/report.py renders it


if __name__ == "__main__":
    main()

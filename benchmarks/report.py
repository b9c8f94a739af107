#!/usr/bin/env python3
"""Render docs/benchmarks.md from the benchmark JSON in docs/data/: one section per GPU (kernel table with its peers,
then sustained-load and end-to-end tables where measured), each with date, command and peers of the run.

    python benchmarks/report.py                      # rewrite docs/benchmarks.md from docs/data/*.json
    python benchmarks/report.py --check              # exit 1 if docs/benchmarks.md is not what the data renders
    cp out/bench/bench.json docs/data/h200_kernel.json && python benchmarks/report.py   # after a new run

Input kinds (recognised by their keys):
- kernel: `benchmarks/bench_kernel.py`'s bench.json ({meta, rows, accuracy}); rows hold TOPS per implementation.
- sustained ({"kind": "sustained", meta, rows}): per shape and implementation burst / sustained TOPS and SM clock.
- portable_vs_sa2 ({"kind": "portable_vs_sa2", meta, rows, accuracy}): `benchmarks/bench_portable_vs_sa2.py`, our
  portable kernel and the public SageAttention2 kernels; meta names the labels and the (ours, theirs) ratio pairs.
- multigpu ({"kind": "multigpu", runs: [bench_multigpu.json, ...]}): `benchmarks/bench_multigpu.py` under torchrun,
  1 GPU vs P GPUs, SDPA vs sage, context and tensor parallelism; a section of its own ("P x GPU").
- finetune ({"kind": "finetune", meta, runs, spread}): `benchmarks/finetune_smollm2.py`, LoRA fine-tuning with full
  attention and the trainable 8b, held-out perplexity and the loss-spread statistic; its machine's section.
- training ({"kind": "training", meta, attention, llama, flux}): `benchmarks/bench_training.py`, the trainable 8b
  against torch SDPA: attention forward + backward and backward alone, training steps of Llama-3.2-1B and Flux.
- end_to_end ({"kind": "end_to_end", meta, runs: [{gpu, date, command, rows}]}), and `bench_diffusers.py --json`
  output ({meta, records}) and `bench_transformers.py`'s bench_transformers.json ({meta, results}).
- fallback ({"kind": "fallback", meta, cases}): `bench_transformers.py --fallback-cases`, the full-precision
  fallback's cost against transformers' sdpa (docs/data/<gpu>_fallback.json).
- generate ({"kind": "generate", meta, times, prompts}): `benchmarks/bench_generate.py`, greedy generate() of a
  left-padded batch, sage vs sdpa: time to first token, total time, where the tokens first differ and the margin there.
- first_call ({"kind": "first_call", meta, rows}): `benchmarks/first_call.py`, a fresh process's phases up to its
  first attention output, per package version, and torch SDPA's first call (docs/data/<gpu>_first_call.json).
The page is regenerated, never appended to: a new run replaces the file of its GPU and kind.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LABELS = {"sage8b": "sage 8b", "sage_api": "sage 8b (public call)", "cudnn": "SDPA cuDNN", "flash": "SDPA flash (FA2)",
          "sa2_sm90": "public SageAttention2 sm90", "cudnn_fp8": "cuDNN FP8 (kernel only)",
          "sage8b_portable": "sage 8b portable", "sage8b_wgmma": "sage 8b wgmma", "math": "SDPA math",
          "efficient": "SDPA mem-efficient", "sage8b_hopper": "sage 8b sm_90a bwd"}
SHAPE_KEYS = {"B", "H", "N", "D", "causal", "padded_to"}
OURS = ("sage8b", "sage_api")
RATIO_PEERS = ("flash", "cudnn", "sa2_sm90")


def kind_of(data: dict) -> str:
    if "kind" in data:
        return data["kind"]
    if "records" in data:
        return "diffusers"
    if "results" in data:
        return "transformers"
    return "kernel"


def gpu_of(data: dict, k: str) -> str:
    meta = data.get("meta", {})
    return meta.get("gpu") or meta.get("device") or "unknown GPU"


def table(columns, rows) -> list:
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)] + [
        "| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def run_lines(meta: dict) -> list:
    """Date, machine, command and method of one run, as the lines above its table."""
    out = []
    bits = [f"**Date**: {meta['date']}"] if meta.get("date") else []
    soft = ", ".join(x for x in (f"torch {meta['torch']}" if meta.get("torch") else "",
                                 f"CUDA {meta['cuda']}" if meta.get("cuda") else "",
                                 f"commit {meta['commit']}" if meta.get("commit") else "") if x)
    if soft:
        bits.append(soft)
    if meta.get("impl"):
        bits.append(f"kernel: {meta['impl']}")
    if bits:
        out.append("- " + "; ".join(bits) + ".")
    if meta.get("command"):
        out.append(f"- **Command**: `{meta['command']}`" if "not recorded" not in meta["command"]
                   else f"- **Command**: {meta['command']}.")
    if meta.get("reproduce"):
        out.append(f"- **To reproduce**: `{meta['reproduce']}`")
    if meta.get("method"):
        out.append(f"- **Method**: {meta['method']}")
    for key in ("spread", "checks"):
        if meta.get(key):
            out.append(f"- **{key.capitalize()}**: {meta[key]}.")
    return out


def render_kernel(data: dict) -> list:
    rows = data["rows"]
    impls = [k for k in rows[0] if k not in SHAPE_KEYS and not k.endswith(("_ms", "_error"))]
    for r in rows[1:]:
        impls += [k for k in r if k not in SHAPE_KEYS and not k.endswith(("_ms", "_error")) and k not in impls]
    ours = next((o for o in OURS if o in impls), None)
    peers = [p for p in RATIO_PEERS if p in impls and ours]
    padded = any("padded_to" in r for r in rows)   # bench_kernel.py: the head dim a padded call runs at
    cols = ["B", "H", "D"] + ["runs at D"] * padded + ["causal", "N"] + [LABELS.get(i, i) for i in impls] + [
        f"{LABELS.get(ours, ours)} / {LABELS.get(p, p)}" for p in peers]

    def cell(x):
        return f"{x:.1f}" if isinstance(x, (int, float)) else "n/a"

    body = []
    for r in rows:
        line = [r["B"], r["H"], r["D"]] + [r.get("padded_to") or r["D"]] * padded + [
            "yes" if r["causal"] else "no", r["N"]] + [cell(r.get(i)) for i in impls]
        line += [f"{r[ours] / r[p]:.2f}" if r.get(ours) and r.get(p) else "n/a" for p in peers]
        body.append(line)
    out = [f"Attention TOPS (4·B·H·N²·D / time, halved for causal), whole call; peers: "
           f"{', '.join(LABELS.get(i, i) for i in impls if i not in OURS)}.", ""]
    out += run_lines(data.get("meta", {})) + [""] + table(cols, body)
    acc = data.get("accuracy") or {}
    accs = [f"{LABELS.get(k, k)} cos {v['cos']:.6f}, rel. L1 {v['rel_l1']:.5f}" for k, v in acc.items()
            if isinstance(v, dict) and "cos" in v]
    if accs:
        out += ["", f"Accuracy ({acc.get('shape', '')}): " + "; ".join(accs) + "."]
    if data.get("accuracy_table"):
        t = data["accuracy_table"]
        out += ["", t["title"] + ":", ""] + table(t["columns"], t["rows"])
    for prof in data.get("meta", {}).get("profile") or []:
        if isinstance(prof, dict):
            parts = ", ".join(f"{k} {v * 1000:.1f} us" for k, v in prof["ms_per_call"].items())
            out += ["", f"Device time per kernel of one call ({prof['shape']}): {parts}."]
    return out


def _tops(x) -> str:
    return f"{x:.1f}" if isinstance(x, (int, float)) else "n/a"


def render_portable_vs_sa2(data: dict) -> list:
    """The portable kernel against the public SageAttention2 kernels: TOPS per implementation, the ratio of each
    (ours, theirs) pair of meta["pairs"], the errors of calls that did not run, per-kernel times, accuracy."""
    meta, rows = data.get("meta", {}), data["rows"]
    labels = meta.get("labels", {})
    impls = [k for k in rows[0] if k not in SHAPE_KEYS and not k.endswith(("_ms", "_error"))]
    for r in rows[1:]:
        impls += [k for k in r if k not in SHAPE_KEYS and not k.endswith(("_ms", "_error")) and k not in impls]
    pairs = [(a, b) for a, b in meta.get("pairs", []) if a in impls and b in impls]
    name = lambda i: labels.get(i, LABELS.get(i, i))  # noqa: E731
    cols = ["B", "H", "D", "causal", "N"] + [name(i) for i in impls] + [f"{name(a)} / {name(b)}" for a, b in pairs]
    body = []
    for r in rows:
        line = [r["B"], r["H"], r["D"], "yes" if r["causal"] else "no", r["N"]] + [_tops(r.get(i)) for i in impls]
        line += [f"{r[a] / r[b]:.2f}" if r.get(a) and r.get(b) else "n/a" for a, b in pairs]
        body.append(line)
    out = ["Our portable mma.sync kernel (what Ada and Ampere GPUs run) against the public SageAttention2 mma.sync "
           "kernels of the same P~V precision, both compiled for and run on this GPU: attention TOPS (4·B·H·N²·D / "
           "time, halved for causal), whole call (quantization passes included); ratio > 1: ours faster.", ""]
    out += run_lines(meta)
    build = meta.get("sa2_build") or {}
    if build:
        up = build.get("upstream") or {}
        out.append(f"- **SageAttention2 build**: {up.get('upstream', 'upstream')} commit {up.get('commit', '?')}, "
                   f"sm_{build.get('arch', '?')}, built in {build.get('total_s', '?')} s by benchmarks/sa2_build.py.")
    variants = meta.get("variants") or {}
    if variants:
        out.append("- **Our kernels**: " + "; ".join(f"{name(i)} = registry {v['variant']} ({v['name']}, kernel id "
                                                     f"{v['kernel_id']})" for i, v in variants.items()) + ".")
    out += [""] + table(cols, body)
    errors: dict = {}
    for r in rows:
        for i in impls:
            if r.get(i + "_error"):
                errors.setdefault(i, []).append(r)
    for i, failed in errors.items():
        r = failed[0]
        out += ["", f"- {name(i)} did not run in {len(failed)} of {len(rows)} shapes; first, D={r['D']} "
                    f"causal={r['causal']} N={r['N']}: {r[i + '_error']}"]
    for prof in meta.get("profile") or []:
        out += ["", f"Device time per kernel of one call ({prof['shape']}), us:", ""]
        for i, split in prof["ms_per_call"].items():
            parts = ", ".join(f"{k} {v * 1000:.1f}" for k, v in split.items() if k != "total")
            out.append(f"- {name(i)}: total {split.get('total', 0) * 1000:.1f} ({parts})")
    acc = data.get("accuracy") or {}
    if acc.get("rows"):
        acc_impls = [i for i in impls if any(i in r for r in acc["rows"])]
        cells = lambda m: (f"{m['cos']:.6f} / {m['rel_l1']:.4f}" if "cos" in m  # noqa: E731
                           else f"error: {m.get('error', '?')}")
        acc_body = [[r["B"], r["H"], r["D"], "yes" if r["causal"] else "no", r["N"]]
                    + [cells(r[i]) if i in r else "" for i in acc_impls] for r in acc["rows"]]
        out += ["", f"Accuracy, cos / rel. L1 vs float64 ({acc.get('inputs', '')}):", ""]
        out += table(["B", "H", "D", "causal", "N"] + [name(i) for i in acc_impls], acc_body)
    return out


def render_sustained(data: dict) -> list:
    rows = data["rows"]
    impls = [k for k in rows[0] if k not in SHAPE_KEYS]
    for r in rows[1:]:
        impls += [k for k in r if k not in SHAPE_KEYS and k not in impls]
    cols = ["B", "H", "N", "D", "causal"] + [f"{LABELS.get(i, i)} burst / sustained (SM MHz)" for i in impls]
    has_ratio = "sage8b" in impls and "cudnn" in impls
    if has_ratio:
        cols.append("sustained sage 8b / cuDNN")

    def cell(m):
        if not m:
            return ""
        s = f"{m['burst']:.1f} / {m['sustained']:.1f}"
        return s + (f" ({m['sm_mhz']})" if m.get("sm_mhz") else "")

    body = []
    for r in rows:
        line = [r["B"], r["H"], r["N"], r["D"], "yes" if r["causal"] else "no"] + [cell(r.get(i)) for i in impls]
        if has_ratio:
            line.append(f"{r['sage8b']['sustained'] / r['cudnn']['sustained']:.2f}")
        body.append(line)
    return ["Speed under sustained load (TOPS): the same calls run back to back for seconds, as a long job does.", ""] \
        + run_lines(data.get("meta", {})) + [""] + table(cols, body)


def e2e_rows_from(data: dict, k: str) -> list:
    """end_to_end runs from any of the three end-to-end formats."""
    if k == "end_to_end":
        return data["runs"]
    meta = data.get("meta", {})
    run = {"gpu": gpu_of(data, k), "date": meta.get("date"), "command": meta.get("command"), "rows": []}
    if k == "diffusers":
        for r in data["records"]:
            if "speedup" in r:
                run["rows"].append({"model": r["case"], "tokens": r.get("tokens"), "speedup": r["speedup"],
                                    "attn_speedup": r.get("attn_speedup"), "attn_share": r.get("attn_share")})
    else:
        for r in data["results"]:
            if "speedup" in r:
                run["rows"].append({"model": "Llama-3.1-8B architecture, prefill TTFT", "tokens": r["seq"],
                                    "speedup": r["speedup"], "attn_speedup": r.get("op_speedup"),
                                    "attn_share": r.get("attention_share")})
    return [run]


def render_e2e(runs: list, method: str | None) -> list:
    out = ["End to end (original = torch SDPA in the same process; speed-up = original time / sage time)."]
    if method:
        out += ["", f"Method: {method}"]
    for run in runs:
        out += [""] + run_lines({k: run.get(k) for k in ("date", "command", "reproduce", "commit")})
        if run.get("note"):
            out.append(f"- Note: {run['note']}.")
        body = [[r["model"], r.get("tokens", ""), f"{r['speedup']:.3f}x",
                 f"{r['attn_speedup']:.2f}x" if r.get("attn_speedup") else "",
                 f"{100 * r['attn_share']:.1f}%" if r.get("attn_share") else ""] for r in run["rows"]]
        out += [""] + table(["model", "tokens", "speed-up", "attention speed-up", "attention share"], body)
    return out


def render_multigpu(data: dict) -> list:
    from bench_multigpu import markdown   # the benchmark's own table (benchmarks/ is this script's directory)

    out = ["One transformer forward, 1 GPU vs P GPUs (random bf16 weights from the real configs): torch SDPA vs sage "
           "in the same run; P-GPU times are the slowest rank's median; cos = cosine of the P-GPU output to the "
           "1-GPU output of the same attention (sage to sage, SDPA to SDPA)."]
    for run in data["runs"]:
        meta = run.get("meta", {})
        out += [""] + run_lines(meta)
        if meta.get("note"):
            out.append(f"- Note: {meta['note']}.")
        out += [""] + markdown(run["records"], sorted({k.split("_")[0] for r in run["records"] for k in r
                                                       if k.endswith("_sage_ms") and not k.startswith(("1gpu",
                                                                                                       "tp"))},
                                                      key=("ulysses", "ring", "unified").index)).splitlines()
    return out


def render_finetune(data: dict) -> list:
    meta = data["meta"]
    out = [f"What ran: {meta['what_ran']}.", ""] + run_lines(meta)
    # runs kept from an earlier invocation by --merge carry the date and command that made them
    this_run, earlier = (meta.get("date"), meta.get("command")), {}
    for r in data["runs"]:
        made = (r.get("date", this_run[0]), r.get("command", this_run[1]))
        if made != this_run:
            earlier.setdefault(made, []).append(r["name"])
    for (date, command), names in earlier.items():
        out.append(f"- Runs {', '.join(names)} kept from an earlier invocation (`--merge`): **Date**: {date}; "
                   f"**Command**: `{command}`")
    out += [""]
    body = [[r["name"], r["attn_implementation"], r["seed"], f"{r['ppl_before']:.3f}", f"{r['ppl_after']:.3f}",
             f"{sum(r['losses'][-30:]) / len(r['losses'][-30:]):.3f}"] for r in data["runs"]]
    out += table(["run", "attention", "seed", "held-out ppl before", "after", "loss, mean of last 30 steps"], body)
    png = meta.get("png", "docs/img/finetune_smollm2_cpu.png")   # the loss curves (finetune_smollm2.py --png)
    out += [""]
    for key, name in (("spread", "sage"), ("spread_sage1", "sage1")):
        sp = data.get(key)
        if sp is None:
            continue
        ppl = (f"; held-out perplexity {sp['ppl_vs_same_seed_full']:+.4f} vs the same seed's full attention "
               f"(within the seeds' spread: {sp['ppl_within_seeds_spread']})" if "ppl_vs_same_seed_full" in sp else "")
        out += [f"- {name}: mean per-step |loss - loss of full attention, same seed| {sp['candidate_vs_full_s0']:.4f}, "
                f"full attention's other seed {sp['full_s1_vs_full_s0']:.4f} (after step {sp['after_step']}: "
                f"{sp['candidate_vs_full_s0_after']:.4f} vs {sp['full_s1_vs_full_s0_after']:.4f}; within the spread: "
                f"{sp['within_spread']}){ppl}; {sp['note']}."]
    out += ["", f"Curves: `{png}`."]
    return out


def _label(name: str) -> str:
    return LABELS.get(name, name)


def _cell_ms(m: dict, mode: str) -> str:
    if "error" in m:
        return "OOM" if m["error"].startswith("OOM") else "error"
    if not m.get(mode + "_ms"):
        return "n/a"
    t = m[mode + "_tflops"]
    return f"{m[mode + '_ms']:.2f} / " + (f"{t:.0f}" if t >= 100 else f"{t:.1f}" if t >= 1 else f"{t:.2g}")


def _ratio(x) -> str:
    return f"{x:.2f}" if isinstance(x, (int, float)) else "n/a"


def _training_errors(rows: list, where) -> list:
    out = []
    for r in rows:
        for name, m in (r.get("impls") or {"": r}).items():
            if isinstance(m, dict) and m.get("error"):
                out.append(f"- {where(r)}{' ' + _label(name) if name else ''}: {m['error']}")
    return out


def render_training_attention(rows: list, meta: dict) -> list:
    am, base = meta.get("attention", {}), meta.get("baseline", "cudnn")
    impls = list(dict.fromkeys(i for r in rows for i in r.get("impls", {})))
    others = [i for i in impls if i != base]
    shape = lambda r: [r["D"], "yes" if r["causal"] else "no", r["N"]]  # noqa: E731
    b, h = rows[0]["B"], rows[0]["H"]
    out = [f"Attention, B={b} H={h} {meta.get('dtype', '')}, inputs that require grad; the whole call (every "
           f"quantization pass included). Cells: ms / TFLOPS, TFLOPS = {am.get('tflops', 'see the benchmark')}; "
           f"speed-up = {_label(base)} time / time. sage 8b = `sagebwd_attention` with the Triton pair (kernel="
           f"\"sagebwd-triton\", no routing); sage 8b sm_90a bwd = the same with the sm_90a backward (kernel="
           f"\"sagebwd-hopper\"); "
           f"public call = `sage_patch.attention(precision=\"8b\")`, which runs what the resolver chose (column "
           f"\"public call ran\"). Timing: {am.get('timing', 'see the benchmark')}."]
    ran = lambda r: ", ".join(f"{k} x{v}" for k, v in r["impls"].get("sage_api", {}).get("ran", {}).items())  # noqa
    for mode, title in (("fwdbwd", "Forward + backward"), ("bwd", "Backward alone (one forward outside the timing)")):
        cols = ["D", "causal", "N"] + [_label(i) for i in impls] + [f"{_label(i)} vs {_label(base)}" for i in others]
        body = [shape(r) + [_cell_ms(r["impls"].get(i, {"error": r.get("error", "not run")}), mode) for i in impls]
                + [_ratio(r["impls"].get(i, {}).get(mode + "_vs_baseline")) for i in others] for r in rows]
        if mode == "fwdbwd" and "sage_api" in impls:
            cols.append("public call ran")
            body = [line + [ran(r)] for line, r in zip(body, rows)]
        out += ["", f"{title}:", ""] + table(cols, body)
    peaks = [r for r in rows if any(m.get("peak_mib") is not None for m in r.get("impls", {}).values())]
    if peaks:
        out += ["", "Peak memory of one forward + backward, MiB beyond what was allocated before it (q, k, v, dO):",
                ""]
        out += table(["D", "causal", "N"] + [_label(i) for i in impls], [
            shape(r) + [f"{r['impls'][i]['peak_mib']:.0f}" if r["impls"].get(i, {}).get("peak_mib") is not None
                        else "n/a" for i in impls] for r in peaks])
    accs = [r for r in rows if isinstance(r.get("accuracy"), dict) and any(
        isinstance(v, dict) for v in r["accuracy"].values())]
    if accs:
        body = []
        for r in accs:
            for i in impls:
                m = r["accuracy"].get(i)
                if isinstance(m, dict):
                    body.append(shape(r) + [_label(i)] + ([f"{m[k]:.6f}" for k in ("out", "dq", "dk", "dv")]
                                                          if "error" not in m else [m["error"], "", "", ""]))
        out += ["", f"Accuracy: cosine to torch SDPA math in float64 ({accs[0]['accuracy'].get('slice', '')}):", ""]
        out += table(["D", "causal", "N", "implementation", "out", "dQ", "dK", "dV"], body)
    errors = _training_errors(rows, lambda r: f"D={r['D']} causal={r['causal']} N={r['N']}")
    if errors:
        out += ["", "Did not run:", ""] + errors
    return out


def render_training_steps(rows: list, meta: dict, base: str) -> list:
    tokens = f" ({meta['tokens']})" if meta.get("tokens") else ""
    out = [f"{meta.get('model', '')}; batch {meta.get('batch', 1)}{tokens}, loss: {meta.get('loss', '')}; optimizer "
           f"{meta.get('optimizer', '')} (lr {meta.get('lr', '')}); median of {meta.get('reps', '?')} steps after "
           f"{meta.get('warmup', '?')} warm-up; gradient checkpointing: {meta.get('grad_ckpt', '?')} (auto: only "
           f"after an out-of-memory, marked per row). Probe: one forward + backward per implementation on the same "
           f"weights: its loss and the cosine of the gradient of {meta.get('probe_param', 'one weight')} to "
           f"{_label(base)}'s. Peak: the most allocated during the timed steps (weights, gradients, optimizer state, "
           f"activations)." + (f" {meta['note']}" if meta.get("note") else ""), ""]
    name = lambda i: 'attn "sage"' if i == "sage" else f"SDPA {_label(i).replace('SDPA ', '')}"  # noqa: E731
    body = []
    for r in rows:
        ok = "step_ms" in r
        body.append([r["tokens"], name(r["impl"]), "yes" if r["grad_ckpt"] else "no", r.get("optimizer", ""),
                     f"{r['step_ms']:.1f}" if ok else ("OOM" if r.get("error", "").startswith("OOM") else "error"),
                     f"{r['tokens_per_s']:.0f}" if ok else "", _ratio(r.get("vs_baseline")) if ok else "",
                     f"{r['peak_gib']:.1f}" if r.get("peak_gib") is not None else "n/a",
                     f"{r['probe_loss']:.4f}" if "probe_loss" in r else "",
                     f"{r['probe_grad_cos_vs_baseline']:.6f}" if "probe_grad_cos_vs_baseline" in r else "",
                     ", ".join(f"{k} x{v}" for k, v in (r.get("ran") or {}).items())])
    out += table(["tokens", "attention", "grad ckpt", "optimizer", "step ms", "tokens/s",
                  f"speed-up vs {_label(base)}", "peak GiB", "probe loss", "probe grad cos", "sage ran"], body)
    errors = [f"- {r['tokens']} tokens, {name(r['impl'])}, grad ckpt {'on' if r['grad_ckpt'] else 'off'}: "
              f"{r['error']}" for r in rows if r.get("error")]
    return out + (["", "Did not run:", ""] + errors if errors else [])


def render_training(data: dict) -> list:
    """bench_training.py's JSON: the attention tables, then the training-step tables of the models it ran."""
    meta = data.get("meta", {})
    trainable = meta.get("trainable") or {}
    out = ["The trainable 8b attention (SageBwd) against torch SDPA in the same run: forward + backward, backward "
           "alone, and whole training steps."
           + (f" A training call of the public API ran `{trainable['impl']}`"
              + (f" ({trainable['reason']})" if trainable.get("reason") else "") + "." if trainable.get("impl")
              else ""), ""] + run_lines(meta) + ([f"- Note: {meta['note']}."] if meta.get("note") else [])
    if data.get("attention"):
        out += ["", "#### Attention", ""] + render_training_attention(data["attention"], meta)
    for key, title in (("llama", "Training step: Llama-3.2-1B architecture"),
                       ("flux", "Training step: Flux transformer")):
        if data.get(key):
            out += ["", f"#### {title}", ""] + render_training_steps(data[key], meta.get(key, {}),
                                                                     meta.get("baseline", "cudnn"))
    return out


def render_fallback(data: dict) -> list:
    """bench_transformers.py --fallback-cases: padded and unpadded batches, and the full-precision fallback, vs
    transformers' sdpa (or eager, for a model without an sdpa path: the case's "baseline"), both orders."""
    meta = data["meta"]
    out = run_lines(meta) + [f"- **Method**: prefill forward (KV cache filled, logits_to_keep=1), {meta.get('dtype')}, "
                             f"random weights, median of {meta.get('iters')} after {meta.get('warmup')} warm-up, "
                             "CUDA events; sdpa and sage on one model, in both orders. Padded batch: key padding on the 8b kernel, "
                             "beside the same batch unpadded; sliding windows: the kernels' window (transformers' sdpa "
                             "gets a dense mask); a head dim without a kernel: the full-precision fallback, whose "
                             "budget is +1%.", ""]
    # a case's baseline is transformers' sdpa, or its eager for a model without an sdpa path (gpt-oss's sinks);
    # runs before the "baseline" key have sdpa_ms / sage_over_sdpa
    base = "sdpa" if all(c.get("baseline", "sdpa") == "sdpa" for c in data["cases"]) else "baseline"
    if base == "baseline":
        out[-2] += (" The baseline is transformers' sdpa, or its eager for a model it runs without sdpa (gpt-oss: "
                    "attention sinks), named in the column.")
    rows = []
    for c in data["cases"]:
        for o in c["orders"]:
            base_ms = o.get("baseline_ms", o.get("sdpa_ms"))
            ratio = o.get("sage_over_baseline", o.get("sage_over_sdpa"))
            rows.append([c["case"], f"{c['batch']} x {c['tokens']}", " then ".join(o["order"]),
                         f"{base_ms:.2f}" if base == "sdpa" else f"{c.get('baseline', 'sdpa')} {base_ms:.2f}",
                         f"{o['sage_ms']:.2f}", f"{ratio - 1:+.2%}",
                         ", ".join(f"{k} x{v}" for k, v in c.get("sage_impl", {}).items())])
    return out + table(["case", "batch x tokens", "order", f"{base} ms", "sage ms", f"sage vs {base}", "sage ran"],
                       rows)


def render_window(data: dict) -> list:
    """bench_kernel.py --window: the kernels' causal sliding window vs SDPA with the dense mask transformers' sdpa
    path gives it, and both at plain causal for scale."""
    out = run_lines(data["meta"]) + ["- **Method**: median ms of the whole call (triton do_bench), fp16, causal; "
                                     "window W = transformers' sliding_window (window_left W - 1); accuracy of the "
                                     "windowed call vs float64 on 2 heads.", ""]
    rows = [[r["B"], r["H"], r["D"], r["N"], r["window"], f"{r['sage8b_window_ms']:.2f}",
             f"{r['sdpa_window_mask_ms']:.2f}", f"{r['speedup_vs_sdpa_mask']:.2f}x", f"{r['sage8b_causal_ms']:.2f}",
             f"{r['cudnn_causal_ms']:.2f}", f"{r['vs_float64_cos']:.5f}"] for r in data["rows"]]
    return out + table(["B", "H", "D", "N", "window", "sage 8b window ms", "SDPA dense window mask ms", "speed-up",
                        "sage 8b causal ms", "cuDNN causal ms", "cos vs float64"], rows)


def render_first_call(data: dict) -> list:
    """benchmarks/first_call.py: fresh-process phase times per package version, torch SDPA's as the peer."""
    meta = data["meta"]
    out = run_lines(meta) + [f"- **Method**: each row the median of {meta.get('reps')} fresh Python processes "
                             f"(perf_counter, device sync after each phase); the call: B=1 H=8 "
                             f"N={meta.get('tokens')} D=128, precision 8b; versions: "
                             + ", ".join(f"{k} = `{v}`" for k, v in meta.get("trees", {}).items()) + ".", ""]
    rows = [[r["row"], f"{r['torch']:.2f}", f"{r['import']:.3f}" if "import" in r else "-", f"{r['first']:.3f}",
             f"{r['second'] * 1e3:.1f}", ", ".join(r.get("impl", {})) or "-", ", ".join(r.get("imported", [])) or "-"]
            for r in data["rows"]]
    return out + table(["row", "import torch + CUDA s", "import sage_patch s", "first call s", "second call ms",
                        "ran", "first call imported"], rows)


def render_generate(data: dict) -> list:
    """bench_generate.py: median TTFT and total time per implementation, and the token comparison per prompt."""
    meta = data["meta"]
    out = run_lines(meta) + [f"- **Method**: {meta.get('model')} ({meta.get('layers')} layers, random {meta.get('dtype')} "
                             f"weights), greedy generate() of {len(meta.get('prompts', []))} left-padded prompts of "
                             f"{', '.join(map(str, meta.get('prompts', [])))} tokens, {meta.get('new_tokens')} new tokens; "
                             f"median of {meta.get('reps')} calls each, interleaved with the other implementation's, the order "
                             f"alternating, CUDA events; shipped llama policy (decode steps "
                             f"full); sage ran: {', '.join(f'{k} x{v}' for k, v in data.get('sage_impl', {}).items())}.",
                             ""]
    med = {impl: {k: statistics.median(v) for k, v in data["times"][impl].items()} for impl in ("sdpa", "sage")}
    sd, sg = med["sdpa"], med["sage"]
    steps = max(int(meta.get("new_tokens") or 2) - 1, 1)  # decode steps: (total - TTFT) / steps
    dd, dg = ((m["total_ms"] - m["ttft_ms"]) / steps for m in (sd, sg))
    out += table(["sdpa TTFT ms", "sage TTFT ms", "TTFT speed-up", "sdpa total ms", "sage total ms", "total speed-up",
                  "sdpa decode ms/step", "sage decode ms/step", "decode speed-up"],
                 [[f"{sd['ttft_ms']:.1f}", f"{sg['ttft_ms']:.1f}", f"{sd['ttft_ms'] / sg['ttft_ms']:.3f}x",
                   f"{sd['total_ms']:.1f}", f"{sg['total_ms']:.1f}", f"{sd['total_ms'] / sg['total_ms']:.3f}x",
                   f"{dd:.2f}", f"{dg:.2f}", f"{dd / dg:.3f}x"]]) + [""]
    out += table(["prompt tokens", "tokens vs sdpa", "sdpa logit margin there"],
                 [[p["tokens"], "identical" if p["first_divergence"] is None else
                   f"first differ at step {p['first_divergence']}", "-" if p["margin"] is None else f"{p['margin']:.4f}"]
                  for p in data["prompts"]])
    return out


# (kind, section title, renderer) in page order; the end-to-end section (its runs merged) comes after the first four
SECTIONS = [("kernel", "Attention kernel", render_kernel),
            ("portable_vs_sa2", "Portable kernel vs public SageAttention2", render_portable_vs_sa2),
            ("window", "Sliding window", render_window),
            ("sustained", "Sustained load", render_sustained),
            ("generate", "generate() end to end", render_generate),
            ("first_call", "First call of a process", render_first_call),
            ("fallback", "Batched, windowed and fallback prefills", render_fallback),
            ("training", "Training", render_training),
            ("finetune", "Fine-tuning on real weights", render_finetune),
            ("multigpu", "Multiple GPUs", render_multigpu)]


def render(data_dir: str) -> str:
    per_gpu: dict = {}
    for path in sorted(glob.glob(os.path.join(data_dir, "*.json"))):
        with open(path) as f:
            data = json.load(f)
        k = kind_of(data)
        src = os.path.relpath(path, ROOT)
        if k == "finetune":
            per_gpu.setdefault(data["meta"].get("machine", "CPU"), {}).setdefault(k, []).append((src, data))
        elif k == "multigpu":
            meta = data["runs"][0].get("meta", {})
            per_gpu.setdefault(f"{meta.get('world_size')} x {meta.get('gpu')}", {}).setdefault(k, []).append((src, data))
        elif k in ("end_to_end", "diffusers", "transformers"):
            method = data.get("meta", {}).get("method")
            for run in e2e_rows_from(data, k):
                per_gpu.setdefault(run["gpu"], {}).setdefault("e2e", []).append((src, run, method))
        else:
            per_gpu.setdefault(gpu_of(data, k), {}).setdefault(k, []).append((src, data))
    lines = ["# Benchmarks", "",
             "Current numbers, one section per GPU. **Generated** by `python benchmarks/report.py` from the JSON in "
             "`docs/data/` (do not edit by hand: replace the JSON with a new run's and regenerate). Every table names "
             "its date, command and the peers measured in the same run. Methods: `docs/benchmarks_transformers.md`, "
             "`docs/benchmarks_diffusers.md`; the kernel design these numbers belong to: `docs/design/kernels.md`. "
             "Earlier measurements are in git history (`git log -p -- docs/benchmarks.md`).", ""]
    for gpu in sorted(per_gpu, key=lambda g: (g.startswith("CPU"), " x " in g, "H200" not in g, g)):
        sec = per_gpu[gpu]
        lines += [f"## {gpu}", ""]
        for kind, title, render_section in SECTIONS[:4]:
            for src, data in sec.get(kind, []):
                lines += [f"### {title} (`{src}`)", ""] + render_section(data) + [""]
        if sec.get("e2e"):
            srcs = sorted({s for s, _, _ in sec["e2e"]})
            lines += [f"### End to end (`{'`, `'.join(srcs)}`)", ""]
            lines += render_e2e([r for _, r, _ in sec["e2e"]], next((m for _, _, m in sec["e2e"] if m), None)) + [""]
        for kind, title, render_section in SECTIONS[4:]:
            for src, data in sec.get(kind, []):
                lines += [f"### {title} (`{src}`)", ""] + render_section(data) + [""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=os.path.join(ROOT, "docs", "data"))
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "benchmarks.md"))
    ap.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 when out of date")
    a = ap.parse_args(argv)
    text = render(a.data)
    if a.check:
        cur = open(a.out).read() if os.path.exists(a.out) else ""
        if cur != text:
            print(f"{a.out} is out of date: run python benchmarks/report.py", file=sys.stderr)
            return 1
        return 0
    with open(a.out, "w") as f:
        f.write(text)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

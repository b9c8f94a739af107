"""Calibration: measure each attention layer's error under every candidate precision on sample inputs, and
write the policy that picks, per layer, the fastest precision meeting the user's thresholds.

The model runs in full precision while an observer on each layer's binding takes sampled calls and heads,
computes fp32 attention of those heads and each candidate precision's output, and keeps only the metrics
(streaming: memory stays bounded by one call's sampled heads).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
from collections import Counter
from dataclasses import dataclass, field

import torch

from .accuracy import compare
from .guard import head_slices
from .policy import LayerRule, Policy
from .precisions import check_precision
from .reference import exact_attention
from .report import LayerStats
from .routing import bindings_of, route_sdpa

SPEED_ORDER = ("fp4", "4b", "8b")  # fastest first; "full" is the fallback when none meets the thresholds


@dataclass
class LayerErrors:
    calls: int = 0
    sampled: int = 0
    metrics: dict = field(default_factory=dict)  # precision -> {"cos": [...], "rel_l1": [...], "rmse": [...]}

    def add(self, precision: str, m: dict) -> None:
        d = self.metrics.setdefault(precision, {"cos": [], "rel_l1": [], "rmse": []})
        for key in d:
            d[key].append(m[key])

    def summary(self, precision: str) -> dict:
        d = self.metrics.get(precision)
        if not d or not d["cos"]:
            return {}
        return {"cos_mean": sum(d["cos"]) / len(d["cos"]), "cos_worst": min(d["cos"]),
                "rel_l1_mean": sum(d["rel_l1"]) / len(d["rel_l1"]), "rel_l1_worst": max(d["rel_l1"]),
                "rmse_mean": sum(d["rmse"]) / len(d["rmse"]), "rmse_worst": max(d["rmse"]), "n": len(d["cos"])}


@dataclass
class Calibration:
    policy: Policy
    precisions: tuple
    errors: dict            # layer -> LayerErrors
    choice: dict            # layer -> precision
    min_cos: float
    max_rel_l1: float | None
    speedup: float | None = None

    def to_dict(self) -> dict:
        return {"choice": self.choice, "min_cos": self.min_cos, "max_rel_l1": self.max_rel_l1,
                "estimated_attention_speedup": self.speedup,
                "errors": {n: {p: e.summary(p) for p in self.precisions} for n, e in self.errors.items()}}

    def table(self) -> str:
        head = f"{'layer':40s} {'calls':>5s} " + " ".join(f"{p + ' worst cos/relL1':>24s}" for p in self.precisions)
        lines = [head + "  choice", "-" * (len(head) + 8)]
        for name, e in self.errors.items():
            cells = []
            for p in self.precisions:
                s = e.summary(p)
                cells.append(f"{s['cos_worst']:.6f} / {s['rel_l1_worst']:.4f}".rjust(24) if s else "-".rjust(24))
            lines.append(f"{name[-40:]:40s} {e.calls:5d} " + " ".join(cells) + f"  {self.choice[name]}")
        counts = Counter(self.choice.values())
        lines.append(f"chosen: {dict(counts)}; thresholds: worst cos >= {self.min_cos}"
                     + (f", worst rel L1 <= {self.max_rel_l1}" if self.max_rel_l1 is not None else ""))
        lines.append(f"estimated attention speed-up vs full: {self.speedup:.2f}x" if self.speedup
                     else "estimated speed-up: no kernel benchmark numbers given (--bench)")
        return "\n".join(lines)

    def heatmap(self, path: str) -> None:
        """Layers x precisions heatmap of the worst-case error, as -log10(1 - cos) (higher is better)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = list(self.errors)
        grid = [[-math.log10(max(1e-9, 1 - self.errors[n].summary(p).get("cos_worst", 0.0)))
                 for p in self.precisions] for n in names]
        fig, ax = plt.subplots(figsize=(2 + 1.2 * len(self.precisions), 1 + 0.28 * len(names)))
        im = ax.imshow(grid, aspect="auto", cmap="viridis")
        for i, n in enumerate(names):  # worst cos in each cell; the chosen precision in bold
            for j, p in enumerate(self.precisions):
                cos = self.errors[n].summary(p).get("cos_worst")
                if cos is not None:
                    ax.text(j, i, f"{cos:.4f}", ha="center", va="center", fontsize=7, color="white",
                            fontweight="bold" if self.choice[n] == p else "normal")
        ax.set_xticks(range(len(self.precisions)), self.precisions)
        ax.set_yticks(range(len(names)), names, fontsize=7)
        ax.set_title(f"-log10(1 - worst cos); threshold {-math.log10(1 - self.min_cos):.1f}")
        fig.colorbar(im, ax=ax)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


def _sample_heads(n: int, k: int) -> list[int]:
    if n <= k:
        return list(range(n))
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)}) if k > 1 else [0]


class _Observer:
    def __init__(self, precisions, max_calls: int, max_heads: int):
        self.precisions, self.max_calls, self.max_heads = precisions, max_calls, max_heads
        self.errors: dict[str, LayerErrors] = {}
        self.scratch = LayerStats("<calibration>")

    def __call__(self, binding, q, k, v, call):
        from .api import run_attention

        e = self.errors.setdefault(binding.name, LayerErrors())
        e.calls += 1
        steps = binding.steps.num_steps
        stride = max(1, steps // self.max_calls) if steps else 1
        if e.sampled >= self.max_calls or (e.calls - 1) % stride:
            return
        e.sampled += 1
        n_heads = q.shape[2] if call["layout"] == "bshd" else q.shape[1]
        qs, ks, vs, mask = head_slices(q, k, v, call, _sample_heads(n_heads, self.max_heads))
        with torch.no_grad():
            ref = exact_attention(qs, ks, vs, is_causal=call["is_causal"], scale=call["scale"], attn_mask=mask,
                                  dtype=torch.float32)
            for p in self.precisions:
                out = run_attention(qs, ks, vs, layout="bhsd", is_causal=call["is_causal"], scale=call["scale"],
                                    attn_mask=mask, precision=p, stats=self.scratch)
                e.add(p, compare(out, ref))


@contextlib.contextmanager
def _routed_full(obj):
    """Route obj's attention through bindings running full precision; restore everything afterwards."""
    with contextlib.ExitStack() as stack:
        bindings = bindings_of(obj)
        if not bindings and hasattr(obj, "enable_sage_attention"):
            obj.enable_sage_attention(policy="full")
            stack.callback(obj.disable_sage_attention)
            bindings = bindings_of(obj)
        if not bindings:
            if not isinstance(obj, torch.nn.Module):
                raise TypeError(f"calibrate takes an nn.Module or a diffusers pipeline; got {type(obj).__name__}")
            stack.enter_context(route_sdpa(obj, "full"))
            bindings = bindings_of(obj)
        if not bindings:
            raise ValueError("calibrate found no attention layer to measure: the model's attention modules must "
                             "call F.scaled_dot_product_attention or be routed by sage_patch")
        saved = {n: b.policy for n, b in bindings.items()}
        full = Policy(default="full")
        for b in bindings.values():
            b.policy = full
        try:
            yield bindings, saved
        finally:
            for n, b in bindings.items():
                b.policy, b.observer = saved[n], None


def _default_inputs(obj):
    cfg = getattr(obj, "config", None)
    vocab = getattr(cfg, "vocab_size", None)
    if vocab is None:
        raise ValueError("calibrate needs `inputs` for this model (built-in random defaults exist for "
                         "transformers language models only)")
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (1, 256), generator=g), torch.randint(0, vocab, (2, 192), generator=g)]


def _call(obj, x):
    device = getattr(obj, "device", None)
    if isinstance(x, torch.Tensor):
        x = x.to(device) if isinstance(device, torch.device) else x
        return obj(input_ids=x) if hasattr(obj, "config") and hasattr(obj.config, "vocab_size") else obj(x)
    if isinstance(x, dict):
        return obj(**x)
    if isinstance(x, str):
        return obj(prompt=x)
    if isinstance(x, (list, tuple)):
        return obj(*x)
    raise TypeError(f"calibrate inputs: each item must be a tensor, dict, prompt string or tuple; "
                    f"got {type(x).__name__}")


def bench_speedups(data: dict) -> dict:
    """Per-precision speed-up vs full from a JSON of scripts/bench_kernel.py (rows with "sage<precision>" and
    "cudnn"/"flash" TOPS: median over rows of ours / the best SDPA backend) or {"speedup_vs_full": {...}}."""
    if "speedup_vs_full" in data:
        return dict(data["speedup_vs_full"])
    out = {}
    for p in SPEED_ORDER:
        ratios = sorted(r[f"sage{p}"] / max(r.get("cudnn") or 0, r.get("flash") or 0)
                        for r in data.get("rows", []) if r.get(f"sage{p}") and (r.get("cudnn") or r.get("flash")))
        if ratios:
            out[p] = ratios[len(ratios) // 2]
    return out


def _speeds(bench) -> dict:
    """Per-precision kernel speed-ups vs full from a dict ({"8b": 1.7, ...}) or a JSON path (see bench_speedups)."""
    if bench is None:
        return {}
    if isinstance(bench, (str, os.PathLike)):
        with open(bench) as f:
            bench = bench_speedups(json.load(f))
    return {k: float(v) for k, v in bench.items()}


def _speedup(choice: dict, bench) -> float | None:
    """Estimated attention speed-up vs full of a per-layer choice."""
    if bench is None:
        return None
    rel = {"full": 1.0, **_speeds(bench)}
    if not choice or any(p not in rel for p in choice.values()):
        return None
    return len(choice) / sum(1.0 / rel[p] for p in choice.values())


def calibrate(model_or_pipe, inputs=None, *, out=None, min_cos=0.999, max_rel_l1=None, precisions=None,
              max_calls=8, max_heads=4, heatmap=None, bench=None, progress=True, return_details=False):
    """Measure per-layer error of each candidate precision and return the Policy picking, per layer, the fastest
    precision whose worst-case cosine >= min_cos (and worst relative L1 <= max_rel_l1 if given).

    inputs: list of what the model/pipeline is called with: token-id tensors, dicts of keyword arguments, prompt
    strings (pipelines) or argument tuples; None uses random token ids (transformers language models).
    out: write the policy as YAML there. heatmap: write a PNG (layers x precisions). bench: per-precision
    kernel speed-ups vs full (dict or JSON path) for the speed-up estimate. return_details: also return the
    Calibration (metrics table, choices).
    """
    precisions = tuple(precisions or SPEED_ORDER)
    for p in precisions:
        check_precision(p, "precisions")
    precisions = tuple(p for p in SPEED_ORDER if p in precisions)  # fastest first
    inputs = _default_inputs(model_or_pipe) if inputs is None else list(inputs)
    observer = _Observer(precisions, max_calls, max_heads)
    with _routed_full(model_or_pipe) as (bindings, saved), torch.no_grad():
        for b in bindings.values():
            b.observer = observer
        it = inputs
        if progress:
            from tqdm.auto import tqdm

            it = tqdm(inputs, desc="calibrating", unit="input")
        for x in it:
            _call(model_or_pipe, x)
        base = next(iter(saved.values()))
        names = {n: b.name for n, b in bindings.items()}

    errors = {names[n]: observer.errors.get(names[n], LayerErrors()) for n in bindings}
    speeds = _speeds(bench)
    # fastest first: measured kernel speed-ups when given (full = 1.0: a kernel slower than full never wins),
    # else the nominal order fp4 > 4b > 8b
    order = sorted(precisions, key=lambda p: -speeds.get(p, 0.0)) if speeds else list(precisions)
    if speeds:
        order = [p for p in order if speeds.get(p, 0.0) > 1.0]
    choice = {}
    for name, e in errors.items():
        choice[name] = "full"
        for p in order:
            s = e.summary(p)
            if s and s["cos_worst"] >= min_cos and (max_rel_l1 is None or s["rel_l1_worst"] <= max_rel_l1):
                choice[name] = p
                break
    default = Counter(choice.values()).most_common(1)[0][0] if choice else base.default
    rules = tuple(LayerRule(p, match=name) for name, p in choice.items() if p != default)
    policy = Policy(default=default, layers=rules, steps=base.steps, min_seq_len=base.min_seq_len,
                    full_head_dims=base.full_head_dims, full_dtypes=base.full_dtypes, smooth_v=base.smooth_v,
                    guard_every=base.guard_every, guard_min_cos=base.guard_min_cos,
                    guard_max_rel_l1=base.guard_max_rel_l1, name="calibrated",
                    description=f"sage-patch calibrate: worst cos >= {min_cos}"
                                + (f", worst rel L1 <= {max_rel_l1}" if max_rel_l1 is not None else "")
                                + f", candidates {', '.join(precisions)}")
    result = Calibration(policy, precisions, errors, choice, min_cos, max_rel_l1, _speedup(choice, bench))
    if out is not None:
        policy.save(out)
    if heatmap is not None:
        result.heatmap(heatmap)
    return (policy, result) if return_details else policy

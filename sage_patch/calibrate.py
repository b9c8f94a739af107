"""Calibration: measure each attention layer's error under every candidate precision on sample inputs, and
write the policy that picks, per layer, the fastest precision that is accurate enough.

The model runs in full precision while an observer on each layer's binding takes sampled calls and heads,
computes fp32 attention of those heads and each candidate precision's output, and keeps only the metrics
(streaming: memory stays bounded by one call's sampled heads).

Two objectives decide what "accurate enough" means:

- "thresholds" (default): each layer on its own must meet worst-case cosine / relative-L1 thresholds. Cheap (one
  forward pass), but a per-layer threshold says nothing about what 30 layers' errors do to the model's output
  together: a threshold loose enough to use 4b somewhere can cost several percent of perplexity.
- "perplexity" (causal LMs): the whole model's perplexity on the calibration text may rise by at most
  `max_ppl_increase` (relative) over full precision. Layers are moved to a faster precision greedily, least
  sensitive first (sensitivity: the measured mean relative L1 of that layer at that precision), and every candidate
  assignment is checked by perplexity; a binary search over how many layers move keeps this to about
  log2(layers) forward passes per precision.
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
from .lifecycle import bindings_of, family_policy
from .integrations.generic import route_sdpa

SPEED_ORDER = ("fp4", "4b", "8b")  # fastest first; "full" is the fallback when none meets the thresholds
OBJECTIVES = ("thresholds", "perplexity")


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
    objective: str = "thresholds"
    max_ppl_increase: float | None = None
    margin: float | None = None
    ppl_full: float | None = None     # perplexity objective: full precision on the calibration text
    ppl: float | None = None          # ... and of the chosen assignment
    trace: list = field(default_factory=list)  # perplexity objective: (precision, layers tried, ppl, accepted)

    def to_dict(self) -> dict:
        return {"objective": self.objective, "choice": self.choice, "min_cos": self.min_cos,
                "max_rel_l1": self.max_rel_l1, "max_ppl_increase": self.max_ppl_increase,
                "ppl_full": self.ppl_full, "ppl": self.ppl, "trace": self.trace,
                "estimated_attention_speedup": self.speedup,
                "errors": {n: {p: e.summary(p) for p in self.precisions} for n, e in self.errors.items()}}

    def counts(self) -> dict:
        """Number of layers at each precision, fastest first."""
        c = Counter(self.choice.values())
        return {p: c[p] for p in (*SPEED_ORDER, "full") if c[p]}

    def table(self) -> str:
        head = f"{'layer':40s} {'calls':>5s} " + " ".join(f"{p + ' worst cos/relL1':>24s}" for p in self.precisions)
        lines = [head + "  choice", "-" * (len(head) + 8)]
        for name, e in self.errors.items():
            cells = []
            for p in self.precisions:
                s = e.summary(p)
                cells.append(f"{s['cos_worst']:.6f} / {s['rel_l1_worst']:.4f}".rjust(24) if s else "-".rjust(24))
            lines.append(f"{name[-40:]:40s} {e.calls:5d} " + " ".join(cells) + f"  {self.choice[name]}")
        if self.objective == "perplexity":
            for p, k, ppl, ok in self.trace:
                lines.append(f"  try {k:3d} layers at {p:4s}: perplexity {ppl:.4f} "
                             f"({100 * (ppl / self.ppl_full - 1):+.3f}%) {'accepted' if ok else 'rejected'}")
            lines.append(f"chosen: {self.counts()}; perplexity {self.ppl:.4f} vs full {self.ppl_full:.4f} "
                         f"({100 * (self.ppl / self.ppl_full - 1):+.3f}%, allowed "
                         f"+{100 * self.max_ppl_increase:.2f}%, searched within "
                         f"+{100 * self.max_ppl_increase * (1 - self.margin):.2f}% in every window) on the "
                         f"calibration inputs")
        else:
            lines.append(f"chosen: {self.counts()}; thresholds: worst cos >= {self.min_cos}"
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
        if self.objective == "perplexity":
            ax.set_title(f"-log10(1 - worst cos); bold: chosen (perplexity <= "
                         f"+{100 * self.max_ppl_increase:.2f}%)", fontsize=9)
        else:
            ax.set_title(f"-log10(1 - worst cos); threshold {-math.log10(1 - self.min_cos):.1f}", fontsize=9)
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
            window = call.get("window_left", -1)
            ref = exact_attention(qs, ks, vs, is_causal=call["is_causal"], scale=call["scale"], attn_mask=mask,
                                  dtype=torch.float32, window_left=window)
            for p in self.precisions:
                out = run_attention(qs, ks, vs, layout="bhsd", is_causal=call["is_causal"], scale=call["scale"],
                                    attn_mask=mask, precision=p, stats=self.scratch, window_left=window)
                e.add(p, compare(out, ref))


@contextlib.contextmanager
def _routed_full(obj):
    """Route obj's attention through bindings running full precision; restore everything afterwards. Yields the
    bindings, their policies before, and the policy obj was routed under (its family default if it was not)."""
    with contextlib.ExitStack() as stack:
        bindings = bindings_of(obj)
        routed = next(iter(bindings.values())).policy if bindings else family_policy(obj)
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
            yield bindings, saved, routed
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
    """Per-precision speed-up vs full from a JSON of benchmarks/bench_kernel.py (rows with "sage<precision>" and
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


def _token_ids(x) -> torch.Tensor:
    ids = x.get("input_ids") if isinstance(x, dict) else x
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise TypeError("perplexity needs token-id tensors (batch, tokens) or dicts with input_ids; "
                        f"got {type(x).__name__}")
    return ids


def window_perplexities(model, inputs, *, progress=False, desc="perplexity") -> list[tuple[float, int]]:
    """(perplexity, predicted tokens) of each window of token ids (tensors (batch, tokens) or dicts with
    input_ids), each scored on its own (no context carried across windows)."""
    device = getattr(model, "device", None)
    out = []
    it = list(inputs)
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, desc=desc, unit="window", leave=False)
    with torch.no_grad():
        for x in it:
            ids = _token_ids(x)
            if isinstance(device, torch.device):
                ids = ids.to(device)
            loss = model(input_ids=ids, labels=ids).loss
            out.append((math.exp(float(loss)), ids.shape[0] * (ids.shape[1] - 1)))
    return out


def _pooled(per_window) -> float:
    n = sum(t for _, t in per_window)
    if n == 0:
        raise ValueError("perplexity needs at least one window of 2 or more tokens")
    return math.exp(sum(math.log(p) * t for p, t in per_window) / n)


def perplexity(model, inputs, *, progress=False, desc="perplexity") -> float:
    """Token-weighted perplexity of a causal LM over windows of token ids: exp(total NLL / predicted tokens)."""
    return _pooled(window_perplexities(model, inputs, progress=progress, desc=desc))


def _policy_from_choice(choice: dict, base: Policy, description: str) -> Policy:
    """The policy with the most common precision as default and one layer rule per other layer; fallbacks,
    step rules, options and the guard are `base`'s (see calibrate)."""
    default = Counter(choice.values()).most_common(1)[0][0] if choice else base.default
    rules = tuple(LayerRule(p, match=name) for name, p in choice.items() if p != default)
    return Policy(default=default, layers=rules, steps=base.steps, min_seq_len=base.min_seq_len,
                  full_head_dims=base.full_head_dims, full_dtypes=base.full_dtypes, smooth_v=base.smooth_v,
                  exact_4b=base.exact_4b, guard_every=base.guard_every, guard_min_cos=base.guard_min_cos,
                  guard_max_rel_l1=base.guard_max_rel_l1, name="calibrated", description=description)


def _sensitivity(e: LayerErrors, p: str) -> float:
    s = e.summary(p)
    return s["rel_l1_mean"] if s else math.inf


def _search_perplexity(model, bindings, names, errors, order, base, eval_inputs, max_ppl_increase, margin,
                       progress):
    """Greedy demotion checked by perplexity. Returns (choice, ppl_full, ppl, trace).

    Stages go from the safest candidate to the fastest: first as many layers as possible leave full precision
    (for the safest candidate), then as many of those as possible move on to each faster candidate. Within a
    stage the layers are ordered by their measured sensitivity at that precision; all of them are tried first,
    then a binary search finds the longest prefix that stays within the target (it assumes more quantized layers
    never lower the perplexity; the result does not rely on that: only measured, accepted assignments are kept).

    An assignment is accepted when EVERY calibration window's perplexity stays within (1 - margin) x the target
    of that window's full-precision perplexity, not just the pooled one. Both guard text the search has not
    seen: the increase varies with the text, and picking the best-looking subset of layers on the calibration
    windows flatters it (measured on SmolLM2: +0.34% there was +0.64% on held-out text without the margin)."""
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(desc="perplexity search", unit="eval")

    def windows_of(choice):
        pol = _policy_from_choice(choice, base, "candidate")
        for b in bindings.values():
            b.policy = pol
        per_window = window_perplexities(model, eval_inputs)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(ppl=f"{_pooled(per_window):.4f}")
        return per_window

    choice = {names[n]: "full" for n in bindings}
    full = windows_of(choice)
    ppl_full = ppl = _pooled(full)
    limits = [p * (1 + max_ppl_increase * (1 - margin)) for p, _ in full]
    trace = []
    for stage, p in enumerate(reversed(order)):  # safest first
        slower = set(order[len(order) - stage:]) if stage else {"full"}  # where a layer can come from
        cands = sorted((n for n, c in choice.items() if c in slower), key=lambda n: _sensitivity(errors[n], p))
        cands = [n for n in cands if math.isfinite(_sensitivity(errors[n], p))]
        lo, hi, mid = 0, len(cands), len(cands)
        while lo < hi:
            per_window = windows_of({**choice, **{n: p for n in cands[:mid]}})
            ok = all(w <= lim for (w, _), lim in zip(per_window, limits))
            trace.append((p, mid, _pooled(per_window), ok))
            if ok:
                lo, ppl = mid, _pooled(per_window)
            else:
                hi = mid - 1
            mid = (lo + hi + 1) // 2
        choice.update({n: p for n in cands[:lo]})
    if bar is not None:
        bar.close()
    return choice, ppl_full, ppl, trace


def calibrate(model_or_pipe, inputs=None, *, out=None, min_cos=0.999, max_rel_l1=None, precisions=None,
              max_calls=8, max_heads=4, heatmap=None, bench=None, progress=True, return_details=False,
              objective="thresholds", max_ppl_increase=0.005, margin=0.5, eval_inputs=None, base=None):
    """Measure per-layer error of each candidate precision and return the Policy picking, per layer, the fastest
    precision that is accurate enough for the objective.

    objective "thresholds": a layer's precision is the fastest whose worst-case cosine >= min_cos (and worst
    relative L1 <= max_rel_l1 if given). objective "perplexity" (causal LMs): the fewest layers are kept at
    slower precisions such that the perplexity of every window of eval_inputs (default: inputs) stays within
    1 + max_ppl_increase x (1 - margin) times its full-precision perplexity: margin is the share of the budget
    held back for text the calibration has not seen (see _search_perplexity).

    inputs: list of what the model/pipeline is called with: token-id tensors, dicts of keyword arguments, prompt
    strings (pipelines) or argument tuples; None uses random token ids (transformers language models). The
    perplexity objective needs token-id tensors (or dicts with input_ids) of real text.
    out: write the policy as YAML there. heatmap: write a PNG (layers x precisions). bench: per-precision
    kernel speed-ups vs full (dict or JSON path) for the speed-up estimate. return_details: also return the
    Calibration (metrics table, choices).
    base: the policy whose fallback rules, step rules, options and guard the calibrated policy keeps (anything
    `set_policy` takes); None: the policy the model is routed under, else its family default (e.g. the shipped
    llama policy's `fallback.min_seq_len: 128` for transformers LMs, so decode steps stay full). A precision name
    such as "8b" keeps none.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}; got {objective!r}")
    if objective == "perplexity" and not (isinstance(max_ppl_increase, (int, float)) and max_ppl_increase >= 0):
        raise ValueError(f"max_ppl_increase must be a number >= 0 (0.005 = +0.5%); got {max_ppl_increase!r}")
    if objective == "perplexity" and not (isinstance(margin, (int, float)) and 0 <= margin < 1):
        raise ValueError(f"margin must be a number >= 0 and < 1 (0.5: search within half the budget); "
                         f"got {margin!r}")
    precisions = tuple(precisions or SPEED_ORDER)
    for p in precisions:
        check_precision(p, "precisions")
    precisions = tuple(p for p in SPEED_ORDER if p in precisions)  # fastest first
    inputs = _default_inputs(model_or_pipe) if inputs is None else list(inputs)
    if objective == "perplexity":
        eval_inputs = inputs if eval_inputs is None else list(eval_inputs)
        for x in eval_inputs:
            _token_ids(x)
    observer = _Observer(precisions, max_calls, max_heads)
    speeds = _speeds(bench)
    # fastest first: measured kernel speed-ups when given (full = 1.0: a kernel slower than full never wins),
    # else the nominal order fp4 > 4b > 8b
    order = sorted(precisions, key=lambda p: -speeds.get(p, 0.0)) if speeds else list(precisions)
    if speeds:
        order = [p for p in order if speeds.get(p, 0.0) > 1.0]
    ppl_full = ppl = None
    trace = []
    base = None if base is None else Policy.from_any(base)
    with _routed_full(model_or_pipe) as (bindings, saved, routed), torch.no_grad():
        for b in bindings.values():
            b.observer = observer
        it = inputs
        if progress:
            from tqdm.auto import tqdm

            it = tqdm(inputs, desc="calibrating", unit="input")
        for x in it:
            _call(model_or_pipe, x)
        base = routed if base is None else base
        names = {n: b.name for n, b in bindings.items()}
        errors = {names[n]: observer.errors.get(names[n], LayerErrors()) for n in bindings}
        if objective == "perplexity":
            for b in bindings.values():
                b.observer = None
            choice, ppl_full, ppl, trace = _search_perplexity(model_or_pipe, bindings, names, errors, order, base,
                                                              eval_inputs, max_ppl_increase, margin, progress)

    if objective == "thresholds":
        choice = {}
        for name, e in errors.items():
            choice[name] = "full"
            for p in order:
                s = e.summary(p)
                if s and s["cos_worst"] >= min_cos and (max_rel_l1 is None or s["rel_l1_worst"] <= max_rel_l1):
                    choice[name] = p
                    break
        description = (f"sage-patch calibrate: worst cos >= {min_cos}"
                       + (f", worst rel L1 <= {max_rel_l1}" if max_rel_l1 is not None else ""))
    else:
        description = (f"sage-patch calibrate: perplexity within +{100 * max_ppl_increase:g}% of full precision "
                       f"(searched within +{100 * max_ppl_increase * (1 - margin):g}% per calibration window; "
                       f"{ppl:.4f} vs {ppl_full:.4f})")
    policy = _policy_from_choice(choice, base, description + f", candidates {', '.join(precisions)}")
    result = Calibration(policy, precisions, errors, choice, min_cos, max_rel_l1, _speedup(choice, bench),
                         objective=objective, max_ppl_increase=max_ppl_increase if objective == "perplexity" else None,
                         ppl_full=ppl_full, ppl=ppl, trace=trace, margin=margin if objective == "perplexity" else None)
    if out is not None:
        policy.save(out)
    if heatmap is not None:
        result.heatmap(heatmap)
    return (policy, result) if return_details else policy

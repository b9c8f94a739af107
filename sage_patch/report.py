"""Per-layer call statistics and the report users read: which precision ran where, and why it fell back."""
from __future__ import annotations

import itertools
import logging
import weakref
from collections import Counter
from dataclasses import dataclass, field

import torch

logger = logging.getLogger("sage_patch")
_logged_reasons: set[str] = set()

STATS_ATTR = "_sage_patch_stats"  # attribute holding a LayerStats on each routed attention module


def log_fallback_once(reason: str) -> None:
    """Log each distinct fallback reason once per process."""
    if reason not in _logged_reasons:
        _logged_reasons.add(reason)
        # Running the reference where no kernel exists is expected (CPU); anything else deserves a warning.
        level = logging.INFO if reason.startswith("reference simulation") else logging.WARNING
        logger.log(level, "sage_patch fallback: %s", reason)


@dataclass
class LayerStats:
    name: str
    calls: int = 0
    used: Counter = field(default_factory=Counter)       # precision actually used -> calls
    impls: Counter = field(default_factory=Counter)      # implementation ("cuda-mma", "reference", "sdpa") -> calls
    variants: Counter = field(default_factory=Counter)   # kernel variant's unique registry key -> calls (an impl
                                                         # name can cover several variants)
    fallbacks: Counter = field(default_factory=Counter)  # reason -> calls
    requested: Counter = field(default_factory=Counter)  # precision the policy asked for -> calls
    guard: Counter = field(default_factory=Counter)      # runtime-guard demotions (reason -> 1)
    context: Counter = field(default_factory=Counter)    # how calls were distributed (context parallelism) -> calls

    def __post_init__(self):
        self._key = next(_keys)
        _BY_KEY[self._key] = self

    def __setstate__(self, state):  # copies (deepcopy, pickle) get their own key, or traced records would go astray
        self.__dict__.update(state)
        self.__post_init__()

    def record(self, decision) -> None:
        """Count one call. Inside a torch.compile graph the decision is recorded once, when the graph is traced
        (the compiled graph runs without Python, and counting there would make dynamo guard on the counters and
        recompile at every call)."""
        variant = None if decision.variant is None else decision.variant.key
        if torch.compiler.is_compiling():
            _record_traced(self._key, decision.requested, decision.precision, decision.impl, decision.reason,
                           variant)
            return
        self._add(decision.requested, decision.precision, decision.impl, decision.reason, variant)

    def _add(self, requested: str, precision: str, impl: str, reason: str | None, variant: str | None = None) -> None:
        self.calls += 1
        self.used[precision] += 1
        self.impls[impl] += 1
        if variant is not None:
            self.variants[variant] += 1
        self.requested[requested] += 1
        if reason:
            self.fallbacks[reason] += 1

    def record_context(self, context: str) -> None:
        """Note how one counted call was distributed, e.g. "context parallel (ulysses 2 x ring 1) on rank 0 of 2":
        under context parallelism each rank counts the calls it ran, on its shard. Traced: noted once, as `record`."""
        if torch.compiler.is_compiling():
            _record_context_traced(self._key, context)
            return
        self.context[context] += 1

    def reset(self) -> None:
        self.calls = 0
        for c in (self.used, self.impls, self.variants, self.fallbacks, self.requested, self.guard, self.context):
            c.clear()

    def to_dict(self) -> dict:
        d = {"calls": self.calls, "used": dict(self.used), "fallbacks": dict(self.fallbacks),
             "impl": dict(self.impls), "requested": dict(self.requested), "guard": dict(self.guard)}
        if self.variants:
            d["variant"] = dict(self.variants)
        if self.context:
            d["context"] = dict(self.context)
        return d


_keys = itertools.count()
_BY_KEY: "weakref.WeakValueDictionary[int, LayerStats]" = weakref.WeakValueDictionary()


def _record_traced(key: int, requested: str, precision: str, impl: str, reason: str | None,
                   variant: str | None = None) -> None:
    """Runs at trace time only: dynamo calls a function marked constant-result with constant arguments."""
    st = _BY_KEY.get(key)
    if st is not None:
        st._add(requested, precision, impl, reason, variant)


_record_traced._dynamo_marked_constant = True  # what torch._dynamo.assume_constant_result sets, without importing dynamo


def _record_context_traced(key: int, context: str) -> None:
    """`_record_traced` for LayerStats.record_context."""
    st = _BY_KEY.get(key)
    if st is not None:
        st.context[context] += 1


_record_context_traced._dynamo_marked_constant = True


class _NoStats:
    """A stats sink that counts nothing (calls counted elsewhere, e.g. the later K/V chunks of a ring call)."""

    def record(self, decision) -> None:
        pass


NO_STATS = _NoStats()

# Calls made outside any routed layer (plain sage_patch.attention / sdpa / sageattn).
GLOBAL_STATS = LayerStats("<direct calls>")


class Report:
    """`to_dict()` -> {layer: {"calls", "used", "fallbacks", "impl", "requested", "guard"}, plus "variant" (the
    kernel variants' registry keys -> calls) and "context" where there are any}; `str()` is a table."""

    def __init__(self, layers: dict[str, LayerStats]):
        self.layers = layers

    def to_dict(self) -> dict:
        return {name: st.to_dict() for name, st in self.layers.items()}

    def __len__(self) -> int:
        return len(self.layers)

    def __str__(self) -> str:
        if not self.layers:
            return "sage_patch report: no attention layers are routed"
        rows = [("layer", "calls", "used", "impl", "fallbacks")]
        for name, st in self.layers.items():
            notes = ([f"{r} (x{n})" for r, n in st.fallbacks.items()] + list(st.guard)
                     + [f"{c} (x{n})" for c, n in st.context.items()])
            impls = _fmt(st.impls) + (f" [{_fmt(st.variants)}]" if st.variants else "")
            rows.append((name, str(st.calls), _fmt(st.used), impls, "; ".join(notes) or "-"))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = []
        if any(st.context for st in self.layers.values()):
            lines.append("context parallelism: the counts are the calls this rank ran, on its shard of the sequence")
        for i, r in enumerate(rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4])
            if i == 0:
                lines.append("-" * (sum(widths) + 8 + len(r[4])))
        return "\n".join(lines)

    __repr__ = __str__


def _fmt(counter: Counter) -> str:
    return ", ".join(f"{k}:{v}" for k, v in counter.items()) or "-"


def report(obj=None) -> Report:
    """Report of a model (nn.Module), a diffusers pipeline (its module components), or, with no argument,
    of direct calls made outside any routed layer."""
    if obj is None:
        return Report({GLOBAL_STATS.name: GLOBAL_STATS})
    layers: dict[str, LayerStats] = {}
    for prefix, module in _modules_of(obj):
        for name, sub in module.named_modules():
            st = getattr(sub, STATS_ATTR, None)
            if isinstance(st, LayerStats):
                full = f"{prefix}.{name}" if prefix and name else (prefix or name)
                layers[full] = st
    return Report(layers)


def _modules_of(obj):
    import torch

    if isinstance(obj, torch.nn.Module):
        return [("", obj)]
    components = getattr(obj, "components", None)
    if isinstance(components, dict):
        return [(k, v) for k, v in components.items() if isinstance(v, torch.nn.Module)]
    raise TypeError(f"report() takes an nn.Module or a diffusers pipeline; got {type(obj).__name__}")

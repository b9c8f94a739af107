"""Per-layer precision policies, from YAML, a dict or a path.

Schema (first matching layer rule wins; see sage_patch/configs/ for examples):

    default: 8b                      # 8b | 4b | fp4 | full
    training: 8b                     # calls that need a gradient: 8b (SageBwd) | full; absent: the layer's
                                     # precision decides (full stays full, quantized layers train in 8b)
    layers:
      - match: "single_transformer_blocks.*"   # glob on the module name
        precision: full
      - index: "0-1"                 # layer-index range (int, "a-b", or a list of those)
        precision: full
    steps:                           # diffusion only, by denoising step (0-based)
      - first: 2
        precision: full
      - last: 2
        precision: full
      - range: "10-20"
        precision: 4b
    fallback:
      min_seq_len: 128               # Sq or Skv shorter than this uses full
      head_dims: [256]               # these head dims use full
      dtypes: [float32]              # these input dtypes use full
    options:
      smooth_v: false
      exact_4b: false                # true: "4b" layers run 4b even without INT4 tensor cores (sm_90 and newer:
                                     # INT4 values in INT8 MMA, slower than 8b and than SDPA on Hopper); false:
                                     # there they run 8b, the faster and more accurate precision, with the reason
      training_speed_routing: true   # calls that need a gradient run SDPA where it is faster than the training
                                     # kernel (its measured crossover, per GPU, head dim and causal); false: the
                                     # training kernel wherever it can run (SAGE_PATCH_SPEED_ROUTING is inference's)
    guard:                           # runtime guard (off unless given)
      every: 50                      # every 50th call of a layer, one sampled head is recomputed in full
      min_cos: 0.999                 # below this (or above max_rel_l1) the layer is demoted to a safer precision
      max_rel_l1: 0.05

Precedence: a matching step rule overrides the layer rules and the default, except that a layer pinned to
"full" by a layer rule stays full (accuracy exclusions are never undone by a step rule).
"""
from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass, field

import yaml

from .precisions import PRECISIONS

_TOP_KEYS = {"default", "training", "layers", "steps", "fallback", "options", "guard", "name", "description"}
TRAINING = ("8b", "full")  # precisions with a backward pass
_GUARD_KEYS = {"every", "min_cos", "max_rel_l1"}
_FALLBACK_KEYS = {"min_seq_len", "head_dims", "dtypes"}
_OPTION_KEYS = {"smooth_v", "exact_4b", "training_speed_routing"}
_DTYPES = ("float16", "bfloat16", "float32")


class PolicyError(ValueError):
    """A policy that does not validate. The message names the source, the key, the line if known, and what is allowed."""


def _glob_match(name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern)


# torch.compile cannot trace fnmatch (regex compilation); with constant (str) arguments dynamo may run it at trace
# time instead. This is the attribute torch._dynamo.assume_constant_result sets, without importing dynamo here.
_glob_match._dynamo_marked_constant = True


@dataclass(frozen=True)
class LayerRule:
    precision: str
    match: str | None = None
    index: tuple[tuple[int, int], ...] | None = None

    def matches(self, name: str | None, index: int | None) -> bool:
        if self.match is not None and (name is None or not _glob_match(name, self.match)):
            return False
        if self.index is not None and (index is None or not any(a <= index <= b for a, b in self.index)):
            return False
        return True


@dataclass(frozen=True)
class StepRule:
    precision: str
    first: int | None = None
    last: int | None = None
    range: tuple[int, int] | None = None

    def matches(self, step: int, num_steps: int | None) -> bool:
        if self.first is not None:
            return step < self.first
        if self.last is not None:
            return num_steps is not None and step >= num_steps - self.last
        return self.range[0] <= step <= self.range[1]


@dataclass(frozen=True)
class Policy:
    default: str = "8b"
    training: str | None = None          # None: follow the layer's precision (resolve._resolve_training)
    layers: tuple[LayerRule, ...] = ()
    steps: tuple[StepRule, ...] = ()
    min_seq_len: int = 0
    full_head_dims: tuple[int, ...] = ()
    full_dtypes: tuple[str, ...] = ()
    smooth_v: bool = False
    exact_4b: bool = False               # keep "4b" where only INT8 MMA carries it (resolve: otherwise 8b runs)
    training_speed_routing: bool = True  # False: training calls keep the training kernel below its SDPA crossover
    guard_every: int = 0                 # 0: runtime guard off
    guard_min_cos: float = 0.999
    guard_max_rel_l1: float | None = None
    name: str | None = None
    description: str | None = None
    source: str = field(default="<dict>", compare=False)

    # ---- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_any(cls, policy) -> "Policy":
        """A Policy from a Policy, a dict, a path to a YAML file, a YAML string, a precision name, the name of a
        shipped policy (sage_patch/configs/<name>.yaml: "llama", "flux", ...) or None (default)."""
        if policy is None:
            return cls()
        if isinstance(policy, Policy):
            return policy
        if isinstance(policy, dict):
            return cls.from_dict(policy)
        if isinstance(policy, os.PathLike) or (isinstance(policy, str) and (
                policy.endswith((".yaml", ".yml")) or os.path.exists(policy))):
            return load_policy(policy)
        if isinstance(policy, str) and policy in PRECISIONS:
            return cls(default=policy, source=f"precision {policy!r}")
        if isinstance(policy, str) and policy in shipped_policies():
            return shipped_policies()[policy]
        if isinstance(policy, str):
            return cls.from_yaml(policy, source="<string>", argument=policy)
        raise PolicyError(f"policy must be a Policy, dict, YAML path or string, or a precision name; "
                          f"got {type(policy).__name__}")

    @classmethod
    def from_yaml(cls, text: str, source: str = "<string>", argument: str | None = None) -> "Policy":
        """Parse YAML text. `argument`: the string a caller passed as its policy argument, for the message
        when it is neither a file, a precision name nor a YAML mapping."""
        try:
            node = yaml.compose(text, Loader=yaml.SafeLoader)
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
            problem = getattr(e, "problem", None) or str(e)
            raise PolicyError(f"policy {source}: malformed YAML{where}: {problem}") from None
        if argument is not None and not isinstance(data, dict):
            raise PolicyError(f"policy {argument!r}: not a file (no such path), not a shipped policy (allowed: "
                              f"{', '.join(shipped_policies())}), not a precision name (allowed: "
                              f"{', '.join(PRECISIONS)}) and not a YAML mapping; pass a policy file path, a "
                              f"shipped policy or precision name, a dict or YAML text such as 'default: 8b'")
        _check_duplicate_keys(node, source)
        if data is None:
            data = {}
        return cls.from_dict(data, source=source, lines=_line_map(node))

    @classmethod
    def from_dict(cls, data: dict, source: str = "<dict>", lines: dict | None = None) -> "Policy":
        return _Parser(source, lines or {}).policy(data)

    # ---- queries ------------------------------------------------------------------------------------------
    def layer_precision(self, name: str | None = None, index: int | None = None) -> str:
        for rule in self.layers:
            if rule.matches(name, index):
                return rule.precision
        return self.default

    def step_precision(self, step: int | None, num_steps: int | None = None) -> str | None:
        if step is None:
            return None
        for rule in self.steps:
            if rule.matches(step, num_steps):
                return rule.precision
        return None

    def precision_for(self, name: str | None = None, index: int | None = None,
                      step: int | None = None, num_steps: int | None = None) -> str:
        """The precision a layer asks for at a step (before shape fallbacks and kernel availability)."""
        rule = next((r for r in self.layers if r.matches(name, index)), None)
        layer = rule.precision if rule else self.default
        by_step = self.step_precision(step, num_steps)
        if by_step is None or (rule is not None and rule.precision == "full"):
            return layer
        return by_step

    def unmatched_layer_rules(self, layers) -> list[str]:
        """The layer rules that match none of `layers` ((name, index) pairs), each described as in the YAML
        ("layers[1] {'match': 'blocks.*', 'precision': 'full'}")."""
        layers = list(layers)
        return [f"layers[{i}] {_layer_rule_dict(r)}" for i, r in enumerate(self.layers)
                if not any(r.matches(name, index) for name, index in layers)]

    def fallback_reason(self, sq: int, skv: int, head_dim: int, dtype) -> str | None:
        """Why this call must use full precision according to the policy's fallback rules, or None."""
        if min(sq, skv) < self.min_seq_len:
            return f"sequence length {min(sq, skv)} < policy min_seq_len {self.min_seq_len}"
        if head_dim in self.full_head_dims:
            return f"head dim {head_dim} listed in policy fallback.head_dims"
        dt = str(dtype).replace("torch.", "")
        if dt in self.full_dtypes:
            return f"dtype {dt} listed in policy fallback.dtypes"
        return None

    # ---- output -------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d: dict = {"default": self.default}
        if self.training is not None:
            d["training"] = self.training
        if self.name:
            d["name"] = self.name
        if self.description:
            d["description"] = self.description
        if self.layers:
            d["layers"] = [_layer_rule_dict(r) for r in self.layers]
        if self.steps:
            d["steps"] = [_step_rule_dict(r) for r in self.steps]
        fb = {}
        if self.min_seq_len:
            fb["min_seq_len"] = self.min_seq_len
        if self.full_head_dims:
            fb["head_dims"] = list(self.full_head_dims)
        if self.full_dtypes:
            fb["dtypes"] = list(self.full_dtypes)
        if fb:
            d["fallback"] = fb
        d["options"] = {"smooth_v": self.smooth_v}
        if self.exact_4b:
            d["options"]["exact_4b"] = True
        if not self.training_speed_routing:
            d["options"]["training_speed_routing"] = False
        if self.guard_every:
            d["guard"] = {"every": self.guard_every, "min_cos": self.guard_min_cos}
            if self.guard_max_rel_l1 is not None:
                d["guard"]["max_rel_l1"] = self.guard_max_rel_l1
        return d

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def save(self, path) -> None:
        with open(path, "w") as f:
            f.write(self.to_yaml())


def load_policy(path) -> Policy:
    """Load and validate a policy file. Raises PolicyError naming the file, key, line and what is allowed."""
    path = os.fspath(path)
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise PolicyError(f"policy {path}: cannot read file: {e.strerror}") from None
    return Policy.from_yaml(text, source=path)


def shipped_policy_path(family: str) -> str:
    """Path of a policy shipped in sage_patch.configs (e.g. 'llama', 'flux')."""
    from importlib import resources

    return str(resources.files("sage_patch.configs").joinpath(f"{family}.yaml"))


# The shipped policies and the family table, parsed once. Filled by `load_shipped()`, which the transformers and
# diffusers hooks call when they register: torch.compile cannot trace importlib.resources or file reads, and a
# model built with attn_implementation="sage" may look up its default policy for the first time inside a traced
# forward; reading these dicts there is traceable.
_SHIPPED: dict[str, Policy] = {}
_DEFAULTS: dict = {}
_FAMILY_TABLE = "families"  # sage_patch/configs/families.yaml: the default policy per family, not a policy


def load_shipped() -> None:
    """Parse every shipped policy and the family table (idempotent)."""
    if _SHIPPED and _DEFAULTS:
        return
    from importlib import resources

    folder = resources.files("sage_patch.configs")
    names = sorted(f.name[:-len(".yaml")] for f in folder.iterdir() if f.name.endswith(".yaml"))
    _SHIPPED.update({n: load_policy(str(folder.joinpath(f"{n}.yaml"))) for n in names if n != _FAMILY_TABLE})
    _DEFAULTS.update(yaml.safe_load(folder.joinpath(f"{_FAMILY_TABLE}.yaml").read_text()))


def shipped_policies() -> dict[str, Policy]:
    """The policies shipped in sage_patch/configs, by name ("cogvideox", "flux", "hunyuanvideo", "llama", "sd35")."""
    load_shipped()
    return _SHIPPED


def default_policy(library: str, model) -> Policy:
    """The default policy of `model` for an adapter of `library` ("transformers" or "diffusers"), from the family
    table sage_patch/configs/families.yaml (config.model_type for transformers, the class name for diffusers)."""
    load_shipped()
    table = _DEFAULTS[library]
    if library == "transformers":
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        choice = table["model_type"].get(model_type, table["default"])
    else:
        cls = type(model).__name__
        choice = next((fam for key, fam in table["class_contains"].items() if key in cls), table["default"])
    if isinstance(choice, str):
        return _SHIPPED[choice]
    return Policy.from_dict(choice, source=f"<{library} default>")


# ---- parsing helpers -------------------------------------------------------------------------------------------

def _check_duplicate_keys(node, source: str, path: str = "") -> None:
    """PyYAML keeps the last of duplicate mapping keys silently; a policy with two `default:` lines (or two
    `fallback:` blocks) would then not mean what it says. Raise naming the key path and both lines."""
    if isinstance(node, yaml.MappingNode):
        seen: dict = {}
        for k, v in node.value:
            key = k.value
            p = f"{path}.{key}" if path else str(key)
            if key in seen:
                raise PolicyError(f"policy {source}: key '{p}' (line {k.start_mark.line + 1}): duplicate key, "
                                  f"already given at line {seen[key]}; each key may appear once per mapping")
            seen[key] = k.start_mark.line + 1
            _check_duplicate_keys(v, source, p)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            _check_duplicate_keys(v, source, f"{path}[{i}]")


def _line_map(node, path: str = "", out: dict | None = None) -> dict:
    """Map 'a.b[2].c' key paths to 1-based line numbers from a composed YAML node tree."""
    out = {} if out is None else out
    if node is None:
        return out
    out.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            p = f"{path}.{k.value}" if path else str(k.value)
            out[p] = k.start_mark.line + 1
            _line_map(v, p, out)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            _line_map(v, f"{path}[{i}]", out)
    return out


class _Parser:
    def __init__(self, source: str, lines: dict):
        self.source, self.lines = source, lines

    def fail(self, key: str, msg: str):
        line = self.lines.get(key)
        where = f" (line {line})" if line else ""
        what = f"key '{key}'" if key else "the top level"
        raise PolicyError(f"policy {self.source}: {what}{where}: {msg}")

    def precision(self, value, key: str) -> str:
        if value not in PRECISIONS:
            self.fail(key, f"must be one of {', '.join(PRECISIONS)}; got {value!r}")
        return value

    def mapping(self, value, key: str, allowed: set) -> dict:
        if not isinstance(value, dict):
            got = {list: "a list", str: f"the string {value!r}"}.get(type(value), type(value).__name__)
            self.fail(key, f"must be a mapping with keys from {', '.join(sorted(allowed))}; got {got}")
        unknown = sorted(set(map(str, value)) - allowed)
        if unknown:
            self.fail(f"{key}.{unknown[0]}" if key else unknown[0],
                      f"unknown key; allowed: {', '.join(sorted(allowed))}")
        return value

    def nonneg_int(self, value, key: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            self.fail(key, f"must be a non-negative integer; got {value!r}")
        return value

    def int_range(self, value, key: str) -> tuple[int, int]:
        if isinstance(value, int) and not isinstance(value, bool):
            return self.nonneg_int(value, key), value
        if isinstance(value, str):
            parts = value.replace(" ", "").split("-")
            if len(parts) == 1 and parts[0].isdigit():
                return int(parts[0]), int(parts[0])
            if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit() and int(parts[0]) <= int(parts[1]):
                return int(parts[0]), int(parts[1])
        self.fail(key, f"must be an integer or a range 'a-b' with 0 <= a <= b; got {value!r}")

    def policy(self, data) -> Policy:
        self.mapping(data, "", _TOP_KEYS)
        kw: dict = {"source": self.source}
        if "default" in data:
            kw["default"] = self.precision(data["default"], "default")
        if "training" in data:
            if data["training"] not in TRAINING:
                self.fail("training", f"must be one of {', '.join(TRAINING)} (the precisions with a backward "
                                      f"pass); got {data['training']!r}")
            kw["training"] = data["training"]
        for k in ("name", "description"):
            if k in data:
                if not isinstance(data[k], str):
                    self.fail(k, f"must be a string; got {data[k]!r}")
                kw[k] = data[k]
        kw["layers"] = tuple(self.layer_rule(r, f"layers[{i}]") for i, r in enumerate(self.seq(data, "layers")))
        kw["steps"] = tuple(self.step_rule(r, f"steps[{i}]") for i, r in enumerate(self.seq(data, "steps")))
        fb = self.mapping(data.get("fallback") or {}, "fallback", _FALLBACK_KEYS)
        if "min_seq_len" in fb:
            kw["min_seq_len"] = self.nonneg_int(fb["min_seq_len"], "fallback.min_seq_len")
        if "head_dims" in fb:
            hd = fb["head_dims"]
            if not isinstance(hd, list):
                self.fail("fallback.head_dims", f"must be a list of integers; got {hd!r}")
            kw["full_head_dims"] = tuple(self.nonneg_int(x, f"fallback.head_dims[{i}]") for i, x in enumerate(hd))
        if "dtypes" in fb:
            dts = fb["dtypes"]
            if not isinstance(dts, list) or any(x not in _DTYPES for x in dts):
                self.fail("fallback.dtypes", f"must be a list from {', '.join(_DTYPES)}; got {dts!r}")
            kw["full_dtypes"] = tuple(dts)
        opts = self.mapping(data.get("options") or {}, "options", _OPTION_KEYS)
        if "smooth_v" in opts:
            if not isinstance(opts["smooth_v"], bool):
                self.fail("options.smooth_v", f"must be true or false; got {opts['smooth_v']!r}")
            kw["smooth_v"] = opts["smooth_v"]
        if "exact_4b" in opts:
            if not isinstance(opts["exact_4b"], bool):
                self.fail("options.exact_4b", f"must be true or false; got {opts['exact_4b']!r}")
            kw["exact_4b"] = opts["exact_4b"]
        if "training_speed_routing" in opts:
            if not isinstance(opts["training_speed_routing"], bool):
                self.fail("options.training_speed_routing",
                          f"must be true (training calls run SDPA where it is faster than the training kernel) or "
                          f"false (the training kernel wherever it can run); got {opts['training_speed_routing']!r}")
            kw["training_speed_routing"] = opts["training_speed_routing"]
        if "guard" in data:
            g = self.mapping(data["guard"] or {}, "guard", _GUARD_KEYS)
            every = g.get("every", 50)
            if isinstance(every, bool) or not isinstance(every, int) or every < 1:
                self.fail("guard.every", f"must be a positive integer (calls between checks); got {every!r}")
            kw["guard_every"] = every
            if "min_cos" in g:
                kw["guard_min_cos"] = self.fraction(g["min_cos"], "guard.min_cos")
            if g.get("max_rel_l1") is not None:
                kw["guard_max_rel_l1"] = self.fraction(g["max_rel_l1"], "guard.max_rel_l1")
        return Policy(**kw)

    def fraction(self, value, key: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            self.fail(key, f"must be a number between 0 and 1; got {value!r}")
        return float(value)

    def seq(self, data, key):
        value = data.get(key) or []
        if not isinstance(value, list):
            self.fail(key, f"must be a list of rules; got {type(value).__name__}")
        return value

    def layer_rule(self, r, key) -> LayerRule:
        self.mapping(r, key, {"match", "index", "precision"})
        if "precision" not in r:
            self.fail(key, "a layer rule needs 'precision' and at least one of 'match' (glob) or 'index' (range)")
        if "match" not in r and "index" not in r:
            self.fail(key, "a layer rule needs 'match' (a glob on the module name) or 'index' (a layer range)")
        match = r.get("match")
        if match is not None and not isinstance(match, str):
            self.fail(f"{key}.match", f"must be a glob string; got {match!r}")
        index = None
        if "index" in r:
            raw = r["index"] if isinstance(r["index"], list) else [r["index"]]
            index = tuple(self.int_range(x, f"{key}.index") for x in raw)
        return LayerRule(self.precision(r["precision"], f"{key}.precision"), match, index)

    def step_rule(self, r, key) -> StepRule:
        self.mapping(r, key, {"first", "last", "range", "precision"})
        which = [k for k in ("first", "last", "range") if k in r]
        if len(which) != 1 or "precision" not in r:
            self.fail(key, "a step rule needs 'precision' and exactly one of 'first', 'last' or 'range'")
        prec = self.precision(r["precision"], f"{key}.precision")
        w = which[0]
        if w == "range":
            return StepRule(prec, range=self.int_range(r["range"], f"{key}.range"))
        return StepRule(prec, **{w: self.nonneg_int(r[w], f"{key}.{w}")})


def _ranges_repr(index) -> list:
    return [a if a == b else f"{a}-{b}" for a, b in index]


def _layer_rule_dict(r: LayerRule) -> dict:
    d: dict = {}
    if r.match is not None:
        d["match"] = r.match
    if r.index is not None:
        rs = _ranges_repr(r.index)
        d["index"] = rs[0] if len(rs) == 1 else rs
    d["precision"] = r.precision
    return d


def _step_rule_dict(r: StepRule) -> dict:
    if r.first is not None:
        return {"first": r.first, "precision": r.precision}
    if r.last is not None:
        return {"last": r.last, "precision": r.precision}
    return {"range": f"{r.range[0]}-{r.range[1]}", "precision": r.precision}

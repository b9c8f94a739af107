"""`sage-patch` command line: info, validate, demo."""
from __future__ import annotations

import argparse
import json
import platform
import sys


def _info(args) -> int:
    import torch

    from . import __version__, kernels
    from .integrations import STATUS

    lines = [f"sage-patch {__version__}", f"python {platform.python_version()}", f"torch {torch.__version__}"]
    for lib in ("transformers", "diffusers"):
        try:
            mod = __import__(lib)
            lines.append(f"{lib} {mod.__version__}: integration {STATUS.get(lib, 'not attempted')}")
        except ImportError:
            lines.append(f"{lib}: not installed")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            cap = torch.cuda.get_device_capability(i)
            lines.append(f"GPU {i}: {torch.cuda.get_device_name(i)} (sm_{cap[0]}{cap[1]})")
    else:
        lines.append("GPU: none visible to torch (quantized precisions run the reference simulation)")
    st = kernels.status()
    if st["loaded"]:
        lines.append(f"kernels: loaded from {st['path']} (archs: {', '.join(st['archs']) or '?'})")
    else:
        lines.append(f"kernels: not loaded: {st['reason']}")
    if kernels.SPEED_ROUTING:
        for impl, table in kernels.SDPA_FASTER_BELOW.items():
            rule = ", ".join(f"D={d}{' causal' if c else ''} < {n}" for (d, c), n in sorted(table.items()))
            lines.append(f"speed routing: {impl} calls run SDPA below the measured crossover ({rule} tokens)")
    else:
        lines.append("speed routing: off (SAGE_PATCH_SPEED_ROUTING=0): the kernels run at every length")
    print("\n".join(lines))
    if args.json:
        print(json.dumps({"kernels": st, "integrations": STATUS}, indent=2, default=str))
    return 0


def _validate(args) -> int:
    from .policy import PolicyError, load_policy

    try:
        pol = load_policy(args.file)
    except PolicyError as e:
        print(str(e), file=sys.stderr)
        return 1
    print(f"{args.file}: valid policy (default {pol.default}, {len(pol.layers)} layer rules, "
          f"{len(pol.steps)} step rules, min_seq_len {pol.min_seq_len})")
    return 0


def _demo(args) -> int:
    from .demo import run_demo

    return run_demo(precisions=args.precisions, seed=args.seed)


def _calibrate(args) -> int:
    import torch

    from .calibrate import calibrate

    if args.pipeline:
        from diffusers import DiffusionPipeline

        obj = DiffusionPipeline.from_pretrained(args.model, torch_dtype=getattr(torch, args.dtype))
        if not args.prompt:
            print("--pipeline needs at least one --prompt", file=sys.stderr)
            return 2
        inputs = [{"prompt": p, "num_inference_steps": args.steps, "output_type": "latent"} for p in args.prompt]
    else:
        from transformers import AutoModelForCausalLM

        obj = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=getattr(torch, args.dtype),
                                                   attn_implementation="sdpa").eval()
        if args.prompt:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(args.model)
            inputs = [tok(p, return_tensors="pt").input_ids for p in args.prompt]
        else:
            g = torch.Generator().manual_seed(0)
            inputs = [torch.randint(0, obj.config.vocab_size, (1, args.tokens), generator=g)
                      for _ in range(args.batches)]
    if torch.cuda.is_available():
        obj = obj.to("cuda")
    policy, result = calibrate(obj, inputs, out=args.out, min_cos=args.min_cos, max_rel_l1=args.max_rel_l1,
                               precisions=args.precisions, max_calls=args.max_calls, max_heads=args.max_heads,
                               heatmap=args.heatmap, bench=args.bench, return_details=True)
    print(result.table())
    print(f"policy written to {args.out}" + (f"; heatmap {args.heatmap}" if args.heatmap else ""))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="sage-patch", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    pi = sub.add_parser("info", help="versions, GPU and arch, which kernels load and why not")
    pi.add_argument("--json", action="store_true", help="also print machine-readable status")
    pi.set_defaults(fn=_info)
    pv = sub.add_parser("validate", help="validate a policy YAML file (exit 1 with the message if bad)")
    pv.add_argument("file")
    pv.set_defaults(fn=_validate)
    pd = sub.add_parser("demo", help="run tiny Flux-style and Llama models with each precision vs full")
    pd.add_argument("--precisions", nargs="+", default=["8b", "4b", "fp4", "full"])
    pd.add_argument("--seed", type=int, default=0)
    pd.set_defaults(fn=_demo)
    pc = sub.add_parser("calibrate", help="measure per-layer error and write the policy meeting your thresholds")
    pc.add_argument("model", help="a transformers causal-LM directory, or a diffusers pipeline with --pipeline")
    pc.add_argument("--out", required=True, help="where to write the policy YAML")
    pc.add_argument("--pipeline", action="store_true", help="MODEL is a diffusers pipeline")
    pc.add_argument("--prompt", action="append", help="sample prompt (repeatable)")
    pc.add_argument("--tokens", type=int, default=512, help="random prompt length when no --prompt (LLM)")
    pc.add_argument("--batches", type=int, default=2, help="random prompts when no --prompt (LLM)")
    pc.add_argument("--steps", type=int, default=20, help="denoising steps per prompt (pipelines)")
    pc.add_argument("--dtype", default="float32", choices=["float16", "bfloat16", "float32"])
    pc.add_argument("--min-cos", type=float, default=0.999)
    pc.add_argument("--max-rel-l1", type=float, default=None)
    pc.add_argument("--precisions", nargs="+", default=None, help="candidates (default: fp4 4b 8b)")
    pc.add_argument("--max-calls", type=int, default=8, help="sampled calls per layer")
    pc.add_argument("--max-heads", type=int, default=4, help="sampled heads per call")
    pc.add_argument("--heatmap", default=None, help="write a layers x precisions PNG here")
    pc.add_argument("--bench", default=None, help="kernel benchmark JSON (scripts/bench_kernel.py output, or {\"speedup_vs_full\": {...}}) "
                         "for the speed-up estimate")
    pc.set_defaults(fn=_calibrate)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())

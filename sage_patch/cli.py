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
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())

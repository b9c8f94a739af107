"""The first call's fixed cost: what a fresh process spends before its first attention output, sage_patch against
torch SDPA in the same run. Each repeat is a new Python process (nothing cached but the OS file cache and the
driver's), timed by phase with perf_counter and a device sync after each GPU phase:

    torch   import torch + CUDA context (one tiny tensor on the GPU)
    import  import sage_patch
    first   the first sage_patch.attention(..., precision="8b") call (imports on first use, library load, launch)
    second  the next call (what every later call costs)
    sdpa    the first torch SDPA call of a process in the same state (the peer: what the user had)

    python benchmarks/first_call.py --out docs/data/h200_first_call.json
    python benchmarks/first_call.py --tree before=/path/to/old/checkout --tree after=. --out out/first_call.json

--tree LABEL=PATH (repeatable) times the package found at PATH (a checkout or a folder holding sage_patch/), so an
older version is measured in the same run. On a machine without a GPU it times the CPU path (reference simulation).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# One fresh process: prints a JSON line of phase times (s) and the heavy modules the first call imported.
CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
cuda = torch.cuda.is_available()
dev = "cuda" if cuda else "cpu"
sync = torch.cuda.synchronize if cuda else (lambda: None)
torch.zeros(1, device=dev); sync()
t1 = time.perf_counter()
q, k, v = (torch.randn(1, 8, N, 128, device=dev, dtype=torch.float16 if cuda else torch.float32) for _ in range(3))
sync()
if MODE == "sdpa":
    t2 = time.perf_counter()
    torch.nn.functional.scaled_dot_product_attention(q, k, v); sync()
    t3 = time.perf_counter()
    torch.nn.functional.scaled_dot_product_attention(q, k, v); sync()
    t4 = time.perf_counter()
    print(json.dumps({"torch": t1 - t0, "first": t3 - t2, "second": t4 - t3}))
    sys.exit()
t2 = time.perf_counter()
import sage_patch
t3 = time.perf_counter()
sage_patch.attention(q, k, v, layout="bhsd", precision="8b"); sync()
t4 = time.perf_counter()
sage_patch.attention(q, k, v, layout="bhsd", precision="8b"); sync()
t5 = time.perf_counter()
impl = dict(sage_patch.report().to_dict()["<direct calls>"]["impl"])
heavy = sorted(m for m in ("torch._dynamo", "triton", "transformers", "diffusers") if m in sys.modules)
print(json.dumps({"torch": t1 - t0, "import": t3 - t2, "first": t4 - t3, "second": t5 - t4, "impl": impl,
                  "imported": heavy}))
"""


def run_child(tree: str | None, mode: str, n: int) -> dict:
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(tree)] + [p for p in [env.get("PYTHONPATH")] if p])
    code = f"N = {n}\nMODE = {mode!r}\n" + CHILD
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd="/")
    if r.returncode != 0:
        raise RuntimeError(f"first-call child ({mode}, tree {tree}) failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def summarize(runs: list[dict]) -> dict:
    keys = [k for k, v in runs[0].items() if isinstance(v, float)]
    out = {k: statistics.median(r[k] for r in runs) for k in keys}
    for k in ("impl", "imported"):
        if k in runs[0]:
            out[k] = runs[-1][k]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", default=[], metavar="LABEL=PATH",
                    help="time the sage_patch at PATH under LABEL (default: this checkout as 'current')")
    ap.add_argument("--reps", type=int, default=3, help="fresh processes per row (median; default 3)")
    ap.add_argument("--tokens", type=int, default=4096, help="sequence length of the call (default 4096: above "
                                                             "the Hopper kernel's crossover, so the kernel runs)")
    ap.add_argument("--out", default=None, help="JSON file to write (docs/data/<gpu>_first_call.json)")
    a = ap.parse_args(argv)
    trees = [t.split("=", 1) for t in a.tree] or [["current", ROOT]]
    for t in trees:
        if len(t) != 2 or not os.path.isdir(os.path.join(t[1], "sage_patch")):
            ap.error(f"argument --tree: {'='.join(t)!r} is not LABEL=PATH with PATH/sage_patch")
    sys.path.insert(0, HERE)
    from timing import run_meta  # noqa: E402  benchmarks/timing.py (imports torch)

    rows = []
    for _ in range(a.reps):  # interleaved: the rows share the machine's state
        for label, path in trees:
            rows.append({"row": label, **run_child(path, "sage", a.tokens)})
        rows.append({"row": "torch SDPA", **run_child(None, "sdpa", a.tokens)})
    labels = [label for label, _ in trees] + ["torch SDPA"]
    summary = [{"row": lab, **summarize([r for r in rows if r["row"] == lab])} for lab in labels]
    for s in summary:
        phases = "  ".join(f"{k} {s[k]:.3f} s" for k in ("torch", "import", "first", "second") if k in s)
        print(f"{s['row']:>12}: {phases}  {s.get('impl', '')} {s.get('imported', '')}")
    if a.out:
        meta = run_meta(tokens=a.tokens, reps=a.reps, trees={lab: os.path.relpath(p, ROOT) for lab, p in trees})
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump({"kind": "first_call", "meta": meta, "rows": summary}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

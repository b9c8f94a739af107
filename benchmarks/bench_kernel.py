#!/usr/bin/env python3
"""Benchmark the compiled "8b" kernel (whole user call, quantization passes included) against torch SDPA's
cuDNN and flash backends, in the same run. Writes bench.md, bench.json and bench.png into --out.

    python benchmarks/bench_kernel.py --out out/bench            # B=4 H=32 fp16, D 64/128, causal or not, N 1K..32K + Flux
    python benchmarks/bench_kernel.py --out out/bench --quick    # a few sizes
    python benchmarks/bench_kernel.py --out out/win --window 4096 --ns 8192,16384,32768   # sliding window, causal
    python benchmarks/bench_kernel.py --out out/padded --ds 80,96,112 --impls sage8b,sage_api,flash,cudnn --no-flux
    python benchmarks/bench_kernel.py --out out/d256 --ds 256 --heads 16,18 --no-flux   # Gemma / Ideogram 4 shapes
        # head dims the kernels lack: ours runs zero-padded to the next native head dim, SDPA at the real one

TOPS = 4*B*H*N*N*D / time, halved for causal, with the call's real D (a padded call is charged the real work, so
its TOPS compare with SDPA's at that D; the row's "padded_to" names the head dim the kernel ran at). Timing: CUDA events via triton.testing.do_bench (median; 25 ms
warm-up, 100 ms of repeats) when triton is present, else a CUDA-event loop with the same policy.
Accuracy: cos / rel L1 / rmse of each implementation against float64 exact attention at one size.
bench.json is what docs/data/<gpu>_kernel.json holds: copy it there and run benchmarks/report.py.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import bench_ms, kernel_split, require_cuda_kernels, run_meta, sdpa_fn, tops  # noqa: E402

import sage_patch.kernels as K  # noqa: E402
from sage_patch.accuracy import compare  # noqa: E402
from sage_patch.reference import exact_attention  # noqa: E402


# sage8b: what a user call runs (the Hopper wgmma kernel on H100/H200, no LSE: the integrations never ask for it);
# the others force one variant
OURS = {"sage8b": None, "sage8b_portable": "fp8-portable", "sage8b_fp8mma": "fp8-mma", "sage8b_fp8f16": "fp8-f16",
        "sage8b_pv16": "fp16", "sage8b_wgmma": "wgmma"}


def api_fn(q, k, v, causal):
    """sage_api: the public call (resolver included: SDPA below the measured crossover, the kernel above)"""
    import sage_patch

    return lambda: sage_patch.attention(q, k, v, is_causal=causal, precision="8b")


def ours_fn(q, k, v, causal, name="sage8b"):
    pv = OURS[name]
    return lambda: K.attention(q, k, v, is_causal=causal, pv=pv, return_lse=False)


def run_one(b, h, n, d, causal, impls):
    g = torch.Generator(device="cuda").manual_seed(n + d)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
    row = {"B": b, "H": h, "N": n, "D": d, "causal": causal}
    pad_to = K.head_dims.padding(d, d)
    if pad_to is not None:
        row["padded_to"] = pad_to
    for name in impls:
        fn = (ours_fn(q, k, v, causal, name) if name in OURS else api_fn(q, k, v, causal) if name == "sage_api"
              else sdpa_fn(name, q, k, v, causal))
        try:
            ms = bench_ms(fn)
            row[name + "_ms"] = ms
            row[name] = tops(b, h, n, d, causal, ms)
        except Exception as e:  # a backend missing for this shape: record why
            row[name] = None
            row[name + "_error"] = f"{type(e).__name__}: {str(e)[:120]}"
    del q, k, v
    torch.cuda.empty_cache()
    return row


def run_window(b, h, n, d, window):
    """A causal sliding window of `window` keys (transformers' sliding_window; window_left = window - 1): our kernel
    with the window, SDPA with the dense bool mask transformers' sdpa path gives it (the memory-efficient backend,
    the whole N x N work), and, for scale, both at plain causal (cuDNN for SDPA)."""
    g = torch.Generator(device="cuda").manual_seed(n + d)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
    i = torch.arange(n, device="cuda")
    mask = ((i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window))[None, None]
    fns = {"sage8b_window": lambda: K.attention(q, k, v, is_causal=True, return_lse=False, window_left=window - 1),
           "sdpa_window_mask": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask),
           "sage8b_causal": ours_fn(q, k, v, True), "cudnn_causal": sdpa_fn("cudnn", q, k, v, True)}
    row = {"B": b, "H": h, "N": n, "D": d, "window": window}
    for name, fn in fns.items():
        row[name + "_ms"] = bench_ms(fn)
    row["speedup_vs_sdpa_mask"] = row["sdpa_window_mask_ms"] / row["sage8b_window_ms"]
    out = K.attention(q, k, v, is_causal=True, return_lse=False, window_left=window - 1)[0]
    row.update({f"vs_float64_{k_}": v_ for k_, v_ in compare(
        out[:, :2].float(), exact_attention(q[:, :2], k[:, :2], v[:, :2], attn_mask=mask)).items()})
    return row


def profile_split(n, b=4, h=32, d=128):
    """Device time of each kernel of one whole call (pre-passes vs attention), from torch.profiler."""
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16) for _ in range(3))
    ms = kernel_split(lambda: K.attention(q, k, v, return_lse=False))
    return {"shape": f"B={b} H={h} N={n} D={d} fp16 non-causal", "ms_per_call": ms}


def accuracy(impls, b=2, h=8, n=4096, d=128):
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(b, h, n, d, device="cuda", generator=g)
    k = torch.randn(b, h, n, d, device="cuda", generator=g) + 4 * torch.randn(d, device="cuda", generator=g)
    v = torch.randn(b, h, n, d, device="cuda", generator=g) + 4 * torch.randn(d, device="cuda", generator=g)
    q, k, v = (x.half() for x in (q, k, v))
    ref = exact_attention(q, k, v)
    res = {"shape": f"q,k,v ~ randn({b},{h},{n},{d}) fp16, K and V + 4*randn(D) per-channel bias; ref float64"}
    for name in impls:
        fn = (ours_fn(q, k, v, False, name) if name in OURS else api_fn(q, k, v, False) if name == "sage_api"
              else sdpa_fn(name, q, k, v, False))
        try:
            out = fn()
            out = out[0] if isinstance(out, tuple) else out
            res[name] = compare(out, ref)
        except Exception as e:
            res[name] = {"error": str(e)[:120]}
    return res


def write_outputs(out_dir, rows, acc, meta, impls):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bench.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "accuracy": acc}, f, indent=1)
    lines = [f"# sage-patch kernel benchmark ({meta['date']})", "",
             f"GPU: {meta['gpu']} (sm_{meta['cc']}), torch {meta['torch']}, CUDA {meta['cuda']}, impl {meta['impl']}",
             f"Command: `{meta['command']}`", "",
             "TOPS = 4*B*H*N*N*D/time (halved for causal), median time of the whole call (sage8b includes its "
             "quantization passes). A head dim the kernels lack natively (D* in the table) runs zero-padded to the "
             "next native one; its TOPS count the real D, as SDPA's.", "",
             "| B | H | D | causal | N | " + " | ".join(impls) + " | sage8b / flash | sage8b / cuDNN |",
             "|---|---|---|---|---|" + "---|" * (len(impls) + 2)]
    for r in rows:
        cells = [f"{r[i]:.1f}" if r.get(i) else "n/a" for i in impls]
        rf = f"{r['sage8b'] / r['flash']:.2f}" if r.get("sage8b") and r.get("flash") else "n/a"
        rc = f"{r['sage8b'] / r['cudnn']:.2f}" if r.get("sage8b") and r.get("cudnn") else "n/a"
        dim = f"{r['D']}* ({r['padded_to']})" if r.get("padded_to") else str(r["D"])
        lines.append(f"| {r['B']} | {r['H']} | {dim} | {'yes' if r['causal'] else 'no'} | {r['N']} | "
                     + " | ".join(cells) + f" | {rf} | {rc} |")
    lines += ["", f"Accuracy ({acc.get('shape', '')}):", "", "| impl | cos | rel L1 | rmse |", "|---|---|---|---|"]
    for i in impls:
        m = acc.get(i, {})
        if "cos" in m:
            lines.append(f"| {i} | {m['cos']:.6f} | {m['rel_l1']:.5f} | {m['rmse']:.5f} |")
        else:
            lines.append(f"| {i} | {m.get('error', 'n/a')} | | |")
    for prof in meta.get("profile") or []:
        lines += ["", f"Device time per kernel of one call ({prof['shape']}), ms:", ""]
        lines += [f"- {k}: {v}" for k, v in prof["ms_per_call"].items()]
    with open(os.path.join(out_dir, "bench.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        combos = [(d, h, c) for d in dict.fromkeys(r["D"] for r in rows if r["B"] == 4)
                  for h in dict.fromkeys(r["H"] for r in rows if r["B"] == 4 and r["D"] == d) for c in (False, True)]
        fig, axes = plt.subplots(1, len(combos), figsize=(5 * len(combos), 4), squeeze=False)
        for ax, (d, h, c) in zip(axes[0], combos):
            sub = [r for r in rows if r["D"] == d and r["H"] == h and r["causal"] == c and r["B"] == 4]
            for i in impls:
                pts = [(r["N"], r[i]) for r in sub if r.get(i)]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=i)
            ax.set_xscale("log", base=2)
            ax.set_title(f"D={d} H={h} {'causal' if c else 'non-causal'}")
            ax.set_xlabel("N")
            ax.set_ylabel("TOPS")
            ax.grid(alpha=0.3)
            ax.legend()
        fig.suptitle(f"{meta['gpu']}: B=4 fp16, whole call")
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "bench.png"), dpi=110)
    except Exception as e:  # matplotlib missing: md/json still written
        print(f"no plot: {e}", file=sys.stderr)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out/bench")
    ap.add_argument("--quick", action="store_true", help="N in 1K, 4K, 16K only")
    ap.add_argument("--ns", default=None, help="comma-separated N list")
    ap.add_argument("--no-accuracy", action="store_true")
    ap.add_argument("--impls", default="sage8b,flash,cudnn",
                    help="comma list of sage8b, sage8b_portable, sage8b_wgmma, sage8b_fp8mma, sage8b_fp8f16, "
                         "sage8b_pv16, flash, cudnn")
    ap.add_argument("--ds", default="128,64",
                    help="comma list of head dims; one the kernels lack natively (e.g. 80,96,112) runs zero-padded "
                         "to the next native one, SDPA at the real one (accuracy: at the first)")
    ap.add_argument("--heads", default="32", help="comma list of head counts H (B=4), e.g. 16,18 (Gemma, Ideogram 4)")
    ap.add_argument("--no-flux", action="store_true")
    ap.add_argument("--profile", default=None, metavar="N",
                    help="also profile one call at B=4 H=32 D=128 N (comma list; torch.profiler): time per kernel of our "
                         "call")
    ap.add_argument("--window", type=int, default=None, metavar="W",
                    help="instead: causal sliding window of W keys at each N, B=4 H=32 per --ds (run_window)")
    a = ap.parse_args()
    require_cuda_kernels()
    ns = [int(x) for x in a.ns.split(",")] if a.ns else ([1024, 4096, 16384] if a.quick else
                                                         [1024, 2048, 4096, 8192, 16384, 32768])
    impls = a.impls.split(",")
    meta = run_meta(impl=K.status()["reason"])
    rows = []
    t0 = time.time()
    if a.window:
        for d in [int(x) for x in a.ds.split(",")]:
            for n in ns:
                rows.append(run_window(4, 32, n, d, a.window))
                print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rows[-1].items()}),
                      flush=True)
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "window.json"), "w") as f:
            json.dump({"kind": "window", "meta": meta, "rows": rows}, f, indent=1)
        return
    for d in [int(x) for x in a.ds.split(",")]:
        for h in [int(x) for x in a.heads.split(",")]:
            for causal in (False, True):
                for n in ns:
                    r = run_one(4, h, n, d, causal, impls)
                    rows.append(r)
                    print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()}),
                          flush=True)
    if not a.no_flux:
        rows.append(run_one(1, 24, 4608, 128, False, impls))  # Flux
        print(json.dumps(rows[-1]), flush=True)
    if a.profile:
        meta["profile"] = [profile_split(int(n)) for n in str(a.profile).split(",")]
        print(json.dumps(meta["profile"]), flush=True)
    acc = {} if a.no_accuracy else accuracy(impls, d=int(a.ds.split(",")[0]))
    print(json.dumps(acc), flush=True)
    meta["seconds"] = round(time.time() - t0, 1)
    write_outputs(a.out, rows, acc, meta, impls)
    print(open(os.path.join(a.out, "bench.md")).read())


if __name__ == "__main__":
    main()

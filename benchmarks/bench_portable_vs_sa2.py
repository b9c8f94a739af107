#!/usr/bin/env python3
"""Our portable mma.sync kernel against the public SageAttention2 mma.sync kernels, same run, same inputs, whole call
(each side's quantization passes included), plus accuracy on structured inputs against float64.

    python benchmarks/sa2_build.py build --src .sa2src --out build/sa2       # once, on the GPU machine
    python benchmarks/bench_portable_vs_sa2.py --sa2 build/sa2 --out out/sa2 # bench.json + bench.md in --out
    cp out/sa2/bench.json docs/data/h100_portable_vs_sa2.json && python benchmarks/report.py

The pairs (what an Ada and an Ampere GPU run; on the H100 the same mma.sync code, from sm_90a SASS):
    portable_fp8   sage_patch kernel "cuda-mma-fp8pv" (kernel id 0): INT8 Q K^T + FP8 e4m3 P~V mma.sync (sm_89 path)
    sa2_fp8        sageattention.sageattn_qk_int8_pv_fp8_cuda, its defaults (per-thread INT8, smooth K,
                   pv_accum_dtype "fp32+fp16"): what sageattn() runs on sm_89
    portable_fp16  sage_patch kernel "cuda-mma-fp16pv" (kernel id 1): INT8 Q K^T + FP16 P~V (sm_80/86 path)
    sa2_fp16       sageattention.sageattn_qk_int8_pv_fp16_cuda(pv_accum_dtype="fp32"): what sageattn() runs on sm_80
    cudnn          torch SDPA, cuDNN backend (fp16, exact): the reference line
Optional: portable_fp8f16 (kernel id 2, the e4m3 values in fp16 MMAs: what the portable path picks on sm_90),
sa2_fp8_f32acc (pv_accum_dtype "fp32+fp32").

Ours is called through sage_patch.kernels.attention(pv=...) (no resolver: the portable kernels have no SDPA speed
routing, so the public call runs the same kernel plus its host-side checks). Timing as benchmarks/bench_kernel.py
(benchmarks/timing.py: triton.testing.do_bench median, 25 ms warm-up, 100 ms of repeats); torch.randn fp16 inputs,
B=4 H=32; TOPS = 4*B*H*N*N*D/time, halved for causal. Accuracy: q with outlier channels (x6), k and v with a
per-channel bias of 4 sigma (the structure real inputs have, tests/conftest.py), fp16, against float64 exact attention.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import bench_ms, kernel_split, run_meta, sdpa_fn, tops  # noqa: E402

# name -> (label, pv mode of our kernel) for ours; (label, SA2 function, its keyword arguments) for theirs
OURS = {"portable_fp8": ("sage portable FP8 P~V (kernel 0)", "fp8-mma"),
        "portable_fp16": ("sage portable FP16 P~V (kernel 1)", "fp16"),
        "portable_fp8f16": ("sage portable FP8-in-FP16 P~V (kernel 2)", "fp8-f16")}
SA2 = {"sa2_fp8": ("SA2 qk_int8_pv_fp8_cuda (sm89 default)", "sageattn_qk_int8_pv_fp8_cuda",
                   {"pv_accum_dtype": "fp32+fp16"}),
       "sa2_fp16": ("SA2 qk_int8_pv_fp16_cuda (sm80 default)", "sageattn_qk_int8_pv_fp16_cuda",
                    {"pv_accum_dtype": "fp32"}),
       "sa2_fp8_f32acc": ("SA2 qk_int8_pv_fp8_cuda fp32+fp32", "sageattn_qk_int8_pv_fp8_cuda",
                          {"pv_accum_dtype": "fp32+fp32"})}
PEERS = {"cudnn": "SDPA cuDNN"}
LABELS = {k: v[0] for k, v in {**OURS, **SA2}.items()} | PEERS
# (ours, theirs): the ratio columns, each of our kernels against the SA2 kernel of the same P~V precision
PAIRS = (("portable_fp8", "sa2_fp8"), ("portable_fp16", "sa2_fp16"), ("portable_fp8f16", "sa2_fp8"),
         ("portable_fp8", "sa2_fp8_f32acc"))
DEFAULT_IMPLS = "portable_fp8,sa2_fp8,portable_fp16,sa2_fp16,cudnn"
DEFAULT_NS = "1024,2048,4096,8192,16384,32768"
ACC_CASES = ((128, False, 4096), (128, True, 4096), (64, False, 4096), (64, True, 4096), (128, False, 16384))


def csv_ints(text: str, name: str, allowed=None) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--{name} must be comma-separated integers, got {text!r}") from None
    bad = [x for x in vals if x < 1 or (allowed is not None and x not in allowed)]
    if not vals or bad:
        raise SystemExit(f"--{name} {text!r}: {bad or 'empty'} not allowed"
                         + (f" (allowed {allowed})" if allowed else " (positive integers)"))
    return vals


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sa2", default=os.environ.get("SA2_DIR"),
                    help="the SA2 build (sa2_build.py build --out), holding sageattention/; env SA2_DIR")
    ap.add_argument("--out", default="out/sa2")
    ap.add_argument("--ns", default=DEFAULT_NS, help="comma-separated sequence lengths")
    ap.add_argument("--ds", default="128,64", help="head dims (64, 128)")
    ap.add_argument("--causal", default="both", choices=("both", "no", "yes"))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--impls", default=DEFAULT_IMPLS, help=f"comma list of {', '.join(LABELS)}")
    ap.add_argument("--no-accuracy", action="store_true")
    ap.add_argument("--profile", default="8192", metavar="N",
                    help="per-kernel device time of one call of ours and SA2's at B H N D=128 non-causal "
                         "(torch.profiler; comma list of N; 'none' to skip)")
    a = ap.parse_args(argv)
    a.ns = csv_ints(a.ns, "ns")
    a.ds = csv_ints(a.ds, "ds", allowed=(64, 128))
    a.impls = [x.strip() for x in a.impls.split(",") if x.strip()]
    unknown = [x for x in a.impls if x not in LABELS]
    if unknown or not a.impls:
        raise SystemExit(f"--impls: unknown {unknown or 'empty list'}; allowed {', '.join(LABELS)}")
    a.profile = [] if a.profile in ("none", "") else csv_ints(a.profile, "profile")
    a.causals = {"both": [False, True], "no": [False], "yes": [True]}[a.causal]
    if a.batch < 1 or a.heads < 1:
        raise SystemExit(f"--batch and --heads must be >= 1, got {a.batch}, {a.heads}")
    if any(i in SA2 for i in a.impls) and not a.sa2:
        raise SystemExit("the SA2 implementations need --sa2 DIR (or SA2_DIR): the output of sa2_build.py build")
    return a


def import_sa2(path: str):
    """The sageattention package built by sa2_build.py in `path`, imported from there (not any installed copy)."""
    pkg = os.path.join(path, "sageattention", "__init__.py")
    if not os.path.exists(pkg):
        raise SystemExit(f"--sa2 {path!r} holds no sageattention/ package: run sa2_build.py build --out {path}")
    sys.path.insert(0, os.path.abspath(path))
    sa = importlib.import_module("sageattention")
    if os.path.dirname(os.path.abspath(sa.__file__)) != os.path.abspath(os.path.dirname(pkg)):
        raise SystemExit(f"imported sageattention from {sa.__file__}, not from --sa2 {path!r}")
    core = importlib.import_module("sageattention.core")
    missing = [f for f, ok in (("_qattn_sm89", core.SM89_ENABLED), ("_qattn_sm80", core.SM80_ENABLED)) if not ok]
    if missing:  # their core.py swallows the import error: show it
        for m in missing:
            importlib.import_module(f"sageattention.{m}")
        raise SystemExit(f"sageattention extensions {missing} did not load")
    return sa


def impl_fn(name: str, q, k, v, causal: bool, sa2=None):
    """A zero-argument whole call of implementation `name` on (B, H, N, D) fp16 tensors; returns the output."""
    if name in OURS:
        import sage_patch.kernels as K

        pv = OURS[name][1]
        return lambda: K.attention(q, k, v, is_causal=causal, pv=pv, return_lse=False)[0]
    if name in SA2:
        fn, kw = getattr(sa2, SA2[name][1]), SA2[name][2]
        return lambda: fn(q, k, v, tensor_layout="HND", is_causal=causal, **kw)
    return sdpa_fn(name, q, k, v, causal)


def variants_used(impls, q) -> dict:
    """Registry name and C kernel id of each of our implementations on this device."""
    import sage_patch.kernels as K

    out = {}
    for i in impls:
        if i in OURS:
            v = K.variant_for(q, OURS[i][1])
            out[i] = {"variant": v.key, "name": v.name, "kernel_id": v.kernel_id}
    return out


def time_row(b, h, n, d, causal, impls, sa2) -> dict:
    g = torch.Generator(device="cuda").manual_seed(n + d)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
    row = {"B": b, "H": h, "N": n, "D": d, "causal": causal}
    for name in impls:
        try:
            fn = impl_fn(name, q, k, v, causal, sa2)
            out = fn()  # first call outside the timing (Triton JIT of SA2's quantization), and a sanity check
            if not bool(torch.isfinite(out).all()):
                raise RuntimeError("non-finite output")
            ms = bench_ms(fn)
            row[name + "_ms"] = ms
            row[name] = tops(b, h, n, d, causal, ms)
        except Exception as e:  # a call this shape cannot run: record why, keep the peers
            row[name] = None
            row[name + "_error"] = f"{type(e).__name__}: {str(e)[:160]}"
    del q, k, v
    torch.cuda.empty_cache()
    return row


def structured_qkv(b, h, n, d, seed, device="cuda"):
    """fp16 q with d//32 outlier channels (x6), k and v with a per-channel bias of 4 sigma."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(b, h, n, d, device=device, generator=g)
    q[..., torch.randperm(d, device=device, generator=g)[: max(1, d // 32)]] *= 6.0
    k = torch.randn(b, h, n, d, device=device, generator=g) + 4.0 * torch.randn(d, device=device, generator=g)
    v = torch.randn(b, h, n, d, device=device, generator=g) + 4.0 * torch.randn(d, device=device, generator=g)
    return q.half(), k.half(), v.half()


def accuracy(impls, sa2, cases=ACC_CASES, b=2, h=8) -> dict:
    """cos and rel. L1 of each implementation against float64 exact attention, per (D, causal, N)."""
    from sage_patch.accuracy import compare
    from sage_patch.reference import exact_attention

    rows = []
    for d, causal, n in cases:
        q, k, v = structured_qkv(b, h, n, d, seed=7 + n + d)
        ref = exact_attention(q, k, v, is_causal=causal)
        row = {"B": b, "H": h, "N": n, "D": d, "causal": causal}
        for name in impls:
            try:
                m = compare(impl_fn(name, q, k, v, causal, sa2)(), ref)
                row[name] = {"cos": m["cos"], "rel_l1": m["rel_l1"]}
            except Exception as e:
                row[name] = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del q, k, v, ref
        torch.cuda.empty_cache()
    return {"inputs": "fp16 q = randn with d//32 outlier channels x6; k, v = randn + 4*randn(D) per-channel bias; "
                      "reference float64 exact attention", "rows": rows}


def profiles(impls, sa2, ns, b, h, d=128) -> list:
    """Device time of each kernel of one whole call (quantization passes vs attention) of ours and SA2's."""
    impls = [i for i in impls if i not in PEERS]
    out = []
    for n in ns:
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16) for _ in range(3))
        out.append({"shape": f"B={b} H={h} N={n} D={d} fp16 non-causal",
                    "ms_per_call": {i: kernel_split(impl_fn(i, q, k, v, False, sa2)) for i in impls}})
        del q, k, v
        torch.cuda.empty_cache()
    return out


def markdown(data: dict) -> str:
    """bench.md: the same tables report.py renders into docs/benchmarks.md."""
    import report

    return "\n".join([f"# Portable kernel vs public SageAttention2 ({data['meta'].get('gpu', '')})", ""]
                     + report.render_portable_vs_sa2(data)) + "\n"


def main(argv=None) -> int:
    a = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (this benchmark times compiled kernels)")
    import sage_patch.kernels as K

    if any(i in OURS for i in a.impls) and not K.status()["loaded"]:
        raise SystemExit(f"sage_patch kernels not usable: {K.status()['reason']}")
    sa2 = import_sa2(a.sa2) if any(i in SA2 for i in a.impls) else None
    probe = torch.zeros(1, 1, 1, 64, device="cuda", dtype=torch.float16)
    build = {}
    if a.sa2 and os.path.exists(os.path.join(a.sa2, "build.json")):
        build = json.load(open(os.path.join(a.sa2, "build.json")))
    meta = run_meta(impl="sage_patch portable mma.sync kernels, sage_patch.kernels.attention(pv=...), whole call",
                    variants=variants_used(a.impls, probe), labels={i: LABELS[i] for i in a.impls},
                    pairs=[list(p) for p in PAIRS if p[0] in a.impls and p[1] in a.impls],
                    sa2_build={k: build.get(k) for k in ("arch", "upstream", "total_s") if k in build},
                    method="fp16 torch.randn inputs, median of triton.testing.do_bench (25 ms warm-up, 100 ms of "
                           "repeats), every implementation on the same tensors in the same run, whole call "
                           "(quantization passes included); SA2 built from source by benchmarks/sa2_build.py")
    t0 = time.time()
    rows = []
    for d in a.ds:
        for causal in a.causals:
            for n in a.ns:
                rows.append(time_row(a.batch, a.heads, n, d, causal, a.impls, sa2))
                print(json.dumps({k: (round(x, 2) if isinstance(x, float) else x) for k, x in rows[-1].items()}),
                      flush=True)
    if a.profile:
        meta["profile"] = profiles(a.impls, sa2, a.profile, a.batch, a.heads)
        print(json.dumps(meta["profile"]), flush=True)
    acc = {} if a.no_accuracy else accuracy(a.impls, sa2)
    meta["seconds"] = round(time.time() - t0, 1)
    data = {"kind": "portable_vs_sa2", "meta": meta, "rows": rows, "accuracy": acc}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "bench.json"), "w") as f:
        json.dump(data, f, indent=1)
    text = markdown(data)
    with open(os.path.join(a.out, "bench.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

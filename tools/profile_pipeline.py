"""Where a diffusers forward spends GPU time, with the original attention and with sage: attention inside a pipeline
can run slower than the same shape alone (pre-passes, the pipeline's bf16 BSHD views), and this shows which kernels.

One forward per policy under torch.profiler: GPU time per kernel name (top rows), the attention kernels' total, and
the q/k/v shapes, strides and dtypes of the first routed call. Full-size config, random bf16 weights.
  python3 tools/profile_pipeline.py --case flux-1024 [--policy 8b] [--top 12]
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_diffusers as bd  # noqa: E402


def kernel_times(model, inputs, reps=3):
    """GPU microseconds per kernel name over `reps` forwards (averaged per forward), and the forwards' wall ms."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        model(**inputs)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                model(**inputs)
            torch.cuda.synchronize()
    per = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name] += e.device_time_total / reps
    return per


def first_call_layout(model, inputs):
    from sage_patch import binding

    seen = []
    orig = binding.LayerBinding.attention

    def spy(self, q, k, v, **kw):
        if not seen:
            seen.append({n: (tuple(x.shape), tuple(x.stride()), str(x.dtype), x.is_contiguous())
                         for n, x in (("q", q), ("k", k), ("v", v))} | {"layout": kw.get("layout")})
        return orig(self, q, k, v, **kw)

    binding.LayerBinding.attention = spy
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        binding.LayerBinding.attention = orig
    return seen[0] if seen else None


def is_attention_kernel(name: str) -> bool:
    n = name.lower()
    return any(s in n for s in ("hopper_", "stats_kernel", "flash", "fmha", "attn", "sdpa", "cudnn"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default="flux-1024", choices=list(bd.CASES))
    ap.add_argument("--policy", default="8b")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    import sage_patch  # noqa: F401

    family, h, w, frames = bd.CASES[args.case]
    model, inputs, tokens = bd.build(family, h, w, frames, torch.device("cuda"), torch.bfloat16, False)
    print(f"{args.case}: {tokens} tokens, {len(model.attn_processors)} attention layers")
    totals = {}
    for label, policy in (("original", None), ("sage", args.policy)):
        if policy:
            model.enable_sage_attention(policy)
            print("first routed call:", first_call_layout(model, inputs))
        per = kernel_times(model, inputs)
        if policy:
            model.disable_sage_attention()
        gpu = sum(per.values()) / 1e3
        attn = sum(t for n, t in per.items() if is_attention_kernel(n)) / 1e3
        totals[label] = (gpu, attn)
        print(f"\n== {label}: GPU time per forward {gpu:.2f} ms, attention kernels {attn:.2f} ms")
        for n, t in per.most_common(args.top):
            print(f"  {t / 1e3:8.3f} ms  {'*' if is_attention_kernel(n) else ' '} {n[:110]}")
    (g0, a0), (g1, a1) = totals["original"], totals["sage"]
    print(f"\nGPU time {g0:.2f} -> {g1:.2f} ms ({g0 / g1:.3f}x); attention kernels {a0:.2f} -> {a1:.2f} ms "
          f"({a0 / a1:.3f}x)")


if __name__ == "__main__":
    main()

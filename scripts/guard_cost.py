"""Measure the runtime guard's cost: time per routed attention call with the guard off and every N calls.

    python scripts/guard_cost.py [--device cuda] [--n 4096] [--heads 24] [--dim 128]

Prints a Markdown table (median of repeated calls; CUDA events on GPU, perf_counter on CPU).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from sage_patch.policy import Policy
from sage_patch.routing import LayerBinding


def time_calls(binding, q, k, v, calls: int) -> float:
    times = []
    for _ in range(calls):
        if q.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            binding.attention(q, k, v)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            binding.attention(q, k, v)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.mean(times[calls // 5:])  # mean, not median: the guard's cost is one call in N


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--calls", type=int, default=100)
    args = ap.parse_args()
    dtype = torch.float16 if args.device == "cuda" else torch.float32
    q, k, v = (torch.randn(1, args.heads, args.n, args.dim, device=args.device, dtype=dtype) for _ in range(3))
    rows = []
    with torch.no_grad():
        base = None
        for every in (0, 100, 50, 10):
            pol = Policy.from_dict({"default": "8b", **({"guard": {"every": every}} if every else {})})
            b = LayerBinding("bench", 0, pol)
            t = time_calls(b, q, k, v, args.calls)
            base = t if base is None else base
            rows.append((every, t, (t / base - 1) * 100))
    print(f"device {args.device}, B=1 H={args.heads} N={args.n} D={args.dim} {dtype}, impl: "
          f"{dict(b.stats.impls)}")
    print("| guard every | ms per call (mean) | overhead |\n|---|---|---|")
    for every, t, over in rows:
        print(f"| {every or 'off'} | {t:.3f} | {over:+.1f}% |")


if __name__ == "__main__":
    main()

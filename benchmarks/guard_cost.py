"""Measure the runtime guard's cost: time per routed attention call with the guard off and every N calls.

    python benchmarks/guard_cost.py [--device cuda] [--n 4096] [--heads 24] [--dim 128]

Prints a Markdown table (mean ms per call after a warm-up fifth; CUDA events on GPU, perf_counter on CPU).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import Timer  # noqa: E402

from sage_patch.policy import Policy  # noqa: E402
from sage_patch.binding import LayerBinding  # noqa: E402


def time_calls(binding, q, k, v, calls: int) -> float:
    """Mean ms per call after the first fifth (mean, not median: the guard's cost is one call in N)."""
    warm = calls // 5
    times = Timer(q.device)(lambda: binding.attention(q, k, v), warm, calls - warm)
    return statistics.mean(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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

#!/usr/bin/env python3
"""Sustained-load speed: each implementation runs back to back for --secs seconds (as in a long diffusion or prefill
job), next to the short-burst median that benchmarks/bench_kernel.py reports (triton do_bench: L2 flush between calls,
~100 ms of repeats). Under sustained load the H200 reaches its power cap (700 W) and lowers the SM clock, by a
different amount for each kernel; nvidia-smi is sampled every 100 ms for the SM clock, the power and the clock event
reasons (0x4: software power cap). Needs a GPU and nvidia-smi.

    python benchmarks/bench_sustained.py --secs 5
    python benchmarks/bench_sustained.py --shapes "4,32,2048,128,1;1,24,4608,128,0"
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernel import ours_fn  # noqa: E402
from timing import bench_ms, require_cuda_kernels, sdpa_fn, tops  # noqa: E402

SHAPES = [(4, 32, 4096, 128, False), (4, 32, 16384, 128, False), (4, 32, 16384, 128, True),
          (4, 32, 16384, 64, False), (1, 24, 4608, 128, False)]


def sustained(fn, secs):
    """(median ms per call over the second half of the run, median SM MHz, median W, clock event reasons)"""
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    e.synchronize()
    chunk = max(1, int(50.0 / max(s.elapsed_time(e), 1e-3)))  # calls per ~50 ms timed chunk
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,clocks_event_reasons.active",
                            "--format=csv,noheader,nounits", "-lms", "100"], stdout=subprocess.PIPE, text=True)
    per_call, t0 = [], time.time()
    while time.time() - t0 < secs:
        s.record()
        for _ in range(chunk):
            fn()
        e.record()
        e.synchronize()
        per_call.append(s.elapsed_time(e) / chunk)
    smi.terminate()
    rows = [r.split(", ") for r in smi.communicate()[0].strip().splitlines()]
    rows = rows[len(rows) // 2:] or rows
    ms = statistics.median(per_call[len(per_call) // 2:])
    return (ms, statistics.median(float(r[0]) for r in rows), statistics.median(float(r[1]) for r in rows),
            "/".join(sorted({r[2].strip() for r in rows})))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--secs", type=float, default=5.0)
    ap.add_argument("--impls", default="sage8b,cudnn")
    ap.add_argument("--shapes", default=None, help="B,H,N,D,causal(0/1) entries separated by ';' (default: 5 shapes)")
    args = ap.parse_args()
    require_cuda_kernels()
    impls = args.impls.split(",")
    shapes = SHAPES if not args.shapes else [
        (*map(int, e.split(",")[:4]), e.split(",")[4] == "1") for e in args.shapes.split(";")]
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, sustained {args.secs:g} s per entry\n")
    print("| B | H | N | D | causal | impl | burst TOPS | sustained TOPS | SM MHz | W | reasons |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for b, h, n, d, causal in shapes:
        g = torch.Generator(device="cuda").manual_seed(n + d)
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
        for name in impls:
            fn = ours_fn(q, k, v, causal, name) if name.startswith("sage8b") else sdpa_fn(name, q, k, v, causal)
            burst = bench_ms(fn)
            ms, mhz, w, why = sustained(fn, args.secs)
            print(f"| {b} | {h} | {n} | {d} | {'yes' if causal else 'no'} | {name} | "
                  f"{tops(b, h, n, d, causal, burst):.1f} | {tops(b, h, n, d, causal, ms):.1f} | {mhz:.0f} | {w:.0f} | "
                  f"{why} |", flush=True)
        del q, k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

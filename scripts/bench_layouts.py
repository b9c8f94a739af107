#!/usr/bin/env python3
"""Whole-call time of the compiled kernel vs cuDNN SDPA (forced) at the user-facing shapes (Flux: B=1 H=24 N=4608
D=128; SD3.5: B=1 H=38 N=4429 D=64; B=4 H=32 N=4096 D=128), per dtype and layout (BHSD / BSHD): median over 15 bursts
of 20 calls between CUDA events (host gaps hidden, as when a pipeline runs ahead), and torch.profiler's per-kernel
device times (with programmatic dependent launch these include each kernel's wait for its predecessor).
BF16_ONLY=1: bfloat16 only. Usage (GPU machine, repo root): python3 scripts/bench_layouts.py"""
import os
import re
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import sage_patch.kernels as K  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

F = torch.nn.functional.scaled_dot_product_attention
SHAPES = [(1, 24, 4608, 128), (1, 38, 4429, 64), (4, 32, 4096, 128)]


def burst_ms(fn, n=20, reps=15):
    """Median ms per call over `reps` bursts of `n` calls between two CUDA events."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / n)
    return statistics.median(times)


def kernel_split(fn, calls=5):
    """Device time per kernel of one call (torch.profiler), as 'name=us' pairs."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = {}
    for ev in prof.events():
        if not str(ev.device_type).endswith("CUDA") or "kernel" not in ev.name:
            continue
        m = re.search(r"(\w+)_kernel", ev.name)
        name = m.group(1) if m else ev.name[:30]
        out[name] = out.get(name, 0.0) + ev.device_time_total / calls
    return " ".join(f"{k}={v:.1f}us" for k, v in out.items())


def main():
    dtypes = (torch.bfloat16,) if os.environ.get("BF16_ONLY") else (torch.float16, torch.bfloat16)
    for B, H, N, D in SHAPES:
        flops = 4 * B * H * N * N * D
        for dt in dtypes:
            for layout in ("bhsd", "bshd"):
                shape = (B, H, N, D) if layout == "bhsd" else (B, N, H, D)
                q, k, v = (torch.randn(shape, device="cuda", dtype=dt) for _ in range(3))
                qt, kt, vt = ((x.transpose(1, 2) if layout == "bshd" else x) for x in (q, k, v))

                def sage():
                    return K.attention(q, k, v, layout=layout, return_lse=False)

                s = burst_ms(sage)
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    c = burst_ms(lambda: F(qt, kt, vt))
                print(f"B{B} H{H} N{N} D{D} {str(dt)[6:]:9s} {layout}: sage {s * 1000:.0f} us "
                      f"({flops / s / 1e9:.0f} TOPS) cudnn {c * 1000:.0f} us ({flops / c / 1e9:.0f}) = {c / s:.3f}x "
                      f"| {kernel_split(sage)}")


if __name__ == "__main__":
    main()

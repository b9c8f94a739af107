#!/usr/bin/env python3
"""Host (CPU) time per attention call, layer by layer, on a shape small enough that the GPU keeps up: the cost a
pipeline pays when it does not run ahead of the GPU. Times N calls without a sync in between (the launch queue
does not fill at these counts), median of R repeats, then a cProfile of the user-facing call.
Usage: python benchmarks/host_overhead.py [B H N D] (default 1 8 256 128)."""
import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import require_cuda_kernels  # noqa: E402

import sage_patch  # noqa: E402
import sage_patch.kernels as K  # noqa: E402

F = torch.nn.functional.scaled_dot_product_attention


def layers(q, k, v) -> dict:
    """The call stack from the public API down, one entry per layer (internal layers that this build does not
    have are left out)."""
    out = {"sage_patch.attention (user API)": lambda: sage_patch.attention(q, k, v),
           "kernels.attention (no resolver)": lambda: K.attention(q, k, v, return_lse=False)}
    from sage_patch.kernels import _ops

    # the custom op and its implementation, with the kernel id a plain call launches
    args = (q, k, v, None, False, False, q.shape[-1] ** -0.5, K.variant_for(q).kernel_id, 8, False, False)
    out["torch.ops.sage_patch.attn"] = lambda: torch.ops.sage_patch.attn(*args)
    out["_ops._attn_impl (no custom op)"] = lambda: _ops._attn_impl(*args)
    out["torch SDPA (peer)"] = lambda: F(q, k, v)
    return out


def per_call_us(fn, n=200, reps=7):
    """Host microseconds per call: n calls without a sync in between, median of reps."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        ts.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", nargs="*", type=int, default=[1, 8, 256, 128], metavar="B H N D")
    B, H, N, D = ap.parse_args().shape
    require_cuda_kernels()
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.float16) for _ in range(3))
    K.SPEED_ROUTING = False  # the user path runs the kernel at this small shape (else it routes to SDPA)
    print(f"host time per call, B={B} H={H} N={N} D={D} fp16 (us, median of 7 x 200 calls)")
    for name, fn in layers(q, k, v).items():
        print(f"  {name:34s} {per_call_us(fn):8.1f}")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(500):
        sage_patch.attention(q, k, v)
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    print("\n".join(s.getvalue().splitlines()[:45]))


if __name__ == "__main__":
    main()

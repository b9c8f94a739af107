#!/usr/bin/env python3
"""Host (CPU) time per attention call, layer by layer, on a shape small enough that the GPU keeps up: the cost a
pipeline pays when it does not run ahead of the GPU. Times N calls without a sync in between (the launch queue
does not fill at these counts), median of R repeats, then a cProfile of the user-facing call.
Usage: host_overhead.py [B H N D] (default 1 8 256 128)."""
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import sage_patch  # noqa: E402
import sage_patch.kernels as K  # noqa: E402
from sage_patch.kernels import _ops  # noqa: E402

B, H, N, D = (int(x) for x in (sys.argv[1:5] if len(sys.argv) >= 5 else (1, 8, 256, 128)))
q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.float16) for _ in range(3))
scale = D ** -0.5
mode = K.variant_for(q).kernel_id  # the kernel id a plain call launches
K.SPEED_ROUTING = False  # the user path runs the kernel at this small shape (else it routes to SDPA)
F = torch.nn.functional.scaled_dot_product_attention
layers = {
    "sage_patch.attention (user API)": lambda: sage_patch.attention(q, k, v),
    "kernels.attention (no resolver)": lambda: K.attention(q, k, v, return_lse=False),
    "torch.ops.sage_patch.attn": lambda: torch.ops.sage_patch.attn(q, k, v, None, False, False, scale, mode, 8, False,
                                                                   False),
    "_ops._attn_impl (no custom op)": lambda: _ops._attn_impl(q, k, v, None, False, False, scale, mode, 8, False,
                                                              False),
    "torch SDPA (peer)": lambda: F(q, k, v),
}


def per_call_us(fn, n=200, reps=7):
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


print(f"host time per call, B={B} H={H} N={N} D={D} fp16 (us, median of 7 x 200 calls)")
for name, fn in layers.items():
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

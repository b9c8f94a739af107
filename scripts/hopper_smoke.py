#!/usr/bin/env python3
"""Quick check of the Hopper kernel before longer runs: wgmma probes, one small and one persistent call vs the
portable kernel. Exit 1 on a mismatch (a hang is caught by the caller's timeout)."""
import sys
import os
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import sage_patch.kernels as K  # noqa: E402
from sage_patch.accuracy import compare  # noqa: E402

print(K.status(), flush=True)
ok = True
for b, h, n, d, causal in [(1, 2, 200, 128, False), (1, 2, 300, 64, True), (4, 32, 2048, 128, True)]:
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", generator=g, dtype=torch.float16) for _ in range(3))
    t = time.time()
    o, l = K.attention(q, k, v, is_causal=causal, pv="wgmma")
    torch.cuda.synchronize()
    p, lp = K.attention(q, k, v, is_causal=causal, pv="fp8-f16")
    m = compare(o, p)
    print(f"b{b} h{h} n{n} d{d} causal={causal}: vs portable {m}, lse maxdiff "
          f"{float((l - lp).abs().max()):.3g}, finite {bool(torch.isfinite(o).all())}, {time.time() - t:.2f}s",
          flush=True)
    ok &= m["cos"] > 0.999
sys.exit(0 if ok else 1)

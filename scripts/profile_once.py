#!/usr/bin/env python3
"""Calls the sage kernel a few times at one shape, for a profiler (ncu) to pick one launch.
Usage: profile_once.py B H N D [causal] [reps]"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import sage_patch.kernels as K  # noqa: E402

b, h, n, d = (int(x) for x in sys.argv[1:5])
causal = len(sys.argv) > 5 and sys.argv[5] == "1"
reps = int(sys.argv[6]) if len(sys.argv) > 6 else 3
q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16) for _ in range(3))
k += 2 * torch.randn(d, device="cuda", dtype=torch.float16)
for _ in range(reps):
    o, _ = K.attention(q, k, v, is_causal=causal, return_lse=False)  # what a user call runs
torch.cuda.synchronize()
print("ok", tuple(o.shape), bool(torch.isfinite(o).all()))

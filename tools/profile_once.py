#!/usr/bin/env python3
"""Calls the sage kernel a few times at one shape, for a profiler (ncu, nsys) to pick one launch:
    ncu --set full -k regex:attn --launch-skip 1 --launch-count 1 -o prof python3 tools/profile_once.py 1 32 8192 128
Usage: profile_once.py B H N D [causal 0/1] [reps]"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from timing import require_cuda_kernels  # noqa: E402

import sage_patch.kernels as K  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name in ("B", "H", "N", "D"):
        ap.add_argument(name, type=int)
    ap.add_argument("causal", nargs="?", type=int, default=0)
    ap.add_argument("reps", nargs="?", type=int, default=3)
    a = ap.parse_args()
    require_cuda_kernels()
    q, k, v = (torch.randn(a.B, a.H, a.N, a.D, device="cuda", dtype=torch.float16) for _ in range(3))
    k += 2 * torch.randn(a.D, device="cuda", dtype=torch.float16)  # a channel bias, as real K has
    for _ in range(a.reps):
        o, _ = K.attention(q, k, v, is_causal=bool(a.causal), return_lse=False)  # what a user call runs
    torch.cuda.synchronize()
    print("ok", tuple(o.shape), bool(torch.isfinite(o).all()))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Whole-call time of the compiled kernel vs cuDNN SDPA (forced) at the user-facing shapes (Flux: B=1 H=24 N=4608
D=128; SD3.5: B=1 H=38 N=4429 D=64; B=4 H=32 N=4096 D=128), per dtype and layout (BHSD / BSHD): median over 15 bursts
of 20 calls between CUDA events (host gaps hidden, as when a pipeline runs ahead), and torch.profiler's per-kernel
device times (with programmatic dependent launch these include each kernel's wait for its predecessor).
BF16_ONLY=1: bfloat16 only. Usage (GPU machine, repo root): python3 benchmarks/bench_layouts.py"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import burst_ms, forced_sdpa, kernel_split, require_cuda_kernels, tops  # noqa: E402

import sage_patch.kernels as K  # noqa: E402

F = torch.nn.functional.scaled_dot_product_attention
SHAPES = [(1, 24, 4608, 128), (1, 38, 4429, 64), (4, 32, 4096, 128)]


def split_us(fn) -> str:
    """Device time per kernel of one call, as 'name=us' pairs."""
    return " ".join(f"{k.removesuffix('_kernel')}={v * 1000:.1f}us" for k, v in kernel_split(fn).items()
                    if k != "total")


def main():
    import argparse

    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    require_cuda_kernels()
    dtypes = (torch.bfloat16,) if os.environ.get("BF16_ONLY") else (torch.float16, torch.bfloat16)
    for B, H, N, D in SHAPES:
        for dt in dtypes:
            for layout in ("bhsd", "bshd"):
                shape = (B, H, N, D) if layout == "bhsd" else (B, N, H, D)
                q, k, v = (torch.randn(shape, device="cuda", dtype=dt) for _ in range(3))
                qt, kt, vt = ((x.transpose(1, 2) if layout == "bshd" else x) for x in (q, k, v))

                def sage():
                    return K.attention(q, k, v, layout=layout, return_lse=False)

                s = burst_ms(sage)
                with forced_sdpa("cudnn"):
                    c = burst_ms(lambda: F(qt, kt, vt))
                print(f"B{B} H{H} N{N} D{D} {str(dt)[6:]:9s} {layout}: sage {s * 1000:.0f} us "
                      f"({tops(B, H, N, D, False, s):.0f} TOPS) cudnn {c * 1000:.0f} us ({tops(B, H, N, D, False, c):.0f}) = {c / s:.3f}x "
                      f"| {split_us(sage)}")


if __name__ == "__main__":
    main()

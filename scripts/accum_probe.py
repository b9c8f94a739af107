#!/usr/bin/env python3
"""Accuracy of the Hopper kernel against float64 at long N, on sampled query rows: for comparing accumulation schemes
(two-level vs single-level FP8 P~V) built as separate libraries (SAGE_PATCH_KERNELS_LIB). Prints one line per case."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import sage_patch.kernels as K  # noqa: E402
from sage_patch.accuracy import compare  # noqa: E402


def exact_rows(q, k, v, rows):
    """float64 attention for the query rows `rows` (all batches and heads)."""
    qs = q[:, :, rows].double() * q.shape[-1] ** -0.5
    s = qs @ k.double().transpose(-1, -2)
    return torch.softmax(s, dim=-1) @ v.double()


def case(name, n, d=128, h=4, qmul=1.0, bias=4.0, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, h, n, d, device="cuda", generator=g) * qmul
    k = torch.randn(1, h, n, d, device="cuda", generator=g) + bias * torch.randn(d, device="cuda", generator=g)
    v = torch.randn(1, h, n, d, device="cuda", generator=g) + bias * torch.randn(d, device="cuda", generator=g)
    q, k, v = (x.half() for x in (q, k, v))
    o, _ = K.attention(q, k, v, is_causal=False, pv="wgmma")
    rows = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:384].sort().values.cuda()
    ref = exact_rows(q, k, v, rows)
    m = compare(o[:, :, rows], ref)
    print(f"{name} n={n} d={d}: cos {m['cos']:.6f} rel_l1 {m['rel_l1']:.5f} rmse {m['rmse']:.5f}", flush=True)


for n in (4096, 32768):
    case("randn+bias", n)
    case("flat(q*0.1)", n, qmul=0.1)
    case("peaked(q*3)", n, qmul=3.0)

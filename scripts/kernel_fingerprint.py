#!/usr/bin/env python3
"""Bit-identity check of two kernel builds: `--save F` runs the compiled kernel (SAGE_PATCH_KERNELS_LIB picks the
build) on fixed-seed inputs over the feature matrix (D, dtype, causal, GQA, key padding, varlen, smooth V, BSHD, odd
lengths) and saves outputs and LSEs; `--compare A B` reports per case whether they are bitwise equal. Exit 1 if not.
For refactors that must not change results (pre-pass rewrites, scheduling), checked on the device."""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

CASES = [  # name, B, Hq, Hkv, Sq, Skv, D, dtype, causal, masked, smooth_v, layout
    ("d128-fp16", 2, 4, 4, 1000, 1000, 128, torch.float16, False, False, False, "bhsd"),
    ("d128-bf16-causal", 2, 4, 4, 777, 777, 128, torch.bfloat16, True, False, False, "bhsd"),
    ("d64-fp16-gqa", 2, 8, 2, 515, 900, 64, torch.float16, False, False, False, "bhsd"),
    ("d64-bf16-causal-bshd", 1, 4, 4, 640, 1300, 64, torch.bfloat16, True, False, False, "bshd"),
    ("d128-kmask", 2, 4, 2, 384, 1029, 128, torch.float16, False, True, False, "bhsd"),
    ("d128-smoothv", 1, 4, 4, 1000, 1111, 128, torch.float16, False, False, True, "bhsd"),
    ("d128-long", 1, 8, 8, 4096, 4096, 128, torch.float16, False, False, False, "bhsd"),
]


def inputs(case, seed):
    name, B, Hq, Hkv, Sq, Skv, D, dt, causal, masked, smooth_v, layout = case
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, Hq, Sq, D, device="cuda", generator=g)
    k = torch.randn(B, Hkv, Skv, D, device="cuda", generator=g) + 3 * torch.randn(D, device="cuda", generator=g)
    v = torch.randn(B, Hkv, Skv, D, device="cuda", generator=g) + 2 * torch.randn(D, device="cuda", generator=g)
    q, k, v = (x.to(dt) for x in (q, k, v))
    if layout == "bshd":
        q, k, v = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    mask = None
    if masked:
        mask = torch.rand(B, Skv, device="cuda", generator=g) > 0.2  # (B, Skv) key-padding mask, True = attend
        mask[:, 0] = True
    return q, k, v, mask


def run_all():
    import sage_patch.kernels as K

    res = {}
    for i, case in enumerate(CASES):
        q, k, v, mask = inputs(case, 1234 + i)
        o, l = K.attention(q, k, v, layout=case[11], is_causal=case[8], attn_mask=mask, pv="wgmma",
                           smooth_v=case[10])
        res[case[0]] = (o.cpu(), l.cpu())
    # varlen: three packed sequences of different lengths (one shorter than a block)
    g = torch.Generator(device="cuda").manual_seed(99)
    lens = [700, 90, 1333]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
    tot = int(cu[-1])
    q, k, v = (torch.randn(tot, 4, 128, device="cuda", generator=g).half() for _ in range(3))
    o, l = K.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), is_causal=True, pv="wgmma")
    res["varlen-causal"] = (o.cpu(), l.cpu())
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--save")
    ap.add_argument("--compare", nargs=2)
    a = ap.parse_args()
    if a.save:
        torch.save(run_all(), a.save)
        print(f"saved {a.save}")
        return 0
    x, y = (torch.load(f) for f in a.compare)
    ok = True
    for name in x:
        (o1, l1), (o2, l2) = x[name], y[name]
        same = torch.equal(o1, o2) and torch.equal(l1, l2)
        nd = int((o1 != o2).sum())
        dmax = float((o1.float() - o2.float()).abs().max())
        print(f"{name:24s} {'identical' if same else f'DIFFERENT: {nd} outputs differ, max {dmax:.3g}'}")
        ok &= same
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Bit-identity check of two kernel builds: `--save F` runs the compiled kernel (SAGE_PATCH_KERNELS_LIB picks the
build) on fixed-seed inputs over the feature matrix (D, dtype, causal, GQA, key padding, varlen, smooth V, BSHD, odd
lengths) and saves outputs and LSEs; `--compare A B` reports per case whether they are bitwise equal. Exit 1 if not.
For refactors that must not change results (pre-pass rewrites, scheduling), checked on the device. Covers the sm_90a
Hopper kernel (pv "wgmma", on an sm_90 GPU with an sm_90a build; also without the LSE and with a sliding window,
"<case>/nolse", "/win300", "/win300-nolse") and the portable mma.sync kernel: "8b" in each
P~V mode the GPU has (fp8-f16, fp8-mma: sm_89+; fp16) and "4b" with INT8 and INT4 MMA (case names
"<case>/<pv>/<precision>[/<qk>]"). Old vs new build in one run:
    SAGE_PATCH_KERNELS_LIB=old/libsage_kernels.so python tools/kernel_fingerprint.py --save old.pt
    SAGE_PATCH_KERNELS_LIB=new/libsage_kernels.so python tools/kernel_fingerprint.py --save new.pt
    python tools/kernel_fingerprint.py --compare old.pt new.pt"""
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
    ("d256-fp16", 2, 4, 4, 1000, 1000, 256, torch.float16, False, False, False, "bhsd"),
    ("d256-bf16-causal-gqa", 1, 8, 2, 777, 900, 256, torch.bfloat16, True, False, False, "bhsd"),
    ("d256-kmask-smoothv", 1, 4, 4, 600, 1029, 256, torch.float16, False, True, True, "bhsd"),
    ("d256-long", 1, 8, 8, 4096, 4096, 256, torch.float16, False, False, False, "bhsd"),
]
# the Hopper kernel only (its instantiations the cases above miss): without the LSE (the split tail runs only
# there) and with a sliding window (window_left), each with and without the LSE
HOPPER_ONLY = ("d128-long", "d256-fp16", "d256-bf16-causal-gqa", "d256-kmask-smoothv", "d256-long")
HOPPER_EXTRA = [  # (name suffix, return_lse, window_left)
    ("nolse", False, -1), ("win300", True, 300), ("win300-nolse", False, 300)]


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


# portable kernel variants: (pv, precision, qk); the FP8 P~V modes need sm_89+
PORTABLE = [("fp8-f16", "8b", None), ("fp8-mma", "8b", None), ("fp16", "8b", None), ("fp8-f16", "4b", "int8"),
            ("fp8-f16", "4b", "int4"), ("fp16", "4b", "int8")]


def run_all():
    import sage_patch.kernels as K

    cc = torch.cuda.get_device_capability()
    hopper = cc == (9, 0) and "90a" in K.status()["archs"]
    variants = ([("wgmma", "8b", None)] if hopper else []) + [x for x in PORTABLE if x[0] == "fp16" or cc >= (8, 9)]
    res = {}
    for pv, prec, qk in variants:
        for i, case in enumerate(CASES):
            if pv != "wgmma" and case[0] in HOPPER_ONLY:
                continue  # (the portable kernels: the short cases are enough; their D=256 is not the Hopper one's)
            q, k, v, mask = inputs(case, 1234 + i)
            o, l = K.attention(q, k, v, layout=case[11], is_causal=case[8], attn_mask=mask, pv=pv, precision=prec,
                               qk=qk, smooth_v=case[10])
            name = case[0] if pv == "wgmma" else "/".join([case[0], pv, prec] + ([qk] if qk else []))
            res[name] = (o.cpu(), l.cpu())
            if pv != "wgmma":
                continue
            for suffix, lse, window in HOPPER_EXTRA:
                o, l = K.attention(q, k, v, layout=case[11], is_causal=case[8], attn_mask=mask, pv=pv,
                                   precision=prec, qk=qk, smooth_v=case[10], return_lse=lse, window_left=window)
                res[f"{case[0]}/{suffix}"] = (o.cpu(), l.cpu() if lse else torch.empty(0))
        # varlen: three packed sequences of different lengths (one shorter than a block)
        g = torch.Generator(device="cuda").manual_seed(99)
        lens = [700, 90, 1333]
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
        tot = int(cu[-1])
        q, k, v = (torch.randn(tot, 4, 128, device="cuda", generator=g).half() for _ in range(3))
        o, l = K.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), is_causal=True, pv=pv, precision=prec,
                                  qk=qk)
        res["varlen-causal" if pv == "wgmma" else "/".join(["varlen-causal", pv, prec] + ([qk] if qk else []))] = (
            o.cpu(), l.cpu())
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--save", help="run every case with this build and save outputs + LSEs here")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two saved files bitwise")
    a = ap.parse_args()
    if not a.save and not a.compare:
        ap.error("give --save FILE or --compare A B")
    if a.save and not torch.cuda.is_available():
        sys.exit("--save needs a CUDA GPU")
    if a.save:
        import sage_patch.kernels as K

        res = run_all()
        torch.save(res, a.save)
        print(f"saved {a.save}: {len(res)} cases, library {K.status().get('path')}")
        return 0
    x, y = (torch.load(f) for f in a.compare)
    ok = True
    for name in sorted(set(x) ^ set(y)):
        print(f"{name:40s} MISSING in {'the second' if name in x else 'the first'} file")
        ok = False
    for name in x:
        if name not in y:
            continue
        (o1, l1), (o2, l2) = x[name], y[name]
        same = torch.equal(o1, o2) and torch.equal(l1, l2)
        nd = int((o1 != o2).sum())
        dmax = float((o1.float() - o2.float()).abs().max())
        print(f"{name:40s} {'identical' if same else f'DIFFERENT: {nd} outputs differ, max {dmax:.3g}'}")
        ok &= same
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Per attention kernel of a built library: registers, stack/spill bytes (cuobjdump --dump-resource-usage) and counts
of the instructions that tell the paths apart (tensor-core MMAs, TMA copies, barriers, local loads/stores).
Use it to check that a change keeps registers and spills equal or better.
Usage: python tools/sass_summary.py [LIB] [--all]   (LIB default: sage_patch/kernels/libsage_kernels.so)"""
import argparse
import collections
import re
import shutil
import subprocess
import sys

OPS = ("IMMA", "HMMA", "QMMA", "HGMMA", "IGMMA", "QGMMA", "UBLKCP", "UTMALDG", "SYNCS", "LDSM", "LDL", "STL", "F2FP",
       "MUFU")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("lib", nargs="?", default="sage_patch/kernels/libsage_kernels.so")
    ap.add_argument("--all", action="store_true", help="every kernel, not only the attention kernels")
    a = ap.parse_args()
    if not shutil.which("cuobjdump"):
        sys.exit("cuobjdump not found (CUDA toolkit)")
    keep = (lambda f: True) if a.all else (lambda f: "attn" in f or "quant" in f)
    res = subprocess.run(["cuobjdump", "--dump-resource-usage", a.lib], capture_output=True, text=True).stdout
    cur = None
    for line in res.splitlines():
        m = re.search(r"Function (\S+):", line)
        if m:
            cur = m.group(1)
            continue
        m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", line)
        if cur and m and keep(cur):
            print(f"{cur[-80:]}: REG {m.group(1)} STACK {m.group(2)} SHARED {m.group(3)} LOCAL {m.group(4)}")
    sass = subprocess.run(["cuobjdump", "--dump-sass", a.lib], capture_output=True, text=True).stdout
    cur, counts = None, collections.OrderedDict()
    for line in sass.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            cur = m.group(1)
            counts[cur] = collections.Counter()
            continue
        if cur:
            for op in OPS:
                if re.search(r"\b" + op + r"(\b|\.)", line):
                    counts[cur][op] += 1
    for f, c in counts.items():
        if keep(f):
            print(f[-80:], dict(c))


if __name__ == "__main__":
    main()

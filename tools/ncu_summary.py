#!/usr/bin/env python3
"""Summarise an `ncu --page source --csv --print-source sass` export: stall reasons over the kernel, the hottest
instructions with their main stall reasons, and executed instructions per opcode. Usage: python tools/ncu_summary.py CSV [top]"""
import argparse
import collections
import csv

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("csv", help="ncu --page source --csv --print-source sass export")
ap.add_argument("top", nargs="?", type=int, default=40, help="hottest instructions to list")
args = ap.parse_args()
rows = list(csv.reader(open(args.csv)))
top = args.top
hdr = rows[1]
data = [dict(zip(hdr, r)) for r in rows[2:] if len(r) == len(hdr)]
num = lambda x: float(x.replace(",", "")) if x not in ("", "-") else 0.0  # noqa: E731
stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
tot = collections.Counter()
for d in data:
    for s in stalls:
        tot[s] += num(d[s])
allsamp = sum(num(d["Warp Stall Sampling (All Samples)"]) for d in data)
print(f"instructions {len(data)}, samples {allsamp:.0f}")
for s, v in tot.most_common(12):
    print(f"  {s:28s} {100 * v / max(allsamp, 1):5.1f}%")
ops = collections.Counter()
for d in data:
    op = d["Source"].strip().split()
    if not op:
        continue
    o = op[0] if not op[0].startswith("@") else op[1]
    ops[o.split(".")[0]] += num(d["Instructions Executed"])
te = sum(ops.values())
print(f"warp instructions executed {te:.3g}; by opcode:")
print("  " + ", ".join(f"{o} {100 * v / te:.1f}%" for o, v in ops.most_common(24)))
print(f"top {top} instructions by samples:")
for i, d in sorted(enumerate(data), key=lambda x: -num(x[1]["Warp Stall Sampling (All Samples)"]))[:top]:
    s = num(d["Warp Stall Sampling (All Samples)"])
    main = sorted(((num(d[k]), k[6:]) for k in stalls), reverse=True)[:3]
    print(f"  #{i:5d} {100 * s / allsamp:5.2f}%  exec {num(d['Instructions Executed']):9.3g}  {d['Source'].strip()[:60]:60s} "
          + " ".join(f"{k}:{100 * v / max(s, 1):.0f}" for v, k in main if v))

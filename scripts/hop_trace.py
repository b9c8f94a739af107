#!/usr/bin/env python3
"""Where a Hopper-kernel tile's time goes: needs a library built with -DSAGE_HOP_TRACE=1 (SAGE_PATCH_KERNELS_LIB).
Per shape, one warm call, then one traced call; prints the median cycles per phase of the CTAs' first tiles:
prologue (Q quantization), block 0 (first S + softmax), loop (the other blocks), epilogue (last merge, next tile,
stores), and the cycles per block of the loop. Usage: hop_trace.py [B H N D causal] ..."""
import ctypes
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import sage_patch.kernels as K  # noqa: E402
from sage_patch.kernels import _lib  # noqa: E402

CTAS, TILES, EV = 132, 8, 8
shapes = [tuple(int(x) for x in a.split(",")) for a in sys.argv[1:]] or [
    (4, 32, 1024, 128, 0), (4, 32, 1024, 128, 1), (4, 32, 4096, 128, 0), (4, 32, 16384, 128, 0)]
h = _lib.get().handle
h.sage_hop_trace_read.argtypes = [ctypes.c_void_p, ctypes.c_int]
buf0 = (ctypes.c_longlong * (CTAS * 2 * TILES * EV))()
for b, hh, n, d, causal in shapes:
    q, k, v = (torch.randn(b, hh, n, d, device="cuda", dtype=torch.float16) for _ in range(3))
    for _ in range(2):
        K.attention(q, k, v, is_causal=bool(causal), return_lse=False)
        torch.cuda.synchronize()
        if _ == 0:
            h.sage_hop_trace_read(buf0, CTAS * 2 * TILES * EV)  # clears the previous shape's entries
    buf = (ctypes.c_longlong * (CTAS * 2 * TILES * EV))()
    assert h.sage_hop_trace_read(buf, CTAS * 2 * TILES * EV) == 0
    ph = {"prologue": [], "block0": [], "loop": [], "epilogue": [], "tile": [], "per_block": [], "gap": []}
    for c in range(CTAS):
        for w in range(2):
            prev_end = None
            for t in range(TILES):
                e = [buf[((c * 2 + w) * TILES + t) * EV + i] for i in range(EV)]
                if e[0] == 0 or e[4] < e[0]:
                    break
                nkb = e[6]
                ph["prologue"].append(e[1] - e[0])
                ph["block0"].append(e[2] - e[1])
                ph["loop"].append(e[3] - e[2])
                ph["epilogue"].append(e[4] - e[3])
                ph["tile"].append(e[4] - e[0])
                if nkb > 1:
                    ph["per_block"].append((e[3] - e[2]) / (nkb - 1))
                if prev_end is not None:
                    ph["gap"].append(e[0] - prev_end)
                prev_end = e[4]
    med = {k2: (statistics.median(x) if x else float("nan")) for k2, x in ph.items()}
    print(f"B{b} H{hh} N{n} D{d} causal={causal}: tiles {len(ph['tile'])}, median cycles: " +
          ", ".join(f"{k2} {v2:.0f}" for k2, v2 in med.items()), flush=True)

# -DSAGE_HOP_TRACE=2 builds: the loop of each CTA's first tile, per iteration (of the last shape run); 4 warpgroup slots
NWG = int(os.environ.get("HOP_NWG", "2"))  # consumer warpgroups of the traced kernel (>= 3: serial blocks)
if hasattr(h, "sage_hop_ltrace_read"):
    IT, LEV, WS = 16, 8, 4
    lb = (ctypes.c_longlong * (CTAS * WS * IT * LEV))()
    h.sage_hop_ltrace_read.argtypes = [ctypes.c_void_p, ctypes.c_int]
    assert h.sage_hop_ltrace_read(lb, CTAS * WS * IT * LEV) == 0
    ev = lambda c, w, i, e: lb[((c * WS + w) * IT + i) * LEV + e]  # noqa: E731
    if NWG == 2:
        names = ["wait_full", "issue", "wait_S", "softmax", "wait_PV", "merge_pack", "to_next"]
    else:  # serial loop: stage wait, S (issue + wait), softmax + pack, P~V half a, merge a + half b, merge b, loop top
        names = ["wait_full", "S", "softmax_pack", "PVa", "merge_a_PVb", "merge_b", "to_next"]
    dur = {k2: [] for k2 in names}
    busy = {k: [0.0] * (NWG + 1) for k in ("softmax", "S", "PV")}
    for c in range(CTAS):
        for w in range(NWG):
            for i in range(2, IT - 1):
                if ev(c, w, i, 0) == 0 or ev(c, w, i + 1, 0) == 0:
                    continue
                for j in range(6):
                    dur[names[j]].append(ev(c, w, i, j + 1) - ev(c, w, i, j))
                dur["to_next"].append(ev(c, w, i + 1, 0) - ev(c, w, i, 6))
        if NWG >= 3 and all(ev(c, w, IT - 1, 6) for w in range(NWG)):
            # how many warpgroups are in each phase at once, over the window all of them are in iterations 2..15
            t0 = max(ev(c, w, 2, 0) for w in range(NWG))
            t1 = min(ev(c, w, IT - 1, 6) for w in range(NWG))
            spans = {"S": (1, 2), "softmax": (2, 3), "PV": (3, 5)}
            for ph, (a, bnd) in spans.items():
                pts = []
                for w in range(NWG):
                    for i in range(IT):
                        x0, x1 = ev(c, w, i, a), ev(c, w, i, bnd)
                        if x0 and x1 > x0:
                            pts += [(max(x0, t0), 1), (min(x1, t1), -1)] if x1 > t0 and x0 < t1 else []
                pts.sort()
                cur, last = 0, t0
                for t, d in pts:
                    busy[ph][cur] += t - last
                    cur += d
                    last = t
                busy[ph][cur] += t1 - last
    print("loop (last shape, first tile, iterations 2..14), median cycles per warpgroup: " +
          ", ".join(f"{k2} {statistics.median(x):.0f}" for k2, x in dur.items() if x), flush=True)
    if NWG >= 3:
        for ph, v in busy.items():
            tot = sum(v) or 1.0
            print(f"  share of time with k warpgroups in {ph}: " +
                  ", ".join(f"{k}: {x / tot:.2f}" for k, x in enumerate(v)))
    for c in (0, 1):
        for w in range(NWG):
            base = ev(c, 0, 1, 0)
            print(f"cta {c} wg {w}: " + " | ".join(
                ",".join(str(ev(c, w, i, e) - base) for e in range(7)) for i in range(1, 5)))

#!/usr/bin/env python3
"""Compare the SASS of two builds of libsage_kernels.so, kernel by kernel (a refactoring check: identical SASS per
kernel means identical outputs and speed).

    python tools/sass_diff.py OLD.so NEW.so [--arch sm_90a] [--show-diff N] [--json out.json] [--rename PAT=REPL ...]

Needs cuobjdump and nvdisasm on PATH (CUDA toolkit, or the nvidia-cuda-cuobjdump / nvidia-cuda-nvdisasm wheels).
Each kernel's SASS is normalized: instruction addresses and encodings dropped, symbol names demangled and their
namespace ("(anonymous namespace)::", "sage::") removed (a TU's anonymous-namespace hash is not code). Kernels are
matched by (arch, normalized name). Also prints registers, stack, local memory and spill instructions
(STL/LDL) per kernel, old -> new. --rename PAT=REPL (a regex, repeatable) rewrites the demangled names on both sides
before matching, for a refactoring that renames (e.g. --rename 'hopper::=' --rename '\bHop([A-Z])=\1'). Exit status 0 when every kernel of OLD is in NEW with identical SASS (kernels only
in OLD are listed as removed and make the status 1 unless --allow-removed matches them).
"""
from __future__ import annotations

import argparse
import difflib
import json
import re
import subprocess
import sys

_FUNC = re.compile(r"^\s*Function : (\S+)")
_ARCH = re.compile(r"^arch = (sm_\w+)")
_RES_FUNC = re.compile(r"^\s*Function (\S+):")
_RES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
_ADDR = re.compile(r"/\*[0-9a-f]{4,}\*/")
_ENC = re.compile(r"/\* 0x[0-9a-f]+ \*/")
_NS = re.compile(r"\(anonymous namespace\)::|\bsage::")


def _run(args: list[str]) -> str:
    return subprocess.run(args, check=True, capture_output=True, text=True).stdout


def demangle(names: list[str]) -> dict[str, str]:
    if not names:
        return {}
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    return {m: _NS.sub("", d) for m, d in zip(names, out.split("\n"))}


def _mangled_symbols(text: str) -> list[str]:
    return sorted(set(re.findall(r"\b_Z\w+", text)))


_RENAMES: list[tuple[re.Pattern, str]] = []


def _renamed(names: dict[str, str]) -> dict[str, str]:
    for pat, repl in _RENAMES:
        names = {m: pat.sub(repl, d) for m, d in names.items()}
    return names


def sass_by_kernel(lib: str) -> dict[tuple[str, str], list[str]]:
    """(arch, normalized kernel name) -> normalized SASS lines."""
    text = _run(["cuobjdump", "-sass", lib])
    names = _renamed(demangle(_mangled_symbols(text)))
    out: dict[tuple[str, str], list[str]] = {}
    arch, cur = None, None
    for line in text.split("\n"):
        m = _ARCH.match(line)
        if m:
            arch, cur = m.group(1), None
            continue
        m = _FUNC.match(line)
        if m:
            cur = (arch, names.get(m.group(1), m.group(1)))
            out[cur] = []
            continue
        if line.startswith("Fatbin") or line.startswith("====="):
            cur = None
            continue
        if cur is None:
            continue
        s = _ENC.sub("", _ADDR.sub("", line)).strip()
        if not s or s.startswith(".") or s.startswith("----"):
            continue
        s = re.sub(r"\b_Z\w+", lambda mm: names.get(mm.group(0), mm.group(0)), s)
        out[cur].append(re.sub(r"\s+", " ", s))
    return out


def resources(lib: str) -> dict[tuple[str, str], dict]:
    text = _run(["cuobjdump", "-res-usage", lib])
    names = _renamed(demangle(_mangled_symbols(text)))
    out, arch, cur = {}, None, None
    for line in text.split("\n"):
        m = _ARCH.match(line)
        if m:
            arch = m.group(1)
            continue
        m = _RES_FUNC.match(line)
        if m:
            cur = (arch, names.get(m.group(1), m.group(1)))
            continue
        m = _RES.search(line)
        if m and cur:
            out[cur] = dict(reg=int(m.group(1)), stack=int(m.group(2)), shared=int(m.group(3)), local=int(m.group(4)))
            cur = None
    return out


def spills(lines: list[str]) -> int:
    return sum(1 for s in lines if re.search(r"\b(STL|LDL)(\.\w+)*\b", s))


def short(name: str) -> str:
    return name.split("(")[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--arch", action="append", help="only these archs (sm_80, sm_90a, ...)")
    ap.add_argument("--show-diff", type=int, default=0, help="print up to N lines of diff per differing kernel")
    ap.add_argument("--allow-removed", default=None, help="regex of kernel names allowed to exist only in OLD")
    ap.add_argument("--json", default=None, help="write the per-kernel table here")
    ap.add_argument("--rename", action="append", default=[], metavar="PAT=REPL",
                    help="regex substitution applied to the demangled names of both libraries (repeatable)")
    a = ap.parse_args()
    for r in a.rename:
        pat, sep, repl = r.partition("=")
        if not sep:
            ap.error(f"--rename {r!r}: want PAT=REPL")
        _RENAMES.append((re.compile(pat), repl))
    old, new = sass_by_kernel(a.old), sass_by_kernel(a.new)
    rold, rnew = resources(a.old), resources(a.new)
    keys = sorted(set(old) | set(new))
    if a.arch:
        keys = [k for k in keys if k[0] in a.arch]
    rows, bad = [], 0
    for k in keys:
        o, n = old.get(k), new.get(k)
        if o is None:
            status = "added"
        elif n is None:
            status = "removed"
            if not (a.allow_removed and re.search(a.allow_removed, k[1])):
                bad += 1
        elif o == n:
            status = "identical"
        else:
            status = "DIFFERS"
            bad += 1
        ro, rn = rold.get(k, {}), rnew.get(k, {})
        row = dict(arch=k[0], kernel=k[1], status=status, instr_old=len(o or []), instr_new=len(n or []),
                   reg_old=ro.get("reg"), reg_new=rn.get("reg"), stack_old=ro.get("stack"), stack_new=rn.get("stack"),
                   local_old=ro.get("local"), local_new=rn.get("local"),
                   spill_old=spills(o) if o else None, spill_new=spills(n) if n else None)
        rows.append(row)
        print(f"{k[0]:7s} {status:9s} reg {row['reg_old']}->{row['reg_new']} stack {row['stack_old']}->"
              f"{row['stack_new']} STL/LDL {row['spill_old']}->{row['spill_new']} instr {row['instr_old']}->"
              f"{row['instr_new']}  {short(k[1])}")
        if status == "DIFFERS" and a.show_diff:
            d = list(difflib.unified_diff(o, n, lineterm="", n=1))
            print("\n".join("    " + x for x in d[: a.show_diff]))
    counts = {s: sum(1 for r in rows if r["status"] == s) for s in ("identical", "DIFFERS", "added", "removed")}
    print("summary:", ", ".join(f"{v} {k}" for k, v in counts.items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""Build kernels_cuda/ into a plain C-ABI shared library, libsage_kernels.so (no libtorch, static cudart).

One translation unit per kernel family, compiled in parallel and linked together:
    sage_api.cpp         the C ABI (host only)
    portable/launch.cu   the mma.sync path, for every target (sm_80, 86, 89, 90a)
    hopper/launch.cu     the wgmma path, for sm_90a only (left out when the targets have no 90a)

Called by setup.py during build_py (`build_into`), or by hand:

    python kernels_cuda/build_kernels.py [--inplace] [--out DIR]

Environment:
    SAGE_PATCH_NO_KERNELS=1        skip the build (the package still installs; reference/full paths only)
    SAGE_PATCH_CUDA_ARCHS="90a"    narrow the targets ("80;90a", "8.0 9.0a", "sm_89" ...); default 80 86 89 90a
    SAGE_PATCH_KERNELS_REQUIRED=1  make a failed or impossible build an error instead of a warning (CI)
    SAGE_PATCH_NVCC=/path/to/nvcc  use this compiler (else $CUDA_HOME/bin/nvcc, nvcc on PATH, /usr/local/cuda/bin/nvcc)
    SAGE_PATCH_NVCC_THREADS=N      nvcc --threads of the portable unit (default: number of CPUs, at most 4)
    SAGE_PATCH_NVCC_EXTRA="..."    extra nvcc flags for every unit
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
LIB_NAME = "libsage_kernels.so"
DEFAULT_ARCHS = ["80", "86", "89", "90a"]
KNOWN_ARCHS = {"80", "86", "87", "89", "90", "90a"}


def _log(msg: str) -> None:
    print(f"[sage-patch kernels] {msg}", file=sys.stderr, flush=True)


def parse_archs(spec: str | None) -> list[str]:
    """'80;90a' / '8.0,9.0a' / 'sm_89 sm_90a' -> ['80', '90a']. Empty or None -> the defaults."""
    if not spec or not spec.strip():
        return list(DEFAULT_ARCHS)
    out = []
    for tok in re.split(r"[;,\s]+", spec.strip()):
        if not tok:
            continue
        t = tok.lower().replace("sm_", "").replace("compute_", "").replace(".", "")
        if t not in KNOWN_ARCHS:
            raise ValueError(f"SAGE_PATCH_CUDA_ARCHS: unsupported target {tok!r} (known: {sorted(KNOWN_ARCHS)})")
        if t not in out:
            out.append(t)
    return out


def gencode_flags(archs: list[str]) -> list[str]:
    return [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]


def find_nvcc() -> str | None:
    cands = [os.environ.get("SAGE_PATCH_NVCC")]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            cands.append(os.path.join(os.environ[var], "bin", "nvcc"))
    cands += [shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


class Unit(NamedTuple):
    """One translation unit: its source (relative to kernels_cuda/) and the targets it is compiled for."""
    source: str
    archs: str  # "host": no device code; "all": every requested target; "90a": sm_90a only (if requested)


UNITS = (Unit("sage_api.cpp", "host"), Unit("portable/launch.cu", "all"), Unit("hopper/launch.cu", "90a"))
COMMON_FLAGS = ["-std=c++17", "-O3", "-Xcompiler", "-fPIC,-Wall,-Wextra,-Werror", "-Werror", "all-warnings"]


def unit_archs(unit: Unit, archs: list[str]) -> list[str]:
    """The targets `unit` is compiled for; [] for a host-only unit or one this build leaves out."""
    if unit.archs == "host":
        return []
    if unit.archs == "all":
        return list(archs)
    return [a for a in archs if a == unit.archs]


def units_for(archs: list[str]) -> list[Unit]:
    return [u for u in UNITS if u.archs == "host" or unit_archs(u, archs)]


def _threads(threads: int | None) -> int:
    if threads is None:
        threads = int(os.environ.get("SAGE_PATCH_NVCC_THREADS", "0") or 0) or min(4, os.cpu_count() or 1)
    return max(1, threads)


def compile_command(nvcc: str, unit: Unit, archs: list[str], obj_path: str, threads: int | None = None) -> list[str]:
    """nvcc -c of one unit into obj_path."""
    src = os.path.join(HERE, unit.source)
    extra = os.environ.get("SAGE_PATCH_NVCC_EXTRA", "").split()
    if unit.archs == "host":
        with_hopper = "1" if "90a" in archs else "0"
        return [nvcc, *COMMON_FLAGS, f'-DSAGE_ARCHS="{" ".join(archs)}"', f"-DSAGE_WITH_HOPPER={with_hopper}",
                *extra, "-c", "-o", obj_path, src]
    ua = unit_archs(unit, archs)
    return [nvcc, *COMMON_FLAGS, "-lineinfo", "--threads", str(_threads(threads) if len(ua) > 1 else 1),
            *gencode_flags(ua), *extra, "-c", "-o", obj_path, src]


def link_command(nvcc: str, objs: list[str], out_path: str) -> list[str]:
    return [nvcc, "-shared", "-o", out_path, *objs]


def nvcc_commands(nvcc: str, archs: list[str], out_path: str, obj_dir: str, threads: int | None = None):
    """([compile command per unit], link command): the units compile in parallel, then one link."""
    objs, compiles = [], []
    for u in units_for(archs):
        obj = os.path.join(obj_dir, u.source.replace("/", "_") + ".o")
        objs.append(obj)
        compiles.append(compile_command(nvcc, u, archs, obj, threads))
    return compiles, link_command(nvcc, objs, out_path)


def _run_parallel(cmds: list[list[str]]):
    """Run the commands at once; [(returncode, stdout + stderr)] in order."""
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in cmds]
    return [(p.wait(), p.stdout.read()) for p in procs]


def will_build() -> bool:
    """Whether build() would try to compile (for the wheel tag): not disabled and nvcc present."""
    return os.environ.get("SAGE_PATCH_NO_KERNELS", "") in ("", "0") and find_nvcc() is not None


def build(out_dir: str, archs: list[str] | None = None, nvcc: str | None = None) -> str | None:
    """Compile into out_dir/libsage_kernels.so; return its path, or None (with the reason logged)."""
    required = os.environ.get("SAGE_PATCH_KERNELS_REQUIRED", "") not in ("", "0")

    def give_up(why: str):
        if required:
            raise RuntimeError(f"kernels build required (SAGE_PATCH_KERNELS_REQUIRED=1) but: {why}")
        _log(f"not building the CUDA kernels: {why}. The package installs without them "
             "(reference and full-precision paths only; `sage-patch info` says why).")
        return None

    if os.environ.get("SAGE_PATCH_NO_KERNELS", "") not in ("", "0"):
        return give_up("SAGE_PATCH_NO_KERNELS is set")
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        return give_up("nvcc not found (set CUDA_HOME or SAGE_PATCH_NVCC, or put nvcc on PATH)")
    try:
        archs = archs or parse_archs(os.environ.get("SAGE_PATCH_CUDA_ARCHS"))
    except ValueError as e:
        return give_up(str(e))
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp_out = os.path.join(tmp, LIB_NAME)
        compiles, link = nvcc_commands(nvcc, archs, tmp_out, tmp)
        _log(f"compiling for sm_{', sm_'.join(archs)} ({len(compiles)} units in parallel):")
        for cmd in compiles:
            _log("  " + " ".join(cmd))
        t0 = time.time()
        try:
            results = _run_parallel(compiles)
            results.append(_run_parallel([link])[0])
        except OSError as e:
            return give_up(f"could not run nvcc: {e}")
        for (rc, out), cmd in zip(results, compiles + [link]):
            if rc != 0:
                sys.stderr.write(out)
                return give_up(f"nvcc failed (exit {rc}): {' '.join(cmd)}")
            if out.strip():
                sys.stderr.write(out)
        dst = os.path.join(out_dir, LIB_NAME)
        shutil.copyfile(tmp_out, dst + ".tmp")
        os.replace(dst + ".tmp", dst)  # atomic: a running process keeps its mapping of the old file
    _log(f"built {dst} in {time.time() - t0:.1f} s")
    return dst


def build_into(build_lib_kernels_dir: str, inplace_dir: str | None = None) -> str | None:
    """setup.py hook: build once, place the library in the build tree and (if given) in the source tree."""
    path = build(build_lib_kernels_dir)
    stale = os.path.join(build_lib_kernels_dir, LIB_NAME)
    if path is None and os.path.exists(stale):
        # build_py copied a library left in the source tree by an earlier build: never ship a binary this
        # build did not make (the wheel would be tagged pure and could carry the wrong targets)
        os.remove(stale)
        _log(f"removed {stale}: copied from the source tree, not built by this build")
    if path and inplace_dir and os.path.abspath(inplace_dir) != os.path.abspath(build_lib_kernels_dir):
        os.makedirs(inplace_dir, exist_ok=True)
        dst = os.path.join(inplace_dir, LIB_NAME)
        shutil.copyfile(path, dst + ".tmp")
        os.replace(dst + ".tmp", dst)
    return path


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="output directory (default: sage_patch/kernels in the source tree)")
    ap.add_argument("--archs", default=None, help="override SAGE_PATCH_CUDA_ARCHS")
    a = ap.parse_args()
    out = a.out or os.path.join(os.path.dirname(HERE), "sage_patch", "kernels")
    res = build(out, parse_archs(a.archs) if a.archs else None)
    sys.exit(0 if res else 1)

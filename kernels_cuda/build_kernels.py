"""Build kernels_cuda/ into a plain C-ABI shared library, libsage_kernels.so (no libtorch, static cudart).

One translation unit per kernel family, compiled in parallel and linked together:
    sage_api.cpp         the C ABI (host only)
    portable/launch.cu   the mma.sync path, for every target: SASS for sm_80, 86, 89, 90a, 100, 120 and PTX
                         compute_120 (a GPU newer than every SASS target JIT-compiles it: CUDA_CACHE_PATH keeps it)
    hopper/launch.cu     the wgmma path, SASS for sm_90a only (left out when the targets have no sm_90a: wgmma is an
                         arch-specific feature, no portable PTX can carry it)
    hopper/bwd_launch.cu the SageBwd training backward's wgmma kernel (dQ, dK, dV), sm_90a only, like hopper/launch.cu
    hopper/fwd_train_launch.cu  the SageBwd training forward's wgmma kernel (O, both LSEs), sm_90a only

Targets: "XY" (or sm_XY, X.Y) = SASS for compute capability X.Y, which runs on X.Y..X.9 ("90a": on 9.0 only);
"compute_XY" = PTX, which the driver JIT-compiles on any GPU of capability >= X.Y. The Blackwell SASS is the plain
sm_100 / sm_120 (not sm_100a / sm_120a): the portable kernel uses no arch-specific instruction, and the plain
targets also run on sm_103 / sm_121. sm_110 (Jetson Thor) has neither SASS nor PTX here (PTX compute_120 JIT-
compiles only on 12.0 and newer): the resolver runs full precision there and says so.

Called by setup.py during build_py (`build_into`), or by hand:

    python kernels_cuda/build_kernels.py [--inplace] [--out DIR]

Environment:
    SAGE_PATCH_NO_KERNELS=1        skip the build (the package still installs; reference/full paths only)
    SAGE_PATCH_CUDA_ARCHS="90a"    narrow the targets ("80;90a", "8.0 9.0a", "sm_89", "compute_90" ...); default
                                   80 86 89 90a 100 120 compute_120. Only compute_* tokens = a PTX-only library
                                   (tests of the JIT path: "compute_90" on an H100, docs/design/kernels.md)
    SAGE_PATCH_KERNELS=required|optional|auto (default auto)
                                   what a build that cannot make the library does. auto: a failed compile is an
                                   error, a missing nvcc a warning (the package installs without kernels);
                                   required: both are errors (release wheels, CI); optional: both are warnings and
                                   the wheel is built without the library (pure Python, tagged py3-none-any)
    SAGE_PATCH_KERNELS_REQUIRED=1  the same as SAGE_PATCH_KERNELS=required (kept for existing scripts)
    SAGE_PATCH_PREBUILT_LIBRARY=P  put this already-built library in the build instead of compiling (release
                                   wheels from a library CI built once); it must hold the requested targets
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
DEFAULT_ARCHS = ["80", "86", "89", "90a", "100", "120", "compute_120"]
# SASS targets nvcc 13.0 accepts for the portable kernel (plus the arch-specific 90a/100a/120a), PTX: the same
# compute capabilities without the arch-specific ones (a compute_90a PTX would JIT on 9.0 only: not forward-portable)
KNOWN_SASS = {"80", "86", "87", "89", "90", "90a", "100", "100a", "103", "120", "120a", "121"}
KNOWN_PTX = {"compute_" + a for a in KNOWN_SASS if not a.endswith("a")}
KNOWN_ARCHS = KNOWN_SASS | KNOWN_PTX
HOPPER_TARGET = "90a"
MODES = ("auto", "required", "optional")


def _log(msg: str) -> None:
    print(f"[sage-patch kernels] {msg}", file=sys.stderr, flush=True)


class _Progress:
    """The one line a user of `pip install` sees while the library compiles: "compiling ... (targets) ... done in N s".
    pip shows a build backend's output only with -v or when the build fails (checked with pip 26: `pip install -e .`
    shows its spinner and nothing else for the minutes nvcc takes), so where stderr is not a terminal (a pip build)
    the line goes to the controlling terminal, /dev/tty, when there is one (none in CI: the build log has the same
    facts in _log's lines). Only this line is written there; nothing goes to stderr between start and end, since
    each line pip reads from the backend moves its spinner into the middle of ours."""

    def __init__(self):
        self.tty = None
        if not sys.stderr.isatty():
            try:
                self.tty = open("/dev/tty", "w")  # noqa: SIM115  closed in end()
            except OSError:  # no controlling terminal (CI, a service)
                self.tty = None

    def _write(self, text: str) -> None:
        if self.tty is not None:
            try:
                self.tty.write(text)
                self.tty.flush()
            except OSError:
                pass

    def start(self, archs: list[str]) -> None:
        # the leading newline leaves pip's spinner line ("Building editable for sage-patch ... -") intact
        self._write(f"\n[sage-patch] compiling the CUDA kernel library for {' '.join(archs)} (takes minutes; "
                    "SAGE_PATCH_CUDA_ARCHS narrows the targets, SAGE_PATCH_NO_KERNELS=1 skips the library) ... ")

    def end(self, what: str) -> None:
        self._write(what + "\n")
        if self.tty is not None:
            self.tty.close()
            self.tty = None


def parse_archs(spec: str | None) -> list[str]:
    """'80;90a' / '8.0,9.0a' / 'sm_89 sm_90a' -> ['80', '90a'] (SASS); 'compute_120' stays 'compute_120' (PTX).
    Empty or None -> the defaults."""
    if not spec or not spec.strip():
        return list(DEFAULT_ARCHS)
    out = []
    for tok in re.split(r"[;,\s]+", spec.strip()):
        if not tok:
            continue
        t = tok.lower().replace(".", "")
        t = t if t.startswith("compute_") else t.replace("sm_", "")
        if t not in KNOWN_ARCHS:
            raise ValueError(f"SAGE_PATCH_CUDA_ARCHS: unsupported target {tok!r} (allowed: SASS "
                             f"{sorted(KNOWN_SASS, key=_order)}, PTX {sorted(KNOWN_PTX, key=_order)})")
        if t not in out:
            out.append(t)
    return out


def _order(target: str):
    return (target.startswith("compute_"), int(re.sub(r"\D", "", target)), target)


def is_ptx(target: str) -> bool:
    return target.startswith("compute_")


def gencode_flags(archs: list[str]) -> list[str]:
    """SASS 'XY' -> code=sm_XY; PTX 'compute_XY' -> code=compute_XY (the PTX itself in the fatbin)."""
    return [f"-gencode=arch={a},code={a}" if is_ptx(a) else f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]


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
    archs: str  # "host": no device code; "all": every requested target; "90a": sm_90a SASS only (if requested)


UNITS = (Unit("sage_api.cpp", "host"), Unit("portable/launch.cu", "all"), Unit("hopper/launch.cu", HOPPER_TARGET),
         Unit("hopper/bwd_launch.cu", HOPPER_TARGET), Unit("hopper/fwd_train_launch.cu", HOPPER_TARGET))
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
        with_hopper = "1" if HOPPER_TARGET in archs else "0"
        return [nvcc, *COMMON_FLAGS, f'-DSAGE_ARCHS="{" ".join(archs)}"', f"-DSAGE_WITH_HOPPER={with_hopper}",
                *extra, "-c", "-o", obj_path, src]
    ua = unit_archs(unit, archs)
    return [nvcc, *COMMON_FLAGS, "-lineinfo", "--threads", str(_threads(threads) if len(ua) > 1 else 1),
            *gencode_flags(ua), *extra, "-c", "-o", obj_path, src]


def link_command(nvcc: str, objs: list[str], out_path: str) -> list[str]:
    # -nodlink: the units are whole-program (no -rdc), so there is no device code to link; without it nvcc adds an
    # empty device-link cubin for its default arch (sm_75), SASS that a PTX-only build must not hold
    return [nvcc, "-shared", "-nodlink", "-o", out_path, *objs]


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


def kernels_mode() -> str:
    """SAGE_PATCH_KERNELS ("auto" when unset); SAGE_PATCH_KERNELS_REQUIRED=1 means "required"."""
    mode = os.environ.get("SAGE_PATCH_KERNELS", "").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"SAGE_PATCH_KERNELS={os.environ['SAGE_PATCH_KERNELS']!r}: allowed {', '.join(MODES)}")
    if os.environ.get("SAGE_PATCH_KERNELS_REQUIRED", "") not in ("", "0"):
        if mode == "optional":
            raise ValueError("SAGE_PATCH_KERNELS=optional contradicts SAGE_PATCH_KERNELS_REQUIRED=1: unset one")
        mode = "required"
    return mode


class KernelBuildError(RuntimeError):
    """The library could not be made and the build may not go on without it."""


def _fail(why: str, mode: str, hard: bool) -> None:
    """A build that cannot make the library: an error when `hard` (a failed compile outside "optional") or when the
    library is required, else a warning (the package installs without kernels)."""
    if mode == "required" or (hard and mode != "optional"):
        bar = "=" * 100
        raise KernelBuildError(
            f"\n{bar}\nsage-patch: the CUDA kernel library was NOT built: {why}\n"
            f"A package without it runs no kernel on any GPU. Fix the compiler (SAGE_PATCH_NVCC, CUDA_HOME), narrow "
            f"the targets (SAGE_PATCH_CUDA_ARCHS), or build without the kernels on purpose with "
            f"SAGE_PATCH_KERNELS=optional (SAGE_PATCH_KERNELS={mode} now).\n{bar}")
    _log(f"WARNING: building WITHOUT the CUDA kernels: {why}. The package installs without them (reference "
         f"and full-precision paths only; `sage-patch info` says why); SAGE_PATCH_KERNELS={mode}.")


def will_build() -> bool:
    """Whether build() would try to compile: not disabled and nvcc present."""
    return os.environ.get("SAGE_PATCH_NO_KERNELS", "") in ("", "0") and find_nvcc() is not None


def build(out_dir: str, archs: list[str] | None = None, nvcc: str | None = None) -> str | None:
    """Compile into out_dir/libsage_kernels.so; return its path, or None (with the reason logged) where
    SAGE_PATCH_KERNELS allows building without it; else raise KernelBuildError (ValueError for bad settings)."""
    mode = kernels_mode()
    archs = archs or parse_archs(os.environ.get("SAGE_PATCH_CUDA_ARCHS"))
    if os.environ.get("SAGE_PATCH_NO_KERNELS", "") not in ("", "0"):
        return _fail("SAGE_PATCH_NO_KERNELS is set", mode, hard=False)
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        return _fail("nvcc not found (set CUDA_HOME or SAGE_PATCH_NVCC, or put nvcc on PATH)", mode, hard=False)
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp_out = os.path.join(tmp, LIB_NAME)
        compiles, link = nvcc_commands(nvcc, archs, tmp_out, tmp)
        # The log has one line before and one after (a line per nvcc command buried them; _fail names a failing
        # one); pip shows it only with -v or on failure, so _Progress puts the same on the user's terminal.
        _log(f"compiling the CUDA kernel library for {' '.join(archs)} ({len(compiles)} nvcc units in parallel; "
             f"a few minutes for every target: SAGE_PATCH_CUDA_ARCHS narrows them, SAGE_PATCH_NO_KERNELS=1 skips)")
        progress = _Progress()  # after the log line: a line pip reads between start and end would move its spinner
        progress.start(archs)
        t0 = time.time()
        try:
            results = _run_parallel(compiles)
            if all(rc == 0 for rc, _ in results):
                results.append(_run_parallel([link])[0])
        except OSError as e:
            progress.end(f"failed after {time.time() - t0:.0f} s")
            return _fail(f"could not run nvcc {nvcc}: {e}", mode, hard=True)
        failed = next((rc for rc, _ in results if rc != 0), 0)
        progress.end(f"failed after {time.time() - t0:.0f} s" if failed else f"done in {time.time() - t0:.0f} s")
        for (rc, out), cmd in zip(results, compiles + [link]):
            if out.strip():
                sys.stderr.write(out)
            if rc != 0:
                return _fail(f"nvcc failed (exit {rc}): {' '.join(cmd)}", mode, hard=True)
        dst = os.path.join(out_dir, LIB_NAME)
        shutil.copyfile(tmp_out, dst + ".tmp")
        os.replace(dst + ".tmp", dst)  # atomic: a running process keeps its mapping of the old file
    _log(f"compiled the CUDA kernel library in {time.time() - t0:.0f} s: {dst} ({os.path.getsize(dst) / 1e6:.1f} MB)")
    return dst


def library_targets(path: str) -> list[str]:
    """The targets a built library says it holds (its sage_compiled_archs()); loads it with ctypes (no GPU needed)."""
    import ctypes

    h = ctypes.CDLL(os.path.abspath(path))
    h.sage_compiled_archs.restype = ctypes.c_char_p
    return h.sage_compiled_archs().decode().split()


def place_prebuilt(src: str, out_dir: str, archs: list[str] | None = None) -> str:
    """Copy an already-built library into out_dir after checking it holds exactly the requested targets."""
    archs = archs or parse_archs(os.environ.get("SAGE_PATCH_CUDA_ARCHS"))
    if not os.path.isfile(src):
        raise KernelBuildError(f"SAGE_PATCH_PREBUILT_LIBRARY={src!r}: no such file")
    try:
        held = library_targets(src)
    except (OSError, AttributeError) as e:
        raise KernelBuildError(f"SAGE_PATCH_PREBUILT_LIBRARY={src!r} is not a sage_patch kernel library: {e}")
    if sorted(held, key=_order) != sorted(archs, key=_order):
        raise KernelBuildError(f"SAGE_PATCH_PREBUILT_LIBRARY={src!r} holds {' '.join(held)}, this build wants "
                               f"{' '.join(archs)} (SAGE_PATCH_CUDA_ARCHS): rebuild it or change the targets")
    os.makedirs(out_dir, exist_ok=True)
    dst = os.path.join(out_dir, LIB_NAME)
    if os.path.abspath(src) != os.path.abspath(dst):
        shutil.copyfile(src, dst + ".tmp")
        os.replace(dst + ".tmp", dst)
    _log(f"placed the prebuilt {src} ({' '.join(held)}) in {out_dir}")
    return dst


def build_into(build_lib_kernels_dir: str, inplace_dir: str | None = None) -> str | None:
    """setup.py hook: build once (or place SAGE_PATCH_PREBUILT_LIBRARY), put the library in the build tree and
    (if given) in the source tree. Returns its path, or None when this build makes none."""
    stale = os.path.join(build_lib_kernels_dir, LIB_NAME)
    if os.path.exists(stale):
        # build_py copied a library left in the source tree by an earlier build: never ship a binary this
        # build did not make or check (it could carry other targets)
        os.remove(stale)
        _log(f"removed {stale}: copied from the source tree, not built by this build")
    prebuilt = os.environ.get("SAGE_PATCH_PREBUILT_LIBRARY")
    if prebuilt:
        return place_prebuilt(prebuilt, build_lib_kernels_dir)
    path = build(build_lib_kernels_dir)
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
    try:
        res = build(out, parse_archs(a.archs) if a.archs else None)
    except (KernelBuildError, ValueError) as e:
        print(e, file=sys.stderr)
        sys.exit(1)
    sys.exit(0 if res else 1)

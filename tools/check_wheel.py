"""Check a sage-patch release wheel: a tag a package index accepts, the kernel library inside, every build target in
its fatbin, and nothing that ties it to a Python or torch version. Exit 1 with every failed check listed.

    python tools/check_wheel.py dist/sage_patch-0.1.0-py3-none-manylinux_2_34_x86_64.whl [--targets "80 90a ..."]

Checks:
- every git-tracked `sage_patch/**/*.py` and `*.yaml` is in it (a module missing from the wheel breaks the installed
  package while the editable install, which maps the source folder, hides it);
- file name and WHEEL metadata: py3-none-manylinux_X_Y_<arch> (no bare linux_* tag, which indexes reject), the same
  tags in both, Root-Is-Purelib false;
- sage_patch/kernels/libsage_kernels.so is in it and is the only binary (no CPython extension);
- the library's NEEDED entries name no libtorch / c10 / libcudart / libpython (plain C ABI, static cudart), and its
  newest GLIBC symbol version is covered by the manylinux tag;
- `cuobjdump --list-elf` shows SASS for every SASS target (and one more sm_90a image per Hopper unit), `--list-ptx`
  PTX for every compute_* target, and the library's own sage_compiled_archs() names exactly the targets.
cuobjdump is looked for on PATH, next to nvcc, and in the nvidia-cuda-cuobjdump wheel (pip install
nvidia-cuda-cuobjdump).
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "kernels_cuda"))

import build_kernels  # noqa: E402  kernels_cuda/build_kernels.py: the default targets, nvcc lookup

LIB_IN_WHEEL = "sage_patch/kernels/" + build_kernels.LIB_NAME
FORBIDDEN_NEEDED = re.compile(r"libtorch|libc10|libcudart|libpython|libcuda\.so")
PLATFORM_TAG = re.compile(r"^manylinux_(\d+)_(\d+)_(x86_64|aarch64)$")
PACKAGE_SUFFIXES = (".py", ".yaml")  # the package's modules and shipped policies


def package_sources(root: str = ROOT) -> list[str]:
    """The files every wheel must carry: git-tracked sage_patch/**/*.py and *.yaml (without git, e.g. in an sdist,
    the source tree's)."""
    try:
        files = subprocess.run(["git", "-C", root, "ls-files", "--", "sage_patch"], capture_output=True, text=True,
                               check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        files = [os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/")
                 for d, _, names in os.walk(os.path.join(root, "sage_patch")) for f in names]
    return sorted(f for f in files if f.endswith(PACKAGE_SUFFIXES))


def missing_package_files(names, sources=None) -> list[str]:
    """The package sources (default: package_sources()) that `names` (a wheel's file list) lacks."""
    return sorted(set(package_sources() if sources is None else sources) - set(names))


def find_cuobjdump() -> str | None:
    cands = [shutil.which("cuobjdump")]
    nvcc = build_kernels.find_nvcc()
    if nvcc:
        cands.append(os.path.join(os.path.dirname(os.path.realpath(nvcc)), "cuobjdump"))
    for site in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        cands += sorted(glob.glob(os.path.join(site, "nvidia", "cu*", "bin", "cuobjdump")), reverse=True)
        cands += glob.glob(os.path.join(site, "nvidia", "cuda_cuobjdump", "bin", "cuobjdump"))
    return next((c for c in cands if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


def wheel_tags(name: str) -> tuple[str, str, list[str]]:
    """(python tag, abi tag, [platform tags]) of a wheel file name."""
    parts = os.path.basename(name)[:-len(".whl")].split("-")
    return parts[-3], parts[-2], parts[-1].split(".")


def glibc_needed(lib: str) -> tuple[int, int]:
    """The newest GLIBC_x.y symbol version the library needs (readelf --version-info)."""
    out = subprocess.run(["readelf", "--version-info", "--wide", lib], capture_output=True, text=True,
                         check=True).stdout
    versions = [tuple(map(int, m)) for m in re.findall(r"GLIBC_(\d+)\.(\d+)", out)]
    return max(versions) if versions else (0, 0)


def needed_libs(lib: str) -> list[str]:
    out = subprocess.run(["readelf", "-d", "--wide", lib], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def cuobjdump_images(cuobjdump: str, lib: str) -> tuple[list[str], list[str]]:
    """([sm_XY of every cubin], [compute_XY of every PTX]) in the library's fatbins (the build links with -nodlink:
    no device-link stub cubin, so every cubin is a unit's)."""
    res = []
    for flag, what in (("--list-elf", r"ELF file\s+\d+: (\S+)\.(sm_\w+)\.cubin"),
                       ("--list-ptx", r"PTX file\s+\d+: (\S+)\.(sm_\w+|compute_\w+)\.ptx")):
        r = subprocess.run([cuobjdump, flag, lib], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{cuobjdump} {flag} {lib} failed: {r.stderr.strip()}")
        res.append([arch for _, arch in re.findall(what, r.stdout)])
    elf, ptx = res
    return elf, ["compute_" + p.split("_", 1)[1] for p in ptx]  # cuobjdump names a PTX by its target: sm_120


def check(wheel: str, targets: list[str], cuobjdump: str | None) -> list[str]:
    """The failed checks (empty: the wheel is good)."""
    errors = []
    py, abi, plats = wheel_tags(wheel)
    if (py, abi) != ("py3", "none"):
        errors.append(f"tag {py}-{abi}: want py3-none (plain C ABI, no Python version)")
    bad = [p for p in plats if not PLATFORM_TAG.match(p)]
    if bad:
        errors.append(f"platform tag(s) {bad}: an index accepts manylinux_X_Y_<arch> only (run auditwheel repair)")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        wheel_meta = next((n for n in names if n.endswith(".dist-info/WHEEL")), None)
        meta = z.read(wheel_meta).decode() if wheel_meta else ""
        meta_tags = sorted(re.findall(r"^Tag: (\S+)$", meta, re.M))
        want = sorted(f"{py}-{abi}-{p}" for p in plats)
        if meta_tags != want:
            errors.append(f"WHEEL metadata tags {meta_tags} differ from the file name's {want}")
        if "Root-Is-Purelib: false" not in meta:
            errors.append("WHEEL metadata: Root-Is-Purelib is not false (a binary wheel is platform code)")
        missing = missing_package_files(names)
        if missing:
            errors.append(f"{len(missing)} package file(s) of the source tree missing from the wheel: "
                          f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
        binaries = [n for n in names if n.endswith(".so") or ".so." in n]
        if LIB_IN_WHEEL not in names:
            return errors + [f"{LIB_IN_WHEEL} is not in the wheel (files: {len(names)}): the kernels are missing"]
        if binaries != [LIB_IN_WHEEL]:
            errors.append(f"binaries other than the kernel library: {sorted(set(binaries) - {LIB_IN_WHEEL})}")
        with tempfile.TemporaryDirectory() as tmp:
            lib = z.extract(LIB_IN_WHEEL, tmp)
            errors += check_library(lib, targets, cuobjdump, plats)
    return errors


def check_library(lib: str, targets: list[str], cuobjdump: str | None, plats: list[str]) -> list[str]:
    errors = []
    forbidden = [n for n in needed_libs(lib) if FORBIDDEN_NEEDED.search(n)]
    if forbidden:
        errors.append(f"the library links {forbidden}: it must link no torch, python or CUDA runtime library")
    need = glibc_needed(lib)
    for p in plats:
        m = PLATFORM_TAG.match(p)
        if m and (int(m[1]), int(m[2])) < need:
            errors.append(f"tag {p} promises glibc {m[1]}.{m[2]} but the library needs GLIBC_{need[0]}.{need[1]}")
    sass = sorted("sm_" + t for t in targets if not build_kernels.is_ptx(t))
    # one more sm_90a image per Hopper-only unit (the forward's and the SageBwd backward's)
    hopper = [f"sm_{u.archs}" for u in build_kernels.UNITS if u.archs == build_kernels.HOPPER_TARGET
              and u.archs in targets]
    ptx = sorted(t for t in targets if build_kernels.is_ptx(t))
    if cuobjdump is None:
        errors.append("cuobjdump not found (PATH, next to nvcc, or pip install nvidia-cuda-cuobjdump): the "
                      "fatbin's targets are unchecked")
    else:
        elf, got_ptx = cuobjdump_images(cuobjdump, lib)
        if sorted(elf) != sorted(sass + hopper):
            errors.append(f"cuobjdump --list-elf: SASS {sorted(elf)}, want {sorted(sass + hopper)} (portable unit "
                          f"for every SASS target, each Hopper unit for sm_90a)")
        if sorted(got_ptx) != ptx:
            errors.append(f"cuobjdump --list-ptx: PTX {sorted(got_ptx)}, want {ptx}")
    try:
        held = build_kernels.library_targets(lib)
    except (OSError, AttributeError) as e:
        return errors + [f"the library does not load as a sage_patch kernel library: {e}"]
    if sorted(held) != sorted(targets):
        errors.append(f"sage_compiled_archs() says {held}, want {targets}")
    return errors


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("wheel")
    ap.add_argument("--targets", default=None, help="the build targets to expect (SAGE_PATCH_CUDA_ARCHS syntax; "
                                                    "default: the build's defaults)")
    a = ap.parse_args(argv)
    if not a.wheel.endswith(".whl") or not os.path.isfile(a.wheel):
        ap.error(f"argument wheel: {a.wheel!r} is not a .whl file")
    targets = build_kernels.parse_archs(a.targets)
    errors = check(a.wheel, targets, find_cuobjdump())
    for e in errors:
        print(f"check_wheel: FAIL: {e}", file=sys.stderr)
    if errors:
        return 1
    print(f"check_wheel: OK: {os.path.basename(a.wheel)} holds {LIB_IN_WHEEL} with {' '.join(targets)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

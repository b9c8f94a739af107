#!/usr/bin/env python3
"""Build the public SageAttention 2.x (github.com/thu-ml/SageAttention) from source, for one GPU target, as the peer
of our portable mma.sync kernel in benchmarks/bench_portable_vs_sa2.py. Offline: no pip, no downloads.

Two steps, each a subcommand:

    python benchmarks/sa2_build.py prepare --from /tmp/sa2src --commit d1a57a5   # here: copy the files the build needs
    python benchmarks/sa2_build.py build --src .sa2src --out build/sa2            # on the GPU machine

`prepare` copies from a full checkout only what the build and the Python package need (csrc/, sageattention/,
LICENSE, setup.py for reference) into --to (default .sa2src, about 0.5 MB), and records the upstream commit.
`build` compiles exactly the extensions our benchmark calls, with upstream's own flags (setup.py), into
--out/sageattention/ next to an unmodified copy of their Python package:

    sageattention._qattn_sm89   INT8 Q K^T + FP8 P~V mma.sync kernels (sm89_*.cu: sageattn_qk_int8_pv_fp8_cuda)
    sageattention._qattn_sm80   INT8 Q K^T + FP16 P~V mma.sync kernels (qk_int_sv_f16_cuda_sm80.cu:
                                sageattn_qk_int8_pv_fp16_cuda)
    sageattention._fused        the CUDA quantization kernels (V to FP8 per channel, per-block/per-warp INT8)

Not built: _qattn_sm90 (the Hopper wgmma kernel; the peer of our wgmma kernel, compared in h100_kernel.json).
Their per-thread INT8 quantization of Q and K (the default) is Triton code, so the GPU machine needs triton.

Upstream's setup.py compiles every extension for each target in TORCH_CUDA_ARCH_LIST and maps 9.0 to sm_90a; we
do the same for the H100 (--arch 90a, the default; "90" also works: these kernels use mma.sync, cp.async and
e4m3 conversions, all in sm_89+ PTX, none of the sm_90a-only instructions). Flags are upstream's NVCC_FLAGS and
CXX_FLAGS minus -Xptxas=-v (register report only) plus what torch's BuildExtension adds (torch include paths,
-D__CUDA_NO_HALF_* first so their -U undoes them, -fPIC, TORCH_EXTENSION_NAME, the libstdc++ ABI of this torch).
Every translation unit of the three extensions compiles in parallel (--jobs, default $MAX_JOBS or the CPU count), so
the build takes as long as its slowest unit; no ninja needed. Their sources are not modified.

`build --compile-only` stops before linking (a CPU-only torch has no libtorch_cuda to link against): it checks
that the sources compile for the target on a machine without a GPU.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import warnings

# name -> sources, as in upstream setup.py (the extensions our benchmark's calls import)
EXTENSIONS = {
    "_qattn_sm80": ["csrc/qattn/pybind_sm80.cpp", "csrc/qattn/qk_int_sv_f16_cuda_sm80.cu"],
    "_qattn_sm89": ["csrc/qattn/pybind_sm89.cpp",
                    "csrc/qattn/sm89_qk_int8_sv_f8_accum_f32_attn_inst_buf.cu",
                    "csrc/qattn/sm89_qk_int8_sv_f8_accum_f16_attn_inst_buf.cu",
                    "csrc/qattn/sm89_qk_int8_sv_f8_accum_f32_attn.cu",
                    "csrc/qattn/sm89_qk_int8_sv_f8_accum_f32_fuse_v_scale_fuse_v_mean_attn.cu",
                    "csrc/qattn/sm89_qk_int8_sv_f8_accum_f32_fuse_v_scale_attn.cu",
                    "csrc/qattn/sm89_qk_int8_sv_f8_accum_f32_fuse_v_scale_attn_inst_buf.cu",
                    "csrc/qattn/sm89_qk_int8_sv_f8_accum_f16_fuse_v_scale_attn_inst_buf.cu"],
    "_fused": ["csrc/fused/pybind.cpp", "csrc/fused/fused.cu"],
}
# upstream setup.py's flags (-Xptxas=-v left out: it only prints register counts)
UPSTREAM_NVCC_FLAGS = ["-O3", "-std=c++17", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
                       "--use_fast_math", "--threads=8", "-diag-suppress=174"]
UPSTREAM_CXX_FLAGS = ["-g", "-O3", "-fopenmp", "-std=c++17", "-DENABLE_BF16"]
# what torch's BuildExtension puts before the user's nvcc flags (torch.utils.cpp_extension.COMMON_NVCC_FLAGS)
TORCH_NVCC_PREFIX = ["-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                     "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__", "--expt-relaxed-constexpr"]
# what `prepare` copies from a checkout: the build's sources and headers, the Python package, the licence
PREPARE_DIRS = ("csrc", "sageattention")
PREPARE_FILES = ("LICENSE", "setup.py", "README.md")
PREPARE_SKIP_EXT = (".png", ".gif", ".jpg", ".mp4", ".pdf")
ARCHS = ("89", "90", "90a")


def _log(msg: str) -> None:
    print(f"[sa2_build] {msg}", file=sys.stderr, flush=True)


def prepare(src: str, dst: str, commit: str | None) -> dict:
    """Copy what the build needs from the checkout `src` into `dst` (replaced); return what was copied."""
    missing = [p for p in PREPARE_DIRS + ("setup.py",) if not os.path.exists(os.path.join(src, p))]
    if missing:
        raise SystemExit(f"--from {src!r} is not a SageAttention checkout: missing {missing}")
    if os.path.exists(dst):
        shutil.rmtree(dst)
    os.makedirs(dst)
    ignore = shutil.ignore_patterns("__pycache__", *(f"*{e}" for e in PREPARE_SKIP_EXT))
    for d in PREPARE_DIRS:
        shutil.copytree(os.path.join(src, d), os.path.join(dst, d), ignore=ignore)
    for f in PREPARE_FILES:
        if os.path.exists(os.path.join(src, f)):
            shutil.copy2(os.path.join(src, f), os.path.join(dst, f))
    info = {"upstream": "https://github.com/thu-ml/SageAttention", "commit": commit or "unknown",
            "copied": list(PREPARE_DIRS) + [f for f in PREPARE_FILES if os.path.exists(os.path.join(dst, f))]}
    with open(os.path.join(dst, "UPSTREAM.json"), "w") as f:
        json.dump(info, f, indent=1)
    size = sum(os.path.getsize(os.path.join(r, n)) for r, _, ns in os.walk(dst) for n in ns)
    _log(f"copied {info['copied']} into {dst}: {size / 1e6:.2f} MB")
    return info


def parse_arch(arch: str) -> str:
    a = arch.lower().replace("sm_", "").replace("compute_", "").replace(".", "")
    if a not in ARCHS:
        raise SystemExit(f"--arch {arch!r}: allowed {', '.join(ARCHS)} (FP8 mma.sync needs sm_89+)")
    return a


def cuda_home() -> str:
    """$CUDA_HOME, else the CUDA root of the nvcc on PATH (through a wrapper script's exec line), else /usr/local/cuda."""
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        root = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
        if os.path.exists(os.path.join(root, "include", "cuda.h")):
            return root
    if os.path.exists("/usr/local/cuda/include/cuda.h"):
        return "/usr/local/cuda"
    raise SystemExit("no CUDA toolkit found: set CUDA_HOME (nvcc and include/cuda.h under it)")


# torch's ATen/cuda/CUDAContext.h (included by their fused.cu) includes the CUDA math libraries' headers
CUDA_LIBRARY_HEADERS = ("cusparse.h", "cublas_v2.h", "cublasLt.h", "cusolverDn.h")


def cuda_include_dirs(cuda: str, site_packages: str) -> list[str]:
    """The toolkit's include dir, then those of pip's nvidia-* packages (torch's CUDA wheels depend on them: a machine
    with nvcc but without the toolkit's math-library headers has them there)."""
    import glob

    return [os.path.join(cuda, "include")] + sorted(glob.glob(os.path.join(site_packages, "nvidia", "*", "include")))


def missing_headers(dirs: list[str]) -> list[str]:
    return [h for h in CUDA_LIBRARY_HEADERS if not any(os.path.exists(os.path.join(d, h)) for d in dirs)]


def torch_flags() -> dict:
    """Include and library paths and defines of this torch, as its BuildExtension would use them."""
    import torch
    import torch.utils.cpp_extension as ce

    root = os.path.dirname(torch.__file__)
    inc = [os.path.join(root, "include"), os.path.join(root, "include", "torch", "csrc", "api", "include"),
           sysconfig.get_paths()["include"]]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    with warnings.catch_warnings():  # newer torch: deprecated and empty (pybind11 handles its ABI itself)
        warnings.simplefilter("ignore")
        pybind = getattr(ce, "_get_pybind11_abi_build_flags", lambda: [])()
    return {"include": inc, "lib": os.path.join(root, "lib"), "defines": [f"-D_GLIBCXX_USE_CXX11_ABI={abi}"] + pybind,
            "site_packages": os.path.dirname(root)}


def compile_commands(src: str, obj_dir: str, arch: str, cuda: str, tf: dict) -> list[tuple[str, str, list[str]]]:
    """(extension, object path, command) for every translation unit of EXTENSIONS."""
    inc = [f"-I{p}" for p in [os.path.join(src, "csrc")] + tf["include"]
           + cuda_include_dirs(cuda, tf.get("site_packages", ""))]
    gencode = ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    cmds = []
    for ext, sources in EXTENSIONS.items():
        name = [f"-DTORCH_EXTENSION_NAME={ext}", "-DTORCH_API_INCLUDE_EXTENSION_H"]
        for s in sources:
            obj = os.path.join(obj_dir, ext, os.path.basename(s) + ".o")
            path = os.path.join(src, s)
            if s.endswith(".cu"):
                cmd = [os.path.join(cuda, "bin", "nvcc"), *TORCH_NVCC_PREFIX, *inc, "--compiler-options", "-fPIC",
                       *UPSTREAM_NVCC_FLAGS, *gencode, *name, *tf["defines"], "-c", path, "-o", obj]
            else:
                cmd = [os.environ.get("CXX", "g++"), "-fPIC", *inc, *UPSTREAM_CXX_FLAGS, *name, *tf["defines"],
                       "-c", path, "-o", obj]
            cmds.append((ext, obj, cmd))
    return cmds


def link_command(ext: str, objs: list[str], out_path: str, cuda: str, tf: dict) -> list[str]:
    """torch's extension link line (BuildExtension on Linux): libtorch + CUDA runtime, shared, OpenMP as upstream."""
    return [os.environ.get("CXX", "g++"), "-shared", *objs, f"-L{tf['lib']}", "-lc10", "-lc10_cuda", "-ltorch_cpu",
            "-ltorch_cuda", "-ltorch", "-ltorch_python", f"-L{os.path.join(cuda, 'lib64')}", "-lcudart", "-lgomp",
            "-o", out_path]


def _run(cmd: list[str]) -> tuple[int, float, str]:
    t0 = time.time()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return p.returncode, time.time() - t0, p.stdout


def build(src: str, out: str, arch: str, jobs: int, compile_only: bool = False) -> dict:
    """Compile EXTENSIONS from `src` into `out`/sageattention/ (the package copied beside them). Raises SystemExit
    with the compiler's output on the first failure. Returns timings."""
    missing = [s for ss in EXTENSIONS.values() for s in ss if not os.path.exists(os.path.join(src, s))]
    if missing:
        raise SystemExit(f"--src {src!r} lacks {missing}: run `sa2_build.py prepare` first")
    cuda, tf = cuda_home(), torch_flags()
    dirs = cuda_include_dirs(cuda, tf["site_packages"])
    if missing_headers(dirs):  # fail before minutes of compiling, not at the last unit
        raise SystemExit(f"no {', '.join(missing_headers(dirs))} in {dirs}: torch's CUDA headers (used by "
                         f"csrc/fused/fused.cu) need the CUDA toolkit's cuSPARSE/cuBLAS/cuSOLVER dev headers under "
                         f"CUDA_HOME or pip's nvidia-* packages")
    pkg = os.path.join(out, "sageattention")
    obj_dir = os.path.join(out, "obj")
    if os.path.exists(pkg):
        shutil.rmtree(pkg)
    shutil.copytree(os.path.join(src, "sageattention"), pkg, ignore=shutil.ignore_patterns("__pycache__"))
    for ext in EXTENSIONS:
        os.makedirs(os.path.join(obj_dir, ext), exist_ok=True)
    cmds = compile_commands(src, obj_dir, arch, cuda, tf)
    _log(f"compiling {len(cmds)} units for sm_{arch} with {jobs} jobs (CUDA {cuda})")
    t0 = time.time()
    times = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futs = {pool.submit(_run, cmd): (ext, obj, cmd) for ext, obj, cmd in cmds}
        for fut in concurrent.futures.as_completed(futs):
            ext, obj, cmd = futs[fut]
            rc, sec, text = fut.result()
            times[os.path.basename(obj)] = round(sec, 1)
            if rc != 0:
                pool.shutdown(cancel_futures=True)
                raise SystemExit(f"compile failed ({rc}): {' '.join(cmd)}\n{text[-6000:]}")
            _log(f"  {os.path.basename(obj)}: {sec:.0f} s")
    res = {"arch": arch, "jobs": jobs, "compile_s": round(time.time() - t0, 1), "units_s": times}
    if not compile_only:
        suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
        for ext, sources in EXTENSIONS.items():
            objs = [o for e, o, _ in cmds if e == ext]
            cmd = link_command(ext, objs, os.path.join(pkg, ext + suffix), cuda, tf)
            rc, _, text = _run(cmd)
            if rc != 0:
                raise SystemExit(f"link failed ({rc}): {' '.join(cmd)}\n{text[-4000:]}")
    res["total_s"] = round(time.time() - t0, 1)
    info = os.path.join(src, "UPSTREAM.json")
    res["upstream"] = json.load(open(info)) if os.path.exists(info) else {}
    with open(os.path.join(out, "build.json"), "w") as f:
        json.dump(res, f, indent=1)
    _log(f"done in {res['total_s']} s" + (" (compile only)" if compile_only else f": {pkg}"))
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="copy the files the build needs from a full checkout")
    p.add_argument("--from", dest="src", required=True, help="a SageAttention checkout (e.g. git archive output)")
    p.add_argument("--to", default=".sa2src")
    p.add_argument("--commit", default=None, help="the upstream commit the checkout is of (recorded)")
    b = sub.add_parser("build", help="compile the extensions (on the GPU machine)")
    b.add_argument("--src", default=".sa2src")
    b.add_argument("--out", default="build/sa2")
    b.add_argument("--arch", default="90a", help=f"one of {', '.join(ARCHS)} (default 90a, as upstream on an H100)")
    b.add_argument("--jobs", type=int, default=int(os.environ.get("MAX_JOBS", 0)) or os.cpu_count() or 1)
    b.add_argument("--compile-only", action="store_true", help="stop before linking (CPU-only torch)")
    a = ap.parse_args(argv)
    if a.cmd == "prepare":
        prepare(a.src, a.to, a.commit)
    else:
        if a.jobs < 1:
            raise SystemExit(f"--jobs must be >= 1, got {a.jobs}")
        build(a.src, a.out, parse_arch(a.arch), a.jobs, a.compile_only)
    return 0


if __name__ == "__main__":
    sys.exit(main())

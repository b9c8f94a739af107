"""Wall time of the first and the second call of each compiled kernel path: with a library whose image for this GPU
is PTX (a PTX-only build, or a GPU newer than every SASS target), the first call includes the driver's JIT compile.

    SAGE_PATCH_CUDA_ARCHS=compute_90 python kernels_cuda/build_kernels.py --out build/ptx_only     # here, no GPU
    CUDA_CACHE_DISABLE=1 SAGE_PATCH_KERNELS_LIB=build/ptx_only/libsage_kernels.so \
        python tools/ptx_jit_time.py --json out/jit.json                                       # on the GPU

CUDA_CACHE_DISABLE=1 makes the driver compile instead of reading its JIT cache (~/.nv/ComputeCache), so the first
call shows the cost a user pays once per driver cache. torch's own CUDA start-up and SDPA are warmed up first and not
counted. Each path is a fresh kernel instantiation (8b, 4b, head dims 64 and 128, causal): with lazy module loading
the driver JIT-compiles what a launch needs.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

import sage_patch.kernels as K
from sage_patch.kernels import _lib

CASES = [  # (precision, head dim, causal): each a distinct kernel the first call must get compiled
    ("8b", 128, False), ("8b", 128, True), ("8b", 64, False), ("4b", 128, False), ("4b", 64, True),
]


def _timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--tokens", type=int, default=4096)
    a = ap.parse_args(argv)
    st = K.status()
    if not st["loaded"]:
        raise SystemExit(f"kernels not loaded: {st['reason']}")
    major, minor = torch.cuda.get_device_capability()
    image = _lib.arch_image(st["archs"], major, minor)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, 8, a.tokens, 128, device="cuda", generator=g, dtype=torch.float16)
    _timed(lambda: torch.nn.functional.scaled_dot_product_attention(x, x, x))  # torch's own warm-up
    hopper = K.registry.get("wgmma-fp8").why_not(K.registry.Target((major, minor), tuple(st["archs"]), "8b"))
    res = {"device": torch.cuda.get_device_name(), "arch": f"sm_{major}{minor}", "library": st["path"],
           "targets": st["archs"], "image": image, "status": st["reason"], "wgmma_why_not": hopper,
           "cuda_cache_disable": os.environ.get("CUDA_CACHE_DISABLE"),
           "cuda_module_loading": os.environ.get("CUDA_MODULE_LOADING", "LAZY (default)"), "cases": []}
    print(f"{res['device']} ({res['arch']}): library image {image}; CUDA_CACHE_DISABLE="
          f"{res['cuda_cache_disable']}\nstatus: {st['reason']}\nwgmma kernel: {hopper or 'serves 8b'}")
    t_all = time.perf_counter()
    for precision, d, causal in CASES:
        q = torch.randn(1, 8, a.tokens, d, device="cuda", generator=g, dtype=torch.float16)
        variant = K.variant_for(q, precision=precision)
        call = lambda: K.attention(q, q, q, is_causal=causal, precision=precision)  # noqa: E731
        first, second = _timed(call), _timed(call)
        case = {"precision": precision, "head_dim": d, "causal": causal, "kernel": variant.key,
                "first_s": round(first, 4), "second_s": round(second, 5), "jit_s": round(first - second, 4)}
        res["cases"].append(case)
        print(f"{precision} D={d} causal={causal} [{variant.key}]: first call {first * 1e3:.1f} ms, second "
              f"{second * 1e3:.2f} ms (first - second: {case['jit_s'] * 1e3:.1f} ms)")
    res["all_cases_s"] = round(time.perf_counter() - t_all, 3)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The fuzzed grid on the GPU: a few thousand random calls with the kernels forced at every length (conftest's
SPEED_ROUTING = False, as SAGE_PATCH_SPEED_ROUTING=0), each vs float64, reporting failures by kind and which implementation ran."""
import collections
import json
import logging
import os
import sys

import pytest
import torch

import sage_patch.kernels as K

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from attention_fuzz import run_grid  # noqa: E402

pytestmark = pytest.mark.gpu
GPU_CASES = int(os.environ.get("SAGE_FUZZ_CASES", "3000"))
FIRST_SEED = int(os.environ.get("SAGE_FUZZ_FIRST_SEED", "10000"))
GPU_SECONDS = float(os.environ.get("SAGE_FUZZ_SECONDS", "400"))  # stop drawing new cases after this long


def _kernel_fits(c) -> bool:
    """Calls a compiled kernel must serve (an independent statement of the routing rule): a quantized precision
    (fp4 runs as 8b off Blackwell), head dims of Q/K and V up to the largest native one (those not native run
    zero-padded to the next), fp16/bf16, no dense or float mask; varlen is left out: its kernel path records no
    per-call statistics yet."""
    if c.api == "sdpa" and (c.causal or c.window >= 0) and c.sq != c.skv:  # torch's top-left rule: a dense mask
        return False
    return (c.precision != "full" and c.api != "varlen" and max(c.d, c.dv) <= max(K.NATIVE_HEAD_DIMS)
            and c.dtype in (torch.float16, torch.bfloat16) and c.mask in ("none", "key_padding", "key_padding_4d"))


def test_fuzz_grid_gpu():
    if not K.status()["loaded"]:
        pytest.skip(f"compiled kernels not loaded: {K.status()['reason']}")
    logging.getLogger("sage_patch").setLevel(logging.ERROR)
    kinds, failures, infos = run_grid(range(FIRST_SEED, FIRST_SEED + GPU_CASES), device="cuda", budget=4e7,
                                      expect_kernel=_kernel_fits, seconds=GPU_SECONDS, progress=250)
    impls = collections.Counter()
    for _, info in infos:
        impls.update(info.get("impl", {}))
    summary = {"cases": len(infos), "failures": dict(kinds), "impls": dict(impls),
               "worst_rel_l1": {}, "device": torch.cuda.get_device_name()}
    for c, info in infos:
        for p in info.get("used", {}):
            key = f"{p}/{str(c.dtype)[6:]}" if p == "full" else p
            summary["worst_rel_l1"][key] = max(summary["worst_rel_l1"].get(key, 0.0), info.get("rel_l1", 0.0))
    print(json.dumps(summary))
    out = os.environ.get("SAGE_TEST_RESULTS")
    if out:
        with open(out, "a") as f:
            f.write(json.dumps({"fuzz_gpu": summary}) + "\n")
    detail = "\n".join(f"{kind}: {msg} | {c}" for c, kind, msg in failures[:30])
    assert not failures, f"failures by kind {dict(kinds)}:\n{detail}"
    assert len(infos) >= min(GPU_CASES, 1000), f"only {len(infos)} cases in {GPU_SECONDS} s"
    # the grid really exercises the kernels: every call a kernel must serve ran one (checked per case above), and
    # such calls are a good share of the grid
    eligible = sum(_kernel_fits(c) for c, _ in infos)
    assert eligible >= len(infos) // 10
    assert sum(v for k, v in impls.items() if k.startswith("cuda-")) >= eligible

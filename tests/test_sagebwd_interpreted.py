"""The SageBwd Triton kernels themselves on CPU, under Triton's interpreter (TRITON_INTERPRET=1): the non-finite
rule in training (attention_fuzz.check_nonfinite_training) at small shapes. Needs the `triton` package (skipped
without it); tests/gpu/test_sagebwd_gpu.py runs the same checks compiled.

Each case runs in a child process: triton.jit reads TRITON_INTERPRET when a function is defined, Triton's own
library functions included, so the interpreter cannot be switched on in a process that has imported triton."""
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from attention_fuzz import NONFINITE_WHERE, check_nonfinite_training  # noqa: E402

def _kernels(q, k, v, dout, mask, causal):
    from sage_patch.kernels import sagebwd

    scale = 1 / math.sqrt(q.shape[-1])
    out, lse, lse_s, qi, qs, ki, ks = sagebwd.forward(q, k, v, is_causal=causal, scale=scale, key_padding_mask=mask)
    dq, dk, dv = sagebwd.backward(dout, qi, qs, ki, ks, v, out, lse_s, is_causal=causal, scale=scale,
                                  key_padding_mask=mask)
    return out, dq, dk, dv


def _child(causal, key_padding):
    """Runs in the child (TRITON_INTERPRET=1): prints the failures of the four locations as JSON. The run without
    the value is the same for all four: made once (the interpreter takes seconds per call)."""
    cache = {}

    def run(*args):
        key = tuple(x.numpy().tobytes() if isinstance(x, torch.Tensor) else x for x in args)
        if key not in cache:
            cache[key] = _kernels(*args)
        return cache[key]

    fails = []
    for where, bad in zip(NONFINITE_WHERE, BAD[causal]):
        fails += [[where, *f] for f in check_nonfinite_training(
            run, where, bad, b=2, hq=2, hkv=1, sq=72, skv=48, d=64, dtype=torch.float16, causal=causal == "1",
            key_padding=key_padding == "1")]
    print(json.dumps(fails))


# NaN and Inf in each of q, k, v, dout over the two cases. fp16 only: the interpreter misreads bf16 tiles loaded
# through tensor descriptors (Triton 3.9: finite garbage); the GPU tests cover bf16.
BAD = {"1": (math.nan, math.inf, -math.inf, math.nan), "0": (-math.inf, math.nan, math.nan, math.inf)}


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs the triton package (its interpreter)")
@pytest.mark.parametrize("causal, key_padding", [
    (True, False),     # Sq > Skv: the first rows see no key
    (False, True),     # key padding, a fully padded batch entry
])
def test_kernels_nonfinite_poisons_what_it_reaches(causal, key_padding):
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(p for p in (os.path.dirname(HERE), os.environ.get("PYTHONPATH")) if p))
    r = subprocess.run([sys.executable, __file__, str(int(causal)), str(int(key_padding))], capture_output=True,
                       text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    fails = json.loads(r.stdout.strip().splitlines()[-1])
    assert not fails, fails


if __name__ == "__main__":
    _child(*sys.argv[1:])

"""Helpers shared by the GPU kernel tests: inputs with realistic outliers, NaN-poisoned outputs, result records."""
from __future__ import annotations

import json
import os

import torch

DEV = "cuda"


def record(res: dict) -> None:
    """Print the measured figures; with SAGE_TEST_RESULTS=path also append them there as JSON lines."""
    print(res)
    path = os.environ.get("SAGE_TEST_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(res) + "\n")


def make_qkv(b, hq, hkv, sq, skv, d, dtype=torch.float16, layout="bhsd", seed=0, q_bias=None, kv_bias=4.0):
    """Random q, k, v; k and v (and q if q_bias) get a per-channel bias of that size times randn(d), the channel
    outliers real K and V tensors have. layout "bshd" returns contiguous (B, S, H, D) tensors."""
    g = torch.Generator(device=DEV).manual_seed(seed)

    def rnd(h, s, bias):
        x = torch.randn(b, h, s, d, generator=g, device=DEV)
        if bias is not None:
            x = x + bias * torch.randn(d, generator=g, device=DEV)
        x = x.to(dtype)
        return x.transpose(1, 2).contiguous() if layout == "bshd" else x

    return rnd(hq, sq, q_bias), rnd(hkv, skv, kv_bias), rnd(hkv, skv, kv_bias)


def to_bhsd(x, layout):
    return x.transpose(1, 2) if layout == "bshd" else x


def poison(shape, dtype):
    """Fill the caching allocator's next blocks of this size with NaN, so unwritten outputs show."""
    t = torch.full(shape, float("nan"), device=DEV, dtype=dtype)
    del t

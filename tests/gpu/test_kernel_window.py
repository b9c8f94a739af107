"""Sliding windows in the compiled kernels (SageAttnParams.window_keys; `kernels.attention(window_left=...)`): the
wgmma kernel and the portable mma.sync kernel, each against the simulation of its own layout and float64 with the
window given as a dense mask (gpu_helpers.window_mask), with key padding, Sq != Skv (bottom-right), windows that cut
inside a block and across the tile's warpgroups, a window of one key, and one wider than the sequence. (That blocks
outside the window are skipped shows in time, benchmarks/bench_window.py: a NaN key outside the window would still
reach every row through the per-head K mean and V scale, so it cannot show it.) Run with `pytest -m gpu tests/gpu`."""
from __future__ import annotations

import pytest
import torch

import sage_patch.kernels as K
from gpu_helpers import DEV, check_kernel_case

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or not K.status()["loaded"]:  # pragma: no cover - CPU machines
    pytest.skip(f"compiled kernels not usable here: {K.status()['reason']}", allow_module_level=True)

HOPPER = torch.cuda.get_device_capability() == (9, 0) and "90a" in K.status()["archs"]
PVS = ["wgmma", "fp8"] if HOPPER else ["fp8"]

CASES = [  # b, hq, hkv, sq, skv, d, window_left, causal, padding
    (2, 4, 2, 1000, 1000, 128, 255, True, None),       # cuts inside 128-key blocks, across warpgroups
    (1, 4, 1, 4129, 4129, 64, 1023, True, "left"),     # generate()'s left padding, several tiles
    (2, 2, 2, 300, 1500, 128, 99, True, "right"),       # chunked prefill: the queries are the last 300 keys
    (1, 2, 2, 777, 777, 64, 0, True, None),            # one key: the diagonal
    (1, 2, 1, 513, 513, 128, 4096, True, None),         # wider than the sequence: causal alone
    (1, 2, 2, 640, 640, 64, 200, False, None),          # window without causal: keys after the diagonal stay
    (2, 4, 2, 1000, 1000, 256, 255, True, "left"),      # head dim 256
]


def _padding(kind, b, skv):
    if kind is None:
        return None
    m = torch.ones(b, skv, dtype=torch.bool, device=DEV)
    for i in range(b):
        n = 37 + 301 * i
        if kind == "left":
            m[i, :n] = False
        else:
            m[i, skv - n:] = False
    return m


@pytest.mark.parametrize("pv", PVS)
@pytest.mark.parametrize("b,hq,hkv,sq,skv,d,wl,causal,pad", CASES)
def test_window_matches_simulation_and_float64(pv, b, hq, hkv, sq, skv, d, wl, causal, pad):
    # LSE vs the simulation: test_kernel_8b's 5e-3 (a K rounding one step apart moves a score by one quantum, the
    # LSE by p times that); with one visible key (wl 0) p = 1 and the LSE is that score: one quantum, ~1e-2
    check_kernel_case("8b", b, hq, hkv, sq, skv, d, sim_l1=1e-3, lse_atol=5e-3 if wl else 1.5e-2, causal=causal,
                      mask=_padding(pad, b, skv), pv=pv, window_left=wl, seed=sq + wl, dtype=torch.bfloat16,
                      name=f"window {pv} b{b} h{hq}/{hkv} {sq}x{skv} d{d} left={wl} causal={causal} pad={pad}")


"""A CUDA device the library holds no kernel for (sm_120, sm_75): quantized precisions run full precision with
a reason naming the device and what to do, never the reference simulation (unless asked for); CPU keeps it."""
import types

import pytest
import torch

import sage_patch
import sage_patch.kernels as K
import sage_patch.resolve as R
from sage_patch.masks import MaskInfo
from sage_patch.report import GLOBAL_STATS

ARCHS = ["80", "86", "89", "90a"]


@pytest.fixture
def device_cc(monkeypatch):
    """CPU tensors posing as CUDA ones, on a device of the capability the test sets, with a library of ARCHS:
    kernels.status() runs its real checks on that capability."""
    cc = {}
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: self.device.type == "cpu"), raising=False)
    monkeypatch.setattr(K._lib, "_LIB", types.SimpleNamespace(handle=object(), reason="loaded", path="fake.so",
                                                              archs=list(ARCHS)))
    monkeypatch.setattr(K, "_cuda_available", lambda: True)
    monkeypatch.setattr(K, "_STATUS_CACHE", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    import sage_patch.kernels._ops as ops

    monkeypatch.setattr(ops, "device_cc", lambda dev: cc["cc"])
    # resolve caches these for torch.compile; here they must follow the faked device
    monkeypatch.setattr(R, "_kernels_loaded", lambda: bool(K._status()["loaded"]))
    monkeypatch.setattr(R, "_kernels_reason", lambda: str(K._status()["reason"]))
    return cc


@pytest.mark.parametrize("cc, name", [((12, 0), "sm_120"), ((7, 5), "sm_75")])
@pytest.mark.parametrize("precision", ["8b", "4b", "fp4"])
def test_no_kernel_runs_full_with_the_reason(device_cc, cc, name, precision):
    device_cc["cc"] = cc
    q = torch.randn(1, 2, 64, 64, dtype=torch.float16)
    d = R.resolve(precision, q, q, q, layout="bhsd", is_causal=False, mask=MaskInfo("none", None), dropout_p=0.0,
                  return_lse=False, smooth_v=False)
    assert d.impl == "sdpa" and d.precision == "full" and d.variant is None
    assert name in d.reason and "SAGE_PATCH_CUDA_ARCHS" in d.reason and "SAGE_PATCH_SIMULATE_ON_GPU" in d.reason
    GLOBAL_STATS.reset()
    out = sage_patch.attention(q, q, q, precision=precision)
    assert GLOBAL_STATS.to_dict()["impl"] == {"sdpa": 1}
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), q.float(), q.float())
    assert (out.float() - ref).abs().max() < 1e-2  # full precision, not the simulation's quantization error


def test_simulation_on_the_gpu_only_when_asked(device_cc, monkeypatch):
    device_cc["cc"] = (12, 0)
    monkeypatch.setattr(R, "SIMULATE_ON_GPU", True)
    q = torch.randn(1, 2, 64, 64, dtype=torch.float16)
    d = R.resolve("8b", q, q, q, layout="bhsd", is_causal=False, mask=MaskInfo("none", None), dropout_p=0.0,
                  return_lse=False, smooth_v=False)
    assert d.impl == "reference" and "SAGE_PATCH_SIMULATE_ON_GPU=1" in d.reason


def test_cpu_keeps_the_reference():
    q = torch.randn(1, 2, 64, 64)
    GLOBAL_STATS.reset()
    sage_patch.attention(q, q, q, precision="8b")
    st = GLOBAL_STATS.to_dict()
    assert st["impl"] == {"reference": 1} and any("reference simulation" in r for r in st["fallbacks"])

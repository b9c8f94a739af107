"""A CUDA device the library holds no kernel for (sm_120, sm_75): quantized precisions run full precision with
a reason naming the device and what to do, never the reference simulation (unless asked for); CPU keeps it."""
import pytest
import torch

import sage_patch
import sage_patch.kernels as K
import sage_patch.resolve as R
from sage_patch.masks import MaskInfo
from sage_patch.report import GLOBAL_STATS

ARCHS = ["80", "86", "89", "90a"]


@pytest.fixture
def device_cc(fake_cuda):
    """CPU tensors posing as CUDA ones, on a device of the capability the test sets, with a library of ARCHS:
    kernels.status() runs its real checks on that capability (conftest.fake_cuda)."""
    return fake_cuda(ARCHS)


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


# --- fp4 (no kernel on any GPU yet): the fastest precision with a kernel on the (faked) device, with the reason ---
NEW_ARCHS = ["80", "86", "89", "90a", "100", "120", "compute_120"]  # kernels_cuda/build_kernels.py DEFAULT_ARCHS


def _resolve(precision, n=64):
    q = torch.randn(1, 2, n, 128, dtype=torch.float16)
    return R.resolve(precision, q, q, q, layout="bhsd", is_causal=False, mask=MaskInfo("none", None), dropout_p=0.0,
                     return_lse=False, smooth_v=False)


@pytest.mark.parametrize("cc, archs, precision, variant", [
    ((8, 0), ARCHS, "4b", "mma-fp16-qk4"),          # Ampere: native INT4 MMA, 4b is faster than 8b
    ((8, 9), ARCHS, "4b", "mma-fp8-qk4"),           # Ada: the same, FP8 P~V
    ((9, 0), ARCHS, "8b", "wgmma-fp8"),             # Hopper: no INT4 tensor cores, 8b's wgmma kernel
    ((12, 0), NEW_ARCHS, "8b", "mma-fp8"),          # consumer Blackwell: sm_120 SASS, INT4 values would ride INT8 MMA
    ((10, 0), NEW_ARCHS, "8b", "mma-fp8"),          # datacenter Blackwell: sm_100 SASS
    ((13, 0), NEW_ARCHS, "8b", "mma-fp8"),          # a GPU newer than every SASS target: the compute_120 PTX
])
def test_fp4_runs_the_fastest_precision_with_a_kernel(device_cc, monkeypatch, cc, archs, precision, variant):
    device_cc["cc"] = cc
    device_cc["lib"].archs = list(archs)
    monkeypatch.setattr(K, "SPEED_ROUTING", False)  # the choice of kernel, not the SDPA crossover, is tested here
    d = _resolve("fp4")
    assert (d.precision, d.variant.key if d.variant else None) == (precision, variant), d
    assert d.reason.startswith("fp4 unavailable (fp4 has no compiled kernel") and "Blackwell" in d.reason
    assert d.reason.endswith(f"using {precision}, the fastest precision with a kernel here")
    # the stand-in is what that precision itself resolves to here
    assert _resolve(precision).variant == d.variant


def test_fp4_with_no_kernel_anywhere_runs_full(device_cc):
    device_cc["cc"] = (11, 0)  # Jetson Thor: no SASS of major 11, and the compute_120 PTX does not JIT below 12.0
    device_cc["lib"].archs = list(NEW_ARCHS)
    d = _resolve("fp4")
    assert d.impl == "sdpa" and d.precision == "full" and "sm_110" in d.reason
    assert "compute_120 (PTX)" in d.reason  # the library's targets, PTX named as such


def test_fp4_stand_in_keeps_speed_routing(device_cc, monkeypatch):
    """On Hopper fp4 runs 8b's wgmma kernel, and below its measured crossover SDPA (faster, exact), as 8b would."""
    device_cc["cc"] = (9, 0)
    monkeypatch.setattr(K, "SPEED_ROUTING", True)
    d = _resolve("fp4", n=256)
    assert d.impl == "sdpa" and "SDPA is faster" in d.reason


def test_ptx_only_library_serves_hopper_with_the_portable_kernel(device_cc):
    """A library holding only compute_90 PTX (the JIT test build): the wgmma kernel needs sm_90a SASS, so 8b runs the
    portable FP8 kernel, and the reason says why."""
    device_cc["cc"] = (9, 0)
    device_cc["lib"].archs = ["compute_90"]
    st = K.status()
    assert st["loaded"] and "compute_90 PTX JIT-compiled by the driver" in st["reason"]
    from sage_patch.kernels import registry

    v, _ = registry.select(registry.Target((9, 0), ("compute_90",), "8b"))
    assert v.key == "mma-fp8f16"
    why = registry.get("wgmma-fp8").why_not(registry.Target((9, 0), ("compute_90",), "8b"))
    assert "sm_90a SASS" in why and "PTX" in why
    # compute_80 PTX has no e4m3 instructions: the FP16 P~V kernel
    v, _ = registry.select(registry.Target((9, 0), ("compute_80",), "8b"))
    assert v.key == "mma-fp16"

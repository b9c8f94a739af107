"""A CUDA device the library holds no kernel for (sm_120, sm_75): quantized precisions run full precision with
a reason naming the device and what to do, never the reference simulation (unless asked for); CPU keeps it."""
import pytest
import torch

import sage_patch
import sage_patch.kernels as K
import sage_patch.resolve as R
from sage_patch.masks import MaskInfo
from sage_patch.policy import Policy
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


# --- 4b without INT4 tensor cores: 8b stands in (faster and more accurate); options.exact_4b keeps 4b ------------

def _resolve_with(precision, n=64, policy=None, mask=None, d=128):
    q = torch.randn(1, 2, n, d, dtype=torch.float16)
    m = MaskInfo("none", None) if mask is None else MaskInfo("key_padding", mask)
    return R.resolve(precision, q, q, q, layout="bhsd", is_causal=False, mask=m, dropout_p=0.0, return_lse=False,
                     smooth_v=False, policy=policy)


@pytest.mark.parametrize("cc, archs, precision, variant", [
    ((8, 0), ARCHS, "4b", "mma-fp16-qk4"),      # Ampere: native INT4 MMA, 4b as asked
    ((8, 9), ARCHS, "4b", "mma-fp8-qk4"),       # Ada: the same
    ((9, 0), ARCHS, "8b", "wgmma-fp8"),         # Hopper: no INT4 tensor cores: 8b's wgmma kernel
    ((10, 0), NEW_ARCHS, "8b", "mma-fp8"),      # datacenter Blackwell: none either
    ((12, 0), NEW_ARCHS, "8b", "mma-fp8"),      # consumer Blackwell: none either
])
def test_4b_without_int4_tensor_cores_runs_8b(device_cc, monkeypatch, cc, archs, precision, variant):
    device_cc["cc"] = cc
    device_cc["lib"].archs = list(archs)
    monkeypatch.setattr(K, "SPEED_ROUTING", False)  # the choice of kernel, not the SDPA crossover, is tested here
    d = _resolve_with("4b")
    assert (d.precision, d.variant.key) == (precision, variant), d
    if precision == "8b":
        assert d.reason.startswith("4b unavailable (no INT4 tensor cores on this GPU: 4b would carry INT4 values in "
                                   "INT8 MMA") and "options.exact_4b: true keeps 4b" in d.reason
        assert d.reason.endswith("using 8b, the fastest precision with a kernel here")
        # exact_4b: the 4b numerics, on the portable kernel (INT4 values in INT8 MMA)
        e = _resolve_with("4b", policy=Policy(exact_4b=True))
        assert e.precision == "4b" and e.variant.qk == "int8" and e.reason is None, e
    else:
        assert d.reason is None


def test_4b_on_hopper_is_reported(device_cc, monkeypatch):
    """What runs and why reaches report() (the layer's stats) and the fallback log, as fp4's stand-in does."""
    device_cc["cc"] = (9, 0)
    monkeypatch.setattr(K, "SPEED_ROUTING", False)
    monkeypatch.setattr(K, "run", lambda variant, precision, q, *a, **kw: q.new_zeros(q.shape))
    GLOBAL_STATS.reset()
    q = torch.randn(1, 2, 64, 128, dtype=torch.float16)
    sage_patch.attention(q, q, q, precision="4b")
    st = GLOBAL_STATS.to_dict()
    assert st["used"] == {"8b": 1} and st["impl"] == {K.IMPL_WGMMA: 1}
    assert any("no INT4 tensor cores" in r for r in st["fallbacks"])


def test_portable_kernels_route_to_sdpa_on_hopper(device_cc, monkeypatch):
    """The portable mma.sync kernels are slower than SDPA on sm_90 at every length: a call they would serve runs SDPA
    (key-padding calls too), unless speed routing is off. The wgmma kernel keeps key-padding calls below its
    crossover (masked SDPA is ~0.6x of the unmasked SDPA it was measured against)."""
    from sage_patch.kernels import registry

    device_cc["cc"] = (9, 0)
    monkeypatch.setattr(K, "SPEED_ROUTING", True)
    monkeypatch.setattr(registry, "FORCE_PV", "fp8-f16")  # 8b on the portable kernel, as a PTX-only build runs it
    kp = torch.ones(1, 8192, dtype=torch.bool)
    for mask in (None, kp):
        d = _resolve_with("8b", n=8192, mask=mask)
        assert d.impl == "sdpa" and "SDPA is faster than cuda-mma-fp8pv at every measured length on sm_90" in d.reason
    monkeypatch.setattr(K, "SPEED_ROUTING", False)
    assert _resolve_with("8b", n=8192).variant.key == "mma-fp8f16"
    monkeypatch.setattr(K, "SPEED_ROUTING", True)
    monkeypatch.setattr(registry, "FORCE_PV", None)
    assert _resolve_with("8b", n=1024, mask=torch.ones(1, 1024, dtype=torch.bool)).variant.key == "wgmma-fp8"
    assert _resolve_with("8b", n=1024).impl == "sdpa"
    # sm_100 (not measured): assumed as sm_90, and the reason says it is an assumption
    device_cc["cc"] = (10, 0)
    device_cc["lib"].archs = list(NEW_ARCHS)
    d = _resolve_with("8b", n=8192)
    assert d.impl == "sdpa" and "at every length (assumed on sm_100: not measured there)" in d.reason
    device_cc["cc"] = (8, 9)  # no crossover: the kernel at every length
    device_cc["lib"].archs = list(ARCHS)
    assert _resolve_with("8b", n=128).variant.key == "mma-fp8"


def test_exact_4b_on_hopper_keeps_the_kernel_with_the_reason(device_cc, monkeypatch):
    """options.exact_4b asks for the 4b numerics: speed routing would run full precision instead, so the portable
    kernel runs, and the reason says SDPA is faster."""
    device_cc["cc"] = (9, 0)
    monkeypatch.setattr(K, "SPEED_ROUTING", True)
    d = _resolve_with("4b", n=8192, policy=Policy(exact_4b=True))
    assert d.precision == "4b" and d.variant.key == "mma-fp8f16"
    assert d.reason.startswith("policy options.exact_4b keeps the 4b kernel (mma-fp8f16) though SDPA is faster "
                               "than cuda-mma-fp8pv at every measured length on sm_90")
    d = _resolve_with("4b", n=8192)  # without it: 8b's kernel, past its crossover
    assert d.precision == "8b" and d.variant.key == "wgmma-fp8"

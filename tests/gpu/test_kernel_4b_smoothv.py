"""Compiled "4b" and smooth_v on a CUDA GPU (run with `pytest -m gpu tests/gpu`; skipped without CUDA or kernels).

Every case: fresh structured inputs (randn + a 4-sigma per-channel bias on K and V, and a per-channel bias on Q so
Q smoothing matters), NaN-poisoned output memory, inputs checked unchanged, and the kernel compared with
  - the reference simulation with the SAME config (sage_patch.kernels.reference_config, same precision and
    smooth_v): rel L1 <= 1e-3 (both rounded to the output dtype);
  - float64 exact attention: cos >= 0.995 ("4b"), cos >= 0.9995 and rel L1 <= 0.03 ("8b" + smooth_v).
"""
from __future__ import annotations

import os

import pytest
import torch

import sage_patch.kernels as K
from sage_patch.accuracy import compare
from sage_patch.reference import exact_attention
from gpu_helpers import DEV, check_kernel_case, poison, record, routed_precision
from gpu_helpers import make_qkv as _make_qkv

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or not K.status()["loaded"]:  # pragma: no cover - CPU machines
    pytest.skip(f"compiled kernels not usable here: {K.status()['reason']}", allow_module_level=True)

SIM_L1 = float(os.environ.get("SAGE_TEST_SIM_L1", "1e-3"))
# INT4 steps are 18x coarser than INT8: one rounding landing a step apart (K mean / Q block mean summed in another
# order than torch's) moves one score by ~0.1; the LSE moves by p * that.
LSE_ATOL = {"8b": 5e-3, "4b": 3e-2}


def make_qkv(*args, **kw):
    return _make_qkv(*args, q_bias=1.0, **kw)  # these cases also give Q a channel bias (Q smoothing of "4b")


def run_case(precision, *args, **kw):  # these cases also give Q a channel bias (Q smoothing of "4b")
    return check_kernel_case(precision, *args, sim_l1=SIM_L1, lse_atol=LSE_ATOL[precision], q_bias=1.0, **kw)


CASES = [
    # b, hq, hkv, sq, skv, d, dtype, layout, causal
    (1, 2, 2, 1, 1, 64, torch.float16, "bhsd", False),
    (2, 4, 4, 77, 77, 128, torch.bfloat16, "bshd", True),
    (1, 4, 4, 1000, 1000, 64, torch.float16, "bshd", False),
    (2, 8, 2, 513, 1031, 128, torch.float16, "bhsd", True),      # GQA, Sq != Skv, causal bottom-right
    (1, 4, 1, 300, 200, 64, torch.bfloat16, "bhsd", True),       # Sq > Skv: first 100 rows empty
    (1, 2, 2, 4097, 4097, 128, torch.bfloat16, "bshd", False),
    (1, 1, 1, 16385, 16385, 64, torch.float16, "bhsd", True),
    (2, 8, 2, 513, 1031, 256, torch.bfloat16, "bshd", True),     # head dim 256: one m16 tile per warp
    (1, 2, 2, 4097, 4097, 256, torch.float16, "bhsd", False),
]


@pytest.mark.parametrize("b,hq,hkv,sq,skv,d,dtype,layout,causal", CASES)
def test_4b_matches_reference_and_exact(b, hq, hkv, sq, skv, d, dtype, layout, causal):
    name = f"4b b{b} h{hq}/{hkv} sq{sq} skv{skv} d{d} {str(dtype)[6:]} {layout} causal={causal}"
    run_case("4b", b, hq, hkv, sq, skv, d, dtype=dtype, layout=layout, causal=causal, seed=sq + d, name=name)


@pytest.mark.parametrize("precision", ["8b", "4b"])
@pytest.mark.parametrize("b,hq,hkv,sq,skv,d,dtype,layout,causal", CASES[1:5])
def test_smooth_v_matches_reference_and_exact(precision, b, hq, hkv, sq, skv, d, dtype, layout, causal):
    name = f"{precision}+smooth_v b{b} h{hq}/{hkv} sq{sq} skv{skv} d{d} {str(dtype)[6:]} {layout} causal={causal}"
    run_case(precision, b, hq, hkv, sq, skv, d, dtype=dtype, layout=layout, causal=causal, smooth_v=True,
             seed=sq + d + 1, name=name)


@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("pv", ["fp16", "fp8-mma", "fp8-f16"])
@pytest.mark.parametrize("precision,smooth_v", [("4b", False), ("8b", True), ("4b", True)])
def test_all_pv_modes(pv, precision, smooth_v, d):
    if pv != "fp16" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 P~V needs sm_89+")
    run_case(precision, 2, 4, 2, 333, 700, d, causal=True, pv=pv, smooth_v=smooth_v, seed=7,
             name=f"{precision} smooth_v={smooth_v} pv={pv} d{d}")


@pytest.mark.parametrize("precision,smooth_v", [("4b", False), ("8b", True), ("4b", True)])
def test_key_padding_mask_with_empty_rows(precision, smooth_v):
    b, skv = 3, 300
    mask = torch.ones(b, skv, dtype=torch.bool, device=DEV)
    mask[0, 200:] = False
    mask[1, :] = False               # fully masked batch: rows 0, LSE -inf (no mean added back)
    mask[2, ::3] = False
    out, lse = run_case(precision, b, 4, 2, 130, skv, 64, mask=mask, smooth_v=smooth_v,
                        name=f"{precision} smooth_v={smooth_v} mask")
    assert (out[1] == 0).all() and torch.isneginf(lse[1]).all()


def test_smooth_v_helps_biased_v():
    """With a large per-channel offset on V, smoothing V lowers the error against exact attention."""
    q, k, v = make_qkv(1, 4, 4, 1024, 1024, 128, torch.float16, seed=21)
    v = (v.float() + 30.0).half()
    ex = exact_attention(q, k, v)
    plain = compare(K.attention(q, k, v)[0], ex)["rel_l1"]
    smooth = compare(K.attention(q, k, v, smooth_v=True)[0], ex)["rel_l1"]
    record({"case": "smooth_v on V+30", "rel_l1_plain": plain, "rel_l1_smooth_v": smooth})
    assert smooth < plain


def test_4b_cuda_graph_and_compile():
    q, k, v = make_qkv(2, 4, 4, 300, 300, 64, torch.bfloat16, seed=3)
    eager, _ = K.attention(q, k, v, is_causal=True, precision="4b", smooth_v=True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        K.attention(q, k, v, is_causal=True, precision="4b", smooth_v=True)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, _ = K.attention(q, k, v, is_causal=True, precision="4b", smooth_v=True)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)

    def f(q, k, v):
        return torch.ops.sage_patch.attn(q, k, v, None, False, True, 0.125, 2, 4, True, False)[0] * 2.0

    torch.testing.assert_close(torch.compile(f, fullgraph=True)(q, k, v),
                               torch.ops.sage_patch.attn(q, k, v, None, False, True, 0.125, 2, 4, True, False)[0] * 2.0)


def test_4b_deterministic_and_routed():
    import sage_patch

    q, k, v = make_qkv(1, 4, 4, 700, 700, 128, torch.float16, seed=9)
    a, _ = K.attention(q, k, v, precision="4b")
    b, _ = K.attention(q, k, v, precision="4b")
    assert torch.equal(a, b)
    impl, why = K.can_run("4b", q, k, v, layout="bhsd", is_causal=False, attn_mask=None, return_lse=False,
                          smooth_v=True)
    assert impl is not None, why
    out = sage_patch.attention(q, k, v, precision="4b", smooth_v=True)
    ref, _ = K.attention(q, k, v, precision=routed_precision(q, "4b"), smooth_v=True)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("d,causal,dtype,pv", [(64, True, torch.float16, None), (128, False, torch.bfloat16, None),
                                               (128, True, torch.float16, "fp16")])
def test_4b_int4_mma_equals_int8_mma(d, causal, dtype, pv):
    """The packed INT4 mma.sync m16n8k64 path (native on sm_80-89, emulated on sm_90) gives exactly the INT8-MMA
    result (same integers, exact int32 sums), and matches the simulation."""
    b, hq, hkv, sq, skv = 2, 4, 2, 333, 1000
    a, la = run_case("4b", b, hq, hkv, sq, skv, d, dtype=dtype, causal=causal, pv=pv, seed=13,
                     name=f"4b int8-mma d{d} causal={causal} pv={pv}")
    q, k, v = make_qkv(b, hq, hkv, sq, skv, d, dtype, seed=13)
    poison(q.shape, dtype)
    c, lc = K.attention(q, k, v, is_causal=causal, pv=pv, precision="4b", qk="int4")
    torch.cuda.synchronize()
    record({"case": f"4b int4-mma vs int8-mma d{d}", "equal": bool(torch.equal(a, c)),
            "maxdiff": float((a.float() - c.float()).abs().max())})
    assert torch.equal(a, c) and torch.equal(la, lc)

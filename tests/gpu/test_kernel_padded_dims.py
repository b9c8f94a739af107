"""Head dims the kernels lack natively, on a CUDA GPU (`pytest -m gpu tests/gpu/test_kernel_padded_dims.py`):
the call runs the kernel of the next native head dim n on Q, K, V zero-padded to n (sage_patch.kernels.head_dims).

Every case: fresh structured inputs (randn + a per-channel bias of 4 sigma on K and V), output memory poisoned with
NaN, inputs checked unchanged, output of the caller's Dv, layout and dtype, and compared with
  - the same kernel run on explicitly zero-padded inputs with the real head dim's scale: bitwise equal (the padded
    call IS the native kernel on the padded layout),
  - the reference simulation of the padded layout (the variant's reference_config at n): rel L1 <= 1e-3, LSE within
    5e-3, the same empty rows (0), and
  - float64 exact attention at the real head dims: cos >= 0.9995, rel L1 <= 0.03, LSE within 0.05.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

import sage_patch
import sage_patch.kernels as K
from sage_patch.accuracy import compare
from sage_patch.kernels import head_dims, registry
from sage_patch.reference import exact_attention, simulate
from gpu_helpers import DEV, check_graph_replay, make_qkv, poison, record, to_bhsd, window_mask

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or not K.status()["loaded"]:  # pragma: no cover - CPU machines
    pytest.skip(f"compiled kernels not usable here: {K.status()['reason']}", allow_module_level=True)

SIM_L1 = float(os.environ.get("SAGE_TEST_SIM_L1", "1e-3"))
SIM_LSE_ATOL = float(os.environ.get("SAGE_TEST_SIM_LSE_ATOL", "5e-3"))


def check_padded_case(b, hq, hkv, sq, skv, d, dv, *, dtype=torch.float16, layout="bhsd", causal=False, mask=None,
                      window_left=-1, seed=0, name=""):
    q, k, _ = make_qkv(b, hq, hkv, sq, skv, d, dtype, layout, seed)
    v = make_qkv(b, hq, hkv, sq, skv, dv, dtype, layout, seed + 1)[2]
    keep = [x.clone() for x in (q, k, v)]
    poison(q.shape[:-1] + (registry.native_head_dim(d, dv),), dtype)
    out, lse = K.attention(q, k, v, layout=layout, is_causal=causal, attn_mask=mask, window_left=window_left)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b_) for a, b_ in zip((q, k, v), keep)), "an input was modified"
    assert out.shape == q.shape[:-1] + (dv,) and out.dtype == dtype and out.is_contiguous()
    assert torch.isfinite(out).all(), "NaN/inf in the output"
    n = registry.native_head_dim(d, dv)
    # the native kernel on the padded layout, with the real head dim's scale: the very same bits
    pq, pk, pv = (head_dims.pad(x, n) for x in (q, k, v))
    nat, nat_lse = K.attention(pq, pk, pv, layout=layout, is_causal=causal, attn_mask=mask, window_left=window_left,
                               scale=1 / math.sqrt(d))
    assert torch.equal(out, nat[..., :dv]) and torch.equal(lse, nat_lse)
    assert (nat[..., dv:] == 0).all(), "V's zero columns must give zero output columns"
    qb, kb, vb, ob = (to_bhsd(x, layout) for x in (q, k, v, out))
    m4 = mask[:, None, None, :] if mask is not None else None
    if window_left >= 0:
        w = window_mask(sq, skv, window_left)
        m4 = w if m4 is None else m4 & w
    variant = K.variant_for(q)
    sim, sim_lse = head_dims.padded(lambda q_, k_, v_, s: simulate(
        q_, k_, v_, "8b", scale=s, is_causal=causal, attn_mask=m4, return_lse=True,
        config=K.reference_config(variant, n)), qb, kb, vb, None)
    res = {"case": name, "padded_to": n, "sim_l1": compare(ob, sim.to(dtype))["rel_l1"]}
    fin = torch.isfinite(sim_lse)
    assert torch.equal(torch.isfinite(lse), fin), "LSE -inf pattern differs from the simulation"
    res["lse_maxdiff"] = float((lse[fin] - sim_lse[fin]).abs().max()) if fin.any() else 0.0
    if (~fin).any():
        assert (ob.float()[~fin] == 0).all(), "empty rows must be 0"
    ex, ex_lse = exact_attention(qb, kb, vb, is_causal=causal, attn_mask=m4, return_lse=True)
    mex = compare(ob, ex)
    res.update(exact_cos=mex["cos"], exact_l1=mex["rel_l1"],
               exact_lse_maxdiff=float((lse[fin] - ex_lse[fin]).abs().max()) if fin.any() else 0.0)
    record(res)
    assert res["sim_l1"] <= SIM_L1 and res["lse_maxdiff"] <= SIM_LSE_ATOL, res
    assert res["exact_cos"] >= 0.9995 and res["exact_l1"] <= 0.03 and res["exact_lse_maxdiff"] <= 0.05, res
    return out, lse


CASES = [
    # b, hq, hkv, sq, skv, d, dv, dtype, layout, causal
    (1, 2, 2, 77, 77, 1, 1, torch.float16, "bhsd", False),
    (2, 4, 2, 333, 700, 48, 48, torch.bfloat16, "bshd", True),     # GQA, Sq != Skv, causal bottom-right
    (2, 4, 4, 1000, 1000, 80, 80, torch.float16, "bhsd", False),
    (1, 8, 2, 513, 1031, 96, 96, torch.float16, "bshd", True),
    (1, 4, 1, 300, 200, 112, 112, torch.bfloat16, "bhsd", True),   # MQA, Sq > Skv: empty rows
    (1, 4, 4, 4097, 4097, 96, 96, torch.bfloat16, "bhsd", True),
    (2, 4, 2, 555, 1234, 96, 64, torch.float16, "bhsd", False),    # Dv != D
    (1, 4, 4, 700, 900, 128, 80, torch.bfloat16, "bshd", True),
    (2, 4, 2, 513, 1031, 160, 160, torch.float16, "bhsd", True),  # 129..255 pad to 256
    (1, 4, 4, 1000, 1000, 192, 192, torch.bfloat16, "bshd", False),
    (1, 4, 2, 600, 700, 192, 128, torch.float16, "bhsd", True),    # MLA-style Dv != D
]


@pytest.mark.parametrize("b,hq,hkv,sq,skv,d,dv,dtype,layout,causal", CASES)
def test_padded_head_dims(b, hq, hkv, sq, skv, d, dv, dtype, layout, causal):
    check_padded_case(b, hq, hkv, sq, skv, d, dv, dtype=dtype, layout=layout, causal=causal, seed=sq + d,
                      name=f"padded b{b} h{hq}/{hkv} sq{sq} skv{skv} d{d}/{dv} {str(dtype)[6:]} {layout} "
                           f"causal={causal}")


@pytest.mark.parametrize("d, dv", [(80, 80), (96, 64), (48, 48), (192, 192)])
def test_padded_key_padding_and_window(d, dv):
    g = torch.Generator(device=DEV).manual_seed(d)
    mask = torch.rand(2, 900, generator=g, device=DEV) < 0.7
    mask[1] = False  # a fully masked batch entry: every row empty (0, LSE -inf)
    check_padded_case(2, 4, 2, 600, 900, d, dv, causal=True, mask=mask, seed=d, name=f"padded d{d}/{dv} key padding")
    check_padded_case(1, 4, 2, 1500, 1500, d, dv, causal=True, window_left=300, seed=d + 1,
                      name=f"padded d{d}/{dv} window 300")


def test_public_api_runs_the_kernel_and_reports_the_padding():
    from sage_patch.report import GLOBAL_STATS

    GLOBAL_STATS.reset()
    q, k, v = make_qkv(1, 4, 4, 600, 600, 96, torch.float16, seed=4)
    out = sage_patch.attention(q, k, v, precision="8b", is_causal=True)
    ref, _ = K.attention(q, k, v, is_causal=True)
    assert torch.equal(out, ref)
    st = GLOBAL_STATS.to_dict()
    assert all(i.startswith("cuda-") for i in st["impl"]), st
    assert any("head dim 96 zero-padded to 128" in r for r in st["fallbacks"]), st
    drop_in = sage_patch.sdpa(q, k, v, is_causal=True, precision="8b")  # square: torch's causal rule is the same
    assert torch.equal(drop_in, ref)


def test_padded_cuda_graph_and_compile():
    q, k, v = make_qkv(2, 4, 2, 500, 500, 80, torch.float16, seed=6)
    # the padded copies are captured with the kernel
    check_graph_replay(lambda: K.attention(q, k, v, is_causal=True), (q, k, v),
                       make_qkv(2, 4, 2, 500, 500, 80, torch.float16, seed=7))

    def f(q, k, v):
        return sage_patch.attention(q, k, v, precision="8b", is_causal=True) * 2.0

    with torch.no_grad():
        torch.testing.assert_close(torch.compile(f, fullgraph=True)(q, k, v), f(q, k, v), atol=0, rtol=0)

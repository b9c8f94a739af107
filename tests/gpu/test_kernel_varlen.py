"""Compiled packed variable-length attention (cu_seqlens) on a CUDA GPU (`pytest -m gpu tests/gpu`).

The kernel path (one launch) is compared with the per-sequence loop (sage_patch.varlen._reference_loop, i.e. the
compiled kernel called once per sequence) and with the reference simulation per sequence (same config): rel L1 <= 1e-3
per sequence; LSE (Hq, total_q) against the simulation. Outputs poisoned, inputs checked unchanged, empty sequences
(no query, no key, causal rows before the first key), odd lengths, GQA, causal Sq != Skv, fp16/bf16, 8b/4b.
"""
from __future__ import annotations

import os

import pytest
import torch

import sage_patch
import sage_patch.kernels as K
from sage_patch.accuracy import compare
from sage_patch.reference import exact_attention, simulate
from sage_patch.varlen import _reference_loop
from gpu_helpers import routed_precision

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or not K.status()["loaded"]:  # pragma: no cover - CPU machines
    pytest.skip(f"compiled kernels not usable here: {K.status()['reason']}", allow_module_level=True)

DEV = "cuda"
SIM_L1 = float(os.environ.get("SAGE_TEST_SIM_L1", "1e-3"))
LSE_ATOL = {"8b": 5e-3, "4b": 3e-2}


def packed(lens_q, lens_k, hq, hkv, d, dtype, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    tq, tk = sum(lens_q), sum(lens_k)
    q = (torch.randn(tq, hq, d, generator=g, device=DEV) + torch.randn(d, generator=g, device=DEV)).to(dtype)
    k = (torch.randn(tk, hkv, d, generator=g, device=DEV) + 4 * torch.randn(d, generator=g, device=DEV)).to(dtype)
    v = (torch.randn(tk, hkv, d, generator=g, device=DEV) + 4 * torch.randn(d, generator=g, device=DEV)).to(dtype)

    def cu(lens):
        return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)

    return q, k, v, cu(lens_q), cu(lens_k)


CASES = [
    # lens_q, lens_k, hq, hkv, d, dtype, causal, precision
    ([77, 1, 300, 129], [77, 5, 200, 1000], 4, 2, 128, torch.float16, True, "8b"),
    ([77, 1, 300, 129], [77, 5, 200, 1000], 4, 2, 128, torch.float16, False, "4b"),
    ([0, 50, 33, 0, 257], [10, 0, 700, 0, 257], 8, 1, 64, torch.bfloat16, True, "8b"),    # empty sequences
    ([513, 64, 2], [1031, 64, 3000], 2, 2, 64, torch.float16, True, "4b"),
    ([1000, 999], [1000, 999], 4, 4, 128, torch.bfloat16, False, "4b"),
    ([5, 2049], [4097, 2049], 2, 1, 128, torch.bfloat16, True, "8b"),
]


@pytest.mark.parametrize("lens_q,lens_k,hq,hkv,d,dtype,causal,precision", CASES)
def test_varlen_matches_loop_and_simulation(lens_q, lens_k, hq, hkv, d, dtype, causal, precision):
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k, hq, hkv, d, dtype, seed=sum(lens_q) + d)
    keep = [x.clone() for x in (q, k, v, cu_q, cu_k)]
    impl, why = K.can_run_varlen(precision, q, k, v, cu_q, cu_k)
    assert impl is not None, why
    t = torch.full(q.shape, float("nan"), device=DEV, dtype=dtype)
    del t
    out, lse = sage_patch.varlen_attention(q, k, v, cu_q, cu_k, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k),
                                           is_causal=causal, precision=precision, return_lse=True)
    torch.cuda.synchronize()
    for a, b in zip((q, k, v, cu_q, cu_k), keep):
        assert torch.equal(a, b), "an input was modified"
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (hq, q.shape[0])
    assert torch.isfinite(out).all(), "NaN/inf in the output"
    loop, loop_lse = _reference_loop(q, k, v, cu_q, cu_k, is_causal=causal, scale=None, precision=precision,
                                     return_lse=True)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    precision = routed_precision(q, precision)  # what ran
    cfg = K.reference_config(K.variant_for(q, None, precision), d)
    worst = {"loop_l1": 0.0, "sim_l1": 0.0, "lse": 0.0, "exact_cos": 1.0}
    for b in range(len(lens_q)):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if q1 == q0:
            continue
        ob = out[q0:q1]
        if k1 == k0:
            assert (ob == 0).all() and torch.isneginf(lse[:, q0:q1]).all()
            continue
        worst["loop_l1"] = max(worst["loop_l1"], compare(ob, loop[q0:q1])["rel_l1"])
        qs, ks, vs = (x[None].transpose(1, 2) for x in (q[q0:q1], k[k0:k1], v[k0:k1]))
        sim, sim_lse = simulate(qs, ks, vs, precision, is_causal=causal, return_lse=True, config=cfg)
        worst["sim_l1"] = max(worst["sim_l1"], compare(ob, sim[0].transpose(0, 1).to(dtype))["rel_l1"])
        fin = torch.isfinite(sim_lse[0])
        assert torch.equal(torch.isfinite(lse[:, q0:q1]), fin)
        if fin.any():
            worst["lse"] = max(worst["lse"], float((lse[:, q0:q1][fin] - sim_lse[0][fin]).abs().max()))
        ex = exact_attention(qs, ks, vs, is_causal=causal)
        worst["exact_cos"] = min(worst["exact_cos"], compare(ob, ex[0].transpose(0, 1))["cos"])
    print({"case": f"varlen {precision} {lens_q}/{lens_k} h{hq}/{hkv} d{d} {dtype} causal={causal}", **worst})
    assert worst["loop_l1"] <= SIM_L1 and worst["sim_l1"] <= SIM_L1, worst
    assert worst["lse"] <= LSE_ATOL[precision], worst
    assert worst["exact_cos"] >= (0.995 if precision == "4b" else 0.9995), worst


def test_varlen_smooth_v_and_fp16_pv_direct():
    q, k, v, cu_q, cu_k = packed([100, 37], [130, 300], 4, 2, 64, torch.float16, seed=5)
    for pv in ("fp16", "fp8"):
        out, _ = K.attention_varlen(q, k, v, cu_q, cu_k, 100, 300, is_causal=True, smooth_v=True, pv=pv)
        torch.cuda.synchronize()
        for q0, q1, k0, k1 in ((0, 100, 0, 130), (100, 137, 130, 430)):
            ref, _ = K.attention(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], layout="bshd", is_causal=True,
                                 smooth_v=True, pv=pv)
            assert compare(out[q0:q1], ref[0])["rel_l1"] <= SIM_L1


def test_varlen_cuda_graph():
    q, k, v, cu_q, cu_k = packed([300, 17], [310, 40], 4, 4, 128, torch.float16, seed=6)
    eager, _ = K.attention_varlen(q, k, v, cu_q, cu_k, 300, 310, is_causal=True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        K.attention_varlen(q, k, v, cu_q, cu_k, 300, 310, is_causal=True)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, _ = K.attention_varlen(q, k, v, cu_q, cu_k, 300, 310, is_causal=True)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_varlen_4b_int4_mma_equals_int8_mma():
    q, k, v, cu_q, cu_k = packed([130, 0, 77], [200, 9, 64], 4, 2, 128, torch.float16, seed=8)
    a, la = K.attention_varlen(q, k, v, cu_q, cu_k, 130, 200, is_causal=True, precision="4b", qk="int8")
    b, lb = K.attention_varlen(q, k, v, cu_q, cu_k, 130, 200, is_causal=True, precision="4b", qk="int4")
    torch.cuda.synchronize()
    assert torch.equal(a, b) and torch.equal(la, lb)

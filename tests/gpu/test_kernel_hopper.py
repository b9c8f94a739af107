"""The sm_90a Hopper kernel (pv mode "wgmma", IMPL_WGMMA): wgmma operand layouts, the FP8 accumulator width, and
cases that only this kernel has (persistent tiles, 128-key blocks, its own quantization groups). Every general
"8b" case of test_kernel_8b.py / test_kernel_varlen.py / test_kernel_4b_smoothv.py (smooth V) also runs this
kernel on an H100/H200, since it is the default there. Run with `pytest -m gpu tests/gpu`."""
from __future__ import annotations

import ctypes

import pytest
import torch

import sage_patch.kernels as K
from sage_patch.accuracy import compare
from sage_patch.kernels import _lib
from gpu_helpers import DEV, make_qkv, poison, record, to_bhsd
from sage_patch.reference import exact_attention, simulate

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or not K.status()["loaded"]:  # pragma: no cover - CPU machines
    pytest.skip(f"compiled kernels not usable here: {K.status()['reason']}", allow_module_level=True)
if torch.cuda.get_device_capability() != (9, 0) or "90a" not in K.status()["archs"]:  # pragma: no cover
    pytest.skip("the Hopper kernel needs sm_90 and an sm_90a build", allow_module_level=True)



def probe(a: torch.Tensor, b: torch.Tensor, mode: int) -> torch.Tensor:
    """D = A . B^T through chained wgmma m64n16k32 (mode 0: e4m3, A in registers; 1: s8, A in shared memory)."""
    steps = a.shape[1] // 32
    a8, b8 = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    d = torch.full((64, 16), float("nan"), device=DEV)
    rc = _lib.get().handle.sage_hopper_probe(ctypes.c_void_p(a8.data_ptr()), ctypes.c_void_p(b8.data_ptr()),
                                             ctypes.c_void_p(d.data_ptr()), steps, mode,
                                             ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
    assert rc == 0
    torch.cuda.synchronize()
    return d


def test_wgmma_int8_layout_exact():
    g = torch.Generator(device=DEV).manual_seed(0)
    a = torch.randint(-127, 128, (64, 128), generator=g, device=DEV, dtype=torch.int32)
    b = torch.randint(-127, 128, (16, 128), generator=g, device=DEV, dtype=torch.int32)
    d = probe(a.to(torch.int8), b.to(torch.int8), 1)
    assert torch.equal(d, (a.double() @ b.double().T).float())


def test_wgmma_fp8_layout_exact():
    """Values whose products and sums are exact in fp32: any mismatch is a layout error."""
    g = torch.Generator(device=DEV).manual_seed(1)
    vals = torch.tensor([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0, 4.0], device=DEV)
    a = vals[torch.randint(0, 8, (64, 96), generator=g, device=DEV)]
    b = vals[torch.randint(0, 8, (16, 96), generator=g, device=DEV)]
    d = probe(a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn), 0)
    assert torch.equal(d, (a.double() @ b.double().T).float())


def test_fp8_wgmma_accumulator_width():
    """Measure how many bits below the leading term survive in the FP8 wgmma accumulator: D = 1 + 2^-e with
    e = 0..18 (a) inside one k32 instruction and (b) added by a second chained instruction (scale-d = 1).
    Recorded for docs/kernels.md. The kernel's two-level accumulation (a fresh accumulator per 128-key block,
    added into fp32 registers) relies on >= 10 bits inside a block (P~ <= 448 per term, errors ~2^-10 relative)."""
    rows = torch.arange(64, device=DEV)
    ea = (rows % 10).double()                       # A small term 2^-ea (e4m3 down to 2^-9)
    cols = torch.arange(16, device=DEV)
    eb = (cols % 10).double()
    results = {}
    for name, steps in (("within_instruction", 1), ("across_instructions", 2)):
        a = torch.zeros(64, 32 * steps, device=DEV, dtype=torch.float64)
        b = torch.zeros(16, 32 * steps, device=DEV, dtype=torch.float64)
        a[:, 0] = 1.0
        b[:, 0] = 1.0
        k_small = 1 if steps == 1 else 32  # second instruction for (b)
        a[:, k_small] = 2.0 ** -ea
        b[:, k_small] = 2.0 ** -eb
        d = probe(a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn), 0)
        small = (2.0 ** -(ea[:, None] + eb[None, :]))
        got = d.double() - 1.0
        e = (ea[:, None] + eb[None, :])
        kept = {}
        for ev in range(0, 19):
            sel = e == ev
            if sel.any():
                kept[ev] = "exact" if bool((got[sel] == small[sel]).all()) else (
                    "lost" if bool((got[sel] == 0).all()) else "rounded")
        width = max([ev for ev, s in kept.items() if s == "exact"], default=None)
        results[name] = {"bits_below_leading_exact": width, "by_exponent": kept}
    record({"fp8_wgmma_accumulator": results})
    assert results["within_instruction"]["bits_below_leading_exact"] is not None
    assert results["within_instruction"]["bits_below_leading_exact"] >= 10


@pytest.mark.parametrize("b,hq,hkv,n,d,causal", [
    (4, 32, 8, 2048, 128, True),     # 2048 tiles over 132 CTAs: persistent loop, GQA, causal heavy-first order
    (2, 24, 24, 4608, 64, False),
    (1, 3, 1, 1, 128, False),
])
def test_hopper_many_tiles_matches_simulation(b, hq, hkv, n, d, causal):
    q, k, v = make_qkv(b, hq, hkv, n, n, d, seed=n + d)
    out, lse = K.attention(q, k, v, is_causal=causal, pv="wgmma")
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    grp = hq // hkv
    q2, k2, v2 = q[:, :2], k.repeat_interleave(grp, 1)[:, :2], v.repeat_interleave(grp, 1)[:, :2]  # 2 heads
    sim, sim_lse = simulate(q2, k2, v2, "8b", is_causal=causal, return_lse=True,
                            config=K.reference_config(K.IMPL_WGMMA, d))
    m = compare(out[:, :2], sim.half())
    mex = compare(out[:, :2], exact_attention(q2, k2, v2, is_causal=causal))
    res = {"case": f"hopper b{b} h{hq}/{hkv} n{n} d{d} causal={causal}", "sim_l1": m["rel_l1"],
           "exact_cos": mex["cos"], "exact_l1": mex["rel_l1"],
           "lse_maxdiff": float((lse[:, :2] - sim_lse).abs().max())}
    record(res)
    assert m["rel_l1"] <= 1e-3, res
    assert mex["cos"] >= 0.9995 and mex["rel_l1"] <= 0.03, res


def _set_split_max(parts: int) -> int:
    """The library's most key parts per tail tile (1: no split); returns the previous value."""
    h = _lib.get().handle
    h.sage_hop_set_split_max.restype = ctypes.c_int
    h.sage_hop_set_split_max.argtypes = [ctypes.c_int]
    return h.sage_hop_set_split_max(parts)


def _expected_parts(b, hq, n, d):
    """hop_plan (non-causal, no LSE): the ntiles mod nsm tail tiles split into min(4, nsm // rem, nkb // 4) parts."""
    nwg = 4 if d == 64 else 3
    ntiles = b * hq * -(-n // (64 * nwg))
    nsm = torch.cuda.get_device_properties(DEV).multi_processor_count
    rem = ntiles % nsm
    parts = min(4, nsm // rem, -(-n // 128) // 4) if rem else 1
    return parts if parts >= 2 else 1


@pytest.mark.parametrize("b,hq,hkv,n,d,dtype,layout,masked", [
    (1, 24, 24, 4608, 128, torch.float16, "bhsd", False),  # Flux: 576 tiles = 4 x 132 + 48, 2 parts each
    (1, 24, 24, 4429, 64, torch.bfloat16, "bshd", False),  # SD3.5-like, 4 consumers: 432 = 3 x 132 + 36, 3 parts
    (2, 4, 2, 1500, 128, torch.float16, "bhsd", True),     # 64 tiles, GQA, key padding: 2 parts, a partial q-tile
])
def test_hopper_split_tail(b, hq, hkv, n, d, dtype, layout, masked):
    """Tail tiles split along the keys (each part on its own CTA, the last to finish combines): as accurate as the
    unsplit kernel against float64, close to it and to the simulation, deterministic, inputs untouched, every
    output row written (NaN-poisoned memory), and the split really ran (some outputs differ from the unsplit ones:
    a part starts its running max afresh, so its P~ round differently)."""
    assert _expected_parts(b, hq, n, d) >= 2
    q, k, v = make_qkv(b, hq, hkv, n, n, d, dtype=dtype, layout=layout, seed=n + d)
    mask = None
    if masked:
        mask = torch.ones(b, n, dtype=torch.bool, device=DEV)
        mask[0, 1100:] = False  # batch 0: the last 400 keys are padding (whole and partial blocks)
        mask[1, ::7] = False
    keep = [x.clone() for x in (q, k, v)]
    prev = _set_split_max(1)
    try:
        whole, _ = K.attention(q, k, v, layout=layout, attn_mask=mask, pv="wgmma", return_lse=False)
        _set_split_max(4)
        poison(q.shape, dtype)
        split, _ = K.attention(q, k, v, layout=layout, attn_mask=mask, pv="wgmma", return_lse=False)
        split2, _ = K.attention(q, k, v, layout=layout, attn_mask=mask, pv="wgmma", return_lse=False)
    finally:
        _set_split_max(prev)
    torch.cuda.synchronize()
    assert all(torch.equal(a, x) for a, x in zip(keep, (q, k, v)))
    assert torch.isfinite(split).all()
    assert torch.equal(split, split2)
    assert not torch.equal(split, whole)
    qb, kb, vb = (to_bhsd(x, layout) for x in (q, k, v))
    sb, wb = to_bhsd(split, layout), to_bhsd(whole, layout)
    ex = exact_attention(qb, kb, vb, attn_mask=None if mask is None else mask[:, None, None, :].expand(b, 1, n, n))
    ms, mw, mm = compare(sb, ex), compare(wb, ex), compare(sb, wb)
    res = {"case": f"split b{b} h{hq}/{hkv} n{n} d{d} {dtype} {layout} mask={masked}",
           "parts": _expected_parts(b, hq, n, d), "split_exact_cos": ms["cos"], "split_exact_l1": ms["rel_l1"],
           "whole_exact_l1": mw["rel_l1"], "split_vs_whole_l1": mm["rel_l1"]}
    record(res)
    assert ms["cos"] >= 0.9995 and ms["rel_l1"] <= 0.03, res
    assert ms["rel_l1"] <= mw["rel_l1"] * 1.05 + 1e-5, res  # no less accurate than the unsplit kernel
    assert mm["rel_l1"] <= 1e-3, res


def test_hopper_deterministic_and_close_to_portable():
    q, k, v = make_qkv(2, 8, 8, 3000, 3000, 128, seed=4)
    a, la = K.attention(q, k, v, pv="wgmma")
    a2, la2 = K.attention(q, k, v, pv="wgmma")
    p, lp = K.attention(q, k, v, pv="fp8-f16")
    assert torch.equal(a, a2) and torch.equal(la, la2)
    m = compare(a, p)
    record({"case": "hopper vs portable", **m})
    assert m["cos"] >= 0.9999


def test_hopper_rejects_4b():
    q, k, v = make_qkv(1, 2, 2, 64, 64, 64)
    with pytest.raises(RuntimeError):
        K.attention(q, k, v, pv="wgmma", precision="4b")
    impl, _ = K.can_run("4b", q, k, v, layout="bhsd", is_causal=False, attn_mask=None, return_lse=False,
                        smooth_v=False)
    assert impl == K.IMPL_FP8PV  # "4b" stays on the portable kernel on Hopper


def test_speed_routing_short_calls_run_sdpa(monkeypatch):
    """With speed routing on (the default), a short call runs torch SDPA (exactly its output) and is reported with
    the reason; a long one, or one with a key-padding mask, runs the Hopper kernel."""
    import sage_patch
    from sage_patch.report import GLOBAL_STATS

    monkeypatch.setattr(K, "SPEED_ROUTING", True)
    GLOBAL_STATS.reset()
    q, k, v = make_qkv(1, 4, 4, 1024, 1024, 128, torch.float16)
    out = sage_patch.attention(q, k, v, precision="8b")
    assert torch.equal(out, torch.nn.functional.scaled_dot_product_attention(q, k, v))
    reasons = " ".join(GLOBAL_STATS.fallbacks)
    assert "SDPA is faster" in reasons and "2048" in reasons
    q, k, v = make_qkv(1, 4, 4, 4096, 4096, 128, torch.float16)
    out = sage_patch.attention(q, k, v, precision="8b")
    ref, _ = K.attention(q, k, v, return_lse=False)  # (without LSE the kernel may split tail tiles: other last bits)
    assert torch.equal(out, ref)
    q, k, v = make_qkv(1, 4, 4, 1024, 1024, 128, torch.float16)
    keep = torch.ones(1, 1024, dtype=torch.bool, device=DEV)
    keep[:, 1000:] = False
    out = sage_patch.attention(q, k, v, precision="8b", attn_mask=keep)
    ref, _ = K.attention(q, k, v, attn_mask=keep, return_lse=False)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("d,dtype,smooth_v,value", [
    (128, torch.float16, False, 300.0),
    (64, torch.bfloat16, True, 3.0e5),
    (128, torch.bfloat16, False, 1.0e20),   # vfac = 2^61, near its 2^64 bound
])
def test_hopper_v_outlier_outside_the_sample(d, dtype, smooth_v, value):
    """V's base scale comes from 128 sampled tokens; a key the sample misses (77 of 1000) with a huge V row that
    every query attends to must not saturate: its block gets a power-of-two factor (the K/V pass's rare path).
    Kernel = simulation of the same numerics, and close to float64."""
    q, k, v = make_qkv(1, 4, 4, 1000, 1000, d, dtype=dtype, seed=21)
    k, v = k.clone(), v.clone()
    k[:, :, 77] = (4.0 * q.float().mean(dim=2)).to(dtype)
    v[:, :, 77] = value
    out, lse = K.attention(q, k, v, pv="wgmma", smooth_v=smooth_v)
    sim, sim_lse = simulate(q, k, v, "8b", return_lse=True, smooth_v=smooth_v,
                            config=K.reference_config(K.IMPL_WGMMA, d))
    m = compare(out, sim.to(dtype))
    mex = compare(out, exact_attention(q, k, v))
    res = {"case": f"hopper V outlier d{d} {dtype} smooth_v={smooth_v} value={value:g}", "sim_l1": m["rel_l1"],
           "exact_cos": mex["cos"], "exact_l1": mex["rel_l1"], "lse_maxdiff": float((lse - sim_lse).abs().max())}
    record(res)
    assert torch.isfinite(out).all(), res
    assert res["lse_maxdiff"] <= 0.02, res
    assert m["rel_l1"] <= 2e-3, res
    assert mex["cos"] >= 0.999, res

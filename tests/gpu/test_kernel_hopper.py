"""The sm_90a Hopper kernel (variant "wgmma-fp8", IMPL_WGMMA): wgmma operand layouts, the two-level accumulation, and
cases that only this kernel has (persistent tiles, 128-key blocks, its own quantization groups). Every general
"8b" case of test_kernel_8b.py / test_kernel_varlen.py / test_kernel_4b_smoothv.py (smooth V) also runs this
kernel on an H100/H200, since it is the default there. Run with `pytest -m gpu tests/gpu`."""
from __future__ import annotations

import pytest
import torch

import sage_patch.kernels as K
from sage_patch.accuracy import compare
from gpu_helpers import DEV, make_qkv, poison, record, to_bhsd
from sage_patch.reference import exact_attention, simulate

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or not K.status()["loaded"]:  # pragma: no cover - CPU machines
    pytest.skip(f"compiled kernels not usable here: {K.status()['reason']}", allow_module_level=True)
if torch.cuda.get_device_capability() != (9, 0) or "90a" not in K.status()["archs"]:  # pragma: no cover
    pytest.skip("the Hopper kernel needs sm_90 and an sm_90a build", allow_module_level=True)



@pytest.mark.parametrize("d,dtype", [(128, torch.float16), (64, torch.bfloat16), (256, torch.float16),
                                     (256, torch.bfloat16)])
def test_wgmma_operand_layouts_end_to_end(d, dtype):
    """The wgmma operand layouts through the public kernel (the diagnostics probe kernel left the library): every
    query row attends to exactly one key (q_i = k_perm(i), random sign vectors: its score leads the others by > 40
    logits), so the output row is V's row perm(i); any mix-up of the Q/K image rows, the V^T key slots or the
    channel order lands a row on the wrong key or a channel in the wrong place."""
    n = 3 * 128 + 17  # several 128-key blocks and a partial one
    g = torch.Generator(device=DEV).manual_seed(d)
    perm = torch.randperm(n, generator=g, device=DEV)
    k = (torch.randint(0, 2, (1, 2, n, d), generator=g, device=DEV) * 2 - 1).to(dtype)
    q = k[:, :, perm]
    v = torch.randn(1, 2, n, d, generator=g, device=DEV).to(dtype)
    out, _ = K.attention(q, k, v, pv="wgmma", scale=1.0)
    want = v[:, :, perm].float()
    nearest = torch.cdist(out.float()[0], v.float()[0]).argmin(-1)  # per head: the V row each output row is
    assert torch.equal(nearest, perm.expand(2, n))
    m = compare(out.float(), want)
    record({"case": f"wgmma layouts d{d} {dtype}", **m})
    assert m["rel_l1"] <= 0.05, m  # V in FP8 E4M3 (3 mantissa bits) with per-block power-of-two factors


def test_two_level_accumulation_long_rows():
    """The FP8 wgmma accumulator keeps ~13 mantissa bits (measured with the former probe kernel, docs/design/
    tried_and_rejected.md), so each 128-key block's P~V goes into a fresh accumulator added into fp32 registers:
    on 16K-key rows of nearly uniform weights the kernel stays at the simulation of exactly that scheme."""
    q, k, v = make_qkv(1, 2, 2, 256, 16384, 128, seed=21)
    q = q * 0.05  # nearly uniform attention: every block contributes
    out, _ = K.attention(q, k, v, pv="wgmma")
    sim = simulate(q, k, v, "8b", config=K.reference_config(K.registry.get("wgmma-fp8"), 128))
    m = compare(out, sim.half())
    record({"case": "wgmma two-level accumulation 16K keys", **m})
    assert m["rel_l1"] <= 1e-3, m


@pytest.mark.parametrize("b,hq,hkv,n,d,causal", [
    (4, 32, 8, 2048, 128, True),     # 2048 tiles over 132 CTAs: persistent loop, GQA, causal heavy-first order
    (2, 24, 24, 4608, 64, False),
    (1, 3, 1, 1, 128, False),
    (4, 16, 8, 2048, 256, True),     # head dim 256: 2 consumers, 2 stages, P~V in quarters
    (2, 18, 18, 4097, 256, False),
    (1, 3, 1, 1, 256, False),
])
def test_hopper_many_tiles_matches_simulation(b, hq, hkv, n, d, causal):
    q, k, v = make_qkv(b, hq, hkv, n, n, d, seed=n + d)
    out, lse = K.attention(q, k, v, is_causal=causal, pv="wgmma")
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    grp = hq // hkv
    q2, k2, v2 = q[:, :2], k.repeat_interleave(grp, 1)[:, :2], v.repeat_interleave(grp, 1)[:, :2]  # 2 heads
    sim, sim_lse = simulate(q2, k2, v2, "8b", is_causal=causal, return_lse=True,
                            config=K.reference_config(K.registry.get("wgmma-fp8"), d))
    m = compare(out[:, :2], sim.half())
    mex = compare(out[:, :2], exact_attention(q2, k2, v2, is_causal=causal))
    res = {"case": f"hopper b{b} h{hq}/{hkv} n{n} d{d} causal={causal}", "sim_l1": m["rel_l1"],
           "exact_cos": mex["cos"], "exact_l1": mex["rel_l1"],
           "lse_maxdiff": float((lse[:, :2] - sim_lse).abs().max())}
    record(res)
    assert m["rel_l1"] <= 1e-3, res
    assert mex["cos"] >= 0.9995 and mex["rel_l1"] <= 0.03, res


def _expected_parts(b, hq, n, d):
    """hopper::plan (non-causal, no LSE): the ntiles mod nsm tail tiles split into min(4, nsm // rem, nkb // 4) parts."""
    nwg = 4 if d == 64 else 3 if d == 128 else 2
    ntiles = b * hq * -(-n // (64 * nwg))
    nsm = torch.cuda.get_device_properties(DEV).multi_processor_count
    rem = ntiles % nsm
    parts = min(4, nsm // rem, -(-n // 128) // 4) if rem else 1
    return parts if parts >= 2 else 1


@pytest.mark.parametrize("b,hq,hkv,n,d,dtype,layout,masked", [
    (1, 24, 24, 4608, 128, torch.float16, "bhsd", False),  # Flux: 576 tiles = 4 x 132 + 48, 2 parts each
    (1, 24, 24, 4429, 64, torch.bfloat16, "bshd", False),  # SD3.5-like, 4 consumers: 432 = 3 x 132 + 36, 3 parts
    (2, 4, 2, 1500, 128, torch.float16, "bhsd", True),     # 64 tiles, GQA, key padding: 2 parts, a partial q-tile
    (1, 18, 18, 4096, 256, torch.bfloat16, "bshd", False),  # Ideogram-like: 576 tiles = 4 x 132 + 48, 2 parts
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
    # the launch field SageAttnParams.hop_split_max: 1 = no split, 4 = the default limit
    whole, _ = K.attention(q, k, v, layout=layout, attn_mask=mask, pv="wgmma", return_lse=False, hop_split_max=1)
    poison(q.shape, dtype)
    split, _ = K.attention(q, k, v, layout=layout, attn_mask=mask, pv="wgmma", return_lse=False, hop_split_max=4)
    split2, _ = K.attention(q, k, v, layout=layout, attn_mask=mask, pv="wgmma", return_lse=False)  # default: 4
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
    assert impl.name == K.IMPL_FP8PV and impl.pv == "fp8-f16"  # "4b" stays on the portable kernel on Hopper


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
    (256, torch.float16, True, 3.0e4),
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
                            config=K.reference_config(K.registry.get("wgmma-fp8"), d))
    m = compare(out, sim.to(dtype))
    mex = compare(out, exact_attention(q, k, v))
    res = {"case": f"hopper V outlier d{d} {dtype} smooth_v={smooth_v} value={value:g}", "sim_l1": m["rel_l1"],
           "exact_cos": mex["cos"], "exact_l1": mex["rel_l1"], "lse_maxdiff": float((lse - sim_lse).abs().max())}
    record(res)
    assert torch.isfinite(out).all(), res
    assert res["lse_maxdiff"] <= 0.02, res
    assert m["rel_l1"] <= 2e-3, res
    assert mex["cos"] >= 0.999, res

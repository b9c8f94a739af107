"""Non-finite inputs on the compiled kernels (issue 28): a NaN, +Inf or -Inf in Q, K or V must reach the output,
never become finite garbage. Run with `pytest -m gpu tests/gpu` (skipped without CUDA or kernels).

Every kernel variant (the sm_90a Hopper "8b" kernel with LSE, split tail, causal, key padding, smooth V and varlen;
the portable mma.sync "8b" kernel in each P~V mode; the portable "4b" kernel with INT8 and INT4 MMA; the public
`sage_patch.attention` on CUDA) is forced (pv / qk / precision given; speed routing off, see conftest.py), run once
on clean inputs and then once per injected value, each a fresh copy of the clean inputs with one element set:
  - q[b, h, i, c] non-finite -> output row (b, h, i) non-finite (other rows of its quantization group may be too);
    its LSE too;
  - k[b, g, j, c] or v[b, g, j, c] -> every output row of batch b, query heads of KV head g, that sees key j (causal
    bottom-right, key padding) is non-finite (other rows of that (b, g) may be too); for k, their LSE too;
  - every other (batch, KV head) group: finite and bitwise equal to the clean run (output and LSE);
  - the inputs are unchanged (bitwise, the injected NaN / Inf included); the output memory is filled with a finite
    value before each call, so an unwritten row cannot pass as non-finite.
Keys are injected at a token the Hopper kernel's statistics sample reads (token 0), one it does not, and one near the
end (which early causal rows cannot see). The clean run is checked against float64 (the tolerances of gpu_helpers'
check_kernel_case: "8b" cos >= 0.9995, rel L1 <= 0.03, LSE within 0.05; "4b" cos >= 0.995), finite, empty rows 0.
All failures of a case are collected and reported together (one device run shows everything)."""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import pytest
import torch

import sage_patch.kernels as K
from sage_patch.accuracy import compare
from sage_patch.reference import exact_attention
from gpu_helpers import DEV, bits_equal, fill_next, make_qkv, poison, record, rows_nonfinite, set_at, to_bhsd

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or not K.status()["loaded"]:  # pragma: no cover - CPU machines
    pytest.skip(f"compiled kernels not usable here: {K.status()['reason']}", allow_module_level=True)

CC = torch.cuda.get_device_capability()
HOPPER = CC == (9, 0) and "90a" in K.status()["archs"]
FP8 = CC >= (8, 9)
VALUES = (float("nan"), float("inf"), float("-inf"))
SENTINEL = 1234.0  # finite fill of the output memory before a poisoned call
HOPPER_SAMPLE = K.HOPPER_STATS_SAMPLE


@dataclass(frozen=True)
class Case:
    name: str
    precision: str = "8b"
    pv: str | None = None     # "wgmma" (Hopper), "fp8-f16", "fp8-mma", "fp16" (portable)
    qk: str | None = None     # "4b": "int8" / "int4"
    b: int = 2
    hq: int = 4
    hkv: int = 2
    sq: int = 333
    skv: int = 333
    d: int = 128
    dtype: torch.dtype = torch.float16
    layout: str = "bhsd"
    causal: bool = False
    masked: bool = False
    smooth_v: bool = False
    lse: bool = True
    needs: str | None = None  # "hopper" / "fp8"


CASES = [
    # Hopper "8b" kernel (pv "wgmma"): LSE; no LSE = split tail (48 tiles of 132 / 114 SMs: 2 key parts each)
    Case("hopper-d128-fp16-lse", pv="wgmma", sq=1000, skv=1000, needs="hopper"),
    Case("hopper-d128-bf16-bshd-split", pv="wgmma", sq=1000, skv=1000, dtype=torch.bfloat16, layout="bshd",
         lse=False, needs="hopper"),
    Case("hopper-d64-bf16-causal", pv="wgmma", sq=700, skv=1000, d=64, dtype=torch.bfloat16, causal=True,
         needs="hopper"),
    Case("hopper-d128-fp16-kmask-split", pv="wgmma", sq=1000, skv=1000, masked=True, lse=False, needs="hopper"),
    Case("hopper-d64-fp16-smoothv-kmask", pv="wgmma", sq=333, skv=777, d=64, masked=True, smooth_v=True,
         needs="hopper"),
    Case("hopper-d128-bf16-causal-emptyrows", pv="wgmma", sq=600, skv=400, dtype=torch.bfloat16, causal=True,
         smooth_v=True, needs="hopper"),
    Case("hopper-d256-fp16-causal-kmask", pv="wgmma", sq=700, skv=1000, d=256, causal=True, masked=True,
         needs="hopper"),
    Case("hopper-d256-bf16-split", pv="wgmma", sq=1000, skv=1000, d=256, dtype=torch.bfloat16, lse=False,
         needs="hopper"),
    # portable mma.sync "8b"
    Case("portable8b-fp8f16-d128-causal", pv="fp8-f16", sq=300, skv=517, causal=True, needs="fp8"),
    Case("portable8b-fp8mma-d64-bf16-kmask-smoothv", pv="fp8-mma", d=64, dtype=torch.bfloat16, masked=True,
         smooth_v=True, needs="fp8"),
    Case("portable8b-fp8f16-d64-bshd-nolse", pv="fp8-f16", d=64, layout="bshd", lse=False, needs="fp8"),
    Case("portable8b-fp16-d128-bf16-causal-emptyrows-bshd", pv="fp16", sq=400, skv=300, dtype=torch.bfloat16,
         layout="bshd", causal=True),
    Case("portable8b-fp16-d64-kmask-smoothv", pv="fp16", d=64, masked=True, smooth_v=True),
    Case("portable8b-fp8f16-d256-causal-kmask", pv="fp8-f16", sq=300, skv=517, d=256, causal=True, masked=True,
         needs="fp8"),
    # portable "4b"
    Case("portable4b-int8-d128-causal", precision="4b", qk="int8", pv="fp8-f16", sq=300, skv=517, causal=True,
         needs="fp8"),
    Case("portable4b-int4-d64-bf16-kmask-smoothv-bshd", precision="4b", qk="int4", pv="fp8-f16", d=64,
         dtype=torch.bfloat16, layout="bshd", masked=True, smooth_v=True, needs="fp8"),
    Case("portable4b-int8-fp16pv-d64-bf16", precision="4b", qk="int8", pv="fp16", d=64, dtype=torch.bfloat16),
    Case("portable4b-int4-fp16pv-d128-causal-nolse", precision="4b", qk="int4", pv="fp16", causal=True, lse=False),
    Case("portable4b-int8-d256-bf16", precision="4b", qk="int8", pv="fp8-f16", d=256, dtype=torch.bfloat16,
         needs="fp8"),
]

API_CASES = [
    Case("api-8b-d128-causal", sq=2048, skv=2048, causal=True),
    Case("api-8b-d64-bf16-kmask", d=64, dtype=torch.bfloat16, sq=1000, skv=1000, masked=True),
    Case("api-4b-d128-bf16", precision="4b", dtype=torch.bfloat16, sq=700, skv=700),
    Case("api-4b-d64-causal-kmask", precision="4b", d=64, sq=500, skv=600, causal=True, masked=True),
]


def _skip_unsupported(c: Case):
    if c.needs == "hopper" and not HOPPER:
        pytest.skip("the Hopper kernel needs sm_90 and an sm_90a build")
    if c.needs == "fp8" and not FP8:
        pytest.skip("FP8 P~V needs sm_89+")
    if c.qk == "int4" and "4b-int4" in K.DISABLED:
        pytest.skip(K.DISABLED["4b-int4"])


def _sampled(skv):
    """Tokens the Hopper kernel's statistics read (hopper_sample_stats_kernel): floor(i skv / ns), ns = min(128, skv)."""
    ns = min(HOPPER_SAMPLE, skv)
    return {i * skv // ns for i in range(ns)}


def _inputs(c: Case, seed: int):
    q, k, v = make_qkv(c.b, c.hq, c.hkv, c.sq, c.skv, c.d, c.dtype, c.layout, seed,
                       q_bias=1.0 if c.precision == "4b" else None)
    mask = None
    if c.masked:
        g = torch.Generator(device=DEV).manual_seed(seed + 1)
        mask = torch.rand(c.b, c.skv, generator=g, device=DEV) > 0.25
        mask[0, c.skv // 2:] = False  # batch 0: the second half padding (whole and partial blocks)
    return q, k, v, mask


def _visible(c: Case, mask):
    """(B, Sq, Skv) bool: key j visible to query i (causal bottom-right, key padding)."""
    vis = torch.ones(c.b, c.sq, c.skv, dtype=torch.bool, device=DEV)
    if c.causal:
        i = torch.arange(c.sq, device=DEV)[:, None]
        j = torch.arange(c.skv, device=DEV)[None, :]
        vis &= (j <= i + (c.skv - c.sq))[None]
    if mask is not None:
        vis &= mask[:, None, :]
    return vis


def _injections(c: Case, mask):
    """[(tensor, value, (b, h, s, ch))]: each of NaN, +Inf, -Inf once per tensor, at three positions, in batch 1 and
    the last KV head (so batch 0 and the other KV heads of batch 1 are the untouched groups)."""
    b, g = 1, c.hkv - 1
    h = c.hq - 1  # a query head of KV head g
    first = max(c.sq - c.skv, 0)  # causal: rows before it see no key
    rows = [c.sq - 1, first + (c.sq - first) // 2, min(first + 3, c.sq - 1)]
    sampled = _sampled(c.skv)
    mid = next(j for j in range(c.skv // 3, c.skv) if j not in sampled)
    keys = [0, mid, c.skv - 5]  # sampled by the Hopper statistics, not sampled, late (early causal rows miss it)
    if mask is not None:
        mask[b, keys] = True
    chans = [0, c.d // 2 + 1, c.d - 1]
    out = []
    for n, val in enumerate(VALUES):
        out.append(("q", val, (b, h, rows[n], chans[n])))
        out.append(("k", val, (b, g, keys[n], chans[(n + 1) % 3])))
        out.append(("v", val, (b, g, keys[(n + 1) % 3], chans[(n + 2) % 3])))
    return out


def _group_heads(c: Case, g):
    rep = c.hq // c.hkv
    return list(range(g * rep, (g + 1) * rep))


def _check_clean(c: Case, q, k, v, mask, out, lse, fails):
    qb, kb, vb, ob = (to_bhsd(x, c.layout) for x in (q, k, v, out))
    vis = _visible(c, mask)
    empty = ~vis.any(-1)  # (B, Sq)
    m4 = mask[:, None, None, :] if mask is not None else None
    ex, ex_lse = exact_attention(qb, kb, vb, is_causal=c.causal, attn_mask=m4, return_lse=True)
    res = {"case": f"nonfinite clean {c.name}", **compare(ob, ex)}
    if not torch.isfinite(ob).all():
        fails.append("clean run: non-finite output")
    if empty.any() and not (ob.float()[empty[:, None, :].expand(c.b, c.hq, c.sq)] == 0).all():
        fails.append("clean run: empty rows are not 0")
    if lse is not None:
        fin = torch.isfinite(ex_lse)
        if not torch.equal(torch.isfinite(lse), fin):
            fails.append("clean run: LSE -inf pattern differs from float64")
        elif fin.any():
            res["lse_maxdiff"] = float((lse[fin] - ex_lse[fin]).abs().max())
    record(res)
    if c.precision == "4b":
        ok = res["cos"] >= 0.995
    else:
        ok = res["cos"] >= 0.9995 and res["rel_l1"] <= 0.03 and res.get("lse_maxdiff", 0.0) <= 0.05
    if not ok:
        fails.append(f"clean run vs float64 out of tolerance: {res}")


def _check_poisoned(c: Case, what, val, pos, mask, out, lse, out0, lse0, fails):
    """One injected value: required rows non-finite, every other (batch, KV head) group bitwise the clean run."""
    tag = f"{what}{list(pos)}={val}"
    b, hh, s, _ = pos
    g = hh if what != "q" else hh // (c.hq // c.hkv)
    ob, ob0 = to_bhsd(out, c.layout), to_bhsd(out0, c.layout)
    bad = rows_nonfinite(ob)  # (B, Hq, Sq)
    if what == "q":
        need = torch.zeros_like(bad)
        need[b, hh, s] = True
    else:
        need = torch.zeros_like(bad)
        seen = _visible(c, mask)[b, :, s]  # (Sq,) rows that see key s
        for h in _group_heads(c, g):
            need[b, h] = seen
    missing = need & ~bad
    if missing.any():
        idx = missing.nonzero()[:5].tolist()
        fails.append(f"{tag}: {int(missing.sum())} required rows finite, e.g. (b, h, i) {idx}")
    if lse is not None and what in ("q", "k"):
        lmiss = need & torch.isfinite(lse)
        if lmiss.any():
            fails.append(f"{tag}: {int(lmiss.sum())} required LSE rows finite, e.g. {lmiss.nonzero()[:5].tolist()}")
    for bb in range(c.b):
        for gg in range(c.hkv):
            if (bb, gg) == (b, g):
                continue
            hs = _group_heads(c, gg)
            o1, o0 = ob[bb, hs], ob0[bb, hs]
            if not torch.isfinite(o1).all():
                fails.append(f"{tag}: untouched group (b={bb}, kv={gg}) has non-finite output")
            elif not torch.equal(o1, o0):
                fails.append(f"{tag}: untouched group (b={bb}, kv={gg}) differs from the clean run")
            if lse is not None and not torch.equal(lse[bb, hs], lse0[bb, hs]):
                fails.append(f"{tag}: untouched group (b={bb}, kv={gg}) LSE differs from the clean run")
    return int(bad.sum())


def _run_injections(c: Case, call, seed, impl_check=None):
    q, k, v, mask = _inputs(c, seed)
    inj = _injections(c, mask)  # (sets the injected keys visible in the mask)
    keep = [x.clone() for x in (q, k, v)] + ([mask.clone()] if mask is not None else [])
    fails: list[str] = []
    poison(q.shape, c.dtype)
    out0, lse0 = call(q, k, v, mask)
    torch.cuda.synchronize()
    if impl_check:
        impl_check(fails)
    if not all(bits_equal(a, x) for a, x in zip((q, k, v) + ((mask,) if mask is not None else ()), keep)):
        fails.append("clean run: an input was modified")
    _check_clean(c, q, k, v, mask, out0, lse0, fails)
    nbad = {}
    for what, val, pos in inj:
        x = {"q": q, "k": k, "v": v}[what].clone()
        set_at(x, c.layout, *pos, val)
        xs = x.clone()
        args = {"q": q, "k": k, "v": v}
        args[what] = x
        fill_next(q.shape, c.dtype, SENTINEL)
        out, lse = call(args["q"], args["k"], args["v"], mask)
        torch.cuda.synchronize()
        if not bits_equal(x, xs) or not all(bits_equal(args[n], keep[i]) for i, n in enumerate("qkv") if n != what):
            fails.append(f"{what}{list(pos)}={val}: an input was modified")
        if mask is not None and not torch.equal(mask, keep[3]):
            fails.append(f"{what}{list(pos)}={val}: the mask was modified")
        nbad[f"{what}{pos}={val}"] = _check_poisoned(c, what, val, pos, mask, out, lse, out0, lse0, fails)
    record({"case": f"nonfinite {c.name}", "nonfinite_rows": nbad, "failures": len(fails)})
    assert not fails, f"{c.name}: {len(fails)} failures:\n  " + "\n  ".join(fails)


@pytest.mark.parametrize("c", CASES, ids=[c.name for c in CASES])
def test_kernel_nonfinite(c: Case):
    _skip_unsupported(c)

    def call(q, k, v, mask):
        return K.attention(q, k, v, layout=c.layout, is_causal=c.causal, attn_mask=mask, pv=c.pv,
                           precision=c.precision, smooth_v=c.smooth_v, qk=c.qk, return_lse=c.lse)

    def impl_check(fails):
        q = torch.empty(1, device=DEV)
        impl = K.variant_for(q, c.pv, c.precision).name
        want = K.IMPL_WGMMA if c.pv == "wgmma" else (K.IMPL_FP16PV if c.pv == "fp16" else K.IMPL_FP8PV)
        if impl != want:
            fails.append(f"ran {impl}, expected {want}")

    _run_injections(c, call, seed=zlib.crc32(c.name.encode()) % 1000, impl_check=impl_check)


@pytest.mark.parametrize("c", API_CASES, ids=[c.name for c in API_CASES])
def test_public_api_nonfinite(c: Case):
    """sage_patch.attention(..., precision=...) on CUDA: the resolver's kernel (checked in the stats) behaves the same."""
    import sage_patch
    from sage_patch.report import GLOBAL_STATS

    def call(q, k, v, mask):
        out, lse = sage_patch.attention(q, k, v, layout=c.layout, is_causal=c.causal, attn_mask=mask,
                                        precision=c.precision, return_lse=True, smooth_v=c.smooth_v)
        return out, lse

    GLOBAL_STATS.reset()

    def impl_check(fails):
        impls = dict(GLOBAL_STATS.impls)
        if not impls or any(not str(i).startswith("cuda-") for i in impls):
            fails.append(f"public API did not run a compiled kernel: {impls}, fallbacks {GLOBAL_STATS.fallbacks}")

    _run_injections(c, call, seed=7 + len(c.name), impl_check=impl_check)


VARLEN_CASES = [
    # lens_q, lens_k, hq, hkv, d, dtype, causal, precision, pv, needs
    ([300, 77, 1000], [500, 77, 1000], 4, 2, 128, torch.float16, True, "8b", "wgmma", "hopper"),
    ([300, 77, 1000], [500, 77, 1000], 4, 2, 64, torch.bfloat16, False, "8b", "wgmma", "hopper"),
    ([300, 77, 513], [500, 77, 600], 4, 2, 128, torch.bfloat16, True, "8b", "fp8-f16", "fp8"),
    ([300, 77, 513], [500, 77, 600], 4, 2, 64, torch.float16, True, "4b", "fp16", None),
]


@pytest.mark.parametrize("lens_q,lens_k,hq,hkv,d,dtype,causal,precision,pv,needs", VARLEN_CASES)
def test_varlen_nonfinite(lens_q, lens_k, hq, hkv, d, dtype, causal, precision, pv, needs):
    """Packed sequences: a non-finite value poisons only its own (sequence, KV head) group."""
    _skip_unsupported(Case("varlen", needs=needs))
    g = torch.Generator(device=DEV).manual_seed(sum(lens_q) + d)
    tq, tk = sum(lens_q), sum(lens_k)
    q = (torch.randn(tq, hq, d, generator=g, device=DEV) + torch.randn(d, generator=g, device=DEV)).to(dtype)
    k = (torch.randn(tk, hkv, d, generator=g, device=DEV) + 4 * torch.randn(d, generator=g, device=DEV)).to(dtype)
    v = (torch.randn(tk, hkv, d, generator=g, device=DEV) + 4 * torch.randn(d, generator=g, device=DEV)).to(dtype)
    cq = [0] + torch.tensor(lens_q).cumsum(0).tolist()
    ck = [0] + torch.tensor(lens_k).cumsum(0).tolist()
    cu_q, cu_k = (torch.tensor(x, dtype=torch.int32, device=DEV) for x in (cq, ck))
    rep = hq // hkv

    def call(q_, k_, v_):
        return K.attention_varlen(q_, k_, v_, cu_q, cu_k, max(lens_q), max(lens_k), is_causal=causal,
                                  precision=precision, pv=pv)

    keep = [x.clone() for x in (q, k, v)]
    poison((tq, hq, d), dtype)
    out0, lse0 = call(q, k, v)
    torch.cuda.synchronize()
    fails = []
    assert all(bits_equal(a, x) for a, x in zip((q, k, v), keep)), "an input was modified"
    assert torch.isfinite(out0).all(), "clean varlen run: non-finite output"
    for si in range(len(lens_q)):  # each sequence against float64
        if lens_q[si] == 0 or lens_k[si] == 0:
            continue
        qs = q[cq[si]:cq[si + 1]].transpose(0, 1)[None]
        ks = k[ck[si]:ck[si + 1]].transpose(0, 1)[None].repeat_interleave(rep, 1)
        vs = v[ck[si]:ck[si + 1]].transpose(0, 1)[None].repeat_interleave(rep, 1)
        ex = exact_attention(qs, ks, vs, is_causal=causal)
        m = compare(out0[cq[si]:cq[si + 1]].transpose(0, 1)[None], ex)
        ok = m["cos"] >= (0.995 if precision == "4b" else 0.9995)
        if not ok:
            fails.append(f"clean sequence {si} vs float64: {m}")
    seq, gkv = 2, hkv - 1  # poison the last sequence, last KV head
    lq, lk = lens_q[seq], lens_k[seq]
    sampled = _sampled(lk)
    mid = next(j for j in range(lk // 3, lk) if j not in sampled)
    inj = []
    for n, val in enumerate(VALUES):
        inj.append(("q", val, ([lq - 1, lq // 2, 3][n], hq - 1, [0, d // 2 + 1, d - 1][n])))
        inj.append(("k", val, ([0, mid, lk - 5][n], gkv, [0, d // 2 + 1, d - 1][(n + 1) % 3])))
        inj.append(("v", val, ([0, mid, lk - 5][(n + 1) % 3], gkv, [0, d // 2 + 1, d - 1][(n + 2) % 3])))
    for what, val, (t, hh, ch) in inj:
        base = cq[seq] if what == "q" else ck[seq]
        args = {"q": q, "k": k, "v": v}
        x = args[what].clone()
        x[base + t, hh, ch] = val
        xs = x.clone()
        args[what] = x
        fill_next((tq, hq, d), dtype, SENTINEL)
        out, lse = call(args["q"], args["k"], args["v"])
        torch.cuda.synchronize()
        tag = f"{what}[tok {t} of seq {seq}, head {hh}, ch {ch}]={val}"
        if not bits_equal(x, xs):
            fails.append(f"{tag}: the input was modified")
        bad = rows_nonfinite(out)  # (total_q, Hq)
        need = torch.zeros_like(bad)
        if what == "q":
            need[cq[seq] + t, hh] = True
        else:
            i = torch.arange(lq, device=DEV)
            seen = (t <= i + (lk - lq)) if causal else torch.ones(lq, dtype=torch.bool, device=DEV)
            for h in range(gkv * rep, (gkv + 1) * rep):
                need[cq[seq]:cq[seq + 1], h] = seen
        if (need & ~bad).any():
            fails.append(f"{tag}: {int((need & ~bad).sum())} required rows finite")
        if what in ("q", "k") and (need.T & torch.isfinite(lse)).any():
            fails.append(f"{tag}: required LSE rows finite")
        for si in range(len(lens_q)):
            for gg in range(hkv):
                if (si, gg) == (seq, gkv):
                    continue
                hs = slice(gg * rep, (gg + 1) * rep)
                rs = slice(cq[si], cq[si + 1])
                if not torch.equal(out[rs, hs], out0[rs, hs]) or not torch.isfinite(out[rs, hs]).all():
                    fails.append(f"{tag}: untouched (sequence {si}, kv {gg}) differs from the clean run")
                if not torch.equal(lse[hs, rs], lse0[hs, rs]):
                    fails.append(f"{tag}: untouched (sequence {si}, kv {gg}) LSE differs from the clean run")
    record({"case": f"nonfinite varlen {precision} {pv} d{d} causal={causal}", "failures": len(fails)})
    assert not fails, f"{len(fails)} failures:\n  " + "\n  ".join(fails)


def test_cases_cover_every_variant():
    """The matrix above names every kernel variant the issue lists (guards against silently dropped cases)."""
    names = " ".join(c.name for c in CASES)
    for part in ("hopper", "split", "causal", "kmask", "smoothv", "portable8b-fp8f16", "portable8b-fp8mma",
                 "portable8b-fp16", "portable4b-int8", "portable4b-int4", "d64", "d128", "bf16", "fp16"):
        assert part in names, part
    assert math.isnan(VALUES[0]) and VALUES[1] == float("inf") and VALUES[2] == float("-inf")

"""A fuzzed grid over the whole input space the public API accepts, each case checked against float64.

`draw_case(seed, device)` draws one call: batch, GQA head counts, Sq != Skv, odd lengths 1..5000, head dims
1..256, causal, key padding (with fully masked rows), dense bool and float masks, fp16/bf16/fp32, both layouts,
non-contiguous views, LSE, scale, every precision, and the three entry points (`attention`, the SDPA drop-in
`sdpa` with torch's own mask and causal rules, `varlen_attention`). `check_case(case)` runs it and returns the list
of failures (empty: passed), each tagged with its kind, so a grid reports its failures by kind.

Checks: output (and LSE) vs the float64 reference within the tolerance of the precision that actually ran, no
NaN or Inf from finite inputs, rows with no visible key exactly 0 (LSE -inf), inputs untouched, the output's shape
and dtype, and which implementation ran (the reference on CPU, a compiled kernel on a GPU where one fits).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

import sage_patch
from sage_patch.report import GLOBAL_STATS
from sage_patch.reference import exact_attention

# Tolerances vs float64 on structured inputs, by the precision that ran: relative L1 over visible rows, and the
# LSE's error relative to the call's largest |LSE|, at least 4 (quantized scores err in proportion to the scores'
# magnitude, which the structured inputs' outliers make large; calls of a few keys have an LSE near 0). Full precision is bounded by the dtype's rounding; quantized ones by their numerics (the
# SageAttention papers' figures are cos >= 0.999 for 8b; 4b and fp4 are coarser by design).
REL_L1 = {"full": {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2},
          "8b": 0.03, "4b": 0.25, "fp4": 0.2}
LSE_REL = {"full": {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3},
           "8b": 0.01, "4b": 0.25, "fp4": 0.1}
PRECISIONS = ("8b", "4b", "fp4", "full")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MASKS = ("none", "key_padding", "key_padding_4d", "dense", "float")


@dataclass
class Case:
    seed: int
    api: str            # "attention" | "sdpa" | "varlen"
    b: int
    hq: int
    hkv: int
    sq: int
    skv: int
    d: int
    dv: int
    causal: bool
    mask: str           # one of MASKS
    dtype: torch.dtype
    layout: str         # "bhsd" | "bshd" (attention only)
    noncontig: bool
    lse: bool
    scale: float | None
    precision: str
    device: str
    window: int = -1    # window_size=(window, 0) when >= 0 (attention and sdpa)

    def __str__(self):
        return (f"seed={self.seed} {self.api} {self.precision} B{self.b} H{self.hq}/{self.hkv} S{self.sq}x{self.skv} "
                f"D{self.d}/{self.dv} causal={self.causal} mask={self.mask} {str(self.dtype)[6:]} {self.layout} "
                f"noncontig={self.noncontig} lse={self.lse} scale={self.scale} window={self.window}")


def _length(rng: random.Random) -> int:
    return max(1, min(5000, int(math.exp(rng.uniform(0, math.log(5000))))))


def draw_case(seed: int, device: str = "cpu", budget: float = 3e6) -> Case:
    """One random call. `budget` bounds B * Hq * Sq * Skv (the float64 reference's work)."""
    rng = random.Random(seed)
    api = rng.choices(("attention", "sdpa", "varlen"), weights=(6, 2, 1))[0]
    hkv = rng.choice((1, 1, 2, 3, 4))
    hq = hkv * rng.choice((1, 1, 2, 3))
    b = rng.choice((1, 1, 2, 3))
    sq, skv = _length(rng), _length(rng)
    if rng.random() < 0.3:
        skv = sq
    d = rng.choice((64, 128, 64, 128, rng.randint(1, 256)))
    dv = d if rng.random() < 0.85 or api == "varlen" else rng.choice((d, 64, rng.randint(1, 256)))
    while b * hq * sq * skv > budget:  # shrink the batch and heads first, then the lengths
        if b > 1:
            b -= 1
        elif hq > hkv:
            hq -= hkv
        elif hkv > 1:
            hkv, hq = hkv - 1, hq // hkv * (hkv - 1)
        elif sq >= skv:
            sq = max(1, sq // 2)
        else:
            skv = max(1, skv // 2)
    mask = rng.choice(MASKS) if api != "varlen" else "none"
    if api == "sdpa" and mask in ("key_padding",):  # sdpa follows torch: a (B, Skv) mask is not its rule
        mask = "key_padding_4d"
    causal = rng.random() < 0.4 and (api != "sdpa" or mask == "none")  # torch's sdpa: mask or causal, not both
    # a sliding window on a quarter of the calls, from a generator of its own (the other draws stay as they were)
    wrng = random.Random(seed * 7919 + 1)
    window = wrng.randint(0, 2 * max(sq, skv)) if api != "varlen" and wrng.random() < 0.25 else -1
    return Case(seed=seed, api=api, b=b, hq=hq, hkv=hkv, sq=sq, skv=skv, d=d, dv=dv, causal=causal, mask=mask,
                dtype=rng.choice(DTYPES), layout=rng.choice(("bhsd", "bshd")) if api == "attention" else "bhsd",
                noncontig=rng.random() < 0.3, lse=api != "sdpa" and rng.random() < 0.4,
                scale=rng.choice((None, None, 0.05, 0.3)), precision=rng.choice(PRECISIONS), device=device,
                window=window)


def _structured(g: torch.Generator, shape, dim_bias: float, outliers: bool):
    """randn plus what real attention inputs have: a per-channel bias (K, V) or a few outlier channels (Q)."""
    dev = g.device
    x = torch.randn(*shape, generator=g, device=dev)
    if dim_bias:
        x = x + dim_bias * torch.randn(shape[-1], generator=g, device=dev)
    if outliers:
        x[..., torch.randperm(shape[-1], generator=g, device=dev)[: max(1, shape[-1] // 32)]] *= 6.0
    return x


def _view(x: torch.Tensor, noncontig: bool) -> torch.Tensor:
    """x itself, or the same values as a non-contiguous view (every other row of a wider buffer)."""
    if not noncontig:
        return x
    wide = torch.empty(*x.shape[:-2], x.shape[-2], 2 * x.shape[-1], dtype=x.dtype, device=x.device)
    wide[..., : x.shape[-1]] = x
    return wide[..., : x.shape[-1]]


def make_inputs(c: Case):
    """q, k, v (B, H, S, D) in the case's dtype and the mask argument, drawn on the case's device."""
    g = torch.Generator(device=c.device).manual_seed(c.seed)
    dev = c.device
    q = _structured(g, (c.b, c.hq, c.sq, c.d), 0.0, True)
    k = _structured(g, (c.b, c.hkv, c.skv, c.d), 4.0, False)
    v = _structured(g, (c.b, c.hkv, c.skv, c.dv), 4.0, False)
    attn_mask = None
    if c.mask in ("key_padding", "key_padding_4d"):
        keep = torch.rand(c.b, c.skv, generator=g, device=dev) < 0.7
        keep[0, -1] = False
        if c.b > 1:
            keep[1] = False  # a fully masked batch entry: every row empty
        attn_mask = keep if c.mask == "key_padding" else keep[:, None, None, :]
    elif c.mask == "dense":
        hb = c.hq if c.seed % 2 else 1
        attn_mask = torch.rand(c.b, hb, c.sq, c.skv, generator=g, device=dev) < 0.6
        attn_mask[..., 0, :] = False  # an empty row
    elif c.mask == "float":
        attn_mask = torch.randn(1, c.hq, c.sq, c.skv, generator=g, device=dev)
        attn_mask = attn_mask.masked_fill(torch.rand(1, c.hq, c.sq, c.skv, generator=g, device=dev) < 0.2, -math.inf)
        attn_mask = attn_mask.to(c.dtype)
    return q.to(c.dtype), k.to(c.dtype), v.to(c.dtype), attn_mask


def _visible(c: Case, attn_mask):
    """(B|1, H|1, Sq, Skv) bool: what each row may see under the entry point's own rules."""
    if attn_mask is None:
        vis = torch.ones(1, 1, c.sq, c.skv, dtype=torch.bool, device=c.device)
    elif attn_mask.dtype == torch.bool:
        vis = attn_mask[:, None, None, :] if attn_mask.dim() == 2 else attn_mask
    else:
        vis = attn_mask > -math.inf
    if c.causal or c.window >= 0:  # window_size=(w, 0) is causal by itself
        i = torch.arange(c.sq, device=c.device)[:, None]
        j = torch.arange(c.skv, device=c.device)
        # sdpa keeps torch's top-left rule; attention and varlen align bottom-right
        diag = i if c.api == "sdpa" else i + c.skv - c.sq
        vis = vis & (j <= diag)
        if c.window >= 0:
            vis = vis & (j >= diag - c.window)
    return vis


def _call(c: Case, q, k, v, attn_mask):
    """Run the entry point on device tensors in the case's layout; returns (out (B, H, Sq, Dv), lse or None)."""
    dev = c.device
    if c.api == "varlen":
        # each batch entry becomes one packed sequence of the same lengths
        pack = lambda x: x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[-1])  # noqa: E731
        cu_q = torch.arange(c.b + 1, dtype=torch.int32, device=dev) * c.sq
        cu_k = torch.arange(c.b + 1, dtype=torch.int32, device=dev) * c.skv
        res = sage_patch.varlen_attention(_view(pack(q), c.noncontig), pack(k), pack(v), cu_q, cu_k,
                                          is_causal=c.causal, scale=c.scale, precision=c.precision,
                                          return_lse=c.lse)
        out, lse = res if c.lse else (res, None)
        out = out.reshape(c.b, c.sq, c.hq, c.dv).transpose(1, 2)
        lse = None if lse is None else lse.reshape(c.hq, c.b, c.sq).transpose(0, 1)
        return out, lse
    if c.api == "sdpa":
        out = sage_patch.sdpa(_view(q, c.noncontig), k, v, attn_mask=attn_mask, is_causal=c.causal, scale=c.scale,
                              enable_gqa=c.hq != c.hkv, precision=c.precision, window_size=_window_size(c))
        return out, None
    if c.layout == "bshd":
        q, k, v = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    res = sage_patch.attention(_view(q, c.noncontig), k, v, layout=c.layout, is_causal=c.causal, scale=c.scale,
                               attn_mask=attn_mask, precision=c.precision, return_lse=c.lse,
                               window_size=_window_size(c))
    out, lse = res if c.lse else (res, None)
    return (out.transpose(1, 2) if c.layout == "bshd" else out), lse


def _window_size(c: Case):
    return (c.window, 0) if c.window >= 0 else None


def check_case(c: Case, *, expect_kernel: bool = False) -> tuple[list[tuple[str, str]], dict]:
    """Run one case; returns ([(kind, message)], info). info: the implementation and precision that ran."""
    qd, kd, vd, attn_mask = make_inputs(c)
    before = [x.clone() for x in (qd, kd, vd)]
    GLOBAL_STATS.reset()
    try:
        out, lse = _call(c, qd, kd, vd, attn_mask)
    except Exception as e:  # an accepted call must not raise
        return [("raised", f"{type(e).__name__}: {e}")], {}
    impls, used = dict(GLOBAL_STATS.impls), dict(GLOBAL_STATS.used)
    info = {"impl": impls, "used": used}
    fails = []
    if any(not torch.equal(a, b2) for a, b2 in zip(before, (qd, kd, vd))):
        fails.append(("input_written", "an input tensor was modified"))
    if tuple(out.shape) != (c.b, c.hq, c.sq, c.dv) or out.dtype != c.dtype:
        return fails + [("shape", f"out {tuple(out.shape)} {out.dtype}")], info
    if c.device == "cpu" and c.precision != "full" and "reference" not in impls and "sdpa" not in impls:
        fails.append(("impl", f"on CPU expected the reference or sdpa, ran {impls}"))
    if expect_kernel and not any(i.startswith("cuda-") for i in impls):
        fails.append(("impl", f"expected a compiled kernel, ran {impls} ({dict(GLOBAL_STATS.fallbacks)})"))
    precision = max(used, key=lambda p: PRECISIONS.index(p)) if used else c.precision  # the coarsest that ran

    # the reference sees what each row may see (the entry point's own causal and window rules) as one dense mask
    vis = _visible(c, attn_mask).expand(c.b, c.hq, c.sq, c.skv)
    ref_mask = vis
    if attn_mask is not None and attn_mask.dtype != torch.bool:  # the float mask's values, -inf where hidden
        ref_mask = torch.where(vis, attn_mask.double(), -math.inf)
    # float64 of the very values the call saw (rounded to its dtype), on its device
    ref, ref_lse = exact_attention(*(x.double() for x in (qd, kd, vd)), scale=c.scale, return_lse=True,
                                   attn_mask=ref_mask)
    outd = out.detach().double()
    nonempty = vis.any(-1)
    if not torch.isfinite(outd).all():
        fails.append(("nonfinite", f"{int((~torch.isfinite(outd)).sum())} non-finite outputs from finite inputs"))
    if (outd[~nonempty] != 0).any():
        fails.append(("empty_row", "a row with no visible key is not 0"))
    tol = REL_L1[precision] if precision != "full" else REL_L1["full"][c.dtype]
    sel = nonempty.unsqueeze(-1).expand_as(outd)
    err = ((outd - ref)[sel].abs().sum() / ref[sel].abs().sum().clamp_min(1e-30)).item() if sel.any() else 0.0
    info["rel_l1"] = err
    if not err <= tol:
        fails.append(("accuracy", f"rel L1 {err:.3g} > {tol} ({precision})"))
    if c.lse:
        lsed = lse.detach().double()
        if tuple(lsed.shape) != (c.b, c.hq, c.sq):
            fails.append(("lse", f"LSE shape {tuple(lsed.shape)}"))
        else:
            if not (lsed[~nonempty] == -math.inf).all():
                fails.append(("lse", "LSE of an empty row is not -inf"))
            ltol = LSE_REL[precision] if precision != "full" else LSE_REL["full"][c.dtype]
            lerr = 0.0
            if nonempty.any():
                lerr = ((lsed - ref_lse)[nonempty].abs().max() / ref_lse[nonempty].abs().max().clamp_min(4)).item()
            info["lse_rel"] = lerr
            if not lerr <= ltol:
                fails.append(("lse", f"LSE error {lerr:.3g} of max |LSE| > {ltol} ({precision})"))
    return fails, info


def run_grid(seeds, device="cpu", budget=3e6, expect_kernel=None, seconds=None, progress=0):
    """Run many cases (until `seconds` have passed, if given); returns (counts by failure kind,
    [(case, kind, message)], [(case, info)])."""
    import time
    from collections import Counter

    kinds, failures, infos = Counter(), [], []
    t0 = time.perf_counter()
    for n, s in enumerate(seeds, 1):
        c = draw_case(s, device, budget)
        fails, info = check_case(c, expect_kernel=bool(expect_kernel and expect_kernel(c)))
        infos.append((c, info))
        for kind, msg in fails:
            kinds[kind] += 1
            failures.append((c, kind, msg))
        elapsed = time.perf_counter() - t0
        if progress and n % progress == 0:
            print(f"fuzz: {n} cases, {elapsed:.0f} s, failures {dict(kinds)}", flush=True)
        if seconds is not None and elapsed > seconds:
            break
    return kinds, failures, infos


# ---- non-finite values in training (the trainable 8b, forward and backward) ------------------------------------

NONFINITE_WHERE = ("q", "k", "v", "dout")


def nonfinite_training_inputs(b, hq, hkv, sq, skv, d, dtype, device, key_padding, seed=0):
    """q, k, v, dout (B, H, S, D) of `dtype` on `device`, and the key-padding mask (None, or batch 0's last third
    masked and, with B > 1, the last batch entry fully masked: rows with no visible key)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, sq, d, generator=g)
    k = torch.randn(b, hkv, skv, d, generator=g) + 2.0 * torch.randn(d, generator=g)
    v = torch.randn(b, hkv, skv, d, generator=g) + 2.0 * torch.randn(d, generator=g)
    dout = torch.randn(b, hq, sq, d, generator=g)
    mask = None
    if key_padding:
        mask = torch.ones(b, skv, dtype=torch.bool)
        mask[0, skv - max(1, skv // 3):] = False
        if b > 1:
            mask[-1] = False
        mask = mask.to(device)
    return [x.to(device, dtype) for x in (q, k, v, dout)], mask


def check_nonfinite_training(run, where: str, bad: float, *, b=2, hq=4, hkv=2, sq=80, skv=72, d=64,
                             dtype=torch.float16, causal=True, key_padding=False, device="cpu", seed=0,
                             dq_order: float = 0.0):
    """The non-finite rule in training (docs/semantics.md), for one NaN or Inf placed in q, k, v or dout of batch
    entry 0, last query head (and its KV head). run(q, k, v, dout, mask, causal) -> (out, dq, dk, dv). Returns the
    list of failures (empty: the rule held):
    - reached: every output row and gradient row the value reaches is non-finite: a query row i (q, dout) reaches
      its own O (q only) and dQ rows and the dK / dV rows of the keys it sees; a key j (k, v) reaches O and dQ of
      every row that sees it and dK_j (k also dV_j, through P);
    - untouched: other batch entries and (KV-)heads are bitwise those of the run without the value (dout: O
      everywhere);
    - empty rows (no visible key) give O = 0, and dQ = 0 unless K or V of their group is non-finite (an empty row's
      dS is 0, times the NaN key scale folded into it, or times dP = dO V^T).
    dq_order > 0: the kernel sums dQ with floating-point reductions (two runs may differ in the last bit of an element
    near a rounding boundary), so "untouched" holds dQ to finite values within rel L1 dq_order, not bitwise."""
    (q, k, v, dout), mask = nonfinite_training_inputs(b, hq, hkv, sq, skv, d, dtype, device, key_padding, seed)
    h0 = hq - 1
    kv0 = h0 // (hq // hkv)
    group = slice(kv0 * (hq // hkv), (kv0 + 1) * (hq // hkv))
    row, key = sq - 2, 1
    clean = [x.detach() for x in run(q, k, v, dout, mask, causal)]
    poisoned = {"q": q.clone(), "k": k.clone(), "v": v.clone(), "dout": dout.clone()}
    if where in ("q", "dout"):
        poisoned[where][0, h0, row, 3] = bad
    else:
        poisoned[where][0, kv0, key, 3] = bad
    out, dq, dk, dv = (x.detach() for x in run(poisoned["q"], poisoned["k"], poisoned["v"], poisoned["dout"], mask,
                                               causal))
    vis = torch.ones(b, 1, sq, skv, dtype=torch.bool, device=device)
    if mask is not None:
        vis = vis & mask[:, None, None, :]
    if causal:
        vis = vis & (torch.arange(skv, device=device) <= torch.arange(sq, device=device)[:, None] + skv - sq)
    vis = vis.expand(b, hq, sq, skv)
    empty = ~vis.any(-1)
    bad_rows = lambda x: (~torch.isfinite(x)).any(-1)  # noqa: E731
    fails = []

    def need(name, x, sel):
        if not bad_rows(x)[sel].all():
            fails.append(("reached", f"{name}: {int((~bad_rows(x)[sel]).sum())} of {int(sel.sum())} rows the "
                                     f"{where} value reaches are finite"))

    hit_q = torch.zeros(b, hq, sq, dtype=torch.bool, device=device)     # query rows it must reach (O / dQ)
    hit_k = torch.zeros(b, hkv, skv, dtype=torch.bool, device=device)   # key rows (dK, and dV below)
    if where in ("q", "dout"):
        hit_q[0, h0, row] = True
        hit_k[0, kv0] = vis[0, h0, row]
    else:
        hit_q[0, group] = vis[0, group, :, key]
        hit_k[0, kv0, key] = True
    if where == "q":
        need("O", out, hit_q)
    if where in ("k", "v"):
        need("O", out, hit_q)
    need("dQ", dq, hit_q)
    need("dK", dk, hit_k)
    if where != "v":  # dV = P^T dO holds no V
        need("dV", dv, hit_k)

    scope_q = torch.zeros(b, hq, dtype=torch.bool, device=device)       # (batch, head) pairs it may change
    scope_kv = torch.zeros(b, hkv, dtype=torch.bool, device=device)
    scope_kv[0, kv0] = True
    if where in ("q", "dout"):
        scope_q[0, h0] = True
    else:
        scope_q[0, group] = True
    for name, x, ref, scope in (("O", out, clean[0], scope_q & (where != "dout")), ("dQ", dq, clean[1], scope_q),
                                ("dK", dk, clean[2], scope_kv), ("dV", dv, clean[3], scope_kv)):
        if name == "dQ" and dq_order > 0:
            a, r = x[~scope].float(), ref[~scope].float()
            if torch.isfinite(a).all() and (a - r).abs().sum() <= dq_order * r.abs().sum():
                continue
        if not torch.equal(x[~scope], ref[~scope]):
            fails.append(("untouched", f"{name} changed outside the (batch, head) the {where} value belongs to"))
    if (out[empty] != 0).any():
        fails.append(("empty_row", "O of a row with no visible key is not 0"))
    if where in ("q", "dout") and (dq[empty] != 0).any():
        fails.append(("empty_row", "dQ of a row with no visible key is not 0"))
    return fails

"""Helpers shared by the GPU kernel tests: inputs with realistic outliers, NaN-poisoned outputs, result records."""
from __future__ import annotations

import json
import os

import torch

import sage_patch.kernels as K
from sage_patch.accuracy import compare
from sage_patch.reference import exact_attention, simulate

DEV = "cuda"


def record(res: dict) -> None:
    """Print the measured figures; with SAGE_TEST_RESULTS=path also append them there as JSON lines."""
    print(res)
    path = os.environ.get("SAGE_TEST_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(res) + "\n")


def make_qkv(b, hq, hkv, sq, skv, d, dtype=torch.float16, layout="bhsd", seed=0, q_bias=None, kv_bias=4.0):
    """Random q, k, v; k and v (and q if q_bias) get a per-channel bias of that size times randn(d), the channel
    outliers real K and V tensors have. layout "bshd" returns contiguous (B, S, H, D) tensors."""
    g = torch.Generator(device=DEV).manual_seed(seed)

    def rnd(h, s, bias):
        x = torch.randn(b, h, s, d, generator=g, device=DEV)
        if bias is not None:
            x = x + bias * torch.randn(d, generator=g, device=DEV)
        x = x.to(dtype)
        return x.transpose(1, 2).contiguous() if layout == "bshd" else x

    return rnd(hq, sq, q_bias), rnd(hkv, skv, kv_bias), rnd(hkv, skv, kv_bias)


def to_bhsd(x, layout):
    return x.transpose(1, 2) if layout == "bshd" else x


def poison(shape, dtype):
    """Fill the caching allocator's next blocks of this size with NaN, so unwritten outputs show."""
    t = torch.full(shape, float("nan"), device=DEV, dtype=dtype)
    del t


def check_kernel_case(precision, b, hq, hkv, sq, skv, d, *, sim_l1, lse_atol, dtype=torch.float16, layout="bhsd",
                      causal=False, mask=None, pv=None, smooth_v=False, seed=0, q_bias=None, check_exact=True,
                      name="", window_left=-1):
    """One compiled-kernel call checked end to end; returns (out, lse). Fresh inputs (make_qkv), NaN-poisoned output
    memory, inputs unchanged after the call, finite output, then against the simulation of the kernel's own config
    (rel L1 <= sim_l1, LSE within lse_atol, the same empty rows, which must be 0) and, with check_exact, float64:
    "8b" cos >= 0.9995, rel L1 <= 0.03, LSE within 0.05; "4b" cos >= 0.995. window_left >= 0: the kernel's sliding
    window; the simulation and float64 get it as a dense bool mask (window_mask)."""
    q, k, v = make_qkv(b, hq, hkv, sq, skv, d, dtype, layout, seed, q_bias=q_bias)
    keep = [x.clone() for x in (q, k, v)] + ([mask.clone()] if mask is not None else [])
    poison(q.shape, dtype)
    out, lse = K.attention(q, k, v, layout=layout, is_causal=causal, attn_mask=mask, pv=pv, precision=precision,
                           smooth_v=smooth_v, window_left=window_left)
    torch.cuda.synchronize()
    for a, b_ in zip((q, k, v) + ((mask,) if mask is not None else ()), keep):
        assert torch.equal(a, b_), "an input was modified"
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.isfinite(out).all(), "NaN/inf in the output (unwritten or empty rows)"
    qb, kb, vb = (to_bhsd(x, layout) for x in (q, k, v))
    ob = to_bhsd(out, layout)
    m4 = mask[:, None, None, :] if mask is not None else None
    if window_left >= 0:
        w = window_mask(sq, skv, window_left)
        m4 = w if m4 is None else m4 & w
    impl = K.variant_for(q, pv, precision)  # the kernel variant this call ran (its reference SimConfig)
    sim, sim_lse = simulate(qb, kb, vb, precision, is_causal=causal, attn_mask=m4, return_lse=True,
                            smooth_v=smooth_v, config=K.reference_config(impl, d))
    res = {"case": name, "sim_l1": compare(ob, sim.to(dtype))["rel_l1"], "sim_l1_fp32": compare(ob, sim)["rel_l1"]}
    fin = torch.isfinite(sim_lse)
    assert torch.equal(torch.isfinite(lse), fin), "LSE -inf pattern differs from the simulation"
    res["lse_maxdiff"] = float((lse[fin] - sim_lse[fin]).abs().max()) if fin.any() else 0.0
    if (~fin).any():
        assert (ob.float()[~fin] == 0).all(), "empty rows must be 0"
    if check_exact:
        ex, ex_lse = exact_attention(qb, kb, vb, is_causal=causal, attn_mask=m4, return_lse=True)
        mex = compare(ob, ex)
        res.update(exact_cos=mex["cos"], exact_l1=mex["rel_l1"])
        res["exact_lse_maxdiff"] = float((lse[fin] - ex_lse[fin]).abs().max()) if fin.any() else 0.0
    record(res)
    assert res["sim_l1"] <= sim_l1, res
    assert res["lse_maxdiff"] <= lse_atol, res
    if check_exact and precision == "4b":
        assert res["exact_cos"] >= 0.995, res
    elif check_exact:
        assert res["exact_cos"] >= 0.9995 and res["exact_l1"] <= 0.03 and res["exact_lse_maxdiff"] <= 0.05, res
    return out, lse


def check_graph_replay(call, inputs, new_inputs):
    """call() -> (out, lse) captured in a CUDA graph (after a warm-up on a side stream): a replay into NaN-filled
    output gives the eager result, and after new_inputs are copied into the captured inputs, a replay gives the
    eager result of those (the graph recomputes, it does not replay a cached answer)."""
    eager, eager_lse = call()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, lse = call()
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager) and torch.equal(lse, eager_lse)
    for x, y in zip(inputs, new_inputs):
        x.copy_(y)
    g.replay()
    ref, _ = call()
    torch.cuda.synchronize()
    assert torch.equal(out, ref)


def routed_precision(q, precision):
    """The precision the public API runs for `precision` on q's GPU: without INT4 tensor cores (sm_90+) the
    resolver runs "4b" as 8b (resolve.py; policy options.exact_4b not set)."""
    if precision == "4b" and K.variant_for(q, None, "4b").qk != "int4":
        return "8b"
    return precision


def window_mask(sq, skv, window_left):
    """(1, 1, Sq, Skv) bool: the kernels' sliding window, stated independently of them: key j is visible from query
    i unless j < i + Skv - Sq - window_left (causal is the caller's is_causal)."""
    i = torch.arange(sq, device=DEV)[:, None] + (skv - sq)
    j = torch.arange(skv, device=DEV)[None, :]
    return (j >= i - window_left)[None, None]


# ---- non-finite inputs (test_nonfinite_gpu.py)

def fill_next(shape, dtype, value):
    """Like poison, with any fill value (a finite one makes unwritten outputs look finite, which a test that expects
    non-finite rows must see as a failure)."""
    t = torch.full(shape, value, device=DEV, dtype=dtype)
    del t


def set_at(x, layout, b, h, s, c, value):
    """x[b, h, s, c] = value in (B, H, S, D) terms, whatever the layout ("bshd": x[b, s, h, c])."""
    if layout == "bshd":
        x[b, s, h, c] = value
    else:
        x[b, h, s, c] = value


def bits_equal(a, b) -> bool:
    """Bitwise equality (NaN payloads included; torch.equal says NaN != NaN)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype in (torch.float16, torch.bfloat16):
        return torch.equal(a.view(torch.int16), b.view(torch.int16))
    if a.dtype == torch.float32:
        return torch.equal(a.view(torch.int32), b.view(torch.int32))
    return torch.equal(a, b)


def rows_nonfinite(x):
    """Per row (last dim reduced): whether the row holds a non-finite value."""
    return ~torch.isfinite(x.float()).all(dim=-1)

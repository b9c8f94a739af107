"""sage_patch.varlen_attention: the per-sequence reference path (CPU), against exact attention per sequence."""
from __future__ import annotations

import math

import pytest
import torch

import sage_patch
from sage_patch.accuracy import compare
from sage_patch.reference import exact_attention, simulate
from sage_patch.varlen import varlen_attention


def packed(lens_q, lens_k, hq=4, hkv=2, d=64, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(lens_q), sum(lens_k)
    q = torch.randn(tq, hq, d, generator=g).to(dtype)
    k = (torch.randn(tk, hkv, d, generator=g) + 2.0 * torch.randn(d, generator=g)).to(dtype)
    v = (torch.randn(tk, hkv, d, generator=g) + 2.0 * torch.randn(d, generator=g)).to(dtype)
    cu = lambda lens: torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)  # noqa: E731
    return q, k, v, cu(lens_q), cu(lens_k)


def per_sequence(fn, q, k, v, cu_q, cu_k):
    outs = []
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = (int(x) for x in (cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]))
        if q1 > q0:
            outs.append((q0, q1, fn(q[None, q0:q1].transpose(1, 2), k[None, k0:k1].transpose(1, 2),
                                    v[None, k0:k1].transpose(1, 2))))
    return outs


@pytest.mark.parametrize("causal", [False, True])
def test_full_precision_matches_exact_per_sequence(causal):
    lens_q, lens_k = [5, 17, 1, 30], [9, 17, 4, 30]
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k)
    out, lse = varlen_attention(q, k, v, cu_q, cu_k, is_causal=causal, precision="full", return_lse=True)
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    for q0, q1, (ex, ex_lse) in per_sequence(
            lambda a, b, c: exact_attention(a, b, c, is_causal=causal, return_lse=True), q, k, v, cu_q, cu_k):
        torch.testing.assert_close(out[q0:q1], ex[0].transpose(0, 1).float(), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(lse[:, q0:q1], ex_lse[0].float(), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("precision", ["8b", "4b", "fp4"])
def test_quantized_matches_per_sequence_simulation(precision):
    lens_q, lens_k = [33, 7, 70], [40, 7, 129]
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k, seed=1)
    out = varlen_attention(q, k, v, cu_q, cu_k, is_causal=True, precision=precision)
    for q0, q1, sim in per_sequence(lambda a, b, c: simulate(a, b, c, precision, is_causal=True), q, k, v, cu_q, cu_k):
        torch.testing.assert_close(out[q0:q1], sim[0].transpose(0, 1), atol=1e-6, rtol=1e-5)
    # and close to exact attention (the quantization is per sequence)
    for q0, q1, ex in per_sequence(lambda a, b, c: exact_attention(a, b, c, is_causal=True), q, k, v, cu_q, cu_k):
        assert compare(out[q0:q1], ex[0].transpose(0, 1))["cos"] > 0.98


def test_empty_sequences_give_zeros_and_minus_inf():
    # sequence 1: no query; sequence 2: queries but no key; sequence 3: causal with Sq > Skv (first rows empty)
    lens_q, lens_k = [4, 0, 3, 6], [4, 5, 0, 2]
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k, seed=2)
    out, lse = varlen_attention(q, k, v, cu_q, cu_k, is_causal=True, precision="8b", return_lse=True)
    assert torch.isfinite(out).all()
    assert (out[4:7] == 0).all() and torch.isneginf(lse[:, 4:7]).all()
    # last sequence: 6 queries, 2 keys, bottom-right: rows 0..3 see nothing, rows 4, 5 see keys
    assert (out[7:11] == 0).all() and torch.isneginf(lse[:, 7:11]).all()
    assert torch.isfinite(lse[:, 11:]).all()


def test_single_sequence_equals_attention():
    q, k, v, cu_q, cu_k = packed([50], [60], seed=3)
    out = varlen_attention(q, k, v, cu_q, cu_k, precision="8b", scale=0.2)
    ref = sage_patch.attention(q[None], k[None], v[None], layout="bshd", precision="8b", scale=0.2)
    torch.testing.assert_close(out, ref[0])


def test_fp16_inputs_keep_dtype_and_max_seqlen_is_accepted():
    q, k, v, cu_q, cu_k = packed([8, 9], [8, 9], dtype=torch.float16, seed=4)
    out = varlen_attention(q, k, v, cu_q, cu_k, max_seqlen_q=9, max_seqlen_k=9, precision="full")
    assert out.dtype == torch.float16 and torch.isfinite(out).all()


@pytest.mark.parametrize("bad", ["shape", "cu", "offsets", "gqa"])
def test_validation(bad):
    q, k, v, cu_q, cu_k = packed([4, 4], [4, 4])
    if bad == "shape":
        with pytest.raises(ValueError, match="3-D"):
            varlen_attention(q[None], k, v, cu_q, cu_k)
    elif bad == "cu":
        with pytest.raises(ValueError, match="B\\+1"):
            varlen_attention(q, k, v, cu_q, cu_k[:2])
    elif bad == "offsets":
        with pytest.raises(ValueError, match="non-decreasing"):
            varlen_attention(q, k, v, torch.tensor([0, 5, 3], dtype=torch.int32), cu_k)
    else:
        with pytest.raises(ValueError, match="GQA"):
            varlen_attention(q[:, :3], k, v, cu_q, cu_k)


def test_exported():
    assert sage_patch.varlen_attention is varlen_attention
    assert math.isfinite(float(varlen_attention(*packed([2], [2]), precision="full").sum()))

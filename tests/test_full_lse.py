"""The full-precision path's log-sum-exp (sage_patch/full.py): what ring attention merges for the calls no kernel
serves (precision "full", head dims other than 64/128, dense masks). Checked against a float64 logsumexp written
out here, independent of sage_patch's own exact attention, with key-padding and dense masks and Sq != Skv."""
import math

import pytest
import torch

import sage_patch
from sage_patch.policy import Policy
from sage_patch.binding import LayerBinding

B, HQ, HKV = 2, 4, 2
# fp32 inputs: the fused kernels round to fp32 (LSE values here reach ~30, so ~4e-6); the 8b simulation is ~1e-1 off
TOL = dict(rtol=1e-6, atol=1e-5)


def _reference(q, k, v, visible, scale):
    """float64 out and natural-log LSE; `visible` bool broadcastable to (B, Hq, Sq, Skv). Empty rows: 0, -inf."""
    g = q.shape[1] // k.shape[1]
    kd, vd = (x.double().repeat_interleave(g, dim=1) for x in (k, v))
    s = (q.double() @ kd.transpose(-1, -2)) * scale
    s = s.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    return p @ vd, lse


def _case(sq, skv, d, mask_kind, causal, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, s, d, generator=g) for h, s in ((HQ, sq), (HKV, skv), (HKV, skv)))
    k = k + 3.0 * torch.randn(d, generator=g)  # a channel bias, as real keys have
    if mask_kind == "key_padding":
        mask = torch.rand(B, skv, generator=g) < 0.7
        mask[1, :] = False
        mask[1, skv // 2:] = True                # the second entry sees only its last half: causal empties rows
        visible = mask[:, None, None, :]
    else:
        mask = torch.rand(B, HQ, sq, skv, generator=g) < 0.6
        mask[0, 1, 3] = False                    # an empty row
        visible = mask
    if causal:  # bottom-right: query i sees keys j <= i + Skv - Sq
        i, j = torch.arange(sq)[:, None], torch.arange(skv)[None, :]
        visible = visible & (j <= i + skv - sq)
    return q, k, v, mask, visible


@pytest.mark.parametrize("mask_kind", ["key_padding", "dense"])
@pytest.mark.parametrize("sq, skv", [(37, 100), (100, 37)])
@pytest.mark.parametrize("d", [64, 96])
@pytest.mark.parametrize("causal", [False, True])
def test_full_lse_is_exact(mask_kind, sq, skv, d, causal):
    q, k, v, mask, visible = _case(sq, skv, d, mask_kind, causal)
    scale = d ** -0.5
    out, lse = sage_patch.attention(q, k, v, attn_mask=mask, is_causal=causal, precision="full", return_lse=True)
    ref, ref_lse = _reference(q, k, v, visible, scale)
    empty = ~visible.expand(B, HQ, sq, skv).any(-1)
    assert lse.dtype == torch.float32 and lse.shape == (B, HQ, sq)
    assert torch.equal(torch.isneginf(lse), empty) and torch.equal(torch.isneginf(ref_lse), empty)
    assert empty.any() == (mask_kind == "dense" or (causal and sq > skv // 2))  # the -inf rows are exercised
    torch.testing.assert_close(lse.double()[~empty], ref_lse[~empty], **TOL)
    torch.testing.assert_close(out.double(), ref, **TOL)
    assert (out[empty.unsqueeze(-1).expand_as(out)] == 0).all()


@pytest.mark.parametrize("mask_kind", ["key_padding", "dense"])
def test_lse_of_a_policy_fallback_is_the_full_paths(mask_kind):
    """An "8b" layer whose call its policy sends to full (head dim 96 listed) returns the full path's exact LSE, as
    the resolver's no-kernel fallbacks do on a GPU (head dim 96, dense masks)."""
    q, k, v, mask, visible = _case(48, 80, 96, mask_kind, True, seed=1)
    layer = LayerBinding("ring", 0, Policy.from_any({"default": "8b", "fallback": {"head_dims": [96]}}))
    out, lse = layer.attention(q, k, v, is_causal=True, attn_mask=mask, return_lse=True)
    ref, ref_lse = _reference(q, k, v, visible, 96 ** -0.5)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], **TOL)
    torch.testing.assert_close(out.double(), ref, **TOL)
    assert layer.stats.used == {"full": 1}
    assert layer.stats.fallbacks == {"head dim 96 listed in policy fallback.head_dims": 1}

"""Sliding windows in the public API and the reference: FlashAttention's window_size=(left, 0).

`sage_patch.attention` / `sageattn` align the window bottom-right (as their causal), `sdpa` top-left (as torch's
is_causal); the reference simulation masks exactly what the kernels mask (window_left: key j hidden from query i when
j < i + Skv - Sq - window_left). References are float64 attention with a dense mask built here, independently.
"""
import pytest
import torch

import sage_patch
from sage_patch.reference import exact_attention, simulate

COS_8B = 0.999


def qkv(b=2, hq=4, hkv=2, sq=37, skv=37, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, hq, sq, d, generator=g), torch.randn(b, hkv, skv, d, generator=g),
            torch.randn(b, hkv, skv, d, generator=g))


def dense_window(sq, skv, left, *, top_left=False):
    """(1, 1, Sq, Skv): FlashAttention's (left, 0) around the diagonal j = i + Skv - Sq (top-left: j = i)."""
    i = torch.arange(sq)[:, None] + (0 if top_left else skv - sq)
    j = torch.arange(skv)[None, :]
    return ((j <= i) & (j >= i - left))[None, None]


def cosine(a, b):
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


@pytest.mark.parametrize("bad", [(3,), (3, 0, 0), (3, 1), (-1, 0), (-2, 0), (2.0, 0), (True, 0), (3, False), "3",
                                 3, (None, 0)])
def test_window_size_validation_names_argument_value_and_allowed(bad):
    q, k, v = qkv(sq=8, skv=8)
    for call in (lambda: sage_patch.attention(q, k, v, window_size=bad),
                 lambda: sage_patch.sageattn(q, k, v, window_size=bad),
                 lambda: sage_patch.sdpa(q, k, v, enable_gqa=True, window_size=bad)):
        with pytest.raises(ValueError) as e:
            call()
        msg = str(e.value)
        assert "window_size" in msg and repr(bad) in msg and "(left, 0)" in msg and "(-1, -1)" in msg


def test_run_attention_window_left_validated():
    q, k, v = qkv(sq=8, skv=8)
    with pytest.raises(ValueError, match="window_left"):
        sage_patch.api.run_attention(q, k, v, window_left=-2)


def test_no_window_values_change_nothing():
    q, k, v = qkv()
    base = sage_patch.attention(q, k, v, is_causal=True)
    for ws in (None, (-1, -1), [-1, -1]):
        torch.testing.assert_close(sage_patch.attention(q, k, v, is_causal=True, window_size=ws), base,
                                   atol=0, rtol=0)


@pytest.mark.parametrize("precision", ["8b", "4b", "fp4"])
@pytest.mark.parametrize("sq,skv,left", [(37, 37, 5), (13, 50, 9), (50, 13, 4), (37, 37, 0), (37, 37, 36),
                                         (13, 50, 100), (1, 50, 6)])
@pytest.mark.parametrize("padded", [False, True])
def test_simulate_window_is_the_dense_mask_and_near_float64(precision, sq, skv, left, padded):
    """simulate(window_left) masks exactly what the same window as a dense mask masks (bit for bit), with key
    padding too, and is within the precision's error of float64 attention; rows with no visible key give 0."""
    q, k, v = qkv(sq=sq, skv=skv)
    kp = torch.ones(2, skv, dtype=torch.bool)
    if padded:
        kp[0, :skv // 2] = False  # left padding: some rows of batch 0 see no key inside their window
        kp[1, skv - 3:] = False
    dense = dense_window(sq, skv, left) & kp[:, None, None, :]
    got = simulate(q, k, v, precision, is_causal=True, attn_mask=kp if padded else None, window_left=left)
    same = simulate(q, k, v, precision, attn_mask=dense)
    assert torch.equal(got, same)
    ref = exact_attention(q, k, v, attn_mask=dense)
    empty = ~dense.expand(2, 4, sq, skv).any(-1)
    assert (got[empty] == 0).all() and (ref[empty] == 0).all()
    assert cosine(got, ref) >= {"8b": COS_8B, "4b": 0.98, "fp4": 0.97}[precision]


@pytest.mark.parametrize("precision", ["8b", "full"])
@pytest.mark.parametrize("sq,skv", [(29, 29), (7, 41), (41, 7)])
def test_attention_window_bottom_right_with_padding(precision, sq, skv):
    q, k, v = qkv(sq=sq, skv=skv)
    kp = torch.ones(2, skv, dtype=torch.bool)
    kp[1, :skv // 3] = False
    dense = dense_window(sq, skv, 6) & kp[:, None, None, :]
    ref = exact_attention(q, k, v, attn_mask=dense)
    out, lse = sage_patch.attention(q, k, v, is_causal=True, attn_mask=kp, window_size=(6, 0), precision=precision,
                                    return_lse=True)
    _, ref_lse = exact_attention(q, k, v, attn_mask=dense, return_lse=True)
    if precision == "full":
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
    else:
        assert cosine(out, ref) >= COS_8B
    # bshd layout and sageattn's NHD: the same window
    out2 = sage_patch.sageattn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), tensor_layout="NHD",
                               is_causal=True, attn_mask=kp, window_size=(6, 0), precision=precision)
    torch.testing.assert_close(out2.transpose(1, 2), out)


def test_window_is_causal_by_itself():
    """FlashAttention: (left, 0) is causal, whatever is_causal says."""
    q, k, v = qkv(sq=20, skv=30)
    for precision in ("8b", "full"):
        a = sage_patch.attention(q, k, v, is_causal=False, window_size=(4, 0), precision=precision)
        b = sage_patch.attention(q, k, v, is_causal=True, window_size=(4, 0), precision=precision)
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("sq,skv", [(24, 24), (9, 24), (24, 9)])
@pytest.mark.parametrize("with_mask", [False, True])
def test_sdpa_window_is_top_left(sq, skv, with_mask):
    """sdpa aligns the window as torch aligns is_causal (top-left); attn_mask, bool or float, applies too."""
    q, k, v = qkv(sq=sq, skv=skv)
    user = None
    dense = dense_window(sq, skv, 5, top_left=True)
    if with_mask:
        user = torch.rand(2, 1, sq, skv, generator=torch.Generator().manual_seed(3)) > 0.2
        dense = dense & user
    ref = exact_attention(q, k, v, attn_mask=dense)
    out = sage_patch.sdpa(q, k, v, attn_mask=user, enable_gqa=True, precision="full", window_size=(5, 0))
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    out8 = sage_patch.sdpa(q, k, v, attn_mask=user, enable_gqa=True, precision="8b", window_size=(5, 0))
    assert cosine(out8, ref) >= COS_8B
    if with_mask:  # a float additive mask: the window is added to it
        fm = torch.zeros(2, 1, sq, skv).masked_fill(~user, float("-inf"))
        out_f = sage_patch.sdpa(q, k, v, attn_mask=fm, enable_gqa=True, precision="full", window_size=(5, 0))
        torch.testing.assert_close(out_f.double(), ref, atol=1e-5, rtol=1e-5)


def test_window_reaches_the_resolver_and_stats_keep_their_shape(monkeypatch):
    seen = []
    real = sage_patch.api.resolve

    def spy(*args, **kwargs):
        seen.append(kwargs.get("window_left"))
        return real(*args, **kwargs)

    monkeypatch.setattr(sage_patch.api, "resolve", spy)
    q, k, v = qkv(sq=16, skv=16)
    sage_patch.attention(q, k, v, window_size=(3, 0))
    sage_patch.sdpa(q, k, v, enable_gqa=True, window_size=(3, 0))
    sage_patch.attention(q, k, v, is_causal=True)
    assert seen == [3, 3, -1]


def test_window_with_gradient_runs_full_with_a_reason():
    q, k, v = (t.requires_grad_() for t in qkv(sq=16, skv=16))
    out = sage_patch.attention(q, k, v, window_size=(3, 0))
    out.sum().backward()
    ref = exact_attention(q.detach(), k.detach(), v.detach(), attn_mask=dense_window(16, 16, 3))
    torch.testing.assert_close(out.detach().double(), ref, atol=1e-5, rtol=1e-5)
    assert q.grad is not None

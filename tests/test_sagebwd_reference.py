"""SageBwd reference simulation (8-bit trainable attention): forward and backward against float64 autograd of
exact attention on structured inputs, the paper's dO.V^T ablation, GQA, masks, empty rows, the smoothing identity."""

import math

import pytest
import torch

from sage_patch.accuracy import cosine
from sage_patch.masks import causal_mask
from sage_patch.reference import exact_attention
from sage_patch.reference.sagebwd import SageBwdConfig, sagebwd_backward, sagebwd_forward
from tests.conftest import structured_qkv


def _dout(q, dv=None, seed=7):
    shape = (*q.shape[:-1], q.shape[-1] if dv is None else dv)
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(q.dtype)


def _float64_grads(q, k, v, dout, **kw):
    """Output, LSE and gradients of exact attention in float64 (autograd)."""
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    out, lse = exact_attention(q64, k64, v64, return_lse=True, **kw)
    out.backward(dout.double())
    return out.detach(), lse, q64.grad, k64.grad, v64.grad


def _sagebwd(q, k, v, dout, config=None, **kw):
    out, lse, saved = sagebwd_forward(q, k, v, config=config, **kw)
    return (out, lse, *sagebwd_backward(dout, saved))


def _cosines(ours, ref):
    return {name: cosine(a, b) for name, a, b in zip(("O", "dQ", "dK", "dV"), (ours[0], *ours[2:]),
                                                      (ref[0], *ref[2:]))}


# Measured at N=1024, B=1, H=2, fp16, structured inputs (seed 1), dO seed 7, default 32 x 32 blocks (1 - cosine):
#   D=64:   O 3e-6  dQ 2.0e-3  dK 1.8e-3  dV 1.6e-3 | causal: O 5e-6 dQ 1.7e-3 dK 1.5e-3 dV 1.0e-3
#   D=128:  O 3e-6  dQ 1.9e-3  dK 1.8e-3  dV 1.8e-3 | causal: O 5e-6 dQ 1.7e-3 dK 2.0e-3 dV 1.2e-3
# (the masked, GQA and bf16 cases below: dQ, dK >= 0.99826, dV >= 0.99860, O >= 0.999991). The thresholds keep a
# small margin. The error grows with N, mostly from the one INT8 scale per tile of dS (dQ, dK) and of P (dV).
MIN_COS = {"O": 0.99998, "dQ": 0.9975, "dK": 0.9975, "dV": 0.9978}


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_vs_float64_on_structured_inputs(d, causal):
    q, k, v = structured_qkv(b=1, h=2, sq=1024, d=d, dtype=torch.float16, seed=1)
    dout = _dout(q)
    ours = _sagebwd(q, k, v, dout, is_causal=causal)
    ref = _float64_grads(q, k, v, dout, is_causal=causal)
    cos = _cosines(ours, ref)
    assert all(cos[n] >= MIN_COS[n] for n in MIN_COS), cos
    assert ours[0].dtype == ours[2].dtype == torch.float32 and ours[1].dtype == torch.float32
    torch.testing.assert_close(ours[1], ref[1].float(), atol=0.15, rtol=0)  # INT8 S moves the LSE directly
    assert (ours[1] - ref[1]).abs().mean() < 0.03


# The paper's numerics (Algorithms 2 and 3): one scale per 32 x 32 block, INT8 P~ V in the forward.
PAPER = SageBwdConfig(groups="block", block_q=32, block_k=32, pv="int8")


def test_gradients_at_4k_reach_the_issue_target():
    """The issue's target: dQ, dK, dV cosine >= 0.998 against float64 at N=4K (D=64, not causal) with the default
    (the kernels') numerics; the paper's 32 x 32 blocks reach >= 0.997 (measured dQ 0.99716, dK 0.99860, dV 0.99844)."""
    q, k, v = structured_qkv(b=1, h=2, sq=4096, d=64, dtype=torch.float16, seed=1)
    dout = _dout(q)
    ref = _float64_grads(q, k, v, dout)
    cos = _cosines(_sagebwd(q, k, v, dout), ref)
    assert cos["O"] >= MIN_COS["O"] and all(cos[n] >= 0.998 for n in ("dQ", "dK", "dV")), cos
    paper = _cosines(_sagebwd(q, k, v, dout, config=PAPER), ref)
    assert all(paper[n] >= 0.997 for n in ("dQ", "dK", "dV")), paper
    assert all(cos[n] > paper[n] for n in ("dQ", "dK", "dV")), (cos, paper)


def test_bf16_inputs():
    q, k, v = structured_qkv(b=1, h=2, sq=256, d=64, dtype=torch.bfloat16, seed=2)
    dout = _dout(q)
    cos = _cosines(_sagebwd(q, k, v, dout), _float64_grads(q, k, v, dout))
    assert all(cos[n] >= MIN_COS[n] for n in MIN_COS), cos


def test_ablation_int8_dp_loses_dq_accuracy_growing_with_n():
    """The paper's ablation: dP = dO V^T in INT8 instead of FP16 makes dQ less accurate, more so at larger N."""
    gaps = {}
    for n in (256, 1024):
        q, k, v = structured_qkv(b=1, h=2, sq=n, d=64, dtype=torch.float16, seed=1)
        dout = _dout(q)
        ref_dq = _float64_grads(q, k, v, dout)[2]
        fp16 = cosine(_sagebwd(q, k, v, dout, config=PAPER)[2], ref_dq)
        int8 = cosine(_sagebwd(q, k, v, dout, config=SageBwdConfig(groups="block", block_q=32, block_k=32,
                                                                     pv="int8", dp="int8"))[2], ref_dq)
        assert fp16 > int8, (n, fp16, int8)
        gaps[n] = fp16 - int8
    # measured: gap 1.3e-3 at N=256, 3.3e-3 at N=1024 (6.5e-3 at N=4096)
    assert gaps[1024] > 1.5 * gaps[256], gaps


def test_smoothing_k_makes_gradients_more_accurate():
    q, k, v = structured_qkv(b=1, h=2, sq=256, d=64, dtype=torch.float16, seed=3)
    dout = _dout(q)
    ref = _float64_grads(q, k, v, dout)
    smooth = _cosines(_sagebwd(q, k, v, dout), ref)
    plain = _cosines(_sagebwd(q, k, v, dout, config=SageBwdConfig(smooth_k=False)), ref)
    assert smooth["dQ"] > plain["dQ"] and smooth["dK"] > plain["dK"], (smooth, plain)


def test_smoothing_gradient_identity_in_float64():
    """Why the simulation returns the gradient against the smoothed K with no extra term: with the mean attached
    (a function of K), autograd gives the same dK as without smoothing, because every row of dS sums to zero, so
    the token-sum of dK is zero."""
    q, k, v = structured_qkv(b=1, h=2, sq=64, skv=96, d=16, dtype=torch.float64, seed=4)
    dout = _dout(q)
    grads = []
    for smooth in (False, True):
        kk = k.clone().requires_grad_()
        ks = kk - kk.mean(dim=-2, keepdim=True) if smooth else kk
        exact_attention(q, ks, v, is_causal=True).backward(dout)
        grads.append(kk.grad)
    torch.testing.assert_close(grads[1], grads[0], atol=1e-12, rtol=1e-10)
    assert grads[0].sum(dim=-2).abs().max() < 1e-10 * grads[0].abs().max()
    # dS row sums in closed form: sum_j P_ij (dP_ij - D_i) with D_i = dO_i . O_i
    s = (q @ k.transpose(-1, -2)) / math.sqrt(16)
    s = s.masked_fill(~causal_mask(64, 96), -math.inf)
    p = torch.softmax(s, dim=-1)
    o = p @ v
    ds = p * (dout @ v.transpose(-1, -2) - (dout * o).sum(-1, keepdim=True))
    assert ds.sum(-1).abs().max() < 1e-12 * ds.abs().max()


def test_gqa_reduction_equals_repeated_kv_summed(one_thread):
    q, k, v = structured_qkv(b=2, h=6, hkv=2, sq=160, d=32, dtype=torch.float16, seed=5)
    dout = _dout(q)
    gqa = _sagebwd(q, k, v, dout, is_causal=True)
    rep = _sagebwd(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), dout, is_causal=True)
    for a, b in zip(gqa[:3], rep[:3]):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    for a, b in zip(gqa[3:], rep[3:]):
        assert a.shape == (2, 2, 160, 32)
        torch.testing.assert_close(a, b.reshape(2, 2, 3, 160, 32).sum(2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sq,skv", [(96, 300), (300, 200)])
def test_causal_bottom_right_with_unequal_lengths(sq, skv, one_thread):
    q, k, v = structured_qkv(b=1, h=2, sq=sq, skv=skv, d=64, dtype=torch.float16, seed=6)
    dout = _dout(q)
    ours = _sagebwd(q, k, v, dout, is_causal=True)
    # the same rule given as a dense mask gives the same numbers
    dense = _sagebwd(q, k, v, dout, attn_mask=causal_mask(sq, skv)[None, None])
    for a, b in zip(ours, dense):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    ref = _float64_grads(q, k, v, dout, is_causal=True)
    nonempty = torch.isfinite(ref[1])
    empty_rows = ~nonempty[0, 0]
    assert int(empty_rows.sum()) == max(0, sq - skv)  # query i sees keys j <= i + skv - sq
    assert all(torch.isfinite(t).all() for t in (ours[0], *ours[2:]))
    assert (ours[0][..., empty_rows, :] == 0).all() and (ours[2][..., empty_rows, :] == 0).all()
    assert torch.isneginf(ours[1][..., empty_rows]).all()
    # float64 autograd gives NaN through an empty row's -inf LSE: compare the non-empty rows' gradients
    if sq > skv:
        ref = _float64_grads(q[..., ~empty_rows, :], k, v, dout[..., ~empty_rows, :], is_causal=True)
        ours = (ours[0][..., ~empty_rows, :], ours[1], ours[2][..., ~empty_rows, :], *ours[3:])
    cos = _cosines(ours, ref)
    assert all(cos[n] >= MIN_COS[n] for n in MIN_COS), cos


def test_key_padding_and_dense_masks():
    q, k, v = structured_qkv(b=2, h=2, sq=128, skv=200, d=64, dtype=torch.float16, seed=8)
    dout = _dout(q)
    kp = torch.ones(2, 200, dtype=torch.bool)
    kp[1, 130:] = False
    ours = _sagebwd(q, k, v, dout, attn_mask=kp)
    cos = _cosines(ours, _float64_grads(q, k, v, dout, attn_mask=kp))
    assert all(cos[n] >= MIN_COS[n] for n in MIN_COS), cos
    assert (ours[3][1, :, 130:] == 0).all() and (ours[4][1, :, 130:] == 0).all()  # padded keys get no gradient
    dense = torch.rand(1, 2, 128, 200, generator=torch.Generator().manual_seed(0)) > 0.5
    ours = _sagebwd(q, k, v, dout, attn_mask=dense, is_causal=True)
    cos = _cosines(ours, _float64_grads(q, k, v, dout, attn_mask=dense, is_causal=True))
    assert all(cos[n] >= MIN_COS[n] for n in MIN_COS), cos


def test_empty_rows_give_zeros_and_no_nan(one_thread):
    q, k, v = structured_qkv(b=3, h=2, sq=100, skv=150, d=64, dtype=torch.float16, seed=9)
    dout = _dout(q)
    kp = torch.ones(3, 150, dtype=torch.bool)
    kp[2] = False  # a batch entry with no visible key at all
    mask = kp[:, None, None, :] & torch.ones(1, 1, 100, 1, dtype=torch.bool)
    mask[0, :, 7] = False  # and one empty query row in another
    out, lse, dq, dk, dv = _sagebwd(q, k, v, dout, attn_mask=mask)
    assert all(torch.isfinite(t).all() for t in (out, dq, dk, dv))
    assert (out[2] == 0).all() and (dq[2] == 0).all() and (dk[2] == 0).all() and (dv[2] == 0).all()
    assert (out[0, :, 7] == 0).all() and (dq[0, :, 7] == 0).all()
    assert torch.isneginf(lse[2]).all() and torch.isneginf(lse[0, :, 7]).all() and torch.isfinite(lse[:2, :, 8]).all()
    # the other rows are as without the empty ones
    alone = _sagebwd(q[:2], k[:2], v[:2], dout[:2], attn_mask=mask[:2])
    for a, b in zip((out, dq, dk, dv), (alone[0], *alone[2:])):
        torch.testing.assert_close(a[:2], b, atol=0, rtol=0)


def test_inputs_are_never_modified():
    q, k, v = structured_qkv(b=1, h=4, hkv=2, sq=130, d=64, dtype=torch.float16, seed=10)
    dout = _dout(q)
    mask = torch.rand(1, 130) > 0.2
    copies = [t.clone() for t in (q, k, v, dout, mask)]
    _sagebwd(q, k, v, dout, attn_mask=mask, is_causal=True)
    for a, b in zip((q, k, v, dout, mask), copies):
        assert torch.equal(a, b)


def test_saved_state_is_int8_and_the_lse_shift_is_added_back():
    q, k, v = structured_qkv(b=1, h=2, sq=200, d=64, dtype=torch.float16, seed=11)
    out, lse, saved = sagebwd_forward(q, k, v, config=SageBwdConfig(groups="block", block_q=64, block_k=32))
    assert saved.q_int.dtype == saved.k_int.dtype == torch.int8
    assert saved.q_int.abs().max() <= 127 and saved.k_int.abs().max() <= 127
    assert saved.q_scale.shape == (1, 2, 4) and saved.k_scale.shape == (1, 2, 7)  # one scale per block
    _, _, tok = sagebwd_forward(q, k, v)
    assert tok.q_scale.shape == tok.k_scale.shape == (1, 2, 200)  # token groups: one per token
    assert tok.q_int.abs().amax(-1).eq(127).all()
    assert saved.out.dtype == torch.float16 and saved.v is v
    # the saved LSE is the smoothed scores'; the caller's adds back tau q . mean(K)
    shift = (q.float() @ k.float().mean(-2, keepdim=True).transpose(-1, -2)).squeeze(-1) / 8.0
    torch.testing.assert_close(lse, saved.lse + shift)


def test_smaller_tiles_are_more_accurate_and_unit_p_scale_is_coarser():
    """The paper's block groups: smaller blocks are more accurate; 16-bit P~ V (the default) beats every INT8 one."""
    q, k, v = structured_qkv(b=1, h=2, sq=512, d=64, dtype=torch.float16, seed=12)
    dout = _dout(q)
    ref = _float64_grads(q, k, v, dout)

    def err(cfg=None):
        return {n: 1 - c for n, c in _cosines(_sagebwd(q, k, v, dout, config=cfg), ref).items()}

    def block(n, **kw):
        return SageBwdConfig(groups="block", block_q=n, block_k=n, pv="int8", **kw)

    default, mid, large = err(block(32)), err(block(64)), err(block(128))
    assert SageBwdConfig() == SageBwdConfig(groups="token", block_q=64, block_k=64, pv="input")
    token = err()
    assert all(token[n] < default[n] for n in ("O", "dQ", "dK", "dV")), (token, default)
    # measured (1 - cos of dQ): 2.5e-3 at 32x32 (the default), 5.5e-3 at 64x64, 1.3e-2 at 128x128
    assert default["dQ"] < mid["dQ"] < large["dQ"] and default["dK"] < mid["dK"] < large["dK"], (default, mid, large)
    # P~ scaled by 1/127 instead of its row maximum in the block (which the online softmax has): O 9x worse, and
    # dQ through D = rowsum(dO o O) (measured 1 - cos: O 4.7e-5 vs 5e-6, dQ 1.5e-2 vs 2.5e-3)
    unit = err(block(32, p_scale="unit"))
    assert unit["O"] > 3 * default["O"] and unit["dQ"] > 2 * default["dQ"], (unit, default)


@pytest.mark.parametrize("kw,msg", [({"block_q": 0}, "block_q"), ({"block_k": 1.5}, "block_k"),
                                    ({"dp": "fp8"}, "dp"), ({"p_scale": "token"}, "p_scale"), ({"pv": "fp8"}, "pv"),
                                    ({"groups": "tile"}, "groups"), ({"dp": "int8"}, "groups='block'")])
def test_config_validation(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SageBwdConfig(**kw)


def test_tile_quantization_has_one_scale_per_tile():
    from sage_patch.reference import quantize_int_tiles

    x = torch.randn(2, 3, 70, 50, generator=torch.Generator().manual_seed(13))
    q, s = quantize_int_tiles(x, 32, 16, 127)
    assert q.shape == x.shape and s.shape == (2, 3, 3, 4)
    for ti, tj in ((0, 0), (2, 3), (1, 2)):  # including the ragged last tiles
        tile = x[..., ti * 32:(ti + 1) * 32, tj * 16:(tj + 1) * 16]
        torch.testing.assert_close(s[..., ti, tj], tile.abs().amax(dim=(-2, -1)) / 127, rtol=0, atol=0)
        qt = q[..., ti * 32:(ti + 1) * 32, tj * 16:(tj + 1) * 16]
        assert torch.equal(qt, torch.round(tile / s[..., ti, tj, None, None]).clamp(-127, 127))

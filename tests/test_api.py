"""Public API: attention, sdpa, sageattn: semantics, layouts, dtypes, fallbacks and argument errors."""
import logging

import pytest
import torch

import sage_patch
from sage_patch.accuracy import cosine
from sage_patch.reference import exact_attention, simulate
from sage_patch.report import GLOBAL_STATS
from tests.conftest import structured_qkv


def test_reference_path_equals_simulation_and_is_reported():
    q, k, v = structured_qkv(sq=130, d=64, seed=1)
    GLOBAL_STATS.reset()
    out = sage_patch.attention(q, k, v, precision="8b")
    assert torch.equal(out, simulate(q, k, v, "8b"))
    d = sage_patch.report().to_dict()["<direct calls>"]
    assert d["calls"] == 1 and d["used"] == {"8b": 1} and d["impl"] == {"reference": 1}
    assert any("reference simulation" in r for r in d["fallbacks"])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("precision", ["8b", "4b", "fp4", "full"])
def test_dtypes_and_layouts(dtype, precision):
    q, k, v = structured_qkv(b=2, h=4, hkv=2, sq=70, skv=90, d=64, dtype=dtype, seed=2)
    out = sage_patch.attention(q, k, v, precision=precision, is_causal=True)
    assert out.dtype == dtype and out.shape == q.shape
    out_bshd = sage_patch.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), layout="bshd",
                                    precision=precision, is_causal=True)
    assert out_bshd.shape == q.transpose(1, 2).shape
    torch.testing.assert_close(out_bshd.transpose(1, 2), out, rtol=0, atol=0)
    ref = exact_attention(q, k, v, is_causal=True)
    assert cosine(out, ref) >= (0.999 if precision in ("8b", "full") else 0.99)


def test_return_lse_shapes_and_values():
    q, k, v = structured_qkv(b=2, h=4, sq=33, skv=80, d=64, seed=3)
    _, ref_lse = exact_attention(q, k, v, is_causal=True, return_lse=True)
    for p in ("8b", "full"):
        out, lse = sage_patch.attention(q, k, v, precision=p, is_causal=True, return_lse=True)
        assert lse.shape == (2, 4, 33) and lse.dtype == torch.float32
        torch.testing.assert_close(lse, ref_lse, atol=0.1, rtol=0)


def test_full_causal_is_bottom_right_and_empty_rows_are_zero():
    q, k, v = structured_qkv(b=1, h=2, sq=20, skv=8, d=16, seed=4)
    out = sage_patch.attention(q, k, v, precision="full", is_causal=True)
    # with Sq > Skv the first Sq - Skv queries see no key
    assert (out[..., :12, :] == 0).all() and torch.isfinite(out).all()
    ref = exact_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("precision", ["8b", "full"])
def test_key_padding_mask_shapes_and_fully_masked_batch(precision):
    q, k, v = structured_qkv(b=2, h=2, sq=40, skv=50, d=32, seed=5)
    kp = torch.ones(2, 50, dtype=torch.bool)
    kp[1] = False
    for mask in (kp, kp[:, None, None, :]):
        out = sage_patch.attention(q, k, v, precision=precision, attn_mask=mask)
        assert torch.isfinite(out).all() and (out[1] == 0).all()
        assert cosine(out[0], exact_attention(q, k, v, attn_mask=kp)[0]) >= 0.9995


def test_float_additive_mask_runs_full_with_reason(caplog):
    q, k, v = structured_qkv(b=1, h=2, sq=16, skv=24, d=16, seed=6)
    fmask = torch.zeros(1, 1, 16, 24)
    fmask[..., 5:] = -1e4
    GLOBAL_STATS.reset()
    with caplog.at_level(logging.WARNING, logger="sage_patch"):
        out = sage_patch.attention(q, k, v, precision="8b", attn_mask=fmask)
    assert GLOBAL_STATS.used == {"full": 1}
    assert any("float additive" in r for r in GLOBAL_STATS.fallbacks)
    torch.testing.assert_close(out.double(), exact_attention(q, k, v, attn_mask=fmask), atol=1e-5, rtol=1e-5)


def test_autograd_runs_the_trainable_8b_on_cpu_and_backward_works():
    q, k, v = (t.requires_grad_() for t in structured_qkv(b=1, h=2, sq=16, d=16, seed=7))
    GLOBAL_STATS.reset()
    out = sage_patch.attention(q, k, v, precision="8b")
    out.sum().backward()
    assert q.grad is not None and GLOBAL_STATS.used == {"8b": 1} and GLOBAL_STATS.impls == {"reference-sagebwd": 1}
    with torch.no_grad():
        sage_patch.attention(q, k, v, precision="8b")
    assert GLOBAL_STATS.impls["reference"] == 1


def test_never_writes_inputs():
    q, k, v = structured_qkv(b=1, h=2, sq=64, d=32, seed=8)
    mask = torch.ones(1, 64, dtype=torch.bool)
    copies = [t.clone() for t in (q, k, v, mask)]
    for p in ("8b", "4b", "fp4", "full"):
        sage_patch.attention(q, k, v, precision=p, attn_mask=mask, smooth_v=True, return_lse=True)
    for a, b in zip((q, k, v, mask), copies):
        assert torch.equal(a, b)


def test_sdpa_drop_in_matches_torch_semantics():
    q, k, v = structured_qkv(b=2, h=4, sq=24, skv=40, d=32, seed=9)
    f = torch.nn.functional.scaled_dot_product_attention
    # full precision is torch itself, including the top-left is_causal and 2-D (Sq, Skv) masks
    torch.testing.assert_close(sage_patch.sdpa(q, k, v, is_causal=True, precision="full"),
                               f(q, k, v, is_causal=True))
    m2 = torch.rand(24, 40, generator=torch.Generator().manual_seed(1)) > 0.2
    torch.testing.assert_close(sage_patch.sdpa(q, k, v, attn_mask=m2, precision="full"), f(q, k, v, attn_mask=m2))
    out = sage_patch.sdpa(q, k, v, attn_mask=m2, scale=0.1)
    assert cosine(out, f(q, k, v, attn_mask=m2, scale=0.1)) >= 0.9995
    kh, vh = k[:, :2], v[:, :2]
    with pytest.raises(ValueError, match="enable_gqa"):
        sage_patch.sdpa(q, kh, vh)
    assert cosine(sage_patch.sdpa(q, kh, vh, enable_gqa=True), f(q, kh, vh, enable_gqa=True)) >= 0.9995
    GLOBAL_STATS.reset()
    sage_patch.sdpa(q, k, v, dropout_p=0.5)
    assert GLOBAL_STATS.used == {"full": 1} and any("dropout" in r for r in GLOBAL_STATS.fallbacks)
    with pytest.raises(ValueError, match="either attn_mask or is_causal"):
        sage_patch.sdpa(q, k, v, attn_mask=m2, is_causal=True)


def test_sageattn_signature():
    q, k, v = structured_qkv(b=1, h=2, sq=64, d=64, seed=10)
    out = sage_patch.sageattn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), tensor_layout="NHD",
                              is_causal=True, sm_scale=0.2)
    ref = exact_attention(q, k, v, is_causal=True, scale=0.2)
    assert cosine(out.transpose(1, 2), ref) >= 0.9995
    o, lse = sage_patch.sageattn(q, k, v, return_lse=True)
    assert lse.shape == (1, 2, 64)
    with pytest.raises(TypeError):
        sage_patch.sageattn(q, k, v, dropout_p=0.1)  # never silently dropped
    with pytest.raises(ValueError, match="tensor_layout"):
        sage_patch.sageattn(q, k, v, tensor_layout="BHSD")


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(layout="sbhd"), ValueError, "layout"),
    (dict(precision="int8"), ValueError, "precision"),
    (dict(scale=float("nan")), ValueError, "scale"),
    (dict(is_causal=1), TypeError, "is_causal"),
    (dict(attn_mask=torch.ones(2, 5, dtype=torch.bool)), ValueError, "attn_mask"),
    (dict(attn_mask=torch.ones(2, 2, 16, 16, dtype=torch.int32)), TypeError, "attn_mask"),
    (dict(attn_mask=torch.ones(3, 1, 16, 16, dtype=torch.bool)), ValueError, "attn_mask"),
])
def test_bad_arguments_raise_clear_errors(kwargs, exc, match):
    q, k, v = structured_qkv(b=2, h=2, sq=16, d=16, seed=11)
    with pytest.raises(exc, match=match):
        sage_patch.attention(q, k, v, **kwargs)


def test_bad_tensors_raise_clear_errors():
    q, k, v = structured_qkv(b=2, h=4, sq=16, d=16, seed=12)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        sage_patch.attention(q, k[:, :3], v[:, :3])
    with pytest.raises(TypeError, match="share one dtype"):
        sage_patch.attention(q, k.half(), v)
    with pytest.raises(TypeError, match="dtype must be"):
        sage_patch.attention(q.double(), k.double(), v.double())
    with pytest.raises(ValueError, match="4-D"):
        sage_patch.attention(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="head dim"):
        big = torch.randn(1, 1, 4, 300)
        sage_patch.attention(big, big, big)
    with pytest.raises(ValueError, match="head dims differ"):
        sage_patch.attention(q, k[..., :8], v)
    with pytest.raises(ValueError, match="sequence lengths"):
        sage_patch.attention(q[:, :, :0], k, v)


def test_torch_compile_fullgraph_reference_path():
    q, k, v = structured_qkv(b=1, h=2, sq=128, d=64, seed=13)

    def f(q, k, v):
        return sage_patch.attention(q, k, v, precision="8b", is_causal=True)

    with torch.no_grad():
        compiled = torch.compile(f, fullgraph=True)(q, k, v)
        torch.testing.assert_close(compiled, f(q, k, v), atol=1e-5, rtol=1e-5)


def test_speed_routing_rule(monkeypatch):
    """Below the measured crossover the Hopper kernel's whole call is slower than SDPA: the rule says so (with the
    threshold and this call's length), only for that kernel, on min(Sq, Skv), per layout; the switch turns it off."""
    import sage_patch.kernels as K

    monkeypatch.setattr(K, "SPEED_ROUTING", True)
    WGMMA = K.registry.get("wgmma-fp8")

    def reason(variant, q, k, layout, is_causal):
        return K.sdpa_faster_reason(variant, q, k, layout=layout, is_causal=is_causal, cc=(9, 0))

    def shapes(sq, skv, d, layout="bhsd"):
        mk = (lambda s: torch.empty(1, 2, s, d)) if layout == "bhsd" else (lambda s: torch.empty(1, s, 2, d))
        return mk(sq), mk(skv)

    q, k = shapes(1024, 1024, 128)
    why = reason(WGMMA, q, k, "bhsd", False)
    assert why and "2048" in why and "1024" in why
    q, k = shapes(4096, 4096, 128)
    assert reason(WGMMA, q, k, "bhsd", False) is None
    assert reason(WGMMA, q, k, "bhsd", True) is None
    q, k = shapes(2560, 2560, 64)
    assert reason(WGMMA, q, k, "bhsd", True)  # D=64 causal: from 3072
    assert reason(WGMMA, q, k, "bhsd", False) is None
    q, k = shapes(3072, 3072, 64)
    assert reason(WGMMA, q, k, "bhsd", True) is None
    q, k = shapes(8192, 1024, 128, layout="bshd")  # the shorter side decides; BSHD reads dim 1
    assert "1024" in reason(WGMMA, q, k, "bshd", False)
    q, k = shapes(1024, 1024, 128)
    mma = K.registry.get("mma-fp8f16")
    assert "every measured length on sm_90" in reason(mma, q, k, "bhsd", False)  # portable on Hopper: never faster
    assert K.sdpa_faster_reason(mma, q, k, layout="bhsd", is_causal=False, cc=(8, 9)) is None  # no crossover: kept
    monkeypatch.setattr(K, "SPEED_ROUTING", False)
    assert K.sdpa_faster_reason(WGMMA, q, k, layout="bhsd", is_causal=False) is None


def test_key_padding_of_dense_reads_each_mask_once_and_never_keeps_a_wrong_answer(monkeypatch):
    from sage_patch import masks

    b, s = 2, 6
    keys = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    agree = keys[:, None, None, :].expand(b, 1, s, s).clone()
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(1) or tolist(t))
    kp = masks.key_padding_of_dense(agree)
    assert kp.shape == (b, 1, 1, s) and torch.equal(kp[:, 0, 0], keys)
    assert masks.key_padding_of_dense(agree) is not agree and len(reads) == 1   # the second layer: memo, no read
    assert masks.key_padding_of_dense(torch.ones(b, 1, s, s, dtype=torch.bool)) is None
    agree[1, 0, 3, 0] = False                      # modified in place: rows now differ, read again
    assert masks.key_padding_of_dense(agree) is agree and len(reads) == 3
    causal = torch.ones(s, s, dtype=torch.bool).tril()[None, None]
    assert masks.key_padding_of_dense(causal) is causal
    for other in (agree.float(), agree[:, :, :1], agree.expand(b, 3, s, s), keys):   # not a (B, 1, Sq>1, Skv) bool
        assert masks.key_padding_of_dense(other) is other


def test_autocast_runs_in_the_autocast_dtype_like_torch_sdpa():
    """Under bf16 autocast a Llama hands fp32 q/k (after RoPE) beside a bf16 v: torch's SDPA casts all three to the
    autocast dtype, and so does sage_patch (it raised on the mixed dtypes before)."""
    torch.manual_seed(0)
    q, k = torch.randn(1, 2, 64, 32), torch.randn(1, 2, 64, 32)
    v = torch.randn(1, 2, 64, 32).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = sage_patch.attention(q, k, v, is_causal=True, precision="full")
        out8 = sage_patch.attention(q, k, v, is_causal=True, precision="8b")
    assert out.dtype == ref.dtype == out8.dtype == torch.bfloat16
    assert torch.allclose(out.float(), ref.float(), atol=2e-2) and cosine(out8.float(), ref.float()) > 0.99
    with pytest.raises(TypeError, match="share one dtype"):   # outside autocast: as before
        sage_patch.attention(q, k, v)

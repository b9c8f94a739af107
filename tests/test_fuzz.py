"""The fuzzed grid on CPU (a few hundred fixed-seed calls vs float64) and the non-finite input rules."""
import logging
import math

import pytest
import torch

import sage_patch
from sage_patch.report import GLOBAL_STATS
from attention_fuzz import NONFINITE_WHERE, check_case, check_nonfinite_training, draw_case, run_grid

CPU_CASES = 250


@pytest.fixture(autouse=True)
def _quiet():
    logging.getLogger("sage_patch").setLevel(logging.ERROR)
    yield
    logging.getLogger("sage_patch").setLevel(logging.NOTSET)


def test_fuzz_grid_cpu():
    kinds, failures, infos = run_grid(range(CPU_CASES), budget=1.5e6)
    detail = "\n".join(f"{kind}: {msg} | {c}" for c, kind, msg in failures[:20])
    assert not failures, f"failures by kind {dict(kinds)}:\n{detail}"
    # the grid really spans the space it claims to
    cases = [c for c, _ in infos]
    assert {c.precision for c in cases} == {"8b", "4b", "fp4", "full"}
    assert {c.api for c in cases} == {"attention", "sdpa", "varlen"}
    assert {c.mask for c in cases} == {"none", "key_padding", "key_padding_4d", "dense", "float"}
    assert {c.dtype for c in cases} == {torch.float16, torch.bfloat16, torch.float32}
    assert any(c.hq != c.hkv for c in cases) and any(c.sq != c.skv for c in cases)
    assert any(c.d not in (64, 128) for c in cases) and any(c.dv != c.d for c in cases)
    assert any(c.causal for c in cases) and any(c.lse for c in cases) and any(c.noncontig for c in cases)
    assert max(max(c.sq, c.skv) for c in cases) > 2000 and min(min(c.sq, c.skv) for c in cases) == 1
    windowed = [c for c in cases if c.window >= 0]
    assert {c.api for c in windowed} == {"attention", "sdpa"} and any(c.window < max(c.sq, c.skv) for c in windowed)


def test_fuzz_checker_catches_a_wrong_answer(monkeypatch):
    """The grid's checks can fail: a full-precision path that ignores the mask is reported as inaccurate."""
    import sage_patch.api as api

    real = api.full_attention
    monkeypatch.setattr(api, "full_attention", lambda q, k, v, *, mask, **kw: real(
        q, k, v, mask=type(mask)("none", None), **kw))
    seed = next(s for s in range(1000) if (lambda c: c.precision == "full" and c.mask == "dense"
                                          and c.api == "attention")(draw_case(s)))
    fails, _ = check_case(draw_case(seed))
    assert {kind for kind, _ in fails} & {"accuracy", "empty_row"}


def test_fuzz_checker_catches_an_ignored_window(monkeypatch):
    """... and a full-precision path that drops the sliding window too."""
    import sage_patch.api as api

    real = api.full_attention
    monkeypatch.setattr(api, "full_attention", lambda q, k, v, **kw: real(q, k, v, **{**kw, "window_left": -1}))
    seed = next(s for s in range(2000) if (lambda c: c.precision == "full" and c.api == "attention"
                                          and 0 <= c.window < min(c.sq, c.skv) // 2)(draw_case(s)))
    fails, _ = check_case(draw_case(seed))
    assert "accuracy" in {kind for kind, _ in fails}


# ---- non-finite inputs --------------------------------------------------------------------------------------

def _qkv(seed=0, b=2, hq=4, hkv=2, s=96, d=64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, hq, s, d, generator=g), torch.randn(b, hkv, s, d, generator=g) + 2.0,
            torch.randn(b, hkv, s, d, generator=g) + 2.0)


@pytest.mark.parametrize("precision", ["8b", "4b", "fp4"])
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("causal", [False, True])
def test_nonfinite_input_poisons_every_row_it_reaches(precision, where, bad, causal):
    """Quantized precisions: a NaN/Inf reaches the quantization statistics it belongs to, which become NaN, so
    every output row the value reaches is non-finite (never finite values from a silently zeroed scale); rows of
    other (batch, KV-head) groups are untouched."""
    q, k, v = _qkv()
    clean = sage_patch.attention(q, k, v, is_causal=causal, precision=precision)
    t = {"q": q.clone(), "k": k.clone(), "v": v.clone()}
    row = 40
    t[where][0, 0, row, 5] = bad
    out = sage_patch.attention(t["q"], t["k"], t["v"], is_causal=causal, precision=precision)
    bad_rows = (~torch.isfinite(out)).any(-1)
    if where == "q":
        assert bad_rows[0, 0, row]
    else:  # key `row` is seen by every row of the query heads of KV head 0 (causal: rows >= row)
        reached = torch.arange(q.shape[2]) >= (row if causal else 0)
        assert bad_rows[0, :2][:, reached].all()
    # other KV-head groups (query heads 2, 3) and the other batch entry: exactly the clean output
    assert torch.equal(out[0, 2:], clean[0, 2:]) and torch.equal(out[1], clean[1])


@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_full_precision_is_torch(where, bad):
    """full is torch SDPA: the same IEEE arithmetic (a key scored -inf has weight 0), so the same rows are
    non-finite as torch's own math backend gives."""
    q, k, v = _qkv()
    t = {"q": q.clone(), "k": k.clone(), "v": v.clone()}
    t[where][0, 0, 40, 5] = bad
    out = sage_patch.attention(t["q"], t["k"], t["v"], precision="full")
    ref = torch.nn.functional.scaled_dot_product_attention(t["q"], t["k"], t["v"], enable_gqa=True)
    assert torch.equal(torch.isfinite(out), torch.isfinite(ref))
    assert (~torch.isfinite(out)).any()


def test_nonfinite_lse_and_varlen():
    q, k, v = _qkv()
    q[0, 1, 7, 0] = math.nan
    for precision in ("8b", "full"):
        out, lse = sage_patch.attention(q, k, v, precision=precision, return_lse=True)
        assert not math.isfinite(lse[0, 1, 7]) and not torch.isfinite(out[0, 1, 7]).all()
        assert torch.isfinite(lse[1]).all()
    qp, kp, vp = (x[0].transpose(0, 1).contiguous() for x in (q, k, v))  # one packed sequence of batch entry 0
    cu = torch.tensor([0, qp.shape[0]], dtype=torch.int32)
    out = sage_patch.varlen_attention(qp, kp, vp, cu, cu, precision="8b")
    assert not torch.isfinite(out[7, 1]).all()


def test_full_lse_crash_and_one_pass():
    """Ring attention's call: head dim 96 (full), GQA 7:1, key padding, LSE, more than one query block."""
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(1, 7, 2048, 96, generator=g), torch.randn(1, 1, 1500, 96, generator=g), \
        torch.randn(1, 1, 1500, 96, generator=g)
    mask = torch.rand(1, 1500, generator=g) < 0.7
    out, lse = sage_patch.attention(q, k, v, attn_mask=mask, return_lse=True, precision="full")
    ref, ref_lse = sage_patch.reference.exact_attention(q, k, v, attn_mask=mask, return_lse=True)
    assert (out.double() - ref).abs().max() < 1e-5 and (lse.double() - ref_lse).abs().max() < 1e-5


def test_full_lse_is_one_pass(monkeypatch):
    """The full path's LSE comes from the fused kernel's own pass: no second exact attention runs."""
    import sage_patch.reference.exact as exact

    monkeypatch.setattr(exact, "exact_attention", lambda *a, **k: pytest.fail("a second attention pass ran"))
    q, k, v = _qkv()
    out, lse = sage_patch.attention(q, k, v, precision="full", return_lse=True, is_causal=True)
    assert lse.shape == (2, 4, 96) and torch.isfinite(lse).all()


@pytest.mark.parametrize("call, match", [
    (lambda q: sage_patch.attention(q, q[:, :0], q[:, :0]), r"head counts must be >= 1.*k/v heads 0"),
    (lambda q: sage_patch.sdpa(q, q, q, attn_mask=torch.ones(2, 7, dtype=torch.bool)),
     r"attn_mask of shape \(2, 7\) does not broadcast .*\(2, 4, 8, 8\).*mask\[:, None, None, :\]"),
    (lambda q: sage_patch.varlen_attention(q[0], q[0], q[0, :3], torch.tensor([0, 4], dtype=torch.int32),
                                           torch.tensor([0, 4], dtype=torch.int32)),
     r"k and v must have the same tokens and heads"),
])
def test_errors_name_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call(torch.randn(2, 4, 8, 16))


def test_varlen_value_head_dim_may_differ():
    q, k, v = torch.randn(10, 4, 32), torch.randn(12, 2, 32), torch.randn(12, 2, 48)
    cu_q, cu_k = torch.tensor([0, 4, 10], dtype=torch.int32), torch.tensor([0, 5, 12], dtype=torch.int32)
    out = sage_patch.varlen_attention(q, k, v, cu_q, cu_k, precision="full")
    ref = sage_patch.attention(q[None, 4:], k[None, 5:], v[None, 5:], layout="bshd", precision="full")
    assert out.shape == (10, 4, 48) and torch.allclose(out[4:], ref[0], atol=1e-6)


# ---- non-finite values in training: the trainable 8b on CPU (reference-sagebwd, through autograd) ------------

def _train_8b(q, k, v, dout, mask, causal, config=None):
    from sage_patch.trainable import sagebwd_attention

    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    GLOBAL_STATS.reset()
    if config is None:
        out = sage_patch.attention(qg, kg, vg, is_causal=causal, attn_mask=mask, precision="8b")
        assert dict(GLOBAL_STATS.impls) == {"reference-sagebwd": 1}, dict(GLOBAL_STATS.impls)
    else:
        out = sagebwd_attention(qg, kg, vg, is_causal=causal, scale=None, attn_mask=mask, config=config, kernel=False)
    out.backward(dout)
    return out, qg.grad, kg.grad, vg.grad


@pytest.mark.parametrize("where", NONFINITE_WHERE)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("causal, key_padding", [(True, False), (False, True)])
def test_nonfinite_training_poisons_what_it_reaches(where, bad, causal, key_padding):
    """A NaN/Inf in q, k, v or the upstream gradient poisons every output and gradient row it reaches (fp16
    GradScaler skips a step on a non-finite gradient: a swallowed NaN would be a silent wrong step), leaves other
    batch entries and heads bitwise unchanged, and rows with no visible key (causal Sq > Skv; a fully padded batch
    entry) stay 0."""
    fails = check_nonfinite_training(_train_8b, where, bad, causal=causal, key_padding=key_padding,
                                     dtype=torch.bfloat16)
    assert not fails, fails


@pytest.mark.parametrize("where", NONFINITE_WHERE)
def test_nonfinite_training_block_groups(where):
    """The same rule for the paper's layout (one scale per block of tokens), which the simulation also runs."""
    from sage_patch.reference.sagebwd import SageBwdConfig

    cfg = SageBwdConfig(groups="block", block_q=32, block_k=32, pv="int8")
    fails = check_nonfinite_training(lambda *a: _train_8b(*a, config=cfg), where, math.nan, dtype=torch.float32)
    assert not fails, fails


def test_nonfinite_training_checker_catches_a_swallowed_nan():
    """The checks can fail: a run that zeroes non-finite inputs (what the old SageBwd kernels' rounding did) is
    reported for every location."""
    def swallowing(q, k, v, dout, mask, causal):
        return _train_8b(*(x.nan_to_num(0.0, 0.0, 0.0) for x in (q, k, v, dout)), mask, causal)

    for where in NONFINITE_WHERE:
        fails = check_nonfinite_training(swallowing, where, math.nan, dtype=torch.float32)
        assert {kind for kind, _ in fails} == {"reached"}, (where, fails)

"""Head dims the kernels lack natively run the kernel of the next native head dim, zero-padded (kernels.head_dims):
the registry's rule and speed routing, can_run / resolve and the report on a faked sm_90 device, the launch's
padding (a fake op that checks what it receives and runs the kernel's simulation), the CPU path simulating the
padded layout, and that layout's numerics vs float64 on structured inputs."""
from __future__ import annotations

import math

import pytest
import torch

import sage_patch
import sage_patch.api as api
import sage_patch.kernels as K
import sage_patch.resolve as R
from attention_fuzz import LSE_REL, REL_L1, _structured
from sage_patch.kernels import head_dims, registry
from sage_patch.masks import MaskInfo
from sage_patch.reference import exact_attention, simulate

CALL = dict(is_causal=False, mask=MaskInfo("none", None), dropout_p=0.0, return_lse=False, smooth_v=False)


# ---- the registry's rule ------------------------------------------------------------------------------------------

def test_native_head_dim_and_work_ratio():
    assert [registry.native_head_dim(d) for d in (1, 48, 63, 64, 65, 96, 127, 128)] == [64] * 4 + [128] * 4
    assert registry.native_head_dim(129) == 256 and registry.native_head_dim(256) == 256
    assert registry.native_head_dim(257) is None and registry.native_head_dim(64, 300) is None
    assert registry.native_head_dim(64, 128) == 128 and registry.native_head_dim(128, 80) == 128
    assert registry.native_head_dim(96, 192) == 256
    assert head_dims.padding(128, 128) is None and head_dims.padding(64, 64) is None
    assert head_dims.padding(96, 96) == 128 and head_dims.padding(128, 80) == 128 and head_dims.padding(1, 1) == 64
    assert head_dims.padding(192, 192) == 256 and head_dims.padding(160, 128) == 256
    assert head_dims.padding(256, 256) is None and head_dims.padding(320, 320) is None  # native / none fits
    assert registry.work_ratio(128) == 1.0 and registry.work_ratio(96) == pytest.approx(4 / 3)
    assert registry.work_ratio(96, 64) == pytest.approx(256 / 160) and registry.work_ratio(16) == 4.0


def test_padded_calls_take_the_measured_padded_crossover_at_or_below_their_work():
    """sm_90's table names measured padded head dims: a padded call takes the largest measured one <= (D + Dv) / 2
    padded to the same native dim (its work ratio is that one's or more), SDPA at every length where none is."""
    w = registry.get("wgmma-fp8")
    assert w.crossover((9, 0), 128, False) == 2048 and w.crossover((9, 0), 64, True) == 3072  # native: as measured
    assert w.crossover((9, 0), 256, False) == 2048 and w.crossover((9, 0), 256, True) == 2560
    assert w.crossover((9, 0), 96, False) == 6144 and w.crossover((9, 0), 96, True) == 9216  # measured
    assert w.crossover((9, 0), 100, False) == 6144                              # 96's: more work than 96 has
    assert w.crossover((9, 0), 72, False) == math.inf                           # below every measured one: SDPA
    assert w.crossover((9, 0), 48, True) == math.inf                            # none measured padded to 64
    assert w.crossover((9, 0), 192, False) == 12288 and w.crossover((9, 0), 192, True) == 20480
    assert w.crossover((9, 0), 150, False) == math.inf                          # below 160 in 256's bucket
    assert w.crossover((9, 0), 192, False, 128) == 12288                        # MLA 192/128: work of 160
    assert w.crossover((9, 0), 128, True, 80) == 9216                           # (128 + 80) / 2 = 104 -> 96's, causal
    assert registry.padded_measurement(w.sdpa_faster_below, (9, 0), 128, False, 80) == (96, 6144)
    assert registry.padded_measurement(w.sdpa_faster_below, (9, 0), 128, False) is None      # native
    assert w.crossover((9, 0), 320, False) is None                             # no kernel at all


def test_padded_crossover_is_the_native_one_times_the_work_ratio(monkeypatch):
    """Where padded calls follow the assumption: an architecture whose crossovers are not measured and whose table
    names no padded head dim (here a table of sm_90's native entries, read as if sm_90 were not measured)."""
    monkeypatch.setattr(registry, "MEASURED_ARCHS", ())
    native = {k: v for k, v in registry.get("wgmma-fp8").sdpa_faster_below["sm_90"].items()
              if k[0] in registry.NATIVE_HEAD_DIMS}
    table = {"sm_90": native}

    def crossover(*a):
        return registry._crossover(table, (9, 0), *a)

    assert crossover(96, False) == math.ceil(2048 * 128 / 96)
    assert crossover(96, True) == math.ceil(2560 * 128 / 96)
    assert crossover(48, True) == math.ceil(3072 * 64 / 48)
    assert crossover(96, False, 64) == math.ceil(2048 * 256 / 160)   # Dv != D: (n + n) / (D + Dv)
    assert crossover(128, False, 80) == math.ceil(2048 * 256 / 208)
    assert crossover(192, False) == math.ceil(2048 * 256 / 192)
    assert crossover(320, False) is None                             # no kernel at all
    portable = registry.get("mma-fp8")
    assert portable.crossover((9, 0), 96, False) == math.inf                   # slower at every length stays so
    # no table (sm_89: assumed faster at every length, 2-3x): padding with at most 2x the work keeps that
    assert portable.crossover((8, 9), 96, False) is None and portable.crossover((8, 9), 32, True) is None
    assert portable.crossover((8, 9), 31, False) == math.inf and portable.crossover((8, 9), 1, False) == math.inf
    assert "measured for 80, 96, 112" in registry.PADDED_SPEED_ASSUMPTION


def test_info_prints_the_padded_assumption():
    from sage_patch.cli import _speed_routing

    assert any("padded head dims: on sm_90 measured for 80, 96, 112" in line for line in _speed_routing())


# ---- can_run / resolve on a faked sm_90 device ------------------------------------------------------------------

@pytest.fixture
def hopper(fake_cuda):
    fake = fake_cuda(["90a"])
    fake["cc"] = (9, 0)
    return fake


def _can_run(q, k, v, layout="bhsd", mask=None):
    return K.can_run("8b", q, k, v, layout=layout, is_causal=False, attn_mask=mask, return_lse=False, smooth_v=False)


def _t(d, s=40, h=2, dtype=torch.float16):
    return torch.zeros(1, h, s, d, dtype=dtype)


@pytest.mark.parametrize("d", [1, 7, 48, 63, 64, 65, 80, 96, 100, 112, 127, 128])
def test_can_run_serves_every_head_dim_up_to_128(hopper, d):
    q = _t(d)
    variant, why = _can_run(q, q, q)
    assert variant is registry.get("wgmma-fp8")
    n = registry.native_head_dim(d)
    assert why == ("ok" if n == d else f"head dim {d} zero-padded to {n}, the kernels' next native head dim (exact; "
                                      f"the work of {n})")
    assert K.variant_for(q) is variant  # direct calls (kernels.attention) pick at the padded head dim too


@pytest.mark.parametrize("d", [129, 160, 192, 255, 256])
def test_can_run_serves_head_dims_up_to_256(hopper, d):
    """129..256 run at 256, on the Hopper kernel there (the portable kernels have 256 too)."""
    q = _t(d)
    variant, why = _can_run(q, q, q)
    assert variant is registry.get("wgmma-fp8")
    assert why == ("ok" if d == 256 else f"head dim {d} zero-padded to 256, the kernels' next native head dim "
                                         "(exact; the work of 256)")
    assert registry.get("mma-fp8f16").why_not(K._target("8b", q, cc=(9, 0)), ignore=("pv",)) is None


@pytest.mark.parametrize("d, dv", [(257, 257), (320, 320), (64, 320), (320, 128)])
def test_can_run_refuses_above_the_largest_native_head_dim(hopper, d, dv):
    variant, why = _can_run(_t(d), _t(d), _t(dv))
    assert variant is None
    assert why.startswith(f"head_dim {max(d, dv)}: the kernel has head dims (64, 128, 256) only")


@pytest.mark.parametrize("d, dv, n", [(96, 64, 128), (128, 80, 128), (64, 128, 128), (48, 32, 64), (80, 96, 128)])
def test_can_run_serves_dv_different_from_d(hopper, d, dv, n):
    variant, why = _can_run(_t(d), _t(d), _t(dv))
    assert variant is registry.get("wgmma-fp8")
    assert why.startswith(f"head dims {d} (q, k) / {dv} (v) zero-padded to {n}")
    assert _can_run(_t(d), _t(d + 8 if d < 128 else 64), _t(dv)) == (None, f"head dims differ (q {d}, k "
                                                                          f"{d + 8 if d < 128 else 64})")


def test_padded_tensors_skip_the_stride_rules_native_ones_keep_them(hopper):
    q = _t(100)  # strides of 100 elements: not 16-byte multiples, but the kernel reads a padded copy
    assert _can_run(q, q, q)[0] is not None
    view = torch.zeros(1, 2, 40, 72, dtype=torch.float16)[..., :64]  # native 64 with row stride 72 * 2 bytes: fine
    assert _can_run(view, view, view)[0] is not None
    odd = torch.zeros(1, 2, 40, 65, dtype=torch.float16)[..., :64]   # native 64 read in place: stride 65 refused
    variant, why = _can_run(odd, odd, odd)
    assert variant is None and "not multiples of 8" in why
    assert _can_run(q[0], q[0], q[0]) == (None, "q must be 4-D (B, H, S, D), got 3-D")


def test_can_run_varlen_pads_too(hopper):
    q = torch.zeros(50, 4, 96, dtype=torch.float16)
    kv = torch.zeros(60, 2, 96, dtype=torch.float16)
    cu_q, cu_k = torch.tensor([0, 20, 50], dtype=torch.int32), torch.tensor([0, 30, 60], dtype=torch.int32)
    variant, why = K.can_run_varlen("8b", q, kv, kv, cu_q, cu_k)
    assert variant is registry.get("wgmma-fp8") and why.startswith("head dim 96 zero-padded to 128")
    variant, why = K.can_run_varlen("8b", q, kv, kv[..., :64].contiguous(), cu_q, cu_k)
    assert variant is not None and why.startswith("head dims 96 (q, k) / 64 (v) zero-padded to 128")
    assert K.can_run_varlen("8b", q, kv, torch.zeros(60, 2, 320, dtype=torch.float16), cu_q, cu_k)[0] is None


def test_resolve_runs_the_kernel_and_says_it_padded(hopper, monkeypatch):
    monkeypatch.setattr(K, "SPEED_ROUTING", False)
    q = _t(96, s=64)
    d = R.resolve("8b", q, q, q, layout="bhsd", **CALL)
    assert d.variant is registry.get("wgmma-fp8") and d.impl == K.IMPL_WGMMA
    assert d.reason.startswith("head dim 96 zero-padded to 128")
    d = R.resolve("8b", q, q, _t(64, s=64), layout="bhsd", **CALL)
    assert d.impl == K.IMPL_WGMMA and "head dims 96 (q, k) / 64 (v) zero-padded to 128" in d.reason
    d = R.resolve("8b", _t(128, s=64), _t(128, s=64), _t(128, s=64), layout="bhsd", **CALL)
    assert d.reason is None  # native: nothing to say
    d = R.resolve("8b", _t(192, s=64), _t(192, s=64), _t(192, s=64), layout="bhsd", **CALL)
    assert d.impl == K.IMPL_WGMMA and d.reason.startswith("head dim 192 zero-padded to 256")
    d = R.resolve("8b", _t(320, s=64), _t(320, s=64), _t(320, s=64), layout="bhsd", **CALL)
    assert d.impl == "sdpa" and "head_dim 320: the kernel has head dims (64, 128, 256) only" in d.reason


def test_padded_calls_on_sm90_follow_the_measured_padded_crossover_with_the_reason(hopper, monkeypatch):
    monkeypatch.setattr(K, "SPEED_ROUTING", True)
    q = _t(96, s=4096, h=1)
    d = R.resolve("8b", q, q, q, layout="bhsd", **CALL)
    assert d.impl == "sdpa" and "below 6144 tokens on sm_90 (measured with head dim 96 zero-padded to 128" in d.reason
    q = _t(96, s=6144, h=1)
    assert R.resolve("8b", q, q, q, layout="bhsd", **CALL).impl == K.IMPL_WGMMA
    q = _t(72, s=16384, h=1)   # more padding work than any measured head dim: SDPA
    d = R.resolve("8b", q, q, q, layout="bhsd", **CALL)
    assert d.impl == "sdpa" and "no padded head dim at or below this one's is measured" in d.reason
    monkeypatch.setattr(K, "SPEED_ROUTING", False)  # SAGE_PATCH_SPEED_ROUTING=0 runs the padded kernel
    assert R.resolve("8b", q, q, q, layout="bhsd", **CALL).impl == K.IMPL_WGMMA


def test_speed_routing_of_padded_calls(hopper, monkeypatch):
    """The assumption's routing (sm_90's table read as not measured, without its padded entries)."""
    monkeypatch.setattr(K, "SPEED_ROUTING", True)
    monkeypatch.setattr(registry, "MEASURED_ARCHS", ())
    table = registry.get("wgmma-fp8").sdpa_faster_below
    monkeypatch.setitem(table, "sm_90", {k: v for k, v in table["sm_90"].items() if k[0] in registry.NATIVE_HEAD_DIMS})
    below = math.ceil(2048 * 128 / 96)
    q = _t(96, s=below - 1, h=1)
    d = R.resolve("8b", q, q, q, layout="bhsd", **CALL)
    assert d.impl == "sdpa" and f"below {below} tokens on sm_90" in d.reason and "work ratio 1.33" in d.reason
    assert "padded head dims are not measured" in d.reason and "head dim 96," in d.reason
    q = _t(96, s=below, h=1)
    assert R.resolve("8b", q, q, q, layout="bhsd", **CALL).impl == K.IMPL_WGMMA
    # a key-padding mask: the native kernel keeps it below its crossover, a padded one does not (assumed)
    q128, q96 = _t(128, s=1024, h=1), _t(96, s=1024, h=1)
    kp = MaskInfo("key_padding", torch.ones(1, 1024, dtype=torch.bool))
    assert R.resolve("8b", q128, q128, q128, layout="bhsd", **{**CALL, "mask": kp}).impl == K.IMPL_WGMMA
    d = R.resolve("8b", q96, q96, q96, layout="bhsd", **{**CALL, "mask": kp})
    assert d.impl == "sdpa" and "work ratio" in d.reason
    assert R.resolve("8b", q96, q96, q96, layout="bhsd", window_left=100, **CALL).impl == "sdpa"
    v64 = _t(64, s=3000, h=1)
    q = _t(96, s=3000, h=1)  # Dv = 64: ratio 256 / 160, crossover 3277
    d = R.resolve("8b", q, q, v64, layout="bhsd", **CALL)
    assert d.impl == "sdpa" and "head dims 96/64" in d.reason and "below 3277 tokens" in d.reason


def test_head_dims_above_128_pad_to_256(hopper):
    """NATIVE_HEAD_DIMS has 256: 129..256 pad to it, Dv != D too (MLA-style 192 / 128)."""
    assert registry.native_head_dim(192) == 256 and registry.native_head_dim(192, 128) == 256
    variant, why = _can_run(_t(192), _t(192), _t(128))
    assert variant is not None and why.startswith("head dims 192 (q, k) / 128 (v) zero-padded to 256")
    variant, why = _can_run(_t(256), _t(256), _t(256))
    assert variant is not None and why == "ok"


def test_fp16_pv_at_256_needs_the_large_shared_memory():
    """The fp16-carried P~V modes need 123 KB of shared memory at head dim 256: sm_86 (99 KB) gets no kernel, the
    reason naming it; sm_80 (163 KB) and sm_89 (FP8 P~V: 91 KB) do."""
    archs = ("80", "86", "89", "90a")
    t86 = registry.Target((8, 6), archs, head_dim=256)
    assert registry.select(t86)[0] is None
    assert registry.get("mma-fp16").why_not(t86) == (
        "head_dim 256 with fp16 P~V needs 123 KB of shared memory per block (sm_86 has 99 KB)")
    assert registry.select(registry.Target((8, 6), archs, head_dim=128))[0] is registry.get("mma-fp16")
    assert registry.select(registry.Target((8, 0), archs, head_dim=256))[0] is registry.get("mma-fp16")
    assert registry.select(registry.Target((8, 9), archs, head_dim=256))[0] is registry.get("mma-fp8")


# ---- the launch: padded copies in, the caller's Dv out ---------------------------------------------------------

@pytest.fixture
def fake_op(hopper, monkeypatch):
    """The custom op's body replaced by the simulation of the variant it is asked for, at the head dim it gets;
    records what it received."""
    seen = []

    def op(q, k, v, kmask, bshd, is_causal, scale, kernel, qk_bits, smooth_v, want_lse, hop_split_max=0,
           window_left=-1):
        seen.append(dict(shapes=(q.shape, k.shape, v.shape), contiguous=all(x.is_contiguous() for x in (q, k, v)),
                         scale=scale, data=(q.data_ptr(), k.data_ptr(), v.data_ptr())))
        variant = next(x for x in registry.VARIANTS if x.kernel_id == kernel)
        qb, kb, vb = (x.transpose(1, 2) for x in (q, k, v)) if bshd else (q, k, v)
        out, lse = simulate(qb, kb, vb, "8b" if qk_bits == 8 else "4b", is_causal=is_causal, scale=scale,
                            attn_mask=None if kmask is None else kmask[:, None, None, :], return_lse=True,
                            config=variant.reference_config(q.shape[-1]), window_left=window_left)
        out = out.to(q.dtype)
        return (out.transpose(1, 2).contiguous() if bshd else out), (lse if want_lse else lse.new_empty(0))

    monkeypatch.setattr(K._ops, "_attn_impl", op)
    monkeypatch.setattr(K, "SPEED_ROUTING", False)
    return seen


def _padded_sim(q, k, v, n, config, **kw):
    pad = lambda x: torch.nn.functional.pad(x.float(), (0, n - x.shape[-1]))  # noqa: E731
    return simulate(pad(q), pad(k), pad(v), "8b", scale=kw.pop("scale", 1 / math.sqrt(q.shape[-1])),
                    return_lse=True, config=config, **kw)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("d, dv", [(96, 96), (80, 64), (128, 80), (48, 48)])
def test_launch_pads_and_slices(fake_op, layout, d, dv):
    g = torch.Generator().manual_seed(d + dv)
    q = _structured(g, (2, 4, 70, d), 0.0, True).half()
    k = _structured(g, (2, 2, 90, d), 4.0, False).half()
    v = _structured(g, (2, 2, 90, dv), 4.0, False).half()
    if layout == "bshd":
        q, k, v = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    keep = [x.clone() for x in (q, k, v)]
    mask = torch.rand(2, 90, generator=g) < 0.8
    out, lse = sage_patch.attention(q, k, v, layout=layout, is_causal=True, attn_mask=mask, precision="8b",
                                    return_lse=True)
    n = registry.native_head_dim(d, dv)
    (qs, ks, vs), call = fake_op[-1]["shapes"], fake_op[-1]
    assert qs[-1] == ks[-1] == vs[-1] == n and call["contiguous"]
    assert call["scale"] == 1 / math.sqrt(d)                      # the caller's default: the real head dim's
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), keep))  # the caller's tensors untouched
    assert call["data"][2] != v.data_ptr() or dv == n
    assert out.shape == q.shape[:-1] + (dv,) and out.dtype == torch.float16 and out.is_contiguous()
    tb = (lambda x: x.transpose(1, 2)) if layout == "bshd" else (lambda x: x)
    ref, ref_lse = _padded_sim(tb(q), tb(k), tb(v), n, registry.get("wgmma-fp8").reference_config(n),
                               is_causal=True, attn_mask=mask[:, None, None, :])
    assert torch.equal(tb(out), ref[..., :dv].half()) and torch.equal(lse, ref_lse)
    assert (ref[..., dv:] == 0).all()  # V's zero columns give zero output columns: what the slice drops
    ex = exact_attention(*(tb(x).double() for x in (q, k, v)), is_causal=True, attn_mask=mask[:, None, None, :])
    sel = torch.isfinite(lse)
    err = (tb(out).double() - ex)[sel].abs().sum() / ex[sel].abs().sum()
    assert err <= REL_L1["8b"]
    # a scale of the caller's own reaches the kernel as given
    sage_patch.attention(q, k, v, layout=layout, precision="8b", scale=0.3)
    assert fake_op[-1]["scale"] == 0.3


def test_direct_kernel_call_pads(fake_op):
    q = torch.randn(1, 2, 33, 112, dtype=torch.bfloat16)
    out, lse = K.attention(q, q, q)
    assert fake_op[-1]["shapes"][0][-1] == 128 and out.shape == q.shape and lse.shape == (1, 2, 33)
    out, lse = K.attention(q, q, q, return_lse=False)
    assert lse is None and out.shape == q.shape


# ---- the CPU path simulates the padded layout ----------------------------------------------------------------

def test_cpu_reference_simulates_the_padded_layout(monkeypatch):
    dims = []
    real = api.simulate

    def spy(q, k, v, *a, **kw):
        dims.append((q.shape[-1], k.shape[-1], v.shape[-1], kw["scale"]))
        return real(q, k, v, *a, **kw)

    monkeypatch.setattr(api, "simulate", spy)
    q, k, v = torch.randn(1, 2, 50, 96), torch.randn(1, 2, 60, 96), torch.randn(1, 2, 60, 64)
    out = sage_patch.attention(q, k, v, precision="8b")
    assert dims[-1] == (128, 128, 128, 1 / math.sqrt(96)) and out.shape == (1, 2, 50, 64)
    sage_patch.attention(q, k, k, precision="4b", scale=0.2)
    assert dims[-1] == (128, 128, 128, 0.2)
    sage_patch.attention(q[..., :64], k[..., :64], v, precision="8b")
    assert dims[-1][:3] == (64, 64, 64)                           # native: as it is
    wide = torch.randn(1, 2, 50, 192)
    sage_patch.attention(wide, wide, wide[..., :128], precision="8b")
    assert dims[-1][:3] == (256, 256, 256)                        # above 128: padded to 256 (the public API's
                                                                  # largest head dim, api.MAX_HEAD_DIM)


def test_public_api_end_to_end_on_cpu():
    g = torch.Generator().manual_seed(3)
    q = _structured(g, (2, 6, 77, 80), 0.0, True)
    k = _structured(g, (2, 2, 77, 80), 4.0, False)
    v = _structured(g, (2, 2, 77, 80), 4.0, False)
    ex = exact_attention(q.double(), k.double(), v.double(), is_causal=True)
    for x in (sage_patch.attention(q, k, v, is_causal=True, precision="8b"),
              sage_patch.sdpa(q, k, v, is_causal=True, enable_gqa=True, precision="8b"),
              sage_patch.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), layout="bshd",
                                   is_causal=True, precision="8b").transpose(1, 2)):
        assert x.shape == q.shape and x.dtype == q.dtype
        assert (x.double() - ex).abs().sum() / ex.abs().sum() <= REL_L1["8b"]
    # full precision is not padded: torch SDPA's own result
    full = sage_patch.attention(q, k, v, is_causal=True, precision="full")
    torch.testing.assert_close(full, torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), is_causal=True))


def test_sinks_on_a_padded_head_dim():
    g = torch.Generator().manual_seed(5)
    q = _structured(g, (1, 4, 65, 96), 0.0, True)
    k = _structured(g, (1, 2, 129, 96), 4.0, False)
    v = _structured(g, (1, 2, 129, 96), 4.0, False)
    sinks = torch.randn(4, generator=g)
    out, lse = sage_patch.attention(q, k, v, precision="8b", sinks=sinks, return_lse=True, window_size=(40, 0))
    ex, ex_lse = exact_attention(q.double(), k.double(), v.double(), sinks=sinks.double(), return_lse=True,
                                 is_causal=True, window_left=40)
    assert (out.double() - ex).abs().sum() / ex.abs().sum() <= REL_L1["8b"]
    assert (lse.double() - ex_lse).abs().max() / ex_lse.abs().max().clamp_min(4) <= LSE_REL["8b"]


# ---- the padded layout's numerics: the kernels' own simulation vs float64 --------------------------------------

LAYOUTS = {"wgmma": lambda n: registry.get("wgmma-fp8").reference_config(n),
           "mma-fp8": lambda n: registry.get("mma-fp8").reference_config(n)}
CASES = [
    # b, hq, hkv, sq, skv, d, dv, causal, mask, window
    (1, 2, 2, 1, 1, 1, 1, False, False, -1),
    (2, 4, 2, 77, 131, 48, 48, True, True, -1),       # GQA, odd lengths, causal bottom-right, key padding
    (1, 3, 1, 200, 200, 80, 80, False, False, 50),    # MQA, window
    (2, 2, 2, 129, 257, 96, 96, True, False, -1),
    (1, 4, 4, 300, 150, 112, 112, True, True, 30),    # Sq > Skv: empty rows; key padding and window
    (1, 2, 1, 90, 333, 96, 64, False, True, -1),      # Dv != D
    (2, 2, 2, 65, 191, 128, 80, True, False, -1),
    (1, 4, 2, 150, 211, 160, 160, True, True, -1),    # padded to 256
    (1, 2, 2, 97, 140, 192, 128, False, False, 40),   # MLA-style 192 / 128, window
    (2, 4, 1, 130, 257, 256, 256, True, True, -1),    # native 256
    (1, 2, 2, 200, 200, 256, 256, False, False, 64),
]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("b,hq,hkv,sq,skv,d,dv,causal,mask,window", CASES)
def test_padded_layout_vs_float64(layout, b, hq, hkv, sq, skv, d, dv, causal, mask, window):
    """The simulation of the padded layout (what the kernel of head dim n computes on the padded call) is within the
    8b tolerance of float64 on structured inputs (K, V channel bias; Q outlier channels); it equals the simulation
    of the same layout at the real head dims (padding changes no quantization), and V's padded columns are 0."""
    g = torch.Generator().manual_seed(sq * 7 + d)
    q = _structured(g, (b, hq, sq, d), 0.0, True).half()
    k = _structured(g, (b, hkv, skv, d), 4.0, False).half()
    v = _structured(g, (b, hkv, skv, dv), 4.0, False).half()
    m = None
    if mask:
        keep = torch.rand(b, skv, generator=g) < 0.7
        keep[0, -1] = False
        m = keep[:, None, None, :]
    n = registry.native_head_dim(d, dv)
    cfg = LAYOUTS[layout](n)
    kw = dict(is_causal=causal, attn_mask=m, window_left=window)
    sim, sim_lse = _padded_sim(q, k, v, n, cfg, **kw)
    assert (sim[..., dv:] == 0).all()
    sim = sim[..., :dv]
    ex, ex_lse = exact_attention(q.double(), k.double(), v.double(), return_lse=True, **kw)
    nonempty = torch.isfinite(ex_lse)
    assert torch.equal(torch.isfinite(sim_lse), nonempty) and (sim[~nonempty] == 0).all()
    if nonempty.any():
        err = (sim.double() - ex)[nonempty].abs().sum() / ex[nonempty].abs().sum()
        lerr = (sim_lse.double() - ex_lse)[nonempty].abs().max() / ex_lse[nonempty].abs().max().clamp_min(4)
        assert err <= REL_L1["8b"] and lerr <= LSE_REL["8b"], (float(err), float(lerr))
    unpadded, unpadded_lse = simulate(q, k, v, "8b", return_lse=True, config=cfg, **kw)
    torch.testing.assert_close(sim, unpadded, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sim_lse, unpadded_lse, rtol=1e-5, atol=1e-5)


def test_torch_compile_fullgraph_of_a_padded_head_dim():
    """The padding is plain tensor code outside any custom op: it traces (here the CPU path, which pads the same way
    through head_dims.padded as the launch does)."""
    g = torch.Generator().manual_seed(13)
    q, k, v = (_structured(g, (1, 2, 96, 80), 4.0 * (i > 0), i == 0) for i in range(3))

    def f(q, k, v):
        return sage_patch.attention(q, k, v, precision="8b", is_causal=True)

    with torch.no_grad():
        torch.testing.assert_close(torch.compile(f, fullgraph=True)(q, k, v), f(q, k, v), atol=1e-5, rtol=1e-5)

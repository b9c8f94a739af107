"""Reference numerics against float64 exact attention, and the papers' ablations."""

import pytest
import torch

from sage_patch.accuracy import compare, cosine, rel_l1
from sage_patch.reference import (
    Grouping,
    SimConfig,
    exact_attention,
    quantize_nvfp4,
    round_fp4_e2m1,
    round_fp8_e4m3,
    simulate,
)
from tests.conftest import structured_qkv


@pytest.fixture(scope="module")
def data():
    q, k, v = structured_qkv(b=2, h=4, sq=512, d=128, seed=1)
    return q, k, v, exact_attention(q, k, v)


@pytest.mark.parametrize("precision,min_cos,max_l1", [("8b", 0.9995, 0.03), ("4b", 0.995, None), ("fp4", 0.995, None)])
def test_precision_vs_float64(data, precision, min_cos, max_l1):
    q, k, v, ref = data
    m = compare(simulate(q, k, v, precision), ref)
    assert m["cos"] >= min_cos, m
    if max_l1 is not None:
        assert m["rel_l1"] <= max_l1, m


def test_full_equals_sdpa_within_fp32_rounding(data):
    import sage_patch

    q, k, v, ref = data
    out = sage_patch.attention(q, k, v, precision="full")
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v), rtol=0, atol=0)
    assert compare(out, ref)["rel_l1"] < 1e-5


def test_ablation_smoothing_qk_beats_none_for_int4():
    q, k, v = structured_qkv(sq=512, d=64, seed=2)
    q = q + 3.0 * torch.randn(64, generator=torch.Generator().manual_seed(9))  # channel bias in Q too
    ref = exact_attention(q, k, v)
    smooth = rel_l1(simulate(q, k, v, "4b"), ref)
    plain = rel_l1(simulate(q, k, v, "4b", config=SimConfig(smooth_q=False, smooth_k=False)), ref)
    k_only = rel_l1(simulate(q, k, v, "4b", config=SimConfig(smooth_q=False, smooth_k=True)), ref)
    assert smooth < k_only < plain, (smooth, k_only, plain)


def test_ablation_per_thread_groups_beat_per_block():
    q, k, v = structured_qkv(sq=512, d=64, seed=3)
    # tokens of varying magnitude, as real activations have
    g = torch.Generator().manual_seed(4)
    q = q * torch.rand(1, 1, 512, 1, generator=g).mul(3).add(0.2)
    k = k * torch.rand(1, 1, 512, 1, generator=g).mul(3).add(0.2)
    ref = exact_attention(q, k, v)
    per_thread = rel_l1(simulate(q, k, v, "4b"), ref)
    per_block = rel_l1(simulate(q, k, v, "4b", config=SimConfig(q_group=Grouping.per_block(128),
                                                                   k_group=Grouping.per_block(64))), ref)
    assert per_thread < per_block, (per_thread, per_block)


def test_ablation_two_level_p_scaling_beats_direct_fp4():
    # Long rows with peaky attention: most KV blocks hold only small P~, where a direct E4M3 block scale
    # (max/6 <= 1/6) lands in E4M3's subnormal range; the per-row first-level scale avoids that.
    q, k, v = structured_qkv(b=1, h=2, sq=128, skv=4096, d=64, seed=5)
    q = q * 2
    ref = exact_attention(q, k, v)
    two = rel_l1(simulate(q, k, v, "fp4"), ref)
    direct = rel_l1(simulate(q, k, v, "fp4", config=SimConfig(p_scaling="direct")), ref)
    assert two < direct, (two, direct)


def test_ablation_two_level_accumulation_beats_one_narrow_accumulator():
    q, k, v = structured_qkv(b=1, h=2, sq=64, skv=4096, d=64, seed=6)
    ref = exact_attention(q, k, v)
    two = rel_l1(simulate(q, k, v, "8b", config=SimConfig(pv_accum_bits=13, two_level=True)), ref)
    one = rel_l1(simulate(q, k, v, "8b", config=SimConfig(pv_accum_bits=13, two_level=False)), ref)
    assert two < one, (two, one)


def test_smooth_v_option_stays_accurate():
    q, k, v = structured_qkv(sq=256, d=64, seed=7)
    ref = exact_attention(q, k, v)
    assert cosine(simulate(q, k, v, "8b", smooth_v=True), ref) >= 0.9995
    assert cosine(simulate(q, k, v, "fp4", smooth_v=True), ref) >= 0.995


@pytest.mark.parametrize("d", [1, 16, 64, 80, 128, 256])
@pytest.mark.parametrize("precision", ["8b", "4b", "fp4"])
def test_head_dims(d, precision):
    q, k, v = structured_qkv(b=1, h=2, sq=130, d=d, seed=d)
    m = compare(simulate(q, k, v, precision), exact_attention(q, k, v))
    assert m["cos"] >= (0.9995 if precision == "8b" else 0.99), (d, m)


@pytest.mark.parametrize("sq,skv", [(1, 1), (1, 300), (7, 65), (129, 200), (200, 129), (64, 64)])
@pytest.mark.parametrize("causal", [False, True])
def test_odd_lengths_and_bottom_right_causal(sq, skv, causal):
    q, k, v = structured_qkv(b=1, h=2, sq=sq, skv=skv, d=64, seed=sq * 1000 + skv)
    # independent construction of the bottom-right rule: query i sees keys j <= i + skv - sq
    mask = torch.tensor([[j <= i + skv - sq for j in range(skv)] for i in range(sq)]) if causal else None
    ref = exact_attention(q, k, v, attn_mask=mask[None, None] if causal else None)
    out = simulate(q, k, v, "8b", is_causal=causal)
    assert torch.isfinite(out).all()
    assert cosine(out, ref) >= 0.9995
    empty = ~mask.any(-1) if causal else torch.zeros(sq, dtype=torch.bool)
    assert (out[..., empty, :] == 0).all()


def test_gqa_matches_expanded_heads():
    q, k, v = structured_qkv(b=2, h=8, hkv=2, sq=200, d=64, seed=8)
    ref = exact_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1))
    assert cosine(exact_attention(q, k, v), ref) > 1 - 1e-12
    for p in ("8b", "4b", "fp4"):
        assert cosine(simulate(q, k, v, p), ref) >= 0.99


def test_key_padding_and_fully_masked_rows():
    q, k, v = structured_qkv(b=3, h=2, sq=100, skv=150, d=64, seed=10)
    kp = torch.ones(3, 150, dtype=torch.bool)
    kp[1, 90:] = False
    kp[2, :] = False  # a batch with no visible key at all
    ref, ref_lse = exact_attention(q, k, v, attn_mask=kp, return_lse=True)
    for p in ("8b", "4b", "fp4"):
        out, lse = simulate(q, k, v, p, attn_mask=kp, return_lse=True)
        assert torch.isfinite(out).all()
        assert (out[2] == 0).all() and torch.isneginf(lse[2]).all()
        assert cosine(out[:2], ref[:2]) >= 0.99
    assert cosine(simulate(q, k, v, "8b", attn_mask=kp)[:2], ref[:2]) >= 0.9995
    assert torch.isneginf(ref_lse[2]).all()


def test_lse_matches_float64():
    q, k, v = structured_qkv(b=1, h=2, sq=130, skv=300, d=64, seed=11)
    _, ref_lse = exact_attention(q, k, v, is_causal=True, return_lse=True)
    _, lse = simulate(q, k, v, "8b", is_causal=True, return_lse=True)
    torch.testing.assert_close(lse, ref_lse, atol=0.1, rtol=0)  # INT8 error in S moves the LSE directly
    assert (lse - ref_lse).abs().mean() < 0.02
    assert lse.dtype == torch.float32


def test_dense_mask():
    q, k, v = structured_qkv(b=2, h=2, sq=64, skv=96, d=32, seed=12)
    mask = torch.rand(2, 2, 64, 96, generator=torch.Generator().manual_seed(0)) > 0.3
    mask[0, 0, 5] = False
    out = simulate(q, k, v, "8b", attn_mask=mask)
    assert (out[0, 0, 5] == 0).all()
    assert cosine(out, exact_attention(q, k, v, attn_mask=mask)) >= 0.9995


def test_simulation_never_writes_inputs():
    q, k, v = structured_qkv(sq=100, d=64, seed=13)
    copies = [t.clone() for t in (q, k, v)]
    for p in ("8b", "4b", "fp4"):
        simulate(q, k, v, p, smooth_v=True)
    for a, b in zip((q, k, v), copies):
        assert torch.equal(a, b)


def test_fp8_and_fp4_rounding_grids():
    assert round_fp8_e4m3(torch.tensor([1000.0, -1000.0, 0.0])).tolist() == [448.0, -448.0, 0.0]
    x = torch.tensor([0.24, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.74])
    assert round_fp4_e2m1(x).tolist() == [0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.5]
    grid = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0}
    r = round_fp4_e2m1(torch.randn(1000) * 4).abs()
    assert set(r.unique().tolist()) <= grid


def test_nvfp4_block_scaling_error_is_small_relative_to_block_max():
    x = torch.randn(4, 64) * torch.logspace(-3, 3, 64)  # wildly different magnitudes along the row
    deq = quantize_nvfp4(x, 16, x.abs().amax(-1, keepdim=True) / (448 * 6))
    blocks_err = (deq - x).reshape(4, 4, 16).abs().amax(-1)
    blocks_max = x.reshape(4, 4, 16).abs().amax(-1)
    assert (blocks_err <= blocks_max * 0.25 + 1e-12).all()


def test_mma_grouping_layout():
    from sage_patch.reference import MMA_K_GROUPING, MMA_Q_GROUPING

    qg, nq = MMA_Q_GROUPING.ids(64)
    assert nq == 16 and qg[0] == qg[8] == qg[16] == qg[24] and qg[0] != qg[1] and qg[32] != qg[0]
    kg, nk = MMA_K_GROUPING.ids(130)
    assert nk == 12 and kg[0] == kg[1] == kg[8] == kg[9] and kg[0] != kg[2] and kg[64] != kg[0]
    with pytest.raises(ValueError):
        Grouping(30, 8, 1)


def test_simconfig_validation():
    with pytest.raises(ValueError, match="pv"):
        SimConfig(pv="int8")
    with pytest.raises(ValueError, match="p_scaling"):
        SimConfig(p_scaling="x")
    with pytest.raises(ValueError, match="row_sum"):
        SimConfig(row_sum="x")


def test_fp16_pv_variant_for_ampere():
    q, k, v = structured_qkv(sq=200, d=64, seed=14)
    ref = exact_attention(q, k, v)
    assert cosine(simulate(q, k, v, "8b", config=SimConfig(pv="fp16")), ref) >= 0.9999


def test_wgmma_grouping_is_expressible_and_accurate():
    """The Hopper kernel's per-thread groups (wgmma m64nNk32 accumulator layout, 128-key blocks) can be simulated."""
    q, k, v = structured_qkv(b=1, h=2, sq=300, d=128, seed=15)
    cfg = SimConfig(q_group=Grouping(16, 8, 1), k_group=Grouping(128, 8, 2), block_k=128)
    m = compare(simulate(q, k, v, "8b", config=cfg), exact_attention(q, k, v))
    assert m["cos"] >= 0.9995 and m["rel_l1"] <= 0.03


def test_operand_row_sums_stay_accurate_and_leave_the_lse_alone():
    """The Hopper kernel's row sums are taken by the tensor cores from the quantized P~ (a ones row in V^T): within
    the "8b" thresholds, at least as accurate as the fp32 sum here, and the LSE (fp32 sums of p) is unchanged."""
    q, k, v = structured_qkv(b=1, h=2, sq=300, skv=700, d=128, seed=16)
    base = SimConfig(q_group=Grouping(16, 8, 1), k_group=Grouping(128, 8, 2), block_k=128)
    hop = SimConfig(q_group=Grouping(16, 8, 1), k_group=Grouping(128, 8, 2), block_k=128, row_sum="operand")
    ref = exact_attention(q, k, v)
    out_base, lse_base = simulate(q, k, v, "8b", config=base, return_lse=True)
    out_hop, lse_hop = simulate(q, k, v, "8b", config=hop, return_lse=True)
    m = compare(out_hop, ref)
    assert m["cos"] >= 0.9995 and m["rel_l1"] <= 0.03, m
    assert rel_l1(out_hop, ref) <= rel_l1(out_base, ref)
    assert 0 < rel_l1(out_hop, out_base) < 5e-3
    assert torch.equal(lse_hop, lse_base)


def test_operand_row_sums_make_the_output_a_true_weighted_average():
    """With row_sum="operand" numerator and denominator use the same quantized P~: if every key has the same value
    row, the output is exactly that (quantized) row; with the fp32 row sum the P~ rounding leaves an error."""
    q, k, _ = structured_qkv(b=1, h=1, sq=64, skv=256, d=64, seed=17)
    v = torch.randn(1, 1, 1, 64).expand(1, 1, 256, 64).contiguous()
    want = simulate(q, k, v, "8b", config=SimConfig(row_sum="operand"))[0, 0, 0]  # any row: all must match it
    got = simulate(q, k, v, "8b", config=SimConfig(row_sum="operand"))
    assert torch.allclose(got, want.expand_as(got), rtol=1e-6, atol=1e-6)
    assert torch.allclose(want, v[0, 0, 0], rtol=0.07, atol=0)  # V's own e4m3 rounding only
    plain = simulate(q, k, v, "8b", config=SimConfig(row_sum="p"))
    assert (plain - want).abs().max() > 1e-4


# Sampled statistics (SimConfig.stats_sample: the Hopper kernel's pre-pass) ------------------------------------------

_SAMPLED = dict(block_k=128, stats_sample=128)


def test_sample_tokens_spread_over_the_sequence():
    from sage_patch.reference.quant import sample_tokens

    assert sample_tokens(1000, 128).tolist() == [i * 1000 // 128 for i in range(128)]
    assert sample_tokens(50, 128).tolist() == list(range(50))  # short: every token
    assert sample_tokens(0, 128).numel() == 0


def test_sampled_v_blocks_never_saturate_and_factor_is_power_of_two():
    from sage_patch.reference import quantize_fp8_sampled_blocks
    from sage_patch.reference.quant import sample_tokens

    g = torch.Generator().manual_seed(3)
    v = torch.randn(1, 2, 1000, 64, generator=g) + 2.0 * torch.randn(64, generator=g)
    v[0, 1, 77, 5] = 5000.0   # not a sampled token (multiples of 1000/128 are 0, 7, 15, ...: 77 is not one)
    assert 77 not in sample_tokens(1000, 128).tolist()
    q8, base = quantize_fp8_sampled_blocks(v, v.index_select(-2, sample_tokens(1000, 128)), 128)
    deq = q8 * base
    # the outlier's block got a factor (its values are no longer e4m3 multiples of base alone) and nothing clamped
    assert abs(float(deq[0, 1, 77, 5]) - 5000.0) / 5000.0 <= 2.0 ** -4
    rel = ((deq - v).abs() / v.abs().clamp(min=1e-3)).flatten()
    assert float(rel.median()) < 0.04
    # per block, q8 / c is representable in e4m3: c is a power of two >= 1
    blk = q8[0, 1, 0:128]  # the outlier's block
    c = torch.exp2(torch.ceil(torch.log2(blk.abs().amax() / 448.0)).clamp(min=0))
    assert float(c) >= 2.0 and torch.equal(round_fp8_e4m3(blk / c), blk / c)
    other = q8[0, 0, 0:128]  # a block without outliers: factor 1, values e4m3 as they are
    assert torch.equal(round_fp8_e4m3(other), other) and float(other.abs().amax()) <= 448.0


def test_sampled_statistics_accurate_with_outliers_outside_the_sample():
    """Channel bias in K and V, plus one key the sample misses with a V row of 300 (the sampled base covers ~56)
    that every query attends to (~6%): the block factor keeps it unsaturated (clamped to the base range the rows
    would be off by ~15), so the error stays within 1.5x of exact per-channel statistics (whose scale maps this
    row, each channel's max, exactly to 448; fp8 rounds it here)."""
    q, k, v = structured_qkv(b=1, h=2, sq=256, skv=1000, d=64, seed=11)
    k = k.clone()
    v = v.clone()
    k[:, :, 77] = 4.0 * q.mean(dim=2)  # every query attends to key 77
    v[:, :, 77] = 300.0
    ref = exact_attention(q, k, v)
    sampled = compare(simulate(q, k, v, "8b", config=SimConfig(**_SAMPLED)), ref)
    exact_stats = compare(simulate(q, k, v, "8b", config=SimConfig(block_k=128)), ref)
    assert sampled["cos"] >= 0.999 and sampled["rel_l1"] <= 1.5 * exact_stats["rel_l1"], (sampled, exact_stats)
    v_clamped = v.clone()
    v_clamped[:, :, 77] = 56.0
    assert compare(exact_attention(q, k, v_clamped), ref)["rel_l1"] > 0.5  # what saturation would cost


@pytest.mark.parametrize("smooth_v", [False, True])
def test_sampled_statistics_lse_and_smooth_v(smooth_v):
    q, k, v = structured_qkv(b=1, h=2, sq=128, skv=777, d=64, seed=12)
    ref, ref_lse = exact_attention(q, k, v, return_lse=True)
    out, lse = simulate(q, k, v, "8b", smooth_v=smooth_v, return_lse=True, config=SimConfig(**_SAMPLED))
    m = compare(out, ref)
    assert m["cos"] >= 0.9995 and m["rel_l1"] <= 0.03, m
    assert float((lse - ref_lse).abs().max()) <= 0.05  # the sampled K mean's q.mean is added back to the LSE


def test_sampled_statistics_short_sequence_uses_every_token():
    """skv <= 128: the sample is the whole sequence, so the K mean is the exact one (the LSE shift agrees)."""
    q, k, v = structured_qkv(b=1, h=1, sq=64, skv=100, d=64, seed=13)
    _, lse_s = simulate(q, k, v, "8b", return_lse=True, config=SimConfig(**_SAMPLED))
    _, lse_e = simulate(q, k, v, "8b", return_lse=True, config=SimConfig(block_k=128))
    assert float((lse_s - lse_e).abs().max()) <= 1e-3

"""The kernel-variant registry (sage_patch.kernels.registry): one descriptor per compiled kernel, the one decision
between them, and resolve() handing the descriptor to the launch (padded and varlen calls alike). CPU only."""
from __future__ import annotations

import dataclasses
import os
import re
import types

import pytest
import torch

import sage_patch.kernels as K
from sage_patch import resolve as R
from sage_patch.kernels import registry
from sage_patch.kernels.registry import Target

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALL = ("80", "86", "89", "90a")


def _key(cc, precision, archs=ALL, **kw):
    v, why = registry.select(Target(cc, archs, precision), **kw)
    return v.key if v else why


@pytest.mark.parametrize("cc,precision,key,kernel_id,name", [
    ((8, 0), "8b", "mma-fp16", 1, K.IMPL_FP16PV),
    ((8, 6), "4b", "mma-fp16-qk4", 5, K.IMPL_FP16PV),      # packed INT4 MMA where it is native
    ((8, 9), "8b", "mma-fp8", 0, K.IMPL_FP8PV),
    ((8, 9), "4b", "mma-fp8-qk4", 4, K.IMPL_FP8PV),
    ((9, 0), "8b", "wgmma-fp8", 3, K.IMPL_WGMMA),
    ((9, 0), "4b", "mma-fp8f16", 2, K.IMPL_FP8PV),         # "4b" stays on the portable kernel, INT8 MMA, fp8-f16
])
def test_default_variant_per_gpu(cc, precision, key, kernel_id, name):
    v, why = registry.select(Target(cc, ALL, precision))
    assert why == "ok" and (v.key, v.kernel_id, v.name) == (key, kernel_id, name)
    assert precision in v.precisions


def test_build_targets_and_disabled_modes(monkeypatch):
    assert _key((9, 0), "8b", archs=("80", "89")) == "mma-fp16"  # no sm_90 SASS with FP8: the sm_80 code runs
    assert _key((9, 0), "8b", archs=("80", "86", "89", "90")) == "mma-fp8f16"  # no 90a: the portable FP8 kernel
    monkeypatch.setitem(registry.DISABLED, "wgmma", "wgmma: disabled (test)")
    assert _key((9, 0), "8b") == "mma-fp8f16"
    monkeypatch.setitem(registry.DISABLED, "4b-int4", "int4: disabled (test)")
    assert _key((8, 0), "4b") == "mma-fp16" and _key((8, 9), "4b") == "mma-fp8"


def test_forced_modes_choose_a_variant():
    assert _key((9, 0), "8b", pv="fp16") == "mma-fp16"
    assert _key((9, 0), "8b", pv="fp8-mma") == "mma-fp8"
    assert _key((9, 0), "4b", pv="fp16") == "mma-fp16"        # the GPU's default Q K^T mode (INT8 on sm_90)
    assert _key((9, 0), "4b", qk="int4") == "mma-fp8f16-qk4"  # the GPU's default P~V mode
    assert _key((8, 9), "4b", qk="int8") == "mma-fp8"
    assert _key((8, 0), "8b", pv="fp8-mma") == "mma-fp16"     # a mode that cannot run here: the default
    assert _key((8, 9), "8b", pv="wgmma") == "mma-fp8"
    with pytest.raises(ValueError):
        registry.select(Target((9, 0), ALL, "8b"), pv="fp9")


def test_explicit_variants_of_direct_calls():
    t = Target((9, 0), ALL, "8b")
    assert registry.explicit(t, "fp8").key == "wgmma-fp8"
    assert registry.explicit(t, "fp8-f16").key == "mma-fp8f16"
    assert registry.explicit(Target((8, 9), ALL, "4b"), "fp16").key == "mma-fp16-qk4"
    assert registry.explicit(Target((9, 0), ALL, "4b"), "fp8-f16", "int4").key == "mma-fp8f16-qk4"
    assert registry.explicit(Target((8, 0), ALL, "8b"), "fp8").key == "mma-fp8"  # the library refuses it (arch)
    with pytest.raises(RuntimeError):
        registry.explicit(Target((9, 0), ALL, "4b"), "wgmma")


def test_descriptors_are_unique_and_frozen():
    """One registry of one variant type: inference kernels (a C id each) and training pairs (trains), every key
    unique (the name reports show beside the implementation: Report's "variant")."""
    inference = [v for v in registry.VARIANTS if not v.trains]
    training = [v for v in registry.VARIANTS if v.trains]
    assert len({v.key for v in registry.VARIANTS}) == len(registry.VARIANTS) == 9
    assert len({v.kernel_id for v in inference}) == len(inference) == 7
    assert {v.name for v in inference} == {K.IMPL_FP8PV, K.IMPL_FP16PV, K.IMPL_WGMMA}
    assert [(v.key, v.name, v.launch) for v in training] == [
        ("sagebwd-hopper", registry.IMPL_SAGEBWD_HOPPER, "sage_patch.kernels.sagebwd.hopper"),
        ("sagebwd-triton", registry.IMPL_SAGEBWD, "sage_patch.kernels.sagebwd")]
    assert not {v.name for v in training} & {v.name for v in inference}
    assert all(type(v) is registry.KernelVariant for v in registry.VARIANTS)
    assert not hasattr(registry, "TrainingVariant") and not hasattr(registry, "select_training")
    with pytest.raises(Exception):
        registry.VARIANTS[0].kernel_id = 5  # frozen


def test_kernel_ids_match_the_c_header():
    text = open(os.path.join(ROOT, "kernels_cuda", "sage_kernels.h")).read()
    ids = {m.group(1): int(m.group(2)) for m in re.finditer(r"SAGE_KERNEL_(\w+) = (\d+)", text)}
    want = {"MMA_FP8": "mma-fp8", "MMA_FP16": "mma-fp16", "MMA_FP8F16": "mma-fp8f16", "WGMMA_FP8": "wgmma-fp8",
            "MMA_FP8_QK4": "mma-fp8-qk4", "MMA_FP16_QK4": "mma-fp16-qk4", "MMA_FP8F16_QK4": "mma-fp8f16-qk4"}
    assert {c: ids[c] for c in want} == {c: registry.get(k).kernel_id for c, k in want.items()}
    assert ids["COUNT"] == len([v for v in registry.VARIANTS if v.kernel_id is not None])


def test_reference_config_per_variant():
    w = registry.get("wgmma-fp8").reference_config(64)
    assert w.block_k == 128 and w.row_sum == "operand" and w.stats_sample == 128
    assert (w.q_group.tile, w.k_group.tile) == (16, 128)
    assert registry.get("mma-fp16").reference_config(128).pv == "fp16"
    m = registry.get("mma-fp8-qk4").reference_config(128)
    assert m.block_k == 64 and m.pv == "fp8" and m.q_smooth_block == 4 * K.registry.PORTABLE_Q_GROUP_ROWS
    assert K.reference_config(K.IMPL_WGMMA, 64) == w  # by implementation name, as before


def test_reference_interprets_the_kernel_layout():
    """The registry describes a kernel's numerics as data; the reference turns it into the simulation's config."""
    from sage_patch.reference import Grouping, SimConfig, simulate

    w = registry.get("wgmma-fp8").reference_config(64)
    cfg = SimConfig.of(w)
    assert (cfg.q_group, cfg.k_group) == (Grouping(16, 8, 1), Grouping(128, 8, 2))
    assert (cfg.block_k, cfg.row_sum, cfg.stats_sample, cfg.pv) == (128, "operand", 128, "fp8")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 300, 64, generator=g) for _ in range(3))
    out = simulate(q, k, v, "8b", config=w)
    assert torch.equal(out, simulate(q, k, v, "8b", config=cfg))
    assert not torch.equal(out, simulate(q, k, v, "8b"))       # the layout is in effect, not the defaults


def test_sdpa_crossover_is_data_of_the_variant():
    assert registry.get("wgmma-fp8").sdpa_faster_below["sm_90"][(128, False)] == 2048
    assert registry.get("wgmma-fp8").crossover((9, 0), 128, False) == 2048


@pytest.mark.parametrize("cc", [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0), (13, 0)])
def test_every_variant_that_runs_on_hopper_has_a_crossover_there(cc):
    """Every variant that can run on a GPU we measure (sm_90) has a crossover for every head dim and causal flag;
    the portable mma.sync kernels are slower than SDPA there at every length (inf). Elsewhere the table states the
    assumption: sm_100 as sm_90, the others no entry (the kernel runs)."""
    for v in registry.VARIANTS:
        can_run_on_hopper = any(v.why_not(Target((9, 0), ALL, p, d), ignore=("pv", "qk")) is None
                                for p in v.precisions for d in registry.NATIVE_HEAD_DIMS)
        if not can_run_on_hopper:
            continue
        for d in registry.NATIVE_HEAD_DIMS:
            for causal in (False, True):
                n = v.crossover(cc, d, causal)
                if cc == (9, 0):
                    assert n is not None and (v.family == "wgmma" or n == float("inf")), (v.key, d, causal)
                elif v.family == "mma":
                    assert n == (float("inf") if cc[0] == 10 else None), (v.key, cc)
    assert registry.arch_key((10, 3)) == "sm_100" and registry.arch_key((8, 7)) == "sm_87"
    assert "sm_80/86/89/120" in registry.SPEED_ASSUMPTION and "sm_100" in registry.SPEED_ASSUMPTION


# ---- training variants: the same type, the same select ---------------------------------------------------------

def _training(cc=(9, 0), d=128, dtype=torch.float16, triton=None):
    return Target(cc, ALL, "8b", d, training=True, dtype=dtype, triton=triton)


def test_one_select_serves_inference_and_training_targets(monkeypatch):
    v, why = registry.select(_training((8, 0), 64, torch.bfloat16))
    assert (v.key, why, v.trains) == ("sagebwd-triton", "ok", True)
    assert registry.select(Target((9, 0), ALL, "8b", 128))[0].key == "wgmma-fp8"
    # the Triton pair's own reasons (the registry narrowed to it: another training variant may serve some of these)
    monkeypatch.setattr(registry, "VARIANTS", tuple(v for v in registry.VARIANTS
                                                    if not v.trains or v.key == "sagebwd-triton"))
    assert registry.select(_training())[0].key == "sagebwd-triton"
    for t, why in ((_training(triton="Triton is not installed"), "Triton is not installed"),
                   (_training((7, 5)), "the SageBwd Triton kernels need sm_80+ (device is sm_75)"),
                   (_training(d=96), "head_dim 96: the SageBwd Triton kernels have head dims (64, 128) only"),
                   (_training(dtype=torch.float32), "dtype float32: the SageBwd Triton kernels take float16 or "
                                                    "bfloat16")):
        assert registry.select(t) == (None, why)
    with pytest.raises(ValueError, match="a training target takes neither"):
        registry.select(_training(), pv="wgmma")
    # each kind serves its own calls only: forced modes and direct calls never reach a training variant
    assert "trains (forward + backward)" in registry.get("sagebwd-triton").why_not(Target((9, 0), ALL, "8b", 128))
    assert "has no backward pass" in registry.get("wgmma-fp8").why_not(_training())
    for cc in ((8, 0), (8, 9), (9, 0)):
        for pv in registry.PV_MODES:
            v, _ = registry.select(Target(cc, ALL, "8b"), pv=pv)
            assert v is None or not v.trains
        assert not registry.explicit(Target(cc, ALL, "8b"), "fp8").trains


def test_training_capability_is_the_sagebwd_packages_own(monkeypatch):
    """The training family checks its own head dims and dtypes (sagebwd.HEAD_DIMS, sagebwd.DTYPES), not the
    inference kernels' NATIVE_HEAD_DIMS."""
    from sage_patch.kernels import sagebwd

    monkeypatch.setattr(registry, "VARIANTS", tuple(v for v in registry.VARIANTS
                                                    if not v.trains or v.key == "sagebwd-triton"))
    monkeypatch.setattr(registry, "NATIVE_HEAD_DIMS", (64,))
    assert registry.select(_training(d=128))[0].key == "sagebwd-triton"
    monkeypatch.setattr(sagebwd, "HEAD_DIMS", (64,))
    assert registry.select(_training(d=128)) == (
        None, "head_dim 128: the SageBwd Triton kernels have head dims (64,) only")
    monkeypatch.setattr(sagebwd, "DTYPES", (torch.bfloat16,))
    assert registry.select(_training(d=64))[1] == "dtype float16: the SageBwd Triton kernels take bfloat16"


def test_sm90a_backward_can_run_where_it_is_not_routed(monkeypatch):
    """sagebwd.hopper.cannot_run is the kernel's own capability (what the GPU tests run it at: every head dim it
    has); unsupported_reason adds the speed rule (FASTER_HEAD_DIMS) on top of it."""
    from sage_patch.kernels.sagebwd import hopper

    for d in hopper.HEAD_DIMS:
        assert hopper.cannot_run(_training(d=d)) is None
        assert (hopper.unsupported_reason(_training(d=d)) is None) == (d in hopper.FASTER_HEAD_DIMS)
    monkeypatch.setattr(hopper, "FASTER_HEAD_DIMS", (128,))  # a head dim where the Triton backward measured faster
    assert hopper.cannot_run(_training(d=64)) is None
    assert "the SageBwd Triton backward is faster there" in hopper.unsupported_reason(_training(d=64))
    assert hopper.unsupported_reason(_training(d=128)) is None
    assert "sm_90 only (device is sm_89)" in hopper.cannot_run(_training(d=128, cc=(8, 9)))
    assert "no sm_90a SASS" in hopper.cannot_run(dataclasses.replace(_training(d=128), archs=("80",)))


def test_training_crossover_is_the_variants_own_table():
    """A training variant's crossover is its table as it stands (per arch, head dim and causal), without the
    inference kernels' padded-head-dim assumption."""
    import math

    tv = registry.get("sagebwd-triton")
    assert tv.crossover((9, 0), 128, True) == math.inf and tv.crossover((8, 6), 64, False) == math.inf
    custom = dataclasses.replace(tv, sdpa_faster_below={"sm_90": {(128, False): 4096, (96, False): 1024}})
    assert custom.crossover((9, 0), 128, False) == 4096 and custom.crossover((9, 0), 128, True) is None
    assert custom.crossover((8, 9), 128, False) is None
    assert custom.crossover((9, 0), 96, False) == 1024 and custom.crossover((9, 0), 100, False) is None
    # an inference table reads padded head dims through the measured stand-in (96 for 100), SDPA below it (72)
    inference = dataclasses.replace(registry.get("wgmma-fp8"), sdpa_faster_below=custom.sdpa_faster_below)
    assert inference.crossover((9, 0), 100, False) == 1024 and inference.crossover((9, 0), 72, False) == math.inf


# ---- resolve hands the descriptor to the launch ---------------------------------------------------------------

@pytest.fixture
def fake_cuda(monkeypatch):
    """CPU tensors posing as CUDA ones on an sm_90 device with a loaded library; launches recorded."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: self.device.type == "cpu"), raising=False)
    monkeypatch.setattr(R, "_kernels_loaded", lambda: True)
    monkeypatch.setattr(K, "_status", lambda: {"loaded": True, "reason": "fake", "path": None, "archs": list(ALL)})
    monkeypatch.setattr(K, "_ops_cc", lambda q: (9, 0))
    monkeypatch.setattr(K._lib, "_LIB", types.SimpleNamespace(handle=None, reason="fake", path=None, archs=list(ALL)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    calls = []

    def run_varlen(variant, precision, q, *a, **kw):
        calls.append(("varlen", variant, precision))
        out = q.new_zeros(q.shape)
        return (out, q.new_zeros(q.shape[1], q.shape[0])) if kw.get("return_lse") else out

    def run(variant, precision, q, *a, **kw):
        calls.append(("padded", variant, precision))
        return q.new_zeros(q.shape)

    monkeypatch.setattr(K, "run_varlen", run_varlen)
    monkeypatch.setattr(K, "run", run)
    return calls


def test_resolve_returns_the_variant(fake_cuda, monkeypatch):
    monkeypatch.setattr(K, "SPEED_ROUTING", False)
    q = torch.randn(1, 2, 64, 128, dtype=torch.float16)
    from sage_patch.masks import MaskInfo

    d = R.resolve("8b", q, q, q, layout="bhsd", is_causal=False, mask=MaskInfo("none", None), dropout_p=0.0,
                  return_lse=False, smooth_v=False)
    assert d.variant is registry.get("wgmma-fp8") and d.impl == K.IMPL_WGMMA and d.reason is None
    import sage_patch

    from sage_patch.api import run_attention
    from sage_patch.policy import Policy

    run_attention(q, q, q, precision="4b", policy=Policy(exact_4b=True))
    assert fake_cuda[-1] == ("padded", registry.get("mma-fp8f16"), "4b")
    sage_patch.attention(q, q, q, precision="4b")  # no INT4 tensor cores on sm_90: 8b's kernel stands in
    assert fake_cuda[-1] == ("padded", registry.get("wgmma-fp8"), "8b")


def test_varlen_goes_through_resolve_and_is_recorded(fake_cuda, monkeypatch):
    from sage_patch.report import GLOBAL_STATS
    from sage_patch.varlen import varlen_attention

    monkeypatch.setattr(K, "SPEED_ROUTING", False)
    GLOBAL_STATS.reset()
    q = torch.randn(40, 4, 64, dtype=torch.float16)
    k = torch.randn(50, 2, 64, dtype=torch.float16)
    cu_q = torch.tensor([0, 15, 40], dtype=torch.int32)
    cu_k = torch.tensor([0, 20, 50], dtype=torch.int32)
    out, lse = varlen_attention(q, k, k, cu_q, cu_k, is_causal=True, return_lse=True)
    assert fake_cuda == [("varlen", registry.get("wgmma-fp8"), "8b")]
    d = GLOBAL_STATS.to_dict()
    assert d["calls"] == 1 and d["impl"] == {K.IMPL_WGMMA: 1}


def test_varlen_keeps_the_kernel_below_the_crossover(fake_cuda, monkeypatch):
    """Speed routing compares with one SDPA call; a packed batch's alternative is a per-sequence loop, so varlen
    keeps the kernel at any length, while the same short lengths as a dense batch route to SDPA."""
    from sage_patch.masks import MaskInfo

    monkeypatch.setattr(K, "SPEED_ROUTING", True)
    q = torch.randn(40, 4, 64, dtype=torch.float16)
    cu = torch.tensor([0, 15, 40], dtype=torch.int32)
    kw = dict(is_causal=False, mask=MaskInfo("none", None), dropout_p=0.0, return_lse=False, smooth_v=False)
    d = R.resolve("8b", q, q, q, layout="varlen", varlen=R.Varlen(cu, cu, 25, 25), **kw)
    assert d.variant is registry.get("wgmma-fp8") and d.reason is None
    qd = q[None, :25]
    d = R.resolve("8b", qd, qd, qd, layout="bshd", **kw)
    assert d.impl == "sdpa" and d.variant is None and "25" in d.reason

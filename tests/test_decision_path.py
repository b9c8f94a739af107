"""Decision.path: what runs a decided call, the one thing run_attention (and varlen, the CLI) dispatch on; each path
reached; training's speed routing switched by the policy's options.training_speed_routing, not by
SAGE_PATCH_SPEED_ROUTING; the report naming the variant that ran and why SDPA ran instead. CPU only (a faked sm_90
for the kernel paths, launches recorded)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import sage_patch
import sage_patch.api as api
import sage_patch.kernels as K
from sage_patch import resolve as R
from sage_patch.kernels import registry
from sage_patch.masks import MaskInfo
from sage_patch.policy import Policy
from sage_patch.report import GLOBAL_STATS
from sage_patch.resolve import PATHS, Decision
from tests.conftest import structured_qkv

CALL = dict(layout="bhsd", is_causal=False, mask=MaskInfo("none", None), dropout_p=0.0, return_lse=False,
            smooth_v=False)


def test_a_decision_names_a_valid_path():
    assert PATHS == ("sdpa", "reference", "kernel", "training-kernel", "training-reference")
    wgmma, triton = registry.get("wgmma-fp8"), registry.get("sagebwd-triton")
    with pytest.raises(TypeError, match="path"):
        Decision("8b", "full", "sdpa", None)  # no default: a decision always says what runs it
    with pytest.raises(ValueError, match="must be one of"):
        Decision("8b", "8b", "triton-sagebwd", None, triton, path="triton")
    for path, variant in (("kernel", None), ("training-kernel", wgmma), ("kernel", triton), ("sdpa", wgmma),
                          ("training-reference", triton)):
        with pytest.raises(ValueError, match="does not match variant"):
            Decision("8b", "8b", "x", None, variant, path=path)
    assert Decision("8b", "8b", triton.name, None, triton, path="training-kernel").variant is triton


def test_each_cpu_path_is_reached_and_dispatched(monkeypatch):
    q, k, v = structured_qkv(b=1, h=2, sq=48, d=32, seed=1)
    assert R.resolve("8b", q, k, v, **CALL).path == "reference"
    assert R.resolve("full", q, k, v, **CALL).path == "sdpa"
    qg = q.clone().requires_grad_()
    assert R.resolve("8b", qg, k, v, **CALL).path == "training-reference"
    assert R.resolve("full", qg, k, v, **CALL).path == "sdpa"
    launched = []
    real = api.sagebwd_attention
    monkeypatch.setattr(api, "sagebwd_attention", lambda *a, **kw: launched.append(kw["kernel"]) or real(*a, **kw))
    api.run_attention(qg, k, v, precision="8b").sum().backward()
    assert launched == [False] and qg.grad is not None  # the reference simulation through autograd


@pytest.mark.parametrize("path,impl,runs", [("reference", "sdpa", "simulate"), ("sdpa", "reference", "full")])
def test_run_attention_dispatches_on_the_path_not_the_impl_string(monkeypatch, path, impl, runs):
    """A decision whose impl string says one thing and whose path another runs its path: the string is for reports."""
    q, k, v = structured_qkv(b=1, h=2, sq=64, d=32, seed=2)
    sim = api.simulate(q, k, v, "8b", is_causal=False)
    full = api.full_attention(q, k, v, is_causal=False, scale=None, mask=MaskInfo("none", None), dropout_p=0.0,
                              return_lse=False)
    assert not torch.equal(sim, full)
    monkeypatch.setattr(api, "resolve", lambda *a, **kw: Decision("8b", "8b", impl, None, path=path))
    out = api.run_attention(q, k, v, precision="8b")
    assert torch.equal(out, sim if runs == "simulate" else full)


@pytest.fixture
def hopper(fake_cuda, monkeypatch):
    """A faked sm_90 with the library loaded and Triton usable; inference kernel launches and training calls
    recorded instead of run (returning zeros)."""
    fake = fake_cuda(["90a"])
    fake["cc"] = (9, 0)
    monkeypatch.setattr(K, "_TRITON_REASON", [None])
    # the training variants narrowed to the Triton pair, whose decisions these tests spell out
    monkeypatch.setattr(registry, "VARIANTS", tuple(v for v in registry.VARIANTS
                                                    if not v.trains or v.key == "sagebwd-triton"))
    calls = []

    def run(variant, precision, q, *a, **kw):
        calls.append(("kernel", variant.key))
        return q.new_zeros(q.shape)

    def train(q, k, v, **kw):
        calls.append(("training", kw["kernel"]))
        return q * 0

    monkeypatch.setattr(K, "run", run)
    monkeypatch.setattr(api, "sagebwd_attention", train)
    GLOBAL_STATS.reset()
    return calls


def _with_training_crossover(monkeypatch, table):
    """The registry with the training variant's crossover replaced (as a measured one would be)."""
    tv = dataclasses.replace(registry.get("sagebwd-triton"), sdpa_faster_below=table)
    monkeypatch.setattr(registry, "VARIANTS", tuple(tv if v.key == tv.key else v for v in registry.VARIANTS))
    return tv


def test_gpu_paths_launch_the_decided_variant_and_the_report_names_it(hopper, monkeypatch):
    monkeypatch.setattr(K, "SPEED_ROUTING", False)
    q = torch.randn(1, 2, 256, 128, dtype=torch.float16)
    d = R.resolve("8b", q, q, q, **CALL)
    assert (d.path, d.variant.key) == ("kernel", "wgmma-fp8")
    api.run_attention(q, q, q, precision="8b")
    qg = q.clone().requires_grad_()
    d = R.resolve("8b", qg, q, q, **{**CALL, "policy": Policy(training_speed_routing=False)})
    assert (d.path, d.variant.key, d.impl) == ("training-kernel", "sagebwd-triton", "triton-sagebwd")
    api.run_attention(qg, q, q, precision="8b", policy=Policy(training_speed_routing=False))
    assert hopper == [("kernel", "wgmma-fp8"), ("training", "sagebwd-triton")]
    st = GLOBAL_STATS.to_dict()
    assert st["impl"] == {K.IMPL_WGMMA: 1, "triton-sagebwd": 1}
    assert st["variant"] == {"wgmma-fp8": 1, "sagebwd-triton": 1}
    assert "cuda-wgmma-fp8pv:1, triton-sagebwd:1 [wgmma-fp8:1, sagebwd-triton:1]" in str(sage_patch.report())


def test_training_speed_routing_is_the_policys_switch_not_the_env(hopper, monkeypatch):
    tv = _with_training_crossover(monkeypatch, {"sm_90": {(128, False): 4096, (128, True): 8192}})
    short = torch.empty(1, 2, 2048, 128, dtype=torch.float16, requires_grad=True)
    long = torch.empty(1, 2, 4096, 128, dtype=torch.float16, requires_grad=True)
    off = Policy.from_yaml("options:\n  training_speed_routing: false\n")
    for env in (True, False):  # SAGE_PATCH_SPEED_ROUTING, inference's switch, changes nothing here
        monkeypatch.setattr(K, "SPEED_ROUTING", env)
        for policy in (None, Policy(), Policy(training_speed_routing=True)):
            d = R.resolve("8b", short, short, short, **{**CALL, "policy": policy})
            assert d.path == "sdpa" and d.reason == (
                "SDPA is faster than triton-sagebwd below 4096 tokens on sm_90 (head dim 128, causal=False; this call "
                "2048): running full precision (policy options.training_speed_routing: false keeps the kernel)")
            d = R.resolve("8b", long, long, long, **{**CALL, "policy": policy})
            assert (d.path, d.variant, d.reason) == ("training-kernel", tv, None)
            assert R.resolve("8b", long, long, long, **{**CALL, "policy": policy, "is_causal": True}).path == "sdpa"
        d = R.resolve("8b", short, short, short, **{**CALL, "policy": off})  # off: the kernel wherever it can run
        assert (d.path, d.variant, d.reason) == ("training-kernel", tv, None)
        assert R.resolve("8b", short, short, short, **{**CALL, "policy": off, "is_causal": True}).path == \
            "training-kernel"
    q96 = torch.empty(1, 2, 2048, 96, dtype=torch.float16, requires_grad=True)  # off does not widen what it serves
    d = R.resolve("8b", q96, q96, q96, **{**CALL, "policy": off})
    assert d.path == "sdpa" and "head_dim 96" in d.reason


def test_the_report_says_why_a_training_call_ran_sdpa(hopper):
    q = torch.randn(1, 2, 256, 128, dtype=torch.float16, requires_grad=True)
    api.run_attention(q, q, q, precision="8b")
    assert hopper == []  # SDPA, not the training kernel
    why = ("SDPA is faster than triton-sagebwd at every measured length on sm_90 (head dim 128, causal=False; this "
           "call 256): running full precision (policy options.training_speed_routing: false keeps the kernel)")
    st = GLOBAL_STATS.to_dict()
    assert st["used"] == {"full": 1} and st["fallbacks"] == {why: 1} and "variant" not in st
    assert why in str(sage_patch.report())


def test_sagebwd_attention_launches_training_variants_only():
    from sage_patch.trainable import KERNEL_CONFIG, kernel_config, sagebwd_attention

    assert kernel_config("sagebwd-triton") == KERNEL_CONFIG
    q, k, v = structured_qkv(b=1, h=2, sq=16, d=16, seed=3)
    for bad in ("wgmma-fp8", "sagebwd-nope"):
        with pytest.raises(ValueError, match=r"is not a training kernel; allowed: .*'sagebwd-triton'"):
            sagebwd_attention(q, k, v, is_causal=False, scale=None, attn_mask=None, kernel=bad)


def test_a_second_training_variant_is_one_entry(hopper, monkeypatch):
    """Room for the CUDA training kernel: one more KernelVariant(trains=True) ahead of the Triton pair, with its own
    capability and crossover, is chosen where it serves and beats SDPA, and the Triton pair elsewhere."""
    def sm90_only(t):
        return None if t.cc == (9, 0) else f"sm_90 only (device is sm_{t.cc[0]}{t.cc[1]})"

    second = registry.KernelVariant("sagebwd-second", "cuda-second-sagebwd", None, "wgmma", "int8", "input", ("8b",),
                                    (sm90_only,), sdpa_faster_below={"sm_90": {(128, False): 4096}}, trains=True,
                                    launch="sage_patch.kernels.sagebwd")
    triton = registry.get("sagebwd-triton")
    monkeypatch.setattr(registry, "VARIANTS", tuple(v for v in registry.VARIANTS if not v.trains) + (second, triton))
    q = torch.empty(1, 2, 8192, 128, dtype=torch.float16, requires_grad=True)
    d = R.resolve("8b", q, q, q, **CALL)
    assert (d.path, d.variant, d.impl) == ("training-kernel", second, "cuda-second-sagebwd")
    api.run_attention(q, q, q, precision="8b")
    assert hopper == [("training", "sagebwd-second")]
    short = torch.empty(1, 2, 2048, 128, dtype=torch.float16, requires_grad=True)
    assert "SDPA is faster than cuda-second-sagebwd below 4096 tokens" in R.resolve("8b", short, short, short,
                                                                                   **CALL).reason
    t = registry.Target((8, 9), ("89",), "8b", 128, training=True, dtype=torch.float16)
    assert registry.select(t)[0] is triton
    v, why = registry.select(dataclasses.replace(t, triton="Triton is not installed"))
    assert v is None and why == "sagebwd-second: sm_90 only (device is sm_89); sagebwd-triton: Triton is not installed"

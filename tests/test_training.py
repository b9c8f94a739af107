"""Training through sage_patch: the trainable 8b (SageBwd reference simulation on CPU) behind autograd, the resolver's
choices for calls that need a gradient, the policy key `training`, a tiny Llama training loop, torch.compile."""

import logging

import pytest
import torch

import sage_patch
from sage_patch.reference.sagebwd import sagebwd_backward, sagebwd_forward
from sage_patch.report import GLOBAL_STATS
from tests.conftest import structured_qkv


def _leaves(*ts):
    return [t.detach().clone().requires_grad_() for t in ts]


def _simulated(q, k, v, dout, **kw):
    """Output and gradients straight from the reference simulation, in the input dtype."""
    out, _, saved = sagebwd_forward(q, k, v, **kw)
    return (out.to(q.dtype), *(g.to(q.dtype) for g in sagebwd_backward(dout, saved)))


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_attention_gradients_equal_the_simulations_backward(layout, one_thread):
    q, k, v = structured_qkv(b=2, h=4, hkv=2, sq=80, skv=96, d=32, dtype=torch.float16, seed=1)
    kp = torch.ones(2, 96, dtype=torch.bool)
    kp[1, 70:] = False
    dout = torch.randn(2, 4, 80, 32, generator=torch.Generator().manual_seed(2)).half()
    ref = _simulated(q, k, v, dout, is_causal=True, attn_mask=kp)
    t = (lambda x: x.transpose(1, 2).contiguous()) if layout == "bshd" else (lambda x: x)
    qg, kg, vg = _leaves(t(q), t(k), t(v))
    GLOBAL_STATS.reset()
    out = sage_patch.attention(qg, kg, vg, layout=layout, is_causal=True, attn_mask=kp, precision="8b")
    out.backward(t(dout))
    for got, want in zip((out, qg.grad, kg.grad, vg.grad), ref):
        assert got.dtype == torch.float16
        torch.testing.assert_close(t(want), got, atol=0, rtol=0)
    assert GLOBAL_STATS.impls == {"reference-sagebwd": 1} and GLOBAL_STATS.used == {"8b": 1}
    assert "reference-sagebwd" in str(sage_patch.report())


def test_sdpa_drop_in_trains_through_the_simulation(one_thread):
    q, k, v = structured_qkv(b=1, h=2, sq=64, d=32, seed=3)
    dout = torch.randn(1, 2, 64, 32, generator=torch.Generator().manual_seed(4))
    ref = _simulated(q, k, v, dout, is_causal=True)
    qg, kg, vg = _leaves(q, k, v)
    out = sage_patch.sdpa(qg, kg, vg, is_causal=True)
    out.backward(dout)
    for got, want in zip((out, qg.grad, kg.grad, vg.grad), ref):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("precision", ["4b", "fp4"])
def test_precisions_without_backward_train_as_8b_with_a_logged_reason(precision, caplog):
    q, k, v = _leaves(*structured_qkv(b=1, h=2, sq=32, d=16, seed=5))
    GLOBAL_STATS.reset()
    with caplog.at_level(logging.WARNING, logger="sage_patch"):
        sage_patch.attention(q, k, v, precision=precision).sum().backward()
    assert GLOBAL_STATS.used == {"8b": 1} and GLOBAL_STATS.impls == {"reference-sagebwd": 1}
    why = f"{precision} has no backward pass"
    assert any(why in r for r in GLOBAL_STATS.fallbacks) and any(why in r.message for r in caplog.records)
    with torch.no_grad():  # without a gradient the precision is the one asked for
        sage_patch.attention(q, k, v, precision=precision)
    assert GLOBAL_STATS.used[precision] == 1


@pytest.mark.parametrize("kw,why", [({"dropout_p": 0.1}, "dropout_p=0.1"), ({"return_lse": True}, "return_lse"),
                                    ({"precision": "full"}, None)])
def test_what_the_trainable_8b_cannot_do_runs_full(kw, why):
    from sage_patch.api import run_attention

    q, k, v = _leaves(*structured_qkv(b=1, h=2, sq=32, d=16, seed=6))
    GLOBAL_STATS.reset()
    res = run_attention(q, k, v, **{"precision": "8b", **kw})
    (res[0] if isinstance(res, tuple) else res).sum().backward()
    assert GLOBAL_STATS.used == {"full": 1} and q.grad is not None
    assert list(GLOBAL_STATS.fallbacks) == [] if why is None else any(why in r for r in GLOBAL_STATS.fallbacks)


def test_float_masks_with_a_gradient_run_full():
    q, k, v = _leaves(*structured_qkv(b=1, h=2, sq=32, d=16, seed=6))
    fmask = torch.zeros(1, 1, 32, 32)
    GLOBAL_STATS.reset()
    sage_patch.attention(q, k, v, attn_mask=fmask).sum().backward()
    assert GLOBAL_STATS.used == {"full": 1} and any("float additive" in r for r in GLOBAL_STATS.fallbacks)


def test_on_a_gpu_gradients_take_the_kernel_where_it_serves_and_is_faster(fake_cuda, monkeypatch):
    import sage_patch.kernels as K
    from sage_patch import resolve as R
    from sage_patch.masks import MaskInfo
    from sage_patch.policy import Policy

    fake = fake_cuda(["90a"])
    fake["cc"] = (9, 0)
    q = torch.empty(1, 2, 4096, 128, dtype=torch.float16, requires_grad=True)
    call = dict(layout="bhsd", is_causal=False, mask=MaskInfo("none", None), dropout_p=0.0, return_lse=False,
                smooth_v=False)
    monkeypatch.setattr(K, "_TRITON_REASON", ["Triton is not installed (pip install triton)"])
    d = R.resolve("8b", q, q, q, **call)
    assert (d.precision, d.impl) == ("full", "sdpa") and "Triton is not installed" in d.reason
    monkeypatch.setattr(K, "_TRITON_REASON", [None])
    monkeypatch.setattr(K, "SPEED_ROUTING", True)
    d = R.resolve("8b", q, q, q, **call)  # slower than cuDNN at every measured length: SDPA, with the reason
    assert (d.precision, d.impl) == ("full", "sdpa") and "SDPA is faster than cuda-wgmma-sagebwd at every" in d.reason
    assert "policy options.training_speed_routing: false keeps the kernel" in d.reason
    kp = MaskInfo("key_padding", torch.ones(1, 4096, dtype=torch.bool))
    assert R.resolve("8b", q, q, q, **{**call, "mask": kp}).impl == "sdpa"  # key padding is routed too
    no_routing = Policy(training_speed_routing=False)
    call = {**call, "policy": no_routing}
    d = R.resolve("8b", q, q, q, **call)
    # sm_90 at D=64 and 128: the sm_90a backward (faster than the Triton one there)
    assert (d.precision, d.impl, d.reason) == ("8b", "cuda-wgmma-sagebwd", None) and d.variant.key == "sagebwd-hopper"
    assert d.path == "training-kernel"
    q64 = torch.empty(1, 2, 4096, 64, dtype=torch.float16, requires_grad=True)
    assert R.resolve("8b", q64, q64, q64, **call).variant.key == "sagebwd-hopper"
    d = R.resolve("4b", q, q, q, **call)
    assert (d.precision, d.impl) == ("8b", "cuda-wgmma-sagebwd") and "4b has no backward pass" in d.reason
    assert R.resolve("8b", q, q, q, **{**call, "mask": kp}).impl == "cuda-wgmma-sagebwd"
    dense = MaskInfo("dense", torch.ones(1, 1, 4096, 4096, dtype=torch.bool))
    assert "key-padding masks only" in R.resolve("8b", q, q, q, **{**call, "mask": dense}).reason
    q96 = torch.empty(1, 2, 4096, 96, dtype=torch.float16, requires_grad=True)
    assert "head_dim 96: the SageBwd Triton kernels have head dims (64, 128)" in R.resolve("8b", q96, q96, q96,
                                                                                          **call).reason
    q32 = q.detach().float().requires_grad_()
    assert "dtype float32: the SageBwd Triton kernels take float16 or bfloat16" in R.resolve("8b", q32, q32, q32,
                                                                                             **call).reason
    monkeypatch.setattr(R, "SIMULATE_ON_GPU", True)
    d = R.resolve("8b", q, q, q, **call)
    assert (d.precision, d.impl) == ("8b", "reference-sagebwd") and "SAGE_PATCH_SIMULATE_ON_GPU=1" in d.reason
    assert d.path == "training-reference" and d.variant is None
    with torch.no_grad():  # the forward path is unchanged: the kernel
        assert R.resolve("8b", q, q, q, **call).impl != "sdpa"


def test_double_backward_raises_clearly():
    q, k, v = _leaves(*structured_qkv(b=1, h=2, sq=32, d=16, seed=7))
    out = sage_patch.attention(q, k, v, precision="8b")
    (gq,) = torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)  # a first backward with a graph is fine
    with pytest.raises(RuntimeError, match="double backward"):
        gq.sum().backward()


def test_backward_allocates_nothing_before_the_backward_op():
    """Autograd would hand the backward zero gradients for the non-differentiable outputs (the INT8 Q^ and K^ are
    half as large as Q and K), allocated before the op runs and alive through it: a peak-memory cost for nothing."""
    from torch.utils._python_dispatch import TorchDispatchMode

    q, k, v = _leaves(*structured_qkv(b=1, h=2, sq=32, d=16, seed=5))
    out = sage_patch.attention(q, k, v, precision="8b")
    ops = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Record():
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert "sage_patch.sagebwd_bwd.default" in ops
    assert not [op for op in ops if "zeros" in op or "empty" in op or "full" in op], ops
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)


def test_custom_ops_pass_opcheck():
    from sage_patch.trainable import sagebwd_attention  # noqa: F401  (registers the ops)

    q, k, v = _leaves(*structured_qkv(b=1, h=4, hkv=2, sq=40, skv=48, d=16, dtype=torch.float16, seed=8))
    kp = torch.rand(1, 48, generator=torch.Generator().manual_seed(0)) > 0.2
    args = (q, k, v, kp, True, 0.25, "token", 16, 16, True, "input", "rowmax", "input", "")
    torch.library.opcheck(torch.ops.sage_patch.sagebwd_fwd.default, args)
    outs = torch.ops.sage_patch.sagebwd_fwd(*[a.detach() if isinstance(a, torch.Tensor) else a for a in args])
    dout = torch.randn(1, 4, 40, 16).half()
    bwd = (dout, outs[3], outs[4], outs[5], outs[6], v.detach(), outs[0], outs[2], kp, True, 0.25, "token", 16, 16,
           True, "input", "rowmax", "input", "")
    torch.library.opcheck(torch.ops.sage_patch.sagebwd_bwd.default, bwd,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_torch_compile_fullgraph_training_step():
    torch._dynamo.reset()
    proj = torch.nn.Linear(16, 16)
    x = torch.randn(2, 24, 16, generator=torch.Generator().manual_seed(9))

    def step(x):
        q = k = v = proj(x).view(2, 24, 2, 8)
        out = sage_patch.attention(q, k, v, layout="bshd", is_causal=True, precision="8b")
        return out.float().pow(2).mean()

    loss = torch.compile(step, fullgraph=True)(x)
    loss.backward()
    compiled = [p.grad.clone() for p in proj.parameters()]
    proj.zero_grad()
    step(x).backward()
    for a, b in zip(compiled, (p.grad for p in proj.parameters())):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in compiled)


def test_route_sdpa_compiled_training_step_traces_the_trainable_op():
    import torch.nn.functional as F

    class SelfAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, 48)

        def forward(self, x):
            q, k, v = self.proj(x).view(2, 24, 3, 2, 8).permute(2, 0, 3, 1, 4)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    torch._dynamo.reset()
    model = torch.nn.Sequential(SelfAttention())
    x = torch.randn(2, 24, 16, generator=torch.Generator().manual_seed(12))
    with sage_patch.route_sdpa(model, policy="8b"):
        torch.compile(model, fullgraph=True)(x).pow(2).mean().backward()
        compiled = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        model(x).pow(2).mean().backward()
        st = sage_patch.report(model).to_dict()["0"]
    for a, b in zip(compiled, (p.grad for p in model.parameters())):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert st["impl"] == {"reference-sagebwd": 2}


def test_varlen_gradients_equal_per_sequence_attention():
    g = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(30, h, 16, generator=g) for h in (4, 2, 2))
    cu = torch.tensor([0, 10, 30], dtype=torch.int32)
    qg, kg, vg = _leaves(q, k, v)
    sage_patch.varlen_attention(qg, kg, vg, cu, cu, is_causal=True).pow(2).sum().backward()
    for a, b in ((0, 10), (10, 30)):
        qs, ks, vs = _leaves(q[None, a:b], k[None, a:b], v[None, a:b])
        sage_patch.attention(qs, ks, vs, layout="bshd", is_causal=True).pow(2).sum().backward()
        for got, want in ((qg.grad, qs.grad), (kg.grad, ks.grad), (vg.grad, vs.grad)):
            torch.testing.assert_close(got[a:b], want[0], atol=1e-6, rtol=1e-5)


def test_diffusers_transformer_trains_through_the_trainable_8b():
    from tests.test_diffusers_integration import tiny_flux

    model, inputs = tiny_flux()
    model.train().enable_sage_attention("8b")
    try:
        model(**inputs)[0].pow(2).mean().backward()
        rep = sage_patch.report(model).to_dict()
    finally:
        model.disable_sage_attention()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert len(rep) == 4 and all(st["impl"] == {"reference-sagebwd": 1} for st in rep.values()), rep


# ---- a transformers model ---------------------------------------------------------------------------------------

def _tiny_llama(impl, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM._from_config(cfg, attn_implementation=impl)


def _train(model, steps, ids, am=None):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=am, labels=ids).loss
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def test_tiny_llama_trains_through_the_trainable_8b():
    ids = torch.randint(1, 128, (2, 48), generator=torch.Generator().manual_seed(10))
    am = torch.ones_like(ids)
    am[1, :8] = 0  # left padding: a key-padding mask reaches the attention
    sage = _tiny_llama("sage")
    sage.load_state_dict(_tiny_llama("sdpa").state_dict())
    sage_patch.set_policy(sage, "8b")  # the shipped llama policy runs sequences under 128 tokens full
    full_losses = _train(_tiny_llama("sdpa"), 6, ids, am)
    sage_losses = _train(sage, 6, ids, am)
    assert sage_losses[-1] < sage_losses[0] - 0.1, sage_losses
    # the same model and data in full precision: the curves agree (measured: at most 3.1e-3 apart)
    assert max(abs(a - b) for a, b in zip(sage_losses, full_losses)) < 0.01, (sage_losses, full_losses)
    for st in sage_patch.report(sage).to_dict().values():
        assert st["impl"] == {"reference-sagebwd": 6} and st["used"] == {"8b": 6}


def test_policy_training_key_keeps_inference_and_training_apart():
    ids = torch.randint(1, 128, (1, 32), generator=torch.Generator().manual_seed(11))
    for policy, train_impl, infer_impl in (({"default": "8b", "training": "full"}, "sdpa", "reference"),
                                           ({"default": "full", "training": "8b"}, "reference-sagebwd", None),
                                           ({"default": "4b"}, "reference-sagebwd", "reference")):
        model = _tiny_llama("sage")
        sage_patch.set_policy(model, policy)
        _train(model, 1, ids)
        with torch.no_grad():
            model(ids)
        for st in sage_patch.report(model).to_dict().values():
            assert st["impl"].get(train_impl) == 1, (policy, st)
            if infer_impl is not None:  # a full layer without a gradient runs the caller's own SDPA (not counted)
                assert st["impl"].get(infer_impl) == 1, (policy, st)


def test_the_cpu_default_numerics_are_the_gpu_kernels():
    from sage_patch.reference.sagebwd import DEFAULT_SAGEBWD_CONFIG
    from sage_patch.trainable import KERNEL_CONFIG

    assert KERNEL_CONFIG == DEFAULT_SAGEBWD_CONFIG


def test_every_config_field_reaches_the_simulation():
    """sagebwd_attention(config=...) runs exactly that config (each field travels through the custom ops)."""
    from sage_patch.reference.sagebwd import SageBwdConfig, sagebwd_forward
    from sage_patch.trainable import sagebwd_attention

    q, k, v = structured_qkv(b=1, h=2, sq=70, d=16, dtype=torch.float16, seed=21)
    for cfg in (SageBwdConfig(pv="int8"), SageBwdConfig(groups="block", block_q=32, block_k=16, pv="int8", dp="int8",
                                                        p_scale="unit", smooth_k=False)):
        ours = sagebwd_attention(q, k, v, is_causal=True, scale=None, attn_mask=None, config=cfg, kernel=False)
        ref = sagebwd_forward(q, k, v, is_causal=True, config=cfg)[0].to(q.dtype)
        assert torch.equal(ours, ref), cfg

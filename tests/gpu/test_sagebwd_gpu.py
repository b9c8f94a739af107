"""SageBwd kernels (sage_patch/kernels/sagebwd, Triton) on the GPU: against the reference simulation of their own
numerics (KERNEL_CONFIG), against float64 autograd of exact attention, and the contract of a training call (poisoned
memory, odd lengths, GQA, masks, layouts, determinism, CUDA graphs, routing)."""
import math
import os
import sys

import pytest
import torch

import sage_patch
from sage_patch.accuracy import cosine
from sage_patch.trainable import KERNEL_CONFIG, sagebwd_attention
from sage_patch.reference.sagebwd import sagebwd_backward, sagebwd_forward
from sage_patch.report import GLOBAL_STATS
from tests.conftest import structured_qkv

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from attention_fuzz import NONFINITE_WHERE, check_nonfinite_training  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

sagebwd = pytest.importorskip("sage_patch.kernels.sagebwd")
pytest.importorskip("triton")


def _trains_with(d: int) -> str:
    """What a training call of head dim d runs here: on Hopper at the head dims where the sm_90a backward is faster
    than the Triton one (the registry's sagebwd-hopper, FASTER_HEAD_DIMS), else the Triton pair."""
    from sage_patch.kernels.sagebwd.hopper import FASTER_HEAD_DIMS

    hopper = d in FASTER_HEAD_DIMS and torch.cuda.get_device_capability() == (9, 0)
    return "cuda-wgmma-sagebwd" if hopper else "triton-sagebwd"


def rel_l1(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().sum() / b.abs().sum().clamp_min(1e-30)).item()


def _inputs(b, hq, hkv, sq, skv, d, dtype, seed=0):
    q, k, v = structured_qkv(b=b, h=hq, hkv=hkv, sq=sq, skv=skv, d=d, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(b, hq, sq, d, generator=g)
    return [x.to("cuda", dtype) for x in (q, k, v, dout)]


def _key_padding(b, skv):
    m = torch.ones(b, skv, dtype=torch.bool, device="cuda")
    m[0, skv - max(1, skv // 3):] = False
    return m


def _kernel(q, k, v, dout, causal, mask):
    scale = 1 / math.sqrt(q.shape[-1])
    fwd = sagebwd.forward(q, k, v, is_causal=causal, scale=scale, key_padding_mask=mask)
    out, lse, lse_s, qi, qs, ki, ks = fwd
    grads = sagebwd.backward(dout, qi, qs, ki, ks, v, out, lse_s, is_causal=causal, scale=scale,
                             key_padding_mask=mask)
    return fwd, grads


CASES = [  # b, hq, hkv, sq, skv, d, causal, key padding
    (1, 2, 2, 256, 256, 64, False, False),
    (2, 4, 2, 300, 300, 128, True, False),
    (2, 6, 2, 129, 200, 64, True, True),      # GQA 3:1, bottom-right causal, padding, odd lengths
    (1, 2, 1, 333, 77, 128, True, False),     # Sq > Skv: the first rows see no key
    (2, 2, 2, 1, 190, 64, False, True),       # one query (decode-like)
    (1, 4, 4, 1000, 1000, 128, False, True),
]


def check_lse(q, k, qi, qs, ki, ks, lse, lse_s, r_lse, mask, causal):
    """A training forward's LSEs (CPU tensors): finite where the simulation's r_lse is; lse_s exactly the
    log-sum-exp of the kernel's own dequantized scores (a K^ entry one rounding step from the simulation's, the K
    mean being summed in another order, moves a whole row's LSE), lse = lse_s + tau q . mean(K). Returns the rows
    with a visible key."""
    b, hq, sq, d = q.shape
    skv, g = k.shape[2], hq // k.shape[1]
    fin = torch.isfinite(r_lse)
    assert torch.equal(fin, torch.isfinite(lse)) and torch.equal(fin, torch.isfinite(lse_s))
    scores = (qi.double() * qs.double()[..., None]) @ (ki.double() * ks.double()[..., None]).repeat_interleave(
        g, 1).transpose(-1, -2) / math.sqrt(d)
    from sage_patch.masks import combined_bool_mask
    vis = combined_bool_mask(mask, causal, sq, skv, scores.device)
    if vis is not None:
        scores = scores.masked_fill(~vis, -math.inf)
    exact = torch.logsumexp(scores, dim=-1)
    assert (lse_s[fin].double() - exact[fin]).abs().max().item() <= 2e-4
    shift = (q.double() @ k.double().mean(2, keepdim=True).repeat_interleave(g, 1).transpose(-1, -2)).squeeze(-1)
    assert ((lse - lse_s)[fin].double() - shift[fin] / math.sqrt(d)).abs().max().item() <= 2e-4
    return fin


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_kernels_match_the_simulation_of_their_numerics(case, dtype):
    b, hq, hkv, sq, skv, d, causal, kp = case
    q, k, v, dout = _inputs(b, hq, hkv, sq, skv, d, dtype)
    mask = _key_padding(b, skv) if kp else None
    (out, lse, lse_s, qi, qs, ki, ks), (dq, dk, dv) = _kernel(q, k, v, dout, causal, mask)
    cfg = KERNEL_CONFIG
    # the simulation runs on the CPU: IEEE fp32 matmuls (a GPU may run fp32 matmuls in TF32)
    q, k, v, dout, out, lse, lse_s, qi, qs, ki, ks, dq, dk, dv = (
        x.cpu() for x in (q, k, v, dout, out, lse, lse_s, qi, qs, ki, ks, dq, dk, dv))
    mask = None if mask is None else mask.cpu()
    r_out, r_lse, saved = sagebwd_forward(q, k, v, is_causal=causal, attn_mask=mask, config=cfg)
    # forward: the quantized operands are the simulation's (a rounding tie may land one step apart), O and LSE agree
    assert (qi.int() - saved.q_int.int()).abs().max().item() <= 1
    assert (ki.int() - saved.k_int.int()).abs().max().item() <= 1
    assert rel_l1(out, r_out.to(dtype)) <= 1e-3
    check_lse(q, k, qi, qs, ki, ks, lse, lse_s, r_lse, mask, causal)
    # backward from the same saved operands, and end to end
    same = saved._replace(q_int=qi, q_scale=qs, k_int=ki, k_scale=ks, out=out, lse=lse_s)
    for ours, ref in zip((dq, dk, dv), sagebwd_backward(dout, same)):
        assert ours.dtype == dtype and torch.isfinite(ours).all()
        assert rel_l1(ours, ref.to(dtype)) <= 1e-3
    for name, ours, ref in zip("qkv", (dq, dk, dv), sagebwd_backward(dout, saved)):
        assert rel_l1(ours, ref.to(dtype)) <= 3e-3, name


def _float64_grads(q, k, v, dout, causal):
    qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        qd, kd.repeat_interleave(g, 1), vd.repeat_interleave(g, 1), is_causal=causal)
    out.backward(dout.double())
    return out.detach(), qd.grad, kd.grad, vd.grad


@pytest.mark.parametrize("n", [4096, 16384])
@pytest.mark.parametrize("d,causal", [(64, False), (128, True), (128, False)])
def test_gradients_against_float64(n, d, causal):
    """The issue's target: dQ, dK, dV cosine >= 0.998 against float64 on structured inputs at N=4K and 16K."""
    if n == 16384 and d == 64:
        pytest.skip("one head dim at 16K keeps the float64 reference's time down")
    q, k, v, dout = _inputs(1, 2, 2, n, n, d, torch.bfloat16, seed=3)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    out = sagebwd_attention(qg, kg, vg, is_causal=causal, scale=None, attn_mask=None)
    out.backward(dout)
    ref = _float64_grads(q, k, v, dout, causal)
    cos = {n_: cosine(a.float(), b.float()) for n_, a, b in zip(("O", "dQ", "dK", "dV"), (out, qg.grad, kg.grad,
                                                                                       vg.grad), ref)}
    print("cosine vs float64", n, d, causal, cos)
    assert cos["O"] >= 0.9999 and all(cos[x] >= 0.998 for x in ("dQ", "dK", "dV")), cos


def test_poisoned_memory_and_inputs_untouched():
    """Outputs are fully written (NaN-filled memory does not leak in) and the caller's tensors are not modified."""
    q, k, v, dout = _inputs(2, 4, 2, 333, 333, 128, torch.bfloat16)
    before = [x.clone() for x in (q, k, v, dout)]
    clean = _kernel(q, k, v, dout, True, None)
    torch.cuda.synchronize()
    junk = torch.full((64 << 20,), float("nan"), device="cuda")  # the caching allocator hands these blocks out next
    del junk
    poisoned = _kernel(q, k, v, dout, True, None)
    for a, b in zip(clean[0] + clean[1], poisoned[0] + poisoned[1]):
        assert torch.equal(a, b)
    for a, b in zip(before, (q, k, v, dout)):
        assert torch.equal(a, b)


def test_deterministic():
    q, k, v, dout = _inputs(2, 8, 2, 1111, 1111, 64, torch.bfloat16)
    a, b = _kernel(q, k, v, dout, True, None), _kernel(q, k, v, dout, True, None)
    for x, y in zip(a[0] + a[1], b[0] + b[1]):
        assert torch.equal(x, y)


def test_gqa_sums_over_the_group():
    q, k, v, dout = _inputs(1, 6, 2, 257, 257, 64, torch.float16)
    _, (dq, dk, dv) = _kernel(q, k, v, dout, True, None)
    _, (dq_r, dk_r, dv_r) = _kernel(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), dout, True, None)
    assert torch.equal(dq, dq_r)
    torch.testing.assert_close(dk, dk_r.view(1, 2, 3, 257, 64).float().sum(2).half(), rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(dv, dv_r.view(1, 2, 3, 257, 64).float().sum(2).half(), rtol=2e-3, atol=2e-3)


def test_public_call_routes_to_the_kernel_in_both_layouts():
    GLOBAL_STATS.reset()
    q, k, v, dout = _inputs(2, 4, 2, 200, 200, 128, torch.bfloat16)
    grads = {}
    for layout in ("bhsd", "bshd"):
        t = (lambda x: x.transpose(1, 2).contiguous()) if layout == "bshd" else (lambda x: x)
        qg, kg, vg = (t(x).detach().requires_grad_() for x in (q, k, v))
        out = sage_patch.attention(qg, kg, vg, layout=layout, is_causal=True, precision="8b")
        out.backward(t(dout))
        back = (lambda x: x.transpose(1, 2)) if layout == "bshd" else (lambda x: x)
        grads[layout] = [back(x.grad) for x in (qg, kg, vg)]
    assert GLOBAL_STATS.impls == {_trains_with(128): 2}, GLOBAL_STATS.impls
    for a, b in zip(grads["bhsd"], grads["bshd"]):
        assert torch.equal(a, b)


def test_cuda_graph_capture_of_forward_and_backward():
    q, k, v, dout = _inputs(1, 4, 4, 512, 512, 64, torch.bfloat16)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))

    def step():
        for x in (qg, kg, vg):
            x.grad = None
        out = sagebwd_attention(qg, kg, vg, is_causal=True, scale=None, attn_mask=None)
        out.backward(dout)
        return out

    eager = step().detach().clone()
    eager_grads = [x.grad.clone() for x in (qg, kg, vg)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up on the side stream compiles every kernel before capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    for x in (qg, kg, vg):
        x.grad = None
    with torch.cuda.graph(graph):
        out = sagebwd_attention(qg, kg, vg, is_causal=True, scale=None, attn_mask=None)
        out.backward(dout)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    if _trains_with(64) == "cuda-wgmma-sagebwd":  # its dQ reductions have no fixed order: DQ_ORDER of its own tests
        assert rel_l1(qg.grad.float(), eager_grads[0].float()) <= 1e-4
    else:
        assert torch.equal(qg.grad, eager_grads[0])
    for a, b in zip((kg.grad, vg.grad), eager_grads[1:]):
        assert torch.equal(a, b)


def test_llama_trains_through_the_kernel():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    torch.manual_seed(0)
    ids = torch.randint(0, 512, (2, 384), device="cuda")
    losses, grads = {}, {}
    for impl in ("sdpa", "sage"):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
        model.set_attn_implementation(impl)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses[impl] = loss.item()
        grads[impl] = torch.cat([p.grad.float().flatten() for p in model.parameters()])
        if impl == "sage":
            impls = [st["impl"] for st in sage_patch.report(model).to_dict().values()]
            assert impls == [{_trains_with(64): 1}] * 2, impls
    assert abs(losses["sage"] - losses["sdpa"]) < 1e-2
    assert cosine(grads["sage"], grads["sdpa"]) > 0.99


# ---- non-finite values: NaN in, NaN out (docs/semantics.md; attention_fuzz.check_nonfinite_training) -----------

NONFINITE_VARIANTS = {  # b, hq, hkv, sq, skv, causal, key padding
    "causal_gqa_sq>skv": (2, 6, 2, 300, 200, True, False),     # bottom-right causal: the first 100 rows see no key
    "causal_padding_gqa": (3, 4, 2, 257, 257, True, True),      # batch 2 fully padded: empty rows
    "padding_mha": (2, 2, 2, 190, 333, False, True),
    "plain_mha": (2, 2, 2, 256, 256, False, False),
}


def _autograd_kernels(q, k, v, dout, mask, causal):
    """The trainable 8b through autograd with the kernels forced (what a training step runs)."""
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    out = sagebwd_attention(qg, kg, vg, is_causal=causal, scale=None, attn_mask=mask, kernel=True)
    out.backward(dout)
    return out, qg.grad, kg.grad, vg.grad


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("variant", list(NONFINITE_VARIANTS))
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", NONFINITE_WHERE)
def test_nonfinite_poisons_what_it_reaches(where, bad, variant, d, dtype):
    """A NaN/Inf in q, k, v or dO poisons every output and gradient row it reaches (never a finite value from a
    swallowed NaN: GradScaler skips a step only on a non-finite gradient), other batch entries and heads are
    bitwise those of the clean run, rows with no visible key stay 0."""
    b, hq, hkv, sq, skv, causal, kp = NONFINITE_VARIANTS[variant]
    fails = check_nonfinite_training(_autograd_kernels, where, bad, b=b, hq=hq, hkv=hkv, sq=sq, skv=skv, d=d,
                                     dtype=dtype, causal=causal, key_padding=kp, device="cuda")
    assert not fails, fails


def test_nonfinite_through_the_public_call():
    """The same through sage_patch.attention (the route a model's layer takes), the kernel being what ran."""
    def public(q, k, v, dout, mask, causal):
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        out = sage_patch.attention(qg, kg, vg, is_causal=causal, attn_mask=mask, precision="8b")
        out.backward(dout)
        return out, qg.grad, kg.grad, vg.grad

    GLOBAL_STATS.reset()
    for where in NONFINITE_WHERE:
        fails = check_nonfinite_training(public, where, math.nan, b=2, hq=4, hkv=2, sq=300, skv=200, d=128,
                                         dtype=torch.bfloat16, causal=True, device="cuda")
        assert not fails, (where, fails)
    assert GLOBAL_STATS.impls == {_trains_with(128): 8}, GLOBAL_STATS.impls

"""The sm_90a SageBwd backward (dQ, dK, dV from kernels_cuda/hopper/bwd_kernel.cuh; sage_patch.kernels.sagebwd.hopper)
and the sm_90a training forward (O and both LSEs from kernels_cuda/hopper/fwd_train_kernel.cuh; hopper.forward) on the
GPU: the same comparisons as the Triton kernels' (test_sagebwd_gpu.py) against the reference simulation of their
numerics, against float64, and the training contract (poisoned memory, odd lengths, GQA, key padding, NaN rule, CUDA
graphs). The backward tests run the sm_90a pair (the sm_90a forward at every shape, then the backward). Runs on an
H100/H200 with an sm_90a build only.

dQ is summed across key blocks with fp32 reductions in whatever order they land, so two runs of the same call may
differ in the last bit of a dQ element that sits near a rounding boundary of the output dtype: where the Triton tests
ask for bitwise equality, dQ is held to DQ_ORDER (rel L1) instead, dK and dV stay bitwise. Against the simulation
dQ keeps the Triton kernels' tolerance (rel L1 <= 1e-3: the simulation's accumulation order is not a kernel's either;
reordering fp32 sums of <= Skv / 64 terms moves them by ~1e-6 relative, far below it). Under
torch.use_deterministic_algorithms(True) the kernel's deterministic mode adds the key blocks in a fixed order: there
runs are bitwise equal, dQ included."""
import contextlib
import math
import os
import sys

import pytest
import torch

from sage_patch.accuracy import cosine
from sage_patch.reference.sagebwd import sagebwd_backward, sagebwd_forward
from sage_patch.trainable import KERNEL_CONFIG, sagebwd_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

sagebwd = pytest.importorskip("sage_patch.kernels.sagebwd")
pytest.importorskip("triton")
from sage_patch.kernels import _lib, triton_reason  # noqa: E402
from sage_patch.kernels._ops import device_cc  # noqa: E402
from sage_patch.kernels.registry import Target  # noqa: E402
from sage_patch.kernels.sagebwd import hopper  # noqa: E402
from tests.gpu.test_sagebwd_gpu import CASES as TRITON_CASES  # noqa: E402
from tests.gpu.test_sagebwd_gpu import (NONFINITE_VARIANTS, _float64_grads, _inputs, _key_padding,  # noqa: E402
                                        check_lse, rel_l1)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from attention_fuzz import NONFINITE_WHERE, check_nonfinite_training  # noqa: E402


DQ_ORDER = 1e-4   # rel L1 between two runs' dQ (the reductions' order); garbage or a missed zeroing is >> this


def _same_grads(a, b):
    """(dq, dk, dv) of two runs of one call: dK, dV bitwise, dQ up to the order of its fp32 reductions."""
    assert rel_l1(a[0].float(), b[0].float()) <= DQ_ORDER, rel_l1(a[0].float(), b[0].float())
    for x, y in zip(a[1:], b[1:]):
        assert torch.equal(x, y)


@pytest.fixture(autouse=True)
def _needs_the_kernel():
    why = hopper.cannot_run(Target(device_cc(torch.cuda.current_device()), tuple(_lib.get().archs), head_dim=128,
                                   training=True, dtype=torch.bfloat16, triton=triton_reason()))
    if why:
        pytest.skip(f"the sm_90a SageBwd kernel does not serve this machine: {why}")


@pytest.fixture
def through_hopper(monkeypatch):
    """The trainable 8b's autograd backward through the compiled kernel (what a routed training step runs)."""
    monkeypatch.setattr(sagebwd, "backward", hopper.backward)


def _cuda_forward(q, k, v, *, is_causal, scale, key_padding_mask=None):
    """The sm_90a forward at every shape (hopper.forward sends some to the Triton one: TRITON_FORWARD_BELOW)."""
    return sagebwd._forward(q, k, v, is_causal=is_causal, scale=scale, key_padding_mask=key_padding_mask,
                            smooth_k=True, cuda=True)


def _run(q, k, v, dout, causal, mask, bwd, forward=None):
    """forward (default: the sm_90a one, _cuda_forward) then bwd from what it saved."""
    scale = 1 / math.sqrt(q.shape[-1])
    fwd = (forward or _cuda_forward)(q, k, v, is_causal=causal, scale=scale, key_padding_mask=mask)
    out, lse, lse_s, qi, qs, ki, ks = fwd
    return fwd, bwd(dout, qi, qs, ki, ks, v, out, lse_s, is_causal=causal, scale=scale, key_padding_mask=mask)


CASES = TRITON_CASES + [  # b, hq, hkv, sq, skv, d, causal, key padding
    (1, 4, 2, 1000, 1537, 128, True, True),   # odd lengths, Skv > Sq, GQA
    (2, 2, 1, 1000, 1537, 64, False, False),
]


@contextlib.contextmanager
def deterministic_algorithms(on=True):
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(on)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_matches_the_simulation_and_the_triton_kernels(case, dtype):
    b, hq, hkv, sq, skv, d, causal, kp = case
    q, k, v, dout = _inputs(b, hq, hkv, sq, skv, d, dtype)
    mask = _key_padding(b, skv) if kp else None
    fwd, (dq, dk, dv) = _run(q, k, v, dout, causal, mask, hopper.backward)
    _, (tq, tk, tv) = _run(q, k, v, dout, causal, mask, sagebwd.backward)
    vs_triton = {n: rel_l1(o, t) for n, o, t in (("dq", dq, tq), ("dk", dk, tk), ("dv", dv, tv))}
    print("rel L1 vs Triton", case, dtype, vs_triton)
    for name, ours, theirs in (("dq", dq, tq), ("dk", dk, tk), ("dv", dv, tv)):
        assert ours.dtype == dtype and ours.shape == theirs.shape and torch.isfinite(ours).all(), name
        assert vs_triton[name] <= 2e-4, (name, vs_triton[name])
    _check_against_the_simulation(q, k, v, dout, causal, mask, fwd, (dq, dk, dv))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_deterministic_mode_matches_the_simulation(case, dtype):
    """The deterministic mode's results against the simulation with the default mode's tolerances, and against the
    default mode: dK, dV bitwise (the mode orders dQ's reductions only), dQ up to the reductions' order."""
    b, hq, hkv, sq, skv, d, causal, kp = case
    q, k, v, dout = _inputs(b, hq, hkv, sq, skv, d, dtype)
    mask = _key_padding(b, skv) if kp else None
    fwd, default = _run(q, k, v, dout, causal, mask, hopper.backward)
    with deterministic_algorithms():
        got = _run(q, k, v, dout, causal, mask, hopper.backward)[1]
    _same_grads(default, got)
    _check_against_the_simulation(q, k, v, dout, causal, mask, fwd, got)


def _check_against_the_simulation(q, k, v, dout, causal, mask, fwd, grads):
    """The kernel's gradients against the simulation from the same saved operands, as the Triton kernels are
    checked."""
    out, lse, lse_s, qi, qs, ki, ks = fwd
    dq, dk, dv = grads
    dtype = q.dtype
    q, k, v, dout, out, lse_s, qi, qs, ki, ks, dq, dk, dv = (
        x.cpu() for x in (q, k, v, dout, out, lse_s, qi, qs, ki, ks, dq, dk, dv))
    mask = None if mask is None else mask.cpu()
    _, _, saved = sagebwd_forward(q, k, v, is_causal=causal, attn_mask=mask, config=KERNEL_CONFIG)
    same = saved._replace(q_int=qi, q_scale=qs, k_int=ki, k_scale=ks, out=out, lse=lse_s)
    rq, rk, rv = sagebwd_backward(dout, same)
    for name, ours, ref in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        assert rel_l1(ours, ref.to(dtype)) <= 1e-3, (name, rel_l1(ours, ref.to(dtype)))


@pytest.mark.parametrize("d,causal", [(64, False), (64, True), (128, True), (128, False)])
def test_gradients_against_float64_at_4k(d, causal):
    """dQ, dK, dV cosine >= 0.999 against float64 autograd of exact attention on structured inputs at N=4K."""
    q, k, v, dout = _inputs(1, 2, 2, 4096, 4096, d, torch.bfloat16, seed=3)
    _, (dq, dk, dv) = _run(q, k, v, dout, causal, None, hopper.backward)
    _, rq, rk, rv = _float64_grads(q, k, v, dout, causal)
    cos = {n: cosine(a.float(), r.float()) for n, a, r in zip(("dQ", "dK", "dV"), (dq, dk, dv), (rq, rk, rv))}
    print("cosine vs float64", d, causal, cos)
    assert all(c >= 0.999 for c in cos.values()), cos


@pytest.mark.parametrize("case", [(3, 6, 2, 1000, 1537, 128, True, True), (5, 4, 1, 333, 333, 64, False, False)])
def test_chunked_backward_matches_the_whole_call(case, monkeypatch):
    """The backward run in chunks of (batch entry, KV head) pairs (hopper.chunks; forced here, where the call is
    small enough for one piece) gives the whole call's gradients: each chunk's slices of every operand, mask and
    output (GQA: its query heads; key padding: its batch entries). Chunks of heads of one entry, then of whole
    entries."""
    b, hq, hkv, sq, skv, d, causal, kp = case
    q, k, v, dout = _inputs(b, hq, hkv, sq, skv, d, torch.bfloat16)
    mask = _key_padding(b, skv) if kp else None
    whole = _run(q, k, v, dout, causal, mask, hopper.backward)[1]
    monkeypatch.setattr(hopper, "CHUNK_MIN_BYTES", 0)
    assert len(hopper.chunks(b, hkv, hq // hkv, sq, d, 2)) > 1
    parts = _run(q, k, v, dout, causal, mask, hopper.backward)[1]
    _same_grads(whole, parts)


TMA_CASES = [  # b, hq, hkv, sq, skv, d, causal, key padding, dtype, layout of the inputs, chunked
    # Sq % 16 == 0: the producer's permuted maps load Q^, dO and the stats of every whole tile (bwd_producer.cuh,
    # BwdMaps), cp.async the head's last, partial one (Sq % 64 != 0)
    (2, 4, 2, 1040, 1040, 128, True, False, torch.bfloat16, "bshd", False),  # dO heads inside a row
    (2, 4, 2, 1040, 1040, 128, True, False, torch.bfloat16, "bshd", True),   # per chunk: each chunk's own maps
    (1, 3, 1, 2064, 900, 64, False, True, torch.float16, "bhsd", False),     # dO heads on whole 16-row groups
    (2, 2, 2, 48, 100, 64, True, False, torch.bfloat16, "bhsd", False),      # Sq < 64: no whole tile
    (1, 2, 2, 1024, 1024, 128, False, False, torch.float16, "sliced", False),  # dO heads off the groups: cp.async
]


@pytest.mark.parametrize("case", TMA_CASES)
def test_tma_loaded_tiles_match_the_simulation_and_the_triton_kernels(case, monkeypatch):
    """The layouts and lengths that choose between the producer's TMA loads and its cp.async copies give the
    gradients of the Triton kernels and of the simulation: BSHD views, dO a slice of a longer tensor (its heads'
    rows off the maps' 16-row groups), whole and partial tiles, Sq < 64, chunks."""
    b, hq, hkv, sq, skv, d, causal, kp, dtype, layout, chunked = case
    q, k, v, dout = _inputs(b, hq, hkv, sq, skv, d, dtype)
    if layout == "bshd":
        q, k, v, dout = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v, dout))
    elif layout == "sliced":
        longer = torch.zeros(b, hq, sq + 8, d, dtype=dtype, device="cuda")
        longer[:, :, :sq] = dout
        dout = longer[:, :, :sq]
    mask = _key_padding(b, skv) if kp else None
    if chunked:
        monkeypatch.setattr(hopper, "CHUNK_MIN_BYTES", 0)
        assert len(hopper.chunks(b, hkv, hq // hkv, sq, d, 2)) > 1
    fwd, (dq, dk, dv) = _run(q, k, v, dout, causal, mask, hopper.backward)
    _, (tq, tk, tv) = _run(q, k, v, dout, causal, mask, sagebwd.backward)
    for name, ours, theirs in (("dq", dq, tq), ("dk", dk, tk), ("dv", dv, tv)):
        assert ours.dtype == dtype and torch.isfinite(ours).all(), name
        assert rel_l1(ours, theirs) <= 2e-4, (name, rel_l1(ours, theirs))
    _check_against_the_simulation(q, k, v, dout, causal, mask, fwd, (dq, dk, dv))


def test_nan_in_the_next_heads_dout_stays_there():
    """Sq % 16 == 0 but not % 64: the first head's last tile ends where the next head's dO rows begin in memory; a
    NaN there reaches the next head's gradients only (the partial tile's rows past Sq are zero-filled, not loaded)."""
    q, k, v, dout = _inputs(1, 2, 2, 272, 272, 128, torch.bfloat16)
    clean = _run(q, k, v, dout, False, None, hopper.backward)[1]
    dout[0, 1, 0, 0] = float("nan")
    poisoned = _run(q, k, v, dout, False, None, hopper.backward)[1]
    for name, x, y in zip(("dq", "dk", "dv"), clean, poisoned):
        assert torch.isnan(y[0, 1]).any(), name
        assert torch.isfinite(y[0, 0]).all(), name
    _same_grads([x[0, 0] for x in clean], [y[0, 0] for y in poisoned])


def test_poisoned_memory_and_inputs_untouched():
    q, k, v, dout = _inputs(2, 4, 2, 333, 333, 128, torch.bfloat16)
    before = [x.clone() for x in (q, k, v, dout)]
    clean = _run(q, k, v, dout, True, None, hopper.backward)[1]
    torch.cuda.synchronize()
    junk = torch.full((64 << 20,), float("nan"), device="cuda")
    del junk
    poisoned = _run(q, k, v, dout, True, None, hopper.backward)[1]
    _same_grads(clean, poisoned)
    for a, b in zip(before, (q, k, v, dout)):
        assert torch.equal(a, b)


def test_gqa_sums_over_the_group_and_repeats():
    q, k, v, dout = _inputs(1, 6, 2, 257, 257, 64, torch.float16)
    _, (dq, dk, dv) = _run(q, k, v, dout, True, None, hopper.backward)
    _, again = _run(q, k, v, dout, True, None, hopper.backward)
    _same_grads((dq, dk, dv), again)
    _, (dq_r, dk_r, dv_r) = _run(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), dout, True, None,
                                 hopper.backward)
    assert rel_l1(dq.float(), dq_r.float()) <= DQ_ORDER
    torch.testing.assert_close(dk, dk_r.view(1, 2, 3, 257, 64).float().sum(2).half(), rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(dv, dv_r.view(1, 2, 3, 257, 64).float().sum(2).half(), rtol=2e-3, atol=2e-3)


def test_non_contiguous_views_and_caller_stream():
    """BSHD views (strided V and dO) on a side stream give the results of contiguous BHSD inputs."""
    q, k, v, dout = _inputs(2, 4, 2, 300, 300, 128, torch.bfloat16)
    ref = _run(q, k, v, dout, True, None, hopper.backward)[1]
    views = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v, dout)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got = _run(*views, True, None, hopper.backward)[1]
    torch.cuda.current_stream().wait_stream(s)
    _same_grads(ref, got)


@pytest.mark.parametrize("deterministic", [False, True])
def test_cuda_graph_capture(through_hopper, deterministic):
    """The backward captured and replayed: the replay's gradients those of an eager step (bitwise in the
    deterministic mode: its tile counters are zeroed inside the graph, each replay)."""
    with deterministic_algorithms(deterministic):
        _graph_capture(deterministic)


def _graph_capture(deterministic):
    q, k, v, dout = _inputs(1, 4, 4, 2048, 2048, 64, torch.bfloat16)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))

    def step():
        for x in (qg, kg, vg):
            x.grad = None
        out = sagebwd_attention(qg, kg, vg, is_causal=True, scale=None, attn_mask=None, kernel=True)
        out.backward(dout)
        return out

    step()
    eager_grads = [x.grad.clone() for x in (qg, kg, vg)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    for x in (qg, kg, vg):
        x.grad = None
    with torch.cuda.graph(graph):
        out = sagebwd_attention(qg, kg, vg, is_causal=True, scale=None, attn_mask=None, kernel=True)
        out.backward(dout)
    for _ in range(2):   # (a second replay: the counters start from zero again)
        graph.replay()
        torch.cuda.synchronize()
        if deterministic:
            assert all(torch.equal(x.grad, e) for x, e in zip((qg, kg, vg), eager_grads))
        else:
            _same_grads((qg.grad, kg.grad, vg.grad), eager_grads)


DETERMINISTIC_CASES = [  # b, hq, hkv, sq, skv, d, causal, key padding: 32-40 key blocks per (batch, KV head)
    (1, 4, 2, 4096, 4096, 128, False, False),  # GQA 2:1
    (1, 4, 4, 4096, 4096, 64, True, False),     # causal: the reversed order of key blocks
    (2, 6, 2, 1000, 5000, 128, True, True),     # odd lengths, Skv > Sq, GQA 3:1, key padding
    (1, 2, 1, 5000, 1000, 64, True, True),      # Sq > Skv: the first rows see no key
    (2, 2, 2, 4200, 4200, 64, False, True),
]


@pytest.mark.parametrize("case", DETERMINISTIC_CASES)
def test_deterministic_mode_is_bitwise_reproducible(case):
    """Under torch.use_deterministic_algorithms(True) three backward runs of one call give bitwise the same dQ, dK
    and dV (the default mode's dQ differs between two such runs at these lengths: docs/design/kernels.md), close to the
    default mode's."""
    b, hq, hkv, sq, skv, d, causal, kp = case
    q, k, v, dout = _inputs(b, hq, hkv, sq, skv, d, torch.bfloat16)
    mask = _key_padding(b, skv) if kp else None
    scale = 1 / math.sqrt(d)
    out, lse, lse_s, qi, qs, ki, ks = sagebwd.forward(q, k, v, is_causal=causal, scale=scale, key_padding_mask=mask)

    def bwd():
        return hopper.backward(dout, qi, qs, ki, ks, v, out, lse_s, is_causal=causal, scale=scale,
                               key_padding_mask=mask)

    default = bwd()
    with deterministic_algorithms():
        runs = [bwd() for _ in range(3)]
    for again in runs[1:]:
        for name, x, y in zip(("dq", "dk", "dv"), runs[0], again):
            assert torch.equal(x, y), (name, (x != y).sum().item())
    assert all(torch.isfinite(x).all() for x in runs[0])
    _same_grads(default, runs[0])


def _autograd(q, k, v, dout, mask, causal):
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    out = sagebwd_attention(qg, kg, vg, is_causal=causal, scale=None, attn_mask=mask, kernel=True)
    out.backward(dout)
    return out, qg.grad, kg.grad, vg.grad


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("variant", list(NONFINITE_VARIANTS))
@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("where", NONFINITE_WHERE)
def test_nonfinite_poisons_what_it_reaches(through_hopper, where, bad, variant, d, dtype):
    b, hq, hkv, sq, skv, causal, kp = NONFINITE_VARIANTS[variant]
    fails = check_nonfinite_training(_autograd, where, bad, b=b, hq=hq, hkv=hkv, sq=sq, skv=skv, d=d, dtype=dtype,
                                     causal=causal, key_padding=kp, device="cuda", dq_order=DQ_ORDER)
    assert not fails, fails


# ---- the sm_90a training forward (the Triton quantization passes, then fwd_train_kernel.cuh) ----------------------

def _fwd(q, k, v, causal, mask, forward=None):
    return (forward or _cuda_forward)(q, k, v, is_causal=causal, scale=1 / math.sqrt(q.shape[-1]),
                                      key_padding_mask=mask)


def _check_forward_numerics(q, k, v, mask, causal, fwd, dtype):
    """O and both LSEs of fwd (the sm_90a forward's results) against the simulation, as the Triton forward is checked
    (test_sagebwd_gpu.test_kernels_match_the_simulation_of_their_numerics)."""
    out, lse, lse_s, qi, qs, ki, ks = (x.cpu() for x in fwd)
    q, k, v = q.cpu(), k.cpu(), v.cpu()
    mask = None if mask is None else mask.cpu()
    r_out, r_lse, saved = sagebwd_forward(q, k, v, is_causal=causal, attn_mask=mask, config=KERNEL_CONFIG)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert rel_l1(out, r_out.to(dtype)) <= 1e-3, rel_l1(out, r_out.to(dtype))
    fin = check_lse(q, k, qi, qs, ki, ks, lse, lse_s, r_lse, mask, causal)
    assert (out[~fin] == 0).all()   # rows with no visible key


# the producer's TMA boxes overhang a tensor's end: fewer keys than one block, Skv not a multiple of 4 (the key
# scales' rows are not 16-byte strided), with GQA and key padding
FORWARD_CASES = CASES + [
    (2, 4, 2, 50, 37, 128, True, True),
    (2, 3, 1, 70, 45, 64, False, True),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", FORWARD_CASES)
def test_forward_matches_the_simulation_and_the_triton_forward(case, dtype):
    """Odd lengths (Sq != Skv, not multiples of 64 or 4, Skv < 64), GQA, causal, key padding, one query: O and the
    LSEs against the simulation; the quantized operands are the Triton passes' (bitwise), O and the LSEs those of the
    Triton forward up to the order of the row sums."""
    b, hq, hkv, sq, skv, d, causal, kp = case
    q, k, v, _ = _inputs(b, hq, hkv, sq, skv, d, dtype)
    mask = _key_padding(b, skv) if kp else None
    ours = _fwd(q, k, v, causal, mask)
    theirs = _fwd(q, k, v, causal, mask, sagebwd.forward)
    for x, y in zip(ours[3:], theirs[3:]):
        assert torch.equal(x, y)
    o_vs = rel_l1(ours[0], theirs[0])
    lse_vs = max((x - y)[torch.isfinite(y)].abs().max().item() if torch.isfinite(y).any() else 0.0
                 for x, y in zip(ours[1:3], theirs[1:3]))
    print("forward vs Triton", case, dtype, "O rel L1", o_vs, "LSE max abs", lse_vs)
    assert o_vs <= 5e-4 and lse_vs <= 1e-4, (o_vs, lse_vs)
    _check_forward_numerics(q, k, v, mask, causal, ours, dtype)


@pytest.mark.parametrize("d,causal", [(64, False), (64, True), (128, True), (128, False)])
def test_forward_against_float64_at_4k(d, causal):
    """O cosine >= 0.9999 against float64 exact attention (the Triton forward's bar), GQA 2:1, N=4K."""
    q, k, v, _ = _inputs(1, 4, 2, 4096, 4096, d, torch.bfloat16, seed=3)
    out = _fwd(q, k, v, causal, None)[0]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1), is_causal=causal)
    cos = cosine(out.float(), ref.float())
    print("forward O cosine vs float64", d, causal, cos)
    assert cos >= 0.9999, cos


def test_forward_overwrites_poisoned_outputs_and_leaves_inputs_untouched():
    """Outputs pre-filled with NaN are fully overwritten (empty rows included: Sq > Skv causal, a padded batch
    entry), the inputs are not written, and a poisoned allocator changes nothing."""
    q, k, v, _ = _inputs(2, 4, 2, 333, 200, 128, torch.bfloat16)
    mask = torch.ones(2, 200, dtype=torch.bool, device="cuda")
    mask[1] = False
    before = [x.clone() for x in (q, k, v, mask)]
    clean = _fwd(q, k, v, True, mask)
    out, lse, lse_s, qi, qs, ki, ks = clean
    qdot = torch.empty_like(lse)   # recomputed: hopper.forward does not return it
    from sage_patch.kernels.sagebwd import _quantize_tokens
    mean = k.mean(dim=2, dtype=torch.float32).contiguous()
    _quantize_tokens(q, torch.empty_like(qi), (333 * 128, 128, 1), torch.empty_like(qs), mean=mean, mean_group=2,
                     dot=qdot)
    nan_out, nan_lse, nan_lse_s = (torch.full_like(x, math.nan) for x in (out, lse, lse_s))
    hopper.launch_forward(qi, qs, qdot, ki, ks, v, nan_out, nan_lse, nan_lse_s, mask, is_causal=True,
                          scale=1 / math.sqrt(128))
    assert torch.equal(nan_out, out) and torch.equal(nan_lse_s, lse_s) and torch.equal(nan_lse, lse)
    assert (out[1] == 0).all() and (lse_s[1] == -math.inf).all() and (out[0, :, :133] == 0).all()
    junk = torch.full((64 << 20,), float("nan"), device="cuda")
    del junk
    again = _fwd(q, k, v, True, mask)
    for x, y in zip(clean, again):
        assert torch.equal(x, y)
    for a, b in zip(before, (q, k, v, mask)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("d,dtype", [(64, torch.float16), (128, torch.bfloat16)])
def test_forward_non_contiguous_views_and_caller_stream(d, dtype):
    """BSHD views on a side stream give bitwise the forward of contiguous BHSD inputs (V is read through its
    strides)."""
    q, k, v, _ = _inputs(2, 4, 2, 300, 300, d, dtype)
    mask = _key_padding(2, 300)
    ref = _fwd(q, k, v, True, mask)
    views = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got = _fwd(*views, True, mask)
    torch.cuda.current_stream().wait_stream(s)
    for x, y in zip(ref, got):
        assert torch.equal(x, y)


@pytest.mark.parametrize("d", [64, 128])
def test_forward_one_padding_row_for_the_batch(d):
    """A (1, Skv) key padding mask (batch stride 0) serves every batch entry: bitwise the forward with the row
    repeated per entry, and it masks (not the unmasked forward)."""
    q, k, v, _ = _inputs(3, 4, 2, 130, 190, d, torch.bfloat16)
    row = torch.ones(1, 190, dtype=torch.bool, device="cuda")
    row[0, 100:] = False
    one = _fwd(q, k, v, False, row)
    each = _fwd(q, k, v, False, row.expand(3, 190).contiguous())
    for x, y in zip(one, each):
        assert torch.equal(x, y)
    assert not torch.equal(one[0], _fwd(q, k, v, False, None)[0])
    _check_forward_numerics(q, k, v, row.expand(3, 190), False, one, torch.bfloat16)


def test_forward_cuda_graph_capture():
    q, k, v, _ = _inputs(1, 4, 2, 700, 700, 128, torch.bfloat16)
    eager = _fwd(q, k, v, False, None)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _fwd(q, k, v, False, None)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _fwd(q, k, v, False, None)
    graph.replay()
    torch.cuda.synchronize()
    for x, y in zip(eager, captured):
        assert torch.equal(x, y)


@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_forward_nonfinite_reaches_the_rows_it_touches(where, bad):
    """The forward alone (the autograd tests above check it with the backward): a NaN/Inf in q poisons its row's O
    and LSE, in k or v the O of every row that sees the key; other (batch, head) pairs are bitwise the clean run's;
    rows with no visible key stay 0."""
    q, k, v, _ = _inputs(2, 4, 2, 300, 200, 64, torch.bfloat16)
    clean = _fwd(q, k, v, True, None)
    x = {"q": q.clone(), "k": k.clone(), "v": v.clone()}
    if where == "q":
        x["q"][0, 3, 298, 5] = bad
    else:
        x[where][0, 1, 1, 5] = bad
    out = _fwd(x["q"], x["k"], x["v"], True, None)[0]
    bad_rows = ~torch.isfinite(out).all(-1)
    if where == "q":
        assert bad_rows[0, 3, 298]
    else:   # key 1 is seen by rows i >= 1 + Sq - Skv of heads 2, 3
        assert bad_rows[0, 2:, 101:].all()
        assert (out[0, 2:, :100] == 0).all()   # no visible key
    scope = torch.zeros(2, 4, dtype=torch.bool)
    scope[0, 3 if where == "q" else slice(2, 4)] = True
    assert torch.equal(out[~scope], clean[0][~scope])

"""The sm_90a SageBwd backward's launcher (sage_patch.kernels.sagebwd.hopper) without a GPU: what it runs under
torch's deterministic-algorithms switch (its dQ is summed with floating-point reductions in no fixed order, so
deterministic mode takes the Triton kernels, whose dQ is deterministic, and says so once), and the reading of the
kernel's fp32 dQ buffer (in blocks, bwd_traits.cuh's bwd_dq_tile). The kernel itself:
tests/gpu/test_sagebwd_hopper_gpu.py."""
import logging

import pytest
import torch

from sage_patch.kernels.sagebwd import hopper


def test_deterministic_algorithms_route_to_the_triton_kernels(monkeypatch, caplog):
    ran = []
    monkeypatch.setattr(hopper, "_backward", lambda *a, **kw: ran.append(kw["cuda"]))
    monkeypatch.setattr(hopper, "_deterministic_logged", False)
    args = (None,) * 8
    hopper.backward(*args, is_causal=False, scale=1.0)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with caplog.at_level(logging.INFO, logger="sage_patch"):
            hopper.backward(*args, is_causal=False, scale=1.0)
            hopper.backward(*args, is_causal=True, scale=1.0)
    finally:
        torch.use_deterministic_algorithms(was)
    assert ran == [True, False, False]
    said = [r.getMessage() for r in caplog.records if "deterministic" in r.getMessage()]
    assert len(said) == 1 and "Triton" in said[0], said


def _kernel_blocks(dq: torch.Tensor) -> torch.Tensor:
    """dq (B, Hq, Sq, D) written into a buffer of hopper.dq_blocks_shape element by element as the kernel stores it
    (bwd_traits.cuh: tile, 32-channel chunk c, warp w; within the 512 floats of a block, element
    ((2 k + hh) 32 + lane) 2 + e holds query 16 w + 8 hh + lane / 4, channel 32 c + 8 k + 2 (lane % 4) + e)."""
    b, hq, sq, d = dq.shape
    shape = hopper.dq_blocks_shape(b, hq, sq, d)
    ntq = shape[2]
    flat = torch.full((b, hq, ntq, d // 32, 4, 512), float("nan"))
    for t in range(ntq):
        for c in range(d // 32):
            for w in range(4):
                for i in range(512):
                    k, hh, lane, e = i // 128, (i // 64) % 2, (i // 2) % 32, i % 2
                    qi, ch = 64 * t + 16 * w + 8 * hh + lane // 4, 32 * c + 8 * k + 2 * (lane % 4) + e
                    flat[:, :, t, c, w, i] = dq[:, :, qi, ch] if qi < sq else 0.0
    return flat.view(shape)


@pytest.mark.parametrize("sq,d", [(128, 64), (130, 128)])
def test_dq_from_blocks_reads_the_kernels_block_order(sq, d):
    g = torch.Generator().manual_seed(0)
    dq = torch.randn(2, 3, sq, d, generator=g)
    acc = _kernel_blocks(dq)
    got = hopper.dq_from_blocks(acc, sq, 0.125, torch.float32)
    assert got.shape == dq.shape and got.is_contiguous()
    assert torch.equal(got, dq * 0.125)
    # the scale applied in fp32, then the cast: as dq_acc.mul_(scale).to(dtype) did
    half = hopper.dq_from_blocks(acc, sq, 0.0883883, torch.bfloat16)
    assert torch.equal(half, (dq * 0.0883883).to(torch.bfloat16))


def test_launch_refuses_a_dq_buffer_in_another_layout():
    b, hq, sq, d = 1, 2, 100, 64
    q_int = torch.zeros(b, hq, sq, d, dtype=torch.int8)
    with pytest.raises(ValueError, match="dq_blocks_shape"):
        hopper.launch(q_int, None, None, None, None, None, None, None, None, None,
                      torch.zeros(b, hq, sq, d), None, is_causal=False, scale=1.0)


def test_forward_routes_where_the_triton_forward_measured_faster(monkeypatch):
    """hopper.forward runs the sm_90a forward except for the (head dim, causal) pairs of TRITON_FORWARD_BELOW below
    their length (min(Sq, Skv)), where the Triton forward_kernel measured faster; the same quantization passes
    either way (sagebwd._forward)."""
    ran = []
    monkeypatch.setattr(hopper, "_forward", lambda *a, **kw: ran.append(kw["cuda"]))
    monkeypatch.setattr(hopper, "TRITON_FORWARD_BELOW", {(64, True): 100})
    for d, causal, sq, skv in ((64, True, 99, 500), (64, True, 100, 100), (64, False, 8, 8), (128, True, 8, 8)):
        hopper.forward(torch.zeros(1, 1, sq, d), torch.zeros(1, 1, skv, d), None, is_causal=causal, scale=1.0)
    assert ran == [False, True, True, True]


def test_forward_routing_table_is_keyed_by_served_head_dims():
    assert all(d in hopper.HEAD_DIMS and isinstance(c, bool) and n > 0
               for (d, c), n in hopper.TRITON_FORWARD_BELOW.items())


@pytest.mark.parametrize("what", ["q_scale", "k_int", "lse", "out"])
def test_launch_forward_refuses_operands_of_another_shape_or_layout(what):
    """The forward's launch checks every operand's shape and layout before the library is asked for (a wrong one
    would be read out of bounds by the kernel): the error names the argument."""
    b, hq, hkv, sq, skv, d = 1, 4, 2, 100, 70, 64
    args = dict(q_int=torch.zeros(b, hq, sq, d, dtype=torch.int8), q_scale=torch.zeros(b, hq, sq),
                qdot=torch.zeros(b, hq, sq), k_int=torch.zeros(b, hkv, skv, d, dtype=torch.int8),
                k_scale=torch.zeros(b, hkv, skv), v=torch.zeros(b, hkv, skv, d, dtype=torch.bfloat16),
                out=torch.zeros(b, hq, sq, d, dtype=torch.bfloat16), lse=torch.zeros(b, hq, sq),
                lse_s=torch.zeros(b, hq, sq))
    bad = {"q_scale": torch.zeros(b, hq, sq + 1), "k_int": torch.zeros(b, hkv, d, skv, dtype=torch.int8).mT,
           "lse": torch.zeros(b, hq, sq - 1), "out": torch.zeros(b, hq, sq, d, dtype=torch.float16)}
    args[what] = bad[what]
    with pytest.raises(ValueError, match=f"^{what}: "):
        hopper.launch_forward(*args.values(), None, is_causal=False, scale=1.0)

"""The sm_90a SageBwd backward's launcher (sage_patch.kernels.sagebwd.hopper) without a GPU: what it runs under
torch's deterministic-algorithms switch (its dQ is summed with floating-point atomics, so deterministic mode takes
the Triton kernels, whose dQ is deterministic, and says so once). The kernel itself: tests/gpu/test_sagebwd_hopper_gpu.py."""
import logging

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

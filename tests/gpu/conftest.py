import pytest


@pytest.fixture(autouse=True)
def _kernel_at_every_length(monkeypatch):
    """These tests exercise the kernels at short lengths too: no routing to SDPA for speed (tested on its own).
    Inference: SAGE_PATCH_SPEED_ROUTING's switch; training calls (whose switch is a policy's
    options.training_speed_routing, and these calls come with or without one): the training variants without a
    crossover."""
    import dataclasses

    import sage_patch.kernels as K

    monkeypatch.setattr(K, "SPEED_ROUTING", False)
    monkeypatch.setattr(K.registry, "VARIANTS", tuple(dataclasses.replace(v, sdpa_faster_below={}) if v.trains else v
                                                      for v in K.registry.VARIANTS))


@pytest.fixture(autouse=True)
def _sync_after():
    yield
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()

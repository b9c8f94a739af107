import pytest


@pytest.fixture(autouse=True)
def _kernel_at_every_length(monkeypatch):
    """These tests exercise the kernels at short lengths too: no routing to SDPA for speed (tested on its own)."""
    import sage_patch.kernels as K

    monkeypatch.setattr(K, "SPEED_ROUTING", False)


@pytest.fixture(autouse=True)
def _sync_after():
    yield
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()

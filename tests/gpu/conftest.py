import pytest


@pytest.fixture(autouse=True)
def _sync_after():
    yield
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()

import pytest
import torch


def structured_qkv(b=2, h=4, sq=256, skv=None, d=64, hkv=None, dtype=torch.float32, seed=0):
    """randn plus the outliers real attention inputs have: a per-channel bias of 4 sigma on K and V,
    and a few outlier channels in Q."""
    g = torch.Generator().manual_seed(seed)
    skv = sq if skv is None else skv
    hkv = h if hkv is None else hkv
    q = torch.randn(b, h, sq, d, generator=g)
    q[..., torch.randperm(d, generator=g)[: max(1, d // 32)]] *= 6.0
    k = torch.randn(b, hkv, skv, d, generator=g) + 4.0 * torch.randn(d, generator=g)
    v = torch.randn(b, hkv, skv, d, generator=g) + 4.0 * torch.randn(d, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.fixture
def qkv():
    return structured_qkv


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

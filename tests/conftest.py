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
def one_thread():
    """Bitwise comparisons of two CPU runs: with several threads, a loaded machine can change how a matmul splits its
    reductions between the runs (seen with the CPU busy)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def qkv():
    return structured_qkv


@pytest.fixture
def mask_kinds(monkeypatch):
    """The kinds ("none", "key_padding", "dense", "float") of the masks the public attention API classifies, in call
    order: what a routed layer actually received."""
    import sage_patch.api as api

    kinds = []
    classify = api.classify_mask

    def spy(*a, **k):
        info = classify(*a, **k)
        kinds.append(info.kind)
        return info

    monkeypatch.setattr(api, "classify_mask", spy)
    return kinds


def _spy_resolver(monkeypatch, record):
    import sage_patch.api as api

    real = api.resolve

    def spy(*args, mask, window_left=-1, **kwargs):
        record(mask.kind, window_left)
        return real(*args, mask=mask, window_left=window_left, **kwargs)

    monkeypatch.setattr(api, "resolve", spy)


@pytest.fixture
def resolver_masks(monkeypatch):
    """The mask kind of every attention call that reaches the resolver, in call order (what its decision saw; on CPU
    a dense mask would run the simulation too, so the report alone cannot show a dense-mask fallback)."""
    kinds = []
    _spy_resolver(monkeypatch, lambda kind, _window: kinds.append(kind))
    return kinds


@pytest.fixture
def resolver_windows(monkeypatch):
    """(mask kind, window_left) of every attention call that reaches the resolver."""
    seen = []
    _spy_resolver(monkeypatch, lambda kind, window: seen.append((kind, window)))
    return seen


@pytest.fixture
def fake_cuda(monkeypatch):
    """fake_cuda(archs) -> a dict whose "cc" the test sets: CPU tensors then pose as CUDA ones on a device of that
    capability, with a loaded library of those build targets (`lib` in the dict), so kernels.status(), the registry
    and the resolver run their real checks on it."""
    def make(archs):
        import types

        import sage_patch.kernels as K
        import sage_patch.kernels._ops as ops
        import sage_patch.resolve as R

        fake = {"lib": types.SimpleNamespace(handle=object(), reason="loaded", path="/fake/libsage_kernels.so",
                                             archs=list(archs))}
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: self.device.type == "cpu"), raising=False)
        monkeypatch.setattr(K._lib, "_LIB", fake["lib"])
        monkeypatch.setattr(K, "_cuda_available", lambda: True)
        monkeypatch.setattr(K, "_STATUS_CACHE", {})
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(ops, "device_cc", lambda dev: fake["cc"])
        # resolve caches these for torch.compile; here they must follow the faked device
        monkeypatch.setattr(R, "_kernels_loaded", lambda: bool(K._status()["loaded"]))
        monkeypatch.setattr(R, "_kernels_reason", lambda: str(K._status()["reason"]))
        return fake
    return make


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

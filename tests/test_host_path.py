"""CPU tests of the host-side kernel path: the parameter block packing, the eager fast path around the custom ops,
the status/availability caching and the per-call tensor checks (no GPU needed: a fake library handle stands in
for libsage_kernels.so and records what the C side would read)."""
from __future__ import annotations

import ctypes
import math
import struct
import types

import pytest
import torch

import sage_patch.kernels as K
from sage_patch.kernels import _lib, _ops

F = _lib.PARAM_FIELDS


# ---- the parameter block ---------------------------------------------------------------------------------------

def _values(**over):
    """A full value tuple in PARAM_FIELDS order (distinct, recognisable numbers), with overrides by field name."""
    d = {name: 0x1000 * (i + 1) for i, name in enumerate(F)}
    d.update(B=2, Hq=8, Hkv=2, Sq=256, Skv=384, D=128, causal=1, dtype=1, kernel=3, device=0, device_cc=90,
             sm_scale=0.08838834764831845, qk_bits=8, smooth_v=0, qk_packed=0, hop_split_max=0, kmask_sb=384,
             lse_sh=0)
    d.update(over)
    return tuple(d[name] for name in F)


def _ctypes_bytes(values) -> bytes:
    p = _lib.SageAttnParams()
    for name, x in zip(F, values):
        setattr(p, name, x)
    return bytes(p)


def _packed_bytes(values) -> bytes:
    p = _lib.SageAttnParams()
    _lib.fill_params(p, values)
    return bytes(p)


def test_params_struct_covers_every_field_at_its_ctypes_offset():
    assert len(F) == len(_lib.SageAttnParams._fields_) == 40
    last = getattr(_lib.SageAttnParams, F[-1])
    assert _lib.PARAMS_STRUCT.size == last.offset + last.size <= ctypes.sizeof(_lib.SageAttnParams)
    # each field lands where ctypes reads it: a value only in field i shows up only there
    for i, name in enumerate(F):
        vals = [0] * len(F)
        vals[i] = 0.5 if name == "sm_scale" else 7
        p = _lib.SageAttnParams()
        _lib.fill_params(p, tuple(vals))
        assert getattr(p, name) == vals[i]
        assert all(getattr(p, other) in (0, None) for other in F if other != name)


@pytest.mark.parametrize("over", [
    {},                                                                        # every pointer set
    dict(lse=0, kmask=0, kmask_sb=0, cu_seqlens_q=0, cu_seqlens_k=0),          # NULLs: no lse, no mask, padded
    dict(kmask=0, kmask_sb=0, cu_seqlens_q=0xdead0000, cu_seqlens_k=0xbeef0000, lse_sh=12345, B=3),  # varlen
    dict(qk_bits=4, smooth_v=1, kernel=4, hop_split_max=2, device=3, device_cc=89, causal=0, dtype=0),
    dict(q_sb=-(2**40), k_ss=2**62, v_sh=-1, o_sb=2**63 - 1, kmask_sb=0, sm_scale=1e-30),  # int64 range, tiny scale
    dict(q=2**64 - 16, sm_scale=3.0e38, Skv=2**31 - 1, Hq=-5),                 # extremes that still pack
])
def test_fill_params_bytes_equal_field_by_field(over):
    vals = _values(**over)
    assert _packed_bytes(vals) == _ctypes_bytes(vals)


@pytest.mark.parametrize("over", [
    dict(lse=None, kmask=None, cu_seqlens_q=None, cu_seqlens_k=None),  # None pointers (what the old code passed)
    dict(Skv=2**31, B=-(2**31) - 1),                                   # int32 overflow: ctypes wraps
    dict(sm_scale=1e39),                                               # float32 overflow: ctypes gives inf
    dict(q=-16),                                                       # negative pointer: ctypes wraps
])
def test_fill_params_falls_back_to_ctypes_semantics(over):
    vals = _values(**over)
    with pytest.raises((struct.error, OverflowError)):
        _lib.PARAMS_STRUCT.pack(*vals)  # the packer refuses these ...
    assert _packed_bytes(vals) == _ctypes_bytes(vals)  # ... and the fallback writes what ctypes would


def test_fill_params_errors():
    with pytest.raises(ValueError, match="40 values"):
        _packed_bytes(_values()[:-1])  # a short tuple must not shift fields
    with pytest.raises(TypeError):
        _packed_bytes(_values(B="2"))  # a wrong type raises as ctypes always did


# ---- _launch through a fake library handle ---------------------------------------------------------------------

class FakeHandle:
    """Stands in for the loaded library: records the block at both calls (the C side reads it only then)."""

    WS_BYTES = 96

    def __init__(self, rc=0):
        self.rc = rc
        self.ws_block = self.fwd_block = self.stream = self.workspace = self.kmask_bytes = None

    def sage_attn_workspace_bytes(self, ref):
        self.ws_block = bytes(ref._obj)
        return self.WS_BYTES

    def sage_attn_fwd(self, ref, stream):
        p = ref._obj
        self.fwd_block, self.stream, self.workspace = bytes(p), stream.value, p.workspace
        if p.kmask:  # what the kernel would read through the pointer, while the launch is in progress
            self.kmask_bytes = ctypes.string_at(p.kmask, p.B * p.Skv if p.kmask_sb else p.Skv)
        return self.rc

    def sage_error_string(self, rc):
        return b"bad argument"


def _old_block(q, k, v, out, lse, *, dims, qs, ks, vs, os_, kmask, cu_q, cu_k, is_causal, scale, kernel,
               qk_bits, smooth_v, dev, cc, hop_split_max=0, window_left=-1):
    """The block as _ops._launch filled it field by field before the packing change (verbatim, minus the launch)."""
    B, Hq, Hkv, Sq, Skv, D = dims
    p = _lib.SageAttnParams()
    p.q, (p.q_sb, p.q_sh, p.q_ss) = q.data_ptr(), qs
    p.k, (p.k_sb, p.k_sh, p.k_ss) = k.data_ptr(), ks
    p.v, (p.v_sb, p.v_sh, p.v_ss) = v.data_ptr(), vs
    p.o, (p.o_sb, p.o_sh, p.o_ss) = out.data_ptr(), os_
    p.lse = lse.data_ptr() if lse.numel() else None
    if kmask is not None:
        if kmask.stride(-1) != 1:
            kmask = kmask.contiguous()
        p.kmask = kmask.data_ptr()
        p.kmask_sb = kmask.stride(0) if kmask.shape[0] > 1 else 0
    if cu_q is not None:
        p.cu_seqlens_q, p.cu_seqlens_k = cu_q.data_ptr(), cu_k.data_ptr()
        p.lse_sh = lse.stride(0) if lse.numel() else 0
    p.B, p.Hq, p.Hkv, p.Sq, p.Skv, p.D = B, Hq, Hkv, Sq, Skv, D
    p.causal = int(bool(is_causal))
    p.dtype = _ops._DTYPE_CODE[q.dtype]
    p.kernel = int(kernel)
    p.qk_bits = int(qk_bits)
    p.smooth_v = int(bool(smooth_v))
    p.hop_split_max = int(hop_split_max)  # (qk_packed stays 0: the library derives it from kernel)
    p.window_keys = int(window_left) + 1  # ABI 7
    p.device, p.device_cc = dev, cc
    p.sm_scale = float(scale)
    return p


def _zero_field(block: bytes, name: str) -> bytes:
    f = getattr(_lib.SageAttnParams, name)
    return block[:f.offset] + bytes(f.size) + block[f.offset + f.size:]


@pytest.fixture
def fake_lib(monkeypatch):
    """A loaded-looking library with a FakeHandle, device 0 an sm_90 GPU; CPU tensors stand in for CUDA ones."""
    handle = FakeHandle()
    monkeypatch.setattr(_lib, "_LIB", types.SimpleNamespace(handle=handle, reason="loaded", path=None,
                                                            archs=["80", "86", "89", "90a"]))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # CPU tensors have no device index
    monkeypatch.setitem(_ops._CC, 0, (9, 0))
    streams = []
    monkeypatch.setattr(_ops, "_stream_ptr", lambda device, index: streams.append((device, index)) or 0x7f00_1230)
    olds = []
    real_launch = _ops._launch

    def spy(q, k, v, out, lse, **kw):
        olds.append(_old_block(q, k, v, out, lse, dev=0, cc=90, **kw))  # same arguments, the pre-change fill
        return real_launch(q, k, v, out, lse, **kw)

    monkeypatch.setattr(_ops, "_launch", spy)
    return types.SimpleNamespace(handle=handle, olds=olds, streams=streams)


def _check_launch(fake, kmask_copied=False):
    h = fake.handle
    assert len(fake.olds) == 1 and h.fwd_block is not None
    old = bytes(fake.olds[0])
    ws_block, fwd_block = h.ws_block, h.fwd_block
    if kmask_copied:  # each side made its own contiguous copy: compare the pointer by what it points to
        assert h.kmask_bytes is not None
        ws_block, fwd_block, old = (_zero_field(b, "kmask") for b in (ws_block, fwd_block, old))
    assert ws_block == old  # workspace still 0 when the size is asked
    assert h.workspace and _zero_field(fwd_block, "workspace") == old  # then only the workspace is set
    assert h.stream == 0x7f00_1230 and fake.streams == [(torch.device("cpu"), 0)]


@pytest.mark.parametrize("bshd", [False, True])
@pytest.mark.parametrize("prec", [(8, False, 2), (4, True, 6), (4, False, 2)])  # (qk_bits, smooth_v, kernel id)
@pytest.mark.parametrize("want_lse", [True, False])
def test_launch_block_identical_padded(fake_lib, bshd, prec, want_lse):
    qk_bits, smooth_v, kernel = prec
    g = torch.Generator().manual_seed(0)
    if bshd:  # strided views: batch/head/seq strides all differ from the contiguous ones
        q = torch.randn(2, 4, 24, 64, generator=g).to(torch.bfloat16).transpose(1, 2)
        k = torch.randn(2, 40, 2, 64, generator=g).to(torch.bfloat16)[:, 8:]
    else:
        q = torch.randn(2, 4, 24, 64, generator=g).half()
        k = torch.randn(2, 2, 32, 64, generator=g).half()
    out, lse = _ops._attn_impl(q, k, k, None, bshd, True, 0.1, kernel, qk_bits, smooth_v, want_lse)
    _check_launch(fake_lib)
    assert (lse.numel() > 0) == want_lse
    p = _lib.SageAttnParams.from_buffer_copy(fake_lib.handle.ws_block)
    assert (p.lse is not None) == want_lse and p.kernel == kernel and p.qk_packed == 0 and p.hop_split_max == 0
    assert (p.B, p.Hq, p.Hkv, p.Sq, p.Skv, p.D) == (2, 4, 2, 24, 32, 64) and p.sm_scale == pytest.approx(0.1)


@pytest.mark.parametrize("kind", ["batch", "broadcast", "strided"])
def test_launch_block_identical_kmask(fake_lib, kind):
    q = torch.randn(3, 2, 16, 128).half()
    k = torch.randn(3, 2, 40, 128).half()
    g = torch.Generator().manual_seed(1)
    if kind == "batch":
        kmask = torch.rand(3, 40, generator=g) > 0.3
    elif kind == "broadcast":  # one row for every batch: batch stride 0
        kmask = torch.rand(1, 40, generator=g) > 0.3
    else:  # key dim not contiguous: _launch passes a contiguous copy
        kmask = (torch.rand(40, 3, generator=g) > 0.3).t()
    _ops._attn_impl(q, k, k, kmask, False, False, 0.125, 3, 8, False, True)
    _check_launch(fake_lib, kmask_copied=kind == "strided")
    p = _lib.SageAttnParams.from_buffer_copy(fake_lib.handle.fwd_block)
    assert p.kmask_sb == (40 if kind != "broadcast" else 0)
    if kind == "strided":
        assert fake_lib.handle.kmask_bytes == kmask.contiguous().numpy().tobytes()


@pytest.mark.parametrize("want_lse", [True, False])
def test_launch_block_identical_varlen(fake_lib, want_lse):
    q = torch.randn(50, 4, 64).half()
    k = torch.randn(70, 2, 64).half()
    cu_q = torch.tensor([0, 20, 50], dtype=torch.int32)
    cu_k = torch.tensor([0, 30, 70], dtype=torch.int32)
    out, lse = _ops._attn_varlen_impl(q, k, k, cu_q, cu_k, 30, 40, True, 0.125, 6, 4, True, want_lse)
    _check_launch(fake_lib)
    p = _lib.SageAttnParams.from_buffer_copy(fake_lib.handle.fwd_block)
    assert p.cu_seqlens_q == cu_q.data_ptr() and p.cu_seqlens_k == cu_k.data_ptr() and p.kmask is None
    assert p.lse_sh == (50 if want_lse else 0) and (p.B, p.Sq, p.Skv) == (2, 30, 40)
    assert out.shape == q.shape and lse.shape == ((4, 50) if want_lse else (0,))


def test_launch_error_is_reported(fake_lib):
    fake_lib.handle.rc = 9
    q = torch.randn(1, 1, 8, 64).half()
    with pytest.raises(RuntimeError, match=r"launch failed \(9\): bad argument"):
        _ops._attn_impl(q, q, q, None, False, False, 0.125, 3, 8, False, True)


# ---- eager fast path around the custom ops ---------------------------------------------------------------------

@pytest.fixture
def op_spies(monkeypatch):
    """CPU tensors posing as CUDA ones; the custom ops and their bodies replaced by recorders."""
    calls = []

    def recorder(name):
        def f(q, *args):
            calls.append((name, args))
            return q.new_empty(q.shape), q.new_empty((0,), dtype=torch.float32)
        return f

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: self.device.type == "cpu"), raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setitem(_ops._CC, 0, (9, 0))
    monkeypatch.setattr(_lib, "_LIB", types.SimpleNamespace(handle=None, reason="fake", path=None,
                                                            archs=["80", "86", "89", "90a"]))
    monkeypatch.setattr(_ops, "_attn_impl", recorder("direct"))
    monkeypatch.setattr(_ops, "_attn_varlen_impl", recorder("direct_varlen"))
    monkeypatch.setattr(torch.ops.sage_patch, "attn", recorder("op"))
    monkeypatch.setattr(torch.ops.sage_patch, "attn_varlen", recorder("op_varlen"))
    return calls


def _qkv(requires_grad=False):
    return [torch.randn(1, 2, 8, 64, dtype=torch.float16, requires_grad=requires_grad) for _ in range(3)]


def _path(calls, fn):
    calls.clear()
    fn()
    assert len(calls) == 1
    return calls[0][0]


def test_fast_path_taken_in_plain_eager(op_spies):
    q, k, v = _qkv()
    assert _path(op_spies, lambda: K.attention(q, k, v)) == "direct"
    direct_args = op_spies[0][1]
    mask = torch.ones(1, 8, dtype=torch.bool)
    assert _path(op_spies, lambda: K.attention(q, k, v, attn_mask=mask, is_causal=True, precision="4b",
                                               smooth_v=True, return_lse=False)) == "direct"
    # the op gets exactly the arguments the body would get
    with torch.device("cpu"):  # a torch-function mode: the op path
        assert _path(op_spies, lambda: K.attention(q, k, v)) == "op"
    assert op_spies[0][1] == direct_args
    assert direct_args == (k, v, None, False, False, 0.125, 3, 8, False, True, 0, -1)


def test_fast_path_respects_autograd(op_spies):
    q, k, v = _qkv(requires_grad=True)
    assert _path(op_spies, lambda: K.attention(q, k, v)) == "op"  # the op records its (raising) autograd node
    with torch.no_grad():
        assert _path(op_spies, lambda: K.attention(q, k, v)) == "direct"
    with torch.inference_mode():
        assert _path(op_spies, lambda: K.attention(*_qkv())) == "direct"
    q2, k2, v2 = _qkv()
    v2.requires_grad_()
    assert _path(op_spies, lambda: K.attention(q2, k2, v2)) == "op"


@pytest.mark.parametrize("case", ["compiling", "parameter", "mask_not_tensor", "dispatch_mode", "functorch",
                                  "profiler"])
def test_fast_path_falls_back_to_op(op_spies, monkeypatch, case):
    from torch.utils._python_dispatch import TorchDispatchMode

    q, k, v = _qkv()
    kw = {}
    ctx = None
    if case == "compiling":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    elif case == "parameter":
        q = torch.nn.Parameter(q, requires_grad=False)  # a Tensor subclass
    elif case == "mask_not_tensor":
        kw["attn_mask"] = [[True] * 8]
    elif case == "dispatch_mode":
        class Passthrough(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                return func(*args, **(kwargs or {}))

        ctx = Passthrough()
    elif case == "functorch":
        monkeypatch.setattr(torch._C, "_are_functorch_transforms_active", lambda: True)
    elif case == "profiler":
        monkeypatch.setattr(torch.autograd, "_profiler_enabled", lambda: True)
    if ctx is not None:
        with ctx:
            assert _path(op_spies, lambda: K.attention(q, k, v, **kw)) == "op"
    else:
        assert _path(op_spies, lambda: K.attention(q, k, v, **kw)) == "op"


def test_fast_path_not_for_other_devices(op_spies):
    q, k, v = _qkv()
    kmeta = torch.empty(1, 2, 8, 64, dtype=torch.float16, device="meta")
    assert _path(op_spies, lambda: K.attention(q, kmeta, v)) == "op"  # the dispatcher decides, as before
    mask_meta = torch.empty(1, 8, dtype=torch.bool, device="meta")
    assert _path(op_spies, lambda: K.attention(q, k, v, attn_mask=mask_meta)) == "op"


def test_fast_path_varlen(op_spies):
    q, k, v = (torch.randn(12, 2, 64, dtype=torch.float16) for _ in range(3))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    assert _path(op_spies, lambda: K.attention_varlen(q, k, v, cu, cu, 7, 7, is_causal=True)) == "direct_varlen"
    args = op_spies[0][1]
    assert args == (k, v, cu, cu, 7, 7, True, 0.125, 3, 8, False, True)
    with torch.device("cpu"):
        assert _path(op_spies, lambda: K.attention_varlen(q, k, v, cu, cu, 7, 7, is_causal=True)) == "op_varlen"
    assert op_spies[0][1] == args
    q.requires_grad_()
    assert _path(op_spies, lambda: K.attention_varlen(q, k, v, cu, cu, 7, 7)) == "op_varlen"
    cu_meta = torch.empty(3, dtype=torch.int32, device="meta")
    assert _path(op_spies, lambda: K.attention_varlen(q.detach(), k, v, cu_meta, cu, 7, 7)) == "op_varlen"


def test_custom_op_autograd_behaviour_kept_for_grad_inputs():
    """What inputs requiring grad get through the op (meta tensors run its fake kernel): an autograd node whose
    backward raises. The fast path never takes these calls, so this stays the behaviour."""
    q = torch.empty(1, 2, 8, 64, dtype=torch.float16, device="meta", requires_grad=True)
    out, lse = torch.ops.sage_patch.attn(q, q, q, None, False, False, 0.125, 3, 8, False, 0, True)
    assert out.requires_grad and out.grad_fn is not None
    with pytest.raises(RuntimeError, match="no autograd formula"):
        out.sum().backward()


# ---- status and per-call checks --------------------------------------------------------------------------------

def test_cuda_availability_asked_until_true(monkeypatch):
    asked = []

    def avail(answer):
        def f():
            asked.append(answer)
            return answer
        return f

    monkeypatch.setattr(K, "_CUDA_SEEN", False)
    monkeypatch.setattr(torch.cuda, "is_available", avail(False))
    assert not K._cuda_available() and not K._cuda_available() and len(asked) == 2  # no: asked every time
    monkeypatch.setattr(torch.cuda, "is_available", avail(True))
    assert K._cuda_available() and K._cuda_available() and len(asked) == 3  # yes once: not asked again


def test_status_is_a_copy_and_per_device(monkeypatch):
    monkeypatch.setattr(_lib, "_LIB", types.SimpleNamespace(handle=object(), reason="loaded", path="/x.so",
                                                            archs=["80", "90a"]))
    monkeypatch.setattr(K, "_CUDA_SEEN", True)
    monkeypatch.setattr(K, "_STATUS_CACHE", {})
    dev = [0]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: dev[0])
    monkeypatch.setitem(_ops._CC, 0, (9, 0))
    monkeypatch.setitem(_ops._CC, 1, (7, 5))
    st = K.status()
    assert st["loaded"] and "sm_90" in st["reason"] and list(st) == ["loaded", "reason", "path", "archs"]
    st["loaded"] = False  # a caller's copy: the cache is untouched
    assert K.status()["loaded"] and K._unserved_reason("8b", False) is None
    dev[0] = 1  # another current device: its own answer
    assert not K.status()["loaded"] and "sm_75" in K._unserved_reason("8b", False)
    assert K._status() is K._status()  # the internal one is the cached dict itself


def test_status_without_cuda_keeps_its_message(monkeypatch):
    monkeypatch.setattr(_lib, "_LIB", types.SimpleNamespace(handle=object(), reason="loaded", path="/x.so",
                                                            archs=["80", "90a"]))
    monkeypatch.setattr(K, "_CUDA_SEEN", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    st = K.status()
    assert list(st) == ["loaded", "reason", "path", "archs"] and st["loaded"] is False
    assert st["reason"].startswith("library loaded (/x.so, sm_80, sm_90a) but no CUDA device is visible to torch")


@pytest.mark.parametrize("make,expect", [
    (lambda: torch.zeros(2, 3, 8, 64, dtype=torch.float16), None),
    (lambda: torch.zeros(2, 3, 64, 8, dtype=torch.float16).transpose(-1, -2),
     "q head dim is not contiguous (stride 8)"),
    (lambda: torch.zeros(2 * 3 * 8 * 64 + 1, dtype=torch.float16)[1:].view(2, 3, 8, 64),
     "q data pointer is not 16-byte aligned"),
    (lambda: torch.zeros(2, 3, 9, 60, dtype=torch.float16)[..., :8],
     "q strides (1620, 540, 60, 1) are not multiples of 8 elements (16-byte loads)"),
    (lambda: torch.zeros(2, 3, 8, dtype=torch.float16), "q must be 4-D, got 3-D"),
])
def test_check_tensor_messages(make, expect):
    assert K._check_tensor("q", make(), torch) == expect


def test_scale_default_matches_head_dim(op_spies):
    q, k, v = (torch.randn(1, 2, 8, 128, dtype=torch.float16) for _ in range(3))
    K.attention(q, k, v)
    assert op_spies[0][1][5] == 1.0 / math.sqrt(128)

"""The sm_90a SageBwd backward's launcher (sage_patch.kernels.sagebwd.hopper) without a GPU: what it runs under
torch's deterministic-algorithms switch (the kernel's deterministic mode: dQ's reductions in a fixed order, through
tile counters), the counters' sizing and their way into the kernel's parameters (the ctypes struct against the C
header), and the reading of the kernel's fp32 dQ buffer (in blocks, bwd_traits.cuh's bwd_dq_tile). The kernel
itself: tests/gpu/test_sagebwd_hopper_gpu.py."""
import ctypes
import os
import shutil
import subprocess

import pytest
import torch

from sage_patch.kernels import _lib
from sage_patch.kernels.sagebwd import hopper

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_deterministic_algorithms_select_the_kernels_deterministic_mode(monkeypatch, caplog):
    ran = []
    monkeypatch.setattr(hopper, "_backward", lambda *a, **kw: ran.append((kw["cuda"], kw["deterministic"])))
    args = (None,) * 8
    hopper.backward(*args, is_causal=False, scale=1.0)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        hopper.backward(*args, is_causal=False, scale=1.0)
        hopper.backward(*args, is_causal=True, scale=1.0)
    finally:
        torch.use_deterministic_algorithms(was)
    assert ran == [(True, False), (True, True), (True, True)]   # the compiled kernel in both modes, no fallback


@pytest.mark.parametrize("sq,tiles", [(1, 1), (64, 1), (65, 2), (1000, 16), (16384, 256)])
def test_dq_sem_shape_has_one_counter_per_dq_tile(sq, tiles):
    assert hopper.dq_sem_shape(2, 3, sq) == (2, 3, tiles)
    assert hopper.dq_sem_shape(2, 3, sq)[2] == hopper.dq_blocks_shape(2, 3, sq, 64)[2]


def _launch_args(b=1, hq=2, hkv=1, sq=100, skv=90, d=64):
    t = lambda *shape, dtype=torch.bfloat16: torch.zeros(*shape, dtype=dtype)  # noqa: E731
    q_int = t(b, hq, sq, d, dtype=torch.int8)
    q_t = do_t = t(b * hq, d, 112, dtype=torch.int8)
    k_int, k_scale, v = t(b, hkv, skv, d, dtype=torch.int8), t(b, hkv, skv, dtype=torch.float32), t(b, hkv, skv, d)
    dq_acc = t(*hopper.dq_blocks_shape(b, hq, sq, d), dtype=torch.float32)
    return (q_int, q_t, do_t, t(b * hq, sq, 4, dtype=torch.float32), k_int, k_scale, v, t(b, hq, sq, d), t(*v.shape),
            t(*v.shape), dq_acc, None)


class _FakeLib:
    """_lib.get()'s stand-in: records the SageBwdParams each launch hands the library."""

    def __init__(self):
        self.seen = []
        fake = self

        class Handle:
            @staticmethod
            def sage_bwd(p, stream):
                fake.seen.append(ctypes.cast(p, ctypes.POINTER(_lib.SageBwdParams)).contents.dq_sem)
                return 0

        self.handle = Handle()


def test_launch_hands_the_counters_to_the_kernel(monkeypatch):
    fake = _FakeLib()
    monkeypatch.setattr(_lib, "get", lambda: fake)
    monkeypatch.setattr(hopper, "device_cc", lambda dev: (9, 0))
    monkeypatch.setattr(hopper, "_stream_ptr", lambda device, dev: 0)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    args = _launch_args()
    hopper.launch(*args, is_causal=True, scale=1.0)
    sem = torch.zeros(hopper.dq_sem_shape(1, 2, 100), dtype=torch.int32)
    hopper.launch(*args, is_causal=True, scale=1.0, dq_sem=sem)
    assert fake.seen == [None, sem.data_ptr()]   # NULL: the default mode


@pytest.mark.parametrize("bad", [torch.zeros(1, 2, 1, dtype=torch.int32), torch.zeros(1, 2, 2),
                                 torch.zeros(1, 2, 4, dtype=torch.int32)[..., ::2]])
def test_launch_refuses_counters_of_another_shape_or_type(bad):
    with pytest.raises(ValueError, match="dq_sem_shape"):
        hopper.launch(*_launch_args(), is_causal=False, scale=1.0, dq_sem=bad)


def test_the_ctypes_struct_has_the_c_headers_layout(tmp_path):
    """SageBwdParams field offsets and size in sage_patch/kernels/_lib.py against kernels_cuda/sage_kernels.h (a
    field added on one side only would hand the kernel garbage: the deterministic mode's dq_sem is ABI 9's)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    names = [n for n, _ in _lib.SageBwdParams._fields_]
    src = tmp_path / "layout.c"
    src.write_text('#include <stdio.h>\n#include <stddef.h>\n#include "sage_kernels.h"\nint main(void) {\n'
                   + "".join(f'printf("%zu\\n", offsetof(SageBwdParams, {n}));\n' for n in names)
                   + 'printf("%zu\\n", sizeof(SageBwdParams));\nreturn 0;\n}\n')
    exe = tmp_path / "layout"
    subprocess.run([cc, "-I", os.path.join(ROOT, "kernels_cuda"), "-o", str(exe), str(src)], check=True)
    got = [int(x) for x in subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()]
    want = [getattr(_lib.SageBwdParams, n).offset for n in names] + [ctypes.sizeof(_lib.SageBwdParams)]
    assert got == want, dict(zip(names + ["sizeof"], zip(got, want)))


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

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


@pytest.mark.parametrize("b,hkv,group,sq,d", [(4, 32, 1, 16384, 128), (1, 8, 4, 32768, 128), (3, 2, 3, 1000, 64),
                                              (2, 1, 1, 4096, 64), (1, 1, 1, 128, 64)])
def test_chunks_cover_every_pair_once_in_contiguous_slices(b, hkv, group, sq, d, monkeypatch):
    monkeypatch.setattr(hopper, "CHUNK_MIN_BYTES", 1 << 20)
    parts = hopper.chunks(b, hkv, group, sq, d, 2)
    seen = torch.zeros(b, hkv, dtype=torch.int64)
    for bs, hs in parts:
        # a slice of (B, H, ...) is contiguous when it holds whole batch entries or heads of one entry
        assert hs == slice(0, hkv) or bs.stop - bs.start == 1, (bs, hs)
        seen[bs, hs] += 1
    assert torch.equal(seen, torch.ones_like(seen))
    temps = b * hkv * group * (-(-sq // 64) * 64 * d * 4 + 2 * d * (-(-sq // 16) * 16) + 16 * sq)
    dq = b * hkv * group * sq * d * 2
    if temps <= 1 << 20:
        assert len(parts) == 1
        return
    # each chunk's temporaries within one bf16 dQ of the whole call, as few chunks as that allows
    per_pair = temps / (b * hkv)
    assert all((bs.stop - bs.start) * (hs.stop - hs.start) * per_pair <= dq for bs, hs in parts) or \
        len(parts) == b * hkv
    assert len(parts) <= 2 * -(-temps // dq)


def test_small_calls_run_in_one_piece():
    assert hopper.chunks(4, 32, 1, 4096, 128, 2) == [(slice(0, 4), slice(0, 32))]   # 392 MiB of temporaries
    assert len(hopper.chunks(4, 32, 1, 16384, 128, 2)) == 4   # 1.5 GiB: 1 GiB of fp32 dQ blocks
    assert len(hopper.chunks(4, 32, 1, 16384, 64, 2)) == 4


def test_chunked_backward_assembles_each_chunks_slices(monkeypatch):
    """The sm_90a path's loop (sagebwd._backward_sm90a) hands each chunk the slices of one set of (batch entry, KV
    head) pairs (GQA: their query heads; the key-padding mask: their entries) and writes its results into those
    slices of dQ, dK, dV. A stand-in for the kernel returns its own inputs: dQ <- Q^, dK <- K^, dV <- V + mask."""
    import sage_patch.kernels.sagebwd as sagebwd

    b, hq, hkv, sq, skv, d = 3, 6, 2, 70, 90, 64
    g = torch.Generator().manual_seed(0)
    q_int = torch.randint(-127, 128, (b, hq, sq, d), generator=g, dtype=torch.int8)
    k_int = torch.randint(-127, 128, (b, hkv, skv, d), generator=g, dtype=torch.int8)
    v = torch.randn(b, hkv, skv, d, generator=g).to(torch.bfloat16)
    mask = torch.rand(b, skv, generator=g) > 0.3
    seen = []

    def kernel(q_c, q_t, do_t, stats, k_c, ks_c, v_c, do_c, dk_c, dv_c, dq_acc, kpm, *, is_causal, scale, dq_sem):
        assert all(x.is_contiguous() for x in (q_c, k_c, dk_c, dv_c))
        seen.append(q_c.shape[:2])
        dq_acc.copy_(_kernel_blocks(q_c.float()))
        dk_c.copy_(k_c.to(dk_c.dtype))
        dv_c.copy_(v_c + kpm[:, None, :, None].to(v_c.dtype))

    monkeypatch.setattr(hopper, "launch", kernel)
    monkeypatch.setattr(sagebwd, "_operands", lambda *a: (None, None, None))
    monkeypatch.setattr(hopper, "CHUNK_MIN_BYTES", 0)
    dq, dk, dv = sagebwd._backward_sm90a(torch.zeros(b, hq, sq, d, dtype=torch.bfloat16), q_int,
                                         torch.ones(b, hq, sq), k_int, torch.ones(b, hkv, skv), v,
                                         torch.zeros(b, hq, sq, d, dtype=torch.bfloat16), torch.zeros(b, hq, sq),
                                         is_causal=False, scale=0.5, key_padding_mask=mask, deterministic=False)
    assert len(seen) > 1
    assert torch.equal(dq, (q_int.float() * 0.5).to(torch.bfloat16))
    assert torch.equal(dk, k_int.to(torch.bfloat16))
    assert torch.equal(dv, v + mask[:, None, :, None].to(torch.bfloat16))


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

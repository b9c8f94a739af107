"""SageBwd's forward and backward from the compiled sm_90a kernels instead of the Triton ones. The forward
(kernels_cuda/hopper/fwd_train_kernel.cuh, C ABI sage_train_fwd) replaces forward_kernel only: Q and K are quantized by
the Triton passes as before (sagebwd._forward), the kernel writes O and both LSEs with forward_kernel's numerics. The
backward (kernels_cuda/hopper/bwd_kernel.cuh, C ABI sage_bwd) replaces the Triton dkdv_kernel and dq_kernel: dQ, dK
and dV in one pass over the (key block, query tile) pairs. Same numerics (KERNEL_LAYOUT), the same operands prepared
by the same passes (sagebwd._backward), the caller's stream, no host synchronization. dQ is summed across key blocks
with floating-point reductions in an fp32 buffer, so by default its summation order (not its numerics' groups) varies
from run to run; with torch.use_deterministic_algorithms(True) the kernel runs its deterministic mode instead
(FlashAttention-3's: per 64-query tile a counter in a zeroed int32 workspace, dq_sem_shape, makes the key blocks add
to the tile one after another in a fixed order), so two runs give bitwise the same dQ, dK and dV. Large calls run the
backward in chunks of (batch entry, KV head) pairs (`chunks`), to bound its temporaries.

It is the launch module of the training variant "sagebwd-hopper" (registry): the Triton family's KERNEL_LAYOUT, this
forward (the Triton one where that measures faster: TRITON_FORWARD_BELOW) and this backward. The registry offers it
where it measures faster than the Triton backward (FASTER_HEAD_DIMS, `unsupported_reason`); the Triton pair serves
every other training call.

    unsupported_reason(t)   -> str | None     the registry's check of a training Target: cannot_run, then speed
    cannot_run(t)           -> str | None     whether the kernel can run the Target at all (device, build, Triton)
    forward(...)                              sagebwd.forward's signature and results (it saves what backward reads)
    backward(...)           -> dq, dk, dv     sagebwd.backward's signature and results
    dq_blocks_shape, dq_from_blocks           the kernel's fp32 dQ buffer (in blocks) and its reading into dQ
    dq_sem_shape                              the deterministic mode's tile counters
    chunks                                    the backward's chunks of (batch entry, KV head) pairs
    launch, launch_forward                    the two kernels' launches
"""
from __future__ import annotations

import ctypes

import torch

from .. import _lib
from .._ops import _DTYPE_CODE, _stream_ptr, device_cc
from . import KERNEL_LAYOUT, _backward, _forward  # noqa: F401 (KERNEL_LAYOUT: this variant's, as launched)
from . import unsupported_reason as _triton_unsupported_reason

HEAD_DIMS = (64, 128)                            # what bwd_launch.cu instantiates
DTYPES = (torch.float16, torch.bfloat16)
# Where this backward is faster than the Triton one (H200, B=4 H=32 bf16, backward alone, same run, 2026-11-29 17:00,
# 4K / 16K): D=128 1.21x / 1.23x, causal 1.13x / 1.24x; D=64 1.18x / 1.20x, causal 1.13x / 1.21x
FASTER_HEAD_DIMS = (64, 128)
# Where the forward stays on the Triton forward_kernel: (head dim, causal) -> the min(Sq, Skv) below which it measured
# faster than the sm_90a forward. H200, B=4 H=32 bf16, forward alone incl. the quantization passes, same run,
# 2026-11-29, Triton / sm_90a / cuDNN ms at 4K and 16K: D=128 2.29 / 2.26 / 1.59, 34.87 / 31.65 / 27.96; causal
# 1.32 / 1.36 / 0.89, 17.30 / 16.48 / 14.20; D=64 1.60 / 1.49 / 1.16, 23.03 / 20.55 / 18.89; causal 1.21 / 0.91 /
# 0.64, 12.28 / 10.81 / 9.56. D=128 causal lost at 4K and won at 16K (no point between measured: Triton below 16K)
TRITON_FORWARD_BELOW = {(128, True): 16384}


def unsupported_reason(t) -> str | None:
    """Why the variant does not train `t` (a registry.Target with training=True), None when it does: the kernel
    cannot run it (cannot_run), or the head dim is one where the Triton backward measures faster
    (FASTER_HEAD_DIMS)."""
    why = cannot_run(t)
    if why:
        return why
    if t.head_dim not in FASTER_HEAD_DIMS:
        return (f"head_dim {t.head_dim}: the SageBwd Triton backward is faster there (the sm_90a one serves "
                f"{FASTER_HEAD_DIMS})")
    return None


def cannot_run(t) -> str | None:
    """Why the compiled kernel cannot run `t` at all, None when it can: what the Triton pair needs (its forward and
    operand passes run here too), then this kernel's own head dims and dtypes, sm_90 and an sm_90a build. The GPU
    tests use it to run the kernel at every head dim it has, not only where it is routed."""
    why = _triton_unsupported_reason(t)
    if why:
        return why
    if t.head_dim not in HEAD_DIMS:
        return f"head_dim {t.head_dim}: the SageBwd sm_90a backward has head dims {HEAD_DIMS} only"
    if t.dtype not in DTYPES:
        return f"dtype {str(t.dtype).removeprefix('torch.')}: the SageBwd sm_90a backward takes float16 or bfloat16"
    if t.cc != (9, 0):
        return f"the SageBwd sm_90a backward runs on sm_90 only (device is sm_{t.cc[0]}{t.cc[1]})"
    if "90a" not in t.archs:
        return "the build has no sm_90a SASS (the SageBwd wgmma backward cannot be JIT-compiled from portable PTX)"
    return None


def forward(q, k, v, *, is_causal: bool, scale: float, key_padding_mask=None, smooth_k: bool = True):
    """sagebwd.forward from the sm_90a kernel (check `cannot_run` first), or from the Triton forward_kernel where
    that measured faster (TRITON_FORWARD_BELOW); the same quantization passes either way."""
    cuda = min(q.shape[2], k.shape[2]) >= TRITON_FORWARD_BELOW.get((q.shape[-1], bool(is_causal)), 0)
    return _forward(q, k, v, is_causal=is_causal, scale=scale, key_padding_mask=key_padding_mask, smooth_k=smooth_k,
                    cuda=cuda)


def launch_forward(q_int, q_scale, qdot, k_int, k_scale, v, out, lse, lse_s, key_padding_mask, *, is_causal,
                   scale) -> None:
    """Launch the forward kernel on the current stream: O into out (B, Hq, Sq, D), the LSEs into lse and lse_s
    (B, Hq, Sq) fp32 contiguous, from q_int (B, Hq, Sq, D) and k_int (B, Hkv, Skv, D) contiguous INT8 with their
    contiguous fp32 scales, qdot (B, Hq, Sq) fp32 contiguous or None (no K smoothing: lse = lse_s) and v with 16-byte
    aligned rows (sagebwd._descriptor_ready)."""
    b, hq, sq, d = q_int.shape
    hkv, skv = k_int.shape[1], k_int.shape[2]
    for name, x, shape in (("q_int", q_int, (b, hq, sq, d)), ("q_scale", q_scale, (b, hq, sq)),
                           ("qdot", qdot, (b, hq, sq)), ("k_int", k_int, (b, hkv, skv, d)),
                           ("k_scale", k_scale, (b, hkv, skv)), ("lse", lse, (b, hq, sq)),
                           ("lse_s", lse_s, (b, hq, sq))):
        if x is not None and (tuple(x.shape) != shape or not x.is_contiguous()):
            raise ValueError(f"{name}: {tuple(x.shape)} (contiguous: {x.is_contiguous()}); the sm_90a forward needs "
                             f"a contiguous tensor of shape {shape}")
    if tuple(out.shape) != (b, hq, sq, d) or out.stride(-1) != 1 or out.dtype != v.dtype:
        raise ValueError(f"out: {tuple(out.shape)} {out.dtype} strides {out.stride()}; the sm_90a forward needs "
                         f"({b}, {hq}, {sq}, {d}) in {v.dtype} with channel stride 1")
    _library()
    kmask, kmask_sb = None, 0
    if key_padding_mask is not None:
        # the kernel's TMA map of the mask needs a row stride that is a multiple of 16 bytes: rows padded (this local
        # keeps the copy alive until the launch is enqueued)
        kmask = torch.zeros(key_padding_mask.shape[0], -(-skv // 16) * 16, dtype=torch.uint8, device=v.device)
        kmask[:, :skv] = key_padding_mask
        kmask_sb = kmask.stride(0) if kmask.shape[0] > 1 else 0
    p = _lib.SageTrainFwdParams()
    p.q_int, p.q_scale = q_int.data_ptr(), q_scale.data_ptr()
    p.qdot = qdot.data_ptr() if qdot is not None else 0
    p.k_int, p.k_scale = k_int.data_ptr(), k_scale.data_ptr()
    p.v, (p.v_sb, p.v_sh, p.v_ss) = v.data_ptr(), v.stride()[:3]
    p.o, (p.o_sb, p.o_sh, p.o_ss) = out.data_ptr(), out.stride()[:3]
    p.lse, p.lse_s = lse.data_ptr(), lse_s.data_ptr()
    p.kmask, p.kmask_sb = (kmask.data_ptr() if kmask is not None else 0), kmask_sb
    _call("sage_train_fwd", "forward", p, v, (b, hq, hkv, sq, skv, d), is_causal=is_causal, scale=scale)


def backward(dout, q_int, q_scale, k_int, k_scale, v, out, lse_s, *, is_causal: bool, scale: float,
             key_padding_mask=None):
    """sagebwd.backward from the sm_90a kernel (check `cannot_run` first); its deterministic mode under
    torch.are_deterministic_algorithms_enabled() (dQ's reductions in a fixed order)."""
    # (sagebwd._backward itself, not sagebwd.backward: that name may be this function, patched in)
    return _backward(dout, q_int, q_scale, k_int, k_scale, v, out, lse_s, is_causal=is_causal, scale=scale,
                     key_padding_mask=key_padding_mask, cuda=True,
                     deterministic=torch.are_deterministic_algorithms_enabled())


def dq_blocks_shape(b: int, hq: int, sq: int, d: int) -> tuple[int, ...]:
    """Shape of the sm_90a kernel's fp32 dQ buffer (bwd_traits.cuh, bwd_dq_tile): per (batch, query head), per
    64-query tile (the last padded), per 32-channel chunk c and warp w (queries 16 w..), a 2 KB block in the
    accumulator-fragment order (k, hh, g, t4, e): query 16 w + 8 hh + g, channel 32 c + 8 k + 2 t4 + e. The kernel's
    float2 stores of a fragment are then 256 contiguous bytes and a warp's block is one bulk reduction."""
    return b, hq, -(-sq // 64), d // 32, 4, 4, 2, 8, 4, 2


def dq_sem_shape(b: int, hq: int, sq: int) -> tuple[int, int, int]:
    """Shape of the deterministic mode's workspace (int32, zeroed; SageBwdParams.dq_sem): one counter per (batch,
    query head, 64-query tile), the dQ buffer's tiles."""
    return b, hq, -(-sq // 64)


def dq_from_blocks(dq_acc: torch.Tensor, sq: int, scale: float, dtype: torch.dtype,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """dQ (B, Hq, Sq, D) in dtype = dq_acc (dq_blocks_shape) * scale, in (query, channel) order: one strided pass
    (the product rounded in fp32, then cast, as dq_acc.mul_(scale).to(dtype)), into `out` (contiguous) if given."""
    b, hq, ntq, nc = dq_acc.shape[:4]
    padded = ntq * 64 != sq
    dq = out if out is not None and not padded else torch.empty(b, hq, ntq * 64, nc * 32, dtype=dtype,
                                                                 device=dq_acc.device)
    # (tile, c, w, k, hh, g, t4, e) -> (tile, w, hh, g | c, k, t4, e): query row, then channel
    torch.mul(dq_acc.permute(0, 1, 2, 4, 6, 7, 3, 5, 8, 9), scale, out=dq.view(b, hq, ntq, 4, 2, 8, nc, 4, 4, 2))
    if not padded:
        return dq
    if out is None:
        return dq[:, :, :sq].contiguous()
    return out.copy_(dq[:, :, :sq])


# The backward's temporaries per query (its fp32 dQ blocks, Q^ and dO^ transposed, the four per-query values) are
# ~3x the bf16 dQ (6.25 bytes per dQ element at D = 128). Made for the whole call, they put its peak memory at
# 1.34-1.36x cuDNN's (cuDNN holds one fp32 dQ accumulator, 2x dQ). Calls whose temporaries pass CHUNK_MIN_BYTES make
# them per chunk of (batch entry, KV head) pairs, each chunk's within one bf16 dQ of the whole call: peak 0.96-0.97x
# cuDNN's. Each chunk is a launch that drains (its last wave) and its own operand passes: H200, B=4 H=32 bf16,
# same run, backward alone in 4 chunks vs one piece: 16K +0-2%, 4K +1.5-3%, causal 4K +10-11%; so smaller calls,
# whose temporaries are small in absolute terms, run in one piece.
CHUNK_MIN_BYTES = 512 << 20


def chunks(b: int, hkv: int, group: int, sq: int, d: int, elem: int) -> list[tuple[slice, slice]]:
    """(batch slice, KV head slice) pairs that cover the call, each a contiguous slice of (B, H, ...) tensors: whole
    batch entries, or heads of one entry. group = Hq / Hkv, elem = bytes per element of dQ."""
    ntq = -(-sq // 64)
    temps = b * hkv * group * (ntq * 64 * d * 4 + 2 * d * (-(-sq // 16) * 16) + 16 * sq)
    if temps <= CHUNK_MIN_BYTES:
        return [(slice(0, b), slice(0, hkv))]
    n = min(b * hkv, -(-temps // (b * hkv * group * sq * d * elem)))
    if n <= 1:
        return [(slice(0, b), slice(0, hkv))]
    if n <= b:
        cuts = [b * i // n for i in range(n + 1)]
        return [(slice(lo, hi), slice(0, hkv)) for lo, hi in zip(cuts, cuts[1:]) if hi > lo]
    m = min(hkv, -(-n // b))
    cuts = [hkv * i // m for i in range(m + 1)]
    return [(slice(i, i + 1), slice(lo, hi)) for i in range(b) for lo, hi in zip(cuts, cuts[1:]) if hi > lo]


def launch(q_int, q_t, do_t, stats, k_int, k_scale, v, dout, dk, dv, dq_acc, key_padding_mask, *, is_causal,
           scale, dq_sem=None) -> None:
    """Launch the kernel on the current stream: dK, dV into dk, dv (B, Hkv, Skv, D), dQ / scale added to dq_acc
    (fp32, contiguous, zeroed, of shape dq_blocks_shape: the kernel's block order, which dq_from_blocks reads).
    q_t / do_t: the transposed INT8 operands of sagebwd._int8_transposed (views of (B * Hq, D, padded) buffers),
    stats: (B * Hq, Sq, 4); v and dout with 16-byte aligned rows (sagebwd._descriptor_ready). dq_sem: None (dQ's
    reductions in any order) or the deterministic mode's zeroed int32 counters of shape dq_sem_shape."""
    b, hq, sq, d = q_int.shape
    want = dq_blocks_shape(b, hq, sq, d)
    if tuple(dq_acc.shape) != want or dq_acc.dtype != torch.float32 or not dq_acc.is_contiguous():
        raise ValueError(f"dq_acc: {tuple(dq_acc.shape)} {dq_acc.dtype} (contiguous: {dq_acc.is_contiguous()}); "
                         f"the kernel needs a contiguous float32 buffer of shape dq_blocks_shape = {want}")
    if dq_sem is not None and (tuple(dq_sem.shape) != dq_sem_shape(b, hq, sq) or dq_sem.dtype != torch.int32
                               or not dq_sem.is_contiguous()):
        raise ValueError(f"dq_sem: {tuple(dq_sem.shape)} {dq_sem.dtype} (contiguous: {dq_sem.is_contiguous()}); "
                         f"the deterministic mode needs a contiguous, zeroed int32 buffer of shape dq_sem_shape = "
                         f"{dq_sem_shape(b, hq, sq)}")
    _library()
    hkv, skv = k_int.shape[1], k_int.shape[2]
    kmask, kmask_sb = None, 0
    if key_padding_mask is not None:
        kmask = key_padding_mask.to(torch.uint8)
        if kmask.stride(-1) != 1:
            kmask = kmask.contiguous()   # this local keeps the copy alive until the launch is enqueued
        kmask_sb = kmask.stride(0) if kmask.shape[0] > 1 else 0
    p = _lib.SageBwdParams()
    p.q_int, p.q_t, p.do_t, p.stats = q_int.data_ptr(), q_t.data_ptr(), do_t.data_ptr(), stats.data_ptr()
    p.k_int, p.k_scale = k_int.data_ptr(), k_scale.data_ptr()
    p.v, (p.v_sb, p.v_sh, p.v_ss) = v.data_ptr(), v.stride()[:3]
    p.dout, (p.do_sb, p.do_sh, p.do_ss) = dout.data_ptr(), dout.stride()[:3]
    p.dk, p.dv, p.dq_acc = dk.data_ptr(), dv.data_ptr(), dq_acc.data_ptr()
    p.dq_sem = dq_sem.data_ptr() if dq_sem is not None else 0
    p.kmask, p.kmask_sb = (kmask.data_ptr() if kmask is not None else 0), kmask_sb
    p.t_stride = q_t.stride(1)
    if do_t.stride(1) != p.t_stride:
        raise ValueError(f"q_t and do_t row strides differ ({p.t_stride}, {do_t.stride(1)})")
    _call("sage_bwd", "backward", p, v, (b, hq, hkv, sq, skv, d), is_causal=is_causal, scale=scale)


def _library():
    """The loaded library's handle; RuntimeError with the loader's reason when there is none (checked before a
    launch prepares anything)."""
    lib = _lib.get()
    if lib.handle is None:
        raise RuntimeError(f"sage_patch kernels not loaded: {lib.reason}")
    return lib.handle


def _call(entry: str, what: str, p, v, sizes, *, is_causal, scale) -> None:
    """Fill the fields both kernels' parameter structs share (sizes (B, Hq, Hkv, Sq, Skv, D), causal, dtype, device,
    scale) and call the C entry point `entry` on the current stream of v's device."""
    dev = v.device.index if v.device.index is not None else torch.cuda.current_device()
    major, minor = device_cc(dev)
    p.B, p.Hq, p.Hkv, p.Sq, p.Skv, p.D = sizes
    p.causal, p.dtype = int(bool(is_causal)), _DTYPE_CODE[v.dtype]
    p.device, p.device_cc, p.sm_scale = dev, major * 10 + minor, float(scale)
    h = _library()
    rc = getattr(h, entry)(ctypes.byref(p), ctypes.c_void_p(_stream_ptr(v.device, dev)))
    if rc != 0:
        raise RuntimeError(f"sage_patch SageBwd sm_90a {what} failed ({rc}): {h.sage_error_string(rc).decode()}")

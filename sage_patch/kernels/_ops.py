"""torch.library custom ops around libsage_kernels.so (launch on the caller's stream, no host sync).

- ``sage_patch::attn``: "8b" or "4b" (qk_bits 8/4), optional smooth V, BHSD or BSHD.
- ``sage_patch::attn_varlen``: packed variable-length batches (q (total_q, Hq, D), k/v (total_k, Hkv, D),
  cu_seqlens int32 (B+1)); lse is (Hq, total_q).
``attn`` and ``attn_varlen`` take want_lse: False returns an empty lse (shape (0,)) and the kernel skips the LSE
work (the sm_90 kernel then runs a variant without the fp32 row sums the LSE needs).
"""
from __future__ import annotations

import ctypes
import math
from typing import Optional, Tuple

import torch

from . import _lib

_DTYPE_CODE = {torch.float16: 0, torch.bfloat16: 1}
_CC: dict[int, tuple[int, int]] = {}  # device index -> compute capability, queried once per device


def device_cc(index: int) -> tuple[int, int]:
    cc = _CC.get(index)
    if cc is None:
        cc = tuple(torch.cuda.get_device_capability(index))
        _CC[index] = cc
    return cc


def _dims(x: torch.Tensor, bshd: bool):
    """(B, H, S, D) and element strides (batch, head, seq) of a BHSD or BSHD tensor."""
    if bshd:
        b, s, h, d = x.shape
        sb, ss, sh, _ = x.stride()  # one stride() call: each is a round trip into C++
        return (b, h, s, d), (sb, sh, ss)
    b, h, s, d = x.shape
    sb, sh, ss, _ = x.stride()
    return (b, h, s, d), (sb, sh, ss)


def _lse_shape(q: torch.Tensor, bshd: bool):
    (b, h, s, _), _ = _dims(q, bshd)
    return (b, h, s)


# The raw cudaStream_t of a device's current stream, what torch.cuda.current_stream(dev).cuda_stream gives without
# building a Stream object (inductor's generated code uses the same call); builds without it take that slower call.
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream_ptr(device: torch.device, index: int) -> int:
    if _RAW_STREAM is not None:
        return _RAW_STREAM(index)
    return torch.cuda.current_stream(device).cuda_stream


def _launch(q, k, v, out, lse, *, dims, qs, ks, vs, os_, kmask, cu_q, cu_k, is_causal, scale, kernel, qk_bits,
            smooth_v, hop_split_max=0, window_left=-1) -> None:
    lib = _lib.get()
    if lib.handle is None:
        raise RuntimeError(f"sage_patch kernels not loaded: {lib.reason}")
    device = q.device
    dev = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = device_cc(dev)
    want_lse = lse.numel() != 0  # an empty lse: no LSE wanted (NULL)
    kmask_ptr = kmask_sb = 0
    if kmask is not None:
        if kmask.stride(-1) != 1:
            kmask = kmask.contiguous()  # this local keeps the copy alive until the launch is enqueued
        kmask_ptr = kmask.data_ptr()
        kmask_sb = kmask.stride(0) if kmask.shape[0] > 1 else 0
    cu_q_ptr = cu_k_ptr = lse_sh = 0
    if cu_q is not None:
        cu_q_ptr, cu_k_ptr = cu_q.data_ptr(), cu_k.data_ptr()
        lse_sh = lse.stride(0) if want_lse else 0  # (Hq, total_q)
    # A fresh block per call (about as cheap as a thread-local one, and safe under threads and re-entry), filled in
    # one struct.pack_into instead of ~40 ctypes attribute writes; values in _lib.PARAM_FIELDS order, pointers as
    # ints (0 = NULL), workspace 0 until its size is known. The C side reads the block during the two calls only.
    p = _lib.SageAttnParams()
    _lib.fill_params(p, (q.data_ptr(), *qs, k.data_ptr(), *ks, v.data_ptr(), *vs, out.data_ptr(), *os_,
                         lse.data_ptr() if want_lse else 0, kmask_ptr, kmask_sb, 0, *dims,
                         int(bool(is_causal)), _DTYPE_CODE[q.dtype], int(kernel), dev, major * 10 + minor,
                         float(scale), int(qk_bits), int(bool(smooth_v)), cu_q_ptr, cu_k_ptr,
                         0, int(hop_split_max), lse_sh, int(window_left) + 1))
    ref = ctypes.byref(p)
    h = lib.handle
    nbytes = h.sage_attn_workspace_bytes(ref)
    ws = torch.empty(nbytes, device=device, dtype=torch.uint8)
    p.workspace = ws.data_ptr()
    rc = h.sage_attn_fwd(ref, ctypes.c_void_p(_stream_ptr(device, dev)))
    if rc != 0:
        raise RuntimeError(f"sage_patch kernel launch failed ({rc}): {h.sage_error_string(rc).decode()}")


def _lse_or_empty(q, shape, want_lse):
    return q.new_empty(shape if want_lse else (0,), dtype=torch.float32)


def _attn_impl(q, k, v, kmask, bshd, is_causal, scale, kernel, qk_bits, smooth_v, want_lse=True, hop_split_max=0,
               window_left=-1):
    (B, Hq, Sq, D), qs = _dims(q, bshd)
    (_, Hkv, Skv, _), ks = _dims(k, bshd)
    _, vs = _dims(v, bshd)
    out = q.new_empty(q.shape)
    lse = _lse_or_empty(q, (B, Hq, Sq), want_lse)
    if Sq == 0 or B == 0 or Hq == 0:
        return out, lse
    if Skv == 0:
        out.zero_()
        lse.fill_(-math.inf)
        return out, lse
    _, os_ = _dims(out, bshd)
    _launch(q, k, v, out, lse, dims=(B, Hq, Hkv, Sq, Skv, D), qs=qs, ks=ks, vs=vs, os_=os_, kmask=kmask, cu_q=None,
            cu_k=None, is_causal=is_causal, scale=scale, kernel=kernel, qk_bits=qk_bits, smooth_v=smooth_v,
            hop_split_max=hop_split_max, window_left=window_left)
    return out, lse


@torch.library.custom_op("sage_patch::attn", mutates_args=(), device_types="cuda")
def attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kmask: Optional[torch.Tensor], bshd: bool,
         is_causal: bool, scale: float, kernel: int, qk_bits: int, smooth_v: bool, want_lse: bool,
         hop_split_max: int = 0, window_left: int = -1) -> Tuple[torch.Tensor, torch.Tensor]:
    """kernel: the kernel variant's C id (sage_patch.kernels.registry, SAGE_KERNEL_*); qk_bits 8 ("8b") or 4 ("4b" =
    INT4 values with Q smoothing); smooth_v; want_lse; hop_split_max (wgmma kernel: most parts of a split tail tile,
    0 = the default 4); window_left (sliding window, -1 = none: SageAttnParams.window_left)."""
    return _attn_impl(q, k, v, kmask, bshd, is_causal, scale, kernel, qk_bits, smooth_v, want_lse, hop_split_max,
                      window_left)


@attn.register_fake
def _attn_fake(q, k, v, kmask, bshd, is_causal, scale, kernel, qk_bits, smooth_v, want_lse, hop_split_max=0,
               window_left=-1):
    return q.new_empty(q.shape), _lse_or_empty(q, _lse_shape(q, bshd), want_lse)


@torch.library.custom_op("sage_patch::attn_varlen", mutates_args=(), device_types="cuda")
def attn_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, is_causal: bool, scale: float,
                kernel: int, qk_bits: int, smooth_v: bool, want_lse: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """Packed variable-length batches: q (total_q, Hq, D), k/v (total_k, Hkv, D), cu_seqlens int32 (B+1) on q's
    device, max_seqlen_* >= every sequence's length. Returns (out like q, lse fp32 (Hq, total_q))."""
    return _attn_varlen_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale,
                             kernel, qk_bits, smooth_v, want_lse)


def _attn_varlen_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale, kernel,
                      qk_bits, smooth_v, want_lse):
    """The body of sage_patch::attn_varlen (kernels.attention_varlen calls it directly in eager mode)."""
    total_q, Hq, D = q.shape
    Hkv = k.shape[1]
    B = cu_seqlens_q.shape[0] - 1
    out = q.new_empty(q.shape)
    lse = _lse_or_empty(q, (Hq, total_q), want_lse)
    if total_q == 0 or B <= 0 or Hq == 0 or max_seqlen_q <= 0:
        return out, lse
    if max_seqlen_k <= 0 or k.shape[0] == 0:
        out.zero_()
        lse.fill_(-math.inf)
        return out, lse

    def st(x):  # (batch, head, seq) strides: no batch stride, tokens are offset by cu_seqlens
        return (0, x.stride(1), x.stride(0))

    _launch(q, k, v, out, lse, dims=(B, Hq, Hkv, int(max_seqlen_q), int(max_seqlen_k), D), qs=st(q), ks=st(k),
            vs=st(v), os_=st(out), kmask=None, cu_q=cu_seqlens_q, cu_k=cu_seqlens_k, is_causal=is_causal,
            scale=scale, kernel=kernel, qk_bits=qk_bits, smooth_v=smooth_v)
    return out, lse


@attn_varlen.register_fake
def _attn_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale, kernel,
                      qk_bits, smooth_v, want_lse):
    return q.new_empty(q.shape), _lse_or_empty(q, (q.shape[1], q.shape[0]), want_lse)

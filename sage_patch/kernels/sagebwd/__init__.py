"""SageBwd on the GPU: the trainable 8b attention's forward and backward as Triton kernels (sm_80 and newer).

    forward(q, k, v, ...)   -> out, lse, lse_s, q_int, q_scale, k_int, k_scale   (what the backward reads)
    backward(dout, ...)     -> dq, dk, dv

The numerics are `KERNEL_LAYOUT`, data that sage_patch.reference.sagebwd.SageBwdConfig takes (`SageBwdConfig(**
KERNEL_LAYOUT)`, sage_patch.trainable.KERNEL_CONFIG) to simulate them exactly (the GPU tests compare the two):
per-token INT8 scales for Q, the smoothed K and dO, P~ V in the input dtype, and the P / dS operands of the
backward's INT8 products quantized per row or column of their tile after the other operand's scale is folded in
(SageBwdConfig docstring). The tile sizes that set the numerics are the backward's block_q (dK/dV's query tile)
and block_k (dQ's key tile); the others are free and chosen for speed (TILES).

Non-finite inputs follow the simulation's rule (its module docstring): a NaN or Inf in Q, K, V or dO reaches every
output and gradient row it enters: Q, K and dO, and the P / dS tiles they reach, through the NaN scale of the row
they are quantized in (quant.row_amax); V, used in the input dtype, by IEEE arithmetic.

Layout (B, H, S, D) with any strides whose channel stride is 1 (for V and dO, read through tensor descriptors, also
every other stride and the base 16-byte aligned); other inputs are copied, outputs are contiguous. Launches go to the
current CUDA stream (Triton's default), with no host synchronization: CUDA graphs capture them. Triton is imported
when a kernel first runs, so importing sage_patch never needs it.
"""
from __future__ import annotations

import torch

# SageBwdConfig's fields (the kernels describe their numerics as data; the reference layer interprets them)
KERNEL_LAYOUT = {"groups": "token", "block_q": 64, "block_k": 64, "pv": "input", "smooth_k": True, "dp": "input"}
# What the kernels serve (this family's own constants: the training capability check, `unsupported_reason`, reads
# these, not the inference kernels' registry.NATIVE_HEAD_DIMS)
HEAD_DIMS = (64, 128)
DTYPES = (torch.float16, torch.bfloat16)
MIN_CC = (8, 0)  # Triton emits mma.sync from sm_80 (wgmma on sm_90)


def unsupported_reason(t) -> str | None:
    """Why these kernels cannot run a training call of `t` (a registry.Target with training=True), None when they
    can: the device (sm_80+), Triton (t.triton), the head dim (HEAD_DIMS) and the dtype (DTYPES)."""
    if t.cc < MIN_CC:
        return f"the SageBwd Triton kernels need sm_{MIN_CC[0]}{MIN_CC[1]}+ (device is sm_{t.cc[0]}{t.cc[1]})"
    if t.triton:
        return t.triton
    if t.head_dim not in HEAD_DIMS:
        return f"head_dim {t.head_dim}: the SageBwd Triton kernels have head dims {HEAD_DIMS} only"
    if t.dtype not in DTYPES:
        names = " or ".join(str(x).removeprefix("torch.") for x in DTYPES)
        return f"dtype {str(t.dtype).removeprefix('torch.')}: the SageBwd Triton kernels take {names}"
    return None

# Free tile sizes and launch settings per head dim (measured on the H200, docs/design/tried_and_rejected.md): forward
# query rows, keys, warps and pipeline stages; dK/dV keys and warps, and whether dK and dV share one launch
# (dkdv_fused) or take one each; dQ query rows and warps; the backward's pipeline stages.
TILES = {
    64: dict(fwd_m=128, fwd_n=64, fwd_warps=4, fwd_stages=3, dkdv_n=64, dkdv_warps=4, dkdv_fused=True, dq_m=64,
             dq_warps=4, bwd_stages=2),
    128: dict(fwd_m=64, fwd_n=64, fwd_warps=4, fwd_stages=3, dkdv_n=64, dkdv_warps=4, dkdv_fused=False, dq_m=64,
              dq_warps=4, bwd_stages=2),
}


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _channels_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x, or a contiguous copy where its channel stride is not 1 (what the pointer-indexed kernels need)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _descriptor_ready(x: torch.Tensor) -> torch.Tensor:
    """x, or a contiguous copy where a tensor descriptor cannot address it (channel stride 1, every other stride
    and the base address 16-byte aligned)."""
    size = x.element_size()
    ok = x.stride(-1) == 1 and x.data_ptr() % 16 == 0 and all(s * size % 16 == 0 for s in x.stride()[:-1])
    return x if ok else x.contiguous()


def _descriptor(x: torch.Tensor, box):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(x, list(x.shape), list(x.stride()), list(box))


def _scales_descriptor(scale: torch.Tensor, block: int):
    """A descriptor of (B, H, S) fp32 scales as (B * H, S) rows of `block`: rows padded to 16 bytes (a copy: the
    kernels' saved scales stay contiguous), zeros past S."""
    b, h, s = scale.shape
    padded = torch.zeros(b * h, _cdiv(s, 4) * 4, dtype=scale.dtype, device=scale.device)
    padded[:, :s] = scale.view(b * h, s)
    return _descriptor(padded[:, :s], (1, block))


def _int8_transposed(b: int, h: int, s: int, d: int, device) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """An empty INT8 (B * H, D, S) transposed operand whose rows are padded to 16 bytes (a descriptor's strides must
    be), and the (head, token, channel) strides that _quantize_tokens writes it with."""
    padded = _cdiv(s, 16) * 16
    buf = torch.empty(b * h, d, padded, dtype=torch.int8, device=device)
    return buf[:, :, :s], (d * padded, 1, padded)


def _transpose(x_int: torch.Tensor) -> torch.Tensor:
    """(B, H, S, D) INT8, contiguous -> its (B * H, D, S) transpose (_int8_transposed)."""
    from .quant import transpose_kernel

    b, h, s, d = x_int.shape
    xt, _ = _int8_transposed(b, h, s, d, x_int.device)
    block = 64
    transpose_kernel[(_cdiv(s, block), b * h)](_descriptor(x_int.view(b * h, s, d), (1, block, d)),
                                               _descriptor(xt, (1, d, block)), BLOCK_S=block, D=d)
    return xt


def _key_padding(mask: torch.Tensor | None, q: torch.Tensor):
    """(uint8 (B, Skv) or a dummy, its batch stride, whether a mask is used)."""
    if mask is None:
        return q.new_empty(1, dtype=torch.uint8), 0, False
    m = mask.to(torch.uint8)
    return m, (0 if m.shape[0] == 1 else m.stride(0)), True


def _quantize_tokens(x, out, out_strides, scale=None, *, mean=None, mean_group=1, dot=None, stats=None):
    """Per-token INT8 of x into `out` (its strides out_strides) and its scales into `scale`; mean: K's token mean to
    subtract (or, with dot, to take q . mean(K) against); stats (o, q_scale, lse, rows): x is dO, and the kernel
    writes the backward's per-query rows instead of the scales."""
    from .quant import quantize_tokens_kernel

    b, h, s, d = x.shape
    mode = 0 if mean is None else (2 if dot is not None else 1)
    spare = scale if stats is None else stats[3]   # passed for the pointers a mode does not read
    o, q_scale, lse, rows = (x, spare, spare, spare) if stats is None else stats
    block = 64
    quantize_tokens_kernel[(_cdiv(s, block), b * h)](
        x, x.stride(0), x.stride(1), x.stride(2), out, *out_strides, spare,
        spare if mean is None else mean, spare if dot is None else dot,
        o, o.stride(0), o.stride(1), o.stride(2), q_scale, lse, rows, h, s, mean_group,
        D=d, BLOCK_S=block, MEAN_MODE=mode, STATS=stats is not None)


def forward(q, k, v, *, is_causal: bool, scale: float, key_padding_mask=None, smooth_k: bool = True):
    """Training forward. q (B, Hq, Sq, D), k and v (B, Hkv, Skv, D), fp16 or bf16; key_padding_mask None or bool
    (B, Skv), True = attend. Returns (out (B, Hq, Sq, D) in q's dtype, lse fp32 (B, Hq, Sq), lse of the smoothed
    scores, q_int int8 (B, Hq, Sq, D), q_scale fp32 (B, Hq, Sq), k_int int8 (B, Hkv, Skv, D), k_scale (B, Hkv, Skv))."""
    return _forward(q, k, v, is_causal=is_causal, scale=scale, key_padding_mask=key_padding_mask, smooth_k=smooth_k,
                    cuda=False)


def _forward(q, k, v, *, is_causal, scale, key_padding_mask, smooth_k, cuda: bool):
    """`forward`, from the Triton forward_kernel or (cuda) the compiled sm_90a kernel (hopper.launch_forward: the same
    numerics from the same quantized operands)."""
    q, k, v = _channels_contiguous(q), _channels_contiguous(k), _descriptor_ready(v)   # only V is read by descriptor
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    t = TILES[d]
    f32 = torch.float32
    k_int = torch.empty(b, hkv, skv, d, dtype=torch.int8, device=q.device)
    k_scale = torch.empty(b, hkv, skv, dtype=f32, device=q.device)
    mean = k.mean(dim=2, dtype=f32).contiguous() if smooth_k else None          # (B, Hkv, D)
    _quantize_tokens(k, k_int, (skv * d, d, 1), k_scale, mean=mean)
    q_int = torch.empty(b, hq, sq, d, dtype=torch.int8, device=q.device)
    q_scale = torch.empty(b, hq, sq, dtype=f32, device=q.device)
    qdot = torch.empty(b, hq, sq, dtype=f32, device=q.device) if smooth_k else q_scale
    _quantize_tokens(q, q_int, (sq * d, d, 1), q_scale, mean=mean, mean_group=hq // hkv,
                     dot=qdot if smooth_k else None)
    out = torch.empty(b, hq, sq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, hq, sq, dtype=f32, device=q.device)
    lse_s = torch.empty_like(lse)
    if cuda:
        from .hopper import launch_forward

        launch_forward(q_int, q_scale, qdot if smooth_k else None, k_int, k_scale, v, out, lse, lse_s,
                       key_padding_mask, is_causal=is_causal, scale=scale)
        return out, lse, lse_s, q_int, q_scale, k_int, k_scale
    from .fwd import forward_kernel

    kpm, skpm, has_kpm = _key_padding(key_padding_mask, q)
    bn = t["fwd_n"]
    forward_kernel[(_cdiv(sq, t["fwd_m"]), b * hq)](
        q_int, q_scale, qdot, _descriptor(k_int.view(b * hkv, skv, d), (1, bn, d)), _scales_descriptor(k_scale, bn),
        _descriptor(v, (1, 1, bn, d)), out, out.stride(0), out.stride(1), out.stride(2), lse, lse_s, kpm, skpm, hq, hkv,
        sq, skv, float(scale), D=d, BLOCK_M=t["fwd_m"], BLOCK_N=bn, CAUSAL=bool(is_causal), KEY_PADDING=has_kpm,
        SMOOTH_K=bool(smooth_k), num_warps=t["fwd_warps"], num_stages=t["fwd_stages"])
    return out, lse, lse_s, q_int, q_scale, k_int, k_scale


def backward(dout, q_int, q_scale, k_int, k_scale, v, out, lse_s, *, is_causal: bool, scale: float,
             key_padding_mask=None):
    """Backward from what `forward` returned. dout (B, Hq, Sq, D) (cast to v's dtype, as autograd may hand it in
    another). Returns (dq, dk, dv) in v's dtype, contiguous."""
    return _backward(dout, q_int, q_scale, k_int, k_scale, v, out, lse_s, is_causal=is_causal, scale=scale,
                     key_padding_mask=key_padding_mask, cuda=False)


def _backward(dout, q_int, q_scale, k_int, k_scale, v, out, lse_s, *, is_causal, scale, key_padding_mask,
              cuda: bool, deterministic: bool = False):
    """`backward`, from the Triton dkdv_kernel and dq_kernel or (cuda) the compiled sm_90a kernel (hopper.launch:
    the same numerics from the same prepared operands, dQ accumulated in fp32 and scaled and cast here; with
    deterministic, in the kernel's fixed order: its tile counters zeroed here)."""
    dout = _descriptor_ready(dout.to(v.dtype))
    v, out = _descriptor_ready(v), _channels_contiguous(out)
    if cuda:
        return _backward_sm90a(dout, q_int, q_scale, k_int, k_scale, v, out, lse_s, is_causal=is_causal,
                               scale=scale, key_padding_mask=key_padding_mask, deterministic=deterministic)
    b, hq, sq, d = q_int.shape
    hkv, skv = k_int.shape[1], k_int.shape[2]
    t = TILES[d]
    half, bm, bn = d // 2, KERNEL_LAYOUT["block_q"], KERNEL_LAYOUT["block_k"]
    do_t, stats, q_t = _operands(dout, q_int, q_scale, out, lse_s)
    dk = torch.empty(b, hkv, skv, d, dtype=v.dtype, device=v.device)
    dv = torch.empty_like(dk)
    kpm, skpm, has_kpm = _key_padding(key_padding_mask, v)
    flags = dict(D=d, CAUSAL=bool(is_causal), KEY_PADDING=has_kpm, num_stages=t["bwd_stages"],
                 num_warps=t["dkdv_warps"], BLOCK_M=bm, BLOCK_N=t["dkdv_n"])
    sizes = (hq, hkv, sq, skv, float(scale))
    args = (_descriptor(q_int.view(b * hq, sq, d), (1, bm, d)), _descriptor(q_t, (1, half, bm)), k_int, k_scale, v,
            v.stride(0), v.stride(1), v.stride(2), _descriptor(dout, (1, 1, bm, d)), _descriptor(do_t, (1, half, bm)),
            _descriptor(stats, (1, bm, 4)), dk, dv, kpm, skpm, *sizes)
    from .bwd import dkdv_kernel, dq_kernel

    grid = (_cdiv(skv, t["dkdv_n"]), b * hkv)
    for parts in ((True, True),) if t["dkdv_fused"] else ((False, True), (True, False)):
        dkdv_kernel[grid](*args, DK=parts[0], DV=parts[1], **flags)
    del args, do_t, q_t  # the transposed INT8 operands are not needed by dQ: freed before K^T is made
    k_t = _transpose(k_int)   # the K-major operand of dS K^
    dq = torch.empty(b, hq, sq, d, dtype=v.dtype, device=v.device)
    dq_kernel[(_cdiv(sq, t["dq_m"]), b * hq)](
        q_int, _descriptor(k_int.view(b * hkv, skv, d), (1, bn, d)), _descriptor(k_t, (1, half, bn)),
        _scales_descriptor(k_scale, bn), _descriptor(v, (1, 1, bn, d)), dout, dout.stride(0), dout.stride(1),
        dout.stride(2), stats, dq, kpm, skpm, *sizes, D=d, CAUSAL=bool(is_causal), KEY_PADDING=has_kpm,
        num_stages=t["bwd_stages"], num_warps=t["dq_warps"], BLOCK_M=t["dq_m"], BLOCK_N=bn)
    return dq, dk, dv


def _operands(dout, q_int, q_scale, out, lse_s):
    """What both backwards read besides the saved tensors: dO^ transposed (INT8, its per-token scales folded into
    the per-query rows), those rows (B * Hq, Sq, 4) (bwd.row_stats) and Q^ transposed (the K-major operand of
    dS^T Q^)."""
    b, hq, sq, d = q_int.shape
    do_t, do_t_strides = _int8_transposed(b, hq, sq, d, dout.device)
    stats = torch.empty(b * hq, sq, 4, dtype=torch.float32, device=dout.device)
    _quantize_tokens(dout, do_t, do_t_strides, stats=(out, q_scale, lse_s, stats))
    return do_t, stats, _transpose(q_int)


def _backward_sm90a(dout, q_int, q_scale, k_int, k_scale, v, out, lse_s, *, is_causal, scale, key_padding_mask,
                    deterministic):
    """The sm_90a kernel's backward, over chunks of (batch entry, KV head) pairs (hopper.chunks): each chunk's
    temporaries (the fp32 dQ buffer, the transposed INT8 operands, the per-query rows: ~3x its bf16 dQ) live only
    while it runs, so a large call's peak memory stays below cuDNN's, which holds a whole fp32 dQ accumulator (small
    calls run in one piece: hopper.CHUNK_MIN_BYTES)."""
    from .hopper import chunks, dq_blocks_shape, dq_from_blocks, dq_sem_shape, launch

    b, hq, sq, d = q_int.shape
    hkv, skv = k_int.shape[1], k_int.shape[2]
    g = hq // hkv
    dq = torch.empty(b, hq, sq, d, dtype=v.dtype, device=v.device)
    dk = torch.empty(b, hkv, skv, d, dtype=v.dtype, device=v.device)
    dv = torch.empty_like(dk)
    for bs, hs in chunks(b, hkv, g, sq, d, v.element_size()):
        qs = (bs, slice(hs.start * g, hs.stop * g))   # the query heads of KV heads hs
        kpm = key_padding_mask if key_padding_mask is None or key_padding_mask.shape[0] == 1 else key_padding_mask[bs]
        q_c = q_int[qs]
        do_t, stats, q_t = _operands(dout[qs], q_c, q_scale[qs], out[qs], lse_s[qs])
        dq_acc = torch.zeros(dq_blocks_shape(*q_c.shape), dtype=torch.float32, device=v.device)
        dq_sem = torch.zeros(dq_sem_shape(*q_c.shape[:3]), dtype=torch.int32, device=v.device) if deterministic \
            else None
        launch(q_c, q_t, do_t, stats, k_int[bs, hs], k_scale[bs, hs], v[bs, hs], dout[qs], dk[bs, hs], dv[bs, hs],
               dq_acc, kpm, is_causal=is_causal, scale=scale, dq_sem=dq_sem)
        del do_t, stats, q_t   # before the next chunk's are made
        dq_from_blocks(dq_acc, sq, float(scale), v.dtype, out=dq[qs])
        del dq_acc, dq_sem
    return dq, dk, dv

import torch
import sage_patch.kernels.sagebwd as K
from sage_patch.kernels.sagebwd import _cdiv, _channels_contiguous, _quantize_tokens, _key_padding, KERNEL_LAYOUT

WARPS = {"dv": 4, "dkq": 8, "all": 8}

def backward(dout, q_int, q_scale, k_int, k_scale, v, out, lse_s, *, is_causal, scale, key_padding_mask=None):
    from sage_patch.kernels.sagebwd.bwd_dqexp import dkdv_kernel
    dout = _channels_contiguous(dout.to(v.dtype))
    b, hq, sq, d = q_int.shape
    hkv, skv = k_int.shape[1], k_int.shape[2]
    f32 = torch.float32
    do_t = torch.empty(b, hq, d, sq, dtype=torch.int8, device=v.device)
    do_scale = torch.empty(b, hq, sq, dtype=f32, device=v.device)
    delta = torch.empty(b, hq, sq, dtype=f32, device=v.device)
    _quantize_tokens(dout, do_t, (d * sq, 1, sq), do_scale, o=out, delta=delta)
    q_t = q_int.transpose(2, 3).contiguous()
    k_t = k_int.transpose(2, 3).contiguous()
    kpm, skpm, has_kpm = _key_padding(key_padding_mask, v)
    dk = torch.empty(b, hkv, skv, d, dtype=v.dtype, device=v.device)
    dv = torch.empty_like(dk)
    dqa = torch.zeros(b, hq, sq, d, dtype=f32, device=v.device)
    args = (q_int, q_t, q_scale, k_int, k_scale, v, v.stride(0), v.stride(1), v.stride(2),
            dout, dout.stride(0), dout.stride(1), dout.stride(2), do_t, do_scale, lse_s, delta, dk, dv, k_t, dqa,
            kpm, skpm, hq, hkv, sq, skv, float(scale))
    grid = (_cdiv(skv, 64), b * hkv)
    flags = dict(D=d, CAUSAL=bool(is_causal), KEY_PADDING=has_kpm, num_stages=2, BLOCK_M=64, BLOCK_N=64)
    if d == 64:
        dkdv_kernel[grid](*args, DK=True, DV=True, DQ=True, num_warps=WARPS["all"], **flags)
    else:
        dkdv_kernel[grid](*args, DK=False, DV=True, DQ=False, num_warps=WARPS["dv"], **flags)
        dkdv_kernel[grid](*args, DK=True, DV=False, DQ=True, num_warps=WARPS["dkq"], **flags)
    return dqa.to(v.dtype), dk, dv

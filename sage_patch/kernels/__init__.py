"""Compiled kernels (kernels_cuda/): loading, capability checks and launch.

Contract used by sage_patch.resolve (keep these three names and signatures):

- ``status() -> dict``: {"loaded": bool, "reason": str, "path": str | None, "archs": list[str]}.
- ``can_run(precision, q, k, v, *, layout, is_causal, attn_mask, return_lse, smooth_v) -> (impl | None, reason)``:
  ``impl`` names the kernel that would run (e.g. "cuda-mma"), or None with the reason it cannot.
  ``attn_mask`` here is None or a bool key-padding mask (B, Skv), True = attend (resolve normalizes masks first).
- ``run(impl, precision, q, k, v, *, layout, is_causal, scale, attn_mask, return_lse, smooth_v)``:
  returns ``out`` or ``(out, lse)``; ``out`` in the input layout and dtype, ``lse`` fp32 (B, H, Sq), natural log.

Implementations (see docs/kernels.md):

- ``"cuda-mma-fp8pv"``: "8b" = INT8 QK^T (mma.sync m16n8k32) + FP8 E4M3 P~V with two-level accumulation;
  needs sm_89+ (and a build with sm_89 or sm_90a). On sm_89 the P~V MMA is e4m3 mma.sync m16n8k32 (pv mode
  "fp8-mma"); on sm_90 ptxas lowers that instruction to fp16 MMAs plus per-MMA conversions, so there the same
  e4m3 values are carried in fp16 through m16n8k16 (pv mode "fp8-f16"): identical numerics, fewer instructions.
  Reference equivalent: ``reference_config(IMPL_FP8PV, D)`` = ``SimConfig(q_group=Grouping(32, 8, 1),
  k_group=Grouping(64, 8, 2), pv="fp8")`` in the default build (the Q tile is ``q_group_rows(D)``).
- ``"cuda-mma-fp16pv"``: "8b" with FP16 P~V (SageAttention1-style) for sm_80/86; reference: the same with pv="fp16".
- ``"cuda-wgmma-fp8pv"``: the sm_90a Hopper kernel (kernels_cuda/hopper_attn.cuh; "8b" only, the default on sm_90
  when the build has sm_90a): INT8 + FP8 wgmma, warp-specialized, 128-key blocks. Reference:
  ``reference_config(IMPL_WGMMA)`` = ``SimConfig(block_k=128, q_group=Grouping(16, 8, 1),
  k_group=Grouping(128, 8, 2), pv="fp8", row_sum="operand", stats_sample=128)`` (the output is normalised by the
  tensor cores' sums of the quantized P~; K/V means and V's base scale come from 128 evenly spaced tokens, V's
  scale times a power of two per 128-key block). "4b" stays on the portable kernel there.

Both implementations also run "4b" (SageAttention2-4b numerics: INT4 values in [-7, 7] with the same per-thread
groups, Q smoothing per 128-row block with its fp32 Delta S correction; carried in INT8 mma.sync on every arch, see
docs/kernels.md) and ``smooth_v``. ``reference_config(impl, D)`` simulates either precision
(``q_smooth_block`` = the attention CTA's rows). Packed variable-length batches: ``can_run_varlen`` /
``attention_varlen`` (used by ``sage_patch.varlen``).

Environment: ``SAGE_PATCH_NO_KERNELS=1`` disables loading; ``SAGE_PATCH_KERNELS_LIB`` loads another .so;
``SAGE_PATCH_PV=fp16|fp8-mma|fp8-f16`` forces a P~V mode (e.g. to exercise the sm_80 path on newer GPUs).
"""
from __future__ import annotations

import math
import os

from . import _lib
from . import _ops  # registers the custom op torch.ops.sage_patch.attn_8b
from ._lib import arch_supported

# The per-thread quantization groups of these kernels: Q rows with equal r % 8 inside each warp tile of
# q_group_rows(D) rows (32 in the default build: Grouping(32, 8, 1)), keys with equal (c % 8) // 2 in each 64-key block.
DEFAULT_Q_GROUP_ROWS = 32
KERNEL_K_GROUPING_ARGS = (64, 8, 2)
KERNEL_BLOCK_K = 64
NATIVE_HEAD_DIMS = (64, 128)
IMPL_FP8PV = "cuda-mma-fp8pv"
IMPL_FP16PV = "cuda-mma-fp16pv"
IMPL_WGMMA = "cuda-wgmma-fp8pv"  # sm_90a Hopper kernel ("8b"): INT8 + FP8 wgmma, warp-specialized (hopper_attn.cuh)
HOPPER_Q_GROUPING_ARGS = (16, 8, 1)
HOPPER_K_GROUPING_ARGS = (128, 8, 2)
HOPPER_BLOCK_K = 128
HOPPER_STATS_SAMPLE = 128  # tokens the Hopper path's K/V means and V base scale come from (kHopSample)

_STATUS_CACHE: dict = {}
_FORCE_PV = os.environ.get("SAGE_PATCH_PV", "").lower() or None  # read once (keeps traced code env-free)
PV_MODES = {"fp8-mma": 0, "fp16": 1, "fp8-f16": 2, "wgmma": 3}
QK_BITS = {"8b": 8, "4b": 4}
# "4b" QK^T MMA: "int4" (packed INT4, mma.sync m16n8k64 s4: sm_80/86/89) or "int8" (INT4 values in INT8 MMA: every
# arch, the default on sm_90 whose tensor cores have no INT4). SAGE_PATCH_QK_MMA=int4|int8 forces one (tests).
_FORCE_QK_MMA = os.environ.get("SAGE_PATCH_QK_MMA", "").lower() or None
# Speed routing: the shortest sequence (min of Sq, Skv) at which a kernel's whole call (pre-passes included) beats
# torch SDPA (cuDNN), per (head dim, causal), measured on the H200 (B=4 H=32 fp16, docs/benchmarks.md "Hopper kernel,
# fourteenth session": D=128 non-causal 0.97x at 1.75K, 1.15x at 2K; causal 0.98x at 2K, 1.06x at 2.5K; D=64
# non-causal 0.98x at 1.75K, 1.02x at 2K; causal 0.98x at 3.5K, 1.02x at 4K). Shorter calls without a key-padding
# mask run SDPA instead: faster there and exact. SAGE_PATCH_SPEED_ROUTING=0 (or SPEED_ROUTING = False) turns it off.
SDPA_FASTER_BELOW: dict[str, dict[tuple[int, bool], int]] = {
    IMPL_WGMMA: {(128, False): 2048, (128, True): 2560, (64, False): 2048, (64, True): 4096},
}
SPEED_ROUTING = os.environ.get("SAGE_PATCH_SPEED_ROUTING", "1") != "0"


def sdpa_faster_reason(impl: str, q, k, *, layout: str, is_causal: bool) -> str | None:
    """Why SDPA should run this call instead of kernel `impl` (it is faster at this length), or None."""
    if not SPEED_ROUTING:
        return None
    below = SDPA_FASTER_BELOW.get(impl, {}).get((q.shape[-1], bool(is_causal)))
    sdim = 1 if str(layout).lower() == "bshd" else 2
    n = min(q.shape[sdim], k.shape[sdim])  # compared, not int()-ed: a symbolic length under torch.compile stays one
    if below is None or n >= below:
        return None
    return (f"SDPA is faster than {impl} below {below} tokens (head dim {q.shape[-1]}, causal={bool(is_causal)}; "
            f"this call {n}): running full precision (SAGE_PATCH_SPEED_ROUTING=0 keeps the kernel)")


# Features switched off in this version with the reason (a mode the H200 tests did not pass is listed here, so the
# resolver never routes to it): keys "4b", "smooth_v", "varlen"; "4b-int4" (the INT4 MMA: "4b" then uses INT8 MMA).
DISABLED: dict[str, str] = {}


def _torch():
    import torch

    return torch


def status() -> dict:
    """Whether the compiled kernels can run on the current CUDA device, and why not."""
    return dict(_status())


_CUDA_SEEN = False  # torch.cuda.is_available() was True once: it stays so (torch caches the device count)


def _cuda_available() -> bool:
    # is_available() reads os.environ (PYTORCH_NVML_BASED_CUDA_CHECK) at every call: ask until it says yes
    global _CUDA_SEEN
    if not _CUDA_SEEN:
        _CUDA_SEEN = _torch().cuda.is_available()
    return _CUDA_SEEN


# torch.compile runs it at trace time as a constant (as it folds is_available) instead of guarding on _CUDA_SEEN,
# which would recompile once when the first traced call sets it; the attribute assume_constant_result sets.
_cuda_available._dynamo_marked_constant = True


def _status() -> dict:
    """status() without the defensive copy (the per-call checks read it): callers must not modify the result."""
    lib = _lib.get()
    if lib.handle is None:
        return {"loaded": False, "reason": lib.reason, "path": lib.path, "archs": list(lib.archs)}
    torch = _torch()
    if not _cuda_available():
        return {"loaded": False,
                "reason": (f"library loaded ({lib.path}, sm_{', sm_'.join(lib.archs)}) but no CUDA device is "
                           f"visible to torch (torch {torch.__version__}, CUDA {torch.version.cuda})"),
                "path": lib.path, "archs": list(lib.archs)}
    dev = torch.cuda.current_device()
    cached = _STATUS_CACHE.get(dev)
    if cached is not None:
        return cached
    from ._ops import device_cc

    major, minor = device_cc(dev)
    st = {"loaded": False, "reason": lib.reason, "path": lib.path, "archs": list(lib.archs)}
    if not arch_supported(lib.archs, major, minor):
        st["reason"] = (f"library built for sm_{', sm_'.join(lib.archs)} but device {dev} is sm_{major}{minor}: "
                        "rebuild with SAGE_PATCH_CUDA_ARCHS including it")
    elif (major, minor) < (8, 0):
        st["reason"] = f"device {dev} is sm_{major}{minor}: the kernels need sm_80 or newer"
    else:
        st["loaded"] = True
        st["reason"] = f"loaded for sm_{major}{minor} (impl {_pick_impl(lib.archs, major, minor)})"
    _STATUS_CACHE[dev] = st
    return st


def hopper_available(archs, major, minor) -> bool:
    """Whether the sm_90a Hopper kernel can run here (and is not overridden by SAGE_PATCH_PV)."""
    return (major, minor) == (9, 0) and "90a" in archs and _FORCE_PV in (None, "wgmma") and "wgmma" not in DISABLED


def _pick_impl(archs, major, minor, precision="8b") -> str:
    if _FORCE_PV == "fp16":
        return IMPL_FP16PV
    if precision == "8b" and hopper_available(archs, major, minor):
        return IMPL_WGMMA
    fp8_archs = [a for a in archs if int(a[:2]) >= 89]
    if (major, minor) >= (8, 9) and arch_supported(fp8_archs, major, minor):
        return IMPL_FP8PV
    return IMPL_FP16PV


def _layout_ok(layout) -> bool:
    return str(layout).lower() in ("bhsd", "bshd")


def _check_tensor(name, x, torch):
    if x.dim() != 4:
        return f"{name} must be 4-D, got {x.dim()}-D"
    st = x.stride()  # one call (a tuple), indexed below
    if st[3] != 1:
        return f"{name} head dim is not contiguous (stride {st[3]})"
    if x.data_ptr() % 16:
        return f"{name} data pointer is not 16-byte aligned"
    if st[0] % 8 or st[1] % 8 or st[2] % 8:
        return f"{name} strides {st} are not multiples of 8 elements (16-byte loads)"
    if x.numel() >= 2**31 * 8:
        return f"{name} is too large"
    return None


def _dtype_dim_gqa_reason(q, k, v, hdim, torch):
    """Checks shared by the padded and the varlen kernel: dtypes, head dim, GQA ratio (hdim: the heads axis)."""
    if q.dtype not in (torch.float16, torch.bfloat16) or not (q.dtype == k.dtype == v.dtype):
        return f"dtypes {q.dtype}/{k.dtype}/{v.dtype}: the kernel takes fp16 or bf16 (all the same)"
    if q.shape[-1] not in NATIVE_HEAD_DIMS:
        return f"head_dim {q.shape[-1]}: the kernel has head dims {NATIVE_HEAD_DIMS} only"
    if k.shape[hdim] == 0 or q.shape[hdim] % k.shape[hdim]:
        return f"GQA needs Hq % Hkv == 0 (Hq={q.shape[hdim]}, Hkv={k.shape[hdim]})"
    return None


def can_run(precision, q, k, v, *, layout, is_causal, attn_mask, return_lse, smooth_v):
    if precision == "fp4":
        return None, "fp4 needs Blackwell FP4 tensor cores (sm_100/sm_120); no fp4 kernel for this GPU"
    why = _unserved_reason(precision, smooth_v)
    if why:
        return None, why
    torch = _torch()
    dev = q.device  # read once: every .device / .shape access builds a new object
    if not (q.is_cuda and k.is_cuda and v.is_cuda) or not (dev == k.device == v.device):
        return None, "q, k, v must be CUDA tensors on one device"
    idx = dev.index
    if idx is not None and idx != torch.cuda.current_device():
        # the status check above was for the current device; check this one too
        from ._ops import device_cc

        major, minor = device_cc(idx)
        if not arch_supported(_lib.get().archs, major, minor) or (major, minor) < (8, 0):
            return None, f"device {dev} (sm_{major}{minor}) not supported by this build"
    if not _layout_ok(layout):
        return None, f"layout {layout!r} not supported (bhsd, bshd)"
    for name, x in (("q", q), ("k", k), ("v", v)):
        why = _check_tensor(name, x, torch)
        if why:
            return None, why
    bshd = str(layout).lower() == "bshd"
    qs, ks, vs = q.shape, k.shape, v.shape
    d = qs[-1]
    if ks[-1] != d or vs[-1] != d:
        return None, f"head dims differ (q {d}, k {ks[-1]}, v {vs[-1]})"
    hdim = 2 if bshd else 1
    sdim = 1 if bshd else 2
    if qs[0] != ks[0] or ks != vs:
        return None, f"shapes q {tuple(qs)}, k {tuple(ks)}, v {tuple(vs)} do not match"
    why = _dtype_dim_gqa_reason(q, k, v, hdim, torch)
    if why:
        return None, why
    if max(qs[sdim], ks[sdim]) >= 2**30:
        return None, "sequence too long"
    if qs[0] * qs[hdim] > 65535:
        return None, f"B*H = {qs[0] * qs[hdim]} > 65535 (grid limit of the pre-passes)"
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool or attn_mask.dim() != 2 or attn_mask.device != dev:
            return None, "key-padding mask must be a bool (B, Skv) tensor on q's device"
        ms = attn_mask.shape
        if ms[1] != ks[sdim] or ms[0] not in (1, qs[0]):
            return None, f"key-padding mask shape {tuple(ms)} does not match (B, Skv)"
    major, minor = _ops_cc(q)
    return _pick_impl(_lib.get().archs, major, minor, precision), "ok"


def _feature_reason(precision, smooth_v, varlen=False):
    if precision not in QK_BITS:
        return f"no compiled kernel for precision {precision!r}"
    for key, on in ((precision, precision == "4b"), ("smooth_v", smooth_v), ("varlen", varlen)):
        if on and key in DISABLED:
            return DISABLED[key]
    return None


def _unserved_reason(precision, smooth_v, varlen=False):
    """Why no compiled kernel serves this precision / feature combination here at all (None: one may)."""
    why = _feature_reason(precision, smooth_v, varlen)
    if why:
        return why
    st = _status()
    return None if st["loaded"] else st["reason"]


def _ops_cc(q):
    idx = q.device.index
    return _ops.device_cc(idx if idx is not None else _torch().cuda.current_device())


def run(impl, precision, q, k, v, *, layout, is_causal, scale, attn_mask, return_lse, smooth_v):
    if precision not in QK_BITS or impl not in _IMPL_PV or (impl == IMPL_WGMMA and precision != "8b"):
        raise RuntimeError(f"no compiled kernel {impl!r} for precision {precision!r}")
    out, lse = attention(q, k, v, layout=layout, is_causal=is_causal, scale=scale, attn_mask=attn_mask,
                         pv=_IMPL_PV[impl], precision=precision, smooth_v=smooth_v, return_lse=return_lse)
    return (out, lse) if return_lse else out


_IMPL_PV = {IMPL_FP16PV: "fp16", IMPL_FP8PV: "fp8-portable", IMPL_WGMMA: "wgmma"}


def pv_mode(pv, major: int) -> int:
    """P~V mode of the C ABI for pv "fp8-portable" (best mma.sync FP8 mode for this GPU), "fp16", "fp8-mma",
    "fp8-f16" or "wgmma" (the sm_90a Hopper kernel)."""
    if pv == "fp8-portable":
        if _FORCE_PV in ("fp8-mma", "fp8-f16"):
            return PV_MODES[_FORCE_PV]
        return 2 if major == 9 else 0
    if pv not in PV_MODES:
        raise ValueError(f"pv must be None, 'fp8', 'fp8-portable', 'fp16', 'fp8-mma', 'fp8-f16' or 'wgmma', "
                         f"got {pv!r}")
    return PV_MODES[pv]


def impl_for(q, pv=None, precision="8b", *, cc=None) -> str:
    """The implementation a direct call with this `pv` runs (for reference_config). cc: q's device's compute
    capability when the caller has it (saves a look-up)."""
    major, minor = cc or _ops_cc(q)
    if pv is None or pv == "fp8":
        impl = _pick_impl(_lib.get().archs, major, minor, precision)
        return IMPL_FP8PV if (pv == "fp8" and impl == IMPL_FP16PV) else impl
    return {"fp16": IMPL_FP16PV, "wgmma": IMPL_WGMMA}.get(pv, IMPL_FP8PV)


def _mode(q, pv, precision="8b", *, cc=None):
    cc = cc or _ops_cc(q)
    return pv_mode(_IMPL_PV[impl_for(q, pv, precision, cc=cc)], cc[0])


def qk_mma(q, qk=None, *, cc=None) -> int:
    """The C ABI's qk_mma for "4b": qk "int4" -> 1, "int8" -> 0; None: SAGE_PATCH_QK_MMA, else int4 below sm_90."""
    qk = qk or _FORCE_QK_MMA
    if qk is None:
        major, _ = cc or _ops_cc(q)
        qk = "int4" if major == 8 and "4b-int4" not in DISABLED else "int8"
    if qk not in ("int4", "int8"):
        raise ValueError(f"qk must be None, 'int4' or 'int8', got {qk!r}")
    return 1 if qk == "int4" else 0


def _eager_direct(*tensors) -> bool:
    """Whether calling a custom op's body directly runs exactly what torch.ops.sage_patch.* would (its CUDA kernel,
    with nothing around it), skipping ~20 us of dispatch: eager (not traced by dynamo/export), grad mode off or no
    input requiring grad (with one, the op records its autograd node, whose backward raises), plain CUDA tensors (no
    subclass such as FakeTensor or Parameter, no CPU/meta input the dispatcher would route elsewhere), no torch
    function or dispatch mode (make_fx, FakeTensorMode, torch.device(...) contexts), no functorch transform (vmap,
    grad) and no profiler (which records the op by name). Anything else takes the op. The first three tensors are
    q, k, v; a None (no mask) is skipped."""
    torch = _torch()
    if torch.compiler.is_compiling():
        return False
    for x in tensors:
        if x is not None and not (type(x) is torch.Tensor and x.is_cuda):
            return False
    q, k, v = tensors[:3]
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return False
    C = torch._C
    return not (C._len_torch_function_stack() or C._len_torch_dispatch_stack()
                or C._are_functorch_transforms_active() or torch.autograd._profiler_enabled())


def attention(q, k, v, *, layout="bhsd", is_causal=False, scale=None, attn_mask=None, pv=None, precision="8b",
              smooth_v=False, qk=None, return_lse=True):
    """Direct call of the compiled kernel (no resolver): returns (out, lse); lse is None with return_lse=False (the
    kernel then skips the LSE work).

    precision: "8b" or "4b". pv: None (the variant can_run would pick), "fp8" (best FP8 P~V mode for this GPU),
    "fp16", "fp8-mma", "fp8-f16". qk ("4b" only): None (default for this GPU), "int4" or "int8" MMA."""
    torch = _torch()
    cc = _ops_cc(q)  # once for _mode and qk_mma
    mode = _mode(q, pv, precision, cc=cc)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    op = _ops._attn_impl if _eager_direct(q, k, v, attn_mask) else torch.ops.sage_patch.attn
    out, lse = op(q, k, v, attn_mask, str(layout).lower() == "bshd", bool(is_causal), scale, mode, QK_BITS[precision],
                  bool(smooth_v), qk_mma(q, qk, cc=cc), bool(return_lse))
    return out, (lse if return_lse else None)


def can_run_varlen(precision, q, k, v, cu_seqlens_q, cu_seqlens_k, *, smooth_v=False):
    """(impl | None, reason) for a packed variable-length call: q (total_q, Hq, D), k/v (total_k, Hkv, D)."""
    why = _unserved_reason(precision, smooth_v, varlen=True)
    if why:
        return None, why
    torch = _torch()
    tensors = (q, k, v, cu_seqlens_q, cu_seqlens_k)
    if not all(x.is_cuda for x in tensors) or len({x.device for x in tensors}) != 1:
        return None, "q, k, v, cu_seqlens_q, cu_seqlens_k must be CUDA tensors on one device"
    if q.device.index is not None and q.device.index != torch.cuda.current_device():
        return None, f"varlen kernel: {q.device} is not the current CUDA device"
    for c in (cu_seqlens_q, cu_seqlens_k):
        if c.dtype != torch.int32 or c.dim() != 1 or c.stride(0) != 1:
            return None, "cu_seqlens must be contiguous 1-D int32 tensors"
    if cu_seqlens_q.shape != cu_seqlens_k.shape or cu_seqlens_q.shape[0] < 2:
        return None, "cu_seqlens_q and cu_seqlens_k must both have B+1 >= 2 entries"
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 3:
            return None, f"{name} must be 3-D (total, H, D), got {x.dim()}-D"
        why = _check_tensor(name, x.unsqueeze(0), torch)
        if why:
            return None, why
    if k.shape != v.shape or k.shape[-1] != q.shape[-1]:
        return None, f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match"
    why = _dtype_dim_gqa_reason(q, k, v, 1, torch)
    if why:
        return None, why
    if (cu_seqlens_q.shape[0] - 1) * q.shape[1] > 65535:
        return None, "B*H > 65535 (grid limit of the pre-passes)"
    if max(q.shape[0], k.shape[0]) >= 2**30:
        return None, "sequence too long"
    major, minor = _ops_cc(q)
    return _pick_impl(_lib.get().archs, major, minor, precision), "ok"


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, is_causal=False,
                     scale=None, precision="8b", smooth_v=False, pv=None, qk=None, return_lse=True):
    """Direct packed variable-length call: returns (out (total_q, Hq, D), lse (Hq, total_q) or None with
    return_lse=False). max_seqlen_* must be >= every sequence's length (longer sequences are cut there)."""
    torch = _torch()
    cc = _ops_cc(q)
    mode = _mode(q, pv, precision, cc=cc)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    direct = _eager_direct(q, k, v, cu_seqlens_q, cu_seqlens_k)
    op = _ops._attn_varlen_impl if direct else torch.ops.sage_patch.attn_varlen
    out, lse = op(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), bool(is_causal), scale,
                  mode, QK_BITS[precision], bool(smooth_v), qk_mma(q, qk, cc=cc), bool(return_lse))
    return out, (lse if return_lse else None)


def q_group_rows(head_dim: int) -> int:
    """Rows of the attention kernel's warp tile for this head dim (from the loaded library; else the default)."""
    lib = _lib.get()
    return int(lib.handle.sage_q_group_rows(int(head_dim))) if lib.handle is not None else DEFAULT_Q_GROUP_ROWS


def reference_config(impl: str = IMPL_FP8PV, head_dim: int = 128):
    """The reference SimConfig that simulates `impl` exactly (same groupings, block and P~V operands)."""
    from ..reference import Grouping, SimConfig

    if impl == IMPL_WGMMA:  # 64-row warpgroup tiles (rows g, g+8 of each warp's 16), 128-key blocks
        return SimConfig(block_k=HOPPER_BLOCK_K, q_group=Grouping(*HOPPER_Q_GROUPING_ARGS),
                         k_group=Grouping(*HOPPER_K_GROUPING_ARGS), pv="fp8", row_sum="operand",
                         stats_sample=HOPPER_STATS_SAMPLE)
    rows = q_group_rows(head_dim)
    return SimConfig(block_k=KERNEL_BLOCK_K, q_group=Grouping(rows, 8, 1), k_group=Grouping(*KERNEL_K_GROUPING_ARGS),
                     q_smooth_block=4 * rows, pv="fp16" if impl == IMPL_FP16PV else "fp8")



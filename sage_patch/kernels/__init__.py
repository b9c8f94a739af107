"""Compiled kernels (kernels_cuda/): loading, capability checks and launch.

The kernel variants and the choice between them live in ``registry`` (one frozen ``KernelVariant`` per kernel:
name, C kernel id, Q K^T and P~V modes, precisions, numerics layout for the reference, constraints, SDPA
crossover; ``trains`` for the forward + backward pairs that serve calls needing a gradient).
Contract used by sage_patch.resolve:

- ``status() -> dict``: {"loaded": bool, "reason": str, "path": str | None, "archs": list[str]}.
- ``can_run(precision, q, k, v, *, layout, is_causal, attn_mask, return_lse, smooth_v) -> (variant | None, reason)``
  and ``can_run_varlen(precision, q, k, v, cu_seqlens_q, cu_seqlens_k, *, smooth_v) -> (variant | None, reason)``:
  the ``registry.KernelVariant`` that would run, or None with the reason none can. ``attn_mask`` is None or a bool
  key-padding mask (B, Skv), True = attend (resolve normalizes masks first).
  A call of head dims (D, Dv) that are not native (D, Dv <= the largest native head dim) is served zero-padded to
  the next native one (``head_dims``): the reason is then the padding's note instead of "ok".
- ``can_run_training(q, k, v, *, layout, attn_mask) -> (variant | None, reason)``: the training variant
  (``trains``) that runs forward + backward of a call needing a gradient.
- ``sdpa_faster_reason(variant, q, k, *, layout, is_causal, training_routing)``: why SDPA should run instead (speed
  routing: SAGE_PATCH_SPEED_ROUTING for inference variants, the policy's options.training_speed_routing for
  training ones).
- ``run(variant, precision, q, k, v, *, layout, is_causal, scale, attn_mask, return_lse, smooth_v)`` and
  ``run_varlen(variant, precision, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)``: launch
  exactly that variant; ``out`` or ``(out, lse)``, lse fp32 natural log ((B, H, Sq), varlen (Hq, total_q)).

Implementations (names in reports; see docs/design/kernels.md and the registry):

- ``"cuda-mma-fp8pv"``: "8b" = INT8 QK^T (mma.sync m16n8k32) + FP8 E4M3 P~V with two-level accumulation (sm_89+);
  on sm_89 e4m3 mma.sync, on sm_90 the same e4m3 values carried in fp16 m16n8k16 (identical numerics).
- ``"cuda-mma-fp16pv"``: "8b" with FP16 P~V (SageAttention1-style) for sm_80/86.
- ``"cuda-wgmma-fp8pv"``: the sm_90a Hopper kernel ("8b" only): INT8 + FP8 wgmma, warp-specialized, 128-key blocks.
The mma.sync kernels also run "4b" (INT4 values, packed INT4 MMA on sm_80-89, INT8 MMA elsewhere) and smooth V.

Direct calls without the resolver: ``attention`` / ``attention_varlen`` (pv= / qk= pick a variant, ``variant_for``).
Environment: ``SAGE_PATCH_NO_KERNELS=1`` disables loading; ``SAGE_PATCH_KERNELS_LIB`` loads another .so;
``SAGE_PATCH_PV`` / ``SAGE_PATCH_QK_MMA`` prefer a P~V / "4b" Q K^T mode (registry).
"""
from __future__ import annotations

import math
import os

from . import _lib
from . import _ops  # registers the custom ops torch.ops.sage_patch.attn / attn_varlen
from . import head_dims, registry
from ._lib import arch_supported
from .registry import (DISABLED, HOPPER_BLOCK_K, HOPPER_K_GROUPING_ARGS,  # noqa: F401
                       HOPPER_Q_GROUPING_ARGS, HOPPER_STATS_SAMPLE, IMPL_FP8PV, IMPL_FP16PV, IMPL_WGMMA,
                       KERNEL_BLOCK_K, KERNEL_K_GROUPING_ARGS, NATIVE_HEAD_DIMS, KernelVariant, Target)

_STATUS_CACHE: dict = {}
QK_BITS = {"8b": 8, "4b": 4}
# Speed routing of inference calls (the measured crossovers are each variant's sdpa_faster_below):
# SAGE_PATCH_SPEED_ROUTING=0 (or SPEED_ROUTING = False) turns it off. Training calls have their own switch, the
# policy's options.training_speed_routing (sdpa_faster_reason's training_routing).
SPEED_ROUTING = os.environ.get("SAGE_PATCH_SPEED_ROUTING", "1") != "0"


def sdpa_faster_reason(variant, q, k, *, layout: str, is_causal: bool, key_padding: bool = False,
                       window_left: int = -1, cc: tuple[int, int] | None = None,
                       head_dim_v: int | None = None, training_routing: bool = True) -> str | None:
    """Why SDPA should run this call instead of `variant` (a registry.KernelVariant): it is faster at
    min(Sq, Skv) of q, k on this GPU (the variant's crossover for the device's architecture), or None.
    Whether speed routing is on: SPEED_ROUTING (SAGE_PATCH_SPEED_ROUTING) for an inference variant,
    `training_routing` (the policy's options.training_speed_routing) for a training one (variant.trains).
    key_padding: the call has a key-padding mask. The crossovers are measured against unmasked SDPA (cuDNN); with a
    mask SDPA runs its memory-efficient kernel, about 0.6x of cuDNN on Hopper (FlashAttention-2 class: 320-346 vs
    547-582 TOPS, D=128), so a finite crossover does not apply to it (the wgmma kernel is at 0.8-0.97x of cuDNN
    below it); a variant slower than SDPA at every length (the portable kernels on sm_90: 160-338 TOPS, slower than
    even FlashAttention-2 up to 16K) routes masked calls too. window_left >= 0 (a sliding window) counts as a mask:
    SDPA takes a window only as a dense mask, with the full work; the kernels skip the key blocks outside it.
    cc: the device's compute capability (None: q's). head_dim_v: v's head dim (None: q's). A call whose head dims
    are not native runs zero-padded (head_dims): its crossover is registry.PADDED_SPEED_ASSUMPTION's, masked or not
    (the padded kernel does more work than the mask-free comparison it was scaled from)."""
    if not (training_routing if variant.trains else SPEED_ROUTING):
        return None
    cc = cc or _ops_cc(q)
    d = q.shape[-1]
    dv = d if head_dim_v is None else head_dim_v
    below = variant.crossover(cc, d, bool(is_causal), dv)
    pad_to = None if variant.trains else head_dims.padding(d, dv)  # training variants run their own head dims
    if below is None or ((key_padding or window_left >= 0) and below != math.inf and pad_to is None):
        return None
    sdim = 1 if str(layout).lower() == "bshd" else 2
    n = min(q.shape[sdim], k.shape[sdim])  # compared, not int()-ed: a symbolic length under torch.compile stays one
    if n >= below:
        return None
    arch = registry.arch_key(cc)
    stand_in = None if pad_to is None else registry.padded_measurement(variant.sdpa_faster_below, cc, d,
                                                                         bool(is_causal), dv)
    measured = arch in registry.MEASURED_ARCHS and (pad_to is None or stand_in is not None)
    where = f"below {below} tokens" if below != math.inf else "at every measured length" if measured else \
        "at every length"
    if stand_in is not None:
        where += (f" on {arch} (measured with head dim {stand_in[0]} zero-padded to {pad_to}; this call runs "
                  f"zero-padded to {pad_to} too)")
    elif pad_to is not None and arch in registry.MEASURED_ARCHS:
        where = (f"at every length on {arch}: no padded head dim at or below this one's is measured there (the "
                 f"kernel would run zero-padded to head dim {pad_to})")
    elif pad_to is not None:
        where += (f" on {arch} (assumed: head dim {pad_to}'s crossover times the work ratio "
                  f"{registry.work_ratio(d, dv):.2f} of zero-padding to it; padded head dims are not measured)")
    else:
        where += f" on {arch}" if measured else f" (assumed on {arch}: not measured there)"
    dims = f"head dim {d}" if dv == d else f"head dims {d}/{dv}"
    keep = ("policy options.training_speed_routing: false keeps the kernel" if variant.trains else
            "SAGE_PATCH_SPEED_ROUTING=0 keeps the kernel")
    return (f"SDPA is faster than {variant.name} {where} ({dims}, "
            f"causal={bool(is_causal)}; this call {n}): running full precision ({keep})")


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
                "reason": (f"library loaded ({lib.path}, {_lib.format_targets(lib.archs)}) but no CUDA device is "
                           f"visible to torch (torch {torch.__version__}, CUDA {torch.version.cuda})"),
                "path": lib.path, "archs": list(lib.archs)}
    dev = torch.cuda.current_device()
    cached = _STATUS_CACHE.get(dev)
    if cached is not None:
        return cached
    from ._ops import device_cc

    major, minor = device_cc(dev)
    st = {"loaded": False, "reason": lib.reason, "path": lib.path, "archs": list(lib.archs)}
    image = _lib.arch_image(lib.archs, major, minor)
    if image is None:
        st["reason"] = (f"library built for {_lib.format_targets(lib.archs)} but device {dev} is sm_{major}{minor}: "
                        "rebuild with SAGE_PATCH_CUDA_ARCHS including it")
    elif (major, minor) < (8, 0):
        st["reason"] = f"device {dev} is sm_{major}{minor}: the kernels need sm_80 or newer"
    else:
        st["loaded"] = True
        v, _ = registry.select(Target((major, minor), tuple(lib.archs)))
        jit = f", {image} PTX JIT-compiled by the driver" if _lib.is_ptx(image) else ""
        st["reason"] = f"loaded for sm_{major}{minor} (impl {v.name if v else 'none'}{jit})"
    _STATUS_CACHE[dev] = st
    return st


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
    """Checks shared by the padded and the varlen kernel: dtypes, head dims, GQA ratio (hdim: the heads axis).
    Head dims up to the largest native one pass: those not native run zero-padded (head_dims)."""
    if q.dtype not in (torch.float16, torch.bfloat16) or not (q.dtype == k.dtype == v.dtype):
        return f"dtypes {q.dtype}/{k.dtype}/{v.dtype}: the kernel takes fp16 or bf16 (all the same)"
    why = registry.head_dim_reason(q.shape[-1], v.shape[-1])
    if why:
        return why
    if k.shape[hdim] == 0 or q.shape[hdim] % k.shape[hdim]:
        return f"GQA needs Hq % Hkv == 0 (Hq={q.shape[hdim]}, Hkv={k.shape[hdim]})"
    return None


def can_run(precision, q, k, v, *, layout, is_causal, attn_mask, return_lse, smooth_v, window_left=-1):
    if precision == "fp4":
        return None, ("fp4 has no compiled kernel in this version, on any GPU (SageAttention3's NVFP4 needs "
                      "Blackwell FP4 tensor cores, sm_100a/sm_120a; not written yet)")
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
    qs, ks, vs = q.shape, k.shape, v.shape
    why = _padded_tensors_reason((("q", q), ("k", k), ("v", v)), torch,
                                 "(B, S, H, D)" if str(layout).lower() == "bshd" else "(B, H, S, D)")
    if why:
        return None, why
    bshd = str(layout).lower() == "bshd"
    d = qs[-1]
    if ks[-1] != d:
        return None, f"head dims differ (q {d}, k {ks[-1]})"
    hdim = 2 if bshd else 1
    sdim = 1 if bshd else 2
    if qs[0] != ks[0] or ks[:-1] != vs[:-1]:
        return None, f"shapes q {tuple(qs)}, k {tuple(ks)}, v {tuple(vs)} do not match"
    why = _dtype_dim_gqa_reason(q, k, v, hdim, torch)
    if why:
        return None, why
    if max(qs[sdim], ks[sdim]) >= 2**30:
        return None, "sequence too long"
    if qs[0] * qs[hdim] > 65535:
        return None, f"B*H = {qs[0] * qs[hdim]} > 65535 (grid limit of the pre-passes)"
    if not isinstance(window_left, int) or window_left < -1:
        return None, f"window_left must be an int >= -1 (-1: no window), got {window_left!r}"
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool or attn_mask.dim() != 2 or attn_mask.device != dev:
            return None, "key-padding mask must be a bool (B, Skv) tensor on q's device"
        ms = attn_mask.shape
        if ms[1] != ks[sdim] or ms[0] not in (1, qs[0]):
            return None, f"key-padding mask shape {tuple(ms)} does not match (B, Skv)"
    return _padded_select(precision, q, v, smooth_v=smooth_v, lse=return_lse)


def _padded_tensors_reason(named, torch, shape: str):
    """The layout checks of q, k, v (`named`: (name, tensor) pairs; `shape` their axes, e.g. "(B, H, S, D)"). A
    tensor whose head dim is padded (head_dims) is checked for rank and size only: the kernel reads its padded copy,
    a new contiguous tensor. A head dim no native one holds is left to _dtype_dim_gqa_reason."""
    ndim = shape.count(",") + 1
    for name, x in named:
        if x.dim() != ndim:
            return f"{name} must be {ndim}-D {shape}, got {x.dim()}-D"
    n = registry.native_head_dim(named[0][1].shape[-1], named[2][1].shape[-1])
    if n is None:  # no kernel for these head dims: _dtype_dim_gqa_reason says so, before any layout detail
        return None
    for name, x in named:
        if x.shape[-1] == n:
            why = _check_tensor(name, x if ndim == 4 else x.unsqueeze(0), torch)
            if why:
                return why
        elif x.numel() // max(x.shape[-1], 1) * n >= 2**31 * 8:
            return f"{name} is too large (zero-padded to head dim {n})"
    return None


def _padded_select(precision, q, v, **kw):
    """registry.select at the call's native head dim; the reason "ok", or the padding's note where it pads."""
    d, dv = q.shape[-1], v.shape[-1]
    n = head_dims.padding(d, dv)
    variant, why = _select(precision, q, head_dim=n, **kw)
    return (variant, head_dims.note(d, dv, n)) if variant is not None and n is not None else (variant, why)


_TRITON_REASON: list = []


def triton_reason() -> str | None:
    """Why the Triton kernels (SageBwd) cannot run in this process, None when they can (read once)."""
    if not _TRITON_REASON:
        import importlib.util

        why = None
        if importlib.util.find_spec("triton") is None:
            why = "Triton is not installed (pip install triton; torch's Linux CUDA wheels depend on it)"
        _TRITON_REASON.append(why)
    return _TRITON_REASON[0]


def can_run_training(q, k, v, *, layout, attn_mask):
    """The training variant (a registry.KernelVariant that trains) that runs forward + backward of this call, or
    None and why: the checks every training kernel shares here (CUDA, layout, one head dim, GQA, 32-bit offsets),
    then registry.select over a training Target, whose variants check the device, head dim, dtype and Triton
    themselves (their own capability checks). attn_mask: None or a bool (B, Skv) key-padding mask (resolve
    normalizes masks first)."""
    torch = _torch()
    dev = q.device
    if not (q.is_cuda and k.is_cuda and v.is_cuda) or not (dev == k.device == v.device):
        return None, "q, k, v must be CUDA tensors on one device"
    if not _layout_ok(layout):
        return None, f"layout {layout!r} not supported by the SageBwd kernels (bhsd, bshd)"
    bshd = str(layout).lower() == "bshd"
    d = q.shape[-1]
    if k.shape[-1] != d or v.shape[-1] != d:
        return None, f"head dims differ (q {d}, k {k.shape[-1]}, v {v.shape[-1]}): the SageBwd kernels need one"
    hdim = 2 if bshd else 1
    if not (q.dtype == k.dtype == v.dtype):
        return None, f"dtypes {q.dtype}/{k.dtype}/{v.dtype} differ: the SageBwd kernels take one"
    if k.shape[hdim] == 0 or q.shape[hdim] % k.shape[hdim]:
        return None, f"GQA needs Hq % Hkv == 0 (Hq={q.shape[hdim]}, Hkv={k.shape[hdim]})"
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.numel() >= 2**31:
            return None, f"{name} has 2**31 or more elements (32-bit offsets in the SageBwd kernels)"
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    t = Target(_ops.device_cc(idx), tuple(_lib.get().archs), "8b", int(d), training=True, dtype=q.dtype,
               triton=triton_reason())
    return registry.select(t)


def _target(precision, q, *, varlen=False, smooth_v=False, lse=True, cc=None, head_dim=None) -> Target:
    """head_dim: the head dim the kernel runs at (None: q's, or the native one q's pads to)."""
    if head_dim is None:
        head_dim = head_dims.padding(q.shape[-1], q.shape[-1]) or q.shape[-1]
    return Target(cc or _ops_cc(q), tuple(_lib.get().archs), precision, int(head_dim), varlen, bool(smooth_v),
                  bool(lse))


def _select(precision, q, **kw):
    return registry.select(_target(precision, q, **kw))


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


def run(variant: KernelVariant, precision, q, k, v, *, layout, is_causal, scale, attn_mask, return_lse, smooth_v,
        window_left=-1):
    """Launch exactly `variant` (from can_run / resolve). window_left >= 0: key j is hidden from query i when
    j < i + Skv - Sq - window_left (FlashAttention's window_size=(window_left, 0) together with is_causal)."""
    if precision not in variant.precisions:
        raise RuntimeError(f"kernel {variant.key!r} does not run precision {precision!r}")
    out, lse = _attention(variant, q, k, v, layout=layout, is_causal=is_causal, scale=scale, attn_mask=attn_mask,
                          precision=precision, smooth_v=smooth_v, return_lse=return_lse, window_left=window_left)
    return (out, lse) if return_lse else out


def run_varlen(variant: KernelVariant, precision, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
               is_causal, scale, smooth_v=False, return_lse=False):
    """Launch exactly `variant` (from can_run_varlen / resolve) on a packed variable-length batch."""
    if precision not in variant.precisions:
        raise RuntimeError(f"kernel {variant.key!r} does not run precision {precision!r}")
    out, lse = _attention_varlen(variant, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 is_causal=is_causal, scale=scale, precision=precision, smooth_v=smooth_v,
                                 return_lse=return_lse)
    return (out, lse) if return_lse else out


def variant_for(q, pv=None, precision="8b", qk=None, *, cc=None) -> KernelVariant:
    """The variant a direct call with this `pv` / `qk` runs: pv None = what can_run would pick (SAGE_PATCH_PV /
    SAGE_PATCH_QK_MMA apply), "fp8" = the preferred FP8 variant here, "fp16" / "fp8-mma" / "fp8-f16" / "wgmma" = that
    P~V mode; qk ("4b"): None (default for this GPU), "int4" or "int8" MMA. Arch checks are the library's."""
    t = _target(precision, q, cc=cc)
    if pv is None:
        v, why = registry.select(t, qk=qk)
        if v is None:
            raise RuntimeError(f"no compiled kernel for this call: {why}")
        return v
    return registry.explicit(t, pv, qk)


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
              smooth_v=False, qk=None, return_lse=True, hop_split_max=0, window_left=-1):
    """Direct call of a compiled kernel (no resolver): returns (out, lse); lse is None with return_lse=False (the
    kernel then skips the LSE work). precision "8b" or "4b"; pv / qk pick the variant (variant_for);
    hop_split_max: the wgmma kernel's most parts per split tail tile (0: the default 4; 1: no split); window_left
    as in `run`."""
    return _attention(variant_for(q, pv, precision, qk), q, k, v, layout=layout, is_causal=is_causal, scale=scale,
                      attn_mask=attn_mask, precision=precision, smooth_v=smooth_v, return_lse=return_lse,
                      hop_split_max=hop_split_max, window_left=window_left)


def _attention(variant, q, k, v, *, layout, is_causal, scale, attn_mask, precision, smooth_v, return_lse,
               hop_split_max=0, window_left=-1):
    torch = _torch()

    def launch(q, k, v, scale):  # at the native head dim: head dims that are not native are zero-padded
        op = _ops._attn_impl if _eager_direct(q, k, v, attn_mask) else torch.ops.sage_patch.attn
        out, lse = op(q, k, v, attn_mask, str(layout).lower() == "bshd", bool(is_causal), scale, variant.kernel_id,
                      QK_BITS[precision], bool(smooth_v), bool(return_lse), int(hop_split_max), int(window_left))
        return out, (lse if return_lse else None)

    return head_dims.padded(launch, q, k, v, scale)


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
    why = _padded_tensors_reason((("q", q), ("k", k), ("v", v)), torch, "(total, H, D)")
    if why:
        return None, why
    if k.shape[:-1] != v.shape[:-1] or k.shape[-1] != q.shape[-1]:
        return None, f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match"
    why = _dtype_dim_gqa_reason(q, k, v, 1, torch)
    if why:
        return None, why
    if (cu_seqlens_q.shape[0] - 1) * q.shape[1] > 65535:
        return None, "B*H > 65535 (grid limit of the pre-passes)"
    if max(q.shape[0], k.shape[0]) >= 2**30:
        return None, "sequence too long"
    return _padded_select(precision, q, v, varlen=True, smooth_v=smooth_v)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, is_causal=False,
                     scale=None, precision="8b", smooth_v=False, pv=None, qk=None, return_lse=True):
    """Direct packed variable-length call: returns (out (total_q, Hq, D), lse (Hq, total_q) or None with
    return_lse=False). max_seqlen_* must be >= every sequence's length (longer sequences are cut there)."""
    return _attention_varlen(variant_for(q, pv, precision, qk), q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                             max_seqlen_k, is_causal=is_causal, scale=scale, precision=precision, smooth_v=smooth_v,
                             return_lse=return_lse)


def _attention_varlen(variant, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, is_causal, scale,
                      precision, smooth_v, return_lse):
    torch = _torch()

    def launch(q, k, v, scale):  # at the native head dim: head dims that are not native are zero-padded
        direct = _eager_direct(q, k, v, cu_seqlens_q, cu_seqlens_k)
        op = _ops._attn_varlen_impl if direct else torch.ops.sage_patch.attn_varlen
        out, lse = op(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), bool(is_causal),
                      scale, variant.kernel_id, QK_BITS[precision], bool(smooth_v), bool(return_lse))
        return out, (lse if return_lse else None)

    return head_dims.padded(launch, q, k, v, scale)


def reference_config(variant: KernelVariant | str = IMPL_FP8PV, head_dim: int = 128):
    """The numerics layout of `variant` (a KernelVariant, or an implementation name), as data: pass it to
    `reference.simulate(..., config=...)` to simulate that kernel exactly."""
    if isinstance(variant, str):
        variant = next((x for x in registry.VARIANTS if x.name == variant), None) or registry.get("mma-fp8")
    return variant.reference_config(head_dim)

"""ctypes binding of libsage_kernels.so (plain C ABI, see kernels_cuda/sage_kernels.h). No torch import here."""
from __future__ import annotations

import ctypes
import os
import struct
import threading

LIB_NAME = "libsage_kernels.so"
ABI_VERSION = 9
_HERE = os.path.dirname(os.path.abspath(__file__))


class SageAttnParams(ctypes.Structure):
    _fields_ = [
        ("q", ctypes.c_void_p), ("q_sb", ctypes.c_int64), ("q_sh", ctypes.c_int64), ("q_ss", ctypes.c_int64),
        ("k", ctypes.c_void_p), ("k_sb", ctypes.c_int64), ("k_sh", ctypes.c_int64), ("k_ss", ctypes.c_int64),
        ("v", ctypes.c_void_p), ("v_sb", ctypes.c_int64), ("v_sh", ctypes.c_int64), ("v_ss", ctypes.c_int64),
        ("o", ctypes.c_void_p), ("o_sb", ctypes.c_int64), ("o_sh", ctypes.c_int64), ("o_ss", ctypes.c_int64),
        ("lse", ctypes.c_void_p),
        ("kmask", ctypes.c_void_p), ("kmask_sb", ctypes.c_int64),
        ("workspace", ctypes.c_void_p),
        ("B", ctypes.c_int32), ("Hq", ctypes.c_int32), ("Hkv", ctypes.c_int32),
        ("Sq", ctypes.c_int32), ("Skv", ctypes.c_int32), ("D", ctypes.c_int32),
        ("causal", ctypes.c_int32), ("dtype", ctypes.c_int32), ("kernel", ctypes.c_int32),  # ABI 6: SAGE_KERNEL_*
        ("device", ctypes.c_int32), ("device_cc", ctypes.c_int32),
        ("sm_scale", ctypes.c_float),
        # ABI 4
        ("qk_bits", ctypes.c_int32), ("smooth_v", ctypes.c_int32),
        ("cu_seqlens_q", ctypes.c_void_p), ("cu_seqlens_k", ctypes.c_void_p),
        # ABI 6: qk_packed is the library's (derived from kernel; 0 here), hop_split_max 0 = the default (4)
        ("qk_packed", ctypes.c_int32), ("hop_split_max", ctypes.c_int32),
        ("lse_sh", ctypes.c_int64),
        # ABI 7: sliding window as a key count, 0 = none (window_left + 1)
        ("window_keys", ctypes.c_int32),
    ]


class SageBwdParams(ctypes.Structure):
    """ABI 8: the Hopper SageBwd backward's launch (sage_bwd; sage_patch.kernels.sagebwd.hopper)."""

    _fields_ = [
        ("q_int", ctypes.c_void_p), ("q_t", ctypes.c_void_p), ("do_t", ctypes.c_void_p), ("stats", ctypes.c_void_p),
        ("k_int", ctypes.c_void_p), ("k_scale", ctypes.c_void_p),
        ("v", ctypes.c_void_p), ("v_sb", ctypes.c_int64), ("v_sh", ctypes.c_int64), ("v_ss", ctypes.c_int64),
        ("dout", ctypes.c_void_p), ("do_sb", ctypes.c_int64), ("do_sh", ctypes.c_int64), ("do_ss", ctypes.c_int64),
        ("dk", ctypes.c_void_p), ("dv", ctypes.c_void_p), ("dq_acc", ctypes.c_void_p),
        ("kmask", ctypes.c_void_p), ("kmask_sb", ctypes.c_int64),
        ("t_stride", ctypes.c_int64),
        ("B", ctypes.c_int32), ("Hq", ctypes.c_int32), ("Hkv", ctypes.c_int32),
        ("Sq", ctypes.c_int32), ("Skv", ctypes.c_int32), ("D", ctypes.c_int32),
        ("causal", ctypes.c_int32), ("dtype", ctypes.c_int32), ("device", ctypes.c_int32), ("device_cc", ctypes.c_int32),
        ("sm_scale", ctypes.c_float),
        # ABI 9: the deterministic mode's tile counters (int32, zeroed), 0 = the default mode
        ("dq_sem", ctypes.c_void_p),
    ]


class SageTrainFwdParams(ctypes.Structure):
    """ABI 9: the Hopper SageBwd training forward's launch (sage_train_fwd; sage_patch.kernels.sagebwd.hopper)."""

    _fields_ = [
        ("q_int", ctypes.c_void_p), ("q_scale", ctypes.c_void_p), ("qdot", ctypes.c_void_p),
        ("k_int", ctypes.c_void_p), ("k_scale", ctypes.c_void_p),
        ("v", ctypes.c_void_p), ("v_sb", ctypes.c_int64), ("v_sh", ctypes.c_int64), ("v_ss", ctypes.c_int64),
        ("o", ctypes.c_void_p), ("o_sb", ctypes.c_int64), ("o_sh", ctypes.c_int64), ("o_ss", ctypes.c_int64),
        ("lse", ctypes.c_void_p), ("lse_s", ctypes.c_void_p),
        ("kmask", ctypes.c_void_p), ("kmask_sb", ctypes.c_int64),
        ("B", ctypes.c_int32), ("Hq", ctypes.c_int32), ("Hkv", ctypes.c_int32),
        ("Sq", ctypes.c_int32), ("Skv", ctypes.c_int32), ("D", ctypes.c_int32),
        ("causal", ctypes.c_int32), ("dtype", ctypes.c_int32), ("device", ctypes.c_int32),
        ("device_cc", ctypes.c_int32), ("sm_scale", ctypes.c_float),
    ]


# SageAttnParams field names in ABI order, and a struct.Struct writing them all in one call at the ctypes offsets
# (explicit pad bytes, built from the Structure's own layout, so the bytes are those of field-by-field assignment).
PARAM_FIELDS = tuple(name for name, _ in SageAttnParams._fields_)


def _params_struct():
    codes = {ctypes.c_void_p: "Q" if ctypes.sizeof(ctypes.c_void_p) == 8 else "I", ctypes.c_int64: "q",
             ctypes.c_int32: "i", ctypes.c_float: "f"}
    fmt, pos = "=", 0
    for name, ctype in SageAttnParams._fields_:
        f = getattr(SageAttnParams, name)
        fmt += "x" * (f.offset - pos) + codes[ctype]
        pos = f.offset + f.size
    st = struct.Struct(fmt)
    assert st.size == pos <= ctypes.sizeof(SageAttnParams)
    return st


PARAMS_STRUCT = _params_struct()


def fill_params(p: SageAttnParams, values) -> None:
    """Set every field of `p` from `values` (PARAM_FIELDS order; pointers as ints, 0 = NULL) in one
    struct.pack_into. A value struct cannot pack (None, out of int32 range, a float32 overflow, a wrong type) goes
    through ctypes field assignment instead, which converts, wraps or raises as field-by-field code always did."""
    try:
        PARAMS_STRUCT.pack_into(p, 0, *values)
    except (struct.error, OverflowError):
        set_params_fields(p, values)


def set_params_fields(p: SageAttnParams, values) -> None:
    """Field-by-field assignment through ctypes (the reference for fill_params)."""
    if len(values) != len(PARAM_FIELDS):  # zip would silently shift every later field
        raise ValueError(f"SageAttnParams takes {len(PARAM_FIELDS)} values, got {len(values)}")
    for name, x in zip(PARAM_FIELDS, values):
        setattr(p, name, x)


class Lib:
    """The loaded library, or the reason it is not loaded."""

    def __init__(self):
        self.handle = None
        self.path = None
        self.reason = "not loaded yet"
        self.archs: list[str] = []

    def load(self) -> None:
        if os.environ.get("SAGE_PATCH_NO_KERNELS", "") not in ("", "0"):
            self.reason = "disabled by SAGE_PATCH_NO_KERNELS"
            return
        path = os.environ.get("SAGE_PATCH_KERNELS_LIB") or os.path.join(_HERE, LIB_NAME)
        self.path = path
        if not os.path.isfile(path):
            self.reason = (f"{LIB_NAME} not found in {os.path.dirname(path)}: the package was installed without "
                           "the CUDA kernels (no nvcc at build time, or SAGE_PATCH_NO_KERNELS=1); reinstall with "
                           "nvcc on PATH to build them")
            return
        try:
            h = ctypes.CDLL(path)
        except OSError as e:
            self.reason = f"could not load {path}: {e}"
            return
        try:
            h.sage_abi_version.restype = ctypes.c_int
            h.sage_compiled_archs.restype = ctypes.c_char_p
            h.sage_error_string.restype = ctypes.c_char_p
            h.sage_error_string.argtypes = [ctypes.c_int]
            h.sage_attn_workspace_bytes.restype = ctypes.c_int64
            h.sage_attn_workspace_bytes.argtypes = [ctypes.POINTER(SageAttnParams)]
            h.sage_attn_fwd.restype = ctypes.c_int
            h.sage_attn_fwd.argtypes = [ctypes.POINTER(SageAttnParams), ctypes.c_void_p]
            h.sage_hopper_compiled.restype = ctypes.c_int
            h.sage_bwd.restype = ctypes.c_int
            h.sage_bwd.argtypes = [ctypes.POINTER(SageBwdParams), ctypes.c_void_p]
            h.sage_train_fwd.restype = ctypes.c_int
            h.sage_train_fwd.argtypes = [ctypes.POINTER(SageTrainFwdParams), ctypes.c_void_p]
            abi = h.sage_abi_version()
        except AttributeError as e:
            self.reason = f"{path} is not a sage_patch kernel library ({e})"
            return
        if abi != ABI_VERSION:
            self.reason = f"{path} has ABI version {abi}, this sage_patch expects {ABI_VERSION}: rebuild/reinstall"
            return
        self.archs = h.sage_compiled_archs().decode().split()
        self.handle = h
        self.reason = "loaded"


_LIB: Lib | None = None
_LOCK = threading.Lock()


def get() -> Lib:
    global _LIB
    if _LIB is None:
        with _LOCK:
            if _LIB is None:
                lib = Lib()
                lib.load()
                _LIB = lib
    return _LIB


def reset() -> None:
    """Forget the loaded state (tests)."""
    global _LIB
    _LIB = None


def target_cc(target: str) -> tuple[int, int]:
    """'90a' -> (9, 0), '120' -> (12, 0), 'compute_120' -> (12, 0): the capability a build target is for."""
    digits = target.removeprefix("compute_").rstrip("a")
    return int(digits[:-1]), int(digits[-1])


def is_ptx(target: str) -> bool:
    """'compute_XY' targets are PTX (JIT-compiled by the driver); the others SASS."""
    return target.startswith("compute_")


def arch_image(archs, major: int, minor: int) -> str | None:
    """The image of a library with these targets that runs on a device of capability major.minor, as the driver
    chooses it: SASS first (sm_XY on the same major with minor >= Y; an arch-specific sm_XYa on X.Y only), else the
    newest PTX compute_XY with X.Y <= the device (JIT-compiled at the first launch). None: nothing runs there."""
    cc = (major, minor)
    sass = [a for a in archs if not is_ptx(a) and (target_cc(a) == cc if a.endswith("a") else
                                                   target_cc(a)[0] == major and target_cc(a) <= cc)]
    if sass:
        return "sm_" + max(sass, key=lambda a: (target_cc(a), a.endswith("a")))
    ptx = [a for a in archs if is_ptx(a) and (target_cc(a) == cc if a.endswith("a") else target_cc(a) <= cc)]
    return max(ptx, key=target_cc) if ptx else None


def format_targets(archs) -> str:
    """'80 90a compute_120' -> 'sm_80, sm_90a, compute_120 (PTX)' for messages."""
    return ", ".join(f"{a} (PTX)" if is_ptx(a) else f"sm_{a}" for a in archs) or "no target"


def arch_supported(archs, major: int, minor: int) -> bool:
    """Whether a library with these targets (SASS "80", "90a"; PTX "compute_120") runs on major.minor."""
    return arch_image(archs, major, minor) is not None

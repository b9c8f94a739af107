"""The kernel variants: one frozen descriptor per kernel the package can launch, inference (the compiled library,
kernels_cuda/, C ids SAGE_KERNEL_* in sage_kernels.h) and training (forward + backward pairs: SageBwd,
sage_patch/kernels/sagebwd), and the one place that decides which of them serves a call.

Each descriptor carries everything the rest of the package needs to know about its kernel: the name reports show
(``name``), the C kernel id (``kernel_id``), the Q K^T and P~V modes, the precisions it serves, its numerics layout
(``reference_config``: a ``KernelLayout``, data the reference simulation interprets to simulate it exactly), its
capability constraints (small predicates, each returning the reason it cannot run a call or None) and the measured
SDPA crossover (``sdpa_faster_below``).
``select`` walks ``VARIANTS`` in order of preference and returns the first of the call's kind (``Target.training``:
a call that needs a gradient; ``KernelVariant.trains``) whose constraints all pass; ``sage_patch.resolve`` gets that
descriptor and ``kernels.run(variant, ...)`` (inference) or ``trainable.sagebwd_attention(kernel=variant.key)``
(training: the variant's ``launch`` module's forward and backward) launches exactly it.

Adding a kernel (a Blackwell fp4 kernel) = its source files under kernels_cuda/ with a new C id, plus one
``KernelVariant`` here; adding a training kernel = its launch module (``forward``, ``backward``, ``KERNEL_LAYOUT``,
as sage_patch/kernels/sagebwd) and its capability check, plus one ``KernelVariant(..., trains=True)`` here.

Environment (read once): ``SAGE_PATCH_PV=fp16|fp8-mma|fp8-f16|wgmma`` and ``SAGE_PATCH_QK_MMA=int4|int8`` prefer the
variants with that P~V / "4b" Q K^T mode wherever they can run (tests, e.g. the sm_80 path on newer GPUs).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Callable, Mapping, NamedTuple

from . import sagebwd
from .sagebwd import hopper as sagebwd_hopper
from ._lib import arch_supported, target_cc

# C kernel ids (kernels_cuda/sage_kernels.h, SAGE_KERNEL_*)
KERNEL_MMA_FP8, KERNEL_MMA_FP16, KERNEL_MMA_FP8F16, KERNEL_WGMMA_FP8 = 0, 1, 2, 3
KERNEL_MMA_FP8_QK4, KERNEL_MMA_FP16_QK4, KERNEL_MMA_FP8F16_QK4 = 4, 5, 6

IMPL_FP8PV = "cuda-mma-fp8pv"
IMPL_FP16PV = "cuda-mma-fp16pv"
IMPL_WGMMA = "cuda-wgmma-fp8pv"
IMPL_SAGEBWD = "triton-sagebwd"
IMPL_SAGEBWD_HOPPER = "cuda-wgmma-sagebwd"

NATIVE_HEAD_DIMS = (64, 128, 256)  # ascending
# the portable kernels' per-thread quantization groups: Q rows with equal r % 8 inside each warp tile of
# PORTABLE_Q_GROUP_ROWS rows (Grouping(32, 8, 1); PORTABLE_Q_GROUP_ROWS_WIDE = 16 at head dims above
# PORTABLE_WIDE_ABOVE: kernels_cuda/portable/traits.cuh warp_rows(), checked against the source by
# tests/test_kernels_build.py), keys with equal (c % 8) // 2 in each 64-key block
PORTABLE_Q_GROUP_ROWS = 32
PORTABLE_Q_GROUP_ROWS_WIDE = 16
PORTABLE_WIDE_ABOVE = 128
KERNEL_K_GROUPING_ARGS = (64, 8, 2)
KERNEL_BLOCK_K = 64
HOPPER_Q_GROUPING_ARGS = (16, 8, 1)
HOPPER_K_GROUPING_ARGS = (128, 8, 2)
HOPPER_BLOCK_K = 128
HOPPER_STATS_SAMPLE = 128  # tokens the Hopper path's K/V means and V base scale come from (kSample, kernels_cuda/hopper/traits.cuh)

FORCE_PV = os.environ.get("SAGE_PATCH_PV", "").lower() or None
FORCE_QK = os.environ.get("SAGE_PATCH_QK_MMA", "").lower() or None

# Features switched off in this version with the reason (a mode the GPU tests did not pass is listed here, so the
# resolver never routes to it): keys "4b", "smooth_v", "varlen"; "4b-int4" (the packed INT4 MMA); "wgmma".
DISABLED: dict[str, str] = {}


@dataclass(frozen=True)
class Target:
    """What a variant's constraints look at: the device, the build, and the call's features. training: the call
    needs a gradient (only variants that train serve it, and they look at dtype and triton too)."""
    cc: tuple[int, int]                # the tensors' device compute capability
    # targets compiled into the library: SASS "80", "90a", "120", ... and PTX "compute_120" (JIT-compiled on any
    # newer device: a device is served where _lib.arch_image finds either)
    archs: tuple[str, ...]
    precision: str = "8b"
    head_dim: int = 128
    varlen: bool = False
    smooth_v: bool = False
    lse: bool = True
    training: bool = False
    dtype: object = None               # the inputs' torch dtype (training variants check it; can_run checks it for
                                       # the inference kernels)
    triton: str | None = None          # why Triton cannot be used here, None when it can (training variants)


Constraint = Callable[[Target], "str | None"]  # the reason the variant cannot run the target, or None


def _needs_cc(lo: tuple[int, int], what: str) -> Constraint:
    def check(t: Target):
        return None if t.cc >= lo else f"{what} needs sm_{lo[0]}{lo[1]}+ (device is sm_{t.cc[0]}{t.cc[1]})"
    return check


def _needs_fp8_build(t: Target):
    fp8 = [a for a in t.archs if target_cc(a) >= (8, 9)]  # SASS or PTX compiled with the e4m3 instructions
    return None if arch_supported(fp8, *t.cc) else f"the build has no FP8 target for sm_{t.cc[0]}{t.cc[1]}"


def _needs_hopper(t: Target):
    if t.cc != (9, 0):
        return f"the wgmma kernel runs on sm_90 only (device is sm_{t.cc[0]}{t.cc[1]})"
    if "90a" not in t.archs:  # wgmma is arch-specific: a portable PTX (compute_90) cannot carry it
        return "the build has no sm_90a SASS (the wgmma kernel cannot be JIT-compiled from portable PTX)"
    return DISABLED.get("wgmma")


def _needs_int4_mma(t: Target):
    return DISABLED.get("4b-int4")


def portable_q_group_rows(head_dim: int) -> int:
    """The portable attention kernel's rows per warp (its Q scale group tile) at native head dim `head_dim`."""
    return PORTABLE_Q_GROUP_ROWS_WIDE if head_dim > PORTABLE_WIDE_ABOVE else PORTABLE_Q_GROUP_ROWS


# Devices whose shared memory per block (opt-in) is 227 KB (sm_90, sm_100) or 163 KB (sm_80, sm_87); every other
# one (sm_86, sm_89, sm_120) has 99 KB
_LARGE_SMEM_CCS = ((8, 0), (8, 7), (9, 0), (10, 0), (10, 3))


def _fp16_pv_smem(t: Target):
    # the fp16-carried P~V modes double-buffer V^T in fp16: at head dim 256 the attention CTA takes 123 KB of shared
    # memory (AttnSmem in kernels_cuda/portable/attn_body.cuh); the FP8 mode's 91 KB fits everywhere, and so does
    # the packed INT4 Q/K (*-qk4) variants' 99 KB (half-width K and Q rows)
    if t.head_dim > PORTABLE_WIDE_ABOVE and t.cc not in _LARGE_SMEM_CCS:
        return (f"head_dim {t.head_dim} with fp16 P~V needs 123 KB of shared memory per block (sm_"
                f"{t.cc[0]}{t.cc[1]} has 99 KB)")
    return None


def head_dim_reason(d: int, dv: int | None = None) -> str | None:
    """Why no compiled kernel serves q/k head dim d and v head dim dv (None: one does, natively or zero-padded to
    the next native head dim, kernels.head_dims); one rule for can_run, the registry and the resolver's early
    decision."""
    if native_head_dim(d, dv) is not None:
        return None
    return (f"head_dim {max(d, d if dv is None else dv)}: the kernel has head dims {NATIVE_HEAD_DIMS} only (smaller "
            "head dims run zero-padded to the next of them)")


def _head_dim(t: Target):
    return None if t.head_dim in NATIVE_HEAD_DIMS else (
        f"head_dim {t.head_dim}: the kernel has head dims {NATIVE_HEAD_DIMS} only")


def native_head_dim(d: int, dv: int | None = None) -> int | None:
    """The head dim the kernels run a call of q/k head dim `d` and v head dim `dv` (None: d) at: the smallest of
    NATIVE_HEAD_DIMS >= max(d, dv) (the call's Q, K and V zero-padded to it: kernels.head_dims), or None where every
    native head dim is smaller. Adding a head dim to NATIVE_HEAD_DIMS is all it takes for the dims below it to pad."""
    need = max(d, d if dv is None else dv)
    for n in NATIVE_HEAD_DIMS:  # ascending; a plain loop: torch.compile traces it (min() over a generator it cannot)
        if n >= need:
            return n
    return None


def work_ratio(d: int, dv: int | None = None) -> float:
    """The work of a call run at its native head dim n over that at its own head dims: Q K^T and P~V each scale
    with their head dim, so (n + n) / (d + dv); 1 for a native call."""
    dv = d if dv is None else dv
    n = native_head_dim(d, dv)
    return 1.0 if n is None else 2.0 * n / (d + dv)


# preferences: where another variant is the better default. Tagged by the mode they are about ("pv" or "qk"): a
# forced P~V (or "4b" Q K^T) mode ignores the preferences of that mode.
def _not_sm90(t: Target):
    return "sm_90 carries the e4m3 values in fp16 MMAs (fp8-f16)" if t.cc[0] == 9 else None


def _sm90(t: Target):
    return None if t.cc[0] == 9 else "e4m3 MMAs are native below sm_90"


def _int4_native(t: Target):
    return None if t.cc[0] == 8 else "no INT4 tensor cores from sm_90 on"


PREFER_NOT_SM90 = ("pv", _not_sm90)
PREFER_SM90 = ("pv", _sm90)
PREFER_INT4_NATIVE = ("qk", _int4_native)


@dataclass(frozen=True)
class KernelVariant:
    key: str                          # unique registry key (reports show it beside the name: Decision.variant)
    name: str                         # implementation name in decisions and reports
    kernel_id: int | None             # SageAttnParams.kernel (None: a training variant, launched by `launch`)
    family: str                       # "mma" (portable mma.sync, kernels_cuda/portable), "wgmma" (kernels_cuda/hopper)
                                      # or "triton" (training: sage_patch/kernels/sagebwd)
    qk: str                           # Q K^T: "int8" (INT8 values; "4b": INT4 values carried in INT8 MMA) or "int4"
    pv: str                           # P~V: "fp8-mma", "fp8-f16", "fp16" or "wgmma"; "input" (training: the input
                                      # dtype)
    precisions: tuple[str, ...]       # the precisions it serves ("8b", "4b")
    constraints: tuple[Constraint, ...] = ()   # hard: it cannot run where one fails
    preferences: tuple[tuple[str, Constraint], ...] = ()  # soft, per mode ("pv"/"qk"): not the default where one fails
    # the shortest sequence (min of Sq, Skv) at which the whole call beats torch SDPA (cuDNN), per GPU architecture
    # (arch_key; ANY_ARCH: every other one) and (head dim, causal); shorter calls without a key-padding mask run SDPA
    # instead. Measured on MEASURED_ARCHS (docs/benchmarks.md), assumed elsewhere (SPEED_ASSUMPTION)
    sdpa_faster_below: Mapping[str, Mapping[tuple[int, bool], float]] = field(default_factory=dict)
    # a training variant: a forward + backward pair that serves calls needing a gradient (Target.training), launched
    # by the module `launch` names (its forward, backward and KERNEL_LAYOUT, the numerics as
    # reference.sagebwd.SageBwdConfig fields: sage_patch.trainable); its crossover is of forward + backward
    trains: bool = False
    launch: str | None = None

    def crossover(self, cc: tuple[int, int], head_dim: int, causal: bool,
                  head_dim_v: int | None = None) -> float | None:
        """sdpa_faster_below on a device of capability `cc` (None: no crossover, the kernel runs at every length);
        a call padded to a native head dim (head_dim, head_dim_v not native) gets PADDED_SPEED_ASSUMPTION's.
        A training variant runs its own head dims only (no padding): its table's entry as it stands."""
        if self.trains:
            per_arch = _per_arch(self.sdpa_faster_below, cc)
            return None if per_arch is None else per_arch.get((head_dim, bool(causal)))
        return _crossover(self.sdpa_faster_below, cc, head_dim, causal, head_dim_v)

    def why_not(self, t: Target, *, ignore: tuple[str, ...] = ()) -> str | None:
        """The reason this variant does not serve `t` (None: it does); preferences of the modes in `ignore` skipped,
        ignore=("pv", "qk"): hard constraints only."""
        if t.training != self.trains:
            return (f"{self.name} ({self.key}) " + ("trains (forward + backward)" if self.trains else
                                                    "has no backward pass"))
        if t.precision not in self.precisions:
            return f"{self.name} ({self.key}) does not run precision {t.precision!r}"
        for c in self.constraints:
            why = c(t)
            if why:
                return why
        for mode, c in self.preferences:
            why = None if mode in ignore else c(t)
            if why:
                return why
        return None

    def reference_config(self, head_dim: int = 128) -> "KernelLayout":
        """This kernel's numerics layout (groupings, block, P~V operands), as data that the reference simulation
        takes as its config (`simulate(..., config=layout)`: reference.SimConfig.of) to simulate it exactly."""
        if self.trains:
            raise ValueError(f"{self.key} is a training variant: its numerics are its launch module's KERNEL_LAYOUT "
                             "(sage_patch.trainable.kernel_config)")
        if self.family == "wgmma":  # 64-row warpgroup tiles (rows g, g+8 of each warp's 16), 128-key blocks
            return KernelLayout(block_k=HOPPER_BLOCK_K, q_group=Groups(*HOPPER_Q_GROUPING_ARGS),
                                k_group=Groups(*HOPPER_K_GROUPING_ARGS), pv="fp8", row_sum="operand",
                                stats_sample=HOPPER_STATS_SAMPLE)
        rows = portable_q_group_rows(head_dim)
        return KernelLayout(block_k=KERNEL_BLOCK_K, q_group=Groups(rows, 8, 1), k_group=Groups(*KERNEL_K_GROUPING_ARGS),
                            q_smooth_block=4 * rows, pv="fp16" if self.pv == "fp16" else "fp8")


class Groups(NamedTuple):
    """A quantization grouping as data (reference.Grouping interprets it): token t is in group
    (t // tile) * (mod // div) + ((t % tile) % mod) // div."""
    tile: int
    mod: int = 1
    div: int = 1


@dataclass(frozen=True)
class KernelLayout:
    """What the reference simulation must follow to compute exactly what a kernel computes; the fields are those of
    reference.SimConfig with the same meaning (the hardware layer describes, the reference layer interprets)."""
    block_k: int
    q_group: Groups
    k_group: Groups
    pv: str
    q_smooth_block: int = 128
    row_sum: str = "p"
    stats_sample: int = 0


# ---- speed routing: where SDPA is faster than a kernel ---------------------------------------------------------
ANY_ARCH = "*"               # a crossover table's entry for every architecture it does not name
MEASURED_ARCHS = ("sm_90",)  # the only architecture we can measure (an H200); every other entry is an assumption


def every_length(head_dims) -> dict:
    """A per-arch crossover table saying SDPA is faster at any length, for each of `head_dims`, causal or not."""
    return {(d, c): math.inf for d in head_dims for c in (False, True)}


EVERY_LENGTH = every_length(NATIVE_HEAD_DIMS)
# What the tables assume where nothing was measured (`sage-patch info` shows it):
SPEED_ASSUMPTION = (
    "sm_80/86/89/120 (not measured): the mma.sync kernels are assumed faster than SDPA at every length (they are "
    "SageAttention2's design, published at 2-3x FlashAttention2 on Ampere, Ada and consumer Blackwell, where "
    "mma.sync is the native tensor-core path); sm_100 (not measured): assumed slower at every length, as on sm_90 "
    "(datacenter Blackwell's tensor cores, like Hopper's wgmma, are not reached through mma.sync; cuDNN uses them)")
# A call whose head dims are not native runs zero-padded to the next native head dim n (kernels.head_dims): it does
# the work of n, SDPA that of its own head dims. Where a table names measured padded head dims, a padded call takes
# `padded_measurement`'s; elsewhere its crossover is the native dim's scaled by the work ratio (`_crossover`):
PADDED_UNMEASURED_MAX_RATIO = 2.0  # where n has no crossover (faster at every length): at most this much more work
PADDED_SPEED_ASSUMPTION = (
    "padded head dims: on sm_90 measured for 80, 96, 112 (padded to 128) and 160, 192 (padded to 256); a call of "
    "head dims D, Dv takes the crossover of the largest measured head dim <= (D + Dv) / 2 padded to the same native "
    "dim, and runs SDPA at every length where none is (SAGE_PATCH_SPEED_ROUTING=0 runs the kernel); elsewhere a "
    "call of head dims D, Dv that the kernels run zero-padded to their next "
    "native head dim n does the work of n; its crossover is assumed to be n's times the work ratio 2n / (D + Dv), "
    "key-padding masks and sliding windows included (SDPA at the real head dim is the safe choice until measured); "
    "where n's table has no crossover (the kernel assumed faster at every length: 2-3x FlashAttention2), a work "
    f"ratio above {PADDED_UNMEASURED_MAX_RATIO:g} is assumed slower at every length")


def arch_key(cc: tuple[int, int]) -> str:
    """A device's key in the crossover tables: "sm_80", "sm_86", "sm_89", "sm_90"; every 10.x is "sm_100", every
    12.x "sm_120" (one family each)."""
    major, minor = cc
    return f"sm_{major}{minor}" if major < 10 else f"sm_{major}0"


def _per_arch(table, cc):
    """A crossover table's entries for a device of capability `cc` (its arch's, else ANY_ARCH's, else None)."""
    return table.get(arch_key(cc), table.get(ANY_ARCH))


def padded_measurement(table, cc, head_dim, causal, head_dim_v=None):
    """(m, crossover) of the measured padded head dim that stands for a padded call in `table` on `cc`, or None.
    A table may name padded head dims (measured zero-padded to their native dim n); a call of head dims D, Dv padded
    to n takes the entry of the largest measured m <= (D + Dv) / 2 padded to the same n: its work ratio is m's or
    more (the kernel does n's work, SDPA that of (D + Dv) / 2), so its crossover is m's or later, never earlier
    (the measured ones: 80, 96 and 112 have the same crossovers, and 160 and 192)."""
    per_arch = _per_arch(table, cc)
    n = native_head_dim(head_dim, head_dim_v)
    if per_arch is None or n is None or (n == head_dim and head_dim_v in (None, head_dim)):  # native: no stand-in
        return None
    work = (head_dim + (head_dim if head_dim_v is None else head_dim_v)) / 2
    best = None
    for (m, c), below in per_arch.items():
        if c == bool(causal) and m not in NATIVE_HEAD_DIMS and native_head_dim(m) == n and m <= work:
            if best is None or m > best[0]:
                best = (m, below)
    return best


def _crossover(table, cc, head_dim, causal, head_dim_v=None):
    per_arch = _per_arch(table, cc)
    n = native_head_dim(head_dim, head_dim_v)
    if n is None or (n == head_dim and head_dim_v in (None, head_dim)):  # native (or no kernel at all)
        return None if per_arch is None else per_arch.get((head_dim, bool(causal)))
    measured = padded_measurement(table, cc, head_dim, causal, head_dim_v)
    if measured is not None:
        return measured[1]
    if arch_key(cc) in MEASURED_ARCHS:  # no padded head dim measured for this one: SDPA, the measured safe choice
        return math.inf
    below = None if per_arch is None else per_arch.get((n, bool(causal)))  # padded: PADDED_SPEED_ASSUMPTION
    ratio = work_ratio(head_dim, head_dim_v)
    if below is None:
        return math.inf if ratio > PADDED_UNMEASURED_MAX_RATIO else None
    return below if below == math.inf else math.ceil(below * ratio)


# The portable mma.sync kernels on sm_90 (any P~V mode, "8b" or "4b"): slower than SDPA cuDNN at every measured
# length, D 64 and 128, causal or not: kernels 0/1 (mma-fp8, mma-fp16) 0.25-0.61x of cuDNN at N=1K-32K
# (docs/benchmarks.md "Portable kernel vs public SageAttention2"), kernel 2 (mma-fp8f16, "4b" on INT8 MMA) 269 vs
# 587 TOPS at B4 H32 N8K D128 (docs/benchmarks.md, 2026-11-28); the packed INT4 MMA kernels (*-qk4) run on sm_90
# only when forced (SAGE_PATCH_QK_MMA=int4), where INT4 mma.sync is emulated at 44 TOPS (INT8: ~1280): slower
# still. Datacenter Blackwell (sm_100) is assumed the same (SPEED_ASSUMPTION); other archs have no entry: the
# kernel runs at every length.
_PORTABLE_CROSSOVER = {"sm_90": EVERY_LENGTH, "sm_100": EVERY_LENGTH}

_COMMON = (_head_dim,)
_SAGEBWD_SLOWER = every_length(sagebwd.HEAD_DIMS)
_FP8 = (_needs_cc((8, 9), "FP8 P~V"), _needs_fp8_build)
_INT4 = (_needs_int4_mma,)

# In order of preference: select() returns the first that serves the call.
VARIANTS: tuple[KernelVariant, ...] = (
    # sm_90a Hopper kernel ("8b"): INT8 + FP8 wgmma, warp-specialized, 128-key blocks (kernels_cuda/hopper). Speed
    # routing measured on the H200 (B=4 H=32 fp16: D=128 non-causal 0.97x at 1.75K, 1.15x at 2K; causal 0.98x at 2K,
    # 1.06x at 2.5K; D=64 non-causal 0.98x at 1.75K, 1.02x at 2K; D=256, B=4 H=16/18: non-causal 0.79x at 1K,
    # 1.09-1.13x at 2K. Causal, with the L2-section tile order (2026-11-29): D=128 0.92x at 1.5K, 1.03x at 2K, 1.13x
    # at 2.5K; D=64 0.93x at 2.5K, 1.06x at 3K; D=256 0.90-0.98x at 2K, 1.09-1.11x at 2.5K). Padded
    # head dims, B=4 H=32, the kernel zero-padded against SDPA at the real head dim (padded_measurement), re-measured
    # with the L2-section tile order (2026-11-29, two passes): 80, 96, 112 (to 128) 1.01-1.03x at 5K, 1.09-1.11x at
    # 6K; causal 0.98-1.04x at 8K (a tie), 1.05-1.10x at 9K; 160, 192 (to 256) 1.02x at 10K, 1.06-1.07x at 12K;
    # causal 0.98-1.01x at 16K, 1.01-1.04x at 18K, 1.04-1.05x at 20K.
    KernelVariant("wgmma-fp8", IMPL_WGMMA, KERNEL_WGMMA_FP8, "wgmma", "int8", "wgmma", ("8b",),
                  _COMMON + (_needs_hopper,),
                  sdpa_faster_below={"sm_90": {(128, False): 2048, (128, True): 2560, (64, False): 2048,
                                               (64, True): 3072, (256, False): 2048, (256, True): 2560,
                                               **{(d, False): 6144 for d in (80, 96, 112)},
                                               **{(d, True): 9216 for d in (80, 96, 112)},
                                               **{(d, False): 12288 for d in (160, 192)},
                                               **{(d, True): 20480 for d in (160, 192)}}}),
    # portable mma.sync kernels (kernels_cuda/portable): "4b" on packed INT4 MMA where it is native (sm_80-89) ...
    KernelVariant("mma-fp8-qk4", IMPL_FP8PV, KERNEL_MMA_FP8_QK4, "mma", "int4", "fp8-mma", ("4b",),
                  _COMMON + _FP8 + _INT4, (PREFER_NOT_SM90, PREFER_INT4_NATIVE), _PORTABLE_CROSSOVER),
    KernelVariant("mma-fp8f16-qk4", IMPL_FP8PV, KERNEL_MMA_FP8F16_QK4, "mma", "int4", "fp8-f16", ("4b",),
                  _COMMON + _FP8 + _INT4, (PREFER_SM90, PREFER_INT4_NATIVE), _PORTABLE_CROSSOVER),
    KernelVariant("mma-fp16-qk4", IMPL_FP16PV, KERNEL_MMA_FP16_QK4, "mma", "int4", "fp16", ("4b",),
                  _COMMON + _INT4, (PREFER_INT4_NATIVE,), _PORTABLE_CROSSOVER),
    # ... and "8b", or "4b" as INT4 values in INT8 MMA (any arch): FP8 P~V with e4m3 mma.sync (sm_89) ...
    KernelVariant("mma-fp8", IMPL_FP8PV, KERNEL_MMA_FP8, "mma", "int8", "fp8-mma", ("8b", "4b"),
                  _COMMON + _FP8, (PREFER_NOT_SM90,), _PORTABLE_CROSSOVER),
    # ... the same e4m3 values carried in fp16 MMAs (sm_90: identical numerics, fewer instructions) ...
    KernelVariant("mma-fp8f16", IMPL_FP8PV, KERNEL_MMA_FP8F16, "mma", "int8", "fp8-f16", ("8b", "4b"),
                  _COMMON + _FP8 + (_fp16_pv_smem,), (PREFER_SM90,), _PORTABLE_CROSSOVER),
    # ... and FP16 P~V (SageAttention1-style) for sm_80/86
    KernelVariant("mma-fp16", IMPL_FP16PV, KERNEL_MMA_FP16, "mma", "int8", "fp16", ("8b", "4b"),
                  _COMMON + (_needs_cc((8, 0), "the kernels"), _fp16_pv_smem), (), _PORTABLE_CROSSOVER),
    # Training (forward + backward, trains=True; select() offers them to calls needing a gradient only).
    # SageBwd with its backward (dQ, dK, dV in one pass) from the sm_90a wgmma kernel (kernels_cuda/hopper/
    # bwd_kernel.cuh), the forward and numerics the Triton pair's; where it beats the Triton backward (sm_90, D=64 and
    # 128: 1.13-1.26x; its capability check is sagebwd.hopper.unsupported_reason). Forward + backward it still loses
    # to cuDNN at every measured length (0.59-0.73x), so by default SDPA trains there too.
    KernelVariant("sagebwd-hopper", IMPL_SAGEBWD_HOPPER, None, "wgmma", "int8", "input", ("8b",),
                  (sagebwd_hopper.unsupported_reason,),
                  sdpa_faster_below={"sm_90": every_length(sagebwd_hopper.FASTER_HEAD_DIMS)},
                  trains=True, launch="sage_patch.kernels.sagebwd.hopper"),
    # SageBwd in Triton (sm_80+: Triton emits wgmma on sm_90, mma.sync below): INT8 Q K^T, P~ V, P^T dO, dS^T Q,
    # dS K; dO V^T in the input dtype. Its capability check is its package's (sagebwd.unsupported_reason: sm_80+,
    # Triton, sagebwd.HEAD_DIMS, sagebwd.DTYPES).
    # Slower than cuDNN forward + backward at every measured length on sm_90, D 64 and 128, causal or not
    # (0.13-0.59x, docs/benchmarks.md "Training"), so every length trains with SDPA by default; assumed the same on
    # every other architecture (not measured).
    KernelVariant("sagebwd-triton", IMPL_SAGEBWD, None, "triton", "int8", "input", ("8b",),
                  (sagebwd.unsupported_reason,),
                  sdpa_faster_below={"sm_90": _SAGEBWD_SLOWER, ANY_ARCH: _SAGEBWD_SLOWER},
                  trains=True, launch="sage_patch.kernels.sagebwd"),
)

BY_KEY: dict[str, KernelVariant] = {v.key: v for v in VARIANTS}
_IDS = [v.kernel_id for v in VARIANTS if v.kernel_id is not None]
assert len(BY_KEY) == len(VARIANTS) and len(set(_IDS)) == len(_IDS)
assert all(v.launch for v in VARIANTS if v.trains)
PV_MODES = ("fp8-mma", "fp8-f16", "fp16", "wgmma")
QK_MODES = ("int4", "int8")


def get(key: str) -> KernelVariant:
    return BY_KEY[key]


def select(t: Target, *, pv: str | None = None, qk: str | None = None) -> tuple[KernelVariant | None, str]:
    """The variant that serves `t` and "ok", or None and the reason none does: the first of VARIANTS that can run it
    and is preferred here. pv / qk ("4b" only): a forced P~V / Q K^T mode (None: SAGE_PATCH_PV / SAGE_PATCH_QK_MMA)
    wins wherever a variant with it can run; where none can, the defaults apply. A training target
    (t.training) is served by the variants that train only, in their order (the forced modes are the inference
    kernels')."""
    family = tuple(v for v in VARIANTS if v.trains == t.training)
    if t.training:
        if pv is not None or qk is not None:
            raise ValueError(f"pv / qk pick inference kernels; a training target takes neither (got pv={pv!r}, "
                             f"qk={qk!r})")
        whys = {}
        for v in family:
            why = v.why_not(t)
            if why is None:
                return v, "ok"
            whys[v.key] = why
        if len(set(whys.values())) == 1:  # one reason for all (Triton missing): said once
            return None, next(iter(whys.values()))
        return None, "; ".join(f"{k}: {why}" for k, why in whys.items()) or "no trainable kernel"  # each its own
    pv = pv or FORCE_PV
    qk = (qk or FORCE_QK) if t.precision == "4b" else None
    if pv is not None and pv not in PV_MODES:
        raise ValueError(f"pv must be None or one of {PV_MODES}, got {pv!r}")
    if qk is not None and qk not in QK_MODES:
        raise ValueError(f"qk must be None, 'int4' or 'int8', got {qk!r}")
    tries = []
    if pv or qk:
        ignore = tuple(m for m, f in (("pv", pv), ("qk", qk)) if f)
        tries.append(([v for v in family if (pv is None or v.pv == pv) and (qk is None or v.qk == qk)], ignore))
    tries.append((family, ()))
    tries.append((family, ("pv", "qk")))  # nothing preferred (a disabled mode): anything that can run
    first = None
    for cands, ignore in tries:
        for v in cands:
            why = v.why_not(t, ignore=ignore)
            if why is None:
                return v, "ok"
            first = first or why
    return None, first or f"no compiled kernel for precision {t.precision!r}"


def explicit(t: Target, pv: str, qk: str | None = None) -> KernelVariant:
    """Direct calls (kernels.attention(pv=...)): the variant with P~V mode `pv` ("fp8": the preferred FP8 one) and,
    for "4b", Q K^T mode `qk` (None: SAGE_PATCH_QK_MMA, else INT4 MMA on sm_80-89). Arch checks are the library's."""
    inference = [v for v in VARIANTS if not v.trains]
    if pv == "fp8":
        fp8 = [v for v in inference if v.pv != "fp16"]
        for ignore in ((), ("pv", "qk")):
            for v in fp8:
                if v.why_not(t, ignore=ignore) is None and (qk is None or v.qk == qk or t.precision != "4b"):
                    return v
        pv = "fp8-f16" if t.cc[0] == 9 else "fp8-mma"  # none can run here: the library says why
    if pv not in PV_MODES:
        raise ValueError(f"pv must be None, 'fp8' or one of {PV_MODES}, got {pv!r}")
    if t.precision == "4b":
        qk = qk or FORCE_QK or ("int4" if t.cc[0] == 8 and "4b-int4" not in DISABLED else "int8")
    else:
        qk = "int8"
    for v in inference:
        if v.pv == pv and v.qk == qk and t.precision in v.precisions:
            return v
    raise RuntimeError(f"no compiled kernel with pv={pv!r}, qk={qk!r} for precision {t.precision!r}")

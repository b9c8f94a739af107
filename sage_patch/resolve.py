"""One function decides, for each call, the precision and implementation that actually run, and why."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, get_args

import torch

from . import kernels
from .precisions import SAFER


# The reference simulation on a GPU without a usable kernel: only when asked for (read once, constant to tracing).
SIMULATE_ON_GPU = os.environ.get("SAGE_PATCH_SIMULATE_ON_GPU", "") not in ("", "0")


# What runs a decided call, the one thing its consumers dispatch on (api.run_attention, varlen, the CLI):
#   "sdpa"               full precision: torch SDPA (or the adapter's own full-precision function)
#   "reference"          the PyTorch reference simulation of the precision's numerics (CPU; GPU only when asked)
#   "kernel"             the inference kernel `variant` (kernels.run)
#   "training-kernel"    the training variant `variant` (forward + backward, through autograd: trainable)
#   "training-reference" the reference simulation of the trainable 8b (SageBwd) through autograd
Path = Literal["sdpa", "reference", "kernel", "training-kernel", "training-reference"]
PATHS: tuple[str, ...] = get_args(Path)


@dataclass(frozen=True)
class Decision:
    requested: str        # what the caller or policy asked for
    precision: str        # what runs
    impl: str             # the implementation's name in reports: "sdpa", "reference", "reference-sagebwd" or a
                          # kernel variant's name (consumers dispatch on `path`, never on this string)
    reason: str | None    # why precision/impl differ from the request's fast path; None when as asked
    variant: "kernels.KernelVariant | None" = None  # the kernel variant that runs (kernels.registry), else None
    path: Path = field(kw_only=True)  # what runs it (PATHS): required, so no decision is dispatched by default

    def __post_init__(self):
        if self.path not in PATHS:
            raise ValueError(f"Decision.path must be one of {PATHS}, got {self.path!r}")
        kernel_path = self.path in ("kernel", "training-kernel")
        if kernel_path != (self.variant is not None) or (
                kernel_path and self.variant.trains != (self.path == "training-kernel")):
            raise ValueError(f"Decision.path {self.path!r} does not match variant "
                             f"{getattr(self.variant, 'key', None)!r} (a kernel path names the variant it runs, of "
                             "its kind; the others none)")

    @property
    def is_fallback(self) -> bool:
        return self.reason is not None


# Kernel availability is fixed for the process: constants to torch.compile (no tracing into the loader).
def _kernels_loaded() -> bool:
    return bool(kernels._status()["loaded"])  # no copy: this runs at every eager call


def _kernels_reason() -> str:
    return str(kernels.status()["reason"])


# What torch.compiler.assume_constant_result sets, set without it: the decorator imports torch._dynamo, about 4 s
# that the first attention call of a process paid (H200, torch 2.11) though eager calls never need Dynamo.
_kernels_loaded._dynamo_marked_constant = True
_kernels_reason._dynamo_marked_constant = True


def _next_precision(requested: str, precision: str) -> str:
    """The precision tried after `precision` found no kernel: the next safer one, except that "fp4" (no kernel on any
    GPU yet) first tries "4b", kept only where its kernel is faster than "8b" (see resolve)."""
    return "4b" if requested == precision == "fp4" else SAFER[precision]


def _full(requested: str, reason: str | None) -> Decision:
    return Decision(requested, "full", "sdpa", reason, path="sdpa")


def _policy_fallback(policy, q, k, layout: str, varlen) -> str | None:
    """The policy's fallback rules (sequence length, head dim, dtype) for this call: why it runs full, or None."""
    if policy is None:
        return None
    if varlen is not None:
        sq, skv = varlen.max_seqlen_q, varlen.max_seqlen_k
    else:
        sq = q.shape[-2] if layout == "bhsd" else q.shape[1]
        skv = k.shape[-2] if layout == "bhsd" else k.shape[1]
    return policy.fallback_reason(sq, skv, q.shape[-1], q.dtype)


# The one precision with a backward pass: SageBwd (sage_patch.trainable over a training variant's kernels on a GPU,
# the reference simulation sage_patch.reference.sagebwd on CPU, reported as TRAINABLE_IMPL).
TRAINABLE = "8b"
TRAINABLE_IMPL = "reference-sagebwd"


def _resolve_training(requested: str, q, k, v, *, layout, is_causal, mask, dropout_p, return_lse, smooth_v, policy,
                      varlen, window_left=-1) -> Decision:
    """A call that needs a gradient. The policy's `training` key decides the precision ("8b" or "full"); without
    it, the layer's: full stays full, every quantized precision trains as the trainable 8b (4b and fp4 have no
    backward pass). The trainable 8b runs a training variant's kernels on a GPU where they serve the call and are
    faster than SDPA (the variant's measured crossover; the policy's options.training_speed_routing: false keeps
    the kernel at every length), the reference simulation on CPU (on a GPU only with
    SAGE_PATCH_SIMULATE_ON_GPU=1)."""
    training = getattr(policy, "training", None)
    wanted = training or ("full" if requested == "full" else TRAINABLE)
    if wanted == "full":
        return _full(requested, None if requested == "full" else
                     f"policy training: full: calls that need a gradient run full precision (layer: {requested})")
    if dropout_p > 0:
        return _full(requested, f"dropout_p={dropout_p} > 0: the trainable 8b (SageBwd) has no dropout")
    if return_lse:
        return _full(requested, "return_lse=True (or attention sinks, applied from the LSE) with autograd: the "
                                "trainable 8b (SageBwd) differentiates the output only")
    if mask.kind == "float":
        return _full(requested, "float additive attn_mask: the trainable 8b (SageBwd) takes bool masks only")
    if window_left >= 0:
        return _full(requested, "sliding window: the trainable 8b (SageBwd) has no window")
    why = _policy_fallback(policy, q, k, layout, varlen)
    if why:
        return _full(requested, why)
    if requested == TRAINABLE:
        why_8b = None
    elif training is not None:
        why_8b = f"policy training: 8b: calls that need a gradient run the trainable 8b (layer: {requested})"
    else:
        why_8b = f"{requested} has no backward pass: calls that need a gradient run the trainable 8b (SageBwd)"
    v_note = "options.smooth_v is not applied by the trainable 8b" if smooth_v else None
    if q.is_cuda and not SIMULATE_ON_GPU:
        if varlen is not None:  # varlen_attention then runs each sequence, which resolves here again
            return _full(requested, "a packed (varlen) call that needs a gradient runs sequence by sequence")
        if mask.kind == "dense":
            return _full(requested, "dense (per-query) attn_mask: the SageBwd kernels take key-padding masks only")
        variant, why = kernels.can_run_training(q, k, v, layout=layout,
                                                attn_mask=mask.mask if mask.kind == "key_padding" else None)
        if variant is None:
            return _full(requested, f"the trainable 8b (SageBwd) kernels cannot run this call: {why}")
        # unlike the forward-only kernels, key-padding calls are routed too: the crossover is measured without a
        # mask, and the kernels are slower than cuDNN at every length there. The switch is the policy's, not
        # SAGE_PATCH_SPEED_ROUTING (inference's): a training crossover is of forward + backward.
        slow = kernels.sdpa_faster_reason(variant, q, k, layout=layout, is_causal=is_causal,
                                          training_routing=getattr(policy, "training_speed_routing", True))
        if slow:
            return _full(requested, slow)
        reason = "; ".join(r for r in (why_8b, v_note) if r) or None
        return Decision(requested, TRAINABLE, variant.name, reason, variant, path="training-kernel")
    where = ("on the GPU (SAGE_PATCH_SIMULATE_ON_GPU=1)" if q.is_cuda else "(tensors on CPU)")
    simulated = f"reference simulation of the trainable 8b (SageBwd) {where}"
    return Decision(requested, TRAINABLE, TRAINABLE_IMPL, "; ".join(r for r in (why_8b, simulated, v_note) if r),
                    path="training-reference")


class Varlen(NamedTuple):
    """A packed variable-length call (layout "varlen": q (total_q, Hq, D), k/v (total_k, Hkv, D))."""
    cu_seqlens_q: object
    cu_seqlens_k: object
    max_seqlen_q: int
    max_seqlen_k: int


def resolve_by_rule(requested: str, q, k, *, layout: str, float_mask: bool, dropout_p: float, policy=None,
                    varlen: Varlen | None = None) -> Decision | None:
    """The full-precision decisions that `resolve` makes by rule, before it looks at the mask's shape or the kernels'
    other constraints, for a call that needs no gradient: an explicit "full", dropout, a float mask, the policy's
    fallback rules (sequence length, head dim, dtype), a head dim no compiled kernel has (on a GPU with the kernels
    loaded). None: the call needs the rest of `resolve`. Cheap enough for every
    decode step (LayerBinding.full_by_rule asks it before anything else): the answer for the last arguments is
    kept, and the layers of one forward ask with the same ones."""
    memo = varlen is None and not torch.compiler.is_compiling()  # traced shapes are symbolic: no guards on them
    if memo:
        key = (requested, policy, layout, q.shape, k.shape, q.dtype, q.is_cuda, dropout_p, float_mask)
        last = _LAST_BY_RULE[0]
        if last is not None and last[0] == key:
            return last[1]
    decision = _by_rule(requested, q, k, layout, float_mask, dropout_p, policy, varlen)
    if memo:
        _LAST_BY_RULE[0] = (key, decision)
    return decision


_LAST_BY_RULE: list = [None]  # (arguments, decision) of the last resolve_by_rule call


def _by_rule(requested, q, k, layout, float_mask, dropout_p, policy, varlen) -> Decision | None:
    if requested == "full":
        return _full(requested, None)
    if dropout_p > 0:
        return _full(requested, f"dropout_p={dropout_p} > 0: quantized precisions have no dropout")
    if float_mask:
        return _full(requested, "float additive attn_mask: quantized precisions take bool masks only")
    why = _policy_fallback(policy, q, k, layout, varlen)
    if why:
        return _full(requested, why)
    # A head dim no compiled kernel has, on a GPU whose kernels resolve would ask: the decision (and its reason)
    # resolve reaches through can_run, made here so that such layers (Gemma's 256) cost the decision alone.
    if (requested in ("8b", "4b") and varlen is None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and _kernels_loaded()):
        why = kernels.registry.head_dim_reason(q.shape[-1])
        if why:
            return _full(requested, f"{requested} unavailable: {why}")
    return None


def resolve(requested: str, q, k, v, *, layout: str, is_causal: bool, mask, dropout_p: float,
            return_lse: bool, smooth_v: bool, policy=None, varlen: Varlen | None = None,
            window_left: int = -1) -> Decision:
    """Decide precision and implementation. `mask` is a masks.MaskInfo; `policy` a Policy or None; `varlen` the
    offsets and longest lengths of a packed call (then "sdpa" means: each sequence through run_attention);
    `window_left` the sliding window (-1: none), which the kernels take (can_run) and speed routing counts as a mask.

    Order: explicit full; what no quantized path honours (dropout, autograd, float masks); the policy's
    fallback rules; then the compiled kernel if it can run this call (else the next safer precision it can
    run; for "fp4", which has no kernel yet, the fastest precision that runs: "4b" where its kernel has native INT4
    MMA, else "8b") unless SDPA is faster at this length (the variant's measured crossover); on CPU the reference
    simulation;
    on a GPU without a usable kernel, full precision (the simulation only with SAGE_PATCH_SIMULATE_ON_GPU=1).
    A call that needs a gradient takes `_resolve_training` instead.
    """
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _resolve_training(requested, q, k, v, layout=layout, is_causal=is_causal, mask=mask,
                                 dropout_p=dropout_p, return_lse=return_lse, smooth_v=smooth_v, policy=policy,
                                 varlen=varlen, window_left=window_left)
    early = resolve_by_rule(requested, q, k, layout=layout, float_mask=mask.kind == "float", dropout_p=dropout_p,
                            policy=policy, varlen=varlen)
    if early is not None:
        return early

    if not q.is_cuda:
        return Decision(requested, requested, "reference", "reference simulation (tensors on CPU)", path="reference")
    if not _kernels_loaded():
        if SIMULATE_ON_GPU:
            return Decision(requested, requested, "reference",
                            f"reference simulation on the GPU (SAGE_PATCH_SIMULATE_ON_GPU=1; compiled kernels not "
                            f"loaded: {_kernels_reason()})", path="reference")
        # The simulation is the slowest, most memory-hungry path: on a GPU it runs only when asked for.
        return _full(requested, f"{requested} needs a compiled kernel and none is usable here ({_kernels_reason()}): "
                                "running full precision. Build the kernels for this GPU (SAGE_PATCH_CUDA_ARCHS, "
                                "README 'Install'), or set SAGE_PATCH_SIMULATE_ON_GPU=1 to run the reference "
                                "simulation of the numerics instead")

    kmask = mask.mask if mask.kind == "key_padding" else None
    exact_4b = requested == "4b" and bool(getattr(policy, "exact_4b", False))
    first_why = None
    stand_in = requested == "fp4"  # the request has no kernel of its own here: the fastest one that runs stands in
    precision = requested
    if mask.kind == "dense":
        first_why = "dense (per-query) attn_mask: kernels take key-padding masks only"
        precision = "full"
    while precision != "full":
        if varlen is not None:
            variant, why = kernels.can_run_varlen(precision, q, k, v, varlen.cu_seqlens_q, varlen.cu_seqlens_k,
                                                  smooth_v=smooth_v)
        else:
            variant, why = kernels.can_run(precision, q, k, v, layout=layout, is_causal=is_causal, attn_mask=kmask,
                                           return_lse=return_lse, smooth_v=smooth_v, window_left=window_left)
        if variant is not None and precision == "4b" and variant.qk != "int4" and not exact_4b:
            # Without INT4 tensor cores (sm_90 and newer) 4b carries INT4 values in INT8 MMA: the 8b work plus Q
            # smoothing, with 4b's larger error (Hopper: 269 TOPS vs 8b's 885, SDPA 587; docs/benchmarks.md).
            # 8b is the faster and more accurate stand-in; the policy's options.exact_4b keeps the 4b numerics.
            variant, why = None, (f"no INT4 tensor cores on this GPU: 4b would carry INT4 values in INT8 MMA "
                                  f"({variant.key}), slower than 8b; policy options.exact_4b: true keeps 4b")
            stand_in = True
        if variant is not None:
            # Speed routing compares with one SDPA call of the same batch; a packed batch's alternative is a loop of
            # SDPA calls, one per sequence, which the measured crossover does not describe: varlen keeps the kernel.
            slow = varlen is None and kernels.sdpa_faster_reason(variant, q, k, layout=layout, is_causal=is_causal,
                                                                 key_padding=kmask is not None,
                                                                 window_left=window_left, head_dim_v=v.shape[-1])
            note = None if why == "ok" else why  # what can_run says of a call it serves: a padded head dim
            if slow and exact_4b:
                # options.exact_4b asks for the 4b numerics: SDPA would run other (full-precision) numerics, so the
                # kernel runs, and the report says what it costs.
                slow = slow.split(": running full precision")[0]
                return Decision(requested, precision, variant.name, "; ".join(r for r in (
                    f"policy options.exact_4b keeps the 4b kernel ({variant.key}) though {slow}", note) if r), variant,
                    path="kernel")
            if slow:
                return _full(requested, slow)
            reason = None if precision == requested else (
                f"{requested} unavailable ({first_why}); using {precision}"
                + (", the fastest precision with a kernel here" if stand_in else ""))
            reason = "; ".join(r for r in (reason, note) if r) or None
            return Decision(requested, precision, variant.name, reason, variant, path="kernel")
        first_why = first_why or why
        precision = _next_precision(requested, precision)
    return _full(requested, f"{requested} unavailable: {first_why}")

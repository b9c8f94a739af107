"""Head dims the kernels do not have natively: such a call runs the kernel of the next native head dim n
(registry.native_head_dim, n >= max(D, Dv)) on Q, K and V zero-padded to n columns.

Exact by construction: a zero column adds 0 to every score q . k, so the scores, the softmax and the LSE are those
of the real head dims, and V's zero columns give output columns that are 0 and are sliced off. The scale is the
caller's (default 1/sqrt(D) of the real D, never 1/sqrt(n)). The quantization sees the same real values: Q's and
K's group scales are maxima over channels (a zero changes none), K's mean of a zero channel is 0 and so is its
share of the LSE's q . mean(K), and V's FP8 scale of an all-zero channel quantizes it to 0 without a 0/0 (portable:
quant_v_kernel divides by a scale only where it is > 0, kernels_cuda/portable/prepass.cuh; Hopper: the sampled base
scale is floored at 1e-20 / 448 and at 2^-10 of the largest channel's, kernels_cuda/hopper/kv_prepass.cuh). So the
real columns are exactly what the kernel of head dim n computes, and the reference simulation follows it by
simulating the padded layout: `padded` is the one place both the launch (kernels._attention) and the CPU path
(api.run_attention) pad, run and slice.

The padded copies are new tensors (the caller's are never written), made outside the custom op: torch.compile
traces them, CUDA graphs capture them, and nothing syncs with the host.
"""
from __future__ import annotations

import math

from .registry import native_head_dim


def padding(d: int, dv: int) -> int | None:
    """The native head dim a call of q/k head dim d and v head dim dv is padded to, or None: no padding (the call
    is native, or no native head dim is large enough)."""
    n = native_head_dim(d, dv)
    return None if n is None or n == d == dv else n


def note(d: int, dv: int, n: int) -> str:
    """What a padded call's decision says (the report shows it)."""
    dims = f"head dim {d}" if d == dv else f"head dims {d} (q, k) / {dv} (v)"
    return f"{dims} zero-padded to {n}, the kernels' next native head dim (exact; the work of {n})"


def pad(x, n: int):
    """x with its last dim zero-padded to n: a new contiguous tensor (the kernels' stride and alignment rules hold
    for it whatever x's are), or x itself when it has n already."""
    import torch

    d = x.shape[-1]
    return x if d == n else torch.nn.functional.pad(x, (0, n - d)).contiguous()


def padded(fn, q, k, v, scale):
    """fn(q, k, v, scale) -> (out, lse or None) run at the call's native head dim: q, k, v padded when their head
    dims are not native (`padding`), with the caller's scale (None: 1/sqrt of q's real head dim); returns out with
    v's real head dim (contiguous, in fn's layout and dtype) and the LSE as fn gave it."""
    d, dv = q.shape[-1], v.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    n = padding(d, dv)
    if n is None:
        return fn(q, k, v, scale)
    out, lse = fn(pad(q, n), pad(k, n), pad(v, n), scale)
    return out[..., :dv].contiguous(), lse

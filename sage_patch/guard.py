"""Runtime guard: every Nth call of a layer, one sampled head is recomputed in full precision; when its error
crosses the policy's threshold, the layer is demoted to the next safer precision (logged once, in the report).

Cost: one head of one call in N, in fp32, plus one host sync for the comparison (so the guard skips calls made
during CUDA-graph capture or torch.compile tracing). With H heads the extra attention work is 1/(N*H) of the
layer's, in fp32.
"""
from __future__ import annotations

import torch

from .accuracy import compare
from .precisions import SAFER
from .reference import exact_attention
from .report import log_fallback_once


class Guard:
    def __init__(self):
        self.calls = 0
        self.demoted: dict[str, str] = {}   # precision -> the safer one used instead
        self.last: dict | None = None       # metrics of the last check

    def effective(self, precision: str) -> str:
        while precision in self.demoted:
            precision = self.demoted[precision]
        return precision

    def clear(self) -> list[str]:
        """Forget every demotion (a new policy was set); returns them as "a -> b"."""
        cleared = [f"{a} -> {b}" for a, b in self.demoted.items()]
        self.demoted.clear()
        return cleared

    def after_call(self, binding, precision: str, q, k, v, call: dict, out) -> None:
        pol = binding.policy
        if not pol.guard_every or precision == "full" or torch.compiler.is_compiling():
            return
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            return
        self.calls += 1
        if self.calls % pol.guard_every:
            return
        heads = q.shape[1] if call["layout"] == "bhsd" else q.shape[2]
        h = (self.calls // pol.guard_every - 1) % heads
        m = self.last = head_error(q, k, v, out, h, call)
        bad = m["cos"] < pol.guard_min_cos or (pol.guard_max_rel_l1 is not None and m["rel_l1"] > pol.guard_max_rel_l1)
        if bad and precision not in self.demoted and SAFER[precision] is not None:
            safer = self.demoted[precision] = SAFER[precision]
            reason = (f"runtime guard demoted {precision} -> {safer} at call {self.calls} "
                      f"(head {h}: cos {m['cos']:.5f}, rel L1 {m['rel_l1']:.4f})")
            binding.stats.guard[reason] += 1
            log_fallback_once(f"{binding.name}: {reason}")


def head_slices(q, k, v, call: dict, heads: list[int]):
    """The given query heads of a routed call, with their KV heads (GQA) and mask, in (B, H, S, D) layout."""
    if call["layout"] == "bshd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    kv = [h // (q.shape[1] // k.shape[1]) for h in heads]
    mask = call.get("attn_mask")
    if mask is not None and mask.dim() == 4 and mask.shape[1] > 1:
        mask = mask[:, heads]
    return q[:, heads], k[:, kv], v[:, kv], mask


def head_error(q, k, v, out, h: int, call: dict) -> dict:
    """Error of head h of a routed call's output against fp32 attention of that head."""
    qs, ks, vs, mask = head_slices(q, k, v, call, [h])
    sinks = call.get("sinks")
    ref = exact_attention(qs, ks, vs, is_causal=call["is_causal"], scale=call["scale"], attn_mask=mask,
                          dtype=torch.float32, window_left=call.get("window_left", -1),
                          sinks=None if sinks is None else sinks[[h]])
    out_h = out.transpose(1, 2)[:, [h]] if call["layout"] == "bshd" else out[:, [h]]
    return compare(out_h, ref)

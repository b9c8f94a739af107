"""Compiled kernels (kernels_cuda/): loading, capability checks and launch.

Contract used by sage_patch.resolve (keep these three names and signatures):

- ``status() -> dict``: {"loaded": bool, "reason": str, "path": str | None, "archs": list[str]}.
- ``can_run(precision, q, k, v, *, layout, is_causal, attn_mask, return_lse, smooth_v) -> (impl | None, reason)``:
  ``impl`` names the kernel that would run (e.g. "cuda-mma"), or None with the reason it cannot.
  ``attn_mask`` here is None or a bool key-padding mask (B, Skv), True = attend (resolve normalizes masks first).
- ``run(impl, precision, q, k, v, *, layout, is_causal, scale, attn_mask, return_lse, smooth_v)``:
  returns ``out`` or ``(out, lse)``; ``out`` in the input layout and dtype, ``lse`` fp32 (B, H, Sq), natural log.
"""
from __future__ import annotations


def status() -> dict:
    return {"loaded": False, "reason": "kernels_cuda is not built yet in this version", "path": None, "archs": []}


def can_run(precision, q, k, v, *, layout, is_causal, attn_mask, return_lse, smooth_v):
    return None, status()["reason"]


def run(impl, precision, q, k, v, *, layout, is_causal, scale, attn_mask, return_lse, smooth_v):
    raise RuntimeError(f"no compiled kernel available ({status()['reason']})")

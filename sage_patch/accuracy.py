"""The papers' accuracy metrics, on flattened outputs, computed in float64."""
from __future__ import annotations

import torch


def _flat(a, b):
    a, b = a.detach().double().flatten(), b.detach().double().flatten().to(a.device)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    return a, b


def cosine(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Cosine similarity of the flattened tensors (1.0 when both are all zero)."""
    a, b = _flat(out, ref)
    na, nb = a.norm(), b.norm()
    if na == 0 and nb == 0:
        return 1.0
    return float((a @ b) / (na * nb).clamp_min(1e-300))


def rel_l1(out: torch.Tensor, ref: torch.Tensor) -> float:
    """sum|O - O'| / sum|O'| with O' the reference."""
    a, b = _flat(out, ref)
    den = b.abs().sum()
    num = (a - b).abs().sum()
    return float(num / den) if den > 0 else float(num)


def rmse(out: torch.Tensor, ref: torch.Tensor) -> float:
    a, b = _flat(out, ref)
    return float(((a - b) ** 2).mean().sqrt())


def compare(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """All three metrics: {"cos": ..., "rel_l1": ..., "rmse": ...}."""
    return {"cos": cosine(out, ref), "rel_l1": rel_l1(out, ref), "rmse": rmse(out, ref)}

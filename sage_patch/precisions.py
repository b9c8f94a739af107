"""Precision names and their order of accuracy."""
from __future__ import annotations

PRECISIONS = ("8b", "4b", "fp4", "full")

DESCRIPTIONS = {
    "8b": "SageAttention2-8b: INT8 Q.K^T with per-thread scales and K smoothing, FP8 P~V, two-level accumulation",
    "4b": "SageAttention2-4b: INT4 Q.K^T (values in [-7, 7]) with Q and K smoothing, FP8 P~V",
    "fp4": "SageAttention3: NVFP4 microscaling (E2M1 + E4M3 scale per 16) for Q, K, P~ and V, two-level P~ scaling",
    "full": "no quantization: torch scaled_dot_product_attention in the input dtype",
}

# When a precision cannot run natively, the resolver tries the next safer one.
SAFER = {"fp4": "8b", "4b": "8b", "8b": "full", "full": None}


def check_precision(value, what: str = "precision") -> str:
    if value not in PRECISIONS:
        raise ValueError(f"{what} must be one of {', '.join(PRECISIONS)}; got {value!r}")
    return value

"""sage-patch: SageAttention-family quantized attention for transformers and diffusers, with per-layer policies."""
from .accuracy import compare, cosine, rel_l1, rmse
from .api import attention, sageattn, sdpa
from .policy import Policy, PolicyError, load_policy
from .precisions import PRECISIONS
from .report import Report, report
from .routing import route_sdpa

__version__ = "0.1.0"

__all__ = [
    "attention", "sdpa", "sageattn", "Policy", "PolicyError", "load_policy", "PRECISIONS", "report", "Report",
    "route_sdpa", "compare", "cosine", "rel_l1", "rmse", "__version__",
]

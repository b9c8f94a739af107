"""sage-patch: SageAttention-family quantized attention for transformers and diffusers, with per-layer policies."""
from .accuracy import compare, cosine, rel_l1, rmse
from .api import attention, sageattn, sdpa
from .calibrate import calibrate
from .policy import Policy, PolicyError, load_policy
from .precisions import PRECISIONS
from .report import Report, report
from .routing import route_sdpa
from .varlen import varlen_attention

__version__ = "0.1.0"

from .integrations import install as _install_integrations  # noqa: E402
from .integrations import set_policy  # noqa: E402

_install_integrations()

__all__ = [
    "attention", "sdpa", "sageattn", "Policy", "PolicyError", "load_policy", "PRECISIONS", "report", "Report",
    "route_sdpa", "set_policy", "calibrate", "varlen_attention", "compare", "cosine", "rel_l1", "rmse", "__version__",
]

"""sage-patch: SageAttention-family quantized attention for transformers and diffusers, with per-layer policies.

`import sage_patch` is cheap: the names below are imported on first use (PEP 562), and the transformers/diffusers
hooks register when those libraries are imported (see sage_patch.integrations); `uninstall()` undoes them.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "compare": "accuracy", "cosine": "accuracy", "rel_l1": "accuracy", "rmse": "accuracy",
    "attention": "api", "sdpa": "api", "sageattn": "api",
    "calibrate": "calibrate",
    "Policy": "policy", "PolicyError": "policy", "load_policy": "policy",
    "PRECISIONS": "precisions",
    "Report": "report",
    "report": "lifecycle", "reset_report": "lifecycle", "inject": "lifecycle", "unload": "lifecycle",
    "set_policy": "lifecycle",
    "route_sdpa": "integrations.generic",
    "varlen_attention": "varlen",
}

__all__ = [*_LAZY, "uninstall", "__version__"]


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'sage_patch' has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(f"sage_patch.{module}"), name)
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


def uninstall() -> None:
    """Undo what `import sage_patch` did to transformers and diffusers ("sage" registrations, the diffusers
    methods, the import hook, pipeline __call__ wrappers). Models still routed keep their routing until unloaded."""
    from .integrations import uninstall as _uninstall

    _uninstall()


# The submodule sage_patch.report (stats and the Report table) is imported now, so that its import never sets the
# package attribute `report` again: that name is the function (lifecycle.report), resolved on first use.
importlib.import_module("sage_patch.report")  # not `from . import report`: that would ask __getattr__ first
globals().pop("report", None)
from .integrations import install as _install  # noqa: E402

_install()

"""Hooks into transformers and diffusers (the sage_patch.integrations package).

`install()` runs at `import sage_patch`: it registers "sage" with transformers and adds
enable_sage_attention()/disable_sage_attention() to diffusers pipelines and models, for whichever of the two
libraries is installed. A failing hook is logged and reported by `sage-patch info`, never fatal.
"""
from __future__ import annotations

import importlib.util
import logging

logger = logging.getLogger("sage_patch")
STATUS: dict[str, str] = {}  # library -> "installed" or the reason it is not


def install() -> None:
    for lib, hook in (("transformers", "register"), ("diffusers", "install")):
        if importlib.util.find_spec(lib) is None:
            STATUS[lib] = f"{lib} is not installed"
            continue
        try:
            mod = importlib.import_module(f"sage_patch.integrations.{lib}")
            getattr(mod, hook)()
            STATUS[lib] = "installed"
        except Exception as e:  # a broken hook must not break `import sage_patch`
            STATUS[lib] = f"hook failed: {type(e).__name__}: {e}"
            logger.warning("sage_patch: %s integration not installed: %s", lib, STATUS[lib])


def set_policy(obj, policy) -> None:
    """Set the attention policy of a transformers model, or of a diffusers model or pipeline."""
    if hasattr(obj, "enable_sage_attention"):
        obj.enable_sage_attention(policy=policy)
        return
    from . import transformers as hf

    hf.set_policy(obj, policy)

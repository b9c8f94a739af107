"""Hooks into transformers and diffusers (the sage_patch.integrations package).

`install()` runs at `import sage_patch` and imports neither library: for each one already imported it registers now,
for the others it puts a finder on `sys.meta_path` that registers right after the library's own module has run (the
post-import hook pattern: the loader found by the other finders is wrapped, everything else delegated to it). So
both import orders work and `import sage_patch` stays cheap. Registering means, and is all that happens to the two
libraries at import: "sage" in transformers' attention and mask interfaces; `enable_sage_attention()` /
`disable_sage_attention()` on diffusers' ModelMixin and DiffusionPipeline. `uninstall()` undoes it. A failing hook
is logged and reported by `sage-patch info` (`STATUS`), never fatal.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import logging
import sys

logger = logging.getLogger("sage_patch")
STATUS: dict[str, str] = {}  # library -> "installed", "on import of <lib>" or the reason it is not
_HOOKS = {"transformers": ("register", "unregister"), "diffusers": ("install", "uninstall")}


def _register(lib: str) -> None:
    try:
        mod = importlib.import_module(f"sage_patch.integrations.{lib}")
        getattr(mod, _HOOKS[lib][0])()
        STATUS[lib] = "installed"
    except Exception as e:  # a broken hook must not break the import of sage_patch or of the library
        STATUS[lib] = f"hook failed: {type(e).__name__}: {e}"
        logger.warning("sage_patch: %s integration not installed: %s", lib, STATUS[lib])


class _Loader(importlib.abc.Loader):
    """The library's own loader, plus registration once its module has executed."""

    def __init__(self, loader, lib: str):
        self._loader, self._lib = loader, lib

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _FINDER.pending.discard(self._lib)
        _register(self._lib)

    def __getattr__(self, name):  # get_resource_reader, is_package, get_source, ...
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self):
        self.pending: set[str] = set()

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, fullname)
                return spec
        return None


_FINDER = _Finder()


def install() -> None:
    """Register with each library now if it is imported, else when it is. The hook goes in first: registering with
    diffusers may import transformers."""
    now = [lib for lib in _HOOKS if lib in sys.modules]
    for lib in _HOOKS:
        if lib in now:
            continue
        if importlib.util.find_spec(lib) is None:
            STATUS[lib] = f"{lib} is not installed"
        else:
            _FINDER.pending.add(lib)
            STATUS[lib] = f"on import of {lib}"
    if _FINDER.pending and _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    for lib in now:
        _register(lib)


def uninstall() -> None:
    """Undo `install()`: unregister from both libraries, drop the import hook. `install()` brings it back."""
    _FINDER.pending.clear()
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    for lib, (_, undo) in _HOOKS.items():
        if STATUS.get(lib) == "installed":
            getattr(importlib.import_module(f"sage_patch.integrations.{lib}"), undo)()
            STATUS[lib] = "uninstalled"

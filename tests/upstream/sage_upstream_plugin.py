"""pytest plugin (`-p sage_upstream_plugin`): run the libraries' own model tests with sage_patch on at policy "full".

- transformers: every model whose attention implementation resolves to "sdpa" (the default, or asked for) gets
  "sage" instead, with the policy "full" on every layer. "eager", flex and flash requests are left alone.
- diffusers: every diffusers model gets `enable_sage_attention({"default": "full"})` before its first forward
  (a global forward pre-hook), so models the tests build directly, from configs or through pipelines are routed,
  and processors the tests set later (IP-Adapter, set_attn_processor) are routed by the layer hook.
- Calls that went through sage are counted (transformers attention calls; diffusers routed SDPA/dispatch calls)
  and written as JSON to $SAGE_UPSTREAM_COUNTS at the end, so the runner can prove the plugin was active.

With SAGE_UPSTREAM_PLUGIN=0 nothing is patched (the baseline run), but the counts file is still written.
"""
from __future__ import annotations

import json
import os
import sys

COUNTS = {"transformers_calls": 0, "diffusers_calls": 0, "diffusers_models_enabled": 0,
          "transformers_models_switched": 0}
ACTIVE = os.environ.get("SAGE_UPSTREAM_PLUGIN", "1") != "0"


def _patch_transformers():
    import transformers
    from transformers import AttentionInterface, PreTrainedModel

    from sage_patch.integrations import transformers as hf
    from sage_patch.policy import Policy

    full = Policy.from_any("full")
    hf.default_policy = lambda *args, **kwargs: full   # every layer bound from now on asks for "full"

    forward = hf.sage_attention_forward

    def counted(module, *args, **kwargs):
        COUNTS["transformers_calls"] += 1
        return forward(module, *args, **kwargs)

    AttentionInterface.register(hf.NAME, counted)

    orig = PreTrainedModel._check_and_adjust_attn_implementation

    def check(self, attn_implementation, *args, **kwargs):
        impl = orig(self, attn_implementation, *args, **kwargs)
        if impl == "sdpa" and attn_implementation in (None, "sdpa"):
            COUNTS["transformers_models_switched"] += 1
            return hf.NAME
        return impl

    PreTrainedModel._check_and_adjust_attn_implementation = check
    return transformers.__version__


def _patch_diffusers():
    import diffusers
    import torch
    from diffusers import ModelMixin

    from sage_patch.integrations import diffusers as sd
    from sage_patch.routing import LayerBinding, select_modules

    # a routed diffusers call either runs the layer's attention (run) or goes back to diffusers' own path, "full"
    for meth in ("run", "record_passthrough"):
        orig = getattr(LayerBinding, meth)

        def counted(self, *args, _orig=orig, **kwargs):
            COUNTS["diffusers_calls"] += 1
            return _orig(self, *args, **kwargs)

        setattr(LayerBinding, meth, counted)

    def pre_hook(module, args):
        if isinstance(module, ModelMixin) and not sd.is_enabled(module) \
                and not getattr(module, "_sage_upstream_seen", False):
            object.__setattr__(module, "_sage_upstream_seen", True)   # enable once; a test may disable it
            if select_modules(module, sd.LIBRARY):
                sd.enable(module, {"default": "full"})
                COUNTS["diffusers_models_enabled"] += 1

    torch.nn.modules.module.register_module_forward_pre_hook(pre_hook)
    return diffusers.__version__


def pytest_configure(config):
    import sage_patch  # noqa: F401  (registers "sage" and the diffusers methods)

    versions = {}
    if ACTIVE:
        for lib, patch in (("transformers", _patch_transformers), ("diffusers", _patch_diffusers)):
            try:
                versions[lib] = patch()
            except ImportError:
                versions[lib] = None
    else:   # the baseline records what it imported too (upstream's conftest may put a checkout's src/ first)
        for lib in ("transformers", "diffusers"):
            try:
                versions[lib] = __import__(lib).__version__
            except ImportError:
                versions[lib] = None
    COUNTS["plugin_active"] = ACTIVE
    COUNTS["versions"] = versions


def pytest_report_header(config):
    state = "ON (policy full)" if ACTIVE else "OFF (baseline)"
    return f"sage_patch upstream plugin: {state}"


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(
        f"sage_patch upstream plugin {'on' if ACTIVE else 'off'}: {COUNTS['transformers_calls']} transformers "
        f"attention calls and {COUNTS['diffusers_calls']} diffusers attention calls went through sage_patch")


def pytest_unconfigure(config):
    COUNTS["paths"] = {lib: getattr(sys.modules.get(lib), "__file__", None) for lib in ("transformers", "diffusers")}
    path = os.environ.get("SAGE_UPSTREAM_COUNTS")
    if path:
        with open(path, "w") as f:
            json.dump(COUNTS, f)

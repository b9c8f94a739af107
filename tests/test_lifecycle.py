"""The package's shape and lifecycle (issue 31): the import graph is a tower, `import sage_patch` is cheap and changes
nothing of transformers/diffusers but the documented registrations (either import order), and `inject`/`unload`
restore exactly what was there, for every adapter."""
import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sage_patch

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "sage_patch"

# Layers, bottom to top: a module imports only from its own layer or lower ones, and nothing imports in a circle.
LAYERS = [
    {"precisions", "sdpa_semantics", "accuracy", "configs", "layer_scope"},
    {"masks", "policy", "report"},
    {"reference"},
    {"kernels", "full", "trainable"},
    {"resolve"},
    {"api", "guard"},
    {"binding", "varlen"},
    {"integrations.transformers", "integrations.diffusers", "integrations.diffusers_parallel",
     "integrations.cp_plans", "integrations.generic"},
    {"lifecycle", "integrations"},
    {"calibrate", "demo", ""},   # "" is the package itself (sage_patch/__init__.py)
    {"cli"},
]


def _unit(mod: str) -> str:
    """The tower unit of a module name relative to sage_patch: subpackages count as one unit, except integrations."""
    if mod.startswith("integrations.") or mod in LAYERS[7]:
        return mod
    return mod.split(".")[0]


def _rank(unit: str) -> int:
    for i, layer in enumerate(LAYERS):
        if unit in layer:
            return i
    raise AssertionError(f"sage_patch.{unit} is in no layer of the tower: add it to LAYERS")


def _imports():
    """{importer module: {imported module}} within sage_patch, module names relative to the package ("" = itself);
    every import statement, function-level ones included."""
    graph = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).with_suffix("")
        parts = list(rel.parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        name = ".".join(parts)
        here = parts if is_pkg else parts[:-1]
        out = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[:len(here) - (node.level - 1)] if node.level > 1 else list(here)
                    target = base + (node.module.split(".") if node.module else [])
                elif node.module and node.module.split(".")[0] == "sage_patch":
                    target = node.module.split(".")[1:]
                else:
                    continue
                tgt = ".".join(target)
                for alias in node.names:  # `from . import report` names a submodule
                    sub = f"{tgt}.{alias.name}" if tgt else alias.name
                    out.add(sub if (PKG / sub.replace(".", "/")).with_suffix(".py").exists()
                            or (PKG / sub.replace(".", "/")).is_dir() else tgt)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "sage_patch":
                        out.add(".".join(alias.name.split(".")[1:]))
    return graph


def test_import_graph_is_a_tower_without_circles():
    graph = _imports()
    units = {}
    for src, targets in graph.items():
        for tgt in targets:
            a, b = _unit(src), _unit(tgt)
            if a != b:
                units.setdefault(a, set()).add(b)
                assert _rank(b) <= _rank(a), f"sage_patch.{src} (layer {_rank(a)}) imports sage_patch.{tgt} " \
                                             f"(layer {_rank(b)}): a lower layer must not import a higher one"
    seen, stack = set(), []

    def visit(u):
        assert u not in stack, f"import circle: {' -> '.join(stack[stack.index(u):] + [u])}"
        if u in seen:
            return
        stack.append(u)
        for v in units.get(u, ()):
            visit(v)
        stack.pop()
        seen.add(u)

    for u in list(units):
        visit(u)
    assert "binding" not in {_unit(t) for t in graph["api"]}, "api must know nothing of layers"
    below = {_unit(t) for src, targets in graph.items() if _unit(src) == "kernels" for t in targets}
    assert "reference" not in below, "kernels (the hardware layer) describes its numerics as data; reference reads it"


def _run(code: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1]


# Every attribute of every class (and module-level function) of the modules sage_patch hooks into, as names that can
# be compared across processes.
_SNAPSHOT = r'''
import importlib, inspect, json, torch
MODULES = ["transformers.modeling_utils", "transformers.masking_utils", "transformers.integrations.sdpa_attention",
           "transformers.modeling_flash_attention_utils", "transformers.models.llama.modeling_llama",
           "diffusers.models.modeling_utils", "diffusers.pipelines.pipeline_utils",
           "diffusers.models.attention_processor", "diffusers.models.attention_dispatch",
           "diffusers.pipelines.flux.pipeline_flux", "diffusers.models.transformers.transformer_flux",
           "torch.nn.functional", "torch.nn.modules.module"]
def ident(v):
    v = getattr(v, "__func__", v)
    return f"{getattr(v, '__module__', '')}.{getattr(v, '__qualname__', type(v).__name__)}"
def snapshot():
    out = {}
    for name in MODULES:
        mod = importlib.import_module(name)
        for attr, val in vars(mod).items():
            if inspect.isclass(val) and val.__module__ == name:
                for k, v in vars(val).items():
                    out[f"{name}.{attr}.{k}"] = ident(v)
            elif inspect.isfunction(val):
                out[f"{name}.{attr}"] = ident(val)
    return out
'''


@pytest.mark.slow
def test_import_changes_no_attribute_of_transformers_or_diffusers_in_either_order():
    without = json.loads(_run(_SNAPSHOT + "import transformers, diffusers\nprint(json.dumps(snapshot()))"))
    first = json.loads(_run(_SNAPSHOT + "import sage_patch, transformers, diffusers\nprint(json.dumps(snapshot()))"))
    after = json.loads(_run(_SNAPSHOT + "import transformers, diffusers\nsnapshot()\nimport sage_patch\n"
                                        "print(json.dumps(snapshot()))"))
    added = {"diffusers.models.modeling_utils.ModelMixin.enable_sage_attention",
             "diffusers.models.modeling_utils.ModelMixin.disable_sage_attention",
             "diffusers.pipelines.pipeline_utils.DiffusionPipeline.enable_sage_attention",
             "diffusers.pipelines.pipeline_utils.DiffusionPipeline.disable_sage_attention"}
    for snap in (first, after):
        changed = sorted(k for k in without if snap.get(k) != without[k])
        assert not changed, f"attributes changed by import sage_patch: {changed[:10]}"
        assert set(snap) - set(without) == added


@pytest.mark.parametrize("order", ["sage_patch first", "libraries first"])
def test_registration_in_both_import_orders_and_uninstall(order):
    imports = "import sage_patch, transformers, diffusers" if order == "sage_patch first" else \
        "import transformers, diffusers, sage_patch"
    out = _run(imports + r'''
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
from diffusers import DiffusionPipeline, ModelMixin
def state():
    return ["sage" in AttentionInterface._global_mapping, "sage" in AttentionMaskInterface._global_mapping,
            hasattr(DiffusionPipeline, "enable_sage_attention"), hasattr(ModelMixin, "disable_sage_attention")]
on = state()
sage_patch.uninstall()
off = state()
print(on + off + [sage_patch.integrations.STATUS["transformers"]])
''')
    assert out == "[True, True, True, True, False, False, False, False, 'uninstalled']"


def test_import_is_light():
    out = _run(r'''
import sys, time, torch
t = time.perf_counter()
import sage_patch
dt = time.perf_counter() - t
heavy = sorted(m for m in ("torch._dynamo", "transformers", "diffusers", "yaml") if m in sys.modules)
print([round(dt, 3) < 1.0, heavy])
''')
    assert out == "[True, []]"


def test_first_attention_call_imports_no_compiler_or_library():
    """The first call's fixed cost is ours only where we import what it does not need: torch._dynamo alone took
    about 4 s of a 4 s first call on the H200 (resolve's constant markers imported it); Triton belongs to calls
    that need a gradient, transformers and diffusers to their integrations."""
    out = _run(r'''
import sys, torch, sage_patch
q = torch.randn(1, 2, 64, 64)
sage_patch.attention(q, q, q, layout="bhsd", precision="8b")
sage_patch.sdpa(q, q, q, is_causal=True)
print(sorted(m for m in ("torch._dynamo", "triton", "transformers", "diffusers") if m in sys.modules))
''')
    assert out == "[]"


# ---- inject / unload --------------------------------------------------------------------------------------------

def _llama(impl):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM._from_config(cfg, attn_implementation=impl).eval()


def test_unload_of_a_model_built_with_sage_equals_sdpa():
    sage, ref = _llama("sage"), _llama("sdpa")
    ids = torch.randint(0, 128, (2, 150), generator=torch.Generator().manual_seed(1))
    am = torch.ones_like(ids)
    am[1, :5] = 0
    with torch.no_grad():
        routed = sage(ids, attention_mask=am).logits
        assert sage_patch.report(sage).to_dict()["model.layers.0.self_attn"]["used"] == {"8b": 1}
        assert sage_patch.unload(sage) is sage
        assert len(sage_patch.report(sage)) == 0 and sage.config._attn_implementation == "sdpa"
        torch.testing.assert_close(sage(ids, attention_mask=am).logits, ref(ids, attention_mask=am).logits,
                                   rtol=0, atol=0)
        assert not torch.equal(routed, ref(ids, attention_mask=am).logits)
        sage_patch.inject(ref, "full")   # inject switches an sdpa model to sage; unload switches it back
        assert ref.config._attn_implementation == "sage" and len(sage_patch.report(ref)) == 2
        sage_patch.unload(ref)
        assert ref.config._attn_implementation == "sdpa" and len(sage_patch.report(ref)) == 0


class _Attention(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.scaled_dot_product_attention(x, x, x)


def test_generic_adapter_inject_unload_restores_torch_and_modules():
    net = torch.nn.Sequential(_Attention(), _Attention())
    x = torch.randn(1, 2, 160, 16)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    before = [dict(m.__dict__) for m in net.modules()]
    sage_patch.inject(net, "8b")
    with torch.no_grad():
        net(x)
    assert {n: s["used"] for n, s in sage_patch.report(net).to_dict().items()} == {"0": {"8b": 1}, "1": {"8b": 1}}
    sage_patch.unload(net)
    assert torch.nn.functional.scaled_dot_product_attention is sdpa
    assert [dict(m.__dict__) for m in net.modules()] == before


def test_diffusers_inject_unload_restores_processors():
    from diffusers import FluxTransformer2DModel

    m = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
                               num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                               guidance_embeds=True, axes_dims_rope=(4, 6, 6))
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    procs = dict(m.attn_processors)
    backends = dict(_AttentionBackendRegistry._backends)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    before = [dict(mod.__dict__) for mod in m.modules()]
    g = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, 64, 16, generator=g), encoder_hidden_states=torch.randn(1, 13, 32,
                  generator=g), pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.tensor([0.5]),
                  guidance=torch.tensor([3.5]), img_ids=torch.zeros(64, 3), txt_ids=torch.zeros(13, 3),
                  return_dict=False)
    with torch.no_grad():
        ref = m(**inputs)[0]
        sage_patch.inject(m, "8b")
        routed = m(**inputs)[0]
        assert {n: s["used"] for n, s in sage_patch.report(m).to_dict().items()} == \
            {n.removesuffix(".processor"): {"8b": 1} for n in procs}
        assert all(a is b for a, b in zip(m.attn_processors.values(), procs.values()))   # processors untouched
        sage_patch.unload(m)
        assert all(a is b for a, b in zip(m.attn_processors.values(), procs.values()))
        assert len(sage_patch.report(m)) == 0 and [dict(mod.__dict__) for mod in m.modules()] == before
        assert torch.nn.functional.scaled_dot_product_attention is sdpa     # the pass-throughs are gone
        assert _AttentionBackendRegistry._backends == backends
        assert not torch.equal(routed, ref) and torch.equal(m(**inputs)[0], ref)


def test_registration_when_only_diffusers_was_imported_first():
    """diffusers imported before sage_patch, transformers after (registering with diffusers may import it)."""
    out = _run(r'''
import diffusers, sage_patch, transformers
from transformers import AttentionInterface
from diffusers import ModelMixin
print(["sage" in AttentionInterface._global_mapping, hasattr(ModelMixin, "enable_sage_attention")])
''')
    assert out == "[True, True]"


def test_sdpa_semantics_one_module_for_api_and_routed_layers():
    """3-D inputs, (Sq, Skv) masks and top-left causal mean what torch means, through api.sdpa and route_sdpa alike."""
    f = torch.nn.functional.scaled_dot_product_attention
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(2, 24, 16, generator=g), torch.randn(2, 40, 16, generator=g), torch.randn(2, 40, 16,
                                                                                                   generator=g)
    torch.testing.assert_close(sage_patch.sdpa(q, k, v, is_causal=True, precision="full"), f(q, k, v, is_causal=True))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = _Attention()

    net = Net()
    net.attn.forward = lambda x: torch.nn.functional.scaled_dot_product_attention(x, k, v, is_causal=True)
    with sage_patch.route_sdpa(net, "full"):
        routed = net.attn(q)
    torch.testing.assert_close(routed, f(q, k, v, is_causal=True))
    assert sage_patch.report(net).to_dict()["attn"]["used"] == {"full": 1}


@pytest.mark.slow
def test_reports_of_five_tiny_models_unchanged_since_c347a5f():
    """tools/dump_reports.py on Flux, SD3.5, CogVideoX, HunyuanVideo and Llama (default policies and 8b, before and after
    a forward) gives the report recorded on commit c347a5f, before issue 31's refactor: same layers, precisions,
    implementations and reasons."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import dump_reports
    finally:
        sys.path.pop(0)
    expected = json.loads((ROOT / "tests" / "data" / "reports_c347a5f.json").read_text())
    assert json.loads(json.dumps(dump_reports.dump(), sort_keys=True)) == expected


class _DirectAttention(torch.nn.Module):
    """A layer that calls sage_patch.sdpa itself instead of torch's SDPA."""

    def forward(self, x):
        return sage_patch.sdpa(x, x, x)


def test_sdpa_called_inside_a_routed_layer_runs_that_layer():
    """precision=None inside a routed layer means that layer's attention (policy, stats), as before issue 31; api
    finds it through layer_scope without importing binding. Outside any layer it means "8b"."""
    net = torch.nn.Sequential(_DirectAttention(), _DirectAttention())
    x = torch.randn(1, 2, 160, 16, generator=torch.Generator().manual_seed(0))
    policy = {"default": "8b", "layers": [{"match": "1", "precision": "full"}]}
    with torch.no_grad(), sage_patch.route_sdpa(net, policy):
        out = [net[0](x), net[1](x)]
    assert {n: s["used"] for n, s in sage_patch.report(net).to_dict().items()} == {"0": {"8b": 1}, "1": {"full": 1}}
    torch.testing.assert_close(out[1], torch.nn.functional.scaled_dot_product_attention(x, x, x))
    with torch.no_grad():
        assert torch.equal(out[0], sage_patch.sdpa(x, x, x, precision="8b"))
        assert torch.equal(sage_patch.sdpa(x, x, x), out[0]) and not torch.equal(out[0], out[1])
        assert torch.equal(net[1](x), out[0])     # unrouted: the layer is gone, precision None is "8b" again

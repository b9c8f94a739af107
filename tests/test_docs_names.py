"""Every code name the docs cite in backticks exists in the tree: README.md and docs/**/*.md may not name a module,
field, constant, setting or file that is gone (they once cited `SDPA_FASTER_BELOW` long after the code dropped it).

What counts as a code name (a backticked span without spaces, quotes or brackets; code fences are not scanned):
- a path under the tree's folders (`sage_patch/...`, `kernels_cuda/...`, `benchmarks/...`, `tools/...`, `tests/...`,
  `docs/...`, `.ci/...`; a `:name` suffix dropped): the file or folder exists (`*` as a glob); a bare file name
  (`bench_kernel.py`) exists somewhere in the tree; another project's paths are written with its name first
  (`transformers/tests/...`) and are not checked;
- a dotted name (`KernelVariant.sdpa_faster_below`, `sage_patch.kernels.registry.select`): rooted in torch / `F`,
  transformers, diffusers or triton, it must resolve by import; otherwise every component is an identifier of the
  tree (component-wise: `Class.attr` passes when both names exist somewhere, even apart);
- an upper-case constant or setting with an underscore (`SAGE_PATCH_CUDA_ARCHS`, `HOPPER_BLOCK_K`) or a snake_case
  name (`exact_4b`, `select_modules`): an identifier of the tree.
Identifiers of the tree: the names Python's AST sees in sage_patch/, benchmarks/, tools/ and tests/ (modules,
classes, functions, arguments, attributes, assigned names, and string constants that are identifiers, e.g. policy
keys and environment variables), C/CUDA identifiers of kernels_cuda/, and the names of the libraries the package
integrates with that the tree only uses (ALLOWED_UPSTREAM). Hardware target names (`sm_90a`, `compute_120`) are not
code names. A line that cites a commit (a 7-40 digit hex hash) is history (the tried-and-rejected and probe tables name
the experiment's code at that commit): its names are not checked."""
from __future__ import annotations

import ast
import glob
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PATH_ROOTS = ("sage_patch/", "kernels_cuda/", "benchmarks/", "tools/", "tests/", "docs/", ".ci/")
IMPORT_ROOTS = {"torch": "torch", "F": "torch.nn.functional", "transformers": "transformers",
                "diffusers": "diffusers", "triton": "triton"}
# upstream names the docs discuss that our code never spells out (each checked once by hand against its library)
ALLOWED_UPSTREAM = {"_cp_plan", "enable_parallelism", "tp_plan", "device_mesh", "post_init", "torch_dtype",
                    "loop_unroll_factor", "warp_specialize", "atomic_add", "from_pretrained", "ring_degree",
                    "ulysses_degree", "cuMulticastCreate", "position_ids", "parallel_config", "q_proj", "k_proj",
                    "v_proj", "o_proj", "set_default_device"}
IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
NOT_CODE = re.compile(r"^(sm|compute)_\d+[a-z]?$")
FILE_NAME = re.compile(r"^[\w-]+\.(py|cu|cuh|h|cpp|md|yaml|json|sh)$")
# a hash with a letter anywhere, or an all-digit one alone in a table cell (`| 3917026 |`)
COMMIT = re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b|\|\s*\d{7,12}\s*\|")


def _code_spans(text: str) -> list[str]:
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)  # fenced blocks are examples, not citations
    lines = [line for line in text.split("\n") if not COMMIT.search(line)]
    return [s for line in lines for s in re.findall(r"(?<!`)`([^`\n]+)`(?!`)", line)]


def _tree_identifiers() -> set[str]:
    names: set[str] = set()
    for folder in ("sage_patch", "benchmarks", "tools", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            if "upstream" in path.parts or path.name == Path(__file__).name:  # this file names gone names on purpose
                continue
            names.add(path.stem)
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                for field in ("name", "id", "attr", "arg"):
                    value = getattr(node, field, None)
                    if isinstance(value, str):
                        names.add(value)
                if isinstance(node, ast.alias):
                    names.update(node.name.split("."))
                    if node.asname:
                        names.add(node.asname)
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    names.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", node.value))
    for path in (ROOT / "kernels_cuda").rglob("*"):
        if path.suffix in (".cu", ".cuh", ".h", ".cpp", ".py"):
            names.add(path.stem)
            names.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", path.read_text()))
    for path in (ROOT / "sage_patch" / "configs").glob("*.yaml"):
        names.add(path.stem)
        names.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", path.read_text()))
    return names | ALLOWED_UPSTREAM


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    try:
        obj = importlib.import_module(IMPORT_ROOTS[parts[0]])
    except ImportError:
        return True  # the library is not installed here: nothing to check against
    if parts[:2] == ["torch", "_C"] and not obj.cuda.is_available():
        return True  # CUDA-only bindings are absent from a CPU build of torch
    for i, part in enumerate(parts[1:], 1):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        try:
            obj = importlib.import_module(".".join([IMPORT_ROOTS[parts[0]]] + parts[1:i + 1]))
        except ImportError:
            return False
    return True


def unknown_names(text: str, idents: set[str]) -> list[str]:
    bad = []
    for span in _code_spans(text):
        name = span.rstrip(".,:;").removesuffix("()")
        if any(c in name for c in " \"'()[]{}<>=,|$"):
            continue
        if name.startswith(PATH_ROOTS):
            if not glob.glob(str(ROOT / name.split(":")[0])):
                bad.append(name)
        elif FILE_NAME.match(name):
            if not glob.glob(str(ROOT / "**" / name), recursive=True):
                bad.append(name)
        elif "." in name and all(IDENT.match(p) for p in name.split(".")):
            root = name.split(".")[0]
            if root in IMPORT_ROOTS:
                if not _resolves(name):
                    bad.append(name)
            elif not all(p in idents for p in name.split(".")):
                bad.append(name)
        elif IDENT.match(name) and "_" in name.strip("_") and not NOT_CODE.match(name):
            if name not in idents:
                bad.append(name)
    return bad


@pytest.fixture(scope="module")
def idents():
    return _tree_identifiers()


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_every_cited_code_name_exists(doc, idents):
    bad = unknown_names(doc.read_text(), idents)
    assert not bad, f"{doc.relative_to(ROOT)} cites names that are not in the tree: {sorted(set(bad))}"


def test_the_rule_catches_names_that_are_gone(idents):
    text = ("the crossovers were `sage_patch.kernels.SDPA_FASTER_BELOW`, set by `set_sdpa_crossover`, in "
            "`sage_patch/router.py` and `wgmma_probe.cu`; now `KernelVariant.sdpa_faster_below` in "
            "`sage_patch/kernels/registry.py`, `F.scaled_dot_product_attention`, `torch.compile`, `sm_90a`, `exact_4b`.")
    assert unknown_names(text, idents) == ["sage_patch.kernels.SDPA_FASTER_BELOW", "set_sdpa_crossover",
                                           "sage_patch/router.py", "wgmma_probe.cu"]
    assert unknown_names("`F.no_such_function`", idents) == ["F.no_such_function"]
    assert unknown_names("| `wgmma_probe.cu` | measured, then removed | 97e21b6 |", idents) == []

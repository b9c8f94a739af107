"""Every code name the documentation cites exists in the tree.

Scope: README.md and docs/**/*.md. What is checked ("code names"):

Inline code spans (`...`), each classified by its shape, first rule that applies:
  1. `--flag ...` (a span starting with a flag) and `sage-patch SUB ... --flag`: every `--flag` token is a string in
     the tree's source (argparse options, scripts).
  2. `SAGE_PATCH_*` anywhere in a span: the environment variable is read somewhere in the source text.
  3. `Struct::member` (C++), `ns::op` (a torch op) or `tests/x.py::test_y` (a pytest node): the struct has the
     member; the op's qualified name is a string literal in the source; the node's file exists and defines the test.
  4. File paths: a span without spaces or wildcards that starts with a top-level folder of the repository
     (`sage_patch/`, `kernels_cuda/`, `benchmarks/`, `tools/`, `tests/`, `docs/`, `.ci/`), or ends with `/`, or ends
     with a source or data extension (.py .cu .cuh .h .cpp .yaml .json .md .png .toml .so .sh): it exists, as given
     from the repository root or from the document's folder, or as the tail of a path in the tree (`hopper/`,
     `_lib.py`), or (built artifacts) as a string literal of the source (`libsage_kernels.so`), or in Python's
     standard library (`pydoc_data/topics.py`).
  5. Names: a span that is a dotted identifier path, optionally followed by a call's parentheses (whatever they
     hold) or by `=value` (a keyword argument: the name before `=` is checked).
     - A dotted path resolves from its first part when that part is `sage_patch`, a module of the tree (`registry`,
       `kernels`, `timing`), a class of the tree (Python class, C/C++ struct: `SageAttnParams`, `KernelVariant`) or
       an upstream module (`torch`, `F` = torch.nn.functional, `transformers`, `diffusers`: checked by import, or
       found in the tree's source, verbatim or as the string getattr reads, for names a CPU build of torch lacks
       such as `torch._C._cuda_getCurrentRawStream`).
       Each next part must be a submodule, a module-level name (definitions, assignments, imports; a module with
       `__getattr__` also exports its dicts' string keys), or a class member (body names, dataclass fields,
       `self.x` assignments, ctypes `_fields_`, C struct fields and methods; members of its in-tree bases). Once a
       part is a function or a value, the rest is not checked. A dotted path rooted anywhere else (`q.shape`,
       the YAML path `fallback.min_seq_len`) is not a code name.
     - A single identifier is checked when it cannot be an English word or a value: it contains `_` (snake_case,
       SCREAMING_CASE; dunders excepted) or an inner capital (CamelCase). It must be defined in the tree: a
       Python definition, assignment target, parameter, class member, a string literal that is exactly that
       identifier (policy keys, env names), or a C/CUDA identifier of kernels_cuda/ (comments and strings
       stripped), or be in UPSTREAM (names of torch/transformers/diffusers that the docs cite bare).
  Everything else is prose, not a code name: spans with spaces (shell commands, YAML, expressions, signatures),
  numbers, single lowercase words (`full`, `8b`, `sage`), quoted values.

History: a line that names a commit (a hexadecimal hash of 7 to 40 digits, at least one a decimal digit, as the
tables of docs/design/ do) describes code as it was at that commit; its names are not checked.
Foreign documents (FOREIGN: docs about other repositories' files, such as the upstream test suites) are checked for
this project's names only: dotted `sage_patch.*` paths, `SAGE_PATCH_*` variables, flags of `sage-patch` and of
in-tree scripts, and paths under this project's own folders (not `tests/`, which upstream has too, except
`tests/upstream/`).

Markdown links to files of the tree (`[text](docs/x.md)`, relative to the document) must point at a file.

Fenced code blocks: dotted `sage_patch.*` paths (calls, `from sage_patch.x import a, b`), `SAGE_PATCH_*` variables,
in-tree script paths, and the flags given to `sage-patch` or to an in-tree script (those after it on its line).

The tree's Python is read with `ast` (nothing is imported except the upstream modules above), so the test runs in
a second and does not depend on a GPU or a built library.
"""
from __future__ import annotations

import ast
import importlib
import re
import sysconfig
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", "build", "dist", "__pycache__", ".pytest_cache", "node_modules", ".venv", "venv",
             "out", ".whl", ".gl"}  # the last three: scratch folders .gitignore keeps out of the tree
ROOT_DIRS = ("sage_patch/", "kernels_cuda/", "benchmarks/", "tools/", "tests/", "docs/", ".ci/")
FILE_EXTS = (".py", ".cu", ".cuh", ".h", ".cpp", ".yaml", ".yml", ".json", ".md", ".png", ".toml", ".so", ".sh")
PY_DIRS = ("sage_patch", "benchmarks", "tools", "tests", "kernels_cuda")
C_EXTS = (".h", ".cuh", ".cu", ".cpp", ".c")

# Upstream names the docs cite bare (no module prefix to import them by), each with where it lives.
UPSTREAM = {
    "attn_implementation", "set_attn_implementation", "from_pretrained", "torch_dtype", "tp_plan",  # transformers
    "device_mesh", "distributed_config", "gguf_file", "DistributedConfig", "AutoModelForCausalLM", "Trainer",
    "q_proj", "k_proj", "v_proj",                                                       # transformers Llama modules
    "set_attention_backend", "enable_parallelism", "parallel_config", "_cp_plan", "ModelMixin",  # diffusers
    "DiffusionPipeline", "ContextParallelConfig", "attn2", "ulysses_degree", "ring_degree",
    "custom_op", "register_fake", "assume_constant_result", "GradScaler",               # torch
    "is_causal", "attn_mask", "dropout_p", "enable_gqa", "scaled_dot_product_attention",  # torch SDPA's arguments
    "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",                     # flash-attn's varlen names
    "tensor_layout", "sageattn",                                                        # the sageattention package
    "cu_seqlens", "DynamicCache",                                                       # flash-attn, transformers
    "OMP_NUM_THREADS", "CUDA_CACHE_PATH",                                               # OpenMP's, the CUDA driver's
}
FOREIGN = {"docs/upstream_tests.md": "cites transformers' and diffusers' own test files and classes"}
OWN_DIRS = ("sage_patch/", "kernels_cuda/", "benchmarks/", "tools/", "docs/", ".ci/", "tests/upstream/")
COMMIT = re.compile(r"(?<![\w.-])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w.-])")
UPSTREAM_MODULES = {"torch": "torch", "F": "torch.nn.functional", "nn": "torch.nn", "transformers": "transformers",
                    "diffusers": "diffusers"}

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
DOTTED = re.compile(rf"^({IDENT}(?:\.{IDENT})*)(?:\(.*\)|=\S*)?$", re.S)
FLAG = re.compile(r"--[a-z][a-z0-9-]*")
ENV = re.compile(r"SAGE_PATCH_[A-Z0-9_]+")


def _walk(exts):
    for path in sorted(ROOT.rglob("*")):
        rel = path.relative_to(ROOT)
        if any(p in SKIP_DIRS or p.endswith(".egg-info") for p in rel.parts[:-1]):
            continue
        if path.is_file() and path.suffix in exts and path != Path(__file__).resolve():  # not this test's own names
            yield path


class _Class:
    def __init__(self, name):
        self.name, self.members, self.nested, self.bases = name, set(), {}, []


class _Module:
    def __init__(self, key, is_pkg):
        self.key, self.is_pkg = key, is_pkg
        self.names: dict[str, str] = {}      # name -> "class" | "import" | "value"
        self.classes: dict[str, _Class] = {}


class Tree:
    """What the tree defines, from its Python (ast) and C/CUDA (regex) sources."""

    def __init__(self):
        self.modules: dict[str, _Module] = {}
        self.classes: dict[str, list[_Class]] = {}
        self.idents: set[str] = set()
        self.literals: set[str] = set()       # whole string literals that are a name, a flag or an op
        self.flags: set[str] = set()
        self.source_text = []
        for path in _walk((".py",)):
            self._python(path)
        for path in _walk(C_EXTS):
            self._c(path.read_text(errors="replace"))
        for path in [*_walk((".sh", ".toml", ".in")), ROOT / ".ci" / "run"]:
            if path.exists():
                self.source_text.append(path.read_text(errors="replace"))
        self.source_text = "\n".join(self.source_text)
        self.flags |= set(FLAG.findall(self.source_text))
        files = [p.relative_to(ROOT).as_posix() for p in _walk(
            FILE_EXTS + C_EXTS + (".txt", ".in", "")) if p.name != ".gitignore"]
        self.files = set(files)
        self.dirs = {"/".join(f.split("/")[:i]) + "/" for f in files for i in range(1, f.count("/") + 1)}
        self.stems: dict[str, list[str]] = {}
        for key in self.modules:
            self.stems.setdefault(key.split(".")[-1], []).append(key)

    # --- Python -------------------------------------------------------------------------------------------------
    def _python(self, path):
        text = path.read_text(errors="replace")
        self.source_text.append(text)
        try:
            tree = ast.parse(text)
        except SyntaxError:
            return
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        key = ".".join(parts) if parts else ""
        mod = self.modules[key] = _Module(key, is_pkg)
        self.idents.add(parts[-1] if parts else "")
        self._scope(tree.body, mod.names, mod.classes)
        if "__getattr__" in mod.names:  # PEP 562 lazy exports: the string keys of the module's dicts
            for node in tree.body:
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
                    for k in node.value.keys:
                        if isinstance(k, ast.Constant) and isinstance(k.value, str):
                            mod.names.setdefault(k.value, "value")
        for node in ast.walk(tree):
            if isinstance(node, ast.arg):
                self.idents.add(node.arg)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                s = node.value
                if re.fullmatch(rf"{IDENT}|--[\w-]+|{IDENT}::{IDENT}", s):
                    self.literals.add(s)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.idents.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                self.idents.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                self.idents.add(node.attr)
            elif isinstance(node, ast.alias):
                self.idents.add((node.asname or node.name).split(".")[-1])
        self.idents |= set(mod.names)

    def _scope(self, body, names, classes):
        """Module- or class-level names of `body`, descending into if/try/with blocks but not into functions."""
        for node in body:
            if isinstance(node, ast.ClassDef):
                names[node.name] = "class"
                cls = classes[node.name] = _Class(node.name)
                self.classes.setdefault(node.name, []).append(cls)
                cls.bases = [ast.unparse(b).split(".")[-1] for b in node.bases]
                member_kinds: dict[str, str] = {}
                self._scope(node.body, member_kinds, cls.nested)
                cls.members |= set(member_kinds)
                for sub in ast.walk(node):
                    if (isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store)
                            and isinstance(sub.value, ast.Name) and sub.value.id == "self"):
                        cls.members.add(sub.attr)
                    if isinstance(sub, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_fields_"
                                                           for t in sub.targets):
                        for elt in getattr(sub.value, "elts", []):  # ctypes fields: ("name", type)
                            if isinstance(elt, ast.Tuple) and isinstance(elt.elts[0], ast.Constant):
                                cls.members.add(elt.elts[0].value)
                self.idents |= cls.members
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names[node.name] = "value"
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            names[n.id] = "value"
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for a in node.names:
                    names[(a.asname or a.name).split(".")[0]] = "import"
            elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For)):
                for block in ("body", "orelse", "finalbody"):
                    self._scope(getattr(node, block, []), names, classes)
                for h in getattr(node, "handlers", []):
                    self._scope(h.body, names, classes)

    # --- C / CUDA -------------------------------------------------------------------------------------------------
    def _c(self, text):
        self.source_text.append(text)
        code = re.sub(r"//[^\n]*|/\*.*?\*/", " ", text, flags=re.S)
        code = re.sub(r'"(?:\\.|[^"\\\n])*"', '""', code)
        self.idents |= set(re.findall(IDENT, code))
        for m in re.finditer(rf"\b(?:struct|class)\s+({IDENT})?\s*(?::[^{{;]*)?\{{", code):
            depth, i, top = 1, m.end(), []
            while i < len(code) and depth:
                c = code[i]
                depth += (c == "{") - (c == "}")
                if depth == 1 and c != "}":
                    top.append(c)
                i += 1
            body = "".join(top)
            name = m.group(1) or (re.match(rf"\s*({IDENT})\s*;", code[i:]) or [None, None])[1]
            if not name:
                continue
            cls = _Class(name)
            cls.members = set(re.findall(rf"({IDENT})\s*(?:\[[^\]]*\])?\s*(?:[;,]|=[^;]*;)", body))
            cls.members |= set(re.findall(rf"({IDENT})\s*\(", body))
            self.classes.setdefault(name, []).append(cls)

    # --- lookups ------------------------------------------------------------------------------------------------
    def defines(self, name: str) -> bool:
        return name in self.idents or name in self.literals

    def _class_has(self, name: str, attr: str, seen=()) -> "bool | None":
        """True/False: whether class `name` (any in-tree definition) has `attr`; None: unknowable (external base)."""
        unknown = False
        for cls in self.classes.get(name, []):
            if attr in cls.members or attr in cls.nested:
                return True
            for base in cls.bases:
                if base in ("object", "NamedTuple", "Exception", "Structure", "Enum", "Protocol", "Generic"):
                    continue
                if base in self.classes and base not in seen:
                    found = self._class_has(base, attr, (*seen, name))
                    unknown |= found is None
                    if found:
                        return True
                else:
                    unknown = True
        return None if unknown else False

    def resolve(self, parts: list[str]) -> "str | None":
        """None when dotted `parts` resolves (or is not a code name); else what is missing."""
        head = parts[0]
        if head in UPSTREAM_MODULES:
            if ".".join(parts) in self.source_text or parts[-1] in self.literals:
                return None  # what the tree itself calls (torch._C names a CPU build lacks, read with getattr)
            return _upstream(UPSTREAM_MODULES[head], tuple(parts[1:]))
        if head == "sage_patch":
            scopes = [("module", "sage_patch")]
        elif head in self.stems:
            scopes = [("module", k) for k in self.stems[head]]
        elif head in self.classes:
            scopes = [("class", head)]
        else:
            return None
        if len(parts) == 1:
            return None
        errors = []
        for scope in scopes:
            err = self._walk_parts(scope, parts, 1)
            if err is None:
                return None
            errors.append(err)
        return errors[0]

    def _walk_parts(self, scope, parts, i):
        kind, where = scope
        while i < len(parts):
            p = parts[i]
            if kind == "module":
                mod = self.modules[where]
                sub = f"{where}.{p}" if where else p
                if mod.is_pkg and sub in self.modules:
                    where = sub
                elif p in mod.names:
                    if mod.names[p] == "value" or p not in self.classes:
                        return None   # a function or a value: its attributes are not followed
                    kind, where = "class", p
                else:
                    return f"{'.'.join(parts[:i + 1])}: module {where} defines no {p!r}"
            else:
                has = self._class_has(where, p)
                if has is None:
                    return None if self.defines(p) else f"{'.'.join(parts[:i + 1])}: no {p!r} in the tree"
                if not has:
                    return f"{'.'.join(parts[:i + 1])}: class {where} has no member {p!r}"
                if p not in self.classes:
                    return None
                where = p
            i += 1
        return None


@lru_cache(maxsize=None)
def _upstream(module: str, attrs: tuple[str, ...]) -> "str | None":
    try:
        obj = importlib.import_module(module)
    except ImportError:
        return None  # not installed here: nothing to check against
    for a in attrs:
        try:
            obj = getattr(obj, a)
        except Exception:
            try:
                obj = importlib.import_module(f"{obj.__name__}.{a}")
            except Exception:
                return f"{module}.{'.'.join(attrs)}: {a!r} not found upstream"
    return None


@pytest.fixture(scope="module")
def tree():
    return Tree()


def _docs():
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _spans(text):
    """(line number, inline code span) outside fenced blocks (a span may wrap onto the next line, not across a
    blank one), (line number, line) inside them, and (line number, link target) of Markdown links."""
    fenced, prose, in_fence = [], [], False
    for no, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
            prose.append("")
        elif in_fence:
            fenced.append((no, line))
            prose.append("")
        else:
            prose.append(line)
    body = "\n".join(prose)
    inline = [(body.count("\n", 0, m.start()) + 1, " ".join(m.group(2).split()))
              for m in re.finditer(r"(`+)((?:(?!\n\s*\n).)+?)\1", body, re.S)]
    links = [(body.count("\n", 0, m.start()) + 1, m.group(1))
             for m in re.finditer(r"\]\(([^)\s]+)\)", re.sub(r"(`+).*?\1", "", body, flags=re.S))]
    return inline, fenced, links


def _check_path(tree: Tree, span: str, doc: Path) -> "str | None":
    span = span.rstrip(".,:;")
    if any(c in span for c in "*{}<>") or "..." in span:
        return None
    rel_doc = (doc.parent / span).resolve()
    if (ROOT / span).exists() or rel_doc.exists():
        return None
    if span.endswith("/") and any(d == span or d.endswith("/" + span) for d in tree.dirs):
        return None
    if not span.endswith("/") and any(f == span or f.endswith("/" + span) for f in tree.files):
        return None
    if "/" not in span and span in tree.literals | set(re.findall(r"[\w.-]+", tree.source_text)):
        return None  # a built artifact the source names (libsage_kernels.so)
    if (Path(sysconfig.get_paths()["stdlib"]) / span).exists():
        return None
    return f"{span}: no such file or folder"


def _is_path(span: str) -> bool:
    if " " in span or "=" in span or "(" in span:
        return False
    return span.startswith(ROOT_DIRS) or (span.endswith("/") and re.fullmatch(r"[\w./-]+", span) is not None) or (
        span.endswith(FILE_EXTS) and re.fullmatch(r"[\w./-]+", span) is not None)


def _name_wanted(name: str) -> bool:
    if name.startswith("__") and name.endswith("__"):
        return False
    return "_" in name or re.search(r"[a-z][A-Z]", name) is not None


def check_span(tree: Tree, span: str, doc: Path) -> list[str]:
    s = span.strip()
    problems = []
    tokens = s.split()
    if s.startswith("--") or (tokens[:1] == ["sage-patch"]):
        problems += [f"{f}: no such option in the source" for f in FLAG.findall(s) if f not in tree.flags]
    problems += [f"{e}: no such environment variable in the source" for e in ENV.findall(s)
                 if e not in tree.source_text]
    if s.startswith("--") or tokens[:1] == ["sage-patch"] or ENV.match(s):
        return problems
    node = re.fullmatch(rf"([\w./-]+\.py)::({IDENT})", s)
    if node:
        path = ROOT / node.group(1)
        if not path.exists():
            return [f"{s}: no file {node.group(1)}"]
        names = {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, (ast.FunctionDef,
                                                                                         ast.ClassDef))}
        return [] if node.group(2) in names else [f"{s}: {node.group(1)} defines no {node.group(2)}"]
    op = re.fullmatch(rf"({IDENT})::({IDENT})", s)
    if op:
        if op.group(1) in tree.classes:
            return [] if tree._class_has(*op.groups()) is not False else [f"{s}: no member {op.group(2)!r}"]
        return [] if s in tree.literals else [f"{s}: no op of that name in the source"]
    if _is_path(s):
        why = _check_path(tree, s, doc)
        return [why] if why else []
    m = DOTTED.match(s)
    if not m or " " in m.group(1):
        return problems
    parts = m.group(1).split(".")
    if len(parts) > 1:
        why = tree.resolve(parts)
        return problems + ([why] if why else [])
    name = parts[0]
    if _name_wanted(name) and not tree.defines(name) and name not in UPSTREAM:
        problems.append(f"{name}: defined nowhere in the tree (and not in UPSTREAM)")
    return problems


def check_fenced(tree: Tree, line: str, doc: Path) -> list[str]:
    problems = []
    for m in re.finditer(rf"\bsage_patch(?:\.{IDENT})+", line):
        why = tree.resolve(m.group(0).split("."))
        if why:
            problems.append(why)
    imp = re.match(rf"\s*from\s+(sage_patch(?:\.{IDENT})*)\s+import\s+(.+)", line)
    if imp:
        for name in re.findall(IDENT, imp.group(2).split("#")[0]):
            if name != "as":
                why = tree.resolve([*imp.group(1).split("."), name])
                if why:
                    problems.append(why)
    problems += [f"{e}: no such environment variable in the source" for e in ENV.findall(line)
                 if e not in tree.source_text]
    code = line.split("#")[0]
    script = re.search(r"(?:^|\s)(sage-patch|(?:benchmarks|tools)/[\w/]+\.(?:py|sh))(?=\s|$)", code)
    if script:
        if script.group(1) != "sage-patch" and not (ROOT / script.group(1)).exists():
            problems.append(f"{script.group(1)}: no such script")
        problems += [f"{f}: no such option in the source" for f in FLAG.findall(code[script.end():])
                     if f not in tree.flags]
    return problems


def _own(span: str) -> bool:
    """In a foreign document: whether the span is one of this project's names."""
    s = span.strip()
    return (s.startswith(("sage_patch.", "sage-patch ", "--")) or ENV.search(s) is not None
            or (s.startswith(OWN_DIRS) and not s.startswith("tests/") or s.startswith("tests/upstream/")))


def _problems(tree: Tree, doc: Path) -> list[str]:
    text = doc.read_text()
    lines = text.splitlines()
    inline, fenced, links = _spans(text)
    rel = doc.relative_to(ROOT).as_posix()
    inline = [(no, s) for no, s in inline if not COMMIT.search(lines[no - 1]) and (rel not in FOREIGN or _own(s))]
    out = [f"{rel}:{no}: `{span}`: {p}" for no, span in inline for p in check_span(tree, span, doc)]
    out += [f"{rel}:{no}: (code block) {p}" for no, line in fenced for p in check_fenced(tree, line, doc)]
    out += [f"{rel}: link to {target}: no such file" for _, target in links
            if not re.match(r"[a-z]+:|#", target) and not (doc.parent / target.split("#")[0]).exists()]
    return out


@pytest.mark.parametrize("doc", _docs(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_cited_code_names_exist(tree, doc):
    problems = _problems(tree, doc)
    assert not problems, "code names cited in the docs that the tree does not have:\n" + "\n".join(problems)


def test_the_check_can_fail(tree, tmp_path):
    """The names this test was written to catch, and upstream names it must let through."""
    doc = tmp_path / "x.md"
    stale = ["sage_patch.kernels.SDPA_FASTER_BELOW", "SDPA_FASTER_BELOW", "SageAttnParams.pv_mode", "qk_mma",
             "sage_patch/routing.py", "sage_patch.router.inject", "registry.no_such_function", "--no-such-flag",
             "SAGE_PATCH_NO_SUCH_VAR=1", "tests/test_lifecycle.py::test_no_such_test", "sage_patch::no_such_op"]
    for s in stale:
        assert check_span(tree, s, doc), s
    fine = ["sage_patch.kernels.registry.select", "KernelVariant.sdpa_faster_below", "SageAttnParams.qk_bits",
            "F.scaled_dot_product_attention", "torch.compile", "set_attention_backend", "sage_patch.route_sdpa",
            "registry.KernelVariant(\"sagebwd-triton\")", "sage_patch/integrations/generic.py", "hopper/",
            "libsage_kernels.so", "pydoc_data/topics.py", "full", "8b", "min(Sq, Skv)", "q.shape",
            "SAGE_PATCH_SPEED_ROUTING=0", "sage_patch::sagebwd_fwd", "--min-cos 0.999"]
    for s in fine:
        assert not check_span(tree, s, doc), (s, check_span(tree, s, doc))
    assert check_fenced(tree, "from sage_patch.routing import route_sdpa", doc)
    assert check_fenced(tree, "sage-patch calibrate m --no-such-flag 1", doc)
    assert not check_fenced(tree, "pip install --no-deps x && sage-patch calibrate m --min-cos 0.99", doc)

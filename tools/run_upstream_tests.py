#!/usr/bin/env python
"""Run the libraries' own model tests with sage_patch on (policy "full") and without it, and compare.

    python tools/run_upstream_tests.py [--install] [--only transformers|diffusers] [--diffusers-src DIR]
                                       [--transformers-src DIR] [--keyword EXPR] [--full]

Sources of the upstream test files, at the versions pinned in tests/upstream/requirements.txt:
- transformers: the PyPI sdist (`pip download --no-binary :all:`) ships tests/test_modeling_common.py and the other
  common mixins, but not tests/models/* nor tests/generation/test_utils.py. The runner runs upstream's
  ModelTesterMixin on Llama, Mistral and Qwen2 through tests/upstream/sage_upstream_models.py (per-model glue and
  generation checks written here). With --transformers-src (a source checkout of the pinned tag) it runs
  tests/models/{llama,mistral,qwen2}/ from there instead.
- diffusers: the PyPI sdist ships no tests/models at all (only tests/testing_utils.py). With --diffusers-src (a
  folder holding a source checkout's tests/, e.g. `git archive HEAD tests | tar -x -C DIR`) it runs the model tests
  tests/models/transformers/test_models_transformer_{flux,sd3,cogvideox,hunyuan_video}.py (their LoRA, LoRA
  hot-swap and IP-Adapter classes included) and the pipeline LoRA tests tests/lora/test_lora_layers_{flux,sd3,
  cogvideox,hunyuanvideo}.py, whole files by default (what needs CUDA, a quantizer or the Hub skips itself or fails
  in both runs alike); without one it says so. Upstream's tests/conftest.py puts DIR/src first on sys.path: with a
  full checkout the tests import that library, with tests/ alone the installed one (summary.json names it).

Each selected suite runs twice in a subprocess: with `-p sage_upstream_plugin` (sage at policy full on every model
built; calls counted) and with the plugin off (baseline). Exit 1 when a test that passes without the plugin fails
with it, or when the plugin run sent no attention call through sage_patch. The last line is
"upstream: N passed, N failed" for the plugin run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UPSTREAM = ROOT / "tests" / "upstream"
PINS = UPSTREAM / "requirements.txt"

# Default selection: upstream's common model tests minus the groups that take long on 2 CPU cores and exercise
# nothing of the attention path (hub, multi-device, quantization, torch.export, 1000-step training loops).
TRANSFORMERS_DESELECT = ("not multi_gpu and not parallel and not offload and not disk and not tp_ and "
                         "not torch_export and not fsdp and not deepspeed and not bnb and not hub and "
                         "not flash_attn and not flex and not kernels")
# CI (--ci): also leave out the groups that are slowest with the plugin on 2 cores (gradient checkpointing and
# training loops, output-equivalence sweeps, embedding resizing), which run attention as the kept tests do.
TRANSFORMERS_CI_DESELECT = (TRANSFORMERS_DESELECT + " and not gradient_checkpointing and not training and not "
                            "outputs_equivalence and not resize_tokens and not require_grads")
DIFFUSERS_FILES = tuple(f"tests/models/transformers/test_models_transformer_{m}.py"
                        for m in ("flux", "sd3", "cogvideox", "hunyuan_video")) + tuple(
                  f"tests/lora/test_lora_layers_{m}.py" for m in ("flux", "sd3", "cogvideox", "hunyuanvideo"))
# A smaller diffusers selection (--keyword "$DIFFUSERS_DESELECT"-style); by default the whole files run (about
# 2 minutes per run on 2 cores: the groups below skip themselves on CPU).
DIFFUSERS_DESELECT = ("not compile and not cuda and not gpu and not parallel and not offload and not quant and "
                      "not gguf and not single_file and not hub and not memory and not cache")


def pins() -> dict:
    out = {}
    for line in PINS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, ver = line.partition("==")
            out[name.strip()] = ver.strip()
    return out


def check_versions(pinned: dict, install: bool) -> None:
    wrong = {}
    for name, ver in pinned.items():
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            have = None
        if have != ver:
            wrong[name] = have
    if wrong and install:
        print(f"installing the pinned versions ({', '.join(f'{n}=={pinned[n]}' for n in wrong)})", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-r", str(PINS)], check=True)
    elif wrong:
        sys.exit(f"run_upstream_tests: installed {wrong} differ from the pins in {PINS} "
                 f"({', '.join(f'{n}=={pinned[n]}' for n in wrong)}); pass --install or install them")


def sdist_tests(name: str, ver: str, cache: Path) -> Path:
    """<cache>/src/<name>-<ver>/ holding the sdist's tests/ folder (downloaded once)."""
    dest = cache / "src" / f"{name}-{ver}"
    if (dest / ".complete").exists():
        return dest
    archive = cache / f"{name}-{ver}.tar.gz"
    if not archive.exists():
        print(f"downloading the {name}=={ver} sdist from the package index", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        "--no-build-isolation", f"{name}=={ver}", "-d", str(cache)], check=True)
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    prefix = f"{name}-{ver}/tests/"
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix) and (m.isfile() or m.isdir())]
        for m in members:
            m.name = m.name[len(f"{name}-{ver}/"):]
        tar.extractall(dest, members=members, filter="data")
    (dest / ".complete").write_text("")
    return dest


def prepare_transformers(src: Path) -> list[str]:
    """Lay our glue module and the two stand-ins next to upstream's mixins; return the pytest targets."""
    tests = src / "tests"
    for pkg in ("", "models", "models/sage_upstream", "generation", "exporters", "utils"):
        (tests / pkg).mkdir(parents=True, exist_ok=True)
        init = tests / pkg / "__init__.py"
        if not init.exists():
            init.write_text("")
    # stand-ins are stored under names pytest does not collect in this repository's own suite
    for stub in ("generation/test_utils.py", "exporters/test_export.py"):
        if not (tests / stub).exists() or (tests / stub).read_text().startswith('"""Stand-in'):
            shutil.copy(UPSTREAM / "stubs" / stub.replace("/", "_"), tests / stub)
    shutil.copy(UPSTREAM / "sage_upstream_models.py", tests / "models" / "sage_upstream" / "test_sage_upstream_models.py")
    return ["tests/models/sage_upstream/test_sage_upstream_models.py"]


def run_pytest(cwd: Path, targets: list, keyword: str | None, plugin_on: bool, out: Path, timeout: int) -> dict:
    tag = "on" if plugin_on else "off"
    junit, counts = out / f"junit-{tag}.xml", out / f"counts-{tag}.json"
    env = dict(os.environ, SAGE_UPSTREAM_PLUGIN="1" if plugin_on else "0", SAGE_UPSTREAM_COUNTS=str(counts),
               PYTHONPATH=os.pathsep.join([str(UPSTREAM), str(cwd), os.environ.get("PYTHONPATH", "")]),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "sage_upstream_plugin", "-p", "no:cacheprovider",
           "--rootdir", str(cwd), "-o", "addopts=", "--junitxml", str(junit), *targets]
    if keyword:
        cmd += ["-k", keyword]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    (out / f"pytest-{tag}.log").write_text(proc.stdout + proc.stderr)
    result = {"seconds": round(time.time() - t0, 1), "rc": proc.returncode, "outcomes": {}, "counts": {}}
    if junit.exists():
        for case in ET.parse(junit).getroot().iter("testcase"):
            name = f"{case.get('classname')}::{case.get('name')}"
            kinds = {child.tag for child in case}
            result["outcomes"][name] = ("failed" if kinds & {"failure", "error"} else
                                        "skipped" if "skipped" in kinds else "passed")
    if counts.exists():
        result["counts"] = json.loads(counts.read_text())
    tail = (proc.stdout.strip().splitlines() or [""])[-1]
    print(f"  plugin {tag}: {tail}  ({result['seconds']} s)", flush=True)
    return result


def summarize(suite: str, on: dict, off: dict) -> tuple[int, list]:
    def tally(r):
        vals = list(r["outcomes"].values())
        return {k: vals.count(k) for k in ("passed", "failed", "skipped")}

    t_on, t_off = tally(on), tally(off)
    expected = {line.split("#", 1)[0].strip() for line in (UPSTREAM / "expected_failures.txt").read_text().splitlines()}
    expected.discard("")
    only_on = sorted(n for n, o in on["outcomes"].items() if o == "failed" and off["outcomes"].get(n) == "passed")
    regressions = [n for n in only_on if n.split("::")[-1] not in expected]
    print(f"{suite}: with the plugin {t_on}, without {t_off}; sage_patch calls: {on['counts']}")
    for n in only_on:
        if n not in regressions:
            print(f"  expected with the plugin (tests/upstream/expected_failures.txt): {n}")
    for n in regressions:
        print(f"  REGRESSION (passes without the plugin, fails with it): {n}")
    return t_on["passed"], regressions


def per_file(on: dict, off: dict) -> dict:
    """{test module: {"with": tally, "without": tally}} from the junit class names (module.Class)."""
    out: dict = {}
    for tag, r in (("with", on), ("without", off)):
        for name, outcome in r["outcomes"].items():
            cls = name.split("::")[0]
            parts = cls.split(".")
            mod = next((".".join(parts[:i + 1]) for i in range(len(parts) - 1, -1, -1)
                        if parts[i].startswith("test_")), cls)
            t = out.setdefault(mod, {"with": {}, "without": {}})[tag]
            t[outcome] = t.get(outcome, 0) + 1
    for mod, t in sorted(out.items()):
        print(f"  {mod}: with the plugin {t['with']}, without {t['without']}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--install", action="store_true", help="pip install the pinned versions if others are installed")
    ap.add_argument("--only", choices=("transformers", "diffusers"))
    ap.add_argument("--transformers-src", type=Path, help="a source checkout of the pinned transformers tag")
    ap.add_argument("--diffusers-src", type=Path, help="a source checkout of the pinned diffusers tag")
    ap.add_argument("--keyword", help="pytest -k expression (default: the curated transformers selection; diffusers: the whole files)")
    ap.add_argument("--ci", action="store_true", help="the smaller selection CI runs (about 5 minutes on 2 cores)")
    ap.add_argument("--cache", type=Path, default=Path(os.environ.get(
        "SAGE_UPSTREAM_CACHE", Path.home() / ".cache" / "sage_patch" / "upstream")))
    ap.add_argument("--out", type=Path, default=None, help="folder for logs, junit files and summary.json")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per pytest run")
    args = ap.parse_args(argv)

    pinned = pins()
    check_versions(pinned, args.install)
    args.cache.mkdir(parents=True, exist_ok=True)
    out_root = args.out or (args.cache / "runs" / time.strftime("%Y%m%d-%H%M%S"))
    summary, failed, passed, regressions = {}, 0, 0, []

    suites = []
    if args.only in (None, "transformers"):
        if args.transformers_src:
            src = args.transformers_src
            targets = [f"tests/models/{m}" for m in ("llama", "mistral", "qwen2")]
        else:
            src = sdist_tests("transformers", pinned["transformers"], args.cache)
            targets = prepare_transformers(src)
        suites.append(("transformers", src, targets, args.keyword or (TRANSFORMERS_CI_DESELECT if args.ci else TRANSFORMERS_DESELECT), "transformers_calls"))
    if args.only in (None, "diffusers"):
        if args.diffusers_src:
            src = args.diffusers_src.resolve()
            targets = [f for f in DIFFUSERS_FILES if (src / f).is_file()]
            missing = sorted(set(DIFFUSERS_FILES) - set(targets))
            if missing:
                print(f"diffusers: not in {src}: {missing}", flush=True)
            if not targets:
                sys.exit(f"run_upstream_tests: --diffusers-src {src} holds none of {list(DIFFUSERS_FILES)}")
            suites.append(("diffusers", src, targets, args.keyword, "diffusers_calls"))
        else:
            src = sdist_tests("diffusers", pinned["diffusers"], args.cache)
            shipped = sorted(p.relative_to(src).as_posix() for p in (src / "tests").rglob("*.py"))
            print(f"diffusers: the PyPI sdist of diffusers=={pinned['diffusers']} ships no model tests "
                  f"(its tests/ holds only {shipped}); pass --diffusers-src with a source checkout of the tag "
                  f"to run tests/models/transformers/ for Flux, SD3, CogVideoX and HunyuanVideo")
            summary["diffusers"] = {"ran": False, "reason": "no model tests in the PyPI sdist"}

    for suite, src, targets, keyword, counter in suites:
        out = out_root / suite
        out.mkdir(parents=True, exist_ok=True)
        print(f"{suite}=={pinned[suite]}: {' '.join(targets)}" + (f" -k '{keyword}'" if keyword else ""), flush=True)
        on = run_pytest(src, targets, keyword, True, out, args.timeout)
        off = run_pytest(src, targets, keyword, False, out, args.timeout)
        n_pass, regs = summarize(suite, on, off)
        calls = on["counts"].get(counter, 0)
        if not on["outcomes"]:
            print(f"{suite}: no test ran (see {out}/pytest-on.log)")
            regs = regs + ["<no test ran>"]
        if calls == 0:
            print(f"{suite}: the plugin sent no attention call through sage_patch: it was not active")
            regs = regs + ["<plugin inactive>"]
        if off["counts"].get(counter, 0) != 0:
            regs = regs + ["<baseline went through sage_patch>"]
        passed += n_pass
        failed += len(regs)
        regressions += [f"{suite}: {r}" for r in regs]
        summary[suite] = {"ran": True, "targets": targets, "keyword": keyword,
                          "with_plugin": {k: v for k, v in on.items() if k != "outcomes"},
                          "without_plugin": {k: v for k, v in off.items() if k != "outcomes"},
                          "tally_with": {k: list(on["outcomes"].values()).count(k) for k in ("passed", "failed", "skipped")},
                          "tally_without": {k: list(off["outcomes"].values()).count(k) for k in ("passed", "failed", "skipped")},
                          "per_file": per_file(on, off), "regressions": regs}
    out_root.mkdir(parents=True, exist_ok=True)
    (out_root / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(f"details: {out_root}")
    # "passed": tests that pass with the plugin; "failed": regressions against the baseline (0 wanted)
    print(f"upstream: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

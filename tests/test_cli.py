"""The sage-patch command line."""
import subprocess
import sys

from sage_patch.cli import main


def test_validate_good_and_bad(tmp_path, capsys):
    assert main(["validate", "configs/flux.yaml"]) == 0
    assert "valid policy" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("default: 8b\nlayers:\n  - index: 'x'\n    precision: full\n")
    assert main(["validate", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "layers[0].index" in err and "line 3" in err


def test_info_says_why_kernels_are_missing(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "kernels:" in out
    assert "not loaded:" in out or "loaded from" in out


def test_info_shows_speed_routing(capsys, monkeypatch):
    import sage_patch.kernels as K

    monkeypatch.setattr(K, "SPEED_ROUTING", True)
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"speed routing: {K.IMPL_WGMMA}" in out and "D=128 < 2048" in out and "D=128 causal < 2560" in out
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
    r = subprocess.run([exe, "validate", "configs/llama.yaml"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr

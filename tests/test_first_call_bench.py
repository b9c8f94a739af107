"""benchmarks/first_call.py on CPU: fresh processes per package version and the torch SDPA peer, the JSON it
writes, the section benchmarks/report.py renders from it, and its argument check."""
from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import first_call  # noqa: E402
import report  # noqa: E402


def test_one_repeat_end_to_end(tmp_path):
    out = tmp_path / "fc.json"
    assert first_call.main(["--reps", "1", "--tokens", "64", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["kind"] == "first_call" and [r["row"] for r in data["rows"]] == ["current", "torch SDPA"]
    ours, peer = data["rows"]
    assert all(ours[k] > 0 for k in ("torch", "import", "first", "second")) and peer["first"] > 0
    assert ours["impl"] == ["reference"] or "reference" in ours["impl"]
    assert ours["imported"] == []  # the first call imports no compiler, Triton or integration library
    text = "\n".join(report.render_first_call(data))
    assert "| current |" in text and "| torch SDPA |" in text and "first call s" in text


def test_a_tree_without_the_package_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        first_call.main(["--tree", f"old={tmp_path}"])

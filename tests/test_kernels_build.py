"""CPU-side tests of the kernel build hook and the loader (no GPU needed)."""
from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import shutil

import pytest
import torch

import sage_patch.kernels as K
from sage_patch.kernels import _lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _build_module():
    spec = importlib.util.spec_from_file_location("build_kernels", os.path.join(ROOT, "kernels_cuda", "build_kernels.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def bk():
    return _build_module()


@pytest.fixture
def fresh_lib(monkeypatch):
    """Reload the library state under a modified environment, restore it afterwards."""
    _lib.reset()
    K._STATUS_CACHE.clear()
    yield monkeypatch
    monkeypatch.undo()
    _lib.reset()
    K._STATUS_CACHE.clear()


def test_parse_archs(bk):
    default = ["80", "86", "89", "90a", "100", "120", "compute_120"]
    assert bk.parse_archs(None) == default and bk.parse_archs("") == default
    assert bk.parse_archs("90a") == ["90a"]
    assert bk.parse_archs("80;90a") == ["80", "90a"]
    assert bk.parse_archs("8.0, 9.0a sm_89") == ["80", "90a", "89"]
    assert bk.parse_archs("sm_120 compute_90") == ["120", "compute_90"]  # compute_*: PTX, not SASS
    for bad in ("75", "compute_90a", "sm_110"):
        with pytest.raises(ValueError, match="SAGE_PATCH_CUDA_ARCHS.*allowed"):
            bk.parse_archs(bad)


def test_gencode_flags(bk):
    assert bk.gencode_flags(["80", "90a"]) == ["-gencode=arch=compute_80,code=sm_80",
                                               "-gencode=arch=compute_90a,code=sm_90a"]
    assert bk.gencode_flags(["120", "compute_120"]) == ["-gencode=arch=compute_120,code=sm_120",
                                                        "-gencode=arch=compute_120,code=compute_120"]
    compiles, link = bk.nvcc_commands("nvcc", ["90a"], "/tmp/x.so", "/tmp/o", threads=2)
    for cmd in compiles:
        assert "-c" in cmd and "all-warnings" in cmd and "-Werror" in cmd
    assert "-shared" in link
    assert not any("torch" in c for c in sum(compiles, link))  # plain C ABI: never links libtorch


def test_one_translation_unit_per_arch_family(bk):
    """The portable path for every target, the Hopper path for sm_90a only (and only when it is a target)."""
    compiles, _ = bk.nvcc_commands("nvcc", bk.DEFAULT_ARCHS, "/tmp/x.so", "/tmp/o")
    by_src = {os.path.relpath(c[-1], os.path.join(ROOT, "kernels_cuda")): c for c in compiles}
    assert set(by_src) == {"sage_api.cpp", os.path.join("portable", "launch.cu"), os.path.join("hopper", "launch.cu"),
                           os.path.join("hopper", "bwd_launch.cu"), os.path.join("hopper", "fwd_train_launch.cu")}
    for unit in ("launch.cu", "bwd_launch.cu", "fwd_train_launch.cu"):
        hop = [f for f in by_src[os.path.join("hopper", unit)] if f.startswith("-gencode")]
        assert hop == ["-gencode=arch=compute_90a,code=sm_90a"]
    portable = [f for f in by_src[os.path.join("portable", "launch.cu")] if f.startswith("-gencode")]
    assert portable == bk.gencode_flags(bk.DEFAULT_ARCHS) and "code=compute_120" in portable[-1]
    assert not any(f.startswith("-gencode") for f in by_src["sage_api.cpp"])
    assert "-DSAGE_WITH_HOPPER=1" in by_src["sage_api.cpp"]
    assert '-DSAGE_ARCHS="80 86 89 90a 100 120 compute_120"' in by_src["sage_api.cpp"]
    compiles, _ = bk.nvcc_commands("nvcc", ["80", "89"], "/tmp/x.so", "/tmp/o")
    assert len(compiles) == 2 and "-DSAGE_WITH_HOPPER=0" in compiles[0]
    # the PTX-only build (JIT tests): no SASS anywhere, and no Hopper unit (wgmma needs sm_90a SASS)
    compiles, _ = bk.nvcc_commands("nvcc", ["compute_90"], "/tmp/x.so", "/tmp/o")
    flags = [f for c in compiles for f in c if f.startswith("-gencode")]
    assert flags == ["-gencode=arch=compute_90,code=compute_90"] and "-DSAGE_WITH_HOPPER=0" in compiles[0]


def test_build_skipped_by_env(bk, tmp_path, build_env, capsys):
    monkeypatch = build_env
    monkeypatch.setenv("SAGE_PATCH_NO_KERNELS", "1")
    assert bk.build_into(str(tmp_path / "a"), inplace_dir=str(tmp_path / "b")) is None
    assert "SAGE_PATCH_NO_KERNELS" in capsys.readouterr().err
    assert not (tmp_path / "a" / "libsage_kernels.so").exists()


@pytest.fixture
def build_env(monkeypatch):
    for var in ("SAGE_PATCH_NO_KERNELS", "SAGE_PATCH_KERNELS_REQUIRED", "SAGE_PATCH_KERNELS", "SAGE_PATCH_CUDA_ARCHS",
                "SAGE_PATCH_PREBUILT_LIBRARY"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_build_without_nvcc_warns_unless_required(bk, tmp_path, build_env, capsys):
    build_env.setattr(bk, "find_nvcc", lambda: None)
    assert bk.build(str(tmp_path)) is None
    assert "WARNING" in capsys.readouterr().err
    for var, value in (("SAGE_PATCH_KERNELS_REQUIRED", "1"), ("SAGE_PATCH_KERNELS", "required")):
        with build_env.context() as m:
            m.setenv(var, value)
            with pytest.raises(bk.KernelBuildError, match="(?s)nvcc not found.*SAGE_PATCH_KERNELS=optional"):
                bk.build(str(tmp_path))


def _fake_nvcc(tmp_path):
    nvcc = tmp_path / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'fake nvcc: error: this compiler rejects everything' >&2\nexit 3\n")
    nvcc.chmod(0o755)
    return str(nvcc)


def test_failed_compile_is_an_error_unless_optional(bk, tmp_path, build_env, capsys):
    build_env.setenv("SAGE_PATCH_NVCC", _fake_nvcc(tmp_path))
    for mode in ("", "auto", "required"):
        build_env.setenv("SAGE_PATCH_KERNELS", mode)
        with pytest.raises(bk.KernelBuildError) as e:
            bk.build(str(tmp_path / "out"))
        assert "nvcc failed (exit 3)" in str(e.value) and "SAGE_PATCH_KERNELS=optional" in str(e.value)
        assert "rejects everything" in capsys.readouterr().err  # the compiler's own message is shown
    build_env.setenv("SAGE_PATCH_KERNELS", "optional")
    assert bk.build(str(tmp_path / "out")) is None
    assert "WITHOUT the CUDA kernels" in capsys.readouterr().err
    assert not (tmp_path / "out" / "libsage_kernels.so").exists()


def test_a_pip_build_says_in_one_line_that_it_compiles_and_how_long(bk, tmp_path, build_env, capsys):
    """pip hides the backend's output (without -v): the build tells the user's terminal itself, one line."""
    import io

    tty = io.StringIO()
    tty.close = lambda: None  # read after the build
    build_env.setattr(bk.sys.stderr, "isatty", lambda: False, raising=False)
    build_env.setattr(bk, "open", lambda path, mode: tty if path == "/dev/tty" else open(path, mode), raising=False)
    nvcc = tmp_path / "nvcc"  # makes its -o file
    nvcc.write_text('#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && : > "$2"; shift; done\n')
    nvcc.chmod(0o755)
    build_env.setenv("SAGE_PATCH_NVCC", str(nvcc))
    assert bk.build(str(tmp_path / "out"), archs=["80", "90a"])
    line = tty.getvalue()
    assert line.strip().count("\n") == 0 and line.endswith("\n"), line
    assert "compiling the CUDA kernel library for 80 90a" in line and re.search(r"\.\.\. done in \d+ s$", line.strip())
    assert "compiled the CUDA kernel library in " in capsys.readouterr().err  # and the build log has its own lines

    tty.seek(0), tty.truncate()
    build_env.setenv("SAGE_PATCH_NVCC", _fake_nvcc(tmp_path))
    with pytest.raises(bk.KernelBuildError):
        bk.build(str(tmp_path / "out"), archs=["90a"])
    assert re.search(r"compiling the CUDA kernel library for 90a .*\.\.\. failed after \d+ s$", tty.getvalue().strip())


def test_kernels_mode_rejects_bad_values(bk, build_env):
    build_env.setenv("SAGE_PATCH_KERNELS", "sometimes")
    with pytest.raises(ValueError, match="SAGE_PATCH_KERNELS='sometimes': allowed auto, required, optional"):
        bk.kernels_mode()
    build_env.setenv("SAGE_PATCH_KERNELS", "optional")
    build_env.setenv("SAGE_PATCH_KERNELS_REQUIRED", "1")
    with pytest.raises(ValueError, match="contradicts"):
        bk.kernels_mode()
    build_env.setenv("SAGE_PATCH_KERNELS", "")
    assert bk.kernels_mode() == "required"


def test_prebuilt_library_must_hold_the_targets(bk, tmp_path, build_env, monkeypatch):
    lib = tmp_path / "libsage_kernels.so"
    lib.write_bytes(b"x")
    monkeypatch.setattr(bk, "library_targets", lambda path: ["80", "90a"])
    build_env.setenv("SAGE_PATCH_PREBUILT_LIBRARY", str(lib))
    with pytest.raises(bk.KernelBuildError, match="holds 80 90a, this build wants 80 86 89 90a 100 120 compute_120"):
        bk.build_into(str(tmp_path / "build"))
    build_env.setenv("SAGE_PATCH_CUDA_ARCHS", "90a;80")
    assert bk.build_into(str(tmp_path / "build")) == str(tmp_path / "build" / "libsage_kernels.so")
    assert (tmp_path / "build" / "libsage_kernels.so").read_bytes() == b"x"
    build_env.setenv("SAGE_PATCH_PREBUILT_LIBRARY", str(tmp_path / "missing.so"))
    with pytest.raises(bk.KernelBuildError, match="no such file"):
        bk.build_into(str(tmp_path / "build"))


def test_status_explains_missing_library(fresh_lib, tmp_path):
    fresh_lib.delenv("SAGE_PATCH_NO_KERNELS", raising=False)
    fresh_lib.setenv("SAGE_PATCH_KERNELS_LIB", str(tmp_path / "libsage_kernels.so"))
    st = K.status()
    assert st["loaded"] is False and "not found" in st["reason"] and st["archs"] == []
    q = torch.zeros(1, 1, 4, 64, dtype=torch.float16)
    impl, why = K.can_run("8b", q, q, q, layout="bhsd", is_causal=False, attn_mask=None, return_lse=False,
                          smooth_v=False)
    assert impl is None and "not found" in why


def test_status_disabled_by_env(fresh_lib):
    fresh_lib.setenv("SAGE_PATCH_NO_KERNELS", "1")
    st = K.status()
    assert st["loaded"] is False and "SAGE_PATCH_NO_KERNELS" in st["reason"]


def test_status_bad_library(fresh_lib, tmp_path):
    bad = tmp_path / "libsage_kernels.so"
    bad.write_bytes(b"not an ELF file")
    fresh_lib.delenv("SAGE_PATCH_NO_KERNELS", raising=False)
    fresh_lib.setenv("SAGE_PATCH_KERNELS_LIB", str(bad))
    st = K.status()
    assert st["loaded"] is False and "could not load" in st["reason"]


def test_arch_compatibility():
    assert K.arch_supported(["80"], 8, 6) and K.arch_supported(["86"], 8, 9)
    assert not K.arch_supported(["86"], 8, 0)
    assert K.arch_supported(["90a"], 9, 0) and not K.arch_supported(["90a"], 10, 0)
    assert not K.arch_supported(["80", "86", "89", "90a"], 12, 0)


@pytest.mark.parametrize("cc, image", [
    ((8, 0), "sm_80"), ((8, 7), "sm_86"), ((8, 9), "sm_89"), ((9, 0), "sm_90a"), ((10, 0), "sm_100"),
    ((10, 3), "sm_100"), ((12, 0), "sm_120"), ((12, 1), "sm_120"),
    ((13, 0), "compute_120"),   # newer than every SASS target: the driver JIT-compiles the PTX
    ((11, 0), None),            # no SASS of major 11, and PTX compute_120 does not run below 12.0
    ((7, 5), None),
])
def test_arch_image_of_the_default_build(cc, image):
    archs = ["80", "86", "89", "90a", "100", "120", "compute_120"]
    assert _lib.arch_image(archs, *cc) == image
    assert K.arch_supported(archs, *cc) is (image is not None)


def test_arch_image_ptx_only():
    assert _lib.arch_image(["compute_90"], 9, 0) == "compute_90"
    assert _lib.arch_image(["compute_80", "compute_90"], 9, 0) == "compute_90"   # the newest PTX that fits
    assert _lib.arch_image(["compute_80", "compute_90"], 8, 6) == "compute_80"
    assert _lib.arch_image(["compute_90"], 8, 9) is None                          # PTX never runs on an older GPU
    assert _lib.arch_image(["compute_80", "90a"], 9, 0) == "sm_90a"              # SASS first
    assert _lib.target_cc("compute_120") == (12, 0) and _lib.target_cc("90a") == (9, 0)


def test_fp4_and_4b_reasons():
    q = torch.zeros(1, 1, 4, 64, dtype=torch.float16)
    impl, why = K.can_run("fp4", q, q, q, layout="bhsd", is_causal=False, attn_mask=None, return_lse=False,
                          smooth_v=False)
    assert impl is None and "Blackwell" in why
    # "4b" and smooth_v have a kernel: on a CPU tensor the reason is the device/library, not the precision
    for prec, sv in (("4b", False), ("8b", True), ("4b", True)):
        impl, why = K.can_run(prec, q, q, q, layout="bhsd", is_causal=False, attn_mask=None, return_lse=False,
                              smooth_v=sv)
        assert impl is None and why and "precision" not in why and "smooth_v" not in why


def test_disabled_features_are_refused_with_their_reason(monkeypatch):
    q = torch.zeros(1, 1, 4, 64, dtype=torch.float16)
    monkeypatch.setitem(K.DISABLED, "4b", "4b: disabled (test)")
    monkeypatch.setitem(K.DISABLED, "smooth_v", "smooth_v: disabled (test)")
    monkeypatch.setitem(K.DISABLED, "varlen", "varlen: disabled (test)")
    kw = dict(layout="bhsd", is_causal=False, attn_mask=None, return_lse=False)
    assert K.can_run("4b", q, q, q, smooth_v=False, **kw) == (None, "4b: disabled (test)")
    assert K.can_run("8b", q, q, q, smooth_v=True, **kw) == (None, "smooth_v: disabled (test)")
    q3 = q[0].transpose(0, 1)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    assert K.can_run_varlen("8b", q3, q3, q3, cu, cu) == (None, "varlen: disabled (test)")
    assert K.can_run_varlen("fp4", q3, q3, q3, cu, cu)[0] is None


def test_varlen_can_run_reasons_on_cpu():
    q3 = torch.zeros(4, 2, 64, dtype=torch.float16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    impl, why = K.can_run_varlen("8b", q3, q3, q3, cu, cu)
    assert impl is None and why


def test_reference_config_4b_smoothing_block():
    cfg = K.reference_config(K.IMPL_FP8PV, 64)
    assert cfg.q_smooth_block == 4 * K.registry.PORTABLE_Q_GROUP_ROWS


def test_reference_config_matches_kernel_layout():
    cfg = K.reference_config(K.IMPL_FP8PV, 128)
    assert (cfg.q_group.tile, cfg.q_group.mod, cfg.q_group.div) == (K.registry.PORTABLE_Q_GROUP_ROWS, 8, 1)
    assert (cfg.k_group.tile, cfg.k_group.mod, cfg.k_group.div) == (64, 8, 2)
    assert cfg.block_k == 64 and cfg.pv == "fp8"
    assert K.reference_config(K.IMPL_FP16PV).pv == "fp16"


@pytest.mark.parametrize("bshd", [False, True])
def test_custom_op_fake_shapes(bshd):
    """The fake (meta) implementation gives torch.compile the right output shapes without running anything."""
    shape_q = (2, 7, 4, 64) if bshd else (2, 4, 7, 64)
    shape_k = (2, 9, 2, 64) if bshd else (2, 2, 9, 64)
    q = torch.empty(shape_q, dtype=torch.bfloat16, device="meta")
    k = torch.empty(shape_k, dtype=torch.bfloat16, device="meta")
    out, lse = torch.ops.sage_patch.attn(q, k, k, None, bshd, True, 0.125, 2, 8, False, True)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device.type == "meta"
    assert lse.shape == (2, 4, 7) and lse.dtype == torch.float32
    out, lse = torch.ops.sage_patch.attn(q, k, k, None, bshd, False, 0.125, 6, 4, True, True)
    assert out.shape == q.shape and lse.shape == (2, 4, 7)
    out, lse = torch.ops.sage_patch.attn(q, k, k, None, bshd, False, 0.125, 2, 8, False, False, 2)
    assert out.shape == q.shape and lse.shape == (0,)  # no LSE wanted


def test_custom_op_varlen_fake_shapes():
    q = torch.empty(11, 4, 128, dtype=torch.float16, device="meta")
    k = torch.empty(13, 2, 128, dtype=torch.float16, device="meta")
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    out, lse = torch.ops.sage_patch.attn_varlen(q, k, k, cu, cu, 8, 9, True, 0.1, 2, 8, False, True)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (4, 11) and lse.dtype == torch.float32
    assert torch.ops.sage_patch.attn_varlen(q, k, k, cu, cu, 8, 9, True, 0.1, 2, 8, False, False)[1].shape == (0,)


def _built_library():
    for p in (os.environ.get("SAGE_PATCH_KERNELS_LIB"), os.path.join(ROOT, "sage_patch", "kernels", _lib.LIB_NAME)):
        if p and os.path.isfile(p):
            return p
    return None


@pytest.mark.skipif(_built_library() is None, reason="libsage_kernels.so not built here")
def test_library_abi_without_gpu():
    """The .so loads without a GPU (static cudart, no libtorch) and its host-side entry points answer."""
    h = ctypes.CDLL(_built_library())
    h.sage_abi_version.restype = ctypes.c_int
    assert h.sage_abi_version() == _lib.ABI_VERSION
    h.sage_compiled_archs.restype = ctypes.c_char_p
    assert h.sage_compiled_archs().decode().split()
    h.sage_attn_workspace_bytes.restype = ctypes.c_int64
    p = _lib.SageAttnParams()
    p.B, p.Hq, p.Hkv, p.Sq, p.Skv, p.D = 2, 8, 2, 100, 130, 128
    assert h.sage_attn_workspace_bytes(ctypes.byref(p)) > 2 * 8 * 128 * 128
    h.sage_attn_fwd.restype = ctypes.c_int
    assert h.sage_attn_fwd(ctypes.byref(p), None) == -1  # null pointers: rejected before touching CUDA
    p.qk_bits = 4
    assert h.sage_attn_workspace_bytes(ctypes.byref(p)) > 2 * 8 * 130 * 4  # + the Delta S table
    h.sage_error_string.restype = ctypes.c_char_p
    assert b"head dim" in h.sage_error_string(-3)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None and not os.path.exists("/usr/local/cuda/bin/nvcc"),
                    reason="no nvcc")
def test_compiles_one_arch(bk, tmp_path, monkeypatch):
    monkeypatch.delenv("SAGE_PATCH_NO_KERNELS", raising=False)
    path = bk.build(str(tmp_path), archs=["90a"])
    assert path and os.path.getsize(path) > 100_000


def test_build_into_drops_stale_library(bk, tmp_path, build_env):
    """A library left in the source tree must not be shipped by a build that did not make it."""
    monkeypatch = build_env
    monkeypatch.setenv("SAGE_PATCH_NO_KERNELS", "1")
    build_lib = tmp_path / "build_lib"
    build_lib.mkdir()
    (build_lib / "libsage_kernels.so").write_bytes(b"stale")
    assert bk.build_into(str(build_lib), inplace_dir=str(tmp_path / "src")) is None
    assert not (build_lib / "libsage_kernels.so").exists()
    assert bk.will_build() is False


@pytest.mark.skipif(_built_library() is None, reason="libsage_kernels.so not built here")
def test_workspace_layout_sizes_pinned():
    """The workspace carve-ups (WsCarver sequences in portable/traits.cuh, hopper/launch.cu) size exactly as the
    layouts they replaced: byte counts of the library before the change, for "8b" FP8 / FP16 P~V, "4b" (+ Delta S)
    and the Hopper kernel with a key-padding mask (causal: never split, so no SM count enters)."""
    h = ctypes.CDLL(_built_library())
    h.sage_attn_workspace_bytes.restype = ctypes.c_int64
    kmask = (ctypes.c_uint8 * 8)()
    cases = [(dict(kernel=0, qk_bits=8), 487680),  # the sum of 12 regions, each 256-aligned (see the layout)
             (dict(kernel=1, qk_bits=8), 585984),
             (dict(kernel=4, qk_bits=4), 327936)]
    if h.sage_hopper_compiled():
        cases.append((dict(kernel=3, qk_bits=8, causal=1, device_cc=90, kmask=1), 269312))
    for fields, expected in cases:
        p = _lib.SageAttnParams()
        p.B, p.Hq, p.Hkv, p.Sq, p.Skv, p.D = 2, 8, 2, 100, 130, 128
        for name, value in fields.items():
            setattr(p, name, ctypes.cast(kmask, ctypes.c_void_p).value if name == "kmask" else value)
        assert h.sage_attn_workspace_bytes(ctypes.byref(p)) == expected, fields


def test_portable_q_group_rows_is_the_kernels_warp_rows():
    """The reference layout's Q groups (registry.portable_q_group_rows) are the portable kernel's warp tile: what
    warp_rows() returns in kernels_cuda/portable/traits.cuh (the library no longer exports it), per head dim."""
    import re

    src = open(os.path.join(ROOT, "kernels_cuda", "portable", "traits.cuh")).read()
    m = re.search(r"constexpr int warp_rows\(int D\) \{ return D > (\d+) \? (\d+) : (\d+); \}", src)
    assert m, "warp_rows() changed form: update registry.portable_q_group_rows and this test"
    above, wide, narrow = (int(x) for x in m.groups())
    for d in K.registry.NATIVE_HEAD_DIMS:
        assert K.registry.portable_q_group_rows(d) == (wide if d > above else narrow), d
        assert K.reference_config(K.IMPL_FP8PV, d).q_group.tile == K.registry.portable_q_group_rows(d)
    assert K.registry.portable_q_group_rows(256) == 16  # one m16 tile per warp at head dim 256

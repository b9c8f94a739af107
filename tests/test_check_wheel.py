"""tools/check_wheel.py on wheels made around the built library: it accepts a correctly tagged one and names every
defect of a wrong one (tag, glibc promise, missing targets, missing library). Needs the library the install built and
cuobjdump (CI installs nvidia-cuda-cuobjdump); the release wheel itself is checked by .ci/run."""
from __future__ import annotations

import importlib.util
import os
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("check_wheel", os.path.join(ROOT, "tools", "check_wheel.py"))
cw = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cw)

LIB = os.path.join(ROOT, "sage_patch", "kernels", "libsage_kernels.so")
DEFAULT = cw.build_kernels.parse_archs(None)

pytestmark = [
    pytest.mark.skipif(not os.path.isfile(LIB), reason="libsage_kernels.so not built here"),
    pytest.mark.skipif(cw.find_cuobjdump() is None, reason="no cuobjdump (pip install nvidia-cuda-cuobjdump)"),
]


def _built_targets():
    return cw.build_kernels.library_targets(LIB)


def _wheel(tmp_path, plat, lib=True, meta_plat=None):
    tag = f"py3-none-{plat}"
    path = tmp_path / f"sage_patch-0.1.0-{tag}.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name in cw.package_sources():
            z.writestr(name, "")
        if lib:
            z.write(LIB, cw.LIB_IN_WHEEL)
        z.writestr("sage_patch-0.1.0.dist-info/WHEEL", f"Wheel-Version: 1.0\nRoot-Is-Purelib: false\n"
                                                       f"Tag: py3-none-{meta_plat or plat}\n")
    return str(path)


def test_a_good_wheel_passes(tmp_path):
    targets = _built_targets()
    assert cw.check(_wheel(tmp_path, "manylinux_2_34_x86_64"), targets, cw.find_cuobjdump()) == []


def test_the_built_library_holds_every_default_target():
    """What CI's install compiled is the full default set (else the release wheel check below it would fail)."""
    assert sorted(_built_targets()) == sorted(DEFAULT)


def test_bad_wheels_are_refused_with_the_reason(tmp_path):
    cuobjdump = cw.find_cuobjdump()
    targets = _built_targets()
    errors = cw.check(_wheel(tmp_path, "linux_x86_64"), targets, cuobjdump)
    assert len(errors) == 1 and "an index accepts manylinux_X_Y_<arch> only" in errors[0]
    errors = cw.check(_wheel(tmp_path, "manylinux_2_17_x86_64"), targets, cuobjdump)
    assert len(errors) == 1 and "promises glibc 2.17 but the library needs GLIBC_2." in errors[0]
    errors = cw.check(_wheel(tmp_path, "manylinux_2_34_x86_64", meta_plat="manylinux_2_28_x86_64"), targets,
                      cuobjdump)
    assert len(errors) == 1 and "WHEEL metadata tags" in errors[0]
    errors = cw.check(_wheel(tmp_path, "manylinux_2_34_x86_64", lib=False), targets, cuobjdump)
    assert len(errors) == 1 and "the kernels are missing" in errors[0]


def test_missing_targets_are_named(tmp_path):
    whl = _wheel(tmp_path, "manylinux_2_34_x86_64")
    errors = cw.check(whl, _built_targets() + ["compute_90", "87"], cw.find_cuobjdump())
    assert any("--list-elf" in e and "sm_87" in e for e in errors)
    assert any("--list-ptx" in e and "compute_90" in e for e in errors)
    assert any("sage_compiled_archs()" in e for e in errors)

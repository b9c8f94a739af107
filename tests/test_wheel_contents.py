"""tools/check_wheel.py's package-contents check, on small zip files (no library, no build): a wheel that lacks any
git-tracked module or shipped policy of sage_patch/ is refused, naming the files."""
from __future__ import annotations

import importlib.util
import os
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("check_wheel", os.path.join(ROOT, "tools", "check_wheel.py"))
cw = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cw)


def test_package_sources_are_every_module_and_policy():
    sources = cw.package_sources()
    assert "sage_patch/kernels/sagebwd/bwd.py" in sources and "sage_patch/configs/flux.yaml" in sources
    assert all(s.startswith("sage_patch/") and s.endswith((".py", ".yaml")) for s in sources)


def test_a_wheel_missing_a_module_or_a_policy_is_refused(tmp_path):
    sources = cw.package_sources()
    dropped = ["sage_patch/kernels/sagebwd/bwd.py", "sage_patch/configs/flux.yaml"]
    whl = tmp_path / "sage_patch-0.1.0-py3-none-manylinux_2_34_x86_64.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for name in sources:
            if name not in dropped:
                z.writestr(name, "")
    errors = cw.check(str(whl), [], None)
    (missing,) = [e for e in errors if "missing from the wheel" in e]
    assert "2 package file(s)" in missing and all(d in missing for d in dropped)
    assert cw.missing_package_files(sources) == []

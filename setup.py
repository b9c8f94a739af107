"""Build hook: compiles kernels_cuda/ into a plain C-ABI shared library when nvcc is available.

What a build that cannot make the library does is SAGE_PATCH_KERNELS's (kernels_cuda/build_kernels.py): by default a
failed compile fails the build, and a missing nvcc installs the package without kernels (with a warning);
SAGE_PATCH_KERNELS=required makes both errors (release wheels: tools/release_wheel.py), =optional neither.
A wheel that carries libsage_kernels.so is tagged py3-none-<platform> (plain C ABI: no Python or torch version in
it); one without it is pure (py3-none-any).
"""
import os
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "kernels_cuda"))

import build_kernels  # noqa: E402  kernels_cuda/build_kernels.py


def _kernels_dir(build_lib: str) -> str:
    return os.path.join(build_lib, "sage_patch", "kernels")


class BuildWithKernels(build_py):
    def run(self):
        super().run()
        build_kernels.build_into(_kernels_dir(self.build_lib), inplace_dir=_kernels_dir(HERE))


cmdclass = {"build_py": BuildWithKernels}
try:
    try:
        from setuptools.command.bdist_wheel import bdist_wheel as _bdist_wheel
    except ImportError:
        from wheel.bdist_wheel import bdist_wheel as _bdist_wheel

    class BdistWheel(_bdist_wheel):
        """Tags the wheel by what the build made: the library in the build tree -> platform wheel, else pure."""

        def run(self):
            if not self.skip_build:
                self.run_command("build")
            build_lib = self.get_finalized_command("build_py").build_lib
            binary = os.path.isfile(os.path.join(_kernels_dir(build_lib), build_kernels.LIB_NAME))
            self.root_is_pure = not binary
            if binary:  # install into the wheel's root as platform code (platlib), not under .data/purelib
                self.distribution.has_ext_modules = lambda: True
            super().run()

        def get_tag(self):
            py, abi, plat = super().get_tag()
            return (py, abi, plat) if self.root_is_pure else ("py3", "none", plat)

    cmdclass["bdist_wheel"] = BdistWheel
except ImportError:
    pass

setup(cmdclass=cmdclass)

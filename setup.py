"""Build hook: compiles kernels_cuda/ into a plain C-ABI shared library when nvcc is available.

Without nvcc the package still installs; sage_patch then runs the reference and full paths and
`sage-patch info` says why the kernels are missing.
"""
import os
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels_cuda"))


class BuildWithKernels(build_py):
    def run(self):
        super().run()
        try:
            import build_kernels  # kernels_cuda/build_kernels.py
        except ImportError:
            return
        build_kernels.build_into(os.path.join(self.build_lib, "sage_patch", "kernels"), inplace_dir=os.path.join(
            os.path.dirname(os.path.abspath(__file__)), "sage_patch", "kernels"))


cmdclass = {"build_py": BuildWithKernels}
try:  # a wheel that carries libsage_kernels.so is platform-specific (but not Python-specific: plain C ABI)
    try:
        from setuptools.command.bdist_wheel import bdist_wheel as _bdist_wheel
    except ImportError:
        from wheel.bdist_wheel import bdist_wheel as _bdist_wheel

    class BdistWheel(_bdist_wheel):
        def finalize_options(self):
            super().finalize_options()
            try:
                import build_kernels

                self.root_is_pure = not build_kernels.will_build()
            except ImportError:
                pass

        def get_tag(self):
            py, abi, plat = super().get_tag()
            return (py, abi, plat) if self.root_is_pure else ("py3", "none", plat)

    cmdclass["bdist_wheel"] = BdistWheel
except ImportError:
    pass

setup(cmdclass=cmdclass)

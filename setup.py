"""Installs the Python package malleus (python/malleus and its pybind11 module _malleus).

    /usr/bin/python3 -m venv --system-site-packages /tmp/malleus-env
    MALLEUS_BUILD_DIR=build /tmp/malleus-env/bin/pip install --no-build-isolation --no-index .

(Debian's own interpreter refuses packages installed beside its own, PEP 668; the virtual
environment sees Debian's PyTorch. docs/python.md, "Build and import".)

The module is built by the project's CMake build: into build-python/ (configured without tests
and benchmarks), or into an existing build directory named by MALLEUS_BUILD_DIR (e.g. build),
for the interpreter running this."""

import os
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        build_dir = os.environ.get("MALLEUS_BUILD_DIR", os.path.join(ROOT, "build-python"))
        build_dir = os.path.abspath(build_dir)
        if not os.path.exists(os.path.join(build_dir, "CMakeCache.txt")):
            launcher = ["-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"] if shutil.which("ccache") else []
            subprocess.check_call(["cmake", "-S", ROOT, "-B", build_dir, "-G", "Ninja",
                                   "-DCMAKE_BUILD_TYPE=Release", "-DMALLEUS_BUILD_TESTS=OFF",
                                   "-DMALLEUS_BUILD_BENCH=OFF",
                                   f"-DPython_EXECUTABLE={sys.executable}"] + launcher)
        subprocess.check_call(["cmake", "--build", build_dir, "--target", "malleus_python"])
        built = os.path.join(build_dir, "python", "malleus")
        module = [f for f in os.listdir(built) if f.startswith("_malleus") and f.endswith(".so")]
        if not module:
            raise RuntimeError(f"{built}: no _malleus module was built (is pybind11-dev "
                               "installed? scripts/setup.sh)")
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(os.path.join(built, module[0]), target)


setup(
    name="malleus",
    version="0.1.0",
    description="malleus's planner, simulator and straggler loop, and malleus.torch",
    packages=["malleus", "malleus.torch"],
    package_dir={"": "python"},
    package_data={"malleus": ["_malleus.pyi", "py.typed"]},
    ext_modules=[Extension("malleus._malleus", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.9",
    # setuptools' own build files stay out of CMake's build/ and out of the sources.
    options={"build": {"build_base": os.path.join("build-python", "setuptools")},
             "egg_info": {"egg_base": "build-python"}},
)

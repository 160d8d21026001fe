"""`pip install .` as docs/python.md has it: into a virtual environment that sees Debian's
PyTorch (--system-site-packages), offline (--no-index, --no-build-isolation: Debian's
setuptools), reusing the build tree (MALLEUS_BUILD_DIR); the installed package, imported from
outside the repository, holds the module, its type stub and malleus.torch. The environment lives
in a temporary folder and goes with it."""

import os
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("MALLEUS_TEST_BUILD_DIR", os.path.join(ROOT, "build"))


class PipInstall(unittest.TestCase):
    def test_the_documented_install_imports_from_anywhere(self):
        with tempfile.TemporaryDirectory(prefix="malleus-venv-") as tmp:
            env_dir = os.path.join(tmp, "env")
            subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", env_dir],
                           check=True)
            pip = subprocess.run(
                [os.path.join(env_dir, "bin", "pip"), "install", "--no-build-isolation",
                 "--no-index", "--no-cache-dir", "--quiet", ROOT],
                env=dict(os.environ, MALLEUS_BUILD_DIR=BUILD, PYTHONPATH=""),
                capture_output=True, text=True, timeout=900)
            self.assertEqual(pip.returncode, 0, pip.stdout + pip.stderr)
            code = ("import os, malleus, malleus.torch as mt\n"
                    "print(os.path.dirname(malleus.__file__))\n"
                    "print(sorted(os.listdir(os.path.dirname(malleus.__file__))))\n"
                    "print(mt.DataParallel.__module__, malleus.uniform_plan('demo', 2, 1, 1, 8))\n")
            out = subprocess.run([os.path.join(env_dir, "bin", "python"), "-c", code], cwd=tmp,
                                 env=dict(os.environ, PYTHONPATH=""), capture_output=True,
                                 text=True, check=True).stdout.splitlines()
            self.assertTrue(out[0].startswith(env_dir), out[0])  # the installed copy
            for name in ("_malleus.pyi", "py.typed", "torch", "__init__.py"):
                self.assertIn(name, out[1])
            self.assertEqual(out[2], "malleus.torch.data_parallel "
                                     "Plan(2 pipelines: [pp1 tp1 m4] [pp1 tp1 m4])")


if __name__ == "__main__":
    unittest.main()

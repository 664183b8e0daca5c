"""Builds proxima's extension modules with the repository's CMake project: `_proxima` (this
folder's binding.cc over libproxima) and `proxima_codec_py` (tools/eval/codec_binding.cc, the
codec module the quality tool uses), then places both inside the package.

PROXIMA_BUILD_DIR=<dir> reuses a build tree that already has both modules (scripts/build.sh
makes them; a relative path is taken from the repository root); otherwise the repository is configured into build/python-wheel beside this file
(tests and benchmarks off) and only those two targets are built. CMAKE_ARGS adds CMake options,
CMAKE_BUILD_PARALLEL_LEVEL sets the jobs (default 2).
"""
import glob
import os
import shlex
import shutil
import subprocess

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
MODULES = {"_proxima": os.path.join("client", "python"),
           "proxima_codec_py": os.path.join("tools", "eval")}


def _built(build_dir, name):
    found = glob.glob(os.path.join(build_dir, MODULES[name], name + ".*.so"))
    return found[0] if found else None


class CMakeBuild(build_ext):
    def run(self):
        build_dir = os.environ.get("PROXIMA_BUILD_DIR")
        if build_dir:
            build_dir = os.path.join(REPO, build_dir)  # a relative path is from the repo root
            missing = [m for m in MODULES if not _built(build_dir, m)]
            if missing:
                raise RuntimeError(f"PROXIMA_BUILD_DIR={build_dir} has no {', '.join(missing)}: "
                                   "expected a build made by scripts/build.sh")
        else:
            build_dir = os.path.join(HERE, "build", "python-wheel")
            args = ["-DPROXIMA_BUILD_TESTS=OFF", "-DPROXIMA_BUILD_BENCH=OFF",
                    "-DCMAKE_BUILD_TYPE=Release"] + shlex.split(os.environ.get("CMAKE_ARGS", ""))
            if shutil.which("ninja") and not os.path.exists(
                    os.path.join(build_dir, "CMakeCache.txt")):
                args += ["-G", "Ninja"]
            subprocess.check_call(["cmake", "-S", REPO, "-B", build_dir] + args)
            jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", "2")
            subprocess.check_call(["cmake", "--build", build_dir, "-j", jobs, "--target",
                                   *MODULES])
        for ext in self.extensions:
            name = ext.name.split(".")[-1]
            dest = self.get_ext_fullpath(ext.name)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            shutil.copyfile(_built(build_dir, name), dest)


setup(ext_modules=[Extension(f"proxima.{m}", sources=[]) for m in MODULES],
      cmdclass={"build_ext": CMakeBuild})

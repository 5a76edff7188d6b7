"""The build step of `pip install ./python`: pdlib's CMake build of the _pdlib extension.

pyproject.toml holds the metadata; this file only drives CMake, from the repository root one
level up (pip builds in place, so the tree is there):

  PDLIB_CMAKE_BUILD_DIR   a configured build directory to reuse (e.g. build/release: then only
                          what changed is rebuilt); default build/pip, configured here (Release,
                          no tests, benchmarks or examples) for this interpreter
  PDLIB_CMAKE_ARGS        more arguments for that configure step (e.g. -DPDLIB_WITH_CUDA=OFF)
  PDLIB_BUILD_JOBS        build parallelism (default: the CPU count)
  PDLIB_KEEP_DEBUG=1      keep the extension's debug info (by default it is stripped from the
                          copy that goes into the wheel: a RelWithDebInfo build's is ~100 MB)

The extension links pdlib statically; the shared libraries it still needs at run time (gRPC,
protobuf, Abseil, UCX, rdma-core) are listed by python/tools/wheel_deps.py.
"""

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# pip's metadata step needs setuptools' bdist_wheel, which comes from the `wheel` package. Debian
# has it for its own interpreter (python3-wheel, which `make deps` installs); a virtualenv of
# another interpreter (pyenv, conda) lacks it, and pip would only say "invalid command
# 'bdist_wheel'".
if importlib.util.find_spec("wheel") is None and any(
        a in ("bdist_wheel", "dist_info", "editable_wheel") for a in sys.argv[1:]):
    sys.exit(f"pdlib: this interpreter ({sys.executable}) has no 'wheel' package. Build with "
             "Debian's Python, for which `make deps` installs wheel, numpy, torch and pybind11: "
             "/usr/bin/python3 -m venv --system-site-packages ~/venv")


def pdlib_version() -> str:
    text = (ROOT / "CMakeLists.txt").read_text()
    match = re.search(r"project\(pdlib VERSION ([0-9][0-9.]*)", text)
    if match is None:
        raise RuntimeError(f"no 'project(pdlib VERSION x.y.z' in {ROOT / 'CMakeLists.txt'}")
    return match.group(1)


def run(cmd: list[str]) -> None:
    print("pdlib setup.py:", " ".join(shlex.quote(c) for c in cmd), flush=True)
    subprocess.run(cmd, check=True)


class CMakeBuild(build_ext):
    """Builds the CMake target pdlib_python and copies _pdlib into the wheel's tree."""

    def build_extension(self, ext: Extension) -> None:
        build_dir = Path(os.environ.get("PDLIB_CMAKE_BUILD_DIR") or ROOT / "build" / "pip")
        if not build_dir.is_absolute():
            build_dir = ROOT / build_dir
        if not (build_dir / "CMakeCache.txt").exists():
            generator = ["-G", "Ninja"] if shutil.which("ninja") else []
            run(["cmake", "-S", str(ROOT), "-B", str(build_dir), *generator,
                 "-DCMAKE_BUILD_TYPE=Release", "-DPDLIB_WITH_PYTHON=ON",
                 "-DPDLIB_BUILD_TESTS=OFF", "-DPDLIB_BUILD_BENCH=OFF",
                 "-DPDLIB_BUILD_EXAMPLES=OFF", f"-DPython3_EXECUTABLE={sys.executable}",
                 *shlex.split(os.environ.get("PDLIB_CMAKE_ARGS", ""))])
        jobs = os.environ.get("PDLIB_BUILD_JOBS") or str(os.cpu_count() or 2)
        run(["cmake", "--build", str(build_dir), "--target", "pdlib_python", "-j", jobs])
        built = sorted((build_dir / "python" / "pdlib").glob("_pdlib*.so"))
        if not built:
            raise RuntimeError(f"the build in {build_dir} made no python/pdlib/_pdlib*.so")
        target = Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        # The interpreter's own suffix (e.g. .cpython-311-x86_64-linux-gnu.so) when it was built
        # for it, else the one CMake gave.
        source = next((b for b in built if b.name == target.name), built[0])
        shutil.copyfile(source, target)
        if not os.environ.get("PDLIB_KEEP_DEBUG") and shutil.which("strip"):
            run(["strip", "--strip-debug", str(target)])


setup(
    version=pdlib_version(),
    ext_modules=[Extension("pdlib._pdlib", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
)

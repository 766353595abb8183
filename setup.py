"""Build gpumem._C (csrc/, nanobind) through CMake; everything else is pure Python.

Environment switches (all optional):
  GPUMEM_BUILD_TYPE   CMake build type (default Release)
  GPUMEM_CMAKE_ARGS   extra arguments for the CMake configure step
  GPUMEM_BUILD_JOBS   parallel build jobs (default: all cores)
"""

import os
import shlex
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        import nanobind

        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(self.build_temp).resolve() / ext.name
        build_dir.mkdir(parents=True, exist_ok=True)
        cfg = os.environ.get("GPUMEM_BUILD_TYPE", "Release")
        args = [
            f"-S{ROOT}",
            f"-B{build_dir}",
            f"-DCMAKE_BUILD_TYPE={cfg}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dnanobind_DIR={nanobind.cmake_dir()}",
            f"-DGPUMEM_OUTPUT_DIR={out_dir}",
        ]
        try:
            subprocess.run(["ninja", "--version"], check=True, capture_output=True)
            args.append("-GNinja")
        except (OSError, subprocess.CalledProcessError):
            pass  # fall back to CMake's default generator (make)
        args += shlex.split(os.environ.get("GPUMEM_CMAKE_ARGS", ""))
        jobs = os.environ.get("GPUMEM_BUILD_JOBS", str(os.cpu_count() or 1))
        subprocess.run(["cmake", *args], check=True)
        subprocess.run(
            ["cmake", "--build", str(build_dir), "--config", cfg, "-j", jobs], check=True
        )


setup(ext_modules=[CMakeExtension("gpumem._C")], cmdclass={"build_ext": CMakeBuild})

"""Build step for the two native libraries; all other package metadata lives in pyproject.toml.

Both are plain C ABI shared libraries loaded with ctypes, built as setuptools extensions so that `pip install -e .`
and the Docker build compile them with the system C++ compiler: no torch headers, no nvcc.
- glm53.cpu_lane._expert_kernel (glm53/cpu_lane/kernel.py): the CPU expert kernel. Every ISA path is compiled here
  with target pragmas and chosen at run time, so the build flags stay baseline x86-64 and the library runs on any
  CPU the package does.
- store._native (store/native.py): the store's parallel pread and read queue; store/ builds and loads it alone.
"""

import runpy
from pathlib import Path

from setuptools import Extension, setup

FLAGS = {"language": "c++", "extra_compile_args": ["-std=c++17", "-O3", "-fvisibility=hidden", "-pthread"],
         "extra_link_args": ["-pthread"]}


STORE_BUILD = Path("store") / "native_build.py"
files_hash = runpy.run_path(str(STORE_BUILD))["files_hash"]  # standard library only: runs before any install


def extension(info_file: Path, macro: str) -> Extension:
    """One library from its build info (sources, headers, name); the sources' hash compiled in as `macro`, so its
    loader refuses a library built from other sources."""
    info, src = runpy.run_path(str(info_file)), info_file.parent  # its SOURCES are named relative to it
    names = tuple(info["SOURCES"]) + tuple(info["HEADERS"])
    return Extension(info["EXTENSION"], sources=[str(src / s) for s in info["SOURCES"]],
                     depends=[str(src / h) for h in info["HEADERS"]],
                     define_macros=[(macro, f'"{files_hash(src, names)}"')], **FLAGS)


# The bench's emulated disk (glm53.bench.emulated_disk): a read hook of its own, loaded with ctypes.
emulated_disk = Extension("glm53.bench._emulated_disk", sources=[str(Path("glm53") / "bench" / "emulated_disk.cpp")],
                          **FLAGS)

setup(ext_modules=[extension(Path("glm53") / "cpu_lane" / "buildinfo.py", "GLM53_SRC_HASH"),
                   extension(STORE_BUILD, "GLM53_STORE_SRC_HASH"), emulated_disk])

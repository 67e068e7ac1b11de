"""Build step for the CPU expert kernel; all other package metadata lives in pyproject.toml.

The kernel is a plain C ABI shared library (loaded with ctypes by glm53/cpu_lane/kernel.py), built as a setuptools
extension so that `pip install -e .` and the Docker build compile it with the system C++ compiler: no torch
headers, no nvcc. Every ISA path is compiled here with target pragmas and chosen at run time, so the build flags
stay baseline x86-64 and the library runs on any CPU the package does.
"""

import runpy
from pathlib import Path

from setuptools import Extension, setup

LANE = Path("glm53") / "cpu_lane"
info = runpy.run_path(str(LANE / "buildinfo.py"))
src_hash = info["source_hash"](LANE)  # compiled in; kernel.py refuses a library built from other sources

kernel = Extension(
    info["EXTENSION"],
    sources=[str(LANE / s) for s in info["SOURCES"]],
    depends=[str(LANE / h) for h in info["HEADERS"]],
    language="c++",
    define_macros=[("GLM53_SRC_HASH", f'"{src_hash}"')],
    extra_compile_args=["-std=c++17", "-O3", "-fvisibility=hidden", "-pthread"],
    extra_link_args=["-pthread"],
)

# The bench's emulated disk (glm53.bench.emulated_disk): a read hook of its own, loaded with ctypes like the kernel.
emulated_disk = Extension(
    "glm53.bench._emulated_disk",
    sources=[str(Path("glm53") / "bench" / "emulated_disk.cpp")],
    language="c++",
    extra_compile_args=["-std=c++17", "-O2", "-fvisibility=hidden", "-pthread"],
    extra_link_args=["-pthread"],
)

setup(ext_modules=[kernel, emulated_disk])

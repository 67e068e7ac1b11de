"""Which sources make the CPU expert kernel, and their hash.

setup.py compiles the hash into the library (GLM53_SRC_HASH) and kernel.py compares it at load time, so a
library left over from older sources (an editable install not rebuilt after a pull) is refused with the
command that rebuilds it, instead of computing with stale code. No imports at the top: setup.py runs this file in
the build environment, before glm53 is importable, and hashes SOURCES + HEADERS itself (with store/native_build.py's
files_hash, as source_hash does here).
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = ("kernel.cpp", "kernel_scalar.cpp", "kernel_avx2.cpp", "kernel_avx2vnni.cpp", "kernel_avx512.cpp",
           "kernel_avx512vnni.cpp")
HEADERS = ("kernel_api.h", "kernel_impl.h")
EXTENSION = "glm53.cpu_lane._expert_kernel"


def source_hash(directory: Path = HERE) -> str:
    """sha256 (first 16 hex digits) over the kernel's sources and headers, names included, in a fixed order."""
    from store.native_build import files_hash

    return files_hash(directory, SOURCES + HEADERS)

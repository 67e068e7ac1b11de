"""Which sources make the store's native library (store/_native*.so), and their hash.

setup.py compiles the hash into the library (GLM53_STORE_SRC_HASH) and store/native.py compares it at load time,
so a library left over from older sources (an editable install not rebuilt after a pull) is refused with the
command that rebuilds it. Standard library only: setup.py runs this file before the package is importable.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = ("csrc/parallel_read.cpp", "csrc/read_queue.cpp")  # relative to this file's directory
HEADERS = ("csrc/store_api.h",)
EXTENSION = "store._native"


def files_hash(directory: Path, names: tuple[str, ...]) -> str:
    """sha256 (first 16 hex digits) over the named files under `directory`, names included, in the given order
    (line endings normalised). glm53/cpu_lane/buildinfo.py hashes the CPU kernel's sources with it too."""
    h = hashlib.sha256()
    for name in names:
        h.update(name.encode() + b"\0")
        h.update((directory / name).read_bytes().replace(b"\r\n", b"\n"))
    return h.hexdigest()[:16]


def source_hash(directory: Path = HERE) -> str:
    """The hash of this library's sources and headers."""
    return files_hash(directory, SOURCES + HEADERS)

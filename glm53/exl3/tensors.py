"""Where each checkpoint tensor's bytes are: the tier loader reads routed experts raw, past exllamav3's loader."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from store.safetensors_header import read_safetensors_header


@dataclass(frozen=True)
class TensorEntry:
    path: Path
    dtype: str  # safetensors dtype string (I16, F16, ...)
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


class SafetensorsIndex:
    """Tensor name -> where its bytes are, from the headers of every *.safetensors file on disk.

    Like exllamav3, it never trusts model.safetensors.index.json (the published checkpoint's index omits files).
    Reads are raw `pread`s into caller buffers: the bytes that land are exactly the checkpoint's, which is
    what stock exllamav3 loads for int16 trellis and fp16 scales (no conversion on either side)."""

    def __init__(self, model_dir: str | os.PathLike):
        self.model_dir = Path(model_dir)
        self.entries: dict[str, TensorEntry] = {}
        files = sorted(self.model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {self.model_dir}")
        for path in files:
            head = read_safetensors_header(path)
            for name, t in head.tensors.items():
                self.entries[name] = TensorEntry(path, t.dtype, t.shape, head.data_start + t.begin, t.nbytes)
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def entry(self, name: str) -> TensorEntry:
        try:
            return self.entries[name]
        except KeyError:
            raise KeyError(f"tensor {name} is in no *.safetensors file of {self.model_dir}") from None

    def _fd(self, path: Path) -> int:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = os.open(path, os.O_RDONLY)
            return fd

    def read_into(self, name: str, out: np.ndarray, start: int = 0, length: int | None = None) -> None:
        """Copy bytes [start, start+length) of tensor `name` into the uint8 array `out` (exactly that size)."""
        e = self.entry(name)
        length = e.nbytes - start if length is None else length
        if out.dtype != np.uint8 or out.nbytes != length:
            raise ValueError(f"{name}: destination of {out.nbytes} bytes for {length}")
        fd, mv, done = self._fd(e.path), memoryview(out).cast("B"), 0
        while done < length:
            n = os.preadv(fd, [mv[done:]], e.offset + start + done)
            if n <= 0:
                raise OSError(f"{e.path}: short read of {name} at byte {start + done} of {e.nbytes}")
            done += n

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


"""The project's one safetensors header reader: an 8-byte little-endian length, then that many bytes of JSON naming
every tensor's dtype, shape and data_offsets (relative to the end of the header). No tensor data is read.

The safetensors package reads headers too, but gives no tensor's offsets in the file (safe_open exposes names,
shapes and dtypes), and the packer, the checkpoint checks and the adapter's raw preads all need them.

    head = read_safetensors_header(path)                 # SafetensorsHeaderError (a ValueError) names the problem
    for name, t in head.tensors.items():
        print(name, t.dtype, t.shape, head.data_start + t.begin, t.nbytes)
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from store.files import not_regular

MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header; a longer one is damage, not a model


class SafetensorsHeaderError(ValueError):
    """The file is not a readable safetensors file; the message names the file and what is wrong with it."""


@dataclass(frozen=True)
class TensorInfo:
    dtype: str                # safetensors dtype string, e.g. "I16"
    shape: tuple[int, ...]
    begin: int                # data_offsets, from the end of the header
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    tensors: dict[str, TensorInfo]   # in the header's order, __metadata__ left out
    metadata: dict[str, str]
    data_start: int                  # 8 + the header's length: where tensor data begins in the file
    file_size: int

    @property
    def data_end(self) -> int:
        """The end of the data the header describes, from data_start (0 for a file of no tensors)."""
        return max((t.end for t in self.tensors.values()), default=0)

    def sizes(self) -> dict[str, int]:
        """Tensor name -> byte size."""
        return {name: t.nbytes for name, t in self.tensors.items()}


def read_safetensors_header(path: str | Path) -> SafetensorsHeader:
    """One file's header, checked: long enough, a length that fits the file (and safetensors' limit), valid JSON,
    and every tensor with a dtype, a shape and data_offsets that are two ints in order. Whether the data fits the
    file is the caller's to check (data_start + data_end against file_size): some callers want it exact."""
    path = Path(path)
    kind = not_regular(path)
    if kind is not None:
        raise SafetensorsHeaderError(f"{path} is {kind}, not a safetensors file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise SafetensorsHeaderError(f"{path} is {size} bytes: too short to be a safetensors file (truncated?)")
        (n,) = struct.unpack("<Q", raw)
        if n > min(MAX_HEADER, size - 8):
            raise SafetensorsHeaderError(f"{path}: safetensors header length {n} does not fit the {size}-byte file "
                                         "(truncated, or not a safetensors file)")
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise SafetensorsHeaderError(f"{path}: the safetensors header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise SafetensorsHeaderError(f"{path}: the safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    tensors = {}
    for name, h in header.items():
        try:
            begin, end = (int(v) for v in h["data_offsets"])
            info = TensorInfo(str(h["dtype"]), tuple(int(d) for d in h["shape"]), begin, end)
        except (KeyError, TypeError, ValueError):
            raise SafetensorsHeaderError(f"{path}: tensor {name} has no valid dtype, shape and data_offsets") from None
        if not 0 <= begin <= end:
            raise SafetensorsHeaderError(f"{path}: tensor {name} has data_offsets {begin}..{end}, out of order")
        tensors[name] = info
    return SafetensorsHeader(path, tensors, metadata, 8 + n, size)

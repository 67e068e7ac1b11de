"""The one safetensors header reader (store.safetensors_header): on files the safetensors library wrote, every
tensor's dtype, shape and bytes match the library's own reading; damaged files are refused naming the problem."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from store.safetensors_header import MAX_HEADER, SafetensorsHeaderError, read_safetensors_header


def test_offsets_dtypes_and_shapes_match_what_the_library_wrote(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {"a.trellis": rng.integers(-3000, 3000, (2, 3, 48)).astype(np.int16),
               "a.suh": rng.standard_normal(32).astype(np.float16), "b": np.arange(7, dtype=np.float32),
               "empty": np.zeros((0, 4), np.int32)}
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path), metadata={"format": "np"})
    head = read_safetensors_header(path)
    assert set(head.tensors) == set(tensors) and head.metadata == {"format": "np"}
    assert head.data_start + head.data_end == head.file_size == path.stat().st_size
    raw, loaded = path.read_bytes(), load_file(str(path))
    dtypes = {np.int16: "I16", np.float16: "F16", np.float32: "F32", np.int32: "I32"}
    for name, t in head.tensors.items():
        assert t.dtype == dtypes[tensors[name].dtype.type] and t.shape == tensors[name].shape
        got = raw[head.data_start + t.begin:head.data_start + t.end]
        assert got == loaded[name].tobytes() and t.nbytes == len(got) == head.sizes()[name]


def _write(path, header_bytes: bytes, length: int | None = None, tail: bytes = b"") -> None:
    path.write_bytes(struct.pack("<Q", len(header_bytes) if length is None else length) + header_bytes + tail)


@pytest.mark.parametrize("make, says", [
    (lambda p: p.write_bytes(b"abc"), "too short"),
    (lambda p: _write(p, b"{}", length=1 << 40), "does not fit"),
    (lambda p: _write(p, b"{}", length=MAX_HEADER + 1, tail=b" " * 16), "does not fit"),
    (lambda p: _write(p, b"{not json"), "not valid JSON"),
    (lambda p: _write(p, b"[1, 2]"), "not a JSON object"),
    (lambda p: _write(p, json.dumps({"t": {"dtype": "F16", "shape": [2]}}).encode()), "tensor t has no valid"),
    (lambda p: _write(p, json.dumps({"t": {"dtype": "F16", "shape": [2], "data_offsets": [8, 4]}}).encode()),
     "out of order"),
], ids=["short", "length", "limit", "json", "object", "offsets", "order"])
def test_a_damaged_header_is_refused_naming_the_file_and_the_problem(tmp_path, make, says):
    path = tmp_path / "bad.safetensors"
    make(path)
    with pytest.raises(SafetensorsHeaderError, match=says) as ei:
        read_safetensors_header(path)
    assert str(path) in str(ei.value)

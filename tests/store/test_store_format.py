"""Store format v1: record layout, header encoding, and the refusals of a damaged header."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from store.errors import StoreFormatError
from store.format import (
    ALIGN,
    MAGIC,
    SEGMENT_ALIGN,
    SEGMENT_ORDER,
    Layout,
    RecordEntry,
    canonical_json,
    data_offset_for,
    header_region,
    read_header,
    record_digests,
)
from store.reader import slot_views


def test_real_width_record_is_9_mib_plus_36_kib():
    lay = Layout.build(4096, 2048, (3, 3, 3))
    assert [s.name for s in lay.segments] == list(SEGMENT_ORDER)
    assert lay.segment("gate.trellis").shape == (256, 128, 48)
    assert lay.segment("down.trellis").shape == (128, 256, 48)
    assert lay.segment("gate.trellis").nbytes == 3 * 2**20
    assert lay.length == 9 * 2**20 + 36 * 2**10
    assert lay.extent == lay.length                 # already a 4 KiB multiple at the real width
    assert lay.gaps() == []


@settings(max_examples=60, deadline=None)
@given(hidden=st.integers(1, 64).map(lambda x: 16 * x), inter=st.integers(1, 64).map(lambda x: 16 * x),
       k=st.tuples(st.integers(1, 8), st.integers(1, 8), st.integers(1, 8)))
def test_layout_segments_are_aligned_disjoint_and_gaps_cover_the_rest(hidden, inter, k):
    lay = Layout.build(hidden, inter, k)
    covered = np.zeros(lay.extent, dtype=np.int8)
    for s in lay.segments:
        assert s.offset % SEGMENT_ALIGN == 0
        covered[s.offset:s.offset + s.nbytes] += 1
    for a, b in lay.gaps():
        covered[a:b] += 1
    assert (covered == 1).all() and lay.extent % ALIGN == 0
    assert Layout.from_json(lay.to_json()) == lay


def test_layout_from_json_rejects_another_segment_order():
    d = Layout.build(256, 128, (3, 3, 3)).to_json()
    d["segments"][0], d["segments"][1] = d["segments"][1], d["segments"][0]
    with pytest.raises(ValueError):
        Layout.from_json(d)


def test_slot_views_point_into_the_buffer():
    lay = Layout.build(64, 32, (2, 3, 4))
    buf = np.arange(lay.extent, dtype=np.uint32).astype(np.uint8)
    v = slot_views(lay, buf)
    seg = lay.segment("up.svh")
    assert v.up.svh.shape == (32,) and v.up.svh.dtype == np.float16
    assert v.up.svh.tobytes() == buf[seg.offset:seg.offset + seg.nbytes].tobytes()
    assert v.down.trellis.shape == (2, 4, 64)
    v.gate.suh[0] = 1.5                               # a view, not a copy
    assert buf[lay.segment("gate.suh").offset:][:2].view(np.float16)[0] == 1.5


def _write_store(path, n=3, hidden=64, inter=32):
    lay = Layout.build(hidden, inter, (3, 3, 3))
    identity = canonical_json({"layouts": [lay.to_json()], "layers": [{"layer": 1, "layout": 0}],
                               "source_hint": "/models/x"})
    rng = np.random.default_rng(0)
    off = data_offset_for(len(identity), n)
    entries, blobs = [], []
    for e in range(n):
        blob = np.zeros(lay.extent, np.uint8)
        blob[:lay.length] = rng.integers(0, 256, lay.length, dtype=np.uint8)
        entries.append(RecordEntry(1, e, off + e * lay.extent, lay.length, *record_digests(blob)))
        blobs.append(blob.tobytes())
    size = off + n * lay.extent
    path.write_bytes(header_region(identity, entries, size) + b"".join(blobs))
    return entries


def test_header_round_trip(tmp_path):
    p = tmp_path / "s.glm53"
    entries = _write_store(p)
    head = read_header(p)
    assert head.entries == entries
    assert head.entry(1, 2) == entries[2]
    assert head.layout(1).length == entries[0].length
    assert head.data_offset % ALIGN == 0 and all(e.offset % ALIGN == 0 for e in head.entries)
    with pytest.raises(KeyError, match="layer 1, expert 9"):
        head.entry(1, 9)


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


@pytest.mark.parametrize("where", ["identity", "table", "reserved"])
def test_one_flipped_header_byte_is_refused(tmp_path, where):
    p = tmp_path / "s.glm53"
    _write_store(p)
    head = read_header(p)
    _flip(p, {"identity": 130, "table": head.table_offset + 20, "reserved": 110}[where])
    with pytest.raises(StoreFormatError, match="fails its sha256 check") as ei:
        read_header(p)
    assert "glm53 pack-store" in ei.value.fix


def test_wrong_magic(tmp_path):
    p = tmp_path / "s.glm53"
    _write_store(p)
    with open(p, "r+b") as f:
        f.write(b"GGUF\0\0\0\0")
    with pytest.raises(StoreFormatError, match="not a glm53 expert store") as ei:
        read_header(p)
    assert "pack-store" in ei.value.fix


def test_wrong_version(tmp_path):
    p = tmp_path / "s.glm53"
    _write_store(p)
    with open(p, "r+b") as f:
        f.seek(len(MAGIC))
        f.write(struct.pack("<I", 7))
    with pytest.raises(StoreFormatError, match="format version 7; this glm53 reads version 1") as ei:
        read_header(p)
    assert "pack-store" in ei.value.fix


@pytest.mark.parametrize("keep", [0, 50, "half"])
def test_truncated(tmp_path, keep):
    p = tmp_path / "s.glm53"
    _write_store(p)
    size = p.stat().st_size
    n = size // 2 if keep == "half" else keep
    with open(p, "r+b") as f:
        f.truncate(n)
    with pytest.raises(StoreFormatError, match="truncated|too short") as ei:
        read_header(p)
    assert "pack-store" in ei.value.fix


def test_missing_file(tmp_path):
    with pytest.raises(StoreFormatError, match="does not exist") as ei:
        read_header(tmp_path / "nope.glm53")
    assert "glm53 pack-store --model" in ei.value.fix

"""Store format v1: byte layout, encoding and decoding. docs/store-format.md is the prose twin of this file.

    [0, 128)                 superblock (fixed binary, little-endian)
    [128, 128 + I)           identity: canonical UTF-8 JSON (model identity, quantization, record layouts)
    [table_offset, +64*N)    record table: N fixed 64-byte entries sorted by (layer, expert)
    [data_offset, file_size) records, each 4 KiB-aligned, each one VRAM slot image padded with zeros to 4 KiB

The superblock carries a sha256 over itself (digest field zeroed), the identity and the table, so one check
covers everything but the records; each record carries its own xxh3-64 (fast) and sha256 (trusted).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from store.errors import StoreFormatError
from store.files import not_regular

MAGIC = b"GLM53STR"
VERSION = 1
ALIGN = 4096            # record offsets and extents: the O_DIRECT and page granularity
SEGMENT_ALIGN = 256     # segment starts inside a record: cudaMalloc's alignment, so slot views are kernel-safe
SUPERBLOCK_SIZE = 128
ENTRY_SIZE = 64
FORMAT_NAME = "glm53-expert-store"

# Superblock: magic, version, superblock size, alignment, entry size, identity offset/length, table offset,
# record count, data offset, file size, meta sha256, 24 reserved bytes.
_SB = struct.Struct("<8sIIII QQ QQ QQ 32s 24s")
# Table entry: layer, expert, offset, payload length, xxh3-64, sha256.
_ENTRY = struct.Struct("<IIQQQ32s")
assert _SB.size == SUPERBLOCK_SIZE and _ENTRY.size == ENTRY_SIZE

PROJECTIONS = ("gate", "up", "down")
# The slot image order. Fixed by the format: trellises first (the bulk, contiguous for one big copy),
# then the small sign/scale vectors.
SEGMENT_ORDER = tuple(f"{p}.trellis" for p in PROJECTIONS) + tuple(
    f"{p}.{v}" for p in PROJECTIONS for v in ("suh", "svh"))
DTYPES = {"int16": np.int16, "float16": np.float16}


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def canonical_json(obj: Any) -> bytes:
    """One byte string per value: sorted keys, no spaces, ASCII. Hashes and lengths depend on it."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


@dataclass(frozen=True)
class Segment:
    name: str            # e.g. "gate.trellis"
    offset: int          # bytes from the record start
    dtype: str           # "int16" | "float16"
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(DTYPES[self.dtype]).itemsize


@dataclass(frozen=True)
class Layout:
    """Where each tensor of one expert sits inside its record (the VRAM slot image)."""

    k_bits: tuple[int, int, int]          # gate, up, down
    segments: tuple[Segment, ...]

    @classmethod
    def build(cls, hidden: int, intermediate: int, k_bits: tuple[int, int, int]) -> Layout:
        dims = {"gate": (hidden, intermediate), "up": (hidden, intermediate), "down": (intermediate, hidden)}
        kb = dict(zip(PROJECTIONS, k_bits, strict=True))
        segs, off = [], 0
        for name in SEGMENT_ORDER:
            proj, part = name.split(".")
            n_in, n_out = dims[proj]
            if part == "trellis":
                seg = Segment(name, off, "int16", (n_in // 16, n_out // 16, 16 * kb[proj]))
            else:
                seg = Segment(name, off, "float16", (n_in if part == "suh" else n_out,))
            segs.append(seg)
            off = align_up(off + seg.nbytes, SEGMENT_ALIGN)
        return cls(tuple(k_bits), tuple(segs))

    @property
    def length(self) -> int:
        """Payload bytes: end of the last segment."""
        last = self.segments[-1]
        return last.offset + last.nbytes

    @property
    def extent(self) -> int:
        """Bytes the record occupies on disk (payload padded to 4 KiB); also the buffer size a read needs."""
        return align_up(self.length)

    def segment(self, name: str) -> Segment:
        for s in self.segments:
            if s.name == name:
                return s
        raise KeyError(name)

    def gaps(self) -> list[tuple[int, int]]:
        """Byte ranges in [0, extent) not covered by a segment; pack zeroes them."""
        out, pos = [], 0
        for s in self.segments:
            if s.offset > pos:
                out.append((pos, s.offset))
            pos = s.offset + s.nbytes
        if self.extent > pos:
            out.append((pos, self.extent))
        return out

    def to_json(self) -> dict:
        return {"k_bits": dict(zip(PROJECTIONS, self.k_bits, strict=True)), "length": self.length,
                "segments": [[s.name, s.offset, s.dtype, list(s.shape)] for s in self.segments]}

    @classmethod
    def from_json(cls, d: dict) -> Layout:
        segs = tuple(Segment(n, int(o), t, tuple(int(x) for x in sh)) for n, o, t, sh in d["segments"])
        lay = cls(tuple(int(d["k_bits"][p]) for p in PROJECTIONS), segs)
        if [s.name for s in segs] != list(SEGMENT_ORDER) or lay.length != int(d["length"]):
            raise ValueError("layout segments are not in the v1 order or the length disagrees")
        return lay


@dataclass(frozen=True)
class RecordEntry:
    layer: int
    expert: int
    offset: int
    length: int
    xxh3: int
    sha256: bytes

    @property
    def extent(self) -> int:
        return align_up(self.length)

    def pack(self) -> bytes:
        return _ENTRY.pack(self.layer, self.expert, self.offset, self.length, self.xxh3, self.sha256)

    def where(self) -> str:
        return f"record (layer {self.layer}, expert {self.expert}) at offset {self.offset}, {self.extent} bytes"


def record_digests(buf: np.ndarray | bytes | memoryview) -> tuple[int, bytes]:
    """xxh3-64 and sha256 of a record extent (payload and zero padding)."""
    import xxhash

    mv = memoryview(buf)
    return xxhash.xxh3_64_intdigest(mv), hashlib.sha256(mv).digest()


@dataclass
class StoreHeader:
    """A decoded header: what a reader needs to find, size and check every record."""

    version: int
    identity: dict
    identity_bytes: bytes
    entries: list[RecordEntry]
    table_offset: int
    data_offset: int
    file_size: int
    meta_sha256: bytes
    layouts: list[Layout] = field(default_factory=list)
    layer_layout: dict[int, int] = field(default_factory=dict)
    index: dict[tuple[int, int], RecordEntry] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.layouts = [Layout.from_json(d) for d in self.identity["layouts"]]
        self.layer_layout = {int(d["layer"]): int(d["layout"]) for d in self.identity["layers"]}
        self.index = {(e.layer, e.expert): e for e in self.entries}

    def layout(self, layer: int) -> Layout:
        return self.layouts[self.layer_layout[layer]]

    def entry(self, layer: int, expert: int) -> RecordEntry:
        try:
            return self.index[(layer, expert)]
        except KeyError:
            raise KeyError(f"the store has no record for layer {layer}, expert {expert}") from None

    @property
    def max_extent(self) -> int:
        return max(lay.extent for lay in self.layouts)

    @property
    def source_hint(self) -> str:
        return self.identity.get("source_hint") or "MODEL_DIR"


def encode_superblock(identity_len: int, table_offset: int, count: int, data_offset: int, file_size: int,
                      meta_sha256: bytes = b"\0" * 32) -> bytes:
    return _SB.pack(MAGIC, VERSION, SUPERBLOCK_SIZE, ALIGN, ENTRY_SIZE, SUPERBLOCK_SIZE, identity_len,
                    table_offset, count, data_offset, file_size, meta_sha256, b"\0" * 24)


def meta_digest(superblock: bytes, identity: bytes, table: bytes) -> bytes:
    """sha256 over the superblock with its digest field zeroed, the identity and the table."""
    h = hashlib.sha256()
    h.update(superblock[:72] + b"\0" * 32 + superblock[104:])
    h.update(identity)
    h.update(table)
    return h.digest()


def header_region(identity: bytes, entries: list[RecordEntry], file_size: int) -> bytes:
    """Everything before the first record (superblock, identity, table, zero fill), ready to write at 0."""
    table_offset = align_up(SUPERBLOCK_SIZE + len(identity))
    data_offset = align_up(table_offset + ENTRY_SIZE * len(entries))
    table = b"".join(e.pack() for e in entries)
    sb = encode_superblock(len(identity), table_offset, len(entries), data_offset, file_size)
    sb = sb[:72] + meta_digest(sb, identity, table) + sb[104:]
    out = bytearray(data_offset)
    out[:SUPERBLOCK_SIZE] = sb
    out[SUPERBLOCK_SIZE:SUPERBLOCK_SIZE + len(identity)] = identity
    out[table_offset:table_offset + len(table)] = table
    return bytes(out)


def data_offset_for(identity_len: int, count: int) -> int:
    return align_up(align_up(SUPERBLOCK_SIZE + identity_len) + ENTRY_SIZE * count)


def read_header(path: str | Path) -> StoreHeader:
    """Decode and check the superblock, identity and table. Raises StoreFormatError with a fix."""
    path = Path(path)
    repack = "repack it: glm53 pack-store --model MODEL_DIR --out " + str(path)
    kind = not_regular(path)
    if kind == "a directory":
        raise StoreFormatError(f"{path} is a directory, not a store file",
                               f"name the store file itself, e.g. {path / 'experts.glm53'}")
    if kind is not None:  # checked before open(): a FIFO would block it
        raise StoreFormatError(f"{path} is {kind}, not a store file",
                               f"point GLM53_STORE at the file pack-store wrote, or make it: glm53 pack-store "
                               f"--model MODEL_DIR --out {path}")
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise StoreFormatError(f"store {path} does not exist",
                               f"make it: glm53 pack-store --model MODEL_DIR --out {path}") from None
    try:
        size = os.fstat(fd).st_size
        sb = os.pread(fd, SUPERBLOCK_SIZE, 0)
        if len(sb) < SUPERBLOCK_SIZE:
            raise StoreFormatError(f"{path} is {size} bytes, too short to be a glm53 store (truncated or empty)",
                                   repack)
        (magic, version, sb_size, align, esize, id_off, id_len, table_offset, count, data_offset,
         file_size, digest, _reserved) = _SB.unpack(sb)
        if magic != MAGIC:
            raise StoreFormatError(f"{path} is not a glm53 expert store (magic {magic!r}, expected {MAGIC!r})",
                                   f"point GLM53_STORE at a file made by pack-store, or {repack}")
        if version != VERSION:
            raise StoreFormatError(f"{path} is store format version {version}; this glm53 reads version {VERSION}",
                                   f"{repack} (or run the glm53 release that wrote it)")
        if (sb_size, align, esize, id_off) != (SUPERBLOCK_SIZE, ALIGN, ENTRY_SIZE, SUPERBLOCK_SIZE) \
                or table_offset < id_off + id_len or data_offset < table_offset + esize * count:
            raise StoreFormatError(f"{path}: the superblock is inconsistent (damaged header)", repack)
        if size != file_size:
            what = "truncated" if size < file_size else "longer than its header says"
            raise StoreFormatError(f"{path} is {what}: {size} bytes on disk, the header says {file_size} "
                                   "(an interrupted copy or a damaged file)", repack)
        # Before anything is read by these lengths: a damaged one would ask for exabytes (MemoryError, OverflowError).
        if data_offset > size:
            raise StoreFormatError(f"{path}: the superblock is inconsistent (damaged header): its identity of "
                                   f"{id_len} bytes and table of {count} records end beyond the end of the file "
                                   f"({size} bytes)", repack)
        identity = os.pread(fd, id_len, id_off)
        table = os.pread(fd, esize * count, table_offset)
    finally:
        os.close(fd)
    if meta_digest(sb, identity, table) != digest:
        raise StoreFormatError(f"{path}: the header or record table fails its sha256 check (damaged header)", repack)
    try:
        ident = json.loads(identity)
        entries = [RecordEntry(*_ENTRY.unpack_from(table, i * esize)) for i in range(count)]
        head = StoreHeader(version, ident, identity, entries, table_offset, data_offset, file_size, digest)
    except (ValueError, KeyError, TypeError) as exc:
        raise StoreFormatError(f"{path}: the identity block cannot be decoded ({exc})", repack) from None
    for e in entries:
        if e.offset % ALIGN or e.offset < data_offset or e.offset + e.extent > file_size \
                or e.layer not in head.layer_layout or e.length != head.layout(e.layer).length:
            raise StoreFormatError(f"{path}: table entry for layer {e.layer}, expert {e.expert} is inconsistent",
                                   repack)
    return head

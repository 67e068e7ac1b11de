"""The checkpoint as it is on disk: safetensors headers of every `*.safetensors`, config.json, expert tensors.

Tensors are found by reading every shard's header, never model.safetensors.index.json (the published
checkpoint's index omits tensors). The index is consulted only to name a shard that it
lists but that is missing on disk, which makes the error message precise.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xxhash

from store.errors import CheckpointError
from store.format import PROJECTIONS, SEGMENT_ORDER, Layout
from store.safetensors_header import SafetensorsHeaderError, read_safetensors_header

FINGERPRINT_BLOCKS = 16
FINGERPRINT_BLOCK = 64 << 10
ST_DTYPES = {"I16": ("int16", 2), "F16": ("float16", 2), "I32": ("int32", 4), "BF16": ("bfloat16", 2),
             "F32": ("float32", 4), "I8": ("int8", 1), "U8": ("uint8", 1), "I64": ("int64", 8),
             "F64": ("float64", 8), "BOOL": ("bool", 1), "U16": ("uint16", 2), "U32": ("uint32", 4),
             "U64": ("uint64", 8), "F8_E4M3": ("f8e4m3", 1), "F8_E5M2": ("f8e5m2", 1)}
EXPERT_RE = re.compile(r"^(?P<prefix>.*layers)\.(?P<layer>\d+)\.mlp\.experts\.(?P<expert>\d+)\."
                       r"(?P<proj>gate|up|down)_proj\.(?P<part>trellis|suh|svh|mul1|mcg)$")
CODEBOOK_MARKERS = ("mul1", "mcg")
SHARD_RE = re.compile(r"^(?P<stem>.+)-(?P<i>\d+)-of-(?P<n>\d+)\.safetensors$")


@dataclass(frozen=True)
class TensorRef:
    name: str
    shard: str          # file name inside the checkpoint directory
    dtype: str          # safetensors dtype string, e.g. "I16"
    shape: tuple[int, ...]
    offset: int         # absolute byte offset in the shard file
    nbytes: int


@dataclass(frozen=True)
class Shard:
    name: str
    size: int
    mtime_ns: int


@dataclass
class Checkpoint:
    root: Path
    config: dict
    config_sha256: str
    shards: list[Shard]
    tensors: dict[str, TensorRef]

    @property
    def text_config(self) -> dict:
        # Glm5NextForConditionalGeneration nests the language model's settings under text_config.
        return self.config.get("text_config") or self.config


def scan_checkpoint(model_dir: str | Path) -> Checkpoint:
    root = Path(model_dir)
    if not root.is_dir():
        raise CheckpointError(f"model directory {root} does not exist",
                              "pass --model with the checkpoint directory (the one holding config.json)")
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{root} has no config.json", "point --model at the checkpoint directory itself")
    cfg_bytes = cfg_path.read_bytes()
    try:
        config = json.loads(cfg_bytes)
    except ValueError as exc:
        raise CheckpointError(f"{cfg_path} is not valid JSON ({exc})",
                              "restore config.json from the download") from None
    files = sorted(p for p in root.glob("*.safetensors") if p.is_file())
    if not files:
        raise CheckpointError(f"{root} has no *.safetensors files", "download the checkpoint: glm53 model fetch")
    shards, tensors = [], {}
    for p in files:
        st = p.stat()
        shards.append(Shard(p.name, st.st_size, st.st_mtime_ns))
        try:
            head = read_safetensors_header(p)
        except SafetensorsHeaderError as exc:
            raise CheckpointError(str(exc), "restore the file from the original download (glm53 model verify DIR)") \
                from None
        for name, t in head.tensors.items():
            if head.data_start + t.end > st.st_size:
                raise CheckpointError(f"{p}: tensor {name} lies beyond the end of the file (truncated shard)",
                                      "restore the file from the original download (glm53 model verify DIR)")
            tensors[name] = TensorRef(name, p.name, t.dtype, t.shape, head.data_start + t.begin, t.nbytes)
    return Checkpoint(root, config, hashlib.sha256(cfg_bytes).hexdigest(), shards, tensors)


def missing_shards_hint(root: Path) -> str:
    """Shards that are evidently missing, from the index or the `-0000i-of-0000n` numbering. Diagnostics only:
    discovery never uses the index."""
    gone = set()
    try:
        names = set(json.loads((root / "model.safetensors.index.json").read_text())["weight_map"].values())
        gone |= {n for n in names if not (root / n).is_file()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    for p in root.glob("*-of-*.safetensors"):
        m = SHARD_RE.match(p.name)
        if m:
            gone |= {f"{m['stem']}-{i:0{len(m['i'])}d}-of-{m['n']}.safetensors" for i in range(1, int(m["n"]) + 1)
                     if not (root / f"{m['stem']}-{i:0{len(m['i'])}d}-of-{m['n']}.safetensors").is_file()}
    return f"; shard(s) missing from {root}: {', '.join(sorted(gone))}" if gone else ""


def fingerprint(path: Path, size: int) -> str:
    """xxh3-64 over 16 blocks of 64 KiB at fixed, evenly spaced offsets (the whole file when small).

    A cheap content check for every start: different weights of the same shapes (another seed or revision)
    change it, and it reads ~1 MiB per shard instead of the whole 125 GB."""
    h = xxhash.xxh3_64()
    with open(path, "rb", buffering=0) as f:
        if size <= FINGERPRINT_BLOCKS * FINGERPRINT_BLOCK:
            h.update(f.read())
        else:
            span = size - FINGERPRINT_BLOCK
            for i in range(FINGERPRINT_BLOCKS):
                h.update(os.pread(f.fileno(), FINGERPRINT_BLOCK, span * i // (FINGERPRINT_BLOCKS - 1)))
    return h.hexdigest()


@dataclass
class ExpertSet:
    """Every routed expert the store will hold, with the tensors that make up each record."""

    prefix: str
    num_hidden_layers: int
    mtp_layers: list[int]
    hidden: int
    intermediate: int
    n_experts: int
    codebook: dict                                   # {"kind": "mul1"|"mcg"|"3inst", "value": int|None}
    layers: dict[int, Layout] = field(default_factory=dict)
    # (layer, expert) -> segment name -> TensorRef, in SEGMENT_ORDER
    parts: dict[tuple[int, int], dict[str, TensorRef]] = field(default_factory=dict)

    def keys(self) -> list[tuple[int, int]]:
        return sorted(self.parts)


def _cfg_int(cfg: dict, *names: str) -> int | None:
    for n in names:
        if isinstance(cfg.get(n), int):
            return cfg[n]
    return None


def find_experts(ck: Checkpoint, include_mtp: bool = False) -> ExpertSet:
    """Group expert tensors into records and check them against config.json. Raises CheckpointError."""
    cfg = ck.text_config
    n_layers = _cfg_int(cfg, "num_hidden_layers")
    hidden = _cfg_int(cfg, "hidden_size")
    inter = _cfg_int(cfg, "moe_intermediate_size")
    n_exp = _cfg_int(cfg, "n_routed_experts", "num_experts")
    if None in (n_layers, hidden, inter, n_exp):
        raise CheckpointError(f"{ck.root}/config.json lacks num_hidden_layers, hidden_size, moe_intermediate_size "
                              "or n_routed_experts", "use the checkpoint's own config.json")
    n_mtp = _cfg_int(cfg, "num_nextn_predict_layers") or 0
    found: dict[tuple[int, int], dict[str, TensorRef]] = {}
    markers: dict[tuple[int, int, str], TensorRef] = {}
    prefixes = set()
    for name, ref in ck.tensors.items():
        m = EXPERT_RE.match(name)
        if not m:
            continue
        layer, expert = int(m["layer"]), int(m["expert"])
        if layer >= n_layers and not include_mtp:
            continue        # MTP head (layers >= num_hidden_layers): not used for serving
        prefixes.add(m["prefix"])
        if m["part"] in CODEBOOK_MARKERS:
            markers[(layer, expert, m["proj"])] = ref
        else:
            found.setdefault((layer, expert), {})[f"{m['proj']}.{m['part']}"] = ref
    if not found:
        raise CheckpointError(f"{ck.root} has no routed expert tensors (…mlp.experts.N.gate_proj.trellis); "
                              "is it an EXL3 Glm5Next checkpoint?" + missing_shards_hint(ck.root),
                              "point --model at the EXL3 checkpoint directory")
    if len(prefixes) > 1:
        raise CheckpointError(f"{ck.root}: expert tensors under several prefixes {sorted(prefixes)}",
                              "remove the stray shard(s) from the checkpoint directory")
    layers = sorted({k[0] for k in found})
    absent = [i for i in _expected_moe_layers(cfg, n_layers) if i not in layers]
    if absent:
        raise CheckpointError(f"{ck.root}: config.json makes layer(s) {absent} MoE layers, but no expert tensors "
                              f"for them are on disk{missing_shards_hint(ck.root)}",
                              "restore the missing shard(s) from the original download "
                              "(glm53 model verify DIR --lock LOCK lists them; glm53 model fetch re-downloads)")
    missing = [f"{prefixes.copy().pop()}.{layer}.mlp.experts.{e}.{s.replace('.', '_proj.', 1)}"
               for layer in layers for e in range(n_exp) for s in SEGMENT_ORDER
               if s not in found.get((layer, e), {})]
    extra = sorted(k for k in found if k[1] >= n_exp)
    if missing or extra:
        what = (f"{len(missing)} expert tensor(s) missing, e.g. {missing[0]}" if missing
                else f"expert ids beyond n_routed_experts={n_exp}, e.g. layer {extra[0][0]} expert {extra[0][1]}")
        raise CheckpointError(f"{ck.root}: {what}{missing_shards_hint(ck.root)}",
                              "restore the missing shard(s) from the original download "
                              "(glm53 model verify DIR --lock LOCK lists them; glm53 model fetch re-downloads)")
    es = ExpertSet(prefixes.pop(), n_layers, list(range(n_layers, n_layers + n_mtp)), hidden, inter, n_exp,
                   _codebook(ck, markers, found))
    for layer in layers:
        es.layers[layer] = _layer_layout(ck, layer, found, hidden, inter, n_exp)
    es.parts = {k: {s: v[s] for s in SEGMENT_ORDER} for k, v in found.items()}
    return es


def _expected_moe_layers(cfg: dict, n_layers: int) -> list[int]:
    """The MoE layers config.json promises (mlp_layer_types, else first_k_dense_replace); [] when it says neither."""
    types = cfg.get("mlp_layer_types")
    if isinstance(types, list) and len(types) == n_layers:
        return [i for i, t in enumerate(types) if t in ("sparse", "moe")]
    first = cfg.get("first_k_dense_replace")
    return list(range(first, n_layers)) if isinstance(first, int) else []


def _codebook(ck: Checkpoint, markers: dict, found: dict) -> dict:
    """One codebook for all experts (the slot arena assumes it); the marker's value is recorded once."""
    kinds = {}
    for layer, expert in found:
        for p in PROJECTIONS:
            ref = markers.get((layer, expert, p))
            kinds.setdefault(ref.name.rsplit(".", 1)[1] if ref else "3inst", ref)
    if len(kinds) > 1:
        raise CheckpointError(f"{ck.root}: experts use mixed EXL3 codebooks {sorted(kinds)}",
                              "the store needs one codebook for all routed experts; re-quantize consistently")
    kind, ref = next(iter(kinds.items()))
    value = None
    if ref is not None:
        with open(ck.root / ref.shard, "rb") as f:
            raw = os.pread(f.fileno(), ref.nbytes, ref.offset)
        value = int(np.frombuffer(raw, dtype=np.int32)[0]) if ref.dtype == "I32" and ref.nbytes == 4 else None
    return {"kind": kind, "value": value}


def _layer_layout(ck: Checkpoint, layer: int, found: dict, hidden: int, inter: int, n_exp: int) -> Layout:
    refs = found[(layer, 0)]
    k_bits = []
    for p in PROJECTIONS:
        shape = refs[f"{p}.trellis"].shape
        if len(shape) != 3 or shape[2] % 16:
            raise CheckpointError(f"{ck.root}: layer {layer} {p}_proj.trellis has shape {shape}, "
                                  "expected (in/16, out/16, 16*K)", "use an EXL3 checkpoint")
        k_bits.append(shape[2] // 16)
    layout = Layout.build(hidden, inter, tuple(k_bits))
    want = {s.name: s for s in layout.segments}
    dt = {"int16": "I16", "float16": "F16"}
    for e in range(n_exp):
        for name, ref in found[(layer, e)].items():
            seg = want[name]
            if ref.shape != seg.shape or ref.dtype != dt[seg.dtype] or ref.nbytes != seg.nbytes:
                raise CheckpointError(
                    f"{ck.root}: {ref.name} is {ref.dtype}{list(ref.shape)}, expected {dt[seg.dtype]}"
                    f"{list(seg.shape)} (hidden {hidden}, moe_intermediate {inter}, K {layout.k_bits})",
                    "the store needs every expert of a layer quantized alike; check the checkpoint")
    return layout


class SourceReader:
    """Assembles slot images from the checkpoint with pread: one open fd per shard, shared by threads."""

    def __init__(self, ck: Checkpoint, es: ExpertSet):
        self.ck, self.es = ck, es
        self.fds = {s.name: os.open(ck.root / s.name, os.O_RDONLY) for s in ck.shards}

    def fill(self, layer: int, expert: int, buf: np.ndarray) -> None:
        """Write the record for (layer, expert) into buf[:extent], gaps and padding zeroed."""
        layout = self.es.layers[layer]
        for a, b in layout.gaps():
            buf[a:b] = 0
        mv = memoryview(buf)
        for seg in layout.segments:
            ref = self.es.parts[(layer, expert)][seg.name]
            view, pos = mv[seg.offset:seg.offset + seg.nbytes], 0
            while pos < seg.nbytes:
                n = os.preadv(self.fds[ref.shard], [view[pos:]], ref.offset + pos)
                if n <= 0:
                    raise CheckpointError(f"{self.ck.root / ref.shard}: short read of {ref.name} (file shrank?)",
                                          "restore the shard from the original download (glm53 model verify DIR)")
                pos += n

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}

    def __enter__(self) -> SourceReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""A minimal expert-only EXL3 checkpoint: config.json and routed-expert tensors, written streaming.

For the store's benchmark and unit tests, which need many large records quickly and nothing else. The full
Glm5Next test model (attention, norms, tokenizer, ...) is glm53.fixture's job. Deterministic for a seed.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from store.format import PROJECTIONS, SEGMENT_ORDER

MUL1 = 0x83DCD12D - (1 << 32)       # the mul1 multiplier as the int32 a marker tensor holds


def _expert_tensors(layer: int, expert: int, hidden: int, inter: int, k_bits: int, prefix: str) -> list:
    dims = {"gate": (hidden, inter), "up": (hidden, inter), "down": (inter, hidden)}
    out = []
    for seg in SEGMENT_ORDER:
        proj, part = seg.split(".")
        n_in, n_out = dims[proj]
        base = f"{prefix}.{layer}.mlp.experts.{expert}.{proj}_proj"
        if part == "trellis":
            out.append((f"{base}.trellis", "I16", (n_in // 16, n_out // 16, 16 * k_bits)))
        else:
            out.append((f"{base}.{part}", "F16", (n_in if part == "suh" else n_out,)))
    out += [(f"{prefix}.{layer}.mlp.experts.{expert}.{p}_proj.mul1", "I32", ()) for p in PROJECTIONS]
    return out


def _nbytes(dtype: str, shape: tuple) -> int:
    return int(np.prod(shape, dtype=np.int64)) * {"I16": 2, "F16": 2, "I32": 4, "BF16": 2}[dtype]


def _fill(rng: np.random.Generator, name: str, dtype: str, shape: tuple) -> bytes:
    n = _nbytes(dtype, shape)
    if name.endswith(".mul1"):
        return struct.pack("<i", MUL1)
    if dtype == "F16":
        sign = rng.choice(np.array([-1.0, 1.0], dtype=np.float16), size=shape)
        return (sign * rng.uniform(0.5, 1.5, size=shape).astype(np.float16)).astype("<f2").tobytes()
    return rng.bytes(n)                 # any int16 bit pattern is a valid trellis


def write_safetensors(path: Path, tensors: list[tuple[str, str, tuple]], make) -> None:
    """Write tensors [(name, dtype, shape)] whose bytes come from make(name, dtype, shape), one at a time."""
    header, off = {}, 0
    for name, dtype, shape in tensors:
        n = _nbytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, dtype, shape in tensors:
            f.write(make(name, dtype, shape))


def write_expert_checkpoint(out: Path, *, hidden: int = 256, moe_intermediate: int = 128, layers: int = 3,
                            dense_layers: int = 1, experts: int = 8, k_bits: int = 3, seed: int = 0,
                            shards: int = 1, mtp_layers: int = 1, prefix: str = "model.language_model.layers",
                            write_index: bool = True) -> Path:
    """Layers [dense_layers, layers) are MoE; layers >= `layers` are the MTP head (experts included, as in
    the real checkpoint). Each shard holds whole layers; shard 1 also holds a non-expert tensor."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next",
              "text_config": {"hidden_size": hidden, "moe_intermediate_size": moe_intermediate,
                              "num_hidden_layers": layers, "first_k_dense_replace": dense_layers,
                              "n_routed_experts": experts, "num_nextn_predict_layers": mtp_layers,
                              "num_experts_per_tok": min(8, experts)}}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    moe = list(range(dense_layers, layers + mtp_layers))
    groups = [moe[i::shards] for i in range(shards)]
    rng = np.random.default_rng(seed)
    weight_map = {}
    for i, group in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        tensors = [("model.language_model.embed_tokens.weight", "BF16", (64, hidden))] if i == 0 else []
        for layer in sorted(group):
            for e in range(experts):
                tensors += _expert_tensors(layer, e, hidden, moe_intermediate, k_bits, prefix)
        write_safetensors(out / name, tensors, lambda n, d, s: _fill(rng, n, d, s))
        weight_map.update({t[0]: name for t in tensors})
    if write_index:
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out

"""The model's shape: the few numbers the plan needs, from a checkpoint on disk or GLM-5.3-Flash defaults.

Sizes come from the safetensors headers of every `*.safetensors` file in the directory (8-byte length, JSON
header; no weights are read). We never read `model.safetensors.index.json`: the published 3.05 bpw branch
leaves 22 indexer tensors out of it, and exllamav3 globs the files too (DESIGN section 1).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

from store.safetensors_header import SafetensorsHeaderError, read_safetensors_header

MIB = 1 << 20
KIB = 1 << 10

# A routed expert's tensors: ...layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.{trellis,suh,svh,...}
EXPERT_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.experts\.(\d+)\.(?:gate|up|down)_proj\.")
LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# Layer types that keep a per-token KV cache (MLA); the linear-attention (KDA) layers keep a fixed-size state.
MLA_TYPES = ("deepseek_sparse_attention", "indexed_attention", "full_attention", "attention", "mla")


class ShapeError(ValueError):
    """The checkpoint directory cannot be read as a Glm5Next model."""


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int                   # decoder layers used for serving (the MTP layer is not counted)
    moe_layers: int
    experts_per_layer: int
    top_k: int
    expert_bytes: int             # one routed expert: gate|up|down trellis + suh/svh (one VRAM slot image)
    always_used_bytes: int        # everything a token always touches: attention, dense MLPs, shared experts, ...
    kv_bytes_per_token: int       # MLA layers' cache per token (all layers together)
    state_bytes_per_seq: int      # KDA layers' fixed recurrent state per sequence (all layers together)
    mla_layers: int
    mtp_layer: int | None         # index of the MTP head's layer (skipped for serving)
    source: str                   # where the numbers came from, for the plan's reasons
    max_context: int | None = None  # config.json's max_position_embeddings (None: not given)
    # Per decoder layer, for splitting the layers across GPUs (glm53.split); empty: not known (the defaults' and
    # a headerless checkpoint's), then glm53.split assumes GLM's layout and spreads the weights evenly.
    layer_bytes: tuple[int, ...] = ()    # each layer's always-used bytes (the rest of always_used: embedding, head)
    moe_layer_ids: tuple[int, ...] = ()  # decoder layers with routed experts
    mla_layer_ids: tuple[int, ...] = ()  # decoder layers with a per-token KV cache

    @property
    def experts(self) -> int:
        return self.moe_layers * self.experts_per_layer

    @property
    def all_experts_bytes(self) -> int:
        return self.experts * self.expert_bytes

    def to_json(self) -> dict:
        return {**asdict(self), "experts": self.experts, "all_experts_bytes": self.all_experts_bytes}


def _expert_bytes(hidden: int, moe_intermediate: int, bits: float) -> int:
    """EXL3 trellis of gate, up (hidden x inter) and down (inter x hidden) at `bits`, plus fp16 suh/svh."""
    trellis = round(3 * hidden * moe_intermediate * bits / 8)
    signs = 3 * 2 * (hidden + moe_intermediate)
    return trellis + signs


def _kv_per_token(mla_layers: int, kv_lora_rank: int, rope_dim: int, index_dim: int) -> int:
    # MLA caches the compressed latent plus the rope key, and the DSA indexer its own key, all 16-bit.
    return mla_layers * (kv_lora_rank + rope_dim + index_dim) * 2


def _state_per_seq(kda_layers: int, heads: int, head_dim: int) -> int:
    # KDA keeps one fp32 head_dim x head_dim matrix per head per layer, whatever the sequence length.
    return kda_layers * heads * head_dim * head_dim * 4


# GLM-5.3-Flash, EXL3 3.05 bpw (DESIGN section 1): 9 MiB of K=3 trellis + 36 KiB of suh/svh per expert.
DEFAULT_SHAPE = ModelShape(
    hidden=4096, layers=45, moe_layers=42, experts_per_layer=288, top_k=8,
    expert_bytes=_expert_bytes(4096, 2048, 3.0),
    always_used_bytes=5_800_000_000,
    kv_bytes_per_token=_kv_per_token(11, 512, 64, 128),
    state_bytes_per_seq=_state_per_seq(34, 32, 128),
    mla_layers=11, mtp_layer=45,
    source="GLM-5.3-Flash 3.05 bpw defaults (no model mounted; KV and KDA state are estimates)",
)
assert DEFAULT_SHAPE.expert_bytes == 9 * MIB + 36 * KIB


def read_safetensors_sizes(path: Path) -> dict[str, int]:
    """Tensor name -> byte size, from one file's header only."""
    try:
        return read_safetensors_header(path).sizes()
    except SafetensorsHeaderError as exc:
        raise ShapeError(str(exc)) from None


def _text_config(config: dict) -> dict:
    # Multimodal wrappers nest the language model's config; a plain causal LM keeps it flat.
    return config.get("text_config") or config


def from_checkpoint(model_dir: str | Path) -> ModelShape:
    """Read config.json and every *.safetensors header under `model_dir`."""
    root = Path(model_dir)
    try:
        config = json.loads((root / "config.json").read_text())
    except FileNotFoundError:
        raise ShapeError(f"no config.json in {root}") from None
    except ValueError as exc:
        raise ShapeError(f"{root}/config.json is not JSON: {exc}") from None
    tc = _text_config(config)
    try:
        layers = int(tc["num_hidden_layers"])
        hidden = int(tc["hidden_size"])
        n_experts = int(tc.get("n_routed_experts") or tc["num_experts"])
        top_k = int(tc["num_experts_per_tok"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ShapeError(f"{root}/config.json lacks {exc} (num_hidden_layers, hidden_size, n_routed_experts, "
                         "num_experts_per_tok are needed)") from None
    mlp_types = tc.get("mlp_layer_types") or (["dense"] * int(tc.get("first_k_dense_replace", 0))
                                              + ["sparse"] * (layers - int(tc.get("first_k_dense_replace", 0))))
    attn_types = tc.get("layer_types") or ["linear_attention" if i % 4 != 3 else "deepseek_sparse_attention"
                                           for i in range(layers)]
    mla = sum(1 for t in attn_types[:layers] if t in MLA_TYPES)
    lin = tc.get("linear_attn_config") or {}
    kv = _kv_per_token(mla, int(tc.get("kv_lora_rank", 512)), int(tc.get("qk_rope_head_dim", 64)),
                       int(tc.get("index_head_dim", 128)))
    state = _state_per_seq(layers - mla, int(lin.get("num_heads", tc.get("linear_num_heads", 32))),
                           int(lin.get("head_dim", tc.get("linear_head_dim", 128))))
    mtp = layers if int(tc.get("num_nextn_predict_layers", 0) or 0) > 0 else None
    native = int(tc.get("max_position_embeddings") or 0) or None

    sizes: dict[str, int] = {}
    files = sorted(root.glob("*.safetensors"))
    for path in files:
        sizes.update(read_safetensors_sizes(path))
    moe_from_config = sum(1 for t in mlp_types[:layers] if t == "sparse")
    if not files:
        inter = int(tc.get("moe_intermediate_size", 2048))
        return ModelShape(hidden, layers, moe_from_config, n_experts, top_k, _expert_bytes(hidden, inter, 3.0),
                          DEFAULT_SHAPE.always_used_bytes, kv, state, mla, mtp,
                          f"{root}/config.json; no *.safetensors yet, so sizes are 3 bpw estimates", native)

    per_expert: dict[tuple[int, int], int] = defaultdict(int)
    always = 0
    per_layer = [0] * layers
    for name, nbytes in sizes.items():
        layer = int(m.group(1)) if (m := LAYER_RE.search(name)) else None
        if layer is not None and layer >= layers:
            continue  # the MTP head: not used for serving, and the store skips it
        if e := EXPERT_RE.search(name):
            per_expert[(int(e.group(1)), int(e.group(2)))] += nbytes
        else:
            always += nbytes
            if layer is not None:
                per_layer[layer] += nbytes
    if not per_expert:
        raise ShapeError(f"{root}: no routed-expert tensors (layers.L.mlp.experts.E.*_proj.*) in "
                         f"{len(files)} safetensors file(s)")
    moe_layers = sorted({layer for layer, _ in per_expert})
    counts = defaultdict(int)
    for layer, _ in per_expert:
        counts[layer] += 1
    short = [layer for layer in moe_layers if counts[layer] != n_experts]
    if short:
        raise ShapeError(f"{root}: MoE layer {short[0]} has {counts[short[0]]} experts on disk, config says "
                         f"{n_experts} (incomplete download?)")
    # Slots must hold the largest expert; in a well-formed checkpoint they are all the same size.
    mla_ids = tuple(i for i, t in enumerate(attn_types[:layers]) if t in MLA_TYPES)
    return ModelShape(hidden, layers, len(moe_layers), n_experts, top_k, max(per_expert.values()), always, kv,
                      state, mla, mtp, f"{root} ({len(files)} safetensors headers)", native,
                      tuple(per_layer), tuple(moe_layers), mla_ids)

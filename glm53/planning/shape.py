"""The model's shape: the few numbers the plan needs, from a checkpoint on disk or GLM-5.3-Flash defaults.

Sizes come from the safetensors headers of every `*.safetensors` file in the directory (8-byte length, JSON
header; no weights are read). We never read `model.safetensors.index.json`: the published 3.05 bpw branch
leaves 22 indexer tensors out of it, and exllamav3 globs the files too.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

from store.files import not_regular
from store.safetensors_header import SafetensorsHeaderError, read_safetensors_header

MIB = 1 << 20
KIB = 1 << 10

# A routed expert's tensors: ...layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.{trellis,suh,svh,...}
CODEBOOK_MARKERS = (".mcg", ".mul1")
EXPERT_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.experts\.(\d+)\.(?:gate|up|down)_proj\.")
LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# Layer types that keep a per-token KV cache (MLA); the linear-attention (KDA) layers keep a fixed-size state.
MLA_TYPES = ("deepseek_sparse_attention", "indexed_attention", "full_attention", "attention", "mla")
EMBED_RE = re.compile(r"(?:^|\.)embed_tokens\.")
VISION_PREFIX = "model.visual."


class ShapeError(ValueError):
    """The checkpoint directory cannot be read as a Glm5Next model."""


F16 = 2   # fp16 / bf16 bytes
F32 = 4
# Transformers' Glm5NextTextConfig defaults (transformers 5.23.0), which a config.json may leave out: exllamav3 reads
# the same keys. NoPE MLA (no rope dims), 64 KDA heads of 128 with a 4-tap conv, and every MLA layer's indexer
# "full" with k-pool compression of 16.
CONFIG_DEFAULTS = {"kv_lora_rank": 512, "qk_rope_head_dim": 0, "index_head_dim": 128, "index_kpool": 16,
                   "linear_num_heads": 64, "linear_head_dim": 128, "linear_conv_kernel_dim": 4, "hc_mult": 4,
                   "moe_intermediate_size": 2048, "vocab_size": 154880}
# exllamav3's MoE prefill: the batched reconstruct tier dequantizes a group of up to EXL3_MOE_RECON_BATCH (16)
# experts' gate and up weights to fp16 within EXL3_MOE_RECON_MB (256 MiB) (modules/moe_batch_recon.py batch_cap).
MOE_RECON_MB = 256 * MIB
MOE_RECON_BATCH = 16
# exllamav3 runs the KDA chunk scan over sub-ranges of this many tokens (EXL3_GDN_SUB_CHUNK).
KDA_SUB_CHUNK = 2048


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int                   # decoder layers used for serving (the MTP layer is not counted)
    moe_layers: int
    experts_per_layer: int
    top_k: int
    expert_bytes: int             # one routed expert: gate|up|down trellis + suh/svh (one VRAM slot image)
    always_used_bytes: int        # VRAM weights every token touches: attention, dense MLPs, shared experts, head
    kv_bytes_per_token: int       # MLA layers' paged cache per token, indexer planes included (all layers together)
    state_bytes_per_seq: int      # KDA layers' recurrent state per cache sequence slot (all layers together)
    mla_layers: int
    mtp_layer: int | None         # index of the MTP head's layer (skipped for serving)
    source: str                   # where the numbers came from, for the plan's reasons
    max_context: int | None = None  # config.json's max_position_embeddings (None: not given)
    # Per decoder layer, for splitting the layers across GPUs (glm53.planning.split); empty: not known (the defaults' and
    # a headerless checkpoint's), then glm53.planning.split assumes GLM's layout and spreads the weights evenly.
    layer_bytes: tuple[int, ...] = ()    # each layer's own VRAM bytes (the rest of always_used: the head)
    moe_layer_ids: tuple[int, ...] = ()  # decoder layers with routed experts
    mla_layer_ids: tuple[int, ...] = ()  # decoder layers with a per-token KV cache
    host_bytes: int = 0           # weights exllamav3 keeps in host RAM: the unquantized embedding table (prefer_cpu)
    checkpoint_bytes: int = 0     # one recurrent-state checkpoint in host RAM (the Generator's prefix reuse)
    # Prefill activations: (phase, bytes per chunk token, fixed bytes, bytes per sub-range token, sub-range tokens) for
    # each step of a layer; a chunk's peak is the largest phase's (temporaries are freed between steps).
    prefill_phases: tuple[tuple[str, int, int, int, int], ...] = ()
    # The vision tower (model.visual.*), where the checkpoint has one: its VRAM weights, and the device bytes its
    # forward allocates at its peak per image patch (an estimate: glm53.planning.shape.vision_patch_bytes).
    vision_bytes: int = 0
    vision_bytes_per_patch: int = 0

    @property
    def experts(self) -> int:
        return self.moe_layers * self.experts_per_layer

    @property
    def all_experts_bytes(self) -> int:
        return self.experts * self.expert_bytes

    def prefill_bytes(self, chunk: int) -> tuple[int, str]:
        """Device bytes a prefill forward of `chunk` tokens allocates at its peak, and the layer kind it peaks in."""
        if not self.prefill_phases:
            return 0, "none"
        return max((per_token * chunk + fixed + per_sub * min(chunk, sub), name)
                   for name, per_token, fixed, per_sub, sub in self.prefill_phases)

    def to_json(self) -> dict:
        return {**asdict(self), "experts": self.experts, "all_experts_bytes": self.all_experts_bytes}


def _expert_bytes(hidden: int, moe_intermediate: int, bits: float) -> int:
    """EXL3 trellis of gate, up (hidden x inter) and down (inter x hidden) at `bits`, plus fp16 suh/svh."""
    trellis = round(3 * hidden * moe_intermediate * bits / 8)
    signs = 3 * 2 * (hidden + moe_intermediate)
    return trellis + signs


def _kv_per_token(mla_layers: int, kv_lora_rank: int, rope_dim: int, index_dim: int, kpool: int,
                  full_indexers: int) -> int:
    """exllamav3's CacheLayer_MLA_fp16 per token: every MLA layer's fp16 latent (kv_lora_rank) and rope key
    (qk_rope_head_dim: 0 in NoPE); a layer with a "full" indexer adds its key plane (index_head_dim, [k || gate]
    of twice that with k-pool compression) and the pooled-key plane (index_head_dim per kpool tokens)."""
    latent = mla_layers * (kv_lora_rank + rope_dim) * F16
    plane = index_dim * (2 if kpool else 1) * F16
    pooled = index_dim * F16 / kpool if kpool else 0
    return latent + math.ceil(full_indexers * (plane + pooled))


def _kda_state(kda_layers: int, heads: int, head_dim: int, conv_kernel: int) -> tuple[int, int]:
    """(device bytes per cache sequence slot, host bytes per recurrent checkpoint), from exllamav3's GDNLayerState
    with max_history 0: two fp16 state rows per slot (Cache's recurrent_dtype default), the bf16 conv ring of the
    q|k|v channels, and one row of staged scan inputs (bf16 conv output and beta, fp32 per-channel gate); a
    checkpoint (get_checkpoint_size) is the conv ring and one state row."""
    qkv = 3 * heads * head_dim
    state = heads * head_dim * head_dim * F16
    per_slot = 2 * state + qkv * conv_kernel * F16 + qkv * F16 + heads * F16 + heads * head_dim * F32
    return kda_layers * per_slot, kda_layers * (qkv * conv_kernel * F16 + state)


def _moe_recon_scratch(hidden: int, moe_intermediate: int) -> int:
    """The batched reconstruct's fp16 weight scratch for one group, plus an eighth for its gathered row slabs."""
    per = 2 * hidden * moe_intermediate * F16  # gate and up, live together (batch_cap's `per`)
    group = max(1, min(MOE_RECON_BATCH, MOE_RECON_MB // per)) * per
    return group + group // 8


def _prefill_phases(hidden: int, hc_mult: int, top_k: int, moe_intermediate: int, moe: bool, kda: bool, heads: int,
                    head_dim: int,
                    attn_heads: int, kv_lora_rank: int, topk_tokens: int, index_heads: int, index_dim: int
                    ) -> tuple[tuple[str, int, int, int, int], ...]:
    """What each step of exllamav3 1.6.5's prefill holds at its peak, as (phase, bytes per chunk token, fixed bytes,
    bytes per token of a sub-range, the sub-range's tokens). Every phase holds the residual: the mHC streams
    (hc_mult x hidden fp32), the block's fp32 output and its fp16 input.
    KDA (gated_delta_net.py): the fp16 q|k|v projection, its bf16 conv output, the fp32 output gate z and
    per-channel gate g; the scan (vendor/fla chunk_kda) runs over sub-ranges of EXL3_GDN_SUB_CHUNK (2,048) tokens,
    each holding l2-normed q and k, g's chunk cumsum, w / kg / qg / u, one bf16 state per 64 tokens, v_new, o and the
    intra-chunk A matrices. MoE (block_sparse_mlp.py, deterministic accumulation): the fp32 slot scratch of
    (chunk x top_k, hidden), the fp32 routed sum and shared-expert output, the fp16 input copy; fixed: the batched
    reconstruct's weight scratch (EXL3_MOE_RECON_MB) and its row slabs. MLA (mla_attn.py, sparse path): the
    absorbed queries and the latent output, head-major (heads x kv_lora_rank fp16 each), the indexer's queries
    and its int32 selection of index_topk (+ tail) tokens; fixed: the indexer's 256-row score slab. Logits are
    the last row's only (prefill stops before the head)."""
    residual = hc_mult * hidden * F32 + hidden * F32 + hidden * F16
    phases = []
    if kda:
        width = heads * head_dim
        layer = 3 * width * F16 + 2 * width * F32  # the conv output, z and g, live through the layer
        scan = (2 * width * F16 + width * F32 + 4 * width * F16 + heads * head_dim * head_dim * F16 // 64
                + 2 * width * F16 + heads * 64 * F16 + heads * 16 * F32)
        phases.append(("KDA projections and conv", residual + layer + 3 * width * F16, 0, 0, 0))
        phases.append(("KDA scan", residual + layer + width * F16, 0, scan, KDA_SUB_CHUNK))
    if moe:
        phases.append(("MoE", residual + top_k * hidden * F32 + 2 * hidden * F32 + hidden * F16,
                       _moe_recon_scratch(hidden, moe_intermediate), 0, 0))
    mla = 2 * attn_heads * kv_lora_rank * F16 + index_heads * index_dim * F16 + (topk_tokens + 32) * F32
    phases.append(("MLA", residual + mla, 16 * MIB, 0, 0))
    return tuple(phases)


def vision_patch_bytes(vc: dict) -> int:
    """Device bytes exllamav3's Glm5NextVisionModel forward holds per image patch at its peak (vision_config `vc`):
    the fp16 patch row and the fp32 residual stream, with the larger of a block's temporaries (normed fp16 input,
    fp16 gate, up and activation) and the merger's, whose rows are merge^2 patches each (fp32 input, fp16 gate, up
    and activation of the projection's width). Attention runs in fp16 rows narrower than the MLP's."""
    h, m = int(vc.get("hidden_size", 1024)), int(vc.get("intermediate_size", 4096))
    out = int(vc.get("out_hidden_size", 4096))
    proj = int(vc.get("projection_intermediate_size", 10240))
    merge, tps, p = int(vc.get("spatial_merge_size", 2)), int(vc.get("temporal_patch_size", 2)), int(
        vc.get("patch_size", 14))
    block = h * F16 + 3 * m * F16
    merger = (out * F32 + 3 * proj * F16) // merge**2
    return 3 * tps * p * p * F16 + h * F32 + max(block, merger)


# GLM-5.3-Flash's vision tower as the published 3.05 bpw checkpoint ships it (issue 42: a 0.6 GB encoder; depth 24,
# width 1024, MLP 4096, projection 10240 into the 4096-wide text model).
VISION_DEFAULT_BYTES = 600_000_000
# GLM-5.3-Flash's real geometry (transformers' Glm5NextTextConfig): 34 KDA layers of 64 heads x 128, 11 NoPE MLA
# layers (latent 512) each with a full k-pool indexer (128 dims, pools of 16), 64 attention heads of 256, mHC x4.
_DEFAULT_KDA = _kda_state(34, 64, 128, 4)
# GLM-5.3-Flash, EXL3 3.05 bpw: 9 MiB of K=3 trellis + 36 KiB of suh/svh per expert; about 5.8 GB
# of always-used weights in VRAM, and the 154,880 x 4,096 bf16 embedding table in host RAM.
DEFAULT_SHAPE = ModelShape(
    hidden=4096, layers=45, moe_layers=42, experts_per_layer=288, top_k=8,
    expert_bytes=_expert_bytes(4096, 2048, 3.0),
    always_used_bytes=5_800_000_000,
    kv_bytes_per_token=_kv_per_token(11, 512, 0, 128, 16, 11),
    state_bytes_per_seq=_DEFAULT_KDA[0],
    mla_layers=11, mtp_layer=45,
    source="GLM-5.3-Flash 3.05 bpw defaults (no model mounted; its config's geometry, exllamav3 1.6.5's cache "
           "layouts)",
    host_bytes=154880 * 4096 * F16,
    checkpoint_bytes=_DEFAULT_KDA[1],
    prefill_phases=_prefill_phases(4096, 4, 8, 2048, True, True, 64, 128, 64, 512, 2048 + 15, 32, 128),
    vision_bytes=VISION_DEFAULT_BYTES,
    vision_bytes_per_patch=vision_patch_bytes({}),
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


RESTORE = "fix: restore the config.json that came with the checkpoint"


def json_kind(value: object) -> str:
    """How a JSON value is called in a refusal."""
    if value is None:
        return "null"
    kinds = ((bool, "a JSON boolean"), (dict, "a JSON object"), (list, "a JSON array"), (str, "a JSON string"),
             (int, "a JSON number"), (float, "a JSON number"))
    return next(name for t, name in kinds if isinstance(value, t))


def load_config(root: str | Path) -> dict:
    """The checkpoint's config.json, checked as far as glm53 reads it before anything loads: a regular file (never
    opened otherwise: a FIFO would block), holding a JSON object whose text_config, if any, is an object and whose
    max_position_embeddings, if any, is a positive integer. ShapeError names the problem and the fix."""
    path = Path(root) / "config.json"
    kind = not_regular(path)
    if kind is not None:
        raise ShapeError(f"{path} is {kind}, not a regular file; {RESTORE}")
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ShapeError(f"no config.json in {root}") from None
    except UnicodeDecodeError:
        raise ShapeError(f"{path} is not text (not valid JSON); {RESTORE}") from None
    except ValueError as exc:
        raise ShapeError(f"{path} is not valid JSON ({exc}); {RESTORE}") from None
    if not isinstance(config, dict):
        raise ShapeError(f"{path} is {json_kind(config)}, not the JSON object a model's config.json is; {RESTORE}")
    text = config.get("text_config")
    if text is not None and not isinstance(text, dict):
        raise ShapeError(f"{path}: text_config is {json_kind(text)}, not a JSON object; {RESTORE}")
    native = _text_config(config).get("max_position_embeddings")
    if native is not None and not _positive_int(native):
        raise ShapeError(f"{path}: max_position_embeddings is {json.dumps(native)}, not a positive integer (the "
                         f"model's context length in tokens); {RESTORE}")
    return config


def _positive_int(value: object) -> bool:
    integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    return integral and not isinstance(value, bool) and value > 0


def _geometry(tc: dict, layers: int, hidden: int, top_k: int, moe: bool) -> dict:
    """The cache and activation sizes of config.json's geometry (transformers' defaults for keys it leaves out)."""
    def num(key: str, *alt: str) -> int:
        for k in (key, *alt):
            if tc.get(k) is not None:
                return int(tc[k])
        return CONFIG_DEFAULTS[key]

    attn_types = tc.get("layer_types") or ["linear_attention" if i % 4 != 3 else "deepseek_sparse_attention"
                                           for i in range(layers)]
    mla_idx = [i for i, t in enumerate(attn_types[:layers]) if t in MLA_TYPES]
    indexers = tc.get("indexer_types") or ["full"] * layers
    full = sum(1 for i in mla_idx if i < len(indexers) and indexers[i] == "full")
    lin = tc.get("linear_attn_config") or {}
    heads = int(lin.get("num_heads") or num("linear_num_heads"))
    head_dim = int(lin.get("head_dim") or num("linear_head_dim"))
    conv = int(lin.get("short_conv_kernel_size") or num("linear_conv_kernel_dim"))
    kpool = num("index_kpool") if tc.get("index_kpool_compress", True) else 0
    index_dim = num("index_head_dim")
    kda = layers - len(mla_idx)
    state, checkpoint = _kda_state(kda, heads, head_dim, conv)
    attn_heads = int(tc.get("num_attention_heads") or 1)
    topk_tokens = int(tc.get("index_topk") or 2048) + (kpool - 1 if kpool else 0)
    index_heads = int(tc.get("index_n_heads") or 32)
    return {"mla": len(mla_idx), "mla_ids": tuple(mla_idx),
            "kv": _kv_per_token(len(mla_idx), num("kv_lora_rank"), num("qk_rope_head_dim"), index_dim, kpool, full),
            "state": state, "checkpoint": checkpoint,
            "phases": _prefill_phases(hidden, num("hc_mult"), top_k, num("moe_intermediate_size"), moe, kda > 0,
                                      heads, head_dim, attn_heads, num("kv_lora_rank"), topk_tokens, index_heads,
                                      index_dim)}


def _tensor_place(name: str, layers: int, tied_head: bool) -> str:
    """Where exllamav3 keeps a non-expert tensor when serving text: "vram", "host" or "none" (not loaded)."""
    layer = int(m.group(1)) if (m := LAYER_RE.search(name)) else None
    if (layer is not None and layer >= layers) or name.startswith(VISION_PREFIX):
        return "none"  # the MTP head (the store skips it too) and the vision tower: not loaded to serve text
    if EMBED_RE.search(name):
        # An unquantized table loads on the CPU (Embedding prefer_cpu); a quantized one is a RowTable in RAM whose
        # rows are decoded on the device. With tied embeddings and no lm_head the head's Linear reads it in VRAM too.
        return "both" if tied_head else "host"
    return "vram"


def from_checkpoint(model_dir: str | Path) -> ModelShape:
    """Read config.json and every *.safetensors header under `model_dir`."""
    root = Path(model_dir)
    config = load_config(root)
    tc = _text_config(config)
    try:
        layers = int(tc["num_hidden_layers"])
        hidden = int(tc["hidden_size"])
        n_experts = int(tc.get("n_routed_experts") or tc["num_experts"])
        top_k = int(tc["num_experts_per_tok"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ShapeError(f"{root}/config.json lacks {exc} (num_hidden_layers, hidden_size, n_routed_experts, "
                         "num_experts_per_tok are needed)") from None
    try:
        mlp_types = tc.get("mlp_layer_types") or (["dense"] * int(tc.get("first_k_dense_replace", 0))
                                                  + ["sparse"] * (layers - int(tc.get("first_k_dense_replace", 0))))
        moe_from_config = sum(1 for t in mlp_types[:layers] if t == "sparse")
        geo = _geometry(tc, layers, hidden, top_k, moe_from_config > 0)
        mtp = layers if int(tc.get("num_nextn_predict_layers", 0) or 0) > 0 else None
    except (TypeError, ValueError, AttributeError) as exc:  # a value of the wrong kind (a word for a number...)
        raise ShapeError(f"{root}/config.json has a value glm53 cannot read ({exc}); {RESTORE}") from None
    native = int(tc.get("max_position_embeddings") or 0) or None
    caches = dict(max_context=native, checkpoint_bytes=geo["checkpoint"], prefill_phases=geo["phases"])

    sizes: dict[str, int] = {}
    files = sorted(root.glob("*.safetensors"))
    for path in files:
        sizes.update(read_safetensors_sizes(path))
    if not files:
        inter = int(tc.get("moe_intermediate_size") or CONFIG_DEFAULTS["moe_intermediate_size"])
        vocab = int(tc.get("vocab_size") or CONFIG_DEFAULTS["vocab_size"])
        return ModelShape(hidden, layers, moe_from_config, n_experts, top_k, _expert_bytes(hidden, inter, 3.0),
                          DEFAULT_SHAPE.always_used_bytes, geo["kv"], geo["state"], geo["mla"], mtp,
                          f"{root}/config.json; no *.safetensors yet, so sizes are 3 bpw estimates",
                          host_bytes=vocab * hidden * F16, **caches)

    tied = bool(config.get("tie_word_embeddings", tc.get("tie_word_embeddings", False))) and not any(
        n.startswith("lm_head.") for n in sizes)
    per_expert: dict[tuple[int, int], int] = defaultdict(int)
    always = host = 0
    visual = sum(nbytes for name, nbytes in sizes.items() if name.startswith(VISION_PREFIX))
    vc = config.get("vision_config") if isinstance(config.get("vision_config"), dict) else None
    if visual and vc is not None:  # the tower the engine loads (resident) where the checkpoint has its weights
        caches.update(vision_bytes=visual, vision_bytes_per_patch=vision_patch_bytes(vc))
    per_layer = [0] * layers
    for name, nbytes in sizes.items():
        if e := EXPERT_RE.search(name):
            # The codebook markers (mcg, mul1: 4 bytes each) are read once at load, not part of the slot image or
            # the store's record; counting them would make every record 4 KiB longer than the one packed.
            if int(e.group(1)) < layers and not name.endswith(CODEBOOK_MARKERS):
                per_expert[(int(e.group(1)), int(e.group(2)))] += nbytes
            continue
        place = _tensor_place(name, layers, tied)
        always += nbytes if place in ("vram", "both") else 0
        host += nbytes if place in ("host", "both") else 0
        if place == "vram" and (m := LAYER_RE.search(name)):
            per_layer[int(m.group(1))] += nbytes  # a decoder layer's own tensors (the rest: embedding, head, norm)
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
    return ModelShape(hidden, layers, len(moe_layers), n_experts, top_k, max(per_expert.values()), always, geo["kv"],
                      geo["state"], geo["mla"], mtp, f"{root} ({len(files)} safetensors headers)", host_bytes=host,
                      layer_bytes=tuple(per_layer), moe_layer_ids=tuple(moe_layers), mla_layer_ids=geo["mla_ids"],
                      **caches)

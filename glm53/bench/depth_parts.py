"""The pure parts of `glm53 bench depth`, shared by the parent (glm53.bench.depth) and one mode's measurement
(glm53.bench.depth_measure): the modes and run sizes, the prompts, the layer types of a module key, the checkpoint
bytes each type reads per token, and the token comparison."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

MODES = ("stock", "exact", "fast", "nvme-exact", "nvme")
EXACT_LIKE = ("exact", "nvme-exact")
# 48 routed experts per layer: with 32 every expert fits a 24 GB budget beside the always-used weights (nothing is
# tiered, and 42 x 32 = 1,344 slots cannot show the 1,376 the issue asks); with 64 the checkpoint and its store
# (~32 + ~25 GB) outgrow the GPU machine's 64 GB disk.
DEFAULT_FIXTURE = "--shape glm53 --depth full --experts 48"
DEFAULT_PROMPTS = "8192,32768,120000"
SHORT_PROMPT = 16          # the "0 history" decode: a prompt of a few tokens
PEAK_TOKENS = 512          # decoded after the longest prompt while peak memory is watched
REFERENCE_SLOTS = 1376     # the reference appliance's hot experts on a 24 GB card at 131,072 tokens (issue 25)
GREEDY_TOKENS = 256        # greedy ids after the longest prompt compared with stock's
SAMPLE_S = 0.02            # memory sampler period
TYPES = ("kda", "mla", "moe", "shared", "dense", "glue", "head", "embed")
TYPE_NAMES = {"kda": "KDA linear attention", "mla": "MLA + DSA indexer", "moe": "MoE (router + routed experts)",
              "shared": "shared expert", "dense": "dense MLP", "glue": "norms + hyper-connections",
              "head": "head (hc collapse, norm, lm_head)", "embed": "embedding"}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.(.*))?$")
_NORM = re.compile(r"(?:^|\.)norm(?:\.|$)")


def parse_modes(text: str) -> tuple[str, ...]:
    modes = tuple(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise ValueError(f"--modes: unknown {unknown or 'none given'}; choose from {', '.join(MODES)}")
    return modes


def parse_prompts(text: str, context: int) -> list[int]:
    try:
        prompts = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"--prompts wants token counts like {DEFAULT_PROMPTS}, got {text!r}") from None
    if not prompts or prompts[0] <= SHORT_PROMPT:
        raise ValueError(f"--prompts: each prompt must be longer than {SHORT_PROMPT} tokens, got {text!r}")
    if prompts[-1] + PEAK_TOKENS >= context:
        raise ValueError(f"--prompts: the longest prompt {prompts[-1]} plus {PEAK_TOKENS} decoded tokens does not fit "
                         f"the {context}-token context: shorten it or raise --context")
    return prompts


def prompt_ids(n: int, hi: int, seed: int) -> list[int]:
    """n token ids of deterministic pseudo-text in [0, hi): words of 1-3 ids from a 4,096-word lexicon drawn with
    Zipf frequencies, so words and phrases repeat as in text. Prefix-stable: a shorter prompt of the same seed is
    the start of a longer one (distinct seeds share no prefix, so no prompt is served from another's KV pages)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    words = 4096
    lengths = rng.integers(1, 4, size=words)
    lexicon = rng.integers(0, hi, size=(words, 3))
    p = 1.0 / np.arange(1, words + 1)
    p /= p.sum()
    out: list[int] = []
    while len(out) < n:
        for w in rng.choice(words, size=1024, p=p):
            out.extend(lexicon[w, : lengths[w]].tolist())
    return out[:n]


def layer_kinds(config: dict) -> tuple[list[str], list[str]]:
    """(attention kind per text layer, MLP kind per text layer) from a Glm5Next config.json, as exllamav3 reads it."""
    text = config.get("text_config", config)
    n = int(text["num_hidden_layers"])
    attn = list(text["layer_types"])[:n]
    dense = int(text.get("first_k_dense_replace", 3))
    mlp = list(text.get("mlp_layer_types") or ["dense" if i < dense else "sparse" for i in range(n)])[:n]
    return attn, mlp


def classify(key: str, attn: Sequence[str], mlp: Sequence[str]) -> str:
    """The layer type of a module key or tensor name: kda, mla (with its indexer), moe (router and routed experts),
    shared, dense, glue (a block's norms and hyper-connections), block (a whole decoder block), head, embed; mtp
    for layers past the text layers (not run in decode), other for anything else."""
    m = _LAYER.search(key)
    if m:
        i, rest = int(m[1]), m[2] or ""
        if i >= len(attn):
            return "mtp"
        if not rest:
            return "block"
        if rest.startswith("self_attn"):
            return "kda" if attn[i] == "linear_attention" else "mla"
        if rest == "mlp" or rest.startswith("mlp."):
            if mlp[i] == "dense":
                return "dense"
            return "shared" if rest.startswith("mlp.shared_experts") else "moe"
        return "glue"
    if "embed_tokens" in key or key.startswith("hc_expand"):
        return "embed"
    if key.startswith(("lm_head", "hc_head")) or _NORM.search(key):
        return "head"
    return "other"


def weight_bytes_per_token(model_dir: Path) -> dict[str, float]:
    """Checkpoint bytes each layer type reads per decoded token, from the safetensors headers: every weight of the
    always-used layers, top_k / experts of each MoE layer's routed experts (the router whole), one row of the
    embedding table."""
    from store.safetensors_header import read_safetensors_header

    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config", config)
    attn, mlp = layer_kinds(config)
    top_k, experts = int(text["num_experts_per_tok"]), int(text["n_routed_experts"])
    out = dict.fromkeys(TYPES, 0.0)
    for f in sorted(model_dir.glob("*.safetensors")):
        for name, t in read_safetensors_header(f).tensors.items():
            kind = classify(name, attn, mlp)
            if kind == "embed" and len(t.shape) == 2:
                out["embed"] += t.nbytes / t.shape[0]  # one row per token
            elif kind == "moe" and ".mlp.experts." in name:
                out["moe"] += t.nbytes * top_k / experts
            elif kind in out:
                out[kind] += t.nbytes
    return out


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two token lists differ (a shorter list differs where it ends); None: identical."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))

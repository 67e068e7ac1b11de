"""A fake exllamav3 1.6.5 for CPU tests of glm53.exl3's glue and of Exl3Engine (helpers only, no
tests here).

`installed()` puts fake modules into sys.modules for the duration of a `with` block (exllamav3, .version,
.modules.block_sparse_mlp, .modules.block_sparse_mlp_routing, .modules.linear, .modules.mla_attn,
.modules.quant.exl3, .modules.quant.exl3_lib.quantize, .generator.filter, .generator.filter.llguidance,
.tokenizer, .architecture.glm5_next and their parents), holding what glm53.exl3 imports and check_contract()
checks, and puts back what was there before.
`Model.from_config(Config.from_directory(dir))` builds a model of a generated EXL3 checkpoint (glm53.fixture.exl3):
the embedding, one block per layer (FakeBlockSparseMLP under the sparse ones, a stand-in under the dense ones),
the fp16 head. Its forward is a deterministic function of the token history (each position reads its own and the
two previous tokens' embeddings, in place of attention and a KV cache) that runs every MoE layer, so generation
crosses TieredMoE's seam at every step.

Generation (generator/generator.py, job.py, sampler, filter/filter.py, filter/llguidance.py), at the level
glm53.exl3.runtime depends on (it turns iterate()'s dicts into glm53.exl3.events for Exl3Engine):
Cache(model, max_num_tokens, max_batch_size) is allocated by the model's next load(); Generator(model, cache,
tokenizer, max_batch_size, max_chunk_size) with enqueue / iterate / cancel / clear_queue / num_remaining_jobs; iterate() starts pending jobs, runs one page-aligned prefill chunk of each job still ingesting
its prompt (a failure there is contained as reap_failed_job does: an "error" result, no identifier), then one
batched decode forward and each job's sample. Job(...) takes exllamav3's arguments; max_new_tokens is capped to the
cache and a job that cannot fit its pages is refused at enqueue, as there. Results are emit()'s dicts: "stage"
"prefill" (curr_progress / max_progress) and "streaming" ("eos", "eos_reason" stop_token / max_new_tokens /
end_filter, "eos_triggering_token_id", "token_ids" / "logits" / "text" of what is released, "held" for what an
ending job still holds, "identifier"); tokens are held while their text ends in an incomplete character, and a
stop token is reported in "held" only. ArgmaxSampler and ComboSampler (temperature, min_p, top_k, top_p; one draw
from the job's seeded rng) mask the model's padded vocabulary in place and apply filter masks to a copy.
LLGuidanceFilter is exllamav3's (the same llguidance calls, packed bitmasks); a filter with a trigger_token is
inactive until that token is sampled, and completing the grammar with eos_after_completed ends the job
("end_filter") on the completing token. Pages: a job holds the pages of its prompt plus its max_rq_tokens segment
(aligned to a page; the whole reply without it), a pending job starts when its pages are free (skipped over by
smaller ones at most max_skips times, as iterate_start_jobs does), and a job given max_rq_tokens requeues at each
segment's end (a "requeue" result; it goes back to the front of the pending queue with the sequence so far as its
prompt, which it prefills again). generator.pagetable has max_pages, metrics and num_unreferenced_pages(). The
prompt cache only under installed(prompt_cache=True): a job starts past the full pages (hash-chained token ids) an
ended job held, as exllamav3's page hashing matches them; recurrent checkpoints are not modelled. Not faked: stop
strings, banned strings, token healing, speculative decoding.

The vision component (architecture/glm5_next.py, glm4v.py, tokenizer/mm_embedding.py):
Model.from_config(config, component="vision") gives Glm5NextVisionModel, whose get_image_embeddings(tokenizer,
image) preprocesses as exllamav3 does and returns an MMEmbedding owning fresh placeholder ids (>= 10^9); a Job's
`embeddings` reach every forward as params["indexed_embeddings"], and the embedding puts their rows at those ids.

The MoE layers, from exllamav3 1.6.5's sources (modules/block_sparse_mlp.py, block_sparse_mlp_cpu.py,
linear.py, multilinear.py, quant/exl3.py, block_sparse_mlp_routing.py, loader/safetensors.py), at the level the
adapter depends on:

- Linear.load -> load_exl3: an EXL3 linear's trellis / suh / svh from the checkpoint and its codebook marker
  through config.stc.get_codebook_marker, then LinearEXL3(config, in, out, scale, su, sv, suh, svh, trellis, mcg,
  mul1, bias, out_dtype, key=). LinearEXL3 bakes its tensors into a bound object (ext.BC_LinearEXL3: device
  pointers in exllamav3); its forward reads the bytes there at call time.
- BlockSparseMLP.load: submodules, e_score_correction_bias, load_local (MultiLinear "pointer tables" over the
  gates / ups / downs lists as they are at load, and the expert interval [routing_first, routing_last) baked into
  ext.BC_BlockSparseMLP: (-1, -1), i.e. no masking, when it is unset or spans all num_experts), load_routing
  (RoutingCFG with the fixed bsz-1 routing buffers).
- BlockSparseMLP.forward: the "dots" router (sigmoid logits; selection by score + e_score_correction_bias, top-k;
  weights the unbiased scores, normalised and scaled; bsz 1 writes the fixed bsz-1 buffers), then the CPU-split
  seam `self.cpu_split_submit(y, bsz, selected, weights)` when cpu_split_first is set, then the routed sum:
  bsz <= MAX_BSZN through the fused decode path (every (token, k) pick from the baked tables; a pick outside the
  interval adds exact zeros), else the torch path (ids outside the slice go to a sentinel; picks grouped by
  local expert, each group through the module's current gate / up / down Linears and activation_fn_call), then
  `self.cpu_split_combine(final, cpu_partial, cpu_pending, shape)`. Both paths add each token's picks in k order
  (exllamav3's fused decode kernel and its deterministic gather do), so relabelling experts never changes a bit.
- cpu_unload restores the expert lists from _split_saved; cpu_split_combine is the stock one.

The maths is glm53.exl3ref (the numpy EXL3 decode, checked bit for bit against ext.reconstruct) on the bytes the
tensors hold at that moment: under TieredMoE, the arena bytes. interm_dtype torch.half rounds gate / up outputs
and the activation to fp16 like the GPU kernels; torch.float keeps the fused path's intermediates exact, which is
what the CPU lane computes (near-exact comparisons then measure the glue, not fp16 rounding). A pick whose slot
id would index past the pointer tables raises: the real kernels would read arbitrary memory or drop it silently.
`fake_stats` on each FakeBlockSparseMLP counts the picks computed and masked, and the slot ids the kernels saw.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import random
import sys
import threading
import types
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from glm53 import exl3ref as R

VERSION = "1.6.5"
MAX_BSZN = 8
codebook_mcg_mult = 0xCBAC1FED
codebook_mul1_mult = 0x83DCD12D
PREFIX = "model.language_model"


# ---- the numerics: EXL3 linears from the bytes in their tensors -------------------------------------------------

_inner_cache: dict[tuple[bytes, str], np.ndarray] = {}
_inner_lock = threading.Lock()


def _inner(trellis: np.ndarray, codebook: str) -> np.ndarray:
    """The decoded inner weight of these trellis bytes (cached by content: refilled slots decode anew)."""
    key = (hashlib.blake2b(np.ascontiguousarray(trellis).tobytes(), digest_size=16).digest(), codebook)
    with _inner_lock:
        w = _inner_cache.get(key)
    if w is None:
        w = R.decode_trellis(trellis, codebook).astype(np.float64)
        with _inner_lock:
            if len(_inner_cache) > 4096:
                _inner_cache.clear()
            _inner_cache[key] = w
    return w


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def swiglu_np(g: np.ndarray, u: np.ndarray, limit: float, half: bool) -> np.ndarray:
    """exllamav3's clamped SwiGLU: fp16 arithmetic on fp16 inputs (half), else exact."""
    if half:
        return R.swiglu(np.asarray(g, np.float16), np.asarray(u, np.float16), limit, fp16=True)
    return R.swiglu(np.asarray(g, np.float64), np.asarray(u, np.float64), limit)


class _BC_LinearEXL3:
    """ext.BC_LinearEXL3: the linear's tensors, bound at construction (exllamav3 keeps their device pointers)."""

    def __init__(self, trellis, suh, svh, K, bias, mcg, mul1, xh):
        assert bias is None, "the fake has no EXL3 biases"
        self.trellis, self.suh, self.svh = trellis, suh, svh
        self.codebook = "mcg" if mcg else "mul1" if mul1 else "3inst"

    def forward_np(self, x: np.ndarray) -> np.ndarray:
        """x (rows, in) -> (rows, out) float32: exl3ref's linear on the bytes the bound tensors hold now."""
        tr = _np(self.trellis)
        lin = R.Exl3Linear(tr, _np(self.suh), _np(self.svh), self.codebook)
        return lin.forward(np.asarray(x, np.float64), inner=_inner(tr, self.codebook))

    def run_alloc(self, x: torch.Tensor, out_features: int, float_out: bool) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).double()
        y = torch.from_numpy(self.forward_np(_np(rows))).reshape(*x.shape[:-1], out_features)
        return y if float_out else y.half()


def silu_mul(g: torch.Tensor, u: torch.Tensor, a: torch.Tensor, limit: float) -> None:
    """ext.silu_mul: a = min(silu(g), limit) * clamp(u, -limit, limit), half arithmetic for half inputs."""
    r = swiglu_np(_np(g), _np(u), limit, half=g.dtype == torch.half)
    a.copy_(torch.from_numpy(np.asarray(r)).to(a.dtype).reshape(a.shape))


class _BC_BlockSparseMLP:
    """ext.BC_BlockSparseMLP: the per-slot tables (as bound at load_local) and the expert interval."""

    def __init__(self, gates: list, ups: list, downs: list, min_expert: int, max_expert: int, act_limit: float,
                 half: bool, out_bszn: torch.Tensor, stats: dict):
        self.gates, self.ups, self.downs = gates, ups, downs
        self.min_expert, self.max_expert = min_expert, max_expert
        self.act_limit, self.half, self.out_bszn, self.stats = act_limit, half, out_bszn, stats

    def expert(self, i: int, x: np.ndarray) -> np.ndarray:
        """Table entry i's expert on rows x: (rows, hidden) float32."""
        g, u = self.gates[i].forward_np(x), self.ups[i].forward_np(x)
        return self.downs[i].forward_np(swiglu_np(g, u, self.act_limit, self.half))

    def run_bszN(self, y: torch.Tensor, selected: torch.Tensor, weights: torch.Tensor) -> None:
        """The fused decode kernel: each (token, k) pick through its table entry, added in k order into out_bszn;
        a pick outside [min_expert, max_expert) (when set) adds exact zeros."""
        bsz, k_top = selected.shape
        sel, w = _np(selected).astype(np.int64), _np(weights.float())
        x = _np(y.double())
        acc = np.zeros((bsz, y.shape[-1]), np.float32)
        lo, hi = self.min_expert, self.max_expert
        self.stats["slot_ids"].append(sel.copy())
        for k in range(k_top):
            for t in range(bsz):
                s = int(sel[t, k])
                if lo >= 0 and not lo <= s < hi:
                    self.stats["masked"] += 1
                    continue
                i = s - lo if lo >= 0 else s
                if not 0 <= i < len(self.gates):
                    raise IndexError(f"pick {s} indexes past the {len(self.gates)}-entry expert tables (interval "
                                     f"{lo}..{hi}): the real kernel would read arbitrary memory")
                acc[t] += np.float32(w[t, k]) * self.expert(i, x[t : t + 1])[0]
                self.stats["computed"] += 1
        self.out_bszn[:bsz].copy_(torch.from_numpy(acc))


class _Ext:
    BC_LinearEXL3 = _BC_LinearEXL3
    BC_BlockSparseMLP = _BC_BlockSparseMLP
    silu_mul = staticmethod(silu_mul)


ext = _Ext()


# ---- checkpoint access (config.stc) -----------------------------------------------------------------------------

class FakeSTC:
    """exllamav3's SafetensorsCollection, for what the modules here read: tensors by name, codebook markers."""

    _markers: dict[int, torch.Tensor] = {}

    def __init__(self, model_dir: str | Path):
        from safetensors.torch import load_file

        self.tensors: dict[str, torch.Tensor] = {}
        for path in sorted(Path(model_dir).glob("*.safetensors")):
            self.tensors.update(load_file(str(path)))
        self.reads: list[str] = []  # every tensor a load asked for: TieredMoE's slot Linears read none

    def has_tensor(self, key: str) -> bool:
        return key in self.tensors

    def get_tensor(self, key: str, device: Any = None, optional: bool = False, allow_bf16: bool = False,
                   no_defer: bool = False) -> torch.Tensor | None:
        t = self.tensors.get(key)
        if t is None:
            if optional:
                return None
            raise ValueError(f"tensor {key} not found")
        self.reads.append(key)
        if t.dtype == torch.bfloat16 and not allow_bf16:
            t = t.half()
        return t.clone().to(device if device is not None else "cpu")

    def get_codebook_marker(self, key: str, value: int) -> torch.Tensor | None:
        t = self.tensors.get(key)
        if t is None:
            return None
        stored = int(t.view(torch.int32).item()) & 0xFFFFFFFF
        if stored != value:
            raise ValueError(f"codebook marker {key} holds {stored:#x}, expected {value:#x}")
        marker = self._markers.get(value)
        if marker is None:
            marker = self._markers[value] = torch.from_numpy(np.array(value, np.uint32).view(np.int32))
        return marker


class Config:
    """exllamav3.Config: the text model's shape from config.json and the checkpoint (config.stc)."""

    def __init__(self, model_dir: str | Path):
        self.directory = str(model_dir)
        top = json.loads((Path(model_dir) / "config.json").read_text())
        text = top["text_config"]
        self.hidden_size = text["hidden_size"]
        self.moe_intermediate_size = text["moe_intermediate_size"]
        self.num_experts = text["n_routed_experts"]
        self.num_experts_per_tok = text["num_experts_per_tok"]
        self.swiglu_limit = float(text.get("swiglu_limit") or 0.0)
        self.routed_scaling_factor = text.get("routed_scaling_factor")
        self.n_group = text.get("n_group")
        self.topk_group = text.get("topk_group")
        self.mlp_layer_types = list(text["mlp_layer_types"])
        self.vocab_size = text["vocab_size"]
        self.max_position_embeddings = text.get("max_position_embeddings") or 8192
        eos = top.get("eos_token_id", text.get("eos_token_id"))
        self.eos_token_id_list = [e for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
        self.eos_token_id = self.eos_token_id_list[0] if self.eos_token_id_list else None
        self.bos_token_id = top.get("bos_token_id", text.get("bos_token_id"))
        self.stc = FakeSTC(model_dir)
        self._read_vision(top)
        # exllamav3's InferParams: its own CPU MoE split / offload come from the environment, as there
        self.infer_params = types.SimpleNamespace(
            no_reconstruct=False, moe_cpu_split=int(os.environ.get("EXL3_MOE_CPU_SPLIT", 0)),
            moe_cpu_offload=int(os.environ.get("EXL3_MOE_CPU_OFFLOAD", 0)))

    @classmethod
    def from_directory(cls, model_dir: str) -> Config:
        return cls(model_dir)

    def _read_vision(self, top: dict) -> None:
        """The tower's preprocessing and ids (config.vision_pp, vision_start/end_token_id), as Glm5NextConfig reads
        them; absent where the checkpoint describes no tower (exllamav3 would refuse such a config)."""
        path = Path(self.directory) / "processor_config.json"
        self.vision_pp = None
        if "vision_config" not in top or not path.exists():
            return
        ip = json.loads(path.read_text())["image_processor"]
        self.vision_pp = types.SimpleNamespace(
            patch_size=ip["patch_size"], temporal_patch_size=ip["temporal_patch_size"], merge_size=ip["merge_size"],
            image_mean=ip["image_mean"], image_std=ip["image_std"], min_image_tokens=ip["min_image_tokens"],
            max_image_tokens=ip["max_image_tokens"], resample=3, rescale_factor=1 / 255)
        self.vision_out_hidden = int(top["vision_config"]["out_hidden_size"])
        self.vision_start_token_id = int(top["image_start_token_id"])
        self.vision_end_token_id = int(top["image_end_token_id"])


# ---- modules ----------------------------------------------------------------------------------------------------

class Module:
    def __init__(self, config: Config | None, key: str, qmap: str | None = None):
        self.config, self.key, self.qmap = config, key, qmap
        self.modules: list[Module] = []
        self.device = None
        self.caps: dict = {}

    def __iter__(self) -> Iterator[Module]:
        yield self
        for module in self.modules:
            yield from module

    def register_submodule(self, module: Module | None) -> None:
        if module is not None:
            self.modules.append(module)

    def load(self, device: Any, **kwargs: Any) -> None:
        self.device = device
        for module in self.modules:
            module.load(device, **kwargs)

    def unload(self) -> None:
        self.device = None
        for module in self.modules:
            module.unload()


class LinearEXL3:
    quant_type: str = "exl3"

    def __init__(self, config, in_features, out_features, scale=None, su=None, sv=None, suh=None, svh=None,
                 trellis=None, mcg=None, mul1=None, bias=None, out_dtype=None, transformers_fix=False, key=None):
        assert scale is None, "scale is no longer used"
        assert su is None and sv is None, "the fake takes unpacked suh / svh only"
        assert suh is not None and suh.dtype == torch.half, "suh is wrong datatype"
        assert svh is not None and svh.dtype == torch.half, "svh is wrong datatype"
        assert trellis is not None and trellis.dtype == torch.int16, "trellis is wrong datatype"
        assert len(trellis.shape) == 3, "trellis must have dim = 3"
        # (exllamav3 does not check these; a slot view of the wrong field would otherwise compute garbage)
        assert tuple(trellis.shape[:2]) == (in_features // 16, out_features // 16), f"{key}: trellis shape"
        assert tuple(suh.shape) == (in_features,) and tuple(svh.shape) == (out_features,), f"{key}: scale shapes"
        self.config, self.key = config, key
        self.su = self.sv = None
        self.suh, self.svh, self.trellis = suh, svh, trellis
        K = trellis.shape[-1] / 16
        self.K = int(K) if float(K).is_integer() else K
        self.in_features, self.out_features = in_features, out_features
        self.bias = bias
        self.out_dtype = out_dtype
        self.default_out_dtype = out_dtype or torch.half
        self.mcg_tensor, self.mul1_tensor = mcg, mul1
        self.mcg, self.mul1 = mcg is not None, mul1 is not None
        self.bc = ext.BC_LinearEXL3(self.trellis, self.suh, self.svh, self.K, self.bias, self.mcg, self.mul1, None)

    def unload(self) -> None:
        pass

    def forward(self, x: torch.Tensor, params: dict, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        assert x.is_contiguous(), f"LinearEXL3 {self.key}: non-contiguous input {tuple(x.shape)}"
        dtype = out_dtype or self.default_out_dtype
        return self.bc.run_alloc(x, self.out_features, dtype == torch.float)


class LinearFP16:
    def __init__(self, weight: torch.Tensor, out_dtype: torch.dtype | None):
        self.weight = weight  # (in, out) half, like exllamav3's transposed load
        self.bias = None
        self.out_dtype = out_dtype

    def unload(self) -> None:
        pass

    def forward(self, x: torch.Tensor, params: dict, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return (x.float() @ self.weight.float()).to(out_dtype or self.out_dtype or torch.half)


class Linear(Module):
    def __init__(self, config: Config, key: str, in_features: int, out_features: int, qmap: str | None = None,
                 out_dtype: torch.dtype | None = None, pad_to: int = 128, allow_input_padding: bool = False,
                 trim_padded_out: bool = False):
        super().__init__(config, key, qmap)
        self.in_features_unpadded, self.out_features_unpadded = in_features, out_features
        self.in_features = (in_features + pad_to - 1) // pad_to * pad_to
        self.out_features = (out_features + pad_to - 1) // pad_to * pad_to
        self.out_dtype = out_dtype
        self.allow_input_padding, self.trim_padded_out = allow_input_padding, trim_padded_out
        self.inner: Any = None
        self.quant_type: str | None = None
        self.softcap, self.pre_scale, self.post_scale = 0.0, 1.0, 1.0
        self.lora_a_tensors: dict = {}
        self.lora_b_tensors: dict = {}
        self.used_alt_key = False
        self.alt_key = None

    def load(self, device: Any, **kwargs: Any) -> None:
        self.device = device
        if self.load_exl3(self.key):
            return
        if self.load_fp16(self.key):
            return
        raise ValueError(f"No tensors found for {self.key} matching supported quantization format.")

    def load_exl3(self, key: str) -> bool:
        stc = self.config.stc
        if not stc.has_tensor(key + ".trellis"):
            return False
        suh = stc.get_tensor(key + ".suh", self.device)
        svh = stc.get_tensor(key + ".svh", self.device)
        trellis = stc.get_tensor(key + ".trellis", self.device)
        mcg = stc.get_codebook_marker(key + ".mcg", codebook_mcg_mult)
        mul1 = stc.get_codebook_marker(key + ".mul1", codebook_mul1_mult)
        self.inner = LinearEXL3(self.config, self.in_features, self.out_features, None, None, None, suh, svh,
                                trellis, mcg, mul1, None, self.out_dtype, key=self.key)
        self.quant_type = "exl3"
        return True

    def load_fp16(self, key: str) -> bool:
        w = self.config.stc.get_tensor(key + ".weight", self.device, optional=True)
        if w is None:
            return False
        self.inner = LinearFP16(w.T.contiguous().half(), self.out_dtype)  # checkpoint (out, in) -> (in, out)
        self.quant_type = "fp16"
        return True

    def forward(self, x: torch.Tensor, params: dict, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.inner.forward(x, params, out_dtype)

    def unload(self) -> None:
        if self.inner is not None:
            self.inner.unload()
        self.device = None
        self.inner = None


class MultiLinear:
    """exllamav3's MultiLinear: per-expert pointer tables over a list of loaded EXL3 linears."""

    def __init__(self, device: Any, linears: list[Linear], allow_bias: bool = False):
        assert all(lin.quant_type == "exl3" for lin in linears)
        assert all(not lin.softcap and lin.post_scale == 1.0 for lin in linears)
        self.device, self.linears = device, linears
        self.in_features, self.out_features = linears[0].in_features, linears[0].out_features
        self.K = linears[0].inner.K
        assert all(lin.inner.K == self.K and lin.in_features == self.in_features and
                   lin.out_features == self.out_features for lin in linears)
        self.ptrs_trellis = torch.tensor([lin.inner.trellis.data_ptr() for lin in linears], dtype=torch.long)
        self.ptrs_suh = torch.tensor([lin.inner.suh.data_ptr() for lin in linears], dtype=torch.long)
        self.ptrs_svh = torch.tensor([lin.inner.svh.data_ptr() for lin in linears], dtype=torch.long)
        self.tables = [lin.inner.bc for lin in linears]  # what the fake kernels read through
        self.mcg, self.mul1 = linears[0].inner.mcg, linears[0].inner.mul1
        assert all(lin.inner.mcg == self.mcg and lin.inner.mul1 == self.mul1 for lin in linears[1:])


@dataclasses.dataclass
class RoutingCFG:
    gate_tensor: torch.Tensor
    gate_tensor_t: torch.Tensor | None
    num_experts: int
    num_experts_per_tok: int
    router_logits_bsz1: torch.Tensor
    routing_weights_bsz1: torch.Tensor
    selected_experts_bsz1: torch.Tensor
    e_score_correction_bias: torch.Tensor | None
    e_score_bias_h: torch.Tensor | None
    routed_scaling_factor: float | None
    n_group: int | None
    topk_group: int | None
    per_expert_scale: torch.Tensor | None
    router_bias: torch.Tensor | None = None


def routing_dots(bsz: int, cfg: RoutingCFG, y: torch.Tensor, params: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """GLM's router: sigmoid scores; top-k of score + selection bias (one group); weights the
    unbiased scores of the picks, normalised, times routed_scaling_factor; half. bsz 1: the fixed buffers."""
    scores = torch.sigmoid(y.reshape(bsz, -1).float() @ cfg.gate_tensor.float())
    sel = scores + (cfg.e_score_correction_bias.float() if cfg.e_score_correction_bias is not None else 0.0)
    assert (cfg.n_group or 1) == 1, "the fake routes without expert groups (the fixture writes n_group 1)"
    ids = sel.topk(cfg.num_experts_per_tok, dim=-1).indices
    w = scores.gather(1, ids)
    w = (w / (w.sum(-1, keepdim=True) + 1e-20) * (cfg.routed_scaling_factor or 1.0)).half()
    if bsz == 1:
        cfg.selected_experts_bsz1.copy_(ids)
        cfg.routing_weights_bsz1.copy_(w)
        return cfg.selected_experts_bsz1, cfg.routing_weights_bsz1
    return ids, w


@dataclasses.dataclass
class ExpertsCFG:
    out_bszn: torch.Tensor
    min_expert: int
    max_expert: int


class BlockSparseMLP(Module):
    def __init__(self, config: Config, key: str, hidden_size: int, intermediate_size: int, num_experts: int,
                 num_experts_per_tok: int, act_limit: float = 0.0, interm_dtype: torch.dtype = torch.half,
                 routed_scaling_factor: float | None = None, n_group: int | None = None,
                 topk_group: int | None = None):
        super().__init__(config, key, None)
        self.hidden_size = self.expert_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_experts, self.num_experts_per_tok = num_experts, num_experts_per_tok
        self.num_local_experts = num_experts
        self.routing_first = self.routing_last = None
        self.act_limit, self.interm_dtype = act_limit, interm_dtype
        self.routed_scaling_factor, self.n_group, self.topk_group = routed_scaling_factor, n_group, topk_group
        self.routing_gate = Linear(config, f"{key}.gate", hidden_size, num_experts, out_dtype=torch.half, pad_to=1)
        self.register_submodule(self.routing_gate)
        self.gated = True
        self.gates, self.ups, self.downs = [], [], []
        for idx in range(num_experts):
            base = f"{key}.experts.{idx}"
            gate = Linear(config, f"{base}.gate_proj", hidden_size, intermediate_size, qmap="block.mlp.input",
                          out_dtype=interm_dtype)
            up = Linear(config, f"{base}.up_proj", hidden_size, intermediate_size, qmap="block.mlp.input",
                        out_dtype=interm_dtype)
            down = Linear(config, f"{base}.down_proj", intermediate_size, hidden_size, out_dtype=torch.float,
                          allow_input_padding=True, trim_padded_out=True)
            self.gates.append(gate)
            self.ups.append(up)
            self.downs.append(down)
            self.register_submodule(up)
            self.register_submodule(gate)
            self.register_submodule(down)
        self.activation_fn_call = ext.silu_mul
        self.router_pre_norm = None
        self.routing_cfg: RoutingCFG | None = None
        self.experts_cfg: ExpertsCFG | None = None
        self.e_score_correction_bias = None
        self.multi_gate = self.multi_up = self.multi_down = None
        self.bc = None
        self.fake_stats = {"computed": 0, "masked": 0, "slot_ids": [], "forwards": 0}
        self._cpu_init_state()

    # ---- block_sparse_mlp_cpu.BlockSparseMLP_CPU (the part the adapter uses) ------------------------------------

    def _cpu_init_state(self):
        self._split_spares = 0
        self._split_pending = None
        self.cpu_offload = False
        self.cpu_split_first = None
        self._split_map = None

    def cpu_unload(self):
        if self.cpu_split_first is not None:
            (self.gates, self.ups, self.downs, self.modules,
             self.num_local_experts, self.routing_first, self.routing_last) = self._split_saved
            self._split_saved = None
            self.cpu_split_first = None

    def cpu_split_submit(self, y, bsz, selected_experts, routing_weights):
        raise AssertionError("the stock CPU split is not in use under TieredMoE (its seam replaces this)")

    def cpu_split_combine(self, final_hidden_states, cpu_partial, cpu_pending, shape):
        if cpu_pending is not None:
            raise AssertionError(f"stock combine given a pending job it does not know: {cpu_pending!r}")
        if cpu_partial is not None:
            final_hidden_states = cpu_partial.view(shape) if final_hidden_states is None \
                else final_hidden_states + cpu_partial.view(shape)
        return final_hidden_states

    # ---- load / unload ----------------------------------------------------------------------------------------

    def load(self, device: Any, **kwargs: Any):
        super().load(device, **kwargs)
        esb = self.config.stc.get_tensor(f"{self.key}.gate.e_score_correction_bias", self.device, optional=True,
                                         allow_bf16=True, no_defer=True)
        self.e_score_correction_bias = None if esb is None else esb.float()
        self.load_local(**kwargs)
        self.load_routing(**kwargs)

    def load_local(self, **kwargs: Any):
        self.is_quantized = all(lin.quant_type == "exl3" for lin in self.gates + self.ups + self.downs)
        assert self.is_quantized, f"{self.key}: the fake runs EXL3 experts only"
        self.multi_gate = MultiLinear(self.device, self.gates, allow_bias=True)
        self.multi_up = MultiLinear(self.device, self.ups, allow_bias=True)
        self.multi_down = MultiLinear(self.device, self.downs, allow_bias=True)
        mine, maxe = self.routing_first, self.routing_last
        if mine is None or maxe - mine == self.num_experts:
            mine, maxe = -1, -1
        out_bszn = torch.zeros((MAX_BSZN, self.expert_size), dtype=torch.float)
        self.experts_cfg = ExpertsCFG(out_bszn, mine, maxe)
        self.bc = ext.BC_BlockSparseMLP(self.multi_gate.tables, self.multi_up.tables, self.multi_down.tables, mine,
                                        maxe, self.act_limit, self.interm_dtype == torch.half, out_bszn,
                                        self.fake_stats)

    def load_routing(self, **kwargs: Any):
        k = self.num_experts_per_tok
        self.routing_cfg = RoutingCFG(
            gate_tensor=self.routing_gate.inner.weight, gate_tensor_t=None, num_experts=self.num_experts,
            num_experts_per_tok=k, router_logits_bsz1=torch.empty((1, self.num_experts), dtype=torch.half),
            routing_weights_bsz1=torch.empty((1, k), dtype=torch.half),
            selected_experts_bsz1=torch.empty((1, k), dtype=torch.long),
            e_score_correction_bias=self.e_score_correction_bias, e_score_bias_h=None,
            routed_scaling_factor=self.routed_scaling_factor, n_group=self.n_group, topk_group=self.topk_group,
            per_expert_scale=None,
        )

    def unload(self):
        self.cpu_unload()
        self.bc = None
        self.multi_gate = self.multi_up = self.multi_down = None
        self.routing_cfg = None
        self.experts_cfg = None
        self.e_score_correction_bias = None
        super().unload()

    # ---- forward ----------------------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, params: dict, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        y = x.view(-1, self.hidden_size)
        bsz = y.shape[0]
        eshape = x.shape[:-1] + (self.expert_size,)
        bszn_eligible = self.bc is not None and bsz <= MAX_BSZN
        self.fake_stats["forwards"] += 1

        z = self.router_pre_norm.forward(y, params, out_dtype=torch.half) if self.router_pre_norm else y
        selected_experts, routing_weights = routing_dots(bsz, self.routing_cfg, z, params)

        cpu_partial = None
        cpu_pending = None
        if self.cpu_split_first is not None and not params.get("autosplit_measure"):
            cpu_partial, cpu_pending = self.cpu_split_submit(y, bsz, selected_experts, routing_weights)

        if self.intermediate_size == 0 or self.num_local_experts == 0:
            final_hidden_states = torch.zeros(eshape, dtype=torch.float)
        elif not bszn_eligible:
            # The torch (prefill) path: ids mapped to the local slice (outside it: the sentinel E), picks grouped by
            # local expert in ascending order, each group through the expert's current Linears; then each token's
            # picks added in k order (exllamav3's deterministic gather).
            num_tokens, top_k = selected_experts.shape
            E = self.num_local_experts
            flat = _np(selected_experts).reshape(-1).astype(np.int64)
            self.fake_stats["slot_ids"].append(flat.reshape(num_tokens, top_k).copy())
            if self.num_local_experts == self.num_experts:
                local = flat
                bad = (local < 0) | (local >= E)
                if bad.any():
                    raise IndexError(f"ids {sorted(set(local[bad].tolist()))} outside the {E} experts with no "
                                     "slice set: the real path would drop them silently")
            else:
                local = flat - self.routing_first
                local = np.where((local >= 0) & (local < E), local, E)
            w = _np(routing_weights.float()).reshape(-1)
            contrib = np.zeros((flat.size, y.shape[1]), np.float32)
            for e in range(E):
                picks = np.flatnonzero(local == e)
                if not picks.size:
                    continue
                xc = y[torch.from_numpy(picks // top_k)].contiguous()
                u = self.ups[e].forward(xc, params)
                g = self.gates[e].forward(xc, params)
                a = u if self.interm_dtype == torch.half else torch.empty_like(u, dtype=torch.half)
                self.activation_fn_call(g, u, a, self.act_limit)
                contrib[picks] = _np(self.downs[e].forward(a, params).float()) * w[picks, None]
                self.fake_stats["computed"] += picks.size
            self.fake_stats["masked"] += int((local == E).sum())
            acc = np.zeros((num_tokens, y.shape[1]), np.float32)
            per_token = contrib.reshape(num_tokens, top_k, -1)
            for k in range(top_k):
                acc += per_token[:, k]
            final_hidden_states = torch.from_numpy(acc).reshape(eshape)
        else:
            self.bc.run_bszN(y, selected_experts, routing_weights)
            final_hidden_states = self.experts_cfg.out_bszn[:bsz].view(eshape)

        final_hidden_states = self.cpu_split_combine(final_hidden_states, cpu_partial, cpu_pending, eshape)
        if out_dtype is not None:
            final_hidden_states = final_hidden_states.to(out_dtype)
        return final_hidden_states


# ---- the model: a tiny forward through the MoE layers --------------------------------------------------------

PAGE_SIZE = 256  # exllamav3's KV page (constants.PAGE_SIZE)
CONTEXT = 3  # tokens each position reads: itself and the two before it (the fake's stand-in for attention)


def rms_half(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return (x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()).half()


class Embedding(Module):
    def __init__(self, config: Config, key: str):
        super().__init__(config, key)
        self.weight: torch.Tensor | None = None

    def load(self, device: Any, **kwargs: Any) -> None:
        super().load(device, **kwargs)
        self.weight = self.config.stc.get_tensor(f"{self.key}.weight", device)  # bf16 in the checkpoint: fp16 here

    def unload(self) -> None:
        self.weight = None
        super().unload()

    def forward(self, ids: torch.Tensor, params: dict | None = None) -> torch.Tensor:
        """Rows of the embedding (float) for ids; -1 (no token) embeds as zeros; a placeholder id (>=
        FIRST_MM_EMBEDDING_INDEX) takes its row of the MMEmbedding in params["indexed_embeddings"] that owns it
        (modules/embedding.py), and fails without one (exllamav3 would index past its table)."""
        mm = ids >= FIRST_MM_EMBEDDING_INDEX
        out = self.weight.float()[torch.where(mm, 0, ids).clamp(min=0)] * (ids >= 0).unsqueeze(-1)
        if not bool(mm.any()):
            return out
        owned = torch.zeros_like(mm)
        for e in (params or {}).get("indexed_embeddings") or []:
            m = (ids >= e.first_index) & (ids < e.first_index + e.mm_length)
            out[m] = e.embeddings.float()[ids[m] - e.first_index]
            owned |= m
        assert bool(owned[mm].all()), "placeholder ids without their MMEmbedding in indexed_embeddings"
        return out


class Model:
    """`modules`: the embedding, one block per layer (a BlockSparseMLP under the sparse ones), the head (lm_head,
    an fp16 Linear). forward() is a deterministic function of the token history that runs every MoE layer."""

    def __init__(self, config: Config, modules: list[Module]):
        self.config, self.modules = config, modules
        self.caches: list[Cache] = []  # exllamav3 keeps weak references; allocated by load(), as there
        self.loaded = False
        self.output_device: Any = None

    @classmethod
    def from_config(cls, config: Config, component: str = "text", interm_dtype: torch.dtype = torch.half) -> Any:
        if component == "vision":
            assert config.vision_pp is not None, "Glm5NextForConditionalGeneration: no vision config"
            return Glm5NextVisionModel(config)
        assert component == "text", f"Glm5NextForConditionalGeneration does not define a '{component}' component model"
        modules: list[Module] = [Embedding(config, f"{PREFIX}.embed_tokens")]
        for i, kind in enumerate(config.mlp_layer_types):
            block = Module(config, f"{PREFIX}.layers.{i}")
            if kind == "sparse":
                block.register_submodule(BlockSparseMLP(
                    config, f"{PREFIX}.layers.{i}.mlp", config.hidden_size, config.moe_intermediate_size,
                    config.num_experts, config.num_experts_per_tok, act_limit=config.swiglu_limit,
                    interm_dtype=interm_dtype, routed_scaling_factor=config.routed_scaling_factor,
                    n_group=config.n_group, topk_group=config.topk_group))
            else:
                block.register_submodule(Module(config, f"{PREFIX}.layers.{i}.mlp"))  # a dense MLP stand-in
            modules.append(block)
        modules.append(Linear(config, "lm_head", config.hidden_size, config.vocab_size, out_dtype=torch.float,
                              pad_to=1))
        return cls(config, modules)

    def load(self, device: Any = "cpu", **kwargs: Any) -> None:
        for m in self.modules:
            m.load(device, **kwargs)
        self.loaded, self.output_device = True, device
        for cache in self.caches:
            cache.initialized = True

    def unload(self) -> None:
        for m in self.modules:
            m.unload()
        self.loaded, self.output_device = False, None
        for cache in self.caches:
            cache.initialized = False

    def moe(self) -> list[BlockSparseMLP]:
        return [m for top in self.modules for m in top if isinstance(m, BlockSparseMLP)]

    def forward(self, input_ids: torch.Tensor, params: dict) -> torch.Tensor:
        """Logits (bsz, n, vocab) float of input_ids (bsz, n). A position's state is its token's embedding plus 0.5 x
        the previous token's plus 0.25 x the one before (params["past_ids"], (bsz, 2): the two tokens before each
        row's first, -1 for none: the fake's KV cache), RMS-normalised to fp16; every MoE layer adds its output to
        it (renormalised), dense layers are identities; the head reads the last state. params["image_context"]
        (bsz, hidden), where a row's sequence holds images: 0.5 x the mean of their embeddings joins every position's
        state (the fake's stand-in for attention reaching back to the image)."""
        assert self.loaded, "forward() before load()"
        bsz = input_ids.shape[0]
        past = params.get("past_ids")
        if past is None:
            past = torch.full((bsz, CONTEXT - 1), -1, dtype=torch.long)
        emb = self.modules[0].forward(torch.cat([past.long(), input_ids.long()], dim=1), params)
        state = emb[:, 2:] + 0.5 * emb[:, 1:-1] + 0.25 * emb[:, :-2]
        seen = params.get("image_context")  # (bsz, hidden): the images each row's sequence holds, or None
        if seen is not None:
            state = state + 0.5 * seen.unsqueeze(1)
        x = rms_half(state)
        for m in self.moe():
            x = rms_half(x.float() + m.forward(x.contiguous(), params).float())
        return self.modules[-1].forward(x, params).float()


class Cache:
    """The paged KV cache's size (the fake keeps no K/V: the model reads the token history). Tied to the model and
    allocated by its next load(): a cache made after load() is not initialized, and iterate() refuses it."""

    def __init__(self, model: Model, max_num_tokens: int, layer_type: Any = None, max_batch_size: int = 16,
                 **kwargs: Any):
        self.model, self.max_num_tokens, self.max_batch_size = model, max_num_tokens, max_batch_size
        self.max_pages = max_num_tokens // PAGE_SIZE
        self.initialized = False
        model.caches.append(self)


class Tokenizer:
    """exllamav3.Tokenizer over the checkpoint's tokenizer.json (`tokenizer`: the tokenizers.Tokenizer)."""

    def __init__(self, config: Config):
        from tokenizers import Tokenizer as HFTokenizer

        self.config = config
        self.tokenizer = HFTokenizer.from_file(str(Path(config.directory) / "tokenizer.json"))
        self.eos_token_id = config.eos_token_id
        self.bos_token_id = config.bos_token_id
        self.raw_vocab_size = self.tokenizer.get_vocab_size()
        self.actual_vocab_size = self.raw_vocab_size  # the sampler masks the model's padded logits past this
        self._pieces: dict[bool, list[str]] = {}

    @staticmethod
    def from_config(config: Config) -> Tokenizer:
        return Tokenizer(config)

    def get_id_to_piece_list(self, include_special_tokens: bool = False) -> list[str]:
        pieces = self._pieces.get(include_special_tokens)
        if pieces is None:
            ids = [[i] for i in range(self.actual_vocab_size)]
            pieces = self._pieces[include_special_tokens] = self.tokenizer.decode_batch(
                ids, skip_special_tokens=not include_special_tokens)
        return pieces

    def decode(self, ids: torch.Tensor, decode_special_tokens: bool = False) -> str | list[str]:
        rows = ids.tolist()
        if ids.dim() == 1:
            return self.tokenizer.decode(rows, skip_special_tokens=not decode_special_tokens)
        return [self.tokenizer.decode(r, skip_special_tokens=not decode_special_tokens) for r in rows]


# ---- sampling ---------------------------------------------------------------------------------------------------

def _dense_mask(mask: torch.Tensor, dim: int) -> torch.Tensor:
    """A filter mask as an additive float (1, dim): a packed int32 bitmask (bit i & 31 of word i >> 5 set = allowed)
    or a dense additive one; tokens past its width are masked out (exllamav3's rule for both formats)."""
    out = torch.full((1, dim), float("-inf"))
    if mask.dtype == torch.int32:
        bits = np.unpackbits(mask.reshape(-1).numpy().view(np.uint8), bitorder="little")[:dim]
        out[0, : bits.size][torch.from_numpy(bits.astype(bool))] = 0.0
    else:
        n = min(dim, mask.shape[-1])
        out[0, :n] = mask.reshape(-1)[:n].float()
    return out


class Sampler:
    """exllamav3's sampler interface: forward(logits, sequence_ids, rand_u32, tokenizer, logit_mask) -> token ids of
    shape logits.shape[:-1]. Logits past the tokenizer's vocabulary are set to -inf in place (as exllamav3 does);
    the filter mask is applied to a copy. Each sampler's pick(x, rand_u32) draws from the masked logits."""

    reqs_past_ids = False

    def forward(self, logits: torch.Tensor, sequence_ids: Any = None, rand_u32: int | None = None,
                tokenizer: Tokenizer | None = None, logit_mask: torch.Tensor | None = None) -> torch.Tensor:
        out_shape = logits.shape[:-1]
        if tokenizer is not None and tokenizer.actual_vocab_size < logits.shape[-1]:
            logits[..., tokenizer.actual_vocab_size :] = -float("inf")
        dim = logits.shape[-1]
        x = logits.reshape(-1, dim).double()
        if logit_mask is not None:
            x = x + _dense_mask(logit_mask, dim).double()
        if rand_u32 is None:
            rand_u32 = random.randint(0, (1 << 32) - 1)
        return self.pick(x, rand_u32).view(out_shape)


class ArgmaxSampler(Sampler):
    def pick(self, x: torch.Tensor, rand_u32: int) -> torch.Tensor:
        return torch.argmax(x, dim=-1)  # ties: the lowest id


class ComboSampler(Sampler):
    """Temperature, min_p, top_k, top_p (exllamav3's order), then one draw from rand_u32; the penalties, DRY and
    logit bias of the real ComboSampler are not faked (a non-default value raises)."""

    def __init__(self, rep_p: float = 1.0, freq_p: float = 0.0, pres_p: float = 0.0, dry_multiplier: float = 0.0,
                 temperature: float = 1.0, min_p: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 temp_last: bool = False, logit_bias: dict | None = None, **kwargs: Any):
        if rep_p != 1.0 or freq_p or pres_p or dry_multiplier or temp_last or logit_bias:
            raise NotImplementedError("the fake ComboSampler has no penalties, DRY, temp_last or logit bias")
        self.temperature, self.min_p, self.top_k, self.top_p = temperature, min_p, top_k, top_p

    def pick(self, x: torch.Tensor, rand_u32: int) -> torch.Tensor:
        if self.temperature == 0 or self.top_k == 1:
            return torch.argmax(x, dim=-1)
        out = []
        for row in x:
            p = torch.softmax(row / self.temperature, dim=-1)
            if self.min_p > 0:
                p = torch.where(p < self.min_p * p.max(), 0.0, p)
            if self.top_k > 0:
                p = torch.where(p < torch.topk(p, min(self.top_k, p.numel())).values[-1], 0.0, p)
            if self.top_p < 1.0:
                sp, si = torch.sort(p, descending=True)
                keep = torch.cumsum(sp, 0) - sp < self.top_p * sp.sum()
                p = torch.zeros_like(p).scatter(0, si, torch.where(keep, sp, 0.0))
            cdf = torch.cumsum(p, 0)
            u = (rand_u32 + 0.5) / 2**32 * float(cdf[-1])
            out.append(min(int(torch.searchsorted(cdf, torch.tensor([u], dtype=cdf.dtype))), p.numel() - 1))
        return torch.tensor(out, dtype=torch.long)


# ---- filters (generator/filter/filter.py, llguidance.py) ---------------------------------------------------------

class Filter:
    """Inactive until trigger_token is sampled (then reset and active); active from the start without one. Each
    sampled token is fed; completing the grammar deactivates it and, with eos_after_completed, ends the job. The
    grammar itself is LLGuidanceFilter's: reset, accept_token, get_next_logit_mask, is_completed."""

    def __init__(self, tokenizer: Tokenizer, trigger_token: int | None, prefix_str: str | None,
                 eos_after_completed: bool):
        self.tokenizer, self.trigger_token = tokenizer, trigger_token
        self.prefix_str, self.eos_after_completed = prefix_str, eos_after_completed
        self.job: Any = None
        self.generator: Any = None
        self.vocab_size: int | None = None
        self.is_active = trigger_token is None

    def feed(self, token: int) -> bool:
        if not self.is_active:
            if token == self.trigger_token:
                self.is_active = True
                self.reset()
            return False
        self.accept_token(token)
        if self.is_completed():
            self.is_active = False
            return self.eos_after_completed
        return False

    def attach(self, job: Job) -> None:
        self.job, self.generator = job, job.generator
        self.vocab_size = job.generator.padded_vocab_size


try:
    from llguidance import LLMatcher, LLTokenizer, grammar_from

    llguidance_available = True
except ImportError:
    llguidance_available = False
    LLTokenizer = LLMatcher = grammar_from = None


@functools.lru_cache(10)
def create_ll_tokenizer(tokenizer: Tokenizer) -> Any:
    cfg = tokenizer.config
    eos = list(cfg.eos_token_id_list) if getattr(cfg, "eos_token_id_list", None) else tokenizer.eos_token_id
    return LLTokenizer(tokenizer.tokenizer.to_str(), eos_token=eos)


class LLGuidanceFilter(Filter):
    """exllamav3's LLGuidanceFilter (the same llguidance calls): one grammar source; a grammar llguidance rejects
    raises ValueError("Invalid grammar: ..."); masks are packed int32 bitmasks over llguidance's vocabulary."""

    def __init__(self, tokenizer: Tokenizer, trigger_token: int | None = None, prefix_str: str | None = None,
                 eos_after_completed: bool = False, json_schema: dict | str | None = None, regex: str | None = None,
                 lark_grammar: str | None = None, gbnf_grammar: str | None = None, llg_grammar: str | None = None,
                 consume_prefix: bool = False):
        if not llguidance_available:
            raise ValueError("llguidance package is not available.")
        super().__init__(tokenizer, trigger_token, prefix_str, eos_after_completed)
        sources = [("json_schema", json_schema), ("regex", regex), ("lark", lark_grammar), ("gbnf", gbnf_grammar),
                   ("llguidance", llg_grammar)]
        given = [(f, g) for f, g in sources if g is not None]
        assert len(given) == 1, "Specify exactly one of json_schema, regex, lark_grammar, gbnf_grammar, llg_grammar"
        g_format, g_text = given[0]
        if isinstance(g_text, dict):
            g_text = json.dumps(g_text)
        assert not (consume_prefix and prefix_str), "the fake does not consume prefixes"
        self._ll_tokenizer = create_ll_tokenizer(tokenizer)
        self._grammar = grammar_from(g_format, g_text)
        err = LLMatcher.validate_grammar(self._grammar, self._ll_tokenizer)
        if err:
            raise ValueError(f"Invalid grammar: {err}")
        self._matcher = LLMatcher(self._ll_tokenizer, self._grammar)
        self._bitmask = np.empty(((self._ll_tokenizer.vocab_size + 31) // 32,), dtype=np.int32)
        self._bitmask_torch = torch.from_numpy(self._bitmask).unsqueeze(0)
        self._check_error()

    def _check_error(self) -> None:
        if self._matcher.is_error():
            raise RuntimeError(f"llguidance matcher error: {self._matcher.get_error()}")

    def reset(self) -> None:
        if self._matcher.is_error():
            self._matcher = LLMatcher(self._ll_tokenizer, self._grammar)
        else:
            self._matcher.reset()
        self._check_error()

    def accept_token(self, token: int) -> None:
        if self._matcher.is_stopped():
            return
        self._matcher.consume_token(token)
        self._check_error()

    def get_next_logit_mask(self) -> torch.Tensor:
        bm = self._bitmask
        self._matcher.unsafe_compute_mask_ptr(bm.ctypes.data, bm.size * bm.itemsize)
        self._check_error()
        return self._bitmask_torch

    def is_completed(self) -> bool:
        return self._matcher.is_stopped()


# ---- the vision tower (architecture/glm5_next.py, glm4v.py, tokenizer/mm_embedding.py) ----------------------------

FIRST_MM_EMBEDDING_INDEX = 1000000000  # placeholder ids start here (exllamav3 assumes no vocabulary reaches it)
_mm_next = [FIRST_MM_EMBEDDING_INDEX]  # the process-wide allocator (mm_embedding.global_allocator)


class MMEmbedding:
    """One image's embeddings (tokens, hidden) and the placeholder ids it owns: token_string's -1 entries are
    replaced by first_index.. first_index + mm_length, allocated once per embedding, as in exllamav3."""

    def __init__(self, embeddings: torch.Tensor, token_string: torch.Tensor, text_alias: str | None = None,
                 grid_thw: tuple | None = None, mrope_merge_size: int | None = None, **kwargs: Any):
        self.metadata: dict = {}
        self.full_length = token_string.shape[-1]
        self.mm_length = embeddings.shape[-2]
        self.first_index = _mm_next[0]
        _mm_next[0] += self.mm_length
        self.last_index = self.first_index + self.mm_length
        self.embeddings = embeddings
        self.text_alias = text_alias or f"<$EMB_{self.first_index}$>"
        self.grid_thw, self.mrope_merge_size = grid_thw, mrope_merge_size
        r = torch.arange(self.first_index, self.last_index, dtype=torch.long)
        token_string.masked_scatter_(token_string == -1, r)
        self.token_string = token_string
        self.token_list = token_string[0].tolist()


def glm5_vision_canvas(num_frames, height, width, temporal_factor, factor, min_tokens, max_tokens):
    """exllamav3's aligned canvas within the token budget (architecture/mm_processing/glm5_next.py)."""
    pixels_per_token = temporal_factor * factor**2
    min_pixels, max_pixels = min_tokens * pixels_per_token, max_tokens * pixels_per_token

    def align(value: int, f: int) -> int:
        return -(-value // f) * f

    frames = max(temporal_factor, round(num_frames / temporal_factor) * temporal_factor)
    h, w = align(height, factor), align(width, factor)
    if frames * h * w < min_pixels:
        scale = float(np.sqrt(min_pixels / (num_frames * height * width)))
        h, w = align(max(1, int(np.ceil(height * scale))), factor), align(max(1, int(np.ceil(width * scale))), factor)
    if frames * h * w > max_pixels:
        low, high, best = 1, height, (factor, factor)
        while low <= high:
            ch = (low + high) // 2
            cw = max(1, width * ch // height)
            cand = (align(ch, factor), align(cw, factor))
            if frames * cand[0] * cand[1] <= max_pixels:
                best, low = cand, ch + 1
            else:
                high = ch - 1
        h, w = best
    return h, w


class Glm5NextVisionModel:
    """Model.from_config(config, component="vision"): load() reads the tower's patch embedding and downsample
    weights (model.visual.*; a checkpoint without them fails there, as exllamav3's loader does); preprocess() is
    exllamav3's (canvas, content scale, zero pad, rescale, normalize, merge-major patches, fp16);
    get_image_embeddings() runs a stand-in tower on the patches: the patch embedding, then each merge block's
    patches concatenated through the downsample conv, RMS-normalised, so the rows are a deterministic function of
    the pixels and the checkpoint's bytes."""

    def __init__(self, config: Config):
        self.config, self.loaded = config, False
        self.weights: dict[str, torch.Tensor] = {}
        self.forwards = 0

    def load(self, device: Any = "cpu", **kwargs: Any) -> None:
        for key in ("patch_embed.proj.weight", "patch_embed.proj.bias", "downsample.weight", "downsample.bias"):
            t = self.config.stc.get_tensor(f"model.visual.{key}", device)
            assert t is not None, f"model.visual.{key} is missing"
            self.weights[key] = t.float()
        self.loaded = True

    def unload(self) -> None:
        self.weights, self.loaded = {}, False

    def preprocess(self, image: Any) -> tuple[torch.Tensor, tuple, tuple]:
        from PIL import Image

        pp = self.config.vision_pp
        tps, factor, p, m = pp.temporal_patch_size, pp.patch_size * pp.merge_size, pp.patch_size, pp.merge_size
        image = image.convert("RGB")
        w, h = image.size
        th, tw = glm5_vision_canvas(tps, h, w, tps, factor, pp.min_image_tokens, pp.max_image_tokens)
        scale = min(th / h, tw / w)
        if tps * h * w >= tps * factor**2 * pp.min_image_tokens:
            scale = min(1.0, scale)
        ch, cw = max(1, min(th, int(np.floor(h * scale)))), max(1, min(tw, int(np.floor(w * scale))))
        if (cw, ch) != image.size:
            image = image.resize((cw, ch), resample=Image.Resampling(pp.resample))
        board = Image.new("RGB", (tw, th), (0, 0, 0))
        board.paste(image, (0, 0))
        x = np.array(board).astype(np.float32) * pp.rescale_factor
        x = (x - np.asarray(pp.image_mean, np.float32)) / np.asarray(pp.image_std, np.float32)
        x = np.tile(x.transpose(2, 0, 1)[None], (tps, 1, 1, 1))
        gh, gw = th // p, tw // p
        x = x.reshape(1, tps, 3, gh // m, m, p, gw // m, m, p).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return torch.from_numpy(x.reshape(gh * gw, 3 * tps * p * p).copy()).half(), (tw, th), (1, gh, gw)

    def get_image_embeddings(self, tokenizer: Tokenizer, image: Any, text_alias: str | None = None) -> MMEmbedding:
        assert self.loaded, "get_image_embeddings() before load()"
        patches, _, grid_thw = self.preprocess(image)
        wt = self.weights
        x = patches.float() @ wt["patch_embed.proj.weight"].reshape(wt["patch_embed.proj.weight"].shape[0], -1).T
        x = x + wt["patch_embed.proj.bias"]
        x = x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
        down = wt["downsample.weight"]
        blocks = x.reshape(-1, down.shape[2] * down.shape[3] * x.shape[-1])
        y = blocks @ down.permute(0, 2, 3, 1).reshape(down.shape[0], -1).T + wt["downsample.bias"]
        y = (y / y.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()).half()
        self.forwards += 1
        c = self.config
        token_string = torch.tensor([[c.vision_start_token_id] + [-1] * y.shape[0] + [c.vision_end_token_id]])
        return MMEmbedding(embeddings=y, text_alias=text_alias, token_string=token_string, grid_thw=grid_thw,
                           mrope_merge_size=c.vision_pp.merge_size)


# ---- jobs and the generator (generator/job.py, generator.py) -------------------------------------------------

class Job:
    """One sequence: the prompt, then sampled tokens streamed in exllamav3's result dicts (Job.receive_sample's
    emit(): "stage" "streaming", "eos", "eos_reason", "token_ids" / "logits" of the tokens released, "held" for
    what an ending job still held, "identifier" when given). Text is held while it ends in an incomplete
    character. `embeddings`: the MMEmbeddings whose ids the prompt holds, read by every forward of the job. Not faked
    (raise): stop strings, banned strings, token healing, top tokens / probs, loop detection."""

    def __init__(self, input_ids: torch.Tensor | list[torch.Tensor], max_new_tokens: int | None = None,
                 min_new_tokens: int = 0, max_skips: int | None = 4, sampler: Sampler | None = None,
                 seed: int | None = None, stop_conditions: list | tuple | set | None = None,
                 decode_special_tokens: bool = False, return_top_tokens: int = 0, return_logits: bool = False,
                 return_probs: bool = False, filters: list[Filter] | None = None, token_healing: bool = False,
                 identifier: object | None = None, banned_strings: list[str] | None = None,
                 embeddings: list | None = None, max_rq_tokens: int | None = None,
                 stop_on_loop: tuple[int, int] | None = None, rq_state: dict | None = None, **kwargs: Any):
        if isinstance(input_ids, list):
            assert len(input_ids) == 1, "A job holds exactly one sequence (multi-sequence jobs are not supported)"
            input_ids = input_ids[0]
        assert input_ids.device.type == "cpu", "input_ids must reside in system memory"
        assert input_ids.dim() == 2 and input_ids.shape[0] == 1, "input_ids must be [1, seq_len] tensor"
        assert input_ids.shape[-1] > 0, "Input IDs cannot be empty."
        assert max_new_tokens is None or max_new_tokens >= 1, "max_new_tokens must be >= 1, or None for no limit"
        if return_top_tokens or return_probs or token_healing or banned_strings or stop_on_loop or rq_state:
            raise NotImplementedError("the fake Job has no top tokens, probs, healing, banned strings or loop "
                                      "detection")
        self.embeddings = list(embeddings or [])  # MMEmbeddings whose placeholder ids the prompt holds
        self.orig_max_rq_tokens = self.max_rq_tokens = max_rq_tokens
        self.max_skips, self.skips, self.pages, self.requeued = max_skips, 0, 0, False
        self.generator: Generator | None = None
        self.serial_number: int | None = None
        self.identifier = identifier
        self.input_ids = input_ids.clone()
        self.sequence_ids: list[int] = input_ids[0].tolist()
        self.kv_position = 0
        self.max_new_tokens, self.min_new_tokens = max_new_tokens, min_new_tokens
        self.new_tokens = 0
        # What the page cache served of the prompt (nothing here: the fake caches no pages); rq_cached carries it
        # across requeues in exllamav3.
        self.cached_pages, self.cached_tokens, self.rq_cached = 0, 0, None
        self.sampler = sampler if sampler is not None else ComboSampler(temperature=0.8, min_p=0.08)
        self.seed = seed
        self.rng = random.Random() if seed is None else random.Random(seed)
        self.decode_special_tokens, self.return_logits = decode_special_tokens, return_logits
        self.stop_tokens: set[int] = set()
        if stop_conditions is not None:
            if isinstance(stop_conditions, str | int):
                stop_conditions = [stop_conditions]
            for t in stop_conditions:
                if isinstance(t, str):
                    raise NotImplementedError("the fake Job has no stop strings")
                if not isinstance(t, int):
                    raise ValueError("Unsupported type in stop_conditions")
                self.stop_tokens.add(t)
        self.filters = filters if filters is not None else []
        self.filters_suspended = False
        self.held_text = ""
        self.held_tokens: list[int] = []
        self.held_logits: list[torch.Tensor] = []
        self.full_completion = ""
        self.is_finished = False

    def prepare_for_queue(self, generator: Generator, serial_number: int) -> None:
        self.serial_number, self.generator = serial_number, generator
        # The cache bounds the response: max_new_tokens is capped to what fits past the prompt (exllamav3's rule).
        room = generator.max_total_tokens - len(self.input_ids[0]) - 1
        if self.max_new_tokens is None:
            self.max_new_tokens = max(1, room)
        elif room >= 1:
            self.max_new_tokens = min(self.max_new_tokens, room)
        # Pages for the prompt, the response and one position past it (Sequence.prepare, max_rq_tokens): a prompt
        # with no room left keeps its limit and fails here, as there.
        x = len(self.input_ids[0])
        if self.orig_max_rq_tokens is not None:  # a segment to the next page boundary at least (no recurrent cache)
            y = (x - 1 + self.orig_max_rq_tokens + PAGE_SIZE - 1) // PAGE_SIZE * PAGE_SIZE
            self.max_rq_tokens = max(1, min(y, generator.max_total_tokens) - x)
        else:
            self.max_rq_tokens = self.max_new_tokens + 1
        total_pages = self.pages = (x + self.max_rq_tokens + PAGE_SIZE - 1) // PAGE_SIZE
        max_pages = generator.cache.max_pages
        assert total_pages <= max_pages, \
            f"Job requires {total_pages} pages (only {max_pages} available) and cannot be enqueued. Total cache " \
            f"allocated is {max_pages} * {PAGE_SIZE} = {generator.max_total_tokens} tokens"

    def activate(self) -> None:
        for f in self.filters:
            f.attach(self)
            f.reset()
            f.is_active = f.trigger_token is None and not self.filters_suspended

    def is_prefill_done(self) -> bool:
        return self.kv_position == len(self.sequence_ids) - 1

    def _past(self, pos: int) -> list[int]:
        """The CONTEXT - 1 tokens before position pos (-1 before the start)."""
        return [self.sequence_ids[i] if i >= 0 else -1 for i in range(pos - CONTEXT + 1, pos)]

    def prefill(self, results: list) -> None:
        """One chunk of the prompt (all but its last token) through the model, ending on a page boundary."""
        n = len(self.sequence_ids)
        if self.kv_position >= n - 1:
            return
        start = self.kv_position
        end = min((start + self.generator.max_chunk_size) // PAGE_SIZE * PAGE_SIZE, n - 1)
        ids = torch.tensor([self.sequence_ids[start:end]], dtype=torch.long)
        self.generator.model.forward(ids, {"past_ids": torch.tensor([self._past(start)], dtype=torch.long),
                                           "indexed_embeddings": self.embeddings,
                                           "image_context": _image_context([self])})
        self.kv_position = end
        r = {"job": self, "stage": "prefill", "eos": False, "curr_progress": end, "max_progress": n - 1,
             "serial": self.serial_number}
        if self.identifier is not None:
            r["identifier"] = self.identifier
        results.append(r)

    def logit_mask(self) -> torch.Tensor | None:
        """The active filters' masks combined (and stop tokens blocked before min_new_tokens)."""
        dim = self.generator.padded_vocab_size
        mask = None
        if not self.filters_suspended:
            for f in self.filters:
                if f.is_active:
                    m = _dense_mask(f.get_next_logit_mask(), dim)
                    mask = m if mask is None else mask + m
        if self.new_tokens < self.min_new_tokens and self.stop_tokens:
            mask = torch.zeros((1, dim)) if mask is None else mask
            mask[:, sorted(self.stop_tokens)] = float("-inf")
        return mask

    def prepare_for_requeue(self) -> None:
        """The sequence so far becomes the prompt of the job's next segment (the same object, as in exllamav3)."""
        self.max_new_tokens -= self.new_tokens
        self.min_new_tokens = max(0, self.min_new_tokens - self.new_tokens)
        self.input_ids = torch.tensor([self.sequence_ids], dtype=torch.long)
        self.new_tokens, self.kv_position, self.requeued = 0, 0, True
        self.prepare_for_queue(self.generator, self.serial_number)

    def receive_sample(self, logits: torch.Tensor, next_token: torch.Tensor, results: list) -> bool | str:
        """Accept one sampled token (logits: its (1, 1, vocab) row); True when the job ended, "requeue" at the end
        of its segment."""
        token = int(next_token.item())
        filter_eos = False
        if not self.filters_suspended:
            for f in self.filters:
                filter_eos |= f.feed(token)
        self.new_tokens += 1
        self.sequence_ids.append(token)
        self.kv_position += 1

        tokenizer = self.generator.tokenizer
        self.held_text += tokenizer.get_id_to_piece_list(self.decode_special_tokens)[token]
        self.held_tokens.append(token)
        if self.return_logits:
            self.held_logits.append(logits[:1, :, :].clone())
        if token in self.stop_tokens:
            return self._emit(results, eos="stop_token", stop_token=token)
        if self.new_tokens >= self.max_new_tokens:
            return self._emit(results, eos="max_new_tokens", held=True)
        if filter_eos:
            return self._emit(results, eos="end_filter", held=True)
        if self.new_tokens >= self.max_rq_tokens:
            self._emit(results, held=True, requeue=True)
            return "requeue"
        if "\ufffd" in self.held_text:
            text = tokenizer.decode(torch.tensor([self.held_tokens]), self.decode_special_tokens)[0]
            if text.endswith("\ufffd") and len(text) <= 20:
                return self._emit(results)  # the last character may still be completed: hold
            self.held_text = text
        return self._emit(results, held=True)

    def _emit(self, results: list, eos: str | None = None, held: bool = False, stop_token: int | None = None,
              requeue: bool = False) -> bool:
        r: dict[str, Any] = {"job": self, "stage": "streaming", "eos": eos is not None, "serial": self.serial_number}
        if requeue:
            r["requeue"] = True
        if eos is not None:
            r["eos_reason"] = eos
            if eos == "stop_token":
                r["eos_triggering_token_id"] = stop_token
                r["eos_triggering_token_str"] = self.generator.tokenizer.get_id_to_piece_list(True)[stop_token]
        if held:
            if eos is not None and "\ufffd" in self.held_text and self.held_tokens:
                self.held_text = self.generator.tokenizer.decode(torch.tensor([self.held_tokens]),
                                                                 self.decode_special_tokens)[0]
            if self.held_text:
                self.full_completion += self.held_text
                r["text"], self.held_text = self.held_text, ""
            if self.held_tokens:
                r["token_ids"] = torch.tensor([self.held_tokens], dtype=torch.long)
                self.held_tokens = []
            if self.held_logits:
                r["logits"] = torch.cat(self.held_logits, dim=1)
                self.held_logits = []
        if eos is not None:
            self.is_finished = True
            r.update(full_completion=self.full_completion, new_tokens=self.new_tokens,
                     prompt_tokens=len(self.input_ids[0]), time_enqueued=0.0, time_prefill=0.0, time_generate=0.0,
                     cached_pages=self.cached_pages, cached_tokens=self.cached_pages * PAGE_SIZE + self.cached_tokens)
            rh: dict[str, Any] = {}
            if self.held_text:
                rh["text"] = self.held_text
            if self.held_tokens:
                rh["token_ids"] = torch.tensor([self.held_tokens], dtype=torch.long)
            if self.held_logits:
                rh["logits"] = torch.cat(self.held_logits, dim=1)
            if rh:
                r["held"] = rh
        if self.identifier is not None:
            r["identifier"] = self.identifier
        results.append(r)
        return eos is not None


class PageTable:
    """The page table's counters (generator/pagetable.py): pages held by active jobs, nothing cached."""

    def __init__(self, generator: Generator, max_pages: int):
        self.generator, self.max_pages = generator, max_pages
        self.metrics = {"evictions": 0, "evictions_live": 0, "stashes_stranded": 0, "alloc_pages": 0,
                        "alloc_prompt_pages": 0, "alloc_cached_pages": 0, "alloc_tier_pages": 0,
                        "alloc_disk_pages": 0, "alloc_kv_only_pages": 0}

    def num_unreferenced_pages(self) -> int:
        return self.max_pages - sum(job.pages for job in self.generator.active_jobs)

    def reset_page_table(self) -> None:
        """Every page a fresh hash: no cached prefix is found again."""
        if self.generator.page_hashes is not None:
            self.generator.page_hashes.clear()


class Generator:
    """Pending and active jobs; iterate(): start jobs (up to max_batch_size), one prefill chunk per job still
    ingesting its prompt (a failure there fails only that job: an "error" result, as reap_failed_job does), then one
    batched decode step (one model forward of every job past its prompt) and each job's sample. Pages as the module
    docstring says; no speculative decoding."""

    def __init__(self, model: Model, cache: Cache, tokenizer: Tokenizer, max_batch_size: int = 256,
                 max_chunk_size: int = 2048, **kwargs: Any):
        self.model, self.cache, self.tokenizer = model, cache, tokenizer
        self.max_batch_size, self.max_chunk_size = max_batch_size, max_chunk_size
        self.padded_vocab_size = (model.config.vocab_size + 31) // 32 * 32
        self.max_total_tokens = PAGE_SIZE * cache.max_pages
        self.pending_jobs: list[Job] = []
        self.active_jobs: list[Job] = []
        self.pagetable = PageTable(self, cache.max_pages)
        self.recurrent_cache = None
        self.job_serial = 0
        self.forwards = 0  # model forwards (prefill chunks and decode steps), for tests
        # installed(prompt_cache=True): hashes of the full pages ended jobs held, the latest max_pages of them
        self.page_hashes: OrderedDict[bytes, None] | None = OrderedDict() if _options["prompt_cache"] else None

    def num_remaining_jobs(self) -> int:
        return len(self.pending_jobs) + len(self.active_jobs)

    def enqueue(self, job: Job | list[Job]) -> int | list[int]:
        if isinstance(job, list):
            return [self.enqueue(j) for j in job]
        job.prepare_for_queue(self, self.job_serial)
        self.job_serial += 1
        self.pending_jobs.append(job)
        return job.serial_number

    def cancel(self, job: Job) -> None:
        if job in self.pending_jobs:
            self.pending_jobs.remove(job)
        elif job in self.active_jobs:
            self.active_jobs.remove(job)

    def clear_queue(self) -> None:
        self.active_jobs.clear()
        self.pending_jobs.clear()

    def reap_failed_job(self, job: Job, error: Exception, results: list) -> None:
        if job in self.active_jobs:
            self.active_jobs.remove(job)
        results.append({"job": job, "serial": job.serial_number, "stage": "error", "eos": True, "error": error})

    def iterate(self) -> list[dict]:
        assert self.cache.initialized, \
            "Cache tensors were never allocated. Construct the Cache BEFORE calling model.load()"
        results: list[dict] = []
        skipped: list[Job] = []
        for job in list(self.pending_jobs):
            if len(self.active_jobs) >= self.max_batch_size:
                break
            if job.pages > self.pagetable.num_unreferenced_pages():
                skipped.append(job)
                continue
            if any(j.skips >= j.max_skips for j in skipped):
                break
            for j in skipped:
                j.skips += 1
            self.pending_jobs.remove(job)
            self.active_jobs.append(job)
            self.pagetable.metrics["alloc_pages"] += job.pages
            if not job.requeued:  # a requeued job's filters carry on where they were
                job.activate()
                self._reuse_pages(job)
            r = {"job": job, "stage": "started", "eos": False, "serial": job.serial_number}
            if job.identifier is not None:
                r["identifier"] = job.identifier
            results.append(r)
        for job in list(self.active_jobs):
            try:
                if not job.is_prefill_done():
                    self.forwards += 1
                job.prefill(results)
            except Exception as e:
                self.reap_failed_job(job, e, results)
        self._iterate_gen(results)
        return results

    def _iterate_gen(self, results: list) -> None:
        batch = [job for job in self.active_jobs if job.is_prefill_done()]
        if not batch:
            return
        masks = [job.logit_mask() for job in batch]  # exllamav3 computes them alongside the forward
        ids = torch.tensor([[job.sequence_ids[-1]] for job in batch], dtype=torch.long)
        past = torch.tensor([job._past(len(job.sequence_ids) - 1) for job in batch], dtype=torch.long)
        self.forwards += 1
        logits = self.model.forward(ids, {"past_ids": past,
                                          "indexed_embeddings": [e for job in batch for e in job.embeddings],
                                          "image_context": _image_context(batch)})
        for j, (job, mask) in enumerate(zip(batch, masks, strict=True)):
            row = logits[j : j + 1]
            token = job.sampler.forward(row, None, job.rng.randint(0, (1 << 32) - 1), self.tokenizer, logit_mask=mask)
            ended = job.receive_sample(row, token, results)
            if ended:
                self.active_jobs.remove(job)
                self._keep_pages(job)
            if ended == "requeue":
                job.prepare_for_requeue()
                self.pending_jobs.insert(0, job)


    def _reuse_pages(self, job: Job) -> None:
        """With the prompt cache: the job starts past the leading full pages an ended job held (their hash chain:
        the token ids of every page up to them, placeholder ids included), leaving at least one token to prefill;
        the end-of-job result reports them."""
        if self.page_hashes is None:
            return
        limit = max(0, (len(job.sequence_ids) - 2) // PAGE_SIZE)
        n = 0
        for h in _page_chain(job.sequence_ids)[:limit]:
            if h not in self.page_hashes:
                break
            self.page_hashes.move_to_end(h)
            n += 1
        job.cached_pages, job.kv_position = n, n * PAGE_SIZE
        self.pagetable.metrics["alloc_cached_pages"] += n

    def _keep_pages(self, job: Job) -> None:
        if self.page_hashes is None:
            return
        for h in _page_chain(job.sequence_ids[:job.kv_position]):
            self.page_hashes[h] = None
            self.page_hashes.move_to_end(h)
        while len(self.page_hashes) > self.cache.max_pages:
            self.page_hashes.popitem(last=False)


def _image_context(jobs: list[Job]) -> torch.Tensor | None:
    """Per job, the mean row of the embeddings its sequence holds (zeros for none); None when no job has any."""
    if not any(job.embeddings for job in jobs):
        return None
    hidden = next(e.embeddings.shape[-1] for job in jobs for e in job.embeddings)
    return torch.stack([torch.cat([e.embeddings.float() for e in job.embeddings]).mean(0) if job.embeddings
                        else torch.zeros(hidden) for job in jobs])


def _page_chain(ids: list[int]) -> list[bytes]:
    """The hash of each full page of `ids`, chained through the pages before it (pagetable.tensor_hash_checksum)."""
    out, h = [], b""
    for i in range(len(ids) // PAGE_SIZE):
        h = hashlib.sha256(h + np.asarray(ids[i * PAGE_SIZE:(i + 1) * PAGE_SIZE], dtype=np.int64).tobytes()).digest()
        out.append(h)
    return out


def _module(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


def fake_modules() -> dict[str, types.ModuleType]:
    """The sys.modules entries of the fake exllamav3, parents included."""
    mods = {
        "exllamav3": _module("exllamav3", Config=Config, Model=Model, Cache=Cache, Tokenizer=Tokenizer,
                             Generator=Generator, Job=Job, ArgmaxSampler=ArgmaxSampler, ComboSampler=ComboSampler),
        "exllamav3.generator": _module("exllamav3.generator"),
        "exllamav3.generator.filter": _module("exllamav3.generator.filter", Filter=Filter,
                                              LLGuidanceFilter=LLGuidanceFilter),
        "exllamav3.generator.filter.llguidance": _module("exllamav3.generator.filter.llguidance",
                                                         LLGuidanceFilter=LLGuidanceFilter,
                                                         llguidance_available=llguidance_available,
                                                         create_ll_tokenizer=create_ll_tokenizer),
        "exllamav3.version": _module("exllamav3.version", __version__=VERSION),
        "exllamav3.tokenizer": _module("exllamav3.tokenizer", MMEmbedding=MMEmbedding, Tokenizer=Tokenizer),
        "exllamav3.architecture": _module("exllamav3.architecture"),
        "exllamav3.architecture.glm5_next": _module("exllamav3.architecture.glm5_next",
                                                    Glm5NextVisionModel=Glm5NextVisionModel),
        "exllamav3.modules": _module("exllamav3.modules"),
        "exllamav3.modules.block_sparse_mlp": _module("exllamav3.modules.block_sparse_mlp",
                                                      BlockSparseMLP=BlockSparseMLP, MAX_BSZN=MAX_BSZN),
        "exllamav3.modules.block_sparse_mlp_routing": _module("exllamav3.modules.block_sparse_mlp_routing",
                                                              RoutingCFG=RoutingCFG),
        "exllamav3.modules.linear": _module("exllamav3.modules.linear", Linear=Linear),
        "exllamav3.modules.mla_attn": _module("exllamav3.modules.mla_attn", MAX_DECODE_QLEN=16),
        "exllamav3.modules.quant": _module("exllamav3.modules.quant"),
        "exllamav3.modules.quant.exl3": _module("exllamav3.modules.quant.exl3", LinearEXL3=LinearEXL3),
        "exllamav3.modules.quant.exl3_lib": _module("exllamav3.modules.quant.exl3_lib"),
        "exllamav3.modules.quant.exl3_lib.quantize": _module("exllamav3.modules.quant.exl3_lib.quantize",
                                                             codebook_mul1_mult=codebook_mul1_mult,
                                                             codebook_mcg_mult=codebook_mcg_mult),
    }
    for name, mod in mods.items():  # `import a.b` binds b on a
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(mods[parent], child, mod)
    return mods


_options = {"prompt_cache": False}


@contextlib.contextmanager
def installed(prompt_cache: bool = False) -> Iterator[dict[str, types.ModuleType]]:
    """The fake exllamav3 in sys.modules inside the block; whatever was there before (usually nothing) after.
    prompt_cache: generators made inside reuse the full pages of ended jobs (Generator._reuse_pages)."""
    mods = fake_modules()
    saved = {name: sys.modules.get(name) for name in mods}
    sys.modules.update(mods)
    _options["prompt_cache"] = prompt_cache
    try:
        yield mods
    finally:
        _options["prompt_cache"] = False
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old

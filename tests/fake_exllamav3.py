"""A fake exllamav3 1.6.5 for CPU tests of glm53.engine.exl3_adapter's glue (helpers only, no tests here).

`installed()` puts fake modules into sys.modules for the duration of a `with` block (exllamav3, .version,
.modules.block_sparse_mlp, .modules.block_sparse_mlp_routing, .modules.linear, .modules.quant.exl3,
.modules.quant.exl3_lib.quantize) that satisfy the adapter's check_contract(), and puts back what was there
before. `Model.from_config(Config.from_directory(dir))` builds a model of a generated EXL3 checkpoint
(glm53.fixture.exl3) whose MoE layers are FakeBlockSparseMLP; nothing else of the model is faked beyond what the
adapter walks (`model.modules`, each iterable over its submodules).

What is imitated, from exllamav3 1.6.5's sources (modules/block_sparse_mlp.py, block_sparse_mlp_cpu.py,
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
import hashlib
import json
import sys
import threading
import types
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
        text = json.loads((Path(model_dir) / "config.json").read_text())["text_config"]
        self.hidden_size = text["hidden_size"]
        self.moe_intermediate_size = text["moe_intermediate_size"]
        self.num_experts = text["n_routed_experts"]
        self.num_experts_per_tok = text["num_experts_per_tok"]
        self.swiglu_limit = float(text.get("swiglu_limit") or 0.0)
        self.routed_scaling_factor = text.get("routed_scaling_factor")
        self.n_group = text.get("n_group")
        self.topk_group = text.get("topk_group")
        self.mlp_layer_types = list(text["mlp_layer_types"])
        self.stc = FakeSTC(model_dir)
        self.infer_params = types.SimpleNamespace(no_reconstruct=False)

    @classmethod
    def from_directory(cls, model_dir: str) -> Config:
        return cls(model_dir)


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

    def q_cb(self) -> tuple[bool, bool]:
        return self.mcg, self.mul1

    def unload(self) -> None:
        pass


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
    """GLM's router: sigmoid scores; top-k of score + selection bias (group-limited where configured); weights the
    unbiased scores of the picks, normalised, times routed_scaling_factor; half. bsz 1: the fixed buffers."""
    scores = torch.sigmoid(y.reshape(bsz, -1).float() @ cfg.gate_tensor.float())
    sel = scores + (cfg.e_score_correction_bias.float() if cfg.e_score_correction_bias is not None else 0.0)
    if (cfg.n_group or 1) > 1:
        grouped = sel.unflatten(-1, (cfg.n_group, -1))
        keep = torch.zeros(grouped.shape[:-1], dtype=torch.bool)
        keep.scatter_(-1, grouped.topk(2, dim=-1).values.sum(-1).topk(cfg.topk_group, dim=-1).indices, True)
        sel = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(-2)
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


# ---- the model and the rest of the public names --------------------------------------------------------------

class Model:
    """What TieredMoE walks: `modules`, top-level modules iterable over their submodules."""

    def __init__(self, config: Config, modules: list[Module]):
        self.config, self.modules = config, modules

    @classmethod
    def from_config(cls, config: Config, interm_dtype: torch.dtype = torch.half) -> Model:
        modules: list[Module] = [Module(config, f"{PREFIX}.embed_tokens")]
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
        return cls(config, modules)

    def load(self, device: Any = "cpu", **kwargs: Any) -> None:
        for m in self.modules:
            m.load(device, **kwargs)

    def unload(self) -> None:
        for m in self.modules:
            m.unload()

    def moe(self) -> list[BlockSparseMLP]:
        return [m for top in self.modules for m in top if isinstance(m, BlockSparseMLP)]


class Cache:
    pass


class Tokenizer:
    pass


class Generator:
    pass


class Job:
    pass


def _module(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


def fake_modules() -> dict[str, types.ModuleType]:
    """The sys.modules entries of the fake exllamav3, parents included."""
    mods = {
        "exllamav3": _module("exllamav3", Config=Config, Model=Model, Cache=Cache, Tokenizer=Tokenizer,
                             Generator=Generator, Job=Job),
        "exllamav3.version": _module("exllamav3.version", __version__=VERSION),
        "exllamav3.modules": _module("exllamav3.modules", Module=Module, Linear=Linear,
                                     BlockSparseMLP=BlockSparseMLP),
        "exllamav3.modules.block_sparse_mlp": _module("exllamav3.modules.block_sparse_mlp",
                                                      BlockSparseMLP=BlockSparseMLP, MAX_BSZN=MAX_BSZN),
        "exllamav3.modules.block_sparse_mlp_routing": _module("exllamav3.modules.block_sparse_mlp_routing",
                                                              RoutingCFG=RoutingCFG, routing_dots=routing_dots),
        "exllamav3.modules.linear": _module("exllamav3.modules.linear", Linear=Linear),
        "exllamav3.modules.multilinear": _module("exllamav3.modules.multilinear", MultiLinear=MultiLinear),
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


@contextlib.contextmanager
def installed() -> Iterator[dict[str, types.ModuleType]]:
    """The fake exllamav3 in sys.modules inside the block; whatever was there before (usually nothing) after."""
    mods = fake_modules()
    saved = {name: sys.modules.get(name) for name in mods}
    sys.modules.update(mods)
    try:
        yield mods
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old

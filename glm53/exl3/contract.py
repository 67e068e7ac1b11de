"""The exllamav3 contract: every internal glm53 hooks, checked at start-up so that an upgrade fails in one place.

Supported: exllamav3 1.6.5 (layer-split loading, one CUDA device). `check_contract()` verifies every hook below
before any weight is read and fails with the missing piece named.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SUPPORTED_VERSION = "1.6.5"
MAX_BSZN = 8  # exllamav3's fused decode kernel row limit (block_sparse_mlp.MAX_BSZN); checked by the contract
# The most query rows MLA attention runs through its captured path (mla_attn.MAX_DECODE_QLEN), compiled per row
# count: the warm-up covers each (glm53.engine.warmup); checked by the contract
SMALL_QUERY_ROWS = 16


class Exl3ContractError(RuntimeError):
    """The installed exllamav3 lacks something the adapter hooks (another version, or a changed internal)."""


@dataclass(frozen=True)
class Hook:
    """One thing the adapter relies on: `target` is "module:Class" or "module", `name` an attribute on it."""

    target: str
    name: str
    why: str
    source_contains: str | None = None  # for methods: a call that must appear in the method's source


CONTRACT: tuple[Hook, ...] = (
    Hook("exllamav3", "Config", "Config.from_directory reads the checkpoint"),
    Hook("exllamav3", "Model", "Model.from_config builds the modules we patch before load()"),
    Hook("exllamav3", "Cache", "paged KV cache sized by the plan"),
    Hook("exllamav3", "Tokenizer", "the generator's tokenizer"),
    Hook("exllamav3", "Generator", "jobs, streaming, sampling"),
    Hook("exllamav3", "Job", "one request"),
    Hook("exllamav3.modules.block_sparse_mlp", "MAX_BSZN", "decode batches (<= 8 rows) run the fused kernel"),
    Hook("exllamav3.modules.mla_attn", "MAX_DECODE_QLEN", "MLA's small-query path, compiled per row count (warm-up)"),
    Hook("exllamav3.modules.block_sparse_mlp:BlockSparseMLP", "forward",
         "calls the CPU-split seam after routing, before any expert kernel", "self.cpu_split_submit("),
    Hook("exllamav3.modules.block_sparse_mlp:BlockSparseMLP", "forward",
         "folds the seam's partial back in (None: identity)", "self.cpu_split_combine("),
    Hook("exllamav3.modules.block_sparse_mlp:BlockSparseMLP", "load",
         "builds the pointer tables from the (slot) expert lists after the submodules load", "self.load_local("),
    Hook("exllamav3.modules.block_sparse_mlp:BlockSparseMLP", "load_local",
         "bakes expert tensor pointers into MultiLinear / BC_BlockSparseMLP", "MultiLinear("),
    Hook("exllamav3.modules.block_sparse_mlp:BlockSparseMLP", "cpu_unload",
         "restores the expert lists from _split_saved on unload", "self._split_saved"),
    Hook("exllamav3.modules.block_sparse_mlp:BlockSparseMLP", "cpu_split_combine",
         "the stock combine (identity for a None partial); replaced per instance to add the CPU lane's partial"),
    Hook("exllamav3.modules.block_sparse_mlp:BlockSparseMLP", "forward",
         "the torch expert path we mirror to recompute a CPU-lane job on the GPU", "self.activation_fn_call(g, u, a"),
    Hook("exllamav3.modules.block_sparse_mlp_routing", "RoutingCFG",
         "gate_tensor (hidden, experts) and e_score_correction_bias: the next layer's router, run ahead"),
    Hook("exllamav3.modules.block_sparse_mlp:BlockSparseMLP", "_cpu_init_state",
         "initialises cpu_split_first / _split_map to None"),
    Hook("exllamav3.modules.linear:Linear", "load", "replaced per slot Linear: builds LinearEXL3 on arena views"),
    Hook("exllamav3.modules.linear:Linear", "load_exl3", "the stock EXL3 load we mirror (codebook markers)",
         "get_codebook_marker("),
    Hook("exllamav3.modules.quant.exl3:LinearEXL3", "__init__",
         "LinearEXL3(config, in, out, scale, su, sv, suh, svh, trellis, mcg, mul1, bias, out_dtype, key=)",
         "ext.BC_LinearEXL3("),
    Hook("exllamav3.modules.quant.exl3_lib.quantize", "codebook_mul1_mult", "mul1 codebook marker value"),
    Hook("exllamav3.modules.quant.exl3_lib.quantize", "codebook_mcg_mult", "mcg codebook marker value"),
    Hook("exllamav3.architecture.glm5_next:Glm5NextVisionModel", "get_image_embeddings",
         "an image's embeddings by exllamav3's own preprocessing and tower (Model.from_config component=\"vision\")",
         "MMEmbedding("),
    Hook("exllamav3.tokenizer", "MMEmbedding", "an image's placeholder ids (token_list) and rows, taken by a Job"),
)

ROUTING_FIELDS = ("gate_tensor", "e_score_correction_bias", "num_experts_per_tok", "n_group", "topk_group")


# LinearEXL3's positional parameters, in order: the slot loader passes them by position like the stock loader.
LINEAR_EXL3_PARAMS = ("config", "in_features", "out_features", "scale", "su", "sv", "suh", "svh", "trellis", "mcg",
                      "mul1", "bias", "out_dtype")


def describe_contract() -> str:
    """The contract as text (for logs and `glm53 bench decode --help`-style output)."""
    lines = [f"glm53 exllamav3 adapter contract (exllamav3 {SUPPORTED_VERSION}):"]
    for h in CONTRACT:
        extra = f" [source contains {h.source_contains!r}]" if h.source_contains else ""
        lines.append(f"  {h.target}.{h.name}: {h.why}{extra}")
    return "\n".join(lines)


def _resolve(target: str, importer: Callable[[str], Any]) -> Any:
    mod_name, _, cls = target.partition(":")
    obj = importer(mod_name)
    return getattr(obj, cls) if cls else obj


def check_contract(importer: Callable[[str], Any] | None = None, version: str | None = None) -> None:
    """Raise Exl3ContractError naming the first missing piece; `importer`/`version` let CPU tests inject fakes."""
    import importlib

    importer = importer or importlib.import_module
    where = f"glm53 supports exllamav3 {SUPPORTED_VERSION} only"
    if version is None:
        try:
            version = importer("exllamav3.version").__version__
        except Exception as exc:  # an ImportError, or a broken build: both mean "not usable"
            raise Exl3ContractError(f"exllamav3 is not importable ({exc!r}); {where}") from exc
    if version != SUPPORTED_VERSION:
        raise Exl3ContractError(f"exllamav3 {version} is installed; {where} (pip install exllamav3=={SUPPORTED_VERSION})")
    for h in CONTRACT:
        try:
            owner = _resolve(h.target, importer)
        except (ImportError, AttributeError) as exc:
            raise Exl3ContractError(f"exllamav3 {version}: {h.target} is missing ({exc}); {where}") from exc
        if not hasattr(owner, h.name):
            raise Exl3ContractError(f"exllamav3 {version}: {h.target}.{h.name} is missing (needed: {h.why}); {where}")
        if h.source_contains:
            try:
                src = inspect.getsource(getattr(owner, h.name))
            except (OSError, TypeError) as exc:
                raise Exl3ContractError(f"exllamav3 {version}: cannot read the source of {h.target}.{h.name} "
                                        f"to check it ({exc}); {where}") from exc
            if h.source_contains not in src:
                raise Exl3ContractError(f"exllamav3 {version}: {h.target}.{h.name} no longer contains "
                                        f"{h.source_contains!r} (needed: {h.why}); {where}")
    lin = _resolve("exllamav3.modules.quant.exl3:LinearEXL3", importer)
    params = tuple(inspect.signature(lin.__init__).parameters)[1 : 1 + len(LINEAR_EXL3_PARAMS)]
    if params != LINEAR_EXL3_PARAMS:
        raise Exl3ContractError(f"exllamav3 {version}: LinearEXL3.__init__ takes {params}, expected "
                                f"{LINEAR_EXL3_PARAMS}; {where}")
    fields = getattr(_resolve("exllamav3.modules.block_sparse_mlp_routing:RoutingCFG", importer),
                     "__dataclass_fields__", {})
    for name in ROUTING_FIELDS:
        if name not in fields:
            raise Exl3ContractError(f"exllamav3 {version}: RoutingCFG has no field {name!r} (needed: the router "
                                    f"lookahead); {where}")
    bsz = _resolve("exllamav3.modules.block_sparse_mlp", importer).MAX_BSZN
    if bsz != MAX_BSZN:
        raise Exl3ContractError(f"exllamav3 {version}: MAX_BSZN is {bsz}, expected {MAX_BSZN}; {where}")
    rows = _resolve("exllamav3.modules.mla_attn", importer).MAX_DECODE_QLEN
    if rows != SMALL_QUERY_ROWS:
        raise Exl3ContractError(f"exllamav3 {version}: MAX_DECODE_QLEN is {rows}, expected {SMALL_QUERY_ROWS} (the "
                                f"warm-up's small-query shapes); {where}")



def installed() -> bool:
    """exllamav3 importable, found without importing it (the import JIT-loads CUDA code)."""
    import importlib.util

    return importlib.util.find_spec("exllamav3") is not None


def gpu_available() -> bool:
    """exllamav3 installed and a CUDA device present: the exllamav3 engine can run here."""
    if not installed():
        return False
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()

"""glm53.exl3's pure parts, on the CPU: the contract check, the staging rule and the header index. (The host side
of a layer step, which the seam delegates to, is tested in tests/step/test_stepper.py.)"""

from __future__ import annotations

import dataclasses
import json
import struct
import types

import numpy as np
import pytest

from glm53.exl3 import contract as A
from glm53.exl3.tensors import SafetensorsIndex
from glm53.exl3.tiered import staging_needed

# ---- a fake exllamav3 that satisfies the contract (method bodies carry the calls the contract looks for) --------


class FakeBlockSparseMLP:
    def forward(self):
        self.cpu_split_submit(None)
        self.cpu_split_combine(None)
        self.activation_fn_call(g, u, a, self.act_limit)  # noqa: F821 - never called, only its source is read

    def load(self):
        self.load_local()

    def load_local(self):
        return MultiLinear()  # noqa: F821 - never called, only its source is read

    def cpu_unload(self):
        return self._split_saved

    def cpu_split_combine(self):
        pass

    def _cpu_init_state(self):
        pass


class FakeLinear:
    def load(self):
        pass

    def load_exl3(self):
        return self.config.stc.get_codebook_marker("k", 1)


class FakeLinearEXL3:
    def __init__(self, config, in_features, out_features, scale, su, sv, suh, svh, trellis, mcg, mul1, bias,
                 out_dtype, transformers_fix=False, key=None):
        self.bc = ext.BC_LinearEXL3(trellis)  # noqa: F821 - never called, only its source is read


class FakeVisionModel:
    def get_image_embeddings(self):
        return MMEmbedding()  # noqa: F821 - never called, only its source is read


@dataclasses.dataclass
class FakeRoutingCFG:
    gate_tensor: object
    e_score_correction_bias: object
    num_experts_per_tok: int
    n_group: int
    topk_group: int


def fake_modules(**overrides):
    mods = {
        "exllamav3": types.SimpleNamespace(Config=1, Model=1, Cache=1, Tokenizer=1, Generator=1, Job=1),
        "exllamav3.version": types.SimpleNamespace(__version__=A.SUPPORTED_VERSION),
        "exllamav3.modules.block_sparse_mlp": types.SimpleNamespace(BlockSparseMLP=FakeBlockSparseMLP, MAX_BSZN=8),
        "exllamav3.modules.block_sparse_mlp_routing": types.SimpleNamespace(RoutingCFG=FakeRoutingCFG),
        "exllamav3.modules.mla_attn": types.SimpleNamespace(MAX_DECODE_QLEN=16),
        "exllamav3.modules.linear": types.SimpleNamespace(Linear=FakeLinear),
        "exllamav3.modules.quant.exl3": types.SimpleNamespace(LinearEXL3=FakeLinearEXL3),
        "exllamav3.modules.quant.exl3_lib.quantize": types.SimpleNamespace(codebook_mul1_mult=1, codebook_mcg_mult=2),
        "exllamav3.architecture.glm5_next": types.SimpleNamespace(Glm5NextVisionModel=FakeVisionModel),
        "exllamav3.tokenizer": types.SimpleNamespace(MMEmbedding=object),
    }
    mods.update(overrides)

    def importer(name):
        if name not in mods:
            raise ImportError(f"No module named {name!r}")
        return mods[name]

    return importer


def test_contract_passes_on_a_conforming_exllamav3():
    A.check_contract(fake_modules())


def test_contract_refuses_another_version():
    imp = fake_modules(**{"exllamav3.version": types.SimpleNamespace(__version__="1.7.0")})
    with pytest.raises(A.Exl3ContractError, match=r"exllamav3 1\.7\.0 is installed; glm53 supports exllamav3 1\.6\.5"):
        A.check_contract(imp)


def test_contract_names_a_missing_module_attribute_and_method():
    imp = fake_modules(**{"exllamav3.modules.block_sparse_mlp": types.SimpleNamespace(BlockSparseMLP=object,
                                                                                       MAX_BSZN=8)})
    with pytest.raises(A.Exl3ContractError, match=r"BlockSparseMLP\.forward is missing .*1\.6\.5"):
        A.check_contract(imp)
    imp = fake_modules(**{"exllamav3.modules.quant.exl3_lib.quantize": types.SimpleNamespace(codebook_mul1_mult=1)})
    with pytest.raises(A.Exl3ContractError, match=r"codebook_mcg_mult is missing"):
        A.check_contract(imp)


def test_contract_notices_a_changed_seam():
    class Changed(FakeBlockSparseMLP):
        def forward(self):  # the seam call is gone
            return None

    imp = fake_modules(**{"exllamav3.modules.block_sparse_mlp": types.SimpleNamespace(BlockSparseMLP=Changed,
                                                                                       MAX_BSZN=8)})
    with pytest.raises(A.Exl3ContractError, match=r"no longer contains 'self\.cpu_split_submit\('"):
        A.check_contract(imp)


def test_contract_checks_linear_exl3_signature_and_decode_rows():
    class Reordered(FakeLinearEXL3):
        def __init__(self, config, in_features, out_features, scale, su, sv, svh, suh, trellis, mcg, mul1, bias,
                     out_dtype):
            self.bc = ext.BC_LinearEXL3(trellis)  # noqa: F821

    with pytest.raises(A.Exl3ContractError, match="LinearEXL3.__init__ takes"):
        A.check_contract(fake_modules(**{"exllamav3.modules.quant.exl3": types.SimpleNamespace(LinearEXL3=Reordered)}))
    with pytest.raises(A.Exl3ContractError, match="MAX_BSZN is 16"):
        A.check_contract(fake_modules(**{"exllamav3.modules.block_sparse_mlp": types.SimpleNamespace(
            BlockSparseMLP=FakeBlockSparseMLP, MAX_BSZN=16)}))


def test_contract_without_exllamav3():
    def importer(name):
        raise ImportError(f"No module named {name!r}")

    with pytest.raises(A.Exl3ContractError, match="not importable"):
        A.check_contract(importer)


def test_describe_contract_lists_every_hook():
    text = A.describe_contract()
    assert A.SUPPORTED_VERSION in text
    assert text.count("\n") == len(A.CONTRACT)
    assert "cpu_split_submit" in text and "LinearEXL3" in text


def test_staging_needed():
    assert staging_needed(1, 8, 288) == 8
    assert staging_needed(8, 8, 288) == 64
    assert staging_needed(2048, 8, 288) == 288


# ---- the header index -------------------------------------------------------------------------------------------

def _write_safetensors(path, tensors: dict[str, np.ndarray]) -> None:
    names = {np.dtype(np.int16): "I16", np.dtype(np.float16): "F16"}
    header, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
    for name, arr in tensors.items():
        b = arr.tobytes()
        header[name] = {"dtype": names[arr.dtype], "shape": list(arr.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def test_index_reads_raw_bytes_from_every_shard_ignoring_the_index_json(tmp_path):
    rng = np.random.default_rng(1)
    t = rng.integers(-32768, 32767, (4, 8, 48), dtype=np.int16)
    s = rng.standard_normal(64).astype(np.float16)
    _write_safetensors(tmp_path / "model-00001.safetensors", {"a.trellis": t})
    _write_safetensors(tmp_path / "kpool_aux.safetensors", {"a.suh": s})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a.trellis": "x"}}))
    idx = SafetensorsIndex(tmp_path)
    assert "a.suh" in idx and idx.entry("a.trellis").shape == (4, 8, 48) and idx.entry("a.suh").dtype == "F16"
    out = np.zeros(t.nbytes, np.uint8)
    idx.read_into("a.trellis", out)
    assert out.tobytes() == t.tobytes()
    part = np.zeros(10, np.uint8)
    idx.read_into("a.suh", part, start=6, length=10)
    assert part.tobytes() == s.tobytes()[6:16]
    with pytest.raises(KeyError, match="b.svh is in no"):
        idx.entry("b.svh")
    with pytest.raises(ValueError, match="destination"):
        idx.read_into("a.suh", np.zeros(3, np.uint8))
    idx.close()


def test_index_needs_safetensors(tmp_path):
    with pytest.raises(FileNotFoundError):
        SafetensorsIndex(tmp_path)


def test_contract_needs_the_routing_fields_the_lookahead_reads():
    @dataclasses.dataclass
    class Older:
        gate_tensor: object

    imp = fake_modules(**{"exllamav3.modules.block_sparse_mlp_routing": types.SimpleNamespace(RoutingCFG=Older)})
    with pytest.raises(A.Exl3ContractError, match="RoutingCFG has no field 'e_score_correction_bias'"):
        A.check_contract(imp)

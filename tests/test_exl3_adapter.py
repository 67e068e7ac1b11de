"""The exllamav3 adapter's pure parts, on the CPU: the contract check, router-id translation, the header index."""

from __future__ import annotations

import json
import struct
import types

import numpy as np
import pytest

from glm53.engine import exl3_adapter as A

# ---- a fake exllamav3 that satisfies the contract (method bodies carry the calls the contract looks for) --------


class FakeBlockSparseMLP:
    def forward(self):
        self.cpu_split_submit(None)
        self.cpu_split_combine(None)

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


def fake_modules(**overrides):
    mods = {
        "exllamav3": types.SimpleNamespace(Config=1, Model=1, Cache=1, Tokenizer=1, Generator=1, Job=1),
        "exllamav3.version": types.SimpleNamespace(__version__=A.SUPPORTED_VERSION),
        "exllamav3.modules.block_sparse_mlp": types.SimpleNamespace(BlockSparseMLP=FakeBlockSparseMLP, MAX_BSZN=8),
        "exllamav3.modules.linear": types.SimpleNamespace(Linear=FakeLinear),
        "exllamav3.modules.quant.exl3": types.SimpleNamespace(LinearEXL3=FakeLinearEXL3),
        "exllamav3.modules.quant.exl3_lib.quantize": types.SimpleNamespace(codebook_mul1_mult=1, codebook_mcg_mult=2),
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


# ---- translation ------------------------------------------------------------------------------------------------

def test_translate_maps_residents_and_staged():
    slot_of = np.full(16, -1, np.int32)
    slot_of[[3, 7]] = [0, 1]
    ids = np.array([[3, 5, 7, 9], [9, 3, 11, 5]])
    out = A.translate(ids, slot_of, staged=[5, 9, 11], staging_base=2)
    assert out.tolist() == [[0, 2, 1, 3], [3, 0, 4, 2]]
    assert out.dtype == np.int64
    assert ids.tolist() == [[3, 5, 7, 9], [9, 3, 11, 5]]  # the input is not modified


def test_translate_refuses_a_pick_that_would_silently_vanish():
    slot_of = np.full(8, -1, np.int32)
    slot_of[1] = 0
    with pytest.raises(A.Exl3TierError, match=r"experts \[4\] are picked but neither resident nor staged"):
        A.translate(np.array([[1, 4]]), slot_of, staged=[], staging_base=1)
    with pytest.raises(A.Exl3TierError, match="both resident"):
        A.translate(np.array([[1]]), slot_of, staged=[1], staging_base=1)


def test_translate_of_a_fully_staged_prefill_is_monotonic():
    # Prefill stages every picked expert in ascending id order: the id -> slot map preserves order, so exllamav3's
    # sort-by-expert paths group picks exactly as stock does.
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 288, (64, 8))
    uniq = np.unique(ids)
    out = A.translate(ids, np.full(288, -1, np.int32), staged=uniq.tolist(), staging_base=32)
    order_in, order_out = np.argsort(ids.ravel(), kind="stable"), np.argsort(out.ravel(), kind="stable")
    assert np.array_equal(order_in, order_out)


def test_staging_needed():
    assert A.staging_needed(1, 8, 288) == 8
    assert A.staging_needed(8, 8, 288) == 64
    assert A.staging_needed(2048, 8, 288) == 288


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
    idx = A.SafetensorsIndex(tmp_path)
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
        A.SafetensorsIndex(tmp_path)


# ---- the host side of a layer step, on CPU tiers ------------------------------------------------------------------

def _cpu_tiered(num_layers=2, experts=16, slots=(3, 0), staging=16, admit=True):
    import torch

    from glm53.tiers import ExpertTiers, SlotLayout

    layout = SlotLayout.packed([("gate.trellis", torch.int16, (2, 2, 48)), ("gate.suh", torch.float16, (32,))])
    tiers = ExpertTiers(layout, experts, list(slots), num_layers * experts - sum(slots) + 4, device="cpu",
                        staging_slots=staging, pin=False)

    def fill(layer, e, out):  # every expert's image is distinct: byte b of (layer, e) = (layer*31 + e*7 + b) % 251
        out.copy_(torch.arange(out.numel(), dtype=torch.int64).add_(layer * 31 + e * 7).remainder_(251).to(torch.uint8))

    tiers.populate(fill)
    t = A.TieredMoE.__new__(A.TieredMoE)
    t.tiers, t.layout, t.staging_slots, t.admit, t.num_experts = tiers, layout, staging, admit, experts
    t.layers = [A._Layer(module=None, keys=[], slots=s, saved=()) for s in slots]
    t.step_time = {"sync": 0.0, "plan": 0.0, "copy_wait": 0.0}
    return t, fill


def test_resolve_points_every_pick_at_its_own_bytes():
    import torch

    t, fill = _cpu_tiered()
    rng = np.random.default_rng(3)
    want = torch.empty(t.layout.nbytes, dtype=torch.uint8)
    for step in range(200):
        li = step % 2
        rows = 1 if step % 5 else 12  # mostly decode (<= 8 rows), sometimes a prefill chunk
        ids = np.stack([rng.choice(16, 4, replace=False, p=np.r_[np.full(4, 0.15), np.full(12, 0.4 / 12)])
                        for _ in range(rows)])
        decode = rows <= A.MAX_BSZN
        slots = t.resolve(li, ids, decode)
        S = t.layers[li].slots
        for e, s in zip(ids.ravel().tolist(), slots.ravel().tolist(), strict=True):
            got = t.tiers.vram[li].flat(s) if s < S else t.tiers.staging[s - S]
            fill(li, e, want)
            assert torch.equal(got, want), f"step {step}: expert {e} mapped to slot {s} holds other bytes"
        if not decode:  # prefill: every pick staged in ascending id order
            assert (slots >= S).all()
            assert np.array_equal(np.argsort(ids.ravel(), kind="stable"), np.argsort(slots.ravel(), kind="stable"))
        t.tiers.check_invariants()
    snap = t.tiers.stats.snapshot()
    assert snap["admissions"] > 0 and snap["evictions"] > 0 and snap["picks"]["total"] == snap["picks"]["vram_hit"] + \
        snap["picks"]["pcie"]
    assert snap["layers"][1]["hit_rate"] == 0  # no slots in layer 1: every pick crossed PCIe


def test_resolve_refuses_more_misses_than_staging_slots():
    t, _ = _cpu_tiered(slots=(0, 0), staging=4, admit=False)
    with pytest.raises(A.Exl3TierError, match="exceed the 4 staging slots"):
        t.resolve(0, np.array([[0, 1, 2, 3], [4, 5, 6, 7]]), decode=True)

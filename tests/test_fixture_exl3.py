"""The synthetic EXL3 checkpoint: names and shapes exllamav3 reads, configs both readers accept, determinism,
sharding, the index omission, router skew, and the full-width plan. (Loading it in stock exllamav3 is
tests/test_gpu_exl3_fixture.py, on the GPU machine.)"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from glm53 import exl3ref
from glm53.cli import main
from glm53.fixture import exl3 as F
from store.safetensors_header import read_safetensors_header

P = "model.language_model"


def header(path: Path) -> dict:
    """Tensor name -> its header entry (dtype, shape, data_offsets), as the file's JSON has it."""
    return {name: {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [t.begin, t.end]}
            for name, t in read_safetensors_header(path).tensors.items()}


def all_tensors(ck: Path) -> dict[str, tuple[str, dict]]:
    out = {}
    for p in sorted(ck.glob("*.safetensors")):
        for name, h in header(p).items():
            assert name not in out, f"{name} in two files"
            out[name] = (p.name, h)
    return out


def tensor_bytes(ck: Path, fname: str, name: str) -> bytes:
    head = read_safetensors_header(ck / fname)
    t = head.tensors[name]
    with open(ck / fname, "rb") as f:
        f.seek(head.data_start + t.begin)
        return f.read(t.nbytes)


def tensor(ck: Path, name: str) -> np.ndarray:
    fname, h = all_tensors(ck)[name]
    dt = {"I16": "<i2", "F16": "<f2", "F32": "<f4", "I32": "<i4", "BF16": "<u2"}[h["dtype"]]
    arr = np.frombuffer(tensor_bytes(ck, fname, name), dtype=dt).reshape(h["shape"])
    if h["dtype"] == "BF16":
        arr = (arr.astype(np.uint32) << 16).view(np.float32)
    return arr


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return F.write_exl3_checkpoint(tmp_path_factory.mktemp("tiny") / "ck")


def expected_names(layers: int, dense: int, experts: int, mtp: int) -> set[str]:
    """The tensors exllamav3 1.6.5 reads for Glm5Next, written out from architecture/glm5_next.py,
    glm5_next_mtp.py and the modules' load code (independently of the fixture's own plan)."""
    exl3 = ("trellis", "suh", "svh", "mul1")

    def lin(key):
        return {f"{key}.{s}" for s in exl3}

    def mlp(key):
        return lin(f"{key}.gate_proj") | lin(f"{key}.up_proj") | lin(f"{key}.down_proj")

    def mla(a):
        names = lin(f"{a}.q_a_proj") | lin(f"{a}.q_b_proj") | lin(f"{a}.kv_a_proj_with_mqa") | lin(f"{a}.o_proj")
        names |= {f"{a}.q_a_layernorm.weight", f"{a}.kv_a_layernorm.weight", f"{a}.kv_b_proj.weight"}
        ix = f"{a}.indexer"
        names |= lin(f"{ix}.wq_b") | {f"{ix}.wk.weight", f"{ix}.k_norm.weight", f"{ix}.k_norm.bias",
                                      f"{ix}.weights_proj.weight", f"{ix}.index_kpool_compress_ape",
                                      f"{ix}.index_kpool_compress_gate"}
        return names

    def moe(m):
        names = {f"{m}.gate.weight", f"{m}.gate.e_score_correction_bias"} | mlp(f"{m}.shared_experts")
        for e in range(experts):
            names |= mlp(f"{m}.experts.{e}")
        return names

    names = {f"{P}.embed_tokens.weight", f"{P}.norm.weight", "lm_head.weight"}
    for i in range(layers):
        L = f"{P}.layers.{i}"
        names |= {f"{L}.input_layernorm.weight", f"{L}.post_attention_layernorm.weight"}
        for site in ("attn", "ffn"):
            names |= {f"{L}.hc_{site}_fn", f"{L}.hc_{site}_base", f"{L}.hc_{site}_scale"}
        a = f"{L}.self_attn"
        if i % 4 != 3:
            names |= lin(f"{a}.qkv_proj") | lin(f"{a}.o_proj")
            names |= {f"{a}.{k}.weight" for k in ("q_conv1d", "k_conv1d", "v_conv1d", "b_proj", "f_a_proj",
                                                   "f_b_proj", "g_a_proj", "g_b_proj", "o_norm")}
            names |= {f"{a}.A_log", f"{a}.dt_bias"}
        else:
            names |= mla(a)
        names |= mlp(f"{L}.mlp") if i < dense else moe(f"{L}.mlp")
    for m in range(mtp):
        L = f"{P}.layers.{layers + m}"
        names |= {f"{L}.enorm.weight", f"{L}.hnorm.weight", f"{L}.input_layernorm.weight",
                  f"{L}.post_attention_layernorm.weight", f"{L}.shared_head.norm.weight"}
        names |= lin(f"{L}.eh_proj") | mla(f"{L}.self_attn") | moe(f"{L}.mlp")
    return names


def test_every_tensor_exllamav3_reads_and_nothing_else(tiny):
    assert set(all_tensors(tiny)) == expected_names(layers=4, dense=1, experts=16, mtp=1)


def test_shapes_and_dtypes(tiny):
    t = all_tensors(tiny)

    def shape(name):
        return tuple(t[name][1]["shape"]), t[name][1]["dtype"]

    e = f"{P}.layers.1.mlp.experts.5"
    assert shape(f"{e}.gate_proj.trellis") == ((16, 8, 48), "I16")      # (in/16, out/16, 16*K), K=3
    assert shape(f"{e}.down_proj.trellis") == ((8, 16, 48), "I16")
    assert shape(f"{e}.gate_proj.suh") == ((256,), "F16") and shape(f"{e}.gate_proj.svh") == ((128,), "F16")
    assert shape(f"{e}.up_proj.mul1") == ((), "I32")
    assert shape(f"{P}.layers.1.mlp.gate.weight") == ((16, 256), "BF16")
    assert shape(f"{P}.layers.1.mlp.gate.e_score_correction_bias") == ((16,), "F32")
    a = f"{P}.layers.0.self_attn"
    assert shape(f"{a}.qkv_proj.trellis") == ((16, 96, 48), "I16")          # 3 x 4 heads x 128
    assert shape(f"{a}.q_conv1d.weight") == ((512, 1, 4), "BF16")
    assert shape(f"{a}.A_log") == ((4,), "BF16") and shape(f"{a}.dt_bias") == ((512,), "BF16")
    assert shape(f"{a}.o_norm.weight") == ((128,), "BF16")
    assert shape(f"{P}.layers.0.hc_attn_fn") == ((24, 1024), "BF16")
    assert shape(f"{P}.layers.0.hc_attn_scale") == ((3,), "BF16")
    m = f"{P}.layers.3.self_attn"
    assert shape(f"{m}.kv_b_proj.weight") == ((4 * 512, 512), "BF16")
    assert shape(f"{m}.indexer.index_kpool_compress_ape") == ((16, 128), "BF16")
    # every unquantized float tensor is bf16 (fp16 broke the KDA gated norm), the router bias fp32
    floats = {h["dtype"] for n, (_, h) in t.items() if not n.endswith(("trellis", "suh", "svh", "mul1"))}
    assert floats == {"BF16", "F32"}
    assert [n for n, (_, h) in t.items() if h["dtype"] == "F32"] == \
        [n for n in t if n.endswith("e_score_correction_bias")]


def test_exl3_tensors_decode_to_sane_weights(tiny):
    assert int(tensor(tiny, f"{P}.layers.2.mlp.experts.0.gate_proj.mul1").view(np.uint32)) == exl3ref.MUL1_MULT
    lin = exl3ref.read_exl3_linear(tiny, f"{P}.layers.2.mlp.experts.0.gate_proj")
    inner = lin.inner().astype(np.float64)
    assert abs(inner.std() - 1.0) < 0.05 and np.isfinite(inner).all()
    w = lin.weight()
    assert abs(w.std() * np.sqrt(256) - 1.0) < 0.1          # Xavier-like: y keeps the scale of x


def test_configs_load_in_transformers_and_carry_what_exllamav3_reads(tiny):
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(tiny)
    assert type(hf).__name__ == "Glm5NextConfig"
    tc = hf.text_config
    assert tc.layer_types == ["linear_attention"] * 3 + ["indexed_attention"]   # transformers' name for DSA
    assert (tc.linear_num_heads, tc.linear_head_dim, tc.linear_conv_kernel_dim) == (4, 128, 4)
    assert tc.n_routed_experts == 16 and tc.num_experts_per_tok == 4 and tc.mlp_layer_types[0] == "dense"

    cfg = json.loads((tiny / "config.json").read_text())
    t = cfg["text_config"]
    assert cfg["architectures"] == ["Glm5NextForConditionalGeneration"]
    # exllamav3's Glm5NextConfig: required keys and asserted values
    for k in ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim",
              "num_hidden_layers", "layer_types", "linear_attn_config", "index_n_heads", "index_head_dim",
              "index_topk", "index_kpool", "indexer_types", "intermediate_size", "moe_intermediate_size",
              "n_routed_experts", "rms_norm_eps"):
        assert k in t, k
    assert set(t["layer_types"]) <= {"linear_attention", "deepseek_sparse_attention"}
    assert t["layer_types"][3] == "deepseek_sparse_attention" and set(t["indexer_types"]) <= {"full", "shared"}
    assert {"num_heads", "head_dim", "short_conv_kernel_size"} <= set(t["linear_attn_config"])
    assert t["qk_rope_head_dim"] == 0 and t["index_kpool_compress"] is True and t["mhc"] is True
    assert (t["hidden_act"], t["scoring_func"], t["topk_method"], t["norm_topk_prob"]) == \
        ("silu", "sigmoid", "noaux_tc", True)
    assert t["n_group"] == 1 and t["topk_group"] == 1 and t["index_topk"] % t["index_kpool"] == 0
    assert isinstance(cfg["image_start_token_id"], int) and isinstance(cfg["image_end_token_id"], int)
    v = cfg["vision_config"]
    for k in ("depth", "hidden_act", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size",
              "patch_size", "spatial_merge_size", "temporal_patch_size", "model_type", "attention_bias",
              "image_size", "rms_norm_eps"):
        assert k in v, k
    ip = json.loads((tiny / "processor_config.json").read_text())["image_processor"]
    assert ip["image_processor_type"] == "Glm5NextImageProcessor"
    assert {"patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std", "min_image_tokens",
            "max_image_tokens"} <= set(ip)
    # token ids agree with the tokenizer and fit the embedding
    tok = json.loads((tiny / "tokenizer.json").read_text())
    ids = {a["content"]: a["id"] for a in tok["added_tokens"]}
    assert t["eos_token_id"][0] == ids["<|endoftext|>"] and ids["<|user|>"] in t["eos_token_id"]
    assert max(ids.values()) < t["vocab_size"] and t["vocab_size"] % 128 == 0
    assert tensor(tiny, f"{P}.embed_tokens.weight").shape == (t["vocab_size"], 256)


def test_index_matches_disk_without_omission(tiny):
    index = json.loads((tiny / F.INDEX_FILE).read_text())
    assert index["weight_map"] == {n: f for n, (f, _) in all_tensors(tiny).items()}
    assert not (tiny / F.KPOOL_AUX_FILE).exists()


def test_index_omission_and_shards(tmp_path):
    ck = F.write_exl3_checkpoint(tmp_path / "ck", shards=3, omit_from_index=True, layers=8, experts=4, top_k=2,
                                 mtp_layers=1)
    shards = sorted(p.name for p in ck.glob("model-*.safetensors"))
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    aux = set(header(ck / F.KPOOL_AUX_FILE))
    # two k-pool tensors per MLA layer (layers 3 and 7, and the MTP layer 8), as in the published branch (22)
    assert aux == {f"{P}.layers.{i}.self_attn.indexer.index_kpool_compress_{k}" for i in (3, 7, 8)
                   for k in ("ape", "gate")}
    wm = json.loads((ck / F.INDEX_FILE).read_text())["weight_map"]
    on_disk = all_tensors(ck)
    assert set(wm) == set(on_disk) - aux
    assert all(on_disk[n][0] == f for n, f in wm.items())


def test_deterministic_per_seed_and_independent_of_sharding(tmp_path):
    kw = dict(layers=4, experts=4, top_k=2, mtp_layers=0)
    a = F.write_exl3_checkpoint(tmp_path / "a", seed=7, **kw)
    b = F.write_exl3_checkpoint(tmp_path / "b", seed=7, **kw)
    c = F.write_exl3_checkpoint(tmp_path / "c", seed=8, **kw)
    d = F.write_exl3_checkpoint(tmp_path / "d", seed=7, shards=2, **kw)

    def digest(ck):
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(ck.iterdir())}

    assert digest(a) == digest(b)
    assert digest(a)["model-00001-of-00001.safetensors"] != digest(c)["model-00001-of-00001.safetensors"]
    ta, td = all_tensors(a), all_tensors(d)
    for name in (f"{P}.layers.2.mlp.experts.3.down_proj.trellis", f"{P}.embed_tokens.weight", "lm_head.weight"):
        assert tensor_bytes(a, ta[name][0], name) == tensor_bytes(d, td[name][0], name)


def test_chunked_generation_is_deterministic_across_worker_counts(tmp_path, monkeypatch):
    monkeypatch.setattr(F, "_CHUNK_ELEMS", 1 << 12)       # many chunks per tensor, small checkpoint
    kw = dict(layers=1, experts=2, top_k=1, mtp_layers=0, dense_layers=0)
    one = F.write_exl3_checkpoint(tmp_path / "one", workers=1, **kw)
    four = F.write_exl3_checkpoint(tmp_path / "four", workers=4, **kw)
    name = "model-00001-of-00001.safetensors"
    assert (one / name).read_bytes() == (four / name).read_bytes()


def test_router_skew_reaches_the_requested_share(tmp_path):
    experts, k = 64, 8
    ck = F.write_exl3_checkpoint(tmp_path / "ck", layers=3, experts=experts, top_k=k, router_skew=(0.11, 0.40),
                                 mtp_layers=0, seed=3)
    info = json.loads((ck / F.FIXTURE_INFO_FILE).read_text())
    rng = np.random.default_rng(11)
    for layer in (1, 2):
        w = tensor(ck, f"{P}.layers.{layer}.mlp.gate.weight")          # (E, hidden)
        bias = tensor(ck, f"{P}.layers.{layer}.mlp.gate.e_score_correction_bias")
        x = rng.standard_normal((4000, 256))
        x /= np.sqrt((x * x).mean(axis=1, keepdims=True))              # RMS-normalised, as after the norm
        score = 1 / (1 + np.exp(-(x @ w.T))) + bias                    # exllamav3's dots router selection
        picks = np.argpartition(-score, k - 1, axis=1)[:, :k]
        counts = np.bincount(picks.ravel(), minlength=experts)
        n_top = round(0.11 * experts)
        share = np.sort(counts)[::-1][:n_top].sum() / counts.sum()
        assert abs(share - 0.40) < 0.05, (layer, share)
        # the hot experts are the ones the info file ranks first, and they differ between layers
        hot = set(np.argsort(-counts)[:n_top].tolist())
        assert len(hot & set(info["expert_rank_order"][str(layer)][:n_top + 2])) >= n_top - 1
    assert info["expert_rank_order"]["1"] != info["expert_rank_order"]["2"]


def test_router_skew_validation():
    with pytest.raises(ValueError, match="at most"):
        F.calibrate_router_skew(16, 8, 0.1, 0.9)
    with pytest.raises(ValueError, match="already"):
        F.calibrate_router_skew(64, 8, 0.5, 0.2)
    assert F.calibrate_router_skew(288, 8, 0.11, 0.40) > 0


def test_glm53_width_plan_without_writing():
    g = F.glm53_geometry(moe_layers=5)
    plan = F.plan_exl3_checkpoint(g, k_bits=3, router_skew=(0.11, 0.40))
    t = {s.name: s for s in plan.tensors()}
    e = F.expert_tensor_names(3, 287)
    assert all(n in t for n in e)
    trellis = sum(t[n].nbytes for n in e if n.endswith("trellis"))
    scales = sum(t[n].nbytes for n in e if n.endswith(("suh", "svh")))
    assert trellis == 9 * 2**20 and scales == 36 * 2**10                # DESIGN: 3K MiB + 36 KiB at K=3
    assert g.expert_bytes(3) == trellis + scales + 12
    assert t[f"{P}.layers.1.mlp.experts.0.gate_proj.trellis"].shape == (256, 128, 48)
    assert sum(1 for n in t if n.endswith("gate_proj.trellis") and ".experts." in n) == 288 * 6   # 5 + MTP
    assert 18e9 < plan.total_bytes < 21e9
    assert t[f"{P}.embed_tokens.weight"].shape == (154880, 4096)


def test_validation_errors(tmp_path):
    with pytest.raises(ValueError, match="multiple of 128"):
        F.write_exl3_checkpoint(tmp_path / "a", hidden=200)
    with pytest.raises(ValueError, match="moe_layers"):
        F.write_exl3_checkpoint(tmp_path / "b", shape="glm53")
    with pytest.raises(ValueError, match="k_bits"):
        F.write_exl3_checkpoint(tmp_path / "c", k_bits=9)
    with pytest.raises(ValueError, match="unknown shape"):
        F.write_exl3_checkpoint(tmp_path / "d", shape="glm99")
    with pytest.raises(ValueError, match="at most"):
        F.write_exl3_checkpoint(tmp_path / "e", experts=16, top_k=8, router_skew=(0.1, 0.9))
    assert not any(tmp_path.iterdir())          # every bad request fails before anything is written


def test_cli(tmp_path, capsys):
    out = tmp_path / "cli"
    assert main(["fixture", "--kind", "exl3", "--out", str(out), "--layers", "4", "--experts", "8", "--top-k", "2",
                 "--k-bits", "2", "--router-skew", "0.25:0.5", "--omit-index-entries", "--seed", "5"]) == 0
    assert "wrote EXL3 Glm5Next checkpoint" in capsys.readouterr().out
    t = all_tensors(out)
    assert t[f"{P}.layers.1.mlp.experts.7.up_proj.trellis"][1]["shape"] == [16, 8, 32]
    assert (out / F.KPOOL_AUX_FILE).exists()
    assert main(["fixture", "--kind", "hf", "--out", str(tmp_path / "x"), "--shards", "2"]) == 2
    assert "only apply to --kind exl3" in capsys.readouterr().err
    assert main(["fixture", "--kind", "exl3", "--out", str(tmp_path / "y"), "--shape", "glm53"]) == 2
    with pytest.raises(SystemExit):
        main(["fixture", "--kind", "exl3", "--out", str(tmp_path / "z"), "--router-skew", "0.5"])

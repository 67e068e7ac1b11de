"""The tiny HF Glm5Next checkpoint: deterministic, readable by transformers and (config + tensors) by exllamav3."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from glm53.engine import demo
from glm53.fixture.hf import write_hf_checkpoint


def test_same_seed_same_bytes(tmp_path: Path, hf_model_dir: Path) -> None:
    again = write_hf_checkpoint(tmp_path / "again", seed=0)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "generation_config.json"):
        assert (again / name).read_bytes() == (hf_model_dir / name).read_bytes(), name
    other = write_hf_checkpoint(tmp_path / "other", seed=1)
    assert (other / "model.safetensors").read_bytes() != (hf_model_dir / "model.safetensors").read_bytes()


def test_config_speaks_both_dialects(hf_model_dir: Path) -> None:
    text = json.loads((hf_model_dir / "config.json").read_text())["text_config"]
    assert text["layer_types"] == ["linear_attention"] * 3 + ["deepseek_sparse_attention"]
    assert text["linear_attn_config"]["num_heads"] == text["linear_num_heads"]
    assert text["num_nextn_predict_layers"] == 1
    from transformers import AutoConfig

    loaded = AutoConfig.from_pretrained(hf_model_dir).get_text_config()
    assert loaded.layer_types[3] == "indexed_attention"
    assert loaded.linear_num_heads == text["linear_num_heads"]
    proc = json.loads((hf_model_dir / "processor_config.json").read_text())
    assert proc["image_processor"]["image_processor_type"] == "Glm5NextImageProcessor"


def test_saved_names_and_mtp_head(hf_model_dir: Path) -> None:
    with safe_open(str(hf_model_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        dtypes = {f.get_slice(k).get_dtype() for k in names}
    pre = "model.language_model.layers."
    # exllamav3 reads checkpoint names, not transformers' in-memory ones.
    assert f"{pre}1.mlp.experts.7.gate_proj.weight" in names and f"{pre}1.mlp.experts.gate_up_proj" not in names
    assert {f"{pre}0.hc_attn_fn", f"{pre}0.self_attn.A_log", f"{pre}0.self_attn.q_conv1d.weight"} <= names
    assert f"{pre}3.self_attn.indexer.index_kpool_compress_gate" in names
    mtp = {n for n in names if n.startswith(f"{pre}4.")}
    for part in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "self_attn.indexer.wq_b.weight", "mlp.experts.0.down_proj.weight", "mlp.gate.e_score_correction_bias"):
        assert f"{pre}4.{part}" in mtp, part
    assert not any(".hc_" in n for n in mtp)  # the MTP block has no mHC
    assert dtypes == {"BF16"}


EXL3_CHECK = r"""
import sys, types
from unittest.mock import MagicMock
sys.path.insert(0, sys.argv[1])
ext = types.ModuleType("exllamav3.ext"); ext.exllamav3_ext = MagicMock()
sys.modules["exllamav3.ext"] = ext
for name in ("exllamav3_ext", "triton", "triton.language", "flash_attn", "PIL", "PIL.Image", "PIL.ImageOps"):
    sys.modules[name] = MagicMock()
from exllamav3.model.config import Config
from exllamav3.model.model import Model
from exllamav3.loader import safetensors as S
requested = set()
for cls in [c for c in vars(S).values() if isinstance(c, type) and hasattr(c, "get_tensor")]:
    def wrap(self, key, *a, _orig=cls.get_tensor, **k):
        requested.add(key)
        return _orig(self, key, *a, **k)
    cls.get_tensor = wrap
cfg = Config.from_directory(sys.argv[2])
for component in ("text", "mtp", "vision"):
    Model.from_config(cfg, component=component).load(device="cpu")
from safetensors import safe_open
unused = set(safe_open(sys.argv[2] + "/model.safetensors", "pt").keys()) - requested
assert not unused, sorted(unused)[:10]
print("ok", len(requested))
"""


EXLLAMAV3 = "exllamav3==1.6.5"  # the version the adapter pins (pyproject's gpu extra)


@pytest.fixture(scope="session")
def exllamav3_src(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An exllamav3 source tree: GLM53_EXLLAMAV3_SRC, else the pinned release's wheel (pure Python; its CUDA
    extension is a separate package) fetched from the package index and unpacked. Skips only when offline."""
    if os.environ.get("GLM53_EXLLAMAV3_SRC"):
        return os.environ["GLM53_EXLLAMAV3_SRC"]
    import zipfile

    d = tmp_path_factory.mktemp("exllamav3")
    run = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                          "-d", str(d), EXLLAMAV3], capture_output=True, text=True, timeout=300)
    wheels = sorted(d.glob("exllamav3-*.whl"))
    if run.returncode != 0 or not wheels:
        pytest.skip(f"could not fetch {EXLLAMAV3} (offline?): {run.stderr.strip()[-300:]}")
    with zipfile.ZipFile(wheels[0]) as z:
        z.extractall(d / "src")
    return str(d / "src")


def test_exllamav3_reader_loads_every_tensor(hf_model_dir: Path, exllamav3_src: str) -> None:
    """exllamav3's own config reader and module loaders (CUDA extension mocked) find every tensor they need,
    and every tensor in the file is used (text, MTP and vision components)."""
    src = exllamav3_src
    run = subprocess.run([sys.executable, "-c", EXL3_CHECK, src, str(hf_model_dir)], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stderr[-3000:]


def _fake_writer(calls: list):
    def write(out: Path, **params) -> Path:
        calls.append(params)
        out.mkdir(parents=True, exist_ok=True)
        for name in demo.REQUIRED:
            (out / name).write_text("{}")
        return out

    return write


def test_demo_model_is_built_once_and_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import glm53.fixture.hf as hf

    calls: list = []
    monkeypatch.setattr(hf, "write_hf_checkpoint", _fake_writer(calls))
    path = demo.ensure_demo_model(tmp_path)
    assert path == tmp_path / demo.DEMO_DIR and len(calls) == 1
    assert demo.ensure_demo_model(tmp_path) == path and len(calls) == 1  # reused
    assert [p.name for p in tmp_path.iterdir()] == [demo.DEMO_DIR]  # no leftovers
    (path / demo.MARKER).write_text("{}")  # a cache from another recipe (or a torn write) is rebuilt
    assert demo.ensure_demo_model(tmp_path) == path and len(calls) == 2


def test_demo_failure_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import glm53.fixture.hf as hf

    def boom(out: Path, **params) -> Path:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(hf, "write_hf_checkpoint", boom)
    with pytest.raises(OSError):
        demo.ensure_demo_model(tmp_path)
    assert list(tmp_path.iterdir()) == []

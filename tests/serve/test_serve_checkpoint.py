"""What `glm53 serve` makes of a checkpoint before loading it: its identity (the lock), its format (from the
tensors), and whether the CPU reference backend can hold it. Through a subprocess, as a user runs it."""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from glm53 import checkpoint as C
from glm53.fixture.exl3 import write_exl3_checkpoint
from glm53.planning.shape import DEFAULT_SHAPE

ROOT = Path(__file__).resolve().parents[2]


def serve(model: Path, tmp_path: Path, until: str | None = None, timeout: float = 90) -> tuple[int | None, str]:
    """Run `glm53 serve --model`; return (exit status, output), or (None, output so far) once `until` is seen."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GLM53_")}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env.update(GLM53_CACHE_DIR=str(tmp_path / "cache"), GLM53_PORT=str(port))
    p = subprocess.Popen([sys.executable, "-m", "glm53", "serve", "--model", str(model)], cwd=ROOT, env=env,
                         text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines = []
    try:
        for line in p.stdout:
            lines.append(line)
            if until and until in line:
                return None, "".join(lines)
        return p.wait(timeout=timeout), "".join(lines)
    finally:
        if p.poll() is None:
            p.terminate()
            p.wait(timeout=30)


def write_safetensors(path: Path, tensors: dict[str, bytes]) -> None:
    header, offset = {}, 0
    for name, data in tensors.items():
        header[name] = {"dtype": "U8", "shape": [len(data)], "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(tensors.values()))


def real_shaped(tmp_path: Path, files: bool) -> Path:
    """A directory whose config.json has GLM-5.3-Flash's shape (so the shipped lock applies)."""
    d = tmp_path / "claims-real"
    d.mkdir()
    config = {"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next",
              "quantization_config": {"quant_method": "exl3", "bits": 3.05},
              "text_config": {"num_hidden_layers": DEFAULT_SHAPE.layers, "hidden_size": DEFAULT_SHAPE.hidden,
                              "n_routed_experts": DEFAULT_SHAPE.experts_per_layer, "num_experts_per_tok": 8}}
    (d / "config.json").write_text(json.dumps(config))
    if files:
        write_safetensors(d / "model-00001.safetensors", {"model.embed.weight": b"\0" * 64})
        write_safetensors(d / "kpool_aux.safetensors", {"model.layers.3.indexer.k_pool": b"\0" * 64})
        (d / C.INDEX).write_text(json.dumps({"metadata": {}, "weight_map": {
            "model.embed.weight": "model-00001.safetensors",
            "model.layers.3.indexer.k_pool": "kpool_aux.safetensors"}}))
    return d


def test_a_generated_checkpoint_is_reported_unknown(hf_model_dir, tmp_path):
    _, out = serve(hf_model_dir, tmp_path, until="checkpoint identity")
    line = next(x for x in out.splitlines() if "checkpoint identity" in x)
    assert "unknown" in line and "no lock applies" in line and "verified" not in line.replace("nothing was verified", "")


def test_a_checkpoint_claiming_to_be_the_real_one_but_not_the_pinned_one_is_refused(tmp_path):
    rc, out = serve(real_shaped(tmp_path, files=False), tmp_path)
    lock = C.load_lock(C.DEFAULT_LOCK)
    assert rc == 2, out
    assert f"is not the pinned {lock.pinned}" in out and "kpool_aux.safetensors: missing" in out
    assert "glm53 model fetch --out" in out and "glm53 model verify" in out


def test_the_shipped_lock_can_only_say_not_verified(tmp_path):
    # Every file the shipped lock names is there; it knows no size or hash, so nothing may be called verified.
    d = real_shaped(tmp_path, files=True)
    rc, out = serve(d, tmp_path)
    assert rc == 2 and "needs exllamav3" in out  # no GPU stack here: refused after the identity check
    ident = [x for x in out.splitlines() if "checkpoint identity" in x]
    assert any("NOT VERIFIED" in x and "only their presence was checked" in x for x in ident), out
    assert not any(" verified against" in x or "identity: verified" in x for x in ident)


def test_the_quick_check_finds_a_wrong_size_and_hashes_only_small_files(tmp_path):
    d = real_shaped(tmp_path, files=True)
    big = d / "model-00001.safetensors"
    lock_path = tmp_path / "t.lock.json"
    lock_path.write_text(json.dumps(C.make_lock(d, "o/r", "rev", progress=False)))
    lock = C.load_lock(lock_path)
    r = C.quick_check(d, lock)
    assert not r.problems and set(r.hashed) == set(lock.files)  # all small here: all hashed
    data = json.loads(lock_path.read_text())
    data["files"][big.name]["size"] += 1
    lock_path.write_text(json.dumps(data))
    r = C.quick_check(d, C.load_lock(lock_path))
    assert any(big.name in p and "the lock says" in p for p in r.problems)
    assert C.lock_for(d, json.loads((d / "config.json").read_text()), locks=tmp_path) is not None
    generated = {"text_config": {"num_hidden_layers": 4, "hidden_size": 256, "n_routed_experts": 16}}
    assert not C.claims_pinned(generated) and C.lock_for(d, generated, locks=tmp_path / "none") is None


def test_trellis_tensors_make_it_exl3_whatever_config_json_says(tmp_path):
    d = write_exl3_checkpoint(tmp_path / "exl3", seed=0, layers=2, experts=4)
    config = json.loads((d / "config.json").read_text())
    config.pop("quantization_config")
    (d / "config.json").write_text(json.dumps(config))
    rc, out = serve(d, tmp_path)
    assert rc == 2, out
    assert "is an EXL3 checkpoint" in out and "CPU reference backend" not in out.split("Also:")[0]
    assert ".trellis" in out and "no quantization_config" in out


def test_the_cpu_reference_backend_refuses_a_checkpoint_too_large_for_it(hf_model_dir, tmp_path):
    d = tmp_path / "big"
    shutil.copytree(hf_model_dir, d)
    n = 1 << 41  # 2 TiB of bf16, as a sparse file: no disk used
    raw = json.dumps({"huge.weight": {"dtype": "BF16", "shape": [n // 2], "data_offsets": [0, n]}}).encode()
    with open(d / "huge.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + n)
    rc, out = serve(d, tmp_path)
    assert rc == 2, out
    assert "2048.0 GiB of bf16 weights" in out and "needs about 4096.0 GiB of RAM" in out and "available" in out
    assert "reference engine: loading" not in out


@pytest.mark.parametrize("quant", [{"quant_method": "exl3"}, None])
def test_format_from_config_and_tensors(quant):
    from glm53.serve.choice import checkpoint_format

    config = {"architectures": ["Glm5NextForCausalLM"], **({"quantization_config": quant} if quant else {})}
    fmt, notes = checkpoint_format(config, ["model.layers.1.mlp.experts.0.up_proj.trellis"])
    assert fmt == "exl3" and bool(notes) == (quant is None)
    assert checkpoint_format(config, ["model.embed_tokens.weight"])[0] == ("exl3" if quant else "hf")

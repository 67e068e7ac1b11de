"""Bad files at start-up (issue 41's probe): each one is a clear one-line refusal naming the problem and the fix,
exit status 2, at once; never a traceback, and never a hang (a FIFO blocks open() until a writer comes, so nothing
is opened before it is known to be a regular file). Each case runs the real command in a subprocess."""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from store import format as F

ROOT = Path(__file__).resolve().parents[2]
HUNG_S = 20  # a refusal comes in about a second (the interpreter's start); this long means it hung


def run(args: list[str], env: dict[str, str], tmp_path: Path) -> tuple[int, str, str, float]:
    """`python -m glm53 ARGS` with only these GLM53_* settings: (status, stdout, stderr, seconds)."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("GLM53_")}
    full.update({"GLM53_CACHE_DIR": str(tmp_path / "cache"), "GLM53_PORT": str(free_port()), **env,
                 "PYTHONPATH": str(ROOT)})  # this tree's glm53, whatever is installed; cwd: no .env of ours
    started = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "glm53", *args], cwd=tmp_path, env=full, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = p.communicate(timeout=HUNG_S)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        pytest.fail(f"glm53 {' '.join(args)} hung for {HUNG_S} s:\n{out}\n{err}")
    return p.returncode, out, err, time.perf_counter() - started


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def refused(rc: int, out: str, err: str, seconds: float, *needles: str) -> str:
    """Exit 2 at once, one line (naming every needle), no traceback."""
    lines = [x for x in (out + err).splitlines() if x.strip()]
    assert rc == 2, (rc, out, err)
    assert "Traceback" not in out + err, out + err
    assert len(lines) == 1, lines
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert seconds < 5, seconds
    return lines[0]


@pytest.fixture
def model(hf_model_dir, tmp_path) -> Path:
    """A copy of the tiny HF checkpoint to damage."""
    return Path(shutil.copytree(hf_model_dir, tmp_path / "model"))


def serve(model: Path, tmp_path: Path, **env: str) -> tuple[int, str, str, float]:
    return run(["serve"], {"GLM53_MODEL_DIR": str(model), **env}, tmp_path)


def edit_config(model: Path, change) -> None:
    path = model / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps(change(config)))


# ------------------------------------------------------------------------------------------------ config.json


@pytest.mark.parametrize("text,kind", [("[]", "a JSON array"), ("null", "null"), ('"glm"', "a JSON string"),
                                       ("{oops", "not valid JSON")])
def test_config_that_is_not_an_object(model, tmp_path, text, kind):
    (model / "config.json").write_text(text)
    refused(*serve(model, tmp_path), f"{model}/config.json", kind, "fix:")


@pytest.mark.parametrize("value", [5, "x", [1, 2]])
def test_text_config_that_is_not_an_object(model, tmp_path, value):
    edit_config(model, lambda c: {**c, "text_config": value})
    refused(*serve(model, tmp_path), "text_config", "not a JSON object", "fix:")


@pytest.mark.parametrize("value", ["lots", -4, 1.5, True])
def test_max_position_embeddings_that_is_not_a_positive_integer(model, tmp_path, value):
    edit_config(model, lambda c: {**c, "text_config": {**c["text_config"], "max_position_embeddings": value}})
    refused(*serve(model, tmp_path), "max_position_embeddings", json.dumps(value), "positive integer", "fix:")


def test_config_that_is_a_fifo(model, tmp_path):
    (model / "config.json").unlink()
    os.mkfifo(model / "config.json")
    refused(*serve(model, tmp_path), f"{model}/config.json", "FIFO", "not a regular file")
    rc, out, err, _ = run(["preflight"], {"GLM53_MODEL_DIR": str(model)}, tmp_path)
    assert rc == 2 and "FIFO" in err and "Traceback" not in out + err, (out, err)


# ------------------------------------------------------------------------------------------------ weights


def test_weights_that_are_a_directory(model, tmp_path):
    (model / "model.safetensors").unlink()
    (model / "model.safetensors").mkdir()
    refused(*serve(model, tmp_path), f"{model}/model.safetensors", "a directory", "glm53 model verify")


def test_weights_that_are_a_fifo(model, tmp_path):
    (model / "model.safetensors").unlink()
    os.mkfifo(model / "model.safetensors")
    refused(*serve(model, tmp_path), f"{model}/model.safetensors", "FIFO", "glm53 model verify")


# ------------------------------------------------------------------------------------------------ the load


def test_a_failed_load_ends_the_server_with_the_reason(model, tmp_path):
    """Not /health 200 forever with the error in an old log line: the process exits 2, the reason last, so a
    container stops with it (and its restart policy decides what follows)."""
    (model / "tokenizer.json").write_text("{}")
    rc, out, err, seconds = serve(model, tmp_path)
    last = [x for x in err.splitlines() if x.strip()][-1]
    assert rc == 2 and seconds < HUNG_S, (rc, err)
    assert last.startswith("glm53: the model could not be loaded: ") and "fix that and start again" in last, last
    assert "glm53 ready" not in err


# ------------------------------------------------------------------------------------------------ the cache


def test_cache_dir_that_is_a_file(tmp_path):
    cache = tmp_path / "cache-file"
    cache.write_text("not a directory\n")
    refused(*run(["serve"], {"GLM53_CACHE_DIR": str(cache)}, tmp_path), f"GLM53_CACHE_DIR={cache}", "a file",
            "directory")
    assert cache.read_text() == "not a directory\n"


# ------------------------------------------------------------------------------------------------ the store


def fake_store(path: Path, *, id_len: int = 2, count: int = 0) -> Path:
    """A superblock whose regions say what they like, the file as long as the header claims (the checks before the
    sha256 check are what is tried here)."""
    table = F.SUPERBLOCK_SIZE + id_len
    data = table + F.ENTRY_SIZE * count
    body = b"{}" + b"\0" * 4096
    size = F.SUPERBLOCK_SIZE + len(body)
    sb = struct.pack("<8sIIII QQ QQ QQ 32s 24s", F.MAGIC, F.VERSION, F.SUPERBLOCK_SIZE, F.ALIGN, F.ENTRY_SIZE,
                     F.SUPERBLOCK_SIZE, id_len, table, count, data, size, b"\0" * 32, b"\0" * 24)
    path.write_bytes(sb + body)
    return path


@pytest.mark.parametrize("field,value", [("id_len", 2**62), ("count", 2**56), ("count", 10**6)])
def test_a_store_header_with_a_huge_region_is_refused(model, tmp_path, field, value):
    """An identity length or record count beyond the file (MemoryError, OverflowError, IndexError before)."""
    store = fake_store(tmp_path / "experts.glm53", **{field: value})
    rc, out, err, seconds = run(["verify-store", str(store)], {}, tmp_path)
    text = out + err
    assert rc == 1 and "Traceback" not in text and seconds < 5, text  # 1: unsound, verify-store's own status
    assert "the superblock is inconsistent" in text and "beyond the end of the file" in text, text
    assert "fix: repack it: glm53 pack-store" in text
    rc, out, err, _ = run(["preflight"], {"GLM53_MODEL_DIR": str(model), "GLM53_STORE": str(store)}, tmp_path)
    assert rc == 2 and "Traceback" not in out + err, (out, err)
    assert "glm53: preflight: store:" in err and "beyond the end of the file" in err, err


def test_a_store_that_is_a_fifo(model, tmp_path):
    fifo = tmp_path / "experts.glm53"
    os.mkfifo(fifo)
    rc, out, err, seconds = run(["verify-store", str(fifo)], {}, tmp_path)
    assert rc == 1 and seconds < 5 and "Traceback" not in out + err, (out, err)
    assert "is a FIFO (named pipe), not a store file: nothing was checked" in err and "does not exist" not in err
    rc, out, err, _ = run(["preflight"], {"GLM53_MODEL_DIR": str(model), "GLM53_STORE": str(fifo)}, tmp_path)
    assert rc == 2 and "Traceback" not in out + err, (out, err)
    assert "FIFO" in err and "not found" not in err, err

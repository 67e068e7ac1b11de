"""`glm53 serve` / `glm53 bench stream`: engine choice, bind safety, and a real start-up in a subprocess."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from glm53.cli import build_parser
from glm53.planning import settings as S
from glm53.serve import choice as engines
from glm53.serve import cli as serve_cli
from glm53.serve.choice import EngineChoiceError, choose_engine

ROOT = Path(__file__).resolve().parents[2]


def settings(**env: str):
    return S.load(environ={f"GLM53_{k.upper()}": str(v) for k, v in env.items()}, dotenv=None)


@pytest.mark.parametrize("host,env,refused", [
    ("127.0.0.1", {}, False),
    ("localhost", {}, False),
    ("::1", {}, False),
    ("0.0.0.0", {}, True),
    ("192.168.1.5", {}, True),
    ("0.0.0.0", {"api_key": "k"}, False),
    ("0.0.0.0", {"allow_no_api_key": "1"}, False),
])
def test_bind_refusal(host, env, refused):
    reason = serve_cli.bind_refusal(settings(host=host, **env))
    assert (reason is not None) == refused
    if refused:
        assert "GLM53_API_KEY" in reason and "GLM53_ALLOW_NO_API_KEY=1" in reason


def test_commands_are_registered():
    parser = build_parser()
    args = parser.parse_args(["serve", "--model", "/m", "--host", "127.0.0.1", "--port", "8001"])
    assert args.func is serve_cli.cmd_serve and (args.model, args.port) == ("/m", 8001)
    from glm53.bench import cli as bench_cli

    args = parser.parse_args(["bench", "stream", "--tokens", "64"])
    assert args.func is bench_cli.cmd_bench_stream and args.tokens == 64


def _config_dir(tmp_path: Path, config: dict) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_exl3_checkpoint_without_exllamav3_is_refused(tmp_path, monkeypatch):
    d = _config_dir(tmp_path, {"architectures": ["Glm5NextForConditionalGeneration"],
                               "quantization_config": {"quant_method": "exl3", "bits": 4}})
    monkeypatch.setattr(engines, "exllamav3_available", lambda: False)
    with pytest.raises(EngineChoiceError, match="exllamav3"):
        choose_engine(settings(model_dir=str(d)))
    from glm53.exl3 import contract

    monkeypatch.setattr(engines, "exllamav3_available", lambda: True)
    monkeypatch.setattr(contract, "gpu_available", lambda: False)
    with pytest.raises(EngineChoiceError, match="needs a CUDA GPU"):
        choose_engine(settings(model_dir=str(d)))


def test_bad_model_dirs_are_refused(tmp_path):
    with pytest.raises(EngineChoiceError, match="not a directory"):
        choose_engine(settings(model_dir=str(tmp_path / "missing")))
    with pytest.raises(EngineChoiceError, match="no config.json"):
        choose_engine(settings(model_dir=str(tmp_path)))
    d = _config_dir(tmp_path / "llama", {"architectures": ["LlamaForCausalLM"]})
    with pytest.raises(EngineChoiceError, match="neither"):
        choose_engine(settings(model_dir=str(d)))


def test_hf_checkpoint_and_demo_use_the_reference_engine(hf_model_dir, monkeypatch, tmp_path):
    choice = choose_engine(settings(model_dir=str(hf_model_dir), context="131072", max_concurrency="3"))
    assert choice.engine.kind == "reference-cpu" and not choice.demo
    assert choice.engine.context_length == 4096  # clamped to the checkpoint's window
    assert choice.engine.max_running == 3 and not choice.engine.ready  # the app loads it
    import glm53.serve.demo as demo

    monkeypatch.setattr(demo, "ensure_demo_model", lambda cache_dir: hf_model_dir)
    choice = choose_engine(settings(cache_dir=str(tmp_path), context="1024"))
    assert choice.demo and choice.engine.context_length == 1024
    assert "random-weight demo model" in choice.banner[0] and "GLM53_MODEL_DIR=" in choice.banner[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(args: list[str], env: dict[str, str], **kw) -> subprocess.Popen:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("GLM53_")}
    full_env.update(env)
    return subprocess.Popen([sys.executable, "-m", "glm53", *args], cwd=ROOT, env=full_env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kw)


def test_serve_refuses_open_bind_and_exl3(tmp_path):
    p = _run(["serve", "--host", "0.0.0.0"], {"GLM53_CACHE_DIR": str(tmp_path)})
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 2 and "refusing to listen on 0.0.0.0" in out
    d = _config_dir(tmp_path / "exl3", {"quantization_config": {"quant_method": "exl3"}})
    p = _run(["serve", "--model", str(d)], {})
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 2 and "EXL3 checkpoint" in out


def test_serve_end_to_end(hf_model_dir, tmp_path):
    port = _free_port()
    p = _run(["serve", "--model", str(hf_model_dir), "--port", str(port)], {"GLM53_CACHE_DIR": str(tmp_path)})
    lines: list[str] = []
    try:
        deadline = time.time() + 90
        while time.time() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            lines.append(line.rstrip())
            if "glm53 ready" in line:
                break
        log = "\n".join(lines)
        assert "glm53 ready" in log, log
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        assert c.models.list().data[0].id == "glm-5.3-flash"
        # Greedy: the random-weight model's reply is then the same every run (sampled, it could end at once).
        r = c.chat.completions.create(model="glm-5.3-flash", messages=[{"role": "user", "content": "hi"}],
                                      max_tokens=200, temperature=0)
        assert r.choices[0].message.content or r.choices[0].message.reasoning_content, r
        assert httpx.get(f"http://127.0.0.1:{port}/ready").status_code == 200
    finally:
        p.terminate()
        p.wait(timeout=30)
    order = [next(i for i, x in enumerate(lines) if phrase in x) for phrase in (
        "Loading safetensors checkpoint shards: 0% Completed | 0/1",
        "Loading safetensors checkpoint shards: 100% Completed | 1/1",
        "Loading weights took",
        "Application startup complete",
        "glm53 ready")]
    assert order == sorted(order), log
    # uvicorn's own (premature) startup line is replaced by the one logged after loading.
    assert sum("Application startup complete" in x for x in lines) == 1


def test_the_kernel_cache_goes_into_the_cache_dir_unless_the_user_chose_one(tmp_path):
    env: dict = {}
    got = serve_cli.keep_kernel_cache(settings(cache_dir=tmp_path), env)
    assert got == env["TRITON_CACHE_DIR"] == str(tmp_path / "triton")
    env = {"TRITON_CACHE_DIR": "/elsewhere"}
    assert serve_cli.keep_kernel_cache(settings(cache_dir=tmp_path), env) == "/elsewhere"

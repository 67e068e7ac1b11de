"""Images through the exllamav3 engine on the CPU: a real HTTP server, real PNG/JPEG bytes, the engine in exact mode
(tiered experts) over a generated EXL3 checkpoint with a vision tower, against the fake exllamav3
(tests/support/fake_exllamav3.py: its vision component, jobs taking embeddings, the page cache hashing token ids).
The image's embeddings reach the model (they change the answer), a resent image keeps its cached prefix and another
image does not, bad images and a checkpoint without the tower are refused in each API's shape."""

from __future__ import annotations

import base64
import importlib.util
import zipfile
from pathlib import Path

import fake_exllamav3 as F
import httpx
import numpy as np
import pytest
from server_support import loaded_and_served
from specs import spec_for
from test_images import chat, chat_image, data_url, error_of, picture

from glm53.engine import vision
from glm53.fixture.exl3 import write_exl3_checkpoint

SLOTS = 3  # VRAM slots per MoE layer (of 16): most picks cross the tiers
WHEEL = Path("/work/shared/device/wheels/exllamav3-1.6.5-py3-none-any.whl")


@pytest.fixture(scope="module", autouse=True)
def fake_exllamav3():
    with F.installed(prompt_cache=True) as mods:
        yield mods


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    return write_exl3_checkpoint(tmp_path_factory.mktemp("exl3-vision") / "ck", vision=True)


def engine_on(ck):
    from glm53.engine.exl3_engine import Exl3Engine

    return Exl3Engine(ck, spec_for(ck, "exact", SLOTS))


@pytest.fixture(scope="module")
def server(ck):
    with loaded_and_served(engine_on(ck)) as srv:
        yield srv


def spec(srv) -> vision.VisionSpec:
    return srv.engine.vision


def encoded(srv) -> int:
    return srv.engine.stats()["vision"]["images_encoded"]


def first_logprobs(srv, png: bytes) -> list:
    r = chat(srv, chat_image(data_url(png)), max_tokens=1, logprobs=True, top_logprobs=5)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]


def test_the_image_reaches_the_model_and_changes_the_answer(server):
    """Same text, same token count, another picture: another first-token distribution; the same picture again: the
    same one, its embedding kept (the tower does not run again)."""
    a, b = picture(56, 56, seed=1), picture(56, 56, seed=2)
    first = first_logprobs(server, a)
    n = encoded(server)
    assert first_logprobs(server, a) == first and encoded(server) == n
    assert first_logprobs(server, b) != first and encoded(server) == n + 1


def test_chat_usage_counts_the_image_tokens_exllamav3_made(server):
    """The engine refuses an image whose embedding count differs from the prompt's layout, so a 200 with usage
    equal to image_tokens() is exllamav3's count agreeing with glm53.engine.vision's, for each size."""
    for w, h in ((64, 48), (300, 120), (1280, 800)):
        r = chat(server, chat_image(data_url(picture(w, h, seed=w))))
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens_details"]["image_tokens"] == vision.image_tokens(h, w, spec(server))


def test_anthropic_image_block(server):
    png = picture(60, 40, seed=4)
    messages = [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png).decode()}},
        {"type": "text", "text": "What is this?"}]}]
    r = httpx.post(server.url + "/v1/messages", timeout=300, json={
        "model": "claude-sonnet", "max_tokens": 4, "messages": messages, "thinking": {"type": "disabled"}})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens_details"]["image_tokens_per_image"] == [
        vision.image_tokens(40, 60, spec(server))]


def test_responses_input_image(server):
    png = picture(30, 90, seed=6, fmt="JPEG")
    content = [{"type": "input_text", "text": "Describe"},
               {"type": "input_image", "image_url": data_url(png, "image/jpeg")}]
    r = httpx.post(server.url + "/v1/responses", timeout=300, json={
        "input": [{"role": "user", "content": content}], "max_output_tokens": 4, "reasoning": {"effort": "none"}})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens_details"]["image_tokens"] == vision.image_tokens(90, 30, spec(server))


def test_a_resent_image_keeps_its_cached_prefix_and_another_image_does_not(server):
    """Turn two resends turn one's image (256 tokens: the prompt spans pages): the page cache serves the prefix
    and the tower does not run again. The same turn with another picture there (the same tokens to the server,
    other placeholder ids to exllamav3) reuses nothing."""
    a, b = picture(448, 448, seed=7), picture(448, 448, seed=8)
    first = chat(server, chat_image(data_url(a)))
    assert first.status_code == 200, first.text
    reply = first.json()["choices"][0]["message"]["content"]

    def second_turn(png: bytes) -> httpx.Response:
        return chat(server, [*chat_image(data_url(png)), {"role": "assistant", "content": reply},
                             {"role": "user", "content": "And now?"}])

    n = encoded(server)
    again = second_turn(a)
    assert again.status_code == 200, again.text
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= F.PAGE_SIZE
    assert encoded(server) == n
    other = second_turn(b)
    assert other.status_code == 200, other.text
    assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert encoded(server) == n + 1


def test_a_bad_image_is_400(server):
    e = error_of(chat(server, chat_image(data_url(b"\x89PNG\r\n\x1a\n not really a png"))), 400)
    assert e["code"] == "invalid_image" and e["param"] == "messages.0.content.1", e


def test_a_checkpoint_without_the_tower_refuses_images_naming_the_fix(tmp_path):
    ck = write_exl3_checkpoint(tmp_path / "text-only")
    with loaded_and_served(engine_on(ck)) as srv:
        e = error_of(chat(srv, chat_image(data_url(picture(16, 16)))), 400)
        assert e["code"] == "images_unsupported" and "vision tower" in e["message"], e
        assert "serve a checkpoint that includes the vision tower" in e["message"]
        block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": base64.b64encode(picture(16, 16)).decode()}}
        r = httpx.post(srv.url + "/v1/messages", timeout=300, json={
            "model": "x", "max_tokens": 4, "messages": [{"role": "user", "content": [block]}]})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
        assert chat(srv, [{"role": "user", "content": "hi"}]).status_code == 200
        assert srv.engine.stats()["vision"] == {"available": False}


def test_a_tower_that_fails_to_load_leaves_text_serving_and_refuses_images(ck, monkeypatch, caplog):
    def broken(self, *args, **kwargs):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(F.Glm5NextVisionModel, "load", broken)
    with loaded_and_served(engine_on(ck)) as srv:
        e = error_of(chat(srv, chat_image(data_url(picture(16, 16)))), 400)
        assert e["code"] == "images_unsupported" and "failed to load" in e["message"], e
        assert "no kernel image" in e["message"]
        assert chat(srv, [{"role": "user", "content": "hi"}]).status_code == 200
    assert any("vision tower did not load" in r.getMessage() for r in caplog.records)


def test_images_off_leaves_the_tower_unloaded_and_refuses_images(ck):
    from dataclasses import replace

    from glm53.engine.exl3_engine import Exl3Engine

    with loaded_and_served(Exl3Engine(ck, replace(spec_for(ck, "exact", SLOTS), vision=False))) as srv:
        e = error_of(chat(srv, chat_image(data_url(picture(16, 16)))), 400)
        assert e["code"] == "images_unsupported" and "GLM53_MAX_IMAGES=0" in e["message"], e
        assert srv.engine.runtime.vision is None
        assert chat(srv, [{"role": "user", "content": "hi"}]).status_code == 200


def test_an_embedding_count_unlike_the_layout_fails_the_request_naming_both():
    from glm53.exl3.vision import VisionTower

    class Tower:
        def get_image_embeddings(self, tokenizer, image):
            return type("E", (), {"mm_length": 5, "token_list": [1] + [10**9] * 5 + [2]})()

    im = vision.PromptImage("d" * 64, 1, 6, None, (1, 4, 6), image=object())
    with pytest.raises(ValueError, match="made 5 embeddings for an image laid out as 6 tokens"):
        VisionTower(Tower(), None, 4).prompt([7] * 8, [im])


def _exllamav3_canvas():
    """exllamav3 1.6.5's own glm5_vision_canvas (a pure function), read from the wheel the GPU machine installs."""
    if not WHEEL.exists():
        pytest.skip(f"{WHEEL} is not here")
    with zipfile.ZipFile(WHEEL) as z:
        src = z.read("exllamav3/architecture/mm_processing/glm5_next.py").decode()
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("exl3_glm5_canvas", loader=None))
    exec(compile(src, "glm5_next.py", "exec"), module.__dict__)  # noqa: S102 - the pinned wheel's source
    return module.glm5_vision_canvas


@pytest.mark.parametrize("size", [(1, 1), (7, 5), (40, 30), (90, 200), (800, 1280), (1080, 1920), (2160, 3840),
                                  (10, 4000), (4000, 12), (1500, 1000)])
def test_image_tokens_follow_exllamav3s_canvas(size):
    """glm53.engine.vision's canvas (the server's token count) is exllamav3's, for images of every shape."""
    canvas = _exllamav3_canvas()
    s = vision.VisionSpec(14, 2, 2, (0.5,) * 3, (0.5,) * 3, 16, 8000, 1, 2, 3)
    h, w = size
    assert vision.canvas(h, w, s) == canvas(s.temporal_patch_size, h, w, s.temporal_patch_size, s.factor,
                                            s.min_image_tokens, s.max_image_tokens)


def test_two_images_at_once_each_answer_as_alone(server):
    """Two requests with different images decoded together: each sees its own image, as when it ran alone."""
    import threading

    a, b = picture(56, 84, seed=21), picture(84, 56, seed=22)
    alone = [first_logprobs(server, a), first_logprobs(server, b)]
    got: dict[int, list] = {}

    def ask(i: int, png: bytes) -> None:
        r = chat(server, chat_image(data_url(png)), max_tokens=6, logprobs=True, top_logprobs=5)
        assert r.status_code == 200, r.text
        got[i] = r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]

    threads = [threading.Thread(target=ask, args=(i, png)) for i, png in enumerate((a, b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    # The same tokens, their logprobs within float rounding (the CPU's batched matmul sums in another order).
    for i in range(2):
        assert [x["token"] for x in got[i]] == [x["token"] for x in alone[i]]
        assert np.allclose([x["logprob"] for x in got[i]], [x["logprob"] for x in alone[i]], atol=1e-5)
    assert [x["token"] for x in alone[0]] != [x["token"] for x in alone[1]]

"""Images on every route, end to end: real PNG/JPEG bytes (Pillow) through a real HTTP server into the CPU reference
engine, whose generated checkpoint carries a random-weight vision tower; the refusals in each API's error shape."""

from __future__ import annotations

import base64
import http.server
import io
import json
import threading

import httpx
import numpy as np
import pytest
from PIL import Image
from server_support import ServerThread, server_settings

from glm53.engine import vision
from glm53.server import create_app

OFF = {"chat_template_kwargs": {"enable_thinking": False}}


def picture(width: int, height: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def chat_image(url: str, text: str = "What is in the picture?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


def chat(srv, messages: list[dict], **body) -> httpx.Response:
    return httpx.post(srv.url + "/v1/chat/completions", timeout=300,
                      json={"messages": messages, "max_tokens": 4, "temperature": 0, **OFF, **body})


@pytest.fixture(scope="module")
def server(reference_engine):
    with ServerThread(create_app(reference_engine, server_settings())) as srv:
        srv.engine = reference_engine
        yield srv


@pytest.fixture(scope="module")
def strict(reference_engine):
    """The same engine behind tight image limits: one image per request, about 10 KiB each."""
    settings = server_settings(max_images=1, max_image_mb=0.01)
    with ServerThread(create_app(reference_engine, settings)) as srv:
        srv.engine = reference_engine
        yield srv


def spec(srv) -> vision.VisionSpec:
    return srv.engine.vision


# -- the canvas -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [(40, 30), (90, 200), (1500, 1000), (7, 5)])
def test_pixels_match_the_checkpoints_image_processor(hf_model_dir, size):
    """The tower's input is what transformers' Glm5Next image processor makes of the same image, to the bit."""
    from transformers.models.glm5_next.image_processing_pil_glm5_next import Glm5NextImageProcessorPil

    ip = json.loads((hf_model_dir / "processor_config.json").read_text())["image_processor"]
    proc = Glm5NextImageProcessorPil(**{k: v for k, v in ip.items() if k != "image_processor_type"})
    img = Image.open(io.BytesIO(picture(*size, seed=3)))
    s = vision.read_vision_spec(hf_model_dir)
    px, grid = vision.pixels(img, s)
    ref = proc(images=[img])
    assert [list(grid)] == ref["image_grid_thw"].tolist()
    np.testing.assert_array_equal(px, np.asarray(ref["pixel_values"]))
    assert vision.image_tokens(size[1], size[0], s) == grid[1] * grid[2] // 4


# -- the three APIs ---------------------------------------------------------------------------------------------


def test_chat_reads_an_image_and_usage_counts_its_tokens(server):
    png = picture(64, 48)
    r = chat(server, chat_image(data_url(png)))
    assert r.status_code == 200, r.text
    details = r.json()["usage"]["prompt_tokens_details"]
    expected = vision.image_tokens(48, 64, spec(server))
    assert details["image_tokens"] == expected and details["image_tokens_per_image"] == [expected]
    counted = httpx.post(server.url + "/tokenize", json={"messages": chat_image(data_url(png)), **OFF}).json()
    assert counted["count"] == r.json()["usage"]["prompt_tokens"]
    assert counted["tokens"].count(spec(server).image_token_id) == expected
    assert counted["image_tokens_per_image"] == [expected]
    text_only = httpx.post(server.url + "/tokenize", json={"messages": chat_image(data_url(png))[:0] + [
        {"role": "user", "content": "What is in the picture?"}], **OFF}).json()
    assert counted["count"] == text_only["count"] + expected + 2  # the begin and end tokens


def test_the_image_changes_what_the_model_sees(server):
    """Same text, same token count, another picture: the first token's distribution differs (the embeddings
    replace the image tokens'); the same picture again gives the same distribution."""
    def first_logprobs(png: bytes) -> list:
        r = chat(server, chat_image(data_url(png)), max_tokens=1, logprobs=True, top_logprobs=5)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]

    a, b = picture(56, 56, seed=1), picture(56, 56, seed=2)
    assert first_logprobs(a) == first_logprobs(a)
    assert first_logprobs(a) != first_logprobs(b)


def test_anthropic_image_blocks_in_a_turn_and_in_a_tool_result(server):
    png, jpeg = picture(60, 40, seed=4), picture(100, 70, seed=5, fmt="JPEG")
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Read the screenshot."}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Read",
                                           "input": {"file_path": "/tmp/shot.jpg"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg",
                                             "data": base64.b64encode(jpeg).decode()}}]},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png).decode()}},
            {"type": "text", "text": "and this one?"}]},
    ]
    body = {"model": "claude-sonnet", "max_tokens": 4, "messages": messages, "thinking": {"type": "disabled"}}
    r = httpx.post(server.url + "/v1/messages", json=body, timeout=300)
    assert r.status_code == 200, r.text
    s = spec(server)
    per_image = [vision.image_tokens(70, 100, s), vision.image_tokens(40, 60, s)]
    usage = r.json()["usage"]
    assert usage["input_tokens_details"]["image_tokens_per_image"] == per_image
    counted = httpx.post(server.url + "/v1/messages/count_tokens", json=body).json()
    assert counted["input_tokens"] == usage["input_tokens"] + usage["cache_read_input_tokens"]


def test_responses_input_image(server):
    png = picture(30, 90, seed=6)
    content = [{"type": "input_text", "text": "Describe"}, {"type": "input_image", "image_url": data_url(png)}]
    r = httpx.post(server.url + "/v1/responses", timeout=300, json={
        "input": [{"role": "user", "content": content}], "max_output_tokens": 4, "reasoning": {"effort": "none"}})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens_details"]["image_tokens"] == vision.image_tokens(90, 30, spec(server))


def test_a_repeated_image_keeps_its_cached_prefix_and_another_image_does_not(server):
    """Turn two resends turn one's image in its history: the prefix cache serves it and the tower is not run
    again. The same turn with another picture in its place (same tokens) reuses nothing."""
    a, b = picture(64, 64, seed=7), picture(64, 64, seed=8)
    first = chat(server, chat_image(data_url(a)))
    assert first.status_code == 200, first.text
    reply = first.json()["choices"][0]["message"]["content"]

    def second_turn(png: bytes) -> httpx.Response:
        return chat(server, [*chat_image(data_url(png)), {"role": "assistant", "content": reply},
                             {"role": "user", "content": "And now?"}])

    encoded = server.engine.stats()["vision"]["images_encoded"]
    again = second_turn(a)
    assert again.status_code == 200, again.text
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert server.engine.stats()["vision"]["images_encoded"] == encoded
    other = second_turn(b)
    assert other.status_code == 200, other.text
    assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert server.engine.stats()["vision"]["images_encoded"] == encoded + 1


def test_several_images_in_one_request_and_in_history(server):
    urls = [data_url(picture(40 + 10 * i, 40, seed=10 + i)) for i in range(3)]
    messages = [*chat_image(urls[0]), {"role": "assistant", "content": "A picture."},
                {"role": "user", "content": [{"type": "image_url", "image_url": u} for u in urls[1:]]}]
    r = chat(server, messages)
    assert r.status_code == 200, r.text
    s = spec(server)
    assert r.json()["usage"]["prompt_tokens_details"]["image_tokens_per_image"] == [
        vision.image_tokens(40, 40 + 10 * i, s) for i in range(3)]


# -- refusals ---------------------------------------------------------------------------------------------------


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


@pytest.mark.parametrize(("url", "code", "words"), [
    (data_url(b"\x89PNG\r\n\x1a\n not really a png"), "invalid_image", "cannot be decoded"),
    (data_url(picture(8, 8), "image/bmp"), "unsupported_media_type", "image/bmp"),
    ("data:image/png;base64,@@@@", "invalid_image", "base64"),
    ("https://example.invalid/cat.png", "image_url_not_allowed", "GLM53_IMAGE_URL_FETCH=1"),
    ("ftp://example.invalid/cat.png", "invalid_image_url", "data: URL"),
])
def test_bad_images_are_400_naming_the_problem(server, url, code, words):
    e = error_of(chat(server, chat_image(url)), 400)
    assert e["code"] == code and words in e["message"] and e["param"] == "messages.0.content.1", e


def test_limits_are_413_and_400(strict):
    big = picture(96, 96)  # random pixels: about 27 KiB of PNG
    e = error_of(chat(strict, chat_image(data_url(big))), 413)
    assert e["code"] == "image_too_large" and "GLM53_MAX_IMAGE_MB" in e["message"]
    tiny = data_url(picture(4, 4))
    two = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": tiny}}] * 2}]
    e = error_of(chat(strict, two), 400)
    assert e["code"] == "too_many_images" and "GLM53_MAX_IMAGES" in e["message"]
    assert chat(strict, chat_image(tiny)).status_code == 200


def test_image_tokens_beyond_the_context_are_context_length_exceeded(server):
    url = data_url(picture(1500, 1000, fmt="JPEG"))  # about 1000 tokens each: five pass the 4096 context
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}] * 5}]
    e = error_of(chat(server, messages), 400)
    assert e["code"] == "context_length_exceeded", e


def test_refusals_are_in_the_anthropic_shape(server):
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/tiff", "data": "AAAA"}}
    r = httpx.post(server.url + "/v1/messages", json={"model": "x", "max_tokens": 4,
                                                      "messages": [{"role": "user", "content": [block]}]})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert r.json()["error"]["type"] == "invalid_request_error" and "image/tiff" in r.json()["error"]["message"]
    block["source"] = {"type": "file", "file_id": "f_1"}
    r = httpx.post(server.url + "/v1/messages", json={"model": "x", "max_tokens": 4,
                                                      "messages": [{"role": "user", "content": [block]}]})
    assert r.status_code == 400 and "'file'" in r.json()["error"]["message"], r.text


def test_refusals_name_the_field_as_the_client_sent_it(server):
    # A broken image in a tool_result (Claude Code's Read of a screenshot) after a system prompt and an earlier
    # exchange: the message names the Anthropic block, not the chat messages the request was translated into.
    bad = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                        "data": base64.b64encode(b"\x89PNG\r\n\x1a\n not a png").decode()}}
    messages = [
        {"role": "user", "content": "Read the screenshot."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Read", "input": {"file_path": "a"}}]},
        {"role": "user", "content": [{"type": "text", "text": "here:"},
                                     {"type": "tool_result", "tool_use_id": "t1", "content": [
                                         {"type": "text", "text": "shot.png"}, bad]}]},
    ]
    r = httpx.post(server.url + "/v1/messages", json={"model": "x", "max_tokens": 4, "system": "Be brief.",
                                                      "messages": messages})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("messages.2.content.1.content.1"), r.text
    content = [{"type": "input_text", "text": "Describe"},
               {"type": "input_image", "image_url": "data:image/png;base64,@@@@"}]
    r = httpx.post(server.url + "/v1/responses", timeout=60, json={
        "instructions": "Be brief.", "input": [{"role": "user", "content": "hi"}, {"role": "user", "content": content}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input.1.content.1", r.text


def test_a_stream_runs_on_while_bad_images_are_refused(server):
    """Refusals happen before anything reaches the engine: a reply streaming meanwhile ends normally."""
    done: dict = {}

    def stream() -> None:
        with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=300, json={
                "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 24, "stream": True,
                "temperature": 0, **OFF}) as r:
            done["frames"] = [line for line in r.iter_lines() if line.startswith("data: ")]

    t = threading.Thread(target=stream)
    t.start()
    for url in (data_url(b"garbage"), data_url(picture(8, 8), "image/x-icon")):
        assert chat(server, chat_image(url)).status_code == 400
    t.join(timeout=300)
    assert done["frames"][-1] == "data: [DONE]"
    last = json.loads(done["frames"][-2].removeprefix("data: "))
    assert last["choices"][0]["finish_reason"] in ("stop", "length")


def test_url_images_are_fetched_when_the_setting_allows(reference_engine):
    png = picture(32, 32, seed=9)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(png)))
            self.end_headers()
            self.wfile.write(png)

        def log_message(self, *args) -> None:
            pass

    host = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=host.serve_forever, daemon=True).start()
    try:
        with ServerThread(create_app(reference_engine, server_settings(image_url_fetch=1))) as srv:
            r = chat(srv, chat_image(f"http://127.0.0.1:{host.server_port}/shot.png"))
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens_details"]["image_tokens"] == vision.image_tokens(32, 32,
                                                                                                  reference_engine.vision)
    finally:
        host.shutdown()


def test_a_checkpoint_without_the_tower_refuses_images_naming_the_fix(tmp_path):
    from glm53.engine.reference import ReferenceEngine
    from glm53.fixture.hf import write_hf_checkpoint

    engine = ReferenceEngine(write_hf_checkpoint(tmp_path / "text-only", vision=False), max_running=2)
    engine.load()
    try:
        with ServerThread(create_app(engine, server_settings())) as srv:
            e = error_of(chat(srv, chat_image(data_url(picture(16, 16)))), 400)
            assert e["code"] == "images_unsupported" and "vision tower" in e["message"], e
            assert "serve a checkpoint that includes the vision tower" in e["message"]
            assert chat(srv, [{"role": "user", "content": "hi"}]).status_code == 200
    finally:
        engine.close()

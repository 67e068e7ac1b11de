"""The KV cache through a real HTTP server: requests without max_tokens share a small cache (issue 26 item 3), the
prefix cache's reuse is reported and counted (item 2), a reply that outgrows the cache ends with "length" and a
prompt longer than it is context_length_exceeded (issue 25 item 3), out of memory is a clear 503 (issue 25 item 4).

On the CPU reference engine by default; with GLM53_TEST_ENGINE=exl3 (the GPU machine) the small-cache tests run on
the exllamav3 engine over the tiny EXL3 fixture. exllamav3 commits a job's pages up to its next recurrent-checkpoint
boundary (2048 tokens for GLM-5) and requeues it there, so its "small cache" is two such segments; the reference
engine's segment is one page.
"""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest
import torch
from server_support import ServerThread, loaded_and_served, server_settings, wait_until

from glm53.planning.spec import PAGE
from glm53.server.app import create_app

EXL3 = os.environ.get("GLM53_TEST_ENGINE", "reference") == "exl3"
SEGMENT = 2048 if EXL3 else PAGE
KV = 2 * SEGMENT


def small_cache_engine(hf_model_dir, tmp_path_factory, **kw):
    """The test engine (not loaded) with a KV cache of KV tokens shared by up to four requests."""
    if EXL3:
        from specs import spec_for

        from glm53.engine.exl3_engine import Exl3Engine
        from glm53.fixture.exl3 import write_exl3_checkpoint

        path = write_exl3_checkpoint(tmp_path_factory.mktemp("exl3-kv") / "model", seed=0)
        return Exl3Engine(path, spec_for(path, "exact", 4, device="cuda:0", kv_tokens=KV, max_concurrency=4))
    from glm53.engine.reference import ReferenceEngine

    return ReferenceEngine(hf_model_dir, max_running=4, kv_tokens=KV, **kw)


@pytest.fixture(scope="module")
def small(hf_model_dir, tmp_path_factory):
    with loaded_and_served(small_cache_engine(hf_model_dir, tmp_path_factory)) as srv:
        yield srv


def complete(srv, prompt: list[int], timeout: float = 600, **body) -> httpx.Response:
    return httpx.post(srv.url + "/v1/completions", json={"prompt": prompt, "temperature": 0, **body},
                      timeout=timeout)


def idle(srv) -> bool:
    s = srv.engine.stats()
    return s["running"] == 0 and s["waiting"] == 0


@pytest.mark.slow  # end to end and long (30-50 s on two cores): make test runs it after the unit suite
def test_four_requests_without_max_tokens_share_a_small_cache(small):
    """Four replies that could each fill the whole cache: all are answered, each ends with "length" where the cache
    ends (or earlier on a stop token), none fails, and /stats and /metrics show the ones waiting for pages."""
    before = small.engine.stats()
    prompts = [[100 + 7 * i + j for j in range(SEGMENT - 56)] for i in range(4)]  # a page short of a segment
    replies: dict[int, httpx.Response] = {}
    threads = [threading.Thread(target=lambda i=i: replies.__setitem__(i, complete(small, prompts[i])))
               for i in range(4)]
    for t in threads:
        t.start()
    waiting, metric_waiting = 0, 0.0
    while any(t.is_alive() for t in threads):
        stats = httpx.get(small.url + "/stats").json()
        waiting = max(waiting, stats["waiting"])
        if stats["waiting"] and not metric_waiting:
            for line in httpx.get(small.url + "/metrics").text.splitlines():
                if line.startswith("glm53_num_requests_waiting "):
                    metric_waiting = float(line.split()[1])
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert waiting >= 1 and metric_waiting >= 1, (waiting, metric_waiting)
    for i, r in replies.items():
        assert r.status_code == 200, r.text
        choice, usage = r.json()["choices"][0], r.json()["usage"]
        assert choice["finish_reason"] in ("length", "stop"), choice
        assert usage["prompt_tokens"] == len(prompts[i])
        if choice["finish_reason"] == "length":  # the cache's end, not the context's (4096 and more)
            assert usage["prompt_tokens"] + usage["completion_tokens"] == KV, usage
    after = small.engine.stats()
    assert after["requests_failed"] == before["requests_failed"]
    assert after["requests_finished"] - before["requests_finished"] == 4
    if not EXL3:  # the youngest holders gave their pages to older requests (exllamav3 requeues instead)
        assert after["requests_preempted"] > before["requests_preempted"]
    assert wait_until(lambda: idle(small))


def test_a_short_request_is_answered_while_one_without_max_tokens_runs(small):
    """The regression of issue 26: one request without max_tokens reserved the whole cache, and a second with
    max_tokens 8 got no answer while it ran."""
    long: dict[str, httpx.Response] = {}
    t = threading.Thread(target=lambda: long.__setitem__("r", complete(small, list(range(200, 220)))))
    before = small.engine.stats()["generated_tokens"]
    t.start()
    try:
        assert wait_until(lambda: small.engine.stats()["generated_tokens"] > before + 4, timeout=60)
        r = complete(small, list(range(300, 320)), max_tokens=8, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
        assert t.is_alive(), "the long request ended before the short one was answered: the test proves nothing"
    finally:
        t.join(600)
    assert long["r"].status_code == 200


def test_a_prompt_longer_than_the_cache_is_context_length_exceeded(small):
    """The context (4096 here) is not the limit when the whole KV cache is smaller: a prompt that leaves the cache
    no room for a token is refused as context_length_exceeded, never an out-of-memory or engine error. (An EngineSpec
    never has a context beyond its cache, so on exllamav3 the two limits are one.)"""
    assert small.engine.context_length > KV or EXL3
    r = complete(small, [5] * KV, max_tokens=4)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert str(KV) in r.json()["error"]["message"]
    assert complete(small, [5] * (KV - 1), max_tokens=4).json()["choices"][0]["finish_reason"] == "length"


def test_the_prefix_cache_reuse_is_reported_and_counted(small):
    """A prompt that continues a finished request's prompt is served partly from the cache: usage says how much,
    and /stats and /metrics count the hit and the tokens."""
    first = [400 + j for j in range(SEGMENT + 40)]
    before = small.engine.stats()
    r = complete(small, first, max_tokens=1)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, r.text
    r = complete(small, first + [7, 8, 9], max_tokens=1)
    assert r.status_code == 200, r.text
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    # The reference engine keeps the whole cache; exllamav3 reuses whole pages up to its last recurrent checkpoint
    # (one every 2048 tokens of prompt).
    assert cached == (SEGMENT if EXL3 else len(first)), r.json()["usage"]
    after = httpx.get(small.url + "/stats").json()
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == 1
    assert after["prompt_tokens_cached"] - before["prompt_tokens_cached"] == cached
    assert after["prompt_tokens"] - before["prompt_tokens"] == 2 * len(first) + 3
    metrics = httpx.get(small.url + "/metrics").text
    assert f"glm53_prefix_cache_tokens {float(after['prompt_tokens_cached'])}" in metrics
    assert f"glm53_prefix_cache_hit_requests {float(after['prefix_cache_hits'])}" in metrics
    # exllamav3's page table has a page past the context (a job reserves a position beyond its last token).
    pages = KV // PAGE + (1 if EXL3 else 0)
    assert "glm53_kv_cache_pages_evicted " in metrics and f"glm53_kv_cache_pages {float(pages)}" in metrics


# -- out of memory (CPU only: torch.cuda.OutOfMemoryError exists in CPU torch) -------------------------------

OOM_PREFILL, OOM_DECODE = 11, 12  # a prompt starting with one of these runs out of memory (in prefill, at token 3)


def oom_engine(hf_model_dir):
    from glm53.engine.reference import ReferenceEngine

    class OutOfMemoryEngine(ReferenceEngine):
        def _forward(self, req, ids):
            if req.prompt[0] == OOM_PREFILL or (req.prompt[0] == OOM_DECODE and len(req.generated) == 3):
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return super()._forward(req, ids)

    return OutOfMemoryEngine(hf_model_dir, max_running=4)


def test_out_of_memory_in_a_request_fails_it_clearly_and_the_others_go_on(hf_model_dir):
    engine = oom_engine(hf_model_dir)
    engine.load()
    try:
        with ServerThread(create_app(engine, server_settings())) as srv:
            others: dict[str, httpx.Response] = {}
            t = threading.Thread(target=lambda: others.__setitem__("r", complete(srv, [20, 21, 22], max_tokens=40)))
            t.start()
            r = complete(srv, [OOM_PREFILL, 1, 2], max_tokens=8)
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert err["code"] == "out_of_memory" and err["type"] == "service_unavailable"
            for knob in ("GLM53_CONTEXT", "GLM53_MAX_CONCURRENCY", "GLM53_VRAM_BUDGET_GB"):
                assert knob in err["message"]
            # Mid-stream: the stream ends with an error frame saying the same.
            body = {"prompt": [OOM_DECODE, 1, 2], "max_tokens": 8, "temperature": 0, "stream": True}
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as s:
                assert s.status_code == 200
                frames = [line for line in s.iter_lines() if line.startswith("data: {")]
            assert "out_of_memory" in frames[-1] and "GLM53_MAX_CONCURRENCY" in frames[-1], frames[-1]
            t.join(120)
            assert others["r"].status_code == 200 and others["r"].json()["usage"]["completion_tokens"] >= 1
            assert complete(srv, [30, 31], max_tokens=4).status_code == 200  # still serving
            stats = engine.stats()
            assert stats["requests_failed_out_of_memory"] == 2 and stats["requests_failed"] == 2
            assert "glm53_requests_failed_out_of_memory 2.0" in httpx.get(srv.url + "/metrics").text
    finally:
        engine.close()


def test_out_of_memory_at_load_names_what_to_lower(hf_model_dir, monkeypatch):
    import glm53.engine.reference as R

    def no_room(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    base = R._model_class

    def model_class(*args):
        cls = base(*args)
        return type(cls.__name__, (cls,), {"from_pretrained": classmethod(no_room)})

    monkeypatch.setattr(R, "_model_class", model_class)
    engine = R.ReferenceEngine(hf_model_dir)
    with ServerThread(create_app(engine, server_settings())) as srv:
        assert wait_until(lambda: "out of memory" in httpx.get(srv.url + "/ready").text, timeout=60)
        r = complete(srv, [1, 2], max_tokens=2)
        assert r.status_code == 503, r.text
        message = r.json()["error"]["message"]
        assert "while loading the model" in message and "GLM53_VRAM_BUDGET_GB" in message, message

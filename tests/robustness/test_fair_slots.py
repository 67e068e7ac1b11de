"""Decode slots are time-sliced (issue 41): with every slot held by replies that run to the end of the context, a
short request is answered while they still run, and the yielded replies come back to finish whole and in order.

Black-box over real HTTP on the CPU reference engine; the slice's floor is lowered on the engine object so that the
test takes seconds (the engine's default is SLICE_FLOOR_S)."""

from __future__ import annotations

import threading

import httpx
import pytest
from server_support import loaded_and_served, wait_until

from glm53.engine.reference import ReferenceEngine
from glm53.planning.spec import PAGE

SLOTS = 2
CONTEXT = 512  # an unbounded reply here runs ~490 tokens: far longer than one slice on the CPU demo


@pytest.fixture(scope="module")
def two_slots(hf_model_dir):
    engine = ReferenceEngine(hf_model_dir, max_running=SLOTS, context_length=CONTEXT)
    engine.slice_floor_s = 0.3
    with loaded_and_served(engine) as srv:
        yield srv


def post(srv, body: dict, timeout: float = 600) -> httpx.Response:
    return httpx.post(srv.url + "/v1/completions", json={"temperature": 0, **body}, timeout=timeout)


@pytest.mark.slow  # end to end and long (30-50 s on two cores): make test runs it after the unit suite
def test_a_short_request_is_answered_while_every_slot_runs_an_unbounded_reply(two_slots):
    srv = two_slots
    before = srv.engine.stats()
    replies: dict[int, httpx.Response] = {}
    # No max_tokens and ignore_eos: each reply holds its slot to the end of the context.
    longs = [threading.Thread(target=lambda i=i: replies.__setitem__(
        i, post(srv, {"prompt": [400 + 13 * i + j for j in range(24)], "ignore_eos": True}))) for i in range(SLOTS)]
    for t in longs:
        t.start()
    try:
        assert wait_until(lambda: srv.engine.stats()["running"] == SLOTS
                          and srv.engine.stats()["generated_tokens"] > before["generated_tokens"] + 8, timeout=60)
        short = post(srv, {"prompt": [7, 8, 9], "max_tokens": 5, "ignore_eos": True}, timeout=120)
        assert short.status_code == 200, short.text
        assert short.json()["usage"]["completion_tokens"] == 5
        still = [t.is_alive() for t in longs]
        assert all(still), "a long reply ended before the short one was answered: the test proves nothing"
        assert srv.engine.stats()["requests_yielded"] > before["requests_yielded"]
    finally:
        for t in longs:
            t.join(600)
    for i in range(SLOTS):
        r = replies[i]
        assert r.status_code == 200, r.text
        choice, usage = r.json()["choices"][0], r.json()["usage"]
        # A yielded reply resumes where it was: it ends at the context's end, its tokens counted once.
        assert choice["finish_reason"] == "length" and usage["prompt_tokens"] + usage["completion_tokens"] == CONTEXT
    after = srv.engine.stats()
    assert after["requests_failed"] == before["requests_failed"] and after["running"] == after["waiting"] == 0


def test_a_reply_that_yields_its_slot_is_the_reply_it_would_have_been(two_slots):
    """Greedy tokens with yields in between equal the same request's tokens alone (its prefix prefilled again)."""
    srv = two_slots
    body = {"prompt": [500 + j for j in range(24)], "max_tokens": 120, "ignore_eos": True}
    alone = post(srv, body).json()["choices"][0]["text"]
    before = srv.engine.stats()["requests_yielded"]
    out: dict[int, str] = {}
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, post(srv, body if i == 0 else {
        "prompt": [900 + 11 * i + j for j in range(24)], "max_tokens": 120, "ignore_eos": True}).json()
        ["choices"][0]["text"])) for i in range(SLOTS + 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert srv.engine.stats()["requests_yielded"] > before  # three replies, two slots: somebody yielded
    assert out[0] == alone


def test_stats_show_the_slice_and_the_yields(two_slots):
    stats = httpx.get(two_slots.url + "/stats").json()
    assert stats["slice_s"] >= 0.3 and stats["requests_yielded"] >= 0


@pytest.mark.slow  # end to end and long (30-50 s on two cores): make test runs it after the unit suite
def test_yielded_replies_give_up_their_kept_pages_when_the_cache_runs_short(hf_model_dir):
    """A yielded reply keeps its cache and pages (resuming costs nothing), but when a running reply needs a page
    the waiting one lets go of its pages and prefills again later: three replies of a two-page cache on two slots
    all finish at the cache's end, each as it is alone."""
    kv = 2 * PAGE
    engine = ReferenceEngine(hf_model_dir, max_running=SLOTS, kv_tokens=kv)
    engine.slice_floor_s = 0.2
    prompts = [[600 + 17 * i + j for j in range(200)] for i in range(3)]
    with loaded_and_served(engine) as srv:
        alone = [post(srv, {"prompt": p, "ignore_eos": True}).json() for p in prompts]
        before = engine.stats()
        out: dict[int, dict] = {}
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, post(srv, {"prompt": prompts[i],
                                                                                    "ignore_eos": True}).json()))
                   for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        after = engine.stats()
    assert after["requests_yielded"] > before["requests_yielded"] and after["requests_failed"] == before["requests_failed"]
    assert after["requests_preempted"] > before["requests_preempted"]  # a kept cache went to a running reply
    for i in range(3):
        assert out[i]["usage"]["prompt_tokens"] + out[i]["usage"]["completion_tokens"] == kv
        assert out[i]["choices"][0]["text"] == alone[i]["choices"][0]["text"]

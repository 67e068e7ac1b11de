"""Exl3Engine end to end on the CPU, against the fake exllamav3 (tests/support/fake_exllamav3.py).

The fake's Generator runs jobs the way exllamav3 1.6.5 does at the level glm53.exl3.events reads (its result dicts, held
tokens, eos reasons, the llguidance filter's trigger and completion, a failed job's "error" result) and each forward
goes through the fake model's MoE layers, so in the tiered modes every step crosses TieredMoE's seam. A generated
tiny EXL3 checkpoint; every mode the engine serves: stock, exact, fast (the CPU lane), nvme-exact (a record store
packed from the checkpoint). Events are checked against the semantics of the CPU reference engine
(tests/engine/test_reference_engine.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator

import fake_exllamav3 as F
import pytest
from specs import packed_store, spec_for
from test_reference_engine import BOOL_OBJECT

from glm53.engine.interface import EngineError, EngineNotReady, PromptProgress, SamplingParams, TokenEvent
from glm53.fixture import tokenizer as gtok
from glm53.fixture.exl3 import write_exl3_checkpoint
from glm53.server.chat_prompt import close_think

SLOTS = 3  # VRAM slots per MoE layer (of 16 experts, top-4): most picks miss

GRAMMAR = "start: %json " + json.dumps(BOOL_OBJECT, separators=(",", ":"))  # as server.common.grammar_for builds


@pytest.fixture(scope="module", autouse=True)
def fake_exllamav3():
    with F.installed() as mods:
        yield mods


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    return write_exl3_checkpoint(tmp_path_factory.mktemp("engine") / "ck", router_skew=(0.25, 0.5))


@pytest.fixture(scope="module")
def store(ck, tmp_path_factory):
    return packed_store(ck, tmp_path_factory.mktemp("engine-store"))


@contextlib.contextmanager
def running(ck, mode: str = "stock", **kw) -> Iterator:
    """The engine in `mode` on the checkpoint: SLOTS VRAM slots per layer, sized otherwise by glm53.planning.spec's rules."""
    from glm53.engine.exl3_engine import Exl3Engine

    engine = Exl3Engine(ck, spec_for(ck, mode, 0 if mode == "stock" else SLOTS, **kw))
    engine.load()
    try:
        yield engine
    finally:
        engine.close()


@pytest.fixture(scope="module")
def stock(ck):
    with running(ck) as engine:
        yield engine


_ids = iter(range(10**9))


def collect(engine, prompt, params, request_id=None) -> list:
    async def main():
        return [ev async for ev in engine.generate(prompt, params, request_id or f"r{next(_ids)}")]

    return asyncio.run(main())


def gather(engine, prompt, *params) -> list[list]:
    """Several requests at once (their decode steps batched by the generator)."""

    async def one(p):
        return [ev async for ev in engine.generate(prompt, p, f"r{next(_ids)}")]

    async def main():
        return await asyncio.gather(*(one(p) for p in params))

    return asyncio.run(main())


def tokens(events) -> list[int]:
    return [e.token_id for e in events if isinstance(e, TokenEvent)]


def chat(engine, thinking: bool) -> list[int]:
    msgs = [{"role": "user", "content": "JSON please"}]
    text = engine.apply_chat_template(msgs, None, thinking)
    return engine.tokenize(text if thinking else close_think(text))  # as the server does


GREEDY = SamplingParams(temperature=0, max_tokens=16, logprobs=2)


def greedy_run(engine, prompt) -> list:
    """Two identical greedy requests at once: equal (determinism under batching); one of them."""
    a, b = gather(engine, prompt, GREEDY, GREEDY)
    assert tokens(a) == tokens(b) and [e.logprob for e in a] == [e.logprob for e in b]
    return a


def check_events(engine, events, max_tokens: int) -> None:
    """The reference engine's event semantics for a run cut by max_tokens."""
    assert all(isinstance(e, TokenEvent) for e in events) and len(events) == max_tokens
    assert [e.finish_reason for e in events] == [None] * (max_tokens - 1) + ["length"]
    assert "".join(e.text for e in events) == engine.detokenize(tokens(events))
    assert not any(e.forced for e in events)


# ---- every mode -------------------------------------------------------------------------------------------------


def test_stock_serves_and_reports(stock):
    prompt = stock.tokenize("Hello there, how are you?")
    a = greedy_run(stock, prompt)
    check_events(stock, a, 16)
    assert all(len(e.top_logprobs) == 2 and e.logprob == pytest.approx(e.top_logprobs[0][1]) for e in a)
    assert stock.fault() is None
    st = stock.stats()
    assert list(st)[:2] == ["kind", "mode"] and st["kind"] == "exllamav3" and st["mode"] == "stock"
    assert st["tiers"] == {} and st["running"] == 0 and st["generated_tokens"] >= 32
    assert st["context_length"] == 4096 and st["prompt_tokens"] >= 2 * len(prompt)
    # stop tokens: ends on the first occurrence, finish "stop", no text (as the reference engine)
    greedy = tokens(a)
    stop = greedy[5]
    events = collect(stock, prompt, SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop]))
    assert tokens(events) == greedy[: greedy.index(stop) + 1]
    assert events[-1].finish_reason == "stop" and events[-1].token_id == stop and events[-1].text == ""
    # seeded sampling reproduces; another seed differs
    seeded = [SamplingParams(temperature=0.9, top_p=0.95, top_k=50, min_p=0.01, seed=s, max_tokens=12) for s in
              (7, 7, 8)]
    s7, s7b, s8 = gather(stock, prompt, *seeded)
    assert tokens(s7) == tokens(s7b) != tokens(s8)


def test_min_tokens_holds_the_stop_tokens_back(stock):
    """exllamav3 masks the stop tokens until min_new_tokens, across the job's requeues."""
    prompt = stock.tokenize("Hello there, how are you?")
    stop = tokens(collect(stock, prompt, SamplingParams(temperature=0, max_tokens=4)))[0]
    assert tokens(collect(stock, prompt, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop]))) == [stop]
    held = collect(stock, prompt, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop], min_tokens=6))
    ids = tokens(held)
    assert len(ids) >= 6 and stop not in ids[:6], ids


def test_exact_mode_equals_stock_through_the_tiers(stock, ck, caplog):
    prompt = stock.tokenize("Hello there, how are you?")
    want = greedy_run(stock, prompt)
    with running(ck, "exact") as engine, caplog.at_level("INFO", logger="glm53.engine"):
        got = greedy_run(engine, prompt)
        # A line per finished job: its prefill and where its picks were read from since it started.
        done = [r.getMessage() for r in caplog.records if " prefilled in " in r.getMessage()]
        assert done and f"prompt {len(prompt)} tokens" in done[-1] and "% PCIe" in done[-1], done
        # bit-identical logits: the logprobs equal
        assert [(e.token_id, e.logprob, e.top_logprobs) for e in got] == \
            [(e.token_id, e.logprob, e.top_logprobs) for e in want]
        assert engine.fault() is None
        st = engine.stats()
        assert st["mode"] == "exact"
        tiers = st["tiers"]
        assert tiers["mode"] == "exact" and tiers["layer_steps"] > 0
        assert tiers["picks"]["pcie"] > 0 and tiers["picks"]["cpu"] == 0 and tiers["evictions"] > 0
        # All in RAM: the guesses ahead serve the prestage, which copies at most two a step for the next layer.
        pre = tiers["lookahead"]["prestage"]
        assert tiers["lookahead"]["steps"] > 0 and 0 < pre["staged"] <= 2 * tiers["lookahead"]["steps"]
        assert pre["judge"]["in_trial"] and pre["used"] > 0
        engine.tiered.check_invariants()


def test_fast_mode_starts_the_cpu_lane(stock, ck):
    prompt = stock.tokenize("Hello there, how are you?")
    with running(ck, "fast", cpu_threads=1) as engine:
        lane = engine.tiered.stepper.lane
        assert lane is not None and lane.alive
        events = collect(engine, prompt, SamplingParams(temperature=0, max_tokens=12))
        check_events(engine, events, 12)
        tiers = engine.stats()["tiers"]
        assert tiers["mode"] == "fast" and "cost_model" in tiers["cpu_lane"] and tiers["picks"]["total"] > 0
    assert not lane.alive  # closed with the engine


def test_nvme_exact_mode_equals_stock_from_the_store(stock, ck, store):
    prompt = stock.tokenize("Hello there, how are you?")
    want = greedy_run(stock, prompt)
    # 48 experts, 9 in VRAM; the RAM tier holds 20 records: store reads and drops.
    with running(ck, "nvme-exact", store=str(store), ram_slots=20, store_threads=2) as engine:
        got = greedy_run(engine, prompt)
        assert [(e.token_id, e.logprob) for e in got] == [(e.token_id, e.logprob) for e in want]
        assert engine.fault() is None
        tiers = engine.stats()["tiers"]
        assert tiers["mode"] == "nvme-exact" and tiers["picks"]["nvme"] > 0 and tiers["nvme_fault"] is None
        assert "lookahead" in tiers
        reads = tiers["store_reads"]  # how the store is read, in /stats
        assert reads["parts"] >= 1 and reads["reads"] > 0 and reads["errors"] == 0 and reads["prefetch_at_once"] >= 1
        nvme = engine.tiered.nvme
    assert nvme.tiers.store is None  # the store reader closed with the engine


# ---- reasoning budget and grammar ----------------------------------------------------------------------------


def test_reasoning_budget_forces_think_close_and_continues_in_a_new_job(stock):
    prompt = chat(stock, thinking=True)
    assert prompt[-1] == stock.token_id(gtok.THINK_OPEN)
    close = stock.tokenize(gtok.THINK_CLOSE + "\n")
    serial = stock.runtime.generator.job_serial
    params = SamplingParams(temperature=0, max_tokens=10, reasoning_budget=3, reasoning_end_ids=close)
    events = collect(stock, prompt, params)
    assert [e.forced for e in events] == [False] * 3 + [True] * 2 + [False] * 5
    assert tokens(events)[3:5] == close and events[-1].finish_reason == "length" and len(events) == 10
    assert stock.runtime.generator.job_serial == serial + 2  # the continuation is a second job
    # It continues exactly as a fresh request on the prompt plus what was emitted
    head = tokens(events)[:5]
    rest = collect(stock, prompt + head, SamplingParams(temperature=0, max_tokens=5))
    assert tokens(rest) == tokens(events)[5:]
    assert gtok.THINK_CLOSE + "\n" in "".join(e.text for e in events)


def test_a_budget_continuation_reports_the_first_jobs_prefix_reuse(stock, monkeypatch):
    # The first job is stopped at the budget, so no end-of-job result carries its cached count: it is read off the
    # job, and the request's last event reports it (usage.prompt_tokens_details.cached_tokens).
    prompt = chat(stock, thinking=True)
    close = stock.tokenize(gtok.THINK_CLOSE + "\n")
    enqueue, jobs = stock.runtime.generator.enqueue, []

    def enqueue_reusing(job):
        if not jobs:
            job.cached_tokens = 5  # as if the page cache had served the first 5 prompt tokens
        jobs.append(job)
        return enqueue(job)

    monkeypatch.setattr(stock.runtime.generator, "enqueue", enqueue_reusing)
    events = collect(stock, prompt, SamplingParams(temperature=0, max_tokens=8, reasoning_budget=2,
                                                   reasoning_end_ids=close))
    assert len(jobs) == 2 and events[-1].finish_reason == "length"
    assert events[-1].cached_tokens == 5


def test_grammar_without_thinking_completes_with_stop(stock):
    prompt = chat(stock, thinking=False)
    for p in (SamplingParams(temperature=0, max_tokens=30, grammar=GRAMMAR),
              SamplingParams(temperature=1.0, seed=3, max_tokens=30, grammar=GRAMMAR, logprobs=1)):
        events = collect(stock, prompt, p)
        assert events[-1].finish_reason == "stop" and all(e.finish_reason is None for e in events[:-1])
        text = "".join(e.text for e in events)
        assert json.loads(text) in ({"ok": True}, {"ok": False})
        # The completing token ends the stream itself (it carries text); no extra event
        assert text == stock.detokenize(tokens(events)) and events[-1].text
        assert events[-1].token_id not in stock.eos_token_ids


def test_grammar_waits_for_the_think_block(stock):
    prompt = chat(stock, thinking=True)
    # Inside the think block the grammar does not constrain: the same tokens as without it
    free = collect(stock, prompt, SamplingParams(temperature=0, max_tokens=12))
    assert stock.token_id(gtok.THINK_CLOSE) not in tokens(free)
    held = collect(stock, prompt, SamplingParams(temperature=0, max_tokens=12, grammar=GRAMMAR))
    assert tokens(held) == tokens(free) and held[-1].finish_reason == "length"
    # Budget-forced close: the continuation job's grammar applies at once
    close = stock.tokenize(gtok.THINK_CLOSE + "\n")
    events = collect(stock, prompt, SamplingParams(temperature=0, max_tokens=40, grammar=GRAMMAR, reasoning_budget=2,
                                                   reasoning_end_ids=close))
    assert tokens(events)[2:4] == close and events[-1].finish_reason == "stop"
    assert json.loads(stock.detokenize(tokens(events)[4:])) in ({"ok": True}, {"ok": False})


def test_grammar_triggers_on_a_sampled_think_close(stock, monkeypatch):
    """The model closes the think block itself: exllamav3's filter activates on the trigger token."""
    prompt = chat(stock, thinking=True)
    free = tokens(collect(stock, prompt, SamplingParams(temperature=0, max_tokens=6)))
    after = free[2]  # steer the model: </think> is the most likely token after this one
    assert after not in free[:2]
    think_close = stock.token_id(gtok.THINK_CLOSE)
    forward = stock.runtime.model.forward

    def steered(input_ids, params):
        logits = forward(input_ids, params)
        logits[..., think_close] += 1000.0 * (input_ids == after).float()
        return logits

    monkeypatch.setattr(stock.runtime.model, "forward", steered)
    serial = stock.runtime.generator.job_serial
    events = collect(stock, prompt, SamplingParams(temperature=0, max_tokens=30, grammar=GRAMMAR))
    ids = tokens(events)
    assert ids[:4] == [*free[:3], think_close] and not any(e.forced for e in events)
    assert events[-1].finish_reason == "stop" and stock.runtime.generator.job_serial == serial + 1
    assert json.loads(stock.detokenize(ids[4:])) in ({"ok": True}, {"ok": False})


def test_invalid_grammar_is_a_value_error(stock):
    with pytest.raises(ValueError, match="invalid grammar"):
        collect(stock, [1, 2, 3], SamplingParams(grammar="start: %json {"))
    assert stock.stats()["running"] == 0


# ---- limits, failures, cancellation, shutdown ---------------------------------------------------------------


def test_long_prompts_and_the_end_of_the_context(ck):
    with running(ck, "exact", kv_tokens=512, prefill_chunk=256) as engine:
        assert engine.context_length == 512
        prompt = [(7 * i + 3) % 3000 for i in range(500)]
        events = collect(engine, prompt, SamplingParams(temperature=0))
        progress = [(e.processed, e.total) for e in events if isinstance(e, PromptProgress)]
        assert progress == [(256, 499), (499, 499)] and events[:2] == [PromptProgress(*p) for p in progress]
        # The rest of the context, each token once, the last one "length" (as the reference engine)
        check_events(engine, events[2:], 12)

        # A prompt one token short of the context gets its one token, and a request running beside it is unharmed
        async def main():
            other = engine.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=40), "beside")
            first = await other.__anext__()
            edge = [ev async for ev in engine.generate(prompt[:1] * 511, SamplingParams(temperature=0), "edge")]
            return edge, [first] + [ev async for ev in other]

        edge, beside = asyncio.run(main())
        assert [type(e) for e in edge] == [PromptProgress, PromptProgress, TokenEvent]
        check_events(engine, edge[2:], 1)
        check_events(engine, beside, 40)

        # A continuation job (the reasoning budget) prefills again: no progress events after the first token
        close = engine.tokenize(gtok.THINK_CLOSE + "\n")
        events = collect(engine, prompt[:300], SamplingParams(temperature=0, max_tokens=8, reasoning_budget=2,
                                                               reasoning_end_ids=close))
        kinds = [isinstance(e, PromptProgress) for e in events]
        assert kinds == [True] * 2 + [False] * 8 and [e.forced for e in events[2:]] == [False] * 2 + [True] * 2 + \
            [False] * 4


def test_a_failed_prefill_fails_its_request(stock, monkeypatch):
    """exllamav3 contains a job's prefill failure (an "error" result without the identifier): the request must
    fail, not hang, and the engine keep serving."""
    forward = stock.runtime.model.forward

    def broken(input_ids, params):
        if input_ids.shape[1] > 1:
            raise RuntimeError("simulated prefill fault")
        return forward(input_ids, params)

    monkeypatch.setattr(stock.runtime.model, "forward", broken)

    async def main():
        return await asyncio.wait_for(collect_async(stock, list(range(1, 40))), timeout=10)

    with pytest.raises(EngineError, match="simulated prefill fault"):
        asyncio.run(main())
    monkeypatch.undo()
    assert stock.stats()["requests_failed"] >= 1 and stock.runtime.generator.num_remaining_jobs() == 0
    assert len(collect(stock, [1, 2, 3], SamplingParams(temperature=0, max_tokens=3))) == 3


def test_a_request_that_cannot_start_fails_alone(stock, monkeypatch):
    enqueue = stock.runtime.generator.enqueue

    def refuse(job):
        if job.input_ids.shape[1] == 9:
            raise AssertionError("Job requires 3 pages (only 2 available) and cannot be enqueued")
        return enqueue(job)

    monkeypatch.setattr(stock.runtime.generator, "enqueue", refuse)

    async def main():
        other = stock.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=20), "running")
        first = await other.__anext__()
        with pytest.raises(EngineError, match="cannot be enqueued"):
            await collect_async(stock, list(range(1, 10)))
        return [first] + [ev async for ev in other]

    check_events(stock, asyncio.run(main()), 20)


def test_held_tokens_arrive_together(stock, monkeypatch):
    """exllamav3 holds tokens while their text ends in an incomplete character and releases them in one result:
    each becomes its own event, and no event's text has a broken character."""
    chars = stock.tokenize("東京")  # six byte-level tokens, none a whole character alone
    assert len(chars) == 6 and all(stock.detokenize([t]) == "\ufffd" for t in chars)
    prompt = [5, 6, 7]
    after = dict(zip([prompt[-1], *chars[:-1]], chars, strict=True))  # steer: each token is followed by the next
    forward = stock.runtime.model.forward

    def steered(input_ids, params):
        logits = forward(input_ids, params)
        for prev, nxt in after.items():
            logits[..., nxt] += 1000.0 * (input_ids == prev).float()
        return logits

    released = []
    on_tokens = stock._on_tokens

    def spy(req, ev):
        if ev.token_ids:
            released.append(len(ev.token_ids))
        on_tokens(req, ev)

    monkeypatch.setattr(stock.runtime.model, "forward", steered)
    monkeypatch.setattr(stock, "_on_tokens", spy)
    events = collect(stock, prompt, SamplingParams(temperature=0, max_tokens=8, logprobs=1))
    assert tokens(events)[:6] == chars and released[:2] == [3, 3]
    assert [e.text for e in events[:6]] == ["", "", "東", "", "", "京"]
    assert all(e.logprob is not None for e in events)
    check_events(stock, events, 8)


async def collect_async(engine, prompt):
    return [ev async for ev in engine.generate(prompt, SamplingParams(temperature=0, max_tokens=4),
                                               f"r{next(_ids)}")]


def test_closing_the_stream_cancels_the_job(stock):
    async def main():
        agen = stock.generate([5, 6, 7], SamplingParams(max_tokens=3000), f"r{next(_ids)}")
        n = 0
        async for ev in agen:
            n += isinstance(ev, TokenEvent)
            if n == 3:
                break
        await agen.aclose()

    before = stock.stats()["requests_cancelled"]
    asyncio.run(main())
    deadline = time.monotonic() + 5
    while (stock.stats()["running"] or stock.runtime.generator.num_remaining_jobs()) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert stock.stats()["requests_cancelled"] == before + 1 and stock.runtime.generator.num_remaining_jobs() == 0


def test_moe_cpu_split_is_refused(ck, monkeypatch):
    from glm53.engine.exl3_engine import Exl3Engine

    monkeypatch.setenv("EXL3_MOE_CPU_SPLIT", "1")
    engine = Exl3Engine(ck, spec_for(ck, "exact", SLOTS))
    with pytest.raises(EngineError, match="EXL3_MOE_CPU_SPLIT"):
        engine.load()
    assert not engine.ready


def test_close_fails_in_flight_requests_and_restores_the_model(ck):
    with running(ck, "exact") as engine:
        model = engine.runtime.model
        stepped = asyncio.Event()

        async def main():
            async def slow():
                out = []
                async for ev in engine.generate([5, 6, 7], SamplingParams(max_tokens=3000), "long"):
                    out.append(ev)
                    stepped.set()
                return out

            task = asyncio.create_task(slow())
            await stepped.wait()
            await asyncio.to_thread(engine.close)
            return await asyncio.gather(task, return_exceptions=True)

        (result,) = asyncio.run(main())
        assert isinstance(result, EngineNotReady)
        assert not engine.ready and engine.runtime is None and engine.tiered is None
        assert not model.loaded and not any(c.initialized for c in model.caches)
        for m in model.moe():
            assert m.num_local_experts == m.num_experts and m.routing_first is None and m.cpu_split_first is None
            assert "cpu_split_submit" not in vars(m)
        with pytest.raises(EngineNotReady):
            collect(engine, [1, 2], SamplingParams(max_tokens=2))
        assert engine.stats()["tiers"] == {} and engine.fault() is None
        engine.close()  # twice is fine


def test_tool_call_grammar_through_the_filter(stock):
    """The server's tool-call grammar reaches exllamav3's LLGuidanceFilter unchanged: a forced call names the
    tool and its arguments follow the schema (the same grammar the reference engine applies)."""
    from glm53.server.chat import ChatStreamParser, merge_tool_calls, tool_param_types
    from glm53.server.chat_grammar import tool_call_grammar

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["city", "days"]}}}]
    grammar = tool_call_grammar(tools, stock.token_id, choice="required", named=None, parallel=False)
    prompt = chat(stock, thinking=False)
    for seed in range(3):
        events = collect(stock, prompt, SamplingParams(temperature=1.0, seed=seed, max_tokens=60, grammar=grammar))
        assert events[-1].finish_reason == "stop"
        parser = ChatStreamParser(start_in_reasoning=False, parse_tools=True, param_types=tool_param_types(tools))
        out = parser.feed("".join(e.text for e in events))
        out.extend(parser.finish())
        (call,) = merge_tool_calls(out.tool_calls)
        args = json.loads(call["function"]["arguments"])
        assert call["function"]["name"] == "get_weather" and set(args) == {"city", "days"}
        assert isinstance(args["city"], str) and len(args["city"]) <= 8 and 1 <= args["days"] <= 9


@pytest.mark.slow  # end to end and long (30-50 s on two cores): make test runs it after the unit suite
def test_replies_without_max_tokens_commit_pages_as_they_grow_and_wait_for_them(ck):
    """max_rq_tokens: a job holds its prompt's pages and one segment, and requeues at the segment's end; on a cache
    too small for two whole replies, the second job waits for pages (counted as waiting, not running) instead of
    either failing, both end with "length" where the cache ends, and neither reply differs from the same request
    run alone (a requeue loses or repeats no token)."""
    kv = 3 * F.PAGE_SIZE
    with running(ck, kv_tokens=kv, max_concurrency=2) as engine:
        alone = collect(engine, [5, 6, 7], SamplingParams(temperature=0))
        seen: list[tuple[int, int, int]] = []

        async def main():
            async def one(prompt):
                return [ev async for ev in engine.generate(prompt, SamplingParams(temperature=0), f"r{next(_ids)}")]

            jobs = [asyncio.ensure_future(one(p)) for p in ([5, 6, 7], [8, 9, 10])]
            while not all(j.done() for j in jobs):
                s = engine.stats()
                seen.append((s["running"], s["waiting"], s["waiting_for_kv"]))
                await asyncio.sleep(0.002)
            return [j.result() for j in jobs]

        both = asyncio.run(main())
        stats = engine.stats()
    assert tokens(both[0]) == tokens(alone) and len(alone) == kv - 3
    for events in (alone, *both):
        assert events[-1].finish_reason == "length" and len(tokens(events)) == kv - 3
    assert any(running == 2 for running, _, _ in seen), seen  # both decoded at once: no reply reserved it all
    assert any(k and waiting >= k for _, waiting, k in seen), seen  # then one waited for pages, and showed it
    assert stats["requests_failed"] == 0 and stats["requests_finished"] == 3
    assert stats["kv_cache"]["pages"] == kv // F.PAGE_SIZE + 1 and stats["kv_cache"]["pages_evicted"] == 0
    assert stats["prefix_cache_hits"] == 0 and stats["prompt_tokens_cached"] == 0  # the fake has no prompt cache


def test_the_warm_up_runs_every_shape_before_serving(ck, fake_exllamav3, monkeypatch, caplog):
    """Every row count and decode batch glm53.engine.warmup lists goes through the generator before the engine is
    ready, in both regimes when the model has a sparse indexer (a top-k on the fake's config): on exllamav3 each is
    a kernel variant compiled at start-up instead of inside a user's request."""
    from glm53.engine.exl3_engine import Exl3Engine
    from glm53.engine.warmup import warmup_shapes
    from glm53.exl3.contract import SMALL_QUERY_ROWS
    from glm53.planning.spec import PAGE

    prompts, batches = [], set()

    class Job(F.Job):
        def __init__(self, *a, input_ids, **kw):
            prompts.append(int(input_ids.shape[-1]))
            super().__init__(*a, input_ids=input_ids, **kw)

    forward = F.Model.forward

    def counted(self, input_ids, params):
        if input_ids.shape[1] == 1:
            batches.add(int(input_ids.shape[0]))
        return forward(self, input_ids, params)

    monkeypatch.setattr(fake_exllamav3["exllamav3"], "Job", Job)
    monkeypatch.setattr(F.Model, "forward", counted)
    monkeypatch.setattr(F.Config, "index_topk", 300, raising=False)
    spec = spec_for(ck, "exact", SLOTS, max_concurrency=3)
    caplog.set_level("INFO", logger="glm53.engine")
    engine = Exl3Engine(ck, spec)
    engine.load()
    try:
        shapes = warmup_shapes(small_rows=SMALL_QUERY_ROWS, max_batch=3, kv_tokens=spec.kv_tokens,
                               chunk=spec.prefill_chunk, page=PAGE, sparse_topk=300)
        assert {s.prefix for s in shapes} == {0, 512}
        want = {s.prefix + s.tail + 1 for s in shapes}
        assert want <= set(prompts)
        assert {1, 2, 3} <= batches
        assert f"warm-up: {len(shapes) + 1} shapes" in caplog.text
        events = collect(engine, [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0))
        assert [e for e in events if isinstance(e, TokenEvent)][-1].finish_reason == "length"
    finally:
        engine.close()


def test_three_greedy_replies_on_two_slots_take_turns_and_stay_what_they_are_alone(ck):
    """Decode slots are time-sliced (glm53.engine.worker): a reply whose slice is spent yields its slot while another
    waits, its job stopped and a new one started on prompt + generated; each reply equals the same request alone."""
    params = SamplingParams(temperature=0, max_tokens=40, min_tokens=40)
    with running(ck, "exact", max_concurrency=2) as engine:
        assert engine.max_running == 2
        prompts = [engine.tokenize(t) for t in ("First of three.", "Second, a little longer.", "Third")]
        alone = [tokens(collect(engine, p, params)) for p in prompts]
        engine.slice_floor_s = 0.0  # every step with a waiting request yields (the slice's floor)

        async def main():
            async def one(p):
                return [ev async for ev in engine.generate(p, params, f"r{next(_ids)}")]
            return await asyncio.gather(*(one(p) for p in prompts))

        together = asyncio.run(main())
        st = engine.stats()
    assert st["requests_yielded"] > 0 and st["requests_failed"] == 0
    assert [tokens(t) for t in together] == alone
    for t in together:
        check_events(engine, t, 40)

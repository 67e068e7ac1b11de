"""The CPU reference engine on the tiny generated checkpoint: sampling, stops, budgets, cancel, concurrency."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import torch

from glm53.engine import sampling
from glm53.engine.detok import IncrementalDetokenizer
from glm53.engine.interface import (
    ContextLengthExceeded,
    Engine,
    GrammarUnsupported,
    PromptProgress,
    SamplingParams,
    TokenEvent,
)
from glm53.engine.reference import ReferenceEngine
from glm53.fixture import tokenizer as gtok
from glm53.server.chat_prompt import close_think

_ids = iter(range(10**9))


def rid() -> str:
    return f"t{next(_ids)}"


async def collect(engine, prompt, params, request_id=None) -> list:
    return [ev async for ev in engine.generate(prompt, params, request_id or rid())]


def tokens(events) -> list[int]:
    return [e.token_id for e in events if isinstance(e, TokenEvent)]


@pytest.fixture(scope="module")
def prompt(reference_engine) -> list[int]:
    text = reference_engine.apply_chat_template([{"role": "user", "content": "Name three colors."}], None, True)
    return reference_engine.tokenize(text)


def wait_idle(engine, timeout: float = 2.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        if (stats["running"] == 0 and stats["waiting"] == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.005)


def test_protocol_and_basic_generation(reference_engine, prompt) -> None:
    eng = reference_engine
    assert isinstance(eng, Engine) and eng.ready and eng.kind == "reference-cpu"
    assert eng.context_length == 4096
    assert eng.eos_token_ids == sorted(eng.token_id(t) for t in gtok.EOS_TOKENS)
    assert prompt[:2] == [eng.token_id(gtok.GMASK), eng.token_id(gtok.SOP)]
    events = asyncio.run(collect(eng, prompt, SamplingParams(max_tokens=12, seed=1)))
    assert len(events) == 12 and all(isinstance(e, TokenEvent) for e in events)
    assert [e.finish_reason for e in events] == [None] * 11 + ["length"]
    assert "".join(e.text for e in events) == eng.detokenize(tokens(events))
    assert all(e.logprob is None and e.top_logprobs is None for e in events)
    stats = wait_idle(eng)
    assert stats["generated_tokens"] >= 12 and stats["tiers"] == {}


def test_greedy_is_deterministic_and_matches_a_plain_forward(reference_engine, prompt) -> None:
    params = SamplingParams(temperature=0, max_tokens=8)
    a = tokens(asyncio.run(collect(reference_engine, prompt, params)))
    b = tokens(asyncio.run(collect(reference_engine, prompt, params)))
    assert a == b
    # Same tokens as argmax over a full (cache-free) forward of the growing sequence.
    model, n_vocab = reference_engine._model, reference_engine._n_vocab
    seq = list(prompt)
    with torch.inference_mode():
        for _ in range(3):
            logits = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1, :n_vocab]
            seq.append(int(torch.argmax(logits)))
    assert seq[len(prompt) :] == a[:3]


def test_chunked_prefill_matches_single_pass(hf_model_dir: Path, reference_engine, prompt) -> None:
    chunked = ReferenceEngine(hf_model_dir, prefill_chunk=4)
    chunked.load()
    try:
        params = SamplingParams(temperature=0, max_tokens=6)
        events = asyncio.run(collect(chunked, prompt, params))
        progress = [e for e in events if isinstance(e, PromptProgress)]
        assert [p.processed for p in progress] == list(range(4, len(prompt), 4)) + [len(prompt)]
        assert tokens(events) == tokens(asyncio.run(collect(reference_engine, prompt, params)))
    finally:
        chunked.close()


def test_seed_determinism(reference_engine, prompt) -> None:
    def run(seed: int) -> list[int]:
        return tokens(asyncio.run(collect(reference_engine, prompt, SamplingParams(temperature=1.0, max_tokens=10, seed=seed))))

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_sampling_filters() -> None:
    logits = torch.tensor([1.0, 3.0, 2.0, 2.9, -1.0])
    gen = sampling.make_generator(0)
    for params in (SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(min_p=1.0), SamplingParams(temperature=0)):
        assert {sampling.sample(logits, params, gen) for _ in range(20)} == {1}
    probs = sampling.filtered_probs(logits, SamplingParams(top_k=2))
    assert torch.count_nonzero(probs) == 2 and probs[1] > probs[3] > 0
    with pytest.raises(ValueError):
        sampling.validate(SamplingParams(top_p=0))


@pytest.mark.parametrize("params", [SamplingParams(top_p=5e-324), SamplingParams(temperature=5e-324),
                                    SamplingParams(temperature=1e-30, top_p=1e-40, min_p=1.0)])
def test_extreme_legal_params_still_draw_the_likeliest_token(params: SamplingParams) -> None:
    """Values the API accepts but float32 cannot hold (5e-324 rounds to 0) still leave a distribution to draw from."""
    logits = torch.tensor([1.0, 3.0, 2.0, 2.9, -1.0])
    sampling.validate(params)
    probs = sampling.filtered_probs(logits, params)
    assert torch.isfinite(probs).all() and probs.argmax() == 1
    assert sampling.sample(logits, params, sampling.make_generator(0)) == 1


def test_stop_token(reference_engine, prompt) -> None:
    greedy = tokens(asyncio.run(collect(reference_engine, prompt, SamplingParams(temperature=0, max_tokens=8))))
    stop = greedy[4]
    first = greedy.index(stop)
    events = asyncio.run(collect(reference_engine, prompt, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop])))
    assert tokens(events) == greedy[: first + 1]
    assert events[-1].finish_reason == "stop" and events[-1].token_id == stop and events[-1].text == ""


def test_logprobs(reference_engine, prompt) -> None:
    events = asyncio.run(collect(reference_engine, prompt, SamplingParams(temperature=0, max_tokens=4, logprobs=3)))
    for ev in events:
        assert len(ev.top_logprobs) == 3
        values = [v for _, v in ev.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert ev.logprob == pytest.approx(values[0])  # greedy picks the most likely token
        assert ev.top_logprobs[0][0] == ev.token_text == reference_engine.detokenize([ev.token_id])


def test_reasoning_budget_forces_think_close(reference_engine, prompt) -> None:
    close = reference_engine.tokenize(gtok.THINK_CLOSE + "\n")
    params = SamplingParams(temperature=0, max_tokens=10, reasoning_budget=3, reasoning_end_ids=close)
    events = asyncio.run(collect(reference_engine, prompt, params))
    assert [e.forced for e in events[:5]] == [False, False, False, True, True]
    assert tokens(events)[3:5] == close
    assert gtok.THINK_CLOSE + "\n" in "".join(e.text for e in events)
    assert not any(e.forced for e in events[5:])


def test_context_overflow_and_bad_input(reference_engine, hf_model_dir: Path) -> None:
    too_long = [0] * reference_engine.context_length
    with pytest.raises(ContextLengthExceeded) as info:
        asyncio.run(collect(reference_engine, too_long, SamplingParams()))
    assert info.value.prompt_tokens == reference_engine.context_length
    with pytest.raises(ValueError):
        asyncio.run(collect(reference_engine, [], SamplingParams()))
    with pytest.raises(ValueError):
        asyncio.run(collect(reference_engine, [1], SamplingParams(temperature=-1)))


def test_grammar_unsupported_without_llguidance(reference_engine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reference_engine, "supports_grammar", False)
    with pytest.raises(GrammarUnsupported):
        asyncio.run(collect(reference_engine, [1], SamplingParams(grammar="start: %json {}")))


BOOL_OBJECT = {
    "x-guidance": {"whitespace_flexible": False},
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}


def test_grammar_constrains_the_answer_after_reasoning(reference_engine) -> None:
    pytest.importorskip("llguidance")
    eng = reference_engine
    grammar = "start: %json " + json.dumps(BOOL_OBJECT)
    with pytest.raises(ValueError):
        asyncio.run(collect(eng, [1], SamplingParams(grammar="start: %json {")))

    msgs = [{"role": "user", "content": "JSON please"}]
    no_think = eng.tokenize(close_think(eng.apply_chat_template(msgs, None, False)))  # as the server does
    for seed in range(3):
        events = asyncio.run(collect(eng, no_think, SamplingParams(max_tokens=30, seed=seed, grammar=grammar)))
        assert events[-1].finish_reason == "stop"  # the grammar completes: nothing more is allowed
        assert json.loads("".join(e.text for e in events)) in ({"ok": True}, {"ok": False})

    # Reasoning is free text; the grammar applies from the token after the (here budget-forced) </think>.
    think = eng.tokenize(eng.apply_chat_template(msgs, None, True))
    close = eng.tokenize(gtok.THINK_CLOSE + "\n")
    params = SamplingParams(max_tokens=40, seed=0, grammar=grammar, reasoning_budget=2, reasoning_end_ids=close)
    events = asyncio.run(collect(eng, think, params))
    assert tokens(events)[2:4] == close and events[-1].finish_reason == "stop"
    answer = eng.detokenize(tokens(events)[4:])
    assert json.loads(answer) in ({"ok": True}, {"ok": False})


def test_generation_stops_at_the_context_end(hf_model_dir: Path) -> None:
    small = ReferenceEngine(hf_model_dir, context_length=24)
    small.load()
    try:
        events = asyncio.run(collect(small, list(range(20)), SamplingParams(temperature=0)))
        assert len(tokens(events)) == 4 and events[-1].finish_reason == "length"
    finally:
        small.close()


def test_close_iterator_frees_the_slot(reference_engine, prompt) -> None:
    async def main() -> int:
        agen = reference_engine.generate(prompt, SamplingParams(max_tokens=3000), rid())
        n = 0
        async for ev in agen:
            n += isinstance(ev, TokenEvent)
            if n == 3:
                break
        await agen.aclose()
        return n

    before = reference_engine.stats()["requests_cancelled"]
    assert asyncio.run(main()) == 3
    stats = wait_idle(reference_engine)
    assert stats["running"] == 0 and stats["requests_cancelled"] == before + 1


def test_cancel_by_id_ends_the_stream(reference_engine, prompt) -> None:
    async def main() -> list:
        request_id = rid()
        out = []
        async for ev in reference_engine.generate(prompt, SamplingParams(max_tokens=3000), request_id):
            out.append(ev)
            if len(out) == 2:
                reference_engine.cancel(request_id)
        return out

    t0 = time.perf_counter()
    events = asyncio.run(main())
    assert time.perf_counter() - t0 < 2.0
    assert 2 <= len(events) < 50 and events[-1].finish_reason is None
    assert wait_idle(reference_engine)["running"] == 0
    reference_engine.cancel("no-such-request")  # unknown ids are ignored


def test_concurrent_requests_all_progress(reference_engine, prompt) -> None:
    params = SamplingParams(temperature=0, max_tokens=12)
    solo = tokens(asyncio.run(collect(reference_engine, prompt, params)))

    async def one(i: int) -> tuple[list[int], list[float]]:
        ids, stamps = [], []
        async for ev in reference_engine.generate(prompt, params, f"conc-{i}-{rid()}"):
            ids.append(ev.token_id)
            stamps.append(time.perf_counter())
        return ids, stamps

    async def main():
        return await asyncio.gather(*(one(i) for i in range(6)))

    results = asyncio.run(main())
    # Per-request caches: every stream equals the solo run, and they interleave rather than run one by one.
    assert all(ids == solo for ids, _ in results)
    first_done = min(stamps[-1] for _, stamps in results)
    assert all(stamps[0] < first_done for _, stamps in results)


def test_duplicate_request_id_is_refused(reference_engine, prompt) -> None:
    async def main() -> None:
        first = reference_engine.generate(prompt, SamplingParams(max_tokens=3000), "dup")
        await first.__anext__()
        try:
            with pytest.raises(ValueError):
                await collect(reference_engine, prompt, SamplingParams(max_tokens=2), "dup")
        finally:
            await first.aclose()

    asyncio.run(main())
    wait_idle(reference_engine)


def test_incremental_detokenizer_never_splits_characters(reference_engine) -> None:
    text = "Grüße aus 東京 👋🏽 — ok"
    ids = reference_engine.tokenize(text)
    detok = IncrementalDetokenizer(reference_engine.detokenize)
    parts = [detok.push(i) for i in ids]
    assert "".join(parts) + detok.flush() == text
    assert all("\ufffd" not in p for p in parts)


def test_min_tokens_holds_the_stop_tokens_back(reference_engine, prompt) -> None:
    greedy = tokens(asyncio.run(collect(reference_engine, prompt, SamplingParams(temperature=0, max_tokens=12))))
    stop = greedy[0]  # what greedy decoding says first: as a stop token it ends the reply at once
    params = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop])
    assert tokens(asyncio.run(collect(reference_engine, prompt, params))) == [stop]
    held = asyncio.run(collect(reference_engine, prompt, SamplingParams(temperature=0, max_tokens=12,
                                                                        stop_token_ids=[stop], min_tokens=6)))
    ids = tokens(held)
    assert len(ids) >= 6 and stop not in ids[:6], ids
    assert held[-1].finish_reason == ("stop" if ids[-1] == stop else "length")

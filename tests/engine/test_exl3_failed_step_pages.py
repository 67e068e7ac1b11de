"""After a generation step fails (a lane partial that could not be made, an expert that could not be read), no cached
page is reused as a prompt's prefix: the failed forward may have written wrong keys and values into a page it
completed, and the client's retry sends the same prompt. Fake exllamav3 with its prompt cache."""

from __future__ import annotations

import asyncio

import fake_exllamav3 as F
import pytest
from specs import spec_for

from glm53.engine.interface import EngineError, SamplingParams
from glm53.fixture.exl3 import write_exl3_checkpoint

PROMPT = [(7 * i) % 150 + 3 for i in range(2 * F.PAGE_SIZE + 20)]  # two full pages and a tail


@pytest.fixture(scope="module", autouse=True)
def fake_exllamav3():
    with F.installed(prompt_cache=True) as mods:
        yield mods


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from glm53.engine.exl3_engine import Exl3Engine

    ck = write_exl3_checkpoint(tmp_path_factory.mktemp("exl3-failed-step") / "ck")
    e = Exl3Engine(ck, spec_for(ck, "stock", 0))
    e.load()
    yield e
    e.close()


def cached(engine, request_id: str) -> int:
    async def main():
        return [ev async for ev in engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4), request_id)]

    events = asyncio.run(main())
    return max(ev.cached_tokens or 0 for ev in events)


def test_a_failed_step_leaves_no_cached_prefix_behind(engine, monkeypatch):
    cached(engine, "first")
    assert cached(engine, "again") >= 2 * F.PAGE_SIZE  # the prefix cache works here
    step = engine.runtime.step

    def failing():
        raise RuntimeError("the CPU lane's partial could not be made")

    monkeypatch.setattr(engine.runtime, "step", failing)
    with pytest.raises(EngineError, match="partial could not be made"):
        cached(engine, "failed")
    monkeypatch.setattr(engine.runtime, "step", step)
    assert cached(engine, "retry") == 0
    assert cached(engine, "after") >= 2 * F.PAGE_SIZE  # and the cache fills again from the retry's clean pages

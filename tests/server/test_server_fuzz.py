"""Schemathesis fuzz of the app's own OpenAPI schema: valid and invalid requests to every operation, never a
5xx, never FastAPI's 422 `{"detail": ...}` shape. Bounded by count, never by the clock: a fixed number of
derandomized examples per operation, so a slow machine runs the same cases, only later.

It runs twice: with the scripted fake engine (many examples, fast: it fuzzes the HTTP layer) and with the
real ReferenceEngine behind a 48-token window (fewer examples: it catches what only the engine rejects)."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from server_support import FakeEngine

from glm53.engine.reference import ReferenceEngine
from glm53.planning import settings as S
from glm53.server import create_app

pytestmark = pytest.mark.slow  # end to end and long: make test runs it after the unit suite

SUPPRESS = list(HealthCheck)
# Schemathesis calls the app in-process as Starlette's test client does, under the name "testserver": a name the
# Host check (glm53.server.browser) serves only when told, as it would a LAN name.
SETTINGS = {"GLM53_ALLOWED_ORIGINS": "http://testserver"}


def fuzz(app, examples: int) -> dict[str, int]:
    """Calls made per operation."""
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    calls: dict[str, int] = {}
    for result in schema.get_all_operations():
        op = result.ok()
        strategy = op.as_strategy(generation_mode=GenerationMode.POSITIVE) | op.as_strategy(
            generation_mode=GenerationMode.NEGATIVE)

        @settings(max_examples=examples, deadline=None, suppress_health_check=SUPPRESS, database=None,
                  derandomize=True)
        @given(case=strategy)
        def check(case) -> None:
            response = case.call()
            key = f"{case.method} {case.path}"
            calls[key] = calls.get(key, 0) + 1
            assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
            content_type = response.headers.get("content-type") or [""]
            if content_type[0].startswith("application/json"):
                body = response.json()
                assert not (isinstance(body, dict) and "detail" in body), response.text[:500]
                if response.status_code >= 400:  # Anthropic's shape on its routes, OpenAI's elsewhere
                    shape = {"type", "error"} if case.path.startswith("/v1/messages") else {"error"}
                    assert set(body) == shape, response.text[:500]

        check()
    return calls


def test_fuzz_http_layer_with_fake_engine():
    eng = FakeEngine(lambda prompt, params: "Some thought.</think>\nAn answer.")
    eng.load()
    calls = fuzz(create_app(eng, S.load(environ=SETTINGS, dotenv=None)), examples=30)
    assert len(calls) >= 10, calls  # every route of the three APIs, the models list and health
    assert sum(n for n in calls.values() if n > 1) >= 200, calls  # the operations that take input, fuzzed


@pytest.fixture(scope="module")
def tiny_window_engine(hf_model_dir):
    engine = ReferenceEngine(hf_model_dir, context_length=48, max_running=16)
    engine.load()
    yield engine
    engine.close()


def test_fuzz_with_reference_engine(tiny_window_engine):
    calls = fuzz(create_app(tiny_window_engine, S.load(environ=SETTINGS, dotenv=None)), examples=8)
    assert sum(calls.values()) > 30, calls
    assert tiny_window_engine.stats()["running"] == 0

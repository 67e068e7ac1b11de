"""/stats shows the plan's speed forecast beside the measured decode rate (issue 38), through a real HTTP server on
the tiny CPU reference engine. The forecast is the plan's (glm53.planning.forecast, for the reference 3090 box);
the server only passes on what engine.stats() says, and the engine only carries what the composition handed it.
"""

from __future__ import annotations

import httpx
import pytest
from fakehost import HostSpec, write_host
from server_support import loaded_and_served

from glm53.planning import host as H
from glm53.planning import plan as P
from glm53.planning import settings as S
from glm53.planning import shape as M


@pytest.fixture(scope="module")
def forecast(tmp_path_factory) -> dict:
    root = write_host(tmp_path_factory.mktemp("host"), HostSpec())
    s = S.load(environ={"GLM53_MODEL_DIR": "/model"}, dotenv=None)
    return P.plan(H.read_host(root), M.DEFAULT_SHAPE, s).forecast


@pytest.fixture(scope="module")
def served(hf_model_dir, forecast):
    from glm53.engine.reference import ReferenceEngine

    engine = ReferenceEngine(hf_model_dir, max_running=2)
    engine.forecast = forecast  # what glm53.serve.choice.engine_for_plan does with the plan's
    with loaded_and_served(engine) as srv:
        yield srv


def test_stats_show_the_forecast_beside_the_measured_decode_rate(served, forecast):
    before = httpx.get(served.url + "/stats").json()["decode"]
    assert before["tok_s_per_stream"] is None and before["gaps_timed"] == 0  # nothing decoded yet
    assert before["forecast_mode"] == "fast" and before["forecast_tok_s"] == forecast["modes"]["fast"]["tok_s"]
    assert before["forecast"] == forecast and before["measured_over_forecast"] is None
    r = httpx.post(served.url + "/v1/completions", json={"prompt": "The weather", "max_tokens": 12,
                                                          "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    n = r.json()["usage"]["completion_tokens"]
    stats = httpx.get(served.url + "/stats").json()
    d = stats["decode"]
    assert d["gaps_timed"] == n - 1 >= 1  # the gaps after the first token: decode steps, not the prefill
    assert d["tok_s_per_stream"] > 0
    assert d["measured_over_forecast"] == pytest.approx(d["tok_s_per_stream"] / d["forecast_tok_s"], abs=1e-3)
    assert d["forecast"]["terms"]["link_GBps"]["source"].startswith("PCIe 4.0 x16 from host facts")
    metrics = httpx.get(served.url + "/metrics").text
    assert f"glm53_decode_forecast_tokens_per_second {float(d['forecast_tok_s'])}" in metrics
    assert "glm53_decode_tokens_per_second_per_stream " in metrics


def test_an_engine_without_a_forecast_says_so(reference_engine):
    d = reference_engine.stats()["decode"]
    assert d["forecast"] is None and d["forecast_tok_s"] is None and d["forecast_mode"] is None

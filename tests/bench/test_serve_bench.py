"""`glm53 bench serve`: concurrent streams through a `glm53 serve` the bench starts itself on the demo-shaped
checkpoint, and the arithmetic of its rates."""

from __future__ import annotations

import json

import pytest

from glm53.bench import serve_bench as SB
from glm53.cli import main


def test_rates_count_tokens_after_the_first_over_the_span():
    # Two streams of 11 tokens: each decodes its last 10 in 1 s; the second starts 0.5 s late.
    level = SB.Level(2, [SB.StreamedReply(0.0, 1.0, 11, "length", 64), SB.StreamedReply(0.5, 1.5, 11, "stop", 64)])
    assert level.per_stream_tps == pytest.approx(10.0) and level.slowest_tps == pytest.approx(10.0)
    assert level.aggregate_tps == pytest.approx(20 / 1.5)  # the late start counts against the aggregate
    assert level.ended_early(max_tokens=11) == 0 and level.ended_early(max_tokens=12) == 2
    result = SB.ConcurrencyResult(SB.ConcurrencyOptions(), "m", 8, [SB.Level(1, [SB.StreamedReply(0, 1, 11, "length", 64)]),
                                                                    level])
    assert result.ratio(result.levels[0]) == 1.0 and result.ratio(level) == pytest.approx(20 / 1.5 / 10)
    assert SB.REFERENCE_RATIO == pytest.approx(1.206, abs=1e-3)


def test_bad_levels_are_refused(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--concurrency", "1,two"])
    assert "not a comma-separated list of stream counts" in capsys.readouterr().err


def test_bench_serve_starts_its_server(hf_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GLM53_CACHE_DIR", str(tmp_path))
    out = tmp_path / "serve.json"
    assert main(["bench", "serve", "--model", str(hf_model_dir), "--concurrency", "1,2", "--prompt-tokens", "48",
                 "--max-tokens", "8", "--log-dir", str(tmp_path / "logs"), "--json", str(out)]) == 0
    captured = capsys.readouterr()
    assert "starting `glm53 serve`" in captured.err and "server ready" in captured.err
    assert (tmp_path / "logs" / "serve.log").read_text().count("glm53 ready") == 1
    doc = json.loads(out.read_text())
    assert [x["streams"] for x in doc["levels"]] == [1, 2] and doc["max_running"] == 8
    for level in doc["levels"]:
        runs = level["streams_detail"]
        assert len(runs) == level["streams"]
        # Same prompt length for every stream, tokens from usage within max_tokens.
        assert all(r["prompt_tokens"] == 48 and 1 <= r["tokens"] <= 8 for r in runs)
        assert level["aggregate_tok_s"] > 0 and level["per_stream_tok_s"] >= 0
    assert doc["levels"][0]["ratio_to_one"] == 1.0 and doc["reference"]["streams"] == 4
    lines = captured.out.splitlines()
    assert lines[0].startswith("bench serve: glm-5.3-flash, prompts of 48 tokens, max_tokens 8")
    assert lines[1].split()[:3] == ["streams", "aggregate", "tok/s"]
    assert [x.split()[0] for x in lines[2:4]] == ["1", "2"] and "1.00x" in lines[2]

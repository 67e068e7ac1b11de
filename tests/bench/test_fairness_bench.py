"""`glm53 bench fairness` through a `glm53 serve` it starts on the demo-shaped checkpoint with two decode slots: a
short request alone and beside two replies without max_tokens; the report and its JSON say the same. No timings are
asserted: they are the machine's."""

from __future__ import annotations

import json

from glm53.cli import main


def test_bench_fairness_starts_its_server_and_reports(hf_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GLM53_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("GLM53_MAX_CONCURRENCY", "2")
    monkeypatch.setenv("GLM53_CONTEXT", "1024")
    out = tmp_path / "fairness.json"
    assert main(["bench", "fairness", "--model", str(hf_model_dir), "--unbounded", "2", "--rounds", "1",
                 "--log-dir", str(tmp_path / "logs"), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["max_running"] == 2 and doc["options"]["unbounded"] == 2
    assert len(doc["alone_s"]) == len(doc["beside_s"]) == len(doc["beside_first_s"]) == 1
    assert all(0 < f <= w for f, w in zip(doc["beside_first_s"], doc["beside_s"], strict=True))
    assert doc["slice_s"] >= 2.0 and doc["long_running"] == [True] and doc["yielded"] >= 1  # a slot was yielded to it
    assert "beside 2 replies without max_tokens (2 decode slots" in text and "still running at each answer: yes" in text


def test_bench_fairness_refuses_replies_that_end_before_they_all_stream(hf_model_dir, tmp_path, monkeypatch, capsys):
    """A context so short that the cache holds one reply's pages: the unbounded replies run in turn and end; the
    bench says so and names the fix at once instead of waiting for them to stream together."""
    monkeypatch.setenv("GLM53_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("GLM53_MAX_CONCURRENCY", "2")
    monkeypatch.setenv("GLM53_CONTEXT", "256")
    assert main(["bench", "fairness", "--model", str(hf_model_dir), "--unbounded", "2", "--rounds", "1",
                 "--log-dir", str(tmp_path / "logs")]) != 0
    captured = capsys.readouterr()
    said = captured.out + captured.err
    assert "reached the end of the context" in said and "GLM53_CONTEXT" in said

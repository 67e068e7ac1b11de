"""`glm53 bench agent`: the scripted session, the history it sends back, the targets' arithmetic, and whole runs
over HTTP against a real `glm53 serve` on the demo-shaped checkpoint (the CPU engine has no prefix cache, so
its cached_tokens are 0: present, counted, and the share target printed as a FAIL)."""

from __future__ import annotations

import json

import pytest

from glm53.bench import agent as A
from glm53.bench.agent_script import KINDS, ORDER, TOOLS, Script
from glm53.bench.served import BenchError, ServeOptions, Server, Streamed, served
from glm53.cli import main


def test_the_script_is_deterministic_and_only_the_agent_is_shared():
    a, b, other = Script(1), Script(1), Script(2)
    assert a.task() == b.task() and a.step(3, 2000).output == b.step(3, 2000).output
    assert a.task() != other.task() and a.step(3, 2000).output != other.step(3, 2000).output
    # One agent, many sessions: the system prompt does not depend on the seed.
    assert Script.system_prompt(3000) == Script.system_prompt(3000) and len(Script.system_prompt(3000)) >= 3000
    assert a.cold_text(4000, "x") != a.cold_text(4000, "y") and not a.cold_text(4000, "x").startswith(a.task()[:20])
    assert {k.tool for k in KINDS.values()} <= {t["function"]["name"] for t in TOOLS}
    assert set(ORDER) == set(KINDS)
    for i in range(len(ORDER)):
        step = a.step(i, 1500)
        assert 1200 <= len(step.output) <= 4000, (step.kind, len(step.output))
        assert step.tool == KINDS[step.kind].tool and json.dumps(step.arguments)


def _reply(content: str = "", reasoning: str = "", calls: int = 0) -> Streamed:
    got = Streamed(0.1, 0.5, 100, 8, 90, "tool_calls" if calls else "length", content, reasoning)
    got.tool_calls = [{"id": f"call_{i}", "type": "function", "function": {"name": "grep", "arguments": "{}"}}
                      for i in range(calls)]
    return got


def test_the_reply_goes_back_as_a_client_sends_it():
    got = _reply("Looking at the file.", "the test fails because", calls=0)
    assert A._reply_message(got, keep_reasoning=False) == {"role": "assistant", "content": "Looking at the file."}
    assert A._reply_message(got, keep_reasoning=True)["reasoning_content"] == "the test fails because"
    called = A._reply_message(_reply("", "r", calls=2), keep_reasoning=False)
    assert called["content"] is None and [c["id"] for c in called["tool_calls"]] == ["call_0", "call_1"]
    step = Script(1).step(1, 500)
    # The model called: the step's output answers its first call, the others are refused.
    shape, msgs = A._step_messages(_reply(calls=2), step)
    assert shape == "tool" and [m["tool_call_id"] for m in msgs] == ["call_0", "call_1"]
    assert msgs[0]["content"] == step.output and msgs[1]["content"] == A.NOT_RUN
    # It answered in text: the client reports the call it ran and the output, as a user message.
    shape, msgs = A._step_messages(_reply("text"), step)
    assert shape == "user" and msgs[0]["role"] == "user" and step.output in msgs[0]["content"]
    assert step.tool in msgs[0]["content"]


def _result(turns: list[tuple[int, int | None, float]], cold_rate: float = 1000.0) -> A.AgentResult:
    r = A.AgentResult(A.AgentOptions(), "m", cold_prompt_tokens=int(cold_rate), cold_cached_tokens=0, cold_ttft_s=1.0)
    for i, (prompt, cached, ttft) in enumerate(turns, 1):
        t = A.Turn(i, "user", prompt, cached, ttft, 10.0, 8, "length", 0, None, None)
        t.cold_s = t.new_tokens / cold_rate
        r.turns.append(t)
    return r


def test_targets_pass_and_fail_on_the_issue_s_numbers():
    # Turn 1 cold; then 1,000 new tokens a turn (1 s cold): the limits are 1.8 s (median) and 3.3 s (any turn).
    good = _result([(10_000, 0, 10.0), (11_000, 10_000, 1.2), (12_000, 11_000, 1.7), (13_000, 12_000, 1.0)])
    v = {x.name: x for x in A.verdicts(good)}
    assert all(x.ok for x in v.values()), v
    assert "0.9" in v["cached_share"].text and "turn 2" in v["median_ttft"].text
    slow = _result([(10_000, 0, 10.0), (11_000, 10_000, 2.0), (12_000, 11_000, 1.9), (13_000, 12_000, 3.4)])
    v = {x.name: x for x in A.verdicts(slow)}
    assert not v["median_ttft"].ok and not v["max_ttft"].ok and "turn 4" in v["max_ttft"].text
    # Reuse that covers only half the history fails the share, however fast the turns are.
    poor = _result([(10_000, 0, 10.0), (20_000, 10_000, 0.1), (30_000, 15_000, 0.1)])
    assert not {x.name: x for x in A.verdicts(poor)}["cached_share"].ok
    missing = _result([(10_000, None, 10.0), (11_000, None, 1.0)])
    share = {x.name: x for x in A.verdicts(missing)}["cached_share"]
    assert not share.ok and "no usage.prompt_tokens_details.cached_tokens" in share.text


def test_options_that_cannot_fit_are_refused_with_the_fix():
    with pytest.raises(BenchError, match="lower --target-tokens or raise GLM53_CONTEXT"):
        A.AgentOptions(target_tokens=8000).check(context=4096)
    with pytest.raises(BenchError, match="--turns must be at least 2"):
        A.AgentOptions(turns=1).check(context=0)
    with pytest.raises(BenchError, match="lower --system-tokens"):
        A.AgentOptions(target_tokens=1000, system_tokens=900).check(context=0)
    assert A.common_prefix([1, 2, 3, 4], [1, 2, 5]) == 2 and A.common_prefix([], [1]) == 0


def test_url_and_a_started_server_s_flags_exclude_each_other(capsys):
    with pytest.raises(SystemExit, match="with --url the server is already running"):
        main(["bench", "agent", "--url", "http://127.0.0.1:1", "--model", "/m"])


@pytest.fixture(scope="module")
def demo_server(hf_model_dir, tmp_path_factory):
    """`glm53 serve` on the demo-shaped checkpoint, started the way the bench starts its own."""
    logs = tmp_path_factory.mktemp("agent-serve")
    with served(ServeOptions(model=str(hf_model_dir), env={"GLM53_CACHE_DIR": str(logs)}, log_dir=logs,
                             ready_timeout_s=180)) as server:
        yield server


# Small enough for CI's 2 cores: the demo tokenizer's 3,072-token vocabulary makes the tool block alone ~2,000
# tokens, so the session grows from there to 3,000 in three turns.
SMALL = ["--target-tokens", "3000", "--turns", "3", "--reply-tokens", "8", "--system-tokens", "50",
         "--cold-tokens", "600"]


def _check_session(doc: dict, turns: int) -> None:
    assert len(doc["turns"]) == turns
    prev = None
    for t in doc["turns"]:
        # cached_tokens is reported on every turn (the CPU engine reuses its last request's cache when the prompt
        # starts with all of it).
        assert isinstance(t["cached_tokens"], int) and 0 <= t["cached_tokens"] <= t["prompt_tokens"]
        assert t["new_tokens"] == t["prompt_tokens"] - t["cached_tokens"]
        assert t["ttft_s"] > 0 and 1 <= t["completion_tokens"] <= 8 and t["cold_s"] > 0
        if prev is not None:
            # The history came back token for token: this prompt starts with the whole previous one.
            assert t["prompt_tokens"] > prev["prompt_tokens"]
            assert t["prev_prompt_tokens"] == prev["prompt_tokens"] == t["same_prefix"], t
        prev = t
    assert doc["cold"]["tok_s"] > 0 and doc["cold"]["cached_tokens"] == 0
    assert set(doc["targets"]) == {"cached_share", "median_ttft", "max_ttft"}
    share = doc["summary"]["cached_share"]
    assert 0.0 <= share < 1.0 and doc["targets"]["cached_share"]["ok"] == (doc["summary"]["cached_share_from_turn_2"]
                                                                         >= 0.9)
    assert doc["server_stats"]["after"]["engine"] == "reference-cpu"


def test_agent_session_over_http(demo_server, tmp_path, capsys):
    out = tmp_path / "agent.json"
    assert main(["bench", "agent", "--url", demo_server.url, *SMALL, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    doc = json.loads(out.read_text())
    _check_session(doc, 3)
    assert not doc["options"]["keep_reasoning"]
    lines = text.splitlines()
    assert lines[0].startswith("bench agent: glm-5.3-flash, 3 turns to 3000 tokens, reasoning dropped")
    assert lines[2].split()[:6] == ["turn", "step", "prompt", "cached", "new", "same"]
    assert [x.split()[:2] for x in lines[3:6]] == [["1", "task"], ["2", "user"], ["3", "user"]]
    assert f"cached share of all prompt tokens: {doc['summary']['cached_share']:.3f}" in text
    for name in ("cached_share", "median_ttft", "max_ttft"):
        assert any(x.startswith(f"target {name}: ") and (": PASS: " in x or ": FAIL: " in x) for x in lines), name
    # Each turn's reply had reasoning (closed by max_reasoning_tokens) and the step's output made the prompt grow.
    assert all(t["reasoning_chars"] > 0 for t in doc["turns"])


def test_agent_session_keeping_reasoning(demo_server, tmp_path, capsys):
    out = tmp_path / "agent-kept.json"
    assert main(["bench", "agent", "--url", demo_server.url, *SMALL, "--turns", "2", "--seed", "2", "--keep-reasoning",
                 "--json", str(out)]) == 0
    assert "reasoning kept by the client" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    _check_session(doc, 2)
    assert doc["options"]["keep_reasoning"] and doc["options"]["seed"] == 2


def test_a_server_that_is_not_there_is_named(capsys):
    assert main(["bench", "agent", "--url", "http://127.0.0.1:9", "--ready-timeout", "1"]) == 1
    assert "http://127.0.0.1:9 was not ready after 1 s" in capsys.readouterr().err


def test_server_reports_its_context(demo_server):
    assert isinstance(demo_server, Server) and demo_server.context_length == 4096
    assert demo_server.count_tokens("hello world") >= 2


def test_findings_name_where_reuse_was_lost():
    r = _result([(10_000, 0, 10.0), (11_000, 9_500, 1.0), (12_000, 10_400, 1.0)])
    r.turns[1].prev_prompt_tokens, r.turns[1].same_prefix = 10_000, 10_000
    r.turns[2].prev_prompt_tokens, r.turns[2].same_prefix = 11_000, 6_000
    notes = A.findings(r)
    assert any(n.startswith("turn 3: the history differs from the previous prompt from token 6000 of 11000")
               for n in notes)
    assert any("prefilled a median 550 tokens of the previous prompt again" in n for n in notes)
    assert not any("undercounts" in n for n in notes)
    # Fast follow-ups with nothing reported cached: the TTFTs give the count away.
    quiet = _result([(10_000, 0, 10.0), (11_000, 0, 1.0), (12_000, 0, 1.0)])
    assert any("cached_tokens undercounts" in n for n in A.findings(quiet))

"""bench decode's GPU-free paths: a job's streamed results counted as exllamav3 gives them (held tokens, several
tokens a result, a stop token in the final "held"), and --baseline's paired windows of this code and an earlier
commit's, with the per-window runner injected."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
import types
from pathlib import Path

import fake_exllamav3 as F
import pytest
import torch

from glm53.bench import decode as B
from glm53.bench import decode_baseline as P
from glm53.cli import build_parser

REPO = Path(__file__).resolve().parents[2]


class ScriptedGenerator:
    """Hands out scripted iterate() batches, a millisecond apart, as a generator streaming one job would."""

    def __init__(self, batches: list[list[dict]]):
        self.batches = list(batches)

    def enqueue(self, job) -> None:
        self.job = job

    def num_remaining_jobs(self) -> int:
        return len(self.batches)

    def iterate(self) -> list[dict]:
        time.sleep(0.001)
        return self.batches.pop(0)


def ids(*xs: int) -> torch.Tensor:
    return torch.tensor([list(xs)], dtype=torch.long)


def run(batches: list[list[dict]]) -> dict:
    from glm53.exl3.runtime import Runtime

    runner = B._Runner.__new__(B._Runner)  # no model: the generator is scripted
    with F.installed() as mods:
        runner.runtime, runner.tiered = Runtime(Path("."), mods["exllamav3"], None), None
        runner.runtime.generator = ScriptedGenerator(batches)
        return runner.run([1, 2, 3], 8, seed=0)


def streaming(**kw) -> dict:
    return {"stage": "streaming", "eos": False, **kw}


def test_held_tokens_multi_token_results_and_a_held_stop_token_are_counted():
    got = run([[{"stage": "prefill", "curr_progress": 2, "max_progress": 2}],
               [streaming(token_ids=ids(5), text="a")],
               [streaming()],  # held: its text ends in an incomplete character
               [streaming()],
               [streaming(token_ids=ids(6, 7, 8), text="\u00e9x")],
               [streaming(eos=True, token_ids=ids(9), text="y", new_tokens=6, time_prefill=0.0,
                          held={"token_ids": ids(2)})]])
    assert got["tokens"] == [5, 6, 7, 8, 9, 2]
    assert got["decoded_tokens"] == 5  # all but the first release's one
    assert got["decode_tok_s"] > 0 and math.isfinite(got["decode_tok_s"]) and got["prefill_s"] > 0


def test_a_first_release_of_several_tokens_is_not_timed_as_decode():
    got = run([[streaming(token_ids=ids(5, 6, 7))], [streaming(token_ids=ids(8))],
               [streaming(eos=True, token_ids=ids(9), new_tokens=5, time_prefill=0.25)]])
    assert got["decoded_tokens"] == 2 and got["prefill_s"] == 0.25  # exllamav3's own, the release came late
    everything_held = run([[streaming()], [streaming(eos=True, token_ids=ids(1, 2, 3), new_tokens=3)]])
    assert everything_held["tokens"] == [1, 2, 3] and everything_held["decoded_tokens"] == 0
    assert math.isnan(everything_held["decode_tok_s"])  # nothing to time: said, not a crash


def test_a_job_without_a_final_result_is_an_error():
    with pytest.raises(RuntimeError, match="without a final result"):
        run([[streaming(token_ids=ids(5))]])


def decode_args(*extra: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "decode", "--modes", "exact,fast,nvme-exact", "--tokens", "32",
                                      "--windows", "1", *extra])


def doc(scale: float) -> dict:
    return {"stock_decode_tok_s": 100.0 * scale, "same_tokens": True,
            "modes": {m: {"decode_tok_s": v * scale} for m, v in (("exact", 50.0), ("fast", 80.0),
                                                                   ("nvme-exact", 20.0))}}


def test_paired_windows_alternate_the_sides_and_take_the_median_of_their_ratios(tmp_path, capsys):
    calls = []
    drift = iter([1.0, 0.98, 0.5, 0.5, 2.0, 1.9])  # the machine's speed moves between pairs, not within one

    def fake(side: str, argv: list[str]) -> dict:
        calls.append((side, argv))
        return doc(next(drift))

    res = P.paired(fake, decode_args(), tmp_path, 3, log=lambda m: None)
    assert [s for s, _ in calls] == ["current", "baseline", "baseline", "current", "current", "baseline"]
    # Each side's window asks for its own JSON under the shared --work, with the kept checkpoint and store.
    for side, argv in calls:
        assert argv[:2] == ["bench", "decode"] and "--keep" in argv and argv[argv.index("--work") + 1] == str(tmp_path)
        assert argv[argv.index("--json") + 1].endswith(f"-{side}.json")
    ratios = res["modes"]["exact"]["ratios"]
    assert ratios == pytest.approx([1 / 0.98, 1.0, 2.0 / 1.9])
    assert res["modes"]["exact"]["over_baseline"] == pytest.approx(1 / 0.98)
    assert set(res["modes"]) == {"stock", "exact", "fast", "nvme-exact"} and res["same_tokens"]
    res.update(commit="b38dea7" + "0" * 33)
    text = P.report(res, "b38dea7")
    assert "3 paired windows" in text and "this / b38dea7 1.020, median of paired windows" in text
    # Over each process's own stock run the drift cancels: every mode ran at the same share of stock on both sides.
    assert res["modes"]["exact"]["ratios_of_stock"] == pytest.approx([1.0, 1.0, 1.0])
    assert "over each process's stock 1.000" in text and res["modes"]["stock"]["over_baseline_of_stock"] is None


@pytest.mark.skipif(subprocess.run(["git", "cat-file", "-e", "HEAD"], cwd=REPO, capture_output=True).returncode != 0,
                    reason="no git history")
def test_the_command_orchestrates_without_a_gpu_and_writes_json(tmp_path, capsys):
    sides = []

    def fake(side: str, argv: list[str]) -> dict:
        sides.append(side)
        return doc(1.0 if side == "current" else 0.99)

    args = decode_args("--baseline", "HEAD", "--baseline-windows", "2", "--work", str(tmp_path),
                       "--json", str(tmp_path / "paired.json"))
    assert P.cmd_bench_decode_baseline(args, run=fake) == 0
    assert sides == ["current", "baseline", "baseline", "current"]
    out = capsys.readouterr().out
    assert "this / HEAD 1.010" in out
    assert (tmp_path / "paired.json").exists()
    bad = decode_args("--baseline", "no-such-rev")
    assert P.cmd_bench_decode_baseline(bad, run=fake) == 2
    assert "not a commit" in capsys.readouterr().err


OLD = "b38dea7"


@pytest.mark.skipif(subprocess.run(["git", "cat-file", "-e", f"{OLD}:glm53/engine/bench.py"], cwd=REPO,
                                   capture_output=True).returncode != 0, reason=f"{OLD} is not in this clone")
def test_each_window_passes_only_flags_the_commit_before_this_work_has(tmp_path, monkeypatch):
    """Parse one window's arguments with b38dea7's own bench decode parser, as its process will."""
    source = subprocess.run(["git", "show", f"{OLD}:glm53/engine/bench.py"], cwd=REPO, capture_output=True,
                            text=True, check=True).stdout
    old = types.ModuleType("old_bench")
    monkeypatch.setitem(sys.modules, "old_bench", old)  # its dataclasses look their module up
    exec(compile(source, "old_bench.py", "exec"), old.__dict__)
    parser = argparse.ArgumentParser()
    old.register_bench(parser.add_subparsers(dest="bench"))
    args = decode_args("--slots", "32", "--emulate-disk-GBps", "6", "--store-dir", "/dev/shm", "--cpu-threads", "4")
    argv = P.window_args(args, tmp_path, tmp_path / "w.json")
    parsed = parser.parse_args(argv[1:])
    assert parsed.modes == "exact,fast,nvme-exact" and parsed.slots == 32 and parsed.keep
    assert parsed.work == str(tmp_path) and parsed.emulate_disk_GBps == 6.0 and parsed.windows == 1
    assert set(parsed.modes.split(",")) <= set(old.MODES)


def test_kept_windows_are_reused_so_a_comparison_can_span_calls(tmp_path):
    ran = []

    def fake(side: str, argv: list[str]) -> dict:
        ran.append(side)
        out = Path(argv[argv.index("--json") + 1])
        out.write_text(json.dumps(doc(1.0)))  # as the window's own process writes it
        return doc(1.0)

    args = decode_args("--keep", "--work", str(tmp_path))
    P.paired(fake, args, tmp_path, 1, log=lambda m: None)
    assert ran == ["current", "baseline"]
    res = P.paired(fake, args, tmp_path, 2, log=lambda m: None)  # a later call: only pair 1 runs
    assert ran == ["current", "baseline", "baseline", "current"] and len(res["pairs"]) == 2


def test_a_baseline_tree_without_bench_decode_is_refused(tmp_path, capsys):
    args = decode_args("--baseline", "b38dea7", "--baseline-tree", str(tmp_path))
    assert P.cmd_bench_decode_baseline(args, run=lambda side, argv: doc(1.0)) == 2
    assert "git archive b38dea7 | tar -x -C" in capsys.readouterr().err
    (tmp_path / "glm53" / "engine").mkdir(parents=True)
    (tmp_path / "glm53" / "engine" / "bench.py").write_text("")  # b38dea7's layout
    assert P.cmd_bench_decode_baseline(args, run=lambda side, argv: doc(1.0)) == 0


def test_a_window_process_runs_this_codes_glm53_and_its_failure_is_said(tmp_path):
    """The real per-window process on this CPU machine: this code's parser takes the window's flags, and bench
    decode then stops for want of CUDA; the runner says which side failed and why."""
    run = P.subprocess_runner(REPO, REPO)
    with pytest.raises(RuntimeError, match="current window failed \\(exit 2\\): .*bench decode needs"):
        run("current", P.window_args(decode_args("--slots", "4"), tmp_path, tmp_path / "w.json"))


def _lane_runner(window: int) -> tuple[B._Runner, list[int]]:
    """A runner whose every decoded token is one decode layer step told to a real LaneJudge on a made-up clock."""
    from glm53.step.lane_judge import LaneJudge

    now = [0.0]
    judge = LaneJudge(clock=lambda: now[0], window=window, pairs=2)
    runner = B._Runner.__new__(B._Runner)
    runner.tiered = types.SimpleNamespace(stepper=types.SimpleNamespace(lane=object(), lane_judge=judge, prestage=None))
    calls: list[int] = []

    def run(prompt, tokens, seed):
        calls.append(tokens)
        for _ in range(tokens):
            judge.started(True)
            now[0] += 0.001 if judge.offer() else 0.002  # offering the lane halves a step: it is kept
            judge.done(8, 2)
        return {}

    runner.run = run
    return runner, calls


def test_a_lane_mode_warms_up_until_its_judge_rules():
    runner, calls = _lane_runner(window=8)
    # 2 pairs of 8-step windows: the verdict falls at the 32nd step, within the third 12-token chunk.
    assert runner.judged([1], 12, limit=1000) == 36 and calls == [12, 12, 12]
    judge = runner.tiered.stepper.lane_judge
    assert not judge.in_trial and judge.kept
    assert runner.judged([1], 12, limit=1000) == 0  # ruled already: nothing more


def test_an_exact_runner_warms_up_until_the_prestage_judge_rules():
    from glm53.step.prestage import Prestage, PrestageJudge

    now = [0.0]
    pre = Prestage(24, 8, judge=PrestageJudge(clock=lambda: now[0], window=8, pairs=2))
    runner = B._Runner.__new__(B._Runner)
    runner.tiered = types.SimpleNamespace(stepper=types.SimpleNamespace(lane=None, prestage=pre))
    calls: list[int] = []

    def run(prompt, tokens, seed):
        calls.append(tokens)
        for _ in range(tokens):
            pre.judge.started(True)
            now[0] += 0.002 if pre.judge.offer() else 0.001  # the prestage makes steps slower: set aside
            pre.judge.done(8, 2)
        return {}

    runner.run = run
    assert runner.judged([1], 12, limit=1000) == 36 and calls == [12, 12, 12]
    assert not pre.judge.in_trial and pre.judge.kept is False


def test_the_judge_warm_up_stops_at_its_limit_and_a_runner_without_a_lane_skips_it():
    runner, calls = _lane_runner(window=100)
    assert runner.judged([1], 16, limit=40) == 48 and calls == [16, 16, 16]
    assert runner.tiered.stepper.lane_judge.in_trial
    plain = B._Runner.__new__(B._Runner)
    plain.tiered = None
    assert plain.judged([1], 16, limit=40) is None
    plain.tiered = types.SimpleNamespace(stepper=types.SimpleNamespace(lane=None, prestage=None))
    assert plain.judged([1], 16, limit=40) is None


def test_every_tiered_mode_starts_its_windows_after_as_many_warm_up_tokens():
    """The thirty-third session's grid: fast's judges took 96 tokens against exact's 32, and its warmer cache (2-5
    points of hit rate) made fast 1.03-1.06x exact with its lane set aside."""
    assert B.even_warmup({"exact": 32, "fast": 96, "nvme-exact": None}) == {"exact": 64, "nvme-exact": 96}
    assert B.even_warmup({"exact": 32, "fast": 32}) == {}
    assert B.even_warmup({"exact": None}) == {} and B.even_warmup({}) == {}


def test_the_host_probe_says_how_much_added_host_time_reached_the_token():
    """Two layer steps a token, 100 us more host each: a token 0.2 ms longer is all of it on the critical path, one
    0.05 ms longer a quarter. The windows' shares are a median, as the paired ratios are."""
    rows = [{"name": n, "window": w, "decode_tok_s": tok} for n, w, tok in [
        ("exact", 0, 100.0), ("exact+host100us", 0, 1 / (0.01 + 0.0002)),
        ("exact", 1, 100.0), ("exact+host100us", 1, 1 / (0.01 + 0.00005)),
        ("exact", 2, 50.0), ("exact+host100us", 2, 1 / (0.02 + 0.0001)),
        ("stock", 0, 300.0)]]
    got = B.host_probe(rows, "exact", "exact+host100us", 100, layer_steps=2)
    assert got["critical_share"] == pytest.approx(0.5)
    assert got["added_host_ms_per_token"] == pytest.approx(0.2)
    assert got["paired_over_plain"] == pytest.approx(0.01 / 0.01005)
    assert math.isnan(B.host_probe(rows[-1:], "exact", "exact+host100us", 100, 2)["critical_share"])


def test_the_delayed_stepper_spends_the_time_before_it_plans():
    calls = []
    stepper = types.SimpleNamespace(resolve=lambda *a, **k: calls.append((a, k)) or "slots")
    B.delay_planning(stepper, 2000)
    t0 = time.perf_counter()
    assert stepper.resolve(3, ids=[1]) == "slots"
    assert time.perf_counter() - t0 >= 0.002 and calls == [((3,), {"ids": [1]})]

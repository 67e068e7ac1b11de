"""`glm53 bench host-step` at tiny counts: its report parses and its JSON holds what the report says. No timings are
asserted: the benchmark's numbers are the machine's, not the code's."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from glm53.cli import main

TINY = ["--layers", "2", "--experts", "32", "--top-k", "4", "--slots", "4", "--staging", "33", "--steps", "12",
        "--warmup", "4", "--bsz", "1,2", "--top", "3"]
RUN = re.compile(r"^(this|baseline) bsz (\d+): median ([\d.]+) us, p90 ([\d.]+) us per layer step "
                 r"\((\d+) layer steps, VRAM hit rate ([\d.]+)\)$")
ROW = re.compile(r"^ +([\d.]+)% +([\d.]+) us  \S")
RATIO = re.compile(r"^ratio bsz (\d+): this / baseline = ([\d.]+) / ([\d.]+) us = ([\d.]+) \(([\d.]+)x fewer")
REPO = Path(__file__).resolve().parents[2]


def _bench(capsys, *extra: str) -> list[str]:
    assert main(["bench", "host-step", *TINY, *extra]) == 0
    return capsys.readouterr().out.splitlines()


def test_report_lines_parse(capsys):
    lines = _bench(capsys, "--baseline", "none")
    runs = [m.groups() for m in map(RUN.match, lines) if m]
    assert [(who, int(b)) for who, b, *_ in runs] == [("this", 1), ("this", 2)]
    for _, _, median, p90, steps, hit in runs:
        assert 0 < float(median) <= float(p90)
        assert int(steps) == 12 * 2  # every timed step of every layer
        assert 0 <= float(hit) <= 1
    assert sum(1 for line in lines if line.strip().startswith("by call from resolve")) == 2
    rows = [m for m in map(ROW.match, lines) if m]
    assert len(rows) == 2 * 2 * 3  # two tables of --top rows per batch size
    assert not any(line.startswith("ratio") for line in lines)


def test_json_to_stdout(capsys):
    lines = _bench(capsys, "--baseline", "none", "--top", "40", "--json")
    doc = json.loads("\n".join(lines))
    assert doc["options"]["experts"] == 32 and doc["options"]["bsz"] == [1, 2]
    assert [r["bsz"] for r in doc["runs"]] == [1, 2]
    for r in doc["runs"]:
        assert r["layer_steps"] == 24 and r["median_us"] > 0
        by_call = r["breakdown"]["by_call"]
        # Every direct callee and resolve's own time fit in 40 rows, and they add up to resolve's whole.
        assert "resolve (own time)" in [row["name"] for row in by_call]
        assert sum(row["share"] for row in by_call) == pytest.approx(1.0, abs=0.02)


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


def _in_git_checkout() -> bool:
    try:
        return _git("rev-parse", "--is-inside-work-tree") == "true"
    except (OSError, subprocess.CalledProcessError):
        return False


needs_git = pytest.mark.skipif(not _in_git_checkout(), reason="not a git checkout")
# The "baseline lacks it" tests reach back to commits before the benchmark: a shallow clone has no such commit (its
# oldest commit shows every file as added).
needs_history = pytest.mark.skipif(not _in_git_checkout() or _git("rev-parse", "--is-shallow-repository") == "true",
                                   reason="needs the git history (not a checkout, or a shallow clone)")


@needs_history
def test_a_baseline_without_the_command_is_said_and_skipped(capsys):
    root = _git("rev-list", "--max-parents=0", "HEAD").splitlines()[0]
    lines = _bench(capsys, "--baseline", root, "--bsz", "1")
    assert any("lacks `glm53 bench host-step`" in line for line in lines)
    assert [m.group(1) for m in map(RUN.match, lines) if m] == ["this"]
    assert not any(line.startswith("ratio") for line in lines)


@needs_git
def test_baseline_from_a_worktree_prints_the_ratio(capsys):
    if subprocess.run(["git", "cat-file", "-e", "HEAD:glm53/bench/host_step.py"], cwd=REPO).returncode:
        pytest.skip("HEAD has no host-step benchmark yet")
    before = _git("worktree", "list")
    lines = _bench(capsys, "--baseline", "HEAD", "--bsz", "1")
    assert [m.group(1) for m in map(RUN.match, lines) if m] == ["this", "baseline"]
    ratios = [m.groups() for m in map(RATIO.match, lines) if m]
    assert len(ratios) == 1 and ratios[0][0] == "1"
    _, this, base, r, _ = ratios[0]
    assert float(r) == pytest.approx(float(this) / float(base), rel=0.05, abs=1e-3)
    assert _git("worktree", "list") == before  # the temporary worktree is gone


# ---- --nvme: the nvme modes' path on a record store packed for the run --------------------------------------------

NVME = ["--nvme", "--store-threads", "2"]
NVME_LINE = re.compile(r"^  resolve \(plan\) median ([\d.]+) us, p90 ([\d.]+); ahead median ([\d.]+) us, p90 ([\d.]+); "
                       r"blocked on reads \(not counted\) mean ([\d.]+) us, in (\d+) of (\d+) steps$")


def test_nvme_report_and_json(capsys, tmp_path):
    out = tmp_path / "nvme.json"
    lines = _bench(capsys, *NVME, "--baseline", "none", "--top", "40", "--json", str(out))
    assert any(line.startswith("nvme: RAM tier 0.47 of all experts") for line in lines)
    runs = [m.groups() for m in map(RUN.match, lines) if m]
    assert [(who, int(b)) for who, b, *_ in runs] == [("this", 1), ("this", 2)]
    nvme_lines = [m.groups() for m in map(NVME_LINE.match, lines) if m]
    assert len(nvme_lines) == 2 and all(int(steps) == 24 for *_, steps in nvme_lines)
    doc = json.loads(out.read_text())
    assert doc["nvme"] == {"ram_share": 0.47, "recall": 0.575, "store_threads": 2}
    assert "emulation" not in doc and not any("emulated" in r for r in doc["runs"])  # only when asked for
    assert not any(line.startswith("emulated") for line in lines)
    for r in doc["runs"]:
        assert r["layer_steps"] == 24 and 0 < r["median_us"] <= r["p90_us"]
        # Each layer step is what runs before launch (resolve(), with the lookahead when it runs inside) and after
        # it (the deferred admissions, and the lookahead when a step held it back), less the time blocked on reads;
        # before launch is never less than resolve's own accounting of its host time.
        assert r["mean_us"] == pytest.approx(r["before_launch"]["mean_us"] + r["after_launch"]["mean_us"])
        assert r["before_launch"]["mean_us"] >= r["resolve"]["mean_us"] - 1e-6
        assert r["ahead"]["median_us"] > 0 and r["store_wait"]["mean_us"] >= 0
        store = r["store"]
        assert store["demand_reads_per_step"] + store["prefetch_reads_per_step"] > 0  # RAM is a cache: reads happen
        assert store["prefetch"]["issued"] > 0
        assert 0.3 < r["lookahead_recall"] < 0.85
        names = [row["name"] for row in r["breakdown"]["by_call"]]
        assert "resolve (own time)" in names and any(n.startswith("ahead > ") for n in names)
        # The rows add up to the whole: the blocked time leaves the rows and the total by the same (profiler's) clock.
        assert sum(row["share"] for row in r["breakdown"]["by_call"]) == pytest.approx(1.0, abs=0.02)


EMULATED = ["--disk-ms-per-record", "2", "--gpu-ms-per-layer", "0.5", "--emulated-runs", "2"]
READER_LINE = re.compile(r"^  bsz 1 (default) \((\d+) guess reads at once[^)]*\): ([\d.]+) ms per "
                         r"step \(store waits ([\d.]+), host before launch ([\d.]+), GPU ([\d.]+)\); store busy "
                         r"([\d.]+), load ([\d.]+), a right guess saving ([\d.]+) of a read, guess floor ([\d.]+)$")
GUESS_LINE = re.compile(r"^    per step: ([\d.]+) demand and ([\d.]+) guess reads; guesses issued ([\d.]+), in time "
                        r"([\d.]+), late ([\d.]+) \(under way ([\d.]+)\), wasted ([\d.]+); demand misses ([\d.]+)$")


def test_nvme_on_an_emulated_disk_and_gpu(capsys, tmp_path):
    from glm53.bench import emulated_disk as E

    if E.problem():
        pytest.skip(E.problem())
    out = tmp_path / "emulated.json"
    lines = _bench(capsys, *NVME, *EMULATED, "--bsz", "1", "--baseline", "none", "--json", str(out))
    assert E.set_rate(0.0) == 0.0  # left off
    assert [m.group(1) for m in map(RUN.match, lines) if m] == ["this"]  # the host figures as before, then these
    assert any(line.startswith("emulated disk and GPU: a record (") for line in lines)
    readers = [m.groups() for m in map(READER_LINE.match, lines) if m]
    assert [(name, int(at_once)) for name, at_once, *_ in readers] == [("default", 1)]
    assert len([m for m in map(GUESS_LINE.match, lines) if m]) == 1
    doc = json.loads(out.read_text())
    assert doc["emulation"] == {"disk_ms_per_record": 2.0, "gpu_ms_per_layer": 0.5, "runs": 2}
    (run,) = doc["runs"]
    em = run["emulated"]
    assert em["runs"] == 2 and em["steps"] == 12 and em["record_bytes"] > 0
    assert em["seconds_per_byte"] == pytest.approx(2e-3 / em["record_bytes"])
    r = em["readers"]["default"]
    assert len(r["step_ms_runs"]) == 2
    assert r["gpu_ms"] == pytest.approx(2 * 0.5)  # two layers a step
    # A step's wall time holds its GPU time (slept), its store waits and its host work before launch.
    assert r["step_ms"] >= r["gpu_ms"] + r["store_wait_ms"] + r["host_ms"] - 1e-6
    assert 0 < r["store_busy"] <= 1.01 and 0 <= r["store_load"] <= 1
    assert r["demand_reads"] + r["prefetch_reads"] > 0
    assert set(r["guesses"]) == {"issued", "hits", "late", "late_under_way", "wasted", "demand_misses"}
    assert all(v >= 0 for v in r["guesses"].values()) and r["guesses"]["issued"] > 0
    assert r["guesses"]["late_under_way"] <= r["guesses"]["late"]
    assert r["two_at_once_gain"] is not None and r["prefetch_at_once"] == 1
    assert 0 <= r["guess_saving"] <= 1 and 0 <= r["guess_floor"] <= 1


def test_the_emulated_disk_and_gpu_need_nvme(capsys):
    assert main(["bench", "host-step", *TINY, *EMULATED, "--baseline", "none"]) == 2
    assert "need --nvme" in capsys.readouterr().err


def test_guesses_keep_about_the_recall_and_name_distinct_experts():
    from glm53.bench.host_step_nvme import guesses
    from glm53.bench.routing_trace import zipf_trace

    trace = zipf_trace(2000, 64, 8, exponent=1.1, seed=5).reshape(-1, 2, 8)
    g = guesses(trace, 64, 0.575, seed=1)
    assert g.shape == trace.shape and np.array_equal(g, guesses(trace, 64, 0.575, seed=1))  # seeded
    same = g == trace
    assert abs(same.mean() - 0.575) < 0.03
    assert same[..., 0].mean() > same[..., -1].mean() + 0.3  # surer of the best guesses
    for real, guess in zip(trace.reshape(-1, 8)[:200], g.reshape(-1, 8)[:200], strict=True):
        assert len(set(guess.tolist())) == 8
        wrong = [e for e, r in zip(guess.tolist(), real.tolist(), strict=True) if e != r]
        assert not set(wrong) & set(real.tolist())  # a wrong guess names an expert the row did not pick


@needs_history
def test_nvme_baseline_without_the_mode_is_said_and_skipped(capsys):
    added = _git("log", "--diff-filter=A", "--format=%H", "--", "glm53/engine/host_bench.py", "glm53/bench/host_step.py").splitlines()
    if not added:
        pytest.skip("no commit added the host-step benchmark")
    lines = _bench(capsys, *NVME, "--baseline", added[-1], "--bsz", "1")
    assert any("lacks `bench host-step --nvme`" in line and "--baseline-driver this" in line for line in lines)
    assert [m.group(1) for m in map(RUN.match, lines) if m] == ["this"]
    assert not any(line.startswith("ratio") for line in lines)


@needs_git
def test_nvme_baseline_with_this_driver_prints_the_ratio(capsys):
    if subprocess.run(["git", "cat-file", "-e", "HEAD:glm53/bench/host_step.py"], cwd=REPO).returncode:
        pytest.skip("HEAD has no host-step benchmark yet")
    before = _git("worktree", "list")
    lines = _bench(capsys, *NVME, "--baseline", "HEAD", "--baseline-driver", "this", "--bsz", "1")
    assert any("measured by this version's benchmark" in line for line in lines)
    assert [m.group(1) for m in map(RUN.match, lines) if m] == ["this", "baseline"]
    assert len([m for m in map(NVME_LINE.match, lines) if m]) == 2
    ratios = [m.groups() for m in map(RATIO.match, lines) if m]
    assert len(ratios) == 1 and ratios[0][0] == "1"
    assert _git("worktree", "list") == before


@needs_git
def test_a_baseline_worktree_gets_the_compiled_library_of_its_sources(tmp_path):
    """Git ignores the compiled library: a baseline without it would read the store on Python threads. Same kernel
    sources: this tree's library is copied in, and the baseline's kernel module loads it."""
    from glm53.bench.worktree import baseline_library as _baseline_library
    from glm53.cpu_lane import buildinfo

    libs = sorted((REPO / "glm53" / "cpu_lane").glob("_expert_kernel*.so"))
    if not libs:
        pytest.skip("glm53's library is not built here")
    head = _git("rev-parse", "HEAD")
    tree = tmp_path / "tree"
    _git("worktree", "add", "--detach", str(tree), head)
    try:
        if buildinfo.source_hash(tree / "glm53" / "cpu_lane") != buildinfo.source_hash():
            pytest.skip("the working tree's kernel sources differ from HEAD's")
        assert _baseline_library(REPO, tree) is None
        assert [p.name for p in sorted((tree / "glm53" / "cpu_lane").glob("_expert_kernel*.so"))] == \
            [p.name for p in libs]
        probe = subprocess.run([sys.executable, "-c", "from store import native; "
                                "print(native.available())"], cwd=tree, capture_output=True, text=True,
                               env={**os.environ, "PYTHONPATH": str(tree)})
        assert probe.stdout.strip() == "True", probe.stderr
    finally:
        _git("worktree", "remove", "--force", str(tree))


def test_a_baseline_tree_runs_ahead_of_the_pythonpath_it_inherits(monkeypatch, tmp_path):
    """The GPU machine installs exllamav3 through PYTHONPATH: a baseline process must keep it, behind its tree."""
    import os

    from glm53.bench import worktree

    monkeypatch.setenv("PYTHONPATH", "/tmp/site")
    assert worktree.tree_env(tmp_path)["PYTHONPATH"] == f"{tmp_path}{os.pathsep}/tmp/site"
    monkeypatch.delenv("PYTHONPATH")
    assert worktree.tree_env(tmp_path)["PYTHONPATH"] == str(tmp_path)

"""`glm53 bench host-step` at tiny counts: its report parses and its JSON holds what the report says. No timings are
asserted: the benchmark's numbers are the machine's, not the code's."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from glm53.cli import main

TINY = ["--layers", "2", "--experts", "32", "--top-k", "4", "--slots", "4", "--staging", "33", "--steps", "12",
        "--warmup", "4", "--bsz", "1,2", "--top", "3"]
RUN = re.compile(r"^(this|baseline) bsz (\d+): median ([\d.]+) us, p90 ([\d.]+) us per layer step "
                 r"\((\d+) layer steps, VRAM hit rate ([\d.]+)\)$")
ROW = re.compile(r"^ +([\d.]+)% +([\d.]+) us  \S")
RATIO = re.compile(r"^ratio bsz (\d+): this / baseline = ([\d.]+) / ([\d.]+) us = ([\d.]+) \(([\d.]+)x fewer")
REPO = Path(__file__).resolve().parents[1]


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
    assert any("resolve (own time)" in line for line in lines)
    assert not any(line.startswith("ratio") for line in lines)


def test_json_to_stdout(capsys):
    lines = _bench(capsys, "--baseline", "none", "--json")
    doc = json.loads("\n".join(lines))
    assert doc["options"]["experts"] == 32 and doc["options"]["bsz"] == [1, 2]
    assert [r["bsz"] for r in doc["runs"]] == [1, 2]
    for r in doc["runs"]:
        assert r["layer_steps"] == 24 and r["median_us"] > 0 and len(r["breakdown"]["by_call"]) == 3


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


def _in_git_checkout() -> bool:
    try:
        return _git("rev-parse", "--is-inside-work-tree") == "true"
    except (OSError, subprocess.CalledProcessError):
        return False


needs_git = pytest.mark.skipif(not _in_git_checkout(), reason="not a git checkout")


@needs_git
def test_a_baseline_without_the_command_is_said_and_skipped(capsys):
    root = _git("rev-list", "--max-parents=0", "HEAD").splitlines()[0]
    lines = _bench(capsys, "--baseline", root, "--bsz", "1")
    assert any("lacks `glm53 bench host-step`" in line for line in lines)
    assert [m.group(1) for m in map(RUN.match, lines) if m] == ["this"]
    assert not any(line.startswith("ratio") for line in lines)


@needs_git
def test_baseline_from_a_worktree_prints_the_ratio(capsys):
    if subprocess.run(["git", "cat-file", "-e", "HEAD:glm53/engine/host_bench.py"], cwd=REPO).returncode:
        pytest.skip("HEAD has no host-step benchmark yet")
    before = _git("worktree", "list")
    lines = _bench(capsys, "--baseline", "HEAD", "--bsz", "1")
    assert [m.group(1) for m in map(RUN.match, lines) if m] == ["this", "baseline"]
    ratios = [m.groups() for m in map(RATIO.match, lines) if m]
    assert len(ratios) == 1 and ratios[0][0] == "1"
    _, this, base, r, _ = ratios[0]
    assert float(r) == pytest.approx(float(this) / float(base), rel=0.05, abs=1e-3)
    assert _git("worktree", "list") == before  # the temporary worktree is gone

"""`glm53 bench disk-sweep` and `depth-probe` without a disk or a GPU: the split of records into aligned reads, and
both registered under `glm53 bench` with their flags."""

from __future__ import annotations

from glm53.bench.disk_sweep import pieces
from glm53.cli import build_parser
from store.directio import ALIGN


def test_a_record_is_cut_into_aligned_parts_that_cover_it():
    extent = 9 * ALIGN + 100
    got = pieces([(ALIGN * 4, extent)], 4)
    assert [o for o, _ in got] == [ALIGN * 4 + i * 3 * ALIGN for i in range(4)]
    assert all(o % ALIGN == 0 for o, _ in got) and sum(n for _, n in got) == extent
    assert pieces([(0, extent)], 1) == [(0, extent)]


def test_both_are_glm53_bench_commands():
    args = build_parser().parse_args(["bench", "disk-sweep", "/x/experts.glm53", "--records", "200"])
    assert (str(args.store), args.records, args.depths) == ("/x/experts.glm53", 200, "1,2,4,8,16,32")
    args = build_parser().parse_args(["bench", "depth-probe", "--experts", "8", "--prompts", "16,2048"])
    assert (args.experts, args.prompts, args.tokens) == (8, "16,2048", 32)
    assert args.func.__module__ == "glm53.bench.depth_probe"

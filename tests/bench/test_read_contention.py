"""The read-contention probe: times the planning thread's kind of work alone and beside real store reads."""

from __future__ import annotations

import pytest
from nvme_support import make_store

from glm53.bench.read_contention import COPIES, READS, line, read_contention


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("contention"), layers=3, experts=16)


def test_the_probe_times_the_work_alone_and_beside_real_reads(packed, monkeypatch):
    from store import reader as R

    reads = []
    real = R.StoreReader.read_many

    def counting(self, requests, **kw):
        reads.append(len(requests))
        return real(self, requests, **kw)

    monkeypatch.setattr(R.StoreReader, "read_many", counting)
    res = read_contention(packed[1], 4, device="cpu", reps=6)
    assert reads == [READS] * (4 + 6), "each timed piece of work beside reads had its reads in flight"
    assert res["alone_s"] > 0 and res["reader_s"] > 0
    assert res["reader_over_alone"] == pytest.approx(res["reader_s"] / res["alone_s"])
    assert "native_s" in res
    text = line(res)
    assert f"{COPIES} slot copies" in text and f"beside {READS} StoreReader reads in 4 part(s)" in text
    assert "through a plain thread pool" in text

"""`glm53 bench zero-copy` without a GPU: its refusal, its flags, the arithmetic and report, and the measurement's
control flow on a fake layer whose "kernel" reads every pick's bytes at the addresses its pointer tables hold (so
re-pointing, the host copies, the VRAM slots and the restore are exercised for real; only the timings are fake)."""

from __future__ import annotations

import ctypes
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from glm53.bench import zero_copy as zc
from glm53.cli import build_parser, main


def test_registered_with_its_flags():
    args = build_parser().parse_args(["bench", "zero-copy", "--ks", "1,8", "--reps", "50", "--experts", "64"])
    assert (args.ks, args.reps, args.trials, args.experts, args.model) == ("1,8", 50, 3, 64, None)
    assert args.func is zc.cmd_bench_zero_copy


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_cuda_it_refuses_with_exit_2(capsys, tmp_path):
    assert main(["bench", "zero-copy", "--work", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "bench zero-copy" in err and "CUDA" in err
    assert list(tmp_path.iterdir()) == []  # refused before writing any checkpoint


def test_bad_flags_refuse_with_exit_2(capsys):
    assert main(["bench", "zero-copy", "--ks", "0,3"]) == 2
    assert "1..8" in capsys.readouterr().err
    assert main(["bench", "zero-copy", "--reps", "0"]) == 2
    assert "--reps" in capsys.readouterr().err


def test_parse_ks():
    assert zc.parse_ks("1,2,4,8") == [1, 2, 4, 8]
    assert zc.parse_ks(" 8, 1 ") == [8, 1]
    for bad, why in (("", "empty"), ("a", "comma-separated"), ("9", "1..8"), ("2,2", "repeats"), ("0", "1..8")):
        with pytest.raises(ValueError, match=why):
            zc.parse_ks(bad)
    assert zc.parse_ks("3", top_k=4) == [3]
    with pytest.raises(ValueError, match="1..4"):
        zc.parse_ks("5", top_k=4)


def test_summarize_arithmetic():
    mib9 = 9 * 2**20
    rows = zc.summarize(0.2, [zc.Timing(k=2, copy_ms=0.4, memcpy_ms=0.6, memcpy_same=True, zero_copy_ms=0.5,
                                        zero_copy_same=True),
                              zc.Timing(k=1, copy_ms=0.1, memcpy_ms=0.3, memcpy_same=False)], mib9)
    r = rows[0]
    assert r["bytes"] == 2 * mib9
    assert r["zero_copy_extra_ms"] == pytest.approx(0.3) and r["memcpy_extra_ms"] == pytest.approx(0.4)
    assert r["zero_copy_GBps"] == pytest.approx(2 * mib9 / 0.3e-3 / 1e9)
    assert r["copy_GBps"] == pytest.approx(2 * mib9 / 0.4e-3 / 1e9)
    assert r["zero_copy_over_memcpy"] == pytest.approx(0.5 / 0.6)
    assert r["ahead_bound_ms"] == pytest.approx(0.4)  # the copy is the longer of the two
    r = rows[1]
    assert r["zero_copy_ms"] is None and r["zero_copy_GBps"] is None and r["zero_copy_over_memcpy"] is None
    assert r["ahead_bound_ms"] == pytest.approx(0.2)  # the kernel is
    assert zc.summarize(0.5, [zc.Timing(1, 0.1, 0.4, True, 0.45, True)], 1)[0]["zero_copy_GBps"] is None  # no extra


def _result(rows, **kw):
    return {"experts": 288, "top_k": 8, "expert_bytes": 9 * 2**20, "reps": 200, "trials": 3, "stock_ms": 0.2,
            "stock_repeat_same": True, "repoint_effective": True, "h2d_GBps": 52.0, "rows": rows, **kw}


def test_render_and_verdict():
    rows = zc.summarize(0.2, [zc.Timing(1, 0.17, 0.38, True, 0.33, True), zc.Timing(8, 1.4, 1.6, True, 1.9, True)],
                        9 * 2**20)
    text = zc.render(_result(rows, device="NVIDIA H200"))
    lines = text.splitlines()
    assert "top-8" in lines[0] and "NVIDIA H200" in lines[0]
    assert any(line.startswith("   1 |") for line in lines) and any(line.startswith("   8 |") for line in lines)
    assert "zero-copy is faster than copy-then-compute at k = [1] of [1, 8]" in text
    assert lines[-1] == "outputs bit-identical to stock in every run: yes"
    assert zc.all_identical(_result(rows))
    partial = zc.summarize(0.2, [zc.Timing(1, 0.17, 0.38, False)], 9 * 2**20)  # copies only (zero-copy died)
    text = zc.render(_result(partial))
    assert "zero-copy is faster" not in text and text.splitlines()[-1].endswith("NO")
    assert not zc.all_identical(_result(partial))
    assert not zc.all_identical(_result(rows, repoint_effective=False))


# ---- the measurement's control flow on a fake layer ----------------------------------------------------------------


class _FakeEvent:
    def __init__(self, enable_timing=False):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return 2.0


def _lin(shape_in, shape_out, g):
    trellis = torch.randint(-2**15, 2**15 - 1, (shape_in // 16, shape_out // 16, 48), dtype=torch.int16, generator=g)
    suh = torch.randn(shape_in, generator=g).half()
    svh = torch.randn(shape_out, generator=g).half()
    return types.SimpleNamespace(inner=types.SimpleNamespace(trellis=trellis, suh=suh, svh=svh))


def _fake_layer(experts=12, top_k=4, hidden=64, inter=32):
    g = torch.Generator().manual_seed(1)
    m = types.SimpleNamespace(key="layers.1.mlp", num_experts=experts, num_experts_per_tok=top_k, hidden_size=hidden,
                              gated=True)
    m.gates = [_lin(hidden, inter, g) for _ in range(experts)]
    m.ups = [_lin(hidden, inter, g) for _ in range(experts)]
    m.downs = [_lin(inter, hidden, g) for _ in range(experts)]

    def multi(lins):
        return types.SimpleNamespace(**{f"ptrs_{s}": torch.tensor([getattr(x.inner, s).data_ptr() for x in lins],
                                                                  dtype=torch.long) for s in zc.PARTS})

    m.multi_gate, m.multi_up, m.multi_down = multi(m.gates), multi(m.ups), multi(m.downs)
    out = torch.zeros((8, hidden), dtype=torch.float)
    m.experts_cfg = types.SimpleNamespace(out_bszn=out)
    sizes = {name: t.numel() * t.element_size() for name, _, _, t in zc.expert_fields(m, 0)}
    names = list(sizes)
    tables = zc.pointer_tables(m)

    def run_bszN(y, sel, rw):  # reads each pick's bytes where its tables point, like the kernel
        out.zero_()
        for k, e in enumerate(sel[0].tolist()):
            for i, name in enumerate(names):
                raw = np.frombuffer(ctypes.string_at(int(tables[name][e]), sizes[name]), dtype=np.uint8)
                out[0, i] += float(rw[0, k]) * float(raw.astype(np.int64).sum() % 10007)
        out[0, len(names):] = y[0, len(names):].float()

    m.bc = types.SimpleNamespace(run_bszN=run_bszN, sh_coop=True)
    return m


@pytest.fixture
def ext(monkeypatch):
    """CUDA's timing and pinning calls on the CPU, and the extension's two host-pointer calls."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "fake")
    import glm53.tiers.ram as ram

    monkeypatch.setattr(ram, "pinned_empty", lambda shape, pin: torch.zeros(shape, dtype=torch.uint8))
    monkeypatch.setattr(zc, "L2_FLUSH_BYTES", 4096)
    return types.SimpleNamespace(cuda_host_get_device_pointer=lambda p: p, cuda_device_get_attribute=lambda a, d: 1)


def test_measure_flow_on_a_fake_layer(ext):
    m = _fake_layer()
    before = {name: t.clone() for name, t in zc.pointer_tables(m).items()}
    seen = []
    res = zc._measure(torch, ext, m, [1, 2, 4], reps=3, trials=2, seed=0, log=seen.append, partial=lambda r: None)
    assert res["repoint_effective"] and res["stock_repeat_same"] and res["alias_is_host_pointer"]
    assert [r["k"] for r in res["rows"]] == [1, 2, 4]
    assert all(r["memcpy_same"] and r["zero_copy_same"] for r in res["rows"])
    assert all(r["zero_copy_ms"] == pytest.approx(2.0) for r in res["rows"])  # each call between its events: 2 ms
    assert zc.all_identical(res)
    for name, t in zc.pointer_tables(m).items():  # every table back as loaded
        assert torch.equal(t, before[name])
    assert len(set(res["picks"])) == 4 and any(line.startswith("(ii) k=4") for line in seen)
    assert "outputs bit-identical to stock in every run: yes" in zc.render(res)


def test_measure_reports_tables_the_kernel_ignores(ext):
    m = _fake_layer()
    m.bc.run_bszN = lambda y, sel, rw: m.experts_cfg.out_bszn.fill_(1.0)  # reads no table
    res = zc._measure(torch, ext, m, [1], reps=2, trials=1, seed=0, log=lambda s: None, partial=lambda r: None)
    assert res["repoint_effective"] is False and "does not read them" in res["note"]
    assert not zc.all_identical(res)


def test_the_generated_checkpoint_is_one_full_width_moe_layer_kept_under_work(tmp_path, monkeypatch):
    import argparse
    import inspect

    import glm53.fixture.exl3 as F

    real = F.write_exl3_checkpoint
    calls = []

    def fake_write(out, **kw):
        inspect.signature(real).bind(out, **kw)  # the real writer takes these arguments
        calls.append(kw)
        out.mkdir(parents=True)
        return out

    monkeypatch.setattr(F, "write_exl3_checkpoint", fake_write)
    args = argparse.Namespace(model=None, work=str(tmp_path), keep=True, experts=288)
    work, model_dir = zc._checkpoint(args)
    assert model_dir == tmp_path / "glm53-zero-copy-288e" / "ckpt" and model_dir.is_dir() and work == model_dir.parent
    kw = calls[0]
    assert (kw["shape"], kw["moe_layers"], kw["mtp_layers"], kw["experts"]) == ("glm53", 1, 0, 288)
    g = F.glm53_geometry(kw["moe_layers"], mtp_layers=kw["mtp_layers"], experts=kw["experts"])
    F.validate(g, k_bits=3, shards=kw["shards"], router_skew=None, always_bits=None, head_bits=16)
    assert zc._checkpoint(args)[1] == model_dir and len(calls) == 1  # reused, not rewritten
    assert zc._checkpoint(argparse.Namespace(model="/m", work=None, keep=False, experts=8)) == (None, Path("/m"))


def test_host_rows_fall_back_to_mapped_registration():
    calls = []

    class Ext:
        def __init__(self, fail_first):
            self.fail = fail_first

        def cuda_host_get_device_pointer(self, p):
            if self.fail:
                self.fail = False
                raise RuntimeError("cudaHostGetDevicePointer(0x1) failed: invalid argument\nmore")
            return p + 4096

        def cuda_host_register(self, p, n, flags):
            calls.append(("register", n, flags))

        def cuda_host_unregister(self, p):
            calls.append(("unregister",))

    def pinned(shape, pin):
        assert pin
        return torch.zeros(shape, dtype=torch.uint8)

    host, alias, kind = zc.host_rows(torch, Ext(False), (2, 64), pinned)
    assert alias == host.data_ptr() + 4096 and "RAM tier" in kind and calls == []
    host, alias, kind = zc.host_rows(torch, Ext(True), (2, 64), pinned)
    assert tuple(host.shape) == (2, 64) and alias == host.data_ptr() + 4096
    assert calls == [("register", 4096, 0x03)] and "portable|mapped" in kind and "invalid argument" in kind  # whole pages
    del host
    import gc

    gc.collect()
    assert calls[-1] == ("unregister",)


def test_stock_is_timed_beside_the_pacers_spin_and_the_verdict_names_a_delay(ext):
    """(iv): a spin queued beside every timed call, on a stream of its own."""
    m = _fake_layer()
    spins = []
    res = zc._measure(torch, ext, m, [1], reps=3, trials=2, seed=0, log=lambda s: None, partial=lambda r: None,
                      spin=lambda: spins.append(1))
    assert len(spins) == 3 * 2 and res["stock_beside_spin_same"]
    assert zc.all_identical(res)
    assert "the spin does not delay the expert kernel" in zc.render(res)  # the fake events time every call alike
    assert "(x stock 1.200): the spin delays the expert kernel" in zc.render(
        {**res, "stock_beside_spin_ms": res["stock_ms"] * 1.2})
    assert "(x stock 1.010): the spin does not delay the expert kernel" in zc.render(
        {**res, "stock_beside_spin_ms": res["stock_ms"] * 1.01})
    assert not zc.all_identical({**res, "stock_beside_spin_same": False})

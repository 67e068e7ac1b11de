"""The CPU expert kernel against the numpy EXL3 reference: decode bit for bit, experts near-exactly, on every ISA path.

Real EXL3 bytes: experts of generated checkpoints, read both as a store record (the slot image the RAM tier holds)
and as a tiers slot image; accuracy is the max error relative to the output's max, against float64 maths. The
exact kernel must be near-exact; the integer kernel (the one served where it exists) must be at least as close
to float64 maths as a GPU-like fp16 computation of the same expert (exl3ref.expert_forward_fp16).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from glm53 import exl3ref as R
from glm53.cpu_lane import kernel as K
from glm53.tiers.layout import exl3_expert_layout

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "exl3_golden.npz"
LIMIT = 10.0
TOL = 1e-4  # measured ~5e-7: fp32 sums and Hadamards against float64
INT_TOL = 1e-3  # the integer kernel, measured ~4e-4 (RMS and max); the GPU-like fp16 computation ~8e-4 / ~9e-4

def test_the_library_loaded():
    assert K.available(), K.unavailable_reason()
    assert "scalar" in K.supported_isas()


ISAS = K.supported_isas()
SIMD = [i for i in ISAS if i != "scalar"]
INT_ISAS = [i for i in ISAS if K.kernel_supported(i, "int")]  # every path the CPU runs
PATHS = [(i, "exact") for i in ISAS] + [(i, "int") for i in INT_ISAS]


def _trellis(rng, k_in: int, k_out: int, k: int) -> np.ndarray:
    return rng.integers(-32768, 32767, (k_in // 16, k_out // 16, 16 * k), dtype=np.int16, endpoint=True)


# ---- decode --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("isa", ISAS)
def test_decode_is_bit_exact_for_every_k(isa):
    rng = np.random.default_rng(0)
    for k in range(1, 9):
        t = _trellis(rng, 48, 64, k)
        assert np.array_equal(K.decode_linear(t, isa), R.decode_trellis(t).astype(np.float32)), f"K={k}"


@pytest.mark.parametrize("isa", ISAS)
def test_decode_matches_exllamav3_golden_vectors(isa):
    g = np.load(GOLDEN)
    for k in (2, 3, 4):
        got = K.decode_linear(g[f"inner/mul1_K{k}/trellis"], isa)
        assert np.array_equal(got, g[f"inner/mul1_K{k}/weight"].astype(np.float32)), f"K={k}"


@pytest.mark.parametrize("isa", ISAS)
def test_decode_covers_almost_every_state(isa):
    t = R.state_coverage_trellis()  # K=8, visits > 99.5% of the 65536 states
    assert np.array_equal(K.decode_linear(t, isa), R.decode_trellis(t).astype(np.float32))


def test_the_coverage_trellis_reaches_every_weight_value():
    # A weight is a function of the byte sum of s * 0x83DCD12D; the SIMD paths round it to fp16 in fp32 arithmetic
    # (no conversion instructions), so the test above is exhaustive only if it meets every byte sum there is.
    s = np.arange(1 << 16, dtype=np.uint64)
    x = (s * 0x83DCD12D) & 0xFFFFFFFF
    sums = (x & 0xFF) + (x >> 8 & 0xFF) + (x >> 16 & 0xFF) + (x >> 24)
    assert len(np.unique(R.decode_trellis(R.state_coverage_trellis()))) == len(np.unique(sums))


# ---- experts from generated checkpoints ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def store_experts(tmp_path_factory):
    """A packed store of a generated expert checkpoint: (record buffers, store layout, reference linears)."""
    from store.directio import alloc_aligned
    from store.pack import PackOptions, pack_store
    from store.reader import StoreReader
    from store.synth import write_expert_checkpoint

    root = tmp_path_factory.mktemp("cpu_lane_store")
    ck = write_expert_checkpoint(root / "ck", hidden=256, moe_intermediate=128, layers=2, experts=3, mtp_layers=0)
    out = root / "s.glm53"
    pack_store(PackOptions(ck, out, threads=1, progress=False, verify=False), log=lambda m: None)
    records, refs = [], []
    with StoreReader(out, threads=1, allow_buffered=True) as reader:
        layout = reader.layout(1)
        for e in range(3):
            buf = alloc_aligned(reader.max_extent)
            records.append(reader.read(1, e, buf).result(30).data)
            refs.append([R.read_exl3_linear(ck, f"model.language_model.layers.1.mlp.experts.{e}.{p}_proj")
                         for p in ("gate", "up", "down")])
    return records, layout, refs


def _fixture_slot(hidden: int, inter: int, k: int, seed: int, svh_gain: float = 1.0):
    """A tiers slot image of one expert with the EXL3 fixture's value ranges, and its reference linears."""
    layout = exl3_expert_layout(hidden, inter, k)
    rng = np.random.default_rng(seed)
    slot = torch.zeros(layout.nbytes, dtype=torch.uint8)
    views = layout.views(slot)
    lins = []
    for p, (i, o) in {"gate": (hidden, inter), "up": (hidden, inter), "down": (inter, hidden)}.items():
        tr = _trellis(rng, i, o, k)
        suh = (np.where(rng.random(i) < 0.5, -1, 1) * np.exp(0.1 * rng.standard_normal(i))).astype(np.float16)
        svh = (np.where(rng.random(o) < 0.5, -1, 1) * svh_gain / np.sqrt(i)).astype(np.float16)
        for name, arr in (("trellis", tr), ("suh", suh), ("svh", svh)):
            views[f"{p}.{name}"].copy_(torch.from_numpy(arr))
        lins.append(R.Exl3Linear(tr, suh, svh))
    return slot, layout, lins


def _reference(x: np.ndarray, lins, limit: float = LIMIT) -> np.ndarray:
    return R.expert_forward(x, *lins, swiglu_limit=limit, half_intermediate=False)


def _rel_err(y: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(y.astype(np.float64) - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("isa", ISAS)
def test_store_records_match_the_reference(store_experts, isa, record_property):
    records, layout, refs = store_experts
    rng = np.random.default_rng(1)
    worst = 0.0
    for rec, lins in zip(records, refs, strict=True):
        for rows in range(1, 9):
            x = rng.standard_normal((rows, 256)).astype(np.float32)
            for threads in (1, 2):
                y = K.expert_forward(rec, layout, x, threads=threads, isa=isa, kernel="exact")
                worst = max(worst, _rel_err(y, _reference(x, lins)))
    record_property("max_rel_err", worst)
    print(f"{isa}: store records, rows 1..8, threads 1..2: max relative error {worst:.2e}")
    assert worst < TOL


@pytest.mark.parametrize("hidden,inter,k", [(256, 128, 3), (384, 256, 2), (128, 384, 4), (256, 256, 5)])
def test_shapes_and_bitrates_match_the_reference(hidden, inter, k, record_property):
    slot, layout, lins = _fixture_slot(hidden, inter, k, seed=hidden + inter + k)
    rng = np.random.default_rng(2)
    worst = 0.0
    for rows in (1, 3, 8, 33):  # 33: prefill-sized steps work too (the planner rarely sends them)
        x = (2 * rng.standard_normal((rows, hidden))).astype(np.float32)
        ref = _reference(x, lins)
        for isa in ISAS:
            worst = max(worst, _rel_err(K.expert_forward(slot, layout, x, threads=2, isa=isa, kernel="exact"), ref))
    record_property("max_rel_err", worst)
    assert worst < TOL


def test_the_clamp_is_applied_like_exllamav3():
    # Large svh: gate/up outputs well past the limit, so min(silu(g), 10) * clamp(u, -10, 10) decides the result.
    slot, layout, lins = _fixture_slot(256, 128, 3, seed=7, svh_gain=30.0)
    x = np.random.default_rng(3).standard_normal((4, 256)).astype(np.float32)
    g = lins[0].forward(x)
    assert (g > 12).mean() > 0.2, "the test needs activations past the limit"
    for kernel, tol in (("exact", TOL), *((("int", INT_TOL),) if INT_ISAS else ())):
        y = K.expert_forward(slot, layout, x, kernel=kernel)
        assert _rel_err(y, _reference(x, lins, LIMIT)) < tol, kernel
        assert _rel_err(y, _reference(x, lins, 0.0)) > 0.1, "unclamped maths gives a different answer"
        y0 = K.expert_forward(slot, layout, x, swiglu_limit=0.0, kernel=kernel)
        assert _rel_err(y0, _reference(x, lins, 0.0)) < tol, kernel


def test_isa_paths_agree_and_threads_do_not_change_a_bit():
    slot, layout, _ = _fixture_slot(512, 256, 3, seed=11)
    x = np.random.default_rng(4).standard_normal((5, 512)).astype(np.float32)
    outs = {isa: K.expert_forward(slot, layout, x, threads=1, isa=isa, kernel="exact") for isa in ISAS}
    for isa in ISAS:
        # Each output column is summed by one thread in a fixed order: the split of work cannot change it.
        assert np.array_equal(K.expert_forward(slot, layout, x, threads=2, isa=isa, kernel="exact"), outs[isa]), isa
        assert _rel_err(outs[isa], outs["scalar"].astype(np.float64)) < 1e-5, isa


@pytest.mark.parametrize("isa,kernel", PATHS)
@pytest.mark.parametrize("k", [3, 8])  # K=8: the AVX-512 paths' two-window decode (a pair does not fit one load)
def test_each_row_comes_out_as_if_it_were_alone(isa, kernel, k):
    # A tile is decoded once per group of up to 8 rows and applied to each; more rows make more groups. Whatever
    # the row count and the thread count, every row must come out bit for bit as it does alone.
    slot, layout, _ = _fixture_slot(256, 256, k, seed=20 + k)
    x = (2 * np.random.default_rng(6).standard_normal((19, 256))).astype(np.float32)
    alone = np.concatenate([K.expert_forward(slot, layout, x[r:r + 1], threads=1, isa=isa, kernel=kernel)
                            for r in range(len(x))])
    for rows in (2, 3, 4, 5, 6, 7, 8, 9, 16, 19):
        for threads in (1, 2):
            got = K.expert_forward(slot, layout, x[:rows], threads=threads, isa=isa, kernel=kernel)
            assert np.array_equal(got, alone[:rows]), f"{rows} rows, {threads} threads"

# ---- the integer kernel ---------------------------------------------------------------------------------------


def _rms_err(y: np.ndarray, ref: np.ndarray) -> float:
    return float(np.sqrt(((y.astype(np.float64) - ref) ** 2).mean() / (ref ** 2).mean()))


def _errors(ys: list[np.ndarray], refs: list[np.ndarray]) -> tuple[float, float]:
    """(RMS error relative to the RMS output, worst max error relative to the output's max) over several experts."""
    y, ref = np.concatenate([a.ravel() for a in ys]), np.concatenate([r.ravel() for r in refs])
    return _rms_err(y, ref), max(_rel_err(a, r) for a, r in zip(ys, refs, strict=True))


def _int_vs_gpu_like(cases, isa: str, rows: int, threads: int, seed: int, outlier: bool = False):
    """The integer kernel's, the exact kernel's and the GPU-like computation's errors against float64 maths."""
    rng = np.random.default_rng(seed)
    got = {"int": [], "exact": [], "gpu": []}
    refs = []
    for slot, layout, lins in cases:
        x = rng.standard_normal((rows, lins[0].in_features)).astype(np.float32)
        if outlier:  # a few large channels, as real hidden states have
            x[:, rng.choice(x.shape[1], 3, replace=False)] *= 40.0
        refs.append(_reference(x, lins))
        for kernel in ("int", "exact"):
            got[kernel].append(K.expert_forward(slot, layout, x, threads=threads, isa=isa, kernel=kernel))
        got["gpu"].append(R.expert_forward_fp16(x, *lins, swiglu_limit=LIMIT))
    return {k: _errors(v, refs) for k, v in got.items()}, got


@pytest.mark.parametrize("isa", INT_ISAS)
@pytest.mark.parametrize("rows,threads", [(1, 1), (1, 2), (2, 2), (5, 1), (8, 2), (33, 2)])
def test_the_integer_kernel_is_as_close_as_a_gpu(store_experts, isa, rows, threads, record_property):
    # Real EXL3 bytes (a generated checkpoint's store records) and fixture slots of other shapes and bitrates;
    # one row (decode), several (batched decode) and 33 (prefill-sized): each its own integer path.
    records, layout, refs = store_experts
    cases = [(rec, layout, lins) for rec, lins in zip(records, refs, strict=True)]
    cases += [_fixture_slot(h, i, k, seed=h + i + k) for h, i, k in ((384, 256, 2), (128, 384, 4), (256, 256, 8))]
    errs, got = _int_vs_gpu_like(cases, isa, rows, threads, seed=rows)
    (int_rms, int_max), (gpu_rms, gpu_max) = errs["int"], errs["gpu"]
    vs_exact = _errors(got["int"], [y.astype(np.float64) for y in got["exact"]])
    record_property("int_rms_err", int_rms)
    record_property("gpu_like_rms_err", gpu_rms)
    print(f"{isa}, {rows} rows, {threads} threads: integer kernel RMS {int_rms:.2e} max {int_max:.2e} "
          f"(vs the exact kernel RMS {vs_exact[0]:.2e} max {vs_exact[1]:.2e}); GPU-like fp16 RMS {gpu_rms:.2e} "
          f"max {gpu_max:.2e}; exact kernel RMS {errs['exact'][0]:.2e}")
    assert int_rms <= gpu_rms and int_max <= gpu_max
    assert vs_exact[0] <= gpu_rms and vs_exact[1] <= gpu_max
    assert int_max < INT_TOL and errs["exact"][1] < TOL


@pytest.mark.parametrize("isa", INT_ISAS)
def test_the_integer_kernel_scales_each_block_of_activations(isa):
    # Large channels, and inputs far from 1 in size: the int16 scale is per 128-block of the transformed
    # activations, so neither costs accuracy. (Unclamped: with the clamp, large activations leave only the small
    # unclamped ones, whose absolute error is the whole vector's, in any approximate arithmetic, the GPU's too.)
    cases = [_fixture_slot(512, 256, 3, seed=3)]
    errs, _ = _int_vs_gpu_like(cases, isa, 4, 2, seed=9, outlier=True)
    assert errs["int"][0] <= errs["gpu"][0] and errs["int"][1] < INT_TOL
    slot, layout, lins = cases[0]
    x = np.random.default_rng(8).standard_normal((2, 512)).astype(np.float32)
    for gain in (1e-6, 1e3):
        xs = (gain * x).astype(np.float32)
        y = K.expert_forward(slot, layout, xs, isa=isa, kernel="int", swiglu_limit=0.0)
        with np.errstate(over="ignore"):  # silu's exp(-g) for large negative g: inf, and silu -0.0, as it should
            ref = _reference(xs, lins, 0.0)
        assert _rel_err(y, ref) < INT_TOL, gain


@pytest.mark.parametrize("hidden,inter,k", [(256, 128, 1), (256, 128, 3), (384, 256, 2), (128, 384, 4),
                                            (256, 256, 5), (256, 128, 6), (256, 128, 7), (256, 256, 8)])
def test_the_integer_kernel_reads_every_bitrate(hidden, inter, k):
    slot, layout, lins = _fixture_slot(hidden, inter, k, seed=hidden + inter + k)
    x = (2 * np.random.default_rng(2).standard_normal((3, hidden))).astype(np.float32)
    ref = _reference(x, lins)
    for isa in INT_ISAS:
        assert _rel_err(K.expert_forward(slot, layout, x, threads=2, isa=isa, kernel="int"), ref) < INT_TOL, isa


def test_the_integer_paths_agree_bit_for_bit():
    # The SIMD paths add the same integer products into the same lanes and scale each block's lanes the same
    # way as the scalar path, so every ISA's integer kernel gives the scalar one's result exactly.
    slot, layout, _ = _fixture_slot(512, 256, 3, seed=11)
    x = np.random.default_rng(4).standard_normal((5, 512)).astype(np.float32)
    want = K.expert_forward(slot, layout, x, threads=1, isa="scalar", kernel="int")
    for isa in INT_ISAS:
        for threads in (1, 2):
            assert np.array_equal(K.expert_forward(slot, layout, x, threads=threads, isa=isa, kernel="int"), want)


@pytest.mark.parametrize("isa", INT_ISAS)
def test_the_integer_kernel_keeps_nan_and_zero(isa):
    slot, layout, _ = _fixture_slot(256, 128, 3, seed=2)
    x = np.random.default_rng(1).standard_normal((3, 256)).astype(np.float32)
    x[1, 5] = np.nan
    x[2] = 0.0
    y = K.expert_forward(slot, layout, x, isa=isa, kernel="int")
    assert np.isfinite(y[0]).all() and np.isnan(y[1]).all() and (y[2] == 0).all()
    assert np.array_equal(y[0], K.expert_forward(slot, layout, x[:1], isa=isa, kernel="int")[0])


def test_which_kernel_serves_on_each_isa():
    assert K.KERNELS == ("exact", "int")
    for isa in ISAS:
        assert K.kernel_supported(isa, "exact")
        assert K.served_kernel(isa) == ("int" if isa in INT_ISAS else "exact")
    # Every ISA path has its integer kernel (each checked against the reference by the tests above on a CPU
    # that runs it): the lane serves it wherever the CPU runs the path.
    assert INT_ISAS == ISAS
    with K.CpuKernel(1, isa=ISAS[-1]) as kern:
        assert kern.kernel == K.served_kernel(ISAS[-1])  # what the lane and calibration get by default
    with pytest.raises(ValueError, match="unknown kernel"):
        K.kernel_supported("avx2", "fp8")


def test_another_build_of_the_library_runs_side_by_side(tmp_path):
    # `glm53 bench cpu-lane --baseline-lib` times an older build against this one, each through its own pool.
    lib = K.load_library(K._LIB._name)
    slot, layout, _ = _fixture_slot(256, 128, 3, seed=4)
    x = np.random.default_rng(7).standard_normal((3, 256)).astype(np.float32)
    with K.CpuKernel(2, lib=lib) as kern:
        assert np.array_equal(kern.forward(slot, layout, x), K.expert_forward(slot, layout, x, threads=2))
    with pytest.raises(K.KernelUnavailable, match="cannot load"):
        K.load_library(tmp_path / "missing.so")


def test_the_bench_times_a_baseline_build_in_the_same_run(monkeypatch):
    from glm53.bench import cpu_lane as bench
    from glm53.cli import build_parser
    from glm53.cpu_lane import calibrate

    monkeypatch.setattr(calibrate, "ram_read_bandwidth", lambda nbytes=None, threads=None, repeats=5: 1e10)
    args = build_parser().parse_args(["bench", "cpu-lane", "--thread-list", "1", "--rows", "1,3", "--repeats", "1",
                                      "--experts", "1", "--hidden", "256", "--intermediate", "128", "--isa", ISAS[-1],
                                      "--baseline-lib", K._LIB._name])
    lines: list[str] = []
    doc = bench.run_bench(args, log=lines.append)
    assert [r["rows"] for r in doc["results"]] == [1, 3]
    assert all(r["baseline_seconds_per_expert"] > 0 and r["baseline_ratio"] > 0 for r in doc["results"])
    assert any("speed-up" in line for line in lines)


def test_one_call_runs_many_experts_and_marks_each_done():
    slots = [_fixture_slot(256, 128, 3, seed=s) for s in range(3)]
    layout = slots[0][1]
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal((r, 256)).astype(np.float32) for r in (1, 4, 8)]
    outs = [np.empty_like(x) for x in xs]
    done = np.zeros(3, np.int32)
    with K.CpuKernel(2) as kern:
        assert kern.run([K.ExpertCall(s[0], x, o) for s, x, o in zip(slots, xs, outs, strict=True)], layout, done=done)
        assert done.tolist() == [1, 1, 1]
        for s, x, o in zip(slots, xs, outs, strict=True):
            assert np.array_equal(o, kern.forward(s[0], layout, x))


def test_each_call_reports_where_its_time_went():
    # `glm53 bench cpu-lane` prints it: the phases of each worker, summed over the call's experts.
    slots = [_fixture_slot(512, 256, 3, seed=s) for s in range(2)]
    layout = slots[0][1]
    xs = [np.random.default_rng(r).standard_normal((r, 512)).astype(np.float32) for r in (1, 3)]
    with K.CpuKernel(2) as kern:
        assert kern.profile().wall == 0.0  # no call yet
        t0 = time.perf_counter()
        kern.run([K.ExpertCall(s[0], x, np.empty_like(x)) for s, x in zip(slots, xs, strict=True)], layout)
        prof = kern.profile()
        t1 = time.perf_counter()
    assert prof.per_thread.shape == (2, len(K.PHASES)) and (prof.per_thread >= 0).all()
    mean = prof.mean()
    assert mean["gate_up"] > 0 and mean["down"] > 0 and mean["prep"] > 0
    # Each worker's work starts inside the call and ends before profile() returns (it waits for every worker to
    # leave the call); a worker may end its last phase after the call returned (the one that completes it, or one
    # descheduled on a loaded host), so the call's own wall time is no bound.
    work = prof.per_thread[:, [K.PHASES.index(p) for p in ("prep", "gate_up", "down")]].sum(axis=1)
    assert (work <= t1 - t0).all()
    assert 0 <= prof.caller_wake <= prof.wall <= t1 - t0


def test_calls_back_to_back_on_more_threads_than_cores_stay_exact():
    # A call returns once its outputs are written; a worker that woke late may still be leaving it, and the next
    # call waits for that worker before it reuses the buffers. Oversubscribed, short calls in a row make every
    # ordering of those happen; each output must still equal the one-thread result bit for bit, and a cancelled
    # call in between must not disturb the next.
    # (At the real expert size a call outlasts a scheduler tick, so workers are preempted inside units: without
    # the wait for the previous expert's outputs, a quarter of these calls came out wrong on the 2-core dev box;
    # without the wait for the previous call's workers, it crashed.)
    slots = [_fixture_slot(4096, 2048, 3, seed=s) for s in range(3)]
    layout = slots[0][1]
    rng = np.random.default_rng(11)
    xs = [rng.standard_normal((r, 4096)).astype(np.float32) for r in (1, 2, 5)]
    with K.CpuKernel(1) as one:
        want = [one.forward(s[0], layout, x) for s, x in zip(slots, xs, strict=True)]
    with K.CpuKernel(8, spin_us=0) as kern:
        for i in range(60):
            order = [(i + k) % 3 for k in range(1 + i % 3)]
            outs = [np.empty_like(xs[k]) for k in order]
            done = np.zeros(len(order), np.int32)
            if i % 20 == 7:
                assert kern.run([K.ExpertCall(slots[k][0], xs[k], o) for k, o in zip(order, outs, strict=True)],
                                layout, cancel=np.ones(1, np.int32)) is False
                continue
            assert kern.run([K.ExpertCall(slots[k][0], xs[k], o) for k, o in zip(order, outs, strict=True)], layout,
                            done=done)
            assert done.all()
            for k, o in zip(order, outs, strict=True):
                assert np.array_equal(o, want[k]), (i, k)


def test_a_cancelled_call_marks_nothing_done():
    slot, layout, _ = _fixture_slot(256, 128, 3, seed=1)
    x = np.ones((2, 256), np.float32)
    done, cancel = np.zeros(2, np.int32), np.ones(1, np.int32)
    with K.CpuKernel(1) as kern:
        calls = [K.ExpertCall(slot, x, np.empty_like(x)) for _ in range(2)]
        assert kern.run(calls, layout, cancel=cancel, done=done) is False
    assert done.tolist() == [0, 0]


def test_bad_inputs_are_refused():
    slot, layout, _ = _fixture_slot(256, 128, 3, seed=1)
    with pytest.raises(ValueError, match="holds"):
        K.expert_forward(slot[:-1], layout, np.ones((1, 256), np.float32))
    with pytest.raises(ValueError, match="x must be"):
        K.expert_forward(slot, layout, np.ones((1, 128), np.float32))
    with pytest.raises(ValueError, match="unknown ISA"):
        K.expert_forward(slot, layout, np.ones((1, 256), np.float32), isa="neon")
    bad = exl3_expert_layout(256, 128, 3)
    with pytest.raises(TypeError):
        K.ExpertGeometry.from_layout(object())
    assert K.ExpertGeometry.from_layout(bad).k_bits == (3, 3, 3)


def test_cpu_picking_uses_one_cpu_per_physical_core(tmp_path):
    # Two cores with SMT siblings: cpu0/cpu2 share core 0, cpu1/cpu3 share core 1.
    for cpu, core in enumerate((0, 1, 0, 1)):
        topo = tmp_path / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text("0\n")
        (topo / "core_id").write_text(f"{core}\n")
    every = {0, 1, 2, 3}
    assert K.physical_cores(tmp_path, every) == [0, 1]
    assert K.physical_cores(tmp_path, {2, 3}) == [2, 3]
    assert K.pick_cpus(1, tmp_path, every, set()) == [1]
    assert K.pick_cpus(3, tmp_path, every, set()) is None     # more threads than cores: leave it to the OS
    assert K.physical_cores(tmp_path, {0, 9}) == []           # no topology for CPU 9: unpinned


def test_host_cpus_are_the_cores_the_lane_leaves(tmp_path):
    # Four cores, each with an SMT sibling: cpu c and cpu c+4 share core c.
    for cpu in range(8):
        topo = tmp_path / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text("0\n")
        (topo / "core_id").write_text(f"{cpu % 4}\n")
    every = set(range(8))
    lane = K.pick_cpus(3, tmp_path, every, set())
    assert lane == [1, 2, 3]
    assert K.host_cpus(lane, tmp_path, every) == [0, 4]      # core 0 and its sibling; never a lane core's sibling
    assert K.host_cpus([0, 1, 2, 3], tmp_path, every) == [4, 5, 6, 7]  # every core taken: the siblings
    assert K.host_cpus(sorted(every), tmp_path, every) == []


def test_a_pinned_lane_moves_its_starter_off_the_lane_cores_until_closed():
    import os
    import threading

    import torch

    from glm53.cpu_lane.lane import HostPin

    allowed = sorted(os.sched_getaffinity(0))
    if len(K.physical_cores(allowed=set(allowed))) < 2:
        pytest.skip("needs two physical cores")
    seen = {}

    def starter() -> None:  # in its own thread, so the test runner's mask is never touched
        lane_cpus = K.pick_cpus(1)
        torch_before = torch.get_num_threads()
        pin = HostPin.take(lane_cpus)
        child = threading.Thread(target=lambda: seen.update(child=os.sched_getaffinity(0)))
        child.start()
        child.join()
        seen.update(lane=lane_cpus, pinned=os.sched_getaffinity(0), torch=torch.get_num_threads(), pin=pin.cpus)
        pin.release()
        seen.update(after=os.sched_getaffinity(0), torch_after=torch.get_num_threads(), torch_before=torch_before)

    t = threading.Thread(target=starter)
    t.start()
    t.join()
    assert seen["pinned"] == set(seen["pin"]) == seen["child"] and not seen["pinned"] & set(seen["lane"])
    assert seen["torch"] == len(seen["pin"])
    assert seen["after"] == set(allowed) and seen["torch_after"] == seen["torch_before"]


def test_cpu_picking_prefers_performance_cores(tmp_path):
    # A hybrid CPU: cores 0-3 are performance cores, 4-7 efficiency cores (no SMT here, for brevity).
    for cpu in range(8):
        topo = tmp_path / "cpu" / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text("0")
        (topo / "core_id").write_text(str(cpu))
    (tmp_path / "cpu_core").mkdir()
    (tmp_path / "cpu_core" / "cpus").write_text("0-3\n")
    perf = K.performance_cpus(tmp_path)
    assert perf == {0, 1, 2, 3}
    every = set(range(8))
    assert K.pick_cpus(3, tmp_path / "cpu", every, perf) == [1, 2, 3]
    assert K.pick_cpus(6, tmp_path / "cpu", every, perf) == [0, 1, 2, 3, 6, 7]
    assert K.pick_cpus(3, tmp_path / "cpu", every, set()) == [5, 6, 7]
    assert K.performance_cpus(tmp_path / "nowhere") is None


def test_a_missing_or_stale_library_is_explained(monkeypatch):
    monkeypatch.setattr(K.buildinfo, "source_hash", lambda directory=K.HERE: "0" * 16)
    lib, why = K._load()
    assert lib is None and "stale build" in why and "pip install -e ." in why
    monkeypatch.setattr(K, "_LIB", None)
    monkeypatch.setattr(K, "_WHY", "not built (test)")
    assert not K.available() and K.supported_isas() == []
    with pytest.raises(K.KernelUnavailable, match="not built"):
        K.CpuKernel(1)


def test_store_record_layout_is_the_tiers_slot_layout():
    from store.format import Layout

    store_geo = K.ExpertGeometry.from_layout(Layout.build(4096, 2048, (3, 3, 3)))
    assert store_geo == K.ExpertGeometry.from_layout(exl3_expert_layout(4096, 2048, 3))

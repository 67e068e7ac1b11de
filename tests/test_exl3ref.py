"""glm53.exl3ref: internal consistency here, and bit-exactness against exllamav3 via tests/data/exl3_golden.npz."""

from __future__ import annotations

import hashlib
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from glm53 import exl3ref as R

GOLDEN = Path(__file__).parent / "data" / "exl3_golden.npz"


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def _trellis(rng, k_in: int, k_out: int, k: float) -> np.ndarray:
    return rng.integers(-32768, 32767, (k_in // 16, k_out // 16, int(16 * k)), dtype=np.int16, endpoint=True)


def _linear(rng, k_in: int, k_out: int, k: float = 3, cb: str = "mul1") -> R.Exl3Linear:
    suh = (np.where(rng.random(k_in) < 0.5, -1, 1) * np.exp(0.1 * rng.standard_normal(k_in))).astype(np.float16)
    svh = (np.where(rng.random(k_out) < 0.5, -1, 1) / np.sqrt(k_in)).astype(np.float16)
    return R.Exl3Linear(_trellis(rng, k_in, k_out, k), suh, svh, cb)


# ---- fp16 rounding, independently of numpy's casts ---------------------------------------------------------


def _round_half_exact(v: Fraction) -> float:
    """Round an exact rational to the nearest fp16 (ties to even) with integer arithmetic only."""
    if v == 0:
        return 0.0
    sign = -1 if v < 0 else 1
    a = abs(v)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    e = max(e, -14)                       # subnormals share the exponent of the smallest normal
    ulp = Fraction(2) ** (e - 10)
    q, r = divmod(a, ulp)
    q = int(q)
    if r > ulp / 2 or (r == ulp / 2 and q % 2 == 1):
        q += 1
    return sign * float(q * ulp)


def _half(bits: int) -> Fraction:
    return Fraction(float(np.array([bits], dtype=np.uint16).view(np.float16)[0]))


def test_mul1_codebook_is_the_fused_fma_of_the_kernel():
    # Every mul1 value is fma(1024 + b, 0x1EEE, 0xC931) rounded once, b = byte sum of s * 0x83DCD12D
    table = R.codebook_table("mul1")
    k_inv, k_bias = _half(0x1EEE), _half(0xC931)
    s = np.arange(65536, dtype=np.uint64)
    x = (s * R.MUL1_MULT) & 0xFFFFFFFF
    b = sum((x >> (8 * i)) & 0xFF for i in range(4)).astype(np.int64)
    expect = {int(bb): _round_half_exact((1024 + int(bb)) * k_inv + k_bias) for bb in np.unique(b)}
    got = table.astype(np.float64)
    assert all(got[i] == expect[int(b[i])] for i in range(0, 65536, 7))
    assert len(np.unique(table)) <= 1021          # one value per possible byte sum


@pytest.mark.parametrize("cb,mult,add", [("mcg", R.MCG_MULT, 0), ("3inst", R.INST3_MULT, R.INST3_ADD)])
def test_lop3_codebooks_round_the_sum_of_halves_once(cb, mult, add):
    table = R.codebook_table(cb)
    for s in _rng(1).integers(0, 65536, 2000):
        x = ((int(s) * mult + add) & 0xFFFFFFFF) & 0x8FFF8FFF ^ 0x3B603B60
        exact = _half(x & 0xFFFF) + _half(x >> 16)
        assert float(table[s]) == _round_half_exact(exact), (cb, s)


def test_codebook_distributions():
    # mul1 is ~N(0, 1) (a sum of 4 uniform bytes, recentred); mcg and 3INST have exllamav3's codebook_scale std
    mul1 = R.codebook_table("mul1").astype(np.float64)
    assert abs(mul1.mean()) < 0.01 and abs(mul1.std() - 1.0) < 0.01
    for cb in ("mcg", "3inst"):
        t = R.codebook_table(cb).astype(np.float64)
        assert abs(t.mean()) < 0.01 and abs(t.std() - 1.24371088) < 0.005
        assert np.isfinite(t).all() and np.abs(t).max() < 4.0
    with pytest.raises(ValueError):
        R.codebook_table("nf4")


# ---- bit layout ---------------------------------------------------------------------------------------------


def _states_by_bits(tile_words: np.ndarray, k: float) -> list[int]:
    """Slow, obviously-correct extraction: build the bit list, read each wrapped 16-bit window."""
    u16 = tile_words.view(np.uint16)
    bits: list[int] = []
    for i in range(0, u16.size, 2):
        word = int(u16[i]) | (int(u16[i + 1]) << 16)
        bits += [(word >> (31 - j)) & 1 for j in range(32)]
    steps = [int(k)] * 256 if float(k).is_integer() else [int(k) + (t & 1) for t in range(256)]
    ends = np.cumsum(steps)
    out = []
    for e in ends:
        v = 0
        for p in range(e - 16, e):
            v = (v << 1) | bits[p % len(bits)]
        out.append(v)
    return out


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6, 7, 8, 1.5, 2.5, 3.5])
def test_trellis_states_match_bitwise_reading(k):
    tr = _trellis(_rng(int(2 * k)), 32, 32, k)
    states = R.trellis_states(tr)
    for tk in range(2):
        for tn in range(2):
            assert states[tk, tn].tolist() == _states_by_bits(tr[tk, tn], k)


def test_tensor_core_permutation_is_a_permutation_and_matches_exllamav3s_table():
    perm = R.tensor_core_perm()
    assert sorted(perm.tolist()) == list(range(256))
    # exllamav3 quantize.tensor_core_perm, transcribed
    ref = [0] * 256
    for t in range(32):
        r0, c0 = (t % 4) * 2, t // 4
        for j, (r, c) in enumerate([(r0, c0), (r0 + 1, c0), (r0 + 8, c0), (r0 + 9, c0),
                                    (r0, c0 + 8), (r0 + 1, c0 + 8), (r0 + 8, c0 + 8), (r0 + 9, c0 + 8)]):
            ref[t * 8 + j] = r * 16 + c
    assert perm.tolist() == ref


def test_decode_places_tiles_by_input_then_output_block():
    rng = _rng(3)
    tr = _trellis(rng, 64, 128, 3)
    w = R.decode_trellis(tr)
    assert w.shape == (64, 128) and w.dtype == np.float16
    # Each tile decodes independently: tile (1, 5) alone gives the same 16x16 block
    single = R.decode_trellis(tr[1:2, 5:6])
    assert np.array_equal(w[16:32, 80:96], single)


def test_bitstream_words_follow_the_stream_order_and_coverage():
    stream = _rng(4).integers(0, 256, 96, dtype=np.uint8)     # one K=3 tile: 768 bits
    words = R.tile_words_from_bitstream(stream.tobytes())
    assert words.size == 48
    bits = np.unpackbits(stream)                               # MSB-first, in stream order
    states = R.trellis_states(words.reshape(1, 1, 48))[0, 0]
    for t in (0, 1, 5, 100, 255):
        window = [bits[p % 768] for p in range(3 * (t + 1) - 16, 3 * (t + 1))]
        assert states[t] == int("".join(map(str, window)), 2)
    cover = R.state_coverage_trellis()
    assert cover.shape == (16, 16, 128)
    assert len(np.unique(R.trellis_states(cover))) > 0.995 * 65536


def test_k8_states_are_consecutive_stream_bytes():
    stream = np.arange(256, dtype=np.uint8)
    tile = R.tile_words_from_bitstream(stream.tobytes()).reshape(1, 1, 128)
    states = R.trellis_states(tile)[0, 0]
    assert states[1] == (0 << 8 | 1) and states[200] == (199 << 8 | 200) and states[0] == (255 << 8 | 0)


def test_decode_4096x2048_k3_has_unit_scale():
    tr = _trellis(_rng(5), 4096, 2048, 3)
    w = R.decode_trellis(tr)
    assert abs(float(w.astype(np.float32).std()) - 1.0) < 0.01


# ---- transforms and forwards --------------------------------------------------------------------------------


def test_hadamard_is_orthonormal_symmetric_sylvester():
    h = R.hadamard()
    assert h.shape == (128, 128)
    assert np.allclose(h @ h.T, np.eye(128), atol=1e-12)
    assert np.array_equal(h, h.T)
    assert np.allclose(np.abs(h), 1 / np.sqrt(128))
    assert np.all(h[0] > 0) and np.all(h[:, 0] > 0)
    assert np.allclose(h[:2, :2] * np.sqrt(128), [[1, 1], [1, -1]])


def test_effective_weight_matches_the_definition():
    rng = _rng(6)
    lin = _linear(rng, 256, 128)
    inner = lin.inner().astype(np.float64)
    hk = np.kron(np.eye(2), R.hadamard())
    hn = R.hadamard()
    expect = np.diag(lin.suh.astype(np.float64)) @ hk @ inner @ hn @ np.diag(lin.svh.astype(np.float64))
    assert np.allclose(lin.weight(), expect, rtol=1e-5, atol=1e-6)


def test_reconstruct_then_forward_equals_direct_forward():
    rng = _rng(7)
    lin = _linear(rng, 256, 384, k=4, cb="mcg")
    x = rng.standard_normal((5, 256)).astype(np.float32)
    direct = lin.forward(x)
    via_weight = x.astype(np.float64) @ lin.weight().astype(np.float64)
    assert direct.shape == (5, 384)
    assert np.allclose(direct, via_weight, rtol=1e-4, atol=1e-5)
    # the transform preserves norms, so y has the scale the fixture's svh implies (about |x|)
    assert 0.5 < float(np.linalg.norm(direct) / np.linalg.norm(x)) < 2.0


def test_swiglu_clamps_like_exllamav3():
    g = np.array([-20.0, -1.0, 0.0, 1.0, 9.0, 10.5, 30.0])
    u = np.array([50.0, -50.0, 1.0, 2.0, 3.0, -12.0, 1.0])
    a = R.swiglu(g, u, 10.0)
    silu = g / (1 + np.exp(-g))
    a16 = R.swiglu(g, u, 10.0, fp16=True)
    assert a16.dtype == np.float16 and a16[0] == 0.0 and a16[-1] == 10.0   # fp16 silu(-20) flushes to 0
    assert np.allclose(a, np.minimum(silu, 10.0) * np.clip(u, -10, 10))
    assert a[-1] == 10.0                          # activated gate clamped from above, after the activation
    assert np.allclose(R.swiglu(g, u, 0.0), silu * u)   # limit 0 disables the clamp


def test_expert_forward_composes_the_linears():
    rng = _rng(8)
    gate, up = _linear(rng, 256, 128), _linear(rng, 256, 128)
    down = _linear(rng, 128, 256)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    y = R.expert_forward(x, gate, up, down, 10.0, half_intermediate=False)
    a = R.swiglu(x @ gate.weight(), x @ up.weight(), 10.0)
    assert np.allclose(y, a @ down.weight(), rtol=1e-3, atol=1e-4)
    y16 = R.expert_forward(x, gate, up, down, 10.0)
    assert np.allclose(y16, y, rtol=2e-2, atol=2e-3)


def test_read_exl3_linear_from_a_generated_checkpoint(tmp_path):
    from glm53.fixture.exl3 import write_exl3_checkpoint

    out = write_exl3_checkpoint(tmp_path / "ck", layers=2, experts=4, top_k=2, mtp_layers=0)
    lin = R.read_exl3_linear(out, "model.language_model.layers.1.mlp.experts.3.down_proj")
    assert lin.codebook == "mul1" and lin.K == 3 and (lin.in_features, lin.out_features) == (128, 256)
    x = _rng(9).standard_normal((2, 128)).astype(np.float32)
    y = lin.forward(x)
    assert np.isfinite(y).all() and 0.3 < float(np.linalg.norm(y) / np.linalg.norm(x)) < 3.0
    with pytest.raises(KeyError):
        R.read_exl3_linear(out, "model.language_model.layers.1.mlp.experts.99.down_proj")


# ---- golden vectors from exllamav3 (tests/gpu/make_golden.py on the GPU machine) ---------------------------


@pytest.fixture(scope="module")
def golden():
    if not GOLDEN.exists():
        pytest.skip(f"{GOLDEN.relative_to(GOLDEN.parents[2])} is absent: make it on the GPU machine with "
                    "`python tests/gpu/make_golden.py` (needs CUDA + exllamav3 1.6.5) and commit it")
    with np.load(GOLDEN) as z:
        return {k: z[k] for k in z.files}


def _cases(golden, prefix: str) -> list[str]:
    return sorted({k.split("/")[1] for k in golden if k.startswith(prefix + "/")})


def test_golden_inner_weights_bit_exact(golden):
    cases = _cases(golden, "inner")
    assert len(cases) >= 9
    for name in cases:
        cb = name.split("_K")[0]
        got = R.decode_trellis(golden[f"inner/{name}/trellis"], cb)
        want = golden[f"inner/{name}/weight"]
        assert got.shape == want.shape, name
        diff = np.flatnonzero(got.view(np.uint16) != want.view(np.uint16))
        assert diff.size == 0, f"{name}: {diff.size} of {got.size} values differ, first at {diff[:5]}"


def test_golden_codebooks_bit_exact_over_all_states(golden):
    cover = R.state_coverage_trellis()
    for cb in _cases(golden, "cover"):
        w = np.ascontiguousarray(R.decode_trellis(cover, cb))
        assert np.array_equal(w[::37, ::41].view(np.uint16), golden[f"cover/{cb}/sample"].view(np.uint16)), cb
        assert hashlib.sha256(w.tobytes()).digest() == golden[f"cover/{cb}/sha256"].tobytes(), cb


def test_golden_full_weight_and_forward(golden):
    for cb in _cases(golden, "full"):
        g = {k.split("/")[2]: v for k, v in golden.items() if k.startswith(f"full/{cb}/")}
        lin = R.Exl3Linear(g["trellis"], g["suh"], g["svh"], cb)
        w = lin.weight()
        scale = float(np.abs(w).max())
        # exllamav3 rounds to fp16 between the transforms; 3 fp16 ulps of the largest weight bounds that
        for key in ("weight_torch", "weight_fused"):
            err = float(np.abs(w - g[key].astype(np.float32)).max())
            assert err < 3 * 2.0 ** -10 * scale, f"{cb} {key}: max error {err} vs scale {scale}"
        y = lin.forward(g["x"].astype(np.float32))
        rel = float(np.linalg.norm(y - g["y"]) / np.linalg.norm(g["y"]))
        assert rel < 2e-3, f"{cb} forward: relative error {rel}"


def test_golden_activation(golden):
    g, u, want = golden["act/g"], golden["act/u"], golden["act/a"]
    limit = float(golden["act/limit"])
    a = R.swiglu(g, u, limit, fp16=True)
    # fp16 emulation of the half kernel: the silu flush to 0 below g = -11.09 included (it was bit-exact on all
    # 1024 samples on the H200; h2exp / h2rcp are allowed one ulp)
    assert np.array_equal(a == 0, want == 0)
    ulps = np.abs(a.astype(np.float64) - want.astype(np.float64)) / np.spacing(np.abs(want)).astype(np.float64)
    assert ulps.max() <= 1 and (a.view(np.uint16) == want.view(np.uint16)).mean() >= 0.99
    # exact maths agrees within fp16 rounding except where the kernel flushes silu to zero
    exact = R.swiglu(g.astype(np.float64), u.astype(np.float64), limit)
    live = g.astype(np.float64) > -11.0
    assert np.allclose(exact[live], want[live].astype(np.float64), rtol=4e-3, atol=1e-4)

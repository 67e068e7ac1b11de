"""Reference EXL3 decoder in numpy: trellis -> weights, the sign/Hadamard transform, a linear and an expert MLP.

Written from exllamav3 1.6.5's CUDA sources (exllamav3_ext/quant/exl3_dq.cuh, codebook.cuh, reconstruct.cu,
activation_kernels.cuh) so that it needs neither a GPU nor exllamav3. `decode_trellis` reproduces
`ext.reconstruct` bit for bit (checked against golden vectors made on the GPU machine,
tests/data/exl3_golden.npz); the transforms and forwards are float32/float64 references, exact up to the
summation order of exllamav3's own GEMMs.

EXL3 in one paragraph. A linear's weight W (in x out, y = x W) is stored as an inner weight
W^ in 16x16 tiles, `trellis` int16 (in/16, out/16, 16*K): each tile is a 256*K-bit stream. Read as
little-endian uint32 words, bits MSB-first, element t of the tile is the 16-bit window ending at bit (t+1)*K,
wrapping around the tile (tail-biting). A codebook turns each 16-bit state into an fp16 value; elements land in
the tile in tensor-core order. Then W = diag(suh) H W^ H diag(svh), H block-diagonal 128x128 Sylvester
Hadamard / sqrt(128).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path

import numpy as np

MCG_MULT = 0xCBAC1FED
MUL1_MULT = 0x83DCD12D
INST3_MULT = 89226354
INST3_ADD = 64248484
HAD_DIM = 128
CODEBOOKS = ("3inst", "mcg", "mul1")


# --------------------------------------------------------------------------------------------------------------
# Codebooks: one fp16 value per 16-bit state, computed with the kernel's exact fp16 rounding steps


def _half_bits(bits: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(bits, dtype=np.uint16).view(np.float16)


def _lop3_sum(x: np.ndarray) -> np.ndarray:
    """mcg / 3INST tail: x = (x & 0x8FFF8FFF) ^ 0x3B603B60 (the kernel's lop3, LUT 0x6A), then
    __hadd(low half, high half): one fp16 addition, so one rounding of the exact sum. float64 holds the exact
    sum of two fp16 values (exponents here span 2^-3..2^0), and numpy's float64 -> float16 cast rounds to
    nearest even, which is __hadd's rounding."""
    x = (x & np.uint32(0x8FFF8FFF)) ^ np.uint32(0x3B603B60)
    lo = _half_bits((x & np.uint32(0xFFFF)).astype(np.uint16)).astype(np.float64)
    hi = _half_bits((x >> np.uint32(16)).astype(np.uint16)).astype(np.float64)
    return (lo + hi).astype(np.float16)


@cache
def codebook_table(codebook: str) -> np.ndarray:
    """fp16 value of every 16-bit trellis state (65536 entries, read-only) for 'mul1', 'mcg' or '3inst'."""
    s = np.arange(65536, dtype=np.uint32)
    if codebook == "mul1":
        # x = s * 0x83DCD12D; sum = dp4a(x, 0x01010101, 0x6400) adds the four unsigned bytes to 0x6400, whose fp16
        # reading is 1024 + b exactly (b <= 1020 stays inside [1024, 2048), where fp16 steps by 1). Then
        # __hfma(h, 0x1EEE, 0xC931): fused, so a single rounding of h * k_inv + k_bias. The product of two fp16
        # values is exact in float64 and so is the sum with k_bias, so casting the float64 result is the fma.
        x = s * np.uint32(MUL1_MULT)
        b = sum(((x >> np.uint32(8 * i)) & np.uint32(0xFF)) for i in range(4))
        h = _half_bits((0x6400 + b).astype(np.uint16)).astype(np.float64)
        k_inv = float(_half_bits(np.array([0x1EEE]))[0])
        k_bias = float(_half_bits(np.array([0xC931]))[0])
        table = (h * k_inv + k_bias).astype(np.float16)
    elif codebook == "mcg":
        table = _lop3_sum(s * np.uint32(MCG_MULT))
    elif codebook == "3inst":
        table = _lop3_sum(s * np.uint32(INST3_MULT) + np.uint32(INST3_ADD))
    else:
        raise ValueError(f"unknown codebook {codebook!r} (known: {', '.join(CODEBOOKS)})")
    table.setflags(write=False)
    return table


# --------------------------------------------------------------------------------------------------------------
# Trellis bit layout


def bits_per_weight(trellis_words: int) -> float:
    """K from the tile width: 16*K uint16 words per tile (16*KA + 8 for the half-integer K = KA + 0.5)."""
    k = trellis_words / 16
    if k.is_integer() and 1 <= k <= 8:
        return int(k)
    if (2 * k).is_integer() and k in (1.5, 2.5, 3.5):
        return k
    raise ValueError(f"trellis tiles of {trellis_words} words are not an EXL3 bitrate (1..8 or 1.5/2.5/3.5)")


@cache
def _window_ends(k2: int) -> tuple[np.ndarray, int]:
    """(end bit of each element's 16-bit window, bits per tile) for K = k2 / 2. Integer K: element t ends at
    (t+1)K. Half-integer K = KA + 0.5: steps alternate KA and KA+1 bits, odd positions carrying the extra bit
    (exllamav3's frac mask 0xAAAA)."""
    if k2 % 2 == 0:
        steps = np.full(256, k2 // 2, dtype=np.int64)
    else:
        ka = k2 // 2
        steps = ka + (np.arange(256) & 1)
    ends = np.cumsum(steps)
    return ends, int(ends[-1])


@cache
def _gather_plan(k2: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ends, total = _window_ends(k2)
    nwords = total // 32
    start = (ends - 16) % total                 # first (most significant) bit of the window; tail-biting wrap
    i0 = start // 32
    i1 = (i0 + 1) % nwords                      # a 16-bit window spans at most two 32-bit words
    shift = (48 - start % 32).astype(np.uint64)  # (w[i0] << 32 | w[i1]) >> shift puts the window's last bit at 0
    return i0, i1, shift


@cache
def tensor_core_perm() -> np.ndarray:
    """Element t of a tile -> row-major position r*16 + c: t = 8*lane + j lands at row 2*(lane%4) + (j&1) +
    8*((j>>1)&1), column lane//4 + 8*(j>>2) (the mma fragment layout the dequant kernels produce)."""
    t = np.arange(256)
    lane, j = t // 8, t % 8
    row = 2 * (lane % 4) + (j & 1) + 8 * ((j >> 1) & 1)
    col = lane // 4 + 8 * (j >> 2)
    return row * 16 + col


def trellis_states(trellis: np.ndarray) -> np.ndarray:
    """(tiles_k, tiles_n, 16*K) int16 trellis -> (tiles_k, tiles_n, 256) uint16 states in element order t."""
    trellis = np.asarray(trellis)
    if trellis.ndim != 3:
        raise ValueError(f"trellis must be 3-D (in/16, out/16, 16*K), got shape {trellis.shape}")
    k2 = int(round(2 * bits_per_weight(trellis.shape[-1])))
    tk, tn, nw = trellis.shape
    u16 = np.ascontiguousarray(trellis).view(np.uint16).reshape(tk * tn, nw)
    # Little-endian uint32 words: word i = u16[2i] | u16[2i+1] << 16
    words = u16[:, 0::2].astype(np.uint64) | (u16[:, 1::2].astype(np.uint64) << np.uint64(16))
    i0, i1, shift = _gather_plan(k2)
    merged = (words[:, i0] << np.uint64(32)) | words[:, i1]
    states = ((merged >> shift) & np.uint64(0xFFFF)).astype(np.uint16)
    return states.reshape(tk, tn, 256)


def decode_trellis(trellis: np.ndarray, codebook: str = "mul1") -> np.ndarray:
    """Inner weight W^ (in, out) fp16 exactly as exllamav3's `ext.reconstruct` produces it (rotated basis)."""
    states = trellis_states(trellis)
    tk, tn, _ = states.shape
    vals = codebook_table(codebook)[states]                 # (tk, tn, 256) in element order
    tiles = np.empty_like(vals)
    tiles[..., tensor_core_perm()] = vals                   # element t -> its row-major tile position
    return tiles.reshape(tk, tn, 16, 16).transpose(0, 2, 1, 3).reshape(tk * 16, tn * 16)


def tile_words_from_bitstream(stream: bytes | np.ndarray) -> np.ndarray:
    """Inverse of the word layout: a tile's bitstream bytes (in stream order, MSB first) -> its int16 words."""
    b = np.frombuffer(bytes(stream), dtype=np.uint8) if not isinstance(stream, np.ndarray) else stream.astype(np.uint8)
    if b.size % 4:
        raise ValueError("a tile bitstream is a whole number of 32-bit words")
    w = b.reshape(-1, 4).astype(np.uint32)
    w = (w[:, 0] << 24) | (w[:, 1] << 16) | (w[:, 2] << 8) | w[:, 3]
    u16 = np.empty(2 * w.size, dtype=np.uint16)
    u16[0::2] = w & 0xFFFF
    u16[1::2] = w >> 16
    return u16.view(np.int16)


def state_coverage_trellis() -> np.ndarray:
    """A K=8 trellis (256 x 256 weights) whose elements visit over 99.5% of the 65536 states: at K=8 each state is
    two consecutive stream bytes, so the tiles are cut from a de Bruijn sequence B(256, 2). Decoding it checks
    a codebook almost exhaustively against a real decoder."""
    seq = _de_bruijn_256_2()
    tiles = [tile_words_from_bitstream(seq[256 * i: 256 * (i + 1)]) for i in range(256)]
    return np.stack(tiles).reshape(16, 16, 128)


@lru_cache(maxsize=1)
def _de_bruijn_256_2() -> np.ndarray:
    # de Bruijn sequence B(256, 2) by the Lyndon-word (FKM) construction: every byte pair occurs once
    k, n = 256, 2
    a = [0] * (k * n)
    seq: list[int] = []

    def db(t: int, p: int) -> None:
        if t > n:
            if n % p == 0:
                seq.extend(a[1:p + 1])
        else:
            a[t] = a[t - p]
            db(t + 1, p)
            for j in range(a[t - p] + 1, k):
                a[t] = j
                db(t + 1, t)

    db(1, 1)
    return np.array(seq, dtype=np.uint8)


# --------------------------------------------------------------------------------------------------------------
# Hadamard / sign transform and the effective weight


@cache
def hadamard(n: int = HAD_DIM) -> np.ndarray:
    """Sylvester Hadamard / sqrt(n), float64 (exllamav3 builds its 128 the same way from H1; symmetric)."""
    if n & (n - 1):
        raise ValueError("Sylvester Hadamard needs a power of two")
    i = np.arange(n)
    popcount = np.vectorize(lambda v: bin(v).count("1"))(i[:, None] & i[None, :])
    h = np.where(popcount % 2 == 0, 1.0, -1.0) / np.sqrt(n)
    h.setflags(write=False)
    return h


def had_rows(x: np.ndarray) -> np.ndarray:
    """Apply H blockwise along the last axis (x @ blockdiag(H)), float64."""
    n = x.shape[-1]
    if n % HAD_DIM:
        raise ValueError(f"dimension {n} is not a multiple of {HAD_DIM}")
    y = np.asarray(x, dtype=np.float64).reshape(*x.shape[:-1], n // HAD_DIM, HAD_DIM) @ hadamard()
    return y.reshape(x.shape)


def effective_weight(inner: np.ndarray, suh: np.ndarray, svh: np.ndarray) -> np.ndarray:
    """W = diag(suh) H W^ H diag(svh) (float64): the original-basis weight, y = x W."""
    w = np.asarray(inner, dtype=np.float64)
    w = had_rows(w.T).T                      # H W^ (left Hadamard over the input dim, blockwise)
    w = w * np.asarray(suh, dtype=np.float64)[:, None]
    w = had_rows(w)                          # (.) H over the output dim
    return w * np.asarray(svh, dtype=np.float64)[None, :]


# --------------------------------------------------------------------------------------------------------------
# Linears and the expert MLP


@dataclass(frozen=True)
class Exl3Linear:
    trellis: np.ndarray   # int16 (in/16, out/16, 16*K)
    suh: np.ndarray       # fp16 (in,)
    svh: np.ndarray       # fp16 (out,)
    codebook: str = "mul1"

    @property
    def in_features(self) -> int:
        return self.trellis.shape[0] * 16

    @property
    def out_features(self) -> int:
        return self.trellis.shape[1] * 16

    @property
    def K(self) -> float:
        return bits_per_weight(self.trellis.shape[-1])

    def inner(self) -> np.ndarray:
        return decode_trellis(self.trellis, self.codebook)

    def weight(self) -> np.ndarray:
        """Original-basis weight (in, out), float32."""
        return effective_weight(self.inner(), self.suh, self.svh).astype(np.float32)

    def forward(self, x: np.ndarray, inner: np.ndarray | None = None) -> np.ndarray:
        """y = x W the way the kernels do it, without forming W: H(x * suh) -> x W^ -> H(.) * svh. float32."""
        x = np.asarray(x, dtype=np.float64)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input width {x.shape[-1]} != in_features {self.in_features}")
        w = self.inner() if inner is None else inner
        xh = had_rows(x * self.suh.astype(np.float64))
        y = had_rows(xh @ w.astype(np.float64)) * self.svh.astype(np.float64)
        return y.astype(np.float32)

    def forward_fp16(self, x: np.ndarray, inner: np.ndarray | None = None) -> np.ndarray:
        """forward() with a GPU kernel's fp16 roundings: the input, the transformed input H(x * suh), the GEMM's
        output (exact fp16 weights, a wide accumulator) and the output transform each rounded to fp16. float16.
        An estimate of the error a GPU computation carries against float64 maths, for the CPU lane's integer
        kernel to be measured against (tests/cpu_lane/test_cpu_lane_kernel.py), not exllamav3's exact rounding
        order."""
        x = _f16(x)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input width {x.shape[-1]} != in_features {self.in_features}")
        w = self.inner() if inner is None else inner
        xh = _f16(had_rows(x * self.suh.astype(np.float64)))
        y = _f16(xh @ w.astype(np.float64))
        return (had_rows(y) * self.svh.astype(np.float64)).astype(np.float16)


def _f16(x: np.ndarray) -> np.ndarray:
    """x rounded to fp16, as float64."""
    return np.asarray(x, dtype=np.float64).astype(np.float16).astype(np.float64)


def silu(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x / (1.0 + np.exp(-x))


def silu_fp16(x: np.ndarray) -> np.ndarray:
    """silu as exllamav3's half kernels compute it (act_mul_kernel_h and the fused MoE kernels' _silu):
    x * rcp(1 + exp(-x)), every step rounded to fp16. exp(-x) overflows fp16 below x = -11.09, so silu is
    exactly 0 there (float silu would give about -1.7e-4). h2exp / h2rcp are within an ulp of the rounded
    exact values used here."""
    x = np.asarray(x, dtype=np.float16)
    with np.errstate(over="ignore"):
        e = np.exp(-x.astype(np.float32)).astype(np.float16)
    s = (np.float32(1.0) + e.astype(np.float32)).astype(np.float16)
    with np.errstate(divide="ignore"):
        r = (np.float32(1.0) / s.astype(np.float32)).astype(np.float16)
    return (x.astype(np.float32) * r.astype(np.float32)).astype(np.float16)


def swiglu(g: np.ndarray, u: np.ndarray, limit: float, fp16: bool = False) -> np.ndarray:
    """exllamav3's clamped SwiGLU (act_mul_kernel_*, the fused MoE kernels, the CPU MoE kernel):
    min(silu(g), limit) * clamp(u, -limit, limit); limit 0 disables the clamp. Note the gate is clamped AFTER
    the activation, unlike transformers' Glm5Next (silu(min(g, limit))); the two differ only where
    silu(g) > limit, i.e. g > ~limit, by less than limit * e^-limit relative.

    fp16=False: exact float64 maths. fp16=True: the GPU kernels' half arithmetic (silu_fp16, fp16 clamps, one
    fp16 rounding of the product), returning float16."""
    if fp16:
        a = silu_fp16(g)
        u16 = np.asarray(u, dtype=np.float16)
        if limit:
            lim = np.float16(limit)
            a = np.minimum(a, lim)
            u16 = np.clip(u16, -lim, lim)
        return (a.astype(np.float32) * u16.astype(np.float32)).astype(np.float16)
    a = silu(g)
    u = np.asarray(u, dtype=np.float64)
    if limit:
        a = np.minimum(a, limit)
        u = np.clip(u, -limit, limit)
    return a * u


def expert_forward(x: np.ndarray, gate: Exl3Linear, up: Exl3Linear, down: Exl3Linear, swiglu_limit: float = 10.0,
                   half_intermediate: bool = True) -> np.ndarray:
    """One routed expert: down(swiglu(gate(x), up(x))). With half_intermediate (what exllamav3 does for
    Glm5Next: interm_dtype half) the gate/up outputs are rounded to fp16 and the activation runs in fp16
    arithmetic (swiglu(fp16=True)); otherwise everything is exact float64 maths. The result is float32."""
    g, u = gate.forward(x), up.forward(x)
    if half_intermediate:
        a = swiglu(g.astype(np.float16), u.astype(np.float16), swiglu_limit, fp16=True)
    else:
        a = swiglu(g, u, swiglu_limit)
    return down.forward(a)


def expert_forward_fp16(x: np.ndarray, gate: Exl3Linear, up: Exl3Linear, down: Exl3Linear,
                        swiglu_limit: float = 10.0) -> np.ndarray:
    """expert_forward in a GPU's fp16 arithmetic: each linear's forward_fp16, the SwiGLU in fp16
    (swiglu(fp16=True)). float32. The yardstick for the error of an approximate kernel: a GPU-like
    computation is this far from float64 maths."""
    g, u = gate.forward_fp16(x), up.forward_fp16(x)
    return down.forward_fp16(swiglu(g, u, swiglu_limit, fp16=True)).astype(np.float32)


def read_exl3_linear(checkpoint: Path | str, key: str) -> Exl3Linear:
    """Load one EXL3 linear `key` (e.g. '...experts.7.gate_proj') from the safetensors files of a checkpoint
    directory, reading headers from disk (not the index). The codebook follows the marker tensors:
    `.mcg` -> mcg, `.mul1` -> mul1, none -> 3INST."""
    from safetensors import safe_open

    found: dict[str, np.ndarray] = {}
    for path in sorted(Path(checkpoint).glob("*.safetensors")):
        with safe_open(str(path), framework="numpy") as f:
            for sfx in ("trellis", "suh", "svh", "mcg", "mul1"):
                name = f"{key}.{sfx}"
                if name in f.keys():
                    found[sfx] = f.get_tensor(name)
    missing = [s for s in ("trellis", "suh", "svh") if s not in found]
    if missing:
        raise KeyError(f"{key}: no {', '.join(missing)} in {checkpoint}/*.safetensors")
    codebook = "mcg" if "mcg" in found else "mul1" if "mul1" in found else "3inst"
    return Exl3Linear(found["trellis"], found["suh"], found["svh"], codebook)

"""Make tests/data/exl3_golden.npz with exllamav3's own code (run once on the GPU machine, then commit the file).

    python tests/gpu/make_golden.py [--out tests/data/exl3_golden.npz]

Needs CUDA torch and exllamav3 1.6.5 (its extension JIT-compiles on first import, ~5 minutes). Every input is
made from a fixed seed here, stored in the file next to what exllamav3 made of it, and tests/test_exl3ref.py
replays the inputs through glm53.exl3ref:

- `inner/<cb>_K<k>`: ext.reconstruct (via LinearEXL3.get_inner_weight_tensor) of a random 32 x 256 trellis, for
  every codebook (3inst, mcg, mul1) at K = 2, 3, 4 and mul1 at K = 2.5. Compared bit for bit.
- `cover/<cb>`: sha256 of ext.reconstruct of glm53.exl3ref.state_coverage_trellis() (K = 8, over 99.5% of all
  65536 states), so one hash checks each codebook almost exhaustively. Compared bit for bit.
- `full/<cb>`: a 128 x 256 K=3 linear with random suh/svh: LinearEXL3.get_weight_tensor() (torch Hadamards),
  ext.reconstruct_had_slice (the fused kernel), and LinearEXL3.forward on 4 rows (the GEMV kernel). These go
  through fp16 roundings and GEMM summation orders, so they are compared within a tolerance.
- `act`: ext.silu_mul(g, u, a, 10.0) on fp16 inputs spanning the clamp, compared within fp16 tolerance.
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SEED = 20261129
INNER_SHAPE = (32, 256)   # reconstruct needs out % 128 == 0; 32 rows keep the file small
FULL_SHAPE = (128, 256)   # the Hadamard transforms need both dims % 128 == 0
CASES = [(cb, k) for cb in ("3inst", "mcg", "mul1") for k in (2, 3, 4)] + [("mul1", 2.5)]


def words_per_tile(k: float) -> int:
    return int(16 * k)


def random_trellis(rng: np.random.Generator, shape: tuple[int, int], k: float) -> np.ndarray:
    return rng.integers(-32768, 32767, (shape[0] // 16, shape[1] // 16, words_per_tile(k)), dtype=np.int16,
                        endpoint=True)


def random_signs_scales(rng: np.random.Generator, n: int, scale: float) -> np.ndarray:
    sign = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    return (sign * scale * np.exp(0.1 * rng.standard_normal(n))).astype(np.float16)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "exl3_golden.npz")
    args = ap.parse_args()

    import torch
    from exllamav3.ext import exllamav3_ext as ext
    from exllamav3.modules.quant.exl3 import LinearEXL3
    from exllamav3.modules.quant.exl3_lib.quantize import codebook_mcg_mult, codebook_mul1_mult
    from exllamav3.version import __version__ as exl3_version

    from glm53.exl3ref import state_coverage_trellis

    dev = torch.device("cuda:0")
    rng = np.random.default_rng(SEED)

    def markers(cb: str):
        # The loader hands LinearEXL3 a CPU int32 scalar holding the multiplier; only its presence matters
        mcg = torch.tensor(codebook_mcg_mult, dtype=torch.uint32).view(torch.int) if cb == "mcg" else None
        mul1 = torch.tensor(codebook_mul1_mult, dtype=torch.uint32).view(torch.int) if cb == "mul1" else None
        return mcg, mul1

    def linear(trellis: np.ndarray, suh: np.ndarray, svh: np.ndarray, cb: str) -> LinearEXL3:
        mcg, mul1 = markers(cb)
        k_in, k_out = trellis.shape[0] * 16, trellis.shape[1] * 16
        return LinearEXL3(None, k_in, k_out, None, None, None,
                          torch.from_numpy(suh).to(dev), torch.from_numpy(svh).to(dev),
                          torch.from_numpy(trellis).to(dev), mcg, mul1, None, None)

    out: dict[str, np.ndarray] = {}
    for cb, k in CASES:
        name = f"{cb}_K{k}"
        tr = random_trellis(rng, INNER_SHAPE, k)
        ones_in = np.ones(INNER_SHAPE[0], dtype=np.float16)
        ones_out = np.ones(INNER_SHAPE[1], dtype=np.float16)
        lin = linear(tr, ones_in, ones_out, cb)
        out[f"inner/{name}/trellis"] = tr
        out[f"inner/{name}/weight"] = lin.get_inner_weight_tensor().cpu().numpy()
        print(f"inner {name}: {out[f'inner/{name}/weight'].shape}")

    cover = state_coverage_trellis()
    for cb in ("3inst", "mcg", "mul1"):
        lin = linear(cover, np.ones(cover.shape[0] * 16, np.float16), np.ones(cover.shape[1] * 16, np.float16), cb)
        w = np.ascontiguousarray(lin.get_inner_weight_tensor().cpu().numpy())
        out[f"cover/{cb}/sha256"] = np.frombuffer(hashlib.sha256(w.tobytes()).digest(), dtype=np.uint8)
        out[f"cover/{cb}/sample"] = w[::37, ::41].copy()   # a few values, for a readable diff on mismatch
        print(f"cover {cb}: {hashlib.sha256(w.tobytes()).hexdigest()[:16]}")

    for cb in ("3inst", "mcg", "mul1"):
        tr = random_trellis(rng, FULL_SHAPE, 3)
        suh = random_signs_scales(rng, FULL_SHAPE[0], 1.0)
        svh = random_signs_scales(rng, FULL_SHAPE[1], 1.0 / np.sqrt(FULL_SHAPE[0]))
        x = rng.standard_normal((4, FULL_SHAPE[0])).astype(np.float16)
        lin = linear(tr, suh, svh, cb)
        mcg, mul1 = markers(cb)
        fused = torch.empty(FULL_SHAPE, dtype=torch.half, device=dev)
        ext.reconstruct_had_slice(fused, lin.trellis, lin.suh, lin.svh, lin.K, mcg is not None, mul1 is not None, 0)
        y = lin.forward(torch.from_numpy(x).to(dev).contiguous(), {})
        for key, val in [("trellis", tr), ("suh", suh), ("svh", svh), ("x", x),
                         ("weight_torch", lin.get_weight_tensor().cpu().numpy()),
                         ("weight_fused", fused.cpu().numpy()), ("y", y.float().cpu().numpy())]:
            out[f"full/{cb}/{key}"] = val
        print(f"full {cb}: y {tuple(y.shape)} {y.dtype}")

    g = np.linspace(-16, 16, 1024).astype(np.float16)
    u = rng.permutation(np.linspace(-16, 16, 1024)).astype(np.float16)
    a = torch.empty(1024, dtype=torch.half, device=dev)
    ext.silu_mul(torch.from_numpy(g).to(dev), torch.from_numpy(u).to(dev), a, 10.0)
    out["act/g"], out["act/u"], out["act/a"], out["act/limit"] = g, u, a.cpu().numpy(), np.array(10.0)

    out["meta/exllamav3"] = np.array(exl3_version)
    out["meta/torch"] = np.array(torch.__version__)
    out["meta/device"] = np.array(torch.cuda.get_device_name(dev))
    out["meta/host"] = np.array(platform.node())
    out["meta/seed"] = np.array(SEED)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **out)
    size = args.out.stat().st_size
    print(f"wrote {args.out} ({size / 1024:.0f} KiB, exllamav3 {exl3_version})")
    if size > 1 << 20:
        print("warning: golden file exceeds 1 MiB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Images on the GPU machine (python3 -m pytest -m gpu tests/engine/test_gpu_vision.py -s; tests/gpu/session.sh's
`vision` step): generated EXL3 checkpoints WITH the vision tower (glm53 fixture --kind exl3 --vision).

- Text with an image, greedy, in glm53's exact mode (the experts tiered: a few VRAM slots per MoE layer, the rest
  in the pinned RAM tier) is bit-identical to stock exllamav3 (all experts in VRAM) given the same embeddings:
  tiny, and at the real width with the real tower's dims.
- exllamav3's own embedding count for images of every shape is glm53.engine.vision.image_tokens() (the prompt
  layout the server makes and the engine checks).
- The figures for docs/results.md, printed: the tower's VRAM (its weights, and torch's peak while it encodes a
  1280x800 PNG screenshot) beside the plan's estimate, and the time to the first token for that screenshot (the
  tower's encode and the prefill of its ~1,334 tokens) in stock and exact mode, at two MoE layers and at full depth.
- The engine (Exl3Engine, exact mode) takes an image end to end and answers what stock exllamav3 answers.
"""

from __future__ import annotations

import asyncio
import gc
import io
import time

import numpy as np
import pytest
from specs import spec_for

from glm53.engine import vision
from glm53.fixture.exl3 import write_exl3_checkpoint

pytestmark = pytest.mark.gpu

STEPS = 64
SCREENSHOT = (1280, 800)  # width, height


def picture(width: int, height: int, seed: int = 0):
    """A PNG's decoded image: smooth gradients with noise, like a screenshot's mix of flat and busy regions."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([(x * 255 // max(1, width - 1)), (y * 255 // max(1, height - 1)), ((x + y) % 256)], -1)
    noise = rng.integers(0, 48, (height, width, 3))
    buf = io.BytesIO()
    Image.fromarray(((base + noise) % 256).astype(np.uint8)).save(buf, format="PNG")
    return Image.open(io.BytesIO(buf.getvalue()))


def load_tower(model_dir):
    """exllamav3's vision component of the checkpoint on cuda:0: (config, tokenizer, model, weight bytes)."""
    import torch
    from exllamav3 import Config, Model, Tokenizer

    config = Config.from_directory(str(model_dir))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    tower = Model.from_config(config, component="vision")
    tower.load(device=torch.device("cuda:0"))
    torch.cuda.synchronize()
    return config, Tokenizer.from_config(config), tower, torch.cuda.memory_allocated() - before


def encode_peak(tower, tokenizer, image) -> tuple[object, int, float]:
    """(MMEmbedding, torch's peak allocation above the start while encoding, seconds)."""
    import torch

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    with torch.inference_mode():
        mme = tower.get_image_embeddings(tokenizer, image)
    torch.cuda.synchronize()
    return mme, torch.cuda.max_memory_allocated() - base, time.perf_counter() - t0


def image_prompt(mme, vocab: int) -> list[int]:
    """Text, the image (begin, its placeholder ids, end), text."""
    head = [(7 * i + 3) % vocab for i in range(24)]
    tail = [(11 * i + 5) % vocab for i in range(12)]
    return head + list(mme.token_list) + tail


def greedy_with_image(model_dir, ids, mme, steps, slots=None, ttft_image=None, tokenizer=None, tower=None) -> dict:
    """`steps` greedy tokens (and their logits) after `ids`, the job given `mme`; stock without `slots`, else
    exact with that many VRAM slots per MoE layer. ttft_image: afterwards, time a fresh encode of that image plus
    its prompt's prefill to the first token, twice (the first may compile kernels), on the same model."""
    import torch
    from exllamav3 import ArgmaxSampler, Cache, Config, Generator, Job, Model, Tokenizer

    from glm53.exl3.tiered import TieredMoE

    config = Config.from_directory(str(model_dir))
    model = Model.from_config(config)
    cache = Cache(model, max_num_tokens=8192)
    tiered = None
    if slots is not None:
        tiered = TieredMoE(model, model_dir, spec_for(model_dir, "exact", slots, device="cuda:0", kv_tokens=8192))
        tiered.install()
    model.load(device=torch.device("cuda:0"))
    if tiered is not None:
        tiered.populate()
    try:
        gen = Generator(model=model, cache=cache, tokenizer=Tokenizer.from_config(config), max_batch_size=1)

        def run(prompt, embeddings, n):
            gen.enqueue(Job(input_ids=torch.tensor([prompt], dtype=torch.long), max_new_tokens=n,
                            sampler=ArgmaxSampler(), stop_conditions=[], return_logits=True, embeddings=embeddings))
            tokens, logits, first = [], [], None
            while gen.num_remaining_jobs():
                for r in gen.iterate():
                    if r.get("stage") == "streaming" and "token_ids" in r:
                        first = first or time.perf_counter()
                        tokens += r["token_ids"][0].tolist()
                        logits.append(r["logits"][0].float().cpu())
            return tokens, torch.cat(logits), first

        with torch.inference_mode():
            tokens, logits, _ = run(ids, [mme], steps)
            out = {"tokens": tokens, "logits": logits, "ttft": []}
            for _ in range(2 if ttft_image is not None else 0):
                t0 = time.perf_counter()
                shot = tower.get_image_embeddings(tokenizer, ttft_image)  # a fresh embedding: new ids, no cached pages
                _, _, first = run(image_prompt(shot, 200), [shot], 1)
                out["ttft"].append(first - t0)
        if tiered is not None:
            tiered.check_invariants()
            out["stats"] = tiered.snapshot()
        return out
    finally:
        model.unload()
        if tiered is not None:
            tiered.close()
        del model, cache
        gc.collect()
        torch.cuda.empty_cache()


def assert_same(stock: dict, exact: dict, steps: int) -> None:
    import torch

    assert len(stock["tokens"]) == len(exact["tokens"]) == steps
    for t in range(steps):
        if not torch.equal(stock["logits"][t], exact["logits"][t]):
            diff = (stock["logits"][t] - exact["logits"][t]).abs().max().item()
            raise AssertionError(f"logits differ at generated token {t} (max |diff| {diff:.3e})")
    assert stock["tokens"] == exact["tokens"]


def check_counts(tower, tokenizer, spec) -> None:
    """exllamav3's embedding count is image_tokens() for images of every shape, the screenshot included."""
    import torch

    for w, h in ((7, 5), (64, 48), (300, 120), SCREENSHOT, (120, 1900), (1920, 1080)):
        with torch.inference_mode():
            mme = tower.get_image_embeddings(tokenizer, picture(w, h, seed=w))
        assert mme.mm_length == vision.image_tokens(h, w, spec), (w, h, mme.mm_length)
        assert mme.token_list[0] == spec.image_start_id and mme.token_list[-1] == spec.image_end_id


def test_tiny_image_exact_bit_identical_to_stock(tmp_path, exl3):
    path = write_exl3_checkpoint(tmp_path / "tiny", router_skew=(0.25, 0.5), layers=4, dense_layers=1, vision=True)
    _, tokenizer, tower, _ = load_tower(path)
    try:
        check_counts(tower, tokenizer, vision.read_vision_spec(path))
        mme, _, _ = encode_peak(tower, tokenizer, picture(200, 150, seed=1))
        other, _, _ = encode_peak(tower, tokenizer, picture(200, 150, seed=2))
    finally:
        tower.unload()
    ids = image_prompt(mme, 200)
    stock = greedy_with_image(path, ids, mme, STEPS)
    exact = greedy_with_image(path, ids, mme, STEPS, slots=2)
    assert_same(stock, exact, STEPS)
    assert exact["stats"]["picks"]["pcie"] > 0
    # The image reaches the model: another picture in the same place changes the logits.
    changed = greedy_with_image(path, image_prompt(other, 200), other, 1)
    assert not np.array_equal(changed["logits"][0].numpy(), stock["logits"][0].numpy())
    print(f"\ntiny with a {mme.mm_length}-token image: {STEPS} greedy tokens bit-identical, exact (2 slots/layer) "
          f"vs stock; picks {exact['stats']['picks']}")


def screenshot_stock_and_exact(path, slots: int, what: str, inspect=None) -> None:
    """The screenshot's greedy text in stock and in exact mode at `slots` VRAM slots a layer, bit-identical, and its
    time to the first token in each, printed. inspect(tower, tokenizer, shot, weight bytes), before the runs, checks
    and prints more."""
    _, tokenizer, tower, weights = load_tower(path)
    shot = picture(*SCREENSHOT, seed=3)
    try:
        if inspect is not None:
            inspect(tower, tokenizer, shot, weights)
        mme, _, _ = encode_peak(tower, tokenizer, shot)
        ids = image_prompt(mme, 200)
        stock = greedy_with_image(path, ids, mme, STEPS, ttft_image=shot, tokenizer=tokenizer, tower=tower)
        exact = greedy_with_image(path, ids, mme, STEPS, slots=slots, ttft_image=shot, tokenizer=tokenizer,
                                  tower=tower)
    finally:
        tower.unload()
    assert_same(stock, exact, STEPS)
    print(f"\n{what} with the screenshot ({len(ids)} prompt tokens): {STEPS} greedy tokens bit-identical, exact "
          f"({slots} slots/layer) vs stock; picks {exact['stats']['picks']}")
    print(f"TTFT for the screenshot, {what} (encode + prefill to the first token; first run, then warm): stock "
          + ", ".join(f"{t:.3f} s" for t in stock["ttft"]) + f"; exact {slots} slots/layer "
          + ", ".join(f"{t:.3f} s" for t in exact["ttft"]))


def test_glm53_width_image_exact_bit_identical_vram_and_ttft(tmp_path, exl3):
    """Real width, two MoE layers, the real tower's dims (bf16 random weights); the figures for docs/results.md."""
    from glm53.planning import plan as P
    from glm53.planning.shape import from_checkpoint

    path = write_exl3_checkpoint(tmp_path / "glm53", shape="glm53", moe_layers=2, mtp_layers=0, shards=4, vision=True)

    def tower_vram(tower, tokenizer, shot, weights):
        check_counts(tower, tokenizer, vision.read_vision_spec(path))
        encode_peak(tower, tokenizer, shot)  # compiles the tower's kernels for this shape
        mme, peak, encode_s = encode_peak(tower, tokenizer, shot)
        shape = from_checkpoint(path)
        planned, why = P.vision_tower_bytes(shape)
        print(f"\nvision tower (real dims, bf16): weights {weights / 2**30:.3f} GiB on the device "
              f"(headers: {shape.vision_bytes / 2**30:.3f} GiB); encoding a {SCREENSHOT[0]}x{SCREENSHOT[1]} PNG "
              f"({mme.mm_length} tokens) peaks {peak / 2**30:.3f} GiB above the weights, in {encode_s * 1e3:.0f} ms; "
              f"the plan counts {planned / 2**30:.3f} GiB ({why})")
        assert mme.mm_length == vision.image_tokens(SCREENSHOT[1], SCREENSHOT[0], vision.read_vision_spec(path))

    screenshot_stock_and_exact(path, 16, "glm53 width x2 MoE layers", tower_vram)


def test_full_depth_image_exact_bit_identical_and_ttft(tmp_path, exl3):
    """The real depth (45 layers in the real pattern, FULL_DEPTH's bit widths) and width with the real tower's dims,
    8 routed experts a layer: the screenshot's greedy text bit-identical in exact mode (4 VRAM slots a layer, so
    about half of the picks cross PCIe) and its time to the first token, stock beside exact."""
    from glm53.fixture.exl3 import FULL_DEPTH

    path = write_exl3_checkpoint(tmp_path / "depth", shape="glm53", experts=8, shards=8, vision=True, **FULL_DEPTH)
    screenshot_stock_and_exact(path, 4, "glm53 full depth (45 layers, 8 experts a layer)")


def test_engine_takes_an_image_and_answers_as_stock(tmp_path, exl3):
    """Exl3Engine in exact mode, a prompt laid out as the server lays it out (image tokens at the image's span):
    the greedy answer is stock exllamav3's with the same image (up to the end-of-turn token the engine stops on);
    the image sent again reuses its embedding."""
    from glm53.engine.exl3_engine import Exl3Engine
    from glm53.engine.interface import SamplingParams, TokenEvent

    path = write_exl3_checkpoint(tmp_path / "tiny", router_skew=(0.25, 0.5), layers=4, dense_layers=1, vision=True)
    spec = vision.read_vision_spec(path)
    img = picture(200, 150, seed=1)
    _, tokenizer, tower, _ = load_tower(path)
    try:
        mme, _, _ = encode_peak(tower, tokenizer, img)
    finally:
        tower.unload()
    n = mme.mm_length
    head, tail = [(7 * i + 3) % 200 for i in range(24)], [(11 * i + 5) % 200 for i in range(12)]
    prompt = head + [spec.image_start_id] + [spec.image_token_id] * n + [spec.image_end_id] + tail
    px, grid = vision.pixels(img, spec)
    image = vision.PromptImage("f" * 64, len(head) + 1, n, px, grid, image=img)
    stock = greedy_with_image(path, head + list(mme.token_list) + tail, mme, 16)

    engine = Exl3Engine(path, spec_for(path, "exact", 2, device="cuda:0"))
    engine.load()
    try:
        async def answer():
            events = [e async for e in engine.generate(prompt, SamplingParams(temperature=0, max_tokens=16), "v1",
                                                      images=[image])]
            return [e.token_id for e in events if isinstance(e, TokenEvent)]

        # The engine stops on the checkpoint's end-of-turn tokens, the stock run does not: its answer is a prefix.
        first = asyncio.run(answer())
        assert first and first == stock["tokens"][:len(first)]
        assert asyncio.run(answer()) == first
        counts = engine.stats()["vision"]
        assert counts["available"] and counts["images_encoded"] == 1 and counts["image_embeddings_reused"] == 1
    finally:
        engine.close()

"""Stock exllamav3 loads the synthetic EXL3 fixture and generates from it (GPU machine: pytest -m gpu).

On the GPU machine: `source .device-cache/setup.sh && python3 -m pytest -m gpu tests/test_gpu_exl3_fixture.py`.
"""

from __future__ import annotations

import gc
import time

import pytest

from glm53.fixture.exl3 import write_exl3_checkpoint

pytestmark = pytest.mark.gpu


def _load_and_generate(path, exl3) -> dict:
    import torch

    t0 = time.monotonic()
    config = exl3.Config.from_directory(str(path))
    model = exl3.Model.from_config(config)
    cache = exl3.Cache(model, max_num_tokens=4096)
    model.load()
    load_s = time.monotonic() - t0
    tokenizer = exl3.Tokenizer.from_config(config)
    try:
        ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)
        logits = model.forward(ids, {"attn_mode": "flash_attn_nc"})
        assert logits.shape[-1] >= config.vocab_size
        assert torch.isfinite(logits[..., : config.vocab_size].float()).all(), "non-finite logits"

        generator = exl3.Generator(model=model, cache=cache, tokenizer=tokenizer)
        prompt = model.default_chat_prompt("Say something.")
        t1 = time.monotonic()
        text, last = generator.generate(prompt=prompt, max_new_tokens=32, min_new_tokens=16, add_bos=False,
                                        encode_special_tokens=True, completion_only=True,
                                        return_last_results=True)
        gen_s = time.monotonic() - t1
        assert isinstance(text, str)
        new_tokens = last.get("new_tokens", 0) if isinstance(last, dict) else 0
        assert new_tokens >= 16, f"generated {new_tokens} tokens"
        return {"load_s": load_s, "gen_s": gen_s, "new_tokens": new_tokens, "text": text}
    finally:
        model.unload()
        del model, cache
        gc.collect()
        torch.cuda.empty_cache()


def test_tiny_exl3_fixture_loads_and_generates(tmp_path, exl3):
    path = write_exl3_checkpoint(tmp_path / "tiny", router_skew=(0.25, 0.5), shards=2, omit_from_index=True)
    r = _load_and_generate(path, exl3)
    print(f"tiny: load {r['load_s']:.1f} s, {r['new_tokens']} tokens in {r['gen_s']:.2f} s: {r['text'][:60]!r}")


@pytest.mark.parametrize("moe_layers", [2, 3])
def test_glm53_width_fixture_loads_and_generates(tmp_path, exl3, moe_layers):
    # Real width (hidden 4096, 288 experts of 9 MiB at K=3) after 1 dense layer: 2 MoE layers is about 9 GB on
    # disk, all KDA; 3 MoE layers adds layer 3, the first full-width MLA + DSA indexer layer.
    path = write_exl3_checkpoint(tmp_path / "glm53", shape="glm53", moe_layers=moe_layers, mtp_layers=0, shards=4,
                                 router_skew=(0.11, 0.40))
    r = _load_and_generate(path, exl3)
    print(f"glm53 x{moe_layers}: load {r['load_s']:.1f} s, {r['new_tokens']} tokens in {r['gen_s']:.2f} s")

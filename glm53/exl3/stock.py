"""Stock exllamav3, untouched by glm53's tiers: the reference the benches measure glm53 against."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any


def load(model_dir: Path, cache_tokens: int, device: str = "cuda:0") -> tuple[Any, Any]:
    """The checkpoint loaded whole on `device` with a one-sequence cache of `cache_tokens`: (tokenizer, generator)."""
    import exllamav3 as exl
    import torch

    config = exl.Config.from_directory(str(model_dir))
    model = exl.Model.from_config(config)
    cache = exl.Cache(model, max_num_tokens=cache_tokens, max_batch_size=1)
    model.load(device=torch.device(device))
    tokenizer = exl.Tokenizer.from_config(config)
    return tokenizer, exl.Generator(model=model, cache=cache, tokenizer=tokenizer, max_batch_size=1)


def greedy(gen: Any, ids: list[int], tokens: int) -> tuple[list[float], list[int], int]:
    """Greedy-decode `tokens` after `ids`: (the perf_counter time each streamed chunk arrived, the tokens, the
    tokens of the first chunk: held-back tokens of a split UTF-8 character come out together)."""
    import exllamav3 as exl
    import torch

    job = exl.Job(input_ids=torch.tensor([ids], dtype=torch.long), max_new_tokens=tokens,
                  sampler=exl.ArgmaxSampler(), stop_conditions=[])
    gen.enqueue(job)
    stamps: list[float] = []
    out: list[int] = []
    first_n = 0
    while gen.num_remaining_jobs():
        for r in gen.iterate():
            new = r.get("token_ids")
            if r.get("stage") == "streaming" and new is not None and new.numel():
                stamps.append(time.perf_counter())
                out += new.flatten().tolist()
                first_n = first_n or len(out)
    return stamps, out, first_n


def ext() -> Any:
    """exllamav3's compiled extension (the benches that call its kernels directly)."""
    from exllamav3.ext import exllamav3_ext

    return exllamav3_ext

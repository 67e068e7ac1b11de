"""The shapes the start-up warm-up sends through the exllamav3 engine, so that no user request pays for compiling.

exllamav3 compiles kernels per shape on first sight, and a compile inside a request is time the user waits for
(docs/results.md has what it cost agent turns):
- The MLA layers run up to `small_rows` (16) query rows through a captured path compiled per (batch, rows,
  regime). A follow-up turn's prefill ends with the rows past its last page boundary, so any tail of 1-16 rows
  occurs; decode meets every batch size up to max_batch.
- The regime is dense or sparse: sparse once the visible context exceeds the DSA indexer's top-k.
- The KDA short-chunk kernels are compiled per power of two of the chunk length up to a page.
Compiled kernels go to Triton's cache (GLM53_CACHE_DIR/triton), so on a machine that served before, the warm-up
reads them instead of compiling.

A shape is a round of `batch` jobs, each with `prefix` shared tokens (the page cache keeps them after the first
job) and `tail` more prompt rows to prefill, then decoding together.
"""

from __future__ import annotations

from dataclasses import dataclass

# One row per power of two past the small-query path, up to a page and beyond (the chunked path's own tiles).
BUCKET_TAILS = (24, 48, 96, 192, 384, 768, 1536)


@dataclass(frozen=True)
class WarmShape:
    prefix: int  # tokens shared with every other job of the same prefix (0: none)
    tail: int  # prompt rows each job prefills after the prefix (the prompt's last token is decoded)
    batch: int  # jobs run together: their decode steps are one batch


def sparse_prefix(sparse_topk: int | None, page: int, kv_tokens: int, max_batch: int) -> int:
    """Length of the shared prefix that puts a job past the indexer's top-k (whole pages, so its checkpoint is
    kept), or 0 where the model has no sparse regime or the cache cannot hold it beside a batch's own pages."""
    if not sparse_topk:
        return 0
    prefix = (sparse_topk // page + 1) * page
    return prefix if prefix + (max_batch + 1) * page <= kv_tokens else 0


def warmup_shapes(*, small_rows: int, max_batch: int, kv_tokens: int, chunk: int, page: int,
                  sparse_topk: int | None) -> list[WarmShape]:
    """Every (regime, rows, batch) the small-query path can meet while serving, and a tail in each power-of-two
    bucket, for each regime the model has."""
    shapes: list[WarmShape] = []
    prefixes = [0]
    long_prefix = sparse_prefix(sparse_topk, page, kv_tokens, max_batch)
    if long_prefix:
        prefixes.append(long_prefix)
    for prefix in prefixes:
        # A dense-regime job must stay within the top-k; any job within the cache and one prefill chunk.
        limit = min(chunk, kv_tokens - prefix - page)
        if prefix == 0 and sparse_topk:
            limit = min(limit, sparse_topk - 1)
        tails = [t for t in (*range(1, small_rows + 1), *BUCKET_TAILS) if t <= limit]
        shapes += [WarmShape(prefix, t, 1) for t in tails]
        shapes += [WarmShape(prefix, 1, b) for b in range(2, max_batch + 1)]
    return shapes

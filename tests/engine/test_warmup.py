"""The warm-up's shapes (glm53.engine.warmup): every small-query row count and decode batch in each regime the
model has, within the cache and one prefill chunk."""

from glm53.engine.warmup import BUCKET_TAILS, WarmShape, sparse_prefix, warmup_shapes

GLM53 = dict(small_rows=16, max_batch=7, kv_tokens=131072, chunk=4096, page=256, sparse_topk=2048)


def by_prefix(shapes):
    out = {}
    for s in shapes:
        out.setdefault(s.prefix, []).append(s)
    return out


def test_the_real_model_gets_both_regimes_every_row_count_and_batch():
    groups = by_prefix(warmup_shapes(**GLM53))
    assert sorted(groups) == [0, 2304]  # whole pages past the indexer's 2,048
    for shapes in groups.values():
        tails = [s.tail for s in shapes if s.batch == 1]
        assert tails == [*range(1, 17), *BUCKET_TAILS]
        assert [s.batch for s in shapes if s.batch > 1] == list(range(2, 8))
        assert all(s.tail == 1 for s in shapes if s.batch > 1)
    # a dense-regime job stays within the top-k: its prompt (tail + 1 decoded token) never passes 2,048
    assert max(s.tail for s in groups[0]) + 1 <= 2048


def test_a_model_without_a_sparse_indexer_has_one_regime_and_no_topk_limit():
    shapes = warmup_shapes(**{**GLM53, "sparse_topk": None, "chunk": 2048})
    assert {s.prefix for s in shapes} == {0}
    assert max(s.tail for s in shapes) == 1536


def test_a_small_cache_keeps_the_dense_regime_and_drops_what_does_not_fit():
    assert sparse_prefix(2048, 256, 3072, 4) == 0  # 2,304 + 5 pages > 3,072
    assert sparse_prefix(2048, 256, 3584, 4) == 2304
    shapes = warmup_shapes(**{**GLM53, "kv_tokens": 1024, "max_batch": 2})
    assert {s.prefix for s in shapes} == {0}
    assert max(s.tail for s in shapes) <= 1024 - 256
    assert WarmShape(0, 1, 2) in shapes

"""Next-layer router lookahead: predict_topk against transformers' own gates, RecallMeter's sums, the fixture's recall."""

from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np
import pytest
import torch

from glm53.step.lookahead import Guesses, RecallMeter, predict_topk

ROUTERS = [
    ("glm5_next", "Glm5NextTextConfig", "Glm5NextTextTopkRouter"),
    ("deepseek_v3", "DeepseekV3Config", "DeepseekV3TopkRouter"),
]


@pytest.mark.parametrize("family,config_cls,router_cls", ROUTERS)
@pytest.mark.parametrize("experts,top_k,n_group,topk_group", [(8, 2, 1, 1), (64, 6, 8, 3), (32, 4, 4, 1)])
@pytest.mark.parametrize("seed", [0, 1])
def test_predict_topk_matches_the_transformers_gate(family, config_cls, router_cls, experts, top_k, n_group,
                                                    topk_group, seed) -> None:
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    cfg = getattr(importlib.import_module("transformers"), config_cls)(
        hidden_size=48, n_routed_experts=experts, num_experts_per_tok=top_k, n_group=n_group, topk_group=topk_group,
    )
    gen = torch.Generator().manual_seed(seed)
    router = getattr(module, router_cls)(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
        # A bias on the sigmoid scale, so it reorders picks (and groups) as the trained correction bias does.
        router.e_score_correction_bias.copy_(torch.rand(experts, generator=gen) * 0.5)
        z = torch.randn(3, 17, 48, generator=gen).to(torch.bfloat16)  # the gate's input dtype in the model
        _, _, actual = router(z)
    pred = predict_topk(z, router.weight, router.e_score_correction_bias, top_k, n_group=n_group,
                        topk_group=topk_group)
    assert pred.dtype == torch.int64 and pred.shape == (51, top_k)
    assert torch.equal(pred.sort(-1).values, actual.sort(-1).values)


def test_predict_topk_returns_best_first_and_honours_the_bias() -> None:
    w = torch.eye(4)
    z = torch.tensor([[4.0, 3.0, 2.0, 1.0]])
    assert predict_topk(z, w, torch.zeros(4), 3).tolist() == [[0, 1, 2]]
    # The bias is added to sigmoid scores, not logits: sigmoid(1) + 0.3 beats sigmoid(4); 1 + 0.3 would not.
    assert predict_topk(z, w, torch.tensor([0.0, 0.0, 0.0, 0.3]), 2).tolist() == [[3, 0]]


def test_recall_meter_arithmetic() -> None:
    m = RecallMeter()
    # Row recall: row 0 hits 1 of 2, row 1 hits 2 of 2 -> 3/4. Step: actual {1,2,3,4}, predicted {1,3,4,5} -> 3/4.
    m.update(5, [[1, 5], [3, 4]], [[1, 2], [4, 3]])
    # Expert recall differs from row recall: row 0 misses 2, row 1 predicted it -> rows 1/2, distinct experts 1/1.
    m.update(5, [[7], [2]], [[2], [2]])
    m.update(6, torch.tensor([[0, 1, 2, 3]]), torch.tensor([[3, 9]]))  # a wider guess: 1 of 2
    snap = m.snapshot()
    l5, l6 = snap["layers"][5], snap["layers"][6]
    assert l5["recall"] == pytest.approx(4 / 6) and l5["picks"] == 6 and l5["steps"] == 2
    assert l5["expert_recall"] == pytest.approx(4 / 5)
    assert l6["recall"] == 0.5 and l6["expert_recall"] == 0.5
    assert snap["recall"] == pytest.approx((4 / 6 + 0.5) / 2)
    assert snap["expert_recall"] == pytest.approx((4 / 5 + 0.5) / 2)
    with pytest.raises(ValueError):
        m.update(5, [[1, 2]], [[1, 2], [3, 4]])
    assert (snap["hits"], snap["picks"], snap["expert_hits"], snap["experts"], snap["steps"]) == (5, 8, 5, 7, 3)
    m.reset()
    assert m.snapshot() == {"layers": {}, "recall": None, "expert_recall": None, "hits": 0, "picks": 0,
                            "expert_hits": 0, "experts": 0, "steps": 0}


@pytest.fixture(scope="module")
def fixture_model(hf_model_dir: Path):
    from glm53.bench.lookahead import load_model

    return load_model(hf_model_dir)


def test_fixture_recall_self_exact_and_lookahead_above_chance(fixture_model) -> None:
    from glm53.bench.lookahead import measure_recall

    ids = torch.randint(0, fixture_model.config.get_text_config().vocab_size, (1, 96),
                        generator=torch.Generator().manual_seed(0))
    doc = measure_recall(fixture_model, ids)
    ahead = doc["lookahead"]
    print("\nlookahead recall per layer: "
          + ", ".join(f"{v['source']}->{t} {v['recall']:.3f}" for t, v in ahead["layers"].items())
          + f"; mean {ahead['recall']:.3f}; chance {doc['chance']:.3f}")
    # Each layer's own input through its own router is the gate's computation: the hooks and predict_topk agree.
    assert doc["self"]["recall"] == 1.0 and all(v["recall"] == 1.0 for v in doc["self"]["layers"].values())
    assert doc["rows"] == 96 and doc["chance"] == doc["top_k"] / doc["experts"]
    assert len(ahead["layers"]) >= 2
    assert all(v["recall"] > doc["chance"] for v in ahead["layers"].values())


def test_bench_command(hf_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from glm53.cli import main

    assert main(["bench", "lookahead", "--model", str(hf_model_dir), "--tokens", "24", "--predict-k", "3"]) == 0
    out = capsys.readouterr().out
    assert "1 -> 2" in out and "chance 0.375" in out


def test_the_stepper_scores_its_guesses_as_the_recall_meter_counts_them() -> None:
    """The stepper counts the meter's sums in its own pass over a step's rows (Guesses.score): the same counts as
    RecallMeter.update, and per-rank hits as a plain count of each guess among its row's picks, on random rows, rows
    that name an expert twice included."""
    rng = np.random.default_rng(0)
    guesses, meter = Guesses(), RecallMeter()
    hits, total = [0] * 4, [0] * 4
    for step in range(300):
        rows, layer = int(rng.integers(1, 9)), int(rng.integers(0, 3))
        experts = int(rng.integers(4, 12))  # few experts: rows overlap, and with replace=True repeat themselves
        twice = step % 3 == 0
        pred = np.stack([rng.choice(experts, 4, replace=twice) for _ in range(rows)])
        ids = np.stack([rng.choice(experts, 3, replace=twice and step % 2 == 0) for _ in range(rows)])
        guesses.pending[layer] = pred
        guesses.score(layer, ids, True)
        meter.update(layer, pred, ids)
        for guess, real in zip(pred.tolist(), ids.tolist(), strict=True):
            for r, e in enumerate(guess):
                total[r] += 1
                hits[r] += e in real
    assert guesses.meter.snapshot() == meter.snapshot()
    assert (guesses.hits, guesses.total) == (hits, total)
    assert guesses.precision == [(h + 1) / (t + 2) for h, t in zip(hits, total, strict=True)]


def test_the_guesses_outside_vram_are_scored_by_their_order_in_the_row() -> None:
    """What a prestage of a row's first outside-VRAM guesses would have had right: guesses inside VRAM are skipped,
    the rest counted by their order among the row's outside ones."""
    guesses = Guesses()
    guesses.pending[2] = np.array([[5, 1, 7, 3], [2, 6, 4, 0]])
    guesses.outside[2] = [[False, True, True, False], [True, True, False, True]]
    guesses.score(2, np.array([[5, 7, 9], [0, 6, 8]]), True)
    # row 0: outside 1 (miss), 7 (hit); row 1: outside 2 (miss), 6 (hit), 0 (hit)
    assert (guesses.outside_hits, guesses.outside_total) == ([0, 2, 1], [2, 2, 1])
    assert guesses.outside_precision() == [0.0, 1.0, 1.0]
    guesses.pending[2], guesses.outside[2] = np.array([[1, 2]]), [[True, False]]
    guesses.score(2, np.array([[1, 3]]), False)  # a prompt step: not scored, and its guess is gone
    assert guesses.outside_total == [2, 2, 1] and 2 not in guesses.outside

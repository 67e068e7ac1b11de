"""`glm53 bench lookahead`: how well layer l's MoE input predicts layer l+1's expert picks, on the transformers model.

Forward hooks on every MoE router capture its input (the post-norm MoE input) and the ids it picked; layer l's
input is then run through layer l+1's router weights with `predict_topk` and scored against layer l+1's actual
picks. Each layer's own input through its own router must reproduce its picks exactly (recall 1.0): that checks
the hooks and `predict_topk` against the model, so the lookahead numbers measure the lookahead and nothing else.
Chance is predict_k / experts (a uniform random guess of predict_k distinct experts).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from itertools import pairwise
from pathlib import Path
from typing import Any

DEFAULT_TOKENS = 256


def _routers(model: Any) -> dict[int, Any]:
    """{decoder layer index: router module} for every noaux_tc router (GLM-5 / DeepSeek-V3 gates) in `model`."""
    out = {}
    for name, module in model.named_modules():
        if hasattr(module, "e_score_correction_bias") and hasattr(module, "top_k") and ".layers." in name:
            out[int(name.split(".layers.")[1].split(".")[0])] = module
    return dict(sorted(out.items()))


def measure_recall(model: Any, input_ids: Any, *, predict_k: int | None = None, step_rows: int = 1) -> dict:
    """Per-layer lookahead recall on one forward of `input_ids` (batch, tokens) through a transformers model.

    Rows are scored `step_rows` at a time (the model is causal, so prompt rows stand in for decode steps; 1 is
    batch-1 decode, more is a decode batch or a prefill chunk). `predict_k` experts are guessed per row (default
    the router's top_k). Returns {"lookahead": snapshot keyed by target layer (+ "source"), "self": snapshot of
    each layer through its own router, "chance", "top_k", "predict_k", "experts", "n_group", "topk_group", "rows"}.
    """
    import torch

    from glm53.engine.quiet import quiet_transformers
    from glm53.step.lookahead import RecallMeter, predict_topk

    routers = _routers(model)
    if len(routers) < 2:
        raise ValueError(f"need at least two MoE layers, found {len(routers)}")
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(layer: int):
        def capture(module: Any, inputs: tuple, output: tuple) -> None:
            z = inputs[0]
            seen[layer] = (z.reshape(-1, z.shape[-1]).detach(), output[-1].detach())

        return capture

    ids = torch.as_tensor(input_ids)
    handles = [r.register_forward_hook(hook(layer)) for layer, r in routers.items()]
    try:
        with torch.inference_mode(), quiet_transformers():  # the CPU KDA/conv fallbacks are intended here
            model(input_ids=ids if ids.dim() == 2 else ids.reshape(1, -1), use_cache=False)
    finally:
        for h in handles:
            h.remove()

    first = next(iter(routers.values()))
    top_k, experts = int(first.top_k), int(first.weight.shape[0])
    k = predict_k or top_k

    def guess(z: torch.Tensor, router: Any, kk: int) -> torch.Tensor:
        return predict_topk(z, router.weight, router.e_score_correction_bias, kk,
                            n_group=int(router.num_group), topk_group=int(router.topk_group))

    ahead, own = RecallMeter(), RecallMeter()
    pairs = list(pairwise(routers))
    rows = seen[pairs[0][0]][0].shape[0]
    for src, dst in pairs:
        pred_ahead = guess(seen[src][0], routers[dst], k)
        pred_own = guess(seen[dst][0], routers[dst], top_k)
        actual = seen[dst][1]
        for s in range(0, rows, max(1, step_rows)):
            rows_s = slice(s, s + max(1, step_rows))
            ahead.update(dst, pred_ahead[rows_s], actual[rows_s])
            own.update(dst, pred_own[rows_s], actual[rows_s])
    lookahead = ahead.snapshot()
    for src, dst in pairs:
        lookahead["layers"][dst]["source"] = src
    return {
        "lookahead": lookahead,
        "self": own.snapshot(),
        "chance": k / experts,
        "top_k": top_k,
        "predict_k": k,
        "experts": experts,
        "n_group": int(first.num_group),
        "topk_group": int(first.topk_group),
        "rows": rows,
    }


def load_model(model_dir: Path) -> Any:
    """The Glm5Next checkpoint as the CPU reference engine loads it (fp32, MTP head tensors ignored)."""
    import torch
    from transformers import AutoConfig

    from glm53.engine.quiet import quiet_transformers
    from glm53.engine.reference import _model_class

    with quiet_transformers():
        text = AutoConfig.from_pretrained(model_dir).get_text_config()
        cls = _model_class(text.num_hidden_layers, int(getattr(text, "num_nextn_predict_layers", 0) or 0))
        return cls.from_pretrained(model_dir, dtype=torch.float32).eval()


def register_bench(bench_sub: Any) -> None:
    p = bench_sub.add_parser("lookahead", help="next-layer router lookahead: recall of layer l+1's expert picks "
                                               "predicted from layer l's MoE input, vs chance (CPU)")
    p.add_argument("--model", metavar="DIR", help="HF Glm5Next checkpoint (default: generate the tiny one)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated checkpoint and the prompt (default 0)")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help=f"prompt tokens (default {DEFAULT_TOKENS})")
    p.add_argument("--predict-k", type=int, help="experts guessed per row (default: the router's top_k)")
    p.add_argument("--step-rows", type=int, default=1, help="rows per scored step, for expert recall (default 1)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.set_defaults(func=cmd_bench_lookahead)


def run_bench(args: argparse.Namespace, log=print) -> dict:
    import torch

    with tempfile.TemporaryDirectory(prefix="glm53-lookahead-") as tmp:
        if args.model:
            model_dir = Path(args.model)
        else:
            from glm53.fixture.hf import write_hf_checkpoint

            model_dir = write_hf_checkpoint(Path(tmp) / "model", seed=args.seed)
        model = load_model(model_dir)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (1, args.tokens), generator=torch.Generator().manual_seed(args.seed))
    doc = measure_recall(model, ids, predict_k=args.predict_k, step_rows=args.step_rows)
    doc["model"] = str(args.model or f"generated tiny Glm5Next (seed {args.seed})")

    log(f"glm53 bench lookahead: {doc['model']}; {doc['rows']} prompt tokens; {doc['experts']} experts, top_k "
        f"{doc['top_k']}, groups {doc['n_group']}/{doc['topk_group']}; guessing {doc['predict_k']} per row")
    log(f"{'layer':>9}  {'recall':>7}  {'expert':>7}  {'self':>5}")
    own = doc["self"]["layers"]
    for dst, v in doc["lookahead"]["layers"].items():
        log(f"{v['source']:>3} -> {dst:<3}  {v['recall']:7.3f}  {v['expert_recall']:7.3f}  {own[dst]['recall']:5.3f}")
    log(f"{'mean':>9}  {doc['lookahead']['recall']:7.3f}  {doc['lookahead']['expert_recall']:7.3f}  "
        f"{doc['self']['recall']:5.3f}")
    log(f"chance {doc['chance']:.3f} (predict_k/experts); recall/chance {doc['lookahead']['recall'] / doc['chance']:.2f}x")
    return doc


def cmd_bench_lookahead(args: argparse.Namespace) -> int:
    try:
        doc = run_bench(args)
    except (OSError, ValueError) as exc:
        print(f"glm53 bench lookahead: {exc}", file=sys.stderr)
        return 2
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0

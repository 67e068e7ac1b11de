"""The plan's inputs, gathered at the edge: settings, host facts under a root, the model's shape, saved routing.

`inputs` reads files (host facts, config.json, safetensors headers, the routing statistics an earlier run saved)
and hands plan() everything it decides from; `current_plan` is the composition's one way into the decision
package: the plan `glm53 serve` obeys. `glm53 plan` and `glm53 preflight` (glm53.plan_cli) print the same.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from glm53.planning import host as H
from glm53.planning import plan as P
from glm53.planning import settings as S
from glm53.planning import shape as M
from glm53.planning.routing import saved_routing


@dataclass
class Inputs:
    settings: S.Settings
    facts: H.HostFacts
    shape: M.ModelShape
    warnings: list[str]
    model_error: str | None = None   # the checkpoint is there but unreadable: a refusal, reported like one
    model_mounted: bool = False
    routing: tuple = (None, "no checkpoint mounted")  # saved routing statistics (counts or None, why)


# `glm53 plan --shape NAME`: plan for a known model's shape with no checkpoint (before the download).
SHAPES = {"glm53": M.DEFAULT_SHAPE}


def inputs(settings: S.Settings, root: str = "/", shape_name: str | None = None) -> Inputs:
    """Host facts under `root` and the model's shape for `settings`: everything plan() needs. shape_name (a key of
    SHAPES): that model's shape whatever is mounted, planned as if its checkpoint were (GLM53_MODEL_DIR, or
    /model when it is empty)."""
    if root == "/" and settings.store:
        # The plan compares this path with the store facts, which hold it absolute.
        settings = settings.with_overrides(store=os.path.abspath(settings.store))
    warnings: list[str] = []
    shape, error, mounted = M.DEFAULT_SHAPE, None, False
    if shape_name is not None:
        shape = SHAPES[shape_name]
        settings = settings if settings.model_dir else settings.with_overrides(model_dir="/model")
    elif settings.model_dir:
        # On a fake host the model directory is part of the tree, like every other path.
        model = Path(root) / settings.model_dir.lstrip("/") if root != "/" else Path(settings.model_dir)
        # exists(), not is_file(): a config.json that is a FIFO or a directory is refused by name, not taken for
        # a model not mounted yet.
        mounted = (model / "config.json").exists()
        if mounted:
            try:
                shape = M.from_checkpoint(model)
            except M.ShapeError as exc:
                error = f"{exc}: check the checkpoint with `glm53 model verify {settings.model_dir}`"
        else:
            warnings.append(f"no config.json in {settings.model_dir} (model not mounted yet?): planned with the "
                            "GLM-5.3-Flash 3.05 bpw defaults")
    facts = H.read_host(root, store=settings.store or None)
    if root == "/":
        from glm53.cpu_lane import kernel

        facts = replace(facts, lane_kernel_error=kernel.unavailable_reason())
    routing = _routing(settings, model, shape) if mounted and error is None else (None, "no checkpoint mounted")
    return Inputs(settings, facts, shape, warnings, error, mounted, routing)


def _routing(settings: S.Settings, model_dir: Path, shape: M.ModelShape) -> tuple:
    """The routing statistics an earlier run of this checkpoint saved under the cache dir: they split the VRAM
    slots among layers (the plan) and warm the tiers (the engine)."""
    return saved_routing(Path(settings.cache_dir).expanduser(), model_dir, shape.moe_layers, shape.experts_per_layer)


def make_plan(inp: Inputs) -> tuple[P.Plan | None, dict]:
    """(plan or None, its JSON with facts and shape attached); input warnings go first."""
    try:
        if inp.model_error:
            raise P.PlanError(inp.model_error)
        plan = P.plan(inp.facts, inp.shape, inp.settings, inp.routing)
        plan.warnings[:0] = inp.warnings
        out = plan.to_json()
    except P.PlanError as exc:
        exc.warnings[:0] = inp.warnings
        plan, out = None, exc.to_json()
    out["facts"] = inp.facts.to_json()
    out["shape"] = inp.shape.to_json()
    return plan, out


def current_plan(settings: S.Settings) -> tuple[P.Plan, Inputs]:
    """The plan `glm53 serve` obeys: this host, these settings. Raises PlanError (its message has the fix)."""
    inp = inputs(settings)
    if inp.model_error:
        raise P.PlanError(inp.model_error, inp.warnings)
    plan = P.plan(inp.facts, inp.shape, inp.settings, inp.routing)
    plan.warnings[:0] = inp.warnings
    return plan, inp

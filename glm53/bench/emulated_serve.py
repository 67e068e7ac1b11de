"""`python -m glm53.bench.emulated_serve EMULATION_JSON`: `glm53 serve` as it runs on the emulated host
(glm53.bench.emulate), for the HTTP benches (bench serve, agent: --emulate). The settings, the plan, the server
and the engine are the product's; only the engine's spec (the card's share of the slots, the lane's threads) and
its on_tiers (the paced link, the lane's kernel paths) are the emulation's, set before the engine loads."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from glm53.bench import emulate

log = logging.getLogger("glm53.bench")


def emulated(engine: Any, emu: emulate.Emulation) -> Any:
    """The engine `glm53 serve` chose, not loaded yet, set to run on the emulated host; an engine that tiers
    nothing (stock, the demo) is returned as it is, which the log says."""
    if getattr(engine, "spec", None) is None or not engine.spec.tiered:
        log.warning("emulating %s: this engine tiers no experts, so nothing crosses the link and the emulation "
                    "changes nothing", emu.name)
        return engine
    if engine.ready:
        raise RuntimeError("the emulation must be set before the engine loads")
    from glm53.planning.shape import from_checkpoint

    shape = from_checkpoint(engine.model_dir)
    engine.spec = emulate.emulated_spec(engine.spec, emu, shape.experts_per_layer)
    pacer = emulate.link_pacer(emu, shape.expert_bytes, log=log.info) if engine.spec.device.startswith("cuda") else None
    engine.on_tiers = emulate.tiers_hook(emu, pacer)
    log.info("emulating %s: VRAM slots per MoE layer %s, lane threads %d", emu.describe(), list(engine.spec.vram_slots),
             engine.spec.cpu_threads)
    return engine


def main(argv: list[str]) -> int:
    from glm53.serve.cli import serve, settings_from_args, start_engine

    emu = emulate.from_json(json.loads(argv[0]))
    settings = settings_from_args(argparse.Namespace())  # no flags: the environment the bench set
    return serve(settings, lambda settings: emulated(start_engine(settings), emu))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Expert tiers: VRAM slot arenas, the exclusive RAM tier, the cache policy, and their statistics.

Independent of exllamav3: the device is a parameter, and CPU tensors stand in for VRAM in CI. glm53/engine
hooks the arenas into exllamav3's BlockSparseMLP (slot tensors, router map) without this package knowing.

The names below load on first use (PEP 562): `glm53 bench nvme` registers from glm53.bench.nvme at every CLI
start, and importing this package must not pull in torch for that.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Copier": "copier", "Ticket": "copier",
    "combine": "layer", "direct_moe": "layer", "group_picks": "layer",
    "Field": "layout", "SlotLayout": "layout", "exl3_expert_layout": "layout",
    "Policy": "policy", "ScoredPolicy": "policy", "choose_admissions": "policy", "hot_order": "policy",
    "RamTier": "ram",
    "DIRECTIONS": "stats", "LANES": "stats", "TierStats": "stats",
    "ExpertTiers": "tiers", "TierError": "tiers", "Where": "states",
    "VramLayer": "vram",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))

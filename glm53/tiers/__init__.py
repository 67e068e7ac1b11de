"""Expert tiers: VRAM slot arenas, the exclusive RAM tier, the cache policy, and their statistics.

Independent of exllamav3: the device is a parameter, and CPU tensors stand in for VRAM in CI. glm53/engine
hooks the arenas into exllamav3's BlockSparseMLP (slot tensors, router map) without this package knowing.
"""

from .copier import Copier, Ticket
from .layer import LayerResult, combine, direct_moe, group_picks, tiered_moe
from .layout import Field, SlotLayout, exl3_expert_layout
from .policy import (
    LruPolicy,
    Policy,
    ScoredPolicy,
    SimResult,
    choose_admissions,
    hot_order,
    load_routing_stats,
    routing_stats_path,
    save_routing_stats,
    simulate,
    split_budget,
    zipf_trace,
)
from .ram import RamTier
from .stats import DIRECTIONS, LANES, TierStats
from .tiers import ExpertTiers, TierError, Where
from .vram import VramLayer

__all__ = [
    "DIRECTIONS",
    "LANES",
    "Copier",
    "ExpertTiers",
    "Field",
    "LayerResult",
    "LruPolicy",
    "Policy",
    "RamTier",
    "ScoredPolicy",
    "SimResult",
    "SlotLayout",
    "Ticket",
    "TierError",
    "TierStats",
    "VramLayer",
    "Where",
    "choose_admissions",
    "combine",
    "direct_moe",
    "exl3_expert_layout",
    "group_picks",
    "hot_order",
    "load_routing_stats",
    "routing_stats_path",
    "save_routing_stats",
    "simulate",
    "split_budget",
    "tiered_moe",
    "zipf_trace",
]

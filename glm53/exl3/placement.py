"""Where exllamav3's modules load and what runs around their calls: the layer split, load progress, wrappers.

exllamav3's single-device loader runs module by module; glm53 wraps each top-level module's `load` (an instance
attribute, removed by the undo each function returns) to send it to its layer's card or to report progress.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from glm53.planning.spec import EngineSpec


def moe_modules(model: Any) -> list:
    """The model's routed-expert layers (exllamav3 BlockSparseMLP modules), in layer order."""
    from exllamav3.modules.block_sparse_mlp import BlockSparseMLP

    return [m for top in model.modules for m in top if isinstance(m, BlockSparseMLP)]


_LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def decoder_layer(key: str) -> int | None:
    m = _LAYER_KEY.search(key)
    return int(m.group(1)) if m else None


def place_layers(model: Any, spec: EngineSpec) -> Callable[[], None]:
    """exllamav3's layer split by the spec's device shares: each top-level module loads onto its decoder layer's
    share's device (the embedding with the first layer, the head with the last), its cache layers with it, since
    exllamav3 allocates them in the module's load. `model.load(device=...)` then runs the stock single-device
    loader, module by module, on the devices given here. No shares: nothing changes. Returns the undo."""
    from glm53.planning.devices import share_of_layer

    if not spec.devices:
        return lambda: None
    import torch

    cpu = spec.device == "cpu"
    targets, seen = [], False
    for mod in model.modules:
        layer = decoder_layer(mod.key)
        seen = seen or layer is not None
        share = share_of_layer(spec.devices, layer) if layer is not None else (len(spec.devices) - 1 if seen else 0)
        targets.append(torch.device("cpu" if cpu else spec.devices[share].device))

    def wrap(i: int, orig: Callable[..., Any]) -> Callable[..., Any]:
        def load(device: Any, *args: Any, **kwargs: Any) -> Any:
            # A module exllamav3 keeps on the CPU (an unquantized embedding) stays there.
            return orig(device if torch.device(device).type == "cpu" else targets[i], *args, **kwargs)

        return load

    return _wrap_loads(model.modules, wrap)


def wrap_load_progress(model: Any, report: Callable[[int, int], None]) -> Callable[[], None]:
    """Report after each top-level module of `model` loads (exllamav3's single-device loader has no callback).
    Returns a function that removes the wrappers."""
    total = len(model.modules)

    def wrap(i: int, orig: Callable[..., Any]) -> Callable[..., Any]:
        def load(*args: Any, **kwargs: Any) -> Any:
            out = orig(*args, **kwargs)
            report(i + 1, total)
            return out

        return load

    return _wrap_loads(model.modules, wrap)


def _wrap_loads(mods: Sequence[Any], wrap: Callable[[int, Callable[..., Any]], Callable[..., Any]]) -> Callable[[], None]:
    """Replace each module's `load` by wrap(index, its load), as an instance attribute; returns the undo (which
    removes every wrapper of these modules at once, whoever stacked them)."""
    mods = list(mods)
    for i, mod in enumerate(mods):
        mod.load = wrap(i, mod.load)

    def undo() -> None:
        for mod in mods:
            mod.__dict__.pop("load", None)

    return undo

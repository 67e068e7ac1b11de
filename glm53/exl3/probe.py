"""What the benchmarks read of a loaded exllamav3 model: module forwards to time, the shared expert on its own, and
the bytes its caches hold. The product never calls these; glm53.bench does, so that it imports no exllamav3."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def wrap_forwards(model: Any, wrap: Callable[[Any, Callable[..., Any]], Callable[..., Any]]) -> Callable[[], None]:
    """Replace the forward of each module a decode step calls on its own (the top-level modules, each block's
    attention and MLP, the MLP's shared experts; not the norms, not the experts) by wrap(module, its forward), as
    an instance attribute. exllamav3 1.6.5 runs a forward as a Python loop over the top-level modules, each block
    calling its attention and MLP, so these are the calls a step is made of. Returns the undo."""
    wrapped: list[tuple[Any, Any]] = []

    def one(mod: Any) -> None:
        if not callable(getattr(mod, "forward", None)):  # a container that is never called
            return
        new = wrap(mod, mod.forward)
        wrapped.append((mod, mod.__dict__.get("forward")))
        mod.forward = new

    for top in model.modules:
        one(top)
        for sub in getattr(top, "modules", ()):
            if sub.key.endswith((".self_attn", ".mlp")):
                one(sub)
                for shared in getattr(sub, "modules", ()):
                    if shared.key.endswith(".mlp.shared_experts"):
                        one(shared)

    def undo() -> None:
        for mod, prev in wrapped:
            if prev is None:
                mod.__dict__.pop("forward", None)
            else:
                mod.forward = prev
        wrapped.clear()

    return undo


def shared_expert(model: Any) -> tuple[Callable[[], Any], int] | None:
    """(one call of the first MoE layer's shared expert on a one-token input, the number of layers that have one),
    or None where the model has no shared expert modules."""
    mods = [m.mlp.shared_experts for m in model.modules
            if getattr(getattr(m, "mlp", None), "shared_experts", None) is not None]
    if not mods:
        return None
    import torch

    m = mods[0]
    x = (torch.randn(1, 1, m.hidden_size, device=m.device) * 0.1).half()
    return (lambda: m.forward(x, {})), len(mods)


def cache_bytes(cache: Any) -> tuple[int, int]:
    """Bytes of the distinct device tensors the cache's KV layers and its recurrent states hold."""
    return (_tensor_bytes(getattr(cache, "layers", {}).values()),
            _tensor_bytes(getattr(cache, "recurrent_layers", {}).values()))


def _tensor_bytes(objs: Any) -> int:
    import torch

    seen, total = set(), 0
    for obj in objs:
        for v in vars(obj).values():
            for t in v if isinstance(v, (list, tuple)) else (v,):
                if isinstance(t, torch.Tensor) and t.device.type == "cuda" and t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    total += t.untyped_storage().nbytes()
    return total

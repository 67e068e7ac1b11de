"""The OpenAI-compatible HTTP server: `create_app(engine, settings)`; `glm53 serve` lives in glm53.serve."""

from __future__ import annotations

from typing import Any


def create_app(engine: Any, settings: Any, **kw: Any) -> Any:
    # Imported on use: `glm53 --help` must not pay for FastAPI.
    from glm53.server.app import create_app as _create_app

    return _create_app(engine, settings, **kw)


__all__ = ["create_app"]

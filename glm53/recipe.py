"""The desktop-plugin recipes (docker/recipes.json), checked and rendered.

The recipes file is the single source for how the container is launched: the README's docker run
one-liners and docker/compose.yaml are checked against what `docker_run()` renders from it, so the three
never drift. `check()` refuses a recipe whose args name an entrypoint command or whose env names a setting
that does not exist.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from glm53.planning import settings as S

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "docker" / "recipes.json"
SCHEMA = "omarchy-local-ai/recipes/3"
# What entrypoint.sh dispatches to glm53; kept in step with its case statement by a test.
ENTRYPOINT_COMMANDS = ("serve", "plan", "preflight", "pack-store", "verify-store", "bench", "settings", "model",
                       "fixture")
# Host paths the README shows for the mounts (the plugin substitutes its own).
EXAMPLE_HOST_PATHS = {"/model": "/path/to/GLM-5.3-Flash-exl3", "/store": "/nvme/glm53", "/cache": "glm53-cache"}


class RecipeError(ValueError):
    pass


def load(path: Path = RECIPES) -> dict[str, Any]:
    doc = json.loads(path.read_text())
    check(doc)
    return doc


def entrypoint_commands(entrypoint: Path = ROOT / "entrypoint.sh") -> set[str]:
    """The subcommands entrypoint.sh hands to glm53, read from its case statement."""
    for line in entrypoint.read_text().splitlines():
        m = re.match(r"\s*([a-z-]+(?:\|[a-z-]+)+)\)\s*$", line)
        if m:
            return set(m.group(1).split("|"))
    raise RecipeError(f"{entrypoint}: no dispatch case statement found")


def _check_args(rid: str, what: str, args: list[str]) -> None:
    if not args or args[0] not in ENTRYPOINT_COMMANDS:
        raise RecipeError(f"recipe {rid}: {what} starts with {args[:1]}, which is not an entrypoint command "
                          f"({', '.join(ENTRYPOINT_COMMANDS)})")


def check(doc: dict[str, Any]) -> None:
    if doc.get("schema") != SCHEMA:
        raise RecipeError(f"recipes schema is {doc.get('schema')!r}, expected {SCHEMA!r}")
    seen = set()
    for r in doc.get("recipes", []):
        rid = r.get("id", "?")
        if rid in seen:
            raise RecipeError(f"recipe id {rid} appears twice")
        seen.add(rid)
        for key in ("image", "weights", "args", "env", "port", "shmSize", "ulimits", "resources"):
            if key not in r:
                raise RecipeError(f"recipe {rid}: missing {key!r}")
        _check_args(rid, "args", r["args"])
        for name in r["env"]:
            if name.startswith(S.PREFIX) and name not in S.BY_NAME:
                raise RecipeError(f"recipe {rid}: env {name} is not a glm53 setting (see docs/configuration.md)")
        prep = r.get("prepare")
        if prep:
            _check_args(rid, "prepare.args", prep["args"])
            _check_args(rid, "prepare.verifyArgs", prep["verifyArgs"])
        if r.get("memory") and "store" not in r.get("volumes", {}):
            raise RecipeError(f"recipe {rid}: a memory cap means an nvme mode, which needs a store volume")


def docker_run(recipe: dict[str, Any], args: list[str] | None = None, gpu: bool = True) -> str:
    """The docker run one-liner for a recipe (README form, example host paths)."""
    parts = ["docker run --rm"]
    if gpu:
        parts.append("--gpus all")
    if recipe["ulimits"].get("memlock") == -1:
        parts.append("--ulimit memlock=-1")
    parts.append(f"--shm-size {recipe['shmSize']}")
    if recipe.get("memory"):
        # An equal swap cap: without it the RAM tier would leak into swap.
        parts.append(f"--memory {recipe['memory']} --memory-swap {recipe['memory']}")
    parts.append(f"-p 127.0.0.1:{recipe['port']}:{recipe['port']}")
    mount = recipe["weights"]["mount"]
    parts.append(f"-v {EXAMPLE_HOST_PATHS[mount]}:{mount}:ro")
    for name, target in sorted(recipe.get("volumes", {}).items()):
        ro = ":ro" if name == "store" else ""
        parts.append(f"-v {EXAMPLE_HOST_PATHS[target]}:{target}{ro}")
    parts += [f"-e {k}={v}" for k, v in recipe["env"].items()]
    parts.append("glm53")
    parts += args if args is not None else recipe["args"]
    return " ".join(parts)


def prepare_run(recipe: dict[str, Any]) -> str:
    """The one-shot pack-store container: no GPU, no network, the store volume writable."""
    prep = recipe["prepare"]
    mount = recipe["weights"]["mount"]
    return (f"docker run --rm --network none -v {EXAMPLE_HOST_PATHS[mount]}:{mount}:ro "
            f"-v {EXAMPLE_HOST_PATHS['/store']}:/store glm53 " + " ".join(prep["args"]))

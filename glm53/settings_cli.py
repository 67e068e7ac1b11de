"""`glm53 settings`: print the schema with current values, or regenerate .env.example and docs."""

from __future__ import annotations

from pathlib import Path

from glm53.planning import settings as S

ROOT = Path(__file__).resolve().parent.parent
GENERATED = {ROOT / ".env.example": S.render_env_example, ROOT / "docs" / "configuration.md": S.render_markdown}


def register(sub) -> None:
    p = sub.add_parser("settings", help="list every GLM53_* setting with its default, meaning and current value")
    p.add_argument("--write", action="store_true", help="regenerate .env.example and docs/configuration.md")
    p.add_argument("--check", action="store_true", help="exit 1 if .env.example or docs/configuration.md drifted")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.write:
        for path, render in GENERATED.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(render())
            print(f"wrote {path}")
        return 0
    if args.check:
        stale = [str(p.relative_to(ROOT)) for p, render in GENERATED.items()
                 if not p.is_file() or p.read_text() != render()]
        for name in stale:
            print(f"{name} is out of date with glm53/planning/settings.py: run `glm53 settings --write`")
        return 1 if stale else 0
    print(S.render_table(S.load_or_exit()))
    return 0

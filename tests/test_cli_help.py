"""Every command's --help renders (argparse formats help lazily: a stray % in a help string only fails when asked)."""

from __future__ import annotations

import argparse

from glm53.cli import build_parser


def _walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, (*path, name))


def test_every_command_help_renders():
    seen = []
    for path, parser in _walk(build_parser()):
        text = parser.format_help()
        assert text.startswith("usage:"), path
        seen.append(" ".join(path))
    for cmd in ("serve", "plan", "settings", "bench decode", "bench cpu-lane", "pack-store"):
        assert cmd in seen, f"{cmd} not registered"

"""The scripted coding-agent session `glm53 bench agent` replays: the agent's system prompt and tools, the task,
and each step's tool call with its output (file reads, grep hits, test logs, listings, diffs, shell output),
all generated deterministically from a seed.

The system prompt and tools do not depend on the seed (one agent, many sessions, as in real use: a second
session reuses them from the cache); the task and every output do, so sessions with different seeds share
nothing past the tools.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass

_PATH = {"type": "string", "minLength": 1, "maxLength": 160, "description": "Path relative to the repository root."}


def _tool(name: str, description: str, required: list[str], **properties: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required, "additionalProperties": False}}}


def _int(lo: int, hi: int | None, description: str) -> dict:
    return {"type": "integer", "minimum": lo, **({"maximum": hi} if hi else {}), "description": description}


def _str(hi: int, description: str) -> dict:
    return {"type": "string", "maxLength": hi, "description": description}


TOOLS = [
    _tool("read_file", "Read a text file from the repository. Returns the lines with their numbers (cat -n style). "
          "Use offset and limit for long files; prefer reading the whole file once over many small reads. Never "
          "guess a file's content: read it before editing it.", ["path"],
          path=_PATH, offset=_int(1, None, "First line to read (1-based)."), limit=_int(1, 4000, "Lines to read.")),
    _tool("grep", "Search file contents with a regular expression (ripgrep syntax). Returns path:line:text for each "
          "match, at most 200 matches. Use glob to restrict the files searched and context for lines around each "
          "match.", ["pattern"],
          pattern={**_str(200, "Regular expression."), "minLength": 1},
          path={**_PATH, "description": "Directory or file to search (default: the repository root)."},
          glob=_str(80, "File glob, e.g. '*.py'."), context=_int(0, 10, "Lines of context.")),
    _tool("run_tests", "Run the test suite or part of it with pytest and return its output (the last 400 lines). Run "
          "the narrowest selection that covers the change first, the whole suite at the end.", [],
          path={**_PATH, "description": "Test file or directory (default: tests/)."},
          keyword=_str(120, "pytest -k expression."),
          verbose={"type": "boolean", "description": "Print each test's name (-v)."}),
    _tool("edit_file", "Replace one exact occurrence of old_string with new_string in a file. old_string must match "
          "the file byte for byte, indentation included, and be unique in it; include enough surrounding lines to "
          "make it so. Returns the diff that was applied.", ["path", "old_string", "new_string"],
          path=_PATH, old_string=_str(2000, "Text to replace."), new_string=_str(2000, "Replacement text.")),
    _tool("list_dir", "List a directory as a tree, directories first, hidden files and build outputs omitted.", [],
          path={**_PATH, "description": "Directory (default: the repository root)."},
          depth=_int(1, 4, "Levels to descend.")),
    _tool("run_shell", "Run a shell command in the repository root (bash -lc) and return its exit status, stdout and "
          "stderr. Commands that need a network or run longer than timeout_s are stopped. Do not use it to read or "
          "search files: read_file and grep do that better.", ["command"],
          command={**_str(400, "The command line."), "minLength": 1},
          timeout_s=_int(1, 600, "Seconds before the command is stopped.")),
]

_RULES = """You are a coding agent working in a Python repository on the user's machine. You read code, run
tests and edit files through the tools you are given, one step at a time, until the task is done.

How you work:
- Understand before you change. Read the files involved and search for every caller of what you change.
- Keep changes small and local. Do not reformat code you are not changing; match the style around you.
- After each edit, run the narrowest tests that cover it; before you finish, run the whole suite.
- When a test fails, read its output carefully: fix the cause, never the symptom, and never weaken a test.
- Say what you did and why in one short paragraph at the end; name the files you changed.
- If the task is ambiguous, choose the reading that keeps existing behaviour and say so.
- Never invent file contents, command output or test results: use the tools to find out.
"""

_WORDS = """request response handler session cache token prompt stream reply buffer queue worker engine server route
config setting value option limit budget window context prefix page block record store reader writer index offset
length count total state status error retry timeout deadline metric counter gauge sample rate batch step layer
expert router weight tensor device host memory pool slot arena copy load save parse render format encode decode
check verify validate build plan schedule admit evict reuse commit release acquire open close start stop run wait
""".split()
_VERBS = "get set load save parse render check build make read write open close start stop run find apply".split()
_MODULES = "server engine cache store plan settings metrics tokenizer scheduler worker router stream chat".split()


def _ident(rng: random.Random) -> str:
    return "_".join(rng.sample(_WORDS, rng.choice((1, 2, 2, 3))))


def _sentence(rng: random.Random, words: int = 0) -> str:
    text = " ".join(rng.choice(_WORDS) for _ in range(words or rng.randint(5, 14)))
    return text[0].upper() + text[1:] + "."


def repo_paths(rng: random.Random, count: int) -> list[str]:
    paths = []
    for _ in range(count):
        pkg = rng.choice(("app", "app", "app/core", "app/api", "tests"))
        name = f"{rng.choice(_MODULES)}_{rng.choice(_WORDS)}.py"
        paths.append(f"{pkg}/{'test_' if pkg == 'tests' else ''}{name}")
    return sorted(set(paths))


def _function(rng: random.Random) -> list[str]:
    name = f"{rng.choice(_VERBS)}_{_ident(rng)}"
    args = rng.sample(_WORDS, rng.randint(1, 3))
    lines = [f"def {name}({', '.join(args)}):", f'    """{_sentence(rng)}"""']
    var = _ident(rng)
    lines.append(f"    {var} = {args[0]}.{rng.choice(_VERBS)}({', '.join(args[1:])})")
    for _ in range(rng.randint(1, 5)):
        cond = f"{var}.{rng.choice(_WORDS)} > {rng.randint(0, 4096)}"
        lines += [f"    if {cond}:", f"        raise ValueError(f\"{_sentence(rng, 6)[:-1]}: {{{var}!r}}\")"]
    lines.append(f"    return {var}")
    return lines


def source_file(rng: random.Random, chars: int) -> str:
    """A Python module, as read_file returns it (numbered lines)."""
    lines = ['"""' + _sentence(rng, 12) + '"""', "", "from __future__ import annotations", "",
             *[f"import {m}" for m in sorted(rng.sample(("json", "os", "time", "logging", "asyncio", "re"), 3))], ""]
    size = sum(len(x) + 8 for x in lines)
    while size < chars:
        if rng.random() < 0.2:
            block = [f"class {_ident(rng).title().replace('_', '')}:", f'    """{_sentence(rng)}"""', ""]
            block += ["    " + x if x else x for x in _function(rng)]
        else:
            block = _function(rng)
        block += ["", ""]
        lines += block
        size += sum(len(x) + 8 for x in block)
    return "\n".join(f"{i:6d}\t{x}" for i, x in enumerate(lines, 1))


def _lines(chars: int, line: Callable[[], str]) -> list[str]:
    """Lines from `line()` until they make about `chars` characters."""
    out, size = [], 0
    while size < chars:
        out.append(line())
        size += len(out[-1]) + 1
    return out


def grep_output(rng: random.Random, chars: int, pattern: str) -> str:
    paths = repo_paths(rng, 40)
    return "\n".join(_lines(chars, lambda: f"{rng.choice(paths)}:{rng.randint(1, 900)}:    {_ident(rng)} = {pattern}"
                                          f"({_ident(rng)}, {rng.choice(_WORDS)}={rng.randint(0, 99)})"))


def test_log(rng: random.Random, chars: int, failing: bool) -> str:
    paths = [p for p in repo_paths(rng, 60) if p.startswith("tests/")] or ["tests/test_server.py"]
    out = ["============================= test session starts ==============================",
           "platform linux -- Python 3.11.9, pytest-8.3.2, pluggy-1.5.0", "rootdir: /repo", "collected "
           f"{rng.randint(200, 900)} items", ""]
    size = sum(len(x) for x in out)
    fails = 0
    while size < chars * 0.6:
        dots = "".join(rng.choice("......F" if failing else ".........s") for _ in range(rng.randint(20, 60)))
        fails += dots.count("F")
        line = f"{rng.choice(paths)} {dots} [{rng.randint(1, 99):3d}%]"
        out.append(line)
        size += len(line)
    out += ["", "=================================== FAILURES ==================================="]
    while size < chars:
        test = f"test_{_ident(rng)}"
        block = [f"______________________________ {test} ______________________________", "",
                 *[f"    {x}" for x in _function(rng)[:6]],
                 f">       assert {_ident(rng)}.{rng.choice(_WORDS)} == {rng.randint(0, 99)}",
                 f"E       AssertionError: assert {rng.randint(100, 999)} == {rng.randint(0, 99)}",
                 f"E        +  where {rng.randint(100, 999)} = <{_ident(rng)} object at 0x7f{rng.getrandbits(40):010x}>",
                 "", f"{rng.choice(paths)}:{rng.randint(10, 700)}: AssertionError"]
        out += block
        size += sum(len(x) + 1 for x in block)
    out.append(f"========== {max(fails, 1) if failing else 0} failed, {rng.randint(200, 900)} passed in "
               f"{rng.uniform(5, 90):.2f}s ==========")
    return "\n".join(out)


def tree(rng: random.Random, chars: int) -> str:
    out, size = [".", "├── README.md", "├── pyproject.toml"], 40
    for path in repo_paths(rng, max(8, chars // 24)):
        line = "│   " * path.count("/") + "├── " + path.rsplit("/", 1)[-1]
        out.append(line)
        size += len(line) + 1
        if size >= chars:
            break
    return "\n".join(out)


def diff(rng: random.Random, chars: int, path: str) -> str:
    out = [f"--- a/{path}", f"+++ b/{path}"]
    size = 40
    while size < chars:
        old, new = _function(rng), _function(rng)
        hunk = [f"@@ -{rng.randint(1, 500)},{len(old)} +{rng.randint(1, 500)},{len(new)} @@",
                *["-" + x for x in old], *["+" + x for x in new]]
        out += hunk
        size += sum(len(x) + 1 for x in hunk)
    return "\n".join(out) + "\nThe edit was applied."


def shell_output(rng: random.Random, chars: int) -> str:
    return "exit status 0\nstdout:\n" + "\n".join(_lines(chars - 20, lambda: (
        f"{rng.getrandbits(28):07x} {_sentence(rng, rng.randint(4, 9))[:-1]} ({rng.choice(_MODULES)}: "
        f"{rng.choice(_VERBS)} {_ident(rng)})")))


# What each step's output is, and its share of the session's growth (file reads dominate real sessions).
@dataclass(frozen=True)
class Kind:
    tool: str
    weight: float


KINDS = {"tree": Kind("list_dir", 0.4), "read": Kind("read_file", 1.6), "grep": Kind("grep", 0.6),
         "tests_fail": Kind("run_tests", 1.0), "edit": Kind("edit_file", 0.3), "tests_pass": Kind("run_tests", 0.5),
         "shell": Kind("run_shell", 0.4)}
# The order of a session's steps (repeated as needed): explore, read, search, test, edit, test again.
ORDER = ("tree", "read", "grep", "read", "tests_fail", "read", "edit", "tests_fail", "grep", "read", "edit",
         "shell", "read", "tests_pass", "grep", "read", "edit", "tests_pass")


def kind_of(index: int) -> str:
    return ORDER[index % len(ORDER)]


@dataclass
class ToolStep:
    """One scripted step: the call the agent made, and its output."""

    kind: str
    tool: str
    arguments: dict
    output: str

    def as_text(self) -> str:
        """How a client without tool calls (aider's shape) reports the step: the call, then its output."""
        return f"I ran {self.tool}({json.dumps(self.arguments, ensure_ascii=False)}). Its output:\n\n" \
               f"{self.output}\n\nContinue with the task."


class Script:
    """The session for one seed. Sizes are asked for in characters; the caller converts from tokens."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.paths = repo_paths(random.Random(f"repo:{seed}"), 80)

    def _rng(self, what: str) -> random.Random:
        return random.Random(f"{self.seed}:{what}")

    @staticmethod
    def system_prompt(chars: int) -> str:
        """The agent's instructions and a map of the repository's conventions, padded to about `chars`."""
        rng = random.Random("system")
        parts = [_RULES, "\nRepository conventions (from CONTRIBUTING.md):\n"]
        size = sum(map(len, parts))
        n = 0
        while size < chars:
            n += 1
            line = f"{n}. In {rng.choice(_MODULES)}/, {_sentence(rng, rng.randint(8, 20))}\n"
            parts.append(line)
            size += len(line)
        return "".join(parts)

    def task(self) -> str:
        rng = self._rng("task")
        a, b = rng.sample(self.paths, 2)
        return (f"The tests in {b} fail since the last change to {a}: {_sentence(rng, 14)} Find the cause, fix "
                f"it without weakening any test, and run the suite.")

    def step(self, index: int, chars: int) -> ToolStep:
        kind = kind_of(index)
        rng = self._rng(f"step:{index}")
        path = rng.choice(self.paths)
        if kind == "tree":
            args, output = {"path": ".", "depth": 3}, tree(rng, chars)
        elif kind == "read":
            args, output = {"path": path}, source_file(rng, chars)
        elif kind == "grep":
            pattern = f"{rng.choice(_VERBS)}_{rng.choice(_WORDS)}"
            args, output = {"pattern": pattern, "glob": "*.py"}, grep_output(rng, chars, pattern)
        elif kind in ("tests_fail", "tests_pass"):
            args = {"path": "tests/", "keyword": rng.choice(_WORDS)} if kind == "tests_fail" else {"path": "tests/"}
            output = test_log(rng, chars, kind == "tests_fail")
        elif kind == "edit":
            args = {"path": path, "old_string": _sentence(rng, 6), "new_string": _sentence(rng, 6)}
            output = diff(rng, chars, path)
        else:
            args, output = {"command": "git log --oneline -n 40"}, shell_output(rng, chars)
        return ToolStep(kind, KINDS[kind].tool, args, output)

    @staticmethod
    def weight(index: int) -> float:
        return KINDS[kind_of(index)].weight

    def cold_text(self, chars: int, salt: str) -> str:
        """Text like the session's (code, logs, search hits) that shares no prefix with it: the cold prompt."""
        rng = self._rng(f"cold:{salt}")
        parts = [f"Review request {rng.getrandbits(64):016x}. Summarise what these files and logs say.\n\n"]
        size = len(parts[0])
        while size < chars:
            piece = rng.choice((lambda: source_file(rng, 2400), lambda: test_log(rng, 1600, True),
                                lambda: grep_output(rng, 900, _ident(rng))))()
            parts.append(piece + "\n\n")
            size += len(piece) + 2
        return "".join(parts)[:chars]

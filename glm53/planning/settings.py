"""The one settings schema: every GLM53_* setting is defined here, once.

Values come from the process environment, then a `.env` file in the working directory (the environment
wins). `.env.example` and docs/configuration.md are generated from this table (`glm53 settings --write`)
and a test fails when they drift. Keep this list short: a number the engine can measure on the host it
runs on is not a setting.
"""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

MODES = ("auto", "fast", "exact", "nvme", "nvme-exact")
LOG_LEVELS = ("debug", "info", "warning", "error")
PREFIX = "GLM53_"


class SettingsError(ValueError):
    """An invalid setting value; start-up stops with exit status 2."""

    def __init__(self, message: str, warnings: list[str] | None = None):
        super().__init__(message)
        self.warnings = list(warnings or [])


BOOL = "bool: 1/0, true/false, yes/no, on/off"


def _bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected one of 1/0, true/false, yes/no, on/off")


def _int_at_least(lo: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text.strip())
        if value < lo:
            raise ValueError(f"expected an integer >= {lo}")
        return value

    parse.__doc__ = f"integer >= {lo}"
    return parse


def _float_at_least(lo: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = float(text.strip())
        if value < lo or value != value:
            raise ValueError(f"expected a number >= {lo}")
        return value

    parse.__doc__ = f"number >= {lo}"
    return parse


def _choice(options: tuple[str, ...]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in options:
            raise ValueError("expected one of " + ", ".join(options))
        return value

    parse.__doc__ = " | ".join(options)
    return parse


def _text(text: str) -> str:
    return text.strip()


def _host(text: str) -> str:
    value = text.strip()
    if not value:
        raise ValueError("empty")
    return value


DEFAULT_PORTS = {"http": "80", "https": "443"}


def _origin(item: str) -> str:
    """One allowed origin as browsers write it in the Origin header: lower case, no path, no default port."""
    if item in ("*", "null"):
        return item
    scheme, sep, rest = item.partition("://")
    authority = rest.rstrip("/")
    if not sep or not scheme.isalpha() or not authority or any(c in authority for c in "/?#@ "):
        raise ValueError(f"{item!r} is not an origin (scheme://host[:port], e.g. http://localhost:3000)")
    scheme, authority = scheme.lower(), authority.lower()
    default = DEFAULT_PORTS.get(scheme)
    if default and authority.endswith(f":{default}"):
        authority = authority[: -len(default) - 1]
    return f"{scheme}://{authority}"


def _origins(text: str) -> tuple:
    """Comma-separated origins -> a tuple of normalized origin strings, in the order given, without repeats."""
    items = [_origin(x.strip()) for x in text.split(",") if x.strip()]
    return tuple(dict.fromkeys(items))


def _port(text: str) -> int:
    value = int(text.strip())
    if not 1 <= value <= 65535:
        raise ValueError("expected a TCP port 1..65535")
    return value


@dataclass(frozen=True)
class Setting:
    name: str
    default: str
    meaning: str
    parse: Callable[[str], Any] = _text
    allowed: str = "text"
    # Defaults that differ by mode, e.g. {"nvme": "2"}; the plain default applies to the other modes.
    mode_defaults: dict[str, str] = field(default_factory=dict)
    secret: bool = False  # `glm53 settings` says whether it is set, never the value (terminals get shared)


SCHEMA: tuple[Setting, ...] = (
    Setting("GLM53_MODEL_DIR", "", "Checkpoint directory (EXL3). Empty: serve the generated random-weight demo model."),
    Setting("GLM53_STORE", "", "Expert record store file made by pack-store; needed by the nvme modes."),
    Setting("GLM53_MODE", "auto", "auto picks from the host; or force fast, exact, nvme, nvme-exact.",
            _choice(MODES), " | ".join(MODES)),
    Setting("GLM53_EXACT", "0", "In auto mode, prefer the bit-exact modes (exact / nvme-exact).", _bool, BOOL),
    Setting("GLM53_HOST", "127.0.0.1", "Address the HTTP server binds to.", _host,
            "an address: 127.0.0.1 (this machine), 0.0.0.0 / :: (every interface)"),
    Setting("GLM53_PORT", "30000", "TCP port of the HTTP server.", _port, "1..65535"),
    Setting("GLM53_MODEL_ID", "glm-5.3-flash", "Model id reported by /v1/models and accepted in requests."),
    Setting("GLM53_API_KEY", "", "If set, every route but /health, /ready and /metrics needs 'Authorization: Bearer <key>' (or 'x-api-key: <key>').",
            secret=True),
    Setting("GLM53_ALLOW_NO_API_KEY", "0",
            "Allow binding to a non-loopback address without an API key (otherwise start-up refuses).",
            _bool, BOOL),
    Setting("GLM53_ALLOWED_ORIGINS", "",
            "Web pages that may use the server from a browser, and the names it answers to besides localhost and IP "
            "addresses (so a page cannot reach it by DNS rebinding): list the origins of those pages, and the "
            "address clients reach the server at when it is a name (http://gpubox.lan:30000, a compose service "
            "http://glm53:30000). Empty: only non-browser clients and the server's own /docs page. * lets every "
            "site and name through.",
            _origins, "comma-separated origins scheme://host[:port] | * | (empty)"),
    Setting("GLM53_CONTEXT", "131072", "Context window in tokens (KV cache size); the plan may lower it to fit.",
            _int_at_least(256), "integer >= 256"),
    Setting("GLM53_REASONING_BUDGET", "4096",
            "Thinking tokens allowed before the server closes the reasoning block; 0 = unlimited.",
            _int_at_least(0), "integer >= 0"),
    Setting("GLM53_REASONING_EFFORT", "high",
            "Default thinking effort when a request sets none: none (off), low, high, or max (the model's own "
            "default, which deliberates hundreds of tokens even on a one-line question: tens of seconds at "
            "desktop decode speed). Requests override it with reasoning_effort.",
            _choice(("none", "low", "high", "max")), "none | low | high | max"),
    Setting("GLM53_MAX_CONCURRENCY", "0",
            "Requests decoded together, at most; more wait in the queue, and the slots are time-sliced: while one "
            "waits, the reply that has held its slot longest past a slice (10x what resuming a reply costs, at least "
            "2 s; slice_s in /stats) yields it and resumes later where it was. Each holds 145 MiB of KDA state in "
            "VRAM. "
            "0: the plan picks, up to 8, fewer where more would cost the VRAM expert slots' hot set; a number is "
            "kept as given.",
            _int_at_least(0), "0 (the plan picks) | integer >= 1"),
    Setting("GLM53_MAX_QUEUE", "32",
            "Requests that may wait for a decode slot; beyond it a request gets 429 with Retry-After (Anthropic's "
            "route: 429 rate_limit_error) at once instead of waiting unseen; one that needs more generations than slots "
            "plus queue (n, or prompts on /v1/completions) gets 400. 0 = no limit.",
            _int_at_least(0), "integer >= 0"),
    Setting("GLM53_MAX_IMAGES", "16",
            "Images one request may carry, history included (each costs its vision-tower pass and up to the "
            "checkpoint's max_image_tokens of context); more get 400. 0 = images off: the exllamav3 engine does not "
            "load the vision tower, and its VRAM goes to expert slots.",
            _int_at_least(0), "integer >= 0"),
    Setting("GLM53_MAX_IMAGE_MB", "5",
            "Largest image accepted, in MiB of encoded bytes (PNG, JPEG, GIF, WebP; Anthropic's API takes 5 too); a "
            "larger one gets 413. Request "
            "bodies may grow by this (base64) for each image allowed.",
            _float_at_least(0.01), "number >= 0.01"),
    Setting("GLM53_IMAGE_URL_FETCH", "0",
            "Let requests name images by http(s) URL, which the server then downloads (the appliance runs offline, "
            "so off by default: such images get 400 and clients send the bytes inline instead).",
            _bool, BOOL),
    Setting("GLM53_VRAM_BUDGET_GB", "0",
            "Cap on the VRAM glm53 uses, in GiB; 0 = what the GPU has free. Emulates a smaller card on a big one.",
            _float_at_least(0.0), "number >= 0"),
    Setting("GLM53_CPU_THREADS", "0",
            "CPU-lane threads; 0 = physical cores minus one (SMT siblings unused). Exact modes use none.",
            _int_at_least(0), "integer >= 0"),
    Setting("GLM53_ALLOW_BUFFERED_READS", "0",
            "Let the store reader fall back to buffered reads where O_DIRECT is unsupported (slower; warned).",
            _bool, BOOL),
    Setting("GLM53_CACHE_DIR", "~/.cache/glm53",
            "Where the demo model, routing statistics and calibration are kept between runs."),
    Setting("GLM53_LOG_LEVEL", "info", "Log verbosity.", _choice(LOG_LEVELS), " | ".join(LOG_LEVELS)),
)

BY_NAME = {s.name: s for s in SCHEMA}
# GLM53_* names that are not settings of the server, so not warned about as unknown: the entrypoint's
# interpreter, and test-suite switches.
NOT_SETTINGS = frozenset({"GLM53_PYTHON", "GLM53_TEST_ENGINE", "GLM53_EXLLAMAV3_SRC"})


@dataclass(frozen=True)
class Settings:
    """Every setting, parsed: one typed field per GLM53_* name (the name without the prefix, lower case), in
    SCHEMA's order. SCHEMA holds the defaults, meanings and parsers; a test keeps its names and types equal to
    these fields."""

    model_dir: str
    store: str
    mode: str
    exact: bool
    host: str
    port: int
    model_id: str
    api_key: str
    allow_no_api_key: bool
    allowed_origins: tuple  # of origins, normalized as browsers write them (or "*")
    context: int
    reasoning_budget: int
    reasoning_effort: str
    max_concurrency: int
    max_queue: int
    max_images: int
    max_image_mb: float
    image_url_fetch: bool
    vram_budget_gb: float
    cpu_threads: int
    allow_buffered_reads: bool
    cache_dir: str
    log_level: str
    warnings: tuple[str, ...] = ()

    def with_overrides(self, **kw: Any) -> Settings:
        """These settings with some fields replaced (the command line's --model, --store, ...)."""
        return replace(self, **kw)


def attr_name(name: str) -> str:
    return name[len(PREFIX):].lower()


def read_dotenv(path: Path) -> dict[str, str]:
    if not path.is_file():
        return {}
    from dotenv import dotenv_values

    return {k: v for k, v in dotenv_values(path).items() if v is not None}


AUTO_CONCURRENCY = 8  # what GLM53_MAX_CONCURRENCY=0 allows at most


def concurrency_of(settings: Settings) -> tuple[int, bool]:
    """(sequences at most, whether the plan may lower them): GLM53_MAX_CONCURRENCY=0 leaves it to the plan."""
    n = int(settings.max_concurrency)
    return (n, False) if n else (AUTO_CONCURRENCY, True)


def load(environ: dict[str, str] | None = None, dotenv: Path | None = Path(".env"),
         mode: str | None = None) -> Settings:
    """Parse every setting; raise SettingsError naming the setting, the value and what is allowed."""
    env = dict(read_dotenv(dotenv)) if dotenv is not None else {}
    env.update(os.environ if environ is None else environ)
    warnings = []
    for key in sorted(env):
        if key.startswith(PREFIX) and key not in BY_NAME and key not in NOT_SETTINGS:
            close = difflib.get_close_matches(key, list(BY_NAME), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else "; `glm53 settings` lists the known ones"
            warnings.append(f"unknown setting {key}{hint}")
    raw_mode = env.get("GLM53_MODE", BY_NAME["GLM53_MODE"].default)
    values: dict[str, Any] = {}
    for s in SCHEMA:
        text = env.get(s.name)
        if text is None:
            eff_mode = mode or raw_mode.strip().lower()
            text = s.mode_defaults.get(eff_mode, s.default)
        try:
            values[attr_name(s.name)] = s.parse(text)
        except ValueError:
            raise SettingsError(f"{s.name}={text!r} is invalid (allowed: {s.allowed}). "
                                f"Fix it in the environment or .env.", warnings) from None
    values["cache_dir"] = str(Path(values["cache_dir"]).expanduser())
    return Settings(**values, warnings=tuple(warnings))


def load_or_exit(**kw: Any) -> Settings:
    try:
        settings = load(**kw)
    except SettingsError as exc:
        for w in exc.warnings:
            print(f"glm53: warning: {w}", file=sys.stderr)
        print(f"glm53: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    for w in settings.warnings:
        print(f"glm53: warning: {w}", file=sys.stderr)
    return settings


def _default_column(s: Setting) -> str:
    parts = [s.default or "(empty)"]
    parts += [f"{m}: {v}" for m, v in s.mode_defaults.items()]
    return "; ".join(parts)


def render_env_example() -> str:
    lines = ["# glm53 settings. Generated from glm53/planning/settings.py by `glm53 settings --write`; do not edit by hand.",
             "# Copy to .env and change what you need. The environment overrides this file.", ""]
    for s in SCHEMA:
        lines.append(f"# {s.meaning} Allowed: {s.allowed}.")
        for m, v in s.mode_defaults.items():
            lines.append(f"# In {m} mode the default is {v}.")
        lines.append(f"# {s.name}={s.default}")
        lines.append("")
    return "\n".join(lines)


def render_markdown() -> str:
    lines = ["# Configuration", "",
             "Generated from `glm53/planning/settings.py` by `glm53 settings --write`; a test fails when this file drifts.",
             "Set these in the environment (`docker run -e ...`) or in a `.env` file. An invalid value stops",
             "start-up with a message naming it (exit status 2); an unknown `GLM53_*` name is warned about.", "",
             "| setting | default | allowed | meaning |", "|---|---|---|---|"]
    def cell(text: str) -> str:  # a bare | would end the cell (GLM53_MODE's allowed values are "auto | fast | ...")
        return str(text).replace("|", "\\|")

    for s in SCHEMA:
        lines.append(f"| `{s.name}` | `{cell(_default_column(s))}` | {cell(s.allowed)} | {cell(s.meaning)} |")
    return "\n".join(lines) + "\n"


def shown_value(s: Setting, value: Any) -> str:
    """A current value as `glm53 settings` prints it: a secret only as set or not."""
    if s.secret:
        return f"<set, {len(value)} characters, hidden>" if value else "''"
    return repr(value)


def render_table(settings: Settings | None = None) -> str:
    rows = []
    for s in SCHEMA:
        current = "" if settings is None else f"  = {shown_value(s, getattr(settings, attr_name(s.name)))}"
        rows.append(f"{s.name:28} default {_default_column(s)!r:18} {s.meaning}{current}")
    return "\n".join(rows)

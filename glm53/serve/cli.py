"""`glm53 serve`: settings -> engine choice (host facts -> plan -> engine, in glm53.serve.choice) -> app -> HTTP.

Heavy imports (torch, FastAPI) happen inside the command, so `glm53 --help` stays fast.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import ipaddress
import logging
import socket
import sys
from collections.abc import Callable
from typing import Any

from glm53.server.urls import http_url

log = logging.getLogger("glm53.server")

LOG_FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"


# On SIGTERM or Ctrl-C, running replies get this long to finish; then each ends with its API's error event, and
# the process exits (well inside `docker stop`'s 10 s).
DRAIN_S = 3.0


def _server(config: Any, state: Any) -> Any:
    """uvicorn's Server, told about the shutdown as soon as the signal arrives (see DRAIN_S)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            first = not self.should_exit
            super().handle_exit(sig, frame)
            if first:  # the signal handler runs on the loop's thread, between two of its steps
                loop = asyncio.get_running_loop()
                loop.call_soon_threadsafe(loop.call_later, DRAIN_S, _stop_generations, state)

    return DrainingServer(config)


def _stop_generations(state: Any) -> None:
    n = state.stop_generations()
    if n:
        log.info("shutdown: %d reply(ies) still running after %.0f s were ended with an error", n, DRAIN_S)


def register(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible API (the demo model when none is configured)")
    p.add_argument("--model", metavar="DIR", help="checkpoint directory (overrides GLM53_MODEL_DIR)")
    p.add_argument("--host", help="bind address (overrides GLM53_HOST)")
    p.add_argument("--port", type=int, help="TCP port (overrides GLM53_PORT)")
    p.set_defaults(func=cmd_serve)


class _DropUvicornStartupLine(logging.Filter):
    """uvicorn says "Application startup complete" before the weights are loaded; launchers read that phrase
    as "ready", so the app logs it itself once the model can answer."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Application startup complete")


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, stream=sys.stderr, force=True)
    logging.getLogger("uvicorn.error").addFilter(_DropUvicornStartupLine())
    if level != "debug":
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per benchmark request is noise


def uvicorn_log_config(level: str) -> dict:
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": LOG_FORMAT}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "plain", "stream": "ext://sys.stderr"}},
        "loggers": {
            "uvicorn": {"handlers": ["stderr"], "level": level.upper(), "propagate": False},
            "uvicorn.access": {"handlers": ["stderr"], "level": "WARNING" if level != "debug" else "INFO",
                               "propagate": False},
        },
    }


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind_refusal(settings: Any) -> str | None:
    """Why start-up must refuse to bind, or None. An open, key-less API on a reachable address lets anyone
    on the network run the model; that must be asked for explicitly."""
    if is_loopback(settings.host) or settings.api_key or settings.allow_no_api_key:
        return None
    return (f"refusing to listen on {settings.host} without an API key: set GLM53_API_KEY (clients then send "
            f"'Authorization: Bearer <key>'), or GLM53_ALLOW_NO_API_KEY=1 if the network in front is trusted.")


def settings_from_args(args: argparse.Namespace) -> Any:
    from glm53.planning import settings as S

    settings = S.load_or_exit()
    overrides = {k: v for k, v in (("model_dir", getattr(args, "model", None)),
                                   ("host", getattr(args, "host", None)),
                                   ("port", getattr(args, "port", None))) if v is not None}
    if "port" in overrides and not 1 <= overrides["port"] <= 65535:
        print(f"glm53: --port {overrides['port']} is not a TCP port (1..65535)", file=sys.stderr)
        raise SystemExit(2)
    if "host" in overrides and not overrides["host"].strip():
        print(f"glm53: --host is empty (allowed: {S.BY_NAME['GLM53_HOST'].allowed})", file=sys.stderr)
        raise SystemExit(2)
    return settings.with_overrides(**overrides) if overrides else settings


def keep_kernel_cache(settings: Any, environ: dict | None = None) -> str:
    """Point Triton's kernel and autotune cache into GLM53_CACHE_DIR (the Docker recipes' cache volume) unless
    the user chose a place: exllamav3's KDA prefill kernels are compiled and autotuned on first use, which took
    116 s before the first 8K-token prompt on a fresh machine and 1 s once cached (docs/results.md)."""
    import os
    from pathlib import Path

    env = os.environ if environ is None else environ
    if not env.get("TRITON_CACHE_DIR"):
        env["TRITON_CACHE_DIR"] = str(Path(settings.cache_dir).expanduser() / "triton")
    return env["TRITON_CACHE_DIR"]


def start_engine(settings: Any) -> Any:
    """The engine these settings choose (not loaded yet), its banner logged; exit 2 with the reason if none."""
    from glm53.serve.choice import EngineChoiceError, choose_engine

    keep_kernel_cache(settings)

    try:
        choice = choose_engine(settings)
    except EngineChoiceError as exc:
        print(f"glm53: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    for line in choice.banner:
        log.info("%s", line)
    for line in choice.warnings:
        log.warning("%s", line)
    return choice.engine


class PortError(RuntimeError):
    """The listening socket cannot be had; the message names the port and the setting that moves it."""


# The container's HEALTHCHECK reads the port served from here; the directory exists only in the image.
PORT_FILE = "/run/glm53/port"


def _note_port(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        with open(PORT_FILE, "w") as f:
            f.write(f"{sock.getsockname()[1]}\n")


def listen(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound before anything slow happens (demo generation, the plan, the
    load), so a port in use is reported at once; uvicorn is handed this very socket, so nothing can take the
    port in between."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise PortError(f"cannot listen on {host}: {exc.strerror} (set GLM53_HOST or --host to an address of "
                        f"this machine)") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortError(f"port {port} on {host} is already in use (another glm53 or server?): stop it, or "
                            f"pick another port with GLM53_PORT=<port> (or --port)") from None
        raise PortError(f"cannot listen on {http_url(host, port)}: {exc.strerror} (GLM53_HOST / GLM53_PORT "
                        f"choose the address)") from None
    sock.set_inheritable(True)
    return sock


def cmd_serve(args: argparse.Namespace) -> int:
    return serve(settings_from_args(args))


def serve(settings: Any, make_engine: Callable[[Any], Any] | None = None) -> int:
    """Listen, start the engine make_engine(settings) gives (default: the one these settings choose), serve
    until stopped. A benchmark that emulates another host passes its own maker (glm53.bench.emulated_serve)."""
    setup_logging(settings.log_level)
    refusal = bind_refusal(settings)
    if refusal:
        print(f"glm53: {refusal}", file=sys.stderr)
        return 2
    try:
        sock = listen(settings.host, settings.port)
    except PortError as exc:
        print(f"glm53: {exc}", file=sys.stderr)
        return 2
    _note_port(sock)
    engine = (make_engine or start_engine)(settings)

    import uvicorn

    from glm53.serve.http import protocol
    from glm53.server.app import create_app

    app = create_app(engine, settings)
    log.info("HTTP on %s (model %s loading; /health answers now, /ready once loaded)",
             http_url(settings.host, settings.port), settings.model_id)
    config = uvicorn.Config(app, log_config=uvicorn_log_config(settings.log_level), http=protocol(),
                            timeout_graceful_shutdown=DRAIN_S + 5)
    state = app.state.glm53
    server = _server(config, state)

    def stop_serving() -> None:
        # A failed load is final: exit (status 2) rather than answer 503 forever. A container then stops with the
        # reason as the last line of its log, and its restart policy, not a health check, decides what follows.
        server.should_exit = True

    state.on_load_failure = stop_serving
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addFilter(_DropUvicornStartupLine())
    # uvicorn names its address only when it binds it itself; the socket is listening already, so say it here.
    uvicorn_log.info("Uvicorn running on %s (Press CTRL+C to quit)", http_url(settings.host, settings.port))
    server.run(sockets=[sock])
    if state.load_error:
        print(f"glm53: the model could not be loaded: {state.load_error} (the log above has the details); fix that "
              f"and start again", file=sys.stderr)
        return 2
    return 0

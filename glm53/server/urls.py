"""The server's address as a client writes it; apart from the app, so the CLI prints it without importing FastAPI."""

from __future__ import annotations


def http_url(host: str, port: int) -> str:
    """The URL a client would use; an IPv6 literal needs brackets (http://[::1]:30000)."""
    return f"http://[{host.strip('[]')}]:{port}" if ":" in host else f"http://{host}:{port}"

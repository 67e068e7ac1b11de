"""uvicorn's HTTP/1.1 protocol with a deadline on request headers.

uvicorn times out a connection only while it is idle between two requests (its keep-alive timeout). A client that
opens a connection and then sends half a request line, or headers a byte at a time, holds its connection (a file
descriptor and a task) for as long as it likes: enough such clients and nobody else gets in. Here every request's
headers must be complete within HEADER_TIMEOUT_S of the connection opening or the previous response ending;
otherwise the connection is closed, with one log line. The body has its own deadline (glm53.server.app.BodyLimit):
headers are read by the protocol, the body by the app.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger("glm53.server")

# Generous for any client on a LAN (headers are a few KB); a slow-header client is cut off well before it matters.
HEADER_TIMEOUT_S = 15.0


def _base() -> type:
    """The class uvicorn's `http="auto"` picks: httptools where it is installed, h11 otherwise."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        return HttpToolsProtocol
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol


def protocol(header_timeout_s: float = HEADER_TIMEOUT_S, base: type | None = None) -> type:
    """The protocol class for uvicorn.Config(http=...): `base` (default: uvicorn's auto choice) with the deadline."""

    class HeaderDeadline(base or _base()):  # type: ignore[misc]
        """A request's headers within `header_timeout_s`; both uvicorn protocols start a new `cycle` exactly when
        a request's headers are complete, which is how the deadline knows it was met."""

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._deadline: asyncio.TimerHandle | None = None
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._deadline is not None and self.cycle is not self._waiting_after:
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._waiting_after = self.cycle  # the headers that follow start a cycle other than this one
            self._deadline = self.loop.call_later(header_timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            peer = self.client[0] if self.client else "unknown"
            log.warning("closed a connection from %s: no complete request headers within %.0f s of %s", peer,
                        header_timeout_s, "its opening" if self._waiting_after is None else "the previous response")
            self.transport.close()

    return HeaderDeadline

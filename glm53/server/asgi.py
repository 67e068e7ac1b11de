"""What the pure ASGI middlewares share: answering with an API error before the app runs, and reading a refused
body to its end."""

from __future__ import annotations

from starlette.types import Receive, Scope, Send

from glm53.server import errors
from glm53.server.errors import APIError
from glm53.server.jsontext import json_bytes

JSON_HEADER = (b"content-type", b"application/json")
DRAIN_LIMIT_BYTES = 64 << 20  # a refused body is read and dropped up to this much (then the connection closes)


async def send_error(scope: Scope, send: Send, err: APIError, extra: list[tuple[bytes, bytes]] | None = None) -> None:
    """The error in the shape the route's clients read (errors.body_for), as a whole response."""
    body = json_bytes(errors.body_for(scope.get("path", ""), err))
    headers = [JSON_HEADER, (b"content-length", str(len(body)).encode()), *(extra or [])]
    headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (err.headers or {}).items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def drain(receive: Receive, most: int = DRAIN_LIMIT_BYTES) -> None:
    """Read and drop the rest of a refused body (cheap: no parsing), so a client that writes its whole request
    before reading gets the answer rather than a connection reset; a body beyond `most` is cut off."""
    seen = 0
    while seen <= most:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        seen += len(message.get("body", b""))

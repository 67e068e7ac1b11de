"""JSON as the server writes it: UTF-8, and never an error for text a client sent.

json.loads accepts a lone surrogate escape ("\\ud800") and Python keeps it in the str; UTF-8 cannot encode it, so
echoing such a string (an error naming the value, the Responses API's metadata) raised inside the response: a
500 and a dropped connection. Such a document is written with ASCII escapes instead, which is the text the client
sent, as it sent it.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse


def json_bytes(obj: Any, allow_nan: bool = True) -> bytes:
    text = json.dumps(obj, ensure_ascii=False, allow_nan=allow_nan, separators=(",", ":"))
    try:
        return text.encode()
    except UnicodeEncodeError:
        return json.dumps(obj, allow_nan=allow_nan, separators=(",", ":")).encode()


class JSONBody(JSONResponse):
    """Starlette's JSONResponse (no NaN), written by json_bytes."""

    def render(self, content: Any) -> bytes:
        return json_bytes(content, allow_nan=False)

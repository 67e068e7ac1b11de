"""A recording HTTP proxy for the real-client tests: forwards every request to the server, streams the answer
back unchanged and writes what the client sent (method, path, headers, JSON body) and the status it got to a
JSON-lines file. The captured requests become fixtures for the translation's unit tests.

Run: python tests/support/recording_proxy.py --port P --upstream http://127.0.0.1:U --out FILE
"""

from __future__ import annotations

import argparse
import http.client
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}
SECRET_HEADERS = {"authorization", "x-api-key"}


class Recorder:
    def __init__(self, path: str) -> None:
        self.path = path
        self.lock = threading.Lock()

    def write(self, record: dict) -> None:
        with self.lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def last_usage(answer: bytes) -> dict | None:
    """The last `usage` object of a JSON answer or of an SSE stream's events (the final counts)."""
    docs = [line[5:].strip() for line in answer.split(b"\n") if line.startswith(b"data:")] or [answer]
    usage = None
    for doc in docs:
        try:
            event = json.loads(doc)
        except ValueError:
            continue
        for holder in (event, event.get("response") or {}) if isinstance(event, dict) else ():
            if isinstance(holder, dict) and isinstance(holder.get("usage"), dict):
                usage = holder["usage"]
    return usage


def make_handler(upstream: str, recorder: Recorder) -> type[BaseHTTPRequestHandler]:
    up = urlsplit(upstream)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # the record file is the log
            pass

        def _forward(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length) if length else b""
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP and k.lower() != "host"}
            conn = http.client.HTTPConnection(up.hostname, up.port, timeout=3600)
            conn.request(self.command, self.path, body=body or None, headers=headers)
            resp = conn.getresponse()
            try:
                parsed = json.loads(body) if body else None
            except ValueError:
                parsed = body.decode("utf-8", "replace")
            record = {"method": self.command, "path": self.path, "status": resp.status,
                      "headers": {k.lower(): ("<redacted>" if k.lower() in SECRET_HEADERS else v)
                                  for k, v in self.headers.items()},
                      "body": parsed}
            self.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in HOP and k.lower() != "content-length":
                    self.send_header(k, v)
            self.send_header("Connection", "close")
            self.end_headers()
            answer = bytearray()
            while True:
                chunk = resp.read1(65536)
                if not chunk:
                    break
                answer += chunk
                self.wfile.write(chunk)
                self.wfile.flush()
            conn.close()
            record["usage"] = last_usage(bytes(answer))
            recorder.write(record)
            self.close_connection = True

        do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = do_OPTIONS = _forward

    return Handler


def serve(port: int, upstream: str, out: str) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", port), make_handler(upstream, Recorder(out)))
    server.daemon_threads = True
    return server


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    serve(a.port, a.upstream, a.out).serve_forever()


if __name__ == "__main__":
    main()

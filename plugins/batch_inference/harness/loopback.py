"""A loopback server that speaks OpenAI's chat-completions wire shape, for the tests and the nights harness.

A hosted or internal endpoint is the one boundary the engine and the fallback
pool cross; this is it, on ``127.0.0.1``. What it answers is up to the caller:
``respond(body)`` returns ``(status, headers, payload)`` for each POSTed JSON
body (``payload`` a dict, or bytes sent as they are; ``DROP`` closes the
connection with no answer, a dropped request), or the same with a fourth
element, the seconds to hold that answer (a slower price tier). Every request
is kept (``hits``: arrival time, body, headers), ``delay`` holds each other
answer back, and ``max_in_flight`` says how many were on the wire at once.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Answer = tuple[int, dict[str, str], Any]   # or (status, headers, payload, seconds to hold this answer)
# How often a server's loop looks for a shutdown, so close() returns within it (socketserver's default
# is 0.5 s, half a second at every close of a test's server).
POLL_S = 0.05
DROP = b"\0drop"      # a payload that drops the request: the connection closes with no answer


def completion(content: str = '{"category": "bug", "summary": "x"}', finish: str = "stop",
               tokens: int = 9) -> dict[str, Any]:
    """A chat-completions answer with one choice."""
    return {"id": "chatcmpl-test", "object": "chat.completion",
            "choices": [{"index": 0, "finish_reason": finish, "message": {"role": "assistant", "content": content}}],
            "usage": {"completion_tokens": tokens}}


class ChatServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, respond: Callable[[dict[str, Any]], Answer] | None = None, delay: float = 0.0):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.respond = respond or (lambda body: (200, {}, completion()))
        self.delay = delay
        self.hits: list[tuple[float, dict[str, Any], dict[str, str]]] = []
        self.lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0
        threading.Thread(target=self.serve_forever, args=(POLL_S,), daemon=True).start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"

    @property
    def bodies(self) -> list[dict[str, Any]]:
        return [body for _, body, _ in self.hits]

    def handle_error(self, request: Any, client_address: Any) -> None:
        import sys

        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)   # a client that timed out and left is expected

    def close(self) -> None:
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    server: ChatServer

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        srv = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with srv.lock:
            srv.hits.append((time.monotonic(), body, dict(self.headers)))
            status, headers, payload, *hold = srv.respond(body)
            srv.in_flight += 1
            srv.max_in_flight = max(srv.max_in_flight, srv.in_flight)
        try:
            time.sleep(hold[0] if hold else srv.delay)
            if payload is DROP:
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        finally:
            with srv.lock:
                srv.in_flight -= 1

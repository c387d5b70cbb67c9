"""The provider side every hosted batch emulator shares: a loopback HTTP server
with a route table, and a clock that works through each batch's requests.

A batch is a list of request lines; a ticker completes them in order at
``rate`` per second after ``validate_s``, stops after ``hold_after`` of them
per batch while that is set (a provider queue that stalls), keeps completing
for ``cancel_delay_s`` after a cancel before the batch settles (a cancel is a
request that settles, and what completes meanwhile is billed), and ends an
unfinished batch at ``expire_s``. A batch keeps the ``validate_s`` and
``expire_s`` it was created with (``_validate_s``, ``_expire_s``), so
``on_create`` may give one batch its own. ``billed`` counts every request
completed, success or per-request error, by id across all batches;
``on_create(batch)`` runs after a batch is created and before the reply (the
crash test kills the caller there). Each API module (``harness.hosted_openai``, ``harness.hosted_gemini``,
tests/fixtures/hosted_anthropic.py, hosted_bedrock.py) says what its batch,
results and routes look like.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from batch_inference.harness.loopback import POLL_S

Route = tuple[str, "re.Pattern[str]", Callable[..., tuple[int, Any]]]


class BatchProvider(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, rate: float = 2000.0, validate_s: float = 0.05, cancel_delay_s: float = 0.3,
                 expire_s: float | None = None, tick_s: float = 0.01):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.rate, self.validate_s, self.cancel_delay_s, self.expire_s = rate, validate_s, cancel_delay_s, expire_s
        self.tick_s = tick_s
        self.batches: dict[str, dict[str, Any]] = {}
        self.work: dict[str, dict[str, Any]] = {}
        self.billed: Counter[str] = Counter()
        self.created = 0                  # batches ever created (a deleted one stays counted)
        self.hold_after: int | None = None
        self.on_create: Callable[[dict[str, Any]], None] | None = None
        self.lock = threading.RLock()
        self.calls: list[tuple[str, str]] = []
        self.auth: set[str] = set()       # the credentials requests carried (Authorization or x-api-key)
        self._stop = threading.Event()
        threading.Thread(target=self.serve_forever, args=(POLL_S,), daemon=True).start()
        threading.Thread(target=self._run, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def close(self) -> None:
        self._stop.set()
        self.shutdown()
        self.server_close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        import sys

        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)   # a killed client is expected in the crash test

    # -- what an API module provides ----------------------------------------
    routes: list[Route] = []

    def started(self, b: dict[str, Any], now: float) -> None:
        """Validation passed: the batch is running."""

    def complete(self, b: dict[str, Any], w: dict[str, Any], line: dict[str, Any]) -> None:
        """Answer one request line (append to w['out'] / w['err'], move the counts)."""

    def ended(self, b: dict[str, Any], w: dict[str, Any], how: str, now: float) -> None:
        """The batch settled: how is 'completed', 'cancelled' or 'expired'; w['next'] is where it stopped."""

    def line_id(self, line: dict[str, Any]) -> str:
        return str(line["custom_id"])

    # -- the provider's clock -------------------------------------------------
    def add(self, bid: str, b: dict[str, Any], lines: list[dict[str, Any]]) -> None:
        now = time.time()
        # A batch keeps the validation time and completion window it was created with.
        b["_t0"], b["_validate_s"], b["_expire_s"] = now, self.validate_s, self.expire_s
        self.created += 1
        self.batches[bid] = b
        self.work[bid] = {"lines": lines, "next": 0, "out": [], "err": [], "clock": now, "carry": 0.0,
                          "phase": "validating", "cancel_at": None, "ran": False}
        if self.on_create is not None:
            self.on_create(b)

    def cancel(self, bid: str) -> bool:
        """Start cancelling; False when the batch has already settled."""
        w = self.work[bid]
        if w["phase"] in ("validating", "running"):
            w["phase"], w["cancel_at"] = "cancelling", time.time()
            return True
        return w["phase"] == "cancelling"

    def _run(self) -> None:
        while not self._stop.wait(self.tick_s):
            now = time.time()
            with self.lock:
                for bid, w in self.work.items():
                    self._advance(self.batches[bid], w, now)

    def _advance(self, b: dict[str, Any], w: dict[str, Any], now: float) -> None:
        if w["phase"] == "validating" and now - b["_t0"] >= b["_validate_s"]:
            w["phase"], w["clock"], w["ran"] = "running", now, True
            self.started(b, now)
            return
        if w["phase"] not in ("running", "cancelling"):
            return
        if b["_expire_s"] is not None and w["phase"] == "running" and now - b["_t0"] >= b["_expire_s"]:
            self._end(b, w, "expired", now)
            return
        budget = w["carry"] + (now - w["clock"]) * self.rate
        w["clock"] = now
        # A batch cancelled while it was still validating completes nothing while the cancel settles.
        while budget >= 1 and w["next"] < len(w["lines"]) and w["ran"]:
            if self.hold_after is not None and w["next"] >= self.hold_after:
                break
            line = w["lines"][w["next"]]
            w["next"] += 1
            self.billed[self.line_id(line)] += 1
            self.complete(b, w, line)
            budget -= 1
        w["carry"] = min(budget, 1.0)
        if w["phase"] == "cancelling" and now - w["cancel_at"] >= self.cancel_delay_s:
            self._end(b, w, "cancelled", now)
        elif w["next"] >= len(w["lines"]) and w["phase"] == "running":
            self._end(b, w, "completed", now)

    def _end(self, b: dict[str, Any], w: dict[str, Any], how: str, now: float) -> None:
        w["phase"], w["ended_at"] = "ended", now
        self.ended(b, w, how, now)

    @staticmethod
    def public(b: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in b.items() if not k.startswith("_")}


class _Handler(BaseHTTPRequestHandler):
    server: BatchProvider
    protocol_version = "HTTP/1.1"
    # The headers and the body go out in two writes: with Nagle's algorithm on, the client's delayed
    # ACK holds the second one about 40 ms, a wait no provider's API has.
    disable_nagle_algorithm = True

    def log_message(self, *args: Any) -> None:
        pass

    def _dispatch(self, method: str) -> None:
        srv = self.server
        path, _, query = self.path.partition("?")
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        srv.calls.append((method, path))
        srv.auth.add(self.headers.get("Authorization") or self.headers.get("x-api-key")
                     or self.headers.get("x-goog-api-key") or "")
        params = dict(p.split("=", 1) for p in query.split("&") if "=" in p)
        with srv.lock:
            for m, pattern, fn in srv.routes:
                match = pattern.match(path)
                if m == method and match:
                    status, payload = fn(srv, *match.groups(), body=raw, params=params, headers=self.headers)
                    break
            else:
                status, payload = 404, {"error": {"message": f"no route {method} {path}"}}
        headers: dict[str, str] = {}
        if isinstance(payload, tuple):        # (bytes, content type) or (bytes, content type, headers)
            data, ctype, *more = payload
            headers = more[0] if more else {}
        else:
            data, ctype = json.dumps(payload).encode(), "application/json"
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def do_DELETE(self) -> None:  # noqa: N802
        self._dispatch("DELETE")

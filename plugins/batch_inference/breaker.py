"""The endpoint breaker: an endpoint that fails most requests is down, and no record is at fault.

Transport failures (refused or dropped connections, timeouts, HTTP 5xx,
408/409/429, and 401/403/404, which refuse every request alike) say nothing
about the record that was sent. The ``openai`` engine counts every HTTP
request in a :class:`Breaker`: a transport failure, or an answer (any other
status: 2xx, or a 4xx about the request, such as 400 for a prompt over the
context). The breaker trips when

* the last ``failures`` requests (default 5) all failed, or
* at least 80% of the last ``window`` requests (default 20) failed,

and from then on every request raises :class:`EndpointUnavailable` instead
of being sent. The worker then leaves the shard's records pending with
their attempts untouched, releases the shard, and exits with
``ExitCode.ENDPOINT``; the fallback pool stops all its threads and raises
``FallbackEndpointUnavailable``. The fallback pool hands one breaker to all
its threads, because they share the endpoint.

A record whose retries all failed spends an attempt only while the breaker
has seen the endpoint answer within its window: other requests get through,
so this one is at fault. Otherwise the record keeps retrying with backoff
until the endpoint answers or the breaker trips, which at most ``failures``
further failures do.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from batch_inference.exceptions import BatchInferenceError, InvalidValue

FAILURES = 5          # consecutive transport failures that trip the breaker
WINDOW = 20           # ... or this many recent requests, of which
WINDOW_SHARE = 0.8    # at least this share failed


def public_url(url: str) -> str:
    """``url`` fit for a message: without userinfo (``https://user:key@host/v1`` becomes
    ``https://host/v1``) and with key-like query values redacted (``batch_inference.db.redact``)."""
    from batch_inference.db import redact

    try:
        parts = urlsplit(url)
    except ValueError:
        return redact(url)
    if "@" in parts.netloc:
        url = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
    return redact(url)


class EndpointUnavailable(BatchInferenceError, RuntimeError):
    """The endpoint failed most requests in a row; the records sent to it are not at fault.

    ``describe(role)`` is the one-line message (``role``: "engine" or
    "fallback"); ``str()`` is ``describe("engine")``.
    """

    def __init__(self, endpoint: str, summary: str):
        self.endpoint = public_url(endpoint)
        self.summary = summary
        super().__init__(self.describe("engine"))

    def describe(self, role: str) -> str:
        return f"{role} endpoint {self.endpoint} failing: {self.summary}; records left pending, no attempts spent"


class Breaker:
    """Counts one endpoint's requests; trips on mostly transport failures. Thread-safe."""

    def __init__(self, endpoint: str, failures: int = FAILURES, window: int = WINDOW):
        if failures < 1 or window < failures:
            raise InvalidValue(f"breaker: 'breaker_failures' must be at least 1 and 'breaker_window' at least "
                             f"'breaker_failures', got {failures} and {window}")
        self.endpoint = endpoint
        self.failures = failures
        self.window = window
        self._lock = threading.Lock()
        self._recent: deque[bool] = deque(maxlen=window)   # True: a transport failure
        self._run = 0                                       # transport failures in a row
        self._tripped: EndpointUnavailable | None = None

    @classmethod
    def from_options(cls, endpoint: str, options: dict[str, Any]) -> "Breaker":
        """A breaker from engine options ``breaker_failures`` and ``breaker_window`` (unset: the defaults)."""
        failures = options.get("breaker_failures")
        window = options.get("breaker_window")
        failures = FAILURES if failures is None else int(failures)
        return cls(endpoint, failures, max(failures, WINDOW) if window is None else int(window))

    @property
    def tripped(self) -> EndpointUnavailable | None:
        return self._tripped

    @property
    def answering(self) -> bool:
        """The endpoint answered at least one of the requests in the window."""
        with self._lock:
            return not all(self._recent)

    def check(self) -> None:
        """Raise :class:`EndpointUnavailable` if the breaker has tripped."""
        exc = self._tripped
        if exc is not None:
            raise EndpointUnavailable(exc.endpoint, exc.summary)

    def success(self) -> None:
        """The endpoint answered (any status that is not a transport failure)."""
        with self._lock:
            self._recent.append(False)
            self._run = 0

    def failure(self, reason: str) -> None:
        """Count a transport failure; raises :class:`EndpointUnavailable` once the breaker has tripped."""
        with self._lock:
            if self._tripped is None:
                self._recent.append(True)
                self._run += 1
                failed = sum(self._recent)
                if self._run >= self.failures:
                    summary = f"{self._run} of the last {self._run} requests failed ({reason})"
                elif len(self._recent) == self.window and failed >= WINDOW_SHARE * self.window:
                    summary = f"{failed} of the last {self.window} requests failed ({reason})"
                else:
                    return
                self._tripped = EndpointUnavailable(self.endpoint, summary)
        self.check()

"""A token bucket for calls to rate-limited endpoints, and a cap on how many calls go at all.

``rate`` tokens per second refill a bucket of ``capacity`` tokens. Acquiring
*reserves*: the bucket may go negative and the caller sleeps exactly until its
token would have arrived. Waiters are therefore served in arrival order, each
sleeps once, and the wait is a pure function of the clock, which is what
makes the bucket testable: inject ``clock`` (and ``sleep``) and drive time by
hand; ``reserve()`` is synchronous and does no sleeping at all.

Safe to share between coroutines of one loop and between threads (a lock
guards the arithmetic; nothing awaits while holding it).

``RequestAllowance`` counts requests instead of pacing them: a fixed number
may go, then none (the fallback pool's budget).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from batch_inference.exceptions import InvalidValue


class TokenBucket:
    def __init__(
        self,
        rate: float,
        capacity: float = 1.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ):
        if rate <= 0:
            raise InvalidValue(f"token bucket rate must be positive, got {rate}")
        if capacity < 1:
            raise InvalidValue(f"token bucket capacity must be at least 1, got {capacity}")
        self.rate = float(rate)
        self.capacity = float(capacity)
        self._clock = clock
        self._sleep = sleep
        self._tokens = self.capacity  # start full: the first burst goes at once
        self._stamp = clock()
        self._lock = threading.Lock()

    @property
    def tokens(self) -> float:
        """Tokens available now (negative: that many are owed to waiters)."""
        with self._lock:
            self._refill(self._clock())
            return self._tokens

    def _refill(self, now: float) -> None:
        if now > self._stamp:
            self._tokens = min(self.capacity, self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now

    def reserve(self, n: float = 1.0) -> float:
        """Take ``n`` tokens now; return how many seconds to wait before using them."""
        if n > self.capacity:
            raise InvalidValue(f"cannot take {n} tokens from a bucket of capacity {self.capacity}")
        with self._lock:
            self._refill(self._clock())
            self._tokens -= n
            return 0.0 if self._tokens >= 0 else -self._tokens / self.rate

    async def acquire(self, n: float = 1.0) -> float:
        """Wait until ``n`` tokens are ours; return the seconds waited."""
        wait = self.reserve(n)
        if wait > 0:
            await self._sleep(wait)
        return wait


class RequestAllowance:
    """At most ``limit`` requests across every thread that shares it; keyed, at most ``limit`` keys.

    ``take(key)`` is asked before each request is sent: True uses one up (nothing when ``key``,
    a record id, already took one: a retry of that record spends nothing twice); False (the
    allowance is spent) means the request is not sent. The first refusal calls ``on_spent()`` once,
    from the refused caller's thread. The fallback pool's budget cap (``fallback.run_fallback``),
    keyed by record: the budget counts rows, as the bill does.
    """

    def __init__(self, limit: int, on_spent: Callable[[], None] | None = None):
        if limit < 0:
            raise InvalidValue(f"a request allowance must be >= 0, got {limit}")
        self.limit = int(limit)
        self.taken = 0
        self.refused = 0
        self._keys: set[Any] = set()
        self._on_spent = on_spent
        self._lock = threading.Lock()

    def take(self, key: Any = None) -> bool:
        with self._lock:
            if key is not None and key in self._keys:
                return True
            if self.taken < self.limit:
                self.taken += 1
                if key is not None:
                    self._keys.add(key)
                return True
            self.refused += 1
            first = self.refused == 1
        if first and self._on_spent is not None:
            self._on_spent()
        return False

    @property
    def spent(self) -> bool:
        """A request was refused: the cap, not the work, ended the run."""
        return self.refused > 0

"""Price tiers of the synchronous fallback: the cutoff's arithmetic picks the cheapest tier that still finishes.

A fallback endpoint may sell its synchronous requests at several tiers
(``spec.fallback.tiers``, cheapest first, named as its API names them:
OpenAI's ``service_tier`` ``flex`` then ``default``; Gemini's ``flex`` then
``standard``; ``spec.FALLBACK_TIERS``). Each tier has its price
(``per_row``), its own rate limit (``rate``) and a latency the pool expects
of it until it has measured one (``latency_s``).

:class:`TierPlan` is shared by every thread of the pool, as its bucket and
breaker are. Before each request it picks a tier (:meth:`TierPlan.choose`):
the cheapest whose measured throughput still finishes the rows the pool has
left by the deadline, less what the publish needs after the re-drive::

    remaining * margin / throughput(tier) <= deadline - now - reserve_s
    throughput(tier) = accepted share x min(rate, concurrency / latency)

It is the cutoff's own equation (``cutoff.decide``: rows over the sustained
rate plus a fixed reserve) solved per tier at every request, with the tier's
measured latency (an exponential average of the answered requests) and the
share of its requests it accepted (a flex tier under load refuses some). As
the margin shrinks (the tier is slower than hoped, it refuses more, the
deadline nears) the next rows go to the next tier up; the last tier takes
whatever no cheaper tier can finish. Without a deadline every row goes to the
cheapest tier.

A refusal at a tier below the last (HTTP 429 "Resource Unavailable", a 5xx,
a dropped connection, a timeout) spends no attempt: the row tries that tier
again after a short back-off while the plan still picks it, and after
``TIER_TRIES`` refusals there (or once the plan no longer picks it) moves to
the next tier up. Each tier below the last has a breaker and a token bucket of
its own; a cheaper tier refuses some requests as a matter of course, so its
breaker trips only on the share rule (80% of its last ``breaker.WINDOW``
requests refused), never on a short run: tripped, it sends every row to the
tiers above it for the rest of the run, and the pool goes on. The last tier's breaker and bucket are the pool's, as
without tiers: that one tripping stops the pool.

Each row is billed at the tier that answered it: the pool's worker records
the tier under its shard lease (``bi.fallback_tiers``), and the bill prices
the job's fallback rows tier by tier (:func:`priced_by_tier`), a fallback row
without a tier at the fallback's one price (``cost.fallback_per_row``).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from batch_inference.breaker import WINDOW, Breaker
from batch_inference.ratelimit import TokenBucket

# The built-in engine the pool runs for a spec with tiers (tiers.engine.TieredOpenAIEngine).
TIERED_ENGINE = "openai-tiers"
MARGIN = 1.25          # the projected re-drive must fit this many times over into the time left
LATENCY_WEIGHT = 0.2   # weight of a new latency in the tier's exponential average
ACCEPT_WEIGHT = 0.05   # ... of a new accept (1) or refusal (0) in its accepted share
MIN_ACCEPT = 0.05      # a tier that refuses nearly everything still counts as this slow, never infinitely
TIER_TRIES = 2         # a row refused this many times at a tier below the last moves up a tier


@dataclass
class Tier:
    """One tier as the pool runs it: its price, limit, measured latency and accepted share, counts."""

    name: str
    per_row: Decimal
    rate: float
    latency_s: float
    bucket: TokenBucket
    breaker: Breaker
    accepted: float = 1.0
    answered: int = 0
    refused: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def throughput(self, concurrency: int) -> float:
        """Rows a second this tier answers now: its accepted share of what its limit and latency allow."""
        return max(self.accepted, MIN_ACCEPT) * min(self.rate, concurrency / max(self.latency_s, 1e-6))

    def to_dict(self, concurrency: int) -> dict[str, Any]:
        return {"tier": self.name, "per_row": float(self.per_row), "answered": self.answered,
                "refused": self.refused, "latency_s": round(self.latency_s, 4), "accepted": round(self.accepted, 4),
                "throughput": round(self.throughput(concurrency), 4),
                "breaker": None if self.breaker.tripped is None else self.breaker.tripped.summary}


class TierPlan:
    """The pool's choice of tier for each request; thread-safe. ``deadline`` and the clock are epoch seconds."""

    def __init__(self, tiers: Sequence[Any], *, base_url: str, options: dict[str, Any], concurrency: int,
                 remaining: int, deadline: float | None = None, reserve_s: float = 0.0, default_rate: float,
                 last_bucket: TokenBucket | None = None, last_breaker: Breaker | None = None,
                 clock: Callable[[], float] = time.time, margin: float = MARGIN):
        if not tiers:
            raise ValueError("a tier plan needs at least one tier")
        self.concurrency = max(1, int(concurrency))
        self.remaining = max(0, int(remaining))
        self.deadline, self.reserve_s, self.clock, self.margin = deadline, float(reserve_s), clock, margin
        self._lock = threading.Lock()
        self.tiers: list[Tier] = []
        for i, t in enumerate(tiers):
            last = i == len(tiers) - 1
            rate = float(t.rate if t.rate is not None else default_rate)
            self.tiers.append(Tier(
                name=t.name, per_row=Decimal(str(t.per_row)), rate=rate, latency_s=float(t.latency_s),
                bucket=(last_bucket if last and last_bucket is not None
                        else TokenBucket(rate, max(1.0, min(rate, 10.0)))),
                breaker=(last_breaker if last and last_breaker is not None
                         else Breaker(f"{base_url} ({t.name} tier)", WINDOW, WINDOW))))

    @property
    def last(self) -> int:
        return len(self.tiers) - 1

    def choose(self, floor: int = 0) -> int:
        """The cheapest tier from ``floor`` up whose throughput finishes the remaining rows in time."""
        with self._lock:
            remaining = self.remaining
        left = None if self.deadline is None else self.deadline - self.clock() - self.reserve_s
        for i in range(min(floor, self.last), self.last + 1):
            t = self.tiers[i]
            if i < self.last and t.breaker.tripped is not None:
                continue
            if left is None or remaining * self.margin / t.throughput(self.concurrency) <= left:
                return i
        return self.last

    def observe(self, i: int, seconds: float) -> None:
        """A request at tier ``i`` was answered after ``seconds``."""
        t = self.tiers[i]
        with t.lock:
            t.answered += 1
            t.latency_s += LATENCY_WEIGHT * (max(seconds, 1e-6) - t.latency_s)
            t.accepted += ACCEPT_WEIGHT * (1.0 - t.accepted)
        with self._lock:
            self.remaining = max(0, self.remaining - 1)

    def refused(self, i: int) -> None:
        """Tier ``i`` refused or dropped a request (the row moves up a tier)."""
        t = self.tiers[i]
        with t.lock:
            t.refused += 1
            t.accepted -= ACCEPT_WEIGHT * t.accepted

    def summary(self) -> list[dict[str, Any]]:
        return [t.to_dict(self.concurrency) for t in self.tiers]


class TierAllowance:
    """The budget's cap on the pool in money, shared by every thread (``ratelimit.RequestAllowance``'s
    interface, keyed by record): ``take(key, price)`` reserves a row at the price of the tier it is sent
    to (``price`` None: the last tier's, ``price``), topping up a row that moves up a tier; a row sent and
    not yet answered stays reserved at its tier's price, and ``settle(key, price)`` bills an answered row at
    the tier that answered it. A row whose price no longer fits is not sent; the first refusal calls
    ``on_spent()`` once (the pool stops). What ``fallback.run_fallback`` gives a tiered pool over its
    budget with ``on_budget: page``: a row at a cheaper tier spends less of the budget than one at the last."""

    def __init__(self, money: Decimal, price: Decimal, on_spent: Callable[[], None] | None = None):
        self.money, self.price = Decimal(money), Decimal(price)
        self.reserved = Decimal(0)
        self.taken = self.refused = 0
        self._held: dict[Any, Decimal] = {}
        self._on_spent = on_spent
        self._lock = threading.Lock()

    def take(self, key: Any = None, price: Decimal | None = None) -> bool:
        price = self.price if price is None else Decimal(price)
        with self._lock:
            held = self._held.get(key, Decimal(0)) if key is not None else Decimal(0)
            if key is not None and key in self._held and price <= held:
                return True
            if self.reserved - held + price <= self.money:
                self.reserved += price - held
                self.taken += key not in self._held
                if key is not None:
                    self._held[key] = price
                return True
            self.refused += 1
            first = self.refused == 1
        if first and self._on_spent is not None:
            self._on_spent()
        return False

    def settle(self, key: Any, price: Decimal) -> None:
        """``key``'s row was answered at a tier of ``price``: billed at that, whatever was reserved."""
        with self._lock:
            if key in self._held:
                self.reserved += Decimal(price) - self._held[key]
                self._held[key] = Decimal(price)

    @property
    def spent(self) -> bool:
        """A row was refused: the cap, not the work, ended the run."""
        return self.refused > 0


def projected_split(tiers: Sequence[Any], rows: int, *, start: float, deadline: float | None, reserve_s: float,
                    concurrency: int, default_rate: float, chunks: int = 1000) -> list[dict[str, Any]]:
    """Where the pool's plan would send ``rows`` fallback rows started at ``start`` (epoch seconds):
    ``{tier, rows}`` per tier, cheapest first (``priced_by_tier``'s ``tier_rows``). :class:`TierPlan`'s own
    choice, run on a clock that advances by each row's share of the chosen tier's throughput at the
    latency the spec expects and every request accepted; rows go in up to ``chunks`` steps. What
    ``estimate`` prices the fallback's tail by."""
    now = [float(start)]
    plan = TierPlan(tiers, base_url="", options={}, concurrency=concurrency, remaining=rows,
                    deadline=deadline, reserve_s=reserve_s, default_rate=default_rate, clock=lambda: now[0])
    sent = [0] * len(plan.tiers)
    step = max(1, -(-int(rows) // chunks))
    while plan.remaining > 0:
        i, n = plan.choose(), min(step, plan.remaining)
        sent[i] += n
        now[0] += n / plan.tiers[i].throughput(plan.concurrency)
        plan.remaining -= n
    return [{"tier": t.name, "rows": n} for t, n in zip(plan.tiers, sent)]


def priced_by_tier(report: Any, tier_rows: Iterable[dict[str, Any]], tiers: Sequence[Any]) -> Any:
    """``report`` (a ``cost.CostReport``) with its fallback rows priced at the tier that answered each
    (``tier_rows``: ``{tier, rows}`` from ``bi.fallback_tiers``; ``tiers``: the spec's, for their prices);
    fallback rows without a tier stay at the fallback's one price. ``report.tiers`` holds the split."""
    price = {t.name: Decimal(str(t.per_row)) for t in tiers}
    split = [{"tier": r["tier"], "rows": int(r["rows"]), "per_row": price.get(r["tier"], report.prices.fallback_per_row)}
             for r in tier_rows]
    tiered = sum(s["rows"] for s in split)
    rest = max(0, report.fallback_rows - tiered)
    if rest:
        split.append({"tier": None, "rows": rest, "per_row": report.prices.fallback_per_row})
    for s in split:
        s["cost"] = s["rows"] * s["per_row"]
    if not tiered:
        return report
    fallback = sum((s["cost"] for s in split), Decimal(0))
    return dataclasses.replace(report, fallback_cost=fallback, total=report.total - report.fallback_cost + fallback,
                               tiers=tuple(split))


__all__ = ["MARGIN", "TIERED_ENGINE", "TIER_TRIES", "Tier", "TierAllowance", "TierPlan", "priced_by_tier", "projected_split"]

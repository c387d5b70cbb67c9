"""The fallback pool's engine for an endpoint with price tiers: the ``openai`` engine, each request at a tier.

``TieredOpenAIEngine`` is the ``openai`` engine (``engines.openai``) with one
more option, ``tiers`` (the spec's ``fallback.tiers``), and a
:class:`~batch_inference.tiers.TierPlan` that the pool shares between its
threads (``plan``; an engine on its own makes one without a deadline). Each
request carries its tier as ``service_tier`` in the chat-completions body.

A request at a tier below the last: an answer (any status that is not a
transport failure) is the record's outcome; a refusal (429 "Resource
Unavailable", 5xx, a dropped connection, a timeout) is counted against that
tier's breaker and accepted share and spends no attempt. The row tries that
tier again after a short back-off (``backoff_base_s``) while the plan still
picks it, at most ``tiers.TIER_TRIES`` times in all, and then moves to the
next tier up. At the last tier the ``openai`` engine's own retries,
back-off, breaker (the pool's) and allowance apply unchanged.

The tier that answered each record is written under the worker's shard lease
(``bi.fallback_tier_put_v1``) as the outcomes come back, in batches of
``WRITE_EVERY``, before the worker stores them; a write the lease no longer
covers is dropped with a warning (the row is then billed at the fallback's
one price: the dearer side).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

from batch_inference.breaker import EndpointUnavailable
from batch_inference.engines import Outcome, Request, one_line
from batch_inference.engines.openai import OpenAIEngine, Retryable, backoff_delay
from batch_inference.exceptions import InvalidValue
from batch_inference.ledger import StaleLease
from batch_inference.spec import ENGINE_RESULT_OPTIONS, FallbackTier
from batch_inference.tiers import TIER_TRIES, TierPlan

log = logging.getLogger("batch_inference.tiers")

WRITE_EVERY = 50
_TIER: contextvars.ContextVar[int | None] = contextvars.ContextVar("batch_inference_tier", default=None)


class TieredOpenAIEngine(OpenAIEngine):
    name = "openai-tiers"
    result_options = frozenset(ENGINE_RESULT_OPTIONS["openai-tiers"])
    option_names = OpenAIEngine.option_names | {"tiers"}

    def __init__(self, spec, options=None):
        super().__init__(spec, options)
        raw = self.option("tiers", None) or [t.model_dump() for t in spec.fallback.tiers]
        try:
            self.tier_specs = [t if isinstance(t, FallbackTier) else FallbackTier.model_validate(t) for t in raw]
        except ValueError as exc:
            raise InvalidValue(f"engine 'openai' (tiered): option tiers: {one_line(exc)}") from None
        if not self.tier_specs:
            raise InvalidValue("engine 'openai' (tiered): no tiers (set fallback.tiers)")
        # The pool swaps in one plan for all its threads (fallback.FallbackPool); alone, no deadline.
        self.plan = TierPlan(self.tier_specs, base_url=self.base_url, options=self.options,
                             concurrency=self.concurrency, remaining=0, default_rate=float(self.rate_limit or 1e6),
                             last_bucket=self.bucket, last_breaker=self.breaker)
        self._answered: dict[str, str] = {}
        self._pause_rng = random.Random()
        self._ledger: Any = None
        self._lease: Any = None

    def body(self, req: Request) -> dict[str, Any]:
        body = super().body(req)
        i = _TIER.get()
        if i is not None:
            body["service_tier"] = self.plan.tiers[i].name
        return body

    async def record_outcome(self, client: Any, req: Request, stop: threading.Event | None) -> Outcome | None:
        plan, floor = self.plan, 0
        refusals: Counter[int] = Counter()
        while True:
            i = plan.choose(floor)
            _TIER.set(i)
            t0 = time.monotonic()
            if i == plan.last:
                outcome = await super().record_outcome(client, req, stop)
                if outcome is not None:
                    plan.observe(i, time.monotonic() - t0)
                    self._answered[req.record_id] = plan.tiers[i].name
                return outcome
            tier = plan.tiers[i]
            await tier.bucket.acquire()
            if stop is not None and stop.is_set():
                return None
            if tier.breaker.tripped is not None:
                floor = i + 1
                continue
            if self.allowance is not None and not self.allowance.take(req.record_id, *self._price(tier)):
                return None
            t0 = time.monotonic()
            try:
                outcome = await self.attempt(client, req)
            except Retryable as exc:
                try:
                    tier.breaker.failure(exc.reason)
                except EndpointUnavailable:
                    log.warning("tier %s tripped its breaker (%s): its rows go to the tiers above it", tier.name,
                                exc.reason)
                plan.refused(i)
                refusals[i] += 1
                # No attempt spent. The row tries this tier again (after a short pause) while the arithmetic
                # still allows it, up to TIER_TRIES times; then it moves up a tier.
                if refusals[i] < TIER_TRIES and tier.breaker.tripped is None and plan.choose(i) == i:
                    delay = backoff_delay(refusals[i] - 1, self.backoff_base_s, self.backoff_max_s, self._pause_rng)
                    if stop is not None and stop.is_set():
                        return None
                    await asyncio.sleep(delay)
                    continue
                floor = i + 1
                continue
            except Exception as exc:  # noqa: BLE001 - as the openai engine: this record fails, not the pool
                return Outcome(req.record_id, None, error=one_line(exc))
            tier.breaker.success()
            plan.observe(i, time.monotonic() - t0)
            self._answered[req.record_id] = tier.name
            if getattr(self.allowance, "settle", None) is not None:   # the budget bills the row at its tier
                self.allowance.settle(req.record_id, tier.per_row)
            return outcome

    def _price(self, tier: Any) -> tuple[Any, ...]:
        """The price a money allowance (tiers.TierAllowance) reserves a row at this tier at; none for a
        count of rows (ratelimit.RequestAllowance)."""
        return (tier.per_row,) if getattr(self.allowance, "settle", None) is not None else ()

    # -- the tier each stored row was answered at ------------------------------
    def begin_shard(self, ledger: Any, lease: Any, drain: threading.Event) -> None:
        self._ledger, self._lease = ledger, lease

    def generate(self, requests: Sequence[Request], stop: threading.Event) -> Iterator[Outcome]:
        pending: dict[str, str] = {}
        try:
            for outcome in super().generate(requests, stop):
                tier = self._answered.pop(outcome.record_id, None)
                if tier is not None:
                    pending[outcome.record_id] = tier
                    if len(pending) >= WRITE_EVERY:
                        self._write(pending)
                yield outcome
        finally:
            self._write(pending)

    def _write(self, pending: dict[str, str]) -> None:
        if not pending or self._ledger is None or self._lease is None:
            pending.clear()
            return
        ledger, lease = self._ledger, self._lease
        ids, tiers = list(pending), list(pending.values())
        pending.clear()
        try:
            ledger.call(lambda: ledger.transition("fallback tiers", "fallback_tier_put", lease, ids=ids, tiers=tiers))
        except StaleLease as exc:
            log.warning("the tiers of %d row(s) were not recorded (%s): they are billed at the fallback's one price",
                        len(ids), exc)


__all__ = ["TieredOpenAIEngine", "WRITE_EVERY"]

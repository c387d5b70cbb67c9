"""The nights harness: many compressed nights, each a whole job from submit to publish, under drawn faults.

``run_nights(NightsConfig())`` starts one embedded PostgreSQL (``harness.database.EmbeddedServer``,
restartable) and a loopback OpenAI-compatible endpoint of its own (``Endpoint``), then runs
each night on the real parts:

* the batch: ``workers`` processes of ``python -m gpu_runner`` on the process fleet
  (``fleet.Fleet``), the noop engine paced by ``engines.noop.PacedEngine`` (the night's batch throughput,
  which a fault may slow from some second on);
* the cutoff: the real watch (``deadline.watch``, the loop ``CutoffTrigger`` runs) on the
  night's deadline, with the early warning re-armed as ``CutoffSensor`` does;
* the fallback: ``fallback.run_fallback`` (the pool of in-process workers, one token bucket,
  one breaker) against the endpoint, retried like an Airflow task when the breaker trips;
* validate and publish (``validate.validate``, ``publish.publish``), which records the load.

A night is the production night with the clock compressed: deadline, fallback rate, overhead,
lease and renewal are scaled (seconds, not hours), and the cutoff is floored to the second
(``step_s=1``) instead of the minute, so the arithmetic is the production arithmetic on
smaller numbers. Each night's faults are drawn from ``random.Random(seed)`` (``draw_faults``):
a batch slowed by a factor from some second on, worker kills and stalls, fallback 5xx bursts,
429s with Retry-After, a cancel that settles slowly (the batch lease holders stopped at the
cutoff, so their leases must expire), a PostgreSQL restart, a drifted history of fallback runs
(``bi.fallback_runs`` rows for the night's dataset, so the watch re-derives its constants from
them), and, rarely, a fallback endpoint that stays down for the whole tail of the night: no
design absorbs that, so the night must page early, when the arithmetic knows the deadline is
lost, and say why.

Some nights send their (cleared) records to a hosted batch API instead: the workers run the
``openai-batch`` transport against a loopback emulator of OpenAI's Batch API
(``harness.hosted_openai``, ``HostedProvider``) at the same throughput, and the night draws one
of the provider's faults (``HOSTED_FAULTS``): a batch whose completion window expires with part
of it done, a batch stuck in ``validating`` until the cutoff cancels it, or a cancel that settles
slowly at the provider while requests still complete and bill. ``NightsConfig.hosted_nights``
adds a night for each of them that the drawn nights lack, so the default run has all three.
A hosted night also fails if the provider billed a request twice.

Each night has a dataset of its own (``nights-<seed>``), so a night replayed alone
(``--night SEED``) draws the same faults, the same history and so the same constants and the
same cutoff at submit. Process timing is not reproducible; the verdict should be.

Verdicts: a night fails if it publishes after its deadline without an early page, stores a
duplicate, loses a record, dead-letters a healthy record or bills over the all-synchronous
ceiling (``cost.job_bill``). Beside the outcome each night carries what the cutoff's own
projection predicted at submit for its drawn conditions (``predict``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import random
import shutil
import signal
import statistics
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg

from batch_inference import db
from batch_inference.cost import DEFAULT_FALLBACK_PER_ROW
from batch_inference.data import NOOP_MODEL, TRIAGE_SCHEMA
from batch_inference.engines.noop import PACED_ENGINE
from batch_inference.exceptions import InvalidValue
from batch_inference.harness import SOURCE, Admin, EmbeddedServer, make_source, worker_credentials

log = logging.getLogger("batch_inference.nights")
UTC = timezone.utc
DRIFTS = ("slower", "longer", "faster")
LOAD_TRIES = 5          # validate and publish, tried again when the database goes away under them
# The hosted batch provider's faults: a batch that expires with partial results, one stuck validating,
# a cancel that settles slowly.
HOSTED_FAULTS = ("expire", "validating", "slow_cancel")
HOSTED_SHARE = 0.15                  # of nights that send their records to a hosted batch API
HOSTED_KEY_ENV = "BI_NIGHTS_HOSTED_KEY"
# The supervisor ends the workers still running this long before the drain is over (autopilot.drain_s
# after the cutoff), so that its own pass (every 0.25 s) and the record of their end land inside it.
DRAIN_SLACK_S = 0.5
SEED_GPU_HOUR, SEED_ROWS_PER_S = 3.50, 18.7   # docs/deadlines.md: a self-hosted GPU row at $3.50 an hour


@dataclass
class NightsConfig:
    """A run of compressed nights. The defaults make a night of about 40 s on two cores."""

    nights: int = 3
    seed: int = 0                     # nights are seeds seed, seed+1, ...; --night replays one
    night: int | None = None          # replay this seed alone
    records: int = 1200
    shard_size: int = 100
    workers: int = 2
    batch_delay_s: float = 0.02       # per record and worker: the batch's nominal throughput
    deadline_s: float = 40.0          # submit to deadline (the night's 22:00 to 06:00)
    rate: float = 50.0                # spec.fallback.rate: the sustained rows/s the cutoff assumes
    pool_rate: float = 80.0           # the pool's own limit (its token bucket), above what it sustains
    overhead_s: float = 8.0           # spec.fallback.overhead_s: cancel drain + reconcile + load
    concurrency: int = 8
    parallel_shards: int = 4
    lease_seconds: int = 3
    renew_seconds: float = 0.5
    poll_s: float = 0.5               # the watch's poll interval
    page_reserve_s: float = 2.0       # what the publish needs after the re-drive (the early page's margin)
    late_s: float = 15.0              # how long past its deadline a paged night may finish
    hosted_nights: int = len(HOSTED_FAULTS)   # add a night for each of the first N hosted faults the nights lack
    keep: bool = False
    autopilot: str = "off"            # off | on | both: each night with the autopilot off, on, or both (paired)
    min_workers: int = 1              # the autopilot's bounds (spec.cost)
    max_workers: int = 8
    pilot_margin_s: float = 5.0       # spec.autopilot, compressed as the night is
    pilot_start_s: float = 2.0        # a worker process's start-up on two loaded cores
    pilot_cooldown_s: float = 8.0
    pilot_window_s: float = 4.0
    budget: float | None = None       # spec.cost.budget (dollars): the autopilot and the fallback pool keep to it
    on_budget: str = "page"           # spec.cost.on_budget: page (keep within it) | spend
    tiers: str = "off"                # off | on | both: the fallback at one price, with price tiers, or both (paired)
    flex_refuse: float = 0.2          # share of flex requests refused (429 Resource Unavailable) or dropped, at random
    flex_latency_s: float = 0.05      # how long flex holds each answer it gives (default answers at once)
    # Each night over three simulated regions (regions.RegionNight: prices, interruption rates, a region lost,
    # a store unreachable) beside the single-region autopilot on the same night (paired, no hosted faults).
    regions: bool = False
    region_capacity: int = 2          # workers at most per region's cluster (the single region: the three's)

    def __post_init__(self) -> None:
        for name, low in (("nights", 1), ("records", 10), ("shard_size", 1), ("workers", 1),
                          ("concurrency", 1), ("parallel_shards", 1), ("lease_seconds", 1), ("hosted_nights", 0)):
            if getattr(self, name) < low:
                raise InvalidValue(f"nights: {name.replace('_', ' ')} must be at least {low}, "
                                   f"got {getattr(self, name)}")
        for name in ("deadline_s", "rate", "pool_rate", "batch_delay_s", "renew_seconds", "poll_s"):
            if not getattr(self, name) > 0:
                raise InvalidValue(f"nights: {name.replace('_', ' ')} must be positive, got {getattr(self, name)}")
        if self.renew_seconds >= self.lease_seconds:
            raise InvalidValue("nights: renew seconds must be below the lease")
        if self.autopilot not in ("off", "on", "both"):
            raise InvalidValue(f"nights: autopilot must be off, on or both, got {self.autopilot!r}")
        if self.budget is not None and not self.budget > 0:
            raise InvalidValue(f"nights: budget must be a positive number of dollars, got {self.budget!r}")
        if self.on_budget not in ("page", "spend"):
            raise InvalidValue(f"nights: on_budget must be page or spend, got {self.on_budget!r}")
        if self.tiers not in ("off", "on", "both"):
            raise InvalidValue(f"nights: tiers must be off, on or both, got {self.tiers!r}")
        if self.regions and (self.tiers != "off" or self.autopilot != "off" or self.budget is not None):
            raise InvalidValue("nights: regions pair each night with the single-region autopilot: no tiers, "
                               "autopilot or budget beside them")
        if self.tiers == "both" and self.autopilot == "both":
            raise InvalidValue("nights: pair the nights on the autopilot or on the tiers, not both at once")
        if not 0 <= self.flex_refuse < 1 or self.flex_latency_s < 0:
            raise InvalidValue("nights: flex refuse must be in [0, 1) and flex latency at least 0")
        if not 0 <= self.min_workers <= self.max_workers:
            raise InvalidValue(f"nights: workers bounds {self.min_workers}..{self.max_workers} are not a range")

    def modes(self) -> list[bool]:
        """The runs of each night: the autopilot off, on, or both (off first)."""
        return {"off": [False], "on": [True], "both": [False, True]}[self.autopilot]

    def tier_modes(self) -> list[bool]:
        """The fallback of each night: at one price, with price tiers, or both (one price first)."""
        return {"off": [False], "on": [True], "both": [False, True]}[self.tiers]

    @property
    def gpu_hour(self) -> float:
        """A batch worker's GPU-hour, scaled so that one of the night's rows at its nominal throughput
        (1 / batch_delay_s a worker) costs what the seed's does: 18.7 rows/s at $3.50 an hour."""
        return round(SEED_GPU_HOUR / SEED_ROWS_PER_S / self.batch_delay_s, 4)

    def seeds(self) -> list[int]:
        """The nights' seeds: ``seed`` on, then the first seeds after them that draw each hosted fault
        none of them drew (``hosted_nights``); or the replayed one."""
        if self.night is not None:
            return [self.night]
        seeds = list(range(self.seed, self.seed + self.nights))
        drawn = {draw_faults(s, self).hosted for s in seeds}
        nxt = self.seed + self.nights
        for kind in HOSTED_FAULTS[:self.hosted_nights]:
            if kind not in drawn:
                while draw_faults(nxt, self).hosted != kind:
                    nxt += 1
                seeds.append(nxt)
                nxt += 1
        return seeds


# -- the faults ---------------------------------------------------------------------


@dataclass(frozen=True)
class Faults:
    """One night's drawn faults. Times are seconds from submit, or from the pool's first request
    (``*_at_pool``) for the endpoint's."""

    slow_at: float | None = None
    slow_factor: float = 1.0
    kills: tuple[float, ...] = ()
    stalls: tuple[float, ...] = ()
    burst_at_pool: float | None = None        # the endpoint answers 5xx from here ...
    burst_s: float = 0.0                      # ... for this long
    throttle_at_pool: float | None = None     # 429 with Retry-After to a share of requests
    throttle_s: float = 0.0
    throttle_share: float = 0.0
    retry_after_s: int = 1
    slow_cancel_s: float | None = None        # batch lease holders stopped this long at the cutoff
    db_restart_at: float | None = None
    drift: str | None = None                  # slower | longer | faster: the night's fallback history
    down_at_pool: float | None = None         # the endpoint down from here to past the deadline
    hosted: str | None = None                 # the records go to a hosted batch API with this fault (HOSTED_FAULTS)
    hosted_batch: int = 0                     # expire, validating: the provider batch (1st, 2nd, ...) it hits
    hosted_cancel_s: float | None = None      # slow_cancel: a cancelled batch settles this long after the cancel

    def names(self) -> list[str]:
        out = []
        if self.slow_at is not None:
            out.append(f"batch x{self.slow_factor:.1f} slower from {self.slow_at:.0f}s")
        if self.kills:
            out.append(f"{len(self.kills)} kill(s)")
        if self.stalls:
            out.append(f"{len(self.stalls)} stall(s)")
        if self.burst_at_pool is not None:
            out.append(f"5xx burst {self.burst_s:.1f}s")
        if self.throttle_at_pool is not None:
            out.append(f"429 {self.throttle_share:.0%} for {self.throttle_s:.1f}s")
        if self.slow_cancel_s is not None:
            out.append(f"cancel settles in {self.slow_cancel_s:.1f}s")
        if self.db_restart_at is not None:
            out.append(f"db restart at {self.db_restart_at:.0f}s")
        if self.drift:
            out.append(f"history {self.drift}")
        if self.down_at_pool is not None:
            out.append("endpoint down for the tail")
        if self.hosted == "expire":
            out.append(f"hosted batch {self.hosted_batch} expires with partial results")
        elif self.hosted == "validating":
            out.append(f"hosted batch {self.hosted_batch} stuck validating")
        elif self.hosted == "slow_cancel":
            out.append(f"hosted cancel settles in {self.hosted_cancel_s:.1f}s")
        return out


def draw_faults(seed: int, cfg: NightsConfig) -> Faults:
    """The night's faults from its seed alone (the same on a replay)."""
    r = random.Random(f"nights-{seed}")
    d = cfg.deadline_s
    slow = r.random() < 0.6
    f = Faults(
        slow_at=round(r.uniform(1.0, 0.25 * d), 2) if slow else None,
        slow_factor=round(r.uniform(1.5, 8.0), 2) if slow else 1.0,
        kills=tuple(sorted(round(r.uniform(1.0, 0.5 * d), 2) for _ in range(r.choice((0, 0, 1, 2, 3))))),
        stalls=tuple(sorted(round(r.uniform(1.0, 0.5 * d), 2) for _ in range(r.choice((0, 0, 1, 2))))),
        burst_at_pool=round(r.uniform(0.2, 3.0), 2) if r.random() < 0.35 else None,
        burst_s=round(r.uniform(0.3, 2.5), 2),
        throttle_at_pool=round(r.uniform(0.0, 3.0), 2) if r.random() < 0.35 else None,
        throttle_s=round(r.uniform(0.5, 3.0), 2),
        throttle_share=round(r.uniform(0.2, 0.6), 2),
        retry_after_s=r.choice((1, 1, 2)),
        # Mostly on slowed nights: a slow cancel only bites when the cutoff fires with leases held.
        slow_cancel_s=(round(cfg.lease_seconds + r.uniform(0.0, 3.0), 2)
                       if r.random() < (0.6 if slow else 0.1) else None),
        db_restart_at=round(r.uniform(2.0, 0.6 * d), 2) if r.random() < 0.25 else None,
        drift=r.choice(DRIFTS) if r.random() < 0.35 else None,
        down_at_pool=round(r.uniform(0.5, 2.0), 2) if r.random() < 0.12 else None,
    )
    if f.burst_at_pool is None:
        f = replace(f, burst_s=0.0)
    if f.throttle_at_pool is None:
        f = replace(f, throttle_s=0.0, throttle_share=0.0)
    # Drawn apart, so a night's other draws are the same whether or not it goes hosted.
    h = random.Random(f"nights-hosted-{seed}")
    if h.random() < HOSTED_SHARE:
        kind = h.choice(HOSTED_FAULTS)
        # The provider's faults replace the worker processes' (kills, stalls, their slow cancel), and an
        # expiry or a stuck batch is the night's only slow-down, so that the cutoff does not cancel it first.
        f = replace(f, hosted=kind, kills=(), stalls=(), slow_cancel_s=None, hosted_batch=h.randint(1, 3))
        if kind != "slow_cancel":
            f = replace(f, slow_at=None, slow_factor=1.0)
        else:
            # A slow cancel bites only when the cutoff fires with batches running: the batch is slowed.
            f = replace(f, hosted_batch=0, hosted_cancel_s=round(cfg.lease_seconds + h.uniform(1.0, 3.0), 2),
                        slow_at=f.slow_at if f.slow_at is not None else round(h.uniform(1.0, 0.25 * d), 2),
                        slow_factor=max(f.slow_factor, round(h.uniform(3.0, 8.0), 2)))
    return f


def history_rows(seed: int, cfg: NightsConfig, drift: str | None) -> list[dict[str, Any]]:
    """The night's drifted history: five past fallback runs of its dataset (none without drift).

    * ``slower``: partial runs (no load measured) whose sustained re-drives were slower than the
      configured rate: they may only tighten it;
    * ``longer``: partial runs whose overhead was longer than the configured one;
    * ``faster``: complete runs (drain, re-drive and load measured) of a faster pool and a
      shorter overhead: five of them relax both constants, which tonight's pool must then hold.
    """
    if drift is None:
        return []
    r = random.Random(f"nights-history-{seed}")
    rows = []
    for k in range(5):
        if drift == "slower":
            rate, over, load = cfg.rate * r.uniform(0.5, 0.8), cfg.overhead_s * r.uniform(0.5, 0.9), None
        elif drift == "longer":
            rate, over, load = cfg.rate * r.uniform(1.0, 1.3), cfg.overhead_s * r.uniform(1.1, 1.6), None
        else:
            rate, over, load = cfg.rate * r.uniform(1.05, 1.3), cfg.overhead_s * r.uniform(0.4, 0.6), 1.0
        busy = 60.0 + r.uniform(0.0, 30.0)   # a sustained re-drive (cutoff.MIN_REDRIVE_S)
        rows.append({"rate": round(rate, 3), "overhead_s": round(over, 3), "busy_s": round(busy, 3),
                     "records": int(rate * busy), "drain_s": round(over / 2, 3), "load_s": load,
                     "days_ago": 5 - k})
    return rows


# -- the fallback endpoint ---------------------------------------------------------------


class Endpoint:
    """The night's fallback endpoint: a ``loopback.ChatServer`` (OpenAI's chat completions on
    127.0.0.1) answering a schema-valid triage object, with the night's endpoint faults on a
    clock that starts at its first request: 5xx bursts, 429 with ``Retry-After`` to a share of
    requests, and an outage from some second of the re-drive until ``down_until`` (monotonic)."""

    def __init__(self, faults: Faults, seed: int, down_until: float = float("inf"), flex_refuse: float = 0.0,
                 flex_latency_s: float = 0.0) -> None:
        from batch_inference.harness import ChatServer, completion

        self.faults, self.down_until = faults, down_until
        self.flex_refuse, self.flex_latency_s = flex_refuse, flex_latency_s
        self.rng = random.Random(f"nights-endpoint-{seed}")
        self.first: float | None = None
        self.answers: Counter[int] = Counter()
        self._ok = completion(json.dumps({"category": "other", "summary": "re-driven by the fallback pool"}),
                              tokens=12)
        self.server = ChatServer(self.respond)

    @property
    def base_url(self) -> str:
        return self.server.base_url

    def respond(self, body: dict[str, Any]) -> tuple[Any, ...]:
        """One answer (the server calls it under its lock). A request at the flex tier is refused
        (429 Resource Unavailable) or dropped at random with ``flex_refuse``, else held ``flex_latency_s``."""
        from batch_inference.harness import DROP

        if body.get("service_tier") == "flex":
            r = self.rng.random()
            if r < self.flex_refuse:
                self.answers["flex-refused"] += 1
                if r < self.flex_refuse / 2:
                    return 200, {}, DROP, 0.0
                return 429, {}, {"error": {"message": "Resource Unavailable", "type": "resource_unavailable"}}
            status, headers, payload = self._answer("flex-")
            return status, headers, payload, self.flex_latency_s
        return self._answer()

    def _answer(self, tier: str = "") -> tuple[int, dict[str, str], dict[str, Any]]:
        """The night's answer with its faults, counted by status (a flex one as ``flex-STATUS``)."""
        now = time.monotonic()
        f = self.faults
        if self.first is None:
            self.first = now
        t = now - self.first
        if f.down_at_pool is not None and t >= f.down_at_pool and now < self.down_until:
            status, headers = 503, {}
        elif f.burst_at_pool is not None and f.burst_at_pool <= t < f.burst_at_pool + f.burst_s:
            status, headers = 500, {}
        elif (f.throttle_at_pool is not None and f.throttle_at_pool <= t < f.throttle_at_pool + f.throttle_s
              and self.rng.random() < f.throttle_share):
            status, headers = 429, {"Retry-After": str(f.retry_after_s)}
        else:
            status, headers = 200, {}
        self.answers[f"{tier}{status}" if tier else status] += 1
        if status != 200:
            return status, headers, {"error": {"message": f"nights endpoint: HTTP {status}", "type": "server_error"}}
        return 200, {}, self._ok

    def close(self) -> None:
        self.server.close()


class HostedProvider:
    """A hosted night's batch API: ``harness.hosted_openai.OpenAIBatchEmulator`` (OpenAI's Files and
    Batches on 127.0.0.1) answering a schema-valid triage object to each request, each batch at the
    night's batch throughput (``1 / batch_delay_s`` requests/s, as one paced worker), with the night's
    provider fault: the ``hosted_batch``-th batch created expires with about 40% of a shard done
    (``expire``) or never leaves ``validating`` (``validating``); or every cancel settles
    ``hosted_cancel_s`` after it while requests still complete (``slow_cancel``)."""

    def __init__(self, faults: Faults, cfg: NightsConfig) -> None:
        from batch_inference.harness import OpenAIBatchEmulator, completion

        answer = completion(json.dumps({"category": "other", "summary": "answered by the hosted batch API"}),
                            tokens=12)
        self.faults, self.cfg = faults, cfg
        self.rate = 1.0 / cfg.batch_delay_s
        self.emulator = OpenAIBatchEmulator(respond=lambda body: (200, answer), rate=self.rate, validate_s=0.2,
                                            cancel_delay_s=faults.hosted_cancel_s or 0.3)
        self.emulator.on_create = self._on_create

    @property
    def base_url(self) -> str:
        return self.emulator.base_url

    def _on_create(self, batch: dict[str, Any]) -> None:
        f, em = self.faults, self.emulator
        if em.created != f.hosted_batch:
            return
        if f.hosted == "validating":
            batch["_validate_s"] = float("inf")
        elif f.hosted == "expire":
            batch["_expire_s"] = em.validate_s + 0.4 * self.cfg.shard_size / em.rate

    def slow(self, factor: float) -> None:
        """The batch's slow-down: every batch completes ``factor`` times slower from now."""
        with self.emulator.lock:
            self.emulator.rate = self.rate / factor

    def figures(self) -> dict[str, Any]:
        em = self.emulator
        with em.lock:
            states = Counter(b["status"] for b in em.batches.values())
            billed = dict(em.billed)
            never_ran = sum(1 for w in em.work.values() if not w["ran"])
            settle = [w["ended_at"] - w["cancel_at"] for w in em.work.values()
                      if w["cancel_at"] is not None and "ended_at" in w]
        return {"batches": em.created, "states": dict(sorted(states.items())), "never_ran": never_ran,
                "cancel_settled_s": round(max(settle), 2) if settle else None, "billed": sum(billed.values()),
                "billed_twice": sum(n - 1 for n in billed.values() if n > 1)}

    def close(self) -> None:
        self.emulator.close()


# -- the prediction -------------------------------------------------------------------------


def predict(cfg: NightsConfig, faults: Faults, rate: float, overhead_s: float, start_s: float = 1.5) -> dict[str, Any]:
    """What the cutoff's own arithmetic predicts at submit for the night's drawn conditions.

    The batch settles ``workers / (batch_delay_s * factor)`` rows/s after ``start_s`` (the
    workers' start); a kill or a stall costs its worker one lease and a restart. The moving
    cutoff (``cutoff.decide`` with the constants in force) is evaluated every poll. Once it
    fires, the pool re-drives what is left at its own limit (``pool_rate``), losing the drawn
    5xx burst (and a retry after the breaker trips) and the throttled share of the 429 window.
    Returns the predicted firing and finish (the last row stored), seconds from submit.
    """
    from batch_inference.cutoff import decide

    t0 = datetime(2026, 1, 1, 22, 0, tzinfo=UTC)
    deadline = t0 + timedelta(seconds=cfg.deadline_s)
    lost = [(t, t + cfg.lease_seconds + start_s) for t in (*faults.kills, *faults.stalls)]
    left, t, dt = float(cfg.records - 1), 0.0, 0.05   # the oversized record is dead at planning
    next_poll = 0.0
    while left > 0 and t < 4 * cfg.deadline_s:
        if t >= next_poll:
            d = decide(t0 + timedelta(seconds=t), deadline, math.ceil(left), rate, overhead_s, step_s=1)
            if d.fire:
                rows = math.ceil(left)
                redrive = rows / cfg.pool_rate + cfg.renew_seconds
                if faults.burst_at_pool is not None and faults.burst_at_pool < redrive:
                    redrive += faults.burst_s + 0.5
                if faults.throttle_at_pool is not None and faults.throttle_at_pool < redrive:
                    redrive += faults.throttle_s * faults.throttle_share
                return {"fires": True, "fire_s": round(t, 2), "finish_s": round(t + redrive, 2),
                        "fallback_rows": rows}
            next_poll = t + cfg.poll_s
        if t >= start_s:
            factor = faults.slow_factor if faults.slow_at is not None and t >= faults.slow_at else 1.0
            down = sum(1 for a, b in lost if a <= t < b)
            left -= max(0, cfg.workers - down) / (cfg.batch_delay_s * factor) * dt
        t += dt
    return {"fires": False, "fire_s": None, "finish_s": round(t, 2), "fallback_rows": 0}


# -- one night ----------------------------------------------------------------------


@dataclass
class Night:
    """One night's record: what it drew, what the cutoff did, what it cost, and the verdict."""

    seed: int
    job_version: str = ""
    faults: list[str] = field(default_factory=list)
    constants: dict[str, Any] = field(default_factory=dict)
    cutoff_at_submit_s: float | None = None   # the latest safe start at submit, from submit
    cutoff_before_deadline_s: float | None = None   # the same, seconds before the deadline (replays match)
    fired_s: float | None = None              # when the cutoff fired, from submit (None: it did not)
    fired_reason: str | None = None
    warned_s: float | None = None
    deadline_s: float | None = None           # the deadline, from submit
    last_row_s: float | None = None
    published_s: float | None = None
    slack_s: float | None = None              # deadline minus publish (negative: late)
    rows: dict[str, int] = field(default_factory=dict)
    bill: dict[str, Any] = field(default_factory=dict)
    cost_ratio: float | None = None
    dead_letters: list[dict[str, Any]] = field(default_factory=list)
    healthy_dead: int = 0
    coverage: dict[str, int] = field(default_factory=dict)
    fallback: dict[str, Any] = field(default_factory=dict)
    endpoint: dict[str, int] = field(default_factory=dict)
    hosted: dict[str, Any] = field(default_factory=dict)   # a hosted night's provider: batches, states, billing
    predicted: dict[str, Any] = field(default_factory=dict)
    prediction_error_s: float | None = None
    page: str | None = None
    page_s: float | None = None
    failures: list[str] = field(default_factory=list)
    verdict: str = ""
    wall_s: float = 0.0
    autopilot: bool = False                   # this run had the autopilot on
    tiered: bool = False                      # this run's fallback had price tiers (flex, then default)
    slowed: bool = False                      # the night's batch was slowed (the comparison's nights)
    gpu_hours: float = 0.0                    # the batch workers' (bi.fleet_observed)
    pilot: dict[str, Any] = field(default_factory=dict)   # decisions, first add, largest fleet, pages
    regions: dict[str, Any] = field(default_factory=dict)  # a region night's (role regions) or its pair's (one)

    @property
    def lost(self) -> int:
        """Records neither stored nor dead-lettered; those a pool stopped at the budget left pending are not
        lost (they wait for a larger budget's re-run)."""
        return 0 if self.fallback.get("budget_stop") else int(self.coverage.get("missing", 0))

    def line(self) -> str:
        fired = f"fired {self.fired_s:.1f}s" if self.fired_s is not None else "no fire"
        slack = f"slack {self.slack_s:+.1f}s" if self.slack_s is not None else "unpublished"
        ratio = f"cost {self.cost_ratio:.3f}" if self.cost_ratio is not None else "cost ?"
        rows = " ".join(f"{k} {v}" for k, v in sorted(self.rows.items()))
        pe = f"pred {self.prediction_error_s:+.1f}s" if self.prediction_error_s is not None else "pred -"
        cut = f"{self.cutoff_before_deadline_s:.0f}" if self.cutoff_before_deadline_s is not None else "?"
        tiers = self.bill.get("fallback_tiers")
        tier = (f" [tiers: {', '.join(f'{k} {v}' for k, v in tiers.items())}]" if tiers else
                " [tiers]" if self.tiered else "")
        mode = tier + (f" [autopilot: {self.pilot.get('adds', 0)} add(s) first at {self.pilot['first_add_s']:.1f}s, "
                f"up to {self.pilot.get('largest', '?')} workers]" if self.autopilot and self.pilot.get("first_add_s")
                is not None else " [autopilot: no add]" if self.autopilot else "")
        head = (f"night {self.seed:>4}: {self.verdict:<6} cutoff at submit D-{cut}s, {fired}, "
                f"{slack}, {ratio}, {rows}, {pe}{mode}")
        tail = f"  [{'; '.join(self.faults) or 'no faults'}]"
        out = head + tail
        if self.hosted:
            h = self.hosted
            settled = f", cancels settled in {h['cancel_settled_s']:.1f}s" if h["cancel_settled_s"] is not None else ""
            out += (f"\n      hosted: {h['batches']} provider batch(es) {h['states']}, {h['never_ran']} never ran"
                    f"{settled}; {h['billed']} request(s) billed, {h['billed_twice']} twice")
        if self.page:
            out += f"\n      page at {self.page_s:.1f}s: {self.page}"
        for f in self.failures:
            out += f"\n      FAIL: {f}"
        return out


class _Supervisor(threading.Thread):
    """The night's batch side: restarts workers that exit (as Kubernetes would), and injects the
    drawn kills, stalls, slow-down, database restart and slow cancel at their times."""

    def __init__(self, night: "_NightRun"):
        super().__init__(daemon=True, name="nights-supervisor")
        self.n = night
        self.stop_event = threading.Event()
        self.cutoff = threading.Event()
        self.events: list[str] = []
        self.resume: list[tuple[float, Any]] = []
        self._conn: psycopg.Connection | None = None
        self._next_pilot = 0.0
        self.cutoff_at: float | None = None     # monotonic: when the cutoff was seen

    def _holders(self) -> dict[str, int]:
        rows = self.n.admin.rows("chaos_lease_holders", {"job": self.n.job})
        return {r["lease_owner"]: r["shard_no"] for r in rows if r["lease_owner"]}

    def _pick_holder(self) -> Any:
        holders = self._holders()
        alive = [w for w in self.n.fleet.alive() if not w.stopped and w.name in holders]
        return self.n.rng.choice(alive) if alive else None

    def run(self) -> None:
        f, n = self.n.faults, self.n
        todo = sorted([(t, "kill") for t in f.kills] + [(t, "stall") for t in f.stalls]
                      + (n.regions.fault_times() if n.regions is not None else [])
                      + [(x.at_s, "same_loss") for x in n.losses]
                      + ([(f.slow_at, "slow")] if f.slow_at is not None else [])
                      + ([(f.db_restart_at, "db_restart")] if f.db_restart_at is not None else []))
        cancel_done = False
        while not self.stop_event.is_set():
            now = time.monotonic()
            t = now - n.t0
            try:
                n.fleet.poll(restart=not self.cutoff.is_set())
                while todo and todo[0][0] <= t:
                    _, kind = todo.pop(0)
                    self._inject(kind, now)
                if self.cutoff.is_set() and not cancel_done:
                    cancel_done = True
                    self.cutoff_at = now
                    if f.slow_cancel_s is not None:
                        for name in self._holders():
                            w = next((w for w in n.fleet.alive() if w.name == name and not w.stopped), None)
                            if w is not None and n.fleet.signal(w, signal.SIGSTOP):
                                self.resume.append((now + f.slow_cancel_s, w))
                                self.events.append(f"{t:.1f}s slow cancel: stopped {w.name}")
                for at, w in list(self.resume):
                    if now >= at:
                        n.fleet.signal(w, signal.SIGCONT)
                        self.resume.remove((at, w))
                self._launch(now)
            except Exception as exc:  # noqa: BLE001 - a fault must not end the night's supervisor
                log.warning("nights %s: supervisor: %s", n.seed, exc)
            self.stop_event.wait(0.05)
        for _, w in self.resume:
            n.fleet.signal(w, signal.SIGCONT)
        if self._conn is not None:
            self._conn.close()

    def _launch(self, now: float) -> None:
        """The night's launcher: with the autopilot, reconcile the fleet to the ledger's desired size
        (``autopilot.reconcile``: no worker added after the cutoff or once one found nothing to claim);
        either way record what runs (the GPU-hours of the bill). Every quarter second."""
        from batch_inference import autopilot

        if now < self._next_pilot:
            return
        self._next_pilot = now + 0.25
        n = self.n
        try:
            if self._conn is None or self._conn.closed:
                self._conn = db.connect(n.url, retries=0)
            if self.cutoff.is_set():
                # Draining: what still runs is billed; past the drain (autopilot.drain_s: its lease is
                # gone, it holds nothing) a GPU worker is ended, as the budget's drain reserve counts on.
                # A hosted night's workers are not GPU workers: they wait for the provider's cancel.
                if n.provider is None and self.cutoff_at is not None \
                        and now - self.cutoff_at >= n.drain_s - DRAIN_SLACK_S and n.fleet.alive():
                    self.events.append(f"{now - n.t0:.1f}s drain over: {len(n.fleet.alive())} worker(s) ended")
                    n.fleet.kill()
                    end = time.monotonic() + 1.0
                    while n.fleet.alive() and time.monotonic() < end:
                        time.sleep(0.01)
                if n.regions is not None:
                    n.regions.observe(self._conn, n.job)
                else:
                    autopilot.observe(self._conn, n.job, "nights", len(n.fleet.alive()))
                return
            if n.regions is not None:       # the regions' launcher: the autopilot over every cluster
                n.regions.launch(self._conn, n.job, n.deadline)
                return

            def scale(k: int) -> None:
                before = len(n.fleet.slots())
                k = min(k, before) if n.fleet.drained else k
                k = k if n.capacity_left is None else min(k, n.capacity_left)    # the GPUs a loss left
                if k != before:
                    n.fleet.scale_to(k)
                    self.events.append(f"{now - n.t0:.1f}s {'autopilot' if n.steered else 'budget stop'} "
                                       f"{before} -> {k} workers")

            # A fixed fleet (or a hosted night's workers) follows only the budget's stop (desired size 0).
            autopilot.reconcile(self._conn, n.job, "nights", lambda: len(n.fleet.slots()), scale, n.cfg.workers,
                                (n.cfg.min_workers, n.cfg.max_workers), follow=n.steered)
        except (psycopg.Error, db.DatabaseUnavailable):
            if self._conn is not None:
                self._conn.close()
            self._conn = None

    def _same_loss(self, loss: Any, t: float) -> None:
        """The single region meets a region's loss (``regions.Loss``): the same share of its running workers
        ended (the newest: killed at once for a region lost, stopped for a store gone), not restarted, and the
        same share of its capacity gone for the rest of the night."""
        n = self.n
        slots = n.fleet.slots()
        alive = [s for s in slots if n.fleet.workers[s] is not None and n.fleet.workers[s].popen.poll() is None]
        k = min(len(alive), max(1, round(loss.workers / loss.of * len(alive)))) if loss.workers and loss.of else 0
        gone = sorted(alive, reverse=True)[:k]
        if loss.kind == "region_lost":
            for s in gone:
                n.fleet.signal(n.fleet.workers[s], signal.SIGCONT)
                n.fleet.signal(n.fleet.workers[s], signal.SIGKILL)
        if gone:       # scale_to retires the newest slots: the ended ones (and any newer one waiting to restart)
            n.fleet.scale_to(len([s for s in slots if s < min(gone)]))
        capacity = n.one_region[2] if n.capacity_left is None else n.capacity_left
        n.capacity_left = max(0, capacity - round(n.one_region[2] * loss.capacity / loss.of_capacity))
        n.faced.append(loss.line(k, n.capacity_left))
        self.events.append(f"{t:.1f}s {n.faced[-1]}")

    def _inject(self, kind: str, now: float) -> None:
        n = self.n
        t = now - n.t0
        if kind in ("region_lost", "store_down"):
            n.regions.inject(kind, t, self.events)
        elif kind == "same_loss":
            self._same_loss(n.losses[len(n.faced)], t)
        elif kind == "slow":
            n.pace.write_text(str(n.faults.slow_factor))
            if n.provider is not None:
                n.provider.slow(n.faults.slow_factor)
            self.events.append(f"{t:.1f}s batch slowed x{n.faults.slow_factor:.1f}")
        elif kind == "db_restart":
            t1 = time.monotonic()
            n.server.restart()
            self.events.append(f"{t:.1f}s database restarted ({time.monotonic() - t1:.1f}s)")
        else:
            w = self._pick_holder()
            if w is None:
                self.events.append(f"{t:.1f}s {kind}: no lease holder")
                return
            if kind == "kill":
                n.fleet.signal(w, signal.SIGKILL)
            else:
                n.fleet.signal(w, signal.SIGSTOP)
                self.resume.append((now + n.cfg.lease_seconds + 1.5, w))
            self.events.append(f"{t:.1f}s {kind} {w.name}")


class _NightRun:
    def __init__(self, cfg: NightsConfig, seed: int, server: EmbeddedServer, work: Path, pilot: bool = False,
                 tiered: bool = False, regions: Any = None, one_region: tuple[float, int, int] | None = None,
                 losses: Sequence[Any] = ()):
        self.cfg, self.seed, self.server = cfg, seed, server
        self.pilot, self.tiered = pilot, tiered
        self.url = server.url
        self.work = work / f"night-{seed}{'-autopilot' if pilot else ''}{'-tiers' if tiered else ''}"
        self.work.mkdir(parents=True, exist_ok=True)
        self.pace = self.work / "pace"
        self.faults = draw_faults(seed, cfg)
        # A region night and its single-region pair: the worker processes' faults, none of a hosted API's.
        self.regions, self.one_region = regions, one_region     # RegionNight; (price, first size, capacity)
        # The single region's pair meets the regions' losses (regions.Loss): its capacity after them, and each
        # as it met it.
        self.losses, self.capacity_left, self.faced = list(losses), None, []
        if cfg.regions:
            self.faults = replace(self.faults, hosted=None, hosted_batch=0, hosted_cancel_s=None)
        self.rng = random.Random(f"nights-targets-{seed}")
        self.admin = Admin(self.url)
        self.rec = Night(seed=seed, faults=self.faults.names(), autopilot=pilot, tiered=tiered,
                         slowed=self.faults.slow_at is not None)
        # Its own dataset per run: the autopilot is not part of the job version, so the paired run
        # would otherwise resume the first run's finished job.
        self.dataset = f"nights_{seed}{'_autopilot' if pilot else ''}{'_tiers' if tiered else ''}" + \
            ("_regions" if regions is not None else "_one" if one_region is not None else "")
        if regions is not None or one_region is not None:
            self.work = work / f"night-{seed}-{'regions' if regions is not None else 'one'}"
            self.work.mkdir(parents=True, exist_ok=True)
            self.pace = self.work / "pace"
            self.rec.faults += regions.faults.names() if regions is not None else \
                [f"the regions' loss at {x.at_s:.1f}s: {x.workers} of {x.of} workers, {x.capacity} of "
                 f"{x.of_capacity} GPUs" for x in self.losses]
        self.provider: HostedProvider | None = None
        self.job = ""
        self.t0 = 0.0
        self.drain_s = float(cfg.lease_seconds + cfg.renew_seconds)
        self.steered = pilot          # the autopilot steers this run's fleet (not a hosted night's)

    # -- set-up -----------------------------------------------------------------
    def spec(self):
        from batch_inference.spec import parse_spec

        c = self.cfg
        return parse_spec({
            "dataset": self.dataset,
            "source": dict(SOURCE),
            "model": dict(NOOP_MODEL),
            "engine": {"name": "noop"},
            "prompt": {"version": "nights-v1", "system": "Classify the support ticket and summarize it."},
            "params": {"temperature": 0, "max_tokens": 64},
            "output_schema": TRIAGE_SCHEMA,
            "shard_size": c.shard_size, "max_attempts": 3, "max_input_chars": 4000,
            "lease_seconds": c.lease_seconds, "renew_seconds": c.renew_seconds,
            "validation": {"sample_size": 0, "max_dead_letter_rate": 0.05},
            "fallback": {"rate": c.rate, "overhead_s": c.overhead_s, "concurrency": c.concurrency,
                         # Price tiers: flex at the batch price (half the synchronous one), default at the full one.
                         **({"provider": "openai", "tiers": [
                             {"name": "flex", "per_row": float(DEFAULT_FALLBACK_PER_ROW / 2),
                              "latency_s": max(c.flex_latency_s, 0.01)},
                             {"name": "default", "per_row": float(DEFAULT_FALLBACK_PER_ROW)}]} if self.tiered else {})},
            # A hosted night: the records are cleared for hosted APIs and go to the provider's batches.
            **({"cleared_for_hosted": True, "engine": {"name": "openai-batch", "options": {
                "base_url": self.provider.base_url, "api_key_env": HOSTED_KEY_ENV, "poll_seconds": 0.2}}}
               if self.provider is not None else {}),
            "cost": {"gpu_hour_spot": self.one_region[0] if self.one_region else c.gpu_hour,
                     "min_workers": c.min_workers,
                     "max_workers": self.one_region[2] if self.one_region else c.max_workers,
                     **({"budget": c.budget, "on_budget": c.on_budget} if c.budget is not None else {})},
            "autopilot": {"enabled": self.pilot, "margin_s": c.pilot_margin_s, "start_s": c.pilot_start_s,
                          "cooldown_s": c.pilot_cooldown_s, "window_s": c.pilot_window_s},
        })

    def _setup(self) -> None:
        from batch_inference import autopilot
        from batch_inference.plan import submit

        c = self.cfg
        if self.faults.hosted is not None:
            self.provider = HostedProvider(self.faults, c)
        with db.connect(self.url, retries=10) as conn:
            # The chaos source with one oversized record: a dead letter at planning, by design.
            make_source(conn, c.records, random.Random(f"nights-source-{self.seed}"))
            now = conn.execute(db.q("nights_db_now")).fetchone()["now"]
            for h in history_rows(self.seed, c, self.faults.drift):
                conn.execute(db.q("nights_history_insert"), {
                    "job": f"{self.dataset}_past_{h['days_ago']}", "dataset": self.dataset,
                    "finished_at": now - timedelta(days=h["days_ago"]), "records": h["records"],
                    "rate": h["rate"], "overhead_s": h["overhead_s"], "drain_s": h["drain_s"],
                    "busy_s": h["busy_s"], "load_s": h["load_s"]})
            spec = self.spec()
            manifest = submit(conn, spec)
            self.job = self.rec.job_version = manifest.job_version
            self.drain_s, self.steered = autopilot.drain_s(spec), self.pilot and autopilot.steers(spec)
            self.worker_url, _ = worker_credentials(conn, self.url, self.job)
            if self.regions is not None:
                self.regions.place(conn, self.job)

    def _argv(self, owner: str) -> list[str]:
        if self.provider is not None:     # the spec's engine: openai-batch
            return [self.job, "--worker-id", owner, "--flush-every", "20", "--grace-seconds", "1"]
        opts = {"inner": "noop", "delay_s": self.cfg.batch_delay_s, "pace_file": str(self.pace)}
        argv = [self.job, "--engine", PACED_ENGINE, "--worker-id", owner,
                "--flush-every", "20", "--grace-seconds", "1"]
        for k, v in opts.items():
            argv += ["--engine-option", f"{k}={json.dumps(v) if not isinstance(v, str) else v}"]
        return argv

    # -- the night ----------------------------------------------------------------
    def run(self) -> Night:
        from batch_inference.fleet import Fleet

        c, rec = self.cfg, self.rec
        t_wall = time.monotonic()
        self._setup()
        log.info("nights %d: %s, faults: %s", self.seed, self.job, "; ".join(rec.faults) or "none")
        env = {**os.environ, "BATCH_INFERENCE_DB": self.worker_url, HOSTED_KEY_ENV: f"sk-nights-{self.seed}"}

        def fleet(name: str, argv: Any, size: int) -> Fleet:
            return Fleet(argv, env, size, name=lambda slot, gen: f"n{self.seed}-{name}-w{slot}-g{gen}", log=log,
                         echo=False, log_dir=self.work / "logs", tail_lines=20, backoff_s=0.5, backoff_max_s=4.0,
                         new_session=True)

        self.fleet = self.regions.start_fleets(fleet, self._argv, self.url) if self.regions is not None else Fleet(
                           self._argv, env, self.one_region[1] if self.one_region else c.workers,
                           name=lambda slot, gen: f"n{self.seed}-w{slot}-g{gen}", log=log, echo=False,
                           log_dir=self.work / "logs", tail_lines=20, backoff_s=0.5, backoff_max_s=4.0,
                           new_session=True)
        self.t0 = time.monotonic()
        self.submit_at = datetime.now(UTC)
        # On a whole second, so the cutoff (floored to the second) is the same distance before it
        # on every replay of the night.
        exact = self.submit_at + timedelta(seconds=c.deadline_s)
        self.deadline = exact.replace(microsecond=0) + timedelta(seconds=1 if exact.microsecond else 0)
        # The endpoint's outage (if drawn) lasts until past the deadline.
        self.endpoint = Endpoint(self.faults, self.seed, self.t0 + c.deadline_s + 2.0, c.flex_refuse,
                                 c.flex_latency_s)
        self.fleet.start_all()
        sup = _Supervisor(self)
        sup.start()
        try:
            self._watch_and_redrive(sup)
        finally:
            sup.stop_event.set()
            sup.join(timeout=10)
            self.fleet.stop(3.0)
            self.fleet.kill()
            self.endpoint.close()
            if self.provider is not None:
                rec.hosted = self.provider.figures()
                self.provider.close()
            self._fleet_stopped()
            if self.regions is not None:
                self.regions.stop()
        self._measure()
        rec.fallback["supervisor"] = sup.events
        rec.endpoint = {str(k): v for k, v in sorted(self.endpoint.answers.items(), key=lambda kv: str(kv[0]))}
        rec.wall_s = round(time.monotonic() - t_wall, 1)
        self.admin.close()
        return rec

    def _s(self, when: datetime | None) -> float | None:
        return None if when is None else round((when - self.submit_at).total_seconds(), 2)

    def _watch_and_redrive(self, sup: _Supervisor) -> None:
        from batch_inference import deadline as dl
        from batch_inference.exceptions import FallbackIncomplete
        from batch_inference.fallback import enter_fallback, run_fallback

        c, rec = self.cfg, self.rec
        wcfg = dl.WatchConfig(job_version=self.job, deadline=self.deadline, poll_interval_s=c.poll_s, step_s=1)
        wlog = logging.getLogger("batch_inference.nights.watch")
        first = True
        while True:
            payload = asyncio.run(dl.watch(lambda: dl.connect_async(self.url, "nights-watch"), wcfg, logger=wlog,
                                           max_polls=1 if first else None))
            if first and payload.get("decision"):
                lss = dl.parse_iso(payload["decision"]["latest_safe_start"])
                rec.cutoff_at_submit_s = self._s(lss)
                rec.cutoff_before_deadline_s = round((self.deadline - lss).total_seconds(), 2)
                rec.constants = payload["constants"]
                k = payload["constants"]
                rec.predicted = predict(c, self.faults, k["rate"], k["overhead_s"])
            first = False
            status = payload["status"]
            if status == dl.WAIT:
                continue
            if status == dl.EARLY_WARNING:
                rec.warned_s = self._s(datetime.now(UTC))
                wcfg = replace(wcfg, warned=True)
                continue
            if status == dl.BUDGET:
                self._budget_page(payload["reason"])
                wcfg = replace(wcfg, paged=True)
                continue
            break
        rate, overhead = rec.constants.get("rate", c.rate), rec.constants.get("overhead_s", c.overhead_s)
        if status == dl.CUTOFF:
            rec.fired_s = self._s(datetime.now(UTC))
            rec.fired_reason = payload["reason"]
            with db.connect(self.url, retries=10) as conn:
                enter_fallback(conn, self.job)                       # what CutoffSensor does on the event
            sup.cutoff.set()
        elif status != dl.COMPLETE:
            rec.failures.append(f"the watch ended {status}: {payload.get('reason')}")
        # The pool runs every night, as the DAG's fallback task does; retried like an Airflow task.
        tries, redriven = 0, {"stored": 0, "dead": 0, "failed_attempts": 0, "tries": 0, "errors": [],
                              "budget_stop": False}
        give_up = self.t0 + c.deadline_s + c.late_s
        while True:
            tries += 1
            try:
                res = run_fallback(self.url, self.job, self.endpoint.base_url, rate=c.pool_rate,
                                   concurrency=c.concurrency, parallel_shards=c.parallel_shards,
                                   lease_seconds=c.lease_seconds,
                                   extra_engine_options={"backoff_base_s": 0.05, "backoff_max_s": 1.0,
                                                         "retry_after_max_s": 3.0, "timeout_s": 5.0},
                                   on_page=self._budget_page, deadline=self.deadline if self.tiered else None)
                for k in ("stored", "dead", "failed_attempts"):
                    redriven[k] += getattr(res, k)
                redriven["run"] = res.to_dict()
                # Stopped at cost.budget (on_budget: page): a paged night, left unpublished, not a crash.
                redriven["budget_stop"], redriven["budget_page"] = res.budget_stop, res.budget_page
                break
            except (FallbackIncomplete, psycopg.OperationalError, db.DatabaseUnavailable) as exc:
                line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                redriven["errors"].append(f"{self._s(datetime.now(UTC))}s {line[:160]}")
                if rec.page is None:
                    self._maybe_page(line, c.pool_rate)
                if time.monotonic() > give_up:
                    rec.failures.append(f"the fallback did not finish {c.late_s:g}s past the deadline: {line[:120]}")
                    break
                time.sleep(0.5)
        redriven["tries"] = tries
        rec.fallback.update(redriven)
        # Validate and publish (the load), as the DAG's last two tasks, retried like them when the
        # database goes away under them (a drawn restart can land here).
        for attempt in range(1, LOAD_TRIES + 1):
            try:
                self._load(redriven["budget_stop"], give_up)
                break
            except (psycopg.OperationalError, db.DatabaseUnavailable) as exc:
                log.warning("nights %d: validate/publish try %d: %s", self.seed, attempt,
                            str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                if attempt == LOAD_TRIES:
                    rec.failures.append(f"validate/publish failed {LOAD_TRIES} times: {exc}")
                else:
                    time.sleep(0.5)

    def _load(self, budget_stop: bool, give_up: float) -> None:
        from batch_inference.publish import publish
        from batch_inference.status import job_counts
        from batch_inference.validate import validate

        rec = self.rec
        with db.connect(self.url, retries=10) as conn:
            counts = job_counts(conn, self.job)
            # Every record done while a worker still holds the shard of its last results: the worker
            # completes it once that put lands. The DAG's validate waits for the workers task (and
            # retries NotReady); here the load waits for the open shards, up to the night's last moment.
            while (counts["outstanding"] == 0 and counts["shards"]["pending"] + counts["shards"]["leased"]
                   and time.monotonic() < give_up):
                time.sleep(0.2)
                counts = job_counts(conn, self.job)
            if counts["outstanding"] == 0 and counts["shards"]["pending"] + counts["shards"]["leased"] == 0:
                report = validate(conn, self.job, sample_dir=self.work)
                if report["passed"]:
                    out = publish(conn, self.job, actor="nights")
                    row = conn.execute(db.q("published_version"), {"dataset": out["dataset"]}).fetchone()
                    rec.published_s = self._s(row["switched_at"])
                else:
                    rec.failures.append("validation failed: " + "; ".join(report["failures"]))
            elif not budget_stop:
                rec.failures.append(f"not finished: {counts['outstanding']} outstanding")

    # -- the autopilot's part --------------------------------------------------------
    def _budget_page(self, reason: str) -> None:
        if self.rec.page is None:
            self.rec.page_s, self.rec.page = self._s(datetime.now(UTC)), reason
            log.error("nights %d: PAGE (budget): %s", self.seed, reason)

    def _fleet_stopped(self) -> None:
        from batch_inference import autopilot

        try:
            with db.connect(self.url, retries=10) as conn:
                autopilot.observe(conn, self.job, "nights", 0)
                if self.regions is not None:
                    self.regions.observe(conn, self.job, stopped=True)
        except (psycopg.Error, db.DatabaseUnavailable) as exc:
            log.warning("nights %d: could not record the fleet's end: %s", self.seed, exc)

    def _gpu_hours(self, spec: Any) -> float:
        """The batch workers' GPU-hours (none on a hosted night), and the autopilot's decisions into the
        night's record."""
        from batch_inference import autopilot

        with db.connect(self.url, retries=10) as conn:
            hours = autopilot.gpu_hours(conn, self.job, spec)
            decisions = conn.execute(db.q("fleet_decisions"), {"job": self.job}).fetchall()
        self.rec.gpu_hours = round(hours, 6)
        if self.pilot:
            adds = [d for d in decisions if d["action"] == "add"]
            changed = [d for d in decisions if d["action"] != "hold"]
            self.rec.pilot = {
                "decisions": len(decisions), "adds": len(adds),
                "removes": sum(1 for d in decisions if d["action"] == "remove"),
                "first_add_s": self._s(adds[0]["at"]) if adds else None,
                "largest": max([int(d["desired"]) for d in decisions] + [self.cfg.workers]),
                "pages": sorted({d["page"] for d in decisions if d["page"]}),
                "changes": [f"{self._s(d['at'])}s {d['action']} {d['current']}->{d['desired']}: {d['reason'][:120]}"
                            for d in decisions if d["action"] != "hold"][:20],
                # Sizes taken whose own projection was over the budget (none with on_budget page), and
                # removals undoing an add within its cooldown (flapping: the hysteresis adds at once and
                # removes only past the cooldown).
                "over_budget": sum(1 for d in decisions for o in (d["options"] or [])
                                   if o["workers"] == d["desired"] and not o.get("within_budget", True)),
                "flaps": sum(1 for a, b in zip(changed, changed[1:]) if (a["action"], b["action"]) == ("add", "remove")
                             and (b["at"] - a["at"]).total_seconds() < self.cfg.pilot_cooldown_s),
            }
        return hours

    def _maybe_page(self, reason: str, rate: float) -> None:
        """Page once the arithmetic says the deadline is lost (``cutoff.deadline_lost``) at ``rate``,
        the pool's own limit: the fastest it could go if the endpoint came back now, so the page
        says what is certain. (At the sustained rate the cutoff assumes, a drifted "slower"
        history made every night lost from submit, and a 1.5 s 5xx burst paged a night that then
        met its deadline: seed 16.)"""
        from batch_inference.fallback import deadline_page

        now = datetime.now(UTC)
        with db.connect(self.url, retries=10) as conn:
            page = deadline_page(conn, self.job, self.deadline, f"the fallback endpoint is failing: {reason[:140]}",
                                 rate=rate, reserve_s=self.cfg.page_reserve_s, step_s=1, now=now)
        if page is not None:
            self.rec.page_s, self.rec.page = self._s(now), page
            log.error("nights %d: PAGE: %s", self.seed, page)

    # -- the figures ------------------------------------------------------------------
    def _measure(self) -> None:
        from batch_inference.cost import cents
        from batch_inference.status import bill as status_bill, job_counts, job_spec

        rec, c = self.rec, self.cfg
        with db.connect(self.url, retries=10) as conn:
            counts = job_counts(conn, self.job)
            spec = job_spec(conn, self.job)
            cov = conn.execute(db.q("chaos_coverage"), {"job": self.job}).fetchone()
            last = conn.execute(db.q("nights_last_rows"), {"job": self.job}).fetchall()
            dead = conn.execute(db.q("dead_letters"), {"job": self.job}).fetchall()
            runs = conn.execute(db.q("nights_fallback_runs"), {"job": self.job}).fetchall()
            bill, _ = status_bill(conn, self.job, counts=counts)     # what `batch-inference cost` reads
        self._gpu_hours(spec)
        rec.coverage = {k: int(v) for k, v in cov.items()}
        rec.rows = {r["transport"]: int(r["n"]) for r in last}
        lasts = [r["last_at"] for r in last if r["last_at"] is not None]
        rec.last_row_s = self._s(max(lasts)) if lasts else None
        b = bill.to_dict()
        rec.bill = {k: b[k] for k in ("batch_rows", "fallback_rows", "batch_cost", "fallback_cost", "total",
                                      "all_synchronous_ceiling", "clean_batch_floor", "gpu_hours", "gpu_cost")}
        # The rows' part of the bill, rounded once (total less GPU, each rounded, is off by a cent).
        rec.bill["rows_total"] = float(cents(bill.total - bill.gpu_cost))
        if "fallback_tiers" in b:     # the tail's rows at the tier that answered each
            rec.bill["fallback_tiers"] = {str(t["tier"]): t["rows"] for t in b["fallback_tiers"]}
            rec.bill["fallback_tier_cost"] = {str(t["tier"]): t["cost"] for t in b["fallback_tiers"]}
        rec.bill["total_exact"] = float(bill.total)       # unrounded, for the budget's check
        if self.regions is not None or self.one_region is not None:
            from batch_inference.regions import one_region_figures

            with db.connect(self.url, retries=10) as conn:
                rec.regions = (self.regions.figures(conn, self.job, rec.bill["rows_total"]) if self.regions is not None
                               else one_region_figures(rec.gpu_hours, self.one_region[0], rec.bill["rows_total"],
                                                       self.one_region[1], self.faced))
        rec.cost_ratio = round(float(bill.total / bill.all_synchronous_ceiling), 4) \
            if bill.all_synchronous_ceiling else None
        rec.dead_letters = [{"record_id": d["record_id"], "stage": d["stage"], "attempts": d["attempts"],
                             "reason": (d["reason"] or "")[:160]} for d in dead]
        # The one oversized record is dead-lettered at planning by design; any other is a healthy one.
        rec.healthy_dead = sum(1 for d in dead if d["stage"] != "plan")
        rec.fallback["runs"] = [{k: (round(float(v), 3) if isinstance(v, float) else v)
                                 for k, v in r.items() if k not in ("started_at", "finished_at")} for r in runs]
        rec.deadline_s = self._s(self.deadline)
        if rec.published_s is not None:
            rec.slack_s = round(rec.deadline_s - rec.published_s, 2)
        if rec.predicted and rec.last_row_s is not None:
            rec.prediction_error_s = round(rec.last_row_s - rec.predicted["finish_s"], 2)
        self._verdict()

    def _verdict(self) -> None:
        rec, c = self.rec, self.cfg
        cov = rec.coverage
        if cov.get("duplicates"):
            rec.failures.append(f"{cov['duplicates']} duplicate row(s)")
        # A pool stopped at the budget leaves its records pending (neither stored nor dead) on purpose.
        missing = rec.lost
        lost = missing + cov.get("stored_and_dead", 0)
        if lost:
            rec.failures.append(f"{missing} record(s) neither stored nor dead-lettered, "
                                f"{cov.get('stored_and_dead', 0)} both")
        if rec.healthy_dead:
            why = Counter(d["reason"][:60] for d in rec.dead_letters if d["stage"] != "plan")
            rec.failures.append(f"{rec.healthy_dead} healthy record(s) dead-lettered: {dict(why)}")
        if rec.hosted.get("billed_twice"):
            rec.failures.append(f"the hosted provider billed {rec.hosted['billed_twice']} request(s) twice")
        # The ceiling bounds what the rows cost (each billed once, at a price no higher than the
        # synchronous one); the workers' GPU time is bounded by the fleet's size and the night instead.
        rows_bill = rec.bill.get("rows_total", rec.bill.get("total", 0.0)) if rec.bill else 0.0
        if rec.bill and rows_bill > rec.bill["all_synchronous_ceiling"]:
            rec.failures.append(f"rows billed ${rows_bill:.2f} over the ceiling ${rec.bill['all_synchronous_ceiling']}")
        # With on_budget page the bill keeps within the budget: the autopilot's fleet, a fixed fleet (stopped
        # at it) and a hosted night's provider batches (sent no more rows than it affords) alike.
        if c.budget is not None and c.on_budget == "page" and rec.bill and rec.bill["total_exact"] > c.budget:
            rec.failures.append(f"billed ${rec.bill['total_exact']:.5f} over the budget ${c.budget:g} (on_budget: page)")
        late = rec.published_s is None or rec.slack_s is None or rec.slack_s < 0
        paged_early = rec.page is not None and rec.page_s is not None and rec.page_s < rec.deadline_s
        if late and not paged_early:
            when = f"at {rec.published_s:.1f}s" if rec.published_s is not None else "never"
            rec.failures.append(f"published {when}, deadline {rec.deadline_s:g}s, no early page")
        if rec.failures:
            rec.verdict = "FAIL"
        elif late:
            rec.verdict = "paged"
        else:
            rec.verdict = "met"


# -- the run ---------------------------------------------------------------------------


def run_totals(runs: list[Night]) -> dict[str, Any]:
    """One side of a paired comparison (autopilot off/on, one price/tiers): verdicts, duplicates, lost rows,
    the fallback's rows and bill (the tail), the whole bill, GPU-hours, cutoffs fired."""
    met = sum(1 for n in runs if n.verdict == "met")
    return {"nights": len(runs), "met": met, "paged": sum(1 for n in runs if n.verdict == "paged"),
            "failed": sum(1 for n in runs if n.verdict == "FAIL"),
            "met_rate": round(met / len(runs), 4) if runs else None,
            "duplicates": sum(n.coverage.get("duplicates", 0) for n in runs), "lost": sum(n.lost for n in runs),
            "bill": round(sum(n.bill.get("total", 0.0) for n in runs), 4),
            "fallback_rows": sum(n.rows.get("fallback", 0) for n in runs),
            "tail_bill": round(sum(n.bill.get("fallback_cost", 0.0) for n in runs), 4),
            "gpu_hours": round(sum(n.gpu_hours for n in runs), 6),
            "fired": sum(1 for n in runs if n.fired_s is not None)}


def tail_by_tier(nights: list[Night]) -> dict[str, dict[str, Any]]:
    """The fallback's rows over the nights by the tier that answered them (the month's tail split):
    ``{tier: {rows, cost, nights}}``, ``nights`` counting the nights that tier answered rows on; "None"
    the fallback rows without a tier. Empty when no night ran tiers."""
    out: dict[str, dict[str, Any]] = {}
    for n in nights:
        cost = n.bill.get("fallback_tier_cost", {})
        for tier, rows in n.bill.get("fallback_tiers", {}).items():
            t = out.setdefault(tier, {"rows": 0, "cost": 0.0, "nights": 0})
            t["rows"] += rows
            t["cost"] = round(t["cost"] + cost.get(tier, 0.0), 6)
            t["nights"] += rows > 0
    return out


@dataclass
class NightsReport:
    config: dict[str, Any]
    nights: list[Night]
    wall_s: float
    work_dir: str | None = None

    @property
    def passed(self) -> bool:
        return all(n.verdict in ("met", "paged") for n in self.nights)

    def summary(self) -> dict[str, Any]:
        ns = self.nights
        met = [n for n in ns if n.verdict == "met"]
        slacks = [n.slack_s for n in ns if n.slack_s is not None]
        ratios = [n.cost_ratio for n in ns if n.cost_ratio is not None]
        errs = [abs(n.prediction_error_s) for n in ns if n.prediction_error_s is not None]
        fired = [n for n in ns if n.fired_s is not None]
        month_bill = sum(n.bill.get("total", 0.0) for n in ns)
        return {
            "nights": len(ns), "met": len(met), "paged": sum(1 for n in ns if n.verdict == "paged"),
            "failed": sum(1 for n in ns if n.verdict == "FAIL"),
            "met_rate": round(len(met) / len(ns), 4) if ns else None,
            "slip_rate": round(len(fired) / len(ns), 4) if ns else None,
            "fallback_by_tier": tail_by_tier(ns),
            "worst_slack_s": min(slacks) if slacks else None,
            "cost_ratio_mean": round(statistics.mean(ratios), 4) if ratios else None,
            "cost_ratio_worst": max(ratios) if ratios else None,
            "prediction_error_mean_s": round(statistics.mean(errs), 2) if errs else None,
            "prediction_error_worst_s": max(errs) if errs else None,
            "bill_total": round(month_bill, 2),
            "ceiling_total": round(sum(n.bill.get("all_synchronous_ceiling", 0.0) for n in ns), 2),
            "floor_total": round(sum(n.bill.get("clean_batch_floor", 0.0) for n in ns), 2),
            "failing_seeds": [n.seed for n in ns if n.verdict == "FAIL"],
            "pages": sum(1 for n in ns if n.page),
            "false_pages": [n.seed for n in ns if n.page and n.verdict == "met"],
            "duplicates": sum(n.coverage.get("duplicates", 0) for n in ns),
            "lost": sum(n.lost for n in ns),
            "healthy_dead": sum(n.healthy_dead for n in ns),
            "hosted_nights": sum(1 for n in ns if n.hosted),
            "hosted_billed_twice": sum(n.hosted.get("billed_twice", 0) for n in ns),
            "budget": self.config.get("budget"),
            "over_budget": [n.seed for n in ns if self.config.get("budget") is not None
                            and n.bill.get("total_exact", n.bill.get("total", 0.0)) > self.config["budget"]],
            "autopilot": self.comparison(),
            "tiers": self.tier_comparison(),
            "regions": self.region_comparison(),
        }

    def comparison(self) -> dict[str, Any] | None:
        """The autopilot off against on, over all nights and over the slowed ones: met rate, bill,
        fallback rows, GPU-hours, and how early the controller acted (its first add, and how long
        before the fixed fleet's cutoff fired that night). None unless both modes ran."""
        off = {n.seed: n for n in self.nights if not n.autopilot and not n.regions}
        on = {n.seed: n for n in self.nights if n.autopilot and not n.regions}
        seeds = sorted(set(off) & set(on))
        if not seeds:
            return None

        out: dict[str, Any] = {}
        for name, pick in (("all", seeds), ("slowed", [s for s in seeds if off[s].slowed])):
            a, b = run_totals([off[s] for s in pick]), run_totals([on[s] for s in pick])
            out[name] = {"off": a, "on": b,
                         "bill_saved": round(1 - b["bill"] / a["bill"], 4) if a["bill"] else None}
        leads = [round(off[s].fired_s - on[s].pilot["first_add_s"], 2) for s in seeds
                 if off[s].fired_s is not None and on[s].pilot.get("first_add_s") is not None]
        out["acted_before_fixed_fleet_fired_s"] = {"nights": len(leads),
                                                   "mean": round(statistics.mean(leads), 2) if leads else None,
                                                   "least": min(leads) if leads else None}
        out["per_night"] = [{"seed": s, "slowed": off[s].slowed, "verdict": [off[s].verdict, on[s].verdict],
                             "bill": [off[s].bill.get("total"), on[s].bill.get("total")],
                             "fallback_rows": [off[s].rows.get("fallback", 0), on[s].rows.get("fallback", 0)],
                             "gpu_hours": [off[s].gpu_hours, on[s].gpu_hours],
                             "fired_s": [off[s].fired_s, on[s].fired_s],
                             "first_add_s": on[s].pilot.get("first_add_s"), "largest": on[s].pilot.get("largest")}
                            for s in seeds]
        return out

    def tier_comparison(self) -> dict[str, Any] | None:
        """The fallback at one price against with price tiers, on the same seeds and faults: met, paged,
        failed, duplicates, lost, the tail's rows and bill (``fallback_cost``), and the tail's bill with
        tiers as a share of the one-price tail's. None unless both ran."""
        one = {n.seed: n for n in self.nights if not n.tiered}
        tiered = {n.seed: n for n in self.nights if n.tiered}
        seeds = sorted(set(one) & set(tiered))
        if not seeds:
            return None

        a, b = run_totals([one[s] for s in seeds]), run_totals([tiered[s] for s in seeds])
        per_row = [x["tail_bill"] / x["fallback_rows"] if x["fallback_rows"] else None for x in (a, b)]
        return {"one_price": a, "tiers": b,
                "tail_bill_ratio": round(b["tail_bill"] / a["tail_bill"], 4) if a["tail_bill"] else None,
                "tail_per_row_ratio": round(per_row[1] / per_row[0], 4) if all(per_row) else None,
                "per_night": [{"seed": s, "verdict": [one[s].verdict, tiered[s].verdict],
                               "fallback_rows": [one[s].rows.get("fallback", 0), tiered[s].rows.get("fallback", 0)],
                               "tail_bill": [one[s].bill.get("fallback_cost"), tiered[s].bill.get("fallback_cost")],
                               "tiers": tiered[s].bill.get("fallback_tiers"), "slack_s": [one[s].slack_s,
                                                                                          tiered[s].slack_s]}
                              for s in seeds]}

    def region_comparison(self) -> dict[str, Any] | None:
        """The nights over three regions against the single-region autopilot on the same nights: met, paged,
        failed, duplicates, lost records, the bill (GPU at each cluster's price, replication and egress, the
        rows), and per night the ratio and whether the regions' prices differed from the ledger region's
        (``cheaper_elsewhere``: another region's record is cheaper, so the bill should be at most one region's).
        On a night with a region lost the single region met the same loss (``faced``). None unless region
        nights ran."""
        one = {n.seed: n for n in self.nights if n.regions.get("role") == "one"}
        reg = {n.seed: n for n in self.nights if n.regions.get("role") == "regions"}
        seeds = sorted(set(one) & set(reg))
        if not seeds:
            return None
        a, b = run_totals([one[s] for s in seeds]), run_totals([reg[s] for s in seeds])
        for side, runs in ((a, one), (b, reg)):
            side["bill"] = round(sum(runs[s].regions["bill_usd"] for s in seeds), 6)
        per = [{"seed": s, "verdict": [one[s].verdict, reg[s].verdict],
                "bill": [one[s].regions["bill_usd"], reg[s].regions["bill_usd"]],
                "ratio": round(reg[s].regions["bill_usd"] / one[s].regions["bill_usd"], 4)
                if one[s].regions["bill_usd"] else None,
                "plan": [one[s].regions["plan"], reg[s].regions["plan"]],
                "faults": reg[s].regions["faults"], "lost": reg[s].regions["lost"], "steals": reg[s].regions["steals"],
                "pages": reg[s].regions["pages"][:1], "slack_s": [one[s].slack_s, reg[s].slack_s],
                "gpu_usd": [one[s].regions["gpu_usd"], reg[s].regions["gpu_usd"]],
                "egress_usd": reg[s].regions["egress_usd"], "faced": one[s].regions.get("faced", []),
                "cheaper_elsewhere": reg[s].regions.get("cheaper_elsewhere")}
               for s in seeds]
        differ = [x for x in per if x["cheaper_elsewhere"]]
        return {"one_region": a, "regions": b, "bill_ratio": round(b["bill"] / a["bill"], 4) if a["bill"] else None,
                "region_lost_nights": sum(1 for x in per if x["lost"]),
                "prices_differ": {"nights": len(differ),
                                  "at_most_one_region": sum(1 for x in differ if x["ratio"] is not None
                                                            and x["ratio"] <= 1.0),
                                  "worst_ratio": max((x["ratio"] for x in differ if x["ratio"] is not None),
                                                     default=None)},
                "per_night": per}

    def as_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "summary": self.summary(), "config": self.config,
                "nights": [asdict(n) for n in self.nights], "wall_s": self.wall_s, "work_dir": self.work_dir}

    def table(self) -> str:
        s, c = self.summary(), self.config
        lines = [f"nights run: {s['nights']} night(s), {c['records']:,} records each, {c['workers']} batch workers, "
                 f"deadline {c['deadline_s']:g}s, fallback {c['rate']:g}/s (pool limit {c['pool_rate']:g}/s), "
                 f"overhead {c['overhead_s']:g}s; wall {self.wall_s:.0f}s", ""]
        lines += [n.line() for n in self.nights]

        def fmt(v: Any, spec: str = "") -> str:
            return "-" if v is None else format(v, spec)

        lines += ["",
                  f"met {s['met']}/{s['nights']} ({fmt(s['met_rate'], '.0%')}), paged early {s['paged']}, "
                  f"failed {s['failed']}; cutoff fired on {fmt(s['slip_rate'], '.0%')} of nights"
                  + (" (the tail by tier: " + ", ".join(f"{k} {v['rows']:,} rows ${v['cost']:,.4f} on {v['nights']} "
                                                        f"night(s)" for k, v in s["fallback_by_tier"].items()) + ")"
                     if s["fallback_by_tier"] else ""),
                  f"worst slack {fmt(s['worst_slack_s'], '+.1f')}s; cost / all-synchronous ceiling: mean "
                  f"{fmt(s['cost_ratio_mean'], '.3f')}, worst {fmt(s['cost_ratio_worst'], '.3f')}; "
                  f"bill ${s['bill_total']:,.2f} against ${s['ceiling_total']:,.2f} all-synchronous and "
                  f"${s['floor_total']:,.2f} all-batch",
                  f"prediction error of the finish: mean {fmt(s['prediction_error_mean_s'], '.1f')}s, worst "
                  f"{fmt(s['prediction_error_worst_s'], '.1f')}s",
                  f"duplicates {s['duplicates']}, lost {s['lost']}, healthy dead letters {s['healthy_dead']}; "
                  f"pages {s['pages']} (false: {s['false_pages'] or 'none'})",
                  *([f"budget ${s['budget']:g} (on_budget {c.get('on_budget')}): bills over it on nights "
                     f"{s['over_budget'] or 'none'}"] if s.get("budget") is not None else []),
                  *self._comparison_lines(s["autopilot"]),
                  *self._tier_lines(s["tiers"]),
                  *self._region_lines(s["regions"]),
                  "PASSED" if self.passed else f"FAILED: nights {s['failing_seeds']} (replay one with --night SEED)"
                  + (f"; logs kept in {self.work_dir}" if self.work_dir else "")]
        return "\n".join(lines)


    @staticmethod
    def _tier_lines(cmp: dict[str, Any] | None) -> list[str]:
        if not cmp:
            return []
        a, b = cmp["one_price"], cmp["tiers"]
        ratio = cmp["tail_bill_ratio"]
        return ["", "fallback at one price -> with tiers (same seeds, same faults):",
                f"  {a['nights']} nights: met {a['met']} -> {b['met']}, paged {a['paged']} -> {b['paged']}, failed "
                f"{a['failed']} -> {b['failed']}, duplicates {a['duplicates']} -> {b['duplicates']}, lost {a['lost']} -> "
                f"{b['lost']}, tail rows {a['fallback_rows']:,} -> {b['fallback_rows']:,}, tail bill "
                f"${a['tail_bill']:,.4f} -> ${b['tail_bill']:,.4f}"
                + (f" ({ratio:.3f} of one price)" if ratio is not None else "")]

    @staticmethod
    def _region_lines(cmp: dict[str, Any] | None) -> list[str]:
        if not cmp:
            return []
        a, b, d = cmp["one_region"], cmp["regions"], cmp["prices_differ"]
        out = ["", "one region (its autopilot) -> three regions (the autopilot over every cluster), same nights "
                   "(a region's loss met by the one region too: the same share of its workers and GPUs):",
               f"  {a['nights']} nights: met {a['met']} -> {b['met']}, paged {a['paged']} -> {b['paged']}, failed "
               f"{a['failed']} -> {b['failed']}, duplicates {a['duplicates']} -> {b['duplicates']}, lost {a['lost']} -> "
               f"{b['lost']}, bill ${a['bill']:,.4f} -> ${b['bill']:,.4f}"
               + (f" ({cmp['bill_ratio']:.3f} of one region)" if cmp["bill_ratio"] is not None else ""),
               f"  a region lost on {cmp['region_lost_nights']} night(s); another region's record cheaper on "
               f"{d['nights']} night(s), the regions' bill at most one region's on {d['at_most_one_region']} of them"
               + (f" (worst {d['worst_ratio']:.3f})" if d["worst_ratio"] is not None else "")]
        for x in cmp["per_night"]:
            out.append(f"  night {x['seed']}: {x['verdict'][0]} -> {x['verdict'][1]}, bill ${x['bill'][0]:.4f} -> "
                       f"${x['bill'][1]:.4f} ({x['ratio']}), plan {x['plan'][0]} -> {x['plan'][1]}, "
                       f"{x['steals']} steal(s){', lost ' + ', '.join(x['lost']) if x['lost'] else ''}"
                       f"{'; ' + '; '.join(x['faults']) if x['faults'] else ''}")
        return out

    @staticmethod
    def _comparison_lines(cmp: dict[str, Any] | None) -> list[str]:
        if not cmp:
            return []
        out = ["", "autopilot off -> on (same seeds, same faults):"]
        for name in ("all", "slowed"):
            a, b, saved = cmp[name]["off"], cmp[name]["on"], cmp[name]["bill_saved"]
            out.append(f"  {name + ' nights':<14} {a['nights']:>3}: met {a['met']} -> {b['met']}, paged {a['paged']} -> "
                       f"{b['paged']}, failed {a['failed']} -> {b['failed']}, cutoff fired {a['fired']} -> {b['fired']}, "
                       f"fallback rows {a['fallback_rows']:,} -> {b['fallback_rows']:,}, GPU-h {a['gpu_hours']:.4f} -> "
                       f"{b['gpu_hours']:.4f}, bill ${a['bill']:,.2f} -> ${b['bill']:,.2f}"
                       + (f" ({saved:+.1%} saved)" if saved is not None else ""))
        lead = cmp["acted_before_fixed_fleet_fired_s"]
        if lead["nights"]:
            out.append(f"  the controller's first add came {lead['mean']:.1f}s (least {lead['least']:.1f}s) before the "
                       f"fixed fleet's cutoff fired, on {lead['nights']} night(s)")
        return out


def _region_pair(cfg: NightsConfig, seed: int, server: EmbeddedServer, work: Path) -> list[Night]:
    """One night over three regions (``regions.RegionNight``) and the same night (its seed's faults) in
    the ledger's region alone under the single-region autopilot, from the planner's first size there. The
    regions run first: the single region then meets their losses as they fell (the same share of its
    workers at the same moment, the same share of its capacity). Returned single region first."""
    from batch_inference.autopilot import Policy
    from batch_inference.regions import RegionNight

    policy = Policy(min_workers=cfg.min_workers, max_workers=cfg.region_capacity, margin_s=cfg.pilot_margin_s,
                    start_s=cfg.pilot_start_s, cooldown_s=cfg.pilot_cooldown_s, window_s=cfg.pilot_window_s)
    rn = RegionNight(seed, work / f"regions-{seed}", cfg.records, cfg.shard_size, cfg.batch_delay_s, cfg.deadline_s,
                     cfg.overhead_s, policy, price_scale=cfg.gpu_hour / SEED_GPU_HOUR, capacity=cfg.region_capacity,
                     poll_s=cfg.poll_s)
    only, price, capacity = rn.one_region()
    first = max(cfg.min_workers, sum(c.workers for c in only.clusters))
    regions = _NightRun(cfg, seed, server, work, regions=rn).run()
    log.warning("%s", regions.line())
    one = _NightRun(cfg, seed, server, work, pilot=True, one_region=(price, first, capacity), losses=rn.losses).run()
    log.warning("%s", one.line())
    return [one, regions]


def run_nights(cfg: NightsConfig) -> NightsReport:
    """Run the configured nights one after another on one database server."""
    t_start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="bi-nights-", dir="/tmp"))   # short: a Unix socket lives in it
    server: EmbeddedServer | None = None
    clean = False
    try:
        server = EmbeddedServer(work / "pg")
        with db.connect(server.url) as conn:
            db.migrate(conn)
        nights: list[Night] = []
        for seed in cfg.seeds():
            for pilot in cfg.modes():
                for tiered in cfg.tier_modes():
                    if cfg.regions:
                        nights += _region_pair(cfg, seed, server, work)
                        continue
                    nights.append(_NightRun(cfg, seed, server, work, pilot, tiered).run())
                    log.warning("%s", nights[-1].line())
        report = NightsReport(asdict(cfg), nights, round(time.monotonic() - t_start, 1))
        clean = report.passed and not cfg.keep
        report.work_dir = None if clean else str(work)
        return report
    finally:
        if server is not None:
            server.stop()
        if clean:
            shutil.rmtree(work, ignore_errors=True)
        else:
            log.warning("nights: work directory kept: %s", work)

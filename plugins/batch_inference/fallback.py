"""The synchronous fallback pool: the same work, a different transport.

When the cutoff fires the job goes into fallback mode (``bi.enter_fallback_v1``):
batch workers learn it at their next lease renewal, stop taking records,
write what is in flight and release their shard. The pool then claims the
remaining shards through the same ledger with ``transport = 'fallback'`` and
drives their outstanding records through an OpenAI-compatible endpoint. It
writes through the same put-if-absent path, so a record the draining batch
worker already wrote is not written twice, and every fallback row is marked
``transport = 'fallback'`` for the cost report.

The pool is several in-process :class:`gpu_runner.worker.Worker` threads,
because one worker holds one shard at a time and the last shards of a late
batch are usually spread over several leases. They share a single token
bucket, because the endpoint's rate limit applies to the whole pool and not
to each thread. Each thread also gets an equal share of the pool's
concurrency, so no more than ``concurrency`` requests are on the wire at once.

Each finished run is measured and written to ``bi.fallback_runs``, so that
the cutoff derives its rate and overhead from recent nights rather than
from constants that go stale:

* ``rate``: records the pool settled (stored or dead-lettered) divided by the
  time at least one pool thread held a shard. This is the sustained rate,
  retry back-off included.
* ``overhead_s``: the rest of the wall time from the moment the cutoff fired
  (``jobs.fallback_at``) to the moment the job had nothing outstanding: the
  scheduling delay before the pool started, the wait for draining or expired
  batch leases, and the final reconciliation. The drain (``drain_s``) and the
  re-drive (``busy_s``) are recorded beside it. The warehouse load is not
  measured here; the publish step records it as ``load_s`` with
  :func:`add_load_time`.

So, by construction, ``finished_at - started_at = overhead_s + records / rate``.
This is the same equation the cutoff solves backwards.

An endpoint that is down is not a poison record. All pool threads share one
:class:`batch_inference.breaker.Breaker`; when it trips (most requests failed
in transport: refused connections, timeouts, HTTP 5xx, ...), every thread
stops, the records stay pending with their attempts untouched, the shards
are released, and :func:`run_fallback` raises
:class:`FallbackEndpointUnavailable` with one line naming the endpoint and
the error.

The budget (``cost.budget``, ``cost.on_budget``) is checked before the pool
starts: the bill so far (``status.bill``, what ``batch-inference cost`` says)
plus the GPU time the batch workers still running may spend draining
(``autopilot.drain_s`` each, reserved first) plus every outstanding row at
``cost.fallback_per_row``. Over it, the pool pages once with that arithmetic
(``on_page``) and, with ``on_budget: page``, re-drives at most the rows the rest
of the budget affords (a retried request spends nothing twice), through one
:class:`batch_inference.ratelimit.RequestAllowance` shared by its threads and
keyed by record; the first record refused stops the pool as ``stop()`` does, the
records left stay pending with no attempt spent, and the result says
``budget_stop``. With ``on_budget: spend`` it re-drives everything.

No Airflow here: the same function runs from the CLI (``batch-inference
fallback``) and from ``FallbackPoolOperator``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import psycopg

from batch_inference import db
from batch_inference.breaker import Breaker, public_url
from batch_inference.clearance import NotCleared, check_clearance
from batch_inference.cost import Prices, cents, rows_within
from batch_inference.cutoff import PAGE_RESERVE_SHARE, deadline_lost
from batch_inference.engines.openai import STYLES
from batch_inference.exceptions import FallbackEndpointUnavailable, FallbackIncomplete, FallbackRefused
from batch_inference.ratelimit import RequestAllowance, TokenBucket
from batch_inference.spec import JobSpec, stored_spec
from batch_inference.status import JobCounts, UnknownJob, bill, job_counts, job_spec

if TYPE_CHECKING:
    from gpu_runner.worker import Worker

log = logging.getLogger("batch_inference.fallback")


# -- guards -----------------------------------------------------------------


def check_hosted(spec: JobSpec, job_version: str, base_url: str | None, hosted: bool | None) -> bool:
    """Refuse a fallback endpoint the job's records may not reach (``clearance.check_clearance``).

    Returns whether the endpoint counts as hosted. ``hosted`` (or the spec's
    ``fallback.hosted``) true marks it hosted; false declares nothing. With no
    URL yet (no ``fallback.base_url``, none given) only that mark is checked.
    The check comes before any request, any claim and any change of mode, so
    a refused fallback leaves the job as it was, with nothing sent.
    """
    try:
        return check_clearance(spec, base_url or None, hosted=bool(spec.fallback.hosted or hosted),
                               job_version=job_version, role="fallback")
    except NotCleared as exc:
        raise FallbackRefused(str(exc)) from None


def enter_fallback(conn: psycopg.Connection, job_version: str) -> bool:
    """Put the job in fallback mode: batch claims are refused and batch workers drain.

    True if the job is running (now or already in fallback mode); False if
    it is not running (validated, published, dropped). Idempotent: the first
    ``fallback_at`` is kept.
    """
    r = conn.execute(db.q("enter_fallback"), {"job": job_version}).fetchone()
    return bool(r and r["ok"])


def deadline_page(conn: psycopg.Connection, job_version: str, deadline: datetime, why: str, *,
                  rate: float | None = None, reserve_s: float | None = None, step_s: int = 60,
                  now: datetime | None = None) -> str | None:
    """The page for a deadline the fallback can no longer meet, or None while it still can:
    ``cutoff.deadline_lost`` on the job's outstanding rows now. ``rate`` defaults to the spec's
    ``fallback.rate``, the pool's own limit: the fastest it could go if its endpoint came back now,
    so the page says what is certain. ``reserve_s`` is what the publish needs after the re-drive (default
    ``cutoff.PAGE_RESERVE_SHARE`` of the spec's ``fallback.overhead_s``: 600 s of the default 1,800 s).
    The nights, ``CutoffSensor`` and ``FallbackPoolOperator`` page with this one message."""
    outstanding = int(job_counts(conn, job_version)["outstanding"])
    if rate is None or reserve_s is None:
        fb = job_spec(conn, job_version).fallback
        rate = fb.rate if rate is None else rate
        reserve_s = fb.overhead_s * PAGE_RESERVE_SHARE if reserve_s is None else reserve_s
    return deadline_lost(now or datetime.now(timezone.utc), deadline, outstanding, float(rate), float(reserve_s),
                         why, step_s=step_s)


def add_load_time(conn: psycopg.Connection, job_version: str, load_s: float | None = None) -> float | None:
    """Record the warehouse load on the job's latest fallback run (``load_s``), once.

    The seed's overhead includes the load, which only the publish step can
    time. Without ``load_s`` the load is measured on the database clock: from
    the run's ``finished_at`` (nothing outstanding) to the switch of the
    dataset's pointer to this version, so validation and the wait for the
    publish task count too. A run that already has a load keeps it (a
    repeated publish is not a second load). Returns the run's whole overhead
    (``overhead_s + load_s``), or None if the job has no fallback run or the
    load cannot be measured yet (not published).
    """
    r = conn.execute(db.q("fallback_run_add_load"), {
        "job": job_version, "load_s": None if load_s is None else float(load_s)}).fetchone()
    if r is None or r["load_s"] is None:
        return None
    return float(r["overhead_s"]) + float(r["load_s"])


@dataclass(frozen=True)
class BudgetCheck:
    """``cost.budget`` against re-driving every outstanding row at the fallback's price, the batch
    workers' drain (GPU time still to run) reserved first."""

    budget: Decimal
    spent: Decimal          # the bill so far (status.bill)
    outstanding: int
    per_row: Decimal        # cost.fallback_per_row
    on_budget: str          # page | spend
    draining: int = 0       # batch workers the launchers still run
    drain_s: float = 0.0    # the longest one of them runs from now (autopilot.drain_s)
    reserve: Decimal = Decimal(0)   # their GPU time at the GPU-hour price
    in_provider: int = 0    # rows a hosted batch transport's provider batches still hold (paid once they complete)
    provider_reserve: Decimal = Decimal(0)   # those rows at the transport's batch price
    # Who sends the outstanding rows, in the page's words: the pool, or a hosted batch transport's workers
    # (``hosted.budget``: the same check before a provider batch is opened).
    who: str = "the fallback"
    does: str = "re-drives"
    note: str = "; a retried request spends nothing twice"
    then: str = " and the fallback runs again"
    # fallback.tiers: (name, per_row) cheapest first. The outstanding rows are projected at the last tier's
    # price (``per_row``: any row may end there) and the pool spends the rest of the budget row by row at
    # the tier each goes to (``tiers.TierAllowance``): ``allowance`` counts rows at the cheapest.
    tiers: tuple[tuple[str, Decimal], ...] = ()

    @property
    def projected(self) -> Decimal:
        return self.spent + self.reserve + self.provider_reserve + self.outstanding * self.per_row

    @property
    def over(self) -> bool:
        return self.projected > self.budget

    @property
    def allowance(self) -> int | None:
        """Rows the pool may re-drive (a retried request spends nothing twice): the rows the rest of the
        budget affords, the drain reserved first, over the budget with ``on_budget: page``; None (no cap)
        otherwise."""
        if not self.over or self.on_budget != "page":
            return None
        return rows_within(self.budget, self.spent + self.reserve + self.provider_reserve,
                           self.tiers[0][1] if self.tiers else self.per_row)

    @property
    def money_left(self) -> Decimal:
        """The budget less the bill so far and the reserves: what the pool may still spend."""
        return max(Decimal(0), self.budget - self.spent - self.reserve - self.provider_reserve)

    def page(self, job_version: str) -> str:
        """One line: the arithmetic, and what the pool does about it."""
        drain = (f" + ${cents(self.reserve):,} for {self.draining:,} draining batch worker(s) ({self.drain_s:g} s at "
                 "the GPU-hour price)" if self.reserve else "")
        drain += (f" + ${cents(self.provider_reserve):,} for {self.in_provider:,} row(s) in provider batches"
                  if self.in_provider else "")
        sums = (f"budget ${cents(self.budget):,}: spent ${cents(self.spent):,} so far{drain} + {self.outstanding:,} rows "
                f"outstanding x ${self.per_row}/row = ${cents(self.projected):,} projected")
        if self.allowance is None:
            return (f"{self.who} of {job_version} {self.does} every row past the budget (on_budget: spend): {sums}, "
                    f"${cents(self.projected - self.budget):,} over")
        n = self.allowance
        if self.tiers:
            (low, low_price), (top, _) = self.tiers[0], self.tiers[-1]
            return (f"{self.who} of {job_version} stops at the budget (on_budget: page): {sums} at the last tier "
                    f"({top}); it {self.does} rows while the rest, ${cents(self.money_left):,}, affords each at the "
                    f"tier it goes to (a row sent and not yet answered reserved at its tier's price): at most "
                    f"{n:,} row(s) at {low} ${low_price}/row, at least "
                    f"{rows_within(self.money_left, 0, self.per_row) or 0:,} at {top}; rows "
                    f"left pending: the job cannot be validated nor published (I3) until cost.budget is raised "
                    f"(resubmit the spec){self.then}")
        return (f"{self.who} of {job_version} stops at the budget (on_budget: page): {sums}; it {self.does} at most "
                f"{n:,} row(s) (${cents(n * self.per_row):,}{self.note}), and leaves at "
                f"least {self.outstanding - n:,} row(s) pending: the job cannot be validated nor published (I3) until "
                f"cost.budget is raised (resubmit the spec){self.then}")


def budget_check(conn: psycopg.Connection, job_version: str, spec: JobSpec,
                 counts: JobCounts) -> BudgetCheck | None:
    """The job's budget against its outstanding rows re-driven now, with the GPU time of the batch
    workers still running reserved for their drain; None without ``cost.budget``."""
    from batch_inference import autopilot

    if spec.cost.budget is None:
        return None
    prices = Prices.from_spec(spec)
    so_far, _ = bill(conn, job_version, prices, counts)
    hosted = autopilot.hosted(spec)
    draining = 0 if hosted else int(conn.execute(db.q("fleet_running"), {"job": job_version}).fetchone()["running"])
    # A hosted transport's batches still settling (a cancel takes a while) bill what completes: reserved
    # (their rows stay in outstanding too, for what comes back unanswered: the safe side).
    in_provider = int(conn.execute(db.q("hosted_spend"), {"job": job_version, "lock": False}).fetchone()["in_flight"]) \
        if hosted else 0
    drain_s = autopilot.drain_s(spec)
    tiers = tuple((t.name, Decimal(str(t.per_row))) for t in spec.fallback.tiers)
    return BudgetCheck(budget=Decimal(str(spec.cost.budget)), spent=so_far.total, tiers=tiers,
                       outstanding=int(counts["outstanding"]),
                       per_row=tiers[-1][1] if tiers else prices.fallback_per_row,
                       on_budget=spec.cost.on_budget, draining=draining, drain_s=drain_s,
                       reserve=prices.gpu_cost(Decimal(draining) * Decimal(str(drain_s)) / 3600),
                       in_provider=in_provider, provider_reserve=in_provider * prices.hosted_batch_per_row)


# -- the pool ---------------------------------------------------------------


@dataclass
class FallbackResult:
    """What one fallback run did. It is small enough for an XCom."""

    job_version: str
    records: int = 0  # settled by this pool: stored + dead-lettered
    stored: int = 0
    dead: int = 0
    failed_attempts: int = 0
    shards: int = 0
    outstanding: int = 0  # after the run; > 0 means the pool stopped early
    busy_s: float = 0.0
    wall_s: float = 0.0  # from the cutoff firing (jobs.fallback_at) to nothing outstanding
    rate: float | None = None
    overhead_s: float | None = None
    fallback_run_id: int | None = None
    entered_fallback: bool = False
    stopped: bool = False
    skipped: str | None = None  # why nothing was done, if nothing was
    workers: int = 0
    endpoint: str | None = None
    budget_stop: bool = False  # the budget's allowance ran out: records left pending, the job unpublishable
    budget_page: str | None = None  # the page sent when re-driving every row is over cost.budget
    allowance: int | None = None  # rows the budget let the pool re-drive (None: no cap)
    tiers: list[dict[str, Any]] | None = None  # per price tier (fallback.tiers): answered, refused, latency, price

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for k in ("busy_s", "wall_s", "rate", "overhead_s"):
            if out[k] is not None:
                out[k] = round(out[k], 3)
        return out


@dataclass
class _Busy:
    """The union of the intervals in which at least one pool thread held a shard."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    active: int = 0
    since: float = 0.0
    total: float = 0.0

    def enter(self) -> None:
        with self.lock:
            if self.active == 0:
                self.since = time.monotonic()
            self.active += 1

    def leave(self) -> None:
        with self.lock:
            self.active -= 1
            if self.active == 0:
                self.total += time.monotonic() - self.since


class FallbackPool:
    """Several fallback workers over one rate limit. ``stop()`` may be called from any thread."""

    def __init__(self, db_url: str | None, job_version: str, *, options: dict[str, Any], rate: float,
                 workers: int, lease_seconds: int | None = None, poll_seconds: float = 1.0,
                 flush_every: int = 20, flush_seconds: float = 1.0, allowance: int | None = None,
                 engine: str = "openai", plan: Any = None, budget_left: Decimal | None = None):
        from gpu_runner.worker import Worker, WorkerConfig  # the GPU runner imports no Airflow either

        self.job_version = job_version
        self.bucket = TokenBucket(rate, max(1.0, min(rate, 10.0)))  # a burst of at most ~1 s of tokens
        self.breaker = Breaker.from_options(options["base_url"], options)
        # The budget's cap on requests, shared by every thread; spent, it stops the pool.
        self.allowance: Any = None if allowance is None else RequestAllowance(allowance, on_spent=self.stop)
        if allowance is not None and plan is not None and budget_left is not None:
            # price tiers: the budget's money, each row reserved at the price of the tier it goes to
            from batch_inference.tiers import TierAllowance

            self.allowance = TierAllowance(budget_left, plan.tiers[-1].per_row, on_spent=self.stop)
        self.plan = plan
        if plan is not None:          # the last tier's limit and breaker are the pool's
            plan.tiers[-1].bucket, plan.tiers[-1].breaker = self.bucket, self.breaker
        self.busy = _Busy()
        self.stopped = threading.Event()
        self.workers = [
            Worker(WorkerConfig(
                job_version=job_version, db_url=db_url, engine=engine, engine_options=dict(options),
                transport="fallback", lease_seconds=lease_seconds, wait_for_leases=True,
                poll_seconds=poll_seconds, flush_every=flush_every, flush_seconds=flush_seconds),
                around_shard=self._shared)
            for _ in range(workers)
        ]
        self.codes: list[int | None] = [None] * workers

    @contextlib.contextmanager
    def _shared(self, worker: Worker) -> Iterator[None]:
        """Around each shard a pool thread runs (the worker's ``around_shard``): one bucket for the whole
        pool (the endpoint's limit is per account, not per thread), one breaker (the threads share the
        endpoint) and one allowance (the budget's), all on the engine before its first request."""
        if getattr(worker.engine, "bucket", self.bucket) is not self.bucket:
            worker.engine.bucket = self.bucket
        worker.engine.breaker = self.breaker
        worker.engine.allowance = self.allowance
        if self.plan is not None:     # price tiers (batch_inference.tiers): one plan for every thread
            worker.engine.plan = self.plan
        self.busy.enter()
        try:
            yield
        finally:
            self.busy.leave()

    def run(self) -> list[int | None]:
        def target(i: int) -> None:
            try:
                self.codes[i] = self.workers[i].run()
            except Exception:  # noqa: BLE001 - reported as a failed worker below
                log.exception("fallback worker %s crashed", self.workers[i].owner)
                self.codes[i] = -1
            if self.breaker.tripped is not None:
                self._halt()   # the endpoint is down for every thread: stop the others too

        threads = [threading.Thread(target=target, args=(i,), name=f"fallback-{i}", daemon=True)
                   for i in range(len(self.workers))]
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(timeout=0.5)
        return self.codes

    def stop(self) -> None:
        """Stop taking records; in-flight ones are written, then the leases are released."""
        self.stopped.set()
        self._halt()

    def _halt(self) -> None:
        for w in self.workers:
            w.stop.set()
            for shard in w.held:
                shard.halt.set()

    def stats(self) -> dict[str, int]:
        out = {"shards": 0, "stored": 0, "failed": 0, "dead": 0, "stale": 0}
        for w in self.workers:
            for k in out:
                out[k] += w.stats.get(k, 0)
        return out


def engine_options(spec: JobSpec, *, base_url: str | None, rate: float, concurrency: int, model: str | None,
                   style: str, api_key_env: str | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The openai engine's options for one pool thread (its share of the concurrency)."""
    if style not in STYLES:
        raise FallbackRefused(f"--style must be one of {', '.join(STYLES)}, got {style!r}")
    url = base_url or spec.fallback.base_url
    if not url:
        raise FallbackRefused("no fallback endpoint: give --base-url / base_url, or set fallback.base_url in the spec")
    opts: dict[str, Any] = {"base_url": url, "response_format_style": style, "concurrency": concurrency,
                            "rate_limit": rate}
    if model:
        opts["model"] = model
    if api_key_env:
        opts["api_key_env"] = api_key_env
    opts.update(extra or {})
    return opts


def tier_plan(spec: JobSpec, options: dict[str, Any], *, rate: float, concurrency: int, remaining: int,
              deadline: datetime | None) -> Any:
    """The pool's ``tiers.TierPlan`` for a spec with ``fallback.tiers`` (None without): the deadline less
    what the publish needs after the re-drive (``cutoff.PAGE_RESERVE_SHARE`` of ``fallback.overhead_s``)."""
    if not spec.fallback.tiers:
        return None
    from batch_inference.tiers import TierPlan

    return TierPlan(spec.fallback.tiers, base_url=options["base_url"], options=options, concurrency=concurrency,
                    remaining=remaining, deadline=None if deadline is None else deadline.timestamp(),
                    reserve_s=spec.fallback.overhead_s * PAGE_RESERVE_SHARE, default_rate=rate)


def run_fallback(db_url: str | None, job_version: str, base_url: str | None = None, *, rate: float | None = None,
                 concurrency: int | None = None, model: str | None = None, style: str | None = None,
                 hosted: bool | None = None, api_key_env: str | None = None, parallel_shards: int = 4,
                 lease_seconds: int | None = None, record_run: bool = True,
                 extra_engine_options: dict[str, Any] | None = None,
                 pool_ready: Any = None, on_page: Callable[[str], Any] | None = None,
                 deadline: datetime | None = None) -> FallbackResult:
    """Re-drive every outstanding record of a job through the synchronous pool.

    ``rate`` (requests/s, retries included) and ``concurrency`` default to the
    spec's ``fallback`` block, and so do ``base_url``, ``hosted`` and ``style``
    (``fallback.response_format_style``).
    ``parallel_shards`` is how many shards the pool holds at once. If records
    are outstanding and the job is still in batch mode, the job is put into
    fallback mode first, because running the pool means the cutoff has fired.
    If nothing is outstanding it returns at once and records no run.
    ``pool_ready(pool)`` is called with the pool before it starts, so a caller
    (an operator's ``on_kill``) can stop it. With ``fallback.tiers`` each request
    goes at the cheapest tier whose measured rate still finishes by ``deadline``
    (``batch_inference.tiers``; no deadline: the cheapest); ``result.tiers`` says
    what each tier answered and refused.

    With ``cost.budget`` set, the bill so far plus every outstanding row at
    ``cost.fallback_per_row`` (with ``fallback.tiers``: at the last tier's price, and the pool then spends
    the rest of the budget row by row at the tier each goes to, ``tiers.TierAllowance``) is checked
    first (:func:`budget_check`). Over it,
    ``on_page(text)`` is called once, before the pool starts, with the page (the
    arithmetic in one line; also ``result.budget_page``); with ``on_budget:
    page`` the pool re-drives at most the rows the rest of the budget affords
    and stops: ``result.budget_stop``, records left pending with no attempt
    spent, so validate refuses the job (``NotReady``) and it cannot be
    published (I3). That is a result, not an exception.

    Raises :class:`FallbackRefused` (one line) before any request when the
    record class is not cleared for a hosted endpoint or the configuration is
    unusable, and :class:`FallbackEndpointUnavailable` (one line) when the
    endpoint failed most requests: the pool stopped, its shards are released
    and the records left pending with no attempts spent.
    """
    from batch_inference.engines import load_engine

    with db.connect(db_url) as conn:
        job = conn.execute(db.q("cutoff_job"), {"job": job_version}).fetchone()
        if job is None:
            raise UnknownJob(f"no job version {job_version!r}")
        spec = stored_spec(job["spec"])
        url = base_url or spec.fallback.base_url
        is_hosted = check_hosted(spec, job_version, url, hosted)
        rate = float(rate if rate is not None else spec.fallback.rate)
        concurrency = int(concurrency if concurrency is not None else spec.fallback.concurrency)
        if not rate > 0 or not math.isfinite(rate):
            raise FallbackRefused(f"rate must be a positive number of requests/s, got {rate!r}")
        if concurrency < 1 or parallel_shards < 1:
            raise FallbackRefused("concurrency and parallel_shards must be at least 1")

        result = FallbackResult(job_version=job_version, endpoint=public_url(url) if url else None)
        counts = job_counts(conn, job_version)
        if job["status"] != "running":
            result.skipped = f"job is {job['status']}"
            log.info("fallback %s: the job is %s; nothing for the fallback to do", job_version, job["status"])
            return result
        if counts["outstanding"] == 0:
            result.skipped = "nothing outstanding"
            log.info("fallback %s: not needed, every record is done (%d stored, %d dead letters)",
                     job_version, counts["stored"], counts["dead_letters"])
            return result

        open_shards = counts["shards"]["pending"] + counts["shards"]["leased"]
        workers = max(1, min(parallel_shards, open_shards, concurrency))
        per_worker = max(1, concurrency // workers)
        style = style or spec.fallback.response_format_style
        opts = engine_options(spec, base_url=url, rate=rate, concurrency=per_worker, model=model, style=style,
                              api_key_env=api_key_env, extra=extra_engine_options)
        engine = "openai"
        if spec.fallback.tiers:       # price tiers: each request at the cheapest tier that still finishes
            from batch_inference.tiers import TIERED_ENGINE

            engine = TIERED_ENGINE
        try:
            load_engine(engine, spec, opts)  # a misspelt option fails here, before the mode changes
        except (ValueError, ImportError) as exc:
            raise FallbackRefused(f"engine 'openai': {exc}") from None
        check = budget_check(conn, job_version, spec, counts)
        budget_left = None
        if check is not None and check.over:
            result.budget_page, result.allowance = check.page(job_version), check.allowance
            budget_left = check.money_left

        if job["mode"] != "fallback":
            result.entered_fallback = enter_fallback(conn, job_version)
            log.warning("fallback %s: job was in batch mode; entered fallback mode (batch workers drain)",
                        job_version)
        leases = {r["transport"]: int(r["n"]) for r in conn.execute(db.q("leases_by_transport"), {"job": job_version})}
        draining = sum(n for transport, n in leases.items() if transport != "fallback")
        log.info("fallback %s: %d outstanding in %d open shards (%d still leased by draining batch or hosted "
                 "batch workers); "
                 "pool of %d worker(s) x %d in flight = %d, %.4g requests/s, %s endpoint %s (%s)", job_version,
                 counts["outstanding"], open_shards, draining, workers, per_worker, workers * per_worker,
                 rate, "hosted" if is_hosted else "in-house", public_url(url), style)

    if result.budget_page is not None:
        log.error("fallback %s: PAGE (budget): %s", job_version, result.budget_page)
        if on_page is not None:
            on_page(result.budget_page)
    if result.allowance == 0:
        # The budget is spent already: not one request. The cutoff still put the job in fallback mode.
        result.budget_stop, result.stopped, result.outstanding = True, True, int(counts["outstanding"])
        return result
    plan = tier_plan(spec, opts, rate=rate, concurrency=workers * per_worker, remaining=int(counts["outstanding"]),
                     deadline=deadline)
    pool = FallbackPool(db_url, job_version, options=opts, rate=rate, workers=workers, lease_seconds=lease_seconds,
                        allowance=result.allowance, engine=engine, plan=plan, budget_left=budget_left)
    if pool_ready is not None:
        pool_ready(pool)
    t0 = time.monotonic()
    codes = pool.run()
    stats = pool.stats()
    result.workers = workers
    result.stored, result.dead, result.failed_attempts = stats["stored"], stats["dead"], stats["failed"]
    result.records = stats["stored"] + stats["dead"]
    result.shards = stats["shards"]
    result.busy_s = pool.busy.total
    result.stopped = pool.stopped.is_set()
    result.tiers = plan.summary() if plan is not None else None

    with db.connect(db_url) as conn:
        after = job_counts(conn, job_version)
        job = conn.execute(db.q("cutoff_job"), {"job": job_version}).fetchone()
        result.outstanding = int(after["outstanding"])
        result.budget_stop = pool.allowance is not None and pool.allowance.spent and result.outstanding > 0
        fired_at: datetime | None = job["fallback_at"] if job else None
        finished_at: datetime = job["db_now"] if job else None
        # The database's clock on both ends, so a skewed Airflow worker
        # cannot shorten the overhead.
        result.wall_s = (finished_at - fired_at).total_seconds() if fired_at and finished_at else \
            time.monotonic() - t0
        down = pool.breaker.tripped
        if down is not None:
            msg = down.describe("fallback")
            log.error("fallback %s: %s (%d outstanding)", job_version, msg, result.outstanding)
            raise FallbackEndpointUnavailable(msg)
        bad = [c for c in codes if c not in (0, 143)]
        if result.outstanding > 0 or bad:
            why = (f" (stopped at the budget after {pool.allowance.taken} row(s))" if result.budget_stop
                   else " (stopped)" if result.stopped else "")
            msg = (f"fallback {job_version}: pool stopped with {result.outstanding} record(s) outstanding{why}; "
                   f"worker exit codes {codes}")
            log.error("%s", msg)
            if not result.stopped:
                raise FallbackIncomplete(msg)
            return result
        if result.records > 0 and result.busy_s > 0:
            result.rate = result.records / result.busy_s
            result.overhead_s = max(0.0, result.wall_s - result.busy_s)
            if record_run and fired_at is not None:
                # The re-drive and the drain are recorded as measured parts;
                # publish adds the load (add_load_time).
                r = conn.execute(db.q("fallback_run_insert"), {
                    "job": job_version, "dataset": job["dataset"], "started_at": fired_at,
                    "finished_at": finished_at, "records": result.records, "rate": result.rate,
                    "overhead_s": result.overhead_s, "busy_s": result.busy_s}).fetchone()
                result.fallback_run_id = int(r["id"])
    log.info("fallback %s: re-drove %d record(s) (%d stored, %d dead letters, %d failed attempts) over %d "
             "shard(s); sustained %.3g records/s over %.1f s busy; %.1f s from the cutoff firing to nothing "
             "outstanding, overhead %.1f s%s", job_version, result.records, result.stored, result.dead,
             result.failed_attempts, result.shards, result.rate or 0.0, result.busy_s, result.wall_s,
             result.overhead_s or 0.0,
             f"; recorded as fallback run {result.fallback_run_id}" if result.fallback_run_id else "")
    return result

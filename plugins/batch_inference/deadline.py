"""The cutoff watch: poll a job's counts, record progress, decide.

This is the loop ``CutoffTrigger`` runs in Airflow's triggerer. The CLI
(``batch-inference fallback --deadline``) runs the same loop, so both
decide with the same code. It is written against ``psycopg.AsyncConnection``
because a triggerer runs every trigger of the deployment on one event loop.
A blocking call here would stall all the others, so every database call is
awaited and nothing else does I/O.

Each poll:

1. reads the job's counts from the shard table (``bi.job_counts_v1`` sums
   per-shard counters, so a poll costs the same for a thousand records or
   fifty million);
2. evaluates the moving cutoff (:func:`batch_inference.cutoff.decide`) and,
   once, the early warning (:func:`batch_inference.cutoff.early_warning`);
3. writes a progress sample to ``bi.progress`` (the burn-down chart and the
   cutoff's history);
4. logs done / outstanding / cutoff on one line.

It ends with one of four outcomes, returned as a JSON-safe dict (the
trigger event's payload):

* ``complete``: nothing outstanding, so there is nothing to re-drive.
* ``cutoff``: now >= the latest safe start (the moving cutoff), or the fixed
  relabel time has come (always-re-drive mode), or the job is already in
  fallback mode.
* ``early_warning``: the batch's throughput so far projects it to finish
  after the cutoff fires. A trigger can only end with an event, so the
  caller notifies and starts watching again with ``warned=True``.
* ``error``: the job does not exist, or the database stayed unreachable
  until the deadline passed.
* ``budget``: the autopilot (``spec.autopilot.enabled``, which runs at every
  poll and writes the fleet's desired size) found that meeting the deadline
  would cost more than ``cost.budget``; or, where it does not steer, a fixed
  fleet stopped at the budget or a hosted batch transport's rows held back by
  it (``budget_page``). The payload's ``reason`` is the page, arithmetic
  included. Sent once per run (``paged=True`` after it), as the early warning is.
* ``halted``: the job's workers recorded a fatal failure (``bi.halt_job_v1``:
  wrong weights, an unusable engine) after ``since``, the DAG run's queued
  time; the run cannot succeed, so the watch ends at once.

Rate and overhead are the spec's unless the dataset's ``bi.fallback_runs``
say otherwise: ``spec.fallback.min_history_runs`` complete runs may relax
them, fewer or partial runs only tighten them (``derive_rate_and_overhead``).
An explicit override beats both. The first poll logs which was used and why.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any

import psycopg
from psycopg.rows import dict_row

from batch_inference import autopilot, db
from batch_inference.autopilot import Throughput
from batch_inference.cost import Prices, job_bill
from batch_inference.cutoff import (
    CutoffDecision,
    DerivedConstants,
    EarlyWarning,
    DEFAULT_MIN_HISTORY_RUNS,
    FallbackRun,
    decide,
    derive_rate_and_overhead,
    history_params,
    early_warning,
    projected_finish,
)
from batch_inference.exceptions import InvalidValue
from batch_inference.spec import JobSpec, stored_spec
from batch_inference.hosted.counts import with_hosted
from batch_inference.status import JobCounts, UnknownJob, counts_from_row

log = logging.getLogger("batch_inference.deadline")

UTC = timezone.utc
COMPLETE, CUTOFF, EARLY_WARNING, ERROR, WAIT = "complete", "cutoff", "early_warning", "error", "wait"
BUDGET = "budget"  # the autopilot's page: meeting the deadline would cost more than cost.budget
HALTED = "halted"  # the job's workers recorded that they cannot work (bi.halt_job_v1): the run cannot succeed


def utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class WatchConfig:
    """What to watch and against what. These are the trigger's serialized fields, with no secrets."""

    job_version: str
    deadline: datetime
    poll_interval_s: float = 60.0
    rate: float | None = None  # override; None: history, else the spec
    overhead_s: float | None = None  # override; None: history, else the spec
    relabel_at: datetime | None = None  # always-re-drive: fire at this time whatever the counts
    warned: bool = False  # the early warning was already sent for this run
    step_s: int = 60  # latest_safe_start is floored to this many seconds
    since: datetime | None = None  # halts recorded before this (the DAG run's queued time) are ignored
    paged: bool = False  # the autopilot's budget page was already sent for this run

    def __post_init__(self) -> None:
        if self.since is not None and self.since.tzinfo is None:
            object.__setattr__(self, "since", self.since.replace(tzinfo=UTC))
        if self.deadline.tzinfo is None:
            object.__setattr__(self, "deadline", self.deadline.replace(tzinfo=UTC))
        if self.relabel_at is not None and self.relabel_at.tzinfo is None:
            object.__setattr__(self, "relabel_at", self.relabel_at.replace(tzinfo=UTC))
        if not self.poll_interval_s > 0:
            raise InvalidValue(f"poll interval must be positive, got {self.poll_interval_s!r}")


@dataclass(frozen=True)
class JobContext:
    """What a watch reads once: the job's spec, its prices and the constants in force."""

    job_version: str
    dataset: str
    spec: JobSpec
    constants: DerivedConstants
    prices: Prices


# -- database reads and writes (async) --------------------------------------


async def _one(aconn: psycopg.AsyncConnection, name: str, params: dict[str, Any]) -> dict[str, Any] | None:
    cur = await aconn.execute(db.q(name), params)
    return await cur.fetchone()


async def poll_counts(aconn: psycopg.AsyncConnection, job_version: str) -> JobCounts:
    """The job's live counts from the shard table's counters (``bi.job_counts_v1``):
    :func:`batch_inference.status.job_counts` without blocking the loop. Raises
    :class:`UnknownJob` for a missing job. Outstanding leaves out what hosted batches in
    flight have succeeded at the provider (``hosted.counts``); ``region_held`` is what far
    workers of a version placed over regions hold done (bi.region_held_v1)."""
    counts = counts_from_row(job_version, await _one(aconn, "job_counts", {"job": job_version}))
    counts = with_hosted(counts, await _one(aconn, "hosted_counts", {"job": job_version}))
    # What far workers of a placed version have done and hold (regions: stored when their shard's file is
    # merged): the cutoff counts them done (``evaluate``).
    held = await _one(aconn, "region_held", {"job": job_version})
    return {**counts, "region_held": min(int(held["held"]) if held else 0, int(counts["outstanding"]))}


async def fallback_history(aconn: psycopg.AsyncConnection, dataset: str, n: int,
                           min_runs: int = DEFAULT_MIN_HISTORY_RUNS) -> list[FallbackRun]:
    """The dataset's last ``n`` fallback runs and its last ``max(n, min_runs)`` complete ones."""
    if n <= 0:
        return []
    cur = await aconn.execute(db.q("fallback_history"), history_params(dataset, n, min_runs))
    return [FallbackRun.from_row(r) for r in await cur.fetchall()]


def choose_constants(spec: JobSpec, history: list[FallbackRun], rate: float | None,
                     overhead_s: float | None, step_s: float = 60.0) -> DerivedConstants:
    """History over the spec's constants; an explicit override over both. Measured
    overheads are rounded up to ``step_s``, the cutoff's own step."""
    derived = derive_rate_and_overhead(history, default_rate=spec.fallback.rate,
                                       default_overhead=spec.fallback.overhead_s, n=spec.fallback.history_runs,
                                       min_runs=spec.fallback.min_history_runs, step_s=step_s)
    if rate is None and overhead_s is None:
        return derived
    parts = []
    if rate is not None:
        parts.append(f"rate {float(rate):g}/s given")
    if overhead_s is not None:
        parts.append(f"overhead {float(overhead_s):,.0f} s given")
    return replace(derived, rate=float(rate) if rate is not None else derived.rate,
                   overhead_s=float(overhead_s) if overhead_s is not None else derived.overhead_s,
                   source="override: " + "; ".join(parts) + f" (otherwise {derived.source})")


async def load_context(aconn: psycopg.AsyncConnection, cfg: WatchConfig) -> JobContext:
    job = await _one(aconn, "cutoff_job", {"job": cfg.job_version})
    if job is None:
        raise UnknownJob(f"no job version {cfg.job_version!r}")
    spec = stored_spec(job["spec"])
    history = await fallback_history(aconn, job["dataset"], spec.fallback.history_runs,
                                     spec.fallback.min_history_runs)
    return JobContext(job_version=cfg.job_version, dataset=job["dataset"], spec=spec,
                      constants=choose_constants(spec, history, cfg.rate, cfg.overhead_s, cfg.step_s),
                      prices=Prices.from_spec(spec))


async def steer_fleet(aconn: psycopg.AsyncConnection, cfg: WatchConfig, ctx: JobContext, counts: dict[str, Any],
                      d: CutoffDecision, pilot: Throughput, logger: Any = log) -> dict[str, Any] | None:
    """The autopilot's poll (``batch_inference.autopilot``): measure one worker's throughput,
    decide the fleet's size against the deadline and the budget, record the decision (and a
    change of size as the desired size the launchers reconcile to). Returns the decision; None
    before a launcher has said what it runs (there is nothing to steer yet)."""
    state = await _one(aconn, "fleet_size", {"job": cfg.job_version})
    seen = await _one(aconn, "fleet_running", {"job": cfg.job_version})
    if state is None and not seen["launchers"]:
        return None
    gpu = await _one(aconn, "fleet_gpu_seconds", {"job": cfg.job_version})
    policy = autopilot.Policy.from_spec(ctx.spec)
    current = int(state["desired"]) if state else (int(seen["running"]) if seen["launchers"] else policy.min_workers)
    running = int(seen["running"]) if seen["launchers"] else current
    per_worker = pilot.add(d.now.timestamp(), int(counts["stored_batch"]), running)
    spent, _ = job_bill(counts, ctx.prices, gpu_hours=float(gpu["worker_seconds"]) / 3600.0)
    decision = autopilot.decide(d.now, cfg.deadline, d.outstanding, per_worker, current, ctx.constants.rate,
                                ctx.constants.overhead_s, policy, ctx.prices, spent.total,
                                last_change=state["decided_at"] if state else counts.get("first_claim_at"),
                                shards_left=int(counts["shards"].get("pending", 0)) + int(counts["shards"].get("leased", 0)),
                                steady=pilot.steady, last_action=state["action"] if state else None)
    await aconn.execute(db.q("fleet_decide"), decision.params(cfg.job_version))
    if decision.action != autopilot.HOLD or decision.page:
        logger.warning("autopilot of %s: %s %d -> %d worker(s): %s%s", cfg.job_version, decision.action,
                       decision.current, decision.desired, decision.reason,
                       f"; PAGE: {decision.page}" if decision.page else "")
    return decision.to_dict()


def conninfo_of(aconn: psycopg.AsyncConnection) -> str:
    """The watch's own connection string (its password included), for the regions' autopilot's sync calls."""
    from psycopg.conninfo import make_conninfo

    password = aconn.info.password
    return make_conninfo(aconn.info.dsn, **({"password": password} if password else {}))


def cluster_pilot(conninfo: str, cfg: WatchConfig, ctx: JobContext) -> Any:
    """The autopilot over every cluster (``regions.ClusterPilot``) of a version placed over several; None for a
    version on one cluster or none (the single fleet's autopilot, ``steer_fleet``). Sync: run in a thread."""
    from batch_inference.regions import ClusterPilot

    with _sync(conninfo) as conn:
        return ClusterPilot.for_job(conn, cfg.job_version, autopilot.Policy.from_spec(ctx.spec),
                                    ctx.constants.overhead_s, shard_s=600.0)


def steer_clusters(conninfo: str, cfg: WatchConfig, pilot: Any, now: datetime) -> dict[str, Any]:
    """One poll of the autopilot over every cluster: regions found lost, each cluster's size decided and
    recorded (bi.fleet_decisions per cluster, bi.fleet_cluster_size), the steal gates set. Sync: run in a
    thread."""
    with _sync(conninfo) as conn:
        return pilot.steer(conn, cfg.job_version, now, cfg.deadline).to_dict()


def _sync(conninfo: str) -> psycopg.Connection:
    """A sync connection for the regions' autopilot; one that cannot be made is the watch's own database
    error (it reconnects with back-off)."""
    try:
        return db.connect(conninfo, retries=0)
    except db.DatabaseUnavailable as exc:
        raise psycopg.OperationalError(str(exc)) from exc


async def budget_page(aconn: psycopg.AsyncConnection, cfg: WatchConfig, ctx: JobContext, counts: dict[str, Any],
                      d: CutoffDecision, logger: Any = log) -> str | None:
    """``cost.budget`` where the autopilot does not steer: a hosted batch transport's rows (the workers
    send the provider no more than the budget affords, ``hosted.budget``: the page gives that
    arithmetic), or a fixed fleet of GPU workers, stopped as the autopilot stops one
    (``autopilot.stop_at_budget``: the desired size 0 its launchers reconcile to). The page, or None."""
    if autopilot.hosted(ctx.spec):
        from batch_inference.hosted.budget import hosted_budget

        spend = await _one(aconn, "hosted_spend", {"job": cfg.job_version, "lock": False})
        # The ledger's outstanding: the cutoff's leaves out what the provider has succeeded.
        ledger_counts = {**counts, "outstanding": int(counts["outstanding"]) + int(counts.get("hosted_succeeded", 0))}
        check = hosted_budget(ctx.spec, ledger_counts, spend, ctx.prices)
        return check.page(cfg.job_version) if check is not None and check.over else None
    state = await _one(aconn, "fleet_size", {"job": cfg.job_version})
    seen = await _one(aconn, "fleet_running", {"job": cfg.job_version})
    if state is not None and int(state["desired"]) == 0:
        return state["reason"]      # stopped already: its page (sent once a run, at a poll that waits)
    if not seen["launchers"]:
        return None                 # nothing runs yet
    gpu = await _one(aconn, "fleet_gpu_seconds", {"job": cfg.job_version})
    spent, _ = job_bill(counts, ctx.prices, gpu_hours=float(gpu["worker_seconds"]) / 3600.0)
    policy, running = autopilot.Policy.from_spec(ctx.spec), int(seen["running"])
    decision = autopilot.stop_at_budget(d.now, running, None, policy, ctx.prices, spent.total)
    if decision is None:
        # on_budget spend: the fixed fleet runs on past the budget, said once.
        return (f"spending past the budget with the fixed fleet (on_budget: spend): "
                f"{autopilot.drain_sum(running, policy, spent.total)}"
                if autopilot.drain_over(running, policy, ctx.prices, spent.total) else None)
    await aconn.execute(db.q("fleet_decide"), decision.params(cfg.job_version))
    logger.warning("budget of %s: the fixed fleet stops, %d -> 0 worker(s): %s", cfg.job_version, decision.current,
                   decision.reason)
    return decision.page


async def record_progress(aconn: psycopg.AsyncConnection, job_version: str, counts: dict[str, Any],
                          decision: CutoffDecision) -> None:
    await aconn.execute(db.q("progress_insert"), {
        "job": job_version, "stored": counts["stored"], "dead_letters": counts["dead_letters"],
        "outstanding": counts["outstanding"], "latest_safe_start": decision.latest_safe_start,
        "deadline": decision.deadline})


# -- the decision (pure) ----------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    status: str  # complete | cutoff | early_warning | wait
    reason: str
    decision: CutoffDecision
    counts: dict[str, Any]
    warning: EarlyWarning | None = None
    relabel_at: datetime | None = None

    @property
    def sleep_hint_s(self) -> float:
        """Seconds until the earliest moment the verdict could change by the clock alone."""
        s = self.decision.seconds_to_cutoff
        if self.relabel_at is not None:
            s = min(s, (self.relabel_at - self.decision.now).total_seconds())
        return max(0.0, s)

    def payload(self, ctx: JobContext, cfg: WatchConfig, polls: int) -> dict[str, Any]:
        c = self.counts
        return {
            "status": self.status,
            "reason": self.reason,
            "job_version": ctx.job_version,
            "dataset": ctx.dataset,
            "polls": polls,
            "message": self.decision.log_line(ctx.job_version),
            "decision": self.decision.to_dict(),
            "counts": {k: int(c[k]) for k in ("records", "stored", "stored_batch", "stored_fallback", "reused",
                                              "dead_letters", "outstanding")} | {
                "mode": c["mode"], "status": c["status"], "shards": dict(c["shards"])},
            "constants": {"rate": ctx.constants.rate, "overhead_s": ctx.constants.overhead_s,
                          "source": ctx.constants.source},
            "relabel_at": self.relabel_at.isoformat() if self.relabel_at else None,
            "warning": self.warning.to_dict() if self.warning else None,
            "watch": watch_kwargs(cfg),
        }


def evaluate(cfg: WatchConfig, ctx: JobContext, counts: dict[str, Any], now: datetime) -> Verdict:
    """One poll's decision from the counts; no I/O."""
    k = ctx.constants
    done = int(counts["stored_batch"]) + int(counts["stored_fallback"])
    outstanding = int(counts["outstanding"])
    # Results far workers hold done are no work for the fallback: a drained worker writes them straight to the
    # ledger, a lease that runs out takes them off the count. The job is complete only once they are stored.
    held = min(int(counts.get("region_held", 0)), outstanding)
    d = decide(now, cfg.deadline, outstanding - held, k.rate, k.overhead_s, done=done + held, step_s=cfg.step_s)
    if held:
        d = replace(d, complete=False)
    v = lambda status, reason, warning=None: Verdict(status, reason, d, counts, warning, cfg.relabel_at)  # noqa: E731
    if d.complete:
        return v(COMPLETE, "nothing outstanding")
    if counts.get("mode") == "fallback":
        # Someone (a previous try of this task, the CLI) already fired it:
        # the workers are draining, so say so rather than wait.
        return v(CUTOFF, "the job is already in fallback mode")
    if cfg.relabel_at is not None:
        if d.now >= cfg.relabel_at:
            return v(CUTOFF, f"relabel mode: the fixed re-drive time {cfg.relabel_at:%H:%M:%S} has come")
        if d.fire:
            # The fixed time was set later than this night's cutoff, so the moving
            # cutoff wins and the deadline still holds.
            return v(CUTOFF, f"moving cutoff {d.latest_safe_start:%H:%M:%S} came before the relabel time "
                             f"{cfg.relabel_at:%H:%M:%S} (set the relabel time earlier)")
        return v(WAIT, f"relabel mode: waiting for {cfg.relabel_at:%H:%M:%S}")
    if d.fire:
        return v(CUTOFF, f"moving cutoff: now >= latest safe start {d.latest_safe_start:%H:%M:%S}")
    if not cfg.warned:
        started = counts.get("first_claim_at")
        projection = projected_finish(started, now, done, done + outstanding) if started else None
        w = early_warning(now, cfg.deadline, projection, d, ctx.prices)
        if w is not None:
            return v(EARLY_WARNING, w.message, w)
    return v(WAIT, f"{d.seconds_to_cutoff:,.0f} s to the cutoff")


# -- the loop ---------------------------------------------------------------


def watch_kwargs(cfg: WatchConfig) -> dict[str, Any]:
    """The config as JSON-safe keyword arguments (the trigger's ``serialize()`` form)."""
    return {
        "job_version": cfg.job_version,
        "deadline": cfg.deadline.isoformat(),
        "poll_interval": cfg.poll_interval_s,
        "rate": cfg.rate,
        "overhead_s": cfg.overhead_s,
        "relabel_at": cfg.relabel_at.isoformat() if cfg.relabel_at else None,
        "warned": cfg.warned,
        "step_s": cfg.step_s,
        "since": cfg.since.isoformat() if cfg.since else None,
        "paged": cfg.paged,
    }


def error_payload(cfg: WatchConfig, message: str, polls: int = 0) -> dict[str, Any]:
    return {"status": ERROR, "reason": message, "message": message, "job_version": cfg.job_version,
            "polls": polls, "watch": watch_kwargs(cfg)}


async def connect_async(conninfo: str, application_name: str = "batch-inference-cutoff") -> psycopg.AsyncConnection:
    return await psycopg.AsyncConnection.connect(db.usable_url(conninfo), autocommit=True, row_factory=dict_row,
                                                 application_name=application_name, connect_timeout=10,
                                                 prepare_threshold=db.PREPARE_THRESHOLD)


async def watch(connect: Callable[[], Awaitable[psycopg.AsyncConnection]], cfg: WatchConfig, *,
                now: Callable[[], datetime] = utcnow, sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
                logger: logging.Logger | logging.LoggerAdapter | Any = log,
                max_polls: int | None = None) -> dict[str, Any]:
    """Poll until complete, cutoff, early warning or error; return the event payload.

    ``connect()`` opens an async connection. A lost connection is reopened
    with back-off: a database restart in the night must not end the watch.
    If the database stays unreachable past the deadline, the watch ends with
    ``error`` so that the task fails loudly instead of waiting for ever.
    Sleeps are cut short so that a poll falls on the cutoff or the relabel
    time instead of up to one interval after it.
    """
    await asyncio.to_thread(db.queries)  # read the named statements off the loop, once per process
    conn: psycopg.AsyncConnection | None = None
    ctx: JobContext | None = None
    polls = failures = 0
    pilot: Throughput | None = None
    clusters: Any = None        # the regions' autopilot of a version placed over several clusters (False: none)
    decision: dict[str, Any] | None = None
    try:
        while True:
            try:
                if conn is None:
                    conn = await connect()
                    await conn.execute(db.q("listen_halts"))
                    await conn.execute(db.q("listen_done"))
                if ctx is None:
                    ctx = await load_context(conn, cfg)
                    logger.info("cutoff watch of %s (dataset %s), deadline %s%s: %s", cfg.job_version, ctx.dataset,
                                cfg.deadline.isoformat(),
                                f", relabel mode at {cfg.relabel_at.isoformat()}" if cfg.relabel_at else "",
                                ctx.constants.source)
                counts = await poll_counts(conn, cfg.job_version)
                halt = await _one(conn, "job_halt", {"job": cfg.job_version})
                # A halt stands unless a later resubmit changed the settings (its cause fixed) or the run
                # began after it.
                if halt and halt["halted_at"] and not halt["resubmitted_after"] \
                        and (cfg.since is None or halt["halted_at"] >= cfg.since):
                    message = (f"the workers of {cfg.job_version} cannot work (halted at "
                               f"{halt['halted_at']:%H:%M:%S}): {halt['halt_reason']}")
                    logger.error("cutoff watch ends: %s", message)
                    return {**error_payload(cfg, message, polls), "status": HALTED}
                verdict = evaluate(cfg, ctx, counts, now())
                polls += 1
                await record_progress(conn, cfg.job_version, counts, verdict.decision)
                if autopilot.steers(ctx.spec) and verdict.status in (WAIT, EARLY_WARNING):
                    a = ctx.spec.autopilot
                    if clusters is None:
                        clusters = await asyncio.to_thread(cluster_pilot, conninfo_of(conn), cfg, ctx) or False
                    if clusters:
                        decision = await asyncio.to_thread(steer_clusters, conninfo_of(conn), cfg, clusters,
                                                           verdict.decision.now)
                    else:
                        pilot = pilot or Throughput(start_s=a.start_s, window_s=a.window_s)
                        decision = await steer_fleet(conn, cfg, ctx, counts, verdict.decision, pilot, logger)
                    if decision and decision.get("page") and not cfg.paged and verdict.status == WAIT:
                        verdict = replace(verdict, status=BUDGET, reason=decision["page"])
                elif verdict.status in (WAIT, EARLY_WARNING) and ctx.spec.cost.budget is not None:
                    # A fixed fleet stopped at the budget, or a hosted transport's rows held back by it.
                    page = await budget_page(conn, cfg, ctx, counts, verdict.decision, logger)
                    if page and not cfg.paged and verdict.status == WAIT:
                        verdict = replace(verdict, status=BUDGET, reason=page)
                failures = 0
            except UnknownJob as exc:
                return error_payload(cfg, str(exc), polls)
            except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
                failures += 1
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                if conn is not None:
                    try:
                        await conn.close()
                    except Exception:  # noqa: BLE001 - already broken
                        pass
                    conn = None
                if now() >= cfg.deadline:
                    return error_payload(cfg, f"database unreachable past the deadline: {first}", polls)
                wait = min(cfg.poll_interval_s, 2.0 ** min(failures, 6))
                logger.warning("cutoff watch of %s: database error (%s); retry %d in %.0f s", cfg.job_version,
                               first, failures, wait)
                await sleep(wait)
                continue

            line = verdict.decision.log_line(cfg.job_version)
            if verdict.status == EARLY_WARNING:
                logger.warning("%s; EARLY WARNING: %s", line, verdict.reason)
            elif verdict.status == CUTOFF:
                logger.warning("%s; %s", line, verdict.reason)
            else:
                logger.info("%s%s", line, f"; {verdict.reason}" if verdict.status == COMPLETE or cfg.relabel_at
                            else "")
            if verdict.status != WAIT or (max_polls is not None and polls >= max_polls):
                return verdict.payload(ctx, cfg, polls) | {"autopilot": decision}
            await pause(conn, cfg.job_version, min(cfg.poll_interval_s, max(0.01, verdict.sleep_hint_s + 0.001)),
                        sleep)
    finally:
        if conn is not None:
            await conn.close()


async def pause(conn: psycopg.AsyncConnection | None, job_version: str, seconds: float,
                sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep) -> None:
    """Wait ``seconds`` between polls; on the real clock a halt of ``job_version`` (``bi.halt_job_v1``
    notifies channel bi_halt) or its last shard done (``bi.complete_shard_v2`` notifies bi_done), both
    channels the watch listens on, ends the wait at once. A connection lost while listening (a database
    restart) ends the wait too: the next poll meets it and reconnects."""
    if sleep is not asyncio.sleep or conn is None:
        await sleep(seconds)
        return
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while (left := end - loop.time()) > 0:
        try:
            async for note in conn.notifies(timeout=left, stop_after=1):
                if note.payload == job_version:
                    return
        except (psycopg.OperationalError, psycopg.InterfaceError):
            return


def parse_iso(text: str | None) -> datetime | None:
    if text is None:
        return None
    dt = datetime.fromisoformat(text)
    return dt.replace(tzinfo=UTC) if dt.tzinfo is None else dt


def config_from_kwargs(job_version: str, deadline: str, poll_interval: float = 60.0, rate: float | None = None,
                       overhead_s: float | None = None, relabel_at: str | None = None, warned: bool = False,
                       step_s: int = 60, since: str | None = None, paged: bool = False) -> WatchConfig:
    """The inverse of :func:`watch_kwargs`."""
    d = parse_iso(deadline)
    if d is None:
        raise InvalidValue("a deadline is required")
    if rate is not None and not (math.isfinite(float(rate)) and float(rate) > 0):
        raise InvalidValue(f"rate must be a positive number of rows/s, got {rate!r}")
    if overhead_s is not None and not (math.isfinite(float(overhead_s)) and float(overhead_s) >= 0):
        raise InvalidValue(f"overhead_s must be a finite number >= 0, got {overhead_s!r}")
    return WatchConfig(job_version=job_version, deadline=d, poll_interval_s=float(poll_interval),
                       rate=None if rate is None else float(rate),
                       overhead_s=None if overhead_s is None else float(overhead_s),
                       relabel_at=parse_iso(relabel_at), warned=bool(warned), step_s=int(step_s),
                       since=parse_iso(since), paged=bool(paged))

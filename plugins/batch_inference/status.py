"""Read-only views of a job: live counts, its spec, shards and dead letters.

Counts come from the shard table's per-shard counters, so reading them costs
the same at a thousand records or fifty million (the cutoff polls this).
"""

from __future__ import annotations

import math
import time
from datetime import datetime
from typing import Any, TypedDict

import psycopg

from batch_inference.autopilot import gpu_hours
from batch_inference.cost import CostReport, Prices, job_bill, priced_by_rung
from batch_inference.db import q
from batch_inference.exceptions import UnknownJob
from batch_inference.spec import JobSpec, stored_spec


class ShardCounts(TypedDict):
    pending: int
    leased: int
    done: int


class JobCounts(TypedDict):
    """A job's live counts (``bi.job_counts_v1``), the one shape every reader returns:
    ``status`` (the CLI, the dashboard, the fallback pool) and ``deadline.poll_counts``
    (the cutoff, on the triggerer's loop). A dict, so it goes into JSON, XComs and
    trigger events as it is."""

    job_version: str
    records: int
    stored: int
    stored_batch: int
    stored_fallback: int
    reused: int
    dead_letters: int
    outstanding: int
    shards: ShardCounts
    mode: str
    status: str
    first_claim_at: datetime | None


def unknown_job(job_version: str) -> UnknownJob:
    """The refusal of a job version the ledger does not hold, with the way to one."""
    return UnknownJob(f"no job version {job_version!r} in this database: `batch-inference submit SPEC` creates one "
                      "and prints its id; pass that id (and the same --db) here and to `batch-inference status`")


class Progress:
    """A long run's progress in records: when a line is due (every ``every`` records or ``seconds``
    seconds, and at the end), its rate and the time left (``text``; ``total`` None: not known ahead,
    no time left). The worker's shard lines, and calibrate's and estimate's, are made with it."""

    def __init__(self, total: int | None, every: int = 500, seconds: float = 30.0):
        self.total, self.every, self.seconds = total, every, seconds
        self.done = self.last_done = 0
        self.t0 = self.last = time.monotonic()
        self.rate, self.eta = 0.0, math.inf

    def add(self, n: int) -> bool:
        """Count ``n`` more records done; True when a line is due (the rate and time left updated)."""
        self.done += n
        now = time.monotonic()
        if self.done - self.last_done < self.every and now - self.last < self.seconds \
                and (self.total is None or self.done < self.total):
            return False
        self.rate = self.done / max(now - self.t0, 1e-9)
        if self.total is not None:
            self.eta = (self.total - self.done) / self.rate if self.rate > 0 else math.inf
        self.last, self.last_done = now, self.done
        return True

    def text(self) -> str:
        if self.total is None:
            return f"{self.done}, {self.rate:.1f} records/s"
        return (f"{self.done}/{self.total} ({100 * self.done / max(self.total, 1):.0f}%), {self.rate:.1f} records/s, "
                f"ETA {duration(self.eta)}")


def duration(seconds: float) -> str:
    """A time left as the progress lines show it: 4m05s, 2h07m, ? when unknown."""
    if seconds == math.inf:
        return "?"
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def counts_from_row(job_version: str, row: dict[str, Any] | None) -> JobCounts:
    """``JobCounts`` from the ``job_counts`` query's row; UnknownJob when there is none."""
    if row is None:
        raise unknown_job(job_version)
    out = dict(row)
    out["job_version"] = job_version
    out["shards"] = {"pending": out.pop("shards_pending"), "leased": out.pop("shards_leased"),
                     "done": out.pop("shards_done")}
    return out  # type: ignore[return-value]


def job_counts(conn: psycopg.Connection, job_version: str) -> JobCounts:
    return counts_from_row(job_version, conn.execute(q("job_counts"), {"job": job_version}).fetchone())


def bill(conn: psycopg.Connection, job_version: str, prices: Prices | None = None,
         counts: JobCounts | None = None) -> tuple[CostReport, CostReport]:
    """The job's bill so far by transport, and if the fallback fired now (``cost.job_bill`` over the
    ledger: the counts, the hosted batches' reported usage, the launchers' GPU-hours). Prices default
    to the job's spec. What ``batch-inference cost``, the dashboard and the fallback's budget read."""
    counts = job_counts(conn, job_version) if counts is None else counts
    spec = job_spec(conn, job_version)
    prices = Prices.from_spec(spec) if prices is None else prices
    hosted = conn.execute(q("hosted_cost_rows"), {"job": job_version}).fetchone()
    so_far, fired = job_bill(counts, prices, hosted, gpu_hours=gpu_hours(conn, job_version),
                             regions=region_bill(conn, job_version))
    if spec.models:   # a model ladder: its rows cost what each rung answered times that rung's price
        rungs = rung_answers(conn, spec, job_version)
        so_far, fired = priced_by_rung(so_far, rungs), priced_by_rung(fired, rungs)
    if spec.fallback.tiers:   # price tiers: each fallback row so far at the tier that answered it (both bills)
        from batch_inference.tiers import priced_by_tier

        tier_rows = conn.execute(q("fallback_tier_rows"), {"job": job_version}).fetchall()
        so_far, fired = priced_by_tier(so_far, tier_rows, spec.fallback.tiers), \
            priced_by_tier(fired, tier_rows, spec.fallback.tiers)
    return so_far, fired


def region_bill(conn: psycopg.Connection, job_version: str) -> dict[str, Any]:
    """What placing the version over regions cost so far (the ``region_bill`` statement): replication
    bytes, seconds and dollars, steals and the merge's reads of far result files at the egress price;
    ``placed`` false for a version in one region."""
    return dict(conn.execute(q("region_bill"), {"job": job_version}).fetchone())


def rung_answers(conn: psycopg.Connection, spec: JobSpec, job_version: str) -> list[dict[str, Any]]:
    """What each rung of a model ladder answered in the job version (bi.ladder_answers) and its price:
    ``{rung, model, answered, answers, cost_per_row}``, ``answers`` counting every sample (the agreement
    rule asks a rung ``samples`` times a record). What ``bill`` prices the ladder's rows by
    (``cost.priced_by_rung``)."""
    counts = {r["rung"]: int(r["answered"]) for r in conn.execute(q("ladder_rung_counts"), {"job": job_version})}
    return [{"rung": no, "model": rung.model.name, "answered": counts.get(no, 0),
             "answers": counts.get(no, 0) * spec.rung_samples(no), "cost_per_row": rung.cost_per_row}
            for no, rung in enumerate(spec.models or (), 1)]


def shared_inputs(conn: psycopg.Connection, job_version: str) -> int:
    """Records stored with another record's result: the same rendered input in one shard, computed
    once (``bi.shared_inputs``, summed over the version's shards)."""
    return int(conn.execute(q("shared_inputs"), {"job": job_version}).fetchone()["n"])


def job_halt(conn: psycopg.Connection, job_version: str) -> dict[str, Any]:
    """When the version's workers last halted it and why (``bi.halt_job_v1``); both None if never.
    ``halt_cleared_at``: when the halt became a past one, the earlier of a resubmit that changed the
    version's settings after it (``bi.jobs.resubmitted_at``: its cause fixed) and the first work on the
    version after it (a worker claimed, renewed or finished a shard; a DAG run submitted it again);
    ``halt_cleared_by`` says which ('resubmit' or 'work'). Both None while it stands."""
    r = conn.execute(q("job_halt"), {"job": job_version}).fetchone()
    cleared = sorted((t, by) for t, by in ((r["resubmitted_after"], "resubmit"), (r["worked_after"], "work"))
                     if t is not None) if r else []
    return {"halted_at": r["halted_at"] if r else None, "halt_reason": r["halt_reason"] if r else None,
            "halt_cleared_at": cleared[0][0] if cleared else None,
            "halt_cleared_by": cleared[0][1] if cleared else None}


def job_spec(conn: psycopg.Connection, job_version: str) -> JobSpec:
    r = conn.execute(q("job_spec"), {"job": job_version}).fetchone()
    if r is None:
        raise unknown_job(job_version)
    return stored_spec(r["spec"])


def job_mode(conn: psycopg.Connection, job_version: str) -> tuple[str, str]:
    r = conn.execute(q("job_spec"), {"job": job_version}).fetchone()
    if r is None:
        raise unknown_job(job_version)
    return r["mode"], r["status"]


def shards(conn: psycopg.Connection, job_version: str) -> list[dict[str, Any]]:
    return conn.execute(q("shards_by_state"), {"job": job_version}).fetchall()


def dead_letters(conn: psycopg.Connection, job_version: str) -> list[dict[str, Any]]:
    return conn.execute(q("dead_letters"), {"job": job_version}).fetchall()


def fence_counts(conn: psycopg.Connection, job_version: str) -> dict[str, int]:
    return {r["op"]: int(r["n"]) for r in conn.execute(q("fence_counts"), {"job": job_version})}

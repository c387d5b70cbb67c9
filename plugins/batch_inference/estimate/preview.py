"""The preview: what a job will cost and when it will finish, read from its records, before any spend.

One pass over the source, read as the submit reads it (a PostgreSQL table or
query in SQL, in a read-only transaction through a server-side cursor; any
other kind through its ``sources`` reader), each record judged as the
snapshot judges it (empty, over ``max_input_chars``, broken text: a dead
letter at planning, never sent), rendered as the worker renders it
(``prompting.build_messages``) and counted by the pinned model's tokenizer
(``estimate.tokens``). Memory is bounded: a histogram of per-record counts
(exact percentiles), the running shared prefix, and the pilot's reservoir
sample when one is drawn. Nothing is written.

The figures that are not counted are measured: records/s of one worker,
output tokens a record and the valid-answer rate come from the newest pilot
of the same pinned model and engine (``bi.estimate_pilots``), else from the
newest runs of the same model in the ledger, else there is no measured rate
and the preview says so (and projects no finish). The bill is
``cost.cost_report`` over the spec's own prices; the finish and the cutoff
are ``cutoff.latest_safe_start`` over the spec's fallback rate and overhead.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections import Counter as Histogram
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import psycopg
from psycopg import sql

from batch_inference import sources
from batch_inference.cost import CostReport, Prices, cents, cost_report, priced_by_rung
from batch_inference.cutoff import PAGE_RESERVE_SHARE, fallback_seconds, latest_safe_start
from batch_inference.db import q
from batch_inference.estimate.tokens import Counter, counter_for
from batch_inference.exceptions import InvalidValue, SnapshotError
from batch_inference.prompting import build_messages
from batch_inference.snapshot import clean_text, null_ids_error, source_errors
from batch_inference.sources import postgres as postgres_source
from batch_inference.spec import JobSpec
from batch_inference.status import Progress
from batch_inference.tiers import priced_by_tier, projected_split

BLANK = " \t\n\r\f\x0b"   # btrim's set: the snapshot's "empty text"
RECENT_RUNS = 5            # job versions of the same model read for a measured rate
MIN_RECENT_ROWS = 20       # a run with fewer batch results measures nothing
OUTPUT_SAMPLE = 200        # stored answers re-tokenized for output tokens a record
FETCH = 2_000              # rows a server-side cursor fetches at once

VERDICTS = ("go", "over_budget", "misses_deadline")
# A progress line every this many records read or seconds (status.Progress): a large source takes minutes.
PROGRESS_EVERY = 100_000
PROGRESS_SECONDS = 30.0

log = logging.getLogger("batch_inference.estimate")


# -- reading the source -----------------------------------------------------------


def source_rows(conn: psycopg.Connection, spec: JobSpec, reader: sources.Reader | None = None
                ) -> Iterator[Mapping[str, Any]]:
    """The records as the submit reads them, lazily: ``{record_id, text, acl[, reject]}``.

    A PostgreSQL table or query is read in a READ ONLY, REPEATABLE READ
    transaction through a server-side cursor: the preview cannot write, by
    the transaction, whatever the query calls. An unreadable source is one
    line (``SnapshotError``)."""
    if spec.source.kind == "postgres":
        yield from _postgres_rows(conn, spec)
        return
    reader = reader or sources.for_spec(spec)
    if reader.ledger is None:
        reader.ledger = conn
    try:
        reader.check()
        rows = reader.rows()
        if rows is None:
            raise SnapshotError(f"source {spec.source.label}: this reader gives no rows to preview")
        yield from rows
    finally:
        reader.close()


def _postgres_rows(conn: psycopg.Connection, spec: JobSpec) -> Iterator[Mapping[str, Any]]:
    relation = postgres_source.source_relation(spec.source, spec.max_input_chars)
    name = spec.source.label
    with conn.transaction():
        conn.execute(q("repeatable_read"))
        conn.execute(q("read_only_transaction"))
        with source_errors(name, any_refusal=bool(spec.source.query)), \
                conn.cursor(name="bi_estimate_source") as cur:
            cur.itersize = FETCH
            cur.execute(sql.SQL(q("estimate_source_rows")).format(relation=relation))
            yield from cur


def judge(spec: JobSpec, row: Mapping[str, Any]) -> tuple[str, str | None]:
    """(the text a worker would get, the reason the snapshot dead-letters it at planning or None).

    As the snapshot judges a record (``snapshot_insert``): a reason given where it was read
    (a record of several columns), broken text (``clean_text``), empty text, then over
    ``max_input_chars`` (a record of several columns was judged whole where it was read)."""
    text, bad = clean_text(row.get("text"))
    reject = row.get("reject") or bad
    text = text or ""
    if reject is None and not text.strip(BLANK):
        reject = "empty text"
    if reject is None and not spec.source.columns and len(text) > spec.max_input_chars:
        reject = f"input over the length cap ({len(text)} characters > {spec.max_input_chars})"
    return text, reject


# -- counting -----------------------------------------------------------------


@dataclass
class TokenTally:
    """Per-record token counts in bounded memory: a histogram (exact percentiles) and the shared prefix."""

    records: int = 0
    total: int = 0
    hist: Histogram = field(default_factory=Histogram)
    prefix: list[int] | None = None

    def add(self, ids: list[int]) -> None:
        n = len(ids)
        self.records += 1
        self.total += n
        self.hist[n] += 1
        p = self.prefix
        if p is None:
            self.prefix = list(ids)
        elif ids[:len(p)] != p:
            k = 0
            for a, b in zip(p, ids):
                if a != b:
                    break
                k += 1
            del p[k:]

    def percentile(self, pct: float) -> int:
        """The smallest count at or above ``pct`` percent of the records (nearest rank)."""
        if not self.records:
            return 0
        rank = max(1, -(-self.records * pct // 100))
        seen = 0
        for n in sorted(self.hist):
            seen += self.hist[n]
            if seen >= rank:
                return n
        return max(self.hist)

    @property
    def shared_prefix(self) -> int:
        return len(self.prefix or ())


# -- measured rates --------------------------------------------------------------


@dataclass(frozen=True)
class Measured:
    """One worker's measured rate and what its answers were like, and where they were measured."""

    source: str                    # 'pilot' or 'recent runs'
    records_per_s: float           # one worker, once started
    output_tokens: float | None    # a stored answer's tokens, mean
    valid_rate: float | None       # valid answers over attempts
    detail: str
    startup_s: float = 0.0         # a worker's start-up before its first record (model load), paid once each


def pilot_figures(conn: psycopg.Connection, spec: JobSpec) -> dict[str, Any] | None:
    """The newest pilot of the spec's pinned model and engine (one of the same spec first), or None."""
    row = conn.execute(q("estimate_pilot_latest"), {
        "model_name": spec.model.name, "model_digest": spec.model.digest, "engine": spec.engine.name,
        "spec_hash": spec.spec_hash}).fetchone()
    return dict(row) if row else None


def measured(conn: psycopg.Connection, spec: JobSpec, counter: Counter) -> Measured | None:
    """A pilot's figures, else the newest runs of the same pinned model, else None."""
    p = pilot_figures(conn, spec)
    if p and p["records_per_s"] > 0:
        out = p["output_tokens"] / p["stored"] if p["stored"] else None
        # The pilot's rate is after its worker's start-up: the rest of its wall time is the start-up.
        startup = max(float(p["seconds"]) - (p["stored"] + p["dead_letters"]) / float(p["records_per_s"]), 0.0)
        return Measured("pilot", float(p["records_per_s"]), out, float(p["valid_rate"]),
                        f"pilot {p['id']} of {p['records']} records at {p['measured_at']:%Y-%m-%d %H:%M} UTC",
                        round(startup, 3))
    runs = conn.execute(q("estimate_recent_runs"), {
        "model_name": spec.model.name, "model_digest": spec.model.digest, "n": RECENT_RUNS,
        "min_rows": MIN_RECENT_ROWS}).fetchall()
    if not runs:
        return None
    # Rows after the first over the span between the first and the last write, per worker.
    rows = sum(int(r["n"]) - 1 for r in runs)
    worker_s = sum(float(r["seconds"]) * max(int(r["workers"]), 1) for r in runs)
    outputs = [r["output"] for r in conn.execute(q("estimate_outputs"), {"job": runs[0]["job_version"],
                                                                           "n": OUTPUT_SAMPLE})]
    out = sum(counter.count_text(o) for o in outputs) / len(outputs) if outputs else None
    return Measured("recent runs", rows / worker_s, out, None,
                    f"{len(runs)} recent run(s) of {spec.model.name}, newest {runs[0]['job_version']}")


# -- the preview --------------------------------------------------------------------


@dataclass
class Preview:
    """Every figure of one preview; ``as_dict`` is the one JSON object the CLI prints."""

    dataset: str
    spec_hash: str
    model: str
    engine: str
    tokenizer: str
    exact: bool
    records: int
    rejected: int
    reject_reasons: dict[str, int]
    eligible: int
    input_tokens: dict[str, Any]
    shared_prefix_tokens: int
    prefix_cache_saves_tokens: int
    over_context: int
    output_tokens: dict[str, Any]
    rate: dict[str, Any] | None
    workers: int
    gpu_hours: float | None
    bill: dict[str, Any]
    budget: float | None
    budget_holds: bool | None
    now: str
    deadline: str | None
    finish: str | None
    cutoff_at: str | None
    batch_rows: int
    fallback_rows: int
    finishes_on_batch: bool | None
    can_finish: bool | None
    verdict: str
    why: str
    seconds: dict[str, float]
    sample: list[dict[str, Any]] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("sample")
        return out


def default_workers(spec: JobSpec) -> int:
    """The batch workers a run of ``spec`` has when nobody says: the autopilot's ceiling, else its floor."""
    c = spec.cost
    return max(1, c.max_workers if spec.autopilot.enabled else c.min_workers)


def preview(conn: psycopg.Connection, spec: JobSpec, *, reader: sources.Reader | None = None,
            counter: Counter | None = None, workers: int = 1, deadline: datetime | None = None,
            now: datetime | None = None, sample: int = 0, seed: int = 0,
            rows: Iterator[Mapping[str, Any]] | None = None, rate: Measured | None = None) -> Preview:
    """Read, render and count every record of ``spec``'s source, and project the run.

    :param workers: batch workers the run will have (each one GPU).
    :param deadline: when the version must be published; None: no finish verdict.
    :param sample: draw this many eligible records (seeded reservoir) into ``Preview.sample``, for a pilot.
    :param rows: records read elsewhere instead of the source (tests, benchmarks).
    :param rate: measured figures to use instead of the ledger's (pilot, recent runs).
    """
    if workers < 1:
        raise InvalidValue(f"estimate: workers must be >= 1, got {workers}")
    now = now or datetime.now(UTC)
    t0 = time.perf_counter()
    own = counter is None
    counter = counter or counter_for(spec)
    t_load = time.perf_counter() - t0
    tally = TokenTally()
    reasons: Histogram = Histogram()
    records = 0
    n_ctx = _context_window(spec)
    over_context = 0
    rng = random.Random(seed)
    drawn: list[dict[str, Any]] = []
    t_count = 0.0
    rung_tokens = [0] * len(spec.models or ())   # a model ladder: each rung's tokenizer's count (LadderCounter)
    progress = Progress(None, every=PROGRESS_EVERY, seconds=PROGRESS_SECONDS)
    null_ids = 0
    try:
        for row in (rows if rows is not None else source_rows(conn, spec, reader)):
            records += 1
            if progress.add(1):
                log.info("estimate: %s records read, judged and counted so far", progress.text())
            if row.get("record_id") is None:   # refused at submit: counted here, refused as submit does
                null_ids += 1
                continue
            text, reject = judge(spec, row)
            if reject is not None:
                reasons[reject.split(" (")[0]] += 1
                continue
            t1 = time.perf_counter()
            ids = counter.count(build_messages(spec, text))
            t_count += time.perf_counter() - t1
            tally.add(ids)
            if rung_tokens:
                each = getattr(counter, "last", None) or [len(ids)] * len(rung_tokens)
                rung_tokens = [a + b for a, b in zip(rung_tokens, each)]
            if n_ctx and len(ids) > n_ctx:
                over_context += 1
            if sample:
                item = {"record_id": row["record_id"], "text": text, "acl": row.get("acl"), "tokens": len(ids)}
                if len(drawn) < sample:
                    drawn.append(item)
                else:
                    j = rng.randrange(tally.records)
                    if j < sample:
                        drawn[j] = item
        m = rate if rate is not None or conn is None else measured(conn, spec, counter)
        calibration = conn.execute(q("ladder_calibration_of_spec"), {
            "dataset": spec.dataset, "spec_hash": spec.spec_hash}).fetchone() if spec.models and conn is not None else None
    finally:
        if own:
            counter.close()
    if records == 0:
        raise SnapshotError(f"source {spec.source.label} is empty: nothing to preview")
    if null_ids:
        raise null_ids_error(spec.source.label, null_ids, spec.source.id_column)
    elapsed = time.perf_counter() - t0
    return _project(spec, counter, tally, records, reasons, over_context, m, workers, deadline, now,
                    {"total": round(elapsed, 3), "tokenizer_load": round(t_load, 3),
                     "render_and_count": round(t_count, 3), "read": round(elapsed - t_load - t_count, 3)},
                    drawn, ladder_reach(spec, calibration) if spec.models else None, rung_tokens)


def _context_window(spec: JobSpec) -> int | None:
    """The prompt tokens the engine can take at most (llama.cpp's n_ctx, vLLM's max_model_len), when known."""
    opts = spec.engine.options or {}
    if spec.engine.name == "llama-cpp":
        return int(opts.get("n_ctx") or 2048)
    if spec.engine.name == "vllm" and opts.get("max_model_len"):
        return int(opts["max_model_len"])
    return None


def _transport(spec: JobSpec) -> str:
    from batch_inference.engines import engine_class

    try:
        return engine_class(spec.engine.name).transport
    except InvalidValue:
        return "batch"


def ladder_reach(spec: JobSpec, calibration: Mapping[str, Any] | None) -> tuple[list[float], str]:
    """A model ladder's share of records asked at each rung, and where it comes from: every record at
    every rung when no rung below the top has a threshold (each escalates all); else the cascade
    calibrate picked for this very spec (the records it finished at each rung of the golden set); else
    every record at every rung, an upper bound."""
    top = len(spec.models or ())
    if all(r.threshold is None for r in (spec.models or ())[:-1]):
        return [1.0] * top, "no thresholds: every record is asked at every rung"
    if calibration and calibration["picked"] and calibration["picked"].get("finished_at"):
        finished = calibration["picked"]["finished_at"]
        n = sum(finished) or 1
        reach, left = [], 1.0
        for k in range(top):
            reach.append(max(left, 0.0))
            left -= finished[k] / n if k < len(finished) else 0.0
        return reach, (f"each rung's share as calibrate found it on {n} golden record(s) at "
                       f"{calibration['calibrated_at']:%Y-%m-%d %H:%M} UTC")
    return [1.0] * top, ("not calibrated here for these thresholds: every record priced at every rung (an upper "
                         "bound; `batch-inference calibrate SPEC` measures each rung's share)")


def _ladder_rungs(spec: JobSpec, reach: list[float], rows: int) -> list[dict[str, Any]]:
    """What ``rows`` records cost at each rung (``cost.priced_by_rung``'s rungs): records asked x samples."""
    return [{"rung": no, "model": rung.model.name, "answered": round(rows * share),
             "answers": round(rows * share) * spec.rung_samples(no), "cost_per_row": rung.cost_per_row}
            for no, (rung, share) in enumerate(zip(spec.models or (), reach), 1)]


def _project(spec: JobSpec, counter: Counter, tally: TokenTally, records: int, reasons: Histogram,
             over_context: int, m: Measured | None, workers: int, deadline: datetime | None, now: datetime,
             seconds: dict[str, float], drawn: list[dict[str, Any]],
             ladder: tuple[list[float], str] | None = None, rung_tokens: list[int] | None = None) -> Preview:
    eligible = tally.records
    prices = Prices.from_spec(spec)
    if m and m.output_tokens is not None:
        out_per, out_source = m.output_tokens, f"measured ({m.source})"
    else:
        out_per, out_source = float(spec.params.max_tokens), "params.max_tokens (an upper bound: nothing measured)"
    out_total = round(out_per * eligible)

    rate = m.records_per_s if m else None
    # Each worker pays its start-up once, and no more workers run than there are shards.
    startup = m.startup_s if m and eligible else 0.0
    running = max(min(workers, math.ceil(eligible / spec.shard_size)), 1)
    fleet = rate * running if rate else None
    gpu_hours = (eligible / rate + running * startup) / 3600 if rate else None
    transport = _transport(spec)

    # Rows by transport: all batch when the batch finishes in time (or nothing says when it must),
    # else batch until the cutoff and the rest through the fallback pool.
    batch, fallback = eligible, 0
    finish = cutoff_at = None
    on_batch = can = None
    if fleet:
        finish = now + timedelta(seconds=startup + eligible / fleet)
    if deadline is not None and fleet:
        overhead, fb_rate = spec.fallback.overhead_s, spec.fallback.rate
        if finish + timedelta(seconds=overhead) <= deadline:
            on_batch, can = True, True
            cutoff_at = latest_safe_start(deadline, 0, fb_rate, overhead)
        else:
            on_batch = False
            # The cutoff fires when the rows still outstanding just fit the fallback: the batch
            # does fleet rows/s until then (a fixed point of the cutoff's own arithmetic).
            outstanding = eligible
            for _ in range(50):
                lss = latest_safe_start(deadline, outstanding, fb_rate, overhead)
                done = min(eligible, int(max(0.0, (lss - now).total_seconds() - startup) * fleet))
                if eligible - done == outstanding:
                    break
                outstanding = eligible - done
            cutoff_at = latest_safe_start(deadline, outstanding, fb_rate, overhead)
            batch, fallback = eligible - outstanding, outstanding
            can = cutoff_at >= now - timedelta(seconds=60)   # the cutoff's minute floor
            finish = max(now, cutoff_at) + timedelta(seconds=fallback_seconds(outstanding, fb_rate, overhead))

    batch_hours = (batch / rate + (running * startup if batch else 0.0)) / 3600 if rate else 0.0
    hosted = transport == "hosted_batch"
    in_tokens_batch = round(tally.total * batch / eligible) if eligible else 0
    hosted_cost = prices.hosted_usage_cost(in_tokens_batch, round(out_per * batch)) if hosted else None
    planned = cost_report(0 if hosted else batch, fallback, prices, total_rows=eligible,
                          hosted_rows=batch if hosted else 0, hosted_cost=hosted_cost,
                          gpu_hours=0 if hosted else batch_hours)
    all_batch = cost_report(0 if hosted else eligible, 0, prices, hosted_rows=eligible if hosted else 0,
                            hosted_cost=prices.hosted_usage_cost(tally.total, out_total) if hosted else None,
                            gpu_hours=0 if hosted else (gpu_hours or 0))
    tiers = None
    if spec.fallback.tiers and fallback:   # price tiers: the tail where the pool's plan would send it
        one_price = planned.fallback_cost
        split = projected_split(spec.fallback.tiers, fallback, start=max(now, cutoff_at).timestamp(),
                                deadline=deadline.timestamp(), reserve_s=spec.fallback.overhead_s * PAGE_RESERVE_SHARE,
                                concurrency=spec.fallback.concurrency, default_rate=spec.fallback.rate)
        planned = priced_by_tier(planned, split, spec.fallback.tiers)
        tiers = {"split": [{"tier": t["tier"], "rows": t["rows"], "per_row": f"{t['per_row']:g}",
                            "cost": str(cents(t["cost"]))} for t in planned.tiers],
                 "one_price": str(cents(one_price)), "one_price_per_row": f"{prices.fallback_per_row:g}"}
    rungs = None
    if ladder is not None:   # a model ladder: its batch rows priced rung by rung, each rung's tokens its own
        reach, source = ladder
        planned = priced_by_rung(planned, _ladder_rungs(spec, reach, planned.batch_rows))
        all_batch = priced_by_rung(all_batch, _ladder_rungs(spec, reach, all_batch.batch_rows))
        tokens = rung_tokens or [0] * len(reach)
        rungs = {"reach_source": source, "rungs": [
            {**{k: v for k, v in r.items() if k != "cost"}, "share_asked": round(share, 4),
             "input_tokens": round(tokens[r["rung"] - 1] * share), "cost": str(cents(r["cost"]))}
            for r, share in zip(planned.rungs, reach)]}
    bill = {"transport": transport, "planned": _bill(planned), "all_batch": _bill(all_batch), "ladder": rungs,
            "fallback_tiers": tiers,
            "prices": prices_used(spec, transport),
            "all_fallback": str(cents(planned.all_synchronous_ceiling)),
            "gpu_priced": prices.gpu_hour is not None,
            "note": None if rate or prices.gpu_hour is None else
            "no measured rate: GPU-hours are unknown and not in the bill (run estimate --pilot N)"}
    budget = spec.cost.budget
    holds = None if budget is None else planned.total <= Decimal(str(budget))

    if can is False:
        verdict = "misses_deadline"
        why = (f"{fallback:,} records cannot be done by {deadline:%Y-%m-%d %H:%M} UTC even through the fallback "
               f"({spec.fallback.rate:g}/s after {spec.fallback.overhead_s:g}s overhead)")
    elif holds is False:
        verdict = "over_budget"
        why = f"projected bill ${cents(planned.total):,} is over cost.budget ${budget:,.2f}"
    else:
        verdict = "go"
        why = ("within the budget and the deadline" if budget is not None and deadline is not None and rate
               else "no budget or deadline breached")
        if not rate:
            why += ("; no measured rate, so the finish is unknown and the bill is every row on batch "
                    "(run estimate --pilot N)")
    prefix = tally.shared_prefix
    return Preview(
        dataset=spec.dataset, spec_hash=spec.spec_hash, model=spec.model.name, engine=spec.engine.name,
        tokenizer=counter.name, exact=counter.exact, records=records, rejected=sum(reasons.values()),
        reject_reasons=dict(reasons), eligible=eligible,
        input_tokens={"total": tally.total, "mean": round(tally.total / eligible, 1) if eligible else 0,
                      "p50": tally.percentile(50), "p90": tally.percentile(90), "p99": tally.percentile(99),
                      "max": max(tally.hist) if tally.hist else 0},
        shared_prefix_tokens=prefix, prefix_cache_saves_tokens=prefix * max(eligible - 1, 0),
        over_context=over_context,
        output_tokens={"per_record": round(out_per, 1), "total": out_total, "source": out_source},
        rate=None if m is None else {**asdict(m), "fleet_records_per_s": fleet, "workers_running": running},
        workers=workers, gpu_hours=None if gpu_hours is None else round(gpu_hours, 6),
        bill=bill, budget=budget, budget_holds=holds,
        now=now.isoformat(), deadline=None if deadline is None else deadline.isoformat(),
        finish=None if finish is None else finish.isoformat(),
        cutoff_at=None if cutoff_at is None else cutoff_at.isoformat(),
        batch_rows=batch, fallback_rows=fallback, finishes_on_batch=on_batch, can_finish=can,
        verdict=verdict, why=why, seconds=seconds, sample=drawn)


def prices_used(spec: JobSpec, transport: str) -> str:
    """Which prices the bill took, each named by its spec field ("(default)" where the spec sets none)."""
    c, given = spec.cost, spec.cost.model_fields_set
    defaults: list[str] = []

    def named(name: str) -> str:
        if name not in given:
            defaults.append(f"cost.{name}")
        return f"cost.{name} ${getattr(c, name):g}" + ("" if name in given else " (default)")

    gpu = "gpu_hour_spot" if c.gpu_hour_spot is not None and (c.capacity == "spot" or c.gpu_hour_on_demand is None) \
        else "gpu_hour_on_demand" if c.gpu_hour_on_demand is not None else None
    if spec.models:
        own = "each rung's answers at its models[].cost_per_row"
    elif transport == "hosted_batch":
        own = ("hosted rows at cost.hosted_batch_per_m_input_tokens/_output_tokens"
               if c.hosted_batch_per_m_input_tokens is not None and c.hosted_batch_per_m_output_tokens is not None
               else f"hosted rows at cost.hosted_batch_per_row ${Prices.from_spec(spec).hosted_batch_per_row:g}"
               + ("" if "hosted_batch_per_row" in given else " (default: half of cost.fallback_per_row)"))
    elif gpu is not None:
        own = f"batch workers' GPU-hours at cost.{gpu} ${getattr(c, gpu):g}"
    else:
        own = f"batch rows at {named('batch_per_row')}"
    one_price = named("fallback_per_row")
    text = f"{own}; fallback rows at {one_price}"
    if spec.fallback.tiers:
        text = (f"{own}; fallback rows at the tier the cutoff's arithmetic picks, each at its fallback.tiers[].per_row ("
                + ", ".join(f"{t.name} ${t.per_row:g}" for t in spec.fallback.tiers)
                + f"), beside every fallback row at {one_price}")
    if defaults:
        text += (f": the defaults are the seed workload's prices for a GPU fleet and a hosted API, not what this "
                 f"run costs on this machine; set {' and '.join(defaults)} in the spec (0 for rows run on your own "
                 "CPU) to price yours")
    return text


def _bill(r: CostReport) -> dict[str, Any]:
    return {"total": str(cents(r.total)), "batch_rows": r.batch_rows, "batch": str(cents(r.batch_cost)),
            "hosted_rows": r.hosted_rows, "hosted": str(cents(r.hosted_cost)), "fallback_rows": r.fallback_rows,
            "fallback": str(cents(r.fallback_cost)), "gpu_hours": float(r.gpu_hours), "gpu": str(cents(r.gpu_cost))}


def render(p: dict[str, Any]) -> str:
    """The readable form of ``Preview.as_dict()``."""
    t = p["input_tokens"]
    exact = "exact" if p["exact"] else "ESTIMATED"
    lines = [
        f"estimate {p['dataset']}: {p['records']:,} records, {p['eligible']:,} to run, {p['rejected']:,} dead "
        f"letters at planning" + (f" ({', '.join(f'{k}: {v}' for k, v in p['reject_reasons'].items())})"
                                  if p["reject_reasons"] else ""),
        f"  input tokens  {t['total']:,} ({exact}, {p['tokenizer']}); per record p50 {t['p50']:,}, "
        f"p90 {t['p90']:,}, p99 {t['p99']:,}, max {t['max']:,}",
        f"  prefix cache  {p['shared_prefix_tokens']:,} tokens shared by every prompt: "
        f"{p['prefix_cache_saves_tokens']:,} prompt tokens not recomputed",
    ]
    if p["over_context"]:
        lines.append(f"  too long      {p['over_context']:,} records over the engine's context window (they will fail)")
    o = p["output_tokens"]
    lines.append(f"  output tokens {o['total']:,} ({o['per_record']:g} a record, {o['source']})")
    r = p["rate"]
    if r:
        valid = f", {r['valid_rate']:.0%} valid answers" if r["valid_rate"] is not None else ""
        start = f" after a {r['startup_s']:.3g}s start-up" if r.get("startup_s") else ""
        running = r.get("workers_running", p["workers"])
        workers = f"{p['workers']} worker(s)" + (f", {running} with a shard to run" if running != p["workers"] else "")
        lines.append(f"  rate          {r['records_per_s']:.3g} records/s a worker{start} ({r['detail']}{valid}); "
                     f"{workers}; {p['gpu_hours']:,.3f} GPU-hours")
    else:
        lines.append("  rate          none measured: run `batch-inference estimate SPEC --pilot 100` first")
    b = p["bill"]
    pl = b["planned"]
    lines.append(f"  bill          ${pl['total']} planned ({b['transport']} {pl['batch_rows'] + pl['hosted_rows']:,} "
                 f"rows ${pl['batch']}+${pl['hosted']}, GPU ${pl['gpu']}, fallback {pl['fallback_rows']:,} rows "
                 f"${pl['fallback']}); all batch ${b['all_batch']['total']}, all fallback ${b['all_fallback']}")
    lines.append(f"  prices        {b['prices']}")
    if b.get("ladder"):
        lad = b["ladder"]
        lines.append("  rungs         " + "; ".join(
            f"rung {r['rung']} {r['model']}: {r['answered']:,} records asked, {r['input_tokens']:,} input tokens, "
            f"{r['answers']:,} answers x ${r['cost_per_row']:g} = ${r['cost']}" for r in lad["rungs"])
            + f" ({lad['reach_source']})")
    if b.get("fallback_tiers"):
        ft = b["fallback_tiers"]
        lines.append("  tiers         " + "; ".join(
            f"{t['tier'] or 'no tier'} {t['rows']:,} rows x ${t['per_row']} = ${t['cost']}" for t in ft["split"])
            + f" (at one price: {pl['fallback_rows']:,} rows x ${ft['one_price_per_row']} = ${ft['one_price']})")
    if b["note"]:
        lines.append(f"                {b['note']}")
    if p["budget"] is not None:
        lines.append(f"  budget        ${p['budget']:,.2f}: {'holds' if p['budget_holds'] else 'EXCEEDED'}")
    if p["finish"]:
        lines.append(f"  finish        {p['finish'][:19]} UTC" + (f" against the deadline {p['deadline'][:19]} UTC"
                                                                 if p["deadline"] else ""))
    if p["fallback_rows"]:
        lines.append(f"  cutoff        {p['cutoff_at'][:19]} UTC: {p['fallback_rows']:,} rows through the fallback")
    lines.append(f"  verdict       {p['verdict']}: {p['why']}")
    return "\n".join(lines)

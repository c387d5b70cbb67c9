"""The moving cutoff: when the synchronous fallback has to start.

A deadline says when the rows must be in the table; the cutoff says when the
alternative has to begin so that they are. Worked backwards from the
deadline, the fallback needs a fixed overhead (cancel drain, results drain and
reconciliation, warehouse load) plus the outstanding rows at the pool's
sustained rate. Only the second term varies, and the shard counts give it at
every poll, so the cutoff moves later as the batch settles rows.

Rounding: ``latest_safe_start`` floors to the whole minute (``step_s=60``).
Flooring moves the cutoff earlier, never later, so it only ever spends a
little patience and never the deadline. With the seed's figures (deadline
06:00, 1,800 s overhead, 85 rows/s) that gives 05:22 for 40,000 outstanding,
04:39 for 260,000 and 04:31 for 300,000 (exactly 04:31:10.6). The seed quotes
04:30 for the full 300,000 because it rounds the 59-minute re-drive up to an
hour; ``step_s=1800`` reproduces that as a fixed, memorable start time.

Pure functions, no I/O, no Airflow: the sensor, the CLI and the fallback pool
all call these with counts they read elsewhere. Datetimes without a timezone
are taken as UTC; arithmetic is done in UTC so a daylight-saving change during
the night does not shift the cutoff by an hour.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass, field
from datetime import datetime, time, timedelta, timezone, tzinfo
from typing import Any, Iterable, Mapping, Sequence

from batch_inference.cost import DEFAULT_PRICES, CostReport, Prices, cents, cost_report
from batch_inference.exceptions import InvalidValue

UTC = timezone.utc

# The seed workload's measured constants. They go stale (a retuned pool, a
# slower warehouse load), which is why derive_rate_and_overhead() exists.
DEFAULT_RATE = 85.0  # synchronous rows/s the pool sustains, not its peak
DEFAULT_OVERHEAD_S = 1800.0  # 15 min cancel drain + 3 min reconcile + 10 min load, rounded up
# What the publish needs once the re-drive is done, as a share of the fallback overhead (the seed's
# 10 min load of its 30 min): the margin of an early page (fallback.deadline_page).
PAGE_RESERVE_SHARE = 1 / 3


# -- time helpers -----------------------------------------------------------


def _aware(dt: datetime) -> datetime:
    return dt.replace(tzinfo=UTC) if dt.tzinfo is None else dt


def _utc(dt: datetime) -> datetime:
    return _aware(dt).astimezone(UTC)


def _floor(dt: datetime, step_s: int) -> datetime:
    """Floor to a multiple of ``step_s`` seconds since the epoch, keeping dt's zone."""
    if step_s <= 0:
        return dt
    ts = _utc(dt).timestamp()
    floored = datetime.fromtimestamp(math.floor(ts / step_s) * step_s, UTC)
    return floored.astimezone(_aware(dt).tzinfo)


_CLOCK = re.compile(r"^(\d{1,2}):(\d{2})(?::(\d{2}))?$")


def parse_clock_time(text: str) -> time:
    """'06:00' or '06:00:30' as a ``time``; anything else is a ValueError naming the text."""
    m = _CLOCK.match(text.strip())
    if not m:
        raise InvalidValue(f"expected HH:MM or HH:MM:SS, got {text!r}")
    h, mi, s = int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)
    if h > 23 or mi > 59 or s > 59:
        raise InvalidValue(f"not a time of day: {text!r}")
    return time(h, mi, s)


def parse_clock(text: str, reference: datetime, tz: tzinfo = UTC, roll: bool = True) -> datetime:
    """A clock time ("06:00") or an ISO datetime, placed relative to ``reference``.

    The clock time is put on ``reference``'s date in ``tz``. With ``roll``
    (the default, right for deadlines) a time already past moves to the next
    day, so a 06:00 deadline read at 22:00 means tomorrow morning. Without it
    (right for "now") the date is kept. A full ISO datetime is used as given;
    a naive one is read in ``tz``.
    """
    text = text.strip()
    if "T" in text or "-" in text[:5]:
        dt = datetime.fromisoformat(text)
        return dt.replace(tzinfo=tz) if dt.tzinfo is None else dt
    t = parse_clock_time(text)
    ref = _aware(reference).astimezone(tz)
    candidate = datetime.combine(ref.date(), t, tzinfo=tz)
    if roll and candidate < ref:
        candidate = datetime.combine(ref.date() + timedelta(days=1), t, tzinfo=tz)
    return candidate


def relabel_start(deadline: datetime, fixed_time: time | str) -> datetime:
    """The always-re-drive start: the last ``fixed_time`` at or before the deadline.

    Once slips are regular the cutoff is replaced by a re-drive that runs
    every night at a fixed time (the seed's 04:30 for a 06:00 deadline) and
    re-drives whatever is outstanding: nothing on a good night, everything on
    a bad one. The time is in the deadline's own zone, as an operator reads it.
    Pick a time no later than ``latest_safe_start`` with every row outstanding.
    """
    t = parse_clock_time(fixed_time) if isinstance(fixed_time, str) else fixed_time
    d = _aware(deadline)
    start = datetime.combine(d.date(), t, tzinfo=d.tzinfo)
    if start > d:
        start = datetime.combine(d.date() - timedelta(days=1), t, tzinfo=d.tzinfo)
    return start


# -- the arithmetic ---------------------------------------------------------


def _check(outstanding: int, rate: float, overhead_s: float) -> None:
    if outstanding < 0:
        raise InvalidValue(f"outstanding must be >= 0, got {outstanding!r}")
    if not rate > 0 or not math.isfinite(rate):
        raise InvalidValue(f"rate must be a positive number of rows/s, got {rate!r}")
    if not overhead_s >= 0 or not math.isfinite(overhead_s):
        raise InvalidValue(f"overhead_s must be >= 0, got {overhead_s!r}")


def fallback_seconds(outstanding: int, rate: float, overhead_s: float) -> float:
    """Wall-clock seconds the fallback needs: the fixed overhead plus the re-drive."""
    _check(outstanding, rate, overhead_s)
    return overhead_s + outstanding / rate


def latest_safe_start(
    deadline: datetime, outstanding: int, rate: float, overhead_s: float, step_s: int = 60
) -> datetime:
    """Deadline minus the fallback duration, floored to ``step_s`` (earlier is the safe side)."""
    exact = _utc(deadline) - timedelta(seconds=fallback_seconds(outstanding, rate, overhead_s))
    return _floor(exact.astimezone(_aware(deadline).tzinfo), step_s)


def _dated(t: datetime) -> str:
    """``2026-12-07 05:22 UTC``: a time with its date and zone, as log lines show the deadline and cutoff."""
    zone = t.strftime("%Z")
    return t.strftime("%Y-%m-%d %H:%M") + (f" {zone}" if zone else "")


@dataclass(frozen=True)
class CutoffDecision:
    """One evaluation of the cutoff against the job's live counts."""

    now: datetime
    deadline: datetime
    done: int
    outstanding: int
    rate: float
    overhead_s: float
    fallback_s: float
    latest_safe_start: datetime
    # Fire only with rows left: at zero outstanding there is nothing to re-drive.
    fire: bool
    complete: bool

    @property
    def seconds_to_cutoff(self) -> float:
        return (_utc(self.latest_safe_start) - _utc(self.now)).total_seconds()

    def log_line(self, job: str | None = None) -> str:
        """The decision in plain words, each time with its date (a deadline is often tomorrow's)."""
        who = f"job {job}: " if job else ""
        if self.complete:
            verdict = "every record is done, the fallback is not needed"
        elif self.fire:
            verdict = "FIRE: start the fallback now"
        else:
            verdict = f"waiting, {self.seconds_to_cutoff / 60:.0f} min to the cutoff"
        return (
            f"{who}{self.done:,} done, {self.outstanding:,} outstanding; "
            f"the synchronous fallback needs {self.fallback_s / 60:.0f} min for them "
            f"({self.overhead_s:,.0f} s to set up, then {self.rate:g} records/s), "
            f"so the cutoff is {_dated(self.latest_safe_start)} for the deadline {_dated(self.deadline)}: {verdict}"
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "now": self.now.isoformat(),
            "deadline": self.deadline.isoformat(),
            "done": self.done,
            "outstanding": self.outstanding,
            "rate": self.rate,
            "overhead_s": self.overhead_s,
            "fallback_s": round(self.fallback_s, 3),
            "latest_safe_start": self.latest_safe_start.isoformat(),
            "latest_safe_start_clock": f"{self.latest_safe_start:%H:%M:%S}",
            "seconds_to_cutoff": round(self.seconds_to_cutoff, 3),
            "fire": self.fire,
            "complete": self.complete,
        }


def decide(
    now: datetime,
    deadline: datetime,
    outstanding: int,
    rate: float,
    overhead_s: float,
    done: int = 0,
    step_s: int = 60,
) -> CutoffDecision:
    """Whether the fallback must start now.

    ``outstanding`` counts every row the fallback would still have to
    produce: unsettled rows and rows that failed on the batch side (settled
    there, not in the table). Rows stored by either transport are not in it.
    """
    lss = latest_safe_start(deadline, outstanding, rate, overhead_s, step_s)
    return CutoffDecision(
        now=_aware(now),
        deadline=_aware(deadline),
        done=done,
        outstanding=outstanding,
        rate=rate,
        overhead_s=overhead_s,
        fallback_s=fallback_seconds(outstanding, rate, overhead_s),
        latest_safe_start=lss,
        fire=outstanding > 0 and _utc(now) >= _utc(lss),
        complete=outstanding == 0,
    )


# -- projection and early warning -------------------------------------------


def projected_finish(started_at: datetime, now: datetime, done: int, total: int) -> datetime | None:
    """When the batch finishes if it keeps the throughput it has shown so far.

    None before there is a throughput to extrapolate (nothing settled yet, or
    no time elapsed); a linear projection from zero is not a projection.
    """
    elapsed = (_utc(now) - _utc(started_at)).total_seconds()
    if done >= total:
        return _aware(now)
    if done <= 0 or elapsed <= 0:
        return None
    per_s = done / elapsed
    return _aware(now) + timedelta(seconds=(total - done) / per_s)


@dataclass(frozen=True)
class EarlyWarning:
    """The batch is projected to still be running when the cutoff meets it."""

    projected_finish: datetime
    fire_at: datetime  # when the moving cutoff is projected to fire
    cutoff_now: datetime  # the cutoff as the counts stand at this poll
    fallback_rows: int  # rows the fallback is projected to re-drive
    cost: CostReport

    @property
    def message(self) -> str:
        c = self.cost
        return (
            f"batch projected to finish {self.projected_finish:%H:%M}, after the cutoff, "
            f"which is projected to fire at {self.fire_at:%H:%M} (cutoff now {self.cutoff_now:%H:%M}); "
            f"expect the fallback to re-drive about {self.fallback_rows:,} rows, "
            f"night ${cents(c.total):,} ({c.overage_text}, "
            f"ceiling ${cents(c.all_synchronous_ceiling):,})"
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "projected_finish": self.projected_finish.isoformat(),
            "fire_at": self.fire_at.isoformat(),
            "cutoff_now": self.cutoff_now.isoformat(),
            "fallback_rows": self.fallback_rows,
            "cost": self.cost.to_dict(),
            "message": self.message,
        }


def early_warning(
    now: datetime,
    deadline: datetime,
    projection: datetime | None,
    decision: CutoffDecision,
    prices: Prices = DEFAULT_PRICES,
) -> EarlyWarning | None:
    """Warn when the batch is projected to finish after the cutoff fires.

    Comparing the projection with this poll's cutoff would raise false alarms:
    the cutoff moves later as rows settle (each settled row takes 1/rate s off
    the fallback). So the batch's current throughput is extended to find the
    moment the moving cutoff and the clock meet; the warning is raised only if
    that comes before the projected finish. It reports that moment, the rows
    still outstanding then, and what the night would cost.

    No projection (no throughput measured yet) gives no warning; the cutoff
    itself still fires on time.
    """
    if decision.complete or projection is None:
        return None
    now = _aware(now)
    total = decision.done + decision.outstanding
    o0, rate = decision.outstanding, decision.rate
    left_s = (_utc(projection) - _utc(now)).total_seconds()
    if decision.fire:
        fire_at, rows = now, o0
    else:
        if left_s <= 0:
            return None
        batch_per_s = o0 / left_s
        if batch_per_s >= rate:
            # The batch settles rows faster than the fallback could: the
            # cutoff recedes at least as fast as the clock and never arrives.
            return None
        exact_cutoff = _utc(deadline) - timedelta(seconds=decision.fallback_s)
        slack_s = (exact_cutoff - _utc(now)).total_seconds()
        # t* - now = slack + (batch_per_s / rate) * (t* - now)
        meet_s = max(0.0, slack_s) / (1.0 - batch_per_s / rate)
        if meet_s >= left_s:
            return None
        fire_at = _floor(now + timedelta(seconds=meet_s), 60)
        rows = min(o0, math.ceil(o0 - batch_per_s * meet_s))
    return EarlyWarning(
        projected_finish=_aware(projection),
        fire_at=fire_at,
        cutoff_now=decision.latest_safe_start,
        fallback_rows=rows,
        cost=cost_report(total - rows, rows, prices, total_rows=total),
    )


def deadline_lost(now: datetime, deadline: datetime, outstanding: int, rate: float, reserve_s: float,
                  why: str, step_s: int = 60) -> str | None:
    """The page for a deadline the fallback can no longer meet, or None while it still can.

    With the fallback failing now (its endpoint down, say), the deadline is lost once even a
    pool that came back at once could not re-drive ``outstanding`` rows at ``rate`` and leave
    ``reserve_s`` for what follows (validate, publish): ``now`` past that latest start. Waiting
    for 06:00 to say so wastes the time a person has to act; this says it the moment the
    arithmetic knows, with ``why`` (one line).
    """
    if outstanding <= 0:
        return None
    lss = latest_safe_start(deadline, outstanding, rate, reserve_s, step_s)
    if _utc(now) < _utc(lss):
        return None
    left = (_utc(deadline) - _utc(now)).total_seconds()
    return (f"deadline {_aware(deadline):%H:%M:%S} will be missed: {outstanding:,} rows outstanding need "
            f"{outstanding / rate:,.1f}s at {rate:g}/s + {reserve_s:g}s to publish, {left:,.1f}s left; {why}")


# -- constants that go stale -------------------------------------------------


@dataclass(frozen=True)
class FallbackRun:
    """One measured fallback run, as recorded in ``bi.fallback_runs``.

    The parts of the overhead are recorded separately; None means the run did
    not measure that part, and a run is complete only when it measured all
    three (drain, re-drive, load).
    """

    records: int  # rows the pool re-drove
    rate: float  # sustained rows/s over the re-drive
    overhead_s: float  # wall time from the cutoff firing to nothing outstanding, less the re-drive
    finished_at: datetime | None = None
    job_version: str | None = None
    dataset: str | None = None
    drain_s: float | None = None  # cutoff firing -> no shard leased by a batch worker
    busy_s: float | None = None  # the re-drive: time at least one pool worker held a shard
    load_s: float | None = None  # warehouse load: nothing outstanding -> published pointer (publish records it)

    @property
    def redrive_s(self) -> float:
        if self.busy_s is not None:
            return self.busy_s
        return self.records / self.rate if self.rate > 0 else 0.0

    @property
    def complete(self) -> bool:
        """Drain, re-drive and load were all measured."""
        return self.drain_s is not None and self.busy_s is not None and self.load_s is not None

    @property
    def whole_overhead_s(self) -> float:
        """Everything but the re-drive: the pool's measured overhead plus the load, where recorded."""
        return self.overhead_s + (self.load_s or 0.0)

    @classmethod
    def from_row(cls, r: Mapping[str, Any]) -> "FallbackRun":
        """From a ``fallback_history`` row."""
        opt = lambda k: None if r.get(k) is None else float(r[k])  # noqa: E731
        return cls(records=int(r["records"]), rate=float(r["rate"]), overhead_s=float(r["overhead_s"]),
                   finished_at=r.get("finished_at"), job_version=r.get("job_version"), dataset=r.get("dataset"),
                   drain_s=opt("drain_s"), busy_s=opt("busy_s"), load_s=opt("load_s"))


# A re-drive shorter than this measured the pool's start-up, not its
# sustained rate (the rate limiter had not engaged), so it does not count.
MIN_REDRIVE_S = 60.0

# Complete runs (every part measured, a sustained re-drive) needed before
# history may make the constants less conservative (spec.fallback.min_history_runs).
DEFAULT_MIN_HISTORY_RUNS = 5


def history_params(dataset: str, n: int, min_runs: int = DEFAULT_MIN_HISTORY_RUNS,
                   min_redrive_s: float = MIN_REDRIVE_S) -> dict[str, Any]:
    """Parameters of the ``fallback_history`` query: the last ``n`` runs of any kind
    and the last ``max(n, min_runs)`` complete ones (none when ``n`` is 0)."""
    n = max(0, int(n))
    return {"dataset": dataset, "n": n, "w": max(n, int(min_runs)) if n else 0, "min_redrive_s": min_redrive_s}


def slow_half_median(values: Iterable[float]) -> float:
    """The median of the slowest half (the lower half, rounded up): a low
    quantile that one fast outlier cannot raise. ValueError on no values."""
    v = sorted(values)
    if not v:
        raise InvalidValue("no values")
    return float(statistics.median(v[: math.ceil(len(v) / 2)]))


def _minute_up(seconds: float, step_s: float = 60.0) -> float:
    return float(math.ceil(seconds / step_s) * step_s)


@dataclass(frozen=True)
class DerivedConstants:
    rate: float
    overhead_s: float
    source: str
    runs_used: int = 0  # the recent runs considered
    rates: Sequence[float] = field(default_factory=tuple)
    overheads: Sequence[float] = field(default_factory=tuple)
    complete_runs: int = 0  # complete runs considered
    min_runs: int = DEFAULT_MIN_HISTORY_RUNS  # complete runs needed to relax the configured constants

    def __iter__(self):  # unpacks as (rate, overhead, source)
        return iter((self.rate, self.overhead_s, self.source))

    def to_dict(self) -> dict[str, Any]:
        return {"rate": self.rate, "overhead_s": self.overhead_s, "source": self.source,
                "runs_used": self.runs_used, "complete_runs": self.complete_runs, "min_runs": self.min_runs}


def derive_rate_and_overhead(
    history: Iterable[FallbackRun],
    default_rate: float = DEFAULT_RATE,
    default_overhead: float = DEFAULT_OVERHEAD_S,
    n: int = 5,
    min_redrive_s: float = MIN_REDRIVE_S,
    min_runs: int = DEFAULT_MIN_HISTORY_RUNS,
    step_s: float = 60.0,
) -> DerivedConstants:
    """Rate and overhead from fallback history, never later than the configured constants on thin evidence.

    * complete runs: the last ``max(n, min_runs)`` runs that measured drain,
      re-drive and load and re-drove for at least ``min_redrive_s``. With at
      least ``min_runs`` of them the constants come from them alone: rate =
      the median of the slowest half of their rates, overhead = the longest
      whole overhead (overhead_s + load_s), rounded up to the minute. With
      fewer, the configured constants stand.
    * recent runs: the last ``n`` of any kind. They can only make the result
      more conservative: a slower rate (the same statistic over their
      sustained re-drives) or a longer overhead (the longest, rounded up; a
      partial run's overhead is a lower bound, a short run's is a real one).

    Overheads are rounded up to ``step_s`` (the cutoff's own step, a minute
    by default), so a night watched at a finer step keeps its precision.

    So short or partial runs never move the cutoff later. Runs are ordered by
    ``finished_at`` where known, else taken in list order; ``n`` = 0 turns
    history off. Unpacks as ``(rate, overhead_s, source)``; ``source`` says
    which figures were used and why.
    """
    runs = list(history)
    if any(r.finished_at is not None for r in runs):
        epoch = datetime.min.replace(tzinfo=UTC)
        runs.sort(key=lambda r: _utc(r.finished_at) if r.finished_at else epoch)
    min_runs = max(1, int(min_runs))
    recent = runs[-n:] if n > 0 else []
    w = max(n, min_runs) if n > 0 else 0
    complete = [r for r in runs if r.complete and r.rate > 0 and r.redrive_s >= min_redrive_s][-w:] if w else []
    sustained = [r for r in recent if r.rate > 0 and r.redrive_s >= min_redrive_s]
    measured = [r.whole_overhead_s for r in recent if r.overhead_s >= 0]
    relax = len(complete) >= min_runs
    cfg_rate, cfg_over = float(default_rate), float(default_overhead)
    need = f"{len(complete)} complete run{'s' if len(complete) != 1 else ''} of the {min_runs} needed to relax it"

    q_rate = slow_half_median(r.rate for r in complete) if complete else None
    recent_rate = slow_half_median(r.rate for r in sustained) if sustained else None
    if relax:
        assert q_rate is not None
        rate = q_rate
        rate_part = f"rate {rate:.1f}/s = median of the slowest half of {len(complete)} complete runs"
        if recent_rate is not None and recent_rate < rate:
            rate = recent_rate
            rate_part = (f"rate {rate:.1f}/s = median of the slowest half of {len(sustained)} recent re-drives "
                         f"(complete runs give {q_rate:.1f}/s)")
    else:
        would = min((x for x in (q_rate, recent_rate) if x is not None), default=None)
        if would is not None and would < cfg_rate:
            rate = would
            of = (f"{len(sustained)} re-drives of {min_redrive_s:.0f} s or more" if would == recent_rate
                  else f"{len(complete)} complete runs")
            rate_part = (f"rate {rate:.1f}/s measured, slower than the configured {cfg_rate:g}/s (median of the "
                         f"slowest half of {of})")
        else:
            rate = cfg_rate
            rate_part = (f"rate {rate:g}/s configured ({need}; history would give {would:.1f}/s)"
                         if would is not None else
                         f"rate {rate:g}/s configured (no re-drive of {min_redrive_s:.0f} s or more measured)")

    q_over = _minute_up(max(r.whole_overhead_s for r in complete), step_s) if complete else None
    recent_over = _minute_up(max(measured), step_s) if measured else None
    up = "rounded up to the minute" if step_s == 60 else f"rounded up to {step_s:g} s"
    if relax:
        assert q_over is not None
        overhead = q_over
        over_part = (f"overhead {overhead:,.0f} s = longest of {len(complete)} complete runs (drain, re-drive and "
                     f"load measured), {up}")
        if recent_over is not None and recent_over > overhead:
            overhead = recent_over
            over_part = (f"overhead {overhead:,.0f} s = longest of {len(measured)} recent runs, {up} "
                         f"(complete runs give {q_over:,.0f} s)")
    else:
        longest = max((x for x in (q_over, recent_over) if x is not None), default=None)
        if longest is not None and longest > cfg_over:
            overhead = longest
            of = f"{len(measured)} recent runs" if longest == recent_over else f"{len(complete)} complete runs"
            over_part = (f"overhead {overhead:,.0f} s measured, longer than the configured {cfg_over:,.0f} s "
                         f"(longest of {of}, {up})")
        else:
            overhead = cfg_over
            over_part = (f"overhead {overhead:,.0f} s configured ({need}; history would give {longest:,.0f} s)"
                         if longest is not None else f"overhead {overhead:,.0f} s configured (no fallback history)")

    used = relax or rate != cfg_rate or overhead != cfg_over
    if runs and (recent or complete):
        head = (f"{'history' if used else 'configured constants'} ({len(recent)} recent fallback "
                f"run{'s' if len(recent) != 1 else ''}, {len(complete)} complete)")
    else:
        head = "configured constants"
    return DerivedConstants(
        rate=rate,
        overhead_s=overhead,
        source=f"{head}: {rate_part}; {over_part}",
        runs_used=len(recent),
        rates=tuple(r.rate for r in sustained),
        overheads=tuple(measured),
        complete_runs=len(complete),
        min_runs=min_runs,
    )

"""The autopilot: the batch fleet's size against the deadline and the budget.

At every poll of the cutoff watch (``deadline.watch``: the deferrable sensor's trigger,
the CLI, the nights harness) it takes the measured throughput of one worker, the
outstanding records and the deadline, and works out, for every fleet size within the
spec's bounds (``cost.min_workers`` .. ``cost.max_workers``), when the batch would finish
and what the night would cost: the bill so far, the GPU-hours still to run, and the rows
the cutoff would hand the synchronous fallback if the batch did not finish first. It wants
the fewest workers that finish ``margin_s`` before the cutoff's last moment (the deadline
less the fallback overhead: a batch done by then never lets the moving cutoff fire). None
of that is spent before every option's projected bill is checked against ``cost.budget``.

Hysteresis, so it does not flap: it adds at once when behind (an added worker needs
``start_s`` before its first row, which the projection counts), but removes only when the
smaller fleet would still finish a second margin early and ``cooldown_s`` have passed since
the last change (or the first claim); and it counts a worker's throughput only from
``start_s`` after it appeared, so a worker starting up does not read as a slow one.

Each decision is recorded in the ledger (``bi.fleet_decisions``: time, projected finish and
bill with and without the change, every option, the reason) and its size becomes the
fleet's desired size (``bi.fleet_size``), which the launchers reconcile to (``reconcile``:
the process fleet, ``operators.gpu_autopilot``: Kubernetes pods). The cutoff and the
fallback are untouched: the autopilot only makes firing rarer.

The arithmetic is pure (``decide``); the ledger reads and writes at the bottom are sync,
for the launchers (the watch awaits the same named statements).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

from batch_inference.cost import Prices, cents

UTC = timezone.utc
ADD, REMOVE, HOLD = "add", "remove", "hold"
MAX_OPTIONS = 12   # options recorded per decision (the bounds, the current size and those around the choice)
# A removal is weighed at this share of the measured throughput: a worker is given back only if
# the smaller fleet would still keep two margins were the measurement that much optimistic.
REMOVE_DERATE = 0.8


@dataclass(frozen=True)
class Policy:
    """The spec's bounds, margins and budget (``cost`` and ``autopilot``)."""

    min_workers: int = 1
    max_workers: int = 8
    margin_s: float = 600.0
    start_s: float = 300.0
    cooldown_s: float = 900.0
    window_s: float = 900.0
    budget: Decimal | None = None
    on_budget: str = "page"

    @classmethod
    def from_spec(cls, spec: Any) -> "Policy":
        c, a = spec.cost, spec.autopilot
        return cls(min_workers=c.min_workers, max_workers=c.max_workers, margin_s=a.margin_s, start_s=a.start_s,
                   cooldown_s=a.cooldown_s, window_s=a.window_s,
                   budget=None if c.budget is None else Decimal(str(c.budget)), on_budget=c.on_budget)

    def clamp(self, n: int) -> int:
        return max(self.min_workers, min(self.max_workers, int(n)))


# -- throughput ---------------------------------------------------------------------------


@dataclass
class Throughput:
    """One worker's rows/s: batch rows stored over the worker-seconds of the workers producing them.

    ``add(t, done, running)`` takes a poll (seconds on any clock, batch rows stored so far,
    workers running). A worker counts as producing ``start_s`` after it appeared (the first
    ones included), so a worker starting up does not read as a slow one; a removed worker
    stops counting at once. The estimate is over the polls of the last ``window_s``, and the
    first one waits for polls spanning half of it (a worker's results arrive in flushes: a short
    span reads a burst as a rate); until then, and while no rows or no producing worker-seconds
    are seen, the previous estimate stands. ``steady``: the polls span the whole window."""

    start_s: float
    window_s: float
    estimate: float | None = None
    _running: int = 0
    _young: list[list[float]] = field(default_factory=list)     # [appeared at, how many]
    _polls: list[tuple[float, int, int]] = field(default_factory=list)   # (t, done, producing)

    def producing(self, t: float) -> int:
        return self._running - int(sum(k for at, k in self._young if t - at < self.start_s))

    def add(self, t: float, done: int, running: int) -> float | None:
        if running > self._running:
            self._young.append([t, running - self._running])
        else:
            gone = self._running - running            # the newest go first (scale_to removes the newest)
            while gone > 0 and self._young:
                take = min(gone, int(self._young[-1][1]))
                self._young[-1][1] -= take
                gone -= take
                if not self._young[-1][1]:
                    self._young.pop()
        self._running = running
        self._young = [y for y in self._young if t - y[0] < self.start_s]
        self._polls.append((t, done, self.producing(t)))
        while len(self._polls) > 2 and t - self._polls[1][0] >= self.window_s:
            self._polls.pop(0)
        rows = self._polls[-1][1] - self._polls[0][1]
        worker_s = sum(p * (b[0] - a[0]) for a, b in zip(self._polls, self._polls[1:]) for p in (a[2],))
        if rows > 0 and worker_s > 0 and self.span >= self.window_s / 2:
            self.estimate = rows / worker_s
        return self.estimate

    @property
    def span(self) -> float:
        return self._polls[-1][0] - self._polls[0][0] if self._polls else 0.0

    @property
    def steady(self) -> bool:
        """The estimate covers a whole window: only then may a worker be removed on it."""
        return self.estimate is not None and self.span >= self.window_s


# -- the projection -----------------------------------------------------------------------


@dataclass(frozen=True)
class Option:
    """One fleet size, projected: when the batch finishes (or the cutoff fires first) and the bill."""

    workers: int
    finish: datetime | None        # the batch's last row; None: the cutoff fires first
    fire: datetime | None          # when the moving cutoff fires; None: it does not
    meets: bool                    # finishes by the target (the cutoff's last moment less the margin)
    fallback_rows: int
    gpu_hours: float               # still to run
    bill: Decimal                  # the night's projected bill
    within_budget: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {"workers": self.workers, "finish": self.finish.isoformat() if self.finish else None,
                "fire": self.fire.isoformat() if self.fire else None, "meets": self.meets,
                "fallback_rows": self.fallback_rows, "gpu_hours": round(self.gpu_hours, 6),
                "bill": float(cents(self.bill)), "within_budget": self.within_budget}


def _segment(t0: float, t1: float, left: float, per_s: float, cut: float, fb_rate: float) -> tuple[str, float, float]:
    """Rows settling at ``per_s`` from ``t0`` to ``t1`` (seconds from now) with ``left`` to go, against the
    moving cutoff (it fires once t >= cut - left(t) / fb_rate). Returns (what ended it: 'finish' | 'fire' |
    'open', when, rows left then)."""
    g0 = t0 - cut + left / fb_rate
    if g0 >= 0 and left > 0:
        return "fire", t0, left
    finish = t0 + left / per_s if per_s > 0 else math.inf
    slope = 1.0 - per_s / fb_rate
    fire = t0 - g0 / slope if slope > 0 else math.inf
    end = min(finish, fire)
    if end >= t1:
        return "open", t1, max(0.0, left - per_s * (t1 - t0))
    if finish <= fire:
        return "finish", finish, 0.0
    return "fire", fire, max(0.0, left - per_s * (fire - t0))


def project(workers: int, current: int, per_worker: float, outstanding: int, now: datetime, deadline: datetime,
            fb_rate: float, overhead_s: float, policy: Policy, prices: Prices, spent: Decimal) -> Option:
    """Run ``workers`` from now (the ones beyond ``current`` after ``start_s``) until the batch finishes or
    the moving cutoff fires; the bill is ``spent`` plus the GPU-hours, the batch's rows and the fallback's."""
    cut = (deadline - now).total_seconds() - overhead_s          # the cutoff's last moment, from now
    first = min(current, workers) if workers > current else workers
    how, t, left = _segment(0.0, policy.start_s if workers > current else math.inf, float(outstanding),
                            first * per_worker, cut, fb_rate)
    if how == "open":
        how, t, left = _segment(t, math.inf, left, workers * per_worker, cut, fb_rate)
    fb_rows = math.ceil(left) if how == "fire" else 0
    gpu_h = workers * t / 3600.0 if math.isfinite(t) else 0.0
    batch_rows = outstanding - fb_rows
    bill = spent + prices.gpu_cost(Decimal(str(gpu_h))) + batch_rows * prices.own_row \
        + fb_rows * prices.fallback_per_row
    finish = now + timedelta(seconds=t) if how == "finish" else None
    return Option(workers=workers, finish=finish, fire=now + timedelta(seconds=t) if how == "fire" else None,
                  meets=how == "finish" and t <= cut - policy.margin_s, fallback_rows=fb_rows, gpu_hours=gpu_h,
                  bill=bill, within_budget=policy.budget is None or bill <= policy.budget)


# -- the decision -------------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    now: datetime
    current: int
    desired: int
    action: str
    reason: str
    per_worker: float | None
    options: tuple[Option, ...] = ()
    page: str | None = None

    def option(self, n: int) -> Option | None:
        return next((o for o in self.options if o.workers == n), None)

    @staticmethod
    def _when(o: Option | None) -> datetime | None:
        return None if o is None else (o.finish or o.fire)

    def params(self, job_version: str) -> dict[str, Any]:
        """The ``fleet_decide`` statement's parameters."""
        without, with_ = self.option(self.current), self.option(self.desired)
        return {"job": job_version, "current": self.current, "desired": self.desired, "action": self.action,
                "reason": self.reason, "per_worker": self.per_worker, "finish_without": self._when(without),
                "finish_with": self._when(with_), "bill_without": None if without is None else cents(without.bill),
                "bill_with": None if with_ is None else cents(with_.bill), "page": self.page,
                "options": json.dumps(self.recorded_options())}

    def recorded_options(self) -> list[dict[str, Any]]:
        opts = list(self.options)
        if len(opts) > MAX_OPTIONS:
            keep = {opts[0].workers, opts[-1].workers, self.current, self.desired}
            near = sorted(opts, key=lambda o: abs(o.workers - self.desired))
            for o in near:
                if len(keep) >= MAX_OPTIONS:
                    break
                keep.add(o.workers)
            opts = [o for o in opts if o.workers in keep]
        return [o.to_dict() for o in opts]

    def to_dict(self) -> dict[str, Any]:
        return {"at": self.now.isoformat(), "current": self.current, "desired": self.desired, "action": self.action,
                "reason": self.reason, "per_worker": self.per_worker, "page": self.page,
                "options": self.recorded_options()}


def _fmt(o: Option) -> str:
    end = f"finish {o.finish:%H:%M:%S}" if o.finish else f"cutoff fires {o.fire:%H:%M:%S}, {o.fallback_rows:,} rows re-driven"
    return f"{o.workers} worker(s): {end}, bill ${cents(o.bill):,}"


def decide(now: datetime, deadline: datetime, outstanding: int, per_worker: float | None, current: int,
           fb_rate: float, overhead_s: float, policy: Policy, prices: Prices, spent: Decimal = Decimal(0),
           last_change: datetime | None = None, shards_left: int | None = None, steady: bool = True) -> Decision:
    """The fleet size for this poll (pure). ``current``: the desired size in force (the launchers'
    target); ``last_change``: when it was set (or the first claim), for the cooldown; ``spent``: the
    bill so far; ``shards_left``: shards pending or leased, beyond which a worker has nothing to claim;
    ``steady``: the throughput covers a whole window (``Throughput.steady``), else nothing is removed."""
    if shards_left is not None and shards_left < policy.max_workers:
        policy = Policy(**{**policy.__dict__, "max_workers": max(policy.min_workers, shards_left)})
    start = policy.clamp(current)
    if outstanding <= 0:
        return Decision(now, current, current, HOLD, "nothing outstanding", per_worker)
    if per_worker is None or per_worker <= 0:
        action = HOLD if start == current else (ADD if start > current else REMOVE)
        return Decision(now, current, start, action, "no throughput measured yet: the bounds' size", per_worker)
    options = tuple(project(n, current, per_worker, outstanding, now, deadline, fb_rate, overhead_s, policy, prices,
                            spent) for n in range(policy.min_workers, policy.max_workers + 1))
    by_n = {o.workers: o for o in options}
    meeting = [o for o in options if o.meets]
    if meeting:
        want = meeting[0]
        why = f"fewest workers finishing {policy.margin_s:g}s before the cutoff's last moment: {_fmt(want)}"
    else:
        want = min(options, key=lambda o: (o.bill, -o.workers))
        why = f"no size finishes before the cutoff; the cheapest night: {_fmt(want)}"
    cur = by_n.get(start)
    desired, action = start, HOLD
    if want.workers > start:
        desired, action = want.workers, ADD
    elif want.workers < start and cur is not None and cur.meets:
        # Remove only with a second margin to spare and past the cooldown: no flapping.
        cooled = last_change is None or (now - last_change).total_seconds() >= policy.cooldown_s
        slow = [project(o.workers, current, per_worker * REMOVE_DERATE, outstanding, now, deadline, fb_rate,
                        overhead_s, policy, prices, spent) for o in options if o.workers < start]
        early = [o for o in slow if o.finish is not None
                 and (o.finish - now).total_seconds() <= (deadline - now).total_seconds() - overhead_s
                 - 2 * policy.margin_s]
        early = [by_n[o.workers] for o in early]
        if cooled and early and steady:
            desired, action = early[0].workers, REMOVE
            why = (f"ahead: {_fmt(early[0])}, a second margin of {policy.margin_s:g}s to spare at "
                   f"{REMOVE_DERATE:.0%} of the measured throughput")
        else:
            held = ("within the cooldown" if not cooled else "no smaller size keeps two margins" if not early
                    else "the throughput is not yet measured over a whole window")
            why = f"ahead, holding {start} ({held}): {_fmt(cur)}"
    elif want.workers == start:
        why = f"on course: {_fmt(want)}"
    elif cur is not None:
        why = f"holding {start}: {_fmt(cur)}"
    page = None
    chosen = by_n[desired]
    if policy.budget is not None and chosen.bill > policy.budget:
        within = [o for o in options if o.within_budget]
        arithmetic = (f"budget ${cents(policy.budget):,}: {_fmt(chosen)} (spent ${cents(spent):,} + "
                      f"{chosen.gpu_hours:.3f} GPU-h at ${prices.gpu_hour or 0}/h + {chosen.fallback_rows:,} fallback "
                      f"rows at ${prices.fallback_per_row}/row)")
        if policy.on_budget == "spend":
            page = f"spending past the budget to meet the deadline: {arithmetic}"
        elif within:
            keep = max(within, key=lambda o: o.workers)
            page = f"the deadline would cost more than the budget; keeping within it with {_fmt(keep)}. {arithmetic}"
            desired = keep.workers
            action = ADD if desired > current else REMOVE if desired < current else HOLD
            why = f"within the budget: {_fmt(keep)}"
        else:
            cheapest = min(options, key=lambda o: o.bill)
            page = f"no fleet size keeps within the budget; the cheapest is {_fmt(cheapest)}. {arithmetic}"
            desired = cheapest.workers
            action = ADD if desired > current else REMOVE if desired < current else HOLD
            why = f"over the budget whatever the size; the cheapest: {_fmt(cheapest)}"
    return Decision(now, current, desired, action if desired != current else HOLD, why, per_worker, options, page)


# -- the ledger (sync: launchers, the CLI) -------------------------------------------------


def desired_size(conn: Any, job_version: str) -> int | None:
    """The fleet's desired size, or None before the autopilot decided."""
    from batch_inference import db

    row = conn.execute(db.q("fleet_size"), {"job": job_version}).fetchone()
    return None if row is None else int(row["desired"])


def record(conn: Any, job_version: str, decision: Decision) -> None:
    from batch_inference import db

    conn.execute(db.q("fleet_decide"), decision.params(job_version))


def observe(conn: Any, job_version: str, launcher: str, running: int) -> None:
    """What ``launcher`` runs now (a row only when that changed): the GPU-hours' source."""
    from batch_inference import db

    conn.execute(db.q("fleet_observe"), {"job": job_version, "launcher": launcher, "running": int(running)})


def gpu_hours(conn: Any, job_version: str) -> float:
    """The batch workers' GPU-hours so far, from every launcher's record."""
    from batch_inference import db

    return float(conn.execute(db.q("fleet_gpu_seconds"), {"job": job_version}).fetchone()["worker_seconds"]) / 3600.0


def reconcile(conn: Any, job_version: str, launcher: str, running: Callable[[], int], scale: Callable[[int], Any],
              default: int, bounds: tuple[int, int] | None = None) -> int:
    """One pass of a launcher: read the desired size (``default`` before any decision), clamp it to
    ``bounds``, make the launcher run that many (``scale``), and record what it runs. Returns the
    size it reconciled to. A restarted launcher calls this first and resumes from the ledger."""
    want = desired_size(conn, job_version)
    want = default if want is None else want
    if bounds is not None:
        want = max(bounds[0], min(bounds[1], want))
    if running() != want:
        scale(want)
    observe(conn, job_version, launcher, running())
    return want

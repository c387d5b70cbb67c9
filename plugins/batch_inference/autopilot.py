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

This is the autopilot of one fleet at one price: a job version with no deployment, or one
cluster. A version placed over several clusters (``batch_inference.regions``) is steered per
cluster by ``regions.ClusterPilot`` with this module's policy, throughput and hysteresis: each
cluster's size at its own price (spot or on demand, egress counted), recorded per cluster
(bi.fleet_decisions.cluster, bi.fleet_cluster_size), with steal gates and lost regions.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

from batch_inference.cost import Prices, cents, rows_within

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
    # How long a batch worker may run once the cutoff fires: it learns fallback mode at its next
    # renewal and holds nothing once its lease runs out, when the launchers end it (``drain_s``).
    drain_s: float = 0.0

    @classmethod
    def from_spec(cls, spec: Any) -> "Policy":
        c, a = spec.cost, spec.autopilot
        return cls(min_workers=c.min_workers, max_workers=c.max_workers, margin_s=a.margin_s, start_s=a.start_s,
                   cooldown_s=a.cooldown_s, window_s=a.window_s,
                   budget=None if c.budget is None else Decimal(str(c.budget)), on_budget=c.on_budget,
                   drain_s=drain_s(spec))

    @property
    def keeps_budget(self) -> bool:
        """``on_budget: page`` with a budget: no option over it is taken."""
        return self.budget is not None and self.on_budget == "page"

    def clamp(self, n: int) -> int:
        return max(self.min_workers, min(self.max_workers, int(n)))


def drain_s(spec: Any) -> float:
    """The longest a batch worker runs after the cutoff fires: until its next renewal refuses it, then
    its lease's length at most (the launchers end a worker whose lease has run out)."""
    return float(spec.lease_seconds) + float(spec.renew_seconds)


def hosted(spec: Any) -> bool:
    """The job's engine is a hosted batch transport: its records go to a provider's batch API, so its
    workers are no GPU workers. The autopilot does not steer them and the bill has no GPU-hours."""
    from batch_inference.engines import engine_class

    try:
        return getattr(engine_class(spec.engine.name), "transport", "batch") == "hosted_batch"
    except (ValueError, ImportError):   # an engine that cannot be loaded here is none of the hosted ones
        return False


def steers(spec: Any) -> bool:
    """The autopilot steers this job's fleet: it is enabled and the workers are GPU workers."""
    return bool(spec.autopilot.enabled) and not hosted(spec)


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
    fallback_rows: int             # rows the fallback pool re-drives
    gpu_hours: float               # still to run, the drain after the cutoff included
    bill: Decimal                  # the night's projected bill
    within_budget: bool = True
    pending_rows: int = 0          # with on_budget page: rows the pool leaves pending at the budget
    batch_rows: int = 0            # rows our own workers store

    def to_dict(self) -> dict[str, Any]:
        return {"workers": self.workers, "finish": self.finish.isoformat() if self.finish else None,
                "fire": self.fire.isoformat() if self.fire else None, "meets": self.meets,
                "fallback_rows": self.fallback_rows, "pending_rows": self.pending_rows,
                "gpu_hours": round(self.gpu_hours, 6), "bill": float(cents(self.bill)),
                "within_budget": self.within_budget}


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
    the moving cutoff fires (and then ``drain_s`` more); the bill is ``spent`` plus the GPU-hours, the
    batch's rows and the fallback's. With ``on_budget: page`` the fallback is priced as the pool spends:
    only the rows the rest of the budget affords, the others left pending."""
    cut = (deadline - now).total_seconds() - overhead_s          # the cutoff's last moment, from now
    first = min(current, workers) if workers > current else workers
    how, t, left = _segment(0.0, policy.start_s if workers > current else math.inf, float(outstanding),
                            first * per_worker, cut, fb_rate)
    if how == "open":
        how, t, left = _segment(t, math.inf, left, workers * per_worker, cut, fb_rate)
    fb_rows = math.ceil(left) if how == "fire" else 0
    run_s = t + (policy.drain_s if how == "fire" else 0.0)
    gpu_h = workers * run_s / 3600.0 if math.isfinite(run_s) else 0.0
    batch_rows = outstanding - fb_rows
    before_fb = spent + prices.gpu_cost(Decimal(str(gpu_h))) + batch_rows * prices.own_row
    pending = 0
    if policy.keeps_budget and fb_rows:
        paid = rows_within(policy.budget, before_fb, prices.fallback_per_row)
        pending = 0 if paid is None else max(0, fb_rows - paid)
    fb_rows -= pending
    bill = before_fb + fb_rows * prices.fallback_per_row
    finish = now + timedelta(seconds=t) if how == "finish" else None
    return Option(workers=workers, finish=finish, fire=now + timedelta(seconds=t) if how == "fire" else None,
                  meets=how == "finish" and t <= cut - policy.margin_s, fallback_rows=fb_rows, gpu_hours=gpu_h,
                  bill=bill, within_budget=policy.budget is None or bill <= policy.budget, pending_rows=pending,
                  batch_rows=batch_rows)


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


def longest_bill(workers: int, outstanding: int, now: datetime, deadline: datetime, overhead_s: float,
                 policy: Policy, prices: Prices, spent: Decimal) -> Decimal:
    """The bill before the fallback's rows were ``workers`` to run as long as they can: until the
    cutoff's last moment (the moving cutoff has fired by then if the batch has not finished) and
    ``drain_s`` after it, every outstanding row stored by them."""
    cut = max(0.0, (deadline - now).total_seconds() - overhead_s)
    gpu_h = Decimal(str(workers * (cut + policy.drain_s) / 3600.0))
    return spent + prices.gpu_cost(gpu_h) + outstanding * prices.own_row


def _fmt(o: Option) -> str:
    if o.finish:
        end = f"finish {o.finish:%H:%M:%S}"
    else:
        end = f"cutoff fires {o.fire:%H:%M:%S}, {o.fallback_rows:,} rows re-driven" + \
            (f", {o.pending_rows:,} left pending at the budget" if o.pending_rows else "")
    return f"{o.workers} worker(s): {end}, bill ${cents(o.bill):,}"


def arithmetic(o: Option, policy: Policy, prices: Prices, spent: Decimal) -> str:
    """The sum behind ``o.bill``, term by term: what the page says of the option it names."""
    own = f" + {o.batch_rows:,} batch rows at ${prices.own_row}/row" if prices.own_row else ""
    pending = f"; {o.pending_rows:,} rows left pending" if o.pending_rows else ""
    return (f"budget ${cents(policy.budget or Decimal(0)):,}: {_fmt(o)} (spent ${cents(spent):,} + "
            f"{o.gpu_hours:.4f} GPU-h at ${prices.gpu_hour or 0}/h{own} + {o.fallback_rows:,} fallback rows at "
            f"${prices.fallback_per_row}/row{pending})")


def stop_at_budget(now: datetime, running: int, per_worker: float | None, policy: Policy, prices: Prices,
                   spent: Decimal, current: int | None = None) -> Decision | None:
    """With ``on_budget: page``: the fleet of ``running`` workers stops (desired size 0) once not even
    their drain is within the budget after ``spent``, measured or not; None while it is. The autopilot's
    first check (``decide``), and the cutoff watch's for a fixed fleet (the autopilot off), whose
    launchers follow a desired size of 0 only (``reconcile``)."""
    if not (policy.keeps_budget and drain_over(running, policy, prices, spent)):
        return None
    why = f"no fleet size keeps within the budget; the fleet stops: {drain_sum(running, policy, spent)}"
    return Decision(now, running if current is None else current, 0, REMOVE, why, per_worker, (), why)


def drain_over(running: int, policy: Policy, prices: Prices, spent: Decimal) -> bool:
    """``running`` workers' drain after ``spent`` is over the budget (False without one)."""
    return policy.budget is not None and running > 0 and \
        spent + prices.gpu_cost(Decimal(str(running * policy.drain_s / 3600))) > policy.budget


def drain_sum(running: int, policy: Policy, spent: Decimal) -> str:
    return (f"spent ${cents(spent):,} + {running} worker(s)' drain of {policy.drain_s:g}s is over the budget "
            f"${cents(policy.budget or Decimal(0)):,}")


def decide(now: datetime, deadline: datetime, outstanding: int, per_worker: float | None, current: int,
           fb_rate: float, overhead_s: float, policy: Policy, prices: Prices, spent: Decimal = Decimal(0),
           last_change: datetime | None = None, shards_left: int | None = None, steady: bool = True,
           last_action: str | None = None) -> Decision:
    """The fleet size for this poll (pure). ``current``: the desired size in force (the launchers'
    target); ``last_change``: when it was set (or the first claim), for the cooldown, and ``last_action``
    what that change was; ``spent``: the bill so far; ``shards_left``: shards pending or leased, beyond
    which a worker has nothing to claim; ``steady``: the throughput covers a whole window
    (``Throughput.steady``), else nothing is removed.

    With ``on_budget: page`` no size over the budget is taken: the options are priced as the pool
    would spend (``project``), a worker is added only if the budget pays for it even at
    ``REMOVE_DERATE`` of the measured throughput (its start-up and its drain included), a size that
    went over is left at once for the largest within it (0 when none is: the budget beats the
    bounds), and within the cooldown a removal is not followed by an add."""
    spec_bounds = policy
    if shards_left is not None and shards_left < policy.max_workers:
        policy = Policy(**{**policy.__dict__, "max_workers": max(policy.min_workers, shards_left)})
    keep = policy.keeps_budget
    start = 0 if keep and current == 0 else policy.clamp(current)     # a fleet the budget stopped stays stopped
    if outstanding <= 0:
        return Decision(now, current, current, HOLD, "nothing outstanding", per_worker)
    stop = stop_at_budget(now, start, per_worker, policy, prices, spent, current)
    if stop is not None:
        return stop
    if per_worker is None or per_worker <= 0:
        # The spec's bounds only: a worker beyond the shards left exits by itself once it finds nothing
        # to claim, and removing it here would undo an add within its cooldown (a watch re-armed after
        # a page measures the throughput afresh).
        size = current if keep and current == 0 else spec_bounds.clamp(current)
        action = HOLD if size == current else (ADD if size > current else REMOVE)
        return Decision(now, current, size, action, "no throughput measured yet: the bounds' size", per_worker)

    def at(n: int, rate: float = per_worker) -> Option:
        return project(n, current, rate, outstanding, now, deadline, fb_rate, overhead_s, policy, prices, spent)

    options = tuple(at(n) for n in range(policy.min_workers, policy.max_workers + 1))
    by_n = {o.workers: o for o in options}
    affordable = [o for o in options if o.within_budget] if keep else list(options)
    meeting = [o for o in affordable if o.meets]
    want: Option | None
    if meeting:
        want = meeting[0]
        why = f"fewest workers finishing {policy.margin_s:g}s before the cutoff's last moment: {_fmt(want)}"
    elif keep and affordable:
        want = min(affordable, key=lambda o: (o.pending_rows, o.bill, o.workers))
        why = f"no size within the budget finishes before the cutoff; the fewest rows left pending: {_fmt(want)}"
    elif keep:
        want = None
        why = "no size keeps within the budget"
    else:
        want = min(options, key=lambda o: (o.bill, -o.workers))
        why = f"no size finishes before the cutoff; the cheapest night: {_fmt(want)}"
    cur = by_n.get(start)
    here = _fmt(cur) if cur is not None else f"{start} worker(s)"
    cooled = last_change is None or (now - last_change).total_seconds() >= policy.cooldown_s
    desired, action = start, HOLD
    if want is None:
        pass   # left below: the fleet stops
    elif want.workers > start:
        if not keep:
            desired, action = want.workers, ADD
        elif last_action == REMOVE and not cooled:
            why = f"behind, holding {start} (a removal within the cooldown is not followed by an add): {here}"
        else:
            # Paid for before it starts: the budget covers the fleet running until the cutoff's last
            # moment and its drain after, the longest it can run whatever the throughput does, so an add
            # is never undone by the budget within its cooldown.
            paid = [n for n in range(want.workers, start, -1)
                    if by_n[n].within_budget and longest_bill(n, outstanding, now, deadline, overhead_s, policy,
                                                               prices, spent) <= policy.budget]
            if paid:
                desired, action = paid[0], ADD
                if paid[0] != want.workers:
                    why = (f"{why}; the budget pays for {paid[0]} running until the cutoff's last moment and "
                           f"its drain: {_fmt(by_n[paid[0]])}")
            else:
                why = f"behind, holding {start} (no added worker is paid for within the budget): {here}"
    elif want.workers < start and cur is not None and cur.meets:
        # Remove only with a second margin to spare and past the cooldown: no flapping.
        slow = [at(o.workers, per_worker * REMOVE_DERATE) for o in options if o.workers < start]
        early = [o for o in slow if o.finish is not None
                 and (o.finish - now).total_seconds() <= (deadline - now).total_seconds() - overhead_s
                 - 2 * policy.margin_s]
        early = [by_n[o.workers] for o in early if by_n[o.workers] in affordable]
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
    if keep and (want is None or (desired > 0 and not by_n[desired].within_budget)):
        # The size in force went over the budget: the largest size within it, at once (the budget is
        # hard, the cooldown is not); none within it: the fleet stops.
        below = [o for o in affordable if o.workers < desired]
        if below:
            desired = below[-1].workers
            why = f"over the budget with {start}; the largest size within it: {_fmt(below[-1])}"
        else:
            desired = 0
            why = "no fleet size keeps within the budget; the fleet stops: " + _fmt(at(0))
        action = REMOVE if desired < current else HOLD
    if desired == 0 and 0 not in by_n:
        by_n[0] = at(0)             # the stopped fleet's projection, recorded with the others
        options = (by_n[0], *options)
    page = None
    chosen = by_n[desired]
    if policy.budget is not None:
        sums = arithmetic(chosen, policy, prices, spent)
        if policy.on_budget == "spend":
            if chosen.bill > policy.budget:
                page = f"spending past the budget to meet the deadline: {sums}"
        elif (not meeting and any(o.meets for o in options)) or chosen.pending_rows:
            head = ("no fleet size keeps within the budget; the fleet stops" if desired == 0 else
                    f"the deadline cannot be met within the budget; keeping within it with {chosen.workers} "
                    "worker(s)")
            page = f"{head}. {sums}"
    return Decision(now, current, desired, action if desired != current else HOLD, why, per_worker, options, page)


# -- the ledger (sync: launchers, the CLI) -------------------------------------------------


def desired_size(conn: Any, job_version: str, cluster: str | None = None) -> int | None:
    """The fleet's desired size, or None before the autopilot decided; with ``cluster``, that cluster's
    (a version placed over several clusters: ``regions.ClusterPilot``), else the fleet's."""
    from batch_inference import db

    if cluster:
        row = conn.execute(db.q("fleet_cluster_size"), {"job": job_version, "cluster": cluster}).fetchone()
        if row is not None:
            return int(row["desired"])
    row = conn.execute(db.q("fleet_size"), {"job": job_version}).fetchone()
    return None if row is None else int(row["desired"])


def launcher_cluster(launcher: str) -> str | None:
    """The cluster a launcher runs (``NAME@CLUSTER``), or None."""
    head, at, cluster = launcher.rpartition("@")
    return cluster if at and head and cluster else None


def record(conn: Any, job_version: str, decision: Decision) -> None:
    from batch_inference import db

    conn.execute(db.q("fleet_decide"), decision.params(job_version))


def observe(conn: Any, job_version: str, launcher: str, running: int) -> None:
    """What ``launcher`` runs now (a row only when that changed): the GPU-hours' source."""
    from batch_inference import db

    conn.execute(db.q("fleet_observe"), {"job": job_version, "launcher": launcher, "running": int(running)})


def gpu_hours(conn: Any, job_version: str, spec: Any = None) -> float:
    """The batch workers' GPU-hours so far, from every launcher's record; 0 for a job whose engine is a
    hosted batch transport (``spec``, read from the ledger when not given): its workers hand the records
    to a provider, no GPU."""
    from batch_inference import db
    from batch_inference.spec import stored_spec

    if spec is None:
        row = conn.execute(db.q("job_spec"), {"job": job_version}).fetchone()
        spec = None if row is None else stored_spec(row["spec"])
    if spec is not None and hosted(spec):
        return 0.0
    return float(conn.execute(db.q("fleet_gpu_seconds"), {"job": job_version}).fetchone()["worker_seconds"]) / 3600.0


def reconcile(conn: Any, job_version: str, launcher: str, running: Callable[[], int], scale: Callable[[int], Any],
              default: int, bounds: tuple[int, int] | None = None, follow: bool = True) -> int:
    """One pass of a launcher: read the desired size (``default`` before any decision), clamp it to
    ``bounds``, make the launcher run that many (``scale``), and record what it runs. Returns the
    size it reconciled to. A restarted launcher calls this first and resumes from the ledger.
    ``follow`` False: a fixed fleet (the autopilot off), which follows only the budget's stop (a
    desired size of 0, ``stop_at_budget``) and otherwise keeps what it runs. A launcher of one cluster of a
    version placed over several (named ``NAME@CLUSTER``) follows that cluster's size once the regions'
    autopilot has sized it."""
    want = desired_size(conn, job_version, launcher_cluster(launcher))
    if not follow:
        want = 0 if want == 0 else running()
    want = default if want is None else want
    if bounds is not None and want != 0:      # 0 comes only from the budget (on_budget: page): it beats the bounds
        want = max(bounds[0], min(bounds[1], want))
    if running() != want:
        scale(want)
    observe(conn, job_version, launcher, running())
    return want

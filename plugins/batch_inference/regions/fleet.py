"""One autopilot over every cluster of a job version placed over regions (``ClusterPilot``).

At every poll it takes one worker's measured throughput (``autopilot.Throughput`` over the workers
of every cluster), the records outstanding, what each cluster runs and the deadline, and decides
each cluster's size (``decide_clusters``, pure):

* **behind** (the fleet in force does not finish the outstanding records ``margin_s`` before the
  cutoff's last moment, the deadline less the fallback's overhead): workers are added where a
  record is cheapest (``planner.choose``: spot where its interruption rate allows and spot is the
  cheaper, on demand where not, a spot worker's throughput derated by its interruptions, a record
  outside the ledger's region paying egress for its replica in and its result back), each cluster
  up to its capacity, until the added throughput, counted from ``start_s`` on, makes the target.
  Until the throughput is measured over a whole window of rows (``window_s`` since the first rows
  stored, so workers still starting are not read as slow ones) only clusters whose record is no
  dearer than the dearest running are added to: the dearer ones wait for that measure.
  When every cluster of the regions not lost cannot, the decision pages now with the arithmetic, on a
  throughput measured over a whole window only (workers still starting read as slow ones: every night
  paged at its first poll).
* **ahead**: workers are removed where a record is dearest first, one at a time, while the smaller
  fleet at ``REMOVE_DERATE`` of the measured throughput still keeps a second margin; only past the
  cooldown and on a throughput measured over a whole window (the single-cluster hysteresis).
* a cluster of a region found lost (``lost.watch``) is sized 0.

Each cluster's decision is a row of bi.fleet_decisions with its cluster and reason, and its size
the cluster's desired size (bi.fleet_cluster_size), which the cluster's launcher reconciles to
(``reconcile``). A job version on one cluster (or none) is the single-cluster autopilot's
(``autopilot.decide``), unchanged.

Steals (``steal_gates``, pure): a region's shards may be taken by workers of another region only
when its remaining records cannot finish by the deadline with its own workers (none left: a
region lost, or none started there), the gate recorded with that sum (bi.set_steal_gate_v1) and
each steal with its egress price (bi.claim_shard_region_v2); an open gate closes only when the region's
own workers finish at ``REMOVE_DERATE`` of their rate (the sizes' hysteresis, for the gates).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import psycopg

from batch_inference.autopilot import ADD, HOLD, REMOVE, REMOVE_DERATE, Policy, Throughput
from batch_inference.db import q
from batch_inference.regions.deployment import Deployment, parse_deployment
from batch_inference.regions.lost import watch as watch_lost
from batch_inference.regions.planner import Choice, Workload, choose

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClusterDecision:
    """One cluster's size for this poll and why."""

    cluster: str
    region: str
    capacity: str            # spot | on_demand (planner.choose), "" for a cluster of a lost region
    hour_usd: float
    record_usd: float
    current: int
    desired: int
    action: str
    reason: str

    def params(self, job_version: str, per_worker: float | None, page: str | None, bill_without: float | None,
               bill_with: float | None, finish_without: datetime | None, finish_with: datetime | None
               ) -> dict[str, Any]:
        """The ``fleet_cluster_decide`` statement's parameters."""
        return {"job": job_version, "cluster": self.cluster, "current": self.current, "desired": self.desired,
                "action": self.action, "reason": self.reason, "per_worker": per_worker,
                "finish_without": finish_without, "finish_with": finish_with,
                "bill_without": None if bill_without is None else round(bill_without, 6),
                "bill_with": None if bill_with is None else round(bill_with, 6), "page": page,
                "options": json.dumps([{"region": self.region, "capacity": self.capacity, "hour_usd": self.hour_usd,
                                        "record_usd": self.record_usd}])}


@dataclass(frozen=True)
class FleetDecision:
    """Every cluster's decision of one poll, the projection with and without the changes, and a page."""

    now: datetime
    clusters: tuple[ClusterDecision, ...]
    per_worker: float | None
    finish_without: datetime | None = None
    finish_with: datetime | None = None
    bill_without: float | None = None       # the GPU-hours and egress still to spend, at the sizes in force
    bill_with: float | None = None          # the same at the desired sizes
    page: str | None = None

    def sizes(self) -> dict[str, int]:
        return {c.cluster: c.desired for c in self.clusters}

    @property
    def changed(self) -> bool:
        return any(c.action != HOLD for c in self.clusters)

    def to_dict(self) -> dict[str, Any]:
        return {"at": self.now.isoformat(), "per_worker": self.per_worker, "page": self.page,
                "bill_without": self.bill_without, "bill_with": self.bill_with,
                "clusters": [{"cluster": c.cluster, "region": c.region, "capacity": c.capacity, "current": c.current,
                              "desired": c.desired, "action": c.action, "reason": c.reason} for c in self.clusters]}


def workload(deployment: Deployment, ledger_region: str, outstanding: int, per_worker: float, time_left_s: float,
             policy: Policy, shard_s: float, replica_bytes: float = 400.0, result_bytes: float = 300.0,
             max_spot_interruption: float = 0.2) -> Workload:
    """The planner's workload for the rest of the night (its prices per record are ``choose``'s)."""
    return Workload(records=max(0, outstanding), per_worker=per_worker, deadline_s=time_left_s,
                    ledger_region=ledger_region, replica_bytes=replica_bytes, result_bytes=result_bytes,
                    start_s=policy.start_s, shard_s=shard_s, margin_s=policy.margin_s,
                    max_spot_interruption=max_spot_interruption)


def _finish_s(outstanding: int, before: float, after: float, start_s: float) -> float:
    """Seconds to finish ``outstanding`` at ``before`` records/s for ``start_s`` (the added workers
    starting), then ``after``; inf when nothing produces."""
    if after <= 0:
        return math.inf
    if after <= before or start_s <= 0:
        return outstanding / after
    early = before * start_s
    return outstanding / before if before > 0 and early >= outstanding else start_s + (outstanding - early) / after


def _bill(sizes: Mapping[str, int], choices: Mapping[str, Choice], finish_s: float, outstanding: int,
          share: Mapping[str, float]) -> float:
    """GPU dollars of ``sizes`` running ``finish_s``, and each cluster's share of the records' egress."""
    if not math.isfinite(finish_s):
        return math.inf
    gpu = sum(sizes[c] * choices[c].hour_usd * finish_s / 3600 for c in sizes if c in choices)
    return gpu + sum(outstanding * share.get(c, 0.0) * choices[c].transfer_usd for c in sizes if c in choices)


def decide_clusters(now: datetime, deadline: datetime, outstanding: int, per_worker: float | None,
                    current: Mapping[str, int], deployment: Deployment, ledger_region: str, overhead_s: float,
                    policy: Policy, *, shard_s: float, lost: set[str] | frozenset[str] = frozenset(),
                    last_change: datetime | None = None, steady: bool = True, shards_left: int | None = None,
                    replica_bytes: float = 400.0, result_bytes: float = 300.0,
                    max_spot_interruption: float = 0.2, remaining: Mapping[str, int] | None = None,
                    open_gates: set[str] | frozenset[str] = frozenset(), settled: bool | None = None) -> FleetDecision:
    """Each cluster's size for this poll (pure; the module docstring). ``current``: each cluster's size in
    force; ``lost``: the regions found lost; ``last_change``: the last change of any cluster's size (or the
    first claim), for the cooldown; ``shards_left``: shards pending or leased, beyond which a worker has
    nothing to claim; ``remaining``: each region's records not done, and ``open_gates`` the regions whose
    steal gate is open: a cluster whose region has none left while no other region's gate is open has
    nothing to claim (idle: sized 0 at once, and no worker added there this poll); ``settled``: the throughput
    is measured over a whole window of rows (``steady`` when not given), before which no worker is added where
    a record is dearer than the dearest running."""
    target = (deadline - now).total_seconds() - overhead_s - policy.margin_s
    cur = {c.name: int(current.get(c.name, 0)) for c in deployment.clusters}
    out: dict[str, tuple[str, str]] = {}       # cluster -> (action, reason)
    desired = dict(cur)
    for c in deployment.clusters:
        if c.region in lost:
            desired[c.name] = 0
            out[c.name] = (REMOVE if cur[c.name] else HOLD, f"region {c.region} lost: its workers are gone")
    if remaining is not None:
        for c in deployment.clusters:
            if c.region not in lost and remaining.get(c.region, 0) <= 0 and not set(open_gates) - {c.region}:
                desired[c.name] = 0
                out[c.name] = (REMOVE if cur[c.name] else HOLD,
                               f"idle: {c.region} has no records left and no other region's steal gate is open")
    idle = {n for n, (_, why) in out.items() if why.startswith("idle")}
    live = [c for c in deployment.clusters if c.region not in lost and c.name not in idle]

    def finish(decision: list[ClusterDecision], page: str | None = None, **kw: Any) -> FleetDecision:
        return FleetDecision(now, tuple(decision), per_worker, page=page, **kw)

    if outstanding <= 0 or per_worker is None or per_worker <= 0:
        why = "nothing outstanding" if outstanding <= 0 else "no throughput measured yet: the sizes in force"
        return finish([ClusterDecision(c.name, c.region, "", 0.0, 0.0, cur[c.name], desired[c.name],
                                       *out.get(c.name, (HOLD, why))) for c in deployment.clusters])
    w = workload(deployment, ledger_region, outstanding, per_worker, target + overhead_s + policy.margin_s, policy,
                 shard_s, replica_bytes, result_bytes, max_spot_interruption)
    choices = {c.name: choose(c, deployment, w) for c in live}
    by_cost = sorted(live, key=lambda c: (choices[c.name].record_usd, c.name))
    rate = {n: ch.per_worker for n, ch in choices.items()}
    cur_rate = sum(cur[n] * rate[n] for n in choices)
    page = None
    cooled = last_change is None or (now - last_change).total_seconds() >= policy.cooldown_s
    room_total = max(0, shards_left - sum(cur.values())) if shards_left is not None else math.inf
    if cur_rate * max(target, 0.0) < outstanding:
        # Behind: the added workers produce from start_s on.
        useful = target - policy.start_s
        short = outstanding - cur_rate * max(target, 0.0)
        need = short / useful if useful > 0 else math.inf
        added = 0.0
        # Before the throughput is measured over a whole window of rows (workers still starting read as slow ones)
        # workers go only where a record costs no more than the dearest one running now: a dearer cluster waits
        # for that measure, which adds it there if the fleet is still behind.
        ceiling = math.inf
        if not (steady if settled is None else settled) and any(cur[c.name] for c in live):
            ceiling = max(choices[c.name].record_usd for c in live if cur[c.name])
        for c in by_cost:
            if added >= need or room_total <= 0:
                break
            ch = choices[c.name]
            if ch.record_usd > ceiling:
                out[c.name] = (HOLD, f"behind, holding {cur[c.name]} here: its record (${ch.record_usd * 1e6:,.2f} per "
                                     f"million) is dearer than any running, and the throughput is not yet measured "
                                     f"over a whole window of rows")
                continue
            room = max(0, c.capacity - cur[c.name])
            k = room if math.isinf(need) else min(room, math.ceil((need - added) / ch.per_worker))
            k = int(min(k, room_total))
            if k <= 0:
                continue
            desired[c.name] = cur[c.name] + k
            room_total -= k
            added += k * ch.per_worker
            out[c.name] = (ADD, f"behind: {outstanding:,} records need {need:.2f} more records/s from "
                                f"{policy.start_s:g}s on; +{k} here at ${ch.record_usd * 1e6:,.2f} per million "
                                f"records ({ch.reason})")
        for c in live:
            if c.name not in out:
                out[c.name] = (HOLD, f"behind, holding {cur[c.name]} here: at its capacity" if cur[c.name] >= c.capacity
                               else f"behind, holding {cur[c.name]} here: cheaper records elsewhere cover the "
                                    f"{need:.2f} records/s wanted")
        if added < need and steady:
            capacity = sum(c.capacity * choices[c.name].per_worker for c in live)
            page = (f"the deadline cannot be met across the clusters{' not lost' if lost else ''}: {outstanding:,} "
                    f"records need {cur_rate + need:.2f} records/s for {max(useful, 0):.0f}s, every cluster's "
                    f"capacity gives {capacity:.2f} records/s ({sum(c.capacity for c in live)} workers at "
                    f"{per_worker:.2f} records/s before interruptions): page now")
    else:
        # Ahead: the dearest record first, one worker at a time, while two margins are kept at the derate.
        keep = target - policy.margin_s
        total = sum(desired[c.name] for c in live)
        held = ("within the cooldown" if not cooled else
                "the throughput is not yet measured over a whole window" if not steady else "")
        for c in reversed(by_cost):
            while not held and desired[c.name] > 0 and total > policy.min_workers:
                after = sum(desired[n] * rate[n] for n in choices) - rate[c.name]
                if after * REMOVE_DERATE * max(keep, 0.0) < outstanding:
                    break
                desired[c.name] -= 1
                total -= 1
            if desired[c.name] < cur[c.name]:
                ch = choices[c.name]
                out[c.name] = (REMOVE, f"ahead: -{cur[c.name] - desired[c.name]} here, the dearest record "
                                       f"(${ch.record_usd * 1e6:,.2f} per million), a second margin of "
                                       f"{policy.margin_s:g}s kept at {REMOVE_DERATE:.0%} of the measured throughput")
        for c in live:
            if c.name not in out:
                out[c.name] = (HOLD, f"ahead, holding ({held})" if held else "on course")
    new_rate = sum(desired[n] * rate[n] for n in choices)
    share = {n: desired[n] * rate[n] / new_rate if new_rate else 0.0 for n in choices}
    added = any(desired[n] > cur[n] for n in choices)
    f_without = _finish_s(outstanding, cur_rate, cur_rate, 0.0)
    f_with = _finish_s(outstanding, cur_rate, new_rate, policy.start_s if added else 0.0)
    old_share = {n: cur[n] * rate[n] / cur_rate if cur_rate else 0.0 for n in choices}

    def at(s: float) -> datetime | None:
        return now + timedelta(seconds=s) if math.isfinite(s) else None

    decisions = []
    for c in deployment.clusters:
        ch = choices.get(c.name)
        action, why = out.get(c.name, (HOLD, "on course"))
        if action == HOLD and desired[c.name] == cur[c.name] and why == "on course" and ch is not None:
            why = f"on course: {desired[c.name]} worker(s) on {ch.capacity} (${ch.record_usd * 1e6:,.2f} per million)"
        decisions.append(ClusterDecision(c.name, c.region, ch.capacity if ch else "", ch.hour_usd if ch else 0.0,
                                         ch.record_usd if ch else 0.0, cur[c.name], desired[c.name],
                                         action if desired[c.name] != cur[c.name] else HOLD, why))
    return finish(decisions, page, finish_without=at(f_without), finish_with=at(f_with),
                  bill_without=_bill(cur, choices, f_without, outstanding, old_share),
                  bill_with=_bill(desired, choices, f_with, outstanding, share))


@dataclass(frozen=True)
class Gate:
    region: str
    open: bool
    reason: str


def steal_gates(now: datetime, deadline: datetime, overhead_s: float, margin_s: float,
                remaining: Mapping[str, int], running: Mapping[str, int], deployment: Deployment,
                per_worker: float | None, lost: set[str] | frozenset[str] = frozenset(), *,
                ledger_region: str, policy: Policy, shard_s: float, max_spot_interruption: float = 0.2,
                was_open: set[str] | frozenset[str] = frozenset()) -> list[Gate]:
    """Each region's steal gate (pure): open when its ``remaining`` records cannot finish by the target (the
    deadline less the overhead and the margin) with its own ``running`` workers (per cluster) at their
    rate (``choose``'s: spot derated by its interruptions); a region lost or with no worker of its own
    and records left is open whatever was measured. A gate open now (``was_open``) closes only when its
    own workers finish its records at ``REMOVE_DERATE`` of that rate, the autopilot's own hysteresis: a
    gate that flapped with the measured rate around its sum sized another region's clusters up and down
    with it (idle at every close), each add paying a start-up."""
    left_s = max(0.0, (deadline - now).total_seconds() - overhead_s - margin_s)
    out = []
    for region in deployment.regions():
        todo = int(remaining.get(region, 0))
        mine = [c for c in deployment.clusters if c.region == region]
        workers = sum(int(running.get(c.name, 0)) for c in mine)
        if todo <= 0:
            out.append(Gate(region, False, f"{region} has no records left"))
            continue
        if region in lost:
            out.append(Gate(region, True, f"{region} lost: {todo:,} records left and none of its own workers"))
            continue
        if workers == 0:
            out.append(Gate(region, True, f"{region}: {todo:,} records left and no worker of its own running"))
            continue
        if per_worker is None or per_worker <= 0:
            out.append(Gate(region, False, f"{region}: {workers} worker(s) of its own, no throughput measured yet"))
            continue
        w = workload(deployment, ledger_region, todo, per_worker, left_s, policy, shard_s,
                     max_spot_interruption=max_spot_interruption)
        rate = sum(int(running.get(c.name, 0)) * choose(c, deployment, w).per_worker for c in mine)
        can = rate * left_s
        sums = (f"{todo:,} records left at {workers} worker(s) x {rate / workers:.2f} records/s = {can:,.0f} in "
                f"the {left_s:.0f}s before the deadline's overhead and margin")
        if todo > can:
            out.append(Gate(region, True, f"{region}: {sums}: it needs help"))
        elif region in was_open and todo > can * REMOVE_DERATE:
            out.append(Gate(region, True, f"{region}: {sums}, {can * REMOVE_DERATE:,.0f} at {REMOVE_DERATE:.0%} "
                                          f"(its gate open): it needs help"))
        else:
            out.append(Gate(region, False, f"{region}: {sums}"))
    return out


# -- the ledger (sync: the launchers) ------------------------------------------------------


def record(conn: psycopg.Connection, job_version: str, decision: FleetDecision) -> None:
    for c in decision.clusters:
        conn.execute(q("fleet_cluster_decide"), c.params(
            job_version, decision.per_worker, decision.page, decision.bill_without, decision.bill_with,
            decision.finish_without, decision.finish_with))


def set_gates(conn: psycopg.Connection, job_version: str, gates: list[Gate]) -> list[Gate]:
    """The gates written; those whose state changed."""
    changed = []
    for g in gates:
        if conn.execute(q("set_steal_gate"), {"job": job_version, "region": g.region, "open": g.open,
                                              "reason": g.reason}).fetchone()["changed"]:
            changed.append(g)
            log.warning("%s: steal gate of %s %s: %s", job_version, g.region, "open" if g.open else "closed",
                        g.reason)
    return changed


def desired_sizes(conn: psycopg.Connection, job_version: str) -> dict[str, dict[str, Any]]:
    """Each cluster's desired size, when it was set and by what action (empty before any decision)."""
    return {r["cluster"]: dict(r) for r in conn.execute(q("fleet_cluster_sizes"), {"job": job_version})}


def launcher_name(launcher: str, cluster: str) -> str:
    """A cluster's launcher as bi.fleet_observed names it (its GPU-seconds are the cluster's)."""
    return f"{launcher}@{cluster}"


def reconcile(conn: psycopg.Connection, job_version: str, launcher: str,
              clusters: Mapping[str, tuple[Callable[[], int], Callable[[int], Any]]],
              default: Mapping[str, int]) -> dict[str, int]:
    """One pass of a launcher of several clusters: each cluster's desired size (``default`` before any
    decision), made so by its ``scale`` (``clusters``: name -> (running, scale)), and what each runs
    recorded (``launcher@cluster``). Returns the sizes it reconciled to."""
    from batch_inference.autopilot import observe

    want = {n: int(r["desired"]) for n, r in desired_sizes(conn, job_version).items()}
    out = {}
    for name, (running, scale) in clusters.items():
        size = want.get(name, int(default.get(name, 0)))
        if running() != size:
            scale(size)
        observe(conn, job_version, launcher_name(launcher, name), running())
        out[name] = size
    return out


def cluster_seconds(conn: psycopg.Connection, job_version: str, launcher: str) -> dict[str, float]:
    """Each cluster's worker-seconds so far, from its launcher's record (``launcher@cluster``)."""
    prefix = f"{launcher}@"
    return {r["launcher"][len(prefix):]: float(r["worker_seconds"])
            for r in conn.execute(q("fleet_launcher_seconds"), {"job": job_version})
            if r["launcher"].startswith(prefix)}


def placed_deployment(conn: psycopg.Connection, job_version: str) -> Deployment | None:
    """The deployment a version was placed on, from the ledger (its clusters' settings and egress prices);
    None for a version on one cluster or none: the single-cluster autopilot's."""
    rows = conn.execute(q("regions_placed_settings"), {"job": job_version}).fetchall()
    if len(rows) < 2:
        return None
    egress = [{"from": r["from_region"], "to": r["to_region"], "usd_per_gb": r["usd_per_gb"]}
              for r in conn.execute(q("region_egress_of_job"), {"job": job_version})]
    ledger = conn.execute(q("region_bill"), {"job": job_version}).fetchone()["ledger_region"]
    regions = {r["region"] for r in rows}
    return parse_deployment({"clusters": [r["settings"] for r in rows], "egress": egress,
                             **({"ledger_region": ledger} if ledger in regions else {})})


def cluster_running(conn: psycopg.Connection, job_version: str) -> dict[str, int]:
    """What each cluster runs, from its launchers' last records (``LAUNCHER@CLUSTER``)."""
    out: dict[str, int] = {}
    for r in conn.execute(q("fleet_running_by_launcher"), {"job": job_version}):
        head, at, cluster = str(r["launcher"]).rpartition("@")
        if at and head:
            out[cluster] = out.get(cluster, 0) + int(r["running"])
    return out


@dataclass
class ClusterPilot:
    """The autopilot over every cluster, one poll at a time (``poll``): regions found lost
    (``lost.watch``), each cluster's size decided and recorded, and the steal gates set."""

    deployment: Deployment
    ledger_region: str
    policy: Policy
    shard_s: float
    overhead_s: float
    replica_bytes: float = 400.0
    result_bytes: float = 300.0
    max_spot_interruption: float = 0.2
    throughput: Throughput | None = None
    last_change: datetime | None = None
    first_rows_at: datetime | None = None       # the first poll that saw rows made
    lost: dict[str, str] = field(default_factory=dict)
    pages: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.throughput is None:
            self.throughput = Throughput(start_s=self.policy.start_s, window_s=self.policy.window_s)

    @classmethod
    def for_job(cls, conn: psycopg.Connection, job_version: str, policy: Policy, overhead_s: float,
                shard_s: float) -> "ClusterPilot | None":
        """The pilot of a version placed over several clusters (its deployment from the ledger); None
        otherwise."""
        d = placed_deployment(conn, job_version)
        return None if d is None else cls(d, d.ledger(), policy, shard_s=shard_s, overhead_s=overhead_s)

    def steer(self, conn: psycopg.Connection, job_version: str, now: datetime, deadline: datetime,
              unreachable: Mapping[str, str] | None = None) -> FleetDecision:
        """One poll from the ledger alone (the cutoff watch's): the counts, and what each cluster runs as its
        launchers last recorded it."""
        from batch_inference.status import job_counts

        c = job_counts(conn, job_version)
        return self.poll(conn, job_version, now, deadline, stored=int(c["stored_batch"]),
                         outstanding=int(c["outstanding"]),
                         shards_left=int(c["shards"]["pending"]) + int(c["shards"]["leased"]),
                         running=cluster_running(conn, job_version), unreachable=unreachable)

    def first(self, conn: psycopg.Connection, job_version: str, now: datetime, sizes: Mapping[str, int],
              reason: str) -> FleetDecision:
        """The night's first sizes (the planner's, at placement), recorded as each cluster's decision."""
        d = FleetDecision(now, tuple(ClusterDecision(c.name, c.region, "", 0.0, 0.0, 0, int(sizes.get(c.name, 0)),
                                                     ADD if sizes.get(c.name, 0) else HOLD, reason)
                                     for c in self.deployment.clusters), None)
        record(conn, job_version, d)
        self.last_change = now
        return d

    def poll(self, conn: psycopg.Connection, job_version: str, now: datetime, deadline: datetime, *,
             stored: int, outstanding: int, shards_left: int, running: Mapping[str, int],
             unreachable: Mapping[str, str] | None = None) -> FleetDecision:
        """One poll: ``stored`` batch rows so far, ``outstanding`` records (the ledger's: the results far workers
        hold, bi.region_held_v1, are counted as stored here), ``running``: what each cluster's launcher runs now;
        ``unreachable``: regions a launcher cannot reach (a Kubernetes API), with why."""
        found = watch_lost(conn, job_version, unreachable=unreachable, known=set(self.lost))
        for f in found:
            self.lost[f["region"]] = f["reason"]
        live = {c.name: int(running.get(c.name, 0)) for c in self.deployment.clusters if c.region not in self.lost}
        assert self.throughput is not None
        # Far workers' results done and held (stored when their shard's file is merged) are measured as they are
        # made, and are no work left: otherwise a night whose workers are all far measures nothing for a shard.
        held = min(int(conn.execute(q("region_held"), {"job": job_version}).fetchone()["held"]), max(outstanding, 0))
        stored, outstanding = stored + held, outstanding - held
        per_worker = self.throughput.add(now.timestamp(), stored, sum(live.values()))
        if stored > 0 and self.first_rows_at is None:
            self.first_rows_at = now
        settled = (self.throughput.steady and self.first_rows_at is not None
                   and (now - self.first_rows_at).total_seconds() >= self.policy.window_s)
        rows = conn.execute(q("region_remaining"), {"job": job_version}).fetchall()
        remaining = {r["region"]: int(r["records_left"]) for r in rows}
        gates = steal_gates(now, deadline, self.overhead_s, self.policy.margin_s, remaining, live, self.deployment,
                            per_worker, set(self.lost), ledger_region=self.ledger_region, policy=self.policy,
                            shard_s=self.shard_s, max_spot_interruption=self.max_spot_interruption,
                            was_open={r["region"] for r in rows if r["gate_open"]})
        set_gates(conn, job_version, gates)
        sizes = {n: int(r["desired"]) for n, r in desired_sizes(conn, job_version).items()}
        current = {c.name: sizes.get(c.name, int(running.get(c.name, 0))) for c in self.deployment.clusters}
        d = decide_clusters(now, deadline, outstanding, per_worker, current, self.deployment, self.ledger_region,
                            self.overhead_s, self.policy, shard_s=self.shard_s, lost=set(self.lost),
                            last_change=self.last_change, steady=self.throughput.steady, shards_left=shards_left,
                            replica_bytes=self.replica_bytes, result_bytes=self.result_bytes,
                            max_spot_interruption=self.max_spot_interruption, remaining=remaining,
                            open_gates={g.region for g in gates if g.open}, settled=settled)
        record(conn, job_version, d)
        if d.changed:
            self.last_change = now
            for c in d.clusters:
                if c.action != HOLD:
                    log.warning("autopilot of %s, cluster %s: %s %d -> %d: %s", job_version, c.cluster, c.action,
                                c.current, c.desired, c.reason)
        if d.page and (not self.pages or found):      # paged once, and again when a region is lost
            self.pages.append(d.page)
            log.error("autopilot of %s: PAGE: %s", job_version, d.page)
        return d


__all__ = ["ClusterDecision", "ClusterPilot", "FleetDecision", "Gate", "cluster_running", "cluster_seconds",
           "decide_clusters", "desired_sizes", "launcher_name", "placed_deployment", "reconcile", "record", "set_gates",
           "steal_gates"]

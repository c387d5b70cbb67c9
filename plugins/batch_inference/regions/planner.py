"""Placement across clusters: the deadline at the least bill, on paper (``plan``), and again when a
region is lost mid-night (``replan``).

For each cluster the planner prices a record on spot and on demand: a GPU-hour's price over the
records a worker makes in an hour, a spot worker's hour derated by its interruptions (each costs a
restart, ``start_s``, and half a shard of lost work, ``shard_s / 2``). Spot is taken where it is the
cheaper of the two and its interruption rate is at most ``max_spot_interruption``; on demand
elsewhere. A record placed outside the ledger's region also pays egress: its replica's bytes read
into the region at placement and its result's bytes merged back (``Deployment.egress_price``).
Clusters are then filled cheapest record first, each up to its capacity, until their throughput
finishes the records ``margin_s`` before the deadline, start-up counted; the shares are in
proportion to throughput, so every cluster ends together. A deadline the whole deployment cannot
meet is said at once with its arithmetic (``Plan.meets`` False: page now, not at the cutoff).

Each cluster's choice carries its reason. The figures are floats: a plan, not a bill (the bill is
``cost``'s, from what the workers recorded).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from batch_inference.regions.deployment import Cluster, Deployment

GB = 1e9


@dataclass(frozen=True)
class Workload:
    records: int
    per_worker: float                  # records/s of one worker (one GPU) of every cluster
    deadline_s: float                  # seconds from now
    ledger_region: str                 # where the snapshot and the merge are
    replica_bytes: float = 400.0       # a record's bytes in its replica
    result_bytes: float = 300.0        # a record's result bytes handed back
    start_s: float = 300.0             # a worker's start before its first record
    shard_s: float = 600.0             # a shard's work on one worker (half is lost at an interruption)
    margin_s: float = 600.0
    max_spot_interruption: float = 0.2  # interruptions per GPU-hour above which spot is not used


@dataclass(frozen=True)
class Choice:
    """One cluster's price of a record, on the capacity it would use."""

    cluster: Cluster
    capacity: str                      # spot | on_demand
    hour_usd: float
    per_worker: float                  # records/s of one worker there, interruptions counted
    transfer_usd: float                # egress a record costs there
    reason: str

    @property
    def record_usd(self) -> float:
        return self.hour_usd / (3600 * self.per_worker) + self.transfer_usd


@dataclass(frozen=True)
class ClusterPlan:
    cluster: str
    region: str
    capacity: str
    workers: int
    records: int
    gpu_hours: float
    gpu_usd: float
    transfer_usd: float
    reason: str


@dataclass(frozen=True)
class Plan:
    meets: bool
    makespan_s: float
    bill_usd: float
    clusters: list[ClusterPlan] = field(default_factory=list)
    arithmetic: str = ""

    def region(self, name: str) -> list[ClusterPlan]:
        return [c for c in self.clusters if c.region == name]


def choose(cluster: Cluster, deployment: Deployment, w: Workload) -> Choice:
    """The cluster's capacity (spot or on demand) and its price of a record (module docstring)."""
    gpu = cluster.gpu
    lost_s = gpu.interruption_rate * (w.start_s + w.shard_s / 2)      # seconds lost per worker-hour
    spot_rate = w.per_worker * max(0.0, 1 - lost_s / 3600)
    transfer = 0.0
    if cluster.region != w.ledger_region:
        into = deployment.egress_price(w.ledger_region, cluster.region) or 0.0
        back = deployment.egress_price(cluster.region, w.ledger_region) or 0.0
        transfer = (w.replica_bytes * into + w.result_bytes * back) / GB
    spot_ok = gpu.interruption_rate <= w.max_spot_interruption and spot_rate > 0
    spot_usd = gpu.spot_per_hour / (3600 * spot_rate) if spot_rate > 0 else math.inf
    od_usd = gpu.on_demand_per_hour / (3600 * w.per_worker)
    if spot_ok and spot_usd <= od_usd:
        return Choice(cluster, "spot", gpu.spot_per_hour, spot_rate, transfer,
                      f"spot: {gpu.interruption_rate:g} interruptions/GPU-hour cost {lost_s:.0f} s an hour; "
                      f"${spot_usd * 1e6:.2f} vs ${od_usd * 1e6:.2f} on demand per million records")
    why = (f"interruption rate {gpu.interruption_rate:g}/GPU-hour over {w.max_spot_interruption:g}"
           if not spot_ok else f"spot's ${spot_usd * 1e6:.2f} per million records after interruptions is "
                                f"more than on demand's ${od_usd * 1e6:.2f}")
    return Choice(cluster, "on_demand", gpu.on_demand_per_hour, w.per_worker, transfer, f"on demand: {why}")


def plan(deployment: Deployment, w: Workload, only: set[str] | None = None) -> Plan:
    """The least bill that meets the deadline over the deployment's clusters (those of the regions in
    ``only``, when given): module docstring."""
    choices = sorted((choose(c, deployment, w) for c in deployment.clusters if only is None or c.region in only),
                     key=lambda ch: ch.record_usd)
    if not choices or w.records <= 0:
        return Plan(True, 0.0, 0.0, arithmetic="nothing to place")
    available = w.deadline_s - w.start_s - w.margin_s
    need = w.records / available if available > 0 else math.inf
    picked: list[tuple[Choice, int]] = []
    rate = 0.0
    for ch in choices:
        if rate >= need:
            break
        n = ch.cluster.capacity if math.isinf(need) else min(ch.cluster.capacity,
                                                             math.ceil((need - rate) / ch.per_worker))
        picked.append((ch, n))
        rate += n * ch.per_worker
    makespan = w.start_s + w.records / rate
    meets = makespan <= w.deadline_s - w.margin_s
    clusters: list[ClusterPlan] = []
    left = w.records
    for i, (ch, n) in enumerate(picked):
        share = left if i == len(picked) - 1 else round(w.records * n * ch.per_worker / rate)
        left -= share
        hours = n * makespan / 3600
        clusters.append(ClusterPlan(ch.cluster.name, ch.cluster.region, ch.capacity, n, share, hours,
                                    hours * ch.hour_usd, share * ch.transfer_usd, ch.reason))
    bill = sum(c.gpu_usd + c.transfer_usd for c in clusters)
    capacity = sum(n * ch.per_worker for ch, n in ((ch, ch.cluster.capacity) for ch in choices))
    arithmetic = (f"{w.records:,} records at {rate:.1f} records/s from {sum(n for _, n in picked)} workers: "
                  f"done in {makespan / 3600:.2f} h against {w.deadline_s / 3600:.2f} h less a "
                  f"{w.margin_s / 60:.0f} min margin; ${bill:,.2f}")
    if not meets:
        arithmetic += (f"; the clusters' whole capacity ({capacity:.1f} records/s) needs "
                       f"{w.start_s / 3600 + w.records / capacity / 3600:.2f} h: page now")
    return Plan(meets, makespan, bill, clusters, arithmetic)


def replan(deployment: Deployment, w: Workload, lost: str, remaining: int, elapsed_s: float) -> Plan:
    """A region lost mid-night (its store or Kubernetes API unreachable, its workers gone): its leases
    end, and the ``remaining`` records are placed again over the other regions with ``deadline_s -
    elapsed_s`` left. The lost region's replicas cannot be read: its shards are rebuilt from the ledger
    in the region that takes them, so they pay the ledger's egress as every other record placed
    outside it. The ledger's own region lost is the ledger lost: nothing to re-place."""
    if lost == w.ledger_region:
        return Plan(False, math.inf, math.inf, arithmetic=f"region {lost} holds the ledger: the night stops there")
    rest = {r for r in deployment.regions() if r != lost}
    return plan(deployment, replace(w, records=remaining, deadline_s=w.deadline_s - elapsed_s), only=rest)


def single_regions(deployment: Deployment, w: Workload) -> dict[str, Plan]:
    """Each region alone with the ledger there: what one region's autopilot would do."""
    return {r: plan(deployment, replace(w, ledger_region=r), only={r}) for r in deployment.regions()}

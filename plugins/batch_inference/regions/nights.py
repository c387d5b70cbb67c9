"""A compressed night over three simulated regions, for the nights harness (``nights.NightsConfig.regions``).

``RegionNight(seed, ...)`` draws the night's regions from its seed alone (``draw``): three regions
``us`` (the ledger's), ``eu`` and ``ap``, each one cluster of local worker processes with its spot
price ($1.50-4.00 a GPU-hour, scaled as the harness scales the seed's $3.50), its on-demand price
(twice that), its interruption rate (0-0.3 an hour), its capacity and a path store, the egress
prices between them; and its region faults: on half the nights a far region the plan gave workers
is lost at a drawn share of the night (``region_lost``: every worker killed at once, its cluster
unreachable from then on), and on a third a far region's store stops answering (``store_down``:
its directory gone; its workers run on). The harness's own faults (kills, stalls, a slowed batch,
a database restart, the fallback endpoint's) come on top, drawn as every night's.

On the night it is the regions' launcher, at every pass of the harness's supervisor (``launch``):
the autopilot over every cluster (``fleet.ClusterPilot``: regions found lost, each cluster's size,
the steal gates) and each cluster's fleet reconciled to its size (``fleet.reconcile``, recorded
as ``nights@cluster``); a merger thread merges the far regions' result files near the ledger. The
placement is the planner's (``planner.plan``: shards homed where its workers are, the first sizes).

The bill (``figures``): each cluster's worker-seconds at the price its capacity was chosen at (a
compressed second is a second of GPU at the scaled hourly price, as the harness bills one region),
plus replication and egress (steals, far result files merged), plus the rows' part of the night's
bill. ``one_region`` is what the same night's single-region autopilot runs with: the ledger's
region's cluster, at its chosen price; and ``losses`` the region faults as they fell (``Loss``), which
its one cluster faces too: the same share of its running workers ended at the same moment and the same
share of its capacity gone for the rest of the night (a single region has no other region to lose, but
the GPUs a region's loss takes are GPUs its one cluster can lose as well).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psycopg

from batch_inference import db
from batch_inference.autopilot import Policy
from batch_inference.regions.deployment import Deployment, parse_deployment
from batch_inference.regions.fleet import ClusterPilot, cluster_seconds, reconcile
from batch_inference.regions.merge import merge_pending
from batch_inference.regions.planner import Plan, Workload, choose, plan
from batch_inference.regions.replicas import place

log = logging.getLogger("batch_inference.nights")
UTC = timezone.utc
REGIONS = ("us", "eu", "ap")
LEDGER = "us"
SEED_GPU_HOUR = 3.50
LAUNCHER = "nights"
EGRESS = ({"from": "us", "to": "eu", "usd_per_gb": 0.02}, {"from": "us", "to": "ap", "usd_per_gb": 0.09},
          {"from": "eu", "to": "ap", "usd_per_gb": 0.08})


@dataclass(frozen=True)
class Loss:
    """A region fault as it fell (``RegionNight.inject``): when, which, and the share of the night's
    workers running then and of its capacity that were that region's. The single region's autopilot faces
    the same share at the same moment (``nights``: its cluster's workers ended, its capacity cut), so the
    bills compare one product against the other under one fault. A store gone takes its region's workers
    out as a region lost does (the autopilot finds it lost and sizes its clusters 0): its workers stop,
    they are not killed."""

    at_s: float
    kind: str                 # region_lost | store_down
    region: str
    workers: int              # the region's workers running when it fell ...
    of: int                   # ... of every cluster's
    capacity: int             # the region's capacity ...
    of_capacity: int          # ... of every cluster's

    def line(self, workers: int, capacity: int) -> str:
        """What the single region faces: ``workers`` of its running ones ended, its ``capacity`` cut."""
        how = "killed at once" if self.kind == "region_lost" else "stopped"
        return (f"the same loss at {self.at_s:.1f}s ({self.region} "
                f"{'lost' if self.kind == 'region_lost' else 'store gone'}: {self.workers} of {self.of} workers, "
                f"{self.capacity} of {self.of_capacity} GPUs): {workers} worker(s) {how}, capacity {capacity}")


@dataclass(frozen=True)
class RegionFaults:
    lost_share: float | None = None      # a far region lost at this share of the deadline (its region: lost)
    store_share: float | None = None     # a far region's store unreachable from this share on
    lost: str | None = None
    store: str | None = None

    def names(self) -> list[str]:
        out = []
        if self.lost:
            out.append(f"region {self.lost} lost at {self.lost_share:.0%} of the night")
        if self.store:
            out.append(f"store of {self.store} unreachable at {self.store_share:.0%} of the night")
        return out


def draw(seed: int, root: Path, price_scale: float, capacity: int) -> tuple[Deployment, float | None, float | None]:
    """The night's regions and when its region faults come (shares of the deadline), from its seed alone."""
    r = random.Random(f"nights-regions-{seed}")
    clusters = []
    for name in REGIONS:
        spot = round(r.uniform(1.5, 4.0), 2)
        clusters.append({"name": f"{name}-gpu", "region": name, "workers": {"kind": "local"},
                         "gpu": {"kind": "H100", "spot_per_hour": round(spot * price_scale, 4),
                                 "on_demand_per_hour": round(2 * spot * price_scale, 4),
                                 "interruption_rate": round(r.uniform(0.0, 0.3), 2)},
                         "capacity": capacity, "store": {"kind": "path", "path": str(root / name)}})
    lost = round(r.uniform(0.25, 0.5), 2) if r.random() < 0.5 else None
    store = round(r.uniform(0.2, 0.5), 2) if r.random() < 0.35 else None
    return parse_deployment({"clusters": clusters, "egress": list(EGRESS)}), lost, store


class ClusterFleets:
    """The night's per-cluster fleets behind the one ``fleet.Fleet`` interface the supervisor uses
    (poll, alive, signal, slots, stop, kill): kills and stalls pick from every cluster's workers."""

    def __init__(self, fleets: Mapping[str, Any]):
        self.by_cluster = dict(fleets)

    def start_all(self) -> None:
        for f in self.by_cluster.values():
            f.start_all()

    def poll(self, restart: bool = True) -> list[Any]:
        return [e for f in self.by_cluster.values() for e in f.poll(restart=restart)]

    def alive(self) -> list[Any]:
        return [w for f in self.by_cluster.values() for w in f.alive()]

    def slots(self) -> list[tuple[str, int]]:
        return [(n, s) for n, f in self.by_cluster.items() for s in f.slots()]

    @property
    def drained(self) -> bool:
        return any(f.drained for f in self.by_cluster.values())

    def signal(self, w: Any, sig: int) -> bool:
        return next(f for f in self.by_cluster.values() if w in f.workers).signal(w, sig)

    def stop(self, grace: float) -> list[Any]:
        return [e for f in self.by_cluster.values() for e in f.stop(grace)]

    def kill(self) -> None:
        for f in self.by_cluster.values():
            f.kill()


@dataclass
class RegionNight:
    seed: int
    root: Path
    records: int
    shard_size: int
    batch_delay_s: float
    deadline_s: float
    overhead_s: float
    policy: Policy
    price_scale: float = 1.0
    capacity: int = 3
    poll_s: float = 0.5
    deployment: Deployment = field(init=False)
    faults: RegionFaults = field(init=False)
    plan: Plan = field(init=False)

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        for r in REGIONS:
            (self.root / r).mkdir(exist_ok=True)
        self.deployment, lost, store = draw(self.seed, self.root, self.price_scale, self.capacity)
        self.plan = plan(self.deployment, self.workload())
        far = sorted({c.region for c in self.plan.clusters if c.workers} - {LEDGER})
        lost_region = far[self.seed % len(far)] if lost is not None and far else None
        others = [r for r in far if r != lost_region] or [r for r in REGIONS if r not in (LEDGER, lost_region)]
        store_region = others[self.seed % len(others)] if store is not None and others else None
        self.faults = RegionFaults(lost if lost_region else None, store if store_region else None, lost_region,
                                   store_region)
        self.unreachable: dict[str, str] = {}
        self.pilot = ClusterPilot(self.deployment, LEDGER, self.policy, shard_s=self.shard_size * self.batch_delay_s,
                                  overhead_s=self.overhead_s, replica_bytes=200, result_bytes=300)
        self.fleets: ClusterFleets | None = None
        self._next_poll = 0.0
        self._merger: threading.Thread | None = None
        self._stop = threading.Event()
        self.merged: dict[str, int] = {}
        self.events: list[str] = []
        self.losses: list[Loss] = []

    def workload(self) -> Workload:
        return Workload(records=self.records, per_worker=1.0 / self.batch_delay_s,
                        deadline_s=self.deadline_s - self.overhead_s, ledger_region=LEDGER, replica_bytes=200,
                        result_bytes=300, start_s=self.policy.start_s, shard_s=self.shard_size * self.batch_delay_s,
                        margin_s=self.policy.margin_s)

    # -- the single-region autopilot's night --------------------------------------------
    def one_region(self) -> tuple[Plan, float, int]:
        """The same night in the ledger's region alone, with as many GPUs there as the three regions have
        together (the comparison is of prices, not of capacity): its planner's first size, its price per
        GPU-hour (spot where its interruption rate allows, the planner's choice) and its capacity."""
        c = next(c for c in self.deployment.clusters if c.region == LEDGER)
        alone = parse_deployment({"clusters": [{**c.model_dump(mode="json"),
                                                "capacity": sum(x.capacity for x in self.deployment.clusters)}]})
        return (plan(alone, self.workload()), choose(alone.clusters[0], alone, self.workload()).hour_usd,
                alone.clusters[0].capacity)

    # -- set-up -----------------------------------------------------------------------
    def place(self, conn: psycopg.Connection, job_version: str) -> None:
        """Shards homed where the plan's workers are, each region's replicas written; the first sizes recorded."""
        shares: dict[str, float] = {}
        for c in self.plan.clusters:
            shares[c.region] = shares.get(c.region, 0) + c.records
        place(conn, job_version, self.deployment, shares)
        self.job = job_version
        self.pilot.first(conn, job_version, datetime.now(UTC), {c.cluster: c.workers for c in self.plan.clusters},
                         f"the planner's placement: {self.plan.arithmetic}")

    def start_fleets(self, make: Callable[[str, Callable[[str], Sequence[str]], int], Any],
                     argv: Callable[[str], Sequence[str]], url: str) -> ClusterFleets:
        """Each cluster's fleet (``make(cluster, argv, size)``), its workers started with ``--region`` (the far
        ones with ``--result-files``), and the merger near the ledger."""
        sizes = {c.cluster: c.workers for c in self.plan.clusters}
        fleets = {}
        for c in self.deployment.clusters:
            extra = ["--region", c.region, "--poll-seconds", "0.3"] + (["--result-files"] if c.region != LEDGER else [])
            fleets[c.name] = make(c.name, lambda name, extra=extra: [*argv(name), *extra], sizes.get(c.name, 0))
        self.fleets = ClusterFleets(fleets)
        self._merger = threading.Thread(target=self._merge, args=(url,), daemon=True, name="nights-merger")
        self._merger.start()
        return self.fleets

    def _merge(self, url: str) -> None:
        conn = None
        while True:
            stopping = self._stop.is_set()
            try:
                if conn is None or conn.closed:
                    conn = db.connect(url, retries=0)
                got = merge_pending(conn, self.job)
                for k, v in got.items():
                    self.merged[k] = self.merged.get(k, 0) + v
            except (psycopg.Error, db.DatabaseUnavailable) as exc:      # a database restart: connect again
                log.info("nights %d: merger: %s", self.seed, str(exc).splitlines()[0] if str(exc) else exc)
                if conn is not None:
                    conn.close()
                conn = None
                got = {}
            if stopping:
                break
            if not got:
                self._stop.wait(0.2)
        if conn is not None:
            conn.close()

    def stop(self) -> None:
        self._stop.set()
        if self._merger is not None:
            self._merger.join(timeout=30)

    # -- the night --------------------------------------------------------------------
    def fault_times(self) -> list[tuple[float, str]]:
        f = self.faults
        return ([(f.lost_share * self.deadline_s, "region_lost")] if f.lost else []) + \
            ([(f.store_share * self.deadline_s, "store_down")] if f.store else [])

    def inject(self, kind: str, t: float, events: list[str]) -> None:
        assert self.fleets is not None
        region = self.faults.lost if kind == "region_lost" else self.faults.store
        mine = [c for c in self.deployment.clusters if c.region == region]
        # The share of the night's workers and capacity the fault takes, for the single region's same loss.
        self.losses.append(Loss(t, kind, region, sum(len(self.fleets.by_cluster[c.name].alive()) for c in mine),
                                len(self.fleets.alive()), sum(c.capacity for c in mine),
                                sum(c.capacity for c in self.deployment.clusters)))
        if kind == "region_lost":
            self.unreachable[region] = "the region's Kubernetes API does not answer"
            for c in mine:
                self.fleets.by_cluster[c.name].kill()
            events.append(f"{t:.1f}s region {region} lost: {self.losses[-1].workers} worker(s) killed at once, "
                          f"its cluster unreachable")
        elif kind == "store_down":
            where = self.root / region
            if where.exists():
                where.rename(self.root / f"{region}-unreachable")
            events.append(f"{t:.1f}s store of {region} unreachable")

    def launch(self, conn: psycopg.Connection, job_version: str, deadline: datetime) -> None:
        """One pass of the regions' launcher: the autopilot's poll (every ``poll_s``), then each cluster's
        fleet reconciled to its size (a cluster of an unreachable region is not started)."""
        from batch_inference.status import job_counts

        assert self.fleets is not None
        now = time.monotonic()
        if now >= self._next_poll:
            self._next_poll = now + self.poll_s
            c = job_counts(conn, job_version)
            running = {n: len(f.slots()) for n, f in self.fleets.by_cluster.items()}
            for name, f in self.fleets.by_cluster.items():
                region = next(x.region for x in self.deployment.clusters if x.name == name)
                if region in self.unreachable:
                    running[name] = 0
            self.pilot.poll(conn, job_version, datetime.now(UTC), deadline, stored=int(c["stored_batch"]),
                            outstanding=int(c["outstanding"]),
                            shards_left=int(c["shards"]["pending"]) + int(c["shards"]["leased"]),
                            running=running, unreachable=self.unreachable)

        def scaler(name: str) -> tuple[Callable[[], int], Callable[[int], Any]]:
            fleet = self.fleets.by_cluster[name]
            region = next(x.region for x in self.deployment.clusters if x.name == name)

            def scale(k: int) -> None:
                if region in self.unreachable:
                    return                     # its API does not answer: nothing starts or stops there
                before = len(fleet.slots())
                fleet.scale_to(k)
                self.events.append(f"{time.monotonic():.1f} {name} {before} -> {k} workers")
            return (lambda: 0 if region in self.unreachable else len(fleet.slots())), scale

        reconcile(conn, job_version, LAUNCHER, {n: scaler(n) for n in self.fleets.by_cluster}, {})

    def observe(self, conn: psycopg.Connection, job_version: str, stopped: bool = False) -> None:
        """What each cluster runs now (0 when ``stopped``): its GPU-seconds."""
        from batch_inference.autopilot import observe
        from batch_inference.regions.fleet import launcher_name

        assert self.fleets is not None
        for name, f in self.fleets.by_cluster.items():
            observe(conn, job_version, launcher_name(LAUNCHER, name), 0 if stopped else len(f.alive()))

    # -- the figures ------------------------------------------------------------------
    def figures(self, conn: psycopg.Connection, job_version: str, rows_usd: float) -> dict[str, Any]:
        """The regions' bill (each cluster's worker-seconds at its chosen price, replication and egress, and
        the rows' part ``rows_usd``), and what the autopilot and the regions did."""
        secs = cluster_seconds(conn, job_version, LAUNCHER)
        w = self.workload()
        gpu = {c.name: secs.get(c.name, 0.0) / 3600 * choose(c, self.deployment, w).hour_usd
               for c in self.deployment.clusters}
        extra = conn.execute(db.q("region_bill"), {"job": job_version}).fetchone()
        egress = float(extra["replication_usd"] + extra["steal_usd"] + extra["merge_usd"])
        decisions = conn.execute(db.q("fleet_cluster_decisions"), {"job": job_version}).fetchall()
        steals = int(extra["steals"])
        reads = conn.execute(db.q("region_autopilot_decisions"), {"job": job_version}).fetchall()
        lost = [r for r in reads if r["kind"] == "region_lost"]
        ledger_usd = next(choose(c, self.deployment, w).record_usd for c in self.deployment.clusters
                          if c.region == LEDGER)
        return {
            "cheaper_elsewhere": any(choose(c, self.deployment, w).record_usd < ledger_usd
                                     for c in self.deployment.clusters if c.region != LEDGER),
            "role": "regions", "plan": [f"{c.region}:{c.capacity}x{c.workers}" for c in self.plan.clusters],
            "plan_meets": self.plan.meets, "faults": self.faults.names(),
            "gpu_usd": round(sum(gpu.values()), 6), "gpu_usd_by_cluster": {k: round(v, 6) for k, v in gpu.items()},
            "worker_seconds": {k: round(v, 2) for k, v in secs.items()},
            "egress_usd": round(egress, 6), "rows_usd": round(rows_usd, 6),
            "bill_usd": round(sum(gpu.values()) + egress + rows_usd, 6),
            "steals": steals, "lost": [r["region"] for r in lost], "lost_reasons": [r["reason"][:160] for r in lost],
            "losses": [asdict(x) for x in self.losses],
            "changes": sum(1 for d in decisions if d["action"] != "hold"),
            "largest": {c.name: max([int(d["desired"]) for d in decisions if d["cluster"] == c.name] or [0])
                        for c in self.deployment.clusters},
            "pages": list(self.pilot.pages), "merged": dict(self.merged), "events": self.events[-20:],
            "steal_reasons": [(r["usd"], r["reason"]) for r in reads if r["kind"] == "steal"][:5],
            "steals_from": dict(Counter(r["home_region"] for r in reads if r["kind"] == "steal")),
            "gates": [(r["region"], r["reason"]) for r in reads if r["kind"] == "steal_gate"],
            # the gates and the losses in the order they were recorded: a gate open at a region's loss
            "gates_and_losses": [(r["kind"], r["region"], r["reason"][:120]) for r in reads
                                 if r["kind"] in ("steal_gate", "region_lost")],
            "decisions": [(d["cluster"], d["action"], d["reason"][:200]) for d in decisions if d["action"] != "hold"],
        }


def one_region_figures(gpu_hours: float, price: float, rows_usd: float, first: int,
                       faced: Sequence[str] = ()) -> dict[str, Any]:
    """The single-region autopilot's bill on the same night, priced as the regions' is; ``faced``: the
    regions' losses as its one cluster met them (``Loss.line``)."""
    return {"role": "one", "plan": [f"{LEDGER}:{first}"], "gpu_usd": round(gpu_hours * price, 6), "egress_usd": 0.0,
            "rows_usd": round(rows_usd, 6), "bill_usd": round(gpu_hours * price + rows_usd, 6),
            "faced": list(faced)}


__all__ = ["ClusterFleets", "Loss", "RegionFaults", "RegionNight", "draw", "one_region_figures"]

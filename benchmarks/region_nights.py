"""Compressed nights over three regions against one region, on the real parts (issue 46, 6b and 6c).

Each night draws (``random.Random(seed)``) three regions' spot and on-demand prices and interruption
rates, and whether a region is lost that night (one the plan gave workers, not the ledger's) and when. The planner
(``regions.planner``) places the night: which clusters, spot or on demand, how many workers; the night
then runs on the real ledger (one embedded PostgreSQL), a path store per region, worker processes per
region (``python -m gpu_runner --region``, the far ones with ``--result-files``), the merger near the
ledger and validate and publish. At the lost second the region's workers are killed and its store
goes away; ``regions.check_regions(end=True)`` ends its leases, ``regions.replan`` places the rest
over the other regions, and workers are started where the new plan needs more; a plan that cannot
meet the deadline pages at once. The same night then runs in the ledger's region alone, as its own
planner places it (no region to lose there).

A compressed second is a GPU-hour: a worker's bill is its wall seconds at its cluster's price (spot
or on demand, the plan's), plus the egress the steals recorded. Verdicts per night: met (published
by the deadline) or paged before it, 0 duplicates, 0 lost, and the regions' bill against one region's.

    python -m benchmarks.region_nights [--nights 4] [--records 1500] [--shard-size 40] [--delay-ms 20]
                                       [--deadline-s 20]
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from batch_inference import db
from batch_inference.plan import submit
from batch_inference.publish import publish
from batch_inference.regions import (Workload, check_regions, merge_until, parse_deployment, place, plan_placement,
                                     replan)
from batch_inference.status import job_counts
from batch_inference.validate import validate
from benchmarks.common import bench_spec, emit, fresh_server, make_tickets, rnd, worker_env

REGIONS = ("us", "eu", "ap")
LEDGER = "us"


def draw(seed: int, root: Path) -> tuple[Any, bool, float]:
    rng = random.Random(seed)
    clusters = []
    for r in REGIONS:
        spot = round(rng.uniform(1.5, 4.0), 2)
        clusters.append({"name": f"{r}-gpu", "region": r, "workers": {"kind": "local"},
                         "gpu": {"kind": "H100", "spot_per_hour": spot, "on_demand_per_hour": round(spot * 2, 2),
                                 "interruption_rate": round(rng.uniform(0, 0.3), 2)},
                         "capacity": 2, "store": {"kind": "path", "path": str(root / r)}})
        (root / r).mkdir(parents=True, exist_ok=True)
    d = parse_deployment({"clusters": clusters, "egress": [
        {"from": "us", "to": "eu", "usd_per_gb": 0.02}, {"from": "us", "to": "ap", "usd_per_gb": 0.09},
        {"from": "eu", "to": "ap", "usd_per_gb": 0.08}]})
    lost = rng.random() < 0.5      # on this night a region with workers (not the ledger's) is lost
    return d, lost, rng.uniform(0.25, 0.5)


class Night:
    """One night's run: its workers, what each costs, and the merger."""

    def __init__(self, url: str, job: str, deployment: Any, delay_ms: float):
        self.url, self.job, self.d, self.delay_ms = url, job, deployment, delay_ms
        self.workers: list[tuple[str, float, subprocess.Popen, list[float]]] = []   # region, $/h, proc, [start, end]

    def start(self, planned: Any, n: int) -> None:
        """``n`` workers of a planned cluster, each billed at its price (spot or on demand, the plan's)."""
        cluster = next(x for x in self.d.clusters if x.name == planned.cluster)
        price = cluster.gpu.spot_per_hour if planned.capacity == "spot" else cluster.gpu.on_demand_per_hour
        for _ in range(n):
            argv = [sys.executable, "-m", "gpu_runner", self.job, "--region", cluster.region, "--poll-seconds", "0.3",
                    "--flush-every", "20", "--engine-option", f"delay_s={self.delay_ms / 1000}",
                    "--worker-id", f"{cluster.region}-{len(self.workers)}"]
            if cluster.region != LEDGER:
                argv.append("--result-files")
            proc = subprocess.Popen(argv, env=worker_env(self.url), stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
            self.workers.append((cluster.region, price, proc, [time.monotonic(), 0.0]))

    def kill(self, region: str) -> None:
        for r, _, proc, t in self.workers:
            if r == region and proc.poll() is None:
                proc.kill()
                proc.wait()
                t[1] = time.monotonic()

    def wait(self, until: float) -> None:
        for _, _, proc, t in self.workers:
            try:
                proc.wait(timeout=max(0.1, until - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if not t[1]:
                t[1] = time.monotonic()

    def gpu_usd(self) -> float:
        return sum(p * (t[1] - t[0]) for _, p, _, t in self.workers)   # a compressed second is an hour


def run_night(url: str, seed: int, mode: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    d, lose, lost_at = draw(seed, root / f"{seed}-{mode}")
    if mode == "one":      # the ledger's region alone: its clusters, no egress, nothing to lose
        d = parse_deployment({"clusters": [c.model_dump(mode="json") for c in d.clusters if c.region == LEDGER]})
    w = Workload(records=args.records, per_worker=1000 / args.delay_ms, deadline_s=args.deadline_s,
                 ledger_region=LEDGER, replica_bytes=200, result_bytes=300, start_s=3.0,
                 shard_s=args.shard_size * args.delay_ms / 1000, margin_s=2.0)
    p = plan_placement(d, w)
    far = sorted({c.region for c in p.clusters} - {LEDGER})
    lost = far[seed % len(far)] if lose and far and mode == "regions" else None
    spec = bench_spec(shard_size=args.shard_size, prompt={"version": f"n{seed}-{mode}", "system": "Classify."})
    with db.connect(url) as conn:
        job = submit(conn, spec).job_version
        shares: dict[str, float] = {}
        for c in p.clusters:      # shards homed where the plan's workers are
            shares[c.region] = shares.get(c.region, 0) + c.records
        place(conn, job, d, shares)
        night = Night(url, job, d, args.delay_ms)
        t0 = time.monotonic()
        for c in p.clusters:
            night.start(c, c.workers)
        stop = threading.Event()
        merger = threading.Thread(target=merge_until, args=(db.connect(url), job, stop, 0.1), daemon=True)
        merger.start()
        paged, replaced = None, []
        if not p.meets:
            paged = round(time.monotonic() - t0, 2)
        if lost:
            at = t0 + lost_at * p.makespan_s
            while time.monotonic() < at and job_counts(conn, job)["outstanding"]:
                time.sleep(0.1)
            night.kill(lost)
            (root / f"{seed}-{mode}" / lost).rename(root / f"{seed}-{mode}" / f"{lost}-lost")
            check_regions(conn, job, end=True)
            left = job_counts(conn, job)["outstanding"]
            again = replan(d, w, lost, left, time.monotonic() - t0)
            for c in again.clusters:           # more workers where the new plan needs them
                running = sum(1 for r, _, proc, _ in night.workers if r == c.region and proc.poll() is None)
                if c.workers > running:
                    night.start(c, c.workers - running)
                    replaced.append(f"{c.region}+{c.workers - running}")
            if not again.meets and paged is None:
                paged = round(time.monotonic() - t0, 2)
        while job_counts(conn, job)["outstanding"] and time.monotonic() < t0 + args.deadline_s * 3:
            time.sleep(0.1)
        done_s = time.monotonic() - t0
        for _, _, proc, _ in night.workers:      # idle workers wait for leases: the night is over
            if proc.poll() is None:
                proc.terminate()
        night.wait(time.monotonic() + 30)
        stop.set()
        merger.join(timeout=30)
        c = job_counts(conn, job)
        dup = conn.execute("SELECT count(*) - count(DISTINCT record_id) AS d FROM bi.results WHERE job_version = %s",
                           (job,)).fetchone()["d"]
        egress = conn.execute("SELECT coalesce(sum(usd), 0)::float8 AS u FROM bi.region_decisions "
                              "WHERE job_version = %s AND kind = 'steal'", (job,)).fetchone()["u"]
        steals = conn.execute("SELECT count(*) AS n FROM bi.region_decisions WHERE job_version = %s AND kind = 'steal'",
                              (job,)).fetchone()["n"]
        published = False
        if not c["outstanding"] and validate(conn, job).passed:
            published = publish(conn, job)["changed"]
    return {"seed": seed, "mode": mode, "lost": lost, "one_region_planned_miss": mode == "one" and not p.meets,
            "met": published and done_s <= args.deadline_s, "paged_s": paged, "done_s": round(done_s, 2),
            "planned": [f"{c.region}:{c.capacity}x{c.workers}" for c in p.clusters], "replaced": replaced,
            "duplicates": dup, "lost_records": args.records - c["stored"] - c["dead_letters"], "steals": steals,
            "bill_usd": round(night.gpu_usd() + egress, 2), "planned_bill_usd": round(sum(c.gpu_usd * 3600 + c.transfer_usd for c in p.clusters), 2)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nights", type=int, default=4)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--records", type=int, default=1500)
    p.add_argument("--shard-size", type=int, default=40)
    p.add_argument("--delay-ms", type=float, default=20.0)
    p.add_argument("--deadline-s", type=float, default=20.0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    nights = []
    with fresh_server() as url, tempfile.TemporaryDirectory(prefix="bi-nights-") as tmp:
        with db.connect(url) as conn:
            make_tickets(conn, args.records)
        for seed in range(args.first_seed, args.first_seed + args.nights):
            for mode in ("regions", "one"):
                nights.append(run_night(url, seed, mode, args, Path(tmp)))
                print(nights[-1], file=sys.stderr, flush=True)
    regions = [n for n in nights if n["mode"] == "regions"]
    one = {n["seed"]: n for n in nights if n["mode"] == "one"}
    out = {
        "benchmark": "region_nights", "records": args.records, "deadline_s": args.deadline_s, "nights": nights,
        "met_or_paged": sum(1 for n in regions if n["met"] or (n["paged_s"] is not None
                                                              and n["paged_s"] < args.deadline_s)),
        "of": len(regions), "duplicates": sum(n["duplicates"] for n in nights),
        "lost_records": sum(n["lost_records"] for n in nights),
        "bill_ratio_to_one_region": [rnd(n["bill_usd"] / one[n["seed"]]["bill_usd"]) if one[n["seed"]]["bill_usd"]
                                     else None for n in regions],
        "target": "every night met or paged before its deadline, 0 duplicates, 0 lost records",
    }
    out["met"] = out["met_or_paged"] == out["of"] and out["duplicates"] == 0 and out["lost_records"] == 0
    return emit(out)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()

"""Compressed nights over three regions against the single-region autopilot, through the nights harness
(issue 46, 6b).

Each night runs twice in ``nights.run_nights(NightsConfig(regions=True))`` on the real parts (one
embedded PostgreSQL, worker processes, the cutoff watch, the fallback pool against its loopback endpoint,
validate and publish), with the harness's faults drawn from its seed (a slowed batch, kills, stalls, a
database restart, fallback 5xx bursts and 429s, a drifted fallback history; hosted nights excepted):

* **one region**: the ledger's region alone, with as many GPUs as the three regions together, under the
  single-region autopilot (``autopilot.decide`` in the cutoff watch), at that region's price (spot where
  its interruption rate allows); on a night where the regions lose a region (killed, or its store gone),
  its one cluster meets the same loss: the same share of its running workers ended at the same moment
  (killed, or stopped for a store gone) and the same share of its GPUs gone for the rest of the night.
  A single region has no other region to lose, but a loss of GPUs it can meet as well, and a bill
  against a baseline that met no fault would price the fault, not the regions;
* **three regions** (``regions.RegionNight``): each region's prices and interruption rate drawn, the
  shards placed where the planner puts its workers, the autopilot over every cluster
  (``regions.ClusterPilot``) sizing each cluster and opening steal gates by the deadline's arithmetic,
  far workers handing in result files merged near the ledger; on some nights a region lost (its
  workers killed at once, its cluster unreachable) and a store unreachable, found by the autopilot's
  poll.

The bill of each is its workers' seconds at their cluster's price (a compressed second of GPU at the
harness's scaled hourly price), replication and egress, and the rows (the fallback's at its price). It
prints the regions' figures beside the single region's from the same run: met or paged, duplicates,
lost records, and the bill, with the nights where another region's record is cheaper than the ledger
region's (where the regions' bill should be at most one region's).

    python -m benchmarks.region_nights [--nights 4] [--first-seed 0 | --seeds S ...] [--repeats 1]
                                       [--records 600] [--shard-size 20] [--delay-ms 100] [--deadline-s 40]
                                       [--capacity 2]

With ``--repeats N`` each night's pair runs N times and each side's bill is the median over its runs: the
fallback's rows decide a slowed night's bill and move by 60-130 between runs of one seed.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from batch_inference.nights import NightsConfig, run_nights
from benchmarks.common import emit, median, rnd


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nights", type=int, default=4)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--seeds", type=int, nargs="*", help="these seeds instead of --nights from --first-seed")
    p.add_argument("--repeats", type=int, default=1,
                   help="each night's pair run this many times (all the seeds, then again): its bills are the "
                        "medians over the runs")
    p.add_argument("--records", type=int, default=600)
    p.add_argument("--shard-size", type=int, default=20)
    p.add_argument("--delay-ms", type=float, default=100.0, help="a record's time on one worker")
    p.add_argument("--deadline-s", type=float, default=40.0,
                   help="the harness's fallback overhead (8 s) and margin (5 s) do not shrink with it")
    p.add_argument("--capacity", type=int, default=2, help="workers at most per region's cluster")
    args = p.parse_args(argv)
    if args.repeats < 1:
        print(f"region_nights: --repeats must be at least 1, got {args.repeats}", file=sys.stderr)
        raise SystemExit(2)
    logging.basicConfig(level=logging.ERROR)
    cfg = dict(regions=True, records=args.records, shard_size=args.shard_size, batch_delay_s=args.delay_ms / 1000,
               deadline_s=args.deadline_s, hosted_nights=0, region_capacity=args.capacity)
    seeds = list(args.seeds) if args.seeds else list(range(args.first_seed, args.first_seed + args.nights))
    nights = []
    for run in range(args.repeats):
        for s in seeds:
            before = os.getloadavg()[0]
            report = run_nights(NightsConfig(nights=1, seed=s, **cfg))
            print(report.table(), file=sys.stderr, flush=True)
            load = [round(before, 1), round(os.getloadavg()[0], 1)]
            nights += [_night(n, run, load) for n in report.nights]
    regions = [n for n in nights if n["mode"] == "regions"]
    one = [n for n in nights if n["mode"] == "one"]
    # Per night, each side's bill and GPU part as the medians over its runs: a fallback row costs 7-300 times a
    # GPU row here, and the rows of one night moved by 60-130 between runs of the same code, more than any
    # difference between the two sides; the ratio is of the two medians (each run's own ratio beside it).
    per = {}
    for s in seeds:
        a = [n for n in one if n["seed"] == s]
        b = [n for n in regions if n["seed"] == s]
        bill = (median([n["bill_usd"] for n in a]), median([n["bill_usd"] for n in b]))
        gpu = (median([n["gpu_usd"] for n in a]), median([n["gpu_usd"] + n["egress_usd"] for n in b]))
        per[s] = {"bill_usd": [round(x, 6) for x in bill], "gpu_usd": [round(x, 6) for x in gpu],
                  "ratio": rnd(bill[1] / bill[0]) if bill[0] else None,
                  "gpu_egress_ratio": rnd(gpu[1] / gpu[0]) if gpu[0] else None,
                  "run_ratios": [rnd(y["bill_usd"] / x["bill_usd"]) if x["bill_usd"] else None for x, y in zip(a, b)],
                  "fallback_rows": [[x["rows"].get("fallback", 0) for x in a], [y["rows"].get("fallback", 0) for y in b]],
                  "cheaper_elsewhere": b[0]["cheaper_elsewhere"], "lost": sorted({r for y in b for r in y["lost"]}),
                  # a region fault drawn (its loss met by the one region too), found by the poll or not (one that
                  # falls after the cutoff fired is not steered, so not found)
                  "region_fault": bool(b[0]["lost"]) or any(" lost at " in f or " unreachable at " in f
                                                            for f in b[0]["faults"]),
                  "faults": b[0]["faults"], "plan": b[0]["plan"], "faced": a[0]["faced"]}

    def differ(loss: bool) -> dict[str, Any]:
        got = {s: x for s, x in per.items() if x["cheaper_elsewhere"] and x["region_fault"] == loss}
        return {"nights": len(got), "at_most_one_region": sum(1 for x in got.values()
                                                              if x["ratio"] is not None and x["ratio"] <= 1.0),
                "ratios": {s: x["ratio"] for s, x in got.items()},
                "gpu_egress_ratios": {s: x["gpu_egress_ratio"] for s, x in got.items()}}

    out = {
        "benchmark": "region_nights", "records": args.records, "deadline_s": args.deadline_s, "repeats": args.repeats,
        "nights": nights, "per_night": per,
        "met_or_paged": sum(1 for n in regions if n["verdict"] in ("met", "paged")), "of": len(regions),
        "one_region_met_or_paged": sum(1 for n in one if n["verdict"] in ("met", "paged")),
        "duplicates": sum(n["duplicates"] for n in nights), "lost_records": sum(n["lost_records"] for n in nights),
        "bill_ratio_to_one_region": [per[s]["ratio"] for s in seeds],
        "gpu_egress_ratio_to_one_region": [per[s]["gpu_egress_ratio"] for s in seeds],
        "bill": {"one_region": round(sum(x["bill_usd"][0] for x in per.values()), 6),
                 "regions": round(sum(x["bill_usd"][1] for x in per.values()), 6)},
        # Another region's record cheaper than the ledger region's and no region lost: the regions' bill
        # should be at most one region's.
        "prices_differ_no_loss": differ(False),
        # The same with a region lost (its store gone counts: the autopilot finds the region lost), against the
        # single region that met the same loss.
        "prices_differ_region_lost": differ(True),
        "region_lost_nights": sum(1 for x in per.values() if x["region_fault"]),
        "baseline": "the single-region autopilot on the same nights; on a night with a region lost, its one "
                    "cluster loses the same share of its running workers at the same moment and the same share of "
                    "its GPUs; each side's bill the median over its runs",
        "target": "every night met or paged before its deadline, 0 duplicates, 0 lost records",
    }
    out["met"] = out["met_or_paged"] == out["of"] and out["duplicates"] == 0 and out["lost_records"] == 0
    return emit(out)


def _night(n: Any, run: int, load: list[float]) -> dict[str, Any]:
    """One run of one side of a night, as the summary lists it (``load``: the load average at its pair's start
    and end)."""
    return {"seed": n.seed, "run": run, "mode": n.regions["role"], "verdict": n.verdict, "met": n.verdict == "met",
            "paged_s": n.page_s, "slack_s": n.slack_s, "fired_s": n.fired_s, "faults": n.faults,
            "plan": n.regions["plan"], "lost": n.regions.get("lost", []),
            "lost_reasons": n.regions.get("lost_reasons", []), "steals": n.regions.get("steals", 0),
            "rows": n.rows, "bill_usd": n.regions["bill_usd"], "gpu_usd": n.regions["gpu_usd"],
            "egress_usd": n.regions["egress_usd"], "rows_usd": n.regions["rows_usd"],
            "worker_seconds": n.regions.get("worker_seconds", round(n.gpu_hours * 3600, 2)),
            "cheaper_elsewhere": n.regions.get("cheaper_elsewhere"), "duplicates": n.coverage.get("duplicates", 0),
            "lost_records": n.lost, "faced": n.regions.get("faced", []), "load": load}

if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()

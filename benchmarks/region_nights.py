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

    python -m benchmarks.region_nights [--nights 4] [--first-seed 0] [--records 600] [--shard-size 20]
                                       [--delay-ms 100] [--deadline-s 40] [--capacity 2]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from batch_inference.nights import NightsConfig, run_nights
from benchmarks.common import emit, rnd


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nights", type=int, default=4)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--seeds", type=int, nargs="*", help="these seeds instead of --nights from --first-seed")
    p.add_argument("--records", type=int, default=600)
    p.add_argument("--shard-size", type=int, default=20)
    p.add_argument("--delay-ms", type=float, default=100.0, help="a record's time on one worker")
    p.add_argument("--deadline-s", type=float, default=40.0,
                   help="the harness's fallback overhead (8 s) and margin (5 s) do not shrink with it")
    p.add_argument("--capacity", type=int, default=2, help="workers at most per region's cluster")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    cfg = dict(regions=True, records=args.records, shard_size=args.shard_size, batch_delay_s=args.delay_ms / 1000,
               deadline_s=args.deadline_s, hosted_nights=0, region_capacity=args.capacity)
    reports = [run_nights(NightsConfig(nights=1, seed=s, **cfg)) for s in args.seeds] if args.seeds else \
        [run_nights(NightsConfig(nights=args.nights, seed=args.first_seed, **cfg))]
    ns = [n for r in reports for n in r.nights]
    nights = [{"seed": n.seed, "mode": n.regions["role"], "verdict": n.verdict, "met": n.verdict == "met",
               "paged_s": n.page_s, "slack_s": n.slack_s, "fired_s": n.fired_s, "faults": n.faults,
               "plan": n.regions["plan"], "lost": n.regions.get("lost", []),
               "lost_reasons": n.regions.get("lost_reasons", []), "steals": n.regions.get("steals", 0),
               "rows": n.rows, "bill_usd": n.regions["bill_usd"], "gpu_usd": n.regions["gpu_usd"],
               "egress_usd": n.regions["egress_usd"], "rows_usd": n.regions["rows_usd"],
               "cheaper_elsewhere": n.regions.get("cheaper_elsewhere"), "duplicates": n.coverage.get("duplicates", 0),
               "lost_records": n.lost, "faced": n.regions.get("faced", [])} for n in ns]
    for r in reports:
        print(r.table(), file=sys.stderr, flush=True)
    regions = [n for n in nights if n["mode"] == "regions"]
    one = {n["seed"]: n for n in nights if n["mode"] == "one"}
    ratio = [(n["seed"], rnd(n["bill_usd"] / one[n["seed"]]["bill_usd"]) if one[n["seed"]]["bill_usd"] else None)
             for n in regions]
    clean = [(s, x) for (s, x), n in zip(ratio, regions) if n["cheaper_elsewhere"] and not n["lost"]]
    loss = [(s, x) for (s, x), n in zip(ratio, regions) if n["cheaper_elsewhere"] and n["lost"]]
    # The part of the bill the regions' prices decide (GPU-seconds at each cluster's price, replication and
    # egress), apart from the fallback's rows, which the cutoff's timing decides.
    gpu = [(n["seed"], rnd((n["gpu_usd"] + n["egress_usd"]) / one[n["seed"]]["gpu_usd"])
            if one[n["seed"]]["gpu_usd"] else None) for n in regions]
    out = {
        "benchmark": "region_nights", "records": args.records, "deadline_s": args.deadline_s, "nights": nights,
        "met_or_paged": sum(1 for n in regions if n["verdict"] in ("met", "paged")), "of": len(regions),
        "one_region_met_or_paged": sum(1 for n in one.values() if n["verdict"] in ("met", "paged")),
        "duplicates": sum(n["duplicates"] for n in nights), "lost_records": sum(n["lost_records"] for n in nights),
        "bill_ratio_to_one_region": [x for _, x in ratio],
        "gpu_egress_ratio_to_one_region": [x for _, x in gpu],
        "bill": {"one_region": round(sum(n["bill_usd"] for n in one.values()), 6),
                 "regions": round(sum(n["bill_usd"] for n in regions), 6)},
        # Another region's record cheaper than the ledger region's and no region lost: the regions' bill
        # should be at most one region's.
        "prices_differ_no_loss": {"nights": len(clean), "at_most_one_region": sum(1 for _, x in clean
                                                                                  if x is not None and x <= 1.0),
                                  "ratios": dict(clean),
                                  "gpu_egress_ratios": {k: x for k, x in gpu if k in dict(clean)}},
        # The same with a region lost (its store gone counts: the autopilot finds the region lost), against the
        # single region that met the same loss.
        "prices_differ_region_lost": {"nights": len(loss), "at_most_one_region": sum(1 for _, x in loss
                                                                                     if x is not None and x <= 1.0),
                                      "ratios": dict(loss),
                                      "gpu_egress_ratios": {k: x for k, x in gpu if k in dict(loss)}},
        "region_lost_nights": sum(1 for n in regions if n["lost"]),
        "baseline": "the single-region autopilot on the same nights; on a night with a region lost, its one "
                    "cluster loses the same share of its running workers at the same moment and the same share of "
                    "its GPUs",
        "target": "every night met or paged before its deadline, 0 duplicates, 0 lost records",
    }
    out["met"] = out["met_or_paged"] == out["of"] and out["duplicates"] == 0 and out["lost_records"] == 0
    return emit(out)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()

"""The fallback's tail at price tiers against one price, on compressed nights (issue 47).

Each night runs twice in ``nights.run_nights(NightsConfig(tiers="both"))`` on the real parts (one embedded
PostgreSQL, worker processes, the cutoff watch, the fallback pool against its loopback endpoint, validate
and publish), with the harness's faults drawn from its seed: once with the fallback at one price, once with
tiers (flex at half the price, refusing or dropping a fifth of its requests at random, then default). It
prints the tail's bill with tiers as a share of the one-price tail's (goal: at most 0.6) beside the
verdicts, duplicates and lost records of both. The tail's length and split follow the machine's speed
(a tier is chosen by the throughput measured against the time left), so the figure belongs here, measured
with its load, not in a test.

    python -m benchmarks.tier_nights [--nights 4] [--first-seed 0] [--seeds 15 ...] [--hosted-nights 3]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from batch_inference.nights import NightsConfig, NightsReport, run_nights
from benchmarks.common import emit

GOAL = 0.6


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nights", type=int, default=4)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--seeds", type=int, nargs="*", help="these seeds instead of --nights from --first-seed")
    p.add_argument("--hosted-nights", type=int, default=3)
    p.add_argument("--records", type=int, default=1200)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    cfg = dict(autopilot="off", tiers="both", records=args.records)
    reports = [run_nights(NightsConfig(night=s, hosted_nights=0, **cfg)) for s in args.seeds] if args.seeds else \
        [run_nights(NightsConfig(nights=args.nights, seed=args.first_seed, hosted_nights=args.hosted_nights, **cfg))]
    for r in reports:
        print(r.table(), file=sys.stderr, flush=True)
    return emit(line(reports, args.records))


def line(reports: list[NightsReport], records: int) -> dict[str, Any]:
    """The benchmark's line (without the machine) from its runs' reports: tests/process/test_nights_tiers.py
    checks the line of the night it runs, seed 15's, which is the quick run's."""
    ns = [n for r in reports for n in r.nights]
    one = [n for n in ns if not n.tiered]
    tiered = [n for n in ns if n.tiered]
    tail = {"one_price": round(sum(n.bill.get("fallback_cost") or 0 for n in one), 4),
            "tiers": round(sum(n.bill.get("fallback_cost") or 0 for n in tiered), 4)}
    rows = {"one_price": sum(n.rows.get("fallback", 0) for n in one),
            "tiers": sum(n.rows.get("fallback", 0) for n in tiered)}
    split: dict[str, int] = {}
    for n in tiered:
        for tier, k in (n.bill.get("fallback_tiers") or {}).items():
            split[tier] = split.get(tier, 0) + k
    ratio = round(tail["tiers"] / tail["one_price"], 4) if tail["one_price"] else None
    per_row = (round((tail["tiers"] / rows["tiers"]) / (tail["one_price"] / rows["one_price"]), 4)
               if rows["tiers"] and rows["one_price"] and tail["one_price"] else None)
    out = {
        "benchmark": "tier_nights", "records": records, "seeds": sorted({n.seed for n in ns}),
        "nights": [{"seed": n.seed, "tiers": n.tiered, "verdict": n.verdict, "fallback_rows": n.rows.get("fallback", 0),
                    "tail_bill": n.bill.get("fallback_cost"), "split": n.bill.get("fallback_tiers"),
                    "slack_s": n.slack_s} for n in ns],
        "met_or_paged": sum(1 for n in ns if n.verdict in ("met", "paged")), "of": len(ns),
        "duplicates": sum(n.coverage.get("duplicates", 0) for n in ns),
        "lost_records": sum(n.lost for n in ns),
        "tail_bill": tail, "tail_rows": rows, "tail_split": split,
        "tail_bill_ratio": ratio, "tail_per_row_ratio": per_row,
        "target": f"the tail's bill with tiers at most {GOAL} of one price, every night met or paged, "
                  "0 duplicates, 0 lost records",
    }
    out["met"] = (ratio is not None and ratio <= GOAL and out["met_or_paged"] == out["of"]
                  and out["duplicates"] == 0 and out["lost_records"] == 0)
    return out


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()

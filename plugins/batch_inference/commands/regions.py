"""``regions place``, ``merge``, ``plan``, ``check``, ``lost`` and ``report``: a submitted job version over clusters in
several regions (batch_inference.regions, docs/regions.md).

``place`` checks the deployment (every store and Kubernetes connection answers) and writes each shard's
replica in its home region (``submit SPEC --deployment YAML`` does the same at submit); its workers then run with ``--region R`` (``--result-files`` far from the
ledger). ``merge`` runs near the ledger and merges the far workers' result files by key until the
version has no shard left, or once with ``--once``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from batch_inference.commands.common import connect, db_arg, doc_summary, print_json


def register(sub: Any) -> None:
    g = sub.add_parser("regions", help="a job version over clusters in several regions",
                       description=doc_summary(__doc__)).add_subparsers(dest="regions_command", required=True)
    p = g.add_parser("place", help="place a submitted job version on a deployment's clusters and write its replicas")
    p.add_argument("job_version")
    p.add_argument("deployment", help="the deployment's YAML file (clusters, stores, egress prices)")
    p.add_argument("--json", action="store_true")
    db_arg(p)
    p.set_defaults(func=run_place)

    m = g.add_parser("merge", help="merge far workers' result files by key, near the ledger")
    m.add_argument("job_version")
    m.add_argument("--once", action="store_true", help="merge what is handed in now and exit")
    m.add_argument("--poll-seconds", type=float, default=1.0)
    db_arg(m)
    m.set_defaults(func=run_merge)

    n = g.add_parser("plan", help="on paper: the least bill that meets a deadline across the clusters, and "
                                  "each region alone")
    n.add_argument("deployment")
    n.add_argument("--records", type=int, required=True)
    n.add_argument("--per-worker", type=float, required=True, help="records/s of one worker (one GPU)")
    n.add_argument("--deadline-hours", type=float, required=True)
    n.add_argument("--ledger-region", help="where the snapshot and the merge are (default: the deployment's "
                                           "ledger_region, else the first cluster's)")
    n.add_argument("--replica-bytes", type=float, default=5000, help="a record's bytes in its replica")
    n.add_argument("--result-bytes", type=float, default=1000, help="a record's result bytes")
    n.add_argument("--start-s", type=float, default=300)
    n.add_argument("--shard-s", type=float, default=600, help="a shard's work on one worker")
    n.add_argument("--margin-s", type=float, default=600)
    n.add_argument("--max-spot-interruption", type=float, default=0.2, help="per GPU-hour")
    n.set_defaults(func=run_plan)

    c = g.add_parser("check", help="ask each region's store; with --end-leases, a region that does not answer "
                                   "has its workers' leases ended at once")
    c.add_argument("job_version")
    c.add_argument("--end-leases", action="store_true")
    db_arg(c)
    c.set_defaults(func=run_check)

    lost = g.add_parser("lost", help="a region is lost (its Kubernetes API or store gone): end its leases now")
    lost.add_argument("job_version")
    lost.add_argument("region")
    lost.add_argument("--reason", required=True, help="why (recorded)")
    db_arg(lost)
    lost.set_defaults(func=run_lost)

    r = g.add_parser("report", help="per region: shards, replica bytes and seconds, claims, steals and egress")
    r.add_argument("job_version")
    db_arg(r)
    r.set_defaults(func=run_report)


def run_place(args: argparse.Namespace) -> int:
    from batch_inference.regions import load_deployment, place

    deployment = load_deployment(args.deployment)      # a bad file: one line before any connection
    with connect(args) as conn:
        out = place(conn, args.job_version, deployment)
    if args.json:
        print_json(out)
    elif not out["placed"]:
        print(f"{args.job_version} is placed on these clusters already; nothing written")
    else:
        for region, c in out["regions"].items():
            print(f"{region}: {int(c['shards'])} shard replicas, {int(c['bytes']):,} bytes in {c['seconds']:.2f}s, "
                  f"${c['usd']:,.4f} egress")
    return 0


def run_merge(args: argparse.Namespace) -> int:
    from batch_inference.regions import merge_pending, merge_until_settled

    with connect(args) as conn:
        if args.once:
            print_json(dict(merge_pending(conn, args.job_version)))
            return 0
        t0 = time.monotonic()
        total = merge_until_settled(conn, args.job_version, poll_s=args.poll_seconds)
    print_json({**total, "seconds": round(time.monotonic() - t0, 2)})
    return 0


def run_plan(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from batch_inference.exceptions import InvalidValue
    from batch_inference.regions import Workload, load_deployment, single_regions
    from batch_inference.regions import plan_placement as plan

    d = load_deployment(args.deployment)
    ledger = args.ledger_region or d.ledger()
    if ledger not in d.regions():
        raise InvalidValue(f"--ledger-region {ledger!r}: no cluster is in it ({', '.join(d.regions())})")
    if args.records <= 0 or args.per_worker <= 0 or args.deadline_hours <= 0:
        raise InvalidValue("--records, --per-worker and --deadline-hours must be above 0")
    w = Workload(args.records, args.per_worker, args.deadline_hours * 3600, ledger, args.replica_bytes,
                 args.result_bytes, args.start_s, args.shard_s, args.margin_s, args.max_spot_interruption)

    def shown(p: Any) -> dict[str, Any]:
        return {"meets": p.meets, "makespan_h": round(p.makespan_s / 3600, 2), "bill_usd": round(p.bill_usd, 2),
                "gpu_hours": round(sum(c.gpu_hours for c in p.clusters), 1),
                "clusters": [{k: round(v, 2) if isinstance(v, float) else v for k, v in asdict(c).items()}
                             for c in p.clusters], "arithmetic": p.arithmetic}

    print_json({"regions": shown(plan(d, w)), "alone": {r: shown(p) for r, p in single_regions(d, w).items()}})
    return 0


def run_check(args: argparse.Namespace) -> int:
    from batch_inference.regions import check_regions

    with connect(args) as conn:
        rows = check_regions(conn, args.job_version, end=args.end_leases)
    for row in rows:
        print_json(row)
    return 0 if all(r["reachable"] for r in rows) else 1


def run_lost(args: argparse.Namespace) -> int:
    from batch_inference.regions import end_region

    with connect(args) as conn:
        print_json({"region": args.region, "ended": end_region(conn, args.job_version, args.region, args.reason)})
    return 0


def run_report(args: argparse.Namespace) -> int:
    from batch_inference.regions import report

    with connect(args) as conn:
        for row in report(conn, args.job_version):
            print_json(row)
    return 0

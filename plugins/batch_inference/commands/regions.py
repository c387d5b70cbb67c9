"""``regions place``, ``regions merge`` and ``regions report``: a submitted job version over clusters in
several regions (batch_inference.regions, docs/regions.md).

``place`` checks the deployment (every store and Kubernetes connection answers) and writes each shard's
replica in its home region; its workers then run with ``--region R`` (``--result-files`` far from the
ledger). ``merge`` runs near the ledger and merges the far workers' result files by key until the
version has no shard left, or once with ``--once``.
"""

from __future__ import annotations

import argparse
import threading
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
            print(f"{region}: {int(c['shards'])} shard replicas, {int(c['bytes']):,} bytes in {c['seconds']:.2f}s")
    return 0


def run_merge(args: argparse.Namespace) -> int:
    from batch_inference.regions import merge_pending, merge_until
    from batch_inference.status import job_counts

    with connect(args) as conn:
        if args.once:
            print_json(dict(merge_pending(conn, args.job_version)))
            return 0
        stop = threading.Event()

        def until_done() -> None:
            with connect(args) as watch:
                while not stop.wait(args.poll_seconds):
                    if job_counts(watch, args.job_version)["outstanding"] == 0:
                        stop.set()

        watcher = threading.Thread(target=until_done, daemon=True)
        t0 = time.monotonic()
        watcher.start()
        total = merge_until(conn, args.job_version, stop, args.poll_seconds)
    print_json({**total, "seconds": round(time.monotonic() - t0, 2)})
    return 0


def run_report(args: argparse.Namespace) -> int:
    from batch_inference.regions import report

    with connect(args) as conn:
        for row in report(conn, args.job_version):
            print_json(row)
    return 0

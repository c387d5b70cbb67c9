"""``worker`` and ``grant``: run a worker here, and let a worker role work on a job version."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from batch_inference.commands.common import connect


def register(sub: Any) -> None:
    from gpu_runner.worker import add_arguments

    w = sub.add_parser("worker", help="run a worker: lease shards, run the engine, write keyed results")
    add_arguments(w)
    w.set_defaults(func=run)

    g = sub.add_parser("grant", help="let a worker role work on a job version (least privilege)")
    g.add_argument("role")
    g.add_argument("job_version")
    g.add_argument("--revoke", action="store_true")
    g.set_defaults(func=run_grant)


def run(args: argparse.Namespace) -> int:
    from gpu_runner.worker import config_from_args, run_worker

    return run_worker(config_from_args(args), own_process=True)


def run_grant(args: argparse.Namespace) -> int:
    from batch_inference.plan import grant_job

    with connect(args) as conn:
        grant_job(conn, args.role, args.job_version, revoke=args.revoke)
    print(f"{'revoked' if args.revoke else 'granted'}: role {args.role} on {args.job_version}", file=sys.stderr)
    return 0

"""``worker`` and ``grant``: run a worker here, and let a worker role work on a job version."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from batch_inference.commands.common import connect, one_line


def register(sub: Any) -> None:
    # The worker's flags are built from gpu_runner.worker's WorkerConfig: imported when this command is
    # parsed, not by every other command.
    w = sub.add_parser("worker", help="run a worker: lease shards, run the engine, write keyed results",
                       arguments=_worker_arguments)
    w.set_defaults(func=run)

    g = sub.add_parser("grant", help="let a worker role work on a job version (least privilege)")
    g.add_argument("role")
    g.add_argument("job_version")
    g.add_argument("--revoke", action="store_true")
    g.set_defaults(func=run_grant)


def _worker_arguments(p: argparse.ArgumentParser) -> None:
    from gpu_runner.worker import add_arguments

    add_arguments(p)


def run(args: argparse.Namespace) -> int:
    """The worker, its exit status kept (``exits.ExitCode``); why it stops is one line on stderr, as
    every command's refusal is (the log's ``fatal:`` line of ``python -m gpu_runner``). A flag it
    refuses (a value out of range, a malformed --engine-option) is the CLI's bad input: one line, exit 2."""
    from gpu_runner.worker import config_from_args, run_worker

    def refuse(line: str) -> None:
        print(f"batch-inference worker: error: {one_line(line.removeprefix('fatal: '))}", file=sys.stderr)

    return run_worker(config_from_args(args), own_process=True, fatal_to=refuse)


def run_grant(args: argparse.Namespace) -> int:
    from batch_inference.plan import grant_job

    with connect(args) as conn:
        grant_job(conn, args.role, args.job_version, revoke=args.revoke)
    print(f"{'revoked' if args.revoke else 'granted'}: role {args.role} on {args.job_version}", file=sys.stderr)
    return 0

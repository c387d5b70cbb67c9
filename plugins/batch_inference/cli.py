"""``batch-inference``: the command line over the core.

Every command takes ``--db URL`` (default: $BATCH_INFERENCE_DB, else the
embedded PostgreSQL under $BATCH_INFERENCE_HOME). Errors are one line on
stderr and a non-zero exit; machine output is one JSON line.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from typing import Any

# Commands contributed by other modules: each has register(subparsers).
_EXTRA_COMMANDS = ("capacity", "cutoff", "cost", "validate", "publish", "chaos", "fallback", "demo")


def _json(obj: Any) -> None:
    print(json.dumps(obj, default=str, ensure_ascii=False))


def _conn(args: argparse.Namespace):
    from batch_inference import db

    conn = db.connect(args.db)
    db.migrate(conn)
    return conn


def cmd_db(args: argparse.Namespace) -> int:
    from batch_inference import db, embedded

    if args.action == "up":
        url = embedded.ensure_server(db.home())
        conn = db.connect(url)
        applied = db.migrate(conn)
        print(url)
        print(f"embedded PostgreSQL running under {db.home() / 'pg'}; migrations applied: "
              f"{', '.join(applied) or 'none new'}", file=sys.stderr)
    elif args.action == "url":
        print(db.redact(db.resolve_url(args.db)))
    elif args.action == "down":
        stopped = embedded.stop_server(db.home())
        print("stopped" if stopped else "not running", file=sys.stderr)
    elif args.action == "migrate":
        applied = db.migrate(db.connect(args.db))
        print(", ".join(applied) or "up to date")
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    from batch_inference.plan import submit
    from batch_inference.spec import load_spec

    spec = load_spec(args.spec)
    overrides = {k: v for k, v in (("shard_size", args.shard_size),) if v is not None}
    if overrides:
        spec = spec.model_copy(update=overrides)
    rows = None
    if spec.source.kind == "s3_manifest":
        from batch_inference.sources import s3_manifest_rows

        rows = s3_manifest_rows(spec.source, endpoint_url=args.s3_endpoint)
    with _conn(args) as conn:
        m = submit(conn, spec, rows)
    _json(m.as_dict())
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from batch_inference.status import job_counts

    with _conn(args) as conn:
        c = job_counts(conn, args.job_version)
    if args.json:
        _json(c)
    else:
        s = c["shards"]
        print(f"{c['job_version']}: {c['stored']}/{c['records']} stored ({c['stored_fallback']} by fallback, "
              f"{c['reused']} reused), {c['dead_letters']} dead letters, {c['outstanding']} outstanding; "
              f"shards pending {s['pending']}, leased {s['leased']}, done {s['done']}; "
              f"mode {c['mode']}, status {c['status']}")
    return 0


def cmd_dead_letters(args: argparse.Namespace) -> int:
    from batch_inference.status import dead_letters, job_counts

    with _conn(args) as conn:
        job_counts(conn, args.job_version)  # a clear error for an unknown version
        rows = dead_letters(conn, args.job_version)
    if args.json:
        for r in rows:
            _json({k: r[k] for k in ("record_id", "reason", "attempts", "stage", "error", "raw_output")})
    else:
        for r in rows:
            raw = (r["raw_output"] or "")[:80].replace("\n", " ")
            print(f"{r['record_id']}\t{r['attempts']}\t{r['reason']}\t{raw}")
        print(f"{len(rows)} dead letter(s)", file=sys.stderr)
    return 0


def cmd_drop(args: argparse.Namespace) -> int:
    from batch_inference.plan import drop_job_version

    with _conn(args) as conn:
        dropped = drop_job_version(conn, args.job_version)
    print("dropped" if dropped else f"no job version {args.job_version!r}", file=sys.stderr)
    return 0 if dropped else 1


def cmd_worker(args: argparse.Namespace) -> int:
    from gpu_runner.worker import config_from_args, run_worker

    return run_worker(config_from_args(args))


def cmd_grant(args: argparse.Namespace) -> int:
    with _conn(args) as conn:
        fn = "bi.revoke_job_v1" if args.revoke else "bi.grant_job_v1"
        conn.execute(f"SELECT {fn}(%s, %s)", (args.role, args.job_version))
    print(f"{'revoked' if args.revoke else 'granted'}: role {args.role} on {args.job_version}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="batch-inference", description=__doc__.splitlines()[0])
    p.add_argument("--db", default=None, help="PostgreSQL URL (default: $BATCH_INFERENCE_DB, else embedded)")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser("db", help="the embedded PostgreSQL: up, url, down, migrate")
    d.add_argument("action", choices=["up", "url", "down", "migrate"])
    d.set_defaults(func=cmd_db)

    s = sub.add_parser("submit", help="validate a spec, snapshot its source and plan shards")
    s.add_argument("spec")
    s.add_argument("--shard-size", type=int)
    s.add_argument("--s3-endpoint", default=None, help="S3-compatible endpoint URL (object-store sources)")
    s.set_defaults(func=cmd_submit)

    st = sub.add_parser("status", help="live counts of a job version")
    st.add_argument("job_version")
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=cmd_status)

    dl = sub.add_parser("dead-letters", help="records that never produced a result, with reasons")
    dl.add_argument("job_version")
    dl.add_argument("--json", action="store_true")
    dl.set_defaults(func=cmd_dead_letters)

    dr = sub.add_parser("drop", help="drop a whole job version (its partitions)")
    dr.add_argument("job_version")
    dr.set_defaults(func=cmd_drop)

    from gpu_runner.worker import add_arguments

    w = sub.add_parser("worker", help="run a worker: lease shards, run the engine, write keyed results")
    add_arguments(w)
    w.set_defaults(func=cmd_worker)

    g = sub.add_parser("grant", help="let a worker role work on a job version (least privilege)")
    g.add_argument("role")
    g.add_argument("job_version")
    g.add_argument("--revoke", action="store_true")
    g.set_defaults(func=cmd_grant)

    for name in _EXTRA_COMMANDS:
        try:
            mod = importlib.import_module(f"batch_inference.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("batch_inference.commands"):
                continue
            raise
        mod.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from batch_inference.db import DatabaseUnavailable
    from batch_inference.plan import snapshot
    from batch_inference.spec import SpecError
    from batch_inference.status import UnknownJob

    try:
        return int(args.func(args) or 0)
    except (SpecError, snapshot.SnapshotError, UnknownJob, DatabaseUnavailable, ValueError) as exc:
        print(f"batch-inference {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

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
import re
import sys
from typing import Any

# Commands contributed by other modules: each has register(subparsers).
_EXTRA_COMMANDS = ("capacity", "cutoff", "cost", "validate", "publish", "chaos", "fallback", "demo")


# C0 and C1 control characters, DEL, and the bidirectional overrides: a terminal
# acts on them (colours, cursor moves, title changes, reordered text).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
# json.dumps escapes C0 itself; these it leaves as they are.
_JSON_CONTROL = re.compile("[\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: Any) -> str:
    """``text`` safe to print on a terminal: control characters as escapes (``\\x1b``, ``\\u202e``)."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), str(text))


def _json(obj: Any) -> None:
    print(_JSON_CONTROL.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(obj, default=str, ensure_ascii=False)))


def one_line(message: Any, limit: int = 400) -> str:
    """An error message as one printable line of at most ``limit`` characters."""
    text = printable(" ".join(str(message).split()))
    return text if len(text) <= limit else text[:limit - 1] + "\u2026"


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
        spec = spec.with_overrides(**overrides)
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
        # Ids, reasons and raw outputs come from records and the model: escaped, never sent raw to a terminal.
        for r in rows:
            raw = printable((r["raw_output"] or "")[:80])
            print(f"{printable(r['record_id'])}\t{r['attempts']}\t{printable(r['reason'])}\t{raw}")
        print(f"{len(rows)} dead letter(s)", file=sys.stderr)
    return 0


def cmd_drop(args: argparse.Namespace) -> int:
    from batch_inference.plan import drop_job_version
    from batch_inference.status import UnknownJob

    with _conn(args) as conn:
        if not drop_job_version(conn, args.job_version):
            raise UnknownJob(f"no job version {args.job_version!r}")
    print("dropped", file=sys.stderr)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from gpu_runner.worker import config_from_args, run_worker

    return run_worker(config_from_args(args))


def cmd_grant(args: argparse.Namespace) -> int:
    from batch_inference.plan import grant_job

    with _conn(args) as conn:
        grant_job(conn, args.role, args.job_version, revoke=args.revoke)
    print(f"{'revoked' if args.revoke else 'granted'}: role {args.role} on {args.job_version}", file=sys.stderr)
    return 0


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (``batch-inference submit: error: ...``), exit 2; subcommands inherit it."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {one_line(message)}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="batch-inference", description=__doc__.splitlines()[0])
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
    import psycopg

    from batch_inference.exceptions import BatchInferenceError

    try:
        return int(args.func(args) or 0)
    except BatchInferenceError as exc:
        print(f"batch-inference {args.command}: error: {one_line(exc.args[0] if exc.args else exc)}",
              file=sys.stderr)
        return 2
    except psycopg.Error as exc:
        # The database refused: its first message line, not a traceback (each command's
        # writes are one transaction, so a refusal leaves nothing half-written).
        diag = getattr(exc, "diag", None)
        msg = (diag.message_primary if diag is not None else None) or str(exc) or type(exc).__name__
        print(f"batch-inference {args.command}: error: {one_line(msg)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

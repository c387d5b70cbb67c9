"""``batch-inference cutoff``: when the fallback has to start.

Without a job version it is a calculator over the figures given; with one it
reads the job's live counts (and its spec's rate and overhead) from the
database. Either way it prints the latest safe start and the fallback
duration it was derived from.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from batch_inference.commands.common import db_arg
from batch_inference.cutoff import (
    DEFAULT_OVERHEAD_S,
    DEFAULT_RATE,
    UTC,
    decide,
    parse_clock,
)


def register(sub: Any) -> None:
    p = sub.add_parser(
        "cutoff",
        help="latest safe start of the fallback for a deadline",
        description="Deadline minus (overhead + outstanding / rate), floored to the minute.",
    )
    p.add_argument("job_version", nargs="?", help="read outstanding rows from this job's live counts")
    p.add_argument("--deadline", required=True, help="HH:MM (next occurrence after --now) or an ISO datetime")
    p.add_argument("--outstanding", type=int, help="rows the fallback would have to produce (required without JOB_VERSION)")
    p.add_argument("--done", type=int, default=0, help="rows already stored (for the log line)")
    p.add_argument("--rate", type=float, help=f"sustained fallback rows/s (default: the spec's, else {DEFAULT_RATE:g})")
    p.add_argument("--overhead", type=float, help=f"fixed overhead seconds (default: the spec's, else {DEFAULT_OVERHEAD_S:g})")
    p.add_argument("--now", help="HH:MM on today's date, or an ISO datetime (default: the clock)")
    p.add_argument("--tz", default="UTC", help="zone the clock times are read in (default UTC)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    db_arg(p)
    p.set_defaults(func=run)


def _from_job(args: argparse.Namespace) -> tuple[int, int, float | None, float | None]:
    """(done, outstanding, spec rate, spec overhead) from the database."""
    from batch_inference import db, status  # lazily: the calculator needs no database
    from batch_inference.hosted.counts import hosted_row, with_hosted

    conn = db.connect(getattr(args, "db", None))
    try:
        counts = with_hosted(status.job_counts(conn, args.job_version), hosted_row(conn, args.job_version))
        rate = overhead = None
        job_spec = getattr(status, "job_spec", None)
        spec = job_spec(conn, args.job_version) if job_spec else None
        fb = getattr(spec, "fallback", None)
        if fb is None and isinstance(spec, dict):
            fb = spec.get("fallback")
        if isinstance(fb, dict):
            rate, overhead = fb.get("rate"), fb.get("overhead_s")
        elif fb is not None:
            rate, overhead = fb.rate, fb.overhead_s
    finally:
        close = getattr(conn, "close", None)
        if close:
            close()
    return int(counts["stored"]), int(counts["outstanding"]), rate, overhead


def run(args: argparse.Namespace) -> int:
    try:
        tz = UTC if args.tz.upper() == "UTC" else ZoneInfo(args.tz)
        clock = datetime.now(tz)
        now = parse_clock(args.now, clock, tz, roll=False) if args.now else clock
        deadline = parse_clock(args.deadline, now, tz)
        done, outstanding = args.done, args.outstanding
        rate, overhead = args.rate, args.overhead
        source = "given"
        if args.job_version:
            done, outstanding, spec_rate, spec_overhead = _from_job(args)
            source = f"job {args.job_version}"
            rate = rate if rate is not None else spec_rate
            overhead = overhead if overhead is not None else spec_overhead
        elif outstanding is None:
            print("cutoff: give --outstanding N, or a JOB_VERSION to read it from", file=sys.stderr)
            return 2
        rate = DEFAULT_RATE if rate is None else rate
        overhead = DEFAULT_OVERHEAD_S if overhead is None else overhead
        d = decide(now, deadline, outstanding, rate, overhead, done=done)
    except (ValueError, KeyError, ZoneInfoNotFoundError) as exc:
        print(f"cutoff: {exc}", file=sys.stderr)
        return 2

    if args.json:
        out = d.to_dict()
        out["counts_from"] = source
        if args.job_version:
            out["job_version"] = args.job_version
        print(json.dumps(out))
        return 0
    redrive = d.outstanding / d.rate
    print(f"latest safe start {d.latest_safe_start:%H:%M:%S} ({d.latest_safe_start.isoformat()})")
    print(
        f"fallback needs {d.fallback_s:,.0f} s ({d.fallback_s / 60:.1f} min): "
        f"{d.overhead_s:,.0f} s overhead + {d.outstanding:,} rows / {d.rate:g} per s = {redrive:,.0f} s"
    )
    print(d.log_line(args.job_version))
    return 0

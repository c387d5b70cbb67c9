"""``batch-inference fallback``: re-drive a job's outstanding records through the synchronous pool.

Three forms, the same code as the Airflow tasks:

* ``fallback JOB --base-url URL``: fire now. The job goes into fallback
  mode (batch workers drain) and the pool re-drives what is outstanding.
* ``fallback JOB --base-url URL --deadline 06:00``: first watch the moving
  cutoff (the trigger's loop), then re-drive if it fires. An early warning
  is logged and the watch goes on.
* ``fallback JOB --base-url URL --deadline 06:00 --relabel-at 04:30``:
  relabel mode. Wait for the fixed time, then re-drive whatever is
  outstanding: nothing on a good night, everything on a bad one. The
  moving cutoff still fires first if it comes earlier.

Without Airflow these are what a cron entry runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import threading
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo

from batch_inference.commands.common import db_arg
from batch_inference.cutoff import UTC, parse_clock, relabel_start

log = logging.getLogger("batch_inference.fallback")


def register(sub: Any) -> None:
    p = sub.add_parser(
        "fallback",
        help="re-drive outstanding records through the synchronous fallback pool (now, at the cutoff, or at a fixed time)",
        description="Claims the job's remaining shards with transport 'fallback' and drives their records "
                    "through an OpenAI-compatible endpoint at a sustained rate. Records its measured rate and "
                    "overhead in bi.fallback_runs.",
    )
    p.add_argument("job_version")
    p.add_argument("--base-url", help="OpenAI-compatible API root including /v1 (default: spec.fallback.base_url)")
    p.add_argument("--rate", type=float, help="sustained requests/s for the whole pool (default: spec.fallback.rate)")
    p.add_argument("--concurrency", type=int, help="requests in flight across the pool (default: spec.fallback.concurrency)")
    p.add_argument("--parallel-shards", type=int, default=4, help="shards held at once (default 4)")
    p.add_argument("--model", help="model name sent to the endpoint (default: spec.model.name)")
    p.add_argument("--style", choices=["json_schema", "json_object"],
                   help="response_format style: json_schema (vLLM, OpenAI) or json_object (llama.cpp server) "
                        "(default: spec.fallback.response_format_style)")
    p.add_argument("--hosted", action="store_true", default=None,
                   help="the endpoint is a hosted API (refused unless the record class is cleared for hosted APIs)")
    p.add_argument("--api-key-env", help="environment variable holding the API key")
    p.add_argument("--no-record", action="store_true", help="do not write this run to bi.fallback_runs (a drill)")
    g = p.add_argument_group("wait first (the cutoff watch)")
    g.add_argument("--deadline", help="watch the moving cutoff for this deadline (HH:MM or ISO) before re-driving")
    g.add_argument("--relabel-at", help="relabel mode: re-drive at this fixed time (HH:MM, the last one at or "
                                        "before --deadline, or ISO) whatever the counts")
    g.add_argument("--tz", default="UTC", help="zone of clock times (default UTC)")
    g.add_argument("--poll-interval", type=float, default=300.0, help="seconds between polls (default 300)")
    g.add_argument("--cutoff-rate", type=float, help="rows/s the cutoff assumes (default: history, else the spec)")
    g.add_argument("--cutoff-overhead", type=float, help="overhead seconds the cutoff assumes (default: history, else the spec)")
    g.add_argument("--step", type=int, default=60, help="floor the latest safe start to this many seconds")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    db_arg(p)
    p.set_defaults(func=run)


def _watch(args: argparse.Namespace, conninfo: str) -> dict[str, Any]:
    from batch_inference import deadline as watchlib

    tz = UTC if args.tz.upper() == "UTC" else ZoneInfo(args.tz)
    now = datetime.now(tz)
    deadline = parse_clock(args.deadline, now, tz)
    relabel = None
    if args.relabel_at:
        text = args.relabel_at.strip()
        relabel = parse_clock(text, deadline, tz) if ("T" in text or "-" in text[:5]) else relabel_start(deadline, text)
    cfg = watchlib.WatchConfig(job_version=args.job_version, deadline=deadline, poll_interval_s=args.poll_interval,
                               rate=args.cutoff_rate, overhead_s=args.cutoff_overhead, relabel_at=relabel,
                               step_s=args.step)
    while True:
        event = asyncio.run(watchlib.watch(lambda: watchlib.connect_async(conninfo), cfg))
        if event["status"] != watchlib.EARLY_WARNING:
            return event
        # The CLI has nobody to page but its log; the watch goes on, warned.
        log.warning("EARLY WARNING for %s: %s", args.job_version, event["reason"])
        cfg = watchlib.config_from_kwargs(**{**event["watch"], "warned": True})


def _stop_on_signal(pool: Any) -> None:
    """SIGTERM/SIGINT stop the pool like a preemption notice: write in-flight records, release leases.

    The pool's workers are threads, which cannot install signal handlers, so
    the main thread does it for them.
    """
    if threading.current_thread() is not threading.main_thread():
        return

    def on_signal(signum: int, _frame: Any) -> None:
        log.warning("signal %d: stopping the fallback pool (in-flight records are written, leases released)",
                    signum)
        pool.stop()

    for signum in (signal.SIGTERM, signal.SIGINT):
        _previous[signum] = signal.signal(signum, on_signal)


_previous: dict[int, Any] = {}  # handlers to put back when the run ends (the CLI may run in-process)


def run(args: argparse.Namespace) -> int:
    from batch_inference import db
    from batch_inference.fallback import FallbackEndpointUnavailable, FallbackIncomplete, FallbackRefused, run_fallback
    from batch_inference.exits import ExitCode

    conninfo = db.resolve_url(getattr(args, "db", None))
    if args.relabel_at and not args.deadline:
        print("fallback: --relabel-at needs --deadline (the fixed time is placed before it)", file=sys.stderr)
        return 2
    event = None
    deadline = None
    try:
        if args.deadline:
            tz = UTC if args.tz.upper() == "UTC" else ZoneInfo(args.tz)
            deadline = parse_clock(args.deadline, datetime.now(tz), tz)   # with fallback.tiers: what each row affords
            event = _watch(args, conninfo)
            if event["status"] == "error":
                print(f"fallback: cutoff watch failed: {event['message']}", file=sys.stderr)
                return 1
            if event["status"] == "complete":
                out = {"job_version": args.job_version, "fired": False, "watch": event}
                print(json.dumps(out, default=str) if args.json else
                      f"{args.job_version}: complete before the cutoff, nothing to re-drive")
                return 0
            log.warning("cutoff for %s: %s; %s", args.job_version, event["reason"], event["message"])
        result = run_fallback(conninfo, args.job_version, args.base_url, rate=args.rate,
                              concurrency=args.concurrency, model=args.model, style=args.style, hosted=args.hosted,
                              api_key_env=args.api_key_env, parallel_shards=args.parallel_shards,
                              record_run=not args.no_record, pool_ready=_stop_on_signal, deadline=deadline)
    except FallbackRefused as exc:
        print(f"batch-inference fallback: {exc}", file=sys.stderr)
        return 2
    except FallbackEndpointUnavailable as exc:
        print(f"batch-inference fallback: {exc}", file=sys.stderr)
        return ExitCode.ENDPOINT   # the worker's code for the same outage
    except FallbackIncomplete as exc:
        print(f"batch-inference fallback: {exc}", file=sys.stderr)
        return 1
    finally:
        for signum, handler in _previous.items():
            signal.signal(signum, handler)
        _previous.clear()
    if result.budget_stop:
        print(f"batch-inference fallback: stopped at the budget with {result.outstanding:,} record(s) outstanding: "
              f"{result.budget_page}", file=sys.stderr)
        return 1
    if result.budget_page:
        print(f"batch-inference fallback: PAGE: {result.budget_page}", file=sys.stderr)
    if result.stopped and result.outstanding:
        print(f"batch-inference fallback: stopped with {result.outstanding:,} record(s) outstanding; "
              "leases released for the next run", file=sys.stderr)
        return 143
    out = result.to_dict()
    if event is not None:
        out["watch"] = event
    if args.json:
        print(json.dumps(out, default=str))
    elif result.skipped:
        print(f"{args.job_version}: {result.skipped}; nothing re-driven")
    else:
        print(f"{args.job_version}: re-drove {result.records:,} record(s) ({result.stored:,} stored, "
              f"{result.dead:,} dead letters) in {result.busy_s:,.1f} s at {result.rate or 0:.3g} records/s; "
              f"{result.wall_s:,.1f} s from the cutoff to nothing outstanding (overhead {result.overhead_s or 0:,.1f} s)"
              + (f"; fallback run {result.fallback_run_id}" if result.fallback_run_id else ""))
    return 0

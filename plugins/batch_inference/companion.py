"""Companion job versions: a small job submitted and run to its end in this process.

The validator's golden run and judge (``batch_inference.evaluation`` grades what they store) and the
estimate's pilot each submit a version through ``plan.submit`` and run it with one in-process worker,
so it is keyed, resumable and stored like any job: a second validate reads a finished companion
instead of generating again. ``validate`` hands ``run_companion`` to ``evaluation.evaluate``, which
itself stays below the planner.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

from batch_inference import plan
from batch_inference.db import q
from batch_inference.spec import JobSpec
from batch_inference.status import job_counts


def conninfo_of(conn: psycopg.Connection) -> str:
    """The conninfo ``conn`` was opened with, password included, for an in-process worker."""
    return make_conninfo(conn.info.dsn, password=conn.info.password) if conn.info.password else conn.info.dsn


def run_companion(conn: psycopg.Connection, spec: JobSpec, serves: str, kind: str,
                  rows: list[dict[str, Any]] | None = None) -> tuple[str, int]:
    """Submit ``spec`` (over ``rows``, else its source read as for any job) as the ``kind``
    ('golden' or 'judge') companion of version ``serves`` (bi.companion_versions: left out of
    job lists, dropped with the last version it serves), and run what is left of it with an
    in-process worker; a version already done is only read. Returns (job version, worker exit code)."""
    job = plan.submit(conn, spec, rows).job_version
    conn.execute(q("companion_link"), {"job": serves, "companion": job, "kind": kind})
    if job_counts(conn, job)["outstanding"] == 0:
        return job, 0
    return job, run_in_process(conn, job)


def run_in_process(conn: psycopg.Connection, job: str, startup: dict[str, float] | None = None) -> int:
    """Run what is left of version ``job`` with one worker in this process (the engine its spec
    names), until no shard is pending; returns the worker's exit code. A companion version's
    run, and a pilot's (``batch_inference.estimate``). ``startup``, when given, receives the
    worker's start-up phases in seconds (connect, engine import, weights digest, engine load)."""
    from gpu_runner.worker import Worker, WorkerConfig   # the GPU runner imports no Airflow either

    # The worker takes SIGTERM and SIGINT as its preemption notice; the caller's own handlers
    # (an Airflow task's, the CLI's Ctrl-C) come back when it is done.
    saved = ({s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
             if threading.current_thread() is threading.main_thread() else {})
    try:
        worker = Worker(WorkerConfig(job_version=job, db_url=conninfo_of(conn), wait_for_leases=False,
                                     backoff=(0.5, 1.0, 2.0), flush_seconds=1.0))
        code = worker.run()
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    if startup is not None:
        startup.update(worker.startup)
    return int(code)


__all__ = ["conninfo_of", "run_companion", "run_in_process"]

"""Read-only views of a job: live counts, its spec, shards and dead letters.

Counts come from the shard table's per-shard counters, so reading them costs
the same at a thousand records or fifty million (the cutoff polls this).
"""

from __future__ import annotations

from typing import Any

import psycopg

from batch_inference.db import q
from batch_inference.exceptions import UnknownJob
from batch_inference.spec import JobSpec


def job_counts(conn: psycopg.Connection, job_version: str) -> dict[str, Any]:
    r = conn.execute(q("job_counts"), {"job": job_version}).fetchone()
    if r is None:
        raise UnknownJob(f"no job version {job_version!r}")
    out = dict(r)
    out["job_version"] = job_version
    out["shards"] = {"pending": out.pop("shards_pending"), "leased": out.pop("shards_leased"),
                     "done": out.pop("shards_done")}
    return out


def job_spec(conn: psycopg.Connection, job_version: str) -> JobSpec:
    r = conn.execute(q("job_spec"), {"job": job_version}).fetchone()
    if r is None:
        raise UnknownJob(f"no job version {job_version!r}")
    return JobSpec.model_validate(r["spec"])


def job_mode(conn: psycopg.Connection, job_version: str) -> tuple[str, str]:
    r = conn.execute(q("job_spec"), {"job": job_version}).fetchone()
    if r is None:
        raise UnknownJob(f"no job version {job_version!r}")
    return r["mode"], r["status"]


def shards(conn: psycopg.Connection, job_version: str) -> list[dict[str, Any]]:
    return conn.execute(q("shards_by_state"), {"job": job_version}).fetchall()


def dead_letters(conn: psycopg.Connection, job_version: str) -> list[dict[str, Any]]:
    return conn.execute(q("dead_letters"), {"job": job_version}).fetchall()


def fence_counts(conn: psycopg.Connection, job_version: str) -> dict[str, int]:
    return {r["op"]: int(r["n"]) for r in conn.execute(q("fence_counts"), {"job": job_version})}

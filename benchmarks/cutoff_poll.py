"""Cutoff poll: the time of ``batch_inference.status.job_counts`` (the query the
cutoff trigger polls) against the shard table of a large job.

The snapshot rows do not need to exist: the counts come from the shard
table's counters alone (summed per stripe, sql/schema/counts.sql), which is
the point being measured. Each
case inserts one ``bi.jobs`` row and its shards directly (60% done, 5% leased,
35% pending, counters filled in), beside a second job of the same size so the
poll has to find its own shards, then times 200 polls on one connection.

Cases: 10,000 shards for 50M records (the backfill at 5,000 per shard);
the same 10,000 shards for 500M records (10x the records, 50,000 per shard:
the time must not move); 100,000 shards for 500M records (10x the shards, the
10x job: the target is judged on the case with the most shards).

    python -m benchmarks.cutoff_poll [--polls N] [--cases 10000:50000000,...]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import psycopg

from batch_inference import db
from batch_inference.status import job_counts
from benchmarks.common import bench_spec, emit, fresh_server, machine, median, pg_version, rnd

TARGET_MS = 20.0
DEFAULT_CASES = ((10_000, 50_000_000), (10_000, 500_000_000), (100_000, 500_000_000))


def make_job(conn: psycopg.Connection, job: str, shards: int, records: int) -> None:
    spec = bench_spec()
    per = records // shards
    conn.execute("""INSERT INTO bi.jobs (job_version, dataset, spec_hash, snapshot_id, spec, model_name,
                                         model_digest, prompt_version, records, shards)
                    VALUES (%s, 'bench', %s, 'synthetic', %s::jsonb, 'noop', %s, 'v1', %s, %s)""",
                 (job, spec.spec_hash, json.dumps(spec.model_dump(mode="json")), spec.model.digest,
                  per * shards, shards))
    # States by shard number: the first 60% done, the next 5% leased, the rest pending.
    conn.execute("""
        INSERT INTO bi.shards (job_version, shard_no, state, epoch, claims, records, stored, dead,
                               lease_owner, lease_expires_at, first_claim_at, done_at)
        SELECT %(job)s, i, st, CASE WHEN st = 'pending' THEN 0 ELSE 1 END, CASE WHEN st = 'pending' THEN 0 ELSE 1 END,
               %(per)s,
               CASE st WHEN 'done' THEN %(per)s - 1 WHEN 'leased' THEN %(per)s / 2 ELSE 0 END,
               CASE st WHEN 'done' THEN 1 ELSE 0 END,
               CASE WHEN st = 'leased' THEN 'worker-' || i END,
               CASE WHEN st = 'leased' THEN clock_timestamp() + interval '10 minutes' END,
               CASE WHEN st <> 'pending' THEN clock_timestamp() END,
               CASE WHEN st = 'done' THEN clock_timestamp() END
          FROM (SELECT i, CASE WHEN i < %(n)s * 60 / 100 THEN 'done'
                               WHEN i < %(n)s * 65 / 100 THEN 'leased' ELSE 'pending' END AS st
                  FROM generate_series(0, %(n)s - 1) AS i) g""", {"job": job, "per": per, "n": shards})


def poll_case(conn: psycopg.Connection, shards: int, records: int, polls: int) -> dict[str, Any]:
    tag = f"{shards}_{records}"
    job, other = f"jv_poll_{tag}", f"jv_other_{tag}"
    make_job(conn, other, shards, records)
    make_job(conn, job, shards, records)
    conn.execute("VACUUM ANALYZE bi.shards")  # what autovacuum keeps up to date on a live table
    for _ in range(5):  # warm the plan cache and the buffer cache
        job_counts(conn, job)
    times = []
    for _ in range(polls):
        t0 = time.perf_counter()
        c = job_counts(conn, job)
        times.append(time.perf_counter() - t0)
    per = records // shards
    assert c["records"] == per * shards and c["shards"]["done"] == shards * 60 // 100, c
    times.sort()
    out = {"shards": shards, "records": per * shards, "median_ms": rnd(median(times) * 1e3),
           "p95_ms": rnd(times[int(0.95 * (len(times) - 1))] * 1e3)}
    conn.execute("DELETE FROM bi.jobs WHERE job_version IN (%s, %s)", (job, other))  # cascades to shards
    conn.execute("VACUUM bi.shards")
    return out


def run(cases: tuple[tuple[int, int], ...] = DEFAULT_CASES, polls: int = 200) -> dict[str, Any]:
    with fresh_server() as url, db.connect(url) as conn:
        # The baseline in the same run: a round trip of the smallest query, so a
        # slow moment of the machine shows as a slow baseline, not a slow poll.
        base = []
        for _ in range(polls):
            t0 = time.perf_counter()
            conn.execute("SELECT 1").fetchone()
            base.append(time.perf_counter() - t0)
        results = [poll_case(conn, s, r, polls) for s, r in cases]
        version = pg_version(conn)
    first = results[0]
    out: dict[str, Any] = {"benchmark": "cutoff_poll", "polls": polls, "round_trip_ms": rnd(median(base) * 1e3),
                           "cases": results}
    # Records 10x at a fixed shard count, and shards 10x, when those cases were run.
    same_shards = [r for r in results[1:] if r["shards"] == first["shards"] and r["records"] != first["records"]]
    more_shards = [r for r in results[1:] if r["shards"] != first["shards"]]
    if same_shards:
        out["records_x10_time_ratio"] = round(same_shards[0]["median_ms"] / first["median_ms"], 2)
    if more_shards:
        out["shards_x10_time_ratio"] = round(more_shards[0]["median_ms"] / first["median_ms"], 2)
    judged = max(results, key=lambda r: r["shards"])
    out.update({"median_ms": judged["median_ms"], "target": f"<= {TARGET_MS} ms at {judged['shards']} shards",
                "met": judged["median_ms"] <= TARGET_MS, "postgres": version, "machine": machine()})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--polls", type=int, default=200)
    ap.add_argument("--cases", default=",".join(f"{s}:{r}" for s, r in DEFAULT_CASES),
                    help="comma-separated SHARDS:RECORDS; the one with the most shards is judged against the target")
    a = ap.parse_args(argv)
    cases = tuple(tuple(int(x) for x in c.split(":")) for c in a.cases.split(","))
    emit(run(cases, a.polls))  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

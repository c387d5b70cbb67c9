"""Reads flat in job size: every read the dashboard or a CLI command makes on a
refresh, timed on two jobs ten times apart in records.

Each size is a job of R records in shards of S (so ten times the records is
ten times the shards), built directly in the ledger's tables as
benchmarks/cutoff_poll builds its jobs: the shard rows with their counters
(60% done, 5% leased, 35% pending; of the stored rows half through hosted
batch and a tenth through the fallback), and for what a read scans, the rows
themselves: the results the counters count (real rows in the job's
partition, with their transports and categories) and their category
counts (bi.category_stripes, as the puts keep them), a dead letter per
thousand records (a third without an ACL, a third team-a's, a third
team-b's; the trigger counts them), a provider batch per done shard. Before
timing, the counters are checked against a count of the rows. What does not
grow with the job stays the same at both sizes: 100 progress samples, no
review sample, no fallback history. The dead-letter reads run as a reader
role that holds team-a, under row-level security, as the dashboard runs them.

Each query runs ``--repeats`` times at each size on one connection, the two
sizes taking turns, after three warm-up runs of each; the line gives each
query's median at both sizes and their ratio, and the shared buffers one
run touches at each (EXPLAIN ANALYZE, BUFFERS) and theirs. At 1,000
records a shard the small job's 1,000 shards already fill the shard table's
page of 500 and its 600 done shards the burn-down's 500 (ui/data.py
DERIVED_SHARDS).
Baseline in the same run: ``SELECT 1`` (the round trip). ``met``: every ratio
<= 1.5.

    python -m benchmarks.reads [--sizes 1000000,10000000] [--shard-size 1000] [--repeats 31]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql as pgsql

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batch_inference import db  # noqa: E402
from batch_inference.cutoff import history_params  # noqa: E402
from batch_inference.ui.data import DERIVED_SHARDS  # noqa: E402
from benchmarks.common import bench_spec, emit, fresh_server, machine, median, pg_version, rnd  # noqa: E402

TARGET_RATIO = 1.5
SAMPLES = 100

# What a refresh reads, by query name (sql/queries.sql, sql/dashboard.sql, sql/hosted.sql, sql/evaluation.sql):
# who reads it, and its parameters from (job version, dataset).
READS: dict[str, tuple[str, Any]] = {
    "jobs": ("dashboard: job list", lambda j, d: {"dataset": d, "limit": 200, "dags": [], "undagged": True,
                                                  "companions": False}),
    "run_dags": ("dashboard: job list", lambda j, d: {}),
    "job_row": ("dashboard: every job panel", lambda j, d: {"job": j}),
    "job_counts": ("dashboard, status, cost, cutoff", lambda j, d: {"job": j}),
    "pointer": ("dashboard: job, drift, history", lambda j, d: {"dataset": d}),
    "companions_of": ("dashboard: job", lambda j, d: {"job": j}),
    "companion_serves": ("dashboard: job", lambda j, d: {"job": j}),
    "job_dags": ("dashboard: job access", lambda j, d: {"job": j}),
    "fallback_history": ("dashboard: job, progress", lambda j, d: history_params(d, 10)),
    "progress_samples": ("dashboard: progress", lambda j, d: {"job": j}),
    "shard_times": ("dashboard: progress (no samples)", lambda j, d: {"job": j, "n": DERIVED_SHARDS}),
    "shards_finished_at": ("dashboard: progress (finished)", lambda j, d: {"job": j}),
    "shard_states": ("dashboard: shards", lambda j, d: {"job": j}),
    "shard_page": ("dashboard: shards", lambda j, d: {"job": j, "limit": 500, "offset": 0}),
    "dead_letter_visible": ("dashboard: dead letters", lambda j, d: {"job": j}),
    "dead_letter_reasons": ("dashboard: dead letters", lambda j, d: {"job": j}),
    "dead_letter_page": ("dashboard: dead letters", lambda j, d: {"job": j, "limit": 100, "offset": 0}),
    "review_state": ("dashboard: review", lambda j, d: {"job": j}),
    "review_rows": ("dashboard: review", lambda j, d: {"job": j, "n": 1000}),
    "hosted_cost_rows": ("dashboard: cost; cost", lambda j, d: {"job": j}),
    "hosted_counts": ("cutoff", lambda j, d: {"job": j}),
    "category_counts": ("dashboard: drift (no report yet)", lambda j, d: {"job": j}),
    "previous_published": ("dashboard: drift", lambda j, d: {"dataset": d, "job": j}),
    "publish_history": ("dashboard: history", lambda j, d: {"dataset": d, "n": 50}),
}


# Read as the reader role (ui/data.py reading_as); READER sees the dead letters without an ACL and team-a's,
# not team-b's.
AS_READER = {"dead_letter_visible", "dead_letter_reasons", "dead_letter_page"}
READER = "bench_reader"


def make_reader(conn: psycopg.Connection) -> None:
    conn.execute(f"CREATE ROLE {READER} NOLOGIN IN ROLE bi_reader")
    conn.execute("INSERT INTO bi.reader_principals (role, principal) VALUES (%s, 'team-a')", (READER,))


def make_job(conn: psycopg.Connection, job: str, dataset: str, records: int, shard_size: int) -> None:
    spec = bench_spec()
    shards = records // shard_size
    conn.execute("""INSERT INTO bi.jobs (job_version, dataset, spec_hash, snapshot_id, spec, model_name,
                                         model_digest, prompt_version, records, shards)
                    VALUES (%s, %s, %s, 'synthetic', %s::jsonb, 'noop', %s, 'v1', %s, %s)""",
                 (job, dataset, spec.spec_hash, json.dumps(spec.model_dump(mode="json")), spec.model.digest,
                  shards * shard_size, shards))
    conn.execute("SELECT bi.create_job_partitions_v1(%s)", (job,))
    dead = max(1, shard_size // 1000)
    # States by shard number: the first 60% done, the next 5% leased, the rest pending. Of the stored rows,
    # the first half hosted, the next tenth by the fallback, the rest by batch workers.
    conn.execute("""
        INSERT INTO bi.shards (job_version, shard_no, state, epoch, claims, records, stored, stored_fallback,
                               stored_hosted, dead, lease_owner, lease_expires_at, first_claim_at, done_at)
        SELECT %(job)s, i, st, CASE WHEN st = 'pending' THEN 0 ELSE 1 END, CASE WHEN st = 'pending' THEN 0 ELSE 1 END,
               %(per)s, n, n / 10, n / 2, CASE st WHEN 'done' THEN %(dead)s ELSE 0 END,
               CASE WHEN st = 'leased' THEN 'worker-' || i END,
               CASE WHEN st = 'leased' THEN clock_timestamp() + interval '10 minutes' END,
               CASE WHEN st <> 'pending' THEN clock_timestamp() - interval '1 hour' END,
               CASE WHEN st = 'done' THEN clock_timestamp() - (i || ' seconds')::interval END
          FROM (SELECT i, st, CASE st WHEN 'done' THEN %(per)s - %(dead)s WHEN 'leased' THEN %(per)s / 2 ELSE 0 END AS n
                  FROM (SELECT i, CASE WHEN i < %(n)s * 60 / 100 THEN 'done'
                                       WHEN i < %(n)s * 65 / 100 THEN 'leased' ELSE 'pending' END AS st
                          FROM generate_series(0, %(n)s - 1) AS i) g) h""",
                 {"job": job, "per": shard_size, "n": shards, "dead": dead})
    # The rows the counters count, with the transports they say.
    conn.execute("""
        INSERT INTO bi.results (job_version, record_id, output, category, model_name, model_digest, prompt_version,
                                transport, engine, endpoint, worker_id, epoch)
        SELECT s.job_version, 'r' || lpad((s.shard_no::bigint * s.records + k)::text, 10, '0'),
               '{"category": "bug"}'::jsonb, (ARRAY['bug', 'billing', 'account', 'other'])[1 + k %% 4],
               'noop', %(digest)s, 'v1',
               CASE WHEN k < s.stored_hosted THEN 'hosted_batch'
                    WHEN k < s.stored_hosted + s.stored_fallback THEN 'fallback' ELSE 'batch' END,
               'noop', 'local', 'w', 1
          FROM bi.shards s CROSS JOIN LATERAL generate_series(0, s.stored - 1) AS k
         WHERE s.job_version = %(job)s AND s.stored > 0""", {"job": job, "digest": spec.model.digest})
    # Their categories, counted as bi.put_results_v3 counts them: per stripe of the shard.
    conn.execute("""
        INSERT INTO bi.category_stripes (job_version, stripe, category, n)
        SELECT s.job_version, s.shard_no %% bi.category_stripe_count_v1(),
               (ARRAY['bug', 'billing', 'account', 'other'])[1 + k %% 4], count(*)
          FROM bi.shards s CROSS JOIN LATERAL generate_series(0, s.stored - 1) AS k
         WHERE s.job_version = %(job)s AND s.stored > 0 GROUP BY 1, 2, 3""", {"job": job})
    conn.execute("""
        INSERT INTO bi.dead_letters (job_version, record_id, reason, error, attempts, stage, model_name,
                                     model_digest, prompt_version, transport, acl)
        SELECT s.job_version, 'r' || lpad((s.shard_no::bigint * s.records + s.records - 1 - k)::text, 10, '0'),
               (ARRAY['output does not match the schema', 'HTTP 400: bad request', 'engine returned no output',
                      'output is not valid JSON'])[1 + k %% 4], 'error text', 3, 'worker', 'noop', %(digest)s,
               'v1', 'batch', CASE s.shard_no %% 3 WHEN 1 THEN ARRAY['team-a'] WHEN 2 THEN ARRAY['team-b'] END
          FROM bi.shards s CROSS JOIN LATERAL generate_series(0, s.dead - 1) AS k
         WHERE s.job_version = %(job)s AND s.dead > 0""", {"job": job, "digest": spec.model.digest})
    conn.execute("""
        INSERT INTO bi.hosted_batches (job_version, shard_no, intent_no, idem_key, provider, epoch, record_ids,
                                       provider_batch_id, state, total, succeeded, input_tokens, output_tokens,
                                       ended_at, reconciled_at)
        SELECT s.job_version, s.shard_no, 1, s.job_version || '-' || s.shard_no, 'openai', 1, ARRAY[]::text[],
               'batch_' || s.shard_no, 'reconciled', s.stored_hosted, s.stored_hosted, 100 * s.stored_hosted,
               40 * s.stored_hosted, clock_timestamp(), clock_timestamp()
          FROM bi.shards s WHERE s.job_version = %(job)s AND s.state = 'done'""", {"job": job})
    conn.execute("""
        INSERT INTO bi.progress (job_version, at, stored, dead_letters, outstanding)
        SELECT %(job)s, clock_timestamp() - (i || ' minutes')::interval, i, 0, %(n)s - i
          FROM generate_series(1, %(samples)s) AS i""", {"job": job, "n": records, "samples": SAMPLES})


def time_query(conn: psycopg.Connection, name: str, params: dict[int, dict[str, Any]],
               repeats: int) -> tuple[dict[int, float], dict[int, int]]:
    """Median ms of one query at each size; the sizes take turns run by run, after three warm-up runs of
    each, so a slow moment of the machine falls on both; and the shared buffers one run touches at each. A query the dashboard runs as the signed-in
    user's reader role (AS_READER) runs as READER, under row-level security."""
    sql = db.q(name)
    if name in AS_READER:
        conn.execute(pgsql.SQL("SET ROLE {}").format(pgsql.Identifier(READER)))   # this session, not one transaction
    for _ in range(3):
        for p in params.values():
            conn.execute(sql, p).fetchall()
    times: dict[int, list[float]] = {n: [] for n in params}
    for _ in range(repeats):
        for n, p in params.items():
            t0 = time.perf_counter()
            conn.execute(sql, p).fetchall()
            times[n].append(time.perf_counter() - t0)
    buffers = {n: plan_buffers(conn, sql, p) for n, p in params.items()}
    if name in AS_READER:
        conn.execute("RESET ROLE")
    return {n: median(t) * 1e3 for n, t in times.items()}, buffers


def plan_buffers(conn: psycopg.Connection, sql: str, params: dict[str, Any]) -> int:
    """The shared buffers one run of the statement touches (hit or read, functions it calls included):
    its work, which the machine's load does not move."""
    plan = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql, params).fetchone()
    top = next(iter(plan.values()))[0]["Plan"]
    return int(top.get("Shared Hit Blocks", 0)) + int(top.get("Shared Read Blocks", 0))


def run(sizes: list[int], shard_size: int, repeats: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    with fresh_server() as url, db.connect(url) as conn:
        build_s = {}
        jobs = {}
        for n in sizes:
            tb = time.perf_counter()
            job, dataset = f"jv_reads_{n}", f"reads_{n}"
            make_job(conn, job, dataset, n, shard_size)
            jobs[n] = (job, dataset)
            build_s[str(n)] = rnd(time.perf_counter() - tb, 2)
        make_reader(conn)
        conn.execute("VACUUM ANALYZE")     # what autovacuum keeps up to date on a live ledger
        for n, (job, _) in jobs.items():    # the counters and the rows they count agree
            hosted = conn.execute(db.q("hosted_cost_rows"), {"job": job}).fetchone()["rows"]
            scanned = conn.execute("SELECT count(*) AS n FROM bi.results WHERE job_version = %s "
                                   "AND transport = 'hosted_batch'", (job,)).fetchone()["n"]
            assert hosted == scanned, (n, hosted, scanned)
            counted = {r["category"]: r["n"] for r in conn.execute(db.q("category_counts"), {"job": job})}
            grouped = {r["category"]: r["n"] for r in conn.execute(
                "SELECT category, count(*) AS n FROM bi.results WHERE job_version = %s GROUP BY category", (job,))}
            assert counted == grouped, (n, counted, grouped)
        base = []
        for _ in range(repeats * 5):
            tb = time.perf_counter()
            conn.execute("SELECT 1").fetchone()
            base.append(time.perf_counter() - tb)
        small, large = sizes
        queries = {}
        for name, (reader, params) in READS.items():
            ms, buffers = time_query(conn, name, {n: params(*jobs[n]) for n in (small, large)}, repeats)
            queries[name] = {"reader": reader, "ms": {str(n): rnd(v) for n, v in ms.items()},
                             "ratio": rnd(ms[large] / max(ms[small], 1e-6), 2),
                             "buffers": {str(n): v for n, v in buffers.items()},
                             "buffers_ratio": rnd(buffers[large] / max(buffers[small], 1), 2)}
        version = pg_version(conn)
    over = sorted(name for name, r in queries.items() if r["ratio"] > TARGET_RATIO)
    return {"benchmark": "reads", "target": f"every refresh read <= {TARGET_RATIO}x between the two sizes",
            "met": not over, "machine": machine(), "wall_s": rnd(time.perf_counter() - t0, 1), "postgres": version,
            "sizes": sizes, "shard_size": shard_size, "repeats": repeats, "build_s": build_s,
            "round_trip_ms": rnd(median(base) * 1e3), "queries": queries, "over_target": over,
            "max_ratio": max(r["ratio"] for r in queries.values())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000000,10000000", help="two job sizes in records, ten times apart")
    ap.add_argument("--shard-size", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=31)
    a = ap.parse_args(argv)
    sizes = [int(x) for x in a.sizes.split(",")]
    if len(sizes) != 2:
        ap.error("--sizes takes two sizes")
    emit(run(sizes, a.shard_size, a.repeats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Ten times the seed: hundreds of workers on one ledger through PgBouncer.

Simulated workers, many per process (asyncio, a few processes), behave like
``gpu_runner.worker`` on the wire: each holds two connections to PgBouncer in
transaction mode (its main one and its renewal thread's), claims a shard,
reads its records (a page of ``SHARD_READ_PAGE`` a call), produces results at ``--rate`` records/s (the seed's 18.7
per worker), puts them through the ledger's named statements every
``--flush-seconds`` (or ``--flush-every`` records), renews its lease every
``renew_seconds`` (jittered down by up to a fifth, as the worker does) and
completes the shard. Now and then one stalls past its lease (the shard moves
on; its next write is refused) or dies without a release (its connections
close; a replacement starts, as a new pod would).

At each level (``--workers 50,200,500``) all workers start at once and, as
the pod operator's workers do, each waits a random part of ``--start-jitter``
seconds before its first claim; ``--warmup`` seconds after the last could
have claimed, the window of ``--seconds`` opens, and the line reports
for that window: sustained rows/s (the job's stored counter), renewals/s,
p50/p99 of each ledger call, PostgreSQL CPU (and PgBouncer's) per 1,000 rows,
client and server connections, backends seen waiting on a lock, and the
cutoff poll (``status.job_counts`` through PgBouncer, once a second) under
that load. Beside them, in the same run: the single-connection put-if-absent
ceiling (benchmarks.control_plane.raw_ceiling) in batches of 1,000 and of the
simulated workers' put size.

    python -m benchmarks.scale [--workers 50,200,500] [--seconds 60] [--processes 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import threading
import time
from typing import Any

import psycopg
import psycopg.sql
from psycopg.rows import dict_row

from batch_inference import db
from batch_inference.engines.noop import minimal_instance
from batch_inference.ledger import FLEET_START_JITTER_SECONDS, SHARD_READ_PAGE
from batch_inference.plan import submit
from batch_inference.status import job_counts
from benchmarks.common import (BENCH_SCHEMA, PYTHON, REPO, ServerCpu, bench_spec, emit, fresh_server, machine,
                               make_tickets, median, pg_version, rnd, worker_env)
from benchmarks.control_plane import raw_ceiling
from gpu_runner.worker import RENEW_JITTER, WorkerConfig

SEED_ROWS_S = 9000          # the seed's 10x result rate
RENEWALS_PER_30S = 480  # 500 workers renewing every 24-30 s, less those between two shards (issue 22)
P99_TARGET_MS = 100.0
CALLS = ("claim", "records", "renew", "put", "complete", "cutoff_poll")
# The fleet's first claims (before the window): as the worker saw them, and the
# part the server spent on them (the rest: PgBouncer's queue and the client's loop)
START = ("claim_at_start", "claim_at_start_server")
# Printed beside the calls, not a call: a claimed shard's whole read, its pages together
WHOLE = ("shard_read",)
# claim_shard, with the time from the server's receipt of the statement to its end
CLAIM_TIMED = ("SELECT c.*, extract(epoch FROM clock_timestamp() - statement_timestamp())::float8 AS server_s"
               f" FROM ({db.q('claim_shard').strip().rstrip(';')}) c")


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * (len(xs) - 1) + 0.5))]


def window(a: argparse.Namespace) -> tuple[float, float]:
    """The measured window: it opens --warmup seconds after the last worker's
    start (--start-jitter after the fleet's), and lasts --seconds."""
    opens = a.start + a.start_jitter + a.warmup
    return opens, opens + a.seconds


# -- one simulated worker ------------------------------------------------------------

class Sim:
    """The workers of one process and what they measured inside the window."""

    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.rng = random.Random(a.seed)
        self.window = window(a)
        self.lat: dict[str, list[float]] = {c: [] for c in (*CALLS, *START, *WHOLE)}
        self.count = {"renewals": 0, "rows_put": 0, "stale": 0, "stalls": 0, "kills": 0, "claims": 0,
                      "no_shard": 0, "errors": 0}
        self.payload = json.dumps(minimal_instance(BENCH_SCHEMA), ensure_ascii=False)

    def in_window(self, t: float) -> bool:
        return self.window[0] <= t < self.window[1]

    async def call(self, conn: psycopg.AsyncConnection, name: str, stat: str, params: dict[str, Any]) -> list:
        t0 = time.time()
        cur = await conn.execute(CLAIM_TIMED if name == "claim_shard" else db.q(name), params)
        rows = await cur.fetchall()
        if self.in_window(t0):
            self.lat[stat].append(time.time() - t0)
        elif stat == "claim" and t0 < self.window[0]:
            self.lat["claim_at_start"].append(time.time() - t0)
            if rows:
                self.lat["claim_at_start_server"].append(rows[0]["server_s"])
        return rows

    async def connect(self) -> psycopg.AsyncConnection:
        return await psycopg.AsyncConnection.connect(self.a.url, autocommit=True, row_factory=dict_row,
                                                     prepare_threshold=db.PREPARE_THRESHOLD,
                                                     application_name="batch-inference-scale")

    def fault(self, per_minute: float, seconds: float) -> bool:
        return self.rng.random() < per_minute * seconds / 60.0

    async def renew_loop(self, conn: psycopg.AsyncConnection, args: dict[str, Any], stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.a.renew * self.rng.uniform(RENEW_JITTER, 1.0))
                return
            except asyncio.TimeoutError:
                pass
            t0 = time.time()
            row = (await self.call(conn, "renew_lease", "renew", {**args, "lease_s": None}))[0]
            if row["stale"]:
                self.count["stale"] += 1
                return
            if self.in_window(t0):
                self.count["renewals"] += 1

    async def worker(self, name: str) -> None:
        """Claim, read, put at the rate, renew, complete; until the end of the run."""
        a = self.a
        end = self.window[1]
        main, renew_conn = await self.connect(), await self.connect()
        try:
            # the worker's start: a random part of --start-jitter before its first claim
            await asyncio.sleep(min(self.rng.uniform(0.0, a.start_jitter), max(0.0, end - time.time())))
            while time.time() < end:
                claimed = await self.call(main, "claim_shard", "claim",
                                          {"job": a.job, "owner": name, "transport": "batch", "lease_s": None})
                if not claimed:
                    self.count["no_shard"] += 1
                    await asyncio.sleep(min(a.poll, max(0.0, end - time.time())))
                    continue
                self.count["claims"] += 1
                lease = claimed[0]
                args = {"job": a.job, "shard": lease["shard_no"], "epoch": lease["epoch"], "owner": name,
                        "transport": "batch", "engine": "noop", "endpoint": "local"}
                ids = await self.read_shard(main, args)
                stop = asyncio.Event()
                renewer = asyncio.create_task(self.renew_loop(renew_conn, args, stop))
                try:
                    outcome = await self.run_shard(main, args, ids, end)
                finally:
                    stop.set()
                    await renewer
                if outcome == "killed":
                    self.count["kills"] += 1
                    return
        finally:
            await main.close()
            await renew_conn.close()

    async def read_shard(self, main: psycopg.AsyncConnection, args: dict[str, Any]) -> list[str]:
        """The shard's records to do, a page a call, as Ledger.record_columns reads them."""
        ids: list[str] = []
        t0 = time.time()
        while True:
            rows = await self.call(main, "shard_records", "records", {**args, "after": ids[-1] if ids else None,
                                                                      "limit": SHARD_READ_PAGE})
            ids += [r["record_id"] for r in rows]
            if len(rows) < SHARD_READ_PAGE:
                break
        if self.in_window(t0):
            self.lat["shard_read"].append(time.time() - t0)
        return ids

    async def run_shard(self, main: psycopg.AsyncConnection, args: dict[str, Any], ids: list[str],
                        end: float) -> str:
        a = self.a
        started = time.monotonic()
        done = 0
        while done < len(ids) and time.time() < end:
            # the next flush: flush_seconds from now, or when flush_every records (or the
            # shard's last ones) are ready
            target = min(done + a.flush_every, len(ids))
            wait = min(a.flush_seconds, max(0.0, target / a.rate - (time.monotonic() - started)))
            await asyncio.sleep(wait)
            if self.fault(a.kills_per_minute, wait):
                return "killed"           # no release: the lease expires, the next claimant counts a lost lease
            if self.fault(a.stalls_per_minute, wait):
                self.count["stalls"] += 1
                # stopped past its lease (its renewals stop too)
                await asyncio.sleep(min(a.lease + 1, max(0.0, end - time.time())))
                started = time.monotonic() - done / a.rate
            ready = min(len(ids), int((time.monotonic() - started) * a.rate))
            if ready <= done:
                continue
            chunk = ids[done:ready]
            t0 = time.time()
            row = (await self.call(main, "put_results", "put",
                                   {**args, "ids": chunk, "outputs": [self.payload] * len(chunk),
                                    "categories": ["billing"] * len(chunk)}))[0]
            if row["stale"]:
                self.count["stale"] += 1
                return "stale"
            if self.in_window(t0):
                self.count["rows_put"] += row["n"]
            done = ready
        if done < len(ids):
            return "ended"
        row = (await self.call(main, "complete_shard", "complete", args))[0]
        if row["stale"]:
            self.count["stale"] += 1
        return "done"

    async def run(self) -> None:
        a = self.a
        await asyncio.sleep(max(0.0, a.start - time.time()))
        tasks = [asyncio.create_task(self.keep_one(f"{a.name}-{i}")) for i in range(a.workers)]
        await asyncio.gather(*tasks)

    async def keep_one(self, name: str) -> None:
        """One worker slot: a worker, and after it dies, its replacement."""
        gen = 0
        while time.time() < self.window[1]:
            try:
                await self.worker(f"{name}-g{gen}")
            except psycopg.Error:
                self.count["errors"] += 1
            gen += 1


def child(a: argparse.Namespace) -> int:
    sim = Sim(a)
    asyncio.run(sim.run())
    print(json.dumps({"lat": sim.lat, "count": sim.count}), flush=True)
    return 0


# -- one level -------------------------------------------------------------------

class Sampler(threading.Thread):
    """Once a second inside the window: the cutoff poll through PgBouncer (timed),
    and the connections and lock waits PostgreSQL sees (direct)."""

    def __init__(self, direct_url: str, pooled_url: str, job: str, window: tuple[float, float]):
        super().__init__(daemon=True)
        self.direct_url, self.pooled_url, self.job, self.window = direct_url, pooled_url, job, window
        self.poll: list[float] = []
        self.server_conns: list[int] = []
        self.lock_waits: list[int] = []
        self.waiting: dict[str, int] = {}   # "function: lock" a waiting backend was in, by samples

    def run(self) -> None:
        with db.connect(self.pooled_url) as pooled, db.connect(self.direct_url) as direct:
            time.sleep(max(0.0, self.window[0] - time.time()))
            while time.time() < self.window[1]:
                tick = time.time()
                t0 = time.perf_counter()
                job_counts(pooled, self.job)
                self.poll.append(time.perf_counter() - t0)
                # every client backend of the database but this one and the run's own direct connection
                r = direct.execute(
                    "SELECT count(*) AS n, count(*) FILTER (WHERE wait_event_type = 'Lock') AS locks"
                    "  FROM pg_stat_activity WHERE datname = current_database() AND backend_type = 'client backend'"
                    "   AND pid <> pg_backend_pid()").fetchone()
                self.server_conns.append(int(r["n"]) - 1)
                self.lock_waits.append(int(r["locks"]))
                if r["locks"]:
                    for w in direct.execute(LOCK_WAITERS):
                        self.waiting[w["call"]] = self.waiting.get(w["call"], 0) + int(w["n"])
                time.sleep(max(0.0, tick + 1.0 - time.time()))


PRESTORE = """
WITH pre AS (
    SELECT s.shard_no, floor(random() * s.records)::integer AS k
      FROM bi.shards s WHERE s.job_version = %(job)s AND s.shard_no < %(n)s
), stored AS (
    INSERT INTO bi.results (job_version, record_id, output, category, model_name, model_digest, prompt_version,
                            transport, worker_id, epoch, acl, content_hash)
    SELECT x.job_version, x.record_id, %(output)s::jsonb, 'billing', j.model_name, j.model_digest,
           j.prompt_version, 'batch', 'earlier', 0, x.acl, x.content_hash
      FROM (SELECT sr.*, row_number() OVER (PARTITION BY sr.shard_no ORDER BY sr.record_id) AS rn
              FROM bi.snapshot_rows sr WHERE sr.job_version = %(job)s AND sr.shard_no < %(n)s) x
      JOIN pre ON pre.shard_no = x.shard_no AND x.rn <= pre.k
      JOIN bi.jobs j ON j.job_version = x.job_version
)
UPDATE bi.shards s SET stored = pre.k FROM pre
 WHERE s.job_version = %(job)s AND s.shard_no = pre.shard_no
"""


# "function: lock relation": the relation of a relation or extension lock, its
# job's partition suffix written <job> (a table, or its index: ..._pkey)
LOCK_WAITERS = """
SELECT coalesce(substring(a.query from 'bi[.]([a-z_0-9]+)'), left(a.query, 40)) || ': ' || a.wait_event
       || coalesce(' ' || regexp_replace(l.relation::regclass::text, '_[0-9a-f]{16}', '_<job>'), '') AS call,
       count(*) AS n
  FROM pg_stat_activity a
  LEFT JOIN pg_locks l ON l.pid = a.pid AND NOT l.granted AND l.relation IS NOT NULL
 WHERE a.datname = current_database() AND a.wait_event_type = 'Lock' GROUP BY 1
"""
WAL_LSN = "SELECT pg_current_wal_lsn() AS lsn"
WAL_SINCE = "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %(lsn)s) AS bytes"
PARTITION_BYTES = """
SELECT (SELECT sum(pg_total_relation_size(t.relid))
          FROM pg_partition_tree(format('bi.%%I', 'results_' || substr(md5(%(job)s), 1, 16))::regclass) t
         WHERE t.isleaf)::bigint AS results,
       pg_total_relation_size(format('bi.%%I', 'snapshot_rows_' || substr(md5(%(job)s), 1, 16))::regclass) AS snapshot
"""


def prestore(conn: psycopg.Connection, job: str, workers: int, seed: int) -> None:
    """The job some hours in: each of the first ``workers`` shards (the ones the
    fleet claims first) has a random share of its records stored already, so
    the fleet's completions and next claims come spread over the window rather
    than in one wave a whole shard's time after the start. Autovacuum has been
    through the job's snapshot and results, as it would have some hours in:
    otherwise each worker's first shard read sets the hint bits of the rows it
    reads, and the fleet's start queues behind that."""
    conn.execute("SELECT setseed(%s)", (0.5 / (seed + 1),))
    conn.execute(PRESTORE, {"job": job, "n": workers, "output": json.dumps(minimal_instance(BENCH_SCHEMA))})
    suffix = conn.execute("SELECT substr(md5(%s), 1, 16) AS s", (job,)).fetchone()["s"]
    for t in ("snapshot_rows", "results"):
        conn.execute(psycopg.sql.SQL("VACUUM (ANALYZE) {}").format(psycopg.sql.Identifier("bi", f"{t}_{suffix}")))
    conn.execute("ANALYZE bi.shards")


def bouncer_stats(url: str) -> dict[str, float]:
    """PgBouncer's totals for the benchmark's database (SHOW STATS, on its admin console)."""
    admin = url.rsplit("/", 1)[0] + "/pgbouncer"
    with psycopg.connect(admin, autocommit=True, cursor_factory=psycopg.ClientCursor) as c:
        cur = c.execute("SHOW STATS")
        names = [d.name for d in cur.description or []]
        for row in cur.fetchall():
            r = dict(zip(names, row))
            if r["database"] == url.rsplit("/", 1)[1]:
                return {k: float(v) for k, v in r.items() if k.startswith("total_")}
    return {}


def level(a: argparse.Namespace, url: str, conn: psycopg.Connection, pooled_url: str, bouncer_pid: int,
          workers: int) -> dict[str, Any]:
    import psutil

    table = f"public.tickets_{workers}"
    # a first shard for each worker, and the shards that replace those finished in the run
    need = workers * a.shard_size + int(workers * a.rate * (a.start_jitter + a.warmup + a.seconds + 5) * 1.1) \
        + workers * a.shard_size // 3
    make_tickets(conn, need, table=table)
    spec = bench_spec(table=table, shard_size=a.shard_size, lease_seconds=a.lease, renew_seconds=a.renew,
                      prompt={"version": f"scale_{workers}", "system": "Classify the support ticket."})
    job = submit(conn, spec).job_version
    prestore(conn, job, workers, a.seed)
    a.start = time.time() + 2.0 + workers / 200   # time for the processes to start and import
    win = window(a)
    per = [workers // a.processes + (1 if i < workers % a.processes else 0) for i in range(a.processes)]
    procs = [subprocess.Popen([PYTHON, "-m", "benchmarks.scale", "--child", "--url", pooled_url, "--job", job,
                               "--workers", str(n), "--seconds", str(a.seconds), "--start", repr(a.start), "--name", f"p{i}",
                               "--seed", str(i),
                               *a.passthrough], cwd=REPO, env=worker_env(url), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for i, n in enumerate(per) if n]
    sampler = Sampler(url, pooled_url, job, win)
    sampler.start()
    server = ServerCpu(conn)
    bouncer = psutil.Process(bouncer_pid)
    time.sleep(max(0.0, a.start - time.time()))
    st_start = bouncer_stats(pooled_url)
    time.sleep(max(0.0, win[0] - time.time()))
    clients = [psutil.Process(p.pid) for p in procs]

    def client_cpu() -> float:
        return sum(sum(c.cpu_times()[:2]) for c in clients)

    w0 = conn.execute(WAL_LSN).fetchone()["lsn"]
    s0, b0, k0, c0, st0 = server(), sum(bouncer.cpu_times()[:2]), client_cpu(), job_counts(conn, job), \
        bouncer_stats(pooled_url)
    time.sleep(max(0.0, win[1] - time.time()))
    s1, b1, k1, c1, st1 = server(), sum(bouncer.cpu_times()[:2]), client_cpu(), job_counts(conn, job), \
        bouncer_stats(pooled_url)
    wal = conn.execute(WAL_SINCE, {"lsn": w0}).fetchone()["bytes"]
    d = {k: st1[k] - st0.get(k, 0.0) for k in st1}
    queries = max(d.get("total_query_count", 0.0), 1.0)
    d_start = {k: st0[k] - st_start.get(k, 0.0) for k in st0}
    queries_start = max(d_start.get("total_query_count", 0.0), 1.0)
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=a.lease + a.seconds + 120)
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        if p.returncode != 0 or not lines:
            raise RuntimeError(f"simulated workers failed (exit {p.returncode}): {err.strip()[-800:]}")
        outs.append(json.loads(lines[-1]))
    sampler.join(10)
    lat = {c: [x for o in outs for x in o["lat"][c]] for c in (*CALLS, *START, *WHOLE)}
    lat["cutoff_poll"] = sampler.poll
    count = {k: sum(o["count"][k] for o in outs) for k in outs[0]["count"]}
    stats = conn.execute("SELECT n_tup_upd, n_tup_hot_upd, n_dead_tup, n_live_tup, autovacuum_count"
                         "  FROM pg_stat_user_tables WHERE relid = 'bi.shards'::regclass").fetchone()
    sizes = conn.execute(PARTITION_BYTES, {"job": job}).fetchone()
    conn.execute(db.q("drop_job_version"), {"job": job})
    conn.execute(f"DROP TABLE {table}")
    rows = c1["stored"] - c0["stored"]
    secs = win[1] - win[0]
    return {
        "workers": workers, "offered_rows_s": rnd(workers * a.rate), "rows_s": rnd(rows / secs),
        "renewals_s": rnd(count["renewals"] / secs),
        "renewals_per_30s": rnd(count["renewals"] / secs * 30),
        "latency_ms": {c: {"n": len(v), "p50": rnd(median(v) * 1e3) if v else None,
                           "p99": rnd(pct(v, 0.99) * 1e3) if v else None} for c, v in lat.items()},
        "pg_cpu_s_per_1000_rows": rnd((s1 - s0) / max(rows, 1) * 1000),
        "pgbouncer_cpu_s_per_1000_rows": rnd((b1 - b0) / max(rows, 1) * 1000),
        "pg_cpu_cores": rnd((s1 - s0) / secs),
        "client_cpu_cores": rnd((k1 - k0) / secs),
        # PgBouncer's own view of the window: the mean time a query ran on a
        # server connection, and the mean time a client waited for one.
        "pgbouncer_mean_query_ms": rnd(d.get("total_query_time", 0.0) / queries / 1e3),
        "pgbouncer_mean_wait_ms": rnd(d.get("total_wait_time", 0.0) / queries / 1e3),
        "pgbouncer_queries_s": rnd(queries / secs),
        # the same from the fleet's start to the window (the first claims and shard reads)
        "start_pgbouncer_mean_query_ms": rnd(d_start.get("total_query_time", 0.0) / queries_start / 1e3),
        "start_pgbouncer_mean_wait_ms": rnd(d_start.get("total_wait_time", 0.0) / queries_start / 1e3),
        # disk: what the window's results wrote to the WAL, and what a stored
        # result and a snapshot row take in their partitions (indexes included)
        "wal_bytes_per_row": rnd(float(wal) / max(rows, 1)),
        "result_bytes_per_row": rnd(sizes["results"] / max(c1["stored"], 1)),
        "snapshot_bytes_per_row": rnd(sizes["snapshot"] / max(c1["records"], 1)),
        "client_connections": 2 * workers,
        "server_connections_max": max(sampler.server_conns, default=0),
        "lock_waits_max": max(sampler.lock_waits, default=0),
        "lock_waits_mean": rnd(sum(sampler.lock_waits) / max(len(sampler.lock_waits), 1)),
        "lock_waits_by_call": sampler.waiting,
        "shards_hot_update_ratio": rnd(stats["n_tup_hot_upd"] / max(stats["n_tup_upd"], 1)),
        "shards_dead_tuples": stats["n_dead_tup"],
        "events": count,
    }


def run(a: argparse.Namespace) -> dict[str, Any]:
    from tests.fixtures.pgbouncer import PgBouncer

    with fresh_server() as url, db.connect(url) as conn:
        for setting in a.pg_setting:   # NAME=VALUE, for the whole server (ALTER SYSTEM, then a reload)
            name, _, value = setting.partition("=")
            conn.execute(psycopg.sql.SQL("ALTER SYSTEM SET {} = {}").format(psycopg.sql.Identifier(name),
                                                                            psycopg.sql.Literal(value)))
            conn.execute("SELECT pg_reload_conf()")
        put_batch = max(1, min(a.flush_every, int(a.rate * a.flush_seconds)))
        ceiling = {str(b): rnd(raw_ceiling(conn, f"ceil_{b}", a.ceiling_records, b)[0]) for b in (1000, put_batch)}
        bouncer = PgBouncer(url, pool_size=a.pool_size, max_client_conn=max(2000, 4 * max(a.workers) + 100))
        try:
            levels = [level(a, url, conn, bouncer.url(url), bouncer.proc.pid, w) for w in a.workers]
        finally:
            bouncer.close()
        version = pg_version(conn)
    top = levels[-1]
    # the window's ledger calls (steady state); the fleet's first claims are reported beside
    p99s = {c: top["latency_ms"][c]["p99"] for c in CALLS if c != "cutoff_poll" and top["latency_ms"][c]["n"]}
    met = (top["rows_s"] >= SEED_ROWS_S and top["renewals_per_30s"] >= RENEWALS_PER_30S
           and all(v < P99_TARGET_MS for v in p99s.values()))
    return {"benchmark": "scale", "workers": a.workers, "seconds": a.seconds, "rate_per_worker": a.rate,
            "shard_size": a.shard_size, "renew_seconds": a.renew, "lease_seconds": a.lease,
            "flush_seconds": a.flush_seconds, "put_batch": put_batch, "processes": a.processes,
            "start_jitter_seconds": a.start_jitter,
            "pg_settings": a.pg_setting,
            "pgbouncer": {"pool_mode": "transaction", "default_pool_size": a.pool_size},
            "ceiling_rows_s_by_batch": ceiling,
            "levels": levels,
            "ratio_to_ceiling": round(top["rows_s"] / ceiling["1000"], 3),
            "first_claims_p99_ms": top["latency_ms"]["claim_at_start"]["p99"],
            "target": (f">= {SEED_ROWS_S} rows/s, >= {RENEWALS_PER_30S} renewals per 30 s and every ledger "
                       f"call's p99 < {P99_TARGET_MS:.0f} ms in the window (steady state) at {top['workers']} workers"),
            "met": met, "postgres": version, "machine": machine()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="50,200,500", help="comma-separated simulated worker counts")
    ap.add_argument("--seconds", type=float, default=60.0, help="the measured window at each level")
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--pool-size", type=int, default=20, help="PgBouncer's default_pool_size")
    ap.add_argument("--ceiling-records", type=int, default=100_000)
    ap.add_argument("--pg-setting", action="append", default=[], metavar="NAME=VALUE",
                    help="a server setting for the run (repeatable), e.g. wal_compression=lz4")
    # what each simulated worker does (passed on to the child processes)
    sim = argparse.ArgumentParser(add_help=False)
    sim.add_argument("--warmup", type=float, default=10.0, help="after the fleet's start")
    sim.add_argument("--start-jitter", type=float, default=FLEET_START_JITTER_SECONDS,
                     help="each worker waits a random 0..S seconds before its first claim (the pod operator's)")
    sim.add_argument("--rate", type=float, default=18.7, help="records/s per worker (the seed's)")
    sim.add_argument("--renew", type=float, default=30.0, help="renew_seconds")
    sim.add_argument("--lease", type=int, default=90, help="lease_seconds")
    sim.add_argument("--shard-size", type=int, default=5000, help="the seed's")
    sim.add_argument("--flush-seconds", type=float, default=WorkerConfig.flush_seconds)   # the worker's
    sim.add_argument("--flush-every", type=int, default=WorkerConfig.flush_every)
    sim.add_argument("--poll", type=float, default=WorkerConfig.poll_seconds,
                     help="poll_seconds when nothing is claimable")
    sim.add_argument("--stalls-per-minute", type=float, default=0.01, help="per worker")
    sim.add_argument("--kills-per-minute", type=float, default=0.01, help="per worker")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    for flag in ("--url", "--job", "--name"):
        ap.add_argument(flag, help=argparse.SUPPRESS)
    ap.add_argument("--start", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    a, rest = ap.parse_known_args(argv)
    s = sim.parse_args(rest)
    for k, v in vars(s).items():
        setattr(a, k, v)
    a.passthrough = [x for k, v in vars(s).items() for x in (f"--{k.replace('_', '-')}", str(v))]
    if a.child:
        a.workers = int(a.workers)
        return child(a)
    a.workers = [int(w) for w in a.workers.split(",")]
    emit(run(a))
    return 0


if __name__ == "__main__":
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())

"""Control-plane throughput: how fast can the ledger and the result writes go
when the model costs nothing?

W worker processes (``python -m gpu_runner JOB --no-wait``, exactly the
container's entrypoint) run the noop engine over shards of 5,000 records on a
fresh embedded PostgreSQL. The rate is records / (last ``done_at`` - first
``first_claim_at``), so process start-up and imports are not counted; lease
renewals, record reads, schema checks, fenced put-if-absent writes and shard
completions are.

Beside it, in the same run, the raw ceiling: one connection inserting the same
number of rows, with the same ~280-byte jsonb payload, into a partitioned
table shaped like ``bi.results``, with ``INSERT ... SELECT FROM unnest ... ON
CONFLICT DO NOTHING`` in batches the size of the worker's flush. Each column
goes as one text split in the server (``string_to_array``), as the worker's
puts go (``Ledger.put_results``): text-format arrays cost the client ~18 us per
row in psycopg's quoting, binary ones about 1 us (its list dumper runs Python
per element), and a ceiling should use the cheapest encoding.
Ceiling and pipeline alternate within each repeat so both see the same load.

With W > 1 workers, also ``raw_writers``: W processes, each with its own
connection, putting disjoint parts of the same rows into one partition the
same way at the same time (records / (last end - first start), the pipeline's
clock), and ``ratio_vs_writers``, the pipeline against as many raw writers as
it has workers. On a faster CPU the single connection and the W writers speed
up together with the server; a fixed cost in the workers shows there.

Also in the same run: ``ledger_put``, one connection writing a whole job
through ``Ledger.put_results`` (the database side of the control plane with no
worker around it), and CPU per record of every arm, which the machine's load
moves far less than wall time.

With ``--components``, also ``put_components``: the put's server CPU taken apart beside the raw
insert's on one backend (the 8-way hash partitions of a job's results, the snapshot read, the guards).

    python -m benchmarks.control_plane [--records N] [--workers W] [--flush 200,1000] [--repeats R] [--components]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import resource
import subprocess
import time
from typing import Any

import psycopg

from batch_inference import db
from batch_inference.engines.noop import minimal_instance
from batch_inference.ledger import PUT_SEPARATOR, Ledger
from batch_inference.plan import submit
from benchmarks.common import (BENCH_SCHEMA, PYTHON, REPO, ServerCpu, bench_spec, cpu_name, emit, fresh_server,
                               machine, make_tickets, median, pg_version, rnd, self_cpu, worker_env)
from gpu_runner.worker import WorkerConfig

TARGET = 0.80  # pipeline rate / raw ceiling

RAW_TABLE = """
CREATE TABLE IF NOT EXISTS public.raw_results (
    job_version text NOT NULL, record_id text NOT NULL, output jsonb NOT NULL, category text,
    model_name text NOT NULL, model_digest text NOT NULL, prompt_version text NOT NULL,
    transport text NOT NULL, engine text, endpoint text, worker_id text, epoch bigint, acl text[], content_hash text,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (job_version, record_id)
) PARTITION BY LIST (job_version)
"""

RAW_INSERT = """
INSERT INTO public.raw_results (job_version, record_id, output, category, model_name, model_digest,
                                prompt_version, transport, engine, endpoint, worker_id, epoch, acl, content_hash)
SELECT %(job)s, u.id, u.output, u.category, 'noop', %(digest)s, 'v1', 'batch', 'noop', 'local', 'raw', 1,
       ARRAY['team0'], md5(u.id)
  FROM unnest(string_to_array(%(ids)s::text, E'\\x1e'), string_to_array(%(outputs)s::text, E'\\x1e')::jsonb[],
              string_to_array(%(categories)s::text, E'\\x1e')) AS u(id, output, category)
ON CONFLICT (job_version, record_id) DO NOTHING
"""


# The put's own snapshot read: the ACL and content hash every result carries, from the rows of the
# shard's snapshot (bi.put_results_v3 joins them the same way: one key scan with all of the call's ids).
RAW_INSERT_JOINED = """
INSERT INTO public.raw_results (job_version, record_id, output, category, model_name, model_digest,
                                prompt_version, transport, engine, endpoint, worker_id, epoch, acl, content_hash)
SELECT %(job)s, u.id, u.output, u.category, 'noop', %(digest)s, 'v1', 'batch', 'noop', 'local', 'raw', 1,
       sr.acl, sr.content_hash
  FROM unnest(string_to_array(%(ids)s::text, E'\\x1e'), string_to_array(%(outputs)s::text, E'\\x1e')::jsonb[],
              string_to_array(%(categories)s::text, E'\\x1e')) AS u(id, output, category)
  JOIN bi.snapshot_rows sr ON sr.record_id = u.id
 WHERE sr.job_version = %(snapshot)s AND sr.record_id = ANY (string_to_array(%(ids)s::text, E'\\x1e'))
ON CONFLICT (job_version, record_id) DO NOTHING
"""


def _columns(ids: list[str], payload: str) -> dict[str, str]:
    """A batch's three columns as the put sends them: each one text joined at ``PUT_SEPARATOR``."""
    return {"ids": PUT_SEPARATOR.join(ids), "outputs": PUT_SEPARATOR.join([payload] * len(ids)),
            "categories": PUT_SEPARATOR.join(["billing"] * len(ids))}


def raw_ceiling(conn: psycopg.Connection, run: str, records: int, batch: int) -> tuple[float, float, float]:
    """(rows/s, server CPU s per row, client CPU s per row) of one connection putting ``records``
    new rows, ``batch`` per statement (autocommit: one transaction per batch, as the worker's flushes)."""
    conn.execute(RAW_TABLE)
    part = f"raw_results_{run}"
    conn.execute(f"CREATE TABLE {part} PARTITION OF public.raw_results FOR VALUES IN ('{run}')")
    # The same text the worker sends: json.dumps of the parsed noop answer.
    payload = json.dumps(minimal_instance(BENCH_SCHEMA), ensure_ascii=False)
    ids = [f"t{i:09d}" for i in range(1, records + 1)]
    server = ServerCpu(conn)
    s0, c0 = server(), self_cpu()
    t0 = time.perf_counter()
    for s in range(0, records, batch):
        chunk = ids[s:s + batch]
        conn.execute(RAW_INSERT, {"job": run, "digest": "0" * 64, **_columns(chunk, payload)})
    elapsed = time.perf_counter() - t0
    server_s, client_s = server() - s0, self_cpu() - c0
    n = conn.execute(f"SELECT count(*) AS n FROM {part}").fetchone()["n"]  # type: ignore[index]
    assert n == records, (n, records)
    conn.execute(f"DROP TABLE {part}")
    return records / elapsed, server_s / records, client_s / records


def _raw_writer(url: str, run: str, ids: list[str], batch: int, start: Any) -> tuple[float, float]:
    """One of ``raw_writers``' processes: (start, end) wall clock of putting ``ids``."""
    payload = json.dumps(minimal_instance(BENCH_SCHEMA), ensure_ascii=False)
    with db.connect(url) as conn:
        start.wait()
        t0 = time.time()
        for s in range(0, len(ids), batch):
            chunk = ids[s:s + batch]
            conn.execute(RAW_INSERT, {"job": run, "digest": "0" * 64, **_columns(chunk, payload)})
        return t0, time.time()


def raw_writers(url: str, conn: psycopg.Connection, run: str, records: int, batch: int, writers: int) -> float:
    """Rows/s of ``writers`` processes, each with its own connection, putting disjoint parts of
    ``records`` new rows into one partition at once, ``batch`` per statement: the ceiling of as many
    raw writers as the pipeline has workers."""
    conn.execute(RAW_TABLE)
    part = f"raw_results_{run}_w"
    conn.execute(f"CREATE TABLE {part} PARTITION OF public.raw_results FOR VALUES IN ('{run}_w')")
    ids = [f"t{i:09d}" for i in range(1, records + 1)]
    ctx = multiprocessing.get_context("fork")
    start = ctx.Manager().Barrier(writers)
    with concurrent.futures.ProcessPoolExecutor(writers, mp_context=ctx) as pool:
        spans = list(pool.map(_raw_writer, [url] * writers, [f"{run}_w"] * writers,
                              [ids[i::writers] for i in range(writers)], [batch] * writers, [start] * writers))
    elapsed = max(e for _, e in spans) - min(b for b, _ in spans)
    n = conn.execute(f"SELECT count(*) AS n FROM {part}").fetchone()["n"]  # type: ignore[index]
    assert n == records, (n, records)
    conn.execute(f"DROP TABLE {part}")
    return records / elapsed


def ledger_put(conn: psycopg.Connection, run: str, records: int, shard_size: int, batch: int) -> tuple[float, float]:
    """Rows/s of one connection writing a whole job through ``Ledger.put_results`` (claim, puts of
    ``batch`` rows, complete, shard after shard) with no worker around it: the database side of the
    control plane alone, comparable with the raw ceiling on the same single connection."""
    spec = bench_spec(shard_size=shard_size, prompt={"version": f"put_{run}", "system": "Classify the support ticket."})
    job = submit(conn, spec).job_version
    # JSON text, as the worker sends it (check_for_storage keeps the engine's text): the arm is the
    # database side, so no json.dumps per record in it.
    answer = json.dumps(minimal_instance(BENCH_SCHEMA), ensure_ascii=False)
    ledger = Ledger(conn, job, f"bench-{run}")
    server = ServerCpu(conn)
    s0 = server()
    t0 = time.perf_counter()
    written = 0
    while (lease := ledger.claim()) is not None:
        ids = ledger.record_columns(lease)[0]   # the worker's read (ids, texts, attempts, crashes)
        for s in range(0, len(ids), batch):
            chunk = ids[s:s + batch]
            written += ledger.put_results(lease, chunk, [answer] * len(chunk), ["billing"] * len(chunk))
        assert ledger.complete(lease) == "done"
    elapsed = time.perf_counter() - t0
    server_s = server() - s0
    assert written == records, (written, records)
    conn.execute("SELECT bi.drop_job_version_v1(%s)", (job,))
    return records / elapsed, server_s / records


def put_components(conn: psycopg.Connection, run: str, records: int, shard_size: int, batch: int
                   ) -> dict[str, float]:
    """Where the put's server CPU goes beside the raw insert's: CPU of this connection's backend alone
    (so neither the machine's other work nor the server's background processes count), us per row,
    ``batch`` rows a statement, each arm on a new partition, in one run:

    * ``raw``: the raw ceiling's insert;
    * ``raw_hash8``: the same into a partition hash-partitioned by record id into 8, as a job's results are;
    * ``raw_snapshot``: the raw insert reading each row's ACL and content hash from a job's snapshot;
    * ``raw_hash8_snapshot``: both;
    * ``put``: ``Ledger.put_results`` over a whole job (its calls alone timed: the fence, the shard's
      counters and the category stripes on top of the last arm);
    * ``read``: the worker's shard read of the same job (``Ledger.record_columns``, its pages alone timed).
    """
    import psutil

    backend = psutil.Process(conn.info.backend_pid)

    def cpu() -> float:
        return sum(backend.cpu_times()[:2])

    spec = bench_spec(shard_size=shard_size, prompt={"version": f"parts_{run}", "system": "Classify the support ticket."})
    job = submit(conn, spec).job_version
    payload = json.dumps(minimal_instance(BENCH_SCHEMA), ensure_ascii=False)
    ids = [f"t{i:09d}" for i in range(1, records + 1)]
    conn.execute(RAW_TABLE)
    out: dict[str, float] = {}
    for name, hashed, statement in (("raw", False, RAW_INSERT), ("raw_hash8", True, RAW_INSERT),
                                    ("raw_snapshot", False, RAW_INSERT_JOINED),
                                    ("raw_hash8_snapshot", True, RAW_INSERT_JOINED)):
        part = f"raw_results_{run}_{name}"
        conn.execute(f"CREATE TABLE {part} PARTITION OF public.raw_results FOR VALUES IN ('{part}')"
                     + (" PARTITION BY HASH (record_id)" if hashed else ""))
        for i in range(8 if hashed else 0):
            conn.execute(f"CREATE TABLE {part}_{i} PARTITION OF {part} FOR VALUES WITH (MODULUS 8, REMAINDER {i})")
        conn.execute("CHECKPOINT")
        c0 = cpu()
        for s in range(0, records, batch):
            chunk = ids[s:s + batch]
            conn.execute(statement, {"job": part, "snapshot": job, "digest": "0" * 64, **_columns(chunk, payload)})
        out[name] = (cpu() - c0) / records
        conn.execute(f"DROP TABLE {part}")
    ledger = Ledger(conn, job, f"bench-{run}")
    conn.execute("CHECKPOINT")
    put_s = read_s = 0.0
    while (lease := ledger.claim()) is not None:
        c0 = cpu()
        rids = ledger.record_columns(lease)[0]
        read_s += cpu() - c0
        for s in range(0, len(rids), batch):
            chunk = rids[s:s + batch]
            c0 = cpu()
            ledger.put_results(lease, chunk, [payload] * len(chunk), ["billing"] * len(chunk))
            put_s += cpu() - c0
        assert ledger.complete(lease) == "done"
    out["put"] = put_s / records
    out["read"] = read_s / records
    conn.execute("SELECT bi.drop_job_version_v1(%s)", (job,))
    return out


def startup_cpu(url: str, job: str) -> float:
    """CPU seconds of a worker that starts, loads the engine and leaves without
    claiming (interpreter, imports, spec, connection): subtracted from the
    pipeline's worker CPU so per-record figures do not depend on the job size."""
    runs = []
    for _ in range(3):
        proc = subprocess.Popen([PYTHON, "-m", "gpu_runner", job, "--no-wait", "--max-shards", "0"], cwd=REPO,
                                env=worker_env(url), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        assert proc.returncode == 0, proc.returncode
        runs.append(usage.ru_utime + usage.ru_stime)
    return median(runs)


def pipeline(url: str, conn: psycopg.Connection, run: str, records: int, shard_size: int, workers: int,
             flush_every: int) -> dict[str, Any]:
    # A distinct prompt version per run gives a distinct job version over the same rows.
    spec = bench_spec(shard_size=shard_size, prompt={"version": run, "system": "Classify the support ticket."})
    job = submit(conn, spec).job_version
    server = ServerCpu(conn)
    s0 = server()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    procs = [subprocess.Popen([PYTHON, "-m", "gpu_runner", job, "--no-wait", "--flush-every", str(flush_every)],
                              cwd=REPO, env=worker_env(url), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True) for _ in range(workers)]
    errors = []
    for p in procs:
        _, err = p.communicate(timeout=3600)
        if p.returncode != 0:
            errors.append(err[-2000:])
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    server_s = server() - s0
    if errors:
        raise RuntimeError(f"worker failed: {errors[0]}")
    r = conn.execute("""SELECT sum(stored) AS stored, count(*) FILTER (WHERE state = 'done') AS done, count(*) AS shards,
                               extract(epoch FROM max(done_at) - min(first_claim_at)) AS seconds
                          FROM bi.shards WHERE job_version = %s""", (job,)).fetchone()
    assert r is not None and r["stored"] == records and r["done"] == r["shards"], r
    seconds = float(r["seconds"])
    return {"job": job, "rate": records / seconds, "seconds": seconds, "server_cpu_s": server_s,
            "worker_cpu_s": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)}


def run(records: int = 100_000, shard_size: int = 5000, workers: int = 2, flush: tuple[int, ...] = (200, 1000),
        repeats: int = 3, patches: tuple[str, ...] = (), components: bool = False) -> dict[str, Any]:
    with fresh_server() as url, db.connect(url) as conn:
        for path in patches:  # a prototype of a core change, applied over the migrated schema
            conn.execute((REPO / path).read_text() if not path.startswith("/") else open(path).read())
        make_tickets(conn, records)
        per_flush: dict[int, dict[str, list[float]]] = {f: {"ceiling": [], "pipeline": [], "ratio": [], "cpu": [],
                                                          "ledger": [], "ledger_ratio": [],
                                                          "server_cpu": [], "ceiling_cpu": [], "cpu_ratio": [],
                                                          "raw_server": [], "put_server": [], "server_ratio": [],
                                                          "writers": [], "writers_ratio": []}
                                                       for f in flush}
        start_cpu: float | None = None
        judged = WorkerConfig.flush_every if WorkerConfig.flush_every in flush else flush[0]
        parts: dict[str, list[float]] = {}
        for rep in range(repeats):
            for f in flush:
                run_id = f"r{rep}_f{f}"
                if components and f == judged:
                    for k, v in put_components(conn, run_id, records, shard_size, f).items():
                        parts.setdefault(k, []).append(v)
                ceiling, raw_server, raw_client = raw_ceiling(conn, run_id, records, f)
                ceiling_cpu = raw_server + raw_client
                put, put_server = ledger_put(conn, run_id, records, shard_size, f)
                p = pipeline(url, conn, run_id, records, shard_size, workers, f)
                if workers > 1:
                    writers = raw_writers(url, conn, run_id, records, f, workers)
                    per_flush[f]["writers"].append(writers)
                    per_flush[f]["writers_ratio"].append(p["rate"] / writers)
                if start_cpu is None:
                    start_cpu = startup_cpu(url, p["job"])
                # Clamped: at --quick sizes start-up is most of a worker's CPU, and the
                # clock's 10 ms resolution can put the difference below zero.
                p["worker_cpu_s"] = max(p["worker_cpu_s"] - workers * start_cpu, 0.0)
                d = per_flush[f]
                d["ledger"].append(put)
                d["ledger_ratio"].append(put / ceiling)
                d["ceiling"].append(ceiling)
                d["pipeline"].append(p["rate"])
                d["ratio"].append(p["rate"] / ceiling)
                d["cpu"].append(p["worker_cpu_s"])
                d["server_cpu"].append(p["server_cpu_s"])
                d["ceiling_cpu"].append(ceiling_cpu)
                d["raw_server"].append(raw_server)
                d["put_server"].append(put_server)
                d["server_ratio"].append(raw_server / max(p["server_cpu_s"] / records, 1e-9))
                d["cpu_ratio"].append(ceiling_cpu / max((p["worker_cpu_s"] + p["server_cpu_s"]) / records, 1e-9))
        version = pg_version(conn)
    results = {
        str(f): {"raw_ceiling_rows_s": rnd(median(d["ceiling"])), "pipeline_records_s": rnd(median(d["pipeline"])),
                 "ratio": round(median(d["ratio"]), 3),
                 "ledger_put_rows_s": rnd(median(d["ledger"])), "ledger_ratio": round(median(d["ledger_ratio"]), 3),
                 # CPU per record (all processes), which the machine's load moves far
                 # less than wall time: raw = client + server of the one-connection
                 # baseline; pipeline = workers (start-up subtracted) + server.
                 "raw_cpu_us_per_row": rnd(median(d["ceiling_cpu"]) * 1e6),
                 "raw_server_cpu_us_per_row": rnd(median(d["raw_server"]) * 1e6),
                 "ledger_put_server_cpu_us_per_row": rnd(median(d["put_server"]) * 1e6),
                 "worker_cpu_us_per_record": rnd(median(d["cpu"]) / records * 1e6),
                 "server_cpu_us_per_record": rnd(median(d["server_cpu"]) / records * 1e6),
                 "cpu_ratio": round(median(d["cpu_ratio"]), 3),
                 # The database's share alone: how many records/s one PostgreSQL absorbs from
                 # the pipeline relative to raw inserts, once workers run on their own machines.
                 "server_cpu_ratio": round(median(d["server_ratio"]), 3),
                 **({"raw_writers_rows_s": rnd(median(d["writers"])),
                     "ratio_vs_writers": round(median(d["writers_ratio"]), 3)} if d["writers"] else {})}
        for f, d in per_flush.items()}
    # Judged at the flush size workers use unless told otherwise.
    default = results[str(judged)]
    return {"benchmark": "control_plane", "records": records, "shard_size": shard_size, "workers": workers,
            "repeats": repeats, "flush_every": list(flush), "judged_flush": judged, "by_flush": results,
            "worker_startup_cpu_s": rnd(start_cpu or 0.0),
            "ratio": default["ratio"], "ratio_vs_writers": default.get("ratio_vs_writers"),
            "ledger_ratio": default["ledger_ratio"], "cpu": cpu_name(),
            "target": f">= {TARGET} (against one connection and against as many raw writers as workers)",
            "met": default["ratio"] >= TARGET and default.get("ratio_vs_writers", TARGET) >= TARGET,
            "patches": list(patches),
            **({"put_components_backend_cpu_us_per_row": {k: rnd(median(v) * 1e6) for k, v in parts.items()}}
               if parts else {}),
            "postgres": version, "machine": machine()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--shard-size", type=int, default=5000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--flush", default="200,1000", help="comma-separated flush sizes; judged at the worker's default (1000) if listed, else the first")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--patch", action="append", default=[],
                    help="SQL file applied after the migrations (a prototype of a core fix, e.g. "
                         "a CREATE OR REPLACE FUNCTION of bi.put_results_v3)")
    ap.add_argument("--components", action="store_true",
                    help="also time the put's parts beside the raw insert on one backend's CPU (put_components), "
                         "at the judged flush size")
    a = ap.parse_args(argv)
    emit(run(a.records, a.shard_size, a.workers, tuple(int(x) for x in a.flush.split(",")), a.repeats,
             tuple(a.patch), a.components))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
